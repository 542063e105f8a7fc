"""Dropless MoE benchmark: dynjax.route vs lax.ragged_dot vs capacity dispatch vs roofline.

    python -m benchmarks moe --out DIR                   # H100 sizes (8/64 experts, d=1024, ...)
    python -m benchmarks moe --quick                     # = --small: CPU sizes
    python -m benchmarks moe -- --settings e2e --k 2     # this module's own flags after "--"
    python -m benchmarks.moe [flags]                     # the same main() (was bench_moe.py)

One process, one table per setting (Zipf(1.2) and uniform routing, 8 and 64 experts, and the
end-to-end MoE transformer ``e2e``), written to DIR/bench_moe.json.  Every method is timed end to end from the token activations and the
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

Setting ``e2e`` (``--e2e`` runs only it): a one-layer MoE transformer encoder (embedding,
masked multi-head attention, MoE FFN, masked-mean pooling) on batches of 8 standard-library
docstrings (``examples.data.request_stream``), numpy in, numpy out per request.  Every
variant runs under ``dynjax.jit(dims={"tokens": "b, t"}, padding="trust")`` with the same
length buckets, so only the MoE layer differs:
  dynjax profiled       Routed(mode="profiled"): static capacities per bucket, no host sync
  dense MoE             every expert on every token, weighted by the (masked) gates
  lax.ragged_dot        sort by expert, two ragged_dot calls, unsort
  dynjax exact-sync     jitted pieces (attention | routed FFN | pooling), one load sync per request
Outputs are checked against the dense variant (``max_err``); compiles counted with
jax.monitoring (cold pass, steady pass: must be 0).  The encoder and its variants are
:mod:`examples.moe_encoder`; this module is the runner.

Needs only jax and numpy (no network).  Works on jax 0.10 and 0.11 (public APIs only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from dynjax import buckets, route
from examples.moe_encoder import (
  init_moe_encoder,
  make_e2e_variants,
  zipf_probs,
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
  # Host cost of exact-sync's planning (loads already on device and ready): first sight of a
  # signature runs the DP planner, a repeated one is a dict lookup (the plan cache).
  routings = [jax.block_until_ready(moe._route(logits_fn(x, wr, draw_bias())))
              for _ in range(8)]
  fresh = route.Routed(experts, router, mode="exact-sync", **opts)
  first = []
  for r in routings:
    t0 = time.perf_counter()
    fresh.capacities(r)
    first.append(time.perf_counter() - t0)
  again = []
  for i in range(400):
    t0 = time.perf_counter()
    fresh.capacities(routings[i % 8])
    again.append(time.perf_counter() - t0)
  results["dynjax exact-sync"]["host_plan_us_first"] = float(np.median(first) * 1e6)
  results["dynjax exact-sync"]["host_plan_us_cached"] = float(np.median(again) * 1e6)
  print(f"  {'exact-sync host planning per call (us)':44s} first sight "
        f"{np.median(first) * 1e6:7.1f}   cached {np.median(again) * 1e6:7.1f}", flush=True)
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


# -----------------------------------------------------------------------------------------------
# End to end: a one-layer MoE transformer encoder on docstring lengths
# -----------------------------------------------------------------------------------------------
E2E_SIZES = {
    "small": dict(vocab=4096, d=64, heads=4, ffn=256, experts=8, max_len=512, batch=8,
                  requests=24, calib=16, min_bucket=16),
    "full": dict(vocab=30522, d=1024, heads=16, ffn=4096, experts=8, max_len=512, batch=8,
                 requests=200, calib=64, min_bucket=64),
}


def run_e2e(args) -> dict:
  """The end-to-end setting: per-request latency of each variant on docstring batches."""
  from examples import data

  size = "small" if args.small else "full"
  cfg = dict(E2E_SIZES[size])
  if args.e2e_requests:
    cfg["requests"] = args.e2e_requests
  dtype = jnp.bfloat16
  params = init_moe_encoder(cfg, args.seed, dtype)
  stream = data.request_stream(cfg["requests"], batch=cfg["batch"], max_len=cfg["max_len"],
                               seed=args.seed, vocab=cfg["vocab"])
  calib = data.request_stream(cfg["calib"], batch=cfg["batch"], max_len=cfg["max_len"],
                              seed=args.seed + 1, vocab=cfg["vocab"])
  mb = cfg["min_bucket"]
  policy = buckets.geometric(1.25, min=mb).aligned(mb if mb <= 16 else 64)
  variants = make_e2e_variants(params, cfg, args.k, policy, 1.0, calib,
                               overflow_chunk=args.overflow_chunk)
  moe, fill = variants.pop("_moe"), variants.pop("_fill")
  summ = data.stream_summary(stream)
  print(f"  {summ['requests']} requests of batch {cfg['batch']}, {summ['distinct_lengths']} "
        f"distinct lengths, mean {summ['mean_length']:.1f}; d={cfg['d']}, ffn={cfg['ffn']}, "
        f"{cfg['experts']} experts, k={args.k}, bf16; profiled fill {fill:.2f}", flush=True)
  out: dict = {"setting": {"name": "e2e", **cfg, "k": args.k}, "stream": summ, "fill": fill,
               "methods": {}}
  outputs: dict[str, list] = {}
  for name, fn in variants.items():
    before = _compiles[0]
    t0 = time.perf_counter()
    ys = [fn(r.tokens, r.lengths) for r in stream]
    cold = time.perf_counter() - t0
    cold_compiles = _compiles[0] - before
    before = _compiles[0]
    ts = []
    for r in stream:
      t1 = time.perf_counter()
      fn(r.tokens, r.lengths)
      ts.append(time.perf_counter() - t1)
    ts = np.asarray(ts) * 1e3
    outputs[name] = ys
    out["methods"][name] = {
        "mean_ms": float(ts.mean()), "median_ms": float(np.median(ts)),
        "p90_ms": float(np.percentile(ts, 90)), "cold_s": cold, "cold_compiles": cold_compiles,
        "steady_compiles": _compiles[0] - before}
  ref = outputs["dense MoE (every expert on every token)"]
  scale = max(float(np.abs(np.asarray(y, np.float32)).max()) for y in ref) or 1.0
  dense_mean = out["methods"]["dense MoE (every expert on every token)"]["mean_ms"]
  for name, m in out["methods"].items():
    err = max(float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())
              for a, b in zip(outputs[name], ref, strict=True))
    m["max_err_vs_dense"] = err / scale
    m["speedup_vs_dense"] = dense_mean / m["mean_ms"]
    print(f"  {name:52s} mean {m['mean_ms']:8.3f} ms  p50 {m['median_ms']:8.3f}  p90 "
          f"{m['p90_ms']:8.3f}  x{m['speedup_vs_dense']:5.2f} vs dense  cold {m['cold_s']:6.1f}"
          f" s / {m['cold_compiles']} compiles, steady {m['steady_compiles']}  err "
          f"{m['max_err_vs_dense']:.1e}", flush=True)
  st = moe.stats()
  out["profiled_capacities"] = st["profiled_capacities"]
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None, help="directory for bench_moe.json")
  ap.add_argument("--small", action="store_true", help="CPU sizes (< 60 s)")
  ap.add_argument("--k", type=int, default=1)
  ap.add_argument("--zipf", type=float, default=1.2)
  ap.add_argument("--settings", default="zipf8,zipf64,uniform8,uniform64,e2e",
                  help="comma-separated: zipf<E>, uniform<E> (the FFN layer alone), e2e")
  ap.add_argument("--e2e", action="store_true",
                  help="only the end-to-end MoE transformer setting (= --settings e2e)")
  ap.add_argument("--e2e-requests", type=int, default=None,
                  help="requests of the e2e stream (default 200, --small 24)")
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
  if args.e2e:
    args.settings = "e2e"
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
    if name == "e2e":
      print("\n== e2e: MoE transformer encoder on docstring batches (per request, numpy in/out)")
      report["settings"].append(run_e2e(args))
      continue
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


def run_cli(cfg) -> int:
  """``python -m benchmarks moe [suite flags] [-- own flags]``: runs :func:`main` in process.

  The suite's ``--out`` and ``--seed`` are passed on unless given after ``--``; ``--quick``
  means ``--small``.  Returns the exit code (the suite prints no table of its own).
  """
  argv = list(cfg.extra_args)
  if cfg.out and "--out" not in argv:
    argv += ["--out", cfg.out]
  if cfg.quick and "--small" not in argv:
    argv.append("--small")
  if "--seed" not in argv:
    argv += ["--seed", str(cfg.seed)]
  main(argv)
  return 0


if __name__ == "__main__":
  main()
