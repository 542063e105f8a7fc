"""dynjax.flax: Linen and NNX wrappers give jax.jit's exact-shape results, state comes back."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax import flax as dflax
from examples import models

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

CFG = models.EncoderConfig(vocab=97, d_model=32, heads=4, layers=2, ffn=64, max_len=64)
LENGTHS = [5, 7, 16, 17, 30, 64, 9]


def _tokens(t, b=3, seed=0):
  rng = np.random.default_rng(seed + t)
  tok = rng.integers(1, 97, (b, t)).astype(np.int32)
  lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)]).astype(np.int32)
  return tok, lens


@pytest.fixture(params=["trust", "auto"])
def padding(request):
  return request.param


def test_linen_bert_matches_jax_jit(padding, compiles):
  module = models.BertEncoder(CFG)
  variables = models.to_device({"params": models.init_encoder_params(CFG)})
  fn = dflax.jit(module, dims={"tokens": "b, t", "lengths": "b"},
                 buckets={"t": dynjax.buckets.pow2(8, 64)}, padding=padding)
  ref = jax.jit(module.apply)
  for t in LENGTHS:
    tok, lens = _tokens(t)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      got = np.asarray(fn(variables, tok, lens))
    np.testing.assert_allclose(got, np.asarray(ref(variables, tok, lens)), rtol=1e-5, atol=2e-6)
  st = fn.stats()
  assert st["calls"] == len(LENGTHS)
  if padding == "trust":
    assert st["compiles"] == 4  # t in {8, 16, 32, 64}


def test_linen_server_warms_up_from_shapes_before_its_weights_exist(tmp_path):
  # A server's start-up: build the function and start its warmup from abstract arguments
  # (Flax's jax.eval_shape(model.init, ...)), then read the weights; calls run what it built.
  module = models.BertEncoder(CFG)
  fn = dflax.jit(module, dims={"tokens": "b, t", "lengths": "b"}, serving=True,
                 buckets={"t": dynjax.buckets.pow2(8, 64)}, cache_dir=str(tmp_path))
  tok_spec = jax.ShapeDtypeStruct((3, 64), np.int32)
  len_spec = jax.ShapeDtypeStruct((3,), np.int32)
  shapes = jax.eval_shape(module.init, jax.random.key(0), tok_spec, len_spec)
  info = fn.warmup(shapes, tok_spec, len_spec, background=True)
  assert sorted(info["buckets"]) == [(4, 8), (4, 16), (4, 32), (4, 64)]
  variables = models.to_device({"params": models.init_encoder_params(CFG)})
  assert fn.wait(timeout=120)
  ref = jax.jit(module.apply)
  for t in (5, 30, 64):
    tok, lens = _tokens(t)
    np.testing.assert_allclose(np.asarray(fn(variables, tok, lens)),
                               np.asarray(ref(variables, tok, lens)), rtol=1e-5, atol=2e-6)
  st = fn.stats()
  # (on a GPU wait() also runs each bucket's full-quality tier: twice the compiles)
  tiers = fn._dispatcher.compiler.tiers()
  assert (st["compiles"], st["waited_for_compile"]) == (4 * tiers, 0)


def test_nnx_warmup_takes_its_options_and_an_abstract_model():
  model = _Net(nnx.Rngs(0))
  f = dflax.nnx_jit(lambda m, x, lengths: m(x, lengths), dims={"x": "b, t, 4", "lengths": "b"},
                    buckets={"t": dynjax.buckets.pow2(4, 16)})
  abstract = nnx.eval_shape(lambda: _Net(nnx.Rngs(0)))
  info = f.warmup(abstract, jax.ShapeDtypeStruct((3, 9, 4), np.float32),
                  jax.ShapeDtypeStruct((3,), np.int32), progress=False)
  assert sorted(info["buckets"]) == [(4, 4), (4, 8), (4, 16)] and info["compiled"] == 3
  x, lens, _ = _xs(11)
  want = np.asarray(nnx.clone(model)(x, lens))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    got = np.asarray(f(model, x, lens))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert f.stats()["compiles"] == 3


def test_linen_method_and_keyword_args():
  module = models.BertEncoder(CFG)
  variables = {"params": models.init_encoder_params(CFG)}
  fn = dflax.jit(module, method="sequence", dims={"tokens": "b, t", "lengths": "b"},
                 buckets={"t": dynjax.buckets.pow2(8, 64)}, padding="trust")
  tok, lens = _tokens(13)
  got = np.asarray(fn(variables, tokens=tok, lengths=lens))
  want = np.asarray(module.apply(variables, tok, lens, method="sequence"))
  assert got.shape == (3, 13, CFG.d_model)
  for i, n in enumerate(lens):  # rows past a length are don't-care in a masked model
    np.testing.assert_allclose(got[i, :n], want[i, :n], rtol=1e-5, atol=2e-6)


class _Stateful(nn.Module):
  """BatchNorm batch statistics plus a call counter: two mutable collections."""

  @nn.compact
  def __call__(self, x):
    count = self.variable("counter", "calls", lambda: jnp.zeros((), jnp.int32))
    count.value += 1
    y = nn.Dense(6)(x)
    y = nn.BatchNorm(use_running_average=False, momentum=0.5)(y)
    return jnp.tanh(y)


@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_linen_mutable_collections(mode):
  module = _Stateful()
  x0 = np.ones((2, 4, 3), np.float32)
  variables = module.init(jax.random.key(0), x0)
  fn = dflax.jit(module, dims={"x": "b, t, 3"}, buckets={"t": dynjax.buckets.pow2(4, 32)},
                 mutable=["batch_stats", "counter"], padding=mode)
  ref = jax.jit(lambda v, x: module.apply(v, x, mutable=["batch_stats", "counter"]))
  rng = np.random.default_rng(0)
  v_got, v_ref = variables, variables
  for t in (3, 5, 9):
    x = rng.standard_normal((2, t, 3)).astype(np.float32)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      out, upd = fn(v_got, x)
    out_r, upd_r = ref(v_ref, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_r), rtol=1e-5, atol=1e-5)
    assert set(upd) == {"batch_stats", "counter"}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-5), upd, upd_r)
    v_got = {**v_got, **upd}
    v_ref = {**v_ref, **upd_r}
  assert int(v_got["counter"]["calls"]) == 1 + 3  # init counted one call


def test_linen_errors():
  with pytest.raises(dynjax.SpecError, match="expected a flax.linen.Module instance"):
    dflax.jit(lambda x: x)
  with pytest.raises(dynjax.SpecError, match="has no method 'nope'"):
    dflax.jit(_Stateful(), method="nope")
  with pytest.raises(dynjax.SpecError, match="dims names 'variables'"):
    dflax.jit(_Stateful(), dims={"variables": None, "x": "b, t, 3"})


# -- NNX -------------------------------------------------------------------------------------
class _Net(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, 16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16,
                                       decode=False, rngs=rngs)
    self.out = nnx.Linear(16, 1, rngs=rngs)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

  def __call__(self, x, lengths):
    self.calls[...] += 1
    t = x.shape[1]
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    h = jax.nn.gelu(self.inp(x))
    h = h + self.attn(h, mask=valid[:, None, None, :])
    y = self.out(h)[..., 0]
    return jnp.where(valid, y, 0.0)


def _xs(t, b=3, seed=0):
  rng = np.random.default_rng(seed + 100 * t)
  x = rng.standard_normal((b, t, 4)).astype(np.float32)
  lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)]).astype(np.int32)
  y = rng.standard_normal((b, t)).astype(np.float32)
  return x, lens, y


def test_nnx_model_matches_and_counts_calls(padding):
  model = _Net(nnx.Rngs(0))

  @dflax.nnx_jit(dims={"x": "b, t, 4", "lengths": "b"}, buckets={"t": dynjax.buckets.pow2(4, 32)},
                 padding=padding)
  def forward(model, x, lengths):
    return model(x, lengths)

  twin = nnx.clone(model)
  for t in (3, 5, 8, 11):
    x, lens, _ = _xs(t)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      got = np.asarray(forward(model, x, lens))
    want = np.asarray(twin(x, lens))
    assert got.shape == (3, t)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert int(model.calls[...]) == 4  # state updates were written back
  assert forward.stats()["calls"] == 4
  assert "family" in forward.explain()


def _loss(model, x, lengths, y):
  pred = model(x, lengths)
  valid = (jnp.arange(x.shape[1])[None, :] < lengths[:, None]).astype(pred.dtype)
  return jnp.sum(valid * (pred - y) ** 2) / jnp.sum(valid)


def _sgd_step(model, x, lengths, y):
  loss, grads = nnx.value_and_grad(_loss)(model, x, lengths, y)
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
  return loss


def test_nnx_sgd_step_matches_exact_shape_update(padding):
  model = _Net(nnx.Rngs(1))
  ref_model = nnx.clone(model)
  step = dflax.nnx_jit(_sgd_step, dims={"x": "b, t, 4", "lengths": "b", "y": "b, t"},
                       buckets={"t": dynjax.buckets.pow2(4, 32)}, padding=padding)
  ref_step = nnx.jit(_sgd_step)
  for t in (6, 3, 13, 6):
    x, lens, y = _xs(t, seed=1)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      loss = float(step(model, x, lens, y))
    ref_loss = float(ref_step(ref_model, x, lens, y))
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
  got = nnx.state(model, nnx.Param)
  want = nnx.state(ref_model, nnx.Param)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                                       atol=1e-5), got, want)
  assert int(model.calls[...]) == int(ref_model.calls[...]) == 4


def test_nnx_decorates_methods():
  class Scaler(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.full((4,), 2.0))
      self.seen = nnx.Variable(jnp.zeros((), jnp.int32))

    @dflax.nnx_jit(dims={"x": "b, t, 4"}, buckets={"t": dynjax.buckets.pow2(2, 16)})
    def __call__(self, x):
      self.seen[...] += x.shape[1]
      return x * self.w[...]

  m = Scaler()
  for t in (3, 7):
    x = np.ones((2, t, 4), np.float32)
    np.testing.assert_allclose(np.asarray(m(x)), 2 * x)
  # padding="auto": x.shape[1] is the true size ("trust" would show the bucket's).
  assert int(m.seen[...]) == 10
  assert Scaler.__call__.stats()["calls"] == 2


def test_nnx_errors():
  with pytest.raises(dynjax.SpecError, match="hold NNX modules or variables"):
    f = dflax.nnx_jit(lambda model, x: model(x), dims={"model": None, "x": "b, 4"})
    f(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), np.ones((2, 4), np.float32))
  with pytest.raises(dynjax.SpecError, match="static_argnames"):
    dflax.nnx_jit(lambda model, x: model(x), static_argnames=("nope",))


def test_nnx_model_whose_config_holds_a_list_runs_like_nnx_jit(compiles):
  from flax import nnx

  class Block(nnx.Module):  # as Gemma keeps attention_types: a list in the module's config
    def __init__(self, rngs):
      self.attention_types = ["global", "local_sliding"]
      self.proj = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      h = self.proj(x)
      return h.sum(-1) if self.attention_types[0] == "global" else h.mean(-1)

  model = Block(nnx.Rngs(0))
  f = dynjax.flax.nnx_jit(lambda m, x: m(x), dims={"x": "b, t, 4"},
                          buckets={"t": dynjax.buckets.pow2(4, 16)})
  ref = nnx.jit(lambda m, x: m(x))
  for t in (3, 4, 7, 3):
    x = np.random.RandomState(t).randn(2, t, 4).astype(np.float32)
    np.testing.assert_allclose(f(model, x), ref(model, x), rtol=1e-6, atol=1e-6)
  s = f.stats()
  assert s["calls"] == 4 and s["compiles"] == 2  # buckets t=4 and t=8
