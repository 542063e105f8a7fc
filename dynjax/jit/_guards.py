"""Guards: size conditions a family infers while tracing (:func:`add_guard`).

Where symbolic tracing needs a comparison it cannot decide (``lax.top_k(x, 3)`` asks whether
``t < 3``), the family decides it as torch.compile's guards do: it assumes the side that holds
for more of the sizes the policy allows, re-traces under that constraint and checks it on every
call.  This module reads the comparison out of jax's error and writes the constraints.
"""

from __future__ import annotations

import logging
import math
import re

from dynjax import _symbolic

logger = logging.getLogger("dynjax")
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


def add_guard(fam, e: BaseException) -> bool:
  """Adds the guard that decides the comparison ``e`` found inconclusive; False when there
  is none to add (not such an error, not ``var OP const``, too many, or no progress)."""
  # Only a dispatcher that checks ``guard_ok`` on every call may run guarded executables.
  if not getattr(fam.ctx, "checks_guards", False):
    return False
  cmp = inconclusive_comparison(e)
  if cmp is None or cmp[0] not in fam.sig.var_order:
    return False
  var, split = cmp  # the sizes of ``var`` split into [1, split - 1] and [split, ...)
  pol = fam.ctx.policies.for_var(var)
  top = pol.max if fam.ctx.opts.overflow != "grow" else None
  i = fam.sig.var_order.index(var)
  bounds = {j: (lo, hi) for j, lo, hi in fam._guard_bounds}
  lo, hi = bounds.get(i, (1, math.inf))
  top = hi if top is None else min(top, hi)
  above, below = top - max(lo, split) + 1, min(top, split - 1) - lo + 1  # sizes per side
  if above >= below:  # ties (and no max): the side of the larger sizes
    new = (max(lo, split), hi)
  else:
    new = (lo, min(hi, split - 1))
  if new == (lo, hi) or new[0] > new[1]:
    return False  # no progress, or no size left
  bounds[i] = new
  guards = guard_texts(fam.sig.var_order, bounds)
  try:
    sig = _signature(fam, guards)
  except Exception:  # noqa: BLE001 - jax refuses the constraint: no guard, run exact
    return False
  fam.sig = sig
  fam.guards = guards
  fam._guard_bounds = tuple((j, lo, hi) for j, (lo, hi) in sorted(bounds.items()))
  logger.info("dynjax: %s traces under the inferred guards %s", fam.name, guards)
  return True


def _signature(fam, guards: tuple[str, ...]):
  """The family's signature with ``guards`` added to its constraints (same specs)."""
  specs = [(path, None if spec is None else spec.text, len(aval.shape))
           for path, spec, aval in zip(fam.leaf_paths, fam.sig.leaves, fam.avals,
                                       strict=True)]
  texts = [text for _, text, _ in specs]
  return _symbolic.build_signature(specs, fam._constraints(texts) + guards)
