"""``jnp.convolve`` and ``jnp.correlate`` of a dynamic-length signal (``dynjax/bucketing/
_jnp.py``; ``jnp.interp``'s copy is tested in ``test_search.py``): JAX's code takes ``len()``
of its inputs, which it refuses for a symbolic length, so these ran one compile per shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax.bucketing import _jnp
from tests.bucketing._harness import family_case

KERNEL = np.array([0.25, 0.5, -0.75], np.float32)


def _case(fun, shapes, **kw):
  return family_case(fun, shapes, ("b", "t"), constraints=("t >= 4",), **kw)


def test_every_mode_of_both_with_garbage_in_the_padding_and_gradients():
  def fns(x, k):
    out = []
    for mode in ("full", "same", "valid"):
      out += [jnp.convolve(x, KERNEL, mode=mode), jnp.correlate(x, k, mode=mode),
              jnp.convolve(k, x, mode=mode)]  # the signal second: swapped as JAX swaps (t > 3)
    moving_average = jnp.convolve(x, jnp.ones(3) / 3, mode="valid")
    grads = jax.grad(lambda x, k: jnp.sum(jnp.sin(jnp.convolve(x, k, mode="same"))),
                     argnums=(0, 1))(x, k)
    return out, moving_average, grads

  case = _case(fns, lambda b, t: [(t,), (3,)], rtol=1e-5, atol=1e-5)
  for true, bucket in (((1, 4), (1, 4)), ((1, 5), (1, 8)), ((1, 16), (1, 16)),
                       ((1, 9), (1, 32))):
    case.check(true, bucket, garbage="mixed")


def test_a_signal_shorter_than_the_kernel_runs_exact_under_a_guard(compiles):
  def smooth(x):
    return jnp.convolve(x, jnp.ones(5, np.float32) / 5, mode="same")

  f = dynjax.jit(smooth, dims={"x": "t"}, buckets={"t": [8, 16]})
  rng = np.random.default_rng(0)
  for t in (5, 7, 12, 16):
    x = rng.normal(size=t).astype(np.float32)
    np.testing.assert_allclose(f(x), jax.jit(smooth)(x), rtol=1e-6, atol=1e-6)
  assert f.stats()["fallbacks"] == [] and "t >= 5" in f.explain()
  x = rng.normal(size=3).astype(np.float32)
  want = jax.jit(smooth)(x)
  before = compiles()
  with pytest.warns(UserWarning, match="t >= 5"):
    np.testing.assert_allclose(f(x), want, rtol=1e-6, atol=1e-6)
  assert compiles() - before == 1  # exact at t = 3


def test_outside_a_family_they_are_jax_and_bad_inputs_raise_as_jax_raises():
  _jnp.install()
  assert jnp.convolve is _jnp.convolve and jnp.correlate.__doc__
  np.testing.assert_allclose(jnp.convolve(jnp.arange(4.0), jnp.ones(2)), [0, 1, 3, 5, 3])
  f = dynjax.jit(lambda x: jnp.convolve(x, KERNEL, mode="wide"), dims={"x": "t"})
  with pytest.raises(ValueError, match=r"mode must be one of \['full', 'same', 'valid'\]"):
    f(np.ones(6, np.float32))


def test_random_permutations_over_a_dynamic_axis_are_jax_with_garbage_padding():
  # JAX's shuffle sorts by random bits ceil(3 log(size) / log(2**32 - 1)) times: once up to
  # 1,625 elements, twice above.  tile(..., 300) crosses that inside one bucket (t = 5: 1,500
  # elements, t = 7: 2,100; bucket 8).
  def fns(x, y):
    k = jax.random.key(7)
    return (jax.random.permutation(k, x, axis=1), jax.random.permutation(k, x[0]),
            jax.random.permutation(k, y, axis=1, independent=True),
            jax.random.permutation(k, jnp.tile(x[0], 300)),
            jax.random.choice(k, x[0], (2,), replace=False))

  case = family_case(fns, lambda b, t: [(b, t), (b, t)], ("b", "t"), constraints=("t >= 2",))
  for true, bucket in (((1, 5), (2, 8)), ((2, 7), (2, 8)), ((1, 2), (1, 4)),
                       ((2, 16), (2, 16))):
    case.check(true, bucket, garbage="mixed")
    case.check(true, bucket, seed=1, garbage="nan")


def test_the_rounds_are_jax_s_formula_at_every_size():
  import numpy as np_

  def jax_rounds(s):  # jax._src.random._shuffle's num_rounds
    return int(np_.ceil(3 * np_.log(max(1, s)) / np_.log(np_.iinfo(np_.uint32).max)))

  for s in (1, 2, 3, 1624, 1625, 1626, 2642245, 2642246, 2**31 - 1):
    assert sum(s > t for t in _jnp._THRESHOLDS) == jax_rounds(s), s


def test_wrap_padding_of_a_dynamic_axis_with_garbage_and_under_its_guard(compiles):
  def fns(x, y):  # circular padding, then a VALID conv: a periodic signal's convolution
    w = jnp.pad(x, ((0, 0), (2, 1)), mode="wrap")
    k = jnp.array([0.25, -0.5, 1.0, 0.75], np.float32)
    conv = jax.vmap(lambda r: jnp.convolve(r, k, mode="valid"))(w)
    return w, conv, jnp.pad(y, ((1, 0), (3, 2)), mode="wrap")

  case = family_case(fns, lambda b, t: [(b, t), (b, t)], ("b", "t"),
                     constraints=("t >= 4", "b >= 2"))
  for true, bucket in (((2, 4), (2, 4)), ((2, 5), (4, 8)), ((3, 13), (4, 16))):
    case.check(true, bucket, garbage="mixed")

  def ring(x):
    return jnp.pad(x, ((2, 2), (0, 0)), mode="wrap")

  f = dynjax.jit(ring, dims={"x": "t, 3"}, buckets={"t": [8, 16]})
  x = np.random.default_rng(1).normal(size=(16, 3)).astype(np.float32)
  for t in (3, 8, 11):
    np.testing.assert_array_equal(f(x[:t]), jax.jit(ring)(x[:t]))
  assert f.stats()["fallbacks"] == [] and "t >= 3" in f.explain()
  want = jax.jit(ring)(x[:2])
  before = compiles()
  with pytest.warns(UserWarning, match="t >= 3"):  # the array repeated: JAX's code, exact
    np.testing.assert_array_equal(f(x[:2]), want)
  assert compiles() - before == 1
