"""The padding pass's fused softmax: one -inf mask instead of three, still exact.

``jax.nn.softmax`` over a dynamic axis followed by a sum or contraction over that axis (the
attention idiom) used to cost three selects over the ``[b, h, q, k]`` scores; the fused rule
masks the input once and marks the padded probabilities as 0, so the contraction needs no mask.
Every case runs with garbage (NaN, +-inf, 1e30) in the padded region and is compared with
``jax.jit`` at the exact shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _harness import Case
from jax import lax

D = 4


def _plan_log(case: Case, bucket) -> list[str]:
  return list(case.plan(bucket).rewrites)


def _attention(x, mask=None, fill=None):
  s = jnp.einsum("btd,bsd->bts", x, x) / math.sqrt(D)
  if mask is not None:
    s = jnp.where(mask[:, None, :], s, jnp.finfo(s.dtype).min if fill is None else fill)
  w = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bts,bsd->btd", w, x)


BTD = lambda b, t: [(b, t, D)]  # noqa: E731


def test_attention_is_fused_and_exact():
  case = Case(lambda x: _attention(x), BTD)
  for true, bucket in [((2, 5), (2, 8)), ((3, 1), (4, 8)), ((2, 8), (2, 8)), ((1, 7), (2, 16))]:
    for garbage in ("mixed", "nan", "zeros"):
      case.check(true, bucket, garbage=garbage)
  log = _plan_log(case, (2, 8))
  assert any("softmax over axis" in line and "fused" in line for line in log), log
  assert any("no mask needed on lhs" in line for line in log), log
  # one mask on the scores (the softmax input), none on its sum or on the probabilities
  assert not any(line.startswith("reduce_sum") and "masked" in line for line in log), log


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_low_precision_softmax_is_fused_and_exact(dtype, tol):
  # jax sums a bf16/f16 softmax in float32 between two converts; that chain fuses too (it
  # took three selects over the scores until session 4).  Compared in float32 with jax.jit at
  # the exact shape in the same dtype; only the order of the float32 sum may differ.
  case = Case(lambda x: _attention(x.astype(dtype)).astype(jnp.float32), BTD, rtol=tol,
              atol=tol)
  for true, bucket in [((2, 5), (2, 8)), ((3, 1), (4, 8)), ((1, 7), (2, 16))]:
    for garbage in ("mixed", "nan"):
      case.check(true, bucket, garbage=garbage)
  log = _plan_log(case, (2, 8))
  assert any("softmax over axis" in line and "fused" in line for line in log), log
  assert any("no mask needed on lhs" in line for line in log), log
  assert not any(line.startswith("reduce_sum") and "masked" in line for line in log), log


def test_rows_whose_keys_are_all_minus_inf_give_nan_as_unpadded():
  def fun(x, m):
    return _attention(x, m, fill=-jnp.inf)

  def inputs(rng, shapes):
    x = rng.normal(size=shapes[0]).astype(np.float32)
    m = rng.random(shapes[1]) < 0.6
    m[0] = False  # every key of row 0 is -inf: softmax is NaN there, padded or not
    return [x, m]

  case = Case(fun, lambda b, t: [(b, t, D), (b, t)], dtypes=[jnp.float32, jnp.bool_],
              inputs=inputs)
  for garbage in ("mixed", "nan"):
    exact = case.check((3, 5), (4, 8), garbage=garbage)
    assert np.isnan(np.asarray(exact[0] if isinstance(exact, list | tuple) else exact)[0]).all()


@pytest.mark.parametrize("name,fun", [
  # the probabilities themselves are an output: their padded region is cut away
  ("probabilities_out", lambda x: jax.nn.softmax(x.sum(-1), axis=-1)),
  # a max over the axis needs -inf, not the 0 the fused value promises: it must still mask
  ("max_of_probabilities", lambda x: jax.nn.softmax(x.sum(-1), axis=-1).max(-1)),
  # the exp intermediate is used outside the softmax: not fused, per-op rules
  ("intermediate_reused", lambda x: (lambda s: (jax.nn.softmax(s, -1) * jnp.exp(s)).sum(-1))(
      x.sum(-1))),
  # softmax over the batch axis (dynamic too) then a sum over time
  ("softmax_over_batch", lambda x: jax.nn.softmax(x.sum(-1), axis=0).sum(1)),
  # two dynamic axes reduced at once after a fused softmax over one of them
  ("sum_over_both_axes", lambda x: jax.nn.softmax(x.sum(-1), axis=-1).sum()),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_patterns_around_the_fusion_stay_exact(name, fun, dtype):
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  case = Case(lambda x: jax.tree.map(lambda y: y.astype(jnp.float32), fun(x.astype(dtype))), BTD,
              rtol=tol, atol=tol)
  for true, bucket in [((2, 5), (2, 8)), ((3, 3), (4, 8))]:
    for garbage in ("mixed", "nan"):
      case.check(true, bucket, garbage=garbage)


def test_static_axis_softmax_is_not_touched():
  case = Case(lambda x: jax.nn.softmax(x, axis=-1).sum(1), BTD)
  case.check((2, 5), (2, 8))
  assert not any("softmax over axis" in line for line in _plan_log(case, (2, 8)))


def test_gradient_of_attention_stays_exact():
  def loss(x):
    return jnp.sum(_attention(x) ** 2, axis=(1, 2))

  case = Case(lambda x: jax.vmap(jax.grad(lambda r: loss(r[None])[0]))(x), BTD, rtol=1e-4,
              atol=1e-4)
  for garbage in ("mixed", "nan"):
    case.check((2, 5), (2, 8), garbage=garbage)


def test_reversed_cumsum_of_probabilities_with_inf_rows_stays_exact():
  # A row with +inf scores: every valid probability is NaN (inf - inf), as unpadded; the fused
  # value's padded 0s must not make a reversed cumsum over the axis differ anywhere valid.
  def fun(x):
    s = x.sum(-1)
    s = jnp.where(jnp.arange(s.shape[1])[None, :] == 0, jnp.where(s[:, :1] > 0, jnp.inf, s), s)
    return jnp.cumsum(jax.nn.softmax(s, axis=-1)[:, ::-1], axis=1)

  case = Case(fun, BTD)
  for garbage in ("mixed", "nan"):
    case.check((3, 5), (4, 8), garbage=garbage)


def test_softmax_over_an_axis_empty_at_the_probe_bucket_is_bucketed():
  # wav2vec2's feature extractor (HF Flax): a VALID conv shortens the length by its kernel, so
  # at the smallest bucket the frames axis is empty, and the fused softmax's max over it raised
  # (jnp.max refuses an empty axis; lax's reduce_max gives -inf): the family fell back with
  # "the padding pass failed ... please report it".
  import warnings

  import dynjax

  taps = jnp.linspace(-1.0, 1.0, 10).reshape(10, 1, 1)  # (width, in, out), as flax's nn.Conv

  def f(x):  # x: [t]; frames: [t - 9] (none at t=8); attention-like softmax over the frames
    frames = lax.conv_general_dilated(x[None, :, None], taps, (1,), "VALID",
                                      dimension_numbers=("NWC", "WIO", "NWC"))[0, :, 0]
    w = jax.nn.softmax(frames[:, None] * frames[None, :], axis=-1)
    return w @ frames

  g = dynjax.jit(f, dims={"x": "t"}, buckets={"t": dynjax.buckets.pow2(min=8)},
                 padding="auto", on_fallback="error")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for t in (12, 16, 27, 40):
      x = np.random.default_rng(t).normal(size=t).astype(np.float32)
      np.testing.assert_allclose(g(x), jax.jit(f)(x), rtol=1e-5, atol=1e-6)
  assert g.stats()["fallbacks"] == []
