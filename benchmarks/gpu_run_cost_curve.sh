#!/usr/bin/env bash
# Device call (H200/H100): BERT-base fp32's cost at every bucket size (multiples of 8, dynjax's
# tier-0 options; tier 1 on a coarser grid) and the request paths side by side: hand-written
# pow2 buckets against dynjax's variants, taking turns (benchmarks/probe_cost_curve.py; session
# 36).  PARTS: which of quick,full,ab run (default all three, ~5 min with the machine's start);
# SF: serve_fresh modes run after them (default none), --pristine-restarts.
source benchmarks/_gpu_head.sh
PARTS=${PARTS:-quick,full,ab}
if [[ ,$PARTS, == *,quick,* ]]; then
  timeout 200 python3 benchmarks/probe_cost_curve.py --parts curve --options quick \
    --sizes "${QSIZES:-16:512:8}" --workers "${W:-3}" --out "$OUT/quick" > "$OUT/quick.log" 2>&1
  echo "quick rc=$?"; tail -n 70 "$OUT/quick.log" | cut -c1-120
fi
if [[ ,$PARTS, == *,full,* ]]; then
  timeout 150 python3 benchmarks/probe_cost_curve.py --parts curve --options full \
    --sizes "${FSIZES:-32:512:32}" --extra "37,48,56,141,300,440,448,450" --workers "${W:-3}" \
    --out "$OUT/full" > "$OUT/full.log" 2>&1
  echo "full rc=$?"; tail -n 30 "$OUT/full.log"
fi
if [[ ,$PARTS, == *,ab,* ]]; then
  timeout "${TAB:-300}" python3 benchmarks/probe_cost_curve.py --parts ab --ab "${AB:-1000}" \
    ${AB_ARGS:-} --out "$OUT/ab" > "$OUT/ab.log" 2>&1
  echo "ab rc=$?"; tail -n 12 "$OUT/ab.log"
fi
if [ -n "${SF:-}" ]; then
  timeout "${TSF:-300}" python3 -m benchmarks.serve_fresh --out "$OUT" --modes "$SF" \
    --timeout 150 --pristine-restarts > "$OUT/sf.log" 2>&1
  echo "serve_fresh rc=$?"; grep -A20 "^| mode" "$OUT/sf.log"
fi
