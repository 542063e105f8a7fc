#!/usr/bin/env bash
# Device call (H200/H100, ~8 min): issue 19's layer table in one process (session 35) -- the
# grouped layer at the auto kernel beside the capacity-1.25 dropping layer, lax.ragged_dot,
# dense (every expert) and one dense cuBLAS FFN of the same FLOPs with no routing (the floor);
# 8 and 64 experts, uniform and Zipf(1.2), k=1 and 2; per call and pipelined (16 calls
# launched back to back, one block); a training step at uniform8.  SETTINGS, K, TIMING, BL
# (the bench's budget in seconds: later rows are skipped) pass through.
source benchmarks/_gpu_head.sh
DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_table19 timeout "${TL:-500}" python3 \
  benchmarks/bench_moe_kernels.py --out "$OUT/table19" --parts env,layer --layer-kernels "" \
  --layer-extra ragged_dot,dense,ffn --settings "${SETTINGS:-uniform8,zipf8,uniform64,zipf64}" \
  --k "${K:-1,2}" --layer-timing "${TIMING:-call,pipelined}" --train uniform8 \
  --iters "${ITERS:-30}" --budget "${BL:-450}" > "$OUT/table19.log" 2>&1
echo "table19 rc=$?"
grep -E "^  [a-z]|^==|FAILED" "$OUT/table19.log" | cut -c1-150
rm -f "$OUT"/table19/*.py
