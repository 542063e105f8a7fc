#!/usr/bin/env bash
# One device call (~4-5 min on the H100; session 27): where an image request's time goes
# (probe_vision_cost.py: ResNet-18, batch 8, fp32, exact / bucket / dynjax numpy, device and
# Padded inputs, host pad, torch), then, when TESTS is not empty, the serving and placement
# tests on the GPU (the pre-lowering race; the store's placement, the pinned input buffers).
# BENCH=1 first runs bench_vision.py's whole table (16 sizes, each twice; ~2.5 min) and
# probe_pinned_inputs.py; PIN_AB=1 runs bench_vision's jit_exact and dynjax rows twice, in
# fresh processes with DYNJAX_PINNED_INPUTS=1 and 0; OLD=dir (carried: a tree's dynjax/) runs
# them on this tree and on OLD's dynjax; COPY=1 runs probe_host_copy.py; COPY_AB=1 runs
# bench_vision's jit_exact and dynjax rows in fresh processes with DYNJAX_COPY_THREADS in
# COPIES (default "4 1 1 4": the split copy on, off, off, on).
source "$(dirname "$0")/_gpu_head.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "${COPY:-}" ]; then  # the host copy into a padded buffer, 1-8 threads
  timeout 120 python3 benchmarks/probe_host_copy.py --out "$OUT" > "$OUT/host_copy.log" 2>&1
  cat "$OUT/host_copy.log"
fi
if [ -n "${OLD:-}" ]; then  # bench_vision's jit_exact + dynjax on this tree, then on OLD's dynjax
  for tree in new old; do
    pp=$PWD; [ "$tree" = old ] && pp=$OLD:$PWD
    PYTHONPATH=$pp timeout 200 python3 benchmarks/bench_vision.py --requests 16 \
      --modes jit_exact,dynjax --out "$OUT/$tree" > "$OUT/bench_vision_$tree.log" 2>&1
    echo "$tree rc=$?"; cat "$OUT/bench_vision_$tree.log"
  done
fi
if [ -n "${COPY_AB:-}" ]; then  # bench_vision's jit_exact + dynjax, split copies on (4) / off (1)
  for k in ${COPIES:-4 1 1 4}; do
    DYNJAX_COPY_THREADS=$k timeout 200 python3 benchmarks/bench_vision.py --requests 16 \
      --modes jit_exact,dynjax --out "$OUT/copy$k" > "$OUT/bench_vision_copy$k.log" 2>&1
    echo "copy threads $k rc=$?"; tail -4 "$OUT/bench_vision_copy$k.log"
    [ -f "$OUT/copy$k/bench_vision.json" ] && mv "$OUT/copy$k/bench_vision.json" \
      "$OUT/copy$k/bench_vision_$(date +%s).json"
  done
fi
if [ -n "${PIN_AB:-}" ]; then  # bench_vision's jit_exact + dynjax, pinned inputs on / off
  for pin in ${PINS:-1 0}; do
    DYNJAX_PINNED_INPUTS=$pin timeout 200 python3 benchmarks/bench_vision.py --requests 16 \
      --modes jit_exact,dynjax --out "$OUT/pin$pin" > "$OUT/bench_vision_pin$pin.log" 2>&1
    echo "pinned $pin rc=$?"; cat "$OUT/bench_vision_pin$pin.log"
  done
fi
if [ -n "${BENCH:-}" ]; then
  timeout 240 python3 benchmarks/bench_vision.py --requests 16 --out "$OUT" \
    > "$OUT/bench_vision.log" 2>&1
  echo "bench rc=$?" >> "$OUT/bench_vision.log"
  cat "$OUT/bench_vision.log"
  timeout 120 python3 benchmarks/probe_pinned_inputs.py --out "$OUT" > "$OUT/pinned.log" 2>&1
  cat "$OUT/pinned.log"
fi
timeout "${TP:-300}" python3 benchmarks/probe_vision_cost.py ${PARGS:-} --out "$OUT" \
  > "$OUT/probe_vision_cost.log" 2>&1
echo "probe rc=$?" >> "$OUT/probe_vision_cost.log"
cat "$OUT/probe_vision_cost.log"
if [ -n "${TESTS-x}" ]; then
  timeout "${TT:-200}" python3 -m pytest -q -p no:cacheprovider -n 4 -rfE \
    ${TESTS:-tests/jit/test_serving.py tests/jit/test_placement.py} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log"
  tail -15 "$OUT/tests.log"
fi
