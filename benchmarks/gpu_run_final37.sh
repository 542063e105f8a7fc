#!/usr/bin/env bash
# Device call (~7 min, H200): session 37's last call.  1. The fast test tier on the GPU (after
# sessions 36-37's changes; `gpu_run_suite.sh` with TT=190 NW=14).  2. Goal 3 of issue 18 in
# more rounds: one dynjax cold process, then torch eager, its restart and its restart with the
# kept-traffic buckets deferred to traffic (`_defer`), three rounds, each restart on a copy of
# the cold cache.
source benchmarks/_gpu_head.sh
TT=${TT:-190} NW=${NW:-14} bash benchmarks/gpu_run_suite.sh | tail -8
R="torch_eager,dynjax_auto16_warm_restart,dynjax_auto16_warm_defer_restart"
timeout "${T32:-230}" python3 -m benchmarks.serve_fresh --out "$OUT" \
  --modes "dynjax_auto16_warm,$R,$R,$R" --timeout 60 --pristine-restarts > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
grep -A14 "^| mode" "$OUT/fp32.log"; grep "ERROR" "$OUT/fp32.log" | cut -c1-300
