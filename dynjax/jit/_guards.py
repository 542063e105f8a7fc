"""Guards: size conditions a family infers while tracing (:func:`add_guard`).

Where symbolic tracing needs a comparison it cannot decide (``lax.top_k(x, 3)`` asks whether
``t < 3``), the family decides it as torch.compile's guards do: it assumes the side that holds
for more of the sizes the policy allows, re-traces under that constraint and checks it on every
call.  This module reads the comparison out of jax's error and writes the constraints.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import re
import warnings

import numpy as np

from dynjax import _symbolic
from dynjax._errors import user_stacklevel

logger = logging.getLogger("dynjax")
MAX_GUARDS = 8  # re-traces under inferred guards per family; one more falls back

_INCONCLUSIVE = re.compile(
    r"Symbolic dimension comparison '([^']+)' (<=|>=|<|>) '([^']+)' is inconclusive")
_VAR_PLUS = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?: ([+-]) (\d+))?$")
_INT = re.compile(r"^-?\d+$")
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


# The advice where a dynamic size went where an integer is needed (a hint below, and a NumPy
# call on the failing line: trace_failure_hint).
SIZE_AS_INTEGER = (
    "a dynamic size (x.shape[i]) went where Python or NumPy need an integer (range(t), "
    "np.ones(t), np.arange(t), a NumPy array sliced by it as table[:t]): NumPy cannot make an "
    "array of a symbolic size, so write that part with jax.numpy (jnp.ones(t), jnp.arange(t), "
    "jnp.asarray(table)[:t]) and a loop over t with lax.fori_loop or lax.scan, or give that "
    "axis an integer in dims if it never varies")
# What to do about the symbolic-shape limits of JAX that public code meets most (found by
# probing public idioms under padding="auto", session 17): a substring of JAX's message ->
# the advice appended to the fallback reason.
TRACE_FAILURE_HINTS = (
    ("associative scan over axis of non-constant size",
     "jax.lax.associative_scan needs a static length along its axis: dynjax binds it as a "
     "bucketed primitive unless fn has effects (jax.debug.print, callbacks) or the function "
     "is reached other than by a module's name (a default argument, a closure cell); a "
     "jax.lax.scan over that axis traces with a dynamic length and is bucketed too"),
    ("used in a context that requires a constant",
     "the function uses a dynamic size where JAX needs a constant (int(), range(), a NumPy "
     "array of that size, jax.random.choice(key, n) with n a length (pass jnp.arange(n)), or "
     "an op whose lowering depends on the length; jnp.searchsorted, digitize, isin and interp "
     "into a dynamic-length array are bucketed): give that axis an integer in dims if it never "
     "varies, or compute that part with ops that accept a symbolic size"),
    ("Cannot divide evenly the sizes of shapes",
     "JAX cannot prove the reshape's divisibility: a length padded to a multiple of k as "
     "t + (-t % k) (jnp.pad(x, (0, -t % k))) is not known to divide by k, but one padded to "
     "-(-t // k) * k is: write the padding that way and the reshape traces"),
    # Python and NumPy ask a symbolic size for ``__index__`` (session 24: openai/whisper's
    # ``sinusoids(n_ctx, d)[:x.shape[1]]`` as a NumPy table; ``range(t)``, ``np.ones(t)``)
    ("cannot be interpreted as an integer", SIZE_AS_INTEGER),
    ("slice indices must be integers", SIZE_AS_INTEGER),
)
_NUMPY_CALL = re.compile(r"(?<![\w.])(np|numpy)\.")  # np.ones(...), not jnp.ones(...)


def trace_failure_hint(e: BaseException) -> str:
  """``" at <file:line (code)>"`` (the innermost frame of the failure outside jax, NumPy, the
  standard library and dynjax; where that is an installed library's, such as flax's, also
  ``", called from <file:line (code)>"``: the innermost frame outside every installed package,
  the user's own line) and ``"; <advice>"`` for a symbolic-tracing failure
  :data:`TRACE_FAILURE_HINTS` knows (appended to the fallback reason)."""
  text = str(e)
  hint = next((hint for key, hint in TRACE_FAILURE_HINTS if key in text), None)
  frame = _user_frame(e)
  where = ""
  if frame is not None:
    code = " ".join((frame.line or "").split())
    where = f" at {_frame_text(frame)}"
    if frame.filename.startswith(_installed_dirs()):
      caller = _user_frame(e, _installed_dirs())
      if caller is not None:
        where += f", called from {_frame_text(caller)}"
    if hint is None and _NUMPY_CALL.search(code):  # np.arange(t) fails inside jax's tracer
      hint = SIZE_AS_INTEGER
  return where + (f"; {hint}" if hint else "")


def _frame_text(frame) -> str:
  code = " ".join((frame.line or "").split())
  return f"{frame.filename}:{frame.lineno}" + (f" ({code[:100]})" if code else "")


@functools.cache
def _installed_dirs() -> tuple[str, ...]:
  """The folders installed packages live in (site-packages), each ending in a separator."""
  import os
  import site
  import sysconfig

  paths = sysconfig.get_paths()
  dirs = {paths.get("purelib"), paths.get("platlib")}
  try:
    dirs.update(site.getsitepackages())
  except AttributeError:  # virtualenv's old site module
    pass
  return tuple(os.path.join(d, "") for d in sorted(x for x in dirs if x))


def _library_dirs() -> tuple[str, ...]:
  import os
  import sysconfig

  import jax
  import jaxlib

  import dynjax

  dirs = [os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, dynjax, np)]
  stdlib = sysconfig.get_paths().get("stdlib")
  if stdlib:
    dirs.append(os.path.join(stdlib, ""))
  return tuple(dirs)


def _user_frame(e: BaseException, skip: tuple[str, ...] = ()):
  """The innermost traceback frame of ``e`` outside jax, jaxlib, NumPy, dynjax, the
  standard library and the folders in ``skip`` (the user's line, or a library's of their own
  such as flax or optax)."""
  import traceback

  try:
    frames = traceback.extract_tb(e.__traceback__)
  except Exception:  # noqa: BLE001 - only for a message
    return None
  internal = _library_dirs() + skip
  for f in reversed(frames):
    if not f.filename.startswith(internal) and not f.filename.startswith("<"):
      return f
  return None


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
  integer, or is over one variable and flips once in 1..:data:`SPLIT_SCAN` (:func:`_split`):
  the comparison holds for sizes on one side of ``split`` (``var < split`` or ``var >=
  split``).  None for anything else (two variables, no single flip, other errors)."""
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
        return _split(lhs, op, rhs)
      # var + c OP k  <=>  var OP k - c
      k = int(rhs) - (int(v.group(3)) if v.group(2) == "+" else -int(v.group(3) or 0))
      return v.group(1), (k if op in ("<", ">=") else k + 1)
    e = e.__cause__ or e.__context__
  return None


SPLIT_SCAN = 4096  # sizes at which a one-variable comparison is evaluated (~2 ms)
_CMP = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def _split(lhs: str, op: str, rhs: str) -> tuple[str, int] | None:
  """``(var, split)`` of ``lhs OP rhs`` over one variable whose truth flips exactly once for
  sizes 1..SPLIT_SCAN, else None.  A reduction without identity over a strided conv's
  output (Keras's ``Conv1D(7, strides=3)`` twice, then ``GlobalMaxPooling1D``: ``jnp.max``
  asks ``max(floordiv(max(floordiv(t - 7, 3) + 1, 0) - 7, 3) + 1, 0) >= 1``).  The guard
  only constrains the re-trace: jax itself decides the comparison under it (or fails again,
  and the family runs exact), and every call checks it."""
  names = _symbolic.dim_vars_of(lhs) | _symbolic.dim_vars_of(rhs)
  if len(names) != 1:
    return None
  try:
    fn, cmp = _symbolic.dim_fn([lhs, rhs], tuple(names)), _CMP[op]
    holds = [cmp(*fn(n)) for n in range(1, SPLIT_SCAN + 1)]
  except Exception:  # noqa: BLE001 - text jax's printer made that we cannot evaluate
    return None
  flips = [n for n in range(1, SPLIT_SCAN) if holds[n] != holds[n - 1]]  # holds[n]: size n+1
  return (names.pop(), flips[0] + 1) if len(flips) == 1 else None


def capped_size(e: BaseException | None, var_order) -> tuple[str, int] | None:
  """``(var, c)`` from the first ``min(c, var)`` (or ``min(var, c)``) in the messages of an
  exception chain, ``var`` one of ``var_order``: a static table sliced by a length
  (``causal_mask[:, :, :t, :t]`` of a ``max_positions`` mask, ``pos_emb[:t]``) is
  ``min(c, t)`` long, and the trace fails where it meets the ``t`` of the inputs.  Only in
  such a clash of shapes ("incompatible shapes/types"): a ``min(2, t)`` in another failure
  (an inconclusive comparison about ``x[:, 2::2]``) says nothing of ``t <= 2``."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text = str(e)
    if any(w in text.lower() for w in _CLASH):
      for m in _MIN_CONST.finditer(text):
        var, c = (m.group(2), m.group(1)) if m.group(1) is not None else m.group(3, 4)
        if var in var_order:
          return var, int(c)
    e = e.__cause__ or e.__context__
  return None


# JAX's words where two shapes that should agree do not ("add got incompatible shapes for
# broadcasting", "Incompatible types for broadcasting", dot_general's "... to have the same
# shape, got (min(128, t), 8) and (t, 8)": HF Flax RoFormer's sinusoidal table; a transpose's
# "Expected cotangent type float32[b,x,4] but got float32[b,y,4]")
_CLASH = ("incompatible", "same shape", "mismatch", "but got")
_MIN_CONST = re.compile(r"\bmin\((-?\d+), ([A-Za-z_]\w*)\)|\bmin\(([A-Za-z_]\w*), (-?\d+)\)")


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
  if not _CALL.match(core):
    return None
  if c == 0:
    return f"{core} == {rhs_text}"
  return f"{core} == {rhs_text} {'-' if c > 0 else '+'} {abs(c)}"


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
  out, seen = [], set()
  order = fam.sig.var_order
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text = str(e)
    if any(w in text.lower() for w in _CLASH):
      groups = _shape_groups(text)
      for a, b in zip(groups, groups[1:], strict=False):
        if len(a) != len(b):
          continue
        for x, y in zip(a, b, strict=True):
          names = _symbolic.dim_vars_of(x) | _symbolic.dim_vars_of(y)
          if x == y or len(names) != 1 or not names <= set(order):
            continue
          var = names.pop()
          i = order.index(var)
          lo, hi = bounds.get(i, (1, math.inf))
          pol = fam.ctx.policies.for_var(var)
          top = pol.max if pol.max is not None and fam.ctx.opts.overflow != "grow" else None
          top = min(hi, top if top is not None else IDENTITY_SCAN)
          rules = tuple(r for r in (_rule(x, y), _rule(y, x)) if r)
          m = _equal_sizes(x, y, var, lo, int(top)) if rules and top >= lo else None
          if m is not None:
            out.append((rules, i, int(top), x, y, m))
      if out:
        return out
    e = e.__cause__ or e.__context__
  return out


def capped_bucket(fam, bkey: tuple) -> tuple:
  """``bkey`` with each variable at most its ``var <= c`` guard from ``min(c, var)``: the
  executables were traced for sizes up to ``c`` (``min(c, t)`` is ``t`` only there), so a
  larger bucket does not hold the trace; ``c`` serves as that variable's bucket (a call of
  ``t <= c`` whose policy bucket is past ``c`` runs at ``c``).  A guard from a comparison
  (``if t >= 4``) decides a branch by the true size, which any larger bucket keeps."""
  for i, m in fam._moduli:  # an identity of multiples of m: buckets at multiples of m
    if bkey[i] % m:
      bkey = bkey[:i] + (bkey[i] + m - bkey[i] % m,) + bkey[i + 1:]
  for i, c in fam._size_caps:
    if bkey[i] > c:
      bkey = bkey[:i] + (c,) + bkey[i + 1:]
  return bkey


def add_guard(fam, e: BaseException) -> bool:
  """Adds the guard that decides the comparison ``e`` found inconclusive, or ``var <= c``
  where ``e`` met ``min(c, var)`` (:func:`capped_size`); False when there is none to add
  (not such an error, not ``var OP const``, too many, or no progress)."""
  # Only a dispatcher that checks ``guard_ok`` on every call may run guarded executables.
  if not getattr(fam.ctx, "checks_guards", False):
    return False
  bounds = {j: (lo, hi) for j, lo, hi in fam._guard_bounds}
  cmp = inconclusive_comparison(e)
  if cmp is None:
    cap = capped_size(e, fam.sig.var_order)
    if cap is None:
      return _add_identities(fam, e, bounds)
    i = fam.sig.var_order.index(cap[0])
    lo, hi = bounds.get(i, (1, math.inf))
    new = (lo, min(hi, cap[1]))
  elif cmp[0] not in fam.sig.var_order:
    return False
  else:
    var, split = cmp  # the sizes of ``var`` split into [1, split - 1] and [split, ...)
    pol = fam.ctx.policies.for_var(var)
    top = pol.max if fam.ctx.opts.overflow != "grow" else None
    i = fam.sig.var_order.index(var)
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
  guards = guard_texts(fam.sig.var_order, bounds) + fam._identities
  try:
    sig = _signature(fam, guards)
  except Exception:  # noqa: BLE001 - jax refuses the constraint: no guard, run exact
    return False
  fam.sig = sig
  fam.guards = guards
  if cmp is None:  # a cap: its buckets stop at c (capped_bucket)
    fam._size_caps = tuple(sorted({**dict(fam._size_caps), i: new[1]}.items()))
  fam._guard_bounds = tuple((j, lo, hi) for j, (lo, hi) in sorted(bounds.items()))
  logger.info("dynjax: %s traces under the inferred guards %s", fam.name, guards)
  return True


def _add_identities(fam, e: BaseException, bounds: dict) -> bool:
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
    for r in cands:
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
  found, rules = new, tuple(rules)
  sig = _signature(fam, guard_texts(order, bounds) + rules)
  fam.sig, fam._identities, fam._moduli = sig, rules, tuple(sorted(moduli.items()))
  fam.guards = guard_texts(sig.var_order, bounds) + rules
  fam._guard_bounds = tuple((j, lo, hi) for j, (lo, hi) in sorted(bounds.items()))
  # Checked per call from the two texts as jax printed them: parsed in the new scope, its
  # rule would make them one expression.
  fam.declared = fam.declared + tuple(
      (f"{x} == {y} (inferred: two shapes of one size)", _symbolic.compile_dim(x, order), "==",
       _symbolic.compile_dim(y, order)) for _, _, _, x, y, _ in found)
  logger.info("dynjax: %s traces under the inferred shape identities %s", fam.name, rules)
  return True


def _signature(fam, guards: tuple[str, ...]):
  """The family's signature with ``guards`` added to its constraints (same specs)."""
  specs = [(path, None if spec is None else spec.text, len(aval.shape))
           for path, spec, aval in zip(fam.leaf_paths, fam.sig.leaves, fam.avals,
                                       strict=True)]
  texts = [text for _, text, _ in specs]
  return _symbolic.build_signature(specs, fam._constraints(texts) + guards)


def equality_guards(fam, equalities) -> str | None:
  """Guards ``lhs != rhs`` for the equalities of symbolic dims that the traced code evaluated
  and jax answered False without deciding (``if x.shape[1] == 5:``; ``_jax_private.
  undecided_equalities``): the trace holds only for sizes where they differ, so the family
  checks that on every call and runs the others exact.  Returns a fallback reason when one
  cannot be checked (its expression does not compile), else None."""
  unequal, seen = [], set()
  for lhs, rhs, where in equalities:
    text = f"{lhs} != {rhs}"
    if text in seen:
      continue
    seen.add(text)
    try:
      diff = _symbolic.compile_dim(lhs - rhs, fam.sig.var_order)
    except Exception as e:  # noqa: BLE001 - an expression we cannot evaluate: run exact
      return (f"the function compares {lhs} == {rhs} at {where}, which symbolic tracing "
              f"cannot decide and dynjax cannot check per call ({type(e).__name__}: {e})")
    unequal.append((text, diff, where))
  fam._unequal = tuple(unequal)
  fam.guards = fam.guards + tuple(text for text, _, _ in unequal)
  logger.info("dynjax: %s traced %s as unequal: checked on every call", fam.name,
              ", ".join(f"{text} ({where})" for text, _, where in unequal))
  return None


def trust_bucket_holds(fam, bkey) -> bool:
  """Whether ``padding="trust"``'s trace at the bucket's sizes takes the side the symbolic trace
  took (it re-runs the Python there): every ``lhs != rhs`` guard holds at ``bkey`` too.
  Warns once per family when not (such calls run exact)."""
  bad = [(text, where) for text, diff, where in fam._unequal if diff(bkey) == 0]
  if not bad:
    return True
  if not fam._warned_trust_bucket:
    fam._warned_trust_bucket = True
    at = ", ".join(f"{v} = {n}" for v, n in zip(fam.sig.var_order, bkey, strict=True))
    warnings.warn(
      f"dynjax.jit({fam.name}): the bucket {at} breaks the guard(s) "
      f"{', '.join(f'{t} ({w})' for t, w in bad)}: padding='trust' re-runs the function at "
      "the bucket's sizes, where it would take the other side, so calls in that bucket run "
      "unpadded, one compile per shape. Fix: padding='auto', or buckets that keep the guard",
      stacklevel=user_stacklevel())
  return False


_RELATION = re.compile(r"^(.*?)(>=|<=|==)(.*)$")


def declared_checks(constraints, sig, origin: str = "constraints=") -> tuple:
  """``(text, lhs(sizes), op, rhs(sizes))`` of each ``constraints=[...]`` the user gave that
  names only the family's dimension variables (``text`` labelled by ``origin``; also the
  rules :func:`unify_shapes` infers).  The padded executables were traced under them (jax
  decides comparisons with them), so they are guards too: sizes outside them run exact
  (``Family.guard_ok``), as jax.export would refuse them."""
  from jax import export  # noqa: PLC0415

  out = []
  for text in constraints:
    m = _RELATION.match(text)
    if m is None:
      continue
    try:
      lhs, rhs = (export.symbolic_shape(side.strip(), scope=sig.scope)[0]
                  for side in (m.group(1), m.group(3)))
      out.append((f"{text} ({origin})", _symbolic.compile_dim(lhs, sig.var_order), m.group(2),
                  _symbolic.compile_dim(rhs, sig.var_order)))
    except Exception:  # noqa: BLE001 - other variables (no spec names them): nothing to check
      continue
  return tuple(out)


_HOLDS = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


def broken_declared(fam, sizes) -> list[str]:
  """The ``constraints=[...]`` (the user's, and inferred rules) that true ``sizes`` break
  (none: ``[]``), each labelled by where it came from."""
  return [text for text, lhs, op, rhs in fam.declared if not _HOLDS[op](lhs(sizes), rhs(sizes))]
