#!/usr/bin/env bash
# Device call (~4.5 min, H200): session 38's closing call, goal 3 of issue 18 on the final tree
# through serve_fresh's own rounds: `--rounds 3` of torch eager, dynjax cold and its restart
# (torch first, then last, then first), one throwaway process first reading every runtime's
# libraries; the table ends with each mode against torch eager in the same round.
source benchmarks/_gpu_head.sh
serve_fresh_call fp32 "${T32:-300}" --rounds 3 \
  --modes torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart --timeout 60 --pristine-restarts
