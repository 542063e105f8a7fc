"""dynjax.cond: branches of different shapes, traced lowering, NeedsProgram."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
import dynjax.control as dc
from dynjax.runtime import collect_stats


def test_shape_changing_branches():
  x = jnp.arange(6.0)
  with collect_stats() as s:
    a = dc.cond(x.sum() > 3, lambda v: v[:2], lambda v: v, x)
  assert a.shape == (2,) and s.host_syncs == 1
  b = dc.cond(x.sum() > 100, lambda v: v[:2], lambda v: (v, v * 2), x)
  assert isinstance(b, tuple) and b[1].shape == (6,)
  np.testing.assert_array_equal(b[1], np.arange(6.0) * 2)


def test_python_bool_pred_needs_no_sync():
  with collect_stats() as s:
    out = dc.cond(True, lambda a, b: a + b, lambda a, b: a, jnp.ones(2), jnp.ones(2))
  assert s.host_syncs == 0
  np.testing.assert_array_equal(out, [2.0, 2.0])


def test_traced_same_shapes_lowers_to_lax_cond():
  f = jax.jit(lambda p, v: dc.cond(p, lambda v: v + 1, lambda v: v * 2, v))
  np.testing.assert_array_equal(f(False, jnp.ones(3)), [2.0, 2.0, 2.0])


def test_traced_different_shapes_needs_program():
  f = jax.jit(lambda p, v: dc.cond(p, lambda v: v[:1], lambda v: v, v))
  f32 = jnp.ones(3).dtype.name  # float64 with x64 on
  with pytest.raises(dc.NeedsProgram, match=r"its branches return different shapes \(output "
                     rf"leaf 0: {f32}\[1\] vs {f32}\[3\]\)"):
    f(True, jnp.ones(3))


def test_cond_inside_run_in_program():
  def fun(x):
    y = dc.cond(x.sum() > 0, lambda v: jnp.concatenate([v, v]), lambda v: v, x)
    return y * 2
  assert dc.run_in_program(fun, (jnp.ones(2),)).shape == (4,)


def test_a_staged_cond_whose_branch_may_be_empty_is_exact():
  # One branch returns x[:0]: the output's dim may be 0, which JAX's dim variables (>= 1)
  # cannot be.  Before, code after the cond read the empty output as one entry (the max of
  # y[-1:] came back 0.0 where JAX gives the initial -5.0).
  import dynjax

  def f(x, p):
    y = dc.cond(p > 0, lambda x: x * 2, lambda x: x[:0], x)
    return jnp.max(y[-1:], initial=-5.0), y.sum(), y.shape[0] + jnp.zeros((), jnp.int32)

  g = dynjax.jit(f, dims={"x": "t"})
  for t in (5, 20):
    x = np.arange(t, dtype=np.float32)
    for p in (1, 0, 1):
      got = g(x, np.int32(p))
      y = x * 2 if p else x[:0]
      assert [float(a) for a in got] == [float(jnp.max(y[-1:], initial=-5.0)),
                                         float(y.sum()), float(y.shape[0])]
  assert g.stats()["programs"][0]["compiled"]


# -- session 29: conds inside dynjax.jit that a cond fuzzer broke ---------------------------
def _py_cond(pred, t, f, v):  # the reference: Python's if on the concrete predicate
  return t(v) if bool(pred) else f(v)


def _same(got, want):
  for g, w in zip(got, want, strict=True):
    assert np.shape(g) == np.shape(w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_a_cond_used_only_for_its_result_shape_is_kept():
  # z's values are dead, its length is read: the program dropped the cond as dead code and
  # the segment that reads z.shape[0] raised KeyError('_dj0').
  def make(cond):
    def f(x):
      z = cond(jnp.sum(x) > 4.8, lambda v: v, lambda v: v[1:][-2:] * 2, x[::-1] + 1)
      return jnp.asarray(z.shape[0], jnp.float32) + jnp.sum(x)
    return f

  g = dynjax.jit(make(dc.cond), dims={"x": "n"})
  for n in (8, 3, 1):
    x = np.arange(float(n), dtype=np.float32)
    _same([g(x)], [make(_py_cond)(jnp.asarray(x))])


def test_sizes_outside_the_guards_of_a_program_run_op_by_op():
  # v[1:][::-1] makes the family trace under n >= 2 (jax asks min(n, 3) - 1 >= 1); the
  # program shares that scope but ran n = 1 anyway (a bucket of 0: ValueError).
  def make(cond):
    def f(x):
      z = cond(jnp.sum(x[:3]) > 8.0, lambda v: v[::2][-2:] * 2, lambda v: v[1:][::-1] + 1,
               x[:3])
      w = z[::2]
      return jnp.concatenate([w, w])
    return f

  g = dynjax.jit(make(dc.cond), dims={"x": "n"})
  _same([g(np.ones(5, np.float32))], [make(_py_cond)(jnp.ones(5))])
  with pytest.warns(UserWarning, match=r"sizes n = 1 violate the guard\(s\) n >= 2"):
    _same([g(np.ones(1, np.float32))], [make(_py_cond)(jnp.ones(1))])
  prog = g.stats()["programs"][0]
  assert prog["compiled"] and prog["runs_outside_guards"] == 1, prog


def test_a_cond_whose_branches_part_only_at_size_zero_runs_op_by_op_there():
  # Symbolically both branches give n (a lax.cond: no program); at n = 0 the second gives 1,
  # so the exact-shape jax.jit raised NeedsProgram.  Such a call now runs op by op.
  def make(cond):
    def f(x):
      z = cond(jnp.sum(x) > -2.0, jnp.sort,
               lambda v: jnp.pad(v[:-1], (1, 0), constant_values=3.0), x)
      return z, jnp.sum(z)
    return f

  g = dynjax.jit(make(dc.cond), dims={"x": "n"})
  for n in (0, 3, 0):
    for sign in (1.0, -1.0):
      x = sign * np.ones(n, np.float32)
      _same(g(x), make(_py_cond)(jnp.asarray(x)))
