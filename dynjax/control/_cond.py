"""``dynjax.cond``: a two-way branch whose branches may return different shapes.

On concrete values it is a three-block VM program: read the predicate (one host sync when it
is a device value, none for a Python bool), ``if``, ``invoke`` the taken branch's executable
(``jax.jit`` of the branch, compiled per operand shapes).  Under a JAX trace it lowers to
``lax.cond`` when both branches agree on structure, shapes and dtypes; otherwise it raises
:class:`~dynjax.control.NeedsProgram` (``dynjax.jit`` then runs the function through the VM).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from dynjax._errors import ControlFlowError
from dynjax.control._frontend import any_tracer, current_stager, needs_vm
from dynjax.runtime import VM, Kernel, ProgramBuilder
from dynjax.runtime._vm import record


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
    return stager.stage_cond(pred, true_fun, false_fun, operands)
  raise needs_vm("cond", "its branches return different shapes (" + "; ".join(diff) + ")")
