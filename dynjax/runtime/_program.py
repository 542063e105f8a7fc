"""The VM's executable format: a :class:`Program` of basic blocks over registers.

This is the run-side half of the build/run split (as TVM's ``relax.exec_builder`` builds what
``runtime.vm`` runs): ``dynjax.control`` traces user code and *builds* Programs with
:class:`ProgramBuilder`; :mod:`dynjax.runtime` only *runs* them and never imports tracing code.

A Program is a list of basic blocks. A block is a label and straight-line instructions; it ends
in a terminator (``If``, ``Goto``, ``Ret``) or falls through to the next block. Registers are numbered slots holding either device
arrays (never read by the host unless an instruction says so) or small host values (sizes,
bucket keys, predicates). Compiled code is reached through :class:`Kernel`: a named family of
executables, one per *key* (a bucket, a batch size); the kernel's ``build(key)`` thunk comes
from the build side, so the runtime compiles lazily without knowing how code was traced.

Instruction set (operands: ``%r`` registers, ``$k`` host immediates):

============  ========================================================================
``Invoke``    ``%d... = invoke K[key] (%a...)``: run kernel K's executable for ``key``
              (an immediate, or a host register ``%k``); async, no host sync.
``If``        ``if %p then L1 else L2``: branch on a *host* value (see ``ReadScalar``).
``Goto``      ``goto L``.
``Ret``       ``ret %a...``: return these registers.
``Move``      ``%d = move %s``.
``Const``     ``%d = const $v``: load an immediate (index arrays, shapes, sizes).
``ShapeOf``   ``%d = shape_of %s``: the array's shape, a host tuple (no sync: metadata).
``HostOp``    ``%d = host fn(%a...)``: a host-side function of host values (bucket choice,
              size arithmetic) -- the VM's shape functions.
``ReadScalar`` ``%d = read %s``: copy a small device array to the host. The ONLY
              instruction that blocks on the device; counted in ``stats.host_syncs``.
``Repad``     ``%d... = repad %s... to %shape...``: move padded arrays into another bucket
              (pad with zeros / drop the tail); one cached executable per (from, to).
``Unpad``     ``%d... = unpad %s... to %shape...``: exact-shape results for the caller.
``AllocTensor`` ``%d = alloc_tensor $shape $dtype``: a zero device buffer (batching arenas).
``Kill``      ``kill %r``: drop a register so its buffer can be freed early.
``Pad``       ``%d... = pad %s... to %shape...``: exact-shape arguments into their bucket
              shapes on the *host* (zero buffer, one transfer; no compile per exact shape).
``Call``      ``%d... = call f(%a...)``: run a sub-program (a control op: a hoisted loop, a
              cond) through a host callable; it may sync.  Counted in ``stats.calls``.
============  ========================================================================
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any


class Op(enum.IntEnum):
  INVOKE = 0
  IF = 1
  GOTO = 2
  RET = 3
  MOVE = 4
  CONST = 5
  SHAPE_OF = 6
  HOST_OP = 7
  READ_SCALAR = 8
  REPAD = 9
  UNPAD = 10
  ALLOC_TENSOR = 11
  KILL = 12
  PAD = 13
  CALL = 14


class Kernel:
  """A named family of compiled executables, one per key, built lazily and cached.

  ``build(key)`` returns a callable ``exe(*arrays) -> tuple of arrays`` (typically a
  ``jax.jit`` function specialised for the key). The runtime calls ``get(key)`` on every
  ``Invoke`` (hot path: one dict lookup, ~0.05 us).

  Example:
    >>> k = Kernel("double", lambda key: (lambda x: (x * 2,)))
    >>> k.get(None)(3)
    (6,)
  """

  __slots__ = ("name", "build", "describe", "_exes", "_lock", "compiles", "calls", "keys_built")

  def __init__(self, name: str, build: Callable[[Hashable], Callable],
               describe: Callable[[Hashable], str] = repr):
    self.name = name
    self.build = build
    self.describe = describe  # key -> short text for as_text()
    self._exes: dict[Hashable, Callable] = {}
    self._lock = threading.Lock()
    self.compiles = 0
    self.calls = 0
    self.keys_built: list[Hashable] = []

  def get(self, key: Hashable) -> Callable:
    exe = self._exes.get(key)
    if exe is None:
      with self._lock:
        exe = self._exes.get(key)
        if exe is None:
          exe = self.build(key)
          self._keep(key, exe)
    return exe

  def _keep(self, key: Hashable, exe: Callable) -> None:  # under self._lock
    self._exes[key] = exe
    self.compiles += 1
    self.keys_built.append(key)

  def has(self, key: Hashable) -> bool:
    return key in self._exes

  def add(self, key: Hashable, exe: Callable) -> bool:
    """Registers an executable built elsewhere for ``key`` (e.g. compiled concurrently by a
    warm-up); returns False (and keeps the existing one) when ``key`` was built meanwhile."""
    with self._lock:
      if key in self._exes:
        return False
      self._keep(key, exe)
      return True

  def __repr__(self) -> str:
    return f"Kernel({self.name!r}, {len(self._exes)} executables)"


@dataclasses.dataclass(frozen=True, slots=True)
class Instr:
  """One instruction: an opcode and its operands (see the module docstring)."""

  op: Op
  dsts: tuple[int, ...] = ()
  srcs: tuple[int, ...] = ()
  kernel: Kernel | None = None
  key: Any = None  # Invoke: immediate key; or ("reg", r) for a key held in a register
  imm: Any = None  # Const value, HostOp function, AllocTensor (shape, dtype), Repad/Unpad info
  target: tuple[str, ...] = ()  # labels for If/Goto

  def as_text(self, names: Sequence[str] | None = None) -> str:
    def reg(r):
      return f"%{r}" if names is None or not names[r] else f"%{names[r]}"

    d = ", ".join(reg(r) for r in self.dsts)
    s = ", ".join(reg(r) for r in self.srcs)
    lhs = f"{d} = " if d else ""
    op = self.op
    if op is Op.INVOKE:
      key = reg(self.key[1]) if _is_reg_key(self.key) else self.kernel.describe(self.key)
      return f"{lhs}invoke {self.kernel.name}[{key}] ({s})"
    if op is Op.IF:
      return f"if {s} then {self.target[0]} else {self.target[1]}"
    if op is Op.GOTO:
      return f"goto {self.target[0]}"
    if op is Op.RET:
      return f"ret {s}"
    if op is Op.CONST:
      return f"{lhs}const {_short(self.imm)}"
    if op is Op.HOST_OP:
      return f"{lhs}host {getattr(self.imm, '__name__', 'fn')}({s})"
    if op is Op.ALLOC_TENSOR:
      shape, dtype = self.imm
      return f"{lhs}alloc_tensor {tuple(shape)} {dtype}"
    if op is Op.CALL:
      return f"{lhs}call {getattr(self.imm, '__name__', 'fn')}({s})"
    if op in (Op.REPAD, Op.UNPAD, Op.PAD):
      n = len(self.dsts)
      srcs, shape_reg = self.srcs[:n], self.srcs[n]
      what = {Op.REPAD: "repad", Op.UNPAD: "unpad_to_host" if self.imm else "unpad",
              Op.PAD: "pad"}[op]
      return f"{lhs}{what} {', '.join(reg(r) for r in srcs)} to {reg(shape_reg)}"
    name = {Op.MOVE: "move", Op.SHAPE_OF: "shape_of", Op.READ_SCALAR: "read",
            Op.KILL: "kill"}[op]
    return f"{lhs}{name} {s}"


def _is_reg_key(key) -> bool:
  return isinstance(key, tuple) and len(key) == 2 and key[0] == "reg"


def _short(value) -> str:
  shape = getattr(value, "shape", None)
  if shape is not None and getattr(value, "size", 0) > 8:
    return f"<{getattr(value, 'dtype', '')}{list(shape)}>"
  text = " ".join(repr(value).split())
  return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass
class Block:
  label: str
  instrs: list[Instr]


class Program:
  """A finished program: blocks, register count, which registers hold the arguments.

  Attributes:
    name: shown by :meth:`as_text`.
    blocks: basic blocks; execution starts at ``blocks[0]``.
    num_regs: the register file size.
    arg_regs: registers that receive the call's arguments, in order.
    reg_names: optional readable names for registers (printing only).

  Example:
    >>> b = ProgramBuilder("ident", num_args=1)
    >>> b.emit_ret(b.args)
    >>> print(b.finish().as_text())
    program ident(%0):
    entry:
      ret %0
  """

  __slots__ = ("name", "blocks", "num_regs", "arg_regs", "reg_names", "meta")

  def __init__(self, name: str, blocks: list[Block], num_regs: int, arg_regs: tuple[int, ...],
               reg_names: list[str] | None = None, meta: dict | None = None):
    self.name = name
    self.blocks = blocks
    self.num_regs = num_regs
    self.arg_regs = arg_regs
    self.reg_names = reg_names
    self.meta = meta or {}

  def num_instrs(self) -> int:
    return sum(len(b.instrs) for b in self.blocks)

  def kernels(self) -> list[Kernel]:
    seen: dict[int, Kernel] = {}
    for b in self.blocks:
      for ins in b.instrs:
        if ins.kernel is not None:
          seen.setdefault(id(ins.kernel), ins.kernel)
    return list(seen.values())

  def as_text(self) -> str:
    """The program in a readable assembly-like form (one instruction per line)."""
    names = self.reg_names
    args = ", ".join(f"%{r}" if not names or not names[r] else f"%{names[r]}"
                     for r in self.arg_regs)
    lines = [f"program {self.name}({args}):"]
    for block in self.blocks:
      lines.append(f"{block.label}:")
      lines.extend("  " + ins.as_text(names) for ins in block.instrs)
    return "\n".join(lines)

  def __repr__(self) -> str:
    return (f"Program({self.name!r}, {len(self.blocks)} blocks, {self.num_instrs()} "
            f"instructions, {self.num_regs} registers)")


class ProgramBuilder:
  """Builds a :class:`Program` block by block (the ``exec_builder`` of dynjax).

  Example:
    >>> b = ProgramBuilder("twice", num_args=1)
    >>> k = Kernel("double", lambda key: (lambda x: (x * 2,)))
    >>> (y,) = b.emit_invoke(k, None, b.args, 1)
    >>> b.emit_ret([y])
    >>> prog = b.finish()
    >>> print(prog.as_text())
    program twice(%0):
    entry:
      %1 = invoke double[None] (%0)
      ret %1
  """

  def __init__(self, name: str, num_args: int, arg_names: Sequence[str] | None = None):
    self.name = name
    self._num_regs = 0
    self._names: list[str] = []
    self.args = tuple(self.new_reg(arg_names[i] if arg_names else "") for i in range(num_args))
    self._blocks: list[Block] = []
    self._current: Block | None = None
    self.meta: dict = {}
    self.block("entry")

  # -- registers and blocks ------------------------------------------------------------
  def new_reg(self, name: str = "") -> int:
    self._num_regs += 1
    self._names.append(name)
    return self._num_regs - 1

  def name_reg(self, reg: int, name: str) -> None:
    """Gives a register a readable name for ``as_text()``."""
    self._names[reg] = name

  def new_regs(self, n: int, prefix: str = "") -> tuple[int, ...]:
    return tuple(self.new_reg(f"{prefix}{i}" if prefix else "") for i in range(n))

  def block(self, label: str) -> str:
    """Starts a new block named ``label``; following emits go into it."""
    if any(b.label == label for b in self._blocks):
      raise ValueError(f"block label {label!r} used twice")
    self._current = Block(label, [])
    self._blocks.append(self._current)
    return label

  def _emit(self, ins: Instr) -> None:
    self._current.instrs.append(ins)

  # -- instructions --------------------------------------------------------------------
  def emit_invoke(self, kernel: Kernel, key, args: Sequence[int], num_results: int,
                  key_reg: int | None = None) -> tuple[int, ...]:
    dsts = self.new_regs(num_results)
    k = ("reg", key_reg) if key_reg is not None else key
    self._emit(Instr(Op.INVOKE, dsts, tuple(args), kernel=kernel, key=k))
    return dsts

  def emit_invoke_into(self, kernel: Kernel, key, args: Sequence[int], dsts: Sequence[int],
                       key_reg: int | None = None) -> None:
    k = ("reg", key_reg) if key_reg is not None else key
    self._emit(Instr(Op.INVOKE, tuple(dsts), tuple(args), kernel=kernel, key=k))

  def emit_if(self, pred: int, then_label: str, else_label: str) -> None:
    self._emit(Instr(Op.IF, srcs=(pred,), target=(then_label, else_label)))

  def emit_goto(self, label: str) -> None:
    self._emit(Instr(Op.GOTO, target=(label,)))

  def emit_ret(self, regs: Sequence[int]) -> None:
    self._emit(Instr(Op.RET, srcs=tuple(regs)))

  def emit_move(self, dst: int, src: int) -> None:
    self._emit(Instr(Op.MOVE, (dst,), (src,)))

  def emit_const(self, value, dst: int | None = None) -> int:
    dst = self.new_reg() if dst is None else dst
    self._emit(Instr(Op.CONST, (dst,), imm=value))
    return dst

  def emit_shape_of(self, src: int) -> int:
    dst = self.new_reg()
    self._emit(Instr(Op.SHAPE_OF, (dst,), (src,)))
    return dst

  def emit_host_op(self, fn: Callable, args: Sequence[int], dst: int | None = None) -> int:
    dst = self.new_reg() if dst is None else dst
    self._emit(Instr(Op.HOST_OP, (dst,), tuple(args), imm=fn))
    return dst

  def emit_read_scalar(self, src: int, dst: int | None = None) -> int:
    dst = self.new_reg() if dst is None else dst
    self._emit(Instr(Op.READ_SCALAR, (dst,), (src,)))
    return dst

  def emit_repad(self, srcs: Sequence[int], shapes_reg: int, dsts: Sequence[int] | None = None
                 ) -> tuple[int, ...]:
    """``shapes_reg`` holds a host tuple of target shapes, one per source."""
    return self._emit_to_shapes(Op.REPAD, srcs, shapes_reg, dsts)

  def emit_unpad(self, srcs: Sequence[int], shapes_reg: int, to_host: bool = False
                 ) -> tuple[int, ...]:
    """Exact-shape results; ``to_host``: as numpy arrays (no transfer back to the device)."""
    dsts = self.new_regs(len(srcs))
    self._emit(Instr(Op.UNPAD, dsts, tuple(srcs) + (shapes_reg,), imm=bool(to_host)))
    return dsts

  def emit_pad(self, srcs: Sequence[int], shapes_reg: int, dsts: Sequence[int] | None = None
               ) -> tuple[int, ...]:
    """Host-side padding of (exact-shape) arguments to the shapes in ``shapes_reg``."""
    return self._emit_to_shapes(Op.PAD, srcs, shapes_reg, dsts)

  def _emit_to_shapes(self, op: Op, srcs: Sequence[int], shapes_reg: int,
                      dsts: Sequence[int] | None) -> tuple[int, ...]:
    dsts = tuple(dsts) if dsts is not None else self.new_regs(len(srcs))
    self._emit(Instr(op, dsts, tuple(srcs) + (shapes_reg,)))
    return dsts

  def emit_call(self, fn: Callable, args: Sequence[int], num_results: int | None = None,
                dsts: Sequence[int] | None = None) -> tuple[int, ...]:
    """``fn(*args)`` returns a tuple of ``num_results`` values (a sub-program run)."""
    dsts = tuple(dsts) if dsts is not None else self.new_regs(num_results)
    self._emit(Instr(Op.CALL, dsts, tuple(args), imm=fn))
    return dsts

  def emit_alloc_tensor(self, shape, dtype, dst: int | None = None) -> int:
    dst = self.new_reg() if dst is None else dst
    self._emit(Instr(Op.ALLOC_TENSOR, (dst,), imm=(tuple(shape), str(dtype))))
    return dst

  def emit_kill(self, reg: int) -> None:
    self._emit(Instr(Op.KILL, srcs=(reg,)))

  def finish(self) -> Program:
    labels = {b.label for b in self._blocks}
    last = self._blocks[-1]
    if not last.instrs or last.instrs[-1].op not in (Op.IF, Op.GOTO, Op.RET):
      raise ValueError(f"the last block {last.label!r} does not end in if/goto/ret")
    for b in self._blocks:
      for ins in b.instrs:
        for t in ins.target:
          if t not in labels:
            raise ValueError(f"block {b.label!r} jumps to unknown label {t!r}")
    names = self._names if any(self._names) else None
    return Program(self.name, self._blocks, self._num_regs, self.args, names, dict(self.meta))
