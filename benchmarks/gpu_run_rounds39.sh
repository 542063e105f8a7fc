#!/usr/bin/env bash
# Device call (~8.5 min, H200): session 39's closing call, goal 3 of issue 18 on the final
# tree: `serve_fresh --rounds 4` of torch eager, dynjax cold and its restart as shipped (JAX's
# allocator defaults), and the same two with JAX's preallocation off (`_noprealloc`:
# XLA_PYTHON_CLIENT_PREALLOCATE=false in the child, JAX's documented switch; the default
# reserves 75% of the GPU at the first transfer, ~2 s of the H200 host's CPU). Torch first
# and last in turn; the table ends with each mode against torch eager of its round.
source benchmarks/_gpu_head.sh
M=dynjax_auto16_warm
serve_fresh_call fp32 "${T32:-540}" --rounds "${ROUNDS:-4}" \
  --modes "torch_eager,$M,${M}_restart,${M}_noprealloc,${M}_noprealloc_restart" \
  --timeout 60 --pristine-restarts
