"""Host-to-device copies of a request's small numpy inputs through the CUDA driver.

JAX moves each numpy argument of a call to the GPU on its own: a staging copy, a transfer on
its copy stream, an event the computation waits on.  On the H100/H200 hosts that costs ~50-60
us an argument, where torch's put of the same tokens takes ~17 us.  Measured (H200, jax
0.11.2, ``benchmarks/probe_direct_inputs.py``: an embedding gather over (8, t) int32 tokens
and (8,) lengths, pinned host output, ``np.asarray`` of it, median us a call): t=128 JAX's
transfer 194.8, these copies 132.0 (through ``dynjax.jit``: 190.5 -> 131.0), inputs already
on the device 82.7, torch eager's whole call 48.6; t=256 177.2 / 116.1 (182.8 -> 118.4) /
78.8 / 57.7.  Issue 19's MoE encoder: 0.08-0.12 ms less a request; BERT-base: level (its
~200 parameter arguments keep the host busy while JAX's transfer lands).

So a host request's numpy input leaves of a GPU bucket (``_placement.HostBuffers``, kind
``DIRECT``) go into a pinned host buffer (``cuMemHostAlloc``), and the driver copies that
buffer, on a stream of ours, into a device array kept beside it (made by ``jax.device_put``;
its address from the public ``unsafe_buffer_pointer``).  The call waits for the copies, then
runs the executable on the kept arrays; the pair goes back to the family's pool only once the
call holds its numpy results (the executable has finished reading the array), one call at a
time per pair.  No JAX API writes into an existing array: this is the one place that does,
only into arrays no one else holds.

Only where libcuda loads and the kept array's memory is device memory of a CUDA context;
anything else raises :class:`DriverError` and the input takes JAX's own path (the family's
``HostBuffers.direct_failed`` keeps why).  ``DYNJAX_DIRECT_INPUTS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
import weakref
from typing import NamedTuple

import jax
import numpy as np

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2
_CU_STREAM_NON_BLOCKING = 1
_CU_MEMHOSTALLOC_PORTABLE = 1
_KDL_CUDA = 2  # DLPack's device type of CUDA device memory


class _DLDevice(ctypes.Structure):
  _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
  """DLPack's tensor (the head of the ``dltensor`` capsule's DLManagedTensor)."""

  _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
              ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
              ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DriverError(RuntimeError):
  """The driver is missing, or refused a call: the input takes JAX's own path."""


class Driver:
  """libcuda's C API, the few calls the copies need."""

  READ_DEVICE = _KDL_CUDA  # the DLPack device type :meth:`read` copies from

  def __init__(self, lib):
    self.lib = lib
    u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
    lib.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, sz, vp]
    lib.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, sz, vp]
    lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_uint]
    lib.cuMemFreeHost.argtypes = [vp]
    lib.cuPointerGetAttribute.argtypes = [vp, ctypes.c_int, u64]
    lib.cuCtxSetCurrent.argtypes = [vp]
    lib.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    lib.cuStreamSynchronize.argtypes = [vp]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
    self.check(lib.cuInit(0), "cuInit")
    self._local = threading.local()  # per thread: {context: stream}
    self._contexts: dict = {}  # device ordinal -> its primary context
    self._verified: set = set()  # devices whose copies read back
    self._read_ctx: dict = {}  # device -> its context, once verify_reads passed

  def check(self, rc: int, what: str) -> None:
    if rc != 0:
      name = ctypes.c_char_p()
      self.lib.cuGetErrorName(rc, ctypes.byref(name))
      raise DriverError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

  def context_of(self, ptr: int) -> int:
    """The primary context of the device whose memory ``ptr`` is (XLA runs in the primary
    contexts; the pointer's own context attribute is empty for memory of the stream-ordered
    and virtual-memory allocators); DriverError where it is not device memory."""
    kind = ctypes.c_uint()
    self.check(self.lib.cuPointerGetAttribute(ctypes.byref(kind),
                                              _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr),
               "cuPointerGetAttribute(memory type)")
    if kind.value != _CU_MEMORYTYPE_DEVICE:
      raise DriverError(f"the array's memory is not device memory (CUmemorytype {kind.value})")
    ordinal = ctypes.c_int()
    self.check(self.lib.cuPointerGetAttribute(ctypes.byref(ordinal),
                                              _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
               "cuPointerGetAttribute(device ordinal)")
    ctx = self._contexts.get(ordinal.value)
    if ctx is None:
      dev, c = ctypes.c_int(), ctypes.c_void_p()
      self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal.value), "cuDeviceGet")
      self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev),
                 "cuDevicePrimaryCtxRetain")
      ctx = self._contexts[ordinal.value] = c.value
    return ctx

  def verify(self, device) -> None:
    """Once a device: a pattern copied into a fresh array of it reads back the same (so a
    wrong context or address fails here, never as a wrong result)."""
    if device in self._verified:
      return
    arr = jax.device_put(np.zeros(64, np.uint8), jax.sharding.SingleDeviceSharding(device))
    arr.block_until_ready()
    ptr = arr.unsafe_buffer_pointer()
    ctx = self.context_of(ptr)
    host = self.host_buffer((64,), np.uint8, ctx)
    host[...] = np.arange(7, 7 + 64, dtype=np.uint8)
    self.copy([_Copy(ctx, ptr, host.ctypes.data, host.nbytes)])
    back = np.asarray(arr)
    if not np.array_equal(back, host):
      raise DriverError(f"a copy into an array of {device} read back otherwise "
                        f"({back[:8].tolist()}... for {host[:8].tolist()}...)")
    self._verified.add(device)

  def host_buffer(self, shape: tuple, dtype, ctx: int) -> np.ndarray:
    """A zeroed numpy array in pinned (page-locked, portable) host memory, allocated in the
    context ``ctx`` (a thread may have none current), freed with the array."""
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    ptr = ctypes.c_void_p()
    self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    self.check(self.lib.cuMemHostAlloc(ctypes.byref(ptr), nbytes, _CU_MEMHOSTALLOC_PORTABLE),
               "cuMemHostAlloc")
    raw = (ctypes.c_char * nbytes).from_address(ptr.value)
    weakref.finalize(raw, _free_host, self.lib, ptr.value)
    out = np.frombuffer(raw, np.dtype(dtype), count=int(np.prod(shape))).reshape(shape)
    out[...] = 0
    return out

  def stream(self, ctx: int) -> int:
    """This thread's stream of ours in ``ctx``, made current (created on first use)."""
    streams = getattr(self._local, "streams", None)
    if streams is None:
      streams = self._local.streams = {}
    self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    stream = streams.get(ctx)
    if stream is None:
      s = ctypes.c_void_p()
      self.check(self.lib.cuStreamCreate(ctypes.byref(s), _CU_STREAM_NON_BLOCKING),
                 "cuStreamCreate")
      stream = streams[ctx] = s.value
    return stream

  def copy(self, slots) -> None:
    """Each slot's host buffer into its device array; returns once all have landed."""
    by_ctx: dict = {}
    for slot in slots:  # (one device a call: one context)
      by_ctx.setdefault(slot.ctx, []).append(slot)
    for ctx, group in by_ctx.items():
      stream = self.stream(ctx)
      for slot in group:
        self.check(self.lib.cuMemcpyHtoDAsync_v2(slot.dst, slot.src, slot.nbytes, stream),
                   "cuMemcpyHtoDAsync")
      self.sync(stream)

  def sync(self, stream) -> None:
    self.check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

  def copy_out(self, dst: int, src: int, nbytes: int, stream) -> None:
    self.check(self.lib.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")

  def read_stream(self, device):
    """The stream :meth:`read` copies on for arrays of ``device`` (verified first, once)."""
    ctx = self._read_ctx.get(device)
    if ctx is None:
      if device is None:
        raise DriverError("an array on several devices")
      self.verify_reads(device)  # (a function run under another jax.default_device)
      ctx = self._read_ctx[device]
    return self.stream(ctx)

  def read(self, arrays, ctx: int | None = None) -> list:
    """Each device array's values as a new numpy array, copied by the driver on a stream of
    ours that first waits, on the device, for the array to be computed (``__dlpack__(stream=
    ...)``, the Array API's way to hand an array to another stream).  The runtime's own
    ``np.asarray`` waits on the host for the computation, then copies and waits again.
    DriverError (nothing half-copied returned) where an array is not a dense device buffer
    of its own shape and dtype.  ``ctx``: the arrays' context (the device check's own read).

    The hot path of a host request's results on a GPU.  Measured (H200, jax 0.11.2, issue 19's
    MoE encoder through ``dynjax.flax.jit``, numpy in and out, one (8, 1024) float32 result):
    100-180 us less a request than pinned host outputs (``_placement.READS``)."""
    caps, outs, stream = [], [], None
    try:
      for a in arrays:
        dtype = np.dtype(a.dtype)
        if not a.size:  # (no bytes to wait for)
          outs.append(np.empty(a.shape, dtype))
          continue
        if ctx is not None:
          stream = self.stream(ctx)
        else:
          devices = a.sharding.device_set
          stream = self.read_stream(next(iter(devices)) if len(devices) == 1 else None)
        cap = a.__dlpack__(stream=stream)  # (the device-side wait; a reference to a's buffer)
        caps.append(cap)
        t = _DLTensor.from_address(_capsule_pointer(cap, b"dltensor"))
        shape = tuple(t.shape[:t.ndim])
        if (t.device.device_type != self.READ_DEVICE or shape != tuple(a.shape)
            or t.dtype.bits * t.dtype.lanes != 8 * dtype.itemsize
            or t.strides and tuple(t.strides[:t.ndim]) != _row_major(shape)):  # (NULL: dense)
          raise DriverError(f"a {dtype} {tuple(a.shape)} result is not a dense device buffer "
                            f"of its own shape and dtype")
        out = np.empty(a.shape, dtype)
        if out.nbytes:
          self.copy_out(out.ctypes.data, t.data + t.byte_offset, out.nbytes, stream)
        outs.append(out)
      if stream is not None:
        self.sync(stream)
        stream = None
      return outs
    finally:
      if stream is not None:  # a copy may be in flight into an array about to be dropped
        try:
          self.sync(stream)
        except DriverError:
          pass
      del caps  # the references to the results' buffers, held until the copies landed

  def verify_reads(self, device) -> None:
    """Once a device: an array of a pattern, read by :meth:`read`, comes back the same (only
    then do reads from it go ahead; one thread checks, the others wait for its answer)."""
    with _verify_lock:
      if device in self._read_ctx:
        return
      want = np.arange(3, 3 + 64, dtype=np.float32).reshape(4, 16)
      where = jax.sharding.SingleDeviceSharding(device)
      first = jax.device_put(np.zeros_like(want), where)
      first.block_until_ready()
      ctx = self.context_of(first.unsafe_buffer_pointer())
      # (an array still in flight, as a result is; a transfer, not a computation: no compile,
      # which every function's first host request would otherwise pay, once a process)
      (back,) = self.read([jax.device_put(want, where)], ctx)
      if not np.array_equal(back, want):
        raise DriverError(f"a result of {device} read back otherwise ({back.ravel()[:4]}... "
                          f"for {want.ravel()[:4]}...)")
      self._read_ctx[device] = ctx


@functools.lru_cache(maxsize=256)
def _row_major(shape: tuple) -> tuple:
  """The element strides of a dense row-major array of ``shape``."""
  return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _free_host(lib, ptr) -> None:
  try:
    lib.cuMemFreeHost(ptr)
  except Exception:  # noqa: BLE001 - at interpreter exit the library may be gone
    pass


class _Copy(NamedTuple):
  ctx: int
  dst: int
  src: int
  nbytes: int


class Slot:
  """A pinned host buffer (``host``, numpy) and the device array it is copied into
  (``array``): one padded input of one bucket shape, reused by one call at a time."""

  __slots__ = ("host", "array", "ctx", "dst", "src", "nbytes")

  def __init__(self, driver, device, shape: tuple, dtype):
    driver.verify(device)
    self.array = jax.device_put(np.zeros(shape, dtype), jax.sharding.SingleDeviceSharding(device))
    self.array.block_until_ready()
    self.dst = self.array.unsafe_buffer_pointer()
    self.ctx = driver.context_of(self.dst)
    self.host = driver.host_buffer(shape, dtype, self.ctx)
    self.src = self.host.ctypes.data
    self.nbytes = self.host.nbytes


_lock = threading.Lock()
_verify_lock = threading.Lock()  # (Driver.verify_reads)
_driver: list = []  # [Driver] or [DriverError]: loaded once a process


def driver() -> Driver:
  """The process's driver, loaded once; DriverError where there is none."""
  if not _driver:
    with _lock:
      if not _driver:
        try:
          _driver.append(Driver(ctypes.CDLL("libcuda.so.1")))
        except (OSError, AttributeError, DriverError) as e:
          _driver.append(DriverError(f"no CUDA driver: {e}"))
  d = _driver[0]
  if isinstance(d, DriverError):
    raise d
  return d


if hasattr(os, "register_at_fork"):  # a forked child starts its own (or none)
  os.register_at_fork(after_in_child=_driver.clear)


@functools.cache
def whole_bytes(dtype) -> bool:
  """Whether ``dtype``'s elements are whole bytes, as numpy lays them out, on the device too:
  numpy's own kinds and ml_dtypes' 8- and 16-bit floats; not int4/uint4/int2/float4 (one an
  unpacked byte in numpy, packed on the device: the driver copies bytes as they are)."""
  if dtype.kind in "biufc":
    return True
  try:
    import ml_dtypes  # noqa: PLC0415 - jax's own dependency

    info = ml_dtypes.finfo(dtype) if "float" in dtype.name else ml_dtypes.iinfo(dtype)
    return info.bits == 8 * dtype.itemsize
  except Exception:  # noqa: BLE001 - an unknown kind: JAX's transfer
    return False
