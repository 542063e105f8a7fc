#!/usr/bin/env bash
# Device call (~9 min, H200/H100): what issue 18 still needs after session 36, in one call.
# 1. bf16 with attention="cudnn": a cold process and three restarts (session 36 found 3 of 5
#    such processes dying of SIGSEGV in the two-at-once warm-up; cuDNN warm-ups now build one
#    at a time: every process must finish).  2. fp32, the same call: torch eager, the
#    hand-written cold + restart on JAX's cache, and dynjax cold + its never-tiered restart,
#    in two rounds (the never-tiered restart against the hand-written one, same call).
# Each restart on a copy of its cold process's cache (--pristine-restarts).  JSON + logs
# under $OUT; T16 / T32 limit each half (s).
source benchmarks/_gpu_head.sh
B=dynjax_cudnn_auto16_warm_restart
timeout "${T16:-170}" python3 -m benchmarks.serve_fresh --out "$OUT" --dtype bfloat16 \
  --modes "dynjax_cudnn_auto16_warm,$B,$B,$B" --timeout 60 --pristine-restarts \
  > "$OUT/bf16.log" 2>&1
echo "bf16 rc=$?"
R="torch_eager,hand_warm,hand_warm_restart,dynjax_auto16_warm,dynjax_auto16_warm_restart"
timeout "${T32:-330}" python3 -m benchmarks.serve_fresh --out "$OUT" \
  --modes "$R,$R" --timeout 90 --pristine-restarts > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
for f in bf16 fp32; do grep -A14 "^| mode" "$OUT/$f.log"; grep "ERROR" "$OUT/$f.log" | cut -c1-300; done
