#!/usr/bin/env bash
# Device call: issue 18's tables on the H100 (BERT-base, 1,000 docstring requests of batch 8,
# each mode in a fresh process; benchmarks/serve_fresh.py), fp32 then bf16, in one call.
#   FP32=... BF16=... bash benchmarks/gpu_run_issue18.sh         (JSON + logs under $OUT)
# FP32= or BF16= (empty) skips that half.  T32/T16: each half's time limit (s); TO: each
# mode's (s; a `*wait` mode's tier-up took 106 s and once over 150); L32/L16: the exact
# lengths of the `lengths` mode.  `*warm*`: the server warms up from shapes at start-up.  The defaults fit one call
# (~9 min on the H100 with the machine's start) only half at a time: run FP32= then BF16=.
# SF_ARGS: more serve_fresh flags (e.g. --pristine-restarts: each restart on a copy of the cold cache).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
FP32=${FP32-torch_eager,hand_warm,hand_warm_restart,dynjax_auto16_warm_wait,dynjax_auto16_warm_wait_restart,lengths}
BF16=${BF16-torch_eager,hand_warm,hand_warm_restart,dynjax_cudnn_auto16_warm_wait,dynjax_cudnn_auto16_warm_wait_restart,lengths}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, jax, torch, flax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'torch', torch.__version__, 'flax', flax.__version__)"
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
if [ -n "$FP32" ]; then
  timeout "${T32:-540}" python3 -m benchmarks.serve_fresh --out "$OUT" --modes "$FP32" \
    --timeout "${TO:-200}" --lengths "${L32:-37,141,300,450}" --reps 20 ${SF_ARGS:-} > "$OUT/fp32.log" 2>&1
  echo "fp32 rc=$?"
fi
if [ -n "$BF16" ]; then
  timeout "${T16:-540}" python3 -m benchmarks.serve_fresh --out "$OUT" --dtype bfloat16 \
    --modes "$BF16" --timeout "${TO:-200}" --lengths "${L16:-37,141,300,450}" --reps 20 ${SF_ARGS:-} \
    > "$OUT/bf16.log" 2>&1
  echo "bf16 rc=$?"
fi
for f in fp32 bf16; do grep -A40 "^| mode" "$OUT/$f.log" 2>/dev/null; grep "ERROR" "$OUT/$f.log" | cut -c1-400; done
