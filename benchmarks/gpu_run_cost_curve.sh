#!/usr/bin/env bash
# Device call (H200/H100, ~5 min): BERT-base fp32's cost at every bucket size (multiples of 8,
# dynjax's tier-0 options; tier 1 on a coarser grid) and the hand-written request path against
# dynjax's at the same pow2 buckets, taking turns (benchmarks/probe_cost_curve.py; session 36).
source benchmarks/_gpu_head.sh
timeout 200 python3 benchmarks/probe_cost_curve.py --parts curve --options quick \
  --sizes "${QSIZES:-16:512:8}" --workers "${W:-3}" --out "$OUT/quick" > "$OUT/quick.log" 2>&1
echo "quick rc=$?"
timeout 150 python3 benchmarks/probe_cost_curve.py --parts curve --options full \
  --sizes "${FSIZES:-32:512:32}" --extra "37,48,56,141,300,440,448,450" --workers "${W:-3}" \
  --out "$OUT/full" > "$OUT/full.log" 2>&1
echo "full rc=$?"
timeout 200 python3 benchmarks/probe_cost_curve.py --parts ab --ab "${AB:-1000}" \
  --ab-options xla,quick --out "$OUT/ab" > "$OUT/ab.log" 2>&1
echo "ab rc=$?"
tail -n 80 "$OUT/quick.log" | cut -c1-120; tail -n 30 "$OUT/full.log"; tail -n 8 "$OUT/ab.log"
