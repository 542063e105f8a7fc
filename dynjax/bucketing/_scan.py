"""``jax.lax.associative_scan`` over a dynamic axis: one primitive, scanned at each bucket.

JAX's ``associative_scan`` recurses ``log2(n)`` times on the length ``n`` of its axis, so it
refuses a symbolic ``n`` (``NotImplementedError: associative scan over axis of non-constant
size``), and a family traced with ``padding="auto"`` (or ``"trust"``) fell back to one compile
per shape.  Linear-recurrence models (S5, LRU, Mamba-style selective scans, GRU-like minimal
RNNs) and RL returns compute exactly that scan along time.

While a family traces (``_rebind.family_tracing()``, this thread only),
``jax.lax.associative_scan`` over a symbolic axis binds ``dynjax_associative_scan`` instead:
the elements and the values ``fn`` closes over are its operands, and ``fn`` is a jaxpr traced at a length of its own
(``LENGTH``, a dim variable that each level of the scan binds to its static length), applied
to whole arrays as JAX applies it.  At a bucket's padded shape the padding rule runs JAX's
recursion (:func:`_blelloch`, operation for operation) at the padded length:

* forward: ``out[i]`` depends on ``elems[:i+1]`` only, and the recursion pairs elements by
  index alone, so the true prefix is the scan at the true length; the padded tail is garbage
  (and may be inf/NaN: it never reaches the prefix);
* ``reverse=True``: the valid prefix is reversed in place (index ``T-1-i``), scanned forward,
  and put back;
* each combine runs through the padding pass with its length variable's true size the
  number of pairs JAX's recursion combines there at the true length: an ``fn`` that reads
  along the axis (a mean over it, against JAX's contract) reads what JAX's would, or falls
  back where the pass has no rule; an elementwise ``fn`` never reads the size (no cost);
* the tangent (``dynjax_associative_scan_lin``, linear in the tangents) likewise;
* the backward (``dynjax_associative_scan_vjp``): a cotangent of 0 times a partial derivative
  taken at garbage is NaN, so under ``jax.grad`` the forward (marked ``differentiated``) runs
  with padded entries replaced by a valid element's and padded positions as the operation's
  identity (a combine whose right side starts at or past the true length returns its left
  side), linearized once; the backward transposes that linear map, for the outputs that have
  a cotangent only (``live``).

``install()`` makes ``jax.lax.associative_scan`` (and names bound to it by ``from jax.lax
import associative_scan`` in modules already imported) this wrapper; outside a family's trace,
or at a static length, it is JAX's function.  A family installs it on the first trace that
fails on that error, then traces again.  Not covered (the family falls back as before): ``fn``
with effects, a function object captured another way (a default argument, a closure cell),
the gradient of the gradient.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from dynjax import _jax_private as jp
from dynjax.bucketing._padding_core import (
  Context,
  PaddedValue,
  interpret,
  is_dynamic_dim,
  register,
)
from dynjax.bucketing._rebind import (
  family_tracing_active,
  rebind_globals,
)
from dynjax.bucketing._rebind import (
  register as register_rebinder,
)

_ORIGINAL = lax.associative_scan  # JAX's function, before install()
FAILURE = "associative scan over axis of non-constant size"  # JAX's refusal (a substring)
LENGTH = "dynjax_scan_n"  # the combine body's length along the scan axis (a dim variable)
jp.exclude_from_user_frames(__file__)  # explain() names the user's line, not this module's


def is_refusal(e: BaseException) -> bool:
  return isinstance(e, NotImplementedError) and FAILURE in str(e)


def install() -> bool:
  """Rebinds ``jax.lax.associative_scan``, every module global bound to JAX's function outside
  jax itself, and the one in the module that defines it, to :func:`associative_scan`.  True
  when it rebound anything (a trace that failed may then succeed), False when nothing was
  left to rebind.  Runs only after a refusal: 3-5 ms over ~1,000 modules (CPU box, flax and
  hypothesis imported)."""
  # JAX's own module too: the JVP of cumprod / cummax / cummin / cumlogsumexp scans with it
  # (``_cumulative_jvp_rule``), so their gradient over a dynamic axis falls back without.
  return rebind_globals(_ORIGINAL, associative_scan,
                        (lax, sys.modules.get(_ORIGINAL.__module__)))


register_rebinder(is_refusal, install)


def associative_scan(fn, elems, reverse=False, axis=0):
  """``jax.lax.associative_scan``; inside a dynjax family's trace, over a symbolic axis, the
  ``dynjax_associative_scan`` primitive (module docstring)."""
  if not family_tracing_active() or not callable(fn):
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)
  flat, tree = jax.tree_util.tree_flatten(elems)
  if not flat or not all(hasattr(x, "shape") for x in flat) or not flat[0].ndim:
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)
  ax = int(axis) + flat[0].ndim if int(axis) < 0 else int(axis)
  n = flat[0].shape[ax] if 0 <= ax < flat[0].ndim else 0
  if not jp.is_dim_expr(n) or any(x.ndim <= ax or str(x.shape[ax]) != str(n) for x in flat):
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)  # JAX's answer (or its error)
  flat = [jnp.asarray(x) for x in flat]
  # fn traced at a length of its own (each level of the scan binds it): applied to whole
  # arrays as JAX's scan applies it, so its operations are JAX's.
  (length,) = jax.export.symbolic_shape(LENGTH, scope=n.scope)
  one = [jax.ShapeDtypeStruct(_at(x.shape, ax, length), x.dtype, weak_type=_weak(x))
         for x in flat]

  def combine(a_flat, b_flat):
    c = fn(jax.tree_util.tree_unflatten(tree, a_flat), jax.tree_util.tree_unflatten(tree, b_flat))
    c_flat, c_tree = jax.tree_util.tree_flatten(c)
    if c_tree != tree:
      raise TypeError(f"lax.associative_scan: fn returned {c_tree}, expected the structure of "
                      f"elems, {tree}")
    return c_flat

  try:
    closed = jax.make_jaxpr(combine)(one, one)
  except Exception:  # noqa: BLE001 - fn needs a static length: JAX's refusal, exact per shape
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)
  outs = closed.out_avals
  if closed.effects or [(tuple(map(str, o.shape)), o.dtype) for o in outs] != [
      (tuple(map(str, s.shape)), s.dtype) for s in one]:
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)  # JAX's refusal: exact per shape
  # fn's closed-over values (tracers of the family's trace) become operands: a jaxpr of
  # (consts, a, b) with no constants of its own.
  j = closed.jaxpr
  const_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in j.constvars]
  body = jax.make_jaxpr(lambda cs, a, b: jax.core.eval_jaxpr(j, cs, *a, *b))(
      const_avals, one, one)
  res = scan_p.bind(*closed.consts, *flat, jaxpr=body.jaxpr, n_consts=len(closed.consts),
                    n_elems=len(flat), axis=ax, reverse=bool(reverse), differentiated=False,
                    live=None)
  return jax.tree_util.tree_unflatten(tree, res)


functools.update_wrapper(associative_scan, _ORIGINAL)  # help() shows JAX's documentation


def _at(shape, axis, n):
  return (*shape[:axis], n, *shape[axis + 1:])


def _weak(x) -> bool:
  return bool(getattr(getattr(x, "aval", None), "weak_type", False))


def _inexact(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


# -- the scan at a static length ------------------------------------------------------------
# ``ev(jaxpr, consts, a, b) -> outs`` evaluates the combine body on whole arrays (its length
# variable bound to theirs): plainly (the primitives' own lowering) or through the padding
# pass's interpreter (the elements may hold other dynamic dims).


def _body_ctx(ctx: Context | None, length: int, true=None) -> Context:
  """``ctx`` (or none) with the body's length variable bound to ``length`` (the arrays'),
  its true size ``true`` (a traced int32: the combine's valid pairs) or ``length``."""
  sizes = dict(ctx.sizes_env) if ctx is not None else {}
  buckets = dict(ctx.bucket_env) if ctx is not None else {}
  sizes[LENGTH] = length if true is None else true
  buckets[LENGTH] = length
  return Context(sizes, buckets, None)


def _plain(p):
  def ev(jaxpr, consts, a, b, true=None):
    c = _body_ctx(None, int(a[0].shape[p["axis"]]))
    return [pv.val for pv in interpret(c, jaxpr, [], [PaddedValue(x) for x in (*consts, *a, *b)])]

  return ev


def _combiner(p, ev, consts):
  """``combine(a, b, b_valid, true)``: the body on whole arrays, ``true`` of their pairs
  valid (a traced int32, or None: all).  ``b_valid`` (a boolean a position along the scan
  axis, or None): where False, ``b`` holds padding only, the scan's identity, and ``a`` is
  the result (``fn``'s value there is discarded: its inputs must be finite,
  :func:`_sanitized`)."""
  axis = p["axis"]

  def combine(a, b, b_valid, true):
    r = ev(p["jaxpr"], consts, a, b, true)
    if b_valid is None:
      return r
    return [jnp.where(b_valid.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1)), u, x)
            for u, x in zip(r, a, strict=True)]

  return combine


def _interleave(a, b, axis):
  """JAX's ``_interleave`` (``associative_scan``'s): ``a[0], b[0], a[1], ...`` along ``axis``."""
  same = a.shape[axis] == b.shape[axis]
  a_pad = [(0, 0, 0)] * a.ndim
  b_pad = [(0, 0, 0)] * b.ndim
  a_pad[axis] = (0, 1 if same else 0, 1)
  b_pad[axis] = (1, 0 if same else 1, 1)
  op = lax.bitwise_or if a.dtype == jnp.bool_ else lax.add
  return op(lax.pad(a, jnp.zeros((), a.dtype), a_pad), lax.pad(b, jnp.zeros((), b.dtype), b_pad))


def _blelloch(combine, elems, axis, t=None, identity=False):
  """JAX's ``associative_scan`` along ``axis``, operation for operation (so its results are
  JAX's), at the elements' length; ``t`` their true length (a traced int32, or None: all).

  Each combine is told how many of its pairs JAX's recursion at length ``t`` has (``fn``
  sees arrays of that length there: an ``fn`` that reads along the axis, against JAX's
  contract, has its reads masked by the padding pass as JAX's would stop), and with
  ``identity`` whether each right operand starts before position ``t``: a range that starts
  at or past ``t`` holds only padding, the identity.  At a level whose elements cover
  ``step`` positions, element ``k`` starts at ``k * step``; a level of ``m`` true elements
  has ``m // 2`` pairs to reduce and ``(m - 1) // 2`` to combine back."""

  def starts_before(first, count, step):
    if t is None or not identity:
      return None
    return first + step * jnp.arange(count, dtype=jnp.int32) < t

  def pairs(k):
    # Under ``identity`` (differentiated) a combine of no valid pair still reads one: its
    # results are discarded, but a mean over none (0 / 0) would make their cotangents NaN.
    return jnp.maximum(k, 1) if identity else k

  def sl(x, start, stop=None, stride=1):
    return lax.slice_in_dim(x, start, stop, stride, axis)

  def scan(elems, step, m):
    n = elems[0].shape[axis]
    if n < 2:
      return elems
    half = None if m is None else m // 2
    reduced = combine([sl(x, 0, -1, 2) for x in elems], [sl(x, 1, None, 2) for x in elems],
                      starts_before(step, n // 2, 2 * step), None if m is None else pairs(half))
    odd = scan(reduced, 2 * step, half)
    rights = [sl(x, 2, None, 2) for x in elems]
    lefts = [sl(x, 0, -1) for x in odd] if n % 2 == 0 else odd
    even = combine(lefts, rights, starts_before(2 * step, rights[0].shape[axis], 2 * step),
                   None if m is None else pairs(jnp.maximum(m - 1, 0) // 2))
    even = [lax.concatenate([sl(x, 0, 1), r], axis) for x, r in zip(elems, even, strict=True)]
    return [_interleave(e, o, axis) for e, o in zip(even, odd, strict=True)]

  return scan(list(elems), 1, t)


def _scan(p, ev, consts, elems, reverse, t=None, identity=False):
  """``associative_scan`` of ``elems`` at their static length, ``t`` of it true (None: all);
  with ``identity`` positions from ``t`` on are the identity (their entries must be finite:
  :func:`_sanitized`)."""
  axis = p["axis"]
  if reverse:
    elems = [lax.rev(x, (axis,)) for x in elems]
  out = _blelloch(_combiner(p, ev, consts), elems, axis, t, identity)
  return [lax.rev(x, (axis,)) for x in out] if reverse else out


def _split(p, ops):
  c = p["n_consts"]
  return list(ops[:c]), list(ops[c:c + p["n_elems"]])


def _floats(p, ops):
  """Positions of the inexact operands among (consts, elems), and of the inexact elems."""
  consts, elems = _split(p, ops)
  both = [*consts, *elems]
  return ([i for i, x in enumerate(both) if _inexact(x)],
          [i for i, x in enumerate(elems) if _inexact(x)])


def _restricted(p, fwd, consts, elems, live=None, aux=False):
  """``g(*inexact operands) -> inexact outputs`` of ``fwd(consts, elems)`` (jax.jvp/vjp
  differentiate floats only; ``live``: of those outputs, the ones kept; ``aux``: ``g``
  returns all outputs beside them, for ``has_aux``) and the inexact operands."""
  ops = [*consts, *elems]
  fl, out_fl = _floats(p, ops)
  if live is not None:
    out_fl = [i for i, keep in zip(out_fl, live, strict=True) if keep]

  def g(*floats):
    full = list(ops)
    for i, x in zip(fl, floats, strict=True):
      full[i] = x
    outs = fwd(*_split(p, full))
    kept = [outs[i] for i in out_fl]
    return (kept, outs) if aux else kept

  return g, [ops[i] for i in fl]


def _tangents(p, fwd, consts, elems, tangents):
  g, primals = _restricted(p, fwd, consts, elems)
  return list(jax.jvp(g, primals, list(tangents))[1])


def _cotangents(p, fwd, consts, elems, cts):
  """The cotangents of the inexact operands, ``cts`` those of the live inexact outputs."""
  g, primals = _restricted(p, fwd, consts, elems, p["live"])
  out_fl = _floats(p, [*consts, *elems])[1]
  dtypes = [elems[i].dtype for i, keep in zip(out_fl, p["live"] or [True] * len(out_fl),
                                               strict=True) if keep]
  _, pull = jax.vjp(g, *primals)
  return list(pull([c.astype(d) for c, d in zip(cts, dtypes, strict=True)]))


def _n_tangents(p, ops) -> int:
  return len(ops) - p["n_consts"] - p["n_elems"]


def _impl(*ops, **p):
  consts, elems = _split(p, ops)
  return _scan(p, _plain(p), consts, elems, p["reverse"])


def _lin_impl(*ops, **p):
  k = _n_tangents(p, ops)
  consts, elems = _split(p, ops[k:])
  return _tangents(p, lambda c, e: _scan(p, _plain(p), c, e, p["reverse"]), consts, elems,
                   ops[:k])


def _vjp_impl(*ops, **p):
  c, e = p["n_consts"], p["n_elems"]
  consts, elems, cts = list(ops[:c]), list(ops[c:c + e]), list(ops[c + e:])
  return _cotangents(p, lambda cs, es: _scan(p, _plain(p), cs, es, p["reverse"]), consts, elems,
                     cts)


# -- the primitives ---------------------------------------------------------------------------
scan_p = jex_core.Primitive("dynjax_associative_scan")
scan_p.multiple_results = True
lin_p = jex_core.Primitive("dynjax_associative_scan_lin")  # tangents, linear in the first ops
lin_p.multiple_results = True
vjp_p = jex_core.Primitive("dynjax_associative_scan_vjp")  # (consts, elems, cts) -> cts
vjp_p.multiple_results = True


def _aval(x):
  return jp.shaped_array(x.shape, x.dtype)


def _abstract(*ops, **p):
  _, elems = _split(p, ops)
  return [_aval(x) for x in elems]


def _lin_abstract(*ops, **p):
  _, elems = _split(p, ops[_n_tangents(p, ops):])
  return [_aval(x) for x in elems if _inexact(x)]


def _vjp_abstract(*ops, **p):
  c, e = p["n_consts"], p["n_elems"]
  return [_aval(x) for x in ops[:c + e] if _inexact(x)]


def _jvp(primals, tangents, **p):
  # The primal marked: its padding rule leaves the backward's residuals (_scan_rule).
  p = {**p, "differentiated": True}
  outs = scan_p.bind(*primals, **p)
  tans = [ad.instantiate_zeros(tangents[i]) for i in _floats(p, primals)[0]]
  touts = iter(lin_p.bind(*tans, *primals, **p))
  _, elems = _split(p, primals)
  return outs, [next(touts) if _inexact(x) else ad.Zero(_aval(x).to_tangent_aval())
                for x in elems]


def _lin_transpose(cts, *ops, **p):
  k = _n_tangents(p, ops)
  if any(ad.is_undefined_primal(x) for x in ops[k:]):  # pragma: no cover
    raise NotImplementedError("dynjax_associative_scan: the tangent is linear in the tangents")
  consts, elems = _split(p, ops[k:])
  # Outputs without a cotangent (an LRU's scan of lambda powers beside its states) are left
  # out of the backward: zeros would cost their whole chain (x * 0 does not fold for floats).
  live = tuple(type(c) is not ad.Zero for c in cts)
  if not any(live):
    return [None] * len(ops)
  grads = vjp_p.bind(*consts, *elems, *(c for c in cts if type(c) is not ad.Zero),
                     **{**p, "live": live})
  return [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, ops[:k], strict=True)
          ] + [None] * (len(ops) - k)


def _batch(prim, args, dims, **p):
  """Under ``jax.vmap``: every operand batched along a new axis 0, the combine body
  vmapped (its consts too), the scan axis one further."""
  size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
  args = [jnp.broadcast_to(a, (size, *a.shape)) if d is None
          else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
  body = p["jaxpr"]
  avals = [jax.ShapeDtypeStruct((size, *v.aval.shape), v.aval.dtype) for v in body.invars]
  vbody = jax.make_jaxpr(jax.vmap(lambda *xs: jax.core.eval_jaxpr(body, (), *xs)))(*avals)
  outs = prim.bind(*args, **{**p, "jaxpr": vbody.jaxpr, "axis": p["axis"] + 1})
  return outs, [0] * len(outs)


for _prim, _impl_fn, _abs in ((scan_p, _impl, _abstract), (lin_p, _lin_impl, _lin_abstract),
                              (vjp_p, _vjp_impl, _vjp_abstract)):
  _prim.def_impl(_impl_fn)
  _prim.def_abstract_eval(_abs)
  mlir.register_lowering(_prim, mlir.lower_fun(_impl_fn, multiple_results=True))
  batching.primitive_batchers[_prim] = lambda args, dims, _p=_prim, **kw: _batch(_p, args,
                                                                                 dims, **kw)
ad.primitive_jvps[scan_p] = _jvp
ad.primitive_transposes[lin_p] = _lin_transpose


# -- padding rules ------------------------------------------------------------------------------


def _padded_ev(ctx: Context, const_pvs, axis: int):
  """The combine body through the padding pass (an element may hold other dynamic dims); the
  consts it is given keep what is known of the padding of ``const_pvs``."""

  def ev(jaxpr, consts, a, b, true=None):
    cs = [PaddedValue(x, pv.fill, pv.axis_fill) for x, pv in zip(consts, const_pvs, strict=True)]
    c = _body_ctx(ctx, int(a[0].shape[axis]), true)
    return [pv.val for pv in interpret(c, jaxpr, [], [*cs, *(PaddedValue(x) for x in (*a, *b))])]

  return ev


def _in_place(ctx: Context, p, aval):
  """With ``reverse``: the valid prefix along the scan axis reversed in place (index
  ``T-1-i``; an involution), so that a forward scan computes the reversed one there.
  Else the identity."""
  if not p["reverse"]:
    return list
  axis = p["axis"]
  i = jnp.arange(ctx.padded_dim(aval.shape[axis]), dtype=jnp.int32)
  t = ctx.true_dim(aval.shape[axis])
  idx = jnp.where(i < t, t - 1 - i, i)
  return lambda xs: [jnp.take(x, idx, axis=axis) for x in xs]


def _describe(ctx, eqn, aval, what: str) -> None:
  p = eqn.params
  rev = ", reversed within the true length" if p["reverse"] else ""
  ctx.note(eqn, f"associative scan along axis {p['axis']} ({aval.shape[p['axis']]}){rev}: "
           f"{what}")


def _prefix_scan(ctx: Context, eqn, invals, ev):
  """``fwd(consts, elems) -> outs`` at the padded length for the backward: padded entries
  replaced by a valid element's (:func:`_sanitized`), padded positions the scan's identity
  (so every derivative is taken at finite values), ``reverse`` in place; and the valid
  masks of the elements."""
  p = eqn.params
  c, e, axis = p["n_consts"], p["n_elems"], p["axis"]
  avals = [v.aval for v in eqn.invars[c:c + e]]
  fix = _in_place(ctx, p, avals[0])
  valid = [_valid(ctx, a) for a in avals]
  t = ctx.true_dim(avals[0].shape[axis])

  def fwd(consts, elems):
    elems = fix([_sanitized(ctx, a, x, v) for a, x, v in zip(avals, elems, valid, strict=True)])
    return fix(_scan(p, ev, consts, elems, False, t, identity=True))

  return fwd, valid


def _stash_key(eqn, n: int):
  """The forward's operands (jaxpr variables) and body."""
  return ("associative_scan", tuple(id(v) for v in eqn.invars[:n]), id(eqn.params["jaxpr"]))


@register(scan_p)
def _scan_rule(ctx, eqn, invals):
  p = eqn.params
  c = p["n_consts"]
  aval = eqn.invars[c].aval
  consts = [pv.val for pv in invals[:c]]
  elems = [pv.val for pv in invals[c:]]
  ev = _padded_ev(ctx, invals[:c], p["axis"])
  if not p["differentiated"]:
    fix = _in_place(ctx, p, aval)
    _describe(ctx, eqn, aval, "JAX's scan at the padded length, exact on the true prefix")
    t = ctx.true_dim(aval.shape[p["axis"]])
    return [PaddedValue(x) for x in fix(_scan(p, ev, consts, fix(elems), False, t))]
  # Under jax.grad: linearized here (the forward once, its residuals kept), the linear map left
  # for vjp_p's rule to transpose, so that the backward does not scan forward again (an LRU
  # training step on CPU: 1.40x jax.jit's time at the bucket's shape when it did).
  fwd, _ = _prefix_scan(ctx, eqn, invals, ev)
  g, primals = _restricted(p, fwd, consts, elems, aux=True)
  _, linear, outs = jax.linearize(g, *primals, has_aux=True)
  # Kept with the trace it belongs to: a jaxpr interpreted again in another trace (a loop
  # body) must not use this one's values.
  ctx.stash[_stash_key(eqn, len(eqn.invars))] = (jex_core.get_opaque_trace_state(), linear,
                                                 primals)
  _describe(ctx, eqn, aval, "JAX's scan at the padded length, exact on the true prefix (padded "
            "positions the scan's identity, linearized for the gradient)")
  return [PaddedValue(x) for x in outs]


@register(lin_p)
def _lin_rule(ctx, eqn, invals):
  # Forward mode: a prefix position's tangent reads prefix elements only, as its value does.
  p = eqn.params
  k = _n_tangents(p, invals)
  c = p["n_consts"]
  aval = eqn.invars[k + c].aval
  fix = _in_place(ctx, p, aval)
  consts = [pv.val for pv in invals[k:k + c]]
  elems = [pv.val for pv in invals[k + c:]]
  fl, _ = _floats(p, [*consts, *elems])
  tans = [fix([pv.val])[0] if i >= c else pv.val for pv, i in zip(invals[:k], fl, strict=True)]
  ev = _padded_ev(ctx, invals[k:k + c], p["axis"])
  _describe(ctx, eqn, aval, "its tangent at the padded length, exact on the true prefix")
  t = ctx.true_dim(aval.shape[p["axis"]])
  out = _tangents(p, lambda cs, es: _scan(p, ev, cs, es, False, t), consts, fix(elems), tans)
  return [PaddedValue(x) for x in fix(out)]


@register(vjp_p)
def _vjp_rule(ctx, eqn, invals):
  # Reverse mode: a cotangent of 0 at a padded position times a partial derivative taken at
  # garbage is NaN; the scan of _prefix_scan takes none there.
  p = eqn.params
  c, e = p["n_consts"], p["n_elems"]
  consts = [pv.val for pv in invals[:c]]
  elems = [pv.val for pv in invals[c:c + e]]
  fwd, valid = _prefix_scan(ctx, eqn, invals, _padded_ev(ctx, invals[:c], p["axis"]))
  _, out_fl = _floats(p, [*consts, *elems])
  live_fl = [i for i, keep in zip(out_fl, p["live"], strict=True) if keep]
  cts = [jnp.where(valid[i], pv.val, jnp.zeros((), pv.val.dtype))
         for pv, i in zip(invals[c + e:], live_fl, strict=True)]
  state, linear, primals = ctx.stash.get(_stash_key(eqn, c + e), (None, None, None))
  if linear is not None and state == jex_core.get_opaque_trace_state():
    _describe(ctx, eqn, eqn.invars[c].aval, "its backward from the forward's linearization, "
              "cotangents of padded positions 0")
    live = [j for j, keep in enumerate(p["live"]) if keep]
    back = jax.linear_transpose(lambda *t: [linear(*t)[j] for j in live], *primals)
    grads = back([ct.astype(elems[i].dtype) for ct, i in zip(cts, live_fl, strict=True)])
  else:
    _describe(ctx, eqn, eqn.invars[c].aval, "its backward at the padded length (the forward "
              "again), cotangents of padded positions 0")
    grads = _cotangents(p, fwd, consts, elems, cts)
  return [PaddedValue(g) for g in grads]


def _valid(ctx: Context, aval):
  """Boolean of the padded shape: true where every dynamic axis' index is below its true
  size."""
  shape = ctx.padded_shape(aval.shape)
  m = ctx.valid_mask(aval, list(range(len(aval.shape))))
  return jnp.ones(shape, bool) if m is None else jnp.broadcast_to(m, shape)


def _sanitized(ctx: Context, aval, x, valid):
  """``x`` with its padded entries replaced by those of a valid element (index 0 of every
  dynamic axis, broadcast along them): finite wherever the valid data is."""
  idx = tuple(slice(0, 1) if is_dynamic_dim(d) else slice(None) for d in aval.shape)
  return jnp.where(valid, x, x[idx])
