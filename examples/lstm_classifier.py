"""An LSTM text classifier over variable-length docstrings, with dynjax's profile-guided buckets.

The model (``lax.scan`` over time, carry frozen past each sequence's length) is pad-safe, so
``padding="trust"`` is exact.  ``buckets.auto(max_compiles=6)`` starts with one bucket at the
max and re-plans its boundaries from the lengths it sees, never compiling more than 6.

    python examples/lstm_classifier.py [--requests 200] [--max_len 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

import dynjax

# The models and data are importable modules of examples/ (the repository root, not in the wheel).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import data, models  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--requests", type=int, default=200)
  ap.add_argument("--max_len", type=int, default=256)
  args = ap.parse_args(argv)

  cfg = models.LstmConfig(embed=64, hidden=128, classes=4)
  params = models.to_device(models.init_lstm_params(cfg, seed=0))
  stream = data.request_stream(args.requests, batch=8, max_len=args.max_len, seed=1)

  classify = dynjax.jit(models.lstm_apply, dims={"tokens": "b, t", "lengths": "b"},
                        buckets={"t": dynjax.buckets.auto(max_compiles=6, min=16,
                                                          max=args.max_len)},
                        padding="trust")
  t0 = time.perf_counter()
  preds = [np.asarray(classify(params, r.tokens, r.lengths)).argmax(-1) for r in stream]
  t_dyn = time.perf_counter() - t0

  # jax.jit on exact shapes: time it on the first requests, until 8 distinct shapes compiled.
  ref = jax.jit(models.lstm_apply)
  seen: set = set()
  t0 = time.perf_counter()
  n_ref = 0
  for r, p in zip(stream, preds, strict=True):
    if len(seen) >= 8 and r.tokens.shape not in seen:
      break
    seen.add(r.tokens.shape)
    want = np.asarray(ref(params, r.tokens, r.lengths))
    assert (want.argmax(-1) == p).all()
    n_ref += 1
  per_compile = (time.perf_counter() - t0) / len(seen)
  shapes = {r.tokens.shape for r in stream}

  st = classify.stats()
  labels = np.bincount(np.concatenate(preds), minlength=cfg.classes)
  print(f"classified {len(stream) * 8} docstrings in {len(stream)} requests in {t_dyn:.2f} s "
        f"(class counts {labels.tolist()})")
  print(f"dynjax : {st['compiles']} compiles, buckets {st['policies'].get('t')} -> "
        f"{sorted(st['per_bucket_calls'])}, padded fraction {st['padded_fraction']:.1%}")
  print(f"jax.jit: would compile {len(shapes)} times (one per distinct length), "
        f"~{len(shapes) * per_compile:.1f} s at ~{per_compile:.2f} s per new shape measured here")
  print(f"predictions match jax.jit on the first {n_ref} requests")
  return {"compiles": st["compiles"], "distinct_shapes": len(shapes),
          "padded_fraction": st["padded_fraction"], "checked": n_ref}


if __name__ == "__main__":
  main()
