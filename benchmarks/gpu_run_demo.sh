#!/usr/bin/env bash
# Device call: the GPU `make demo` table (issue 18 goal 6).  The device has no network, so
# instead of `make demo` (which installs a CUDA jax into .venv first) it runs the demo's own
# command, the Makefile's GPU DEMO_ARGS, on the jax installed there.  310 s on the H100, 345 s
# on the H200 (session 5).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ARGS=$(make -s -n demo DYNJAX_DEVICE=gpu 2>/dev/null | sed -n 's/.*-m benchmarks bert //p' | tail -1)
echo "python3 -m benchmarks bert $ARGS"
timeout "${TDEMO:-560}" python3 -m benchmarks bert $ARGS --out "$OUT" > "$OUT/demo.log" 2>&1
echo "demo rc=$?"
grep -v cuda_timer "$OUT/demo.log" | tail -40
