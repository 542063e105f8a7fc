"""route._once: GPU kernels lowered once a process (jax.export) and inlined in each executable."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.route import _once


@pytest.fixture(autouse=True)
def fresh():
  _once.clear()
  yield
  _once.clear()


def _kernel(a, b):
  return jnp.tanh(a @ b)


def _structs():
  return (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 4), jnp.float32))


def test_a_kernel_is_exported_once_for_every_executable():
  texts = []
  for scale in (1.0, 2.0, 3.0):
    fn = jax.jit(lambda a, b, s=scale: _once.call("k", _kernel, a * s, b))
    texts.append(fn.trace(*_structs()).lower(lowering_platforms=("cuda",)).as_text())
  assert _once._exported.cache_info().misses == 1
  assert all("tanh" in t for t in texts)
  # Other shapes: another export.
  jax.jit(lambda a, b: _once.call("k", _kernel, a, b)).trace(
      jax.ShapeDtypeStruct((4, 16), jnp.float32), _structs()[1]).lower(
          lowering_platforms=("cuda",))
  assert _once._exported.cache_info().misses == 2


def test_a_failed_export_falls_back_to_lowering_in_place_and_warns_once(monkeypatch, caplog):
  def broken(key):
    raise RuntimeError("no export here")

  monkeypatch.setattr(_once, "_exported", broken)
  a = np.random.RandomState(0).randn(8, 16).astype(np.float32)
  b = np.random.RandomState(1).randn(16, 4).astype(np.float32)
  with caplog.at_level(logging.WARNING, logger="dynjax"):
    for _ in range(2):
      out = jax.jit(lambda a, b: _once.call("k", _kernel, a, b))(a, b)
      np.testing.assert_allclose(out, jax.jit(_kernel)(a, b), rtol=1e-6, atol=1e-6)
  warned = [r for r in caplog.records if "exporting the GPU kernel k failed" in r.getMessage()]
  assert len(warned) == 1 and "RuntimeError: no export here" in warned[0].getMessage()


def test_export_off_calls_the_kernel_in_place(monkeypatch):
  monkeypatch.setattr(_once, "EXPORT", False)
  a, b = jnp.ones((8, 16)), jnp.ones((16, 4))
  np.testing.assert_allclose(jax.jit(lambda a, b: _once.call("k", _kernel, a, b))(a, b),
                             _kernel(a, b))
  assert _once._exported.cache_info().misses == 0


def test_builders_are_bounded(monkeypatch):
  monkeypatch.setattr(_once, "EXPORT", False)
  monkeypatch.setattr(_once, "_MAX", 2)
  for n in (1, 2, 3, 4):
    jax.jit(lambda a, b, n=n: _once.call(("k", n), _kernel, a, b)).trace(*_structs())
  assert [k[0][1] for k in _once._BUILDERS] == [3, 4]


def test_a_kernel_is_compiled_ahead_once_where_its_backend_is_listed(monkeypatch, caplog):
  # On a GPU the first export of a kernel starts its compile alone on a daemon thread (Mosaic
  # GPU caches the compiled kernel by the module's hash, so the model's own compile finds it).
  # A backend that is not listed starts nothing.
  monkeypatch.setattr(_once, "PRECOMPILE_ON", ())
  fn = jax.jit(lambda a, b: _once.call("k", _kernel, a, b))
  fn.trace(*_structs()).lower(lowering_platforms=("cuda",))
  assert _once.precompiles() == {}
  # Listed: one thread a kernel, however many executables call it.  The module is exported
  # for CUDA, so off a GPU its compile fails: said at INFO, and the caller is not affected.
  monkeypatch.setattr(_once, "PRECOMPILE_ON", (jax.default_backend(),))
  _once.clear()
  with caplog.at_level(logging.INFO, logger="dynjax"):
    for scale in (1.0, 2.0):
      jax.jit(lambda a, b, s=scale: _once.call("k", _kernel, a * s, b)).trace(
          *_structs()).lower(lowering_platforms=("cuda",))
    (key,) = _once.precompiles()
    _once._STARTED[key].join(60)
  assert _once.precompiles() == {key: True} and key[0] == "k"
  failed = [r.getMessage() for r in caplog.records if "compiling the GPU kernel k ahead" in
            r.getMessage()]
  if jax.default_backend() == "gpu":
    assert failed == []
  else:
    assert len(failed) == 1 and "the executable that holds it compiles it" in failed[0]
