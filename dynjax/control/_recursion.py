"""``dynjax.cell`` and ``dynjax.recursive``: recursion over host structures, batched by level.

How a batch runs (``rec.batch([args, ...])``; ``rec(*args)`` is a batch of one):

1. **Record.** The user's Python function runs on the host over the structure (a tree, a list
   of children).  Calls of a :class:`Cell` do not compute: they add a node to a dataflow graph
   and return :class:`CellValue` placeholders (one per output leaf, shape and dtype known from
   ``jax.eval_shape`` of the cell, cached per argument signature).  Recording costs ~1 us of
   host time per cell call on top of the user's own Python (see :meth:`_Graph.add`).
2. **Schedule.** A node's level is 1 + the deepest level of the nodes it reads.  Nodes of one
   level, one cell and one argument signature form a *group*: they run as ONE call of
   ``vmap(cell)`` on a batch padded to a bucket (powers of two; dummy items repeat item 0 and
   their results are dropped).  Every output leaf lives in an *arena*: one device buffer per
   (shape, dtype), ``(capacity, *shape)``, capacity a power of two.
3. **Build and run.** The schedule becomes a straight-line :class:`~dynjax.runtime.Program`:
   ``alloc_tensor`` per arena, then per group ``const`` (the packed int32 slot indices, host
   inputs; all of a batch's host arrays go to the device in one ``device_put``) and one
   ``invoke`` of the group's step executable, which gathers the inputs from the arenas, runs
   the vmapped cell and scatters the results back (arenas donated, so updated in place).
   Executables are cached per (cell, batch bucket, argument kinds, arena capacities).  The VM
   runs it without a single host sync; the results are cut out by one ``invoke`` per arena.

Arguments that are not cell results (parameters, per-node inputs):

* Python scalars are per-call values (int32 ones ride in the index array: one transfer).
* Any other object (a jax or numpy array, a dict/list/tuple/dataclass pytree of them) is
  recognised **by identity**: the first call that passes it flattens it once; every later call
  of the batch passing the same object costs one dict lookup.  When every call of a group
  passes the same object it is *broadcast* (one executable argument per leaf, never stacked);
  numpy leaves are put on the device once per batch.  Different objects are stacked once per
  distinct object (a table gathered by index inside the executable) or per call.
* The contract that makes identity safe: an argument is read when the batch first sees it
  (containers) or when the batch runs (numpy contents).  Mutating a params dict or array
  *between* batches is fine (nothing is cached across batches); mutating a container *while*
  one batch records is detected at the flush (its leaves are compared by identity) and raises.

What placeholders cost: passing them to cells, returning them, keeping them in tuples/lists/
dicts, and reading ``.shape``/``.dtype``/``.ndim`` are free.  Anything else -- indexing,
arithmetic, ``bool()``, ``np.asarray``, passing them to ``jnp`` functions -- *materialises*
the value: the graph recorded so far runs at once (one batched run), the value is cut out
(one small executable call), and the recording continues; later cells that read such a
materialised value get it as a per-item device array, stacked per group (one extra device op).
So keep non-cell work on cell results inside cells.

For structures held in arrays (child-index arrays of many trees), :func:`dynjax.control.fold`
builds the same schedule with numpy, without running Python per node.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import operator
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynjax._errors import ControlFlowError, format_list
from dynjax._jax_private import lowering_config
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.control._frontend import any_tracer, building, is_tracer, needs_vm
from dynjax.runtime import VM, Kernel, ProgramBuilder, VMStats
from dynjax.runtime._vm import record as _record_stats


class _Local(threading.local):
  graph = None  # the _Graph recording on this thread (class default: every thread sees None)


_local = _Local()


def _current_graph() -> _Graph | None:
  return _local.graph


class CellValue:
  """A placeholder for one output leaf of a recorded cell call (see the module docstring).

  Example:
    >>> @dynjax.cell
    ... def double(x):
    ...   return 2 * x
    >>> rec = dynjax.recursive(lambda x: double(x))
    >>> rec(jnp.ones(3))
    Array([2., 2., 2.], dtype=float32)
  """

  __slots__ = ("batch", "sig", "level", "slot", "cell", "index", "_val")
  __array_priority__ = 100

  def __init__(self, batch, sig, level, slot, cell, index):
    self.batch = batch  # the _Batch that records (then holds) it
    self.sig = sig  # the interned "node" _Kind of (shape, dtype): also names its arena
    self.level = level
    self.slot = slot  # row in that arena
    self.cell = cell
    self.index = index  # which output leaf of the call
    self._val = None

  @property
  def shape(self) -> tuple[int, ...]:
    return self.sig.shape

  @property
  def dtype(self) -> np.dtype:
    return self.sig.dtype

  @property
  def ndim(self) -> int:
    return len(self.sig.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.sig.shape, dtype=np.int64))

  def materialize(self) -> jax.Array:
    """The concrete value (runs the pending graph first if needed; see module docstring)."""
    if self._val is None:
      b = self.batch
      if b.arenas is None:
        b.graph.flush()
      self._val = _take_rows(b.arenas[b.arena_ix[self.sig]], [self.slot])[0]
    return self._val

  def __jax_array__(self):
    return self.materialize()

  def __array__(self, dtype=None, copy=None):
    a = np.asarray(self.materialize())
    return a if dtype is None else a.astype(dtype)

  def __bool__(self):
    return bool(self.materialize())

  def __int__(self):
    return int(self.materialize())

  def __float__(self):
    return float(self.materialize())

  def __len__(self):
    if not self.shape:
      raise TypeError("len() of a 0-d cell result")
    return self.shape[0]

  def __repr__(self) -> str:
    state = "pending" if self.batch.arenas is None else "done"
    return (f"CellValue({self.cell.name}#{self.slot}[{self.index}], "
            f"{jnp.dtype(self.dtype).name}{list(self.shape)}, {state})")


def _forcing(name):
  def op(self, *args):
    args = [a.materialize() if isinstance(a, CellValue) else a for a in args]
    return getattr(self.materialize(), name)(*args)
  op.__name__ = name
  return op


for _name in ("__getitem__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
              "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__mod__", "__pow__",
              "__matmul__", "__rmatmul__", "__neg__", "__abs__", "__lt__", "__le__", "__gt__",
              "__ge__", "__and__", "__or__", "__invert__", "astype", "sum", "mean", "max",
              "min", "reshape", "argmax", "tolist", "item"):
  setattr(CellValue, _name, _forcing(_name))
CellValue.__eq__ = _forcing("__eq__")  # type: ignore[method-assign]
CellValue.__ne__ = _forcing("__ne__")  # type: ignore[method-assign]
CellValue.__hash__ = object.__hash__  # type: ignore[method-assign]


# -- argument kinds -------------------------------------------------------------------------
_LEAF_TD = jax.tree_util.tree_structure(0)


class _Kind:
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
      self.td, self.leaves = _LEAF_TD, (self,)
    else:
      self.td, self.leaves = extra
    self.flat = tuple((k.kind, k.shape, k.dtype) for k in self.leaves)

  def __repr__(self) -> str:
    if self.extra is None:
      return f"{self.kind}:{jnp.dtype(self.dtype).name}{list(self.shape)}"
    return f"{self.kind}{list(self.leaves)}"


_KINDS: dict = {}


def _kind(kind, shape=None, dtype=None, extra=None) -> _Kind:
  key = (kind, shape, dtype, extra)
  k = _KINDS.get(key)
  if k is None:
    k = _KINDS[key] = _Kind(kind, shape, dtype, extra)
  return k


_I32 = np.dtype(np.int32)
_SLOT = operator.attrgetter("slot")
_SCALAR_TYPES = {int: np.int64, float: np.float64, bool: np.bool_,
                 **{t: t for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                   np.uint32, np.uint64, np.float16, np.float32, np.float64,
                                   np.bool_)}}


def _canonical(dt) -> np.dtype:
  return np.dtype(jax.dtypes.canonicalize_dtype(dt))


def _x64() -> bool:
  return _canonical(np.int64) == np.int64  # public API (no jax.config attribute lookups)


def _scalar_kinds() -> dict:
  """Python/numpy scalar type -> its host kind (canonical dtype: follows x64 mode)."""
  x64 = _x64()
  hit = _SCALAR_CACHE.get(x64)
  if hit is None:
    hit = _SCALAR_CACHE[x64] = {t: _kind("host", (), _canonical(np.dtype(d)))
                                for t, d in _SCALAR_TYPES.items()}
  return hit


_SCALAR_CACHE: dict = {}
_ARRAY_TYPES = {np.ndarray}  # + jax's concrete array type, added when first seen (_classify)
_BARE_CACHE: dict = {}


def _bare_kinds() -> dict:
  """(array type, shape, dtype) -> the "obj" kind of a bare array argument (per x64 mode)."""
  return _BARE_CACHE.setdefault(_x64(), {})


# -- cells ---------------------------------------------------------------------------------
class Cell:
  """A pure per-item JAX function whose calls the VM batches (see :func:`cell`)."""

  def __init__(self, fn: Callable, name: str | None = None,
               batch_buckets: BucketPolicy | Sequence[int] | None = None):
    self.fn = fn
    self.name = name or getattr(fn, "__name__", "cell")
    self.batch_policy = (pow2(min=8) if batch_buckets is None
                         else as_policy(batch_buckets, f"[cell {self.name}]"))
    self._jit = jax.jit(fn)
    self._sig_cache: dict = {}
    self.kernel = Kernel(f"{self.name}.step", self._build_step, _describe_step)
    functools.update_wrapper(self, fn)

  def __call__(self, *args):
    graph = _local.graph
    if graph is None:
      leaves = jax.tree_util.tree_leaves(args)
      if any_tracer(leaves):
        return self.fn(*args)  # under a trace a cell is just its function
      if any(isinstance(x, CellValue) for x in leaves):
        args = jax.tree_util.tree_map(
            lambda x: x.materialize() if isinstance(x, CellValue) else x, args)
      return self._jit(*args)
    return graph.add(self, args)

  # -- signature checks (once per argument signature) --------------------------------------
  def _check_closure(self) -> None:
    fn = self.fn
    cells = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    bad = []
    for name, c in zip(names, cells, strict=False):
      try:
        v = c.cell_contents
      except ValueError:
        continue
      if any(is_tracer(x) for x in jax.tree_util.tree_leaves(v)):
        bad.append(name)
    if bad:
      raise ControlFlowError(
          f"cell {self.name!r} closes over JAX tracer(s) {bad}: a cell must be a pure function "
          "of its arguments, but it captured values of an enclosing jax.jit/grad/vmap trace. "
          "Pass them as cell arguments instead.")

  def _signature(self, treedef, sigs):
    key = (treedef, sigs)
    hit = self._sig_cache.get(key)
    if hit is not None:
      return hit
    self._check_closure()
    avals = [jax.ShapeDtypeStruct(s[1], s[2]) for s in sigs]
    name = self.name
    bad: list[str] = []

    def flat(*leaves):
      out = self.fn(*jax.tree_util.tree_unflatten(treedef, leaves))
      for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not (is_tracer(leaf) or isinstance(leaf, jax.Array | np.ndarray | int | float
                                                   | bool | np.generic)):
          bad.append(f"output{jax.tree_util.keystr(path)}: {type(leaf).__name__} {leaf!r}")
      return out

    try:
      with building(f"cell {name!r}"):
        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*avals)
    except ControlFlowError:
      raise
    except TypeError as e:
      if bad:
        raise ControlFlowError(
            f"cell {name!r} must return a pytree of arrays; got non-array leaves:\n"
            + format_list(bad) + "\nReturn only arrays (keep host values outside cells)."
        ) from None
      raise ControlFlowError(f"cell {name!r} could not be traced on {avals}: {e}") from e
    if bad:
      raise ControlFlowError(
          f"cell {name!r} must return a pytree of arrays; got non-array leaves:\n"
          + format_list(bad) + "\nReturn only arrays (keep host values outside cells).")
    if closed.effects:
      raise ControlFlowError(
          f"cell {name!r} has side effects ({sorted(str(e) for e in closed.effects)}): cells "
          "are batched and reordered, so they must be pure. Remove jax.debug.print/"
          "callbacks/io_callback from the cell, or move them outside it.")
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    hit = (out_tree, tuple((tuple(o.shape), jnp.dtype(o.dtype),
                            ("node", tuple(o.shape), jnp.dtype(o.dtype))) for o in out_leaves))
    self._sig_cache[key] = hit
    return hit

  # -- the batched step executable ---------------------------------------------------------
  def _build_step(self, key):
    """The compiled step of one group shape (AOT: ``key`` fixes every argument's shape).

    Compiled ahead of time rather than by the first call, so :meth:`Recursive.warmup` can
    compile a whole family of batch buckets concurrently without running them; calling a
    ``Compiled`` costs the same as a jitted call (~8 vs ~10 us on the 2-core CPU box).
    """
    (batch, treedef, kinds, arena_sigs, out_arenas, data_avals, config) = key
    # kinds: per flat arg leaf: ("node", arena_pos, ids_row) / ("hostid", ids_row) (int32
    # scalars ride in the ids array: one transfer per group) / ("item",) (stacked per item) /
    # ("bcast",) (one value for all) / ("table", ids_row) (distinct values, gathered by the
    # row's indices); out_arenas: per output leaf (arena_pos, ids_row).
    fn = self.fn
    n_arenas = len(arena_sigs)

    # Every node input of one arena is read by ONE gather, and every output of one arena
    # written by ONE scatter (fewer thunks / kernels per step: the arity Tree-LSTM's `two`
    # went from 4 gathers + 2 scatters to 1 + 1).
    reads: dict[int, list[int]] = defaultdict(list)  # arena pos -> ids rows, in leaf order
    for k in kinds:
      if k[0] == "node":
        reads[k[1]].append(k[2])
    writes: dict[int, list[int]] = defaultdict(list)
    for pos, row in out_arenas:
      writes[pos].append(row)

    def rows_of(ids, rows):
      r0 = rows[0]
      if rows == list(range(r0, r0 + len(rows))):
        return ids[r0:r0 + len(rows)]
      return ids[np.asarray(rows)]

    def step(*args):
      arenas, ids, data = list(args[:n_arenas]), args[n_arenas], args[n_arenas + 1:]
      got = {pos: (arenas[pos][rows_of(ids, rows)], rows) for pos, rows in reads.items()}
      leaves, axes, di = [], [], 0
      for k in kinds:
        tag = k[0]
        if tag == "node":
          vals, rows = got[k[1]]
          leaves.append(vals[rows.index(k[2])])
          axes.append(0)
        elif tag == "hostid":
          leaves.append(ids[k[1]])
          axes.append(0)
        elif tag == "table":
          leaves.append(data[di][ids[k[1]]])  # k = ("table", ids_row, table size)
          axes.append(0)
          di += 1
        else:
          leaves.append(data[di])
          axes.append(None if tag == "bcast" else 0)
          di += 1

      def per_item(*xs):
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(treedef, xs)))

      outs = jax.vmap(per_item, in_axes=tuple(axes))(*leaves)
      by_pos: dict[int, list] = defaultdict(list)
      for (pos, _), out in zip(out_arenas, outs, strict=True):
        by_pos[pos].append(out.astype(arenas[pos].dtype))
      for pos, vals in by_pos.items():
        idx = rows_of(ids, writes[pos]).reshape(-1)
        arenas[pos] = arenas[pos].at[idx].set(jnp.concatenate(vals), mode="drop")
      return tuple(arenas)

    avals = _step_avals(key)
    # The key's jax config (matmul precision, ...) is the caller's; warm-up compiles in worker
    # threads, where thread-local contexts such as default_matmul_precision do not reach.
    prec = ast.literal_eval(dict(config).get("jax_default_matmul_precision", "None"))
    with jax.default_matmul_precision(prec) if prec is not None else contextlib.nullcontext():
      return jax.jit(step, donate_argnums=tuple(range(n_arenas))).lower(*avals).compile()

  def __repr__(self) -> str:
    return f"dynjax.cell({self.name})"


def _step_avals(key) -> list:
  """Every argument's aval of a step executable: arenas, the ids array, data."""
  batch, _, kinds, arena_sigs, out_arenas, data_avals, _ = key
  n_rows = 1 + max([k[-1] for k in kinds if k[0] in ("node", "hostid")]
                   + [k[1] for k in kinds if k[0] == "table"] + [r for _, r in out_arenas])
  avals = [jax.ShapeDtypeStruct((cap, *shape), dtype) for (shape, dtype), cap in arena_sigs]
  avals.append(jax.ShapeDtypeStruct((n_rows, batch), np.int32))
  avals.extend(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in data_avals)
  return avals


def _avals(data) -> tuple:
  return tuple((tuple(d.shape), np.dtype(d.dtype)) for d in data)


def _describe_step(key) -> str:
  bsz, _, kinds, arenas, _, _, _ = key
  args = ",".join(k[0] if k[0] != "node" else f"arena{k[1]}" for k in kinds)
  return f"B={bsz}; {args}; caps={[c for _, c in arenas]}"


def cell(fn: Callable | None = None, *, name: str | None = None,
         batch_buckets: BucketPolicy | Sequence[int] | None = None):
  """Marks a per-item JAX function whose calls inside :func:`recursive` are batched.

  Arguments and results are *unbatched* (one item).  Inside a recursion, calling the cell
  records it and returns placeholders (:class:`CellValue`); all calls of a cell at one
  dependency level run as one ``vmap`` call on a bucketed batch.  Outside, it is ``jax.jit``.
  Cells must be pure: no side effects (rejected when JAX sees them: debug prints, callbacks),
  no captured tracers, array results only.

  Args:
    fn: ``fn(*args) -> pytree of arrays`` on one item.
    name: shown in programs and errors (default: ``fn.__name__``).
    batch_buckets: policy for padded batch sizes (default ``dynjax.buckets.pow2(min=8)``).

  Example:
    >>> @dynjax.cell
    ... def combine(a, b):
    ...   return jnp.tanh(a + b)
    >>> @dynjax.recursive
    ... def tree_sum(node):
    ...   if isinstance(node, float):
    ...     return jnp.full((2,), node)
    ...   return combine(tree_sum(node[0]), tree_sum(node[1]))
    >>> tree_sum((0.5, (0.1, 0.2))).shape
    (2,)
  """
  if fn is None:
    return lambda f: Cell(f, name=name, batch_buckets=batch_buckets)
  return Cell(fn, name=name, batch_buckets=batch_buckets)


# -- the graph ------------------------------------------------------------------------------
_ARENA_MIN = 16


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _cap(n: int) -> int:
  return max(_ARENA_MIN, _pow2(n))


_TUPLE_TD = [jax.tree_util.treedef_tuple([_LEAF_TD] * n) for n in range(9)]


class _Entry:
  """What a batch knows about one non-scalar argument object, found by ``id`` (see ``add``).

  ``obj`` is the object the calls' columns hold (the argument itself, or this entry when the
  argument is a mutable container of pending results: then the entry is its snapshot);
  ``vals`` the flat leaves (cell results, numpy arrays, device arrays); ``raw`` the leaves as
  first seen, for the mutation check of containers cached by identity.
  """

  __slots__ = ("kind", "obj", "vals", "level", "raw", "where")

  def __init__(self, kind, obj, vals, level, raw, where):
    self.kind, self.obj, self.vals, self.level, self.raw, self.where = (
        kind, obj, vals, level, raw, where)


class _Group:
  """The calls of one (cell, argument kinds, level): one batched invoke.

  ``calls`` holds each call's argument tuple as passed (kept as is: the flush reads columns
  with ``zip(*calls)``).  Output slots: when every output leaf lives in one arena (the usual
  case, e.g. ``(h, c)``), a call takes consecutive rows and ``base`` keeps the first one per
  call; otherwise ``outs[i]`` keeps output ``i``'s slot per call.
  """

  __slots__ = ("level", "cell", "kinds", "treedef", "calls", "out_info", "out_tree", "mode",
               "arena", "sigs", "base", "outs")

  def __init__(self, key, cell, level, graph):
    self.level, self.cell, self.kinds = level, cell, key[1:-1]
    self.treedef = graph.treedef_of(self.kinds)
    flat = tuple(s for k in self.kinds for s in k.flat)
    out_tree, out_sigs = cell._signature(self.treedef, flat)
    self.out_tree = out_tree
    self.sigs = tuple(_kind("node", shape, dtype) for shape, dtype, _ in out_sigs)
    self.out_info = [(graph.arena_of(sig), sig) for sig in self.sigs]
    arenas = {a for a, _ in self.out_info}
    self.arena = self.out_info[0][0] if len(arenas) == 1 else None
    self.calls: list = []
    self.base: list[int] = []
    self.outs: list[list[int]] = [[] for _ in out_sigs]
    n_out = len(out_sigs)
    if self.arena is None or n_out > 2:
      self.mode = 0  # generic (see _Graph._outputs)
    elif out_tree == _LEAF_TD:
      self.mode = 1
    elif n_out == 2 and out_tree == _TUPLE_TD[2]:
      self.mode = 2
    else:
      self.mode = 0

  def out_rows(self) -> list:
    """Per output leaf, the arena slot of every call."""
    if self.arena is None:
      return self.outs
    base = np.asarray(self.base, np.int32)
    return [base + i for i in range(len(self.out_info))]


class _Batch:
  """One flush worth of recorded calls; ``arenas`` is set once it ran."""

  __slots__ = ("graph", "groups", "arena_sigs", "arena_ix", "counts", "arenas")

  def __init__(self, graph):
    self.graph = graph
    self.groups: dict = {}
    self.arena_sigs: list = []
    self.arena_ix: dict = {}
    self.counts: list[int] = []
    self.arenas = None


def _leaf_kind(x, where: str, scalars: dict):
  """(kind, value) of one non-result argument leaf: "dev" for jax arrays, else "host"."""
  k = scalars.get(type(x))
  if k is not None:
    return k, np.asarray(x, k.dtype)
  if isinstance(x, jax.Array):
    if is_tracer(x):
      raise ControlFlowError(
          f"cell {where!r} got a JAX tracer ({x.aval}) inside dynjax.recursive: the "
          "recursion runs on concrete values. Call the recursive function outside "
          "jax.jit/grad/vmap (or inside dynjax.jit).")
    return _kind("dev", tuple(x.shape), x.dtype), x
  a = np.asarray(x)
  if a.dtype == object:
    raise ControlFlowError(
        f"a cell argument must be an array, a number or a cell result; got "
        f"{type(x).__name__} {x!r}. Pass host structures to the recursive function, not to "
        "cells.")
  return _kind("host", a.shape, _canonical(a.dtype)), x


def _is_frozen_tuple(a, leaves, td) -> bool:
  """A plain tuple of leaves (e.g. ``(h, c)``): immutable, so safe to know by identity."""
  return type(a) is tuple and len(leaves) < len(_TUPLE_TD) and td == _TUPLE_TD[len(leaves)]


class _Graph:
  """The dataflow graph of one ``batch`` call: recorded calls, run by :meth:`flush`.

  Recording is the hot path (one :meth:`add` per cell call of the user's recursion); the
  flush turns each group's columns into int32 index arrays, host stacks and broadcasts.
  """

  def __init__(self, name: str, caps: dict | None = None):
    self.name = name
    self.caps = {} if caps is None else caps  # sticky arena capacities, per signature
    self.headroom = 1.0  # warmup(): arenas sized for this many times the batch's results
    self.cur = _Batch(self)
    self.stats = VMStats()
    self.programs: list = []
    self.seen: dict[int, _Entry] = {}  # id(arg object) -> entry; holds the object alive
    self.scalars = _scalar_kinds()
    self.bare = _bare_kinds()
    self._tds: dict = {}

  @property
  def pending(self) -> bool:
    return bool(self.cur.groups)

  def arena_of(self, sig) -> int:
    b = self.cur
    a = b.arena_ix.get(sig)
    if a is None:
      a = b.arena_ix[sig] = len(b.arena_sigs)
      b.arena_sigs.append(sig)
      b.counts.append(0)
    return a

  def treedef_of(self, kinds):
    td = self._tds.get(kinds)
    if td is None:
      td = self._tds[kinds] = jax.tree_util.treedef_tuple([k.td for k in kinds])
    return td

  # -- recording ---------------------------------------------------------------------------
  def add(self, cell: Cell, args: tuple) -> Any:
    """Records one cell call; returns its placeholders.

    Hot path, measured on the 2-core CPU box (python 3.11, the arity Tree-LSTM of
    ``dynjax.bench._treelstm``, up to 6 arguments): ~0.8-1 us per call, of ~1.7-1.9 us per
    node recorded in all (the user's own recursion is ~0.4-0.5 us of it).  Per argument: one
    type test for a pending result or a Python/numpy scalar, else one ``dict`` lookup by
    ``id`` (params, objects seen before in this batch), else a kind by (type, shape, dtype)
    for a bare array; the group key is the tuple (cell, interned kinds..., level); the call's
    argument tuple is appended as it is (no per-column work until the flush).
    """
    cur = self.cur
    seen = self.seen
    scalars = self.scalars
    bare = self.bare
    level = 0
    key = [cell]
    for a in args:
      t = type(a)
      if t is CellValue and a.batch is cur:
        key.append(a.sig)
        if a.level > level:
          level = a.level
        continue
      k = scalars.get(t)
      if k is not None:
        key.append(k)
        continue
      e = seen.get(id(a))
      if e is None:
        if t in _ARRAY_TYPES:  # a bare array (e.g. a per-node input row): known by its kind
          k = bare.get((t, a.shape, a.dtype))
          key.append(k if k is not None else self._bare_kind(a, t, cell))
          continue
        e = self._classify(a, cell)
        if e.obj is not a:  # a mutable container of pending results: record its snapshot
          return self.add(cell, tuple(self._frozen(x, cell) for x in args))
      key.append(e.kind)
      if e.level > level:
        level = e.level
    level += 1
    key.append(level)
    key = tuple(key)
    g = cur.groups.get(key)
    if g is None:
      g = cur.groups[key] = _Group(key, cell, level, self)
    g.calls.append(args)
    mode = g.mode
    if mode == 2:  # a pair in one arena, e.g. (h, c)
      counts = cur.counts
      ar = g.arena
      s = counts[ar]
      counts[ar] = s + 2
      g.base.append(s)
      sig0, sig1 = g.sigs
      return (CellValue(cur, sig0, level, s, cell, 0),
              CellValue(cur, sig1, level, s + 1, cell, 1))
    if mode == 1:
      counts = cur.counts
      ar = g.arena
      s = counts[ar]
      counts[ar] = s + 1
      g.base.append(s)
      return CellValue(cur, g.sigs[0], level, s, cell, 0)
    return self._outputs(g, cur, level)

  def _outputs(self, g: _Group, cur: _Batch, level: int):
    """Placeholders of a call whose outputs are not one leaf or a pair in one arena."""
    counts = cur.counts
    res = []
    if g.arena is not None:
      ar = g.arena
      s = counts[ar]
      counts[ar] = s + len(g.sigs)
      g.base.append(s)
      for i, sig in enumerate(g.sigs):
        res.append(CellValue(cur, sig, level, s + i, g.cell, i))
    else:
      for i, ((ar, sig), slots) in enumerate(zip(g.out_info, g.outs, strict=True)):
        s = counts[ar]
        counts[ar] = s + 1
        slots.append(s)
        res.append(CellValue(cur, sig, level, s, g.cell, i))
    if len(res) < len(_TUPLE_TD) and g.out_tree == _TUPLE_TD[len(res)]:
      return tuple(res)
    return jax.tree_util.tree_unflatten(g.out_tree, res)

  def _bare_kind(self, a, t, cell: Cell) -> _Kind:
    lk, _ = _leaf_kind(a, cell.name, self.scalars)
    k = self.bare[(t, a.shape, a.dtype)] = _kind("obj", extra=(_LEAF_TD, (lk,)))
    return k

  def _frozen(self, a, cell):
    """The object a call's column holds for argument ``a`` (see :meth:`_classify`)."""
    t = type(a)
    if (t is CellValue and a.batch is self.cur) or t in self.scalars:
      return a
    e = self.seen.get(id(a))
    if e is None:
      e = self._classify(a, cell)
    return e.obj

  def _classify(self, a, cell: Cell) -> _Entry:
    """Flattens an argument seen for the first time in this batch and registers it by id."""
    cur = self.cur
    if type(a) is CellValue:  # a result of an earlier flush (materialised by the user)
      leaves, td = [a], _LEAF_TD
    else:
      leaves, td = jax.tree_util.tree_flatten(a)
    kinds, vals, level, nodes = [], [], 0, False
    for x in leaves:
      if type(x) is CellValue:
        if x.batch is cur:
          kinds.append(x.sig)
          vals.append(x)
          if x.level > level:
            level = x.level
          nodes = True
          continue
        x = x.materialize()
      k, v = self._leaf_kind(x, cell)
      kinds.append(k)
      vals.append(v)
    if td == _LEAF_TD and isinstance(a, jax.Array) and not is_tracer(a):
      _ARRAY_TYPES.add(type(a))  # later bare jax arrays take the fast path of add()
    kind = _kind("mixed" if nodes else "obj", extra=(td, tuple(kinds)))
    raw = None if td == _LEAF_TD else leaves
    e = _Entry(kind, a, vals, level, raw, cell.name)
    if nodes and not _is_frozen_tuple(a, leaves, td):
      e.obj, e.raw = e, None  # a list/dict of pending results: the entry is the snapshot
    self.seen[id(e.obj)] = e
    return e

  def _leaf_kind(self, x, cell: Cell):
    return _leaf_kind(x, cell.name, self.scalars)

  # -- running -------------------------------------------------------------------------------
  def flush(self) -> None:
    """Runs every pending call: one Program (levels in order), run on the VM."""
    b = self.cur
    seen = self.seen
    self.cur = _Batch(self)
    self.seen = {}  # arguments are known by identity within one batch only
    if not b.groups:
      b.arenas = []
      return
    _check_unchanged(seen, self.name)
    prog = self._build(b, seen)
    vm = VM(prog)
    arenas = vm.run()
    st = vm.take_stats()
    st.batches.append(dict(prog.meta))
    self.stats.add(st)
    self.programs.append(prog)
    b.arenas = list(arenas)

  def _build(self, b: _Batch, seen: dict):
    # Capacities only grow (per recursive function), so executables compiled for one batch
    # serve the next ones: compiles stop once the largest batch has been seen.
    caps = []
    for sig, c in zip(b.arena_sigs, b.counts, strict=True):
      key = (sig.shape, sig.dtype)
      cap = max(self.caps.get(key, 0), _cap(int(c * self.headroom)))
      self.caps[key] = cap
      caps.append(cap)
    groups = sorted(b.groups.values(), key=lambda g: g.level)
    arena_ix = b.arena_ix
    bucket_hist: dict[int, int] = defaultdict(int)
    upload = _Uploads()
    config = lowering_config()  # part of every key: precision etc. change the executable
    plans = []
    seen_avals: dict[int, tuple] = {}  # the shared leaves recur in every group: once each

    def avals_of(data):
      out = []
      for d in data:
        a = seen_avals.get(id(d))
        if a is None:
          a = seen_avals[id(d)] = (tuple(d.shape), np.dtype(d.dtype))
        out.append(a)
      return tuple(out)

    nodes = 0
    for g in groups:
      cell = g.cell
      n = len(g.calls)
      nodes += n
      bsz = cell.batch_policy.bucket(n)
      bsz = cell.batch_policy.grow(n) if bsz is None else bsz
      bucket_hist[bsz] += 1
      involved: list[int] = []

      def pos(a, involved=involved):
        if a not in involved:
          involved.append(a)
        return involved.index(a)

      step_kinds: list[tuple] = []
      rows: list[list] = []
      data: list = []
      cols = list(zip(*g.calls, strict=True)) if g.kinds else []
      for kind, col in zip(g.kinds, cols, strict=True):
        kk = kind.kind
        if kk == "node":
          step_kinds.append(("node", pos(arena_ix[kind]), len(rows)))
          rows.append(list(map(_SLOT, col)))
        elif kk == "host":  # Python scalars, one per call
          if kind.dtype == _I32:
            step_kinds.append(("hostid", len(rows)))
            rows.append(list(col))
          else:
            step_kinds.append(("item",))
            data.append(_pad(np.asarray(col, kind.dtype), bsz))
        elif kk == "obj" and kind.td == _LEAF_TD:  # one array per call (or one for all)
          vals = [_leaf_value(seen, x) for x in col]
          _data_column(kind.leaves[0], vals, bsz, step_kinds, rows, data, upload)
        elif kk == "obj" and len(set(map(id, col))) == 1:
          # The shared-argument path (params): one object for every call, broadcast.
          for lk, v in zip(kind.leaves, seen[id(col[0])].vals, strict=True):
            step_kinds.append(("bcast",))
            data.append(v if lk.kind == "dev" else upload(v, lk.dtype))
        else:  # distinct containers per call, or containers of pending results
          ents = [seen[id(x)] for x in col]
          for j, lk in enumerate(kind.leaves):
            vals = [e.vals[j] for e in ents]
            if lk.kind == "node":
              step_kinds.append(("node", pos(arena_ix[lk]), len(rows)))
              rows.append(list(map(_SLOT, vals)))
            else:
              _data_column(lk, vals, bsz, step_kinds, rows, data, upload)
      n_in = len(rows)
      out_pos = []
      for (ar, _), slots in zip(g.out_info, g.out_rows(), strict=True):
        out_pos.append((pos(ar), len(rows)))
        rows.append(slots)
      ids = np.empty((len(rows), bsz), np.int32)
      for r, row in enumerate(rows):
        ids[r, :n] = row
        # dummy items repeat item 0's inputs; their outputs go past the arena (dropped)
        ids[r, n:] = row[0] if r < n_in else caps[g.out_info[r - n_in][0]]
      key = (bsz, g.treedef, tuple(step_kinds),
             tuple(((b.arena_sigs[a].shape, b.arena_sigs[a].dtype), caps[a])
                   for a in involved), tuple(out_pos), avals_of(data), config)
      plans.append((cell, key, ids, data, involved))
    pb = ProgramBuilder(f"{self.name}.batch", num_args=0)
    arena_regs = [pb.emit_alloc_tensor((caps[i], *sig.shape), sig.dtype)
                  for i, sig in enumerate(b.arena_sigs)]
    const_regs: dict[int, int] = {}  # one register per shared value (params), not per group

    def const(v):
      r = const_regs.get(id(v))
      if r is None:
        r = const_regs[id(v)] = pb.emit_const(v)
      return r

    for cell, key, ids, data, involved in plans:
      ids_reg = pb.emit_const(ids)
      data_regs = [const(d) for d in data]
      inv = [arena_regs[a] for a in involved]
      pb.emit_invoke_into(cell.kernel, key, [*inv, ids_reg, *data_regs], inv)
    pb.emit_ret(arena_regs)
    pb.meta.update(nodes=nodes, levels=groups[-1].level, groups=len(groups),
                   batch_buckets=dict(bucket_hist), uploads=len(upload.done), arenas=[
                       (sig.shape, str(sig.dtype), caps[i])
                       for i, sig in enumerate(b.arena_sigs)])
    return pb.finish()


def _pad(a: np.ndarray, bsz: int) -> np.ndarray:
  n = len(a)
  if bsz > n:
    a = np.concatenate([a, np.repeat(a[:1], bsz - n, 0)])
  return a


class _Uploads:
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


def _leaf_value(seen: dict, x):
  e = seen.get(id(x))  # bare numpy/jax arrays have no entry (see _Graph.add)
  return x if e is None else e.vals[0]


def _data_column(lk, vals, bsz, step_kinds, rows, data, upload) -> None:
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
    m = _pow2(len(distinct))
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


def _check_unchanged(seen: dict, name: str) -> None:
  """Containers known by identity must not change while one batch records (see module doc)."""
  bad = []
  for e in seen.values():
    if e.raw is None:
      continue
    leaves, td = jax.tree_util.tree_flatten(e.obj)
    if td != e.kind.td or len(leaves) != len(e.raw) or any(
        x is not y for x, y in zip(leaves, e.raw, strict=True)):
      bad.append(f"{type(e.obj).__name__} passed to cell {e.where!r}: structure or leaves "
                 "changed after its first use")
  if bad:
    raise ControlFlowError(
        f"{name}: argument object(s) were modified while the batch was recording:\n"
        + format_list(bad) + "\ndynjax reads a container passed to cells once per batch (it "
        "is known by identity, so later calls cost one lookup). Pass a new object for new "
        "values, or modify it only between batches.")


_take_rows_cache: dict = {}


def _take_rows(arena, slots: Sequence[int]) -> list:
  """Per-item arrays cut from an arena: one executable call per bucket of ``len(slots)``."""
  n = len(slots)
  b = _pow2(n)
  fn = _take_rows_cache.get(b)
  if fn is None:
    fn = jax.jit(lambda a, idx: tuple(a[idx[i]] for i in range(b)))
    _take_rows_cache[b] = fn
  idx = np.zeros(b, np.int32)
  idx[:n] = slots
  return list(fn(arena, idx)[:n])


def _extract(outs: list) -> list:
  """Replaces every CellValue in ``outs`` by its array: one executable call per arena."""
  leaves, treedef = jax.tree_util.tree_flatten(outs, is_leaf=lambda x: isinstance(x, CellValue))
  want: dict[tuple, list[tuple[int, CellValue]]] = defaultdict(list)
  for i, x in enumerate(leaves):
    if isinstance(x, CellValue):
      if x._val is not None:
        leaves[i] = x._val
        continue
      if x.batch.arenas is None:
        raise AssertionError("extract before flush")
      want[(id(x.batch), x.sig)].append((i, x))
  for items in want.values():
    x0 = items[0][1]
    b = x0.batch
    rows = _take_rows(b.arenas[b.arena_ix[x0.sig]], [x.slot for _, x in items])
    for (i, x), r in zip(items, rows, strict=True):
      leaves[i] = x._val = r
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _with_batch(key, b: int):
  """A step key at another batch bucket: per-item data avals take the new leading size."""
  bsz, td, kinds, arenas, out_pos, avals, config = key
  new, di = [], 0
  for k in kinds:
    if k[0] in ("bcast", "item", "table"):
      shape, dtype = avals[di]
      new.append(((b, *shape[1:]), dtype) if k[0] == "item" else (shape, dtype))
      di += 1
  return (b, td, kinds, arenas, out_pos, tuple(new), config)


def _warm_siblings(programs, spread=(4, 2), workers: int | None = None) -> dict:
  """Compiles the batch-bucket siblings of every step the programs invoked (see warmup)."""
  import concurrent.futures
  import os

  from dynjax.runtime._program import Op

  fams: dict = {}
  for prog in programs:
    for blk in prog.blocks:
      for ins in blk.instrs:
        if ins.op is not Op.INVOKE:
          continue
        cell = getattr(ins.kernel.build, "__self__", None)  # a cell's kernel builds its steps
        if not isinstance(cell, Cell):
          continue
        fam = (cell, _with_batch(ins.key, 0))
        fams.setdefault(fam, set()).add(ins.key[0])
  todo, sizes = [], defaultdict(set)
  for (cell, key0), seen in fams.items():
    pol = cell.batch_policy
    top = max(seen)
    above = pol.bucket(top + 1)  # at least the next bucket up, however coarse the policy
    lo, hi = max(1, min(seen) // spread[0]), max(top * spread[1], above or top)
    b = pol.bucket(lo)
    while b is not None and b <= hi:
      sizes[cell.name].add(b)
      key = _with_batch(key0, b)
      if not cell.kernel.has(key):
        todo.append((cell, key))
      nb = pol.bucket(b + 1)
      b = nb if nb is not None and nb > b else None
  n = 0
  if todo:
    workers = workers or min(8, os.cpu_count() or 1, len(todo))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      exes = list(pool.map(lambda ck: ck[0]._build_step(ck[1]), todo))
    for (cell, key), exe in zip(todo, exes, strict=True):
      n += cell.kernel.add(key, exe)
      # The first run of an executable costs ~1.3 ms more than the next ones (XLA's one-time
      # set-up, measured on the 2-core CPU box): pay it here, on zeros, not in a real batch.
      jax.block_until_ready(exe(*[np.zeros(a.shape, a.dtype) for a in _step_avals(key)]))
  return {"compiled": n, "buckets": {k: sorted(v) for k, v in sizes.items()}}


# -- recursive --------------------------------------------------------------------------------
class Recursive:
  """A host-side recursive function whose cell calls are batched (see :func:`recursive`)."""

  def __init__(self, fn: Callable, name: str | None = None):
    self.fn = fn
    self.name = name or getattr(fn, "__name__", "recursive")
    self._caps: dict = {}
    self.last_stats: VMStats | None = None
    self.last_programs: list = []
    functools.update_wrapper(self, fn)

  def __call__(self, *args):
    if _local.graph is not None:
      # Recording: the hot path is the user's function alone (~0.1 us of our own per call).
      # A cycle in the structure surfaces as a RecursionError; batch() then finds the
      # repeated call among the traceback's frames (no per-call bookkeeping).
      return self.fn(*args)
    try:
      leaves = jax.tree_util.tree_leaves(args)
    except Exception:  # a cyclic or very deep host structure: the walk below reports it
      leaves = args
    if any_tracer(leaves):
      raise needs_vm("recursive", f"{self.name} was called with JAX tracers; it walks a host "
                     "structure and batches its cells on the VM")
    return self.batch([args])[0]

  def warmup(self, items: Sequence, *, headroom: float = 2.0, spread: tuple = (4, 2),
             workers: int | None = None) -> dict:
    """Runs ``items`` once, then compiles ahead what later batches like it will need.

    Executables are keyed by batch bucket and arena capacity, so a new forest compiles
    whenever one of its levels lands in a bucket no earlier batch had, or it outgrows the
    arenas.  This runs the batch with arenas sized for ``headroom`` times its results
    (capacities only grow), then compiles, for every cell and argument signature the batch
    used, every batch bucket from 1/``spread[0]`` of its smallest group to ``spread[1]``
    times its largest (and at least the next bucket up) -- concurrently (XLA compiles
    release the GIL).

    Returns:
      ``{"compiled": n, "seconds": s, "buckets": {cell name: [sizes]}, "caps": [...]}``.

    Example:
      >>> tree_sum.warmup([((0.5, 0.25),)])["compiled"] >= 0
      True
    """
    t0 = time.perf_counter()
    self._run(items, headroom)
    res = _warm_siblings(self.last_programs, spread, workers)
    gc.collect()  # compiling left much garbage: collect it now, not in the first real batch
    self._run(items, headroom)  # and touch the memory the collection gave back (~2 ms saved)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    res["caps"] = sorted((str(k[1]), list(k[0]), c) for k, c in self._caps.items())
    return res

  def batch(self, items: Sequence) -> list:
    """Runs many calls together (e.g. a minibatch of trees); returns their results in order.

    Each item is a tuple of positional arguments (a non-tuple item is one argument; a tuple
    that is itself the structure must be wrapped: ``(tree,)``).

    Example:
      >>> trees = [(0.5, 0.25), ((0.5, 0.5), 1.0)]
      >>> [r.shape for r in tree_sum.batch([(t,) for t in trees])]  # doctest: +SKIP
      [(2,), (2,)]
    """
    return self._run(items, 1.0)

  def _run(self, items: Sequence, headroom: float) -> list:
    if not isinstance(items, list | tuple):
      raise ControlFlowError(
          f"{self.name}.batch expects a list of argument tuples, got {type(items).__name__}")
    fn = self.fn
    if _local.graph is not None:
      return [fn(*(it if isinstance(it, tuple) else (it,))) for it in items]
    graph = _Graph(self.name, self._caps)
    graph.headroom = headroom
    _local.graph = graph
    # Recording allocates many small objects that live until the flush; the cyclic GC would
    # re-traverse all of them again and again (it tripled recording time on big batches).
    gc_on = gc.isenabled()
    gc.disable()
    try:
      t0 = time.perf_counter()
      try:
        outs = [fn(*(it if isinstance(it, tuple) else (it,))) for it in items]
      except RecursionError as e:
        raise _recursion_error(self, e) from None
      finally:
        _local.graph = None
      record_s = time.perf_counter() - t0
      graph.flush()
      res = _extract(outs)
      del outs  # the placeholders go now, while the GC is still off
      flush_s = time.perf_counter() - t0 - record_s
    finally:
      graph.cur = None  # the only reference cycle (graph <-> batch): freed by refcounts
      graph.seen = {}
      if gc_on:
        gc.enable()
    st = graph.stats
    for bmeta in st.batches:
      bmeta["record_s"] = record_s
      bmeta["flush_s"] = flush_s  # build + dispatch (+ waits on CPU, where compute is sync)
    self.last_stats = st
    self.last_programs = graph.programs
    _record_stats(st)
    return res

  def __repr__(self) -> str:
    return f"dynjax.recursive({self.name})"


_SCALARS = frozenset({int, float, str, bool, type(None)})
_CALL_CODE = Recursive.__call__.__code__


def _recursion_error(rec: Recursive, err: RecursionError) -> ControlFlowError:
  """A cycle (the same call again while it is still running) or a too deep structure.

  The calls still running when Python gave up are the ``Recursive.__call__`` frames of the
  traceback; a call repeated among them (structure objects by identity, scalars by value)
  means the structure has a cycle.
  """
  active: set = set()
  tb = err.__traceback__
  while tb is not None:
    frame = tb.tb_frame
    if frame.f_code is _CALL_CODE:
      r, args = frame.f_locals.get("self"), frame.f_locals.get("args", ())
      key = (id(r), tuple([a if type(a) in _SCALARS else id(a) for a in args]))
      if key in active:
        return ControlFlowError(
            f"{r.name}: the structure has a cycle: it was called again with "
            f"{', '.join(_describe(a) for a in args)} while still processing that same call. "
            "dynjax.recursive walks trees and DAGs (acyclic); break the cycle or stop the "
            "recursion there.")
      active.add(key)
    tb = tb.tb_next
  return ControlFlowError(
      f"{rec.name}: the structure nests deeper than Python's recursion limit "
      f"({sys.getrecursionlimit()}). Raise it with sys.setrecursionlimit, or make the "
      "structure shallower (e.g. binarize wide nodes).")


def _describe(obj) -> str:
  text = repr(obj)
  text = text if len(text) <= 60 else text[:57] + "..."
  return f"{type(obj).__name__} {text}"


def recursive(fn: Callable) -> Recursive:
  """Marks a Python function that recurses over a host structure calling cells and itself.

  ``rec(*args)`` runs one call; ``rec.batch([args1, args2, ...])`` runs many together, so cell
  calls at the same dependency level across *all* items are batched into one call.  A call made
  again with the same arguments while it is still running is reported as a cycle.

  Args:
    fn: the recursive function.  It may call :class:`Cell` objects, itself, and plain Python;
      see the module docstring for what operations on cell results cost.

  Example:
    >>> @dynjax.cell
    ... def leaf(x):
    ...   return jnp.full((2,), x, jnp.float32)
    >>> @dynjax.cell
    ... def combine(a, b):
    ...   return jnp.tanh(a + b)
    >>> @dynjax.recursive
    ... def tree_sum(node):
    ...   if isinstance(node, float):
    ...     return leaf(node)
    ...   return combine(tree_sum(node[0]), tree_sum(node[1]))
    >>> [r.shape for r in tree_sum.batch([((0.5, 0.25),), (((0.5, 0.5), 1.0),)])]
    [(2,), (2,)]
  """
  return Recursive(fn)
