#!/usr/bin/env bash
# Device call (H100, ~5 min): what each step of a bucket's build takes from the GIL
# (probe_gil.py, BERT-base at T=128 and 512), then issue 18's cold start again, alternating
# torch eager, dynjax's cold server warmed up from shapes and the same without cache_dir
# (serve_fresh.py; more samples of run 21's new-tree rows).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for t in 128 512; do
  timeout 120 python3 benchmarks/probe_gil.py --size base --t $t --out "$OUT/gil$t" 2>&1 \
    | grep -E "^  " | sed "s/^/T=$t /"
done
W=dynjax_pallas_auto16_warm
timeout 300 python3 -m benchmarks.serve_fresh --out "$OUT/sf" --timeout 70 \
  --modes "torch_eager,$W,${W}_nostore,$W,torch_eager,${W}_nostore" > "$OUT/sf.log" 2>&1
echo "sf rc=$?"; grep -E "start->last|ERROR" "$OUT/sf.log" | cut -c1-330
