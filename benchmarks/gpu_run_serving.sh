#!/usr/bin/env bash
# Device call: issue 10's end-to-end serving table on the H100 (bert base, 1,000 docstring
# requests), every mode that decides the targets, side by side in one run.
#   MODES=... LIMIT=... bash benchmarks/gpu_run_serving.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODES=${MODES:-jit,oracle,aot_bucket,dynjax_serve,dynjax_serve_auto,dynjax_restart,dynjax_restart_auto,torch_eager,torch_compile}
LIMIT=${LIMIT:-570}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import jax, torch, flax; print('jax', jax.__version__, 'torch', torch.__version__, 'flax', flax.__version__, jax.devices())"
timeout "$LIMIT" python3 -m benchmarks bert --size base --requests 1000 --jit_budget_s 30 \
  --oracle_max_shapes 48 --modes "$MODES" --out "$OUT" --plot=false --progress=false \
  --dispatch_iters 300 "$@" > "$OUT/bert.log" 2>&1
echo "rc=$?"
grep -v "cuda_timer\|Resetting cache\|libtpu\|computation_placer\|^W0000\|^I0000" "$OUT/bert.log" | tail -n 45
