#!/usr/bin/env bash
# Device call (H100, ~8 min): where a served request's time goes (issue 19's e2e MoE encoder:
# the block without experts, grouped, dense), under XLA's default flags, command buffers off,
# and command buffers for every op type; each in a fresh process.  JSON under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__, jax.devices())"
python3 benchmarks/probe_request_cost.py --out "$OUT" --timeout 175 "$@" 2>&1 | cut -c1-400
