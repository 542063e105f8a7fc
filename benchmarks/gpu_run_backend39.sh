#!/usr/bin/env bash
# Device call (~3 min, H200): session 39. After `import dynjax` stopped starting the backend,
# serve_fresh's dynjax children ended their imports 1-2 s earlier but Flax's abstract init
# (the first JAX computation, which now starts the backend) took 2.9-4.2 s instead of 0.7-1.3:
# probe_backend_start times each phase by the order a process takes them, then profiles the
# backend's start and the first computation.
source benchmarks/_gpu_head.sh
python3 -c "import jax" >/dev/null 2>&1  # the libraries read once (a throwaway process)
timeout 200 python3 -m benchmarks.probe_backend_start --out "$OUT" --reps "${REPS:-3}" \
  > "$OUT/phases.log" 2>&1
echo "phases rc=$?"; cat "$OUT/phases.log"
mkdir -p "$OUT/prof"
for ph in backend "random key"; do
  timeout 100 python3 -m benchmarks.probe_backend_start --out "$OUT/prof" --reps 1 \
    --variants import_then_backend --profile "$ph" > /dev/null 2>&1
  python3 - "$OUT/prof/probe_backend_start.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
  print(r["variant"], r.get("phases")); print(r.get("profile", r.get("error", ""))[:4000])
PY
done
