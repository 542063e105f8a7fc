"""Per-rule tests of the padding pass: padded execution equals exact execution."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _harness import Case
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export, lax

import dynjax
from dynjax import _jax_private as jp
from dynjax._errors import PaddingUnsupportedError
from dynjax.bucketing._padding import pad_jaxpr, rule_coverage

BT = lambda b, t: [(b, t)]
BTC = lambda b, t: [(b, t, 3)]
POS = jnp.arange(16 * 3, dtype=jnp.float32).reshape(16, 3) / 10.0
TABLE = jnp.arange(10 * 3, dtype=jnp.float32).reshape(10, 3)


def _conv(x, w, stride=1, padding="SAME", dil=1):
  return lax.conv_general_dilated(
    x, w, (stride,), padding, rhs_dilation=(dil,), dimension_numbers=("NWC", "WIO", "NWC")
  )


def _argmax_pair(reduce, x, *args):
  """A variadic (value, index) reduction: a generic reduce / reduce_window."""
  i = lax.broadcasted_iota(jnp.int32, x.shape, 1)

  def pick(a, b):
    return jnp.maximum(a[0], b[0]), jnp.where(a[0] >= b[0], a[1], b[1])

  return reduce((x, i), (-jnp.inf, 0), pick, *args)


def _max_pool(x, window, stride):
  return lax.reduce_window(
    x, -jnp.inf, lax.max, (1, window, 1), (1, stride, 1), "SAME"
  )  # what flax.linen.max_pool builds


@jax.custom_vjp
def _clip_grad(x):
  return jnp.sin(x)


_clip_grad.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))


def _scan_tanh_loss(y):
  step = lambda c, yt: (jnp.tanh(c * y[:, 0] + yt), c)
  return lax.scan(step, jnp.zeros(y.shape[0]), y.T)[1].sum()


# A MoE layer as public JAX code writes it (MaxText / Mixtral ports): top-2 of a router, the
# (token, choice) pairs sorted by expert, the experts' FFN as two ``lax.ragged_dot`` over the
# sorted rows with ``bincount`` group sizes, unsorted, gate-weighted sum.
_MOE = np.random.default_rng(5)
_MOE_GATE = jnp.asarray(_MOE.normal(size=(3, 4)), jnp.float32)
_MOE_W1 = jnp.asarray(_MOE.normal(size=(4, 3, 5)) / 2, jnp.float32)
_MOE_W2 = jnp.asarray(_MOE.normal(size=(4, 5, 3)) / 2, jnp.float32)


def _moe_sorted(x, w1=_MOE_W1, w2=_MOE_W2):
  b, t, d = x.shape
  h = x.reshape(-1, d)
  gates, experts = lax.top_k(h @ _MOE_GATE, 2)
  gates = jax.nn.softmax(gates, axis=-1)
  flat = experts.reshape(-1)
  order = jnp.argsort(flat)
  rows = jnp.repeat(h, 2, axis=0)[order]
  sizes = jnp.bincount(flat, length=w1.shape[0])
  y = lax.ragged_dot(jax.nn.silu(lax.ragged_dot(rows, w1, sizes)), w2, sizes)
  y = y[jnp.argsort(order)].reshape(-1, 2, d)
  return jnp.einsum("nkd,nk->nd", y, gates).reshape(b, t, d)


def _moe_sorted_grads(x, w1, w2):
  """A training step's gradients: the weights' through a ragged contraction over the rows."""
  loss = lambda x, w1, w2: jnp.sum(jnp.tanh(_moe_sorted(x, w1, w2)))
  return jax.grad(loss, (0, 1, 2))(x, w1, w2)


def _ints(lo, hi):
  def make(rng, shapes):
    return [rng.integers(lo, hi, size=s).astype(np.int32) for s in shapes]

  return make


# (id, fun, shapes, Case kwargs)
CASES = [
  ("elementwise", lambda x: jnp.tanh(x) * 2 + jnp.exp(-jnp.abs(x)) - x**2, BT, {}),
  ("reduce_sum", lambda x: (x.sum(1), x.sum(0), x.sum()), BT, {}),
  ("reduce_max_min", lambda x: (x.max(1), x.min(0), x.max()), BT, {}),
  ("reduce_prod", lambda x: jnp.prod(1 + 0.1 * x, axis=1), BT, {}),
  ("argmax_argmin", lambda x: (jnp.argmax(x, 1), jnp.argmin(x, 1), jnp.argmax(x, 0)), BT, {}),
  ("any_all", lambda x: ((x > 0).any(1), (x > 0).all(1), (x > 0).any()), BT, {}),
  ("mean_var", lambda x: (jnp.mean(x, 1), jnp.var(x, 1), jnp.mean(x)), BT, {}),
  ("logsumexp", lambda x: jax.nn.logsumexp(x, axis=1), BT, {}),
  ("dot_contract_t", lambda x, w: x @ w, lambda b, t: [(b, t), (t, 3)], {}),
  ("dot_contract_b", lambda x: jnp.einsum("bt,bs->ts", x, x), BT, {}),
  ("dot_batch_free", lambda x: jnp.einsum("btc,bsc->bts", x, x), BTC, {}),
  ("moe_ragged_dot", _moe_sorted, BTC, {}),
  (  # rows past every group give 0; the ragged contraction (dW) masks the padded rows
    "moe_ragged_dot_grads",
    _moe_sorted_grads,
    lambda b, t: [(b, t, 3), (4, 3, 5), (4, 5, 3)],
    {"rtol": 2e-5, "atol": 2e-5},
  ),
  ("cumsum", lambda x: (jnp.cumsum(x, 1), lax.cumsum(x, 1, reverse=True)), BT, {}),
  (  # each operand as it is; what it holds in its padding (0 from exp - 1 of a 0 fill) kept
    "optimization_barrier",
    lambda x: jnp.sum(lax.optimization_barrier((jnp.expm1(x), x * 2))[0], 1),
    BT,
    {},
  ),
  ("cumprod", lambda x: lax.cumprod(1 + 0.1 * x, 1, reverse=True), BT, {}),
  (
    "cummax_cummin",
    lambda x: (lax.cummax(x, 1, reverse=True), lax.cummin(x, 0, reverse=True)),
    BT,
    {},
  ),
  ("cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1, reverse=True), BT, {}),
  ("sort", lambda x: (jnp.sort(x, 1), jnp.argsort(x, 1), jnp.sort(x, 0)), BT, {}),
  ("top_k", lambda x: lax.top_k(x, 1), BT, {}),
  ("conv_same", lambda x, w: _conv(x, w), lambda b, t: [(b, t, 3), (3, 3, 2)], {}),
  (
    "conv_valid_stride",
    lambda x, w: _conv(x, w, 2, "VALID"),
    lambda b, t: [(b, t + 2, 3), (3, 3, 2)],
    {},
  ),
  (
    "conv_dilated",
    lambda x, w: _conv(x, w, 1, ((2, 2),), 2),
    lambda b, t: [(b, t, 3), (3, 3, 2)],
    {},
  ),
  (
    "reduce_window",
    lambda x: (
      lax.reduce_window(x, -jnp.inf, lax.max, (1, 3), (1, 1), "SAME"),
      lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 1), "SAME"),
    ),
    BT,
    {},
  ),
  ("dim_as_value", lambda x: x * x.shape[1] + x.shape[0] * x.shape[1], BT, {}),
  ("iota", lambda x: x + jnp.arange(x.shape[1]) + jnp.arange(x.shape[0])[:, None], BT, {}),
  # jnp.tile: copies along a static axis bind as is (beam search); along a dynamic axis, or a
  # symbolic rep count, the true extent is copied back to back
  (
    "tile_static_beam",
    lambda x: jnp.tile(x[:, None], (1, 3, 1, 1)).reshape(-1, *x.shape[1:]),
    BTC,
    {},
  ),
  ("tile_static_axis_sum", lambda x: jnp.tile(x, (1, 1, 2)).sum(1), BTC, {}),
  ("tile_dynamic_axes", lambda x: jnp.tile(x, (2, 3)) * jnp.tile(x, (2, 3)).sum(0), BT, {}),
  ("tile_symbolic_reps", lambda x: jnp.tile(x, (1, x.shape[0])).max(1), BT, {}),
  ("reshape_merge_split", lambda x: (x.reshape(-1, 3) * 2).reshape(x.shape), BTC, {}),
  ("reshape_merge_sum", lambda x: x.reshape(-1).cumsum(), BT, {}),
  ("reshape_plain", lambda x: x.reshape(x.shape[0], x.shape[1] * 3).sum(1), BTC, {}),
  ("input_b_times_t", lambda x: x.reshape(-1, 2, 3).sum(0), lambda b, t: [(2 * t, 3)], {}),
  ("input_t_plus_1", lambda x: (x[1:] - x[:-1], x.sum()), lambda b, t: [(t + 1,)], {}),
  ("concat_t", lambda x, y: jnp.concatenate([x, 2 * y], 1), lambda b, t: [(b, t), (b, t)], {}),
  ("concat_b", lambda x: jnp.concatenate([x, x[:1]], 0).sum(0), BT, {}),
  ("flip", lambda x: (jnp.flip(x, 1), jnp.flip(x, (0, 1)), x[:, ::-1].cumsum(1)), BT, {}),
  ("roll", lambda x: (jnp.roll(x, 1, axis=1), jnp.roll(x, -2, axis=0)), BT, {}),
  (
    "pad",
    lambda x: (jnp.pad(x, ((0, 0), (1, 2)), constant_values=5.0), jnp.pad(x, ((1, 0), (0, 0)))),
    BT,
    {},
  ),
  ("pad_interior", lambda x: lax.pad(x, -1.0, ((0, 0, 0), (1, 1, 2))), BT, {}),
  ("slices", lambda x: (x[:, 1:], x[:, ::2], x[:, -1], x[-1]), BT, {}),
  ("pos_emb", lambda x: x + POS[: x.shape[1]], BTC, {"constraints": ("t <= 16",)}),
  (
    "pos_emb_offset",
    lambda x: x + lax.dynamic_slice_in_dim(POS, 4, x.shape[1], 0),
    BTC,
    {"constraints": ("t <= 16",)},
  ),
  ("dynamic_slice", lambda x: lax.dynamic_slice_in_dim(x, x.shape[1] // 2, 1, 1), BT, {}),
  (
    "dynamic_slice_start_input",
    lambda x, i: lax.dynamic_slice_in_dim(x, i, 1, 1),
    lambda b, t: [(b, t), ()],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        np.int32(rng.integers(0, 12)),
      ],
    },
  ),
  (
    "dus_static_update",
    lambda x: lax.dynamic_update_slice_in_dim(x, jnp.ones((x.shape[0], 1)), x.shape[1] - 1, 1),
    BT,
    {},
  ),
  (
    "dus_dynamic_update",
    lambda x: lax.dynamic_update_slice_in_dim(jnp.zeros((x.shape[0], 12)), x, 3, 1).sum(1),
    BT,
    {"constraints": ("t <= 8",)},
  ),
  ("embedding", lambda tok: TABLE[tok].sum(1), BT, {"dtypes": [jnp.int32], "inputs": _ints(0, 10)}),
  ("take_along_axis", lambda x: jnp.take_along_axis(x, jnp.argsort(x, 1), 1), BT, {}),
  (
    "take_fill",
    lambda x, i: jnp.take(x, i, axis=1, mode="fill", fill_value=-7.0),
    lambda b, t: [(b, t), (4,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(-2, 12, size=s[1]).astype(np.int32),
      ],
    },
  ),
  (
    "take_clip",
    lambda x, i: jnp.take(x, i, axis=1, mode="clip"),
    lambda b, t: [(b, t), (4,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(-2, 12, size=s[1]).astype(np.int32),
      ],
    },
  ),
  ("scatter_set", lambda x: x.at[:, 0].set(3.0).at[:, -1].set(-3.0), BT, {}),
  (
    "scatter_add_hist",
    lambda tok: jnp.zeros(10).at[tok].add(1.0),
    BT,
    {"dtypes": [jnp.int32], "inputs": _ints(0, 10)},
  ),
  (
    "scatter_max_set",
    lambda tok: (
      jnp.zeros(10).at[tok.reshape(-1)].max(tok.reshape(-1) * 1.0),
      jnp.full(10, -1).at[tok[:, 0]].set(tok[:, -1]),
    ),
    BT,
    {"dtypes": [jnp.int32], "inputs": _ints(0, 10)},
  ),
  (
    "conv_same_stride2",
    lambda x, w: _conv(x, w, 2, "SAME"),
    lambda b, t: [(b, t, 3), (3, 3, 2)],
    {},
  ),
  (
    "pool_same_stride2",
    lambda x: (
      lax.reduce_window(x, -jnp.inf, lax.max, (1, 3), (1, 2), "SAME"),
      lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 3), "SAME"),
    ),
    BT,
    {},
  ),
  (
    "scatter_drop",
    lambda x, i: x.at[:, i].set(5.0, mode="drop"),
    lambda b, t: [(b, t), (3,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(-2, 12, size=s[1]).astype(np.int32),
      ],
    },
  ),
  (
    "vmapped_gather",
    lambda x, i: jax.vmap(lambda r, j: r[j])(x, i),
    lambda b, t: [(b, t), (b,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(0, 12, size=s[1]).astype(np.int32),
      ],
    },
  ),
  (
    "scatter_window_add",
    lambda x, i: jnp.zeros((6, x.shape[1])).at[i].add(x),
    lambda b, t: [(b, t), (b,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(0, 6, size=s[1]).astype(np.int32),
      ],
    },
  ),
  (
    "segment_sum",
    lambda x, s: jax.ops.segment_sum(x, s, num_segments=5),
    lambda b, t: [(t,), (t,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(0, 5, size=s[1]).astype(np.int32),
      ],
    },
  ),
  # Out-of-range ids of reducing scatters are dropped, on static operand axes too (jraph
  # points padded edges at num_nodes; bincount(length=) and nonzero(size=) drop the rest):
  # the rule once clamped them into the last slot.
  (
    "segment_sum_oob",
    lambda x, s: (jax.ops.segment_sum(x, s, num_segments=5),
                  jax.ops.segment_max(x, s, num_segments=5)),
    lambda b, t: [(t,), (t,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(-2, 8, size=s[1]).astype(np.int32),
      ],
    },
  ),
  (
    "scatter_reduce_oob",
    lambda x, s: (jnp.zeros(5).at[s].add(x), jnp.ones(5).at[s].multiply(x, mode="drop"),
                  jnp.zeros(5).at[s].max(x, mode="drop"), jnp.bincount(s, length=5),
                  jnp.nonzero(x > 0, size=3, fill_value=-1)[0],
                  jnp.histogram(x, bins=4, range=(-1.0, 1.0))[0]),
    lambda b, t: [(t,), (t,)],
    {
      "dtypes": [jnp.float32, jnp.int32],
      "inputs": lambda rng, s: [
        rng.normal(size=s[0]).astype(np.float32),
        rng.integers(-2, 8, size=s[1]).astype(np.int32),
      ],
    },
  ),
  (  # jnp.stack is a primitive of its own since jax 0.10 (it had no rule: ran exact)
    "stack",
    lambda x: (jnp.stack([x, 2 * x], axis=1), jnp.stack([x, jnp.exp(x)]).max(0),
               jnp.stack([x.sum(1), x.max(1)], -1)),
    BT,
    {},
  ),
  ("split", lambda x: jnp.split(x, 2, axis=1)[1] * 2, lambda b, t: [(b, 2 * t)], {}),
  ("jit_inner", lambda x: jax.jit(lambda y: y.sum(1))(x) + jax.jit(jnp.flip)(x).mean(), BT, {}),
  ("custom_jvp", lambda x: jax.nn.relu(x).sum(1) + jax.nn.gelu(x).max(1), BT, {}),
  ("custom_vjp", lambda x: _clip_grad(x).sum(1), BT, {}),
  ("checkpoint", lambda x: jax.checkpoint(lambda y: jnp.sin(y).sum(1))(x), BT, {}),
  ("cond", lambda x: lax.cond(x.sum() > 0, lambda y: y.max(1), lambda y: y.min(1), x), BT, {}),
  (
    "fori_loop_t",
    lambda x: lax.fori_loop(0, x.shape[1], lambda i, c: c * 0.5 + x[:, i], jnp.zeros(x.shape[0])),
    BT,
    {},
  ),
  (  # a compound dim (2*t) whose true size the pass first needs in a loop body's trace, then
     # after the loop: a value cached in the inner trace must not reach the outer jaxpr
    "loop_then_outer_dim",
    lambda x: (lax.fori_loop(0, 2, lambda i, c: c + jnp.concatenate([x, x], 1).sum(1),
                             jnp.zeros(x.shape[0])) + jnp.concatenate([x, -x], 1).max(1)),
    BT,
    {},
  ),
  (  # the same in a cond inside a scan over t, in jax.checkpoint and in vmap inside a loop
    "cond_in_scan_then_outer_dim",
    lambda x: lax.scan(lambda c, xt: (lax.cond(xt.sum() > 0,
                                               lambda: c + jnp.concatenate([x, -x], 1).sum(1),
                                               lambda: c - x.max(1)), None),
                       jnp.zeros(x.shape[0]), x.T)[0] + jnp.concatenate([x, -x], 1).max(1),
    BT,
    {},
  ),
  (
    "checkpoint_vmap_in_loop_then_outer_dim",
    lambda x: lax.fori_loop(
      0, 2, lambda i, c: c + jax.checkpoint(lambda y: jnp.concatenate([y, y], 1).sum(1))(x)
      + jax.vmap(lambda r: jnp.concatenate([r, r]).max())(x), jnp.zeros(x.shape[0]))
    + jnp.concatenate([x, x], 1).min(1) + jax.vmap(lambda r: jnp.concatenate([r, r]).sum())(x),
    BT,
    {},
  ),
  (
    "cond_then_outer_dim",
    lambda x: (lax.cond(x.sum() > 0, lambda y: jnp.concatenate([y, y], 1).sum(1),
                        lambda y: y.min(1), x) + jnp.concatenate([x, -x], 1).max(1)),
    BT,
    {},
  ),
  (
    "while_reduction",
    lambda x: lax.while_loop(
      lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + c[1].sum(1, keepdims=True) * 0.1), (0, x)
    )[1],
    BT,
    {},
  ),
  (
    "scan_t",
    lambda x: lax.scan(lambda c, xt: (c * 0.9 + xt, c.sum()), jnp.zeros(x.shape[0]), x.T),
    BT,
    {},
  ),
  (
    "scan_t_reverse",
    lambda x: lax.scan(lambda c, xt: (c * 0.9 + xt, c), jnp.zeros(x.shape[0]), x.T, reverse=True),
    BT,
    {},
  ),
  (
    "scan_static_len",
    lambda x: lax.scan(lambda c, _: (c + c.sum() * 0.1, None), x, None, length=3)[0],
    BT,
    {},
  ),
  # primitives and params that changed across jax versions (0.11: scan's ft_in/ft_out params,
  # one_minus_square under tanh's derivative, log2, merged ClosedJaxpr/Jaxpr)
  ("tanh_value_and_grad", lambda x: jax.value_and_grad(lambda y: jnp.tanh(y).sum())(x), BT, {}),
  ("log2", lambda x: jnp.log2(jnp.abs(x) + 1).sum(1), BT, {}),
  (
    "scan_grad_closure",
    lambda x: jax.grad(_scan_tanh_loss)(x),
    BT,
    {},
  ),
  (
    "scan_forwarded",
    lambda x: lax.scan(
      lambda c, xt: ((c[0], c[1] + xt * c[0]), xt), (x[:, 0] + 1, jnp.zeros(x.shape[0])), x.T
    ),
    BT,
    {},
  ),
  (
    "checkpoint_grad_closure",
    lambda x: jax.grad(lambda z: jax.checkpoint(lambda y: (jnp.sin(y) * x[:1]).sum())(z))(x),
    BT,
    {},
  ),
  (
    "max_pool_grad_same_stride2",
    lambda x: jax.grad(lambda y: (_max_pool(y, 2, 2) ** 2).sum())(x),
    BTC,
    {},
  ),
  (
    "max_pool_grad_window3_shifted",
    lambda x: jax.grad(lambda y: (_max_pool(y, 3, 2) * jnp.arange(3.0)).sum())(x),
    BTC,
    {},
  ),
  (
    "min_pool_grad_stride1",
    lambda x: jax.grad(
      lambda y: jnp.sin(lax.reduce_window(y, jnp.inf, lax.min, (1, 3, 1), (1, 1, 1), "SAME")).sum()
    )(x),
    BTC,
    {},
  ),
  (
    "max_pool_jvp",
    lambda x: jax.jvp(lambda y: _max_pool(y, 3, 2), (x,), (jnp.cos(x),)),
    BTC,
    {},
  ),
  ("generic_reduce_argmax_pair", lambda x: _argmax_pair(lax.reduce, x, (1,)), BT, {}),
  ("generic_reduce_prod", lambda x: lax.reduce(x, 1.0, lambda a, b: a * b * 1.0, (0, 1)), BT, {}),
  (
    "generic_reduce_window_pair",
    lambda x: _argmax_pair(lax.reduce_window, x, (1, 3), (1, 2), "SAME"),
    BT,
    {},
  ),
  (
    "generic_reduce_window_prod",
    lambda x: lax.reduce_window(x, 1.0, lambda a, b: a * b + 0.0, (2, 2), (1, 1), "SAME"),
    BT,
    {},
  ),
  ("approx_max_k", lambda x: lax.approx_max_k(x, 1), BT, {}),
  ("approx_min_k", lambda x: lax.approx_min_k(x * 2.0, 1), BT, {}),
  ("scatter_set_partial_window", lambda x: jnp.zeros_like(x).at[:, 1:].set(x[:, :-1]), BT, {}),
  (
    "scatter_set_partial_window_clip",
    lambda x: jnp.full_like(x, 7.0).at[:, :-1].set(x[:, 1:] * 2, mode="clip"),
    BT,
    {},
  ),
  (
    "scatter_set_window_into_wider",
    lambda x: jnp.zeros((x.shape[0], x.shape[1] + 2)).at[:, 2:].set(x),
    BT,
    {},
  ),
  ("random_normal", lambda x: x + jax.random.normal(jax.random.key(1), x.shape), BT, {}),
  (
    "random_split",
    lambda x: jax.vmap(lambda k, r: jax.random.uniform(k) + r)(
      jax.random.split(jax.random.key(2), x.shape[1]), x[0]
    ),
    BT,
    {},
  ),
]

BUCKETS = [(3, 8), (2, 5)]


def _case(idx) -> Case:
  name, fun, shapes, kw = CASES[idx]
  return _case_cached(idx)


@functools.cache
def _case_cached(idx) -> Case:
  _, fun, shapes, kw = CASES[idx]
  return Case(fun, shapes, **kw)


# Rules that pad on the CPU only (elsewhere they refuse, tested on the CPU by
# test_approx_top_k_off_the_cpu_says_why).
CPU_ONLY = {"approx_max_k", "approx_min_k"}


def _skip_off_cpu(idx):
  if CASES[idx][0] in CPU_ONLY and jax.default_backend() != "cpu":
    pytest.skip(f"{CASES[idx][0]} pads on the CPU only")


@pytest.mark.parametrize("idx", range(len(CASES)), ids=[c[0] for c in CASES])
def test_rule_edges(idx):
  """True sizes 1 and exactly the bucket size, garbage and zeros in the padded region."""
  _skip_off_cpu(idx)
  case = _case(idx)
  bucket = BUCKETS[0]
  case.check((1, 1), bucket, garbage="mixed")
  case.check(bucket, bucket, garbage="nan", seed=1)
  case.check((2, 3), bucket, garbage="zeros", seed=2)


@pytest.mark.parametrize("idx", range(len(CASES)), ids=[c[0] for c in CASES])
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_rule_random_sizes(idx, data):
  _skip_off_cpu(idx)
  case = _case(idx)
  bucket = data.draw(st.sampled_from(BUCKETS))
  true = tuple(data.draw(st.integers(1, n)) for n in bucket)
  case.check(true, bucket, seed=data.draw(st.integers(0, 100)))


def test_random_bits_are_bit_identical_and_normal():
  fun = lambda x: jax.random.normal(jax.random.key(7), x.shape)
  case = Case(fun, BT)
  # bit-identical: exact equality, not only closeness
  case.rtol = case.atol = 0.0
  ref = case.check((5, 37), (8, 64))
  # and statistically normal
  vals = np.asarray(ref[0]).ravel()
  assert abs(vals.mean()) < 0.3 and abs(vals.std() - 1) < 0.3


def _per_example_dropout(key, x):
  # Equinox's idiom: the model vmapped over the batch, one key an example.
  def one(k, xi):
    return jnp.where(jax.random.bernoulli(k, 0.7, xi.shape), xi / 0.7, 0.0)

  return jax.vmap(one)(jax.random.split(key, x.shape[0]), x)


def test_random_bits_from_a_batch_of_keys_are_bit_identical(compiles):
  # Each key's flat draw, placed at true row-major positions: the keys' own axis padded too
  # (split(key, b) over a dynamic b). It fell back before (the Equinox/Haiku probe).
  f = dynjax.jit(_per_example_dropout, dims={"x": "b, t, 4"}, on_fallback="error",
                 buckets={"b": dynjax.buckets.pow2(1, 8), "t": dynjax.buckets.pow2(4, 64)})
  key = jax.random.key(0)
  n = compiles()
  for b, t in ((2, 5), (3, 9), (1, 3), (4, 16)):
    x = np.random.default_rng(t).normal(size=(b, t, 4)).astype(np.float32)
    want = np.asarray(jax.jit(_per_example_dropout)(key, x))
    np.testing.assert_array_equal(np.asarray(f(key, x)), want)
    assert 0.5 < (want != 0).mean() < 0.9
  assert compiles() - n == 4 + 3  # the references' four, dynjax's three buckets

  def normal_per_key(key, x):  # a fixed batch of keys, the draw's own shape dynamic
    return jax.vmap(lambda k: jax.random.normal(k, x.shape))(jax.random.split(key, 3)) + x

  g = dynjax.jit(normal_per_key, dims={"x": "t, 4"}, on_fallback="error")
  for t in (3, 7, 12):
    x = np.ones((t, 4), np.float32)
    for k in (jax.random.key(1), jax.random.PRNGKey(1)):  # typed and raw uint32 keys
      np.testing.assert_array_equal(np.asarray(g(k, x)), np.asarray(jax.jit(normal_per_key)(k, x)))


def test_dim_expr_evaluation_traced():
  b, t = export.symbolic_shape("b, t")
  exprs = [b * t, t + 1, 2 * t, (t * 3) // 2, t % 5, jnp.maximum if False else None]
  exprs = [e for e in exprs if e is not None]
  mx = export.symbolic_shape("max(t, 3), min(t, 2)", scope=t.scope)
  exprs += list(mx)

  def ev(bv, tv):
    env = {"b": bv, "t": tv}
    return [jp.eval_dim_expr(e, env) for e in exprs]

  for bv, tv in [(1, 1), (2, 7), (3, 2)]:
    got = jax.jit(ev)(jnp.int32(bv), jnp.int32(tv))
    want = [bv * tv, tv + 1, 2 * tv, (3 * tv) // 2, tv % 5, max(tv, 3), min(tv, 2)]
    assert [int(g) for g in got] == want
    assert ev(bv, tv) == want


def test_unsupported_primitive_names_primitive_and_line():
  (t,) = export.symbolic_shape("t")
  fun = lambda x: jnp.fft.fft(x).real  # LINE_FFT
  cj = jax.make_jaxpr(fun)(jax.ShapeDtypeStruct((t,), jnp.float32))
  with pytest.raises(PaddingUnsupportedError) as e:
    pad_jaxpr(cj, ("t",), {"t": 8})
  line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if "# LINE_FFT" in s)
  assert "no exact rule for 'fft' at " in str(e.value)
  assert f"test_padding.py:{line}" in str(e.value)
  assert isinstance(e.value, NotImplementedError)


def test_ragged_dot_over_a_dynamic_ragged_batch_axis_says_why():
  (t,) = export.symbolic_shape("t")
  dn = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((2,), (1,)), ((0,), (0,))),
                                     lhs_ragged_dimensions=(0,), rhs_group_dimensions=())
  fun = lambda x, w: lax.ragged_dot_general(x, w, jnp.array([1, 1], jnp.int32), dn)
  cj = jax.make_jaxpr(fun)(jax.ShapeDtypeStruct((t, 2, 3), jnp.float32),
                           jax.ShapeDtypeStruct((t, 3, 2), jnp.float32))
  with pytest.raises(PaddingUnsupportedError,
                     match="no exact rule for 'ragged_dot_general' at .*ragged batch axis"):
    pad_jaxpr(cj, ("t",), {"t": 8})


def test_unvalidated_plan_checks_in_the_callers_trace():
  """``validate=False`` (the per-bucket lowering): no abstract trace at plan time; the
  caller's own trace inside ``plan.tracing()`` records the rewrites and raises what it cannot
  pad, with the same message as a validated plan."""
  (t,) = export.symbolic_shape("t")
  bad = jax.make_jaxpr(lambda x: jnp.fft.fft(x).real)(jax.ShapeDtypeStruct((t,), jnp.float32))
  plan = pad_jaxpr(bad, ("t",), {"t": 8}, validate=False)  # no error yet
  with pytest.raises(PaddingUnsupportedError, match="no exact rule for 'fft' at "):
    with plan.tracing():
      jax.jit(plan.fun).trace((jnp.int32(3),), jax.ShapeDtypeStruct((8,), jnp.float32))
  good = jax.make_jaxpr(lambda x: jax.nn.softmax(x).sum())(
    jax.ShapeDtypeStruct((t,), jnp.float32))
  want = pad_jaxpr(good, ("t",), {"t": 8})
  plan = pad_jaxpr(good, ("t",), {"t": 8}, validate=False)
  assert plan.rewrites == []
  with plan.tracing():
    traced = jax.jit(plan.fun).trace((jnp.int32(3),), jax.ShapeDtypeStruct((8,), jnp.float32))
  assert plan.rewrites == want.rewrites and plan.rewrites
  plan.check_outputs([o.shape for o in jax.tree.leaves(traced.out_info)])
  with pytest.raises(PaddingUnsupportedError, match="returns shapes"):
    plan.check_outputs([(8,)])
  x = jnp.asarray([1.0, 2.0, 3.0, 9e9, -9e9, 0, 0, 0])
  np.testing.assert_allclose(traced.lower().compile()((jnp.int32(3),), x)[0],
                             jax.nn.softmax(x[:3]).sum(), rtol=1e-6)


def test_rng_bit_generator_over_a_dynamic_shape_says_why():
  (t,) = export.symbolic_shape("t")
  fun = lambda k, x: x + lax.rng_bit_generator(k, x.shape)[1].astype(jnp.float32)
  cj = jax.make_jaxpr(fun)(
    jax.ShapeDtypeStruct((4,), jnp.uint32), jax.ShapeDtypeStruct((t,), jnp.float32)
  )
  with pytest.raises(PaddingUnsupportedError, match="no exact rule for 'rng_bit_generator' at"):
    pad_jaxpr(cj, ("t",), {"t": 8})
  with pytest.raises(PaddingUnsupportedError, match="leaves the mapping from key and shape"):
    pad_jaxpr(cj, ("t",), {"t": 8})


def test_approx_top_k_off_the_cpu_says_why(monkeypatch):
  # A GPU's approx_top_k breaks ties in an order that depends on the length it reduces (H100:
  # six equal values gave index 5, the same six padded to 8 gave 3), so it is refused there.
  (t,) = export.symbolic_shape("t")
  cj = jax.make_jaxpr(lambda x: lax.approx_max_k(x, 1))(jax.ShapeDtypeStruct((2, t), jnp.float32))
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  pad_jaxpr(cj, ("t",), {"t": 8})  # the CPU: an exact sort-based top-k
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(PaddingUnsupportedError,
                     match="on gpu approx_top_k breaks ties in an order that depends on the"):
    pad_jaxpr(cj, ("t",), {"t": 8})


def _line_of(marker: str) -> int:
  return next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if marker in s)


def _every_unsupported(x):
  a = jnp.fft.fft(x).real  # LINE_MANY_FFT
  b = jnp.linalg.cholesky(jnp.outer(x, x) + jnp.eye(x.shape[0])).sum(0)  # LINE_MANY_CHOL
  return jnp.sin(a) + b + jnp.fft.ifft(x * 2).real  # LINE_MANY_IFFT


def test_every_unsupported_equation_is_listed_in_one_error():
  (t,) = export.symbolic_shape("t")
  cj = jax.make_jaxpr(_every_unsupported)(jax.ShapeDtypeStruct((t,), jnp.float32))
  fft = "it touches a dynamic axis: " + re.escape(
    "a DFT of length n has n-dependent twiddle factors, so no padding of the input gives the "
    "unpadded transform"
  )
  chol = "it touches a dynamic axis: " + re.escape(
    "a factorisation over a dynamic matrix axis has no masking rule yet (padding with an "
    "identity block would keep it exact: not implemented)"
  )
  at = lambda marker: rf"\S*test_padding\.py:{_line_of(marker)}:\d+ \(_every_unsupported\)"
  want = (
    r"^the padding pass has no exact rule for 3 equations:\n"
    rf"  'fft' at {at('LINE_MANY_FFT')}: {fft}\n"
    rf"  'cholesky' at {at('LINE_MANY_CHOL')}: {chol}\n"
    rf"  'fft' at {at('LINE_MANY_IFFT')}: {fft}$"
  )
  with pytest.raises(PaddingUnsupportedError, match=want) as e:
    pad_jaxpr(cj, ("t",), {"t": 8})
  assert len(e.value.problems) == 3


def test_fallback_message_says_no_exact_rule_once():
  import dynjax

  x = np.ones(5, np.float32)
  first = rf"'fft' at \S*test_padding\.py:{_line_of('LINE_MANY_FFT')}:\d+ \(_every_unsupported\)"
  f = dynjax.jit(_every_unsupported, dims={"x": "t"})
  with pytest.warns(UserWarning) as w:
    f(x)
  (msg,) = [str(m.message) for m in w]
  assert re.match(
    r"^dynjax\.jit\(_every_unsupported\): running unpadded, one compile per shape: the padding "
    rf"pass has no exact rule for 3 equations:\n  {first}: ",
    msg,
  ), msg
  assert msg.count("no exact rule") == 1 and msg.count("running unpadded") == 1
  g = dynjax.jit(_every_unsupported, dims={"x": "t"}, on_fallback="error")
  with pytest.raises(dynjax.PaddingFallbackError) as e:
    g(x)
  msg = str(e.value)
  assert re.match(
    r"^dynjax\.jit\(_every_unsupported\): padding='auto' cannot pad this function and "
    r"on_fallback='error' refuses to run it unpadded \(one compile per shape\): the padding pass "
    rf"has no exact rule for 3 equations:\n  {first}: ",
    msg,
  ), msg
  assert msg.endswith(
    "\nFix: rewrite the named lines with primitives the pass supports "
    "(dynjax.bucketing.rule_coverage() lists them), use padding='trust' if the function is "
    "pad-safe, or on_fallback='warn' to accept one compile per shape"
  )
  assert msg.count("no exact rule") == 1 and msg.count("runs unpadded") == 0
  h = dynjax.jit(lambda x: jnp.fft.fft(x).real, dims={"x": "t"}, on_fallback="error")
  with pytest.raises(
    dynjax.PaddingFallbackError,
    match=r"\(one compile per shape\): the padding pass has no exact rule for 'fft' at \S+ \(.*\): "
    r"it "
    r"touches a dynamic axis: a DFT .* transform\. Fix: rewrite the named lines",
  ):
    h(x)


def test_unsupported_inside_library_jit_names_user_line():
  (t,) = export.symbolic_shape("t")
  fun = lambda x: jax.jit(jnp.linalg.cholesky)(x)  # LINE_CHOL
  with pytest.raises(PaddingUnsupportedError) as e:
    pad_jaxpr(jax.make_jaxpr(fun)(jax.ShapeDtypeStruct((t, t), jnp.float32)), ("t",), {"t": 4})
  line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if "# LINE_CHOL" in s)
  assert "cholesky" in str(e.value) and f"test_padding.py:{line}" in str(e.value)


def test_static_equations_need_no_rule():
  (t,) = export.symbolic_shape("t")
  w = jnp.eye(3)
  fun = lambda x, m: (x.sum(), jnp.linalg.cholesky(m + 3 * w))
  cj = jax.make_jaxpr(fun)(
    jax.ShapeDtypeStruct((t,), jnp.float32), jax.ShapeDtypeStruct((3, 3), jnp.float32)
  )
  plan = pad_jaxpr(cj, ("t",), {"t": 8})
  x = np.full(8, np.nan, np.float32)
  x[:2] = [1, 2]
  s, c = jax.jit(plan.fun)((jnp.int32(2),), x, np.eye(3, dtype=np.float32))
  assert float(s) == 3.0 and np.allclose(c, 2 * np.eye(3))


def test_rewrites_list_masks_known_fills_and_dead_code():
  (t,) = export.symbolic_shape("t")

  def fun(x):
    _ = jnp.sort(x)  # dead: cannot reach an output
    return x.sum() + jnp.zeros_like(x).sum()

  plan = pad_jaxpr(jax.make_jaxpr(fun)(jax.ShapeDtypeStruct((t,), jnp.float32)), ("t",), {"t": 8})
  text = "\n".join(plan.rewrites)
  assert "sort" in text and "left alone: its result cannot reach an output" in text
  assert "masked operand axes (0:t) with 0.0" in text
  assert "no mask needed on operand: padded region already 0.0" in text


def test_plan_shapes_and_errors():
  b, t = export.symbolic_shape("b, t")
  cj = jax.make_jaxpr(lambda x: x.reshape(-1))(jax.ShapeDtypeStruct((b, t), jnp.float32))
  plan = pad_jaxpr(cj, ("b", "t"), {"b": 2, "t": 4})
  assert plan.in_shapes == [(2, 4)] and plan.out_shapes == [(8,)]
  with pytest.raises(ValueError, match="not in dim_vars"):
    pad_jaxpr(cj, ("t",), {"t": 4})
  with pytest.raises(ValueError, match="no size for"):
    pad_jaxpr(cj, ("b", "t"), {"t": 4})
  with pytest.raises(ValueError, match="expected padded shape"):
    plan.fun((jnp.int32(1), jnp.int32(1)), jnp.zeros((3, 4)))


def test_rule_coverage():
  covered, missing = rule_coverage()
  for name in [
    "dot_general",
    "reduce_sum",
    "gather",
    "scatter-add",
    "scan",
    "while",
    "cond",
    "sort",
    "reshape",
  ]:
    assert name in covered
  assert "fft" in missing and "dot_general" not in missing
  for name in ["select_and_scatter_add", "select_and_gather_add", "reduce", "reduce_window"]:
    assert name in covered
  assert not set(covered) & set(missing)


def test_size_max_grows_in_place_and_stays_exact():
  """``size_max``: true sizes bounded below the bucket, so ``t + 1`` fits the bucket of ``t``
  and the concatenation is one in-place update of the input buffer."""
  (t,) = export.symbolic_shape("t")
  cj = jax.make_jaxpr(lambda x: jnp.concatenate([x, x[-1:] * 2 + 1]))(
      jax.ShapeDtypeStruct((t,), jnp.float32))
  plan = pad_jaxpr(cj, ("t",), {"t": 8}, size_max={"t": 7})
  assert plan.in_shapes == [(8,)] and plan.out_shapes == [(8,)]
  wide = pad_jaxpr(cj, ("t",), {"t": 8})
  assert wide.out_shapes == [(9,)]
  fn = jax.jit(plan.fun)
  for n in (1, 4, 7):
    x = np.full(8, np.nan, np.float32)
    x[:n] = np.arange(n)
    (out,) = fn((jnp.int32(n),), x)
    np.testing.assert_array_equal(np.asarray(out)[:n + 1], [*range(n), 2 * (n - 1) + 1])


def test_non_monotone_output_dims_with_monotone_false():
  (n, t) = export.symbolic_shape("n, t")
  cj = jax.make_jaxpr(lambda x, y: x[y.shape[0]:])(jax.ShapeDtypeStruct((n,), jnp.float32),
                                                  jax.ShapeDtypeStruct((t,), jnp.float32))
  with pytest.raises(PaddingUnsupportedError, match="dims not monotone"):
    pad_jaxpr(cj, ("n", "t"), {"n": 8, "t": 4})
  plan = pad_jaxpr(cj, ("n", "t"), {"n": 8, "t": 4}, monotone=False)
  assert plan.out_shapes == [(7,)]  # n - min(n, t) is largest at n = 8, t = 1
  (out,) = jax.jit(plan.fun)((jnp.int32(6), jnp.int32(2)), jnp.arange(8.0), jnp.zeros(4))
  np.testing.assert_array_equal(np.asarray(out)[:4], [2.0, 3.0, 4.0, 5.0])


def test_per_jaxpr_analysis_is_found_once_and_goes_with_its_jaxpr(monkeypatch):
  # Every bucket re-interprets the family's jaxpr: which equations touch a dynamic axis and
  # which are live is found once a jaxpr (sub-jaxprs each once), and held weakly.
  import gc
  import weakref

  from dynjax.bucketing import _padding_core as pc

  made = []
  real = pc.JaxprInfo.__init__

  def counting(self, jaxpr):
    made.append(jaxpr)
    real(self, jaxpr)

  monkeypatch.setattr(pc.JaxprInfo, "__init__", counting)
  (t,) = export.symbolic_shape("t")
  closed = jax.make_jaxpr(
      lambda x: lax.fori_loop(0, 2, lambda i, c: c + jnp.sin(x).sum(), 0.0) + x.max())(
      jax.ShapeDtypeStruct((t,), jnp.float32))
  for n in (4, 8, 16):
    plan = pad_jaxpr(closed, ("t",), {"t": n})
    x = jnp.concatenate([jnp.arange(3.0), jnp.full((n - 3,), jnp.nan)])
    got = float(jax.jit(plan.fun)((jnp.int32(3),), x)[0])
    want = 2 * float(jnp.sin(jnp.arange(3.0)).sum()) + 2.0
    assert abs(got - want) < 1e-5, (n, got, want)
  assert len(made) == len({id(j) for j in made}) >= 2  # the top jaxpr and the loop body
  ref = weakref.ref(closed.jaxpr)
  made.clear()
  del closed, plan
  gc.collect()
  assert ref() is None  # the analysis cache did not keep the jaxpr alive
