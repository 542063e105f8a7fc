"""One input contract for every call: a warm function checks what a fresh one checks.

Bad inputs get the same error after a good call as before it; numpy's 64-bit dtypes run as
``jax.jit`` runs them with x64 off; options that could never apply are refused at ``jit()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax


def _double(x):
  return x * 2.0


def _fn():
  return dynjax.jit(_double, dims={"x": "b, t"}, buckets={"t": dynjax.buckets.pow2(4, 64)})


def _error_of(f, arg):
  with pytest.raises(Exception) as info:
    f(arg)
  return type(info.value), str(info.value)


@pytest.mark.parametrize("bad", [None, [[1.0, 2.0]], "abc", np.ones((3,), np.float32)],
                         ids=["none", "list", "str", "rank1"])
def test_warm_function_rejects_what_a_fresh_one_rejects(bad):
  cold = _error_of(_fn(), bad)
  f = _fn()
  f(np.ones((2, 3), np.float32))  # warm: the hot path holds an executor for this family
  warm = _error_of(f, bad)
  if bad is None:  # an argument with no leaves: nothing to pad, the function's own error
    assert cold == _error_of(jax.jit(_double), bad)  # (as jax.jit raises it, no fallback)
  else:
    assert issubclass(cold[0], dynjax.DynjaxError), cold
  assert warm == cold
  np.testing.assert_array_equal(f(np.ones((2, 3), np.float32)), np.full((2, 3), 2.0))


@pytest.mark.skipif(jnp.ones(()).dtype == jnp.float64, reason="x64 is on: float64 stays")
def test_float64_and_int64_run_as_jax_jit_runs_them_with_x64_off(compiles):
  f = _fn()
  x64 = np.random.RandomState(0).randn(2, 7)
  want = np.asarray(jax.jit(_double)(x64))
  assert want.dtype == np.float32
  out = f(x64)  # first call with float64: traced as float32
  assert out.dtype == np.float32 and out.shape == (2, 7)
  np.testing.assert_array_equal(out, want)
  before = compiles()
  out32 = f(x64.astype(np.float32))  # float32 afterwards: same family, same executable
  np.testing.assert_array_equal(out32, want)
  np.testing.assert_array_equal(f(x64[:, :6]), want[:, :6])  # same bucket (t=8)
  assert compiles() == before and f.stats()["compiles"] == 1
  assert "x float64 -> float32" in f.explain()
  g = dynjax.jit(lambda i: i + 1, dims={"i": "t"})
  np.testing.assert_array_equal(g(np.arange(5, dtype=np.int32)), np.arange(1, 6))
  out = g(np.arange(5, dtype=np.int64))
  assert out.dtype == np.int32
  np.testing.assert_array_equal(out, np.arange(1, 6))
  assert "i int64 -> int32" in g.explain()


def test_another_dtype_is_traced_again_as_under_jax_jit():
  # jax.jit retraces for an argument of another dtype; so does dynjax (a family of its own,
  # warm path included), where it used to raise DtypeMismatchError.
  f = _fn()
  f(np.ones((2, 3), np.float32))
  out = f(jnp.ones((2, 3), jnp.float32))
  assert isinstance(out, jax.Array)
  for x in (jnp.arange(6, dtype=jnp.int32).reshape(2, 3), np.full((2, 5), 3, np.int32),
            jnp.ones((1, 7), jnp.bfloat16)):
    want = jax.jit(_double)(x)
    got = f(x)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  text = f.explain()
  assert text.count("family ") == 3
  assert "x: int32[b, t]" in text and "x: bfloat16[b, t]" in text


def test_buckets_naming_no_auto_dim_are_refused_at_jit():
  with pytest.raises(dynjax.SpecError, match=r"buckets names \['t'\], but with dims=\"auto\""):
    dynjax.jit(_double, buckets={"t": dynjax.buckets.pow2(4, 16)})
  f = dynjax.jit(_double, buckets={"d0": dynjax.buckets.pow2(4, 16)})  # auto names are d0...
  f(np.ones((2, 3), np.float32))
  np.testing.assert_array_equal(f(np.ones((2, 5), np.float32)), np.full((2, 5), 2.0))


def test_every_unparsable_dims_spec_is_reported_at_jit():
  def two(x, y):
    return x + y

  with pytest.raises(dynjax.SpecError) as info:
    dynjax.jit(two, dims={"x": "b t", "y": "b,, t"})
  msg = str(info.value)
  assert "dims['x'] = 'b t' does not parse" in msg
  assert "dims['y'] = 'b,, t' does not parse" in msg
  assert "jax.export.symbolic_shape syntax" in msg
  with pytest.raises(dynjax.SpecError, match=r"dims\['x'\]\[0\]: expected a string"):
    dynjax.jit(two, dims={"x": [3]})
