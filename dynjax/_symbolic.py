"""Symbolic dimensions: ``dims`` specs, solving sizes from inputs, and shape functions.

A ``dims`` spec names each axis of an argument leaf either by an integer (static, checked) or
by an expression over dimension variables in ``jax.export.symbolic_shape`` syntax.  All
specs of one function share ONE symbolic scope, so a variable used by several arguments is
the same symbol (and is checked to agree at call time).

Shape functions turn a symbolic output dim (``b*t``, ``t + 1``, ``max(t, 3)``) into a Python
function of the solved sizes, compiled once from the expression's text: evaluating one costs
~0.3 us, so output shapes come per call without re-tracing.  ONE compiler (``_compile``) serves
every caller: :func:`dim_fn`/:func:`shape_fn` (positional sizes, host ints or traced int32:
loops, staged programs) and :func:`compile_dim`/:func:`compile_shape` (a sizes tuple: the jit
core).  :func:`is_symbolic` is the one "is this dim symbolic" predicate.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from dynjax._errors import ShapeMismatchError, SpecError, format_list

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Helpers named as jax prints them in dimension expressions.
_EXPR_NAMESPACE = {
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "max": max,
    "min": min,
    "non_negative": lambda a: max(a, 0),
    "__builtins__": {},
}


# The same helpers on traced int32 scalars (next sizes computed inside a compiled loop).
_DEVICE_NAMESPACE = {
    "floordiv": jnp.floor_divide,
    "mod": jnp.mod,
    "max": jnp.maximum,
    "min": jnp.minimum,
    "non_negative": lambda a: jnp.maximum(a, 0),
    "__builtins__": {},
}
# The same helpers over numpy arrays of sizes (a guard's check at 65,536 sizes at once).
_NUMPY_NAMESPACE = {
    "floordiv": np.floor_divide,
    "mod": np.mod,
    "max": np.maximum,
    "min": np.minimum,
    "non_negative": lambda a: np.maximum(a, 0),
    "__builtins__": {},
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_symbolic(d) -> bool:
  """Whether a dimension is symbolic (a ``jax.export`` expression), not an integer.

  The one predicate dynjax uses on dims: control flow, the core and the padding pass ask it.
  """
  return not isinstance(d, int | np.integer)


def dim_vars_of(d) -> set[str]:
  """The variable names a dimension (int, symbolic expression or its text) depends on."""
  if isinstance(d, str):
    return {n for n in _NAME.findall(d) if n not in _EXPR_NAMESPACE}
  if not is_symbolic(d):
    return set()
  return set(d.get_vars())


def vars_of_dims(dims) -> set[str]:
  """The variable names any of ``dims`` (ints, expressions, texts) depends on."""
  out: set[str] = set()
  for d in dims:
    out |= dim_vars_of(d)
  return out


def _compile(body: str, params: str, ns: Mapping = _EXPR_NAMESPACE) -> Callable:
  """The one compiler of dimension expressions: ``lambda params: body`` over jax's helper names
  (``ns``: on Python ints, traced int32 scalars or numpy arrays).

  ``body`` is text from jax's own printer of dimension expressions (``t + 1``,
  ``floordiv(t, 2)``); compiled once, a call costs ~0.3 us.
  """
  return eval(f"lambda {params}: {body}", dict(ns))  # noqa: S307 - jax's printer, not user text


def _namespace(device: bool, arrays: bool = False) -> Mapping:
  return _NUMPY_NAMESPACE if arrays else _DEVICE_NAMESPACE if device else _EXPR_NAMESPACE


def _indexed(text: str, var_order: Sequence[str]) -> str:
  """Rewrites variable names in an expression's text as ``_s[i]`` lookups."""
  index = {v: i for i, v in enumerate(var_order)}

  def sub(m):
    name = m.group(0)
    if name in _EXPR_NAMESPACE:
      return name
    if name not in index:
      raise SpecError(f"dimension expression {text!r} uses {name!r}, which is not one of the "
                      f"function's dimension variables {list(var_order)}")
    return f"_s[{index[name]}]"

  return _NAME.sub(sub, text)


def _tuple_text(items: Sequence[str]) -> str:
  return "(" + "".join(f"{x}, " for x in items) + ")"


def dim_fn(dims: Sequence, var_order: Sequence[str], *, device: bool = False,
           arrays: bool = False) -> Callable[..., tuple]:
  """``fn(*sizes) -> tuple`` of the values of ``dims`` (ints, expressions or their text).

  ``sizes`` are positional, in ``var_order``; with ``device=True`` they may be traced int32
  scalars (``max``/``floordiv`` become ``jnp`` ops), with ``arrays=True`` int64 numpy arrays
  (every size at once).

  Example:
    >>> dim_fn(["t + 1", 4], ("t",))(7)
    (8, 4)
  """
  return _compile(_tuple_text([str(d) for d in dims]), ", ".join(var_order),
                  _namespace(device, arrays))


def shape_fn(shapes: Sequence[Sequence], var_order: Sequence[str], *, device: bool = False
             ) -> Callable[..., tuple]:
  """``fn(*sizes) -> tuple of shapes``, each dim an int, an expression or its text.

  Example:
    >>> shape_fn([("b", "2*t"), (3,)], ("b", "t"))(2, 5)
    ((2, 10), (3,))
  """
  body = _tuple_text([_tuple_text([str(d) for d in s]) for s in shapes])
  return _compile(body, ", ".join(var_order), _namespace(device))


def compile_dim(d, var_order: Sequence[str]) -> Callable[[Sequence[int]], int]:
  """A fast function ``sizes_tuple -> int`` for one dimension (int, symbolic, or the text of
  one as jax prints it)."""
  if isinstance(d, str):
    return _compile(_indexed(d, var_order), "_s")
  if not is_symbolic(d):
    value = int(d)
    return lambda sizes: value
  return _compile(_indexed(str(d), var_order), "_s")


def compile_shape(shape, var_order: Sequence[str]) -> Callable[[Sequence[int]], tuple]:
  """A fast function ``sizes_tuple -> shape tuple`` (~0.3 us; one ``eval`` at build time)."""
  if not any(is_symbolic(d) for d in shape):
    const = tuple(int(d) for d in shape)
    return lambda sizes: const
  return _compile(_tuple_text([_indexed(str(d), var_order) for d in shape]), "_s")


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """The spec of one argument leaf: per axis an int (static) or a symbolic expression."""

  path: str  # keypath used in messages, e.g. "tokens" or "batch['mask']"
  text: str | None  # the spec string as written (None: all axes static)
  dims: tuple  # ints and _DimExpr


@dataclasses.dataclass
class Signature:
  """The symbolic signature of one (static signature of a) function."""

  scope: Any
  var_order: tuple[str, ...]  # every dimension variable, sorted
  leaves: tuple[LeafSpec | None, ...]  # one per flat dynamic leaf; None: fully static leaf
  # (leaf index, axis, var index) for each axis that is a bare variable: how to solve sizes.
  solve_plan: tuple[tuple[int, int, int], ...]
  # (leaf index, axis, shape fn) for axes that are compound expressions or ints: checks.
  check_plan: tuple[tuple[int, int, Callable], ...]

  def describe(self) -> str:
    lines = []
    for spec in self.leaves:
      if spec is not None:
        lines.append(f"{spec.path}: ({', '.join(str(d) for d in spec.dims)})")
    return "\n".join(lines)


def parse_spec(text: str, path: str, scope) -> tuple:
  if not isinstance(text, str):
    raise SpecError(f"dims[{path}]: expected a shape spec string such as \"b, t\", got "
                    f"{type(text).__name__} {text!r}")
  try:
    return tuple(export.symbolic_shape(text, scope=scope))
  except Exception as e:  # jax raises ValueError with its own explanation
    raise SpecError(f"dims[{path}]: cannot parse shape spec {text!r}: {e}\n"
                    "Use jax.export.symbolic_shape syntax, e.g. \"b, t, 768\".") from None


def spec_variables(texts: Sequence[str]) -> list[str]:
  """Variable names used in spec strings (for building the shared scope)."""
  names: set[str] = set()
  for text in texts:
    for tok in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
      if tok not in ("floordiv", "mod", "max", "min", "non_negative") and not keyword.iskeyword(tok):
        names.add(tok)
  return sorted(names)


def build_signature(leaf_specs: Sequence[tuple[str, str | None, int]],
                    constraints: Sequence[str]) -> Signature:
  """Builds the shared-scope symbolic signature.

  Args:
    leaf_specs: per flat leaf ``(path, spec text or None, ndim)``.
    constraints: extra ``jax.export`` constraints, e.g. ``("t <= 512",)``.
  """
  try:
    scope = export.SymbolicScope(tuple(constraints))
  except Exception as e:
    raise SpecError(f"constraints={tuple(constraints)!r} are not valid jax.export constraints: {e}"
                    ) from None
  leaves: list[LeafSpec | None] = []
  problems = []
  for path, text, ndim in leaf_specs:
    if text is None:
      leaves.append(None)
      continue
    dims = parse_spec(text, path, scope)
    if len(dims) != ndim:
      problems.append(f"{path}: spec {text!r} has {len(dims)} axes but the argument has rank "
                      f"{ndim}")
    leaves.append(LeafSpec(path, text, dims))
  if problems:
    raise ShapeMismatchError(
        "dims do not match the arguments' ranks:\n" + format_list(problems)
        + "\nGive one name or size per axis in each spec.")
  all_vars: set[str] = set()
  for spec in leaves:
    if spec is not None:
      for d in spec.dims:
        all_vars |= dim_vars_of(d)
  var_order = tuple(sorted(all_vars))
  var_index = {v: i for i, v in enumerate(var_order)}
  solve, check, solved = [], [], set()
  for li, spec in enumerate(leaves):
    if spec is None:
      continue
    for ax, d in enumerate(spec.dims):
      if is_symbolic(d) and _IDENT.match(str(d)) and str(d) in var_index:
        solve.append((li, ax, var_index[str(d)]))
        solved.add(str(d))
      else:
        check.append((li, ax, compile_dim(d, var_order)))
  unsolvable = sorted(all_vars - solved)
  if unsolvable:
    raise SpecError(
        f"dimension variable(s) {unsolvable} never appear alone as an axis, so their sizes "
        "cannot be read from the arguments; name them alone in some spec (e.g. \"t\" "
        "rather than only \"2*t\").")
  return Signature(scope, var_order, tuple(leaves), tuple(solve), tuple(check))


def solve_sizes(sig: Signature, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
  """Solves every dimension variable from concrete leaf shapes; checks every axis.

  Hot path (~1 us for a few leaves).  Raises ShapeMismatchError listing every mismatch.
  """
  sizes: list[int | None] = [None] * len(sig.var_order)
  bad = None
  for li, ax, vi in sig.solve_plan:
    n = shapes[li][ax]
    prev = sizes[vi]
    if prev is None:
      sizes[vi] = n
    elif prev != n:
      bad = True
  if bad is None:
    for li, ax, fn in sig.check_plan:
      if shapes[li][ax] != fn(sizes):
        bad = True
        break
  if bad is not None:
    _raise_mismatch(sig, shapes)
  return tuple(sizes)  # type: ignore[return-value]


def _raise_mismatch(sig: Signature, shapes) -> None:
  """Builds the full message (slow path): every inconsistent variable and static axis."""
  seen: dict[str, list[tuple[str, int, int]]] = {}
  for li, ax, vi in sig.solve_plan:
    spec = sig.leaves[li]
    seen.setdefault(sig.var_order[vi], []).append((spec.path, ax, shapes[li][ax]))
  lines = []
  values = {}
  for var, uses in seen.items():
    distinct = sorted({n for _, _, n in uses})
    values[var] = uses[0][2]
    if len(distinct) > 1:
      where = ", ".join(f"{p}.shape[{ax}]={n}" for p, ax, n in uses)
      lines.append(f"dimension variable {var!r} must have one size but got {distinct}: {where}")
  sizes = tuple(values.get(v, 0) for v in sig.var_order)
  for li, ax, fn in sig.check_plan:
    spec = sig.leaves[li]
    expected = fn(sizes)
    if shapes[li][ax] != expected:
      lines.append(f"{spec.path}.shape[{ax}]: expected {spec.dims[ax]} = {expected} "
                   f"(spec {spec.text!r}), got {shapes[li][ax]}")
  raise ShapeMismatchError(
      "arguments do not match the declared dims:\n" + format_list(lines)
      + "\nPass arrays whose shapes follow the specs, or change dims=.")


def symbolic_avals(sig: Signature, avals: Sequence[jax.ShapeDtypeStruct]):
  """ShapeDtypeStructs with symbolic dims for leaves that have specs."""
  out = []
  for spec, aval in zip(sig.leaves, avals, strict=True):
    if spec is None:
      out.append(aval)
    else:
      out.append(jax.ShapeDtypeStruct(spec.dims, aval.dtype, weak_type=aval.weak_type))
  return out


def eval_shape_at(sig: Signature, dims: Sequence, env: Mapping[str, int]) -> tuple[int, ...]:
  fn = compile_shape(tuple(dims), sig.var_order)
  return tuple(fn(tuple(env[v] for v in sig.var_order)))
