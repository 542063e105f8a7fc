"""``dynjax.route.ragged_dot`` against ``jax.lax.ragged_dot`` alone: values, which kernel the
optimized HLO holds, the time of one call, and of its value and gradients (packed rows sorted
by expert, as public MoE code has them).  Medians of 50 calls, milliseconds.

  python benchmarks/probe_ragged_dot.py [--rows 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402
from benchmarks.bench_moe_gmm import timeit  # noqa: E402


def _median_ms(fn, *args, n=50) -> float:
  return timeit([functools.partial(fn, *args)], n)["median_ms"]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rows", default="1024,4096,8192")
  ap.add_argument("--k", type=int, default=1024)
  ap.add_argument("--n", type=int, default=4096)
  ap.add_argument("--groups", type=int, default=8)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  from dynjax import route

  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "dtype": jnp.dtype(dtype).name, "rows": {}}
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(args.groups, args.k, args.n)) / args.k ** 0.5, dtype)
  for m in map(int, args.rows.split(",")):
    x = jnp.asarray(rng.normal(size=(m, args.k)), dtype)
    p = rng.dirichlet(np.ones(args.groups))
    sizes = jnp.asarray(np.bincount(rng.choice(args.groups, m, p=p), minlength=args.groups),
                        jnp.int32)
    ours, plain = jax.jit(route.ragged_dot), jax.jit(jax.lax.ragged_dot)
    a, b = np.asarray(ours(x, w, sizes), np.float32), np.asarray(plain(x, w, sizes), np.float32)
    hlo = ours.lower(x, w, sizes).compile().as_text()
    rec = {"sizes": np.asarray(sizes).tolist(),
           "max_abs_diff": float(np.abs(a - b).max()), "max_abs": float(np.abs(b).max()),
           "mosaic_gpu_custom_calls": hlo.count("mosaic_gpu"),
           "route_ms": _median_ms(ours, x, w, sizes),
           "lax_ms": _median_ms(plain, x, w, sizes)}
    # a training step's dot: loss and gradients in lhs and rhs (the kernel's backward)
    ct = jnp.asarray(rng.normal(size=(m, args.n)), jnp.float32)
    grads = {}
    for name, dot in (("route", route.ragged_dot), ("lax", jax.lax.ragged_dot)):
      step = jax.jit(jax.value_and_grad(
          lambda x, w, dot=dot, s=sizes, c=ct: jnp.sum(dot(x, w, s).astype(jnp.float32) * c),
          (0, 1)))
      grads[name] = step(x, w)[1]
      rec[f"{name}_grad_ms"] = _median_ms(step, x, w)
    rec["grad_max_rel_diff"] = float(max(
        np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
        / max(np.abs(np.asarray(b, np.float32)).max(), 1e-30)
        for a, b in zip(grads["route"], grads["lax"], strict=True)))
    print(f"  M={m:6d} value+grads: route {rec['route_grad_ms']:7.3f} ms  lax.ragged_dot "
          f"{rec['lax_grad_ms']:7.3f} ms  max rel diff {rec['grad_max_rel_diff']:.2e}",
          flush=True)
    out["rows"][str(m)] = rec
    print(f"  M={m:6d} route {rec['route_ms']:7.3f} ms  lax.ragged_dot {rec['lax_ms']:7.3f} ms"
          f"  max |diff| {rec['max_abs_diff']:.2e} of {rec['max_abs']:.2e}  mosaic_gpu in HLO "
          f"{rec['mosaic_gpu_custom_calls']}", flush=True)
  write_json(args.out, "probe_ragged_dot.json", out)
  return out


if __name__ == "__main__":
  main()
