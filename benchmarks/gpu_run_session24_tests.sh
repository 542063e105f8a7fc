#!/usr/bin/env bash
# One device call (~4 min on the H100): session 24's tests on the GPU (jax 0.11.2 with CUDA):
# the guards (a static table sliced by the length: HF Flax causal masks), axes empty at a
# bucket (conv front ends), strided-conv gradients, the new real-client trials and the VM's
# public loops, and the route tests conditioned on the backend in session 23.
source "$(dirname "$0")/_gpu_head.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several pytest workers share the GPU
N=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
timeout "${TT:-330}" python3 -m pytest -q -p no:cacheprovider $N tests/jit/test_guards.py \
  tests/bucketing/test_empty_axes.py tests/bucketing/test_fused_softmax.py \
  tests/bucketing/test_conv_vjp.py tests/bucketing/test_jnp.py tests/trials/test_clients2.py \
  tests/control/test_public_loops.py tests/route/test_gmm_hopper.py \
  > "$OUT/session24_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/session24_tests.log"
tail -15 "$OUT/session24_tests.log"
