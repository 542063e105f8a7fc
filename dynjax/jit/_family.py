"""A *family*: everything of one static signature of a ``dynjax.jit`` function.

A family is keyed by the static argument values, the pytree structure and each leaf's dtype
and rank.  It holds the symbolic signature (one ``jax.export.SymbolicScope`` for every
argument), the symbolic jaxpr traced ONCE, the output shape functions, its mode, the bucket
plan (which bucket a tuple of true sizes runs on), and its bucket entries.  It lowers and
compiles one bucket on request (:meth:`Family.lower_bucket`, :meth:`Family.compile_bucket`);
*when* buckets compile is the compiler's business (``jit/_serving.py``).  Modes: ``trust``
(jit at the bucket shape), ``auto`` (jit of the padding pass's ``(sizes, *padded)`` function),
``exact`` (one AOT compile per exact shape: ``padding="exact"``, nothing dynamic, or a
fallback), ``program`` (``dynjax.while_loop``/``cond``/``recursive`` inside: the VM's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import warnings
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynjax import _jax_private, _symbolic
from dynjax._errors import (
  OutOfBucketsError,
  PaddingFallbackError,
  PaddingUnsupportedError,
  format_list,
  needs_program,
  user_stacklevel,
)
from dynjax.bucketing import _auto, _conv_vjp, _jnp, _rebind, _scan, _scan_length, _search  # noqa: F401
from dynjax.bucketing._joint import JointPlan
from dynjax.bucketing._padding import empty_dims, pad_jaxpr
from dynjax.bucketing._policies import BucketPolicy
from dynjax.jit import _args, _casts, _forward, _placement, _rewrites, _sharding
from dynjax.jit._guards import (
  MAX_GUARDS,
  add_constant_dims,
  add_guard,
  broken_declared,
  capped_bucket,
  declared_checks,
  equality_guards,
  held_bucket,
  outside_guards,
  trace_failure_hint,
  trust_bucket_holds,
)
from dynjax.jit._store import ExecutableStore, family_store

logger = logging.getLogger("dynjax")
PADDED_MODES = ("trust", "auto")


@dataclasses.dataclass
class BucketEntry:
  """One compiled bucket of a family: what an executor needs to run it."""

  exe: Any  # jax Compiled
  in_shapes: tuple[tuple[int, ...], ...]  # padded shape per leaf
  padded_elems: int
  rewrites: tuple[str, ...] = ()
  tier: int = 0  # 0: quick compile options (serving on GPU) or the only tier; 1: full options
  source: str = "compiled"  # or "stored": loaded from the executable store
  casts: tuple = ()  # ((leaf index, dtype), ...) the executable takes cast (jit/_casts.py)
  host_out: bool = False  # its outputs are in pinned host memory (jit/_placement.py)


class Family:
  """One static signature of a wrapped function: signature, jaxpr, bucket plan, entries.

  ``ctx`` is the function's dispatcher (``jit/_dispatch.py``): the family reads its options,
  binder, policies and cache, and reports fallbacks to it.
  """

  def __init__(self, ctx, flat_fun, leaf_paths, leaf_specs, avals, treedef, key, fid: int,
               first_leaves=None):
    self.ctx = ctx
    opts = ctx.opts
    self.name = ctx.name
    self.flat_fun = flat_fun
    self.treedef = treedef
    self.key = key
    self.leaf_paths = list(leaf_paths)
    self.avals = avals  # concrete ShapeDtypeStructs of the first call (dtypes, static shapes)
    self.avals_shapes = tuple(tuple(a.shape) for a in avals)
    self.fid = fid
    self.fallback: str | None = None
    self.gen = 0  # bumped whenever an executable of this family is added, replaced or dropped
    self.jaxpr = None
    self.out_tree = None
    self.out_avals = None
    self.out_shape_fns: tuple = ()
    self.out_dynamic: tuple = ()
    self.rewrites: tuple[str, ...] = ()
    self.probe_plan = None  # (bucket, plan) of the padding pass's probe: its bucket reuses it
    self.attention_notes: tuple[str, ...] = ()  # attention=: sites rewritten or left, why
    self.attention_impl = None  # attention= of trust/exact executables (rewritten per shape)
    self.ragged_notes: tuple[str, ...] = ()  # ragged_dot=: sites rewritten or left, why
    self.ragged_per_shape = False  # ragged_dot= of trust/exact executables (per shape)
    self.program = None  # control.ProgramRunner of a "program" family
    self.converted: set = set()  # (leaf path, host dtype, traced dtype) canonicalised inputs
    self.mode = opts.padding
    self.sig = _symbolic.build_signature(
        [(path, text, len(a.shape)) for path, text, a in
         zip(leaf_paths, leaf_specs, avals, strict=True)], self._constraints(leaf_specs))
    self.in_shape_fns = tuple(
        None if s is None else _symbolic.compile_shape(s.dims, self.sig.var_order)
        for s in self.sig.leaves)
    self.declared = declared_checks(opts.constraints, self.sig)  # checked per new size tuple
    self.spec_idx = tuple(i for i, spec in enumerate(self.sig.leaves) if spec is not None)
    # Leaves that decide numpy vs device outputs: those with dims (all leaves when none has).
    self.dyn_leaves = self.spec_idx or tuple(range(len(self.sig.leaves)))
    auto = opts.dims == "auto"
    # With dims="auto" every leaf is checked (its static axes may need promoting); otherwise
    # only leaves with dims are (the executable checks the rest).
    self.checks = tuple(
        (i, _args.leaf_key_of_aval(avals[i]),
         tuple((ax, int(d)) for ax, d in enumerate(spec.dims if spec is not None
                                                   else avals[i].shape)
               if not _symbolic.is_symbolic(d)) if auto else ())
        for i, spec in enumerate(self.sig.leaves) if spec is not None or auto)
    if not self.sig.var_order:
      self.mode = "exact"  # nothing dynamic: a plain jit, one compile per shape
    self._trace()
    self.shard = _sharding.resolve(opts.sharding, self, self.name, ctx.binder.dyn_names, auto)
    pols = ctx.policies
    multiples = {} if self.shard is None else self.shard.multiples
    self.policies = tuple(pols.aligned(v, multiples.get(v, 1)) for v in self.sig.var_order)
    self.observers = tuple((i, p) for i, p in enumerate(self.policies)
                           if type(p).observe is not BucketPolicy.observe)
    # Two or more auto-planned variables: plan bucket tuples jointly (not their product).
    auto_idx = [i for i, p in enumerate(self.policies) if isinstance(p, _auto.Auto)]
    self.joint = None
    if len(auto_idx) >= 2:
      self.joint = JointPlan(self.policies, auto_idx,
                             min(self.policies[i].max_compiles for i in auto_idx))
      self.observers = tuple((i, p) for i, p in self.observers if i not in auto_idx)
    self.dynamic_plan = bool(self.observers) or self.joint is not None
    # Executors are kept by sizes where the plan is fixed, or where each learning policy says
    # when its table moves (``Auto.watch`` -> ``plan_changed``); their calls show it their
    # sizes (``Executor.watch``).  An executor a call cost an auto function 0.47 ms a request
    # on the H200 (BERT-base, probe_cost_curve.py: 3.50 -> 3.03 ms).
    plans = [p for _, p in self.observers] + ([self.joint] if self.joint is not None else [])
    self.watched_plan = bool(plans) and all(hasattr(p, "watch") for p in plans)
    self.keeps_executors = not self.dynamic_plan or self.watched_plan
    for p in plans if self.watched_plan else ():
      p.watch(self)
    # One device: executables take the arguments' own pytrees (jax flattens them in C++), so
    # the hot path never flattens model parameters in Python.  Sharded: flat leaves.
    self.structured = self.shard is None
    # Outputs that are inputs (not computed); leaves only cast narrower: cast once per array.
    padded = self.structured and self.mode in PADDED_MODES and self.jaxpr is not None
    self.forward = _forward.find(self) if padded else {}
    self.casts = _casts.plan(self) if padded else {}  # (reads self.forward)
    self.cast_memo = _casts.Memo()
    self.host_out, self.host_out_reason, self.reads_out = (
        _placement.plan(self, first_leaves) if padded else (False, None, False))
    self._store, self._store_ready = None, False
    self.store()  # now: it may take the output placement its cache_dir holds (_store)
    self.buckets: dict[tuple, BucketEntry] = {}
    self.host_buffers = _placement.HostBuffers()  # padded numpy inputs, reused
    self.executors: dict[tuple, Any] = {}  # hot-path key -> dispatch.Executor
    self.swept = 0  # the gen whose replaced executors Dispatcher.resolve let go
    self.tuple_hist: Counter = Counter()  # true size tuples seen (explain, compile values)
    self.per_sizes: dict[tuple, tuple] = {}  # sizes -> (bucket, output shapes, true elems)
    self.bucket_time: dict[tuple, float] = {}  # measured seconds per call, per bucket
    self.tiered: set = set()  # buckets whose tier-1 recompile was queued
    self.preloaded = False  # stored executables queued for loading (serving)
    self.prelowering = False  # the plan's buckets were handed to the lowering lane
    self.prelowered: dict = {}  # bucket -> Future of (Lowered, rewrites)
    self.kept_lowered: dict = {}  # bucket -> (Lowered, rewrites) its tier-1 recompile takes
    # The top-level hot path: every leaf with dims is a whole argument (``f(params, tokens,
    # lengths)``), so a call needs no Python pytree work at all.
    self.top = None  # ((argument position, leaf index, leaf key), ...)
    names = ctx.binder.dyn_names
    if self.structured and not auto and self.mode in PADDED_MODES:
      top = []
      for li in self.spec_idx:
        path = self.leaf_paths[li]
        if path not in names:  # a leaf inside a pytree argument: the general path
          top = None
          break
        top.append((names.index(path), li, _args.leaf_key_of_aval(avals[li])))
      self.top = None if top is None else tuple(top)
    self.top_pos = () if self.top is None else tuple(p for p, _, _ in self.top)

  def _constraints(self, leaf_specs) -> tuple[str, ...]:
    opts = self.ctx.opts
    out = list(opts.constraints)
    if opts.overflow != "grow":
      for v in _symbolic.spec_variables([t for t in leaf_specs if t is not None]):
        p = self.ctx.policies.for_var(v)
        if p.max is not None:
          out.append(f"{v} <= {p.max}")
    return tuple(out)

  def note_converted(self, i: int, host, traced) -> None:
    """A host input of a 64-bit dtype ran as its canonical dtype (x64 off, as jax.jit)."""
    self.converted.add((self.leaf_paths[i], str(host), str(traced)))

  def accepts(self, leaves) -> bool:
    """Hot-path check of the leaves with dims: dtype and rank (and, with dims="auto", the axes
    still static). ~0.3 us a leaf; the other leaves are checked by the executable itself."""
    for i, key, static_axes in self.checks:
      x = leaves[i]
      if _args.leaf_key(x) != key:
        return False
      if static_axes:
        shape = x.shape
        for ax, n in static_axes:
          if shape[ax] != n:
            return False
    return True

  # -- tracing -----------------------------------------------------------------------------
  def _trace(self) -> None:
    self.guards: tuple[str, ...] = ()
    self._guard_bounds: tuple[tuple[int, int, float], ...] = ()  # (var index, lo, hi)
    self._size_caps: tuple[tuple[int, int], ...] = ()  # (var index, c): _guards.capped_bucket
    self._warned_guards = self._warned_trust_bucket = False  # (_guards.trust_bucket_holds)
    self._unequal: tuple = ()  # guards ``lhs != rhs``: (text, fn(sizes) -> lhs - rhs, where)
    self._identities: tuple[str, ...] = ()  # equality rules of _guards.unify_shapes
    self._moduli: tuple[tuple[int, int], ...] = ()  # (var index, m): buckets at multiples
    for attempt in range(MAX_GUARDS + 1):
      sym = _symbolic.symbolic_avals(self.sig, self.avals)
      try:
        with _jax_private.undecided_equalities() as equalities, _rebind.family_tracing():
          closed, out_shape = jax.make_jaxpr(self.flat_fun, return_shape=True)(*sym)
        if attempt >= MAX_GUARDS or not add_constant_dims(self, closed):
          break  # (else: re-trace under rules that name dims constant at every size checked)
      except Exception as e:  # noqa: BLE001 - any trace failure means: run exact
        if needs_program(e):
          self.mode = "program"  # dynjax.while_loop/cond/recursive inside: run on the VM
          return
        if self.mode == "exact":
          return
        if _rebind.after_refusal(e):
          continue  # associative_scan, searchsorted, interp, convolve: now dynjax's (_rebind)
        if attempt < MAX_GUARDS and add_guard(self, e):
          continue  # re-trace under one more inferred guard
        # A function that fails at the call's own shapes too has a bug of its own (a bad
        # matmul, a missing rng): its error, as jax.jit raises it, not a fallback warning.
        jax.make_jaxpr(self.flat_fun)(*(jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                             weak_type=a.weak_type)
                                        for a in self.avals))
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self.fall_back(self._under_guards(
            f"symbolic tracing failed ({type(e).__name__}: {first}){trace_failure_hint(e)}"))
        return
    if equalities:  # ``if x.shape[1] == 5:`` traced as unequal: checked on every call
      reason = equality_guards(self, equalities)
      if reason is not None:
        self.fall_back(reason)
        return
    closed = _rewrites.for_family(self, closed)  # attention=, ragged_dot= (auto: the jaxpr)
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
        self.fall_back(
            f"output {i} has shape ({', '.join(map(str, shape))}): with padding='trust' only "
            "outputs whose dims are plain variables can be unpadded by slicing; use "
            "padding='auto'")
    elif self.mode == "auto":
      probe = self._guarded_probe_bucket()
      try:
        plan = pad_jaxpr(closed, self.sig.var_order, self.bucket_env(probe))
      except PaddingUnsupportedError as e:
        self.fall_back(self._under_guards(str(e)))  # names every equation it cannot pad
      except Exception as e:  # noqa: BLE001 - a pass bug must never give a wrong result
        self.fall_back(self._under_guards(
            f"the padding pass failed ({type(e).__name__}: {e}); please report it"))
      else:
        self.rewrites = tuple(plan.rewrites)
        self.probe_plan = (probe, plan)

  # -- guards: size conditions inferred while tracing (jit/_guards.py, jit/_facts.py) -------
  # As torch.compile's guards: re-traced under them, checked per call (``guard_ok``); sizes
  # outside them run exact.

  def _under_guards(self, reason: str) -> str:
    if not self.guards:
      return reason
    return f"{reason} (traced under the inferred guards {', '.join(self.guards)})"

  def guard_ok(self, sizes) -> bool:
    """Whether true ``sizes`` (ints in ``sig.var_order`` order) satisfy every inferred guard.

    The padded executables were traced under ``self.guards``: sizes outside them must run
    exact (``outside_guards`` first).  True when the family has no guards.
    """
    for i, lo, hi in self._guard_bounds:
      n = sizes[i]
      if n < lo or n > hi:
        return False
    for _, diff, _ in self._unequal:
      if diff(sizes) == 0:
        return False
    return not (self.declared and broken_declared(self, sizes))

  def outside_guards(self, sizes) -> None:
    """Before running ``sizes`` exact (``guard_ok`` False): see :func:`_guards.outside_guards`."""
    outside_guards(self, sizes)

  def _guarded_probe_bucket(self) -> tuple[int, ...]:
    """The probe bucket: each policy's smallest, each variable's at least its guards' lower
    bound (a smaller bucket only holds sizes that run exact), and larger while an axis the
    function builds is empty there (``_padding.empty_dims``: no real call runs there)."""
    pols = [self.ctx.policies.for_var(v) for v in self.sig.var_order]
    lows = {i: lo for i, lo, _ in self._guard_bounds}
    probe = [max(p.sizes()[0] if p.max is not None else p.grow(max(p.min, 2)),
                 p.bucket(lows.get(i, 1)) or p.grow(lows.get(i, 1)))
             for i, p in enumerate(pols)]
    for _ in range(8):
      low = empty_dims(self.jaxpr, self.bucket_env(probe))
      if not low:
        break
      probe = [p.bucket(b + 1) or p.grow(b + 1) if v in low else b
               for v, b, p in zip(self.sig.var_order, probe, pols, strict=True)]
    return capped_bucket(self, tuple(probe))  # (and at multiples of an identity's m)

  def fall_back(self, reason: str) -> None:
    """The family runs exact from now on (one compile per shape), with one warning; or
    ``PaddingFallbackError`` under ``on_fallback="error"``."""
    opts = self.ctx.opts
    if opts.on_fallback == "error":
      reason = reason.rstrip(".")
      sep = "\n" if "\n" in reason else ". "  # after a list of equations: a line of its own
      raise PaddingFallbackError(
          f"dynjax.jit({self.name}): padding={opts.padding!r} cannot pad this function and "
          f"on_fallback='error' refuses to run it unpadded (one compile per shape): "
          f"{reason}{sep}"
          "Fix: rewrite the named lines with primitives the pass supports "
          "(dynjax.bucketing.rule_coverage() lists them), use padding='trust' if the function "
          "is pad-safe, or on_fallback='warn' to accept one compile per shape") from None
    self.fallback = reason
    self.mode = "exact"
    self.gen += 1
    self.ctx.note_fallback(reason)
    warnings.warn(f"dynjax.jit({self.name}): running unpadded, one compile per shape: "
                  f"{reason}", stacklevel=user_stacklevel())

  def plan_changed(self) -> None:  # a policy's table moved (Auto.watch): executors are stale
    self.gen += 1

  def watch_items(self, sizes) -> tuple:
    """(plan, what it observes) for each plan that learns from the sizes (Executor.watch)."""
    joint = () if self.joint is None else ((self.joint, self.joint.sub(sizes)),)
    return tuple((p, sizes[i]) for i, p in self.observers) + joint

  def bucket_env(self, bkey) -> dict[str, int]:
    return dict(zip(self.sig.var_order, bkey, strict=True))

  # -- the bucket plan ---------------------------------------------------------------------
  def size_info(self, sizes, observe: bool = True) -> tuple:
    """(bucket or None: run exact, output shapes, true elements of the leaves with dims) of
    one tuple of true sizes; memoised unless the plan changes with traffic."""
    known = None if self.dynamic_plan else self.per_sizes.get(sizes)
    if known is not None:
      return known
    bkey = self.bucket_of(sizes, observe)
    info = (bkey, tuple(fn(sizes) for fn in self.out_shape_fns),
            sum(math.prod(fn(sizes)) for fn in self.in_shape_fns if fn is not None))
    if bkey is not None and not self.dynamic_plan:
      if len(self.per_sizes) > 4096:
        self.per_sizes.clear()
      self.per_sizes[sizes] = info
    return info

  def bucket_of(self, sizes, observe: bool = True) -> tuple | None:
    """The bucket of ``sizes`` under the policies (and the joint plan), or None: run exact
    (``overflow="exact"``, a size of 0, or sizes outside the inferred guards).  ``observe``:
    the policies see the sizes."""
    overflow = self.ctx.opts.overflow
    if (self._guard_bounds or self._unequal or self.declared) and not self.guard_ok(sizes):
      return None  # outside a guard inferred while tracing: the padded executables don't hold
    if observe:
      for i, p in self.observers:
        p.observe(sizes[i])
    joint = self.joint
    jmap = {}
    if joint is not None:
      sub = joint.sub(sizes)
      if observe:
        joint.observe(sub)
      jb = joint.bucket(sub)
      if jb is None:
        if overflow == "error":
          self.raise_overflow(sizes)
        elif overflow == "exact":
          return None
        jb = tuple(self.policies[i].grow(sizes[i]) for i in joint.idx)
      jmap = dict(zip(joint.idx, jb, strict=True))
    bkey = []
    for i, (n, p) in enumerate(zip(sizes, self.policies, strict=True)):
      b = jmap[i] if i in jmap else p.bucket(n)
      if b is None:
        if overflow == "error":
          self.raise_overflow(sizes)
        elif overflow == "exact":
          return None
        b = p.grow(n)
      bkey.append(b)
    if 0 in sizes:
      return None
    if self._unequal and self.mode == "trust" and not trust_bucket_holds(self, bkey):
      return None  # re-traced at the bucket's sizes, the Python would take the other side
    return held_bucket(self, tuple(bkey))  # at most a guard's upper bound (t <= c), facts

  def raise_overflow(self, sizes) -> None:
    lines = []
    for v, n, p in zip(self.sig.var_order, sizes, self.policies, strict=True):
      if p.bucket(n) is None:
        uses = [f"{self.sig.leaves[li].path}.shape[{ax}]" for li, ax, vi in self.sig.solve_plan
                if self.sig.var_order[vi] == v]
        lines.append(f"{v} = {n} ({', '.join(uses)}) is above the largest bucket {p.max} of "
                     f"{p!r}")
    raise OutOfBucketsError(
        f"{self.name}: dimension over the largest bucket:\n" + format_list(lines)
        + "\nRaise the policy's max, or pass overflow=\"grow\" (compile a larger bucket) or "
        "overflow=\"exact\" (run unpadded).")

  def planned(self, bkey) -> bool:
    """Whether ``bkey`` is still one of the buckets the policies want."""
    joint = self.joint
    for i, (p, b) in enumerate(zip(self.policies, bkey, strict=True)):
      if (joint is None or i not in joint.idx) and not p.is_bucket(b):
        return False
    return joint is None or joint.is_bucket(joint.sub(bkey))

  def record_time(self, bkey, seconds: float) -> None:
    """One served call's seconds on bucket ``bkey``: the policies' and the compiler's cost
    model (an exponential average per bucket); a bucket's first time also gives the policies
    its compile seconds (value-decided ``auto`` weighs new buckets by them)."""
    old = self.bucket_time.get(bkey)
    built = None if old is not None else self.ctx.cache.built_seconds((self.fid, bkey))
    for p, b in zip(self.policies, bkey, strict=True):
      if built is not None:
        p.record_compile(b, built, self.ctx.opts.max_executables)
      p.record_time(b, seconds)
    self.bucket_time[bkey] = seconds if old is None else 0.8 * old + 0.2 * seconds

  # -- lowering and compiling --------------------------------------------------------------
  def padded_avals(self, bkey, casts: dict | None = None) -> list[jax.ShapeDtypeStruct]:
    """The bucket's inputs; ``casts`` (default: the family's) leaves in their cast dtype."""
    casts = self.casts if casts is None else casts
    out = []
    for i, (fn, aval) in enumerate(zip(self.in_shape_fns, self.avals, strict=True)):
      shape = aval.shape if fn is None else fn(bkey)
      out.append(jax.ShapeDtypeStruct(shape, casts.get(i, aval.dtype), weak_type=aval.weak_type))
    return out

  def donate_leaves(self) -> tuple[int, ...]:
    donate = self.ctx.opts.donate_argnames
    return () if not donate else tuple(i for i, path in enumerate(self.leaf_paths)
                                       if path.split("[", 1)[0].split(".", 1)[0] in donate)

  def lower_bucket(self, bkey):
    """Lowers the executable of one bucket: (Lowered, rewrites).  Unsharded executables take
    the dynamic arguments as pytrees (``structured``); sharded ones flat leaves."""
    t0 = time.perf_counter()
    try:
      return self._lower_bucket(bkey)
    finally:
      self.ctx.counters.lowered(time.perf_counter() - t0)

  def _lower_bucket(self, bkey):
    if self.casts:  # verified on the jaxpr this bucket really lowers (trust re-traces per shape)
      traced, rewrites = self._trace_bucket(bkey, self.casts)
      if _casts.holds(traced.jaxpr.jaxpr, self.casts, 1 if self.mode == "auto" else 0):
        return traced.lower(), rewrites
    traced, rewrites = self._trace_bucket(bkey, {})  # a parameter used uncast here
    return traced.lower(), rewrites

  def _trace_bucket(self, bkey, casts: dict):
    avals = self.padded_avals(bkey, casts)
    flat_fun, dtypes, fwd = self.flat_fun, [a.dtype for a in self.avals], self.forward
    if self.structured:
      args = _args.tree_unflatten(self.treedef, avals)
      donate = self.ctx.binder.donate_positions(self.ctx.opts.donate_argnames)
      as_leaves = jax.tree_util.tree_leaves
    else:
      args = avals
      donate = self.donate_leaves()
      as_leaves = list
    shard = (_placement.jit_kwargs(self, bkey) if self.shard is None
             else self.shard.jit_kwargs(self, bkey, self.mode == "auto"))
    if self.mode == "trust":  # (rewritten as the function sees its leaves: upcast ones too)
      flat_fun = _rewrites.fun_at(self, flat_fun, self.padded_avals(bkey, {}) if casts else avals)
      def bucket_fun(*xs):
        leaves = _casts.upcast(as_leaves(xs), casts, dtypes)
        return _forward.drop(flat_fun(*leaves), fwd, leaves)

      bucket_fun.__name__ = flat_fun.__name__
      return jax.jit(bucket_fun, donate_argnums=donate, **shard).trace(*args), ()
    assert self.mode == "auto", self.mode
    # The probe's bucket reuses its plan (the pass holds the GIL: BERT-base ~0.27 s, CPU box).
    # Other buckets' plans are checked in the one trace that lowers them (validate=False).
    probe = self.probe_plan
    plan = (probe[1] if probe is not None and probe[0] == tuple(bkey)
            else pad_jaxpr(self.jaxpr, self.sig.var_order, self.bucket_env(bkey), validate=False))
    nv = len(self.sig.var_order)

    def padded_fun(sizes, *xs):
      leaves = _casts.upcast(as_leaves(xs), casts, dtypes)
      return _forward.drop(plan.fun(tuple(sizes[i] for i in range(nv)), *leaves), fwd, leaves)

    padded_fun.__name__ = flat_fun.__name__
    sizes_aval = jax.ShapeDtypeStruct((nv,), jnp.int32)
    with plan.tracing() if plan.tracing is not None else contextlib.nullcontext():
      traced = jax.jit(padded_fun, donate_argnums=tuple(d + 1 for d in donate),
                       **shard).trace(sizes_aval, *args)
    plan.check_outputs((o.shape for o in jax.tree.leaves(traced.out_info)), skip=fwd)
    return traced, tuple(plan.rewrites)

  def entry_of(self, exe, bkey, rewrites, tier: int = 0, source: str = "compiled"):
    in_shapes = tuple(a.shape for a in self.padded_avals(bkey))
    padded = sum(math.prod(s) for s, spec in zip(in_shapes, self.sig.leaves, strict=True)
                 if spec is not None)
    casts = _casts.of_executable(self, exe, 1 if self.mode == "auto" else 0)
    return BucketEntry(exe, in_shapes, padded, tuple(rewrites), tier, source, casts,
                       _placement.of_executable(exe))

  def load_stored(self, bkey, stored_min: int = 0) -> BucketEntry | None:
    """The bucket's best stored executable of tier >= ``stored_min`` (``cache_dir``), or None."""
    store = self.store()
    if store is None:
      return None
    for t in sorted({t for b, t in store.stored() if b == bkey and t >= stored_min},
                    reverse=True):
      exe = store.load(bkey, t, self.exe_avals(bkey), self.exe_avals(bkey, {}))
      if exe is not None:
        return self.entry_of(exe, bkey, self.rewrites, t, "stored")
    return None

  def compile_bucket(self, lowered, rewrites, bkey, tier: int, options: dict) -> BucketEntry:
    """Compiles a lowered bucket with ``options`` (and stores it under ``cache_dir``)."""
    store = self.store()
    # A bucket that goes to the executable store skips JAX's persistent cache write: the
    # store alone serves a restart, and each write serializes the executable holding the GIL
    # (H100, BERT-base: 10-90 ms of stalled serving per compile, seen by a GIL probe).
    with (_jax_private.no_persistent_cache_write() if store is not None
          else contextlib.nullcontext()):
      exe = lowered.compile(compiler_options=options) if options else lowered.compile()
    entry = self.entry_of(exe, bkey, rewrites, tier, "compiled")
    if store is not None and store.save(bkey, tier, exe, self.exe_avals(bkey, dict(entry.casts))):
      store.drop_below(bkey, tier)  # a restart loads the best tier (tier 0: drops nothing)
    return entry

  def exe_avals(self, bkey, casts: dict | None = None) -> list[tuple]:
    """(shape, dtype name) of every input of the bucket's executable (a stored one must
    match them to be used); ``casts`` as in :meth:`padded_avals`."""
    avals = [(tuple(a.shape), str(a.dtype)) for a in self.padded_avals(bkey, casts)]
    if self.mode == "auto":
      avals.insert(0, ((len(self.sig.var_order),), "int32"))  # the true-sizes vector
    return avals

  def exact_executable(self, leaves):
    """jax.jit at the exact shape (fallback / exact mode), cached in the shared LRU."""
    key = (self.fid, "exact", tuple(np.shape(x) for x in leaves))
    cache = self.ctx.cache

    def build():
      avals = [jax.ShapeDtypeStruct(np.shape(x), a.dtype, weak_type=a.weak_type)
               for x, a in zip(leaves, self.avals, strict=True)]
      kw = {} if self.shard is None else self.shard.exact_kwargs(self, avals)
      fun = _rewrites.fun_at(self, self.flat_fun, avals)
      exe = jax.jit(fun, donate_argnums=self.donate_leaves(),
                    **kw).lower(*avals).compile()
      return exe if self.shard is None else _sharding.exact_call(exe, self, avals, self.shard)

    exe = cache.get(key)
    if exe is None:
      exe = cache.get_or_build(key, build)
    return exe

  # -- the executable store (cache_dir) ----------------------------------------------------
  def store(self) -> ExecutableStore | None:
    """The family's executable store, or None (see ``_store.family_store``)."""
    if not self._store_ready:
      self._store_ready = True
      self._store = family_store(self, self.mode in PADDED_MODES)
    return self._store
