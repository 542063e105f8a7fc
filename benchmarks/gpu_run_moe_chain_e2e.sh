#!/usr/bin/env bash
# Device call (H100, ~9 min): issue 19's figures with the chained hopper kernel
# (_hopper.CHAIN_TILES): the 8-expert layer table timed per call / x4 / pipelined
# (bench_moe_kernels.py, as gpu_run_moe_layer_modes.sh), then the e2e MoE encoder
# (bench_moe_gmm.py --parts e2e, 200 requests) in two fresh processes, the variants in
# opposite orders, on an empty kernel directory each (the cold start of a fresh machine).
source benchmarks/_gpu_head.sh
L="--parts layer --layer-kernels hopper --layer-extra ffn --train none --iters ${ITERS:-30}"
DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_layer timeout "${TL:-270}" python3 \
  benchmarks/bench_moe_kernels.py --out "$OUT/layer8" $L --k 1,2 --settings uniform8,zipf8 \
  --layer-timing call,x4,pipelined > "$OUT/layer8.log" 2>&1
echo "layer 8 rc=$?"; grep -E "^  |==" "$OUT/layer8.log" | cut -c1-120
E2E_ARGS="--parts e2e --e2e-requests 200 --budget 200"
for order in grouped,ragged_dot,dense dense,ragged_dot,grouped; do
  name="e2e_${order%%,*}_first"
  mkdir -p "$OUT/$name"
  DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_$name timeout "${TE:-140}" python3 \
    benchmarks/bench_moe_gmm.py --out "$OUT/$name" $E2E_ARGS --e2e-variants "$order" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "e2e|warm-up|no MoE|FAILED|mean" "$OUT/$name.log" | cut -c1-200
done
rm -f "$OUT"/*/*.py
