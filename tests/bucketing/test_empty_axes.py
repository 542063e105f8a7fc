"""Axes that are empty at a bucket: a conv front end (HF Flax wav2vec2's feature extractor:
VALID convs with kernels 10 and 3, a constant pad, a conv positional embedding) leaves no
frames at a small length.  The padding pass probed the policy's smallest bucket, met an empty
axis there, and a rule crashed on it (the pad rule's gather, the fused softmax's max): the
whole family fell back to one compile per shape with "a dynjax bug: please report it"."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dynjax
from dynjax.bucketing._padding import empty_dims

TAPS10 = jnp.linspace(-1.0, 1.0, 10).reshape(10, 1, 1)  # (width, in, out), as flax's nn.Conv
TAPS3 = jnp.linspace(-1.0, 1.0, 3).reshape(3, 1, 1)
NWC = ("NWC", "WIO", "NWC")


def front_end(x):  # x: [t] samples -> [(t - 10) // 5 + 1] frames, none below 10 samples
  frames = lax.conv_general_dilated(x[None, :, None], TAPS10, (5,), "VALID", dimension_numbers=NWC)
  y = jnp.pad(frames, ((0, 0), (1, 1), (0, 0)))  # wav2vec2's FlaxConvWithWeightNorm
  z = lax.conv_general_dilated(y, TAPS3, (1,), "VALID", dimension_numbers=NWC)
  return jax.nn.gelu(z + frames)[0, :, 0]


def test_a_conv_front_end_is_bucketed_and_exact_from_empty_to_long():
  g = dynjax.jit(front_end, dims={"x": "t"}, buckets={"t": dynjax.buckets.pow2(min=8)},
                 padding="auto", on_fallback="error")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # 30 first: the probe; 8 and 3 leave no frames (bucket 8: an empty axis), 12 one frame
    for t in (30, 64, 100, 8, 3, 12):
      x = np.random.default_rng(t).normal(size=t).astype(np.float32)
      got, want = g(x), jax.jit(front_end)(x)
      assert got.shape == want.shape
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert g.stats()["fallbacks"] == []
  assert g.stats()["compiles"] == 5  # buckets 8, 16, 32, 64, 128


def test_empty_dims_names_the_variables_of_axes_below_one():
  from jax import export

  t, = export.symbolic_shape("t")
  closed = jax.make_jaxpr(front_end)(jax.ShapeDtypeStruct((t,), jnp.float32))
  assert empty_dims(closed, {"t": 8}) == {"t"}  # (8 - 10) // 5 + 1 = 0 frames
  assert empty_dims(closed, {"t": 10}) == set()
