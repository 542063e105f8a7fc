#!/usr/bin/env bash
# Device call (H100, ~8 min): the hopper kernel's paired 64-row tiles (_hopper.PAIR_TILES) at 64
# experts, on and off side by side: the two GEMMs alone (device time under jax.profiler, error
# against float32), the layer's device time (x4 in one executable), then the layer's wall
# (bench_moe_kernels x4 timing, issue 19's table) with pairs on and off in alternating processes.
source benchmarks/_gpu_head.sh
LOG="$OUT/pairs.log"
mkdir -p "$OUT/g64" "$OUT/layers64"
timeout "${TG:-230}" python3 benchmarks/probe_moe_profile.py --out "$OUT/g64" --parts gemms \
  --gemm-settings "${GS:-uniform64,zipf64}" --no-cublas --knobs "${KN:-1,1+p0}" --iters 10 \
  > "$LOG" 2>&1
echo "gemms rc=$?" | tee -a "$LOG"
timeout "${TL:-150}" python3 benchmarks/probe_moe_profile.py --out "$OUT/layers64" \
  --parts layers --specs "${SPECS:-uniform64:1,zipf64:1}" --variants grouped --knobs "${KN:-1,1+p0}" \
  --iters 10 --top 6 >> "$LOG" 2>&1
echo "layers rc=$?" | tee -a "$LOG"
rm -f "$OUT"/layers64/hlo_*.txt
for round in 1 2; do
  for pair in 1 0; do
    mkdir -p "$OUT/wall_p${pair}_r${round}"
    timeout "${TW:-100}" python3 -c "
import runpy, sys
from dynjax.route import _hopper
_hopper.PAIR_TILES = bool($pair)
sys.argv = ['bench_moe_kernels.py', '--out', '$OUT/wall_p${pair}_r${round}', '--parts', 'layer',
            '--settings', '${S64:-uniform64,zipf64}', '--k', '1', '--layer-kernels', 'hopper',
            '--hopper-layer', '', '--layer-extra', 'ffn', '--layer-skip', 'capacity',
            '--layer-timing', 'x4', '--train', 'none']
runpy.run_path('benchmarks/bench_moe_kernels.py', run_name='__main__')
" >> "$LOG" 2>&1
    echo "wall pairs=$pair round=$round rc=$?" | tee -a "$LOG"
  done
done
rm -f "$OUT"/wall_*/*.py
grep -E "^  [a-z]|rc=|rel err|FAILED|^==|ms  \(min" "$LOG" | cut -c1-170
# At most a few files come back from a device call: one archive of the JSON, the log beside it.
(cd "$OUT" && tar czf pairs_json.tgz g64 layers64 wall_* versions.txt && rm -rf g64 layers64 wall_*)
