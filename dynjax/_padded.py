"""``dynjax.Padded``: a padded buffer plus the true shape of the value it holds."""

from __future__ import annotations

import jax
import numpy as np


@jax.tree_util.register_pytree_node_class
class Padded:
  """A value padded to a bucket: ``buffer`` (bucket shape) and ``shape`` (the true shape).

  ``return_padded=True`` makes a dynjax function return these; every dynjax function accepts
  them as arguments without re-padding when the buffer already has the bucket's shape.  The
  valid data is the prefix ``buffer[:shape[0], :shape[1], ...]``; the rest is unspecified.

  Example:
    >>> p = f(x)            # f = dynjax.jit(..., return_padded=True)
    >>> p.shape, p.buffer.shape
    ((8, 37), (8, 64))
    >>> g(p)                # no host round trip, no re-padding
    >>> p.unpad()           # the exact value, as numpy
  """

  __slots__ = ("buffer", "shape")

  def __init__(self, buffer, shape):
    self.buffer = buffer
    self.shape = tuple(int(s) for s in shape)
    have = getattr(buffer, "shape", None)
    if have is not None and (len(have) != len(self.shape)
                             or any(not 0 <= n <= b for n, b in zip(self.shape, have, strict=True))):
      raise ValueError(
          f"dynjax.Padded(buffer, shape={self.shape}): the true shape must have the buffer's "
          f"rank and fit inside it, but the buffer has shape {tuple(have)}. Pass the shape of "
          "the valid prefix buffer[:shape[0], :shape[1], ...]")

  @classmethod
  def _of(cls, buffer, shape: tuple):
    """Without the checks (dynjax's own results: the shape fits by construction; ~1.5 us a
    leaf saved on a ``return_padded`` call)."""
    obj = object.__new__(cls)
    obj.buffer, obj.shape = buffer, shape
    return obj

  @property
  def dtype(self):
    return self.buffer.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def unpad(self) -> np.ndarray:
    """The exact value as a numpy array (one device-to-host copy)."""
    host = np.asarray(self.buffer)
    return host[tuple(slice(0, s) for s in self.shape)]

  def tree_flatten(self):
    return (self.buffer,), self.shape

  @classmethod
  def tree_unflatten(cls, shape, children):
    return cls._of(children[0], shape)  # (children may be tracers or placeholders)

  def __repr__(self) -> str:
    return (f"Padded(shape={self.shape}, buffer={getattr(self.buffer, 'shape', '?')} "
            f"{getattr(self.buffer, 'dtype', '')})")
