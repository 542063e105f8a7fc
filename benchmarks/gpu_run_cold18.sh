#!/usr/bin/env bash
# Device call (H100, ~6 min): where a cold dynjax server's start-up Python loses its time
# (issue 18 goal 3).  Fresh processes (benchmarks/serve_fresh.py, fp32, BERT-base, 1,000
# requests), each warming up from shapes while it builds its request list: torch eager,
# dynjax with and without its parts (Pallas attention, padding pass, store and preruns, the
# 0.5 ms GIL switch interval), the hand-written warmup; MODES overrides the list.  First
# (PROBE= skips it) benchmarks/probe_gil.py: each step of one bucket's build beside a spinning
# thread and a spinning process (the GIL or the cores).
source "$(dirname "$0")/_gpu_head.sh"
if [ -n "${PROBE-1}" ]; then  # what one bucket's build takes from a thread and from a process
  timeout 200 python3 benchmarks/probe_gil.py --size base --t 128 --attention pallas \
    --out "$OUT/gil" 2>&1 | grep -E "^  |Error"
fi
W=dynjax_pallas_auto16_warm
MODES=${MODES-torch_eager,$W,hand_warm,dynjax_auto16_warm,dynjax_trust_pallas_auto16_warm,${W}_nostore_noprerun,${W}_sw5,torch_eager,$W,hand_warm}
timeout "${T:-540}" python3 -m benchmarks.serve_fresh --out "$OUT" --modes "$MODES" \
  --timeout "${TO:-90}" > "$OUT/cold.log" 2>&1
echo "rc=$?"
grep -A40 "^| mode" "$OUT/cold.log"; grep "ERROR" "$OUT/cold.log" | cut -c1-400
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in glob.glob(sys.argv[1] + "/serve_fresh_*.json"):
  for r in json.load(open(f))["results"]:
    m = r.get("marks", {})
    ph = {k: round(m[k] - m[p], 2) for p, k in (("backend", "requests"), ("requests", "weights"))
          if k in m and p in m}
    st = r.get("stats") or {}
    print(r["mode"], "start->last", r.get("start_to_last_s"), "stream", round(r.get("stream_s", 0), 2),
          ph, "lower_s", st.get("lowering_seconds"), "timeline", r.get("timeline", [])[:5])
PY
