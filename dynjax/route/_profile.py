"""The load profile: per-path loads recorded over calls, and the capacities planned from it.

Loads are stored as fractions of the number of cells of their call, so a profile recorded at one
batch size plans capacities for another.  The profile is plain numpy (no JAX), saved as JSON.
"""

from __future__ import annotations

import json
import math
import os
import threading

import numpy as np

from dynjax._errors import RoutingError
from dynjax.bucketing._policies import BucketPolicy

_FORMAT = "dynjax.route.Profile"


class Profile:
  """Per-path loads recorded over calls; plans static capacities for the ``profiled`` mode.

  Args:
    num_paths: the number of paths.
    max_records: keep at most this many recent calls (a ring buffer).

  Example:
    >>> prof = dynjax.route.Profile(4)
    >>> prof.record([10, 2, 0, 4], num_cells=16)
    >>> prof.capacities(16, dynjax.buckets.pow2(min=1))
    (16, 2, 0, 4)
    >>> prof.save("/tmp/moe_profile.json"); len(dynjax.route.Profile.load("/tmp/moe_profile.json"))
    1
  """

  def __init__(self, num_paths: int, max_records: int = 4096):
    if isinstance(num_paths, bool) or not isinstance(num_paths, int | np.integer) or num_paths < 1:
      raise RoutingError(f"dynjax.route.Profile: num_paths must be an integer >= 1, got "
                         f"{num_paths!r}")
    self.num_paths = int(num_paths)
    self.max_records = int(max_records)
    self._cells: list[int] = []
    self._loads: list[np.ndarray] = []
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._loads)

  def __repr__(self) -> str:
    return f"Profile(num_paths={self.num_paths}, records={len(self)})"

  def record(self, loads, num_cells: int | None = None) -> None:
    """Records one call's per-path loads (a host array; a device array is read, one sync).

    Args:
      loads: ``[num_paths]`` integer loads (e.g. ``Routing.loads``).
      num_cells: the number of cells (tokens) of the call; default ``sum(loads)``.
    """
    arr = np.asarray(loads).astype(np.int64).reshape(-1)
    if arr.shape[0] != self.num_paths:
      raise RoutingError(
          f"dynjax.route.Profile.record: loads has {arr.shape[0]} entries, expected "
          f"num_paths={self.num_paths}; pass Routing.loads of the same router")
    n = int(arr.sum()) if num_cells is None else int(num_cells)
    with self._lock:
      self._cells.append(max(n, 1))
      self._loads.append(arr)
      if len(self._loads) > self.max_records:
        del self._cells[0], self._loads[0]

  def fractions(self) -> np.ndarray:
    """``[records, num_paths]`` loads divided by their call's number of cells."""
    if not self._loads:
      return np.zeros((0, self.num_paths))
    return np.stack(self._loads) / np.asarray(self._cells, float)[:, None]

  def capacities(self, num_cells: int, policy: BucketPolicy, quantile: float = 0.999,
                 margin: float = 1.0, max_capacity: int | None = None) -> tuple[int, ...]:
    """Static per-path capacities for a call of ``num_cells`` cells.

    Capacity of path ``p`` = ``policy.bucket(ceil(q_p * num_cells * margin))`` where ``q_p`` is
    the ``quantile`` of the recorded load fractions of ``p``; 0 for a path never loaded (its
    cells, if any come, take the overflow path).  Capped at ``max_capacity`` (default
    ``num_cells``).

    Args:
      num_cells: cells of the call to plan for.
      policy: the bucket policy (``dynjax.buckets``) that rounds capacities.
      quantile: per-path load quantile to cover (1.0: the largest load seen).
      margin: multiplies the quantile before bucketing (head-room for drift).
      max_capacity: upper bound of a capacity.

    Returns:
      A tuple of ``num_paths`` integers.
    """
    top = num_cells if max_capacity is None else max_capacity
    out = []
    for need in self.needs(num_cells, quantile, margin):
      if need <= 0:
        out.append(0)
        continue
      b = policy.bucket(need)
      out.append(int(min(top, policy.grow(need) if b is None else b)))
    return tuple(out)

  def needs(self, num_cells: int, quantile: float = 0.999, margin: float = 1.0) -> tuple[int, ...]:
    """Per-path loads to cover before bucketing: ``ceil(q_p * num_cells * margin)``."""
    if not self._loads:
      raise RoutingError("dynjax.route.Profile: the profile is empty; record loads first (run "
                         "in mode='exact-sync', or call profile.record(routing.loads, num_cells))")
    q = np.quantile(self.fractions(), quantile, axis=0, method="higher")
    return tuple(max(0, math.ceil(float(f) * num_cells * margin - 1e-9)) for f in q)

  def summary(self) -> dict:
    """Mean and p99 load fraction per path, and the number of records."""
    fr = self.fractions()
    if not len(fr):
      return {"records": 0}
    return {"records": len(fr), "mean_fraction": fr.mean(0).round(6).tolist(),
            "p99_fraction": np.quantile(fr, 0.99, axis=0).round(6).tolist()}

  def as_dict(self) -> dict:
    """A JSON-ready dict (what :meth:`save` writes)."""
    return {"format": _FORMAT, "version": 1, "num_paths": self.num_paths,
            "max_records": self.max_records, "cells": list(self._cells),
            "loads": [a.tolist() for a in self._loads]}

  def save(self, path: str | os.PathLike) -> None:
    """Writes the profile as JSON to ``path``."""
    with open(path, "w") as f:
      json.dump(self.as_dict(), f)

  @classmethod
  def from_dict(cls, data: dict) -> Profile:
    """Rebuilds a profile from :meth:`as_dict` output."""
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
      raise RoutingError(f"dynjax.route.Profile: not a saved profile (expected format "
                         f"{_FORMAT!r}, got {data.get('format') if isinstance(data, dict) else data!r})")
    prof = cls(int(data["num_paths"]), int(data.get("max_records", 4096)))
    for n, loads in zip(data["cells"], data["loads"], strict=True):
      prof.record(loads, n)
    return prof

  @classmethod
  def load(cls, path: str | os.PathLike) -> Profile:
    """Reads a profile written by :meth:`save`."""
    with open(path) as f:
      return cls.from_dict(json.load(f))
