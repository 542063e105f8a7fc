"""A model that searches a dynamic-length sorted array (``jnp.interp``, ``jnp.digitize``),
served on requests of varying length: ``jax.jit`` at each request's shape vs dynjax on buckets.

  python benchmarks/bench_search.py [--small] [--requests 60] [--at N,...] [--out DIR]

The model is ``examples/irregular_public.py``'s ``IrregularClassifier``: an irregularly sampled
series resampled onto a fixed grid by ``jnp.interp``, observation densities by ``jnp.digitize``.
JAX refuses a symbolic length in both, so until dynjax bound the search as a primitive
(``dynjax/bucketing/_search.py``) ``dynjax.flax.jit(padding="auto")`` ran it unpadded: one
compile per number of observations, which is what ``exact`` measures.  Modes, in one process,
over the same stream (log-normal observation counts, numpy in and out):

  exact   ``jax.jit(model.apply)`` at each request's own shape (what the fallback did)
  auto    ``dynjax.flax.jit(padding="auto")``, pow2 buckets of the observation count

Each mode: the cold pass (compiles included), its XLA compiles, the steady mean / median per
request over a second pass, the largest difference from ``exact``, dynjax's fallbacks (must be
none).  ``--at N,...``: then each count ``N`` alone, the forward and ``jnp.searchsorted`` of
``N`` queries into ``N`` sorted values (methods ``scan`` and ``sort``) under ``jax.jit`` at
``N`` and under dynjax at ``N``'s bucket, taking turns (medians).
Writes DIR/bench_search.json.
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

from benchmarks._report import mode_line, turn_medians, write_json  # noqa: E402
from benchmarks._suite import CompileCounter  # noqa: E402

MODES = ("exact", "auto")


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true", help="CPU sizes")
  ap.add_argument("--requests", type=int, default=60)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--at", default="", help="observation counts timed alone (comma-separated)")
  ap.add_argument("--iters", type=int, default=50)
  args = ap.parse_args(argv)
  import dynjax
  import dynjax.flax
  from examples.irregular_public import IrregularClassifier, sample_series

  cfg = dict(grid=64, channels=4, width=32, layers=2) if args.small else dict(
      grid=256, channels=8, width=128, layers=4)
  max_n = 1024 if args.small else 8192
  model = IrregularClassifier(**cfg)
  rng = np.random.default_rng(args.seed)
  counts = np.clip(rng.lognormal(5.5, 1.0, args.requests), 4, max_n).astype(int)
  stream = [sample_series(rng, int(n), cfg["channels"]) for n in counts]
  variables = jax.jit(model.init)(jax.random.key(0), *stream[0])
  policy = dynjax.buckets.pow2(min=16, max=max_n)
  dims = {"times": "n", "values": f"n, {cfg['channels']}"}
  fns = {"exact": jax.jit(model.apply),
         "auto": dynjax.flax.jit(model, dims=dims, buckets={"n": policy})}
  counter = CompileCounter.get()
  out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "backend": jax.default_backend(), "config": {**cfg, "max_n": max_n},
         "requests": len(stream), "distinct_counts": len(set(counts.tolist())),
         "buckets": sorted({policy.bucket(int(n)) for n in counts}), "modes": {}}
  print(f"jax {jax.__version__} on {out['device']}, {len(stream)} requests, "
        f"{out['distinct_counts']} distinct observation counts -> {len(out['buckets'])} "
        f"pow2 buckets", flush=True)
  results = {}
  for mode, fn in fns.items():
    before = counter.compiles
    t0 = time.perf_counter()
    results[mode] = [np.asarray(fn(variables, *r)) for r in stream]
    cold = time.perf_counter() - t0
    ts = []
    for r in stream:
      t1 = time.perf_counter()
      np.asarray(fn(variables, *r))
      ts.append(time.perf_counter() - t1)
    ts = np.asarray(ts) * 1e3
    rec = {"cold_s": cold, "compiles": counter.compiles - before, "mean_ms": float(ts.mean()),
           "median_ms": float(np.median(ts))}
    if hasattr(fn, "stats"):
      rec["fallbacks"] = list(fn.stats()["fallbacks"])
    if mode != "exact":
      rec["max_abs_diff_vs_exact"] = float(max(
          np.abs(a - b).max() for a, b in zip(results[mode], results["exact"], strict=True)))
    out["modes"][mode] = rec
    print(mode_line(mode, rec), flush=True)
    write_json(args.out, "bench_search.json", out)
  if args.at:
    out["at"] = at_counts(args, model, variables, dims, policy, cfg["channels"])
    write_json(args.out, "bench_search.json", out)
  return out


def at_counts(args, model, variables, dims, policy, channels) -> dict:
  """The forward and a bare search at single counts: jax.jit at N vs dynjax at N's bucket."""
  import dynjax
  import dynjax.flax
  from examples.irregular_public import sample_series

  def search(method):
    return lambda a, v: jnp.searchsorted(a, v, method=method)

  fns = {"fwd exact": jax.jit(model.apply),
         "fwd auto": dynjax.flax.jit(model, dims=dims, buckets={"n": policy})}
  for method in ("scan", "sort"):
    fns[f"{method} exact"] = jax.jit(search(method))
    fns[f"{method} auto"] = dynjax.jit(search(method), dims={"a": "n", "v": "n"},
                                       buckets={"n": policy})
  rng = np.random.default_rng(args.seed + 2)
  rec = {}
  for n in (int(s) for s in args.at.split(",")):
    times, values = sample_series(rng, n, channels)
    queries = rng.uniform(0, 1, n).astype(np.float32)
    inputs = {"fwd": (variables, times, values), "scan": (times, queries),
              "sort": (times, queries)}
    rec[str(n)] = turn_medians(fns, lambda name, a=inputs: a[name.split()[0]], args.iters)
    print(f"  N={n} (bucket {policy.bucket(n)}): " + "  ".join(
        f"{k} {v:.3f}" for k, v in rec[str(n)].items()) + " ms", flush=True)
  return rec


if __name__ == "__main__":
  main()
