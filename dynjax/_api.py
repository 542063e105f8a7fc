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
import dataclasses
import functools
import inspect
import itertools
import math
import os
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
from dynjax.bucketing._padding import pad_jaxpr
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.runtime._cache import ExecutableCache, enable_compile_log

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
                out_shardings=out_shardings, on_fallback=on_fallback)
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


class _Family:
  """One static signature of a Wrapped function: signature, jaxpr, executables."""

  def __init__(self, wrapped: Wrapped, flat_fun, leaf_specs, avals, treedef, fid: int):
    self.wrapped = wrapped
    self.flat_fun = flat_fun
    self.treedef = treedef
    self.avals = avals  # concrete ShapeDtypeStructs of the first call (dtypes, static shapes)
    self.fid = fid
    self.fallback: str | None = None
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
    self.size_hist = tuple(Counter() for _ in self.sig.var_order)  # for explain()
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
    """Lowers the executable of one bucket: (Lowered, rewrites)."""
    avals = self.padded_avals(bkey)
    donate = self.wrapped._donate_leaves(self)
    if self.mode == "trust":
      return jax.jit(self.flat_fun, donate_argnums=donate,
                     **_sharding.jit_kwargs(self, bkey, False)).lower(*avals), ()
    assert self.mode == "auto", self.mode
    plan = pad_jaxpr(self.jaxpr, self.sig.var_order, self._bucket_env(bkey))
    nv = len(self.sig.var_order)

    def padded_fun(sizes, *xs):
      return plan.fun(tuple(sizes[i] for i in range(nv)), *xs)

    sizes_aval = jax.ShapeDtypeStruct((nv,), jnp.int32)
    lowered = jax.jit(padded_fun, donate_argnums=tuple(d + 1 for d in donate),
                      **_sharding.jit_kwargs(self, bkey, True)).lower(
        sizes_aval, *avals)
    return lowered, tuple(plan.rewrites)

  def build_bucket(self, bkey) -> _BucketEntry:
    lowered, rewrites = self.lower_bucket(bkey)
    exe = lowered.compile()
    in_shapes = tuple(a.shape for a in self.padded_avals(bkey))
    padded = sum(math.prod(s) for s, spec in zip(in_shapes, self.sig.leaves, strict=True)
                 if spec is not None)
    return _BucketEntry(exe, in_shapes, padded, rewrites)

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
               in_shardings=None, out_shardings=None, on_fallback="warn"):
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
    self._opts = _Options(
        dims=self._check_dims(dims, names, static),
        buckets=self._check_buckets(buckets),
        padding=_choice(padding, _PADDING_MODES, "padding"),
        overflow=_choice(overflow, _OVERFLOW_MODES, "overflow"),
        static_argnames=static, donate_argnames=donate, return_padded=bool(return_padded),
        constraints=tuple(constraints), max_executables=max_executables,
        check=config.check if check is None else bool(check),
        async_compile=bool(async_compile),
        on_fallback=_choice(on_fallback, _ON_FALLBACK, "on_fallback"))
    self._static_pos = tuple(i for i, p in enumerate(self._params) if p.name in static)
    self._dyn_names = tuple(p.name for p in self._params if p.name not in static)
    self._opts.sharding = _sharding.check_options(in_shardings, out_shardings, self._dyn_names,
                                                  static, self.__name__)
    cache_dir = cache_dir or config.cache_dir
    if cache_dir:
      _jax_private.enable_persistent_cache(os.fspath(cache_dir))
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
    self._background: set = set()
    self._pending: list[concurrent.futures.Future] = []
    self._sizes_on_device: dict[tuple, jax.Array] = {}
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
    """(static key, dynamic values in parameter order). ~1 us with positional args only."""
    params = self._params
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
    # Hot path on a cache hit, measured on the 2-core CPU box (jax 0.10.2): one (8, t) float32
    # argument, ~13 us on top of the executable call (split + flatten ~2, family check ~1,
    # solve + bucket ~1.5, host pad ~1.5, unpad ~2, stats ~1); with a 200-leaf parameter
    # pytree, +27 us over jax.jit (97 vs 70 us): only the leaves with dims are touched in
    # Python, the executable checks the others.
    static, dyn = self._split(args, kwargs)
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
        if not str(e).startswith("Argument types differ"):
          raise
    return self._call_slow(static, dyn, leaves, treedef)

  def _call_slow(self, static, dyn, leaves, treedef):
    if any(map(_is_padded, jax.tree_util.tree_leaves(dyn, is_leaf=_is_padded))):
      self._padded_trees.add(_tree_flatten(dyn)[1])
      leaves, treedef = _tree_flatten(dyn, is_leaf=_is_padded)
    fam = self._family(static, dyn, leaves, treedef)
    self._fast[(static, treedef)] = fam
    return self._dispatch(fam, leaves)

  def _dispatch(self, fam: _Family, leaves):
    opts = self._opts
    # Shapes of the leaves with dims only; the others keep the family's (static) shapes.
    shapes = list(fam.avals_shapes)
    for i in fam.spec_idx:
      shapes[i] = getattr(leaves[i], "shape", ())
    # Outputs follow the data: device outputs when a leaf with dims is a device array (model
    # parameters on the device do not make a numpy request return device arrays).
    device = any(_on_device(leaves[i]) for i in fam.dyn_leaves)
    if fam.mode == "exact":
      return self._run_exact(fam, leaves, shapes, device)
    if fam.mode == "program":
      return self._run_program(fam, leaves, device)
    sizes = _symbolic.solve_sizes(fam.sig, shapes)
    for i, p in fam.observers:
      p.observe(sizes[i])
    for h, n in zip(fam.size_hist, sizes, strict=True):
      h[n] += 1
    bkey = []
    exact = False
    for n, p in zip(sizes, fam.policies, strict=True):
      b = p.bucket(n)
      if b is None:
        if opts.overflow == "error":
          self._raise_overflow(fam, sizes)
        elif opts.overflow == "exact":
          exact = True
          break
        b = p.grow(n)
      bkey.append(b)
    if exact or 0 in sizes:
      return self._run_exact(fam, leaves, shapes, device)
    bkey = tuple(bkey)
    entry = fam.buckets.get(bkey)
    hit = entry is not None
    if entry is None:
      entry = self._entry(fam, bkey)
      if entry is None:  # async_compile served the call on a larger bucket
        bkey, entry = self._larger_bucket(fam, bkey)
    elif self._cache.max_entries is not None and (fam.fid, bkey) not in self._cache:
      entry = self._entry(fam, bkey)  # evicted: rebuild
      hit = False
    padded = self._pad(fam, leaves, shapes, entry.in_shapes)
    t0 = time.perf_counter() if fam.observers else 0.0
    if fam.mode == "auto":
      # The true sizes go to the device once per distinct sizes tuple (a dict hit afterwards),
      # not as a fresh host->device copy on every call.
      dev_sizes = self._sizes_on_device.get(sizes)
      if dev_sizes is None or (fam.shard is not None
                               and dev_sizes.sharding != fam.shard.replicated):
        if len(self._sizes_on_device) > 4096:
          self._sizes_on_device.clear()
        dev_sizes = self._sizes_on_device[sizes] = (
            jnp.asarray(np.asarray(sizes, np.int32)) if fam.shard is None
            else fam.shard.put_sizes(sizes))  # replicated over the mesh: no per-call reshard
      outs = entry.exe(dev_sizes, *padded)
    else:
      outs = entry.exe(*padded)
    result = self._unpad(fam, outs, sizes, device)
    if fam.observers:
      dt = time.perf_counter() - t0
      for p, b in zip(fam.policies, bkey, strict=True):
        p.record_time(b, dt)
    with self._stats_lock:
      self._calls += 1
      self._hits += hit
      self._bucket_calls[(fam.fid, bkey)] += 1
      self._padded_elems += entry.padded_elems
      self._true_elems += sum(math.prod(shapes[i]) for i in fam.spec_idx)
      if not device and not opts.return_padded:
        self._host_syncs += 1
    if opts.check:
      self._maybe_check(fam, leaves, result)
    return result

  def _entry(self, fam: _Family, bkey) -> _BucketEntry | None:
    key = (fam.fid, bkey)
    if self._opts.async_compile and key not in self._cache and fam.buckets:
      larger = self._larger_bucket(fam, bkey)
      if larger is not None:
        if key not in self._background:
          self._background.add(key)
          self._pending.append(_background_pool().submit(self._build_entry, fam, bkey))
        return None
    return self._build_entry(fam, bkey)

  def _build_entry(self, fam: _Family, bkey) -> _BucketEntry:
    entry = self._cache.get_or_build((fam.fid, bkey), lambda: fam.build_bucket(bkey))
    fam.buckets[bkey] = entry
    return entry

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

  def _pad(self, fam: _Family, leaves, shapes, in_shapes):
    zero = fam.mode == "trust"
    if fam.shard is not None:  # placed with their shardings, straight from the host
      return fam.shard.pad(fam, leaves, shapes, in_shapes, zero)
    out = list(leaves)
    for i in fam.spec_idx:  # leaves without dims pass through as they are
      x, shape, target = leaves[i], shapes[i], in_shapes[i]
      if _is_padded(x):
        buf = x.buffer
        if tuple(buf.shape) == target:
          out[i] = buf
          continue
        x = x.unpad()
      if shape == target:
        continue
      if not isinstance(x, np.ndarray):
        x = np.asarray(x)  # device array of a non-bucket shape: one host round trip
      out[i] = _host_pad(x, target)
    return out

  def _unpad(self, fam: _Family, outs, sizes, device: bool):
    opts = self._opts
    shapes = [fn(sizes) for fn in fam.out_shape_fns]
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

  def _run_exact(self, fam: _Family, leaves, shapes, device: bool):
    leaves = [x.unpad() if _is_padded(x) else x for x in leaves]
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
    """A function with dynjax control flow: host-side Program run (dynjax.control)."""
    from dynjax.control import run_in_program

    leaves = [x.unpad() if _is_padded(x) else x for x in leaves]
    dyn = iter(_tree_unflatten(fam.treedef, leaves))
    static = iter(fam.key[0])
    kw = {p.name: (next(static) if i in self._static_pos else next(dyn))
          for i, p in enumerate(self._params)}
    out = run_in_program(self.fun, (), kw, options=self._opts)
    flat, tree = _tree_flatten(out)
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
    """Compiles every bucket of the declared ranges ahead of time, concurrently.

    Variables whose policy has no ``max`` are warmed at the example's bucket only.
    ``background=True`` returns at once and compiles largest bucket first; with
    ``async_compile=True`` calls are then served on the smallest compiled bucket that fits
    while the rest compile (``wait()`` blocks until all are done).

    Returns:
      ``{"buckets": [...], "compiled": n, "seconds": s}`` (``"pending": n`` in background).

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
    before = self._cache.compiles
    t0 = time.perf_counter()
    if background:
      pool = _background_pool()
      for b in sorted(todo, key=math.prod, reverse=True):
        key = (fam.fid, b)
        if key not in self._cache and key not in self._background:
          self._background.add(key)
          self._pending.append(pool.submit(self._build_entry, fam, b))
      return {"buckets": todo, "pending": len(self._pending), "seconds": 0.0}
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
            "seconds": time.perf_counter() - t0}

  def wait(self) -> None:
    """Waits for background compiles (``async_compile=True``, ``warmup(background=True)``)."""
    while self._pending:
      self._pending.pop().result()

  def stats(self) -> dict:
    """Counters: calls, compiles, cache hits, compile seconds, per-bucket calls, padded
    fraction, fallbacks, host syncs, evictions.

    Example:
      >>> f.stats()["compiles"]
      3
    """
    with self._stats_lock:
      fams = self._all_families
      per_bucket = {}
      for (fid, bkey), n in sorted(self._bucket_calls.items(), key=str):
        fam = fams[fid]
        if bkey in ("exact", "program"):
          label = "exact (unpadded)" if bkey == "exact" else "control-flow program (VM)"
        else:
          label = ", ".join(f"{v}={b}" for v, b in zip(fam.sig.var_order, bkey, strict=True))
        per_bucket[label] = per_bucket.get(label, 0) + n
      return {
          "calls": self._calls,
          "compiles": self._cache.compiles,
          "cache_hits": self._hits,
          "compile_seconds": self._cache.compile_seconds,
          "per_bucket_calls": per_bucket,
          "padded_fraction": (0.0 if not self._padded_elems
                              else 1.0 - self._true_elems / self._padded_elems),
          "exact_calls": self._exact_calls,
          "fallbacks": list(self._fallbacks),
          "host_syncs": self._host_syncs,
          "evictions": self._cache.evictions,
          "executables": len(self._cache),
          "policies": {v: repr(p) for v, p in self._policies.items()},
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
        for v, p, hist in zip(sig.var_order, fam.policies, fam.size_hist, strict=True):
          plan = p.sizes() if p.max is not None or getattr(p, "_table", None) else "unbounded"
          lines.append(f"    {v}: {p!r} -> {plan}")
          if hist:
            sizes = list(hist.elements())
            lines.append(f"       observed {len(hist)} distinct sizes in {len(sizes)} calls "
                         f"(min {min(hist)}, max {max(hist)}); expected padded fraction of "
                         f"this plan: {p.expected_waste(sizes):.1%}")
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


_BG_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_BG_LOCK = threading.Lock()


def _background_pool() -> concurrent.futures.ThreadPoolExecutor:
  global _BG_POOL
  with _BG_LOCK:
    if _BG_POOL is None:
      # XLA compiles release the GIL; half the cores leaves room for serving threads.
      _BG_POOL = concurrent.futures.ThreadPoolExecutor(
          max(2, (os.cpu_count() or 2) // 2), thread_name_prefix="dynjax-compile")
    return _BG_POOL


def _progress(label: str, done: int, total: int, seconds: float) -> None:
  width = 30
  filled = int(width * done / max(total, 1))
  sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                   f"{seconds:.1f}s")
  sys.stderr.flush()

