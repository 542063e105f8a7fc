"""Programs composed at random from everyday ops over a padded ``(b, t, 3)`` batch, padded
vs exact (session 22).

Each rule is tested alone (``test_padding.py``); what can go wrong between rules is what one
tells the next about the padded region (``fill``, ``axis_fill``: "the padding holds 0 here",
so a sum may skip its mask).  Hypothesis draws a program of up to 8 steps, each an op on
values made so far; the ``Case`` harness pads its inputs with NaN, inf and 1e30 and compares
every value the program made, in every bucket drawn, with ``jax.jit`` at the exact shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.bucketing._harness import Case, family_case


def _case(fun, **kw):
  """Traced as a family traces (the gradients of cumprod / cummax scan with
  ``associative_scan``, which dynjax binds over a dynamic axis)."""
  return family_case(fun, lambda b, t: [(b, t, 3), (b, t, 3)], **kw)


def _keep(x, y):  # broadcast a reduction back to x's shape
  return jnp.broadcast_to(y, x.shape)


UNARY = {
  "sin": jnp.sin,
  "relu": jax.nn.relu,
  "affine": lambda x: 2.0 * x + 1.0,
  "where_pos": lambda x: jnp.where(x > 0, x, 0.0),
  "exp_clip": lambda x: jnp.exp(jnp.clip(x, -5, 5)),
  "sqrt_abs": lambda x: jnp.sqrt(jnp.abs(x)),
  "zeros_like_plus": lambda x: jnp.zeros_like(x) + 0.5,  # a value whose padding is known
  "sum_t": lambda x: _keep(x, jnp.sum(x, axis=1, keepdims=True)),
  "max_t": lambda x: _keep(x, jnp.max(x, axis=1, keepdims=True)),
  "mean_t": lambda x: _keep(x, jnp.mean(x, axis=1, keepdims=True)),
  "lse_t": lambda x: _keep(x, jax.nn.logsumexp(x, axis=1, keepdims=True)),
  "sum_b": lambda x: _keep(x, jnp.sum(x, axis=0, keepdims=True)),
  "min_bt": lambda x: _keep(x, jnp.min(x, axis=(0, 1), keepdims=True)),
  "sum_d": lambda x: _keep(x, jnp.sum(x, axis=2, keepdims=True)),
  "argmax_t": lambda x: _keep(x, jnp.argmax(x, axis=1, keepdims=True).astype(x.dtype)),
  "cumsum_t": lambda x: jnp.cumsum(x, axis=1),
  "rcumsum_t": lambda x: jnp.flip(jnp.cumsum(jnp.flip(x, 1), axis=1), 1),
  "cummax_t": lambda x: jax.lax.cummax(x, axis=1),
  "softmax_t": lambda x: jax.nn.softmax(x, axis=1),
  "softmax_d": lambda x: jax.nn.softmax(x, axis=2),
  "flip_t": lambda x: jnp.flip(x, 1),
  "roll_t": lambda x: jnp.roll(x, 1, axis=1),
  "shift_t": lambda x: jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1),
  "pad_slice_t": lambda x: jnp.pad(x, ((0, 0), (2, 1), (0, 0)), constant_values=3.0)[:, 1:-2],
  "sort_t": lambda x: jnp.sort(x, axis=1),
  "argsort_take": lambda x: jnp.take_along_axis(x, jnp.argsort(x[..., :1], axis=1), axis=1),
  "position": lambda x: x + jnp.arange(x.shape[1], dtype=x.dtype)[None, :, None],
  "causal_mix": lambda x: jnp.einsum(
      "ts,bsd->btd", jnp.tril(jnp.ones((x.shape[1], x.shape[1]), x.dtype)), x),
  "attend": lambda x: jnp.einsum(
      "bts,bsd->btd", jax.nn.softmax(jnp.einsum("btd,bsd->bts", x, x) / 3.0, axis=-1), x),
  "dense": lambda x: x @ jnp.array([[0.5, -1.0, 0.25], [1.0, 0.5, 0.0], [0.0, 0.3, 1.0]],
                                   x.dtype),
  "layernorm_d": lambda x: (x - x.mean(2, keepdims=True)) / (x.std(2, keepdims=True) + 1.0),
  "conv_t": lambda x: jax.lax.conv_general_dilated(
      x, jnp.ones((3, 3, 3), x.dtype) * 0.1, (1,), "SAME",
      dimension_numbers=("NWC", "WIO", "NWC")),
  "cumprod_t": lambda x: jnp.cumprod(jnp.tanh(x), axis=1),
  "var_t": lambda x: _keep(x, jnp.var(x, axis=1, keepdims=True)),
  "median_t": lambda x: _keep(x, jnp.median(x, axis=1, keepdims=True)),
  "count_pos_t": lambda x: jnp.cumsum(x > 0.37, axis=1).astype(x.dtype),
  "set_first": lambda x: x.at[:, 0].set(7.0),
  "add_last": lambda x: x + x[:, -1:],
  "concat_cumsum_cut": lambda x: jnp.cumsum(jnp.concatenate([x, x * 2], axis=1), axis=1)[
      :, :x.shape[1]],
  "concat_rev_cut": lambda x: jnp.flip(jnp.concatenate([x, -x], axis=1), 1)[:, x.shape[1]:],
  "merge_td": lambda x: _keep(x, jnp.sum(x.reshape(x.shape[0], -1), axis=1)[:, None, None]),
  "one_hot_argmax_d": lambda x: jax.nn.one_hot(jnp.argmax(x, axis=2), 3, dtype=x.dtype),
  "gather_by_data": lambda x: jnp.take_along_axis(
      x, jnp.clip((jnp.abs(x[..., :1]) * 2 + 0.37).astype(jnp.int32), 0, x.shape[1] - 1), axis=1),
  "segment_by_sign": lambda x: _keep(x, jax.ops.segment_sum(
      x.reshape(-1, 3), (x[..., 0] > 0.37).reshape(-1).astype(jnp.int32), num_segments=2)[1]),
  "dus_t": lambda x: jax.lax.dynamic_update_slice_in_dim(x, x[:, :1] * 3.0, x.shape[1] // 2,
                                                          axis=1),
  "mask_first_half": lambda x: jnp.where(
      jnp.arange(x.shape[1])[None, :, None] < x.shape[1] // 2, x, -x),
  # Steps, thresholds and poles sit at odd values: a value that is 0 in exact arithmetic (the
  # variance of a constant) comes out 0 or 1e-15 depending on the summation order, and a
  # threshold at 0 would turn that rounding into a different answer (session 22's deep run).
  "log_abs": lambda x: jnp.log(jnp.abs(x) + 0.25),  # NaN / inf from the padding's garbage
  "reciprocal": lambda x: 1.0 / (jnp.abs(x) + 0.3),
  "int_round_trip": lambda x: jnp.floor(x * 3 + 0.37).astype(jnp.int32).astype(x.dtype),
  "bool_mix": lambda x: ((x > 0.37) & (jnp.roll(x, 1, axis=2) < 0.53)).astype(x.dtype),
  "sign_clip": lambda x: jnp.sign(x - 0.37) * jnp.clip(jnp.abs(x), 0.1, 2.0),
  "top2_d": lambda x: _keep(x, jax.lax.top_k(x, 2)[0].sum(-1, keepdims=True)),
  "max_pool_t": lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 1),
                                                (1, 1, 1), "SAME"),
  "avg_pool_t": lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 1), (1, 1, 1),
                                                ((0, 0), (1, 0), (0, 0))) / 2.0,
  "cumsum_b": lambda x: jnp.cumsum(x, axis=0),
  "flip_b": lambda x: jnp.flip(x, 0),
  "swap_bt": lambda x: jnp.swapaxes(jnp.cumsum(jnp.swapaxes(x, 0, 1), axis=0), 0, 1),
  "any_t": lambda x: _keep(x, jnp.any(x > 1.13, axis=1, keepdims=True).astype(x.dtype)),
  "prod_t": lambda x: _keep(x, jnp.prod(jnp.tanh(x), axis=1, keepdims=True)),
  "masked_mean_t": lambda x: _keep(x, jnp.sum(jnp.where(x > 0.37, x, 0), axis=1, keepdims=True)
                                   / (jnp.sum(x > 0.37, axis=1, keepdims=True) + 1.0)),
  "scan_ema_t": lambda x: jnp.moveaxis(jax.lax.scan(
      lambda h, xt: (0.5 * h + xt, 0.5 * h + xt), jnp.zeros_like(x[:, 0]),
      jnp.moveaxis(x, 1, 0))[1], 0, 1),
}
BINARY = {
  "add": jnp.add,
  "mul": jnp.multiply,
  "maximum": jnp.maximum,
  "div": lambda x, y: x / (y * y + 1.0),
  "select": lambda x, y: jnp.where(x > y, x, y),
}
OPS = sorted(UNARY) + sorted(BINARY)


def _program(steps):
  def fun(x, y):
    pool = [x, y]
    for name, i, j in steps:
      a, b = pool[i % len(pool)], pool[j % len(pool)]
      pool.append(UNARY[name](a) if name in UNARY else BINARY[name](a, b))
    return pool[2:]
  return fun


_STEP = st.tuples(st.sampled_from(OPS), st.integers(0, 9), st.integers(0, 9))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_STEP, min_size=1, max_size=8),
       sizes=st.sampled_from([((2, 3), (2, 4)), ((1, 5), (2, 8)), ((3, 1), (4, 4)),
                              ((2, 7), (2, 8)), ((1, 2), (1, 16))]),
       garbage=st.sampled_from(["mixed", "nan", "zeros"]))
def test_random_programs_are_exact_on_the_true_prefix(steps, sizes, garbage):
  case = _case(_program(steps), rtol=2e-4, atol=2e-4)
  true, bucket = sizes
  case.check(true, bucket, seed=len(steps), garbage=garbage)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_STEP, min_size=1, max_size=6),
       sizes=st.sampled_from([((2, 3), (2, 4)), ((1, 5), (2, 8)), ((2, 7), (2, 8))]),
       garbage=st.sampled_from(["mixed", "nan"]))
def test_random_programs_have_exact_gradients(steps, sizes, garbage):
  # The backward of every rule, composed: NaN or inf in the padding must not reach a
  # gradient through a 0 cotangent times a derivative taken there.
  program = _program(steps)

  def loss(x, y):
    return sum(jnp.sum(jnp.sin(v)) for v in program(x, y))

  case = _case(jax.grad(loss, argnums=(0, 1)), rtol=1e-3, atol=1e-3)
  true, bucket = sizes
  case.check(true, bucket, seed=len(steps), garbage=garbage)


def test_the_fuzzer_catches_a_rule_that_lies_about_its_padding(monkeypatch):
  # The check can fail: a cumsum rule that claims its padding holds 0 (it holds the running
  # sum) lets the sum after it skip its mask.
  from dynjax.bucketing import _padding_core as pc

  prim = jax.make_jaxpr(lambda x: jnp.cumsum(x, 1))(np.ones((2, 3))).eqns[0].primitive
  real = pc.RULES[prim]

  def lying(ctx, eqn, invals):
    return [pc.PaddedValue(pv.val, 0.0) for pv in real(ctx, eqn, invals)]

  monkeypatch.setitem(pc.RULES, prim, lying)
  case = Case(_program([("cumsum_t", 0, 0), ("sum_t", 2, 2)]),
              lambda b, t: [(b, t, 3), (b, t, 3)])
  try:
    case.check((2, 3), (2, 8), garbage="mixed")
  except AssertionError:
    return
  raise AssertionError("a wrong fill went unnoticed")
