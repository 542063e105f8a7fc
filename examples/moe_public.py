"""A Mixture-of-Experts encoder written as public Flax/JAX code writes it, not with dynjax.route.

:class:`SparseMoEBlock` is Mixtral's sparse block as the JAX ports write it (MaxText-style): a
router, top-``k`` softmax gates, the (token, choice) pairs sorted by expert with ``argsort``,
the experts as two ``jax.lax.ragged_dot`` over the sorted rows with ``bincount`` group sizes,
scattered back into token order with ``.at[order].set`` and weighted by the gates.  Padded
tokens are routed like any other (no mask): the model knows nothing of dynjax.

:class:`MoEClassifier` wraps it in an encoder: embedding, a learned position table sliced by
the length, masked self-attention, the sparse block, masked-mean pooling.  Under
``dynjax.flax.jit(padding="auto")`` it runs on length buckets, exact against ``jax.jit`` at
each request's own shape (the padding pass's ``ragged_dot_general`` rule: until it existed
the whole model ran unpadded, one compile per shape).  ``dot=dynjax.route.ragged_dot`` runs
the same experts on dynjax's grouped-GEMM kernels (a one-name change in public code).
``benchmarks/bench_moe_public.py`` serves it every way.

Example:
  >>> model = MoEClassifier(vocab=512, d=64, heads=4, hidden=128, experts=8, k=2)
  >>> variables = model.init(jax.random.key(0), tokens, lengths)
  >>> f = dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"})
  >>> pooled = f(variables, tokens, lengths)          # [b, d]
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


class SparseMoEBlock(nn.Module):
  """``sum_j gate_j * w_out[e_j](silu(x @ w_in[e_j]))`` over each token's top-``k`` experts."""

  experts: int = 8
  k: int = 2
  hidden: int = 256
  dtype: jnp.dtype = jnp.float32
  dot: Callable = jax.lax.ragged_dot  # or dynjax.route.ragged_dot: the grouped-GEMM kernels

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    h = x.reshape(-1, d)
    logits = nn.Dense(self.experts, use_bias=False, dtype=jnp.float32, name="router")(h)
    weights, selected = jax.lax.top_k(logits, self.k)
    weights = jax.nn.softmax(weights, axis=-1).astype(self.dtype)
    flat = selected.reshape(-1)
    order = jnp.argsort(flat)
    rows = jnp.take(h, order // self.k, axis=0).astype(self.dtype)
    group_sizes = jnp.bincount(flat, length=self.experts)
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    w_in = self.param("w_in", init, (self.experts, d, self.hidden)).astype(self.dtype)
    w_out = self.param("w_out", init, (self.experts, self.hidden, d)).astype(self.dtype)
    y = self.dot(nn.silu(self.dot(rows, w_in, group_sizes)), w_out, group_sizes)
    y = jnp.zeros_like(y).at[order].set(y).reshape(b * t, self.k, d)
    return jnp.einsum("nkd,nk->nd", y, weights).reshape(b, t, d).astype(x.dtype)


class MoEClassifier(nn.Module):
  """Embedding + masked attention + :class:`SparseMoEBlock` + masked-mean pooling."""

  vocab: int = 512
  d: int = 64
  heads: int = 4
  hidden: int = 256
  experts: int = 8
  k: int = 2
  max_len: int = 512
  dtype: jnp.dtype = jnp.float32
  dot: Callable = jax.lax.ragged_dot

  @nn.compact
  def __call__(self, tokens, lengths):
    t = tokens.shape[1]
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d))
    x = nn.Embed(self.vocab, self.d, dtype=self.dtype)(tokens) + pos[:t].astype(self.dtype)
    y = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(
        y, y, mask=nn.make_attention_mask(valid, valid))
    x = x + SparseMoEBlock(self.experts, self.k, self.hidden, self.dtype, self.dot)(
        nn.LayerNorm(dtype=self.dtype)(x))
    m = valid[..., None].astype(jnp.float32)
    return jnp.sum(x.astype(jnp.float32) * m, 1) / jnp.maximum(lengths, 1)[:, None]
