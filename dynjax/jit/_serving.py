"""The compiler of a ``dynjax.jit`` function: when each bucket is built, and with what.

:meth:`Compiler.entry_for` answers a call whose bucket has no executor: the bucket's entry
when it is built; otherwise, blocking (the default), it builds it now; with
``async_compile``/``serving`` it serves the call on the smallest compiled bucket that covers
it while its own bucket compiles in the background (progressive serving):

- First call (``serving``): the bucket covering the whole declared range compiles first (a
  dim without a declared max keeps the call's own size: an undeclared batch dim made a
  274-token request wait 5 s on the H100), on GPU with >= 8 cores beside the call's own
  bucket; the call waits only for the first that covers it.
- Later calls: a larger compiled bucket at once; their own bucket is queued.  The
  :class:`~dynjax.jit._scheduler.CompileScheduler` runs the job worth the most serving
  seconds saved per second of compiling (:meth:`Compiler.job_value`); buckets an ``auto``
  policy re-planned away are worth 0.
- Tiers on GPU: tier 0 compiles with cheap autotuning (``QUICK_GPU_OPTIONS``), tier 1
  recompiles with XLA's defaults when the compile queue is idle (no tier-0 compile running or
  wanted) and traffic has a gap or is steady, one at a time, the most used bucket first;
  ``wait()`` forces them.  A tier-1 executable replaces its tier-0 file in ``cache_dir``.
- Lowering holds the GIL: one lane thread lowers, with 0.5 ms switches beside traffic
  (:func:`quick_switches`); the plan's buckets lower while a first call's bucket compiles.
- ``cache_dir``: stored executables load at the first call (and in ``warmup``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from dynjax._config import config
from dynjax.bucketing import _attention, _cost
from dynjax.jit import _prerun, _traffic
from dynjax.jit._family import BucketEntry, Family
from dynjax.jit._guards import capped_bucket, plan_buckets, top_bucket
from dynjax.jit._scheduler import CompileScheduler
from dynjax.jit._store import FirstRun

# Quick compiles on GPU (serving, tier 0): Triton gemms off, cuBLAS autotuned at level 1 (timing
# only: no buffer init or checks).  Level 0 (cuBLAS heuristics; compile 2.2 / 3.0 s at T=128 /
# 512 vs 5.2 / 5.1 with XLA's defaults, run 2.72 / 8.70 ms vs 2.03 / 6.70) was the choice while
# four compiles at once autotuning stalled every request (~110 ms); one at a time, level 1 serves
# better from the first request (H100 BERT-base fp32 cold, serve_fresh runs 27/28, tag t0lvl1:
# 3.96-4.13 vs 4.51-5.09 ms a request, stream 4.21-4.40 vs 4.74-5.40 s, torch 4.35-4.39).
QUICK_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 1}
PRELOWER_MAX = 12  # buckets lowered on the lane during a first call's wait (serving)
# A tier-0 build keeps its (Lowered, rewrites) for its tier-1 recompile (lowering holds the GIL:
# BERT-base ~0.3 s a bucket, H100 host); at most this many a family (0.17 MB of StableHLO each).
KEEP_LOWERED = 16
# Tier-1 recompiles (serving on GPU) start when the compile queue is idle AND either the
# function has had no call for ``TIER_UP_IDLE_S`` (a gap in traffic: the autotuning stalls no
# one) or ``TIER_UP_AFTER`` calls (``DYNJAX_TIER_UP_AFTER``, default 1,000) have passed since
# the last tier-0 compile.  Measured on the H100 (BERT-base, issue 18): autotuning compiles slow
# the requests served meanwhile by ~40% (four at once: ~110 ms requests), and starting them as
# soon as the queue was idle made a cold 1,000-request stream 15.5 s instead of ~10.9 s while
# only 1-2 of them finished before the process ended.  wait() runs them at once.
TIER_UP_AFTER = config.tier_up_after
TIER_UP_IDLE_S = 1.0
# Whether a gap before a function's first call counts as a traffic gap.  No: a tier-up still
# compiling when requests come stalls them and holds back the plan's next buckets (H100,
# BERT-base fp32, warmed cold stream: with it 739 of 1,000 requests ran on a larger bucket).
TIER_UP_BEFORE_TRAFFIC = False
# A background compile slows the requests served while it runs (GPU serving: host cores, the
# GIL while it lowers, the device while its first run loads).  A tier-0 job starts when what
# it would have saved on the traffic seen so far (Lindy: about as much traffic is to come)
# exceeds CONTENTION times its compile seconds, or in a traffic gap.  H100, BERT-base fp32
# (serve_fresh.py, jax 0.11.2): a warmed cold stream of 1,000 requests took 5.74 s while
# its plan's first bucket compiled through 4.5 s of it (mean 5.44 ms; PyTorch eager 4.35 s);
# another run's warmed stream again with no compile running: 4.52 ms a request against 10.30
# while four compiled at once (2.3x).  Rough: from those runs.
CONTENTION = 0.3
# Tier 1 on GPU: XLA's defaults with triton gemms off (cuBLAS gemms, autotuned).  Measured,
# BERT-base fp32, jax 0.11.2 (benchmarks/serve_fresh.py): H200, the tier-up of 8 buckets
# after a cold stream took 58-63 s against 80-85 s with the defaults, and the stream after it
# ran 3.42-3.43 ms a request against 3.53; H100, exact shapes T=141 / 450: 2.68 / 7.55 ms
# against 2.74 / 7.43 (compile 3.1 / 3.5 s against 6.4 / 7.0, probe_serving.py).
FULL_GPU_OPTIONS: dict = {"xla_gpu_enable_triton_gemm": False}


def stored_buckets(fam: Family) -> list[tuple[int, ...]]:
  """The buckets ``fam`` has stored under ``cache_dir`` (any tier), sorted; [] if none."""
  store = fam.store()
  if store is None:
    return []
  return sorted({b for b, _ in store.stored() if len(b) == len(fam.policies)})


class Compiler:
  """Builds (loads or compiles) the buckets of one wrapped function's families."""

  def __init__(self, ctx):
    self.ctx = ctx
    self.opts = ctx.opts
    self.cache = ctx.cache
    self.counters = ctx.counters
    self.scheduler: CompileScheduler | None = None
    self.lane_name = f"dynjax-lower-{ctx.name}"
    self._lane: concurrent.futures.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()
    self.force_tier_up = False
    self.calls_at_compile = 0  # calls so far when the last tier-0 compile finished
    self._gap_probe = (-1, 0.0)  # (calls, since when) for _traffic_gap
    self.prerunner = _prerun.Prerunner()
    self._cudnn: dict[int, bool] = {}  # fid -> its executables call cuDNN (runs_cudnn)
    self.traffic = False  # a family of this function has had its first call (preload)

  # -- a call's entry ----------------------------------------------------------------------
  def ready(self, fam: Family, bkey) -> BucketEntry | None:
    entry = fam.buckets.get(bkey)
    if entry is not None and (self.cache.max_entries is None
                              or (fam.fid, bkey) in self.cache):
      return entry
    return None

  def entry_for(self, fam: Family, bkey):
    """(entry, bucket it runs on, was it ready?) for a call whose own bucket is ``bkey``."""
    entry = self.ready(fam, bkey)
    if entry is not None:
      return entry, bkey, True
    if self.opts.async_compile:
      b, entry = self._serve(fam, bkey)
      return entry, b, False
    return self.build_entry(fam, bkey), bkey, False  # new, or evicted: (re)build, wait

  def build_entry(self, fam: Family, bkey, tier: int = 0, prerun: bool = False) -> BucketEntry:
    """Builds (loads or compiles) one bucket; ``tier`` 1 replaces a quick tier-0 executable.
    ``prerun``: nobody waits for this build, so its executable runs once on zeros before it
    serves (``_prerun``; skipped if a caller started waiting for it meanwhile)."""
    if tier == 0:
      entry = self.cache.get_or_build(
          (fam.fid, bkey), lambda: self._first_run(
              fam, bkey, 0, self._build(fam, bkey, 0, prelower=not prerun), prerun))
      if entry.source == "compiled":
        self.calls_at_compile = self.counters.calls_so_far()
    else:
      t0 = time.perf_counter()
      entry = self._first_run(fam, bkey, tier, self._build(fam, bkey, tier, stored_min=tier),
                              prerun)
      self.cache.put((fam.fid, bkey), entry, time.perf_counter() - t0)
    fam.buckets[bkey] = entry
    fam.gen += 1
    if entry.source == "stored":  # a restarted auto policy starts from the buckets it had
      self._adopt(fam, bkey)
    if entry.tier + 1 < self.tiers() and bkey not in fam.tiered:
      # (Also a blocking warmup's builds, run before any scheduler: schedule() makes one.)
      fam.tiered.add(bkey)
      self.schedule(fam, bkey, entry.tier + 1)
    return entry

  def _first_run(self, fam: Family, bkey, tier: int, entry: BucketEntry,
                 prerun: bool) -> BucketEntry:
    """``entry``, run once on zeros first when ``prerun`` and no caller started waiting for
    it meanwhile (a waiting caller runs it itself, on its own request)."""
    if prerun and not (self.scheduler is not None
                       and self.scheduler.waited_for((fam.fid, bkey, tier))):
      if self.runs_cudnn(fam):  # a prerun was in flight in each SIGSEGV and hang of such a
        # process seen (H200, bf16 BERT-base, sessions 36-37; _prerun's docstring): the first
        # request runs it, as under plain JAX
        self.prerunner.skip("cuDNN")
      else:
        self.prerunner.run(fam, bkey, entry)
    return entry

  def runs_cudnn(self, fam: Family) -> bool:
    """Whether ``fam``'s executables call cuDNN (``_attention.runs_cudnn``; once a family)."""
    got = self._cudnn.get(fam.fid)
    if got is None:
      got = self._cudnn[fam.fid] = _attention.runs_cudnn(fam.jaxpr, self.opts.attention)
    return got

  def _build(self, fam: Family, bkey, tier: int, stored_min: int = 0,
             prelower: bool = False) -> BucketEntry:
    """The bucket's best stored executable (tier >= ``stored_min``), or lowered and compiled
    with ``tier``'s compiler options (and stored); ``prelower``: see :meth:`_compile`."""
    entry = fam.load_stored(bkey, stored_min)
    if entry is not None:
      entry.exe = FirstRun(entry.exe, functools.partial(self._rebuild, fam, bkey, entry.tier),
                           functools.partial(_proven, fam, entry),
                           f"{fam.name} bucket {tuple(bkey)} tier {entry.tier}")
      return entry
    return self._compile(fam, bkey, tier, prelower)

  def _compile(self, fam: Family, bkey, tier: int, prelower: bool = False) -> BucketEntry:
    """Lowered (:meth:`lowered`), compiled with ``tier``'s options and stored; ``prelower``
    (a caller waits: a first call's build) lowers the plan's other buckets meanwhile
    (:meth:`_prelower`).  Background builds do not: the process works beside them, and
    lowering holds the GIL (H200, BERT-base fp32: a restart's warm-up from kept traffic
    lowered 8 buckets no job compiled before traffic, 1.9 s of GIL, while the main thread
    built its request list: 7.1 s vs 4.3 s without kept traffic; serve_fresh session 35)."""
    lowered, rewrites = self.lowered(fam, bkey, tier)
    if prelower and self.opts.serving and not fam.prelowering:
      self._prelower(fam, bkey)  # the rest of the plan lowers while this one compiles
    entry = fam.compile_bucket(lowered, rewrites, bkey, tier, self.compile_options(tier))
    if tier + 1 < self.tiers() and KEEP_LOWERED:
      with self._lock:  # for the tier-up: the same module compiled with other options
        kept = fam.kept_lowered
        kept[bkey] = (lowered, rewrites)
        while len(kept) > KEEP_LOWERED:
          kept.pop(next(iter(kept)))
    return entry

  def _rebuild(self, fam: Family, bkey, tier: int):
    """A stored executable that failed its first run, compiled again (its file replaced)."""
    t0 = time.perf_counter()
    exe = self._compile(fam, bkey, tier).exe
    self.cache.counted_compile((fam.fid, bkey), time.perf_counter() - t0)
    self.counters.rebuilt_stored()
    return exe

  def lowered(self, fam: Family, bkey, tier: int = 0):
    """(Lowered, rewrites) of a bucket: kept from its tier-0 build (a tier-up), pre-lowered
    during the first wait, else now (when serving, on the one lowering lane)."""
    if tier > 0:
      with self._lock:
        kept = fam.kept_lowered.pop(bkey, None)
      if kept is not None:
        self.counters.reused_lowering()
        return kept
    with self._lock:  # against _prelower's check of what is building
      fut = fam.prelowered.pop(bkey, None)
    if fut is not None and not fut.cancel():  # started (or done): wait for it
      try:
        return fut.result()
      except Exception:  # noqa: BLE001 - lowered again below, raising where it belongs
        pass
    if self.opts.serving and threading.current_thread().name != self.lane_name:
      return self.lane().submit(lowering, fam, bkey, self.has_traffic).result()
    return fam.lower_bucket(bkey)

  def _plan_from_store(self, fam: Family) -> list:
    """A restart's plan: its stored buckets (returned), then the traffic kept beside them."""
    stored = stored_buckets(fam)
    for b in stored:
      self._adopt(fam, b)
    _traffic.restore(fam)
    return stored

  @staticmethod
  def _adopt(fam: Family, bkey) -> None:
    """The policies (and the joint plan) take a stored bucket as part of their table."""
    for i, (p, b) in enumerate(zip(fam.policies, bkey, strict=True)):
      if fam.joint is None or i not in fam.joint.idx:
        p.adopt(b)
    if fam.joint is not None:
      fam.joint.adopt(fam.joint.sub(bkey))

  # -- progressive serving (async_compile / serving) ---------------------------------------
  def preload(self, fam: Family, sizes) -> None:
    """A family's first call under ``async_compile`` with a ``cache_dir`` (true ``sizes``):
    the stored buckets join the plan now, before the call picks its bucket, and start loading
    in parallel, that call's own bucket first (before, a restart's first call waited for the
    largest stored bucket's load, loads in directory order: H100 BERT-base, 0.6-0.9 s of a
    1,000-request stream)."""
    if fam.preloaded:
      return
    fam.preloaded = True
    self.traffic = True
    stored = self._plan_from_store(fam)
    if self.scheduler is not None:  # traffic: warm jobs one at a time, the restored plan's
      self.scheduler.traffic_started()  # new buckets value-ordered (sched(): one made later)
      _traffic.first_call(fam, self.scheduler)
    own = fam.bucket_of(sizes, observe=False) if stored else None
    for b in sorted(stored, key=lambda b: b != own):  # urgent jobs run in submission order
      # loads in parallel (~0.05-0.2 s a bucket); the others' first runs happen here too
      self.schedule(fam, b, 0, urgent=True, prerun=b != own)

  def _serve(self, fam: Family, bkey):
    """Serves a call whose own bucket is not compiled: the smallest compiled bucket that
    covers it, else the first covering compile in flight (waited for).  The own bucket is
    queued for the background compiler in every case (it runs when it is worth the most)."""
    t_wait = None
    while True:
      best = self.larger_bucket(fam, bkey)
      if best is not None:
        self.schedule(fam, bkey, 0)  # value-driven: compiles when worth it
        if t_wait is not None:
          self.counters.waited(time.perf_counter() - t_wait)
        return best
      if t_wait is None:
        t_wait = time.perf_counter()
      # Nothing compiled covers this call: it waits for the first covering executable.
      # Serving: the bucket covering everything compiles first; the own bucket follows in
      # the background, or (GPU quick tier, >= 8 cores) at the same time: quick compiles
      # autotune little (level 1), so two at once barely slow each other, and the first requests
      # are served on the own bucket, not the largest (H100, BERT-base: the 512 bucket 8.7 ms
      # a request, the 256 one 4.2).  Otherwise (or no declared max): the own bucket, now.
      top = top_bucket(fam, bkey) if self.opts.serving else None
      if top is not None and top != bkey:
        urgent = self.schedule(fam, top, 0, urgent=True)
        self.schedule(fam, bkey, 0, urgent=self._co_compile_own())
      else:
        urgent = self.schedule(fam, bkey, 0, urgent=True)
      futs = {urgent, *self._covering_futures(fam, bkey)}  # (urgent always: a queued job
      # worth nothing now may never run; waiting on such alone hung a restart's first call)
      done, _ = concurrent.futures.wait(futs, return_when=concurrent.futures.FIRST_COMPLETED)
      if urgent in done and urgent.exception() is not None:
        raise urgent.exception()

  def larger_bucket(self, fam: Family, bkey):
    """(bucket, entry) of the smallest compiled bucket that covers ``bkey``, or None."""
    best = None
    for other, entry in list(fam.buckets.items()):
      if (all(o >= b for o, b in zip(other, bkey, strict=True))
          and (fam.fid, other) in self.cache):
        if best is None or math.prod(other) < math.prod(best[0]):
          best = (other, entry)
    return best

  def _co_compile_own(self) -> bool:
    """Whether a first call compiles its own bucket alongside the covering one."""
    return (self.tiers() > 1 and self.opts.compile_workers >= 2
            and (os.cpu_count() or 1) >= 8)

  def _prelower(self, fam: Family, first) -> None:
    """Lowers the buckets the policies plan, on the lane, while a first call's bucket
    compiles: no request is served yet, so the GIL it holds is free (done by the compile
    workers once serving had started, it stalled every request: H100, BERT-base, ~0.3 s
    of GIL a bucket, ~100 ms requests for a second after the first compile)."""
    fam.prelowering = True
    stored = set(stored_buckets(fam))
    plan = [b for b in plan_buckets(fam, first, PRELOWER_MAX) if b != first and b not in stored]
    if not plan:
      return
    lane = self.lane()
    # Not a bucket a build lowers (a blocking warmup's), built, or queued here already; under
    # the lock lowered() pops under, as a build registers as building before it pops (an H100
    # warmup lowered a bucket twice without it).  A compile job that starts before its turn
    # cancels the lane job (a queued future cancels) and lowers it itself.
    with self._lock:
      for b in plan:
        if not (b in fam.prelowered or self.cache.building((fam.fid, b))
                or (fam.fid, b) in self.cache):  # building first: it turns into cached
          fam.prelowered[b] = lane.submit(lowering, fam, b, self.has_traffic)

  def lane(self) -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that lowers buckets while serving.

    Lowering holds the GIL (Python tracing, and MLIR passes in C++ that cannot be
    preempted); several compile workers lowering at once left the serving thread a fifth of
    the GIL (H100, BERT-base, auto re-plans: ~300 ms requests).  One lane costs no lowering
    throughput (the GIL serialises it anyway); while it runs beside traffic the switch
    interval is 0.5 ms (:func:`quick_switches`), not 5 ms.
    """
    lane = self._lane
    if lane is None:
      with self._lock:
        if self._lane is None:
          self._lane = concurrent.futures.ThreadPoolExecutor(
              1, thread_name_prefix=self.lane_name)
        lane = self._lane
    return lane

  def has_traffic(self) -> bool:
    """Whether a family of this function has had its first call (see :func:`lowering`)."""
    return self.traffic

  def sched(self) -> CompileScheduler:
    sched = self.scheduler
    if sched is None:
      with self._lock:
        if self.scheduler is None:
          sched = CompileScheduler(self.opts.compile_workers, self.job_value,
                                   name=self.ctx.name)
          if self.traffic:  # made after the first call (no warm-up before it)
            sched.traffic_started()
          self.scheduler = sched
        sched = self.scheduler
    return sched

  def schedule(self, fam: Family, bkey, tier: int, urgent: bool = False, warm: bool = False,
               prerun: bool | None = None):
    """A future of the bucket's entry: queued for the background compiler (done at once when
    the tier-0 entry is already built); ``urgent``: a caller waits; ``warm``: a background
    warmup's job (see ``_scheduler``); ``prerun`` (default: not ``urgent``): the executable
    runs once on zeros before it serves."""
    if prerun is None:
      prerun = not urgent
    if tier == 0 and (fam.fid, bkey) in self.cache:
      f = concurrent.futures.Future()
      f.set_result(self.cache.get((fam.fid, bkey)))
      return f
    return self.sched().submit((fam.fid, bkey, tier),
                               functools.partial(self.build_entry, fam, bkey, tier,
                                                 prerun=prerun),
                               urgent=urgent, info=(fam, bkey, tier), warm=warm)

  def _covering_futures(self, fam: Family, bkey) -> list:
    return [f for (fid, b, tier), f in self.sched().in_flight().items()
            if fid == fam.fid and tier == 0 and all(x >= y for x, y in zip(b, bkey, strict=True))]

  def job_value(self, job) -> float:
    """Expected serving seconds a job saves per second of compiling (the scheduler's order).

    Tier 0: over the true size tuples seen so far, how much cheaper the job's bucket would
    serve them than the best executable they have now (compiled, or compiling), if the
    policies still want the bucket.  Tier 1 (recompiling with full options) runs when nothing
    else is running or wanted and traffic has a gap (or is steady, or ``wait()`` asks), one at
    a time, the most used bucket first.
    Called by the scheduler under its lock: it reads the scheduler's job lists it is given.
    """
    fam, bkey, tier = job.info
    sched = self.scheduler
    if tier > 0:
      calls = self.counters.calls_so_far()
      if (not self.force_tier_up and calls - self.calls_at_compile < TIER_UP_AFTER
          and not self._traffic_gap(calls)):
        return 0.0  # busy and not yet steady: autotuning now would stall the requests
      if sched.running_jobs():
        return 0.0
      for other in sched.pending_jobs():
        ofam, obkey, otier = other.info
        # A queued tier-0 job worth compiling goes first, also before any call of its family
        # was counted (the first call still runs when the top bucket is built); one worth
        # nothing (not cheaper than what serves its sizes) must not hold tier-ups back.
        if other.urgent or (otier == 0 and (self._tier0_value(ofam, obkey) > 0
                                            or not ofam.tuple_hist)):
          return 0.0
      return 1e-9 * (1 + self.counters.bucket_uses((fam.fid, bkey)))
    return self._tier0_value(fam, bkey)

  def _traffic_gap(self, calls: int) -> bool:
    """Whether no call has arrived for ``TIER_UP_IDLE_S`` (asked by the scheduler's workers,
    which look again at least once a second; free on the hot path: it compares call counts)."""
    now = time.perf_counter()
    seen_calls, since = self._gap_probe
    if calls == 0 and not TIER_UP_BEFORE_TRAFFIC:
      return False
    if calls != seen_calls:
      self._gap_probe = (calls, now)
      return False
    return now - since >= TIER_UP_IDLE_S

  def _tier0_value(self, fam: Family, bkey) -> float:
    if (fam.fid, bkey) in self.cache or not fam.tuple_hist:
      return 0.0
    if not fam.planned(bkey):
      return 0.0  # re-planned away (auto): retired while still queued
    sizes = np.array(list(fam.tuple_hist), np.int64)
    counts = np.array(list(fam.tuple_hist.values()), float)
    have = [b for b in fam.buckets if (fam.fid, b) in self.cache]
    have += [j.info[1] for j in self.scheduler.running_jobs()
             if j.info[0] is fam and j.info[2] == 0 and j.info[1] != bkey]
    cost = self._cost_model(fam)
    mine = cost(bkey)
    if have:
      hb = np.array(have, np.int64)
      covers = np.all(hb[:, None, :] >= sizes[None, :, :], axis=2)  # [have, sizes]
      hc = np.array([cost(b) for b in have])
      cur = np.where(covers, hc[:, None], np.inf).min(axis=0)
    else:
      cur = np.full(len(sizes), np.inf)
    wait_cost = 4.0 * max([mine, *(cost(b) for b in have)])  # no executable yet: a compile
    cur = np.where(np.isfinite(cur), cur, wait_cost)
    mask = np.all(np.array(bkey)[None, :] >= sizes, axis=1)
    gain = float((counts[mask] * np.maximum(cur[mask] - mine, 0.0)).sum())
    seconds = self._compile_estimate(fam)
    if (gain < CONTENTION * seconds and not self.force_tier_up  # wait(): build it all now
        and not self._traffic_gap(self.counters.calls_so_far())):
      return 0.0  # not yet worth the requests it would slow (unless traffic has a gap)
    return gain / seconds

  def _cost_model(self, fam: Family):
    """Seconds per call of a bucket: :func:`dynjax.bucketing._cost.fit` (``a + b*x + c*x**2``,
    nonnegative, with a fixed part) over the measured buckets, ``x`` the product of the bucket
    tuple (one varying dim: its size times the fixed ones), each weighted by its calls."""
    known = [(math.prod(b), t, max(1, self.counters.bucket_uses((fam.fid, b))))
             for b, t in list(fam.bucket_time.items())]
    ref = max((math.prod(b) for b in fam.buckets), default=1)
    model = _cost.fit(known, t_ref=ref)
    return lambda b: float(model(math.prod(b)))

  def _compile_estimate(self, fam: Family) -> float:
    ts = [dt for key, dt in self.cache.compile_log if key[0] == fam.fid]
    return float(np.mean(ts)) if ts else 1.0

  def tiers(self) -> int:
    """2 when serving on GPU with default compiler options (quick tier first), else 1."""
    if self.opts.serving and not self.opts.compiler_options and on_gpu():
      return 2
    return 1

  def compile_options(self, tier: int) -> dict:
    opts = dict(self.opts.compiler_options)
    if self.tiers() > 1:
      opts.update(QUICK_GPU_OPTIONS if tier == 0 else FULL_GPU_OPTIONS)
    return opts

  # -- ahead of time -----------------------------------------------------------------------
  def warmup(self, fam: Family, sizes, progress: bool | None, max_workers: int | None,
             background: bool) -> dict:
    """``Wrapped.warmup``: every bucket of the declared ranges (and every stored one); for
    an ``auto`` policy its plan, or cold its ladder (``BucketPolicy.warm_sizes``)."""
    if fam.mode not in ("trust", "auto"):
      return {"buckets": [], "compiled": 0, "seconds": 0.0,
              "note": fam.fallback or f"{fam.mode} mode"}
    stored = self._plan_from_store(fam)  # (a restart: no cold ladder on top)
    jidx = () if fam.joint is None else fam.joint.idx  # joint dims: the joint plan's tuples
    per_var = [(p.sizes() if i in jidx else p.warm_sizes()) if p.max is not None
               else (p.bucket(n),)
               for i, (n, p) in enumerate(zip(sizes, fam.policies, strict=True))]
    todo = list(itertools.product(*per_var))
    if fam.joint is not None:  # the planned tuples, not the product of the auto tables
      todo = sorted({tuple(jt[jidx.index(i)] if i in jidx else b[i] for i in range(len(b)))
                     for b in todo for jt in fam.joint.sizes()})
    todo = sorted({capped_bucket(fam, b) for b in todo} | set(stored))  # guards' bounds
    before, loads_before = self.cache.compiles, self.cache.loads
    t0 = time.perf_counter()
    if background:  # in order (_traffic.warm_order), max_workers at once (CompileScheduler.warm;
      # cuDNN's kernels one at a time: two at once crashed 3 of 5 bf16 processes, H200)
      self.sched().warm(max_workers or (1 if self.runs_cudnn(fam) else None))
      futs = [self.schedule(fam, b, 0, warm=_traffic.at_startup(fam, b))
              for b in _traffic.warm_order(fam, todo, stored)]
      return {"buckets": todo, "pending": sum(not f.done() for f in futs), "seconds": 0.0}
    show = config.progress if progress is None else progress
    workers = max_workers or min(len(todo), max(2, os.cpu_count() or 2))
    done = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      futs = [pool.submit(self.build_entry, fam, b, prerun=True) for b in todo]
      for f in concurrent.futures.as_completed(futs):
        f.result()
        done += 1
        if show:
          _progress(f"dynjax warmup {self.ctx.name}", done, len(todo),
                    time.perf_counter() - t0)
    if show:
      sys.stderr.write("\n")
    return {"buckets": todo, "compiled": self.cache.compiles - before,
            "loaded": self.cache.loads - loads_before, "seconds": time.perf_counter() - t0}

  def wait(self, timeout: float | None = None) -> bool:
    """Waits for background compiles, including queued tier-1 recompiles; False on timeout."""
    if self.scheduler is None:
      return True
    self.force_tier_up = True  # whoever waits lets the tier-1 recompiles run now
    self.scheduler.poke()
    return self.scheduler.wait_idle(timeout)


_SWITCH = {"active": 0, "saved": None}
_SWITCH_LOCK = threading.Lock()
_QUICK_SWITCH_S = 5e-4


@contextlib.contextmanager
def quick_switches():
  """While any background lowering runs: the interpreter's GIL switch interval at most
  0.5 ms (restored when the last one ends).  Process-wide, as ``sys.setswitchinterval``."""
  with _SWITCH_LOCK:
    if _SWITCH["active"] == 0:
      _SWITCH["saved"] = sys.getswitchinterval()
      sys.setswitchinterval(min(_SWITCH["saved"], _QUICK_SWITCH_S))
    _SWITCH["active"] += 1
  try:
    yield
  finally:
    with _SWITCH_LOCK:
      _SWITCH["active"] -= 1
      if _SWITCH["active"] == 0 and _SWITCH["saved"] is not None:
        sys.setswitchinterval(_SWITCH["saved"])
        _SWITCH["saved"] = None


def _proven(fam: Family, entry, exe) -> None:
  """A stored entry's first run succeeded: its executors take the plain executable."""
  entry.exe = exe
  fam.gen += 1


def lowering(fam: Family, bkey, serving: Callable[[], bool]):
  """A lowering-lane job: ``fam.lower_bucket(bkey)``, with quick GIL switches if ``serving()``
  as it starts (a request then waits <= 0.5 ms for the GIL).  Before traffic they save no
  request and cost the start-up's own Python (2-core box: pure-Python work beside a GIL-bound
  thread took +17% CPU seconds at 0.5 ms switches, +5% at 5 ms)."""
  with quick_switches() if serving() else contextlib.nullcontext():
    return fam.lower_bucket(bkey)


def on_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def _progress(label: str, done: int, total: int, seconds: float) -> None:
  width = 30
  filled = int(width * done / max(total, 1))
  sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                   f"{seconds:.1f}s")
  sys.stderr.flush()
