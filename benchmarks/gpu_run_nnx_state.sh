#!/usr/bin/env bash
# Device call (H100, ~2 min): an NNX model (12 Linear(2048, 2048), float32 params, bf16 compute)
# served with numpy requests, this tree against an older one (OLD=dir; default bench_old),
# alternating: per-call time and where the parameters live afterwards (bench_nnx_state.py).
# OLD holds the older tree's dynjax/ (carry ["bench_old"]); the script is this tree's.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
OLD=${OLD:-bench_old}
NEW=$PWD
for i in 1 2; do
  for tree in new old; do
    pp=$NEW; [ $tree = old ] && pp=$NEW/$OLD:$NEW
    PYTHONPATH=$pp timeout 120 ${PYTHON:-python3} benchmarks/bench_nnx_state.py \
      --out "$OUT/${tree}$i" 2>&1 | grep -v Warning | sed "s/^/$tree$i /"
  done
done
