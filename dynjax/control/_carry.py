"""What every loop front end needs to know about a carry: paths, structure, which axes change.

A ``while_loop`` carry is a pytree of arrays whose sizes may change along some axes.  The
hoisted loop (``_loopspec.py``), the host-mode loop (``_hostloop.py``), the staged loop and the
staged cond (``_loop.py``/``_cond.py`` rules) all ask the same questions here: the keypath of
each leaf (for messages), whether the body keeps dtypes and ranks, which axes change between a
carry and the body's result -- axes that change *alike* (same size in, same size out) share one
name -- and the axes a ``dims=`` spec names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dynjax import _jax_private as jp
from dynjax import _symbolic
from dynjax._errors import ControlFlowError, OutOfBucketsError, format_list
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.control._frontend import building

DEFAULT_POLICY = pow2(min=16)

# The last loop run of this process: what ``dynjax.control.loop_stats()`` reports.  Hoisted
# loops keep their in-progress counters under "info", every loop its summary under "loop".
LAST_RUN: dict = {}

_IDENT = re.compile(r"[A-Za-z_]\w*")
_OFFSET = re.compile(r"([A-Za-z_]\w*)\s*([+-])\s*(\d+)")


def keypaths(treedef) -> list[str]:
  dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  return [("init" + jax.tree_util.keystr(p)) for p, _ in
          jax.tree_util.tree_flatten_with_path(dummy)[0]]


def flat_fns(cond_fun, body_fun, treedef):
  """``cond_fun``/``body_fun`` as functions of the carry's flat leaves."""
  def body_flat(*leaves):
    out = body_fun(jax.tree_util.tree_unflatten(treedef, leaves))
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    if out_tree != treedef:
      raise structure_error("body_fun", treedef, out_tree)
    return out_leaves

  def cond_flat(*leaves):
    return cond_fun(jax.tree_util.tree_unflatten(treedef, leaves))

  return cond_flat, body_flat


def structure_error(what: str, treedef, out_tree) -> ControlFlowError:
  """The carry's structure changed: the two structures and which paths differ."""
  def paths(td):
    dummy = jax.tree_util.tree_unflatten(td, [0] * td.num_leaves)
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]

  a, b = paths(treedef), paths(out_tree)
  lines = [f"result{p}: not in init" for p in b if p not in a]
  lines += [f"init{p}: missing from the result" for p in a if p not in b]
  if not lines:  # same paths, other containers (a tuple returned as a list, a None leaf)
    lines = [f"containers differ: init is {treedef}, the result {out_tree}"]
  return ControlFlowError(
      f"{what} must return a carry with the structure of init (expected {treedef}, got "
      f"{out_tree}):\n" + format_list(lines) + "\nReturn the same containers with the same "
      "keys every iteration (e.g. a tuple, not a list; keep a leaf that may be unused as an "
      "array, not None).")


def trace_error(what: str, e: Exception) -> ControlFlowError | None:
  """The explanation of a trace failure of a loop's body or cond, or None.

  Shapes that depend on data and Python comparisons of symbolic dims are dynjax's to explain
  (a :class:`ControlFlowError`).  Anything else -- the user's own ``KeyError``, an
  ``assert``, a shape error of their code -- is not: the caller re-raises it unchanged (only
  a note says where dynjax was), so ``except KeyError`` around a ``while_loop`` works.
  """
  first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  if isinstance(e, jax.errors.ConcretizationTypeError | jax.errors.TracerBoolConversionError
                | jax.errors.TracerIntegerConversionError | jax.errors.NonConcreteBooleanIndexError):
    return ControlFlowError(
        f"{what} makes a shape depend on data values ({type(e).__name__}: {first}). "
        "dynjax.while_loop needs every carry dim to be a function of the carry's dims (e.g. "
        "t + 1), not of array contents; give such ops a static size (jnp.nonzero(x, size=n)), "
        "or move the data-dependent part into cond_fun.")
  if type(e).__name__ == "InconclusiveDimensionOperation":
    return exact_runs(ControlFlowError(
        f"{what} compares a dynamic carry dim in Python ({first}), itself or in a jnp "
        "function it calls. With shapes that change, dims are symbolic while dynjax traces "
        "the loop: write such a comparison as an array op, e.g. jnp.asarray(x.shape[0]) < 8 "
        "instead of x.shape[0] < 8."))
  note = f"(raised while dynjax.while_loop traced {what} with symbolic carry dims)"
  if note not in getattr(e, "__notes__", ()):
    e.add_note(note)
  return None


def eval_shape_body(body_flat, avals):
  """One abstract step of the body on ``avals`` (errors explained, user errors unchanged)."""
  try:
    with building("while_loop body"):
      return jax.eval_shape(body_flat, *avals)
  except ControlFlowError:
    raise
  except Exception as e:
    err = trace_error("body_fun", e)
    if err is None:
      raise
    raise err from None


def trace_symbolic(part: str, fn, sym_avals):
  """``make_jaxpr`` of the loop's body or cond over symbolic carries, errors named for the user.

  An equality of carry dims that the trace cannot decide (``if q.shape[0] == 0:``, ``if
  q.shape[0]:``; jax answers "not equal" for every size) makes the loop exact (a guard would
  have to hold at every iteration's sizes; ``_jax_private.undecided_equalities``)."""
  try:
    with building(f"while_loop {part}"), jp.undecided_equalities() as undecided:
      closed = jax.make_jaxpr(fn)(*sym_avals)
  except ControlFlowError:
    raise
  except Exception as e:
    err = trace_error(f"{part}_fun", e)
    if err is None:
      raise
    raise err from None
  if undecided:
    lhs, rhs, where = undecided[0]
    raise exact_runs(ControlFlowError(
        f"{part}_fun compares {lhs} == {rhs} at {where}, which the symbolic trace cannot "
        "decide (JAX takes it as unequal at every size). Compare as an array op, e.g. "
        "jnp.asarray(x.shape[0]) == 0 in jnp.where or lax.cond, to have the loop padded."))
  return closed


def check_structure(what, avals_in, outs, treedef, out_tree, paths) -> None:
  """Every leaf keeps its dtype and rank (all problems listed)."""
  if out_tree != treedef:
    raise structure_error(what, treedef, out_tree)
  bad = []
  for p, a, o in zip(paths, avals_in, outs, strict=True):
    if not same_dtype(a.dtype, o.dtype):
      bad.append(f"{p}: dtype {dtype_name(a.dtype)} -> {dtype_name(o.dtype)}")
    if len(a.shape) != len(o.shape):
      bad.append(f"{p}: rank {len(a.shape)} -> {len(o.shape)} (shape {tuple(a.shape)} -> "
                 f"{tuple(o.shape)})")
  if bad:
    raise ControlFlowError(
        f"{what} changes the carry in ways dims cannot express:\n" + format_list(bad)
        + "\nA carry leaf may change its sizes along axes, but not its dtype or rank: cast "
        "the body's result back (x.astype(init's dtype)), start from an init of the result's "
        "dtype, or keep the rank (index or reshape the new axis away).")


def dtype_name(d) -> str:
  """A dtype's name; typed PRNG key dtypes (``key<fry>``) too, which ``jnp.dtype`` refuses."""
  return getattr(d, "name", str(d))


def same_dtype(a, b) -> bool:
  """Dtype equality that holds for numpy dtypes, their names, and extended (key) dtypes."""
  if jax.dtypes.issubdtype(a, jax.dtypes.extended) or jax.dtypes.issubdtype(
      b, jax.dtypes.extended):
    return a == b
  return jnp.dtype(a) == jnp.dtype(b)


def same_dim(a, b) -> bool:
  if _symbolic.is_symbolic(a) or _symbolic.is_symbolic(b):
    return a == b
  return int(a) == int(b)


def changing_axes(shapes_in, shapes_out, share: bool = True) -> tuple[list[tuple], list[str]]:
  """Per leaf per axis the variable name of an axis that changes, else None.

  Axes that change alike (same size in, same size out) share one name, ``n0, n1, ...`` in
  order of appearance (``share=False``: each axis its own).  Returns ``(per leaf, names)``.
  """
  groups: dict[Any, str] = {}
  per_leaf = []
  for li, (si, so) in enumerate(zip(shapes_in, shapes_out, strict=True)):
    per = []
    for ax, (d_in, d_out) in enumerate(zip(si, so, strict=True)):
      key = (str(d_in), str(d_out)) if share else (li, ax)
      name = None if same_dim(d_in, d_out) else groups.setdefault(key, f"n{len(groups)}")
      per.append(name)
    per_leaf.append(tuple(per))
  return per_leaf, list(groups.values())


def carry_vars(shapes_in, shapes_out, named=None, tie: bool = True, share: bool = True
               ) -> tuple[list[tuple], list[str], bool]:
  """The carry's loop variables, for every loop front end: per leaf per axis ``(var, k)``
  (the axis is ``var - k``) or None, the variables, and whether axes were tied.

  With ``named`` (:func:`named_axes`: per leaf per axis a ``dims=`` name, ``t - 1``, or None)
  exactly the named axes are variables, under their user names, in order of appearance.
  Else the axes that change (``shapes_out``: one abstract step), tied by :func:`tied_axes`
  where ``tie`` (``share=False``: no two axes share a variable).  Then :func:`shift_empty`.
  """
  if named is not None:
    per = [tuple(None if t is None else split_offset(t) for t in pl) for pl in named]
    names = list(dict.fromkeys(x[0] for pl in per for x in pl if x is not None))
    tied = False
  else:
    per, names = tied_axes(shapes_in, shapes_out, merge=tie and share, share=share)
    tied = tie and share and len(names) < len(changing_axes(shapes_in, shapes_out)[1])
  return shift_empty(per, shapes_in), names, tied


def shift_empty(per, shapes) -> list[tuple]:
  """``per`` (per leaf per axis ``(var, k)`` or None) where a variable whose own axis (k = 0)
  may start empty is one more than its size (``k + 1`` for each of its axes).

  JAX takes every dim variable to be >= 1, so an empty axis traced as a variable of its own
  would be taken as >= 1 too: ``cache[:, -1:]`` of an empty cache traced as one entry, a
  silently wrong loop.  "May": a size of 0, or a dim not provably >= 1 (an outer loop's
  ``n0 - 1``, :func:`maybe_empty`).
  """
  own: dict[str, Any] = {}
  for pl, shape in zip(per, shapes, strict=True):
    for x, d in zip(pl, shape, strict=True):
      if x is not None and x[1] == 0:
        own.setdefault(x[0], d)
  empty = {v for v, d in own.items() if maybe_empty(d)}
  return [tuple(x if x is None or x[0] not in empty else (x[0], x[1] + 1) for x in pl)
          for pl in per]


def const_diff(a, b) -> int | None:
  """``a - b`` where it is a constant (ints, or dim expressions a constant apart), else None."""
  try:
    d = a - b
  except Exception:  # noqa: BLE001 - dims of other scopes, or other non-numbers
    return None
  return None if _symbolic.is_symbolic(d) else int(d)


def offset_text(name: str, k: int) -> str:
  """The dim ``name - k`` as carry specs and shape functions write it."""
  return name if k == 0 else f"{name} - {k}" if k > 0 else f"{name} + {-k}"


def tied_axes(shapes_in, shapes_out, merge: bool = True, share: bool = True
              ) -> tuple[list[tuple], list[str]]:
  """:func:`changing_axes` where axes that change by the same constant and sit a constant
  apart share one variable: per leaf per axis ``(name, k)`` (the axis is ``name - k``) or None.

  A KV cache one shorter than the tokens (``t - 1`` beside ``t``, both ``+ 1`` a step) is one
  variable, not two that cross their buckets one iteration apart (three buckets for two
  crossings).  The variable is the largest member's size (``k >= 0``), named ``n0, n1, ...`` in
  order of appearance.  Whether the offset holds in every iteration is the caller's to check
  (the body traced on the tied carry must give ``name' - k`` again).  ``merge=False``: every
  variable of :func:`changing_axes` alone (``share``: passed on).
  """
  per, names = changing_axes(shapes_in, shapes_out, share)
  first: dict[str, tuple] = {}  # name -> (size in, size out) of its first axis
  for si, so, pl in zip(shapes_in, shapes_out, per, strict=True):
    for d_in, d_out, n in zip(si, so, pl, strict=True):
      if n is not None:
        first.setdefault(n, (d_in, d_out))
  classes: list[list[str]] = []
  for n in names:
    d_in, d_out = first[n]
    step = const_diff(d_out, d_in)
    for cl in (classes if merge else ()):
      c_in, c_out = first[cl[0]]
      if step is not None and const_diff(c_out, c_in) == step and const_diff(c_in, d_in) \
          is not None:
        cl.append(n)
        break
    else:
      classes.append([n])
  of: dict[str, tuple[str, int]] = {}
  for i, cl in enumerate(classes):
    base = max(cl, key=lambda n: -const_diff(first[cl[0]][0], first[n][0]))
    for n in cl:
      of[n] = (f"n{i}", const_diff(first[base][0], first[n][0]))
  return ([tuple(None if n is None else of[n] for n in pl) for pl in per],
          [f"n{i}" for i in range(len(classes))])


def named_axes(dims, treedef, shapes, paths) -> list[tuple]:
  """Per leaf per axis the name a ``dims=`` spec gives it, else None (every problem listed)."""
  try:
    specs = treedef.flatten_up_to(dims) if treedef.num_leaves != 1 or not isinstance(
        dims, str | type(None)) else [dims]
  except (ValueError, TypeError) as e:
    raise ControlFlowError(f"dims must match the structure of init ({treedef}): {e}") from None
  out, bad = [], []
  for p, s, shape in zip(paths, specs, shapes, strict=True):
    if s is None:
      out.append((None,) * len(shape))
      continue
    parts = [x.strip() for x in s.split(",") if x.strip()]
    if len(parts) != len(shape):
      bad.append(f"{p}: spec {s!r} has {len(parts)} axes, the array has shape {tuple(shape)}")
      out.append((None,) * len(shape))
      continue
    per = []
    for ax, (t, n) in enumerate(zip(parts, shape, strict=True)):
      if t.isdigit():
        if not _symbolic.is_symbolic(n) and int(t) != n:
          bad.append(f"{p}.shape[{ax}]: spec says {t}, got {n}")
        per.append(None)
      elif _IDENT.fullmatch(t) or _OFFSET.fullmatch(t):
        per.append(offset_text(*split_offset(t)))
      else:
        bad.append(f"{p}.shape[{ax}]: {t!r}: a carry axis must be a name, a name plus or "
                   "minus an integer (t - 1), or an integer")
        per.append(None)
    out.append(tuple(per))
  bad += _offset_problems(out, shapes, paths)
  if bad:
    raise ControlFlowError("dims do not fit init:\n" + format_list(bad))
  return out


def split_offset(text: str) -> tuple[str, int]:
  """``"t - 1"`` -> ``("t", 1)``, ``"t + 2"`` -> ``("t", -2)``, ``"t"`` -> ``("t", 0)``."""
  m = _OFFSET.fullmatch(text.strip())
  if m is None:
    return text.strip(), 0
  k = int(m.group(3))
  return m.group(1), k if m.group(2) == "-" else -k


def _offset_problems(named, shapes, paths) -> list[str]:
  """A name used only at an offset, or init sizes that do not fit the offsets dims give."""
  alone: dict[str, tuple] = {}  # name -> (size, where) of its first axis of its own
  for per, shape, p in zip(named, shapes, paths, strict=True):
    for ax, (t, n) in enumerate(zip(per, shape, strict=True)):
      if t is not None and split_offset(t)[1] == 0:
        alone.setdefault(t, (n, f"{p}.shape[{ax}]"))
  bad = []
  for per, shape, p in zip(named, shapes, paths, strict=True):
    for ax, (t, n) in enumerate(zip(per, shape, strict=True)):
      if t is None or split_offset(t)[1] == 0:
        continue
      v, k = split_offset(t)
      if v not in alone:
        bad.append(f"{p}.shape[{ax}]: {t!r}: {v} names no axis by itself; name one axis "
                   f"{v} (its size is read from there)")
        continue
      size, where = alone[v]
      if const_diff(size - k, n) != 0:
        bad.append(f"{p}.shape[{ax}]: spec says {t} = {size - k} ({v} = {size} from "
                   f"{where}), got {n}")
  return bad


def leaf_dims_of(per, shapes) -> list[tuple]:
  """Per leaf per axis its variable's text (``(var, k)``: ``"var - k"``), or its (concrete)
  size."""
  return [tuple(offset_text(*x) if x is not None else int(d)
                for x, d in zip(pl, shape, strict=True))
          for pl, shape in zip(per, shapes, strict=True)]


def concrete_dims(body_flat, avals, dims, treedef, paths, tie: bool = True, share: bool = True,
                  force=()) -> tuple[list[tuple], list[str], bool]:
  """``(leaf_dims, var names, tied)`` of a carry of concrete avals: named by ``dims`` or found
  by one abstract step of the body (:func:`carry_vars`; ``leaf_dims`` may hold texts like
  ``"n0 - 1"``).  ``force``: (leaf, axis) pairs that are variables though that step kept
  them."""
  shapes = [tuple(a.shape) for a in avals]
  if dims is not None:
    per, names, tied = carry_vars(shapes, None, named_axes(dims, treedef, shapes, paths))
    return leaf_dims_of(per, shapes), sorted(names), tied
  outs = eval_shape_body(body_flat, avals)
  check_structure("body_fun", avals, outs, None, None, paths)
  per, names, tied = carry_vars(shapes, moved_outs(outs, force), tie=tie, share=share)
  return leaf_dims_of(per, shapes), names, tied


def moved_outs(outs, force) -> list[tuple]:
  """The out shapes of one abstract step with the ``force``d (leaf, axis) pairs marked as
  changed (one more), so :func:`carry_vars` makes each a variable."""
  shapes = [list(o.shape) for o in outs]
  for li, ax in force:
    shapes[li][ax] = shapes[li][ax] + 1
  return [tuple(s) for s in shapes]


def policies(buckets, var_order) -> list[BucketPolicy]:
  """Per variable its bucket policy from ``buckets=`` (one policy, a dict, or None)."""
  if buckets is None:
    return [DEFAULT_POLICY] * len(var_order)
  if isinstance(buckets, Mapping):
    unknown = sorted(set(buckets) - set(var_order))
    if unknown:
      raise ControlFlowError(f"buckets names {unknown}, which are not carry dims "
                             f"{tuple(var_order)}")
    return [as_policy(buckets[v], f"[{v!r}]") if v in buckets else DEFAULT_POLICY
            for v in var_order]
  pol = as_policy(buckets, "")
  return [pol] * len(var_order)


def hoist_consts(closed):
  """A closed jaxpr whose constvars became leading invars, and the constants' values."""
  j = closed.jaxpr
  j2 = j.replace(constvars=[], invars=list(j.constvars) + list(j.invars))
  return jax.extend.core.ClosedJaxpr(j2, []), list(closed.consts)


def bucket_of(policy: BucketPolicy, n: int) -> int:
  """The bucket of size ``n`` (grown past the policy's max; see loops' ``overflow=``)."""
  b = policy.bucket(n)
  return policy.grow(n) if b is None else b


def initial_dims(leaf_dims, avals, carry_vars) -> dict[str, str]:
  """Per carry variable the text of its initial size: the dim of the init axis where it
  first appears (a program dim expression when staged, an int otherwise); a variable with no
  axis of its own (``v - k`` only) is that axis's dim plus ``k``."""
  out: dict[str, str] = {}
  offset: dict[str, str] = {}
  for ld, a in zip(leaf_dims, avals, strict=True):
    for d, d0 in zip(ld, a.shape, strict=True):
      if isinstance(d, str) and d in carry_vars and d not in out:
        out[d] = str(d0)
      elif isinstance(d, str) and split_offset(d)[0] in carry_vars:
        v, k = split_offset(d)
        offset.setdefault(v, f"{d0} + {k}" if k >= 0 else f"{d0} - {-k}")
  for v, text in offset.items():
    out.setdefault(v, text)
  return out


def maybe_empty(d) -> bool:
  """Whether the dim ``d`` may be 0 (an int 0, or an expression not provably >= 1)."""
  if not _symbolic.is_symbolic(d):
    return int(d) == 0
  try:
    return not bool(d >= 1)
  except Exception:  # noqa: BLE001 - JAX cannot decide it: it may be 0
    return True


def user_policy(buckets, name: str) -> BucketPolicy | None:
  """The policy ``buckets=`` gives the carry dim ``name`` (None: it names none)."""
  if buckets is None:
    return None
  if isinstance(buckets, Mapping):
    return as_policy(buckets[name], f"[{name!r}]") if name in buckets else None
  return as_policy(buckets, "")


def overflow_error(items) -> OutOfBucketsError:
  """``items``: ``(var, size, where in the carry, policy)`` of every dim past its max."""
  lines = [f"{v} = {n} ({where}) is above the largest bucket {p.max} of {p!r}"
           for v, n, where, p in items]
  return OutOfBucketsError(
      "while_loop: a carry dimension grows over the largest bucket:\n" + format_list(lines)
      + "\nRaise the policy's max (buckets=), or pass overflow=\"grow\" (compile larger "
      "buckets) or overflow=\"exact\" (run the sizes past the max unpadded, one compile per "
      "shape).")


def exact_runs(err: ControlFlowError) -> ControlFlowError:
  """Marks a loop error that only the symbolic trace meets: a loop of exact-shape steps runs
  the same code (``build_spec`` falls back to one and warns)."""
  err.exact_runs = True
  return err


class EmptiedCarry(ControlFlowError):
  """A shrinking carry dim of a loop run on padded values (staged in a program, or a host-mode
  loop) reached 0.  JAX takes dim variables to be >= 1, so an empty dim has no padded form:
  the code that traced it as one (``q[-1:]``, ``q.shape[0] - 1``) would be wrong.  The caller
  that can run exact (``ProgramRunner``: the call op by op; ``HostLoop``: the loop eagerly)
  catches it; it reaches a user only if none can."""


def emptied_error(where: str, names: str) -> EmptiedCarry:
  return EmptiedCarry(
      f"{where}: a shrinking carry dim reached {names}; JAX dims are >= 1, so an empty dim has "
      "no padded form. dynjax runs it exact instead (op by op).")


def max_iterations_error(n: int) -> ControlFlowError:
  return ControlFlowError(
      f"while_loop: cond_fun is still true after max_iterations={n} iterations. Raise "
      "max_iterations, or make sure cond_fun becomes false (e.g. bound a step counter).")
