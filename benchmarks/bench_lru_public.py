"""A linear-recurrence model written as public Flax code writes it (``jax.lax.associative_scan``
over time), served and trained on variable-length requests: ``jax.jit`` at each request's shape
vs dynjax on length buckets.

  python benchmarks/bench_lru_public.py [--small] [--requests 60] [--modes ...] [--out DIR]

The model is ``examples/lru_public.py``'s ``LRUClassifier``.  JAX's ``associative_scan``
refuses a symbolic length, so until dynjax bound it as a primitive
(``dynjax/bucketing/_scan.py``) ``dynjax.flax.jit(padding="auto")`` ran this model unpadded:
one compile per request shape, which is what ``exact`` measures.  Modes, in one process, each
over the same stream (batch 8, log-normal lengths, numpy in and out):

  exact        ``jax.jit(model.apply)`` at each request's own shape (what the fallback did)
  auto         ``dynjax.flax.jit(padding="auto")``, pow2 length buckets: exact by the padding pass
  trust        the same with ``padding="trust"``
  train-exact  ``jax.jit`` of a training step (loss and gradients) at each request's shape
  train-auto   the same step under ``dynjax.jit(padding="auto")``

Each mode: the cold pass (compiles included) and its XLA compiles (``jax.monitoring``), then
the steady mean / median per request over a second pass; the largest difference of the outputs
(the loss and every gradient leaf for the training modes) from the exact mode's, and dynjax's
fallbacks (must be none).  ``--at T,...``: then each exact length ``T`` alone, batch 8, every
row ``T`` long: the forward and the training step under ``jax.jit`` at ``T`` and under dynjax at
``T``'s bucket, taking turns (medians): the cost of the bucket's padding plus dynjax's scan.
Writes DIR/bench_lru_public.json.
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
from benchmarks.bench_moe_gmm import request_stream, time_stream  # noqa: E402

MODES = ("exact", "auto", "trust", "train-exact", "train-auto")


def _flat(x) -> list[np.ndarray]:
  return [np.asarray(a, np.float32) for a in jax.tree.leaves(x)]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true", help="CPU sizes")
  ap.add_argument("--requests", type=int, default=60)
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--at", default="", help="exact lengths timed alone (comma-separated)")
  ap.add_argument("--iters", type=int, default=50)
  args = ap.parse_args(argv)
  import dynjax
  import dynjax.flax
  from examples.lru_public import LRUClassifier

  modes = args.modes.split(",")
  bad = [m for m in modes if m not in MODES]
  if bad:
    raise SystemExit(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
  if args.small:
    cfg = dict(vocab=512, d=32, hidden=32, layers=2, max_len=256)
  else:
    cfg = dict(vocab=30522, d=256, hidden=256, layers=4, max_len=512)
  max_len = cfg.pop("max_len")
  model = LRUClassifier(**cfg)
  stream = request_stream(args.requests, 8, max_len, cfg["vocab"], args.seed)
  rng = np.random.default_rng(args.seed + 1)
  targets = [rng.integers(0, model.classes, 8).astype(np.int32) for _ in stream]
  tok0, len0 = stream[0]
  variables = jax.jit(model.init)(jax.random.key(0), jnp.asarray(tok0), jnp.asarray(len0))
  counter = CompileCounter.get()
  policy = dynjax.buckets.pow2(min=16, max=max_len)
  lengths = sorted({tok.shape[1] for tok, _ in stream})
  out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "backend": jax.default_backend(), "config": {**cfg, "max_len": max_len},
         "requests": len(stream), "distinct_lengths": len(lengths),
         "buckets": sorted({policy.bucket(t) for t in lengths}), "modes": {}}
  print(f"jax {jax.__version__} on {out['device']}, {len(stream)} requests of batch 8, "
        f"{len(lengths)} distinct lengths -> {len(out['buckets'])} pow2 buckets", flush=True)

  def loss(variables, tokens, lengths, target):
    logits = model.apply(variables, tokens, lengths)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), target[:, None], 1))

  step = jax.value_and_grad(loss)
  dims = {"tokens": "b, t", "lengths": "b"}
  buckets = {"t": policy, "b": dynjax.buckets.explicit([8])}
  fns = {}
  for mode in modes:
    if mode == "exact":
      fns[mode] = jax.jit(model.apply)
    elif mode in ("auto", "trust"):
      fns[mode] = dynjax.flax.jit(model, dims=dims, buckets=buckets, padding=mode)
    elif mode == "train-exact":
      fns[mode] = jax.jit(step)
    else:
      fns[mode] = dynjax.jit(step, dims={**dims, "target": "b"}, buckets=buckets)
  results = {}
  for mode, fn in fns.items():
    train = mode.startswith("train")
    stream_m = [(tok, lens, tgt) for (tok, lens), tgt in zip(stream, targets, strict=True)]

    def call(f, tok, lens, tgt, train=train):
      return f(variables, tok, lens, tgt) if train else f(variables, tok, lens)

    before = counter.compiles
    t0 = time.perf_counter()
    results[mode] = [_flat(call(fn, *r)) for r in stream_m]
    cold = time.perf_counter() - t0
    compiles = counter.compiles - before
    if train:
      ts = []
      for r in stream_m:
        t1 = time.perf_counter()
        jax.block_until_ready(call(fn, *r))
        ts.append(time.perf_counter() - t1)
      ts = np.asarray(ts) * 1e3
    else:
      ts = time_stream(fn, variables, stream)
    rec = {"cold_s": cold, "compiles": compiles, "mean_ms": float(ts.mean()),
           "median_ms": float(np.median(ts))}
    if hasattr(fn, "stats"):
      st = fn.stats()
      rec["fallbacks"] = list(st["fallbacks"])
      rec["exact_calls"] = int(st["exact_calls"])
    ref = "train-exact" if train else "exact"
    if ref in results and mode != ref:
      rec["max_abs_diff_vs_exact"] = float(max(
          np.abs(a - b).max() for ra, rb in zip(results[mode], results[ref], strict=True)
          for a, b in zip(ra, rb, strict=True)))
    out["modes"][mode] = rec
    print(mode_line(mode, rec, 11), flush=True)
    write_json(args.out, "bench_lru_public.json", out)
  if args.at:
    out["at"] = at_lengths(args, model, variables, step, dims, buckets)
    write_json(args.out, "bench_lru_public.json", out)
  return out


def at_lengths(args, model, variables, step, dims, buckets) -> dict:
  """Forward and training step at single lengths: jax.jit at T vs dynjax at T's bucket."""
  import dynjax
  import dynjax.flax

  fns = {"fwd exact": jax.jit(model.apply),
         "fwd auto": dynjax.flax.jit(model, dims=dims, buckets=buckets),
         "step exact": jax.jit(step),
         "step auto": dynjax.jit(step, dims={**dims, "target": "b"}, buckets=buckets)}
  rng = np.random.default_rng(args.seed + 2)
  rec = {}
  for t in (int(s) for s in args.at.split(",")):
    tok = rng.integers(1, model.vocab, (8, t)).astype(np.int32)
    args_by = {"fwd": (variables, tok, np.full(8, t, np.int32)),
               "step": (variables, tok, np.full(8, t, np.int32), np.zeros(8, np.int32))}
    rec[str(t)] = turn_medians(fns, lambda name, a=args_by: a[name.split()[0]], args.iters)
    print(f"  T={t} (bucket {buckets['t'].bucket(t)}): " + "  ".join(
        f"{k} {v:.3f}" for k, v in rec[str(t)].items()) + " ms", flush=True)
  return rec


if __name__ == "__main__":
  main()
