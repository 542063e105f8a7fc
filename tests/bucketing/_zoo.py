"""A zoo of small real models, written as public Flax/JAX code writes them.

Each entry builds a model, its parameters, a forward function and a training step (loss and
parameter gradients), the ``dims``/``buckets`` a user would give, and the calls to make: sizes
chosen to cover several buckets, size 1 and sizes exactly at a bucket.  ``test_zoo.py`` checks
``padding="auto"`` against ``jax.jit`` at the exact shapes with zero fallbacks and one compile
per bucket; ``python -m tests.bucketing._zoo`` prints the table of the issue note (exactness,
compiles/buckets, fallbacks, padded ("auto") vs "trust" time per call on CPU).

The idioms are the public ones, not the ones the padding rules were written around:

* BiLSTM: ``nn.RNN(nn.OptimizedLSTMCell)`` with ``seq_lengths``; the backward direction reverses
  each padded row by its own length with ``jnp.flip(jnp.roll(x, max_len - length, axis=0),
  axis=0)`` under ``jax.vmap`` (as a user reported it), plus flax's own ``flip_sequences``
  through ``nn.RNN(reverse=True, keep_order=True)``.
* Transformer tagger / encoder-decoder: ``nn.MultiHeadDotProductAttention`` with
  ``nn.make_attention_mask``, ``nn.make_causal_mask``, ``nn.combine_masks``, a learned position
  table sliced by the length (``pos[:, :t]``), tied output embedding (``Embed.attend``).
* Graph network (NNX): nodes and edges are the dynamic dims; ``h[senders]`` gathers,
  ``jax.ops.segment_sum``/``segment_max`` with ``num_segments=n`` over the (padded) edges, and a
  per-graph readout with ``segment_sum``/``segment_max`` over ``node_graph``.
* Audio conv net: ``nn.Conv`` (``"SAME"``), ``nn.max_pool`` / ``nn.avg_pool`` with stride 2, a
  length mask after pooling.
* MoE tagger: Mixtral's sparse block as JAX ports write it (``examples/moe_public.py``):
  top-2 router, tokens sorted by expert with ``argsort``, ``lax.ragged_dot`` experts with
  ``bincount`` group sizes, scattered back with ``.at[order].set``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 40


def _onehot_ce(logits, labels, weights=None):
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  if weights is None:
    return jnp.mean(nll)
  return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _length_mask(lengths, t):
  return jnp.arange(t)[None, :] < lengths[:, None]


# -------------------------------------------------------------------------------------------
# models (flax imported lazily: the zoo needs flax, the rest of the suite does not)


def _linen_models():
  import flax.linen as nn

  def flip_rows(x, lengths):
    """Reverses each row's first ``length`` steps (padding stays at the end), per row."""
    max_len = x.shape[1]

    def one(xi, li):
      return jnp.flip(jnp.roll(xi, max_len - li, axis=0), axis=0)

    return jax.vmap(one)(x, lengths)

  class BiLSTMClassifier(nn.Module):
    d: int = 16
    classes: int = 3

    @nn.compact
    def __call__(self, tokens, lengths):
      x = nn.Embed(VOCAB, self.d)(tokens)
      fwd = nn.RNN(nn.OptimizedLSTMCell(self.d), name="fwd")(x, seq_lengths=lengths)
      bwd = nn.RNN(nn.OptimizedLSTMCell(self.d), name="bwd")(
        flip_rows(x, lengths), seq_lengths=lengths
      )
      bwd = flip_rows(bwd, lengths)
      # flax's own reversal (take_along_axis with modular indices) for a third direction
      bwd2 = nn.RNN(nn.SimpleCell(self.d), reverse=True, keep_order=True, name="bwd2")(
        x, seq_lengths=lengths
      )
      h = jnp.concatenate([fwd, bwd, bwd2], axis=-1)
      mask = _length_mask(lengths, x.shape[1])[..., None]
      pooled = jnp.sum(jnp.where(mask, h, 0.0), axis=1) / jnp.maximum(lengths, 1)[:, None]
      return nn.Dense(self.classes)(pooled)

  from examples.moe_public import SparseMoEBlock

  class Block(nn.Module):
    heads: int = 4
    moe: bool = False  # the FFN a Mixtral-style sparse block (lax.ragged_dot experts)

    @nn.compact
    def __call__(self, x, mask, kv=None, kv_mask=None):
      d = x.shape[-1]
      y = nn.LayerNorm()(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y, mask=mask)
      if kv is not None:
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="cross")(
          y, kv, mask=kv_mask
        )
      y = nn.LayerNorm()(x)
      if self.moe:
        return x + SparseMoEBlock(experts=4, k=2, hidden=48)(y)
      return x + nn.Dense(d)(nn.gelu(nn.Dense(2 * d)(y)))

  class TransformerTagger(nn.Module):
    d: int = 32
    tags: int = 5
    max_len: int = 32
    moe: bool = False

    @nn.compact
    def __call__(self, tokens, lengths):
      t = tokens.shape[1]
      pos = self.param("pos", nn.initializers.normal(0.02), (1, self.max_len, self.d))
      x = nn.Embed(VOCAB, self.d)(tokens) + pos[:, :t]
      valid = _length_mask(lengths, t)
      x = Block(moe=self.moe)(x, nn.make_attention_mask(valid, valid))
      return nn.Dense(self.tags)(nn.LayerNorm()(x))

  class Seq2Seq(nn.Module):
    d: int = 32
    max_len: int = 32

    @nn.compact
    def __call__(self, src, src_len, tgt, tgt_len):
      embed = nn.Embed(VOCAB, self.d)
      pos = self.param("pos", nn.initializers.normal(0.02), (1, self.max_len, self.d))
      s, t = src.shape[1], tgt.shape[1]
      src_valid, tgt_valid = _length_mask(src_len, s), _length_mask(tgt_len, t)
      enc = Block(name="enc")(embed(src) + pos[:, :s], nn.make_attention_mask(src_valid, src_valid))
      enc = nn.LayerNorm()(enc)
      self_mask = nn.combine_masks(
        nn.make_causal_mask(tgt), nn.make_attention_mask(tgt_valid, tgt_valid)
      )
      dec = Block(name="dec")(
        embed(tgt) + pos[:, :t],
        self_mask,
        kv=enc,
        kv_mask=nn.make_attention_mask(tgt_valid, src_valid),
      )
      return embed.attend(nn.LayerNorm()(dec))

  class AudioConvNet(nn.Module):
    classes: int = 4

    @nn.compact
    def __call__(self, x, lengths):
      h = nn.relu(nn.Conv(16, (3,), padding="SAME")(x))
      h = nn.max_pool(h, (2,), strides=(2,), padding="SAME")
      h = nn.relu(nn.Conv(16, (3,), padding="SAME")(h))
      h = nn.avg_pool(h, (2,), strides=(2,), padding="SAME")
      l4 = (lengths + 3) // 4  # each stride-2 "SAME" pool: ceil(l / 2)
      mask = _length_mask(l4, h.shape[1])[..., None]
      pooled = jnp.sum(jnp.where(mask, h, 0.0), axis=1) / jnp.maximum(l4, 1)[:, None]
      return nn.Dense(self.classes)(pooled)

  return BiLSTMClassifier, TransformerTagger, Seq2Seq, AudioConvNet


def _graph_net():
  from flax import nnx

  class GraphNet(nnx.Module):
    """Message passing over a batch of graphs (jraph layout: nodes and edges concatenated)."""

    def __init__(self, d_in: int, d: int, num_graphs: int, rngs):
      self.num_graphs = num_graphs
      self.enc = nnx.Linear(d_in, d, rngs=rngs)
      self.msg = nnx.Linear(2 * d, d, rngs=rngs)
      self.upd = nnx.Linear(3 * d, d, rngs=rngs)
      self.out = nnx.Linear(2 * d, 2, rngs=rngs)

    def __call__(self, nodes, senders, receivers, node_graph):
      n = nodes.shape[0]
      h = nnx.relu(self.enc(nodes))
      for _ in range(2):
        m = nnx.relu(self.msg(jnp.concatenate([h[senders], h[receivers]], axis=-1)))
        agg_sum = jax.ops.segment_sum(m, receivers, num_segments=n)
        agg_max = jax.ops.segment_max(m, receivers, num_segments=n)
        agg_max = jnp.where(jnp.isfinite(agg_max), agg_max, 0.0)  # nodes without in-edges
        h = nnx.relu(self.upd(jnp.concatenate([h, agg_sum, agg_max], axis=-1)))
      g = self.num_graphs
      count = jax.ops.segment_sum(jnp.ones((n,)), node_graph, num_segments=g)
      mean = jax.ops.segment_sum(h, node_graph, num_segments=g) / jnp.maximum(count, 1)[:, None]
      gmax = jax.ops.segment_max(h, node_graph, num_segments=g)
      gmax = jnp.where(jnp.isfinite(gmax), gmax, 0.0)
      return self.out(jnp.concatenate([mean, gmax], axis=-1))

  return GraphNet


# -------------------------------------------------------------------------------------------
# zoo entries


@dataclasses.dataclass
class Entry:
  """One zoo model: ``forward`` (a Linen module, or an NNX function) and ``train(params,
  *args, labels)`` (loss and parameter gradients)."""

  name: str
  forward: object
  train: Callable
  params: object
  dims: dict
  buckets: dict
  calls: list  # [(sizes dict, args tuple)]
  nnx: bool = False


def _bucket_of(sizes, n):
  return min(s for s in sizes if s >= n)


def expected_buckets(entry: Entry) -> set:
  out = set()
  for sizes, _ in entry.calls:
    out.add(tuple((v, _bucket_of(entry.buckets[v], n)) for v, n in sorted(sizes.items())))
  return out


def _tokens(rng, b, t):
  lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)]).astype(np.int32)
  tok = rng.integers(1, VOCAB, (b, t)).astype(np.int32)
  tok[_np_mask(lens, t) == 0] = 0  # the user's own padding token
  return tok, lens


def _np_mask(lens, t):
  return (np.arange(t)[None, :] < lens[:, None]).astype(np.int32)


# size 1, exactly a bucket, the middle of the next bucket: two buckets, three exact shapes
BT_CALLS = [(1, 1), (2, 4), (3, 7)]
T_BUCKETS = {"b": [2, 4], "t": [4, 8]}


def _linen_entry(name, module, init_args, train, dims, buckets, calls):
  params = jax.jit(module.init)(jax.random.key(0), *init_args)
  return Entry(name, module, train(module), params, dims, buckets, calls)


def _bilstm_train(module):
  def train(variables, tokens, lengths, labels):
    def loss(v):
      return _onehot_ce(module.apply(v, tokens, lengths), labels)

    return jax.value_and_grad(loss)(variables)

  return train


def _tagger_train(module):
  def train(variables, tokens, lengths, labels):
    def loss(v):
      weights = _length_mask(lengths, tokens.shape[1])
      return _onehot_ce(module.apply(v, tokens, lengths), labels, weights)

    return jax.value_and_grad(loss)(variables)

  return train


def _seq2seq_train(module):
  def train(variables, src, src_len, tgt, tgt_len, labels):
    def loss(v):
      weights = _length_mask(tgt_len, tgt.shape[1])
      return _onehot_ce(module.apply(v, src, src_len, tgt, tgt_len), labels, weights)

    return jax.value_and_grad(loss)(variables)

  return train


def _audio_train(module):
  def train(variables, x, lengths, labels):
    def loss(v):
      return _onehot_ce(module.apply(v, x, lengths), labels)

    return jax.value_and_grad(loss)(variables)

  return train


def build() -> list[Entry]:
  BiLSTM, Tagger, Seq2Seq, AudioConvNet = _linen_models()
  GraphNet = _graph_net()
  rng = np.random.default_rng(0)
  entries = []

  calls = []
  for b, t in BT_CALLS:
    tok, lens = _tokens(rng, b, t)
    calls.append(({"b": b, "t": t}, (tok, lens, rng.integers(0, 3, b).astype(np.int32))))
  entries.append(
    _linen_entry(
      "bilstm",
      BiLSTM(),
      calls[0][1][:2],
      _bilstm_train,
      {"tokens": "b, t", "lengths": "b", "labels": "b"},
      T_BUCKETS,
      calls,
    )
  )

  calls = []
  for b, t in BT_CALLS:
    tok, lens = _tokens(rng, b, t)
    calls.append(({"b": b, "t": t}, (tok, lens, rng.integers(0, 5, (b, t)).astype(np.int32))))
  entries.append(
    _linen_entry(
      "transformer_tagger",
      Tagger(),
      calls[0][1][:2],
      _tagger_train,
      {"tokens": "b, t", "lengths": "b", "labels": "b, t"},
      T_BUCKETS,
      calls,
    )
  )

  entries.append(  # the transformer tagger's calls, an MoE block in place of its FFN
    _linen_entry(
      "moe_tagger",
      Tagger(moe=True),
      calls[0][1][:2],
      _tagger_train,
      {"tokens": "b, t", "lengths": "b", "labels": "b, t"},
      T_BUCKETS,
      calls,
    )
  )

  calls = []
  for b, s, t in [(1, 1, 1), (2, 8, 4), (3, 5, 7)]:
    src, src_len = _tokens(rng, b, s)
    tgt, tgt_len = _tokens(rng, b, t)
    calls.append(({"b": b, "s": s, "t": t}, (src, src_len, tgt, tgt_len, tgt)))
  entries.append(
    _linen_entry(
      "seq2seq",
      Seq2Seq(),
      calls[0][1][:4],
      _seq2seq_train,
      {"src": "b, s", "src_len": "b", "tgt": "b, t", "tgt_len": "b", "labels": "b, t"},
      {"b": [2, 4], "s": [8, 16], "t": [4, 8]},
      calls,
    )
  )

  calls = []
  for b, t in BT_CALLS:
    lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)]).astype(np.int32)
    x = (rng.normal(size=(b, t, 4)) * _np_mask(lens, t)[..., None]).astype(np.float32)
    calls.append(({"b": b, "t": t}, (x, lens, rng.integers(0, 4, b).astype(np.int32))))
  entries.append(
    _linen_entry(
      "audio_convnet",
      AudioConvNet(),
      calls[0][1][:2],
      _audio_train,
      {"x": "b, t, 4", "lengths": "b", "labels": "b"},
      T_BUCKETS,
      calls,
    )
  )

  from flax import nnx

  graphs = 3
  model = GraphNet(5, 16, graphs, nnx.Rngs(0))
  calls = []
  for n, e in [(1, 1), (8, 16), (13, 20)]:
    nodes = rng.normal(size=(n, 5)).astype(np.float32)
    senders = rng.integers(0, n, e).astype(np.int32)
    receivers = rng.integers(0, n, e).astype(np.int32)
    node_graph = np.sort(rng.integers(0, graphs, n)).astype(np.int32)
    labels = rng.integers(0, 2, graphs).astype(np.int32)
    calls.append(({"n": n, "e": e}, (nodes, senders, receivers, node_graph, labels)))

  def gnn_forward(model, nodes, senders, receivers, node_graph):
    return model(nodes, senders, receivers, node_graph)

  def gnn_train(model, nodes, senders, receivers, node_graph, labels):
    def loss(m):
      return _onehot_ce(m(nodes, senders, receivers, node_graph), labels)

    value, grads = nnx.value_and_grad(loss)(model)
    return value, nnx.to_pure_dict(grads) if hasattr(nnx, "to_pure_dict") else grads

  entries.append(
    Entry(
      "graph_net",
      gnn_forward,
      gnn_train,
      model,
      {"nodes": "n, 5", "senders": "e", "receivers": "e", "node_graph": "n", "labels": None},
      {"n": [8, 16], "e": [16, 32]},
      calls,
      nnx=True,
    )
  )
  return entries


def wrap(entry: Entry, train: bool, padding: str = "auto", **kw):
  """The entry's forward or train step under dynjax (``dynjax.flax`` for NNX)."""
  import dynjax
  import dynjax.flax

  fun = entry.train if train else entry.forward
  dims = dict(entry.dims)
  if not train:
    dims.pop("labels", None)
    if not entry.nnx:
      return dynjax.flax.jit(fun, dims=dims, buckets=entry.buckets, padding=padding, **kw)
  if entry.nnx:
    return dynjax.flax.nnx_jit(fun, dims=dims, buckets=entry.buckets, padding=padding, **kw)
  return dynjax.jit(
    fun,
    dims={"variables": None, **dims},
    buckets=entry.buckets,
    padding=padding,
    **kw,
  )


def call_args(entry: Entry, args, train: bool):
  return args if train else args[:-1]


def reference(entry: Entry, train: bool):
  from flax import nnx

  if entry.nnx:
    return nnx.jit(entry.train if train else entry.forward)
  return jax.jit(entry.train if train else entry.forward.apply)


def _time(fn, args, reps):
  import time

  jax.block_until_ready(fn(*args))
  best = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best.append(time.perf_counter() - t0)
  return float(np.median(best))


def main(reps: int = 20) -> None:
  """Prints the zoo table: exactness, compiles/buckets, fallbacks, auto vs trust time."""
  import warnings

  import tests.conftest as conftest  # the jax.monitoring compile counter

  for k in (1, 2, 3):  # jax's one-off "stage" compile of dynjax's int32[k] sizes vector
    jnp.asarray(np.zeros(k, np.int32))
  rows = []
  for entry in build():
    for train in (False, True):
      exact, max_err = True, 0.0
      start = conftest._counter.count
      f = wrap(entry, train)
      outs = [f(entry.params, *call_args(entry, a, train)) for _, a in entry.calls]
      ncomp = conftest._counter.count - start
      ref = reference(entry, train)
      for (_, a), got in zip(entry.calls, outs, strict=True):
        want = ref(entry.params, *call_args(entry, a, train))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
          err = float(np.max(np.abs(np.asarray(g) - np.asarray(w)), initial=0.0))
          max_err = max(max_err, err)
          exact &= bool(np.allclose(g, w, rtol=1e-4, atol=1e-5))
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trust = wrap(entry, train, padding="trust")
        t_auto = t_trust = 0.0
        for _, a in entry.calls:
          args = (entry.params, *call_args(entry, a, train))
          t_auto += _time(f, args, reps)
          t_trust += _time(trust, args, reps)
      rows.append(
        (
          entry.name + (" train" if train else ""),
          exact,
          max_err,
          f"{ncomp}/{len(expected_buckets(entry))}",
          len(f.stats()["fallbacks"]),
          t_auto / len(entry.calls) * 1e3,
          t_trust / len(entry.calls) * 1e3,
        )
      )
  print("| model | exact? (max abs err) | compiles/buckets | fallbacks | auto ms | trust ms |")
  print("|---|---|---|---|---|---|")
  for name, ok, err, comp, fb, ta, tt in rows:
    print(f"| {name} | {'yes' if ok else 'NO'} ({err:.1e}) | {comp} | {fb} | {ta:.2f} | {tt:.2f} |")


if __name__ == "__main__":
  main()
