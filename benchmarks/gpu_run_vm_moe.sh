#!/usr/bin/env bash
# One device call: dispatch costs, decode (VM), Tree-LSTM (VM), padding pass vs trust
# (unmasked vs masked encoder), MoE. Each step has its own time limit; logs and JSON go to $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 25 "$OUT/$name.log"; }
step dispatch 90 python3 benchmarks/bench_dispatch.py --out "$OUT"
step decode 200 python3 -c "from benchmarks import decode as D; r = D.run({'quick': False, 'requests': 3}, out_dir='$OUT'); print(D.format_table(r))"
step treelstm 120 python3 -c "from benchmarks import treelstm as T; r = T.run({'quick': False}, out_dir='$OUT'); print(T.format_table(r))"
step encoder 150 python3 -m benchmarks encoder --size base --requests 300 --modes oracle,dynjax_pow2,dynjax_pass --oracle_max_shapes 16 --out "$OUT" --plot=false --progress=false --dispatch_iters 0
