#!/usr/bin/env bash
# Device call (~5 min): issue 19's cold start in fresh processes.  Each process runs one e2e
# variant of bench_moe_gmm.py (the Flax MoE encoder, 200 requests): its untimed process
# warm-up (the block without experts over every length bucket), then the cold pass that
# builds its 4 length buckets ("cold" in the log), then the stream.  ROUNDS rounds of the
# VARIANTS, the order turned each round, every process on an empty kernel directory
# (DYNJAX_KERNEL_CACHE: the grouped layer exports and compiles its Mosaic GPU kernels, as on
# a machine's first run); then KEPT processes of the grouped variant on round 1's directory
# (the kernels kept on disk, as every later process on the machine).
# Results: $OUT/cold_rounds.log (the summary) and $OUT/cold_rounds.tgz (every log and JSON).
source "$(dirname "$0")/_gpu_head.sh"
W=/tmp/cold_rounds
rm -rf "$W" /tmp/kc_cold_*; mkdir -p "$W"
read -r -a VS <<< "${VARIANTS:-grouped ragged_dot}"
run() {  # $1 tag, $2 variant, $3 kernel directory
  DYNJAX_KERNEL_CACHE="$3" timeout "${TP:-100}" python3 benchmarks/bench_moe_gmm.py \
    --out "$W/$1" --parts e2e --e2e-requests 200 --e2e-variants "$2" --e2e-interleave 0 \
    > "$W/$1.log" 2>&1
  echo "$1 rc=$? $(grep -E '^  (dynjax|lax|dense)' "$W/$1.log" | head -1 | cut -c1-160)"
}
{
for r in $(seq "${ROUNDS:-3}"); do
  order=("${VS[@]}")
  if (( r % 2 == 0 )); then order=($(printf '%s\n' "${VS[@]}" | tac)); fi
  for v in "${order[@]}"; do run "r${r}_$v" "$v" "/tmp/kc_cold_${r}_$v"; done
done
for i in $(seq "${KEPT:-1}"); do run "kept${i}_grouped" grouped "/tmp/kc_cold_1_grouped"; done
} 2>&1 | tee "$OUT/cold_rounds.log"
rm -f "$W"/*/*.py
tar czf "$OUT/cold_rounds.tgz" -C "$W" .
