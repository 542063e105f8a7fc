"""``dynjax.while_loop``: loops whose carry changes shape, hoisted into one XLA loop per bucket.

Build (once per body/cond/carry signature):

1. Find the dynamic axes.  With ``dims=None`` the body is run abstractly on the initial carry
   (``jax.eval_shape``); every axis whose size changes becomes a dimension variable (axes with the
   same initial size and the same change share one).  With ``dims=`` the caller names them.
2. Trace ``body_fun`` and ``cond_fun`` with ``jax.export`` symbolic shapes.  The output carry's
   dims are expressions of the variables (``t + 1``, ``2*t``); they give the *next sizes* as a
   function of the current ones.  A carry whose new shape cannot be written that way (it depends
   on data, an axis changes rank, two axes sharing a variable disagree) is a
   :class:`~dynjax.ControlFlowError` listing every offending leaf.
3. Per bucket, the padding pass (``dynjax.bucketing._padding.pad_jaxpr``) makes the body and
   cond exact on the padded carry, and a *hoisted* executable runs
   ``lax.while_loop(cond & next_sizes_fit_bucket, body)`` on the padded carry, the true sizes
   riding along as int32 scalars (one copy of the carry per invoke: no donation, a carry may
   alias a value its caller still holds).  The body's plan is told that the true sizes stay where the
   next sizes fit the bucket (``size_max``), so a ``t + 1`` carry is written in place at the true
   length (no copy of the carry per iteration).  ``unroll=k`` runs k guarded steps per XLA loop
   trip (the host-side cost of a trip is paid once per k tokens on GPU).  It returns the carry
   and a status vector ``[pred, sizes..., iterations]``.
4. The *cap* of a loop: when ``cond_fun`` holds a conjunct ``i < K`` on an integer carry scalar
   that the body increments by a constant (``step < max_new``), the loop runs at most
   ``ceil((K - i0) / c)`` more times, so its final sizes are bounded before it starts.
   ``bucket_from="cap"`` starts in the bucket of that bound (one bucket, no crossing, one extra
   sync to read ``i0``); ``"init"`` starts in the bucket of the initial sizes and grows.

Run (the VM program, see ``as_text()``): pick the bucket, pad on the host, then loop
``invoke hoisted[bucket]; read status; if pred: repad to the next bucket, goto loop``.  The host
reads ONE small status vector per bucket visited: host syncs = buckets crossed + 1 (+1 for the
cap's counter).  Finally the carry is unpadded to its exact shapes (small leaves via the host).

Inside a host program (``dynjax.jit`` of a function that calls ``while_loop``: see
``dynjax/control/_staging.py``) the loop is staged with the program's symbolic dims: program
dims the carry or the body's closure carry become loop variables that never change, and the
loop takes and returns *padded* values (``padded_io`` program: no host padding, no unpad).

When the padding pass cannot make the body exact (or ``padding="exact"``), the loop runs in
exact mode: one executable per exact shape (compiled on first use, cached by ``jax.jit``), one
host sync per iteration for the predicate.  ``loop_stats()["mode"]`` says which ran and why.

A body that itself runs a shape-changing ``dynjax.while_loop`` (a nested loop) cannot be one XLA
loop: the outer loop then runs in *host* mode (``_hostloop.py``): host iterations whose body is a
compiled host program (segments + the inner loop's own hoisted program).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export, lax

from dynjax import _jax_private as jp
from dynjax._errors import ControlFlowError, PaddingUnsupportedError, format_list
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.control._frontend import NotLowerable, any_tracer, building, needs_vm
from dynjax.runtime import VM, Kernel, ProgramBuilder
from dynjax.runtime._vm import _fit
from dynjax.runtime._vm import record as _record_stats

try:  # the padding pass (issue 3); without it loops run in exact mode
  from dynjax.bucketing._padding import pad_jaxpr as _pad_jaxpr
except ImportError:  # pragma: no cover - depends on the padding pass being present
  _pad_jaxpr = None

_DEFAULT_POLICY = pow2(min=16)
_BUCKET_FROM = ("auto", "cap", "init")
_CAP_MAX_ITERS = 1 << 16  # a cap further away than this many iterations is not used

# Evaluating dim expressions (jax prints them with these helpers) on host ints / traced int32.
_HOST_NS = {"floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "max": max, "min": min,
            "non_negative": lambda a: max(a, 0), "__builtins__": {}}
_DEV_NS = {"floordiv": jnp.floor_divide, "mod": jnp.mod, "max": jnp.maximum,
           "min": jnp.minimum, "non_negative": lambda a: jnp.maximum(a, 0), "__builtins__": {}}
_HELPERS = {"floordiv", "mod", "max", "min", "non_negative"}


def _compile_exprs(exprs: list[str], var_order: tuple[str, ...], ns: dict) -> Callable:
  body = f"({', '.join(exprs)},)" if exprs else "()"
  src = f"lambda {', '.join(var_order)}: {body}"
  return eval(src, dict(ns))  # noqa: S307 - text from jax's own printer of dim expressions


def _compile_shapes(leaf_dims: list[tuple], var_order: tuple[str, ...]) -> Callable:
  """``fn(*sizes) -> tuple of leaf shapes`` from per-axis ints / expression texts."""
  leaves = ", ".join("(" + "".join(f"{d}, " for d in ld) + ")" for ld in leaf_dims)
  args = ", ".join(var_order)
  return eval(f"lambda {args}: ({leaves}{',' if leaf_dims else ''})",  # noqa: S307
              dict(_HOST_NS))


def _names(text: str) -> set[str]:
  return set(re.findall(r"[A-Za-z_]\w*", text)) - _HELPERS


def _is_sym(d) -> bool:
  return not isinstance(d, int | np.integer)


def _keypaths(treedef) -> list[str]:
  dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  return [("init" + jax.tree_util.keystr(p)) for p, _ in
          jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _trace_symbolic(part: str, fn, sym_avals):
  """``make_jaxpr`` of the loop's body or cond over symbolic carries, errors named for the user."""
  try:
    with building(f"while_loop {part}"):
      return jax.make_jaxpr(fn)(*sym_avals)
  except ControlFlowError:
    raise
  except Exception as e:
    raise _trace_error(f"{part}_fun", e) from None


def _trace_error(what: str, e: Exception) -> ControlFlowError:
  first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  if isinstance(e, jax.errors.ConcretizationTypeError | jax.errors.TracerBoolConversionError
                | jax.errors.TracerIntegerConversionError | jax.errors.NonConcreteBooleanIndexError):
    return ControlFlowError(
        f"{what} makes a shape depend on data values ({type(e).__name__}: {first}). "
        "dynjax.while_loop needs every carry dim to be a function of the carry's dims (e.g. "
        "t + 1), not of array contents; give such ops a static size (jnp.nonzero(x, size=n)), "
        "or move the data-dependent part into cond_fun.")
  if type(e).__name__ == "InconclusiveDimensionOperation":
    return ControlFlowError(
        f"{what} compares a dynamic carry dim in Python ({first}). With shapes that change, "
        "dims are symbolic while dynjax traces the loop: write the comparison as an array "
        "op, e.g. jnp.asarray(x.shape[0]) < 8 instead of x.shape[0] < 8.")
  return ControlFlowError(f"{what} could not be traced with symbolic dims: "
                          f"{type(e).__name__}: {first}")


@dataclasses.dataclass(frozen=True)
class _Cap:
  """``cond_fun`` holds ``carry[leaf] < bound`` (``<=`` if inclusive); the body adds ``step``."""

  leaf: int
  step: int
  bound: int
  inclusive: bool

  def iterations(self, x0: int) -> int:
    last = self.bound if self.inclusive else self.bound - 1  # largest value that continues
    return 0 if x0 > last else (last - x0) // self.step + 1


@dataclasses.dataclass
class _LoopSpec:
  """Everything traced once per (cond, body, carry signature)."""

  treedef: Any
  paths: list[str]
  dtypes: list
  var_order: tuple[str, ...]
  leaf_dims: list[tuple]  # per leaf: per axis an int, a var name or an expression text
  solve: list[tuple[int, int, int]]  # (leaf, axis, var index) to read sizes from shapes
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
  cap: _Cap | None = None
  shapes_fn: Callable = None
  next_host: Callable = None
  next_dev: Callable = None
  hoisted: Kernel = None
  exact_body: Kernel = None
  exact_cond: Kernel = None
  fallback_reason: str | None = None
  rewrites: list = dataclasses.field(default_factory=list)


def _hoist_consts(closed):
  j = closed.jaxpr
  j2 = j.replace(constvars=[], invars=list(j.constvars) + list(j.invars))
  return jax.extend.core.ClosedJaxpr(j2, []), list(closed.consts)


def _auto_dims(body_flat, avals, paths) -> tuple[list[tuple], list[str]]:
  """Per leaf the axes that change (as var names) -- from one abstract concrete step."""
  try:
    with building("while_loop body"):
      outs = jax.eval_shape(body_flat, *avals)
  except ControlFlowError:
    raise
  except Exception as e:
    raise _trace_error("body_fun", e) from None
  _check_structure("body_fun", avals, outs, None, None, paths)
  groups: dict[tuple[int, int], str] = {}
  dims = []
  for a, o in zip(avals, outs, strict=True):
    per = []
    for d_in, d_out in zip(a.shape, o.shape, strict=False):
      if d_in == d_out:
        per.append(int(d_in))
      else:
        name = groups.setdefault((d_in, d_out), f"n{len(groups)}")
        per.append(name)
    dims.append(tuple(per))
  return dims, sorted(set(groups.values()), key=lambda s: int(s[1:]))


def _check_structure(what, avals_in, outs, treedef, out_tree, paths) -> None:
  if out_tree != treedef:
    raise ControlFlowError(f"{what} must return a carry with the structure of init: expected "
                           f"{treedef}, got {out_tree}")
  bad = []
  for p, a, o in zip(paths, avals_in, outs, strict=True):
    if jnp.dtype(a.dtype) != jnp.dtype(o.dtype):
      bad.append(f"{p}: dtype {jnp.dtype(a.dtype).name} -> {jnp.dtype(o.dtype).name}")
    if len(a.shape) != len(o.shape):
      bad.append(f"{p}: rank {len(a.shape)} -> {len(o.shape)} (shape {tuple(a.shape)} -> "
                 f"{tuple(o.shape)})")
  if bad:
    raise ControlFlowError(
        f"{what} changes the carry in ways dims cannot express:\n" + format_list(bad)
        + "\nA carry leaf may change its sizes along axes, but not its dtype or rank.")


def _flat_fns(cond_fun, body_fun, treedef):
  def body_flat(*leaves):
    out = body_fun(jax.tree_util.tree_unflatten(treedef, leaves))
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    if out_tree != treedef:
      raise ControlFlowError(f"body_fun must return a carry with the structure of init: "
                             f"expected {treedef}, got {out_tree}")
    return out_leaves

  def cond_flat(*leaves):
    return cond_fun(jax.tree_util.tree_unflatten(treedef, leaves))

  return cond_flat, body_flat


def _build_spec(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
                bucket_from) -> _LoopSpec:
  """The spec of a loop run on concrete values (its own symbolic scope)."""
  paths = _keypaths(treedef)
  cond_flat, body_flat = _flat_fns(cond_fun, body_fun, treedef)
  if dims is None:
    leaf_dims, var_order = _auto_dims(body_flat, avals, paths)
  else:
    leaf_dims, var_order = _explicit_dims(dims, treedef, avals, paths)
  var_order = tuple(var_order)
  sym = export.symbolic_shape(", ".join(var_order)) if var_order else ()
  sym_of = dict(zip(var_order, sym, strict=True))
  sym_avals = [jax.ShapeDtypeStruct(tuple(sym_of[d] if isinstance(d, str) else d for d in ld),
                                    a.dtype) for ld, a in zip(leaf_dims, avals, strict=True)]
  policies = dict(zip(var_order, _policies(buckets, var_order), strict=True))
  spec = spec_from_symbolic(cond_fun, body_fun, treedef, paths, sym_avals, leaf_dims,
                            var_order, policies.__getitem__, padding, unroll, bucket_from)
  spec.exact_body = Kernel("while.body_exact", lambda key: jax.jit(body_flat),
                           lambda key: "exact")
  spec.exact_cond = Kernel("while.cond_exact", lambda key: jax.jit(
      lambda *xs: (jnp.asarray(cond_flat(*xs)),)), lambda key: "exact")
  return spec


def spec_from_symbolic(cond_fun, body_fun, treedef, paths, sym_avals, leaf_dims, var_order,
                       policy_of, padding, unroll, bucket_from, allow_tracer_consts=False
                       ) -> _LoopSpec:
  """Traces body and cond over symbolic carries and derives next sizes, cap and kernels.

  ``leaf_dims``: per leaf per axis an int, a var name of ``var_order`` (a loop variable) or, for
  staged loops, the text of a fixed program dim expression.  ``policy_of(var)``: its bucket
  policy.  Dims of the closure (staged loops: program values the body reads) that are not in
  ``var_order`` become loop variables that never change.
  """
  cond_flat, body_flat = _flat_fns(cond_fun, body_fun, treedef)
  body_closed = _trace_symbolic("body", body_flat, sym_avals)
  cond_closed = _trace_symbolic("cond", cond_flat, sym_avals)
  outs = body_closed.out_avals
  _check_structure("body_fun", sym_avals, outs, treedef, treedef, paths)
  (pa,) = cond_closed.out_avals if len(cond_closed.out_avals) == 1 else (None,)
  if pa is None or tuple(pa.shape) != () or not (jnp.issubdtype(pa.dtype, jnp.bool_)
                                                 or jnp.issubdtype(pa.dtype, jnp.integer)):
    raise ControlFlowError(
        f"cond_fun must return one scalar boolean, got {cond_closed.out_avals}")
  var_order = tuple(var_order)
  # Next sizes: each variable's new value, consistently across every axis that uses it.
  next_of: dict[str, str] = {}
  where_of: dict[str, str] = {}
  bad = []
  for p, ld, a, o in zip(paths, leaf_dims, sym_avals, outs, strict=True):
    for ax, (d_dim, d_in, d_out) in enumerate(zip(ld, a.shape, o.shape, strict=True)):
      if isinstance(d_dim, str) and d_dim in var_order:
        text = str(d_out)
        prev = next_of.setdefault(d_dim, text)
        where_of.setdefault(d_dim, f"{p}.shape[{ax}]")
        if prev != text:
          bad.append(f"{p}.shape[{ax}]: {d_dim} -> {text}, but {where_of[d_dim]}: {d_dim} -> "
                     f"{prev}; axes sharing a dimension must change alike")
      elif _is_sym(d_in):
        if not (_is_sym(d_out) and d_in == d_out):
          bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out} (a fixed axis of the enclosing "
                     "program that the body changes)")
      elif _is_sym(d_out):
        bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out} (a fixed axis whose new size depends "
                   "on other dims); declare it dynamic with dims=")
      elif int(d_out) != int(d_in):
        bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out}")
  if bad:
    raise ControlFlowError(
        "body_fun changes the carry's shape in a way its dims cannot express:\n"
        + format_list(bad)
        + "\nEach dynamic axis must become an expression of the carry's dims (e.g. t + 1).")
  bcj, bconsts = _hoist_consts(body_closed)
  ccj, cconsts = _hoist_consts(cond_closed)
  extra = set()
  for a in (*bcj.in_avals, *ccj.in_avals):
    for d in a.shape:
      if _is_sym(d):
        extra |= jp.dim_expr_vars(d)
  var_order = var_order + tuple(sorted(extra - set(var_order)))
  known = set(var_order)
  for v in var_order:
    txt = next_of.get(v, v)
    if not _names(txt) <= known:
      raise ControlFlowError(f"next size of {v} is {txt}, which uses unknown names")
  next_exprs = [next_of.get(v, v) for v in var_order]
  solve = []
  for li, ld in enumerate(leaf_dims):
    for ax, d in enumerate(ld):
      if isinstance(d, str) and d in var_order:
        solve.append((li, ax, var_order.index(d)))
  if not allow_tracer_consts and (any_tracer(bconsts) or any_tracer(cconsts)):
    raise needs_vm("while_loop", "body_fun/cond_fun close over JAX tracers")
  spec = _LoopSpec(treedef, paths, [a.dtype for a in sym_avals], var_order, list(leaf_dims),
                   solve, next_exprs, bcj, bconsts, ccj, cconsts,
                   [policy_of(v) for v in var_order], padding,
                   cond_fun, body_fun, unroll=unroll, bucket_from=bucket_from)
  spec.cap = _find_cap(bcj, ccj, len(bconsts), len(cconsts), len(leaf_dims))
  spec.shapes_fn = _compile_shapes([tuple(str(d) for d in ld) for ld in leaf_dims], var_order)
  spec.next_host = _compile_exprs(next_exprs, var_order, _HOST_NS)
  spec.next_dev = _compile_exprs(next_exprs, var_order, _DEV_NS)
  spec.hoisted = Kernel("while.hoisted", lambda key: _build_hoisted(spec, key),
                        lambda key: f"bucket={dict(zip(var_order, key, strict=True))}")
  return spec


def _explicit_dims(dims, treedef, avals, paths):
  try:
    specs = treedef.flatten_up_to(dims) if treedef.num_leaves != 1 or not isinstance(
        dims, str | type(None)) else [dims]
  except (ValueError, TypeError) as e:
    raise ControlFlowError(f"dims must match the structure of init ({treedef}): {e}") from None
  leaf_dims, names, bad = [], set(), []
  for p, s, a in zip(paths, specs, avals, strict=True):
    if s is None:
      leaf_dims.append(tuple(int(d) for d in a.shape))
      continue
    parts = [x.strip() for x in s.split(",") if x.strip()]
    if len(parts) != len(a.shape):
      bad.append(f"{p}: spec {s!r} has {len(parts)} axes, the array has shape {tuple(a.shape)}")
      leaf_dims.append(tuple(int(d) for d in a.shape))
      continue
    per = []
    for ax, (t, n) in enumerate(zip(parts, a.shape, strict=True)):
      if t.isdigit():
        if int(t) != n:
          bad.append(f"{p}.shape[{ax}]: spec says {t}, got {n}")
        per.append(int(t))
      elif re.fullmatch(r"[A-Za-z_]\w*", t):
        per.append(t)
        names.add(t)
      else:
        bad.append(f"{p}.shape[{ax}]: {t!r}: a carry axis must be a name or an integer")
        per.append(int(n))
    leaf_dims.append(tuple(per))
  if bad:
    raise ControlFlowError("dims do not fit init:\n" + format_list(bad))
  return leaf_dims, sorted(names)


def _policies(buckets, var_order) -> list[BucketPolicy]:
  if buckets is None:
    return [_DEFAULT_POLICY] * len(var_order)
  if isinstance(buckets, Mapping):
    unknown = sorted(set(buckets) - set(var_order))
    if unknown:
      raise ControlFlowError(f"buckets names {unknown}, which are not carry dims {var_order}")
    return [as_policy(buckets[v], f"[{v!r}]") if v in buckets else _DEFAULT_POLICY
            for v in var_order]
  pol = as_policy(buckets, "")
  return [pol] * len(var_order)


# -- the cap: a bound on the final sizes read from cond_fun ---------------------------------
_CMP = {"lt": ("lt", False), "le": ("lt", True), "gt": ("gt", False), "ge": ("gt", True)}


def _literal_int(v) -> int | None:
  if isinstance(v, jax.extend.core.Literal):
    val = np.asarray(v.val)
    if val.ndim == 0 and np.issubdtype(val.dtype, np.integer):
      return int(val)
  return None


def _find_cap(body_cj, cond_cj, nb: int, nc: int, n: int) -> _Cap | None:
  """``i < K`` (or ``<=``, ``>``, ``>=``) among the conjuncts of the cond, ``i`` a carry scalar
  the body increments by a positive literal: the loop's remaining trip count is bounded."""
  cj, bj = cond_cj.jaxpr, body_cj.jaxpr
  carry_in = {v: i for i, v in enumerate(cj.invars[nc:])}
  prod = {o: e for e in cj.eqns for o in e.outvars}
  stack, conj = [cj.outvars[0]], []
  while stack:
    v = stack.pop()
    e = prod.get(v)
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
    be = bprod.get(out)
    if be is None or be.primitive.name != "add":
      continue
    x, y = be.invars
    me = bj.invars[nb + leaf]
    step = _literal_int(y) if x is me else _literal_int(x) if y is me else None
    if step is not None and step > 0:
      return _Cap(leaf, step, bound, inclusive)
  return None


def _bucket_for(spec: _LoopSpec, sizes) -> tuple[int, ...]:
  out = []
  for p, n in zip(spec.policies, sizes, strict=True):
    b = p.bucket(n)
    out.append(p.grow(n) if b is None else b)
  return tuple(out)


def _capped_bucket(spec: _LoopSpec, sizes, counter) -> tuple[int, ...] | None:
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


def _padded_shapes(spec: _LoopSpec, sizes) -> tuple[tuple[int, ...], ...]:
  return spec.shapes_fn(*sizes)


def _size_max(spec: _LoopSpec, bucket: tuple[int, ...]) -> dict[str, int]:
  """Per variable whose next size depends on itself alone: the largest true size whose next
  size still fits the bucket (the hoisted body only ever runs on such sizes)."""
  out = {}
  for i, (v, txt) in enumerate(zip(spec.var_order, spec.next_exprs, strict=True)):
    if txt == v or not _names(txt) <= {v}:
      continue
    fn = eval(f"lambda {v}: {txt}", dict(_HOST_NS))  # noqa: S307 - jax's printer
    b = bucket[i]
    s = b
    while s >= 1 and fn(s) > b:
      s -= 1
    if 1 <= s < b:
      out[v] = s
  return out


def _build_hoisted(spec: _LoopSpec, bucket: tuple[int, ...]):
  env = dict(zip(spec.var_order, bucket, strict=True))
  shapes = _padded_shapes(spec, bucket)
  nb, nc, nv = len(spec.body_consts), len(spec.cond_consts), len(spec.var_order)
  body_plan = _pad_jaxpr(spec.body_cj, spec.var_order, env, _size_max(spec, bucket))
  if tuple(map(tuple, body_plan.in_shapes[nb:])) != tuple(shapes):
    body_plan = _pad_jaxpr(spec.body_cj, spec.var_order, env)
  cond_plan = _pad_jaxpr(spec.cond_cj, spec.var_order, env)
  spec.rewrites = list(body_plan.rewrites) + list(cond_plan.rewrites)
  limit = jnp.asarray(bucket, jnp.int32) if nv else None
  next_dev = spec.next_dev
  unroll = spec.unroll

  def go_of(s, cconsts, carry):
    (p, ) = cond_plan.fun(tuple(s), *cconsts, *carry)
    p = jnp.asarray(p).astype(jnp.bool_)
    if not nv:
      return p, p
    ns = jnp.stack([jnp.asarray(x, jnp.int32) for x in next_dev(*s)])
    return p, p & jnp.all(ns <= limit)

  def step(bconsts, s, carry):
    out = body_plan.fun(tuple(s), *bconsts, *carry)
    out = tuple(_fit(o, shp).astype(o.dtype) for o, shp in zip(out, shapes, strict=True))
    return tuple(jnp.asarray(x, jnp.int32) for x in next_dev(*s)), out

  def run(*args):
    bconsts, cconsts = args[:nb], args[nb:nb + nc]
    sizes0, carry0 = args[nb + nc], tuple(args[nb + nc + 1:])
    s0 = tuple(sizes0[i] for i in range(nv))
    if unroll == 1:
      # The predicate is computed in the loop's condition (one fusion, as a hand-written
      # lax.while_loop has), the body is the padded body alone.
      def c(state):
        s, carry, _ = state
        return go_of(s, cconsts, carry)[1]

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
          g = go_of(s, cconsts, carry)[1]
        return s, carry, it, g

      g0 = go_of(s0, cconsts, carry0)[1]
      s, carry, it, _ = lax.while_loop(c, b, (s0, carry0, jnp.int32(0), g0))
    p = go_of(s, cconsts, carry)[0]
    status = jnp.stack([p.astype(jnp.int32), *[jnp.asarray(x, jnp.int32) for x in s], it])
    return (*carry, status)

  # No donation: a carry may alias a value the caller still holds (an input whose shape is
  # already its bucket's, a program value that later segments read).  XLA copies the carry
  # into the loop's buffers once per invoke (once per bucket visited).
  return jax.jit(run)


class _Loop:
  """A built loop: its spec and its VM programs (hoisted, exact, hoisted with padded I/O)."""

  def __init__(self, spec: _LoopSpec):
    self.spec = spec
    self.mode = "hoisted"
    if spec.padding == "exact":
      self.mode, spec.fallback_reason = "exact", 'padding="exact"'
    elif _pad_jaxpr is None:
      self.mode, spec.fallback_reason = "exact", "the padding pass is not available"
    self._vms: dict[str, VM] = {}
    self._fixed = [tuple((ax, int(d)) for ax, d in enumerate(ld) if not isinstance(d, str))
                   for ld in spec.leaf_dims]

  def accepts(self, shapes) -> bool:
    """Whether concrete carry shapes fit this loop's dims (static axes and shared sizes)."""
    spec = self.spec
    for fixed, shape in zip(self._fixed, shapes, strict=True):
      for ax, n in fixed:
        if shape[ax] != n:
          return False
    sizes = [0] * len(spec.var_order)
    for li, ax, vi in spec.solve:
      sizes[vi] = shapes[li][ax]
    return tuple(map(tuple, spec.shapes_fn(*sizes))) == tuple(map(tuple, shapes))

  def vm(self, mode: str) -> VM:
    v = self._vms.get(mode)
    if v is None:
      if mode == "exact":
        prog = _exact_program(self.spec)
      else:
        prog = _hoisted_program(self.spec, padded_io=mode == "padded_io")
      v = self._vms[mode] = VM(prog)
    return v

  def run(self, leaves: list) -> list:
    spec = self.spec
    consts = [*spec.body_consts, *spec.cond_consts]
    if self.mode == "hoisted":
      try:
        vm = self.vm("hoisted")
        outs = vm.run(*consts, *leaves)
      except PaddingUnsupportedError as e:
        self.mode = "exact"
        spec.fallback_reason = f"padding pass: {str(e).splitlines()[0]}"
        return self.run(leaves)
    else:
      vm = self.vm("exact")
      outs = vm.run(*consts, *leaves)
    self._record(vm)
    return list(outs)

  def run_padded(self, consts: list, leaves: list, sizes: tuple, buckets: tuple) -> tuple:
    """Padded carry in (any padded shapes holding ``sizes``), padded carry out.

    ``buckets``: per variable a bucket to use (fixed program dims) or None (the loop's own
    choice).  Returns ``(padded carry, final sizes, final bucket)``.
    """
    vm = self.vm("padded_io")
    *outs, status, bk = vm.run(*consts, *leaves, sizes, buckets)
    self._record(vm)
    nv = len(self.spec.var_order)
    return list(outs), tuple(int(x) for x in status[1:1 + nv]), tuple(bk)

  def _record(self, vm: VM) -> None:
    spec = self.spec
    st = vm.take_stats()
    info = dict(mode=self.mode, host_syncs=st.host_syncs, invokes=st.invokes,
                repads=st.repads, compiles=st.compiles, instructions=st.instructions,
                unroll=spec.unroll)
    if self.mode == "hoisted":
      info.update(_LAST_RUN.pop("info", {}))
      extra = info.pop("host_syncs_cap", 0)  # the cap's read of the counter
      info["host_syncs"] += extra
      st.host_syncs += extra
    else:
      info["iterations"] = st.invokes // 2
      info["buckets"] = []
      info["fallback"] = spec.fallback_reason
    info["buckets_crossed"] = max(0, len(info["buckets"]) - 1)
    st.loops.append(info)
    _LAST_RUN["loop"] = info
    _record_stats(st)


_LAST_RUN: dict = {}


def _use_cap(spec: _LoopSpec) -> bool:
  if spec.cap is None:
    return False
  if spec.bucket_from == "auto":
    return jax.default_backend() != "cpu"
  return spec.bucket_from == "cap"


def _hoisted_program(spec: _LoopSpec, padded_io: bool = False):
  """The hoisted loop's program.  ``padded_io``: takes padded carries plus host ``sizes`` and
  ``buckets`` (fixed dims of an enclosing program), returns the padded carry, the status and the
  final bucket (no host padding, no unpadding: the caller keeps the data padded)."""
  nb, nc, n = len(spec.body_consts), len(spec.cond_consts), len(spec.leaf_dims)
  names = ([f"bc{i}" for i in range(nb)] + [f"cc{i}" for i in range(nc)]
           + [f"carry{i}" for i in range(n)] + (["sizes", "buckets"] if padded_io else []))
  b = ProgramBuilder("while_loop.padded_io" if padded_io else "while_loop",
                     nb + nc + n + (2 if padded_io else 0), names)
  consts, carry = b.args[:nb + nc], b.args[nb + nc:nb + nc + n]
  solve = spec.solve
  nv = len(spec.var_order)
  use_cap = _use_cap(spec)
  cap_leaf = spec.cap.leaf if spec.cap is not None else None

  def sizes_of(*xs):
    sizes = [0] * nv
    for li, ax, vi in solve:
      sizes[vi] = xs[li].shape[ax]
    return tuple(sizes)

  def start_info(sizes):
    info = {"iterations": 0, "buckets": [], "cap": None}
    _LAST_RUN["info"] = info
    return sizes

  def start_bucket(sizes, given=None, counter=None):
    info = _LAST_RUN["info"]
    bk = _bucket_for(spec, sizes)
    if given is not None:
      bk = tuple(g if g is not None else x for g, x in zip(given, bk, strict=True))
    if use_cap:
      capped = _capped_bucket(spec, sizes, counter)  # reads the counter: one sync
      info["host_syncs_cap"] = 1
      if capped is not None:
        info["cap"] = capped
        bk = tuple(max(a, c) if given is None or given[i] is None else a
                   for i, (a, c) in enumerate(zip(bk, capped, strict=True)))
    info["buckets"].append(bk)
    return bk

  def bucket_of(sizes):
    bk = _bucket_for(spec, sizes)
    _LAST_RUN["info"]["buckets"].append(bk)
    return bk

  def shapes_of(bucket):
    return _padded_shapes(spec, bucket)

  def sizes_array(sizes):
    return np.asarray(sizes, np.int32).reshape(nv)

  def keep_going(status):
    _LAST_RUN["info"]["iterations"] += int(status[-1])
    return bool(status[0])

  def grow_sizes(status):
    cur = tuple(int(x) for x in status[1:1 + nv])
    nxt = tuple(int(x) for x in spec.next_host(*cur))
    return tuple(max(a, c) for a, c in zip(cur, nxt, strict=True)), cur

  def first(pair):
    return pair[0]

  def second(pair):
    return pair[1]

  def final_shapes(status):
    return _padded_shapes(spec, tuple(int(x) for x in status[1:1 + nv]))

  if padded_io:
    sizes_in, given = b.args[-2], b.args[-1]
    sizes = b.emit_host_op(start_info, [sizes_in])
  else:
    sizes = b.emit_host_op(sizes_of, carry)
    b.emit_host_op(start_info, [sizes], dst=sizes)
  counter = [carry[cap_leaf]] if use_cap else []
  if padded_io:
    bk = b.emit_host_op(start_bucket, [sizes, given, *counter])
  else:
    def start(s, *c):
      return start_bucket(s, None, *c)

    start.__name__ = "start_bucket"
    bk = b.emit_host_op(start, [sizes, *counter])
  shp = b.emit_host_op(shapes_of, [bk])
  if padded_io:
    b.emit_repad(carry, shp, dsts=carry)
  else:
    b.emit_pad(carry, shp, dsts=carry)
  sz = b.emit_host_op(sizes_array, [sizes])
  status = b.new_reg("status")
  status_h = b.new_reg("st")
  b.block("loop")
  b.emit_invoke_into(spec.hoisted, None, [*consts, sz, *carry], [*carry, status], key_reg=bk)
  b.emit_read_scalar(status, dst=status_h)
  go = b.emit_host_op(keep_going, [status_h])
  b.emit_if(go, "grow", "done")
  b.block("grow")
  pair = b.emit_host_op(grow_sizes, [status_h])
  need = b.emit_host_op(first, [pair])
  b.emit_host_op(bucket_of, [need], dst=bk)
  b.emit_host_op(shapes_of, [bk], dst=shp)
  b.emit_repad(carry, shp, dsts=carry)
  cur = b.emit_host_op(second, [pair])
  b.emit_host_op(sizes_array, [cur], dst=sz)
  b.emit_goto("loop")
  b.block("done")
  if padded_io:
    b.emit_ret([*carry, status_h, bk])
  else:
    fs = b.emit_host_op(final_shapes, [status_h])
    out = b.emit_unpad(carry, fs)
    b.emit_ret(out)
  return b.finish()


def _exact_program(spec: _LoopSpec):
  nb, nc, n = len(spec.body_consts), len(spec.cond_consts), len(spec.leaf_dims)
  b = ProgramBuilder("while_loop.exact", nb + nc + n,
                     [f"bc{i}" for i in range(nb)] + [f"cc{i}" for i in range(nc)]
                     + [f"carry{i}" for i in range(n)])
  carry = b.args[nb + nc:]
  key = b.new_reg("shapes")
  pred = b.new_reg("pred")
  ph = b.new_reg("pred_h")
  b.block("loop")
  b.emit_host_op(_shapes_key, carry, dst=key)
  b.emit_invoke_into(spec.exact_cond, None, carry, [pred], key_reg=key)
  b.emit_read_scalar(pred, dst=ph)
  b.emit_if(ph, "body", "done")
  b.block("body")
  b.emit_invoke_into(spec.exact_body, None, carry, carry, key_reg=key)
  b.emit_goto("loop")
  b.block("done")
  b.emit_ret(carry)
  return b.finish()


def _shapes_key(*xs):
  return tuple(x.shape for x in xs)


# -- cache of built loops --------------------------------------------------------------------
# (cond, body, structure, dtypes and ranks, options) -> the loops built for it.  A loop serves
# every init whose static axes and shared dims fit it (Loop.accepts), so a new prompt length
# reuses the compiled buckets instead of tracing and compiling again.
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_MAX = 64
_PER_KEY = 8


def _get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll=1,
              bucket_from="init"):
  dkey = None if dims is None else repr(dims)
  bkey = repr(buckets)
  key = (cond_fun, body_fun, treedef, tuple((len(a.shape), str(a.dtype)) for a in avals),
         dkey, bkey, padding, unroll, bucket_from)
  shapes = [tuple(a.shape) for a in avals]
  loops = _CACHE.get(key)
  if loops is None:
    loops = _CACHE[key] = []
    if len(_CACHE) > _CACHE_MAX:
      _CACHE.popitem(last=False)
  else:
    _CACHE.move_to_end(key)
    for loop in loops:
      if loop.accepts(shapes):
        return loop
  try:
    spec = _build_spec(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
                       bucket_from)
  except NotLowerable as e:
    from dynjax.control._hostloop import HostLoop

    loop = HostLoop(cond_fun, body_fun, treedef, avals, dims, buckets, str(e))
  else:
    loop = _Loop(spec)
  loops.append(loop)
  del loops[:-_PER_KEY]
  return loop


def _check_options(padding, unroll, bucket_from):
  if padding not in ("auto", "exact"):
    raise ControlFlowError(f'padding must be "auto" or "exact", got {padding!r}')
  if unroll is not None and (not isinstance(unroll, int | np.integer) or isinstance(unroll, bool)
                             or unroll < 1):
    raise ControlFlowError(f"unroll must be None (auto) or an int >= 1, got {unroll!r}")
  if bucket_from not in _BUCKET_FROM:
    raise ControlFlowError(f"bucket_from must be one of {list(_BUCKET_FROM)}, got "
                           f"{bucket_from!r}")


def default_unroll() -> int:
  """``unroll=None``: 1 on CPU (a trip costs ~1 us there), 4 on GPU/TPU (a trip of an XLA GPU
  while loop copies its predicate to the host and waits for it)."""
  return 1 if jax.default_backend() == "cpu" else 4


def while_loop(cond_fun: Callable, body_fun: Callable, init_val, *, dims=None,
               buckets: BucketPolicy | Mapping[str, Any] | list | None = None,
               padding: str = "auto", unroll: int | None = None, bucket_from: str = "auto"):
  """``lax.while_loop`` whose carry may change shape from one iteration to the next.

  While the carry stays inside its bucket, iterations run inside ONE compiled
  ``lax.while_loop`` on the padded carry; the host syncs once per bucket visited (see the module
  docstring).  ``cond_fun`` may depend on device values.

  Args:
    cond_fun: ``carry -> bool scalar``.
    body_fun: ``carry -> carry``; leaves keep dtype and rank, sizes may change along axes as
      expressions of the carry's sizes (``t -> t + 1``).
    init_val: the initial carry (a pytree of arrays).
    dims: ``None`` (axes that change are found automatically) or a pytree like ``init_val``
      of spec strings (``"b, t"``) / ``None`` naming the dynamic axes.
    buckets: one policy for every dim, or ``{name: policy}`` (default ``pow2(min=16)``).
    padding: ``"auto"`` (hoisted, exact through the padding pass; exact mode when it cannot)
      or ``"exact"`` (one executable per exact shape, one host sync per iteration).
    unroll: guarded body steps per XLA loop trip (``None``: 1 on CPU, 4 on GPU/TPU).
    bucket_from: ``"cap"`` (start in the bucket of the final sizes that ``cond_fun`` bounds,
      e.g. ``step < max_new``: no bucket crossing, one sync to read the counter), ``"init"``
      (start in the bucket of the initial sizes and grow), ``"auto"`` (``"cap"`` on GPU/TPU,
      where a bigger bucket costs little per step; ``"init"`` on CPU).

  Returns:
    The final carry, exact shapes.

  Example:
    >>> out = dynjax.while_loop(lambda c: c[-1] < 5,
    ...                         lambda c: jnp.concatenate([c, c[-1:] + 1]), jnp.zeros(1))
    >>> out
    Array([0., 1., 2., 3., 4., 5.], dtype=float32)
  """
  _check_options(padding, unroll, bucket_from)
  unroll = default_unroll() if unroll is None else int(unroll)
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  if any_tracer(leaves):
    return _traced_while(cond_fun, body_fun, init_val, leaves, treedef,
                         dict(dims=dims, buckets=buckets, padding=padding, unroll=unroll,
                              bucket_from=bucket_from))
  # device_put, not jnp.asarray: the latter compiles a tiny executable per shape (jax 0.10)
  leaves = [x if isinstance(x, jax.Array) else jax.device_put(x) for x in leaves]
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  loop = _get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
                   bucket_from)
  return jax.tree_util.tree_unflatten(treedef, loop.run(leaves))


def _traced_while(cond_fun, body_fun, init_val, leaves, treedef, options):
  from dynjax.control import _staging

  stager = _staging.current()
  try:
    with building("while_loop body"):
      out = jax.eval_shape(body_fun, init_val)
  except NotLowerable as e:
    if stager is not None:  # a shape-changing loop inside the body: the program runs it
      return stager.stage_while(cond_fun, body_fun, init_val, options)
    raise needs_vm("while_loop", f"its body runs a loop that changes shapes ({e})") from None
  except ControlFlowError:
    raise
  except Exception as e:
    raise _trace_error("body_fun", e) from None
  out_leaves, out_tree = jax.tree_util.tree_flatten(out)
  changed = []
  if out_tree == treedef:
    for p, a, o in zip(_keypaths(treedef), leaves, out_leaves, strict=True):
      if tuple(a.shape) != tuple(o.shape) or jnp.dtype(a.dtype) != jnp.dtype(o.dtype):
        changed.append(f"{p}: {tuple(a.shape)} -> {tuple(o.shape)}")
  else:
    changed.append(f"structure {treedef} -> {out_tree}")
  if not changed:
    return lax.while_loop(cond_fun, body_fun, init_val)  # shape-invariant: plain XLA loop
  if stager is not None:
    return stager.stage_while(cond_fun, body_fun, init_val, options)
  raise needs_vm("while_loop", "its carry changes shape (" + "; ".join(changed) + ")")


def loop_stats() -> dict:
  """What the last ``while_loop`` of this thread did: mode, iterations, host syncs, buckets.

  Example:
    >>> _ = dynjax.while_loop(lambda c: jnp.asarray(c.shape[0]) < 40,
    ...                       lambda c: jnp.concatenate([c, c[:1]]), jnp.zeros(1))
    >>> dynjax.control.loop_stats()["host_syncs"]
    3
  """
  return dict(_LAST_RUN.get("loop", {}))


def loop_program(cond_fun, body_fun, init_val, *, dims=None, buckets=None,
                 padding: str = "auto", unroll: int | None = None,
                 bucket_from: str = "auto") -> str:
  """The VM program ``while_loop`` runs for these arguments, as text (builds, runs nothing)."""
  _check_options(padding, unroll, bucket_from)
  unroll = default_unroll() if unroll is None else int(unroll)
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
  loop = _get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
                   bucket_from)
  return loop.program_text() if hasattr(loop, "program_text") else loop.vm(
      loop.mode).program.as_text()

