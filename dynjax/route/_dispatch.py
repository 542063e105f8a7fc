"""Dispatch and combine: move cells into per-path buffers, run the paths, gather them back.

Layout.  A :class:`Plan` fixes, at trace time, a capacity per path and the *groups*: paths with
the same capacity (fusion ``"bucket"``) that run as one batched call on a buffer
``[m, C, ...]``.  All group buffers live in one flat *slot* space: group ``g`` owns slots
``[offset_g, offset_g + m_g * C_g)``, path ``i`` of the group owns ``C_g`` consecutive slots.
Cell ``a`` routed to path ``p`` at position ``r`` sits in slot ``base[p] + r``; no sort is needed
because the router already computed ``r``.

- dispatch: scatter the cell ids into the slot table (int32, cheap), then one row gather of ``x``
  per group.  Unused slots read cell 0: computed but never combined, so they cost FLOPs only,
  never correctness or gradient (their outputs get a zero cotangent).
- combine: one row gather from the concatenated outputs, times the gate, summed over the ``k``
  choices of the cell.  Cells that did not fit (the ``profiled`` mode) read their row from the
  overflow buffer instead; "no path" choices read a zero row with gate 0.

Both are plain ``jnp`` gathers/scatters, so they are differentiable in the cells, the gates and
the path parameters, and they jit/vmap like any JAX code.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dynjax._errors import RoutingError
from dynjax.route._router import Routing

FUSIONS = ("auto", "bucket", "runs", "none")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static capacities and groups of one executable (hashable: a compile-cache key).

  Attributes:
    capacities: per-path capacity (0: the path gets no slots).
    groups: ``((path ids), capacity)`` per batched call, largest capacity first.
    overflow: whether cells beyond capacity run an overflow path (``profiled``); when False
      the capacities must cover the loads (``exact-sync``), or cells past them are lost.
    overflow_chunk: rows per step of the overflow path.

  Example:
    >>> make_plan((512, 128, 128, 0)).groups
    (((0,), 512), ((1, 2), 128))
  """

  capacities: tuple[int, ...]
  groups: tuple[tuple[tuple[int, ...], int], ...]
  overflow: bool = False
  overflow_chunk: int = 256

  @property
  def num_paths(self) -> int:
    return len(self.capacities)

  @property
  def offsets(self) -> tuple[int, ...]:
    out, off = [], 0
    for ids, cap in self.groups:
      out.append(off)
      off += len(ids) * cap
    return tuple(out)

  @property
  def num_slots(self) -> int:
    return sum(len(ids) * cap for ids, cap in self.groups)

  @property
  def bases(self) -> tuple[int, ...]:
    base = [0] * self.num_paths
    for (ids, cap), off in zip(self.groups, self.offsets, strict=True):
      for i, p in enumerate(ids):
        base[p] = off + i * cap
    return tuple(base)

  def describe(self) -> str:
    """One line per batched call, e.g. ``bucket 512: paths (1, 2)``."""
    lines = [f"bucket {cap}: paths {ids}" for ids, cap in self.groups]
    if self.overflow:
      lines.append(f"overflow: chunked, {self.overflow_chunk} rows a step")
    return "\n".join(lines)


def make_plan(capacities, fusion: str = "bucket", overflow: bool = False,
              overflow_chunk: int = 256) -> Plan:
  """Groups paths by capacity into batched calls.

  Args:
    capacities: per-path capacities (ints >= 0).
    fusion: ``"bucket"`` (every path of one capacity in one call; a weight gather when those
      paths are not consecutive), ``"runs"`` or ``"auto"`` (runs of consecutive paths with one
      capacity: static weight slices only; ``"auto"`` capacities come from
      :func:`auto_capacities`), ``"none"`` (one call per path).
    overflow: include the overflow path.
    overflow_chunk: rows per overflow step.

  Returns:
    A :class:`Plan`.
  """
  if fusion not in FUSIONS:
    raise RoutingError(f"dynjax.route: fusion must be one of {', '.join(map(repr, FUSIONS))}, got "
                       f"{fusion!r}")
  caps = tuple(int(c) for c in capacities)
  groups: list[tuple[tuple[int, ...], int]] = []
  if fusion == "bucket":
    for cap in sorted({c for c in caps if c > 0}, reverse=True):
      groups.append((tuple(p for p, c in enumerate(caps) if c == cap), cap))
  else:
    run: list[int] = []
    for p, c in enumerate(caps + (0,)):
      if run and (fusion == "none" or c != caps[run[-1]]):
        groups.append((tuple(run), caps[run[-1]]))
        run = []
      if c > 0 and p < len(caps):
        run.append(p)
    groups.sort(key=lambda g: -g[1])
  return Plan(caps, tuple(groups), bool(overflow), int(overflow_chunk))


def bucket_capacity(policy, need: int, max_capacity: int | None = None) -> int:
  """``policy.bucket(need)`` (``grow`` past its max), 0 for ``need <= 0``, capped."""
  if need <= 0:
    return 0
  b = policy.bucket(need)
  b = policy.grow(need) if b is None else b
  return int(b if max_capacity is None else min(b, max_capacity))


def auto_capacities(needs, policy, overhead: int = 256,
                    max_capacity: int | None = None) -> tuple[int, ...]:
  """Capacities that share one batched call per range of consecutive paths, chosen by DP.

  Paths are split into ranges of consecutive ids; a range runs as one batched call at the bucket
  of its largest need, so its cost is ``len(range) * bucket(max need) + overhead`` (in rows;
  ``overhead`` prices a separate call: launch, gather and a less-filled GPU).  Paths with zero
  need may be skipped (capacity 0).  Consecutive ids keep weight slices static (never a gather
  of weights).  ``O(P^2)`` numpy work, vectorised per range end.

  Example:
    >>> auto_capacities([900, 130, 120, 0, 100], dynjax.buckets.linear(128), overhead=64)
    (1024, 256, 128, 0, 128)
  """
  needs = [int(v) for v in needs]
  b = np.asarray([bucket_capacity(policy, v, max_capacity) for v in needs], np.int64)
  return group_buckets(b, overhead)


def group_buckets(b, overhead: int = 256) -> tuple[int, ...]:
  """The DP of :func:`auto_capacities` on already-bucketed needs ``b`` (0: no cells).

  Its result depends on ``b`` only, so callers cache it keyed by ``b``.
  """
  b = np.asarray(b, np.int64)
  n = len(b)
  best = np.zeros(n + 1)
  start = np.full(n + 1, -1, np.int64)  # -1: path j-1 skipped
  for j in range(1, n + 1):
    rev = np.maximum.accumulate(b[j - 1::-1])  # rev[t] = max(b[j-1-t .. j-1])
    lens = np.arange(1, j + 1)
    cost = best[j - 1::-1] + lens * rev + overhead
    cost = np.where(rev > 0, cost, np.inf)
    t = int(np.argmin(cost))
    best[j], start[j] = cost[t], j - 1 - t
    if b[j - 1] == 0 and best[j - 1] <= best[j]:
      best[j], start[j] = best[j - 1], -1
  caps = [0] * n
  j = n
  while j > 0:
    i = int(start[j])
    if i < 0:
      j -= 1
      continue
    cap = int(b[i:j].max())
    caps[i:j] = [cap] * (j - i)
    j = i
  return tuple(caps)


def _flat(routing: Routing, num_paths: int):
  paths = routing.paths.reshape(-1)
  valid = paths < num_paths
  safe = jnp.where(valid, paths, 0)
  return paths, valid, safe, routing.positions.reshape(-1)


def dispatch(x: jax.Array, routing: Routing, plan: Plan) -> list[jax.Array]:
  """Moves cells into their paths' buffers: one ``[m, C, ...]`` array per group of ``plan``.

  Args:
    x: ``[N, ...]`` cells.
    routing: the :class:`Routing` of those cells.
    plan: the static :class:`Plan`.

  Returns:
    A list with one ``[len(ids), capacity, ...]`` buffer per ``plan.groups`` entry.

  Example:
    >>> r = dynjax.route.Router(2)(jnp.array([[1., 0.], [0., 1.], [1., 0.]]))
    >>> [b.shape for b in dispatch(jnp.ones((3, 4)), r, make_plan((2, 1)))]
    [(1, 2, 4), (1, 1, 4)]
  """
  n = x.shape[0]
  k = routing.paths.shape[1]
  _, valid, safe, pos = _flat(routing, plan.num_paths)
  caps = jnp.asarray(plan.capacities, jnp.int32)
  bases = jnp.asarray(plan.bases, jnp.int32)
  num_slots = plan.num_slots
  in_main = valid & (pos < caps[safe])
  slot = jnp.where(in_main, bases[safe] + pos, num_slots)  # num_slots: out of bounds, dropped
  cell = jnp.arange(n * k, dtype=jnp.int32) // k
  table = jnp.zeros((num_slots,), jnp.int32).at[slot].set(cell, mode="drop")
  out = []
  for (ids, cap), off in zip(plan.groups, plan.offsets, strict=True):
    idx = jax.lax.slice_in_dim(table, off, off + len(ids) * cap).reshape(len(ids), cap)
    out.append(jnp.take(x, idx, axis=0, mode="clip"))
  return out


def combine(outputs: list[jax.Array], routing: Routing, plan: Plan,
            overflow: jax.Array | None = None) -> jax.Array:
  """Gathers every cell's path outputs back, weighted by its gates, summed over its choices.

  Args:
    outputs: one ``[len(ids), capacity, ...]`` output per ``plan.groups`` entry (the paths run on
      :func:`dispatch`'s buffers).
    routing: the same :class:`Routing`.
    plan: the same :class:`Plan`.
    overflow: ``[R, ...]`` outputs of the overflow cells (rank order), when ``plan.overflow``.

  Returns:
    ``[N, ...]``: ``sum_j gates[:, j] * path_{paths[:, j]}(x)``, in the outputs' dtype (the sum
    runs in float32 for narrower floats).

  Example:
    >>> r = dynjax.route.Router(2)(jnp.array([[1., 0.], [0., 1.]]))
    >>> plan = make_plan((1, 1))
    >>> y = combine(dispatch(jnp.ones((2, 3)), r, plan), r, plan)
  """
  if not outputs and overflow is None:
    raise RoutingError("dynjax.route.combine: no outputs to combine (every capacity is 0 and "
                       "there is no overflow path)")
  ref = outputs[0] if outputs else overflow
  tail = ref.shape[2:] if outputs else ref.shape[1:]
  n, k = routing.paths.shape
  _, valid, safe, pos = _flat(routing, plan.num_paths)
  caps = jnp.asarray(plan.capacities, jnp.int32)
  bases = jnp.asarray(plan.bases, jnp.int32)
  cap_a = caps[safe]
  in_main = valid & (pos < cap_a)
  pieces = [o.reshape((-1,) + tuple(tail)) for o in outputs]
  num_slots = plan.num_slots
  rows = jnp.where(in_main, bases[safe] + pos, 0)
  total = num_slots
  if overflow is not None:
    loads = routing.loads
    ovf_count = jnp.maximum(loads - caps, 0)
    ovf_off = jnp.cumsum(ovf_count) - ovf_count
    in_ovf = valid & ~in_main
    rows = jnp.where(in_ovf, num_slots + ovf_off[safe] + pos - cap_a, rows)
    pieces.append(overflow)
    total += overflow.shape[0]
  pieces.append(jnp.zeros((1,) + tuple(tail), ref.dtype))
  hit = in_main | (valid & (overflow is not None))
  rows = jnp.where(hit, rows, total)  # the zero row
  table = jnp.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
  acc = jnp.promote_types(ref.dtype, jnp.float32) if jnp.issubdtype(
      ref.dtype, jnp.floating) else ref.dtype
  gates = jnp.where(valid, routing.gates.reshape(-1), 0).astype(acc)
  picked = jnp.take(table, rows, axis=0, mode="clip").astype(acc)
  picked = picked * gates.reshape((-1,) + (1,) * len(tail))
  y = picked.reshape((n, k) + tuple(tail))
  y = y[:, 0] if k == 1 else jnp.sum(y, axis=1)
  return y.astype(ref.dtype)


def run_overflow(paths, params, x: jax.Array, routing: Routing, plan: Plan,
                 out_struct: jax.ShapeDtypeStruct) -> jax.Array:
  """Computes every cell past its path's capacity, exactly; nothing is dropped.

  Overflow cells are ranked by (path, position) into a buffer of ``N*k + W`` rows (``W`` =
  ``plan.overflow_chunk``).  A scan walks over chunks of ``W`` rows of one path each and runs
  that path on them (``paths.run_one``); the whole walk sits under a ``lax.cond`` on "any
  overflow", so a call without overflow pays one predicate, not the scan.  Cost when it runs:
  ``ceil(N*k / W) + P`` scan steps, inactive steps skipped by a ``cond``.

  Returns:
    ``[N*k + W, ...]`` outputs in overflow-rank order (rows past the overflow count are junk).
  """
  n, k = routing.paths.shape
  num_cells = n * k
  w = plan.overflow_chunk
  num_paths = plan.num_paths
  _, valid, safe, pos = _flat(routing, num_paths)
  caps = jnp.asarray(plan.capacities, jnp.int32)
  cap_a = caps[safe]
  in_ovf = valid & (pos >= cap_a)
  ovf_count = jnp.maximum(routing.loads - caps, 0)
  ovf_off = jnp.cumsum(ovf_count) - ovf_count
  rows = num_cells + w
  rank = jnp.where(in_ovf, ovf_off[safe] + pos - cap_a, rows)
  cell = jnp.arange(num_cells, dtype=jnp.int32) // k
  ovf_cell = jnp.zeros((rows,), jnp.int32).at[rank].set(cell, mode="drop")
  chunks = (ovf_count + w - 1) // w
  chunk_end = jnp.cumsum(chunks)
  n_chunks = chunk_end[-1]
  max_chunks = math.ceil(num_cells / w) + num_paths
  out_shape = (rows,) + tuple(out_struct.shape[1:])
  zeros = jnp.zeros(out_shape, out_struct.dtype)

  def walk(_):
    xo = jnp.take(x, ovf_cell, axis=0, mode="clip")

    def step(yo, j):
      p = jnp.minimum(jnp.searchsorted(chunk_end, j, side="right"), num_paths - 1)
      c = j - (chunk_end[p] - chunks[p])
      start = ovf_off[p] + c * w
      end = ovf_off[p] + ovf_count[p]

      def compute(yo):
        xs = jax.lax.dynamic_slice_in_dim(xo, start, w)
        ys = paths.run_one(params, p, xs).astype(yo.dtype)
        old = jax.lax.dynamic_slice_in_dim(yo, start, w)
        ok = (start + jnp.arange(w)) < end
        ys = jnp.where(ok.reshape((w,) + (1,) * (ys.ndim - 1)), ys, old)
        return jax.lax.dynamic_update_slice_in_dim(yo, ys, start, 0)

      return jax.lax.cond(j < n_chunks, compute, lambda yo: yo, yo), None

    yo, _ = jax.lax.scan(step, zeros, jnp.arange(max_chunks, dtype=jnp.int32))
    return yo

  return jax.lax.cond(n_chunks > 0, walk, lambda _: zeros, None)


def apply(paths, params, x: jax.Array, routing: Routing, plan: Plan) -> jax.Array:
  """Dispatch, run every group as one batched call, (overflow), combine: the routed layer.

  Traceable and differentiable; ``plan`` is static.

  Example:
    >>> experts = dynjax.route.Experts(lambda p, x: x @ p)
    >>> r = dynjax.route.Router(2)(jnp.array([[1., 0.], [0., 1.]]))
    >>> y = apply(experts, jnp.ones((2, 3, 3)), jnp.ones((2, 3)), r, make_plan((1, 1)))
  """
  bufs = dispatch(x, routing, plan)
  outs = [paths.run_group(params, ids, b) for (ids, _), b in zip(plan.groups, bufs, strict=True)]
  ovf = None
  if plan.overflow:
    row = jax.ShapeDtypeStruct((1,) + tuple(x.shape[1:]), x.dtype)
    ovf = run_overflow(paths, params, x, routing, plan, paths.out_struct(params, row))
  if not outs and ovf is None:
    # Nothing routed anywhere (e.g. N == 0): zeros of the path's output shape.
    row = jax.ShapeDtypeStruct((1,) + tuple(x.shape[1:]), x.dtype)
    s = paths.out_struct(params, row)
    return jnp.zeros((x.shape[0],) + tuple(s.shape[1:]), s.dtype)
  return combine(outs, routing, plan, ovf)


def dense_reference(paths, params, x: jax.Array, routing: Routing) -> jax.Array:
  """Every cell through every path, weighted by its gates: the exact answer, P times the FLOPs.

  For tests and debugging (``Experts`` and ``Branches``).
  """
  num_paths = len(paths.fns) if hasattr(paths, "fns") else jax.tree.leaves(params)[0].shape[0]
  weights = jnp.zeros((x.shape[0], num_paths + 1), jnp.float32)
  weights = weights.at[jnp.arange(x.shape[0])[:, None], routing.paths].add(
      routing.gates.astype(jnp.float32))[:, :num_paths]
  ys = [paths.run_one(params, jnp.int32(p), x) for p in range(num_paths)]
  y = sum(weights[:, p].reshape((-1,) + (1,) * (ys[p].ndim - 1)) * ys[p].astype(jnp.float32)
          for p in range(num_paths))
  return y.astype(ys[0].dtype)


def _np_int_tuple(a) -> tuple[int, ...]:
  return tuple(int(v) for v in np.asarray(a).reshape(-1))
