#!/usr/bin/env bash
# One device call (~4-6 min on the H100): session 22's tests on the GPU (jax 0.11.2 with CUDA):
# the searches and jnp copies, the associative scan (reading fn, cumulative-op gradients), the
# fuzzer (values and gradients) and the 76 public idioms (x64 off and on).
source "$(dirname "$0")/_gpu_head.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several pytest workers share the GPU
N=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
timeout "${TT:-420}" python3 -m pytest -q -p no:cacheprovider $N tests/bucketing/test_search.py \
  tests/bucketing/test_jnp.py tests/bucketing/test_scan.py tests/bucketing/test_fuzz.py \
  tests/trials/test_idioms.py -k "not linen" > "$OUT/trust22_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/trust22_tests.log"
tail -15 "$OUT/trust22_tests.log"
