#!/usr/bin/env bash
# Device call (issue 12): decode rows (dynjax variants vs jit loop / padded loop / while@max,
# batch 1 and 8), per-step while-body kernels, encoder + decode compiled vs op by op, nested
# loops.  JSON: $OUT/decode.json (rewritten after every section), log: $OUT/decode.log.
# Budget: ~150 s on the H100 (jit_exact stops at 10 s per batch size).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 165 python3 -m benchmarks decode --out "$OUT" -- exact_budget_s=10 program_requests=3 \
  > "$OUT/decode.log" 2>&1
echo "rc=$?"
grep -v "cuda_timer\|Resetting cache" "$OUT/decode.log" | tail -n 60
