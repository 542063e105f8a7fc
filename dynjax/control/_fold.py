"""``dynjax.control.fold``: batched recursion over array-held structures, no Python per node.

:func:`dynjax.recursive` runs the user's Python once per node to *discover* the dataflow
(~1.5-2 us per node on a 2-core CPU, most of it Python's own call overhead).  When the
structure already lives in arrays -- child indices per node, as in the first-child /
next-sibling form of a tree -- the same schedule can be computed with numpy for a whole
minibatch at once, ahead of running anything (Cortex's ahead-of-time linearisation; TF Fold's
loom batches by depth the same way):

1. **Linearise.**  Each structure's child-index array is offset into one forest; a node's
   *level* is 1 + the highest level of its children (leaves: 1) -- computed frontier by
   frontier, one handful of numpy calls per level, not per node.  Nodes are stable-sorted by
   (level, arity): each run of equal keys is a *group*, and a node's rank in that order is its
   row in the output arenas.
2. **Build and run.**  Exactly as a :func:`recursive` batch: one ``invoke`` of the arity's
   cell per group (``vmap`` over a pow2 bucket, gathers from and scatters to the arenas), the
   same step executables (shared with ``recursive`` when the argument kinds agree), one
   ``device_put`` per shared numpy leaf per batch, no host sync until the results.

The cell for a node with ``k`` children is ``cells[k]``, called as
``cells[k](*shared, *inputs_row, *child_1, ..., *child_k)``: the shared arguments (params),
the node's rows of the per-node inputs, then each child's result -- unpacked when it is a tuple,
as ``two(p, tok, *enc(left), *enc(right))`` does in the decorator form, so the same cells serve
both.  Every cell must return the same structure (a child's result feeds a parent of any arity).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from dynjax._errors import ControlFlowError, format_list
from dynjax._jax_private import lowering_config
from dynjax.control._cell import Cell
from dynjax.control._frontend import any_tracer, needs_vm
from dynjax.control._kinds import (
  LEAF_TD,
  Uploads,
  arena_cap,
  avals_of,
  canonical,
  intern_kind,
  leaf_kind,
  rides_in_ids,
  scalar_kinds,
  take_rows,
)
from dynjax.control._recursion import warm_siblings
from dynjax.runtime import VM, ProgramBuilder, VMStats
from dynjax.runtime._vm import record as _record_stats

_I32 = np.dtype(np.int32)


class Fold:
  """A batched bottom-up recursion over array-held structures (see :func:`fold`)."""

  def __init__(self, cells, children: Callable, inputs: Callable | None = None,
               root: int | Callable = 0, name: str | None = None):
    if isinstance(cells, Mapping):
      self.cells = {int(k): c for k, c in cells.items()}
    elif isinstance(cells, Sequence):
      self.cells = dict(enumerate(cells))
    else:
      raise ControlFlowError(
          f"fold: cells must be a sequence (cells[k] for a node with k children) or a dict "
          f"{{arity: cell}}; got {type(cells).__name__}")
    bad = [f"arity {k}: {type(c).__name__} {c!r}" for k, c in self.cells.items()
           if not isinstance(c, Cell)]
    if bad:
      raise ControlFlowError(
          "fold: every cell must be a dynjax.cell; got:\n" + format_list(bad)
          + "\nWrap the functions with @dynjax.cell.")
    self.children = children
    self.inputs = inputs
    self.root = root
    self.name = name or "fold(" + ",".join(c.name for c in self.cells.values()) + ")"
    self._caps: dict = {}
    self._sigs: dict = {}
    self.last_stats: VMStats | None = None
    self.last_programs: list = []

  def __call__(self, structure, *shared):
    return self.batch([structure], *shared)[0]

  def __repr__(self) -> str:
    return f"dynjax.control.fold({self.name})"

  # -- linearisation ---------------------------------------------------------------------
  def _forest(self, structures: Sequence):
    """Children matrix [N, K] (global indices, compacted left), inputs [N, ...], offsets."""
    cols: list[list] = []  # per structure: its child columns (k arrays [n]) ...
    mats: list = []  # ... or its [n, k] matrix
    ins, sizes = [], []
    children, inputs = self.children, self.inputs
    for i, s in enumerate(structures):
      c = children(s)
      if type(c) is tuple and c and all(type(v) is np.ndarray and v.ndim == 1 for v in c):
        n = c[0].shape[0]  # the fast form, e.g. (first_child, next_sibling): no per-tree stack
        if any(v.shape[0] != n for v in c):
          _child_matrix(c, i)  # raises with the shapes
        cols.append(c)
        mats.append(None)
      else:
        m = _child_matrix(c, i)
        n = m.shape[0]
        cols.append(None)
        mats.append(m)
      if n == 0:
        raise ControlFlowError(f"fold: structure {i} has no nodes (its children array has 0 "
                               "rows); a structure needs at least its root node.")
      x = () if inputs is None else inputs(s)
      x = (x,) if isinstance(x, np.ndarray | jax.Array) else tuple(x)
      if not all(type(v) is np.ndarray for v in x):
        x = tuple(np.asarray(v) for v in x)
      for v in x:
        if v.ndim == 0 or v.shape[0] != n:
          wrong = [f"inputs[{j}] has {v.shape[0] if v.ndim else 'no'} rows"
                   for j, v in enumerate(x) if v.ndim == 0 or v.shape[0] != n]
          raise ControlFlowError(
              f"fold: structure {i} has {n} nodes (rows of its children array) but:\n"
              + format_list(wrong) + "\ninputs(structure) must return arrays with one row "
              "per node.")
      ins.append(x)
      sizes.append(n)
    if not sizes:
      raise ControlFlowError("fold: batch() needs at least one structure")
    nin = {len(x) for x in ins}
    if len(nin) > 1:
      raise ControlFlowError(f"fold: inputs(structure) returned {sorted(nin)} arrays for "
                             "different structures; it must return the same number for all.")
    k = max(len(c) if m is None else m.shape[1] for c, m in zip(cols, mats, strict=True))
    sizes_a = np.asarray(sizes, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes_a)[:-1]])
    if all(m is None and len(c) == k for c, m in zip(cols, mats, strict=True)):
      local = np.stack([np.concatenate([c[j] for c in cols]) for j in range(k)], 1)
      local = local.astype(np.int64, copy=False)
    else:
      parts = []
      for c, m in zip(cols, mats, strict=True):
        m = np.stack(c, 1).astype(np.int64) if m is None else m
        if m.shape[1] < k:
          m = np.pad(m, ((0, 0), (0, k - m.shape[1])), constant_values=-1)
        parts.append(m)
      local = np.concatenate(parts, 0) if k else np.zeros((int(sizes_a.sum()), 0), np.int64)
    if not np.issubdtype(local.dtype, np.integer):
      raise ControlFlowError(
          f"fold: children(structure) gave {local.dtype} child indices; they must be "
          "integers (child index or -1).")
    n_row = np.repeat(sizes_a, sizes_a)
    bad = (local < -1) | (local >= n_row[:, None])
    if bad.any():
      rows, cc = np.nonzero(bad)
      owner = np.searchsorted(offsets, rows, side="right") - 1
      lines = [f"structure {o} node {r - offsets[o]}: child {local[r, c]} (it has "
               f"{sizes[o]} nodes)" for o, r, c in zip(owner[:8], rows[:8], cc[:8],
                                                       strict=True)]
      more = f"\n  ... and {len(rows) - 8} more" if len(rows) > 8 else ""
      raise ControlFlowError("fold: child indices out of range:\n" + format_list(lines) + more
                             + "\nA child index is a node of the same structure, or -1 for "
                             "none.")
    valid = local >= 0
    glob = np.where(valid, local + np.repeat(offsets, sizes_a)[:, None], -1)
    if k > 1 and (~valid[:, :-1] & valid[:, 1:]).any():  # a gap before a child: compact left
      order = np.argsort(~valid, axis=1, kind="stable")
      glob = np.take_along_axis(glob, order, 1)
      valid = glob >= 0
    inputs = tuple(np.concatenate([x[j] for x in ins], 0) for j in range(nin.pop()))
    return glob, valid.sum(1), inputs, offsets, sizes_a

  def schedule(self, structures: Sequence) -> dict:
    """The linearisation of ``structures`` (levels, groups), without running anything."""
    glob, arity, inputs, offsets, sizes = self._forest(structures)
    level = _levels(glob, arity, offsets, sizes)
    n_ar = int(arity.max()) + 1 if arity.size else 1
    key = level.astype(np.int64) * n_ar + arity
    order = np.argsort(key, kind="stable")
    sk = key[order]
    cut = np.flatnonzero(np.diff(sk)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(sk)]])
    pos = np.empty_like(order)
    pos[order] = np.arange(len(order))
    return {"children": glob, "arity": arity, "level": level, "inputs": inputs,
            "offsets": offsets, "sizes": sizes, "order": order, "pos": pos,
            "groups": [(int(sk[s] // n_ar), int(sk[s] % n_ar), int(s), int(e))
                       for s, e in zip(starts, ends, strict=True)]}

  # -- signatures ------------------------------------------------------------------------
  def _node_signature(self, shared_kinds, input_kinds, arities):
    """Out (treedef, sigs) of every node; checks that all cells agree on it."""
    key = (shared_kinds, input_kinds, tuple(arities))
    hit = self._sigs.get(key)
    if hit is not None:
      return hit
    missing = [k for k in arities if k not in self.cells]
    if missing:
      raise ControlFlowError(
          f"fold: the structures have nodes with {missing} children but no cell for "
          f"{'that arity' if len(missing) == 1 else 'those arities'}; cells are given for "
          f"arities {sorted(self.cells)}. Pass cells[k] for every k, or binarize the "
          "structure (first-child / next-sibling).")
    base = [(k.td, k.flat) for k in shared_kinds] + [(LEAF_TD, k.flat) for k in input_kinds]
    leaf = self.cells[0] if 0 in self.cells else None
    if leaf is None:
      raise ControlFlowError("fold: no cell for arity 0 (leaves); every structure has leaves.")
    out_tree, out_sigs = leaf.signature(*_args_sig(base, []))
    child = _child_args(out_tree, out_sigs)
    bad = []
    for k in arities:
      if k == 0:
        continue
      c = self.cells[k]
      t, s = c.signature(*_args_sig(base, child * k))
      if t != out_tree or [x[:2] for x in s] != [x[:2] for x in out_sigs]:
        bad.append(f"cells[{k}] ({c.name}) returns {_show(t, s)}")
    if bad:
      raise ControlFlowError(
          f"fold: every cell must return the same structure as cells[0] ({leaf.name}: "
          f"{_show(out_tree, out_sigs)}), since a child's result feeds a parent of any "
          "arity; but:\n" + format_list(bad))
    hit = self._sigs[key] = (out_tree, out_sigs, child)
    return hit

  # -- running ---------------------------------------------------------------------------
  def warmup(self, structures: Sequence, *shared, headroom: float = 2.0,
             spread: tuple = (4, 2), workers: int | None = None) -> dict:
    """Runs one batch, then compiles ahead what later batches like it need.

    As :meth:`dynjax.control.Recursive.warmup`: arenas sized for ``headroom`` times this
    batch's nodes, and every batch bucket from 1/``spread[0]`` of each cell's smallest group
    to ``spread[1]`` times its largest compiled concurrently.
    """
    t0 = time.perf_counter()
    self._run(structures, shared, headroom)
    res = warm_siblings(self.last_programs, spread, workers)
    gc.collect()  # compiling left much garbage: collect it now, not in the first real batch
    self._run(structures, shared, headroom)  # and touch the memory the collection gave back
    res["seconds"] = round(time.perf_counter() - t0, 3)
    res["caps"] = sorted((str(k[1]), list(k[0]), c) for k, c in self._caps.items())
    return res

  def batch(self, structures: Sequence, *shared) -> list:
    """Runs every structure's recursion together; returns each root's result, in order.

    Args:
      structures: objects the ``children`` (and ``inputs``) accessors understand.
      *shared: arguments passed first to every cell call (params): flattened once per
        batch, numpy leaves put on the device once per batch, broadcast to every group.

    Example:
      >>> enc.batch(trees, params)  # doctest: +SKIP
      [(Array(...), Array(...)), ...]
    """
    return self._run(structures, shared, 1.0)

  def _run(self, structures: Sequence, shared: tuple, headroom: float) -> list:
    if not isinstance(structures, list | tuple):
      raise ControlFlowError(
          f"{self.name}.batch expects a list of structures, got {type(structures).__name__}")
    leaves = jax.tree_util.tree_leaves(shared)
    if any_tracer(leaves):
      raise needs_vm("control.fold", f"{self.name} was called with JAX tracers; it runs a "
                     "schedule of batched cell calls on the VM", leaves)
    if not structures:  # an empty minibatch (as recursive.batch([]))
      return []
    t0 = time.perf_counter()
    sch = self.schedule(structures)
    t1 = time.perf_counter()
    scalars = scalar_kinds()
    shared_kinds, shared_vals = [], []
    for a in shared:
      leaves, td = jax.tree_util.tree_flatten(a)
      kv = [leaf_kind(x, self.name, scalars) for x in leaves]
      shared_kinds.append(intern_kind("obj", extra=(td, tuple(k for k, _ in kv))))
      shared_vals.append([v for _, v in kv])
    input_kinds = tuple(intern_kind("host", x.shape[1:], canonical(x.dtype)) for x in sch["inputs"])
    arities = sorted({a for _, a, _, _ in sch["groups"]})
    out_tree, out_sigs, child = self._node_signature(tuple(shared_kinds), input_kinds,
                                                     arities)
    prog, arenas_of, roots = self._build(sch, shared_kinds, shared_vals, input_kinds,
                                         out_sigs, child, structures, headroom)
    t2 = time.perf_counter()
    vm = VM(prog)
    arenas = vm.run()
    res = self._roots(arenas, arenas_of, roots, out_tree)
    t3 = time.perf_counter()
    st = vm.take_stats()
    prog.meta.update(linearize_s=t1 - t0, build_s=t2 - t1, run_s=t3 - t2)
    st.batches.append(dict(prog.meta))
    self.last_stats = st
    self.last_programs = [prog]
    _record_stats(st)
    return res

  def _build(self, sch, shared_kinds, shared_vals, input_kinds, out_sigs, child, structures,
             headroom):
    # Arenas: one per output (shape, dtype); a node's m_A outputs in arena A sit at rows
    # pos * m_A + r (pos = its rank in the (level, arity) order).
    arena_ix: dict = {}
    arena_sigs: list = []
    where = []  # per output leaf: (arena, rank r within it)
    for shape, dtype, _ in out_sigs:
      sig = intern_kind("node", shape, dtype)
      a = arena_ix.get(sig)
      if a is None:
        a = arena_ix[sig] = len(arena_sigs)
        arena_sigs.append(sig)
      where.append((a, sum(1 for b, _ in where if b == a)))
    per = [sum(1 for b, _ in where if b == a) for a in range(len(arena_sigs))]
    n = len(sch["order"])
    caps = []
    for a, sig in enumerate(arena_sigs):
      k = (sig.shape, sig.dtype)
      cap = self._caps[k] = max(self._caps.get(k, 0), arena_cap(int(n * per[a] * headroom)))
      caps.append(cap)
    order, children, inputs = sch["order"], sch["children"], sch["inputs"]
    order = order.astype(np.int64, copy=False)
    upload = Uploads()
    shared_data = [[v if lk.kind == "dev" else upload(v, lk.dtype)
                    for lk, v in zip(k.leaves, vals, strict=True)]
                   for k, vals in zip(shared_kinds, shared_vals, strict=True)]
    pb = ProgramBuilder(f"{self.name}.batch", num_args=0)
    arena_regs = [pb.emit_alloc_tensor((caps[i], *sig.shape), sig.dtype)
                  for i, sig in enumerate(arena_sigs)]
    shared_flat = [v for vals in shared_data for v in vals]
    shared_regs = [pb.emit_const(v) for v in shared_flat]
    shared_avals = avals_of(shared_flat)
    # Every node's index rows at once, in (level, arity) order: hostid inputs, then each child
    # position's output slots; and the node's own output slots.  A group of arity k takes the
    # first n_h + k*m rows of its column range plus its output rows (slices, padded to the
    # bucket): vectorised, so a group costs ~10 us of host time whatever its size.  The row
    # layout is the one recursive() builds, so both front ends share step executables.
    m = len(where)
    host_ix = [j for j, ik in enumerate(input_kinds) if ik.shape == ()
               and (ik.dtype == _I32 or rides_in_ids(ik.dtype, inputs[j]))]
    n_h = len(host_ix)
    k_max = children.shape[1]
    rows = np.empty((n_h + m * k_max, n), np.int32)
    for j, ix in enumerate(host_ix):
      rows[j] = inputs[ix][order]
    if k_max:
      kids = children[order]
      kid_pos = sch["pos"][np.where(kids >= 0, kids, 0)]
      for c in range(k_max):
        for i, (a, r) in enumerate(where):
          rows[n_h + m * c + i] = kid_pos[:, c] * per[a] + r
    own = np.arange(n, dtype=np.int64)
    out_rows = np.stack([own * per[a] + r for a, r in where]).astype(np.int32)
    items = {j: inputs[j][order] for j in range(len(input_kinds)) if j not in host_ix}
    out_caps = np.asarray([caps[a] for a, _ in where], np.int32)[:, None]
    layout: dict = {}
    config = lowering_config()  # part of every key: precision etc. change the executable
    hist: dict[int, int] = defaultdict(int)
    arena_key = tuple(((sig.shape, sig.dtype), caps[a]) for a, sig in enumerate(arena_sigs))
    for _, k, s, e in sch["groups"]:
      cell = self.cells[k]
      cnt = e - s
      bsz = cell.batch_policy.bucket(cnt)
      bsz = cell.batch_policy.grow(cnt) if bsz is None else bsz
      hist[bsz] += 1
      lay = layout.get(k)
      if lay is None:
        lay = layout[k] = self._layout(k, shared_kinds, input_kinds, host_ix, where, child)
      td, step_kinds, out_pos = lay
      n_in = n_h + m * k
      ids = np.empty((n_in + m, bsz), np.int32)
      ids[:n_in, :cnt] = rows[:n_in, s:e]
      ids[n_in:, :cnt] = out_rows[:, s:e]
      if bsz > cnt:  # dummy items repeat item 0; their outputs go past the arena (dropped)
        ids[:n_in, cnt:] = rows[:n_in, s:s + 1]
        ids[n_in:, cnt:] = out_caps
      data = []
      for j in items:
        v = items[j][s:e]
        if bsz > cnt:
          v = np.concatenate([v, np.repeat(v[:1], bsz - cnt, 0)])
        data.append(v if v.dtype == input_kinds[j].dtype else v.astype(input_kinds[j].dtype))
      key = (bsz, td, step_kinds, arena_key, out_pos, shared_avals + avals_of(data), config)
      ids_reg = pb.emit_const(ids)
      data_regs = [pb.emit_const(d) for d in data]
      pb.emit_invoke_into(cell.kernel, key, [*arena_regs, ids_reg, *shared_regs, *data_regs],
                          arena_regs)
    pb.emit_ret(arena_regs)
    roots = self._root_nodes(structures, sch)
    pb.meta.update(nodes=n, levels=int(sch["level"].max()), groups=len(sch["groups"]),
                   batch_buckets=dict(hist), uploads=len(upload.done),
                   arenas=[(sig.shape, str(sig.dtype), caps[i])
                           for i, sig in enumerate(arena_sigs)])
    return pb.finish(), (where, per), sch["pos"][roots]

  def _layout(self, k, shared_kinds, input_kinds, host_ix, where, child):
    """(treedef, step kinds, output rows) of an arity-k call; see the rows in ``_build``."""
    td = jax.tree_util.treedef_tuple(
        [sk.td for sk in shared_kinds] + [LEAF_TD] * len(input_kinds)
        + [ctd for _ in range(k) for ctd, _ in child])
    n_h, m = len(host_ix), len(where)
    kinds: list[tuple] = [("bcast",)] * sum(len(sk.leaves) for sk in shared_kinds)
    for j in range(len(input_kinds)):
      if j not in host_ix:
        kinds.append(("item",))
      elif input_kinds[j].dtype == _I32:
        kinds.append(("hostid", host_ix.index(j)))
      else:  # bools, and ints that fit in int32 (int64 under x64): cast back in the step
        kinds.append(("hostcast", host_ix.index(j), input_kinds[j].dtype.name))
    for c in range(k):
      for i, (a, _) in enumerate(where):
        kinds.append(("node", a, n_h + m * c + i))
    out_pos = tuple((a, n_h + m * k + i) for i, (a, _) in enumerate(where))
    return td, tuple(kinds), out_pos

  def _root_nodes(self, structures, sch) -> np.ndarray:
    offsets, sizes = sch["offsets"], sch["sizes"]
    if callable(self.root):
      local = np.asarray([int(self.root(s)) for s in structures], np.int64)
    else:
      local = np.full(len(structures), int(self.root), np.int64)
    bad = [f"structure {i}: root {r} (it has {n} nodes)"
           for i, (r, n) in enumerate(zip(local, sizes, strict=True)) if not 0 <= r < n]
    if bad:
      raise ControlFlowError("fold: root index out of range:\n" + format_list(bad[:8]))
    return offsets + local

  def _roots(self, arenas, arenas_of, root_pos, out_tree) -> list:
    where, per = arenas_of
    by_arena: dict[int, list] = defaultdict(list)
    for i, (a, _) in enumerate(where):
      by_arena[a].append(i)
    leaves: list[list] = [[None] * len(where) for _ in root_pos]
    for a, outs in by_arena.items():
      slots = [int(p) * per[a] + where[i][1] for p in root_pos for i in outs]
      rows = take_rows(arenas[a], slots)
      j = 0
      for t in range(len(root_pos)):
        for i in outs:
          leaves[t][i] = rows[j]
          j += 1
    return [jax.tree_util.tree_unflatten(out_tree, lv) for lv in leaves]


def _args_sig(base, child_args):
  """(treedef, flat sigs) of a call: base (shared + inputs) then child argument trees."""
  parts = base + child_args
  td = jax.tree_util.treedef_tuple([t for t, _ in parts])
  return td, tuple(s for _, f in parts for s in f)


def _child_args(out_tree, out_sigs) -> list:
  """A child's result as cell arguments: unpacked when it is a tuple (``*enc(child)``)."""
  flat = [("node", s[0], s[1]) for s in out_sigs]
  nd = out_tree.node_data()
  if nd is not None and nd[0] is tuple:
    args, i = [], 0
    for sub in out_tree.children():
      args.append((sub, tuple(flat[i:i + sub.num_leaves])))
      i += sub.num_leaves
    return args
  return [(out_tree, tuple(flat))]


def _show(td, sigs) -> str:
  leaves = [f"{np.dtype(d).name}{list(s)}" for s, d, _ in sigs]
  return str(jax.tree_util.tree_unflatten(td, leaves)).replace("'", "")


def _child_matrix(c, i: int) -> np.ndarray:
  """children(structure) as an int64 [n, K] matrix (see :func:`fold` for the accepted forms)."""
  if isinstance(c, np.ndarray | jax.Array):
    m = np.asarray(c)
    if m.ndim == 1:
      m = m[:, None]
  elif isinstance(c, list | tuple) and c and all(isinstance(v, np.ndarray) for v in c):
    cols = [np.asarray(v) for v in c]
    if len({v.shape for v in cols}) != 1 or cols[0].ndim != 1:
      raise ControlFlowError(
          f"fold: children(structure {i}) returned {len(cols)} arrays of shapes "
          f"{[v.shape for v in cols]}; give k arrays of shape [n] (child index or -1).")
    m = np.stack(cols, 1)
  elif isinstance(c, list | tuple):  # child lists per node (e.g. Tree.children): Python
    try:
      k = max((len(v) for v in c), default=0)
      m = np.full((len(c), k), -1, np.int64)
      for j, v in enumerate(c):
        m[j, :len(v)] = v
    except TypeError:
      raise ControlFlowError(
          f"fold: children(structure {i}) must return an int array [n, k], a sequence of k "
          "int arrays [n] (e.g. (first_child, next_sibling)), or n child-index lists; got "
          f"{type(c).__name__} of {type(c[0]).__name__}.") from None
  else:
    raise ControlFlowError(
        f"fold: children(structure {i}) must return an int array [n, k], a sequence of k int "
        "arrays [n] (e.g. (first_child, next_sibling)), or n child-index lists; got "
        f"{type(c).__name__}.")
  if m.ndim != 2 or not np.issubdtype(m.dtype, np.integer):
    raise ControlFlowError(
        f"fold: children(structure {i}) gave a {m.dtype} array of shape {m.shape}; it must be "
        "integer [n, k] (child index or -1).")
  return m.astype(np.int64, copy=False)


def _distinct(p: np.ndarray) -> np.ndarray:
  # np.unique costs ~15 us a call here (hash-based in numpy 2); a sort and a mask ~3 us.
  if p.size < 2:
    return p
  p = np.sort(p)
  return p[np.concatenate(([True], p[1:] != p[:-1]))]


def _levels(glob: np.ndarray, arity: np.ndarray, offsets, sizes) -> np.ndarray:
  """1 + the highest child level (leaves: 1), frontier by frontier: O(levels) numpy calls.

  Measured on the 2-core CPU box: ~8-12 us per level for a forest of ~2,700 nodes (64 ASTs,
  ~25 levels): ~0.25 ms per batch, against ~1.7 us per node (~4.6 ms) that the recording of
  :func:`recursive` spends discovering the same schedule.
  """
  n = len(arity)
  valid = glob >= 0
  par_rows, par_cols = np.nonzero(valid)
  kids = glob[par_rows, par_cols]
  n_par = np.bincount(kids, minlength=n)
  pending = arity.astype(np.int64).copy()
  level = np.zeros(n, np.int32)
  frontier = np.flatnonzero(pending == 0)
  done = 0
  lvl = 0
  if n_par.max(initial=0) <= 1:  # a forest of trees: one parent per node
    parent = np.full(n, -1, np.int64)
    parent[kids] = par_rows
    while frontier.size:
      lvl += 1
      level[frontier] = lvl
      done += frontier.size
      p = parent[frontier]
      p = p[p >= 0]
      np.subtract.at(pending, p, 1)
      frontier = _distinct(p[pending[p] == 0])
  else:  # a DAG: parents of a node by CSR over the sorted child column
    by_kid = np.argsort(kids, kind="stable")
    parents = par_rows[by_kid]
    start = np.concatenate([[0], np.cumsum(n_par)])
    while frontier.size:
      lvl += 1
      level[frontier] = lvl
      done += frontier.size
      cnt = n_par[frontier]
      first = np.repeat(start[frontier] - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
      p = parents[first + np.arange(cnt.sum())]
      np.subtract.at(pending, p, 1)
      frontier = _distinct(p[pending[p] == 0])
  if done < n:
    stuck = np.flatnonzero(level == 0)
    owner = np.searchsorted(offsets, stuck, side="right") - 1
    lines = [f"structure {o}: nodes {(stuck[owner == o] - offsets[o])[:10].tolist()}"
             for o in np.unique(owner)[:8].tolist()]
    raise ControlFlowError(
        "fold: the structures have a cycle (these nodes are on it or depend on it through "
        "their children):\n" + format_list(lines) + "\nfold runs trees and DAGs (acyclic).")
  return level


def fold(cells, *, children: Callable, inputs: Callable | None = None,
         root: int | Callable = 0, name: str | None = None) -> Fold:
  """A bottom-up recursion over array-held structures, batched without Python per node.

  The vectorised twin of :func:`dynjax.recursive` for structures whose children are given
  by index arrays (see the module docstring): the schedule of a whole minibatch is computed
  with numpy, then runs as one :class:`~dynjax.runtime.Program` of batched cell calls.

  Args:
    cells: ``cells[k]`` is the :func:`dynjax.cell` for a node with ``k`` children (a list,
      or a dict ``{k: cell}``).  Called as ``cells[k](*shared, *inputs_row, *child_1, ...)``
      (a child's tuple result is unpacked); all must return the same structure.
    children: ``children(structure)`` -> an int array ``[n, k]`` of child indices (-1 = none;
      node ``i``'s children are its non-negative entries in order), a sequence of ``k`` int
      arrays ``[n]`` (e.g. ``(tree.first_child, tree.next_sibling)``), or ``n`` child-index
      lists (converted in Python: slower).  Trees and DAGs (a shared child runs once).
    inputs: ``inputs(structure)`` -> an array or a tuple of arrays with one row per node
      (e.g. ``tree.types``); int32 scalars per node ride in the index array (as do bools and
      other ints whose values fit in int32, such as int64 under x64), other rows are stacked
      per group.  ``None``: no per-node inputs.
    root: the node whose result is returned (an index, or ``root(structure) -> index``).
    name: shown in programs and errors.

  Returns:
    A :class:`Fold`: ``f(structure, *shared)`` or ``f.batch(structures, *shared)``.

  Example:
    >>> enc = dynjax.control.fold(
    ...     [leaf, one, two],  # cells by arity, as written for dynjax.recursive
    ...     children=lambda t: (t.first_child, t.next_sibling), inputs=lambda t: t.types)
    >>> hs = enc.batch(trees, params)  # doctest: +SKIP
  """
  return Fold(cells, children, inputs=inputs, root=root, name=name)

