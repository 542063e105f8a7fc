#!/usr/bin/env bash
# Device call (~4.5 min, H200): session 39. Does a thread of the JAX runtime keep a core busy
# while the request list is built (the list's CPU seconds run 1-2.5 s higher in dynjax's
# processes than in torch's on some calls, restarts included)? Every serve_fresh mark now
# records the process's CPU and its busiest threads since the mark before.
# 1. probe_list_cpu: the list alone beside nothing, torch with BERT-base on the GPU, jax with
#    the weights on it; 2. two serve_fresh rounds of torch eager, dynjax cold and restart.
source benchmarks/_gpu_head.sh
timeout 150 python3 benchmarks/probe_list_cpu.py --modes bare,torch,jax --rounds 2 \
  --out "$OUT" > "$OUT/list.log" 2>&1
echo "list rc=$?"; grep median "$OUT/list.log"
serve_fresh_call fp32 "${T32:-300}" --rounds 2 \
  --modes torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart --timeout 60 --pristine-restarts
python3 - "$OUT/serve_fresh_float32.json" "$OUT/probe_list_cpu.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
  w = r.get("work", {}).get("requests", {})
  print(r["mode"], "requests:", w.get("busiest_threads"), "process-main",
        round(w.get("process_cpu_s", 0) - w.get("main_cpu_s", 0), 2))
for r in json.load(open(sys.argv[2]))["rounds"]:
  print(r["mode"], r.get("list_main_cpu_s"), r.get("busiest_threads", r.get("error", ""))[:300])
PY
