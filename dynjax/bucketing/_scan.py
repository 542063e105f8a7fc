"""``jax.lax.associative_scan`` over a dynamic axis: one primitive, scanned at each bucket.

JAX's ``associative_scan`` recurses ``log2(n)`` times on the length ``n`` of its axis, so it
refuses a symbolic ``n`` (``NotImplementedError: associative scan over axis of non-constant
size``), and a family traced with ``padding="auto"`` (or ``"trust"``) fell back to one compile
per shape.  Linear-recurrence models (S5, LRU, Mamba-style selective scans, GRU-like minimal
RNNs) and RL returns compute exactly that scan along time.

While a family traces (``tracing()``, this thread only), ``jax.lax.associative_scan`` over a
symbolic axis binds ``dynjax_associative_scan`` instead: the elements and the values ``fn``
closes over are its operands, and ``fn`` is a jaxpr over one element (the scan axis kept at
size 1), which the scan applies under ``jax.vmap`` as the docstring of ``associative_scan``
asks of ``fn`` ("applied elementwise over the axis").  At a bucket's padded shape the padding
rule runs JAX's own ``associative_scan`` at the padded length:

* forward: ``out[i]`` depends on ``elems[:i+1]`` only, and the recursion pairs elements by
  index alone, so the true prefix is the scan at the true length, bitwise; the padded tail is
  garbage (and may be inf/NaN: it never reaches the prefix);
* ``reverse=True``: the valid prefix is reversed in place (index ``T-1-i``), scanned forward,
  and put back;
* the tangent (``dynjax_associative_scan_lin``, linear in the tangents) likewise;
* the backward (``dynjax_associative_scan_vjp``): a cotangent of 0 times a partial derivative
  taken at garbage is NaN, so there the padded elements are the operation's identity: the
  combine returns the other side where one side holds only padding, and ``fn`` sees a valid
  element in place of padding (a branch whose value is discarded).

``install()`` makes ``jax.lax.associative_scan`` (and names bound to it by ``from jax.lax
import associative_scan`` in modules already imported) this wrapper; outside a family's trace,
or at a static length, it is JAX's function.  A family installs it on the first trace that
fails on that error, then traces again.  Not covered (the family falls back as before): ``fn``
with effects, a function object captured another way (a default argument, a closure cell),
the gradient of the gradient.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

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

_ORIGINAL = lax.associative_scan  # JAX's function, before install()
_LOCAL = threading.local()
_LOCK = threading.Lock()
FAILURE = "associative scan over axis of non-constant size"  # JAX's refusal (a substring)
jp.exclude_from_user_frames(__file__)  # explain() names the user's line, not this module's


@contextlib.contextmanager
def tracing():
  """While a family traces (this thread): ``associative_scan`` over a symbolic axis binds
  the primitive (once :func:`install` has run)."""
  previous = getattr(_LOCAL, "on", False)
  _LOCAL.on = True
  try:
    yield
  finally:
    _LOCAL.on = previous


def is_refusal(e: BaseException) -> bool:
  return isinstance(e, NotImplementedError) and FAILURE in str(e)


def install() -> bool:
  """Rebinds ``jax.lax.associative_scan``, and every module global bound to JAX's function
  outside jax itself, to :func:`associative_scan`.  True when it rebound anything (a trace
  that failed may then succeed), False when nothing was left to rebind."""
  changed = False
  with _LOCK:
    for name, mod in list(sys.modules.items()):
      if mod is None or (name.split(".")[0] in ("jax", "jaxlib", "dynjax") and mod is not lax):
        continue  # jax's own uses stay JAX's (static lengths); dynjax holds _ORIGINAL
      try:
        names = [k for k, v in vars(mod).items() if v is _ORIGINAL]
      except TypeError:  # a module object without a __dict__
        continue
      for k in names:
        setattr(mod, k, associative_scan)
        changed = True
  return changed


def associative_scan(fn, elems, reverse=False, axis=0):
  """``jax.lax.associative_scan``; inside a dynjax family's trace, over a symbolic axis, the
  ``dynjax_associative_scan`` primitive (module docstring)."""
  if not getattr(_LOCAL, "on", False) or not callable(fn):
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)
  flat, tree = jax.tree_util.tree_flatten(elems)
  if not flat or not all(hasattr(x, "shape") for x in flat) or not flat[0].ndim:
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)
  ax = int(axis) + flat[0].ndim if int(axis) < 0 else int(axis)
  n = flat[0].shape[ax] if 0 <= ax < flat[0].ndim else 0
  if not jp.is_dim_expr(n) or any(x.ndim <= ax or str(x.shape[ax]) != str(n) for x in flat):
    return _ORIGINAL(fn, elems, reverse=reverse, axis=axis)  # JAX's answer (or its error)
  flat = [jnp.asarray(x) for x in flat]
  one = [jax.ShapeDtypeStruct(_at(x.shape, ax, 1), x.dtype, weak_type=_weak(x)) for x in flat]

  def combine(a_flat, b_flat):
    c = fn(jax.tree_util.tree_unflatten(tree, a_flat), jax.tree_util.tree_unflatten(tree, b_flat))
    c_flat, c_tree = jax.tree_util.tree_flatten(c)
    if c_tree != tree:
      raise TypeError(f"lax.associative_scan: fn returned {c_tree}, expected the structure of "
                      f"elems, {tree}")
    return c_flat

  closed = jax.make_jaxpr(combine)(one, one)
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
                    n_elems=len(flat), axis=ax, reverse=bool(reverse))
  return jax.tree_util.tree_unflatten(tree, res)


functools.update_wrapper(associative_scan, _ORIGINAL)  # help() shows JAX's documentation


def _at(shape, axis, n):
  return (*shape[:axis], n, *shape[axis + 1:])


def _weak(x) -> bool:
  return bool(getattr(getattr(x, "aval", None), "weak_type", False))


def _inexact(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


# -- the scan at a static length ------------------------------------------------------------
# ``ev(jaxpr, consts, a, b) -> outs`` evaluates the combine body over one element: plainly
# (the primitives' own lowering) or through the padding pass's interpreter (an element may
# hold other dynamic dims).


def _plain(jaxpr, consts, a, b):
  return jax.core.eval_jaxpr(jaxpr, (), *consts, *a, *b)


def _scanner(p, ev, consts, masked: bool, origin=None):
  """The combine over whole arrays: the body under ``jax.vmap`` along the scan axis.

  ``masked``: each leaf comes with a boolean twin (its entries: "this range holds a valid
  element") and padding is the identity: where one side holds none the other side is the
  result, and ``fn`` sees ``origin`` (a valid element) on both sides instead, its value
  discarded.  Without it, padded entries go through ``fn`` as they are."""
  axis, n = p["axis"], p["n_elems"]

  def one(*ab):
    xa, xb = ab[:n], ab[n:2 * n]
    if not masked:
      a, b = xa, xb
    else:
      va, vb = ab[2 * n:3 * n], ab[3 * n:]
      both = [v & w for v, w in zip(va, vb, strict=True)]
      a = [jnp.where(m, x, o) for x, m, o in zip(xa, both, origin, strict=True)]
      b = [jnp.where(m, x, o) for x, m, o in zip(xb, both, origin, strict=True)]
    r = ev(p["jaxpr"], consts, [jnp.expand_dims(x, axis) for x in a],
           [jnp.expand_dims(x, axis) for x in b])
    r = [jnp.squeeze(x, axis) for x in r]
    if not masked:
      return r
    r = [jnp.where(m, u, jnp.where(v, x, y))
         for u, x, y, m, v in zip(r, xa, xb, both, va, strict=True)]
    return r + [v | w for v, w in zip(va, vb, strict=True)]

  def combine(a_flat, b_flat):  # masked: (elems, valid) a side
    ops = (*a_flat[:n], *b_flat[:n], *a_flat[n:], *b_flat[n:]) if masked else (*a_flat, *b_flat)
    return jax.vmap(one, in_axes=axis, out_axes=axis)(*ops)

  return combine


def _scan(p, ev, consts, elems, reverse, valid=None, origin=None):
  """``associative_scan`` of ``elems`` at their static length; ``valid`` (one boolean array
  a leaf) makes padding the identity (:func:`_scanner`)."""
  if valid is None:
    return list(_ORIGINAL(_scanner(p, ev, consts, False), list(elems), reverse=reverse,
                          axis=p["axis"]))
  out = _ORIGINAL(_scanner(p, ev, consts, True, origin), [*elems, *valid], reverse=reverse,
                  axis=p["axis"])
  return list(out[:len(elems)])


def _split(p, ops):
  c = p["n_consts"]
  return list(ops[:c]), list(ops[c:c + p["n_elems"]])


def _floats(p, ops):
  """Positions of the inexact operands among (consts, elems), and of the inexact elems."""
  consts, elems = _split(p, ops)
  both = [*consts, *elems]
  return ([i for i, x in enumerate(both) if _inexact(x)],
          [i for i, x in enumerate(elems) if _inexact(x)])


def _restricted(p, fwd, consts, elems):
  """``g(*inexact operands) -> inexact outputs`` of ``fwd(consts, elems)`` (jax.jvp/vjp
  differentiate floats only) and the inexact operands."""
  ops = [*consts, *elems]
  fl, out_fl = _floats(p, ops)

  def g(*floats):
    full = list(ops)
    for i, x in zip(fl, floats, strict=True):
      full[i] = x
    outs = fwd(*_split(p, full))
    return [outs[i] for i in out_fl]

  return g, [ops[i] for i in fl]


def _tangents(p, fwd, consts, elems, tangents):
  g, primals = _restricted(p, fwd, consts, elems)
  return list(jax.jvp(g, primals, list(tangents))[1])


def _cotangents(p, fwd, consts, elems, cts):
  g, primals = _restricted(p, fwd, consts, elems)
  _, pull = jax.vjp(g, *primals)
  out_fl = _floats(p, [*consts, *elems])[1]
  return list(pull([c.astype(elems[i].dtype) for c, i in zip(cts, out_fl, strict=True)]))


def _n_tangents(p, ops) -> int:
  return len(ops) - p["n_consts"] - p["n_elems"]


def _impl(*ops, **p):
  consts, elems = _split(p, ops)
  return _scan(p, _plain, consts, elems, p["reverse"])


def _lin_impl(*ops, **p):
  k = _n_tangents(p, ops)
  consts, elems = _split(p, ops[k:])
  return _tangents(p, lambda c, e: _scan(p, _plain, c, e, p["reverse"]), consts, elems,
                   ops[:k])


def _vjp_impl(*ops, **p):
  c, e = p["n_consts"], p["n_elems"]
  consts, elems, cts = list(ops[:c]), list(ops[c:c + e]), list(ops[c + e:])
  return _cotangents(p, lambda cs, es: _scan(p, _plain, cs, es, p["reverse"]), consts, elems,
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
  outs = scan_p.bind(*primals, **p)
  fl = [i for i, x in enumerate(primals) if _inexact(x)]
  tans = [ad.instantiate_zeros(tangents[i]) for i in fl]
  touts = iter(lin_p.bind(*tans, *primals, **p))
  _, elems = _split(p, primals)
  return outs, [next(touts) if _inexact(x) else ad.Zero(_aval(x).to_tangent_aval())
                for x in elems]


def _lin_transpose(cts, *ops, **p):
  k = _n_tangents(p, ops)
  if any(ad.is_undefined_primal(x) for x in ops[k:]):  # pragma: no cover
    raise NotImplementedError("dynjax_associative_scan: the tangent is linear in the tangents")
  consts, elems = _split(p, ops[k:])
  out_fl = [x for x in elems if _inexact(x)]
  cts = [jnp.zeros(x.shape, x.dtype) if type(c) is ad.Zero else c
         for c, x in zip(cts, out_fl, strict=True)]
  grads = vjp_p.bind(*consts, *elems, *cts, **p)
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


def _padded_ev(ctx: Context, const_pvs):
  """The combine body through the padding pass (an element may hold other dynamic dims); the
  consts it is given keep what is known of the padding of ``const_pvs``."""

  def ev(jaxpr, consts, a, b):
    cs = [PaddedValue(x, pv.fill, pv.axis_fill) for x, pv in zip(consts, const_pvs, strict=True)]
    return [pv.val for pv in interpret(ctx, jaxpr, [], [*cs, *(PaddedValue(x) for x in (*a, *b))])]

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


@register(scan_p)
def _scan_rule(ctx, eqn, invals):
  p = eqn.params
  c = p["n_consts"]
  aval = eqn.invars[c].aval
  fix = _in_place(ctx, p, aval)
  consts = [pv.val for pv in invals[:c]]
  elems = fix([pv.val for pv in invals[c:]])
  _describe(ctx, eqn, aval, "JAX's scan at the padded length, exact on the true prefix")
  out = _scan(p, _padded_ev(ctx, invals[:c]), consts, elems, False)
  return [PaddedValue(x) for x in fix(out)]


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
  ev = _padded_ev(ctx, invals[k:k + c])
  _describe(ctx, eqn, aval, "its tangent at the padded length, exact on the true prefix")
  out = _tangents(p, lambda cs, es: _scan(p, ev, cs, es, False), consts, fix(elems), tans)
  return [PaddedValue(x) for x in fix(out)]


@register(vjp_p)
def _vjp_rule(ctx, eqn, invals):
  # Reverse mode: a cotangent of 0 at a padded position times a partial derivative taken at
  # garbage is NaN, so here padding is the scan's identity and fn never sees it.
  p = eqn.params
  c, e = p["n_consts"], p["n_elems"]
  e_avals = [v.aval for v in eqn.invars[c:c + e]]
  fix = _in_place(ctx, p, e_avals[0])
  consts = [pv.val for pv in invals[:c]]
  elems = fix([pv.val for pv in invals[c:c + e]])
  valid = [_valid(ctx, a) for a in e_avals]
  _, out_fl = _floats(p, [*consts, *elems])
  cts = fix([jnp.where(valid[i], pv.val, jnp.zeros((), pv.val.dtype))
             for pv, i in zip(invals[c + e:], out_fl, strict=True)])
  origin = [_origin(p, a, x) for a, x in zip(e_avals, elems, strict=True)]
  ev = _padded_ev(ctx, invals[:c])
  _describe(ctx, eqn, e_avals[0], "its backward at the padded length, padding the scan's "
            "identity and its cotangents 0")
  grads = _cotangents(p, lambda cs, es: _scan(p, ev, cs, es, False, valid, origin), consts,
                      elems, cts)
  fl, _ = _floats(p, [*consts, *elems])
  out = []
  for g, i in zip(grads, fl, strict=True):
    if i >= c:  # an element's: back in place, padded positions 0
      g = jnp.where(valid[i - c], fix([g])[0], jnp.zeros((), g.dtype))
    out.append(PaddedValue(g))
  return out


def _valid(ctx: Context, aval):
  """Boolean of the padded shape: true where every dynamic axis' index is below its true
  size."""
  shape = ctx.padded_shape(aval.shape)
  m = ctx.valid_mask(aval, list(range(len(aval.shape))))
  return jnp.ones(shape, bool) if m is None else jnp.broadcast_to(m, shape)


def _origin(p, aval, x):
  """A valid element of ``x`` (the scan axis dropped): its entries at index 0 of every
  dynamic axis, of size 1 along the other dynamic axes (they broadcast)."""
  idx = tuple(slice(0, 1) if is_dynamic_dim(d) else slice(None) for d in aval.shape)
  return jnp.squeeze(x[idx], p["axis"])
