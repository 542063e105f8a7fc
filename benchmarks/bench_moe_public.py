"""A MoE encoder written as public JAX code writes it (``lax.ragged_dot`` experts), served on
variable-length requests: ``jax.jit`` at each request's shape vs dynjax on length buckets.

  python benchmarks/bench_moe_public.py [--small] [--requests 60] [--out DIR]

The model is ``examples/moe_public.py``'s ``MoEClassifier`` (Mixtral's sparse block as the
JAX ports write it: top-2, tokens sorted by expert, two ``lax.ragged_dot``, scattered back).
Until the padding pass had a ``ragged_dot_general`` rule, ``dynjax.flax.jit(padding="auto")``
ran this model unpadded: one compile per request shape, as ``jax.jit`` does.  Modes, in one
process, each over the same request stream (batch 8, log-normal lengths, numpy in and out):

  exact   ``jax.jit(model.apply)`` at each request's own shape (what the fallback did)
  auto    ``dynjax.flax.jit(padding="auto")``, pow2 length buckets: exact by the padding pass
  trust   the same with ``padding="trust"`` (the function re-run at the bucket's sizes)
  +route  any of them with ``dynjax.route.ragged_dot`` in place of ``lax.ragged_dot`` (the
          grouped-GEMM kernels; on CPU it is ``lax.ragged_dot``), e.g. ``auto+route``
  +kernels  auto or trust with the model as written and ``ragged_dot="kernels"`` (dynjax
          rewrites its ``lax.ragged_dot`` to ``route.ragged_dot``), e.g. ``auto+kernels``

Each mode: the cold pass (compiles included) and its XLA compiles (``jax.monitoring``), then
the steady mean / median per request over a second pass; the largest difference of the
outputs from ``exact``'s (auto must be exact within the dtype's rounding); auto's fallbacks
(must be none).  Writes DIR/bench_moe_public.json with the JAX version and the device.

The modes share one process, so XLA's in-process autotuning results for a GEMM shape carry
from one mode to the next (auto and trust compile the same bucket shapes): compare cold
passes between runs of one mode each (``--modes auto``, ``--modes trust``), steady ones
within a run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import mode_line, write_json  # noqa: E402
from benchmarks._suite import CompileCounter  # noqa: E402
from benchmarks.bench_moe_gmm import request_stream, time_stream  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true", help="CPU sizes")
  ap.add_argument("--requests", type=int, default=60)
  ap.add_argument("--modes", default="exact,auto,trust")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  import dynjax
  import dynjax.flax
  from examples.moe_public import MoEClassifier

  on_gpu = jax.default_backend() == "gpu"
  if args.small:
    cfg = dict(vocab=512, d=64, heads=4, hidden=128, experts=8, k=2, max_len=512)
  else:
    cfg = dict(vocab=30522, d=1024, heads=16, hidden=4096, experts=8, k=2, max_len=512)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  model = MoEClassifier(**cfg, dtype=dtype)
  stream = request_stream(args.requests, 8, cfg["max_len"], cfg["vocab"], args.seed)
  tok0, len0 = stream[0]
  variables = jax.jit(model.init)(jax.random.key(0), jnp.asarray(tok0), jnp.asarray(len0))
  counter = CompileCounter.get()  # XLA's backend compiles, through jax.monitoring
  policy = dynjax.buckets.pow2(min=16, max=cfg["max_len"])
  lengths = sorted({tok.shape[1] for tok, _ in stream})
  out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "backend": jax.default_backend(), "dtype": jnp.dtype(dtype).name, "config": cfg,
         "requests": len(stream), "distinct_lengths": len(lengths),
         "buckets": sorted({policy.bucket(t) for t in lengths}), "modes": {}}
  print(f"jax {jax.__version__} on {out['device']}, {out['dtype']}, {len(stream)} requests of "
        f"batch 8, {len(lengths)} distinct lengths -> {len(out['buckets'])} pow2 buckets",
        flush=True)
  fns = {}
  routed = MoEClassifier(**cfg, dtype=dtype, dot=dynjax.route.ragged_dot)
  for mode in args.modes.split(","):
    padding, _, dot = mode.partition("+")
    if padding not in ("exact", "auto", "trust") or dot not in ("", "route", "kernels") or (
        padding == "exact" and dot == "kernels"):
      raise SystemExit(f"--modes: unknown mode {mode!r}; use exact, auto, trust, each "
                       "optionally +route, or auto/trust+kernels")
    m = routed if dot == "route" else model
    if padding == "exact":
      fns[mode] = jax.jit(m.apply)
    else:
      fns[mode] = dynjax.flax.jit(m, dims={"tokens": "b, t", "lengths": "b"},
                                  buckets={"t": policy, "b": dynjax.buckets.explicit([8])},
                                  padding=padding,
                                  ragged_dot="kernels" if dot == "kernels" else None)
  results = {}
  for mode, fn in fns.items():
    before = counter.compiles
    t0 = time.perf_counter()
    results[mode] = [np.asarray(fn(variables, tok, lens)) for tok, lens in stream]
    cold = time.perf_counter() - t0
    compiles = counter.compiles - before
    ts = time_stream(fn, variables, stream)  # ms a request, numpy in and out
    rec = {"cold_s": cold, "compiles": compiles, "mean_ms": float(ts.mean()),
           "median_ms": float(np.median(ts))}
    if not mode.startswith("exact"):
      st = fn.stats()
      rec["fallbacks"] = list(st["fallbacks"])
      rec["compile_s"] = float(st["compile_seconds"])  # dynjax's builds: XLA compile and
      rec["lowering_s"] = float(st["lowering_seconds"])  # of it, trace + padding + lowering
    if "exact" in results and mode != "exact":  # (+route: within the dtype's rounding)
      rec["max_abs_diff_vs_exact"] = float(max(
          np.abs(a.astype(np.float32) - b.astype(np.float32)).max()
          for a, b in zip(results[mode], results["exact"], strict=True)))
    out["modes"][mode] = rec
    print(mode_line(mode, rec, 6), flush=True)
    write_json(args.out, "bench_moe_public.json", out)
  return out


if __name__ == "__main__":
  main()
