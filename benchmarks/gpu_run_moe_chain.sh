#!/usr/bin/env bash
# Device call (H100, ~6-8 min; G64=1 adds the 64-expert GEMMs alone): the hopper kernel with
# a program's tiles chained (_hopper.CHAIN_TILES, knob c1: the next tile's operands stream in
# while a tile finishes; on since session 23 for 128-row tiles, so knob 1 is chained there)
# against the unchained kernel (c0, with its wgmma group in flight): the two GEMMs alone with
# their errors against float32 (8 and 64 experts, uniform and Zipf; 2,048 routed rows: the
# e2e's size), then the layers side by side with the dropping layer (jax.profiler device
# times).  c64 chains the 64-expert kernels' 64-row tiles too.  Session 23's runs 16-17
# compared 1 (then unchained) with 1+c1 (then chaining every tile).
source benchmarks/_gpu_head.sh
LOG="$OUT/chain.log"
cat "$OUT/versions.txt" > "$LOG"
P="python3 benchmarks/probe_moe_profile.py --iters 10"
timeout "${T8:-150}" $P --out "$OUT/g8" --parts gemms --gemm-settings uniform8,zipf8 \
  --knobs "${K8:-1+c0,1+c1}" >> "$LOG" 2>&1; echo "g8 rc=$?" >> "$LOG"
if [ -n "${G64:-}" ]; then  # the 64-expert GEMMs alone: their set-up takes ~2 min
  timeout "${T64:-240}" $P --out "$OUT/g64" --parts gemms --gemm-settings uniform64,zipf64 \
    --no-cublas --knobs "${K64:-1+c0,1+c64}" >> "$LOG" 2>&1; echo "g64 rc=$?" >> "$LOG"
fi
timeout "${TS:-90}" $P --out "$OUT/g2048" --parts gemms --gemm-settings uniform8 --tokens 2048 \
  --knobs "1+c0,1+c1" >> "$LOG" 2>&1; echo "g2048 rc=$?" >> "$LOG"
timeout "${TL:-130}" $P --out "$OUT/layers" --parts layers --top 6 \
  --specs "${SPECS:-uniform8:1,zipf8:1,uniform8:2}" --variants grouped,capacity \
  --knobs "1+c0,1+c1" >> "$LOG" 2>&1; echo "layers rc=$?" >> "$LOG"
timeout "${TL64:-110}" $P --out "$OUT/layers64" --parts layers --top 6 \
  --specs uniform64:1,zipf64:1 --variants grouped,capacity --knobs "1+c0,1+c64" >> "$LOG" 2>&1
echo "layers64 rc=$?" >> "$LOG"
rm -f "$OUT"/*/hlo_*.txt
grep -E "^  [a-z]|rc=|rel err|FAILED|^==|^jax|^python" "$LOG" | cut -c1-170
