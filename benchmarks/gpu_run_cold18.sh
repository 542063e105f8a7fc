#!/usr/bin/env bash
# Device call (H100, ~6 min): where a cold dynjax server's start-up Python loses its time
# (issue 18 goal 3).  Fresh processes (benchmarks/serve_fresh.py, fp32, BERT-base, 1,000
# requests), each warming up from shapes while it builds its request list: torch eager,
# dynjax with and without its parts (Pallas attention, padding pass, store and preruns, the
# 0.5 ms GIL switch interval), the hand-written warmup; MODES overrides the list, ROUNDS
# repeats it (default 1), and OLD=dir (a directory holding another tree's dynjax/) runs
# OLD_MODES (default: the Pallas auto(16) warm-up) on that tree after each round.  First
# (PROBE= skips it) benchmarks/probe_gil.py: each step of one bucket's build beside a spinning
# thread and a spinning process (the GIL or the cores).  The summary gives each mode's request
# list phase: wall, main-thread CPU, the garbage collector's seconds and full collections, and
# the heap's allocated blocks when it began (serve_fresh's ``work`` record).
source "$(dirname "$0")/_gpu_head.sh"
if [ -n "${PROBE-1}" ]; then  # what one bucket's build takes from a thread and from a process
  timeout 200 python3 benchmarks/probe_gil.py --size base --t 128 --attention pallas \
    --out "$OUT/gil" 2>&1 | grep -E "^  |Error"
fi
W=dynjax_pallas_auto16_warm
MODES=${MODES-torch_eager,$W,hand_warm,dynjax_auto16_warm,dynjax_trust_pallas_auto16_warm,${W}_nostore_noprerun,${W}_sw5,torch_eager,$W,hand_warm}
OLD_MODES=${OLD_MODES-$W}
for i in $(seq 1 "${ROUNDS:-1}"); do
  timeout "${T:-540}" python3 -m benchmarks.serve_fresh --out "$OUT/r$i" --modes "$MODES" \
    --timeout "${TO:-90}" > "$OUT/cold_r$i.log" 2>&1
  echo "round $i rc=$?"
  if [ -n "${OLD:-}" ]; then
    PYTHONPATH=$PWD/$OLD:$PWD timeout "${T:-540}" python3 -m benchmarks.serve_fresh \
      --out "$OUT/r${i}_old" --modes "$OLD_MODES" --timeout "${TO:-90}" \
      > "$OUT/cold_r${i}_old.log" 2>&1
    echo "round $i (old tree) rc=$?"
  fi
done
grep -h "ERROR" "$OUT"/cold_r*.log | cut -c1-400
python3 - "$OUT" <<'PY'
import json, sys, glob, os, shutil
merged = {}
for f in sorted(glob.glob(sys.argv[1] + "/r*/serve_fresh_*.json")):
  tree = "old" if "_old" in f else "new"
  merged[f.split("/")[-2]] = json.load(open(f))
  for r in merged[f.split("/")[-2]]["results"]:
    m, w = r.get("marks", {}), r.get("work", {})
    st = r.get("stats") or {}
    lst = {}
    if "backend" in w and "requests" in w:
      a, b = w["backend"], w["requests"]
      lst = {"wall": round(m["requests"] - m["backend"], 2),
             "main_cpu": round(b["main_cpu_s"] - a["main_cpu_s"], 2),
             "gc_s": round(b["gc_s"] - a["gc_s"], 2), "gc_full": b["gc_full"] - a["gc_full"],
             "blocks_at_start": a.get("allocated_blocks", a.get("tracked_objects"))}
    print(f.split("/")[-2], tree, r["mode"], "start->last", r.get("start_to_last_s"),
          "stream", round(r.get("stream_s", 0), 2), "list", lst, "weights",
          round(m.get("weights", 0) - m.get("requests", 0), 2), "lower_s",
          st.get("lowering_seconds"), "compiles", st.get("compiles"), "lowerings",
          st.get("lowerings"), "waited", st.get("waited_for_compile"))
    for t, msg in r.get("timeline", []):
      if "failed" in msg:
        print("   ", t, msg[:300], "...", msg[-700:])
# at most 8 files come back from a device call: one JSON and one log for all rounds
json.dump(merged, open(os.path.join(sys.argv[1], "cold_rounds.json"), "w"), indent=1)
with open(os.path.join(sys.argv[1], "cold_rounds.log"), "w") as out:
  for f in sorted(glob.glob(sys.argv[1] + "/cold_r*.log")):
    out.write(f"== {os.path.basename(f)}\n" + open(f).read())
    os.remove(f)
for d in glob.glob(sys.argv[1] + "/r*/"):
  shutil.rmtree(d)
PY
