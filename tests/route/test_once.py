"""route._once: GPU kernels lowered once a process (jax.export) and inlined in each executable."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.route import _once

# What jax.export calls this process's backend: an export for it runs here (CPU or CUDA).
HERE = ("cuda",) if jax.default_backend() == "gpu" else ("cpu",)


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


# -- kept on disk across processes (keep=True) ----------------------------------------------

def _lower(a_rows=8, scale=1.0, keep=True, key="k", fn=jax.nn.sigmoid):
  f = jax.jit(lambda a: _once.call(key, fn, a * scale, keep=keep))
  return f.trace(jax.ShapeDtypeStruct((a_rows, 16), jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()


def _files(path):
  return sorted(p.name for p in path.iterdir()) if path.exists() else []


def test_a_kept_kernel_is_loaded_by_a_later_process_without_building_it(tmp_path, monkeypatch):
  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path / "kc"))
  first = _lower()
  (name,) = _files(tmp_path / "kc")
  assert name.endswith(".jaxexport") and "stablehlo.divide" in first  # sigmoid
  _once.clear()  # as a new process: nothing in memory
  # The same key with another builder: the file is loaded, the builder never runs.
  again = _lower(fn=lambda a: pytest.fail("built again"))
  assert again == first
  assert _once._exported.cache_info().misses == 1 and _files(tmp_path / "kc") == [name]
  # Other shapes: another file.
  _lower(a_rows=4)
  assert len(_files(tmp_path / "kc")) == 2


def test_the_loaded_kernel_computes_what_the_exported_one_did(tmp_path, monkeypatch):
  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path))
  a = np.random.RandomState(0).randn(8, 16).astype(np.float32)
  # The kept export runs on CPU too where it is exported for it: the file's round trip is
  # checked by value here, beside the CUDA text above.
  monkeypatch.setattr(_once, "_PLATFORMS", HERE)
  want = jax.jit(lambda a: _once.call("v", jax.nn.sigmoid, a, keep=True))(a)
  _once.clear()
  got = jax.jit(lambda a: _once.call("v", jnp.tanh, a, keep=True))(a)  # loaded: not tanh
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got, jax.nn.sigmoid(a), rtol=1e-6, atol=1e-6)


def test_a_damaged_file_is_exported_again_and_replaced(tmp_path, monkeypatch, caplog):
  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path))
  first = _lower()
  (path,) = tmp_path.iterdir()
  good = path.read_bytes()
  path.write_bytes(b"not an export")
  _once.clear()
  with caplog.at_level(logging.WARNING, logger="dynjax"):
    assert _lower() == first
  assert any("could not be read" in r.getMessage() and "exporting it again" in r.getMessage()
             for r in caplog.records)
  assert path.read_bytes() == good


@pytest.mark.parametrize("setting", ["0", "off"])
def test_the_disk_is_not_used_where_turned_off_or_not_asked(tmp_path, monkeypatch, setting):
  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", setting)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert _once.kernel_cache_dir() is None
  _lower()
  assert _files(tmp_path) == []
  monkeypatch.delenv("DYNJAX_KERNEL_CACHE")
  assert _once.kernel_cache_dir() == tmp_path / "dynjax" / "kernels"
  _once.clear()
  _lower(keep=False)  # not asked
  _lower(key=("user", _kernel_user), fn=_kernel_user)  # a key holding a user function
  assert _files(tmp_path) == []


def _kernel_user(a):
  return jnp.tanh(a)


def test_only_values_the_same_in_every_process_key_a_file():
  import functools

  from dynjax.route import _hopper

  gelu = functools.partial(jax.nn.gelu, approximate=False)
  assert _once._stable(("k", 3, (1, 2), jax.nn.gelu)) == ("k", 3, (1, 2),
                                                          "jax._src.nn.functions.gelu")
  assert _once._stable(gelu)[0] == "partial"
  key = _hopper.KernelKey(m=128, k=64, n=256, groups=2, dtype="bfloat16", tm=128, tn=128,
                          tk=64, stages=4, snake=8, activation=jax.nn.gelu, skip_unused=True,
                          sms=132)
  stable = repr(_once._stable(key))
  assert "KernelKey" in stable and "gelu" in stable and "0x" not in stable
  for unstable in (lambda x: x, _kernel_user, object(), ("k", _kernel_user),
                   key._replace(activation=_kernel_user)):
    assert _once._stable(unstable) is None


def test_a_kernel_that_cannot_be_serialized_is_not_kept_and_that_is_logged(tmp_path, monkeypatch, caplog):
  # jax's serialization needs the flatbuffers package: without it the process goes on.
  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path))

  class Unserializable:
    def serialize(self):
      raise ImportError("Please install 'flatbuffers'")

  with caplog.at_level(logging.INFO, logger="dynjax"):
    _once._keep(tmp_path / "x.jaxexport", Unserializable())
  assert _files(tmp_path) == []
  assert any("cannot be kept on disk" in r.getMessage() for r in caplog.records)


def test_the_directory_keeps_the_most_recently_used_kernels(tmp_path, monkeypatch):
  import os
  import time

  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path))
  monkeypatch.setattr(_once, "MAX_KEPT", 2)
  _lower(a_rows=1)
  (first,) = _files(tmp_path)
  os.utime(tmp_path / first, (time.time() - 100, time.time() - 100))
  _lower(a_rows=2)
  second = (set(_files(tmp_path)) - {first}).pop()
  os.utime(tmp_path / second, (time.time() - 50, time.time() - 50))
  _once.clear()
  _lower(a_rows=1)  # loaded: now the most recently used
  _lower(a_rows=3)  # a third file: the least recently used (the second) goes
  names = _files(tmp_path)
  assert len(names) == 2 and first in names and second not in names
  # A writer that died between its write and its rename left a temporary file: gone within
  # the hour's next write, not before.
  for name, age in (("a.jaxexport.1.2.tmp", 7200), ("b.jaxexport.1.2.tmp", 60)):
    (tmp_path / name).write_bytes(b"partial")
    os.utime(tmp_path / name, (time.time() - age, time.time() - age))
  _lower(a_rows=5)
  assert "a.jaxexport.1.2.tmp" not in _files(tmp_path)
  assert "b.jaxexport.1.2.tmp" in _files(tmp_path)


def test_a_kernel_is_kept_per_lowering_configuration(tmp_path, monkeypatch):
  # The file's key holds what keys the executable store too: jax options that change lowering
  # (here the default matmul precision; the suite runs at "highest") give another file, not
  # the other setting's kernel.
  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path))
  _lower()
  with jax.default_matmul_precision("bfloat16"):
    _once.clear()
    _lower()
  assert len(_files(tmp_path)) == 2


def test_a_kept_kernel_on_a_gpu_readies_mosaic_gpus_runtime_without_its_python(tmp_path,
                                                                               monkeypatch):
  # A process that loads its kernels never builds them, so it never imports Mosaic GPU's Python
  # (0.35 s of a cold H100 process), whose import also tells the custom call where Mosaic GPU's
  # runtime is: loading a CUDA kernel on a GPU readies that runtime instead, once a load.
  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path))
  monkeypatch.setattr(_once, "PRECOMPILE_ON", ())
  readied = []
  monkeypatch.setattr(_once, "_ready_to_run", lambda: readied.append(1))
  _lower()
  assert readied == []  # exported here: built with Mosaic GPU's Python
  for backend, want in (("cpu", []), ("gpu", [1])):
    _once.clear()
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    _lower()
    assert readied == want, backend
  # A kernel kept for another platform than CUDA: nothing to ready.
  monkeypatch.setattr(_once, "_PLATFORMS", ("cpu",))
  loads = []
  real = jax.export.deserialize
  monkeypatch.setattr(jax.export, "deserialize", lambda b: loads.append(1) or real(b))
  for _ in range(2):
    _once.clear()
    jax.jit(lambda a: _once.call("c", jnp.tanh, a, keep=True)).trace(
        jax.ShapeDtypeStruct((8, 16), jnp.float32)).lower(lowering_platforms=("cpu",))
  assert loads == [1] and readied == [1] and len(_files(tmp_path)) == 2


def test_the_runtime_is_readied_by_importing_mosaic_gpu_only_where_the_short_way_fails(
    monkeypatch):
  import sys

  from dynjax import _jax_private

  # None in sys.modules: an import of it raises, so the test sees whether it was tried.
  monkeypatch.setitem(sys.modules, "jax.experimental.mosaic.gpu", None)
  monkeypatch.setattr(_jax_private, "mosaic_gpu_runtime", lambda: None)
  _once._ready_to_run()
  monkeypatch.setattr(_jax_private, "mosaic_gpu_runtime", lambda: "no bindings")
  with pytest.raises(ImportError):
    _once._ready_to_run()


@pytest.mark.parametrize("runtime", [True, False])
def test_mosaic_gpus_runtime_is_found_beside_its_compiled_bindings(runtime, tmp_path,
                                                                    monkeypatch):
  import sys
  import types

  from dynjax import _jax_private

  ext = tmp_path / "_mosaic_gpu_ext.so"
  ext.write_bytes(b"")
  if runtime:
    (tmp_path / "libmosaic_gpu_runtime.so").write_bytes(b"")
  lib = types.ModuleType("jax._src.lib.mosaic_gpu")
  lib._mosaic_gpu_ext = types.SimpleNamespace(__file__=str(ext))
  monkeypatch.setitem(sys.modules, "jax._src.lib.mosaic_gpu", lib)
  monkeypatch.setattr(jax._src.lib, "mosaic_gpu", lib, raising=False)
  monkeypatch.setattr(_jax_private, "_MOSAIC_RUNTIME", [])
  monkeypatch.setenv("MOSAIC_GPU_RUNTIME_LIB_PATH", "/stale")  # replaced, as the import does
  why = _jax_private.mosaic_gpu_runtime()
  if runtime:
    assert why is None
    assert os.environ["MOSAIC_GPU_RUNTIME_LIB_PATH"] == str(tmp_path / "libmosaic_gpu_runtime.so")
  else:
    assert why == f"Mosaic GPU's runtime library is not at {tmp_path / 'libmosaic_gpu_runtime.so'}"
    assert os.environ["MOSAIC_GPU_RUNTIME_LIB_PATH"] == "/stale"
  assert _jax_private.mosaic_gpu_runtime() == why  # once a process
  # Without the bindings (a CPU jaxlib): the reason says so.
  monkeypatch.setitem(sys.modules, "jax._src.lib.mosaic_gpu", None)
  monkeypatch.delattr(jax._src.lib, "mosaic_gpu", raising=False)
  monkeypatch.setattr(_jax_private, "_MOSAIC_RUNTIME", [])
  assert _jax_private.mosaic_gpu_runtime().startswith("Mosaic GPU's compiled bindings did not "
                                                      "import")


def test_an_exported_kernel_runs_under_vmap_also_of_a_jitted_caller(monkeypatch):
  # jax has no batching rule for an exported call: under jax.vmap, and jax.vmap of a function
  # already jitted around it (its jaxpr batched after the fact), the kernel runs once an
  # element; unbatched operands are broadcast.
  monkeypatch.setattr(_once, "_PLATFORMS", HERE)  # an export that runs here
  a = jnp.asarray(np.random.RandomState(0).randn(3, 8, 16), jnp.float32)
  b = jnp.asarray(np.random.RandomState(1).randn(16, 4), jnp.float32)
  call = lambda a, b: _once.call("vm", _kernel, a, b)  # noqa: E731
  want = jax.vmap(_kernel, in_axes=(0, None))(a, b)
  for fn in (jax.vmap(call, in_axes=(0, None)), jax.vmap(jax.jit(call), in_axes=(0, None)),
             jax.jit(jax.vmap(call, in_axes=(0, None)))):
    np.testing.assert_allclose(fn(a, b), want, rtol=1e-6, atol=1e-6)
  assert _once._exported.cache_info().misses == 1  # one export, the element's shapes
