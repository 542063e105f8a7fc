"""Layers that differ only in a scalar constant, lowered once a bucket (session 32) or flat.

  python benchmarks/probe_outline_constants.py [--layers 12] [--rounds 3] [--out DIR]

A pre-LN Flax encoder whose every layer scales its residual branches by its own Python
constant ``1 / sqrt(2 (i + 1))`` (as depth-scaled models write it) under ``dynjax.flax.jit``
(``padding="auto"``), batch 4, width 256, buckets t = 64, 128.  For outlining on and off
(``DYNJAX_OUTLINE``'s switch, set before each function is built), in turns over ``--rounds``:
the first bucket's ``lower()`` (with the family's trace), then the second bucket's alone (s),
whether ``explain()`` reports the layers as one template, and the largest difference of the
output from ``jax.jit``'s at the exact shape.  Before session 32 these layers stayed flat.
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

from benchmarks._report import write_json  # noqa: E402


def build(layers: int):
  import flax.linen as nn

  class Layer(nn.Module):
    scale: float

    @nn.compact
    def __call__(self, x, mask):
      h = nn.SelfAttention(num_heads=4)(nn.LayerNorm()(x), mask=mask)
      x = x + self.scale * h
      h = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))
      return x + self.scale * h

  class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, lengths):
      valid = jnp.arange(x.shape[1])[None] < lengths[:, None]
      mask = nn.make_attention_mask(valid, valid)
      for i in range(layers):
        x = Layer(scale=1.0 / np.sqrt(2.0 * (i + 1)))(x, mask)
      return jnp.sum(x * valid[..., None], 1)

  return Encoder()


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import dynjax.flax
  from dynjax.bucketing import _outline  # its config: the switch DYNJAX_OUTLINE sets

  config = _outline.config

  model = build(args.layers)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 100, 256)).astype(np.float32)
  lengths = np.asarray([100, 71, 40, 9], np.int32)
  params = model.init(jax.random.PRNGKey(0), x, lengths)
  want = np.asarray(jax.jit(model.apply)(params, x, lengths))
  rows: dict = {"on": [], "off": []}
  was = config.outline
  try:
    for r in range(args.rounds):
      for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
        config.outline = name == "on"
        f = dynjax.flax.jit(model, dims={"x": "b, t, 256", "lengths": "b"},
                            buckets={"t": [64, 128], "b": [4]})
        t0 = time.perf_counter()
        f.lower(params, x[:, :50], np.minimum(lengths, 50))
        t1 = time.perf_counter()
        f.lower(params, x, lengths)
        t2 = time.perf_counter()
        err = float(np.abs(np.asarray(f(params, x, lengths)) - want).max())
        rows[name].append({"first_s": t1 - t0, "second_s": t2 - t1, "error": err,
                           "one_template": "repeated" in f.explain()})
  finally:
    config.outline = was
  report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "layers": args.layers, "rows": rows}
  for name, rs in rows.items():
    print(f"outline {name:3s}: first bucket {np.median([r['first_s'] for r in rs]):.3f} s, "
          f"second {np.median([r['second_s'] for r in rs]):.3f} s (median of {len(rs)}), one "
          f"template {rs[0]['one_template']}, error vs jax.jit {max(r['error'] for r in rs):.1e}",
          flush=True)
  write_json(args.out, "probe_outline_constants.json", report)
  return report


if __name__ == "__main__":
  main()
