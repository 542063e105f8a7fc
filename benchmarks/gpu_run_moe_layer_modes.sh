#!/usr/bin/env bash
# Device call (H100, ~5 min): issue 19's layer table timed three ways side by side in one
# process (bench_moe_kernels.py --layer-timing call,x4,pipelined): per call (the issue's own
# way: launch + device + sync of one layer), x4 (four layers in one executable / 4) and
# pipelined (16 calls launched back to back, one block: the device's time a layer once the
# host keeps ahead).  Grouped (auto kernel), capacity 1.25 (drops tokens), and one dense FFN of
# the same FLOPs with no routing (the floor).  8 experts uniform/Zipf k=1,2; 64 experts
# uniform/Zipf k=1 without x4 (the dropping layer's x4 build takes > 60 s a variant).
source "$(dirname "$0")/_gpu_head.sh"
export DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_modes
L="--parts layer --layer-kernels hopper --layer-extra ffn --train none --iters ${ITERS:-30}"
timeout 330 python3 benchmarks/bench_moe_kernels.py --out "$OUT/layer8" $L --k 1,2 \
  --settings uniform8,zipf8 --layer-timing call,x4,pipelined > "$OUT/layer8.log" 2>&1
echo "layer 8 rc=$?"; grep -E "^  |==" "$OUT/layer8.log" | cut -c1-120
timeout 200 python3 benchmarks/bench_moe_kernels.py --out "$OUT/layer64" $L --k 1 \
  --settings uniform64,zipf64 --layer-timing call,pipelined > "$OUT/layer64.log" 2>&1
echo "layer 64 rc=$?"; grep -E "^  |==" "$OUT/layer64.log" | cut -c1-120
rm -f "$OUT"/*/*.py
