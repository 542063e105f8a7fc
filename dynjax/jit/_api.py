"""``dynjax.jit`` and the function it returns, :class:`Wrapped`.

``dynjax.jit(fun, ...)`` checks every option once (``_options.py``) and returns a
:class:`Wrapped`.  Calling it binds the arguments (``_args.Binder``) and runs the call
through the dispatcher (``_dispatch.py``):

    solve dims from the inputs -> bucket -> pad -> run -> unpad -> count

A *family* (``_family.py``) is everything of one static signature: symbolic signature,
symbolic jaxpr traced once, output shape functions, bucket plan and entries; the compiler
(``_serving.py``) decides when each bucket is built.  ``trace/lower/compile`` give the stage
objects (``_stages.py``); ``stats()``/``explain()`` read the counters (``_stats.py``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

from dynjax import _jax_private
from dynjax._config import config
from dynjax._errors import SpecError
from dynjax.bucketing._policies import BucketPolicy
from dynjax.jit import _args, _options, _stages, _stats
from dynjax.jit._args import Binder, is_signature_error, parameters, positional_names
from dynjax.jit._cache import enable_compile_log
from dynjax.jit._dispatch import Dispatcher, top_key


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
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
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
    attention: str | None = None,
    cast_once: bool = True,
    host_outputs: bool | None = None,
    ragged_dot: str | None = None,
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
    static_argnames, donate_argnames: as in ``jax.jit``.  Argument leaves that are not
      arrays (an Equinox module's activation function, a string) are static without being
      named, as ``eqx.filter_jit`` keeps them: part of the executable's key, hashed.
    static_argnums, donate_argnums: as in ``jax.jit``: positions of parameters, added to the
      ``*_argnames`` (dynjax keys everything by name).
    return_padded: return :class:`dynjax.Padded` values (buffer + true shape) instead of
      exact-shape arrays.
    constraints: extra ``jax.export`` constraints (``"t <= 512"``); a policy with a ``max`` adds
      ``"t <= max"`` itself unless ``overflow="grow"``.
    max_executables: keep at most this many executables (least recently used evicted).
    cache_dir: persistent compilation cache directory (or ``DYNJAX_CACHE_DIR``): dynjax's
      store of compiled buckets, and JAX's own compilation cache unless the process set that
      (``jax_compilation_cache_dir``), which then stays where it was.
    check: also run the exact-shape function (every ``DYNJAX_CHECK_EVERY``-th call) and raise
      :class:`dynjax.PaddingMismatchError` on a difference. Default ``DYNJAX_CHECK``.
    async_compile: when a call needs a bucket that is not compiled yet but a larger one is,
      serve it on the larger bucket (exact thanks to padding) and compile in the background.
    in_shardings: run every bucket on a device mesh with JAX's GSPMD (see ``dynjax.jit`` docs):
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
    attention: opt-in rewrite of scaled-dot-product attention (``einsum`` q.k, scale, optional
      key mask or bias, ``jax.nn.softmax`` over the keys, ``einsum`` with v) into
      ``jax.nn.dot_product_attention``: ``"cudnn"`` (GPU, float16/bfloat16: cuDNN's fused
      kernel; with ``padding="auto"`` padded keys are cut by ``key_value_seq_lengths`` = the
      true length), ``"pallas"`` (GPU, float32/float16/bfloat16, key-only masks, no bias:
      dynjax's Pallas flash attention, which never writes the logits and, under
      ``padding="auto"``, skips the key blocks past the true length; its gradient is XLA's)
      or ``"xla"``.  Numerics change within the dtype's tolerance (softmax in
      float32), hence opt-in; ``explain()`` lists every site rewritten or left unchanged, and why.
    cast_once: float arguments without dims that the function only ever casts to one narrower
      float dtype (Flax's ``param_dtype=float32`` with ``dtype=bfloat16``) are cast once per
      array, cached by the array's identity (``jax.Array``; numpy is cast on every call), and
      the executables take the cast copies: no per-call conversion of the weights.  The same
      values reach the computation (the function casts them anyway).  Costs the copies' memory beside the caller's arrays,
      as torch's autocast cache, and host work on each call (a flatten of the argument holding
      them): leaves under 256 KiB, and families that would save less than ~0.1 ms a call,
      stay as they are.  ``explain()`` lists the leaves, ``stats()["cast_once"]`` counts
      conversions.  Not for sharded functions or donated arguments.
    host_outputs: where the executables put their outputs.  ``None`` (default): on GPU, in
      pinned host memory for a function whose first call is a host request (its arrays with
      dims are numpy; a warmup from shapes counts as one under ``serving=True``), so a numpy
      result needs no separate device-to-host copy (H100: a small call's numpy round trip
      ~180 -> ~70 us); device memory otherwise.  ``True``: pinned host memory on any backend
      that has it; ``False``: device memory.  Never for sharded functions, donated arguments,
      ``return_padded`` or PRNG-key outputs; a bucket whose outputs exceed 4 MiB keeps them
      on the device.  A device request to a function with host outputs gets them moved back
      to the device.  ``explain()`` says which and why; part of the ``cache_dir`` key.
    ragged_dot: ``"kernels"``: every ``jax.lax.ragged_dot`` in the function as written (a
      Mixture-of-Experts over tokens sorted by expert, and its gradients) runs as
      :func:`dynjax.route.ragged_dot`, on the grouped-GEMM kernels where they apply (Hopper
      GPU, bf16/f16; ``lax.ragged_dot`` itself elsewhere), for code you cannot edit.  Ragged
      dots inside ``scan``/``while``/``cond``/``remat`` bodies, or with a ``precision``,
      stay as written; ``explain()`` lists every site and why.  ``None`` (default):
      as written.  Part of the ``cache_dir`` key.

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
                static_argnums=static_argnums, donate_argnums=donate_argnums,
                return_padded=return_padded, constraints=constraints,
                max_executables=max_executables, cache_dir=cache_dir, check=check,
                async_compile=async_compile, in_shardings=in_shardings,
                out_shardings=out_shardings, serving=serving, compile_workers=compile_workers,
                compiler_options=compiler_options, on_fallback=on_fallback,
                attention=attention, cast_once=cast_once, host_outputs=host_outputs,
                ragged_dot=ragged_dot)
  if fun is None:
    return lambda f: Wrapped(f, **kwargs)
  if not callable(fun):
    raise SpecError(f"dynjax.jit: expected a function, got {type(fun).__name__} {fun!r}")
  return Wrapped(fun, **kwargs)


class Wrapped:
  """A function wrapped by :func:`dynjax.jit`: call it, or stage it with trace/lower/compile.

  Example:
    >>> f = dynjax.jit(lambda x: x.sum(1), dims={"x": "b, t"})
    >>> f(np.ones((2, 5), np.float32))
    array([5., 5.], dtype=float32)
    >>> print(f.explain())
  """

  def __init__(self, fun, **options):
    self.fun = fun
    self.__name__ = getattr(fun, "__name__", type(fun).__name__)
    self.__doc__ = getattr(fun, "__doc__", None)
    self.__wrapped__ = fun
    params = parameters(fun)
    param_names = [p.name for p in params]
    for kind in ("static", "donate"):  # jax's positions, as names
      options[f"{kind}_argnames"] = _options.names(options[f"{kind}_argnames"],
                                                   f"{kind}_argnames") + _options.argnums(
          options.pop(f"{kind}_argnums"), positional_names(params), f"{kind}_argnums",
          self.__name__, var_args=any(p.kind is p.VAR_POSITIONAL for p in params))
    static = options["static_argnames"]
    dyn_names = tuple(n for n in param_names if n not in static)
    opts = _options.check(self.__name__, param_names, dyn_names, **options,
                          var_keyword=any(p.kind is p.VAR_KEYWORD for p in params))
    kept = opts.cache_dir and _jax_private.enable_persistent_cache(opts.cache_dir)
    if kept:
      logging.getLogger("dynjax").info(
          "dynjax: %s stores its executables in %s; JAX's own compilation cache stays where "
          "this process put it (%s)", self.__name__, opts.cache_dir, kept)
    if config.log_compiles:
      enable_compile_log()
    self._binder = Binder(fun, self.__name__, opts.static_argnames)
    self._dispatcher = Dispatcher(opts, self._binder, self.__name__)
    functools.update_wrapper(self, fun, updated=())

  def __call__(self, *args, **kwargs):
    # The hot path.  A family whose leaves with dims are whole arguments (``f(params,
    # tokens, lengths)``) keeps one executor per (shapes, host/device): bind, look it up,
    # run it.  No Python pytree work: the executable flattens and checks the parameters in
    # C++ (a changed parameter raises "Argument types differ" there and the call takes the
    # general path, which builds a new family, as a jax.jit retrace).  Everything else takes
    # the general path (``Dispatcher.call``), which runs the same executors.
    # Measured, tiny function on the 2-core CPU box (session 35): numpy (8, 13) in and out
    # 71-72 us against 51-52 for its AOT executable with hand-written padding, a device array
    # 34 us against 17-20 (see Executor); BERT-base on the H100 host: +2-4% per request.
    static, dyn = self._binder.split(args, kwargs)
    d = self._dispatcher
    try:
      fam = d.top.get(static) if d.top else None
      if fam is not None:
        key = top_key(fam, dyn)  # None: another dtype/rank, or the family runs exact
        if key is not None:
          try:
            ex = fam.executors.get(key)
            if ex is None or ex.gen != fam.gen:  # a miss: plan, build, then the same routine
              ex = d.resolve(fam, dyn, True, key)
              if ex is None:
                return d.call(static, dyn)
            return ex.run(dyn)
          except TypeError as e:
            if not is_signature_error(e):
              raise
      return d.call(static, dyn)
    except Exception as e:  # (a try costs nothing until it catches)
      if _args.has_tracer(dyn):  # called inside jax.jit/grad/vmap or another function's trace
        return d.inline(static, dyn)
      if isinstance(e, TypeError):
        _args.reject_abstract(d.name, self._binder, dyn)  # a ShapeDtypeStruct: say so
      raise

  # -- stages ------------------------------------------------------------------------------
  def trace(self, *args, **kwargs) -> _stages.Traced:
    """Traces with symbolic dims (once per static signature); see :class:`Traced`.  Arguments
    may be ``jax.ShapeDtypeStruct`` (shapes alone), as ``jax.jit(...).trace``."""
    static, dyn = self._binder.split(args, kwargs)
    return _stages.trace(self._dispatcher, static, dyn)

  def lower(self, *args, **kwargs) -> _stages.Lowered:
    return self.trace(*args, **kwargs).lower()

  # -- ahead of time and in the background -------------------------------------------------
  def warmup(self, *args, progress: bool | None = None, max_workers: int | None = None,
             background: bool = False, **kwargs) -> dict:
    """Compiles (or, with ``cache_dir``, loads) every bucket ahead of time, concurrently.

    The buckets: every bucket of the declared ranges (variables whose policy has no ``max``:
    the example's bucket only; an ``auto`` policy: its plan, or before any traffic a ladder
    ``max``, ``max/2``, ``max/4``, ``max/8`` that its later plans keep and add to), plus every
    bucket a previous run stored under ``cache_dir``.  With ``cache_dir``, an ``auto`` policy
    plans from the traffic earlier processes kept there (sizes seen, seconds per bucket:
    ``DYNJAX_KEEP_TRAFFIC``): the buckets that plan adds build after the stored ones, the most
    valuable first; in the background, those not started by the first call wait until the
    traffic makes them worth their compile.
    Stored executables load in parallel (~0.05 s each for BERT-base on an H100) without
    tracing or lowering them again, so a restarted server is ready at once.
    ``background=True`` returns at once and builds the buckets (largest first): two at once
    until the function's first call on hosts of 8 or more cores with a compile worker to
    spare (the default from 12 cores) unless its executables call cuDNN, else and then one at
    a time (``max_workers`` when given);
    with ``async_compile=True``/``serving=True`` calls are then served on the smallest built
    bucket that fits while the rest build, and a call that needs a bucket no built one covers
    builds it at once beside them (``wait()`` blocks until all are done).  A blocking warmup
    builds ``max_workers`` (default: up to the cores) buckets at once.

    Arguments may be arrays or ``jax.ShapeDtypeStruct`` (as ``jax.jit(...).lower``), so a
    server can start at once, before its weights exist (Flax:
    ``jax.eval_shape(model.init, key, *example_args)``), and build or load while it reads
    them.  H100, BERT-base fp32 (``benchmarks/serve_fresh.py``, ``*warm*`` modes): a restart
    that warmed up from shapes answered its first request 63 ms after its weights were ready
    and streamed 1,000 requests in 3.68 s (PyTorch eager 5.51 s); a restart without the
    warmup (another run) waited 0.80 s for its first answer (trace, load, first run) and
    streamed them in 4.97 s (PyTorch eager 5.20 s).

    Returns:
      ``{"buckets": [...], "compiled": n, "loaded": n, "seconds": s}`` (``"pending": n`` in
      background).

    Example:
      >>> f.warmup(np.zeros((8, 16), np.int32))
      {'buckets': [(8, 16), (8, 32), ...], 'compiled': 6, 'seconds': 3.1}
      >>> f.warmup(jax.ShapeDtypeStruct((8, 512), np.int32), background=True)  # at start-up
    """
    traced = self.trace(*args, **kwargs)
    return self._dispatcher.compiler.warmup(traced.family, traced.sizes, progress,
                                            max_workers, background)

  def wait(self, timeout: float | None = None) -> bool:
    """Waits for background compiles (``async_compile``/``serving``,
    ``warmup(background=True)``), including queued tier-1 recompiles; False on timeout."""
    return self._dispatcher.compiler.wait(timeout)

  # -- reports -----------------------------------------------------------------------------
  def stats(self) -> dict:
    """Counters: calls, compiles, cache hits, compile seconds, per-bucket calls, padded
    fraction, fallbacks, host syncs, evictions.

    Example:
      >>> f.stats()["compiles"]
      3
    """
    return _stats.stats_dict(self._dispatcher)

  def explain(self) -> str:
    """A report: symbolic signature, output shape functions, bucket plan and expected waste,
    equations the padding pass rewrote, fallbacks and why."""
    return _stats.explain(self._dispatcher)

  def clear_cache(self) -> None:
    """Drops every traced family and compiled executable."""
    self._dispatcher.clear()

  def __repr__(self) -> str:
    return f"<dynjax.jit {self.__name__}>"

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self
    return functools.partial(self, obj)
