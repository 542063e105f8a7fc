"""``dynjax.jit`` and its stage objects.

Design (after ``jax/_src/stages.py``): ``dynjax.jit(fun, ...)`` returns a :class:`Wrapped`.
``Wrapped.trace(*args)`` traces ``fun`` ONCE per static signature with symbolic dimensions into
a symbolic jaxpr (:class:`Traced`); ``Traced.lower(sizes)`` picks the bucket, runs the padding
pass and lowers it (:class:`Lowered`); ``Lowered.compile()`` gives the XLA executable for that
bucket (:class:`Compiled`).  Calling the ``Wrapped`` does all of that on demand and dispatches:

    solve dims from the inputs -> bucket lookup -> pad -> run -> unpad

A *family* is everything for one static signature (static argument values, pytree structure,
leaf dtypes and ranks): its symbolic signature, symbolic jaxpr, output shape functions and its
executables, one per bucket, in a shared single-flight, LRU-bounded cache.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import os
import re
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np

from dynjax import _jax_private, _sharding, _symbolic
from dynjax._config import config
from dynjax._errors import (
  DtypeMismatchError,
  OutOfBucketsError,
  PaddingFallbackError,
  PaddingMismatchError,
  PaddingUnsupportedError,
  ShapeMismatchError,
  SpecError,
  format_list,
)
from dynjax._padded import Padded
from dynjax.bucketing._joint import JointPlan
from dynjax.bucketing._padding import pad_jaxpr
from dynjax.bucketing._policies import Auto, BucketPolicy, as_policy, pow2
from dynjax.runtime._cache import ExecutableCache, enable_compile_log
from dynjax.runtime._scheduler import CompileScheduler
from dynjax.runtime._store import ExecutableStore, fingerprint_parts

_PADDING_MODES = ("auto", "trust", "exact")
_OVERFLOW_MODES = ("error", "exact", "grow")
_ON_FALLBACK = ("warn", "error")
_tree_flatten = jax.tree_util.tree_flatten
_tree_unflatten = jax.tree_util.tree_unflatten


def _is_padded(x) -> bool:
  return type(x) is Padded


class _Static:
  """Marks a hashable static argument value inside the family key."""


# -----------------------------------------------------------------------------------------------
# Public entry point
# -----------------------------------------------------------------------------------------------
@overload
def jit(fun: Callable, **kwargs) -> Wrapped: ...
@overload
def jit(fun: None = None, **kwargs) -> Callable[[Callable], Wrapped]: ...


def jit(
    fun: Callable | None = None,
    *,
    dims: Mapping[str, Any] | str = "auto",
    buckets: Mapping[str, Any] | BucketPolicy | Sequence[int] | None = None,
    padding: str = "auto",
    overflow: str = "error",
    static_argnames: str | Sequence[str] = (),
    donate_argnames: str | Sequence[str] = (),
    return_padded: bool = False,
    constraints: Sequence[str] = (),
    max_executables: int | None = None,
    cache_dir: str | None = None,
    check: bool | None = None,
    async_compile: bool = False,
    in_shardings: Any = None,
    out_shardings: Any = None,
    serving: bool = False,
    compile_workers: int | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    on_fallback: str = "warn",
):
  """Compiles ``fun`` into a family of bucketed, padded XLA executables.

  Args:
    fun: the function. Positional-or-keyword parameters (no ``*args``/``**kwargs``).
    dims: parameter name -> shape spec in ``jax.export.symbolic_shape`` syntax (``"b, t"``,
      ``"b, t, 768"``), or a pytree of specs/None matching the argument. ``"auto"``: every
      dimension starts static and becomes symbolic the first time a call brings a new size.
    buckets: variable name -> policy (``dynjax.buckets.pow2(16, 1024)``, a list of sizes), or
      one policy for every variable. Default: ``pow2()``.
    padding: ``"auto"`` (the padding pass makes padded execution equal to unpadded execution;
      what it cannot make exact runs unpadded, with a warning), ``"trust"`` (the caller
      guarantees ``fun`` is pad-safe), ``"exact"`` (never pad: one compile per shape).
    overflow: a size above the largest bucket: ``"error"`` (raise
      :class:`dynjax.OutOfBucketsError`), ``"exact"`` (run unpadded), ``"grow"`` (use the
      policy's rule past its max).
    static_argnames, donate_argnames: as in ``jax.jit``.
    return_padded: return :class:`dynjax.Padded` values (buffer + true shape) instead of
      exact-shape arrays.
    constraints: extra ``jax.export`` constraints (``"t <= 512"``); a policy with a ``max`` adds
      ``"t <= max"`` itself unless ``overflow="grow"``.
    max_executables: keep at most this many executables (least recently used evicted).
    cache_dir: persistent compilation cache directory (or ``DYNJAX_CACHE_DIR``).
    check: also run the exact-shape function (every ``DYNJAX_CHECK_EVERY``-th call) and raise
      :class:`dynjax.PaddingMismatchError` on a difference. Default ``DYNJAX_CHECK``.
    async_compile: when a call needs a bucket that is not compiled yet but a larger one is,
      serve it on the larger bucket (exact thanks to padding) and compile in the background.
    in_shardings: run every bucket on a device mesh with JAX's GSPMD (see ``dynjax._sharding``):
      one ``NamedSharding``/``PartitionSpec``/None for every leaf, a tuple with one pytree
      prefix per non-static parameter, or a dict parameter name -> prefix (left out:
      replicated).  A ``PartitionSpec`` takes its mesh from the ``NamedSharding`` values given
      or from ``with jax.set_mesh(mesh):``.  Bucket sizes of sharded dims are multiples of
      the mesh axis size; padded host inputs go to their devices with their sharding.
    out_shardings: one sharding for every output or a pytree prefix of the output (None:
      GSPMD chooses).  Kept by ``return_padded=True`` and device-input calls.
    serving: the configuration for serving a stream of requests (progressive compiles).
      The first call compiles the bucket covering the whole declared range (and its own
      bucket, in parallel) and waits only for the first of them; every later call runs at
      once on the smallest compiled bucket that fits, while the buckets the policy wants
      compile in background threads, the one saving the most serving time per second of
      compiling first.  On GPU, buckets first compile with cuBLAS gemms only (about 40% less
      compile time) and are recompiled with XLA's full autotuning once nothing else is
      pending.  With ``cache_dir``, stored executables of earlier runs load in parallel at
      the first call: a restarted server compiles nothing.  Implies ``async_compile``.
    compile_workers: threads for background compiles (default: 1 on <= 4 cores, else
      ``min(4, cores // 4)``).
    compiler_options: XLA options for every compile of this function, as
      ``jax.stages.Lowered.compile(compiler_options=...)``; part of the executable keys.
    on_fallback: what happens when ``padding="auto"``/``"trust"`` cannot pad a function and it
      would run unpadded (one compile per shape): ``"warn"`` (one warning; counted in
      ``stats()["fallbacks"]``) or ``"error"`` (raise :class:`dynjax.PaddingFallbackError`
      naming the primitive and source line, for servers that refuse the compile storm).

  Returns:
    A :class:`Wrapped` function (or a decorator, when ``fun`` is omitted).

  Example:
    >>> @dynjax.jit(dims={"x": "b, t"}, buckets=dynjax.buckets.pow2(16, 1024))
    ... def f(x):
    ...   return jnp.tanh(x) * 2
    >>> f(np.ones((3, 100), np.float32)).shape   # runs the (3->4, 100->128) bucket
    (3, 100)
  """
  kwargs = dict(dims=dims, buckets=buckets, padding=padding, overflow=overflow,
                static_argnames=static_argnames, donate_argnames=donate_argnames,
                return_padded=return_padded, constraints=constraints,
                max_executables=max_executables, cache_dir=cache_dir, check=check,
                async_compile=async_compile, in_shardings=in_shardings,
                out_shardings=out_shardings, serving=serving, compile_workers=compile_workers,
                compiler_options=compiler_options, on_fallback=on_fallback)
  if fun is None:
    return lambda f: Wrapped(f, **kwargs)
  if not callable(fun):
    raise SpecError(f"dynjax.jit: expected a function, got {type(fun).__name__} {fun!r}")
  return Wrapped(fun, **kwargs)


# -----------------------------------------------------------------------------------------------
# Option validation
# -----------------------------------------------------------------------------------------------
def _names(value, what: str) -> tuple[str, ...]:
  if isinstance(value, str):
    return (value,)
  try:
    out = tuple(value)
  except TypeError:
    raise SpecError(f"{what}: expected a name or a sequence of names, got {value!r}") from None
  for v in out:
    if not isinstance(v, str):
      raise SpecError(f"{what}: expected parameter names (str), got {v!r}")
  return out


def _choice(value, legal, what: str) -> str:
  if value not in legal:
    raise SpecError(f"{what}={value!r} is not valid; use one of {', '.join(map(repr, legal))}")
  return value


@dataclasses.dataclass
class _Options:
  dims: Any
  buckets: Any
  padding: str
  overflow: str
  static_argnames: tuple[str, ...]
  donate_argnames: tuple[str, ...]
  return_padded: bool
  constraints: tuple[str, ...]
  max_executables: int | None
  check: bool
  async_compile: bool
  sharding: Any = None  # dynjax._sharding.ShardingOptions, or None (one device)
  serving: bool = False
  compile_workers: int = 1
  compiler_options: tuple = ()  # sorted (name, value) pairs
  store_root: str | None = None  # where serialized executables live (cache_dir)
  on_fallback: str = "warn"


# -----------------------------------------------------------------------------------------------
# Families
# -----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _BucketEntry:
  """Everything the hot path needs for one (family, bucket)."""

  exe: Any  # jax Compiled
  in_shapes: tuple[tuple[int, ...], ...]  # padded shape per leaf
  padded_elems: int
  rewrites: tuple[str, ...] = ()
  tier: int = 0  # 0: quick compile options (serving on GPU) or the only tier; 1: full options
  source: str = "compiled"  # or "stored": loaded from the executable store


class _Hit:
  """The hot path of one (family, shapes of the leaves with dims, host or device) after its
  first call: everything ``Wrapped._call_top`` needs, resolved once.  Valid while the
  family's ``gen`` is unchanged (a bucket compiled, replaced or dropped bumps it)."""

  __slots__ = ("gen", "sizes", "bkey", "exe", "pads", "dev_sizes", "out_slices", "out_tree",
               "n", "padded", "true", "sync", "timed", "bucket_id", "fam", "larger", "single")

  def __init__(self, fam, gen, sizes, bkey, entry, pads, dev_sizes, out_slices, true, sync,
               timed, larger):
    self.fam = fam
    self.gen = gen
    self.sizes = sizes
    self.bkey = bkey
    self.exe = entry.exe
    self.pads = pads  # ((argument position, padded shape, prefix slices), ...)
    self.dev_sizes = dev_sizes  # the true-sizes vector on the device (padding="auto")
    self.out_slices = out_slices  # per output: None (exact shape) or prefix slices
    self.out_tree = fam.out_tree
    self.n = 0  # calls served, folded into the Wrapped's counters by stats()
    self.padded = entry.padded_elems
    self.true = true
    self.sync = sync
    self.timed = timed
    self.bucket_id = (fam.fid, bkey)
    self.larger = larger  # served on a larger bucket than its own (still compiling)
    self.single = fam.out_tree == _LEAF_TREEDEF  # fun returns one array: no unflatten


class _Family:
  """One static signature of a Wrapped function: signature, jaxpr, executables."""

  def __init__(self, wrapped: Wrapped, flat_fun, leaf_specs, avals, treedef, fid: int):
    self.wrapped = wrapped
    self.flat_fun = flat_fun
    self.treedef = treedef
    self.avals = avals  # concrete ShapeDtypeStructs of the first call (dtypes, static shapes)
    self.fid = fid
    self.fallback: str | None = None
    self.gen = 0  # bumped whenever an executable of this family is added or replaced
    self.hits: dict[tuple, _Hit] = {}  # (shapes of the leaves with dims, device) -> _Hit
    self.retired_hits: list[_Hit] = []  # replaced hits (still counted)
    self.jaxpr = None
    self.out_tree = None
    self.out_avals = None
    self.rewrites: tuple[str, ...] = ()
    opts = wrapped._opts
    self.mode = "exact" if opts.padding == "exact" else opts.padding
    self.sig = _symbolic.build_signature(
        [(path, text, len(a.shape)) for (path, text), a in zip(leaf_specs, avals, strict=True)],
        self._constraints(leaf_specs))
    self.policies = tuple(wrapped._policy_for(v) for v in self.sig.var_order)
    self.observers = tuple((i, p) for i, p in enumerate(self.policies)
                           if type(p).observe is not BucketPolicy.observe)
    self.in_shape_fns = tuple(
        None if s is None else _symbolic.compile_shape(s.dims, self.sig.var_order)
        for s in self.sig.leaves)
    self.buckets: dict[tuple, _BucketEntry] = {}
    self.spec_idx = tuple(i for i, spec in enumerate(self.sig.leaves) if spec is not None)
    self.avals_shapes = tuple(tuple(a.shape) for a in avals)
    auto = wrapped._opts.dims == "auto"
    # With dims="auto" every leaf is checked (its static axes may need promoting); otherwise
    # only leaves with dims are (the executable checks the rest).
    self.checks = tuple(
        (i, _leaf_key_of_aval(avals[i]),
         tuple((ax, int(d)) for ax, d in enumerate(spec.dims if spec is not None
                                                   else avals[i].shape)
               if not _symbolic.is_symbolic(d)) if auto else ())
        for i, spec in enumerate(self.sig.leaves) if spec is not None or auto)
    # Leaves that decide numpy vs device outputs: those with dims (all leaves when none has).
    self.dyn_leaves = self.spec_idx or tuple(range(len(self.sig.leaves)))
    if not self.sig.var_order:
      self.mode = "exact"  # nothing dynamic: a plain jit, one compile per shape
    self._trace()
    self.shard = _sharding.attach(self)  # None without in/out_shardings; aligns policies
    # Two or more auto-planned variables: plan bucket tuples jointly (not their product).
    auto_idx = [i for i, p in enumerate(self.policies) if isinstance(p, Auto)]
    self.joint = None
    if len(auto_idx) >= 2:
      self.joint = JointPlan(self.policies, auto_idx,
                             min(self.policies[i].max_compiles for i in auto_idx))
      self.observers = tuple((i, p) for i, p in self.observers if i not in auto_idx)
    self.dynamic_plan = bool(self.observers) or self.joint is not None
    # One device: executables take the arguments' own pytrees (jax flattens them in C++), so
    # the hot path never flattens model parameters in Python.  Sharded: flat leaves.
    self.structured = self.shard is None
    self.top = None  # ((argument position, leaf index, leaf key), ...): see Wrapped._call_top
    self.tuple_hist: Counter = Counter()  # true size tuples seen (explain, compile values)
    self.per_sizes: dict[tuple, tuple] = {}  # sizes -> (bucket, output shapes, true elems)
    self.ideal_seen: set = set()
    self.bucket_time: dict[tuple, float] = {}  # measured seconds per call, per bucket
    self._store = None
    self._store_ready = False
    self.tiered: set = set()  # buckets whose tier-1 recompile was queued
    self.preloaded = False  # stored executables queued for loading (serving)
    self.prelowering = False  # the plan's buckets were handed to the pre-lowering thread
    self.prelowered: dict[tuple, concurrent.futures.Future] = {}  # bucket -> (Lowered, rw)
    names = wrapped._dyn_names
    if self.structured and wrapped._opts.dims != "auto" and self.mode in ("trust", "auto"):
      top = []
      for li in self.spec_idx:
        path = leaf_specs[li][0]
        if path not in names:  # a leaf inside a pytree argument: the general path
          top = None
          break
        top.append((names.index(path), li, _leaf_key_of_aval(avals[li])))
      self.top = None if top is None else tuple(top)
    self.top_pos = () if self.top is None else tuple(p for p, _, _ in self.top)

  def record_time(self, bkey, seconds: float) -> None:
    """One served call's seconds on bucket ``bkey``: the policies' and the scheduler's cost
    model (an exponential average per bucket)."""
    for p, b in zip(self.policies, bkey, strict=True):
      p.record_time(b, seconds)
    old = self.bucket_time.get(bkey)
    self.bucket_time[bkey] = seconds if old is None else 0.8 * old + 0.2 * seconds

  def accepts(self, leaves) -> bool:
    """Hot-path check of the leaves with dims: dtype and rank (and, with dims="auto", the axes
    still static). ~0.3 us a leaf; the other leaves are checked by the executable itself."""
    for i, key, static_axes in self.checks:
      x = leaves[i]
      if _leaf_key(x) != key:
        return False
      if static_axes:
        shape = x.shape
        for ax, n in static_axes:
          if shape[ax] != n:
            return False
    return True

  def _constraints(self, leaf_specs) -> tuple[str, ...]:
    opts = self.wrapped._opts
    out = list(opts.constraints)
    if opts.overflow != "grow":
      names = _symbolic.spec_variables([t for _, t in leaf_specs if t is not None])
      for v in names:
        p = self.wrapped._policy_for(v)
        if p.max is not None:
          out.append(f"{v} <= {p.max}")
    return tuple(out)

  # -- tracing -----------------------------------------------------------------------------
  def _trace(self) -> None:
    sym = _symbolic.symbolic_avals(self.sig, self.avals)
    try:
      closed, out_shape = jax.make_jaxpr(self.flat_fun, return_shape=True)(*sym)
    except Exception as e:  # noqa: BLE001 - any trace failure means: run exact
      if _needs_program(e):
        self.mode = "program"  # dynjax.while_loop/cond/recursive inside: run on the VM
        self.fallback = None
        return
      if self.mode == "exact":
        self.jaxpr = None
        return
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      self._fall_back(f"symbolic tracing failed ({type(e).__name__}: {first})")
      return
    self.jaxpr = closed
    out_leaves = list(out_shape)
    self.out_tree = self.flat_fun.out_tree
    self.out_avals = tuple(out_leaves)
    self.out_shape_fns = tuple(
        _symbolic.compile_shape(o.shape, self.sig.var_order) for o in out_leaves)
    self.out_dynamic = tuple(any(_symbolic.is_symbolic(d) for d in o.shape) for o in out_leaves)
    if self.mode == "trust":
      bad = [(i, o.shape) for i, o in enumerate(out_leaves)
             if any(_symbolic.is_symbolic(d) and str(d) not in self.sig.var_order
                    for d in o.shape)]
      if bad:
        i, shape = bad[0]
        self._fall_back(
            f"output {i} has shape ({', '.join(map(str, shape))}): with padding='trust' only "
            "outputs whose dims are plain variables can be unpadded by slicing; use "
            "padding='auto'")
    elif self.mode == "auto":
      try:
        plan = pad_jaxpr(closed, self.sig.var_order, self._bucket_env(self._probe_bucket()))
      except PaddingUnsupportedError as e:
        self._fall_back(f"the padding pass has no exact rule: {e}")
      except Exception as e:  # noqa: BLE001 - a pass bug must never give a wrong result
        self._fall_back(f"the padding pass failed ({type(e).__name__}: {e}); please report it")
      else:
        self.rewrites = tuple(plan.rewrites)

  def _probe_bucket(self) -> tuple[int, ...]:
    sizes = []
    for p in self.policies:
      b = p.sizes()[0] if p.max is not None else p.grow(max(p.min, 2))
      sizes.append(b)
    return tuple(sizes)

  def _fall_back(self, reason: str) -> None:
    w = self.wrapped
    if w._opts.on_fallback == "error":
      raise PaddingFallbackError(
          f"dynjax.jit({w.__name__}): padding={w._opts.padding!r} cannot pad this function and "
          f"on_fallback='error' refuses to run it unpadded (one compile per shape): "
          f"{reason.rstrip('.')}. "
          "Fix: rewrite the named line with primitives the pass supports "
          "(dynjax.bucketing.rule_coverage() lists them), use padding='trust' if the function "
          "is pad-safe, or on_fallback='warn' to accept one compile per shape") from None
    self.fallback = reason
    self.mode = "exact"
    self.gen += 1
    w._fallbacks.append(reason)
    warnings.warn(
        f"dynjax.jit({w.__name__}): running unpadded, one compile per shape: {reason}",
        stacklevel=6)

  def _bucket_env(self, bkey) -> dict[str, int]:
    return dict(zip(self.sig.var_order, bkey, strict=True))

  # -- compiling ---------------------------------------------------------------------------
  def padded_avals(self, bkey) -> list[jax.ShapeDtypeStruct]:
    out = []
    for fn, aval in zip(self.in_shape_fns, self.avals, strict=True):
      shape = aval.shape if fn is None else fn(bkey)
      out.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    return out

  def lower_bucket(self, bkey):
    """Lowers the executable of one bucket: (Lowered, rewrites).

    Unsharded executables take the dynamic arguments as pytrees (``structured``); sharded
    ones take flat leaves (their shardings are per leaf).
    """
    avals = self.padded_avals(bkey)
    w = self.wrapped
    flat_fun = self.flat_fun
    if self.structured:
      args = _tree_unflatten(self.treedef, avals)
      donate = w._donate_args()

      def as_leaves(xs):
        return jax.tree_util.tree_leaves(xs)
    else:
      args = avals
      donate = w._donate_leaves(self)

      def as_leaves(xs):
        return list(xs)
    if self.mode == "trust":
      def bucket_fun(*xs):
        return flat_fun(*as_leaves(xs))

      bucket_fun.__name__ = flat_fun.__name__
      return jax.jit(bucket_fun, donate_argnums=donate,
                     **_sharding.jit_kwargs(self, bkey, False)).lower(*args), ()
    assert self.mode == "auto", self.mode
    plan = pad_jaxpr(self.jaxpr, self.sig.var_order, self._bucket_env(bkey))
    nv = len(self.sig.var_order)

    def padded_fun(sizes, *xs):
      return plan.fun(tuple(sizes[i] for i in range(nv)), *as_leaves(xs))

    padded_fun.__name__ = flat_fun.__name__
    sizes_aval = jax.ShapeDtypeStruct((nv,), jnp.int32)
    lowered = jax.jit(padded_fun, donate_argnums=tuple(d + 1 for d in donate),
                      **_sharding.jit_kwargs(self, bkey, True)).lower(
        sizes_aval, *args)
    return lowered, tuple(plan.rewrites)

  def _entry_of(self, exe, bkey, rewrites, tier: int, source: str) -> _BucketEntry:
    in_shapes = tuple(a.shape for a in self.padded_avals(bkey))
    padded = sum(math.prod(s) for s, spec in zip(in_shapes, self.sig.leaves, strict=True)
                 if spec is not None)
    return _BucketEntry(exe, in_shapes, padded, rewrites, tier, source)

  def build_bucket(self, bkey, tier: int = 0, stored_min: int = 0) -> _BucketEntry:
    """Loads the bucket's executable from the store (the best stored tier >= ``stored_min``),
    or lowers and compiles it with ``tier``'s compiler options (and stores it)."""
    store = self.store()
    if store is not None:
      for t in sorted({t for b, t in store.stored() if b == bkey and t >= stored_min},
                      reverse=True):
        exe = store.load(bkey, t)
        if exe is not None:
          return self._entry_of(exe, bkey, self.rewrites, t, "stored")
    lowered, rewrites = self._lowered(bkey)
    w = self.wrapped
    if w._opts.serving and not self.prelowering:
      w._prelower(self, bkey)  # the rest of the plan lowers while this one compiles
    opts = w._compile_options(tier)
    # A bucket that goes to the executable store skips JAX's persistent cache write: the
    # store alone serves a restart, and each write serializes the executable holding the GIL
    # (H100, BERT-base: 10-90 ms of stalled serving per compile, seen by a GIL probe).
    with (_jax_private.no_persistent_cache_write() if store is not None
          else contextlib.nullcontext()):
      exe = lowered.compile(compiler_options=opts) if opts else lowered.compile()
    if store is not None:
      store.save(bkey, tier, exe)
    return self._entry_of(exe, bkey, rewrites, tier, "compiled")

  def _lowered(self, bkey):
    """(Lowered, rewrites) of a bucket: pre-lowered during the first wait, else now (when
    serving, on the one lowering thread: see ``Wrapped._lower_lane``)."""
    fut = self.prelowered.pop(bkey, None)
    if fut is not None and not fut.cancel():  # started (or done): wait for it
      try:
        return fut.result()
      except Exception:  # noqa: BLE001 - lowered again below, raising where it belongs
        pass
    w = self.wrapped
    if w._opts.serving and threading.current_thread().name != w._lane_name:
      return w._lower_lane().submit(_lowering, self, bkey).result()
    return self.lower_bucket(bkey)

  # -- the executable store (cache_dir) ----------------------------------------------------
  def store(self):
    """The family's :class:`~dynjax.runtime.ExecutableStore`, or None (no ``cache_dir``,
    sharded, exact, or a fingerprint that cannot be taken)."""
    if self._store_ready:
      return self._store
    self._store_ready = True
    root = self.wrapped._opts.store_root
    if root is None or not self.structured or self.mode not in ("trust", "auto"):
      return None
    try:
      parts = self.fingerprint_parts()
    except Exception as e:  # noqa: BLE001 - no store, never a wrong executable
      _cache_logger.info("dynjax: %s is not stored (fingerprint failed: %s: %s)",
                         self.wrapped.__name__, type(e).__name__, e)
      return None
    fp = fingerprint_parts(parts)
    describe = {"function": self.wrapped.__name__, "fingerprint": fp,
                **{k: (v if len(str(v)) < 400 else str(v)[:400] + "...")
                   for k, v in parts.items() if k != "consts"}}
    self._store = ExecutableStore(root, fp, describe)
    return self._store

  def fingerprint_parts(self) -> dict[str, Any]:
    """Everything a stored executable depends on, known before lowering.

    The symbolic jaxpr (memory addresses in reprs removed) and a hash of its constants, the
    signature, padding mode, donation, compiler options, jax/jaxlib/dynjax versions (dynjax as
    a hash of its own source, so a changed padding pass never reuses an executable), the
    backend and device, the jax configuration that changes lowering, and ``XLA_FLAGS``.
    """
    import hashlib

    consts = hashlib.sha256()
    for c in self.jaxpr.consts:
      a = np.asarray(c)
      consts.update(f"{a.dtype}{a.shape}".encode())
      consts.update(np.ascontiguousarray(a).tobytes())
    w = self.wrapped
    dev = jax.devices()[0]
    return {
        "jaxpr": _ADDRESS.sub("", str(self.jaxpr.jaxpr)),
        "consts": consts.hexdigest(),
        "mode": self.mode,
        "vars": self.sig.var_order,
        "specs": [(p, None if s is None else s.text) for p, s in
                  zip(self.leaf_paths, self.sig.leaves, strict=True)],
        "avals": [(str(a.dtype), tuple(a.shape), a.weak_type) for a in self.avals],
        "treedef": str(self.treedef),
        "donate": w._opts.donate_argnames,
        "compiler_options": w._opts.compiler_options,
        "versions": (jax.__version__, _jax_private.jaxlib_version(), _dynjax_source_hash()),
        "backend": (jax.default_backend(), dev.device_kind, jax.device_count()),
        "config": _jax_private.lowering_config(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }

  def exact_executable(self, leaves):
    """jax.jit at the exact shape (fallback / exact mode), cached in the shared LRU."""
    key = (self.fid, "exact", tuple(np.shape(x) for x in leaves))
    w = self.wrapped

    def build():
      avals = [jax.ShapeDtypeStruct(np.shape(x), a.dtype, weak_type=a.weak_type)
               for x, a in zip(leaves, self.avals, strict=True)]
      exe = jax.jit(self.flat_fun, donate_argnums=w._donate_leaves(self),
                    **_sharding.exact_kwargs(self, avals)).lower(*avals).compile()
      return exe if self.shard is None else _sharding.exact_call(exe, self, avals, self.shard)

    exe = w._cache.get(key)
    if exe is None:
      exe = w._cache.get_or_build(key, build)
    return exe, key


# -----------------------------------------------------------------------------------------------
# Host padding (reused buffers)
# -----------------------------------------------------------------------------------------------
def _host_pad(x: np.ndarray, shape) -> np.ndarray:
  """A fresh zero-filled host buffer of the bucket shape holding ``x`` in its prefix.

  Fresh on every call, never pooled: on CPU a jit call may alias a numpy argument instead of
  copying it, and the device and ``return_padded`` paths do not wait for the result, so a
  reused buffer could be overwritten while an earlier computation still reads it (seen as a
  wrong result). Measured: ~1.5 us for (8, 37) -> (8, 64) float32 (calloc + copy).
  """
  buf = np.zeros(shape, x.dtype)
  buf[tuple(slice(0, n) for n in x.shape)] = x
  return buf


# -----------------------------------------------------------------------------------------------
# Wrapped
# -----------------------------------------------------------------------------------------------
class Wrapped:
  """A function wrapped by :func:`dynjax.jit`: call it, or stage it with trace/lower/compile.

  Example:
    >>> f = dynjax.jit(lambda x: x.sum(1), dims={"x": "b, t"})
    >>> f(np.ones((2, 5), np.float32))
    array([5., 5.], dtype=float32)
    >>> print(f.explain())
  """

  def __init__(self, fun, *, dims, buckets, padding, overflow, static_argnames, donate_argnames,
               return_padded, constraints, max_executables, cache_dir, check, async_compile,
               in_shardings=None, out_shardings=None, serving=False, compile_workers=None,
               compiler_options=None, on_fallback="warn"):
    self.fun = fun
    self.__name__ = getattr(fun, "__name__", type(fun).__name__)
    self.__doc__ = getattr(fun, "__doc__", None)
    self.__wrapped__ = fun
    self._params = self._parameters(fun)
    static = _names(static_argnames, "static_argnames")
    donate = _names(donate_argnames, "donate_argnames")
    names = [p.name for p in self._params]
    for what, group in (("static_argnames", static), ("donate_argnames", donate)):
      unknown = [n for n in group if n not in names]
      if unknown:
        raise SpecError(f"{what}: {unknown} are not parameters of {self.__name__}; its "
                        f"parameters are {names}")
    if max_executables is not None and (not isinstance(max_executables, int)
                                        or max_executables < 1):
      raise SpecError(f"max_executables must be a positive integer or None, got "
                      f"{max_executables!r}")
    if compile_workers is not None and (isinstance(compile_workers, bool) or not isinstance(
        compile_workers, int) or compile_workers < 1):
      raise SpecError(f"compile_workers must be a positive integer or None, got "
                      f"{compile_workers!r}")
    self._opts = _Options(
        dims=self._check_dims(dims, names, static),
        buckets=self._check_buckets(buckets),
        padding=_choice(padding, _PADDING_MODES, "padding"),
        overflow=_choice(overflow, _OVERFLOW_MODES, "overflow"),
        static_argnames=static, donate_argnames=donate, return_padded=bool(return_padded),
        constraints=tuple(constraints), max_executables=max_executables,
        check=config.check if check is None else bool(check),
        async_compile=bool(async_compile) or bool(serving), serving=bool(serving),
        compile_workers=compile_workers or _default_workers(),
        compiler_options=_check_compiler_options(compiler_options),
        on_fallback=_choice(on_fallback, _ON_FALLBACK, "on_fallback"))
    self._static_pos = tuple(i for i, p in enumerate(self._params) if p.name in static)
    self._dyn_names = tuple(p.name for p in self._params if p.name not in static)
    self._opts.sharding = _sharding.check_options(in_shardings, out_shardings, self._dyn_names,
                                                  static, self.__name__)
    cache_dir = cache_dir or config.cache_dir
    if cache_dir:
      _jax_private.enable_persistent_cache(os.fspath(cache_dir))
      self._opts.store_root = os.path.join(os.fspath(cache_dir), "dynjax-executables")
    if config.log_compiles:
      enable_compile_log()
    self._cache = ExecutableCache(max_executables, name=self.__name__, log=config.log_compiles)
    self._families: dict[Any, _Family] = {}
    self._fast: dict[Any, _Family] = {}  # (static, treedef) -> last family used: the hot path
    self._padded_trees: set = set()  # treedefs (flattened through Padded) that hold a Padded
    self._fids = itertools.count()
    self._all_families: dict[int, _Family] = {}
    self._family_lock = threading.Lock()
    self._auto_state: dict[Any, list] = {}
    self._first_dtypes: dict[Any, tuple] = {}
    self._policies: dict[str, BucketPolicy] = {}
    self._fallbacks: list[str] = []
    self._stats_lock = threading.Lock()
    self._calls = 0
    self._hits = 0
    self._exact_calls = 0
    self._host_syncs = 0
    self._true_elems = 0
    self._padded_elems = 0
    self._bucket_calls: Counter = Counter()
    self._checks = 0
    self._scheduler: CompileScheduler | None = None
    self._lane: concurrent.futures.ThreadPoolExecutor | None = None
    self._lane_name = f"dynjax-lower-{self.__name__}"
    self._sched_lock = threading.Lock()
    self._force_tier_up = False
    self._calls_at_compile = 0  # calls so far when the last tier-0 compile finished
    self._served_larger = 0  # calls served on a larger compiled bucket than their own
    self._waits = 0  # calls that waited for a compile (or a stored executable) to finish
    self._wait_seconds = 0.0
    self._sizes_on_device: dict[tuple, jax.Array] = {}
    self._top: dict[Any, _Family] = {}  # static key -> family with the top-level fast path
    self._nparams = len(self._params)
    self._defaults = tuple(p.default for p in self._params)
    # Calls with only positional arguments may leave out trailing parameters with defaults
    # (keyword-only ones too, e.g. the Flax wrapper's rngs=None).
    positional = 0
    while positional < self._nparams and self._params[positional].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
      positional += 1
    first_default = self._nparams
    while first_default > 0 and self._defaults[first_default - 1] is not inspect.Parameter.empty:
      first_default -= 1
    # args of length n in [first_default, positional] bind in order, the rest take defaults.
    self._defaults_from = first_default if first_default <= positional else self._nparams
    self._positional = positional
    functools.update_wrapper(self, fun, updated=())

  # -- validation --------------------------------------------------------------------------
  @staticmethod
  def _parameters(fun) -> tuple[inspect.Parameter, ...]:
    try:
      params = tuple(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
      raise SpecError(f"dynjax.jit: cannot read the signature of {fun!r}") from None
    bad = [p.name for p in params
           if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if bad:
      raise SpecError(f"dynjax.jit: {getattr(fun, '__name__', fun)} has *args/**kwargs "
                      f"parameters {bad}; dynjax needs named parameters. Wrap it in a function "
                      "with explicit parameters.")
    return params

  def _check_dims(self, dims, names, static):
    if isinstance(dims, str):
      if dims != "auto":
        raise SpecError(f"dims={dims!r}: a single string must be \"auto\"; give a dict "
                        f"mapping parameter names to specs, e.g. {{{names[0]!r}: \"b, t\"}}"
                        if names else f"dims={dims!r} is not valid")
      return "auto"
    if not isinstance(dims, Mapping):
      raise SpecError(f"dims: expected a dict of parameter name -> shape spec, or \"auto\"; got "
                      f"{type(dims).__name__}")
    unknown = [k for k in dims if k not in names]
    if unknown:
      raise SpecError(f"dims names {unknown}, which are not parameters of {self.__name__}; "
                      f"its parameters are {names}")
    in_static = [k for k in dims if k in static]
    if in_static:
      raise SpecError(f"dims names {in_static}, which are in static_argnames; static arguments "
                      "have no shapes to declare")
    texts = []
    for v in jax.tree_util.tree_leaves(dict(dims)):
      if not isinstance(v, str):
        raise SpecError(f"dims: every spec must be a string like \"b, t\" (or None); got "
                        f"{type(v).__name__} {v!r}")
      texts.append(v)
    self._declared_vars = _symbolic.spec_variables(texts)
    return dict(dims)

  def _check_buckets(self, buckets):
    if buckets is None:
      return None
    if isinstance(buckets, Mapping):
      out = {}
      for k, v in buckets.items():
        out[k] = as_policy(v, f"[{k!r}]")
      declared = getattr(self, "_declared_vars", None)
      if declared is not None:
        unknown = [k for k in out if k not in declared]
        if unknown:
          raise SpecError(f"buckets names {unknown}, which are not dimension variables of dims; "
                          f"the variables are {declared}")
      return out
    return as_policy(buckets, "")

  def _policy_for(self, var: str) -> BucketPolicy:
    p = self._policies.get(var)
    if p is None:
      b = self._opts.buckets
      if isinstance(b, dict):
        base = b.get(var)
      else:
        base = b
      p = pow2() if base is None else base.fresh()
      self._policies[var] = p
    return p

  def _donate_args(self) -> tuple[int, ...]:
    """Positions (among the dynamic arguments) of ``donate_argnames``."""
    return tuple(i for i, n in enumerate(self._dyn_names) if n in self._opts.donate_argnames)

  def _donate_leaves(self, fam: _Family) -> tuple[int, ...]:
    if not self._opts.donate_argnames:
      return ()
    out = []
    for i, spec_path in enumerate(fam.leaf_paths):
      head = spec_path.split("[", 1)[0].split(".", 1)[0]
      if head in self._opts.donate_argnames:
        out.append(i)
    return tuple(out)

  # -- argument handling -------------------------------------------------------------------
  def _split(self, args, kwargs):
    """(static key, dynamic values in parameter order). ~1 us with positional args only (also
    when trailing parameters take their defaults: ``inspect`` binding costs ~40 us on the GPU
    host)."""
    params = self._params
    n = len(args)
    if not kwargs and self._defaults_from <= n < self._nparams and n <= self._positional:
      args = args + self._defaults[n:]
    if kwargs or len(args) != len(params):
      try:
        bound = inspect.Signature(params).bind(*args, **kwargs)
      except TypeError as e:
        raise TypeError(f"{self.__name__}(): {e}") from None
      bound.apply_defaults()
      values = tuple(bound.arguments[p.name] for p in params)
    else:
      values = args
    if not self._static_pos:
      return (), values
    static = tuple(values[i] for i in self._static_pos)
    try:
      hash(static)
    except TypeError:
      names = [params[i].name for i in self._static_pos]
      raise SpecError(f"static arguments {names} must be hashable; got "
                      f"{[type(s).__name__ for s in static]}") from None
    dyn = tuple(v for i, v in enumerate(values) if i not in self._static_pos)
    return static, dyn

  def _flat_fun(self, static, treedef):
    fun, params, static_pos = self.fun, self._params, self._static_pos
    def flat_fun(*leaves):
      dyn = iter(_tree_unflatten(treedef, leaves))
      st = iter(static)
      values = [next(st) if i in static_pos else next(dyn) for i in range(len(params))]
      kw = {p.name: v for p, v in zip(params, values, strict=True)}
      out_leaves, flat_fun.out_tree = _tree_flatten(fun(**kw))
      return out_leaves  # a flat list, so executables return flat lists too

    flat_fun.__name__ = self.__name__
    flat_fun.out_tree = None
    return flat_fun

  def _leaf_specs(self, dyn, leaves, treedef, auto_shapes=None) -> list[tuple[str, str | None]]:
    # Keypaths in parameter order (the order of the flat leaves), e.g. "batch['mask']".
    paths = [name + jax.tree_util.keystr(p)
             for name, value in zip(self._dyn_names, dyn, strict=True)
             for p, _ in jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_padded)[0]]
    dims = self._opts.dims
    if dims == "auto":
      specs = auto_shapes
      return list(zip(paths, specs, strict=True))
    texts: list[str | None] = []
    for name, value in zip(self._dyn_names, dyn, strict=True):
      n_leaves = len(_tree_flatten(value, is_leaf=_is_padded)[0])
      spec = dims.get(name)
      if spec is None:
        texts.extend([None] * n_leaves)
      elif isinstance(spec, str):
        if n_leaves != 1:
          raise SpecError(f"dims[{name!r}] = {spec!r} is one spec, but argument {name!r} is a "
                          f"pytree with {n_leaves} leaves; give a pytree of specs matching it")
        texts.append(spec)
      else:
        try:
          per = jax.tree_util.tree_map(
              lambda s, sub: [s] * len(_tree_flatten(sub, is_leaf=_is_padded)[0]), spec, value,
              is_leaf=lambda x: x is None or isinstance(x, str))
        except ValueError as e:
          raise SpecError(f"dims[{name!r}] does not match the structure of argument {name!r}: "
                          f"{e}") from None
        texts.extend(itertools.chain.from_iterable(
            jax.tree_util.tree_leaves(per, is_leaf=lambda x: isinstance(x, list))))
    return list(zip(paths, texts, strict=True))

  # -- families ----------------------------------------------------------------------------
  def _family(self, static, dyn, leaves, treedef) -> _Family:
    # The full key (slow path): dtype and rank of every leaf, plus the whole shape of leaves
    # without dims (a parameter of a new shape is a new family, as a retrace in jax.jit).
    avals = [_aval(x) for x in leaves]
    key = (static, treedef, tuple(map(_leaf_key, leaves)),
           self._static_shapes(dyn, leaves, treedef, avals))
    fam = self._families.get(key)
    if fam is not None and self._opts.dims != "auto":
      return fam
    with self._family_lock:
      fam = self._families.get(key)
      if self._opts.dims == "auto":
        state = self._auto_state.get(key)
        shapes = [a.shape for a in avals]
        if fam is not None and state is not None and _auto_fits(state, shapes):
          return fam
        state = _auto_promote(state, shapes)
        self._auto_state[key] = state
        specs = self._leaf_specs(dyn, leaves, treedef, _auto_specs(state))
      else:
        if fam is not None:
          return fam
        specs = self._leaf_specs(dyn, leaves, treedef)
        if key not in self._families:
          self._check_new_dtype(static, treedef, avals, specs)
      flat_fun = self._flat_fun(static, treedef)
      fam = _Family(self, flat_fun, specs, avals, treedef, next(self._fids))
      fam.leaf_paths = [p for p, _ in specs]
      fam.key = key
      self._families[key] = fam
      self._all_families[fam.fid] = fam
      return fam

  def _static_shapes(self, dyn, leaves, treedef, avals) -> tuple:
    """Shapes of the leaves that have no dims (explicit dims only; "auto" tracks them itself)."""
    if self._opts.dims == "auto":
      return ()
    specs = self._leaf_specs(dyn, leaves, treedef)
    return tuple(tuple(a.shape) for (_, text), a in zip(specs, avals, strict=True) if text is None)

  def _check_new_dtype(self, static, treedef, avals, specs):
    first = self._first_dtypes.setdefault((static, treedef), tuple(a.dtype for a in avals))
    bad = [f"{path}: traced as {d0}, got {a.dtype}"
           for (path, text), a, d0 in zip(specs, avals, first, strict=True)
           if text is not None and a.dtype != d0]
    if bad:
      raise DtypeMismatchError(
          f"{self.__name__}: argument dtypes changed since the first call:\n" + format_list(bad)
          + "\nCast the arguments to the traced dtypes (e.g. x.astype(np.float32)), or wrap "
          "a separate dynjax.jit for the other dtype.")

  # -- calling -----------------------------------------------------------------------------
  def __call__(self, *args, **kwargs):
    # Hot path on a cache hit.  Families whose leaves with dims are whole top-level arguments
    # (``f(params, tokens, lengths)``) take ``_call_top``: no Python pytree work at all; the
    # executable flattens and checks the parameters in C++ (a changed parameter raises
    # "Argument types differ" there and we take the slow path, as a jax.jit retrace).
    # Measured on the H100 host (slow CPU), BERT-base with 200 parameter leaves: ...
    static, dyn = self._split(args, kwargs)
    if self._top:
      fam = self._top.get(static)
      if fam is not None:
        out = self._call_top(fam, dyn)
        if out is not _MISS:
          return out
    leaves, treedef = _tree_flatten(dyn)
    # (a treedef lookup hashes and compares the whole structure: ~10 us for 200 leaves)
    if self._padded_trees and treedef in self._padded_trees:  # a Padded inside: keep it whole
      leaves, treedef = _tree_flatten(dyn, is_leaf=_is_padded)
    fam = self._fast.get((static, treedef))
    if fam is not None and fam.accepts(leaves):
      # Only the leaves with dims are checked here; a changed static leaf (a parameter of a new
      # shape or dtype) is caught by the executable's own argument check, then the slow path.
      try:
        return self._dispatch(fam, leaves)
      except TypeError as e:
        if not _is_signature_error(e):
          raise
    return self._call_slow(static, dyn, leaves, treedef)

  def _call_slow(self, static, dyn, leaves, treedef):
    if any(map(_is_padded, jax.tree_util.tree_leaves(dyn, is_leaf=_is_padded))):
      self._padded_trees.add(_tree_flatten(dyn)[1])
      leaves, treedef = _tree_flatten(dyn, is_leaf=_is_padded)
    fam = self._family(static, dyn, leaves, treedef)
    self._fast[(static, treedef)] = fam
    if fam.top is not None:
      self._top[static] = fam
    return self._dispatch(fam, leaves)

  def _call_top(self, fam: _Family, dyn):
    """The hot path of families whose leaves with dims are whole arguments: ``_MISS`` sends
    the call to the general path (another dtype/rank, or parameters the executable rejects).

    A repeated (shapes, host/device) of a family takes the ``_Hit`` resolved by its first
    call: check the leaves, pad into fresh host buffers, run, cut the outputs.  Measured on
    the 2-core CPU box, tiny function, numpy (8, 13) in / out: ~3 us of Python above the
    bucket's AOT executable called on padded input (was 5.6 us through ``_dispatch_core``).
    """
    if fam.mode not in _PADDED_MODES:
      return _MISS  # fell back to exact after a bucket's plan refused
    key = ()
    device = False
    for pos, _, lkey in fam.top:
      x = dyn[pos]
      if type(x) is np.ndarray:
        if x.dtype != lkey[0] or x.ndim != lkey[1] or lkey[2]:
          return _MISS
      elif _leaf_key(x) != lkey:
        return _MISS
      else:
        device = device or _on_device(x)
      key += (x.shape,)
    hit = fam.hits.get((key, device))
    try:
      if hit is not None and hit.gen == fam.gen:
        return self._run_hit(hit, dyn)
      shapes = {li: shape for (_, li, _), shape in zip(fam.top, key, strict=True)}
      out = self._dispatch_core(fam, dyn, shapes, True)
      self._make_hit(fam, (key, device), shapes, device)
      return out
    except TypeError as e:
      if _is_signature_error(e):
        return _MISS
      raise

  def _run_hit(self, hit: _Hit, dyn):
    if hit.pads:
      args = list(dyn)
      for pos, target, prefix in hit.pads:
        x = dyn[pos]
        if type(x) is not np.ndarray:
          x = np.asarray(x)  # a device array of a non-bucket shape: one host round trip
        buf = np.zeros(target, x.dtype)
        buf[prefix] = x
        args[pos] = buf
    else:
      args = dyn
    if hit.timed:
      t0 = time.perf_counter()
    outs = hit.exe(hit.dev_sizes, *args) if hit.dev_sizes is not None else hit.exe(*args)
    if hit.sync:  # host request: numpy results
      res = [h if sl is None else h[sl]
             for h, sl in zip(_to_host(outs), hit.out_slices, strict=True)]
    else:
      res = [o if sl is None else jax.device_put(np.asarray(o)[sl])
             for o, sl in zip(outs, hit.out_slices, strict=True)]
    fam = hit.fam
    if hit.timed:
      fam.record_time(hit.bkey, time.perf_counter() - t0)
    with self._stats_lock:
      hit.n += 1
    fam.tuple_hist[hit.sizes] += 1
    return res[0] if hit.single else _tree_unflatten(hit.out_tree, res)

  def _make_hit(self, fam: _Family, key, shapes, device: bool) -> None:
    """Resolves the hot path of ``key`` after a call that went through ``_dispatch_core``,
    where the call's path holds no per-call decision (no auto re-planning, checking,
    sharding, padded results, LRU bound)."""
    opts = self._opts
    if (fam.dynamic_plan or fam.shard is not None or opts.check or opts.return_padded
        or self._cache.max_entries is not None or fam.mode not in _PADDED_MODES):
      return
    sizes = _symbolic.solve_sizes(fam.sig, shapes)
    known = fam.per_sizes.get(sizes)
    if known is None or known[0] is None:
      return
    own, out_shapes, true_elems = known
    gen = fam.gen
    entry, bkey = fam.buckets.get(own), own
    if entry is None or (fam.fid, own) not in self._cache:
      best = self._larger_bucket(fam, own)  # served on a larger bucket while own compiles
      if best is None:
        return
      bkey, entry = best
    pads = []
    for pos, li in zip(fam.top_pos, fam.spec_idx, strict=True):
      target = entry.in_shapes[li]
      if shapes[li] != target:
        pads.append((pos, target, tuple(slice(0, n) for n in shapes[li])))
    dev_sizes = None
    if fam.mode == "auto":
      dev_sizes = self._sizes_on_device.get(sizes)
      if dev_sizes is None:
        return
    padded_out = [fn(bkey) for fn in fam.out_shape_fns]  # output dims at the bucket
    out_slices = tuple(None if tuple(o) == tuple(p) else tuple(slice(0, n) for n in o)
                       for o, p in zip(out_shapes, padded_out, strict=True))
    hit = _Hit(fam, gen, sizes, bkey, entry, tuple(pads), dev_sizes, out_slices, true_elems,
               not device, opts.serving and not device, bkey != own)
    with self._stats_lock:
      old = fam.hits.get(key)
      if old is not None:
        # Kept and still counted: a thread may be running it right now.
        fam.retired_hits.append(old)
      if len(fam.hits) > 4096 or len(fam.retired_hits) > 4096:
        for h in (*fam.hits.values(), *fam.retired_hits):
          self._fold_hit(h)
        fam.hits.clear()
        fam.retired_hits.clear()
      fam.hits[key] = hit

  def _fold_hit(self, hit: _Hit) -> None:
    """Moves a hit's calls into the counters (under ``_stats_lock``)."""
    n, hit.n = hit.n, 0
    if n:
      self._calls += n
      self._hits += n
      self._bucket_calls[hit.bucket_id] += n
      self._padded_elems += n * hit.padded
      self._true_elems += n * hit.true
      if hit.sync:
        self._host_syncs += n
      if hit.larger:
        self._served_larger += n

  def _calls_so_far(self) -> int:
    """Calls so far, hot-path ones included; read without the stats lock (a heuristic's
    input: the compile scheduler calls it under its own lock)."""
    n = self._calls
    for fam in list(self._all_families.values()):
      n += sum(h.n for h in list(fam.hits.values()))
    return n

  def _counters(self) -> dict:
    """The call counters, the hot path's per-hit counts included (under ``_stats_lock``)."""
    c = {"calls": self._calls, "hits": self._hits, "bucket_calls": Counter(self._bucket_calls),
         "padded": self._padded_elems, "true": self._true_elems, "syncs": self._host_syncs,
         "larger": self._served_larger}
    for fam in list(self._all_families.values()):
      for hit in (*fam.hits.values(), *fam.retired_hits):
        n = hit.n
        if n:
          c["calls"] += n
          c["hits"] += n
          c["bucket_calls"][hit.bucket_id] += n
          c["padded"] += n * hit.padded
          c["true"] += n * hit.true
          c["syncs"] += n if hit.sync else 0
          c["larger"] += n if hit.larger else 0
    return c

  def _dispatch(self, fam: _Family, leaves):
    # Outputs follow the data: device outputs when a leaf with dims is a device array (model
    # parameters on the device do not make a numpy request return device arrays).
    if fam.mode == "exact":
      return self._run_exact(fam, leaves, any(_on_device(leaves[i]) for i in fam.dyn_leaves))
    if fam.mode == "program":
      return self._run_program(fam, leaves, any(_on_device(leaves[i]) for i in fam.dyn_leaves))
    shapes = {i: getattr(leaves[i], "shape", ()) for i in fam.spec_idx}
    return self._dispatch_core(fam, leaves, shapes, False)

  def _dispatch_core(self, fam: _Family, vals, shapes, top: bool):
    """solve dims -> bucket -> pad -> run -> unpad.  ``vals``: the dynamic arguments (``top``)
    or the flat leaves; ``shapes``: leaf index -> shape of the leaves with dims."""
    opts = self._opts
    where = fam.top_pos if top else fam.spec_idx  # positions in vals of the leaves with dims
    device = False
    for p in where:
      if _on_device(vals[p]):
        device = True
        break
    sizes = _symbolic.solve_sizes(fam.sig, shapes)
    fam.tuple_hist[sizes] += 1
    # Per distinct sizes: (bucket, output shapes, true elements), computed once (~0.2 us a
    # lookup instead of ~3 us of policy bisects and shape functions on the CPU box).
    known = fam.per_sizes.get(sizes)
    if known is None or fam.dynamic_plan:
      known = self._size_info(fam, sizes)
      if known[0] is None:  # overflow="exact", or a size of 0
        leaves = _tree_flatten(vals, is_leaf=_is_padded)[0] if top else vals
        return self._run_exact(fam, leaves, device)
    bkey, out_shapes, true_elems = known
    entry = fam.buckets.get(bkey)
    if entry is not None and (self._cache.max_entries is None
                              or (fam.fid, bkey) in self._cache):
      hit = True
    else:
      try:
        entry, bkey, hit = self._entry_for(fam, bkey)
      except PaddingUnsupportedError as e:  # this bucket's plan refused (the probe's did not)
        fam._fall_back(f"the padding pass has no exact rule at bucket {bkey}: {e}")
        leaves = _tree_flatten(vals, is_leaf=_is_padded)[0] if top else vals
        return self._run_exact(fam, leaves, device)
    if fam.shard is not None:  # placed with their shardings, straight from the host
      full = [shapes.get(i, s) for i, s in enumerate(fam.avals_shapes)]
      args = fam.shard.pad(fam, vals, full, entry.in_shapes, fam.mode == "trust")
    else:
      padded = list(vals)
      for p, li in zip(where, fam.spec_idx, strict=True):
        padded[p] = _pad_leaf(vals[p], shapes[li], entry.in_shapes[li])
      args = padded if top else _tree_unflatten(fam.treedef, padded)
    timed = fam.observers or (opts.serving and not device and not opts.return_padded)
    t0 = time.perf_counter() if timed else 0.0
    if fam.mode == "auto":
      # The true sizes go to the device once per distinct sizes tuple (a dict hit afterwards),
      # not as a fresh host->device copy on every call.
      dev_sizes = self._sizes_on_device.get(sizes)
      if dev_sizes is None or (fam.shard is not None
                               and dev_sizes.sharding != fam.shard.replicated):
        if len(self._sizes_on_device) > 4096:
          self._sizes_on_device.clear()
        dev_sizes = self._sizes_on_device[sizes] = (
            jax.device_put(np.asarray(sizes, np.int32)) if fam.shard is None
            else fam.shard.put_sizes(sizes))  # replicated over the mesh: no per-call reshard
      outs = entry.exe(dev_sizes, *args)
    else:
      outs = entry.exe(*args)
    result = self._unpad(fam, outs, out_shapes, device)
    if timed:
      fam.record_time(bkey, time.perf_counter() - t0)
    with self._stats_lock:
      self._calls += 1
      self._hits += hit
      self._bucket_calls[(fam.fid, bkey)] += 1
      self._padded_elems += entry.padded_elems
      self._true_elems += true_elems
      if not device and not opts.return_padded:
        self._host_syncs += 1
    if opts.check:
      leaves = _tree_flatten(vals, is_leaf=_is_padded)[0] if top else vals
      self._maybe_check(fam, leaves, result)
    return result

  def _size_info(self, fam: _Family, sizes) -> tuple:
    """(bucket or None: run exact, output shapes, true elements of the leaves with dims)."""
    bkey = self._bucket_key(fam, sizes)
    info = (bkey, tuple(fn(sizes) for fn in fam.out_shape_fns),
            sum(math.prod(fn(sizes)) for fn in fam.in_shape_fns if fn is not None))
    if bkey is not None and not fam.dynamic_plan:
      if len(fam.per_sizes) > 4096:
        fam.per_sizes.clear()
      fam.per_sizes[sizes] = info
    return info

  def _bucket_key(self, fam: _Family, sizes) -> tuple | None:
    """The bucket of ``sizes`` (observed by the policies), or None: run exact."""
    for i, p in fam.observers:
      p.observe(sizes[i])
    joint = fam.joint
    if joint is not None:
      sub = joint.sub(sizes)
      joint.observe(sub)
      jb = joint.bucket(sub)
      if jb is None:
        if self._opts.overflow == "error":
          self._raise_overflow(fam, sizes)
        elif self._opts.overflow == "exact":
          return None
        jb = tuple(fam.policies[i].grow(sizes[i]) for i in joint.idx)
      jmap = dict(zip(joint.idx, jb, strict=True))
    bkey = []
    for i, (n, p) in enumerate(zip(sizes, fam.policies, strict=True)):
      b = jmap[i] if joint is not None and i in jmap else p.bucket(n)
      if b is None:
        if self._opts.overflow == "error":
          self._raise_overflow(fam, sizes)
        elif self._opts.overflow == "exact":
          return None
        b = p.grow(n)
      bkey.append(b)
    if 0 in sizes:
      return None
    return tuple(bkey)

  def _entry_for(self, fam: _Family, bkey):
    """(entry, bucket it runs on, cache hit?) for a call whose own bucket is ``bkey``."""
    entry = fam.buckets.get(bkey)
    if entry is not None and (self._cache.max_entries is None
                              or (fam.fid, bkey) in self._cache):
      return entry, bkey, True
    if self._opts.async_compile:
      b, entry = self._serve(fam, bkey)
      return entry, b, False
    return self._build_entry(fam, bkey), bkey, False  # new, or evicted: (re)build, wait

  def _build_entry(self, fam: _Family, bkey, tier: int = 0) -> _BucketEntry:
    """Builds (loads or compiles) one bucket; ``tier`` 1 replaces a quick tier-0 executable."""
    if tier == 0:
      entry = self._cache.get_or_build((fam.fid, bkey), lambda: fam.build_bucket(bkey, 0))
      if entry.source == "compiled":
        self._calls_at_compile = self._calls_so_far()
    else:
      t0 = time.perf_counter()
      entry = fam.build_bucket(bkey, tier, stored_min=tier)
      self._cache.put((fam.fid, bkey), entry, time.perf_counter() - t0)
    fam.buckets[bkey] = entry
    fam.gen += 1
    if entry.source == "stored":  # a restarted auto policy starts from the buckets it had
      for i, (p, b) in enumerate(zip(fam.policies, bkey, strict=True)):
        if fam.joint is None or i not in fam.joint.idx:
          p.adopt(b)
      if fam.joint is not None:
        fam.joint.adopt(fam.joint.sub(bkey))
    if (entry.tier + 1 < self._tiers() and bkey not in fam.tiered
        and self._scheduler is not None):
      fam.tiered.add(bkey)
      self._schedule(fam, bkey, entry.tier + 1)
    return entry

  # -- progressive serving (async_compile / serving) ---------------------------------------
  def _serve(self, fam: _Family, bkey):
    """Serves a call whose own bucket is not compiled: the smallest compiled bucket that
    covers it, else the first covering compile in flight (waited for).  The own bucket is
    queued for the background compiler in every case (it runs when it is worth the most)."""
    if not fam.preloaded:
      fam.preloaded = True
      store = fam.store()
      for b, _ in (store.stored() if store is not None else ()):
        self._schedule(fam, b, 0, urgent=True)  # loads in parallel (~0.05 s a bucket)
    t_wait = None
    while True:
      best = self._larger_bucket(fam, bkey)
      if best is not None:
        self._schedule(fam, bkey, 0)  # value-driven: compiles when worth it
        with self._stats_lock:
          if best[0] != bkey:
            self._served_larger += 1
          if t_wait is not None:
            self._waits += 1
            self._wait_seconds += time.perf_counter() - t_wait
        return best
      if t_wait is None:
        t_wait = time.perf_counter()
      # Nothing compiled covers this call: it waits for the first covering executable.
      # Serving: the bucket covering everything compiles first; the own bucket follows in
      # the background, or (GPU quick tier, >= 8 cores) at the same time: quick compiles
      # run no autotuning, so two at once barely slow each other, and the first requests
      # are served on the own bucket instead of the largest (H100, BERT-base: the 512
      # bucket runs 8.7 ms a request, the 256 one 4.2).  Otherwise (or with no declared
      # max): the own bucket, now.
      top = _top_bucket(fam, bkey) if self._opts.serving else None
      if top is not None and top != bkey:
        urgent = self._schedule(fam, top, 0, urgent=True)
        self._schedule(fam, bkey, 0, urgent=self._co_compile_own())
      else:
        urgent = self._schedule(fam, bkey, 0, urgent=True)
      futs = self._covering_futures(fam, bkey) or [urgent]
      done, _ = concurrent.futures.wait(futs, return_when=concurrent.futures.FIRST_COMPLETED)
      for f in done:
        if f.exception() is not None and (f is urgent or len(futs) == 1):
          raise f.exception()

  def _co_compile_own(self) -> bool:
    """Whether a first call compiles its own bucket alongside the covering one."""
    return (self._tiers() > 1 and self._opts.compile_workers >= 2
            and (os.cpu_count() or 1) >= 8)

  def _prelower(self, fam: _Family, first) -> None:
    """Lowers the buckets the policies plan, in one background thread, while the first
    (urgent) bucket compiles.

    Lowering is Python (tracing, MLIR building) and holds the GIL: done by the compile
    workers once serving has started, it stalled every request (H100, BERT-base: ~0.3 s of
    GIL per bucket, ~100 ms requests for a second after the first compile).  While the first
    bucket compiles, XLA has released the GIL and no request is being served yet, so the
    lowering there is free.
    """
    fam.prelowering = True
    store = fam.store()
    stored = {b for b, _ in store.stored()} if store is not None else set()
    cands = [b for b in _plan_buckets(fam, first, _PRELOWER_MAX)
             if b != first and b not in stored and (fam.fid, b) not in self._cache]
    if not cands:
      return
    lane = self._lower_lane()
    # A compile job that starts before its bucket's turn cancels the lane job (a queued
    # future cancels) and lowers it itself.
    fam.prelowered.update((b, lane.submit(_lowering, fam, b)) for b in cands)

  def _lower_lane(self) -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that lowers buckets while serving.

    Lowering holds the GIL (Python tracing, and MLIR passes in C++ that cannot be
    preempted); several compile workers lowering at once left the serving thread a fifth of
    the GIL (H100, BERT-base, auto re-plans: ~300 ms requests).  One lane costs no lowering
    throughput (the GIL serialises lowering anyway), and while it runs the interpreter's
    switch interval drops to 0.5 ms (``_quick_switches``) so a serving thread waiting for the
    GIL gets it back within 0.5 ms of Python instead of 5 ms.
    """
    lane = self._lane
    if lane is None:
      with self._sched_lock:
        if self._lane is None:
          self._lane = concurrent.futures.ThreadPoolExecutor(
              1, thread_name_prefix=self._lane_name)
        lane = self._lane
    return lane

  def _sched(self) -> CompileScheduler:
    sched = self._scheduler
    if sched is None:
      with self._sched_lock:
        if self._scheduler is None:
          self._scheduler = CompileScheduler(self._opts.compile_workers, self._job_value,
                                             name=self.__name__)
        sched = self._scheduler
    return sched

  def _schedule(self, fam: _Family, bkey, tier: int, urgent: bool = False):
    if tier == 0 and (fam.fid, bkey) in self._cache:
      f = concurrent.futures.Future()
      f.set_result(self._cache.get((fam.fid, bkey)))
      return f
    return self._sched().submit((fam.fid, bkey, tier),
                                functools.partial(self._build_entry, fam, bkey, tier),
                                urgent=urgent, info=(fam, bkey, tier))

  def _covering_futures(self, fam: _Family, bkey) -> list:
    return [f for (fid, b, tier), f in self._sched().in_flight().items()
            if fid == fam.fid and tier == 0 and all(x >= y for x, y in zip(b, bkey, strict=True))]

  def _job_value(self, job) -> float:
    """Expected serving seconds a job saves per second of compiling (the scheduler's order).

    Tier 0: over the true size tuples seen so far, how much cheaper the job's bucket would
    serve them than the best executable they have now (compiled, or compiling), if the
    policies still want the bucket.  Tier 1 (recompiling with full options) runs only when
    nothing else is running or wanted, one at a time, the most used bucket first.
    """
    fam, bkey, tier = job.info
    sched = self._scheduler
    if tier > 0:
      if (not self._force_tier_up
          and self._calls_so_far() - self._calls_at_compile < _TIER_UP_AFTER):
        return 0.0  # the traffic is not steady yet: recompiling now would slow it down
      if sched._running:
        return 0.0
      for other in sched._pending.values():
        ofam, obkey, otier = other.info
        if other.urgent or (otier == 0 and self._tier0_value(ofam, obkey) > 0):
          return 0.0
      used = self._bucket_calls.get((fam.fid, bkey), 0) + sum(
          h.n for h in list(fam.hits.values()) if h.bkey == bkey)
      return 1e-9 * (1 + used)
    return self._tier0_value(fam, bkey)

  def _tier0_value(self, fam: _Family, bkey) -> float:
    if (fam.fid, bkey) in self._cache or not fam.tuple_hist:
      return 0.0
    if not _planned(fam, bkey):
      return 0.0  # re-planned away (auto): retired while still queued
    sizes = np.array(list(fam.tuple_hist), np.int64)
    counts = np.array(list(fam.tuple_hist.values()), float)
    have = [b for b in fam.buckets if (fam.fid, b) in self._cache]
    have += [k[1] for k in self._scheduler._running if k[0] == fam.fid and k[2] == 0
             and k[1] != bkey]
    cost = self._cost_model(fam)
    mine = cost(bkey)
    if have:
      hb = np.array(have, np.int64)
      covers = np.all(hb[:, None, :] >= sizes[None, :, :], axis=2)  # [have, sizes]
      hc = np.array([cost(b) for b in have])
      cur = np.where(covers, hc[:, None], np.inf).min(axis=0)
    else:
      cur = np.full(len(sizes), np.inf)
    wait_cost = 4.0 * max([mine, *(cost(b) for b in have)])  # no executable yet: a compile
    cur = np.where(np.isfinite(cur), cur, wait_cost)
    mask = np.all(np.array(bkey)[None, :] >= sizes, axis=1)
    gain = float((counts[mask] * np.maximum(cur[mask] - mine, 0.0)).sum())
    return gain / self._compile_estimate(fam)

  def _cost_model(self, fam: _Family):
    """Seconds per call of a bucket: a line through the measured buckets, else padded
    elements (a relative cost is all the scheduler needs)."""
    known = [(math.prod(b), t) for b, t in fam.bucket_time.items()]
    if len(known) >= 2:
      xs, ys = np.array(known, float).T
      if np.ptp(xs) > 0:
        slope, icpt = np.polyfit(xs, ys, 1)
        if slope > 0:
          return lambda b: float(icpt + slope * math.prod(b))
    scale = known[0][1] / known[0][0] if known else 1.0
    return lambda b: float(scale * math.prod(b))

  def _compile_estimate(self, fam: _Family) -> float:
    ts = [dt for key, dt in self._cache.compile_log if key[0] == fam.fid]
    return float(np.mean(ts)) if ts else 1.0

  def _tiers(self) -> int:
    """2 when serving on GPU with default compiler options (quick tier first), else 1."""
    if self._opts.serving and not self._opts.compiler_options and _on_gpu():
      return 2
    return 1

  def _compile_options(self, tier: int) -> dict:
    opts = dict(self._opts.compiler_options)
    if tier == 0 and self._tiers() > 1:
      opts.update(_QUICK_GPU_OPTIONS)
    return opts

  def _larger_bucket(self, fam: _Family, bkey):
    best = None
    for other, entry in list(fam.buckets.items()):
      if all(o >= b for o, b in zip(other, bkey, strict=True)) and (fam.fid, other) in self._cache:
        if best is None or math.prod(other) < math.prod(best[0]):
          best = (other, entry)
    return best

  def _raise_overflow(self, fam: _Family, sizes) -> None:
    lines = []
    for v, n, p in zip(fam.sig.var_order, sizes, fam.policies, strict=True):
      if p.bucket(n) is None:
        uses = [f"{fam.sig.leaves[li].path}.shape[{ax}]" for li, ax, vi in fam.sig.solve_plan
                if fam.sig.var_order[vi] == v]
        lines.append(f"{v} = {n} ({', '.join(uses)}) is above the largest bucket {p.max} of "
                     f"{p!r}")
    raise OutOfBucketsError(
        f"{self.__name__}: dimension over the largest bucket:\n" + format_list(lines)
        + "\nRaise the policy's max, or pass overflow=\"grow\" (compile a larger bucket) or "
        "overflow=\"exact\" (run unpadded).")

  def _unpad(self, fam: _Family, outs, shapes, device: bool):
    opts = self._opts
    if opts.return_padded:
      res = [Padded(o, s) if dyn else o
             for o, s, dyn in zip(outs, shapes, fam.out_dynamic, strict=True)]
      return _tree_unflatten(fam.out_tree, res)
    if device:
      res = []
      for o, s in zip(outs, shapes, strict=True):
        if tuple(o.shape) != s:
          # Unpadding on device would compile a slice per exact shape (~70 ms on H100); a host
          # round trip costs a sync plus two copies instead (~0.1-0.3 ms on H100).
          o = (jax.device_put(np.asarray(o)[tuple(slice(0, n) for n in s)])
               if fam.shard is None else fam.shard.unpad(o, s))
        res.append(o)
      return _tree_unflatten(fam.out_tree, res)
    host = _to_host(outs)
    res = [h if h.shape == s else h[tuple(slice(0, n) for n in s)]
           for h, s in zip(host, shapes, strict=True)]
    return _tree_unflatten(fam.out_tree, res)

  def _run_exact(self, fam: _Family, leaves, device: bool):
    leaves = [x.unpad() if _is_padded(x) else x for x in leaves]
    shapes = [np.shape(leaves[i]) for i in fam.dyn_leaves]
    exe, _ = fam.exact_executable(leaves)
    flat = exe(*leaves)
    tree = fam.flat_fun.out_tree
    if not device:
      flat = _to_host(flat)
    with self._stats_lock:
      self._calls += 1
      self._exact_calls += 1
      self._bucket_calls[(fam.fid, "exact")] += 1
      n = sum(math.prod(s) for s in shapes)
      self._true_elems += n
      self._padded_elems += n
      if not device:
        self._host_syncs += 1
    if self._opts.return_padded:
      flat = [Padded(o, np.shape(o)) for o in flat]
    return _tree_unflatten(tree, flat)

  def _run_program(self, fam: _Family, leaves, device: bool):
    """A function with dynjax control flow: a host program on the VM whose straight-line
    segments are compiled per bucket (dynjax.control), or op by op when it cannot be staged."""
    from dynjax.control import run_in_program
    from dynjax.control._inprogram import ProgramRunner

    leaves = [x.unpad() if _is_padded(x) else x for x in leaves]
    runner = getattr(fam, "program", None)
    if runner is None:
      runner = fam.program = ProgramRunner(
          fam.flat_fun, _symbolic.symbolic_avals(fam.sig, fam.avals), fam.sig, fam.policies,
          self.__name__, self._opts.padding)

    def eager():
      dyn = iter(_tree_unflatten(fam.treedef, leaves))
      static = iter(fam.key[0])
      kw = {p.name: (next(static) if i in self._static_pos else next(dyn))
            for i, p in enumerate(self._params)}
      return run_in_program(self.fun, (), kw, options=self._opts)

    flat, tree = runner.run(leaves, not device, eager)
    if not device:
      flat = _to_host(flat)
    with self._stats_lock:
      self._calls += 1
      self._bucket_calls[(fam.fid, "program")] += 1
    return _tree_unflatten(tree, flat)

  def _maybe_check(self, fam: _Family, leaves, result) -> None:
    self._checks += 1
    if (self._checks - 1) % config.check_every:
      return
    exact_leaves = [x.unpad() if _is_padded(x) else np.asarray(x) for x in leaves]
    exe, _ = fam.exact_executable(exact_leaves)
    want = _to_host(exe(*exact_leaves))
    got, _ = _tree_flatten(result, is_leaf=_is_padded)
    got = [g.unpad() if _is_padded(g) else np.asarray(g) for g in got]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
      w = np.asarray(w)
      ok = g.shape == w.shape and (
          np.allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)
          if np.issubdtype(w.dtype, np.inexact) else np.array_equal(g, w))
      if not ok:
        diff = (f"max abs diff {np.max(np.abs(g.astype(np.float64) - w)):.3g}"
                if g.shape == w.shape else f"shape {g.shape} vs {w.shape}")
        raise PaddingMismatchError(
            f"{self.__name__}: check=True found output {i} of the padded executable differs "
            f"from the exact-shape function ({diff}). Please report this with the function; "
            "padding='exact' avoids it meanwhile.")

  # -- stages ------------------------------------------------------------------------------
  def trace(self, *args, **kwargs) -> Traced:
    """Traces with symbolic dims (once per static signature); see :class:`Traced`."""
    static, dyn = self._split(args, kwargs)
    leaves, treedef = _tree_flatten(dyn, is_leaf=_is_padded)
    fam = self._family(static, dyn, leaves, treedef)
    shapes = [x.shape if hasattr(x, "shape") else () for x in leaves]
    sizes = _symbolic.solve_sizes(fam.sig, shapes) if fam.sig.var_order else ()
    return Traced(self, fam, sizes)

  def lower(self, *args, **kwargs) -> Lowered:
    return self.trace(*args, **kwargs).lower()

  def warmup(self, *args, progress: bool | None = None, max_workers: int | None = None,
             background: bool = False, **kwargs) -> dict:
    """Compiles (or, with ``cache_dir``, loads) every bucket ahead of time, concurrently.

    The buckets: every bucket of the declared ranges (variables whose policy has no ``max``:
    the example's bucket only), plus every bucket a previous run stored under ``cache_dir``.
    Stored executables load in parallel (~0.05 s each for BERT-base on an H100) without
    tracing or lowering them again, so a restarted server is ready at once.
    ``background=True`` returns at once and builds the largest bucket first; with
    ``async_compile=True``/``serving=True`` calls are then served on the smallest built
    bucket that fits while the rest build (``wait()`` blocks until all are done).

    Returns:
      ``{"buckets": [...], "compiled": n, "loaded": n, "seconds": s}`` (``"pending": n`` in
      background).

    Example:
      >>> f.warmup(np.zeros((8, 16), np.int32))
      {'buckets': [(8, 16), (8, 32), ...], 'compiled': 6, 'seconds': 3.1}
    """
    traced = self.trace(*args, **kwargs)
    fam = traced.family
    if fam.mode == "exact":
      return {"buckets": [], "compiled": 0, "seconds": 0.0, "note": fam.fallback or "exact mode"}
    per_var = []
    for n, p in zip(traced.sizes, fam.policies, strict=True):
      per_var.append(p.sizes() if p.max is not None else (p.bucket(n),))
    todo = list(itertools.product(*per_var))
    if fam.joint is not None:  # the planned tuples, not the product of the auto tables
      jidx = fam.joint.idx
      todo = sorted({tuple(jt[jidx.index(i)] if i in jidx else b[i] for i in range(len(b)))
                     for b in todo for jt in fam.joint.sizes()})
    store = fam.store()
    if store is not None:
      todo = sorted(set(todo) | {b for b, _ in store.stored() if len(b) == len(fam.policies)})
    before, loads_before = self._cache.compiles, self._cache.loads
    t0 = time.perf_counter()
    if background:
      futs = [self._schedule(fam, b, 0, urgent=True)
              for b in sorted(todo, key=math.prod, reverse=True)]
      return {"buckets": todo, "pending": sum(not f.done() for f in futs), "seconds": 0.0}
    show = config.progress if progress is None else progress
    workers = max_workers or min(len(todo), max(2, os.cpu_count() or 2))
    done = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      futs = [pool.submit(self._build_entry, fam, b) for b in todo]
      for f in concurrent.futures.as_completed(futs):
        f.result()
        done += 1
        if show:
          _progress(f"dynjax warmup {self.__name__}", done, len(todo), time.perf_counter() - t0)
    if show:
      sys.stderr.write("\n")
    return {"buckets": todo, "compiled": self._cache.compiles - before,
            "loaded": self._cache.loads - loads_before, "seconds": time.perf_counter() - t0}

  def wait(self, timeout: float | None = None) -> bool:
    """Waits for background compiles (``async_compile``/``serving``,
    ``warmup(background=True)``), including queued tier-1 recompiles; False on timeout."""
    if self._scheduler is None:
      return True
    self._force_tier_up = True  # whoever waits lets the tier-1 recompiles run now
    self._scheduler.poke()
    return self._scheduler.wait_idle(timeout)

  def stats(self) -> dict:
    """Counters: calls, compiles, cache hits, compile seconds, per-bucket calls, padded
    fraction, fallbacks, host syncs, evictions.

    Example:
      >>> f.stats()["compiles"]
      3
    """
    with self._stats_lock:
      fams = self._all_families
      c = self._counters()
      per_bucket = {}
      for (fid, bkey), n in sorted(c["bucket_calls"].items(), key=str):
        fam = fams[fid]
        if bkey in ("exact", "program"):
          label = "exact (unpadded)" if bkey == "exact" else "control-flow program (VM)"
        else:
          label = ", ".join(f"{v}={b}" for v, b in zip(fam.sig.var_order, bkey, strict=True))
        per_bucket[label] = per_bucket.get(label, 0) + n
      return {
          "calls": c["calls"],
          "compiles": self._cache.compiles,
          "cache_hits": c["hits"],
          "compile_seconds": self._cache.compile_seconds,
          "per_bucket_calls": per_bucket,
          "padded_fraction": (0.0 if not c["padded"] else 1.0 - c["true"] / c["padded"]),
          "exact_calls": self._exact_calls,
          "fallbacks": list(self._fallbacks),
          "host_syncs": c["syncs"],
          "evictions": self._cache.evictions,
          "executables": len(self._cache),
          "loaded_from_store": self._cache.loads,
          "served_on_larger_bucket": c["larger"],
          "waited_for_compile": self._waits,
          "wait_seconds": self._wait_seconds,
          "background": (None if self._scheduler is None else {
              "workers": self._scheduler.workers, "done": self._scheduler.done,
              "failed": self._scheduler.failed, "busy_seconds": self._scheduler.busy_seconds,
              "running": len(self._scheduler.running()),
              "pending": len(self._scheduler.pending())}),
          "policies": {v: repr(p) for v, p in self._policies.items()},
          "programs": [fam.program.describe() for fam in fams.values()
                       if getattr(fam, "program", None) is not None],
      }

  def explain(self) -> str:
    """A report: symbolic signature, output shape functions, bucket plan and expected waste,
    equations the padding pass rewrote, fallbacks and why."""
    lines = [f"dynjax.jit({self.__name__}): padding={self._opts.padding!r}, "
             f"overflow={self._opts.overflow!r}"]
    if not self._families:
      lines.append("  (not traced yet: call it or use .trace(*args))")
    for fam in self._families.values():
      sig = fam.sig
      lines.append(f"family {fam.fid}: mode={fam.mode}")
      runner = getattr(fam, "program", None)
      if runner is not None:
        d = runner.describe()
        lines.append(f"  host program: {d['segments']} compiled segments, control ops "
                     f"{d['control_ops']}" if d["compiled"] else
                     f"  host program: runs op by op ({d['reason']})")
      lines.append("  inputs:")
      for (path, text), a in zip(
          [(p, s) for p, s in zip(fam.leaf_paths, sig.leaves, strict=True)], fam.avals,
          strict=True):
        dims = ", ".join(map(str, text.dims)) if text is not None else ", ".join(
            map(str, a.shape))
        lines.append(f"    {path}: {a.dtype}[{dims}]{'' if text else '  (static)'}")
      if fam.out_avals is not None:
        lines.append("  outputs (shape functions of the dims):")
        for i, o in enumerate(fam.out_avals):
          lines.append(f"    out[{i}]: {o.dtype}[{', '.join(map(str, o.shape))}]")
      if sig.var_order:
        lines.append("  bucket plan:")
        hists = [Counter() for _ in sig.var_order]
        for sizes, n in fam.tuple_hist.items():
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
      if fam.joint is not None:
        lines.append(f"    jointly planned {[sig.var_order[i] for i in fam.joint.idx]}: "
                     f"{list(fam.joint.sizes())} ({fam.joint.replans} re-plans)")
      used = sorted(k for k in fam.buckets)
      if used:
        lines.append(f"  compiled buckets: {used}")
      waste = self.stats()["padded_fraction"]
      lines.append(f"  padded fraction so far: {waste:.1%}")
      if fam.rewrites:
        lines.append("  padding pass:")
        lines.extend(f"    {r}" for r in fam.rewrites)
      if fam.fallback:
        lines.append(f"  FALLBACK to exact execution: {fam.fallback}")
    return "\n".join(lines)

  def clear_cache(self) -> None:
    """Drops every traced family and compiled executable."""
    with self._family_lock:
      self._families.clear()
      self._fast.clear()
      self._top.clear()
      self._auto_state.clear()
      self._cache.clear()

  def __repr__(self) -> str:
    return f"<dynjax.jit {self.__name__}>"

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self
    return functools.partial(self, obj)


# -----------------------------------------------------------------------------------------------
# dims="auto"
# -----------------------------------------------------------------------------------------------
def _auto_fits(state, shapes) -> bool:
  for entry, shape in zip(state, shapes, strict=True):
    for d, n in zip(entry, shape, strict=True):
      if isinstance(d, int) and d != n:
        return False
  return True


def _auto_promote(state, shapes):
  """Makes every axis whose size changed symbolic; axes that changed together share a name."""
  if state is None:
    return [tuple(int(n) for n in s) for s in shapes]
  used = {d for entry in state for d in entry if isinstance(d, str)}
  groups: dict[tuple[int, int], str] = {}
  new_state = []
  counter = itertools.count()
  for entry, shape in zip(state, shapes, strict=True):
    row = []
    for d, n in zip(entry, shape, strict=True):
      if isinstance(d, int) and d != n:
        name = groups.get((d, n))
        if name is None:
          name = next(f"d{i}" for i in counter if f"d{i}" not in used)
          used.add(name)
          groups[(d, n)] = name
        row.append(name)
      else:
        row.append(d)
    new_state.append(tuple(row))
  return new_state


def _auto_specs(state) -> list[str | None]:
  out = []
  for entry in state:
    if any(isinstance(d, str) for d in entry):
      out.append(", ".join(str(d) for d in entry))
    else:
      out.append(None)
  return out


# -----------------------------------------------------------------------------------------------
# Stage objects
# -----------------------------------------------------------------------------------------------
class Traced:
  """A function traced with symbolic dims: the symbolic jaxpr and its shape functions."""

  __slots__ = ("wrapped", "family", "sizes")

  def __init__(self, wrapped: Wrapped, family: _Family, sizes):
    self.wrapped = wrapped
    self.family = family
    self.sizes = tuple(sizes)

  @property
  def jaxpr(self):
    """The symbolic ``ClosedJaxpr`` (None when tracing failed and the function runs exact)."""
    return self.family.jaxpr

  @property
  def dim_vars(self) -> tuple[str, ...]:
    return self.family.sig.var_order

  @property
  def out_shapes(self):
    """Symbolic output shapes, as a pytree of ``ShapeDtypeStruct``."""
    fam = self.family
    return None if fam.out_tree is None else _tree_unflatten(fam.out_tree, list(fam.out_avals))

  def bucket(self) -> tuple[int, ...]:
    fam = self.family
    out = []
    for n, p in zip(self.sizes, fam.policies, strict=True):
      b = p.bucket(n)
      out.append(p.grow(n) if b is None else b)
    return tuple(out)

  def lower(self, bucket: Mapping[str, int] | None = None) -> Lowered:
    """Lowers the executable of ``bucket`` (default: the bucket of the traced arguments)."""
    fam = self.family
    if fam.mode == "exact":
      raise SpecError(f"{self.wrapped.__name__} runs exact (unpadded), so it has no bucket "
                      f"executables to lower: {fam.fallback or 'padding=' + repr(fam.mode)}")
    bkey = self.bucket() if bucket is None else tuple(bucket[v] for v in fam.sig.var_order)
    lowered, rewrites = fam.lower_bucket(bkey)
    return Lowered(self, bkey, lowered, rewrites)

  def as_text(self) -> str:
    return str(self.family.jaxpr)

  def __repr__(self) -> str:
    return f"Traced({self.wrapped.__name__}, dims={self.dim_vars}, sizes={self.sizes})"


class Lowered:
  """One bucket's padded function, lowered to StableHLO."""

  __slots__ = ("traced", "bucket", "_lowered", "rewrites")

  def __init__(self, traced: Traced, bucket, lowered, rewrites):
    self.traced = traced
    self.bucket = bucket
    self._lowered = lowered
    self.rewrites = rewrites

  def as_text(self) -> str:
    return self._lowered.as_text()

  def compile(self) -> Compiled:
    fam = self.traced.family
    exe = self._lowered.compile()
    in_shapes = tuple(a.shape for a in fam.padded_avals(self.bucket))
    padded = sum(math.prod(s) for s, spec in zip(in_shapes, fam.sig.leaves, strict=True)
                 if spec is not None)
    entry = _BucketEntry(exe, in_shapes, padded, self.rewrites)
    return Compiled(self.traced, self.bucket, entry)

  def __repr__(self) -> str:
    return f"Lowered({self.traced.wrapped.__name__}, bucket={self.bucket})"


class Compiled:
  """One bucket's XLA executable; calling it pads, runs and unpads (args must fit the bucket).

  Compiling through the stages also installs the executable in the function's cache.
  """

  __slots__ = ("traced", "bucket", "entry")

  def __init__(self, traced: Traced, bucket, entry: _BucketEntry):
    self.traced = traced
    self.bucket = bucket
    self.entry = entry
    w, fam = traced.wrapped, traced.family
    w._cache.get_or_build((fam.fid, bucket), lambda: entry)
    fam.buckets.setdefault(bucket, entry)

  def as_text(self) -> str:
    return self.entry.exe.as_text()

  def __call__(self, *args, **kwargs):
    w = self.traced.wrapped
    traced = w.trace(*args, **kwargs)
    if traced.bucket() != self.bucket:
      raise ShapeMismatchError(
          f"these arguments need bucket {traced.bucket()} but this executable is bucket "
          f"{self.bucket}; call the dynjax function itself to dispatch any shape")
    return w(*args, **kwargs)

  def __repr__(self) -> str:
    return f"Compiled({self.traced.wrapped.__name__}, bucket={self.bucket})"


# -----------------------------------------------------------------------------------------------
# helpers
# -----------------------------------------------------------------------------------------------
_ARRAY_IMPL = type(jnp.zeros(()))


def _leaf_key_of_aval(a) -> tuple:
  return (a.dtype, len(a.shape), False) if not a.weak_type else (a.dtype, len(a.shape), True)


def _on_device(x) -> bool:
  t = type(x)
  if t is _ARRAY_IMPL:
    return True
  if t is Padded:
    return _on_device(x.buffer)
  return t is not np.ndarray and isinstance(x, jax.Array)


def _leaf_key(x):
  """(dtype, rank, weak) of a leaf without building an aval.

  Measured (2-core CPU): ~0.15 us for a jax array through ``.aval`` and an exact type test;
  ``isinstance(x, jax.Array)`` (an ABC check) alone cost ~0.8 us, 170 us for a 200-leaf model.
  """
  t = type(x)
  if t is _ARRAY_IMPL:
    a = x.aval
    return (a.dtype, len(a.shape), False)
  if t is np.ndarray:
    return (x.dtype, x.ndim, False)
  if t is Padded:
    return (x.buffer.dtype, len(x.shape), False)
  a = _aval(x)
  return (a.dtype, len(a.shape), a.weak_type)


def _aval(x) -> jax.ShapeDtypeStruct:
  if _is_padded(x):
    return jax.ShapeDtypeStruct(x.shape, x.buffer.dtype)
  if isinstance(x, np.ndarray | jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if isinstance(x, bool | int | float | complex):
    dtype = jnp.asarray(x).dtype
    return jax.ShapeDtypeStruct((), dtype, weak_type=True)
  if isinstance(x, np.generic):
    return jax.ShapeDtypeStruct((), x.dtype)
  try:
    a = jnp.asarray(x)
  except TypeError:
    raise SpecError(f"argument leaf of type {type(x).__name__} is not an array; mark its "
                    "parameter in static_argnames") from None
  return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _needs_program(e: BaseException) -> bool:
  """True when tracing stopped at a dynjax control-flow op (dynjax.control.NeedsProgram)."""
  while e is not None:
    if type(e).__name__ == "NeedsProgram" and type(e).__module__.startswith("dynjax.control"):
      return True
    e = e.__cause__ or e.__context__
  return False


def _to_host(outs) -> list[np.ndarray]:
  """Device outputs to numpy. ``np.asarray`` per output costs ~2 us on CPU where
  ``jax.device_get`` costs ~40 us (tree walk); several outputs start their copies first."""
  if len(outs) > 1:
    for o in outs:
      if isinstance(o, jax.Array):
        o.copy_to_host_async()
  return [np.asarray(o) for o in outs]


_MISS = object()  # _call_top: not served by the fast path
_PADDED_MODES = ("trust", "auto")
_LEAF_TREEDEF = jax.tree_util.tree_structure(0)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Quick compiles on GPU (serving, tier 0): cuBLAS gemms chosen by cuBLAS's heuristics, no
# autotuning.  H100, BERT-base, jax 0.11.2 (benchmarks/probe_serving.py, probe_contention.py):
# compile 2.2 s (T=128) / 3.0 s (T=512) vs 5.2 / 5.1 s with XLA's defaults and 3.3 / 3.9 s
# with triton gemms off but autotuned; run 2.72 / 8.70 ms vs 2.03 / 6.70 (defaults).  What
# decides it is serving *during* background compiles: autotuning runs kernels on the GPU, and
# while four compiles autotuned, every request took ~110 ms instead of ~8 (5 s of stalls in
# a 600-request cold start); without autotuning the stalls were gone.  Tier 1 recompiles
# with XLA's defaults once traffic is steady.
_QUICK_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
# Buckets lowered in the background during the first wait (serving).
_PRELOWER_MAX = 12
# Tier-1 recompiles (serving on GPU) wait for this many calls after the last tier-0 compile:
# measured, they slow serving by ~40% while they run (GPU autotuning, cores), and pay back
# only after minutes of traffic.  wait() runs them at once.
_TIER_UP_AFTER = 1000
_cache_logger = logging.getLogger("dynjax")


def _is_signature_error(e: BaseException) -> bool:
  """An executable rejected its arguments (new parameter shapes/dtypes/structure): retrace."""
  msg = str(e)
  return msg.startswith("Argument types differ") or msg.startswith(
      "Function compiled with input pytree does not match")


def _pad_leaf(x, shape, target):
  """One argument leaf padded to its bucket shape (a ``Padded`` of that shape passes as is)."""
  if type(x) is Padded:
    buf = x.buffer
    if tuple(buf.shape) == target:
      return buf
    x = x.unpad()
    shape = x.shape
  if shape == target:
    return x
  if not isinstance(x, np.ndarray):
    x = np.asarray(x)  # device array of a non-bucket shape: one host round trip
  return _host_pad(x, target)


def _planned(fam, bkey) -> bool:
  """Whether ``bkey`` is still one of the buckets the family's policies want."""
  joint = fam.joint
  for i, (p, b) in enumerate(zip(fam.policies, bkey, strict=True)):
    if (joint is None or i not in joint.idx) and not p.is_bucket(b):
      return False
  return joint is None or joint.is_bucket(joint.sub(bkey))


_SWITCH = {"active": 0, "saved": None}
_SWITCH_LOCK = threading.Lock()
_QUICK_SWITCH_S = 5e-4


@contextlib.contextmanager
def _quick_switches():
  """While any background lowering runs: the interpreter's GIL switch interval at most
  0.5 ms (restored when the last one ends).  Process-wide, as ``sys.setswitchinterval``."""
  with _SWITCH_LOCK:
    if _SWITCH["active"] == 0:
      _SWITCH["saved"] = sys.getswitchinterval()
      sys.setswitchinterval(min(_SWITCH["saved"], _QUICK_SWITCH_S))
    _SWITCH["active"] += 1
  try:
    yield
  finally:
    with _SWITCH_LOCK:
      _SWITCH["active"] -= 1
      if _SWITCH["active"] == 0 and _SWITCH["saved"] is not None:
        sys.setswitchinterval(_SWITCH["saved"])
        _SWITCH["saved"] = None


def _lowering(fam, bkey):
  """A lowering-lane job: ``fam.lower_bucket(bkey)`` with quick GIL switches."""
  with _quick_switches():
    return fam.lower_bucket(bkey)


def _plan_buckets(fam, bkey, limit: int) -> list[tuple]:
  """Up to ``limit`` bucket tuples the policies plan now, for calls like one of bucket
  ``bkey`` (dims without a declared max keep ``bkey``'s size), largest first."""
  if fam.joint is not None:
    return []
  axes = []
  for p, b in zip(fam.policies, bkey, strict=True):
    try:
      sizes = (b,) if p.max is None else tuple(p.sizes())
    except Exception:  # noqa: BLE001 - a policy that cannot list its sizes yet
      sizes = (b,)
    axes.append(sorted(sizes, reverse=True))
  out = []
  for combo in itertools.product(*axes):
    out.append(tuple(combo))
    if len(out) >= limit:
      break
  return out


def _top_bucket(fam, bkey) -> tuple:
  """The bucket that covers every size of the declared ranges, for a call of bucket ``bkey``:
  the largest bucket of each dim with a declared max, ``bkey``'s own size along a dim without
  one (an undeclared batch dim ``b`` must not leave the sequence dim ``t`` uncovered: a server
  whose first request is short would otherwise wait again for the first long one)."""
  return tuple(b if p.max is None else max(b, p.sizes()[-1])
               for p, b in zip(fam.policies, bkey, strict=True))


def _on_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def _default_workers() -> int:
  n = os.cpu_count() or 2
  return 1 if n <= 4 else min(4, n // 4)


def _check_compiler_options(options) -> tuple:
  if options is None:
    return ()
  if not isinstance(options, Mapping):
    raise SpecError(f"compiler_options must be a dict of XLA option name -> value, got "
                    f"{type(options).__name__}")
  bad = [k for k, v in options.items()
         if not isinstance(k, str) or not isinstance(v, bool | int | float | str)]
  if bad:
    raise SpecError(f"compiler_options: {bad} are not name -> bool/int/float/str pairs")
  return tuple(sorted(options.items()))


@functools.cache
def _dynjax_source_hash() -> str:
  """A hash of dynjax's own source: executables built by other dynjax code are not reused."""
  import hashlib

  root = os.path.dirname(os.path.abspath(__file__))
  h = hashlib.sha256()
  for dirpath, dirnames, files in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "bench"))
    for f in sorted(files):
      if f.endswith(".py"):
        with open(os.path.join(dirpath, f), "rb") as fh:
          h.update(f.encode())
          h.update(fh.read())
  return h.hexdigest()[:16]


def _progress(label: str, done: int, total: int, seconds: float) -> None:
  width = 30
  filled = int(width * done / max(total, 1))
  sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                   f"{seconds:.1f}s")
  sys.stderr.flush()

