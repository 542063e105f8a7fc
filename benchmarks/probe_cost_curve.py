"""What one BERT-base call costs at each bucket size on a GPU, and dynjax's request path against
the hand-written one at the same buckets (issue 18: the T<=64 bin, the tier-up's worth, the
planner's cost model against the hardware).

  python benchmarks/probe_cost_curve.py --out DIR [--sizes 16:512:8] [--options quick,full]
                                        [--ab 1000] [--ab-variants hand,pow2_xla,...]

``curve``: for each size T and each named option set (``quick``: dynjax's tier 0, ``full``:
its tier 1, ``xla``: XLA's defaults), ``jax.jit(module.apply)`` lowered at (batch, T) with
every length T and compiled (``--workers`` compiles at once); then every executable's median
of ``--reps`` synced runs on device inputs (ms), in ``--rounds`` rounds, the order reversed
each round (the median over rounds is reported).  ``--extra`` adds sizes off the grid (odd
and unaligned: the exact shapes a request brings).

``ab``: issue 18's request stream (``--ab`` requests of batch 8, numpy in and out) served by
the hand-written server (``serve_fresh.py``'s ``hand``: pow2 buckets padded on the host,
``jax.jit``, ``np.asarray`` of the padded result) and dynjax's variants (:func:`ab`), every
bucket built on all of them first, then ``--rounds`` passes taking turns per request: mean /
median ms and the mean per length bin.  ``hand`` and ``pow2_xla`` differ in the request path
only (the same buckets and XLA options).  Writes DIR/probe_cost_curve.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import jax
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402

BINS = ((1, 64), (65, 128), (129, 256), (257, 512))
# dynjax's tier 0 / tier 1 on GPU (jit/_serving.py's QUICK_GPU_OPTIONS / FULL_GPU_OPTIONS,
# spelled here: benchmarks do not import dynjax's private modules).
OPTIONS = {"quick": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 1},
           "full": {"xla_gpu_enable_triton_gemm": False}, "xla": {}}


def _sizes(spec: str) -> list[int]:
  out = []
  for part in filter(None, spec.split(",")):
    if ":" in part:
      lo, hi, step = (int(x) for x in part.split(":"))
      out += list(range(lo, hi + 1, step))
    else:
      out.append(int(part))
  return sorted(set(out))


def _model(size: str, dtype: str):
  from examples import models

  cfg = models.ENCODER_SIZES[size]
  module = models.BertEncoder(cfg)
  dt = jax.numpy.dtype(dtype)
  variables = jax.device_put({"params": jax.tree.map(
      lambda a: a.astype(dt), models.init_encoder_params(cfg, seed=0))})
  return cfg, module, variables


def curve(args) -> dict:
  cfg, module, variables = _model(args.size, args.dtype)
  apply = jax.jit(module.apply)
  sizes = sorted(set(_sizes(args.sizes)) | set(_sizes(args.extra)))
  opts = [o for o in args.options.split(",") if o]
  rng = np.random.default_rng(0)
  inputs = {t: (jax.device_put(rng.integers(1, cfg.vocab, (args.batch, t), dtype=np.int32)),
                jax.device_put(np.full((args.batch,), t, np.int32))) for t in sizes}
  t0 = time.perf_counter()
  lowered = {t: apply.lower(variables, *inputs[t]) for t in sizes}  # lowering holds the GIL
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
    futs = {(t, o): pool.submit(lowered[t].compile, compiler_options=OPTIONS[o])
            for t in sizes for o in opts}
    exes = {k: f.result() for k, f in futs.items()}
  compile_s = time.perf_counter() - t0
  keys = list(exes)
  per: dict = {k: [] for k in keys}
  for rnd in range(args.rounds):
    for k in (keys if rnd % 2 == 0 else keys[::-1]):
      exe, (tok, lens) = exes[k], inputs[k[0]]
      for _ in range(3):
        exe(variables, tok, lens).block_until_ready()
      xs = []
      for _ in range(args.reps):
        t1 = time.perf_counter()
        exe(variables, tok, lens).block_until_ready()
        xs.append(time.perf_counter() - t1)
      per[k].append(float(np.median(xs)) * 1e3)
  table = {o: {t: float(np.median(per[(t, o)])) for t in sizes} for o in opts}
  for t in sizes:
    print(f"T={t:4d} " + "  ".join(f"{o} {table[o][t]:.3f}" for o in opts), flush=True)
  return {"ms": table, "spread_ms": {o: {t: [min(per[(t, o)]), max(per[(t, o)])]
                                         for t in sizes} for o in opts},
          "lower_s": lower_s, "compile_s": compile_s, "workers": args.workers}


def _served(g, variables):
  return lambda r: np.asarray(g(variables, r.tokens, r.lengths))


def _bin_stats(v, lengths) -> dict:
  v = np.asarray(v) * 1e3
  sel = {f"{lo}-{hi}": (lengths >= lo) & (lengths <= hi) for lo, hi in BINS}
  return {"mean_ms": float(v.mean()), "median_ms": float(np.median(v)),
          "bins_ms": {b: float(v[m].mean()) for b, m in sel.items() if m.any()},
          "bins_median_ms": {b: float(np.median(v[m])) for b, m in sel.items() if m.any()}}


def ab(args) -> dict:
  """The request paths side by side (see the module docstring); ``--ab-variants``:
  ``hand``; ``pow2_<opts>`` dynjax.flax.jit, pow2 buckets, blocking compiles; ``auto16s``
  ``auto(16)`` with ``serving=True`` and a ``cache_dir`` (tier-0 options named, so one tier),
  planned by build passes over the stream, then ``wait()``; ``auto16s_loaded`` a second such
  function on the same ``cache_dir`` (a restart's executables, loaded from the store).  Then
  ``auto16s`` again in whole passes, its family keeping executors by sizes (``keep``) or
  building one per call (``perc``: dynjax before session 36), taking turns."""
  import tempfile

  import dynjax
  import dynjax.flax
  from examples import data

  cfg, module, variables = _model(args.size, args.dtype)
  reqs = data.request_stream(args.ab, batch=args.batch, max_len=cfg.max_len, seed=0,
                             vocab=cfg.vocab)
  pol = dynjax.buckets.pow2(16, cfg.max_len)
  apply = jax.jit(module.apply)
  cache = tempfile.mkdtemp(prefix="probe_cost_curve_")
  dims = {"tokens": "b, t", "lengths": "b"}

  def hand(r):
    b, t = r.tokens.shape
    buf = np.zeros((b, pol.bucket(t)), r.tokens.dtype)
    buf[:, :t] = r.tokens
    return np.asarray(apply(variables, buf, r.lengths))[:, :t]

  def auto16s():
    return dynjax.flax.jit(module, dims=dims, buckets={"t": dynjax.buckets.auto(
        max_compiles=16, min=16, max=cfg.max_len)}, serving=True, cache_dir=cache,
        compiler_options=OPTIONS["quick"])

  fns, wrapped, out = {}, {}, {"requests": args.ab, "rounds": args.rounds, "build_s": {}}
  for v in filter(None, args.ab_variants.split(",")):
    t0 = time.perf_counter()
    if v == "hand":
      fns[v] = hand
    elif v.startswith("pow2_"):
      g = dynjax.flax.jit(module, dims=dims, buckets={"t": pol},
                          compiler_options=OPTIONS[v[5:]] or None)
      fns[v] = _served(g, variables)
    elif v in ("auto16s", "auto16s_loaded"):
      g = wrapped[v] = auto16s()
      fns[v] = _served(g, variables)
    else:
      raise SystemExit(f"--ab-variants: unknown {v!r}")
    for _ in range(2 if v == "auto16s" else 1):  # planned from the stream, then built
      for r in reqs:
        fns[v](r)
      if v in wrapped:
        wrapped[v].wait()
    out["build_s"][v] = time.perf_counter() - t0
  for v, g in wrapped.items():
    out[f"{v}_stats"] = {k: g.stats().get(k) for k in ("compiles", "loaded_from_store",
                                                        "per_bucket_calls")}
  names = list(fns)
  ts: dict = {n: [] for n in names}
  for k in range(args.rounds):
    for i, r in enumerate(reqs):
      for n in (names if (i + k) % 2 == 0 else names[::-1]):
        t1 = time.perf_counter()
        fns[n](r)
        ts[n].append(time.perf_counter() - t1)
  lengths = np.asarray([r.tokens.shape[1] for r in reqs] * args.rounds)
  for n, v in ts.items():
    out[n] = _bin_stats(v, lengths)
    print(f"{n:16s} mean {out[n]['mean_ms']:.3f} median {out[n]['median_ms']:.3f} bins "
          + " ".join(f"{b} {x:.3f}" for b, x in out[n]["bins_ms"].items()), flush=True)
  if "auto16s" in wrapped:  # executors kept by sizes vs one per call, whole passes in turn
    g, fn = wrapped["auto16s"], fns["auto16s"]
    fams = list(g._dispatcher.all_families.values())
    keep = {id(f): (f.keeps_executors, f.watched_plan) for f in fams}
    passes: dict = {"keep": [], "perc": []}
    for k in range(2 * args.rounds):
      mode = ("keep", "perc")[(k + k // 2) % 2]  # keep perc perc keep keep perc ...
      for f in fams:
        f.keeps_executors, f.watched_plan = keep[id(f)] if mode == "keep" else (False, False)
        f.executors.clear()
      xs = []
      for r in reqs:
        t1 = time.perf_counter()
        fn(r)
        xs.append(time.perf_counter() - t1)
      passes[mode] += xs
    lens = np.asarray([r.tokens.shape[1] for r in reqs] * args.rounds)
    out["executors"] = {m: _bin_stats(v, lens) for m, v in passes.items()}
    for m, r in out["executors"].items():
      print(f"auto16s {m:5s} mean {r['mean_ms']:.4f} median {r['median_ms']:.4f} bins "
            + " ".join(f"{b} {x:.3f}" for b, x in r["bins_ms"].items()), flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--parts", default="curve,ab")
  ap.add_argument("--size", default="base")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--sizes", default="16:512:8", help="lo:hi:step and single sizes, comma-separated")
  ap.add_argument("--extra", default="37,141,300,450", help="sizes off the grid")
  ap.add_argument("--options", default="quick,full")
  ap.add_argument("--workers", type=int, default=4)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--ab", type=int, default=1000, help="requests of the A/B (0: none)")
  ap.add_argument("--ab-variants", default="hand,pow2_xla,pow2_quick,auto16s,auto16s_loaded")
  args = ap.parse_args(argv)
  report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "config": vars(args)}
  parts = args.parts.split(",")
  if "curve" in parts:
    report["curve"] = curve(args)
    if args.out:
      write_json(args.out, "probe_cost_curve.json", report)
  if "ab" in parts and args.ab:
    report["ab"] = ab(args)
  if args.out:
    write_json(args.out, "probe_cost_curve.json", report)
  return report


if __name__ == "__main__":
  main()
