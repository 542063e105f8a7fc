#!/usr/bin/env bash
# Device call (H100): XLA:GPU's CUDA graphs ("command buffers") on and off, side by side in
# one process each (benchmarks/_xla_options.py: "nocb" = no CUDA graphs, "nocc" = graphs
# without custom calls such as the Mosaic GPU kernels).  PARTS (default layer; each part takes
# ~5-6 min, so run one a device call) picks:
#   layer   issue 19's MoE layer (bench_moe_kernels.py, four layers in one executable / 4 and
#           per call): the grouped layer, the dropping layer, one dense FFN of the same FLOPs
#   e2e     issue 19's MoE encoder taking turns per request (bench_moe_gmm.py --parts e2e),
#           grouped / ragged_dot / dense, grouped, dense and the block without experts nocb
#   lengths issue 18's BERT-base per exact length (serve_fresh.py lengths, lengths_nocb)
#   requests issue 19's e2e encoder one request at a time under jax.jit
#           (probe_moe_profile.py --parts requests): none / grouped / dense, each with the
#           defaults, nocb and nocc: the host's time before the first kernel, device time
#           (REQ_MODELS, REQ_OPTIONS; E2E_VARIANTS, E2E_OPTIONS, INTERLEAVE for the e2e;
#           an empty *_OPTIONS: the defaults only)
# Results: $OUT/{layer_x4,layer_call,e2e,serve,requests}/ and one log each.
source "$(dirname "$0")/_gpu_head.sh"
PARTS=${PARTS:-layer}
export DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_cb
if [[ ,$PARTS, == *,layer,* ]]; then
  L="--parts layer --layer-kernels hopper --train none --iters ${ITERS:-20} --xla-options nocb,nocc"
  # x4 builds take ~10 s a variant and option set (run 16 cut both x4 runs at 150 s)
  timeout 240 python3 benchmarks/bench_moe_kernels.py --out "$OUT/layer_x4" $L --k 1 \
    --layer-timing x4 --settings uniform8,zipf8 --layer-extra ffn > "$OUT/layer_x4.log" 2>&1
  echo "layer x4 rc=$?"; grep -E "^  |==" "$OUT/layer_x4.log" | cut -c1-120
  # 64 experts: the dropping layer's x4 build takes > 60 s a variant (timed per call below)
  timeout 120 python3 benchmarks/bench_moe_kernels.py --out "$OUT/layer_x4_64" $L --k 1 \
    --layer-timing x4 --settings uniform64,zipf64 --layer-extra ffn --layer-skip capacity \
    > "$OUT/layer_x4_64.log" 2>&1
  echo "layer x4 64 rc=$?"; grep -E "^  |==" "$OUT/layer_x4_64.log" | cut -c1-120
  timeout 150 python3 benchmarks/bench_moe_kernels.py --out "$OUT/layer_call" $L --k 1 \
    --layer-timing call --settings uniform8,uniform64 --layer-extra ffn \
    > "$OUT/layer_call.log" 2>&1
  echo "layer call rc=$?"; grep -E "^  |==" "$OUT/layer_call.log" | cut -c1-120
fi
if [[ ,$PARTS, == *,requests,* ]]; then
  mkdir -p "$OUT/requests"
  timeout ${TR:-250} python3 benchmarks/probe_moe_profile.py --out "$OUT/requests" \
    --parts requests --request-lengths 128,256,512 \
    --request-models ${REQ_MODELS:-none,grouped,dense} \
    --request-xla-options "${REQ_OPTIONS-nocb,nocc}" --iters 20 > "$OUT/requests.log" 2>&1
  echo "requests rc=$?"; grep -E "==|: wall|a call \(median\)" "$OUT/requests.log" | cut -c1-160
  rm -f "$OUT"/requests/hlo_*.txt
fi
if [[ ,$PARTS, == *,e2e,* ]]; then
  timeout ${TE:-330} python3 benchmarks/bench_moe_gmm.py --out "$OUT/e2e" --parts e2e \
    --e2e-requests 200 --e2e-variants ${E2E_VARIANTS:-grouped,ragged_dot,dense} \
    --e2e-xla-options "${E2E_OPTIONS-nocb}" --e2e-interleave ${INTERLEAVE:-0} \
    > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"; grep -E "e2e|no MoE|mean|FAILED" "$OUT/e2e.log" | cut -c1-200
fi
if [[ ,$PARTS, == *,lengths,* ]]; then
  timeout 400 python3 -m benchmarks.serve_fresh --out "$OUT/serve" \
    --modes "${MODES:-lengths,lengths_nocb}" --timeout 190 > "$OUT/serve.log" 2>&1
  echo "serve rc=$?"; tail -30 "$OUT/serve.log"
fi
rm -f "$OUT"/*/*.py
