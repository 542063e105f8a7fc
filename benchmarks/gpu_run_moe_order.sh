#!/usr/bin/env bash
# Device call (H100, ~5 min): the hopper kernel's row tiles in group order (knob 1) or in the
# mixed order (1+o1, _hopper.MIXED_ORDER: heavy and light groups' tiles alternating), side by
# side in one process each: the GEMMs alone with their errors against float32
# (probe_moe_profile.py --parts gemms), then the whole layer's device time, 4 layers in one
# executable under jax.profiler (--parts layers); 64 experts uniform / Zipf and 8 experts.
source "$(dirname "$0")/_gpu_head.sh"
export DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_order
LOG="$OUT/order.log"
timeout "${TG:-260}" python3 benchmarks/probe_moe_profile.py --out "$OUT/gemms" --parts gemms \
  --gemm-settings "${GS:-zipf64,uniform64,zipf8}" --no-cublas --knobs 1,1+o1 --iters 10 \
  > "$LOG" 2>&1
echo "gemms rc=$?" >> "$LOG"
timeout "${TL:-240}" python3 benchmarks/probe_moe_profile.py --out "$OUT/layers" --parts layers \
  --specs "${SPECS:-zipf64:1,uniform64:1,zipf8:1,uniform8:1}" --variants grouped \
  --knobs 1,1+o1 --iters 10 --top 6 >> "$LOG" 2>&1
echo "layers rc=$?" >> "$LOG"
rm -f "$OUT"/*/hlo_*.txt
grep -E "^  [a-z]|rc=|rel err|FAILED|^==|^jax" "$LOG" | cut -c1-160
