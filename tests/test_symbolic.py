"""dynjax._symbolic: dims specs, the one dim-expression compiler, solving sizes, messages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import export

from dynjax import _symbolic
from dynjax._errors import ShapeMismatchError, SpecError


def _sig(*specs, constraints=()):
  return _symbolic.build_signature(
      [(path, text, ndim) for path, text, ndim in specs], constraints)


def test_is_symbolic_is_the_one_predicate():
  b, t = export.symbolic_shape("b, t")
  assert _symbolic.is_symbolic(t) and _symbolic.is_symbolic(b * t + 1)
  assert not _symbolic.is_symbolic(3) and not _symbolic.is_symbolic(np.int64(3))
  assert _symbolic.dim_vars_of(2 * t + b) == {"b", "t"}
  assert _symbolic.dim_vars_of("max(t, 3) + floordiv(b, 2)") == {"t", "b"}
  assert _symbolic.vars_of_dims([4, t, "b + 1"]) == {"t", "b"}


@given(b=st.integers(1, 50), t=st.integers(1, 300))
def test_compiled_dims_agree_with_python_for_every_size(b, t):
  sb, st_ = export.symbolic_shape("b, t")
  (mx,) = export.symbolic_shape("max(t, 3)", scope=st_.scope)
  dims = [sb * st_, st_ + 1, 2 * st_ - 1, (st_ + 3) // 4, st_ % 5, mx, 7]
  want = (b * t, t + 1, 2 * t - 1, (t + 3) // 4, t % 5, max(t, 3), 7)
  order = ("b", "t")
  assert _symbolic.compile_shape(tuple(dims), order)((b, t)) == want
  assert _symbolic.dim_fn(dims, order)(b, t) == want
  assert _symbolic.dim_fn([str(d) for d in dims], order)(b, t) == want
  assert _symbolic.shape_fn([dims[:2], (3,)], order)(b, t) == (want[:2], (3,))


def test_device_dim_fn_runs_on_traced_sizes():
  fn = _symbolic.dim_fn(["max(t, 3) + 1", "floordiv(t, 2)"], ("t",), device=True)
  out = jax.jit(lambda t: jnp.stack(fn(t)))(jnp.int32(7))
  np.testing.assert_array_equal(out, [8, 3])
  np.testing.assert_array_equal(jax.jit(lambda t: jnp.stack(fn(t)))(jnp.int32(1)), [4, 0])


def test_an_expression_over_an_unknown_variable_is_refused():
  with pytest.raises(SpecError, match=r"uses 'u', which is not one of the function's "
                                      r"dimension variables \['t'\]"):
    _symbolic.compile_dim(export.symbolic_shape("u")[0] + 1, ("t",))


def test_solve_sizes_and_every_mismatch_listed():
  sig = _sig(("x", "b, t", 2), ("mask", "b, t", 2), ("lengths", "b", 1), ("pos", "t + 1", 1))
  assert sig.var_order == ("b", "t")
  assert _symbolic.solve_sizes(sig, [(2, 5), (2, 5), (2,), (6,)]) == (2, 5)
  with pytest.raises(ShapeMismatchError) as info:
    _symbolic.solve_sizes(sig, [(2, 5), (3, 4), (2,), (9,)])
  msg = str(info.value)
  assert "dimension variable 'b' must have one size but got [2, 3]" in msg
  assert "dimension variable 't' must have one size but got [4, 5]" in msg
  assert "pos.shape[0]: expected t + 1 = 6 (spec 't + 1'), got 9" in msg
  assert msg.endswith("Pass arrays whose shapes follow the specs, or change dims=.")


def test_specs_parse_errors_and_ranks():
  with pytest.raises(SpecError, match=r"dims\[x\]: cannot parse shape spec 'b t'"):
    _sig(("x", "b t", 2))
  with pytest.raises(ShapeMismatchError) as info:
    _sig(("x", "b, t", 3), ("y", "t", 2))
  msg = str(info.value)
  assert "x: spec 'b, t' has 2 axes but the argument has rank 3" in msg
  assert "y: spec 't' has 1 axes but the argument has rank 2" in msg
  with pytest.raises(SpecError, match="are not valid jax.export constraints"):
    _sig(("x", "t", 1), constraints=("t <=",))


def test_constraints_decide_comparisons_and_symbolic_avals_carry_them():
  sig = _sig(("x", "b, t", 2), constraints=("t <= 512", "t >= 3"))
  (aval,) = _symbolic.symbolic_avals(sig, [jax.ShapeDtypeStruct((2, 5), jnp.float32)])
  t = aval.shape[1]
  assert (t >= 3) is True and (t < 600) is True
  out = jax.eval_shape(lambda x: jax.lax.top_k(x, 3)[0], aval)
  assert out.shape[1] == 3
  assert _symbolic.eval_shape_at(sig, (aval.shape[0], t + 1), {"b": 2, "t": 7}) == (2, 8)
