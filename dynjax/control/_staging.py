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
   fresh dims, so it is symbolic too.
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

import collections
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.extend import core as jex

from dynjax import _jax_private as jp
from dynjax._errors import ControlFlowError, PaddingUnsupportedError
from dynjax.bucketing._padding import pad_jaxpr
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.control._frontend import NotLowerable, building, current_stager, is_tracer, staging
from dynjax.runtime import VM, Kernel, ProgramBuilder
from dynjax.runtime._vm import VMStats, record, repad

_DEFAULT_POLICY = pow2(min=16)


class StagingError(ControlFlowError):
  """A function (or a control op in it) cannot be staged into a compiled host program."""


def current():
  """The active :class:`Stager` of this thread, or None."""
  return current_stager()


# -- the opaque control-op equation ----------------------------------------------------------
_control_p = jex.Primitive("dynjax_control")
_control_p.multiple_results = True


def _control_abstract_eval(*args, call):
  del args
  return call.out_avals


def _control_impl(*args, call):
  raise StagingError(f"internal: staged {call.name} ran outside its program")


_control_p.def_abstract_eval(_control_abstract_eval)
_control_p.def_impl(_control_impl)


class Env:
  """True sizes and padded extents of a program's dimension variables (host ints)."""

  __slots__ = ("sizes", "buckets")

  def __init__(self, sizes: dict[str, int], buckets: dict[str, int]):
    self.sizes = sizes
    self.buckets = buckets

  def updated(self, sizes: dict, buckets: dict) -> Env:
    s, b = dict(self.sizes), dict(self.buckets)
    s.update(sizes)
    b.update(buckets)
    return Env(s, b)

  def __repr__(self) -> str:
    return f"Env(sizes={self.sizes}, buckets={self.buckets})"


class _Call:
  """One staged control op: ``run(env, *inputs) -> (env, *outputs)`` on padded values."""

  name = "control"

  def __init__(self, out_avals):
    self.out_avals = list(out_avals)
    self.__name__ = self.name

  def __hash__(self):
    return id(self)

  def __eq__(self, other):
    return self is other

  def __repr__(self) -> str:
    return f"<{self.name}>"

  def __call__(self, env, *inputs):
    return self.run(env, *inputs)


def _vars_of_dims(dims) -> set[str]:
  out: set[str] = set()
  for d in dims:
    out |= jp.dim_expr_vars(d)
  return out


def _is_sym(d) -> bool:
  return jp.is_dim_expr(d)


def _shape_fn(avals, var_order: Sequence[str]) -> Callable:
  """``fn(env_dict) -> tuple of shapes`` of avals whose dims are ints or expressions."""
  texts = ["(" + "".join(f"{d}, " for d in a.shape) + ")" for a in avals]
  from dynjax.control._loop import _HOST_NS

  body = ", ".join(texts) + ("," if texts else "")
  names = sorted(set(var_order))
  fn = eval(f"lambda {', '.join(names)}: ({body})", dict(_HOST_NS))  # noqa: S307
  if not names:
    return lambda env: fn()
  return lambda env: fn(*[env[v] for v in names])


_SIZES_CACHE: collections.OrderedDict = collections.OrderedDict()


def _sizes_vec(sizes: tuple) -> jax.Array:
  """The int32 sizes vector of a segment, put on the device once per tuple (~1 us a hit)."""
  v = _SIZES_CACHE.get(sizes)
  if v is None:
    v = _SIZES_CACHE[sizes] = jax.device_put(np.asarray(sizes, np.int32).reshape(len(sizes)))
    if len(_SIZES_CACHE) > 4096:
      _SIZES_CACHE.popitem(last=False)
  return v


def _probe_bucket(policies: dict, names) -> dict[str, int]:
  out = {}
  for v in names:
    p = policies.get(v, _DEFAULT_POLICY)
    b = p.bucket(2)
    out[v] = p.grow(2) if b is None else b
  return out


def _first_line(e: BaseException) -> str:
  s = str(e).strip()
  return s.splitlines()[0] if s else type(e).__name__


# -- the stager: what control ops call when they meet tracers --------------------------------
class Stager:
  """State of one staging trace: the symbolic scope, fresh dims, their bucket policies."""

  def __init__(self, scope, policies: dict[str, BucketPolicy]):
    self.scope = scope
    self.policies = dict(policies)
    self.n_fresh = 0
    self.calls: list[_Call] = []

  def fresh(self, policy: BucketPolicy) -> tuple[str, Any]:
    name = f"_dj{self.n_fresh}"
    self.n_fresh += 1
    (sym,) = export.symbolic_shape(name, scope=self.scope)
    self.policies[name] = policy
    return name, sym

  def bind(self, call: _Call, inputs: list) -> list:
    self.calls.append(call)
    return _control_p.bind(*inputs, call=call)

  # -- while_loop ---------------------------------------------------------------------------
  def stage_while(self, cond_fun, body_fun, init_val, options: dict):
    from dynjax.control import _loop as L

    leaves, treedef = jax.tree_util.tree_flatten(init_val)
    paths = L._keypaths(treedef)
    if options["padding"] == "exact":
      raise StagingError('while_loop(padding="exact") runs per exact shape: not staged')
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    cond_flat, body_flat = L._flat_fns(cond_fun, body_fun, treedef)
    try:
      with building("while_loop body"):
        outs = jax.eval_shape(body_flat, *avals)
    except NotLowerable:
      from dynjax.control._hostloop import stage_host_loop

      return stage_host_loop(self, cond_fun, body_fun, init_val, options)
    except ControlFlowError:
      raise
    except Exception as e:
      raise L._trace_error("body_fun", e) from None
    L._check_structure("body_fun", avals, outs, None, None, paths)
    leaf_dims, sym_avals, fresh = self._carry_dims(avals, outs, options["dims"], treedef)
    buckets = options["buckets"]
    user_of = {v: u for u, v in fresh.items()}
    if isinstance(buckets, Mapping):
      unknown = sorted(set(buckets) - set(fresh))
      if unknown:
        raise ControlFlowError(f"buckets names {unknown}, which are not carry dims "
                               f"{sorted(fresh)}")

    def policy_of(v):
      u = user_of.get(v)
      if u is None:
        return self.policies.get(v, _DEFAULT_POLICY)
      if buckets is None:
        return _DEFAULT_POLICY
      if isinstance(buckets, Mapping):
        return as_policy(buckets[u], f"[{u!r}]") if u in buckets else _DEFAULT_POLICY
      return as_policy(buckets, "")

    for v in user_of:
      self.policies[v] = policy_of(v)
    declared = sorted(set(fresh.values()) | _vars_of_dims(
        [d for a in sym_avals for d in a.shape]))
    spec = L.spec_from_symbolic(cond_fun, body_fun, treedef, paths, sym_avals, leaf_dims,
                                declared, policy_of, options["padding"], options["unroll"],
                                options["bucket_from"], allow_tracer_consts=True)
    for v in spec.var_order:
      self.policies.setdefault(v, policy_of(v))
    try:  # every padding-pass refusal surfaces here, not in the middle of a run
      env = _probe_bucket(self.policies, spec.var_order)
      bk = tuple(env[v] for v in spec.var_order)
      pad_jaxpr(spec.body_cj, spec.var_order, env, L._size_max(spec, bk))
      pad_jaxpr(spec.cond_cj, spec.var_order, env)
    except PaddingUnsupportedError as e:
      raise StagingError(f"while_loop body: {_first_line(e)}") from None
    consts = [*spec.body_consts, *spec.cond_consts]
    slots = [i for i, c in enumerate(consts) if is_tracer(c)]
    out_avals = [jp.shaped_array(a.shape, a.dtype) for a in sym_avals]
    call = _WhileCall(L._Loop(spec), consts, slots, avals, set(fresh.values()), out_avals)
    spec.body_consts = [None if is_tracer(c) else c for c in spec.body_consts]
    spec.cond_consts = [None if is_tracer(c) else c for c in spec.cond_consts]
    outs = self.bind(call, [consts[i] for i in slots] + list(leaves))
    return jax.tree_util.tree_unflatten(treedef, outs)

  def _carry_dims(self, avals, outs, dims, treedef):
    """Per carry axis: a fresh var (it changes, or ``dims`` names it), else the program dim.

    Returns ``(leaf_dims, symbolic carry avals, {user name: fresh var})``; auto dims are
    named ``n0, n1, ...`` in order of appearance, as ``while_loop`` names them.
    """
    named = None
    if dims is not None:
      try:
        specs = treedef.flatten_up_to(dims) if treedef.num_leaves != 1 or not isinstance(
            dims, str | type(None)) else [dims]
      except (ValueError, TypeError) as e:
        raise ControlFlowError(f"dims must match the structure of init ({treedef}): {e}"
                               ) from None
      named = []
      for s, a in zip(specs, avals, strict=True):
        parts = [None] * len(a.shape) if s is None else [x.strip() for x in s.split(",")]
        if len(parts) != len(a.shape):
          raise ControlFlowError(f"dims spec {s!r} has {len(parts)} axes, the carry leaf has "
                                 f"{len(a.shape)}")
        named.append(tuple(p if p and not p.isdigit() else None for p in parts))
    fresh: dict[Any, str] = {}  # user name or (d_in, d_out) -> fresh var
    users: dict[str, str] = {}
    syms: dict[str, Any] = {}
    leaf_dims, sym_avals = [], []
    for li, (a, o) in enumerate(zip(avals, outs, strict=True)):
      per, psym = [], []
      for ax, (d_in, d_out) in enumerate(zip(a.shape, o.shape, strict=True)):
        user = named[li][ax] if named is not None else None
        if _is_sym(d_in) or _is_sym(d_out):
          changes = not d_in == d_out
        else:
          changes = int(d_in) != int(d_out)
        if user is not None or (named is None and changes):
          key = user if user is not None else (d_in, d_out)
          if key not in fresh:
            name, sym = self.fresh(_DEFAULT_POLICY)
            fresh[key] = name
            syms[name] = sym
            users[user if user is not None else f"n{len(users)}"] = name
          per.append(fresh[key])
          psym.append(syms[fresh[key]])
        else:
          per.append(str(d_in) if _is_sym(d_in) else int(d_in))
          psym.append(d_in)
      leaf_dims.append(tuple(per))
      sym_avals.append(jax.ShapeDtypeStruct(tuple(psym), a.dtype))
    return leaf_dims, sym_avals, users

  # -- cond ---------------------------------------------------------------------------------
  def stage_cond(self, pred, true_fun, false_fun, operands):
    if not is_tracer(pred):  # a Python bool: the branch is known while tracing
      return true_fun(*operands) if pred else false_fun(*operands)
    leaves, treedef = jax.tree_util.tree_flatten(operands)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    branches, trees = [], []
    for name, fn in (("true_fun", true_fun), ("false_fun", false_fun)):
      def flat(*xs, fn=fn):
        out = fn(*jax.tree_util.tree_unflatten(treedef, xs))
        out_leaves, tree = jax.tree_util.tree_flatten(out)
        trees.append(tree)
        return out_leaves
      try:
        with building(f"cond {name}"):
          closed = jax.make_jaxpr(flat)(*avals)
      except ControlFlowError:
        raise
      except Exception as e:
        raise StagingError(f"cond {name} could not be traced: {_first_line(e)}") from None
      j = closed.jaxpr
      cj = jex.ClosedJaxpr(j.replace(constvars=[], invars=list(j.constvars) + list(j.invars)),
                           [])
      branches.append((cj, list(closed.consts)))
    if trees[0] != trees[1]:
      raise StagingError(f"cond branches return different structures: {trees[0]} vs "
                         f"{trees[1]}")
    t_out, f_out = branches[0][0].out_avals, branches[1][0].out_avals
    fresh: dict[Any, tuple[str, Any]] = {}
    out_avals, bad = [], []
    for i, (a, b) in enumerate(zip(t_out, f_out, strict=True)):
      if a.dtype != b.dtype or len(a.shape) != len(b.shape):
        bad.append(f"output leaf {i}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        continue
      dims = []
      for da, db in zip(a.shape, b.shape, strict=True):
        same = (da == db) if (_is_sym(da) or _is_sym(db)) else int(da) == int(db)
        if same:
          dims.append(da)
        else:
          if (da, db) not in fresh:
            fresh[(da, db)] = self.fresh(_DEFAULT_POLICY)
          dims.append(fresh[(da, db)][1])
      out_avals.append(jp.shaped_array(tuple(dims), a.dtype))
    if bad:
      raise StagingError("cond branches differ in dtype or rank: " + "; ".join(bad))
    ins, plans = [], []
    for cj, consts in branches:
      slots = [k for k, c in enumerate(consts) if is_tracer(c)]
      ins.extend(consts[k] for k in slots)
      names = sorted(_vars_of_dims([d for a in cj.in_avals for d in a.shape])
                     | _vars_of_dims([d for a in cj.out_avals for d in a.shape]))
      for v in names:
        self.policies.setdefault(v, _DEFAULT_POLICY)
      try:
        pad_jaxpr(cj, names, _probe_bucket(self.policies, names), monotone=False)
      except PaddingUnsupportedError as e:
        raise StagingError(f"cond branch: {_first_line(e)}") from None
      plans.append((cj, [None if is_tracer(c) else c for c in consts], slots, names))
    call = _CondCall(plans, out_avals, {k: v[0] for k, v in fresh.items()})
    outs = self.bind(call, [jnp.asarray(pred)] + ins + list(leaves))
    return jax.tree_util.tree_unflatten(trees[0], outs)


class _WhileCall(_Call):
  """A staged hoisted loop: padded carry in, padded carry out (``_Loop.run_padded``)."""

  name = "while_loop"

  def __init__(self, loop, consts, slots, init_avals, fresh: set, out_avals):
    super().__init__(out_avals)
    from dynjax.control._loop import _HOST_NS, _compile_exprs

    spec = loop.spec
    self.loop = loop
    self.consts = [None if is_tracer(c) else c for c in consts]
    self.slots = slots
    self.fresh = fresh
    self.var_order = spec.var_order
    # Initial value of each loop variable: a fresh var starts at the program dim of the axis
    # where it first appears; a program var is itself.
    init_text: dict[str, str] = {}
    for ld, a in zip(spec.leaf_dims, init_avals, strict=True):
      for d, d0 in zip(ld, a.shape, strict=True):
        if isinstance(d, str) and d in fresh and d not in init_text:
          init_text[d] = str(d0)
    self.prog_vars = tuple(sorted((set(spec.var_order) - fresh)
                                  | {n for t in init_text.values() for n in _names(t)}))
    exprs = [init_text.get(v, v) for v in spec.var_order]
    self._init = _compile_exprs(exprs, self.prog_vars, _HOST_NS)
    self._given = [None if v in fresh else v for v in spec.var_order]
    self._fresh_idx = [(i, v) for i, v in enumerate(spec.var_order) if v in fresh]

  def run(self, env: Env, *inputs):
    k = len(self.slots)
    consts = list(self.consts)
    for slot, x in zip(self.slots, inputs[:k], strict=True):
      consts[slot] = x
    sizes = tuple(int(x) for x in self._init(*[env.sizes[v] for v in self.prog_vars]))
    given = tuple(None if v is None else env.buckets[v] for v in self._given)
    outs, fsizes, fbk = self.loop.run_padded(consts, list(inputs[k:]), sizes, given)
    env = env.updated({v: fsizes[i] for i, v in self._fresh_idx},
                      {v: fbk[i] for i, v in self._fresh_idx})
    return (env, *outs)


def _names(text: str) -> set[str]:
  return set(re.findall(r"[A-Za-z_]\w*", text)) - {"floordiv", "mod", "max", "min",
                                                     "non_negative"}


class _CondCall(_Call):
  """A staged cond: read the predicate, invoke the taken branch's padded executable."""

  name = "cond"

  def __init__(self, plans, out_avals, fresh: dict):
    super().__init__(out_avals)
    self.branches = []
    self.n_in = [len(p[2]) for p in plans]
    for i, (cj, consts, slots, names) in enumerate(plans):
      kernel = Kernel(f"cond.{('true_fun', 'false_fun')[i]}",
                      lambda key, cj=cj, names=names: _plan_exe(cj, names, key),
                      lambda key, names=names: f"bucket={dict(zip(names, key, strict=True))}")
      # fresh var -> (leaf, axis, its dim expression in this branch)
      where = {}
      for li, (ob, oa) in enumerate(zip(cj.out_avals, out_avals, strict=True)):
        for ax, (d_b, d_o) in enumerate(zip(ob.shape, oa.shape, strict=True)):
          name = str(d_o)
          if name in set(fresh.values()) and name not in where:
            where[name] = (li, ax, d_b)
      self.branches.append((kernel, consts, slots, names, where))
    self.calls = 0

  def run(self, env: Env, pred, *inputs):
    taken = 0 if bool(np.asarray(pred)) else 1  # the one sync
    record(VMStats(host_syncs=1))
    kernel, consts, slots, names, where = self.branches[taken]
    off = sum(self.n_in[:taken])
    k = self.n_in[taken]
    consts = list(consts)
    for slot, x in zip(slots, inputs[off:off + k], strict=True):
      consts[slot] = x
    ops = inputs[sum(self.n_in):]
    key = tuple(env.buckets[v] for v in names)
    exe, out_shapes = kernel.get(key)
    outs = exe(_sizes_vec(tuple(env.sizes[v] for v in names)), *consts, *ops)
    sizes, buckets = {}, {}
    for var, (li, ax, d) in where.items():
      sizes[var] = int(jp.eval_dim_expr(d, env.sizes))
      buckets[var] = out_shapes[li][ax]
    self.calls += 1
    return (env.updated(sizes, buckets), *outs)


def _plan_exe(cj, names, key):
  """(callable, padded output shapes) of a jaxpr for one bucket (a cond branch)."""
  return _padded_exe(cj, names, key, "cond_branch")


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
    out |= _vars_of_dims(getattr(v.aval, "shape", ()))

  def visit(p):
    nonlocal out
    if isinstance(p, tuple | list):
      for q in p:
        visit(q)
    elif jp.is_dim_expr(p):
      out |= jp.dim_expr_vars(p)
    elif isinstance(p, jex.ClosedJaxpr):
      visit_jaxpr(p.jaxpr)
    elif isinstance(p, jex.Jaxpr):
      visit_jaxpr(p)

  def visit_jaxpr(j):
    nonlocal out
    for v in (*j.invars, *j.constvars, *j.outvars):
      out |= _vars_of_dims(getattr(getattr(v, "aval", None), "shape", ()))
    for e in j.eqns:
      out |= _eqn_dim_vars(e)

  for p in eqn.params.values():
    visit(p)
  return out


def _sub_jaxprs(params) -> list:
  out = []
  for v in params.values():
    for item in v if isinstance(v, tuple | list) else (v,):
      if isinstance(item, jex.ClosedJaxpr):
        out.append(item.jaxpr)
      elif isinstance(item, jex.Jaxpr):
        out.append(item)
  return out


def _has_control(jaxpr) -> bool:
  for e in jaxpr.eqns:
    if e.primitive is _control_p:
      return True
    for sub in _sub_jaxprs(e.params):
      if _has_control(sub):
        return True
  return False


def split(jaxpr) -> list:
  """Steps ``[_Segment, control eqn, _Segment, ...]`` of a staged jaxpr (dead code dropped)."""
  Var = jex.Var
  live = {v for v in jaxpr.outvars if isinstance(v, Var)}
  keep = []
  for e in reversed(jaxpr.eqns):
    if any(o in live for o in e.outvars):
      keep.append(e)
      live.update(v for v in e.invars if isinstance(v, Var))
  keep.reverse()
  level: dict = {}
  dim_level: dict[str, int] = {}  # a fresh dim exists from the control op that makes it
  segs: list[list] = [[]]
  controls = []
  for e in keep:
    lv = max((level.get(v, 0) for v in e.invars if isinstance(v, Var)), default=0)
    lv = max([lv] + [dim_level.get(n, 0) for n in _eqn_dim_vars(e)])
    if e.primitive is _control_p:
      controls.append(e)
      segs.append([])
      for o in e.outvars:
        level[o] = len(controls)
        for n in _vars_of_dims(o.aval.shape):
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
      names |= _eqn_dim_vars(e)
    for v in ins:
      names |= _vars_of_dims(v.aval.shape)
    out.append(_Segment(len([s for s in out if isinstance(s, _Segment)]), step, ins, outs,
                        tuple(sorted(names))))
  return out


def _segment_exe(seg: _Segment, template, key):
  return _padded_exe(seg.closed(template), seg.dim_vars, key, f"segment{seg.index}")[0]


def _padded_exe(cj, names, key, label: str):
  """The padding pass's plan of ``cj`` for one bucket, jitted: ``(call, out_shapes)``.

  ``call(sizes, *args)``: ``sizes`` the int32 true sizes of ``names``; an argument in a bigger
  buffer than the plan's (a loop's own bucket, a compound dim) is repadded first (one cached
  executable per shape pair).  ~0.3 us a leaf when every shape already matches.
  """
  plan = pad_jaxpr(cj, names, dict(zip(names, key, strict=True)), monotone=False)
  n = len(names)

  def fn(sizes, *args):
    return tuple(plan.fun(tuple(sizes[i] for i in range(n)), *args))

  fn.__name__ = label
  exe = jax.jit(fn)
  want = [tuple(s) for s in plan.in_shapes]

  def call(sizes, *args):
    for a, w in zip(args, want, strict=True):
      if a.shape != w:
        args = repad(args, want)
        break
    return exe(sizes, *args)

  return call, [tuple(s) for s in plan.out_shapes]


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
      if e.primitive is not _control_p and any(
          _has_control(j) for j in _sub_jaxprs(e.params)):
        raise StagingError(f"a dynjax control op runs inside '{e.primitive.name}' (vmap, an "
                           "inner jit, a lax loop): only top-level control ops can be staged")
    self.steps = split(self.jaxpr)
    self.segments = [s for s in self.steps if isinstance(s, _Segment)]
    for seg in self.segments:
      for v in seg.dim_vars:
        self.policies.setdefault(v, _DEFAULT_POLICY)
      seg.kernel = Kernel(
          f"segment{seg.index}", lambda key, seg=seg: _segment_exe(seg, self.jaxpr, key),
          lambda key, seg=seg: f"bucket={dict(zip(seg.dim_vars, key, strict=True))}")
    self._in_shapes = _shape_fn(self.in_avals, _vars_of_dims(
        [d for a in self.in_avals for d in a.shape]))
    outs = [v.aval for v in self.jaxpr.outvars]
    self._out_shapes = _shape_fn(outs, _vars_of_dims([d for a in outs for d in a.shape]))
    self.dyn_in = tuple(dyn_in) if dyn_in is not None else tuple(
        i for i, a in enumerate(self.in_avals) if any(_is_sym(d) for d in a.shape))
    self._vms: dict = {}
    self.runs = 0

  def probe(self) -> None:
    """Plans every segment for a probe bucket: padding-pass refusals surface now."""
    for seg in self.segments:
      try:
        pad_jaxpr(seg.closed(self.jaxpr), seg.dim_vars,
                  _probe_bucket(self.policies, seg.dim_vars), monotone=False)
      except PaddingUnsupportedError as e:
        raise StagingError(f"segment {seg.index}: {_first_line(e)}") from None

  # -- entries ------------------------------------------------------------------------------
  def entry_env(self, *dyn_leaves) -> Env:
    shapes = [None] * len(self.in_avals)
    for i, x in zip(self.dyn_in, dyn_leaves, strict=True):
      shapes[i] = tuple(np.shape(x))
    sizes = dict(zip(self.var_order, self.solve(shapes), strict=True))
    buckets = {}
    for v, n in sizes.items():
      p = self.policies.get(v, _DEFAULT_POLICY)
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
    return _sizes_vec(tuple(env.sizes[v] for v in names))
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
