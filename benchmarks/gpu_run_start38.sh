#!/usr/bin/env bash
# Device call (~8 min, H200): session 38's first call.
# 1. Goal 3 of issue 18 (process start to the 1,000th answer), where the start-up warm-up's
#    trace runs: three rounds of torch eager, dynjax cold as today (`warmup(background=True)`
#    traces on the main thread), the same call made from a thread (`_bgtrace`), and the whole
#    warm-up from shapes, Flax's abstract init included, in a thread (`_bgall`); then a restart
#    of each of the first two.  New marks: `imported` (jax, Flax, dynjax), `abstract`.
# 2. The fast test tier on the GPU (`gpu_run_suite.sh`, TT=170 NW=14): session 37's test-side
#    fixes were not re-run there.
source benchmarks/_gpu_head.sh
R="torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_bgtrace,dynjax_auto16_warm_bgall"
serve_fresh_call fp32 "${T32:-300}" \
  --modes "$R,$R,$R,dynjax_auto16_warm_restart,dynjax_auto16_warm_bgtrace_restart" \
  --timeout 60 --pristine-restarts
TT=${TT:-170} NW=${NW:-14} bash benchmarks/gpu_run_suite.sh | tail -8
