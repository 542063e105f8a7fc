#!/usr/bin/env bash
# Device call (H100), session 4: a wider Mosaic GPU tiling sweep for the MoE GEMMs with the
# layer timed at the sweep's best tiling beside the auto choice and the capacity layer
# (issue 19), then the GPU `make demo` table (issue 18 goal 6; the device has no network, so
# the demo's own command runs on the jax installed there instead of `make demo`'s set-up).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, jax, torch, flax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'torch', torch.__version__, 'flax', flax.__version__)"
} > "$OUT/versions.txt" 2>&1
timeout "${TMOE:-300}" python3 benchmarks/bench_moe_kernels.py --out "$OUT/moe" --parts env,sweep,layer \
  --mgpu "${MGPU:-128x64x128x4x4g4,128x64x128x4x4g8,128x64x128x4x5g4,192x64x128x4x4g4,128x64x64x4x6g8,192x64x128x4x5g8,64x64x128x4x4g4}" \
  --triton "" --sweep-settings uniform8 --settings uniform8,uniform64 --k 1 \
  --layer-kernels mgpu --mgpu-layer "best,64x64x128x4x4g4" --train "" --budget "${BMOE:-240}" \
  > "$OUT/moe.log" 2>&1
echo "moe rc=$?"
grep -E "ms  \(min|FAILED|==" "$OUT/moe.log" | cut -c1-200
DEMO=$(sed -n 's/^DEMO_ARGS := \(--size base.*\)\\$/\1/p' Makefile)
DEMO2=$(sed -n '/^DEMO_ARGS := --size base/{n;s/^\t//;p}' Makefile)
echo "demo: python3 -m benchmarks bert $DEMO $DEMO2"
timeout "${TDEMO:-260}" python3 -m benchmarks bert $DEMO $DEMO2 --out "$OUT" > "$OUT/demo.log" 2>&1
echo "demo rc=$?"
tail -30 "$OUT/demo.log"
