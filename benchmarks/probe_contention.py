"""Why requests slow down while buckets compile in the background (issue 10 probe).

  python benchmarks/probe_contention.py --size base --requests 600 --out $OUT

One fresh process per variant (``--variant`` runs one): a cold ``serving=True`` Flax BERT
serves ``--requests`` docstring requests one after another while its buckets compile in the
background.  Recorded per variant:

* every request's latency and start time, and every XLA compile's span (``jax.monitoring``
  time spans of backend compiles: compiled function and thread, start, seconds);
* a GIL probe: a thread that sleeps 1 ms in a loop and records how late it wakes up (a
  thread holding the GIL delays every wake-up by up to the switch interval, 5 ms);
* a sampler: every 20 ms, the innermost dynjax/jax/flax frame of each compile thread.

Variants: ``base`` (as the bench: cache_dir set), ``nocache`` (no cache_dir: no executable
store, no JAX persistent cache), ``switch`` (``sys.setswitchinterval(2e-4)``), ``workers1``
(one compile thread), ``workers2``, ``at1`` / ``at0`` (the quick compiles with XLA's GPU
autotune level 1 / 0: level 0 runs nothing on the GPU while compiling), ``par1`` / ``at0par1``
(``xla_gpu_force_compilation_parallelism=1``: each compile keeps to its own thread).

The ``at*``/``par1`` variants pass :data:`QUICK_OPTIONS` plus their change as ``compiler_options``
(public API).  That sets them for every compile of the function: serving's quick tier 0 (which
uses :data:`QUICK_OPTIONS` by default on GPU) and no tier-1 recompile, which serving only starts
1,000 calls after the last tier-0 compile, i.e. not within a 600-request run anyway.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

# serving=True's quick tier-0 options on GPU (README "Serving"; dynjax/_api.py's comment has
# the measurements): cuBLAS gemms by heuristics, no autotuning.
QUICK_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
VARIANTS = ("base", "nocache", "switch", "workers1", "workers2", "at1", "at0", "par1", "at0par1")


def run_variant(variant: str, size: str, n: int) -> dict:
  import jax
  import numpy as np

  import dynjax
  from dynjax import flax as djf
  from examples import data, models

  if variant == "switch":
    sys.setswitchinterval(2e-4)
  options = None
  if variant.startswith("at"):
    options = {**QUICK_OPTIONS, "xla_gpu_autotune_level": int(variant[2])}
  if variant.endswith("par1"):
    options = {**(options or QUICK_OPTIONS), "xla_gpu_force_compilation_parallelism": 1}
  cfg = models.ENCODER_SIZES[size]
  module = models.BertEncoder(cfg)
  variables = models.to_device({"params": models.init_encoder_params(cfg, seed=0)})
  reqs = data.request_stream(n, batch=8, max_len=512, seed=0, vocab=cfg.vocab)
  kw = {}
  if variant != "nocache":
    kw["cache_dir"] = tempfile.mkdtemp(prefix="dynjax_contention_")
  if variant in ("workers1", "workers2"):
    kw["compile_workers"] = int(variant[-1])
  if options is not None:
    kw["compiler_options"] = options
  f = djf.jit(module, dims={"tokens": "b, t", "lengths": "b"}, padding="trust", serving=True,
              buckets={"t": dynjax.buckets.pow2(16, 512)}, **kw)
  stop = threading.Event()
  spans = []  # (compiled function @ thread, start wall time, seconds) of every XLA compile

  def on_span(event, start, end, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      spans.append((f"{kw.get('fun_name', '?')}@{threading.current_thread().name}", start,
                    end - start))

  jax.monitoring.register_event_time_span_listener(on_span)
  t_start, t_start_wall = time.perf_counter(), time.time()
  gil = []

  def gil_probe():
    while not stop.is_set():
      t0 = time.perf_counter()
      time.sleep(0.001)
      gil.append((t0 - t_start, (time.perf_counter() - t0 - 0.001) * 1e3))

  samples = collections.Counter()

  def sampler():
    while not stop.is_set():
      time.sleep(0.02)
      frames = sys._current_frames()
      for th in threading.enumerate():
        if not th.name.startswith("dynjax-compile"):
          continue
        fr = frames.get(th.ident)
        best = None
        while fr is not None:
          fn = fr.f_code.co_filename
          if any(k in fn for k in ("/jax/", "/jaxlib/", "/dynjax/", "/flax/")):
            best = f"{os.path.basename(fn)}:{fr.f_code.co_name}"
            break
          fr = fr.f_back
        samples[best or "idle/other"] += 1

  threads = [threading.Thread(target=gil_probe, daemon=True),
             threading.Thread(target=sampler, daemon=True)]
  for t in threads:
    t.start()
  lat = []
  for r in reqs:
    t0 = time.perf_counter()
    np.asarray(f(variables, r.tokens, r.lengths))
    lat.append((t0 - t_start, (time.perf_counter() - t0) * 1e3, int(r.length)))
  total = time.perf_counter() - t_start
  stop.set()
  log = [(k, s - t_start_wall, d) for k, s, d in spans]
  st = f.stats()
  lat_ms = np.array([x[1] for x in lat])
  g = np.array([x[1] for x in gil]) if gil else np.zeros(1)
  out = {"variant": variant, "total_s": total, "requests": n,
         "slow_requests_over_40ms": int((lat_ms > 40).sum()),
         "slow_seconds": float(lat_ms[lat_ms > 40].sum() / 1e3),
         "gil_wake_late_ms": {"p50": float(np.percentile(g, 50)),
                              "p90": float(np.percentile(g, 90)),
                              "p99": float(np.percentile(g, 99)), "n": len(g)},
         "latency": lat, "gil": gil[::5], "sched_log": log, "samples": dict(samples),
         "stats": {k: st[k] for k in ("compiles", "served_on_larger_bucket",
                                      "waited_for_compile", "wait_seconds")},
         "versions": {"jax": jax.__version__, "python": sys.version.split()[0],
                      "device": jax.devices()[0].device_kind}}
  print(f"{variant:<9} total {total:6.2f} s; requests > 40 ms: {out['slow_requests_over_40ms']} "
        f"({out['slow_seconds']:.2f} s); GIL wake-up late p50/p90/p99 "
        f"{out['gil_wake_late_ms']['p50']:.2f}/{out['gil_wake_late_ms']['p90']:.2f}/"
        f"{out['gil_wake_late_ms']['p99']:.2f} ms; compiles {st['compiles']}", flush=True)
  print("   compile log: " + ", ".join(f"{k}@{s:.1f}+{d:.1f}s" for k, s, d in log), flush=True)
  print("   compile-thread samples: " + ", ".join(
      f"{k} {v}" for k, v in samples.most_common(8)), flush=True)
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--variant", default=None)
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--size", default="base")
  ap.add_argument("--requests", type=int, default=600)
  ap.add_argument("--out", default="probe_out")
  args = ap.parse_args(argv)
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  os.makedirs(args.out, exist_ok=True)
  if args.variant is None:
    for v in args.variants.split(","):
      rc = subprocess.call([sys.executable, __file__, "--variant", v, "--size", args.size,
                            "--requests", str(args.requests), "--out", args.out])
      if rc:
        print(f"variant {v}: exit {rc}", flush=True)
    return
  res = run_variant(args.variant, args.size, args.requests)
  with open(os.path.join(args.out, f"contention_{args.variant}.json"), "w") as fh:
    json.dump(res, fh)
  sys.stdout.flush()
  os._exit(0)  # compile threads may still run: do not wait for them at exit


if __name__ == "__main__":
  main()
