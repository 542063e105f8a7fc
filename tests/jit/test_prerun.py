"""First runs on zeros of executables nobody waits for (``jit/_prerun.py``).

On a GPU the first run of an executable pays CUDA's lazy module loading and JAX's first-call
path; a background build pays it on a worker.  These tests run on the CPU with the platform
list widened, so the same code runs here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax import _config
from dynjax.jit import _prerun
from tests.jit.test_serving import _model, _params


@pytest.fixture
def on_cpu_too(monkeypatch):
  monkeypatch.setattr(_prerun, "PLATFORMS", ("gpu", "cpu"))


def _x(t, b=2, d=4):
  return np.random.RandomState(t).randn(b, t, d).astype(np.float32)


def _rowwise(params, x):  # padding="trust" is exact for it: no reduction over t
  return jax.nn.softmax(jnp.tanh(x @ params["w"] + params["b"]), axis=-1)


EXACT = jax.jit(_model)
KW = dict(dims={"x": "b, t, 4"}, buckets={"b": [2], "t": dynjax.buckets.pow2(4, 32)})
SHAPES = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params())


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_warmup_runs_each_built_executable_once_and_compiles_nothing_more(
    on_cpu_too, compiles, padding):
  model = _model if padding == "auto" else _rowwise
  f = dynjax.jit(model, padding=padding, **KW)
  f.warmup(SHAPES, jax.ShapeDtypeStruct((2, 5, 4), np.float32))
  pre = f.stats()["preruns"]
  assert (pre["runs"], pre["skipped"]) == (4, {}), pre  # t = 4, 8, 16, 32
  assert pre["seconds"] > 0
  assert compiles() == 4  # zeros go to the device by device_put: no compile of their own
  # (jax 0.11.2 may compile a transfer of its own for jnp.asarray, after Pallas interpret-mode
  # tests ran in the process: counted from after the parameters exist.)
  p = _params()
  before = compiles()
  for t in (3, 7, 30):
    np.testing.assert_allclose(f(p, _x(t)), jax.jit(model)(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert compiles() - before == 3  # the three exact-shape references
  assert f.stats()["preruns"]["runs"] == 4  # calls run what the warmup built, no new prerun


def test_background_builds_and_a_restarts_other_buckets_run_ahead(on_cpu_too, tmp_path):
  kw = dict(KW, cache_dir=str(tmp_path), serving=True, padding="auto")
  f = dynjax.jit(_model, **kw)
  f.warmup(SHAPES, jax.ShapeDtypeStruct((2, 5, 4), np.float32), background=True)
  assert f.wait(timeout=120)
  # Warm jobs: nobody waits for them (on a GPU, serving's tier-up recompiles run ahead too).
  assert f.stats()["preruns"]["runs"] == 4 * f._dispatcher.compiler.tiers()
  # A restart's first call waits for its own stored bucket and, when none of the others has
  # loaded yet, also for the top one (serving): those run on that call, not ahead.  The other
  # stored buckets load beside it and run once before they serve.
  g = dynjax.jit(_model, **kw)
  p = _params()
  np.testing.assert_allclose(g(p, _x(7)), EXACT(p, _x(7)), rtol=1e-6, atol=1e-6)
  assert g.wait(timeout=120)
  s = g.stats()
  assert (s["compiles"], s["loaded_from_store"]) == (0, 4)
  assert s["preruns"]["runs"] in (2, 3), s["preruns"]
  for t in (3, 20, 32):
    np.testing.assert_allclose(g(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)


def test_a_first_call_that_waits_runs_its_bucket_itself(on_cpu_too):
  f = dynjax.jit(_model, padding="auto", **KW)
  p = _params()
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  assert f.stats()["preruns"]["runs"] == 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the default runs ahead on GPU")
def test_off_gpu_by_default_and_off_by_config(monkeypatch):
  f = dynjax.jit(_model, padding="auto", **KW)
  f.warmup(SHAPES, jax.ShapeDtypeStruct((2, 5, 4), np.float32))
  assert f.stats()["preruns"] == {"runs": 0, "seconds": 0.0, "skipped": {"platform": 4}}
  monkeypatch.setattr(_prerun, "PLATFORMS", ("gpu", "cpu"))
  monkeypatch.setattr(_config.config, "prerun", False)  # DYNJAX_PRERUN=0
  g = dynjax.jit(_model, padding="auto", **KW)
  g.warmup(SHAPES, jax.ShapeDtypeStruct((2, 5, 4), np.float32))
  assert g.stats()["preruns"]["skipped"] == {"off": 4}


def test_executables_that_call_cudnn_are_not_run_ahead(on_cpu_too, tmp_path):
  # H200, bf16 BERT-base with attention="cudnn" (sessions 36-37): both SIGSEGV stacks had a
  # worker in a prerun's device_put, and a cold process hung in its weights' upload as a
  # prerun began.  Such functions' first runs are left to their first requests: warm-up,
  # background builds and a restart's loads alike; a function without cuDNN still runs ahead.
  from tests.jit.test_serving import _CUDNN

  def model(params, x):  # the model's own cuDNN attention (a primitive named as jax's)
    return jax.jit(_CUDNN.bind)(x @ params["w"] + params["b"])

  p, x = _params(), jax.ShapeDtypeStruct((2, 5, 4), np.float32)
  f = dynjax.jit(model, padding="trust", **KW)
  f.warmup(SHAPES, x)
  assert f.stats()["preruns"] == {"runs": 0, "seconds": 0.0, "skipped": {"cuDNN": 4}}
  g = dynjax.jit(_rowwise, padding="trust", **KW)
  g.warmup(SHAPES, x)
  assert g.stats()["preruns"]["runs"] == 4
  kw = dict(KW, padding="trust", serving=True, cache_dir=str(tmp_path))
  kw["attention"] = "cudnn"  # named (on the CPU no site is rewritten)
  h = dynjax.jit(model, **kw)
  h.warmup(SHAPES, x, background=True)
  assert h.wait(timeout=120)
  r = dynjax.jit(model, **kw)  # a restart: its stored buckets load, none runs ahead
  np.testing.assert_allclose(r(p, _x(7)), jax.jit(model)(p, _x(7)), rtol=1e-6, atol=1e-6)
  assert r.wait(timeout=120)
  tiers = h._dispatcher.compiler.tiers()  # (2 on a GPU: the tier-ups skip theirs too)
  assert h.stats()["preruns"] == {"runs": 0, "seconds": 0.0, "skipped": {"cuDNN": 4 * tiers}}
  s = r.stats()
  assert (s["compiles"], s["loaded_from_store"]) == (0, 4)
  # (as in the test above: the loads nobody waited for, 2 or 3 of the 4, would have run ahead)
  assert s["preruns"]["runs"] == 0 and s["preruns"]["skipped"]["cuDNN"] in (2, 3), s["preruns"]


def test_functions_with_effects_are_not_run_on_data_nobody_sent(on_cpu_too, capfd):
  def loud(params, x):
    jax.debug.print("ran {}", x.shape[1])
    return _model(params, x)

  f = dynjax.jit(loud, padding="auto", **KW)
  f.warmup(SHAPES, jax.ShapeDtypeStruct((2, 5, 4), np.float32))
  assert f.stats()["preruns"]["skipped"] == {"effects": 4}
  assert "ran" not in capfd.readouterr().out
  f(_params(), _x(5))
  jax.effects_barrier()
  assert capfd.readouterr().out.count("ran") == 1


def test_donated_keys_and_too_large_inputs_are_skipped(on_cpu_too, monkeypatch):
  f = dynjax.jit(_rowwise, padding="trust", donate_argnames="x", **KW)
  f.warmup(SHAPES, jax.ShapeDtypeStruct((2, 5, 4), np.float32))
  assert f.stats()["preruns"]["skipped"] == {"donated arguments": 4}

  def keyed(key, x):
    return x + jax.random.normal(key, x.shape[-1:])

  g = dynjax.jit(keyed, padding="trust", **KW)
  g.warmup(jax.ShapeDtypeStruct((), jax.random.key(0).dtype),
           jax.ShapeDtypeStruct((2, 5, 4), np.float32))
  assert g.stats()["preruns"]["skipped"] == {"extended dtype": 4}
  key = jax.random.key(3)  # the warmup from a key's ShapeDtypeStruct built what calls run
  np.testing.assert_allclose(g(key, _x(5)), jax.jit(keyed)(key, _x(5)), rtol=1e-6)
  assert g.stats()["compiles"] == 4

  monkeypatch.setattr(_prerun, "MAX_BYTES", 64)  # w (64 B) fits, then b does not
  h = dynjax.jit(_model, padding="auto", **KW)
  h.warmup(SHAPES, jax.ShapeDtypeStruct((2, 5, 4), np.float32))
  assert h.stats()["preruns"]["skipped"] == {"too large": 4}
  p = _params()
  np.testing.assert_allclose(h(p, _x(9)), EXACT(p, _x(9)), rtol=1e-6, atol=1e-6)
