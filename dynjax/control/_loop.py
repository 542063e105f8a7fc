"""``dynjax.while_loop``: loops whose carry changes shape, hoisted into one XLA loop per bucket.

Where each part lives:

* ``_carry.py``: the carry's paths, structure checks, and which axes change (shared names).
* ``_loopspec.py``: the spec (body and cond traced over symbolic carries, next-size functions,
  the cap read from the cond) and the hoisted executable of one bucket.
* ``_loopprog.py``: :class:`~dynjax.control._loopprog.Loop` and its VM programs (hoisted,
  exact, padded I/O).
* ``_hostloop.py``: loops whose body runs a shape-changing loop itself (host iterations).
* here: the front end (``while_loop``, the cache of built loops, ``loop_stats``,
  ``loop_program``) and the loop's staging rule (a loop inside ``dynjax.jit``: one ``call``
  of the host program, padded values in and out).

Run: pick the bucket, pad on the host, then ``invoke hoisted[bucket]; read status; if pred:
repad to the next bucket, goto loop``: host syncs = buckets crossed + 1.  When the padding pass
cannot make the body exact (or ``padding="exact"``), the loop runs in exact mode: one
executable per exact shape, one host sync per iteration.  ``loop_stats()["mode"]`` says which
ran and why.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dynjax import _jax_private as jp
from dynjax import _symbolic
from dynjax._errors import ControlFlowError, PaddingUnsupportedError
from dynjax.bucketing._policies import BucketPolicy
from dynjax.control._carry import (
  DEFAULT_POLICY,
  LAST_RUN,
  check_structure,
  eval_shape_body,
  flat_fns,
  initial_dims,
  keypaths,
  same_dtype,
  user_policy,
)
from dynjax.control._frontend import NotLowerable, any_tracer, is_tracer, needs_vm
from dynjax.control._hostloop import HostLoop, stage_host_loop
from dynjax.control._loopprog import Loop
from dynjax.control._loopspec import (
  build_spec,
  pad_jaxpr,
  size_max,
  spec_from_symbolic,
)
from dynjax.control._stager import (
  Call,
  Env,
  Stager,
  StagingError,
  current,
  first_line,
  probe_bucket,
  register,
)

_BUCKET_FROM = ("auto", "cap", "init")
_OVERFLOW = ("error", "exact", "grow")  # as dynjax.jit's overflow=


# -- cache of built loops --------------------------------------------------------------------
# (cond, body, structure, dtypes and ranks, options) -> the loops built for it.  A loop serves
# every init whose static axes and shared dims fit it (Loop.accepts), so a new prompt length
# reuses the compiled buckets instead of tracing and compiling again.
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_MAX = 64
_PER_KEY = 8


def get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll=1,
             bucket_from="init", overflow="error", max_iterations=None):
  """The built loop for these arguments (cached; one serves every init its dims fit)."""
  dkey = None if dims is None else repr(dims)
  bkey = repr(buckets)
  key = (cond_fun, body_fun, treedef, tuple((len(a.shape), str(a.dtype)) for a in avals),
         dkey, bkey, padding, unroll, bucket_from, overflow, max_iterations)
  shapes = [tuple(a.shape) for a in avals]
  loops = _CACHE.get(key)
  if loops is None:
    loops = _CACHE[key] = []
    if len(_CACHE) > _CACHE_MAX:
      _CACHE.popitem(last=False)
  else:
    _CACHE.move_to_end(key)
    for loop in loops:
      if loop.accepts(shapes):
        return loop
  try:
    spec = build_spec(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
                      bucket_from, overflow, max_iterations)
  except NotLowerable as e:
    loop = HostLoop(cond_fun, body_fun, treedef, avals, dims, buckets, str(e), overflow,
                    max_iterations)
  else:
    loop = Loop(spec)
  loops.append(loop)
  del loops[:-_PER_KEY]
  return loop


def _check_options(padding, unroll, bucket_from, overflow="error", max_iterations=None):
  if padding not in ("auto", "exact"):
    raise ControlFlowError(f'padding must be "auto" or "exact", got {padding!r}')
  if unroll is not None and (not isinstance(unroll, int | np.integer) or isinstance(unroll, bool)
                             or unroll < 1):
    raise ControlFlowError(f"unroll must be None (auto) or an int >= 1, got {unroll!r}")
  if bucket_from not in _BUCKET_FROM:
    raise ControlFlowError(f"bucket_from must be one of {list(_BUCKET_FROM)}, got "
                           f"{bucket_from!r}")
  if overflow not in _OVERFLOW:
    raise ControlFlowError(f"overflow must be one of {list(_OVERFLOW)}, got {overflow!r}")
  if max_iterations is not None and (not isinstance(max_iterations, int | np.integer)
                                     or isinstance(max_iterations, bool) or max_iterations < 0):
    raise ControlFlowError(f"max_iterations must be None or an int >= 0, got "
                           f"{max_iterations!r}")


def default_unroll() -> int:
  """``unroll=None``: 1 on CPU (a trip costs ~1 us there), 4 on GPU/TPU (a trip of an XLA GPU
  while loop copies its predicate to the host and waits for it)."""
  return 1 if jax.default_backend() == "cpu" else 4


def while_loop(cond_fun: Callable, body_fun: Callable, init_val, *, dims=None,
               buckets: BucketPolicy | Mapping[str, Any] | list | None = None,
               padding: str = "auto", unroll: int | None = None, bucket_from: str = "auto",
               overflow: str = "error", max_iterations: int | None = None):
  """``lax.while_loop`` whose carry may change shape from one iteration to the next.

  While the carry stays inside its bucket, iterations run inside ONE compiled
  ``lax.while_loop`` on the padded carry; the host syncs once per bucket visited (see the module
  docstring).  ``cond_fun`` may depend on device values.

  Args:
    cond_fun: ``carry -> bool scalar``.
    body_fun: ``carry -> carry``; leaves keep dtype and rank, sizes may change along axes as
      expressions of the carry's sizes (``t -> t + 1``).
    init_val: the initial carry (a pytree of arrays).
    dims: ``None`` (axes that change are found automatically; axes that change by the same
      constant and sit a constant apart, a KV cache ``t - 1`` beside tokens ``t``, share one
      dim) or a pytree like ``init_val`` of spec strings (``"b, t"``, ``"b, t - 1, h, d"``)
      / ``None`` naming the dynamic axes.
    buckets: one policy for every dim, or ``{name: policy}`` (default ``pow2(min=16)``).
    padding: ``"auto"`` (hoisted, exact through the padding pass; exact mode when it cannot)
      or ``"exact"`` (one executable per exact shape, one host sync per iteration).
    unroll: guarded body steps per XLA loop trip (``None``: 1 on CPU, 4 on GPU/TPU).
    bucket_from: ``"cap"`` (start in the bucket of the final sizes that ``cond_fun`` bounds,
      e.g. ``step < max_new``: no bucket crossing, one sync to read the counter), ``"init"``
      (start in the bucket of the initial sizes and grow), ``"auto"`` (``"cap"`` on GPU/TPU,
      where a bigger bucket costs little per step; ``"init"`` on CPU).
    overflow: a carry dim past its policy's max (``buckets=pow2(16, 256)`` and a carry that
      reaches 257), as ``dynjax.jit``'s ``overflow=``: ``"error"`` (raise
      :class:`dynjax.OutOfBucketsError` naming the carry path, the size and the max),
      ``"exact"`` (the iterations past the max run unpadded, one compile per exact shape and
      one host sync per iteration; not inside ``dynjax.jit``, where such a loop makes the
      function run op by op), ``"grow"`` (compile buckets past the max by the policy's rule).
      Loops run in host mode (a shape-changing loop in the body) treat ``"exact"`` as
      ``"grow"``.
    max_iterations: ``None`` (no limit) or the most body runs allowed: when ``cond_fun`` is
      still true after that many, :class:`dynjax.ControlFlowError` is raised (a guard against
      loops that never stop).  Not enforced where the loop lowers to ``lax.while_loop`` (a
      carry of fixed shapes under ``jax.jit``).

  Returns:
    The final carry, exact shapes.

  Example:
    >>> out = dynjax.while_loop(lambda c: c[-1] < 5,
    ...                         lambda c: jnp.concatenate([c, c[-1:] + 1]), jnp.zeros(1))
    >>> out
    Array([0., 1., 2., 3., 4., 5.], dtype=float32)
    >>> long = dynjax.while_loop(lambda c: c.sum() < 1e9, lambda c: jnp.concatenate([c, c]),
    ...                          jnp.ones(1), buckets=dynjax.buckets.pow2(16, 64))
    Traceback (most recent call last):
    ...
    dynjax.OutOfBucketsError: while_loop: a carry dimension grows over the largest bucket: ...
  """
  _check_options(padding, unroll, bucket_from, overflow, max_iterations)
  unroll = default_unroll() if unroll is None else int(unroll)
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  if any_tracer(leaves):
    return _traced_while(cond_fun, body_fun, init_val, leaves, treedef,
                         dict(dims=dims, buckets=buckets, padding=padding, unroll=unroll,
                              bucket_from=bucket_from, overflow=overflow,
                              max_iterations=max_iterations))
  # device_put, not jnp.asarray: the latter compiles a tiny executable per shape (jax 0.10)
  leaves = [x if isinstance(x, jax.Array) else jax.device_put(x) for x in leaves]
  weak_out = None
  if any(getattr(x, "weak_type", False) for x in leaves):  # Python scalars in the carry
    leaves, weak_out = _weak_carry(body_fun, treedef, leaves)
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  loop = get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
                  bucket_from, overflow, max_iterations)
  outs = loop.run(leaves)
  if weak_out:
    outs = [jp.as_weak(o) if w and not getattr(o, "weak_type", True) else o
            for o, w in zip(outs, weak_out, strict=True)]
  return jax.tree_util.tree_unflatten(treedef, outs)


_WEAK: collections.OrderedDict = collections.OrderedDict()


def _weak_carry(body_fun, treedef, leaves):
  """Weakly typed carry leaves (Python scalars) as ``lax.while_loop`` types them.

  A weak leaf whose body result has another dtype (``0`` plus an ``int8``) starts as that
  dtype; a leaf is weak at the end when it was weak at the start and the body keeps it weak
  (``i + 1``).  The loop itself runs on strong types (its executables, the padding pass);
  the results get their weak types back (before, a hoisted loop returned them strong, its
  exact mode weak: ``s * x_f32`` of a carry ``s = 1.0`` gave float64 under x64).  Returns
  ``(leaves, per leaf whether the result is weak)``; cached per body and the carry's ranks,
  dtypes and weak types (one abstract trace of the body, as ``get_loop``'s cache).
  """
  weak_in = [getattr(x, "weak_type", False) for x in leaves]  # a key array has none
  key = (body_fun, treedef, tuple((x.ndim, str(x.dtype), w) for x, w in zip(leaves, weak_in,
                                                                            strict=True)))
  plan = _WEAK.get(key)
  if plan is None:
    _, body_flat = flat_fns(None, body_fun, treedef)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=w)
             for x, w in zip(leaves, weak_in, strict=True)]
    outs = eval_shape_body(body_flat, avals)
    if len(outs) != len(avals):
      raise ControlFlowError(f"body_fun must return a carry with the structure of init: "
                             f"{len(avals)} leaves in, {len(outs)} out")
    promote = [jnp.result_type(x, o.dtype) if a.weak_type and same_rank_other_dtype(a, o)
               else None for x, a, o in zip(leaves, avals, outs, strict=True)]
    if any(p is not None for p in promote):
      avals = [a if p is None else jax.ShapeDtypeStruct(a.shape, p)
               for a, p in zip(avals, promote, strict=True)]
      outs = eval_shape_body(body_flat, avals)
    weak = [bool(a.weak_type and getattr(o, "weak_type", False))
            for a, o in zip(avals, outs, strict=True)]
    plan = _WEAK[key] = (promote, weak)
    if len(_WEAK) > _CACHE_MAX:
      _WEAK.popitem(last=False)
  promote, weak = plan
  leaves = [x if p is None else jax.device_put(np.asarray(x, p))
            for x, p in zip(leaves, promote, strict=True)]
  return leaves, weak


def same_rank_other_dtype(a, o) -> bool:
  return len(a.shape) == len(o.shape) and not same_dtype(a.dtype, o.dtype)


def _traced_while(cond_fun, body_fun, init_val, leaves, treedef, options):
  stager = current()
  try:
    out = eval_shape_body(body_fun, (init_val,))  # NotLowerable passes through unchanged
  except NotLowerable as e:
    if stager is not None:  # a shape-changing loop inside the body: the program runs it
      return stager.stage("while_loop", cond_fun, body_fun, init_val, options)
    raise needs_vm("while_loop", f"its body runs a loop that changes shapes ({e})") from None
  out_leaves, out_tree = jax.tree_util.tree_flatten(out)
  changed = []
  if out_tree == treedef:
    for p, a, o in zip(keypaths(treedef), leaves, out_leaves, strict=True):
      if tuple(a.shape) != tuple(o.shape) or not same_dtype(a.dtype, o.dtype):
        changed.append(f"{p}: {tuple(a.shape)} -> {tuple(o.shape)}")
  else:
    changed.append(f"structure {treedef} -> {out_tree}")
  if not changed:
    return lax.while_loop(cond_fun, body_fun, init_val)  # shape-invariant: plain XLA loop
  if stager is not None:
    return stager.stage("while_loop", cond_fun, body_fun, init_val, options)
  raise needs_vm("while_loop", "its carry changes shape (" + "; ".join(changed) + ")")


def loop_stats() -> dict:
  """What the last ``while_loop`` of this thread did: mode, iterations, host syncs, buckets.

  Example:
    >>> _ = dynjax.while_loop(lambda c: jnp.asarray(c.shape[0]) < 40,
    ...                       lambda c: jnp.concatenate([c, c[:1]]), jnp.zeros(1))
    >>> dynjax.control.loop_stats()["host_syncs"]
    3
  """
  return dict(LAST_RUN.get("loop", {}))


def loop_program(cond_fun, body_fun, init_val, *, dims=None, buckets=None,
                 padding: str = "auto", unroll: int | None = None,
                 bucket_from: str = "auto", overflow: str = "error",
                 max_iterations: int | None = None) -> str:
  """The VM program ``while_loop`` runs for these arguments, as text (builds, runs nothing)."""
  _check_options(padding, unroll, bucket_from, overflow, max_iterations)
  unroll = default_unroll() if unroll is None else int(unroll)
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
  loop = get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding, unroll,
                  bucket_from, overflow, max_iterations)
  return loop.program_text() if hasattr(loop, "program_text") else loop.vm(
      loop.mode).program.as_text()



# -- the staging rule: a loop inside dynjax.jit ------------------------------------------------
@register("while_loop")
def _stage_while(stager: Stager, cond_fun, body_fun, init_val, options: dict):
  """Stages a shape-changing loop as one ``call while_loop`` of the host program."""
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  paths = keypaths(treedef)
  if options["padding"] == "exact":
    raise StagingError('while_loop(padding="exact") runs per exact shape: not staged')
  if options["overflow"] == "exact":
    raise StagingError('while_loop(overflow="exact") may run per exact shape: not staged')
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  cond_flat, body_flat = flat_fns(cond_fun, body_fun, treedef)
  try:
    outs = eval_shape_body(body_flat, avals)
  except NotLowerable:  # a shape-changing op inside the body: host iterations
    return stage_host_loop(stager, cond_fun, body_fun, init_val, options)
  check_structure("body_fun", avals, outs, None, None, paths)
  try:
    spec, sym_avals, fresh, policy_of = _staged_spec(stager, cond_fun, body_fun, treedef,
                                                     paths, avals, outs, options, tie=True)
  except _Untie:  # axes a constant apart that do not stay so: each its own var
    spec, sym_avals, fresh, policy_of = _staged_spec(stager, cond_fun, body_fun, treedef,
                                                     paths, avals, outs, options, tie=False)
  for v in spec.var_order:
    stager.policies.setdefault(v, policy_of(v))
  try:  # every padding-pass refusal surfaces here, not in the middle of a run
    env = probe_bucket(stager.policies, spec.var_order)
    bk = tuple(env[v] for v in spec.var_order)
    pad_jaxpr(spec.body_cj, spec.var_order, env, size_max(spec, bk))
    pad_jaxpr(spec.cond_cj, spec.var_order, env)
  except PaddingUnsupportedError as e:
    raise StagingError(f"while_loop body: {first_line(e)}") from None
  consts = [*spec.body_consts, *spec.cond_consts]
  slots = [i for i, c in enumerate(consts) if is_tracer(c)]
  out_avals = [jp.shaped_array(a.shape, a.dtype) for a in sym_avals]
  call = _WhileCall(Loop(spec), consts, slots, avals, set(fresh.values()), out_avals)
  spec.body_consts = [None if is_tracer(c) else c for c in spec.body_consts]
  spec.cond_consts = [None if is_tracer(c) else c for c in spec.cond_consts]
  outs = stager.bind(call, [consts[i] for i in slots] + list(leaves))
  return jax.tree_util.tree_unflatten(treedef, outs)


class _Untie(Exception):
  """The tied carry dims of a staged loop did not stay tied (:func:`_staged_spec`)."""


def _staged_spec(stager, cond_fun, body_fun, treedef, paths, avals, outs, options, tie):
  """The spec of a staged loop: ``(spec, symbolic carry avals, {user name: fresh var},
  policy_of)``."""
  leaf_dims, sym_avals, fresh, tied = stager.carry_dims(avals, outs, options["dims"], treedef,
                                                        tie=tie)
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
      return stager.policies.get(v, DEFAULT_POLICY)
    return user_policy(buckets, u) or DEFAULT_POLICY

  for v in user_of:
    stager.policies[v] = policy_of(v)
  declared = sorted(set(fresh.values()) | _symbolic.vars_of_dims(
      [d for a in sym_avals for d in a.shape]))
  try:
    spec = spec_from_symbolic(cond_fun, body_fun, treedef, paths, sym_avals, leaf_dims,
                              declared, policy_of, options["padding"], options["unroll"],
                              options["bucket_from"], allow_tracer_consts=True,
                              overflow=options["overflow"],
                              max_iterations=options["max_iterations"], staged=True)
  except ControlFlowError:
    if tied:
      raise _Untie from None
    raise
  spec.labels = dict(user_of)
  return spec, sym_avals, fresh, policy_of


class _WhileCall(Call):
  """A staged hoisted loop: padded carry in, padded carry out (``Loop.run_padded``)."""

  name = "while_loop"

  def __init__(self, loop, consts, slots, init_avals, fresh: set, out_avals):
    super().__init__(out_avals)
    spec = loop.spec
    self.loop = loop
    self.consts = [None if is_tracer(c) else c for c in consts]
    self.slots = slots
    self.fresh = fresh
    self.var_order = spec.var_order
    # Initial value of each loop variable: a fresh var starts at the program dim of the axis
    # where it first appears; a program var is itself.
    init_text = initial_dims(spec.leaf_dims, init_avals, fresh)
    self.prog_vars = tuple(sorted((set(spec.var_order) - fresh)
                                  | _symbolic.vars_of_dims(init_text.values())))
    self._init = _symbolic.dim_fn([init_text.get(v, v) for v in spec.var_order],
                                  self.prog_vars)
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


