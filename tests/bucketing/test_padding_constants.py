"""Every padding rule with constant and literal operands (closed-over arrays, Python scalars,
0-d and size-1 axes, weak types): a rule must build its rewrite or refuse with
``PaddingUnsupportedError``, never crash with a Python error (a ``TypedNdArray``
literal fill made ``concatenate`` raise ``TypeError``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dynjax import _jax_private as jp
from dynjax import route
from dynjax.bucketing._padding_core import RULES
from tests.bucketing._harness import Case, family_case

UNSTACK = jp.private_primitives()["unstack"]  # jnp.roll under vmap emits it (jax >= 0.11)

C3 = np.array([0.5, -2.0, 3.0], np.float32)  # closed-over NumPy constant
J3 = jnp.array([1.5, 0.0, -1.0], jnp.float32)  # closed-over device constant


def _t3(t):
  return [(t, 3)]


def _roll_flip_row(x):
  # flax's flip_sequences idiom: reverse each padded row by its own length
  n = x.shape[0]
  return jnp.flip(jnp.roll(x, n - 2, axis=0), axis=0)


CASES = {
  # elementwise / broadcast with literals and constants, weak types
  "elementwise": (lambda x: jnp.where(x > 0, x * 2 + 1, -x) - C3 + J3 / 2, _t3),
  "weak_scalar": (lambda x: jnp.maximum(x, 0.0) ** 2 + jnp.float32(3) * 1, _t3),
  "broadcast": (lambda x: x + jnp.broadcast_to(C3, x.shape), _t3),
  "broadcast_literal": (lambda x: jnp.concatenate([x, jnp.full(x.shape, 2.0)], 1), _t3),
  "transpose": (lambda x: (x.T * C3[:, None]).T, _t3),
  "squeeze": (lambda x: jnp.squeeze(x[:, :1], 1) + 1.0, _t3),
  "iota": (lambda x: x + jnp.arange(x.shape[0], dtype=jnp.float32)[:, None], _t3),
  "dim_as_value": (lambda x: x * x.shape[0], _t3),
  # masking rules: a constant operand on the other side
  "reduce_sum": (lambda x: (x + C3).sum(0) + jnp.ones_like(x).sum(), _t3),
  "reduce_prod": (lambda x: jnp.prod(jnp.full(x.shape, 1.5), 0), _t3),
  "reduce_max": (lambda x: jnp.max(jnp.zeros_like(x), 0) + x.max(0), _t3),
  "reduce_min": (lambda x: jnp.min(x + 1.0, 0), _t3),
  "reduce_and": (lambda x: jnp.all(x > C3, 0), _t3),
  "reduce_or": (lambda x: jnp.any(jnp.ones(x.shape, bool), 0), _t3),
  "reduce_xor": (
    lambda x: lax.reduce_xor_p.bind(jnp.ones(x.shape, jnp.int32), axes=(0,)),
    _t3,
  ),
  "argmax": (lambda x: jnp.argmax(jnp.zeros_like(x) + C3, 0), _t3),
  "argmin": (lambda x: jnp.argmin(x * 0.0, 0), _t3),
  "dot_general": (lambda x: (jnp.ones_like(x) @ C3) + C3 @ x.T, _t3),
  "dynjax_ragged_dot": (  # route.ragged_dot at a symbolic row count (3 columns: lax's inside)
    lambda x: route.ragged_dot(x, jnp.stack([jnp.diag(C3), jnp.eye(3)]),
                               jnp.array([1, 1], jnp.int32), kernel="pallas"),
    _t3,
  ),
  "dynjax_ragged_dot_vjp": (  # its backward (the gradient in the rows and the weights)
    lambda x, w: jax.grad(lambda x, w: jnp.sum(jnp.sin(route.ragged_dot(
        x, w, jnp.array([1, 1], jnp.int32), kernel="pallas"))), (0, 1))(x, w),
    lambda t: [(t, 3), (2, 3, 3)],
  ),
  "dynjax_ragged_dot_lin": (  # its tangent (forward mode)
    lambda x: jax.jvp(lambda x: route.ragged_dot(x, jnp.stack([jnp.diag(C3), jnp.eye(3)]),
                                                 jnp.array([1, 1], jnp.int32), kernel="pallas"),
                      (x,), (jnp.cos(x),)),
    _t3,
  ),
  "dynjax_associative_scan": (  # lax.associative_scan over t: fn closes over constants
    lambda x: lax.associative_scan(lambda a, b: a * C3 + b + 1.0, x),
    _t3,
  ),
  "dynjax_associative_scan_lin": (  # its tangent (forward mode), reversed
    lambda x: jax.jvp(lambda x: lax.associative_scan(lambda a, b: a * J3 + b, x, reverse=True),
                      (x,), (jnp.ones_like(x),)),
    _t3,
  ),
  "dynjax_associative_scan_vjp": (  # its backward, a weak-typed literal and a constant leaf
    lambda x: jax.grad(lambda x: jnp.sum(lax.associative_scan(
        lambda a, b: (a[0] * b[0], a[1] * 0.5 + b[1]), (x, jnp.ones_like(x) * C3))[1] * x))(x),
    _t3,
  ),
  "dynjax_searchsorted": (  # constant queries into a column of x (t long), two methods
    lambda x: (jnp.searchsorted(jnp.sort(x[:, 0]), C3),
               jnp.searchsorted(x[:, 1], 0.5, side="right", method="compare_all")),
    _t3,
  ),
  "ragged_dot": (  # constant weights and group sizes; a ragged contraction of a full operand
    lambda x: (
      lax.ragged_dot(x, jnp.stack([jnp.diag(C3), jnp.eye(3)]), jnp.array([1, 1], jnp.int32)),
      lax.ragged_dot_general(
        jnp.ones_like(x), x, jnp.array([1, 2], jnp.int32),
        lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ()))),
    _t3,
  ),
  "cumsum": (lambda x: lax.cumsum(jnp.ones_like(x), 0, reverse=True) + x, _t3),
  "cumprod": (lambda x: lax.cumprod(jnp.full(x.shape, 2.0), 0, reverse=True), _t3),
  "cummax": (lambda x: lax.cummax(jnp.zeros_like(x), 0, reverse=True), _t3),
  "cummin": (lambda x: lax.cummin(x + C3, 0, reverse=True), _t3),
  "cumlogsumexp": (lambda x: lax.cumlogsumexp(jnp.zeros_like(x), 0, reverse=True), _t3),
  "tile": (
    lambda x: (
      jnp.tile(C3, (x.shape[0], 1)) + jnp.tile(jnp.ones((x.shape[0], 1)), (2, 3))[: x.shape[0]]
    ),
    _t3,
  ),
  "sort": (lambda x: jnp.sort(jnp.zeros_like(x) + C3, 0), _t3),
  "top_k": (lambda x: lax.top_k(jnp.zeros((3, x.shape[0])), 1)[0] + x[:1, 0], _t3),
  # ties: lax.top_k gives the lower index first on every backend (its documented contract)
  "top_k_ties": (lambda x: lax.top_k(jnp.zeros((3, x.shape[0])) + x[:1, 0] * 0, 1)[1], _t3),
  "conv": (
    lambda x: lax.conv_general_dilated(
      jnp.ones((1, 1, x.shape[0])), jnp.asarray(C3)[None, None], (1,), "SAME"
    ),
    _t3,
  ),
  "reduce_window_sum": (
    lambda x: lax.reduce_window(jnp.ones_like(x), 0.0, lax.add, (2, 1), (2, 1), "SAME"),
    _t3,
  ),
  "reduce_window_max": (
    lambda x: lax.reduce_window(jnp.zeros_like(x), -jnp.inf, lax.max, (3, 1), (1, 1), "SAME"),
    _t3,
  ),
  "reduce_window_min": (
    lambda x: lax.reduce_window(x * 0.0, jnp.inf, lax.min, (2, 3), (1, 1), "VALID"),
    _t3,
  ),
  "select_and_scatter_add": (
    lambda x: jax.grad(
      lambda y: lax.reduce_window(y + C3, -jnp.inf, lax.max, (2, 1), (2, 1), "SAME").sum()
    )(jnp.zeros_like(x)),
    _t3,
  ),
  "select_and_gather_add": (
    lambda x: jax.jvp(
      lambda y: lax.reduce_window(y, -jnp.inf, lax.max, (2, 1), (1, 1), "SAME"),
      (jnp.zeros_like(x),),
      (jnp.ones_like(x),),
    ),
    _t3,
  ),
  "reduce": (lambda x: lax.reduce(jnp.ones_like(x), 1.0, lambda a, b: a * b + 0.0, (0,)), _t3),
  "reduce_window": (
    lambda x: lax.reduce_window(
      x * 0.0 + C3, 0.0, lambda a, b: a + b * 1.0, (2, 1), (1, 1), "SAME"
    ),
    _t3,
  ),
  "approx_top_k": (lambda x: lax.approx_max_k(jnp.zeros_like(x).T + 1.0, 1), _t3),
  # relayout rules with constant operands
  "reshape": (lambda x: jnp.ones_like(x).reshape(-1) + 2.0, _t3),
  "concatenate_const": (lambda x: jnp.concatenate([jnp.zeros((1, 3)), x, C3[None]], 0), _t3),
  "concatenate_static_axis": (
    lambda x: jnp.concatenate([jnp.zeros((x.shape[0], 1)), x + 1.0, x], 1),
    _t3,
  ),
  "rev": (lambda x: jnp.flip(jnp.zeros_like(x) + C3, 0), _t3),
  "roll_flip": (_roll_flip_row, _t3),
  "vmapped_roll_flip": (
    lambda x: jax.vmap(lambda r, n: jnp.flip(jnp.roll(r, 3 - n, 0), 0), (1, 0), 1)(
      x.T.reshape(3, -1).T, jnp.array([1, 2, 3])
    ),
    _t3,
  ),
  "pad": (lambda x: jnp.pad(jnp.ones_like(x), ((1, 2), (0, 0)), constant_values=3.0), _t3),
  "slice": (lambda x: jnp.ones_like(x)[1:] + x[:-1], _t3),
  "lax_slice": (lambda x: lax.slice_in_dim(jnp.ones_like(x) * C3, 1, x.shape[0], 1, 0), _t3),
  "unstack": (
    lambda x: sum(UNSTACK.bind(x * C3, axis=1)),
    _t3,
  ),
  "split": (lambda x: jnp.split(jnp.concatenate([x, jnp.ones_like(x)], 0), 2, 0)[1], _t3),
  "stack": (lambda x: jnp.stack([x, jnp.zeros_like(x), jnp.full(x.shape, 2.0)], 1), _t3),
  "dynamic_slice": (lambda x: lax.dynamic_slice_in_dim(jnp.ones_like(x) + x, 1, 1, 0), _t3),
  "dynamic_update_slice": (
    lambda x: lax.dynamic_update_slice(jnp.zeros_like(x), C3[None], (jnp.int32(0), 0)),
    _t3,
  ),
  "gather": (lambda x: jnp.take(jnp.ones_like(x) * C3, jnp.array([0, 0]), axis=0), _t3),
  "gather_const_operand": (lambda x: jnp.take(J3, jnp.clip(x, 0, 2).astype(jnp.int32)), _t3),
  "scatter_add": (
    lambda x: jnp.zeros((4, 3)).at[jnp.clip(x[:, 0], 0, 3).astype(jnp.int32)].add(1.0),
    _t3,
  ),
  "scatter_add_const_updates": (
    lambda x: jnp.zeros_like(x).at[jnp.zeros(x.shape[0], jnp.int32)].add(C3),
    _t3,
  ),
  "scatter_mul": (lambda x: jnp.ones_like(x).at[0].multiply(2.0), _t3),
  "scatter_min": (lambda x: jnp.zeros_like(x).at[0].min(C3), _t3),
  "scatter_max": (lambda x: jnp.zeros_like(x).at[-1].max(1.0), _t3),
  "scatter": (lambda x: jnp.zeros_like(x).at[0].set(C3), _t3),
  "scatter_partial_window": (lambda x: jnp.ones_like(x).at[1:].set(2.0), _t3),
  "random_bits": (
    lambda x: x + jax.random.uniform(jax.random.key(0), x.shape),
    _t3,
  ),
  "random_split": (
    lambda x: jax.random.key_data(jax.random.split(jax.random.key(1), x.shape[0])),
    _t3,
  ),
  # sub-jaxprs with constants and literals inside
  "jit": (lambda x: jax.jit(lambda y: y * C3 + 1.0)(x), _t3),
  "custom_jvp": (lambda x: jax.nn.relu(x - 1.0) + jax.nn.softmax(jnp.zeros_like(x), 0), _t3),
  "custom_vjp": (
    lambda x: jax.grad(lambda y: jax.nn.logsumexp(y * C3, 0).sum())(x),
    _t3,
  ),
  "remat": (lambda x: jax.checkpoint(lambda y: jnp.sin(y) * 2.0 + C3)(x), _t3),
  "cond": (
    lambda x: lax.cond(jnp.sum(x) > 0, lambda y: y + C3, lambda y: y * 0.0, x),
    _t3,
  ),
  "while": (
    lambda x: lax.while_loop(
      lambda c: c[0] < jnp.sum(c[1] > 0), lambda c: (c[0] + 1, c[1] + C3), (0, x)
    ),
    _t3,
  ),
  "scan": (
    lambda x: lax.scan(lambda c, r: (c + r * C3 + 1.0, c), jnp.zeros(3), x),
    _t3,
  ),
  "size1_axes": (lambda x: (x[:, None, :1] + jnp.zeros((1, 1, 1))).sum((1, 2)), _t3),
  "zero_d": (lambda x: jnp.sum(x) * jnp.float32(2.0) + jnp.asarray(1.0), _t3),
}

# Rules the cases above do not reach, and why that is fine.
NOT_REACHED = {
  "sharding_constraint": "layout pass-through shared with transpose (reached)",
  "device_put": "layout pass-through shared with transpose (reached)",
  "closed_call": "the call rule shared with jit (reached)",
  "dynjax_attention": "only in jaxprs jit(attention=) rewrites; its operands are transposes of "
                      "traced values, never literals (tests/bucketing/test_attention.py)",
}


_BUILT: dict[str, Case] = {}


def _case(name: str) -> Case:
  if name not in _BUILT:
    fun, shapes = CASES[name]
    # lax.associative_scan over t and jnp.searchsorted into a t-long array bind dynjax's
    # primitives while a family traces
    _BUILT[name] = family_case(fun, shapes, dims=("t",), constraints=("t <= 8",))
  return _BUILT[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_with_constant_operands(name):
  if name == "approx_top_k" and jax.default_backend() != "cpu":
    pytest.skip("approx_top_k pads on the CPU only (test_padding.py: off it, it says why)")
  case = _case(name)
  for true in (1, 6):  # size 1 and a padded middle (bucket edges: test_padding.py)
    case.check((true,), (8,), seed=true)


def _primitives(jaxpr, out):
  for eqn in jaxpr.eqns:
    out.add(eqn.primitive)
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          _primitives(inner, out)
        elif hasattr(sub, "eqns"):
          _primitives(sub, out)
  return out


def test_every_rule_is_reached():
  seen = set()
  for name in CASES:
    _primitives(_case(name).closed.jaxpr, seen)
  rules = {}
  for prim, rule in RULES.items():
    rules.setdefault(rule, set()).add(prim.name)
  reached = {rule for rule in rules if any(p in seen for p in RULES if RULES[p] is rule)}
  missing = sorted(
    ",".join(sorted(names))
    for rule, names in rules.items()
    if rule not in reached and not names <= set(NOT_REACHED)
  )
  assert not missing, f"rules without a constant/literal case: {missing}"
