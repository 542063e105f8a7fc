#!/usr/bin/env bash
# Device call (~5.5 min, H200): session 39. A fresh JAX process's first transfer costs ~2 s
# of main-thread CPU on the H200 (gpu_run_backend39.sh): is it the allocator reserving 75% of
# the GPU? probe_backend_start under JAX's default, XLA_PYTHON_CLIENT_PREALLOCATE=false and
# XLA_PYTHON_CLIENT_MEM_FRACTION=.25; then two serve_fresh rounds of torch eager, dynjax cold
# and its restart, as shipped and with preallocation off (`_noprealloc`).
source benchmarks/_gpu_head.sh
python3 -c "import jax" >/dev/null 2>&1  # the libraries read once (a throwaway process)
timeout 120 python3 -m benchmarks.probe_backend_start --out "$OUT" --reps 2 \
  --variants import_then_backend \
  --envs ";XLA_PYTHON_CLIENT_PREALLOCATE=false;XLA_PYTHON_CLIENT_MEM_FRACTION=.25" \
  > "$OUT/phases.log" 2>&1
echo "phases rc=$?"; cat "$OUT/phases.log"
M=dynjax_auto16_warm
serve_fresh_call fp32 "${T32:-330}" --rounds "${ROUNDS:-2}" \
  --modes "torch_eager,$M,${M}_restart,${M}_noprealloc,${M}_noprealloc_restart" \
  --timeout 60 --pristine-restarts
