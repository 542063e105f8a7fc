"""Repeated blocks padded once a bucket (``bucketing/_outline.py``): a model's layers, traced
once each, are padded and lowered as one jitted template; results equal the flat padding pass
bitwise and ``jax.jit`` at the exact shape, forward and training step."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _harness import Case
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend import core as jex_core

import dynjax
from dynjax._config import config
from dynjax._errors import PaddingUnsupportedError
from dynjax.bucketing import _outline
from dynjax.bucketing._padding import pad_jaxpr

nn = pytest.importorskip("flax.linen")

LENGTHS = [3, 9, 16, 21]


class EncoderBlock(nn.Module):
  """A pre-LN encoder layer as Flax's examples write one (wmt, lm1b)."""

  d: int = 16
  heads: int = 2
  ffn: int = 32

  @nn.compact
  def __call__(self, x, mask):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.d)(y, y, mask=mask)
    x = x + y
    y = nn.LayerNorm()(x)
    y = nn.Dense(self.d)(nn.gelu(nn.Dense(self.ffn)(y)))
    return x + y


class Encoder(nn.Module):
  layers: int = 4

  @nn.compact
  def __call__(self, tokens, lengths):
    x = nn.Embed(50, 16)(tokens)
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    mask = nn.make_attention_mask(valid, valid)  # made once, read by every layer
    for _ in range(self.layers):
      x = EncoderBlock()(x, mask)
    return nn.LayerNorm()(x)


def _batch(t, b=3, seed=0):
  rng = np.random.default_rng(seed + t)
  tok = rng.integers(0, 50, (b, t)).astype(np.int32)
  lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)]).astype(np.int32)
  return tok, lens


@pytest.fixture(scope="module")
def encoder():
  model = Encoder()
  tok, lens = _batch(5)
  return model, model.init(jax.random.PRNGKey(0), tok, lens)


def _run_all(fn, params):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return [np.asarray(fn(params, *_batch(t))) for t in LENGTHS]


def test_layers_are_padded_once_and_match_jax_jit_and_the_flat_pass(encoder, monkeypatch,
                                                                      compiles):
  model, params = encoder
  dims = {"tokens": "b, t", "lengths": "b"}
  buckets = {"t": dynjax.buckets.pow2(8, 32)}
  fn = dynjax.flax.jit(model, dims=dims, buckets=buckets)
  got = _run_all(fn, params)
  n_outlined = compiles()
  ref = jax.jit(model.apply)
  for t, g in zip(LENGTHS, got, strict=True):
    np.testing.assert_allclose(g, np.asarray(ref(params, *_batch(t))), rtol=1e-5, atol=2e-6)
  assert "repeated 4 times: padded and lowered once" in fn.explain()
  lowered = fn.trace(params, *_batch(5)).lower(bucket={"b": 3, "t": 16}).as_text()
  assert lowered.count("call @dynjax_block") == 4, "one lowered template, called a layer"

  monkeypatch.setattr(config, "outline", False)
  flat = dynjax.flax.jit(model, dims=dims, buckets=buckets)
  before = compiles()
  for g, f in zip(got, _run_all(flat, params), strict=True):
    np.testing.assert_array_equal(g, f)  # bitwise: XLA inlines the calls first
  assert "repeated" not in flat.explain()
  assert compiles() - before == n_outlined  # the template adds no XLA compile
  assert "dynjax_block" not in flat.trace(params, *_batch(5)).lower(
    bucket={"b": 3, "t": 16}).as_text()


def test_a_training_step_pads_forward_and_backward_layers_once(encoder):
  model, params = encoder

  def step(params, tokens, lengths):
    def loss(p):
      y = model.apply(p, tokens, lengths)
      valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
      return jnp.sum(jnp.where(valid[..., None], y ** 2, 0.0)) / jnp.sum(lengths)

    return jax.value_and_grad(loss)(params)

  fn = dynjax.jit(step, dims={"tokens": "b, t", "lengths": "b"},
                  buckets={"t": dynjax.buckets.pow2(8, 32)})
  ref = jax.jit(step)
  for t in LENGTHS[1:3]:  # buckets 16 and 32
    (lg, gg), (lr, gr) = fn(params, *_batch(t)), ref(params, *_batch(t))
    np.testing.assert_allclose(lg, lr, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gr), strict=True):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
  assert fn.explain().count("repeated 4 times") >= 2  # the layers, then their backward


# -- finding runs ------------------------------------------------------------------------------


def _layers(x, ws, scales=None):
  mask = jnp.cumsum(jnp.ones_like(x), axis=0) > 1.0  # made once, read at growing distances
  for k, w in enumerate(ws):
    h = jnp.tanh(x @ w) * (1.0 if scales is None else scales[k])
    h = jnp.where(mask, h, 0.0)
    x = x + jax.nn.softmax(h, axis=0) * jnp.sum(h, axis=0, keepdims=True)
  return x


def _jaxpr(fun, *shapes):
  return jax.make_jaxpr(fun)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).jaxpr


@pytest.fixture
def small_blocks(monkeypatch):
  monkeypatch.setattr(_outline, "MIN_PERIOD", 2)
  monkeypatch.setattr(_outline, "MIN_SAVED", 2)


def _exact_and_as_flat(monkeypatch, fun, args, repeats: int, lengths=(3, 7)):
  """``dynjax.jit(fun)`` at each length: close to ``jax.jit`` at the exact shape, its layers
  padded once, and bitwise what the flat pass (``DYNJAX_OUTLINE=0``) gives."""
  rng = np.random.default_rng(0)
  xs = [rng.normal(size=(t, 4)).astype(np.float32) for t in lengths]
  f = dynjax.jit(fun, dims={"x": "t, 4"}, buckets={"t": [8]}, on_fallback="error")
  got = [np.asarray(f(x, *args)) for x in xs]
  for x, g in zip(xs, got, strict=True):
    np.testing.assert_allclose(g, np.asarray(jax.jit(fun)(x, *args)), rtol=1e-6, atol=1e-6)
  assert f"repeated {repeats} times: padded and lowered once" in f.explain()
  monkeypatch.setattr(config, "outline", False)
  flat = dynjax.jit(fun, dims={"x": "t, 4"}, buckets={"t": [8]}, on_fallback="error")
  for x, g in zip(xs, got, strict=True):
    np.testing.assert_array_equal(g, np.asarray(flat(x, *args)))
  assert "repeated" not in flat.explain()


def test_dynjax_jit_pads_five_layers_once_and_equals_jax_jit_and_the_flat_pass(monkeypatch):
  def fun(x, w1, w2, w3, w4, w5):  # 5 layers of 17 equations: over MIN_SAVED as shipped
    return _layers(x, [w1, w2, w3, w4, w5])

  rng = np.random.default_rng(1)
  _exact_and_as_flat(monkeypatch, fun, [rng.normal(size=(4, 4)).astype(np.float32)
                                        for _ in range(5)], 5)


def test_runs_are_found_across_a_value_every_block_reads(small_blocks):
  jaxpr = _jaxpr(lambda x, *ws: _layers(x, ws), (6, 4), *[(4, 4)] * 5)
  (run,) = _outline.find_runs(jaxpr).values()
  assert run.count == 5
  assert [len(i) for i in run.ins] == [3] * 5  # x, w_k and the mask
  assert all(ins[2] is run.ins[0][2] for ins in run.ins)  # one mask


@pytest.mark.parametrize("act", ["relu", "custom_jvp", "custom_vjp"])
def test_layers_with_custom_derivative_activations_are_one_template(small_blocks, monkeypatch,
                                                                   act):
  # jax.nn.relu is a custom_jvp: each call binds its own jvp rule (a new WrappedFun), which
  # only differentiation reads; padded programs are never differentiated, so layers differing
  # there are equal (they were not: an NNX miniGPT's blocks stayed flat).  The same for a
  # user's custom_jvp and custom_vjp activations.
  @jax.custom_jvp
  def soft(x):
    return jnp.logaddexp(x, 0.0)

  soft.defjvp(lambda p, t: (soft(p[0]), t[0] * jax.nn.sigmoid(p[0])))

  @jax.custom_vjp
  def clip(x):
    return jnp.clip(x, -3.0, 3.0)

  clip.defvjp(lambda x: (clip(x), x), lambda x, g: (g * (jnp.abs(x) < 3.0),))
  f = {"relu": jax.nn.relu, "custom_jvp": soft, "custom_vjp": clip}[act]

  def fun(x, *ws):
    for w in ws:
      x = x + f(x @ w)
    return x

  jaxpr = _jaxpr(fun, (6, 4), *[(4, 4)] * 4)
  prim = {"relu": "custom_jvp_call", "custom_jvp": "custom_jvp_call",
          "custom_vjp": "custom_vjp_call"}[act]
  assert sum(prim in e.primitive.name for e in jaxpr.eqns) == 4
  (run,) = _outline.find_runs(jaxpr).values()
  assert run.count == 4
  rng = np.random.default_rng(2)
  _exact_and_as_flat(monkeypatch, fun, [rng.normal(size=(4, 4)).astype(np.float32)
                                        for _ in range(4)], 4)


def test_a_per_layer_constant_is_an_input_of_the_one_template(small_blocks):
  # A per-layer Python scale (1.0, 2.0, 3.0, ...): one template for the 5 layers, the scale
  # its input; the constants every layer shares stay literals in it.  (Before session 32 only
  # the layers with equal constants were one template: 3 here.)
  shapes = [(6, 4), *[(4, 4)] * 5]
  scales = [1.0, 2.0, 3.0, 3.0, 3.0]
  jaxpr = _jaxpr(lambda x, *ws: _layers(x, ws, scales), *shapes)
  (run,) = _outline.find_runs(jaxpr).values()
  assert (run.count, run.hoisted) == (5, 1)
  assert [float(ins[-1].val) for ins in run.ins] == scales
  lits = [v for e in run.template.eqns for v in e.invars if isinstance(v, jex_core.Literal)]
  assert lits and all(float(v.val) not in scales[1:3] for v in lits)  # 0.0, 1.0 (shared)
  # equal scales everywhere: nothing to hoist
  (run,) = _outline.find_runs(_jaxpr(lambda x, *ws: _layers(x, ws, [2.0] * 5), *shapes)).values()
  assert (run.count, run.hoisted) == (5, 0)


def test_layers_scaled_per_layer_are_exact_and_as_flat(monkeypatch):
  def fun(x, w1, w2, w3, w4, w5):  # a per-layer Python scale, weak-typed and not
    x = _layers(x, [w1, w2, w3, w4, w5], [0.5, 1.5, 2.5, 3.5, 4.5])
    return _layers(x, [w1, w2, w3, w4, w5], [np.float32(1 / (k + 1)) for k in range(5)])

  rng = np.random.default_rng(3)
  _exact_and_as_flat(monkeypatch, fun, [rng.normal(size=(4, 4)).astype(np.float32)
                                        for _ in range(5)], 5)


def test_a_weak_typed_per_layer_constant_keeps_its_type_in_the_template(small_blocks,
                                                                     monkeypatch):
  def fun(x, *ws):  # jnp.where's and lax.mul's Python scalars stay weak-typed literals
    for k, w in enumerate(ws):
      h = jnp.tanh(x @ w)
      h = jnp.where(h > 0, h, -0.1 * (k + 1))
      x = x + jax.lax.mul(h, 0.5 + k) + jnp.sum(h, axis=0, keepdims=True)
    return x

  jaxpr = _jaxpr(fun, (6, 4), *[(4, 4)] * 4)
  (run,) = _outline.find_runs(jaxpr).values()
  assert (run.count, run.hoisted) == (4, 2)
  hoisted = run.template.invars[-2:]
  assert all(v.aval.weak_type for v in hoisted)
  rng = np.random.default_rng(4)
  _exact_and_as_flat(monkeypatch, fun, [rng.normal(size=(4, 4)).astype(np.float32)
                                        for _ in range(4)], 4)


def test_blocks_with_other_wiring_are_not_one_template(small_blocks):
  # Layer 0 reads one weight in both of its slots where the others read two: the wiring
  # differs, so the run is the other three layers, each binding its own two weights.
  def two_weights(x, a, b, c, d, e, f, g):
    for w, u in ((a, a), (b, c), (d, e), (f, g)):
      x = x + jnp.tanh(x @ w) @ u
    return x

  jaxpr = _jaxpr(two_weights, (6, 4), *[(4, 4)] * 7)
  (run,) = _outline.find_runs(jaxpr).values()
  ws = jaxpr.invars[1:]
  assert run.count == 3
  assert [(ins[1], ins[2]) for ins in run.ins] == [(ws[1], ws[2]), (ws[3], ws[4]),
                                                  (ws[5], ws[6])]


def _indexed_layers(x, table, ws):
  # Each layer reads its own row of a table made before the layers (HF BERT's head_mask[i]):
  # the rows' slices differ between layers and read nothing of a layer: holes, run first.
  for k, w in enumerate(ws):
    x = x + jnp.tanh(x @ w) * table[k] + jnp.sum(x, axis=0, keepdims=True) * 0.1
    x = jax.nn.softmax(x, axis=0) * x
  return x


def test_each_layer_s_own_row_of_a_table_runs_before_one_template(monkeypatch):
  def fun(x, table, w1, w2, w3, w4, w5, w6):
    return _indexed_layers(x, table * 2.0, [w1, w2, w3, w4, w5, w6])

  monkeypatch.setattr(_outline, "MIN_SAVED", 16)
  shapes = [(6, 4), (6, 4), *[(4, 4)] * 6]
  (run,) = _outline.find_runs(_jaxpr(fun, *shapes)).values()
  assert run.count == 6 and run.holes and len(run.holes) % run.count == 0  # rows of each
  rng = np.random.default_rng(1)
  args = [rng.normal(size=(6, 4)).astype(np.float32)] + [
    rng.normal(size=(4, 4)).astype(np.float32) for _ in range(6)]
  _exact_and_as_flat(monkeypatch, fun, args, 6, lengths=(2, 5))


def test_off_and_below_the_threshold_nothing_is_outlined(monkeypatch):
  jaxpr = _jaxpr(lambda x, *ws: _layers(x, ws), (6, 4), *[(4, 4)] * 3)
  assert _outline.find_runs(jaxpr) == {}  # 3 blocks of 17 equations save fewer than MIN_SAVED
  monkeypatch.setattr(_outline, "MIN_SAVED", 2)
  assert _outline.find_runs(jaxpr)
  monkeypatch.setattr(config, "outline", False)
  assert _outline.find_runs(jaxpr) == {}


@settings(max_examples=20, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["tanh", "cumsum", "softmax", "flip", "sum",
                                                 "max", "shift", "dense", "scale", "fill"]),
                                st.integers(0, 5)), min_size=1, max_size=5),
       sizes=st.sampled_from([((2, 3), (2, 4)), ((1, 5), (2, 8)), ((2, 7), (2, 8))]),
       garbage=st.sampled_from(["mixed", "nan"]))
def test_random_layers_repeated_are_exact_on_the_true_prefix(steps, sizes, garbage):
  ops = {
    "tanh": lambda a, w, c: jnp.tanh(a * w[0]),
    "cumsum": lambda a, w, c: jnp.cumsum(a, axis=1),
    "softmax": lambda a, w, c: jax.nn.softmax(a, axis=1),
    "flip": lambda a, w, c: jnp.flip(a, 1) + w[1],
    "sum": lambda a, w, c: a + jnp.sum(a, axis=1, keepdims=True),
    "max": lambda a, w, c: a - jnp.max(a, axis=1, keepdims=True),
    "shift": lambda a, w, c: jnp.concatenate([a[:, 1:], a[:, :1] * 0], axis=1),
    "dense": lambda a, w, c: a @ w,
    # the layer's own Python constant (a template input since session 32)
    "scale": lambda a, w, c: a * c,
    "fill": lambda a, w, c: jnp.where(a > 0, a, c),
  }

  def layer(x, w, c):
    pool = [x]
    for name, i in steps:
      pool.append(ops[name](pool[i % len(pool)], w, c))
    return x + pool[-1]

  def fun(x, w1, w2, w3):
    for w, c in ((w1, 0.5), (w2, -1.5), (w3, 2.0)):
      x = layer(x, w, c)
    return x

  used = []  # (the run's period, whether its template ran)
  real = _outline.call_run

  def spy(ctx, run, *a):
    used.append((run.period, real(ctx, run, *a)))
    return used[-1][1]

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(_outline, "MIN_PERIOD", 1)
    mp.setattr(_outline, "MIN_SAVED", 1)
    mp.setattr(_outline, "call_run", spy)
    case = Case(fun, lambda b, t: [(b, t, 3), (3, 3), (3, 3), (3, 3)], rtol=2e-4, atol=2e-4)
    case.check(*sizes, seed=len(steps), garbage=garbage)
  # the three layers ran as one template (with these thresholds a template may hold a run of
  # its own, a layer's repeated steps; one that reads a value its flat pass left out goes
  # flat inside the template, exact: steps [cumsum, tanh(1), tanh(0)] make one)
  top = max((p for p, _ in used), default=0)
  assert top and all(ok for p, ok in used if p == top), "the three layers ran as one template"


def test_an_equation_it_cannot_pad_inside_the_blocks_is_named_as_without_them(small_blocks,
                                                                             monkeypatch):
  def fun(x, *ws):
    for w in ws:
      x = x + jnp.fft.fft(x @ w, axis=0).real  # FFT along the dynamic axis: no rule
    return x

  (t,) = jax.export.symbolic_shape("t")
  avals = [jax.ShapeDtypeStruct((t, 4), jnp.float32), *[jax.ShapeDtypeStruct((4, 4),
                                                                           jnp.float32)] * 4]
  went = []
  real = _outline.call_run
  monkeypatch.setattr(_outline, "call_run", lambda *a: went.append(real(*a)) or went[-1])
  messages = []
  for on in (True, False):
    monkeypatch.setattr(config, "outline", on)
    with pytest.raises(PaddingUnsupportedError) as err:
      pad_jaxpr(jax.make_jaxpr(fun)(*avals), ("t",), {"t": 8})
    messages.append(str(err.value))
  assert went and not any(went)  # the run was found, its template failed, it went flat
  assert "fft" in messages[0] and messages[0] == messages[1]
