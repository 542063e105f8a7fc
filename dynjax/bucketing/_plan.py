"""The one-dimensional bucket plan: which candidate sizes become buckets, by dynamic programming.

Given sorted candidate sizes ``cands`` (observed sizes rounded up to the alignment, the
declared max, the buckets already built), the calls each candidate would serve as the smallest
bucket covering them (``counts``), and what a call costs on each candidate (``cost``,
nondecreasing: :class:`~dynjax.bucketing._cost.CostModel`), :func:`plan_table` finds the table
minimising ``sum_j count_j * cost(bucket covering j)``:

- ``forced`` candidates (buckets already compiled: sunk, free) are always in the table;
- ``end`` (the declared max, or the smallest candidate covering the largest size seen) closes it;
- at most ``k_max`` new buckets; with ``penalty`` (value-decided plans) each new bucket must
  save more than ``penalty`` (in the same units as the cost) or it is not added.

``D[k][j]`` = the cheapest table covering candidates ``<= j`` whose largest bucket is ``j``,
with ``k`` new buckets.  Row ``k`` is one vectorised min over an ``m x m`` matrix (new
candidates, from row ``k-1``) plus a short sequential pass over the forced ones (from row
``k``): ``O(m^2 k)`` work in ``O(k)`` numpy steps.  The segment cost ``cost_j * (S_j - S_i)``
(``S``: cumulative counts) is a Monge array when ``cost`` is nondecreasing, so ``D[k][end]`` is
convex in ``k`` (Bein, Larmore and Park): the marginal saving of each further bucket only
shrinks, and a value-decided plan stops at the first bucket not worth its penalty.

Above :data:`MAX_CANDIDATES` the candidates are thinned first: a candidate whose cost is within
``eps`` of the next kept one above goes (its calls pay at most ``eps`` more), ``eps`` the
smallest that leaves few enough (512 candidates of a quadratic from 1x to 80x: ~3.5%).  Where the cost is flat (short lengths, dominated by the
fixed part) candidates merge; where it is steep they stay fine.  Measured whole re-plans (fit,
thinning, DP, hysteresis; 2-core shared CPU box): max=512 (64 candidates), budget 8: 0.5-0.9
ms; max=4096 (512 candidates -> 128), budget 64: 3.2-3.4 ms (~2.5 ms of it the 65 DP rows);
unthinned 512 candidates: ~18 ms.  Re-plans run at 8, 16, 32, ... calls: ~20 in a million.
"""

from __future__ import annotations

import numpy as np

MAX_CANDIDATES = 128


def thin(cost: np.ndarray, keep: np.ndarray, limit: int | None = None) -> np.ndarray:
  """Indices of the candidates kept: the largest of each band of costs within a factor
  ``1 + eps`` (its calls pay at most ``eps`` more on the next kept one), the ``keep`` ones and
  the last; ``eps`` the smallest (bisected, ~0.2 ms) that leaves at most ``limit``."""
  limit = MAX_CANDIDATES if limit is None else limit
  m = len(cost)
  if m <= limit:
    return np.arange(m)
  logc = np.log(np.maximum(np.asarray(cost, float), 1e-300))
  keep = np.asarray(keep, bool)

  def kept(log_eps: float) -> np.ndarray:
    band = np.floor(logc / np.log1p(np.exp(log_eps)))
    out = keep.copy()
    out[:-1] |= band[:-1] != band[1:]
    out[-1] = True
    return out

  lo, hi = np.log(1e-4), np.log(1e3)  # hi: one band, only the forced ones and the last
  for _ in range(30):
    mid = 0.5 * (lo + hi)
    if kept(mid).sum() <= limit:
      hi = mid
    else:
      lo = mid
  return np.flatnonzero(kept(hi))


def plan_table(counts: np.ndarray, cost: np.ndarray, forced: np.ndarray, end: int, k_max: int,
               penalty: float | None = None) -> tuple[list[int], float, int] | None:
  """The best table: (candidate indices, serving cost, new buckets), or None when no table
  within ``k_max`` new buckets reaches ``end``.

  ``penalty`` None: the cheapest table with at most ``k_max`` new buckets.  Else: the table
  minimising ``serving cost + penalty * new buckets`` (at most ``k_max`` new buckets).
  Candidates above ``end`` are not used.
  """
  m = end + 1
  cnt = np.asarray(counts, float)[:m]
  c = np.asarray(cost, float)[:m]
  forced = np.asarray(forced, bool)[:m]
  S = np.cumsum(cnt)
  inf = np.inf
  idx = np.arange(m)
  # ls[j]: the last forced candidate below j (-1: none); the path cannot skip a forced one.
  last = np.where(forced, idx, -1)
  ls = np.concatenate([[-1], np.maximum.accumulate(last)[:-1]])
  valid = (idx[:, None] < idx[None, :]) & (idx[:, None] >= ls[None, :])
  W = np.where(valid, c[None, :] * (S[None, :] - S[:, None]), inf)
  start = np.where(ls < 0, c * S, inf)  # j as the smallest bucket
  new_j = np.flatnonzero(~forced)
  forced_j = np.flatnonzero(forced)
  Wn = W[:, new_j]
  buf = np.empty_like(Wn)
  rows = []
  best = None  # (objective, k)
  for k in range(k_max + 1):
    row = np.full(m, inf)
    if k >= 1 and len(new_j):
      v = np.add(rows[-1][:, None], Wn, out=buf).min(axis=0)  # argmins: only when backtracking
      row[new_j] = np.minimum(v, start[new_j]) if k == 1 else v
    for j in forced_j:  # forced: from this row (no new bucket), in increasing order
      v = float((row + W[:, j]).min())
      row[j] = min(v, float(start[j])) if k == 0 else v
    rows.append(row)
    obj = row[end] + (penalty or 0.0) * k
    if np.isfinite(obj) and (best is None or obj < best[0]):
      best = (obj, k)
    if penalty is not None and k >= 1 and np.isfinite(rows[-2][end]):
      if rows[-2][end] - row[end] <= penalty:
        break  # convex in k: no further bucket is worth its penalty either
  if best is None:
    return None
  k = best[1]
  j, chosen = end, []
  while j >= 0:  # back along the path: each step one argmin over the row it came from
    chosen.append(int(j))
    src = k if forced[j] else k - 1
    first = k == (0 if forced[j] else 1)
    if first and start[j] <= rows[k][j] * (1 + 1e-12):
      break  # j is the smallest bucket
    j = int(np.argmin(rows[src] + W[:, j]))
    k = src
  return chosen[::-1], float(rows[best[1]][end]), best[1]
