#!/usr/bin/env bash
# Device call (H100, ~8 min): the "hopper" grouped GEMM (a warp-specialized Mosaic GPU kernel on
# tile-aligned groups, dynjax/route/_hopper.py) checked against float32 references (forward,
# fused GELU, gradients, the grouped layer k=1/2), its tilings swept beside JAX's Mosaic GPU
# ragged dot (the "mgpu" backend) on the FFN's two GEMMs, then the layer side by side with the
# auto choice, mgpu and the capacity-1.25 (dropping) layer, k=1 and 2, and a training step
# (issue 19).  JSON under $OUT/moe.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe"
timeout "${TMOE:-570}" python3 benchmarks/bench_moe_kernels.py --out "$OUT/moe" \
  --parts env,check,sweep,layer --mgpu "${MGPU:-128x64x128x4x4g4}" \
  --hopper "${HOPPER:-128x64x128x4x4g8,128x64x64x4x4g8,128x64x128x4x5g8,128x64x128x4x4g1}" \
  --triton "" --sweep-settings uniform8 --settings "${SETTINGS:-uniform8,zipf8,uniform64}" \
  --k 1,2 --layer-kernels mgpu,hopper --hopper-layer best --train "${TRAIN:-uniform8}" \
  --budget "${BMOE:-470}" > "$OUT/moe.log" 2>&1
echo "moe rc=$?"
grep -E "ms  \(min|FAILED|==|rel_err|error" "$OUT/moe.log" | cut -c1-220
rm -f "$OUT"/moe/*.py
