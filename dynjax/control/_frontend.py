"""Shared pieces of the control-flow frontends: the core hook and trace-context helpers.

The frontends (``while_loop``, ``cond``, ``cell``, ``recursive``) run on concrete values by
building a :class:`~dynjax.runtime.Program` and running it on the VM.  When they see JAX
tracers instead, two cases:

* the operation has a pure-XLA form (a loop whose carry keeps its shapes, a cond whose
  branches agree, a cell call) -- it lowers to ``lax.while_loop``/``lax.cond``/the cell itself,
  valid under any trace;
* it has none (a carry that changes shape, recursion over a host structure) -- it raises
  :class:`NeedsProgram`.  ``dynjax.jit`` catches it and re-runs the function through
  :func:`dynjax.control.run_in_program`; under a plain ``jax.jit`` the user sees the message.
"""

from __future__ import annotations

import contextlib
import threading

import jax

from dynjax import _jax_private as jp
from dynjax._errors import ControlFlowError, DynjaxError


class NeedsProgram(DynjaxError, RuntimeError):
  """A control-flow op met JAX tracers but needs the VM (shapes that change, host recursion).

  ``dynjax.jit`` catches this while tracing and runs the function with
  :func:`dynjax.control.run_in_program` instead.  Seen by a user, it means the op was called
  under ``jax.jit``/``vmap``/``grad``, which cannot hold it.

  Example:
    >>> try:
    ...   jax.jit(lambda x: dynjax.while_loop(lambda c: c.shape[0] < 4,
    ...       lambda c: jnp.concatenate([c, c]), x))(jnp.ones(1))
    ... except dynjax.control.NeedsProgram as e:
    ...   print("needs the VM")
    needs the VM
  """

  def __init__(self, op: str, why: str):
    self.op = op
    self.why = why
    super().__init__(
        f"dynjax.{op} cannot run inside a JAX trace here: {why}.\n"
        "It needs the dynjax VM (host decisions between compiled blocks). Call it outside "
        "jax.jit/vmap/grad, or inside a dynjax.jit function (which runs it through "
        "dynjax.control.run_in_program).")


def is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def any_tracer(leaves) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in leaves)


_local = threading.local()


@contextlib.contextmanager
def building(what: str):
  """Marks that dynjax itself is tracing ``what`` (a loop body, a cell) on this thread.

  Inside, a nested op that cannot lower to XLA raises :class:`ControlFlowError` naming the
  outer construct (the outer construct may then fall back), instead of ``NeedsProgram``.
  """
  stack = getattr(_local, "stack", None)
  if stack is None:
    stack = _local.stack = []
  stack.append(what)
  try:
    yield
  finally:
    stack.pop()


def building_what() -> str | None:
  stack = getattr(_local, "stack", None)
  top = stack[-1] if stack else None
  return top if isinstance(top, str) else None


@contextlib.contextmanager
def staging(stager):
  """Marks that dynjax stages a host program on this thread (``control/_staging.py``).

  Inside, a control op that meets tracers and has no XLA form is *staged* (an opaque equation
  the program runs on the VM) instead of raising; a ``building`` context pushed later (a loop
  body traced for XLA) takes precedence again.
  """
  stack = getattr(_local, "stack", None)
  if stack is None:
    stack = _local.stack = []
  stack.append(stager)
  try:
    yield stager
  finally:
    stack.pop()


def current_stager():
  """The innermost staging context of this thread, unless a ``building`` one is nearer."""
  stack = getattr(_local, "stack", None)
  top = stack[-1] if stack else None
  return None if top is None or isinstance(top, str) else top


class NotLowerable(ControlFlowError):
  """Internal: an op inside a dynjax-built trace has no pure-XLA form (outer falls back)."""


def needs_vm(op: str, why: str, leaves=()) -> Exception:
  """The exception for an op that met tracers and has no XLA form.

  ``leaves`` (recursions: ``recursive``, ``fold``): the values that held the tracers.
  Tracers of differentiation (``jax.grad``, ``jvp``, ``vjp``) get a :class:`ControlFlowError`
  of their own: the VM has no backward pass, so ``dynjax.jit`` (which catches
  :class:`NeedsProgram` and reruns the function on concrete values, where ``jax.grad`` still
  makes tracers) could not run the recursion either.
  """
  if any(jp.is_differentiation_tracer(x) for x in leaves):
    return ControlFlowError(
        f"dynjax.{op} cannot be differentiated (jax.grad/jvp/vjp): {why}. The VM has no "
        "backward pass, inside dynjax.jit either. Differentiate a plain-JAX version of the same recursion (a Python function "
        "without dynjax.recursive or fold: a dynjax.cell called under a JAX trace runs as its "
        f"own function), and keep dynjax.{op} for the forward pass (inference).")
  outer = building_what()
  if outer is not None:
    return NotLowerable(f"dynjax.{op} inside {outer} has no XLA form: {why}")
  return NeedsProgram(op, why)
