"""``jnp.searchsorted`` (and ``jnp.digitize``, ``jnp.isin``, ``jnp.interp``) into a
dynamic-length array (``dynjax/bucketing/_search.py``): bucketed and exact under
``padding="auto"``, where JAX's refusal of a symbolic length used to fall back to one compile
per shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynjax
from dynjax.bucketing import _jnp
from tests.bucketing._harness import family_case

_METHODS = ["scan", "scan_unrolled", "sort", "compare_all"]


def _data(rng, n, m, *, sort=True, nan=False):
  """Rounded values (ties between the array and the queries), inf and NaN queries."""
  a = np.round(rng.normal(size=n), 1).astype(np.float32)
  if sort:
    a = np.sort(a)
  if nan and n > 2:
    a[1] = np.nan
  v = np.concatenate([np.round(rng.normal(size=m), 1), a[:2], [np.nan, np.inf, -np.inf, -0.0]])
  return a, v.astype(np.float32)


@pytest.mark.parametrize("method", _METHODS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_searchsorted_is_bucketed_and_jax_for_any_contents(method, side, compiles):
  # Unsorted arrays with NaN break the contract; the answer must still be JAX's at the true
  # length (the binary search's path depends on the length).
  def fn(a, v):
    return jnp.searchsorted(a, v, side=side, method=method)

  f = dynjax.jit(fn, dims={"a": "n", "v": "m"}, buckets={"n": [4, 16], "m": [16]},
                 on_fallback="error")
  rng = np.random.default_rng(0)
  cases = [_data(rng, n, 5, sort=s, nan=not s) for n in (1, 3, 4, 7, 16) for s in (True, False)]
  want = [jax.jit(fn)(a, v) for a, v in cases]
  before = compiles()
  for (a, v), w in zip(cases, want, strict=True):
    got = f(a, v)
    assert got.dtype == w.dtype and got.shape == w.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
  assert compiles() - before == 2
  assert f.stats()["fallbacks"] == []
  text = f.explain()
  assert "dynjax_searchsorted at" in text and "test_search.py" in text
  assert ("never read" in text) == method.startswith("scan")


def test_with_garbage_in_the_padding_the_public_idioms_hold():
  # Packed sequences: segment ids from cumulative lengths (both arrays dynamic), a histogram
  # into data-dependent bin edges, interpolation of an irregular series (and its gradient),
  # a membership test.
  def packed(cu, pos):
    return jnp.searchsorted(cu, pos, side="right") - 1

  def fns(edges, x):
    xp = jnp.sort(edges)
    return (packed(xp, x), jnp.digitize(x, xp), jnp.digitize(x, xp[::-1], right=True),
            jnp.isin(x, xp), jnp.interp(x, xp, jnp.sin(xp)),
            jnp.interp(x, xp, jnp.cos(xp), left=-2.0, right="extrapolate"),
            jnp.interp(x, xp, xp * 2, period=3.0),
            jax.grad(lambda e, x: jnp.sum(jnp.interp(x, jnp.sort(e), jnp.sin(e)) ** 2),
                     argnums=(0, 1))(edges, x))

  case = family_case(fns, lambda b, n: [(n,), (b,)], rtol=1e-5, atol=1e-5)
  for true, bucket in (((3, 1), (4, 4)), ((5, 6), (8, 8)), ((1, 9), (2, 16)),
                       ((7, 16), (8, 16))):
    case.check(true, bucket, garbage="mixed")
    case.check(true, bucket, seed=1, garbage="nan")


def test_under_vmap_and_with_a_dynamic_batch_of_queries():
  def fn(a, v):  # one sorted array a row, its own queries
    return jax.vmap(lambda r, q: jnp.searchsorted(jnp.sort(r), q))(a, v)

  def shared(a, v):  # one array, a batch of queries vmapped
    return jax.vmap(lambda q: jnp.searchsorted(jnp.sort(a[0]), q, method="sort"))(v)

  def queries_shared(a, v):  # a batch of arrays, one set of queries
    return jax.vmap(lambda r: jnp.searchsorted(jnp.sort(r), v[0], side="right"))(a)

  for g in (fn, shared, queries_shared):
    case = family_case(g, lambda b, n: [(3, n), (3, b)], dtypes=[jnp.int32, jnp.int32])
    for true, bucket in (((2, 5), (4, 8)), ((6, 1), (8, 2)), ((5, 16), (8, 16))):
      case.check(true, bucket)


def test_jax_outside_a_family_and_bad_inputs_raise_as_jax_raises():
  np.testing.assert_array_equal(jnp.searchsorted(jnp.arange(5.0), 2.5), 3)
  _jnp.install()
  assert jnp.interp is _jnp.interp and jnp.interp.__doc__  # JAX's documentation
  np.testing.assert_allclose(jnp.interp(0.5, jnp.arange(3.0), jnp.arange(3.0) * 2), 1.0)

  def two_d(a, v):  # JAX's own error: a should be 1-dimensional
    return jnp.searchsorted(a, v)

  with pytest.raises(ValueError) as jax_error:
    jax.jit(two_d)(np.ones((2, 3), np.float32), np.ones(2, np.float32))
  f = dynjax.jit(two_d, dims={"a": "b, n", "v": "m"})
  with pytest.raises(ValueError, match=str(jax_error.value)):
    f(np.ones((2, 3), np.float32), np.ones(2, np.float32))

  def mismatched(xp, fp):
    return jnp.interp(0.5, xp, fp)

  g = dynjax.jit(mismatched, dims={"xp": "n", "fp": "k"})
  with pytest.raises(ValueError, match="xp and fp must be one-dimensional arrays of equal size"):
    g(np.ones(3, np.float32), np.ones(4, np.float32))


def test_value_and_grad_through_interp_at_each_size():
  def loss(xp, x):
    return jnp.sum(jnp.interp(x, xp, jnp.tanh(xp)))

  f = dynjax.jit(jax.value_and_grad(loss, argnums=(0, 1)), dims={"xp": "n", "x": "m"},
                 buckets={"n": [8], "m": [8]}, on_fallback="error")
  rng = np.random.default_rng(4)
  for n, m in ((3, 8), (8, 2), (5, 5)):
    xp, x = np.sort(rng.normal(size=n)).astype(np.float32), rng.normal(size=m).astype(np.float32)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xp, x)
    for g, w in zip(jax.tree.leaves(f(xp, x)), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


_PROPERTY: dict = {}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), m=st.integers(1, 6), side=st.sampled_from(["left", "right"]),
       method=st.sampled_from(_METHODS), sort=st.booleans(), seed=st.integers(0, 3))
def test_property_any_length_any_contents_is_jax(n, m, side, method, sort, seed):
  key = (side, method)
  if key not in _PROPERTY:
    def fn(a, v):
      return jnp.searchsorted(a, v, side=side, method=method)
    _PROPERTY[key] = (dynjax.jit(fn, dims={"a": "n", "v": "m"}, buckets={"n": [8, 64],
                                 "m": [16]}, on_fallback="error"), jax.jit(fn))
  f, want = _PROPERTY[key]
  rng = np.random.default_rng(seed * 100 + n)
  a = rng.integers(-4, 5, size=n).astype(np.int32)
  if sort:
    a = np.sort(a)
  v = np.concatenate([rng.integers(-5, 6, size=m), [np.iinfo(np.int32).max,
                                                     np.iinfo(np.int32).min]]).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(f(a, v)), np.asarray(want(a, v)))


def test_under_x64_the_indices_are_int32_as_jax_jit_gives_them():
  # jnp.searchsorted's dtype for a symbolic length is the default int (int64 under x64); JAX's
  # at a true length is int32.  A process of its own: x64 is process-wide.
  import os
  import subprocess
  import sys
  import textwrap

  code = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, dynjax
    a, v = np.sort(np.random.rand(7)), np.random.rand(3)
    for f in (lambda a, v: jnp.searchsorted(a, v), lambda a, v: jnp.digitize(v, a)):
      g = dynjax.jit(f, dims={"a": "n", "v": "m"}, on_fallback="error")
      got, want = g(a, v), jax.jit(f)(a, v)
      assert got.dtype == want.dtype == np.int32, (got.dtype, want.dtype)
      np.testing.assert_array_equal(got, want)
    print("ok")
  """)
  env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
