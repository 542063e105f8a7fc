"""JAX functions that refuse a symbolic size and that dynjax rebinds while a family traces.

``_scan`` (``jax.lax.associative_scan``), ``_search`` (JAX's search behind ``jnp.searchsorted``)
and ``_jnp`` (``jnp.interp``, ``convolve``, ``correlate``, JAX's shuffle behind
``jax.random.permutation``) each :func:`register` how to recognise JAX's refusal and how to
install a wrapper; a family that meets a refusal installs
the matching wrapper and traces again (:func:`after_refusal`).  The wrapper binds dynjax's
primitive (or runs a symbolic-size copy of JAX's code) inside :func:`family_tracing` only,
and is JAX's function everywhere else.
"""

from __future__ import annotations

import contextlib
import sys
import threading

_FAMILY = threading.local()
_LOCK = threading.Lock()
_REBINDERS: list = []  # (is_refusal(e) -> bool, install() -> bool)


def register(is_refusal, install) -> None:
  _REBINDERS.append((is_refusal, install))


def after_refusal(e: BaseException) -> bool:
  """Whether ``e`` is a refusal a registered wrapper answers and installing it changed
  something (then a trace that failed may succeed: trace again)."""
  return any(is_refusal(e) and install() for is_refusal, install in _REBINDERS)


def install_all() -> None:
  """Every registered wrapper installed, without waiting for a refusal (the padding pass's
  test harness traces functions the way a family does)."""
  for _, install in _REBINDERS:
    install()


def rebind_hook(hook, wrapper) -> bool:
  """``hook`` (``(module, name)`` from ``_jax_private``, or None where that JAX lacks it) set
  to ``wrapper``.  True when it changed."""
  if hook is None or getattr(*hook) is wrapper:
    return False
  setattr(*hook, wrapper)
  return True


@contextlib.contextmanager
def family_tracing():
  """While a family traces its function (this thread): the rebound functions bind dynjax's
  primitives; outside, they are JAX's."""
  previous = getattr(_FAMILY, "on", False)
  _FAMILY.on = True
  try:
    yield
  finally:
    _FAMILY.on = previous


def family_tracing_active() -> bool:
  return getattr(_FAMILY, "on", False)


def rebind_globals(original, wrapper, public_modules=()) -> bool:
  """Every module global bound to ``original`` outside jax, jaxlib and dynjax (``from
  jax.lax import associative_scan``), and the same name in ``public_modules`` (jax's modules
  named: the public one that exports it, or the one whose own code calls it), rebound to
  ``wrapper``.  True when it rebound anything.  Other jax modules keep JAX's function.
  3-5 ms over ~1,000 modules (CPU box, flax and hypothesis imported): run it after a refusal,
  not on every trace."""
  changed = False
  with _LOCK:
    for name, mod in list(sys.modules.items()):
      if mod is None or (name.split(".")[0] in ("jax", "jaxlib", "dynjax")
                         and not any(mod is m for m in public_modules)):
        continue
      try:
        names = [k for k, v in vars(mod).items() if v is original]
      except Exception:  # noqa: BLE001 - a module object without a plain __dict__
        continue
      for k in names:
        setattr(mod, k, wrapper)
        changed = True
  return changed
