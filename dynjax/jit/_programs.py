"""Host-program runs of ``dynjax.jit``: functions with dynjax control flow (a program on the VM
whose straight-line segments are compiled per bucket, or op by op), and op-by-op runs of a
call the exact path cannot build.  Functions of the :class:`~dynjax.jit._dispatch.Dispatcher`
(``disp``), split from it to keep that module small."""

from __future__ import annotations

import jax
from jax.tree_util import tree_unflatten

from dynjax import _symbolic
from dynjax.jit._args import is_padded
from dynjax.jit._placement import to_host


def eager(disp, fam, leaves):
  """The user's function on this call's exact arguments, op by op (control ops on the VM)."""
  from dynjax.control import run_in_program

  args, kw = disp.binder.call_args(fam.key[0], tree_unflatten(fam.key[1], leaves))
  return run_in_program(disp.binder.fun, tuple(args), kw, options=disp.opts)


def op_by_op(disp, fam, leaves, device: bool):
  """One call op by op: a dynjax control op with an XLA form symbolically (a cond whose
  branches agree on ``n``) but not at this call's sizes (at ``n = 0`` they differ)."""
  flat, tree = jax.tree_util.tree_flatten(eager(disp, fam, leaves))
  disp.counters.unpadded(fam.fid, "program", 0, False)
  return tree_unflatten(tree, to_host(flat) if not device else flat)


def run_program(disp, fam, leaves, device: bool):
  """A function with dynjax control flow: a host program on the VM whose straight-line
  segments are compiled per bucket (dynjax.control), or op by op when it cannot be staged."""
  from dynjax.control._inprogram import ProgramRunner
  leaves = [x.unpad() if is_padded(x) else x for x in leaves]
  if fam.program is None:
    fam.program = ProgramRunner(
        fam.flat_fun, _symbolic.symbolic_avals(fam.sig, fam.avals), fam.sig, fam.policies,
        disp.name, disp.opts.padding)

  def holds(sizes) -> bool:  # the family's guards (program families were traced under them)
    if fam.guard_ok(sizes):
      return True
    fam.outside_guards(sizes)  # warns once (raises under on_fallback="error")
    return False

  flat, tree = fam.program.run(leaves, not device, lambda: eager(disp, fam, leaves), holds)
  if not device:
    flat = to_host(flat)
  disp.counters.unpadded(fam.fid, "program", 0, False)
  return tree_unflatten(tree, flat)
