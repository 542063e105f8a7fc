#!/usr/bin/env bash
# Device call (~7 min, H200): session 38's second call, goal 3 of issue 18.
# 1. Four rounds of torch eager, dynjax cold and its restart (on a copy of that round's cold
#    cache), the order alternating between rounds (torch first, then dynjax first), fp32.
# 2. Where a cold dynjax process's threads hold the GIL in its first 17 s (imports to about
#    its first answer): `py-spy record --gil --threads` of one `dynjax_auto16_warm` child
#    (a py-spy binary carried in .tools/, gitignored; skipped without it).  Session 38: its
#    blocking samples slowed the child (warm-up started at 13.3 s against 7.8-9.9) and the 17 s
#    ended before the request list: no usable profile (not kept); `--nonblocking` next time.
source benchmarks/_gpu_head.sh
export PATH=$PWD/.tools:$PATH
A="torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart"
B="dynjax_auto16_warm,dynjax_auto16_warm_restart,torch_eager"
serve_fresh_call fp32 "${T32:-340}" --modes "$A,$B,$A,$B" --timeout 60 --pristine-restarts
if command -v py-spy > /dev/null; then
  rm -rf /tmp/gil_cache
  SERVE_FRESH_T0=$(python3 -c "import time; print(time.time())") timeout 60 py-spy record \
    --gil --threads --format raw --rate 250 --duration 17 -o "$OUT/gil_cold.txt" -- \
    python3 -m benchmarks.serve_fresh --child dynjax_auto16_warm --size base \
    --cache /tmp/gil_cache > /dev/null 2> "$OUT/gil_child.err"
  echo "py-spy rc=$?"; grep "mark\|timeline" "$OUT/gil_child.err" | head -20
fi
