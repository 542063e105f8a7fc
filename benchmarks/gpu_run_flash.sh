#!/usr/bin/env bash
# Device call: dynjax's Pallas flash attention (attention="pallas") on the GPU, ~5 min on the
# H100: its tests on the real kernel, the attention block alone per T and block size against
# XLA, cuDNN and PyTorch SDPA (probe_attention.py), and BERT-base per exact length with and
# without the rewrite (serve_fresh.py's `lengths` mode, fp32 then bf16).  JSON + logs in $OUT.
source "$(dirname "$0")/_gpu_head.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/bucketing/test_flash.py \
  tests/bucketing/test_attention.py > "$OUT/flash_tests.log" 2>&1
echo "tests rc=$?"; tail -5 "$OUT/flash_tests.log"
timeout 150 python3 benchmarks/probe_attention.py --only_attention --ts "${TS:-256,448}" \
  --out "$OUT/probe_flash.json" > "$OUT/probe_flash.log" 2>&1
echo "probe rc=$?"; grep -E "pallas|torch|einsum|cudnn_lengths" "$OUT/probe_flash.log"
for dt in ${DTYPES:-float32 bfloat16}; do
  timeout "${TL:-150}" python3 -m benchmarks.serve_fresh --out "$OUT/$dt" --modes lengths \
    --dtype "$dt" --lengths "${LENGTHS:-141,300,450}" --reps 20 > "$OUT/lengths_$dt.log" 2>&1
  echo "lengths $dt rc=$?"; grep -A8 "^| T" "$OUT/lengths_$dt.log"
done
rm -f "$OUT"/*.hlo.txt
