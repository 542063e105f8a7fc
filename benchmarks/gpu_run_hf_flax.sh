#!/usr/bin/env bash
# One device call (~6 min on the H100): benchmarks/probe_hf_flax.py on the GPU.  The device has
# no network: transformers 4.57 and its pure-Python/abi3 dependencies come as wheels carried in
# bench_old/hfwheels (pass carry: ["bench_old"]), installed --no-deps into /tmp/hfpkgs (the
# device's jax, flax, optax and numpy stay as they are).
source "$(dirname "$0")/_gpu_head.sh"
python3 -m pip install -q --no-deps --no-index --target /tmp/hfpkgs bench_old/hfwheels/*.whl \
  2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/hfpkgs
timeout "${T:-480}" python3 benchmarks/probe_hf_flax.py --out "$OUT" --stream "${STREAM:-30}" \
  --models "${MODELS:-gpt2,llama,bert,roformer,bart,wav2vec2}" --train "${TRAIN:-gpt2,llama}" \
  2>&1 | grep -v "deprecated" | tee "$OUT/probe_hf_flax.log"
