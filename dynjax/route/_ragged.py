"""``dynjax.route.ragged_dot``: ``jax.lax.ragged_dot`` on the grouped-GEMM kernels, a drop-in.

Public MoE code sorts its (token, choice) pairs by expert and runs the experts as
``lax.ragged_dot(rows, w, group_sizes)``: packed rows, group ``g`` the ``group_sizes[g]`` rows
after the groups before it.  :func:`ragged_dot` computes the same on :func:`dynjax.route.gmm`'s
kernels: the rows are gathered into tile-aligned groups (each group's base a multiple of the
row tile, the layout of ``mode="grouped"``), run through the kernel, and gathered back.

Under ``dynjax.jit(padding="auto")`` the family is traced with a symbolic row count, where no
kernel (static shapes) can be built: there :func:`ragged_dot` binds ``dynjax_ragged_dot``, a
primitive whose padding rule is ``ragged_dot_general``'s (the rows are a true prefix; nothing
is masked) and whose lowering, at each bucket's padded shape, is :func:`ragged_dot` again.  Its
tangent (``dynjax_ragged_dot_lin``, linear in the tangents) transposes to
``dynjax_ragged_dot_vjp``, which each bucket lowers to ``jax.vjp`` of the kernel path, so
``jax.grad`` inside the traced function runs its backward on the kernels too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from dynjax import _jax_private as jp
from dynjax._errors import RoutingError
from dynjax._symbolic import is_symbolic
from dynjax.bucketing._padding_core import (
  PaddedValue,
  identity_for,
  is_dynamic_dim,
  register,
  unsupported,
)
from dynjax.route._gmm import Tiling, buffer_rows, resolve_backend, row_alignment
from dynjax.route._grouped import _on_groups, grouped_layout
from dynjax.route._router import Routing

KERNELS = ("hopper", "mgpu", "pallas")  # the gmm backends ragged_dot runs on (else lax's)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, *,
               kernel: str = "auto", tiling: Tiling | None = None) -> jax.Array:
  """:func:`jax.lax.ragged_dot` on dynjax's grouped-GEMM kernels: a drop-in replacement.

  ``lhs [M, K]`` holds its rows in consecutive groups of ``group_sizes [G]`` (tokens sorted by
  expert, the idiom of public MoE code); ``out[rows of g] = lhs[rows of g] @ rhs[g]`` and rows
  past the last group are 0, as ``lax.ragged_dot`` computes.  On a Hopper GPU in bf16/f16 the
  rows are laid out in tile-aligned groups (one row gather), run through the ``"hopper"``
  kernel of :func:`gmm`, and gathered back; elsewhere (CPU, other dtypes or widths, a
  ``precision`` or ``preferred_element_type`` that the kernels do not take) it *is*
  ``lax.ragged_dot``.  With a symbolic row count (``dynjax.jit(padding="auto")``'s family
  trace) it binds a primitive that each bucket lowers to the kernel.  Differentiable, the
  backward on the kernels too; the numerics are the kernels' (float32 accumulation, outputs
  in ``lhs``'s dtype).  Under ``jax.vmap`` (also of a function jitted around it) the
  kernel runs once an element (``route._once``: a ``lax.map``), unbatched weights included,
  which ``lax.ragged_dot``'s own batching does not take.

  Args:
    lhs: ``[M, K]``.
    rhs: ``[G, K, N]``.
    group_sizes: integer ``[G]``; rows past ``M`` are cut (as ``lax.ragged_dot``).
    precision, preferred_element_type: as ``lax.ragged_dot``'s (set: ``lax.ragged_dot``).
    kernel: ``"auto"`` (:func:`dynjax.route._gmm.resolve_backend`), or a :func:`gmm` backend.
    tiling: the kernel's :class:`Tiling` (default: ``Tiling.auto`` for the rows and groups).

  Example:
    >>> order = jnp.argsort(experts); sizes = jnp.bincount(experts, length=8)
    >>> y = dynjax.route.ragged_dot(x[order], w_in, sizes)   # was jax.lax.ragged_dot
  """
  lhs, rhs, group_sizes = (jnp.asarray(a) for a in (lhs, rhs, group_sizes))
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != rhs.shape[:1] or (
      lhs.shape[1] != rhs.shape[1]):
    raise RoutingError(
        f"dynjax.route.ragged_dot: expected lhs [M, K], rhs [G, K, N] and group_sizes [G], "
        f"got lhs {tuple(lhs.shape)}, rhs {tuple(rhs.shape)}, group_sizes "
        f"{tuple(group_sizes.shape)}; for other dimension numbers use "
        "jax.lax.ragged_dot_general")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise RoutingError(f"dynjax.route.ragged_dot: group_sizes has dtype {group_sizes.dtype}, "
                       "expected an integer dtype (int32)")
  plain = functools.partial(jax.lax.ragged_dot, lhs, rhs, group_sizes, precision=precision,
                            preferred_element_type=preferred_element_type)
  m, k = lhs.shape
  g, _, n = rhs.shape
  if (precision is not None or preferred_element_type is not None or lhs.dtype != rhs.dtype
      or any(is_symbolic(d) for d in (k, n))):
    return plain()
  if is_symbolic(m):  # a family trace: the kernel is chosen at each bucket's shape
    backend = resolve_backend(kernel, lhs.dtype, None, g, widths=((k, n),), tiling=tiling)
    if backend not in KERNELS:
      return plain()
    return ragged_dot_p.bind(lhs, rhs, group_sizes.astype(jnp.int32), kernel=kernel,
                             tiling=tiling)
  return _on_kernel(lhs, rhs, group_sizes, kernel, tiling) if m and g else plain()


def _on_kernel(lhs, rhs, group_sizes, kernel: str, tiling: Tiling | None):
  """:func:`ragged_dot` at a static row count: the tile layout around the kernel, or
  ``lax.ragged_dot`` where no kernel runs.

  Measured (H100, jax 0.11.2, bf16, 8 groups of [1024, 4096], the gathers in and out
  included; ``benchmarks/probe_ragged_dot.py``): 0.171 / 0.235 / 0.646 ms at 1,024 / 4,096 /
  8,192 rows against ``lax.ragged_dot``'s 0.217 / 0.552 / 1.314."""
  m, k = lhs.shape
  g, _, n = rhs.shape
  if tiling is None:
    tiling = Tiling.auto(m, g, resolve_backend(kernel, lhs.dtype, m, g, widths=((k, n),)))
  backend = resolve_backend(kernel, lhs.dtype, m, g, widths=((k, n),), tiling=tiling)
  # The kernels take K and N in whole blocks (hopper: N in two compute warpgroups' columns).
  cols = tiling.tn * (2 if backend == "hopper" else 1)
  if backend not in KERNELS or k % tiling.tk or n % cols:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
  # Group sizes cut at M (rows past it do not exist: uncut, the kernel would walk tiles past
  # its buffer); each row is routed to its group (g: past every group, no slot, result 0) at
  # its rank there, and laid out as mode="grouped" lays out a routing.
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  sizes = ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  r = jnp.arange(m, dtype=jnp.int32)
  grp = jnp.searchsorted(ends, r, side="right", method="compare_all").astype(jnp.int32)
  safe = jnp.minimum(grp, g - 1)
  routing = Routing(paths=grp[:, None], gates=jnp.zeros((m, 1), jnp.float32),
                    positions=(r - (ends[safe] - sizes[safe]))[:, None], loads=sizes)
  lay = grouped_layout(routing, g, row_alignment(tiling, backend),
                       buffer_rows(m, g, tiling, backend))
  xs = jnp.take(lhs, lay.table, axis=0, mode="fill", fill_value=0)
  ys = _on_groups(xs, rhs, lay.group_sizes, m, tiling, backend, None)
  return jnp.take(ys, lay.slots[:, 0], axis=0, mode="fill", fill_value=0)


# -- a symbolic row count: one primitive, lowered at each bucket's shape -----------------------
ragged_dot_p = jex_core.Primitive("dynjax_ragged_dot")


def _impl(lhs, rhs, group_sizes, *, kernel, tiling):
  return _dot_at(lhs, rhs, group_sizes, kernel, tiling)


def _abstract(lhs, rhs, group_sizes, **_):
  return jp.shaped_array((lhs.shape[0], rhs.shape[2]), lhs.dtype)


def _jvp(primals, tangents, *, kernel, tiling):
  # The kernel's forward; the tangent a primitive linear in (dl, dr) whose transpose (the
  # backward) is the kernel path's own vjp at each bucket's rows (route.gmm's custom_vjp: at
  # a static row count it is free to run), lax.ragged_dot's at a symbolic one.
  lhs, rhs, sizes = primals
  dl, dr, _ = (ad.instantiate_zeros(t) for t in tangents)
  out = ragged_dot_p.bind(lhs, rhs, sizes, kernel=kernel, tiling=tiling)
  return out, ragged_dot_lin_p.bind(dl, dr, lhs, rhs, sizes, kernel=kernel, tiling=tiling)


def _dot_at(lhs, rhs, sizes, kernel, tiling):
  """The dot of ``lhs`` rows: the kernel path at a static row count, else (a symbolic
  lowering, as ``jax.export``'s: no kernel can be built) lax.ragged_dot."""
  if is_symbolic(lhs.shape[0]):
    return jax.lax.ragged_dot(lhs, rhs, sizes)
  return _on_kernel(lhs, rhs, sizes, kernel, tiling)


# The tangent: dl @ rhs + lhs @ dr by groups, linear in (dl, dr).
ragged_dot_lin_p = jex_core.Primitive("dynjax_ragged_dot_lin")


def _lin_impl(dl, dr, lhs, rhs, sizes, *, kernel, tiling):
  return (_dot_at(dl, rhs, sizes, kernel, tiling)
          + _dot_at(lhs, dr.astype(lhs.dtype), sizes, kernel, tiling)).astype(dl.dtype)


def _lin_transpose(ct, dl, dr, lhs, rhs, sizes, *, kernel, tiling):
  if ad.is_undefined_primal(lhs) or ad.is_undefined_primal(rhs):  # pragma: no cover
    raise NotImplementedError("dynjax_ragged_dot: the tangent is linear in (dl, dr) only")
  if type(ct) is ad.Zero:
    return [None, None, None, None, None]
  ct_l, ct_r = ragged_dot_vjp_p.bind(lhs, rhs, sizes, ct, kernel=kernel, tiling=tiling)
  return [ct_l if ad.is_undefined_primal(dl) else None,
          ct_r if ad.is_undefined_primal(dr) else None, None, None, None]


# The backward: (ct @ rhs^T by groups, lhs^T @ ct by groups), lowered at each bucket's rows.
ragged_dot_vjp_p = jex_core.Primitive("dynjax_ragged_dot_vjp")
ragged_dot_vjp_p.multiple_results = True


def _vjp_impl(lhs, rhs, sizes, ct, *, kernel, tiling):
  _, pull = jax.vjp(lambda a, b: _dot_at(a, b, sizes, kernel, tiling), lhs, rhs)
  return list(pull(ct.astype(lhs.dtype)))


def _vjp_abstract(lhs, rhs, sizes, ct, **_):
  return [jp.shaped_array(lhs.shape, lhs.dtype), jp.shaped_array(rhs.shape, rhs.dtype)]


def _vmap_all(fn, args, dims, n_out=1):
  """``fn`` under jax.vmap with every operand batched (unbatched ones broadcast)."""
  size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
  args = [jnp.broadcast_to(a, (size, *a.shape)) if d is None
          else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
  return jax.vmap(fn)(*args), (0 if n_out == 1 else [0] * n_out)


ragged_dot_lin_p.def_impl(_lin_impl)
ragged_dot_lin_p.def_abstract_eval(
    lambda dl, dr, lhs, rhs, sizes, **_: jp.shaped_array((dl.shape[0], rhs.shape[2]), dl.dtype))
ad.primitive_transposes[ragged_dot_lin_p] = _lin_transpose
mlir.register_lowering(ragged_dot_lin_p, mlir.lower_fun(_lin_impl, multiple_results=False))
batching.primitive_batchers[ragged_dot_lin_p] = lambda args, dims, **kw: _vmap_all(
    lambda dl, dr, lhs, rhs, s: jax.lax.ragged_dot(dl, rhs, s)
    + jax.lax.ragged_dot(lhs, dr.astype(lhs.dtype), s), args, dims)
ragged_dot_vjp_p.def_impl(_vjp_impl)
ragged_dot_vjp_p.def_abstract_eval(_vjp_abstract)
mlir.register_lowering(ragged_dot_vjp_p, mlir.lower_fun(_vjp_impl, multiple_results=True))
batching.primitive_batchers[ragged_dot_vjp_p] = lambda args, dims, **kw: _vmap_all(
    lambda lhs, rhs, s, ct: list(jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, s), lhs, rhs)[1](
        ct.astype(lhs.dtype))), args, dims, n_out=2)


def _batch(args, dims, *, kernel, tiling):
  # Under jax.vmap of a family trace: lax.ragged_dot's own batching (no kernel), every operand
  # batched (this jax's rule takes no other case).
  del kernel, tiling
  return _vmap_all(jax.lax.ragged_dot, args, dims)


ragged_dot_p.def_impl(_impl)
ragged_dot_p.def_abstract_eval(_abstract)
ad.primitive_jvps[ragged_dot_p] = _jvp
batching.primitive_batchers[ragged_dot_p] = _batch
mlir.register_lowering(ragged_dot_p, mlir.lower_fun(_impl, multiple_results=False))


def _only_rows_dynamic(eqn, rows, weights) -> None:
  """Refuses an equation of these primitives where a dim but the rows' (axis 0 of each of
  ``rows``) is dynamic: of those arrays' other axes, or of the ``weights``."""
  dims = [d for a in rows for d in a.shape[1:]] + list(weights.shape)
  if any(is_dynamic_dim(d) for d in dims):
    raise unsupported(eqn, "a dynamic contracting, output or group axis")


@register(ragged_dot_p)
def _padding_rule(ctx, eqn, invals):
  # The padding pass (dynjax.jit(padding="auto")): ragged rows are a true prefix (the group
  # sizes have no dynamic axis, so they are the true ones); nothing to mask.  Bound at the
  # bucket's padded shape, the primitive lowers to the kernel there.
  la, ra, _ = (v.aval for v in eqn.invars)
  _only_rows_dynamic(eqn, [la], ra)
  ctx.note(eqn, f"ragged rows along axis 0 ({la.shape[0]}): exact on the true prefix, "
           "nothing masked; the grouped-GEMM kernel at the bucket's rows")
  out = ragged_dot_p.bind(*(pv.val for pv in invals), **eqn.params)
  return [PaddedValue(out)]


@register(ragged_dot_lin_p)
def _lin_padding_rule(ctx, eqn, invals):
  # The tangent: rows of dl and lhs are true prefixes, as the primal's.
  la, ra = eqn.invars[2].aval, eqn.invars[3].aval
  _only_rows_dynamic(eqn, [la], ra)
  return [PaddedValue(ragged_dot_lin_p.bind(*(pv.val for pv in invals), **eqn.params))]


@register(ragged_dot_vjp_p)
def _vjp_padding_rule(ctx, eqn, invals):
  # The backward: ct_lhs by rows (a true prefix); ct_rhs contracts over the rows, so the padded
  # rows of lhs and ct are masked with 0 (they lie past every group, but need not be finite).
  la, ra, _, ca = (v.aval for v in eqn.invars)
  _only_rows_dynamic(eqn, [la, ca], ra)
  lhs = ctx.mask(invals[0], la, [0], identity_for("sum", la.dtype), eqn, "lhs")
  ct = ctx.mask(invals[3], ca, [0], identity_for("sum", ca.dtype), eqn, "cotangent")
  ctx.note(eqn, "the backward of the grouped-GEMM kernel at the bucket's rows")
  outs = ragged_dot_vjp_p.bind(lhs, invals[1].val, invals[2].val, ct, **eqn.params)
  return [PaddedValue(o) for o in outs]
