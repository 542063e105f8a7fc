"""Counters of a ``dynjax.jit`` function, its ``stats()`` dict and its ``explain()`` report.

:class:`Counters` is the one place calls are counted.  Padded calls count on their executor
(``Executor.n``, one increment under the lock, summed here on ``stats()``); exact and
program calls count here directly.  :func:`combine` adds the ``stats()`` of several functions
(the Flax NNX wrapper keeps one per graph structure).
"""

from __future__ import annotations

import threading
from collections import Counter

from dynjax.jit import _args, _casts, _placement


class Counters:
  """Call counters of one wrapped function (thread-safe: every write holds ``lock``)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.calls = 0  # folded calls of every kind
    self.padded_calls = 0  # folded calls on padded executables
    self.misses = 0  # padded calls whose executable was not ready (built, waited, larger)
    self.exact_calls = 0
    self.syncs = 0
    self.true = 0
    self.padded = 0
    self.larger = 0  # calls served on a larger compiled bucket than their own
    self.bucket_calls: Counter = Counter()
    self.waits = 0  # calls that waited for a compile (or a stored executable)
    self.wait_seconds = 0.0
    self.checks = 0
    self.lowerings = 0  # buckets lowered (traced, padded, lowered to StableHLO)
    self.lowering_seconds = 0.0
    self.lowerings_reused = 0  # tier-1 recompiles that took their tier-0 build's lowering
    self.stored_rebuilt = 0  # stored executables that failed their first run, compiled again
    self.live: list = []  # executors whose own counts are not folded yet
    self._sweep_at = 64  # len(live) at which register() next lets the replaced ones go

  # -- writes (each under the lock) ----------------------------------------------------------
  def register(self, ex) -> None:
    """An executor kept for later calls: its counts are summed on read.  Once the list has
    doubled since the last sweep, the replaced ones are let go (:meth:`sweep`; all of them
    past 4,096)."""
    with self.lock:
      if len(self.live) >= self._sweep_at:
        self._sweep(full=len(self.live) >= 4096)
      self.live.append(ex)

  def sweep(self) -> None:
    """Folds and lets go the replaced executors (their family's ``gen`` moved on), so that
    none keeps a replaced executable alive (a tier-0 one after its tier-up, an evicted one);
    a call still running on one folds its own count as it ends (``Executor.once``; before
    session 36 such late counts were lost).  ``Dispatcher.resolve`` sweeps once a ``gen``."""
    with self.lock:
      self._sweep(full=False)

  def _sweep(self, full: bool) -> None:
    keep = []
    for old in self.live:
      if full or old.gen != old.fam.gen:
        self._fold(old)
        old.once = True
      else:
        keep.append(old)
    self.live = keep
    self._sweep_at = max(64, 2 * len(keep))

  def fold(self, ex) -> None:
    """Moves a one-off executor's counts into the totals."""
    with self.lock:
      self._fold(ex)

  def _fold(self, ex) -> None:
    n, ex.n = ex.n, 0
    if n:
      self.calls += n
      self.padded_calls += n
      self.bucket_calls[ex.bucket_id] += n
      self.padded += n * ex.padded_elems
      self.true += n * ex.true_elems
      self.syncs += n if ex.sync else 0
      self.larger += n if ex.larger else 0

  def lowered(self, seconds: float) -> None:
    with self.lock:
      self.lowerings += 1
      self.lowering_seconds += seconds

  def reused_lowering(self) -> None:
    with self.lock:
      self.lowerings_reused += 1

  def rebuilt_stored(self) -> None:
    with self.lock:
      self.stored_rebuilt += 1

  def miss(self) -> None:
    with self.lock:
      self.misses += 1

  def waited(self, seconds: float) -> None:
    with self.lock:
      self.waits += 1
      self.wait_seconds += seconds

  def unpadded(self, fid: int, kind: str, elems: int, sync: bool) -> None:
    """One exact-shape (``kind="exact"``) or host-program (``"program"``) call."""
    with self.lock:
      self.calls += 1
      self.bucket_calls[(fid, kind)] += 1
      if kind == "exact":
        self.exact_calls += 1
        self.true += elems
        self.padded += elems
      self.syncs += sync

  # -- reads -------------------------------------------------------------------------------
  def calls_so_far(self) -> int:
    """Calls so far, read without the lock (a heuristic's input: the compile scheduler asks
    under its own lock)."""
    return self.calls + sum(ex.n for ex in list(self.live))

  def bucket_uses(self, bucket_id) -> int:
    return self.bucket_calls.get(bucket_id, 0) + sum(
        ex.n for ex in list(self.live) if ex.bucket_id == bucket_id)

  def snapshot(self) -> dict:
    """Totals with the live executors' counts added."""
    with self.lock:
      c = {"calls": self.calls, "padded_calls": self.padded_calls,
           "bucket_calls": Counter(self.bucket_calls), "padded": self.padded,
           "true": self.true, "syncs": self.syncs, "larger": self.larger}
      for ex in self.live:
        n = ex.n
        if n:
          c["calls"] += n
          c["padded_calls"] += n
          c["bucket_calls"][ex.bucket_id] += n
          c["padded"] += n * ex.padded_elems
          c["true"] += n * ex.true_elems
          c["syncs"] += n if ex.sync else 0
          c["larger"] += n if ex.larger else 0
      c["hits"] = c["padded_calls"] - self.misses
      return c


def stats_dict(d) -> dict:
  """``Wrapped.stats()`` of a dispatcher ``d``."""
  c = d.counters.snapshot()
  fams = d.all_families
  per_bucket: dict[str, int] = {}
  for (fid, bkey), n in sorted(c["bucket_calls"].items(), key=str):
    fam = fams[fid]
    if bkey in ("exact", "program"):
      label = "exact (unpadded)" if bkey == "exact" else "control-flow program (VM)"
    else:
      label = ", ".join(f"{v}={b}" for v, b in zip(fam.sig.var_order, bkey, strict=True))
    per_bucket[label] = per_bucket.get(label, 0) + n
  cache, sched, counters = d.cache, d.compiler.scheduler, d.counters
  return {
      "calls": c["calls"],
      "compiles": cache.compiles,
      "cache_hits": c["hits"],
      "compile_seconds": cache.compile_seconds,
      "lowerings": counters.lowerings,  # Python holding the GIL, apart from the compiles
      "lowering_seconds": counters.lowering_seconds,
      "lowerings_reused": counters.lowerings_reused,
      "per_bucket_calls": per_bucket,
      "padded_fraction": (0.0 if not c["padded"] else 1.0 - c["true"] / c["padded"]),
      "exact_calls": counters.exact_calls,
      "fallbacks": list(d.fallbacks),
      "host_syncs": c["syncs"],
      "evictions": cache.evictions,
      "executables": len(cache),
      "loaded_from_store": cache.loads,
      "stored_rebuilt": counters.stored_rebuilt,  # of the compiles: loaded ones that failed
      "served_on_larger_bucket": c["larger"],
      "preruns": d.compiler.prerunner.describe(),
      "cast_once": {"leaves": sum(len(f.casts) for f in fams.values()),
                    "conversions": sum(f.cast_memo.conversions for f in fams.values())},
      "host_outputs": sum(1 for f in fams.values() if f.host_out),
      # padded numpy inputs in reused pinned host buffers (jit/_placement.py; GPU, >= 2 MiB)
      "pinned_input_bytes": sum(f.host_buffers.pinned_bytes for f in fams.values()),
      "pinned_inputs_failed": next((f.host_buffers.pinned_failed for f in fams.values()
                                    if f.host_buffers.pinned_failed), None),
      # small numpy inputs of sync calls copied by the CUDA driver (jit/_cuda.py; GPU)
      "direct_input_bytes": sum(f.host_buffers.direct_bytes for f in fams.values()),
      "direct_inputs_failed": next((f.host_buffers.direct_failed for f in fams.values()
                                    if f.host_buffers.direct_failed), None),
      # host requests' results read by the CUDA driver from device outputs (GPU)
      "direct_output_families": sum(1 for f in fams.values() if _placement.reads_planned(f)),
      "direct_outputs_failed": next((f.host_buffers.reads_failed for f in fams.values()
                                     if f.host_buffers.reads_failed), None),
      "device_pads": d.devpads.describe(),  # jit/_devpad.py (device requests)
      "waited_for_compile": counters.waits,
      "wait_seconds": counters.wait_seconds,
      "background": (None if sched is None else {
          "workers": sched.workers, "done": sched.done, "failed": sched.failed,
          "busy_seconds": sched.busy_seconds, "running": len(sched.running()),
          "pending": len(sched.pending())}),
      "policies": d.policies.describe(),
      "programs": [fam.program.describe() for fam in fams.values()
                   if fam.program is not None],
  }


def combine(parts: list[dict]) -> dict:
  """The ``stats()`` of several functions added up (``padded_fraction`` weighted by calls)."""
  if len(parts) == 1:
    return parts[0]
  total: dict = {}
  for s in parts:
    for k, v in s.items():
      if isinstance(v, int | float) and not isinstance(v, bool) and k != "padded_fraction":
        total[k] = total.get(k, 0) + v
      elif isinstance(v, dict):
        d = total[k] = total.get(k) or {}
        for kk, vv in v.items():
          d[kk] = (d.get(kk, 0) + vv if isinstance(vv, int | float)
                   and not isinstance(vv, bool) else vv)  # seconds add up too
      elif isinstance(v, list):
        total.setdefault(k, []).extend(v)
      elif total.get(k) is None:  # a description (str) or None: the first that says something
        total[k] = v
  if parts:
    weights = [max(s.get("calls", 0), 1) for s in parts]
    total["padded_fraction"] = sum(
        w * s.get("padded_fraction", 0.0) for w, s in zip(weights, parts, strict=True)
    ) / sum(weights)
  return total


def explain(d) -> str:
  """``Wrapped.explain()``: symbolic signature, output shape functions, bucket plan and
  expected waste, equations the padding pass rewrote, fallbacks and why."""
  opts = d.opts
  lines = [f"dynjax.jit({d.name}): padding={opts.padding!r}, overflow={opts.overflow!r}"]
  if not d.families:
    lines.append("  (not traced yet: call it or use .trace(*args))")
  waste = stats_dict(d)["padded_fraction"]
  for fam in d.families.values():
    sig = fam.sig
    names = d.binder.static_names
    at = ", ".join(f"{n}={v!r}" for n, v in zip(names, fam.key[0], strict=True)
                   if v is not _args.OMITTED)
    lines.append(f"family {fam.fid}: mode={fam.mode}" + (f" (static {at})" if at else ""))
    runner = fam.program
    if runner is not None:
      desc = runner.describe()
      lines.append(f"  host program: {desc['segments']} compiled segments, control ops "
                   f"{desc['control_ops']}" if desc["compiled"] else
                   f"  host program: runs op by op ({desc['reason']})")
    lines.append("  inputs:")
    for path, spec, a in zip(fam.leaf_paths, sig.leaves, fam.avals, strict=True):
      dims = ", ".join(map(str, spec.dims if spec is not None else a.shape))
      lines.append(f"    {path}: {a.dtype}[{dims}]{'' if spec else '  (static)'}")
    if fam.converted:
      lines.append("  inputs converted to the traced dtypes (x64 is off, as in jax.jit): "
                   + ", ".join(f"{p} {a} -> {b}" for p, a, b in sorted(fam.converted)))
    if fam.out_avals is not None:
      lines.append("  outputs (shape functions of the dims):")
      for i, o in enumerate(fam.out_avals):
        note = ("  (no dims: a device array, numpy requests too)"
                if sig.var_order and not fam.out_dynamic[i] else "")
        lines.append(f"    out[{i}]: {o.dtype}[{', '.join(map(str, o.shape))}]{note}")
    if sig.var_order:
      lines.append("  bucket plan:")
      hists = [Counter() for _ in sig.var_order]
      for sizes, n in list(fam.tuple_hist.items()):
        for h, size in zip(hists, sizes, strict=True):
          h[size] += n
      for v, p, hist in zip(sig.var_order, fam.policies, hists, strict=True):
        plan = p.sizes() if p.max is not None or getattr(p, "_table", None) else "unbounded"
        lines.append(f"    {v}: {p!r} -> {plan}")
        if hist:
          sizes = list(hist.elements())
          lines.append(f"       observed {len(hist)} distinct sizes in {len(sizes)} calls "
                       f"(min {min(hist)}, max {max(hist)}); expected padded fraction of "
                       f"this plan: {p.expected_waste(sizes):.1%}")
    if fam.guards:
      lines.append(f"  guards inferred while tracing: {', '.join(fam.guards)} (sizes outside "
                   "them run exact, one compile per shape)")
    if fam.joint is not None:
      lines.append(f"    jointly planned {[sig.var_order[i] for i in fam.joint.idx]}: "
                   f"{list(fam.joint.sizes())} ({fam.joint.replans} re-plans)")
    used = sorted(fam.buckets)
    if used:
      lines.append(f"  compiled buckets: {used}")
    lines.append(f"  padded fraction so far: {waste:.1%}")
    if fam.attention_notes:
      lines.append(f"  attention={opts.attention!r}:")
      lines.extend(f"    {r}" for r in fam.attention_notes)
    if fam.ragged_notes:
      lines.append(f"  ragged_dot={opts.ragged_dot!r}:")
      lines.extend(f"    {r}" for r in fam.ragged_notes)
    if fam.casts:
      lines.append("  cast once per array (cast_once=True; the executables take the copies):")
      lines.extend(f"    {r}" for r in _casts.describe(fam))
    for placed in (_placement.describe(fam), _placement.describe_inputs(fam)):
      if placed:
        lines.append(f"  {placed}")
    if fam.rewrites:
      lines.append("  padding pass:")
      lines.extend(f"    {r}" for r in fam.rewrites)
    if fam.fallback:
      lines.append(f"  FALLBACK to exact execution: {fam.fallback}")
  return "\n".join(lines)
