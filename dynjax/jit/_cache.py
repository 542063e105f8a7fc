"""Executable cache: one compiled executable per key, compiled once under concurrency.

Single flight: the first caller of a key compiles it; concurrent callers of the same key wait
for that compile instead of starting their own.  A bound (``max_entries``) evicts the least
recently used executable so that a server fed an unbounded stream of shapes keeps its memory
flat.  Only runtime code lives here (no tracing): the caller passes a ``build()`` thunk.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger("dynjax")


def enable_compile_log() -> None:
  """DYNJAX_LOG_COMPILES=1: make the compile lines visible (INFO on stderr) unless the
  application configured the "dynjax" logger itself."""
  if not logger.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logger.addHandler(handler)
  if logger.level == logging.NOTSET or logger.level > logging.INFO:
    logger.setLevel(logging.INFO)


class ExecutableCache:
  """Maps keys to executables built by a thunk, single-flight, optionally LRU-bounded."""

  def __init__(self, max_entries: int | None = None, name: str = "", log: bool = False):
    self.max_entries = max_entries
    self.name = name
    self.log = log
    self._lock = threading.Lock()
    self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    self._inflight: dict[Hashable, Future] = {}
    self.compiles = 0
    self.loads = 0  # entries loaded from an executable store (``source == "stored"``)
    self.compile_seconds = 0.0
    self.evictions = 0
    self.compile_log: list[tuple[Hashable, float]] = []
    # fid -> the family whose ``(fid, bucket)`` keys these are: an evicted bucket's entry
    # leaves its ``buckets`` too (before session 36 it stayed there, and with it every
    # executable ever built: a bound of 2 over 6 buckets kept 6 alive).
    self.owners: dict[Hashable, Any] = {}

  def built_seconds(self, key: Hashable) -> float | None:
    """Seconds the latest compile of ``key`` took, or None (loads are not logged)."""
    return next((dt for k, dt in reversed(self.compile_log) if k == key), None)

  def get(self, key: Hashable):
    """The executable for ``key`` or None (hot path: one dict lookup, ~0.1 us)."""
    return self._entries.get(key)

  def touch(self, key: Hashable) -> None:
    """``key`` was used now (a call ran its executable): the last to be evicted."""
    with self._lock:
      if key in self._entries:
        self._entries.move_to_end(key)

  def keys(self):
    return list(self._entries.keys())

  def __contains__(self, key) -> bool:
    return key in self._entries

  def __len__(self) -> int:
    return len(self._entries)

  def get_or_build(self, key: Hashable, build: Callable[[], Any]):
    """Returns the executable for ``key``, building it once even under concurrent callers."""
    exe = self._entries.get(key)
    if exe is not None:
      if self.max_entries is not None:
        with self._lock:
          if key in self._entries:
            self._entries.move_to_end(key)
      return exe
    with self._lock:
      exe = self._entries.get(key)
      if exe is not None:
        return exe
      fut = self._inflight.get(key)
      owner = fut is None
      if owner:
        fut = Future()
        self._inflight[key] = fut
    if not owner:
      return fut.result()
    t0 = time.perf_counter()
    try:
      exe = build()
    except BaseException as e:
      with self._lock:
        del self._inflight[key]
      fut.set_exception(e)
      raise
    dt = time.perf_counter() - t0
    with self._lock:
      del self._inflight[key]
      self._insert(key, exe, dt)
    fut.set_result(exe)
    return exe

  def put(self, key: Hashable, exe, seconds: float) -> None:
    """Installs (or replaces) ``key``'s executable, built by the caller in ``seconds``."""
    with self._lock:
      self._insert(key, exe, seconds)

  def counted_compile(self, key: Hashable, seconds: float) -> None:
    """A compile of ``key``'s executable done outside ``get_or_build`` (a stored entry
    compiled again in place), counted as one."""
    with self._lock:
      self._count_compile(key, seconds)

  def _count_compile(self, key, seconds: float) -> None:  # under the lock
    self.compiles += 1
    self.compile_seconds += seconds
    self.compile_log.append((key, seconds))

  def _insert(self, key, exe, dt: float) -> None:
    stored = getattr(exe, "source", "compiled") == "stored"
    self._entries[key] = exe
    self._entries.move_to_end(key)
    if stored:
      self.loads += 1
    else:
      self._count_compile(key, dt)
    if self.max_entries is not None:
      while len(self._entries) > self.max_entries:
        old_key, old = self._entries.popitem(last=False)
        self.evictions += 1
        fam = self.owners.get(old_key[0]) if type(old_key) is tuple and len(old_key) == 2 else None
        if fam is not None and fam.buckets.get(old_key[1]) is old:
          fam.buckets.pop(old_key[1], None)
          fam.gen += 1  # an executable dropped: executors built on it are stale
    if self.log:
      logger.info("%s %s %s in %.3f s", "loaded" if stored else "compiled", self.name, key, dt)

  def building(self, key: Hashable) -> bool:
    return key in self._inflight

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()
