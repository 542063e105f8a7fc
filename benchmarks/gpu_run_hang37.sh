#!/usr/bin/env bash
# Device call (~6 min, H200): session 37's look at the cold bf16 cuDNN process that hung
# (gpu_run_verify36.sh: `dynjax_cudnn_auto16_warm` timed out after 60 s, its restarts ran).
# 1. probe_cudnn_hang: plain JAX, a cuDNN-attention compile in a thread beside a big upload.
# 2. Cold serve_fresh processes, each on a fresh cache: the start-up warm-up as shipped, and
#    with the quick tier's autotuning off (_t0lvl0; session 37's rows ran as `_at0`, the same
#    setting).  A child past --timeout prints every thread's Python stack (SIGUSR1) into the
#    JSON's stderr_tail, and the GPU's load, its threads' wait channels and native stacks
#    (py-spy, carried in .tools/) into $OUT/hang_<mode>_<pid>.txt.
source benchmarks/_gpu_head.sh
export PATH=$PWD/.tools:$PATH
timeout "${TP:-200}" python3 -m benchmarks.probe_cudnn_hang --out "$OUT" \
  --variants "${VARIANTS:-cudnn,cudnn_at0,cudnn_at1,xla}" --rounds "${ROUNDS:-16}" \
  > "$OUT/probe.log" 2>&1
echo "probe rc=$?"; cat "$OUT/probe.log"
M=dynjax_cudnn_auto16_warm
timeout "${T:-300}" python3 -m benchmarks.serve_fresh --out "$OUT" --dtype bfloat16 \
  --modes "${MODES:-$M,${M}_t0lvl0,$M,${M}_t0lvl0,$M,${M}_t0lvl0}" --timeout "${TO:-35}" \
  > "$OUT/bf16.log" 2>&1
echo "bf16 rc=$?"
grep -A10 "^| mode" "$OUT/bf16.log"
python3 - "$OUT/serve_fresh_bfloat16.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
  if "error" in r:
    print("=====", r["mode"], r["error"], r.get("stacks_file"))
    t = r.get("stderr_tail", "")
    print(t[:t.find("Thread 0x")][-1200:])
PY
for f in "$OUT"/hang_*.txt; do [ -f "$f" ] && head -c 1500 "$f"; done
