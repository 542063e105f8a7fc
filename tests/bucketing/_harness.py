"""Test harness of the padding pass: padded execution vs exact execution.

``Case(fun, shapes)`` traces ``fun`` symbolically once; ``case.check(true, bucket)`` pads fresh
inputs of the true sizes to the bucket with garbage (NaN, huge values) in the padded region,
runs ``jax.jit(plan.fun)`` (one executable per bucket, cached) and compares the prefix of every
output with ``jax.jit(fun)`` at the exact shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from dynjax.bucketing import _conv_vjp, _jnp, _rebind, _scan, _search  # noqa: F401 - rebinders
from dynjax.bucketing._padding import pad_jaxpr


def default_inputs(rng: np.random.Generator, shapes, dtypes) -> list[np.ndarray]:
  out = []
  for s, dt in zip(shapes, dtypes, strict=True):
    dt = np.dtype(dt)
    if dt == np.bool_:
      out.append(rng.random(s) < 0.5)
    elif np.issubdtype(dt, np.integer):
      out.append(rng.integers(-3, 8, size=s).astype(dt))
    else:
      out.append(rng.normal(size=s).astype(dt))
  return out


def garbage_like(rng: np.random.Generator, shape, dtype, kind: str) -> np.ndarray:
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    if kind == "zeros":
      return np.zeros(shape, dtype)
    return rng.integers(info.min // 2, info.max // 2, size=shape, dtype=dtype)
  if kind == "zeros":
    return np.zeros(shape, dtype)
  if kind == "nan":
    return np.full(shape, np.nan, dtype)
  big = min(1e30, float(np.finfo(dtype).max))  # float16's largest is 65504
  choices = np.array([np.nan, np.inf, -np.inf, big, -big, 7.0], dtype)
  return choices[rng.integers(0, len(choices), size=shape)]


class Case:
  """A function with symbolic input shapes, checked padded-vs-exact over buckets.

  Args:
    fun: takes flat arrays, returns a pytree of arrays.
    shapes: ``shapes(*dims) -> list of shapes``, called with symbolic dims, true sizes and
      bucket sizes in turn.
    dims: the dimension variable names.
    constraints: ``jax.export.symbolic_shape`` constraints (e.g. ``"t <= 16"``).
    dtypes: one per input (default float32).
    inputs: ``inputs(rng, shapes) -> list of arrays`` at true shapes (default: normal / ints).
  """

  def __init__(
    self,
    fun: Callable,
    shapes: Callable,
    dims: Sequence[str] = ("b", "t"),
    constraints: Sequence[str] = (),
    dtypes: Sequence | None = None,
    inputs: Callable | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-5,
  ):
    self.fun = fun
    self.shapes = shapes
    self.dims = tuple(dims)
    sym = export.symbolic_shape(", ".join(self.dims), constraints=tuple(constraints))
    sym_shapes = shapes(*sym)
    self.dtypes = list(dtypes) if dtypes is not None else [jnp.float32] * len(sym_shapes)
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(sym_shapes, self.dtypes, strict=True)]
    self.closed = jax.make_jaxpr(fun)(*specs)
    self.inputs = inputs
    self.rtol, self.atol = rtol, atol
    self._plans: dict = {}
    self._exact = jax.jit(fun)

  def plan(self, bucket: Sequence[int]):
    key = tuple(bucket)
    if key not in self._plans:
      plan = pad_jaxpr(self.closed, self.dims, dict(zip(self.dims, key, strict=True)))
      self._plans[key] = (plan, jax.jit(plan.fun))
    return self._plans[key][0]

  def run_padded(self, true, bucket, exact_args, garbage="mixed", seed=0):
    self.plan(bucket)
    _, fn = self._plans[tuple(bucket)]
    rng = np.random.default_rng(seed + 1000)
    padded = []
    for a, s, dt in zip(exact_args, self.shapes(*bucket), self.dtypes, strict=True):
      a = np.asarray(a)
      if not np.issubdtype(np.dtype(dt), np.number) and np.dtype(dt) != np.bool_:
        padded.append(a)  # keys etc.: static shapes only
        continue
      p = garbage_like(rng, s, a.dtype, garbage)
      p[tuple(slice(0, n) for n in a.shape)] = a
      padded.append(p)
    sizes = tuple(jnp.int32(n) for n in true)
    return fn(sizes, *padded)

  def check(self, true: Sequence[int], bucket: Sequence[int], seed: int = 0, garbage="mixed"):
    """Asserts padded == exact for one true size in one bucket; returns the exact outputs."""
    rng = np.random.default_rng(seed)
    true_shapes = self.shapes(*true)
    if self.inputs is not None:
      args = self.inputs(rng, true_shapes)
    else:
      args = default_inputs(rng, true_shapes, self.dtypes)
    ref = jax.tree.leaves(self._exact(*args))
    outs = self.run_padded(true, bucket, args, garbage=garbage, seed=seed)
    assert len(outs) == len(ref)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
      r = np.asarray(r)
      got = np.asarray(o)[tuple(slice(0, n) for n in r.shape)]
      assert got.shape == r.shape, (i, got.shape, r.shape)
      msg = f"output {i}, true {tuple(true)}, bucket {tuple(bucket)}, garbage {garbage}"
      if np.issubdtype(r.dtype, np.inexact):
        np.testing.assert_allclose(
          got, r, rtol=self.rtol, atol=self.atol, equal_nan=True, err_msg=msg
        )
      else:
        np.testing.assert_array_equal(got, r, err_msg=msg)
    return ref


def family_case(fun: Callable, shapes: Callable, dims: Sequence[str] = ("b", "t"), **kw) -> Case:
  """A :class:`Case` traced as a family traces: every rebound JAX function installed
  (``bucketing/_rebind``: associative_scan, searchsorted, interp, convolve, shuffle, wrap
  padding), so those bind dynjax's primitives where JAX would refuse a symbolic size."""
  _rebind.install_all()
  with _rebind.family_tracing():
    return Case(fun, shapes, dims, **kw)
