"""Real layers written the natural way (no padding masks), training-step gradients and random
programs: padded execution equals exact execution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _harness import Case
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

D = 4
_rng = np.random.default_rng(42)
WQ, WK, WV, WO = (jnp.asarray(_rng.normal(size=(D, D)) / 2, jnp.float32) for _ in range(4))
W_RNN = jnp.asarray(_rng.normal(size=(D, D)) / 2, jnp.float32)
U_RNN = jnp.asarray(_rng.normal(size=(D, D)) / 2, jnp.float32)
K_CONV = jnp.asarray(_rng.normal(size=(3, D, D)) / 2, jnp.float32)
POS = jnp.asarray(_rng.normal(size=(16, D)), jnp.float32)
EMB = jnp.asarray(_rng.normal(size=(11, D)), jnp.float32)
BUCKET = (3, 8)


def attention(x, mask=None):
  q, k, v = x @ WQ, x @ WK, x @ WV
  s = jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(D)
  if mask is not None:
    s = jnp.where(mask[:, None, :], s, -1e9)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bts,bsd->btd", p, v) @ WO


def layer_norm(x, axis):
  mu = x.mean(axis, keepdims=True)
  var = ((x - mu) ** 2).mean(axis, keepdims=True)
  return (x - mu) / jnp.sqrt(var + 1e-5)


def rnn(x, reverse=False):
  def cell(h, xt):
    h = jnp.tanh(xt @ W_RNN + h @ U_RNN)
    return h, h

  h0 = jnp.zeros((x.shape[0], D))
  h, hs = lax.scan(cell, h0, jnp.swapaxes(x, 0, 1), reverse=reverse)
  return h, jnp.swapaxes(hs, 0, 1)


def conv1d(x):
  y = lax.conv_general_dilated(x, K_CONV, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
  return jax.nn.relu(y)


def encoder(tokens):
  x = EMB[tokens] + POS[: tokens.shape[1]]
  x = layer_norm(x + attention(x, mask=tokens != 0), -1)
  x = layer_norm(x + jax.nn.gelu(conv1d(x)), -1)
  return x.mean(1), x


def _tokens(rng, shapes):
  toks = rng.integers(0, 11, size=shapes[0]).astype(np.int32)
  toks[0] = 0  # a row whose keys are all masked: its attention averages over all keys
  return [toks]


BTD = lambda b, t: [(b, t, D)]

LAYERS = [
  ("attention", lambda x: attention(x), BTD, {}),
  (
    "attention_user_mask_all_masked_rows",
    lambda tok: attention(EMB[tok], mask=tok != 0),
    lambda b, t: [(b, t)],
    {"dtypes": [jnp.int32], "inputs": _tokens},
  ),
  ("layer_norm_over_time", lambda x: layer_norm(x, 1), BTD, {}),
  ("layer_norm_features", lambda x: layer_norm(x, -1), BTD, {}),
  ("mean_var_pooling", lambda x: jnp.concatenate([x.mean(1), x.var(1), x.max(1)], -1), BTD, {}),
  ("logsumexp", lambda x: jax.nn.logsumexp(x, axis=(1, 2)), BTD, {}),
  ("rnn_scan", lambda x: rnn(x), BTD, {}),
  (
    "birnn_reverse",
    lambda x: jnp.concatenate([rnn(x)[1], jnp.flip(rnn(jnp.flip(x, 1))[1], 1)], -1),
    BTD,
    {},
  ),
  ("rnn_scan_reverse", lambda x: rnn(x, reverse=True), BTD, {}),
  ("conv1d_over_time", lambda x: conv1d(conv1d(x)).sum(1), BTD, {}),
  ("top_k", lambda x: lax.top_k(x.sum(-1), 1), BTD, {}),
  ("argsort", lambda x: jnp.argsort(-x[..., 0], axis=1), BTD, {}),
  ("cumsum", lambda x: jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None], BTD, {}),
  (
    "concat_two_lengths",
    lambda x, y: attention(jnp.concatenate([x, y], 1)).mean(1),
    lambda b, t, s: [(b, t, D), (b, s, D)],
    {"dims": ("b", "t", "s")},
  ),
  (
    "reshape_bt_d_and_back",
    lambda x: jnp.tanh(x.reshape(-1, D) @ WQ).reshape(x.shape) + x,
    BTD,
    {},
  ),
  ("reverse_sequences", lambda x: (jnp.flip(x, 1), x[:, ::-1].cumsum(1)), BTD, {}),
  ("pos_emb_slice", lambda x: x + POS[: x.shape[1]], BTD, {"constraints": ("t <= 16",)}),
  (
    "encoder",
    encoder,
    lambda b, t: [(b, t)],
    {"dtypes": [jnp.int32], "inputs": _tokens, "constraints": ("t <= 16",)},
  ),
]


@pytest.mark.parametrize("layer", LAYERS, ids=[c[0] for c in LAYERS])
def test_layer(layer):
  _, fun, shapes, kw = layer
  kw = dict(kw)
  dims = kw.get("dims", ("b", "t"))
  case = Case(fun, shapes, **kw)
  bucket = BUCKET + (5,) * (len(dims) - 2)
  for true, garbage in [
    ((1,) * len(dims), "mixed"),
    (bucket, "nan"),
    ((2, 5, 3)[: len(dims)], "mixed"),
  ]:
    case.check(true, bucket, garbage=garbage)


def test_flax_linen_encoder_block():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)(nn.LayerNorm()(x))
      x = x + h
      x = x + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
      return x.mean(1)

  block = Block()
  params = block.init(jax.random.key(0), jnp.zeros((1, 3, D)))
  case = Case(lambda x: block.apply(params, x), BTD)
  case.check((2, 5), BUCKET)
  case.check((1, 1), BUCKET, garbage="nan")


# --- training-step gradients -------------------------------------------------------------


def _loss(params, tokens, targets):
  w1, w2, emb = params
  x = emb[tokens] + POS[: tokens.shape[1]]
  x = layer_norm(x + attention(x @ w1), -1)
  x = jnp.tanh(x.reshape(-1, D) @ w2).reshape(x.shape)
  h, _ = rnn(x)
  pred = h + x.max(1) + jnp.cumsum(x, 1)[:, -1]
  return jnp.mean((pred - targets) ** 2) + 0.01 * jnp.mean(x**2)


def _train_step(w1, w2, emb, tokens, targets):
  loss, grads = jax.value_and_grad(_loss)((w1, w2, emb), tokens, targets)
  return loss, grads


def _train_inputs(rng, shapes):
  return [
    rng.normal(size=shapes[0]).astype(np.float32),
    rng.normal(size=shapes[1]).astype(np.float32),
    rng.normal(size=shapes[2]).astype(np.float32),
    rng.integers(0, 11, size=shapes[3]).astype(np.int32),
    rng.normal(size=shapes[4]).astype(np.float32),
  ]


def test_training_step_gradients_equal_exact():
  case = Case(
    _train_step,
    lambda b, t: [(D, D), (D, D), (11, D), (b, t), (b, D)],
    dtypes=[jnp.float32, jnp.float32, jnp.float32, jnp.int32, jnp.float32],
    inputs=_train_inputs,
    constraints=("t <= 16",),
    # (a GPU sums float32 in another order at the bucket's shape: H100, 1.9e-4 apart)
    rtol=1e-4 if jax.default_backend() == "cpu" else 5e-4,
    atol=1e-5,
  )
  for true in [(1, 1), (2, 5), BUCKET]:
    case.check(true, BUCKET, garbage="mixed")


def test_conv_pooling_gradients_equal_exact():
  def step(k, x):
    def loss(k):
      y = lax.conv_general_dilated(x, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
      y = lax.reduce_window(y, 0.0, lax.add, (1, 2, 1), (1, 1, 1), "SAME")
      return jnp.mean(jnp.sort(y, axis=1)[:, -1] ** 2) + jnp.mean(jax.nn.logsumexp(y, 1))

    return jax.value_and_grad(loss)(k)

  case = Case(step, lambda b, t: [(3, D, D), (b, t, D)], rtol=1e-4)
  for true in [(1, 1), (2, 6), BUCKET]:
    case.check(true, BUCKET)


# --- random programs -----------------------------------------------------------------------

OPS = [
  ("tanh", lambda x: jnp.tanh(x)),
  ("center", lambda x: x - x.mean(1, keepdims=True)),
  ("scale_by_max", lambda x: x * x.max(1, keepdims=True)),
  ("cumsum", lambda x: jnp.cumsum(x, 1) * 0.3),
  ("rev_cumsum", lambda x: jnp.cumsum(x[:, ::-1], 1)[:, ::-1] * 0.3),
  ("flip", lambda x: jnp.flip(x, 1)),
  ("sort", lambda x: jnp.sort(x, 1)),
  ("softmax", lambda x: jax.nn.softmax(x, 1)),
  ("roll", lambda x: x + jnp.roll(x, 1, 1)),
  ("reshape_flat", lambda x: (x.reshape(-1) * 2).reshape(x.shape)),
  ("batch_sum", lambda x: x + x.sum(0, keepdims=True) * 0.1),
  ("gram", lambda x: x @ (x.T @ x) / (x.shape[0] * x.shape[1])),
  ("pad_slice", lambda x: jnp.pad(x, ((0, 0), (2, 1)))[:, 1:-2] + x),
  ("take_last", lambda x: x + x[:, -1:]),
  ("scan", lambda x: lax.scan(lambda c, xt: (0.5 * c + xt, c), jnp.zeros(x.shape[0]), x.T)[1].T),
  ("top1", lambda x: x - lax.top_k(x, 1)[0]),
]


@settings(max_examples=12, deadline=None)
@given(
  ops=st.lists(st.sampled_from(range(len(OPS))), min_size=1, max_size=4),
  true=st.tuples(st.integers(1, 3), st.integers(1, 6)),
)
def test_random_programs(ops, true):
  def program(x):
    for i in ops:
      x = OPS[i][1](x)
    return x, x.sum(1), jnp.argmax(x, 1)

  case = Case(program, lambda b, t: [(b, t)], rtol=1e-4, atol=1e-4)
  case.check(true, (3, 6))


BEAM = 3


def _tile_beams(x):
  # WMT beam search's helper: (b, ...) -> (b * beam, ...), each row repeated beam times
  return jnp.tile(x[:, None], (1, BEAM) + (1,) * (x.ndim - 1)).reshape((-1,) + x.shape[1:])


def beam_attend(enc, queries):
  """One beam-search step over an encoder output: tiled memory, attention, top-k per batch."""
  mem = _tile_beams(enc)  # (b*beam, t, D): tiles along a static axis only
  q = jnp.tile(queries, (enc.shape[0], 1))  # (b*beam, D): a symbolic rep count
  s = jnp.einsum("nd,ntd->nt", q, mem) / jnp.sqrt(D)
  ctx = jnp.einsum("nt,ntd->nd", jax.nn.softmax(s, -1), mem)
  return ctx, lax.top_k(ctx.sum(-1).reshape(-1, BEAM), 2)


def test_beam_search_tile_pads_with_one_compile_per_bucket(compiles):
  import dynjax

  f = dynjax.jit(
    beam_attend, dims={"enc": "b, t, 4"}, buckets={"b": [2], "t": [8, 16]}, on_fallback="error"
  )
  ref = jax.jit(beam_attend)
  queries = jnp.asarray(_rng.normal(size=(BEAM, D)), jnp.float32)
  cases = []
  for b, t in [(1, 1), (2, 5), (2, 8), (1, 9), (2, 16)]:  # buckets t=8 and t=16
    enc = np.random.default_rng(t).normal(size=(b, t, D)).astype(np.float32)
    cases.append((enc, jax.tree.map(np.asarray, ref(enc, queries))))
  before = compiles()
  for enc, want in cases:
    got = f(enc, queries)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert compiles() - before == 2 == f.stats()["compiles"]
  assert f.stats()["fallbacks"] == []
