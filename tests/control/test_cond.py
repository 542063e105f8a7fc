"""dynjax.cond: branches of different shapes, traced lowering, NeedsProgram."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
