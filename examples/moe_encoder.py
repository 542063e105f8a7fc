"""A one-layer MoE transformer encoder whose FFN layer is swappable: ``dynjax.route``
(profiled capacities per bucket, or exact-sync), dense, or ``lax.ragged_dot``.

Embedding, masked multi-head attention, the MoE FFN, masked-mean pooling
(:func:`moe_encoder_apply`; weights from :func:`init_moe_encoder`: numpy, seeded, no compile).
The FFN is a function ``moe_ffn(expert_params, h, logits, mask) -> y``:

* :func:`routed_moe_ffn`: ``route.Routed(mode="profiled")``, static capacities per bucket, no
  host sync; an overflow path when a request has more valid tokens than planned.
* :func:`dense_moe_ffn`: every expert on every token, weighted by the (masked) gates.
* :func:`ragged_moe_ffn`: sort by expert, two ``lax.ragged_dot`` calls, unsort.

:func:`make_e2e_variants` wraps each under
``dynjax.jit(dims={"tokens": "b, t"}, padding="trust")`` with the same length buckets (and the
exact-sync variant as jitted pieces), numpy in, numpy out; the benchmark is
``python -m benchmarks moe -- --settings e2e``.

Example:
  >>> cfg = dict(vocab=4096, d=64, heads=4, ffn=256, experts=8, max_len=512, batch=8,
  ...            min_bucket=16)
  >>> params = init_moe_encoder(cfg, seed=0)
  >>> fns = make_e2e_variants(params, cfg, k=2, policy=buckets.pow2(min=16))
  >>> pooled = fns["lax.ragged_dot"](tokens, lengths)  # [b, d]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import dynjax
from dynjax import buckets, route


def zipf_probs(n: int, s: float) -> np.ndarray:
  p = 1.0 / np.arange(1, n + 1) ** s
  return p / p.sum()


def init_moe_encoder(cfg: dict, seed: int = 0, dtype=jnp.float32) -> dict:
  """Seeded weights of :func:`moe_encoder_apply` (numpy init: no compile), cast to ``dtype``."""
  rng = np.random.default_rng(seed)
  d, f, e = cfg["d"], cfg["ffn"], cfg["experts"]

  def w(*shape, fan_in):
    return jnp.asarray(rng.standard_normal(shape, np.float32) / math.sqrt(fan_in), dtype)

  return {
      "embed": w(cfg["vocab"], d, fan_in=1), "pos": w(cfg["max_len"], d, fan_in=d),
      "wqkv": w(d, 3 * d, fan_in=d), "wo": w(d, d, fan_in=d), "wr": w(d, e, fan_in=d),
      # A Zipf(1.2) prior on the experts, so the routing is skewed as in the FFN settings.
      "router_bias": jnp.asarray(np.log(zipf_probs(e, cfg.get("zipf", 1.2))), jnp.float32),
      "experts": {"w1": w(e, d, f, fan_in=d), "w2": w(e, f, d, fan_in=f)},
  }


def _layer_norm(x):
  x32 = x.astype(jnp.float32)
  mu = jnp.mean(x32, -1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mu), -1, keepdims=True)
  return ((x32 - mu) * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype)


def encoder_front(params, tokens, lengths, heads: int):
  """Embedding + masked attention block: ``(x [b,t,d], h [b*t,d], logits [b*t,E], mask [b*t])``.

  bf16 matmuls with float32 accumulation (``preferred_element_type``) for scores and logits;
  softmax in float32.  Keys past a row's length are masked (every row has >= 1 valid key).
  """
  b, t = tokens.shape
  d = params["embed"].shape[1]
  dt = params["embed"].dtype
  x = params["embed"][tokens] + params["pos"][:t][None]
  mask = jnp.arange(t)[None, :] < lengths[:, None]
  h = _layer_norm(x)
  qkv = jnp.dot(h, params["wqkv"], preferred_element_type=jnp.float32).astype(dt)
  q, k, v = jnp.split(qkv.reshape(b, t, 3, heads, d // heads), 3, axis=2)
  q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
  s = jnp.einsum("bqhc,bkhc->bhqk", q, k, preferred_element_type=jnp.float32)
  s = s / math.sqrt(d // heads)
  s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
  a = jax.nn.softmax(s, axis=-1).astype(dt)
  o = jnp.einsum("bhqk,bkhc->bqhc", a, v, preferred_element_type=jnp.float32).astype(dt)
  x = x + jnp.dot(o.reshape(b, t, d), params["wo"], preferred_element_type=jnp.float32
                  ).astype(dt)
  h2 = _layer_norm(x).reshape(b * t, d)
  logits = jnp.dot(h2, params["wr"], preferred_element_type=jnp.float32) + params["router_bias"]
  return x, h2, logits, mask.reshape(b * t)


def encoder_back(x, y, mask, lengths):
  """Residual of the MoE output, then the masked mean over valid tokens: ``[b, d]`` float32."""
  b, t, d = x.shape
  x = x.astype(jnp.float32) + y.reshape(b, t, d).astype(jnp.float32)
  m = mask.reshape(b, t, 1).astype(jnp.float32)
  return jnp.sum(x * m, axis=1) / lengths[:, None].astype(jnp.float32)


def moe_encoder_apply(params, tokens, lengths, moe_ffn, heads: int, pool: bool = True):
  """The MoE encoder with the FFN layer ``moe_ffn(expert_params, h, logits, mask) -> y``.

  Returns ``[b, d]`` pooled (float32), or with ``pool=False`` the ``[b, t, d]`` hidden states.
  Padding tokens (``mask`` False) take no expert: their FFN output is 0 in every variant.
  """
  x, h, logits, mask = encoder_front(params, tokens, lengths, heads)
  y = moe_ffn(params["experts"], h, logits, mask)
  if not pool:
    b, t, d = x.shape
    return x.astype(jnp.float32) + y.reshape(b, t, d).astype(jnp.float32)
  return encoder_back(x, y, mask, lengths)


def dense_moe_ffn(router, expert):
  """Every expert on every token, weighted by the masked gates (E times the FLOPs)."""

  def fn(ep, h, logits, mask):
    paths, gates = router.select(logits, mask=mask)
    e = router.num_paths
    w = jnp.zeros((h.shape[0], e + 1), jnp.float32)
    w = w.at[jnp.arange(h.shape[0])[:, None], paths].add(gates)[:, :e]
    ys = jax.vmap(expert, in_axes=(0, None))(ep, h)  # [E, N, d]
    y = jnp.einsum("ne,end->nd", w, ys.astype(jnp.float32))
    return y.astype(h.dtype)

  return fn


def ragged_moe_ffn(router, activation=jax.nn.gelu):
  """Sort by expert (padding last), two ``lax.ragged_dot`` calls, unsort, weight by the gates.

  Under dynjax.jit's symbolic shape trace (a symbolic token count) it traces the dense form:
  that trace only fixes output shapes in ``padding="trust"``; executables trace at buckets.
  """
  dense = dense_moe_ffn(router, route.ffn(activation))

  def fn(ep, h, logits, mask):
    if not isinstance(h.shape[0], int):
      return dense(ep, h, logits, mask)
    n, k, e = h.shape[0], router.k, router.num_paths
    paths, gates = router.select(logits, mask=mask)
    flat = paths.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1, mode="drop")
    xs = jnp.take(h, order // k, axis=0)
    a = jax.lax.ragged_dot(xs, ep["w1"], sizes)
    a = activation(a).astype(h.dtype)
    ys = jax.lax.ragged_dot(a, ep["w2"], sizes)
    ys = jnp.where((flat[order] < e)[:, None], ys, 0)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
    y = y.astype(jnp.float32).reshape(n, k, -1) * gates[..., None]
    return y.sum(1).astype(h.dtype)

  return fn


def routed_moe_ffn(moe: route.Routed, fill: float = 1.0):
  """``moe`` (profiled) as the FFN: capacities planned for ``fill`` x the bucket's tokens.

  ``fill`` < 1 sizes the capacities for the valid tokens a bucket usually holds (padding takes
  no slot); a request with more valid tokens runs the overflow path (exact, slower).
  """

  def fn(ep, h, logits, mask):
    n = h.shape[0]
    if not isinstance(n, int) or fill >= 1.0:
      return moe(ep, h, logits, mask=mask)  # a symbolic n gets the dense stand-in (Routed)
    caps = moe.profiled_capacities(max(1, math.ceil(fill * n)))
    return moe.apply(ep, h, moe.route(logits, mask=mask), caps)

  return fn


def e2e_forward(params, tokens, lengths, moe_ffn, heads):
  return moe_encoder_apply(params, tokens, lengths, moe_ffn, heads)


def make_e2e_variants(params, cfg: dict, k: int, policy, quantile: float = 1.0,
                      calib=None, overflow_chunk: int = 64, fill: float | None = None) -> dict:
  """``name -> fn(tokens, lengths) -> np.ndarray [b, d]`` for every e2e variant.

  ``calib``: requests whose routing loads build the profile (and the fill of the buckets);
  ``fill``: overrides the calibrated fill (a small one forces the overflow path).
  """
  heads, e = cfg["heads"], cfg["experts"]
  router = route.Router(e, k=k)
  expert = route.ffn(jax.nn.gelu)
  experts = route.Experts(expert)
  t_policy = buckets.pow2(min=16, max=cfg["max_len"])
  moe = route.Routed(experts, router, mode="profiled", buckets=policy, quantile=quantile,
                     overflow_chunk=overflow_chunk, group_overhead=cfg["min_bucket"])
  calibrated = 1.0
  if calib:
    def routing_of(p, tok, lens):
      _, _, logits, mask = encoder_front(p, tok, lens, heads)
      return moe.route(logits, mask=mask)

    front = jax.jit(routing_of)
    fills = []
    for r in calib:
      t = t_policy.bucket(r.length)
      tok = np.zeros((r.tokens.shape[0], t), np.int32)
      tok[:, :r.length] = r.tokens
      routing = front(params, tok, r.lengths)
      valid = int(r.lengths.sum())
      moe.profile.record(np.asarray(routing.loads), valid)
      fills.append(valid / tok.size)
    calibrated = float(np.quantile(fills, 0.9))
  fill = calibrated if fill is None else fill

  def wrap(moe_ffn, name):
    fn = dynjax.jit(lambda params, tokens, lengths: e2e_forward(params, tokens, lengths,
                                                                moe_ffn, heads),
                    dims={"tokens": "b, t", "lengths": "b"},
                    buckets={"t": t_policy, "b": buckets.explicit([cfg["batch"]])},
                    padding="trust")
    fn.__name__ = name
    return lambda tok, lens: np.asarray(fn(params, tok, lens))

  variants = {
      "dynjax profiled (one executable per length bucket)":
          wrap(routed_moe_ffn(moe, fill), "moe_profiled"),
      "dense MoE (every expert on every token)":
          wrap(dense_moe_ffn(router, expert), "moe_dense"),
      "lax.ragged_dot": wrap(ragged_moe_ffn(router), "moe_ragged"),
  }

  sync = route.Routed(experts, router, mode="exact-sync", buckets=policy,
                      group_overhead=cfg["min_bucket"], record=False)
  front = jax.jit(lambda p, tok, lens: encoder_front(p, tok, lens, heads))
  back = jax.jit(encoder_back)

  def exact_sync(tok, lens):
    t = t_policy.bucket(tok.shape[1])
    padded = np.zeros((tok.shape[0], t), np.int32)
    padded[:, :tok.shape[1]] = tok
    x, h, logits, mask = front(params, padded, lens)
    y = sync(params["experts"], h, logits, mask=mask)
    return np.asarray(back(x, y, mask, lens))

  variants["dynjax exact-sync (jitted pieces, one sync)"] = exact_sync
  variants["_moe"] = moe  # for stats
  variants["_fill"] = fill
  return variants
