"""A training loop fed numpy batches (a data loader's), variable lengths: ms per step.

  python benchmarks/bench_train_numpy.py [--size base] [--steps 60] [--out DIR] [--tag NAME]

The Flax BERT encoder of ``--size`` (examples/models.py) with a mean-squared loss on its pooled
output and plain SGD: ``params, loss, err = step(params, tokens, lengths, targets)``, batch 8,
lengths from a lognormal (<= ``--max_len``), numpy batches, the parameters fed back each step.
Rows: ``dynjax`` (``dynjax.jit`` with pow2 buckets on t; whichever dynjax is first on
``PYTHONPATH``: run it once per tree for an A/B) and ``jax.jit padded`` (pow2 padding on the
host, one ``jax.jit``; the parameters stay on the device).  The first pass over the batches
compiles (untimed), the second is timed step by step (``float(loss)`` each step: the sync a
loop that logs its loss pays).  Also: whether the returned parameters are device arrays.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dynjax  # noqa: E402
from benchmarks._report import write_json  # noqa: E402
from examples import models  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size", default="base")
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--max_len", type=int, default=128)
  ap.add_argument("--out", default=None)
  ap.add_argument("--tag", default="")
  args = ap.parse_args(argv)
  cfg = models.ENCODER_SIZES[args.size]
  module = models.BertEncoder(cfg)
  params = models.to_device({"params": models.init_encoder_params(cfg, seed=0)})
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(args.steps):
    lens = np.clip(rng.lognormal(3.8, 0.7, 8), 4, args.max_len).astype(np.int32)
    t = int(lens.max())
    tok = rng.integers(1, cfg.vocab, (8, t)).astype(np.int32)
    batches.append((tok, lens, rng.standard_normal((8, cfg.d_model)).astype(np.float32)))

  def step(params, tokens, lengths, targets):
    def loss_fn(p):
      err = module.apply(p, tokens, lengths) - targets
      return jnp.mean(err ** 2), jnp.mean(err ** 2, axis=1)
    (loss, per), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(lambda a, b: a - 1e-4 * b, params, g), loss, per

  f = dynjax.jit(step, dims={"tokens": "b, t", "lengths": "b", "targets": f"b, {cfg.d_model}"},
                 buckets={"t": dynjax.buckets.pow2(16, args.max_len)}, padding="trust")
  hand = jax.jit(step)
  pol = dynjax.buckets.pow2(16, args.max_len)

  def hand_step(p, tok, lens, tgt):
    t = pol.bucket(tok.shape[1])
    pad = np.zeros((8, t), np.int32)
    pad[:, :tok.shape[1]] = tok
    return hand(p, pad, lens, tgt)

  res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "size": args.size,
         "tag": args.tag, "dynjax": os.path.dirname(dynjax.__file__), "rows": {}}
  for name, fn in (("dynjax", f), ("jax.jit padded", hand_step)):
    p = params
    for tok, lens, tgt in batches:  # compiles
      p, loss, _ = fn(p, tok, lens, tgt)
    float(loss)
    p = params
    ts = []
    for tok, lens, tgt in batches:
      t0 = time.perf_counter()
      p, loss, _ = fn(p, tok, lens, tgt)
      float(loss)
      ts.append(time.perf_counter() - t0)
    leaf = jax.tree.leaves(p)[0]
    res["rows"][name] = {"mean_ms": float(np.mean(ts)) * 1e3,
                         "median_ms": float(np.median(ts)) * 1e3,
                         "params_returned_as": type(leaf).__name__}
    print(f"  {name:16s} mean {np.mean(ts) * 1e3:8.2f} ms/step  median "
          f"{np.median(ts) * 1e3:8.2f}  params come back as {type(leaf).__name__}", flush=True)
  write_json(args.out, f"bench_train_numpy{args.tag}.json", res)
  return res


if __name__ == "__main__":
  main()
