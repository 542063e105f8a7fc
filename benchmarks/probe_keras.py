"""Keras 3 models on the JAX backend under ``dynjax.jit(padding="auto")`` against ``jax.jit``.

  python3 -m venv /tmp/keras
  /tmp/keras/bin/pip install "jax[cpu]==0.10.2" flax optax keras   # keras 3.15.1 was used
  PYTHONPATH=$PWD KERAS_BACKEND=jax /tmp/keras/bin/python benchmarks/probe_keras.py --out $OUT

Keras is not a dynjax dependency: this probe only.  Real client code as keras.io writes it,
each model built from random weights (no download) and called through Keras's "custom training
loop with JAX" idiom: ``model.stateless_call(trainable_variables, non_trainable_variables, x,
training=...)`` inside the function (the variables passed as ordinary lists of arrays),
``jax.value_and_grad(compute_loss_and_updates, has_aux=True)`` and
``optimizer.stateless_apply`` for a whole training step ``train_step(state, data)``, and a
forward (inference) function ``forward(state, x)``.  Token ids of shape (b, t), right-padded
with 0, at several lengths; ``dims={"state": None, "x": "b, t"}``, ``buckets={"b": [4],
"t": pow2(min=8)}``.  For each model and part: every call's largest absolute difference from
``jax.jit`` at the exact shape (exact = rtol = atol = 1e-5 on every leaf), the family's
compiles against the buckets the lengths hit, and the fallbacks' reasons.  ``--models``
picks models (``MODELS``).  Writes ``probe_keras.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import warnings

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "jax")

from benchmarks._report import write_json  # noqa: E402

VOCAB, D, HEADS, FF = 40, 16, 2, 32
MODELS = ("ctc_asr,keras_attention,conv_autoencoder,transformer_clf,lstm_mask,gru_mask,bilstm_mask,bilstm_imdb,conv1d_maxpool,"
          "mha_attention_mask,seq2seq_transformer,masked_avgpool,simple_rnn_tagger,"
          "causal_conv,lstm_seq2seq,batchnorm_conv")
LENGTHS = "5,8,13,16,23,32,40"


def _models():
  """name -> builder of (model, loss, kind): kind says which inputs and targets it takes."""
  import keras  # noqa: PLC0415
  from keras import layers, ops  # noqa: PLC0415

  class TokenAndPositionEmbedding(layers.Layer):  # keras.io text_classification_with_transformer
    def __init__(self, maxlen, vocab_size, embed_dim, **kw):
      super().__init__(**kw)
      self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
      self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
      maxlen = ops.shape(x)[-1]
      positions = ops.arange(start=0, stop=maxlen, step=1)
      positions = self.pos_emb(positions)
      x = self.token_emb(x)
      return x + positions

  class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kw):
      super().__init__(**kw)
      self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
      self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                   layers.Dense(embed_dim)])
      self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
      self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
      self.dropout1 = layers.Dropout(rate)
      self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
      attn_output = self.att(inputs, inputs)
      attn_output = self.dropout1(attn_output)
      out1 = self.layernorm1(inputs + attn_output)
      ffn_output = self.ffn(out1)
      ffn_output = self.dropout2(ffn_output)
      return self.layernorm2(out1 + ffn_output)

  class PositionalEmbedding(layers.Layer):  # keras.io neural_machine_translation_with_transformer
    def __init__(self, sequence_length, vocab_size, embed_dim, **kw):
      super().__init__(**kw)
      self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
      self.position_embeddings = layers.Embedding(input_dim=sequence_length,
                                                  output_dim=embed_dim)

    def call(self, inputs):
      length = ops.shape(inputs)[-1]
      positions = ops.arange(0, length, 1)
      return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
      return ops.not_equal(inputs, 0)

  class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kw):
      super().__init__(**kw)
      self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
      self.dense_proj = keras.Sequential([layers.Dense(dense_dim, activation="relu"),
                                          layers.Dense(embed_dim)])
      self.layernorm_1 = layers.LayerNormalization()
      self.layernorm_2 = layers.LayerNormalization()
      self.supports_masking = True

    def call(self, inputs, mask=None):
      if mask is not None:
        padding_mask = ops.cast(mask[:, None, :], dtype="int32")
      else:
        padding_mask = None
      attention_output = self.attention(query=inputs, value=inputs, key=inputs,
                                        attention_mask=padding_mask)
      proj_input = self.layernorm_1(inputs + attention_output)
      proj_output = self.dense_proj(proj_input)
      return self.layernorm_2(proj_input + proj_output)

  class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kw):
      super().__init__(**kw)
      self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
      self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
      self.dense_proj = keras.Sequential([layers.Dense(latent_dim, activation="relu"),
                                          layers.Dense(embed_dim)])
      self.layernorm_1 = layers.LayerNormalization()
      self.layernorm_2 = layers.LayerNormalization()
      self.layernorm_3 = layers.LayerNormalization()
      self.supports_masking = True

    def call(self, inputs, mask=None):
      # keras.io builds the causal mask by ops.tile(mask, [batch_size, 1, 1]), which Keras
      # itself cannot trace on jax 0.10 (tile's reps must be hashable); MultiHeadAttention's
      # own use_causal_mask=True makes the same mask
      inputs, encoder_outputs = inputs
      if mask is None:
        inputs_padding_mask, encoder_outputs_padding_mask = None, None
      else:
        inputs_padding_mask, encoder_outputs_padding_mask = mask
      attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs,
                                            use_causal_mask=True,
                                            query_mask=inputs_padding_mask)
      out_1 = self.layernorm_1(inputs + attention_output_1)
      attention_output_2 = self.attention_2(query=out_1, value=encoder_outputs,
                                            key=encoder_outputs, query_mask=inputs_padding_mask,
                                            key_mask=encoder_outputs_padding_mask)
      out_2 = self.layernorm_2(out_1 + attention_output_2)
      proj_output = self.dense_proj(out_2)
      return self.layernorm_3(out_2 + proj_output)

  def ids():
    return keras.Input(shape=(None,), dtype="int32")

  def clf(x, inputs, n=2):
    return keras.Model(inputs, layers.Dense(n)(x))

  def transformer_clf():  # keras.io/examples/nlp/text_classification_with_transformer
    inputs = ids()
    x = TokenAndPositionEmbedding(64, VOCAB, D)(inputs)
    x = TransformerBlock(D, HEADS, FF)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(x)), "probs", "clf"

  def rnn(cell, bidirectional=False):
    def build():
      inputs = ids()
      x = layers.Embedding(VOCAB, D, mask_zero=True)(inputs)
      r = cell(D)
      x = (layers.Bidirectional(r) if bidirectional else r)(x)
      return clf(x, inputs), "logits", "clf"
    return build

  def bilstm_imdb():  # keras.io/examples/nlp/bidirectional_lstm_imdb (+ mask_zero=True)
    inputs = ids()
    x = layers.Embedding(VOCAB, D, mask_zero=True)(inputs)
    x = layers.Bidirectional(layers.LSTM(D, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(D))(x)
    return keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x)), "binary", "binary"

  def conv1d_maxpool():  # keras.io/examples/nlp/text_classification_from_scratch
    inputs = ids()
    x = layers.Embedding(VOCAB, D)(inputs)
    x = layers.Dropout(0.5)(x)
    x = layers.Conv1D(D, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.Conv1D(D, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(D, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    return keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x)), "binary", "binary"

  def mha_attention_mask():  # an explicit attention_mask from the padding
    inputs = ids()
    x = layers.Embedding(VOCAB, D)(inputs)
    pad = ops.not_equal(inputs, 0)
    att = layers.MultiHeadAttention(num_heads=HEADS, key_dim=D // HEADS)
    y = att(x, x, attention_mask=pad[:, None, :])
    x = layers.LayerNormalization()(x + y)
    x = layers.GlobalAveragePooling1D()(x)
    return clf(x, inputs), "logits", "clf"

  def seq2seq_transformer():  # keras.io/examples/nlp/neural_machine_translation_with_transformer
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(64, VOCAB, D)(encoder_inputs)
    encoder_outputs = TransformerEncoder(D, FF, HEADS)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(64, VOCAB, D)(decoder_inputs)
    x = TransformerDecoder(D, FF, HEADS)([x, encoder_outputs])
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(VOCAB, activation="softmax")(x)
    return (keras.Model([encoder_inputs, decoder_inputs], decoder_outputs), "seq_probs",
            "seq2seq")

  def masked_avgpool():  # Embedding(mask_zero) -> GlobalAveragePooling1D masked by Keras
    inputs = ids()
    x = layers.Embedding(VOCAB, D, mask_zero=True)(inputs)
    x = layers.Dense(D, activation="relu")(x)
    x = layers.GlobalAveragePooling1D()(x)
    return clf(x, inputs), "logits", "clf"

  def simple_rnn_tagger():  # a tagger: SimpleRNN(return_sequences) + TimeDistributed(Dense)
    inputs = ids()
    x = layers.Embedding(VOCAB, D, mask_zero=True)(inputs)
    x = layers.SimpleRNN(D, return_sequences=True)(x)
    x = layers.TimeDistributed(layers.Dense(5))(x)
    return keras.Model(inputs, x), "seq_logits", "tagger"

  def causal_conv():  # WaveNet-style causal dilated Conv1D over float sequences + Masking
    inputs = keras.Input(shape=(None, 3))
    x = layers.Masking(mask_value=0.0)(inputs)
    x = layers.Conv1D(D, 3, padding="causal", dilation_rate=2, activation="relu")(x)
    x = layers.Conv1D(D, 3, padding="same", activation="relu")(x)
    x = layers.LSTM(D)(x)
    return clf(x, inputs), "logits", "float_clf"

  def lstm_seq2seq():  # keras.io/examples/nlp/lstm_seq2seq (encoder states -> decoder)
    encoder_inputs = keras.Input(shape=(None,), dtype="int32")
    e = layers.Embedding(VOCAB, D, mask_zero=True)(encoder_inputs)
    _, state_h, state_c = layers.LSTM(D, return_state=True)(e)
    decoder_inputs = keras.Input(shape=(None,), dtype="int32")
    d = layers.Embedding(VOCAB, D, mask_zero=True)(decoder_inputs)
    d = layers.LSTM(D, return_sequences=True)(d, initial_state=[state_h, state_c])
    out = layers.Dense(VOCAB, activation="softmax")(d)
    return keras.Model([encoder_inputs, decoder_inputs], out), "seq_probs", "seq2seq"

  def batchnorm_conv():  # keras.io/examples/timeseries/timeseries_classification_from_scratch
    input_layer = keras.Input(shape=(None, 1))
    x = input_layer
    for _ in range(3):
      x = layers.Conv1D(filters=D, kernel_size=3, padding="same")(x)
      x = layers.BatchNormalization()(x)
      x = layers.ReLU()(x)
    gap = layers.GlobalAveragePooling1D()(x)
    return keras.Model(input_layer, layers.Dense(2, activation="softmax")(gap)), "probs", \
      "series_clf"

  def ctc_asr():  # keras.io/examples/audio/ctc_asr (DeepSpeech2-like), small
    inputs = keras.Input(shape=(None, 8))
    x = layers.Reshape((-1, 8, 1))(inputs)
    x = layers.Conv2D(4, kernel_size=[3, 5], strides=[2, 2], padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    x = layers.Reshape((-1, x.shape[-2] * x.shape[-1]))(x)
    x = layers.Bidirectional(layers.GRU(D, return_sequences=True, reset_after=True))(x)
    x = layers.Dropout(0.5)(x)
    return keras.Model(inputs, layers.Dense(6)(x)), "ctc", "speech"

  def keras_attention():  # layers.Attention([query, value]) with the masks Embedding makes
    q_in, v_in = ids(), ids()
    emb = layers.Embedding(VOCAB, D, mask_zero=True)
    q, v = emb(q_in), emb(v_in)
    x = layers.Attention()([q, v])
    x = layers.Concatenate()([layers.GlobalAveragePooling1D()(q),
                              layers.GlobalAveragePooling1D()(x)])
    return keras.Model([q_in, v_in], layers.Dense(2)(x)), "logits", "pair"

  def conv_autoencoder():  # keras.io/examples/timeseries/timeseries_anomaly_detection
    inputs = keras.Input(shape=(None, 1))
    x = layers.Conv1D(8, 7, padding="same", strides=2, activation="relu")(inputs)
    x = layers.Dropout(0.2)(x)
    x = layers.Conv1D(4, 7, padding="same", strides=2, activation="relu")(x)
    x = layers.Conv1DTranspose(4, 7, padding="same", strides=2, activation="relu")(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Conv1DTranspose(8, 7, padding="same", strides=2, activation="relu")(x)
    x = layers.Conv1DTranspose(1, 7, padding="same")(x)
    return keras.Model(inputs, x), "mse", "series"

  return {
    "ctc_asr": ctc_asr,
    "keras_attention": keras_attention,
    "conv_autoencoder": conv_autoencoder,
    "transformer_clf": transformer_clf,
    "lstm_mask": rnn(layers.LSTM),
    "gru_mask": rnn(layers.GRU),
    "bilstm_mask": rnn(layers.LSTM, bidirectional=True),
    "bilstm_imdb": bilstm_imdb,
    "conv1d_maxpool": conv1d_maxpool,
    "mha_attention_mask": mha_attention_mask,
    "seq2seq_transformer": seq2seq_transformer,
    "masked_avgpool": masked_avgpool,
    "simple_rnn_tagger": simple_rnn_tagger,
    "causal_conv": causal_conv,
    "lstm_seq2seq": lstm_seq2seq,
    "batchnorm_conv": batchnorm_conv,
  }


def build(name: str):
  """(model, optimizer, loss_fn, kind), the model built from random weights (seeded)."""
  import keras  # noqa: PLC0415

  keras.utils.set_random_seed(0)
  model, loss, kind = _models()[name]()
  loss_fn = {
    "probs": keras.losses.SparseCategoricalCrossentropy(),
    "logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "binary": keras.losses.BinaryCrossentropy(),
    "seq_probs": keras.losses.SparseCategoricalCrossentropy(),
    "seq_logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "ctc": keras.losses.CTC(),
    "mse": keras.losses.MeanSquaredError(),
  }[loss]
  optimizer = keras.optimizers.Adam(learning_rate=LR)
  optimizer.build(model.trainable_variables)
  return model, optimizer, loss_fn, kind


def functions(model, optimizer, loss_fn):
  """(forward, train_step) as keras.io's "Writing a training loop from scratch in JAX"."""
  import jax  # noqa: PLC0415

  def forward(state, x):
    trainable_variables, non_trainable_variables = state
    y_pred, _ = model.stateless_call(trainable_variables, non_trainable_variables, x,
                                     training=False)
    return y_pred

  def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
    y_pred, non_trainable_variables = model.stateless_call(
      trainable_variables, non_trainable_variables, x, training=True)
    loss = loss_fn(y, y_pred)
    return loss, non_trainable_variables

  grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

  def train_step(state, data):
    trainable_variables, non_trainable_variables, optimizer_variables = state
    x, y = data
    (loss, non_trainable_variables), grads = grad_fn(
      trainable_variables, non_trainable_variables, x, y)
    trainable_variables, optimizer_variables = optimizer.stateless_apply(
      optimizer_variables, grads, trainable_variables)
    return loss, (trainable_variables, non_trainable_variables, optimizer_variables)

  return forward, train_step


# Adam on a zero gradient: a Conv1D's bias right before BatchNormalization has a zero gradient
# in exact arithmetic (the batch mean removes it); its computed gradient is rounding noise
# (~4e-7 against ~0.1 elsewhere), which Adam's m / (sqrt(v) + eps) turns into a step of up to
# +-lr whose sign depends on the summation order: jax.jit at two shapes disagrees there too.
# Those leaves are compared to within two steps (each call is one step from the same state).
LOOSE = {"batchnorm_conv": re.compile(r"conv1d(_\d+)?/bias$")}
LR = 1e-3


def inputs(kind, b, t, rng):
  """(x, y, x_dims, y_dims): right-padded token ids (row 0 full length, lengths >= 1)."""
  import numpy as np  # noqa: PLC0415

  def tokens(t):
    lens = np.concatenate([[t], rng.integers(1, t + 1, b - 1)])
    tok = rng.integers(1, VOCAB, (b, t)).astype(np.int32)
    tok[np.arange(t)[None, :] >= lens[:, None]] = 0
    return tok

  if kind == "clf":
    return tokens(t), rng.integers(0, 2, b).astype(np.int32), "b, t", "b"
  if kind == "binary":
    return tokens(t), rng.integers(0, 2, (b, 1)).astype(np.float32), "b, t", "b, 1"
  if kind == "tagger":
    return tokens(t), rng.integers(0, 5, (b, t)).astype(np.int32), "b, t", "b, t"
  if kind == "series_clf":
    return (rng.normal(size=(b, t, 1)).astype(np.float32), rng.integers(0, 2, b).astype(np.int32),
            "b, t, 1", "b")
  if kind == "float_clf":
    x = rng.normal(size=(b, t, 3)).astype(np.float32)
    x[1:, t * 2 // 3:] = 0.0  # Masking(mask_value=0.0): padded steps are all zeros
    return x, rng.integers(0, 2, b).astype(np.int32), "b, t, 3", "b"
  if kind == "speech":  # spectrogram frames (b, t, 8); labels (b, n), n = t // 4 + 1 (no 0)
    n = t // 4 + 1
    x = rng.normal(size=(b, t, 8)).astype(np.float32)
    return x, rng.integers(1, 6, (b, n)).astype(np.int32), "b, t, 8", "b, n"
  if kind == "pair":
    return [tokens(t), tokens(t // 2 + 1)], rng.integers(0, 2, b).astype(np.int32), \
      ["b, t", "b, u"], "b"
  if kind == "series":  # as model.fit(x, x): the length a multiple of 4 (two stride-2 convs
    # and two stride-2 transposed ones give 4 * ceil(t / 4) steps back)
    x = rng.normal(size=(b, -(-t // 4) * 4, 1)).astype(np.float32)
    return x, x, "b, t, 1", "b, t, 1"
  assert kind == "seq2seq"  # source of length t, target of length t // 2 + 1 (dim "u")
  u = t // 2 + 1
  x = [tokens(t), tokens(u)]
  return x, rng.integers(0, VOCAB, (b, u)).astype(np.int32), ["b, t", "b, u"], "b, u"


def probe(name: str, train: bool, lengths, batch: int = 4) -> dict:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import dynjax  # noqa: PLC0415

  model, optimizer, loss_fn, kind = build(name)
  forward, train_step = functions(model, optimizer, loss_fn)
  state = ([v.value for v in model.trainable_variables],
           [v.value for v in model.non_trainable_variables])
  if train:
    state = (*state, [v.value for v in optimizer.variables])
  rng = np.random.default_rng(0)
  calls = [inputs(kind, batch, t, rng) for t in lengths]
  _, _, xd, yd = calls[0]
  pol = dynjax.buckets.pow2(min=8)
  fn, dims = ((train_step, {"state": None, "data": (xd, yd)}) if train
              else (forward, {"state": None, "x": xd}))
  dvars = set(re.findall(r"[a-z]+", str(dims["data" if train else "x"])))
  buckets = {v: dynjax.buckets.explicit([batch]) if v == "b" else pol for v in dvars}
  g = dynjax.jit(fn, dims=dims, buckets=buckets, padding="auto")
  ref = jax.jit(fn)
  rec = {"kind": kind, "max_abs_err": {}, "exact": True, "bad": []}
  names = ["loss"] + [v.path for v in model.trainable_variables] if train else []
  loose = {i for i, n in enumerate(names) if name in LOOSE and LOOSE[name].search(n)}
  if loose:
    rec["loose"] = {names[i]: 0.0 for i in sorted(loose)}
  seen = set()
  for x, y, _, _ in calls:
    a = (state, (x, y)) if train else (state, x)
    want = jax.tree.leaves(ref(*a))
    got = jax.tree.leaves(g(*a))
    t = int((x[0] if isinstance(x, list) else x).shape[1])
    xs = x if isinstance(x, list) else [x]
    sizes = {"t": xs[0].shape[1], "u": xs[-1].shape[1], "n": np.shape(y)[-1]}
    seen.add(tuple(max(8, 1 << (int(sizes[v]) - 1).bit_length())  # pow2(min=8)
                   for v in sorted(dvars - {"b"})))
    err = 0.0
    for i, (p, q) in enumerate(zip(got, want, strict=True)):
      p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
      if p.shape != q.shape:
        rec["bad"].append(f"t={t} leaf {i}: shape {p.shape} != {q.shape}")
        err = float("inf")
        continue
      if i in loose:
        e = float(np.max(np.abs(p - q), initial=0.0))
        rec["loose"][names[i]] = max(rec["loose"][names[i]], e)
        if e > 2 * LR:
          rec["bad"].append(f"t={t} {names[i]}: max abs err {e:.3g} > 2 lr")
        continue
      err = max(err, float(np.max(np.abs(p - q), initial=0.0)))
      if not np.allclose(p, q, rtol=1e-5, atol=1e-5, equal_nan=True):
        rec["bad"].append(f"t={t} leaf {i} {p.shape}: max abs err "
                          f"{float(np.max(np.abs(p - q))):.3g}")
    rec["max_abs_err"][t] = err
  st = g.stats()
  rec.update(exact=not rec["bad"], compiles=st["compiles"], buckets=len(seen),
             fallbacks=[str(f) for f in st["fallbacks"]])
  return rec


def _reason(rec) -> str:
  text = rec.get("error") or (rec["fallbacks"][0] if rec.get("fallbacks") else "")
  return " ".join(text.split("The function runs unpadded")[0].split())[:160]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default=MODELS)
  ap.add_argument("--train", default=None, help="models whose train_step is probed too "
                  "(default: the same as --models; empty: none)")
  ap.add_argument("--lengths", default=LENGTHS)
  ap.add_argument("--no-opt", action="store_true", help="compile without XLA's optimisations "
                  "(jax_disable_most_optimizations, as the test suite; both sides alike). "
                  "Beware: reduce_max's gradient (eq(x, max(x))) then finds no maximum in some "
                  "rows: jax.jit's own gradients through BatchNormalization + "
                  "GlobalMaxPooling1D change by O(1) between the modes")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  warnings.simplefilter("ignore")  # dynjax's fallback warnings: the table reports them
  import jax  # noqa: PLC0415
  import keras  # noqa: PLC0415

  import dynjax  # noqa: PLC0415

  jax.config.update("jax_disable_most_optimizations", args.no_opt)

  lengths = [int(t) for t in args.lengths.split(",")]
  report = {"jax": jax.__version__, "keras": keras.__version__,
            "keras_backend": keras.backend.backend(), "dynjax": dynjax.__version__,
            "device": jax.devices()[0].device_kind, "lengths": lengths,
            "xla_optimizations": not args.no_opt, "models": {}}
  print("| model | part | exact? (max abs err) | compiles/buckets | fallback / error |")
  print("|---|---|---|---|---|")
  train = args.models if args.train is None else args.train
  for part, names in (("forward", args.models), ("train", train)):
    for name in filter(None, names.split(",")):
      t0 = time.perf_counter()
      lens = lengths
      if name == "conv1d_maxpool":  # two VALID stride-3 convs of width 7 need t >= 25
        lens = [t for t in lengths if t >= 25] or [25, 40]
      try:
        rec = probe(name, part == "train", lens)
      except Exception as e:  # noqa: BLE001 - one model must not lose the others
        rec = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
      rec["seconds"] = time.perf_counter() - t0
      report["models"][f"{name} {part}"] = rec
      err = max(rec.get("max_abs_err", {}).values(), default=float("nan"))
      exact = {True: "yes", False: "NO"}.get(rec.get("exact"), "-")
      print(f"| {name} | {part} | {exact} ({err:.1e}) | {rec.get('compiles', '-')}/"
            f"{rec.get('buckets', '-')} | {_reason(rec)} |", flush=True)
  write_json(args.out, "probe_keras.json", report)
  return report


if __name__ == "__main__":
  main()
