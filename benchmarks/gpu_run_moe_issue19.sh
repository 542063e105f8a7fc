#!/usr/bin/env bash
# Device call (H100, ~9 min): issue 19's table.  The layer side by side (grouped at the auto
# kernel, the capacity-1.25 dropping layer, and one dense FFN of the same FLOPs through cuBLAS
# with no routing: the floor a grouped layer cannot beat), uniform/Zipf 8 experts and uniform
# 64, k=1 and 2, four layers in one executable (x4 timing); then the e2e MoE encoder twice, in
# two processes with the variants in opposite orders (grouped, ragged_dot, dense; then dense,
# ragged_dot, grouped), cold starts included.  PARTS (env,layer; add check for the kernels'
# numbers), SETTINGS, S64 (64-expert settings without the capacity layer, k=1), E2E=0 (no e2e).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe" "$OUT/e2e_a" "$OUT/e2e_b"
timeout "${TL:-270}" python3 benchmarks/bench_moe_kernels.py --out "$OUT/moe" \
  --parts "${PARTS:-env,layer}" --settings "${SETTINGS:-uniform8,zipf8,uniform64}" --k 1,2 \
  --layer-kernels hopper --hopper-layer "" --layer-extra ffn --layer-timing x4 --train none \
  --check-kernels hopper --budget "${BL:-240}" > "$OUT/moe.log" 2>&1
echo "layer rc=$?"
grep -E "ms  \(min|FAILED|==|error|rel_err" "$OUT/moe.log" | cut -c1-200
if [ -n "${S64:-}" ]; then  # 64-expert settings without the capacity layer (its x4 build: >60 s)
  mkdir -p "$OUT/moe64"
  timeout "${TL64:-150}" python3 benchmarks/bench_moe_kernels.py --out "$OUT/moe64" \
    --parts layer --settings "$S64" --k 1 --layer-kernels hopper --hopper-layer "" \
    --layer-extra ffn --layer-skip capacity --layer-timing x4 --train none > "$OUT/moe64.log" 2>&1
  echo "layer 64 rc=$?"
  grep -E "ms  \(min|FAILED|==|error" "$OUT/moe64.log" | cut -c1-200
fi
[ "${E2E:-1}" = 1 ] || { rm -f "$OUT"/moe*/*.py; exit 0; }
E2E_ARGS="--parts e2e --e2e-requests 200 --budget 200"
timeout 140 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e_a" $E2E_ARGS \
  --e2e-variants grouped,ragged_dot,dense > "$OUT/e2e_a.log" 2>&1
echo "e2e a rc=$?"; grep -E "e2e|train|warm-up|no MoE|FAILED" "$OUT/e2e_a.log" | cut -c1-200
timeout 140 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e_b" $E2E_ARGS \
  --e2e-variants dense,ragged_dot,grouped > "$OUT/e2e_b.log" 2>&1
echo "e2e b rc=$?"; grep -E "e2e|train|warm-up|no MoE|FAILED" "$OUT/e2e_b.log" | cut -c1-200
rm -f "$OUT"/moe/*.py "$OUT"/e2e*/*.py
