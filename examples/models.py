"""The models of the benchmarks, tests and examples: one weight layout, three implementations
(jax.numpy, Flax Linen, PyTorch).

* :func:`encoder_apply`: a BERT-style transformer encoder in plain ``jax.numpy`` with an
  explicit length mask (issue 2's benchmark model); :func:`encoder_apply_unmasked` is the
  natural version a user writes without thinking about padding (it attends to every position
  it is given), the input of ``padding="auto"``.
* :class:`BertEncoder`: the same network as a Linen module (``pos_embed[:, :t]`` sliced from a
  static ``max_len`` table, multi-head attention masked from ``lengths``, post-LayerNorm, GELU
  MLP).  Its ``params`` tree is exactly the tree :func:`init_encoder_params` makes, so the
  jax.numpy function, the Linen module and the PyTorch twin all run the same weights.
* :func:`lstm_apply`: an LSTM text classifier over ``lax.scan`` with lengths (the carry stops
  updating past each sequence's length).
* :func:`torch_bert` / :func:`torch_lstm`: PyTorch twins loading the same numpy weights.  torch
  is imported lazily; :func:`torch_available` says whether it can be.

Weights are made with numpy (seeded), not ``module.init``: no compile is spent on
initialisation, and every framework loads the same arrays.

Example:
  >>> cfg = ENCODER_SIZES["tiny"]
  >>> params = init_encoder_params(cfg, seed=0)
  >>> pooled = encoder_apply(params, tokens, lengths, cfg=cfg)  # [b, d]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = Any  # a nested dict of arrays


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
  """Sizes of the BERT-style encoder."""

  vocab: int = 30522
  d_model: int = 128
  heads: int = 2
  layers: int = 2
  ffn: int = 512
  max_len: int = 512
  eps: float = 1e-12
  # How attention is computed (the weights are the same for every choice): "einsum" (default)
  # is the idiom of public Flax code; "xla"/"cudnn" call jax.nn.dot_product_attention with the
  # boolean key mask, "xla_lengths"/"cudnn_lengths" with key_value_seq_lengths instead; "none"
  # is a cheap stand-in (the values pass through) that measures attention's share of the time.
  attention_impl: str = "einsum"

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


ATTENTION_IMPLS = ("einsum", "xla", "cudnn", "xla_lengths", "cudnn_lengths", "none")


ENCODER_SIZES = {
    "tiny": EncoderConfig(d_model=128, heads=2, layers=2, ffn=512),
    "small": EncoderConfig(d_model=256, heads=4, layers=4, ffn=1024),
    "base": EncoderConfig(d_model=768, heads=12, layers=12, ffn=3072),
}


@dataclasses.dataclass(frozen=True)
class LstmConfig:
  """Sizes of the LSTM text classifier."""

  vocab: int = 30522
  embed: int = 128
  hidden: int = 512
  classes: int = 4


LSTM_SIZES = {
    "tiny": LstmConfig(embed=64, hidden=128),
    "small": LstmConfig(embed=128, hidden=256),
    "base": LstmConfig(embed=256, hidden=512),
}


# -- weights -------------------------------------------------------------------------------
def _dense(rng: np.random.Generator, n_in: int, n_out: int) -> dict:
  return {"kernel": (rng.standard_normal((n_in, n_out)) / math.sqrt(n_in)).astype(np.float32),
          "bias": np.zeros((n_out,), np.float32)}


def _ln(d: int) -> dict:
  return {"scale": np.ones((d,), np.float32), "bias": np.zeros((d,), np.float32)}


def init_encoder_params(cfg: EncoderConfig, seed: int = 0) -> Params:
  """Seeded numpy weights of the encoder, in the Linen :class:`BertEncoder` ``params`` layout.

  Layout: ``tok_embed/embedding [V, d]``, ``pos_embed [1, max_len, d]``, ``emb_ln``, and per
  layer ``layer_{i}/{attn/{qkv,out},ln1,mlp_in,mlp_out,ln2}`` (Dense kernels are ``[in, out]``).
  """
  rng = np.random.default_rng(seed)
  d = cfg.d_model
  p: dict = {
      "tok_embed": {"embedding": (0.02 * rng.standard_normal((cfg.vocab, d))).astype(np.float32)},
      "pos_embed": (0.02 * rng.standard_normal((1, cfg.max_len, d))).astype(np.float32),
      "emb_ln": _ln(d),
  }
  for i in range(cfg.layers):
    p[f"layer_{i}"] = {
        "attn": {"qkv": _dense(rng, d, 3 * d), "out": _dense(rng, d, d)},
        "ln1": _ln(d),
        "mlp_in": _dense(rng, d, cfg.ffn),
        "mlp_out": _dense(rng, cfg.ffn, d),
        "ln2": _ln(d),
    }
  return p


def init_lstm_params(cfg: LstmConfig, seed: int = 0) -> Params:
  """Seeded numpy weights of the LSTM classifier (gate order i, f, g, o as in PyTorch)."""
  rng = np.random.default_rng(seed)
  h = cfg.hidden
  s = 1.0 / math.sqrt(h)
  return {
      "embed": {"embedding": (0.1 * rng.standard_normal((cfg.vocab, cfg.embed))).astype(np.float32)},
      "lstm": {"wi": rng.uniform(-s, s, (cfg.embed, 4 * h)).astype(np.float32),
               "wh": rng.uniform(-s, s, (h, 4 * h)).astype(np.float32),
               "b": rng.uniform(-s, s, (4 * h,)).astype(np.float32)},
      "head": _dense(rng, h, cfg.classes),
  }


def flatten_params(params: Params, sep: str = "/") -> dict[str, np.ndarray]:
  """``{"a/b/c": array}`` view of a nested params dict (the cross-framework weight names)."""
  out: dict[str, np.ndarray] = {}

  def rec(prefix: str, node):
    if isinstance(node, dict) or hasattr(node, "items"):
      for k in sorted(node):
        rec(f"{prefix}{sep}{k}" if prefix else str(k), node[k])
    else:
      out[prefix] = np.asarray(node)

  rec("", params)
  return out


def to_device(params: Params) -> Params:
  """The params tree as device arrays (put once, outside any timed loop)."""
  return jax.tree.map(jnp.asarray, params)


# -- jax.numpy encoder ---------------------------------------------------------------------
def _layer_norm(x, p, eps):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _linear(x, p):
  return x @ p["kernel"] + p["bias"]


def attend(q, k, v, key_mask, impl: str = "einsum"):
  """Multi-head attention core ``[b, t, h, dh] x3 -> [b, t, h, dh]`` (see ``attention_impl``).

  ``impl="einsum"`` is the code of public Flax models; the others are for measuring
  (``benchmarks/probe_attention.py``).
  """
  dh = q.shape[-1]
  if impl == "einsum":
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    if key_mask is not None:
      # finfo.min, not -inf: exp underflows to exactly 0, so padded keys contribute nothing.
      scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
    w = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", w, v)
  if impl == "none":
    return v
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl: expected one of {ATTENTION_IMPLS}, got {impl!r}")
  base, _, lengths = impl.partition("_")
  if key_mask is None:
    return jax.nn.dot_product_attention(q, k, v, implementation=base)
  if lengths:
    kv_len = jnp.sum(key_mask, axis=-1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len,
                                        implementation=base)
  # cuDNN takes a mask as a bias of shape [B|1, N|1, T, S]: T and S in full.
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  mask = jnp.broadcast_to(key_mask[:, None, None, :], (b, 1, t, s))
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=base)


def _attention(x, p, heads, key_mask, impl="einsum"):
  b, t, d = x.shape
  dh = d // heads
  qkv = _linear(x, p["qkv"]).reshape(b, t, 3, heads, dh)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  out = attend(q, k, v, key_mask, impl).reshape(b, t, d)
  return _linear(out, p["out"])


def encoder_sequence(params: Params, tokens, lengths, *, cfg: EncoderConfig):
  """Hidden states ``[b, t, d]`` of the masked encoder (rows past a length are don't-care)."""
  t = tokens.shape[1]
  key_mask = None if lengths is None else jnp.arange(t)[None, :] < lengths[:, None]
  x = params["tok_embed"]["embedding"][tokens] + params["pos_embed"][:, :t]
  x = _layer_norm(x, params["emb_ln"], cfg.eps)
  for i in range(cfg.layers):
    p = params[f"layer_{i}"]
    a = _attention(x, p["attn"], cfg.heads, key_mask, cfg.attention_impl)
    x = _layer_norm(x + a, p["ln1"], cfg.eps)
    h = jax.nn.gelu(_linear(x, p["mlp_in"]), approximate=False)
    x = _layer_norm(x + _linear(h, p["mlp_out"]), p["ln2"], cfg.eps)
  return x


def encoder_apply(params: Params, tokens, lengths, *, cfg: EncoderConfig):
  """Masked-mean pooled encoder output ``[b, d]``: the padded region never matters.

  Args:
    params: from :func:`init_encoder_params`.
    tokens: int32 ``[b, t]``.
    lengths: int32 ``[b]``, each in ``[1, t]``.
    cfg: the sizes (bind with ``functools.partial``).
  """
  x = encoder_sequence(params, tokens, lengths, cfg=cfg)
  valid = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(x.dtype)
  return jnp.sum(x * valid[..., None], axis=1) / lengths[:, None].astype(x.dtype)


def encoder_apply_unmasked(params: Params, tokens, *, cfg: EncoderConfig):
  """The natural encoder: attends to and averages over all ``t`` positions (no lengths).

  Padding it naively changes its result; ``padding="auto"`` must make it exact.
  """
  x = encoder_sequence(params, tokens, None, cfg=cfg)
  return jnp.mean(x, axis=1)


def make_encoder(cfg: EncoderConfig, masked: bool = True):
  """A fresh ``fun(params, tokens, lengths)`` (or ``fun(params, tokens)``) for ``cfg``.

  Every call returns a new function object, so two benchmark modes never share JAX's caches.
  """
  if masked:
    def encoder(params, tokens, lengths):
      return encoder_apply(params, tokens, lengths, cfg=cfg)
  else:
    def encoder(params, tokens):
      return encoder_apply_unmasked(params, tokens, cfg=cfg)
  return encoder


# -- LSTM classifier -----------------------------------------------------------------------
def lstm_apply(params: Params, tokens, lengths):
  """Logits ``[b, classes]`` of an LSTM over ``tokens [b, t]`` with true ``lengths [b]``.

  ``lax.scan`` over time; past its length a sequence's carry is frozen, so the final carry is
  the state after its last real token whatever the padded length.
  """
  x = params["embed"]["embedding"][tokens]  # [b, t, e]
  p = params["lstm"]
  b = tokens.shape[0]
  hdim = p["wh"].shape[0]
  xs = jnp.swapaxes(x @ p["wi"] + p["b"], 0, 1)  # input projection for all steps at once
  steps = jnp.arange(tokens.shape[1])

  def step(carry, inp):
    h, c = carry
    gx, s = inp
    g = gx + h @ p["wh"]
    i, f, gg, o = jnp.split(g, 4, axis=-1)
    c2 = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(gg)
    h2 = jax.nn.sigmoid(o) * jnp.tanh(c2)
    live = (s < lengths)[:, None]
    return (jnp.where(live, h2, h), jnp.where(live, c2, c)), None

  zeros = jnp.zeros((b, hdim), xs.dtype)
  (h, _), _ = jax.lax.scan(step, (zeros, zeros), (xs, steps))
  return _linear(h, params["head"])


def make_lstm():
  """A fresh ``fun(params, tokens, lengths)`` (see :func:`make_encoder`)."""
  def lstm(params, tokens, lengths):
    return lstm_apply(params, tokens, lengths)
  return lstm


# -- Flax Linen ----------------------------------------------------------------------------
@functools.cache
def _linen_classes():
  import flax.linen as nn  # lazily: flax is an optional dependency

  class Attention(nn.Module):
    d_model: int
    heads: int
    impl: str = "einsum"

    @nn.compact
    def __call__(self, x, key_mask):
      b, t, d = x.shape
      dh = d // self.heads
      qkv = nn.Dense(3 * d, name="qkv")(x).reshape(b, t, 3, self.heads, dh)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
      if self.impl == "einsum":  # the idiom of public Flax code, written out
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        if key_mask is not None:
          scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
        w = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", w, v)
      else:
        out = attend(q, k, v, key_mask, self.impl)
      return nn.Dense(d, name="out")(out.reshape(b, t, d))

  class Layer(nn.Module):
    cfg: EncoderConfig

    @nn.compact
    def __call__(self, x, key_mask):
      cfg = self.cfg
      a = Attention(cfg.d_model, cfg.heads, cfg.attention_impl, name="attn")(x, key_mask)
      x = nn.LayerNorm(epsilon=cfg.eps, name="ln1")(x + a)
      h = jax.nn.gelu(nn.Dense(cfg.ffn, name="mlp_in")(x), approximate=False)
      return nn.LayerNorm(epsilon=cfg.eps, name="ln2")(x + nn.Dense(cfg.d_model, name="mlp_out")(h))

  class BertEncoder(nn.Module):
    """BERT-style encoder (post-LN, GELU) with a length mask; see the module docstring."""

    cfg: EncoderConfig

    def setup(self):
      cfg = self.cfg
      self.tok_embed = nn.Embed(cfg.vocab, cfg.d_model)
      self.pos_embed = self.param("pos_embed", nn.initializers.normal(0.02),
                                  (1, cfg.max_len, cfg.d_model))
      self.emb_ln = nn.LayerNorm(epsilon=cfg.eps)
      self.layers = [Layer(cfg, name=f"layer_{i}") for i in range(cfg.layers)]

    def sequence(self, tokens, lengths=None):
      """Hidden states ``[b, t, d]``."""
      t = tokens.shape[1]
      key_mask = None if lengths is None else jnp.arange(t)[None, :] < lengths[:, None]
      x = self.emb_ln(self.tok_embed(tokens) + self.pos_embed[:, :t])
      for layer in self.layers:
        x = layer(x, key_mask)
      return x

    def __call__(self, tokens, lengths):
      """Masked-mean pooled output ``[b, d]``."""
      x = self.sequence(tokens, lengths)
      valid = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(x.dtype)
      return jnp.sum(x * valid[..., None], axis=1) / lengths[:, None].astype(x.dtype)

  return BertEncoder


def BertEncoder(cfg: EncoderConfig):  # noqa: N802  (a constructor)
  """The Linen BERT-style encoder for ``cfg`` (flax imported on first use).

  ``module.apply({"params": init_encoder_params(cfg)}, tokens, lengths)`` gives ``[b, d]``;
  ``method="sequence"`` gives ``[b, t, d]``.
  """
  return _linen_classes()(cfg)


# -- PyTorch twins -------------------------------------------------------------------------
def torch_available() -> bool:
  """Whether ``import torch`` works here (it is never imported at module import)."""
  try:
    import torch  # noqa: F401
  except Exception:  # ImportError, or a broken CUDA install
    return False
  return True


def torch_bert(params: Params, cfg: EncoderConfig, device: str | None = None):
  """A PyTorch ``nn.Module`` computing :func:`encoder_apply` with the same numpy weights.

  ``module(tokens [b, t] int64/int32, lengths [b]) -> [b, d]``.  Weights keep the JAX layout
  (Dense kernels ``[in, out]``, applied as ``x @ W + b``).
  """
  import torch
  import torch.nn.functional as F  # noqa: N812

  flat = flatten_params(params)
  dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

  class TorchBert(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.w = torch.nn.ParameterDict({
          k.replace("/", "__"): torch.nn.Parameter(torch.from_numpy(np.array(v)),
                                                   requires_grad=False)
          for k, v in flat.items()})

    def _p(self, name):
      return self.w[name.replace("/", "__")]

    def _lin(self, x, name):
      return torch.addmm(self._p(name + "/bias"), x.reshape(-1, x.shape[-1]),
                         self._p(name + "/kernel")).reshape(*x.shape[:-1], -1)

    def _ln(self, x, name):
      return F.layer_norm(x, (x.shape[-1],), self._p(name + "/scale"), self._p(name + "/bias"),
                          cfg.eps)

    def forward(self, tokens, lengths):
      b, t = tokens.shape
      pos = torch.arange(t, device=tokens.device)
      valid = pos[None, :] < lengths[:, None]  # [b, t]
      x = self._p("tok_embed/embedding")[tokens.long()] + self._p("pos_embed")[:, :t]
      x = self._ln(x, "emb_ln")
      h, dh = cfg.heads, cfg.head_dim
      attn_mask = valid[:, None, None, :]
      for i in range(cfg.layers):
        pre = f"layer_{i}/"
        qkv = self._lin(x, pre + "attn/qkv").reshape(b, t, 3, h, dh)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        a = self._lin(a.transpose(1, 2).reshape(b, t, h * dh), pre + "attn/out")
        x = self._ln(x + a, pre + "ln1")
        m = self._lin(F.gelu(self._lin(x, pre + "mlp_in")), pre + "mlp_out")
        x = self._ln(x + m, pre + "ln2")
      vf = valid.to(x.dtype)[..., None]
      return (x * vf).sum(1) / lengths[:, None].to(x.dtype)

  return TorchBert().to(dev).eval()


def torch_lstm(params: Params, device: str | None = None):
  """A PyTorch ``nn.Module`` computing :func:`lstm_apply` with the same numpy weights.

  Uses ``torch.nn.LSTM`` (cuDNN on GPU) and gathers the output at ``length - 1``; the LSTM is
  causal, so outputs at true positions do not depend on the padding.
  """
  import torch

  dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
  emb = np.asarray(params["embed"]["embedding"])
  p = params["lstm"]
  wi, wh, bias = (np.asarray(p[k]) for k in ("wi", "wh", "b"))
  head_k, head_b = np.asarray(params["head"]["kernel"]), np.asarray(params["head"]["bias"])

  class TorchLstm(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb.copy()))
      self.lstm = torch.nn.LSTM(wi.shape[0], wh.shape[0], batch_first=True)
      with torch.no_grad():
        self.lstm.weight_ih_l0.copy_(torch.from_numpy(wi.T.copy()))
        self.lstm.weight_hh_l0.copy_(torch.from_numpy(wh.T.copy()))
        self.lstm.bias_ih_l0.copy_(torch.from_numpy(bias.copy()))
        self.lstm.bias_hh_l0.zero_()
      self.head_k = torch.nn.Parameter(torch.from_numpy(head_k.copy()), requires_grad=False)
      self.head_b = torch.nn.Parameter(torch.from_numpy(head_b.copy()), requires_grad=False)

    def forward(self, tokens, lengths):
      out, _ = self.lstm(self.embed(tokens.long()))
      idx = (lengths.long() - 1).clamp(min=0)
      h = out[torch.arange(out.shape[0], device=out.device), idx]
      return h @ self.head_k + self.head_b

  return TorchLstm().to(dev).eval()
