#!/usr/bin/env bash
# Device call (H200/H100, ~6 min): paired 64-row tiles at 64 experts (session 31;
# _hopper.PAIR_TILES: two row tiles of one group a program, so a weight tile crosses L2 once a
# pair; p1 a half pair's second warpgroup multiplies unstored rows, p2 it issues no wgmma)
# against unpaired tiles (1, shipped).  The 64-expert GEMMs alone under Zipf routing with their
# errors against float32 (KG knobs), then the layers' device time beside the dropping layer
# (jax.profiler, uniform and Zipf; KL knobs).
source benchmarks/_gpu_head.sh
LOG="$OUT/pairs.log"
cat "$OUT/versions.txt" > "$LOG"
P="python3 benchmarks/probe_moe_profile.py --iters 10"
timeout "${TG:-170}" $P --out "$OUT/g64" --parts gemms --gemm-settings "${GS:-zipf64}" \
  --no-cublas --knobs "${KG:-1+p2}" >> "$LOG" 2>&1; echo "g64 rc=$?" >> "$LOG"
timeout "${TL:-200}" $P --out "$OUT/layers64" --parts layers --top 6 \
  --specs uniform64:1,zipf64:1 --variants grouped,capacity --knobs "${KL:-1,1+p1,1+p2}" \
  >> "$LOG" 2>&1; echo "layers64 rc=$?" >> "$LOG"
rm -f "$OUT"/*/hlo_*.txt
grep -E "^  [a-z]|rc=|rel err|FAILED|^==|^jax|^python" "$LOG" | cut -c1-170
