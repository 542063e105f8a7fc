"""Dispatch cost on a cache hit, side by side: jax.jit vs AOT Compiled vs dynjax, per input path.

  python benchmarks/bench_dispatch.py [--out DIR] [--iters N]

Prints a table (median us per call over 5 loops of N calls) and writes DIR/dispatch.json.
Rows: device-array input without sync (pure dispatch), numpy in -> numpy out (H2D + D2H), the
AOT ``Compiled`` object with numpy and with device inputs, an explicit ``device_put`` first, and
dynjax in "trust" and "auto" modes at the bucket shape and padded (13 -> 16).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import dynjax  # noqa: E402
from benchmarks._report import write_json  # noqa: E402
from benchmarks._suite import time_calls  # noqa: E402


def _tiny(x):
  return x * 2.0 + 1.0


def _time(fn, arg, iters: int, sync: bool) -> float:
  return time_calls(fn, arg, iters, sync, reduce=np.median)


def run(iters: int) -> dict:
  x13 = np.ones((8, 13), np.float32)
  x16 = np.ones((8, 16), np.float32)
  d16 = jnp.asarray(x16)
  jf = jax.jit(_tiny)
  comp = jax.jit(_tiny).lower(x16).compile()
  trust = dynjax.jit(_tiny, dims={"x": "b, t"}, padding="trust",
                     buckets={"b": [8], "t": dynjax.buckets.pow2(16, 64)})
  auto = dynjax.jit(_tiny, dims={"x": "b, t"}, padding="auto",
                    buckets={"b": [8], "t": dynjax.buckets.pow2(16, 64)})
  # A model-like call: 200 parameter leaves on the device plus one numpy (8, 13) batch.
  params = {f"layer{i}": {"kernel": jnp.asarray(np.ones((4, 4), np.float32)),
                          "bias": jnp.asarray(np.ones(4, np.float32))} for i in range(100)}

  def model(params, x):
    return x * params["layer0"]["bias"][0] + 1.0

  jm = jax.jit(model)
  dm = dynjax.jit(model, dims={"x": "b, t"}, padding="trust",
                  buckets={"b": [8], "t": dynjax.buckets.pow2(16, 64)})
  rows = {
      "jax.jit, device in, async": _time(jf, d16, iters, False),
      "Compiled, device in, async": _time(comp, d16, iters, False),
      "dynjax trust, device in (bucket shape), async": _time(trust, d16, iters, False),
      "dynjax auto, device in (bucket shape), async": _time(auto, d16, iters, False),
      "jax.jit, numpy (8,16) in, numpy out": _time(jf, x16, iters, True),
      "Compiled, numpy (8,16) in, numpy out": _time(comp, x16, iters, True),
      "Compiled, device_put then call, numpy out": _time(
          lambda a: comp(jax.device_put(a)), x16, iters, True),
      "jax.jit, numpy (8,13) in, numpy out": _time(jf, x13, iters, True),
      "dynjax trust, numpy (8,13)->16 in, numpy out": _time(trust, x13, iters, True),
      "dynjax auto, numpy (8,13)->16 in, numpy out": _time(auto, x13, iters, True),
      "jax.jit, 200 param leaves + numpy (8,13), numpy out": _time(
          lambda a: jm(params, a), x13, iters, True),
      "dynjax trust, 200 param leaves + numpy (8,13)->16": _time(
          lambda a: dm(params, a), x13, iters, True),
  }
  return {
      "us_per_call": rows,
      "iters": iters,
      "versions": {"python": platform.python_version(), "jax": jax.__version__,
                   "device": str(jax.devices()[0].device_kind)},
  }


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--out", default=None)
  ap.add_argument("--iters", type=int, default=2000)
  args = ap.parse_args(argv)
  res = run(args.iters)
  v = res["versions"]
  print(f"dispatch cost per call (median of 5 x {args.iters}), python {v['python']}, "
        f"jax {v['jax']}, {v['device']}")
  for k, us in res["us_per_call"].items():
    print(f"  {k:<52} {us:9.1f} us")
  write_json(args.out, "dispatch.json", res)


if __name__ == "__main__":
  main()
