"""The benchmark suite behind ``python -m benchmarks WORKLOAD``.

One run compares every mode on the same seeded request stream, in one process:

| mode            | what it is |
|-----------------|------------|
| ``jit``         | ``jax.jit`` called on each request's exact shape: one compile per new shape |
| ``oracle``      | the same, with every exact shape compiled beforehand (compile time excluded) |
| ``pad_max``     | ``jax.jit`` on requests padded on the host to ``max_len``: one compile |
| ``dynjax_pow2`` | ``dynjax.jit`` with ``buckets.pow2(16, max_len)`` |
| ``dynjax_auto`` | ``dynjax.jit`` with ``buckets.auto(max_compiles=8, max=max_len)`` |
| ``dynjax_warmup`` | ``dynjax_pow2`` after ``f.warmup()`` (its concurrent compiles counted in the total) |
| ``torch_eager`` / ``torch_compile`` | PyTorch twins (same weights), eager and ``torch.compile(dynamic=True)``, TF32 on; only when torch imports |

Every mode is fed the way a user would: numpy host batches in, numpy out (``--device_sync``,
default on, converts each result to numpy, so every request's latency includes the device work
and the copy back).  Parameters are put on the device once, before timing.

Two passes over the stream: pass 1 from cold gives the total time including compiles and the
cumulative curve; pass 2 gives the steady-state latencies (requests of pass 2 that still
compiled, e.g. after an ``auto`` re-plan, are left out).  Compiles are counted with a
``jax.monitoring`` listener on ``/jax/core/compile/backend_compile_duration`` (minus persistent
cache hits, ``/jax/compilation_cache/cache_hits``), not with dynjax's own counters.

Because ``jit`` over 1,000 requests of BERT-base on a GPU means ~277 compiles of ~5 s,
``--jit_budget_s`` stops that mode once its budget is spent and extrapolates the rest
(remaining new shapes x its mean compile cost + remaining requests x its steady latency); the
table marks such figures with ``~``.  ``--oracle_max_shapes`` likewise compiles the oracle for
an evenly spread subset of the distinct shapes (concurrently), and ratios to the oracle are
then taken over the requests of those shapes only (paired: the same requests for every mode).

Workloads plug in through :data:`WORKLOADS`: an entry names a module and a builder
``build(config) -> Workload`` (or, for a stand-alone script, a file run as a subprocess).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
DEFAULT_MODES = ("jit", "oracle", "aot_bucket", "pad_max", "dynjax_pow2", "dynjax_auto",
                 "dynjax_warmup", "torch_eager", "torch_compile", "dynjax_serve",
                 "dynjax_serve_auto", "dynjax_restart", "dynjax_restart_auto")
TORCH_MODES = ("torch_eager", "torch_compile")


# -----------------------------------------------------------------------------------------------
# Compile counting
# -----------------------------------------------------------------------------------------------
class CompileCounter:
  """Counts XLA backend compiles process-wide through ``jax.monitoring`` (installed once)."""

  _instance: CompileCounter | None = None
  _install_lock = threading.Lock()

  def __init__(self):
    self.events = 0
    self.cache_hits = 0
    self.seconds = 0.0
    self._lock = threading.Lock()

  @classmethod
  def get(cls) -> CompileCounter:
    with cls._install_lock:
      if cls._instance is None:
        import jax.monitoring

        inst = cls()
        jax.monitoring.register_event_duration_secs_listener(inst._on_duration)
        jax.monitoring.register_event_listener(inst._on_event)
        cls._instance = inst
      return cls._instance

  def _on_duration(self, event: str, duration: float, **_):
    if event == COMPILE_EVENT:
      with self._lock:
        self.events += 1
        self.seconds += duration

  def _on_event(self, event: str, **_):
    if event == CACHE_HIT_EVENT:
      with self._lock:
        self.cache_hits += 1

  @property
  def compiles(self) -> int:
    """Backend compiles that were not served by the persistent compilation cache."""
    return self.events - self.cache_hits

  def snapshot(self) -> tuple[int, int, float]:
    return self.compiles, self.cache_hits, self.seconds


# -----------------------------------------------------------------------------------------------
# Workload and mode contracts
# -----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
  """Options of one run (built from the absl flags; tests build it directly)."""

  workload: str = "bert"
  size: str = "tiny"
  requests: int = 200
  max_len: int = 512
  batch: int = 8
  seed: int = 0
  modes: tuple[str, ...] = DEFAULT_MODES
  device_sync: bool = True
  persistent_cache_dir: str | None = None
  out: str | None = "bench_out"
  padding: str = "trust"
  steady_passes: int = 1
  jit_budget_s: float | None = None
  oracle_max_shapes: int = 0
  async_compile: bool = False
  dispatch_iters: int = 2000
  plot: bool = True
  progress: bool = True
  quick: bool = False
  extra_args: tuple[str, ...] = ()
  isolate: tuple[str, ...] = ()  # modes run start to end in a fresh process each


@dataclasses.dataclass
class Mode:
  """One way of running the workload.

  Attributes:
    name: the mode's key (``"jit"``, ``"dynjax_pow2"``...).
    run: ``request -> output`` (numpy, jax or torch values; the suite converts to numpy when
      ``--device_sync``).
    label: one line for the table, e.g. the policy.
    setup: work before pass 1: returns nothing; timed, and counted in the total unless
      ``setup_counted`` is False (the oracle's compiles).
    setup_counted: whether ``setup`` time belongs to the mode's total.
    between_passes: called after pass 1 (e.g. wait for background compiles).
    stats: extra counters for the JSON (dynjax's ``stats()``).
    padded_fraction: ``() -> float`` padded share of executed elements, if the mode pads.
    compiles: ``() -> int`` compiles not visible to ``jax.monitoring`` (torch).
    only: indices of the requests the mode runs (the oracle's subset); None means all.
    sync: converts an output to host memory (default: numpy for jax/numpy/torch values).
    external: filled by ``setup`` when the mode ran in another process (a restarted server):
      its record (``total_s``, ``compiles``, ``stats``...); the mode then takes no steady pass.
  """

  name: str
  run: Callable[[Any], Any]
  label: str = ""
  setup: Callable[[], Any] | None = None
  setup_counted: bool = True
  between_passes: Callable[[], Any] | None = None
  stats: Callable[[], dict] | None = None
  padded_fraction: Callable[[], float] | None = None
  compiles: Callable[[], int | None] | None = None
  only: Sequence[int] | None = None
  sync: Callable[[Any], Any] | None = None
  external: dict | None = None


@dataclasses.dataclass
class Workload:
  """A request stream and the modes that serve it.

  Attributes:
    name: the workload's name.
    description: one line for the table header.
    requests: the stream; every request has an integer ``length`` (the x axis, and the
      per-length-bucket grouping).
    modes: mode name -> ``factory(ctx) -> Mode``, built lazily in the order of ``--modes``.
      ``ctx`` is a :class:`ModeContext`.
    shape_key: request -> hashable exact shape (for ``jit``'s new-shape count and the oracle).
    info: extra facts for the JSON (model sizes, data summary...).
  """

  name: str
  description: str
  requests: list
  modes: dict[str, Callable[[ModeContext], Mode]]
  shape_key: Callable[[Any], Any] = lambda r: r.length
  info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ModeContext:
  """What a mode factory gets: the run's config, the stream and a dict shared across modes."""

  config: Config
  workload: Workload
  oracle_indices: list[int]
  shared: dict


class ModeUnavailable(Exception):
  """Raised by a mode factory when the mode cannot run here (e.g. torch is not installed)."""


def child_mode(name: str, ctx: ModeContext, run_as: str | None = None,
               steady: bool = True) -> Mode:
  """Runs mode ``run_as`` (default ``name``) in a NEW process (``benchmarks._child``): its
  cold pass (timed as in :func:`cold_mode`) and, with ``steady``, one steady pass right after.

  Why: XLA keeps in-process caches (GPU autotuning results per gemm shape, among others), so
  a mode run after another that compiled the same shapes compiles faster than a user's fresh
  process would.  Isolated modes start from nothing; serving modes get the cache directory
  ``ctx.shared["cache_dirs"][run_as]`` (made here), which a later restart mode reuses.
  """
  run_as = run_as or name
  dirs = ctx.shared.setdefault("cache_dirs", {})
  if not steady and run_as not in dirs:
    raise ModeUnavailable(f"needs {run_as} earlier in --modes (it fills the cache)")
  if run_as.startswith("dynjax_serve") and run_as not in dirs:
    import tempfile

    dirs[run_as] = tempfile.mkdtemp(prefix=f"dynjax_{run_as}_")
  cfg = dataclasses.replace(ctx.config, modes=(run_as,), out=None, plot=False, progress=False,
                            dispatch_iters=0, isolate=())
  payload = json.dumps({"config": dataclasses.asdict(cfg), "mode": run_as,
                        "cache_dirs": dirs, "steady": steady})
  result: dict = {}

  def setup():
    proc = subprocess.run([sys.executable, "-m", "benchmarks._child", payload],
                          capture_output=True, text=True, timeout=1800, env=_child_env())
    if proc.returncode != 0:
      raise RuntimeError(f"the {run_as} process failed: {proc.stderr[-2000:]}")
    result.update(json.loads(proc.stdout.strip().splitlines()[-1]))

  def run(r):
    raise AssertionError("not called: the mode runs in its own process")

  label = ("restarted in a new process from " + run_as + "'s cache_dir" if not steady
           else "in its own process")
  return Mode(name, run, setup=setup, setup_counted=False, only=[], label=label,
              external=result)


# -----------------------------------------------------------------------------------------------
# Progress
# -----------------------------------------------------------------------------------------------
class _Progress:
  def __init__(self, total: int, desc: str, enabled: bool):
    self._bar = None
    self._n = 0
    self._total = total
    self._desc = desc
    self._enabled = enabled
    self._last = 0.0
    if enabled:
      try:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr,
                         dynamic_ncols=True)
      except ImportError:
        pass

  def update(self, n: int = 1) -> None:
    if not self._enabled:
      return
    if self._bar is not None:
      self._bar.update(n)
      return
    self._n += n
    now = time.perf_counter()
    if now - self._last > 0.2 or self._n == self._total:
      self._last = now
      w = 30
      fill = int(w * self._n / max(self._total, 1))
      sys.stderr.write(f"\r{self._desc} [{'#' * fill}{'.' * (w - fill)}] {self._n}/{self._total}")
      sys.stderr.flush()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    elif self._enabled:
      sys.stderr.write("\r" + " " * (len(self._desc) + 50) + "\r")
      sys.stderr.flush()


# -----------------------------------------------------------------------------------------------
# Running
# -----------------------------------------------------------------------------------------------
def to_host(x):
  """Numpy copies of every leaf of ``x`` (jax arrays, torch tensors, numpy): forces a sync."""
  import jax

  def one(v):
    if isinstance(v, np.ndarray):
      return v
    if hasattr(v, "detach") and hasattr(v, "cpu"):
      return v.detach().cpu().numpy()
    return np.asarray(v)

  return jax.tree_util.tree_map(one, x)


def _pass(mode: Mode, requests: list, indices: Sequence[int], cfg: Config, counter: CompileCounter,
          desc: str, budget_s: float | None = None):
  sync = mode.sync or to_host
  lat = np.full(len(requests), np.nan)
  compiled = np.zeros(len(requests), bool)
  done: list[int] = []
  bar = _Progress(len(indices), desc, cfg.progress)
  out = None
  start = time.perf_counter()
  try:
    for i in indices:
      c0 = counter.events
      t0 = time.perf_counter()
      out = mode.run(requests[i])
      if cfg.device_sync:
        out = sync(out)
      t1 = time.perf_counter()
      lat[i] = (t1 - t0) * 1e3
      compiled[i] = counter.events != c0
      done.append(i)
      bar.update()
      if budget_s is not None and t1 - start > budget_s:
        break
    if not cfg.device_sync and out is not None:
      sync(out)
  finally:
    bar.close()
  return lat, compiled, done, time.perf_counter() - start


def _length_buckets(max_len: int) -> list[int]:
  edges = [16]
  while edges[-1] < max_len:
    edges.append(min(edges[-1] * 2, max_len))
  return edges


def _bucket_label(edges: list[int], n: int) -> str:
  lo = 1
  for e in edges:
    if n <= e:
      return f"{lo}-{e}"
    lo = e + 1
  return f">{edges[-1]}"


def cold_mode(name: str, factory, ctx: ModeContext, counter: CompileCounter):
  """Builds one mode and times its cold pass (pass 1) over the stream.

  Returns:
    ``(record, mode, done)``; ``mode`` is None when the mode was skipped or failed (the record
    then says why), ``done`` the indices pass 1 ran.
  """
  cfg, wl = ctx.config, ctx.workload
  reqs = wl.requests
  res: dict[str, Any] = {"name": name}
  c0, h0, s0 = counter.snapshot()
  t_build = time.perf_counter()
  try:
    mode = factory(ctx)
  except ModeUnavailable as e:
    return {"name": name, "skipped": str(e)}, None, []
  build_s = time.perf_counter() - t_build
  res["label"] = mode.label
  indices = list(range(len(reqs))) if mode.only is None else list(mode.only)
  setup_s = 0.0
  try:
    if mode.setup is not None:
      t0 = time.perf_counter()
      mode.setup()
      setup_s = time.perf_counter() - t0
    if mode.external is not None:  # ran in its own process: take its record as it is
      label = res.get("label", "")
      res.update(mode.external)
      res["label"] = (res.get("label") or "") + " [" + label + "]"
      res.update({"external_process": True, "process_s": setup_s, "setup_counted": False})
      return res, None, []
    c_setup = counter.snapshot()
    budget = cfg.jit_budget_s if name == "jit" else None
    lat1, comp1, done1, wall1 = _pass(mode, reqs, indices, cfg, counter, f"{name} cold", budget)
    c_pass1 = counter.snapshot()
    if mode.between_passes is not None:
      mode.between_passes()
    # Background compiles (async_compile) that finish after pass 1 are compiles of this mode.
    c_pass1 = (counter.snapshot()[0],) + tuple(c_pass1[1:])
  except Exception as e:  # one broken mode must not lose the others' figures
    import traceback

    traceback.print_exc()
    return {"name": name, "label": mode.label, "error": f"{type(e).__name__}: {e}"}, None, []
  res.update({
      "build_s": build_s,
      "setup_s": setup_s,
      "setup_counted": mode.setup_counted,
      "measured_requests": len(done1),
      "requests_in_mode": len(indices),
      "pass1_s": wall1,
      "total_s": (setup_s + build_s if mode.setup_counted else 0.0) + wall1,
      "compiles": c_pass1[0] - (c0 if mode.setup_counted else c_setup[0]),
      "compiles_setup": c_setup[0] - c0,
      "persistent_cache_hits": c_pass1[1] - h0,
      "compile_seconds_monitored": c_pass1[2] - s0,
      "pass1_latency_ms": lat1.tolist(),
      "pass1_compiled": comp1.tolist(),
      "_indices": indices,
  })
  return res, mode, done1


def steady_phase(live: list, cfg: Config, wl: Workload, counter: CompileCounter) -> None:
  """Pass 2 (and more with ``--steady_passes``), interleaved: request by request, every live
  mode in a rotating order, so a noisy neighbour on the machine slows all modes alike."""
  n = len(wl.requests)
  steady = {id(m): np.full(n, np.nan) for _, m, _ in live}
  sets = {id(m): set(done) for _, m, done in live}
  before = counter.snapshot()[0]
  total = sum(len(s) for s in sets.values()) * max(cfg.steady_passes, 1)
  bar = _Progress(total, "steady (all modes)", cfg.progress)
  try:
    for k in range(max(cfg.steady_passes, 1)):
      for i in range(n):
        r = wl.requests[i]
        order = live[i % len(live):] + live[:i % len(live)] if live else []
        for _, mode, _ in order:
          if i not in sets[id(mode)]:
            continue
          sync = mode.sync or to_host
          c0 = counter.events
          t0 = time.perf_counter()
          out = mode.run(r)
          if cfg.device_sync:
            sync(out)
          dt = (time.perf_counter() - t0) * 1e3
          if not cfg.device_sync:
            sync(out)
          if counter.events != c0:
            dt = np.nan  # a compile (e.g. an auto re-plan): not steady state
          st = steady[id(mode)]
          st[i] = dt if k == 0 or not np.isfinite(st[i]) else min(st[i], dt)
          bar.update()
  finally:
    bar.close()
  del before
  for res, mode, _ in live:
    res["steady_latency_ms"] = steady[id(mode)].tolist()


def finish_mode(res: dict, mode: Mode, wl: Workload, counter_after: tuple) -> None:
  """Adds the framework counters, stats and the jit budget extrapolation to a record."""
  reqs = wl.requests
  indices = res.pop("_indices")
  done1 = [i for i in indices if np.isfinite(res["pass1_latency_ms"][i])]
  if mode.compiles is not None:
    extra = mode.compiles()
    if extra is not None:
      res["compiles"] = extra
      res["compiles_note"] = "counted by the framework (not jax.monitoring)"
  if len(done1) < len(indices):
    rest = indices[len(done1):]
    seen = {wl.shape_key(reqs[i]) for i in done1}
    new_shapes = len({wl.shape_key(reqs[i]) for i in rest} - seen)
    lat1 = np.array(res["pass1_latency_ms"], float)
    comp1 = np.array(res["pass1_compiled"], bool)
    st = np.array(res["steady_latency_ms"], float)[done1]
    st_mean = float(np.nanmean(st)) if np.isfinite(st).any() else float(np.nanmean(lat1))
    cold = lat1[done1][comp1[done1]]
    compile_ms = max(float(np.mean(cold)) - st_mean, 0.0) if len(cold) else 0.0
    res["extrapolated"] = True
    res["extrapolated_new_shapes"] = new_shapes
    res["mean_compile_ms"] = compile_ms
    res["total_s"] += (new_shapes * compile_ms + len(rest) * st_mean) / 1e3
    res["compiles"] += new_shapes
  if mode.padded_fraction is not None:
    res["padded_fraction"] = float(mode.padded_fraction())
  if mode.stats is not None:
    try:
      res["stats"] = _jsonable(mode.stats())
      res["fallbacks"] = len(res["stats"].get("fallbacks", []))
    except Exception as e:  # stats are informative only
      res["stats"] = {"error": str(e)}
  del counter_after


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, float | int | str | bool) or x is None:
    return x
  return repr(x)


def summarize(results: list[dict], wl: Workload, cfg: Config) -> None:
  """Adds p50/p99/mean, the paired ratio to the oracle and per-length-bucket medians."""
  lengths = np.array([r.length for r in wl.requests])
  edges = _length_buckets(max(cfg.max_len, int(lengths.max()) if len(lengths) else 16))
  labels = [_bucket_label(edges, int(n)) for n in lengths]
  oracle = next((r for r in results if r["name"] == "oracle" and "steady_latency_ms" in r), None)
  o_lat = np.array(oracle["steady_latency_ms"]) if oracle else None
  for r in results:
    if "steady_latency_ms" not in r:
      continue
    st = np.array(r["steady_latency_ms"], float)
    ok = np.isfinite(st)
    if ok.any():
      r["p50_ms"] = float(np.percentile(st[ok], 50))
      r["p99_ms"] = float(np.percentile(st[ok], 99))
      r["mean_ms"] = float(st[ok].mean())
    if o_lat is not None:
      both = ok & np.isfinite(o_lat)
      if both.any():
        r["ratio_vs_oracle"] = float(st[both].sum() / o_lat[both].sum())
        r["ratio_requests"] = int(both.sum())
    per: dict[str, float] = {}
    for lab in dict.fromkeys(_bucket_label(edges, e) for e in edges):
      sel = ok & np.array([x == lab for x in labels])
      if sel.any():
        per[lab] = float(np.median(st[sel]))
    r["per_length_bucket_ms"] = per
    if "padded_fraction" not in r:
      r["padded_fraction"] = 0.0


# -----------------------------------------------------------------------------------------------
# Dispatch overhead
# -----------------------------------------------------------------------------------------------
def time_calls(fn, arg, iters: int, sync: bool, warmup: int = 50, loops: int = 5,
               reduce=min) -> float:
  """Microseconds per call of ``fn(arg)``: ``loops`` loops of ``iters`` calls, reduced.

  ``sync``: every result goes to numpy (a host copy and sync per call); otherwise only the
  last result of each loop is waited for (pure dispatch).
  """
  import jax

  r = None
  for _ in range(warmup):
    r = fn(arg)
  jax.block_until_ready(r)
  times = []
  for _ in range(loops):
    t0 = time.perf_counter()
    if sync:
      for _ in range(iters):
        np.asarray(fn(arg))
    else:
      for _ in range(iters):
        r = fn(arg)
      jax.block_until_ready(r)
    times.append((time.perf_counter() - t0) / iters * 1e6)
  return float(reduce(times))


def measure_dispatch(iters: int = 2000) -> dict:
  """Per-call cost on a cache hit of a tiny function: dynjax.jit vs jax.jit.

  ``async``: device-array input, no sync (pure dispatch).  ``numpy``: numpy (8, 13) in, numpy
  out (dynjax pads 13 -> 16 on the host and unpads on the host).  Best of 5 loops.
  """
  import jax
  import jax.numpy as jnp

  import dynjax

  def tiny(x):
    return x * 2.0 + 1.0

  jf = jax.jit(lambda x: tiny(x))
  df = dynjax.jit(lambda x: tiny(x), dims={"x": "b, t"},
                  buckets={"t": dynjax.buckets.pow2(16, 64)}, padding="trust")
  x16 = jnp.ones((8, 16), jnp.float32)
  x13 = np.ones((8, 13), np.float32)

  def best(fn, arg, sync):
    return time_calls(fn, arg, iters, sync, warmup=20, reduce=min)

  out = {
      "jax_jit_async_us": best(jf, x16, False),
      "dynjax_async_us": best(df, x16, False),
      "jax_jit_numpy_us": best(jf, x13, True),
      "dynjax_numpy_padded_us": best(df, x13, True),
      "iters": iters,
  }
  out["overhead_async_us"] = out["dynjax_async_us"] - out["jax_jit_async_us"]
  out["overhead_numpy_us"] = out["dynjax_numpy_padded_us"] - out["jax_jit_numpy_us"]
  return out


# -----------------------------------------------------------------------------------------------
# Versions, table, JSON, plot
# -----------------------------------------------------------------------------------------------
def versions() -> dict:
  """Python, jax, jaxlib, flax, numpy, torch versions and the device (for the JSON and table)."""
  import jax
  import jaxlib

  v: dict[str, Any] = {
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": getattr(jaxlib, "__version__", "?"),
      "numpy": np.__version__,
      "platform": platform.platform(),
      "cpu_count": os.cpu_count(),
  }
  try:
    import flax

    v["flax"] = flax.__version__
  except ImportError:
    v["flax"] = None
  try:
    import torch

    v["torch"] = torch.__version__
    v["torch_cuda"] = torch.cuda.is_available()
  except Exception:
    v["torch"] = None
  dev = jax.devices()[0]
  v["backend"] = jax.default_backend()
  v["device_kind"] = dev.device_kind
  v["device_count"] = jax.device_count()
  return v


def _fmt(x, spec: str, approx: bool = False) -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "-"
  return ("~" if approx else "") + format(x, spec)


def format_table(report: dict) -> str:
  """The terminal table (also stored in the JSON as ``table``)."""
  v = report["versions"]
  cfg = report["config"]
  lines = []
  lines.append(f"python -m benchmarks {report['workload']} ({report['description']})")
  lines.append(
      f"python {v['python']} | jax {v['jax']} | jaxlib {v['jaxlib']} | flax {v.get('flax')} | "
      f"torch {v.get('torch')} | {v['backend']}: {v['device_kind']} x{v['device_count']}")
  st = report.get("stream", {})
  lines.append(
      f"stream: {st.get('requests')} requests of batch {cfg['batch']}, seed {cfg['seed']}, "
      f"max_len {cfg['max_len']}, {st.get('distinct_lengths')} distinct lengths, mean length "
      f"{st.get('mean_length', 0):.1f}; padding={cfg['padding']!r}, "
      f"device_sync={cfg['device_sync']}")
  head = (f"{'mode':<15}{'total s':>10}{'compiles':>9}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
          f"{'x oracle':>9}{'padded':>8}  notes")
  lines.append(head)
  lines.append("-" * len(head))
  for r in report["modes"]:
    if "skipped" in r:
      lines.append(f"{r['name']:<15}  skipped: {r['skipped']}")
      continue
    if "error" in r:
      lines.append(f"{r['name']:<15}  ERROR: {r['error'][:150]}")
      continue
    ex = bool(r.get("extrapolated"))
    notes = r.get("label", "")
    if ex:
      notes += (f" [ran {r['measured_requests']}/{r['requests_in_mode']} requests, "
                f"rest extrapolated]")
    if r["name"] == "oracle":
      notes += " [compile time excluded]"
    if r.get("persistent_cache_hits"):
      notes += f" [{r['persistent_cache_hits']} persistent-cache hits]"
    lines.append(
        f"{r['name']:<15}{_fmt(r.get('total_s'), '.2f', ex):>10}"
        f"{_fmt(r.get('compiles'), 'd', ex):>9}{_fmt(r.get('p50_ms'), '.2f'):>9}"
        f"{_fmt(r.get('p99_ms'), '.2f'):>9}{_fmt(r.get('mean_ms'), '.2f'):>9}"
        f"{_fmt(r.get('ratio_vs_oracle'), '.2f'):>9}"
        f"{_fmt(100 * r.get('padded_fraction', 0.0), '.1f'):>7}%  {notes}")
  ok = [r for r in report["modes"] if "per_length_bucket_ms" in r]
  if ok:
    cols = sorted(dict.fromkeys(k for r in ok for k in r["per_length_bucket_ms"]),
                  key=lambda c: int(c.lstrip(">").split("-")[0]))
    lines.append("")
    lines.append("steady-state median ms per request, by request length:")
    lines.append(f"{'mode':<15}" + "".join(f"{c:>10}" for c in cols))
    for r in ok:
      lines.append(f"{r['name']:<15}" + "".join(
          f"{_fmt(r['per_length_bucket_ms'].get(c), '.2f'):>10}" for c in cols))
  d = report.get("dispatch")
  if d:
    lines.append("")
    lines.append(
        f"dispatch on a cache hit (tiny function): jax.jit {d['jax_jit_async_us']:.1f} us, "
        f"dynjax {d['dynjax_async_us']:.1f} us (+{d['overhead_async_us']:.1f}) async; numpy "
        f"in/out: jax.jit {d['jax_jit_numpy_us']:.1f} us, dynjax (padded 13->16) "
        f"{d['dynjax_numpy_padded_us']:.1f} us (+{d['overhead_numpy_us']:.1f})")
  by = {r["name"]: r for r in report["modes"] if "total_s" in r}
  best_dj = min((r for n, r in by.items() if n.startswith("dynjax")),
                key=lambda r: r["total_s"], default=None)
  if best_dj is not None:
    lines.append("")
    for other in ("jit", "pad_max", "torch_compile", "torch_eager"):
      if other in by and best_dj["total_s"] > 0:
        lines.append(f"end to end: {best_dj['name']} is {by[other]['total_s'] / best_dj['total_s']:.1f}x "
                     f"faster than {other} ({best_dj['total_s']:.2f} s vs "
                     f"{'~' if by[other].get('extrapolated') else ''}{by[other]['total_s']:.2f} s)")
  return "\n".join(lines)


def plot(report: dict, path: str) -> str | None:
  """Writes the PNG: steady latency vs request length per mode, and cumulative time."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  lengths = np.array(report["lengths"])
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
  for r in report["modes"]:
    if "steady_latency_ms" not in r:
      continue
    st = np.array(r["steady_latency_ms"], float)
    ok = np.isfinite(st)
    if not ok.any():
      continue
    pts = ax1.scatter(lengths[ok], st[ok], s=6, alpha=0.35)
    per = {}
    for n, v in zip(lengths[ok], st[ok], strict=True):
      per.setdefault(int(n), []).append(v)
    xs = sorted(per)
    ys = [float(np.median(per[x])) for x in xs]
    if len(xs) > 8:  # a running median reads better than one dot per length
      k = max(3, len(xs) // 25)
      ys = [float(np.median(ys[max(0, i - k):i + k + 1])) for i in range(len(ys))]
    ax1.plot(xs, ys, label=r["name"], color=pts.get_facecolor()[0][:3])
    lat1 = np.array(r["pass1_latency_ms"], float)
    order = [i for i in range(len(lat1)) if np.isfinite(lat1[i])]
    if order:
      base = (r["setup_s"] if r.get("setup_counted") else 0.0) + r.get("build_s", 0.0) * bool(
          r.get("setup_counted"))
      cum = base + np.cumsum(lat1[order]) / 1e3
      ax2.plot(np.arange(1, len(cum) + 1), cum, label=r["name"],
               linestyle="--" if r.get("extrapolated") else "-")
  ax1.set_xlabel("request length (tokens, longest of the batch)")
  ax1.set_ylabel("steady-state latency per request (ms)")
  ax1.set_title("latency vs length (dots: requests; line: running median)")
  ax1.set_yscale("log")
  ax1.legend(fontsize=8)
  ax2.set_xlabel("requests served")
  ax2.set_ylabel("cumulative time incl. compiles (s)")
  ax2.set_title("cold start: cumulative time (pass 1)")
  ax2.set_yscale("log")
  ax2.legend(fontsize=8)
  v = report["versions"]
  fig.suptitle(f"python -m benchmarks {report['workload']} — {v['device_kind']}, jax {v['jax']}",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# -----------------------------------------------------------------------------------------------
# Registry
# -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WorkloadEntry:
  """Where a workload lives.

  Either ``modules`` (tried in order) holding ``build(config) -> Workload`` (the suite times its
  modes, prints the table, writes JSON and plot) or ``run(flags: dict, out_dir) -> dict`` (a
  self-contained benchmark; its ``format_table(result)`` is printed when present), or a
  ``script`` path (relative to the repository root) run as a subprocess.
  """

  description: str
  modules: tuple[str, ...] = ()
  builder: str = "build"
  script: str | None = None
  owner: str = ""


WORKLOADS: dict[str, WorkloadEntry] = {
    "bert": WorkloadEntry("Flax Linen BERT-style encoder (--size tiny|small|base), pooled output",
                          ("benchmarks._workloads",), "bert"),
    "encoder": WorkloadEntry("Flax-free jax.numpy transformer encoder with a length mask",
                             ("benchmarks._workloads",), "encoder"),
    "lstm": WorkloadEntry("LSTM text classifier with lengths (lax.scan over time)",
                          ("benchmarks._workloads",), "lstm"),
    "decode": WorkloadEntry("greedy decoding of docstring prompts (control-flow VM)",
                            ("benchmarks.decode",),
                            owner="the VM issue (4)"),
    "treelstm": WorkloadEntry("Tree-LSTM over standard-library ASTs (control-flow VM)",
                              ("benchmarks.treelstm",),
                              owner="the VM issue (4)"),
    "moe": WorkloadEntry("mixture-of-experts FFN with skewed routing + MoE encoder e2e",
                         ("benchmarks.moe",), "run_cli", owner="the routing issue (6)"),
}


def register_workload(name: str, entry: WorkloadEntry) -> None:
  """Adds or replaces a workload (other modules may call this at import)."""
  WORKLOADS[name] = entry


def _repo_root() -> str:
  """The directory that holds ``benchmarks/`` (what ``python -m benchmarks`` needs on the path)."""
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict:
  """The environment of a child ``python -m benchmarks...``: the repository root on
  ``PYTHONPATH``, so the child finds this package whatever its working directory; JAX's GPU
  memory on demand (unless set): the parent already holds 75% of the GPU, and a child that
  pre-allocated 75% of the rest left PyTorch 31 MiB (the H200 demo's torch_eager OOM)."""
  path = os.environ.get("PYTHONPATH")
  return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ,
          "PYTHONPATH": _repo_root() + (os.pathsep + path if path else "")}


class WorkloadNotAvailable(Exception):
  """The workload's module or script does not exist (yet)."""


def _runner_flags(cfg: Config) -> dict:
  flags: dict[str, Any] = {"seed": cfg.seed}
  if cfg.quick:
    flags["quick"] = True
  for a in cfg.extra_args:  # KEY=VALUE pairs after the workload name
    k, sep, v = a.lstrip("-").partition("=")
    if sep:
      try:
        flags[k] = json.loads(v)
      except ValueError:
        flags[k] = v
  return flags


def load_workload(cfg: Config):
  """Returns a :class:`Workload`, or an ``int`` exit code when the workload ran on its own."""
  entry = WORKLOADS.get(cfg.workload)
  if entry is None:
    raise WorkloadNotAvailable(
        f"unknown workload {cfg.workload!r}; choose one of {sorted(WORKLOADS)}")
  owner = entry.owner or "another issue"
  if entry.script is not None:
    path = os.path.join(_repo_root(), entry.script)
    if not os.path.exists(path):
      raise WorkloadNotAvailable(
          f"workload {cfg.workload!r} is not available yet: {entry.script} does not exist "
          f"(it belongs to {owner})")
    args = list(cfg.extra_args)
    if cfg.out and "--out" not in args:
      args += ["--out", cfg.out]
    if cfg.quick and "--small" not in args:
      args.append("--small")
    cmd = [sys.executable, path, *args]
    print("running", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=_repo_root())
  mod = None
  for name in entry.modules:
    try:
      mod = importlib.import_module(name)
      break
    except ModuleNotFoundError as e:
      if not (e.name and name.startswith(e.name)):
        raise
  if mod is None:
    raise WorkloadNotAvailable(
        f"workload {cfg.workload!r} is not available yet: none of the modules "
        f"{list(entry.modules)} exists (it belongs to {owner})")
  build = getattr(mod, entry.builder, None)
  if build is not None:
    return build(cfg)
  runner = getattr(mod, "run", None)
  if runner is None:
    raise WorkloadNotAvailable(
        f"workload {cfg.workload!r} is not available yet: {mod.__name__} has neither "
        f"{entry.builder}(config) nor run(flags, out_dir)")
  res = runner(_runner_flags(cfg), cfg.out)
  fmt = getattr(mod, "format_table", None)
  if fmt is not None:
    print(fmt(res))
  if cfg.out:
    print(f"results in {cfg.out}")
  return 0


def run(cfg: Config) -> dict | int:
  """Runs one benchmark: every mode, dispatch overhead, table, JSON and plot.

  Returns:
    The report dict (also written to ``<out>/<workload>.json``), or a script's exit code.
  """
  import jax

  if cfg.persistent_cache_dir:
    os.makedirs(cfg.persistent_cache_dir, exist_ok=True)
  if cfg.isolate and not os.environ.get("DYNJAX_BENCH_STREAM_CACHE"):
    import tempfile

    # Child processes read the request stream from here instead of parsing the stdlib again.
    os.environ["DYNJAX_BENCH_STREAM_CACHE"] = tempfile.mkdtemp(prefix="dynjax_stream_")
  counter = CompileCounter.get()
  wl = load_workload(cfg)
  if isinstance(wl, int):
    return wl
  reqs = wl.requests
  shapes: dict[Any, int] = {}
  for i, r in enumerate(reqs):
    shapes.setdefault(wl.shape_key(r), i)
  reps = sorted(shapes.values(), key=lambda i: reqs[i].length)
  if cfg.oracle_max_shapes and len(reps) > cfg.oracle_max_shapes:
    pick = np.unique(np.linspace(0, len(reps) - 1, cfg.oracle_max_shapes).round().astype(int))
    keep = {wl.shape_key(reqs[reps[k]]) for k in pick}
    oracle_idx = [i for i, r in enumerate(reqs) if wl.shape_key(r) in keep]
  else:
    oracle_idx = list(range(len(reqs)))
  ctx = ModeContext(config=cfg, workload=wl, oracle_indices=oracle_idx, shared={})
  lengths = np.array([r.length for r in reqs])
  report: dict[str, Any] = {
      "workload": wl.name,
      "description": wl.description,
      "config": _jsonable(dataclasses.asdict(cfg)),
      "versions": versions(),
      "info": _jsonable(wl.info),
      "stream": {"requests": len(reqs), "distinct_lengths": int(len(np.unique(lengths))),
                 "distinct_shapes": len(shapes),
                 "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
                 "max_length": int(lengths.max()) if len(lengths) else 0},
      "lengths": lengths.tolist(),
      "modes": [],
  }
  t_all = time.perf_counter()
  live = []
  for name in cfg.modes:
    factory = wl.modes.get(name)
    if factory is not None and name in cfg.isolate:
      factory = functools.partial(child_mode, name)
    if factory is None:
      report["modes"].append({"name": name, "skipped": f"not defined for {wl.name}"})
      continue
    print(f"[{time.perf_counter() - t_all:6.1f}s] mode {name}: cold pass ...", file=sys.stderr,
          flush=True)
    res, mode, done = cold_mode(name, factory, ctx, counter)
    report["modes"].append(res)
    if mode is not None:
      live.append((res, mode, done))
  print(f"[{time.perf_counter() - t_all:6.1f}s] steady state, all modes interleaved ...",
        file=sys.stderr, flush=True)
  c_before = counter.snapshot()
  steady_phase(live, cfg, wl, counter)
  report["compiles_in_steady_phase"] = counter.snapshot()[0] - c_before[0]
  for res, mode, _ in live:
    finish_mode(res, mode, wl, counter.snapshot())
  del live
  summarize(report["modes"], wl, cfg)
  if cfg.dispatch_iters > 0:
    print(f"[{time.perf_counter() - t_all:6.1f}s] dispatch overhead ...", file=sys.stderr,
          flush=True)
    report["dispatch"] = measure_dispatch(cfg.dispatch_iters)
  report["wall_s"] = time.perf_counter() - t_all
  report["table"] = format_table(report)
  print(report["table"], flush=True)
  if cfg.out:
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, f"{wl.name}.json")
    if cfg.plot:
      png = plot(report, os.path.join(cfg.out, f"{wl.name}.png"))
      report["plot"] = png
    with open(path, "w") as fh:
      json.dump(_jsonable(report), fh, indent=1)
    print(f"wrote {path}" + (f" and {report.get('plot')}" if report.get("plot") else ""))
  del jax
  return report


def _pool_map(fn, items, workers: int):
  """Runs ``fn`` over ``items`` in threads (XLA compiles release the GIL)."""
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    return list(pool.map(fn, items))
