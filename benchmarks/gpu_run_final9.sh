#!/usr/bin/env bash
# Device call (H100, ~4 min): session 9's final tree: the MoE e2e (cast once with its
# thresholds; variants also taking turns per request) and the NNX numpy-request bench.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
timeout 200 python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e" --parts e2e --e2e-requests 200 \
  --budget 200 --e2e-variants grouped,ragged_dot,dense > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"; grep -E "e2e|no MoE|interleaved|    |FAILED" "$OUT/e2e.log" | cut -c1-200
python3 -c "import json; d=json.load(open('$OUT/e2e/bench_moe_gmm.json'))['e2e']['methods']; print({k: (v.get('cast_once'), v.get('hlo_f32_expert_weights')) for k, v in d.items()})"
timeout 100 python3 benchmarks/bench_nnx_state.py --out "$OUT/nnx" 2>&1 | grep -v Warning
rm -f "$OUT"/*/*.py
