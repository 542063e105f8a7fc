"""Device arrays padded to their bucket, and outputs cut to their exact shape, on the device.

A device array whose shape is not its bucket's goes through the host: ``np.asarray`` (waits
for it, copies it out), a zeroed host buffer, the copy back in with the call; a padded
output of a device request comes back the same way.  That is a host sync and two copies a
call (H100, jax 0.11.2, ``benchmarks/probe_device_pad.py``: 0.25 ms for 0.6 kB, 2.5 ms for
6 MB of bf16), and the sync stops the host from queueing the next call while the device
works.  On the device the same pad or cut is a tiny XLA program per (shape, bucket shape,
dtype, device): one compile each (57-92 ms on that H100), then an async call (0.09-0.15 ms).

Which is cheaper depends on how often a shape comes back, which nobody knows in advance:
ski rental.  Each site (an argument or output of one shape padded or cut to one bucket
shape) times its host trips, copies in and out included; once they add up to the price of
one compile (the median of this process's measured compiles of such programs; ``PRIOR_S``
until one is measured) it compiles its program and goes on on the device.  That never
costs more than about twice the better choice in hindsight.  A training loop that sees a
few shapes many times pays a few compiles; a stream of shapes seen once or twice keeps the
host route.

On the CPU too: there the host route's copies are memcpys, and a pad program still costs
less than a third of them (2-core box, jax 0.10.2: 3.1-3.3 vs 1.0-1.2 ms for 10-12 MB of
float32, 0.13 vs 0.03 ms for 1 kB; compiles 56-64 ms, the process's first 248).  A
sharded function's fully addressable arrays too: the host route gathers the whole array and
scatters it back, the program pads it in place (its result placed as the function wants).
Only arrays on the executable's own device (or with the sharding a site was first met
with), in device memory; a ``Padded``, a multi-process array or a PRNG key keeps the host
route.  ``DYNJAX_DEVICE_PAD=0`` turns it off.
``stats()["device_pads"]`` counts sites, programs, their compile seconds, and the host trips
with their seconds.
"""
from __future__ import annotations

import re
import threading
import time

import jax
import numpy as np
from jax import lax

from dynjax._config import config

# A program that moves data between devices (the padded axis is sharded, or the array comes
# sharded otherwise than the function takes it) is not kept on CPU devices: on 8 fake ones
# such programs dispatched back to back with the executable deadlocked in XLA's CPU
# rendezvous (collective-permute, "only 7 of 8 threads arrived"); the host route stays for
# them.  GPUs run each device's programs in order on its stream: kept there (two H100s,
# probe_device_pad's sharded part with a growing batch).
COLLECTIVES = re.compile(r"\b(collective-permute|all-gather|all-reduce|all-to-all|"
                         r"reduce-scatter|collective-broadcast)")
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")  # where the route is measured or expected to pay
# A pad program's compile before one is measured in this process (seconds).  H100, jax 0.11.2:
# 57-92 ms (probe_device_pad's "compile_ms", five runs); the measured median replaces it.
PRIOR_S = 0.08
MAX_SITES = 4096  # sites per function; past it new shapes keep the host route
MAX_PROGRAMS = 512  # programs per process; past it sites keep the host route

_lock = threading.Lock()
_compiled: list[float] = []  # seconds of each pad/cut program this process compiled


def price() -> float:
  """Seconds one pad/cut program costs to build: the median of this process's compiles (the
  latest 64), else ``PRIOR_S``.  The median, not the mean: a process's first XLA compile
  carries one-time costs (H100, jax 0.11.2: 146-464 ms for the first, then 57-92 ms)."""
  if not _compiled:
    return PRIOR_S
  ordered = sorted(_compiled[-64:])
  return ordered[len(ordered) // 2]


class Sites:
  """The pad/cut sites of one ``dynjax.jit`` function (``Dispatcher.devpads``)."""

  def __init__(self):
    self.sites: dict = {}
    self.lock = threading.Lock()
    self.programs = 0
    self.compile_seconds = 0.0
    self.trips = 0
    self.trip_seconds = 0.0
    self.refused = 0  # programs built but not kept: they move data between CPU devices

  def site(self, kind: str, shape, target, dtype, where, out=None):
    """The site of (``kind`` "pad" or "cut", ``shape`` -> ``target``, dtype), for arrays
    placed as ``where`` (a device, or the sharding of a sharded function's array) and results
    placed as ``out`` (default: as ``where``), or None where the device route never applies."""
    if isinstance(where, jax.Device):
      where = jax.sharding.SingleDeviceSharding(where)
    key = (kind, tuple(shape), tuple(target), dtype, where, where if out is None else out)
    s = self.sites.get(key)  # a sharded function looks its sites up on every call: ~1.1 us
    if s is not None:  # here, against ~5.4 us through the checks and the lock (8 fake CPUs)
      return s
    if (not config.device_pad or where is None or key[1] == key[2]
        or not any(d.platform in PLATFORMS for d in where.device_set)
        or jax.dtypes.issubdtype(dtype, jax.dtypes.extended)):
      return None
    key = (*key[:3], np.dtype(dtype), *key[4:])
    with self.lock:
      s = self.sites.get(key)
      if s is None and len(self.sites) < MAX_SITES:
        s = self.sites[key] = Site(self, *key)
    return s

  def describe(self) -> dict:
    return {"sites": len(self.sites), "programs": self.programs,
            "compile_seconds": self.compile_seconds, "host_trips": self.trips,
            "host_trip_seconds": self.trip_seconds, "refused": self.refused}


class Site:
  """One argument padded (or output cut) from one shape to another, placed one way."""

  __slots__ = ("owner", "kind", "shape", "target", "dtype", "sharding", "out", "spent", "fn")

  def __init__(self, owner: Sites, kind, shape, target, dtype, sharding, out):
    self.owner = owner
    self.kind = kind
    self.shape = shape
    self.target = target
    self.dtype = dtype
    self.sharding = sharding  # where the arrays it takes are
    self.out = out  # where its results go
    self.spent = 0.0  # seconds of host trips so far
    self.fn = None  # the compiled program, once bought

  def run(self, x, host, *args):
    """``x`` padded (cut) on the device once the program is bought; before that (and for an
    ``x`` on another device or memory kind) ``host(x, *args)``, the host route, timed."""
    s = x.sharding
    if s is not self.sharding and s != self.sharding:
      return host(x, *args)
    fn = self.fn
    if fn is not None:
      return fn(x)  # ~10-20 us of dispatch (jax's C++ path for AOT-compiled programs)
    jax.block_until_ready(x)  # not rent: the computation costs the wait either way
    t0 = time.perf_counter()
    out = host(x, *args)
    if isinstance(out, np.ndarray):  # the copy in, which the executable's call would make
      out = jax.device_put(out, self.out)
    jax.block_until_ready(out)
    self.rent(time.perf_counter() - t0)
    return out

  def rent(self, seconds: float) -> None:
    """A host trip of this site took ``seconds``; buys the program once they add up."""
    o = self.owner
    with o.lock:
      o.trips += 1
      o.trip_seconds += seconds
      self.spent += seconds
      buy = self.fn is None and self.spent >= price() and len(_compiled) < MAX_PROGRAMS
      if buy:
        self.spent = -np.inf  # one buyer
    if buy:
      self._buy()

  def _buy(self) -> None:
    shape, target = self.shape, self.target
    if self.kind == "pad":
      zero = np.zeros((), self.dtype)

      def program(x):
        return lax.pad(x, zero, [(0, t - n, 0) for n, t in zip(shape, target, strict=True)])
    else:

      def program(x):
        return lax.slice(x, (0,) * len(shape), target)
    aval = jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.sharding)
    t0 = time.perf_counter()
    try:
      fn = jax.jit(program, out_shardings=self.out).lower(aval).compile()
      devices = self.sharding.device_set | self.out.device_set
      moves = (len(devices) > 1 and any(d.platform == "cpu" for d in devices)
               and COLLECTIVES.search(fn.as_text() or "") is not None)
    except Exception:  # noqa: BLE001 - the host route stays; never fails a call
      return
    dt = time.perf_counter() - t0
    o = self.owner
    with o.lock, _lock:
      _compiled.append(dt)
      o.programs += 1
      o.compile_seconds += dt
      if moves:
        o.refused += 1
    if not moves:
      self.fn = fn

