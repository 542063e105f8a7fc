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

  __slots__ = ("node", "index", "shape", "dtype", "sig")
  __array_priority__ = 100

  def __init__(self, node: _Node, index: int, shape: tuple[int, ...], dtype, sig=None):
    self.node = node
    self.index = index
    self.shape = shape
    self.dtype = dtype
    self.sig = sig or ("node", shape, jnp.dtype(dtype))  # the argument-kind key part

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  def materialize(self) -> jax.Array:
    """The concrete value (runs the pending graph first if needed; see module docstring)."""
    node = self.node
    if node.values is None:
      node.graph.flush()
    return node.values[self.index]

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
    state = "pending" if self.node.values is None else "done"
    return (f"CellValue({self.node.cell.name}#{self.node.id}[{self.index}], "
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


class _Node:
  __slots__ = ("id", "graph", "cell", "leaves", "kinds", "level", "outs", "values", "group")

  def __init__(self, nid, graph, cell, leaves, kinds, level):
    self.id = nid
    self.graph = graph
    self.cell = cell
    self.leaves = leaves  # flat argument leaves (CellValue / device array / numpy)
    self.kinds = kinds  # the group key part contributed by the arguments
    self.level = level
    self.outs: tuple[CellValue, ...] = ()
    self.values: tuple | None = None  # per output leaf device arrays, once run


# -- cells ---------------------------------------------------------------------------------
_SCALAR_SIGS = {t: ("host", (), np.dtype(jax.dtypes.canonicalize_dtype(d)))
                for t, d in ((int, np.int64), (float, np.float64), (bool, np.bool_))}


def _leaf_sig(x):
  """(kind, shape, dtype) of one cell argument leaf; converts host values to numpy."""
  if isinstance(x, CellValue):
    if x.node.values is None:
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
    # kinds: per flat arg leaf: ("node", arena_pos) / ("host",) / ("bcast",) / ("stack",)
    fn = self.fn
    n_in_node = sum(1 for k in kinds if k[0] == "node")

    n_arenas = len(arena_sigs)

    def step(*args):
      arenas, ids, data = list(args[:n_arenas]), args[n_arenas], args[n_arenas + 1:]
      leaves, axes, di, ni = [], [], 0, 0
      for k in kinds:
        if k[0] == "node":
          leaves.append(arenas[k[1]][ids[ni]])
          axes.append(0)
          ni += 1
        else:
          leaves.append(data[di])
          axes.append(None if k[0] == "bcast" else 0)
          di += 1

      def per_item(*xs):
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(treedef, xs)))

      outs = jax.vmap(per_item, in_axes=tuple(axes))(*leaves)
      for j, (pos, out) in enumerate(zip(out_arenas, outs, strict=True)):
        arenas[pos] = arenas[pos].at[ids[n_in_node + j]].set(
            out.astype(arenas[pos].dtype), mode="drop")
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


class _Graph:
  """The dataflow graph of one batch: recorded nodes, run by :meth:`flush`."""

  def __init__(self, name: str, caps: dict | None = None):
    self.name = name
    self.caps = {} if caps is None else caps  # sticky arena capacities, per signature
    self.pending: list[_Node] = []
    self.count = 0
    self.stats = VMStats()
    self.programs: list = []
    self._dev_sig: dict[int, tuple] = {}

  def add(self, cell: Cell, args) -> Any:
    # Hot path of recording (~5 us per call on CPU): per leaf a type test and a cached sig.
    leaves, treedef = jax.tree_util.tree_flatten(args)
    kinds, vals, level = [], [], 0
    dev_sig = self._dev_sig
    for x in leaves:
      t = type(x)
      if t is CellValue:
        nd = x.node
        if nd.values is None:
          kinds.append(x.sig)
          vals.append(x)
          if nd.level > level:
            level = nd.level
          continue
        x = x.materialize()
        t = type(x)
      sig = _SCALAR_SIGS.get(t)
      if sig is not None:
        kinds.append(sig)
        vals.append(x)
        continue
      if isinstance(x, jax.Array):
        hit = dev_sig.get(id(x))
        if hit is None:
          hit = dev_sig[id(x)] = (("dev", tuple(x.shape), x.dtype), x)  # keeps x alive
        kinds.append(hit[0])
        vals.append(x)
        continue
      k, shape, dtype, a = _leaf_sig(x)
      kinds.append((k, shape, dtype))
      vals.append(a)
    kinds = tuple(kinds)
    out_tree, out_sigs = cell._signature(treedef, kinds)
    node = _Node(self.count, self, cell, vals, (treedef, kinds), level + 1)
    self.count += 1
    node.outs = tuple(CellValue(node, i, sh, dt, sg) for i, (sh, dt, sg) in enumerate(out_sigs))
    self.pending.append(node)
    return jax.tree_util.tree_unflatten(out_tree, node.outs)

  def flush(self) -> None:
    """Runs every pending node: schedule by level, build a Program, run it on the VM."""
    nodes, self.pending = self.pending, []
    if not nodes:
      return
    prog, arena_keys, slot_of = self._build(nodes)
    vm = VM(prog)
    arenas = vm.run()
    st = vm.take_stats()
    st.batches.append(dict(prog.meta))
    self.stats.add(st)
    self.programs.append(prog)
    arena_of = dict(zip(arena_keys, arenas, strict=True))
    for node in nodes:
      node.values = _LazyValues(node, arena_of, slot_of)

  def _build(self, nodes: list[_Node]):
    # Slots: one per output leaf, per arena signature.
    arena_index: dict[tuple, int] = {}
    counts: list[int] = []
    slot_of: dict[tuple[int, int], tuple[int, int]] = {}
    for node in nodes:
      for v in node.outs:
        sig = (v.shape, jnp.dtype(v.dtype))
        a = arena_index.get(sig)
        if a is None:
          a = arena_index[sig] = len(counts)
          counts.append(0)
        slot_of[(node.id, v.index)] = (a, counts[a])
        counts[a] += 1
    arena_keys = list(arena_index)
    # Capacities only grow (per recursive function), so executables compiled for one batch
    # serve the next ones: compiles stop once the largest batch has been seen.
    caps = []
    for sig, c in zip(arena_keys, counts, strict=True):
      cap = max(self.caps.get(sig, 0), _cap(c))
      self.caps[sig] = cap
      caps.append(cap)
    groups: dict[tuple, list[_Node]] = defaultdict(list)
    for node in nodes:
      groups[(node.level, id(node.cell), node.kinds)].append(node)
    order = sorted(groups, key=lambda k: k[0])
    b = ProgramBuilder(f"{self.name}.batch", num_args=0)
    arena_regs = [b.emit_alloc_tensor((caps[i], *sig[0]), sig[1])
                  for i, sig in enumerate(arena_keys)]
    levels = max(n.level for n in nodes)
    bucket_hist: dict[int, int] = defaultdict(int)
    for gk in order:
      members = groups[gk]
      cell = members[0].cell
      treedef, kinds = gk[2]
      n = len(members)
      bsz = cell.batch_policy.bucket(n)
      bsz = cell.batch_policy.grow(n) if bsz is None else bsz
      bucket_hist[bsz] += 1
      involved: list[int] = []

      def pos(a, involved=involved):
        if a not in involved:
          involved.append(a)
        return involved.index(a)

      step_kinds, id_rows, data = [], [], []
      for j, (kind, _shape, _dtype) in enumerate(kinds):
        if kind == "node":
          src = [slot_of.get((m.leaves[j].node.id, m.leaves[j].index)) for m in members]
          if any(s is None for s in src):
            raise AssertionError("a node reads a value of another flush")  # levels forbid it
          step_kinds.append(("node", pos(src[0][0])))
          row = np.fromiter((s[1] for s in src), np.int32, n)
          id_rows.append(np.concatenate([row, np.full(bsz - n, row[0], np.int32)]))
        elif kind == "host":
          stacked = np.asarray([m.leaves[j] for m in members], dtype=_dtype)
          if bsz > n:
            stacked = np.concatenate([stacked, np.repeat(stacked[:1], bsz - n, 0)])
          step_kinds.append(("host",))
          data.append(stacked)
        else:  # device array: broadcast when every item passes the same array
          first = members[0].leaves[j]
          if all(m.leaves[j] is first for m in members):
            step_kinds.append(("bcast",))
            data.append(first)
          else:
            items = [m.leaves[j] for m in members]
            items += [items[0]] * (bsz - n)
            step_kinds.append(("stack",))
            data.append(jnp.stack(items))
      out_pos = []
      for i in range(len(members[0].outs)):
        a = slot_of[(members[0].id, i)][0]
        out_pos.append(pos(a))
        row = np.fromiter((slot_of[(m.id, i)][1] for m in members), np.int32, n)
        id_rows.append(np.concatenate([row, np.full(bsz - n, caps[a], np.int32)]))  # dropped
      ids = (np.stack(id_rows) if id_rows else np.zeros((0, bsz), np.int32))
      key = (bsz, treedef, tuple(step_kinds),
             tuple((arena_keys[a], caps[a]) for a in involved), tuple(out_pos))
      ids_reg = b.emit_const(ids)
      data_regs = [b.emit_const(d) for d in data]
      inv = [arena_regs[a] for a in involved]
      b.emit_invoke_into(cell.kernel, key, [*inv, ids_reg, *data_regs], inv)
    b.emit_ret(arena_regs)
    b.meta.update(nodes=len(nodes), levels=levels, groups=len(order),
                  batch_buckets=dict(bucket_hist), arenas=[
                      (sig[0], str(sig[1]), caps[i]) for i, sig in enumerate(arena_keys)])
    return b.finish(), arena_keys, slot_of


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


class _LazyValues:
  """A node's values after its flush: cut out of the arenas on first access."""

  __slots__ = ("node", "arenas", "slot_of", "_vals")

  def __init__(self, node, arenas, slot_of):
    self.node = node
    self.arenas = arenas
    self.slot_of = slot_of
    self._vals = None

  def __getitem__(self, i):
    if self._vals is None:
      keys = list(self.arenas)
      vals = []
      for v in self.node.outs:
        a, slot = self.slot_of[(self.node.id, v.index)]
        vals.append(_take_rows(self.arenas[keys[a]], [slot])[0])
      self._vals = vals
    return self._vals[i]


def _extract(graph: _Graph, outs: list) -> list:
  """Replaces every CellValue in ``outs`` by its array: one executable call per arena."""
  leaves, treedef = jax.tree_util.tree_flatten(outs, is_leaf=lambda x: isinstance(x, CellValue))
  want: dict[int, list[tuple[int, int]]] = defaultdict(list)  # id(arenas) -> (leaf i, slot)
  arenas_by: dict[int, tuple] = {}
  for i, x in enumerate(leaves):
    if isinstance(x, CellValue):
      lv = x.node.values
      if lv is None:
        raise AssertionError("extract before flush")
      a, slot = lv.slot_of[(x.node.id, x.index)]
      arena = list(lv.arenas.values())[a]
      want[id(arena)].append((i, slot))
      arenas_by[id(arena)] = arena
  for k, items in want.items():
    rows = _take_rows(arenas_by[k], [s for _, s in items])
    for (i, _), r in zip(items, rows, strict=True):
      leaves[i] = r
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
    key = tuple(a if type(a) in _SCALARS else id(a) for a in args)
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
    res = _extract(graph, outs)
    st = graph.stats
    for bmeta in st.batches:
      bmeta["record_s"] = record_s
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
