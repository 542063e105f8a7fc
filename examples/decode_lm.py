"""A byte-level transformer LM and greedy decoding: a growing token buffer, a stop condition on
device values.

The model is a one-layer causal transformer LM in ``jax.numpy`` over bytes; weights are random
and seeded, so generated text is noise but the work is real.  Greedy decoding is written every
way the decode benchmark (``python -m benchmarks decode``) compares:

* :func:`decode_dynjax`: ``dynjax.while_loop`` over :func:`make_step`'s ``(cond, body)``, the
  carry ``(tokens, step, done)`` growing by one token per step (one compiled loop per bucket).
* :func:`decode_jit_exact`: a Python loop of ``jax.jit`` steps on exact shapes (a compile per
  new length, a sync per token for the stop test).
* :func:`decode_pad_max` / :func:`decode_while_max`: one ``jax.jit`` step, or one
  ``lax.while_loop``, over a max-size buffer (:func:`make_padded_step`).
* :func:`make_encode_generate`: an encoder (:func:`encode`) over the prompt, then the decode
  loop with the pooled context in the carry -- one function for ``dynjax.jit``.
* :func:`make_nested`: an outer loop over sentences whose body decodes one sentence with an
  inner shape-changing loop; :func:`decode_nested_python` is its plain-Python reference.

Example:
  >>> params = init_lm(LMConfig(), seed=0)
  >>> cond, body = make_step(params, max_new=16)
  >>> tokens, steps, done = dynjax.control.while_loop(cond, body, init_carry(prompts))
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

VOCAB = 256
STOP = 0  # the stop byte


@dataclasses.dataclass(frozen=True)
class LMConfig:
  d: int = 32
  heads: int = 2
  ffn: int = 64


def init_lm(cfg: LMConfig = LMConfig(), seed: int = 0) -> dict:
  k = jax.random.split(jax.random.PRNGKey(seed), 6)
  s = 1.0 / np.sqrt(cfg.d)
  return {
      "emb": jax.random.normal(k[0], (VOCAB, cfg.d)) * 0.5,
      "wqkv": jax.random.normal(k[1], (cfg.d, 3 * cfg.d)) * s,
      "wo": jax.random.normal(k[2], (cfg.d, cfg.d)) * s,
      "w1": jax.random.normal(k[3], (cfg.d, cfg.ffn)) * s,
      "w2": jax.random.normal(k[4], (cfg.ffn, cfg.d)) * (1.0 / np.sqrt(cfg.ffn)),
      "out": jax.random.normal(k[5], (cfg.d, VOCAB)) * s,
  }


def _norm(x):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) * lax.rsqrt(v + 1e-5)


def lm_logits(params: dict, tokens: jax.Array, heads: int = 2) -> jax.Array:
  """Next-token logits ``(b, V)`` after ``tokens (b, t)`` (causal, sinusoidal positions)."""
  b, t = tokens.shape
  d = params["emb"].shape[1]
  pos = jnp.arange(t, dtype=jnp.float32)[:, None]
  freq = jnp.exp(-jnp.arange(0, d, 2, dtype=jnp.float32) * (np.log(1e4) / d))[None, :]
  pe = jnp.concatenate([jnp.sin(pos * freq), jnp.cos(pos * freq)], axis=-1)
  x = params["emb"][tokens] + pe[None]
  h = _norm(x)
  qkv = h @ params["wqkv"]
  q, k, v = jnp.split(qkv, 3, axis=-1)
  dh = d // heads
  q = q.reshape(b, t, heads, dh)
  k = k.reshape(b, t, heads, dh)
  v = v.reshape(b, t, heads, dh)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  s = jnp.where(causal[None, None], s, -1e9)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d)
  x = x + o @ params["wo"]
  x = x + jax.nn.gelu(_norm(x) @ params["w1"]) @ params["w2"]
  return _norm(x[:, -1]) @ params["out"]


def make_step(params: dict, max_new: int, heads: int = 2, stop: int = STOP):
  """``(cond, body)`` of greedy decoding over the carry ``(tokens, step, done)``."""

  def body(carry):
    tokens, step, done = carry
    nxt = jnp.argmax(lm_logits(params, tokens, heads), axis=-1).astype(tokens.dtype)
    nxt = jnp.where(done, stop, nxt)
    return (jnp.concatenate([tokens, nxt[:, None]], axis=1), step + 1, done | (nxt == stop))

  def cond(carry):
    _, step, done = carry
    return (step < max_new) & ~jnp.all(done)

  return cond, body


def init_carry(prompts: np.ndarray):
  b = prompts.shape[0]
  return (jnp.asarray(prompts, jnp.int32), jnp.int32(0), jnp.zeros((b,), bool))


_CACHE: dict = {}  # compiled step functions per (mode, params, sizes)


# -- greedy decoding, four ways -------------------------------------------------------------
def decode_jit_exact(params, prompts, max_new, heads=2, deadline=None, limit=None):
  """Python loop of jax.jit steps on exact shapes (returns carry, host syncs).

  ``deadline`` (a ``time.perf_counter()`` value) / ``limit`` (steps) stop the loop early (the
  benchmark's time budget: this mode compiles once per new length); ``carry[1]`` says how many
  tokens were decoded.
  """
  key = ("exact", id(params), max_new, heads)
  if key not in _CACHE:
    cond, body = make_step(params, max_new, heads)
    _CACHE[key] = (jax.jit(cond), jax.jit(body))
  cond, body = _CACHE[key]
  carry = init_carry(prompts)
  syncs = steps = 0
  while True:
    syncs += 1
    if not bool(cond(carry)):
      break
    if (limit is not None and steps >= limit) or (
        deadline is not None and time.perf_counter() > deadline):
      break
    carry = body(carry)
    steps += 1
  return carry, syncs


def make_padded_step(params, max_len, max_new, heads):
  def logits_at(tokens, t):
    # Causal attention: positions < t never read positions >= t, so the logits at t-1 of the
    # max-size buffer equal those of the exact buffer.
    b = tokens.shape[0]
    d = params["emb"].shape[1]
    tt = tokens.shape[1]
    pos = jnp.arange(tt, dtype=jnp.float32)[:, None]
    freq = jnp.exp(-jnp.arange(0, d, 2, dtype=jnp.float32) * (np.log(1e4) / d))[None, :]
    pe = jnp.concatenate([jnp.sin(pos * freq), jnp.cos(pos * freq)], axis=-1)
    x = params["emb"][tokens] + pe[None]
    h = _norm(x)
    q, k, v = jnp.split(h @ params["wqkv"], 3, axis=-1)
    dh = d // heads
    q, k, v = (a.reshape(b, tt, heads, dh) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    causal = jnp.arange(tt)[:, None] >= jnp.arange(tt)[None, :]
    s = jnp.where(causal[None, None], s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, tt, d)
    x = x + o @ params["wo"]
    x = x + jax.nn.gelu(_norm(x) @ params["w1"]) @ params["w2"]
    last = lax.dynamic_index_in_dim(x, t - 1, axis=1, keepdims=False)
    return _norm(last) @ params["out"]

  def body(carry):
    buf, t, step, done = carry
    nxt = jnp.argmax(logits_at(buf, t), -1).astype(buf.dtype)
    nxt = jnp.where(done, STOP, nxt)
    buf = lax.dynamic_update_slice_in_dim(buf, nxt[:, None], t, axis=1)
    return buf, t + 1, step + 1, done | (nxt == STOP)

  def cond(carry):
    _, _, step, done = carry
    return (step < max_new) & ~jnp.all(done)

  return cond, body


def init_padded_carry(prompts, max_len):
  b, t = prompts.shape
  buf = np.zeros((b, max_len), np.int32)
  buf[:, :t] = prompts
  return (jnp.asarray(buf), jnp.int32(t), jnp.int32(0), jnp.zeros((b,), bool))


def python_loop(cond, body, carry):
  """``(final carry, host syncs)`` of a Python loop of jitted steps: one sync a cond."""
  syncs = 0
  while True:
    syncs += 1
    if not bool(cond(carry)):
      return carry, syncs
    carry = body(carry)


def decode_pad_max(params, prompts, max_len, max_new, heads=2):
  key = ("pad", id(params), max_len, max_new, heads)
  if key not in _CACHE:
    cond, body = make_padded_step(params, max_len, max_new, heads)
    _CACHE[key] = (jax.jit(cond), jax.jit(body, donate_argnums=0))
  cond, body = _CACHE[key]
  carry, syncs = python_loop(cond, body, init_padded_carry(prompts, max_len))
  buf, t = carry[0], int(carry[1])
  return (buf[:, :t], carry[2], carry[3]), syncs


def decode_while_max(params, prompts, max_len, max_new, heads=2):
  key = ("while", id(params), max_len, max_new, heads)
  if key not in _CACHE:
    cond, body = make_padded_step(params, max_len, max_new, heads)
    _CACHE[key] = jax.jit(lambda c: lax.while_loop(cond, body, c))
  carry = _CACHE[key](init_padded_carry(prompts, max_len))
  buf, t = carry[0], int(carry[1])  # the one sync
  return (buf[:, :t], carry[2], carry[3]), 1


def decode_dynjax(params, prompts, max_new, heads=2, buckets=None, unroll=None,
                  bucket_from="auto"):
  from dynjax.control import loop_stats, while_loop

  key = ("dynjax", id(params), max_new, heads)
  if key not in _CACHE:
    _CACHE[key] = make_step(params, max_new, heads)
  cond, body = _CACHE[key]
  out = while_loop(cond, body, init_carry(prompts), buckets=buckets, unroll=unroll,
                   bucket_from=bucket_from)
  return out, loop_stats()



# -- greedy decoding with a KV cache (the cache one position behind the tokens) --------------
def _sinusoid(pos: jax.Array, d: int) -> jax.Array:
  """Positional encodings ``(n, d)`` of the float positions ``pos (n,)`` (as ``lm_logits``)."""
  freq = jnp.exp(-jnp.arange(0, d, 2, dtype=jnp.float32) * (np.log(1e4) / d))[None, :]
  return jnp.concatenate([jnp.sin(pos[:, None] * freq), jnp.cos(pos[:, None] * freq)], axis=-1)


def _kv(params: dict, tokens: jax.Array, pos: jax.Array, heads: int):
  """Input, query, key and value of ``tokens (b, n)`` at positions ``pos (n,)``."""
  b, n = tokens.shape
  d = params["emb"].shape[1]
  x = params["emb"][tokens] + _sinusoid(pos, d)[None]
  q, k, v = jnp.split(_norm(x) @ params["wqkv"], 3, axis=-1)
  return x, *(a.reshape(b, n, heads, d // heads) for a in (q, k, v))


def prefill(params: dict, prompts, heads: int = 2):
  """The carry ``(tokens, k_cache, v_cache, step, done)`` of :func:`make_kv_step`: keys and
  values of every prompt position but the last (the body adds the last token's)."""
  tokens = jnp.asarray(prompts, jnp.int32)
  b, t = tokens.shape
  _, _, k, v = _kv(params, tokens[:, :-1], jnp.arange(t - 1, dtype=jnp.float32), heads)
  return tokens, k, v, jnp.int32(0), jnp.zeros((b,), bool)


def make_kv_step(params: dict, max_new: int, heads: int = 2, stop: int = STOP):
  """``(cond, body)`` of greedy decoding with a KV cache, as public decoders write it: the
  caches ``(b, t - 1, heads, dh)`` grow by concatenation beside the tokens ``(b, t)``.  The
  logits equal :func:`lm_logits` of the whole prefix (causal attention) up to rounding."""

  def body(carry):
    tokens, kc, vc, step, done = carry
    b = tokens.shape[0]
    d = params["emb"].shape[1]
    dh = d // heads
    pos = (jnp.asarray(tokens.shape[1]) - 1).astype(jnp.float32)[None]
    x, q, k, v = _kv(params, tokens[:, -1:], pos, heads)
    kc = jnp.concatenate([kc, k], axis=1)
    vc = jnp.concatenate([vc, v], axis=1)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kc) / np.sqrt(dh)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vc).reshape(b, 1, d)
    x = x + o @ params["wo"]
    x = x + jax.nn.gelu(_norm(x) @ params["w1"]) @ params["w2"]
    logits = _norm(x[:, 0]) @ params["out"]
    nxt = jnp.where(done, stop, jnp.argmax(logits, axis=-1).astype(tokens.dtype))
    return (jnp.concatenate([tokens, nxt[:, None]], axis=1), kc, vc, step + 1,
            done | (nxt == stop))

  def cond(carry):
    _, _, _, step, done = carry
    return (step < max_new) & ~jnp.all(done)

  return cond, body


def decode_kv_jit_exact(params, prompts, max_new, heads=2):
  """Python loop of ``jax.jit`` KV-cache steps on exact shapes (returns carry, host syncs)."""
  key = ("kv_exact", id(params), max_new, heads)
  if key not in _CACHE:
    cond, body = make_kv_step(params, max_new, heads)
    _CACHE[key] = (jax.jit(cond), jax.jit(body), jax.jit(prefill, static_argnums=2))
  cond, body, pre = _CACHE[key]
  return python_loop(cond, body, pre(params, prompts, heads))


def decode_kv_dynjax(params, prompts, max_new, heads=2, buckets=None, unroll=None,
                     bucket_from="auto"):
  """``dynjax.while_loop`` over :func:`make_kv_step` after :func:`prefill` under
  ``dynjax.jit`` (one executable per prompt-length bucket)."""
  import dynjax
  from dynjax.control import loop_stats, while_loop

  key = ("kv_dynjax", id(params), max_new, heads)
  if key not in _CACHE:
    pre = dynjax.jit(lambda prompts: prefill(params, prompts, heads), dims={"prompts": "b, t"})
    _CACHE[key] = (*make_kv_step(params, max_new, heads), pre)
  cond, body, pre = _CACHE[key]
  out = while_loop(cond, body, pre(prompts), buckets=buckets, unroll=unroll,
                   bucket_from=bucket_from)
  return out, loop_stats()


# -- an encoder before the decode loop (the compiled-program rows) ----------------------------
def init_encoder(cfg: LMConfig, layers: int, seed: int = 1) -> list[dict]:
  k = jax.random.split(jax.random.PRNGKey(seed), 4 * layers + 1)
  s, sf = 1.0 / np.sqrt(cfg.d), 1.0 / np.sqrt(cfg.ffn)
  out = []
  for i in range(layers):
    out.append({"wqkv": jax.random.normal(k[4 * i], (cfg.d, 3 * cfg.d)) * s,
                "wo": jax.random.normal(k[4 * i + 1], (cfg.d, cfg.d)) * s,
                "w1": jax.random.normal(k[4 * i + 2], (cfg.d, cfg.ffn)) * s,
                "w2": jax.random.normal(k[4 * i + 3], (cfg.ffn, cfg.d)) * sf})
  return out


def encode(params: dict, enc: list[dict], tokens: jax.Array, heads: int) -> jax.Array:
  """Bidirectional transformer encoder over ``tokens [b, t]``: ``[b, t, d]``."""
  b, t = tokens.shape
  d = params["emb"].shape[1]
  dh = d // heads
  x = params["emb"][tokens]
  for layer in enc:
    q, k, v = jnp.split(_norm(x) @ layer["wqkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, dh) for a in (q, k, v))
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d) @ layer["wo"]
    x = x + jax.nn.gelu(_norm(x) @ layer["w1"]) @ layer["w2"]
  return x


def make_ctx_step(params: dict, max_new: int, heads: int = 2, stop: int = STOP):
  """``(cond, body)`` over ``(tokens, step, done, ctx)``: the LM's logits plus ``ctx @ out``."""

  def body(carry):
    tokens, step, done, ctx = carry
    logits = lm_logits(params, tokens, heads) + _norm(ctx) @ params["out"]
    nxt = jnp.where(done, stop, jnp.argmax(logits, axis=-1).astype(tokens.dtype))
    return (jnp.concatenate([tokens, nxt[:, None]], axis=1), step + 1, done | (nxt == stop),
            ctx)

  def cond(carry):
    _, step, done, _ = carry
    return (step < max_new) & ~jnp.all(done)

  return cond, body


def make_encode_generate(params: dict, enc: list[dict], max_new: int, heads: int):
  """``encode_generate(prompt) -> (new tokens [b, n], steps)``: encoder, then decode."""
  from dynjax.control import while_loop

  cond, body = make_ctx_step(params, max_new, heads)

  def encode_generate(prompt):
    mem = encode(params, enc, prompt, heads)
    ctx = mem.mean(axis=1)
    b = prompt.shape[0]
    out = while_loop(cond, body, (prompt, jnp.int32(0), jnp.zeros((b,), bool), ctx))
    return out[0][:, prompt.shape[1]:], out[1]

  return encode_generate


# -- nested loops: sentences of a decode, each an inner shape-changing loop --------------------
SEP = 1  # separator token appended after each sentence


def make_nested(params: dict, per_sentence: int, sentences: int, heads: int):
  """``(cond, body)`` of the outer loop over ``(tokens, k)``; the body runs an inner decode
  loop of ``per_sentence`` tokens (or to the stop byte), then appends ``SEP``."""
  from dynjax.control import while_loop

  icond, ibody = make_step(params, per_sentence, heads)

  def body(carry):
    tokens, k = carry
    b = tokens.shape[0]
    inner = while_loop(icond, ibody, (tokens, jnp.int32(0), jnp.zeros((b,), bool)))
    sep = jnp.full((b, 1), SEP, tokens.dtype)
    return jnp.concatenate([inner[0], sep], axis=1), k + 1

  def cond(carry):
    return carry[1] < sentences

  return cond, body


def decode_nested_python(params, prompts, per_sentence, sentences, heads, max_len):
  """The reference: Python loops of one ``jax.jit`` step over a max-size buffer (as
  ``pad_max``: one compile, one sync per token; exact by causality)."""
  key = ("nested_ref", id(params), per_sentence, heads, max_len)
  if key not in _CACHE:
    cond, body = make_padded_step(params, max_len, per_sentence, heads)

    def sep(buf, t):
      col = jnp.full((buf.shape[0], 1), SEP, buf.dtype)
      return lax.dynamic_update_slice_in_dim(buf, col, t, axis=1), t + 1

    _CACHE[key] = (jax.jit(cond), jax.jit(body), jax.jit(sep))
  cond, body, sep = _CACHE[key]
  buf, t, _, _ = init_padded_carry(prompts, max_len)
  for _ in range(sentences):
    carry = (buf, t, jnp.int32(0), jnp.zeros((buf.shape[0],), bool))
    while bool(cond(carry)):
      carry = body(carry)
    buf, t = sep(carry[0], carry[1])
  return buf[:, :int(t)]


# -- inspecting a compiled loop -------------------------------------------------------------
def while_body_ops(hlo_text: str) -> dict:
  """Top-level instructions of the (first) while body of an optimized HLO module, by opcode
  (parameters, tuples, constants and bitcasts left out): the kernels one iteration launches."""
  import re

  m = re.search(r"while\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)", hlo_text)
  if m is None:
    return {}
  out: dict[str, int] = {}
  on = False
  for line in hlo_text.splitlines():
    if not on:
      on = bool(re.match(rf"^%?{re.escape(m.group(2))} ", line))
      continue
    if line.startswith("}"):
      break
    op = re.search(r"= \S+ ([\w\-]+)\(", line)
    if op and op.group(1) not in ("parameter", "get-tuple-element", "tuple", "constant",
                                  "bitcast"):
      out[op.group(1)] = out.get(op.group(1), 0) + 1
  out["total"] = sum(out.values())
  return out
