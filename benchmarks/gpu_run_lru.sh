#!/usr/bin/env bash
# One device call (~6-8 min on the H100): jax.lax.associative_scan over a dynamic axis
# (dynjax/bucketing/_scan.py).  Its tests on the GPU, then bench_lru_public.py: the public-idiom
# LRU classifier served and trained on variable-length requests, jax.jit per shape (what the
# fallback did) vs dynjax's buckets, and single lengths timed alone (--at).
source "$(dirname "$0")/_gpu_head.sh"
timeout "${TT:-150}" python3 -m pytest -q -p no:cacheprovider tests/bucketing/test_scan.py \
  > "$OUT/lru_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/lru_tests.log"
tail -3 "$OUT/lru_tests.log"
timeout "${TB:-420}" python3 benchmarks/bench_lru_public.py --requests "${REQ:-40}" \
  --at "${AT:-200,256,300,512}" --out "$OUT" 2>&1 | tee "$OUT/bench_lru_public.log"
