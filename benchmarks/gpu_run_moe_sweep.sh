#!/usr/bin/env bash
# Device call (H100, ~3.5 min): a Mosaic GPU tiling sweep of the MoE FFN's two grouped GEMMs
# (8 experts, uniform, 8,192 rows; tilings from JAX's own ragged_dot_mgpu sweep family:
# block_k 64, block_m/block_n powers of two, 2-6 copies in flight, grid_block_n 4-8), then the
# layer at the sweep's fastest tiling beside the auto choice and the capacity layer (issue 19).
# Session 4's run: benchmarks/results/bench_moe_kernels_run3_sweep_h100.json.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe"
timeout "${TMOE:-280}" python3 benchmarks/bench_moe_kernels.py --out "$OUT/moe" --parts env,sweep,layer \
  --mgpu "${MGPU:-128x64x128x4x4g4,128x64x128x4x4g8,128x64x128x4x5g4,128x64x64x4x6g8,128x64x128x4x2g4,64x64x128x4x5g8}" \
  --triton "" --sweep-settings uniform8 --settings "${SETTINGS:-uniform8,uniform64}" --k 1,2 \
  --layer-kernels mgpu --mgpu-layer best --train "" --budget "${BMOE:-230}" > "$OUT/moe.log" 2>&1
echo "moe rc=$?"
grep -E "ms  \(min|FAILED|==" "$OUT/moe.log" | cut -c1-200
