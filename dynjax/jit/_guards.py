"""Guards: size conditions a family infers while tracing (see ``Family._add_guard``).

Where symbolic tracing needs a comparison it cannot decide (``lax.top_k(x, 3)`` asks whether
``t < 3``), the family decides it as torch.compile's guards do: it assumes the side that holds
for more of the sizes the policy allows, re-traces under that constraint and checks it on every
call.  This module reads the comparison out of jax's error and writes the constraints.
"""

from __future__ import annotations

import math
import re

MAX_GUARDS = 8  # re-traces under inferred guards per family; one more falls back

_INCONCLUSIVE = re.compile(
    r"Symbolic dimension comparison '([^']+)' (<=|>=|<|>) '([^']+)' is inconclusive")
_VAR_PLUS = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?: ([+-]) (\d+))?$")
_INT = re.compile(r"^-?\d+$")
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def guard_texts(var_order, bounds: dict) -> tuple[str, ...]:
  """``jax.export`` constraints of ``{var index: (lo, hi)}`` bounds (``hi`` may be inf)."""
  out = []
  for i, (lo, hi) in sorted(bounds.items()):
    if lo > 1:
      out.append(f"{var_order[i]} >= {lo}")
    if hi != math.inf:
      out.append(f"{var_order[i]} <= {hi}")
  return tuple(out)


def inconclusive_comparison(e: BaseException | None) -> tuple[str, int] | None:
  """``(var, split)`` from the first "Symbolic dimension comparison 'A' OP 'B' is
  inconclusive" in an exception chain, when it compares ``var`` (or ``var + c``) with an
  integer: the comparison holds for sizes on one side of ``split`` (``var < split`` or
  ``var >= split``).  None for anything else (products, two variables, other errors)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    m = _INCONCLUSIVE.search(str(e))
    if m is not None:
      lhs, op, rhs = (g.strip() for g in m.groups())
      if _INT.match(lhs):
        lhs, op, rhs = rhs, _FLIP[op], lhs
      v = _VAR_PLUS.match(lhs)
      if v is None or not _INT.match(rhs):
        return None
      # var + c OP k  <=>  var OP k - c
      k = int(rhs) - (int(v.group(3)) if v.group(2) == "+" else -int(v.group(3) or 0))
      return v.group(1), (k if op in ("<", ">=") else k + 1)
    e = e.__cause__ or e.__context__
  return None
