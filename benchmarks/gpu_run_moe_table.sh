#!/usr/bin/env bash
# Device call (H200/H100, ~9 min): each row tile's group read from a table (g1,
# _hopper.TILE_TABLE, session 31) against the walk over every group's tile end (g0, which
# Nsight Compute found spilling in the 64-expert kernels: benchmarks/gpu_run_moe_ncu.sh).
# The 64-expert GEMMs alone with their errors against float32, then the layers side by side
# with the dropping layer (jax.profiler device times), 64 and 8 experts; the 8-expert GEMMs
# with the table and their errors last.
source benchmarks/_gpu_head.sh
LOG="$OUT/table.log"
cat "$OUT/versions.txt" > "$LOG"
P="python3 benchmarks/probe_moe_profile.py --iters 10"
timeout "${T64:-200}" $P --out "$OUT/g64" --parts gemms --gemm-settings uniform64,zipf64 \
  --no-cublas --knobs "${K:-1+g0,1+g1}" >> "$LOG" 2>&1; echo "g64 rc=$?" >> "$LOG"
timeout "${TL64:-130}" $P --out "$OUT/layers64" --parts layers --top 6 \
  --specs uniform64:1,zipf64:1 --variants grouped,capacity --knobs "${K:-1+g0,1+g1}" >> "$LOG" 2>&1
echo "layers64 rc=$?" >> "$LOG"
timeout "${TL:-120}" $P --out "$OUT/layers" --parts layers --top 6 \
  --specs "${SPECS:-uniform8:1,zipf8:1}" --variants grouped,capacity \
  --knobs "${K:-1+g0,1+g1}" >> "$LOG" 2>&1; echo "layers rc=$?" >> "$LOG"
timeout "${T8:-80}" $P --out "$OUT/g8" --parts gemms --gemm-settings uniform8 --no-cublas \
  --knobs 1+g1 >> "$LOG" 2>&1; echo "g8 rc=$?" >> "$LOG"
rm -f "$OUT"/*/hlo_*.txt
grep -E "^  [a-z]|rc=|rel err|FAILED|^==|^jax|^python" "$LOG" | cut -c1-170
