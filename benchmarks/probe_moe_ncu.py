"""The grouped layer's GEMMs under Nsight Compute (issue 19): where their time goes.

  ncu --clock-control none --profile-from-start off --csv --page details \
      --section SpeedOfLight --section MemoryWorkloadAnalysis ... \
      python3 benchmarks/probe_moe_ncu.py --case gemm1:uniform64

One case a process.  The case is built, jitted and run twice untimed, then run once more
between ``cuProfilerStart``/``cuProfilerStop`` (the driver API, through ctypes), so that ncu
(``--profile-from-start off``) profiles only that call's kernels.  Cases:

  gemm1:<setting>, gemm2:<setting>  the hopper grouped GEMM of the layer (k=1, the layer's
                                    buffer, tiling and bounds; gemm1 with its fused GELU)
  dense1, dense2                    cuBLAS on the dense shapes of the same FLOPs
                                    ([N,d]x[d,f], [N,f]x[f,d])
  capacity1:<setting>               the dropping layer's first GEMM: every path's capacity
                                    (1.25 x the mean load) rows in one batched GEMM

``<setting>`` is as ``bench_moe_kernels.py``'s: uniform8, zipf8, uniform64, zipf64.  The figures
that matter are in ncu's output; ``--summarize`` prints them per kernel (``KEY``: duration,
DRAM and L2 throughput, L2 hit rate, the SMs' throughput, spills, occupancy).
``benchmarks/gpu_run_moe_ncu.sh`` runs every case in one device call.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks.bench_moe_kernels import Setting  # noqa: E402
from benchmarks.probe_moe_profile import grouped_gemm_inputs  # noqa: E402
from dynjax import route  # noqa: E402


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--case", help="the case to run (see the docstring)")
  p.add_argument("--summarize", nargs="+", metavar="CSV",
                 help="print the key figures of ncu --csv --page details output instead")
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--d", type=int, default=1024)
  p.add_argument("--ffn", type=int, default=4096)
  p.add_argument("--zipf", type=float, default=1.2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--rotate", type=int, default=1)
  return p.parse_args(argv)


def build(args):
  """(jitted function, its arguments, a line saying what it computes) for ``args.case``."""
  from dynjax.route import _gmm  # noqa: PLC0415

  kind, _, setting = args.case.partition(":")
  n, d, f = args.tokens, args.d, args.ffn
  key = jax.random.PRNGKey(11)
  if kind in ("dense1", "dense2"):
    k, m = (d, f) if kind == "dense1" else (f, d)
    x = jax.random.normal(key, (n, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (k, m)) / math.sqrt(k)).astype(
        jnp.bfloat16)
    return jax.jit(jnp.dot), (x, w), f"cuBLAS [{n},{k}]x[{k},{m}]"
  s = Setting(setting, 1, args)
  e = s.e
  if kind == "capacity1":
    cap = math.ceil(1.25 * n / e)
    x = jax.random.normal(key, (e, cap, d)).astype(jnp.bfloat16)
    return (jax.jit(lambda x, w: jnp.einsum("ecd,edf->ecf", x, w)), (x, s.params["w1"]),
            f"batched [{e},{cap},{d}]x[{e},{d},{f}]")
  t = route.Tiling.auto(n, e, "hopper")
  rows, fill, waves, (lay, *_), (gathered, *_) = grouped_gemm_inputs(s, n, t)
  if kind == "gemm1":
    lhs, w, act = gathered, s.params["w1"], jax.nn.gelu
  else:
    lhs = jax.random.normal(key, (rows, f)).astype(jnp.bfloat16)
    w, act = s.params["w2"], None
  sizes = lay.group_sizes
  tiles = int(jnp.sum((sizes + t.tm - 1) // t.tm))

  def fn(lhs, w, sizes):
    return _gmm.hopper_grouped(lhs, w, sizes, t, act, skip_unused=fill, wave_rows=waves)

  return (jax.jit(fn), (lhs, w, sizes),
          f"hopper {kind} {setting}: tiling {t}, buffer {rows} rows, {tiles} row tiles in use "
          f"({tiles * t.tm} rows), loads {sorted(map(int, sizes), reverse=True)[:6]}...")


# (label, ncu's metric name, its unit or None for any): the figures the summary prints per kernel
KEY = (("us", "Duration", None), ("DRAM %", "DRAM Throughput", "%"),
       ("L2 %", "L2 Cache Throughput", "%"), ("mem %", "Memory Throughput", "%"),
       ("L2 hit %", "L2 Hit Rate", "%"), ("SM %", "Compute (SM) Throughput", "%"),
       ("spills", "Local Memory Spilling Requests", None),
       ("occupancy %", "Achieved Occupancy", "%"), ("regs", "Registers Per Thread", None),
       ("smem B", "Dynamic Shared Memory Per Block", None), ("grid", "Grid Size", None))


def summarize(paths) -> list[dict]:
  """One row per profiled kernel of ncu's ``--csv --page details`` files: KEY's figures."""
  import csv  # noqa: PLC0415

  rows: dict = {}
  for path in paths:
    with open(path, newline="") as fh:
      lines = [ln for ln in fh if ln.startswith('"')]  # ncu's own log lines are not CSV
    for rec in csv.DictReader(lines):
      kid = (path, rec.get("ID"))
      row = rows.setdefault(kid, {"file": os.path.basename(path),
                                  "kernel": rec.get("Kernel Name", "")[:60]})
      for label, name, want in KEY:
        unit = rec.get("Metric Unit", "")
        if rec.get("Metric Name") == name and want in (None, unit):
          val = rec.get("Metric Value", "").replace(",", "")
          try:
            v = float(val)
            if name == "Duration":
              v *= {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
            row[label] = round(v, 2)
          except ValueError:
            row[label] = val
  out = list(rows.values())
  for r in out:
    print("  " + "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
  return out


def main(argv=None) -> None:
  args = _parse(argv)
  if args.summarize:
    summarize(args.summarize)
    return
  if not args.case:
    raise SystemExit("probe_moe_ncu: --case CASE (see the docstring) or --summarize CSV...")
  fn, fargs, what = build(args)
  for _ in range(2):
    jax.block_until_ready(fn(*fargs))
  cuda = ctypes.CDLL("libcuda.so.1")
  cuda.cuProfilerStart()
  jax.block_until_ready(fn(*fargs))
  cuda.cuProfilerStop()
  print(f"case {args.case}: {what}", flush=True)


if __name__ == "__main__":
  main()
