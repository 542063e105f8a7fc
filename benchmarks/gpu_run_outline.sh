#!/usr/bin/env bash
# Device call (H100, ~6-8 min): repeated layers padded and lowered once a bucket (session 30,
# bucketing/_outline.py; issue 18 goal 3).  (1) the outline tests on the GPU; (2) one bucket's
# lowering of BERT-base with the template (DYNJAX_OUTLINE=1) and flat (=0), XLA and Pallas
# attention (benchmarks/probe_lowering.py: lowering s a bucket, the padded jaxpr's equations);
# (3) the issue-18 cold protocol (serve_fresh.py through gpu_run_cold18.sh), torch eager, the
# shipped cold server (W) and the same flat (W_flat), in alternating order; ROUNDS repeats it.
source "$(dirname "$0")/_gpu_head.sh"
if [ -n "${TESTS-1}" ]; then
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/bucketing/test_outline.py \
    > "$OUT/tests_outline.log" 2>&1
  echo "tests rc=$?"; tail -2 "$OUT/tests_outline.log"
fi
if [ -n "${LOWER-1}" ]; then
  for o in 1 0; do
    DYNJAX_OUTLINE=$o timeout 200 python3 benchmarks/probe_lowering.py --size base \
      --attention none,pallas --tag "outline$o" --out "$OUT" 2>&1 | grep -E "^  |Error"
  done
fi
W=dynjax_pallas_auto16_warm
PROBE= MODES=${MODES-torch_eager,$W,${W}_flat,torch_eager,${W}_flat,$W} \
  bash "$(dirname "$0")/gpu_run_cold18.sh"
