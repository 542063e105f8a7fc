"""GPU kernels lowered once a process: ``jax.export`` of a kernel, inlined into every executable.

jax lowers a jitted function again in every executable that calls it, and a Mosaic GPU
kernel's lowering builds its whole program in Python.  A model served over length buckets
compiles one executable per bucket, all calling the same few kernels (the grouped layer's
buffer has one shape up to ``HOPPER_MIN_ROWS`` routed rows): :func:`call` lowers each kernel
once a process with :func:`jax.export.export` (its custom calls are Mosaic GPU's, which export
supports) and every executable inlines the serialized module.  The same module bytes also let
Mosaic GPU's compiled-kernel cache (keyed by the module's hash) serve every executable.

Measured (H100, jax 0.11.2, ``bench_moe_gmm.py --parts e2e``, 4 length buckets' builds of
the MoE encoder with the ``"hopper"`` kernel, session 8): 16.8 s lowered per executable,
10.5 s exported once (``lax.ragged_dot``'s 10.9 s): more than the lowering (0.58 -> 0.085 s a
bucket for cuda on the 2-core box), so the kernels' compiles were not shared between
executables before either (cause not isolated).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable, Hashable

import jax

# Off: every executable lowers its kernels itself (bench_moe_gmm.py --no-kernel-export).
EXPORT = True
# Where the default backend is one of these, a kernel's first export also starts its compile
# alone on a background thread (an executable holding only the kernel): Mosaic GPU compiles a
# kernel at the XLA compile of the first executable that holds it and caches it by the
# module's hash, so the model's own compile then finds it while the model is still being
# traced, lowered and compiled (XLA releases the GIL while it compiles).  () turns it off.
PRECOMPILE_ON = ("gpu",)
_CUSTOM_CALLS = ("mosaic_gpu_v2",)
_MAX = 128  # kernels remembered (an export and its builder each)
# key -> the function that builds the kernel (the first given), most recently used last.
_BUILDERS: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()
_FAILED: set = set()  # keys whose export raised: lowered per executable (warned once)
_STARTED: dict = {}  # key -> the thread compiling its kernel alone (PRECOMPILE_ON)
logger = logging.getLogger("dynjax")


def call(key: Hashable, fn: Callable, *args):
  """``fn(*args)``, lowered for CUDA once a process per ``key`` and argument shapes.

  ``fn`` must be a pure function of ``key`` and the arguments' shapes and dtypes (its first
  use per key is the one exported).  Traceable; one jit around the call, so an executable
  calling the same kernel from several layers holds it once (also where it is not exported).
  """
  full = (key, tuple((tuple(a.shape), jax.numpy.dtype(a.dtype).name) for a in args))
  with _LOCK:
    _BUILDERS[full] = _BUILDERS.pop(full, fn)  # most recent last
    while len(_BUILDERS) > _MAX:
      _BUILDERS.popitem(last=False)
  if EXPORT and full not in _FAILED:
    try:
      _exported(full)  # built here (cached), so that a failure can fall back
    except Exception as e:  # noqa: BLE001 - only the compile time is at stake, not the values
      _FAILED.add(full)
      logger.warning("dynjax.route: exporting the GPU kernel %s failed (%s: %s); it is lowered "
                     "in every executable instead (slower to compile, same values)",
                     key[0] if isinstance(key, tuple) else key, type(e).__name__, e)
    else:
      _precompile(full)
      return _call(*args, key=full)
  return _direct(*args, key=full)


def _precompile(key) -> None:
  """Compiles the exported kernel of ``key`` alone on a daemon thread, once a process."""
  if jax.default_backend() not in PRECOMPILE_ON:
    return
  with _LOCK:
    if key in _STARTED:
      return
    t = _STARTED[key] = threading.Thread(target=_compile_alone, args=(key,), daemon=True,
                                         name="dynjax-kernel-precompile")
  t.start()


def _compile_alone(key) -> None:
  try:
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in key[1]]
    jax.jit(_exported(key).call).lower(*structs).compile()
  except Exception as e:  # noqa: BLE001 - the model's own compile then builds the kernel
    name = key[0][0] if isinstance(key[0], tuple) else key[0]
    logger.info("dynjax.route: compiling the GPU kernel %s ahead failed (%s: %s); the "
                "executable that holds it compiles it", name, type(e).__name__, e)


def precompiles() -> dict:
  """``{kernel key: finished?}`` of the kernels compiled ahead in this process (tests)."""
  with _LOCK:
    return {k: not t.is_alive() for k, t in _STARTED.items()}


@functools.partial(jax.jit, static_argnames=("key",))
def _call(*args, key):
  return _exported(key).call(*args)


@functools.partial(jax.jit, static_argnames=("key",))
def _direct(*args, key):
  return _BUILDERS[key](*args)


@functools.lru_cache(maxsize=_MAX)
def _exported(key):
  from jax import export  # noqa: PLC0415

  _, avals = key
  structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
  checks = [export.DisabledSafetyCheck.custom_call(c) for c in _CUSTOM_CALLS]
  return export.export(jax.jit(_BUILDERS[key]), platforms=("cuda",),
                       disabled_checks=checks)(*structs)


def clear() -> None:
  """Forgets every exported kernel (tests)."""
  _exported.cache_clear()
  _call.clear_cache()
  _direct.clear_cache()
  _BUILDERS.clear()
  _FAILED.clear()
  _STARTED.clear()
