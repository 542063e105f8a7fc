#!/usr/bin/env bash
# One device call (~6-8 min on the H100): session 26's work on the GPU (jax 0.11.2 with CUDA).
# 1. bench_vision.py: a Flax ResNet-18 over images of many sizes (batch 8, fp32): dynjax's
#    buckets against jax.jit per exact shape, jax.jit at the bucket, padded to the largest by
#    hand, and PyTorch eager (SIZES distinct sizes, each twice; STEP the linear bucket step).
# 2. The session's tests (shape identities, *args/**kwargs binding, guards, the vision idioms,
#    the conv rule's tests) on the GPU, when TESTS is not empty.
source "$(dirname "$0")/_gpu_head.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout "${TB:-300}" python3 benchmarks/bench_vision.py --requests "${SIZES:-16}" \
  --step "${STEP:-64}" --depth "${DEPTH:-18}" --out "$OUT" > "$OUT/bench_vision.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench_vision.log"
cat "$OUT/bench_vision.log"
if [ -n "${TESTS-x}" ]; then
  timeout "${TT:-240}" python3 -m pytest -q -p no:cacheprovider -n 4 -rfE \
    ${TESTS:-tests/jit/test_shape_identities.py tests/jit/test_calls.py tests/jit/test_guards.py \
    tests/trials/test_vision_idioms.py tests/bucketing/test_padding.py} \
    > "$OUT/session26_tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/session26_tests.log"
  tail -15 "$OUT/session26_tests.log"
fi
