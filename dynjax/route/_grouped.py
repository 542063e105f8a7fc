"""The ``"grouped"`` routed layer: cells sorted by path into tile-aligned groups, grouped GEMMs.

No capacities: path ``p``'s cells take rows ``[base_p, base_p + load_p)`` of one buffer, where
``base_p`` is ``tm`` times the row tiles of the paths before it, so a path is padded by at most
``tm - 1`` rows and the buffer has a static ``num_tiles(N*k, P, tm) * tm`` rows (the bound over
every routing).  The ``"mgpu"`` kernel takes ragged groups, so there paths are packed
(``base_p`` = the loads before it) into ``N*k`` rows rounded up to a tile.  As in the capacity modes, the router's positions place the cells (one int32
scatter of cell ids, one row gather; no sort).  The expert FFN then runs as two grouped GEMMs
(:func:`dynjax.route.gmm`) with the activation between them, and the combine gathers each
cell's ``k`` rows times its gates.  Dropless, one traceable function, no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dynjax._errors import RoutingError
from dynjax.route._gmm import (
  Tiling,
  buffer_rows,
  gmm,
  hopper_floor_rows,
  hopper_grouped,
  num_tiles,
  resolve_backend,
  row_alignment,
)
from dynjax.route._router import Routing

# The combine (each cell's k rows times their gates) materialized on its own, not fused into
# its consumer (an optimization barrier).  XLA fused its gather into the transpose that feeds
# the e2e MoE encoder's pooling: 19 us at 1,024 tokens where the dense model's same transpose
# takes 7.  Apart, H100 jax 0.11.2 (session 18): the request's device time 249.5 / 250.1 ->
# 237.9 / 238.4 us at t=128, 314.7 / 313.1 -> 304.5 / 304.0 at t=256, 547 -> 543 at t=512
# (probe_moe_profile.py --parts requests); the e2e taking turns per request, apart against
# fused, 5 of 6 mean/median pairs faster by 6-29 us (bench_moe_gmm_e2e_run22_combine_h100.log).
# Its cost where the consumer would have fused it cheaply: one [N, d] write and read.
COMBINE_APART = True


class GroupedLayout(NamedTuple):
  """Where every (cell, choice) sits in the grouped buffer.

  Attributes:
    slots: int32 ``[N, k]``, the buffer row of each choice (``rows`` for "no path").
    table: int32 ``[rows]``, the cell of each buffer row (``N`` for padding rows).
    group_sizes: int32 ``[P]``, the loads.
  """

  slots: jax.Array
  table: jax.Array
  group_sizes: jax.Array


def grouped_layout(routing: Routing, num_paths: int, tm: int,
                   rows: int | None = None) -> GroupedLayout:
  """The grouped layout of a routing (traceable): path ``p`` starts at ``tm`` times the
  ``tm``-row tiles of the paths before it (``tm=1``: packed, as the ``"mgpu"`` kernel takes).

  ``rows``: the buffer's static row count (default: the tile bound of :func:`num_tiles`).

  Example:
    >>> r = dynjax.route.Router(4, k=2)(logits)
    >>> lay = grouped_layout(r, 4, 128)     # lay.table: [rows] cell ids, N = padding
  """
  n, k = routing.paths.shape
  if rows is None:
    rows = num_tiles(n * k, num_paths, tm) * tm
  paths = routing.paths.reshape(-1)
  valid = paths < num_paths
  safe = jnp.where(valid, paths, 0)
  loads = routing.loads.astype(jnp.int32)
  tiles = (loads + tm - 1) // tm
  base = (jnp.cumsum(tiles) - tiles) * tm
  slots = jnp.where(valid, base[safe] + routing.positions.reshape(-1), rows)
  cell = jnp.arange(n * k, dtype=jnp.int32) // k
  table = jnp.full((rows,), n, jnp.int32).at[slots].set(cell, mode="drop")
  return GroupedLayout(slots.reshape(n, k).astype(jnp.int32), table, loads)


def _on_groups(xs, w, sizes, routed: int, tiling: Tiling, backend: str, activation):
  """``activation(xs[rows of g] @ w[g])`` on the grouped buffer ``xs`` (``routed``: the rows
  a routing fills at most)."""
  if backend != "hopper":
    return gmm(xs, w, sizes, tiling=tiling, backend=backend, activation=activation)
  # Row tiles past the groups' are not computed at all: the callers read only the groups'
  # rows, and their gradients are dropped by the row gather's transpose (the table sends
  # them nowhere).  The static buffer bounds every routing: at 64 paths ~1/4 of its tiles
  # are unused on a uniform routing.
  # The kernels' column tiles follow the waves of the largest routing of the buffer's
  # class: every call shape below the floor shares one kernel pair (one Mosaic GPU compile
  # each: ~1-1.5 s on the H100), where choosing by each shape's own rows gave the e2e's 6
  # length buckets 4 kernels.
  num = w.shape[0]
  fill = num_tiles(routed, num, tiling.tm) * tiling.tm
  waves = max(fill, hopper_floor_rows(num, tiling.tm))
  return hopper_grouped(xs, w, sizes.astype(jnp.int32), tiling, activation, skip_unused=fill,
                        wave_rows=waves)


def ffn_spec(paths) -> tuple | None:
  """``(activation, accumulate)`` when ``paths`` is ``Experts(ffn(...))``, else None."""
  return getattr(getattr(paths, "fn", None), "ffn_spec", None)


def grouped_ffn(params, x: jax.Array, routing: Routing, *, activation, tiling: Tiling,
                backend: str) -> jax.Array:
  """``sum_j gates[:, j] * act(x @ w1[p_j]) @ w2[p_j]`` via two grouped GEMMs (dropless).

  Args:
    params: ``{"w1": [P, d, f], "w2": [P, f, d]}``.
    x: ``[N, d]``.
    routing: the :class:`Routing`.
    activation: the FFN activation.
    tiling: the grouped GEMM's :class:`Tiling`.
    backend: ``"pallas"``, ``"mgpu"``, ``"xla"`` or ``"auto"`` (see :func:`dynjax.route.gmm`).

  Returns:
    ``[N, d]`` in ``x``'s dtype (the weighted sum over the ``k`` choices runs in float32).
  """
  w1, w2 = params["w1"], params["w2"]
  num_paths = w1.shape[0]
  n = x.shape[0]
  if x.ndim != 2:
    raise RoutingError(f"dynjax.route: mode='grouped' takes cells of shape [N, d], got "
                       f"{tuple(x.shape)}; flatten the leading axes")
  if not n:
    return jnp.zeros((0, w2.shape[2]), x.dtype)
  d, f = w1.shape[1:]
  backend = resolve_backend(backend, x.dtype, n * routing.paths.shape[1], num_paths,
                            widths=((d, f), (f, d)), tiling=tiling)
  rows = buffer_rows(n * routing.paths.shape[1], num_paths, tiling, backend)
  lay = grouped_layout(routing, num_paths, row_alignment(tiling, backend), rows)
  xs = jnp.take(x, lay.table, axis=0, mode="fill", fill_value=0)
  routed = n * routing.paths.shape[1]
  h = _on_groups(xs, w1.astype(x.dtype), lay.group_sizes, routed, tiling, backend, activation)
  ys = _on_groups(h, w2.astype(x.dtype), lay.group_sizes, routed, tiling, backend, None)
  acc = jnp.promote_types(ys.dtype, jnp.float32)
  valid = routing.paths < num_paths
  gates = jnp.where(valid, routing.gates, 0).astype(acc)
  picked = jnp.take(ys, lay.slots.reshape(-1), axis=0, mode="fill", fill_value=0)
  picked = picked.astype(acc).reshape(n, -1, ys.shape[1]) * gates[..., None]
  y = picked[:, 0] if picked.shape[1] == 1 else jnp.sum(picked, axis=1)
  y = y.astype(x.dtype)
  return jax.lax.optimization_barrier(y) if COMBINE_APART else y
