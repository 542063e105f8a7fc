"""dynjax.while_loop: greedy decoding vs exact-shape jax.jit, syncs, errors, nesting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax.control as dc
from dynjax._errors import ControlFlowError
from dynjax.runtime import collect_stats
from examples import decode_lm as D

PARAMS = D.init_lm(D.LMConfig(d=16, heads=2, ffn=32), seed=1)


@jax.jit
def _ref_body(carry, stop):
  tokens, step, done = carry
  nxt = jnp.argmax(D.lm_logits(PARAMS, tokens, 2), axis=-1).astype(tokens.dtype)
  nxt = jnp.where(done, stop, nxt)
  return jnp.concatenate([tokens, nxt[:, None]], axis=1), step + 1, done | (nxt == stop)


def _reference(prompts, max_new, stop):
  """A plain Python loop of exact-shape jax.jit steps (one compile per length, shared)."""
  carry = D.init_carry(prompts)
  while int(carry[1]) < max_new and not bool(np.all(np.asarray(carry[2]))):
    carry = _ref_body(carry, stop)
  return carry


# Prompt lengths and stops chosen so the cases share exact-shape compiles and cross buckets.
@pytest.mark.parametrize("batch,t,max_new,stop_at", [
    (1, 5, 14, None), (1, 5, 14, 4), (2, 9, 10, 3), (1, 12, 2, None)])
def test_greedy_decode_matches_exact_jit(batch, t, max_new, stop_at):
  rng = np.random.default_rng(t)
  prompts = rng.integers(1, 256, size=(batch, t)).astype(np.int32)
  stop = D.STOP
  if stop_at is not None:  # make the stop token the one generated at step stop_at
    ref = _reference(prompts, stop_at + 1, D.STOP)
    stop = int(np.asarray(ref[0])[0, t + stop_at])
  want = _reference(prompts, max_new, stop)
  cond, body = D.make_step(PARAMS, max_new, 2, stop)
  got = dc.while_loop(cond, body, D.init_carry(prompts))
  st = dc.loop_stats()
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert int(got[1]) == int(want[1])
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
  assert st["mode"] == "hoisted"
  assert st["iterations"] == int(want[1])
  # One sync a bucket; off the CPU a loop with a cap starts at the cap's bucket
  # (bucket_from="auto"), which reads the step counter once more (H100 run of the suite).
  extra = st["host_syncs"] - len(st["buckets"])
  assert len(st["buckets"]) == st["buckets_crossed"] + 1, st
  assert extra in ((0,) if jax.default_backend() == "cpu" else (0, 1)), st
  if stop_at is not None and batch == 1:
    assert int(want[1]) <= stop_at + 1 < max_new  # it really stopped early
  if t + max_new > 16 and stop_at is None and jax.default_backend() == "cpu":
    assert st["buckets_crossed"] >= 1  # (off the CPU it starts at the cap's bucket)


def test_zero_iterations():
  x = jnp.arange(5.0)
  out = dc.while_loop(lambda c: c[0] > 100, lambda c: jnp.concatenate([c, c[:1]]), x)
  np.testing.assert_array_equal(out, x)
  st = dc.loop_stats()
  assert st["iterations"] == 0 and st["host_syncs"] == 1


def test_syncs_count_buckets_and_collect_stats():
  with collect_stats() as s:
    out = dc.while_loop(lambda c: jnp.asarray(c.shape[0]) < 40,
                        lambda c: jnp.concatenate([c, c[-1:] + 1]), jnp.zeros(1))
  np.testing.assert_array_equal(out, np.arange(40.0))
  st = dc.loop_stats()
  assert st["buckets"] == [(16,), (32,), (64,)]
  assert s.host_syncs == 3 == st["buckets_crossed"] + 1


def test_exact_mode_equals_hoisted():
  def body(c):
    return jnp.concatenate([c, c[-1:] * 2 + 1])

  cond = lambda c: c[-1] < 1000  # noqa: E731
  a = dc.while_loop(cond, body, jnp.ones(1))
  b = dc.while_loop(cond, body, jnp.ones(1), padding="exact")
  np.testing.assert_array_equal(a, b)
  assert dc.loop_stats()["mode"] == "exact"
  assert dc.loop_stats()["host_syncs"] == a.shape[0]  # one per iteration + 1


def test_nested_loop_inner_shape_invariant():
  def body(c):
    x, = (c,)
    inner = dc.while_loop(lambda s: s[1] < 3, lambda s: (s[0] + 1.0, s[1] + 1),
                          (x[-1], jnp.int32(0)))
    return jnp.concatenate([x, inner[0][None]])

  out = dc.while_loop(lambda c: c[-1] < 10, body, jnp.zeros(1))
  np.testing.assert_array_equal(out, [0.0, 3.0, 6.0, 9.0, 12.0])
  assert dc.loop_stats()["mode"] == "hoisted"


def test_traced_shape_invariant_lowers_to_lax():
  f = jax.jit(lambda x: dc.while_loop(lambda c: c.sum() < 10, lambda c: c + 1, x))
  np.testing.assert_array_equal(f(jnp.zeros(2)), [5.0, 5.0])


def test_traced_shape_changing_needs_program():
  f = jax.jit(lambda x: dc.while_loop(lambda c: c[-1] < 4,
                                      lambda c: jnp.concatenate([c, c[-1:] + 1]), x))
  with pytest.raises(dc.NeedsProgram, match=r"dynjax.while_loop cannot run inside a JAX trace "
                     r"here: its carry changes shape \(init: \(1,\) -> \(2,\)\)"):
    f(jnp.zeros(1))


def test_run_in_program():
  def grow(x):
    return dc.while_loop(lambda c: jnp.asarray(c.shape[0]) < 8,
                         lambda c: jnp.concatenate([c, c]), x * 2)
  assert dc.run_in_program(grow, (jnp.ones(1),)).tolist() == [2.0] * 8


def test_error_data_dependent_shape():
  with pytest.raises(ControlFlowError, match=r"body_fun makes a shape depend on data values "
                     r"\(NonConcreteBooleanIndexError"):
    dc.while_loop(lambda c: c.sum() < 10, lambda c: c[c > 0], jnp.ones(3))


def test_error_dtype_and_rank_change():
  with pytest.raises(ControlFlowError) as e:
    dc.while_loop(lambda c: c[0][0] < 1,
                  lambda c: (c[0].astype(jnp.int32), c[1][None]), (jnp.ones(2), jnp.ones(3)))
  assert str(e.value) == (
      "body_fun changes the carry in ways dims cannot express:\n"
      f"  init[0]: dtype {jnp.ones(2).dtype.name} -> int32\n"  # float64 with x64 on
      "  init[1]: rank 1 -> 2 (shape (3,) -> (1, 3))\n"
      "A carry leaf may change its sizes along axes, but not its dtype or rank: cast the "
      "body's result back (x.astype(init's dtype)), start from an init of the result's dtype, "
      "or keep the rank (index or reshape the new axis away).")


def test_error_shared_dim_changes_differently():
  with pytest.raises(ControlFlowError, match=r"init\[1\].shape\[0\]: t -> 2\*t, but "
                     r"init\[0\].shape\[0\]: t -> t \+ 1; axes sharing a dimension must change "
                     r"alike"):
    dc.while_loop(lambda c: c[0][0] < 1,
                  lambda c: (jnp.concatenate([c[0], c[0][:1]]),
                             jnp.concatenate([c[1], c[1]])),
                  (jnp.ones(3), jnp.ones(3)), dims=("t", "t"))


def test_a_python_shape_comparison_runs_exact_and_says_how_to_pad():
  # The symbolic trace cannot decide c.shape[0] < 8; a loop of exact-shape steps can (it
  # raised before).  The warning teaches the padded form.
  with pytest.warns(UserWarning, match=r"write such a comparison as an array op, e.g. "
                    r"jnp.asarray\(x.shape\[0\]\) < 8(.|\n)*runs per exact carry shape"):
    out = dc.while_loop(lambda c: c.shape[0] < 8, lambda c: jnp.concatenate([c, c]),
                        jnp.ones(1))
  assert out.shape == (8,) and dc.loop_stats()["mode"] == "exact", dc.loop_stats()
  assert dc.loop_stats()["fallback"].startswith("cond_fun compares a dynamic carry dim"), \
      dc.loop_stats()


def test_loop_program_text():
  text = dc.loop_program(lambda c: c[-1] < 5, lambda c: jnp.concatenate([c, c[-1:] + 1]),
                         jnp.zeros(1))
  assert "invoke while.hoisted[%2]" in text and "read %status" in text
  assert text.splitlines()[0] == "program while_loop(%carry0):"
