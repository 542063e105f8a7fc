"""Where issue 19's e2e MoE encoder spends its builds: per length bucket, ``jax.jit`` of the
model's ``apply`` traced, lowered and compiled AOT (what a ``padding="trust"`` bucket build
does), for the grouped layer (dynjax.route, hopper kernel) and for ``lax.ragged_dot``.

  python benchmarks/probe_moe_build.py [--variants grouped,ragged_dot] [--out DIR] [--small]

Each variant in a fresh process (no shared jax caches), buckets t = 64, 128, 256, 512 (batch 8)
in that order: seconds of trace, lower (StableHLO, the GPU kernels' export included) and XLA
compile, the first run, and the steady time a call (the lowest of 5 bursts of 50 calls with one
block each; a checksum of the output beside it).  Options of the grouped layer after ``-``,
joined by ``.``: ``noahead``, its kernels not compiled ahead on a background thread
(``route._once.PRECOMPILE_ON``); ``scan``, each row tile's group found by a searchsorted scan
(``route._gmm.TILE_GROUP_SEARCH``, before session 18).  Writes DIR/probe_moe_build.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _isolated  # noqa: E402
from benchmarks._report import write_json  # noqa: E402

STEADY_CALLS = 50


def child(variants: str, small: bool) -> list:
  """Each of ``variants`` (``+``-separated) built in this one process, in order."""
  return [_build(v, small) for v in variants.split("+")]


def _build(variant: str, small: bool) -> dict:
  """``variant``: ``none``, ``grouped``, ``ragged_dot`` or ``dense``; the grouped layer's
  options after ``-`` (the module docstring), e.g. ``grouped-noahead.scan``."""
  t00 = time.perf_counter()
  label = variant
  variant, _, opt = variant.partition("-")
  if opt and variant != "grouped":
    raise SystemExit(f"--variants: options are for the grouped layer, not {label!r}")
  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import bench_moe_gmm as bm

  from dynjax import route
  from dynjax.route import _gmm, _once

  for o in filter(None, opt.split(".")):
    if o == "noahead":
      _once.PRECOMPILE_ON = ()
    elif o == "scan":  # each row tile's group by a searchsorted scan (before session 18)
      _gmm.TILE_GROUP_SEARCH = "scan"
    else:
      raise SystemExit(f"--variants: unknown option {o!r} in {label!r} "
                       f"(noahead, scan; joined by '.')")

  cfg = dict(vocab=30522, d=1024, heads=16, ffn=4096, experts=8, k=2, max_len=512, batch=8)
  ts = (64, 128, 256, 512)
  if small:
    cfg.update(vocab=512, d=128, heads=4, ffn=256, max_len=128)
    ts = (32, 64)
  on_gpu = jax.default_backend() != "cpu"
  routed = route.Routed(route.Experts(route.ffn()),
                        route.Router(cfg["experts"], k=cfg["k"], renormalize=True),
                        mode="grouped", kernel="auto" if on_gpu else "xla")
  model = bm.build_flax_model(cfg, variant, routed if variant == "grouped" else None)
  tok = np.ones((cfg["batch"], ts[0]), np.int32)
  lens = np.full(cfg["batch"], ts[0], np.int32)
  variables = jax.jit(bm.build_flax_model(cfg, "dense", None).init)(
      jax.random.PRNGKey(0), jnp.asarray(tok), jnp.asarray(lens))
  v16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 else x, variables)
  out = {"variant": label, "imports_s": time.perf_counter() - t00, "buckets": {},
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
  for t in ts:
    tok = np.ones((cfg["batch"], t), np.int32)
    lens = np.full(cfg["batch"], t, np.int32)
    fn = jax.jit(model.apply)
    t0 = time.perf_counter()
    traced = fn.trace(v16, tok, lens)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    exe = lowered.compile()
    t3 = time.perf_counter()
    y = jax.block_until_ready(exe(v16, tok, lens))
    t4 = time.perf_counter()
    # Steady: a burst of calls with one block at the end, per call (the GPU's time when the
    # host launches ahead), the lowest of 5 bursts.
    call = functools.partial(exe, v16, tok, lens)
    burst = bm.timeit([lambda call=call: [call() for _ in range(STEADY_CALLS)]], 5)
    steady_us = burst["min_ms"] / STEADY_CALLS * 1e3
    out["buckets"][t] = {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
                         "first_run_s": t4 - t3, "steady_us": steady_us,
                         "checksum": float(np.asarray(y, np.float32).sum())}
    print(f"  {label:16s} t={t:4d} trace {t1 - t0:6.2f} s  lower {t2 - t1:6.2f}  compile "
          f"{t3 - t2:6.2f}  first run {t4 - t3:6.3f}  steady {steady_us:7.1f} us", flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--variants", default="grouped,ragged_dot,grouped,ragged_dot",
                  help="one process each; a+b+c: a, b and c built in one process, in order "
                       "(none: the model without experts)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--xla_flags", default="", help="added to XLA_FLAGS of every process")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    _isolated.emit(child(args.child, args.small))
    return {}
  known = {"none", "grouped", "ragged_dot", "dense"}
  bad = {x for v in args.variants.split(",") for x in v.split("+")
         if x.partition("-")[0] not in known}
  if bad:
    raise SystemExit(f"--variants: unknown {sorted(bad)}; known: {sorted(known)}")
  report = {"runs": []}
  for v in args.variants.split(","):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", v] + (
        ["--small"] if args.small else [])
    got = _isolated.run(cmd, _isolated.env_with_xla_flags(args.xla_flags), 300)
    for r in (got if isinstance(got, list) else [dict(got, variant=v)]):
      r["process"] = v
      report["runs"].append(r)
  for r in report["runs"]:
    if "buckets" in r:
      b = r["buckets"].values()
      print(f"[{r['process']}] {r['variant']:16s} imports {r['imports_s']:.1f} s  trace {sum(x['trace_s'] for x in b):.2f}"
            f"  lower {sum(x['lower_s'] for x in b):.2f}  compile "
            f"{sum(x['compile_s'] for x in b):.2f}  first runs "
            f"{sum(x['first_run_s'] for x in b):.2f}", flush=True)
  write_json(args.out, "probe_moe_build.json", report)
  return report


if __name__ == "__main__":
  main()
