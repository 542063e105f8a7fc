"""Bucket policies replayed on the docstring request stream under a per-length cost curve (CPU).

  python benchmarks/sim_buckets.py [--cost 37:2.56,141:3.38,300:5.86,450:9.04] [--compile-s 2.5]
                                   [--calls 1000,10000,100000,1000000] [--noise 0.05] [--out FILE]
                                   [--time-replan]

No JAX work: the request lengths of ``examples.data.request_stream(1000, batch=8, max_len=512,
seed=0)`` (the longest docstring of each batch of 8) go through ``pow2(16, 512)``,
``auto(8, 16, 512)`` and the value-decided ``auto(None, 16, 512)`` as the dispatcher feeds them
(``observe``, ``bucket``, ``record_time`` of the bucket's cost with ``--noise`` relative noise,
``record_compile`` with ``--compile-s`` the first time a bucket is used).  Compiles are taken
as instant (the plan's quality, not the cold start).  The stream is cycled to each of
``--calls`` (a server that has answered that many requests).

The cost curve (ms per request at an exact length) defaults to the H100 figures of issue 18
(BERT-base encoder, batch 8, fp32: T=37 2.56, T=141 3.38, T=300 5.86, T=450 9.04), linearly
interpolated and extrapolated from the end segments.

Prints, per policy and traffic: buckets, compile seconds, and cost / exact-shape cost weighted
by the traffic, for the whole stream as served (``online``: each request on the bucket it got
then) and for the final table applied to the stream (``steady``), with the steady ratio per
length bin (<=64, 65-128, 129-256, 257-512).  ``--time-replan`` adds the measured replan time
(``policy.last_plan_seconds``) of auto at 64 candidates (max=512) and 512 candidates
(max=4096, budget 64).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import dynjax  # noqa: E402
from examples import data  # noqa: E402

H100_BERT_MS = "37:2.56,141:3.38,300:5.86,450:9.04"
BINS = ((1, 64), (65, 128), (129, 256), (257, 512))


def cost_curve(spec: str):
  """``"T:ms,T:ms,..."`` -> seconds per request at length T (linear, extrapolated)."""
  try:
    pts = sorted((float(t), float(ms)) for t, ms in (p.split(":") for p in spec.split(",")))
  except ValueError:
    raise SystemExit(f"--cost: expected 'T:ms,T:ms,...' (e.g. {H100_BERT_MS}), got {spec!r}; "
                     "give at least two points") from None
  if len(pts) < 2:
    raise SystemExit(f"--cost: expected at least two 'T:ms' points, got {spec!r}")
  t, ms = np.array(pts).T

  def cost(n):
    n = np.asarray(n, float)
    lo = ms[0] + (n - t[0]) * (ms[1] - ms[0]) / (t[1] - t[0])
    hi = ms[-1] + (n - t[-1]) * (ms[-1] - ms[-2]) / (t[-1] - t[-2])
    mid = np.interp(n, t, ms)
    out = np.where(n < t[0], lo, np.where(n > t[-1], hi, mid))
    return np.maximum(out, 1e-3) * 1e-3
  return cost


def policies() -> dict:
  return {"pow2(16,512)": dynjax.buckets.pow2(16, 512),
          "auto(8)": dynjax.buckets.auto(8, 16, 512),
          "auto(12)": dynjax.buckets.auto(12, 16, 512),
          "auto(16)": dynjax.buckets.auto(16, 16, 512),
          "auto(None)": dynjax.buckets.auto(None, 16, 512)}


def replay(policy, lengths, cost, compile_s: float, noise: float, rng) -> dict:
  served, built, per_bucket = [], set(), {}
  jitter = 1.0 + noise * rng.standard_normal(len(lengths))
  for n, e in zip(lengths, jitter.tolist(), strict=True):
    policy.observe(n)
    b = policy.bucket(n)
    if b not in built:
      built.add(b)
      per_bucket[b] = float(cost(b))
      policy.record_compile(b, compile_s)
    served.append(b)
    policy.record_time(b, per_bucket[b] * e)
  lengths = np.asarray(lengths)
  exact = cost(lengths)
  table = np.array(policy.sizes())
  steady_b = table[np.searchsorted(table, lengths)]
  steady = cost(steady_b)
  out = {"buckets": len(table), "table": [int(b) for b in table], "compiled": len(built),
         "compile_seconds": round(len(built) * compile_s, 1),
         "online_ratio": round(float(cost(np.array(served)).sum() / exact.sum()), 4),
         "steady_ratio": round(float(steady.sum() / exact.sum()), 4),
         "steady_ms_per_request": round(float(steady.mean() * 1e3), 3),
         "exact_ms_per_request": round(float(exact.mean() * 1e3), 3), "bins": {}}
  for lo, hi in BINS:
    m = (lengths >= lo) & (lengths <= hi)
    key = f"{lo}-{hi}" if lo > 1 else f"<={hi}"
    out["bins"][key] = {"requests": int(m.sum()),
                        "ratio": round(float(steady[m].sum() / exact[m].sum()), 4) if m.any()
                        else None}
  return out


def time_replan() -> dict:
  """Replan seconds (``last_plan_seconds``, best of the later replans) at 64 and 512 candidates."""
  rng = np.random.default_rng(0)
  out = {}
  for label, k, hi in (("64 candidates, max_compiles=8", 8, 512),
                       ("64 candidates, max_compiles=None", None, 512),
                       ("512 candidates, max_compiles=64", 64, 4096),
                       ("512 candidates, max_compiles=None", None, 4096)):
    p = dynjax.buckets.auto(k, 1, hi)
    for b in (hi // 8, hi // 4, hi // 2, hi):  # a quadratic cost: fixed part + T + T^2
      for _ in range(2):
        p.record_time(b, 2e-3 + 4e-6 * b + 2.4e-8 * b * b)
    p.record_compile(hi, 2.5)
    times = []
    for n in rng.integers(1, hi + 1, 1 << 15):
      before = p.replans, p.last_plan_seconds
      p.observe(int(n))
      if p.last_plan_seconds != before[1]:
        times.append(p.last_plan_seconds)
    out[label] = {"replan_ms_last": round(times[-1] * 1e3, 3),
                  "replan_ms_median": round(float(np.median(times[-4:])) * 1e3, 3),
                  "buckets": len(p.sizes())}
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--cost", default=H100_BERT_MS, help="T:ms points of the exact-length cost")
  ap.add_argument("--compile-s", type=float, default=2.5, help="seconds a bucket compile takes")
  ap.add_argument("--calls", default="1000,10000,100000,1000000", help="traffic sizes (the stream cycled)")
  ap.add_argument("--noise", type=float, default=0.05, help="relative noise of measured times")
  ap.add_argument("--out", default=None, help="JSON file (or directory: sim_buckets.json)")
  ap.add_argument("--time-replan", action="store_true", help="also time auto's replans")
  args = ap.parse_args(argv)
  cost = cost_curve(args.cost)
  base = [r.length for r in data.request_stream(1000, batch=8, max_len=512, seed=0)]
  result = {"cost_ms": args.cost, "compile_s": args.compile_s, "noise": args.noise,
            "mean_length": round(float(np.mean(base)), 1), "python": platform.python_version(),
            "runs": {}}
  print(f"stream: {len(base)} requests, mean length {np.mean(base):.1f}; cost {args.cost} ms; "
        f"compile {args.compile_s} s")
  for calls in (int(c) for c in args.calls.split(",")):
    lengths = (base * (calls // len(base) + 1))[:calls]
    print(f"\n{calls} calls   buckets  compiled  online  steady  <=64    65-128  129-256 257-512")
    runs = {}
    for name, pol in policies().items():
      rng = np.random.default_rng(1)
      t0 = time.perf_counter()
      r = replay(pol, lengths, cost, args.compile_s, args.noise, rng)
      r["sim_seconds"] = round(time.perf_counter() - t0, 2)
      runs[name] = r
      bins = "  ".join(f"{v['ratio']:.3f}" if v["ratio"] else "  -  " for v in r["bins"].values())
      print(f"  {name:12s} {r['buckets']:4d} {r['compiled']:8d}    {r['online_ratio']:.3f}   "
            f"{r['steady_ratio']:.3f}   {bins}")
      print(f"  {'':12s} table {r['table']}")
    result["runs"][str(calls)] = runs
  if args.time_replan:
    result["replan"] = time_replan()
    print("\nreplan time (2-core CPU box when run there):")
    for k, v in result["replan"].items():
      print(f"  {k}: last {v['replan_ms_last']} ms, median of last 4 {v['replan_ms_median']} ms, "
            f"{v['buckets']} buckets")
  if args.out:
    path = os.path.join(args.out, "sim_buckets.json") if os.path.isdir(args.out) else args.out
    with open(path, "w") as fh:
      json.dump(result, fh, indent=1)
    print(f"\nwrote {path}")
  return result


if __name__ == "__main__":
  main()
