"""Guards: size conditions a family infers while tracing (:func:`add_guard`).

Where symbolic tracing needs a comparison it cannot decide (``lax.top_k(x, 3)`` asks whether
``t < 3``), the family decides it as torch.compile's guards do: it assumes the side that holds
for more of the sizes the policy allows, re-traces under that constraint and checks it on every
call.  This module reads the comparison out of jax's error and writes the constraints.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import re
import warnings

import numpy as np

from dynjax import _symbolic
from dynjax._errors import PaddingFallbackError, user_stacklevel
from dynjax.jit import _facts
from dynjax.jit._facts import (  # noqa: F401 - re-exported
  _CLASH,
  _signature,
  add_constant_dims,
  guard_texts,
)

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
     "JAX cannot prove the reshape's divisibility, and dynjax found lengths where it fails "
     "(a remainder that is 0 at every length it checks becomes a checked constraint): pad to "
     "the multiple the reshape divides by; a length padded to -(-t // k) * k is known to "
     "divide by k"),
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


_MIN_CONST = re.compile(r"\bmin\((-?\d+), ([A-Za-z_]\w*)\)|\bmin\(([A-Za-z_]\w*), (-?\d+)\)")


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


def held_bucket(fam, bkey: tuple) -> tuple | None:
  """``capped_bucket``, or None (run exact) where the bucket breaks a fact the family checked
  over a grid of sizes only (``_facts.add_facts``): the padded program is traced under it."""
  bkey = capped_bucket(fam, bkey)
  for _, lhs, op, rhs in getattr(fam, "_bucket_checks", ()):
    if not _HOLDS[op](lhs(bkey), rhs(bkey)):
      return None
  return bkey


def add_guard(fam, e: BaseException) -> bool:
  """Adds the guard that decides the comparison ``e`` found inconclusive, or ``var <= c``
  where ``e`` met ``min(c, var)`` (:func:`capped_size`); False when there is none to add
  (not such an error, not ``var OP const``, too many, or no progress)."""
  # Only a dispatcher that checks ``guard_ok`` on every call may run guarded executables.
  if not getattr(fam.ctx, "checks_guards", False) or _facts.over_budget(fam):
    return False
  bounds = {j: (lo, hi) for j, lo, hi in fam._guard_bounds}
  cmp = inconclusive_comparison(e)
  if cmp is None:
    cap = capped_size(e, fam.sig.var_order)
    if cap is None:
      return (_facts.add_identities(fam, e, bounds) or _facts.add_clash_facts(fam, e, bounds)
              or _facts.add_facts(fam, e, bounds))
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


_HOLDS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt,
          "<": operator.lt}


def broken_declared(fam, sizes) -> list[str]:
  """The ``constraints=[...]`` (the user's, and inferred rules) that true ``sizes`` break
  (none: ``[]``), each labelled by where it came from."""
  return [text for text, lhs, op, rhs in fam.declared if not _HOLDS[op](lhs(sizes), rhs(sizes))]


def outside_guards(fam, sizes) -> None:
  """Call before running ``sizes`` of ``fam`` (with ``fam.guard_ok(sizes)`` False) exact:
  raises ``PaddingFallbackError`` under ``on_fallback="error"``, else warns once a family."""
  names = fam.sig.var_order
  bad = list(guard_texts(names, {i: (lo, hi) for i, lo, hi in fam._guard_bounds
                                 if not lo <= sizes[i] <= hi}))
  bad += [f"{text} ({where})" for text, diff, where in fam._unequal if diff(sizes) == 0]
  bad += broken_declared(fam, sizes)  # labelled: constraints=, or inferred
  at = ", ".join(f"{v} = {n}" for v, n in zip(names, sizes, strict=True))
  what = (f"dynjax.jit({fam.name}): sizes {at} violate the guard(s) {', '.join(bad)} "
          "inferred while tracing")
  if fam.ctx.opts.on_fallback == "error":
    raise PaddingFallbackError(
        f"{what}, and on_fallback='error' refuses to run them unpadded (one compile per "
        f"shape). Fix: keep {', '.join(bad)}, or pass constraints=[...] that decide the "
        "comparison the other way, or on_fallback='warn'") from None
  if not fam._warned_guards:
    fam._warned_guards = True
    warnings.warn(f"{what}: such calls run unpadded, one compile per shape",
                  stacklevel=user_stacklevel())


def plan_buckets(fam, bkey, limit: int) -> list[tuple]:
  """Up to ``limit`` bucket tuples the policies plan now, for calls like one of bucket ``bkey``
  (dims without a declared max keep ``bkey``'s size), largest first."""
  if fam.joint is not None:
    return []
  axes = []
  for p, b in zip(fam.policies, bkey, strict=True):
    try:
      sizes = (b,) if p.max is None else tuple(p.sizes())
    except Exception:  # noqa: BLE001 - a policy that cannot list its sizes yet
      sizes = (b,)
    axes.append(sorted(sizes, reverse=True))
  return list(itertools.islice(dict.fromkeys(  # each at most its guards' caps, once
      capped_bucket(fam, b) for b in itertools.product(*axes)), limit))


def top_bucket(fam, bkey) -> tuple:
  """The bucket that covers every size of the declared ranges, for a call of bucket ``bkey``:
  the largest bucket of each dim with a declared max, ``bkey``'s own size along a dim without
  one (an undeclared batch dim ``b`` must not leave the sequence dim ``t`` uncovered: a server
  whose first request is short would otherwise wait again for the first long one)."""
  return capped_bucket(fam, tuple(b if p.max is None else max(b, p.sizes()[-1])
                                 for p, b in zip(fam.policies, bkey, strict=True)))
