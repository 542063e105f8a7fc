"""The VM: interprets a :class:`~dynjax.runtime.Program`, keeping data on the device.

Loading a Program flattens its blocks into one code array and turns every instruction into a
small Python closure ``step(regs) -> next pc``; running is then the loop
``while pc >= 0: pc = code[pc](regs)``.  Measured cost per executed instruction on the 2-core CPU
box (python 3.11, ``tests/runtime/test_vm.py::test_dispatch_cost``): ~0.1 us for
``move``/``const``/``goto``, ~0.2 us for ``host``; an ``invoke`` adds the executable's own
dispatch (~5 us for a jitted function on CPU, ~30 us on an H100 host).  So the interpreter is
noise next to the executables it calls.

The host touches device data only in ``read`` (``ReadScalar``: one blocking transfer of a small
array, counted in ``host_syncs``) and in ``unpad`` of small results (counted in
``unpad_to_host``).  Everything else is asynchronous.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dynjax.runtime._program import Instr, Op, Program, _is_reg_key

# Results of at most this many bytes are unpadded through the host (a numpy slice and a
# device_put, ~30 us, no compile; jnp.asarray of a numpy array would compile a tiny "stage"
# executable per shape in jax 0.10); larger ones by a device slice, which compiles once per exact
# shape (~40-70 ms on CPU, ~70 ms on an H100: a tiny pad or slice compiles per new shape).
UNPAD_VIA_HOST_BYTES = 4 << 20


@dataclasses.dataclass
class VMStats:
  """Counters of what the VM did (summed over runs while collected).

  Attributes:
    runs: programs run.
    instructions: instructions executed.
    invokes: executables called.
    host_syncs: blocking device-to-host reads made for decisions (``ReadScalar``).
    repads: carries moved to another bucket.
    unpad_to_host: results unpadded through the host (one transfer each, after the last sync).
    pad_via_host: arguments padded to their bucket on the host (a read when on the device).
    calls: sub-programs run by ``call`` (control ops inside a compiled host program).
    compiles: executables built by kernels while collected.
    loops: one dict per ``while_loop`` run: iterations, host_syncs, buckets visited, mode.
    batches: one dict per recursive batch: nodes, levels, invokes, batch buckets.
  """

  runs: int = 0
  instructions: int = 0
  invokes: int = 0
  host_syncs: int = 0
  repads: int = 0
  unpad_to_host: int = 0
  pad_via_host: int = 0
  calls: int = 0
  compiles: int = 0
  loops: list = dataclasses.field(default_factory=list)
  batches: list = dataclasses.field(default_factory=list)

  def add(self, other: VMStats) -> None:
    for f in _COUNTERS:
      setattr(self, f, getattr(self, f) + getattr(other, f))
    self.loops.extend(other.loops)
    self.batches.extend(other.batches)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


_COUNTERS = ("runs", "instructions", "invokes", "host_syncs", "repads", "unpad_to_host",
             "pad_via_host", "calls", "compiles")
_GLOBAL = VMStats()
_local = threading.local()


def _collectors() -> list[VMStats]:
  c = getattr(_local, "collectors", None)
  if c is None:
    c = _local.collectors = []
  return c


def record(stats: VMStats) -> None:
  """Adds one run's counters to the global stats and to every active collector."""
  _GLOBAL.add(stats)
  for c in _collectors():
    c.add(stats)


def stats() -> VMStats:
  """Counters summed over every VM run of this process (see :class:`VMStats`).

  Example:
    >>> dynjax.runtime.stats().host_syncs >= 0
    True
  """
  return _GLOBAL


@contextlib.contextmanager
def collect_stats() -> Iterator[VMStats]:
  """Collects the counters of the VM runs inside the ``with`` block (this thread).

  Example:
    >>> with dynjax.runtime.collect_stats() as s:
    ...   out = dynjax.while_loop(lambda c: jnp.asarray(c.shape[0]) < 5,
    ...                           lambda c: jnp.concatenate([c, c[:1]]), jnp.zeros(1))
    >>> s.host_syncs
    1
  """
  s = VMStats()
  cs = _collectors()
  cs.append(s)
  try:
    yield s
  finally:  # by identity: VMStats compare equal field by field, nested collectors may too
    del cs[next(i for i, c in enumerate(cs) if c is s)]


# -- repad / unpad executables (runtime-owned: plain lax pad/slice, no user code) -------------
def fit(x, shape):
  """``x`` cut or zero-padded to ``shape`` (the valid prefix is kept)."""
  if tuple(x.shape) == tuple(shape):
    return x
  cut = tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape, strict=True))
  x = x[cut]
  pads = [(0, b - a) for a, b in zip(x.shape, shape, strict=True)]
  return jnp.pad(x, pads) if any(p for _, p in pads) else x


_repad_cache: dict = {}


def repad(values: Sequence, shapes: Sequence[tuple[int, ...]]) -> tuple:
  """Moves padded arrays into new padded shapes in one executable (cached per shapes)."""
  from_shapes = tuple(tuple(v.shape) for v in values)
  targets = tuple(tuple(s) for s in shapes)
  if from_shapes == targets:
    return tuple(values)  # nothing to move (~0.5 us; the common case inside programs)
  key = (from_shapes, tuple(str(v.dtype) for v in values), targets)
  fn = _repad_cache.get(key)
  if fn is None:
    targets = tuple(tuple(s) for s in shapes)
    fn = jax.jit(lambda *xs: tuple(fit(x, s) for x, s in zip(xs, targets, strict=True)))
    _repad_cache[key] = fn
  return fn(*values)


def unpad(values: Sequence, shapes: Sequence[tuple[int, ...]], to_host: bool = False
          ) -> tuple[tuple, int]:
  """Exact-shape copies of the valid prefixes; returns (arrays, number moved via the host).

  ``to_host``: numpy results (one transfer each, never back to the device).
  """
  out, via_host = [], 0
  small = [i for i, (v, s) in enumerate(zip(values, shapes, strict=True))
           if to_host or (tuple(v.shape) != tuple(s) and v.nbytes <= UNPAD_VIA_HOST_BYTES)]
  host = dict(zip(small, jax.device_get([values[i] for i in small]), strict=True))
  for i, (v, s) in enumerate(zip(values, shapes, strict=True)):
    if i in host:
      h = host[i]
      if tuple(np.shape(h)) != tuple(s):
        h = np.ascontiguousarray(h[tuple(slice(0, n) for n in s)])
        via_host += 1
      out.append(np.asarray(h) if to_host else jax.device_put(h))
    elif tuple(v.shape) == tuple(s):
      out.append(v)
    else:
      out.append(v[tuple(slice(0, n) for n in s)])
  return tuple(out), via_host


def pad(values: Sequence, shapes: Sequence[tuple[int, ...]]) -> tuple[tuple, int]:
  """Exact-shape arguments padded (zeros) or cut to ``shapes``; returns (arrays, via host).

  Leaves of at most ``UNPAD_VIA_HOST_BYTES`` are padded on the host: a numpy zero buffer, the
  prefix copied in, one ``device_put`` (~10-30 us on CPU, no compile; a device array is read
  first).  A device pad would compile once per exact shape (~40-70 ms).  Larger leaves use
  :func:`repad` on the device.
  """
  out, via_host, big = [], 0, []
  for i, (v, s) in enumerate(zip(values, shapes, strict=True)):
    s = tuple(s)
    shape = tuple(np.shape(v))
    if shape == s:
      out.append(v if isinstance(v, jax.Array) else jax.device_put(v))
      continue
    dtype = np.dtype(v.dtype) if hasattr(v, "dtype") else np.asarray(v).dtype
    if math.prod(s) * dtype.itemsize > UNPAD_VIA_HOST_BYTES:
      out.append(None)
      big.append(i)
      continue
    h = np.asarray(v)
    buf = np.zeros(s, dtype)
    cut = tuple(slice(0, min(a, b)) for a, b in zip(shape, s, strict=True))
    buf[cut] = h[cut]
    out.append(jax.device_put(buf))
    via_host += 1
  if big:
    moved = repad([jax.device_put(values[i]) for i in big], [shapes[i] for i in big])
    for i, m in zip(big, moved, strict=True):
      out[i] = m
  return tuple(out), via_host


class VM:
  """Runs a :class:`Program`.

  Example:
    >>> b = ProgramBuilder("inc", num_args=1)
    >>> k = Kernel("inc", lambda key: jax.jit(lambda x: (x + 1,)))
    >>> (y,) = b.emit_invoke(k, None, b.args, 1)
    >>> b.emit_ret([y])
    >>> VM(b.finish()).run(jnp.int32(1))
    (Array(2, dtype=int32),)
  """

  __slots__ = ("program", "_code", "_stats", "_entry", "_kernels")

  def __init__(self, program: Program):
    self.program = program
    labels, flat = {}, []
    for block in program.blocks:
      labels[block.label] = len(flat)
      flat.extend(block.instrs)
    self._stats = VMStats()
    self._code = [self._lower(pc, ins, labels) for pc, ins in enumerate(flat)]
    self._kernels = program.kernels()

  def _lower(self, pc: int, ins: Instr, labels: dict):  # noqa: C901 - one case per opcode
    nxt = pc + 1
    op = ins.op
    st = self._stats
    if op is Op.INVOKE:
      kernel, dsts, srcs = ins.kernel, ins.dsts, ins.srcs
      if _is_reg_key(ins.key):
        kreg = ins.key[1]

        def step(regs):
          outs = kernel.get(regs[kreg])(*[regs[s] for s in srcs])
          for d, o in zip(dsts, outs, strict=True):
            regs[d] = o
          st.invokes += 1
          return nxt
      else:
        key = ins.key

        def step(regs):
          outs = kernel.get(key)(*[regs[s] for s in srcs])
          for d, o in zip(dsts, outs, strict=True):
            regs[d] = o
          st.invokes += 1
          return nxt
      return step
    if op is Op.IF:
      (p,) = ins.srcs
      t, f = labels[ins.target[0]], labels[ins.target[1]]
      return lambda regs: t if regs[p] else f
    if op is Op.GOTO:
      t = labels[ins.target[0]]
      return lambda regs: t
    if op is Op.RET:
      srcs = ins.srcs

      def step(regs):
        regs.append(tuple(regs[s] for s in srcs))  # the result rides at the end of the file
        return -1
      return step
    if op is Op.MOVE:
      (d,), (s,) = ins.dsts, ins.srcs

      def step(regs):
        regs[d] = regs[s]
        return nxt
      return step
    if op is Op.CONST:
      (d,), v = ins.dsts, ins.imm

      def step(regs):
        regs[d] = v
        return nxt
      return step
    if op is Op.SHAPE_OF:
      (d,), (s,) = ins.dsts, ins.srcs

      def step(regs):
        regs[d] = regs[s].shape
        return nxt
      return step
    if op is Op.HOST_OP:
      (d,), srcs, fn = ins.dsts, ins.srcs, ins.imm

      def step(regs):
        regs[d] = fn(*[regs[s] for s in srcs])
        return nxt
      return step
    if op is Op.READ_SCALAR:
      (d,), (s,) = ins.dsts, ins.srcs

      def step(regs):
        regs[d] = np.asarray(regs[s])  # blocks until the value is computed
        st.host_syncs += 1
        return nxt
      return step
    if op is Op.CALL:
      dsts, srcs, fn = ins.dsts, ins.srcs, ins.imm

      def step(regs):
        outs = fn(*[regs[s] for s in srcs])
        for dd, o in zip(dsts, outs, strict=True):
          regs[dd] = o
        st.calls += 1
        return nxt
      return step
    if op in (Op.REPAD, Op.UNPAD, Op.PAD):
      dsts, n = ins.dsts, len(ins.dsts)
      srcs, shape_reg = ins.srcs[:n], ins.srcs[n]
      if op is Op.PAD:
        def step(regs):
          outs, via_host = pad([regs[s] for s in srcs], regs[shape_reg])
          for dd, o in zip(dsts, outs, strict=True):
            regs[dd] = o
          st.pad_via_host += via_host
          return nxt
      elif op is Op.REPAD:
        def step(regs):
          outs = repad([regs[s] for s in srcs], regs[shape_reg])
          for dd, o in zip(dsts, outs, strict=True):
            regs[dd] = o
          st.repads += 1
          return nxt
      else:
        to_host = bool(ins.imm)

        def step(regs):
          outs, via_host = unpad([regs[s] for s in srcs], regs[shape_reg], to_host)
          for dd, o in zip(dsts, outs, strict=True):
            regs[dd] = o
          st.unpad_to_host += via_host
          return nxt
      return step
    if op is Op.ALLOC_TENSOR:
      (d,), (shape, dtype) = ins.dsts, ins.imm

      def step(regs):
        regs[d] = jnp.zeros(shape, dtype)
        return nxt
      return step
    if op is Op.KILL:
      (s,) = ins.srcs

      def step(regs):
        regs[s] = None
        return nxt
      return step
    raise AssertionError(f"unknown opcode {op!r}")

  def run(self, *args) -> tuple:
    """Runs the program on ``args`` (one per argument register); returns ``ret``'s values."""
    prog = self.program
    if len(args) != len(prog.arg_regs):
      raise TypeError(f"program {prog.name} takes {len(prog.arg_regs)} arguments, got "
                      f"{len(args)}")
    regs: list = [None] * prog.num_regs
    for r, a in zip(prog.arg_regs, args, strict=True):
      regs[r] = a
    st = self._stats
    kernels = self._kernels
    compiles0 = sum(k.compiles for k in kernels)
    code = self._code
    pc, n = 0, 0
    while pc >= 0:  # hot loop: ~0.1 us per instruction (see the module docstring)
      pc = code[pc](regs)
      n += 1
    st.runs += 1
    st.instructions += n
    st.compiles += sum(k.compiles for k in kernels) - compiles0
    return regs[-1]

  def take_stats(self) -> VMStats:
    """Returns the counters since the last call and resets them (records them globally)."""
    s = self._stats
    self._stats = VMStats()
    # Closures captured the old object: swap counters in place instead.
    fresh = dataclasses.replace(s, loops=list(s.loops), batches=list(s.batches))
    for f in _COUNTERS:
      setattr(s, f, 0)
    s.loops.clear()
    s.batches.clear()
    self._stats = s
    return fresh
