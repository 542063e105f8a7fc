"""Paths: what a routed cell runs through.  Stacked experts or distinct branch functions.

A path set answers two questions for dispatch: run a *group* of paths that share a capacity on
their cell buffers ``[m, C, ...]`` (one batched call: homogeneous fusion), and run *one* path
chosen by a traced index on a chunk of cells (the overflow path of the ``profiled`` mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dynjax._errors import RoutingError, format_list


def _contiguous(ids: Sequence[int]) -> bool:
  return all(b == a + 1 for a, b in zip(ids, ids[1:], strict=False))


class Experts:
  """Stacked experts: ``fn(params_p, x) -> y`` with every parameter stacked along axis 0.

  Experts that land in the same capacity bucket run as ONE ``jax.vmap(fn)`` call over their
  stacked parameters (a batched ``dot_general`` for matmul experts).  The parameter slice is a
  static slice when the group's experts are contiguous, else a gather (a copy of their weights).

  Args:
    fn: the per-expert function, ``fn(params, x[C, ...]) -> y[C, ...]``, written for one expert.

  Example:
    >>> experts = dynjax.route.Experts(lambda p, x: x @ p["w"])
    >>> params = {"w": jnp.zeros((8, 16, 16))}          # 8 experts
  """

  __slots__ = ("fn",)

  def __init__(self, fn: Callable):
    if not callable(fn):
      raise RoutingError(f"dynjax.route.Experts: fn must be callable fn(params, x), got "
                         f"{type(fn).__name__}")
    self.fn = fn

  def __repr__(self) -> str:
    return f"Experts({getattr(self.fn, '__name__', self.fn)!r})"

  def check(self, params, num_paths: int) -> None:
    """Every parameter leaf must have leading axis ``num_paths``; lists every mismatch."""
    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      shape = np.shape(leaf)
      if not shape or shape[0] != num_paths:
        bad.append(f"params{jax.tree_util.keystr(path)}: shape {tuple(shape)}, expected leading "
                   f"axis {num_paths}")
    if bad:
      raise RoutingError(
          f"dynjax.route.Experts: parameters must be stacked with one slice per path "
          f"(num_paths={num_paths}) along axis 0:\n{format_list(bad)}\nstack per-expert "
          "parameters with jax.tree.map(lambda *a: jnp.stack(a), *per_expert)")

  def run_group(self, params, ids: tuple[int, ...], xs: jax.Array) -> jax.Array:
    """Runs paths ``ids`` on ``xs[m, C, ...]`` as one batched call."""
    if _contiguous(ids):
      lo, hi = ids[0], ids[-1] + 1
      sub = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, lo, hi, axis=0), params)
    else:
      idx = np.asarray(ids, np.int32)
      sub = jax.tree.map(lambda a: jnp.take(a, idx, axis=0), params)
    return jax.vmap(self.fn)(sub, xs)

  def run_one(self, params, index: jax.Array, x: jax.Array) -> jax.Array:
    """Runs the path chosen by a traced ``index`` on ``x[W, ...]``."""
    sub = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False),
                       params)
    return self.fn(sub, x)

  def out_struct(self, params, x_row: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The output ``ShapeDtypeStruct`` of one path on ``[1, ...]`` cells."""
    sub = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], jnp.result_type(a)),
                       params)
    return jax.eval_shape(self.fn, sub, x_row)


class Branches:
  """Distinct branch functions, one per path: ``fns[p](params[p], x) -> y``.

  All branches run inside one executable; a branch with no cells is skipped at plan time.
  Outputs of all branches must have the same per-cell shape and dtype (they are combined).

  Args:
    fns: one function per path, ``fn(params, x[C, ...]) -> y[C, ...]``.

  Example:
    >>> branches = dynjax.route.Branches([lambda p, x: x, lambda p, x: jnp.tanh(x @ p)])
    >>> params = [None, jnp.eye(4)]
  """

  __slots__ = ("fns",)

  def __init__(self, fns: Sequence[Callable]):
    fns = tuple(fns)
    bad = [f"fns[{i}]: {type(f).__name__}" for i, f in enumerate(fns) if not callable(f)]
    if not fns or bad:
      raise RoutingError("dynjax.route.Branches: expected a non-empty sequence of functions "
                         f"fn(params, x); not callable:\n{format_list(bad or ['(empty)'])}")
    self.fns = fns

  def __repr__(self) -> str:
    return f"Branches({len(self.fns)} functions)"

  def check(self, params, num_paths: int) -> None:
    if len(self.fns) != num_paths:
      raise RoutingError(f"dynjax.route.Branches: {len(self.fns)} functions for num_paths="
                         f"{num_paths}; give one function per path")
    if not isinstance(params, list | tuple) or len(params) != num_paths:
      got = f"{type(params).__name__} of length {len(params)}" if isinstance(
          params, list | tuple) else type(params).__name__
      raise RoutingError(f"dynjax.route.Branches: params must be a list with one entry per "
                         f"branch ({num_paths}), got {got}; use None for a branch without "
                         "parameters")

  def run_group(self, params, ids: tuple[int, ...], xs: jax.Array) -> jax.Array:
    return jnp.stack([self.fns[i](params[i], xs[j]) for j, i in enumerate(ids)])

  def run_one(self, params, index: jax.Array, x: jax.Array) -> jax.Array:
    branches = [lambda x, i=i: self.fns[i](params[i], x) for i in range(len(self.fns))]
    return jax.lax.switch(index, branches, x)

  def out_struct(self, params, x_row: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    structs = [jax.eval_shape(f, p, x_row) for f, p in zip(self.fns, params, strict=True)]
    shapes = {(s.shape, s.dtype) for s in structs}
    if len(shapes) != 1:
      lines = [f"fns[{i}] -> {s.shape} {s.dtype}" for i, s in enumerate(structs)]
      raise RoutingError("dynjax.route.Branches: branch outputs differ in shape or dtype; they "
                         f"are combined per cell, so they must agree:\n{format_list(lines)}")
    return structs[0]


def ffn(activation: Callable = jax.nn.gelu, accumulate=None) -> Callable:
  """A two-matmul expert ``act(x @ w1) @ w2`` for :class:`Experts`, params ``{"w1", "w2"}``.

  ``accumulate=None`` (default) keeps matmul outputs in the input dtype: XLA's bf16 GEMMs
  accumulate in float32 internally (cuBLAS/Triton compute type f32) and write bf16, which halves
  the traffic of the ``[C, ffn]`` hidden compared with a float32 output.  ``accumulate=
  jnp.float32`` asks for ``preferred_element_type=float32`` outputs and casts back.

  Example:
    >>> experts = dynjax.route.Experts(dynjax.route.ffn())
    >>> params = {"w1": jnp.zeros((8, 64, 256)), "w2": jnp.zeros((8, 256, 64))}
  """

  def expert(p, x):
    h = jnp.dot(x, p["w1"], preferred_element_type=accumulate)
    h = activation(h).astype(x.dtype)
    return jnp.dot(h, p["w2"], preferred_element_type=accumulate).astype(x.dtype)

  expert.__name__ = f"ffn_{getattr(activation, '__name__', 'act')}"
  # Read by Routed(mode="grouped"): this expert can run as two grouped GEMMs.
  expert.ffn_spec = (activation, accumulate)
  return expert
