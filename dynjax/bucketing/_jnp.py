"""JAX functions whose code needs a static length: symbolic-length copies.

``jnp.interp`` (``len(xp)``), ``jnp.convolve`` and ``jnp.correlate`` (``len(x) < len(y)``, to
put the longer input first) call Python's ``len()``, which JAX refuses for a symbolic length
(``TypeError: '_DimExpr' object cannot be interpreted as an integer``), so a family traced
with ``padding="auto"`` fell back to one compile per shape for resampling an irregular
series or smoothing a variable-length signal.  After the first such refusal, ``install()``
rebinds them (``jnp.<name>`` and module globals bound to JAX's function) to wrappers that,
while a family traces and an input has a symbolic length, run JAX's code operation for
operation with ``x.shape[0]`` for ``len(x)``; everywhere else they are JAX's functions.  A
comparison of lengths the trace cannot decide (``t < 3`` for a 3-tap kernel) becomes a
guard like any other (``t >= 3``; shorter signals run exact).  The padding pass then pads
what they compute (the search: ``_search``; the convolution: its ``conv_general_dilated``
rule).

``jax.random.permutation`` (and ``choice`` without replacement) shuffle with JAX's
``_shuffle``, which refuses a symbolic size because its number of sorting rounds depends on
it (``ceil(3 log(size) / log(2**32 - 1))``: 1 up to 1,625 elements, 2 up to ~2.6 million).
:func:`shuffle` is the same rounds of JAX's (split the key, 32 random bits per element, a
stable sort by them), counted from the true size on the device by the thresholds of JAX's own
formula and run by a ``while_loop``: the same keys, bits and sorts as JAX at the true size.
"""

from __future__ import annotations

import functools
import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dynjax import _jax_private as jp
from dynjax.bucketing._rebind import family_tracing_active, rebind_globals, rebind_hook
from dynjax.bucketing._rebind import register as register_rebinder

_ORIGINALS = {"interp": jnp.interp, "convolve": jnp.convolve, "correlate": jnp.correlate}
FAILURE = "cannot be interpreted as an integer"  # len() of a symbolic size
jp.exclude_from_user_frames(__file__)


def _symbolic_length(*xs) -> bool:
  return family_tracing_active() and any(
      jnp.ndim(x) == 1 and jp.is_dim_expr(np.shape(x)[0]) for x in xs if hasattr(x, "shape"))


_SHUFFLE_HOOK = jp.shuffle_hook()
_SHUFFLE = getattr(*_SHUFFLE_HOOK) if _SHUFFLE_HOOK else None  # JAX's, before install()
SHUFFLE_FAILURE = "shape polymorphism for `permutation` or `shuffle`"


_PAD_WRAP_HOOK = jp.pad_wrap_hook()
_PAD_WRAP = getattr(*_PAD_WRAP_HOOK) if _PAD_WRAP_HOOK else None


def is_refusal(e: BaseException) -> bool:
  if isinstance(e, NotImplementedError) and SHUFFLE_FAILURE in str(e):
    return True
  names = {f.name for f in traceback.extract_tb(e.__traceback__)}
  if "_pad_wrap" in names and "inconclusive" in str(e):
    return True  # divmod(pad, t) > 0
  return isinstance(e, TypeError) and FAILURE in str(e) and bool(names & {"_interp", "_conv"})


def install() -> bool:
  changed = False
  for name, original in _ORIGINALS.items():
    changed |= rebind_globals(original, globals()[name], (jnp,))
  changed |= rebind_hook(_SHUFFLE_HOOK, shuffle)
  changed |= rebind_hook(_PAD_WRAP_HOOK, pad_wrap)
  return changed


register_rebinder(is_refusal, install)


def interp(x, xp, fp, left=None, right=None, period=None):
  """``jnp.interp``; inside a dynjax family's trace, with ``xp`` of symbolic length, JAX's
  code (``lax_numpy._interp``, operation for operation) with ``xp.shape[0]`` for its
  ``len(xp)``, which JAX refuses for a symbolic length."""
  if not _symbolic_length(xp):
    return _ORIGINALS["interp"](x, xp, fp, left=left, right=right, period=period)
  x, xp, fp = jnp.asarray(x), jnp.asarray(xp), jnp.asarray(fp)
  if xp.shape != fp.shape or xp.ndim != 1:
    raise ValueError("xp and fp must be one-dimensional arrays of equal size")
  x_arr, xp_arr = jp.promote_dtypes_inexact(x, xp)
  (fp_arr,) = jp.promote_dtypes_inexact(fp)
  for name, side in (("left", left), ("right", right)):
    if isinstance(side, str) and side != "extrapolate":
      raise ValueError(f"the only valid string value of `{name}` is 'extrapolate', but got: "
                       f"{side!r}")
  if jnp.issubdtype(x_arr.dtype, jnp.complexfloating):
    raise ValueError("jnp.interp: complex x values not supported.")
  if period is not None:
    if np.ndim(period) != 0:
      raise ValueError(f"period must be a scalar; got {period}")
    period = jnp.abs(period)
    x_arr = x_arr % period
    xp_arr = xp_arr % period
    xp_arr, fp_arr = lax.sort_key_val(xp_arr, fp_arr)
    xp_arr = jnp.concatenate([xp_arr[-1:] - period, xp_arr, xp_arr[:1] + period])
    fp_arr = jnp.concatenate([fp_arr[-1:], fp_arr, fp_arr[:1]])
  i = jnp.clip(jnp.searchsorted(xp_arr, x_arr, side="right"), 1, xp_arr.shape[0] - 1)
  df = fp_arr[i] - fp_arr[i - 1]
  dx = xp_arr[i] - xp_arr[i - 1]
  delta = x_arr - xp_arr[i - 1]
  epsilon = np.spacing(np.finfo(xp_arr.dtype).eps)
  dx0 = lax.abs(dx) <= epsilon  # Prevent NaN gradients when `dx` is small.
  f = jnp.where(dx0, fp_arr[i - 1], fp_arr[i - 1] + (delta / jnp.where(dx0, 1, dx)) * df)
  if not isinstance(left, str):
    left_arr = fp_arr[0] if left is None else left
    if period is None:
      f = jnp.where(x_arr < xp_arr[0], left_arr, f)
  if not isinstance(right, str):
    right_arr = fp_arr[-1] if right is None else right
    if period is None:
      f = jnp.where(x_arr > xp_arr[-1], right_arr, f)
  return f


functools.update_wrapper(interp, _ORIGINALS["interp"])  # help() shows JAX's documentation


def _conv(x, y, mode, op, precision, preferred_element_type):
  """JAX's ``lax_numpy._conv``, operation for operation, with ``x.shape[0]`` for ``len(x)``."""
  if np.ndim(x) != 1 or np.ndim(y) != 1:
    raise ValueError(f"{op}() only support 1-dimensional inputs.")
  if preferred_element_type is None:
    x, y = jp.promote_dtypes_inexact(x, y)
  else:
    x, y = jp.promote_dtypes(x, y)
  if x.shape[0] == 0 or y.shape[0] == 0:
    raise ValueError(f"{op}: inputs cannot be empty, got shapes {x.shape} and {y.shape}.")
  out_order = slice(None)
  if op == "correlate":
    y = jnp.conj(y)
    if x.shape[0] < y.shape[0]:
      x, y = y, x
      out_order = slice(None, None, -1)
  elif op == "convolve":
    if x.shape[0] < y.shape[0]:
      x, y = y, x
    y = jnp.flip(y)
  if mode == "valid":
    padding = [(0, 0)]
  elif mode == "same":
    padding = [(y.shape[0] // 2, y.shape[0] - y.shape[0] // 2 - 1)]
  elif mode == "full":
    padding = [(y.shape[0] - 1, y.shape[0] - 1)]
  else:
    raise ValueError("mode must be one of ['full', 'same', 'valid']")
  result = lax.conv_general_dilated(x[None, None, :], y[None, None, :], (1,), padding,
                                    precision=precision,
                                    preferred_element_type=preferred_element_type)
  return result[0, 0, out_order]


def _conv_wrapper(op: str, default_mode: str):
  """``jnp.<op>``; inside a dynjax family's trace, with an input of symbolic length, JAX's
  code with ``x.shape[0]`` for ``len(x)`` (module docstring)."""

  def wrapper(a, v, mode=default_mode, *, precision=None, preferred_element_type=None):
    if not _symbolic_length(a, v):
      return _ORIGINALS[op](a, v, mode=mode, precision=precision,
                            preferred_element_type=preferred_element_type)
    return _conv(jnp.asarray(a), jnp.asarray(v), mode, op, precision, preferred_element_type)

  return functools.update_wrapper(wrapper, _ORIGINALS[op])  # help() shows JAX's documentation


convolve = _conv_wrapper("convolve", "full")
correlate = _conv_wrapper("correlate", "valid")


def _round_thresholds() -> tuple[int, ...]:
  """Sizes ``s_r`` such that JAX's ``_shuffle`` sorts ``r`` times for sizes in
  ``(s_{r-1}, s_r]`` (``s_0 = 1``: one element is not sorted), from its own formula in
  float64, up to 2**31 elements."""

  def rounds(s):
    return int(np.ceil(3 * np.log(max(1, s)) / np.log(np.iinfo(np.uint32).max)))

  out, r = [1], 1
  while out[-1] < 2**31:
    lo, hi = out[-1], 2**31  # the largest s with rounds(s) <= r
    if rounds(hi) <= r:
      break
    while lo < hi:
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if rounds(mid) <= r else (lo, mid - 1)
    out.append(lo)
    r += 1
  return tuple(out)


_THRESHOLDS = _round_thresholds()  # (1, 1625, 2642245): measured once at import, ~0.1 ms


def shuffle(key, x, axis):
  """JAX's ``_shuffle``; inside a dynjax family's trace, with a symbolic size, its rounds run
  by a ``while_loop`` (module docstring).  Cost (2-core CPU box, jax 0.10.2, three
  alternating processes, session 23): a (1000, 16) row permutation 0.40-0.48 ms at bucket
  1024 vs ``jax.jit``'s 0.28-0.41 at the exact shape; a bare ``sort_key_val`` there is at
  ``jax.jit``'s time since the sort rule stopped adding a key, so the rest is the rounds'
  loop and bits."""
  if not family_tracing_active() or not any(jp.is_dim_expr(d) for d in np.shape(x)):
    return _SHUFFLE(key, x, axis)
  x = jnp.asarray(x)
  size = jnp.asarray(math.prod(x.shape), jnp.int32)  # the true size, once padded
  rounds = sum((size > t).astype(jnp.int32) for t in _THRESHOLDS)

  def body(state):
    i, key, x = state
    key, subkey = jax.random.split(key)
    bits = jax.random.bits(subkey, x.shape, jnp.uint32)
    return i + 1, key, lax.sort_key_val(bits, x, axis)[1]

  return lax.while_loop(lambda s: s[0] < rounds, body, (jnp.int32(0), key, x))[2]


if _SHUFFLE is not None:
  functools.update_wrapper(shuffle, _SHUFFLE)


def pad_wrap(array, pad_width):
  """JAX's ``_pad_wrap`` (``jnp.pad(mode="wrap")``); inside a dynjax family's trace, an axis
  of symbolic size ``t`` padded by ``(l, r)`` with ``l, r < t`` is ``[x[t-l:], x, x[:r]]``, as
  JAX's code makes it at a static size.  ``l < t`` is a comparison the trace may not decide:
  it becomes a guard (``t >= l + 1``; shorter sizes run exact).  Padding of ``t`` or more
  (the array repeated) is left to JAX (the family falls back)."""
  if not family_tracing_active() or not any(jp.is_dim_expr(d) for d in np.shape(array)):
    return _PAD_WRAP(array, pad_width)
  for i, size in enumerate(array.shape):
    left, right = pad_width[i]
    if not jp.is_dim_expr(size):
      one = [(0, 0)] * array.ndim
      one[i] = (left, right)
      array = _PAD_WRAP(array, tuple(one))
      continue
    if left == 0 and right == 0:
      continue
    if not (size > left and size > right):  # the array repeated: JAX's code (it refuses)
      return _PAD_WRAP(array, pad_width)
    parts = [lax.slice_in_dim(array, size - left, size, axis=i)] if left else []
    parts.append(array)
    if right:
      parts.append(lax.slice_in_dim(array, 0, right, axis=i))
    array = lax.concatenate(parts, dimension=i)
  return array


if _PAD_WRAP is not None:
  functools.update_wrapper(pad_wrap, _PAD_WRAP)
