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
from dynjax.jit import _facts


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


def test_the_rule_needs_the_two_sizes_equal_at_every_size_or_every_multiple():
  """``x[:, ::3] + x[:, 1::2]`` (ceil(t / 3) against floor(t / 2)) is equal at 2..5 and 7,
  no pattern: no rule, the family falls back as before, saying why.  ``x[:, ::2] + x[:,
  1::2]`` is equal at every even length (jax.jit fails at odd ones): even lengths pad."""
  f = dynjax.jit(lambda x: x[:, ::3] + x[:, 1::2], dims={"x": "b, t"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = f(np.ones((2, 4), np.float32))
  np.testing.assert_array_equal(out, np.full((2, 2), 2, np.float32))
  assert "incompatible shapes" in f.stats()["fallbacks"][0]
  assert any("running unpadded" in str(w.message) for w in caught)
  g = dynjax.jit(lambda x: x[:, ::2] + x[:, 1::2], dims={"x": "b, t"})
  for t in (6, 10, 2):
    x = np.arange(2 * t, dtype=np.float32).reshape(2, t)
    np.testing.assert_array_equal(g(x), x[:, ::2] + x[:, 1::2])
  assert g.stats()["per_bucket_calls"] == {"b=2, t=8": 1, "b=2, t=16": 1, "b=2, t=2": 1}


def test_shape_groups_and_rules_as_jax_prints_them():
  text = ("add got incompatible shapes for broadcasting: (2, floordiv(h - 1, 2) + 1, 16), "
          "(2, - floordiv(- h, 2), 16).")
  assert _facts._shape_groups(text) == [["2", "floordiv(h - 1, 2) + 1", "16"],
                                         ["2", "- floordiv(- h, 2)", "16"]]
  assert _facts._rule("floordiv(h - 1, 2) + 1", "- floordiv(- h, 2)") == (
      "floordiv(h - 1, 2) == - floordiv(- h, 2) - 1")
  assert _facts._rule("h + 1", "h") is None  # a bare variable: never a rule
  assert _facts._equal_sizes("floordiv(h - 1, 2) + 1", "- floordiv(- h, 2)", "h", 1, 4096) == 1
  assert _facts._equal_sizes("floordiv(h, 2)", "- floordiv(- h, 2)", "h", 1, 4096) == 2
  assert _facts._equal_sizes("floordiv(h, 2)", "- floordiv(- h, 3)", "h", 1, 4096) is None


def test_an_unbounded_size_past_the_checked_range_runs_exact(monkeypatch):
  monkeypatch.setattr(_facts, "IDENTITY_SCAN", 40)
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


def _conv1d(x, w, stride):
  return lax.conv_general_dilated(x, w, (stride,), "SAME",
                                  dimension_numbers=("NWC", "WIO", "NWC"))


def test_an_autoencoder_whose_sizes_meet_at_multiples_is_bucketed_at_multiples(compiles):
  """Keras's Conv1D autoencoder (two stride-2 convs, two ``UpSampling1D(2)``, the loss
  ``mean(square(x - y))``): ``4*ceil(ceil(t / 2) / 2)`` is ``t`` for multiples of 4 only, so
  ``jax.jit`` itself fails at other lengths.  The family traces under ``mod(t, 4) == 0``,
  runs other lengths exact (to jax's own error) and rounds buckets up to multiples of 4."""
  rng = np.random.default_rng(2)
  w1, w2, w3 = (jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32)
                for s in ((3, 1, 4), (3, 4, 4), (3, 4, 1)))

  def loss(x):
    h = jax.nn.relu(_conv1d(jax.nn.relu(_conv1d(x, w1, 2)), w2, 2))
    y = _conv1d(jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=1), w3, 1)
    return jnp.mean(jnp.square(x - y))

  f = dynjax.jit(loss, dims={"x": "b, t, 1"}, buckets={"t": dynjax.buckets.linear(6, max=60)})
  for t in (8, 12, 16, 44):  # linear buckets 12, 12, 18 -> 20, 48
    x = jnp.asarray(rng.normal(size=(2, t, 1)), jnp.float32)
    _close(f(x), jax.jit(loss)(x))
  s = f.stats()
  assert s["per_bucket_calls"] == {"b=2, t=12": 2, "b=2, t=20": 1, "b=2, t=48": 1}
  assert s["fallbacks"] == [] and s["exact_calls"] == 0
  x = jnp.ones((2, 10, 1), jnp.float32)
  with pytest.raises(TypeError, match="incompatible shapes"):
    jax.jit(loss)(x)
  with pytest.warns(UserWarning, match=r"violate the guard\(s\) t == "), pytest.raises(
      TypeError, match="incompatible shapes"):
    f(x)  # run exact: jax's own error, as jax.jit raises it
  assert "mod(t, 4) == 0" in f.explain()


# -- facts checked over sizes (jit/_facts.py): the helper's vision probe's three fallbacks ----
_DN = ("NHWC", "HWIO", "NHWC")


def _vit_grid(x):  # big_vision: a VALID patch conv, then the grid flattened
  y = lax.conv_general_dilated(x, jnp.ones((4, 4, 3, 8)), (4, 4), "VALID", dimension_numbers=_DN)
  n, h, w, c = y.shape
  return y.reshape(n, h * w, c).mean(1)


def _unet_skip(x):  # padded to a multiple of 4 as (-h) % 4, pooled, transposed conv, skip
  h, w = x.shape[1:3]
  x = jnp.pad(x, ((0, 0), (0, (-h) % 4), (0, (-w) % 4), (0, 0)))
  d = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
  u = lax.conv_transpose(d, jnp.ones((2, 2, 3, 3)), (2, 2), "SAME", dimension_numbers=_DN)
  return jnp.concatenate([x, u], -1)[:, :h, :w]


def _swin_windows(x):  # the PyTorch Swin's pad, window_partition and window_reverse
  b, h, w, c = x.shape
  x = jnp.pad(x, ((0, 0), (0, (4 - h % 4) % 4), (0, (4 - w % 4) % 4), (0, 0)))
  hp, wp = x.shape[1:3]
  win = x.reshape(b, hp // 4, 4, wp // 4, 4, c).transpose(0, 1, 3, 2, 4, 5).reshape(-1, 16, c)
  bb = win.shape[0] // ((hp // 4) * (wp // 4))
  win = win * jnp.arange(16, dtype=x.dtype)[:, None]  # something done per window
  return win.reshape(bb, hp // 4, wp // 4, 4, 4, -1).transpose(0, 1, 3, 2, 4, 5).reshape(
      bb, hp, wp, -1)[:, :h, :w]


@pytest.mark.parametrize("fn, needs", [
    (_vit_grid, "holds at every size checked"),
    (_unet_skip, "two shapes of one size"),
    (_swin_windows, "one size at every size checked"),
], ids=["vit", "unet", "swin"])
def test_facts_a_trace_needs_are_checked_over_sizes_and_then_per_call(fn, needs):
  rng = np.random.default_rng(3)
  f = dynjax.jit(fn, dims={"x": "b, h, w, 3"}, on_fallback="error")
  for s in ((37, 45), (50, 31), (64, 64)):
    x = jnp.asarray(rng.normal(size=(2, *s, 3)), jnp.float32)
    _close(f(x), jax.jit(fn)(x))
  st = f.stats()
  assert st["per_bucket_calls"] == {"b=2, h=64, w=32": 1, "b=2, h=64, w=64": 2}
  assert st["exact_calls"] == 0
  fam = next(iter(f._dispatcher.families.values()))
  labels = " ".join(text for text, *_ in fam.declared)
  assert needs in labels, labels
