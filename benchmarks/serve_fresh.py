"""A served model from process start to its 1,000th answer, each mode in a FRESH process.

    python -m benchmarks.serve_fresh --out DIR                      # the H100 table (fp32)
    python -m benchmarks.serve_fresh --out DIR --dtype bfloat16     # the bf16 table
    python -m benchmarks.serve_fresh --size tiny --requests 200 --modes torch_eager,dynjax_pow2

The protocol of issue 18.  Every mode runs in its own process, started by this one; the clock
starts when the parent spawns it, so "start to 1,000th answer" includes the interpreter, the
imports, the backend's start, building the request list from the standard library (the same
work in every mode), the weights (restored from host arrays) and every compile.  The model is
the Linen BERT encoder of :mod:`examples.models` with a lengths mask (``--size base``: 12
layers, d 768), fed 1,000 requests of batch 8 with stdlib docstring lengths; numpy in, numpy
out in every mode.  torch is the same architecture with the same weights
(:func:`examples.models.torch_bert`: SDPA with a padding mask; fp32 with
``set_float32_matmul_precision("high")``, bf16 with its default SDPA).

Modes (``--modes``, in order; a ``*_restart`` mode reuses the cache of the mode it names):

* ``torch_eager``: PyTorch eager.
* ``hand``: what a JAX user writes by hand: pow2 buckets padded on the host, one ``jax.jit``
  called at each bucket shape (compiles block), JAX's persistent compilation cache in a fresh
  directory; ``hand_restart``: a new process on that cache.  ``hand_warm*``: a thread compiles
  every bucket from shapes at start-up, as dynjax's ``*warm*`` modes (``hand_warm_restart``
  restarts on ``hand``'s or ``hand_warm``'s cache).
* ``dynjax_pow2`` / ``dynjax_auto`` / ``dynjax_value``: ``dynjax.flax.jit(serving=True)`` with
  ``pow2(16, 512)`` / ``auto(max_compiles=8)`` / ``auto(max_compiles=None)`` (value-decided)
  buckets (``dynjax_autoN``: ``auto(max_compiles=N)``) and a fresh ``cache_dir``; ``*_restart``: a new process on that cache_dir.
* ``dynjax_wait``: ``dynjax_pow2`` then ``f.wait()`` (every tier-up done) and a second pass
  over the stream (the "after tier-up" per-length row); ``dynjax_wait_restart`` restarts on it.
* ``*warm*``: the server starts ``f.warmup(..., background=True)`` from abstract arguments
  (``jax.eval_shape(module.init, ...)``) right after its imports, before it builds its requests
  and reads its weights (the start-up a server would write; ``*_restart`` of it too).
  Every cold mode starts on a fresh cache; ``X_restart`` and ``X_warm_restart`` restart on the
  cache of whichever of ``X`` and ``X_warm`` ran last.
* ``<mode>_again`` (e.g. ``dynjax_auto16_warm_wait_restart_again``): after the stream, the same
  stream again at once in the same process (what the first pass paid once: new exact shapes,
  first runs of loaded executables).
* ``<mode>_prof``: ``<mode>`` with its first ``--profile_first`` calls under cProfile before
  the timed stream (top entries in the record; its timings are not the protocol's).
* ``lengths``: per exact length (``--lengths``): the exact-shape AOT executable, dynjax's
  full-tier bucket executable (pow2, ``serving=False``: XLA's defaults) with ``padding="auto"``
  (the default: the padding pass) and ``"trust"`` (the model masks itself), the auto one
  loaded from the executable store by a second function, and torch eager, the median of
  ``--reps`` synced calls, numpy in/out.
* ``dynjax_trust_*``: the same modes with ``padding="trust"`` (the model masks by ``lengths``
  itself, as this one does: the bucket executable is exactly the hand-written one);
  ``*cudnn*``: with ``attention="cudnn"`` (the opt-in rewrite to cuDNN's fused attention; bf16);
  ``*pallas*``: with ``attention="pallas"`` (dynjax's Pallas flash attention; fp32 too).
  ``*_devout*``: ``host_outputs=False`` (outputs in device memory, the default before
  session 10; the default puts a numpy request's outputs in pinned host memory on GPU).
  ``*_startnew*`` (an experiment): a restart's new buckets (planned from the kept traffic, not
  in its store) compile at start-up on a big host, as in sessions 35-36 (session 37's
  ``*_defer*`` rows are today's default: they wait for traffic).
  ``*_bgtrace*`` / ``*_bgall*`` (experiments, session 38): a ``*warm*`` mode's
  ``f.warmup(...)`` called from a thread (its trace off the main thread) / the whole warm-up
  from shapes, Flax's abstract ``init`` included, on a thread; neither beat the default.
  ``*_nostore*``: no ``cache_dir`` (no executable store, no JAX cache: what the store's
  writes cost a cold start).  ``*_flat*``: ``DYNJAX_OUTLINE=0`` (the padding pass interprets
  and JAX lowers every layer, as before session 30; by default repeated layers are padded and
  lowered once a bucket).  ``*_pinned*``: ``DYNJAX_DIRECT_OUTPUTS=0`` (a numpy request's
  results through pinned host outputs, as before session 33; by default on a GPU the CUDA
  driver reads them from device outputs).  ``*_nokeep*``: ``DYNJAX_KEEP_TRAFFIC=0`` (a
  restart plans from nothing, as before session 34, not from the traffic the processes
  before it kept in its ``cache_dir``; restarts on the same cache as the mode without the
  tag; with ``--pristine-restarts`` every restart runs on a copy of the cache as the cold
  process left it, so an A/B of restarts does not depend on their order).  ``*_noprerun*``: ``DYNJAX_PRERUN=0`` (background builds do not run their executables once
  on zeros before they serve).  ``*t0tune*`` (an experiment, not an option): tier 0 autotunes its cuBLAS gemms (triton gemms
  stay off) instead of taking cuBLAS's heuristic choice; ``*t0lvl1*`` the same at autotune level 1
  (no buffer initialisation or correctness checks; the default since session 10);
  ``*t0lvl0*`` without autotuning (the default before).  ``*sw5*`` (an experiment): background
  lowering keeps the interpreter's 5 ms GIL switch interval instead of dropping it to 0.5 ms.
  ``*parN*``: XLA's ``xla_gpu_force_compilation_parallelism=N`` for every compile; ``*nice*``:
  the compile workers (and the threads they start) run at nice 10; ``*ladN*``: a cold ``auto``
  warm-up builds N buckets (``max`` and its halvings; ``_auto.WARM_LADDER``, 4); ``*waN*``: the
  warm-up builds N buckets at once (``wa1``: one at a time, dynjax's default before session
  35).  ``*nocb*`` (any mode, and
  ``lengths_nocb``): the child runs with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=``, XLA:GPU
  without CUDA graphs (every kernel launched on its own).

Per mode: start -> 1,000th answer (s), the stream (first request to last answer, s), the mean
latency over the second half of the requests per length bin (the request's padded length:
<=64, 65-128, 129-256, 257-512), the mean over all requests of that half, and the child's
phase timestamps (imports, backend, requests built, weights, first answer; dynjax's children
also ``imported`` (jax, Flax, dynjax) and, in ``*warm*`` modes, ``abstract`` (Flax's abstract
init done) and ``warmup_started``; JAX's ``host_weights``: the host arrays made, before their
upload).  Before the first mode one throwaway process reads every runtime's libraries
(``--no-prime``: not); with a ``lengths``
record in the same run, "x exact": the traffic-weighted mean over the exact-shape AOT cost of
the same requests (linear through the measured lengths; more lengths, a better curve).  JSON to
``<out>/serve_fresh_<dtype>.json``, a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import _isolated
from benchmarks import _xla_options as xla_options

BINS = ((1, 64), (65, 128), (129, 256), (257, 512))
DEFAULT_MODES = ("torch_eager,hand,hand_restart,dynjax_pow2,dynjax_pow2_restart,dynjax_auto,"
                 "dynjax_value,dynjax_value_restart,dynjax_wait,dynjax_wait_restart,lengths")


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None, help="directory for serve_fresh_<dtype>.json")
  p.add_argument("--modes", default=DEFAULT_MODES)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--size", default="base")
  p.add_argument("--requests", type=int, default=1000)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--max_len", type=int, default=512)
  p.add_argument("--lengths", default="37,141,300,450")
  p.add_argument("--reps", type=int, default=30)
  p.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
  p.add_argument("--pristine-restarts", action="store_true",
                 help="every restart runs on a copy of its cache as the cold process left it "
                      "(an A/B of restarts in any order: a restart's own background builds "
                      "do not reach the next restart)")
  p.add_argument("--profile_first", type=int, default=0,
                 help="dynjax modes: cProfile the first N calls (run before the timed stream)")
  p.add_argument("--rounds", type=int, default=1,
                 help="run --modes this many times, torch modes first in even rounds and last "
                      "in odd ones; the table adds each mode's start->last difference to the "
                      "same round's torch_eager (median, mean, range, rounds ahead)")
  p.add_argument("--no-prime", dest="prime", action="store_false",
                 help="no throwaway process reading every runtime's libraries before the "
                      "first mode (the first mode then pays the cold disk reads alone)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
  p.set_defaults(bytecode=None)
  return p.parse_args(argv)


# -- the child: one mode in a fresh process ----------------------------------------------------
class _Clock:
  """Seconds since the parent spawned this process (``SERVE_FRESH_T0``).  Beside each mark,
  ``work`` keeps the main thread's CPU seconds and the cyclic garbage collector's seconds
  and full (generation 2) collections so far, on any thread: a phase's wall time less its
  main-thread CPU is time the main thread waited (the GIL, the cores); its collections walk
  every tracked object of the process, the warm-up's included."""

  def __init__(self):
    self.t0 = float(os.environ.get("SERVE_FRESH_T0", time.time()))
    self.marks: dict[str, float] = {"interpreter": self.now()}
    self.work: dict[str, dict] = {}
    self._gc = {"seconds": 0.0, "full": 0, "main_seconds": 0.0}
    self._gc_start: dict[int, float] = {}
    self._main = threading.get_ident()
    self._threads: dict = {}
    import gc

    gc.callbacks.append(self._on_gc)

  def _on_gc(self, phase, info) -> None:
    ident = threading.get_ident()
    if phase == "start":
      self._gc_start[ident] = time.perf_counter()
      return
    dt = time.perf_counter() - self._gc_start.pop(ident, time.perf_counter())
    self._gc["seconds"] += dt
    if ident == self._main:
      self._gc["main_seconds"] += dt
    if info.get("generation") == 2:
      self._gc["full"] += 1

  def now(self) -> float:
    return time.time() - self.t0

  def mark(self, name: str, threads: bool = True) -> None:
    """``threads=False``: no ``busiest_threads`` here (reading ``/proc`` for each thread took
    3.6 ms with 80 threads on the CPU box: not inside a timed stream); the next mark's covers
    both phases."""
    self.marks[name] = round(self.now(), 4)
    sys.stderr.write(f"serve_fresh mark {name} {self.marks[name]}\n")  # (a hung child's phase)
    # The heap's size as pymalloc's allocated blocks: ``len(gc.get_objects())`` here raced a
    # warm-up thread building a tuple (CPython's "tupleobject.c: bad argument to internal
    # function" SystemError in JAX's tracing: the H100 run 35 lost a bucket to it).
    busy = None
    if threads:
      now = _thread_cpu()
      busy = sorted(((round((t - self._threads.get(k, (0, ""))[0]) / _TICKS, 3), tname)
                     for k, (t, tname) in now.items()), reverse=True)[:4]
      self._threads = now
    self.work[name] = {"main_cpu_s": round(time.thread_time(), 4),
                       "process_cpu_s": round(time.process_time(), 4),
                       "gc_s": round(self._gc["seconds"], 4),
                       "gc_main_s": round(self._gc["main_seconds"], 4),
                       "gc_full": self._gc["full"], "allocated_blocks": sys.getallocatedblocks(),
                       # the threads that used the most CPU since the last mark that read
                       # them ((s, name), busiest first; None: not read at this mark)
                       "busiest_threads": busy}


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu() -> dict:
  """``{tid: (CPU ticks, name)}`` of this process's threads (Linux ``/proc``; {} elsewhere):
  a thread the runtime starts that keeps a core busy (a driver thread polling) shows here."""
  out = {}
  try:
    tids = os.listdir("/proc/self/task")
  except OSError:
    return out
  for tid in tids:
    try:
      with open(f"/proc/self/task/{tid}/stat") as fh:
        stat = fh.read()
    except OSError:
      continue
    name = stat[stat.find("(") + 1:stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2:].split()
    out[tid] = (int(fields[11]) + int(fields[12]), f"{name}/{tid}")  # utime + stime
  return out


def _requests(args):
  from examples import data

  return data.request_stream(args.requests, batch=args.batch, max_len=args.max_len, seed=0,
                             vocab=30522)


def _model_cfg(args):
  from examples import models

  ecfg = models.ENCODER_SIZES[args.size]
  if args.max_len > ecfg.max_len:
    ecfg = models.EncoderConfig(**{**ecfg.__dict__, "max_len": args.max_len})
  return ecfg


def _jax_setup(args, clock, requests=True):
  import jax

  from examples import models

  clock.mark("imports")
  jax.devices()
  clock.mark("backend")
  reqs = _requests(args) if requests else None
  clock.mark("requests")
  ecfg = _model_cfg(args)
  module = models.BertEncoder(ecfg)
  raw = models.init_encoder_params(ecfg, seed=0)
  clock.mark("host_weights")  # (the weights' upload: from here to "weights")
  dt = jax.numpy.dtype(args.dtype)  # float32 or bfloat16
  variables = jax.device_put({"params": jax.tree.map(lambda a: a.astype(dt), raw)})
  jax.block_until_ready(variables)
  clock.mark("weights")
  return module, variables, reqs


def _serve(reqs, call, clock, second=None):
  """Runs the stream; returns per-request latencies (s) and the stream's wall time."""
  lat = []
  t_first = time.perf_counter()
  for i, r in enumerate(reqs):
    t = time.perf_counter()
    _to_numpy(call(r))  # numpy results (a device or torch output is synced here)
    lat.append(time.perf_counter() - t)
    if i == 0 and second is None:  # a second pass keeps the first pass's mark
      clock.mark("first_answer", threads=False)  # (inside the timed stream)
  stream = time.perf_counter() - t_first
  clock.mark(f"answer_{len(reqs)}" if second is None else f"answer_{len(reqs)}_{second}")
  return lat, stream


def _to_numpy(out):
  import numpy as np

  if hasattr(out, "detach"):  # torch
    return out.float().cpu().numpy()
  return np.asarray(out)


def _bins(reqs, lat) -> dict:
  half = len(reqs) // 2
  res = {}
  for lo, hi in BINS:
    xs = [x for r, x in zip(reqs[half:], lat[half:], strict=True) if lo <= r.tokens.shape[1] <= hi]
    res[f"{lo}-{hi}"] = 1e3 * statistics.fmean(xs) if xs else None
  res["all"] = 1e3 * statistics.fmean(lat[half:])
  return res


def _record(mode, reqs, lat, stream, clock, **extra) -> dict:
  hist: dict[int, int] = {}
  for r in reqs[len(reqs) // 2:]:  # the lengths the bins average over (for "x exact")
    hist[r.tokens.shape[1]] = hist.get(r.tokens.shape[1], 0) + 1
  return {"mode": mode, "start_to_last_s": clock.marks[f"answer_{len(reqs)}"],
          "stream_s": stream, "bins_ms": _bins(reqs, lat), "marks": clock.marks,
          "work": clock.work,
          "first_ms": 1e3 * lat[0], "requests": len(reqs), "lengths_second_half": hist,
          **extra}


def exact_cost(results):
  """``T -> ms`` of the exact-shape AOT executables from the ``lengths`` mode's points: made
  non-decreasing (noise), linear between them, flat below the first, proportional to T above
  the last (a conservative extrapolation: attention grows faster); None with < 2 points."""
  pts = sorted((int(t), row["exact_aot"]) for rec in results if rec.get("mode") == "lengths"
               for t, row in rec["per_length_ms"].items() if row.get("exact_aot"))
  if len(pts) < 2:
    return None
  for k in range(1, len(pts)):
    pts[k] = (pts[k][0], max(pts[k][1], pts[k - 1][1]))

  def cost(t):
    if t <= pts[0][0]:
      return pts[0][1]
    if t >= pts[-1][0]:
      return pts[-1][1] * t / pts[-1][0]
    k = next(k for k in range(1, len(pts)) if t <= pts[k][0])
    (t0, c0), (t1, c1) = pts[k - 1], pts[k]
    return c0 + (t - t0) * (c1 - c0) / (t1 - t0)
  return cost


def x_exact(bins, hist, cost) -> float | None:
  """Traffic-weighted mean of a mode's per-bin latencies over the exact-shape cost of the same
  requests (issue 18's "within 1.05x of the exact-shape AOT executables")."""
  if not hist or cost is None:
    return None
  num = den = 0.0
  for lo, hi in BINS:
    ts = [(int(t), n) for t, n in hist.items() if lo <= int(t) <= hi]
    if not ts or bins.get(f"{lo}-{hi}") is None:
      continue
    num += bins[f"{lo}-{hi}"] * sum(n for _, n in ts)
    den += sum(n * cost(t) for t, n in ts)
  return num / den if den else None


def _child_torch(args, clock):
  import torch

  from examples import models

  clock.mark("imports")
  dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  torch.zeros(1, device=dev)
  clock.mark("backend")
  reqs = _requests(args)
  clock.mark("requests")
  ecfg = _model_cfg(args)
  torch.set_float32_matmul_precision("high")
  model = models.torch_bert(models.init_encoder_params(ecfg, seed=0), ecfg, device=str(dev))
  if args.dtype == "bfloat16":
    model = model.to(torch.bfloat16)
  clock.mark("weights")

  def call(r):
    with torch.inference_mode():
      tok = torch.from_numpy(r.tokens).to(dev, non_blocking=True)
      lens = torch.from_numpy(r.lengths).to(dev, non_blocking=True)
      return model(tok, lens).float().cpu().numpy()

  lat, stream = _serve(reqs, call, clock)
  rec = _record("torch_eager", reqs, lat, stream, clock, torch=torch.__version__,
                device=str(dev))
  return rec


def _enable_jax_cache(path):
  import jax

  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _child_hand(args, clock, mode):
  import jax
  import numpy as np

  import dynjax

  _enable_jax_cache(args.cache)
  pol = dynjax.buckets.pow2(16, args.max_len)
  built: dict[int, object] = {}
  if "warm" in mode:  # as dynjax's *warm* modes: every bucket from shapes, in a thread
    _hand_warmup(args, pol, built)
    clock.mark("warmup_started")
  module, variables, reqs = _jax_setup(args, clock)
  apply = jax.jit(module.apply)

  def call(r):
    b, t = r.tokens.shape
    bt = pol.bucket(t)
    buf = np.zeros((b, bt), r.tokens.dtype)
    buf[:, :t] = r.tokens
    exe = built.get(bt)  # the warmup's executable once it is built, else jax.jit's call
    return np.asarray((exe or apply)(variables, buf, r.lengths))

  lat, stream = _serve(reqs, call, clock)
  extra = {"jax": jax.__version__}
  _again(mode, reqs, call, clock, extra)
  return _record(mode, reqs, lat, stream, clock, **extra)


def _again(mode, reqs, call, clock, extra) -> None:
  """``*_again``: the same stream again at once (what the first pass paid only once)."""
  if "_again" in mode:
    lat2, stream2 = _serve(reqs, call, clock, second="again")
    extra["again"] = {"stream_s": stream2, "bins_ms": _bins(reqs, lat2)}


def _abstract_model(args):
  """(module, abstract variables in the run's dtype, tokens and lengths specs at ``max_len``)
  from Flax's ``jax.eval_shape(module.init, ...)``: what a server has before its weights."""
  import jax
  import numpy as np

  from examples import models

  module = models.BertEncoder(_model_cfg(args))
  tokens = jax.ShapeDtypeStruct((args.batch, args.max_len), np.int32)
  lengths = jax.ShapeDtypeStruct((args.batch,), np.int32)
  shapes = jax.eval_shape(module.init, jax.random.key(0), tokens, lengths)
  dt = jax.numpy.dtype(args.dtype)  # float32 or bfloat16
  return module, {"params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dt),
                                         shapes["params"])}, tokens, lengths


def _hand_warmup(args, pol, built) -> None:
  """``hand_warm*``: what a JAX user would write for dynjax's start-up warmup: one thread
  lowers and compiles ``jax.jit(module.apply)`` at every pow2 bucket from shapes (largest
  first; JAX's persistent cache serves a restart) and publishes each executable."""
  import jax
  import numpy as np

  module, shapes, _, lengths = _abstract_model(args)
  apply = jax.jit(module.apply)

  def run():
    for bt in sorted(pol.sizes(), reverse=True):
      tokens = jax.ShapeDtypeStruct((args.batch, bt), np.int32)
      built[bt] = apply.lower(shapes, tokens, lengths).compile()

  threading.Thread(target=run, daemon=True).start()


def _policy(mode, args):
  import dynjax

  if "auto" in mode:  # "auto": auto(8); "auto16": auto(16)
    n = re.search(r"auto(\d*)", mode).group(1)
    return dynjax.buckets.auto(max_compiles=int(n or 8), min=16, max=args.max_len)
  if "value" in mode:
    return dynjax.buckets.auto(max_compiles=None, min=16, max=args.max_len)
  return dynjax.buckets.pow2(16, args.max_len)


def _warmup_from_shapes(args, build, clock, workers=None, mode=None):
  """``*warm*`` modes: right after the imports, before the requests or weights exist, the
  server builds its function and starts ``warmup(background=True)`` from abstract arguments
  (Flax's ``jax.eval_shape(module.init, ...)`` idiom): the first bucket compiles (a restart:
  the stored buckets load) while the process reads its weights.  ``workers``: buckets built
  at once (``waN`` tag: N, kept after the first call; default dynjax's: two at once on hosts
  of 12+ cores until the first call, since session 35; ``wa1`` = one at a time, as before)."""
  if mode is not None and "_bgall" in mode:  # experiment: the whole start-up warm-up (Flax's
    # abstract init included) in a thread of the server's: the main thread goes on at once
    from examples import models

    module = models.BertEncoder(_model_cfg(args))
    f = build(module)

    def run():
      _, shapes, tokens, lengths = _abstract_model(args)
      f.warmup(shapes, tokens, lengths, background=True, max_workers=workers)

    threading.Thread(target=run, name="serve-warmup", daemon=True).start()
    clock.mark("warmup_started")
    return f
  module, shapes, tokens, lengths = _abstract_model(args)
  clock.mark("abstract")
  f = build(module)
  if mode is not None and "_bgtrace" in mode:  # experiment: warmup (its trace) in a thread
    threading.Thread(target=f.warmup, args=(shapes, tokens, lengths), name="serve-warmup",
                     kwargs={"background": True, "max_workers": workers}, daemon=True).start()
  else:
    f.warmup(shapes, tokens, lengths, background=True, max_workers=workers)
  clock.mark("warmup_started")
  return f


def _child_dynjax(args, clock, mode):
  import jax

  import dynjax
  from dynjax import flax as dynjax_flax
  from dynjax.jit import _serving  # the experiment tags below set its module constants

  clock.mark("imported")  # jax, Flax and dynjax (a warm mode's "imports" mark comes later)
  if "t0tune" in mode:  # experiment: tier 0 autotunes cuBLAS gemms (triton gemms still off)
    _serving.QUICK_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
  if "t0lvl1" in mode:  # experiment: tier 0 autotunes at level 1 (no buffer init or checks)
    _serving.QUICK_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False,
                                  "xla_gpu_autotune_level": 1}
  if "t0lvl0" in mode:  # experiment: tier 0 without autotuning (the default before session 10)
    _serving.QUICK_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False,
                                  "xla_gpu_autotune_level": 0}
  if "t1xla" in mode:  # experiment: tier 1 with XLA's defaults (triton gemms on; before run 12)
    _serving.FULL_GPU_OPTIONS = {}
  if "t1before" in mode:  # experiment: tier-up before the first call too (before run 13)
    _serving.TIER_UP_BEFORE_TRAFFIC = True
  if "noup" in mode:  # experiment: no tier-up at all (quick tier only, unless wait())
    _serving.TIER_UP_IDLE_S = _serving.TIER_UP_AFTER = 1e12
  if "nokeep" in mode:  # experiment: a tier-up lowers its bucket again (before session 8)
    _serving.KEEP_LOWERED = 0
  if "sw5" in mode:  # experiment: lowering keeps the interpreter's 5 ms GIL switch interval
    _serving._QUICK_SWITCH_S = 5e-3
  par = re.search(r"par(\d+)", mode)  # experiment: XLA's compile threads per compile
  if par:
    for opts in (_serving.QUICK_GPU_OPTIONS, _serving.FULL_GPU_OPTIONS):
      opts["xla_gpu_force_compilation_parallelism"] = int(par.group(1))
  if "nice" in mode:  # experiment: compile workers (and the threads they start) at nice 10
    from dynjax.jit import _scheduler

    work = _scheduler.CompileScheduler._work

    def niced(self):
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
      return work(self)

    _scheduler.CompileScheduler._work = niced
  if "_startnew" in mode:  # experiment: a restart's new (kept-traffic) buckets compile before
    # traffic on a big host (the default of sessions 35-36; session 37: they wait for traffic)
    from dynjax.jit import _scheduler, _traffic

    _traffic.at_startup = lambda fam, bkey: _scheduler.startup_host() or bkey not in (
        _traffic._STATE.get(fam, {}).get("new", ()))
  ladder = re.search(r"lad(\d+)", mode)  # experiment: a cold auto warm-up builds N buckets
  if ladder:
    from dynjax.bucketing import _auto

    _auto.WARM_LADDER = int(ladder.group(1))
  workers = re.search(r"cw(\d+)", mode)  # experiment: compile_workers=N

  def build(module):
    return dynjax_flax.jit(module, dims={"tokens": "b, t", "lengths": "b"},
                           buckets={"t": _policy(mode, args)}, serving=True,
                           cache_dir=args.cache, padding="trust" if "trust" in mode else "auto",
                           attention=("cudnn" if "cudnn" in mode
                                      else "pallas" if "pallas" in mode else None),
                           compile_workers=int(workers.group(1)) if workers else None,
                           host_outputs=False if "devout" in mode else None)

  import logging

  timeline = []  # (s since spawn, "compiled|loaded <key> in <s>"): when each build finished

  class _Timeline(logging.Handler):
    def emit(self, record):
      msg = record.getMessage()[:160]
      if record.levelno >= logging.WARNING:  # a failure: its message and traceback's end
        msg = record.getMessage()[:400]
        if record.exc_info:
          import traceback

          msg += " | " + "".join(traceback.format_exception(*record.exc_info))[-1500:]
      timeline.append((round(clock.now(), 2), msg))
      sys.stderr.write(f"serve_fresh timeline {timeline[-1][0]} {msg[:160]}\n")

  logging.getLogger("dynjax").addHandler(_Timeline(logging.INFO))
  logging.getLogger("dynjax").setLevel(logging.INFO)
  built = build

  def build(module):  # noqa: F811 - every build logs its compiles and loads into the timeline
    g = built(module)
    g._dispatcher.cache.log = True
    return g

  f = None
  if "warm" in mode:  # a server's start-up: build (or load) in the background, from shapes
    wa = re.search(r"wa(\d+)", mode)  # experiment: the warm-up builds N buckets at once
    f = _warmup_from_shapes(args, build, clock, int(wa.group(1)) if wa else None, mode)
  module, variables, reqs = _jax_setup(args, clock)
  f = f or build(module)

  def call(r):
    return f(variables, r.tokens, r.lengths)

  prof = None
  if args.profile_first:  # where the first calls spend their time (cProfile, top entries)
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    head = reqs[: args.profile_first]
    pr.enable()
    for r in head:
      call(r)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
    prof = buf.getvalue()[-6000:]
    clock.mark("profiled_first")
  lat, stream = _serve(reqs, call, clock)
  st = f.stats()
  extra = {"stats": {k: st.get(k) for k in ("compiles", "loaded_from_store", "policies",
                                             "preruns", "lowerings", "lowering_seconds",
                                             "lowerings_reused",
                                             "served_on_larger_bucket", "waited_for_compile",
                                             "wait_seconds", "padded_fraction",
                                             "host_outputs", "direct_output_families",
                                             "direct_outputs_failed", "direct_inputs_failed")},
           "per_bucket_calls": st.get("per_bucket_calls"),
           "jax": jax.__version__, "dynjax_version": getattr(dynjax, "__version__", None)}
  if prof is not None:
    extra["profile_first"] = prof
  extra["timeline"] = list(timeline)
  if "_idle" in mode and "restart" not in mode:  # the same stream again once no compile runs
    extra["idle_s"] = _idle(f)
    lat2, stream2 = _serve(reqs, call, clock, second="after_idle")
    extra["after_idle"] = {"stream_s": stream2, "bins_ms": _bins(reqs, lat2)}
  _again(mode, reqs, call, clock, extra)
  if "_wait" in mode and "restart" not in mode:
    t = time.perf_counter()
    f.wait()
    extra["wait_s"] = time.perf_counter() - t
    lat2, stream2 = _serve(reqs, call, clock, second="after_wait")
    extra["after_wait"] = {"stream_s": stream2, "bins_ms": _bins(reqs, lat2)}
  return _record(mode, reqs, lat, stream, clock, **extra)


def _idle(f) -> float:
  """Waits until no background build runs or is queued, without forcing tier-1 (wait() would)."""
  t = time.perf_counter()
  sched = f._dispatcher.compiler.scheduler
  while sched is not None and (sched.running_jobs() or any(
      j.info[2] == 0 for j in sched.pending_jobs())):
    time.sleep(0.05)
  return time.perf_counter() - t


def _child_lengths(args, clock):
  import jax
  import numpy as np

  import dynjax
  from dynjax import flax as dynjax_flax
  from examples import models

  module, variables, _ = _jax_setup(args, clock, requests=False)
  lengths = [int(x) for x in args.lengths.split(",") if x]
  rng = np.random.default_rng(0)
  apply = jax.jit(module.apply)
  def dj(padding, cache=None, attention=None, host_outputs=None):
    return dynjax_flax.jit(module, dims={"tokens": "b, t", "lengths": "b"},
                           buckets={"t": dynjax.buckets.pow2(16, args.max_len)},
                           padding=padding, cache_dir=cache, attention=attention,
                           host_outputs=host_outputs)

  store = tempfile.mkdtemp(prefix="serve_fresh_lengths_")
  f, ft = dj("auto", store), dj("trust")
  fd = dj("trust", host_outputs=False)  # outputs in device memory (before session 10)
  tmodel = None
  if models.torch_available():
    import torch

    torch.set_float32_matmul_precision("high")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tmodel = models.torch_bert(models.init_encoder_params(_model_cfg(args), seed=0),
                               _model_cfg(args), device=dev)
    if args.dtype == "bfloat16":
      tmodel = tmodel.to(torch.bfloat16)

  def med(fn):
    for _ in range(3):
      fn()
    ts = []
    for _ in range(args.reps):
      t = time.perf_counter()
      fn()
      ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)

  ref_vars = None
  if args.dtype == "bfloat16":
    ref_vars = jax.device_put({"params": models.init_encoder_params(_model_cfg(args), seed=0)})
  def row_at(t):
    tok = rng.integers(1, 30522, (args.batch, t)).astype(np.int32)
    lens = np.full((args.batch,), t, np.int32)
    lens[0] = max(1, t // 2)
    exe = apply.lower(variables, tok, lens).compile()
    row = {"exact_aot": med(lambda: np.asarray(exe(variables, tok, lens)))}
    if jax.default_backend() == "gpu":  # the exact shape under dynjax's tier options
      from dynjax.jit import _serving

      for name, opts in (("exact_quick", _serving.QUICK_GPU_OPTIONS),
                         ("exact_triton_off", _serving.FULL_GPU_OPTIONS)):  # tier 1's today
        e = apply.lower(variables, tok, lens).compile(compiler_options=dict(opts))
        row[name] = med(lambda e=e: np.asarray(e(variables, tok, lens)))
    row |= {
           "dynjax_full": med(lambda: f(variables, tok, lens)),
           "dynjax_full_trust": med(lambda: ft(variables, tok, lens)),
           "dynjax_full_trust_devout": med(lambda: fd(variables, tok, lens))}
    fl = dj("auto", store)  # a second function: its bucket executable loads from the store
    row["dynjax_loaded"] = med(lambda: fl(variables, tok, lens))
    row["loaded_from_store"] = fl.stats().get("loaded_from_store")
    if jax.default_backend() == "gpu":  # the opt-in Pallas flash attention (fp32 too)
      fp, fpt = dj("auto", attention="pallas"), dj("trust", attention="pallas")
      row["dynjax_full_pallas"] = med(lambda: fp(variables, tok, lens))
      row["dynjax_full_trust_pallas"] = med(lambda: fpt(variables, tok, lens))
      want = np.asarray(exe(variables, tok, lens), np.float64)
      for name, fn in (("pallas_auto", fp), ("pallas_trust", fpt)):
        got = np.asarray(fn(variables, tok, lens), np.float64)
        row[f"maxerr_{name}_vs_exact"] = float(np.abs(got - want).max()
                                               / max(float(np.abs(want).max()), 1e-30))
    if args.dtype == "bfloat16":  # the opt-in cuDNN attention rewrite (true lengths under auto)
      fa, fat = dj("auto", attention="cudnn"), dj("trust", attention="cudnn")
      row["dynjax_full_cudnn"] = med(lambda: fa(variables, tok, lens))
      row["dynjax_full_trust_cudnn"] = med(lambda: fat(variables, tok, lens))
      # Exactness within bf16: each against the fp32 model at the exact shape (valid rows).
      ref = np.asarray(jax.jit(module.apply)(ref_vars, tok, lens), np.float64)
      scale = float(np.abs(ref).max())
      for name, fn in (("bf16_as_written", lambda: exe(variables, tok, lens)),
                       ("bf16_cudnn_auto", lambda: fa(variables, tok, lens)),
                       ("bf16_cudnn_trust", lambda: fat(variables, tok, lens))):
        got = np.asarray(np.asarray(fn()).astype(np.float32), np.float64)
        row[f"maxerr_{name}"] = float(np.abs(got - ref).max() / scale)
    if tmodel is not None:
      import torch

      def tcall():
        with torch.inference_mode():
          out = tmodel(torch.from_numpy(tok).to(dev), torch.from_numpy(lens).to(dev))
          return out.float().cpu().numpy()
      row["torch_eager"] = med(tcall)
    return row

  rows = {str(t): row_at(t) for t in lengths}
  return {"mode": args.child or "lengths", "per_length_ms": rows, "marks": clock.marks,
          "jax": jax.__version__}


def child(args) -> dict:
  clock = _Clock()
  mode = args.child
  if mode == "torch_eager":
    return _child_torch(args, clock)
  if mode.startswith("hand"):
    return _child_hand(args, clock, mode)
  if mode.startswith("dynjax_"):
    return _child_dynjax(args, clock, mode)
  if mode == "lengths" or mode.startswith("lengths_"):  # lengths_nocb: see _spawn
    return _child_lengths(args, clock)
  raise SystemExit(f"serve_fresh: unknown mode {mode!r}; modes: {DEFAULT_MODES}")


# -- the parent ------------------------------------------------------------------------------
def child_command(args, mode, cache) -> tuple[list[str], dict]:
  """The command line and environment of ``mode``'s child process (``_spawn``; a probe that
  watches a child, as ``probe_gil_holders.py``, starts the same process)."""
  cmd = [sys.executable, "-m", "benchmarks.serve_fresh", "--child", mode, "--dtype", args.dtype,
         "--size", args.size, "--requests", str(args.requests), "--batch", str(args.batch),
         "--max_len", str(args.max_len), "--lengths", args.lengths, "--reps", str(args.reps),
         "--profile_first", str(args.profile_first if mode.endswith("_prof") else 0)]
  if cache and "_nostore" not in mode:
    cmd += ["--cache", cache]
  # experiment nocb: XLA:GPU without CUDA graphs (command buffers) in every compile
  flags = xla_options.as_flags(xla_options.OPTION_SETS["nocb"]) if "nocb" in mode else ""
  env = dict(_isolated.env_with_xla_flags(flags) if flags else os.environ,
             SERVE_FRESH_T0=repr(time.time()))
  env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash prints every thread's stack (stderr)
  if args.bytecode:  # the checkout's modules compiled once, as an installed package ships them
    env["PYTHONPYCACHEPREFIX"] = args.bytecode
  if "_noprerun" in mode:  # background builds do not run their executables ahead
    env["DYNJAX_PRERUN"] = "0"
  if "_flat" in mode:  # the padding pass interprets every layer (no outlined template)
    env["DYNJAX_OUTLINE"] = "0"
  if "_pinned" in mode:  # results through pinned host outputs, not the driver's reads
    env["DYNJAX_DIRECT_OUTPUTS"] = "0"
  if "_nokeep" in mode:  # the traffic kept in cache_dir is neither read nor written
    env["DYNJAX_KEEP_TRAFFIC"] = "0"
  if "_noprealloc" in mode:  # JAX's GPU allocator grows on demand (JAX's documented switch):
    # the default reserves 75% of the GPU at the process's first transfer (session 39, H200)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  return cmd, env


def _spawn(args, mode, cache) -> dict:
  cmd, env = child_command(args, mode, cache)
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  _CHILD[0] = proc
  try:
    stdout, stderr = proc.communicate(timeout=args.timeout)
  except subprocess.TimeoutExpired:
    stacks = _hung_stacks(args, mode, proc)
    proc.kill()
    _, stderr = proc.communicate()
    return {"mode": mode, "error": f"timed out after {args.timeout:.0f} s",
            "stderr_tail": stderr[-6000:], "stacks_file": stacks}
  finally:
    _CHILD[0] = None
  lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
  if proc.returncode != 0 or not lines:
    return {"mode": mode, "error": f"rc={proc.returncode}: {stderr[-3000:]}"}
  return json.loads(lines[-1][len("RESULT "):])


def _hung_stacks(args, mode, proc) -> str | None:
  """Before a hung child is killed: every thread's Python stack (the child's SIGUSR1 handler,
  into its stderr) and, where ``py-spy`` or ``gdb`` is installed, the native stacks, into a
  file under ``--out`` (its path is returned)."""
  import shutil
  import signal

  proc.send_signal(signal.SIGUSR1)
  time.sleep(2)
  path = os.path.join(args.out or tempfile.gettempdir(), f"hang_{mode}_{proc.pid}.txt")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a") as fh:  # the GPU busy (a kernel spins) or idle (a host-side lock)?
    for cmd in (["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv"],):
      if shutil.which(cmd[0]):
        try:
          got = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
          fh.write(f"== {' '.join(cmd)}\n{got.stdout}{got.stderr}\n")
        except (subprocess.TimeoutExpired, OSError) as e:
          fh.write(f"== {cmd[0]}: {e}\n")
    fh.write("== threads (name, state, wchan)\n")
    for tid in sorted(os.listdir(f"/proc/{proc.pid}/task")):
      try:
        name = open(f"/proc/{proc.pid}/task/{tid}/comm").read().strip()
        state = open(f"/proc/{proc.pid}/task/{tid}/stat").read().split(") ")[1].split()[0]
        wchan = open(f"/proc/{proc.pid}/task/{tid}/wchan").read().strip()
      except OSError:
        continue
      fh.write(f"{tid} {name} {state} {wchan}\n")
  for cmd in (["py-spy", "dump", "--native", "--pid", str(proc.pid)],
              ["gdb", "-p", str(proc.pid), "-batch", "-ex", "thread apply all bt 30"]):
    if shutil.which(cmd[0]) is None:
      continue
    try:
      got = subprocess.run(cmd, capture_output=True, text=True, timeout=40)
    except (subprocess.TimeoutExpired, OSError) as e:
      got = None
      text = f"{cmd[0]}: {e}"
    else:
      text = got.stdout + got.stderr
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as fh:
      fh.write(f"== {' '.join(cmd)}\n{text}\n")
    if got is not None and got.returncode == 0:
      break
  return path if os.path.exists(path) else None


_CHILD: list = [None]  # the mode's process now running (killed with this one)


def _kill_child(signum, frame):
  # A parent stopped by `timeout` must not leave its child on the GPU: an orphaned child
  # contended with the next modes of the run and made their figures void (H100, issue 18).
  proc = _CHILD[0]
  if proc is not None and proc.poll() is None:
    proc.kill()
  raise SystemExit(128 + signum)


def main(argv=None) -> dict:
  args = _parse(argv)
  if args.child:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks a hung child
    rec = child(args)
    print("RESULT " + json.dumps(rec), flush=True)
    os._exit(0)  # background compile threads need not finish
  import signal

  signal.signal(signal.SIGTERM, _kill_child)
  signal.signal(signal.SIGINT, _kill_child)
  one = [m for m in args.modes.split(",") if m]
  runs = [(k, m) for k in range(args.rounds) for m in round_order(one, k)]
  tmp = tempfile.mkdtemp(prefix="serve_fresh_")
  args.bytecode = _compile_checkout(os.path.join(tmp, "pyc"))
  # The request list reads the stdlib's sources: read them once here, so that the first mode's
  # process does not pay the disk reads the later ones find in the page cache (session 30).
  _requests(args)
  if args.prime:
    _prime(args)
  caches: dict[str, str] = {}
  results = []
  out = _write(args, results)
  for k, mode in runs:
    cache, why = mode_cache(mode, caches, tmp, len(results), args.pristine_restarts)
    if why is not None:
      results.append({"mode": mode, "error": why})
      continue
    rec = _spawn(args, mode, cache)
    if args.rounds > 1:
      rec["round"] = k
    if args.pristine_restarts:
      keep_cold(mode, cache)
    results.append(rec)
    print(_line(rec), flush=True)
    out = _write(args, results)  # after every mode: a run cut short keeps what it measured
  print(table(results))
  shutil.rmtree(tmp, ignore_errors=True)
  return out


def mode_cache(mode: str, caches: dict, tmp: str, n: int,
               pristine: bool) -> tuple[str | None, str | None]:
  """``(cache directory, None)`` that ``mode``'s child runs on (None: no cache, a torch or
  ``lengths`` mode), or ``(None, why it cannot run)``.  A cold mode always starts on a fresh
  directory under ``tmp`` (``n`` keeps names apart; a repeated mode too: the same directory
  made its second run a restart) and ``caches`` keeps it for the restarts after it; a restart
  takes the latest, or with ``pristine`` a copy of it as its cold process left it
  (:func:`keep_cold`)."""
  if not mode.startswith(("hand", "dynjax_")):
    return None, None
  restart, base = cache_key(mode)
  if not restart:
    caches[base] = os.path.join(tmp, f"{mode}-{n}")
    return caches[base], None
  if base not in caches:
    return None, f"needs {base} earlier in --modes"
  if not pristine:
    return caches[base], None
  cold, cache = caches[base] + ".cold", os.path.join(tmp, f"{mode}-{n}")
  if not os.path.isdir(cold):
    return None, f"{base} left no cache to restart on"
  shutil.copytree(cold, cache, symlinks=True)
  return cache, None


def keep_cold(mode: str, cache: str | None) -> None:
  """After a cold mode's child: a copy of its cache as it left it, for the pristine restarts
  (:func:`mode_cache`)."""
  if cache and not cache_key(mode)[0] and os.path.isdir(cache):
    shutil.copytree(cache, cache + ".cold", symlinks=True)


_PRIME = """
import importlib
for name in ("jax", "flax.linen", "torch", "dynjax", "examples.models"):
  try:
    importlib.import_module(name)
  except Exception:  # noqa: BLE001 - a runtime the run does not use (torch on a CPU box)
    pass
import jax
jax.devices()
try:
  import torch
  torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
except Exception:  # noqa: BLE001
  pass
"""


def _prime(args) -> None:
  """Before the first mode: one throwaway process imports every runtime and starts its
  backend, so that the first mode's process does not alone read jaxlib's, torch's and CUDA's
  libraries from disk (a fresh GPU machine each call; in 2 of session 38's 4 calls the first
  process was the slowest of its mode to finish its imports, by 0.5-2.1 s; in the other two
  it was the fastest: a precaution, not a measured fix)."""
  env = dict(os.environ)
  if args.bytecode:
    env["PYTHONPYCACHEPREFIX"] = args.bytecode
  try:
    subprocess.run([sys.executable, "-c", _PRIME], env=env, timeout=args.timeout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
  except subprocess.TimeoutExpired:
    pass


def _compile_checkout(prefix: str) -> str | None:
  """Compiles the checkout's packages (dynjax, examples, benchmarks) to bytecode under
  ``prefix`` (``PYTHONPYCACHEPREFIX`` of every child), once.  A pip-installed package ships its
  ``.pyc`` files, as torch, jax and flax do on the GPU machine; the checkout, run there under
  ``PYTHONDONTWRITEBYTECODE=1``, would compile dynjax's ~90 modules from source in every fresh
  process (0.23 s on the 2-core CPU box: dynjax's import 0.29 s from source, 0.065 s from
  bytecode), a cost the torch modes do not pay.  None where compiling fails (the children
  then compile from source, as before)."""
  import compileall
  import importlib.util

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  saved = sys.pycache_prefix
  sys.pycache_prefix = prefix  # where importlib (and so compileall) puts and finds bytecode
  try:
    ok = all(compileall.compile_dir(os.path.join(root, pkg), quiet=2)
             for pkg in ("dynjax", "examples", "benchmarks"))
    probe = importlib.util.cache_from_source(os.path.join(root, "dynjax", "__init__.py"))
    return prefix if ok and os.path.exists(probe) else None
  except Exception:  # noqa: BLE001 - a benchmark's fairness step must not stop the run
    return None
  finally:
    sys.pycache_prefix = saved


def round_order(modes: list[str], k: int) -> list[str]:
  """Round ``k``'s order of ``modes``: as given in even rounds; in odd ones the torch modes
  move to the end (they may run first or last; a restart stays after its cold mode)."""
  if k % 2 == 0:
    return list(modes)
  return ([m for m in modes if not m.startswith("torch")]
          + [m for m in modes if m.startswith("torch")])


def paired(results) -> dict:
  """Per mode, over the rounds that ran it beside ``torch_eager``: its start->last answer
  minus torch eager's of the same round (s) and its stream over torch's."""
  torch = {r["round"]: r for r in results
           if r.get("mode") == "torch_eager" and "round" in r and "error" not in r}
  out: dict = {}
  for r in results:
    t = torch.get(r.get("round"))
    if t is None or r is t or "error" in r or "start_to_last_s" not in r:
      continue
    d = out.setdefault(r["mode"], {"diff_s": [], "stream_x": []})
    d["diff_s"].append(r["start_to_last_s"] - t["start_to_last_s"])
    d["stream_x"].append(r["stream_s"] / t["stream_s"])
  for d in out.values():
    diffs = d["diff_s"]
    d.update(n=len(diffs), median_s=statistics.median(diffs), mean_s=statistics.fmean(diffs),
             ahead=sum(x < 0 for x in diffs))
  return out


def cache_key(mode: str) -> tuple[bool, str]:
  """(whether ``mode`` restarts, the mode whose cache it uses).  ``_prof`` and ``_warm`` change
  what a process does at start-up only: ``X_warm_restart`` and ``X_restart`` restart on the
  cache of ``X`` or ``X_warm``, whichever ran last (every cold mode gets a fresh cache)."""
  m = (mode.removesuffix("_prof").replace("_again", "").replace("_noprerun", "")
       .replace("_nostore", "").replace("_nokeep", "").replace("_defer", "")
       .replace("_startnew", ""))
  return m.endswith("_restart"), m.removesuffix("_restart").replace("_warm", "")


def _write(args, results) -> dict:
  out = {"config": vars(args), "results": results, "python": sys.version.split()[0]}
  for name in ("jax", "torch"):
    try:
      out[name] = __import__(name).__version__
    except Exception:  # noqa: BLE001 - not installed
      pass
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"serve_fresh_{args.dtype}.json")
    with open(path, "w") as fh:
      json.dump(out, fh, indent=1)
  return out


def _line(rec) -> str:
  if "error" in rec:
    return f"{rec['mode']}: ERROR {rec['error'][-600:]}"
  if rec["mode"].startswith("lengths"):
    return f"{rec['mode']}: " + json.dumps(rec["per_length_ms"])
  b = rec["bins_ms"]
  s = (f"{rec['mode']}: start->last {rec['start_to_last_s']:.2f} s, stream {rec['stream_s']:.2f} s, "
       + ", ".join(f"{k} {v:.2f}" for k, v in b.items() if v is not None) + f" | marks {rec['marks']}")
  if "after_wait" in rec:
    s += f" | wait {rec['wait_s']:.1f} s, after: " + ", ".join(
        f"{k} {v:.2f}" for k, v in rec["after_wait"]["bins_ms"].items() if v is not None)
  if "stats" in rec:
    s += f" | stats {rec['stats']}"
  return s


def table(results) -> str:
  cost = exact_cost(results)
  head = "| mode | start->last answer s | stream s | " + " | ".join(
      f"T {lo}-{hi} ms" for lo, hi in BINS) + " | all ms | x exact |"
  rows = [head, "|" + "---|" * (5 + len(BINS))]

  def tail(b, rec):
    x = x_exact(b, rec.get("lengths_second_half"), cost)
    return f" | {b['all']:.2f} | " + (f"{x:.3f}" if x is not None else "") + " |"
  for rec in results:
    if "error" in rec or rec.get("mode", "").startswith("lengths"):
      continue
    b = rec["bins_ms"]
    cells = [f"{b[f'{lo}-{hi}']:.2f}" if b.get(f"{lo}-{hi}") is not None else "" for lo, hi in BINS]
    rows.append(f"| {rec['mode']} | {rec['start_to_last_s']:.1f} | {rec['stream_s']:.2f} | "
                + " | ".join(cells) + tail(b, rec))
    for key, what, secs in (("again", "again at once", None),
                            ("after_idle", "again, no compile running", "idle_s"),
                            ("after_wait", "after wait()", "wait_s")):
      if key in rec:
        a = rec[key]["bins_ms"]
        cells = [f"{a[f'{lo}-{hi}']:.2f}" if a.get(f"{lo}-{hi}") is not None else ""
                 for lo, hi in BINS]
        took = f" ({rec[secs]:.0f} s)" if secs else ""
        rows.append(f"| {rec['mode']} {what}{took} | | "
                    f"{rec[key]['stream_s']:.2f} | " + " | ".join(cells) + tail(a, rec))
  for rec in results:
    if rec.get("mode", "").startswith("lengths"):
      keys = next(iter(rec["per_length_ms"].values())).keys()
      rows += [f"\n{rec['mode']}:\n| T | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
      for t, row in rec["per_length_ms"].items():
        rows.append(f"| {t} | " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v)
                                             for v in row.values()) + " |")
  pairs = paired(results)
  if pairs:
    rows += ["\nagainst torch_eager in the same round (start->last answer, s; stream, x):",
             "| mode | rounds | median | mean | range | rounds ahead | stream x |",
             "|---|---|---|---|---|---|---|"]
    for mode, d in pairs.items():
      rows.append(f"| {mode} | {d['n']} | {d['median_s']:+.2f} | {d['mean_s']:+.2f} | "
                  f"{min(d['diff_s']):+.2f} .. {max(d['diff_s']):+.2f} | {d['ahead']} of "
                  f"{d['n']} | {min(d['stream_x']):.2f}-{max(d['stream_x']):.2f} |")
  return "\n".join(rows)


if __name__ == "__main__":
  main()
