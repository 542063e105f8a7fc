"""Host programs with compiled segments: how ``dynjax.jit`` runs a function with control flow.

A function that calls a shape-changing ``dynjax.while_loop`` (or a ``dynjax.cond`` whose
branches disagree) is not one XLA executable.  As the Relay VM does, dynjax compiles it into a
:class:`~dynjax.runtime.Program` whose *straight-line blocks are compiled executables* and whose
control instructions run the loops and conds:

1. **Stage.**  The function is traced once per family with ``jax.make_jaxpr`` over the core's
   symbolic shapes, inside :func:`~dynjax.control._frontend.staging`.  A control op that meets
   tracers and has no XLA form does not raise there: it becomes one opaque ``dynjax_control``
   equation whose outputs have *fresh* symbolic dims for every axis whose size is decided at run
   time (a loop's growing axis, the final length).  Code after the op is traced over those
   fresh dims, so it is symbolic too.  The stager (``_stager.py``) looks the op's rule up in its rule
   table; each op's module registers its rule (``_loop.py``, ``_cond.py``).
2. **Split.**  The jaxpr is cut at the control equations (each equation placed in the earliest
   segment its inputs allow; dead code dropped).  Each segment is a jaxpr over a few dimension
   variables.
3. **Compile per bucket.**  A segment is run through the padding pass (``pad_jaxpr``) for the
   buckets of its variables: ONE executable per (segment, bucket), exact on padded inputs.
   Program inputs are padded on the host with the function's ``buckets`` policies; values
   stay padded on the device between segments and control ops; outputs are unpadded once.
   Fresh dims of a loop take the loop's bucket (its padded carry is used as it is).
4. **Run.**  ``Program``: ``pad`` inputs -> ``invoke seg0[bucket]`` -> ``call while_loop``
   (its hoisted sub-program with padded I/O: syncs = buckets visited) -> ``invoke seg1`` ...
   -> ``unpad`` -> ``ret``.  A ``cond`` reads its predicate (one sync) and invokes the taken
   branch's padded executable.

What cannot be staged (a primitive without a padding rule over a dynamic axis, recursion,
effects, a control op under ``vmap``/an inner ``jit``, Python code that needs a concrete dim)
runs op by op instead (``run_in_program``'s eager path): ``program_runs()`` and
``Wrapped.stats()`` say why.  Compiles: segments x buckets + loop buckets, never per exact
shape.

Host cost of a program run (2-core CPU, jax 0.10; ``tests``-sized function with two segments
around a loop): ~20 us on top of what its executables and the loop cost (entry solve + host
pad ~8, two host ops + one invoke per segment ~2 + dispatch, ``call`` + env update ~2, unpad to
the host ~5).  Op by op, the same function dispatches every primitive (~5-20 us each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from dynjax import _jax_private as jp
from dynjax import _symbolic
from dynjax._errors import PaddingUnsupportedError
from dynjax.bucketing._padding import pad_jaxpr
from dynjax.bucketing._padding_core import sub_jaxprs
from dynjax.control._carry import DEFAULT_POLICY
from dynjax.control._frontend import staging
from dynjax.control._stager import (
  Env,
  Stager,
  StagingError,
  control_p,
  first_line,
  padded_exe,
  probe_bucket,
  sizes_vec,
)
from dynjax.runtime import VM, Kernel, ProgramBuilder
from dynjax.runtime._vm import record


def _shape_fn(avals) -> Callable:
  """``fn(env_dict) -> tuple of shapes`` of avals whose dims are ints or expressions."""
  shapes = [a.shape for a in avals]
  names = sorted(_symbolic.vars_of_dims([d for s in shapes for d in s]))
  fn = _symbolic.shape_fn(shapes, names)
  if not names:
    return lambda env: fn()
  return lambda env: fn(*[env[v] for v in names])


# -- splitting a staged jaxpr ----------------------------------------------------------------
@dataclasses.dataclass
class _Segment:
  index: int
  eqns: list
  in_vars: list
  out_vars: list
  dim_vars: tuple[str, ...]
  kernel: Kernel = None

  def closed(self, template):
    j = template.replace(constvars=[], invars=list(self.in_vars), outvars=list(self.out_vars),
                         eqns=list(self.eqns))
    return jex.ClosedJaxpr(j, [])


def _eqn_dim_vars(eqn) -> set[str]:
  out: set[str] = set()
  for v in (*eqn.invars, *eqn.outvars):
    out |= _symbolic.vars_of_dims(getattr(v.aval, "shape", ()))

  def visit(p):
    nonlocal out
    if isinstance(p, tuple | list):
      for q in p:
        visit(q)
    elif jp.is_dim_expr(p):  # a dim among arbitrary params (not every param is a dim)
      out |= _symbolic.dim_vars_of(p)
    elif isinstance(p, jex.ClosedJaxpr):
      visit_jaxpr(p.jaxpr)
    elif isinstance(p, jex.Jaxpr):
      visit_jaxpr(p)

  def visit_jaxpr(j):
    nonlocal out
    for v in (*j.invars, *j.constvars, *j.outvars):
      out |= _symbolic.vars_of_dims(getattr(getattr(v, "aval", None), "shape", ()))
    for e in j.eqns:
      out |= _eqn_dim_vars(e)

  for p in eqn.params.values():
    visit(p)
  return out


def _has_control(jaxpr) -> bool:
  for e in jaxpr.eqns:
    if e.primitive is control_p:
      return True
    for sub in sub_jaxprs(e.params):
      if _has_control(sub):
        return True
  return False


def split(jaxpr) -> list:
  """Steps ``[_Segment, control eqn, _Segment, ...]`` of a staged jaxpr (dead code dropped)."""
  Var = jex.Var
  live = {v for v in jaxpr.outvars if isinstance(v, Var)}
  # A control op whose values are dead may still make a dim that later code reads
  # (``z.shape[0]`` of a cond's result): it is kept for that dim (it raised KeyError).
  live_dims: set[str] = set()
  for v in jaxpr.outvars:
    live_dims |= _symbolic.vars_of_dims(getattr(v.aval, "shape", ()))
  keep = []
  dims_of: dict[int, set[str]] = {}  # id(eqn) -> its dim vars (walks sub-jaxprs: once each)
  for e in reversed(jaxpr.eqns):
    if any(o in live for o in e.outvars) or (e.primitive is control_p and any(
        _symbolic.vars_of_dims(o.aval.shape) & live_dims for o in e.outvars)):
      keep.append(e)
      live.update(v for v in e.invars if isinstance(v, Var))
      dims_of[id(e)] = _eqn_dim_vars(e)
      live_dims |= dims_of[id(e)]
  keep.reverse()
  level: dict = {}
  dim_level: dict[str, int] = {}  # a fresh dim exists from the control op that makes it
  segs: list[list] = [[]]
  controls = []
  for e in keep:
    lv = max((level.get(v, 0) for v in e.invars if isinstance(v, Var)), default=0)
    lv = max([lv] + [dim_level.get(n, 0) for n in dims_of[id(e)]])
    if e.primitive is control_p:
      controls.append(e)
      segs.append([])
      for o in e.outvars:
        level[o] = len(controls)
        for n in _symbolic.vars_of_dims(o.aval.shape):
          dim_level.setdefault(n, len(controls))
    else:
      segs[lv].append(e)
      for o in e.outvars:
        level[o] = lv
  # uses after each step, to decide segment outputs
  steps = []
  for k, eqns in enumerate(segs):
    steps.append(eqns)
    if k < len(controls):
      steps.append(controls[k])
  out = []
  for si, step in enumerate(steps):
    if not isinstance(step, list):
      out.append(step)
      continue
    if not step:
      continue
    defined = {o for e in step for o in e.outvars}
    ins, seen = [], set()
    for e in step:
      for v in e.invars:
        if isinstance(v, Var) and v not in defined and v not in seen:
          seen.add(v)
          ins.append(v)
    later = set(v for v in jaxpr.outvars if isinstance(v, Var))
    for nxt in steps[si + 1:]:
      for e in (nxt if isinstance(nxt, list) else [nxt]):
        later.update(v for v in e.invars if isinstance(v, Var))
    outs = [o for e in step for o in e.outvars if o in later]
    names: set[str] = set()
    for e in step:
      names |= dims_of[id(e)]
    for v in ins:
      names |= _symbolic.vars_of_dims(v.aval.shape)
    out.append(_Segment(len([s for s in out if isinstance(s, _Segment)]), step, ins, outs,
                        tuple(sorted(names))))
  return out


def _segment_exe(seg: _Segment, template, key):
  return padded_exe(seg.closed(template), seg.dim_vars, key, f"segment{seg.index}")[0]


# -- a staged function as a VM program -------------------------------------------------------
class StagedFunction:
  """A jaxpr with staged control ops, compiled segment by segment, run on the VM.

  Two entries: :meth:`run` (exact arguments: pad on the host, unpad the results; the core's
  path) and :meth:`run_padded` (padded values and an :class:`Env` in and out; a host loop's
  body).  ``program_text()`` prints the program.
  """

  def __init__(self, name: str, closed, policies: dict, in_avals, var_order=(), solve=None,
               hoist_consts: bool = False, dyn_in=None):
    self.name = name
    self.jaxpr = closed.jaxpr
    self.consts = list(closed.consts)
    self.in_avals = list(in_avals)
    if hoist_consts:  # the caller passes the closure's values (padded) as leading inputs
      j = self.jaxpr
      self.jaxpr = j.replace(constvars=[], invars=list(j.constvars) + list(j.invars))
      self.in_avals = [v.aval for v in j.constvars] + self.in_avals
      self.hoisted_consts, self.consts = self.consts, []
    self.policies = dict(policies)
    self.var_order = tuple(var_order)
    self.solve = solve
    if self.jaxpr.effects:
      raise StagingError(f"the function has side effects ({sorted(map(str, self.jaxpr.effects))}"
                         "); they cannot be split into compiled segments")
    for e in self.jaxpr.eqns:
      if e.primitive is not control_p and any(
          _has_control(j) for j in sub_jaxprs(e.params)):
        raise StagingError(f"a dynjax control op runs inside '{e.primitive.name}' (vmap, an "
                           "inner jit, a lax loop): only top-level control ops can be staged")
    self.steps = split(self.jaxpr)
    self.segments = [s for s in self.steps if isinstance(s, _Segment)]
    for seg in self.segments:
      for v in seg.dim_vars:
        self.policies.setdefault(v, DEFAULT_POLICY)
      seg.kernel = Kernel(
          f"segment{seg.index}", lambda key, seg=seg: _segment_exe(seg, self.jaxpr, key),
          lambda key, seg=seg: f"bucket={dict(zip(seg.dim_vars, key, strict=True))}")
    self._in_shapes = _shape_fn(self.in_avals)
    outs = [v.aval for v in self.jaxpr.outvars]
    self._out_shapes = _shape_fn(outs)
    self.dyn_in = tuple(dyn_in) if dyn_in is not None else tuple(
        i for i, a in enumerate(self.in_avals) if any(_symbolic.is_symbolic(d) for d in a.shape))
    self._vms: dict = {}
    self.runs = 0

  def probe(self) -> None:
    """Plans every segment for a probe bucket: padding-pass refusals surface now."""
    for seg in self.segments:
      try:
        pad_jaxpr(seg.closed(self.jaxpr), seg.dim_vars,
                  probe_bucket(self.policies, seg.dim_vars), monotone=False)
      except PaddingUnsupportedError as e:
        raise StagingError(f"segment {seg.index}: {first_line(e)}") from None

  # -- entries ------------------------------------------------------------------------------
  def entry_env(self, *dyn_leaves) -> Env:
    shapes = [None] * len(self.in_avals)
    for i, x in zip(self.dyn_in, dyn_leaves, strict=True):
      shapes[i] = tuple(np.shape(x))
    sizes = dict(zip(self.var_order, self.solve(shapes), strict=True))
    buckets = {}
    for v, n in sizes.items():
      p = self.policies.get(v, DEFAULT_POLICY)
      b = p.bucket(n)
      buckets[v] = p.grow(n) if b is None else b
    return Env(sizes, buckets)

  def in_shapes(self, env: Env):
    shapes = self._in_shapes(env.buckets)
    return tuple(shapes[i] for i in self.dyn_in)

  def out_shapes(self, env: Env, padded: bool = False):
    return self._out_shapes(env.buckets if padded else env.sizes)

  def vm(self, entry: str) -> VM:
    v = self._vms.get(entry)
    if v is None:
      v = self._vms[entry] = VM(self._program(entry))
    return v

  def program_text(self, entry: str = "host") -> str:
    return self.vm(entry).program.as_text()

  def run(self, leaves, to_host: bool = False) -> list:
    vm = self.vm("host" if to_host else "device")
    try:
      outs = vm.run(*leaves)
    finally:
      record(vm.take_stats())
    self.runs += 1
    return list(outs)

  def run_padded(self, env: Env, leaves) -> tuple[Env, list]:
    vm = self.vm("padded")
    try:
      env, *outs = vm.run(env, *leaves)
    finally:
      record(vm.take_stats())
    self.runs += 1
    return env, outs

  def _program(self, entry: str):
    j = self.jaxpr
    n = len(j.invars)
    padded = entry == "padded"
    arg_names = ([] if not padded else ["env"]) + [f"in{i}" for i in range(n)]
    b = ProgramBuilder(self.name, len(arg_names), arg_names)
    reg: dict = {}
    ins = b.args[1:] if padded else b.args
    for v, r in zip(j.invars, ins, strict=True):
      reg[v] = r
    if padded:
      env = b.args[0]
    else:
      env = b.emit_host_op(self.entry_env, [ins[i] for i in self.dyn_in])
      b.name_reg(env, "env")
      if self.dyn_in:
        shp = b.emit_host_op(self.in_shapes, [env])
        b.emit_pad([ins[i] for i in self.dyn_in], shp, dsts=[ins[i] for i in self.dyn_in])
    for v, c in zip(j.constvars, self.consts, strict=True):
      reg[v] = b.emit_const(c)

    def read(v):
      if isinstance(v, jex.Literal):
        return b.emit_const(jnp.asarray(v.val, v.aval.dtype))
      return reg[v]

    for step in self.steps:
      if isinstance(step, _Segment):
        names = step.dim_vars
        key = b.emit_host_op(_key_fn(names), [env])
        sz = b.emit_host_op(_sizes_fn(names), [env])
        outs = b.emit_invoke(step.kernel, None, [sz] + [read(v) for v in step.in_vars],
                             len(step.out_vars), key_reg=key)
        for i, (o, r) in enumerate(zip(step.out_vars, outs, strict=True)):
          reg[o] = r
          b.name_reg(r, f"s{step.index}_{i}")
      else:
        call = step.params["call"]
        outs = b.emit_call(call, [env] + [read(v) for v in step.invars],
                           1 + len(step.outvars))
        b.name_reg(outs[0], "env")
        env = outs[0]
        for o, r in zip(step.outvars, outs[1:], strict=True):
          reg[o] = r
    results = [read(v) for v in j.outvars]
    if padded:
      b.emit_ret([env, *results])
    else:
      shp = b.emit_host_op(self.out_shapes, [env])
      outs = b.emit_unpad(results, shp, to_host=entry == "host")
      b.emit_ret(list(outs))
    return b.finish()


def _key_fn(names):
  def key(env):
    return tuple(env.buckets[v] for v in names)
  key.__name__ = "bucket"
  return key


def _sizes_fn(names):
  def sizes(env):
    return sizes_vec(tuple(env.sizes[v] for v in names))
  sizes.__name__ = "sizes"
  return sizes


def stage(fun_flat: Callable, sym_avals, scope, policies: dict, name: str,
          var_order=(), solve=None, stager: Stager | None = None,
          hoist_consts: bool = False, dyn_in=None) -> tuple[StagedFunction, Any]:
  """Traces ``fun_flat`` with its control ops staged; returns the program and the traced
  output avals.  Raises :class:`StagingError` (or the trace's own error) when it cannot.

  ``stager``: stage into an existing trace's scope (a host loop's body inside a program);
  ``hoist_consts``: the closure's values become leading inputs (they may be tracers of an
  enclosing staging trace).
  """
  stager = Stager(scope, policies) if stager is None else stager
  with staging(stager):
    closed = jax.make_jaxpr(fun_flat)(*sym_avals)
  staged = StagedFunction(name, closed, stager.policies, sym_avals, var_order, solve,
                          hoist_consts, dyn_in)
  staged.probe()
  return staged, closed.out_avals


__all__ = ["Env", "StagedFunction", "Stager", "StagingError", "stage"]
