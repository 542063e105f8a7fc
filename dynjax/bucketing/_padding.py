"""The padding pass behind ``padding="auto"``: exact execution of a symbolic jaxpr on padded inputs.

``pad_jaxpr(closed_jaxpr, dim_vars, bucket)`` specialises a jaxpr traced with symbolic shapes
(``jax.export.symbolic_shape``) to one bucket.  The returned ``PaddingPlan.fun(sizes, *args)``
takes the true sizes as traced int32 scalars and inputs padded to the bucket with arbitrary
contents in their padded region, and returns outputs whose prefix (the output dims evaluated at
the true sizes) equals what the unpadded function returns.  One executable therefore serves every
true size inside the bucket.

The pass is an interpreter over the jaxpr (``_padding_core``) with a per-primitive rule table
(``_padding_rules``): pass-through, masking with the identity of the combining operation, or
relayout.  Equations touching a dynamic axis without a rule raise one
``PaddingUnsupportedError`` naming every one of them (primitive and the user's source line); the
core then runs the function unpadded.  ``pad_jaxpr`` traces ``fun`` abstractly once, so every such error (and
every rewrite listed in ``plan.rewrites``) surfaces at plan time, not inside the core's jit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp

from dynjax import _jax_private as jp
from dynjax._errors import PaddingUnsupportedError, ShapeMismatchError, SpecError
from dynjax.bucketing import _padding_rules
from dynjax.bucketing._padding_core import (
  RULES,
  Context,
  PaddedValue,
  interpret_closed,
  sub_jaxprs,
  unsupported_all,
)


@dataclasses.dataclass(frozen=True)
class PaddingPlan:
  """A jaxpr specialised to one bucket.

  Attributes:
    fun: ``fun(sizes, *flat_padded_args) -> list`` of flat padded outputs; traceable (jit it).
    rewrites: lines for ``explain()``: which equations were masked or relayouted and how, and
      which were left alone because their result cannot reach an output.
    dim_vars: the order of ``sizes``.
    bucket: ``{var: padded size}``.
    in_shapes: padded shape of every flat input.
    out_shapes: padded shape of every flat output.
  """

  fun: Callable[..., list]
  rewrites: list[str]
  dim_vars: tuple[str, ...]
  bucket: dict[str, int]
  in_shapes: list[tuple[int, ...]]
  out_shapes: list[tuple[int, ...]]
  # A plan built with ``validate=False``: ``with plan.tracing():`` around the caller's own
  # trace of ``fun`` records its rewrites and raises what it cannot pad (None once checked).
  tracing: Callable | None = None

  def check_outputs(self, shapes, skip=()) -> None:
    """Raises unless the traced padded function returned the planned padded shapes (but
    the outputs at indices in ``skip``, which the caller left out)."""
    got = [tuple(s) for s in shapes]
    want = [s for i, s in enumerate(self.out_shapes) if i not in skip]
    if got != want:
      raise PaddingUnsupportedError(
        f"the padded function returns shapes {got}, expected {want} for bucket {self.bucket}")


def _jaxpr_dim_vars(closed) -> set[str]:
  names: set[str] = set()
  for aval in closed.in_avals:
    for d in getattr(aval, "shape", ()):
      names |= jp.dim_expr_vars(d)
  return names


def empty_dims(closed, env: Mapping[str, int]) -> set[str]:
  """The variables of the symbolic dims of ``closed`` (its equations' results, sub-jaxprs
  included) that evaluate below 1 at the sizes ``env``.  A probe bucket where an axis the
  function builds is empty meets what no real call does (wav2vec2's frames below its conv
  kernels at 8 samples: a rule's gather from an empty axis crashed the plan into a fallback),
  so the family probes a larger bucket (``Family._guarded_probe_bucket``).  Once a family;
  dims are told apart by identity (the jaxpr keeps them alive), since a symbolic dim's ``==``
  costs ~25 us: examples' BERT-base 16 -> 3 ms (2-core CPU box)."""
  low: set[str] = set()
  seen: set[int] = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        for d in getattr(v.aval, "shape", ()):
          if jp.is_dim_expr(d) and id(d) not in seen:
            seen.add(id(d))
            names = jp.dim_expr_vars(d)  # a rule's own variable (a bound scan's): skipped
            if names <= env.keys() and jp.eval_dim_expr(d, env) < 1:
              low.update(names)
      for sub in sub_jaxprs(eqn.params):
        walk(sub)

  walk(closed.jaxpr)
  return low


def pad_jaxpr(closed_jaxpr, dim_vars: Sequence[str], bucket: Mapping[str, int],
              size_max: Mapping[str, int] | None = None, monotone: bool = True,
              validate: bool = True) -> PaddingPlan:
  """Builds the padded, exact version of a symbolic jaxpr for one bucket.

  Args:
    closed_jaxpr: ``jax.make_jaxpr(flat_fun)(*specs)`` where the specs' shapes come from one
      ``jax.export.symbolic_shape`` scope.
    dim_vars: the dimension variable names, in the order of ``sizes``.
    bucket: ``{var: padded size}`` for every variable.
    size_max: optional ``{var: largest true size}`` (at most the bucket) that the caller
      guarantees; compound dims (``t + 1``) then get buffers for that range, so their padded
      size may equal the bucket of ``t`` (hoisted loops use it to grow a carry in place).
    monotone: require every input/output dim to take its largest value at the bucket (the
      core's contract).  ``False`` (compiled host programs, which read the padded shapes from
      ``in_shapes``/``out_shapes``): such a dim (``n - min(n, t)``) gets a buffer of its
      largest value over the bucket box instead.
    validate: trace ``fun`` abstractly now (rewrites and errors known at once).  ``False``:
      the caller traces it itself inside ``with plan.tracing():`` and calls
      ``plan.check_outputs`` (one interpretation of the jaxpr instead of two: the per-bucket
      lowering of ``padding="auto"``; BERT-base on the 2-core CPU box, ~0.16 s of ~0.45 s).

  Returns:
    A :class:`PaddingPlan`.

  Raises:
    PaddingUnsupportedError: equations touching a dynamic axis have no exact rule; the message
      names every one of them (primitive, the user's source line, why), and ``e.problems``
      holds one line per equation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax import export
    >>> (t,) = export.symbolic_shape("t")
    >>> cj = jax.make_jaxpr(lambda x: x.sum())(jax.ShapeDtypeStruct((t,), jnp.float32))
    >>> plan = pad_jaxpr(cj, ("t",), {"t": 8})
    >>> x = jnp.array([1.0, 2.0, 3.0, 9e9, 9e9, 9e9, 9e9, 9e9])
    >>> float(jax.jit(plan.fun)((jnp.int32(3),), x)[0])
    6.0
  """
  dim_vars = tuple(dim_vars)
  missing = sorted(_jaxpr_dim_vars(closed_jaxpr) - set(dim_vars))
  if missing:
    raise SpecError(
      f"pad_jaxpr: dimension variables {missing} of the jaxpr are not in dim_vars {dim_vars}"
    )
  absent = [v for v in dim_vars if v not in bucket]
  if absent:
    raise SpecError(f"pad_jaxpr: bucket {dict(bucket)} has no size for {absent}")
  bucket_env = {v: int(bucket[v]) for v in dim_vars}
  size_max = {v: min(int(n), bucket_env[v]) for v, n in (size_max or {}).items()
              if v in bucket_env}
  top_env = {v: size_max.get(v, n) for v, n in bucket_env.items()}
  probe = Context({}, bucket_env, None, size_max)
  bad = []
  for where, avals in (("input", closed_jaxpr.in_avals), ("output", closed_jaxpr.out_avals)):
    for i, aval in enumerate(avals):
      for d in getattr(aval, "shape", ()):
        if jp.is_dim_expr(d) and probe.padded_dim(d) != (
            bucket_env[str(d)] if str(d) in bucket_env else jp.eval_dim_expr(d, top_env)):
          bad.append(f"{where} {i} dim {d}")
  if bad and monotone:
    raise PaddingUnsupportedError(
      f"dims not monotone in the sizes (their bucket value is not their largest): {bad}"
    )
  in_shapes = [probe.padded_shape(a.shape) for a in closed_jaxpr.in_avals]
  out_shapes = [probe.padded_shape(a.shape) for a in closed_jaxpr.out_avals]
  recording: list[list[str] | None] = [None]
  problems: list[list[str] | None] = [None]

  def fun(sizes, *args):
    if len(sizes) != len(dim_vars):
      raise ShapeMismatchError(
        f"padded function: expected {len(dim_vars)} sizes {dim_vars}, got {len(sizes)}"
      )
    bad = [
      f"arg {i}: expected padded shape {want}, got {tuple(jnp.shape(a))}"
      for i, (a, want) in enumerate(zip(args, in_shapes, strict=False))
      if tuple(jnp.shape(a)) != want
    ]
    if len(args) != len(in_shapes) or bad:
      raise ShapeMismatchError(
        f"padded function for bucket {bucket_env}: {len(in_shapes)} args expected, got "
        f"{len(args)}; " + "; ".join(bad)
      )
    sizes_env = {v: jnp.asarray(s, jnp.int32) for v, s in zip(dim_vars, sizes, strict=False)}
    ctx = Context(sizes_env, bucket_env, recording[0], size_max, problems[0])
    outs = interpret_closed(ctx, closed_jaxpr, [PaddedValue(a) for a in args])
    return [o.array(a.dtype) for o, a in zip(outs, closed_jaxpr.out_avals, strict=False)]

  rewrites: list[str] = []

  @contextlib.contextmanager
  def tracing():
    found: list[str] = []
    rewrites.clear()
    recording[0], problems[0] = rewrites, found
    try:
      yield
    finally:
      recording[0] = problems[0] = None
    if found:  # every equation it cannot pad, in one message
      raise unsupported_all(found)

  if not validate:
    return PaddingPlan(fun, rewrites, dim_vars, bucket_env, in_shapes, out_shapes, tracing)
  size_specs = tuple(jax.ShapeDtypeStruct((), jnp.int32) for _ in dim_vars)
  arg_specs = [
    jax.ShapeDtypeStruct(s, a.dtype) for s, a in zip(in_shapes, closed_jaxpr.in_avals, strict=False)
  ]
  with tracing():
    out_specs = jax.eval_shape(fun, size_specs, *arg_specs)
  plan = PaddingPlan(fun, rewrites, dim_vars, bucket_env, in_shapes, out_shapes)
  plan.check_outputs([o.shape for o in out_specs])
  return plan


def rule_coverage() -> tuple[list[str], list[str]]:
  """Which primitives the padding pass has rules for, and notable ones it has none for.

  Returns:
    ``(covered, notable_missing)``: sorted primitive names.  ``notable_missing`` lists the
    ``jax.lax`` primitives (collectives and internal plumbing excluded) with no rule: an equation
    using one of them over a dynamic axis makes the function run unpadded.

  Example:
    >>> covered, missing = rule_coverage()
    >>> "dot_general" in covered, "fft" in missing
    (True, True)
  """
  covered = sorted({p.name for p in RULES})
  internal = {
    "after_all", "all_gather", "all_to_all", "axis_index", "create_token", "pmax", "pmin",
    "ppermute", "psum", "ragged_all_to_all", "get", "swap", "name", "empty2", "custom_lin",
    "call", "add_jaxvals",
  }  # fmt: skip
  names = {getattr(P, n).name for n in dir(P) if n.endswith("_p")}
  missing = sorted(n for n in names - set(covered) - internal)
  return covered, missing


__all__ = ["PaddingPlan", "pad_jaxpr", "rule_coverage"]

del _padding_rules, Any
