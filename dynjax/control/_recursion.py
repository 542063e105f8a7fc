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

Where each part lives: ``_cell.py`` (cells, placeholders, step executables), ``_kinds.py``
(argument kinds, arenas, uploads: what ``fold`` shares), ``_graph.py`` (recording and the
batching scheduler), here (``recursive``, batches, warm-up).
"""

from __future__ import annotations

import concurrent.futures
import functools
import gc
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dynjax._errors import ControlFlowError
from dynjax.control._cell import RECORDING, Cell, CellValue, cell, step_avals
from dynjax.control._frontend import any_tracer, needs_vm
from dynjax.control._graph import Graph, extract
from dynjax.runtime import VMStats
from dynjax.runtime._program import Op
from dynjax.runtime._vm import record

__all__ = ["Cell", "CellValue", "Recursive", "cell", "recursive", "warm_siblings"]


def with_batch(key, b: int):
  """A step key at another batch bucket: per-item data avals take the new leading size."""
  bsz, td, kinds, arenas, out_pos, avals, config = key
  new, di = [], 0
  for k in kinds:
    if k[0] in ("bcast", "item", "table"):
      shape, dtype = avals[di]
      new.append(((b, *shape[1:]), dtype) if k[0] == "item" else (shape, dtype))
      di += 1
  return (b, td, kinds, arenas, out_pos, tuple(new), config)


def warm_siblings(programs, spread=(4, 2), workers: int | None = None) -> dict:
  """Compiles the batch-bucket siblings of every step the programs invoked (see warmup)."""
  fams: dict = {}
  for prog in programs:
    for blk in prog.blocks:
      for ins in blk.instrs:
        if ins.op is not Op.INVOKE:
          continue
        cell = getattr(ins.kernel.build, "__self__", None)  # a cell's kernel builds its steps
        if not isinstance(cell, Cell):
          continue
        fam = (cell, with_batch(ins.key, 0))
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
      key = with_batch(key0, b)
      if not cell.kernel.has(key):
        todo.append((cell, key))
      nb = pol.bucket(b + 1)
      b = nb if nb is not None and nb > b else None
  n = 0
  if todo:
    workers = workers or min(8, os.cpu_count() or 1, len(todo))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      exes = list(pool.map(lambda ck: ck[0].build_step(ck[1]), todo))
    for (cell, key), exe in zip(todo, exes, strict=True):
      n += cell.kernel.add(key, exe)
      # The first run of an executable costs ~1.3 ms more than the next ones (XLA's one-time
      # set-up, measured on the 2-core CPU box): pay it here, on zeros, not in a real batch.
      jax.block_until_ready(exe(*[np.zeros(a.shape, a.dtype) for a in step_avals(key)]))
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
    if RECORDING.graph is not None:
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
                     "structure and batches its cells on the VM", leaves)
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
    res = warm_siblings(self.last_programs, spread, workers)
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
    if RECORDING.graph is not None:
      return [fn(*(it if isinstance(it, tuple) else (it,))) for it in items]
    graph = Graph(self.name, self._caps)
    graph.headroom = headroom
    RECORDING.graph = graph
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
        RECORDING.graph = None
      record_s = time.perf_counter() - t0
      graph.flush()
      res = extract(outs)
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
    record(st)
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
