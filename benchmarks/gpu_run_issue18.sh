#!/usr/bin/env bash
# Device call: issue 18's tables on the H100 (BERT-base, 1,000 docstring requests of batch 8,
# each mode in a fresh process; benchmarks/serve_fresh.py), fp32 then bf16, in one call.
#   FP32=... BF16=... bash benchmarks/gpu_run_issue18.sh         (JSON + logs under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
FP32=${FP32:-torch_eager,hand,hand_restart,dynjax_pow2,dynjax_pow2_restart,dynjax_trust_auto,dynjax_trust_auto_restart,dynjax_trust_auto_wait,dynjax_trust_auto_wait_restart,lengths}
BF16=${BF16:-torch_eager,dynjax_trust_auto,dynjax_trust_auto_restart,dynjax_cudnn_auto,dynjax_cudnn_auto_restart,lengths}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, jax, torch, flax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'torch', torch.__version__, 'flax', flax.__version__)"
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
timeout "${T32:-360}" python3 -m benchmarks.serve_fresh --out "$OUT" --modes "$FP32" --timeout 110 --reps 20 \
  > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
[ -n "$BF16" ] && timeout "${T16:-190}" python3 -m benchmarks.serve_fresh --out "$OUT" \
  --dtype bfloat16 --modes "$BF16" --timeout 110 --lengths 141,450 --reps 20 > "$OUT/bf16.log" 2>&1
echo "bf16 rc=$?"
for f in fp32 bf16; do grep -A40 "^| mode" "$OUT/$f.log" 2>/dev/null; grep "ERROR" "$OUT/$f.log" | cut -c1-400; done
