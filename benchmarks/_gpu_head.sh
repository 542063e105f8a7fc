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
