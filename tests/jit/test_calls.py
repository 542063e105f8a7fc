"""How dynjax calls the user's function: as ``jax.jit`` calls it.

Positional parameters go positionally (``jax.value_and_grad(f)`` differentiates positional
arguments only; a ``/`` parameter has no keyword; decorators forward ``*args``), a parameter the
caller leaves out is not passed (its default is a Python value, never traced), and a function
that fails at the call's own shapes raises its own error, not a fallback warning.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax


def _x(b=2, t=5, seed=0):
  return np.random.default_rng(seed).normal(size=(b, t)).astype(np.float32)


def _same(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def _loss(x, w):
  return jax.nn.logsumexp(x * w, -1).sum()


def test_value_and_grad_of_a_function_is_called_positionally():
  vg = jax.value_and_grad(_loss)  # its signature is _loss's, its wrapper takes *args
  f = dynjax.jit(vg, dims={"x": "b, t"})
  for t in (3, 5, 9):
    _same(f(_x(t=t), np.float32(0.5)), jax.jit(vg)(_x(t=t), np.float32(0.5)))
  assert f.stats()["fallbacks"] == []


def test_decorator_forwarding_args_and_positional_only_parameters():
  def twice(fn):
    @functools.wraps(fn)
    def wrapper(*args):
      return fn(*args) * 2

    return wrapper

  @twice
  def row_sum(x):
    return x.sum(-1)

  def head(x, /, k=2):
    return x[:, :k].sum(-1) + x.sum(-1)

  for fun in (row_sum, head):
    f = dynjax.jit(fun, dims={"x": "b, t"})
    for t in (3, 6):
      _same(f(_x(t=t)), jax.jit(fun)(_x(t=t)))
    assert f.stats()["fallbacks"] == [], fun


def test_a_left_out_default_stays_a_python_value():
  def scan_sum(x, reverse=False, mask=None):
    if reverse:  # a traced default raised TracerBoolConversionError here
      x = x[:, ::-1]
    if mask is not None:
      x = x * mask
    return jnp.cumsum(x, -1)

  f = dynjax.jit(scan_sum, dims={"x": "b, t", "mask": "b, t"}, static_argnames=("reverse",))
  for t in (3, 6):
    _same(f(_x(t=t)), jax.jit(scan_sum)(_x(t=t)))  # reverse and mask left out
    _same(f(_x(t=t), True), jax.jit(scan_sum, static_argnames="reverse")(_x(t=t), True))
    m = (np.arange(t) < 2).astype(np.float32)[None].repeat(2, 0)
    _same(f(_x(t=t), mask=m), jax.jit(scan_sum)(_x(t=t), mask=m))
    _same(f(_x(t=t), mask=None), jax.jit(scan_sum)(_x(t=t), mask=None))  # dims, no leaves
  g = dynjax.jit(lambda x, reverse=False: x[:, ::-1] if reverse else x, dims={"x": "b, t"})
  _same(g(_x()), _x())  # not static: fine while left out, as under jax.jit
  assert f.stats()["fallbacks"] == [] and g.stats()["fallbacks"] == []


def test_a_bug_in_the_function_raises_its_own_error_not_a_fallback():
  def bad(x, w):
    return x @ w  # (b, t) @ (3, 4): wrong at every shape

  f = dynjax.jit(bad, dims={"x": "b, t"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "running unpadded" warning first
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
      f(_x(t=5), np.ones((3, 4), np.float32))
  assert f.stats()["fallbacks"] == []


def test_flax_left_out_train_flag_and_mask():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask=None, train: bool = False):
      h = nn.Dense(4)(x)
      h = nn.Dropout(0.5, deterministic=not train)(h)
      return h.sum(-1) if mask is None else (h * mask[..., None]).sum(-1)

  model = Block()
  x = np.random.default_rng(0).normal(size=(2, 5, 3)).astype(np.float32)
  variables = model.init(jax.random.key(0), x)
  f = dynjax.flax.jit(model, dims={"x": "b, t, 3", "mask": "b, t"})
  for t in (3, 5):
    _same(f(variables, x[:, :t]), model.apply(variables, x[:, :t]))
    m = np.ones((2, t), np.float32)
    _same(f(variables, x[:, :t], m), model.apply(variables, x[:, :t], m))
  assert f.stats()["fallbacks"] == []


def test_model_apply_with_args_and_kwargs_as_jax_jit_takes_it():
  """``jax.jit(model.apply)``: Flax's ``apply(variables, *args, rngs=None, method=None,
  mutable=False, ..., **kwargs)``; ``*args`` binds as one tuple argument (dims by
  ``{"args": (...)}``, or "auto"), a static_argname that no parameter names goes into
  ``**kwargs`` as under ``jax.jit``."""
  nn = pytest.importorskip("flax.linen")

  class Tagger(nn.Module):
    @nn.compact
    def __call__(self, x, mask=None, train: bool = False):
      h = nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))
      h = h if mask is None else h * mask[..., None]
      return nn.Dense(2)(h.mean(1) if train else h)

  model = Tagger()
  x = _x(2, 5)[..., None] * np.ones(3, np.float32)
  v = model.init(jax.random.key(0), x)
  by_spec = dynjax.jit(model.apply, dims={"args": ("b, t, 3",)})
  auto = dynjax.jit(model.apply)
  train = dynjax.jit(model.apply, static_argnames="train", dims={"args": ("b, t, 3", "b, t")})
  want_train = jax.jit(model.apply, static_argnames=("train", "mutable"))
  for t in (3, 7, 12, 13):
    xt, m = _x(2, t, seed=t)[..., None] * np.ones(3, np.float32), np.ones((2, t), np.float32)
    _same(by_spec(v, xt), jax.jit(model.apply)(v, xt))
    _same(auto(v, xt), jax.jit(model.apply)(v, xt))
    _same(train(v, xt, m, train=True, mutable=["batch_stats"]),
          want_train(v, xt, m, train=True, mutable=("batch_stats",)))
    _same(train(v, xt, m), model.apply(v, xt, m))  # train left out: its default
  for f in (by_spec, auto, train):
    assert f.stats()["fallbacks"] == []
  assert by_spec.stats()["per_bucket_calls"] == {"b=2, t=4": 1, "b=2, t=8": 1, "b=2, t=16": 2}
  assert by_spec.stats()["compiles"] == 3
  heads = [line for line in train.explain().splitlines() if line.startswith("family")]
  assert heads == ["family 0: mode=auto (static train=True)", "family 1: mode=auto"]
  assert train.stats()["compiles"] == 6  # two families (train=True, left out), 3 buckets each


def test_star_args_and_kwargs_functions():
  def total(*xs, scale=1.0, **named):
    return sum(x.sum(-1) for x in xs) * scale + sum(v.sum(-1) for v in named.values())

  f = dynjax.jit(total, dims={"xs": ("b, t", "b, t"), "named": {"z": "b, t"}})
  for t in (3, 6):
    a, b, z = _x(t=t), _x(t=t, seed=1), _x(t=t, seed=2)
    _same(f(a, b, z=z), total(a, b, z=z))
    _same(f(a, b, scale=2.0, z=z), total(a, b, scale=2.0, z=z))
  assert f.stats()["fallbacks"] == []
  g = dynjax.jit(total)  # dims="auto": one family per tree of arguments
  for n in (1, 3):
    xs = [_x(t=4 + i) for i in range(n)]
    _same(g(*xs), total(*xs))


def test_under_jax_transformations_the_function_is_traced_in_like_a_nested_jit():
  def lse(x):
    return jax.nn.logsumexp(x, -1).sum()

  g = dynjax.jit(lse, dims={"x": "b, t"})
  x = _x(3, 5)
  _same(g(x), lse(x))  # a family first: its executors must not see the tracers below
  _same(jax.grad(g)(x), jax.grad(lse)(x))
  _same(jax.jit(g)(x), jax.jit(lse)(x))
  _same(jax.vmap(g)(x[None]), jax.vmap(lse)(x[None]))
  outer = dynjax.jit(lambda y: g(y) * 2, dims={"y": "b, t"}, buckets={"b": [4], "t": [8]})
  for t in (3, 7):
    _same(outer(_x(t=t)), 2 * lse(_x(t=t)))
  assert outer.stats()["fallbacks"] == [] and outer.stats()["compiles"] == 1


def test_padded_refuses_a_shape_that_does_not_fit_its_buffer():
  with pytest.raises(ValueError, match=r"shape=\(3, 5\).*buffer has shape \(2, 2\)"):
    dynjax.Padded(np.ones((2, 2), np.float32), (3, 5))
  with pytest.raises(ValueError, match="rank"):
    dynjax.Padded(np.ones((2, 8), np.float32), (2,))
  assert dynjax.Padded(np.ones((2, 8), np.float32), (2, 5)).shape == (2, 5)


@pytest.mark.parametrize("spec, match", [
  (["b", "t"], r"is a list, but argument 'x' is one array.*dims=\{'x': 'b, t'\}"),
  ("b, -3", r"negative size\(s\) \[.-3.\]"),
])
def test_spec_mistakes_are_named_with_their_fix(spec, match):
  with pytest.raises(dynjax.SpecError, match=match):
    dynjax.jit(lambda x: x * 2, dims={"x": spec})(_x())  # (a negative size: at jit() already)


def test_static_and_donate_argnums_as_in_jax_jit():
  def scaled(x, n, rev=False):
    y = x * n
    return y[:, ::-1] if rev else y

  f = dynjax.jit(scaled, dims={"x": "b, t"}, static_argnums=(1, -1))
  want = jax.jit(scaled, static_argnums=(1, 2))
  for t in (3, 6):
    _same(f(_x(t=t), 3, True), want(_x(t=t), 3, True))
  assert f.stats()["fallbacks"] == []
  f(_x(), 2)  # rev left out: another family, its static values in explain()
  heads = [line for line in f.explain().splitlines() if line.startswith("family")]
  assert heads == ["family 0: mode=auto (static n=3, rev=True)", "family 1: mode=auto (static n=2)"]
  with pytest.raises(dynjax.SpecError, match=r"static_argnums=5: scaled has 3 positional "
                     r"parameters"):
    dynjax.jit(scaled, static_argnums=5)
  g = dynjax.jit(lambda x, y: x + y, dims={"x": "t"}, donate_argnums=0)
  _same(g(np.ones(3, np.float32), np.float32(1)), np.full(3, 2.0, np.float32))


def test_a_forwarded_numpy_input_comes_back_as_a_device_array():
  # jax.jit returns a device copy of an argument it returns unchanged; the caller's numpy
  # buffer must not double as the result (a later in-place write would change it).
  def step(x, params):
    return x * 2.0, params

  f = dynjax.jit(step, dims={"x": "b, t"})
  params = np.arange(4, dtype=np.float32)
  for x in (np.ones((2, 3), np.float32), np.ones((2, 5), np.float32)):
    y, p = f(x, params)
    want = jax.jit(step)(x, params)[1]
    assert isinstance(p, jax.Array) and p is not params
    np.testing.assert_array_equal(p, want)
    params[0] = 99.0  # the caller reuses its buffer
    assert float(p[0]) == float(want[0])
    params[0] = 0.0
  dev = jnp.arange(4, dtype=jnp.float32)
  assert f(np.ones((2, 3), np.float32), dev)[1] is dev  # a jax.Array: the caller's own object
  s = f(np.ones((2, 3), np.float32), 3.0)[1]  # a Python scalar, as jax.jit returns it
  want = jax.jit(step)(np.ones((2, 3), np.float32), 3.0)[1]  # float32 (float64 with x64 on)
  assert isinstance(s, jax.Array) and s.dtype == want.dtype and float(s) == 3.0


def test_device_outputs_at_the_bucket_shape_come_back_as_they_are_in_their_tree():
  # Executor.as_is: no output to cut, none to move: the executable's outputs go back in the
  # function's own tree (a tuple with a dict here), each exact, the Python list not re-made.
  def f(x):
    return x * 2.0, {"s": x.sum(1), "n": jnp.float32(x.shape[1])}

  g = dynjax.jit(f, dims={"x": "b, t"}, buckets={"t": dynjax.buckets.pow2(4, 16)})
  x8 = jnp.asarray(np.arange(16, dtype=np.float32).reshape(2, 8))
  for _ in range(2):  # the miss, then the executor's hit
    got = g(x8)
    want = jax.jit(f)(x8)
    assert type(got) is tuple and set(got[1]) == {"s", "n"}
    _same(got, want)
  ex = next(iter(next(iter(g._dispatcher.families.values())).executors.values()))
  assert ex.as_is
  got = g(np.asarray(x8)[:, :5])  # a host request with cut outputs: the other routine
  _same(got, jax.jit(f)(np.asarray(x8)[:, :5]))
