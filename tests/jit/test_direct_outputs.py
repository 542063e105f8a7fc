"""A host request's results read by the CUDA driver from device outputs (``_cuda.Driver.read``,
``_placement.READS``): a stream of ours waits for each result on the device
(``__dlpack__(stream=...)``), the driver copies it into a new numpy array, one sync.

On a CPU the driver is a stand-in whose stream is None (a CPU array's ``__dlpack__`` takes no
stream) and whose copy is a host memcpy, so ``read`` itself, its checks of the DLPack tensor,
the plan, the fallbacks and every caller run for real.  On a GPU the same tests run the real
driver."""

from __future__ import annotations

import ctypes

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax._config import config
from dynjax.jit import _cuda, _placement

ON_GPU = jax.default_backend() == "gpu"


class HostReads(_cuda.Driver):
  """``_cuda.Driver``'s reads over a CPU array's memory: no stream, memcpy copies."""

  READ_DEVICE = 1  # DLPack's kDLCPU

  def __init__(self):  # (no libcuda)
    self._read_ctx, self.reads, self.fail, self.wrong = {}, 0, None, False

  def context_of(self, ptr):
    return 1

  def stream(self, ctx):  # (a CPU array's __dlpack__ takes no stream)
    return None

  def copy_out(self, dst, src, nbytes, stream):
    ctypes.memmove(dst, src, nbytes)
    if self.wrong:  # a driver that reads back otherwise
      ctypes.memset(dst, 0, nbytes)

  def read(self, arrays, ctx=None):
    self.reads += 1  # (asked: counted also where it fails)
    if self.fail:
      raise _cuda.DriverError(self.fail)
    return super().read(arrays, ctx)


class Counting:
  """The real driver on a GPU, its reads counted, made to fail on demand."""

  def __init__(self, inner):
    self.inner, self.reads, self.fail = inner, 0, None

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def read(self, arrays, ctx=None):
    self.reads += 1  # (asked: counted also where it fails)
    if self.fail:
      raise _cuda.DriverError(self.fail)
    return self.inner.read(arrays, ctx)


@pytest.fixture
def drv(monkeypatch):
  d = Counting(_cuda.driver()) if ON_GPU else HostReads()
  monkeypatch.setattr(_cuda, "_driver", [d])
  platform = jax.devices()[0].platform
  monkeypatch.setattr(_placement, "AUTO_PLATFORMS", ("gpu", platform))
  monkeypatch.setattr(_placement, "READ_PLATFORMS", (platform,))
  monkeypatch.setattr(_placement, "_reads", {})
  monkeypatch.setattr(config, "direct_outputs", True)
  return d


def fn(p, x, mask):
  h = jnp.tanh(x @ p["w"])  # (b, t, 8): sliced back to the request's t
  pooled = jnp.sum(h * mask[..., None], axis=1)  # (b, 8)
  return {"h": h, "pooled": pooled, "any": jnp.any(h > 0, axis=-1),
          "half": h.astype(jnp.bfloat16), "step": jnp.sum(p["w"])}


P = {"w": jnp.asarray(np.random.RandomState(0).randn(8, 8), jnp.float32)}
REF = jax.jit(fn)


def _x(b, t, seed=0):
  rng = np.random.RandomState(seed + t)
  return rng.randn(b, t, 8).astype(np.float32), (rng.rand(b, t) > 0.3).astype(np.float32)


def _same(got, want):
  for k in want:
    if k == "step":  # no dims: stays a device array, as jax.jit returns it
      assert isinstance(got[k], jax.Array)
    else:
      assert type(got[k]) is np.ndarray, (k, type(got[k]))
    assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
    np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_host_requests_results_are_read_by_the_driver_exactly(drv, padding):
  f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"}, padding=padding)
  n0 = None
  for b, t in [(3, 13), (4, 16), (3, 9), (2, 5)]:
    x, m = _x(b, t)
    _same(f(P, x, m), REF(P, x, m))
    n0 = drv.reads if n0 is None else n0  # (the first call's plan verified the device)
  fam = next(iter(f._dispatcher.all_families.values()))
  assert not fam.host_out and not any(e.host_out for e in fam.buckets.values())
  assert drv.reads - n0 == 3
  st = f.stats()
  assert st["direct_output_families"] == 1 and st["direct_outputs_failed"] is None
  assert st["host_outputs"] == 0
  assert "outputs in device memory (the first call was a host request; read by the CUDA " \
         "driver" in f.explain()
  # a device request of the same family: device arrays back, not read
  x, m = _x(3, 13)
  got = f(P, jnp.asarray(x), jnp.asarray(m))
  assert isinstance(got["h"], jax.Array) and drv.reads - n0 == 3
  np.testing.assert_allclose(np.asarray(got["h"]), np.asarray(REF(P, x, m)["h"]), rtol=1e-6)


def test_a_read_that_fails_leaves_the_runtimes_copies_exact(drv):
  f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"})
  x, m = _x(3, 13)
  _same(f(P, x, m), REF(P, x, m))
  n0 = drv.reads
  drv.fail = "CUDA_ERROR_LAUNCH_FAILED (719)"
  for t in (13, 11, 9):
    x, m = _x(3, t)
    _same(f(P, x, m), REF(P, x, m))
  assert drv.reads == n0 + 1  # the failed one asked, then never again for this family
  assert f.stats()["direct_output_families"] == 1
  assert "CUDA_ERROR_LAUNCH_FAILED" in f.stats()["direct_outputs_failed"]
  assert "the driver's reads failed, the runtime copies" in f.explain()


def test_a_result_that_is_not_a_dense_device_buffer_is_refused(drv, monkeypatch):
  # read's own check of the DLPack tensor (here: another device type than it copies from)
  x = jnp.arange(12.0).reshape(3, 4) * 2
  assert _placement.reads_ready(next(iter(x.devices())))  # (verified: read_stream serves it)
  monkeypatch.setattr(type(drv.inner) if ON_GPU else HostReads, "READ_DEVICE", 99)
  with pytest.raises(_cuda.DriverError, match=r"float32 \(3, 4\) result is not a dense device "
                                              r"buffer of its own shape and dtype"):
    (drv.inner if ON_GPU else drv).read([x])


def test_a_driver_that_reads_back_otherwise_keeps_pinned_host_outputs(monkeypatch):
  if ON_GPU:
    pytest.skip("the stand-in's wrong read (the GPU's real driver reads right)")
  d = HostReads()
  d.wrong = True
  monkeypatch.setattr(_cuda, "_driver", [d])
  platform = jax.devices()[0].platform
  monkeypatch.setattr(_placement, "AUTO_PLATFORMS", ("gpu", platform))
  monkeypatch.setattr(_placement, "READ_PLATFORMS", (platform,))
  monkeypatch.setattr(_placement, "_reads", {})
  f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"})
  x, m = _x(3, 13)
  _same(f(P, x, m), REF(P, x, m))
  assert f.stats()["host_outputs"] == 1 and f.stats()["direct_output_families"] == 0
  assert "read back otherwise" in next(iter(_placement._reads.values()))


@pytest.mark.parametrize("switch", ["config", "host_outputs"])
def test_switched_off_the_outputs_take_their_old_placement(drv, monkeypatch, switch):
  if switch == "config":
    monkeypatch.setattr(config, "direct_outputs", False)
    f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"})
  else:
    f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"}, host_outputs=True)
  x, m = _x(3, 13)
  _same(f(P, x, m), REF(P, x, m))
  assert f.stats()["host_outputs"] == 1 and drv.reads == 0


def test_reads_under_a_transfer_guard_go_through_the_runtime(drv):
  f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"})
  x, m = _x(3, 13)
  _same(f(P, x, m), REF(P, x, m))
  n0 = drv.reads
  with jax.transfer_guard_device_to_host("log"):
    _same(f(P, x, m), REF(P, x, m))
  assert drv.reads == n0
  _same(f(P, x, m), REF(P, x, m))
  assert drv.reads == n0 + 1


def test_the_devices_check_compiles_nothing(drv, compiles):
  # (a compile there would land in every process's first host request, and in compile counts)
  x, m = _x(3, 13)
  f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"})
  jax.clear_caches()  # (an op the check ran would compile again here)
  want = REF(P, x, m)
  start = compiles()
  _same(f(P, x, m), want)
  assert compiles() - start == f.stats()["compiles"] == 1


def test_reads_under_threads_are_each_their_own(drv):
  import concurrent.futures

  f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"})
  cases = [_x(b, t, seed=s) for s, (b, t) in enumerate([(3, 13), (4, 16), (3, 9), (2, 5)] * 6)]
  wants = [REF(P, x, m) for x, m in cases]
  f(P, *cases[0])
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    gots = list(pool.map(lambda c: f(P, *c), cases))
  for got, want in zip(gots, wants, strict=True):
    _same(got, want)
  assert f.stats()["direct_output_families"] == 1 and f.stats()["direct_outputs_failed"] is None


def test_a_read_verifies_its_device_and_reads_empty_arrays(drv):
  d = drv.inner if ON_GPU else drv
  x = jnp.arange(24, dtype=jnp.int32).reshape(2, 3, 4)
  empty = jnp.zeros((3, 0), jnp.bfloat16)
  got, none = d.read([x + 1, empty])  # (the device verified on the way: read_stream)
  np.testing.assert_array_equal(got, np.arange(24).reshape(2, 3, 4) + 1)
  assert got.dtype == np.int32 and none.shape == (3, 0) and none.dtype == empty.dtype
  assert next(iter(x.devices())) in d._read_ctx


def test_sub_byte_outputs_keep_pinned_host_outputs(drv):
  # int4 is one byte an element in numpy, packed on the device: the driver copies bytes
  def quantize(x):
    return jnp.clip(jnp.round(x * 3), -8, 7).astype(jnp.int4)

  f = dynjax.jit(quantize, dims={"x": "b, t"})
  x = np.random.RandomState(0).randn(3, 13).astype(np.float32)
  got = f(x)
  np.testing.assert_array_equal(np.asarray(got, np.int8),
                                np.asarray(jax.jit(quantize)(x), np.int8))
  assert f.stats()["direct_output_families"] == 0 and f.stats()["host_outputs"] == 1


def test_exact_runs_results_are_read_too(drv):
  f = dynjax.jit(fn, dims={"x": "b, t, 8", "mask": "b, t"}, padding="exact")
  n0 = None
  for b, t in [(3, 13), (4, 16), (3, 13)]:
    x, m = _x(b, t)
    _same(f(P, x, m), REF(P, x, m))
    n0 = drv.reads if n0 is None else n0
  assert drv.reads - n0 == 2 and f.stats()["direct_outputs_failed"] is None


def test_a_restart_across_the_switch_loads_the_placement_its_store_holds(drv, tmp_path,
                                                                          monkeypatch):
  # A store written with the reads off (pinned host outputs) serves a restart that plans the
  # reads, and the other way round: no compile, the same results.
  kw = dict(dims={"x": "b, t, 8", "mask": "b, t"}, cache_dir=str(tmp_path),
            buckets=dynjax.buckets.pow2(4, 16))
  x, m = _x(3, 13)
  for first, then in ((False, True), (True, False)):
    root = tmp_path / f"from_{first}"
    monkeypatch.setattr(config, "direct_outputs", first)
    f = dynjax.jit(fn, **{**kw, "cache_dir": str(root)})
    _same(f(P, x, m), REF(P, x, m))
    assert f.stats()["direct_output_families"] == int(first)
    monkeypatch.setattr(config, "direct_outputs", then)
    g = dynjax.jit(fn, **{**kw, "cache_dir": str(root)})
    _same(g(P, x, m), REF(P, x, m))
    st = g.stats()
    assert st["compiles"] == 0 and st["loaded_from_store"] == 1
    # (pinned host outputs loaded: not read; device outputs loaded with the reads off: the
    # runtime's copies)
    assert st["direct_output_families"] == 0
    assert "its cache_dir holds executables with" in g.explain()


def test_a_bucket_with_large_outputs_leaves_them_to_the_runtime(drv, monkeypatch):
  # as pinned host outputs stop at MAX_BYTES: (4, 16) float32 read, (4, 32) not
  monkeypatch.setattr(_placement, "MAX_BYTES", 4 * 16 * 4)
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"})
  np.testing.assert_array_equal(f(np.ones((3, 13), np.float32)), np.full((3, 13), 2.0))
  n0 = drv.reads
  for t in (13, 30, 30, 14):
    x = np.arange(3 * t, dtype=np.float32).reshape(3, t)
    got = f(x)
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, x * 2)
  assert drv.reads - n0 == 2 and f.stats()["direct_output_families"] == 1


DTYPES = [np.float32, np.float16, jnp.bfloat16, np.int8, np.uint32, np.int16, np.bool_,
          np.complex64, jnp.float8_e4m3fn]


@hypothesis.settings(suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
                  dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_a_read_is_the_runtimes_copy_bitwise(drv, shape, dtype, seed):
  # (the driver stand-in is one for all examples: it holds no state between reads)
  x = np.random.RandomState(seed).randn(*shape) * 4
  a = jnp.asarray(x.astype(np.complex64) * (1 + 1j) if dtype is np.complex64 else x, dtype)
  a = a[::-1] if a.ndim else a  # (a computed result, not the uploaded buffer itself)
  d = drv.inner if ON_GPU else drv
  (got,) = d.read([a])
  want = np.asarray(a)
  assert got.shape == want.shape and got.dtype == want.dtype
  assert got.tobytes() == want.tobytes()
