"""The host cost of ``cast_once`` on a call: swapping the cast leaves for their copies.

  NCAST=4 python benchmarks/bench_cast_apply.py     # 12 of 200 leaves cast
  NCAST=50 python benchmarks/bench_cast_apply.py    # 150 of 200

A 50-layer MLP whose parameters are a plain dict of 200 float32 leaves; the first ``NCAST``
layers use their kernels only through a cast to bfloat16 (cast once), the others in float32.
Prints the microseconds of ``Applier.apply`` on a warm executor (every leaf a hit) and of a
whole call, and checks the result against ``jax.jit``.  For an A/B, run it with another
tree's dynjax first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dynjax  # noqa: E402
from dynjax.jit import _casts  # noqa: E402

_casts.MIN_BYTES = 0  # the leaves are small: cast them anyway
_casts.MIN_SAVED_SECONDS = 0.0
L = 50
NCAST = int(os.environ.get("NCAST", "50"))


def f(p, x):
  h = x.astype(jnp.bfloat16)
  for i in range(L):
    lay = p["params"][f"layer_{i}"]
    if i < NCAST:
      h = (jnp.tanh(h @ lay["kernel"].astype(jnp.bfloat16)) @ lay["w2"].astype(jnp.bfloat16)
           + lay["bias"].astype(jnp.bfloat16))
    else:
      h = (jnp.tanh(h.astype(jnp.float32) @ lay["kernel"]) @ lay["w2"]
           + lay["bias"]).astype(jnp.bfloat16)
    h = h * lay["scale"]  # a float32 use: never cast
  return h


def main() -> None:
  params = {"params": {f"layer_{i}": {"kernel": jnp.ones((16, 16)), "bias": jnp.ones((16,)),
                                       "scale": jnp.ones((16,)), "w2": jnp.ones((16, 16))}
                       for i in range(L)}}
  g = dynjax.jit(f, dims={"x": "b, 16"})
  x = np.ones((3, 16), np.float32)
  g(params, x)
  g(params, x)
  fam = next(iter(g._dispatcher.all_families.values()))
  ex = next(e for e in fam.executors.values() if e.top)
  args = [params, x]
  for _ in range(200):
    ex.casts.apply(args)
  n = 3000
  t0 = time.perf_counter()
  for _ in range(n):
    ex.casts.apply(args)
  apply_us = (time.perf_counter() - t0) / n * 1e6
  t0 = time.perf_counter()
  for _ in range(n):
    g(params, x)
  call_us = (time.perf_counter() - t0) / n * 1e6
  np.testing.assert_allclose(np.asarray(g(params, x), np.float32),
                             np.asarray(jax.jit(f)(params, x), np.float32), rtol=1e-2, atol=1e-2)
  print(f"dynjax {os.path.dirname(dynjax.__file__)}: {len(fam.casts)} of "
        f"{len(jax.tree.leaves(params))} leaves cast; apply {apply_us:.1f} us, call "
        f"{call_us:.1f} us", flush=True)


if __name__ == "__main__":
  main()
