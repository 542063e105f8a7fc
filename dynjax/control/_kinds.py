"""Argument kinds and arena helpers of the recursion engine (shared by ``recursive`` and ``fold``).

A cell call's arguments are classified into interned :class:`Kind` objects (hashed by
identity, so group keys hash fast): a pending cell result (``"node"``), a host value
(``"host"``), a device array (``"dev"``), or a composite (``"obj"``: an object of host/device
leaves known by identity; ``"mixed"``: a container holding pending results).  Results live in
*arenas* (one device buffer per (shape, dtype), capacity a power of two); groups read them by
index.  This is the package-internal interface both front ends build their schedules with.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dynjax._errors import ControlFlowError
from dynjax.control._frontend import is_tracer, needs_vm

# -- argument kinds -------------------------------------------------------------------------
LEAF_TD = jax.tree_util.tree_structure(0)


class Kind:
  """An interned argument kind: hashed by identity, so group keys hash fast.

  Leaf kinds: ``"node"`` (a pending cell result), ``"host"`` (a numpy/Python value), ``"dev"``
  (a device array); ``shape``/``dtype`` are the per-item shape and canonical dtype.  Argument
  kinds are a leaf kind (a pending result, a Python scalar) or a composite: ``"obj"`` (an
  object of host/device leaves, recognised by identity: params, a per-node array),
  ``"mixed"`` (a container holding pending results: a tuple ``(h, c)``, a list of children);
  ``extra`` = (treedef, leaf kinds).  ``td`` is the argument's treedef, ``leaves`` its leaf
  kinds, ``flat`` their (kind, shape, dtype) for the cell's signature.
  """

  __slots__ = ("kind", "shape", "dtype", "extra", "td", "leaves", "flat")

  def __init__(self, kind, shape, dtype, extra):
    self.kind, self.shape, self.dtype, self.extra = kind, shape, dtype, extra
    if extra is None:
      self.td, self.leaves = LEAF_TD, (self,)
    else:
      self.td, self.leaves = extra
    self.flat = tuple((k.kind, k.shape, k.dtype) for k in self.leaves)

  def __repr__(self) -> str:
    if self.extra is None:
      return f"{self.kind}:{jnp.dtype(self.dtype).name}{list(self.shape)}"
    return f"{self.kind}{list(self.leaves)}"


_KINDS: dict = {}


def intern_kind(kind, shape=None, dtype=None, extra=None) -> Kind:
  key = (kind, shape, dtype, extra)
  k = _KINDS.get(key)
  if k is None:
    k = _KINDS[key] = Kind(kind, shape, dtype, extra)
  return k


I32 = np.dtype(np.int32)
SLOT = operator.attrgetter("slot")
_SCALAR_TYPES = {int: np.int64, float: np.float64, bool: np.bool_,
                 **{t: t for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                   np.uint32, np.uint64, np.float16, np.float32, np.float64,
                                   np.bool_)}}


_I32_RANGE = (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))


def rides_in_ids(dtype: np.dtype, values) -> bool:
  """Whether per-call scalars of ``dtype`` (not int32) can ride in a group's int32 ids array,
  cast back in the step (``("hostcast", row, dtype)``): bools, and integers whose every value
  (a list, or an array: ``fold``'s inputs) fits in int32.  Python ints are int64 under x64;
  without this they were stacked per item, one more transfer a group."""
  if dtype == np.bool_:
    return True
  if dtype.kind not in "iu" or not len(values):
    return False
  lo, hi = _I32_RANGE
  return lo <= int(np.min(values)) and int(np.max(values)) <= hi


def canonical(dt) -> np.dtype:
  return np.dtype(jax.dtypes.canonicalize_dtype(dt))


def _x64() -> bool:
  return canonical(np.int64) == np.int64  # public API (no jax.config attribute lookups)


def scalar_kinds() -> dict:
  """Python/numpy scalar type -> its host kind (canonical dtype: follows x64 mode)."""
  x64 = _x64()
  hit = _SCALAR_CACHE.get(x64)
  if hit is None:
    hit = _SCALAR_CACHE[x64] = {t: intern_kind("host", (), canonical(np.dtype(d)))
                                for t, d in _SCALAR_TYPES.items()}
  return hit


_SCALAR_CACHE: dict = {}
ARRAY_TYPES = {np.ndarray}  # + jax's concrete array type, added when first seen (_classify)
_BARE_CACHE: dict = {}


def bare_kinds() -> dict:
  """(array type, shape, dtype) -> the "obj" kind of a bare array argument (per x64 mode)."""
  return _BARE_CACHE.setdefault(_x64(), {})


# -- the graph ------------------------------------------------------------------------------
ARENA_MIN = 16


def pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def arena_cap(n: int) -> int:
  return max(ARENA_MIN, pow2(n))


TUPLE_TD = [jax.tree_util.treedef_tuple([LEAF_TD] * n) for n in range(9)]


def leaf_kind(x, where: str, scalars: dict):
  """(kind, value) of one non-result argument leaf: "dev" for jax arrays, else "host"."""
  k = scalars.get(type(x))
  if k is not None:
    return k, np.asarray(x, k.dtype)
  if isinstance(x, jax.Array):
    if is_tracer(x):
      # NeedsProgram (not a plain error): dynjax.jit catches it and reruns the function on
      # concrete values, as it does for a recursion called with tracers directly.
      raise needs_vm("recursive", f"cell {where!r} got a JAX tracer ({x.aval}): the "
                     "recursion batches its cells on the VM, on concrete values", [x])
    return intern_kind("dev", tuple(x.shape), x.dtype), x
  a = np.asarray(x)
  if a.dtype.kind not in "biufc":  # object, str, bytes, datetime: nothing JAX takes
    text = repr(x)
    text = text if len(text) <= 80 else text[:77] + "..."
    raise ControlFlowError(
        f"cell {where!r}: a cell argument must be an array, a number or a cell result; got "
        f"{type(x).__name__} {text}. Pass host structures to the recursive function, not to "
        "cells (e.g. map a word to its id before the cell call).")
  return intern_kind("host", a.shape, canonical(a.dtype)), x


def is_frozen_tuple(a, leaves, td) -> bool:
  """A plain tuple of leaves (e.g. ``(h, c)``): immutable, so safe to know by identity."""
  return type(a) is tuple and len(leaves) < len(TUPLE_TD) and td == TUPLE_TD[len(leaves)]


def avals_of(data) -> tuple:
  return tuple((tuple(d.shape), np.dtype(d.dtype)) for d in data)


def pad_rows(a: np.ndarray, bsz: int) -> np.ndarray:
  n = len(a)
  if bsz > n:
    a = np.concatenate([a, np.repeat(a[:1], bsz - n, 0)])
  return a


class Uploads:
  """Shared numpy leaves (params) put on the device once per batch, deduplicated by identity.

  Everything else a group needs from the host (its int32 index array, per-item stacks) is
  passed to its executable as numpy: jit's own transfer costs ~2 us there against ~15-20 us
  for a separate ``device_put`` (2-core CPU, jax 0.10.2).
  """

  def __init__(self):
    self.done: dict[int, tuple] = {}  # id(source) -> (source, device array)

  def __call__(self, a, dtype):
    hit = self.done.get(id(a))
    if hit is None:
      hit = self.done[id(a)] = (a, jax.device_put(np.asarray(a, dtype)))
    return hit[1]


def data_column(lk, vals, bsz, step_kinds, rows, data, upload) -> None:
  """One non-node leaf column: broadcast, a table of distinct values + indices, or per item."""
  first = vals[0]
  n = len(vals)
  n_distinct = len(set(map(id, vals)))
  if n_distinct == 1:
    step_kinds.append(("bcast",))
    data.append(upload(first, lk.dtype) if lk.kind == "host" else first)
    return
  if 2 * n_distinct <= n:  # few distinct values (e.g. params per tree): stack them once
    index: dict[int, int] = {}
    distinct: list = []
    idx = []
    for v in vals:
      i = index.get(id(v))
      if i is None:
        i = index[id(v)] = len(distinct)
        distinct.append(v)
      idx.append(i)
    m = pow2(len(distinct))
    step_kinds.append(("table", len(rows), m))
    rows.append(idx)
    vals = distinct + [first] * (m - len(distinct))
  else:  # mostly distinct (e.g. a per-node input row): stacked per item
    step_kinds.append(("item",))
    vals = vals + [first] * (bsz - n)
  if lk.kind == "host":
    a = np.stack(vals)  # numpy reads the values now: a batch sees them as they are at its flush
    data.append(a if a.dtype == lk.dtype else a.astype(lk.dtype))
  else:
    data.append(jnp.stack(vals))


_take_rows_cache: dict = {}


def take_rows(arena, slots: Sequence[int]) -> list:
  """Per-item arrays cut from an arena: one executable call per bucket of ``len(slots)``."""
  n = len(slots)
  b = pow2(n)
  fn = _take_rows_cache.get(b)
  if fn is None:
    fn = jax.jit(lambda a, idx: tuple(a[idx[i]] for i in range(b)))
    _take_rows_cache[b] = fn
  idx = np.zeros(b, np.int32)
  idx[:n] = slots
  return list(fn(arena, idx)[:n])


