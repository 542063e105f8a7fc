"""``run_in_program``: how ``dynjax.jit`` runs a function that uses the control-flow ops.

The core traces a function symbolically; when a control op inside raises
:class:`~dynjax.control.NeedsProgram`, the function cannot be one XLA executable.  The core then
runs it as a *host program*:

* **Compiled** (``ProgramRunner``, the default): the function is staged once per family
  (``_staging.py``): the straight-line JAX between control ops becomes compiled segments, one
  executable per (segment, bucket), inputs padded on the host with the function's ``buckets``
  policies, values padded on the device from one segment to the next; every control op
  (``while_loop``, ``cond``) is an instruction of the same VM program.  Compiles are bounded
  by segments x buckets (+ loop buckets), never one per exact shape.
* **Op by op** (:func:`run_in_program`, the fallback): the Python function runs eagerly on
  concrete arguments: control ops on the VM as on their own, the JAX code between them op by
  op through JAX's per-primitive cache (~5-20 us of dispatch per op on CPU, one small compile
  per (op, shape)).  Used when staging is impossible: a primitive the padding pass has no rule
  for over a dynamic axis, ``padding="exact"``, recursion (``dynjax.recursive``), effects, a
  control op under ``vmap``/an inner ``jit``, or Python code that needs a concrete dim.  The
  reason is in ``Wrapped.stats()["programs"]`` and ``program_runs()``.

Cost (CPU, 2 shared cores, ``python -m benchmarks decode``, ``program_*`` rows: a 4-layer
encoder on the prompt, then the decode loop): compiled 0.88 vs 6.35 ms per request op by op
(7.2x; d 32, 16 new tokens) and 4.2 vs 10.9 ms (2.6x; d 64, 32 new tokens, the loop weighs
more); 6 compiles vs 41-84 (one per (op, shape)); a new prompt length inside a bucket compiles
nothing.  Host cost of the compiled path: ~20 us a run on top of its executables.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from dynjax import _symbolic
from dynjax._errors import PaddingUnsupportedError
from dynjax.control import _staging
from dynjax.control._carry import EmptiedCarry
from dynjax.control._frontend import any_tracer

_RUNS = {"calls": 0, "seconds": 0.0, "compiled": 0, "op_by_op": 0, "last_reason": None}


def run_in_program(fun: Callable, args: tuple, kwargs: Mapping[str, Any] | None = None,
                   options: Mapping[str, Any] | None = None):
  """Runs ``fun(*args, **kwargs)`` op by op with its control-flow ops on the VM.

  This is the fallback path of a host program (see the module docstring); ``dynjax.jit``
  compiles the straight-line code between control ops whenever it can.

  Args:
    fun: the user's function (as given to ``dynjax.jit``).
    args: concrete positional arguments (arrays at their exact shapes).
    kwargs: concrete keyword arguments.
    options: the ``dynjax.jit`` options (unused here).

  Returns:
    ``fun``'s outputs, exact shapes.

  Example:
    >>> def grow(x):
    ...   return dynjax.while_loop(lambda c: jnp.asarray(c.shape[0]) < 8,
    ...                            lambda c: jnp.concatenate([c, c]), x)
    >>> dynjax.control.run_in_program(grow, (jnp.ones(1),)).shape
    (8,)
  """
  kwargs = dict(kwargs or {})
  del options
  if any_tracer(jax.tree_util.tree_leaves((args, kwargs))):
    raise TypeError("run_in_program needs concrete arguments, got JAX tracers")
  t0 = time.perf_counter()
  try:
    return fun(*args, **kwargs)
  finally:
    _RUNS["calls"] += 1
    _RUNS["op_by_op"] += 1
    _RUNS["seconds"] += time.perf_counter() - t0


class ProgramRunner:
  """One ``dynjax.jit`` family run as a compiled host program, or op by op and why.

  Attributes:
    staged: the :class:`~dynjax.control._staging.StagedFunction`, or None.
    reason: why the family runs op by op (None when compiled).
    out_tree: the output pytree structure of the staged trace.
  """

  def __init__(self, flat_fun, sym_avals, sig, policies, name: str, padding: str):
    self.staged = None
    self.reason = None
    self.out_tree = None
    self.runs = 0
    self.empty_runs = 0  # calls with a dynamic size of 0, run op by op
    self.emptied_runs = 0  # calls whose staged loop emptied a shrinking carry: op by op
    self.outside_runs = 0  # calls whose sizes break a guard the family traced under: op by op
    self._sig = sig
    self._dyn = tuple(i for i, s in enumerate(sig.leaves) if s is not None)
    if padding == "exact":
      self.reason = 'padding="exact": no padded segments'
      return
    dyn_in = tuple(i for i, s in enumerate(sig.leaves) if s is not None)
    try:
      self.staged, _ = _staging.stage(
          flat_fun, sym_avals, sig.scope, dict(zip(sig.var_order, policies, strict=True)),
          name, sig.var_order, solve=lambda shapes: _symbolic.solve_sizes(sig, shapes),
          dyn_in=dyn_in)
      self.out_tree = flat_fun.out_tree
    except Exception as e:  # noqa: BLE001 - anything unstageable runs op by op
      self.staged = None
      first = str(e).strip().splitlines()[0] if str(e).strip() else ""
      self.reason = f"{type(e).__name__}: {first}"

  def _sizes(self, leaves) -> tuple:
    shapes = [None] * len(self._sig.leaves)
    for i in self._dyn:
      shapes[i] = tuple(np.shape(leaves[i]))
    return tuple(_symbolic.solve_sizes(self._sig, shapes))

  def describe(self) -> dict:
    st = self.staged
    return {"compiled": st is not None, "reason": self.reason, "runs": self.runs,
            "runs_with_an_empty_dim": self.empty_runs,
            "runs_with_an_emptied_carry": self.emptied_runs,
            "runs_outside_guards": self.outside_runs,
            "segments": None if st is None else len(st.segments),
            "control_ops": None if st is None else [
                s.params["call"].name for s in st.steps if not hasattr(s, "eqns")]}

  def run(self, leaves, to_host: bool, eager: Callable[[], Any],
          holds: Callable[[tuple], bool] | None = None):
    """Flat outputs and their tree: compiled when possible, else ``eager()`` (op by op).

    ``holds(sizes)``: whether the call's sizes keep the guards the family (and so the staged
    program, which shares its symbolic scope) was traced under; else it runs op by op."""
    t0 = time.perf_counter()
    why = None
    sizes = self._sizes(leaves) if self.staged is not None else ()
    if self.staged is not None and holds is not None and 0 not in sizes and not holds(sizes):
      self.outside_runs += 1  # (before: such a call ran the program, wrong or raising)
      why = "sizes outside the guards the function was traced under"
    elif self.staged is not None and 0 in sizes:
      # A dynamic size of 0: the staged program's dims are JAX dim variables, taken to be
      # >= 1 (code reading an empty axis, x[-1:], was traced as one entry).  Such calls run
      # op by op, as dynjax.jit runs a size of 0 exact.
      self.empty_runs += 1
      why = "a dynamic size of 0 (JAX dims are >= 1: no padded form)"
    elif self.staged is not None:
      try:
        outs = self.staged.run(leaves, to_host=to_host)
      except PaddingUnsupportedError as e:  # a bucket the probe did not see: op by op
        self.staged = None
        self.reason = f"PaddingUnsupportedError: {str(e).splitlines()[0]}"
      except EmptiedCarry as e:  # this call only (programs have no effects: run it again)
        self.emptied_runs += 1
        why = str(e)
      else:
        self.runs += 1
        _RUNS["calls"] += 1
        _RUNS["compiled"] += 1
        _RUNS["seconds"] += time.perf_counter() - t0
        return outs, self.out_tree
    _RUNS["last_reason"] = why or self.reason
    flat, tree = jax.tree_util.tree_flatten(eager())
    self.runs += 1
    return flat, tree


def program_runs() -> dict:
  """Functions run as host programs: calls, seconds, how many ran compiled vs op by op, and
  the last reason a program ran op by op.

  Example:
    >>> sorted(dynjax.control.program_runs())
    ['calls', 'compiled', 'last_reason', 'op_by_op', 'seconds']
  """
  return dict(_RUNS)
