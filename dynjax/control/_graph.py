"""The dataflow graph of one ``dynjax.recursive`` batch: recording, scheduling, the program.

Recording (:meth:`Graph.add`, the hot path) groups calls by (cell, argument kinds, level);
the flush (:meth:`Graph.flush`) turns every group into one ``invoke`` of its cell's step
executable (int32 index arrays, host stacks, broadcasts) in ONE straight-line program the VM
runs without a host sync.  See ``_recursion.py`` for the whole picture.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import numpy as np

from dynjax._errors import ControlFlowError, format_list
from dynjax._jax_private import lowering_config
from dynjax.control._cell import Cell, CellValue
from dynjax.control._frontend import is_tracer
from dynjax.control._kinds import (
  ARRAY_TYPES,
  I32,
  LEAF_TD,
  SLOT,
  TUPLE_TD,
  Kind,
  Uploads,
  arena_cap,
  bare_kinds,
  data_column,
  intern_kind,
  is_frozen_tuple,
  leaf_kind,
  pad_rows,
  rides_in_ids,
  scalar_kinds,
  take_rows,
)
from dynjax.runtime import VM, ProgramBuilder, VMStats


class Entry:
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


class Group:
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
    out_tree, out_sigs = cell.signature(self.treedef, flat)
    self.out_tree = out_tree
    self.sigs = tuple(intern_kind("node", shape, dtype) for shape, dtype, _ in out_sigs)
    self.out_info = [(graph.arena_of(sig), sig) for sig in self.sigs]
    arenas = {a for a, _ in self.out_info}
    self.arena = self.out_info[0][0] if len(arenas) == 1 else None
    self.calls: list = []
    self.base: list[int] = []
    self.outs: list[list[int]] = [[] for _ in out_sigs]
    n_out = len(out_sigs)
    if self.arena is None or n_out > 2:
      self.mode = 0  # generic (see Graph._outputs)
    elif out_tree == LEAF_TD:
      self.mode = 1
    elif n_out == 2 and out_tree == TUPLE_TD[2]:
      self.mode = 2
    else:
      self.mode = 0

  def out_rows(self) -> list:
    """Per output leaf, the arena slot of every call."""
    if self.arena is None:
      return self.outs
    base = np.asarray(self.base, np.int32)
    return [base + i for i in range(len(self.out_info))]


class Batch:
  """One flush worth of recorded calls; ``arenas`` is set once it ran."""

  __slots__ = ("graph", "groups", "arena_sigs", "arena_ix", "counts", "arenas")

  def __init__(self, graph):
    self.graph = graph
    self.groups: dict = {}
    self.arena_sigs: list = []
    self.arena_ix: dict = {}
    self.counts: list[int] = []
    self.arenas = None


class Graph:
  """The dataflow graph of one ``batch`` call: recorded calls, run by :meth:`flush`.

  Recording is the hot path (one :meth:`add` per cell call of the user's recursion); the
  flush turns each group's columns into int32 index arrays, host stacks and broadcasts.
  """

  def __init__(self, name: str, caps: dict | None = None):
    self.name = name
    self.caps = {} if caps is None else caps  # sticky arena capacities, per signature
    self.headroom = 1.0  # warmup(): arenas sized for this many times the batch's results
    self.cur = Batch(self)
    self.stats = VMStats()
    self.programs: list = []
    self.seen: dict[int, Entry] = {}  # id(arg object) -> entry; holds the object alive
    self.scalars = scalar_kinds()
    self.bare = bare_kinds()
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
    ``benchmarks/treelstm.py``, up to 6 arguments): ~0.8-1 us per call, of ~1.7-1.9 us per
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
        if t in ARRAY_TYPES:  # a bare array (e.g. a per-node input row): known by its kind
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
      g = cur.groups[key] = Group(key, cell, level, self)
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

  def _outputs(self, g: Group, cur: Batch, level: int):
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
    if len(res) < len(TUPLE_TD) and g.out_tree == TUPLE_TD[len(res)]:
      return tuple(res)
    return jax.tree_util.tree_unflatten(g.out_tree, res)

  def _bare_kind(self, a, t, cell: Cell) -> Kind:
    lk, _ = leaf_kind(a, cell.name, self.scalars)
    k = self.bare[(t, a.shape, a.dtype)] = intern_kind("obj", extra=(LEAF_TD, (lk,)))
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

  def _classify(self, a, cell: Cell) -> Entry:
    """Flattens an argument seen for the first time in this batch and registers it by id."""
    cur = self.cur
    if type(a) is CellValue:  # a result of an earlier flush (materialised by the user)
      leaves, td = [a], LEAF_TD
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
    if td == LEAF_TD and isinstance(a, jax.Array) and not is_tracer(a):
      ARRAY_TYPES.add(type(a))  # later bare jax arrays take the fast path of add()
    kind = intern_kind("mixed" if nodes else "obj", extra=(td, tuple(kinds)))
    raw = None if td == LEAF_TD else leaves
    e = Entry(kind, a, vals, level, raw, cell.name)
    if nodes and not is_frozen_tuple(a, leaves, td):
      e.obj, e.raw = e, None  # a list/dict of pending results: the entry is the snapshot
    self.seen[id(e.obj)] = e
    return e

  def _leaf_kind(self, x, cell: Cell):
    return leaf_kind(x, cell.name, self.scalars)

  # -- running -------------------------------------------------------------------------------
  def flush(self) -> None:
    """Runs every pending call: one Program (levels in order), run on the VM."""
    b = self.cur
    seen = self.seen
    self.cur = Batch(self)
    self.seen = {}  # arguments are known by identity within one batch only
    if not b.groups:
      b.arenas = []
      return
    check_unchanged(seen, self.name)
    prog = self._build(b, seen)
    vm = VM(prog)
    arenas = vm.run()
    st = vm.take_stats()
    st.batches.append(dict(prog.meta))
    self.stats.add(st)
    self.programs.append(prog)
    b.arenas = list(arenas)

  def _build(self, b: Batch, seen: dict):
    # Capacities only grow (per recursive function), so executables compiled for one batch
    # serve the next ones: compiles stop once the largest batch has been seen.
    caps = []
    for sig, c in zip(b.arena_sigs, b.counts, strict=True):
      key = (sig.shape, sig.dtype)
      cap = max(self.caps.get(key, 0), arena_cap(int(c * self.headroom)))
      self.caps[key] = cap
      caps.append(cap)
    groups = sorted(b.groups.values(), key=lambda g: g.level)
    arena_ix = b.arena_ix
    bucket_hist: dict[int, int] = defaultdict(int)
    upload = Uploads()
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
          rows.append(list(map(SLOT, col)))
        elif kk == "host":  # Python scalars, one per call
          if kind.dtype == I32:
            step_kinds.append(("hostid", len(rows)))
            rows.append(list(col))
          elif rides_in_ids(kind.dtype, col):  # int64 under x64, bool: cast in the step
            step_kinds.append(("hostcast", len(rows), kind.dtype.name))
            rows.append([int(v) for v in col])
          else:
            step_kinds.append(("item",))
            data.append(pad_rows(np.asarray(col, kind.dtype), bsz))
        elif kk == "obj" and kind.td == LEAF_TD:  # one array per call (or one for all)
          vals = [leaf_value(seen, x) for x in col]
          data_column(kind.leaves[0], vals, bsz, step_kinds, rows, data, upload)
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
              rows.append(list(map(SLOT, vals)))
            else:
              data_column(lk, vals, bsz, step_kinds, rows, data, upload)
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


def leaf_value(seen: dict, x):
  e = seen.get(id(x))  # bare numpy/jax arrays have no entry (see Graph.add)
  return x if e is None else e.vals[0]


def check_unchanged(seen: dict, name: str) -> None:
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


def extract(outs: list) -> list:
  """Replaces every CellValue in ``outs`` by its array: one executable call per arena."""
  leaves, treedef = jax.tree_util.tree_flatten(outs, is_leaf=lambda x: isinstance(x, CellValue))
  want: dict[tuple, list[tuple[int, CellValue]]] = defaultdict(list)
  for i, x in enumerate(leaves):
    if isinstance(x, CellValue):
      if x.value is not None:
        leaves[i] = x.value
        continue
      if x.batch.arenas is None:
        raise AssertionError("extract before flush")
      want[(id(x.batch), x.sig)].append((i, x))
  for items in want.values():
    x0 = items[0][1]
    b = x0.batch
    rows = take_rows(b.arenas[b.arena_ix[x0.sig]], [x.slot for _, x in items])
    for (i, x), r in zip(items, rows, strict=True):
      leaves[i] = x.value = r
  return jax.tree_util.tree_unflatten(treedef, leaves)


