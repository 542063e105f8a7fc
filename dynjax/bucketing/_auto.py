"""The profile-guided bucket policy: :func:`auto` and its :class:`Auto`.

Re-planned from the observed sizes with :mod:`~dynjax.bucketing._cost`'s model of what a bucket
costs to run and :mod:`~dynjax.bucketing._plan`'s DP; the other policies (fixed tables) and
their base class are in :mod:`~dynjax.bucketing._policies`.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence

import numpy as np

from dynjax._errors import PolicyError
from dynjax.bucketing import _cost, _plan
from dynjax.bucketing._policies import BucketPolicy, _check_int, _check_range, _round_up


def early_budget(budget: int, observations: int) -> int:
  """New buckets a plan may add now: small samples mislead, so while fewer than 256 calls
  were seen, half of what is left is kept for later plans."""
  if observations < EARLY_OBSERVATIONS and budget > 1:
    return budget // 2
  return budget


EARLY_OBSERVATIONS = 256
# Value-decided auto (``max_compiles=None``): the most buckets a plan holds (each is an
# executable kept in memory; their size was not measured for this bound), and the seconds a
# compile is assumed to take before one was measured (CPU tests 0.1-1 s; H100 BERT-base 2.2-3 s
# quick tier, ~5 s full).
MAX_BUCKETS = 64
# How many buckets a cold ``Auto.warm_sizes`` builds (``max`` and its halvings).
WARM_LADDER = 4
DEFAULT_COMPILE_SECONDS = 1.0
# The tuple budget joint planning (``_joint.py``) uses for value-decided policies.
JOINT_BUDGET = 8
# ``auto()`` without ``max_compiles``: 8 buckets, or 16 for a function that serves on a GPU
# (``serving=True``: compiles run in the background on host cores the GPU does not need, so more
# buckets cost no blocked call; on a CPU they share the serving cores: 8, as measured there).
# Measured, H100, BERT-base fp32, the 1,000-request docstring stream (issue 18), per length bin
# after tier-up (ms, <=64 / 65-128 / 129-256 / 257-512): auto(8) 2.88 / 3.16 / 4.03 / 7.20
# against hand-written pow2 buckets 2.20 / 2.75 / 3.94 / 7.40 (one run); auto(16) 2.14 / 2.57 /
# 3.52 / 6.25 against 2.87 / 3.26 / 4.62 / 8.13 (another run, a slower host): 16 beats the
# hand-written table in every bin, 8 loses below 128 tokens.  Simulated steady cost over exact
# shapes (benchmarks/sim_buckets.py, the H100 curve): 1.085x (8), 1.061x (12), 1.042x (16).
DEFAULT_MAX_COMPILES = 8
SERVING_MAX_COMPILES = 16


class Watched:
  """A plan that learns from traffic and tells the families keeping executors by sizes when
  its table moves (a size's bucket may have changed): each ``watch``-ing family's
  ``plan_changed()`` runs after every change.  Needs ``_lock``, ``_table`` and ``_watchers``
  (a ``weakref.WeakSet``); every write of the table after construction goes through
  ``_set_table``, under ``_lock``."""

  def watch(self, family) -> None:
    with self._lock:
      self._watchers.add(family)

  def _set_table(self, table) -> None:
    if table != self._table:
      self._table = table
      for family in list(self._watchers):
        family.plan_changed()


class Auto(BucketPolicy, Watched):
  """Profile-guided buckets re-planned from the observed histogram and measured costs.

  Cold start: a single bucket at ``max`` (or the next power of two above the first size when
  unbounded).  After 8, 16, 32, ... observations it re-plans (:func:`~dynjax.bucketing.
  _plan.plan_table`, an exact DP over the observed sizes rounded up to ``align``): the table
  minimising the expected cost ``sum_n count(n) * cost(bucket(n))``, buckets already used
  being sunk (free, kept).  ``cost`` is :mod:`~dynjax.bucketing._cost`'s model fitted to the
  run times the dispatcher reports (``record_time``), ``a + b*T + c*T**2``.

  How many buckets:

  - ``max_compiles`` an integer: at most that many in total.
  - ``max_compiles=None`` (value-decided): a new bucket is planned when the serving seconds it
    saves over the horizon exceed ``threshold`` times the seconds a compile takes (measured
    for this policy's buckets, ``record_compile``; else :data:`DEFAULT_COMPILE_SECONDS`), up
    to :data:`MAX_BUCKETS` in total (and the function's ``max_executables``).  The horizon is
    ``horizon`` (default 2) times the calls seen so far.  Why: with nothing else known, a
    server that has answered N calls answers N more with probability 1/2 (Lindy: the median
    of what is left is N), but a bucket is paid once and keeps serving past the median in
    the heavy tail (its mean is unbounded).  On the docstring stream under the H100 cost
    curve (``benchmarks/sim_buckets.py``), serving seconds above exact shapes plus compile
    seconds were, for horizons 1 / 2 / 4: 8.9 / 9.1 / 7.9 s at 1e3 calls, 28.0 / 22.5 / 26.8
    at 1e4, 74.8 / 69.2 / 69.7 at 1e5, 231 / 203 / 188 at 1e6: 2 is never worse than 1 by
    more than 0.2 s and is within 8% of the best from 1e4 calls on.  ``threshold=1``: a
    compile costs serving about its own seconds (blocking; or in the background: GPU
    contention while it runs and the tier-1 recompile that follows it, H100 figures in
    ``jit/_serving.py``).

  While fewer than 256 calls were seen a plan adds at most half of what is left
  (:func:`early_budget`).  Hysteresis: a new plan is adopted only when it cuts the objective
  (expected cost above the exact-shape cost, plus the penalty of its new buckets when
  value-decided) by more than ``hysteresis`` (default 5%), so the plan does not thrash.
  """

  name = "auto"

  def __init__(self, max_compiles: int | None = 8, min: int = 1, max: int | None = None,
               multiple: int = 1, align: int = 8, hysteresis: float = 0.05,
               threshold: float = 1.0, horizon: float = 2.0, budget_default: bool = False):
    self.value_decided = max_compiles is None
    self.budget_default = budget_default  # auto() without max_compiles: GPU serving raises it
    # Joint planning (several auto dims, ``_joint.py``) reads ``max_compiles`` as its tuple
    # budget; value-decided policies give it the former default there.
    self.max_compiles = JOINT_BUDGET if max_compiles is None else max_compiles
    self.align = align
    self.hysteresis = hysteresis
    self.threshold = threshold
    self.horizon = horizon
    self._lock = threading.Lock()
    self._hist: Counter[int] = Counter()
    self._n_obs = 0
    self._next_plan_at = 8
    self._used: set[int] = set()  # buckets handed out (compiled or being compiled): sunk cost
    self._times: dict[int, list] = {}  # bucket -> [seconds (average), samples]
    self._compiles: dict[int, float] = {}  # bucket -> seconds its compile took
    self._max_executables: int | None = None
    self.replans = 0
    self.last_plan_seconds = 0.0  # how long the last re-plan took (explain, benchmarks)
    self._model: _cost.CostModel | None = None  # set while re-planning
    # Families that keep their executors by sizes (``watch``): a change of the table makes
    # those stale (a size's bucket may have moved), so each is told (its ``plan_changed``).
    self._watchers: weakref.WeakSet = weakref.WeakSet()
    super().__init__(min, max, multiple)

  def _quantum(self) -> int:
    return math.lcm(self.align, self.multiple)

  def _build_table(self) -> tuple[int, ...]:
    return (_round_up(self.max, self.multiple),)

  def _rule(self, n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

  def bucket(self, n: int) -> int | None:
    table = self._table
    if table is not None:
      i = bisect.bisect_left(table, n)
      if i < len(table):
        b = table[i]
        if b not in self._used:
          with self._lock:
            self._used.add(b)
        return b
    if self.max is not None and n > self.max:
      return None
    # Unbounded and above every planned bucket: extend the plan with a power of two.
    b = _round_up(self._rule(max(n, self.min)), self.multiple)
    with self._lock:
      self._used.add(b)
      self._set_table(tuple(sorted(set(self._table or ()) | {b})))
    return b

  @property
  def table(self) -> tuple[int, ...] | None:
    """The planned buckets now; None where there is no max and nothing was observed (where
    :meth:`sizes` raises)."""
    return self._table

  def sizes(self) -> tuple[int, ...]:
    if self._table is None:
      raise PolicyError(f"{self!r} has no max and no observations: its buckets cannot be "
                        "listed yet; give max=... or call the function first")
    return self._table

  def warm_sizes(self) -> tuple[int, ...]:
    """The buckets ``warmup()`` builds.  With traffic seen (or buckets adopted from a store):
    the plan.  Cold, a plan is one bucket at ``max``, and a server warmed on it alone answers
    every request there until its traffic plans more: a ladder of halvings instead, ``max``,
    ``max/2``, ... (:data:`WARM_LADDER` buckets, at most half the budget), adopted as sunk
    buckets the later plans keep and add to.  Why: H100 BERT-base fp32 (issue 18, run 7), a
    start-up warmup of ``max`` alone served 546 of the first 1,000 requests at 512 tokens;
    simulated steady cost over exact shapes with the ladder sunk (512 / 256 / 128 / 64) is
    1.046x against 1.041x for auto(16) from nothing (``benchmarks/sim_buckets.py``)."""
    with self._lock:
      cold = self._n_obs == 0 and self._table == self._build_table()
    if self.max is None or not cold:
      return self.sizes()
    q = self._quantum()
    top = _round_up(self.max, self.multiple)
    ladder = {top}
    for i in range(1, min(WARM_LADDER, max(1, self.bucket_cap() // 2))):
      b = _round_up(top >> i, q)
      if b < max(self.min, 1):
        break
      ladder.add(b)
    for b in ladder:
      self.adopt(b)
    return self.sizes()

  def observe(self, n: int) -> None:
    # Hot path: a Counter increment (~0.2 us); re-planning runs at 8, 16, 32, ... calls.
    self._hist[n] += 1
    self._n_obs += 1
    if self._n_obs >= self._next_plan_at:
      with self._lock:
        planned = self._n_obs >= self._next_plan_at
        if planned:
          self._next_plan_at *= 2
          self._replan()
      if planned and self.on_replan is not None:
        self.on_replan()

  def is_bucket(self, b: int) -> bool:
    table = self._table or ()
    i = bisect.bisect_left(table, b)
    if i < len(table) and table[i] == b:
      return True
    return self.max is None and b > (table[-1] if table else 0) and b == _round_up(
        self._rule(max(b, self.min)), self.multiple)

  def adopt(self, b: int) -> None:
    # A bucket compiled by an earlier run is free: part of the plan and of the sunk budget.
    with self._lock:
      if self.max is not None and b > _round_up(self.max, self.multiple):
        return
      self._used.add(b)
      self._set_table(tuple(sorted(set(self._table or ()) | {b})))

  def record_time(self, bucket: int, seconds: float) -> None:
    # The first run of an executable carries one-off costs (allocation, first launch): the
    # second sample replaces it, later ones average in (0.8 / 0.2).
    rec = self._times.get(bucket)
    if rec is None:
      self._times[bucket] = [seconds, 1]
    else:
      rec[0] = seconds if rec[1] == 1 else 0.8 * rec[0] + 0.2 * seconds
      rec[1] += 1

  def record_compile(self, bucket: int, seconds: float,
                     max_executables: int | None = None) -> None:
    self._compiles[bucket] = seconds
    self._max_executables = max_executables

  # -- traffic kept across processes (``jit/_traffic.py``) ---------------------------------
  on_replan = None  # set by a family that keeps its traffic: called after each re-plan

  def traffic(self) -> dict:
    """What this policy has learned, as JSON: the sizes seen, the measured seconds per call
    and compile seconds per bucket (:meth:`restore` takes it in, in another process)."""
    with self._lock:
      return {"policy": repr(self), "observations": self._n_obs,
              "sizes": sorted([int(n), int(c)] for n, c in self._hist.items()),
              "times": sorted([int(b), float(t), int(k)] for b, (t, k) in self._times.items()),
              "compiles": sorted([int(b), float(s)] for b, s in self._compiles.items())}

  def restore(self, traffic: dict) -> bool:
    """Takes in the :meth:`traffic` of this policy in an earlier process: its sizes join the
    histogram, its times and compile seconds fill the buckets not measured here, and the
    policy re-plans.  False (nothing taken) for another policy's record (another ``repr``)."""
    if traffic.get("policy") != repr(self):
      return False
    sizes = [(int(n), int(c)) for n, c in traffic["sizes"]]
    times = [(int(b), float(t), int(k)) for b, t, k in traffic["times"]]
    compiles = [(int(b), float(s)) for b, s in traffic["compiles"]]
    n_obs = int(traffic["observations"])
    if any(c < 0 for _, c in sizes) or n_obs < 0:
      raise ValueError("negative counts")
    with self._lock:
      for n, c in sizes:
        self._hist[n] += c
      self._n_obs += n_obs
      for b, t, k in times:
        self._times.setdefault(b, [t, k])
      for b, s in compiles:
        self._compiles.setdefault(b, s)
      while self._next_plan_at <= self._n_obs:
        self._next_plan_at *= 2
      self._replan()
    return True

  def value_order(self, new, have) -> list[int]:
    """``new`` buckets one at a time in the order that cuts the histogram's expected cost the
    most on top of ``have`` and the ones before (a restart builds its plan in this order)."""
    with self._lock:
      self._model = self.cost_model()
      try:
        table, left, out = set(have), set(new), []
        while left:
          b = min(left, key=lambda x: (self.expected_cost(table | {x}), -x))
          out.append(b)
          table.add(b)
          left.remove(b)
      finally:
        self._model = None
    return out

  # -- planning ----------------------------------------------------------------------------
  def cost_model(self) -> _cost.CostModel:
    """The fitted cost per call of a bucket (seconds; a prior scaled at ``max`` when nothing
    was measured)."""
    ref = self.max or (max(self._hist) if self._hist else self.min)
    # (sorted: a fit that depends on the order the buckets were first timed in planned a
    # restored policy differently from the one that saw the traffic, at near-ties)
    return _cost.fit([(b, t, n) for b, (t, n) in sorted(list(self._times.items()))], t_ref=ref)

  def _cost_fn(self) -> _cost.CostModel:
    return self._model or self.cost_model()  # one fit per re-plan (~0.2 ms)

  def compile_seconds(self) -> float:
    """Seconds a new bucket's compile is expected to take: the mean of this policy's."""
    ts = list(self._compiles.values())
    return float(np.mean(ts)) if ts else DEFAULT_COMPILE_SECONDS

  def penalty(self) -> float:
    """Value-decided plans: the serving seconds, over the observed histogram, a new bucket
    must save (``threshold * compile seconds``, scaled from the horizon to the calls seen)."""
    return self.threshold * self.compile_seconds() / self.horizon

  def expected_cost(self, table: Sequence[int] | None = None) -> float:
    table = tuple(sorted(table if table is not None else (self._table or ())))
    if not self._hist:
      return 0.0
    ns = np.fromiter(self._hist.keys(), np.int64, len(self._hist))
    cs = np.fromiter(self._hist.values(), float, len(self._hist))
    t = np.array(table, np.int64)
    i = np.searchsorted(t, ns)
    grown = np.array([_round_up(self._rule(int(n)), self.multiple) for n in ns[i >= len(t)]],
                     np.int64)
    b = np.empty(len(ns), np.int64)
    b[i < len(t)] = t[i[i < len(t)]]
    b[i >= len(t)] = grown
    return float((cs * self._cost_fn()(b)).sum())

  def exact_cost(self) -> float:
    """The expected cost of the histogram at exact shapes (no plan does better)."""
    if not self._hist:
      return 0.0
    ns = np.fromiter(self._hist.keys(), np.int64, len(self._hist))
    cs = np.fromiter(self._hist.values(), float, len(self._hist))
    return float((cs * self._cost_fn()(np.maximum(ns, self.min))).sum())

  def _objective(self, table, floor: float = 0.0) -> float:
    # Above ``floor`` (the exact-shape cost): the hysteresis compares what a plan can change.
    # With padded elements as the cost the floor was 0; with a fixed part per call, a 5% cut
    # of the whole would ask a plan to remove most of the padding at once.
    cost = self.expected_cost(table) - floor
    if self.value_decided:
      cost += self.penalty() * len(set(table) - self._used)
    return cost

  def bucket_cap(self) -> int:
    """The most buckets a plan may hold in total."""
    if not self.value_decided:
      return self.max_compiles
    cap = MAX_BUCKETS
    return cap if self._max_executables is None else min(cap, self._max_executables)

  def plan(self) -> tuple[int, ...]:
    """The best table for the histogram so far (does not adopt it)."""
    q = self._quantum()
    sunk = sorted(self._used)
    budget = early_budget(self.bucket_cap() - len(sunk), self._n_obs)
    if not self._hist:
      return tuple(sunk)
    ns = np.fromiter(self._hist.keys(), np.int64, len(self._hist))
    ws = np.fromiter(self._hist.values(), float, len(self._hist))
    cands = -(-np.maximum(ns, self.min) // q) * q
    extra = list(sunk)
    if self.max is not None:
      top = _round_up(self.max, self.multiple)
      cands = np.minimum(cands, top)
      extra.append(top)
    cands = np.unique(np.concatenate([cands, np.array(extra, np.int64)]))
    cands = cands[cands >= self.min]
    if not len(cands):
      return tuple(sunk)
    need = max(int(ns.max()), self.max or 0)
    end = min(int(np.searchsorted(cands, need)), len(cands) - 1)
    cands = cands[:end + 1]
    forced = np.isin(cands, np.array(sunk, np.int64))
    cost = np.asarray(self._cost_fn()(cands), float)
    keep = _plan.thin(cost, forced)
    sel = cands[keep]
    j = np.minimum(np.searchsorted(sel, ns), len(sel) - 1)
    counts = np.bincount(j, weights=ws, minlength=len(sel))
    res = _plan.plan_table(counts, cost[keep], forced[keep], len(sel) - 1, max(budget, 0),
                           self.penalty() if self.value_decided else None)
    if res is None:
      return tuple(sorted(set(sunk) | ({int(cands[end])} if budget > 0 else set())))
    return tuple(sorted({int(sel[i]) for i in res[0]} | set(sunk)))

  def _replan(self) -> None:
    t0 = time.perf_counter()
    self._model = self.cost_model()
    try:
      new = self.plan()
      floor = self.exact_cost()
      if self._table is None or self._objective(new, floor) < (
          1.0 - self.hysteresis) * self._objective(self._table, floor):
        self._set_table(new)
        self.replans += 1
    finally:
      self._model = None
    self.last_plan_seconds = time.perf_counter() - t0

  def _args(self) -> str:
    k = None if self.value_decided else self.max_compiles
    return f"max_compiles={k}, min={self.min}, max={self.max}"

  def _clone(self, multiple):
    return Auto(None if self.value_decided else self.max_compiles, self.min, self.max,
                multiple, self.align, self.hysteresis, self.threshold, self.horizon,
                self.budget_default)

  def for_serving(self) -> Auto:
    """This policy for a function with ``serving=True`` on a GPU: ``auto()`` without
    ``max_compiles`` plans up to :data:`SERVING_MAX_COMPILES` buckets there."""
    if not self.budget_default:
      return self
    p = self._clone(self.multiple)
    p.max_compiles = SERVING_MAX_COMPILES
    return p


def auto(max_compiles: int | None | str = "default", min: int = 1,
         max: int | None = None) -> BucketPolicy:
  """Profile-guided buckets, re-planned from the observed sizes and measured run times.

  Args:
    max_compiles: at most this many bucket sizes.  ``"default"``: 8, or 16 in a function
      with ``serving=True`` on a GPU (its compiles run in the background, and on the H100 16
      buckets beat hand-written pow2 buckets in every length bin where 8 did not).
      ``None``: as many as are worth their compile (a bucket is added when the serving
      seconds it saves over the coming calls, estimated as many as were seen so far, exceed
      the seconds its compile takes), at most 64 and at most the function's
      ``max_executables``.
    min, max: the range of sizes; ``max`` is always a bucket when given.

  A re-plan (at 8, 16, 32, ... calls, on the calling thread) costs 0.5-0.9 ms for the 64
  candidates of ``max=512``, ~3 ms for 512 candidates and a budget of 64 (2-core CPU box);
  see ``Auto`` for the cost model and the plan.

  Example:
    >>> p = dynjax.buckets.auto(max_compiles=4, max=512)
    >>> for n in [5, 7, 9, 30, 31, 200, 6, 8]: p.observe(p.bucket(n) and n)
    >>> len(p.sizes()) <= 4
    True
  """
  default = isinstance(max_compiles, str) and max_compiles == "default"
  if default:
    k = DEFAULT_MAX_COMPILES
  elif max_compiles is None:
    k = None
  elif isinstance(max_compiles, str):
    raise PolicyError(f"dynjax.buckets.auto: max_compiles={max_compiles!r} is not valid; give "
                      "a positive integer, None (value-decided) or \"default\" (8, or 16 "
                      "with serving=True on a GPU)")
  else:
    k = _check_int("max_compiles", max_compiles, 1, "auto")
  lo = _check_int("min", min, 1, "auto")
  hi = None if max is None else _check_int("max", max, 1, "auto")
  _check_range(lo, hi, "auto")
  return Auto(k, lo, hi, budget_default=default)
