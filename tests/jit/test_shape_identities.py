"""Shape identities: two shapes JAX cannot unify that are one size written two ways.

A ResNet block (flax's ``examples/imagenet/models.py``) adds a strided 3x3 conv's output to
its strided 1x1 projection: with SAME padding both are ``ceil(h / 2)``, which JAX's symbolic
shapes write as two expressions it cannot prove equal, so ``residual + y`` fails to trace.
The family checks the two agree at every size of the variable's range, re-traces under an
equality rule (``jax.export`` constraints), and checks it on every call.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dynjax
from dynjax.jit import _guards


def _conv(x, w, stride, padding="SAME"):
  return lax.conv_general_dilated(x, w, (stride, stride), padding,
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


def block(x, w1, w2, wp, wq):
  """Two ResNet basic blocks with strided projections, a max pool between them (SAME), and
  the mean over the image."""
  y = jax.nn.relu(_conv(x, w1, 2))
  y = jax.nn.relu(_conv(y, w2, 1) + _conv(x, wp, 2))
  y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
  z = _conv(jax.nn.relu(_conv(y, w2, 2)), w2, 1)
  return jax.nn.relu(z + _conv(y, wq, 2)).mean((1, 2))


def _weights(rng):
  return [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
          for s in ((3, 3, 3, 4), (3, 3, 4, 4), (1, 1, 3, 4), (1, 1, 4, 4))]


def _image(rng, b, h, w):
  return jnp.asarray(rng.normal(size=(b, h, w, 3)), jnp.float32)


def _close(got, want):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_a_strided_residual_block_is_bucketed_exactly(compiles):
  rng = np.random.default_rng(0)
  ws = _weights(rng)

  def fn(x):
    return block(x, *ws)

  f = dynjax.jit(fn, dims={"x": "b, h, w, 3"}, buckets=dynjax.buckets.pow2(min=8, max=64))
  before = compiles()
  for h, w in ((13, 21), (16, 9), (31, 30), (12, 23)):
    x = _image(rng, 2, h, w)
    _close(f(x), jax.jit(fn)(x))
  s = f.stats()
  assert s["fallbacks"] == [] and s["exact_calls"] == 0
  assert s["per_bucket_calls"] == {"b=8, h=16, w=32": 2, "b=8, h=16, w=16": 1,
                                   "b=8, h=32, w=32": 1}
  assert s["compiles"] == 3
  assert compiles() - before >= 3 + 4  # and jax.jit's, one a shape
  text = f.explain()
  assert "floordiv" in text and "==" in text  # the rules it traced under, in explain()


def test_the_rule_needs_the_two_sizes_equal_at_every_size():
  """``x[:, ::2] + x[:, 1::2]``: ceil(t / 2) against floor(t / 2), equal only for even t:
  no rule; the family falls back as before, saying why."""
  f = dynjax.jit(lambda x: x[:, ::2] + x[:, 1::2], dims={"x": "b, t"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = f(np.ones((2, 6), np.float32))
  np.testing.assert_array_equal(out, np.full((2, 3), 2, np.float32))
  assert "incompatible shapes" in f.stats()["fallbacks"][0]
  assert any("running unpadded" in str(w.message) for w in caught)


def test_shape_groups_and_rules_as_jax_prints_them():
  text = ("add got incompatible shapes for broadcasting: (2, floordiv(h - 1, 2) + 1, 16), "
          "(2, - floordiv(- h, 2), 16).")
  assert _guards._shape_groups(text) == [["2", "floordiv(h - 1, 2) + 1", "16"],
                                         ["2", "- floordiv(- h, 2)", "16"]]
  assert _guards._rule("floordiv(h - 1, 2) + 1", "- floordiv(- h, 2)") == (
      "floordiv(h - 1, 2) == - floordiv(- h, 2) - 1")
  assert _guards._rule("h + 1", "h") is None  # a bare variable: never a rule
  assert _guards._equal_over("floordiv(h - 1, 2) + 1", "- floordiv(- h, 2)", "h", 1, 4096)
  assert not _guards._equal_over("floordiv(h, 2)", "- floordiv(- h, 2)", "h", 1, 4096)


def test_an_unbounded_size_past_the_checked_range_runs_exact(monkeypatch):
  monkeypatch.setattr(_guards, "IDENTITY_SCAN", 40)
  rng = np.random.default_rng(1)
  ws = _weights(rng)

  def res(x):
    return jax.nn.relu(_conv(x, ws[0], 2)) + _conv(x, ws[2], 2)

  f = dynjax.jit(res, dims={"x": "b, h, w, 3"}, buckets=dynjax.buckets.pow2(min=8))
  for h in (13, 30):
    x = _image(rng, 1, h, 11)
    _close(f(x), jax.jit(res)(x))
  assert f.stats()["exact_calls"] == 0
  x = _image(rng, 1, 45, 11)  # h past the 40 sizes checked: exact, with one warning
  with pytest.warns(UserWarning, match=r"violate the guard\(s\) h <= 40"):
    _close(f(x), jax.jit(res)(x))
  assert f.stats()["exact_calls"] == 1
  with pytest.raises(dynjax.PaddingFallbackError, match=r"h <= 40"):
    dynjax.jit(res, dims={"x": "b, h, w, 3"}, buckets=dynjax.buckets.pow2(min=8),
               on_fallback="error")(_image(rng, 1, 50, 11))
