"""Gradients of strided convolutions along a dynamic axis (``bucketing/_conv_vjp.py``).

JAX's transposes of ``conv_general_dilated`` compute their padding from the shapes; for a
strided conv over an axis of symbolic length that padding is symbolic and JAX refused it, so a
training step with a Whisper/wav2vec2-style stride-2 front end fell back to one compile per
shape (found by ``tests/trials/_clients2.py``'s ``conv_audio train``).  Each case here is
compared with ``jax.jit`` at every exact shape, and must run on one executable per bucket.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dynjax
from dynjax.bucketing import _conv_vjp

NWC = ("NWC", "WIO", "NWC")


def _conv1d(stride, padding, lhs_dilation=None, groups=1):
  def loss(w, x):
    y = lax.conv_general_dilated(x, w, (stride,), padding, lhs_dilation=lhs_dilation,
                                 dimension_numbers=NWC, feature_group_count=groups)
    # weights along time, so that each output position's gradient differs
    return jnp.sum(jnp.sin(y) * (1.0 + jnp.arange(y.shape[1]))[None, :, None])

  return loss


CASES = {
  "stride2 pad(1,1) (whisper)": (_conv1d(2, [(1, 1)]), (3, 3, 4)),
  "stride2 SAME": (_conv1d(2, "SAME"), (3, 3, 4)),
  "stride2 VALID": (_conv1d(2, "VALID"), (3, 3, 4)),
  "stride3 k5 pad(2,0)": (_conv1d(3, [(2, 0)]), (5, 3, 4)),
  "depthwise stride2": (_conv1d(2, [(1, 1)], groups=3), (3, 1, 3)),
  "transposed conv (lhs dilation 2)": (_conv1d(1, [(1, 2)], lhs_dilation=(2,)), (3, 3, 4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_of_a_strided_conv_over_a_dynamic_axis_are_bucketed_and_exact(name):
  loss, wshape = CASES[name]
  step = jax.value_and_grad(loss, argnums=(0, 1))
  f = dynjax.jit(step, dims={"w": None, "x": "b, t, 3"}, buckets={"t": [8, 16]},
                 constraints=["t >= 3"])
  rng = np.random.default_rng(0)
  w = rng.normal(size=wshape).astype(np.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a fallback warns: fail
    for t in (3, 5, 8, 11, 16):
      x = rng.normal(size=(2, t, 3)).astype(np.float32)
      got, want = f(w, x), jax.jit(step)(w, x)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.shape(a) == np.shape(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert f.stats()["fallbacks"] == []
  assert f.stats()["compiles"] == 2


def test_a_flax_strided_conv_training_step_is_bucketed():
  nn = pytest.importorskip("flax.linen")
  model = nn.Sequential([nn.Conv(4, (3,), padding="SAME"), nn.gelu,
                         nn.Conv(4, (3,), strides=(2,), padding=((1, 1),))])
  params = model.init(jax.random.key(0), jnp.ones((1, 8, 3)))

  def step(params, x):
    return jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)

  f = dynjax.jit(step, dims={"params": None, "x": "b, t, 3"}, buckets={"t": [8, 16]})
  rng = np.random.default_rng(1)
  for t in (1, 8, 13):
    x = rng.normal(size=(2, t, 3)).astype(np.float32)
    got, want = f(params, x), jax.jit(step)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert f.stats()["fallbacks"] == [] and f.stats()["compiles"] == 2


def test_outside_a_family_trace_the_wrapper_is_jax():
  _conv_vjp.install()
  x = np.random.default_rng(2).normal(size=(1, 7, 3)).astype(np.float32)
  w = np.ones((3, 3, 4), np.float32)
  want = lax.conv_general_dilated(x, w, (2,), [(1, 1)], dimension_numbers=NWC)
  np.testing.assert_array_equal(_conv_vjp.conv(x, w, (2,), [(1, 1)], dimension_numbers=NWC),
                                want)
  t = jax.export.symbolic_shape("t")[0]
  with pytest.raises(ValueError, match=_conv_vjp.FAILURE):  # JAX's own refusal, untouched
    jax.eval_shape(lambda x: _conv_vjp.conv(x, w, (1,), [(0, t)], dimension_numbers=NWC),
                   jax.ShapeDtypeStruct((1, t, 3), np.float32))
  assert _conv_vjp.is_refusal(ValueError(
      f"{_conv_vjp.FAILURE} should be a string or a sequence of (low, high) pairs, got "
      "[(1, 2*floordiv(t - 1, 2) - t + 2)]"))
  assert not _conv_vjp.is_refusal(ValueError(
      f"{_conv_vjp.FAILURE} should be a string or a sequence of (low, high) pairs, got [1]"))
