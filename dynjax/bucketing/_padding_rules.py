"""Per-primitive rules of the padding pass (registered into ``_padding_core.RULES``).

A rule gets the context, the equation and the padded input values, and returns padded output
values satisfying the invariant of ``_padding_core`` (valid data in the prefix).  Three kinds:

* pass-through: the primitive never moves data between the valid prefix and the padded region
  along a dynamic axis (elementwise, broadcast, transpose, reductions over static axes, ...);
  symbolic dims in its params are replaced by their bucket values.
* masking: the primitive mixes elements along a dynamic axis (reductions, contractions,
  convolutions, reversed scans, sorts); the padded region of the operand is set to the identity
  of the combining operation first, unless it is already known to hold it.
* relayout: the exact layout puts valid elements where the padded layout does not (reshape of
  ``(b, t) -> (b*t,)``, concatenation along a dynamic axis, reversal, pad, slices and gathers
  whose offsets depend on sizes); the rule gathers from true-size index arithmetic.
"""

from __future__ import annotations

import math

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from dynjax import _jax_private as jp
from dynjax.bucketing._padding_core import (
  FUSED,
  WHY_NO_RULE,
  Context,
  PaddedValue,
  common_fill,
  dynamic_axes,
  has_dim_expr,
  identity_for,
  interpret_closed,
  is_dynamic_dim,
  register,
  same_fill,
  unsupported,
)

_PRIVATE = jp.private_primitives()

# --------------------------------------------------------------------------------------------
# helpers


def _bind(ctx: Context, eqn, vals: list) -> list:
  out = eqn.primitive.bind(*vals, **ctx.subst_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _remap_axis(x, axis: int, src, valid=None, fill=None):
  """``out[..., j, ...] = x[..., src[j], ...]`` (clipped); ``fill`` where ``valid[j]`` is false."""
  n = x.shape[axis]
  if n:
    out = jnp.take(x, jnp.clip(src, 0, n - 1), axis=axis, mode="clip")
  else:  # an axis empty at this bucket (jnp.take refuses it): no true element to take
    out = jnp.zeros(x.shape[:axis] + (len(src),) + x.shape[axis + 1:], x.dtype)
  if valid is not None:
    shape = [1] * out.ndim
    shape[axis] = out.shape[axis]
    out = jnp.where(valid.reshape(shape), out, jnp.asarray(fill, out.dtype))
  return out


def _iota(n: int):
  return lax.iota(jnp.int32, n)


# --------------------------------------------------------------------------------------------
# pass-through (elementwise and layout-preserving)

_NP_FILL = {
  "add": np.add,
  "add_any": np.add,
  "sub": np.subtract,
  "mul": np.multiply,
  "max": np.maximum,
  "min": np.minimum,
  "neg": np.negative,
  "exp": np.exp,
  "log": np.log,
  "abs": np.abs,
  "sqrt": np.sqrt,
  "square": np.square,
  "tanh": np.tanh,
  "one_minus_square": lambda x: 1 - np.square(x),  # tanh's derivative (jax >= 0.11)
  "log2": np.log2,
  "stop_gradient": lambda x: x,
  "copy": lambda x: x,
  "copy_p": lambda x: x,
  "and": np.logical_and,
  "or": np.logical_or,
  "not": np.logical_not,
  "eq": np.equal,
  "ne": np.not_equal,
  "lt": np.less,
  "le": np.less_equal,
  "gt": np.greater,
  "ge": np.greater_equal,
}


def _elementwise_fill(eqn, invals):
  """The padded-region constant of an elementwise result, when every operand's is known."""
  fills = []
  for v, pv in zip(eqn.invars, invals, strict=False):
    if dynamic_axes(v.aval):
      if pv.fill is None:
        return None
      fills.append(pv.fill)
    elif isinstance(v, jex_core.Literal) and np.ndim(v.val) == 0:
      fills.append(v.val)
    else:
      return None
  name = eqn.primitive.name
  out_dtype = np.dtype(eqn.outvars[0].aval.dtype) if hasattr(eqn.outvars[0].aval, "dtype") else None
  try:
    with np.errstate(all="ignore"):
      if name == "convert_element_type":
        return np.asarray(fills[0]).astype(eqn.params["new_dtype"])[()]
      if name == "select_n":
        return fills[1 + int(fills[0])]
      if name == "integer_pow":
        return np.power(np.asarray(fills[0], out_dtype), eqn.params["y"])[()]
      if name == "div" and np.issubdtype(out_dtype, np.floating):
        return np.asarray(np.true_divide(*fills), out_dtype)[()]
      fn = _NP_FILL.get(name)
      if fn is None:
        return None
      return np.asarray(fn(*[np.asarray(f) for f in fills]), out_dtype)[()]
  except Exception:
    return None


_ELEMENTWISE = [
  getattr(P, f"{n}_p", None)
  for n in (
    "abs acos acosh add add_jaxvals and asin asinh atan2 atan atanh bessel_i0e bessel_i1e cbrt "
    "ceil clamp clz complex conj convert_element_type copy cos cosh digamma div eq erf_inv erf "
    "erfc exp2 exp expm1 floor ge gt igamma_grad_a igamma igammac imag integer_pow is_finite le "
    "lgamma log1p log logistic lt max min mul ne neg nextafter not or polygamma population_count "
    "pow real reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left "
    "shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan "
    "tanh xor zeta random_fold_in random_seed random_gamma threefry2x32 bitcast_convert_type "
    "eq_to le_to lt_to one_minus_square log2"
  ).split()
] + [_PRIVATE.get("random_wrap"), _PRIVATE.get("random_unwrap")]


@register(*_ELEMENTWISE)
def _elementwise_rule(ctx, eqn, invals):
  outs = _bind(ctx, eqn, [pv.val for pv in invals])
  fill = _elementwise_fill(eqn, invals) if len(outs) == 1 else None
  return [PaddedValue(o, fill) for o in outs]


@register(P.transpose_p, P.squeeze_p, P.sharding_constraint_p, P.device_put_p,
          getattr(lax, "optimization_barrier_p", None))  # the barrier: each operand as it is
def _layout_passthrough_rule(ctx, eqn, invals):
  outs = _bind(ctx, eqn, [pv.val for pv in invals])
  fills = [pv.fill for pv in invals]
  return [PaddedValue(o, fills[i] if i < len(fills) else None) for i, o in enumerate(outs)]


@register(P.broadcast_in_dim_p)
def _broadcast_in_dim_rule(ctx, eqn, invals):
  (out,) = _bind(ctx, eqn, [pv.val for pv in invals])
  var, x = eqn.invars[0], invals[0]
  out_aval = eqn.outvars[0].aval
  fill = None
  if isinstance(var, jex_core.Literal) and np.ndim(var.val) == 0:
    fill = var.val
  elif x.fill is not None:
    bdims = eqn.params["broadcast_dimensions"]
    in_shape = var.aval.shape
    if all(a in bdims and is_dynamic_dim(in_shape[bdims.index(a)]) for a in dynamic_axes(out_aval)):
      fill = x.fill
  return [PaddedValue(out, fill)]


@register(P.iota_p)
def _iota_rule(ctx, eqn, invals):
  return [PaddedValue(o) for o in _bind(ctx, eqn, [pv.val for pv in invals])]


@register(jp.dim_as_value_primitive())
def _dim_as_value_rule(ctx, eqn, invals):
  value = ctx.true_dim(eqn.params["dim"])
  ctx.note(eqn, f"evaluates {eqn.params['dim']} at the true sizes")
  return [PaddedValue(jnp.asarray(value, eqn.outvars[0].aval.dtype))]


# --------------------------------------------------------------------------------------------
# masking rules


def _reduction_rule(kind: str):
  def rule(ctx, eqn, invals):
    aval = eqn.invars[0].aval
    ident = identity_for(kind, aval.dtype)
    x = ctx.mask(invals[0], aval, eqn.params["axes"], ident, eqn)
    return [PaddedValue(o) for o in _bind(ctx, eqn, [x])]

  return rule


for _prim, _kind in [
  (P.reduce_sum_p, "sum"),
  (P.reduce_prod_p, "prod"),
  (P.reduce_max_p, "max"),
  (P.reduce_min_p, "min"),
  (P.reduce_and_p, "and"),
  (P.reduce_or_p, "or"),
  (P.reduce_xor_p, "xor"),
  (P.argmax_p, "max"),
  (P.argmin_p, "min"),
]:
  register(_prim)(_reduction_rule(_kind))


@register(P.dot_general_p)
def _dot_general_rule(ctx, eqn, invals):
  (lc, rc), _ = eqn.params["dimension_numbers"]
  la, ra = eqn.invars[0].aval, eqn.invars[1].aval
  lhs = ctx.mask(invals[0], la, lc, identity_for("sum", la.dtype), eqn, "lhs")
  rhs = ctx.mask(invals[1], ra, rc, identity_for("sum", ra.dtype), eqn, "rhs")
  return [PaddedValue(o) for o in _bind(ctx, eqn, [lhs, rhs])]


if "ragged_dot_general" in _PRIVATE:

  @register(_PRIVATE["ragged_dot_general"])
  def _ragged_dot_general_rule(ctx, eqn, invals):
    # ``lax.ragged_dot`` (a MoE over tokens sorted by expert: rows in consecutive groups of
    # ``group_sizes``, group g times ``rhs[g]``; rows past the last group give 0).  The group
    # sizes have no dynamic axis, so they are the true ones (counted from masked data), and
    # every group lies in the true prefix of the ragged axis.  Ragged rows (a non-contracting
    # lhs axis): row i's result depends only on row i and its group, so the prefix is exact
    # with nothing masked.  Ragged contraction (the weights' gradient) and any other dynamic
    # contracting axis: masked with 0 as ``dot_general``'s (the padded rows lie past every
    # group, but need not be finite).
    p = eqn.params
    rdn = p["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, _) = rdn.dot_dimension_numbers
    la, ra, ga = (v.aval for v in eqn.invars)
    if p.get("group_offset") is not None:
      raise unsupported(eqn, "group_offset (a sharded ragged dot) over dynamic shapes")
    if dynamic_axes(ga) or any(is_dynamic_dim(ra.shape[d]) for d in rdn.rhs_group_dimensions):
      raise unsupported(eqn, "a dynamic number of groups")
    if any(d in lb and is_dynamic_dim(la.shape[d]) for d in rdn.lhs_ragged_dimensions):
      raise unsupported(eqn, "a ragged batch axis that is dynamic")
    rows = [d for d in rdn.lhs_ragged_dimensions if d not in lc and is_dynamic_dim(la.shape[d])]
    if rows:
      ctx.note(eqn, f"ragged rows along axis {rows[0]} ({la.shape[rows[0]]}): exact on the "
               "true prefix, nothing masked")
    zero_l, zero_r = identity_for("sum", la.dtype), identity_for("sum", ra.dtype)
    lhs = ctx.mask(invals[0], la, lc, zero_l, eqn, "lhs")
    rhs = ctx.mask(invals[1], ra, rc, zero_r, eqn, "rhs")
    return [PaddedValue(o) for o in _bind(ctx, eqn, [lhs, rhs, invals[2].val])]


def _cumulative_rule(kind: str):
  def rule(ctx, eqn, invals):
    aval = eqn.invars[0].aval
    axis = eqn.params["axis"]
    x = invals[0].val
    if eqn.params["reverse"] and is_dynamic_dim(aval.shape[axis]):
      # a reversed scan reads the padded tail first: it must read as the identity
      x = ctx.mask(invals[0], aval, [axis], identity_for(kind, aval.dtype), eqn)
    return [PaddedValue(o) for o in _bind(ctx, eqn, [x])]

  return rule


for _prim, _kind in [
  (P.cumsum_p, "sum"),
  (P.cumprod_p, "prod"),
  (P.cummax_p, "max"),
  (P.cummin_p, "min"),
  (P.cumlogsumexp_p, "max"),
]:
  register(_prim)(_cumulative_rule(_kind))


def sort_last(dtype):
  """The value a key of ``dtype`` takes to sort after every other under ``lax.sort``'s order
  (floats: NaN, which its comparator makes one value after +inf; complexes: NaN in the real and
  the imaginary part; integers: the largest; bools: True), or None where there is none (a
  float type without NaN)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return True
  if jnp.issubdtype(dtype, jnp.integer):
    return dtype.type(jnp.iinfo(dtype).max)
  if jnp.issubdtype(dtype, jnp.complexfloating):  # sorted by (real, imag): NaN in both
    return np.asarray(complex(np.nan, np.nan), dtype)[()]
  if jnp.issubdtype(dtype, jnp.floating):
    nan = np.asarray(np.nan, dtype)
    return nan[()] if np.isnan(nan) else None
  return None


@register(P.sort_p)
def _sort_rule(ctx, eqn, invals):
  dim = eqn.params["dimension"]
  aval = eqn.invars[0].aval
  vals = [pv.val for pv in invals]
  if not is_dynamic_dim(aval.shape[dim]):
    return [PaddedValue(o) for o in _bind(ctx, eqn, vals)]
  num_keys = eqn.params["num_keys"]
  lasts = [sort_last(v.aval.dtype) for v in eqn.invars[:num_keys]]
  if all(last is not None for last in lasts):
    # Each key's padded tail set to the value its order puts last: a stable sort then places
    # the padding after every valid element (a valid element equal to it in every key comes
    # first: it comes first in the array), in the exact order among valid ones.  One select
    # a key instead of a leading key operand that every comparison reads: 2-core CPU box,
    # jax 0.10.2, jnp.argsort of (1000, 16) along the rows at the 1,024 bucket, three
    # alternating processes: 1.29-1.43x jax.jit's time at 1,000 with the key, 0.90-1.03x
    # with the fill (sort_key_val of 1,000: 1.13-1.26x -> 0.94-1.25x).
    keys = [ctx.mask(pv, v.aval, [dim], last)
            for pv, v, last in zip(invals, eqn.invars, lasts, strict=False)]
    ctx.note(eqn, f"sorted padding last along axis {dim} ({aval.shape[dim]}): keys' padded "
             "tail set to their order's last value")
    outs = P.sort_p.bind(*keys, *vals[num_keys:], dimension=dim, is_stable=True,
                         num_keys=num_keys)
    return [PaddedValue(o) for o in outs]
  # A leading key "is padding" sorts the padded tail after every valid element; a stable sort
  # then keeps the exact order among valid ones.
  is_pad = (~ctx.axis_valid(aval, dim)).astype(jnp.int32)
  ctx.note(eqn, f"sorted padding last along axis {dim} ({aval.shape[dim]}) with a leading key")
  outs = P.sort_p.bind(is_pad, *vals, dimension=dim, is_stable=True, num_keys=num_keys + 1)
  return [PaddedValue(o) for o in outs[1:]]


@register(P.top_k_p)
def _top_k_rule(ctx, eqn, invals):
  aval = eqn.invars[0].aval
  axis = eqn.params.get("axis", aval.ndim - 1)
  if axis < 0:
    axis += aval.ndim
  x = invals[0].val
  if is_dynamic_dim(aval.shape[axis]):
    # top_k prefers the lower index among equal values, so valid elements win ties.
    x = ctx.mask(invals[0], aval, [axis], identity_for("max", aval.dtype), eqn)
  return [PaddedValue(o) for o in _bind(ctx, eqn, [x])]


def _require_static(eqn, params: dict, names) -> None:
  for n in names:
    if n in params and has_dim_expr(params[n]):
      raise unsupported(eqn, f"parameter {n}={params[n]} depends on a dynamic size")


@register(P.conv_general_dilated_p)
def _conv_rule(ctx, eqn, invals):
  p = eqn.params
  _require_static(
    eqn,
    p,
    [
      "window_strides",
      "lhs_dilation",
      "rhs_dilation",
      "feature_group_count",
      "batch_group_count",
    ],
  )
  dn = p["dimension_numbers"]
  la, ra = eqn.invars[0].aval, eqn.invars[1].aval
  lhs_spec, rhs_spec = dn.lhs_spec, dn.rhs_spec
  if p["feature_group_count"] > 1 and is_dynamic_dim(la.shape[lhs_spec[1]]):
    raise unsupported(eqn, "grouped convolution over a dynamic feature axis")
  if p["batch_group_count"] > 1 and is_dynamic_dim(la.shape[lhs_spec[0]]):
    raise unsupported(eqn, "batch-grouped convolution over a dynamic batch axis")
  # The padded tail of every mixed axis must read as the zeros of the exact convolution's
  # implicit padding; the batch axis of lhs and the output-feature axis of rhs do not mix.
  l_axes = [a for a in range(la.ndim) if a != lhs_spec[0]]
  r_axes = [a for a in range(ra.ndim) if a != rhs_spec[0]]
  lhs = ctx.mask(invals[0], la, l_axes, identity_for("sum", la.dtype), eqn, "lhs")
  rhs = ctx.mask(invals[1], ra, r_axes, identity_for("sum", ra.dtype), eqn, "rhs")
  oa = eqn.outvars[0].aval
  specs = []
  for i, a in enumerate(lhs_spec[2:]):
    k = ra.shape[rhs_spec[2 + i]]
    if has_dim_expr(p["padding"][i]) and (is_dynamic_dim(k) or p["lhs_dilation"][i] != 1):
      raise unsupported(eqn, "size-dependent padding with a dynamic or dilated window")
    win = (int(k) - 1) * p["rhs_dilation"][i] + 1 if not is_dynamic_dim(k) else 0
    specs.append((a, p["padding"][i], win, p["window_strides"][i], oa.shape[dn.out_spec[2 + i]]))
  lhs, pads = _shift_symbolic_padding(ctx, eqn, lhs, la, specs, identity_for("sum", la.dtype))
  params = ctx.subst_params(p)
  params["padding"] = tuple(pads)
  out = eqn.primitive.bind(lhs, rhs, **params)
  return [PaddedValue(_crop_to(ctx, out, oa))]


def _crop_to(ctx, out, aval):
  want = ctx.padded_shape(aval.shape)
  if tuple(out.shape) != want and all(g >= w for g, w in zip(out.shape, want, strict=True)):
    out = lax.slice(out, [0] * out.ndim, want)
  return out


def _shift_symbolic_padding(ctx, eqn, x, aval, specs, fill):
  """Turns size-dependent window padding (``"SAME"`` with stride > 1) into a static one.

  ``specs``: per window axis ``(operand_axis, (lo, hi), effective_window, stride, out_dim)``.
  An axis whose ``lo``/``hi`` is symbolic is shifted right by the true ``lo`` (the gap and the
  padded tail read as ``fill``, the value of the exact op's implicit padding) and gets a static
  ``(0, hi)`` that yields at least the padded output size (the caller crops).  ``x`` holds
  ``fill`` past the true size already (the callers mask it first), so the shift is a static
  pad by the largest ``lo`` on each side and a dynamic slice (a ResNet's stride-2 SAME convs:
  ``lo`` is 0 or 1 by the parity of the true size), not a gather: the CPU box compiled a small
  ResNet's buckets in 2.4 s each with the gather (XLA CPU), and ran them slower.
  """
  pads = []
  config = [(0, 0, 0)] * x.ndim  # every shifted axis in one pad and one slice (one copy)
  starts, sizes = [0] * x.ndim, list(x.shape)
  for a, (lo, hi), win, stride, out_dim in specs:
    if not has_dim_expr((lo, hi)):
      pads.append((int(lo), int(hi)))
      continue
    lo_min, lo_max = ctx.dim_range(lo)
    if lo_min < 0:
      raise unsupported(eqn, f"size-dependent negative padding {lo}")
    n = x.shape[a] + lo_max
    if lo_max:
      config[a] = (lo_max, lo_max, 0)
      starts[a], sizes[a] = lo_max - ctx.true_dim(lo), n
    n_out = ctx.padded_dim(out_dim)
    pads.append((0, max(0, (n_out - 1) * int(stride) + win - n)))
    ctx.note(eqn, f"size-dependent padding {lo} of axis {a} applied as a true-size shift")
  if any(c != (0, 0, 0) for c in config):
    x = lax.pad(x, jnp.asarray(fill, x.dtype), config)
    x = lax.dynamic_slice(x, [jnp.asarray(i, jnp.int32) for i in starts], sizes)
  return x, pads


def _reduce_window_rule(kind: str):
  def rule(ctx, eqn, invals):
    p = eqn.params
    _require_static(
      eqn, p, ["window_dimensions", "window_strides", "base_dilation", "window_dilation"]
    )
    aval = eqn.invars[0].aval
    ident = identity_for(kind, aval.dtype)
    x = ctx.mask(invals[0], aval, range(aval.ndim), ident, eqn)
    oa = eqn.outvars[0].aval
    specs = []
    for a in range(aval.ndim):
      if has_dim_expr(p["padding"][a]) and p["base_dilation"][a] != 1:
        raise unsupported(eqn, "size-dependent padding with base dilation")
      win = (p["window_dimensions"][a] - 1) * p["window_dilation"][a] + 1
      specs.append((a, p["padding"][a], win, p["window_strides"][a], oa.shape[a]))
    x, pads = _shift_symbolic_padding(ctx, eqn, x, aval, specs, ident)
    params = ctx.subst_params(p)
    params["padding"] = tuple(pads)
    return [PaddedValue(_crop_to(ctx, eqn.primitive.bind(x, **params), oa))]

  return rule


register(P.reduce_window_sum_p)(_reduce_window_rule("sum"))
register(P.reduce_window_max_p)(_reduce_window_rule("max"))
register(P.reduce_window_min_p)(_reduce_window_rule("min"))


def _mask_with_values(ctx, eqn, pv, aval, axes, init, what):
  """``pv`` with its padded region along ``axes`` set to the (possibly traced) scalar ``init``."""
  m = ctx.valid_mask(aval, axes)
  if m is None:
    return pv.val
  if same_fill(pv.fill, init):
    ctx.note(eqn, f"no mask needed on {what}: padded region already its init value")
    return pv.val
  ctx.note(eqn, f"masked {what} with its init value (the computation's identity)")
  return jnp.where(m, pv.val, jnp.asarray(init, pv.val.dtype))


@register(P.reduce_p)
def _generic_reduce_rule(ctx, eqn, invals):
  # lax.reduce's contract: init_values are an identity of the (associative) computation, so
  # padding elements set to the init value leave every reduction unchanged.
  n = len(eqn.invars) // 2
  dims = eqn.params["dimensions"]
  vals = [
    _mask_with_values(ctx, eqn, pv, v.aval, dims, init.val, f"operand {i}")
    for i, (v, pv, init) in enumerate(zip(eqn.invars[:n], invals[:n], invals[n:], strict=True))
  ]
  outs = _bind(ctx, eqn, vals + [pv.val for pv in invals[n:]])
  return [PaddedValue(o) for o in outs]


@register(P.reduce_window_p)
def _generic_reduce_window_rule(ctx, eqn, invals):
  # As the reduce rule: the init value is the computation's identity (lax.reduce_window's
  # contract), and it is also the value of the exact op's implicit window padding.
  p = eqn.params
  _require_static(
    eqn, p, ["window_dimensions", "window_strides", "base_dilation", "window_dilation"]
  )
  n = len(eqn.invars) // 2
  aval = eqn.invars[0].aval
  oa = eqn.outvars[0].aval
  specs = _window_specs(ctx, eqn, aval, oa, p["base_dilation"])
  vals, pads = [], None
  for i, (v, pv, init) in enumerate(zip(eqn.invars[:n], invals[:n], invals[n:], strict=True)):
    x = _mask_with_values(ctx, eqn, pv, v.aval, range(aval.ndim), init.val, f"operand {i}")
    x, pads = _shift_symbolic_padding(ctx, eqn, x, v.aval, specs, init.val)
    vals.append(x)
  params = ctx.subst_params(p)
  params["padding"] = tuple(pads)
  outs = eqn.primitive.bind(*vals, *[pv.val for pv in invals[n:]], **params)
  return [PaddedValue(_crop_to(ctx, o, v.aval)) for o, v in zip(outs, eqn.outvars, strict=True)]


if hasattr(P, "approx_top_k_p"):

  @register(P.approx_top_k_p)
  def _approx_top_k_rule(ctx, eqn, invals):
    p = eqn.params
    aval = eqn.invars[0].aval
    axis = p["reduction_dimension"] % aval.ndim
    x = invals[0].val
    if is_dynamic_dim(aval.shape[axis]):
      backend = jax.default_backend()
      if backend == "tpu":
        raise unsupported(
          eqn,
          "on TPU approx_top_k is approximate and its recall depends on the reduced length, so "
          "the padded and the exact results differ (use lax.top_k)",
        )
      if backend != "cpu":  # H100: all-equal values of length 6 gave index 5, padded to 8 3
        raise unsupported(
          eqn,
          f"on {backend} approx_top_k breaks ties in an order that depends on the reduced "
          "length, so the padded and the exact indices can differ (use lax.top_k: ties go to "
          "the lower index)",
        )
      if any(is_dynamic_dim(d) for v in eqn.outvars for d in v.aval.shape[axis : axis + 1]):
        raise unsupported(eqn, "approx_top_k with aggregate_to_topk=False over a dynamic axis")
      if p["reduction_input_size_override"] != -1:
        raise unsupported(eqn, "approx_top_k with reduction_input_size_override")
      # On the CPU it is an exact sort-based top-k (ties to the lower index): padding reads
      # as the chooser's identity.
      kind = "max" if p["is_max_k"] else "min"
      x = ctx.mask(invals[0], aval, [axis], identity_for(kind, aval.dtype), eqn)
    return [PaddedValue(o) for o in _bind(ctx, eqn, [x])]


def _select_kind(eqn) -> str:
  name = eqn.params["select_prim"].name
  if name in ("ge", "gt"):
    return "max"
  if name in ("le", "lt"):
    return "min"
  raise unsupported(eqn, f"select_prim {name} is not a max/min chooser")


def _window_specs(ctx, eqn, aval, out_aval, base_dilation=None):
  p = eqn.params
  specs = []
  for a in range(aval.ndim):
    if has_dim_expr(p["padding"][a]) and base_dilation is not None and base_dilation[a] != 1:
      raise unsupported(eqn, "size-dependent padding with base dilation")
    dil = p.get("window_dilation", (1,) * aval.ndim)[a]
    win = (p["window_dimensions"][a] - 1) * dil + 1
    specs.append((a, p["padding"][a], win, p["window_strides"][a], out_aval.shape[a]))
  return specs


@register(P.select_and_scatter_add_p)
def _select_and_scatter_add_rule(ctx, eqn, invals):
  # The gradient of max/min pooling.  The padded tail of the operand reads as the chooser's
  # identity (-inf for max), so a window at a true output position never selects it over a valid
  # element (it comes later in window order and loses ties, like the exact op's own "hi"
  # padding); windows past the true output extent scatter -0.0 (x + -0.0 == x).
  p = eqn.params
  _require_static(eqn, p, ["window_dimensions", "window_strides"])
  sa, oa = eqn.invars[0].aval, eqn.invars[1].aval
  ident = identity_for(_select_kind(eqn), oa.dtype)
  zero = identity_for("sum", sa.dtype)
  if jnp.issubdtype(sa.dtype, jnp.floating):
    zero = np.asarray(-0.0, sa.dtype)[()]
  source = ctx.mask(invals[0], sa, range(sa.ndim), zero, eqn, "source")
  x = ctx.mask(invals[1], oa, range(oa.ndim), ident, eqn, "operand")
  n_in = x.shape
  specs = _window_specs(ctx, eqn, oa, sa)
  x, pads = _shift_symbolic_padding(ctx, eqn, x, oa, specs, ident)
  # the shifted operand must have exactly as many windows as the source has rows
  src_pad = []
  for a, (lo, hi) in enumerate(pads):
    _, _, win, stride, _ = specs[a]
    n_win = max(0, (x.shape[a] + lo + hi - win) // int(stride) + 1)
    if n_win < source.shape[a]:
      raise unsupported(eqn, f"padded windows of axis {a} fewer than the padded source rows")
    src_pad.append((0, n_win - source.shape[a], 0))
  if any(c != (0, 0, 0) for c in src_pad):
    source = lax.pad(source, jnp.asarray(zero, source.dtype), src_pad)
  params = dict(p, padding=tuple(pads))
  out = P.select_and_scatter_add_p.bind(source, x, **params)
  for a, (lo, _hi), _, _, _ in specs:
    if has_dim_expr(lo):  # undo the true-size shift of _shift_symbolic_padding
      out = _remap_axis(out, a, ctx.true_dim(lo) + _iota(n_in[a]))
  return [PaddedValue(out)]


@register(P.select_and_gather_add_p)
def _select_and_gather_add_rule(ctx, eqn, invals):
  # The JVP of max/min pooling: like reduce_window_max, with the tangent moved alongside.
  p = eqn.params
  _require_static(
    eqn, p, ["window_dimensions", "window_strides", "base_dilation", "window_dilation"]
  )
  ta, oa = eqn.invars[0].aval, eqn.invars[1].aval
  ident = identity_for(_select_kind(eqn), oa.dtype)
  x = ctx.mask(invals[1], oa, range(oa.ndim), ident, eqn, "operand")
  specs = _window_specs(ctx, eqn, oa, eqn.outvars[0].aval, p["base_dilation"])
  x, pads = _shift_symbolic_padding(ctx, eqn, x, oa, specs, ident)
  t, _ = _shift_symbolic_padding(ctx, eqn, invals[0].val, ta, specs, 0)
  params = ctx.subst_params(p)
  params["padding"] = tuple(pads)
  out = P.select_and_gather_add_p.bind(t, x, **params)
  return [PaddedValue(_crop_to(ctx, out, eqn.outvars[0].aval))]


# --------------------------------------------------------------------------------------------
# relayout rules


def _nontrivial(shape):
  return [d for d in shape if is_dynamic_dim(d) or int(d) != 1]


def _prod(ds):
  out = 1
  for d in ds:
    out = out * d
  return out


def _reshape_is_plain(ctx, in_shape, out_shape) -> bool:
  """Whether a plain reshape of the padded array keeps valid elements in the prefix.

  Dims are grouped into runs with equal products; a run keeps the layout when every dim but its
  leading one is static (the padded part of the run is then one contiguous tail).
  """
  a, b = _nontrivial(in_shape), _nontrivial(out_shape)
  i = j = 0
  while i < len(a) or j < len(b):
    if i >= len(a) or j >= len(b):
      return False
    ga, gb = [a[i]], [b[j]]
    i, j = i + 1, j + 1
    for _ in range(len(a) + len(b) + 1):
      try:
        if _prod(ga) == _prod(gb):
          break
      except Exception:
        pass
      pa = math.prod(ctx.padded_dim(d) for d in ga)
      pb = math.prod(ctx.padded_dim(d) for d in gb)
      if pa <= pb and i < len(a):
        ga.append(a[i])
        i += 1
      elif j < len(b):
        gb.append(b[j])
        j += 1
      elif i < len(a):
        ga.append(a[i])
        i += 1
      else:
        return False
    else:
      return False
    try:
      if not _prod(ga) == _prod(gb):
        return False
    except Exception:
      return False
    if any(is_dynamic_dim(d) for d in ga[1:]) or any(is_dynamic_dim(d) for d in gb[1:]):
      return False
  return True


def _relayout_gather(ctx, x, in_shape, out_shape):
  """Moves elements so that true row-major order of ``in_shape`` becomes that of ``out_shape``."""
  out_p = ctx.padded_shape(out_shape)
  in_p = ctx.padded_shape(in_shape)
  lin = None
  for a, d in enumerate(out_shape):
    ia = lax.broadcasted_iota(jnp.int32, out_p, a)
    lin = ia if lin is None else lin * jnp.maximum(ctx.true_dim(d), 1) + ia
  if lin is None:
    lin = jnp.zeros(out_p, jnp.int32)
  coords = []
  rem = lin
  for d in reversed(in_shape):
    td = jnp.maximum(ctx.true_dim(d), 1)
    coords.append(rem % td)
    rem = rem // td
  coords.reverse()
  src = jnp.zeros(out_p, jnp.int32)
  for a, c in enumerate(coords):
    src = src * in_p[a] + c
  flat = x.reshape(-1)
  return flat[jnp.clip(src, 0, max(flat.shape[0] - 1, 0))]


@register(P.reshape_p)
def _reshape_rule(ctx, eqn, invals):
  if eqn.params.get("dimensions") is not None:
    raise unsupported(eqn, "reshape with a dimensions permutation")
  in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  x = invals[0]
  if _reshape_is_plain(ctx, in_shape, out_shape):
    return [PaddedValue(o, x.fill) for o in _bind(ctx, eqn, [pv.val for pv in invals])]
  ctx.note(eqn, f"relayout {tuple(in_shape)} -> {tuple(out_shape)} by true-size index gather")
  return [PaddedValue(_relayout_gather(ctx, x.val, in_shape, out_shape))]


@register(P.concatenate_p)
def _concatenate_rule(ctx, eqn, invals):
  dim = eqn.params["dimension"]
  out_aval = eqn.outvars[0].aval
  vals = [pv.val for pv in invals]
  if not is_dynamic_dim(out_aval.shape[dim]):
    # static concatenated axis: operands without a dynamic axis (constants, literals) add no
    # padded region, the others must agree on their fill
    fill = common_fill(
      pv.fill for v, pv in zip(eqn.invars, invals, strict=True) if dynamic_axes(v.aval)
    )
    return [PaddedValue(o, fill) for o in _bind(ctx, eqn, vals)]
  # Each operand lands at the true offset; a later one overwrites the padded tail of the one
  # before.  The buffer holds max_i(largest true offset_i + padded_i), so no start index is ever
  # clamped; when that is the output's padded size (a loop's ``concat([x, new])`` with the true
  # size bounded below the bucket), the first update covers the buffer and XLA writes in place.
  ctx.note(eqn, f"relayout: operands placed at true offsets along axis {dim}")
  out_p = ctx.padded_shape(out_aval.shape)
  buf = list(out_p)
  need, off_max = 0, 0
  for v, val in zip(eqn.invars, vals, strict=True):
    need = max(need, off_max + val.shape[dim])
    off_max += ctx.dim_range(v.aval.shape[dim])[1]
  buf[dim] = max(out_p[dim], need)
  out = jnp.zeros(buf, out_aval.dtype)
  offset = jnp.int32(0)
  for v, val in zip(eqn.invars, vals, strict=True):
    starts = [jnp.int32(0)] * out.ndim
    starts[dim] = offset
    out = lax.dynamic_update_slice(out, val.astype(out.dtype), starts)
    offset = offset + ctx.true_dim(v.aval.shape[dim])
  if buf[dim] != out_p[dim]:
    out = lax.slice_in_dim(out, 0, out_p[dim], axis=dim)
  return [PaddedValue(out)]


def _traced_primitive(fn, *args):
  """The first primitive ``fn`` emits: for primitives ``jax.extend`` does not export, without
  importing jax's private modules."""
  eqns = jax.make_jaxpr(fn)(*args).eqns
  return eqns[0].primitive if eqns else None


# jnp.tile emits one ``tile`` primitive (jax 0.10); jax.extend has no ``tile_p``.
_TILE = _traced_primitive(lambda x: jnp.tile(x, (2,)), np.zeros(1, np.float32))
if _TILE is not None and _TILE.name != "tile":  # pragma: no cover - jnp.tile lowered otherwise
  _TILE = None


@register(_TILE)
def _tile_rule(ctx, eqn, invals):
  # out[..., i, ...] = x[..., i mod d, ...] along every axis.  Copies along static axes
  # (``jnp.tile(x[:, None], (1, beam, 1))`` of beam search) leave each dynamic axis's prefix
  # where it was: the primitive binds as is and a known fill survives.  Copies along a dynamic
  # axis (or a symbolic rep count) are gathered from the true index ``i mod d``, so the k
  # copies of the true extent sit back to back in the prefix of the padded output.
  aval, out_aval = eqn.invars[0].aval, eqn.outvars[0].aval
  reps = eqn.params["reps"]
  x = invals[0]
  moved = [
    a
    for a, r in enumerate(reps)
    if (is_dynamic_dim(r) or int(r) != 1) and (is_dynamic_dim(aval.shape[a]) or is_dynamic_dim(r))
  ]
  static_reps = tuple(1 if a in moved else int(r) for a, r in enumerate(reps))
  val = x.val
  if any(r != 1 for r in static_reps):
    val = eqn.primitive.bind(val, reps=static_reps)
  fill = x.fill
  for a in moved:
    d = aval.shape[a]
    n_out = ctx.padded_dim(out_aval.shape[a])
    src = _iota(n_out) % jnp.maximum(ctx.true_dim(d), 1)
    val = _remap_axis(val, a, src)
    fill = None  # the padded tail along ``a`` now holds copies of valid elements
    ctx.note(
      eqn, f"relayout: {reps[a]} copies of the true extent of axis {a} ({d}) placed back to back"
    )
  return [PaddedValue(val, fill)]


@register(P.rev_p)
def _rev_rule(ctx, eqn, invals):
  aval = eqn.invars[0].aval
  dims = eqn.params["dimensions"]
  static = tuple(d for d in dims if not is_dynamic_dim(aval.shape[d]))
  x = invals[0].val
  if static:
    x = lax.rev(x, static)
  for d in dims:
    if is_dynamic_dim(aval.shape[d]):
      ctx.note(eqn, f"relayout: reversed the true extent of axis {d} ({aval.shape[d]})")
      n = x.shape[d]
      x = _remap_axis(x, d, ctx.true_dim(aval.shape[d]) - 1 - _iota(n))
  return [PaddedValue(x)]


@register(P.pad_p)
def _pad_rule(ctx, eqn, invals):
  aval = eqn.invars[0].aval
  config = eqn.params["padding_config"]
  x, pad_value = invals[0].val, invals[1].val
  dyn = [
    a
    for a, (lo, hi, interior) in enumerate(config)
    if is_dynamic_dim(aval.shape[a]) or any(is_dynamic_dim(c) for c in (lo, hi, interior))
  ]
  static_config = [
    (0, 0, 0) if a in dyn else tuple(int(c) for c in cfg) for a, cfg in enumerate(config)
  ]
  x = lax.pad(x, pad_value.astype(x.dtype), static_config)
  out_aval = eqn.outvars[0].aval
  fill_ok = True
  for a in dyn:
    lo, hi, interior = config[a]
    if is_dynamic_dim(interior):
      raise unsupported(eqn, "interior padding that depends on a dynamic size")
    interior = int(interior)
    n = ctx.padded_dim(out_aval.shape[a])
    rel = _iota(n) - ctx.true_dim(lo)
    size = ctx.true_dim(aval.shape[a])
    if interior:
      q, r = rel // (interior + 1), rel % (interior + 1)
      valid = (rel >= 0) & (r == 0) & (q < size)
    else:
      q = rel
      valid = (rel >= 0) & (rel < size)
    ctx.note(eqn, f"relayout: padded axis {a} at true offsets")
    x = _remap_axis(x, a, q, valid, pad_value)
    if is_dynamic_dim(hi) or int(hi) < 0:
      fill_ok = False
  var = eqn.invars[1]
  fill = (
    var.val if fill_ok and isinstance(var, jex_core.Literal) and np.ndim(var.val) == 0 else None
  )
  return [PaddedValue(x, fill)]


@register(P.slice_p)
def _slice_rule(ctx, eqn, invals):
  aval = eqn.invars[0].aval
  out_aval = eqn.outvars[0].aval
  p = eqn.params
  strides = p["strides"] or (1,) * aval.ndim
  if any(is_dynamic_dim(s) for s in strides):
    raise unsupported(eqn, "a stride that depends on a dynamic size")
  x = invals[0].val
  start, limit, step, remap = [], [], [], []
  for a in range(aval.ndim):
    s, st = p["start_indices"][a], int(strides[a])
    n = ctx.padded_dim(out_aval.shape[a])
    if is_dynamic_dim(s):
      start.append(0), limit.append(x.shape[a]), step.append(1)
      remap.append(a)
    else:
      s = int(s)
      lim = s + (n - 1) * st + 1 if n > 0 else s
      if lim > x.shape[a]:
        raise unsupported(eqn, f"padded slice of axis {a} runs past the padded operand")
      start.append(s), limit.append(lim), step.append(st)
  x = lax.slice(x, start, limit, step)
  for a in remap:
    ctx.note(eqn, f"relayout: slice of axis {a} from the true start {p['start_indices'][a]}")
    n = ctx.padded_dim(out_aval.shape[a])
    x = _remap_axis(x, a, ctx.true_dim(p["start_indices"][a]) + _iota(n) * int(strides[a]))
  return [PaddedValue(x)]


if "split" in _PRIVATE:

  @register(_PRIVATE["split"])
  def _split_rule(ctx, eqn, invals):
    axis = eqn.params["axis"]
    aval = eqn.invars[0].aval
    sizes = eqn.params["sizes"]
    if not is_dynamic_dim(aval.shape[axis]) and not any(is_dynamic_dim(s) for s in sizes):
      return [PaddedValue(o) for o in _bind(ctx, eqn, [invals[0].val])]
    ctx.note(eqn, f"relayout: pieces taken at true offsets along axis {axis}")
    outs, offset = [], 0
    for s in sizes:
      n = ctx.padded_dim(s)
      outs.append(PaddedValue(_remap_axis(invals[0].val, axis, offset + _iota(n))))
      offset = offset + ctx.true_dim(s)
    return outs


if "stack" in _PRIVATE:

  @register(_PRIVATE["stack"])
  def _stack_rule(ctx, eqn, invals):
    # ``jnp.stack`` (jax >= 0.10): operands of one shape, so of one padded layout; the new axis
    # is static (one entry per operand).  The padded region holds a known value only where
    # every operand's holds the same one.
    fill = common_fill(pv.fill for v, pv in zip(eqn.invars, invals, strict=True)
                       if dynamic_axes(v.aval))
    return [PaddedValue(o, fill) for o in _bind(ctx, eqn, [pv.val for pv in invals])]


if "unstack" in _PRIVATE:

  @register(_PRIVATE["unstack"])
  def _unstack_rule(ctx, eqn, invals):
    # The unstacked axis is static (one result per element); the other axes keep their layout.
    aval = eqn.invars[0].aval
    if is_dynamic_dim(aval.shape[eqn.params["axis"]]):
      raise unsupported(eqn, "unstack along a dynamic axis")
    outs = _bind(ctx, eqn, [invals[0].val])
    return [PaddedValue(o, invals[0].fill) for o in outs]


@register(P.dynamic_slice_p)
def _dynamic_slice_rule(ctx, eqn, invals):
  aval = eqn.invars[0].aval
  sizes = eqn.params["slice_sizes"]
  x = invals[0].val
  starts = [pv.val for pv in invals[1 : 1 + aval.ndim]]
  if len(invals) > 1 + aval.ndim:
    raise unsupported(eqn, "dynamic_slice with dynamic-shape operands")
  dyn = [a for a in range(aval.ndim) if is_dynamic_dim(aval.shape[a]) or is_dynamic_dim(sizes[a])]
  st = [jnp.int32(0) if a in dyn else jnp.asarray(starts[a]).astype(jnp.int32)
        for a in range(aval.ndim)]  # one index dtype (x64 starts are int64)
  sz = [x.shape[a] if a in dyn else int(sizes[a]) for a in range(aval.ndim)]
  x = lax.dynamic_slice(x, st, sz)
  for a in dyn:
    # exact semantics clamp the start so the true-size slice fits the true-size operand
    start = jnp.clip(
      starts[a].astype(jnp.int32), 0, ctx.true_dim(aval.shape[a]) - ctx.true_dim(sizes[a])
    )
    ctx.note(eqn, f"relayout: axis {a} sliced from the start clamped at true sizes")
    x = _remap_axis(x, a, start + _iota(ctx.padded_dim(sizes[a])))
  return [PaddedValue(x)]


@register(P.dynamic_update_slice_p)
def _dynamic_update_slice_rule(ctx, eqn, invals):
  xa, ua = eqn.invars[0].aval, eqn.invars[1].aval
  x, u = invals[0], invals[1]
  starts = [
    jnp.clip(pv.val.astype(jnp.int32), 0, ctx.true_dim(xa.shape[a]) - ctx.true_dim(ua.shape[a]))
    for a, pv in enumerate(invals[2 : 2 + xa.ndim])
  ]
  if not dynamic_axes(ua):
    # Starts clamped at true sizes also fit the padded operand: plain update, padded region kept.
    out = lax.dynamic_update_slice(x.val, u.val, starts)
    return [PaddedValue(out, x.fill)]
  ctx.note(eqn, "relayout: update placed by masked index gather (update has dynamic axes)")
  xp = x.val.shape
  g, inside = u.val, None
  for a in range(xa.ndim):
    idx = _iota(xp[a]) - starts[a]
    g = _remap_axis(g, a, idx)
    ok = (idx >= 0) & (idx < ctx.true_dim(ua.shape[a]))
    shape = [1] * xa.ndim
    shape[a] = xp[a]
    ok = ok.reshape(shape)
    inside = ok if inside is None else inside & ok
  return [PaddedValue(jnp.where(inside, g, x.val), x.fill)]


def _default_fill(dtype):
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return np.nan
  if dtype == np.bool_:
    return True
  if jnp.issubdtype(dtype, jnp.unsignedinteger):
    return jnp.iinfo(dtype).max
  return jnp.iinfo(dtype).min


@register(P.gather_p)
def _gather_rule(ctx, eqn, invals):
  p = eqn.params
  dn = p["dimension_numbers"]
  oa, _ia = eqn.invars[0].aval, eqn.invars[1].aval
  slice_sizes = p["slice_sizes"]
  # A window that spans a whole axis the indices never address (x[:, :, 0] on [b, t, 3, ...])
  # keeps that axis' layout: the plain gather is already exact there, and keeping it plain lets
  # XLA turn constant-index gathers into slices (a clamped gather stays a real gather: measured
  # 1.4x slower on the CPU encoder benchmark).
  tricky = [
    a
    for a in range(oa.ndim)
    if (is_dynamic_dim(oa.shape[a]) or is_dynamic_dim(slice_sizes[a]))
    and a not in dn.operand_batching_dims
    and not (a not in dn.start_index_map and slice_sizes[a] == oa.shape[a])
  ]
  mode = p["mode"]
  mode_name = getattr(mode, "name", str(mode))
  fill_mode = "FILL" in mode_name
  if not tricky and not fill_mode:
    return [PaddedValue(o) for o in _bind(ctx, eqn, [invals[0].val, invals[1].val])]
  if not tricky:
    return [PaddedValue(o) for o in _bind(ctx, eqn, [invals[0].val, invals[1].val])]
  x, idx = invals[0].val, invals[1].val
  sim = dn.start_index_map
  oob = None
  cols = []
  for k, a in enumerate(sim):
    col = idx[..., k]
    hi = ctx.true_dim(oa.shape[a]) - ctx.true_dim(slice_sizes[a])
    if fill_mode:
      bad = (col < 0) | (col > hi)
      oob = bad if oob is None else oob | bad
    cols.append(jnp.clip(col, 0, hi).astype(idx.dtype))
  idx = jnp.stack(cols, axis=-1) if cols else idx
  # Pad the operand along tricky indexed axes so the padded gather never clamps a start that the
  # exact gather keeps.
  pads = [(0, 0, 0)] * oa.ndim
  for a in tricky:
    if a in sim:
      pads[a] = (0, ctx.padded_dim(slice_sizes[a]), 0)
    elif ctx.padded_dim(slice_sizes[a]) > x.shape[a]:
      raise unsupported(eqn, f"padded slice of axis {a} is larger than the padded operand")
  if any(c != (0, 0, 0) for c in pads):
    x = lax.pad(x, jnp.zeros((), x.dtype), pads)
  params = ctx.subst_params(p)
  params["mode"] = lax.GatherScatterMode.CLIP
  out = P.gather_p.bind(x, idx, **params)
  ctx.note(eqn, f"start indices clamped at true sizes on axes {tricky}")
  if fill_mode and oob is not None:
    # oob has the batch shape of indices; broadcast it over the offset dims of the output
    batch_dims = [d for d in range(out.ndim) if d not in dn.offset_dims]
    shape = [1] * out.ndim
    for d, s in zip(batch_dims, oob.shape, strict=False):
      shape[d] = s
    fv = p["fill_value"]
    fv = _default_fill(out.dtype) if fv is None else fv
    out = jnp.where(oob.reshape(shape), jnp.asarray(fv, out.dtype), out)
  return [PaddedValue(out)]


_SCATTER_KIND = {
  "scatter-add": "sum",
  "scatter_add": "sum",
  "scatter-mul": "prod",
  "scatter_mul": "prod",
  "scatter-min": "min",
  "scatter_min": "min",
  "scatter-max": "max",
  "scatter_max": "max",
}


@register(P.scatter_p, P.scatter_add_p, P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p)
def _scatter_rule(ctx, eqn, invals):
  p = eqn.params
  dn = p["dimension_numbers"]
  oa, ia, ua = (v.aval for v in eqn.invars[:3])
  x, idx, upd = (pv.val for pv in invals[:3])
  kind = _SCATTER_KIND.get(eqn.primitive.name)
  mode_name = getattr(p["mode"], "name", str(p["mode"]))
  fill_mode = "FILL" in mode_name
  # window size of every operand axis (1 for inserted / batching axes)
  window = {}
  wdims = iter(dn.update_window_dims)
  for a in range(oa.ndim):
    if a in dn.inserted_window_dims or a in dn.operand_batching_dims:
      window[a] = 1
    else:
      window[a] = ua.shape[next(wdims)]
  scatter_batch = [d for d in range(ua.ndim) if d not in dn.update_window_dims]
  sdo = dn.scatter_dims_to_operand_dims
  tricky = [a for a in sdo if is_dynamic_dim(oa.shape[a]) or is_dynamic_dim(window[a])]
  if kind is None:
    for a, w in window.items():
      if is_dynamic_dim(w) and (a in sdo or not (w == oa.shape[a])):
        return _scatter_by_element(ctx, eqn, invals, window)
  # per scatter-batch element: drop (padding, or out of bounds at true sizes in fill mode).  A
  # reducing scatter runs in CLIP mode below, so in fill mode its out-of-bounds updates are
  # masked on every axis, static ones too (``jnp.bincount(ids, length=3)`` drops ids >= 3,
  # jraph points padded edges at num_nodes: clamped, they landed in the last slot).
  drop = None
  cols = []
  for k, a in enumerate(sdo):
    col = idx[..., k]
    hi = ctx.true_dim(oa.shape[a]) - ctx.true_dim(window[a])
    if fill_mode and (a in tricky or kind is not None):
      bad = (col < 0) | (col > hi)
      drop = bad if drop is None else drop | bad
    cols.append(jnp.clip(col, 0, hi).astype(idx.dtype) if a in tricky else col)
  idx_batch_dyn = [d for d in dynamic_axes(ia) if d != ia.ndim - 1]
  if idx_batch_dyn:
    m = ctx.valid_mask(ia, idx_batch_dyn)
    m = m[..., 0]
    drop = ~m if drop is None else drop | ~m
  idx = jnp.stack(cols, axis=-1) if cols else idx
  # broadcast per-batch-element drop over the update window dims
  if drop is not None:
    shape = [1] * ua.ndim
    for d, s in zip(scatter_batch, drop.shape, strict=False):
      shape[d] = s
    drop_u = drop.reshape(shape)
  else:
    drop_u = None
  params = ctx.subst_params(p)
  params["unique_indices"] = False
  params["indices_are_sorted"] = False
  if kind is not None:
    ident = identity_for(kind, ua.dtype)
    if kind == "sum" and jnp.issubdtype(ua.dtype, jnp.floating):
      ident = np.asarray(-0.0, ua.dtype)[()]  # x + (-0.0) == x, even for x == -0.0
    win_axes = [d for d in dn.update_window_dims if is_dynamic_dim(ua.shape[d])]
    keep = ctx.valid_mask(ua, win_axes)
    if drop_u is not None:
      keep = ~drop_u if keep is None else keep & ~drop_u
    if keep is not None:
      upd = jnp.where(keep, upd, jnp.asarray(ident, upd.dtype))
      ctx.note(eqn, f"masked padded updates with {ident}")
    params["mode"] = lax.GatherScatterMode.CLIP
  else:
    if drop is not None:
      sentinel = jnp.iinfo(idx.dtype).max // 2
      idx = jnp.where(drop[..., None], jnp.asarray(sentinel, idx.dtype), idx)
      ctx.note(eqn, "padded updates dropped with an out-of-bounds index")
    params["mode"] = lax.GatherScatterMode.FILL_OR_DROP
    if not fill_mode:
      pass  # in-bounds after the true-size clamp above, so dropping changes nothing
  pads = [(0, 0, 0)] * oa.ndim
  for a in tricky:
    pads[a] = (0, ctx.padded_dim(window[a]), 0)
  padded = any(c != (0, 0, 0) for c in pads)
  xp = lax.pad(x, jnp.zeros((), x.dtype), pads) if padded else x
  out = eqn.primitive.bind(xp, idx, upd, *[pv.val for pv in invals[3:]], **params)
  if padded:
    out = lax.slice(out, [0] * oa.ndim, x.shape)
  return [PaddedValue(out, invals[0].fill)]


def _scatter_by_element(ctx, eqn, invals, window):
  """An overwriting scatter whose window is dynamic and partial (``x.at[:, 1:].set(y)``).

  The padded tail of such a window would overwrite valid operand elements, and no identity
  exists for an overwrite.  So every update element is scattered on its own, at its true
  operand index (start clamped or dropped at the true sizes, as the exact op does, plus its
  window offset); elements in the padded tail of the window or of the scatter batch get an
  out-of-bounds index and are dropped.  Exact, including the order-free semantics of duplicate
  indices; costs an index array of the update's size times the operand rank.
  """
  p = eqn.params
  dn = p["dimension_numbers"]
  oa, ua = eqn.invars[0].aval, eqn.invars[2].aval
  x, idx, upd = (pv.val for pv in invals[:3])
  if dn.operand_batching_dims:
    raise unsupported(eqn, "overwriting scatter with a dynamic partial window and batching dims")
  mode_name = getattr(p["mode"], "name", str(p["mode"]))
  fill_mode = "FILL" in mode_name
  sdo = dn.scatter_dims_to_operand_dims
  scatter_batch = [d for d in range(ua.ndim) if d not in dn.update_window_dims]
  win_axes = [a for a in range(oa.ndim) if a not in dn.inserted_window_dims]
  ushape = tuple(upd.shape)

  def on_update(col):  # a per-scatter-batch-element array, broadcast over the update's shape
    shape = [1] * len(ushape)
    for d, n in zip(scatter_batch, col.shape, strict=True):
      shape[d] = n
    return jnp.broadcast_to(col.reshape(shape), ushape)

  keep = jnp.ones(ushape, bool)
  idx_batch_dyn = [d for d in dynamic_axes(eqn.invars[1].aval) if d != idx.ndim - 1]
  if idx_batch_dyn:
    keep = keep & on_update(ctx.valid_mask(eqn.invars[1].aval, idx_batch_dyn)[..., 0])
  starts = {}
  for k, a in enumerate(sdo):
    col = idx[..., k].astype(jnp.int32)
    hi = ctx.true_dim(oa.shape[a]) - ctx.true_dim(window[a])
    if fill_mode:
      keep = keep & on_update((col >= 0) & (col <= hi))
    starts[a] = on_update(jnp.clip(col, 0, hi))
  coords = []
  for a in range(oa.ndim):
    c = starts.get(a, jnp.zeros(ushape, jnp.int32))
    if a in win_axes:
      d = dn.update_window_dims[win_axes.index(a)]
      off = lax.broadcasted_iota(jnp.int32, ushape, d)
      c = c + off
      if is_dynamic_dim(ua.shape[d]):
        keep = keep & (off < ctx.true_dim(ua.shape[d]))
    coords.append(c)
  sentinel = jnp.iinfo(jnp.int32).max // 2
  full = jnp.stack([jnp.where(keep, c, sentinel) for c in coords], axis=-1)
  params = ctx.subst_params(p)
  params["dimension_numbers"] = lax.ScatterDimensionNumbers(
    update_window_dims=(),
    inserted_window_dims=tuple(range(oa.ndim)),
    scatter_dims_to_operand_dims=tuple(range(oa.ndim)),
  )
  params["mode"] = lax.GatherScatterMode.FILL_OR_DROP
  params["unique_indices"] = False
  params["indices_are_sorted"] = False
  ctx.note(eqn, "partial dynamic window: scattered element by element at true indices")
  out = eqn.primitive.bind(x, full, upd, *[pv.val for pv in invals[3:]], **params)
  return [PaddedValue(out, invals[0].fill)]


# --------------------------------------------------------------------------------------------
# random bits


def _random_flat_rule(ctx, eqn, invals):
  ka = eqn.invars[0].aval
  shape = eqn.params["shape"]
  if not any(is_dynamic_dim(d) for d in shape):
    return [PaddedValue(o) for o in _bind(ctx, eqn, [invals[0].val])]
  if not jp.threefry_partitionable() or "fry" not in str(ka.dtype):
    raise unsupported(
      eqn, "random bits over a dynamic shape need the threefry PRNG with jax_threefry_partitionable"
    )
  # With partitionable threefry the bits of element i of a flat draw do not depend on the draw's
  # length, and a shaped draw is the flat draw in row-major order: draw flat, then place.
  # A batch of keys (``jax.vmap`` over ``jax.random.split(key, b)``: Equinox's per-example
  # dropout) draws each key's own flat draw on the last axis (the leading axes are the keys',
  # padded or not; a padded row's key is garbage and so are its bits, which nobody reads).
  n = math.prod(ctx.padded_shape(shape))
  params = dict(eqn.params, shape=(n,))
  keys = invals[0].val
  flat = eqn.primitive.bind(keys, **params)  # keys.shape + (n,)
  ctx.note(eqn, "bit-identical draw: flat draw placed at true row-major positions")
  out_p = ctx.padded_shape(shape)
  lin = None
  for a, d in enumerate(shape):
    ia = lax.broadcasted_iota(jnp.int32, out_p, a)
    lin = ia if lin is None else lin * ctx.true_dim(d) + ia
  placed = jnp.take(flat, jnp.clip(lin, 0, n - 1).reshape(-1), axis=-1)
  return [PaddedValue(placed.reshape(*keys.shape, *out_p))]


register(P.random_bits_p, P.random_split_p)(_random_flat_rule)


# --------------------------------------------------------------------------------------------
# sub-jaxprs


@register(P.jit_p, P.closed_call_p)
def _call_rule(ctx, eqn, invals):
  closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return interpret_closed(ctx, closed, invals)


@register(P.custom_jvp_call_p, P.custom_vjp_call_p)
def _custom_call_rule(ctx, eqn, invals):
  # Differentiation already happened when the jaxpr was traced: only the primal computation runs.
  return interpret_closed(ctx, eqn.params["call_jaxpr"], invals)


@register(P.remat_p)
def _remat_rule(ctx, eqn, invals):
  return interpret_closed(ctx, eqn.params["jaxpr"], invals)


def _join_fills(fill_lists):
  return [common_fill(fills) for fills in zip(*fill_lists, strict=False)]


@register(P.cond_p)
def _cond_rule(ctx, eqn, invals):
  branches = eqn.params["branches"]
  index, ops = invals[0], invals[1:]
  fill_lists = [None] * len(branches)

  def make(i, br):
    def f(*vals):
      outs = interpret_closed(
        ctx, br, [PaddedValue(v, pv.fill) for v, pv in zip(vals, ops, strict=False)]
      )
      fill_lists[i] = [o.fill for o in outs]
      return [
        jnp.asarray(o.val, v.aval.dtype) for o, v in zip(outs, br.jaxpr.outvars, strict=False)
      ]

    return f

  outs = lax.switch(index.val, [make(i, b) for i, b in enumerate(branches)], *[o.val for o in ops])
  fills = _join_fills(fill_lists) if all(f is not None for f in fill_lists) else [None] * len(outs)
  return [PaddedValue(o, f) for o, f in zip(outs, fills, strict=False)]


@register(P.while_p)
def _while_rule(ctx, eqn, invals):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cc, bc, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]

  def cond_fun(carry):
    (out,) = interpret_closed(ctx, p["cond_jaxpr"], [*cc, *(PaddedValue(c) for c in carry)])
    return out.val

  def body_fun(carry):
    outs = interpret_closed(ctx, p["body_jaxpr"], [*bc, *(PaddedValue(c) for c in carry)])
    return [jnp.asarray(o.val, c.dtype) for o, c in zip(outs, carry, strict=False)]

  outs = lax.while_loop(cond_fun, body_fun, [pv.val for pv in init])
  return [PaddedValue(o) for o in outs]


@register(P.scan_p)
def _scan_rule(ctx, eqn, invals):
  p = eqn.params
  nc, ncar = jp.scan_arity(p)
  consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
  closed = p["jaxpr"]
  length = p["length"]
  dyn_len = is_dynamic_dim(length)
  n = ctx.padded_dim(length)
  true_len = ctx.true_dim(length) if dyn_len else None
  if dyn_len:
    ctx.note(eqn, f"carry frozen past the true length {length}")

  def body(carry, x):
    if dyn_len:
      x, i = x
    outs = interpret_closed(
      ctx, closed, [*consts, *(PaddedValue(c) for c in carry), *(PaddedValue(v) for v in x)]
    )
    new = [jnp.asarray(o.val, c.dtype) for o, c in zip(outs[:ncar], carry, strict=False)]
    if dyn_len:
      new = [jnp.where(i < true_len, a, b) for a, b in zip(new, carry, strict=False)]
    ys = [
      jnp.asarray(o.val, v.aval.dtype)
      for o, v in zip(outs[ncar:], closed.jaxpr.outvars[ncar:], strict=False)
    ]
    return new, ys

  xs_vals = [pv.val for pv in xs]
  scan_xs = (xs_vals, _iota(n)) if dyn_len else xs_vals
  carry, ys = lax.scan(
    body, [pv.val for pv in init], scan_xs, length=n, reverse=p["reverse"], unroll=p["unroll"]
  )
  return [PaddedValue(c) for c in carry] + [PaddedValue(y) for y in ys]


# Why the notable primitives without a rule cannot be padded exactly (the fallback message says it).
WHY_NO_RULE.update(
  {
    "fft": "a DFT of length n has n-dependent twiddle factors, so no padding of the input gives "
    "the unpadded transform",
    "cholesky": "a factorisation over a dynamic matrix axis has no masking rule yet (padding "
    "with an identity block would keep it exact: not implemented)",
    "triangular_solve": "a solve over a dynamic matrix axis has no masking rule yet",
    "eigh": "eigen-decompositions mix every element and sort the spectrum: padding adds "
    "eigenvalues that change the order",
    "lu": "pivoting over a dynamic axis depends on the padded rows",
    "qr": "Householder reflections over a dynamic axis depend on the padded rows",
    "svd": "singular values of the padded matrix include the padding's",
    "custom_linear_solve": "its solver is opaque: no rule",
    "rng_bit_generator": "XLA's RngBitGenerator leaves the mapping from key and shape to bits "
    "to the backend, with no guarantee that a draw of the padded shape holds the unpadded draw "
    "anywhere (nor that the new key ignores the shape); use jax.random with the default "
    "threefry implementation, which the pass keeps bit-identical",
    "pure_callback": "a host callback sees the padded buffer, not the unpadded one",
    "io_callback": "a host callback sees the padded buffer, not the unpadded one",
  }
)


# --------------------------------------------------------------------------------------------
# fused rules (superinstructions)


# jax.nn.softmax over one axis, as jax 0.10 and 0.11 trace it (inlined, not a custom_jvp):
#   b = reduce_max[axes=(k,)] a; c = max(-inf, b); d = broadcast_in_dim c; [e = stop_gradient d]
#   f = sub a e; g = exp f; [g' = convert g to f32] h = reduce_sum[axes=(k,)] g(')
#   i = broadcast_in_dim h; [i' = convert i back to a's dtype] j = div g i(')
# (the bracketed converts: bf16/f16 inputs, whose sum jax accumulates in float32).  Each slot:
# (primitive name, optional).
_SOFTMAX = (("reduce_max", False), ("max", False), ("broadcast_in_dim", False),
            ("stop_gradient", True), ("sub", False), ("exp", False),
            ("convert_element_type", True), ("reduce_sum", False), ("broadcast_in_dim", False),
            ("convert_element_type", True), ("div", False))


def _softmax_chain(eqns, i: int):
  """``(end index, [equation or None per _SOFTMAX slot])`` when the primitive names from
  ``eqns[i]`` on follow the softmax's (optional slots may be missing), else None."""
  got, j = [], i
  for name, optional in _SOFTMAX:
    if j < len(eqns) and eqns[j].primitive.name == name:
      got.append(eqns[j])
      j += 1
    elif optional:
      got.append(None)
    else:
      return None
  return j, got


def fused_softmax(ctx, eqns, i: int, uses: dict, read):
  """``(index after the chain, output var, PaddedValue)`` when ``eqns[i:]`` is a softmax over
  one dynamic axis, else None.

  The per-equation rules mask the max's operand (-inf), the sum's operand (0) and then any
  contraction of the result over the axis (0): three selects over a ``[b, h, q, k]`` tensor
  per attention layer.  Here the input is masked once with -inf; the padded positions of the
  result are then exactly ``exp(-inf - max) = 0`` on every row whose max is finite; a row whose
  max is -inf, +inf or NaN is NaN in every valid position (as the unpadded softmax is), so the
  result carries ``axis_fill = 0`` and a later sum or contraction over the axis needs no mask.
  2-core CPU box, a BERT-style encoder at T=500 under ``padding="auto"``: 45-52 -> 24-27 ms a
  call (``padding="trust"``: 23-31 ms).  bf16 and f16 softmaxes (their sum runs in float32
  between two converts) fuse too: until session 4 they took the three selects, which on the
  H100 made BERT-base bf16 under ``"auto"`` ~0.3 ms slower than ``"trust"`` at T=37.
  """
  found = _softmax_chain(eqns, i)
  if found is None:
    return None
  end, (red, mx, b_max, sg, sub, ex, up, sm, b_sum, down, dv) = found
  chain = [e for e in found[1] if e is not None]
  a = red.invars[0]
  if isinstance(a, jex_core.Literal) or len(red.params["axes"]) != 1:
    return None
  (k,) = red.params["axes"]
  aval = a.aval
  if not is_dynamic_dim(aval.shape[k]) or not jnp.issubdtype(aval.dtype, jnp.floating):
    return None
  if (up is None) != (down is None):
    return None
  if up is not None and not (  # a wider float sum, converted back to the input's dtype
      jnp.issubdtype(up.params["new_dtype"], jnp.floating)
      and jnp.finfo(up.params["new_dtype"]).bits > jnp.finfo(aval.dtype).bits
      and down.params["new_dtype"] == aval.dtype):
    return None
  # The data flow must be exactly the softmax's, every intermediate used only inside it.
  m_b = b_max.outvars[0]
  m_used = sg.outvars[0] if sg is not None else m_b
  summed = up.outvars[0] if up is not None else ex.outvars[0]
  denom = down.outvars[0] if down is not None else b_sum.outvars[0]
  lit = [v for v in mx.invars if isinstance(v, jex_core.Literal)]
  ok = (
    len(lit) == 1 and float(np.asarray(lit[0].val)) == -np.inf
    and red.outvars[0] in mx.invars
    and b_max.invars[0] is mx.outvars[0]
    and (sg is None or sg.invars[0] is m_b)
    and sub.invars[0] is a and sub.invars[1] is m_used
    and ex.invars[0] is sub.outvars[0]
    and (up is None or up.invars[0] is ex.outvars[0])
    and sm.invars[0] is summed and tuple(sm.params["axes"]) == (k,)
    and b_sum.invars[0] is sm.outvars[0]
    and (down is None or down.invars[0] is b_sum.outvars[0])
    and dv.invars[0] is ex.outvars[0] and dv.invars[1] is denom
    and all(v.aval.shape[k] == 1 for v in (m_b, b_sum.outvars[0]))
    and all(tuple(b.params["broadcast_dimensions"]) == tuple(d for d in range(aval.ndim) if d != k)
            for b in (b_max, b_sum))
  )
  inner = [e.outvars[0] for e in chain[:-1]]
  if not ok or any(uses.get(v, 0) != (2 if v is ex.outvars[0] else 1) for v in inner):
    return None
  x = read(a)
  xm = ctx.mask(x, aval, [k], -np.inf, red, "softmax input")
  # initial=-inf: an axis empty at this bucket (a VALID conv's frames at a small bucket)
  # reduces to -inf, as the traced reduce_max does (jnp.max alone refuses an empty axis)
  m = jnp.max(xm, axis=k, keepdims=True, initial=-jnp.inf)
  if sg is not None:
    m = lax.stop_gradient(m)
  u = jnp.exp(xm - m)
  s = jnp.sum(u if up is None else u.astype(up.params["new_dtype"]), axis=k, keepdims=True)
  out = u / (s if down is None else s.astype(down.params["new_dtype"]))
  ctx.note(dv, f"softmax over axis {k}:{aval.shape[k]} fused: one -inf mask, padded "
           "probabilities are 0 (no mask needed on sums over the axis)")
  return end, dv.outvars[0], PaddedValue(out, axis_fill=((k, np.float32(0)),))


FUSED[P.reduce_max_p] = fused_softmax
