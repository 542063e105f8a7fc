"""An NNX model served under ``dynjax.flax.nnx_jit`` with numpy requests: per-call time and
where the model's parameters live afterwards.

  python benchmarks/bench_nnx_state.py --out $OUT        (run it from each tree to compare)

The model: ``--layers`` NNX ``Linear(d, d)`` with float32 parameters and bfloat16 compute
(``dtype=jnp.bfloat16``), ReLU between, a sum over tokens; batches of 8 x 20-120 tokens
(numpy in, numpy out).  Before session 9 every numpy request turned the model's parameters
into numpy copies (the wrapper returns the state; host requests got numpy outputs) that the
next call uploaded again; now they stay the caller's own device arrays and are cast to
bfloat16 once (``cast_once``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH

from benchmarks._report import write_json  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--d", type=int, default=2048)
  ap.add_argument("--calls", type=int, default=100)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import dynjax
  import dynjax.flax

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(args.d, args.d, dtype=jnp.bfloat16, rngs=rngs)
                              for _ in range(args.layers)])

    def __call__(self, x):
      for layer in self.layers:
        x = jax.nn.relu(layer(x))
      return x.astype(jnp.float32).sum(1)

  model = Net(nnx.Rngs(0))
  f = dynjax.flax.nnx_jit(Net.__call__, dims={"x": f"b, t, {args.d}"},
                          buckets={"t": dynjax.buckets.pow2(16, 128)})
  rng = np.random.RandomState(0)
  xs = [rng.randn(8, t, args.d).astype(np.float32) for t in (20, 50, 90, 120)]
  for x in xs:  # every bucket compiled
    f(model, x)
  ts = []
  for i in range(args.calls):
    t0 = time.perf_counter()
    f(model, xs[i % len(xs)])
    ts.append(time.perf_counter() - t0)
  ts = np.asarray(ts) * 1e3
  kernel = model.layers[0].kernel[...]
  st = f.stats()
  rec = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
         "params_mb": args.layers * args.d * args.d * 4 / 2 ** 20,
         "median_ms": float(np.median(ts)), "mean_ms": float(ts.mean()),
         "params_after": type(kernel).__name__, "cast_once": st.get("cast_once"),
         "dynjax": os.path.dirname(dynjax.__file__)}
  print(json.dumps(rec), flush=True)
  write_json(args.out, "bench_nnx_state.json", rec)
  return rec


if __name__ == "__main__":
  main()
