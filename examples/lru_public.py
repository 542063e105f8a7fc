"""A linear recurrent unit (LRU) classifier written as public Flax code writes it.

:class:`LRULayer` is the LRU of "Resurrecting Recurrent Neural Networks for Long Sequences"
(Orvieto et al., 2023) as its public JAX/Flax code writes it: a diagonal recurrence
``h_t = lambda * h_{t-1} + B x_t`` computed by ``jax.lax.associative_scan`` over time, written
for one sequence and lifted over the batch with ``nn.vmap`` (parameters shared), as S5 does.
Here the recurrence is real-valued (the paper's is complex; the scan is the same).
:class:`LRUClassifier` stacks them: embedding, ``layers`` x (LayerNorm, LRU, GELU MLP,
residual), masked-mean pooling over each row's true length, a linear head.

JAX's ``associative_scan`` refuses a symbolic length, so under ``dynjax.flax.jit(padding=
"auto")`` this model ran unpadded, one compile per request shape, until dynjax bound the scan
as a primitive (``dynjax/bucketing/_scan.py``); ``benchmarks/bench_lru_public.py`` serves and
trains it both ways.

Example:
  >>> model = LRUClassifier(vocab=512, d=64, hidden=64, layers=2)
  >>> variables = model.init(jax.random.key(0), tokens, lengths)
  >>> f = dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"})
  >>> logits = f(variables, tokens, lengths)          # [b, classes]
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def _nu_log_init(r_min: float, r_max: float):
  def init(key, shape):  # |lambda| uniform on the ring [r_min, r_max] (the paper's init)
    u = jax.random.uniform(key, shape)
    return jnp.log(-0.5 * jnp.log(u * (r_max**2 - r_min**2) + r_min**2))

  return init


def binary_operator_diag(q_i, q_j):
  """The LRU's scan operator: composes ``h -> a_i h + b_i`` then ``h -> a_j h + b_j``."""
  a_i, b_i = q_i
  a_j, b_j = q_j
  return a_j * a_i, a_j * b_i + b_j


class LRULayer(nn.Module):
  """One sequence ``[t, d] -> [t, d]``: ``y_t = C h_t + D * x_t``."""

  hidden: int
  r_min: float = 0.9
  r_max: float = 0.999

  @nn.compact
  def __call__(self, x):
    nu_log = self.param("nu_log", _nu_log_init(self.r_min, self.r_max), (self.hidden,))
    gamma_log = self.param("gamma_log", lambda k, s: 0.5 * jnp.log(
        1 - jnp.exp(-jnp.exp(nu_log)) ** 2), (self.hidden,))
    lam = jnp.exp(-jnp.exp(nu_log))
    bu = nn.Dense(self.hidden, use_bias=False, name="B")(x) * jnp.exp(gamma_log)
    lambda_elements = jnp.broadcast_to(lam, bu.shape)
    _, h = jax.lax.associative_scan(binary_operator_diag, (lambda_elements, bu))
    d = self.param("D", nn.initializers.normal(1.0), (x.shape[-1],))
    return nn.Dense(x.shape[-1], name="C")(h) + d * x


class LRUClassifier(nn.Module):
  vocab: int = 512
  d: int = 64
  hidden: int = 64
  layers: int = 2
  classes: int = 4
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens, lengths):
    x = nn.Embed(self.vocab, self.d, dtype=self.dtype)(tokens)
    batched = nn.vmap(LRULayer, in_axes=0, out_axes=0, variable_axes={"params": None},
                      split_rngs={"params": False})
    for i in range(self.layers):
      y = batched(self.hidden, name=f"lru_{i}")(nn.LayerNorm(dtype=self.dtype)(x))
      y = nn.Dense(self.d, dtype=self.dtype)(nn.gelu(nn.Dense(2 * self.d, dtype=self.dtype)(y)))
      x = x + y
    mask = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None])[..., None]
    pooled = jnp.sum(jnp.where(mask, x, 0), axis=1) / lengths[:, None].astype(x.dtype)
    return nn.Dense(self.classes, dtype=self.dtype)(pooled)
