"""``dynjax.jit(ragged_dot="kernels")`` (``route/_rewrite.py``) on the CPU, where
``route.ragged_dot`` is ``lax.ragged_dot`` itself: the sites it finds and why it leaves the
others, exactness in every padding mode, and a failing rewrite that changes nothing.  The
kernels themselves (their stand-in) run under it in tests/route/test_gmm_hopper.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax.route import _rewrite

E, K, N = 4, 8, 16
W = jax.random.normal(jax.random.key(0), (E, K, N), jnp.float32)
GATE = jax.random.normal(jax.random.key(1), (K, E), jnp.float32)


def public_moe(gate):
  """The public idiom with ``lax.ragged_dot`` as written: a router ``gate [K, E]``, tokens
  sorted by expert, one ragged dot, scattered back (also tests/route/test_gmm_hopper.py's)."""
  experts_n = gate.shape[1]

  def moe(x, w):
    experts = jnp.argmax(x @ gate, axis=-1)
    order = jnp.argsort(experts)
    y = jax.lax.ragged_dot(x[order], w, jnp.bincount(experts, length=experts_n))
    return jnp.zeros_like(y).at[order].set(y)

  return moe


moe = public_moe(GATE)


# route.ragged_dot is lax.ragged_dot on the CPU: equal to 1e-6.  On a GPU its kernels run
# float32 at the default precision (TF32, the only one the rewrite takes), lax's reference
# at the suite's "highest": 3.4e-3 apart on the H100.
TOL = (dict(rtol=1e-6, atol=1e-6) if jax.default_backend() == "cpu"
       else dict(rtol=1e-2, atol=1e-2))


def _x(t):
  return jax.random.normal(jax.random.key(t), (t, K), jnp.float32)


@pytest.mark.parametrize("padding", ["auto", "trust", "exact"])
def test_exact_in_every_mode_and_explained(padding):
  f = dynjax.jit(moe, dims={"x": "t, 8", "w": None}, padding=padding, on_fallback="error",
                 ragged_dot="kernels")
  for t in (3, 9, 9):
    with jax.default_matmul_precision("default"):
      got = f(_x(t), W)
    np.testing.assert_allclose(got, jax.jit(moe)(_x(t), W), **TOL)
  text = f.explain()
  assert "ragged_dot='kernels':" in text and "ragged_dot (forward) at" in text


def test_what_is_left_as_written_says_why():
  def scanned(x, w):  # a layer stack under lax.scan: its body is not rewritten
    def body(h, wl):
      return moe(h, wl)[:, :K], None
    return jax.lax.scan(body, x, jnp.stack([w, w]))[0]

  f = dynjax.jit(scanned, dims={"x": "t, 8", "w": None}, ragged_dot="kernels")
  np.testing.assert_allclose(f(_x(5), W), jax.jit(scanned)(_x(5), W), rtol=1e-6, atol=1e-6)
  assert "ragged_dot inside scan at" in f.explain()
  assert "bodies of scan/while/cond/remat are not rewritten" in f.explain()
  g = dynjax.jit(moe, dims={"x": "t, 8", "w": None}, ragged_dot="kernels")
  with jax.default_matmul_precision("highest"):
    g(_x(5), W)
  assert "left as written: precision=" in g.explain()
  w16 = W.astype(jnp.bfloat16)  # mixed dtypes: lax.ragged_dot promotes, the kernels do not
  m = dynjax.jit(moe, dims={"x": "t, 8", "w": None}, ragged_dot="kernels")
  with jax.default_matmul_precision("default"):
    np.testing.assert_allclose(m(_x(5), w16), jax.jit(moe)(_x(5), w16), rtol=1e-6, atol=1e-6)
  assert "left as written: mixed dtypes float32 / bfloat16" in m.explain()


def test_a_rewrite_that_fails_leaves_the_function_as_written(monkeypatch):
  def broken(flat):
    raise RuntimeError("matcher bug")

  monkeypatch.setattr(_rewrite, "find", broken)
  f = dynjax.jit(moe, dims={"x": "t, 8", "w": None}, ragged_dot="kernels")
  np.testing.assert_allclose(f(_x(6), W), jax.jit(moe)(_x(6), W), rtol=1e-6, atol=1e-6)
  assert "the ragged_dot rewrite failed (RuntimeError: matcher bug)" in f.explain()


def test_bad_option_is_named_with_the_choices():
  with pytest.raises(dynjax.SpecError, match=r"ragged_dot='yes' is not valid; use None .* "
                                             r"or \"kernels\""):
    dynjax.jit(moe, dims={"x": "t, 8", "w": None}, ragged_dot="yes")


@pytest.mark.parametrize("padding", ["trust", "auto"])
def test_with_weights_cast_once_the_rewrite_sees_the_function_s_own_dtypes(padding,
                                                                          monkeypatch):
  # float32 weights, bfloat16 compute: the executables take cast copies (cast_once) and
  # hand the function its float32 leaves back; trust's per-shape rewrite traced the function
  # at the cast dtypes (no astype left in its jaxpr) and failed on the float32 it got.
  from dynjax.jit import _casts

  monkeypatch.setattr(_casts, "BANDWIDTH", {})  # a GPU's would find 2 MB not worth casting
  w = jax.random.normal(jax.random.key(2), (4, 256, 512), jnp.float32) / 16
  gate = jax.random.normal(jax.random.key(3), (256, 4), jnp.float32)

  pos = jax.random.normal(jax.random.key(4), (512, 256), jnp.float32)

  def block(x, w, pos):
    xb = x.astype(jnp.bfloat16) + pos.astype(jnp.bfloat16)[:x.shape[0]]  # (an add: one dtype)
    experts = jnp.argmax(xb @ gate.astype(jnp.bfloat16), axis=-1)
    order = jnp.argsort(experts)
    y = jax.lax.ragged_dot(xb[order], w.astype(jnp.bfloat16), jnp.bincount(experts, length=4))
    return jnp.zeros_like(y).at[order].set(y)

  f = dynjax.jit(block, dims={"x": "t, 256", "w": None, "pos": None}, padding=padding,
                 buckets={"t": dynjax.buckets.pow2(max=512)}, on_fallback="error",
                 ragged_dot="kernels")
  for t in (5, 7):
    x = jax.random.normal(jax.random.key(t), (t, 256), jnp.float32)
    with jax.default_matmul_precision("default"):
      got = f(x, w, pos)
    # (bitwise equal on jax 0.10.2 and 0.11.2 CPU; two bf16 ulps of room for other XLAs)
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(jax.jit(block)(x, w, pos), np.float32), rtol=8e-3,
                               atol=1e-6)
  assert f.stats()["cast_once"]["leaves"] == 2  # the case this test is about
  assert "ragged_dot (forward) at" in f.explain()
