"""Host-mode loops: a ``while_loop`` whose body runs a shape-changing loop (or cond) itself.

Such a body is not one XLA computation, so the outer loop cannot be hoisted.  It runs as host
iterations over *staged* programs (``_staging.py``): ``cond_fun`` and ``body_fun`` are each
staged once over the outer carry's symbolic dims (the inner loop becomes a ``call`` of its own
hoisted sub-program, the code around it compiled segments, one executable per bucket).  The
carry stays padded on the device between iterations; per iteration the host reads the outer
predicate (one sync) and whatever the inner loops read (one status per bucket they visit).
After each body run the carry's new sizes are the body's output dims evaluated on the host
(they may depend on how long the inner loop ran) and the carry moves to their bucket
(``repad``: one cached executable per (from, to) bucket shapes).

A body that cannot be staged (recursion, a primitive without a padding rule...) runs as a plain
Python loop of eager calls (``mode="host_eager"``, reason in ``loop_stats()["fallback"]``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from dynjax import _jax_private as jp
from dynjax import _symbolic
from dynjax._errors import ControlFlowError, PaddingUnsupportedError, format_list
from dynjax.control._carry import (
  LAST_RUN,
  EmptiedCarry,
  bucket_of,
  carry_vars,
  emptied_error,
  flat_fns,
  initial_dims,
  keypaths,
  leaf_dims_of,
  max_iterations_error,
  moved_outs,
  named_axes,
  overflow_error,
  policies,
  split_offset,
  user_policy,
)
from dynjax.control._frontend import is_tracer
from dynjax.control._stager import Call, Env, Stager, StagingError, first_line
from dynjax.control._staging import StagedFunction, stage
from dynjax.runtime._vm import VMStats, collect_stats, pad, record, repad, unpad


def _crossed(buckets: list) -> int:
  return sum(1 for a, b in zip(buckets, buckets[1:], strict=False) if a != b)


class _HostIterations:
  """The shared core: staged cond and body over a symbolic carry, iterated on padded values.

  ``leaf_dims``: per carry leaf per axis an int, a carry variable, or a fixed program dim
  (text); ``carry_vars``: the carry variables (they change), with ``policies``.
  """

  def __init__(self, cond: StagedFunction, body: StagedFunction, body_out_avals,
               leaf_dims, carry_vars, policies: dict):
    self.cond, self.body = cond, body
    self.carry_vars = tuple(carry_vars)
    self.policies = policies
    self.leaf_dims = leaf_dims
    names = set(carry_vars) | _symbolic.vars_of_dims(
        [d for ld in leaf_dims for d in ld if isinstance(d, str)])
    self._shape_names = tuple(sorted(names))
    self._shapes = _symbolic.shape_fn(leaf_dims, self._shape_names)
    out_shapes = [a.shape for a in body_out_avals]
    out_names = tuple(sorted(_symbolic.vars_of_dims([d for s in out_shapes for d in s])))
    out_fn = _symbolic.shape_fn(out_shapes, out_names)
    self._out_shapes = lambda env: out_fn(*[env[v] for v in out_names])
    # (leaf, axis, var, k): the var's size is the axis's plus k (a var whose axes start empty
    # is one more than their size: ``_carry.shift_empty``)
    self.solve = [(li, ax, *split_offset(d)) for li, ld in enumerate(leaf_dims)
                  for ax, d in enumerate(ld) if isinstance(d, str)
                  and split_offset(d)[0] in self.carry_vars and split_offset(d)[1] >= 0]
    # Host mode grows past a policy's max for overflow="exact" too (it has no exact path).
    self.overflow, self.max_iterations = "grow", None
    self.paths = [f"init leaf {i}" for i in range(len(leaf_dims))]  # keypaths, when known

  def bucket(self, sizes: dict, rest=None) -> dict:
    """The buckets of the carry vars' sizes (raises past a max with overflow="error", and
    :class:`EmptiedCarry` where a var is below 1: JAX dims are >= 1, an empty axis of a var
    that did not start empty has no padded form; the caller runs exact).  ``rest()``: the
    exact carry the caller may go on from (``err.rest``), or None."""
    low = [f"{v} = {n}" for v, n in sizes.items() if n < 1]
    if low:
      err = emptied_error("while_loop in host mode", ", ".join(low))
      err.rest = None if rest is None else rest()
      raise err
    if self.overflow == "error":
      over = [(v, n, ", ".join(f"{self.paths[li]}.shape[{ax}]" for li, ax, u, _ in self.solve
                               if u == v), self.policies[v])
              for v, n in sizes.items() if self.policies[v].bucket(n) is None]
      if over:
        raise overflow_error(over)
    return {v: bucket_of(self.policies[v], n) for v, n in sizes.items()}

  def shapes(self, env: dict):
    return self._shapes(*[env[v] for v in self._shape_names])

  def iterate(self, env: Env, n_cond: int, consts: list, carry: list, info: dict):
    """Runs the loop from ``env`` (sizes and buckets of the carry vars included)."""
    cconsts, bconsts = consts[:n_cond], consts[n_cond:]
    while True:
      _, (p,) = self.cond.run_padded(env, [*cconsts, *carry])
      info["host_syncs"] += 1
      if not bool(np.asarray(p)):
        return env, carry
      if self.max_iterations is not None and info["iterations"] >= self.max_iterations:
        raise max_iterations_error(self.max_iterations)
      env_b, outs = self.body.run_padded(env, [*bconsts, *carry])
      info["iterations"] += 1
      exact = self._out_shapes(env_b.sizes)
      sizes, bad = {}, []
      for li, ax, v, k in self.solve:
        n = exact[li][ax] + k
        if sizes.setdefault(v, n) != n:
          bad.append(f"{v}: {sizes[v]} vs {n} (leaf {li} axis {ax})")
      if bad:
        raise ControlFlowError("body_fun returned a carry whose axes sharing a dimension "
                               "disagree:\n" + format_list(bad))
      buckets = self.bucket(sizes, functools.partial(self._rest, outs, exact))
      env = env.updated(sizes, buckets)
      want = self.shapes(env.sizes)
      if tuple(map(tuple, want)) != tuple(map(tuple, exact)):
        raise ControlFlowError(f"body_fun changed fixed carry axes: expected {want}, got "
                               f"{exact}")
      carry = list(repad(outs, self.shapes(env.buckets)))
      info["buckets"].append(tuple(buckets[v] for v in self.carry_vars))

  def _rest(self, outs, exact):
    """An emptied carry's exact values (the step that emptied it ran on sizes >= 1), for
    HostLoop to go on from eagerly: ``(self, leaves)``; None where a size came out negative."""
    if all(d >= 0 for shape in exact for d in shape):
      return self, list(unpad(outs, exact)[0])
    return None


def _carry_axes(avals, outs, dims, treedef, share: bool = True, force=()
                ) -> tuple[list[tuple], list[str]]:
  """Carry variables from one staged abstract step (or from ``dims``); ``force``: (leaf,
  axis) pairs that are variables though that step kept them."""
  shapes = [tuple(a.shape) for a in avals]
  named = None if dims is None else named_axes(dims, treedef, shapes, keypaths(treedef))
  per, names, _ = carry_vars(shapes, moved_outs(outs, force), named, tie=False, share=share)
  return leaf_dims_of(per, shapes), sorted(names) if named is not None else names


def _shared_apart(leaf_dims, body_out) -> bool:
  """Whether axes sharing a variable get different next sizes in the symbolic body (they
  were one size, and changed alike, only at the init's sizes)."""
  nxt: dict[str, set] = {}
  for ld, o in zip(leaf_dims, body_out, strict=True):
    for d, n in zip(ld, o.shape, strict=True):
      if isinstance(d, str):
        nxt.setdefault(d, set()).add(str(n))
  return any(len(v) > 1 for v in nxt.values())


def _moved(leaf_dims, body_out) -> list[tuple[int, int]]:
  """(leaf, axis) of the axes fixed in the first step that the symbolic body changes."""
  return [(li, ax) for li, (ld, o) in enumerate(zip(leaf_dims, body_out, strict=True))
          for ax, (d, n) in enumerate(zip(ld, o.shape, strict=True))
          if not isinstance(d, str) and (_symbolic.is_symbolic(n) or int(n) != int(d))]


class HostLoop:
  """A standalone ``while_loop`` run in host mode (see the module docstring)."""

  def __init__(self, cond_fun, body_fun, treedef, avals, dims, buckets, reason: str,
               overflow: str = "error", max_iterations: int | None = None):
    self.reason = reason
    self.overflow, self.max_iterations = overflow, max_iterations
    self.mode = "host"
    self.fallback = None
    self.cond_fun, self.body_fun, self.treedef = cond_fun, body_fun, treedef
    self._fixed = None
    self.core = None
    try:
      self._stage(avals, dims, buckets)
    except (StagingError, PaddingUnsupportedError, ControlFlowError) as e:
      self.mode, self.fallback = "host_eager", first_line(e)
    except Exception as e:  # noqa: BLE001 - an unstageable body still runs, eagerly
      self.mode, self.fallback = "host_eager", f"{type(e).__name__}: {first_line(e)}"

  def _stage(self, avals, dims, buckets, share: bool = True, force=()):
    cond_flat, body_flat = flat_fns(self.cond_fun, self.body_fun, self.treedef)
    _, outs = stage(body_flat, avals, export.SymbolicScope(), {}, "while_loop.body")
    leaf_dims, names = _carry_axes(avals, outs, dims, self.treedef, share, force)
    self.leaf_dims, self.carry_vars = leaf_dims, tuple(names)
    scope = export.SymbolicScope()
    syms = export.symbolic_shape(", ".join(names), scope=scope) if names else ()
    it = iter(_symbolic.dim_fn([d for ld in leaf_dims for d in ld], names)(*syms))
    sym_avals = [jax.ShapeDtypeStruct(tuple(next(it) for _ in ld), a.dtype)
                 for ld, a in zip(leaf_dims, avals, strict=True)]
    pols = dict(zip(names, policies(buckets, tuple(names)), strict=True))
    with jp.undecided_equalities() as undecided:  # (``if q.shape[0]:``: see trace_symbolic)
      body, body_out = stage(body_flat, sym_avals, scope, pols, "while_loop.body")
      cond, _ = stage(lambda *xs: [jnp.asarray(cond_flat(*xs))], sym_avals, scope, pols,
                      "while_loop.cond")
    if undecided:
      lhs, rhs, where = undecided[0]
      raise StagingError(f"the loop compares {lhs} == {rhs} at {where}, which the symbolic "
                         "trace cannot decide: it runs eagerly")
    if share and dims is None and _shared_apart(leaf_dims, body_out):
      return self._stage(avals, dims, buckets, share=False)  # each such axis its own var
    moved = _moved(leaf_dims, body_out) if dims is None and not force else []
    if moved:  # fixed in the first step only (r grown by q's length, q empty at the start)
      return self._stage(avals, dims, buckets, share=False, force=moved)
    self.core = _HostIterations(cond, body, body_out, leaf_dims, names, body.policies)
    self.core.overflow, self.core.max_iterations = self.overflow, self.max_iterations
    self.core.paths = keypaths(self.treedef)
    self._fixed = [tuple((ax, int(d)) for ax, d in enumerate(ld) if not isinstance(d, str))
                   for ld in leaf_dims]

  def accepts(self, shapes) -> bool:
    if self._fixed is None:
      return True
    for fixed, shape in zip(self._fixed, shapes, strict=True):
      for ax, n in fixed:
        if shape[ax] != n:
          return False
    return True

  def program_text(self) -> str:
    if self.core is None:
      return f"host loop (eager: {self.fallback})"
    return ("host loop: while cond: body  (carry vars "
            f"{list(self.carry_vars)})\n" + self.core.cond.program_text("padded") + "\n"
            + self.core.body.program_text("padded"))

  def run(self, leaves: list) -> list:
    info = {"mode": self.mode, "iterations": 0, "host_syncs": 0, "buckets": [],
            "fallback": self.fallback or self.reason}
    with collect_stats() as inner:
      if self.core is None:
        outs = self._run_eager(leaves, info)
      else:
        try:
          outs = self._run_staged(leaves, info)
        except EmptiedCarry as e:
          rest = getattr(e, "rest", None)
          info.update(mode="host_eager", fallback=str(e))
          if rest is not None and rest[0] is self.core:  # the rest of the loop, eagerly
            outs = self._run_eager(rest[1], info)
          else:  # at the start, or an inner loop's: the whole loop again (no effects)
            info["iterations"] = 0
            outs = self._run_eager(leaves, info)
    st = VMStats(host_syncs=info["host_syncs"])
    info["host_syncs"] += inner.host_syncs
    info["inner_loops"] = len(inner.loops)
    info["buckets_crossed"] = _crossed(info["buckets"])
    info["compiles"] = inner.compiles
    st.loops.append(info)
    LAST_RUN["loop"] = info
    record(st)
    return outs

  def _run_eager(self, leaves, info) -> list:
    carry = jax.tree_util.tree_unflatten(self.treedef, leaves)
    while True:
      info["host_syncs"] += 1
      if not bool(self.cond_fun(carry)):
        return jax.tree_util.tree_leaves(carry)
      if self.max_iterations is not None and info["iterations"] >= self.max_iterations:
        raise max_iterations_error(self.max_iterations)
      carry = self.body_fun(carry)
      info["iterations"] += 1

  def _run_staged(self, leaves, info) -> list:
    core = self.core
    sizes = {}
    for li, ax, v, k in core.solve:
      sizes.setdefault(v, leaves[li].shape[ax] + k)
    buckets = core.bucket(sizes)
    env = Env(sizes, buckets)
    carry, _ = pad(leaves, core.shapes(buckets))
    info["buckets"].append(tuple(buckets[v] for v in self.carry_vars))
    env, carry = core.iterate(env, 0, [], list(carry), info)
    outs, _ = unpad(carry, core.shapes(env.sizes))
    return list(outs)


# -- a host loop inside a staged program ----------------------------------------------------
class _HostLoopCall(Call):
  """A host loop staged as one control op of an enclosing program (padded values in/out)."""

  name = "host_loop"

  def __init__(self, core: _HostIterations, n_cond: int, n_consts: int, init_text: dict,
               out_avals):
    super().__init__(out_avals)
    self.core = core
    self.n_cond, self.n_consts = n_cond, n_consts
    names = sorted(_symbolic.vars_of_dims(init_text.values()))
    self._init = _symbolic.dim_fn([init_text[v] for v in core.carry_vars], names)
    self._init_names = names

  def run(self, env: Env, *inputs):
    core = self.core
    consts, carry = list(inputs[:self.n_consts]), list(inputs[self.n_consts:])
    sizes = dict(zip(core.carry_vars, (int(x) for x in self._init(
        *[env.sizes[v] for v in self._init_names])), strict=True))
    buckets = core.bucket(sizes)
    env = env.updated(sizes, buckets)
    carry = list(repad(carry, core.shapes(env.buckets)))
    info = {"mode": "host", "iterations": 0, "host_syncs": 0, "buckets": []}
    env, carry = core.iterate(env, self.n_cond, consts, carry, info)
    st = VMStats(host_syncs=info["host_syncs"])
    info["buckets_crossed"] = _crossed(info["buckets"])
    st.loops.append(info)
    LAST_RUN["loop"] = info
    record(st)
    return (env, *carry)


def stage_host_loop(stager: Stager, cond_fun, body_fun, init_val, options: dict):
  """Stages a loop whose body holds a shape-changing control op, inside a program trace."""
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  cond_flat, body_flat = flat_fns(cond_fun, body_fun, treedef)
  _, outs = stage(body_flat, avals, stager.scope, stager.policies, "while_loop.body",
                    stager=stager, hoist_consts=True)
  leaf_dims, sym_avals, users, _ = stager.carry_dims(avals, outs, options["dims"], treedef)
  for u, v in users.items():
    pol = user_policy(options["buckets"], u)
    if pol is not None:
      stager.policies[v] = pol
  carry_vars = tuple(users.values())
  body, body_out = stage(body_flat, sym_avals, stager.scope, stager.policies,
                           "while_loop.body", stager=stager, hoist_consts=True)
  cond, _ = stage(lambda *xs: [jnp.asarray(cond_flat(*xs))], sym_avals, stager.scope,
                    stager.policies, "while_loop.cond", stager=stager, hoist_consts=True)
  core = _HostIterations(cond, body, body_out, leaf_dims, carry_vars, dict(stager.policies))
  core.overflow, core.max_iterations = options["overflow"], options["max_iterations"]
  core.paths = keypaths(treedef)
  init_text = initial_dims(leaf_dims, avals, carry_vars)
  consts = list(cond.hoisted_consts) + list(body.hoisted_consts)
  out_avals = [jp.shaped_array(a.shape, a.dtype) for a in sym_avals]
  call = _HostLoopCall(core, len(cond.hoisted_consts), len(consts), init_text, out_avals)
  outs = stager.bind(call, [jnp.asarray(c) if not is_tracer(c) else c for c in consts]
                     + list(leaves))
  return jax.tree_util.tree_unflatten(treedef, outs)


__all__ = ["HostLoop", "stage_host_loop"]

