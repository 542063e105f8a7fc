"""Facts a family's trace needs that JAX's symbolic shapes cannot prove, checked over sizes.

Each is found in the message of a failed symbolic trace (or in the dims of a traced jaxpr) and
added to the family's ``jax.export`` constraints only where it holds at every size dynjax
checks (every size of one variable's range; a grid of sizes over several), then checked on
every call (sizes where it fails run exact, as ``constraints=`` do) and, where only a grid was
checked, at every bucket:

* **shape identities** (:func:`unify_shapes`, :func:`add_identities`): two clashing shapes
  whose dims are one size written two ways (a ResNet block's strided conv and its strided
  projection, a U-Net's skip connection), as an equality rule; or equal exactly at the
  multiples of ``m`` (a conv autoencoder), with ``mod(v, m) == 0`` and buckets at multiples;
  clashes over several sizes (:func:`add_clash_facts`);
* **facts over a grid** (:func:`add_facts`): comparisons JAX finds inconclusive, reshape
  remainders it cannot prove 0, the sign of a ``-1``'s divisor;
* **constant dims** (:func:`add_constant_dims`): dims one constant at every size checked.

:mod:`dynjax.jit._guards` (bounds, caps, undecided equalities) calls these and shares the
helpers here (:func:`guard_texts`, :func:`_signature`).
"""

from __future__ import annotations

import logging
import math
import re
import time

import numpy as np

from dynjax import _symbolic

logger = logging.getLogger("dynjax")

# JAX's words where two shapes that should agree do not ("add got incompatible shapes for
# broadcasting", "Incompatible types for broadcasting", dot_general's "... to have the same
# shape, got (min(128, t), 8) and (t, 8)": HF Flax RoFormer's sinusoidal table; a transpose's
# "Expected cotangent type float32[b,x,4] but got float32[b,y,4]"; concatenate's "shapes that
# differ in dimensions other than the one being concatenated": a U-Net's skip connection)
_CLASH = ("incompatible", "same shape", "mismatch", "but got", "differ in dimensions")


def guard_texts(var_order, bounds: dict) -> tuple[str, ...]:
  """``jax.export`` constraints of ``{var index: (lo, hi)}`` bounds (``hi`` may be inf)."""
  out = []
  for i, (lo, hi) in sorted(bounds.items()):
    if lo > 1:
      out.append(f"{var_order[i]} >= {lo}")
    if hi != math.inf:
      out.append(f"{var_order[i]} <= {hi}")
  return tuple(out)


IDENTITY_SCAN = 1 << 16  # sizes over which an unbounded variable's identity is checked
_CALL = re.compile(r"^-?\s*(\d+\*)?(floordiv|mod|max|min|non_negative)\(")
_CONST_TAIL = re.compile(r"^(.*\)) ([+-]) (\d+)$")


def _shape_groups(text: str) -> list[list[str]]:
  """The top-level bracketed groups of ``text`` with a comma, split at their own commas: the
  shapes in "add got incompatible shapes for broadcasting: (2, a, 16), (2, b, 16)", or in
  "Expected cotangent type float32[b,a,4] but got float32[b,c,4]"."""
  groups, depth, start = [], 0, None
  for i, ch in enumerate(text):
    if ch in "([":
      if depth == 0:
        start = i
      depth += 1
    elif ch in ")]" and depth:
      depth -= 1
      if depth == 0:
        items, d, cut = [], 0, start + 1
        for j in range(start + 1, i):
          d += text[j] in "(["
          d -= text[j] in ")]"
          if text[j] == "," and d == 0:
            items.append(text[cut:j].strip())
            cut = j + 1
        items.append(text[cut:i].strip())
        if len(items) > 1:
          groups.append([x for x in items if x])
  return groups


MAX_MODULUS = 1024  # the largest m of an identity that holds for multiples of m only


def _equal_sizes(lhs: str, rhs: str, var: str, lo: int, hi: int) -> int | None:
  """1 when ``lhs == rhs`` at every size ``lo..hi`` of ``var``; ``m`` when exactly at its
  multiples of ``m`` (``2 <= m <= MAX_MODULUS``: a Keras conv autoencoder's two stride-2
  convs and two ``UpSampling1D(2)`` give ``4*ceil(ceil(t / 2) / 2)``, which is ``t`` for
  multiples of 4: ``jax.jit`` fails at the others too); None otherwise."""
  try:  # every size at once, over numpy arrays (~2 ms for 65,536 sizes)
    sizes = np.arange(lo, hi + 1, dtype=np.int64)
    a, b = (np.broadcast_to(v, sizes.shape)
            for v in _symbolic.dim_fn([lhs, rhs], (var,), arrays=True)(sizes))
    equal = sizes[a == b]
  except Exception:  # noqa: BLE001 - text we cannot evaluate
    return None
  if len(equal) == hi - lo + 1:
    return 1
  m = int(np.gcd.reduce(equal)) if len(equal) else 0
  if m < 2 or m > MAX_MODULUS or len(equal) != hi // m - (lo - 1) // m:
    return None  # not equal at every multiple of m in the range
  return m


def _rule(lhs_text: str, rhs_text: str) -> str | None:
  """``lhs == rhs`` written as jax takes an equality constraint, a normalization rule whose
  left side is one term (``floordiv(...) + 1 == e`` as ``floordiv(...) == e - 1``); None when
  ``lhs`` is not one operation's term plus a constant (a bare variable would rewrite every
  use of it)."""
  m = _CONST_TAIL.match(lhs_text)
  core, c = (m.group(1), int(m.group(3)) * (1 if m.group(2) == "+" else -1)) if m else (
      lhs_text, 0)
  if not _CALL.match(core) or core.lstrip("- ").split("*")[-1] in rhs_text:
    return None  # (a rule whose right side holds its own left term never stops rewriting)
  if c == 0:
    return f"{core} == {rhs_text}"
  return f"{core} == {rhs_text} {'-' if c > 0 else '+'} {abs(c)}"


def _top(fam, i: int, bounds: dict) -> int:
  """The largest size of variable ``i`` a fact is checked at: its policy's max (unless
  ``overflow="grow"``), else :data:`IDENTITY_SCAN` (which then bounds it: a guard), and at
  most its guard's upper bound."""
  pol = fam.ctx.policies.for_var(fam.sig.var_order[i])
  top = pol.max if pol.max is not None and fam.ctx.opts.overflow != "grow" else None
  return int(min(bounds.get(i, (1, math.inf))[1], top if top is not None else IDENTITY_SCAN))


def unify_shapes(fam, e: BaseException, bounds: dict) -> list[tuple]:
  """Equality rules for two shapes JAX could not unify where their dims are one variable's
  same size written two ways: a ResNet block's strided 3x3 conv (SAME) and its strided 1x1
  projection both give ``ceil(h / 2)``, as ``floordiv(h - 1, 2) + 1`` and ``- floordiv(- h,
  2)``, and ``residual + y`` fails ("add got incompatible shapes").  A pair counts only where
  the two agree at every size of the variable's range (the policy's max, else
  :data:`IDENTITY_SCAN`, which then bounds the variable: its guard), or at every multiple of
  some ``m`` there and nowhere else (``_equal_sizes``: sizes that are not run exact, where
  ``jax.jit`` fails as well, and buckets round up to multiples of ``m``).  Returns ``(rules,
  var index, top, lhs, rhs, m)`` for each pair (``m`` 1: every size), ``rules`` the one or two
  ways to write it in jax's constraint syntax (``_rule``: either side's term on the left)."""
  out = []
  order = fam.sig.var_order
  for x, y in _clash_pairs(e):
    names = _symbolic.dim_vars_of(x) | _symbolic.dim_vars_of(y)
    if len(names) != 1 or not names <= set(order):
      continue  # several sizes: add_clash_facts
    var = names.pop()
    i = order.index(var)
    lo, top = bounds.get(i, (1, math.inf))[0], _top(fam, i, bounds)
    rules = tuple(r for r in (_rule(x, y), _rule(y, x)) if r)
    m = _equal_sizes(x, y, var, lo, top) if rules and top >= lo else None
    if m is not None:
      out.append((rules, i, top, x, y, m))
  return out


def _clash_pairs(e: BaseException) -> list[tuple[str, str]]:
  """The differing dims of the two shapes of the first clash in ``e``'s chain (texts)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text = str(e)
    if any(w in text.lower() for w in _CLASH):
      groups = _shape_groups(text)
      pairs = [(x, y) for a, b in zip(groups, groups[1:], strict=False) if len(a) == len(b)
               for x, y in zip(a, b, strict=True) if x != y]
      if pairs:
        return pairs
    e = e.__cause__ or e.__context__
  return []


def add_clash_facts(fam, e: BaseException, bounds: dict) -> bool:
  """Equality rules for clashing dims over several sizes (or one size and a constant) that
  agree at every size of a grid (Swin's PatchMerging: a channel count 16 against ``-
  floordiv(256*b*..., ...)``, its window reshape's ``-1``); checked per call and bucket."""
  found = []
  for x, y in _clash_pairs(e):
    rules = [r for r in (_rule(x, y), _rule(y, x)) if r and r not in fam._identities]
    held = _holds(x, "==", y, fam, bounds) if rules else None
    if held is not None:
      found.append((rules[0], x, "==", y, held))
  return bool(found) and _adopt(fam, found, bounds, "inferred: one size at every size checked")


def add_identities(fam, e: BaseException, bounds: dict) -> bool:
  """Re-trace under the equality rules :func:`unify_shapes` finds in ``e`` (each checked on
  every call, as ``constraints=`` are: ``Family.declared``)."""
  found = unify_shapes(fam, e, bounds)
  order = fam.sig.var_order
  moduli = dict(fam._moduli)
  for _, i, top, _, _, m in found:
    lo, hi = bounds.get(i, (1, math.inf))
    bounds[i] = (lo, min(hi, top))
    if m > 1:
      moduli[i] = math.lcm(moduli.get(i, 1), m)
  rules = list(fam._identities) + [
      r for r in (f"mod({order[i]}, {m}) == 0" for i, m in sorted(moduli.items()))
      if r not in fam._identities]
  new = []  # each pair's first way of writing that jax takes beside the rules so far
  for cands, *rest in found:
    for r in (r for r in cands if len(r) <= MAX_RULE_CHARS):
      if r in rules:
        break
      try:  # jax refuses two rules with one left side: then the other side's term
        _signature(fam, guard_texts(order, bounds) + tuple(rules + [r]))
      except Exception:  # noqa: BLE001
        continue
      rules.append(r)
      new.append((r, *rest))
      break
  if not new:
    return False  # nothing jax takes, or no progress: run exact
  # Checked per call from the two texts as jax printed them (parsed in the new scope, its
  # rule would make them one expression); every size of the range was checked: no bucket
  # check needed.
  checks = [(f"{x} == {y}", x, "==", y) for _, _, _, x, y, _ in new]
  if not _commit(fam, tuple(rules), bounds, checks, "inferred: two shapes of one size",
                 per_bucket=False):
    return False
  fam._moduli = tuple(sorted(moduli.items()))
  return True


def _signature(fam, guards: tuple[str, ...]):
  """The family's signature with ``guards`` added to its constraints (same specs)."""
  specs = [(path, None if spec is None else spec.text, len(aval.shape))
           for path, spec, aval in zip(fam.leaf_paths, fam.sig.leaves, fam.avals,
                                       strict=True)]
  texts = [text for _, text, _ in specs]
  return _symbolic.build_signature(specs, fam._constraints(texts) + guards)


# -- facts over several sizes: comparisons JAX cannot decide, remainders it cannot prove 0 --
_INCONCLUSIVE = re.compile(
    r"Symbolic dimension comparison '([^']+)' (<=|>=|<|>) '([^']+)' is inconclusive")
_REMAINDER = re.compile(r"The remainder (.+?) should be 0")
_DIVISOR = re.compile(r"Possible division by 0 in division by (.+?)(?:\.?$|\)? at )", re.M)
_OPS = {">=": np.greater_equal, "<=": np.less_equal, ">": np.greater, "<": np.less,
        "==": np.equal}
_NOT = {">=": "<", "<=": ">", ">": "<=", "<": ">="}
GRID_POINTS = 1 << 16  # sizes checked at most (a grid of each variable's sizes, sampled past it)


def _sizes_of(top: int) -> np.ndarray:
  """One variable's sizes a fact is checked at: 1..64, then ~30 geometric points to ``top``
  with the four sizes after each (every residue mod 4 near it)."""
  geo = np.unique(np.geomspace(65, max(65, top), 30).astype(np.int64))
  pts = np.unique(np.concatenate([np.arange(1, 65), *(geo + k for k in range(4))]))
  return pts[pts <= top]


def _holds(text_lhs: str, op: str, text_rhs: str, fam, bounds: dict) -> tuple | None:
  """``(var indices, tops)`` when ``lhs OP rhs`` holds at every size checked (one variable:
  all of ``lo..top``; several: a grid of :func:`_sizes_of` each, at most GRID_POINTS); None
  when it fails somewhere, or names sizes the family does not have."""
  order = fam.sig.var_order
  names = sorted(_symbolic.dim_vars_of(text_lhs) | _symbolic.dim_vars_of(text_rhs))
  if not names or not set(names) <= set(order):
    return None
  axes, idx, tops = [], [], []
  for v in names:
    i = order.index(v)
    lo, top = bounds.get(i, (1, math.inf))[0], _top(fam, i, bounds)
    pts = np.arange(lo, top + 1) if len(names) == 1 else _sizes_of(top)
    axes.append(pts[pts >= lo])
    idx.append(i)
    tops.append(top)
  if math.prod(len(a) for a in axes) > GRID_POINTS:
    rng = np.random.default_rng(0)
    grid = [rng.choice(a, GRID_POINTS) for a in axes]
  else:
    grid = [g.ravel() for g in np.meshgrid(*axes, indexing="ij")]
  try:
    a, b = _symbolic.dim_fn([text_lhs, text_rhs], names, arrays=True)(*grid)
    ok = bool(np.all(_OPS[op](a, b)))
  except Exception:  # noqa: BLE001 - text we cannot evaluate
    return None
  return (idx, tops) if ok else None


def needed_facts(fam, e: BaseException, bounds: dict) -> list[tuple]:
  """``(constraint, lhs, op, rhs, (var indices, tops))`` of what the failed trace ``e`` needed and every size checked
  satisfies: a comparison JAX found inconclusive over several sizes (a ViT's patch grid
  ``floordiv(h - 4, 4)*floordiv(w - 4, 4) + ... + 1 >= 0`` when flattened by ``reshape(n, h *
  w, c)``), or over one size that holds at all of them (no guard splits it); or the
  remainder of a reshape JAX could not prove 0 (Swin's ``window_reverse`` after padding to a
  multiple of the window as ``(ws - h % ws) % ws``), or the sign of the divisor of its ``-1``
  (JAX's "Possible division by 0")."""
  seen, out = set(), []
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text = str(e)
    m = _INCONCLUSIVE.search(text)
    if m is not None:
      lhs, op, rhs = (g.strip() for g in m.groups())
      for o in (op, _NOT[op]):  # true at every size checked, or false at every one
        found = _holds(lhs, o, rhs, fam, bounds)
        if found is not None:
          c = {">": f"{lhs} >= {rhs} + 1", "<": f"{lhs} <= {rhs} - 1"}.get(o, f"{lhs} {o} {rhs}")
          out.append((c, lhs, o, rhs, found))
          break
      return out
    m = _DIVISOR.search(text)
    if m is not None:  # a reshape's -1 divides by the other dims' product: its sign
      div = m.group(1).strip()
      for c, op, rhs in ((f"{div} >= 1", ">=", "1"), (f"{div} <= -1", "<=", "-1")):
        found = _holds(div, op, rhs, fam, bounds)
        if found is not None:
          out.append((c, div, op, rhs, found))
          break
      return out
    m = _REMAINDER.search(text)
    if m is not None:
      rem = m.group(1).strip()
      found = _holds(rem, "==", "0", fam, bounds)
      if found is not None:
        out.append((f"{rem} == 0", rem, "==", "0", found))
      return out
    e = e.__cause__ or e.__context__
  return out


def add_facts(fam, e: BaseException, bounds: dict) -> bool:
  """Re-trace under the facts :func:`needed_facts` finds in ``e``; each also checked on every
  call (``Family.declared``) and at each bucket (``held_bucket``: a grid is not every size)."""
  found = [f for f in needed_facts(fam, e, bounds) if f[0] not in fam._identities]
  return bool(found) and _adopt(fam, found, bounds, "inferred: holds at every size checked")


def _dims_of(jaxpr, out: set) -> None:
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      for d in getattr(v.aval, "shape", ()):
        if _symbolic.is_symbolic(d):
          out.add(d)
    for p in eqn.params.values():
      for sub in (p if isinstance(p, tuple | list) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _dims_of(inner, out)


GUARD_BUDGET_S = 10.0  # seconds of re-tracing under inferred guards and facts, a family


def over_budget(fam) -> bool:
  """Whether the family has spent :data:`GUARD_BUDGET_S` since its first inferred guard: then
  it stops inferring (and falls back).  Each re-trace under more rules can cost more (a full
  Swin's nested window sizes: JAX's symbolic comparisons grow with the expressions), and a
  user waits on them."""
  t0 = getattr(fam, "_guard_t0", None)
  if t0 is None:
    fam._guard_t0 = time.perf_counter()
    return False
  return time.perf_counter() - t0 > GUARD_BUDGET_S


def add_constant_dims(fam, closed) -> bool:
  """Rules for the dims of a traced jaxpr that are one constant at every size checked although
  JAX cannot simplify them (Swin's ``window_reverse`` reshapes to ``(-1, hp, wp, c)`` after
  a ``-1``: its channels come out as ``- floordiv(48*b*..., - b*...)``, 3 at every size): the
  padding pass needs dims it can bound.  Only dims with a ``floordiv``/``mod`` by a symbolic
  divisor are checked (none in most models).  True when the family should re-trace."""
  if not getattr(fam.ctx, "checks_guards", False) or not fam._identities or over_budget(fam):
    return False  # (only after a rule: a -1's divisor that a fact made provable)
  try:
    dims: set = set()
    _dims_of(closed.jaxpr, dims)
    bounds = {j: (lo, hi) for j, lo, hi in fam._guard_bounds}
    found = []
    for d in sorted(dims, key=str):
      text = str(d)
      if not _symbolic_divisor(text):
        continue
      names = sorted(_symbolic.dim_vars_of(text))
      fn = _symbolic.dim_fn([text], names)
      at_one = fn(*([1] * len(names)))[0]
      rule = _rule(text, str(at_one))
      if rule is None or rule in fam._identities or any(  # a quick look before the grid
          fn(*s)[0] != at_one for s in _PROBE_SIZES[len(names)]):
        continue
      held = _holds(text, "==", str(at_one), fam, bounds)
      if held is not None:
        found.append((rule, text, "==", str(at_one), held))
    return bool(found) and _adopt(fam, found, bounds, "inferred: one size at every size checked")
  except Exception:  # noqa: BLE001 - a dim we cannot read: trace as it is
    return False


_DIV = re.compile(r"\b(floordiv|mod)\(")


_PROBE_SIZES = {k: [tuple(int(v) for v in row) for row in
                    np.random.default_rng(k).integers(1, 300, size=(16, k))] for k in range(1, 9)}


def _symbolic_divisor(text: str) -> bool:
  """Whether ``text`` has a ``floordiv``/``mod`` whose divisor names a variable."""
  for m in _DIV.finditer(text):
    depth, comma = 0, None
    for j in range(m.end(), len(text)):
      ch = text[j]
      if ch == "(":
        depth += 1
      elif ch == ")":
        if depth == 0:
          if comma is not None and re.search(r"[A-Za-z_]", text[comma:j]):
            return True
          break
        depth -= 1
      elif ch == "," and depth == 0:
        comma = j
  return False


MAX_RULE_CHARS = 400  # a longer constraint is not adopted: JAX's symbolic comparisons under
# it can take minutes a trace (a full Flax Swin's second stage: ~1,500-character remainders)


def _adopt(fam, found, bounds: dict, origin: str) -> bool:
  """Adds ``found`` (``(constraint, lhs, op, rhs, (var indices, tops))``) to the family's
  constraints and per-call and per-bucket checks; the variables bounded by their tops."""
  found = [f for f in found if len(f[0]) <= MAX_RULE_CHARS]
  if not found:
    return False
  for _, _, _, _, (idx, tops) in found:
    for i, top in zip(idx, tops, strict=True):
      lo, hi = bounds.get(i, (1, math.inf))
      bounds[i] = (lo, min(hi, top))
  rules = fam._identities + tuple(dict.fromkeys(f[0] for f in found))
  return _commit(fam, rules, bounds, [f[:4] for f in found], origin, per_bucket=True)


def _commit(fam, rules: tuple, bounds: dict, checks, origin: str, per_bucket: bool) -> bool:
  """The family re-signed under ``rules`` and the guard ``bounds``; ``checks`` (``(text, lhs,
  op, rhs)``, expression texts) checked per call (``Family.declared``) and, ``per_bucket``,
  at each bucket (``_guards.held_bucket``).  False where jax refuses the constraints."""
  order = fam.sig.var_order
  guards = guard_texts(order, bounds)
  try:
    sig = _signature(fam, guards + rules)
  except Exception:  # noqa: BLE001 - jax refuses it (an equality whose left side is no term)
    return False
  fam.sig, fam._identities, fam.guards = sig, rules, guards + rules
  fam._guard_bounds = tuple((j, lo, hi) for j, (lo, hi) in sorted(bounds.items()))
  compiled = tuple((f"{text} ({origin})", _symbolic.compile_dim(lhs, order), op,
                    _symbolic.compile_dim(rhs, order)) for text, lhs, op, rhs in checks)
  fam.declared = fam.declared + compiled
  if per_bucket:
    fam._bucket_checks = getattr(fam, "_bucket_checks", ()) + compiled
  logger.info("dynjax: %s traces under the inferred rules %s", fam.name, rules)
  return True
