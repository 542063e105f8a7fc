"""``jax.lax.scan(f, init, xs, length=xs.shape[0])`` over a symbolic length.

JAX's ``_infer_scan_length`` calls ``int(length)`` on an explicit ``length``, which a symbolic
size refuses (``InconclusiveDimensionOperation``), although without ``length`` JAX infers the
same symbolic size from ``xs``.  Haiku's ``hk.scan`` (behind ``hk.dynamic_unroll``) always
passes ``length=xs.shape[0]``.  Inside a family's trace (:func:`_rebind.family_tracing`), an
explicit symbolic ``length`` equal to every leading axis of ``xs`` is taken as JAX would take
it without ``length``: the same scan, so the same jaxpr.  Anything else goes to JAX's code.
"""

from __future__ import annotations

from dynjax import _jax_private as jp
from dynjax.bucketing._rebind import family_tracing_active, rebind_hook

_HOOK = jp.scan_length_hook()
_INFER = getattr(*_HOOK) if _HOOK else None  # JAX's, before install()


def infer_scan_length(xs_flat, xs_avals, length):
  if (length is not None and family_tracing_active() and jp.is_dim_expr(length)
      and xs_flat and all(getattr(x, "shape", ())[:1] == (length,) for x in xs_flat)):
    return _INFER(xs_flat, xs_avals, None)
  return _INFER(xs_flat, xs_avals, length)


def install() -> bool:
  return rebind_hook(_HOOK, infer_scan_length)


# Installed at import, not after a refusal: JAX's traceback filtering drops the frame that
# would recognise it, and outside a family's trace the wrapper is one call to JAX's function.
install()
