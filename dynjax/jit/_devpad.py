"""Device arrays padded to their bucket, and outputs cut to their exact shape, on the device.

A device array whose shape is not its bucket's goes through the host: ``np.asarray`` (waits
for it, copies it out), a zeroed host buffer, the copy back in with the call; a padded
output of a device request comes back the same way.  That is a host sync and two copies a
call (H100, jax 0.11.2: see ``benchmarks/probe_device_pad.py``), and the sync stops the host
from queueing the next call while the device works.  On the device the same pad or cut is a
tiny XLA program per (shape, bucket shape, dtype, device): one compile each, then an async
call.

Which is cheaper depends on how often a shape comes back, which nobody knows in advance:
ski rental.  Each site (an argument or output of one shape padded or cut to one bucket
shape) times its host trips; once they add up to the price of one compile (the mean of this
process's measured compiles of such programs; ``PRIOR_S`` until one is measured) it compiles
its program and goes on on the device.  That never costs more than about twice the better
choice in hindsight (the trip's copy into the executable is not in the timed part, so the
rent is under-counted: at most ~3x).  A training loop that sees a few shapes many times
pays a few compiles; a stream of shapes seen once or twice keeps the host route.

Only on accelerators (``PLATFORMS``): on CPU the "host" copy is a memcpy in the same memory,
no cheaper on the device.  Only single-device arrays on the executable's own device, in
device memory; a ``Padded``, a sharded family or a PRNG key keeps the host route.
``DYNJAX_DEVICE_PAD=0`` turns it off.  ``stats()["device_pads"]`` counts sites, programs,
their compile seconds, and the host trips with their seconds.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
from jax import lax

from dynjax._config import config

PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
# A pad program's compile before one is measured in this process (seconds).  H100, jax 0.11.2:
# see probe_device_pad's "compile_ms"; the measured mean replaces it after the first compile.
PRIOR_S = 0.05
MAX_SITES = 4096  # sites per function; past it new shapes keep the host route
MAX_PROGRAMS = 512  # programs per process; past it sites keep the host route

_lock = threading.Lock()
_compiled = {"n": 0, "seconds": 0.0}  # this process's pad/cut programs


def price() -> float:
  """Seconds one pad/cut program costs to build: the measured mean, else ``PRIOR_S``."""
  n = _compiled["n"]
  return _compiled["seconds"] / n if n else PRIOR_S


def exe_device(exe):
  """The one device an executable takes its inputs on, or None (unknown, or several)."""
  exe = getattr(exe, "exe", exe)  # a stored executable before its first run (_store.FirstRun)
  try:
    shardings = jax.tree.leaves(exe.input_shardings)
  except Exception:  # noqa: BLE001 - no metadata: the host route
    return None
  devices = {d for s in shardings for d in s.device_set}
  return devices.pop() if len(devices) == 1 else None


class Sites:
  """The pad/cut sites of one ``dynjax.jit`` function (``Dispatcher.devpads``)."""

  def __init__(self):
    self.sites: dict = {}
    self.lock = threading.Lock()
    self.programs = 0
    self.compile_seconds = 0.0
    self.trips = 0
    self.trip_seconds = 0.0

  def site(self, kind: str, shape, target, dtype, device):
    """The site of (``kind`` "pad" or "cut", ``shape`` -> ``target``, dtype, device), or None
    where the device route never applies."""
    if (not config.device_pad or device is None or device.platform not in PLATFORMS
        or tuple(shape) == tuple(target) or jax.dtypes.issubdtype(dtype, jax.dtypes.extended)):
      return None
    key = (kind, tuple(shape), tuple(target), np.dtype(dtype), device)
    with self.lock:
      s = self.sites.get(key)
      if s is None and len(self.sites) < MAX_SITES:
        s = self.sites[key] = Site(self, *key)
    return s

  def describe(self) -> dict:
    return {"sites": len(self.sites), "programs": self.programs,
            "compile_seconds": self.compile_seconds, "host_trips": self.trips,
            "host_trip_seconds": self.trip_seconds}


class Site:
  """One argument padded (or output cut) from one shape to another on one device."""

  __slots__ = ("owner", "kind", "shape", "target", "dtype", "sharding", "spent", "fn")

  def __init__(self, owner: Sites, kind, shape, target, dtype, device):
    self.owner = owner
    self.kind = kind
    self.shape = shape
    self.target = target
    self.dtype = dtype
    self.sharding = jax.sharding.SingleDeviceSharding(device)
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
    self.rent(time.perf_counter() - t0)
    return out

  def rent(self, seconds: float) -> None:
    """A host trip of this site took ``seconds``; buys the program once they add up."""
    o = self.owner
    with o.lock:
      o.trips += 1
      o.trip_seconds += seconds
      self.spent += seconds
      buy = self.fn is None and self.spent >= price() and _compiled["n"] < MAX_PROGRAMS
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
      fn = jax.jit(program).lower(aval).compile()
    except Exception:  # noqa: BLE001 - the host route stays; never fails a call
      return
    dt = time.perf_counter() - t0
    o = self.owner
    with o.lock, _lock:
      _compiled["n"] += 1
      _compiled["seconds"] += dt
      o.programs += 1
      o.compile_seconds += dt
    self.fn = fn

