#!/usr/bin/env bash
# Device call (H100, ~6 min): issue 19's cold start.  The hopper kernel checked (forward, fused
# GELU, backward, the layer's gradients; the kernel now comes from jax.export), the layer side
# by side at 8 and 64 experts (x4 timing), then the e2e MoE encoder in separate processes:
# this tree (grouped, ragged_dot, dense), this tree with the kernel lowered in every executable
# (--no-kernel-export), and, where OLD names a directory holding another tree's dynjax/, that
# tree's grouped layer (the cold start before).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe" "$OUT/e2e" "$OUT/e2e_noexport" "$OUT/e2e_old"
E2E_ARGS="--parts e2e --e2e-requests 200 --budget 200"
if [ -n "${LAYER-1}" ]; then
  PYTHONPATH=$PWD timeout "${TL:-200}" python3 benchmarks/bench_moe_kernels.py --out "$OUT/moe" \
    --parts env,check,layer --check-kernels hopper --settings "${SETTINGS:-uniform8,uniform64}" \
    --k 1,2 --layer-kernels hopper --hopper-layer "" --layer-timing x4 --train uniform8 \
    --budget "${BL:-170}" > "$OUT/moe.log" 2>&1
  echo "layer rc=$?"
  grep -E "ms  \(min|FAILED|==|rel_err|error" "$OUT/moe.log" | cut -c1-200
fi
PYTHONPATH=$PWD timeout 150 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e" $E2E_ARGS \
  --e2e-variants "${E2E:-grouped,ragged_dot,dense}" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"; grep -E "e2e|train|warm-up|no MoE|FAILED" "$OUT/e2e.log" | cut -c1-200
PYTHONPATH=$PWD timeout 100 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e_noexport" \
  $E2E_ARGS --e2e-variants grouped --no-kernel-export > "$OUT/e2e_noexport.log" 2>&1
echo "e2e no-export rc=$?"; grep -E "e2e|FAILED" "$OUT/e2e_noexport.log" | cut -c1-200
if [ -n "${OLD:-}" ]; then
  PYTHONPATH=$PWD/$OLD:$PWD timeout 100 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e_old" \
    $E2E_ARGS --e2e-variants grouped > "$OUT/e2e_old.log" 2>&1
  echo "e2e old rc=$?"; grep -E "e2e|FAILED" "$OUT/e2e_old.log" | cut -c1-200
fi
rm -f "$OUT"/moe/*.py "$OUT"/e2e*/*.py
