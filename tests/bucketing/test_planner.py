"""The auto planner on recorded request streams (deterministic, no GPU): padded fraction and
compile count versus pow2 and the offline optimum for the same budget; joint planning of two
dimensions versus planning each alone."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax.bucketing._auto import Auto
from dynjax.bucketing._joint import JointPlan
from examples import data


@pytest.fixture(scope="module")
def docstring_lengths():
  # 1,000 requests of batch 8 from the standard library's docstrings (the benchmark stream).
  return [r.length for r in data.request_stream(1000, batch=8, max_len=512, seed=0)]


def _padded_fraction(lengths, bucket_of):
  true = sum(lengths)
  padded = sum(bucket_of(n) for n in lengths)
  return 1.0 - true / padded


def _online(policy, lengths):
  """Feeds the stream as the dispatcher does (observe, then bucket): (fraction, compiles)."""
  used = []
  for n in lengths:
    policy.observe(n)
    used.append(policy.bucket(n))
  return 1.0 - sum(lengths) / sum(used), len(set(used))


def _offline_optimum(lengths, budget, lo, hi):
  opt = Auto(budget, lo, hi)
  for n in lengths:
    opt._hist[n] += 1
  opt._n_obs = len(lengths)
  table = opt.plan()
  assert len(table) <= budget and table[-1] == hi
  return _padded_fraction(lengths, lambda n: next(b for b in table if b >= n)), table


def test_auto_on_the_docstring_stream_beats_pow2_near_the_offline_optimum(docstring_lengths):
  lengths = docstring_lengths
  pow2 = dynjax.buckets.pow2(16, 512)
  pow2_frac, pow2_compiles = _online(pow2, lengths)
  auto_frac, auto_compiles = _online(dynjax.buckets.auto(8, 16, 512), lengths)
  opt_frac, table = _offline_optimum(lengths, 8, 16, 512)
  print(f"\npadded fraction: pow2 {pow2_frac:.1%} ({pow2_compiles} compiles), auto "
        f"{auto_frac:.1%} ({auto_compiles}), offline optimum {opt_frac:.1%} ({len(table)}: "
        f"{table})")
  assert pow2_compiles == 6 and auto_compiles <= 8
  assert opt_frac < auto_frac < pow2_frac
  assert auto_frac - opt_frac < 0.08  # the online plan pays for its early guesses, boundedly
  # The same budget as pow2 (6 compiles): still less padding than pow2.
  auto6, c6 = _online(dynjax.buckets.auto(6, 16, 512), lengths)
  assert c6 <= 6 and auto6 < pow2_frac


def _two_dim_stream(lengths):
  # Variable batch too: long requests come in small batches (a token budget of 4,096).
  rng = np.random.default_rng(0)
  return [(int(min(64, max(1, 4096 // t + rng.integers(-2, 3)))), t) for t in lengths]


def _online_2d(choose, stream):
  used = [choose(b, t) for b, t in stream]
  true = sum(b * t for b, t in stream)
  assert all(bb >= b and tt >= t for (b, t), (bb, tt) in zip(stream, used, strict=True))
  return 1 - true / sum(b * t for b, t in used), len(set(used))


def test_joint_plan_pads_less_than_per_dim_plans_for_the_same_compile_budget(docstring_lengths):
  stream = _two_dim_stream(docstring_lengths)
  joint = JointPlan((dynjax.buckets.auto(8, 1, 64), dynjax.buckets.auto(8, 16, 512)), (0, 1),
                    max_compiles=8)

  def choose_joint(b, t):
    joint.observe((b, t))
    return joint.bucket((b, t))

  frac_joint, n_joint = _online_2d(choose_joint, stream)
  assert n_joint <= 8
  report = [f"joint {frac_joint:.1%} ({n_joint} executables)"]
  for kb in range(1, 9):  # every per-dimension split whose product fits the same budget
    kt = 8 // kb
    qb, qt = dynjax.buckets.auto(kb, 1, 64), dynjax.buckets.auto(kt, 16, 512)

    def choose_prod(b, t, qb=qb, qt=qt):
      qb.observe(b)
      qt.observe(t)
      return qb.bucket(b), qt.bucket(t)

    frac, n = _online_2d(choose_prod, stream)
    report.append(f"{kb}x{kt}: {frac:.1%} ({n})")
    assert n <= 8 and frac_joint < frac
  print("\n2-D stream, padded fraction: " + ", ".join(report))


def test_joint_planning_through_dynjax_jit_is_exact_and_within_budget(compiles):
  def f(x):
    return jnp.cumsum(jnp.tanh(x), axis=1).mean(0)

  g = dynjax.jit(f, dims={"x": "b, t"},
                 buckets={"b": dynjax.buckets.auto(4, 1, 16), "t": dynjax.buckets.auto(4, 1, 64)})
  exact = jax.jit(f)
  rng = np.random.default_rng(0)
  shapes = [(int(b), int(t)) for b, t in zip(rng.integers(1, 17, 40), rng.integers(1, 65, 40),
                                            strict=True)]
  for b, t in shapes:
    x = rng.standard_normal((b, t)).astype(np.float32)
    np.testing.assert_allclose(g(x), exact(x), rtol=2e-5, atol=2e-5)
  fam = g.trace(x).family  # the one family (the stage API, not a private field)
  assert fam.joint is not None and fam.joint.replans >= 1
  assert g.stats()["compiles"] <= 4 and len(fam.joint.sizes()) <= 4
  assert "jointly planned ['b', 't']" in g.explain()


def test_joint_plan_alone_prefers_the_tuples_the_traffic_needs():
  pb, pt = dynjax.buckets.auto(3, 1, 64), dynjax.buckets.auto(3, 1, 512)
  joint = JointPlan((pb, pt), (0, 1), max_compiles=3)
  for _ in range(300):
    for sub in ((60, 10), (2, 500)):  # two clusters: wide-short and narrow-long
      joint.observe(sub)
      joint.bucket(sub)
  table = set(joint.sizes())
  assert (64, 512) in table and len(table) <= 3
  assert any(b >= 60 and t < 100 for b, t in table) and any(b < 16 and t >= 500 for b, t in table)
  assert list(itertools.islice(table, 3))
