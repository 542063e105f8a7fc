#!/usr/bin/env bash
# Device call B: Tree-LSTM and decode (issue 4, control-flow VM) and the MoE e2e encoder (issue 6).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -v "cuda_timer\|Resetting cache\|libtpu" "$OUT/$name.log" | tail -n 30; }
step treelstm 150 python3 -m benchmarks.treelstm --full
step decode 170 python3 -m benchmarks.decode --full --exact-budget=12
step moe_e2e 150 python3 -m benchmarks moe --out "$OUT" -- --e2e --e2e-requests 60
