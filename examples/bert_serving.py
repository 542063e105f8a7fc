"""Serving a Flax BERT-style encoder on variable-length requests with dynjax.

Requests are batches of 8 real docstrings from the Python standard library, each batch padded
only to its own longest sequence, as a client would send them.  ``jax.jit`` would compile once
per distinct length; ``dynjax.flax.jit`` compiles one executable per power-of-two bucket of
the length, pads on the host, and returns exact-shape results.

    python examples/bert_serving.py [--requests 64] [--max_len 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

import dynjax
from dynjax import flax as dynjax_flax

# The models and data are importable modules of examples/ (the repository root, not in the wheel).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import data, models  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--requests", type=int, default=64)
  ap.add_argument("--max_len", type=int, default=512)
  ap.add_argument("--check", type=int, default=3, help="requests compared with jax.jit")
  args = ap.parse_args(argv)

  cfg = models.EncoderConfig(d_model=128, heads=2, layers=2, ffn=512, max_len=args.max_len)
  module = models.BertEncoder(cfg)
  variables = models.to_device({"params": models.init_encoder_params(cfg, seed=0)})
  stream = data.request_stream(args.requests, batch=8, max_len=args.max_len, seed=0)

  # One line: the Linen module, which arguments are dynamic, and the buckets.
  encode = dynjax_flax.jit(module, dims={"tokens": "b, t", "lengths": "b"},
                           buckets={"t": dynjax.buckets.pow2(16, args.max_len)},
                           padding="trust")  # the model masks its own padding

  t0 = time.perf_counter()
  warm = encode.warmup(variables, stream[0].tokens, stream[0].lengths, progress=False)
  t_warm = time.perf_counter() - t0
  t0 = time.perf_counter()
  outputs = [np.asarray(encode(variables, r.tokens, r.lengths)) for r in stream]
  t_serve = time.perf_counter() - t0

  # What jax.jit would have done: one compile per distinct request shape.  Measure a few.
  ref = jax.jit(module.apply)
  shapes = sorted({r.tokens.shape for r in stream})
  t0 = time.perf_counter()
  checked = 0
  for r, out in list(zip(stream, outputs, strict=True))[:args.check]:
    want = np.asarray(ref(variables, r.tokens, r.lengths))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    checked += 1
  per_compile = (time.perf_counter() - t0) / max(checked, 1)

  st = encode.stats()
  print(f"served {len(stream)} requests (batch 8, lengths {min(s[1] for s in shapes)}.."
        f"{max(s[1] for s in shapes)}) in {t_serve:.2f} s after a {t_warm:.2f} s warmup")
  used = sorted(int(k.split("t=")[1]) for k in st["per_bucket_calls"])
  print(f"dynjax : {st['compiles']} compiles (warmup of {len(warm['buckets'])} buckets; "
        f"t = {used} used), "
        f"padded fraction {st['padded_fraction']:.1%}, {st['cache_hits']} cache hits")
  print(f"jax.jit: would compile {len(shapes)} times (one per distinct length), "
        f"~{len(shapes) * per_compile:.1f} s at the {per_compile:.2f} s per compile measured here")
  print(f"outputs match jax.jit on the {checked} requests checked")
  plan = [ln for ln in encode.explain().splitlines()
          if not ln.startswith("    ") or ln.lstrip().startswith(("t:", "b:"))]
  print("\n".join(plan))
  return {"compiles": st["compiles"], "distinct_shapes": len(shapes), "warmup": warm,
          "padded_fraction": st["padded_fraction"], "checked": checked}


if __name__ == "__main__":
  main()
