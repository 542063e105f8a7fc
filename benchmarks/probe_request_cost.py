"""Where one served request's milliseconds go: issue 19's e2e MoE encoder, layer by layer of
the call stack, under several XLA flag sets (each in a fresh process).

  python benchmarks/probe_request_cost.py --out DIR [--small] [--flags default,nocb,cball]

For each model (``none``: the block without experts; ``grouped``: dynjax.route's dropless
grouped GEMM; ``dense``: every expert on every token) and each length bucket t (batch 8), the
padded function under plain ``jax.jit`` (weights already bf16 on the device, as cast_once
leaves them), compiled AOT, timed as:

  pipelined   N calls back to back, one block at the end: the GPU's own time per call when the
              host launches faster than the GPU runs (a lower bound of the request's cost)
  sync        device inputs, block after each call: launches + GPU + one sync
  numpy       numpy tokens/lengths in, ``np.asarray`` out (what a server does): + transfers
  dynjax      ``dynjax.flax.jit`` on an unpadded request of that bucket (numpy in/out): +
              dynjax's host work (bucket choice, padding, cast-once lookup, unpadding)

plus the number of kernels (thunks) in the optimized HLO's entry computation, and the mean
over the e2e's request stream under dynjax for each model.  Flag sets (``XLA_FLAGS``, one
process each): ``default``; ``nocb`` command buffers (CUDA graphs) off; ``cball`` command
buffers for every op type XLA can put in one, from 1 op up.  Writes DIR/probe_request_cost.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _isolated  # noqa: E402
from benchmarks import _xla_options as xla_options  # noqa: E402
from benchmarks._report import median_ms, write_json  # noqa: E402

FLAGS = {"default": "", **{name: xla_options.as_flags(xla_options.OPTION_SETS[name])
                           for name in ("nocb", "cball")}}


def count_kernels(text: str) -> dict:
  """Thunk-like instructions of the optimized HLO's ENTRY computation, by kind."""
  entry = text[text.find("ENTRY"):]
  entry = entry[:entry.find("\n}")]
  kinds = {}
  for line in entry.splitlines()[1:]:
    if " = " not in line:
      continue
    rhs = line.split(" = ", 1)[1]
    m = re.search(r"(?:^|[\s})\]])([a-z][\w.-]*)\(", rhs)
    op = m.group(1) if m else "?"
    if op in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
      continue
    kinds[op] = kinds.get(op, 0) + 1
  return kinds


def child(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import bench_moe_gmm as bm

  import dynjax
  import dynjax.flax
  from dynjax import route

  cfg = dict(vocab=30522, d=1024, heads=16, ffn=4096, experts=8, k=2, max_len=512, batch=8,
             requests=args.requests)
  ts = (64, 128, 256, 512)
  if args.small:
    cfg.update(vocab=512, d=128, heads=4, ffn=256, max_len=128)
    ts = (32, 128)
  stream = bm.request_stream(cfg["requests"], cfg["batch"], cfg["max_len"], cfg["vocab"], 0)
  on_gpu = jax.default_backend() != "cpu"
  routed = route.Routed(route.Experts(route.ffn()),
                        route.Router(cfg["experts"], k=cfg["k"], renormalize=True),
                        mode="grouped", kernel="auto" if on_gpu else "xla")
  models = {m: bm.build_flax_model(cfg, m, routed if m == "grouped" else None)
            for m in args.models.split(",")}
  tok0, len0 = stream[0]
  variables = jax.jit(models["none"].init if "none" in models else bm.build_flax_model(
      cfg, "dense", None).init)(jax.random.PRNGKey(0), jnp.asarray(tok0), jnp.asarray(len0))
  # the weights as cast_once leaves them: every float32 array of >= 2 dims in bf16, but the
  # router's gate (a float32 Dense)
  def cast(path, x):
    keep = any("gate" in str(p) for p in path) or x.ndim < 2
    return x if keep else x.astype(jnp.bfloat16)
  v16 = jax.tree_util.tree_map_with_path(cast, variables)
  pol = dynjax.buckets.pow2(min=16, max=cfg["max_len"])
  out = {"flags": os.environ.get("XLA_FLAGS", ""), "device": jax.devices()[0].device_kind,
         "models": {}}
  rng = np.random.default_rng(1)
  for name, model in models.items():
    res = out["models"][name] = {"buckets": {}}
    apply = jax.jit(model.apply)
    for t in ts:
      tok = rng.integers(1, cfg["vocab"], (cfg["batch"], t)).astype(np.int32)
      lens = rng.integers(t // 2 + 1, t + 1, cfg["batch"]).astype(np.int32)
      lens[0] = t
      exe = apply.lower(v16, tok, lens).compile()
      dtok, dlens = jax.device_put(tok), jax.device_put(lens)
      for _ in range(5):
        jax.block_until_ready(exe(v16, dtok, dlens))
      n = args.iters
      t0 = time.perf_counter()
      for _ in range(n):
        y = exe(v16, dtok, dlens)
      jax.block_until_ready(y)
      piped = (time.perf_counter() - t0) / n
      sync = 1e3 * median_ms(lambda e=exe, a=dtok, b=dlens: jax.block_until_ready(e(v16, a, b)), n)
      nump = 1e3 * median_ms(lambda e=exe, a=tok, b=lens: np.asarray(e(v16, a, b)), n)
      res["buckets"][t] = {"pipelined_us": piped * 1e6, "sync_us": sync, "numpy_us": nump,
                           "kernels": count_kernels(exe.as_text())}
      print(f"  {name:8s} t={t:4d} pipelined {piped * 1e6:8.1f} us  sync {sync:8.1f}  numpy "
            f"{nump:8.1f}  kernels {sum(res['buckets'][t]['kernels'].values())}", flush=True)
    fn = dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"},
                         buckets={"t": pol, "b": dynjax.buckets.explicit([cfg["batch"]])},
                         padding="trust")
    for tok, lens in stream:
      np.asarray(fn(variables, tok, lens))
    for t in ts:  # a request of exactly t tokens per row: runs in bucket t with no padding
      tok = rng.integers(1, cfg["vocab"], (cfg["batch"], t)).astype(np.int32)
      lens = np.full(cfg["batch"], t, np.int32)
      np.asarray(fn(variables, tok, lens))
      xs = []
      for _ in range(args.iters):
        t1 = time.perf_counter()
        np.asarray(fn(variables, tok, lens))
        xs.append(time.perf_counter() - t1)
      res["buckets"][t]["dynjax_us"] = float(np.median(xs)) * 1e6
    xs = []
    for tok, lens in stream:
      t1 = time.perf_counter()
      np.asarray(fn(variables, tok, lens))
      xs.append(time.perf_counter() - t1)
    res["stream_mean_ms"] = float(np.mean(xs)) * 1e3
    res["stream_median_ms"] = float(np.median(xs)) * 1e3
    res["stream_buckets"] = {int(k): int(v) for k, v in zip(*np.unique(
        [pol.bucket(tok.shape[1]) for tok, _ in stream], return_counts=True), strict=True)}
    print(f"  {name:8s} dynjax per t: " + "  ".join(
        f"{t}: {res['buckets'][t]['dynjax_us']:.0f} us" for t in ts) +
        f"  stream mean {res['stream_mean_ms']:.3f} ms", flush=True)
  # the floor: a tiny executable, device in, block
  tiny = jax.jit(lambda x: x + 1).lower(jnp.zeros(8)).compile()
  z = jnp.zeros(8)
  xs = []
  for _ in range(200):
    t1 = time.perf_counter()
    jax.block_until_ready(tiny(z))
    xs.append(time.perf_counter() - t1)
  out["tiny_sync_us"] = float(np.median(xs)) * 1e6
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--flags", default="default,nocb,cball")
  ap.add_argument("--models", default="none,grouped,dense")
  ap.add_argument("--iters", type=int, default=100)
  ap.add_argument("--requests", type=int, default=200)
  ap.add_argument("--timeout", type=float, default=200)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    _isolated.emit(child(args))
    return {}
  import jax

  report = {"jax": jax.__version__, "python": platform.python_version(), "runs": {}}
  for name in args.flags.split(","):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--models", args.models,
           "--iters", str(args.iters), "--requests", str(args.requests)]
    if args.small:
      cmd.append("--small")
    print(f"== flags {name}: {FLAGS[name] or '(none)'}", flush=True)
    report["runs"][name] = _isolated.run(cmd, _isolated.env_with_xla_flags(FLAGS[name]),
                                         args.timeout)
    write_json(args.out, "probe_request_cost.json", report)
  return report


if __name__ == "__main__":
  main()
