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
serve_fresh_call fp32 "${T32:-300}" --modes "$A,$A" --timeout 60
C=dynjax_cudnn_auto16_warm
serve_fresh_call bf16 "${T16:-90}" --dtype bfloat16 --modes "$C,$C" --timeout 40
