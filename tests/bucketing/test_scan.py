"""``jax.lax.associative_scan`` over a dynamic axis (``dynjax/bucketing/_scan.py``): bucketed
and exact under ``padding="auto"``, forward, reversed, differentiated and vmapped, where it
used to fall back to one compile per shape."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export, lax

import dynjax
from dynjax.bucketing import _scan
from tests.bucketing._harness import family_case


def _recurrence(x, reverse=False, axis=1):
  # h_t = a_t h_{t-1} + b_t (S5 / LRU): elements (a, b), a in (0, 1)
  a, b = jax.nn.sigmoid(x[..., :4]), x[..., 4:]
  return lax.associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (a, b),
                              reverse=reverse, axis=axis)[1]


def _close(got, want, rtol=1e-6, atol=1e-6):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.shape(g) == np.shape(w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_linear_recurrence_is_bucketed_and_equal_to_jax_jit(reverse, compiles):
  f = dynjax.jit(lambda x: _recurrence(x, reverse), dims={"x": "b, t, 8"},
                 buckets={"t": [8, 16]}, on_fallback="error")
  rng = np.random.default_rng(0)
  want_fn = jax.jit(lambda x: _recurrence(x, reverse))
  xs = [rng.standard_normal((2, t, 8)).astype(np.float32) for t in (1, 3, 5, 8, 11, 16)]
  for x in xs:
    want_fn(x)
  before = compiles()
  for x in xs:
    got = f(x)
    assert got.shape == (2, x.shape[1], 4)
    _close(got, want_fn(x))  # bitwise but for XLA's fusion choices (1 ulp seen)
  assert compiles() - before == 2  # one executable a bucket
  assert f.stats()["fallbacks"] == []
  text = f.explain()
  assert "dynjax_associative_scan at" in text and "test_scan.py" in text  # the user's line
  assert ("reversed within the true length" in text) == reverse


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("garbage", ["mixed", "nan"])
def test_forward_and_gradients_hold_with_nan_and_inf_in_the_padding(reverse, garbage):
  # The padding pass's harness puts NaN, +-inf and 1e30 in the padded region.  The forward
  # keeps it in the tail; the backward must not multiply a 0 cotangent by a derivative taken
  # there (NaN), nor let it reach the gradient of a parameter fn closes over.
  def loss(w, s, x):
    decay = jax.nn.sigmoid(w)  # closed over by fn: an operand of the primitive

    def op(p, q):
      return p[0] * q[0], q[0] * decay * p[1] + q[1] * s

    h = lax.associative_scan(op, (jax.nn.sigmoid(x[..., :4]), x[..., 4:]), axis=1,
                             reverse=reverse)[1]
    return jnp.sum(h * h), h

  fun = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
  case = family_case(lambda w, s, x: fun(w, s[0], x),
                    lambda b, t: [(4,), (1,), (b, t, 8)], rtol=2e-5, atol=2e-5)
  for true, bucket in (((2, 3), (4, 8)), ((3, 7), (4, 8)), ((1, 1), (2, 4)), ((4, 9), (4, 16))):
    case.check(true, bucket, garbage=garbage)


@pytest.mark.parametrize("reverse", [False, True])
def test_an_fn_that_reads_along_the_scan_axis_is_still_jax(reverse):
  # JAX asks fn to act elementwise along the axis; one that does not (a mean over it) gets
  # a result that depends on the recursion's shape at each level.  dynjax's combine at a
  # level sees the arrays JAX's would at the true length, their padded tail masked (it saw
  # the tail, undetected, before session 22: errors of 1.8-6.9 on these values).
  def scan(x):
    def op(p, q):
      return p[0] * q[0], q[0] * p[1] + q[1] + jnp.mean(p[1], axis=1, keepdims=True)
    return lax.associative_scan(op, (jax.nn.sigmoid(x[..., :3]), x[..., 3:]), axis=1,
                                reverse=reverse)[1]

  case = family_case(lambda x: (scan(x), jax.grad(lambda x: jnp.sum(jnp.sin(scan(x))))(x)),
                    lambda b, t: [(b, t, 6)], rtol=2e-5, atol=2e-5)
  for true, bucket in (((2, 3), (2, 4)), ((2, 5), (4, 8)), ((1, 13), (2, 16)),
                       ((2, 17), (2, 32))):
    case.check(true, bucket, garbage="nan")


def test_an_fn_the_padding_pass_cannot_pad_falls_back_naming_its_line():
  def op(p, q):  # a DFT along the scan axis inside fn: no exact rule
    return p + jnp.real(jnp.fft.ifft(jnp.fft.fft(q, axis=1), axis=1))

  f = dynjax.jit(lambda x: lax.associative_scan(op, x, axis=1), dims={"x": "b, t"},
                 on_fallback="error")
  with pytest.raises(dynjax.PaddingFallbackError, match=r"'fft' at .*test_scan\.py:\d+.*\.op\)"):
    f(np.ones((2, 7), np.float32))


def test_a_scan_along_a_longer_axis_and_an_integer_leaf():
  # minGRU's idiom (a prepended element, states[1:]) and a segmented sum whose reset flags
  # are a boolean leaf of the elements (no tangent of their own).
  def min_gru(x):
    z, h = jax.nn.sigmoid(x[:, :, :3]), x[:, :, 3:]
    a = jnp.concatenate([jnp.ones_like(z[:, :1]), 1 - z], axis=1)  # length t + 1
    b = jnp.concatenate([jnp.zeros_like(z[:, :1]), z * h], axis=1)
    _, s = lax.associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (a, b), axis=1)
    return s[:, 1:]

  def segmented(x, resets):
    def op(p, q):
      return jnp.where(q[1], q[0], p[0] + q[0]), p[1] | q[1]
    return lax.associative_scan(op, (x, resets), axis=1)[0]

  case = family_case(lambda x: (min_gru(x), jax.grad(lambda x: jnp.sum(min_gru(x) ** 2))(x)),
                    lambda b, t: [(b, t, 6)])
  seg = family_case(lambda x, r: (segmented(x, r),
                                 jax.grad(lambda x: jnp.sum(segmented(x, r) ** 2))(x)),
                   lambda b, t: [(b, t, 2), (b, t, 2)], dtypes=[jnp.float32, jnp.bool_])
  for true, bucket in (((2, 5), (2, 8)), ((3, 8), (4, 8)), ((1, 2), (2, 16))):
    case.check(true, bucket)
    seg.check(true, bucket)


class _LRU:
  """A linear recurrent unit in the idiom of its public JAX code: the scan is written for one
  sequence and vmapped over the batch."""

  @staticmethod
  def init(rng, d_in, d_hidden):
    k1, k2, k3 = jax.random.split(rng, 3)
    return {"nu_log": jnp.log(-jnp.log(jax.random.uniform(k1, (d_hidden,), minval=0.8,
                                                           maxval=0.99))),
            "B": jax.random.normal(k2, (d_in, d_hidden)) / np.sqrt(d_in),
            "C": jax.random.normal(k3, (d_hidden, d_in)) / np.sqrt(d_hidden)}

  @staticmethod
  def one(params, x):  # x (t, d_in)
    lam = jnp.exp(-jnp.exp(params["nu_log"]))
    bu = x @ params["B"]
    lam_el = jnp.broadcast_to(lam, bu.shape)

    def binary_operator(e_i, e_j):
      a_i, bu_i = e_i
      a_j, bu_j = e_j
      return a_j * a_i, a_j * bu_i + bu_j

    _, h = jax.lax.associative_scan(binary_operator, (lam_el, bu))
    return h @ params["C"] + x

  @staticmethod
  def apply(params, x, lengths):  # x (b, t, d_in)
    y = jax.vmap(_LRU.one, in_axes=(None, 0))(params, x)
    mask = jnp.arange(x.shape[1])[None, :, None] < lengths[:, None, None]
    return jnp.sum(jnp.where(mask, y, 0.0), axis=1) / lengths[:, None]


def test_an_lru_vmapped_over_a_dynamic_batch_trains_exactly(compiles):
  params = _LRU.init(jax.random.key(0), 6, 16)

  def loss(p, x, lengths, target):
    return jnp.mean((_LRU.apply(p, x, lengths) - target) ** 2)

  step = dynjax.jit(jax.value_and_grad(loss), dims={"x": "b, t, 6", "lengths": "b",
                                                    "target": "b, 6"}, on_fallback="error")
  exact = jax.jit(jax.value_and_grad(loss))
  rng = np.random.default_rng(1)
  for b, t in ((3, 5), (2, 7), (5, 12), (1, 3)):
    x = rng.standard_normal((b, t, 6)).astype(np.float32)
    lengths = rng.integers(1, t + 1, size=b).astype(np.int32)
    target = rng.standard_normal((b, 6)).astype(np.float32)
    _close(step(params, x, lengths, target), exact(params, x, lengths, target), rtol=2e-5,
           atol=2e-6)
  assert step.stats()["fallbacks"] == []
  stats = step.stats()
  assert sorted(stats["per_bucket_calls"]) == ["b=1, t=4", "b=2, t=8", "b=4, t=8", "b=8, t=16"]
  assert stats["compiles"] == 4 and stats["exact_calls"] == 0


_MODULE_SOURCE = """
import jax
from jax.lax import associative_scan  # bound before dynjax rebinds jax.lax's name

def cumprod_rows(x):
  return associative_scan(jax.numpy.multiply, x, axis=1)
"""


def test_a_name_imported_from_jax_lax_is_rebound_and_jax_is_jax_outside_a_family():
  mod = types.ModuleType("dynjax_test_scan_client")
  exec(compile(_MODULE_SOURCE, "dynjax_test_scan_client.py", "exec"), mod.__dict__)
  mod.associative_scan = _scan._ORIGINAL  # as if imported before any dynjax trace
  sys.modules[mod.__name__] = mod
  try:
    f = dynjax.jit(mod.cumprod_rows, dims={"x": "b, t"}, on_fallback="error")
    x = np.random.default_rng(2).uniform(0.5, 1.5, (3, 6)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jax.jit(mod.cumprod_rows)(x)))
    assert mod.associative_scan is _scan.associative_scan
    assert jax.lax.associative_scan is _scan.associative_scan
  finally:
    del sys.modules[mod.__name__]
  # Outside a family's trace it is JAX's function: a symbolic jax.export still refuses it,
  # concrete calls are JAX's, and help() shows JAX's documentation.
  (t,) = export.symbolic_shape("t")
  with pytest.raises(NotImplementedError, match=_scan.FAILURE):
    jax.make_jaxpr(mod.cumprod_rows)(jax.ShapeDtypeStruct((2, t), jnp.float32))
  assert jax.lax.associative_scan.__doc__ == _scan._ORIGINAL.__doc__
  np.testing.assert_array_equal(jax.lax.associative_scan(jnp.add, jnp.arange(5)),
                                np.cumsum(np.arange(5)))


def test_what_it_cannot_bind_falls_back_with_advice_and_user_bugs_raise_as_jax_raises():
  def printing(x):  # fn with an effect: not a primitive's body
    def op(a, b):
      jax.debug.print("{}", a.sum())
      return a + b
    return lax.associative_scan(op, x, axis=1)

  f = dynjax.jit(printing, dims={"x": "b, t"}, on_fallback="error")
  with pytest.raises(dynjax.PaddingFallbackError, match=r"associative scan over axis of "
                     r"non-constant size.*dynjax binds it as a bucketed primitive unless fn has effects"):
    f(np.ones((2, 3), np.float32))

  def wrong(x):  # returns one array for a pair of elements
    return lax.associative_scan(lambda a, b: a[0] + b[0], (x, x), axis=1)

  with pytest.raises(Exception) as jax_error:
    jax.jit(wrong)(np.ones((2, 3), np.float32))
  g = dynjax.jit(wrong, dims={"x": "b, t"})
  with pytest.raises(type(jax_error.value)):
    g(np.ones((2, 3), np.float32))


def test_trust_buckets_a_forward_scan_too(compiles):
  f = dynjax.jit(_recurrence, dims={"x": "b, t, 8"}, buckets={"t": [16]}, padding="trust",
                 on_fallback="error")
  rng = np.random.default_rng(3)
  xs = [rng.standard_normal((2, t, 8)).astype(np.float32) for t in (2, 9, 16)]
  want = [jax.jit(_recurrence)(x) for x in xs]
  before = compiles()
  for x, w in zip(xs, want, strict=True):
    _close(f(x), w)
  assert compiles() - before == 1


_PROPERTY = {}


def _property_fns(reverse: bool, axis: int):
  key = (reverse, axis)
  if key not in _PROPERTY:
    def fn(x):
      x = jnp.moveaxis(x, 1, axis)
      out = _recurrence(x, reverse, axis=axis)
      return jnp.moveaxis(out, axis, 1)

    _PROPERTY[key] = (dynjax.jit(fn, dims={"x": "b, t, 8"}, buckets={"t": [4, 16, 64]},
                                 on_fallback="error"), jax.jit(fn))
  return _PROPERTY[key]


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 64), b=st.integers(1, 3), reverse=st.booleans(),
       axis=st.sampled_from([0, 1]))
def test_property_any_length_in_any_bucket_is_jax(t, b, reverse, axis):
  f, want = _property_fns(reverse, axis)
  x = np.random.default_rng(t * 7 + b).standard_normal((b, t, 8)).astype(np.float32)
  _close(f(x), want(x))


def test_a_linen_lru_model_under_dynjax_flax_is_padded_exactly():
  # S5 / LRU's Flax idiom: the layer is written for one sequence, lifted by nn.vmap with the
  # parameters shared, and the model pools over the true lengths.
  import flax.linen as nn

  class LRULayer(nn.Module):
    d_hidden: int

    @nn.compact
    def __call__(self, x):  # (t, d)
      nu_log = self.param("nu_log", lambda k, s: jnp.log(-jnp.log(
          jax.random.uniform(k, s, minval=0.9, maxval=0.999))), (self.d_hidden,))
      bu = nn.Dense(self.d_hidden, use_bias=False)(x)
      lam = jnp.exp(-jnp.exp(nu_log))

      def binary_operator(q_i, q_j):
        a_i, b_i = q_i
        a_j, b_j = q_j
        return a_j * a_i, a_j * b_i + b_j

      _, h = jax.lax.associative_scan(binary_operator, (jnp.broadcast_to(lam, bu.shape), bu))
      return nn.LayerNorm()(nn.Dense(x.shape[-1])(h) + x)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens, lengths):
      x = nn.Embed(50, 16)(tokens)
      x = nn.vmap(LRULayer, in_axes=0, out_axes=0, variable_axes={"params": None},
                  split_rngs={"params": False})(32)(x)
      mask = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None])[..., None]
      pooled = jnp.sum(jnp.where(mask, x, 0.0), axis=1) / lengths[:, None]
      return nn.Dense(3)(pooled)

  model = Model()
  rng = np.random.default_rng(4)
  tok = rng.integers(0, 50, (2, 5)).astype(np.int32)
  variables = model.init(jax.random.key(1), tok, np.array([5, 3], np.int32))
  f = dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"}, on_fallback="error")
  exact = jax.jit(model.apply)
  for b, t in ((2, 5), (3, 11), (1, 16)):
    tok = rng.integers(0, 50, (b, t)).astype(np.int32)
    lengths = rng.integers(1, t + 1, b).astype(np.int32)
    _close(f(variables, tok, lengths), exact(variables, tok, lengths), rtol=1e-5, atol=1e-6)
  assert f.stats()["fallbacks"] == [] and f.stats()["exact_calls"] == 0


def test_under_jax_checkpoint_the_backward_scans_forward_again_and_stays_exact():
  # nn.remat / jax.checkpoint: the forward is recomputed in the backward, so the backward
  # finds no linearization left by the forward and computes its own (explain() says which).
  def layer(w, x):
    a, b = jax.nn.sigmoid(x @ w), x @ w
    return lax.associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (a, b))[1]

  def loss(w, x):
    return jnp.sum(jnp.tanh(jax.checkpoint(layer)(w, x)))

  w = jnp.asarray(np.random.default_rng(5).standard_normal((4, 4)) / 2, jnp.float32)
  f = dynjax.jit(jax.value_and_grad(loss), dims={"x": "t, 4"}, on_fallback="error")
  for t in (3, 9):
    x = np.random.default_rng(t).standard_normal((t, 4)).astype(np.float32)
    _close(f(w, x), jax.jit(jax.value_and_grad(loss))(w, x), rtol=1e-5, atol=1e-6)
  assert "its backward at the padded length (the forward again)" in f.explain()


@pytest.mark.parametrize("name", ["cumprod", "cummax", "cummin_reverse", "cumlogsumexp"])
def test_gradients_of_cumulative_ops_scan_with_it_and_are_bucketed(name):
  # JAX differentiates cumprod / cummax / cummin / cumlogsumexp with associative_scan (inside
  # jax: _cumulative_jvp_rule), so their gradients over a dynamic axis fell back until the
  # module that defines it was rebound too (session 22).
  op = {"cumprod": lambda x: jnp.cumprod(x, axis=1),
        "cummax": lambda x: lax.cummax(x, axis=1),
        "cummin_reverse": lambda x: lax.cummin(x, axis=1, reverse=True),
        "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis=1)}[name]
  fn = jax.grad(lambda x: jnp.sum(jnp.sin(op(x))))
  f = dynjax.jit(fn, dims={"x": "b, t"}, buckets={"t": [8, 16]}, on_fallback="error")
  for t in (3, 8, 13):
    x = np.random.default_rng(t).uniform(0.5, 1.5, (2, t)).astype(np.float32)
    _close(f(x), jax.jit(fn)(x))
  assert f.stats()["fallbacks"] == []
