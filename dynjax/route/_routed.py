"""``Routed``: a router, a path set and a capacity mode; the dropless routed layer.

Modes (what each costs is in WORKSPACE.md, "Routing"):

- ``"exact-sync"``: route on device (one executable), read the ``P`` loads on the host (the one
  device->host sync of the layer), bucket each load with the policy, then run the executable
  of that *capacity signature* (compiled once, cached).  Capacities always cover the loads, so
  no overflow path exists.  A compile budget bounds the signatures: a new signature is served
  by a cached one that covers it when that wastes little, or when the budget is spent.
- ``"profiled"``: capacities come from the recorded load :class:`Profile` (a quantile of each
  path's load fraction, bucketed) and are static, so the whole layer is one traceable function
  (no host sync: use it under ``jax.jit``/``jax.grad``); cells past capacity take the chunked
  overflow path, computed exactly.
- ``"grouped"``: no capacities at all.  Cells are laid out by path, each path's rows padded to a
  multiple of the row tile only (packed, no padding, for the Hopper ``"mgpu"`` kernel), and the
  expert FFN runs as two grouped GEMMs (:func:`dynjax.route.gmm`: on Hopper in bf16/f16 the
  warp-specialized ``"hopper"`` kernel, else JAX's Mosaic GPU ragged dot or our Pallas/Triton
  kernel on GPU, megablox on TPU).  One traceable function, no host sync, no profile, no
  overflow path.  Needs ``Experts(ffn(...))``; ``kernel="auto"`` falls back to the
  ``"profiled"`` batched path on CPU (where the Pallas kernel only interprets).

Measured (H100, jax 0.11.2, bf16 FFN layer d=1024, ffn=4096, 8,192 tokens; benchmarks/
bench_moe_kernels.py, side by side, two runs): k=1, 8 experts: grouped (auto = hopper) 0.509 /
0.548 ms, grouped mgpu 0.609 / 0.620, capacity 1.25 (drops) 0.530 / 0.587; 64 experts: 0.743 /
0.802, mgpu 0.925 / 1.065, capacity 0.702 / 0.854; k=2, 8 experts: 0.720 / 0.708, capacity
0.951.  An earlier run (bench_moe_gmm.py, Triton only): k=1, 8 experts: grouped 0.556, profiled
0.665, exact-sync 1.379; 64 experts: 0.926 / 0.948 / 1.627.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from dynjax._errors import RoutingError
from dynjax._symbolic import is_symbolic
from dynjax.bucketing._policies import BucketPolicy, as_policy, geometric
from dynjax.route._dispatch import (
  FUSIONS,
  Plan,
  apply,
  auto_capacities,
  bucket_capacity,
  dense_reference,
  group_buckets,
  make_plan,
)
from dynjax.route._gmm import Tiling, resolve_backend
from dynjax.route._grouped import ffn_spec, grouped_ffn
from dynjax.route._paths import Branches, Experts
from dynjax.route._profile import Profile
from dynjax.route._router import Router, Routing

MODES = ("exact-sync", "profiled", "grouped")
KERNELS = ("auto", "pallas", "hopper", "mgpu", "xla", "batched")


def _is_tracer(x) -> bool:
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


class _Signature:
  """A cached exact-sync decision for one bucketed-load signature (see ``Routed._signature``)."""

  __slots__ = ("caps", "plan", "kind", "slots", "fn")

  def __init__(self, caps: tuple[int, ...], plan: Plan, kind: str):
    self.caps = caps
    self.plan = plan
    self.kind = kind  # "hit" (compiled), "covered" (a cached covering one), "new"
    self.slots = plan.num_slots
    self.fn = None


class Routed:
  """A dropless routed layer: ``y[i] = sum_j gate[i, j] * path[paths[i, j]](x[i])``.

  Args:
    paths: :class:`Experts` (stacked parameters) or :class:`Branches` (one function per path).
    router: the :class:`Router`.
    mode: ``"exact-sync"``, ``"profiled"`` or ``"grouped"`` (see the module docstring).
    buckets: the capacity bucket policy (``dynjax.buckets``; a list means explicit sizes).
      Default: ``geometric(1.25, min=8)`` aligned to 8 (at most 25% + 8 rows of padding).
    profile: a :class:`Profile` (or a path to a saved one) for ``"profiled"``; recorded into by
      ``"exact-sync"`` calls.  Without records, ``"profiled"`` plans every path at
      ``bucket(ceil(capacity_factor * cells * k / P))`` (still dropless: the rest overflows).
    quantile: per-path load quantile the profiled capacities cover.
    margin: head-room factor on the profiled capacities.
    capacity_factor: capacity of an unprofiled path relative to the mean load.
    fusion: ``"auto"`` (default: ranges of consecutive paths share one batched call at the
      bucket of their largest load, ranges chosen by :func:`auto_capacities`), ``"bucket"``,
      ``"runs"`` or ``"none"`` (see :func:`make_plan`).
    group_overhead: ``"auto"``: the price of one more batched call, in rows.
    max_signatures: ``"exact-sync"`` compile budget (distinct capacity signatures).
    slack: ``"exact-sync"``: serve a new signature by a cached covering one when its padded
      slots exceed the tight signature's by at most this fraction.
    overflow_chunk: rows per step of the overflow path.
    record: record loads into the profile on every ``"exact-sync"`` call.
    kernel: ``"grouped"`` mode: ``"pallas"`` (grouped-GEMM kernel: Triton on GPU, megablox on
      TPU, interpret mode on CPU), ``"hopper"`` (Hopper, bf16/f16: a warp-specialized Mosaic GPU
      kernel on the same tile-aligned layout; widths multiples of 256), ``"mgpu"`` (Hopper:
      JAX's Mosaic GPU ragged dot, paths packed with no tile padding), ``"xla"``
      (``lax.ragged_dot`` on the same layout), ``"batched"`` (the ``"profiled"`` path) or
      ``"auto"`` (on GPU/TPU when the widths divide by the tiling: ``"hopper"`` on Hopper in
      bf16/f16 where the widths tile for it, else ``"mgpu"`` or ``"pallas"``; else
      ``"batched"``).
    tiling: ``"grouped"`` mode: the grouped GEMM's :class:`Tiling`; default: per call shape,
      128-row tiles when few paths share many cells, else 64-row tiles.

  Example:
    >>> moe = dynjax.route.Routed(dynjax.route.Experts(dynjax.route.ffn()),
    ...                           dynjax.route.Router(8, k=2), mode="exact-sync")
    >>> y = moe(params, x, logits)        # params: {"w1": [8, d, f], "w2": [8, f, d]}
    >>> moe.stats()["host_syncs"]
    1
  """

  def __init__(self, paths: Experts | Branches, router: Router, *, mode: str = "exact-sync",
               buckets: BucketPolicy | list[int] | None = None,
               profile: Profile | str | None = None, quantile: float = 0.999,
               margin: float = 1.0, capacity_factor: float = 1.25, fusion: str = "auto",
               group_overhead: int = 256,
               max_signatures: int = 16, slack: float = 0.125, overflow_chunk: int = 256,
               record: bool = True, kernel: str = "auto", tiling: Tiling | None = None):
    if not isinstance(paths, Experts | Branches):
      raise RoutingError(f"dynjax.route.Routed: paths must be dynjax.route.Experts(fn) or "
                         f"dynjax.route.Branches(fns), got {type(paths).__name__}; wrap the "
                         "function")
    if not isinstance(router, Router):
      raise RoutingError(f"dynjax.route.Routed: router must be a dynjax.route.Router, got "
                         f"{type(router).__name__}")
    if mode not in MODES:
      raise RoutingError(f"dynjax.route.Routed: mode must be one of {', '.join(map(repr, MODES))}"
                         f", got {mode!r}")
    if fusion not in FUSIONS:
      raise RoutingError(f"dynjax.route.Routed: fusion must be one of "
                         f"{', '.join(map(repr, FUSIONS))}, got {fusion!r}")
    if kernel not in KERNELS:
      raise RoutingError(f"dynjax.route.Routed: kernel must be one of "
                         f"{', '.join(map(repr, KERNELS))}, got {kernel!r}")
    if mode == "grouped" and kernel in ("pallas", "xla") and ffn_spec(paths) is None:
      raise RoutingError(f"dynjax.route.Routed: mode='grouped' with kernel={kernel!r} runs the "
                         "expert FFN as grouped GEMMs, so paths must be "
                         f"dynjax.route.Experts(dynjax.route.ffn(...)), got {paths!r}; use "
                         "kernel='batched' (or 'auto') for other paths")
    if isinstance(paths, Branches) and len(paths.fns) != router.num_paths:
      raise RoutingError(f"dynjax.route.Routed: {len(paths.fns)} branches but the router has "
                         f"num_paths={router.num_paths}; give one branch per path")
    self.paths = paths
    self.router = router
    self.mode = mode
    self.policy = (geometric(1.25, min=8).aligned(8) if buckets is None
                   else as_policy(buckets, " (dynjax.route)"))
    self.group_overhead = int(group_overhead)
    if isinstance(profile, str):
      profile = Profile.load(profile)
    if profile is None:
      profile = Profile(router.num_paths)
    if profile.num_paths != router.num_paths:
      raise RoutingError(f"dynjax.route.Routed: the profile has num_paths={profile.num_paths}, "
                         f"the router {router.num_paths}; use a profile of this layer")
    self.profile = profile
    self.quantile = float(quantile)
    self.margin = float(margin)
    self.capacity_factor = float(capacity_factor)
    self.fusion = fusion
    self.max_signatures = int(max_signatures)
    self.slack = float(slack)
    self.overflow_chunk = int(overflow_chunk)
    self.record = bool(record)
    self.kernel = kernel
    self.tiling = tiling  # None: Tiling.auto(cells * k, num_paths) per call shape
    self._route = jax.jit(self.route)
    self._execs: dict[Plan, object] = {}
    # Exact-sync plan cache, keyed by the bucketed loads (bytes of an int64 array): the DP
    # grouping, make_plan and the covering search run once per signature, not once per call.
    # Cleared whenever an executable is added (that can change which signature covers which).
    self._sigs: dict[bytes, _Signature] = {}
    # bucket_capacity(policy, need) for need = 0, 1, ...: a numpy table (grown on demand) when
    # the policy is a fixed rule (not Auto, whose table moves as it observes sizes).
    self._btab = (np.zeros(1, np.int64) if type(self.policy).bucket is BucketPolicy.bucket
                  else None)
    self._uses: dict[Plan, int] = {}
    self._profiled_caps: dict[int, tuple[int, ...]] = {}
    self._lock = threading.Lock()
    self._stats = dict(calls=0, host_syncs=0, compiles=0, signature_hits=0, covered_hits=0,
                       cells=0, slots=0, sync_seconds=0.0)

  def __repr__(self) -> str:
    return f"Routed({self.paths!r}, {self.router!r}, mode={self.mode!r})"

  # -- pieces --------------------------------------------------------------------------------
  def route(self, logits=None, labels=None, mask=None) -> Routing:
    """The routing of a batch (traceable); ``mask`` False = padding cell, routed nowhere."""
    return self.router(logits, labels=labels, mask=mask)

  def _check(self, params, x, logits, labels) -> None:
    self.paths.check(params, self.router.num_paths)
    n = np.shape(logits if logits is not None else labels)[:1]
    if not np.ndim(x) or np.shape(x)[:1] != n:
      raise RoutingError(
          f"dynjax.route.Routed: x has shape {tuple(np.shape(x))}, expected its first axis to "
          f"match the {'labels' if labels is not None else 'logits'} ({n[0] if n else '?'} "
          "cells); pass one routing row per cell of x")

  def _caps_for(self, needs, num_cells: int) -> tuple[int, ...]:
    if self.fusion == "auto":
      return auto_capacities(needs, self.policy, self.group_overhead, num_cells)
    return tuple(bucket_capacity(self.policy, int(v), num_cells) for v in needs)

  def _bucketed(self, loads: np.ndarray, num_cells: int) -> np.ndarray:
    """``bucket_capacity(policy, load, num_cells)`` of every load, vectorised (int64)."""
    tab = self._btab
    if tab is None:
      return np.asarray([bucket_capacity(self.policy, int(v), num_cells) for v in loads],
                        np.int64)
    top = int(loads.max()) if loads.size else 0
    if top >= len(tab):
      size = max(top + 1, 2 * len(tab), 64)
      grown = [bucket_capacity(self.policy, v) for v in range(len(tab), size)]
      tab = self._btab = np.concatenate([tab, np.asarray(grown, np.int64)])
    return np.minimum(tab[loads], num_cells)

  def _signature(self, loads: np.ndarray, num_cells: int) -> _Signature:
    """The cached decision for these loads: capacities, plan, how they were served.

    Hot path of exact-sync: a repeated signature costs the table bucketing and one dict
    lookup; only a new one runs the DP planner, ``make_plan`` and the covering search.
    """
    b = self._bucketed(loads, num_cells)
    key = b.tobytes()
    sig = self._sigs.get(key)
    if sig is None:
      tight = (group_buckets(b, self.group_overhead) if self.fusion == "auto"
               else tuple(int(v) for v in b))
      caps, kind = self._lookup(tight)
      sig = _Signature(caps, self._plan(caps, overflow=False), kind)
      if sig.kind == "hit":
        sig.fn = self._execs[sig.plan]
      self._sigs[key] = sig
    if sig.kind == "hit":
      self._stats["signature_hits"] += 1
    elif sig.kind == "covered":
      self._stats["covered_hits"] += 1
    return sig

  def capacities(self, routing: Routing) -> tuple[int, ...]:
    """Exact capacities for a routing: its loads read on the host (one sync), bucketed.

    Goes through the signature cache (a cached covering signature may be returned), records
    the loads in the profile.  Use with :meth:`apply` to differentiate an exact-sync layer.
    """
    if _is_tracer(routing.loads):
      raise RoutingError(
          "dynjax.route.Routed.capacities: the loads are traced (inside jax.jit/grad/vmap), so "
          "they cannot be read on the host; call capacities() outside the transformation and "
          "pass the result to apply(..., capacities=...), or use mode='profiled'")
    return self._sync_signature(routing).caps

  def _sync_signature(self, routing: Routing) -> _Signature:
    # Measured host cost of this function per call, loads already computed (2-core CPU box,
    # jax 0.10.2, Zipf(1.2) routing of 512 tokens, linear(16) buckets, fusion="auto"):
    # 71 us at 8 paths / 437 us at 64 while the DP planner + make_plan + covering search ran
    # on every call; 7.9 us / 8.2 us with the signature cache (read of the loads, profile
    # record, table bucketing, one dict lookup).  ``python -m benchmarks.moe`` prints it
    # ("host plan") per setting.
    t0 = time.perf_counter()
    loads = np.asarray(routing.loads)  # the one device->host sync of the layer
    self._stats["sync_seconds"] += time.perf_counter() - t0
    self._stats["host_syncs"] += 1
    n = int(routing.paths.shape[0])
    num_cells = n * int(routing.paths.shape[1])
    if self.record:
      self.profile.record(loads, n)
    self._stats["cells"] += int(loads.sum())
    return self._signature(loads.reshape(-1).astype(np.int64, copy=False), num_cells)

  def _lookup(self, tight: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """``(capacities, kind)`` serving ``tight``: compiled (``"hit"``), a cached covering one
    (``"covered"``), the envelope when over budget, or ``tight`` itself (``"new"``)."""
    plan = self._plan(tight, overflow=False)
    if plan in self._execs:
      return tight, "hit"
    covering = [p.capacities for p in self._execs if not p.overflow and
                len(p.capacities) == len(tight) and
                all(c >= t for c, t in zip(p.capacities, tight, strict=True))]
    best = min(covering, key=sum, default=None)
    full = len(self._execs) >= self.max_signatures
    if best is not None and (full or sum(best) <= (1.0 + self.slack) * sum(tight)):
      return best, "covered"
    if full:
      # Over budget and nothing covers it: the envelope of every signature so far.
      env = list(tight)
      for p in self._execs:
        if not p.overflow and len(p.capacities) == len(tight):
          env = [max(a, b) for a, b in zip(env, p.capacities, strict=True)]
      return tuple(env), "new"
    return tight, "new"

  def _plan(self, caps: tuple[int, ...], overflow: bool) -> Plan:
    return make_plan(caps, self.fusion, overflow, self.overflow_chunk)

  def profiled_capacities(self, num_cells: int, k: int | None = None) -> tuple[int, ...]:
    """The static capacities of the ``profiled`` mode for ``num_cells`` cells (cached)."""
    k = self.router.k if k is None else k
    key = (num_cells, k)
    caps = self._profiled_caps.get(key)
    if caps is None:
      total = num_cells * k
      if len(self.profile):
        needs = self.profile.needs(num_cells, self.quantile, self.margin)
      else:
        needs = (max(1, -(-int(self.capacity_factor * total) // self.router.num_paths)),
                 ) * self.router.num_paths
      caps = self._caps_for(needs, total)
      self._profiled_caps[key] = caps
    return caps

  def replan(self) -> None:
    """Forgets the profiled capacities, so the next call plans from the profile as it is now."""
    self._profiled_caps.clear()

  def apply(self, params, x, routing: Routing, capacities: tuple[int, ...] | None = None, *,
            overflow: bool = True) -> jax.Array:
    """The routed layer for a given routing and capacities (traceable, differentiable).

    Args:
      params: path parameters (stacked for :class:`Experts`, a list for :class:`Branches`).
      x: ``[N, ...]`` cells.
      routing: from :meth:`route`.
      capacities: per-path capacities; default: the profiled capacities.
      overflow: run the overflow path for cells past capacity (keep True unless the capacities
        come from :meth:`capacities` of this very routing).

    Example:
      >>> caps = moe.capacities(moe.route(logits))           # host sync, outside grad
      >>> g = jax.grad(lambda p: moe.apply(p, x, moe.route(logits), caps).sum())(params)
    """
    if capacities is None:
      capacities = self.profiled_capacities(int(routing.paths.shape[0]),
                                            int(routing.paths.shape[1]))
    capacities = tuple(int(c) for c in capacities)
    if len(capacities) != self.router.num_paths:
      raise RoutingError(f"dynjax.route.Routed.apply: capacities has {len(capacities)} entries, "
                         f"expected num_paths={self.router.num_paths}")
    return apply(self.paths, params, x, routing, self._plan(capacities, overflow))

  def grouped_kernel(self, params, dtype=None, rows: int | None = None) -> str:
    """The kernel ``mode="grouped"`` runs for these parameters, cells of ``dtype`` (default: the
    weights') and ``rows`` routed rows (cells x k; None: many): ``"pallas"``, ``"hopper"``,
    ``"mgpu"``, ``"xla"`` or ``"batched"`` (``kernel="auto"`` resolved for the default device, the dtype,
    the widths and the rows per path: see :func:`dynjax.route._gmm.resolve_backend`)."""
    if self.kernel != "auto":
      return self.kernel
    if ffn_spec(self.paths) is None or jax.default_backend() == "cpu":
      return "batched"
    t = self.tiling or Tiling(tm=64)  # every auto tiling uses tk, tn <= 128
    d, f = np.shape(params["w1"])[1:]
    if not all(v % t.tk == 0 and v % t.tn == 0 for v in (d, f)):
      return "batched"
    return resolve_backend("auto", jnp.result_type(params["w1"]) if dtype is None else dtype,
                           rows, self.router.num_paths, widths=((d, f), (f, d)),
                           tiling=self.tiling)

  def grouped(self, params, x, routing: Routing) -> jax.Array:
    """The ``"grouped"`` layer for a given routing (traceable, differentiable, dropless).

    Example:
      >>> y = jax.jit(lambda p, x, lg: moe.grouped(p, x, moe.route(lg)))(params, x, logits)
    """
    n, k = routing.paths.shape
    kernel = self.grouped_kernel(params, x.dtype, None if is_symbolic(n) else int(n) * int(k))
    if kernel == "batched":
      return self.apply(params, x, routing)
    activation, _ = ffn_spec(self.paths)
    tiling = self.tiling or Tiling.auto(int(n) * int(k), self.router.num_paths, kernel)
    return grouped_ffn(params, x, routing, activation=activation, tiling=tiling,
                       backend=kernel)

  # -- the layer -----------------------------------------------------------------------------
  def __call__(self, params, x, logits=None, *, labels=None, mask=None) -> jax.Array:
    """Routes ``x`` by ``logits`` (or ``labels``), runs the paths, combines; nothing dropped.

    Args:
      params: path parameters.
      x: ``[N, ...]`` cells.
      logits: ``[N, P]`` gate logits (top-k / threshold routers).
      labels: ``[N]`` integer labels (hash / label routers).
      mask: optional bool ``[N]``: False marks padding cells, which take no slot and get 0.

    Returns:
      ``[N, ...]`` combined outputs.
    """
    self._check(params, x, logits, labels)
    self._stats["calls"] += 1
    if self.mode in ("profiled", "grouped"):
      if is_symbolic(np.shape(x)[0]):
        # A symbolic number of cells (dynjax.jit's shape trace): capacities need a number, so
        # this trace gets the dense computation (exact, same shapes).  dynjax.jit's "trust"
        # executables are traced again at each bucket's concrete size and route for real;
        # under padding="auto" the dense form is what runs (exact, P times the FLOPs).
        paths, gates = self.router.select(logits, labels=labels, mask=mask)
        p = self.router.num_paths
        stand_in = Routing(paths, gates, jax.numpy.zeros_like(paths),
                           jax.numpy.zeros((p,), jax.numpy.int32))
        return dense_reference(self.paths, params, x, stand_in)
      routing = self.route(logits, labels, mask)
      if self.mode == "grouped":
        return self.grouped(params, x, routing)
      return self.apply(params, x, routing)
    if _is_tracer((params, x, logits, labels)):
      raise RoutingError(
          "dynjax.route.Routed: mode='exact-sync' reads the loads on the host, but it was "
          "called inside jax.jit/grad/vmap (its inputs are tracers); call it outside the "
          "transformation, or use mode='profiled', or split it: caps = "
          "moe.capacities(moe.route(logits)) outside, moe.apply(params, x, routing, caps) inside")
    routing = self._route(logits, labels, mask)
    sig = self._sync_signature(routing)
    fn = sig.fn
    if fn is None:
      plan = sig.plan
      with self._lock:
        fn = self._execs.get(plan)
        if fn is None:
          fn = jax.jit(functools.partial(apply, self.paths, plan=plan))
          self._execs[plan] = fn
          self._stats["compiles"] += 1
          self._sigs.clear()  # a new executable can change which signature serves which
        sig.fn = fn
    self._uses[sig.plan] = self._uses.get(sig.plan, 0) + 1
    self._stats["slots"] += sig.slots
    return fn(params, x, routing)

  def stats(self) -> dict:
    """Counters: calls, host syncs, compiles (capacity signatures), cache hits, padded fraction.

    Example:
      >>> moe.stats()["padded_fraction"]      # 1 - routed cells / slots computed (exact-sync)
      0.21
    """
    s = dict(self._stats)
    s["mode"] = self.mode
    if self.mode == "grouped":
      s["kernel"] = self.kernel
      s["tiling"] = "auto" if self.tiling is None else dataclasses.asdict(self.tiling)
    s["signatures"] = {", ".join(map(str, p.capacities)): n for p, n in self._uses.items()}
    s["padded_fraction"] = 0.0 if not s["slots"] else 1.0 - s["cells"] / s["slots"]
    s["profile"] = self.profile.summary()
    s["profiled_capacities"] = {f"{n}x{k}": list(c) for (n, k), c in self._profiled_caps.items()}
    return s

  def explain(self, num_cells: int) -> str:
    """The profiled plan for ``num_cells`` cells, one line per batched call."""
    return self._plan(self.profiled_capacities(num_cells), overflow=True).describe()
