"""Joint bucket planning over several ``auto`` dimensions.

Per-variable ``auto`` policies compile the cartesian product of their tables: two variables
with 8 sizes each can mean 64 executables, most of them for size combinations that never
occur.  A :class:`JointPlan` instead plans *bucket tuples*: at most ``max_compiles`` of them,
chosen from the observed histogram of size tuples so that the expected padded elements
``sum_n count(n) * prod(cheapest planned tuple covering n)`` are smallest.  The tuple of the
declared maxima is always planned (it covers every call).  Buckets already handed out are
sunk (kept, free); a new plan is adopted only when it cuts the expected cost by more than
``hysteresis``.

The search is greedy (add the tuple that saves the most, repeat): the exact problem is a
facility-location problem, NP-hard beyond one dimension.  For one variable the DP of
:class:`~dynjax.bucketing._auto.Auto` is exact.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections import Counter
from collections.abc import Sequence

import numpy as np

from dynjax.bucketing._auto import Watched, early_budget


def _round_up(n: int, q: int) -> int:
  return -(-n // q) * q


class JointPlan(Watched):
  """Bucket tuples for the variables ``idx`` (positions in the family's size tuple)."""

  def __init__(self, policies: Sequence, idx: Sequence[int], max_compiles: int,
               hysteresis: float = 0.05, max_candidates: int = 4096):
    self.policies = tuple(policies)
    self.idx = tuple(idx)
    self.max_compiles = max_compiles
    self.hysteresis = hysteresis
    self.max_candidates = max_candidates
    self._lock = threading.Lock()
    self._hist: Counter = Counter()
    self._n = 0
    self._next_plan_at = 8
    self._used: set[tuple] = set()
    self.replans = 0
    ps = [self.policies[i] for i in self.idx]
    self.top = None
    if all(p.max is not None for p in ps):
      self.top = tuple(_round_up(p.max, p.multiple) for p in ps)
    self._table: tuple[tuple, ...] = (self.top,) if self.top is not None else ()
    self._watchers: weakref.WeakSet = weakref.WeakSet()  # (Watched)

  # -- the dispatcher's side -----------------------------------------------------------------
  def sub(self, sizes: Sequence[int]) -> tuple:
    return tuple(sizes[i] for i in self.idx)

  def observe(self, sub: tuple) -> None:
    self._hist[sub] += 1
    self._n += 1
    if self._n >= self._next_plan_at:
      with self._lock:
        if self._n >= self._next_plan_at:
          self._next_plan_at *= 2
          self._replan()

  def bucket(self, sub: tuple) -> tuple | None:
    """The cheapest planned tuple covering ``sub``; None when ``sub`` is above the maxima."""
    best = None
    for t in self._table:
      if all(a >= b for a, b in zip(t, sub, strict=True)) and (
          best is None or math.prod(t) < math.prod(best)):
        best = t
    if best is None:
      ps = [self.policies[i] for i in self.idx]
      if any(p.max is not None and n > p.max for p, n in zip(ps, sub, strict=True)):
        return None
      best = tuple(p.grow(n) for p, n in zip(ps, sub, strict=True))  # unbounded: extend
      with self._lock:
        self._set_table(tuple(sorted(set(self._table) | {best})))
    if best not in self._used:
      with self._lock:
        self._used.add(best)
    return best

  def is_bucket(self, sub: tuple) -> bool:
    return sub in self._table

  def adopt(self, sub: tuple) -> None:
    with self._lock:
      self._used.add(sub)
      self._set_table(tuple(sorted(set(self._table) | {sub})))

  def sizes(self) -> tuple[tuple, ...]:
    return self._table

  # -- planning --------------------------------------------------------------------------
  def _candidates(self, points: np.ndarray) -> np.ndarray:
    ps = [self.policies[i] for i in self.idx]
    per_var = int(max(2, self.max_candidates ** (1.0 / len(ps))))
    axes = []
    for k, p in enumerate(ps):
      q = math.lcm(getattr(p, "align", 8), p.multiple)
      vals = sorted({_round_up(max(int(n), p.min), q) for n in points[:, k]})
      if p.max is not None:
        top = _round_up(p.max, p.multiple)
        vals = sorted({min(v, top) for v in vals} | {top})
      if len(vals) > per_var:  # spread over the observed range, keeping the largest
        pick = np.unique(np.linspace(0, len(vals) - 1, per_var).round().astype(int))
        vals = [vals[i] for i in pick]
      axes.append(vals)
    return np.array(list(itertools.product(*axes)), np.int64)

  def expected_cost(self, table) -> float:
    if not self._hist or not table:
      return 0.0
    pts = np.array(list(self._hist), np.int64)
    w = np.array(list(self._hist.values()), float)
    return float((w * self._point_costs(np.array(list(table), np.int64), pts)).sum())

  @staticmethod
  def _point_costs(table: np.ndarray, pts: np.ndarray) -> np.ndarray:
    cov = np.all(table[:, None, :] >= pts[None, :, :], axis=2)
    cost = np.prod(table.astype(float), axis=1)
    c = np.where(cov, cost[:, None], np.inf).min(axis=0)
    # A point no tuple covers would be served by growing: price it at its pow2 box.
    box = np.prod(2.0 ** np.ceil(np.log2(np.maximum(pts, 1))), axis=1)
    return np.where(np.isfinite(c), c, box)

  def plan(self) -> tuple[tuple, ...]:
    """The greedy best table for the histogram so far (does not adopt it)."""
    if not self._hist:
      return self._table
    pts = np.array(list(self._hist), np.int64)
    w = np.array(list(self._hist.values()), float)
    keep = set(self._used)
    if self.top is not None:
      keep.add(self.top)
    chosen = [tuple(t) for t in keep]
    budget = self.max_compiles - len(chosen)
    budget = early_budget(budget, self._n)
    cands = self._candidates(pts)
    if not chosen or len(cands) == 0 or budget <= 0:
      return tuple(sorted(chosen))
    cur = self._point_costs(np.array(chosen, np.int64), pts)
    dom = np.all(cands[:, None, :] >= pts[None, :, :], axis=2)  # [cands, points]
    ccost = np.prod(cands.astype(float), axis=1)
    taken = np.zeros(len(cands), bool)
    for _ in range(budget):
      gain = (np.maximum(cur[None, :] - ccost[:, None], 0.0) * dom * w[None, :]).sum(axis=1)
      gain[taken] = 0.0
      j = int(np.argmax(gain))
      if gain[j] <= 0:
        break
      taken[j] = True
      chosen.append(tuple(int(v) for v in cands[j]))
      cur = np.where(dom[j], np.minimum(cur, ccost[j]), cur)
    return tuple(sorted(set(chosen)))

  def _replan(self) -> None:
    new = self.plan()
    old_cost = self.expected_cost(self._table)
    if not self._table or self.expected_cost(new) < (1.0 - self.hysteresis) * old_cost:
      self._set_table(new)
      self.replans += 1

  def __repr__(self) -> str:
    return f"JointPlan(max_compiles={self.max_compiles}, table={list(self._table)})"
