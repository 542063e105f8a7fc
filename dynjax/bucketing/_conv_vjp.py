"""Gradients of strided convolutions along a dynamic axis (session 24).

JAX transposes ``conv_general_dilated`` (``_conv_general_dilated_transpose_lhs`` / ``_rhs`` in
``jax._src.lax.convolution``) into another convolution whose padding it computes from the
shapes: for a strided conv whose input length is not known to be a multiple of the stride
the high padding is a symbolic expression (``2*floordiv(t - 1, 2) - t + 2`` for a stride-2
``nn.Conv(padding=((1, 1),))``; with ``padding="SAME"`` the low padding too), and
``conv_general_dilated`` accepts only integers (``ValueError: padding argument to
conv_general_dilated should be a string or a sequence of (low, high) pairs``).  So the training
step of any model with a strided conv over a dynamic axis (Whisper's and wav2vec2's front ends,
ESPnet's ``Conv2dSubsampling``) fell back to one compile per shape while its forward was
bucketed.

After the first such refusal, ``install()`` rebinds the name the transposes call
(``convolution.conv_general_dilated``, :func:`_jax_private.conv_hook`) to :func:`conv`: while a
family traces and the padding holds a symbolic size, it pads the input first with ``lax.pad``
(the same low/high padding, and the lhs dilation as interior padding: XLA's convolution pads
the dilated input the same way) and convolves with no padding and no lhs dilation; the result
is the same array, and its length is JAX's symbolic expression for the transpose's.  The
padding pass's ``pad`` rule places the true prefix at its offsets, the ``conv`` rule masks the
bucket's tail.  Everywhere else (integer padding, outside a family's trace) it is JAX's
function.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from jax import lax

from dynjax import _jax_private as jp
from dynjax.bucketing._rebind import family_tracing_active, rebind_hook
from dynjax.bucketing._rebind import register as register_rebinder

_HOOK = jp.conv_hook()
_CONV = getattr(*_HOOK) if _HOOK else None  # JAX's, before install()
FAILURE = "padding argument to conv_general_dilated"
_SYMBOL = re.compile(r"[A-Za-z_]")
jp.exclude_from_user_frames(__file__)


def is_refusal(e: BaseException) -> bool:
  """JAX's refusal of a symbolic padding (JAX's traceback filter hides the transposes'
  frames, so the message decides: a padding that names a dimension variable)."""
  text = str(e)
  return isinstance(e, ValueError) and FAILURE in text and bool(
      _SYMBOL.search(text.split(", got", 1)[-1]))


def install() -> bool:
  return rebind_hook(_HOOK, conv)


register_rebinder(is_refusal, install)


def _symbolic_padding(padding) -> bool:
  return not isinstance(padding, str) and any(
      not isinstance(c, (int, np.integer)) for pair in padding for c in pair)


def conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
         dimension_numbers=None, *rest, **kw):
  """``lax.conv_general_dilated``; inside a family's trace, with a symbolic ``padding``, the
  input padded (and dilated) by ``lax.pad`` first, then convolved unpadded.  ``rest``: the
  parameters after ``dimension_numbers`` given by position (``feature_group_count``, ...: JAX's
  own batching rule passes them so)."""
  if not (family_tracing_active() and _symbolic_padding(padding)):
    return _CONV(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, *rest, **kw)
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  spatial = dn.lhs_spec[2:]
  lhs_dilation = tuple(lhs_dilation) if lhs_dilation else (1,) * len(spatial)
  config = [(0, 0, 0)] * lhs.ndim
  for i, axis in enumerate(spatial):
    (lo, hi), d = padding[i], lhs_dilation[i]
    config[axis] = (lo, hi, d - 1)
  lhs = lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
  return _CONV(lhs, rhs, window_strides, [(0, 0)] * len(spatial), (1,) * len(spatial),
               rhs_dilation, dn, *rest, **kw)
