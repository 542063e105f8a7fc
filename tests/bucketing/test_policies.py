"""Bucket policies are plain objects: tested without JAX."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dynjax
from dynjax import buckets as B


def test_tables():
  assert B.pow2(16, 100).sizes() == (16, 32, 64, 100)
  assert B.pow2(1, 8).sizes() == (1, 2, 4, 8)
  assert B.linear(32, 1, 128).sizes() == (32, 64, 96, 128)
  assert B.geometric(2.0, 10, 100).sizes() == (10, 20, 40, 80, 100)
  assert B.explicit([128, 8, 32]).sizes() == (8, 32, 128)


@pytest.mark.parametrize("policy", [B.pow2(4, 300), B.linear(24, 1, 300),
                                    B.geometric(1.3, 3, 300), B.explicit([5, 50, 300])])
@given(n=st.integers(1, 300))
def test_bucket_is_smallest_size_at_least_n(policy, n):
  b = policy.bucket(n)
  assert b >= n and b in policy.sizes()
  assert all(s < n for s in policy.sizes() if s < b)


def test_over_max_and_grow():
  p = B.pow2(4, 64)
  assert p.bucket(65) is None
  assert p.grow(65) == 128
  assert B.explicit([8, 32]).grow(33) == 64
  assert B.linear(10, 1, 30).grow(31) == 40


def test_unbounded_policies():
  p = B.pow2()
  assert p.bucket(1000) == 1024
  with pytest.raises(dynjax.PolicyError, match="has no max"):
    p.sizes()


def test_aligned():
  p = B.pow2(3, 100).aligned(8)
  assert all(s % 8 == 0 for s in p.sizes())
  assert p.bucket(9) == 16 and p.bucket(3) == 8
  assert B.linear(12, 1, 48).aligned(8).sizes() == (16, 24, 40, 48)  # 12,24,36,48 rounded up


def test_expected_waste():
  assert B.explicit([4]).expected_waste([1, 2, 3, 4]) == pytest.approx(1 - 10 / 16)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: B.pow2(min=0), "dynjax.buckets.pow2: min must be >= 1, got 0"),
        (lambda: B.pow2(16, 8), "dynjax.buckets.pow2: max=8 is smaller than min=16; give max >= min"),
        (lambda: B.linear(0), "dynjax.buckets.linear: step must be >= 1, got 0"),
        (lambda: B.geometric(1.0), "dynjax.buckets.geometric: ratio must be a number > 1, got 1.0"),
        (lambda: B.explicit([]), "dynjax.buckets.explicit: sizes is empty; give at least one size"),
        (lambda: B.explicit([4, "8"]),
         "dynjax.buckets.explicit: sizes[1] must be an integer, got str '8'"),
        (lambda: B.auto(max_compiles=0), "dynjax.buckets.auto: max_compiles must be >= 1, got 0"),
        (lambda: B.pow2(1.5), "dynjax.buckets.pow2: min must be an integer, got float 1.5"),
    ],
)
def test_bad_arguments(call, message):
  with pytest.raises(dynjax.PolicyError) as e:
    call()
  assert str(e.value) == message
  assert isinstance(e.value, ValueError)


def _stream(seed, n=2000):
  rng = random.Random(seed)
  return [min(512, max(1, int(rng.lognormvariate(3, 1.2)))) for _ in range(n)]


@pytest.mark.parametrize("k", [3, 6, 8])
def test_auto_respects_compile_budget_and_covers_everything(k):
  p = B.auto(max_compiles=k, max=512)
  used = set()
  for n in _stream(k):
    b = p.bucket(n)
    assert b is not None and b >= n
    used.add(b)
    p.observe(n)
  assert len(used) <= k
  assert p.replans >= 1


def test_auto_beats_pow2_on_skewed_lengths():
  xs = _stream(1)
  p = B.auto(max_compiles=8, max=512)
  for n in xs:
    p.bucket(n)
    p.observe(n)
  assert p.expected_waste(xs) < B.pow2(16, 512).expected_waste(xs)


def test_auto_hysteresis_keeps_plan_on_stationary_stream():
  p = B.auto(max_compiles=8, max=512)
  xs = _stream(2, 4000)
  for n in xs[:2000]:
    p.bucket(n)
    p.observe(n)
  plan, replans = p.sizes(), p.replans
  for n in xs[2000:]:
    p.bucket(n)
    p.observe(n)
  assert p.replans - replans <= 1 and set(plan) <= set(p.sizes()) | set(plan)


def test_auto_uses_measured_times():
  p = B.auto(max_compiles=4, max=256)
  # Buckets above 64 are measured 10x as costly per element: the planner should split there.
  for b in (64, 128, 256):
    p.record_time(b, b * (1.0 if b <= 64 else 10.0))
  cost = p._cost_fn()
  assert cost(256) > cost(64) * 4


def test_fresh_copies_do_not_share_history():
  p = B.auto(max_compiles=4, max=64)
  q = p.fresh()
  for n in range(1, 40):
    p.observe(n)
  assert q._n_obs == 0 and repr(q) == repr(p)


def test_auto_default_budget_is_16_when_serving_on_gpu_8_otherwise(monkeypatch):
  import jax.numpy as jnp

  from dynjax.jit import _serving

  on_gpu = {"v": True}
  monkeypatch.setattr(_serving, "on_gpu", lambda: on_gpu["v"])

  def f(x):
    return jnp.sin(x) * 2.0

  got = []
  for serving, buckets in ((False, B.auto(max=64)), (True, B.auto(max=64)),
                           (True, B.auto(max_compiles=8, max=64))):
    g = dynjax.jit(f, dims={"x": "t"}, buckets=buckets, serving=serving)
    x = jnp.arange(5.0)
    assert jnp.array_equal(g(x), f(x))
    got.append(g.stats()["policies"]["t"])
  assert "max_compiles=8," in got[0]
  assert "max_compiles=16," in got[1]  # auto() without max_compiles, serving
  assert "max_compiles=8," in got[2]  # an explicit 8 stays 8
  on_gpu["v"] = False  # serving on a CPU: compiles share the cores that serve
  g = dynjax.jit(f, dims={"x": "t"}, buckets=B.auto(max=64), serving=True)
  g(jnp.arange(5.0))
  assert "max_compiles=8," in g.stats()["policies"]["t"]
  assert repr(B.auto(max=64)) == repr(B.auto(max_compiles=8, max=64))


def test_auto_max_compiles_rejects_other_strings():
  with pytest.raises(dynjax.PolicyError, match=r"max_compiles='many' is not valid.*\"default\""):
    B.auto(max_compiles="many")
