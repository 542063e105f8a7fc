# Sourced by the gpu_run_*.sh device calls: the environment, $OUT, and versions.txt (the GPU,
# its driver, python/jax/torch/flax versions and the host's CPUs) printed and kept under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, jax, torch, flax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'torch', torch.__version__, 'flax', flax.__version__)"
  lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name)"
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

# serve_fresh_call NAME LIMIT_S ARGS...: benchmarks.serve_fresh with ARGS (its JSON under $OUT),
# its output in $OUT/NAME.log, at most LIMIT_S seconds; then NAME's rc, its tables and errors.
serve_fresh_call() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m benchmarks.serve_fresh --out "$OUT" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
  grep -A40 "^| mode" "$OUT/$name.log"; grep "ERROR" "$OUT/$name.log" | cut -c1-300
}
