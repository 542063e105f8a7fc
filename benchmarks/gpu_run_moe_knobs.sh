#!/usr/bin/env bash
# Device call (H100, ~6-8 min): the hopper kernel's knobs (benchmarks/probe_moe_profile.py
# --knobs: warpgroups splitting a tile's rows or columns, wgmma groups in flight, tilings) on
# the layer's two GEMMs alone at 8 and at 64 experts beside cuBLAS, then the layer side by side
# (x4 in one executable, jax.profiler device times) at the shipped knobs and at K8L (8 experts)
# / K64L (64), by default the kernel before session 13 (n+w0).  K8 / K64 pick the GEMMs' knobs (comma-separated),
# SPECS the 8-expert layers' routings.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/g8" "$OUT/g64" "$OUT/layers" "$OUT/layers64"
LOG="$OUT/knobs.log"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" > "$LOG" 2>&1
timeout "${T8:-200}" python3 benchmarks/probe_moe_profile.py --out "$OUT/g8" --parts gemms \
  --gemm-settings uniform8 --knobs "${K8:-1+n+w0,1,1+t128x64x128x4x4g16}" --iters 10 >> "$LOG" 2>&1
echo "g8 rc=$?" >> "$LOG"
timeout "${T64:-260}" python3 benchmarks/probe_moe_profile.py --out "$OUT/g64" --parts gemms \
  --gemm-settings uniform64 --no-cublas \
  --knobs "${K64:-1,1+t64x32x256x4x5g8,1+t64x32x256x4x4g8}" --iters 10 >> "$LOG" 2>&1
echo "g64 rc=$?" >> "$LOG"
timeout "${TL:-200}" python3 benchmarks/probe_moe_profile.py --out "$OUT/layers" --parts layers \
  --specs "${SPECS:-uniform8:1,zipf8:1,uniform8:2}" --variants grouped,capacity \
  --knobs "1,${K8L:-1+n+w0}" --iters 10 --top 6 >> "$LOG" 2>&1
echo "layers rc=$?" >> "$LOG"
timeout "${TL64:-120}" python3 benchmarks/probe_moe_profile.py --out "$OUT/layers64" \
  --parts layers --specs uniform64:1 --variants grouped --knobs "1,${K64L:-1+n+w0}" --iters 10 \
  --top 6 >> "$LOG" 2>&1
echo "layers64 rc=$?" >> "$LOG"
rm -f "$OUT"/layers*/hlo_*.txt
grep -E "^  [a-z]|rc=|rel err|FAILED|^==|^jax" "$LOG" | cut -c1-160
