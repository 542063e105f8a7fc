#!/usr/bin/env bash
# Device call (H100, ~7 min): dynjax.jit(cast_once=...) on issue 19's e2e MoE encoder (Flax,
# float32 params, bfloat16 compute, k=2, 8 experts, 200 batch-8 requests).  Three fresh
# processes on one host: cast once (grouped, ragged_dot, dense), the same without
# (--no-cast-once), and cast once again with the variants in the opposite order.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
E2E_ARGS="--parts e2e --e2e-requests 200 --budget 200"
run() {  # name, extra args
  mkdir -p "$OUT/$1"
  timeout 150 python3 benchmarks/bench_moe_gmm.py --out "$OUT/$1" $E2E_ARGS "${@:2}" \
    > "$OUT/$1.log" 2>&1
  echo "$1 rc=$?"; grep -E "e2e|warm-up|no MoE|FAILED|Error" "$OUT/$1.log" | cut -c1-220
}
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__, jax.devices())"
run cast_a --e2e-variants grouped,ragged_dot,dense
run nocast --e2e-variants grouped,ragged_dot,dense --no-cast-once
run cast_b --e2e-variants dense,ragged_dot,grouped
rm -f "$OUT"/*/*.py
