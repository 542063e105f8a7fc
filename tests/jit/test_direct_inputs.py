"""A host request's small numpy inputs copied to the device by the CUDA driver into kept device
arrays (``jit/_cuda.py``, ``_placement.HostBuffers`` kind ``DIRECT``).

On a CPU the driver is a stand-in that memcpys the host buffer into the kept array's memory (a
CPU array's buffer is host memory), so everything around the copy runs for real: which leaves
take it, reuse, zeroed padding, threads, budgets and every fallback.  On a GPU the same tests
run the real driver."""

from __future__ import annotations

import concurrent.futures
import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax._config import config
from dynjax.jit import _cuda, _placement

ON_GPU = jax.default_backend() == "gpu"
KEY = ((8, 64), np.dtype(np.int32), _placement.DIRECT)
LENS = ((8,), np.dtype(np.int32), _placement.DIRECT)


class Memmove:
  """The driver's copies as host memcpys (a CPU array's buffer is host memory); the real
  driver's read-back check of a device."""

  def __init__(self):
    self._verified = set()

  verify = _cuda.Driver.verify

  def host_buffer(self, shape, dtype, ctx):
    return np.zeros(shape, dtype)

  def context_of(self, ptr):
    return 1

  def copy(self, slots):
    for s in slots:
      ctypes.memmove(s.dst, s.src, s.nbytes)


class Counting:
  """The driver (the real one on a GPU), its copies counted, made to fail on demand."""

  def __init__(self, inner):
    self.inner, self.copies, self.fail = inner, 0, None

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def copy(self, slots):
    if self.fail:
      raise _cuda.DriverError(self.fail)
    self.inner.copy(slots)
    self.copies += len(slots)


@pytest.fixture
def drv(monkeypatch):
  inner = _cuda.driver() if ON_GPU else Memmove()
  d = Counting(inner)
  monkeypatch.setattr(_cuda, "_driver", [d])
  monkeypatch.setattr(_placement, "DIRECT_PLATFORMS", (jax.devices()[0].platform,))
  monkeypatch.setattr(config, "direct_inputs", True)
  return d


def embed_pool(p, tokens, lengths):
  x = p["emb"][tokens]
  m = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(x.dtype)
  return (x * m[..., None]).sum(1) / jnp.maximum(lengths, 1)[:, None].astype(x.dtype)


REF = jax.jit(embed_pool)
P = {"emb": jnp.asarray(np.random.RandomState(0).randn(50, 16).astype(np.float32))}


def _req(b, t, seed=0):
  rng = np.random.default_rng(seed + 100 * t + b)
  lengths = rng.integers(1, t + 1, b).astype(np.int32)
  tokens = rng.integers(1, 50, (b, t)).astype(np.int32)
  tokens[np.arange(t)[None] >= lengths[:, None]] = 0
  return tokens, lengths


def _fn(padding="trust", **kw):
  return dynjax.jit(embed_pool, dims={"tokens": "b, t", "lengths": "b"},
                    buckets={"b": [8], "t": [16, 32, 64]}, padding=padding, **kw)


def _family(f):
  return next(iter(f._dispatcher.all_families.values()))


def _check(f, tokens, lengths):
  got = f(P, tokens, lengths)
  assert isinstance(got, np.ndarray)
  np.testing.assert_allclose(got, np.asarray(REF(P, tokens, lengths)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_small_inputs_go_by_the_drivers_copy_exact_and_reused(drv, padding):
  f = _fn(padding)
  ts = (60, 40, 20, 64, 9, 33)  # 60 then 40 in one bucket: the stale tokens after 40
  for t in ts:
    _check(f, *_req(8, t))
  assert f.stats()["direct_inputs_failed"] is None
  assert drv.copies == 2 * len(ts)  # tokens and lengths (not padded: b is 8), each call
  hb = _family(f).host_buffers
  # one pair a bucket for the tokens, one for the lengths of every bucket (one (8,) key),
  # the calls in turn
  assert set(hb.free) == {LENS} | {((8, n), np.dtype(np.int32), _placement.DIRECT)
                                   for n in (16, 32, 64)}
  assert all(len(v) == 1 for v in hb.free.values())
  assert hb.direct_bytes == 2 * 4 * 8 * (16 + 32 + 64 + 1)
  st = f.stats()
  assert (st["direct_input_bytes"], st["direct_inputs_failed"]) == (hb.direct_bytes, None)
  assert (f"small numpy inputs: copied by the CUDA driver into kept device arrays (4 kept, "
          f"{hb.direct_bytes} bytes") in f.explain()
  (host, slot, last), = hb.free[KEY]
  assert last[1] == slice(0, 33) and host is slot.host
  # the kept array holds what the host buffer held at the last call (the copy landed), and
  # the old tokens past the new prefix were zeroed (under auto too: small inputs had fresh
  # zeros before the driver's copies)
  np.testing.assert_array_equal(np.asarray(slot.array), host)
  assert np.abs(host[:, 33:]).sum() == 0 and np.abs(host[:, :33]).sum() > 0


def test_a_padded_batch_axis_and_a_second_family(drv):
  f = _fn("auto")
  for b, t in ((5, 30), (8, 30), (3, 7)):
    _check(f, *_req(b, t))
  assert drv.copies == 6
  hb = _family(f).host_buffers
  assert LENS in hb.free and ((8, 32), np.dtype(np.int32), _placement.DIRECT) in hb.free


def test_a_failed_copy_falls_back_to_jaxs_transfer_and_stops(drv):
  f = _fn("trust")
  _check(f, *_req(8, 20))
  drv.fail = "CUDA_ERROR_ILLEGAL_ADDRESS (test)"
  _check(f, *_req(8, 25))  # the failed call takes the host buffers: still exact
  drv.fail = None
  for t in (30, 50):
    _check(f, *_req(8, t))
  assert drv.copies == 2  # the first call only: the family stopped
  st = f.stats()
  assert "CUDA_ERROR_ILLEGAL_ADDRESS (test)" in st["direct_inputs_failed"]
  assert ("small numpy inputs: JAX's own transfers (the CUDA driver's copies failed: "
          "DriverError: CUDA_ERROR_ILLEGAL_ADDRESS (test))") in f.explain()
  hb = _family(f).host_buffers
  assert ((8, 64), np.dtype(np.int32), None) in hb.free  # numpy buffers since


class _ReadsBackWrong(Memmove):
  def copy(self, slots):
    for s in slots:
      ctypes.memset(s.dst, 0, s.nbytes)


@pytest.mark.parametrize("driver, said", [("reads back wrong", "read back otherwise"),
                                          ("none", "no CUDA driver: test")])
def test_a_driver_that_cannot_be_used_leaves_jaxs_transfer(drv, monkeypatch, driver, said):
  if driver == "reads back wrong":
    if ON_GPU:
      pytest.skip("the stand-in's memsets write host memory")
    d = Counting(_ReadsBackWrong())
  else:
    d = _cuda.DriverError("no CUDA driver: test")
  monkeypatch.setattr(_cuda, "_driver", [d])
  f = _fn("trust")
  for t in (20, 40):
    _check(f, *_req(8, t))
  assert said in f.stats()["direct_inputs_failed"]
  assert f.stats()["direct_input_bytes"] == 0


def test_a_transfer_guard_sees_the_inputs_as_before(drv, caplog):
  # jax.transfer_guard("disallow") refused a numpy call's implicit transfer before the
  # driver's copies; it still does (the call takes JAX's transfer), and "log" logs it
  f = _fn("trust")
  _check(f, *_req(8, 20))
  assert drv.copies == 2
  with jax.transfer_guard_host_to_device("disallow"):
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
      f(P, *_req(8, 30))
  with jax.transfer_guard_host_to_device("log"):
    _check(f, *_req(8, 40))
  assert drv.copies == 2 and f.stats()["direct_inputs_failed"] is None
  _check(f, *_req(8, 50))  # the guard gone: the copies again
  assert drv.copies == 4


@pytest.mark.parametrize("dtype, whole", [
    ("float32", True), ("int32", True), ("bool", True), ("complex64", True),
    ("bfloat16", True), ("float8_e4m3fn", True),
    # one byte each in numpy, packed on the device: the driver's byte copy would be wrong
    ("int4", False), ("uint4", False), ("float4_e2m1fn", False)])
def test_only_dtypes_laid_out_alike_take_the_copy(dtype, whole):
  import ml_dtypes

  dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
  assert _cuda.whole_bytes(dt) is whole


def test_without_libcuda_the_driver_says_so_once(monkeypatch):
  calls = []

  def missing(name):
    calls.append(name)
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")

  monkeypatch.setattr(_cuda, "_driver", [])
  monkeypatch.setattr(_cuda.ctypes, "CDLL", missing)
  for _ in range(2):  # loaded (or not) once a process
    with pytest.raises(_cuda.DriverError, match="no CUDA driver: libcuda.so.1: cannot open"):
      _cuda.driver()
  assert calls == ["libcuda.so.1"]


def test_threads_take_a_pair_each(drv):
  f = _fn("trust")
  rng = np.random.default_rng(3)
  reqs = [_req(8, int(t), seed=i) for i, t in enumerate(rng.choice([5, 20, 37, 64], 48))]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    outs = list(pool.map(lambda r: f(P, *r), reqs))
  for r, got in zip(reqs, outs, strict=True):
    np.testing.assert_allclose(got, np.asarray(REF(P, *r)), rtol=1e-6, atol=1e-6)
  assert f.stats()["direct_inputs_failed"] is None  # (pairs made on the pool's threads too)
  assert drv.copies == 2 * len(reqs)
  kept = _family(f).host_buffers.free
  assert all(1 <= len(v) <= _placement.DIRECT_PER_KEY for v in kept.values())


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("case", ["device request", "return_padded", "donated", "off",
                                  "int64 tokens", "over budget"])
def test_calls_that_do_not_take_it(drv, monkeypatch, case):
  kw = {}
  tokens, lengths = _req(8, 20)
  if case == "return_padded":
    kw["return_padded"] = True
  elif case == "donated":
    kw["donate_argnames"] = ("tokens", "lengths")
  elif case == "off":
    monkeypatch.setattr(config, "direct_inputs", False)
  elif case == "int64 tokens":  # the call converts it (x64 off): JAX's transfer
    tokens = tokens.astype(np.int64)
  elif case == "over budget":
    monkeypatch.setattr(_placement, "DIRECT_MAX_BYTES", 2 * 4 * 8 * 32 - 1)
  f = _fn("trust", **kw)
  args = (jnp.asarray(tokens), jnp.asarray(lengths)) if case == "device request" else (
      tokens, lengths)
  got = f(P, *args)
  got = got.unpad() if case == "return_padded" else got
  np.testing.assert_allclose(np.asarray(got), np.asarray(REF(P, tokens, lengths)), rtol=1e-6,
                             atol=1e-6)
  hb = _family(f).host_buffers
  direct = {k for k in hb.free if k[2] == _placement.DIRECT}
  if case == "int64 tokens":  # the lengths (int32) still take it
    assert direct == {LENS} and drv.copies == 1
  elif case == "over budget":  # the tokens' pair (8 x 32) does not fit; the lengths' does
    assert direct == {LENS} and drv.copies == 1
  else:
    assert direct == set() and drv.copies == 0 and hb.direct_bytes == 0
    assert "small numpy inputs" not in f.explain()


@pytest.mark.skipif(not ON_GPU, reason="the real driver: GPU only")
def test_a_slot_round_trips_on_the_gpu():
  import threading

  d = _cuda.driver()
  slots = []  # one made on a thread of its own (no context current there at first)
  th = threading.Thread(target=lambda: slots.append(
      _cuda.Slot(d, jax.devices()[0], (3, 5), np.float32)))
  th.start()
  th.join()
  slot = slots[0]
  slot.host[...] = np.arange(15, dtype=np.float32).reshape(3, 5)
  d.copy([slot])
  np.testing.assert_array_equal(np.asarray(slot.array + 0), slot.host)
