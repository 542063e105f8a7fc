"""Every user-facing error of dynjax.jit, with its full message."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax


def f2(x, y):
  return x + y


def test_unknown_parameter_in_dims():
  with pytest.raises(dynjax.SpecError) as e:
    dynjax.jit(f2, dims={"x": "t", "z": "t"})
  assert str(e.value) == ("dims names ['z'], which are not parameters of f2; its parameters "
                          "are ['x', 'y']")


def test_unknown_variable_in_buckets():
  with pytest.raises(dynjax.SpecError) as e:
    dynjax.jit(f2, dims={"x": "b, t"}, buckets={"q": [4]})
  assert str(e.value) == ("buckets names ['q'], which are not dimension variables of dims; "
                          "the variables are ['b', 't']")


def test_bad_option_values():
  with pytest.raises(dynjax.SpecError) as e:
    dynjax.jit(f2, padding="sometimes")
  assert str(e.value) == "padding='sometimes' is not valid; use one of 'auto', 'trust', 'exact'"
  with pytest.raises(dynjax.SpecError) as e:
    dynjax.jit(f2, overflow="wrap")
  assert str(e.value) == "overflow='wrap' is not valid; use one of 'error', 'exact', 'grow'"
  with pytest.raises(dynjax.SpecError, match=r"static_argnames: \['k'\] are not parameters"):
    dynjax.jit(f2, static_argnames="k")
  with pytest.raises(dynjax.SpecError, match="must be a positive integer"):
    dynjax.jit(f2, max_executables=0)


def test_bad_spec_string():
  with pytest.raises(dynjax.SpecError, match=r"dims\['x'\] = 'b, t,,' does not parse"):
    dynjax.jit(f2, dims={"x": "b, t,,", "y": "b, t"})  # at jit(), before any call


def test_wrong_rank():
  f = dynjax.jit(f2, dims={"x": "b, t", "y": "b, t"}, padding="trust")
  with pytest.raises(dynjax.ShapeMismatchError) as e:
    f(np.ones((2, 3, 4), np.float32), np.ones((2, 3), np.float32))
  assert str(e.value) == (
      "dims do not match the arguments' ranks:\n"
      "  x: spec 'b, t' has 2 axes but the argument has rank 3\n"
      "Give one name or size per axis in each spec.")


def test_wrong_static_dim_and_inconsistent_variable_listed_together():
  f = dynjax.jit(f2, dims={"x": "b, t, 4", "y": "b, t, 4"}, padding="trust")
  f(np.ones((2, 3, 4), np.float32), np.ones((2, 3, 4), np.float32))
  with pytest.raises(dynjax.ShapeMismatchError) as e:
    f(np.ones((2, 3, 5), np.float32), np.ones((2, 7, 4), np.float32))
  assert str(e.value) == (
      "arguments do not match the declared dims:\n"
      "  dimension variable 't' must have one size but got [3, 7]: x.shape[1]=3, y.shape[1]=7\n"
      "  x.shape[2]: expected 4 = 4 (spec 'b, t, 4'), got 5\n"
      "Pass arrays whose shapes follow the specs, or change dims=.")


def test_dtype_change_is_a_new_family_not_an_error():
  f = dynjax.jit(f2, dims={"x": "t", "y": "t"}, padding="trust")
  f(np.ones(3, np.float32), np.ones(3, np.float32))
  out = f(np.arange(3, dtype=np.int32), np.ones(3, np.float32))
  want = jax.jit(f2)(np.arange(3, dtype=np.int32), np.ones(3, np.float32))
  assert out.dtype == want.dtype
  np.testing.assert_array_equal(out, want)
  assert issubclass(dynjax.DtypeMismatchError, TypeError)  # still importable, no longer raised


def test_out_of_buckets_is_value_error():
  f = dynjax.jit(f2, dims={"x": "t", "y": "t"}, buckets=[4, 8], padding="trust")
  with pytest.raises(ValueError, match=r"t = 9 \(x.shape\[0\], y.shape\[0\]\) is above"):
    f(np.ones(9, np.float32), np.ones(9, np.float32))


def test_pytree_spec_mismatch():
  f = dynjax.jit(lambda batch: batch["a"], dims={"batch": "b, t"})
  with pytest.raises(dynjax.SpecError) as e:
    f({"a": np.ones((2, 3)), "b": np.ones((2, 3))})
  assert str(e.value) == ("dims['batch'] = 'b, t' is one spec, but argument 'batch' is a pytree "
                          "with 2 leaves; give a pytree of specs matching it")


def test_variable_never_alone():
  f = dynjax.jit(lambda x: x, dims={"x": "2*t"})
  with pytest.raises(dynjax.SpecError, match=r"variable\(s\) \['t'\] never appear alone"):
    f(np.ones(4))


def test_unhashable_static_arg():
  f = dynjax.jit(lambda x, k: x, dims={"x": "t"}, static_argnames="k")
  with pytest.raises(dynjax.SpecError, match=r"static arguments \['k'\] must be hashable"):
    f(np.ones(3), [1, 2])


def test_static_argnums_into_varargs_says_what_to_do():
  with pytest.raises(dynjax.SpecError, match=r"static_argnums=1: position 1 of <lambda> falls "
                     r"in its \*args \(its named positional parameters are \['x'\]\)"):
    dynjax.jit(lambda x, *args: args, static_argnums=1)
  with pytest.raises(dynjax.SpecError, match=r"donate_argnames: \['y'\] are not parameters"):
    dynjax.jit(lambda x, **kw: x, donate_argnames="y")


def test_wrong_call_signature():
  f = dynjax.jit(f2, dims={"x": "t"})
  with pytest.raises(TypeError, match=r"f2\(\): missing a required argument: 'y'"):
    f(np.ones(3))


def test_check_mode_detects_a_pad_unsafe_function():
  # "trust" on a function that is NOT pad-safe: check=True catches it instead of a wrong result.
  f = dynjax.jit(lambda x: x - x.mean(), dims={"x": "t"}, padding="trust", check=True)
  with pytest.raises(dynjax.PaddingMismatchError) as e:
    f(np.arange(5, dtype=np.float32))
  assert "output 0 of the padded executable differs from the exact-shape function" in str(e.value)
  assert isinstance(e.value, AssertionError)


def test_check_mode_passes_on_a_pad_safe_function():
  f = dynjax.jit(lambda x: jnp.exp(x), dims={"x": "t"}, padding="trust", check=True)
  np.testing.assert_allclose(f(np.arange(5, dtype=np.float32)), np.exp(np.arange(5)), rtol=1e-6)


def test_messages_name_arguments_in_parameter_order():
  # Parameter order (x, a) differs from alphabetical order: paths must follow the leaves.
  f = dynjax.jit(lambda x, a: x + a, dims={"x": "t, 3", "a": "t, 3"}, padding="trust")
  with pytest.raises(dynjax.ShapeMismatchError) as e:
    f(np.ones((2, 4), np.float32), np.ones((2, 3), np.float32))
  assert "  x.shape[1]: expected 3 = 3 (spec 't, 3'), got 4\n" in str(e.value)
