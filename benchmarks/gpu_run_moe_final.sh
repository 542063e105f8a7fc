#!/usr/bin/env bash
# Device call (H100, ~8 min): issue 19's figures with the "hopper" kernel as the grouped layer's
# auto choice: the gradient check of the kernel (its backward through JAX's Mosaic GPU ragged
# dots), the layer side by side (auto=hopper at the auto tiling and at 128/64-row tiles, mgpu,
# the capacity-1.25 dropping layer; uniform/Zipf 8 experts, uniform 64; k=1, 2; a training
# step), then end to end: the one-layer MoE encoder (k=2) under dynjax.flax.jit on 200 batch-8
# docstring requests, grouped (auto; and mgpu) against lax.ragged_dot and dense, cold start
# included.  Run 6 (this session's last): SETTINGS=uniform8,uniform64 LK= HL= (the layer at
# the auto choice beside the dropping layer only).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe" "$OUT/e2e"
timeout "${TL:-330}" python3 benchmarks/bench_moe_kernels.py --out "$OUT/moe" \
  --parts env,check,layer --check-kernels hopper --settings "${SETTINGS:-uniform8,zipf8,uniform64}" \
  --k 1,2 --layer-kernels "${LK:-mgpu}" --hopper-layer "${HL:-128x64x128x4x4g8,64x64x128x4x4g8}" \
  --train "${TRAIN:-uniform8}" --budget "${BL:-290}" > "$OUT/moe.log" 2>&1
echo "layer rc=$?"
grep -E "ms  \(min|FAILED|==|rel_err|error" "$OUT/moe.log" | cut -c1-200
timeout "${TE:-230}" python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e" --parts e2e \
  --e2e-variants "${E2E:-grouped,grouped-mgpu,ragged_dot,dense}" --e2e-requests 200 --budget 200 \
  > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"
grep -E "e2e|train|warm-up|FAILED" "$OUT/e2e.log" | cut -c1-200
rm -f "$OUT"/moe/*.py
