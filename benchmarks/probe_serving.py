"""Where a cold start and a warm restart of a bucketed BERT spend their time (issue 10 probe).

  python benchmarks/probe_serving.py --size base --out $OUT        # drives every part below
  python benchmarks/probe_serving.py --part options --opts triton_off --size base

Each part runs in a fresh subprocess (XLA's in-process autotune cache would otherwise make a
later compile look cheaper than a cold one):

* ``options``: trace, lower and compile two buckets (T=128 and T=512, batch 8) with one set of
  XLA compiler options, then the run time of each executable (median of 30 synced runs).
* ``concurrent``: lower the six pow2 buckets, compile them all at once in six threads
  (default options, persistent cache filled), and serialize the executables.
* ``restart``: a fresh process over that cache: trace, per-bucket lowering, cache load, and
  ``serialize_executable`` loads (one by one and six at once).
* ``hit``: per-call cost of the dynjax hit path vs the bucket's AOT executable (numpy in, numpy
  out both), and a profile.

Writes ``<out>/probe_<part>[_<opts>].json``; prints one line per measurement.

Public APIs only.  The lowering times are dynjax's (``f.trace(...).lower(bucket)``); what is
compiled, serialized and run is the same model lowered by ``jax.jit`` at the bucket's padded
shapes, which is what a ``padding="trust"`` bucket executable computes (dynjax hands out no
``jax`` Lowered to compile with options or to serialize).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

OPTION_SETS = {
    "default": {},
    "triton_off": {"xla_gpu_enable_triton_gemm": False},
    "triton_off_at0": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0},
    "at0": {"xla_gpu_autotune_level": 0},
    "triton_off_at1": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 1},
    "triton_off_nocmdbuf": {"xla_gpu_enable_triton_gemm": False,
                            "xla_gpu_enable_command_buffer": ""},
    "triton_off_at0_nox": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
                           "xla_llvm_disable_expensive_passes": True},
    "triton_off_at0_o1": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
                          "xla_backend_optimization_level": 1},
    # Debug options that are not per-compile options go through XLA_FLAGS ("_env").
    "triton_off_par": {"xla_gpu_enable_triton_gemm": False,
                       "_env": "--xla_gpu_enable_llvm_module_compilation_parallelism=true"},
    "triton_off_at0_par": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
                           "_env": "--xla_gpu_enable_llvm_module_compilation_parallelism=true"},
    # jax 0.11.2's XLA knows this option under neither name (XLA_FLAGS: "Unknown flag";
    # compile option: "No such compile option"; H100, session 3).  triton_off_at0_o1 there:
    # compile 2.32 / 2.67 s (T=128 / 512) vs 2.35 / 3.10, run 2.80 / 8.67 ms vs 2.79 / 8.57
    # (one sample each: not adopted).
    "triton_off_at0_paropt": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
                              "xla_gpu_enable_llvm_module_compilation_parallelism": True},
}


def _compile_opts(name: str) -> dict:
  return {k: v for k, v in OPTION_SETS[name].items() if not k.startswith("_")}


def _enable_persistent_cache(cache_dir: str) -> None:
  """JAX's persistent compilation cache in ``cache_dir``, every compile written (each part runs
  in a fresh process, before its first compile, so the config alone takes effect)."""
  import jax

  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _setup(size: str):
  import numpy as np

  import dynjax
  from dynjax import flax as djf
  from examples import models

  cfg = models.ENCODER_SIZES[size]
  module = models.BertEncoder(cfg)
  raw = models.init_encoder_params(cfg, seed=0)
  variables = models.to_device({"params": raw})
  f = djf.jit(module, dims={"tokens": "b, t", "lengths": "b"},
              buckets={"t": dynjax.buckets.pow2(16, 512)}, padding="trust")
  tok = np.ones((8, 100), np.int32)
  lens = np.full((8,), 100, np.int32)
  return f, variables, tok, lens, np, _bucket_lowering(module, variables)


def _bucket_lowering(module, variables):
  """``lower(t)``: the model under ``jax.jit`` lowered at bucket ``(8, t)``, a ``jax`` Lowered
  (compile it with options, serialize it); the arguments are :func:`_padded_args`'s."""
  import jax
  import numpy as np

  jitted = jax.jit(lambda v, tokens, lengths: module.apply(v, tokens, lengths))

  def lower(t):
    return jitted.lower(variables, np.ones((8, t), np.int32), np.full((8,), min(t, 100), np.int32))

  return lower


def _median_run(exe, args, n=30):
  import jax
  import numpy as np

  jax.block_until_ready(exe(*args))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(exe(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) * 1e3


def _padded_args(f, variables, np, t):
  import jax

  tok = np.ones((8, t), np.int32)
  lens = np.full((8,), min(t, 100), np.int32)
  return list(jax.device_put((variables, tok, lens)))  # the arguments of _bucket_lowering's


def part_options(size: str, opts_name: str) -> dict:
  f, variables, tok, lens, np, lower = _setup(size)
  opts = _compile_opts(opts_name)
  t0 = time.perf_counter()
  traced = f.trace(variables, tok, lens)
  out = {"opts": opts_name, "trace_s": time.perf_counter() - t0, "buckets": {}}
  for t in (128, 512):
    t0 = time.perf_counter()
    traced.lower({"b": 8, "t": t})
    t1 = time.perf_counter()
    low = lower(t)  # not timed: the same lowering under jax.jit, to compile with options
    tc = time.perf_counter()
    exe = low.compile(compiler_options=opts) if opts else low.compile()
    t2 = time.perf_counter()
    ms = _median_run(exe, _padded_args(f, variables, np, t))
    out["buckets"][t] = {"lower_s": t1 - t0, "compile_s": t2 - tc, "run_ms": ms}
    print(f"options {opts_name:<16} T={t:<4} lower {t1 - t0:6.2f} s  compile {t2 - tc:6.2f} s  "
          f"run {ms:7.3f} ms", flush=True)
  return out


def part_concurrent(size: str, cache_dir: str, ser_dir: str, opts_name: str) -> dict:
  from jax.experimental import serialize_executable as se

  _enable_persistent_cache(cache_dir)
  f, variables, tok, lens, np, lower = _setup(size)
  opts = _compile_opts(opts_name)
  t0 = time.perf_counter()
  traced = f.trace(variables, tok, lens)
  trace_s = time.perf_counter() - t0
  sizes = (16, 32, 64, 128, 256, 512)
  lowered, lower_s = {}, {}
  for t in sizes:
    t0 = time.perf_counter()
    traced.lower({"b": 8, "t": t})
    lower_s[t] = time.perf_counter() - t0
    lowered[t] = lower(t)  # not timed: the same lowering under jax.jit (see the docstring)
  comp_s = {}

  def comp(t):
    t0 = time.perf_counter()
    exe = lowered[t].compile(compiler_options=opts) if opts else lowered[t].compile()
    comp_s[t] = time.perf_counter() - t0
    return exe

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(len(sizes)) as pool:
    exes = dict(zip(sizes, pool.map(comp, sizes), strict=True))
  wall = time.perf_counter() - t0
  run_ms = {t: _median_run(exes[t], _padded_args(f, variables, np, t), 10) for t in sizes}
  os.makedirs(ser_dir, exist_ok=True)
  ser_s = {}
  for t in sizes:
    t0 = time.perf_counter()
    payload, in_tree, out_tree = se.serialize(exes[t])
    import pickle

    with open(os.path.join(ser_dir, f"b{t}.pkl"), "wb") as fh:
      pickle.dump((payload, in_tree, out_tree), fh)
    ser_s[t] = time.perf_counter() - t0
  print(f"concurrent {opts_name}: trace {trace_s:.2f} s, lower {sum(lower_s.values()):.2f} s "
        f"({', '.join(f'{t}:{s:.2f}' for t, s in lower_s.items())}), 6 compiles at once "
        f"{wall:.2f} s wall (each {', '.join(f'{t}:{s:.1f}' for t, s in comp_s.items())}); "
        f"run ms {', '.join(f'{t}:{v:.2f}' for t, v in run_ms.items())}", flush=True)
  return {"opts": opts_name, "trace_s": trace_s, "lower_s": lower_s, "compile_s": comp_s,
          "wall_s": wall, "run_ms": run_ms, "serialize_s": ser_s}


def part_restart(size: str, cache_dir: str, ser_dir: str) -> dict:
  import pickle

  from jax.experimental import serialize_executable as se

  _enable_persistent_cache(cache_dir)
  f, variables, tok, lens, np, lower = _setup(size)
  t0 = time.perf_counter()
  traced = f.trace(variables, tok, lens)
  trace_s = time.perf_counter() - t0
  sizes = (16, 32, 64, 128, 256, 512)
  lower_s, load_s = {}, {}
  for t in sizes:
    t0 = time.perf_counter()
    traced.lower({"b": 8, "t": t})
    t1 = time.perf_counter()
    low = lower(t)  # not timed: the same lowering under jax.jit (see the docstring)
    tc = time.perf_counter()
    low.compile()
    lower_s[t], load_s[t] = t1 - t0, time.perf_counter() - tc
  blobs = {}
  for t in sizes:
    with open(os.path.join(ser_dir, f"b{t}.pkl"), "rb") as fh:
      blobs[t] = pickle.load(fh)
  des_s = {}
  for t in sizes:
    t0 = time.perf_counter()
    se.deserialize_and_load(*blobs[t])
    des_s[t] = time.perf_counter() - t0
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    list(pool.map(lambda t: se.deserialize_and_load(*blobs[t]), sizes))
  des_par = time.perf_counter() - t0
  print(f"restart: trace {trace_s:.2f} s; lower {sum(lower_s.values()):.2f} s; persistent-cache "
        f"load {sum(load_s.values()):.2f} s ({', '.join(f'{t}:{s:.2f}' for t, s in load_s.items())}); "
        f"deserialize one by one {sum(des_s.values()):.2f} s, six at once {des_par:.2f} s",
        flush=True)
  return {"trace_s": trace_s, "lower_s": lower_s, "cache_load_s": load_s,
          "deserialize_s": des_s, "deserialize_parallel_s": des_par}


def part_hit(size: str) -> dict:
  import jax
  import jax.numpy as jnp

  f, variables, tok, lens, np, lower = _setup(size)
  out = {}
  for t_true in (100, 128):
    tk = np.ones((8, t_true), np.int32)
    f(variables, tk, lens)
  exe = lower(128).compile()  # the bucket's AOT executable (jax.jit at the padded shapes)
  tok128 = np.ones((8, 128), np.int32)

  def aot():
    return [np.asarray(o) for o in jax.tree_util.tree_leaves(exe(variables, tok128, lens))]

  tk100 = np.ones((8, 100), np.int32)

  def dyn():
    return f(variables, tk100, lens)

  def bench(fn, n):
    for _ in range(10):
      fn()
    best = []
    for _ in range(5):
      t0 = time.perf_counter()
      for _ in range(n):
        fn()
      best.append((time.perf_counter() - t0) / n * 1e6)
    return float(np.median(best))

  n = 50 if size == "base" else 300
  # Interleave to share noise.
  a1, d1, a2, d2 = bench(aot, n), bench(dyn, n), bench(aot, n), bench(dyn, n)
  out["model_aot_us"], out["model_dynjax_us"] = (a1 + a2) / 2, (d1 + d2) / 2
  pr = cProfile.Profile()
  pr.enable()
  for _ in range(n):
    dyn()
  pr.disable()
  s = io.StringIO()
  pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
  out["profile"] = s.getvalue()

  import dynjax

  def tiny(x):
    return x * 2.0 + 1.0

  df = dynjax.jit(tiny, dims={"x": "b, t"}, padding="trust",
                  buckets={"b": [8], "t": dynjax.buckets.pow2(16, 64)})
  x13 = np.ones((8, 13), np.float32)
  x16 = np.ones((8, 16), np.float32)
  df(x13)
  comp = jax.jit(tiny).lower(x16).compile()
  d16 = jnp.asarray(x16)
  out["tiny_aot_numpy_us"] = bench(lambda: np.asarray(comp(x16)), 2000)
  out["tiny_dynjax_numpy_us"] = bench(lambda: np.asarray(df(x13)), 2000)
  out["tiny_aot_device_us"] = bench(lambda: comp(d16), 2000)
  out["tiny_dynjax_device_us"] = bench(lambda: df(d16), 2000)
  print(f"hit path ({size}, T=100 -> 128): AOT {out['model_aot_us']:.0f} us, dynjax "
        f"{out['model_dynjax_us']:.0f} us (+{out['model_dynjax_us'] - out['model_aot_us']:.0f}); "
        f"tiny numpy AOT {out['tiny_aot_numpy_us']:.1f} vs dynjax {out['tiny_dynjax_numpy_us']:.1f} "
        f"us; tiny device AOT {out['tiny_aot_device_us']:.1f} vs dynjax "
        f"{out['tiny_dynjax_device_us']:.1f} us", flush=True)
  print(out["profile"], flush=True)
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--part", default=None)
  ap.add_argument("--opts", default="default")
  ap.add_argument("--size", default="base")
  ap.add_argument("--out", default="probe_out")
  ap.add_argument("--parts", default="options,concurrent,restart,hit")
  ap.add_argument("--option_sets", default="default,triton_off,triton_off_at0")
  args = ap.parse_args(argv)
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  os.makedirs(args.out, exist_ok=True)
  work = os.path.join(tempfile.gettempdir(), f"dynjax_probe_{args.size}")
  cache_dir, ser_dir = os.path.join(work, "cache"), os.path.join(work, "ser")
  if args.part is None:
    for part in args.parts.split(","):
      opts_list = args.option_sets.split(",") if part == "options" else (
          ["default"] if part != "concurrent" else ["triton_off", "default"])
      for o in opts_list:
        cmd = [sys.executable, __file__, "--part", part, "--opts", o, "--size", args.size,
               "--out", args.out]
        env = dict(os.environ)
        extra = OPTION_SETS.get(o, {}).get("_env")
        if extra:
          env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra).strip()
        rc = subprocess.call(cmd, env=env)
        if rc:
          print(f"part {part} {o}: exit {rc}", flush=True)
    return
  if args.part == "options":
    res = part_options(args.size, args.opts)
  elif args.part == "concurrent":
    res = part_concurrent(args.size, os.path.join(cache_dir, args.opts),
                          os.path.join(ser_dir, args.opts), args.opts)
  elif args.part == "restart":
    res = part_restart(args.size, os.path.join(cache_dir, "default"),
                       os.path.join(ser_dir, "default"))
  elif args.part == "hit":
    res = part_hit(args.size)
  else:
    raise SystemExit(f"unknown part {args.part}")
  import jax

  res["versions"] = {"jax": jax.__version__, "python": sys.version.split()[0],
                     "device": jax.devices()[0].device_kind}
  name = f"probe_{args.part}" + (f"_{args.opts}" if args.part in ("options", "concurrent") else "")
  with open(os.path.join(args.out, name + ".json"), "w") as fh:
    json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
  main()
