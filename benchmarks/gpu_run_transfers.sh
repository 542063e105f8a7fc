#!/usr/bin/env bash
# Device call (H100, ~5 min): what a numpy request's transfers cost (probe_transfers.py at
# t=128 and 512), then issue 19's e2e with the grouped layer on the auto kernel (hopper) and
# on the Triton kernel side by side with dense (interleaved).  JSON under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__, jax.devices())"
for t in 128 512; do python3 benchmarks/probe_transfers.py --out "$OUT" --t $t; done
mkdir -p "$OUT/e2e"
timeout 300 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e" --parts e2e --e2e-requests 200 \
  --budget 250 --e2e-variants grouped,grouped-pallas,dense "$@" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"; grep -E "e2e|warm-up|no MoE|FAILED|Error|interleaved|  (dynjax|dense|no MoE|lax)" "$OUT/e2e.log" | cut -c1-220
rm -f "$OUT"/*/*.py
