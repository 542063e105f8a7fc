#!/usr/bin/env bash
# Device call (H200/H100, ~2 min: the 9 cases took 117 s on the H200): the grouped layer's
# GEMMs under Nsight Compute (issue 19): duration, DRAM and L2 traffic, the SMs' use, beside cuBLAS on the dense shapes of the same
# FLOPs and the dropping layer's batched GEMM (benchmarks/probe_moe_ncu.py, one case a
# process; CASES overrides the list).  ncu must leave the clocks alone: --clock-control none.
source "$(dirname "$0")/_gpu_head.sh"
export DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_ncu XLA_PYTHON_CLIENT_PREALLOCATE=false
{ env | grep -E "^(PYTHON|XLA|JAX|CUDA)" ; python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode)"; ncu --version | tail -1; } >> "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
CASES=${CASES:-gemm1:uniform64 gemm1:zipf64 gemm2:uniform64 capacity1:uniform64 gemm1:uniform8 gemm2:uniform8 dense1 dense2 capacity1:uniform8}
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats"
for c in $CASES; do
  f="$OUT/ncu_${c/:/_}.csv"
  timeout "${TC:-90}" ncu --clock-control none --profile-from-start off --csv --page details \
    $SECTIONS python3 benchmarks/probe_moe_ncu.py --case "$c" > "$f" 2>&1
  echo "$c rc=$? $(grep -m1 '^case ' "$f")"
done
python3 benchmarks/probe_moe_ncu.py --summarize "$OUT"/ncu_*.csv > "$OUT/summary.txt" 2>&1
for f in "$OUT"/ncu_*.csv; do echo "== $f"; cat "$f"; done > "$OUT/ncu_all.txt"
rm -f "$OUT"/ncu_*.csv
cat "$OUT/summary.txt"
