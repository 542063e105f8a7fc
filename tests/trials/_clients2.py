"""Real-client trials, second set (session 24): six more models written as public Flax/JAX code
writes them, run by ``test_clients2.py`` with ``_clients.py``'s harness (``Trial``, ``run``):
every call compared with ``jax.jit`` at the exact shape, compiles counted.
``python -m tests.trials._clients2`` prints the table.

The idioms are copied from public code, not shaped around dynjax's padding rules:

* ``t5_encoder``: HF ``modeling_flax_t5.py`` / T5X: ``_relative_position_bucket`` (log-bucketed
  relative positions with ``jnp.where``/``jnp.log``/``astype``), ``compute_bias`` from two
  ``jnp.arange`` of the query and key lengths and an ``nn.Embed`` of the buckets, computed by
  the first layer and passed on; ``T5LayerNorm`` (RMS, no mean); the padding mask from
  ``tokens > 0`` by ``nn.make_attention_mask``, turned into a bias by ``lax.select`` with
  ``finfo.min`` and added to the position bias; ``nn.dot_product_attention_weights`` unscaled.
* ``llama_decoder``: HF ``modeling_flax_llama.py``: ``FlaxLlamaRMSNorm``, a causal mask made
  once for ``max_position_embeddings`` by ``nn.make_causal_mask`` and sliced to the length,
  combined with the (left-)padding mask by ``nn.combine_masks``, ``lax.select`` bias;
  ``position_ids = attention_mask.cumsum(-1) - 1`` (HF's generation inputs); rotary embeddings
  as MaxText's ``RotaryEmbedding`` (timescales from ``jnp.arange``, ``sin``/``cos`` of the
  positions, the halves rotated); SwiGLU MLP; the loss by
  ``optax.softmax_cross_entropy_with_integer_labels`` masked by the shifted attention mask.
* ``bigru_tagger``: ``nn.Bidirectional(nn.RNN(nn.GRUCell), nn.RNN(nn.GRUCell))`` with
  ``seq_lengths=`` (flax's ``flip_sequences`` for the backward direction), a CRF-free tagging
  loss masked by the lengths (flax's sst2 / seqio taggers).
* ``packed_lm``: packed sequences as T5X/MaxText feed them: ``segment_ids`` and ``positions``
  inputs, the attention mask ``segment_ids[:, :, None] == segment_ids[:, None, :]`` and'ed with
  a causal mask and ``segment_ids != 0``, ``jax.nn.dot_product_attention(mask=...)``, learned
  position embeddings of ``positions``, the loss weighted by ``segment_ids > 0``; and the same
  model attending by ``jax.nn.dot_product_attention(query_seq_lengths=, key_value_seq_lengths=)``
  of unpacked rows.
* ``conv_audio``: a Whisper-like encoder (openai/whisper ``AudioEncoder``: ``Conv1d(k=3,
  padding=1)``, GELU, ``Conv1d(k=3, stride=2, padding=1)``, GELU, ``sinusoids`` positions
  sliced to the length), written with ``nn.Conv(padding="SAME")`` and a stride-2
  ``nn.Conv(padding=((1, 1),))``; the frame mask after the stride from the lengths as HF's
  Flax wav2vec2 ``_get_feature_vector_attention_mask`` makes it (``.at[...].set(1)``, flipped
  ``cumsum``), ``nn.MultiHeadDotProductAttention`` with it, masked mean pool
  ``(x * m).sum(1) / m.sum(1)``.
* ``last_token_pool``: HF's ``*ForSequenceClassification`` pooling: ``sequence_lengths =
  argmax(input_ids == pad_token_id, -1) - 1``, ``% input_ids.shape[-1]``, ``logits[arange(b),
  sequence_lengths]``; beside it ``jnp.take_along_axis`` of the last valid token by
  ``lengths - 1`` and a ``jax.ops.segment_sum`` of the flattened tokens into their rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tests.trials._clients import Trial, _bucket_count

VOCAB = 24
D = 16
HEADS = 2


def _maker(fun, dims, buckets):
  def make(padding="auto", **kw):
    import dynjax

    return dynjax.jit(fun, dims=dims, buckets=buckets, padding=padding, **kw)

  return make


def _right_padded(rng, b, t, low=1):
  """Token ids padded with 0 on the right; the first row full length; lengths >= 1."""
  lens = np.concatenate([[t], rng.integers(low, t + 1, b - 1)]).astype(np.int32)
  tok = rng.integers(1, VOCAB, (b, t)).astype(np.int32)
  tok[np.arange(t)[None, :] >= lens[:, None]] = 0
  return tok, lens


def _trial(name, fun, dims, buckets, calls, **extra) -> Trial:
  """``fun`` under dynjax against ``jax.jit(fun)``, the buckets ``calls`` should build."""
  return Trial(name, _maker(fun, dims, buckets), lambda: jax.jit(fun), calls,
               _bucket_count(calls, buckets), **extra)


def _fwd_and_train(name, forward, train_step, calls, fwd_calls, dims, fwd_dims, buckets,
                   **extra):
  return (_trial(f"{name} forward", forward, fwd_dims, buckets, fwd_calls, **extra),
          _trial(f"{name} train", train_step, dims, buckets, calls, **extra))


# ===========================================================================================
# 1. T5 encoder with relative position bias (HF modeling_flax_t5.py / T5X)

NUM_BUCKETS = 8
MAX_DISTANCE = 16


def _t5_encoder():
  import flax.linen as nn

  class T5LayerNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, hidden_states):
      weight = self.param("weight", nn.initializers.ones, (hidden_states.shape[-1],))
      hidden_states = jnp.asarray(hidden_states, jnp.float32)
      variance = jnp.power(hidden_states, 2).mean(-1, keepdims=True)
      hidden_states = hidden_states / jnp.sqrt(variance + self.eps)
      return weight * hidden_states

  class T5Attention(nn.Module):
    has_relative_attention_bias: bool = False

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True,
                                  num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE):
      relative_buckets = 0
      if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0) * num_buckets
        relative_position = jnp.abs(relative_position)
      else:
        relative_position = -jnp.clip(relative_position, max=0)
      max_exact = num_buckets // 2
      is_small = relative_position < max_exact
      relative_position_if_large = max_exact + (
        jnp.log(relative_position / max_exact) / jnp.log(max_distance / max_exact)
        * (num_buckets - max_exact)
      )
      relative_position_if_large = jnp.clip(relative_position_if_large, max=num_buckets - 1)
      relative_buckets += jnp.where(is_small, relative_position, relative_position_if_large)
      return relative_buckets.astype("i4")

    def setup(self):
      inner = D
      self.q = nn.Dense(inner, use_bias=False)
      self.k = nn.Dense(inner, use_bias=False)
      self.v = nn.Dense(inner, use_bias=False)
      self.o = nn.Dense(D, use_bias=False)
      if self.has_relative_attention_bias:
        self.relative_attention_bias = nn.Embed(NUM_BUCKETS, HEADS)

    def compute_bias(self, query_length, key_length):
      context_position = jnp.arange(query_length, dtype="i4")[:, None]
      memory_position = jnp.arange(key_length, dtype="i4")[None, :]
      relative_position = memory_position - context_position
      relative_position_bucket = self._relative_position_bucket(relative_position)
      values = self.relative_attention_bias(relative_position_bucket)
      return values.transpose((2, 0, 1))[None, :, :, :]

    def __call__(self, hidden_states, attention_mask, position_bias=None):
      b, t = hidden_states.shape[:2]

      def split(x):
        return x.reshape(x.shape[:2] + (HEADS, D // HEADS))

      query = split(self.q(hidden_states))
      key = split(self.k(hidden_states))
      value = split(self.v(hidden_states))
      if position_bias is None:
        position_bias = self.compute_bias(t, t)
        # HF: the mask as a bias, added to the position bias
        attention_mask = lax.select(
          attention_mask > 0,
          jnp.full(attention_mask.shape, 0.0),
          jnp.full(attention_mask.shape, jnp.finfo(jnp.float32).min),
        )
        position_bias = position_bias + attention_mask
      attn_weights = nn.dot_product_attention_weights(
        query, key, bias=position_bias, broadcast_dropout=False, deterministic=True
      )
      # T5 has no 1/sqrt(d) scaling: dot_product_attention_weights scales, HF undoes it via
      # the query's init; the weights here are what the model computes either way
      attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value)
      return self.o(attn_output.reshape(b, t, D)), position_bias

  class T5Block(nn.Module):
    has_relative_attention_bias: bool = False

    @nn.compact
    def __call__(self, x, attention_mask, position_bias=None):
      h, position_bias = T5Attention(self.has_relative_attention_bias)(
        T5LayerNorm()(x), attention_mask, position_bias
      )
      x = x + h
      y = T5LayerNorm()(x)
      # T5 v1.1 gated-gelu feed-forward
      y = nn.gelu(nn.Dense(2 * D, use_bias=False)(y), approximate=True) * nn.Dense(
        2 * D, use_bias=False)(y)
      return x + nn.Dense(D, use_bias=False)(y), position_bias

  class T5Encoder(nn.Module):
    @nn.compact
    def __call__(self, input_ids):
      mask = nn.make_attention_mask(input_ids > 0, input_ids > 0)
      x = nn.Embed(VOCAB, D)(input_ids)
      position_bias = None
      for i in range(2):
        x, position_bias = T5Block(has_relative_attention_bias=i == 0)(x, mask, position_bias)
      return nn.Dense(VOCAB)(T5LayerNorm()(x))

  return T5Encoder()


def _t5_trials(rng):
  import optax

  model = _t5_encoder()
  params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))

  def forward(params, input_ids):
    return model.apply(params, input_ids)

  def train_step(params, input_ids, labels):
    def loss_fn(p):
      logits = model.apply(p, input_ids)
      weights = (input_ids > 0).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return (loss * weights).sum() / weights.sum()

    return jax.value_and_grad(loss_fn)(params)

  calls, fwd_calls = [], []
  for b, t in [(1, 1), (2, 8), (3, 13)]:  # 13 > MAX_DISTANCE / 2: the log buckets are used
    tok, _ = _right_padded(rng, b, t)
    labels = rng.integers(0, VOCAB, (b, t)).astype(np.int32)
    calls.append(({"b": b, "t": t}, (params, tok, labels)))
    fwd_calls.append(({"b": b, "t": t}, (params, tok)))
  buckets = {"b": [2, 4], "t": [8, 16]}
  return list(_fwd_and_train(
    "t5_encoder", forward, train_step, calls, fwd_calls,
    {"params": None, "input_ids": "b, t", "labels": "b, t"},
    {"params": None, "input_ids": "b, t"}, buckets,
  ))


# ===========================================================================================
# 2. LLaMA decoder block (HF modeling_flax_llama.py; rotary embeddings as MaxText's)

MAX_POS = 32


def _llama():
  import flax.linen as nn

  class FlaxLlamaRMSNorm(nn.Module):
    eps: float = 1e-6

    def setup(self):
      self.weight = self.param("weight", lambda _, shape: jnp.ones(shape), D)

    def __call__(self, hidden_states):
      variance = jnp.asarray(hidden_states, dtype=jnp.float32)
      variance = jnp.power(variance, 2)
      variance = variance.mean(-1, keepdims=True)
      hidden_states = hidden_states / jnp.sqrt(variance + self.eps)
      return self.weight * jnp.asarray(hidden_states, dtype=jnp.float32)

  def rotary(inputs, position, min_timescale=1, max_timescale=10_000):
    # MaxText layers/embeddings.py RotaryEmbedding.__call__: inputs (b, t, heads, head_dim)
    embedding_dims = inputs.shape[-1]
    half_embedding_dim = embedding_dims // 2
    fraction = 2 * jnp.arange(0, half_embedding_dim) / embedding_dims
    timescale = min_timescale * (max_timescale / min_timescale) ** fraction
    position = position[:, :, jnp.newaxis, jnp.newaxis]
    sinusoid_inp = position / timescale
    sin = jnp.sin(sinusoid_inp).astype(inputs.dtype)
    cos = jnp.cos(sinusoid_inp).astype(inputs.dtype)
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return jnp.concatenate([first_part, second_part], axis=-1)

  class FlaxLlamaAttention(nn.Module):
    def setup(self):
      self.q_proj = nn.Dense(D, use_bias=False)
      self.k_proj = nn.Dense(D, use_bias=False)
      self.v_proj = nn.Dense(D, use_bias=False)
      self.o_proj = nn.Dense(D, use_bias=False)
      self.causal_mask = nn.make_causal_mask(jnp.ones((1, MAX_POS), dtype="bool"), dtype="bool")

    def _split_heads(self, hidden_states):
      return hidden_states.reshape(hidden_states.shape[:2] + (HEADS, D // HEADS))

    def __call__(self, hidden_states, attention_mask, position_ids):
      query = self._split_heads(self.q_proj(hidden_states))
      key = self._split_heads(self.k_proj(hidden_states))
      value = self._split_heads(self.v_proj(hidden_states))
      key = rotary(key, position_ids)
      query = rotary(query, position_ids)
      query_length, key_length = query.shape[1], key.shape[1]
      causal_mask = self.causal_mask[:, :, :query_length, :key_length]
      batch_size = hidden_states.shape[0]
      causal_mask = jnp.broadcast_to(causal_mask, (batch_size,) + causal_mask.shape[1:])
      attention_mask = jnp.broadcast_to(
        jnp.expand_dims(attention_mask, axis=(-3, -2)), causal_mask.shape
      )
      attention_mask = nn.combine_masks(attention_mask, causal_mask)
      attention_bias = lax.select(
        attention_mask > 0,
        jnp.full(attention_mask.shape, 0.0).astype(jnp.float32),
        jnp.full(attention_mask.shape, jnp.finfo(jnp.float32).min).astype(jnp.float32),
      )
      attn_weights = nn.dot_product_attention_weights(
        query, key, bias=attention_bias, deterministic=True, dtype=jnp.float32
      )
      attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value)
      attn_output = attn_output.reshape(attn_output.shape[:2] + (D,))
      return self.o_proj(attn_output)

  class FlaxLlamaMLP(nn.Module):
    @nn.compact
    def __call__(self, hidden_states):
      up_proj_states = nn.Dense(3 * D, use_bias=False, name="up_proj")(hidden_states)
      gate_states = nn.silu(nn.Dense(3 * D, use_bias=False, name="gate_proj")(hidden_states))
      return nn.Dense(D, use_bias=False, name="down_proj")(up_proj_states * gate_states)

  class FlaxLlamaDecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, hidden_states, attention_mask, position_ids):
      residual = hidden_states
      hidden_states = FlaxLlamaRMSNorm()(hidden_states)
      hidden_states = FlaxLlamaAttention()(hidden_states, attention_mask, position_ids)
      hidden_states = residual + hidden_states
      residual = hidden_states
      hidden_states = FlaxLlamaMLP()(FlaxLlamaRMSNorm()(hidden_states))
      return residual + hidden_states

  class FlaxLlamaForCausalLM(nn.Module):
    @nn.compact
    def __call__(self, input_ids, attention_mask):
      # HF prepare_inputs_for_generation: positions count the real tokens (left padding)
      position_ids = attention_mask.cumsum(axis=-1) - 1
      x = nn.Embed(VOCAB, D)(input_ids)
      for _ in range(2):
        x = FlaxLlamaDecoderLayer()(x, attention_mask, position_ids)
      return nn.Dense(VOCAB, use_bias=False)(FlaxLlamaRMSNorm()(x))

  return FlaxLlamaForCausalLM()


def _left_padded(rng, b, t):
  """HF generation batches: pad (0) on the left, attention_mask 0 there."""
  lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)])
  am = (np.arange(t)[None, :] >= (t - lens)[:, None]).astype(np.int32)
  tok = (rng.integers(1, VOCAB, (b, t)) * am).astype(np.int32)
  return tok, am


def _llama_trials(rng):
  import optax

  model = _llama()
  params = model.init(jax.random.key(1), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))

  def forward(params, input_ids, attention_mask):
    return model.apply(params, input_ids, attention_mask)

  def train_step(params, input_ids, attention_mask):
    def loss_fn(p):
      logits = model.apply(p, input_ids, attention_mask)
      shift_logits, labels = logits[:, :-1], input_ids[:, 1:]
      weights = attention_mask[:, 1:].astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(shift_logits, labels)
      return jnp.sum(loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    return jax.value_and_grad(loss_fn)(params)

  calls = []
  for b, t in [(1, 2), (2, 8), (3, 13)]:  # the shifted loss needs t >= 2
    tok, am = _left_padded(rng, b, t)
    calls.append(({"b": b, "t": t}, (params, tok, am)))
  fwd_calls = [(s, a) for s, a in calls[1:]] + [({"b": 1, "t": 1}, (params, *_left_padded(rng, 1, 1)))]
  dims = {"params": None, "input_ids": "b, t", "attention_mask": "b, t"}
  buckets = {"b": [2, 4], "t": [8, 16]}
  return list(_fwd_and_train("llama_decoder", forward, train_step, calls, fwd_calls, dims, dims,
                             buckets))


# ===========================================================================================
# 3. bidirectional GRU tagger (nn.Bidirectional of nn.RNN(nn.GRUCell), seq_lengths=)

TAGS = 5


def _bigru():
  import flax.linen as nn

  class BiGRUTagger(nn.Module):
    hidden: int = 12

    @nn.compact
    def __call__(self, tokens, lengths):
      x = nn.Embed(VOCAB, D)(tokens)
      x = nn.Bidirectional(nn.RNN(nn.GRUCell(self.hidden)), nn.RNN(nn.GRUCell(self.hidden)))(
        x, seq_lengths=lengths
      )
      x = nn.Bidirectional(
        nn.RNN(nn.OptimizedLSTMCell(self.hidden)), nn.RNN(nn.OptimizedLSTMCell(self.hidden))
      )(x, seq_lengths=lengths)
      (c_fwd, c_bwd), _ = nn.Bidirectional(
        nn.RNN(nn.GRUCell(self.hidden)), nn.RNN(nn.GRUCell(self.hidden)), return_carry=True
      )(x, seq_lengths=lengths)
      # per-token tags, and a sentence label from the carries at each row's last token
      return nn.Dense(TAGS)(x), nn.Dense(TAGS)(jnp.concatenate([c_fwd, c_bwd], -1))

  return BiGRUTagger()


def _bigru_trials(rng):
  import optax

  model = _bigru()
  params = model.init(jax.random.key(2), jnp.ones((1, 4), jnp.int32), jnp.array([4]))

  def forward(params, tokens, lengths):
    logits, sentence = model.apply(params, tokens, lengths)
    mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return jnp.where(mask[..., None], logits, 0.0), sentence

  def train_step(params, tokens, lengths, tags):
    def loss_fn(p):
      logits, sentence = model.apply(p, tokens, lengths)
      mask = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)
      loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(tags, TAGS))
      sentence_loss = optax.softmax_cross_entropy_with_integer_labels(sentence, tags[:, 0])
      return jnp.sum(loss * mask) / jnp.sum(mask) + sentence_loss.mean()

    return jax.value_and_grad(loss_fn)(params)

  calls, fwd_calls = [], []
  for b, t in [(1, 1), (2, 8), (3, 13)]:
    tok, lens = _right_padded(rng, b, t)
    tags = rng.integers(0, TAGS, (b, t)).astype(np.int32)
    calls.append(({"b": b, "t": t}, (params, tok, lens, tags)))
    fwd_calls.append(({"b": b, "t": t}, (params, tok, lens)))
  dims = {"params": None, "tokens": "b, t", "lengths": "b", "tags": "b, t"}
  fwd_dims = {k: v for k, v in dims.items() if k != "tags"}
  buckets = {"b": [2, 4], "t": [8, 16]}
  return list(_fwd_and_train("bigru_tagger", forward, train_step, calls, fwd_calls, dims,
                             fwd_dims, buckets))


# ===========================================================================================
# 4. packed sequences (T5X / MaxText): segment_ids, positions, jax.nn.dot_product_attention


def _packed_lm(by_lengths=False):
  import flax.linen as nn

  class PackedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask, lengths):
      b, t, _ = x.shape
      y = nn.RMSNorm()(x)
      q, k, v = (nn.DenseGeneral((HEADS, D // HEADS), use_bias=False)(y) for _ in range(3))
      if by_lengths:
        out = jax.nn.dot_product_attention(
          q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths
        )
      else:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)
      x = x + nn.DenseGeneral(D, axis=(-2, -1), use_bias=False)(out)
      y = nn.RMSNorm()(x)
      return x + nn.Dense(D)(nn.relu(nn.Dense(2 * D)(y)))

  class PackedLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, segment_ids, positions):
      x = nn.Embed(VOCAB, D)(tokens) + nn.Embed(MAX_POS, D)(positions)
      # MaxText attention_op.generate_attention_mask / T5X make_attention_mask(..., jnp.equal)
      mask = segment_ids[:, :, None] == segment_ids[:, None, :]
      t = tokens.shape[1]
      causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
      mask = mask & causal[None] & (segment_ids != 0)[:, None, :]
      mask = mask[:, None, :, :]  # (b, 1, t, t): broadcast over heads
      lengths = jnp.sum(segment_ids != 0, axis=-1).astype(jnp.int32)
      for _ in range(2):
        x = PackedBlock()(x, mask, lengths)
      return nn.Dense(VOCAB)(nn.RMSNorm()(x))

  return PackedLM()


def _packed_batch(rng, b, t):
  """Rows packed with 1-3 sequences each, then 0 padding (T5X's pack_dataset)."""
  tok = np.zeros((b, t), np.int32)
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  for r in range(b):
    used = t if r == 0 else int(rng.integers(1, t + 1))
    cuts = np.sort(rng.choice(np.arange(1, used), size=min(2, max(used - 1, 0)), replace=False))
    bounds = [0, *cuts.tolist(), used]
    for s, (a, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
      tok[r, a:e] = rng.integers(1, VOCAB, e - a)
      seg[r, a:e] = s + 1
      pos[r, a:e] = np.arange(e - a)
  return tok, seg, pos


def _packed_trials(rng):
  import optax

  model = _packed_lm()
  ones = jnp.ones((1, 4), jnp.int32)
  params = model.init(jax.random.key(3), ones, ones, ones)

  def forward(params, tokens, segment_ids, positions):
    return model.apply(params, tokens, segment_ids, positions)

  def train_step(params, tokens, segment_ids, positions, targets):
    def loss_fn(p):
      logits = model.apply(p, tokens, segment_ids, positions)
      weights = (segment_ids > 0).astype(jnp.float32)  # T5X: loss_weights of packed targets
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
      return jnp.sum(loss * weights) / jnp.sum(weights)

    return jax.value_and_grad(loss_fn)(params)

  calls, fwd_calls = [], []
  for b, t in [(1, 1), (2, 8), (3, 13)]:
    tok, seg, pos = _packed_batch(rng, b, t)
    targets = rng.integers(0, VOCAB, (b, t)).astype(np.int32)
    calls.append(({"b": b, "t": t}, (params, tok, seg, pos, targets)))
    fwd_calls.append(({"b": b, "t": t}, (params, tok, seg, pos)))
  dims = {"params": None, "tokens": "b, t", "segment_ids": "b, t", "positions": "b, t",
          "targets": "b, t"}
  fwd_dims = {k: v for k, v in dims.items() if k != "targets"}
  buckets = {"b": [2, 4], "t": [8, 16]}
  trials = list(_fwd_and_train("packed_lm", forward, train_step, calls, fwd_calls, dims,
                               fwd_dims, buckets))

  # one sequence a row: attention by query/key lengths (jax.nn.dot_product_attention's
  # seq_lengths, as MaxText's and HF's cuDNN paths pass them)
  by_len = _packed_lm(by_lengths=True)

  def forward_by_lengths(params, tokens, segment_ids, positions):
    return by_len.apply(params, tokens, segment_ids, positions)

  len_calls = []
  for b, t in [(1, 1), (2, 8), (3, 13)]:
    tok, lens = _right_padded(rng, b, t)
    seg = (tok > 0).astype(np.int32)
    pos = np.where(tok > 0, np.arange(t)[None, :], 0).astype(np.int32)
    len_calls.append(({"b": b, "t": t}, (params, tok, seg, pos)))
  trials.append(_trial("packed_lm seq_lengths forward", forward_by_lengths, fwd_dims, buckets,
                       len_calls))
  return trials


# ===========================================================================================
# 5. Whisper-like 1D conv audio encoder, mask after the stride as HF's Flax wav2vec2 makes it

N_MEL = 6


def sinusoids(length, channels, max_timescale=10000):
  """openai/whisper model.py ``sinusoids``, its torch ops as jax.numpy ones."""
  log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
  inv_timescales = jnp.exp(-log_timescale_increment * jnp.arange(channels // 2))
  scaled_time = jnp.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
  return jnp.concatenate([jnp.sin(scaled_time), jnp.cos(scaled_time)], axis=1)


def sinusoids_np(length, channels, max_timescale=10000):
  """The same table made with NumPy (ports that precompute it as a constant buffer)."""
  log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
  inv_timescales = np.exp(-log_timescale_increment * np.arange(channels // 2))
  scaled_time = np.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
  return np.concatenate([np.sin(scaled_time), np.cos(scaled_time)], axis=1).astype(np.float32)


def _audio_encoder(table=sinusoids):
  import flax.linen as nn

  def _get_feat_extract_output_lengths(input_lengths):
    # HF FlaxWav2Vec2: (length - kernel) // stride + 1 per conv, here with whisper's padding 1
    def _conv_out_length(input_length, kernel_size, stride, pad):
      return (input_length + 2 * pad - kernel_size) // stride + 1

    for kernel_size, stride, pad in ((3, 1, 1), (3, 2, 1)):
      input_lengths = _conv_out_length(input_lengths, kernel_size, stride, pad)
    return input_lengths

  def _get_feature_vector_attention_mask(feature_vector_length, attention_mask):
    # HF modeling_flax_wav2vec2.py, verbatim but for the helper's name
    non_padded_lengths = attention_mask.cumsum(axis=-1)[:, -1]
    output_lengths = _get_feat_extract_output_lengths(non_padded_lengths)
    batch_size = attention_mask.shape[0]
    attention_mask = jnp.zeros((batch_size, feature_vector_length), dtype=attention_mask.dtype)
    attention_mask = attention_mask.at[jnp.arange(attention_mask.shape[0]),
                                       output_lengths - 1].set(1)
    attention_mask = jnp.flip(jnp.flip(attention_mask, -1).cumsum(-1), -1).astype("bool")
    return attention_mask

  class AudioEncoder(nn.Module):
    classes: int = 4

    @nn.compact
    def __call__(self, mel, attention_mask):
      x = nn.gelu(nn.Conv(D, (3,), padding="SAME")(mel), approximate=False)
      x = nn.gelu(nn.Conv(D, (3,), strides=(2,), padding=((1, 1),))(x), approximate=False)
      x = x + table(MAX_POS, D)[: x.shape[1]]
      m = _get_feature_vector_attention_mask(x.shape[1], attention_mask)
      y = nn.LayerNorm()(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(
        y, y, mask=nn.make_attention_mask(m, m)
      )
      x = x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
      mf = m[..., None].astype(x.dtype)
      pooled = (x * mf).sum(1) / mf.sum(1)
      return nn.Dense(self.classes)(pooled)

  return AudioEncoder()


def _audio_trials(rng):
  import optax

  model = _audio_encoder()
  params = model.init(jax.random.key(4), jnp.zeros((1, 8, N_MEL)), jnp.ones((1, 8), jnp.int32))

  def forward(params, mel, attention_mask):
    return model.apply(params, mel, attention_mask)

  def train_step(params, mel, attention_mask, label):
    def loss_fn(p):
      logits = model.apply(p, mel, attention_mask)
      return optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()

    return jax.value_and_grad(loss_fn)(params)

  calls, fwd_calls = [], []
  for b, t in [(1, 1), (2, 16), (3, 27)]:
    lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)])
    am = (np.arange(t)[None, :] < lens[:, None]).astype(np.int32)
    mel = (rng.normal(size=(b, t, N_MEL)) * am[..., None]).astype(np.float32)
    label = rng.integers(0, 4, (b,)).astype(np.int32)
    calls.append(({"b": b, "t": t}, (params, mel, am, label)))
    fwd_calls.append(({"b": b, "t": t}, (params, mel, am)))
  dims = {"params": None, "mel": f"b, t, {N_MEL}", "attention_mask": "b, t", "label": "b"}
  fwd_dims = {k: v for k, v in dims.items() if k != "label"}
  buckets = {"b": [2, 4], "t": [16, 32]}
  trials = list(_fwd_and_train("conv_audio", forward, train_step, calls, fwd_calls, dims,
                               fwd_dims, buckets))
  # the positions table made with NumPy: a NumPy array cannot be sliced by a symbolic size
  np_model = _audio_encoder(sinusoids_np)

  def forward_np_table(params, mel, attention_mask):
    return np_model.apply(params, mel, attention_mask)

  trials.append(_trial("conv_audio numpy table forward", forward_np_table, fwd_dims, buckets,
                       fwd_calls))
  return trials


# ===========================================================================================
# 6. last-token pooling (HF *ForSequenceClassification), take_along_axis, segment_sum

PAD_ID = 0


def _pool_model():
  import flax.linen as nn

  class Classifier(nn.Module):
    @nn.compact
    def __call__(self, input_ids, lengths):
      b, t = input_ids.shape
      x = nn.Embed(VOCAB, D)(input_ids)
      mask = nn.combine_masks(nn.make_causal_mask(input_ids),
                              nn.make_attention_mask(input_ids != PAD_ID, input_ids != PAD_ID))
      x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(x, x, mask=mask)
      logits = nn.Dense(3)(x)
      # HF FlaxGPT2/torch *ForSequenceClassification: the last non-pad token of each row
      sequence_lengths = jnp.argmax(jnp.equal(input_ids, PAD_ID).astype("i4"), -1) - 1
      sequence_lengths = sequence_lengths % input_ids.shape[-1]
      pooled_logits = logits[jnp.arange(b), sequence_lengths]
      # the last valid token by the lengths (take_along_axis), and a segment_sum of the
      # flattened tokens into their rows (padding tokens weighted out)
      last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
      flat = (x * (input_ids != PAD_ID)[..., None]).reshape(b * t, D)
      row_ids = jnp.repeat(jnp.arange(b), t)
      summed = jax.ops.segment_sum(flat, row_ids, num_segments=b)
      return pooled_logits, nn.Dense(3)(last + summed / lengths[:, None])

  return Classifier()


def _pool_trials(rng):
  model = _pool_model()
  params = model.init(jax.random.key(5), jnp.ones((1, 4), jnp.int32), jnp.array([4]))

  def forward(params, input_ids, lengths):
    return model.apply(params, input_ids, lengths)

  def train_step(params, input_ids, lengths, labels):
    def loss_fn(p):
      a, c = model.apply(p, input_ids, lengths)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(a + c), labels[:, None], 1))

    return jax.value_and_grad(loss_fn)(params)

  calls, fwd_calls = [], []
  for b, t in [(1, 1), (2, 8), (3, 13)]:
    tok, lens = _right_padded(rng, b, t)
    labels = rng.integers(0, 3, (b,)).astype(np.int32)
    calls.append(({"b": b, "t": t}, (params, tok, lens, labels)))
    fwd_calls.append(({"b": b, "t": t}, (params, tok, lens)))
  dims = {"params": None, "input_ids": "b, t", "lengths": "b", "labels": "b"}
  fwd_dims = {k: v for k, v in dims.items() if k != "labels"}
  buckets = {"b": [2, 4], "t": [8, 16]}
  return list(_fwd_and_train("last_token_pool", forward, train_step, calls, fwd_calls, dims,
                             fwd_dims, buckets))


# ===========================================================================================


GROUPS = {  # name prefix -> builder (each with its own seeded rng)
  "t5_encoder": _t5_trials,
  "llama_decoder": _llama_trials,
  "bigru_tagger": _bigru_trials,
  "packed_lm": _packed_trials,
  "conv_audio": _audio_trials,
  "last_token_pool": _pool_trials,
}


@functools.cache
def _group(prefix: str) -> dict:
  seed = 100 + list(GROUPS).index(prefix)
  return {t.name: t for t in GROUPS[prefix](np.random.default_rng(seed))}


def get(name: str) -> Trial:
  prefix = next(p for p in GROUPS if name.startswith(p))
  return _group(prefix)[name]


def build() -> list[Trial]:
  return [t for p in GROUPS for t in _group(p).values()]


def main() -> None:
  """Prints the table (as ``_clients.main`` does for the first set)."""
  from tests.trials import _clients

  saved = _clients.build
  _clients.build = build
  try:
    _clients.main()
  finally:
    _clients.build = saved


if __name__ == "__main__":
  main()
