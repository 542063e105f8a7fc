#!/usr/bin/env bash
# Device call (~6 min, H200): session 38's third call.  A cold dynjax process's weights phase
# (host arrays made, then uploaded) ran 0.3-1.0 s longer than torch eager's in every pair of
# the session's first two calls, while its last warm-up compiles finished.  Two rounds of:
# torch eager, dynjax cold as today, without an executable store (`_nostore`: no serialized
# writes), with tier 0 not autotuning (`t0lvl0`: its compiles run nothing on the GPU), and
# without preruns (`_noprerun`).  New mark: `host_weights` (the host arrays made).  Then two
# cold bf16 processes with attention="cudnn" (each must finish: the session 36-37 hang).
source benchmarks/_gpu_head.sh
A="torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_nostore,dynjax_auto16_warm_t0lvl0"
A="$A,dynjax_auto16_warm_noprerun"
timeout "${T32:-300}" python3 -m benchmarks.serve_fresh --out "$OUT" \
  --modes "$A,$A" --timeout 60 > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
grep -A12 "^| mode" "$OUT/fp32.log"; grep "ERROR" "$OUT/fp32.log" | cut -c1-300
C=dynjax_cudnn_auto16_warm
timeout "${T16:-90}" python3 -m benchmarks.serve_fresh --out "$OUT" --dtype bfloat16 \
  --modes "$C,$C" --timeout 40 > "$OUT/bf16.log" 2>&1
echo "bf16 rc=$?"; grep -A4 "^| mode" "$OUT/bf16.log"; grep "ERROR" "$OUT/bf16.log" | cut -c1-200
