"""Guards: size conditions a family infers where symbolic tracing cannot decide a comparison.

``lax.top_k(x, 3)`` asks whether ``t < 3``; the family assumes ``t >= 3`` (the side with more
of the sizes the policy allows), traces and pads under it, and runs sizes outside it exact.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

import dynjax
from dynjax import _symbolic
from dynjax.jit import _dispatch
from dynjax.jit._guards import inconclusive_comparison


@pytest.fixture
def guarded(monkeypatch):
  """A dispatcher that checks ``Family.guard_ok`` before it runs a bucket.

  Until ``Dispatcher`` does it itself (and says so with ``checks_guards = True``), this fixture
  adds that check to ``Dispatcher.resolve``: the first thing it does with the true sizes.
  """
  if getattr(_dispatch.Dispatcher, "checks_guards", False):
    return
  real = _dispatch.Dispatcher.resolve

  def resolve(self, fam, vals, top, key):
    sizes = _symbolic.solve_sizes(fam.sig, dict(zip(fam.spec_idx, key[0], strict=True)))
    if not fam.guard_ok(sizes):
      fam.outside_guards(sizes)  # raises under on_fallback="error"
      fam.tuple_hist[sizes] += 1
      return None  # run exact
    return real(self, fam, vals, top, key)

  monkeypatch.setattr(_dispatch.Dispatcher, "resolve", resolve)
  monkeypatch.setattr(_dispatch.Dispatcher, "checks_guards", True, raising=False)


def top3(x):
  return lax.top_k(x, 3)


def reflect(x):
  return jnp.pad(x, ((0, 0), (2, 2)), mode="reflect")


def diff_max(x):
  return jnp.diff(x, axis=1).max(1)


# (function, the guard it needs, sizes that satisfy it, a size that violates it)
GUARDED = {
  "top_k": (top3, "t >= 3", [3, 5, 8, 9, 16], 2),
  "pad_reflect": (reflect, "t >= 3", [3, 5, 8, 9, 16], 2),
  "diff_max": (diff_max, "t >= 2", [2, 5, 8, 9, 16], 1),
}


def _x(t, seed=0):
  return np.random.default_rng(seed + t).normal(size=(2, t)).astype(np.float32)


def _assert_same(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_inferred_guard_pads_with_one_compile_per_bucket(name, guarded, compiles):
  fun, guard, sizes, _ = GUARDED[name]
  f = dynjax.jit(fun, dims={"x": "b, t"}, buckets={"b": [2], "t": [8, 16]}, on_fallback="error")
  ref = jax.jit(fun)
  wants = [jax.tree.map(np.asarray, ref(_x(t))) for t in sizes]
  before = compiles()
  for t, want in zip(sizes, wants, strict=True):
    _assert_same(f(_x(t)), want)
  assert compiles() - before == 2 == f.stats()["compiles"]  # buckets t=8 and t=16
  assert f.stats()["fallbacks"] == []
  assert f.trace(_x(sizes[0])).family.guards == (guard,)


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_sizes_outside_the_guard_run_exact(name, guarded):
  fun, guard, _, bad = GUARDED[name]
  f = dynjax.jit(fun, dims={"x": "b, t"}, buckets={"b": [2], "t": [8, 16]})
  _assert_same(f(_x(8)), jax.jit(fun)(_x(8)))  # padded
  try:
    want = jax.jit(fun)(_x(bad))
  except Exception as e:  # the exact function refuses this size: so must dynjax
    with pytest.warns(UserWarning, match=rf"violate the guard\(s\) {guard} inferred"):
      with pytest.raises(type(e)):
        f(_x(bad))
  else:
    with pytest.warns(UserWarning, match=rf"violate the guard\(s\) {guard} inferred"):
      _assert_same(f(_x(bad)), want)
    _assert_same(f(_x(bad)), want)  # warned once
    assert f.stats()["exact_calls"] == 2
  assert f.stats()["fallbacks"] == []


def test_outside_the_guard_refuses_under_on_fallback_error(guarded):
  f = dynjax.jit(top3, dims={"x": "b, t"}, buckets={"b": [2], "t": [8]}, on_fallback="error")
  _assert_same(f(_x(5)), jax.jit(top3)(_x(5)))
  with pytest.raises(
    dynjax.PaddingFallbackError,
    match=r"^dynjax\.jit\(top3\): sizes b = 2, t = 2 violate the guard\(s\) t >= 3 inferred while "
    r"tracing, and on_fallback='error' refuses to run them unpadded \(one compile per shape\)\. "
    r"Fix: keep t >= 3, or pass constraints=\[\.\.\.\] that decide the comparison the other "
    r"way, or on_fallback='warn'$",
  ):
    f(_x(2))


def small_or_diff(x):
  return jnp.diff(x, n=3, axis=1) if x.shape[1] >= 4 else x * 2


def test_a_small_policy_max_guards_the_side_with_more_sizes(guarded):
  # sizes 1..4 allowed (max 4): "t >= 4" holds for one of them, "t <= 3" for three
  f = dynjax.jit(small_or_diff, dims={"x": "b, t"}, buckets={"b": [2], "t": [2, 4]})
  assert f.trace(_x(2)).family.guards == ("t <= 3",)
  for t in (1, 2, 3):
    _assert_same(f(_x(t)), jax.jit(small_or_diff)(_x(t)))
  with pytest.warns(UserWarning, match=r"sizes b = 2, t = 4 violate the guard\(s\) t <= 3"):
    _assert_same(f(_x(4)), jax.jit(small_or_diff)(_x(4)))
  assert f.stats()["compiles"] == 3  # buckets t=2 and t=4 (t=4 never padded), t=4 exact


def test_user_constraints_need_no_guard(guarded):
  f = dynjax.jit(
    top3,
    dims={"x": "b, t"},
    buckets={"b": [2], "t": [8]},
    constraints=["t >= 3"],
    on_fallback="error",
  )
  _assert_same(f(_x(4)), jax.jit(top3)(_x(4)))


def test_undecidable_forms_fall_back_as_before(guarded):
  f = dynjax.jit(lambda x, y: lax.top_k(x, y.shape[0]), dims={"x": "b, t", "y": "k"})
  with pytest.warns(UserWarning, match="symbolic tracing failed"):
    _assert_same(f(_x(5), np.ones(2)), jax.jit(lambda x, y: lax.top_k(x, 2))(_x(5), np.ones(2)))


def _cmp_error(lhs, op, rhs):
  return ValueError(f"Symbolic dimension comparison '{lhs}' {op} '{rhs}' is inconclusive.")


@pytest.mark.parametrize(
  "lhs, op, rhs, want",
  [
    ("t", "<", "3", ("t", 3)),
    ("t", ">=", "3", ("t", 3)),
    ("t", "<=", "3", ("t", 4)),
    ("t", ">", "1", ("t", 2)),
    ("3", ">", "t", ("t", 3)),
    ("1", "<", "t", ("t", 2)),
    ("t - 1", ">=", "1", ("t", 2)),
    ("t + 2", "<", "5", ("t", 3)),
    ("2*t", "<", "3", ("t", 2)),  # one variable, one flip (session 25: _guards._split)
    ("max(floordiv(max(floordiv(t - 7, 3) + 1, 0) - 7, 3) + 1, 0)", ">=", "1", ("t", 25)),
    ("t", "<", "s", None),
    ("t*s", ">=", "1", None),
    ("mod(t, 3)", "<", "1", None),  # flips again and again: no one side
  ],
)
def test_inconclusive_comparison_finds_where_one_variable_flips(lhs, op, rhs, want):
  assert inconclusive_comparison(_cmp_error(lhs, op, rhs)) == want
  chained = RuntimeError("outer")
  chained.__cause__ = _cmp_error(lhs, op, rhs)
  assert inconclusive_comparison(chained) == want
  assert inconclusive_comparison(ValueError("something else")) is None


def test_jax_still_words_inconclusive_comparisons_this_way():
  (t,) = export.symbolic_shape("t")
  with pytest.raises(Exception) as e:
    jax.make_jaxpr(top3)(jax.ShapeDtypeStruct((2, t), jnp.float32))
  assert inconclusive_comparison(e.value) == ("t", 3)


def test_a_fallback_names_the_guards_it_traced_under(guarded):
  def fun(x):
    return jnp.fft.fft(x).real.sum(1) + lax.top_k(x, 3)[0].sum(1)

  f = dynjax.jit(fun, dims={"x": "b, t"}, buckets={"b": [2], "t": [8]})
  with pytest.warns(
    UserWarning,
    match=r"running unpadded, one compile per shape: the padding pass has no exact rule for "
    r"'fft' at .*\(traced under the inferred guards t >= 3\)$",
  ):
    np.testing.assert_allclose(f(_x(5)), jax.jit(fun)(_x(5)), rtol=1e-5, atol=1e-5)


def test_without_a_dispatcher_that_checks_guards_it_falls_back_as_before():
  if getattr(_dispatch.Dispatcher, "checks_guards", False):
    pytest.skip("the dispatcher checks guards")
  f = dynjax.jit(top3, dims={"x": "b, t"}, buckets={"b": [2], "t": [8]})
  with pytest.warns(UserWarning, match=r"symbolic tracing failed \(InconclusiveDimensionOperation"):
    _assert_same(f(_x(5)), jax.jit(top3)(_x(5)))
  assert f.trace(_x(5)).family.guards == ()


# -- equalities: jax answers an undecided ``d == 5`` with False (it cannot raise there) -------


def branch_eq(x):
  if x.shape[1] == 5:  # public code's special case of one length
    return x.sum(-1)
  return x.max(-1)


def branch_even(x):
  return x.sum(-1) if x.shape[1] % 2 == 0 else x.max(-1)


def branch_square(x):
  return jnp.trace(x) if x.shape[0] == x.shape[1] else x.sum()


def where_eq(x):
  return jnp.where(x.shape[1] != 5, x.max(-1), x.sum(-1))  # != too


def branch_nonempty(x):
  rest = x[:, 1:]
  if rest.shape[1]:  # Python truthiness: jax's dims had no __bool__ (True at every size)
    return rest.sum(-1) + 1.0
  return x.max(-1) - 7.0


EQUALITIES = {  # (function, its guard, a violating (b, t))
  "if t == 5": (branch_eq, "t != 5", (2, 5)),
  "t % 2 == 0": (branch_even, "mod(t, 2) != 0", (2, 4)),
  "b == t": (branch_square, "b != t", (3, 3)),
  "jnp.where(t != 5)": (where_eq, "t != 5", (2, 5)),
  "if x[:, 1:].shape[1]": (branch_nonempty, "t - 1 != 0", (2, 1)),  # session 29: was wrong
}


@pytest.mark.parametrize("padding", ["auto", "trust"])
@pytest.mark.parametrize("name", sorted(EQUALITIES))
def test_an_undecided_shape_equality_is_a_guard_never_a_wrong_branch(name, padding):
  fun, guard, (vb, vt) = EQUALITIES[name]
  f = dynjax.jit(fun, dims={"x": "b, t"}, buckets={"b": [4], "t": [8, 16]}, padding=padding)
  for b, t in [(2, 3), (2, 7), (3, 9)]:
    x = np.random.default_rng(b * t).normal(size=(b, t)).astype(np.float32)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # trust buckets of even t break mod(t, 2) != 0 (below)
      # (a sum over a padded buffer may round differently on GPU: 1 ulp)
      np.testing.assert_allclose(f(x), jax.jit(fun)(x), rtol=1e-6)
  fam = f.trace(_x(3)).family
  assert fam.guards == (guard,) and fam.mode == padding
  x = np.random.default_rng(0).normal(size=(vb, vt)).astype(np.float32)
  with pytest.warns(UserWarning, match=rf"violate the guard\(s\) {re.escape(guard)} \(.*test_guards.py:\d+\)"):
    np.testing.assert_allclose(f(x), jax.jit(fun)(x), rtol=1e-6)  # the other side: exact
  assert f.stats()["fallbacks"] == []


def test_trust_runs_exact_where_the_bucket_would_take_the_other_side():
  # padding="trust" re-runs the Python at the bucket's sizes: t = 3 pads to t = 8, where
  # ``t % 2 == 0`` holds although it does not at 3
  f = dynjax.jit(branch_even, dims={"x": "b, t"}, buckets={"b": [2], "t": [8]}, padding="trust",
                 on_fallback="warn")
  with pytest.warns(UserWarning, match=r"the bucket b = 2, t = 8 breaks the guard\(s\) mod\(t, 2\)"):
    _assert_same(f(_x(3)), jax.jit(branch_even)(_x(3)))
  assert f.stats()["compiles"] == 1  # t = 3 exact, no bucket


def test_undecided_equality_with_dims_auto_and_on_fallback_error():
  g = dynjax.jit(branch_eq)  # dims="auto": static first, then t becomes a variable
  for t in [3, 4, 5, 5, 6]:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      _assert_same(g(_x(t)), jax.jit(branch_eq)(_x(t)))
  f = dynjax.jit(branch_eq, dims={"x": "b, t"}, on_fallback="error")
  _assert_same(f(_x(4)), jax.jit(branch_eq)(_x(4)))
  with pytest.raises(dynjax.PaddingFallbackError, match=r"t = 5 violate the guard\(s\) t != 5"):
    f(_x(5))


def test_jax_internal_equalities_add_no_guard():
  # broadcasting, squeeze, reshape and gather rules ask jax's definitely_equal(d, 1) etc.:
  # those are jax's own decisions, not the user's, and must not turn into guards
  def fun(x, y):
    z = x[:, :, None] * y[:, None, :]  # (b, t, 1) * (b, 1, t)
    z = z.reshape(x.shape[0], -1).sum(-1) + jnp.squeeze(x[:, :1], 1)
    return z + jnp.take_along_axis(x, jnp.argmax(x, 1, keepdims=True), 1)[:, 0]

  f = dynjax.jit(fun, dims={"x": "b, t", "y": "b, t"})
  x, y = _x(5), _x(5, seed=1)
  _assert_same(f(x, y), jax.jit(fun)(x, y))
  assert f.trace(x, y).family.guards == ()


def test_declared_constraints_are_guards_sizes_outside_run_exact():
  # traced under t <= 4, x[:, :4] is the whole axis: at t = 5 that trace would be wrong
  def head4(x):
    return x[:, :4].sum(-1) + x.shape[1]

  f = dynjax.jit(head4, dims={"x": "b, t"}, constraints=["t <= 4"])
  _assert_same(f(_x(3)), jax.jit(head4)(_x(3)))
  with pytest.warns(UserWarning, match=r"t = 5 violate the guard\(s\) t <= 4 \(constraints=\)"):
    _assert_same(f(_x(5)), jax.jit(head4)(_x(5)))
  strict = dynjax.jit(head4, dims={"x": "b, t"}, constraints=["t <= 4"], on_fallback="error")
  with pytest.raises(dynjax.PaddingFallbackError, match=r"t <= 4 \(constraints=\)"):
    strict(_x(5))


def test_a_generated_eq_called_inside_jax_adds_no_guard_and_from_user_code_it_does():
  # A dataclass's __eq__ is compiled from "<string>": a jax/flax cache keyed by such objects
  # compares dims when two keys' hashes collide (string hashing varies per process: one run of
  # the zoo's BiLSTM got a spurious ``b != 3`` guard).  The frame that called it decides.
  import dataclasses
  import os

  from jax import export

  from dynjax import _jax_private

  @dataclasses.dataclass
  class Key:
    shape: tuple

  inside = {}
  exec(compile("def lookup(a, b):\n  return a == b\n",
               os.path.join(os.path.dirname(jax.__file__), "_probe_cache.py"), "exec"), inside)
  (b,) = export.symbolic_shape("b")
  with _jax_private.undecided_equalities() as record:
    assert inside["lookup"](Key((b, 4)), Key((3, 4))) is False  # jax's own cache: no guard
  assert record == []
  with _jax_private.undecided_equalities() as record:
    assert (Key((b, 4)) == Key((3, 4))) is False  # the user's comparison: a guard, here
  assert [(str(lhs), str(rhs), where.rsplit(":", 1)[0]) for lhs, rhs, where in record] == [
      ("b", "3", __file__)]


# -- advice for JAX's symbolic-shape limits that public code meets ---------------------------


def _linear_recurrence(x):  # h_t = a_t h_{t-1} + b_t by associative scan (S5 / LRU models)
  a, b = jax.nn.sigmoid(x[..., :4]), x[..., 4:]
  return lax.associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (a, b), axis=1)[1]


def test_an_associative_scan_over_the_dynamic_axis_is_bucketed_and_its_limits_get_advice():
  # Session 17 found it falling back (JAX refuses a symbolic length); dynjax binds it as a
  # primitive now (tests/bucketing/test_scan.py).  What it cannot bind keeps the advice.
  from dynjax.jit._guards import trace_failure_hint

  f = dynjax.jit(_linear_recurrence, dims={"x": "b, t, 8"}, buckets={"t": [8, 16]},
                 on_fallback="error")
  x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
  np.testing.assert_allclose(f(x), jax.jit(_linear_recurrence)(x), rtol=1e-6, atol=1e-6)
  assert f.stats()["fallbacks"] == []
  hint = trace_failure_hint(NotImplementedError(
      "associative scan over axis of non-constant size: t. You may be able to avoid this"))
  assert "unless fn has effects" in hint and "jax.lax.scan over that axis" in hint


def test_a_size_needed_as_a_constant_gets_advice_and_unknown_failures_get_none():
  from dynjax.jit._guards import trace_failure_hint

  f = dynjax.jit(lambda x: x * int(x.shape[1]), dims={"x": "b, t"})
  with pytest.warns(UserWarning, match=r"used in a context that requires a constant.*; the "
                    r"function uses a dynamic size where JAX needs a constant"):
    _assert_same(f(_x(5)), _x(5) * 5)
  assert trace_failure_hint(ValueError("something else")) == ""


def test_a_reshape_after_padding_to_a_multiple_gets_advice_that_works():
  def modded(x):  # pad t to a multiple of 8 as t + (-t % 8): JAX cannot prove 8 divides it
    x = jnp.pad(x, ((0, -x.shape[0] % 8), (0, 0)))
    return x.reshape(-1, 8, x.shape[1]).sum(axis=1)

  def advised(x):  # the advice: -(-t // 8) * 8
    t = x.shape[0]
    x = jnp.pad(x, ((0, -(-t // 8) * 8 - t), (0, 0)))
    return x.reshape(-1, 8, x.shape[1]).sum(axis=1)

  def odd(x):  # padded to a multiple of 4, reshaped by 8: divisible only at some lengths
    x = jnp.pad(x, ((0, -x.shape[0] % 4), (0, 0)))
    return x.reshape(-1, 8, x.shape[1]).sum(axis=1)

  x = np.random.default_rng(0).normal(size=(21, 3)).astype(np.float32)
  f = dynjax.jit(odd, dims={"x": "t, 3"})
  with pytest.warns(UserWarning, match=r"Cannot divide evenly.*padded to -\(-t // k\) \* k"):
    _assert_same(f(x), jax.jit(odd)(x))
  # Since session 26 the remainder that JAX cannot prove 0 is checked at every size
  # (jit/_facts.py), so t + (-t % 8) pads too.
  m = dynjax.jit(modded, dims={"x": "t, 3"}, on_fallback="error")
  for t in (3, 16, 21):
    np.testing.assert_allclose(m(x[:t]), jax.jit(modded)(x[:t]), rtol=1e-6, atol=1e-6)
  g = dynjax.jit(advised, dims={"x": "t, 3"}, on_fallback="error")
  for t in (3, 16, 21):
    np.testing.assert_allclose(g(x[:t]), jax.jit(advised)(x[:t]), rtol=1e-6, atol=1e-6)


_TABLE = np.arange(64, dtype=np.float32).reshape(16, 4)  # a constant table built with NumPy


@pytest.mark.parametrize("body", [
    lambda x: x + _TABLE[: x.shape[0]],  # openai/whisper's sinusoids(n, d)[: x.shape[1]]
    lambda x: x + np.ones((x.shape[0], 4), np.float32),
    lambda x: x + np.arange(x.shape[0])[:, None],  # fails inside jax: a tracer's bool
    lambda x: x + sum(x[i] for i in range(x.shape[0])),
], ids=["numpy_table_sliced", "np_ones", "np_arange", "range"])
def test_a_size_given_to_numpy_or_python_names_the_line_and_says_what_to_do(body):
  # Session 24: these fell back with JAX's bare message ("slice indices must be integers or
  # None or have an __index__ method"; a TracerBoolConversionError for np.arange), no line.
  f = dynjax.jit(body, dims={"x": "t, 4"}, buckets={"t": [8, 16]})
  with pytest.warns(UserWarning, match="running unpadded"):
    out = f(np.ones((5, 4), np.float32))
  np.testing.assert_allclose(out, body(np.ones((5, 4), np.float32)), rtol=1e-6)
  (reason,) = f.stats()["fallbacks"]
  assert f" at {__file__}:" in reason, reason  # the user's line, not jax's or numpy's
  assert "NumPy cannot make an array of a symbolic size" in reason, reason
  assert "jnp.asarray(table)[:t]" in reason and "lax.fori_loop" in reason


TABLE = jnp.arange(20.0)


def plus_table(x):  # a static table sliced by the length: TABLE[:t] is min(20, t) long
  return x + TABLE[: x.shape[0]]


def test_a_static_table_sliced_by_the_length_is_a_guard_and_its_size_a_bucket(compiles):
  # HF Flax GPT-2, OPT, LLaMA, Mistral, Gemma, BART: causal_mask[:, :, :t, :t] of a
  # max_positions mask, broadcast against the [b, 1, 1, t] padding mask.  JAX types the slice
  # min(c, t) and refuses the broadcast: every such model fell back to one compile per shape.
  f = dynjax.jit(plus_table, dims={"x": "t"}, buckets={"t": dynjax.buckets.pow2(min=4)},
                 on_fallback="error")
  xs = [np.random.default_rng(t).normal(size=t).astype(np.float32) for t in (3, 8, 13, 17, 20)]
  wants = [jax.jit(plus_table)(x) for x in xs]
  before = compiles()
  for x, want in zip(xs, wants, strict=True):  # buckets 4, 8, 16, 20 (not pow2's 32: the table)
    _assert_same(f(x), want)
  assert compiles() - before == 4 == f.stats()["compiles"]
  st = f.stats()
  assert st["exact_calls"] == 0 and st["fallbacks"] == [] and "t=20" in st["per_bucket_calls"]
  assert f.trace(np.zeros(5, np.float32)).family.guards == ("t <= 20",)
  with pytest.raises(dynjax.PaddingFallbackError, match=r"t = 21 violate the guard\(s\) t <= 20"):
    f(np.zeros(21, np.float32))
  g = dynjax.jit(plus_table, dims={"x": "t"})
  with pytest.warns(UserWarning, match=r"violate the guard\(s\) t <= 20"):
    with pytest.raises(TypeError, match="incompatible shapes"):  # as jax.jit raises it
      g(np.zeros(21, np.float32))


MAX_POS = 24


def gpt2_style_attention(x, attention_mask):
  # modeling_flax_gpt2.py's FlaxGPT2Attention: the causal mask made once for max_positions
  import flax.linen as nn

  causal_mask = nn.make_causal_mask(jnp.ones((1, MAX_POS), dtype="bool"), dtype="bool")
  b, t = attention_mask.shape
  causal_mask = causal_mask[:, :, :t, :t]
  causal_mask = jnp.broadcast_to(causal_mask, (b,) + causal_mask.shape[1:])
  attention_mask = jnp.broadcast_to(jnp.expand_dims(attention_mask, axis=(-3, -2)),
                                    causal_mask.shape)
  mask = nn.combine_masks(attention_mask, causal_mask)
  s = jnp.einsum("bqd,bkd->bqk", x, x)[:, None]
  s = lax.select(mask > 0, s, jnp.full(s.shape, jnp.finfo(s.dtype).min, s.dtype))
  return jnp.einsum("bhqk,bkd->bqd", jax.nn.softmax(s, axis=-1), x)


def test_a_gpt2_causal_mask_is_bucketed_up_to_max_positions(compiles):
  pytest.importorskip("flax")
  f = dynjax.jit(gpt2_style_attention, dims={"x": "b, t, 8", "attention_mask": "b, t"},
                 buckets={"b": [2], "t": dynjax.buckets.pow2(min=8, max=64)},
                 on_fallback="error")
  warm = f.warmup(jax.ShapeDtypeStruct((2, 5, 8), jnp.float32),
                  jax.ShapeDtypeStruct((2, 5), jnp.int32))
  assert sorted(b[-1] for b in warm["buckets"]) == [8, 16, 24]  # 32 and 64 stop at 24
  calls = []
  for t in (5, 16, 20, 24):
    x = np.random.default_rng(t).normal(size=(2, t, 8)).astype(np.float32)
    m = np.ones((2, t), np.int32)
    m[1, t // 2:] = 0
    calls.append((x, m, jax.jit(gpt2_style_attention)(x, m)))
  before = compiles()
  for x, m, want in calls:
    np.testing.assert_allclose(f(x, m), want, rtol=1e-6, atol=1e-6)
  assert compiles() == before  # every call on a warmed-up bucket
  assert f.stats()["fallbacks"] == []


def test_capped_size_reads_min_of_a_constant_only_in_a_clash_of_shapes():
  from dynjax.jit._guards import capped_size

  clash = TypeError("add got incompatible shapes for broadcasting: (t,), (min(100, t),).")
  assert capped_size(clash, ("b", "t")) == ("t", 100)
  assert capped_size(ValueError("Incompatible types: int32[min(t, 64)] vs int32[t]"),
                     ("t",)) == ("t", 64)
  assert capped_size(TypeError(  # HF Flax RoFormer's sinusoidal table, in an einsum
      "dot_general requires lhs batch dimensions and rhs batch dimensions to have the same "
      "shape, got (min(128, t), 8) and (t, 8)."), ("b", "t")) == ("t", 128)
  # speech_ctc's paddings[:, 2::2]: an inconclusive comparison that names min(2, t) is no cap
  other = ValueError("Symbolic dimension comparison 'min(2, t)' >= '1' is inconclusive")
  assert capped_size(other, ("t",)) is None
  assert capped_size(clash, ("b",)) is None  # not one of the family's variables


def test_a_server_builds_no_bucket_past_a_cap():
  # serving=True compiles the bucket that covers the declared range first (t=64 here): past
  # the causal mask's 24 it is the cap's bucket instead, and calls run there
  pytest.importorskip("flax")
  f = dynjax.jit(gpt2_style_attention, dims={"x": "b, t, 8", "attention_mask": "b, t"},
                 buckets={"b": [2], "t": dynjax.buckets.pow2(min=8, max=64)}, serving=True)
  for t in (20, 5, 24):
    x = np.random.default_rng(t).normal(size=(2, t, 8)).astype(np.float32)
    m = np.ones((2, t), np.int32)
    np.testing.assert_allclose(f(x, m), jax.jit(gpt2_style_attention)(x, m), rtol=1e-6,
                               atol=1e-6)
  f.wait()
  buckets = {int(k.split("t=")[1]) for k in f.stats()["per_bucket_calls"]}
  assert max(buckets) == 24, f.stats()["per_bucket_calls"]
