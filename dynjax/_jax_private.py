"""The one module that touches private JAX APIs (``jax._src``).

Everything here has a fallback or a test, so a JAX upgrade that moves a private name breaks
one place.  Append-only across the team: keep functions small and documented.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading

import jax
import numpy as np


def summarize_source(eqn) -> str:
  """The user's source line of a jaxpr equation, e.g. ``model.py:42 (attend)``."""
  try:
    from jax._src import source_info_util

    return source_info_util.summarize(eqn.source_info)
  except Exception:  # pragma: no cover - private API moved
    return "<unknown source>"


def exclude_from_user_frames(path: str) -> None:
  """Source lines of equations skip frames in ``path`` (a dynjax module that binds on the
  user's behalf), as they skip jax's own: ``explain()`` names the user's line."""
  try:
    from jax._src import source_info_util

    source_info_util.register_exclusion(path)
  except Exception:  # pragma: no cover - private API moved: lose source lines, not results
    pass


_CACHE_SET: list = []  # the directory dynjax last pointed JAX's compilation cache at


def enable_persistent_cache(cache_dir: str) -> str | None:
  """Points JAX's persistent compilation cache at ``cache_dir`` and persists everything,
  unless the process chose its own: a ``jax_compilation_cache_dir`` that dynjax did not set
  (``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update``) stays as it is, thresholds included,
  and is returned (None: JAX's cache is at ``cache_dir`` now).  Before, a ``cache_dir`` moved
  every ``jax.jit`` of the process into it and made JAX persist each of their compiles.

  JAX initialises its cache on the first compile of the process; if that already happened
  with another directory, the cache is reset so the new directory takes effect.
  """
  current = jax.config.jax_compilation_cache_dir
  if current and (not _CACHE_SET or current != _CACHE_SET[-1]):
    return current  # the user's own setting
  _CACHE_SET[:] = [cache_dir]
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  try:
    from jax._src import compilation_cache as cc

    if cc.is_initialized():
      cc.reset_cache()
  except Exception:  # pragma: no cover - private API moved: the config alone still works
    pass
  return None


def no_persistent_cache_write():
  """A context (this thread only) in which compiles are not written to JAX's persistent
  compilation cache: its minimum compile time to be written becomes infinite."""
  try:
    from jax._src import config as jax_config

    return jax_config.persistent_cache_min_compile_time_secs(float("inf"))
  except Exception:  # pragma: no cover - private API moved: write as usual
    import contextlib

    return contextlib.nullcontext()


def array_impl() -> type:
  """The concrete ``jax.Array`` class (exact type tests on the hot path), without starting a
  backend: ``type(jax.device_put(x))`` at import time started the default backend inside
  ``import dynjax`` (then ``jax.config.update("jax_num_cpu_devices", n)`` or
  ``jax.distributed.initialize()`` after it raised).  Fallback: that old way."""
  try:
    from jax._src.array import ArrayImpl

    return ArrayImpl
  except Exception:  # pragma: no cover - private API moved: the backend starts at import
    return type(jax.device_put(np.zeros((), np.float32)))


def jaxlib_version() -> str:
  import jaxlib

  return getattr(jaxlib, "__version__", "?")


# jax configuration that changes what a function lowers to (the executable store's key).
_LOWERING_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
                    "jax_default_prng_impl", "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
                    "jax_enable_checks", "jax_debug_nans", "jax_debug_infs",
                    "jax_use_shardy_partitioner", "jax_pallas_call_guard")


def lowering_config() -> tuple:
  """(name, value) of the jax options that change lowered code (those this jax has)."""
  out = []
  for name in _LOWERING_CONFIG:
    try:
      out.append((name, repr(getattr(jax.config, name))))
    except AttributeError:
      continue
  return tuple(out)


# --- symbolic dimensions (used by the padding pass, dynjax/bucketing/_padding*.py) ---


def eval_dim_expr(expr, env: dict):
  """Evaluates a dimension expression with ``env`` mapping variable name -> value.

  Integers evaluate to Python ``int``; with traced int32 scalars in ``env`` (e.g. the true sizes
  inside a jitted function), ``floordiv``/``mod``/``max``/``min`` become ``jnp`` operations and
  the result is a traced int32 scalar.
  """
  from jax._src import core

  if core.is_constant_dim(expr):
    return int(expr)
  # JAX evaluates ``min(t, 2)`` as ``lax.min(t, 2)``, its constants in the default int dtype
  # (int64 under x64): traced sizes are evaluated in that dtype and the result returned in
  # theirs (mixing int32 and int64 made rules crash into a fallback under x64).
  default = jax.dtypes.canonicalize_dtype(np.int64)
  traced = [v.dtype for v in env.values() if hasattr(v, "dtype") and v.dtype != default]
  if traced:
    env = {k: v.astype(default) if hasattr(v, "dtype") else v for k, v in env.items()}
  value = expr._evaluate(env)
  if core.is_constant_dim(value) and not hasattr(value, "aval"):
    return int(value)
  return value.astype(traced[0]) if traced and hasattr(value, "astype") else value


def dim_expr_vars(expr) -> set[str]:
  """Names of the dimension variables appearing in a dimension expression."""
  from jax._src import core

  if core.is_constant_dim(expr):
    return set()
  return set(expr._get_vars())


def dim_as_value_primitive():
  """The ``dim_as_value`` primitive (a symbolic dimension used as a number)."""
  from jax._src.export import shape_poly

  return shape_poly.dim_as_value_p


def threefry_partitionable() -> bool:
  """Whether ``random_bits`` counters are the row-major element index (prefix-stable)."""
  return bool(jax.config.jax_threefry_partitionable)


def private_primitives() -> dict:
  """Primitives that ``jax.extend.core.primitives`` does not export, by name (absent ones skipped)."""
  out = {}
  try:
    from jax._src.random import prng

    out["random_wrap"] = prng.random_wrap_p
    out["random_unwrap"] = prng.random_unwrap_p
  except Exception:  # pragma: no cover - private API moved
    pass
  try:
    from jax._src.lax import lax as lax_internal

    out["split"] = lax_internal.split_p
  except Exception:  # pragma: no cover
    pass
  try:
    from jax._src.lax import lax as lax_internal

    out["unstack"] = lax_internal.unstack_p  # jnp.roll under vmap emits it (jax >= 0.11)
  except Exception:  # pragma: no cover
    pass
  try:
    from jax._src.lax import lax as lax_internal

    out["stack"] = lax_internal.stack_p  # jnp.stack (jax >= 0.10)
  except Exception:  # pragma: no cover
    pass
  try:
    from jax._src.lax import lax as lax_internal

    out["ragged_dot_general"] = lax_internal.ragged_dot_general_p  # lax.ragged_dot (MoE)
  except Exception:  # pragma: no cover
    pass
  return out


def shaped_array(shape, dtype):
  """An abstract value (``ShapedArray``) of a shape that may hold symbolic dims."""
  from jax._src import core

  return core.ShapedArray(tuple(shape), jax.numpy.dtype(dtype))


_DIM_EXPR: list = []  # jax's symbolic dimension class, bound at the first use


def is_dim_expr(obj) -> bool:
  """Whether ``obj`` is a symbolic dimension expression (any other object: False)."""
  # The padding pass asks ~11,000 times a BERT-base bucket: the class is bound once (an
  # import statement here cost ~1 us a call, ~10 ms a bucket on the CPU box); at the first
  # use, not at import, so that a JAX that moved it breaks the pass, not ``import dynjax``.
  if not _DIM_EXPR:
    from jax._src.export import shape_poly

    _DIM_EXPR.append(shape_poly._DimExpr)
  return isinstance(obj, _DIM_EXPR[0])


def dim_interval(expr, box: dict) -> tuple[int, int]:
  """Sound integer bounds of a dimension expression when each variable ``v`` ranges over
  ``box[v] = (lo, hi)`` (interval arithmetic over the ``_DimExpr`` structure).

  Used to size padded buffers of non-monotone dims such as ``t - mod(t, 5)``.
  """
  from jax._src import core

  def mul(a, b):
    ps = [a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]]
    return min(ps), max(ps)

  def ev(e):
    if core.is_constant_dim(e):
      return int(e), int(e)
    lo = hi = 0
    for term, coeff in e._sorted_terms:
      t = (1, 1)
      for factor, exp in term._factors:
        f = ev_factor(factor)
        for _ in range(exp):
          t = mul(t, f)
      c = mul(t, (coeff, coeff))
      lo, hi = lo + c[0], hi + c[1]
    return lo, hi

  def ev_factor(f):
    if f.var is not None:
      return box[f.var]
    ops = [ev(o) for o in f.operands]
    if f.operation == "max":
      return max(ops[0][0], ops[1][0]), max(ops[0][1], ops[1][1])
    if f.operation == "min":
      return min(ops[0][0], ops[1][0]), min(ops[0][1], ops[1][1])
    (alo, ahi), (blo, bhi) = ops
    if f.operation == "mod":
      if blo > 0:
        if alo >= 0 and blo == bhi:
          return (0, min(bhi - 1, ahi)) if ahi < bhi else (0, bhi - 1)
        return 0, bhi - 1
      if bhi < 0:  # Python's mod by a negative divisor lies in (b, 0]
        return blo + 1, 0
      raise ValueError(f"cannot bound {f}")
    if f.operation == "floordiv":
      if bhi < 0:  # floordiv(a, b) == floordiv(-a, -b) (a reshape's -1 by a negated product)
        (alo, ahi), (blo, bhi) = (-ahi, -alo), (-bhi, -blo)
      if blo > 0:
        qs = [alo // blo, alo // bhi, ahi // blo, ahi // bhi]
        return min(qs), max(qs)
      raise ValueError(f"cannot bound {f}")
    raise ValueError(f"cannot bound {f}")

  return ev(expr)


def scan_arity(params: dict) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation's params.

  jax <= 0.10 stores them as ``num_consts``/``num_carry``; later versions describe the operands
  with ``FlatTree`` params ``ft_in = (consts, carry, xs)`` and ``ft_out = (carry, ys)``.
  """
  if "num_consts" in params:
    return int(params["num_consts"]), int(params["num_carry"])
  consts, carry, _xs = params["ft_in"].unpack()
  return len(consts), len(carry)


def eqn_context(eqn):
  """The context ``jax.core.eval_jaxpr`` binds an equation under: its user traceback and name
  stack (so a re-traced equation keeps the user's source line) and its ``eqn.ctx``."""
  import contextlib

  try:
    from jax._src import source_info_util

    stack = contextlib.ExitStack()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(source_info_util.user_context(eqn.source_info.traceback,
                                                      name_stack=name_stack))
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
      stack.enter_context(manager)
    return stack
  except Exception:  # pragma: no cover - private API moved: lose source lines, not results
    return contextlib.nullcontext()


# --- equalities of symbolic dimensions that user code decides (dynjax/jit/_family.py) ---
# jax answers ``d == 5`` for a symbolic ``d`` with False when it cannot decide it (shape_poly
# ``_DimExpr.__eq__``: "which is really unsound"; it cannot raise, hashing uses it).  A user's
# ``if x.shape[1] == 5:`` then takes the "not equal" side for every size, silently.  While a
# family traces, the equality is wrapped so that such undecided comparisons made by code outside
# jax, jaxlib and dynjax (the user's model, flax, optax) are recorded: the family checks
# ``lhs != rhs`` on every call (a guard) and runs the sizes where they are equal exact.
_EQ_LOCAL = threading.local()
_EQ_STATE: dict = {}  # "patched": whether __eq__ is wrapped (once a process)
_EQ_LOCK = threading.Lock()


def _wrap_dim_equality() -> bool:
  """Wraps ``_DimExpr.__eq__`` once a process and gives the class a ``__bool__`` (``d != 0``,
  recorded alike: without one ``if x.shape[0]:`` was True for every size); False where jax's
  class moved (no recording: jax's own answer, as before)."""
  if "patched" in _EQ_STATE:
    return _EQ_STATE["patched"]
  with _EQ_LOCK:
    if "patched" in _EQ_STATE:
      return _EQ_STATE["patched"]
    try:
      from jax._src.export import shape_poly

      cls, is_symbolic = shape_poly._DimExpr, shape_poly.is_symbolic_dim
      original = cls.__eq__
      own_file = original.__code__.co_filename  # __ne__ calls __eq__ from there too
    except Exception:  # pragma: no cover - private API moved
      _EQ_STATE["patched"] = False
      return False
    import os

    import jaxlib

    import dynjax

    internal = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, dynjax))

    def __eq__(self, other):  # noqa: N807 - the wrapped dunder
      answer = original(self, other)
      record = getattr(_EQ_LOCAL, "record", None)
      if record is None or answer is not False:  # not tracing a family, or decided equal
        return answer
      _note(self, other, answer, sys._getframe(1), record)
      return answer

    def __bool__(self):  # noqa: N807 - jax's class has none: ``if x.shape[0]:`` was True
      # for every size, silently (``x[1:]`` of one row is empty).  Now ``d != 0``, recorded.
      answer = original(self, 0)
      record = getattr(_EQ_LOCAL, "record", None)
      if record is not None and answer is False:
        _note(self, 0, answer, sys._getframe(1), record)
      return not answer

    def _note(self, other, answer, frame, record):
      # Past shape_poly's own frames and generated equality methods (a dataclass's ``__eq__``
      # is compiled from "<string>"): a cache keyed by such objects compares dims when two
      # keys' hashes collide, which varies per process (string hashing, keys hashed by id).
      # Seen: jax's ``batching._batch_jaxpr2`` cache comparing ``AxisData`` sizes ``b == 1``,
      # a spurious guard on the zoo's BiLSTM in one run of the slow tier.  Who called decides.
      while frame is not None and (frame.f_code.co_filename == own_file or (
          frame.f_code.co_filename.startswith("<")
          and frame.f_code.co_name in ("__eq__", "__ne__"))):
        frame = frame.f_back
      if frame is None or frame.f_code.co_filename.startswith(internal):
        return  # jax's own shape rules (``definitely_equal(d, 1)``) and dynjax's
      try:
        if not is_symbolic(self - other):
          return  # decided: unequal for every size
      except Exception:  # noqa: BLE001 - another scope, not a dimension: jax's answer stands
        return
      record.append((self, other, f"{frame.f_code.co_filename}:{frame.f_lineno}"))

    cls.__eq__ = __eq__
    if "__bool__" not in vars(cls):
      cls.__bool__ = __bool__
    _EQ_STATE["patched"] = True
    return True


@contextlib.contextmanager
def undecided_equalities():
  """A context (this thread only) yielding a list that collects ``(lhs, rhs, "file:line")``
  for every equality of symbolic dimensions that code outside jax/jaxlib/dynjax evaluated and
  jax answered False without deciding it; None where the wrap is unavailable."""
  if not _wrap_dim_equality():
    yield None
    return
  previous = getattr(_EQ_LOCAL, "record", None)
  record: list = []
  _EQ_LOCAL.record = record
  try:
    yield record
  finally:
    _EQ_LOCAL.record = previous


_MOSAIC_RUNTIME: list = []  # [reason or None], once a process


def mosaic_gpu_runtime() -> str | None:
  """Readies the process to run a Mosaic GPU kernel deserialized with ``jax.export`` without
  importing Mosaic GPU's Python (``jax.experimental.mosaic.gpu``).  None when ready, else why not.

  The kernel's custom call JIT-compiles a host stub that needs Mosaic GPU's runtime library;
  it finds that library through ``MOSAIC_GPU_RUNTIME_LIB_PATH``, which the import of
  ``jax.experimental.mosaic.gpu.core`` sets (next to the compiled bindings'
  ``_mosaic_gpu_ext``).  Without it the first run fails with "Failed to lookup host symbol"
  (``benchmarks/probe_kernel_load.py``).  This imports only the compiled bindings
  (``jax._src.lib.mosaic_gpu``) and sets the variable the same way.  Measured on the H100 host
  (jax 0.11.2): the Python import costs 0.35 s of a cold process; see ``route._once``.
  """
  if _MOSAIC_RUNTIME:
    return _MOSAIC_RUNTIME[0]
  import os
  import pathlib

  why = None
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    path = pathlib.Path(mosaic_gpu_lib._mosaic_gpu_ext.__file__).parent / \
        "libmosaic_gpu_runtime.so"
    if not path.exists():
      why = f"Mosaic GPU's runtime library is not at {path}"
    else:
      os.environ["MOSAIC_GPU_RUNTIME_LIB_PATH"] = str(path)  # as that import does
  except Exception as e:  # noqa: BLE001 - no CUDA plugin, or the private name moved
    why = f"Mosaic GPU's compiled bindings did not import ({type(e).__name__}: {e})"
  _MOSAIC_RUNTIME.append(why)
  return why


def _hook(module: str, name: str):
  """``(module, name)`` of a function JAX's own code looks up by module attribute at each
  call (so setting the attribute rebinds every caller), or None where that JAX lacks it."""
  try:
    mod = importlib.import_module(module)
  except Exception:  # pragma: no cover - private API moved
    return None
  return (mod, name) if callable(getattr(mod, name, None)) else None


def searchsorted_hook():
  """The function ``jnp.searchsorted`` (and ``jnp.digitize``, ``jnp.histogram``,
  ``jnp.isin``, ``Array.searchsorted``) calls to search: jax >= 0.10's
  ``hijax.searchsorted_via_expand`` (:func:`_hook`; None: ``bucketing/_search`` installs
  nothing and such a search falls back exact, as before)."""
  return _hook("jax._src.numpy.hijax", "searchsorted_via_expand")


def shuffle_hook():
  """The function ``jax.random.permutation`` (and ``choice`` without replacement) shuffles
  with: ``jax._src.random.core._shuffle`` (:func:`_hook`; None: ``bucketing/_jnp`` installs
  nothing and a shuffle over a dynamic axis falls back exact, as before)."""
  return _hook("jax._src.random.core", "_shuffle")


def pad_wrap_hook():
  """The function ``jnp.pad(mode="wrap")`` pads with: ``lax_numpy._pad_wrap`` (:func:`_hook`;
  None: ``bucketing/_jnp`` installs nothing and such a pad falls back exact)."""
  return _hook("jax._src.numpy.lax_numpy", "_pad_wrap")


def scan_length_hook():
  """The function ``jax.lax.scan`` checks an explicit ``length`` with: ``loops.
  _infer_scan_length`` (:func:`_hook`; None: ``bucketing/_scan_length`` installs nothing and
  ``scan(..., length=xs.shape[0])`` over a dynamic axis falls back exact, as before)."""
  return _hook("jax._src.lax.control_flow.loops", "_infer_scan_length")


def conv_hook():
  """The name JAX's transposes of ``conv_general_dilated`` call it by (``jax._src.lax.
  convolution.conv_general_dilated``; :func:`_hook`; None: ``bucketing/_conv_vjp`` installs
  nothing and the gradient of a strided conv over a dynamic axis falls back exact)."""
  return _hook("jax._src.lax.convolution", "conv_general_dilated")


def promote_dtypes_inexact(*args):
  """``jnp``'s promotion of ``args`` to one inexact dtype, weak types kept (what
  ``jnp.interp`` applies to ``x`` and ``xp``)."""
  from jax._src.numpy import util

  return util.promote_dtypes_inexact(*args)


def promote_dtypes(*args):
  """``jnp``'s promotion of ``args`` to one dtype, weak types kept."""
  from jax._src.numpy import util

  return util.promote_dtypes(*args)


def sort_comparators():
  """``(lt, le)``: JAX's sort-order comparators (``lax._sort_lt_comparator`` and
  ``_sort_le_comparator``, what ``jnp.searchsorted`` compares with: one total-order compare
  for floats), or None where they moved (``bucketing/_search`` then builds them from public
  operations, ~2x the ops)."""
  try:
    from jax._src.lax import lax as lax_internal

    return lax_internal._sort_lt_comparator, lax_internal._sort_le_comparator
  except Exception:  # pragma: no cover - private API moved
    return None


def is_differentiation_tracer(x) -> bool:
  """Whether ``x`` is a tracer of ``jax.grad``/``jvp``/``vjp``/``linearize`` (forward-mode
  or linearize tracers; ``jax.grad`` makes the latter)."""
  try:
    from jax._src.interpreters import ad
  except Exception:  # pragma: no cover - private API moved: judge by the class name
    return type(x).__name__ in ("JVPTracer", "LinearizeTracer")
  kinds = tuple(t for t in (getattr(ad, "JVPTracer", None), getattr(ad, "LinearizeTracer", None))
                if t is not None)
  return isinstance(x, kinds)


def as_weak(x):
  """``x`` with a weak type (what ``lax.while_loop`` returns for a Python-scalar carry)."""
  try:
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, weak_type=True)
  except Exception:  # pragma: no cover - private API moved: keep the strong type
    return x
