#!/usr/bin/env bash
# Device call (H100, ~4 min): the "hopper" kernel's tilings where issue 19's targets are
# missed, x4 timing (four layers in one executable): 64 experts uniform k=1 (the auto tiling
# 64x64x128 snake 8 against other snake widths, stages and 128-row tiles; no capacity row:
# its x4 compile ran past 50 s before) and 8 experts Zipf(1.2) k=1 (against the dropping
# layer).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/t64" "$OUT/z8"
timeout 200 python3 benchmarks/bench_moe_kernels.py --out "$OUT/t64" --parts env,layer \
  --settings uniform64 --k 1 --layer-kernels hopper --layer-timing x4 --train none \
  --hopper-layer "${T64:-64x64x128x4x4g4,64x64x128x4x4g16,64x64x128x4x4g32,64x64x128x4x5g8,64x64x128x4x3g8,128x64x128x4x4g8}" \
  --layer-skip capacity --layer-extra ffn > "$OUT/t64.log" 2>&1
echo "t64 rc=$?"; grep -E "ms  \(min|FAILED|==|rror" "$OUT/t64.log" | cut -c1-200
timeout 200 python3 benchmarks/bench_moe_kernels.py --out "$OUT/z8" --parts env,layer \
  --settings zipf8 --k 1 --layer-kernels hopper --layer-timing x4 --train none \
  --hopper-layer "${Z8:-128x64x128x4x4g4,128x64x128x4x4g16,128x64x128x4x5g8,64x64x128x4x4g8}" \
  --layer-extra ffn > "$OUT/z8.log" 2>&1
echo "z8 rc=$?"; grep -E "ms  \(min|FAILED|==|rror" "$OUT/z8.log" | cut -c1-200
rm -f "$OUT"/*/*.py
