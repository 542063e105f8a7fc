"""Edge cases of the control VM: all-shared cell groups, a loop's bucket max, user errors."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
import dynjax.control as dc
from dynjax._errors import ControlFlowError, OutOfBucketsError
from tests.control._reference import jit_loop


# -- a cell group whose every argument is shared -------------------------------------------
@dc.cell
def _leaf(x):
  return jnp.tanh(x)


@dc.cell
def _combine(a, b):
  return jnp.tanh(a + b)


@dc.recursive
def _tree_sum(node):  # the README's tree_sum
  if isinstance(node, float):
    return _leaf(jnp.float32(node))
  left, right = node
  return _combine(_tree_sum(left), _tree_sum(right))


def test_one_leaf_tree_runs_the_cell_once():
  assert float(np.asarray(_tree_sum(1.0))) == pytest.approx(float(np.tanh(1.0)), abs=1e-6)
  assert [float(np.asarray(r)) for r in _tree_sum.batch([(0.5,), (0.5,)])] == pytest.approx(
      [float(np.tanh(0.5))] * 2, abs=1e-6)


def test_sync_right_after_a_single_cell_call():
  @dc.recursive
  def walk(x):
    v = _leaf(x)
    return float(v), bool(v > 0.5)

  x = jnp.float32(0.9)
  assert walk(x) == (pytest.approx(float(np.tanh(0.9)), abs=1e-6), True)


def test_every_leaf_reads_the_same_weights():
  W = jnp.asarray(np.random.RandomState(0).randn(3).astype(np.float32))

  @dc.recursive
  def enc(node):
    if node is None:
      return _leaf(W)
    return _combine(enc(node[0]), enc(node[1]))

  got = np.asarray(enc(((None, None), None)))
  lw = np.tanh(np.asarray(W))
  np.testing.assert_allclose(got, np.tanh(np.tanh(lw + lw) + lw), rtol=1e-6, atol=1e-6)


# -- while_loop honours the bucket policy's max -----------------------------------------------
def _grow_cond(c):
  return jnp.asarray(c.shape[0]) < 300


def _grow_body(c):
  return jnp.concatenate([c, c[-1:] + 1])


def test_while_loop_raises_past_the_bucket_max(compiles):
  with pytest.raises(OutOfBucketsError) as e:
    dc.while_loop(_grow_cond, _grow_body, jnp.zeros(3), buckets=dynjax.buckets.pow2(16, 256))
  assert str(e.value) == (
      "while_loop: a carry dimension grows over the largest bucket:\n"
      "  n0 = 257 (init.shape[0]) is above the largest bucket 256 of "
      "dynjax.buckets.pow2(min=16, max=256)\n"
      "Raise the policy's max (buckets=), or pass overflow=\"grow\" (compile larger buckets) "
      "or overflow=\"exact\" (run the sizes past the max unpadded, one compile per shape).")


def test_while_loop_init_past_the_bucket_max():
  with pytest.raises(OutOfBucketsError, match=r"n0 = 20 \(init\[0\]\.shape\[0\]\) is above "
                     r"the largest bucket 16"):
    dc.while_loop(lambda c: c[1] < 3, lambda c: (jnp.concatenate([c[0], c[0][:1]]), c[1] + 1),
                  (jnp.zeros(20), 0), buckets=[8, 16])


@pytest.mark.parametrize("overflow", ["grow", "exact"])
def test_while_loop_overflow_grow_and_exact(overflow):
  out = dc.while_loop(_grow_cond, _grow_body, jnp.zeros(3), buckets=dynjax.buckets.pow2(16, 256),
                      overflow=overflow)
  np.testing.assert_array_equal(np.asarray(out), np.r_[0, 0, 0, np.arange(1, 298)])
  st = dc.loop_stats()
  if overflow == "grow":
    assert st["buckets"][-1] == (512,)
  else:
    assert max(b for (b,) in st["buckets"]) == 256 and st["exact_iterations"] == 300 - 256


def test_while_loop_overflow_choices_are_checked():
  with pytest.raises(ControlFlowError, match=r"overflow must be one of \['error', 'exact', "
                     r"'grow'\], got 'spill'"):
    dc.while_loop(_grow_cond, _grow_body, jnp.zeros(3), overflow="spill")


@pytest.mark.parametrize("padding", ["auto", "exact"])
def test_while_loop_max_iterations(padding):
  body = lambda c: c + 1  # noqa: E731
  out = dc.while_loop(lambda c: c < 5, body, jnp.int32(0), max_iterations=5, padding=padding)
  assert int(out) == 5
  with pytest.raises(ControlFlowError) as e:
    dc.while_loop(lambda c: c < 50, body, jnp.int32(0), max_iterations=10, padding=padding)
  assert str(e.value) == (
      "while_loop: cond_fun is still true after max_iterations=10 iterations. Raise "
      "max_iterations, or make sure cond_fun becomes false (e.g. bound a step counter).")


@pytest.mark.parametrize("unroll", [1, 3])
def test_while_loop_max_iterations_growing_carry(unroll):
  with pytest.raises(ControlFlowError, match=r"still true after max_iterations=40 "):
    dc.while_loop(_grow_cond, _grow_body, jnp.zeros(3), max_iterations=40, unroll=unroll)
  out = dc.while_loop(_grow_cond, _grow_body, jnp.zeros(3), max_iterations=297, unroll=unroll)
  assert out.shape == (300,) and dc.loop_stats()["iterations"] == 297


def test_overflow_error_inside_jit():
  f = dynjax.jit(lambda x: dc.while_loop(_grow_cond, _grow_body, x * 1.0,
                                         buckets=dynjax.buckets.pow2(16, 256)), dims={"x": "t"})
  with pytest.raises(OutOfBucketsError, match=r"n0 = 257 .* above the largest bucket 256"):
    f(jnp.zeros(3))


# -- user exceptions pass through unchanged ------------------------------------------------
def test_user_exception_in_a_loop_body_passes_through():
  table = {"a": 1}

  def body(c):
    return jnp.concatenate([c, c[:1] * table["missing"]])

  with pytest.raises(KeyError, match="missing") as e:
    dc.while_loop(lambda c: jnp.asarray(c.shape[0]) < 8, body, jnp.ones(1))
  assert type(e.value) is KeyError
  with pytest.raises(KeyError, match="missing"):
    dynjax.jit(lambda x: dc.while_loop(lambda c: jnp.asarray(c.shape[0]) < 8, body, x),
               dims={"x": "t"})(jnp.ones(2))


def test_user_exception_in_a_loop_cond_passes_through():
  def cond(c):
    raise ValueError("my own check failed")

  with pytest.raises(ValueError) as e:
    dc.while_loop(cond, _grow_body, jnp.ones(1))
  assert type(e.value) is ValueError and str(e.value) == "my own check failed"


def test_a_jnp_function_that_compares_a_dim_makes_the_loop_exact_not_an_error():
  # r[2:] has the symbolic dim n - min(n, 2); jnp's r[::-1] then asks whether it is >= 1,
  # which the symbolic trace cannot decide (JAX's, not the user's comparison).  It raised
  # (even with padding="exact"); now the loop runs per exact shape and warns.
  def body(c):
    q, r, i = c
    return q, r[2:][::-1] * 0.5, i + 1

  init = (jnp.arange(3.0), jnp.arange(6.0), jnp.int32(0))
  want = jit_loop(lambda c: c[2] < 3, body, init)
  with pytest.warns(UserWarning, match=r"itself or in a jnp function it calls"):
    got = dc.while_loop(lambda c: c[2] < 3, body, init)
  assert got[1].shape == want[1].shape == (0,) and dc.loop_stats()["mode"] == "exact"
  init = (jnp.arange(3.0), jnp.arange(9.0), jnp.int32(0))  # another shape: the same loop
  want = jit_loop(lambda c: c[2] < 3, body, init)
  got = dc.while_loop(lambda c: c[2] < 3, body, init, padding="exact")  # no warning asked
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_axes_of_one_size_that_change_alike_only_there_get_a_dim_each():
  # q and r start at 4 and both lose 2 a step, as q[:-1][1:] and r[2:]: one step changes
  # them alike, so they shared a dim, whose two next sizes then differed as expressions
  # (- min(n0 - 1, 1) + n0 - 1 vs - min(n0, 2) + n0): raised.  Now each its own dim.
  def body(c):
    q, r, i = c
    return q[:-1][1:], r[2:] + 1.0, i + 1

  init = (jnp.arange(4.0), jnp.arange(4.0), jnp.int32(0))
  cond = lambda c: (jnp.asarray(c[0].shape[0]) < 10) & (c[2] < 12)  # noqa: E731
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init, bucket_from="init")
  assert [g.shape for g in got[:2]] == [w.shape for w in want[:2]] == [(0,), (0,)]
  assert int(got[2]) == int(want[2]) and dc.loop_stats()["mode"] == "hoisted", dc.loop_stats()


def _inner(x):
  return dc.while_loop(lambda c: c.sum() < 20.0, lambda c: jnp.concatenate([c, c[-1:] + 1.0]), x)


def _outer_body(c):
  seq, k = c
  return jnp.concatenate([seq, _inner(seq[-1:] * 0.1)]), k + 1


def test_host_mode_loop_honours_max_iterations_and_the_bucket_max():
  init = (jnp.arange(1.0, 4.0), jnp.int32(0))
  with pytest.raises(ControlFlowError, match=r"still true after max_iterations=2 "):
    dc.while_loop(lambda c: c[1] < 3, _outer_body, init, max_iterations=2)
  assert int(dc.while_loop(lambda c: c[1] < 3, _outer_body, init, max_iterations=3)[1]) == 3
  assert dc.loop_stats()["mode"] == "host"
  with pytest.raises(OutOfBucketsError, match=r"n0 = \d+ \(init\[0\]\.shape\[0\]\) is above "
                     r"the largest bucket 8 "):
    dc.while_loop(lambda c: c[1] < 3, _outer_body, init, buckets=dynjax.buckets.pow2(4, 8))


def test_a_cond_that_ignores_the_carry():
  # cond_fun returning a constant: its jaxpr's output is a literal (no equation produced it)
  grow = lambda x: jnp.concatenate([x, x[:1]])  # noqa: E731
  out = dynjax.while_loop(lambda x: False, grow, jnp.ones(1))
  np.testing.assert_array_equal(out, np.ones(1))
  for cond in (lambda x: True, lambda x: jnp.asarray(True)):
    with pytest.raises(dynjax.ControlFlowError, match="still true after max_iterations=5"):
      dynjax.while_loop(cond, grow, jnp.ones(1), max_iterations=5, overflow="grow")


# -- per-call scalars that are not int32 ---------------------------------------------------
_SCALARS_CODE = """
import jax, jax.numpy as jnp, numpy as np
import dynjax.control as dc

@dc.cell
def emb(tok, flip, w):
  v = w[tok % w.shape[0]] * (tok // w.shape[0] + 1).astype(w.dtype)
  return jnp.where(flip, -v, v), tok

@dc.cell
def join(a, b):
  return jnp.tanh(a[0] + b[0]), a[1] + b[1]

W = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 10

@dc.recursive
def enc(node, w):
  if isinstance(node, tuple):
    return join(enc(node[0], w), enc(node[1], w))
  return emb(node, node % 3 == 0, w)

def per_node(node):
  if isinstance(node, tuple):
    (a, s), (b, t) = per_node(node[0]), per_node(node[1])
    return np.tanh(a + b), s + t
  w = np.asarray(W)
  v = w[node % 4] * np.float32(node // 4 + 1)
  return (-v if node % 3 == 0 else v), node

def check(trees, stacked):
  out = enc.batch([(t, W) for t in trees])
  text = enc.last_programs[0].as_text()
  assert ("item" in text) == stacked, text[:3000]
  for (h, s), t in zip(out, trees):
    want_h, want_s = per_node(t)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-6, atol=1e-6)
    assert int(s) == want_s and s.dtype == jnp.asarray(0).dtype, (s, want_s, s.dtype)

small = [((1, 2), (3, (5, 6))), (7, 8), ((9, 10), 11)]
check(small, stacked=False)  # ints and bools ride in the ids array
big = 2**40
check([((big + 1, 2), 3), (4, big)], stacked={x64})  # past int32: stacked per item under x64

# fold: the same per-node rows given as arrays (numpy's default int: int64)
@dc.cell
def leaf(w, tok, flip):
  return emb(tok, flip, w)

@dc.cell
def node2(w, tok, flip, a_h, a_s, b_h, b_s):
  return join((a_h, a_s), (b_h, b_s))

def kids(tree):  # tree: the children [n, 2] (-1: none) and the tokens [n]; root = last node
  return tree[0]

f = dc.fold({0: leaf, 2: node2}, children=kids, inputs=lambda t: (t[1], t[1] % 3 == 0),
            root=lambda t: len(t[1]) - 1)
for toks in (np.arange(1, 6), np.array([big + 1, 2, 3, 4, big])):
  tree = (np.array([[-1, -1], [-1, -1], [-1, -1], [0, 1], [3, 2]]), toks)
  h, s = f(tree, W)
  want_h, want_s = per_node(((int(toks[0]), int(toks[1])), int(toks[2])))
  np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-6, atol=1e-6)
  assert int(s) == want_s, (s, want_s)
  text = f.last_programs[0].as_text()
  assert ("item" in text) == (toks.max() > 2**31), text[:3000]
print("ok")
"""


@pytest.mark.parametrize("x64", [False, True])
def test_python_scalars_ride_in_the_ids_array_and_big_ones_are_stacked(x64):
  # A recursion's per-call Python ints and bools: ints are int32 without x64 and int64 with it,
  # bools are bools.  Those that fit in int32 ride in the group's int32 ids array and are cast
  # back in the step (before, an int64 or bool was stacked per item: one more transfer a
  # group); an int past int32's range (x64 only) is stacked per item.  fold's per-node rows
  # (numpy int64 and bool arrays) likewise.  Values and dtypes equal the per-node
  # computation either way.  A process of its own: x64 is process-wide.
  import os
  import subprocess
  import sys

  code = _SCALARS_CODE.replace("{x64}", str(x64))
  if not x64:
    code = code.replace("big = 2**40", "big = 2**20")  # an int32 Python int: rides
  env = {**os.environ, "JAX_ENABLE_X64": "1" if x64 else "0", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=180, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_carry_shrunk_to_nothing_while_the_loop_goes_on_is_exact():
  # The queue is empty after 3 steps but the counter runs to 5: JAX shapes q[1:] of an
  # empty q as 0 entries, dynjax's trace (dims >= 1) as n - 1 = -1.  Before, the loop came
  # back with 13 entries of garbage; now the hoisted loop stops at the emptied queue and
  # the rest runs exact, and loop_stats() says so.
  def body(c):
    q, i, acc = c
    return q[1:] * 2, i + 1, acc + jnp.max(q[-1:], initial=-5.0)

  def cond(c):
    return c[1] < 5

  init = (jnp.arange(3.0), jnp.int32(0), jnp.float32(0))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init, bucket_from="init", unroll=1)
  assert got[0].shape == (0,) and int(got[1]) == 5 and float(got[2]) == float(want[2])
  st = dc.loop_stats()
  assert st["mode"] == "hoisted" and st["fallback"].startswith(
      "a shrinking carry dim reached n0 = 0: the rest ran exact"), st
  assert st["exact_iterations"] == 2, st


def test_draining_a_queue_to_empty_is_exact():
  def body(c):
    q, total = c
    return q[1:], total + q[0]

  def cond(c):
    return jnp.asarray(c[0].shape[0]) > 0

  got = dc.while_loop(cond, body, (jnp.arange(7.0), jnp.float32(0)), bucket_from="init",
                      unroll=1)
  assert got[0].shape == (0,) and float(got[1]) == 21.0
  st = dc.loop_stats()
  assert st["iterations"] == 7 and st["exact_iterations"] == 0, st  # the cond alone, exact


def test_a_drained_queue_at_exactly_max_iterations_does_not_raise():
  # The hoisted loop stops at the emptied queue; its pred there is the exact loop's, and so
  # is the budget's check (three body runs drain three entries: within max_iterations=3).
  def body(c):
    return c[0][1:], c[1] + c[0][0]

  def cond(c):
    return jnp.asarray(c[0].shape[0]) > 0

  init = (jnp.arange(3.0), jnp.float32(0))
  got = dc.while_loop(cond, body, init, max_iterations=3, bucket_from="init", unroll=1)
  assert got[0].shape == (0,) and float(got[1]) == 3.0
  with pytest.raises(ControlFlowError, match="max_iterations=2"):
    dc.while_loop(cond, body, init, max_iterations=2, bucket_from="init", unroll=1)


# -- a carry emptied where the loop runs on padded values ------------------------------------
def _shrink_body(c):
  q, i, acc = c
  return q[1:] * 2, i + 1, acc + jnp.max(q[-1:], initial=-5.0)


def _five_steps(c):
  return c[1] < 5


def test_a_loop_staged_in_a_program_that_empties_its_carry_runs_the_call_exact():
  # A loop inside dynjax.jit cannot leave its program.  Before, the staged loop went on past
  # the emptied queue: q came back with 14 entries of garbage and acc 14.0 where JAX gives
  # 0 entries and 4.0.  Now the loop stops there and the call runs op by op, once; a call
  # whose queue stays non-empty still runs compiled.
  @dynjax.jit(dims={"x": "n"})
  def f(x):
    q, _, acc = dc.while_loop(_five_steps, _shrink_body, (x * 1.0, jnp.int32(0),
                                                          jnp.float32(0)))
    return q, acc, jnp.sum(q)

  for n in (7, 3, 4, 9):
    x = np.arange(float(n), dtype=np.float32)
    want = jit_loop(_five_steps, _shrink_body, (jnp.asarray(x), jnp.int32(0),
                                                 jnp.float32(0)))
    q, acc, total = f(x)
    assert q.shape == want[0].shape, n
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want[0]))
    assert float(acc) == float(want[2]) and float(total) == float(jnp.sum(want[0])), n
  prog = f.stats()["programs"][0]
  assert prog["compiled"] and prog["runs"] == 4, prog
  assert prog["runs_with_an_emptied_carry"] == 2, prog  # n = 3 and 4
  assert dc.program_runs()["last_reason"].startswith(
      "while_loop staged in a program: a shrinking carry dim reached _dj0 = 0"), \
      dc.program_runs()


def _grow_to_four(r):
  return jnp.concatenate([r, r[:1]])


def _below_four(r):
  return jnp.asarray(r.shape[0]) < 4


def _host_body(c):  # an inner shape-changing loop: the outer loop runs in host mode
  q, i, acc = c
  r = dc.while_loop(_below_four, _grow_to_four, jnp.ones(1) + jnp.sum(q))
  return q[1:] * 2, i + 1, acc + jnp.max(q[-1:], initial=-5.0) + jnp.sum(r)


def _exact_host_body(c):  # the same step with the inner loop as a Python loop
  q, i, acc = c
  r = jnp.ones(1) + jnp.sum(q)
  while r.shape[0] < 4:
    r = _grow_to_four(r)
  return q[1:] * 2, i + 1, acc + jnp.max(q[-1:], initial=-5.0) + jnp.sum(r)


def test_a_host_mode_loop_that_empties_its_carry_goes_on_exact():
  # Before: 14 entries and acc 102.0 where JAX gives 0 and 92.0.  Now the host loop stops
  # at the emptied queue (the step that emptied it ran on a size >= 1: its carry is exact)
  # and runs the rest eagerly.
  init = (jnp.arange(3.0), jnp.int32(0), jnp.float32(0))
  want = jit_loop(_five_steps, _exact_host_body, init)
  got = dc.while_loop(_five_steps, _host_body, init)
  st = dc.loop_stats()
  assert got[0].shape == (0,) and float(got[2]) == float(want[2]), (got, want)
  assert st["mode"] == "host_eager" and st["iterations"] == 5, st
  assert st["fallback"].startswith("while_loop in host mode: a shrinking carry dim reached"), st
  init = (jnp.arange(7.0), jnp.int32(0), jnp.float32(0))  # never empty: stays in host mode
  want = jit_loop(_five_steps, _exact_host_body, init)
  got = dc.while_loop(_five_steps, _host_body, init)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert float(got[2]) == float(want[2]) and dc.loop_stats()["mode"] == "host", dc.loop_stats()


def _drop_one(c):
  q, j = c
  return q[1:], j + 1


def _three_steps(c):
  return c[1] < 3


def _draining_outer_body(c):  # an inner loop that may empty its own carry, in a host-mode body
  x, i, acc = c
  q, _ = dc.while_loop(_three_steps, _drop_one, (x, jnp.int32(0)))
  return jnp.concatenate([x, x[:1]]), i + 1, acc + jnp.sum(q) + jnp.max(q[-1:], initial=-7.0)


def _exact_draining_outer_body(c):
  x, i, acc = c
  q, _ = jit_loop(_three_steps, _drop_one, (x, jnp.int32(0)))
  return jnp.concatenate([x, x[:1]]), i + 1, acc + jnp.sum(q) + jnp.max(q[-1:], initial=-7.0)


@pytest.mark.parametrize("n", [1, 2])
def test_an_inner_loop_emptied_inside_a_host_mode_body_is_exact(n):
  init = (jnp.arange(1.0, n + 1.0), jnp.int32(0), jnp.float32(0))
  want = init
  while bool(_three_steps(want)):  # (the step holds a jit_loop: not jitted itself)
    want = _exact_draining_outer_body(want)
  got = dc.while_loop(_three_steps, _draining_outer_body, init)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert float(got[2]) == float(want[2]), (got, want)
  assert dc.loop_stats()["fallback"].startswith("while_loop staged in a program"), \
      dc.loop_stats()


def _pop_into(c):  # a queue drained in host mode: each step also runs a growing inner loop
  q, total = c
  r = dc.while_loop(_below_four, _grow_to_four, q[:1])
  return q[1:], total + jnp.sum(r)


def _queue_left(c):
  return jnp.asarray(c[0].shape[0]) > 0


def test_a_queue_drained_in_host_mode_runs_only_the_last_cond_eagerly():
  got = dc.while_loop(_queue_left, _pop_into, (jnp.arange(1.0, 6.0), jnp.float32(0)))
  st = dc.loop_stats()
  assert got[0].shape == (0,) and float(got[1]) == 4 * 15.0, got
  assert st["mode"] == "host_eager" and st["iterations"] == 5, st
  assert len(st["buckets"]) == 5, st  # the start and 4 steps padded; the 5th emptied the queue


def test_a_host_loop_staged_in_a_program_that_empties_its_carry_runs_the_call_exact():
  @dynjax.jit(dims={"x": "n"})
  def f(x):
    q, _, acc = dc.while_loop(_five_steps, _host_body, (x * 1.0, jnp.int32(0),
                                                        jnp.float32(0)))
    return q, acc

  for n in (7, 3):
    init = (jnp.arange(float(n)), jnp.int32(0), jnp.float32(0))
    want = jit_loop(_five_steps, _exact_host_body, init)
    q, acc = f(np.arange(float(n), dtype=np.float32))
    assert q.shape == want[0].shape and float(acc) == float(want[2]), (n, q, acc, want)
  prog = f.stats()["programs"][0]
  assert prog["control_ops"] == ["host_loop"] and prog["runs_with_an_emptied_carry"] == 1, prog


def test_a_host_mode_loop_gives_axes_of_one_size_that_part_a_dim_each():
  # q and r start at 2 and change alike in the first step (q[:-1] and r[::2] are both 1):
  # host mode made them one dim, then raised when the body's sizes disagreed (0 vs 1).
  def body(c):
    q, r, i, acc = c
    r = r[::2] + 0.5
    return q[:-1], r, i + 1, acc + jnp.sum(r)

  def host_body(c):
    q, r, i, acc = body(c)
    z = dc.while_loop(_below_four, _grow_to_four, jnp.ones(1))
    return q, r, i, acc + jnp.sum(z) - 4.0

  def cond(c):
    return (jnp.asarray(c[0].shape[0]) < 5) & (c[2] < 4)

  init = (jnp.arange(2.0), jnp.arange(2.0), jnp.int32(0), jnp.float32(0))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, host_body, init)
  assert [g.shape for g in got[:2]] == [w.shape for w in want[:2]] == [(0,), (1,)]
  assert float(got[3]) == float(want[3]) and int(got[2]) == int(want[2])


def _r_grown_by_q(c):  # q starts empty, so the first step keeps r: r looked fixed
  q, r, i = c
  q = jnp.concatenate([q, q[:1] * 0.5 + 1.0])
  r = jnp.concatenate([r, q])
  q = jnp.concatenate([q, jnp.full((2,), i, q.dtype)])
  return q[-3:] * 1.5, r, i + 1


def _r_grown_by_q_host(c):
  q, r, i = _r_grown_by_q(c)
  z = dc.while_loop(_below_four, _grow_to_four, jnp.ones(1))
  return q, r + jnp.sum(z) - 4.0, i


@pytest.mark.parametrize("body", [_r_grown_by_q, _r_grown_by_q_host], ids=["hoisted", "host"])
def test_an_axis_the_first_step_keeps_and_later_steps_change_is_a_dim(body):
  # Host mode raised "body_fun changed fixed carry axes" at the second step; the hoisted
  # loop refused it ("a fixed axis whose new size depends on other dims").
  def cond(c):
    return (jnp.asarray(c[0].shape[0]) < 6) & (c[2] < 5)

  init = (jnp.zeros(0), jnp.arange(3.0), jnp.int32(0))
  want = jit_loop(cond, _r_grown_by_q, init)
  got = dc.while_loop(cond, body, init)
  assert [g.shape for g in got] == [w.shape for w in want] == [(3,), (18,), ()]
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
  assert dc.loop_stats()["mode"] == ("hoisted" if body is _r_grown_by_q else "host")


def _drop_then_refill(c):  # ``if q.shape[0]:``: Python truthiness of a carry dim
  q, i = c
  q = q[1:]
  q = jnp.concatenate([q, q[-1:] * 0.5]) if q.shape[0] else jnp.full((2,), 9.0)
  return q, i + 1


def _drop_then_refill_eq(c):  # the same as an equality
  q, i = c
  q = q[1:]
  q = jnp.full((2,), 9.0) if q.shape[0] == 0 else jnp.concatenate([q, q[-1:] * 0.5])
  return q, i + 1


@pytest.mark.parametrize("body", [_drop_then_refill, _drop_then_refill_eq], ids=["bool", "eq"])
@pytest.mark.parametrize("host", [False, True], ids=["hoisted", "host"])
def test_a_python_test_of_a_carry_dim_the_trace_cannot_decide_makes_the_loop_exact(body, host):
  # JAX answers an undecided d == 0 with False and took bool(d) as True: the loop traced the
  # "non-empty" side at every size.  With one entry left, q[1:] is empty and JAX refills it
  # (9, 9); dynjax's loop came back with garbage.  Now such a loop runs per exact shape.
  def step(c):
    q, i = body(c)
    if host:  # a shape-changing inner loop: the outer loop in host mode
      z = dc.while_loop(_below_four, _grow_to_four, jnp.ones(1))
      q = q + jnp.sum(z) - 4.0
    return q, i

  def cond(c):
    return c[1] < 4

  init = (jnp.arange(1.0, 2.0), jnp.int32(0))
  want = jit_loop(cond, body, init)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    got = dc.while_loop(cond, step, init)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  st = dc.loop_stats()
  if host:
    assert st["mode"] == "host_eager" and "which the symbolic trace cannot decide" in \
        st["fallback"], st
  else:
    assert st["mode"] == "exact" and st["fallback"].startswith("body_fun compares n0 - 1 == 0 at")
    assert any("which the symbolic trace cannot decide" in str(w.message) for w in seen)
