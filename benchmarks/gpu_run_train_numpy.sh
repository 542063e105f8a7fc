#!/usr/bin/env bash
# Device call (H100, ~7 min): a BERT-base training loop fed numpy batches, this tree vs the
# session-9 tree (OLD, default bench_old: its dynjax/ only; carry ["bench_old"]), then issue
# 18's serving A/B again in the opposite order (device outputs first).  JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
OLD=${OLD:-bench_old}
mkdir -p "$OUT"
python3 -c "import jax, torch, flax; print('jax', jax.__version__, 'torch', torch.__version__, 'flax', flax.__version__, jax.devices())" | tee "$OUT/versions.txt"
for tree in new old new; do
  if [ $tree = new ]; then PP=$PWD; else PP=$PWD/$OLD:$PWD; fi
  echo "== $tree"
  PYTHONPATH=$PP timeout 150 python3 benchmarks/bench_train_numpy.py --size base --steps 60 \
    --max_len 128 --out "$OUT" --tag "_$tree$RANDOM" 2>&1 | grep -v Warning | tail -3
done
export PYTHONPATH=$PWD
MODES=${MODES-torch_eager,dynjax_auto16_warm_devout,dynjax_auto16_warm,dynjax_auto16_warm_devout_restart,dynjax_auto16_warm_restart}
timeout 260 python3 -m benchmarks.serve_fresh --out "$OUT" --modes "$MODES" --timeout 120 \
  --reps 20 > "$OUT/fp32.log" 2>&1
echo "fp32 rc=$?"; grep -A12 "^| mode" "$OUT/fp32.log"; grep "ERROR\|error" "$OUT/fp32.log" | cut -c1-300
