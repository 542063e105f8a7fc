"""What a bucket costs to run: ``cost(T) = a + b*T + c*T**2`` seconds a call, ``a, b, c >= 0``.

One model for the two places that weigh buckets by what they cost: the ``auto`` policy's plan
(:class:`~dynjax.bucketing._auto.Auto`) and the serving compiler's job values
(``jit/_serving.py``).  Both feed it the per-bucket seconds the dispatcher measures.

Why a fixed part and a square, and not "cost proportional to padded elements": a call costs a
dispatch, kernel launches and reads every weight once whatever its length, and attention grows
with the square of the length.  Measured on the H100 (BERT-base encoder, batch 8, fp32, exact
shapes): T=37 2.56 ms, T=141 3.38, T=300 5.86, T=450 9.04.  Proportional to T would price T=37
at 0.74 ms (3.5x too cheap) and the step from 16 to 32 tokens at 2x, where it costs ~3%: a
planner using it spends its buckets on short lengths where they save nothing and leaves too
few above 256, where padding 300 to 512 costs 1.8x the exact shape.

Fitting (:func:`fit`): nonnegative least squares over the three terms, solved exactly by
trying the 7 nonempty subsets of terms (the "active sets"; an unconstrained fit on each,
kept when every coefficient is >= 0, the smallest residual wins).  Residuals are relative
(``(y - cost(T)) / y``: short and long buckets count alike) and weighted by each bucket's
sample count.  With fewer distinct sizes than terms the model keeps at most that many terms
(1 size: the prior's shape through that point; 2 sizes: a line when the points rise).  With
no measurement: :func:`prior`.  Cost of a fit: ~60 us for 8 buckets (numpy, 2-core box).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

# The prior's fixed part: a quarter of the reference bucket's cost (H100 BERT-base, batch 8:
# the fitted fixed part is ~2.2 ms of the 10.6 ms of T=512; ~0.6 of a T=128 call).
PRIOR_FIXED = 0.25
# Seconds a call of the reference bucket is assumed to cost when nothing is measured yet.
PRIOR_SECONDS = 1e-3
# Term subsets tried by the exact NNLS, fewest terms first (ties keep the simpler model).
_SUBSETS = tuple(s for r in (1, 2, 3) for s in itertools.combinations(range(3), r))


class CostModel:
  """``cost(T) = a + b*T + c*T**2`` seconds per call (``T``: bucket size, or the product of a
  bucket tuple for the compiler).  Nondecreasing in ``T`` since ``a, b, c >= 0``.

  Example:
    >>> m = CostModel(2e-3, 1e-6, 2e-8)
    >>> round(m(512) * 1e3, 2)
    7.76
  """

  __slots__ = ("a", "b", "c", "source")

  def __init__(self, a: float, b: float, c: float, source: str = "fit"):
    self.a, self.b, self.c = float(a), float(b), float(c)
    self.source = source  # "fit", "one point", "prior": what the model rests on

  def __call__(self, t):
    t = np.asarray(t, float)
    return self.a + (self.b + self.c * t) * t

  def __repr__(self) -> str:
    return f"CostModel(a={self.a:.3g}, b={self.b:.3g}, c={self.c:.3g}, {self.source})"


def prior(t_ref: float, seconds: float = PRIOR_SECONDS) -> CostModel:
  """No measurement yet: ``seconds`` at ``t_ref``, a quarter of it fixed, the rest linear."""
  t_ref = max(float(t_ref), 1.0)
  return CostModel(PRIOR_FIXED * seconds, (1.0 - PRIOR_FIXED) * seconds / t_ref, 0.0, "prior")


def fit(points: Iterable[tuple], t_ref: float = 1.0) -> CostModel:
  """The nonnegative ``a + b*T + c*T**2`` closest to measured ``(T, seconds[, samples])``.

  Args:
    points: one tuple per measured bucket: size ``T``, seconds per call, and optionally how
      many calls the seconds average (the weight; 1 when absent).  Points with seconds <= 0
      are ignored.
    t_ref: the size the prior is scaled at when nothing is measured (e.g. the policy's max).

  Example:
    >>> m = fit([(64, 2.3e-3), (128, 2.9e-3), (256, 4.5e-3), (512, 10.6e-3)])
    >>> m.a > 1e-3 and m.c > 0
    True
  """
  pts = [(float(p[0]), float(p[1]), float(p[2]) if len(p) > 2 else 1.0) for p in points]
  pts = [p for p in pts if p[1] > 0 and p[2] > 0 and np.isfinite(p[1])]
  if not pts:
    return prior(t_ref)
  t, y, n = (np.array(v, float) for v in zip(*pts, strict=True))
  sizes = np.unique(t)
  if len(sizes) == 1:  # one size: the prior's shape through the (weighted) mean
    m = prior(sizes[0], float(np.average(y, weights=n)))
    m.source = "one point"
    return m
  scale = float(sizes[-1])  # columns in units of the largest size: well conditioned
  x = t / scale
  cols = np.stack([np.ones_like(x), x, x * x], axis=1)
  w = np.sqrt(n) / y  # relative residuals, weighted by samples
  A, r = cols * w[:, None], y * w
  G, h, rr = (A.T @ A).tolist(), (A.T @ r).tolist(), float(r @ r)  # normal equations, 3x3
  best = None
  for sub in _SUBSETS:
    if len(sub) > len(sizes):
      continue
    coef = _solve([[G[i][j] for j in sub] for i in sub], [h[i] for i in sub])
    if coef is None or min(coef) < 0:
      continue
    res = rr - sum(c * h[i] for c, i in zip(coef, sub, strict=True))  # at the LS solution
    if best is None or res < best[0] - 1e-12 * rr:
      best = (res, sub, coef)
  abc = np.zeros(3)
  if best is None:  # cannot happen ({a} alone fits a nonnegative mean), kept for safety
    abc[0] = float(np.average(y, weights=n))
  else:
    abc[list(best[1])] = best[2]
  return CostModel(abc[0], abc[1] / scale, abc[2] / scale**2)


def _solve(M: list, v: list) -> list | None:
  """``M x = v`` for 1, 2 or 3 unknowns by Cramer's rule (Python floats: ~1 us, where
  ``np.linalg.solve`` costs ~10 us a call); None when singular."""
  def det(m):
    if len(m) == 1:
      return m[0][0]
    if len(m) == 2:
      return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
  d = det(M)
  if abs(d) <= 1e-12 * max(abs(x) for row in M for x in row) ** len(M):
    return None
  out = []
  for k in range(len(M)):
    mk = [[v[i] if j == k else M[i][j] for j in range(len(M))] for i in range(len(M))]
    out.append(det(mk) / d)
  return out
