#!/usr/bin/env bash
# Device call (~4.5 min, H200): session 39's look at who holds the GIL while a fresh serving
# process builds its request list (issue 18, goal 3). probe_gil_holders: torch eager, dynjax
# cold and its restart, each as serve_fresh's child with two non-blocking py-spy samplers
# (carried in .tools/) from the phase's first mark to `requests`; then one serve_fresh round
# of the same modes without samplers, for reference.
source benchmarks/_gpu_head.sh
timeout "${TG:-240}" python3 -m benchmarks.probe_gil_holders --out "$OUT" \
  --py-spy "$PWD/.tools/py-spy" --rounds "${ROUNDS:-2}" > "$OUT/gil.log" 2>&1
echo "gil rc=$?"; cat "$OUT/gil.log"
serve_fresh_call fp32 "${T32:-150}" --rounds 1 \
  --modes torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart --timeout 60 --pristine-restarts
