#!/usr/bin/env bash
# Device call (H100, ~9 min): outputs in pinned host memory (jit host_outputs, session 10)
# against device outputs (host_outputs=False, the default before), side by side:
#  1. issue 19's e2e MoE encoder (grouped, dense; each also with device outputs; interleaved
#     per request in one process);
#  2. issue 18's BERT-base serving protocol, fp32, each mode a fresh process: torch eager,
#     dynjax cold with the start-up warmup, the same with device outputs, their restarts, and
#     the per-length row (dynjax_full_trust vs dynjax_full_trust_devout in one process).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/e2e"
python3 -c "import jax, torch, flax; print('jax', jax.__version__, 'torch', torch.__version__, 'flax', flax.__version__, jax.devices())" | tee "$OUT/versions.txt"
timeout 200 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e" --parts e2e --e2e-requests 200 \
  --budget 180 --e2e-variants grouped,dense --e2e-device-outputs > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"; grep -E "no MoE|dynjax|dense|interleaved" "$OUT/e2e.log" | cut -c1-200
MODES=${MODES-torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_devout,dynjax_auto16_warm_restart,dynjax_auto16_warm_devout_restart,lengths}
timeout "${T32:-360}" python3 -m benchmarks.serve_fresh --out "$OUT" --modes "$MODES" \
  --timeout 150 --lengths "${L32:-37,141,300,450}" --reps 20 > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
grep -A30 "^| mode" "$OUT/fp32.log"; grep "ERROR\|error" "$OUT/fp32.log" | cut -c1-300
rm -f "$OUT"/*/*.py
