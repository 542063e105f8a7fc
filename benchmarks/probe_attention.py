"""Why XLA's attention loses to torch's SDPA above 256 tokens, and what would win (issue 18 goal 4).

  python benchmarks/probe_attention.py --out $OUT/probe_attention.json          # H100, ~2 min
  python benchmarks/probe_attention.py --small --out /tmp/pa.json               # CPU smoke test
  python benchmarks/probe_attention.py --verify --out $OUT/verify_attention.json  # the rewrite

One process, one JSON (rewritten after every section, so a run cut short keeps what it measured),
one printed line per figure.  BERT-base shapes: batch 8, 12 heads, head dim 64, d 768.  Every
time is the median of >= 20 synced runs (``block_until_ready`` / ``torch.cuda.synchronize``
after each call) of an executable compiled before timing (``jax.jit(f).lower(...).compile()``).

* ``attention``: per T and dtype, the attention block alone from q, k, v ``[b, t, h, dh]`` and a
  boolean key mask (lengths drawn in ``[1, T]``, one row full): (a) ``einsum`` = the model's
  code (``examples.models.attend``: einsum / sqrt(dh), ``where(mask, s, finfo.min)``,
  ``jax.nn.softmax``, einsum); (b) ``jax.nn.dot_product_attention`` ``xla``/``cudnn`` (cudnn in
  bf16 only) with the boolean mask (``*_mask``) or with ``key_value_seq_lengths`` (``*_lengths``);
  (c) ``torch_sdpa`` (``F.scaled_dot_product_attention`` with the same boolean mask; fp32 under
  ``set_float32_matmul_precision("high")`` as in issue 18's torch runs).  ``max_err`` is the
  largest difference from an fp32 HIGHEST-precision reference over valid query rows.
* ``options`` (e): the whole BertEncoder at T=448 fp32 compiled with per-compile XLA options
  (``compile(compiler_options)``): compile seconds and run time.  The first entry (XLA's
  defaults) compiles first, so it pays the in-process autotuning no later entry can reuse.
* ``model`` (d): the whole Linen BertEncoder at exact T: fp32 and bf16 as written, bf16 with
  attention swapped for ``jax.nn.dot_product_attention(implementation="cudnn")`` (mask, or
  lengths), and the cheap stand-in ``attention_impl="none"`` (values pass through), whose
  difference gives ``attention_share``.
* ``hlo``: the kernels of the fp32 attention executable at the largest T (fusions and custom
  calls, from ``compiled.as_text()``) and the text itself beside the JSON.

``--verify`` instead checks dynjax's attention rewrite (``dynjax.jit(..., attention="cudnn")``
on GPU, ``"xla"`` elsewhere) on the BertEncoder, bf16 and fp32, ``padding="trust"`` and
``"auto"``, T in (300, 512) on the 512 bucket, against ``jax.jit`` at exact shapes (see
:func:`verify`; ~3-5 min on the H100, exit status 1 when a check fails), and times the bf16
bucket with and without the rewrite at T=300.

``--budget_s`` (default 130; 540 with ``--verify``) bounds the run: sections are ordered by value and a section that
would not fit is listed under ``skipped``.  Public APIs only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPTION_SETS = {
    "default": {},
    "triton_gemm_off": {"xla_gpu_enable_triton_gemm": False},
    "autotune_0": {"xla_gpu_autotune_level": 0},
    "triton_gemm_off_autotune_0": {"xla_gpu_enable_triton_gemm": False,
                                   "xla_gpu_autotune_level": 0},
    # Older XLA matched attention to cuDNN fused MHA behind this flag; kept to record whether
    # this XLA still knows it (an unknown option is an error, recorded as such).
    "cudnn_fmha": {"xla_gpu_enable_cudnn_fmha": True},
}


class Probe:
  """Holds the results, the clock and the output file."""

  def __init__(self, out: str, budget_s: float):
    self.out = out
    self.t0 = time.perf_counter()
    self.budget_s = budget_s
    self.res: dict = {"attention": [], "options": [], "model": [], "skipped": []}

  def left(self) -> float:
    return self.budget_s - (time.perf_counter() - self.t0)

  def fits(self, what: str, need_s: float) -> bool:
    if self.left() >= need_s:
      return True
    self.res["skipped"].append(f"{what}: {self.left():.0f} s left, needs ~{need_s:.0f} s")
    print(f"skip {what} (budget)", flush=True)
    return False

  def save(self) -> None:
    self.res["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
    d = os.path.dirname(self.out)
    if d:
      os.makedirs(d, exist_ok=True)
    with open(self.out, "w") as f:
      json.dump(self.res, f, indent=1)


def _time_jax(fn, args, reps):
  import jax

  for _ in range(3):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    s = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - s)
  return round(statistics.median(ts) * 1e3, 4), round(min(ts) * 1e3, 4)


def _compile(fun, args, options=None):
  import jax

  s = time.perf_counter()
  lowered = jax.jit(fun).lower(*args)
  s2 = time.perf_counter()
  compiled = lowered.compile(options) if options else lowered.compile()
  return compiled, round(s2 - s, 3), round(time.perf_counter() - s2, 3)


def _lengths(rng, b, t):
  import numpy as np

  lengths = rng.integers(1, t + 1, size=b).astype(np.int32)
  lengths[0] = t  # a batch is padded to its longest row
  return lengths


def _kernels(hlo: str) -> dict:
  """Kernel-level summary of an optimized HLO module's entry computation."""
  entry = hlo[hlo.rfind("ENTRY"):]
  return {
      "fusions": len(re.findall(r"= \S+ fusion\(", entry)),
      "fusion_kinds": sorted(set(re.findall(r"kind=(k\w+)", entry))),
      "custom_calls": re.findall(r'custom_call_target="([^"]+)"', entry),
      "triton_fusions": len(re.findall(r'"kind":"__triton', entry)),
  }


def attention_section(p: Probe, a, ts, dtypes, reps):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from examples import models

  gpu = jax.default_backend() == "gpu"
  torch = _torch()
  p.res["torch"] = None if torch is None else torch.__version__
  b, h, dh = a.batch, a.heads, a.head_dim
  rng = np.random.default_rng(0)
  last_hlo = None
  for t in ts:
    lengths = _lengths(rng, b, t)
    mask = np.arange(t)[None, :] < lengths[:, None]
    qkv32 = [rng.standard_normal((b, t, h, dh)).astype(np.float32) for _ in range(3)]
    ref = _reference(qkv32, mask)
    for dt in dtypes:
      if not p.fits(f"attention T={t} {dt}", 4.0):
        p.save()
        return
      jdt = jnp.dtype(dt)
      q, k, v = (jnp.asarray(x, jdt) for x in qkv32)
      m = jnp.asarray(mask)
      lens = jnp.asarray(lengths)
      variants = {
          "einsum": (lambda q, k, v, m, n: models.attend(q, k, v, m)),
          "xla_mask": (lambda q, k, v, m, n: jax.nn.dot_product_attention(
              q, k, v, mask=m[:, None, None, :], implementation="xla")),
          "xla_lengths": (lambda q, k, v, m, n: jax.nn.dot_product_attention(
              q, k, v, key_value_seq_lengths=n, implementation="xla")),
      }
      if gpu or a.small:  # dynjax's Pallas flash attention (interpreted off GPU), per block size
        for bq, bk in a.pallas_blocks:
          variants[f"pallas_lengths_{bq}x{bk}"] = _pallas(bq, bk, lengths=True)
        variants["pallas_mask"] = _pallas(*a.pallas_blocks[0], lengths=False)
      if dt != "float32":
        # cuDNN takes a mask as a bias [B|1, N|1, T, S] (T and S in full).
        variants["cudnn_mask"] = lambda q, k, v, m, n: jax.nn.dot_product_attention(
            q, k, v, mask=jnp.broadcast_to(m[:, None, None, :], (m.shape[0], 1) + m.shape[1:2]
                                           + m.shape[1:]), implementation="cudnn")
        variants["cudnn_lengths"] = lambda q, k, v, m, n: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=n, implementation="cudnn")
      for name, fun in variants.items():
        row = {"T": t, "dtype": dt, "impl": name}
        if name.startswith("cudnn") and not gpu:
          row["error"] = "no GPU"
        else:
          try:
            args = (q, k, v, m, lens)
            compiled, lower_s, compile_s = _compile(fun, args)
            row["ms"], row["min_ms"] = _time_jax(compiled, args, reps)
            row["compile_s"] = compile_s
            got = np.asarray(compiled(*args), np.float64)
            valid = mask[:, :, None, None]  # query rows past a length are don't-care
            row["max_err"] = float(np.max(np.abs(np.where(valid, got - ref, 0.0))))
            if name == "einsum" and dt == "float32":
              last_hlo = (t, compiled.as_text())
          except Exception as e:  # noqa: BLE001  (cudnn refuses some shapes: record why)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        p.res["attention"].append(row)
        print(f"attention T={t} {dt} {name}: " + (f"{row['ms']:.3f} ms (err {row['max_err']:.2e})"
              if "ms" in row else row["error"]), flush=True)
      if torch is not None:
        row = {"T": t, "dtype": dt, "impl": "torch_sdpa"}
        try:
          row["ms"], row["min_ms"], row["max_err"] = _torch_sdpa(torch, qkv32, mask, dt, reps,
                                                                 ref)
        except Exception as e:  # noqa: BLE001
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        p.res["attention"].append(row)
        print(f"attention T={t} {dt} torch_sdpa: "
              + (f"{row['ms']:.3f} ms" if "ms" in row else row["error"]), flush=True)
    p.save()
  if last_hlo is not None:
    t, text = last_hlo
    p.res["hlo"] = {"T": t, "dtype": "float32", "impl": "einsum", **_kernels(text)}
    with open(os.path.splitext(p.out)[0] + f"_attention_T{t}_fp32.hlo.txt", "w") as f:
      f.write(text)
    print(f"hlo einsum fp32 T={t}: {p.res['hlo']}", flush=True)
  p.save()


def _pallas(bq, bk, lengths):
  """dynjax's flash kernel with blocks ``bq x bk``: true key lengths (``lengths``) or the key
  mask."""
  from dynjax.bucketing import _flash

  def fun(q, k, v, m, n):
    if lengths:
      return _flash.flash_attention(q, k, v, kv_len=n, blocks=(bq, bk))
    return _flash.flash_attention(q, k, v, key_mask=m, blocks=(bq, bk))

  return fun


def _reference(qkv32, mask):
  """fp32 attention at HIGHEST matmul precision (float64 NumPy where that API is missing)."""
  import jax
  import numpy as np

  from examples import models

  try:
    with jax.default_matmul_precision("highest"):
      return np.asarray(jax.jit(models.attend)(*qkv32, mask), np.float64)
  except AttributeError:
    q, k, v = (np.swapaxes(x.astype(np.float64), 1, 2) for x in qkv32)  # [b, h, t, dh]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None, None, :], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.swapaxes((w / w.sum(-1, keepdims=True)) @ v, 1, 2)


def _torch():
  try:
    import torch
  except Exception:  # noqa: BLE001  (absent or a broken CUDA install: skip cleanly)
    return None
  return torch


def _torch_sdpa(torch, qkv32, mask, dt, reps, ref):
  import numpy as np
  import torch.nn.functional as F  # noqa: N812

  torch.set_float32_matmul_precision("high")
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dt]
  q, k, v = (torch.from_numpy(x).to(dev, tdt).transpose(1, 2).contiguous() for x in qkv32)
  m = torch.from_numpy(mask).to(dev)[:, None, None, :]

  def sync():
    if dev == "cuda":
      torch.cuda.synchronize()

  with torch.inference_mode():
    for _ in range(3):
      out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    sync()
    ts = []
    for _ in range(reps):
      s = time.perf_counter()
      out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
      sync()
      ts.append(time.perf_counter() - s)
  got = out.transpose(1, 2).float().cpu().numpy().astype(np.float64)
  err = float(np.max(np.abs(np.where(mask[:, :, None, None], got - ref, 0.0))))
  return round(statistics.median(ts) * 1e3, 4), round(min(ts) * 1e3, 4), err


def _model_fn(cfg, impl):
  import dataclasses

  from examples import models

  module = models.BertEncoder(dataclasses.replace(cfg, attention_impl=impl))

  def run(params, tokens, lengths):
    return module.apply({"params": params}, tokens, lengths)

  return run


def _model_inputs(cfg, b, t, dt, seed=0):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from examples import models

  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(dt)),
                        models.init_encoder_params(cfg, seed))
  rng = np.random.default_rng(seed + t)
  tokens = jnp.asarray(rng.integers(1, cfg.vocab, size=(b, t)).astype(np.int32))
  return params, tokens, jnp.asarray(_lengths(rng, b, t))


def options_section(p: Probe, cfg, b, t, reps, need_s):
  fun = _model_fn(cfg, "einsum")
  args = _model_inputs(cfg, b, t, "float32")
  for name, opts in OPTION_SETS.items():
    if not p.fits(f"options {name}", need_s):
      break
    row = {"T": t, "dtype": "float32", "options": name, "compiler_options": opts}
    try:
      compiled, row["lower_s"], row["compile_s"] = _compile(fun, args, opts)
      row["ms"], row["min_ms"] = _time_jax(compiled, args, reps)
    except Exception as e:  # noqa: BLE001  (an option this XLA does not know)
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    p.res["options"].append(row)
    if name == "default" and "ms" in row:
      p.res["model"].append({"T": t, "dtype": "float32", "impl": "einsum", "ms": row["ms"],
                             "min_ms": row["min_ms"], "compile_s": row["compile_s"]})
    print(f"options T={t} fp32 {name}: " + (f"{row['ms']:.3f} ms, compile {row['compile_s']:.1f} s"
          if "ms" in row else row["error"]), flush=True)
    p.save()


def model_section(p: Probe, cfg, b, ts, variants, reps, need_s, gpu):
  import jax
  import numpy as np

  for t in ts:
    ref = {}
    for dt, impl in variants:
      if any(r["T"] == t and r["dtype"] == dt and r["impl"] == impl for r in p.res["model"]):
        continue  # measured by the options section
      if impl.startswith("cudnn") and not gpu:
        continue
      if not p.fits(f"model T={t} {dt} {impl}", need_s):
        p.save()
        return
      row = {"T": t, "dtype": dt, "impl": impl}
      try:
        args = _model_inputs(cfg, b, t, dt)
        compiled, row["lower_s"], row["compile_s"] = _compile(_model_fn(cfg, impl), args)
        row["ms"], row["min_ms"] = _time_jax(compiled, args, reps)
        out = np.asarray(jax.device_get(compiled(*args)), np.float64)
        if impl == "einsum":
          ref[dt] = out
        elif dt in ref and impl != "none":
          row["max_err_vs_einsum"] = float(np.max(np.abs(out - ref[dt])))
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      p.res["model"].append(row)
      print(f"model T={t} {dt} {impl}: " + (f"{row['ms']:.3f} ms, compile {row['compile_s']:.1f} s"
            if "ms" in row else row["error"]), flush=True)
      p.save()
  _shares(p)


def _shares(p: Probe):
  by = {(r["T"], r["dtype"], r["impl"]): r.get("ms") for r in p.res["model"]}
  shares = []
  for (t, dt, impl), ms in sorted(by.items()):
    if impl == "einsum" and ms and by.get((t, dt, "none")):
      share = round(1 - by[(t, dt, "none")] / ms, 3)
      shares.append({"T": t, "dtype": dt, "attention_share": share})
      print(f"attention share T={t} {dt}: {share:.1%}", flush=True)
  p.res["attention_share"] = shares


def verify(p: Probe, a):
  """dynjax's attention rewrite on the BertEncoder (hidden states [b, t, d]) against jax.jit.

  Per dtype and padding mode, at T in ``a.ts`` on one bucket (the largest T): ``err_on`` =
  max |dynjax(attention=impl) - ref| over valid rows, ``err_off`` = the same for ``jax.jit`` of
  the model as written in that dtype, ``ref`` = ``jax.jit`` of the model in float32 at
  HIGHEST precision.  The rewrite is within the dtype's tolerance when its relative error
  (Frobenius, valid rows) is at most 1.5x the written model's own + 1e-3.  On GPU also the
  time per call of the bucket with and without the rewrite (median of >= 20 synced calls).
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  import dynjax
  from examples import models

  cfg = _config(a)
  gpu = jax.default_backend() == "gpu"
  impl = "cudnn" if gpu else "xla"
  module = models.BertEncoder(cfg)
  bucket = max(a.ts)

  def seq(params, tokens, lengths):
    return module.apply({"params": params}, tokens, lengths, method="sequence")

  def seq_unmasked(params, tokens):
    return module.apply({"params": params}, tokens, None, method="sequence")

  p32 = jax.tree.map(jnp.asarray, models.init_encoder_params(cfg, 0))
  rows = []
  for dt in ("bfloat16", "float32"):
    params = jax.tree.map(lambda x, dt=dt: jnp.asarray(x, jnp.dtype(dt)), p32)
    for padding, fun, masked in (("trust", seq, True), ("auto", seq_unmasked, False),
                                 ("auto", seq, True)):
      if not p.fits(f"verify {dt} {padding}", 6.0 if a.small else 25.0):
        break
      dims = {"tokens": "b, t", "lengths": "b"} if masked else {"tokens": "b, t"}
      kw = dict(dims=dims, padding=padding, buckets={"t": [bucket], "b": [a.batch]})
      f_on = dynjax.jit(fun, attention=impl, **kw)
      for t in a.ts:
        rng = np.random.default_rng(t)
        tokens = rng.integers(1, cfg.vocab, size=(a.batch, t)).astype(np.int32)
        lengths = _lengths(rng, a.batch, t)
        args = (tokens, lengths) if masked else (tokens,)
        valid = ((np.arange(t)[None, :] < lengths[:, None]) if masked
                 else np.ones((a.batch, t), bool))[..., None]
        with jax.default_matmul_precision("highest"):
          ref = np.asarray(jax.jit(fun)(p32, *args), np.float64)
        on = np.asarray(f_on(params, *args), np.float64)
        off = np.asarray(jax.jit(fun)(params, *args), np.float64)

        def errs(x, ref=ref, valid=valid):
          d = np.where(valid, x - ref, 0.0)
          return float(np.max(np.abs(d))), float(np.linalg.norm(d) / np.linalg.norm(
              np.where(valid, ref, 0.0)))

        (on_max, on_rel), (off_max, off_rel) = errs(on), errs(off)
        ok = bool(np.isfinite(on_rel) and on_rel <= 1.5 * off_rel + 1e-3)
        row = {"dtype": dt, "padding": padding, "masked": masked, "T": t, "bucket": bucket,
               "impl": impl, "err_on": on_max, "rel_on": on_rel, "err_off": off_max,
               "rel_off": off_rel, "ok": ok}
        rows.append(row)
        print(f"verify {dt} {padding} {'masked' if masked else 'unmasked'} T={t}: rewrite max "
              f"{on_max:.2e} rel {on_rel:.2e} | as written max {off_max:.2e} rel {off_rel:.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
      lines = [ln.strip() for ln in f_on.explain().splitlines()
               if "attention" in ln and ("rewritten" in ln or "unchanged" in ln
                                         or "seq_lengths" in ln or "padded keys" in ln)]
      rows.append({"dtype": dt, "padding": padding, "masked": masked,
                   "explain": sorted(set(lines))})
      for ln in sorted(set(lines)):
        print(f"explain {dt} {padding}: {ln}", flush=True)
      if gpu and dt == "bfloat16" and p.left() > 30:
        f_off = dynjax.jit(fun, **kw)
        t_time = max(x for x in a.ts if x < bucket) if len(a.ts) > 1 else bucket
        rng = np.random.default_rng(1)
        tokens = rng.integers(1, cfg.vocab, size=(a.batch, t_time)).astype(np.int32)
        args = (params, tokens, _lengths(rng, a.batch, t_time)) if masked else (params, tokens)
        timing = {"dtype": dt, "padding": padding, "masked": masked, "T": t_time,
                  "bucket": bucket}
        for name, f in (("rewrite", f_on), ("as_written", f_off)):
          timing[f"{name}_ms"] = _time_jax(lambda *x, f=f: f(*x), args, a.reps)[0]
        rows.append(timing)
        print(f"time {dt} {padding} T={t_time} (bucket {bucket}): rewrite "
              f"{timing['rewrite_ms']:.3f} ms, as written {timing['as_written_ms']:.3f} ms",
              flush=True)
      p.res["verify"] = rows
      p.save()
  p.res["verify"] = rows
  p.res["verify_ok"] = all(r.get("ok", True) for r in rows)
  p.save()


def _config(a):
  from examples import models

  base = models.ENCODER_SIZES["base"]
  if a.small:
    return models.EncoderConfig(vocab=97, d_model=a.heads * a.head_dim, heads=a.heads, layers=2,
                                ffn=4 * a.heads * a.head_dim, max_len=max(a.ts))
  return base


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="probe_attention.json", help="JSON file to write")
  ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  ap.add_argument("--verify", action="store_true", help="check dynjax's attention rewrite")
  ap.add_argument("--ts", default=None, help="comma-separated T (default 256,...,512)")
  ap.add_argument("--model_ts", default="448,320,512,384,256",
                  help="T of the whole-model section, in order of value")
  ap.add_argument("--reps", type=int, default=25)
  ap.add_argument("--pallas_blocks", default="64x64,128x64,64x32,32x32",
                  help="block_q x block_k of the Pallas flash kernel's rows (first: the mask row)")
  ap.add_argument("--only_attention", action="store_true",
                  help="the attention section only (no options/model sections)")
  ap.add_argument("--budget_s", type=float, default=None,
                  help="stop starting sections past this (default 130 s, --verify 540 s)")
  a = ap.parse_args(argv)
  if a.budget_s is None:
    a.budget_s = 540.0 if a.verify else 130.0
  if a.small:
    a.batch, a.heads, a.head_dim = 2, 2, 64
    a.ts = [int(x) for x in (a.ts or "16,24").split(",")]
    model_ts = [a.ts[-1], a.ts[0]]
  else:
    a.batch, a.heads, a.head_dim = 8, 12, 64
    a.ts = [int(x) for x in (a.ts or ("300,512" if a.verify else "256,320,384,448,512"))
            .split(",")]
    model_ts = [int(x) for x in a.model_ts.split(",")]
  a.reps = max(a.reps, 20)
  a.pallas_blocks = [tuple(int(x) for x in b.split("x")) for b in a.pallas_blocks.split(",")]

  p = Probe(a.out, a.budget_s)
  import jax
  import jaxlib

  dev = jax.devices()[0]
  p.res.update(versions={"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                         "python": sys.version.split()[0]},
               device=f"{dev.platform} {dev.device_kind}",
               config={"batch": a.batch, "heads": a.heads, "head_dim": a.head_dim, "ts": a.ts,
                       "model_ts": model_ts, "reps": a.reps, "small": a.small,
                       "budget_s": a.budget_s})
  print(f"device {p.res['device']}, jax {jax.__version__}", flush=True)
  if a.verify:
    verify(p, a)
    return 0 if p.res["verify_ok"] else 1
  gpu = jax.default_backend() == "gpu"
  cfg = _config(a)
  need = 3.0 if a.small else 9.0  # one whole-model compile + timing, with margin
  attention_section(p, a, a.ts, ("float32", "bfloat16"), a.reps)
  if a.only_attention:
    p.save()
    return 0
  options_section(p, cfg, a.batch, model_ts[0], a.reps, need)
  variants = [("float32", "einsum"), ("float32", "none"), ("bfloat16", "einsum"),
              ("bfloat16", "cudnn"), ("bfloat16", "cudnn_lengths"), ("bfloat16", "none")]
  model_section(p, cfg, a.batch, model_ts, variants, a.reps, need, gpu)
  p.save()
  print(f"wrote {a.out} ({p.res['elapsed_s']} s)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
