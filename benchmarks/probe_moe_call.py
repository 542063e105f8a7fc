"""Where one request of issue 19's e2e MoE encoder spends its time on the host, call path by
call path: the same model and request through ``jax.jit`` and through ``dynjax.flax.jit``.

  python benchmarks/probe_moe_call.py [--out DIR] [--t 128,256,512] [--models none,grouped,dense]
  python benchmarks/probe_moe_call.py --small --out /tmp/p      # CPU smoke run

For each model (``bench_moe_gmm.build_flax_model``: ``none`` the block without experts,
``grouped`` the routed layer, ``dense``) and each request length t (batch 8, the bucket's own
size: no padding), rows, median us of ``--n`` calls taking turns (the row order turned every
round): ``jit_device`` ``jax.jit(model.apply)`` on bfloat16 weights, tokens and lengths
already on the device, blocked (the floor); ``jit_numpy`` the same with numpy tokens and
lengths in and ``np.asarray`` of the result; ``dynjax`` the e2e's call (float32 params cast once,
numpy in and out, the driver's copies of the inputs on a GPU); ``dynjax_jax_put`` the same
with JAX's own input transfers; ``dynjax_device`` device tokens and lengths, blocked.
``--trace``: a ``jax.profiler`` trace of ``--iters`` ``dynjax`` calls, the median call's host
time before its first kernel and after its last (``probe_moe_profile.call_timeline``).
Writes DIR/probe_moe_call.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import dynjax  # noqa: E402
from benchmarks import bench_moe_gmm as bm  # noqa: E402
from benchmarks import probe_moe_profile as pmp  # noqa: E402
from benchmarks._report import write_json  # noqa: E402
from dynjax import route  # noqa: E402

ROWS = ("jit_device", "jit_numpy", "dynjax", "dynjax_jax_put", "dynjax_device")


def _median_us(ts) -> float:
  return float(np.median(ts) * 1e6)


class Case(NamedTuple):
  """One request of the e2e encoder ``name`` at length t and its ways to be called."""

  tok: np.ndarray
  lens: np.ndarray
  dt: jax.Array  # tokens and lengths on the device
  dl: jax.Array
  variables: dict  # float32 params (the e2e's)
  v16: dict  # bfloat16 weights on the device (jax.jit's rows)
  jf: Callable  # jax.jit(model.apply)
  fn: Callable  # the e2e's dynjax.flax.jit call


def encoder_case(name: str, cfg: dict, t: int, seed: int) -> Case:
  rng = np.random.RandomState(seed)
  tok = rng.randint(1, cfg["vocab"], (cfg["batch"], t)).astype(np.int32)
  lens = rng.randint(t // 2 + 1, t + 1, cfg["batch"]).astype(np.int32)
  gpu = jax.default_backend() == "gpu"
  routed = (route.Routed(route.Experts(route.ffn()),
                         route.Router(cfg["experts"], k=cfg["k"], renormalize=True),
                         mode="grouped", kernel="auto" if gpu else "xla")
            if name == "grouped" else None)
  model = bm.build_flax_model(cfg, name, routed)
  variables = jax.jit(bm.build_flax_model(cfg, "dense", None).init)(
      jax.random.PRNGKey(0), jnp.asarray(tok), jnp.asarray(lens))
  v16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 else x, variables)
  fn = dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"},
                       buckets={"t": dynjax.buckets.pow2(min=16, max=cfg["max_len"]),
                                "b": dynjax.buckets.explicit([cfg["batch"]])},
                       padding="trust", cast_once=True)
  return Case(tok, lens, jnp.asarray(tok), jnp.asarray(lens), variables, v16,
              jax.jit(model.apply), fn)


def take_turns(calls: dict, n: int, rounds: int) -> dict:
  """Seconds of each call, the calls taking turns (``n`` each over ``rounds`` rounds, the
  order turned every round)."""
  ts = {row: [] for row in calls}
  names = list(calls)
  for r in range(rounds):
    order = names if r % 2 == 0 else names[::-1]
    for _ in range(n // rounds):
      for row in order:
        t0 = time.perf_counter()
        calls[row]()
        ts[row].append(time.perf_counter() - t0)
  return ts


def one_model(name: str, cfg: dict, t: int, args) -> dict:
  c = encoder_case(name, cfg, t, args.seed)
  tok, lens, dt, dl, variables, v16, jf, fn = c
  put = bm.jax_put(fn)
  calls = {"jit_device": lambda: jax.block_until_ready(jf(v16, dt, dl)),
           "jit_numpy": lambda: np.asarray(jf(v16, tok, lens)),
           "dynjax": lambda: np.asarray(fn(variables, tok, lens)),
           "dynjax_jax_put": lambda: np.asarray(put(variables, tok, lens)),
           "dynjax_device": lambda: jax.block_until_ready(fn(variables, dt, dl))}
  ref = np.asarray(jf(v16, dt, dl), np.float32)
  out: dict = {"max_abs_diff": {}}
  for row, call in calls.items():  # compile + warm, and each path's result against jax.jit's
    for _ in range(3):
      got = call()
    out["max_abs_diff"][row] = float(np.max(np.abs(np.asarray(got, np.float32) - ref)))
  ts = take_turns(calls, args.n, args.rounds)
  out["median_us"] = {row: _median_us(v) for row, v in ts.items()}
  out["stats"] = {k: v for k, v in fn.stats().items() if isinstance(v, int | float | str)}
  if args.trace:
    log_dir = tempfile.mkdtemp(prefix="moe_call_")
    with jax.profiler.trace(log_dir):
      for i in range(args.iters):
        with jax.profiler.TraceAnnotation(f"probe_call_{i}"):
          calls["dynjax"]()
    out["dynjax_trace"] = pmp.call_timeline(pmp.trace_events(log_dir))
  line = "  ".join(f"{row} {us:7.1f}" for row, us in out["median_us"].items())
  print(f"  {name:8s} t={t:4d}  {line}  (us)", flush=True)
  tr = out.get("dynjax_trace")
  if tr:
    print(f"      dynjax traced: call {tr['call_us']:.1f} us, first kernel after "
          f"{tr['to_first_kernel_us']:.1f}, host returns {tr['after_last_kernel_us']:.1f} after "
          f"the last", flush=True)
    for nm, us in tr["host_before_first_kernel"][:8]:
      print(f"        host {us:8.1f} us  {nm[:100]}", flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--t", default="128,256,512")
  ap.add_argument("--models", default="none,grouped,dense")
  ap.add_argument("--n", type=int, default=400, help="calls a row (over all rounds)")
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--trace", action="store_true")
  ap.add_argument("--iters", type=int, default=20, help="--trace: calls traced")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  cfg = dict(vocab=30522, d=1024, heads=16, ffn=4096, experts=8, k=2, max_len=512, batch=8)
  if args.small:
    cfg.update(vocab=512, d=32, heads=2, ffn=64, max_len=64)
  dev = jax.devices()[0]
  report = {"device": dev.device_kind, "jax": jax.__version__, "setting": cfg, "rows": ROWS,
            "results": {}}
  print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
  for t in (int(x) for x in args.t.split(",")):
    for name in args.models.split(","):
      if name not in ("none", "grouped", "dense"):
        raise SystemExit(f"--models: unknown {name!r} (none, grouped, dense)")
      report["results"].setdefault(str(t), {})[name] = one_model(name, cfg, t, args)
      write_json(args.out, "probe_moe_call.json", report)
  return report


if __name__ == "__main__":
  main()
