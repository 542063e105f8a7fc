#!/usr/bin/env bash
# Device call (~4.5 min, H200): session 38's closing call, goal 3 of issue 18 on the final tree
# through serve_fresh's own rounds: `--rounds 3` of torch eager, dynjax cold and its restart
# (torch first, then last, then first), one throwaway process first reading every runtime's
# libraries; the table ends with each mode against torch eager in the same round.
source benchmarks/_gpu_head.sh
timeout "${T32:-300}" python3 -m benchmarks.serve_fresh --out "$OUT" --rounds 3 \
  --modes torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart \
  --timeout 60 --pristine-restarts > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
grep -A18 "^| mode" "$OUT/fp32.log"; grep "ERROR" "$OUT/fp32.log" | cut -c1-300
