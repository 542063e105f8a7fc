"""Compiled host programs (dynjax.jit of a function with control ops), loop caps and unrolling,
nested shape-changing loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
import dynjax.control as dc
from dynjax._errors import ControlFlowError
from dynjax.runtime import collect_stats
from examples import decode_lm as D

CFG = D.LMConfig(d=16, heads=2, ffn=32)
PARAMS = D.init_lm(CFG, seed=1)
ENC = D.init_encoder(CFG, layers=2, seed=2)
GEN = D.make_encode_generate(PARAMS, ENC, max_new=6, heads=2)


def _prompt(t, seed=0, b=1):
  return np.random.default_rng(seed + t).integers(2, 256, size=(b, t)).astype(np.int32)


def _op_by_op(fun, *args):
  return dc.run_in_program(fun, tuple(jnp.asarray(a) for a in args))


# -- (3) straight-line code between control ops is compiled ---------------------------------
def test_encoder_decode_compiled_equals_op_by_op(compiles):
  f = dynjax.jit(GEN, dims={"prompt": "b, t"}, buckets={"t": dynjax.buckets.pow2(8, 32)})
  counts = []
  for t in (5, 7, 11, 6):
    n0 = compiles()
    got = f(_prompt(t))
    counts.append(compiles() - n0)
    want = _op_by_op(GEN, _prompt(t))
    np.testing.assert_array_equal(got[0], np.asarray(want[0]))
    assert int(got[1]) == int(want[1])
  (prog,) = f.stats()["programs"]
  assert prog["compiled"] and prog["reason"] is None
  assert prog["segments"] == 2 and prog["control_ops"] == ["while_loop"]
  # t=7 and t=6 sit in bucket 8 next to t=5: nothing new compiles.  A new bucket of t (11 ->
  # 16) compiles at most: both segments, the loop's repad from the prompt's bucket to its own
  # and one hoisted loop bucket.
  assert counts[1] == 0 and counts[3] == 0
  assert counts[2] <= 4


def test_float_outputs_match_op_by_op_tightly():
  def fun(x):
    h = jnp.tanh(x @ ENC[0]["w1"][:16, :16])
    h = h - h.mean(axis=1, keepdims=True)  # reduces over the dynamic axis: masked
    out = dc.while_loop(lambda c: jnp.asarray(c.shape[0]) < 40,
                        lambda c: jnp.concatenate([c, jnp.sin(c[-1:]) + 1.0]), h[0, :1])
    return jax.nn.softmax(h, axis=1) * out.sum(), out

  f = dynjax.jit(fun, dims={"x": "b, t, 16"})
  for t in (3, 9):
    x = np.random.default_rng(t).normal(size=(2, t, 16)).astype(np.float32)
    got = f(x)
    want = _op_by_op(fun, x)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, np.asarray(w), rtol=2e-6, atol=2e-6)
  assert f.stats()["programs"][0]["compiled"]


def test_program_text_and_stats():
  f = dynjax.jit(GEN, dims={"prompt": "b, t"})
  f(_prompt(5))
  fam = list(f._dispatcher.all_families.values())[-1]
  text = fam.program.staged.program_text()
  lines = text.splitlines()
  assert lines[0] == "program encode_generate(%in0):"
  assert "  %env = host entry_env(%in0)" in lines
  assert any(" = invoke segment0[" in x for x in lines)
  assert any("%env, " in x and " = call while_loop(%env, " in x for x in lines)
  assert any(" = unpad_to_host " in x for x in lines)
  with collect_stats() as s:
    f(_prompt(6))
  assert s.calls == 1 and s.invokes >= 3 and s.compiles == 0


def test_cond_with_different_branch_shapes_is_staged(compiles):
  def fun(x):
    y = jnp.tanh(x) * 2.0
    z = dc.cond(y.sum() > 0, lambda v: jnp.concatenate([v, v]), lambda v: v[:1], y)
    return z * 3.0 + z.sum()

  f = dynjax.jit(fun, dims={"x": "t"}, buckets={"t": [8, 16]})
  for t, sign in ((3, 1), (3, -1), (5, 1), (6, -1)):
    x = sign * np.arange(1, t + 1, dtype=np.float32)
    with collect_stats() as s:
      got = f(x)
    np.testing.assert_allclose(got, np.asarray(_op_by_op(fun, x)), rtol=1e-6, atol=1e-6)
    assert s.host_syncs == 1  # the predicate
  assert f.stats()["programs"][0]["control_ops"] == ["cond"]
  n0 = compiles()
  f(np.arange(1, 8, dtype=np.float32))  # t=7: same bucket, true branch seen
  assert compiles() - n0 == 0


def test_unstageable_function_runs_op_by_op_and_says_why():
  def fun(x):
    y = jnp.fft.fft(x).real  # no padding rule over the dynamic axis
    return dc.while_loop(lambda c: jnp.asarray(c.shape[0]) < 12,
                         lambda c: jnp.concatenate([c, c[-1:] + 1]), y)

  f = dynjax.jit(fun, dims={"x": "t"})
  x = np.arange(4, dtype=np.float32)
  np.testing.assert_allclose(f(x), np.asarray(_op_by_op(fun, x)), rtol=1e-6)
  (prog,) = f.stats()["programs"]
  assert not prog["compiled"]
  assert prog["reason"].startswith("StagingError: segment 0: the padding pass has no exact "
                                   "rule for 'fft' at ")
  assert dc.program_runs()["last_reason"] == prog["reason"]


# -- (4) loops: the cap from cond, unrolling, one spec for every init shape -------------------
@pytest.mark.parametrize("unroll,bucket_from", [(1, "cap"), (3, "init"), (3, "cap")])
def test_cap_and_unroll_equal_the_plain_loop(unroll, bucket_from):
  cond, body = D.make_step(PARAMS, 20, 2)
  p = _prompt(6, b=2)
  want = dc.while_loop(cond, body, D.init_carry(p), unroll=1, bucket_from="init")
  ref = dc.loop_stats()
  got = dc.while_loop(cond, body, D.init_carry(p), unroll=unroll, bucket_from=bucket_from)
  st = dc.loop_stats()
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  assert st["iterations"] == ref["iterations"] == 20 and st["unroll"] == unroll
  assert ref["buckets"] == [(16,), (32,)]  # 6 -> 26 tokens crosses a bucket
  if bucket_from == "cap":  # 6 + 20 new tokens at most: bucket 32 from the start
    assert st["cap"] == (32,) and st["buckets"] == [(32,)] and st["host_syncs"] == 2


def test_cap_is_read_from_the_cond():
  from dynjax.control import _loop as L
  from dynjax.control import _loopspec as LS

  cond, body = D.make_step(PARAMS, 9, 2)
  init = D.init_carry(_prompt(4))
  leaves, treedef = jax.tree_util.tree_flatten(init)
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  loop = L.get_loop(cond, body, treedef, avals, None, None, "auto", 1, "cap")
  assert loop.spec.cap == LS.Cap(leaf=1, step=1, bound=9, inclusive=False)
  assert loop.spec.cap.iterations(0) == 9 and loop.spec.cap.iterations(9) == 0
  no_cap = L.get_loop(lambda c: c[-1] < 5, lambda c: jnp.concatenate([c, c[-1:] + 1]),
                       jax.tree_util.tree_structure(0), [jax.ShapeDtypeStruct((1,), jnp.float32)],
                       None, None, "auto", 1, "cap")
  assert no_cap.spec.cap is None


def test_one_loop_serves_every_prompt_length(compiles):
  cond, body = D.make_step(PARAMS, 3, 2)
  dc.while_loop(cond, body, D.init_carry(_prompt(5)), bucket_from="init", unroll=1)
  n0 = compiles()
  for t in (6, 7, 9):
    dc.while_loop(cond, body, D.init_carry(_prompt(t)), bucket_from="init", unroll=1)
  assert compiles() - n0 == 0  # same bucket 16: no trace, no compile, host padding


def test_hoisted_body_grows_the_carry_in_place():
  from dynjax.control import _loop as L
  from dynjax.control import _loopspec as LS

  cond, body = D.make_step(PARAMS, 3, 2)
  leaves, treedef = jax.tree_util.tree_flatten(D.init_carry(_prompt(5)))
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  spec = L.get_loop(cond, body, treedef, avals, None, None, "auto", 1, "init").spec
  assert LS.size_max(spec, (16,)) == {"n0": 15}
  args = [*spec.body_consts, *spec.cond_consts, np.asarray([5], np.int32),
          jnp.zeros((1, 16), jnp.int32), leaves[1], leaves[2]]
  text = spec.hoisted.get((16,)).lower(*args).compile().as_text()
  ops = D.while_body_ops(text)
  assert "s32[1,17]" not in text  # t + 1 never gets its own buffer
  assert ops["total"] > 0


def test_loop_option_errors():
  c, b, x = (lambda c: c[0] < 1), (lambda c: c), jnp.ones(1)
  with pytest.raises(ControlFlowError) as e:
    dc.while_loop(c, b, x, unroll=0)
  assert str(e.value) == "unroll must be None (auto) or an int >= 1, got 0"
  with pytest.raises(ControlFlowError) as e:
    dc.while_loop(c, b, x, bucket_from="max")
  assert str(e.value) == ("bucket_from must be one of ['auto', 'cap', 'init'], got 'max'")


# -- (5) nested shape-changing loops ----------------------------------------------------------
def _inner(x):
  return dc.while_loop(lambda c: c.sum() < 20.0,
                       lambda c: jnp.concatenate([c, c[-1:] * 1.5 + 1.0]), x)


def _outer_body(c):
  seq, k = c
  return jnp.concatenate([seq, _inner(seq[-1:] * 0.1) * 2.0]), k + 1


def _outer_cond(c):
  return c[1] < 3


def _nested_reference(seq):
  for _ in range(3):
    x = seq[-1:] * np.float32(0.1)
    while x.sum() < 20.0:
      x = np.concatenate([x, x[-1:] * np.float32(1.5) + np.float32(1.0)])
    seq = np.concatenate([seq, x * np.float32(2.0)])
  return seq


def test_nested_shape_changing_loops_run():
  x0 = np.arange(1, 4, dtype=np.float32)
  with collect_stats() as s:
    got, k = dc.while_loop(_outer_cond, _outer_body, (jnp.asarray(x0), jnp.int32(0)))
  st = dc.loop_stats()
  np.testing.assert_allclose(got, _nested_reference(x0), rtol=1e-6)
  assert int(k) == 3
  assert st["mode"] == "host" and st["iterations"] == 3 and st["inner_loops"] == 3
  assert st["fallback"].startswith("dynjax.while_loop inside while_loop body has no XLA form")
  assert s.host_syncs == st["host_syncs"] == 4 + 3  # outer predicate reads + inner statuses


def test_nested_loops_inside_jit_and_decode():
  f = dynjax.jit(lambda x: dc.while_loop(_outer_cond, _outer_body, (x * 1.0, jnp.int32(0)))[0],
                 dims={"x": "t"})
  for t in (3, 5):
    x = np.arange(1, t + 1, dtype=np.float32)
    np.testing.assert_allclose(f(x), _nested_reference(x), rtol=1e-6)
  assert f.stats()["programs"][0]["control_ops"] == ["host_loop"]
  cond, body = D.make_nested(PARAMS, per_sentence=4, sentences=2, heads=2)
  p = _prompt(5)
  got = dc.while_loop(cond, body, (jnp.asarray(p), jnp.int32(0)))[0]
  want = D.decode_nested_python(PARAMS, p, 4, 2, 2, max_len=32)
  np.testing.assert_array_equal(got, want)


def test_nested_loop_that_cannot_be_staged_runs_eagerly():
  def inner(x):
    return dc.while_loop(lambda c: jnp.asarray(c.shape[0]) < 6,
                         lambda c: jnp.concatenate([c, jnp.fft.fft(c).real[:1]]), x)

  def body(c):
    seq, k = c
    return jnp.concatenate([seq, inner(seq[:2])]), k + 1

  x0 = jnp.arange(1.0, 3.0)
  got, _ = dc.while_loop(lambda c: c[1] < 2, body, (x0, jnp.int32(0)))
  st = dc.loop_stats()
  want = np.asarray(x0)
  for _ in range(2):
    y = want[:2]
    while y.shape[0] < 6:
      y = np.concatenate([y, np.fft.fft(y).real[:1].astype(np.float32)])
    want = np.concatenate([want, y])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert st["mode"] == "host_eager"
  assert "no exact rule for 'fft'" in st["fallback"]


def test_a_call_with_an_empty_dim_runs_op_by_op_and_exact():
  # The staged program's dims are JAX dim variables (>= 1): the loop's body read the empty
  # init's last entry (x[-1:]) as one entry and the result was silently wrong.
  def grow(x):
    return dc.while_loop(
        lambda c: jnp.asarray(c.shape[0]) < 12,
        lambda c: jnp.concatenate([c, jnp.max(c[-1:], keepdims=True, initial=-5.0) + 1]), x)

  def reference(x):
    c = jnp.asarray(x)
    while c.shape[0] < 12:
      c = jnp.concatenate([c, jnp.max(c[-1:], keepdims=True, initial=-5.0) + 1])
    return c

  g = dynjax.jit(grow, dims={"x": "t"})
  for t in (3, 0, 5):
    x = np.arange(t, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(reference(x)))
  (prog,) = g.stats()["programs"]
  assert prog["compiled"] and prog["runs"] == 3 and prog["runs_with_an_empty_dim"] == 1, prog
