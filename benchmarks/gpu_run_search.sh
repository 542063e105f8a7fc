#!/usr/bin/env bash
# One device call (~5-7 min on the H100): jnp.searchsorted / digitize / interp into a
# dynamic-length array (dynjax/bucketing/_search.py) and the associative scan's reading fn
# (bucketing/_scan.py, session 22).  Their tests on the GPU, then bench_search.py: the
# public-idiom irregular-series classifier served on requests of varying observation counts,
# jax.jit per shape (what the fallback did) vs dynjax's buckets, single counts timed alone.
source "$(dirname "$0")/_gpu_head.sh"
timeout "${TT:-200}" python3 -m pytest -q -p no:cacheprovider tests/bucketing/test_search.py \
  tests/bucketing/test_scan.py -k "not linen and not lru" > "$OUT/search_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/search_tests.log"
tail -3 "$OUT/search_tests.log"
timeout "${TB:-360}" python3 benchmarks/bench_search.py --requests "${REQ:-60}" \
  --at "${AT:-300,1000,3000}" --out "$OUT" 2>&1 | tee "$OUT/bench_search.log"
