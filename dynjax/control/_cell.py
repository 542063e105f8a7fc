"""``dynjax.cell``: a per-item JAX function whose calls the VM batches, and its placeholders.

Outside a recording a cell is ``jax.jit`` of its function (under a JAX trace, the function
itself).  While ``dynjax.recursive`` records (``RECORDING.graph`` is set on this thread), a call
adds a node to the graph and returns :class:`CellValue` placeholders.  A cell compiles one
*step* executable per group shape (:meth:`Cell.build_step`): gather from the arenas,
``vmap(cell)``, scatter back.  See ``_recursion.py`` for the whole picture.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dynjax._errors import ControlFlowError, format_list
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.control._frontend import any_tracer, building, is_tracer
from dynjax.control._kinds import take_rows
from dynjax.runtime import Kernel


class _Recording(threading.local):
  graph = None  # the _Graph recording on this thread (class default: every thread sees None)


RECORDING = _Recording()


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

  __slots__ = ("batch", "sig", "level", "slot", "cell", "index", "value")
  __array_priority__ = 100

  def __init__(self, batch, sig, level, slot, cell, index):
    self.batch = batch  # the Batch that records (then holds) it
    self.sig = sig  # the interned "node" Kind of (shape, dtype): also names its arena
    self.level = level
    self.slot = slot  # row in that arena
    self.cell = cell
    self.index = index  # which output leaf of the call
    self.value = None

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
    if self.value is None:
      b = self.batch
      if b.arenas is None:
        b.graph.flush()
      self.value = take_rows(b.arenas[b.arena_ix[self.sig]], [self.slot])[0]
    return self.value

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
    self.kernel = Kernel(f"{self.name}.step", self.build_step, describe_step)
    functools.update_wrapper(self, fn)

  def __call__(self, *args):
    graph = RECORDING.graph
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

  def signature(self, treedef, sigs):
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
  def build_step(self, key):
    """The compiled step of one group shape (AOT: ``key`` fixes every argument's shape).

    Compiled ahead of time rather than by the first call, so :meth:`Recursive.warmup` can
    compile a whole family of batch buckets concurrently without running them; calling a
    ``Compiled`` costs the same as a jitted call (~8 vs ~10 us on the 2-core CPU box).
    """
    (batch, treedef, kinds, arena_sigs, out_arenas, data_avals, config) = key
    # kinds: per flat arg leaf: ("node", arena_pos, ids_row) / ("hostid", ids_row) (int32
    # scalars ride in the ids array: one transfer per group) / ("hostcast", ids_row, dtype)
    # (bools, and ints that fit in int32, such as Python ints under x64: cast back here) /
    # ("item",) (stacked per item) /
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
        elif tag == "hostcast":  # k = ("hostcast", ids_row, dtype name)
          leaves.append(ids[k[1]].astype(k[2]))
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

      # axis_size: a group whose every argument is shared (one call of a one-leaf tree, a
      # sync right after one call, every leaf reading one W) has no batched input; vmap then
      # computes the cell once and broadcasts its results to the batch.
      outs = jax.vmap(per_item, in_axes=tuple(axes), axis_size=batch)(*leaves)
      by_pos: dict[int, list] = defaultdict(list)
      for (pos, _), out in zip(out_arenas, outs, strict=True):
        by_pos[pos].append(out.astype(arenas[pos].dtype))
      for pos, vals in by_pos.items():
        idx = rows_of(ids, writes[pos]).reshape(-1)
        arenas[pos] = arenas[pos].at[idx].set(jnp.concatenate(vals), mode="drop")
      return tuple(arenas)

    avals = step_avals(key)
    # The key's jax config (matmul precision, ...) is the caller's; warm-up compiles in worker
    # threads, where thread-local contexts such as default_matmul_precision do not reach.
    prec = ast.literal_eval(dict(config).get("jax_default_matmul_precision", "None"))
    with jax.default_matmul_precision(prec) if prec is not None else contextlib.nullcontext():
      return jax.jit(step, donate_argnums=tuple(range(n_arenas))).lower(*avals).compile()

  def __repr__(self) -> str:
    return f"dynjax.cell({self.name})"


def step_avals(key) -> list:
  """Every argument's aval of a step executable: arenas, the ids array, data."""
  batch, _, kinds, arena_sigs, out_arenas, data_avals, _ = key
  n_rows = 1 + max([k[-1] for k in kinds if k[0] in ("node", "hostid")]
                   + [k[1] for k in kinds if k[0] in ("table", "hostcast")]
                   + [r for _, r in out_arenas])
  avals = [jax.ShapeDtypeStruct((cap, *shape), dtype) for (shape, dtype), cap in arena_sigs]
  avals.append(jax.ShapeDtypeStruct((n_rows, batch), np.int32))
  avals.extend(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in data_avals)
  return avals


def describe_step(key) -> str:
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


