"""Where a warm numpy request's host time goes under dynjax, against the same bucket executable
called directly (issue 18/19: the per-request overhead above the bucket's AOT executable).

  python benchmarks/probe_hit_profile.py [--out DIR] [--calls 3000]

A masked ``tanh(x @ w)`` block, numpy (8, t, 256) in and out, padding="trust", one bucket
(8, 128).  Rows: ``exe`` the bucket's own executable (dynjax's, so pinned host outputs where
dynjax uses them) on a pre-padded numpy input + ``np.asarray`` + slice; ``exe_pad`` the same
with the padding copy each call; ``dynjax`` the wrapped function; each the median of
``--calls`` calls, microseconds, alternating blocks of 200.  Then cProfile of the dynjax calls:
the functions by own time per call.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dynjax

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402


def block(w, x, lens):
  m = (jnp.arange(x.shape[1])[None] < lens[:, None])[..., None]
  return jnp.tanh(x @ w) * m


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--calls", type=int, default=3000)
  ap.add_argument("--t", type=int, default=100)
  args = ap.parse_args(argv)
  rng = np.random.default_rng(0)
  w = jax.device_put((rng.standard_normal((256, 256)) * 0.05).astype(np.float32))
  t = args.t
  x = rng.standard_normal((8, t, 256)).astype(np.float32)
  lens = np.full(8, t, np.int32)
  f = dynjax.jit(block, dims={"x": "b, t, 256", "lens": "b"},
                 buckets={"b": [8], "t": [128]}, padding="trust")
  want = np.asarray(jax.jit(block)(w, x, lens))
  np.testing.assert_allclose(f(w, x, lens), want, rtol=1e-5, atol=1e-5)
  fam = next(iter(f._dispatcher.families.values()))
  ex = next(iter(fam.executors.values()))
  exe = ex.exe
  xp = np.zeros((8, 128, 256), np.float32)
  xp[:, :t] = x

  def direct():
    return np.asarray(exe(w, xp, lens)[0])[:, :t]

  def direct_pad():
    buf = np.zeros((8, 128, 256), np.float32)
    buf[:, :t] = x
    return np.asarray(exe(w, buf, lens)[0])[:, :t]

  def wrapped():
    return f(w, x, lens)

  fns = {"exe": direct, "exe_pad": direct_pad, "dynjax": wrapped}
  for fn in fns.values():
    for _ in range(50):
      fn()
  ts = {k: [] for k in fns}
  for _ in range(max(1, args.calls // 200)):
    for k, fn in fns.items():
      for _ in range(200):
        t0 = time.perf_counter()
        fn()
        ts[k].append(time.perf_counter() - t0)
  res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "t": t,
         "host_out": bool(ex.entry.host_out) if hasattr(ex, "entry") else None,
         "median_us": {k: float(np.median(v)) * 1e6 for k, v in ts.items()},
         "p10_us": {k: float(np.percentile(v, 10)) * 1e6 for k, v in ts.items()}}
  prof = cProfile.Profile()
  n = args.calls
  prof.enable()
  for _ in range(n):
    wrapped()
  prof.disable()
  st = pstats.Stats(prof)
  rows = []
  for (file, line, name), (_, ncalls, tottime, cumtime, _) in st.stats.items():
    rows.append((tottime / n * 1e6, cumtime / n * 1e6, ncalls / n,
                 f"{os.path.basename(file)}:{line}({name})"))
  rows.sort(reverse=True)
  res["profile_top"] = [{"own_us": round(a, 2), "cum_us": round(b, 2), "calls": round(c, 2),
                         "where": d} for a, b, c, d in rows[:30]]
  print(json.dumps({k: v for k, v in res.items() if k != "profile_top"}, indent=1))
  for r in res["profile_top"]:
    print(f"  {r['own_us']:8.2f} own {r['cum_us']:8.2f} cum  x{r['calls']:.1f}  {r['where']}")
  write_json(args.out, "probe_hit_profile.json", res)
  return res


if __name__ == "__main__":
  main()
