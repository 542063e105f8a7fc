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

The export itself is Mosaic GPU's lowering in Python, ~0.6-0.8 s a kernel on the 2-core box
and most of what a grouped layer's first trace costs beyond ``lax.ragged_dot``'s: each export
is also kept on disk (``kernel_cache_dir``: ``DYNJAX_KERNEL_CACHE``, by default
``~/.cache/dynjax/kernels`` as Triton keeps its kernels), so a later process loads it
(``jax.export.deserialize``) instead.  A file is keyed by the kernel's key and argument
shapes, and by what keys the executable store too (``dynjax._fingerprint``: the versions of
jax and jaxlib, dynjax's source, the jax configuration that changes lowering); a key holding
a function outside jax and dynjax (a user's activation: its body is not in the key) is not
kept.  An unreadable file is exported again and replaced; a directory keeps the ``MAX_KEPT``
most recently used files.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import jax
import jax.numpy as jnp

from dynjax import _config, _jax_private
from dynjax._fingerprint import fingerprint_parts, versions

# Off: every executable lowers its kernels itself (bench_moe_gmm.py --no-kernel-export).
EXPORT = True
# Where the default backend is one of these, a kernel's first export also starts its compile
# alone on a background thread (an executable holding only the kernel): Mosaic GPU compiles a
# kernel at the XLA compile of the first executable that holds it and caches it by the
# module's hash, so the model's own compile then finds it while the model is still being
# traced, lowered and compiled (XLA releases the GIL while it compiles).  () turns it off.
PRECOMPILE_ON = ("gpu",)
_CUSTOM_CALLS = ("mosaic_gpu_v2",)
_PLATFORMS = ("cuda",)  # what the kernels are exported for (tests: cpu, to run a loaded one)
_MAX = 128  # kernels remembered (an export and its builder each)
# key -> the function that builds the kernel (the first given), most recently used last.
_BUILDERS: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()
_FAILED: set = set()  # keys whose export raised: lowered per executable (warned once)
_STARTED: dict = {}  # key -> the thread compiling its kernel alone (PRECOMPILE_ON)
_KEEP: set = set()  # keys whose export is kept on disk (call(keep=True))
MAX_KEPT = 256  # kernel files a directory keeps (~50-80 KB each), least recently used dropped
logger = logging.getLogger("dynjax")


def call(key: Hashable, fn: Callable, *args, keep: bool = False):
  """``fn(*args)``, lowered for CUDA once a process per ``key`` and argument shapes.

  ``fn`` must be a pure function of ``key`` and the arguments' shapes and dtypes (its first
  use per key is the one exported).  Traceable; one jit around the call, so an executable
  calling the same kernel from several layers holds it once (also where it is not exported).
  ``keep``: the export is also kept on disk for later processes (:func:`kernel_cache_dir`);
  only for builders whose code is jax's or dynjax's (both in the file's key).
  """
  full = (key, tuple((tuple(a.shape), jax.numpy.dtype(a.dtype).name) for a in args))
  with _LOCK:
    _BUILDERS[full] = _BUILDERS.pop(full, fn)  # most recent last
    while len(_BUILDERS) > _MAX:
      _BUILDERS.popitem(last=False)
    if keep:
      _KEEP.add(full)
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


def _call(*args, key):
  """The exported kernel of ``key`` on ``args``, batchable: jax has no batching rule for an
  exported call, so under ``jax.vmap`` (also of a function jitted around it) the kernel runs
  once an element, in a ``lax.map`` (no batched kernel exists; correct, not fast)."""

  @jax.custom_batching.custom_vmap
  def kernel(*a):
    return _call_exported(*a, key=key)

  @kernel.def_vmap
  def _batched(axis_size, in_batched, *a):
    a = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
         for x, b in zip(a, in_batched, strict=True)]
    out = jax.lax.map(lambda xs: _call_exported(*xs, key=key), a)
    return out, jax.tree.map(lambda _: True, out)

  return kernel(*args)


@functools.partial(jax.jit, static_argnames=("key",))
def _call_exported(*args, key):
  return _exported(key).call(*args)


@functools.partial(jax.jit, static_argnames=("key",))
def _direct(*args, key):
  return _BUILDERS[key](*args)


@functools.lru_cache(maxsize=_MAX)
def _exported(key):
  from jax import export  # noqa: PLC0415

  path = _disk_path(key)
  if path is not None and path.exists():
    try:  # ~1 ms (2-core box) against the export's 0.6-0.8 s
      exp = export.deserialize(bytearray(path.read_bytes()))
      _touch(path)  # most recently used: pruned last
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: export it again
      logger.warning("dynjax.route: the stored GPU kernel %s could not be read (%s: %s); "
                     "exporting it again", path, type(e).__name__, e)
    else:
      if "cuda" in exp.platforms and jax.default_backend() == "gpu":
        _ready_to_run()
      return exp
  _, avals = key
  structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
  checks = [export.DisabledSafetyCheck.custom_call(c) for c in _CUSTOM_CALLS]
  exp = export.export(jax.jit(_BUILDERS[key]), platforms=_PLATFORMS,
                      disabled_checks=checks)(*structs)
  if path is not None:
    _keep(path, exp)
  return exp


def _ready_to_run() -> None:
  """Readies the process to run a kept Mosaic GPU kernel: the process that loads one has not
  built it, so it has not imported ``jax.experimental.mosaic.gpu``, whose import (0.35 s of a
  cold process on the H100 host, 1.3-1.9 s on the 2-core box) also tells the kernel's custom
  call where Mosaic GPU's runtime is.  ``_jax_private.mosaic_gpu_runtime`` says so without
  it; where it cannot, the import does."""
  if _jax_private.mosaic_gpu_runtime() is not None:
    import jax.experimental.mosaic.gpu  # noqa: F401, PLC0415 - sets the runtime's path


def kernel_cache_dir() -> Path | None:
  """Where exported kernels are kept across processes: ``DYNJAX_KERNEL_CACHE`` (``0``,
  ``off`` or ``false``: nowhere), else ``$XDG_CACHE_HOME/dynjax/kernels`` (``~/.cache``)."""
  raw = os.environ.get("DYNJAX_KERNEL_CACHE")
  if raw is not None and _config._BOOLS.get(raw.strip().lower(), True) is False:
    return None  # the spellings of "off" every DYNJAX_* switch takes
  if raw:
    return Path(raw).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "dynjax" / "kernels"


def _disk_path(key) -> Path | None:
  root = kernel_cache_dir() if key in _KEEP else None
  ident = _stable(key)
  if root is None or ident is None:
    return None
  # The executable store's versions and lowering configuration (``_fingerprint``), beside
  # the kernel's own key.
  digest = fingerprint_parts({"kernel": repr(ident), "platforms": _PLATFORMS,
                              "versions": versions(),
                              "config": _jax_private.lowering_config()})
  return root / f"{digest[:40]}.jaxexport"


_STABLE_MODULES = ("jax.", "jaxlib.", "dynjax.")


def _stable(obj):
  """A repr-able value of ``obj`` that is the same in every process, or None (not kept)."""
  if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
    return obj
  if isinstance(obj, (tuple, list)):
    items = tuple(_stable(v) for v in obj)
    if any(i is None and v is not None for i, v in zip(items, obj, strict=True)):
      return None
    return (type(obj).__qualname__, items) if hasattr(obj, "_fields") else items
  if isinstance(obj, functools.partial):
    inner = _stable((obj.func, obj.args, tuple(sorted(obj.keywords.items()))))
    return None if inner is None else ("partial", inner)
  if callable(obj):
    module, name = getattr(obj, "__module__", "") or "", getattr(obj, "__qualname__", "")
    if module.startswith(_STABLE_MODULES) and name and "<" not in name:
      return f"{module}.{name}"
    return None
  try:
    return jax.numpy.dtype(obj).name
  except TypeError:
    return None


def _keep(path: Path, exp) -> None:
  """Writes ``exp`` to ``path``; where that fails, the process goes on without it."""
  try:
    data = exp.serialize()  # jax's serialization needs the flatbuffers package
  except Exception as e:  # noqa: BLE001 - only later processes' export time is at stake
    logger.info("dynjax.route: the GPU kernel cannot be kept on disk (%s: %s)",
                type(e).__name__, e)
    return
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
  except OSError as e:
    logger.info("dynjax.route: could not keep the GPU kernel in %s (%s)", path.parent, e)
    return
  _prune(path.parent)


def _touch(path: Path) -> None:
  try:
    os.utime(path)
  except OSError:
    pass  # a read-only directory still serves


def _prune(root: Path) -> None:
  """Keeps the ``MAX_KEPT`` most recently used kernels of ``root`` (each jax, dynjax or kernel
  change leaves new files; the old ones go here, least recently used first)."""
  try:
    files = sorted(root.glob("*.jaxexport"), key=lambda f: f.stat().st_mtime)
    for f in files[:max(0, len(files) - MAX_KEPT)]:
      f.unlink(missing_ok=True)
    stale = time.time() - 3600  # a writer that died before its rename left these
    for f in root.glob("*.jaxexport.*.tmp"):
      if f.stat().st_mtime < stale:
        f.unlink(missing_ok=True)
  except OSError:
    pass  # another process pruning the same files


def clear() -> None:
  """Forgets every exported kernel (tests)."""
  _exported.cache_clear()
  _call_exported.clear_cache()
  _direct.clear_cache()
  _BUILDERS.clear()
  _FAILED.clear()
  _STARTED.clear()
  _KEEP.clear()
