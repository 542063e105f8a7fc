#!/usr/bin/env bash
# One device call (~3-4 min on the H100): session 23's tests on the GPU (jax 0.11.2 with CUDA):
# the sort rule's fill (ties with NaN / INT_MAX / True in every key dtype), the VM's scalars in
# the ids array (x32 and x64 processes), the hopper kernel's keys and lowering (chained tiles),
# the MoE benches' smoke tests (enqueue_ms, the c0/c1 knob).
source "$(dirname "$0")/_gpu_head.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several pytest workers share the GPU
N=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
timeout "${TT:-240}" python3 -m pytest -q -p no:cacheprovider $N tests/bucketing/test_sort_rule.py \
  tests/control/test_edge_cases.py tests/control/test_recursion_forms.py \
  tests/route/test_gmm_hopper.py tests/benchmarks/test_bench_moe_kernels.py \
  tests/benchmarks/test_probe_moe_profile.py > "$OUT/session23_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/session23_tests.log"
tail -15 "$OUT/session23_tests.log"
