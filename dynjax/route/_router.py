"""Routers: which paths (experts, branches) each cell (token, sample) goes to, and with what gate.

A :class:`Router` turns gate logits (or integer labels) into a :class:`Routing`: for every cell
up to ``k`` path ids, their gates, the cell's *position* among the cells of that path (its
arrival order, by cell index) and the per-path loads.  Everything here is traceable and has a
fixed shape, so routing runs inside ``jax.jit``; the position is what lets dispatch place a cell
in its path's buffer without sorting at dispatch time.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynjax._errors import RoutingError

PROTOCOLS = ("top_k", "threshold", "hash", "label")

# Above this many paths, positions come from a stable sort of the path ids instead of a cumulative
# sum over a [cells, paths] one-hot (whose memory grows with the number of paths).
_ONE_HOT_MAX_PATHS = 64


class Routing(NamedTuple):
  """The routing decision for a batch of cells (a pytree of arrays; ``P`` = ``num_paths``).

  Attributes:
    paths: int32 ``[N, k]``, the path of each (cell, choice); ``P`` marks "no path" (threshold
      routing with fewer than ``k`` paths over the threshold).
    gates: float32 ``[N, k]``, the weight of each choice in the combine (0 for "no path").
    positions: int32 ``[N, k]``, the rank of the cell among the cells routed to that path.
    loads: int32 ``[P]``, the number of cells routed to each path.

  Example:
    >>> r = dynjax.route.Router(4, k=2)(jnp.zeros((3, 4)))
    >>> r.paths.shape, r.loads.shape
    ((3, 2), (4,))
  """

  paths: jax.Array
  gates: jax.Array
  positions: jax.Array
  loads: jax.Array


def _is_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _cumsum_rows(v: jax.Array, block: int = 128) -> jax.Array:
  """Inclusive cumulative sum over axis 0 of small non-negative integers held in float32.

  Two-level blocked scan as matmuls with a constant lower-triangular ``[block, block]`` matrix:
  a handful of kernels on GPU, where ``jnp.cumsum`` lowers to a ``log2(n)``-level associative
  scan (dozens of small kernels).  Exact: integer sums below 2**24 with HIGHEST precision.
  """
  n, e = v.shape
  hi = jax.lax.Precision.HIGHEST
  if n <= block:
    tri = jnp.tril(jnp.ones((n, n), jnp.float32))
    return jnp.dot(tri, v, precision=hi)
  nb = -(-n // block)
  vb = jnp.pad(v, ((0, nb * block - n), (0, 0))).reshape(nb, block, e)
  tri = jnp.tril(jnp.ones((block, block), jnp.float32))
  within = jnp.einsum("ij,bje->bie", tri, vb, precision=hi)
  tot = within[:, -1]
  offsets = _cumsum_rows(tot, block) - tot
  return (within + offsets[:, None, :]).reshape(nb * block, e)[:n]


def positions_and_loads(paths: jax.Array, num_paths: int) -> tuple[jax.Array, jax.Array]:
  """Per-cell rank within its path (in cell order) and the per-path loads.

  Args:
    paths: int32 ``[N, k]`` path ids; ``num_paths`` means "no path" (gets position 0, not counted).
    num_paths: the number of paths ``P``.

  Returns:
    ``(positions [N, k] int32, loads [P] int32)``.

  Example:
    >>> pos, loads = positions_and_loads(jnp.array([[1], [0], [1]]), 2)
    >>> pos.ravel().tolist(), loads.tolist()
    ([0, 0, 1], [1, 2])
  """
  shape = paths.shape
  flat = paths.reshape(-1)
  if num_paths <= _ONE_HOT_MAX_PATHS:
    if not flat.shape[0]:
      return jnp.zeros(shape, jnp.int32), jnp.zeros((num_paths,), jnp.int32)
    one_hot = (flat[:, None] == jnp.arange(num_paths, dtype=flat.dtype)).astype(jnp.float32)
    cum = _cumsum_rows(one_hot)
    pos = jnp.sum(one_hot * (cum - 1.0), axis=1)
    return pos.reshape(shape).astype(jnp.int32), cum[-1].astype(jnp.int32)
  # Sort-based: a stable argsort groups cells by path, keeping cell order inside each path.
  n = flat.shape[0]
  order = jnp.argsort(flat, stable=True)
  sorted_paths = flat[order]
  loads_all = jnp.zeros((num_paths + 1,), jnp.int32).at[flat].add(1)
  starts = jnp.cumsum(loads_all) - loads_all
  pos_sorted = jnp.arange(n, dtype=jnp.int32) - starts[sorted_paths]
  pos = jnp.zeros((n,), jnp.int32).at[order].set(pos_sorted, unique_indices=True)
  pos = jnp.where(flat < num_paths, pos, 0)
  return pos.reshape(shape), loads_all[:num_paths]


class Router:
  """Routes cells to paths: top-k, threshold, hash or label routing.

  Protocols:
    - ``"top_k"``: each cell goes to the ``k`` paths with the largest logits; gates are the softmax
      probabilities of those paths (over all paths), or, with ``renormalize=True``, renormalised to
      sum to one over the ``k`` choices.
    - ``"threshold"``: each cell goes to every path whose softmax probability is ``>= threshold``
      (at most ``k``, at least its top-1 path, so no cell is left without a path).
    - ``"hash"``: cell ``i`` with integer label ``l`` goes to path ``hash(l) % num_paths`` (gate 1).
    - ``"label"``: the label *is* the path id (``0 <= label < num_paths``; gate 1).

  Calling the router is traceable (use it inside ``jax.jit``); it validates shapes and dtypes at
  trace time.

  Args:
    num_paths: the number of paths (experts, branches).
    protocol: one of ``"top_k"``, ``"threshold"``, ``"hash"``, ``"label"``.
    k: choices per cell (``top_k``), or the most paths a cell may take (``threshold``; default
      ``num_paths``).  Must be ``<= num_paths``.
    renormalize: renormalise the gates of a cell's choices to sum to one.
    threshold: the probability threshold of the ``"threshold"`` protocol.

  Example:
    >>> router = dynjax.route.Router(8, k=2, renormalize=True)
    >>> routing = router(jnp.ones((16, 8)))      # logits: [cells, paths]
    >>> int(routing.loads.sum())
    32
  """

  __slots__ = ("num_paths", "protocol", "k", "renormalize", "threshold")

  def __init__(self, num_paths: int, protocol: str = "top_k", *, k: int | None = None,
               renormalize: bool = False, threshold: float | None = None):
    if isinstance(num_paths, bool) or not isinstance(num_paths, int | np.integer) or num_paths < 1:
      raise RoutingError(
          f"dynjax.route.Router: num_paths must be an integer >= 1, got {num_paths!r}; "
          "pass the number of experts/branches")
    if protocol not in PROTOCOLS:
      raise RoutingError(
          f"dynjax.route.Router: protocol must be one of {', '.join(map(repr, PROTOCOLS))}, "
          f"got {protocol!r}")
    num_paths = int(num_paths)
    if k is None:
      k = num_paths if protocol == "threshold" else 1
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
      raise RoutingError(f"dynjax.route.Router: k must be an integer >= 1, got {k!r}")
    if k > num_paths:
      raise RoutingError(
          f"dynjax.route.Router: k={k} is larger than num_paths={num_paths}; a cell cannot take "
          f"more paths than exist: use k <= {num_paths}")
    if protocol in ("hash", "label") and k != 1:
      raise RoutingError(
          f"dynjax.route.Router: protocol {protocol!r} sends each cell to one path, got k={k}; "
          "use k=1 (or protocol='top_k')")
    if protocol == "threshold":
      if threshold is None or not isinstance(threshold, int | float) or not 0.0 <= threshold <= 1.0:
        raise RoutingError(
            "dynjax.route.Router: protocol 'threshold' needs threshold= a probability in [0, 1], "
            f"got {threshold!r}")
    elif threshold is not None:
      raise RoutingError(
          f"dynjax.route.Router: threshold= is only used by protocol 'threshold', got protocol "
          f"{protocol!r}; drop threshold= or use protocol='threshold'")
    self.num_paths = num_paths
    self.protocol = protocol
    self.k = int(k)
    self.renormalize = bool(renormalize)
    self.threshold = None if threshold is None else float(threshold)

  def __repr__(self) -> str:
    extra = f", threshold={self.threshold}" if self.threshold is not None else ""
    norm = ", renormalize=True" if self.renormalize else ""
    return f"Router({self.num_paths}, {self.protocol!r}, k={self.k}{norm}{extra})"

  @property
  def uses_labels(self) -> bool:
    """Whether the router takes integer ``labels`` (hash/label) rather than float ``logits``."""
    return self.protocol in ("hash", "label")

  def _check_logits(self, logits) -> None:
    where = f"dynjax.route.Router({self.protocol!r})"
    if logits is None:
      raise RoutingError(f"{where}: logits is missing; pass logits of shape (num_cells, "
                         f"{self.num_paths})")
    shape = tuple(np.shape(logits))
    if len(shape) != 2 or shape[1] != self.num_paths:
      raise RoutingError(
          f"{where}: logits has shape {shape}, expected (num_cells, {self.num_paths}) with one "
          f"column per path (num_paths={self.num_paths}); pass logits of shape (N, "
          f"{self.num_paths}) or build the Router with num_paths={shape[-1] if shape else '?'}")
    dtype = jnp.result_type(logits)
    if not _is_float(dtype):
      raise RoutingError(
          f"{where}: logits has dtype {dtype}, expected a floating dtype (float32, bfloat16, "
          f"float16); cast with logits.astype(jnp.float32)")

  def _check_labels(self, labels) -> None:
    where = f"dynjax.route.Router({self.protocol!r})"
    if labels is None:
      raise RoutingError(f"{where}: labels is missing; pass integer labels of shape (num_cells,)")
    shape = tuple(np.shape(labels))
    if len(shape) != 1:
      raise RoutingError(f"{where}: labels has shape {shape}, expected (num_cells,); pass one "
                         "integer label per cell")
    dtype = jnp.result_type(labels)
    if not jnp.issubdtype(dtype, jnp.integer):
      raise RoutingError(
          f"{where}: labels has dtype {dtype}, expected an integer dtype (int32); cast with "
          "labels.astype(jnp.int32)")

  def __call__(self, logits=None, *, labels=None, mask=None) -> Routing:
    """Routes a batch of cells.

    Args:
      logits: float ``[num_cells, num_paths]`` gate logits (``top_k``, ``threshold``).
      labels: integer ``[num_cells]`` labels (``hash``, ``label``).
      mask: optional bool ``[num_cells]``; a masked-out cell (padding) takes no path: it gets
        no slot, is not counted in the loads, and its combined output is 0.

    Returns:
      A :class:`Routing`.
    """
    paths, gates = self.select(logits, labels=labels, mask=mask)
    positions, loads = positions_and_loads(paths, self.num_paths)
    return Routing(paths, gates, positions, loads)

  def select(self, logits=None, *, labels=None, mask=None) -> tuple[jax.Array, jax.Array]:
    """``(paths [N, k], gates [N, k])`` of :meth:`__call__`, without positions and loads.

    Shape-polymorphic (works on ``jax.export`` symbolic cell counts), unlike the positions.
    """
    num_paths = self.num_paths
    if self.uses_labels:
      if logits is not None:
        raise RoutingError(
            f"dynjax.route.Router({self.protocol!r}): routes by labels=, got logits; pass "
            "labels=... (integer, one per cell)")
      self._check_labels(labels)
      labels = jnp.asarray(labels).astype(jnp.int32)
      if self.protocol == "hash":
        # Knuth's multiplicative hash in uint32 (wraps), then modulo the number of paths.
        h = labels.astype(jnp.uint32) * jnp.uint32(2654435761)
        paths = (h % jnp.uint32(num_paths)).astype(jnp.int32)
      else:
        paths = jnp.clip(labels, 0, num_paths - 1)
      paths = paths[:, None]
      gates = jnp.ones(paths.shape, jnp.float32)
    else:
      if labels is not None:
        raise RoutingError(
            f"dynjax.route.Router({self.protocol!r}): routes by logits, got labels=; pass "
            "logits of shape (num_cells, num_paths)")
      self._check_logits(logits)
      logits = jnp.asarray(logits).astype(jnp.float32)
      probs = jax.nn.softmax(logits, axis=-1)
      if self.k == 1:
        # argmax is cheaper than top_k on GPU; same tie-break (first index).
        idx = jnp.argmax(logits, axis=-1)[:, None].astype(jnp.int32)
      else:
        _, idx = jax.lax.top_k(logits, self.k)
        idx = idx.astype(jnp.int32)
      gates = jnp.take_along_axis(probs, idx, axis=-1)
      paths = idx
      if self.protocol == "threshold":
        keep = (gates >= self.threshold) | (jnp.arange(self.k) == 0)
        paths = jnp.where(keep, paths, num_paths)
        gates = jnp.where(keep, gates, 0.0)
      if self.renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    if mask is not None:
      n = paths.shape[0]
      if tuple(np.shape(mask)) != (n,):
        raise RoutingError(
            f"dynjax.route.Router: mask has shape {tuple(np.shape(mask))}, expected ({n},): one "
            "boolean per cell (False: padding, routed nowhere)")
      keep = jnp.asarray(mask).astype(bool)[:, None]
      paths = jnp.where(keep, paths, num_paths)
      gates = jnp.where(keep, gates, 0.0)
    return paths, gates
