"""Models written as public JAX/Flax code writes them, for ``test_public_loops.py``.

* :class:`LM`: a Flax Linen decoder-only LM as the Flax examples write one (``nn.Embed`` for
  tokens and positions, ``nn.SelfAttention`` with ``nn.make_causal_mask``, pre-LN blocks),
  re-run on the whole prefix at every decode step.
* :class:`CachedLM`: the same kind of model with a KV cache per layer that grows by
  ``jnp.concatenate`` along the time axis (the carry holds a list of ``{"k", "v"}`` dicts).
* :func:`tree_lstm_node`: the child-sum Tree-LSTM of Tai et al. 2015 (eq. 2-8) as JAX ports
  write it: a Python list of children, ``sum`` over their ``h``, one forget gate per child.
* :func:`eval_expr`: a recursive neural evaluator over dict-based expression nodes of three
  types (number, binary op, call with a list of arguments of any arity).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

V, D, HEADS, MAXLEN, EOS, PAD = 32, 16, 2, 64, 1, 0


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    h = nn.SelfAttention(num_heads=HEADS, qkv_features=D, deterministic=True)(
        nn.LayerNorm()(x), mask=mask)
    x = x + h
    return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))


class LM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    t = tokens.shape[1]
    x = nn.Embed(V, D)(tokens) + nn.Embed(MAXLEN, D)(jnp.arange(t))[None]
    x = Block()(x, nn.make_causal_mask(tokens))
    return nn.Dense(V)(nn.LayerNorm()(x))


class CachedAttention(nn.Module):
  @nn.compact
  def __call__(self, x, cache, pos):
    dh = D // HEADS
    q = nn.DenseGeneral((HEADS, dh), name="query")(x)
    k = jnp.concatenate([cache["k"], nn.DenseGeneral((HEADS, dh), name="key")(x)], axis=1)
    v = jnp.concatenate([cache["v"], nn.DenseGeneral((HEADS, dh), name="value")(x)], axis=1)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    qpos = pos + jnp.arange(x.shape[1])
    mask = jnp.arange(k.shape[1])[None, :] <= qpos[:, None]
    w = jax.nn.softmax(jnp.where(mask[None, None], logits, -1e9), axis=-1)
    out = nn.DenseGeneral(D, axis=(-2, -1), name="out")(jnp.einsum("bhqk,bkhd->bqhd", w, v))
    return out, {"k": k, "v": v}


class CachedLM(nn.Module):
  layers: int = 2

  @nn.compact
  def __call__(self, tokens, caches, pos):
    x = nn.Embed(V, D)(tokens) + nn.Embed(MAXLEN, D)(pos + jnp.arange(tokens.shape[1]))[None]
    new = []
    for i in range(self.layers):
      h, c = CachedAttention(name=f"attn{i}")(nn.LayerNorm()(x), caches[i], pos)
      x = x + h
      x = x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
      new.append(c)
    return nn.Dense(V)(nn.LayerNorm()(x)), new


def empty_caches(batch: int, layers: int = 2) -> list:
  z = jnp.zeros((batch, 0, HEADS, D // HEADS))
  return [{"k": z, "v": z} for _ in range(layers)]


# -- child-sum Tree-LSTM ------------------------------------------------------------------------
def tree_lstm_params(vocab: int, d: int, seed: int = 0) -> dict:
  rs = np.random.RandomState(seed)

  def g(*s):
    return jnp.asarray(rs.randn(*s).astype(np.float32) * 0.3)

  return {"emb": g(vocab, d), "W": g(d, 4 * d), "U_iou": g(d, 3 * d), "U_f": g(d, d),
          "b": g(4 * d)}


def tree_lstm_node(params, x, child_h, child_c):
  """One node: ``x`` its input, ``child_h``/``child_c`` Python lists (empty at a leaf)."""
  d = x.shape[-1]
  h_sum = sum(child_h) if child_h else jnp.zeros(d)
  wx = x @ params["W"] + params["b"]
  i, o, u = jnp.split(wx[:3 * d] + h_sum @ params["U_iou"], 3)
  i, o, u = jax.nn.sigmoid(i), jax.nn.sigmoid(o), jnp.tanh(u)
  c = i * u
  for hk, ck in zip(child_h, child_c, strict=True):
    c = c + jax.nn.sigmoid(wx[3 * d:] + hk @ params["U_f"]) * ck
  return o * jnp.tanh(c), c


def embed(params, word):
  return params["emb"][word]


def make_tree_lstm(node_fn, embed_fn, recurse):
  """The recursion over ``word`` (a leaf) / ``(word, [children])`` trees; ``recurse()``
  returns the function to call on children (the decorated one, or the plain one)."""
  def encode(params, tree):
    if isinstance(tree, int):
      return node_fn(params, embed_fn(params, tree), [], [])
    word, kids = tree
    hs, cs = [], []
    for k in kids:
      h, c = recurse()(params, k)
      hs.append(h)
      cs.append(c)
    return node_fn(params, embed_fn(params, word), hs, cs)
  return encode


# -- an expression evaluator over dict nodes ------------------------------------------------
OPS = {"+": 0.0, "-": -1.0, "*": 1.0}


def expr_params(d: int = 4, seed: int = 0) -> dict:
  rs = np.random.RandomState(seed)
  return {"num": jnp.asarray(rs.randn(d).astype(np.float32)),
          "Wb": jnp.asarray(rs.randn(2 * d, d).astype(np.float32) * 0.5),
          "Wn": jnp.asarray(rs.randn(d, d).astype(np.float32) * 0.5)}


def f_num(p, value):
  return jnp.tanh(p["num"] * value)


def f_bin(p, op, a, b):
  return jnp.tanh(jnp.concatenate([a, b]) @ p["Wb"] + op)


def f_call(p, args):
  return jnp.tanh(jnp.stack(args).mean(0) @ p["Wn"])


def make_eval(num, binop, call, recurse):
  def ev(p, node):
    t = node["type"]
    if t == "num":
      return num(p, node["value"])
    if t == "bin":
      return binop(p, OPS[node["op"]], recurse()(p, node["lhs"]), recurse()(p, node["rhs"]))
    if t == "call":
      return call(p, [recurse()(p, a) for a in node["args"]])
    raise ValueError(f"unknown node type {t!r}")
  return ev


def num(v):
  return {"type": "num", "value": v}


def binop(op, lhs, rhs):
  return {"type": "bin", "op": op, "lhs": lhs, "rhs": rhs}


def call(*args):
  return {"type": "call", "args": list(args)}
