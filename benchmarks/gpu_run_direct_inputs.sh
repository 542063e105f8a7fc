#!/usr/bin/env bash
# Device call (~6 min): a request's small numpy inputs copied by the CUDA driver into kept
# device arrays (dynjax/jit/_cuda.py) checked and measured on the GPU: their tests and the
# placement tests (real driver), benchmarks/probe_direct_inputs.py (JAX's transfer vs the
# driver's copies vs device inputs vs torch, the same call through dynjax.jit with the copies
# on and off, and issue 18's BERT-base served both ways taking turns: BERT=N requests), and
# issue 19's e2e MoE encoder (grouped and dense, each also with JAX's
# own transfers, "[jax put]", all taking turns per request) in two processes, the variants in
# opposite orders.  Everything lands in $OUT/direct_inputs.tgz; the summary in $OUT/summary.log.
source benchmarks/_gpu_head.sh
W=/tmp/direct_inputs
rm -rf "$W"; mkdir -p "$W"
cp "$OUT/versions.txt" "$W/"
export DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_direct
{
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/jit/test_direct_inputs.py \
  tests/jit/test_placement.py > "$W/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$W/tests.log"
timeout 300 python3 benchmarks/probe_direct_inputs.py --out "$W" --bert ${BERT:-300} > "$W/probe.log" 2>&1
echo "probe rc=$?"; grep -E "t=|bytes|bert|mean" "$W/probe.log"
i=0
for order in ${ORDERS:-grouped,dense dense,grouped}; do
  i=$((i + 1))
  mkdir -p "$W/e2e$i"
  timeout "${TE:-220}" python3 benchmarks/bench_moe_gmm.py --out "$W/e2e$i" --parts e2e \
    --e2e-requests 200 --e2e-variants "$order" --e2e-jax-put --budget 200 > "$W/e2e$i.log" 2>&1
  echo "e2e$i ($order) rc=$?"
  grep -E "mean|no MoE|FAILED" "$W/e2e$i.log" | cut -c1-200
done
} 2>&1 | tee "$OUT/summary.log"
rm -f "$W"/e2e*/*.py
tar czf "$OUT/direct_inputs.tgz" -C "$W" .
