#!/usr/bin/env bash
# Device call (H100, ~6 min): where issue 18's cold fp32 start goes, this tree against an older
# one (OLD=dir holding its dynjax/, benchmarks/, examples/; default bench_old), alternating:
# torch eager and dynjax's cold server warmed up from shapes at start-up (BERT-base, 1,000
# requests, serve_fresh.py), the same without a cache_dir (`_nostore`: what the store's writes
# cost), then the MoE e2e with the variants taking turns per request (bench_moe_gmm.py).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
OLD=${OLD:-bench_old}
NEW=$PWD
mkdir -p "$OUT"
python3 -c "import sys, jax, torch; print('python', sys.version.split()[0], 'jax', jax.__version__, 'torch', torch.__version__, jax.devices())"
sf() {  # tree, name, modes
  (cd "$1" && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.serve_fresh --out "$OUT/$2" \
    --modes "$3" --timeout 70 > "$OUT/$2.log" 2>&1)
  echo "$2 rc=$?"; grep -E "start->last|ERROR" "$OUT/$2.log" | cut -c1-330
}
W=dynjax_pallas_auto16_warm
sf "$NEW" new1 "torch_eager,$W"
sf "$OLD" old1 "$W"
sf "$NEW" new2 "${W}_nostore,$W"
sf "$OLD" old2 "$W"
sf "$NEW" new3 torch_eager
(PYTHONPATH=$PWD timeout 150 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e" --parts e2e \
  --e2e-requests 200 --budget 200 --e2e-variants grouped,ragged_dot,dense > "$OUT/e2e.log" 2>&1)
echo "e2e rc=$?"; grep -E "e2e|no MoE|interleaved|    |FAILED" "$OUT/e2e.log" | cut -c1-200
rm -f "$OUT"/*/*.py
