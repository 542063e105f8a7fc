#!/usr/bin/env bash
# Device call A: MoE (issue 6) and the issue-2 encoder table (tiny jax.numpy encoder, all modes).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -v "cuda_timer\|Resetting cache" "$OUT/$name.log" | tail -n 40; }
step moe 300 python3 -m benchmarks moe --out "$OUT"
step encoder_tiny 260 python3 -m benchmarks encoder --size tiny --requests 300 --jit_budget_s 40 --oracle_max_shapes 32 --modes jit,oracle,pad_max,dynjax_pow2,dynjax_auto,dynjax_warmup,dynjax_pass --out "$OUT" --plot=false --progress=false
