"""Outputs that are inputs: returned as the caller's own object, never computed or copied.

(A forwarded numpy array or Python scalar comes back as a device array, as ``jax.jit`` returns
it: the caller's own mutable buffer never doubles as a result.)

A function that returns one of its arguments unchanged (``return y, params``; every Flax NNX
step, whose updated state holds every parameter it did not touch) gets, under ``jax.jit``,
the very array it passed in (pjit forwards it: no copy, no transfer).  dynjax's executables
used to return such an output as a copy on the device and, for a host request, as a numpy
copy: an NNX model called with numpy inputs got numpy parameters back (``nnx.update`` then
stored them), and each later call uploaded them again.  Now:

* :func:`find` (once per family, on the symbolic jaxpr): output index -> input leaf index for
  every output that *is* an input leaf without dims (the jaxpr's outvar is that invar);
* the bucket executables leave those outputs out (:func:`drop` inside the lowered function,
  which checks that the bucket's own trace returns the input there too: ``trust`` re-traces
  the Python per bucket; otherwise the family runs exact, with a warning), and
  :class:`Inserter` puts the caller's own objects back in their places after a run;
* the exact-shape path (one trace per shape, unchecked) returns what its executable computed:
  copies (for an NNX model, the wrapper puts numpy state back on its device).

Parameters that are only forwarded and otherwise only cast count as cast-once candidates
(``jit/_casts.py``): the caller still gets its own float32 array back.
"""

from __future__ import annotations

import bisect

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from dynjax._errors import PaddingUnsupportedError


def find(fam) -> dict[int, int]:
  """output index -> input leaf index, for outputs that are input leaves without dims."""
  jaxpr = fam.jaxpr.jaxpr
  leaf_of = {v: i for i, v in enumerate(jaxpr.invars) if fam.sig.leaves[i] is None}
  return {o: leaf_of[v] for o, v in enumerate(jaxpr.outvars)
          if not isinstance(v, jex_core.Literal) and v in leaf_of}


def arg_positions(fam, leaves) -> dict[int, tuple[int, int]]:
  """leaf index -> (dynamic argument position, index among that argument's leaves), for each
  of ``leaves`` (the family's leaves are its arguments' leaves, concatenated)."""
  starts, n = [], 0
  for child in fam.treedef.children():
    starts.append(n)
    n += child.num_leaves
  out = {}
  for li in leaves:
    pos = bisect.bisect_right(starts, li) - 1  # the last argument starting at or before li
    out[li] = (pos, li - starts[pos])
  return out


def drop(outs, forward: dict, leaves) -> list:
  """The outputs an executable computes: all but the forwarded ones, each checked to be its
  input in this trace too (``trust`` re-traces the Python per bucket: a shape-dependent
  branch could return something else there; the family then runs exact, with a warning)."""
  if not forward:
    return outs
  for o, li in forward.items():
    if outs[o] is not leaves[li]:
      raise PaddingUnsupportedError(
          f"output {o} is input leaf {li} in the symbolic trace but not in this bucket's")
  return [o for i, o in enumerate(outs) if i not in forward]


class Inserter:
  """Puts the forwarded inputs of one call back among an executable's outputs."""

  __slots__ = ("items", "top")

  def __init__(self, fam, top: bool):
    # Ascending output index; with the leaf index (flat leaves), or the argument position and
    # the index among its leaves (top-level arguments).
    items = sorted(fam.forward.items())
    self.top = top
    if top:
      where = arg_positions(fam, [li for _, li in items])
      items = [(o, *where[li]) for o, li in items]
    self.items = tuple(items)

  def insert(self, res: list, vals) -> list:
    """``res`` (the computed outputs, in order) with the forwarded inputs of ``vals`` (the
    call's top-level arguments or flat leaves) inserted at their output positions."""
    res = list(res)
    if not self.top:
      for o, li in self.items:
        res.insert(o, _as_array(vals[li]))
      return res
    flat: dict[int, list] = {}
    for o, pos, j in self.items:
      if pos not in flat:
        flat[pos] = jax.tree_util.tree_leaves(vals[pos])
      res.insert(o, _as_array(flat[pos][j]))
    return res


_ARRAY_TYPE: list = []  # the concrete type of a jax.Array (one isinstance check less a leaf)


def _as_array(x):
  """A forwarded input as ``jax.jit`` returns it: a ``jax.Array`` stays the caller's object; a
  numpy array or Python scalar becomes a device copy (never the caller's mutable buffer).
  ~75 ns a jax.Array leaf (2-core CPU box): 15 us for an NNX state of 200 forwarded leaves."""
  if not _ARRAY_TYPE:
    _ARRAY_TYPE.append(type(jnp.zeros(())))
  if type(x) is _ARRAY_TYPE[0] or isinstance(x, jax.Array):
    return x
  return jnp.asarray(x)
