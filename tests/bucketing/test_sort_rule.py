"""The padding pass's sort rule: the keys' padded tail set to the value their order puts last
(NaN, an integer's largest, True), sorted stably, instead of a leading "is padding" key.

Valid elements equal to that value (NaNs, INT_MAX, True, a complex with NaN parts) must still
come before the padding, in their stable order: every case below holds them, the padding holds
garbage (NaN, +-inf, huge values), and each output is compared with ``jax.jit`` at the exact
shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dynjax.bucketing._padding import pad_jaxpr
from dynjax.bucketing._padding_rules import sort_last
from tests.bucketing._harness import Case


def _with_ties(rng, shapes, dtypes):
  out = []
  for s, dt in zip(shapes, dtypes, strict=True):
    dt = np.dtype(dt)
    if dt == np.bool_:
      out.append(rng.random(s) < 0.7)
    elif np.issubdtype(dt, np.integer):
      info = np.iinfo(dt)
      out.append(rng.choice(np.array([info.max, info.min, 0, 3, info.max - 1], dt), size=s))
    elif np.issubdtype(dt, np.complexfloating):
      parts = np.array([np.nan, np.inf, -1.0, 0.0, 2.0], np.float32)
      z = np.empty(s, dt)
      z.real, z.imag = rng.choice(parts, size=s), rng.choice(parts, size=s)
      out.append(z)
    else:
      out.append(rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1.5], dt), size=s))
  return out


def _iota_sort(*keys, num_keys):
  """Stable lax.sort of ``keys`` along axis 1 with an iota riding along (the permutation)."""
  idx = lax.broadcasted_iota(jnp.int32, keys[0].shape, 1)
  return lax.sort((*keys, idx), dimension=1, is_stable=True, num_keys=num_keys)


CASES = {
  "float32": ([jnp.float32], lambda x: _iota_sort(x, num_keys=1)),
  "float16": ([jnp.float16], lambda x: _iota_sort(x, num_keys=1)),
  "int32": ([jnp.int32], lambda x: _iota_sort(x, num_keys=1)),
  "uint8": ([jnp.uint8], lambda x: _iota_sort(x, num_keys=1)),
  "bool": ([jnp.bool_], lambda x: _iota_sort(x, num_keys=1)),
  "complex64": ([jnp.complex64], lambda x: _iota_sort(x, num_keys=1)),
  "two_keys": ([jnp.float32, jnp.int32], lambda x, y: _iota_sort(x, y, num_keys=2)),
  "argsort": ([jnp.float32], lambda x: (jnp.argsort(x, axis=1), jnp.sort(x, axis=1))),
  "descending": ([jnp.int32], lambda x: jnp.argsort(x, axis=1, descending=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_valid_elements_tied_with_the_fill_stay_before_the_padding(name):
  dtypes, fun = CASES[name]
  case = Case(fun, lambda b, t: [(b, t)] * len(dtypes), dtypes=dtypes,
              inputs=lambda rng, shapes: _with_ties(rng, shapes, dtypes))
  for true, bucket in (((3, 5), (4, 8)), ((2, 1), (2, 16)), ((1, 16), (2, 16))):
    for garbage in ("mixed", "nan", "zeros"):
      case.check(true, bucket, seed=sum(true), garbage=garbage)
  text = "\n".join(case.plan((4, 8)).rewrites)
  assert "padded tail set to their order's last value" in text and "leading key" not in text


def test_the_order_s_last_values():
  assert np.isnan(sort_last(np.float32)) and np.isnan(sort_last(jnp.bfloat16))
  c = sort_last(np.complex64)
  assert np.isnan(c.real) and np.isnan(c.imag)
  assert sort_last(np.int8) == 127 and sort_last(np.uint32) == 2**32 - 1
  assert sort_last(np.bool_) is True
  # lax.sort's own order puts each last, ahead of nothing
  for dt, vals in ((np.float32, [np.inf, np.nan, -np.inf, 0.0]),
                   (np.int8, [127, -128, 0])):
    x = jnp.asarray(np.array(vals + [sort_last(dt)], dt))
    s = np.asarray(jax.jit(lambda v: lax.sort(v, is_stable=True))(x))
    assert np.isnan(s[-1]) if dt == np.float32 else s[-1] == sort_last(dt)


def test_a_float_type_without_nan_keeps_the_leading_key():
  ml_dtypes = pytest.importorskip("ml_dtypes")
  if not hasattr(ml_dtypes, "float4_e2m1fn"):
    pytest.skip("no float4_e2m1fn in this ml_dtypes")
  assert sort_last(ml_dtypes.float4_e2m1fn) is None
  (t,) = jax.export.symbolic_shape("t")
  closed = jax.make_jaxpr(lambda x: lax.sort(x, is_stable=True))(
      jax.ShapeDtypeStruct((t,), ml_dtypes.float4_e2m1fn))
  text = "\n".join(pad_jaxpr(closed, ("t",), {"t": 8}).rewrites)
  assert "with a leading key" in text and "order's last value" not in text
