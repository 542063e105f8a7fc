"""Where a bucket executable's outputs live: device memory, or pinned host memory.

A host request (numpy in, numpy out: a server's) ends with a device-to-host copy of each
output with dims (outputs without dims stay device arrays: ``Executor.numpy_out``).
``np.asarray`` of a device array waits for the computation, then asks the runtime for the copy
and waits again; an executable compiled with those outputs in pinned host memory
(``out_shardings`` of memory kind ``pinned_host``, per output) copies them itself, on its own
stream, and ``np.asarray`` of such an output is a host memcpy.  Measured (H100, jax 0.11.2,
``benchmarks/probe_transfers.py``, five processes, (8, 1024) float32 out): a small call with
device inputs and ``np.asarray`` of its result 172-314 us, with pinned host outputs 66-123 us;
with numpy inputs 212-409 vs 125-192 us (torch eager, the same call: 54-97 us).

``jit(host_outputs=None)`` (default) decides per family, once, before its first bucket lowers:
pinned host outputs on GPU for a family whose first call was a host request (its leaves with
dims all numpy), or, for a family first met abstractly (``warmup``/``trace`` with
``jax.ShapeDtypeStruct``), when ``serving=True``; a bucket whose outputs exceed
``MAX_BYTES`` (4 MiB) keeps them in device memory.  ``True`` asks for them on any backend with
pinned host memory, ``False`` never.  Never for sharded families, donated arguments,
``return_padded=True`` or PRNG-key outputs.  A device request that reaches such an executable
gets its outputs moved back to the device (correct; one transfer each, as the host round trip
of an unpadded output).  The choice is part of the executable store's fingerprint; a restart
whose store holds the other placement only takes that one (:func:`alternative`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import logging
import math
import os
import threading
import weakref

import jax
import numpy as np

from dynjax._config import config
from dynjax._errors import ShardingError, format_list
from dynjax._padded import Padded
from dynjax.jit import _cuda
from dynjax.jit._args import is_key, on_device

HOST_KIND = "pinned_host"
logger = logging.getLogger("dynjax")

AUTO_PLATFORMS = ("gpu",)  # where host_outputs=None turns them on (measured there)
# A bucket whose outputs with dims are larger keeps them in device memory: the gain was
# measured on small results (32 KiB) only; pinned host memory is a scarcer (page-locked) pool,
# and above a few MB the copy itself, not its start-up, is the cost (4 MiB: ~0.2 ms on PCIe).
MAX_BYTES = 4 << 20


def host_request(leaves, idx) -> bool | None:
  """True: the leaves at ``idx`` are all host values; False: one is on a device; None: one
  is abstract (``jax.ShapeDtypeStruct``: a warmup or trace from shapes)."""
  xs = [leaves[i] for i in idx]
  if any(type(x) is jax.ShapeDtypeStruct for x in xs):
    return None
  return not any(on_device(x) for x in xs)


def default_device():
  """The device unsharded executables run on (``jax_default_device``, else the first)."""
  d = jax.config.jax_default_device
  if isinstance(d, jax.Device):
    return d
  return jax.devices(d if isinstance(d, str) else None)[0]


def exe_device(exe):
  """The one device an executable takes its inputs on, or None (unknown, or several); kept
  per executable: jax rebuilds ``input_shardings`` (every parameter's) on each read, ~0.15 ms
  for a 31-leaf model on the 2-core box, twice per executor built (an LRU-bounded function
  builds one a call)."""
  exe = getattr(exe, "exe", exe)  # a stored executable before its first run (_store.FirstRun)
  try:
    return _EXE_DEVICE[exe]
  except (KeyError, TypeError):  # (TypeError: not weakly referenceable)
    pass
  try:
    shardings = jax.tree.leaves(exe.input_shardings)
  except Exception:  # noqa: BLE001 - no metadata
    return None
  devices = {d for s in shardings for d in s.device_set}
  dev = devices.pop() if len(devices) == 1 else None
  with contextlib.suppress(TypeError):
    _EXE_DEVICE[exe] = dev
  return dev


_EXE_DEVICE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_wrong_device(e: BaseException) -> bool:
  """jax's argument check refused an array placed elsewhere than the executable's inputs."""
  return isinstance(e, ValueError) and "disagree with the shardings of arguments" in str(e)


def wrong_device(fam, exe, vals) -> ShardingError:
  """The error for a call whose arrays live on another device (or memory) than ``fam``'s
  executables take them on: each such argument by path, where it is, and what to do."""
  dev = exe_device(exe)
  leaves = jax.tree_util.tree_leaves(vals, is_leaf=lambda x: type(x) is Padded)
  paths = fam.leaf_paths if len(leaves) == len(fam.leaf_paths) else [
      f"argument leaf {i}" for i in range(len(leaves))]
  want = None if dev is None else jax.sharding.SingleDeviceSharding(dev)
  bad = []
  for path, x in zip(paths, leaves, strict=True):
    x = x.buffer if type(x) is Padded else x
    s = getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and s is not None and s != want:
      where = ", ".join(sorted(str(d) for d in s.device_set))
      kind = getattr(s, "memory_kind", None)
      bad.append(f"{path}: on {where}" + (f" ({kind} memory)" if kind not in (None, "device")
                                          else ""))
  put = repr(dev)
  if dev is not None and dev in jax.devices():
    put = f"jax.devices()[{jax.devices().index(dev)}]"
  return ShardingError(
      f"{fam.name}: arguments are placed where this function's executables do not take them "
      f"(they run on {dev}: jax's default device when the function compiled; dynjax.jit "
      "compiles an unsharded function for one device):\n"
      + format_list(bad or ["(jax did not say which)"])
      + f"\nPut them there first (jax.device_put(x, {put})), or, for a replica per device, "
      "make one dynjax.jit function per device and call it under `with "
      "jax.default_device(d):` (its compiles then target d; compiles in background threads, "
      "serving=True or warmup(background=True), do not see that context), or give the "
      "function in_shardings.")


@functools.cache
def has_host_memory(device) -> bool:
  try:
    return any(m.kind == HOST_KIND for m in device.addressable_memories())
  except Exception:  # noqa: BLE001 - a backend without memories: no pinned host outputs
    return False


def plan(fam, first_leaves) -> tuple[bool, str, bool]:
  """(host outputs?, why, results read by the CUDA driver?) for a padded family whose first
  call had ``first_leaves`` (None: none yet)."""
  request = None if first_leaves is None else host_request(first_leaves, fam.dyn_leaves)
  opts = fam.ctx.opts
  want = opts.host_outputs
  if want is False:
    return False, "host_outputs=False", False
  if fam.shard is not None:
    return False, "sharded", False
  if opts.donate_argnames:
    return False, "donated arguments (their buffers may become outputs)", False
  if opts.return_padded:
    return False, "return_padded=True (results stay on the device)", False
  if any(is_key(a) for a in fam.out_avals):
    return False, "PRNG-key outputs", False
  dev = default_device()
  if not has_host_memory(dev):
    return False, f"{dev.platform} has no {HOST_KIND} memory", False
  if want is True:
    return True, "host_outputs=True", False
  if dev.platform not in AUTO_PLATFORMS:
    return False, f"measured on GPU only ({dev.platform})", False
  host, why = ((opts.serving, BY_REQUEST[2 + (not opts.serving)]) if request is None
               else (request, BY_REQUEST[not request]))
  if host and reads_ready(dev) and all(  # device outputs the driver reads: faster still
      _cuda.whole_bytes(np.dtype(a.dtype)) for a, dyn in zip(fam.out_avals, fam.out_dynamic,
                                                         strict=True) if dyn):
    return False, f"{why}; {READS}", True
  return host, why, False


# A host request's results read by the CUDA driver (``_cuda.Driver.read``) from device outputs.
# Measured (H200, jax 0.11.2, benchmarks/probe_completion.py, issue 19's MoE encoder under
# jax.jit, device inputs, (8, 1024) float32 out, median us a call): the block without experts
# at t=128 block_until_ready 211.8, np.asarray 351.9, the driver's read 137.1; the MoE layer
# 468.5 / 647.3 / 347.5; t=256 331.3 / 481.7 / 246.2 and 566.5 / 742.7 / 436.9.  The runtime
# waits for a result on the host (~75-130 us after its last kernel there); a stream that waits
# on the device and a driver sync return as the copy lands.
READS = "read by the CUDA driver (jit/_cuda.py)"
READ_PLATFORMS = ("gpu",)
_reads: dict = {}  # device -> None (verified) or why not


def reads_ready(device) -> bool:
  """Whether host requests' results on ``device`` are read by the driver (once a device: the
  driver loads and a result reads back the same; ``DYNJAX_DIRECT_OUTPUTS=0``: never)."""
  if not config.direct_outputs or device.platform not in READ_PLATFORMS:
    return False
  if device not in _reads:
    try:
      _cuda.driver().verify_reads(device)
      _reads[device] = None
    except Exception as e:  # noqa: BLE001 - pinned host outputs then, as before
      _reads[device] = f"{type(e).__name__}: {e}"
      logger.info("dynjax: results of host requests come back through pinned host memory "
                  "(the CUDA driver cannot read them: %s)", _reads[device])
  return _reads[device] is None


def reads_planned(fam) -> bool:
  """Whether ``fam``'s host requests have their results read by the driver (its plan)."""
  return not fam.host_out and fam.reads_out


def read_host(fam, outs, which) -> list:
  """``to_host(outs, which)``, the driver reading the outputs ``which`` marks (device outputs
  of a family planned with :data:`READS`); where it refuses, the runtime's copies, and the
  family stops asking (``fam.host_buffers.reads_failed`` says why).  Under a
  ``jax.transfer_guard`` for device-to-host transfers the runtime's copies too, so that the
  guard sees them as before."""
  hb = fam.host_buffers
  if hb.reads_failed is None and jax.config.jax_transfer_guard_device_to_host in (None,
                                                                                   "allow"):
    idx = [i for i, w in enumerate(which) if w]
    try:
      got = _cuda.driver().read([outs[i] for i in idx])
    except Exception as e:  # noqa: BLE001 - exact either way
      hb.reads_failed = f"{type(e).__name__}: {e}"
      logger.info("dynjax: %s: results come back by the runtime's copies (the CUDA driver's "
                  "read failed: %s)", fam.name, hb.reads_failed)
    else:
      res = list(outs)
      for i, g in zip(idx, got, strict=True):
        res[i] = g
      return res
  return to_host(outs, which)


# The default's choices by the family's first call (``plan``): either placement is allowed.
BY_REQUEST = ("the first call was a host request", "the first call was a device request",
              "serving=True", "first met abstractly, serving=False")


def alternative(fam) -> bool | None:
  """The other placement (host outputs?) a family may take instead of its planned one, or
  None where its plan is not the default's choice by its first call.  Taken where the store
  under ``cache_dir`` holds executables of that placement only (``_store.family_store``): a
  restart whose first request is numpy, on the store of a process that warmed up from shapes
  without ``serving=True``, compiled every bucket again (either placement gives the same
  results; the other costs ~0.1 ms a request on the H100, a compile seconds)."""
  reason = (fam.host_out_reason or "").split("; ")[0]  # (a READS plan: the rule's choice too)
  if fam.ctx.opts.host_outputs is not None or reason not in BY_REQUEST:
    return None
  return not fam.host_out


def read_bytes(fam, bkey, kept) -> int:
  """Bytes of the outputs with dims (among ``kept``) of the bucket ``bkey``."""
  return sum(math.prod(fam.out_shape_fns[i](bkey)) * np.dtype(fam.out_avals[i].dtype).itemsize
             for i in kept if fam.out_dynamic[i])


def jit_kwargs(fam, bkey) -> dict:
  """``jax.jit`` arguments of one bucket's function: its outputs with dims in pinned host
  memory (a host request returns those as numpy; the others stay device arrays), or none."""
  if not fam.host_out:
    return {}
  kept = [i for i in range(len(fam.out_avals)) if i not in fam.forward]
  size = read_bytes(fam, bkey, kept)
  if size == 0 or size > MAX_BYTES:
    return {}
  dev = default_device()
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind=HOST_KIND)
  on_dev = jax.sharding.SingleDeviceSharding(dev)
  return {"out_shardings": [host if fam.out_dynamic[i] else on_dev for i in kept]}


def of_executable(exe) -> bool:
  """Whether a compiled (or stored) executable writes its outputs to pinned host memory."""
  try:
    return any(getattr(s, "memory_kind", None) == HOST_KIND
               for s in jax.tree_util.tree_leaves(exe.output_shardings))
  except Exception:  # noqa: BLE001 - unknown: treated as device outputs (always correct)
    return False


@functools.cache
def _device_kind(device) -> str:
  return device.default_memory().kind


def to_device(o):
  """A pinned host output moved to its device's default memory (a device request)."""
  s = getattr(o, "sharding", None)
  if s is None or s.memory_kind != HOST_KIND:
    return o
  return jax.device_put(o, s.with_memory_kind(_device_kind(next(iter(s.device_set)))))


def describe(fam) -> str | None:
  if not fam.host_out_reason:
    return None
  where = "pinned host memory" if fam.host_out else "device memory"
  failed = fam.host_buffers.reads_failed
  return f"outputs in {where} ({fam.host_out_reason}" + (
      f"; the driver's reads failed, the runtime copies: {failed})" if failed else ")")


def describe_inputs(fam) -> str | None:
  """How a host request's small numpy inputs reach the device, once the family has tried."""
  hb = fam.host_buffers
  if hb.direct_failed:
    return f"small numpy inputs: JAX's own transfers (the CUDA driver's copies failed: " \
           f"{hb.direct_failed})"
  if not hb.direct_bytes:
    return None
  pairs = sum(len(v) for k, v in hb.free.items() if k[2] == DIRECT)  # (those not in a call)
  return (f"small numpy inputs: copied by the CUDA driver into kept device arrays "
          f"({pairs} kept, {hb.direct_bytes} bytes with their pinned buffers; jit/_cuda.py)")


# -- padded host input buffers, reused ----------------------------------------------------
# A host request's numpy leaves that need padding are copied into a zeroed buffer of the
# bucket's shape.  A fresh np.zeros of a large buffer is a fresh mmap (glibc, >= 128 KiB): its
# pages fault in on the copy and again when the runtime reads it for the host-to-device copy.
# Measured (H100 host, jax 0.11.2, benchmarks/probe_hit_profile.py, numpy (8, 100, 256) float32
# padded to t=128, 1 MiB): the bucket's executable on a pre-padded buffer 300 us a call, with a
# fresh buffer each call 499 us, dynjax 510 us.  So buffers of at least POOL_MIN_BYTES are kept
# per (bucket shape, dtype) and reused: only by calls that wait for their numpy results (the
# computation has read its inputs then: on CPU the runtime may read the numpy memory itself),
# each taken by one call at a time (list.pop/append are atomic), the last call's prefix zeroed
# before the next writes its own, so the padding is zeros as with a fresh buffer: for
# padding="trust" (the function sees the zeros).  padding="auto" never reads padded values
# (its inputs' fill is "anything", bucketing/_padding.py), so there the last call's values stay
# (a batch of 296x528 images after one of 280x504 in a 320x576 buffer: a ~14 MB memset
# saved; 2-core CPU box beside a test run, a trivial function, sizes taking turns, rounds
# zeroed / not taking turns in one process: medians 5.9 vs 4.6 ms a call).
POOL_MIN_BYTES = 64 << 10  # smaller buffers come from the heap: ~1.5 us for (8, 37) -> (8, 64)
POOL_PER_KEY = 4  # buffers kept per (shape, dtype): about the concurrent callers of a bucket
# DIRECT pairs (small; each new one a cuMemHostAlloc and a device_put, ~0.1-1 ms): more kept,
# so a server's threads calling one bucket at once do not make and drop pairs every call
DIRECT_PER_KEY = 16
# On a GPU, a numpy buffer is copied once more by the runtime, into its pinned staging memory,
# before the transfer.  Buffers of at least PINNED_MIN_BYTES are pinned host memory instead (a
# ``pinned_host`` jax array, written through a numpy view of its memory; jax.device_put of it
# is a transfer alone).  Measured (H100, jax 0.11.2, benchmarks/probe_pinned_inputs.py, cold
# data, median ms a call with the answer): a sum over the padded input 0.76 MB 0.61 vs 0.64
# (numpy wins), 3.8 MB 1.18 vs 1.01, 11.4 MB 3.52 vs 1.86, 38 MB 13.3 vs 7.2; ResNet-18,
# batch 8, 200x200 -> 256x256 2.47 vs 2.31, 296x528 -> 320x576 7.19 vs 4.37 (jax.jit on the
# exact numpy image: 3.89).
PINNED_MIN_BYTES = 2 << 20
PINNED_PLATFORMS = ("gpu",)  # where the copy it saves was measured
PINNED_MAX_BYTES = 1 << 30  # pinned buffers of one family, at most (page-locked memory)
# The jax where a pinned_host array's unsafe_buffer_pointer was checked to be its host memory
# on a GPU (0.11.2, H100); an older jax keeps numpy buffers there (a wrong pointer would be
# written to from the host).
PINNED_MIN_JAX = (0, 11)


PINNED, DIRECT = "pinned", "direct"  # HostBuffers kinds beside numpy buffers (None)


class HostBuffers:
  """Padded host input buffers of one family, reused across calls (see above): numpy buffers,
  pinned ones (``PINNED``), and pinned ones beside a kept device array (``DIRECT``,
  jit/_cuda.py)."""

  def __init__(self):
    self.free: dict = {}  # (bucket shape, dtype, kind) -> [(buffer, source, prefix)]
    self.pinned_bytes = 0
    self.direct_bytes = 0  # host and device bytes of the DIRECT pairs made
    self.pinned_failed: str | None = None  # why pinned buffers cannot be made here
    self.direct_failed: str | None = None  # why the driver's copies are not used here
    self.reads_failed: str | None = None  # why the driver does not read results here

  def take(self, target: tuple, dtype, prefix: tuple, device=None, zero: bool = True,
           kind: str | None = PINNED):
    """(buffer, source): a numpy ``buffer`` of shape ``target`` whose ``prefix`` the caller
    overwrites, padded with zeros (``zero``) or with what the last call left, and what goes
    to the call: the buffer itself (``source`` None); with ``device`` and kind ``PINNED``,
    ``jax.device_put(source, device)``; with ``DIRECT``, ``source`` is a :class:`_cuda.Slot`
    whose array takes the buffer's bytes by ``_cuda.Driver.copy`` before the call."""
    # one of that kind kept or to be made; else a numpy one, reused as such (over the budget,
    # or none can be made here)
    if device is None or not (self.free.get((target, dtype, kind))
                              and (kind != DIRECT or self.direct_failed is None)
                              or self._makeable(target, dtype, kind)):
      kind = None
    kept = self.free.get((target, dtype, kind))
    try:
      buf, src, last = kept.pop()
    except (AttributeError, IndexError):  # none kept (yet), or another thread took it
      return self._new(target, dtype, device, kind)
    # (a DIRECT buffer, < 2 MiB, is zeroed under padding="auto" too: small inputs always had
    # fresh zeros before session 32, and the memset costs next to nothing there)
    if (zero or kind == DIRECT) and last != prefix:
      buf[last] = 0  # the previous values outside the new prefix (inside it: overwritten)
    return buf, src

  def give(self, target: tuple, dtype, buf, src, prefix: tuple) -> None:
    kind = None if src is None else DIRECT if type(src) is _cuda.Slot else PINNED
    kept = self.free.setdefault((target, dtype, kind), [])
    if len(kept) < (DIRECT_PER_KEY if kind == DIRECT else POOL_PER_KEY):
      kept.append((buf, src, prefix))
    elif kind == PINNED:
      self.pinned_bytes -= buf.nbytes  # dropped (its memory goes with the jax array)
    elif kind == DIRECT:
      self.direct_bytes -= 2 * buf.nbytes

  def _makeable(self, target, dtype, kind) -> bool:
    """Whether a new one of ``kind`` can be made: none failed, not empty, within the budget."""
    nbytes = math.prod(target) * np.dtype(dtype).itemsize
    if kind == DIRECT:
      return (self.direct_failed is None and nbytes > 0
              and self.direct_bytes + 2 * nbytes <= DIRECT_MAX_BYTES)
    return (self.pinned_failed is None and nbytes > 0
            and self.pinned_bytes + nbytes <= PINNED_MAX_BYTES)

  def _new(self, target, dtype, device, kind):
    if kind is None:
      return np.zeros(target, dtype), None
    if kind == DIRECT:
      try:
        slot = _cuda.Slot(_cuda.driver(), device, target, dtype)
      except Exception as e:  # noqa: BLE001 - JAX's own transfers then, as before
        self.failed_direct(e)
        return np.zeros(target, dtype), None
      self.direct_bytes += 2 * slot.nbytes
      return slot.host, slot
    nbytes = math.prod(target) * np.dtype(dtype).itemsize
    try:
      src = jax.device_put(np.zeros(target, dtype),
                           jax.sharding.SingleDeviceSharding(device, memory_kind=HOST_KIND))
      src.block_until_ready()  # (its zeros are written before the caller's values)
      raw = (ctypes.c_char * nbytes).from_address(src.unsafe_buffer_pointer())
      buf = np.frombuffer(raw, dtype).reshape(target)  # writable, held with src
      if src.dtype != buf.dtype or src.nbytes != nbytes:
        raise TypeError(f"a pinned buffer of {src.dtype} {src.nbytes} bytes for {dtype} "
                        f"{target}")
    except Exception as e:  # noqa: BLE001 - numpy buffers then, as before
      self.pinned_failed = f"{type(e).__name__}: {e}"
      logger.info("dynjax: padded inputs stay in numpy buffers (no pinned host buffer: %s)",
                  self.pinned_failed)
      return np.zeros(target, dtype), None
    self.pinned_bytes += nbytes
    return buf, src

  def copy(self, slots, args: list) -> None:
    """The driver copies ``slots``' host buffers into their device arrays (jit/_cuda.py); where
    it fails, the call takes the host buffers (JAX's own transfer) and the family stops.
    Under a ``jax.transfer_guard`` for host-to-device transfers the call takes them too, so
    that the guard sees (logs, refuses) this implicit transfer as it did before."""
    if jax.config.jax_transfer_guard_host_to_device in (None, "allow"):  # (~0.3 us, CPU box)
      try:
        _cuda.driver().copy(slots)
        return
      except Exception as e:  # noqa: BLE001 - exact either way
        self.failed_direct(e)
    arrays = {id(slot.array): slot.host for slot in slots}
    args[:] = [arrays.get(id(a), a) for a in args]

  def failed_direct(self, e: BaseException) -> None:
    """The driver's copies stop for this family (kept pairs are not taken again)."""
    if self.direct_failed is None:
      self.direct_failed = f"{type(e).__name__}: {e}"
      logger.info("dynjax: small numpy inputs take JAX's own transfers (the driver's copies "
                  "failed: %s)", self.direct_failed)


def pool_of(exe, shape: tuple, dtype, direct: bool = False):
  """How a numpy input of the bucket ``shape`` reuses its host buffer: None (a fresh one each
  call), True (a numpy buffer), or (device, dtype, kind) for a value of that dtype: ``PINNED``
  a pinned host buffer moved to that device, ``DIRECT`` (``direct``: a leaf of a call that
  waits for its numpy results, not donated) a pinned one the driver copies into a kept device
  array (jit/_cuda.py)."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if (direct and 0 < nbytes < DIRECT_BELOW_BYTES and config.direct_inputs
      and _cuda.whole_bytes(dtype)):
    dev = exe_device(exe)
    if dev is not None and dev.platform in DIRECT_PLATFORMS:
      return dev, dtype, DIRECT
  if nbytes < POOL_MIN_BYTES:
    return None
  dev = pinned_device(exe, nbytes)
  return True if dev is None else (dev, dtype, PINNED)


# Numpy inputs below DIRECT_BELOW_BYTES of a call that waits for its numpy results go to the
# device by the driver's copy (jit/_cuda.py: the measured cost there); larger ones keep the
# pinned buffers above.  DIRECT_MAX_BYTES: the pairs one family keeps (host + device bytes).
DIRECT_BELOW_BYTES = PINNED_MIN_BYTES
DIRECT_MAX_BYTES = 256 << 20
DIRECT_PLATFORMS = ("gpu",)


def pinned_device(exe, nbytes: int):
  """The device a padded numpy input of ``nbytes`` goes to through a pinned host buffer, or
  None (a numpy buffer): large enough, on a platform where it pays.  (Only a value of the
  executable's own dtype takes it; the call converts another.)  ``DYNJAX_PINNED_INPUTS=0``:
  never."""
  if nbytes < PINNED_MIN_BYTES or not config.pinned_inputs or _jax_version() < PINNED_MIN_JAX:
    return None
  dev = exe_device(exe)
  if dev is None or dev.platform not in PINNED_PLATFORMS or not has_host_memory(dev):
    return None
  return dev


# The copy of a request into its padded buffer is split over config.copy_threads threads
# (DYNJAX_COPY_THREADS, default 4, 1 = never split; numpy releases the GIL while it copies)
# for inputs of at least PARALLEL_COPY_MIN_BYTES on hosts with at least twice as many cores,
# along the first axis at least that long.
# H100 host (16 cores), benchmarks/probe_host_copy.py, ms a copy, 1 -> 4 threads: 14.3 MB
# (8, 296, 528, 3) float32 1.90 -> 0.80 (pinned buffer 1.93 -> 0.79), 43.9 MB 7.5 -> 2.2,
# 3.7 MB 0.39 -> 0.25 (pinned: 0.35 -> 0.38, no gain: hence 8 MiB).
PARALLEL_COPY_MIN_BYTES = 8 << 20
_copy_lock = threading.Lock()
_copy_pool: list = []


def copy_into(buf: np.ndarray, prefix: tuple, x: np.ndarray) -> None:
  """``buf[prefix] = x``, split over threads when ``x`` is large (see above)."""
  k = config.copy_threads
  if k < 2 or x.nbytes < PARALLEL_COPY_MIN_BYTES or _cores() < 2 * k:
    buf[prefix] = x
    return
  ax = next((i for i, n in enumerate(x.shape) if n >= k), None)
  if ax is None:
    buf[prefix] = x
    return
  n = x.shape[ax]
  step = -(-n // k)
  head = (slice(None),) * ax
  parts = [(prefix[:ax] + (slice(i, min(i + step, n)),) + prefix[ax + 1:],
            x[head + (slice(i, i + step),)]) for i in range(0, n, step)]
  pool = _copy_threads()
  futs = [pool.submit(buf.__setitem__, *part) for part in parts[1:]]
  buf.__setitem__(*parts[0])  # the caller's share
  for f in futs:
    f.result()


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
  os.register_at_fork(after_in_child=_copy_pool.clear)


def _copy_threads() -> concurrent.futures.ThreadPoolExecutor:
  if not _copy_pool:
    with _copy_lock:
      if not _copy_pool:
        _copy_pool.append(concurrent.futures.ThreadPoolExecutor(
            config.copy_threads - 1, thread_name_prefix="dynjax-copy"))
  return _copy_pool[0]


@functools.cache
def _cores() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


@functools.cache
def _jax_version() -> tuple:
  return tuple(int(p) for p in jax.__version__.split(".")[:2] if p.isdigit())


@functools.cache
def device_sharding(device):
  return jax.sharding.SingleDeviceSharding(device)


def exact_to_host(fam, outs, which=None) -> list:
  """``to_host`` of an unpadded (exact) run's device outputs; on a GPU the driver reads those
  it can (:func:`read_host`: one device, whole-byte dtypes), as a padded bucket's."""
  if which is None:
    which = (True,) * len(outs)
  devices = next((o.sharding.device_set for o, w in zip(outs, which, strict=True)
                  if w and isinstance(o, jax.Array)), ())
  if fam.shard is None and len(devices) == 1 and reads_ready(next(iter(devices))):
    # (where the driver does not read, as on a CPU, nothing more is asked of the outputs)
    read = tuple(w and isinstance(o, jax.Array) and not is_key(o) and o.sharding.device_set
                 == devices and _cuda.whole_bytes(np.dtype(o.dtype))
                 for o, w in zip(outs, which, strict=True))
    if any(read):
      outs = read_host(fam, outs, read)
      which = tuple(w and not r for w, r in zip(which, read, strict=True))
  return to_host(outs, which)


def to_host(outs, which=None) -> list:
  """Device outputs to numpy (those ``which`` marks; default all). ``np.asarray`` per output
  costs ~2 us on CPU where ``jax.device_get`` costs ~40 us (tree walk); several outputs start
  their copies first. Arrays of an extended dtype (PRNG keys) have no numpy form and stay jax
  arrays."""
  if which is None:
    which = (True,) * len(outs)
  if len(outs) > 1:
    for o, w in zip(outs, which, strict=True):
      if w and isinstance(o, jax.Array) and not is_key(o):
        o.copy_to_host_async()
  return [np.asarray(o) if w and not is_key(o) else o for o, w in zip(outs, which, strict=True)]
