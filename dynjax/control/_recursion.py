"""``dynjax.cell`` and ``dynjax.recursive``: recursion over host structures, batched by level.

How a batch runs (``rec.batch([args, ...])``; ``rec(*args)`` is a batch of one):

1. **Record.** The user's Python function runs on the host over the structure (a tree, a list
   of children).  Calls of a :class:`Cell` do not compute: they add a node to a dataflow graph
   and return :class:`CellValue` placeholders (one per output leaf, shape and dtype known from
   ``jax.eval_shape`` of the cell, cached per argument signature).  Recording costs ~3-5 us of
   host time per cell call.
2. **Schedule.** A node's level is 1 + the deepest level of the nodes it reads.  Nodes of one
   level, one cell and one argument signature form a *group*: they run as ONE call of
   ``vmap(cell)`` on a batch padded to a bucket (powers of two; dummy items repeat item 0 and
   their results are dropped).  Every output leaf lives in an *arena*: one device buffer per
   (shape, dtype), ``(capacity, *shape)``, capacity a power of two.
3. **Build and run.** The schedule becomes a straight-line :class:`~dynjax.runtime.Program`:
   ``alloc_tensor`` per arena, then per group ``const`` (the packed int32 slot indices, host
   inputs) and one ``invoke`` of the group's step executable, which gathers the inputs from the
   arenas, runs the vmapped cell and scatters the results back (arenas donated, so updated in
   place).  Executables are cached per (cell, batch bucket, argument kinds, arena capacities).
   The VM runs it without a single host sync; the results are cut out by one ``invoke`` per
   result signature.

What placeholders cost: passing them to cells, returning them, keeping them in tuples/lists/
dicts, and reading ``.shape``/``.dtype``/``.ndim`` are free.  Anything else -- indexing,
arithmetic, ``bool()``, ``np.asarray``, passing them to ``jnp`` functions -- *materialises*
the value: the graph recorded so far runs at once (one batched run), the value is cut out
(one small executable call), and the recording continues; later cells that read such a
materialised value get it as a per-item device array, stacked per group (one extra device op).
So keep non-cell work on cell results inside cells.
"""

from __future__ import annotations

import functools
import gc
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
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.control._frontend import any_tracer, building, is_tracer, needs_vm
from dynjax.runtime import VM, Kernel, ProgramBuilder, VMStats
from dynjax.runtime._vm import record as _record_stats

_local = threading.local()


def _current_graph() -> _Graph | None:
  return getattr(_local, "graph", None)


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

  __slots__ = ("batch", "arena", "slot", "level", "shape", "dtype", "sig", "cell", "nid",
               "index", "_val")
  __array_priority__ = 100

  def __init__(self, batch, arena, slot, level, shape, dtype, sig, cell, nid, index):
    self.batch = batch  # the _Batch that records (then holds) it
    self.arena = arena  # arena index in that batch
    self.slot = slot  # row in that arena
    self.level = level
    self.shape = shape
    self.dtype = dtype
    self.sig = sig  # the interned "node" _Kind of (shape, dtype)
    self.cell = cell
    self.nid = nid
    self.index = index
    self._val = None

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  def materialize(self) -> jax.Array:
    """The concrete value (runs the pending graph first if needed; see module docstring)."""
    if self._val is None:
      b = self.batch
      if b.arenas is None:
        b.graph.flush()
      self._val = _take_rows(b.arenas[self.arena], [self.slot])[0]
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
    return (f"CellValue({self.cell.name}#{self.nid}[{self.index}], "
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


class _Kind:
  """An interned argument/result kind: hashed by identity, so group keys hash fast.

  ``kind``: "node" (a pending cell result), "host" (numpy/Python value), "dev" (a device
  array), "dcont" (a container of device arrays, e.g. the params dict: one entry for all its
  leaves; ``extra`` = (treedef, leaf kinds)).
  """

  __slots__ = ("kind", "shape", "dtype", "extra", "flat")

  def __init__(self, kind, shape, dtype, extra):
    self.kind, self.shape, self.dtype, self.extra = kind, shape, dtype, extra
    self.flat = (tuple(k.flat[0] for k in extra[1]) if kind == "dcont"
                 else ((kind, shape, dtype),))


_KINDS: dict = {}


def _kind(kind, shape, dtype, extra=None) -> _Kind:
  key = (kind, shape, dtype, extra)
  k = _KINDS.get(key)
  if k is None:
    k = _KINDS[key] = _Kind(kind, shape, dtype, extra)
  return k


_I32 = np.dtype(np.int32)


# -- cells ---------------------------------------------------------------------------------
_SCALAR_KINDS = {t: _kind("host", (), np.dtype(jax.dtypes.canonicalize_dtype(d)))
                 for t, d in ((int, np.int64), (float, np.float64), (bool, np.bool_))}


def _leaf_sig(x):
  """(kind, shape, dtype) of one cell argument leaf; converts host values to numpy."""
  if isinstance(x, CellValue):
    if x.batch.arenas is None:
      return "node", x.shape, jnp.dtype(x.dtype), x
    x = x.materialize()
  if isinstance(x, jax.Array):
    return "dev", tuple(x.shape), x.dtype, x
  a = np.asarray(x)
  if a.dtype == object:
    raise ControlFlowError(
        f"a cell argument must be an array, a number or a cell result; got "
        f"{type(x).__name__} {x!r}. Pass host structures to the recursive function, not to "
        "cells.")
  a = a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)
  return "host", a.shape, a.dtype, a


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
    graph = _current_graph()
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

  def _check_signature(self, args) -> None:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    self._signature(treedef, tuple(_leaf_sig(x)[:3] for x in leaves))

  # -- the batched step executable ---------------------------------------------------------
  def _build_step(self, key):
    (batch, treedef, kinds, arena_sigs, out_arenas) = key
    # kinds: per flat arg leaf: ("node", arena_pos, ids_row) / ("hostid", ids_row) (int32
    # scalars ride in the ids array: one transfer per group) / ("host",) / ("bcast",) /
    # ("stack",); out_arenas: per output leaf (arena_pos, ids_row).
    fn = self.fn
    n_arenas = len(arena_sigs)

    def step(*args):
      arenas, ids, data = list(args[:n_arenas]), args[n_arenas], args[n_arenas + 1:]
      leaves, axes, di = [], [], 0
      for k in kinds:
        if k[0] == "node":
          leaves.append(arenas[k[1]][ids[k[2]]])
          axes.append(0)
        elif k[0] == "hostid":
          leaves.append(ids[k[1]])
          axes.append(0)
        else:
          leaves.append(data[di])
          axes.append(None if k[0] == "bcast" else 0)
          di += 1

      def per_item(*xs):
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(treedef, xs)))

      outs = jax.vmap(per_item, in_axes=tuple(axes))(*leaves)
      for (pos, row), out in zip(out_arenas, outs, strict=True):
        arenas[pos] = arenas[pos].at[ids[row]].set(out.astype(arenas[pos].dtype), mode="drop")
      return tuple(arenas)

    del batch
    return jax.jit(step, donate_argnums=tuple(range(n_arenas)))

  def __repr__(self) -> str:
    return f"dynjax.cell({self.name})"


def _describe_step(key) -> str:
  bsz, _, kinds, arenas, _ = key
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


def _cap(n: int) -> int:
  return max(_ARENA_MIN, 1 << max(0, (n - 1).bit_length()))


_TUPLE_TD = [jax.tree_util.treedef_tuple([jax.tree_util.tree_structure(0)] * n)
             for n in range(9)]
_LEAF_TD = jax.tree_util.tree_structure(0)


class _Group:
  """The calls of one (level, cell, argument kinds): one batched invoke.

  Filled while recording, column by column: ``cols[j]`` holds, per call, the arena slot
  ("node"), the host value ("host"), the device array ("dev") or the container entry ("dcont")
  of argument kind ``j``; ``outs[i]`` the arena slots of output leaf ``i``.
  """

  __slots__ = ("level", "cell", "kinds", "toks", "treedef", "cols", "outs", "out_info",
               "out_tree", "unflatten")

  def __init__(self, level, cell, toks, kinds, graph):
    self.level, self.cell, self.toks, self.kinds = level, cell, toks, kinds
    self.treedef = graph.treedef_of(toks)
    flat = tuple(s for k in kinds for s in k.flat)
    out_tree, out_sigs = cell._signature(self.treedef, flat)
    self.out_tree = out_tree
    n_out = len(out_sigs)
    if out_tree == _LEAF_TD:
      self.unflatten = 1
    elif n_out < len(_TUPLE_TD) and out_tree == _TUPLE_TD[n_out]:
      self.unflatten = 0
    else:
      self.unflatten = 2
    self.cols = [[] for _ in kinds]
    self.outs = [[] for _ in out_sigs]
    self.out_info = []
    for shape, dtype, _ in out_sigs:
      sig = _kind("node", shape, dtype)
      self.out_info.append((graph.arena_of(sig), shape, dtype, sig))


class _Batch:
  """One flush worth of recorded calls; ``arenas`` is set once it ran."""

  __slots__ = ("graph", "groups", "arena_sigs", "arena_ix", "counts", "arenas", "count")

  def __init__(self, graph):
    self.graph = graph
    self.groups: dict = {}
    self.arena_sigs: list = []
    self.arena_ix: dict = {}
    self.counts: list[int] = []
    self.arenas = None
    self.count = 0


class _DCont:
  __slots__ = ("obj", "kind", "leaves")

  def __init__(self, obj, kind, leaves):
    self.obj, self.kind, self.leaves = obj, kind, leaves


class _Graph:
  """The dataflow graph of one ``batch`` call: recorded calls, run by :meth:`flush`.

  Recording is the hot path (one call per cell call of the user's recursion): per argument a
  type test, interned kinds (identity-hashed), containers of device arrays (params) flattened
  once per object, and the call appended to its group's columns at once -- level, group and
  arena slots are all known when the call is recorded, so a flush only turns columns into
  int32 index arrays.
  """

  def __init__(self, name: str, caps: dict | None = None):
    self.name = name
    self.caps = {} if caps is None else caps  # sticky arena capacities, per signature
    self.cur = _Batch(self)
    self.stats = VMStats()
    self.programs: list = []
    self._dev: dict[int, tuple] = {}  # id(array) -> (kind, array): keeps it alive
    self._cont: dict[int, _DCont] = {}
    self._tds: dict = {}
    self.nodes = 0

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

  def treedef_of(self, toks):
    td = self._tds.get(toks)
    if td is None:
      td = self._tds[toks] = jax.tree_util.treedef_tuple(
          [_LEAF_TD if t is None else t for t in toks])
    return td

  def _leaf(self, x):
    """(kind, value, level) of one non-container argument leaf."""
    t = type(x)
    if t is CellValue:
      if x.batch is self.cur:
        return x.sig, x.slot, x.level
      x = x.materialize()
      t = type(x)
    k = _SCALAR_KINDS.get(t)
    if k is not None:
      return k, x, 0
    if isinstance(x, jax.Array):
      hit = self._dev.get(id(x))
      if hit is None or hit[1] is not x:
        hit = self._dev[id(x)] = (_kind("dev", tuple(x.shape), x.dtype), x)
      return hit[0], x, 0
    kind, shape, dtype, a = _leaf_sig(x)
    return _kind(kind, shape, dtype), a, 0

  def add(self, cell: Cell, args) -> Any:
    cur = self.cur
    toks, kinds, vals, level = [], [], [], 0
    for a in args:
      t = type(a)
      if t is CellValue and a.batch is cur:
        toks.append(None)
        kinds.append(a.sig)
        vals.append(a.slot)
        if a.level > level:
          level = a.level
        continue
      if t is tuple and len(a) < len(_TUPLE_TD):  # e.g. the (h, c) pair of a cell result
        for e in a:
          if type(e) is not CellValue or e.batch is not cur:
            break
        else:
          toks.append(_TUPLE_TD[len(a)])
          for e in a:
            kinds.append(e.sig)
            vals.append(e.slot)
            if e.level > level:
              level = e.level
          continue
      hit = self._cont.get(id(a))
      if hit is not None and hit.obj is a:
        toks.append(hit.kind.extra[0])
        kinds.append(hit.kind)
        vals.append(hit)
        continue
      leaves, td = jax.tree_util.tree_flatten(a)
      if td == _LEAF_TD:
        k, v, lv = self._leaf(a)
        toks.append(None)
        kinds.append(k)
        vals.append(v)
        if lv > level:
          level = lv
        continue
      sub = [self._leaf(x) for x in leaves]
      toks.append(td)
      if sub and all(k.kind == "dev" for k, _, _ in sub):
        # A container of device arrays (params): flattened once per object per batch.
        hit = self._cont[id(a)] = _DCont(a, _kind("dcont", None, None,
                                                  (td, tuple(k for k, _, _ in sub))),
                                         [v for _, v, _ in sub])
        kinds.append(hit.kind)
        vals.append(hit)
        continue
      for k, v, lv in sub:
        kinds.append(k)
        vals.append(v)
        if lv > level:
          level = lv
    level += 1
    key = (level, cell, tuple(toks), tuple(kinds))
    g = cur.groups.get(key)
    if g is None:
      g = cur.groups[key] = _Group(level, cell, key[2], key[3], self)
    for col, v in zip(g.cols, vals):
      col.append(v)
    nid = self.nodes
    self.nodes = nid + 1
    cur.count += 1
    counts = cur.counts
    res = []
    i = 0
    for (ar, shape, dtype, sig), slots in zip(g.out_info, g.outs):
      s = counts[ar]
      counts[ar] = s + 1
      slots.append(s)
      res.append(CellValue(cur, ar, s, level, shape, dtype, sig, cell, nid, i))
      i += 1
    if g.unflatten == 0:
      return tuple(res)
    if g.unflatten == 1:
      return res[0]
    return jax.tree_util.tree_unflatten(g.out_tree, res)

  def flush(self) -> None:
    """Runs every pending call: one Program (levels in order), run on the VM."""
    b = self.cur
    self.cur = _Batch(self)
    self._cont.clear()  # containers are flattened once per recorded batch
    if not b.groups:
      b.arenas = []
      return
    prog = self._build(b)
    vm = VM(prog)
    arenas = vm.run()
    st = vm.take_stats()
    st.batches.append(dict(prog.meta))
    self.stats.add(st)
    self.programs.append(prog)
    b.arenas = list(arenas)

  def _build(self, b: _Batch):
    # Capacities only grow (per recursive function), so executables compiled for one batch
    # serve the next ones: compiles stop once the largest batch has been seen.
    caps = []
    for sig, c in zip(b.arena_sigs, b.counts, strict=True):
      key = (sig.shape, sig.dtype)
      cap = max(self.caps.get(key, 0), _cap(c))
      self.caps[key] = cap
      caps.append(cap)
    groups = sorted(b.groups.values(), key=lambda g: g.level)
    pb = ProgramBuilder(f"{self.name}.batch", num_args=0)
    arena_regs = [pb.emit_alloc_tensor((caps[i], *sig.shape), sig.dtype)
                  for i, sig in enumerate(b.arena_sigs)]
    arena_ix = b.arena_ix
    bucket_hist: dict[int, int] = defaultdict(int)
    for g in groups:
      cell = g.cell
      n = len(g.outs[0]) if g.outs else len(g.cols[0])
      bsz = cell.batch_policy.bucket(n)
      bsz = cell.batch_policy.grow(n) if bsz is None else bsz
      bucket_hist[bsz] += 1
      involved: list[int] = []

      def pos(a, involved=involved):
        if a not in involved:
          involved.append(a)
        return involved.index(a)

      step_kinds, rows, pads, data = [], [], [], []
      for kind, col in zip(g.kinds, g.cols, strict=True):
        kk = kind.kind
        if kk == "node":
          step_kinds.append(("node", pos(arena_ix[kind]), len(rows)))
          rows.append(col)
          pads.append(col[0])
        elif kk == "host":
          if kind.shape == () and kind.dtype == _I32:
            step_kinds.append(("hostid", len(rows)))
            rows.append(col)
            pads.append(col[0])
            continue
          stacked = np.asarray(col, dtype=kind.dtype)
          if bsz > n:
            stacked = np.concatenate([stacked, np.repeat(stacked[:1], bsz - n, 0)])
          step_kinds.append(("host",))
          data.append(stacked)
        elif kk == "dev":  # broadcast when every item passes the same array
          first = col[0]
          if all(x is first for x in col):
            step_kinds.append(("bcast",))
            data.append(first)
          else:
            step_kinds.append(("stack",))
            data.append(jnp.stack(col + [first] * (bsz - n)))
        else:  # "dcont": a container of device arrays
          first = col[0]
          if all(x is first for x in col):
            step_kinds.extend([("bcast",)] * len(first.leaves))
            data.extend(first.leaves)
          else:
            for j in range(len(first.leaves)):
              items = [e.leaves[j] for e in col]
              step_kinds.append(("stack",))
              data.append(jnp.stack(items + [items[0]] * (bsz - n)))
      out_pos = []
      for (ar, _, _, _), slots in zip(g.out_info, g.outs, strict=True):
        out_pos.append((pos(ar), len(rows)))
        rows.append(slots)
        pads.append(caps[ar])  # dummy items' results are dropped
      ids = np.empty((len(rows), bsz), np.int32)
      for r, (row, pad) in enumerate(zip(rows, pads, strict=True)):
        ids[r, :n] = row
        ids[r, n:] = pad
      key = (bsz, g.treedef, tuple(step_kinds),
             tuple(((b.arena_sigs[a].shape, b.arena_sigs[a].dtype), caps[a])
                   for a in involved), tuple(out_pos))
      ids_reg = pb.emit_const(ids)
      data_regs = [pb.emit_const(d) for d in data]
      inv = [arena_regs[a] for a in involved]
      pb.emit_invoke_into(cell.kernel, key, [*inv, ids_reg, *data_regs], inv)
    pb.emit_ret(arena_regs)
    pb.meta.update(nodes=b.count, levels=groups[-1].level, groups=len(groups),
                   batch_buckets=dict(bucket_hist), arenas=[
                       (sig.shape, str(sig.dtype), caps[i])
                       for i, sig in enumerate(b.arena_sigs)])
    return pb.finish()


_take_rows_cache: dict = {}


def _take_rows(arena, slots: Sequence[int]) -> list:
  """Per-item arrays cut from an arena: one executable call per bucket of ``len(slots)``."""
  n = len(slots)
  b = 1 << max(0, (n - 1).bit_length())
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
      want[(id(x.batch), x.arena)].append((i, x))
  for items in want.values():
    x0 = items[0][1]
    rows = _take_rows(x0.batch.arenas[x0.arena], [x.slot for _, x in items])
    for (i, x), r in zip(items, rows, strict=True):
      leaves[i] = x._val = r
  return jax.tree_util.tree_unflatten(treedef, leaves)


# -- recursive --------------------------------------------------------------------------------
class Recursive:
  """A host-side recursive function whose cell calls are batched (see :func:`recursive`)."""

  def __init__(self, fn: Callable, name: str | None = None):
    self.fn = fn
    self.name = name or getattr(fn, "__name__", "recursive")
    self._active: set = set()
    self._caps: dict = {}
    self.last_stats: VMStats | None = None
    self.last_programs: list = []
    functools.update_wrapper(self, fn)

  def __call__(self, *args):
    graph = _current_graph()
    if graph is not None:
      return self._step(args)
    try:
      leaves = jax.tree_util.tree_leaves(args)
    except Exception:  # a cyclic or very deep host structure: the walk below reports it
      leaves = args
    if any_tracer(leaves):
      raise needs_vm("recursive", f"{self.name} was called with JAX tracers; it walks a host "
                     "structure and batches its cells on the VM")
    return self.batch([args])[0]

  def _step(self, args):
    # A call with the same arguments (structure objects by identity, scalars by value) while
    # that call is still running can only recurse forever: a cycle in the structure.
    key = tuple([a if type(a) in _SCALARS else id(a) for a in args])
    if key in self._active:
      raise ControlFlowError(
          f"{self.name}: the structure has a cycle: it was called again with "
          f"{', '.join(_describe(a) for a in args)} while still processing that same call. "
          "dynjax.recursive walks trees and DAGs (acyclic); break the cycle or stop the "
          "recursion there.")
    self._active.add(key)
    try:
      return self.fn(*args)
    finally:
      self._active.discard(key)

  def batch(self, items: Sequence) -> list:
    """Runs many calls together (e.g. a minibatch of trees); returns their results in order.

    Each item is a tuple of positional arguments (a non-tuple item is one argument; a tuple
    that is itself the structure must be wrapped: ``(tree,)``).

    Example:
      >>> trees = [(0.5, 0.25), ((0.5, 0.5), 1.0)]
      >>> [r.shape for r in tree_sum.batch([(t,) for t in trees])]  # doctest: +SKIP
      [(2,), (2,)]
    """
    if not isinstance(items, list | tuple):
      raise ControlFlowError(
          f"{self.name}.batch expects a list of argument tuples, got {type(items).__name__}")
    if _current_graph() is not None:
      return [self._step(it if isinstance(it, tuple) else (it,)) for it in items]
    graph = _Graph(self.name, self._caps)
    _local.graph = graph
    # Recording allocates many small objects that live until the flush; the cyclic GC would
    # re-traverse all of them again and again (it tripled recording time on big batches).
    gc_on = gc.isenabled()
    gc.disable()
    try:
      t0 = time.perf_counter()
      try:
        outs = [self._step(it if isinstance(it, tuple) else (it,)) for it in items]
      except RecursionError:
        raise ControlFlowError(
            f"{self.name}: the structure nests deeper than Python's recursion limit "
            f"({sys.getrecursionlimit()}). Raise it with sys.setrecursionlimit, or make the "
            "structure shallower (e.g. binarize wide nodes).") from None
      finally:
        _local.graph = None
        self._active.clear()
      record_s = time.perf_counter() - t0
      graph.flush()
      res = _extract(outs)
      del outs  # the placeholders go now, while the GC is still off
      flush_s = time.perf_counter() - t0 - record_s
    finally:
      graph.cur = None  # the only reference cycle (graph <-> batch): freed by refcounts
      graph._dev.clear()
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
