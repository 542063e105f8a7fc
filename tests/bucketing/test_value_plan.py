"""Value-decided ``auto`` (``max_compiles=None``): the bucket count follows serving seconds saved
per second of compiling; replayed as the dispatcher feeds a policy (no JAX)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynjax


def _cost(t):  # seconds per request: ~ the H100 BERT-base fit (fixed part + T + T^2)
  t = np.asarray(t, float)
  return 2e-3 + 4e-6 * t + 2.4e-8 * t * t


@pytest.fixture(scope="module")
def lengths():
  # Request lengths shaped like the docstring stream (examples.data.request_stream(1000,
  # batch=8, max_len=512)): the longest of 8 log-normal docstring lengths (median 19, p90 103,
  # as measured on CPython's stdlib), capped at 512.  Synthetic: parsing the stdlib costs each
  # test worker ~10 s.
  rng = np.random.default_rng(0)
  docs = np.exp(rng.normal(np.log(19.0), np.log(103 / 19) / 1.2816, size=(1000, 8)))
  return [int(x) for x in np.clip(np.ceil(docs.max(axis=1)), 1, 512)]


def _replay(policy, lengths, calls, compile_s):
  """observe, bucket, record_compile (first use), record_time: what the dispatcher does."""
  built = set()
  stream = (lengths * (calls // len(lengths) + 1))[:calls]
  for n in stream:
    policy.observe(n)
    b = policy.bucket(n)
    assert b is not None and b >= n
    if b not in built:
      built.add(b)
      policy.record_compile(b, compile_s)
    policy.record_time(b, float(_cost(b)))
  return built


def _ratio(policy, lengths):
  """Traffic-weighted cost of the final table over the exact-shape cost."""
  table = np.array(policy.sizes())
  n = np.asarray(lengths)
  return float(_cost(table[np.searchsorted(table, n)]).sum() / _cost(n).sum())


def test_large_traffic_comes_within_5_percent_of_exact_shapes(lengths):
  value = dynjax.buckets.auto(None, 16, 512)
  built = _replay(value, lengths, 300_000, compile_s=2.5)
  fixed = dynjax.buckets.auto(8, 16, 512)
  _replay(fixed, lengths, 300_000, compile_s=2.5)
  r_value, r_fixed = _ratio(value, lengths), _ratio(fixed, lengths)
  assert r_value < 1.05 < r_fixed  # 8 buckets cannot get there on this stream
  assert 8 < len(value.sizes()) <= 64 and len(built) <= len(value.sizes())
  pow2 = dynjax.buckets.pow2(16, 512)
  assert _ratio(pow2, lengths) > 1.15


def test_tiny_traffic_or_expensive_compiles_plan_few_buckets(lengths):
  tiny = dynjax.buckets.auto(None, 16, 512)
  _replay(tiny, lengths, 64, compile_s=2.5)
  fixed = dynjax.buckets.auto(8, 16, 512)
  _replay(fixed, lengths, 64, compile_s=2.5)
  assert len(tiny.sizes()) == 1 < 4 <= len(fixed.sizes())  # 64 calls: no compile pays off
  costly = dynjax.buckets.auto(None, 16, 512)
  _replay(costly, lengths, 100_000, compile_s=300.0)
  cheap = dynjax.buckets.auto(None, 16, 512)
  _replay(cheap, lengths, 100_000, compile_s=0.5)
  assert len(costly.sizes()) <= 3 < len(cheap.sizes())


def test_the_first_bucket_comes_when_its_savings_pass_its_compile(lengths):
  # Serving everything on 512 costs ~2.6x exact; the best second bucket saves ~4.6 ms a
  # request.  With a 2.5 s compile and a horizon of 2x the calls seen, that pays off at
  # ~270 calls: the plan at 256 calls is still one bucket, the one at 512 adds it.
  p = dynjax.buckets.auto(None, 16, 512)
  _replay(p, lengths, 300, compile_s=2.5)
  assert p.sizes() == (512,)
  _replay(p, lengths[300:] + lengths[:212], 212, compile_s=2.5)
  assert len(p.sizes()) >= 2


@settings(max_examples=30, deadline=None)
@given(lo=st.integers(1, 200), span=st.integers(0, 400), seed=st.integers(0, 10**6),
       k=st.sampled_from([None, 3, 8]))
def test_never_a_bucket_below_min_or_above_max(lo, span, seed, k):
  hi = lo + span
  rng = np.random.default_rng(seed)
  p = dynjax.buckets.auto(k, lo, hi)
  for n in rng.integers(1, hi + 1, 600):
    p.observe(int(n))
    b = p.bucket(int(n))
    assert b is not None and max(int(n), lo) <= b <= hi
    p.record_compile(b, 0.01)
    p.record_time(b, float(_cost(b)))
  assert all(lo <= b <= hi for b in p.sizes()) and p.sizes()[-1] == hi


def test_replan_time_at_512_candidates_and_budget_64():
  # 512 candidates (max=4096, align 8) thinned to 128 by cost; the DP runs <= 64 rows.
  rng = np.random.default_rng(0)
  for k in (64, None):
    p = dynjax.buckets.auto(k, 1, 4096)
    for b in (512, 1024, 2048, 4096):
      p.record_time(b, float(_cost(b)))
      p.record_time(b, float(_cost(b)))
    p.record_compile(4096, 2.5)
    for n in rng.integers(1, 4097, 1 << 14):
      p.observe(int(n))
    assert p.replans >= 1
    t0 = time.perf_counter()
    p.plan()
    plan_s = time.perf_counter() - t0
    assert p.last_plan_seconds < 0.05 and plan_s < 0.05  # measured ~3 ms; a loaded box
