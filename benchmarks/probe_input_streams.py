"""A request's small numpy inputs on a GPU without a host sync: the driver's copy ordered on
JAX's own stream through ``jax.dlpack.from_dlpack``, against dynjax's copy + host sync.

  python benchmarks/probe_input_streams.py [--out DIR] [--t 128,256]
  python benchmarks/probe_input_streams.py --check       # the producer's capsules, on any backend

dynjax copies a host request's small numpy inputs into kept device arrays on a stream of its
own and waits on the host for the copies before it runs the executable (``jit/_cuda.py``,
session 32; ~45-65 us a request in a trace).  ``jax.dlpack.from_dlpack(x)`` asks the producer
``x.__dlpack__(stream=s)`` with ``s`` JAX's stream for external ready events: a producer that
queues its copy on ``s`` and returns a DLPack tensor of the destination gets an array that the
executable waits for on the device.  :class:`Upload` is such a producer (its capsule built with
ctypes; the memory stays the kept array's).

Rows (the e2e probes' small call, ``probe_transfers.embed_sum``: (8, t) int32 tokens and (8,)
lengths in, pinned host output, ``np.asarray``), median us of ``--n`` calls taking turns:
``sync_copy`` the two copies queued on a stream of ours, one host sync, the executable on the
kept arrays (dynjax's way); ``from_dlpack`` each input imported by ``from_dlpack`` with its
copy queued on JAX's stream, no host wait; ``device_in`` the inputs already on the device (the
floor).  Each row's results are checked against the numpy call's on every call of a first
pass.  Writes DIR/probe_input_streams.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import jax
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402
from benchmarks.probe_moe_call import take_turns  # noqa: E402
from benchmarks.probe_transfers import embed_sum  # noqa: E402
from dynjax.jit import _cuda  # noqa: E402

_KDL_CPU, _KDL_CUDA = 1, 2
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_LIVE: dict = {}  # address -> the struct of a capsule a consumer still holds


@_DELETER
def _release(addr) -> None:  # the consumer is done: its struct may go (the memory is ours)
  _LIVE.pop(addr, None)



class _Managed(ctypes.Structure):
  _fields_ = [("dl_tensor", _cuda._DLTensor), ("manager_ctx", ctypes.c_void_p),
              ("deleter", _DELETER)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}  # DLPack's type codes by numpy kind


class Upload:
  """A DLPack producer: ``host``'s bytes copied into ``dst`` (a kept device array's memory) on
  the stream its consumer names, and ``dst`` handed over as the tensor.  ``copy(dst, src, n,
  stream)`` does the copy (the driver's async copy; a memmove on the CPU check)."""

  def __init__(self, host: np.ndarray, dst: int, device_type: int, device_id: int, copy):
    self.host, self.dst, self.copy = host, dst, copy
    self.device = (device_type, device_id)
    self._shape = (ctypes.c_int64 * max(1, host.ndim))(*host.shape)

  def __dlpack_device__(self):
    return self.device

  def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
    del max_version, dl_device, copy  # (an unversioned capsule, no copy asked of us)
    self.copy(self.dst, self.host.ctypes.data, self.host.nbytes, stream)
    m = _Managed()
    t = m.dl_tensor
    t.data, t.ndim, t.byte_offset = self.dst, self.host.ndim, 0
    t.device.device_type, t.device.device_id = self.device
    t.dtype.code, t.dtype.bits = _CODES[self.host.dtype.kind], 8 * self.host.dtype.itemsize
    t.dtype.lanes = 1
    t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = None  # dense, row-major
    m.deleter = _release
    _LIVE[ctypes.addressof(m)] = (m, self._shape)  # (alive until the consumer releases it)
    return _new_capsule(ctypes.addressof(m), b"dltensor", None)


def check() -> dict:
  """The producer's capsules on this backend's CPU form: a numpy buffer's bytes memmoved into
  another numpy buffer, imported by ``from_dlpack``, read back equal (what a GPU run relies
  on, but the stream and the device type)."""
  out = {}
  for dtype in (np.int32, np.float32, np.uint8, np.bool_):
    src = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    dst = np.zeros_like(src)
    up = Upload(src, dst.ctypes.data, _KDL_CPU, 0,
                lambda d, s, n, stream: ctypes.memmove(d, s, n))
    arr = jax.dlpack.from_dlpack(up)
    out[np.dtype(dtype).name] = bool(np.array_equal(np.asarray(arr), src)
                                     and arr.shape == src.shape and arr.dtype == src.dtype)
  print(f"capsules read back equal: {out}", flush=True)
  return out


def one_length(t: int, n: int, rounds: int, emb) -> dict:
  b = 8
  rng = np.random.default_rng(t)
  toks = [rng.integers(1, emb.shape[0], (b, t)).astype(np.int32) for _ in range(16)]
  lens = [rng.integers(1, t + 1, b).astype(np.int32) for _ in range(16)]
  dev = jax.devices()[0]
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  exe = jax.jit(embed_sum, out_shardings=pinned).lower(emb, toks[0], lens[0]).compile()
  drv = _cuda.driver()
  slots = [_cuda.Slot(drv, dev, x.shape, np.int32) for x in (toks[0], lens[0])]
  ctx = slots[0].ctx

  def htod(dst, src, nbytes, stream):
    drv.check(drv.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    drv.check(drv.lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")
    if stream is None:  # (JAX named no stream: it would not wait for ours, so we do)
      drv.sync(None)

  ups = [Upload(s.host, s.dst, _KDL_CUDA, dev.local_hardware_id, htod) for s in slots]
  dtoks = [jax.device_put(x, dev) for x in toks]
  dlens = [jax.device_put(x, dev) for x in lens]
  k = [0]

  def nxt():
    k[0] = (k[0] + 1) % 16
    return k[0]

  def sync_copy():
    i = nxt()
    slots[0].host[...], slots[1].host[...] = toks[i], lens[i]
    drv.copy(slots)
    return i, np.asarray(exe(emb, slots[0].array, slots[1].array))

  def from_dlpack():
    i = nxt()
    ups[0].host[...], ups[1].host[...] = toks[i], lens[i]
    return i, np.asarray(exe(emb, jax.dlpack.from_dlpack(ups[0]),
                             jax.dlpack.from_dlpack(ups[1])))

  def device_in():
    i = nxt()
    return i, np.asarray(exe(emb, dtoks[i], dlens[i]))

  calls = {"sync_copy": sync_copy, "from_dlpack": from_dlpack, "device_in": device_in}
  exact = {}
  for name, call in calls.items():  # every call's result against the numpy call's
    ok = True
    for _ in range(32):
      i, got = call()
      ok &= bool(np.array_equal(got, np.asarray(exe(emb, toks[i], lens[i]))))
    exact[name] = ok
  ts = take_turns(calls, n, rounds)
  res = {name: float(np.median(v) * 1e6) for name, v in ts.items()}
  res["exact"] = exact
  print(f"t={t}: " + "  ".join(f"{k} {v:.1f}" for k, v in res.items() if isinstance(v, float))
        + f"  (us; exact {exact})", flush=True)
  return res


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--t", default="128,256")
  ap.add_argument("--n", type=int, default=600)
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--check", action="store_true", help="only the capsules' CPU check")
  args = ap.parse_args(argv)
  report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "check": check()}
  if not args.check:
    emb = jax.device_put(np.random.default_rng(0).standard_normal((30522, 1024)).astype(
        np.float32))
    report["lengths"] = {t: one_length(t, args.n, args.rounds, emb)
                         for t in (int(x) for x in args.t.split(",") if x)}
  write_json(args.out, "probe_input_streams.json", report)
  return report


if __name__ == "__main__":
  main()
