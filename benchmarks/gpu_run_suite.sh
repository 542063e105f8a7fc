#!/usr/bin/env bash
# One device call (~8-10 min on the H100): the test suite on the GPU (jax 0.11.2 with CUDA).
# TIER="not slow" (default) is `make test`'s fast tier, TIER=slow the slow tier, TIER="" both;
# TARGETS (default tests) narrows it to files or test ids; the log and a JUnit XML of every
# test come back under $OUT.  Tests written for the CPU's numbers are
# conditioned on the backend; a failure here is either such an assumption or a GPU bug.
source "$(dirname "$0")/_gpu_head.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several pytest workers share the GPU
export DYNJAX_KERNEL_CACHE=0
TIER=${TIER-not slow}
TAG=${TAG:-fast}
timeout "${TT:-540}" python3 -m pytest -q -p no:cacheprovider -n "${NW:-8}" -m "$TIER" \
  -rfE --junitxml="$OUT/suite_${TAG}.xml" ${TARGETS:-tests} > "$OUT/suite_${TAG}.log" 2>&1
echo "tests rc=$?" >> "$OUT/suite_${TAG}.log"
tail -60 "$OUT/suite_${TAG}.log"
