"""The staging trace: what a control op does when it meets tracers inside ``dynjax.jit``.

While ``_staging.stage`` traces a function (inside :func:`~dynjax.control._frontend.staging`),
a control op that has no XLA form asks the active :class:`Stager` to stage it.  The stager
knows no op itself: like ``jax.core.eval_jaxpr`` with its per-primitive rule dicts, it looks
the op's rule up in :data:`RULES`; the op's own module registers it (``_loop.py`` the
``while_loop`` rule, ``_cond.py`` the ``cond`` rule).  A rule traces what it needs and binds
ONE opaque ``dynjax_control`` equation (:meth:`Stager.bind`) whose ``call`` param is a
:class:`Call`: ``call(env, *padded inputs) -> (env, *padded outputs)`` at run time.  Axes
decided at run time get *fresh* dims ``_dj0, _dj1, ...`` of the program's scope.

Also here: :class:`Env` (true sizes and padded extents of a program's dims) and
:func:`padded_exe` (the padding pass's plan of a jaxpr for one bucket, jitted), which both the
segments and the staged cond run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import export
from jax.extend import core as jex

from dynjax import _symbolic
from dynjax._errors import ControlFlowError
from dynjax.bucketing._padding import pad_jaxpr
from dynjax.bucketing._policies import BucketPolicy
from dynjax.control._carry import (
  DEFAULT_POLICY,
  carry_vars,
  keypaths,
  named_axes,
  offset_text,
)
from dynjax.control._frontend import current_stager
from dynjax.runtime._vm import repad


class StagingError(ControlFlowError):
  """A function (or a control op in it) cannot be staged into a compiled host program."""


def current():
  """The active :class:`Stager` of this thread, or None."""
  return current_stager()


# -- the opaque control-op equation ----------------------------------------------------------
control_p = jex.Primitive("dynjax_control")
control_p.multiple_results = True


def _control_abstract_eval(*args, call):
  del args
  return call.out_avals


def _control_impl(*args, call):
  raise StagingError(f"internal: staged {call.name} ran outside its program")


control_p.def_abstract_eval(_control_abstract_eval)
control_p.def_impl(_control_impl)


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


class Call:
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


# op name -> rule(stager, *args) -> the op's outputs (traced).  Filled by the ops' modules.
RULES: dict[str, Callable] = {}


def register(op: str):
  """Decorator: ``rule(stager, *args)`` stages ``op`` (see the module docstring)."""
  def deco(rule):
    RULES[op] = rule
    return rule
  return deco


_SIZES_CACHE: collections.OrderedDict = collections.OrderedDict()


def sizes_vec(sizes: tuple) -> jax.Array:
  """The int32 sizes vector of a segment, put on the device once per tuple (~1 us a hit)."""
  v = _SIZES_CACHE.get(sizes)
  if v is None:
    v = _SIZES_CACHE[sizes] = jax.device_put(np.asarray(sizes, np.int32).reshape(len(sizes)))
    if len(_SIZES_CACHE) > 4096:
      _SIZES_CACHE.popitem(last=False)
  return v


def probe_bucket(policies: dict, names) -> dict[str, int]:
  """A small bucket of every var: plans made for it surface padding-pass refusals early."""
  out = {}
  for v in names:
    p = policies.get(v, DEFAULT_POLICY)
    b = p.bucket(2)
    out[v] = p.grow(2) if b is None else b
  return out


def first_line(e: BaseException) -> str:
  s = str(e).strip()
  return s.splitlines()[0] if s else type(e).__name__


def padded_exe(cj, names, key, label: str):
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


class Stager:
  """State of one staging trace: the symbolic scope, fresh dims, their bucket policies."""

  def __init__(self, scope, policies: dict[str, BucketPolicy]):
    self.scope = scope
    self.policies = dict(policies)
    self.n_fresh = 0
    self.calls: list[Call] = []

  def stage(self, op: str, *args):
    """Stages ``op`` by its registered rule (see :data:`RULES`)."""
    rule = RULES.get(op)
    if rule is None:
      raise StagingError(f"dynjax.{op} has no staging rule")
    return rule(self, *args)

  def fresh(self, policy: BucketPolicy) -> tuple[str, Any]:
    name = f"_dj{self.n_fresh}"
    self.n_fresh += 1
    (sym,) = export.symbolic_shape(name, scope=self.scope)
    self.policies[name] = policy
    return name, sym

  def fresh_for(self, names) -> dict[str, tuple[str, Any]]:
    """A fresh var (name, symbol) for each of ``names``, in order."""
    return {n: self.fresh(DEFAULT_POLICY) for n in names}

  def bind(self, call: Call, inputs: list) -> list:
    self.calls.append(call)
    return control_p.bind(*inputs, call=call)

  def carry_dims(self, avals, outs, dims, treedef, tie: bool = False):
    """Per carry axis: a fresh var (it changes, or ``dims`` names it), else the program dim.

    Returns ``(leaf_dims, symbolic carry avals, {user name: fresh var}, tied)``; auto dims
    are named ``n0, n1, ...`` in order of appearance, as ``while_loop`` names them.  With
    ``tie``, axes a constant apart that change alike share one var (``_dj0 - 1``), and
    ``tied`` says whether any does; a var whose axes may start empty is one more than their
    size (``_carry.carry_vars``).
    """
    shapes = [tuple(a.shape) for a in avals]
    named = None if dims is None else named_axes(dims, treedef, shapes, keypaths(treedef))
    per, users, tied = carry_vars(shapes, [tuple(o.shape) for o in outs], named, tie=tie)
    fresh = self.fresh_for(users)
    leaf_dims, sym_avals = [], []
    for a, names in zip(avals, per, strict=True):
      leaf_dims.append(tuple(
          offset_text(fresh[n[0]][0], n[1]) if n is not None
          else (str(d) if _symbolic.is_symbolic(d) else int(d))
          for n, d in zip(names, a.shape, strict=True)))
      sym_avals.append(jax.ShapeDtypeStruct(tuple(
          fresh[n[0]][1] - n[1] if n is not None else d
          for n, d in zip(names, a.shape, strict=True)), a.dtype))
    return leaf_dims, sym_avals, {u: fresh[u][0] for u in users}, tied
