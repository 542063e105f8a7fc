#!/usr/bin/env bash
# One device call (~1-2 min; session 28): greedy decoding with a KV cache under
# dynjax.while_loop (benchmarks/probe_kv_decode.py), this tree and, with OLD=dir (carried: a
# tree's dynjax/), that tree, alternating in fresh processes; BUCKET_FROM (default "init auto")
# the loops' start bucket (auto = the cap's bucket on a GPU: no crossing).
source "$(dirname "$0")/_gpu_head.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for bf in ${BUCKET_FROM:-init auto}; do
  for tree in new ${OLD:+old} new ${OLD:+old}; do
    pp=$PWD; [ "$tree" = old ] && pp=$OLD:$PWD
    PYTHONPATH=$pp timeout 120 python3 benchmarks/probe_kv_decode.py --modes ${MODES:-kv,prefix} \
      --bucket-from "$bf" --tag "${tree}_${bf}_$(date +%s%N | cut -c1-13)" --out "$OUT" \
      2>&1 | sed "s/^/$tree $bf /"
  done
done
