"""padding="auto" through dynjax.jit: exact results, one executable per bucket, fallbacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dynjax


def encoder_block(x, w):
  """Natural, unmasked attention + layer norm over a dynamic time axis."""
  q = x @ w
  att = jax.nn.softmax(q @ jnp.swapaxes(x, 1, 2) / jnp.sqrt(x.shape[-1]), axis=-1)
  h = att @ x + x
  mu = h.mean(axis=(1, 2), keepdims=True)  # statistics over time too: mixes padded positions
  return (h - mu) / jnp.sqrt(h.var(axis=(1, 2), keepdims=True) + 1e-5)


W = np.random.RandomState(0).randn(8, 8).astype(np.float32) / 3


@given(b=st.integers(1, 4), t=st.integers(1, 64))
def test_auto_is_exact_on_an_unmasked_block(b, t):
  x = np.random.RandomState(t).randn(b, t, 8).astype(np.float32)
  got = _block(x, W)
  want = jax.jit(encoder_block)(x, W)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


_block = dynjax.jit(encoder_block, dims={"x": "b, t, 8"},
                    buckets={"b": [4], "t": dynjax.buckets.pow2(8, 64)})


def test_auto_one_executable_serves_every_size_in_a_bucket(compiles):
  f = dynjax.jit(lambda x: x.mean(1) + x.max(1), dims={"x": "b, t"},
                 buckets={"b": [2], "t": dynjax.buckets.pow2(16, 64)})
  for t in range(1, 65):
    x = np.random.RandomState(t).randn(2, t).astype(np.float32)
    np.testing.assert_allclose(f(x), x.mean(1) + x.max(1), rtol=1e-5, atol=1e-6)
  assert compiles() == 3 == f.stats()["compiles"]  # t buckets 16, 32, 64
  assert "masked" in f.explain()


def test_auto_compound_output_dims_are_unpadded_exactly():
  f = dynjax.jit(lambda x, y: (jnp.concatenate([x, y], 0), x.reshape(-1)),
                 dims={"x": "t, 3", "y": "s, 3"})
  x = np.arange(15, dtype=np.float32).reshape(5, 3)
  y = -np.arange(6, dtype=np.float32).reshape(2, 3)
  cat, flat = f(x, y)
  np.testing.assert_array_equal(cat, np.concatenate([x, y]))
  np.testing.assert_array_equal(flat, x.reshape(-1))


def test_auto_gradients_of_a_training_step_are_exact():
  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  step = dynjax.jit(lambda w, x: jax.value_and_grad(loss)(w, x), dims={"x": "t, 8"})
  for t in (1, 5, 16, 33):
    x = np.random.RandomState(t).randn(t, 8).astype(np.float32)
    (l1, g1), (l2, g2) = step(W, x), jax.jit(jax.value_and_grad(loss))(W, x)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-6)


def test_unsupported_primitive_falls_back_with_one_warning_naming_it():
  f = dynjax.jit(lambda x: jnp.abs(jnp.fft.fft(x)), dims={"x": "t"})
  x = np.random.RandomState(0).randn(7).astype(np.float32)
  with pytest.warns(UserWarning, match=r"no exact rule for 'fft' at .*test_jit_auto.py:\d+"):
    np.testing.assert_allclose(f(x), np.abs(np.fft.fft(x)), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(f(x[:5]), np.abs(np.fft.fft(x[:5])), rtol=1e-4, atol=1e-4)
  s = f.stats()
  assert len(s["fallbacks"]) == 1 and "fft" in s["fallbacks"][0]
  assert s["exact_calls"] == 2 and "FALLBACK" in f.explain()


def test_auto_check_mode_agrees():
  f = dynjax.jit(lambda x: jax.nn.logsumexp(x, axis=1), dims={"x": "b, t"}, check=True)
  for t in (3, 9, 17):
    f(np.random.RandomState(t).randn(2, t).astype(np.float32))
  assert f.stats()["calls"] == 3


def test_on_fallback_error_refuses_the_compile_storm():
  f = dynjax.jit(lambda x: jnp.abs(jnp.fft.fft(x)), dims={"x": "t"}, on_fallback="error")
  x = np.ones(7, np.float32)
  with pytest.raises(dynjax.PaddingFallbackError) as e:
    f(x)
  msg = str(e.value)
  assert msg.startswith(
    "dynjax.jit(<lambda>): padding='auto' cannot pad this function and on_fallback='error' "
    "refuses to run it unpadded (one compile per shape): the padding pass has no exact rule "
    "for 'fft' at "
  )
  assert "test_jit_auto.py" in msg and msg.endswith(
    "or on_fallback='warn' to accept one compile per shape"
  )
  assert isinstance(e.value, RuntimeError)
  assert f.stats()["fallbacks"] == []  # nothing ran unpadded
  with pytest.raises(dynjax.PaddingFallbackError):
    f(x)  # every call refuses, not only the first


def test_on_fallback_is_validated_and_passes_through_flax():
  with pytest.raises(
    dynjax.SpecError, match=r"on_fallback='loud' is not valid; use one of 'warn', 'error'"
  ):
    dynjax.jit(lambda x: x, on_fallback="loud")
  flax_nn = pytest.importorskip("flax.linen")

  class Fft(flax_nn.Module):
    def __call__(self, x):
      return jnp.abs(jnp.fft.fft(x))

  f = dynjax.flax.jit(Fft(), dims={"x": "t"}, on_fallback="error")
  with pytest.raises(dynjax.PaddingFallbackError, match="'fft'"):
    f({}, np.ones(5, np.float32))


def test_per_row_flip_roll_under_vmap_pads_without_fallback(compiles):
  # The backward direction of a BiLSTM reverses each padded row by its own length;
  # a literal fill (TypedNdArray) made the concatenate rule crash and the function fall back.
  def flip_rows(x, lengths):
    max_len = x.shape[1]
    one = lambda xi, li: jnp.flip(jnp.roll(xi, max_len - li, axis=0), axis=0)
    return jax.vmap(one)(x, lengths)

  f = dynjax.jit(
    flip_rows, dims={"x": "b, t, 4", "lengths": "b"}, buckets=[4, 8], on_fallback="error"
  )
  ref = jax.jit(flip_rows)
  rng = np.random.default_rng(0)
  for b, t in [(1, 1), (3, 4), (2, 7)]:
    x = rng.normal(size=(b, t, 4)).astype(np.float32)
    lengths = np.concatenate([[t], rng.integers(1, t + 1, b - 1)]).astype(np.int32)
    np.testing.assert_array_equal(f(x, lengths), ref(x, lengths))
  assert f.stats()["fallbacks"] == [] and f.stats()["compiles"] == 2
