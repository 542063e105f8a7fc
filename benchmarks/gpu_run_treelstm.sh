#!/usr/bin/env bash
# Issue 12 (recursion half): the arity Tree-LSTM (3 cells by arity, params as an argument) in
# every argument form -- dynjax.recursive and dynjax.control.fold vs the same cells jitted per
# node vs PyTorch per node -- 64 real ASTs per batch, 20 forests. JSON: $OUT/treelstm.json.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 290 python3 -m benchmarks.treelstm --full models=arity --out "$OUT" 2>&1 \
  | tee "$OUT/treelstm.log" | grep -v "cuda_timer\|Resetting cache\|libtpu"
