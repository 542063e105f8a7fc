"""A ``while_loop``'s spec: its body and cond traced over symbolic carries, and the hoisted
executable of one bucket.

1. Find the dynamic axes (``_carry.concrete_dims``: named by ``dims=``, or the axes that change
   in one abstract step of the body).
2. Trace ``body_fun`` and ``cond_fun`` with ``jax.export`` symbolic shapes.  The output carry's
   dims are expressions of the variables (``t + 1``, ``2*t``); they give the *next sizes* as a
   function of the current ones (compiled once for host ints and for traced int32, by
   ``_symbolic.dim_fn``).  A carry whose new shape cannot be written that way is a
   :class:`~dynjax.ControlFlowError` listing every offending leaf.
3. Per bucket (:func:`build_hoisted`), the padding pass makes the body and cond exact on the
   padded carry, and ONE executable runs ``lax.while_loop(cond & next_sizes_fit_bucket, body)``
   on it, the true sizes riding along as int32 scalars; it returns the carry and a status
   vector ``[pred, sizes..., iterations]``.
4. The *cap* (:func:`find_cap`): a conjunct ``i < K`` of the cond on a carry counter the body
   increments by a constant bounds the remaining trips, hence the final sizes.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export, lax

from dynjax import _symbolic
from dynjax._errors import ControlFlowError, format_list, user_stacklevel
from dynjax.bucketing._policies import BucketPolicy
from dynjax.control._carry import (
  check_structure,
  concrete_dims,
  const_diff,
  exact_runs,
  flat_fns,
  hoist_consts,
  keypaths,
  policies,
  split_offset,
  trace_symbolic,
)
from dynjax.control._carry import overflow_error as _overflow_error
from dynjax.control._frontend import any_tracer, needs_vm
from dynjax.runtime import Kernel
from dynjax.runtime._vm import fit

try:  # the padding pass; without it loops run in exact mode
  from dynjax.bucketing._padding import pad_jaxpr
except ImportError:  # pragma: no cover - depends on the padding pass being present
  pad_jaxpr = None

_CAP_MAX_ITERS = 1 << 16  # a cap further away than this many iterations is not used


@dataclasses.dataclass(frozen=True)
class Cap:
  """``cond_fun`` holds ``carry[leaf] < bound`` (``<=`` if inclusive); the body adds ``step``."""

  leaf: int
  step: int
  bound: int
  inclusive: bool

  def iterations(self, x0: int) -> int:
    last = self.bound if self.inclusive else self.bound - 1  # largest value that continues
    return 0 if x0 > last else (last - x0) // self.step + 1


@dataclasses.dataclass
class LoopSpec:
  """Everything traced once per (cond, body, carry signature)."""

  treedef: Any
  paths: list[str]
  dtypes: list
  var_order: tuple[str, ...]
  leaf_dims: list[tuple]  # per leaf: per axis an int, a var name or an expression text
  solve: list[tuple[int, int, int, int]]  # (leaf, axis, var index, k): size = shape + k
  next_exprs: list[str]  # per var: the expression of its next size
  body_cj: Any  # closed jaxpr, constvars turned into leading invars
  body_consts: list  # concrete values (standalone); staged loops get them at run time
  cond_cj: Any
  cond_consts: list
  policies: list[BucketPolicy]
  padding: str
  cond_fun: Callable
  body_fun: Callable
  unroll: int = 1
  bucket_from: str = "init"
  overflow: str = "error"  # sizes past a policy's max: "error", "exact" or "grow"
  max_iterations: int | None = None
  labels: dict = dataclasses.field(default_factory=dict)  # var -> the user's name (staged)
  cap: Cap | None = None
  shrinks: tuple[int, ...] = ()  # vars whose next size can be smaller (guarded: >= least)
  least: tuple[int, ...] = ()  # per var the smallest size its trace holds (1; a tie's n0 >= 2)
  staged: bool = False  # a loop inside a dynjax.jit program (padded I/O)
  exact_only: bool = False  # no symbolic form (exact_spec): exact steps, any carry shapes
  shapes_fn: Callable = None
  next_host: Callable = None
  next_dev: Callable = None
  hoisted: Kernel = None
  exact_body: Kernel = None
  exact_cond: Kernel = None
  fallback_reason: str | None = None
  rewrites: list = dataclasses.field(default_factory=list)


def build_spec(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
               bucket_from, overflow="error", max_iterations=None) -> LoopSpec:
  """The spec of a loop run on concrete values (its own symbolic scope).

  Where only the symbolic trace fails (a dim compared in Python, by the user or inside a jnp
  function; next sizes dynjax cannot express) the loop runs per exact shape, as
  ``padding="exact"``, with a warning (``loop_stats()["fallback"]`` says why).
  """
  paths = keypaths(treedef)
  cond_flat, body_flat = flat_fns(cond_fun, body_fun, treedef)
  leaf_dims, var_order, tied = concrete_dims(body_flat, avals, dims, treedef, paths)
  args = (cond_fun, body_fun, treedef, paths, avals)
  opts = (buckets, padding, unroll, bucket_from, overflow, max_iterations)
  try:
    spec = _spec_at(*args, leaf_dims, var_order, *opts)
  except ControlFlowError as e:
    spec = None
    # Axes a constant apart that do not stay so (the body changes one of them otherwise at
    # other sizes): each its own variable, as without tying.  Then axes of one size that
    # change alike at the init's sizes only (``r[2:]`` beside ``q[:-1][1:]``): each its own.
    # And axes fixed in the first (concrete) step that the body changes at other sizes
    # (``r`` grown by ``q``'s length, ``q`` empty at the start): a dim each.
    retries = ([dict(tie=False)] if tied else []) + ([dict(tie=False, share=False)]
                                                      if dims is None else [])
    if dims is None and getattr(e, "moved", None):
      retries.append(dict(tie=False, share=False, force=e.moved))
    why = e  # the reason to report: the first error, or a retry's that got further
    for kw in retries:
      try:
        ld, vo, _ = concrete_dims(body_flat, avals, dims, treedef, paths, **kw)
        if (ld, vo) == (leaf_dims, var_order):
          continue
        spec = _spec_at(*args, ld, vo, *opts)
        break
      except ControlFlowError as e2:
        why = e2 if getattr(e2, "exact_runs", False) else why
      except Exception:  # noqa: BLE001 - the first attempt's error is the one to report
        continue
    if spec is None:
      if not getattr(e, "exact_runs", False) or (dims is not None and "cannot express" in
                                                 str(e)):
        raise
      spec = exact_spec(*args, *opts[1:], reason=str(why))
  spec.exact_body = Kernel("while.body_exact", lambda key: jax.jit(body_flat),
                           lambda key: "exact")
  spec.exact_cond = Kernel("while.cond_exact", lambda key: jax.jit(
      lambda *xs: (jnp.asarray(cond_flat(*xs)),)), lambda key: "exact")
  return spec


def exact_spec(cond_fun, body_fun, treedef, paths, avals, padding, unroll, bucket_from,
               overflow, max_iterations, reason: str) -> LoopSpec:
  """A loop of exact-shape steps only (``exact_only``): no symbolic trace, any carry shapes."""
  if padding != "exact":
    warnings.warn(f"dynjax.while_loop: {reason}\nThe loop runs per exact carry shape (a "
                  "compile per shape, a host sync per step).", stacklevel=user_stacklevel())
  return LoopSpec(treedef, paths, [a.dtype for a in avals], (), [tuple(a.shape) for a in avals],
                  [], [], None, [], None, [], [], "exact", cond_fun, body_fun, unroll=unroll,
                  bucket_from=bucket_from, overflow=overflow, max_iterations=max_iterations,
                  exact_only=True, fallback_reason=reason.splitlines()[0])


def _spec_at(cond_fun, body_fun, treedef, paths, avals, leaf_dims, var_order, buckets, padding,
             unroll, bucket_from, overflow, max_iterations) -> LoopSpec:
  var_order = tuple(var_order)
  # An axis tied to a variable at an offset (``n0 - 2``) is a dim too: JAX assumes every dim
  # variable >= 1, so ``n0 >= 3`` (as two variables, the axis would be one >= 1: without it
  # ``b[:-1]`` traces to ``max(0, n0 - 3)``), or ``n0 >= 2`` where the axis starts empty (an
  # empty KV cache: its slices then trace as JAX takes them at size 0).
  least = {}
  for ld, a in zip(leaf_dims, avals, strict=True):
    for d, n in zip(ld, a.shape, strict=True):
      if isinstance(d, str) and d not in var_order:
        (v,) = _symbolic.dim_vars_of(d)
        least[v] = max(least.get(v, 1), (n > 0) - _symbolic.dim_fn([d], (v,))(0)[0])
  cons = tuple(f"{v} >= {k}" for v, k in sorted(least.items()) if k > 1)
  sym = export.symbolic_shape(", ".join(var_order), constraints=cons) if var_order else ()
  at = _symbolic.dim_fn([d for ld in leaf_dims for d in ld], var_order)(*sym)
  it = iter(at)
  sym_avals = [jax.ShapeDtypeStruct(tuple(next(it) for _ in ld), a.dtype)
               for ld, a in zip(leaf_dims, avals, strict=True)]
  policy_of = dict(zip(var_order, policies(buckets, var_order), strict=True))
  return spec_from_symbolic(cond_fun, body_fun, treedef, paths, sym_avals, leaf_dims,
                            var_order, policy_of.__getitem__, padding, unroll, bucket_from,
                            overflow=overflow, max_iterations=max_iterations, least=least)


def dim_sources(paths, leaf_dims, sym_avals, text: str) -> str:
  """Where each carry dim variable ``text`` names comes from: ``n0 = init[0].shape[1]``."""
  out: dict[str, str] = {}
  for p, ld, a in zip(paths, leaf_dims, sym_avals, strict=True):
    for ax, (d, sd) in enumerate(zip(ld, a.shape, strict=True)):
      if isinstance(d, str) and _symbolic.is_symbolic(sd) and re.search(
          rf"\b{re.escape(str(sd))}\b", text):
        out.setdefault(str(sd), f"{sd} = {p}.shape[{ax}]")
  return ", ".join(out.values())


def spec_from_symbolic(cond_fun, body_fun, treedef, paths, sym_avals, leaf_dims, var_order,
                       policy_of, padding, unroll, bucket_from, allow_tracer_consts=False,
                       overflow="error", max_iterations=None, staged=False,
                       least=None) -> LoopSpec:
  """Traces body and cond over symbolic carries and derives next sizes, cap and kernels.

  ``leaf_dims``: per leaf per axis an int, a var name of ``var_order`` (a loop variable) or, for
  staged loops, the text of a fixed program dim expression.  ``policy_of(var)``: its bucket
  policy.  Dims of the closure (staged loops: program values the body reads) that are not in
  ``var_order`` become loop variables that never change.
  """
  cond_flat, body_flat = flat_fns(cond_fun, body_fun, treedef)
  body_closed = trace_symbolic("body", body_flat, sym_avals)
  cond_closed = trace_symbolic("cond", cond_flat, sym_avals)
  outs = body_closed.out_avals
  check_structure("body_fun", sym_avals, outs, treedef, treedef, paths)
  (pa,) = cond_closed.out_avals if len(cond_closed.out_avals) == 1 else (None,)
  if pa is None or tuple(pa.shape) != () or not (jnp.issubdtype(pa.dtype, jnp.bool_)
                                                 or jnp.issubdtype(pa.dtype, jnp.integer)):
    got = ", ".join(a.str_short() for a in cond_closed.out_avals) or "nothing"
    names = dim_sources(paths, leaf_dims, sym_avals, got)
    fix = ("compare it, e.g. x > 0" if pa is not None and tuple(pa.shape) == () else
           "reduce it to one value, e.g. jnp.all(...) or jnp.any(...), or index the element "
           "that decides")
    raise ControlFlowError(
        f"cond_fun must return one scalar boolean (shape (), bool or integer), got {got}"
        + (f" ({names})" if names else "") + f": {fix}.")
  var_order = tuple(var_order)
  # Next sizes: each variable's new value, consistently across every axis that uses it.
  next_of: dict[str, str] = {}
  where_of: dict[str, str] = {}
  bad = []
  # Per loop variable its dim and its next: from its first axis of its own, else (its axes
  # start empty: ``v - 1``) from its first axis ``v - k``.
  now_sym, next_sym, offset_only = {}, {}, {}
  for p, ld, a, o in zip(paths, leaf_dims, sym_avals, outs, strict=True):
    for ax, (d_dim, d_in, d_out) in enumerate(zip(ld, a.shape, o.shape, strict=True)):
      if isinstance(d_dim, str) and d_dim in var_order:
        now_sym.setdefault(d_dim, d_in)
        next_sym.setdefault(d_dim, d_out)
      elif isinstance(d_dim, str) and split_offset(d_dim)[0] in var_order:
        v, k = split_offset(d_dim)
        offset_only.setdefault(v, (d_in + k, d_out + k, f"{p}.shape[{ax}]"))
  for v, (d_in, d_out, where) in offset_only.items():
    if v not in next_sym:
      now_sym[v], next_sym[v] = d_in, d_out
      next_of[v], where_of[v] = str(d_out), where
  moved = []  # (leaf, axis) of fixed axes the body changes (a dim each may express them)
  for li, (p, ld, a, o) in enumerate(zip(paths, leaf_dims, sym_avals, outs, strict=True)):
    for ax, (d_dim, d_in, d_out) in enumerate(zip(ld, a.shape, o.shape, strict=True)):
      tied = (isinstance(d_dim, str) and d_dim not in var_order
              and bool(_symbolic.dim_vars_of(d_dim) & set(next_sym)))
      if tied:  # an axis a constant from a loop variable (``n0 - 1``): it must stay there
        vs = tuple(sorted(_symbolic.dim_vars_of(d_dim)))
        want = None
        if set(vs) <= set(now_sym):
          want = _symbolic.dim_fn([d_dim], vs)(*[next_sym[v] for v in vs])[0]
        if want is None or const_diff(d_out, want) != 0:
          bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out}, but {d_dim} of the next sizes is "
                     f"{want}; an axis tied to a dimension must stay tied")
      elif isinstance(d_dim, str) and d_dim in var_order:
        text = str(d_out)
        prev = next_of.setdefault(d_dim, text)
        where_of.setdefault(d_dim, f"{p}.shape[{ax}]")
        if prev != text:
          bad.append(f"{p}.shape[{ax}]: {d_dim} -> {text}, but {where_of[d_dim]}: {d_dim} -> "
                     f"{prev}; axes sharing a dimension must change alike")
      elif _symbolic.is_symbolic(d_in):
        if not (_symbolic.is_symbolic(d_out) and d_in == d_out):
          bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out} (a fixed axis of the enclosing "
                     "program that the body changes)")
      elif _symbolic.is_symbolic(d_out):
        bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out} (a fixed axis whose new size depends "
                   "on other dims); declare it dynamic with dims=")
        moved.append((li, ax))
      elif int(d_out) != int(d_in):
        bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out}")
        moved.append((li, ax))
  if bad:
    err = exact_runs(ControlFlowError(
        "body_fun changes the carry's shape in a way its dims cannot express:\n"
        + format_list(bad)
        + "\nEach dynamic axis must become an expression of the carry's dims (e.g. t + 1)."))
    err.moved = moved
    raise err
  bcj, bconsts = hoist_consts(body_closed)
  ccj, cconsts = hoist_consts(cond_closed)
  extra = set()
  for a in (*bcj.in_avals, *ccj.in_avals):
    for d in a.shape:
      if _symbolic.is_symbolic(d):
        extra |= _symbolic.dim_vars_of(d)
  var_order = var_order + tuple(sorted(extra - set(var_order)))
  known = set(var_order)
  for v in var_order:
    txt = next_of.get(v, v)
    if not _symbolic.dim_vars_of(txt) <= known:
      raise ControlFlowError(f"next size of {v} is {txt}, which uses unknown names")
  next_exprs = [next_of.get(v, v) for v in var_order]
  solve = []  # (leaf, axis, var index, k): the var's size is the axis's plus k
  for li, ld in enumerate(leaf_dims):
    for ax, d in enumerate(ld):
      if isinstance(d, str) and split_offset(d)[0] in var_order:
        v, k = split_offset(d)
        if k >= 0:
          solve.append((li, ax, var_order.index(v), k))
  if not allow_tracer_consts and (any_tracer(bconsts) or any_tracer(cconsts)):
    raise needs_vm("while_loop", "body_fun/cond_fun close over JAX tracers")
  spec = LoopSpec(treedef, paths, [a.dtype for a in sym_avals], var_order, list(leaf_dims),
                   solve, next_exprs, bcj, bconsts, ccj, cconsts,
                   [policy_of(v) for v in var_order], padding,
                   cond_fun, body_fun, unroll=unroll, bucket_from=bucket_from,
                   overflow=overflow, max_iterations=max_iterations, staged=staged)
  spec.cap = find_cap(bcj, ccj, len(bconsts), len(cconsts), len(leaf_dims))
  spec.shapes_fn = _symbolic.shape_fn(leaf_dims, var_order)
  spec.next_host = _symbolic.dim_fn(next_exprs, var_order)
  spec.next_dev = _symbolic.dim_fn(next_exprs, var_order, device=True)
  # The trace holds for sizes >= ``least`` (JAX's dims >= 1; a tie's constraint): a var
  # shrunk below it has no padded form there (its tied axis emptied): guarded as an emptied one.
  spec.least = tuple((least or {}).get(v, 1) for v in var_order)
  spec.shrinks = shrinking(spec)
  spec.hoisted = Kernel("while.hoisted", lambda key: build_hoisted(spec, key),
                        lambda key: f"bucket={dict(zip(var_order, key, strict=True))}")
  return spec


# -- the cap: a bound on the final sizes read from cond_fun ---------------------------------
_CMP = {"lt": ("lt", False), "le": ("lt", True), "gt": ("gt", False), "ge": ("gt", True)}


def _literal_int(v) -> int | None:
  if isinstance(v, jax.extend.core.Literal):
    val = np.asarray(v.val)
    if val.ndim == 0 and np.issubdtype(val.dtype, np.integer):
      return int(val)
  return None


def find_cap(body_cj, cond_cj, nb: int, nc: int, n: int) -> Cap | None:
  """``i < K`` (or ``<=``, ``>``, ``>=``) among the conjuncts of the cond, ``i`` a carry scalar
  the body increments by a positive literal: the loop's remaining trip count is bounded."""
  cj, bj = cond_cj.jaxpr, body_cj.jaxpr
  carry_in = {v: i for i, v in enumerate(cj.invars[nc:])}
  prod = {o: e for e in cj.eqns for o in e.outvars}
  stack, conj = [cj.outvars[0]], []
  while stack:
    v = stack.pop()
    e = None if isinstance(v, jax.extend.core.Literal) else prod.get(v)  # a constant cond
    if e is not None and e.primitive.name == "and" and jnp.dtype(v.aval.dtype) == jnp.bool_:
      stack.extend(e.invars)
    else:
      conj.append(e)
  bprod = {o: e for e in bj.eqns for o in e.outvars}
  for e in conj:
    if e is None or e.primitive.name not in _CMP:
      continue
    kind, inclusive = _CMP[e.primitive.name]
    a, b = e.invars
    if kind == "gt":  # K > i  is  i < K
      a, b = b, a
    leaf = carry_in.get(a) if not isinstance(a, jax.extend.core.Literal) else None
    bound = _literal_int(b)
    if leaf is None or bound is None or a.aval.shape != () or not jnp.issubdtype(
        a.aval.dtype, jnp.integer):
      continue
    out = bj.outvars[leaf]
    be = None if isinstance(out, jax.extend.core.Literal) else bprod.get(out)
    if be is None or be.primitive.name != "add":
      continue
    x, y = be.invars
    me = bj.invars[nb + leaf]
    step = _literal_int(y) if x is me else _literal_int(x) if y is me else None
    if step is not None and step > 0:
      return Cap(leaf, step, bound, inclusive)
  return None


_SHRINK_SAMPLES = (1, 2, 3, 5, 8, 64, 1000, 1 << 16)


def shrinking(spec: LoopSpec) -> tuple[int, ...]:
  """The variables whose next size is smaller than the current one at some sampled sizes.

  JAX takes dim variables to be >= 1 (and shapes ``x[1:]`` as ``n - 1`` even where ``n`` may
  be 0), so a carry shrunk to nothing has no padded form: the hoisted loop stops once such a
  variable is below its ``least`` (1, or a tie's bound; the step that emptied it ran on a size
  in the traced domain), and the rest of the loop,
  the cond on the emptied carry first, runs exact.  A loop staged inside ``dynjax.jit``
  (``spec.staged``) stops there too and raises :class:`~dynjax.control._carry.EmptiedCarry`:
  it cannot leave its program, so the whole call runs op by op.
  """
  out = set()
  nv = len(spec.var_order)
  # Each variable at each sample size, the others at a few sizes of their own (``t`` a fixed
  # program dim in ``n - t``).  A variable guarded that never shrinks costs one compare a
  # step; one missed would come back wrong, so the grid errs on the wide side (4 variables:
  # 0.12 ms a spec, once a loop; CPU box).
  for x in _SHRINK_SAMPLES:
    for y in {1, 2, x, 1000, 1 << 16} if nv > 1 else {x}:
      for i in range(nv):
        if i in out:
          continue
        sizes = [y] * nv
        sizes[i] = x
        try:
          n = spec.next_host(*sizes)[i]
        except Exception:  # noqa: BLE001 - an expression undefined there (floordiv by 0)
          continue
        if int(n) < x:
          out.add(i)
  return tuple(sorted(out))


def empties(spec: LoopSpec, sizes) -> list[int]:
  """The shrinking variables (indices) whose size is below their ``least`` (1, or a tie's
  bound: past the padded domain)."""
  return [i for i in spec.shrinks if sizes[i] < spec.least[i]]


def bucket_for(spec: LoopSpec, sizes) -> tuple[int, ...]:
  out = []
  for p, n in zip(spec.policies, sizes, strict=True):
    b = p.bucket(n)
    out.append(p.grow(n) if b is None else b)
  return tuple(out)


def over_max(spec: LoopSpec, sizes, given=None) -> list[int]:
  """The variables (indices) whose size is past their policy's max (``given``: fixed ones)."""
  return [i for i, (p, n) in enumerate(zip(spec.policies, sizes, strict=True))
          if (given is None or given[i] is None) and p.bucket(n) is None]


def overflow_error(spec: LoopSpec, sizes, over: list[int]):
  """Every carry dim past its policy's max, where it sits in the carry, and how to fix it."""
  items = []
  for i in over:
    v = spec.var_order[i]
    uses = [f"{spec.paths[li]}.shape[{ax}]" for li, ax, vi, k in spec.solve
            if vi == i and k == 0]
    uses += [f"{spec.paths[li]}.shape[{ax}] = {d}" for li, ld in enumerate(spec.leaf_dims)
             for ax, d in enumerate(ld) if isinstance(d, str) and d != v
             and v in _symbolic.dim_vars_of(d)]  # axes tied to it (a cache at n0 - 1)
    items.append((spec.labels.get(spec.var_order[i], spec.var_order[i]), sizes[i], ", ".join(uses) or "the body's closure",
                  spec.policies[i]))
  return _overflow_error(items)


def capped_bucket(spec: LoopSpec, sizes, counter) -> tuple[int, ...] | None:
  """The bucket of the sizes after the most iterations the cap allows (None: no usable cap)."""
  n = spec.cap.iterations(int(np.asarray(counter)))
  if n > _CAP_MAX_ITERS:
    return None
  s = tuple(sizes)
  for _ in range(n):
    s = tuple(max(a, int(c)) for a, c in zip(s, spec.next_host(*s), strict=True))
  out = []
  for p, x in zip(spec.policies, s, strict=True):
    b = p.bucket(x)
    if b is None:
      return None
    out.append(b)
  return tuple(out)


def padded_shapes(spec: LoopSpec, sizes) -> tuple[tuple[int, ...], ...]:
  return spec.shapes_fn(*sizes)


def size_max(spec: LoopSpec, bucket: tuple[int, ...]) -> dict[str, int]:
  """Per variable whose next size depends on itself alone: the largest true size whose next
  size still fits the bucket (the hoisted body only ever runs on such sizes)."""
  out = {}
  for i, (v, txt) in enumerate(zip(spec.var_order, spec.next_exprs, strict=True)):
    if txt == v or not _symbolic.dim_vars_of(txt) <= {v}:
      continue
    fn = _symbolic.dim_fn([txt], (v,))
    b = bucket[i]
    s = b
    while s >= 1 and fn(s)[0] > b:
      s -= 1
    if 1 <= s < b:
      out[v] = s
  return out


def build_hoisted(spec: LoopSpec, bucket: tuple[int, ...]):
  env = dict(zip(spec.var_order, bucket, strict=True))
  shapes = padded_shapes(spec, bucket)
  nb, nc, nv = len(spec.body_consts), len(spec.cond_consts), len(spec.var_order)
  body_plan = pad_jaxpr(spec.body_cj, spec.var_order, env, size_max(spec, bucket))
  if tuple(map(tuple, body_plan.in_shapes[nb:])) != tuple(shapes):
    body_plan = pad_jaxpr(spec.body_cj, spec.var_order, env)
  cond_plan = pad_jaxpr(spec.cond_cj, spec.var_order, env)
  spec.rewrites = list(body_plan.rewrites) + list(cond_plan.rewrites)
  limit = jnp.asarray(bucket, jnp.int32) if nv else None
  next_dev = spec.next_dev
  shrinks = spec.shrinks
  unroll = spec.unroll
  limited = spec.max_iterations is not None  # the sizes vector then ends with the budget

  def go_of(s, cconsts, carry, it, budget):
    (p, ) = cond_plan.fun(tuple(s), *cconsts, *carry)
    p = jnp.asarray(p).astype(jnp.bool_)
    go = p if budget is None else p & (it < budget)
    if not nv:
      return p, go
    ns = jnp.stack([jnp.asarray(x, jnp.int32) for x in next_dev(*s)])
    go = go & jnp.all(ns <= limit)
    if shrinks:  # an emptied variable (< least): its cond has no padded form, the host's
      go = go & jnp.all(jnp.stack([jnp.asarray(s[i], jnp.int32) for i in shrinks])
                        >= jnp.asarray([spec.least[i] for i in shrinks], jnp.int32))
    return p, go

  def step(bconsts, s, carry):
    out = body_plan.fun(tuple(s), *bconsts, *carry)
    out = tuple(fit(o, shp).astype(o.dtype) for o, shp in zip(out, shapes, strict=True))
    return tuple(jnp.asarray(x, jnp.int32) for x in next_dev(*s)), out

  def run(*args):
    bconsts, cconsts = args[:nb], args[nb:nb + nc]
    sizes0, carry0 = args[nb + nc], tuple(args[nb + nc + 1:])
    s0 = tuple(sizes0[i] for i in range(nv))
    budget = sizes0[nv] if limited else None
    if unroll == 1:
      # The predicate is computed in the loop's condition (one fusion, as a hand-written
      # lax.while_loop has), the body is the padded body alone.
      def c(state):
        s, carry, it = state
        return go_of(s, cconsts, carry, it, budget)[1]

      def b(state):
        s, carry, it = state
        ns, out = step(bconsts, s, carry)
        return ns, out, it + 1

      s, carry, it = lax.while_loop(c, b, (s0, carry0, jnp.int32(0)))
    else:
      # k guarded steps per trip: a step whose guard is false keeps the old state (its results,
      # computed on a state that may not fit, are dropped by the select).
      def c(state):
        return state[3]

      def b(state):
        s, carry, it, g = state
        for _ in range(unroll):
          ns, out = step(bconsts, s, carry)
          s = tuple(jnp.where(g, x, y) for x, y in zip(ns, s, strict=True))
          carry = tuple(jnp.where(g, x, y) for x, y in zip(out, carry, strict=True))
          it = it + g.astype(jnp.int32)
          g = go_of(s, cconsts, carry, it, budget)[1]
        return s, carry, it, g

      g0 = go_of(s0, cconsts, carry0, jnp.int32(0), budget)[1]
      s, carry, it, _ = lax.while_loop(c, b, (s0, carry0, jnp.int32(0), g0))
    p = go_of(s, cconsts, carry, it, budget)[0]
    status = jnp.stack([p.astype(jnp.int32), *[jnp.asarray(x, jnp.int32) for x in s], it])
    return (*carry, status)

  # No donation: a carry may alias a value the caller still holds (an input whose shape is
  # already its bucket's, a program value that later segments read).  XLA copies the carry
  # into the loop's buffers once per invoke (once per bucket visited).
  return jax.jit(run)


