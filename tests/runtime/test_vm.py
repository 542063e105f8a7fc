"""The VM: programs, control instructions, repad/unpad, dispatch cost."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from dynjax.runtime import VM, Kernel, ProgramBuilder, collect_stats


def _counting_program(n_reg_ops: int = 0):
  """A host-only loop: i = 0; while i < n: i += 1 (plus optional moves)."""
  b = ProgramBuilder("count", 1, ["n"])
  (n,) = b.args
  i = b.emit_const(0)
  b.block("loop")
  go = b.emit_host_op(lambda i, n: i < n, [i, n])
  b.emit_if(go, "body", "done")
  b.block("body")
  b.emit_host_op(lambda i: i + 1, [i], dst=i)
  tmp = b.new_reg()
  for _ in range(n_reg_ops):
    b.emit_move(tmp, i)
  b.emit_goto("loop")
  b.block("done")
  b.emit_ret([i])
  return b.finish()


def test_control_instructions_and_text():
  prog = _counting_program()
  assert VM(prog).run(7) == (7,)
  assert prog.as_text().splitlines() == [
      "program count(%n):", "entry:", "  %1 = const 0", "loop:", "  %2 = host <lambda>(%1, %n)",
      "  if %2 then body else done", "body:", "  %1 = host <lambda>(%1)", "  goto loop",
      "done:", "  ret %1"]


def test_invoke_read_and_stats():
  k = Kernel("inc", lambda key: jax.jit(lambda x: (x + 1,)))
  b = ProgramBuilder("inc", 1)
  (y,) = b.emit_invoke(k, None, b.args, 1)
  h = b.emit_read_scalar(y)
  b.emit_ret([h])
  vm = VM(b.finish())
  with collect_stats() as s:
    (out,) = vm.run(jnp.int32(1))
    from dynjax.runtime._vm import record
    record(vm.take_stats())
  assert int(out) == 2 and isinstance(out, np.ndarray)
  assert s.host_syncs == 1 and s.invokes == 1 and s.compiles == 1


def test_repad_and_unpad():
  from dynjax.runtime._vm import repad, unpad
  x = jnp.arange(6.0).reshape(2, 3)
  (y,) = repad([x], [(2, 8)])
  assert y.shape == (2, 8) and np.asarray(y)[:, :3].tolist() == x.tolist()
  (z,), via_host = unpad([y], [(2, 3)])
  np.testing.assert_array_equal(z, x)
  assert via_host == 1


def test_dispatch_cost():
  """Per-instruction cost of the interpreter (printed; WORKSPACE.md quotes it)."""
  n = 2000
  base, moves = _counting_program(0), _counting_program(10)
  vb, vm = VM(base), VM(moves)
  vb.run(10)
  vm.run(10)
  t0 = time.perf_counter()
  vb.run(n)
  t1 = time.perf_counter()
  vm.run(n)
  t2 = time.perf_counter()
  per_loop_instr = (t1 - t0) / (4 * n)  # host, if, host, goto
  per_move = ((t2 - t1) - (t1 - t0)) / (10 * n)
  print(f"\nVM: {1e6 * per_loop_instr:.3f} us per host/if/goto instruction, "
        f"{1e6 * per_move:.3f} us per move")
  assert per_move < 5e-6 and per_loop_instr < 10e-6


def test_pad_and_call_instructions():
  """``pad`` pads exact arguments on the host (no compile); ``call`` runs a sub-program."""
  b = ProgramBuilder("padcall", 1, ["x"])
  (x,) = b.args
  shp = b.emit_const(((2, 8),))
  (p,) = b.emit_pad([x], shp)
  (y, z) = b.emit_call(lambda v: (v.sum(), v.shape), [p], 2)
  b.emit_ret([p, y, z])
  prog = b.finish()
  assert prog.as_text().splitlines()[2:5] == [
      "  %1 = const ((2, 8),)", "  %2 = pad %x to %1", "  %3, %4 = call <lambda>(%2)"]
  vm = VM(prog)
  (out, total, shape), = [vm.run(np.arange(6, dtype=np.float32).reshape(2, 3))]
  st = vm.take_stats()
  assert shape == (2, 8) and float(total) == 15.0 and st.calls == 1 and st.pad_via_host == 1
  np.testing.assert_array_equal(np.asarray(out)[:, :3], np.arange(6).reshape(2, 3))
  assert not np.asarray(out)[:, 3:].any()


def test_unpad_to_host_returns_numpy():
  from dynjax.runtime._vm import unpad
  y = jnp.arange(16.0).reshape(2, 8)
  (z,), via_host = unpad([y], [(2, 3)], to_host=True)
  assert isinstance(z, np.ndarray) and z.shape == (2, 3) and via_host == 1
