"""The bucket cost model (``a + b*T + c*T**2``, nonnegative) and the plan's DP: plain numpy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dynjax.bucketing import _cost, _plan

A, B, C = 2e-3, 4e-6, 2.4e-8  # ~ the H100 BERT-base fit (seconds; T in tokens)


def _quadratic(t):
  return A + B * np.asarray(t, float) + C * np.asarray(t, float) ** 2


@pytest.mark.parametrize("seed", range(4))
def test_fit_recovers_a_b_c_from_noisy_points(seed):
  rng = np.random.default_rng(seed)
  t = np.arange(16, 513, 32)
  y = _quadratic(t) * (1 + 0.02 * rng.standard_normal(len(t)))
  m = _cost.fit([(ti, yi, 50) for ti, yi in zip(t, y, strict=True)])
  assert m.source == "fit"
  assert m.a == pytest.approx(A, rel=0.1) and m.c == pytest.approx(C, rel=0.15)
  assert m.b == pytest.approx(B, rel=0.5)  # the weakest term: 0.4 ms of 10 ms at T=512
  grid = np.arange(1, 513)
  np.testing.assert_allclose(m(grid), _quadratic(grid), rtol=0.03)


@pytest.mark.parametrize("seed", range(4))
def test_fit_is_the_exact_nonnegative_least_squares(seed):
  # A fixed part plus a square, no linear part: with noise, the unconstrained fit often has
  # b < 0; the constrained one matches scipy's NNLS on the same weighted problem.
  from scipy.optimize import nnls  # here, not at import: scipy.optimize costs every worker's
  # collection ~2.6 s on the 2-core box

  rng = np.random.default_rng(seed)
  t = np.array([16, 40, 100, 180, 300, 420, 512], float)
  n = rng.integers(1, 100, len(t)).astype(float)
  y = (3e-3 + 3e-8 * t * t) * (1 + 0.05 * rng.standard_normal(len(t)))
  m = _cost.fit([(ti, yi, ni) for ti, yi, ni in zip(t, y, n, strict=True)])
  x = t / t.max()
  w = np.sqrt(n) / y
  ref, _ = nnls(np.stack([np.ones_like(x), x, x * x], 1) * w[:, None], y * w)
  np.testing.assert_allclose([m.a, m.b * t.max(), m.c * t.max() ** 2], ref, rtol=1e-6,
                             atol=1e-9)
  assert min(m.a, m.b, m.c) >= 0


def test_fit_with_few_points_and_the_prior():
  one = _cost.fit([(512, 8e-3, 3)])
  assert one.source == "one point" and one(512) == pytest.approx(8e-3)
  assert one.a == pytest.approx(_cost.PRIOR_FIXED * 8e-3)  # a fixed part, not proportional
  line = _cost.fit([(128, 3e-3), (512, 9e-3)])
  assert line.c == 0 and line(128) == pytest.approx(3e-3) and line(512) == pytest.approx(9e-3)
  flat = _cost.fit([(128, 5e-3), (512, 4e-3)])  # noise: falling; the model stays monotone
  assert flat.b == flat.c == 0 and 4e-3 < flat.a < 5e-3
  prior = _cost.fit([], t_ref=512)
  assert prior.source == "prior" and prior(512) == pytest.approx(_cost.PRIOR_SECONDS)
  assert prior(16) / prior(512) > 0.25 > 16 / 512  # a short bucket is not 32x cheaper
  assert _cost.fit([(64, 0.0), (128, -1.0)], t_ref=64).source == "prior"  # nothing usable


def _brute(counts, cost, forced, end, k_max, penalty):
  best = None
  free = [j for j in range(end) if not forced[j]]
  for r in range(len(free) + 1):
    for sub in itertools.combinations(free, r):
      table = sorted(set(sub) | {j for j in range(end + 1) if forced[j]} | {end})
      k = sum(not forced[j] for j in table)
      if k > k_max:
        continue
      serve = sum(counts[j] * cost[next(b for b in table if b >= j)] for j in range(end + 1))
      obj = serve + (penalty or 0.0) * k
      if best is None or obj < best - 1e-9:
        best = obj
  return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_table_is_exact_with_sunk_buckets_budgets_and_penalties(seed):
  rng = np.random.default_rng(seed)
  for _ in range(40):
    m = int(rng.integers(1, 9))
    counts = rng.integers(0, 20, m).astype(float)
    cost = np.sort(rng.random(m)) * 10
    forced = rng.random(m) < 0.25
    k_max = int(rng.integers(0, 5))
    penalty = None if rng.random() < 0.5 else float(rng.random() * 20)
    res = _plan.plan_table(counts, cost, forced, m - 1, k_max, penalty)
    want = _brute(counts, cost, forced, m - 1, k_max, penalty)
    assert (res is None) == (want is None)
    if res is not None:
      chosen, serve, k = res
      assert k <= k_max and set(np.flatnonzero(forced)) <= set(chosen) and chosen[-1] == m - 1
      assert serve + (penalty or 0.0) * k == pytest.approx(want)


def test_thinning_merges_where_the_cost_is_flat_and_keeps_fine_candidates_where_steep():
  cands = np.arange(8, 4097, 8)
  cost = 1e-3 * (1 + np.maximum(cands - 2048, 0) / 256.0) ** 2  # flat, then steep
  forced = cands == 1000
  keep = _plan.thin(cost, forced)
  kept = cands[keep]
  assert len(keep) <= _plan.MAX_CANDIDATES and kept[-1] == 4096 and 1000 in kept
  assert set(kept[kept <= 2048]) == {1000, 2048}  # no saving there: merged (bar the sunk one)
  assert (kept > 2048).sum() >= _plan.MAX_CANDIDATES - 3  # steep: the candidates go there
  # The bound it promises: a dropped candidate's calls pay at most eps more on the next kept.
  nxt = kept[np.searchsorted(kept, cands)]
  ratio = (1 + np.maximum(nxt - 2048, 0) / 256.0) ** 2 / (cost / 1e-3)
  assert ratio.max() < 1.1
  few = _plan.thin(cost[:100], forced[:100])
  assert len(few) == 100  # under the limit: nothing dropped, the DP stays exact
