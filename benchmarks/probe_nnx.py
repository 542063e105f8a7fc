"""Flax NNX client code under ``dynjax.flax.nnx_jit`` / ``dynjax.jit`` against ``nnx.jit`` /
``jax.jit`` at the exact shape.

  python benchmarks/probe_nnx.py --out $OUT [--cases minigpt_forward,...] [--lengths 5,9,...]

Models written as the Flax NNX docs write them (flax 0.12), none shaped around dynjax:

* ``minigpt_*``: the "Train a miniGPT language model" tutorial's model:
  ``TokenAndPositionEmbedding`` (an ``nnx.Embed`` of ``jnp.arange(0, x.shape[1])``),
  ``TransformerBlock`` (``nnx.MultiHeadAttention`` with a causal mask from
  ``nnx.make_causal_mask`` and'ed with the right-padding mask, ``nnx.Dropout``,
  ``nnx.LayerNorm``, ``nnx.Linear``), the blocks in an ``nnx.List``; its train step
  (``nnx.value_and_grad(has_aux=True)``, ``nnx.Optimizer(adamw)``, ``optimizer.update(model,
  grads)``, ``nnx.MultiMetric``), dropout drawing from the model's ``nnx.Rngs`` during training
  (the RNG counters are state the step updates); a generation loop that calls the model on a
  growing sequence (one length more per token, greedy); a decode step with
  ``MultiHeadAttention(decode=True)`` and ``init_cache`` (the cache index is state).
* ``rnn_*``: ``nnx.RNN(nnx.LSTMCell)`` with ``seq_lengths=`` and ``nnx.Bidirectional(
  nnx.RNN(nnx.GRUCell), nnx.RNN(nnx.GRUCell))``, a masked tagging loss and an SGD step.
* ``conv_bn_*``: ``nnx.Conv`` over the time axis, ``nnx.BatchNorm(use_running_average=False)``
  with ``mask=`` the valid frames (batch statistics and the running stats it writes back),
  ``nnx.Dropout`` with ``nnx.Rngs``; ``nnx.Sequential`` of layers; ``nnx.remat`` blocks.
* ``split_merge_*``: ``dynjax.jit`` over ``nnx.split`` state, ``nnx.merge`` inside (the
  functional API), against ``jax.jit`` of the same function.

Each case: 3 right-padded token rows at each of ``--lengths``, ``padding="auto"``, ``pow2(8,
64)`` buckets on ``t``; both sides start from equal fresh models, the state is compared after
every call.  Writes ``probe_nnx.json`` (versions recorded); prints the table.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import short_reason, write_json  # noqa: E402

VOCAB, D, HEADS, FF, MAXLEN, B = 32, 16, 2, 32, 64, 3
LENGTHS = (5, 9, 16, 23, 40)
RATE = 0.2


# -- models (the NNX docs' idioms) ----------------------------------------------------------------
def _minigpt_classes():
  import jax.numpy as jnp
  from flax import nnx

  class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, *, rngs):
      self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
      self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
      positions = jnp.arange(0, x.shape[1])[None, :]
      return self.token_emb(x) + self.pos_emb(positions)

  class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, *, rngs, rate=RATE, decode=False):
      self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim,
                                        decode=decode, rngs=rngs)
      self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
      self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
      self.linear1 = nnx.Linear(in_features=embed_dim, out_features=ff_dim, rngs=rngs)
      self.linear2 = nnx.Linear(in_features=ff_dim, out_features=embed_dim, rngs=rngs)
      self.dropout2 = nnx.Dropout(rate=rate, rngs=rngs)
      self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

    def __call__(self, inputs, mask=None, training: bool = False):
      attention_output = self.mha(inputs_q=inputs, mask=mask, decode=False)
      attention_output = self.dropout1(attention_output, deterministic=not training)
      out1 = self.layer_norm1(inputs + attention_output)
      ffn_output = self.linear2(nnx.relu(self.linear1(out1)))
      ffn_output = self.dropout2(ffn_output, deterministic=not training)
      return self.layer_norm2(out1 + ffn_output)

  class MiniGPT(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim,
                 num_transformer_blocks, *, rngs):
      self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
      self.transformer_blocks = nnx.List([
        TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
        for _ in range(num_transformer_blocks)])
      self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size,
                                     use_bias=False, rngs=rngs)

    def __call__(self, inputs, training: bool = False):
      x = self.embedding_layer(inputs)
      mask = nnx.combine_masks(nnx.make_causal_mask(inputs),
                               nnx.make_attention_mask(inputs > 0, inputs > 0))
      for transformer_block in self.transformer_blocks:
        x = transformer_block(x, mask=mask, training=training)
      return self.output_layer(x)

  return MiniGPT, TransformerBlock


def minigpt(seed=0, layers=2):
  MiniGPT, _ = _minigpt_classes()
  from flax import nnx

  return MiniGPT(MAXLEN, VOCAB, D, HEADS, FF, layers, rngs=nnx.Rngs(seed))


def minigpt_loss(model, tokens, training=True):
  import jax.numpy as jnp
  import optax

  logits = model(tokens, training=training)
  labels = tokens[:, 1:]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels)
  w = (labels > 0).astype(jnp.float32)
  return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0), logits


def minigpt_train_state(seed=0):
  import optax
  from flax import nnx

  model = minigpt(seed)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
  return model, optimizer, metrics


def minigpt_train_step(model, optimizer, metrics, tokens):
  from flax import nnx

  grad_fn = nnx.value_and_grad(minigpt_loss, has_aux=True)
  (loss, _), grads = grad_fn(model, tokens)
  metrics.update(loss=loss)
  optimizer.update(model, grads)
  return loss


def minigpt_forward(model, tokens):
  return model(tokens)


def minigpt_decode_model(seed=0):
  from flax import nnx

  class Decoder(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      self.block = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=True,
                                          rngs=rngs)
      self.out = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, token):  # (b, 1) one token a step, the cache is the state
      return self.out(self.block(self.embed(token)))

  model = Decoder(rngs=nnx.Rngs(seed))
  model.block.init_cache((B, MAXLEN, D))
  return model


def rnn_tagger(kind, seed=0):
  from flax import nnx

  class Tagger(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      if kind == "lstm":
        self.rnn = nnx.RNN(nnx.LSTMCell(D, D, rngs=rngs), rngs=rngs)
        out = D
      else:
        self.rnn = nnx.Bidirectional(nnx.RNN(nnx.GRUCell(D, D, rngs=rngs), rngs=rngs),
                                     nnx.RNN(nnx.GRUCell(D, D, rngs=rngs), rngs=rngs),
                                     rngs=rngs)
        out = 2 * D
      self.head = nnx.Linear(out, 5, rngs=rngs)

    def __call__(self, tokens, lengths):
      return self.head(self.rnn(self.embed(tokens), seq_lengths=lengths))

  return Tagger(rngs=nnx.Rngs(seed))


def tagger_loss(model, tokens, lengths, tags):
  import jax.numpy as jnp
  import optax

  logits = model(tokens, lengths)
  mask = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tags)
  return jnp.sum(ce * mask) / jnp.sum(mask)


def tagger_step(model, optimizer, tokens, lengths, tags):
  from flax import nnx

  loss, grads = nnx.value_and_grad(tagger_loss)(model, tokens, lengths, tags)
  optimizer.update(model, grads)
  return loss


def conv_bn(seed=0, remat=False):
  import jax.numpy as jnp
  from flax import nnx

  class ConvBlock(nnx.Module):
    def __init__(self, *, rngs):
      self.conv = nnx.Conv(D, D, kernel_size=(3,), padding="SAME", rngs=rngs)
      self.bn = nnx.BatchNorm(D, use_running_average=False, rngs=rngs)
      self.dropout = nnx.Dropout(RATE, rngs=rngs)

    def __call__(self, x, mask):
      x = self.conv(x) * mask[..., None]
      x = self.bn(x, mask=mask[..., None])
      return self.dropout(nnx.relu(x))

  class ConvNet(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      self.blocks = nnx.List([ConvBlock(rngs=rngs) for _ in range(2)])
      self.head = nnx.Sequential(nnx.Linear(D, FF, rngs=rngs), nnx.gelu,
                                 nnx.Linear(FF, 5, rngs=rngs))

    def __call__(self, tokens, lengths):
      mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
      x = self.embed(tokens)
      for block in self.blocks:
        x = (nnx.remat(lambda b, x, m: b(x, m)) if remat else (lambda b, x, m: b(x, m)))(
          block, x, mask)
      m = mask[..., None].astype(x.dtype)
      return self.head(jnp.sum(x * m, 1) / jnp.sum(m, 1))

  return ConvNet(rngs=nnx.Rngs(seed))


def conv_forward(model, tokens, lengths):
  return model(tokens, lengths)


def conv_step(model, optimizer, tokens, lengths, labels):
  import optax
  from flax import nnx

  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens, lengths), labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def extra_models():
  """More NNX guide idioms: sow + pop of intermediates, a counter Variable, norms with masks
  and convs of every padding kind, nnx.scan over time, nnx.vmap over the batch, attention
  dropout and nnx.Bidirectional(return_carry=True)."""
  import jax.numpy as jnp
  from flax import nnx

  class SowNet(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                         rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens)
      self.sow(nnx.Intermediate, "emb", x)
      return self.attn(x, mask=nnx.make_attention_mask(tokens > 0, tokens > 0),
                       sow_weights=True)

  class Count(nnx.Variable):
    pass

  class Counted(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      self.calls, self.tokens = Count(jnp.array(0)), Count(jnp.array(0))

    def __call__(self, x):
      self.calls[...] += 1
      self.tokens[...] += jnp.sum(x > 0)
      return self.embed(x)

  class Norms(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      self.causal = nnx.Conv(D, D, kernel_size=(3,), padding="CAUSAL", rngs=rngs)
      self.depthwise = nnx.Conv(D, D, kernel_size=(3,), feature_group_count=D, rngs=rngs)
      self.strided = nnx.Conv(D, D, kernel_size=(3,), strides=(2,), rngs=rngs)
      self.bn = nnx.BatchNorm(D, rngs=rngs)
      self.ln, self.rms = nnx.LayerNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
      self.gn = nnx.GroupNorm(D, num_groups=4, rngs=rngs)

    def __call__(self, x, lengths, train=True):
      m = (jnp.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]
      h = self.depthwise(self.causal(self.embed(x)))
      h = self.bn(h, use_running_average=not train)
      h = self.gn(self.ln(h, mask=m), mask=jnp.broadcast_to(m, h.shape))
      return self.rms(h), self.strided(h)

  class ScanGRU(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      self.cell = nnx.GRUCell(D, D, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(None, nnx.Carry, 1), out_axes=(nnx.Carry, 1))
      def step(cell, c, xt):
        return cell(c, xt)

      return step(self.cell, jnp.zeros((x.shape[0], D)), self.embed(x))

  class AttnDropBi(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, dropout_rate=0.3,
                                         decode=False, rngs=rngs)
      self.bi = nnx.Bidirectional(nnx.RNN(nnx.OptimizedLSTMCell(D, D, rngs=rngs), rngs=rngs),
                                  nnx.RNN(nnx.LSTMCell(D, D, rngs=rngs), rngs=rngs),
                                  return_carry=True, rngs=rngs)

    def __call__(self, x, lengths):
      h = self.attn(self.embed(x), mask=nnx.make_attention_mask(x > 0, x > 0),
                    deterministic=False)
      return self.bi(h, seq_lengths=lengths)

  return SowNet, Counted, Norms, ScanGRU, AttnDropBi


# -- inputs ---------------------------------------------------------------------------------------
def batch(t, seed=0, b=B):
  import numpy as np

  rng = np.random.default_rng(seed * 1000 + t)
  lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)]).astype(np.int32)
  tok = rng.integers(1, VOCAB, (b, t)).astype(np.int32)
  tok[np.arange(t)[None, :] >= lens[:, None]] = 0
  tags = rng.integers(0, 5, (b, t)).astype(np.int32)
  labels = rng.integers(0, 5, (b,)).astype(np.int32)
  return tok, lens, tags, labels


# -- cases ----------------------------------------------------------------------------------------
def cases():
  """name -> (fresh() -> tuple of graph-node args, fun, dims, args_of(t), kind); kind "nnx"
  wraps with nnx_jit / nnx.jit, "split" runs dynjax.jit / jax.jit over nnx.split state."""
  import optax
  from flax import nnx

  opt = lambda model: (model, nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param))  # noqa: E731
  tok = lambda t: (batch(t)[0],)  # noqa: E731
  tl = lambda t: batch(t)[:2]  # noqa: E731
  tlt = lambda t: batch(t)[:3]  # noqa: E731
  tll = lambda t: (*batch(t)[:2], batch(t)[3])  # noqa: E731

  def gen_loop(model, tokens):  # one token a call; called on growing sequences (see run_case)
    return model(tokens)[:, -1].argmax(-1)

  SowNet, Counted, Norms, ScanGRU, AttnDropBi = extra_models()

  def sow_pop(model, tokens):
    return model(tokens), nnx.pop(model, nnx.Intermediate)

  def vmapped(model, tokens):
    return nnx.vmap(lambda m, row: m(row[None])[0], in_axes=(None, 0))(model, tokens)

  def grad_of_sum(model, tokens, lengths):
    import jax
    import jax.numpy as jnp

    def loss(m):
      carry, y = m(tokens, lengths)
      return jnp.sum(y ** 2) + sum(jnp.sum(c) for c in jax.tree.leaves(carry))

    return nnx.grad(loss)(model)

  def pytree_forward(model, tokens, lengths):  # NNX modules are pytrees: plain jax.jit
    return model(tokens, lengths), model

  def split_forward(state, tokens):
    model = nnx.merge(SPLIT_GRAPHDEF[0], state)
    return model(tokens, training=False)

  def split_dropout(state, tokens):
    model = nnx.merge(SPLIT_GRAPHDEF[0], state)
    return model(tokens, training=True), nnx.state(model)

  return {
    "minigpt forward": (lambda: (minigpt(),), minigpt_forward, {"tokens": "b, t"}, tok, "nnx"),
    "minigpt train (adamw, dropout rngs, metrics)": (
      minigpt_train_state, minigpt_train_step, {"tokens": "b, t"}, tok, "nnx"),
    "minigpt generate (growing sequence)": (
      lambda: (minigpt(),), gen_loop, {"tokens": "b, t"}, None, "nnx"),
    "minigpt decode cache (init_cache)": (
      lambda: (minigpt_decode_model(),), minigpt_forward, {"tokens": None}, None, "nnx"),
    "lstm seq_lengths forward": (lambda: (rnn_tagger("lstm"),), conv_forward,
                                 {"tokens": "b, t", "lengths": "b"}, tl, "nnx"),
    "lstm seq_lengths train": (lambda: opt(rnn_tagger("lstm")), tagger_step,
                               {"tokens": "b, t", "lengths": "b", "tags": "b, t"}, tlt, "nnx"),
    "bigru seq_lengths forward": (lambda: (rnn_tagger("bigru"),), conv_forward,
                                  {"tokens": "b, t", "lengths": "b"}, tl, "nnx"),
    "bigru seq_lengths train": (lambda: opt(rnn_tagger("bigru")), tagger_step,
                                {"tokens": "b, t", "lengths": "b", "tags": "b, t"}, tlt, "nnx"),
    "conv+batchnorm(mask)+dropout forward (train mode)": (
      lambda: (conv_bn(),), conv_forward, {"tokens": "b, t", "lengths": "b"}, tl, "nnx"),
    "conv+batchnorm(mask)+dropout train": (
      lambda: opt(conv_bn()), conv_step,
      {"tokens": "b, t", "lengths": "b", "labels": "b"}, tll, "nnx"),
    "conv+batchnorm nnx.remat train": (
      lambda: opt(conv_bn(remat=True)), conv_step,
      {"tokens": "b, t", "lengths": "b", "labels": "b"}, tll, "nnx"),
    "minigpt decode cache, dims b (static cache)": (
      lambda: (minigpt_decode_model(),), minigpt_forward, {"tokens": "b, 1"}, None, "nnx"),
    "minigpt train nnx.cached_partial": (
      minigpt_train_state, minigpt_train_step, {"tokens": "b, t"}, tok, "cached"),
    "minigpt forward, batch 1..4": (
      lambda: (minigpt(),), minigpt_forward, {"tokens": "b, t"}, "vary_b", "nnx"),
    "sow + nnx.pop(Intermediate)": (
      lambda: (SowNet(rngs=nnx.Rngs(0)),), sow_pop, {"tokens": "b, t"}, tok, "nnx"),
    "counter Variable": (
      lambda: (Counted(rngs=nnx.Rngs(0)),), minigpt_forward, {"tokens": "b, t"}, tok, "nnx"),
    "conv CAUSAL/depthwise/strided + BN/LN/GN(mask)/RMS": (
      lambda: (Norms(rngs=nnx.Rngs(0)),), conv_forward, {"tokens": "b, t", "lengths": "b"},
      tl, "nnx"),
    "nnx.scan GRUCell over time": (
      lambda: (ScanGRU(rngs=nnx.Rngs(0)),), minigpt_forward, {"tokens": "b, t"}, tok, "nnx"),
    "nnx.vmap over the batch": (
      lambda: (minigpt(),), vmapped, {"tokens": "b, t"}, tok, "nnx"),
    "attention dropout + Bidirectional return_carry, grad": (
      lambda: (AttnDropBi(rngs=nnx.Rngs(0)),), grad_of_sum,
      {"tokens": "b, t", "lengths": "b"}, tl, "nnx"),
    "module as a pytree arg (dynjax.jit, returned)": (
      lambda: (conv_bn(),), pytree_forward, {"model": None, "tokens": "b, t", "lengths": "b"},
      tl, "pytree"),
    "split/merge forward (dynjax.jit)": (
      lambda: (minigpt(),), split_forward, {"state": None, "tokens": "b, t"}, tok, "split"),
    "split/merge dropout (dynjax.jit)": (
      lambda: (minigpt(),), split_dropout, {"state": None, "tokens": "b, t"},
      tok, "split"),
  }


SPLIT_GRAPHDEF = [None]  # the split cases' GraphDef (a static global of their functions)
# -- comparison -----------------------------------------------------------------------------------
LOOSE = ("key']['bias", "key.bias")  # Adam(W) on a gradient that is 0 in exact arithmetic


def max_err(got, want, loose=LOOSE):
  """(max abs err, failing keypaths) over the leaves, rtol = atol = 1e-5; leaves whose
  keypath holds one of ``loose`` are not compared (Adam's steps on rounding noise)."""
  import jax
  import numpy as np

  gl = jax.tree_util.tree_leaves_with_path(got)
  wl = jax.tree_util.tree_leaves(want)
  if len(gl) != len(wl):
    return float("inf"), [f"{len(gl)} leaves != {len(wl)}"]
  err, bad = 0.0, []
  for (path, g), w in zip(gl, wl, strict=True):
    key = jax.tree_util.keystr(path)
    if hasattr(g, "dtype") and jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    g, w = np.asarray(g), np.asarray(w)
    if g.shape != w.shape:
      bad.append(f"{key}: shape {g.shape} != {w.shape}")
      err = float("inf")
      continue
    d = np.abs(g.astype(np.float64) - w.astype(np.float64))
    e = float(np.nanmax(d, initial=0.0)) if d.size else 0.0
    if any(k in key for k in loose):
      continue
    err = max(err, e)
    if not np.allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True):
      bad.append(f"{key}: max abs err {e:.3g}")
  return err, bad


def _pure(nodes):
  from flax import nnx

  return [nnx.to_pure_dict(nnx.state(n)) for n in nodes]


def _compare(errs, bad, got, want, where):
  e, b = max_err(got, want)
  errs.append(e)
  bad += [f"{where} {x}" for x in b]


def run_case(name, spec, lengths, on_fallback="warn"):
  """Runs one case under dynjax and the reference; the record of the table's row.  Compiles
  are dynjax's own count (``stats()``): eager ops between calls compile too."""
  import jax
  import numpy as np
  from flax import nnx

  import dynjax
  import dynjax.flax

  fresh, fun, dims, args_of, kind = spec
  opts = dict(dims=dims, padding="auto", on_fallback=on_fallback,
              buckets={"t": dynjax.buckets.pow2(8, MAXLEN)}
              if any("t" in str(v).replace(" ", "").split(",") for v in dims.values()) else None)
  errs, bad = [], []
  if args_of == "vary_b":  # batch sizes 1..4 beside the lengths
    calls = [(f"b={b} t={t}", (batch(t, b=b)[0],))
             for t, b in zip(lengths, [3, 1, 4, 2, 3] * len(lengths), strict=False)]
  elif args_of is not None:
    calls = [(f"t={t}", args_of(t)) for t in lengths]
  if kind in ("split", "pytree"):
    (model,) = fresh()
    mine, ref = dynjax.jit(fun, **opts), jax.jit(fun)
    if kind == "split":
      SPLIT_GRAPHDEF[0], state = nnx.split(model)
      for where, args in calls:
        _compare(errs, bad, mine(state, *args), ref(state, *args), where)
    else:  # the module is returned (its updated copy): carried from call to call
      a = r = model
      for where, args in calls:
        (got, a), (want, r) = mine(a, *args), ref(r, *args)
        _compare(errs, bad, (got, nnx.state(a)), (want, nnx.state(r)), where)
  else:
    a, r = fresh(), fresh()
    mine, ref = dynjax.flax.nnx_jit(fun, **opts), nnx.jit(fun)
    if kind == "cached":  # the NNX performance guide's idiom: the graph traversal cached
      call_a, call_r = nnx.cached_partial(mine, *a), nnx.cached_partial(ref, *r)
    else:
      call_a, call_r = functools.partial(mine, *a), functools.partial(ref, *r)
    if name.startswith("minigpt generate"):  # greedy, one token a call on the grown sequence
      seq_a = seq_r = batch(lengths[0])[0][:1]
      for _ in range(min(max(lengths), 24) - lengths[0]):
        seq_a = np.concatenate([seq_a, np.asarray(call_a(seq_a))[:, None]], 1).astype(np.int32)
        seq_r = np.concatenate([seq_r, np.asarray(call_r(seq_r))[:, None]], 1).astype(np.int32)
      _compare(errs, bad, seq_a, seq_r, "tokens")
    elif name.startswith("minigpt decode"):  # a token a call, the cache in the state
      calls = [(f"step {i}", (batch(lengths[0])[0][:, i:i + 1],)) for i in range(lengths[0])]
    for where, args in calls if not name.startswith("minigpt generate") else ():
      _compare(errs, bad, call_a(*args), call_r(*args), where)
      _compare(errs, bad, _pure(a), _pure(r), f"{where} state")
  st = mine.stats()
  return {"lengths": list(lengths), "exact": not bad, "max_abs_err": max(errs, default=0.0),
          "bad": bad[:8], "fallbacks": [str(x) for x in st["fallbacks"]],
          "compiles": st["compiles"], "calls": st["calls"]}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="", help="comma-separated name prefixes (empty: all)")
  ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
  ap.add_argument("--fast", action="store_true",
                  help="XLA's optimisations off on both sides (as the test suite compiles)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import flax
  import jax
  import optax

  warnings.simplefilter("ignore")
  if args.fast:
    jax.config.update("jax_disable_most_optimizations", True)
  lengths = [int(t) for t in args.lengths.split(",")]
  report = {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "device": jax.devices()[0].device_kind, "lengths": lengths,
            "buckets": "t: pow2(8, 64)", "padding": "auto", "xla_optimizations": not args.fast,
            "cases": {}}
  wanted = [p for p in args.cases.split(",") if p]
  print("| model | exact? | max abs diff | compiles | fallbacks: reason | s |")
  print("|---|---|---|---|---|---|")
  for name, spec in cases().items():
    if wanted and not any(name.startswith(p) for p in wanted):
      continue
    t0 = time.perf_counter()
    try:
      rec = run_case(name, spec, lengths)
    except Exception as e:  # noqa: BLE001 - one case must not lose the others
      rec = {"exact": None, "error": f"{type(e).__name__}: {str(e)[:600]}", "fallbacks": []}
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    report["cases"][name] = rec
    ok = {True: "yes", False: "NO", None: "ERROR"}[rec["exact"]]
    fb = "; ".join(short_reason(x) for x in rec["fallbacks"])
    fb = f"{len(rec['fallbacks'])}: {fb}" if fb else "0"
    print(f"| {name} | {ok} | {rec.get('max_abs_err', float('nan')):.1e} | "
          f"{rec.get('compiles', '-')} | {fb} | {rec['seconds']} |", flush=True)
    for b in rec.get("bad", [])[:4]:
      print(f"|   | {b} | | | | |")
    if "error" in rec:
      print(f"|   | {rec['error'][:300]} | | | | |")
  write_json(args.out, "probe_nnx.json", report)
  return report


if __name__ == "__main__":
  main()
