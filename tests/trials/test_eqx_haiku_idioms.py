"""Equinox and Haiku idioms under ``dynjax.jit(padding="auto")`` (``benchmarks/probe_eqx_haiku.py``
probes the real libraries).  Each failure the probe found is reduced here to JAX alone (CI has
neither library): an Equinox-style module is a pytree dataclass whose fields include non-array
leaves (an activation function, Python numbers); Haiku's ``hk.scan`` passes
``length=xs.shape[0]``.  Every call is compared with ``jax.jit`` at the exact shape; compiles
are counted.  The last tests run the real libraries where installed (they skip in CI).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax import SpecError

TOL = dict(rtol=1e-6, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class Block:
  """An ``eqx.Module`` in miniature: arrays, an activation function and Python numbers, all
  data fields (pytree leaves), as equinox keeps them."""

  w: jax.Array
  act: Callable = jax.nn.gelu
  p: float = 0.5
  inference: bool = True

  def __call__(self, x):
    y = self.act(x @ self.w)
    if self.inference:  # eqx.nn.Dropout's ``if inference: return x``
      return y
    return y * (1 - self.p)


jax.tree_util.register_dataclass(Block, data_fields=["w", "act", "p", "inference"],
                                 meta_fields=[])

W = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)


def x_at(t, b=2):
  return np.random.default_rng(t).normal(size=(b, t, 4)).astype(np.float32)


def reference(model):
  """jax.jit of the module's arrays, the rest closed over (what eqx.filter_jit compiles)."""
  return jax.jit(lambda w, x: dataclasses.replace(model, w=w)(x))


def test_an_activation_function_leaf_is_static_and_the_call_bucketed(compiles):
  model = Block(jnp.asarray(W), inference=False)
  f = dynjax.jit(lambda model, x: model(x), dims={"x": "b, t, 4"}, padding="auto")
  n = compiles()
  for t in (3, 4, 7):
    np.testing.assert_allclose(f(model, x_at(t)), reference(model)(model.w, x_at(t)), **TOL)
  assert compiles() - n - 3 == 2, "one compile a bucket (4, 8) beside the reference's three"
  assert f.stats()["fallbacks"] == []
  other = Block(jnp.asarray(W), act=jax.nn.relu, inference=False)  # another value: another key
  np.testing.assert_allclose(f(other, x_at(5)), reference(other)(other.w, x_at(5)), **TOL)


def test_stages_take_a_module_with_a_function_leaf():
  # f.trace(...).lower().compile() and the Compiled's call: the static leaf is in the key and
  # not passed to the executable (the Compiled's call passed it and failed until session 25).
  model = Block(jnp.asarray(W), inference=False)
  f = dynjax.jit(lambda model, x: model(x), dims={"x": "b, t, 4"}, padding="auto")
  compiled = f.trace(model, x_at(5)).lower().compile()
  for t in (3, 5):
    np.testing.assert_allclose(compiled(model, x_at(t)), reference(model)(model.w, x_at(t)),
                               **TOL)
  other = Block(jnp.asarray(W), act=jax.nn.relu, inference=False)
  with pytest.raises(dynjax.ShapeMismatchError, match="another static signature"):
    compiled(other, x_at(5))


def test_python_numbers_the_function_branches_on_become_static(compiles):
  # jax.jit traces p and inference, so ``if self.inference:`` raises; eqx.filter_jit keeps them
  # static.  dynjax traces them as jax.jit does and, where that cannot trace, keeps them static.
  for inference in (True, False):
    model = Block(jnp.asarray(W), inference=inference)
    with pytest.raises(jax.errors.TracerBoolConversionError):
      jax.jit(lambda w, inf, x: Block(w, inference=inf)(x))(model.w, inference, x_at(3))
    f = dynjax.jit(lambda model, x: model(x), dims={"x": "b, t, 4"}, padding="auto")
    n = compiles()
    for t in (3, 6, 8):
      np.testing.assert_allclose(f(model, x_at(t)), reference(model)(model.w, x_at(t)), **TOL)
    assert compiles() - n - 3 == 2
    assert f.stats()["fallbacks"] == []


def test_a_train_step_returns_the_module_with_its_static_leaves():
  model = Block(jnp.asarray(W), inference=False)

  def step(model, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(dataclasses.replace(model, w=w)(x) ** 2))(
        model.w)
    return loss, dataclasses.replace(model, w=model.w - 0.1 * g)

  f = dynjax.jit(step, dims={"x": "b, t, 4"}, padding="auto")
  ref = jax.jit(lambda w, x: (lambda r: (r[0], r[1].w))(step(dataclasses.replace(model, w=w), x)))
  for t in (3, 5):
    loss, new = f(model, x_at(t))
    want_loss, want_w = ref(model.w, x_at(t))
    assert new.act is jax.nn.gelu and new.p == 0.5 and new.inference is False
    np.testing.assert_allclose(loss, want_loss, **TOL)
    np.testing.assert_allclose(new.w, want_w, **TOL)


def test_an_unhashable_leaf_that_is_not_an_array_is_refused_by_keypath():
  class Unhashable:
    __hash__ = None

  f = dynjax.jit(lambda model, x: x * 2, dims={"x": "b"})
  with pytest.raises(SpecError) as e:
    f({"cfg": Unhashable()}, np.ones(3, np.float32))
  assert "model['cfg']: Unhashable (unhashable)" in str(e.value)
  assert "Fix: make them hashable" in str(e.value)


def test_scan_with_an_explicit_symbolic_length_is_bucketed(compiles):
  # haiku's hk.scan (behind hk.dynamic_unroll) calls lax.scan(f, init, xs, length=xs.shape[0]);
  # JAX's int(length) refused the symbolic size and the family ran one compile per shape.
  def rnn(x):  # time major, as haiku wants
    xs = jnp.swapaxes(x, 0, 1)
    return jax.lax.scan(lambda h, xt: (jnp.tanh(h * 0.5 + xt), h), jnp.zeros(x.shape[0]), xs,
                        length=xs.shape[0])

  f = dynjax.jit(rnn, dims={"x": "b, t"}, padding="auto")
  n = compiles()
  for t in (3, 4, 7):
    x = np.random.default_rng(t).normal(size=(2, t)).astype(np.float32)
    for got, want in zip(f(x), jax.jit(rnn)(x), strict=True):
      np.testing.assert_allclose(got, want, **TOL)
  assert compiles() - n - 3 == 2
  assert f.stats()["fallbacks"] == []


# -- the real libraries (not installed in CI) ------------------------------------------------
def test_real_equinox_mlp_and_attention_as_arguments(compiles):
  eqx = pytest.importorskip("equinox")
  k = jax.random.PRNGKey(0)

  class Model(eqx.Module):
    mlp: eqx.nn.MLP  # its activation functions are leaves
    mha: eqx.nn.MultiheadAttention  # dropout p (float) and inference (bool) leaves

    def __call__(self, x, n):
      m = jnp.arange(x.shape[0]) < n
      x = x + self.mha(x, x, x, mask=m[:, None] & m[None, :])  # Dropout: ``if inference``
      return jax.vmap(self.mlp)(x)

  model = Model(eqx.nn.MLP(8, 8, 16, 2, key=k), eqx.nn.MultiheadAttention(2, 8, key=k))
  fn = lambda model, x, n: jax.vmap(model)(x, n)  # noqa: E731
  f = dynjax.jit(fn, dims={"x": "b, t, 8", "n": "b"}, padding="auto")
  ref = eqx.filter_jit(fn)
  for t in (3, 4, 7):
    x = np.random.default_rng(t).normal(size=(2, t, 8)).astype(np.float32)
    n = np.array([t, max(1, t - 2)], np.int32)
    np.testing.assert_allclose(f(model, x, n), ref(model, x, n), rtol=1e-5, atol=1e-5)
  assert f.stats()["compiles"] == 2 and f.stats()["fallbacks"] == []


def test_real_haiku_dynamic_unroll_is_bucketed():
  hk = pytest.importorskip("haiku")

  def rnn(x):
    core = hk.LSTM(8)
    out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1), core.initial_state(x.shape[0]))
    return out

  fn = hk.transform(rnn)
  params = fn.init(jax.random.PRNGKey(0), np.zeros((2, 3, 4), np.float32))
  apply = lambda params, x: fn.apply(params, None, x)  # noqa: E731
  f = dynjax.jit(apply, dims={"x": "b, t, 4"}, padding="auto")
  for t in (3, 4, 7):
    x = x_at(t)
    np.testing.assert_allclose(f(params, x), jax.jit(apply)(params, x), rtol=1e-5, atol=1e-5)
  assert f.stats()["compiles"] == 2 and f.stats()["fallbacks"] == []
