"""Greedy decoding benchmark: a growing token buffer, a stop condition on device values.

Modes compared side by side in one run (prompts are standard-library docstrings as bytes):

* ``dynjax``: ``dynjax.while_loop`` -- iterations inside one compiled ``lax.while_loop`` per
  bucket of the sequence length, host syncs = buckets crossed + 1.
* ``jit_exact``: a Python loop of ``jax.jit`` steps on exact shapes (the natural JAX program:
  one compile per new length, one sync per token for the stop test).
* ``pad_max``: a Python loop of one ``jax.jit`` step over a max-size buffer (one compile, one
  sync per token, every step pays for the max length).
* ``while_max``: one ``lax.while_loop`` over the max-size buffer (one compile, one sync; every
  step pays for the max length).

The model is a one-layer causal transformer LM in ``jax.numpy`` over bytes (tiny by default);
weights are random and seeded, so generated text is noise but the work is real.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence

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


# -- the modes --------------------------------------------------------------------------------
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


def _padded_fns(params, max_len, max_new, heads):
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


def _pad_init(prompts, max_len):
  b, t = prompts.shape
  buf = np.zeros((b, max_len), np.int32)
  buf[:, :t] = prompts
  return (jnp.asarray(buf), jnp.int32(t), jnp.int32(0), jnp.zeros((b,), bool))


def decode_pad_max(params, prompts, max_len, max_new, heads=2):
  key = ("pad", id(params), max_len, max_new, heads)
  if key not in _CACHE:
    cond, body = _padded_fns(params, max_len, max_new, heads)
    _CACHE[key] = (jax.jit(cond), jax.jit(body, donate_argnums=0))
  cond, body = _CACHE[key]
  carry = _pad_init(prompts, max_len)
  syncs = 0
  while True:
    syncs += 1
    if not bool(cond(carry)):
      break
    carry = body(carry)
  buf, t = carry[0], int(carry[1])
  return (buf[:, :t], carry[2], carry[3]), syncs


def decode_while_max(params, prompts, max_len, max_new, heads=2):
  key = ("while", id(params), max_len, max_new, heads)
  if key not in _CACHE:
    cond, body = _padded_fns(params, max_len, max_new, heads)
    _CACHE[key] = jax.jit(lambda c: lax.while_loop(cond, body, c))
  carry = _CACHE[key](_pad_init(prompts, max_len))
  buf, t = carry[0], int(carry[1])  # the one sync
  return (buf[:, :t], carry[2], carry[3]), 1


def decode_dynjax(params, prompts, max_new, heads=2, buckets=None):
  from dynjax.control import loop_stats, while_loop

  key = ("dynjax", id(params), max_new, heads)
  if key not in _CACHE:
    _CACHE[key] = make_step(params, max_new, heads)
  cond, body = _CACHE[key]
  out = while_loop(cond, body, init_carry(prompts), buckets=buckets)
  return out, loop_stats()


# -- the benchmark ----------------------------------------------------------------------------
def _prompts(batch: int, n: int, max_prompt: int, seed: int) -> list[np.ndarray]:
  from dynjax.bench import data

  docs = [d for d in data.docstring_bytes(max_len=max_prompt) if len(d) >= 4]
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    rows = [docs[int(i)] for i in rng.integers(0, len(docs), size=batch)]
    t = min(len(r) for r in rows)  # one length per batch (rows cut to the shortest)
    arr = np.array([list(r[:t]) for r in rows], np.int32)
    arr[arr == STOP] = 1
    out.append(arr)
  return out


def _peak_bytes() -> int | None:
  try:
    st = jax.devices()[0].memory_stats()
  except Exception:
    return None
  if not st:
    return None
  return int(st.get("peak_bytes_in_use", st.get("bytes_in_use", 0)))


def run(flags: dict | None = None, out_dir: str | None = None) -> dict:
  """Runs the decode comparison; returns (and writes ``decode.json`` to ``out_dir``) a dict.

  Flags (all optional): ``quick`` (CPU setting, < 60 s), ``batches`` (list), ``new_tokens``,
  ``requests`` per batch size, ``max_prompt``, ``d``, ``seed``.

  Example:
    >>> res = run({"quick": True})  # doctest: +SKIP
    >>> res["rows"][0]["mode"]  # doctest: +SKIP
    'dynjax'
  """
  flags = dict(flags or {})
  quick = bool(flags.get("quick", jax.default_backend() == "cpu"))
  new_tokens = int(flags.get("new_tokens", 24 if quick else 256))
  batches = list(flags.get("batches", [1, 8]))
  requests = int(flags.get("requests", 2 if quick else 8))
  max_prompt = int(flags.get("max_prompt", 24 if quick else 256))
  d = int(flags.get("d", 32 if quick else 256))
  heads = int(flags.get("heads", 2 if quick else 4))
  modes = list(flags.get("modes", ["dynjax", "jit_exact", "pad_max", "while_max"]))
  cfg = LMConfig(d=d, heads=heads, ffn=2 * d)
  params = init_lm(cfg, seed=int(flags.get("seed", 0)))
  max_len = max_prompt + new_tokens
  # jit_exact compiles once per new length: it gets a time budget per batch size (cold pass),
  # the warm pass re-runs exactly the measured part, and its per-token figure is extrapolated
  # from that part (marked ``extrapolated``; "~" in the table).
  budget = flags.get("exact_budget_s", None if quick else 15.0)
  budget = None if budget is None else float(budget)
  progress = flags.get("progress")
  if progress:
    progress(" | ".join(_COLS))
  def decode(mode, pr, deadline=None, limit=None):
    """One request in one mode: ``(outputs, host syncs)``."""
    if mode == "dynjax":
      out, st = decode_dynjax(params, pr, new_tokens, heads)
      return out, st.get("host_syncs", 0)
    if mode == "jit_exact":
      return decode_jit_exact(params, pr, new_tokens, heads, deadline=deadline, limit=limit)
    if mode == "pad_max":
      return decode_pad_max(params, pr, max_len, new_tokens, heads)
    return decode_while_max(params, pr, max_len, new_tokens, heads)

  rows = []
  for batch in batches:
    prompts = _prompts(batch, requests, max_prompt, int(flags.get("seed", 0)))
    ref_out = None
    for mode in modes:
      times, toks, syncs, cold = [], 0, [], None
      outs, limits = [], []
      deadline = (time.perf_counter() + budget if mode == "jit_exact" and budget is not None
                  else None)
      cut = False
      for i, pr in enumerate(prompts):
        if deadline is not None and time.perf_counter() > deadline:
          cut = True
          break
        t0 = time.perf_counter()
        out, s = decode(mode, pr, deadline=deadline)
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        n_new = int(out[1])
        if deadline is not None and time.perf_counter() > deadline:
          done = bool(np.all(np.asarray(out[2]))) or n_new >= new_tokens
          cut = cut or not done
        if i == 0:
          cold = dt
        times.append(dt)
        toks += n_new
        limits.append(n_new)
        syncs.append(s)
        outs.append(np.asarray(out[0]))
      # Warm pass (compiles done): the timing we report.
      warm = []
      for pr, lim in zip(prompts, limits, strict=False):  # limits stops where a budget cut
        t0 = time.perf_counter()
        out, _ = decode(mode, pr, limit=lim)
        jax.block_until_ready(out)
        warm.append(time.perf_counter() - t0)
      if ref_out is None:
        ref_out = outs
      same = all(np.array_equal(a, b[:, :a.shape[1]]) if cut else np.array_equal(a, b)
                 for a, b in zip(outs, ref_out, strict=False))
      per_tok = sum(warm) / max(toks, 1)
      row = {
          "mode": mode, "batch": batch, "requests": len(prompts), "new_tokens": toks,
          "cold_first_s": round(cold or 0.0, 4), "cold_total_s": round(sum(times), 4),
          "warm_ms_per_token": round(1e3 * per_tok, 4),
          "host_syncs_per_request": float(np.mean(syncs)) if syncs else None,
          "matches_first_mode": same, "peak_bytes": _peak_bytes(),
      }
      if cut:
        row["extrapolated"] = True
        row["budget_s"] = budget
        row["cold_ms_per_token"] = round(1e3 * sum(times) / max(toks, 1), 4)
      rows.append(row)
      ref = next((r["warm_ms_per_token"] for r in rows
                  if r["batch"] == batch and r["mode"] == "dynjax"), None)
      row["ratio_vs_dynjax"] = round(row["warm_ms_per_token"] / ref, 3) if ref else None
      if progress:
        progress(_fmt_row(row))
  base = {(r["batch"], r["mode"]): r["warm_ms_per_token"] for r in rows}
  for r in rows:
    ref = base.get((r["batch"], "dynjax"))
    r["ratio_vs_dynjax"] = round(r["warm_ms_per_token"] / ref, 3) if ref else None
  res = {"workload": "decode", "backend": jax.default_backend(), "jax": jax.__version__,
         "quick": quick, "config": {"d": d, "heads": heads, "new_tokens": new_tokens,
                                    "max_prompt": max_prompt, "batches": batches,
                                    "requests": requests}, "rows": rows}
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode.json"), "w") as f:
      json.dump(res, f, indent=1)
  return res


_COLS = ["mode", "batch", "new_tokens", "warm_ms_per_token", "ratio_vs_dynjax",
         "host_syncs_per_request", "cold_total_s", "peak_bytes", "matches_first_mode"]


def _fmt_row(r: dict) -> str:
  cells = []
  for c in _COLS:
    v = r.get(c)
    if r.get("extrapolated") and c in ("warm_ms_per_token", "ratio_vs_dynjax", "new_tokens"):
      v = f"~{v}"  # measured on the part decoded within the time budget, per token
    cells.append(str(v))
  return " | ".join(cells)


def format_table(res: dict) -> str:
  lines = [" | ".join(_COLS)] + [_fmt_row(r) for r in res["rows"]]
  if any(r.get("extrapolated") for r in res["rows"]):
    lines.append("~ : jit_exact stopped at its time budget (exact_budget_s, per batch size); "
                 "per-token figures from the part it decoded (new_tokens = tokens decoded)")
  return "\n".join(lines)


def _main(argv: Sequence[str] | None = None) -> None:
  import sys

  argv = list(sys.argv[1:] if argv is None else argv)
  flags: dict = {"quick": "--full" not in argv,
                 "progress": lambda line: print(line, flush=True)}
  for a in argv:
    if a.startswith("--exact-budget="):
      flags["exact_budget_s"] = float(a.split("=", 1)[1])
  res = run(flags, out_dir=None)
  if any(r.get("extrapolated") for r in res["rows"]):
    print(format_table(res).splitlines()[-1], flush=True)


if __name__ == "__main__":
  _main()
