#!/usr/bin/env bash
# Device call (~8 min, H200): session 37's last call.
# 1. Six cold bf16 processes with attention="cudnn" (cuDNN executables no longer run ahead):
#    every one must finish (before the change 2 of 7 such processes hung, sessions 36-37).
# 2. The fast test tier on the GPU (`gpu_run_suite.sh`, TT=170 NW=14).
# 3. Goal 3 of issue 18: a dynjax cold process, then torch eager, its restart and its restart
#    compiling the kept-traffic buckets before traffic (`_startnew`, sessions 35-36's rule;
#    session 37 ran this as `_restart` = that rule and `_defer_restart` = today's), two rounds.
source benchmarks/_gpu_head.sh
export PATH=$PWD/.tools:$PATH
C=dynjax_cudnn_auto16_warm
timeout "${T16:-190}" python3 -m benchmarks.serve_fresh --out "$OUT" --dtype bfloat16 \
  --modes "$C,$C,$C,$C,$C,$C" --timeout 40 > "$OUT/bf16.log" 2>&1
echo "bf16 rc=$?"; grep -A9 "^| mode" "$OUT/bf16.log"; grep "ERROR" "$OUT/bf16.log" | cut -c1-200
TT=${TT:-170} NW=${NW:-14} bash benchmarks/gpu_run_suite.sh | tail -6
R="torch_eager,dynjax_auto16_warm_restart,dynjax_auto16_warm_startnew_restart"
timeout "${T32:-150}" python3 -m benchmarks.serve_fresh --out "$OUT" \
  --modes "dynjax_auto16_warm,$R,$R" --timeout 60 --pristine-restarts > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
grep -A10 "^| mode" "$OUT/fp32.log"; grep "ERROR" "$OUT/fp32.log" | cut -c1-300
