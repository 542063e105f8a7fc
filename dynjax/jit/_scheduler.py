"""Background compiles, most valuable first: the engine of progressive serving.

A :class:`CompileScheduler` owns a few worker threads (XLA compiles release the GIL, so they
run truly in parallel with each other and with serving).  Jobs are *not* ordered when they are
submitted: each time a worker is free it asks ``value(job)`` of every pending job and runs the
best one, so a plan that changed, or a histogram that grew, re-orders the queue for free.  A
job whose value is ``<= 0`` waits until it becomes positive (or is cancelled).

No tracing code lives here: a job carries a ``build()`` thunk supplied by the compiler
(``dynjax/jit/_serving.py``), which also decides what a job is worth (expected serving time
saved per second of compiling).

Measured (H100 host, 16 cores, BERT-base, triton gemm off): one bucket compiles in 3.4 s
alone; six at once take 7.5 s wall (2.7x the throughput of one at a time): urgent jobs (a
caller waits on them, or a restart loads its stored buckets) use every worker.  Background jobs run one at a time
(:data:`BACKGROUND_AT_ONCE`): while requests are served, parallel compiles slowed them more
than the sooner buckets saved.  Warm jobs (``warmup(background=True)``: a server's start-up,
while its own code still runs) come before background jobs, in submission order,
:data:`STARTUP_AT_ONCE` at a time before traffic on hosts with the cores, then
:data:`WARM_AT_ONCE`; a caller that needs one makes it urgent.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger("dynjax")


# Background (not urgent) jobs running at once.  Urgent jobs (a caller waits on them, or a
# restart loads its stored buckets) use every worker; the rest compile while requests are served, and parallel compiles
# slow those requests.  H100, BERT-base fp32, a cold server warmed up from shapes at start-up
# (4 buckets) then streaming 1,000 requests while its plan's next 4 buckets compiled in the
# quick tier (benchmarks/serve_fresh.py, one run, jax 0.11.2): 4 at once, stream 7.26 s and
# 6.58 ms a request; 2 at once 6.47 s; 1 at a time 5.33 s and 5.51 ms (PyTorch eager 5.84 s,
# 5.56 ms); the same server with no compile during the stream (pow2, all 6 warmed) 4.89 s.
# Lowering the compile threads' priority (nice 10) changed nothing (7.32 s).
BACKGROUND_AT_ONCE = 1
# Warm jobs (``warmup(background=True)``) running at once, unless the warmup names
# ``max_workers``.  A server warms up while its own start-up code (reading weights, building
# state) runs in Python; parallel compiles took that thread's time.  H100, BERT-base fp32
# (serve_fresh.py, jax 0.11.2, run 12): the same start-up code (building the request list)
# took 9.8 s beside dynjax's four concurrent warmup compiles, 5.8 s beside a hand-written
# warmup thread compiling one bucket at a time, and 7.3 s in PyTorch's process.
WARM_AT_ONCE = 1
# Warm jobs at once before traffic (until the function's first call) on hosts of STARTUP_CORES
# cores or more, where the warm-up names no ``max_workers``.  One GPU compile of a bucket is
# one core's work: H200 host (16 cores), BERT-base fp32, jax 0.11.2, serve_fresh.py session
# 35 (tag wa2, two rounds): the start-up ladder's buckets compiled in 4.6-4.7 s two at once
# against 4.6-5.0 alone, all four before the first request (one at a time: two), and the
# cold 1,000-request stream took 4.51 / 4.00 s against 5.16 / 4.78 (4.11 / 3.97 ms a request
# against 4.66 / 4.69; start to the 1,000th answer 18.5 / 20.2 s against 22.2 / 21.9; PyTorch
# eager 5.81 / 4.48 s, 21.6 / 21.0 s); the request list beside them took no longer (5.5-6.9
# s against 5.8-6.8).  From the first call on, WARM_AT_ONCE: requests are served.  One worker
# stays free for an urgent build (a call that needs a bucket waits for none of these).
STARTUP_AT_ONCE = 2
STARTUP_CORES = 8
# Every scheduler alive (its workers hold it while they run): closed at exit (_at_exit); the
# tests close the ones a test started.
LIVE: weakref.WeakSet = weakref.WeakSet()
# At exit, queued jobs are dropped and running ones are waited for up to this long: a compile
# worker that comes back from XLA while the interpreter finalizes is ended by CPython inside
# XLA's C++ frames ("FATAL: exception not rethrown", the process aborts; seen once on the
# 2-core box, a script that ended during a restart's warm-up).
EXIT_WAIT_S = 30.0


def _at_exit() -> None:
  running = [s for s in list(LIVE) if s.running()]
  for sched in list(LIVE):
    sched.close()
  if running:
    logger.info("dynjax: waiting up to %.0f s for %d running background compile(s) to end "
                "before exit", EXIT_WAIT_S, sum(len(s.running()) for s in running))
  deadline = time.perf_counter() + EXIT_WAIT_S
  for sched in running:
    sched.wait_idle(timeout=max(0.0, deadline - time.perf_counter()))


atexit.register(_at_exit)


def startup_host() -> bool:
  """Whether this host has :data:`STARTUP_CORES` cores: compiles before traffic (two warm
  jobs at once, a restored plan's new buckets) leave the server's own start-up its cores."""
  return (os.cpu_count() or 1) >= STARTUP_CORES


def _shutting_down(e: BaseException) -> bool:
  """Whether ``e`` only says the interpreter is exiting (a thread pool refusing new work)."""
  return sys.is_finalizing() or (isinstance(e, RuntimeError)
                                 and "interpreter shutdown" in str(e))


class Job:
  """One pending compile: ``key`` (unique), ``build()``, and ``future`` (its result)."""

  __slots__ = ("key", "build", "future", "urgent", "warm", "submitted", "started", "info",
               "waited_for")

  def __init__(self, key: Hashable, build: Callable[[], Any], urgent: bool, info: Any,
               warm: bool = False):
    self.key = key
    self.build = build
    self.future: Future = Future()
    self.urgent = urgent
    self.warm = warm  # a background warmup's job: before value-ordered jobs, in order
    self.waited_for = False  # an urgent submit found it queued or running: a caller waits
    self.submitted = time.perf_counter()
    self.started: float | None = None
    self.info = info


class CompileScheduler:
  """Runs compile jobs on ``workers`` daemon threads, highest ``value(job)`` first.

  Args:
    workers: number of threads (>= 1).
    value: ``job -> float``; called under the scheduler's lock, must be cheap and must not
      call back into the scheduler.  Urgent jobs (a caller is blocked on them) go first.
    name: for thread names and logs.
  """

  def __init__(self, workers: int, value: Callable[[Job], float], name: str = ""):
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    self.workers = workers
    self._value = value
    self.name = name
    self._cv = threading.Condition()
    self._pending: dict[Hashable, Job] = {}
    self._running: dict[Hashable, Job] = {}
    self._threads: list[threading.Thread] = []
    self._closed = False
    self.warm_at_once = WARM_AT_ONCE
    self._warm_named = False  # a warm-up named its max_workers: kept after traffic starts
    self._traffic = False  # a function of this scheduler's has had its first call
    self.done = 0
    self.failed = 0
    self.busy_seconds = 0.0
    self.log: list[tuple[Hashable, float, float]] = []  # (key, start offset, seconds)
    self._t0 = time.perf_counter()
    LIVE.add(self)

  def warm(self, max_workers: int | None) -> None:
    """A background warm-up starts: its jobs run ``max_workers`` at once, else
    :data:`STARTUP_AT_ONCE` on hosts of :data:`STARTUP_CORES` cores until
    :meth:`traffic_started` (:data:`WARM_AT_ONCE` elsewhere, and once traffic has come),
    leaving a worker free for a caller's urgent build (it does not wait for a warm one)."""
    self._warm_named = bool(max_workers)
    self.warm_at_once = max_workers or (
        max(WARM_AT_ONCE, min(STARTUP_AT_ONCE, self.workers - 1))
        if not self._traffic and startup_host() else WARM_AT_ONCE)

  def traffic_started(self) -> None:
    """A function's first call: warm jobs left run :data:`WARM_AT_ONCE` at once from here
    (unless the warm-up named its ``max_workers``); compiles beside requests slow them."""
    self._traffic = True
    if not self._warm_named:
      self.warm_at_once = WARM_AT_ONCE

  # -- submitting --------------------------------------------------------------------------
  def submit(self, key: Hashable, build: Callable[[], Any], urgent: bool = False,
             info: Any = None, warm: bool = False) -> Future:
    """Queues ``build`` under ``key`` (or returns the future of the job already queued or
    running under it; ``urgent`` or ``warm`` raises a queued job's priority).  Closed (at
    exit): a cancelled future, so that whoever waits on it is told, not left waiting."""
    with self._cv:
      if self._closed:
        fut: Future = Future()
        fut.cancel()
        return fut
      job = self._pending.get(key) or self._running.get(key)
      if job is not None:
        job.waited_for = job.waited_for or urgent
        if (urgent and not job.urgent) or (warm and not job.warm):
          job.urgent = job.urgent or urgent
          job.warm = job.warm or warm
          self._cv.notify()
        return job.future
      job = Job(key, build, urgent, info, warm)
      self._pending[key] = job
      self._ensure_threads()
      self._cv.notify()
      return job.future

  def waited_for(self, key: Hashable) -> bool:
    """Whether a caller started waiting for the job under ``key`` after it was queued."""
    with self._cv:
      job = self._running.get(key) or self._pending.get(key)
      return job is not None and job.waited_for

  def cancel(self, key: Hashable) -> bool:
    """Drops a job that has not started (its future is cancelled)."""
    with self._cv:
      job = self._pending.pop(key, None)
    if job is None:
      return False
    job.future.cancel()
    return True

  def demote(self, which: Callable[[Job], bool]) -> int:
    """Queued warm jobs that ``which`` picks become value-ordered jobs; returns how many."""
    with self._cv:
      jobs = [j for j in self._pending.values() if j.warm and not j.urgent and which(j)]
      for j in jobs:
        j.warm = False
      self._cv.notify_all()
    return len(jobs)

  def poke(self) -> None:
    """Re-evaluates values now (a plan or histogram changed)."""
    with self._cv:
      self._cv.notify_all()

  def in_flight(self) -> dict[Hashable, Future]:
    """Futures of every pending or running job, by key."""
    with self._cv:
      return {k: j.future for k, j in (*self._pending.items(), *self._running.items())}

  def running_jobs(self) -> list[Job]:
    """The running jobs (the lock is re-entrant: a value function may ask)."""
    with self._cv:
      return list(self._running.values())

  def pending_jobs(self) -> list[Job]:
    with self._cv:
      return list(self._pending.values())

  def running(self) -> list[Hashable]:
    with self._cv:
      return list(self._running)

  def pending(self) -> list[Hashable]:
    with self._cv:
      return list(self._pending)

  def idle(self) -> bool:
    with self._cv:
      return not self._pending and not self._running

  def wait_idle(self, timeout: float | None = None, include_waiting: bool = False) -> bool:
    """Blocks until no job runs and no job with a positive value is pending."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    with self._cv:
      while True:
        ready = [j for j in self._pending.values()
                 if include_waiting or j.urgent or j.warm or self._safe_value(j) > 0]
        if not self._running and not ready:
          return True
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
          return False
        self._cv.wait(0.05 if left is None else min(left, 0.05))

  def close(self) -> None:
    with self._cv:
      self._closed = True
      for job in self._pending.values():
        job.future.cancel()
      self._pending.clear()
      self._cv.notify_all()

  # -- workers -----------------------------------------------------------------------------
  def _ensure_threads(self) -> None:
    while len(self._threads) < self.workers:
      t = threading.Thread(target=self._work, daemon=True,
                           name=f"dynjax-compile-{self.name}-{len(self._threads)}")
      self._threads.append(t)
      t.start()

  def _safe_value(self, job: Job) -> float:
    try:
      return float(self._value(job))
    except Exception:  # noqa: BLE001 - a broken value function must not stall compiles
      logger.exception("dynjax: compile priority of %s failed", job.key)
      return 1.0

  def _pick(self) -> Job | None:
    # Urgent jobs (a caller waits on them) first; while one runs, nothing else starts: a
    # concurrent compile would slow it down (XLA compiles share cores and the GPU autotuner).
    urgent = [j for j in self._pending.values() if j.urgent]
    if urgent:
      return min(urgent, key=lambda j: j.submitted)
    if any(j.urgent for j in self._running.values()):
      return None
    warm = [j for j in self._pending.values() if j.warm]
    if warm:  # a start-up warmup: in order (largest bucket first), a few at a time
      if len(self._running) >= self.warm_at_once:
        return None
      return min(warm, key=lambda j: j.submitted)
    if len(self._running) >= BACKGROUND_AT_ONCE:
      return None
    best, best_v = None, 0.0
    for job in self._pending.values():
      v = self._safe_value(job)
      if v > best_v:
        best, best_v = job, v
    return best

  def _work(self) -> None:
    while True:
      with self._cv:
        job = None
        while not self._closed:
          job = self._pick()
          if job is not None:
            break
          self._cv.wait(1.0)  # values change with traffic: look again now and then
        if self._closed:
          return
        del self._pending[job.key]
        self._running[job.key] = job
        job.started = time.perf_counter()
      try:
        result = job.build()
      except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        with self._cv:
          self._running.pop(job.key, None)
          self.failed += 1
          waited = job.urgent or job.waited_for
          self._cv.notify_all()
        if not waited and not _shutting_down(e):  # nobody may ever read the future: say
          # it (the bucket builds again when a call needs it, and that call raises what it
          # raises); a job cut short by the interpreter's exit is not news
          logger.warning("dynjax: the background build of %s failed (%s: %s); a call that "
                         "needs it builds it again", job.key, type(e).__name__, e,
                         exc_info=e)
        job.future.set_exception(e)
        continue
      dt = time.perf_counter() - job.started
      with self._cv:
        self._running.pop(job.key, None)
        self.done += 1
        self.busy_seconds += dt
        self.log.append((job.key, job.started - self._t0, dt))
        self._cv.notify_all()
      job.future.set_result(result)
