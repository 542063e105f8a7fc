#!/usr/bin/env bash
# Device call (~5 min, H200): session 38's last call, goal 3 of issue 18 on the final tree:
# three more rounds of torch eager, dynjax cold and its restart (on a copy of that round's cold
# cache), the order alternating between rounds, fp32 (as `gpu_run_goal3_38.sh`'s first part).
source benchmarks/_gpu_head.sh
A="torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart"
B="dynjax_auto16_warm,dynjax_auto16_warm_restart,torch_eager"
serve_fresh_call fp32 "${T32:-300}" --modes "$B,$A,$B" --timeout 60 --pristine-restarts
