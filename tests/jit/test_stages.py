"""Stage objects as thin views over a family: Traced.bucket decides as a call does, Compiled
runs its own executable through the one run routine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax


def _rowsum(x):
  return jnp.tanh(x).sum(axis=1)


def _x(b, t, seed=0):
  return np.random.RandomState(seed).randn(b, t).astype(np.float32)


@pytest.mark.parametrize("overflow", ["error", "exact", "grow"])
def test_traced_bucket_follows_overflow_as_a_call_does(overflow):
  f = dynjax.jit(_rowsum, dims={"x": "b, t"}, overflow=overflow,
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 16)})
  assert f.trace(_x(2, 5)).bucket() == (2, 8)
  big = _x(2, 20)
  if overflow == "error":
    with pytest.raises(dynjax.OutOfBucketsError, match="t = 20"):
      f.trace(big).bucket()
    with pytest.raises(dynjax.OutOfBucketsError, match="t = 20"):
      f(big)
    return
  want = None if overflow == "exact" else (2, 32)
  assert f.trace(big).bucket() == want
  np.testing.assert_allclose(f(big), jax.jit(_rowsum)(big), rtol=1e-6, atol=1e-6)
  assert f.stats()["exact_calls"] == (1 if overflow == "exact" else 0)


def test_traced_bucket_follows_the_joint_plan_and_does_not_observe():
  f = dynjax.jit(_rowsum, dims={"x": "b, t"},
                 buckets=dynjax.buckets.auto(max_compiles=4, min=1, max=64))
  for b, t in ((2, 5), (3, 9), (2, 30), (4, 12)):
    f(_x(b, t))
  fam = next(iter(f._dispatcher.families.values()))
  assert fam.joint is not None
  hist = dict(fam.tuple_hist)
  traced = f.trace(_x(3, 10))
  assert traced.bucket() == fam.bucket_of((3, 10), observe=False)
  assert dict(fam.tuple_hist) == hist  # tracing is not traffic


def test_compiled_runs_its_executable_and_refuses_other_buckets(compiles):
  f = dynjax.jit(_rowsum, dims={"x": "b, t"},
                 buckets={"b": [4], "t": dynjax.buckets.pow2(4, 64)})
  compiled = f.trace(_x(4, 9)).lower().compile()
  assert compiled.bucket == (4, 16)
  xs = [_x(3, t, seed=t) for t in (9, 12, 16)] + [_x(4, 11)]
  wants = [np.asarray(jax.jit(_rowsum)(x)) for x in xs]
  before = compiles()
  for x, want in zip(xs[:3], wants[:3], strict=True):
    np.testing.assert_allclose(compiled(x), want, rtol=1e-6, atol=1e-6)
  assert compiles() == before  # ran its own executable: nothing traced or compiled again
  s = f.stats()
  assert s["calls"] == 3 and s["per_bucket_calls"] == {"b=4, t=16": 3}
  np.testing.assert_allclose(f(xs[3]), wants[3], rtol=1e-6, atol=1e-6)
  assert compiles() == before  # the function's own calls use the stage-compiled bucket
  with pytest.raises(dynjax.ShapeMismatchError, match=r"need bucket \(4, 32\) but this "
                                                      r"executable is bucket \(4, 16\)"):
    compiled(_x(4, 20))
  with pytest.raises(dynjax.SpecError, match="give a size for every dimension variable"):
    f.trace(_x(4, 9)).lower({"t": 16})


def test_top_level_and_general_paths_share_the_run_routine():
  def flat(x, scale):
    return jnp.tanh(x).sum(axis=1) * scale

  def nested(batch, scale):
    return flat(batch["x"], scale)

  top = dynjax.jit(flat, dims={"x": "b, t"})  # x is a whole argument: the top-level path
  general = dynjax.jit(nested, dims={"batch": {"x": "b, t"}})  # a leaf in a pytree
  for t in (3, 5, 3, 7):
    x = _x(2, t, seed=t)
    want = np.asarray(jax.jit(flat)(x, np.float32(2.0)))
    np.testing.assert_allclose(top(x, np.float32(2.0)), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(general({"x": x}, np.float32(2.0)), want, rtol=1e-6, atol=1e-6)
  ftop = next(iter(top._dispatcher.families.values()))
  fgen = next(iter(general._dispatcher.families.values()))
  assert ftop.top is not None and fgen.top is None
  assert {type(e).__name__ for e in ftop.executors.values()} == {"Executor"}
  assert {type(e).__name__ for e in fgen.executors.values()} == {"Executor"}
  for f in (top, general):
    s = f.stats()
    assert s["calls"] == 4 and s["cache_hits"] == 2 and s["host_syncs"] == 4, s


def test_the_probe_bucket_reuses_the_probes_padding_pass(monkeypatch):
  # The padding pass runs once at trace time on the probe bucket (the smallest planned one);
  # lowering that bucket takes the probe's plan instead of padding again (Python holding the
  # GIL, ~0.27 s a bucket for BERT-base on the CPU box), and the other buckets pad as before.
  from dynjax.jit import _family

  calls = []
  real = _family.pad_jaxpr
  monkeypatch.setattr(_family, "pad_jaxpr", lambda jaxpr, order, env, **kw: calls.append(
      (env["t"], kw.get("validate", True))) or real(jaxpr, order, env, **kw))

  def f(x):
    return jax.nn.softmax(x, axis=-1).sum(-1)

  g = dynjax.jit(f, dims={"x": "b, t"}, buckets={"t": [8, 16, 32], "b": [2]})
  g.warmup(jax.ShapeDtypeStruct((2, 5), np.float32))
  # The probe (b=2, t=8), validated at trace time; then t=16 and t=32, checked in the one trace
  # that lowers them (no abstract trace of their own); not t=8 again.
  assert sorted(calls) == [(8, True), (16, False), (32, False)]
  for t in (3, 8, 9, 20):
    x = np.random.RandomState(t).randn(2, t).astype(np.float32)
    np.testing.assert_allclose(g(x), jax.jit(f)(x), rtol=1e-6, atol=1e-6)
