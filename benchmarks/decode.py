"""Greedy decoding benchmark: a growing token buffer, a stop condition on device values.

Modes compared side by side in one run (prompts are standard-library docstrings as bytes):

* ``dynjax``: ``dynjax.while_loop`` with its defaults -- iterations inside one compiled
  ``lax.while_loop`` per bucket of the sequence length.  Defaults: ``bucket_from="auto"`` (the
  bucket of the length bound ``step < max_new`` implies on GPU/TPU, the prompt's bucket on CPU)
  and ``unroll=None`` (4 guarded steps per XLA loop trip on GPU/TPU, 1 on CPU).
* ``dynjax_init_u1`` / ``dynjax_cap_u1`` / ``dynjax_init_u4``: the same loop with one choice of
  (start bucket, unroll) each, to show what each costs on the device that runs the benchmark.
* ``jit_exact``: a Python loop of ``jax.jit`` steps on exact shapes (the natural JAX program:
  one compile per new length, one sync per token for the stop test).
* ``pad_max``: a Python loop of one ``jax.jit`` step over a max-size buffer (one compile, one
  sync per token, every step pays for the max length).
* ``while_max``: one ``lax.while_loop`` over the max-size buffer (one compile, one sync; every
  step pays for the max length).

Two more sections (``program`` and ``nested`` rows, ``--full`` and ``--quick``):

* ``program_compiled`` vs ``program_op_by_op``: ``encode_generate`` -- an encoder of
  ``enc_layers`` transformer layers over the prompt ``[b, t, d]``, then the decode loop with
  the encoder's pooled context in the carry -- under ``dynjax.jit`` (straight-line code compiled
  per bucket, one VM program) vs the op-by-op host program (``run_in_program``).  Compiles are
  counted with ``jax.monitoring``.
* ``nested_dynjax`` vs ``nested_python``: an outer ``dynjax.while_loop`` over ``segments``
  sentences whose body decodes one sentence with an inner shape-changing ``dynjax.while_loop``
  (host-mode outer loop, hoisted inner loop) vs plain Python loops of exact-shape ``jax.jit``
  steps.

``hlo_body_ops``: top-level instructions of the XLA while body (fusions, copies, custom calls)
of dynjax's hoisted executable vs ``while_max``, per-iteration kernel counts on the device that
runs the benchmark (what a launch-bound batch-1 step costs).

The model and the decoders are :mod:`examples.decode_lm` (a one-layer causal transformer LM in
``jax.numpy`` over bytes, tiny by default; weights are random and seeded, so generated text is
noise but the work is real).  This module holds the runner: modes, timing, table, JSON.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from examples.decode_lm import (
    STOP,
    LMConfig,
    decode_dynjax,
    decode_jit_exact,
    decode_nested_python,
    decode_pad_max,
    decode_while_max,
    init_carry,
    init_encoder,
    init_lm,
    init_padded_carry,
    make_encode_generate,
    make_nested,
    make_padded_step,
    make_step,
    while_body_ops,
)

# dynjax variants: mode -> while_loop options
VARIANTS = {"dynjax": {}, "dynjax_init_u1": {"unroll": 1, "bucket_from": "init"},
            "dynjax_cap_u1": {"unroll": 1, "bucket_from": "cap"},
            "dynjax_init_u4": {"unroll": 4, "bucket_from": "init"}}


# -- the benchmark ----------------------------------------------------------------------------
def _prompts(batch: int, n: int, max_prompt: int, seed: int) -> list[np.ndarray]:
  from examples import data

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


NOTES = {
    "dynjax*": "one compiled lax.while_loop per length bucket; host syncs = buckets visited "
               "(+1 to read the counter with the cap); compiles = buckets x unroll bodies; "
               "each step computes the whole bucket (no KV cache in this LM)",
    "dynjax_*_u4": "4 guarded steps per XLA loop trip: one predicate round trip per 4 tokens "
                   "on GPU, up to 3 wasted steps per bucket visit, ~2x compile time",
    "dynjax_cap_*": "starts in the bucket of prompt + max_new (read from `step < max_new`): "
                    "no bucket crossing, every step pays for that bucket",
    "jit_exact": "Python loop of jax.jit on exact shapes: a compile per new length, a sync per "
                 "token",
    "pad_max": "Python loop of one jit step over the max-length buffer: a sync per token, "
               "every step pays for max_len",
    "while_max": "one lax.while_loop over the max-length buffer with a done flag: one sync, "
                 "every step pays for max_len",
    "program_compiled": "dynjax.jit of encoder + decode loop: segments compiled per bucket, the "
                        "loop as a call in one VM program",
    "program_op_by_op": "the same function run eagerly (run_in_program): every encoder op "
                        "dispatched alone, compiled per (op, shape)",
    "nested_dynjax": "outer loop in host mode (a sync per sentence + the inner loop's syncs, "
                     "two staged sub-programs and a repad per sentence)",
    "nested_python": "Python loops of one padded jit step (a sync per token)",
}

_COMPILES = [0]
_LISTENING = [False]


def _count_compiles() -> None:
  if not _LISTENING[0]:
    _LISTENING[0] = True
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, dur, **kw: _COMPILES.__setitem__(0, _COMPILES[0] + 1)
        if ev == "/jax/core/compile/backend_compile_duration" else None)


def run(flags: dict | None = None, out_dir: str | None = None) -> dict:
  """Runs the decode comparison; returns (and writes ``decode.json`` to ``out_dir``) a dict.

  Flags (all optional): ``quick`` (CPU setting, ~1-2 min on 2 cores), ``batches`` (list),
  ``new_tokens``, ``requests`` per batch size, ``max_prompt``, ``d``, ``seed``, ``modes``,
  ``warm_passes`` (per request the best warm time counts), ``exact_budget_s`` (jit_exact),
  ``sections`` (``decode``, ``program``, ``nested``, ``hlo``), ``enc_layers``,
  ``program_requests``, ``nested_requests``, ``sentences``, ``per_sentence``.

  Example:
    >>> res = run({"quick": True})  # doctest: +SKIP
    >>> res["rows"][0]["mode"]  # doctest: +SKIP
    'dynjax'
  """
  _count_compiles()
  flags = dict(flags or {})
  quick = bool(flags.get("quick", jax.default_backend() == "cpu"))
  new_tokens = int(flags.get("new_tokens", 24 if quick else 256))
  batches = list(flags.get("batches", [1, 8]))
  requests = int(flags.get("requests", 2 if quick else 8))
  max_prompt = int(flags.get("max_prompt", 24 if quick else 256))
  d = int(flags.get("d", 32 if quick else 256))
  heads = int(flags.get("heads", 2 if quick else 4))
  modes = list(flags.get("modes", [*VARIANTS, "jit_exact", "pad_max", "while_max"]))
  sections = list(flags.get("sections", ["decode", "program", "nested", "hlo"]))
  warm_passes = int(flags.get("warm_passes", 3 if quick else 2))
  seed = int(flags.get("seed", 0))
  cfg = LMConfig(d=d, heads=heads, ffn=2 * d)
  params = init_lm(cfg, seed=seed)
  max_len = max_prompt + new_tokens
  # jit_exact compiles once per new length: it gets a time budget per batch size (cold pass),
  # the warm pass re-runs exactly the measured part, and its per-token figure is extrapolated
  # from that part (marked ``extrapolated``; "~" in the table).
  budget = flags.get("exact_budget_s", None if quick else 15.0)
  budget = None if budget is None else float(budget)
  progress = flags.get("progress", lambda line: print(line, flush=True))
  res = {"workload": "decode", "backend": jax.default_backend(), "jax": jax.__version__,
         "device": str(jax.devices()[0].device_kind), "quick": quick,
         "config": {"d": d, "heads": heads, "new_tokens": new_tokens, "max_prompt": max_prompt,
                    "batches": batches, "requests": requests, "warm_passes": warm_passes},
         "rows": [], "program_rows": [], "nested_rows": [], "hlo_body_ops": None,
         "defaults": _loop_defaults(), "notes": NOTES}
  def save():  # after every section: a run cut short still leaves its finished sections
    if out_dir:
      os.makedirs(out_dir, exist_ok=True)
      with open(os.path.join(out_dir, "decode.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)

  if "decode" in sections:
    if progress:
      progress(" | ".join(_COLS))
    res["rows"] = _decode_rows(params, modes, batches, requests, max_prompt, new_tokens,
                               heads, max_len, budget, warm_passes, seed, progress, save, res)
    save()
  if "hlo" in sections:
    try:
      res["hlo_body_ops"] = _hlo_body_ops(params, cfg, max_prompt, new_tokens, heads,
                                           max_len, seed)
    except Exception as e:  # noqa: BLE001 - a diagnostic; never fail the run for it
      res["hlo_body_ops"] = {"error": f"{type(e).__name__}: {e}"}
    if progress:
      progress(_fmt_hlo(res["hlo_body_ops"]))
    save()
  for name, key, fn in (("program", "program_rows", _program_rows),
                        ("nested", "nested_rows", _nested_rows)):
    if name not in sections:
      continue
    try:
      res[key] = fn(params, cfg, flags, quick, heads, seed, progress)
    except Exception as e:  # noqa: BLE001 - keep the other sections' figures
      res[key] = [{"mode": name, "error": f"{type(e).__name__}: {e}"}]
      if progress:
        progress(f"{name}: {res[key][0]['error']}")
    save()
  return res


def _loop_defaults() -> dict:
  """What ``while_loop``'s ``unroll=None`` and ``bucket_from="auto"`` resolve to on this
  backend, asked of the loop itself: a tiny capped loop (``i < 2``) runs once with the defaults
  and :func:`dynjax.control.loop_stats` reports its unroll and whether it started from the cap."""
  from dynjax.control import loop_stats, while_loop

  def cond(c):
    return c[1] < 2

  def body(c):
    return jnp.concatenate([c[0], c[0][:1]]), c[1] + 1

  while_loop(cond, body, (np.zeros(1, np.float32), np.int32(0)))
  st = loop_stats()
  return {"unroll": st.get("unroll"),
          "bucket_from_auto": "cap" if st.get("cap") is not None else "init"}


def _decode_rows(params, modes, batches, requests, max_prompt, new_tokens, heads, max_len,
                 budget, warm_passes, seed, progress, save=None, res=None) -> list[dict]:
  def decode(mode, pr, deadline=None, limit=None):
    """One request in one mode: ``(outputs, host syncs)``."""
    if mode in VARIANTS:
      out, st = decode_dynjax(params, pr, new_tokens, heads, **VARIANTS[mode])
      return out, st.get("host_syncs", 0)
    if mode == "jit_exact":
      return decode_jit_exact(params, pr, new_tokens, heads, deadline=deadline, limit=limit)
    if mode == "pad_max":
      return decode_pad_max(params, pr, max_len, new_tokens, heads)
    return decode_while_max(params, pr, max_len, new_tokens, heads)

  rows = []
  for batch in batches:
    prompts = _prompts(batch, requests, max_prompt, seed)
    ref_out = None
    for mode in modes:
      try:
        row, outs, cut = _decode_mode(decode, mode, batch, prompts, budget, new_tokens,
                                      warm_passes)
      except Exception as e:  # noqa: BLE001 - one broken mode must not hide the others
        row = {"mode": mode, "batch": batch, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        if progress:
          progress(f"{mode} | {batch} | error: {row['error']}")
        continue
      if ref_out is None:
        ref_out = outs
      row["matches_first_mode"] = all(
          np.array_equal(a, b[:, :a.shape[1]]) if cut else np.array_equal(a, b)
          for a, b in zip(outs, ref_out, strict=False))
      rows.append(row)
      ref = next((r["warm_ms_per_token"] for r in rows
                  if r["batch"] == batch and r["mode"] == "dynjax" and "error" not in r), None)
      row["ratio_vs_dynjax"] = round(row["warm_ms_per_token"] / ref, 3) if ref else None
      if progress:
        progress(_fmt_row(row))
      if res is not None and save is not None:
        res["rows"] = rows
        save()
  base = {(r["batch"], r["mode"]): r["warm_ms_per_token"] for r in rows if "error" not in r}
  for r in rows:
    ref = base.get((r["batch"], "dynjax"))
    if "error" not in r:
      r["ratio_vs_dynjax"] = round(r["warm_ms_per_token"] / ref, 3) if ref else None
  return rows


def _decode_mode(decode, mode, batch, prompts, budget, new_tokens, warm_passes):
  """One mode at one batch size: cold pass, warm passes.  Returns (row, outputs, cut)."""
  times, toks, syncs, cold = [], 0, [], None
  outs, limits = [], []
  deadline = (time.perf_counter() + budget if mode == "jit_exact" and budget is not None
              else None)
  cut = False
  c0 = _COMPILES[0]
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
  compiles = _COMPILES[0] - c0
  # Warm passes (compiles done): per request the best time counts.
  passes = 1 if mode == "jit_exact" else warm_passes
  warm = [float("inf")] * len(limits)
  for _ in range(passes):
    for j, (pr, lim) in enumerate(zip(prompts, limits, strict=False)):
      t0 = time.perf_counter()
      out, _ = decode(mode, pr, limit=lim)
      np.asarray(out[0])
      warm[j] = min(warm[j], time.perf_counter() - t0)
  per_tok = sum(warm) / max(toks, 1)
  row = {
      "mode": mode, "batch": batch, "requests": len(limits), "new_tokens": toks,
      "cold_first_s": round(cold or 0.0, 4), "cold_total_s": round(sum(times), 4),
      "warm_ms_per_token": round(1e3 * per_tok, 4),
      "host_syncs_per_request": float(np.mean(syncs)) if syncs else None,
      "compiles": compiles, "peak_bytes": _peak_bytes(),
  }
  if cut:
    row["extrapolated"] = True
    row["budget_s"] = budget
    row["cold_ms_per_token"] = round(1e3 * sum(times) / max(toks, 1), 4)
  return row, outs, cut


def _timed(fn, prompts, passes: int):
  """Cold pass (first sight of every prompt, compiles included), then warm passes: per
  request the best time.  Returns (outputs, cold seconds, warm seconds per request, compiles)."""
  c0 = _COMPILES[0]
  t0 = time.perf_counter()
  outs = []
  for pr in prompts:
    out = fn(pr)
    outs.append([np.asarray(o) for o in jax.tree_util.tree_leaves(out)])
  cold = time.perf_counter() - t0
  compiles = _COMPILES[0] - c0
  warm = [float("inf")] * len(prompts)
  c1 = _COMPILES[0]
  for _ in range(passes):
    for j, pr in enumerate(prompts):
      t0 = time.perf_counter()
      out = fn(pr)
      [np.asarray(o) for o in jax.tree_util.tree_leaves(out)]
      warm[j] = min(warm[j], time.perf_counter() - t0)
  return outs, cold, warm, compiles, _COMPILES[0] - c1


def _program_rows(params, cfg, flags, quick, heads, seed, progress) -> list[dict]:
  import dynjax
  from dynjax.control import run_in_program

  layers = int(flags.get("enc_layers", 4))
  n = int(flags.get("program_requests", 3 if quick else 4))
  max_new = int(flags.get("program_new_tokens", 16 if quick else 64))
  max_prompt = int(flags.get("program_max_prompt", 24 if quick else 128))
  passes = int(flags.get("warm_passes", 3 if quick else 2))
  enc = init_encoder(cfg, layers, seed + 1)
  gen = make_encode_generate(params, enc, max_new, heads)
  prompts = _prompts(1, n, max_prompt, seed + 7)
  compiled = dynjax.jit(gen, dims={"prompt": "b, t"})
  rows, ref = [], None
  for mode, fn in (("program_compiled", compiled),
                   ("program_op_by_op", lambda pr: run_in_program(gen, (jnp.asarray(pr),)))):
    outs, cold, warm, compiles, warm_compiles = _timed(fn, prompts, passes)
    ref = outs if ref is None else ref
    same = all(all(np.array_equal(a, b) for a, b in zip(x, y, strict=True))
               for x, y in zip(outs, ref, strict=True))
    row = {"mode": mode, "batch": 1, "requests": n, "enc_layers": layers,
           "prompt_lengths": [int(p.shape[1]) for p in prompts], "max_new": max_new,
           "warm_ms_per_request": round(1e3 * sum(warm) / n, 3),
           "cold_total_s": round(cold, 3), "compiles": compiles,
           "warm_compiles": warm_compiles, "matches_compiled": same}
    if mode == "program_compiled":
      st = compiled.stats()["programs"]
      row["program"] = st[-1] if st else None
    rows.append(row)
  return _ratios(rows, "warm_ms_per_request", "ratio_vs_compiled", _fmt_prog, progress)


def _ratios(rows: list[dict], metric: str, name: str, fmt, progress) -> list[dict]:
  """Each row's ``metric`` over the first row's, as ``name``; rows printed as they finish."""
  base = rows[0][metric]
  for r in rows:
    r[name] = round(r[metric] / base, 3)
    if progress:
      progress(fmt(r))
  return rows


def _nested_rows(params, cfg, flags, quick, heads, seed, progress) -> list[dict]:
  from dynjax.control import loop_stats, while_loop

  n = int(flags.get("nested_requests", 2 if quick else 4))
  sentences = int(flags.get("sentences", 3 if quick else 4))
  per = int(flags.get("per_sentence", 8 if quick else 32))
  max_prompt = int(flags.get("nested_max_prompt", 16 if quick else 64))
  passes = int(flags.get("warm_passes", 3 if quick else 2))
  prompts = _prompts(1, n, max_prompt, seed + 11)
  cond, body = make_nested(params, per, sentences, heads)
  info = {}

  def nested(pr):
    out = while_loop(cond, body, (jnp.asarray(pr), jnp.int32(0)))[0]
    info.update(loop_stats())
    return out

  rows, ref = [], None
  for mode, fn in (("nested_dynjax", nested),
                   ("nested_python", lambda pr: decode_nested_python(
                       params, pr, per, sentences, heads, max_prompt + sentences * (per + 1)))):
    outs, cold, warm, compiles, warm_compiles = _timed(fn, prompts, passes)
    ref = outs if ref is None else ref
    same = all(all(np.array_equal(a, b) for a, b in zip(x, y, strict=True))
               for x, y in zip(outs, ref, strict=True))
    toks = sum(int(o[0].shape[1]) - int(p.shape[1]) for o, p in zip(outs, prompts,
                                                                     strict=True))
    row = {"mode": mode, "batch": 1, "requests": n, "sentences": sentences,
           "per_sentence": per, "new_tokens": toks,
           "warm_ms_per_token": round(1e3 * sum(warm) / max(toks, 1), 4),
           "cold_total_s": round(cold, 3), "compiles": compiles,
           "warm_compiles": warm_compiles, "matches_dynjax": same}
    if mode == "nested_dynjax":
      row["outer_mode"] = info.get("mode")
      row["host_syncs_per_request"] = info.get("host_syncs")
    rows.append(row)
  return _ratios(rows, "warm_ms_per_token", "ratio_vs_dynjax", _fmt_nested, progress)


def _hlo_body_ops(params, cfg, max_prompt, new_tokens, heads, max_len, seed) -> dict:
  """Per-iteration kernels of dynjax's hoisted loop vs while_max (batch 1, the bucket of
  ``max_len``), from the optimized HLO of the device that runs the benchmark.

  dynjax does not hand out a loop's executable, so a child process (:func:`_hlo_child`) runs
  each variant's loop once at that bucket with XLA's dump flags, and the dumped optimized module
  that holds the while loop is read here.
  """
  import subprocess
  import sys
  import tempfile

  from dynjax.buckets import pow2

  pr = _prompts(1, 1, max_prompt, seed)[0]
  bucket = pow2(min=16).bucket(max_len)  # while_loop's default policy (see its docstring)
  variants = {"dynjax": {}, "dynjax_init_u1": VARIANTS["dynjax_init_u1"]}
  with tempfile.TemporaryDirectory(prefix="dynjax_decode_hlo_") as dump:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                       " --xla_dump_hlo_as_text").strip(),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    payload = {"d": cfg.d, "heads": cfg.heads, "ffn": cfg.ffn, "seed": seed, "heads_arg": heads,
               "new_tokens": new_tokens, "bucket": bucket, "prompt": pr.tolist(),
               "dump": dump, "variants": variants}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--hlo-child",
                           json.dumps(payload)], capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode != 0:
      raise RuntimeError(f"the HLO child process failed: {proc.stderr[-2000:]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for name in variants:
      with open(found[name]["file"]) as f:
        ops = while_body_ops(f.read())
      unroll = found[name]["unroll"]
      ops["unroll"] = unroll
      ops["per_step_total"] = round(ops.get("total", 0) / unroll, 2)
      out[name] = ops
  wc, wb = make_padded_step(params, max_len, new_tokens, heads)
  text = jax.jit(lambda c: lax.while_loop(wc, wb, c)).lower(
      init_padded_carry(pr, max_len)).compile().as_text()
  out["while_max"] = while_body_ops(text)
  out["while_max"]["per_step_total"] = out["while_max"].get("total", 0)
  out["bucket"] = int(bucket)
  return out


def _hlo_child(payload: dict) -> None:
  """``python -m benchmarks.decode --hlo-child '<json>'`` (XLA_FLAGS dump set by the parent):
  runs each variant's loop once, its buckets fixed to the one bucket, and prints which dumped
  optimized module holds each variant's while loop, with the unroll the loop used."""
  import glob

  from dynjax.buckets import explicit
  from dynjax.control import loop_stats, while_loop

  params = init_lm(LMConfig(d=payload["d"], heads=payload["heads"], ffn=payload["ffn"]),
                   seed=payload["seed"])
  pr = np.asarray(payload["prompt"], np.int32)
  pattern = os.path.join(payload["dump"], "*after_optimizations.txt")
  seen: set = set(glob.glob(pattern))
  found = {}
  for name, opts in payload["variants"].items():
    cond, body = make_step(params, payload["new_tokens"], payload["heads_arg"])
    jax.block_until_ready(while_loop(cond, body, init_carry(pr),
                                     buckets=explicit([payload["bucket"]]), **opts))
    new = sorted(set(glob.glob(pattern)) - seen)
    seen.update(new)
    loops = [p for p in new if "while(" in open(p).read()]
    if not loops:
      raise RuntimeError(f"{name}: no dumped module with a while loop (mode "
                         f"{loop_stats().get('mode')!r})")
    found[name] = {"file": loops[-1], "unroll": loop_stats()["unroll"]}
  print(json.dumps(found), flush=True)


_COLS = ["mode", "batch", "new_tokens", "warm_ms_per_token", "ratio_vs_dynjax",
         "host_syncs_per_request", "compiles", "cold_total_s", "matches_first_mode"]
_PCOLS = ["mode", "warm_ms_per_request", "ratio_vs_compiled", "compiles", "warm_compiles",
          "cold_total_s", "matches_compiled"]
_NCOLS = ["mode", "new_tokens", "warm_ms_per_token", "ratio_vs_dynjax", "compiles",
          "warm_compiles", "cold_total_s", "matches_dynjax"]


def _fmt_row(r: dict) -> str:
  cells = []
  for c in _COLS:
    v = r.get(c)
    if r.get("extrapolated") and c in ("warm_ms_per_token", "ratio_vs_dynjax", "new_tokens"):
      v = f"~{v}"  # measured on the part decoded within the time budget, per token
    cells.append(str(v))
  return " | ".join(cells)


def _fmt_prog(r: dict) -> str:
  return " | ".join(str(r.get(c)) for c in _PCOLS)


def _fmt_nested(r: dict) -> str:
  return " | ".join(str(r.get(c)) for c in _NCOLS)


def _fmt_hlo(h: dict) -> str:
  if not h or "error" in h:
    return f"hlo_body_ops: {h}"
  parts = [f"{k}: {v.get('per_step_total')} per step ({v.get('total')} per trip)"
           for k, v in h.items() if isinstance(v, dict)]
  return f"while-body kernels at bucket {h.get('bucket')}: " + "; ".join(parts)


def format_table(res: dict) -> str:
  lines = [" | ".join(_COLS)] + [_fmt_row(r) for r in res["rows"]]
  if any(r.get("extrapolated") for r in res["rows"]):
    lines.append("~ : jit_exact stopped at its time budget (exact_budget_s, per batch size); "
                 "per-token figures from the part it decoded (new_tokens = tokens decoded)")
  if res.get("program_rows"):
    lines += ["", "encoder + decode loop under dynjax.jit (batch 1):", " | ".join(_PCOLS)]
    lines += [_fmt_prog(r) for r in res["program_rows"]]
  if res.get("nested_rows"):
    lines += ["", "nested loops (outer host loop, inner hoisted decode):", " | ".join(_NCOLS)]
    lines += [_fmt_nested(r) for r in res["nested_rows"]]
  if res.get("hlo_body_ops"):
    lines += ["", _fmt_hlo(res["hlo_body_ops"])]
  lines += ["", "notes:"] + [f"  {k}: {v}" for k, v in res.get("notes", {}).items()]
  return "\n".join(lines)


def _main(argv: Sequence[str] | None = None) -> None:
  import sys

  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--hlo-child"]:
    _hlo_child(json.loads(argv[1]))
    return
  flags: dict = {"quick": "--full" not in argv,
                 "progress": lambda line: print(line, flush=True)}
  out_dir = None
  for a in argv:
    if a.startswith("--exact-budget="):
      flags["exact_budget_s"] = float(a.split("=", 1)[1])
    elif a.startswith("--out="):
      out_dir = a.split("=", 1)[1]
  res = run(flags, out_dir=out_dir)
  print(format_table(res), flush=True)


if __name__ == "__main__":
  _main()
