"""``run_in_program``: how ``dynjax.jit`` runs a function that uses the control-flow ops.

The core traces a function symbolically; when a control op inside raises
:class:`~dynjax.control.NeedsProgram`, the function cannot be one XLA executable.  The core then
calls :func:`run_in_program`, which runs the Python function on the host with *concrete*
arguments:

* every control op (``while_loop``, ``cond``, ``recursive``) runs on the VM as on its own: a
  hoisted loop syncs once per bucket, a cond once for its predicate, a recursion batch never;
* the straight-line JAX code between them runs eagerly, op by op, through JAX's own
  per-primitive executable cache: ~5-20 us of dispatch per op on CPU, one small compile per
  (op, shape) the first time.  Nothing is padded there, so new shapes compile per op.

Cost model, therefore: a function that is mostly one loop or one recursion (the common case:
``generate``, a Tree-LSTM encoder) pays only the control op's own cost; a function with much
straight-line work around its control ops should put that work inside the loop body, a cond
branch or a cell, which are compiled per bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from dynjax.control._frontend import any_tracer

_RUNS = {"calls": 0, "seconds": 0.0}


def run_in_program(fun: Callable, args: tuple, kwargs: Mapping[str, Any] | None = None,
                   options: Mapping[str, Any] | None = None):
  """Runs ``fun(*args, **kwargs)`` with its control-flow ops on the VM (see module docstring).

  Args:
    fun: the user's function (as given to ``dynjax.jit``).
    args: concrete positional arguments (arrays at their exact shapes).
    kwargs: concrete keyword arguments.
    options: the ``dynjax.jit`` options (unused for now; reserved for bucket policies of
      straight-line segments).

  Returns:
    ``fun``'s outputs, exact shapes.

  Example:
    >>> def grow(x):
    ...   return dynjax.while_loop(lambda c: c.shape[0] < 8,
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
    _RUNS["seconds"] += time.perf_counter() - t0


def program_runs() -> dict:
  """How many functions ran through :func:`run_in_program`, and their total seconds."""
  return dict(_RUNS)
