"""A padded array and what is known of its padded region (the padding pass's value type)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PaddedValue:
  """A padded array and what is known of its padded region.

  Attributes:
    val: the array, of the aval's shape evaluated at the bucket sizes.
    fill: ``None`` when the padded region may hold anything (garbage); otherwise the Python
      scalar every element of the padded region equals.
  """

  val: Any
  fill: Any = None
  # ((axis, c), ...): along ``axis``, the padded positions of every row whose other dynamic
  # coordinates are valid hold ``c`` -- or every valid element of that row is NaN (then every
  # sum, contraction or reversed cumsum over ``axis`` of the row is NaN, padded or not).  Only
  # sum-like masks over that one axis read it (to skip themselves); see ``fused_softmax``.
  axis_fill: tuple = ()

  def __post_init__(self):
    # Fills come from jaxpr literals (jax's ``TypedNdArray``, an unhashable 0-d ndarray), NumPy
    # scalars or Python numbers: keep one hashable NumPy scalar, or None if it is not a scalar.
    if self.fill is not None:
      object.__setattr__(self, "fill", normalize_fill(self.fill))

  def array(self, dtype):
    """The value as a jitted function returns it: itself where it is an array, else (a
    literal, a Python or NumPy scalar) an array of ``dtype``."""
    return self.val if hasattr(self.val, "shape") else jnp.asarray(self.val, dtype)

  def fill_along(self, axis: int):
    """The known constant of the padded region along ``axis`` (for rows valid elsewhere)."""
    if self.fill is not None:
      return self.fill
    return next((c for a, c in self.axis_fill if a == axis), None)


def normalize_fill(fill):
  """A known padded-region constant as a hashable NumPy scalar (None when not a scalar)."""
  if fill is None:
    return None
  try:
    f = np.asarray(fill)
  except Exception:
    return None
  if f.ndim != 0 or f.dtype == object:
    return None
  return f[()]


def common_fill(fills):
  """The fill shared by every value (same value and sign, e.g. not 0.0 vs -0.0), else None."""
  fills = list(fills)
  if not fills or fills[0] is None:
    return None
  return fills[0] if all(same_fill(f, fills[0]) for f in fills[1:]) else None


def same_fill(fill, identity) -> bool:
  if fill is None:
    return False
  try:
    f, i = np.asarray(fill), np.asarray(identity)
    if f.ndim or i.ndim:
      return False
    if f.dtype == np.bool_ or i.dtype == np.bool_:
      return bool(f) == bool(i)
    if np.iscomplexobj(f) or np.iscomplexobj(i):
      return bool(f == i)
    return bool(f == i) and bool(np.signbit(f) == np.signbit(i))
  except Exception:
    return False


__all__ = ["PaddedValue", "common_fill", "normalize_fill", "same_fill"]
