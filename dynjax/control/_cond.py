"""``dynjax.cond``: a two-way branch whose branches may return different shapes.

On concrete values it is a three-block VM program: read the predicate (one host sync when it
is a device value, none for a Python bool), ``if``, ``invoke`` the taken branch's executable
(``jax.jit`` of the branch, compiled per operand shapes).  Under a JAX trace it lowers to
``lax.cond`` when both branches agree on structure, shapes and dtypes; otherwise it raises
:class:`~dynjax.control.NeedsProgram`, or -- inside ``dynjax.jit`` -- is staged by its rule here
(``_stage_cond``): each branch traced symbolically and planned by the padding pass, dims that
differ between the branches fresh; at run time the predicate is read (one sync) and the taken
branch's padded executable invoked.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dynjax import _jax_private as jp
from dynjax import _symbolic
from dynjax._errors import ControlFlowError, PaddingUnsupportedError
from dynjax.bucketing._padding import pad_jaxpr
from dynjax.control._carry import (
  DEFAULT_POLICY,
  changing_axes,
  hoist_consts,
  maybe_empty,
  split_offset,
)
from dynjax.control._frontend import any_tracer, building, current_stager, is_tracer, needs_vm
from dynjax.control._stager import (
  Call,
  Env,
  Stager,
  StagingError,
  first_line,
  padded_exe,
  probe_bucket,
  register,
  sizes_vec,
)
from dynjax.runtime import VM, Kernel, ProgramBuilder
from dynjax.runtime._vm import VMStats, record


def _shapes_key(*xs):
  return tuple((tuple(x.shape), str(x.dtype)) for x in xs)


class _CondProgram:
  """The program and kernels of one (true_fun, false_fun, operand structure)."""

  def __init__(self, true_fun, false_fun, treedef):
    self.fns = (true_fun, false_fun)
    self.treedef = treedef
    self.out_trees: dict = {}
    self.kernels = [
        Kernel(f"cond.{name}", lambda key, fn=fn: self._build(fn), lambda key: "exact")
        for name, fn in (("true_fun", true_fun), ("false_fun", false_fun))]
    self.n = treedef.num_leaves

  def _build(self, fn):
    treedef = self.treedef
    jf = jax.jit(lambda *xs: jax.tree_util.tree_leaves(
        fn(*jax.tree_util.tree_unflatten(treedef, xs))))
    return lambda *xs: (jf(*xs),)

  def out_tree(self, taken: int, leaves):
    key = (taken, _shapes_key(*leaves))
    tree = self.out_trees.get(key)
    if tree is None:
      ops = jax.tree_util.tree_unflatten(self.treedef, leaves)
      tree = jax.tree_util.tree_structure(jax.eval_shape(self.fns[taken], *ops))
      self.out_trees[key] = tree
    return tree

  def program(self):
    b = ProgramBuilder("cond", 1 + self.n, ["pred"] + [f"op{i}" for i in range(self.n)])
    pred, ops = b.args[0], b.args[1:]
    key = b.emit_host_op(_shapes_key, ops)
    ph = b.emit_host_op(_read_pred, [pred])
    b.emit_if(ph, "then", "else")
    b.block("then")
    (t,) = b.emit_invoke(self.kernels[0], None, ops, 1, key_reg=key)
    taken_t = b.emit_const(0)
    b.emit_ret([t, taken_t])
    b.block("else")
    (f,) = b.emit_invoke(self.kernels[1], None, ops, 1, key_reg=key)
    taken_f = b.emit_const(1)
    b.emit_ret([f, taken_f])
    return b.finish()


def _read_pred(p):
  return bool(p)


_CACHE: collections.OrderedDict = collections.OrderedDict()


def cond(pred, true_fun: Callable, false_fun: Callable, *operands):
  """Runs ``true_fun(*operands)`` if ``pred`` else ``false_fun(*operands)``; shapes may differ.

  Args:
    pred: a Python bool or a scalar array (read to the host: one sync).
    true_fun: function of ``*operands`` returning a pytree of arrays.
    false_fun: the same; unlike ``lax.cond`` its result may differ in shape and structure.
    *operands: the branch arguments.

  Example:
    >>> x = jnp.arange(4.0)
    >>> dynjax.cond(x.sum() > 3, lambda v: v[:2], lambda v: v, x).shape
    (2,)
  """
  leaves, treedef = jax.tree_util.tree_flatten(operands)
  if any_tracer([pred, *leaves]):
    return _traced_cond(pred, true_fun, false_fun, operands)
  if jnp.shape(pred) != ():
    raise ControlFlowError(f"cond: pred must be a scalar, got shape {jnp.shape(pred)}")
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
  key = (true_fun, false_fun, treedef)
  entry = _CACHE.get(key)
  if entry is None:
    cp = _CondProgram(true_fun, false_fun, treedef)
    entry = _CACHE[key] = (cp, VM(cp.program()))
    if len(_CACHE) > 64:
      _CACHE.popitem(last=False)
  cp, vm = entry
  flat_out, taken = vm.run(pred, *leaves)
  st = vm.take_stats()
  st.host_syncs += int(isinstance(pred, jax.Array))  # the predicate read (host op above)
  record(st)
  return jax.tree_util.tree_unflatten(cp.out_tree(taken, leaves), list(flat_out))


def _traced_cond(pred, true_fun, false_fun, operands):
  t = jax.eval_shape(true_fun, *operands)
  f = jax.eval_shape(false_fun, *operands)
  tl, tt = jax.tree_util.tree_flatten(t)
  fl, ft = jax.tree_util.tree_flatten(f)
  diff = []
  if tt != ft:
    diff.append(f"structure {tt} vs {ft}")
  else:
    for i, (a, b) in enumerate(zip(tl, fl, strict=True)):
      if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        diff.append(f"output leaf {i}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
  if not diff:
    return lax.cond(pred, true_fun, false_fun, *operands)
  stager = current_stager()
  if stager is not None:  # inside dynjax.jit: a cond instruction of the host program
    return stager.stage("cond", pred, true_fun, false_fun, operands)
  raise needs_vm("cond", "its branches return different shapes (" + "; ".join(diff) + ")")


# -- the staging rule: a cond inside dynjax.jit ------------------------------------------------
@register("cond")
def _stage_cond(stager: Stager, pred, true_fun, false_fun, operands):
  """Stages a cond whose branches differ as one ``call cond`` of the host program."""
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
      raise StagingError(f"cond {name} could not be traced: {first_line(e)}") from None
    branches.append(hoist_consts(closed))
  if trees[0] != trees[1]:
    raise StagingError(f"cond branches return different structures: {trees[0]} vs "
                       f"{trees[1]}")
  t_out, f_out = branches[0][0].out_avals, branches[1][0].out_avals
  bad = [f"output leaf {i}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
         for i, (a, b) in enumerate(zip(t_out, f_out, strict=True))
         if a.dtype != b.dtype or len(a.shape) != len(b.shape)]
  if bad:
    raise StagingError("cond branches differ in dtype or rank: " + "; ".join(bad))
  # Axes whose sizes differ between the branches get a fresh dim (decided when it runs).
  per, names = changing_axes([a.shape for a in t_out], [b.shape for b in f_out])
  fresh = stager.fresh_for(names)
  # A dim that may be 0 in either branch (x[:0], or a dim not provably >= 1) is one less than
  # its fresh var (JAX takes dim vars to be >= 1; code after the cond reading an empty output
  # would be traced as if it held an entry).
  empty = {n for a, b, ns in zip(t_out, f_out, per, strict=True)
           for n, da, db in zip(ns, a.shape, b.shape, strict=True)
           if n is not None and (maybe_empty(da) or maybe_empty(db))}
  out_avals = [jp.shaped_array(tuple(
      (fresh[n][1] - int(n in empty)) if n is not None else d
      for n, d in zip(ns, a.shape, strict=True)), a.dtype)
               for a, ns in zip(t_out, per, strict=True)]
  ins, plans = [], []
  for cj, consts in branches:
    slots = [k for k, c in enumerate(consts) if is_tracer(c)]
    ins.extend(consts[k] for k in slots)
    names = sorted(_symbolic.vars_of_dims([d for a in cj.in_avals for d in a.shape])
                   | _symbolic.vars_of_dims([d for a in cj.out_avals for d in a.shape]))
    for v in names:
      stager.policies.setdefault(v, DEFAULT_POLICY)
    try:
      pad_jaxpr(cj, names, probe_bucket(stager.policies, names), monotone=False)
    except PaddingUnsupportedError as e:
      raise StagingError(f"cond branch: {first_line(e)}") from None
    plans.append((cj, [None if is_tracer(c) else c for c in consts], slots, names))
  call = _CondCall(plans, out_avals, {v[0] for v in fresh.values()})
  outs = stager.bind(call, [jnp.asarray(pred)] + ins + list(leaves))
  return jax.tree_util.tree_unflatten(trees[0], outs)


class _CondCall(Call):
  """A staged cond: read the predicate, invoke the taken branch's padded executable."""

  name = "cond"

  def __init__(self, plans, out_avals, fresh: set):
    super().__init__(out_avals)
    self.branches = []
    self.n_in = [len(p[2]) for p in plans]
    for i, (cj, consts, slots, names) in enumerate(plans):
      kernel = Kernel(f"cond.{('true_fun', 'false_fun')[i]}",
                      lambda key, cj=cj, names=names: _plan_exe(cj, names, key),
                      lambda key, names=names: f"bucket={dict(zip(names, key, strict=True))}")
      # fresh var -> (leaf, axis, k) of its first axis (the var is its size plus k), and its
      # size in this branch
      where, dims = {}, []
      for li, (ob, oa) in enumerate(zip(cj.out_avals, out_avals, strict=True)):
        for ax, (d_b, d_o) in enumerate(zip(ob.shape, oa.shape, strict=True)):
          name, k = split_offset(str(d_o))
          if name in fresh and name not in where:
            where[name] = (li, ax, k)
            dims.append(d_b)
      size_of = _symbolic.dim_fn(dims, names)
      self.branches.append((kernel, consts, slots, names, where, size_of))
    self.calls = 0

  def run(self, env: Env, pred, *inputs):
    taken = 0 if bool(np.asarray(pred)) else 1  # the one sync
    record(VMStats(host_syncs=1))
    kernel, consts, slots, names, where, size_of = self.branches[taken]
    off = sum(self.n_in[:taken])
    k = self.n_in[taken]
    consts = list(consts)
    for slot, x in zip(slots, inputs[off:off + k], strict=True):
      consts[slot] = x
    ops = inputs[sum(self.n_in):]
    key = tuple(env.buckets[v] for v in names)
    exe, out_shapes = kernel.get(key)
    true_sizes = tuple(env.sizes[v] for v in names)
    outs = exe(sizes_vec(true_sizes), *consts, *ops)
    sizes = {var: n + where[var][2] for var, n in zip(where, size_of(*true_sizes),
                                                       strict=True)}
    buckets = {var: out_shapes[li][ax] + k for var, (li, ax, k) in where.items()}
    self.calls += 1
    return (env.updated(sizes, buckets), *outs)


def _plan_exe(cj, names, key):
  """(callable, padded output shapes) of a jaxpr for one bucket (a cond branch)."""
  return padded_exe(cj, names, key, "cond_branch")
