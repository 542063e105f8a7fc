#!/usr/bin/env bash
# Device call (~6 min, H200/H100): session 37's check of its two changes, in one call.
# 1. bf16 with attention="cudnn", cuDNN executables no longer run ahead on zeros (session 37:
#    1 cold process in 3 and the one before it hung in their weights' upload as a prerun began;
#    session 36: SIGSEGVs with a worker in a prerun's device_put): three cold processes, each
#    followed by a restart on its cache; every one must finish.
# 2. fp32, goal 3 (start to the 1,000th answer): torch eager, dynjax cold, its restart, and a
#    restart that compiles its kept-traffic buckets before traffic (`_startnew`, the rule of
#    sessions 35-36; session 37 ran this as `_restart` = that rule and `_defer_restart` = today's
#    default), two rounds.
# Hangs: Python stacks in the JSON (stderr_tail), the rest in $OUT/hang_*.txt (.tools/py-spy
# on PATH when carried).
source benchmarks/_gpu_head.sh
export PATH=$PWD/.tools:$PATH
C=dynjax_cudnn_auto16_warm
timeout "${T16:-200}" python3 -m benchmarks.serve_fresh --out "$OUT" --dtype bfloat16 \
  --modes "$C,${C}_restart,$C,${C}_restart,$C,${C}_restart" --timeout 40 --pristine-restarts \
  > "$OUT/bf16.log" 2>&1
echo "bf16 rc=$?"
R="torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart,dynjax_auto16_warm_startnew_restart"
timeout "${T32:-300}" python3 -m benchmarks.serve_fresh --out "$OUT" \
  --modes "$R,$R" --timeout 60 --pristine-restarts > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"
for f in bf16 fp32; do grep -A12 "^| mode" "$OUT/$f.log"; grep "ERROR" "$OUT/$f.log" | cut -c1-300; done
python3 - "$OUT" <<'PY'
import json, sys
for dt in ("bfloat16", "float32"):
  for r in json.load(open(f"{sys.argv[1]}/serve_fresh_{dt}.json"))["results"]:
    m = r.get("marks", {})
    print(dt, r["mode"], r.get("error", ""), {k: m.get(k) for k in ("imports", "requests", "weights", "first_answer")},
          (r.get("stats") or {}).get("preruns"))
PY
