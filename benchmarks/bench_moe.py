"""Dropless MoE FFN benchmark: dynjax.route vs lax.ragged_dot vs capacity dispatch vs roofline.

    python benchmarks/bench_moe.py --out DIR            # H100 sizes (8/64 experts, d=1024, ...)
    python benchmarks/bench_moe.py --small --out DIR    # CPU sizes, < 60 s

One process, one table per setting (Zipf(1.2) and uniform routing, 8 and 64 experts), written
to DIR/bench_moe.json.  Every method is timed end to end from the token activations and the
router weights: router matmul, top-k, permutation, expert FFNs, un-permutation and gate
weighting; warm-up first (compile excluded), then ``block_until_ready`` per call; median and p90.
Routing: logits = x @ w_router + log(p) + Gumbel noise, so the top-1 expert of a token is a draw
from p (Zipf(1.2) over the experts, or uniform); fresh noise draws record the load profile.

Methods:
  dynjax exact-sync     route on device, read the E loads (one sync), run the bucketed executable
  dynjax profiled       one jitted function, capacities from the recorded profile, overflow path
  ... stage-B only      the bucketed executable alone, routing precomputed (shows sync overhead)
  ... per-expert weights, fusion none: no weight slices at all (if XLA copies sliced weights)
  lax.ragged_dot        sort by expert, two ragged_dot calls, unsort
  switch cap 1.25       capacity-factor dispatch [E, 1.25*N*k/E, d]: drops tokens (fraction shown)
  per-expert exact      exact per-expert sizes, one call per expert, compiled beforehand (oracle)
  roofline              max(FLOPs / peak, bytes / bandwidth), nominal H100 and measured peak

Needs only jax and numpy (no network).  Works on jax 0.10 and 0.11 (public APIs only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynjax import (
  buckets,  # noqa: E402
  route,  # noqa: E402
)

NOMINAL_PEAK = 800e12  # H100 SXM dense bf16, FLOP/s (rounded as in the issue)
NOMINAL_BW = 3.3e12  # H100 SXM HBM3, bytes/s

_compiles = [0]


def _on_event(event, duration, **_):
  if event == "/jax/core/compile/backend_compile_duration":
    _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def timeit(fn, warmup: int, iters: int) -> dict:
  for _ in range(warmup):
    jax.block_until_ready(fn())
  before = _compiles[0]
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  ts = np.asarray(ts) * 1e3
  return {"median_ms": float(np.median(ts)), "p90_ms": float(np.percentile(ts, 90)),
          "min_ms": float(ts.min()), "compiles_during_timing": _compiles[0] - before}


def zipf_probs(n: int, s: float) -> np.ndarray:
  p = 1.0 / np.arange(1, n + 1) ** s
  return p / p.sum()


def measure_peak(dtype, size: int, iters: int) -> float:
  """Measured matmul FLOP/s of one square ``size`` matmul in ``dtype`` (f32 accumulation)."""
  a = jnp.ones((size, size), dtype)
  f = jax.jit(lambda a: jnp.dot(a, a))
  r = timeit(lambda: f(a), 2, iters)
  return 2 * size**3 / (r["min_ms"] * 1e-3)


def make_ffn(accumulate: str):
  acc = jnp.float32 if accumulate == "f32" else None
  return route.ffn(jax.nn.gelu, accumulate=acc)


def ragged_dot_moe(x, wr, bias, w1, w2, k):
  e = w1.shape[0]
  logits = (x @ wr).astype(jnp.float32) + bias
  probs = jax.nn.softmax(logits, axis=-1)
  if k == 1:
    idx = jnp.argmax(logits, axis=-1)[:, None]
  else:
    _, idx = jax.lax.top_k(logits, k)
  gates = jnp.take_along_axis(probs, idx, axis=-1)
  flat = idx.reshape(-1)
  order = jnp.argsort(flat)
  xs = jnp.take(x, order // k, axis=0)
  sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
  h = jax.lax.ragged_dot(xs, w1, sizes)
  h = jax.nn.gelu(h)
  ys = jax.lax.ragged_dot(h, w2, sizes)
  y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
  y = y.astype(jnp.float32).reshape(x.shape[0], k, -1) * gates[..., None]
  return y.sum(1).astype(x.dtype)


def run_setting(cfg: dict, args) -> dict:
  e, d, f, n, k = cfg["experts"], cfg["d"], cfg["ffn"], cfg["tokens"], args.k
  dtype = jnp.bfloat16
  rng = np.random.default_rng(args.seed)
  probs = zipf_probs(e, args.zipf) if cfg["routing"] == "zipf" else np.full(e, 1.0 / e)

  def draw_bias():
    g = rng.gumbel(size=(n, e))
    return jnp.asarray(np.log(probs)[None, :] + g, jnp.float32)

  key = jax.random.PRNGKey(args.seed)
  kx, kr, k1, k2 = jax.random.split(key, 4)
  x = jax.random.normal(kx, (n, d), jnp.float32).astype(dtype)
  wr = (jax.random.normal(kr, (d, e)) * (0.01 / math.sqrt(d))).astype(dtype)
  params = {"w1": (jax.random.normal(k1, (e, d, f)) / math.sqrt(d)).astype(dtype),
            "w2": (jax.random.normal(k2, (e, f, d)) / math.sqrt(f)).astype(dtype)}
  bias = draw_bias()
  logits_fn = jax.jit(lambda x, wr, bias: (x @ wr).astype(jnp.float32) + bias)
  expert = make_ffn(args.accumulate)
  experts = route.Experts(expert)
  router = route.Router(e, k=k)
  mb = args.min_bucket
  policy = buckets.linear(mb, min=mb)
  opts = dict(buckets=policy, fusion="auto", group_overhead=args.group_overhead)
  warm, iters = args.warmup, args.iters
  out: dict = {"setting": cfg, "k": k, "methods": {}}
  results = {}

  # Reference for error checks: ragged_dot (dropless).
  rd = jax.jit(lambda x, wr, bias, w1, w2: ragged_dot_moe(x, wr, bias, w1, w2, k))
  ref = np.asarray(rd(x, wr, bias, params["w1"], params["w2"]).astype(jnp.float32))
  scale = float(np.abs(ref).max()) or 1.0

  def record(name, fn, **extra):
    r = timeit(fn, warm, iters)
    y = np.asarray(fn().astype(jnp.float32))
    r["max_err_vs_ragged_dot"] = float(np.abs(y - ref).max() / scale)
    r.update(extra)
    results[name] = r
    print(f"  {name:44s} {r['median_ms']:9.3f} ms  p90 {r['p90_ms']:9.3f}", flush=True)

  # Profile: loads of fresh routing draws, recorded by an exact-sync layer.
  moe = route.Routed(experts, router, mode="exact-sync", max_signatures=args.max_signatures,
                     **opts)
  for _ in range(args.profile_draws):
    moe.capacities(moe.route(logits_fn(x, wr, draw_bias())))
  loads = np.asarray(moe.route(logits_fn(x, wr, bias)).loads)
  out["loads"] = loads.tolist()

  record("dynjax exact-sync", lambda: moe(params, x, logits_fn(x, wr, bias)))
  sig = moe.capacities(moe.route(logits_fn(x, wr, bias)))
  plan = moe._plan(sig, overflow=False)
  results["dynjax exact-sync"]["capacities"] = list(sig)
  results["dynjax exact-sync"]["groups"] = plan.describe()
  results["dynjax exact-sync"]["padded_fraction"] = 1 - loads.sum() / plan.num_slots
  stage_b = moe._execs[plan]
  routing0 = moe._route(logits_fn(x, wr, bias))
  record("dynjax exact-sync, stage B only (no sync)", lambda: stage_b(params, x, routing0))

  prof = route.Routed(experts, router, mode="profiled", profile=moe.profile,
                      quantile=args.quantile, overflow_chunk=args.overflow_chunk, **opts)
  prof_fn = jax.jit(lambda p, x, wr, bias: prof(p, x, logits_fn(x, wr, bias)))
  caps = prof.profiled_capacities(n)
  over = int(np.maximum(loads - np.asarray(caps), 0).sum())
  record("dynjax profiled", lambda: prof_fn(params, x, wr, bias), capacities=list(caps),
         overflow_cells=over, groups=prof.explain(n))

  # Force the overflow path: capacities at half the profiled ones.
  half = tuple(c // 2 for c in caps)
  forced = jax.jit(lambda p, x, wr, bias: prof.apply(p, x, prof.route(logits_fn(x, wr, bias)),
                                                     half))
  record("dynjax profiled, forced overflow (caps/2)", lambda: forced(params, x, wr, bias),
         overflow_cells=int(np.maximum(loads - np.asarray(half), 0).sum()))

  if args.variants == "all" or (args.variants == "first" and cfg is args.first_cfg):
    pow2 = route.Routed(experts, router, mode="exact-sync", fusion="bucket",
                        buckets=buckets.pow2(min=mb))
    record("dynjax exact-sync, pow2 buckets, bucket fusion",
           lambda: pow2(params, x, logits_fn(x, wr, bias)))
    per_w = [jax.tree.map(lambda a, i=i: a[i], params) for i in range(e)]
    br = route.Routed(route.Branches([expert] * e), router, mode="exact-sync", fusion="none",
                      buckets=policy)
    record("dynjax exact-sync, per-expert weights, no fusion",
           lambda: br(per_w, x, logits_fn(x, wr, bias)))

  record("lax.ragged_dot", lambda: rd(x, wr, bias, params["w1"], params["w2"]))

  cap = math.ceil(1.25 * n * k / e)
  switch_plan = route.make_plan((cap,) * e)
  switch = jax.jit(lambda p, x, wr, bias: route.apply(
      experts, p, x, router(logits_fn(x, wr, bias)), switch_plan))
  dropped = float(np.maximum(loads - cap, 0).sum() / (n * k))
  record("switch capacity 1.25 (drops tokens)", lambda: switch(params, x, wr, bias),
         dropped_fraction=dropped, capacity=cap)

  exact = route.Routed(experts, router, mode="exact-sync", buckets=buckets.linear(1),
                       fusion="none", record=False)
  record("per-expert exact (oracle shapes)", lambda: exact(params, x, logits_fn(x, wr, bias)))

  active = int((loads > 0).sum())
  flops = 4.0 * n * k * d * f
  nbytes = 2.0 * (active * 2 * d * f + 2 * n * d)
  out["flops"] = flops
  out["bytes"] = nbytes
  out["roofline_ms_nominal"] = max(flops / NOMINAL_PEAK, nbytes / NOMINAL_BW) * 1e3
  out["roofline_ms_measured_peak"] = max(flops / args.peak, nbytes / NOMINAL_BW) * 1e3
  print(f"  {'roofline (nominal H100 800 TF/s, 3.3 TB/s)':44s} {out['roofline_ms_nominal']:9.3f}"
        f" ms   (measured-peak roofline {out['roofline_ms_measured_peak']:.3f} ms)")
  out["methods"] = results
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None, help="directory for bench_moe.json")
  ap.add_argument("--small", action="store_true", help="CPU sizes (< 60 s)")
  ap.add_argument("--k", type=int, default=1)
  ap.add_argument("--zipf", type=float, default=1.2)
  ap.add_argument("--settings", default="zipf8,zipf64,uniform8,uniform64")
  ap.add_argument("--iters", type=int, default=None)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--profile-draws", type=int, default=32)
  ap.add_argument("--quantile", type=float, default=1.0)
  ap.add_argument("--min-bucket", type=int, default=None)
  ap.add_argument("--overflow-chunk", type=int, default=None)
  ap.add_argument("--max-signatures", type=int, default=16)
  ap.add_argument("--group-overhead", type=int, default=None,
                  help="rows one more batched call is worth (fusion='auto' planner)")
  ap.add_argument("--accumulate", choices=("native", "f32"), default="native",
                  help="native: bf16 matmul outputs (XLA accumulates in f32 inside the GEMM); "
                  "f32: preferred_element_type=f32 then cast")
  ap.add_argument("--variants", choices=("all", "first", "none"), default="first",
                  help="extra dynjax rows (pow2 buckets, per-expert weights) on which settings")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.small:
    sizes = {"d": 32, "ffn": 128, "tokens": 512}
    args.iters = args.iters or 5
    args.min_bucket = args.min_bucket or 16
    args.overflow_chunk = args.overflow_chunk or 64
    args.group_overhead = args.group_overhead or 32
    args.warmup = min(args.warmup, 1)
    args.profile_draws = min(args.profile_draws, 8)
    peak_size = 512
  else:
    sizes = {"d": 1024, "ffn": 4096, "tokens": 8192}
    args.iters = args.iters or 50
    args.min_bucket = args.min_bucket or 128
    args.overflow_chunk = args.overflow_chunk or 256
    args.group_overhead = args.group_overhead or 256
    peak_size = 8192
  dev = jax.devices()[0]
  args.peak = measure_peak(jnp.bfloat16, peak_size, 5)
  print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, python "
        f"{platform.python_version()}; measured bf16 matmul peak {args.peak / 1e12:.1f} TFLOP/s")
  report = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "python": platform.python_version(), "measured_peak_flops": args.peak,
            "args": {k: v for k, v in vars(args).items() if k != "peak"}, "settings": []}
  for name in args.settings.split(","):
    routing = "zipf" if name.startswith("zipf") else "uniform"
    e = int(name[len(routing):])
    cfg = dict(sizes, experts=e, routing=routing)
    if not report["settings"]:
      args.first_cfg = cfg
    print(f"\n== {routing} routing, {e} experts, d={cfg['d']}, ffn={cfg['ffn']}, "
          f"{cfg['tokens']} tokens, k={args.k}, bf16")
    report["settings"].append(run_setting(cfg, args))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_moe.json")
    with open(path, "w") as fh:
      json.dump(report, fh, indent=1, default=float)
    print(f"\nwrote {path}")
  return report


if __name__ == "__main__":
  main()
