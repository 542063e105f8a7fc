"""Parameters cast once: float inputs that the function only ever casts to a narrower dtype.

Flax models keep float32 parameters and compute in bfloat16 (``param_dtype=float32``,
``dtype=bfloat16``: ``nn.Dense``/``nn.Embed``/``DenseGeneral`` cast the kernel inside
``__call__``; hand-written experts call ``self.param(...).astype(dtype)``).  Under ``jax.jit``
every call converts every such weight again: a float32 read and a bfloat16 write of the whole
parameter set, in its own kernel before each GEMM (cuBLAS cannot fuse it).  torch's autocast
caches those casts (``cache_enabled=True``); this module is dynjax's equivalent:

* :func:`plan` (once per family, on the symbolic jaxpr): every float leaf without dims, not
  weak-typed and not donated, whose *every* use is ``convert_element_type`` to one narrower
  float dtype ``D`` (an output only where it is returned unchanged: ``jit/_forward.py``) is
  cast once, if it and the family's conversions are large enough (``MIN_BYTES``,
  ``MIN_SAVED_SECONDS``).  The executable takes it as
  ``D`` and upcasts it at its entry; the function's own cast then turns it back into the same
  ``D`` values (``D -> float32 -> D`` is the identity), and XLA's algebraic simplifier removes
  the pair.  Exact: the function never sees the float32 values except through the cast.
* :func:`holds` (per bucket, on the jaxpr that bucket really lowers: ``trust`` re-traces the
  Python function at each bucket's shapes, where a shape-dependent branch could use the
  parameter otherwise): the upcast's every use is the cast back to ``D``; a bucket where that
  fails lowers without casts (its entry records that, see :func:`of_executable`).
* :class:`Memo` / :class:`Applier` (each call): the cast copies, one per leaf of a family,
  cached by the *identity* of the array the caller passed (``jax.Array`` is immutable; a weak
  reference, so the caller's old parameters are freed when dropped).  numpy leaves can change
  in place and are cast on every call.  Cost on a hit, top-level path: a walk down the key
  paths of plain dicts/lists/tuples to the cast leaves, a weakref compare each, copying only
  the containers on those paths (2-core CPU box, ``benchmarks/bench_cast_apply.py``, an
  argument of 200 leaves, five runs (three alternating with the old tree): 5.6-10.3 us with 12 cast, 56-112 us with 150;
  the C++ flatten/unflatten of the whole argument it replaces took 48-95 / 92-161 us, and
  still serves other containers and misses); the misses of a call are converted in one
  dispatch (a training step's new parameters: one extra executable call a step).
  Memory: the cast copies live beside the caller's float32 arrays (+50% of those parameters
  for bfloat16), as torch's autocast cache.  ``dynjax.jit(cast_once=False)`` turns it off.

Not for sharded families (their leaves have per-leaf shardings) or donated leaves.  Uses
inside nested jaxprs (``jax.checkpoint``, ``lax.scan`` over layers, an inner ``jax.jit``) count
as other uses: such parameters stay float32 (cast on every call, as before).
"""

from __future__ import annotations

import math
import threading
import weakref

import jax
import numpy as np
from jax.extend import core as jex_core

from dynjax.jit import _args, _forward

CONVERT = "convert_element_type"
# Leaves smaller than this stay as they are (cast inside the executable, where XLA fuses the
# convert into its consumer): the host work of a cast leaf on a call (~0.7 us of lookup on the
# 2-core CPU box) would outweigh what a small one saves (a 256 KiB float32 leaf: ~0.2 us of
# H100 memory traffic).  Tests set it to 0.
MIN_BYTES = 1 << 18
# And a family casts once only when the conversions it saves a call (bytes read and written,
# at a rough memory bandwidth of the backend) outlast the host work it adds to each call
# (2-core CPU box, an argument of 200 leaves: 6-112 us on a warm call by key path, 50-180 us
# where it flattens; chosen when every call flattened).  Tests set it to 0.
MIN_SAVED_SECONDS = 1e-4
BANDWIDTH = {"gpu": 2e12, "cuda": 2e12, "rocm": 2e12, "tpu": 1e12}  # bytes/s; others 1e10


def plan(fam) -> dict[int, np.dtype]:
  """leaf index -> the dtype it is cast to once, for a padded, one-device family (traced;
  ``fam.forward`` known)."""
  if not fam.ctx.opts.cast_once:
    return {}
  donated = set(fam.donate_leaves())
  cands = {i: np.dtype(a.dtype) for i, (spec, a) in enumerate(
      zip(fam.sig.leaves, fam.avals, strict=True))
           if spec is None and not a.weak_type and i not in donated
           and jax.dtypes.issubdtype(a.dtype, np.floating)
           and math.prod(a.shape) * np.dtype(a.dtype).itemsize >= MIN_BYTES}
  if not cands:
    return {}
  casts = cast_uses(fam.jaxpr.jaxpr, {fam.jaxpr.jaxpr.invars[i]: (i, d)
                                      for i, d in cands.items()}, set(fam.forward))
  moved = sum(math.prod(fam.avals[i].shape) * (cands[i].itemsize + d.itemsize)
              for i, d in casts.items())
  if moved < MIN_SAVED_SECONDS * BANDWIDTH.get(jax.default_backend(), 1e10):
    return {}  # too little to convert: the host work would cost more than it saves
  return casts


def cast_uses(jaxpr, watch: dict, forwarded=frozenset()) -> dict[int, np.dtype]:
  """Of the watched input variables (var -> (leaf index, dtype)), those whose every use in
  ``jaxpr``'s top level is a cast to one narrower float dtype: leaf index -> that dtype.
  Outputs at indices in ``forwarded`` (returned as the caller's own object) are no use."""
  target: dict[int, np.dtype] = {}
  bad: set[int] = set()
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if isinstance(v, jex_core.Literal):
        continue
      hit = watch.get(v)
      if hit is None:
        continue
      i, dtype = hit
      new = eqn.params.get("new_dtype") if eqn.primitive.name == CONVERT else None
      if new is None or not narrower(np.dtype(new), dtype):
        bad.add(i)
      elif target.setdefault(i, np.dtype(new)) != np.dtype(new):
        bad.add(i)  # cast to two dtypes: the copy would serve only one
  for o, v in enumerate(jaxpr.outvars):
    if not isinstance(v, jex_core.Literal) and v in watch and o not in forwarded:
      bad.add(watch[v][0])
  return {i: d for i, d in target.items() if i not in bad}


def narrower(new: np.dtype, old: np.dtype) -> bool:
  return jax.dtypes.issubdtype(new, np.floating) and new.itemsize < old.itemsize


def upcast(leaves, casts: dict, dtypes) -> list:
  """The executable's entry: each cast leaf back to its own dtype (``dtypes[i]``), which the
  function then casts to ``casts[i]`` again (XLA removes the pair)."""
  if not casts:
    return list(leaves)
  return [jax.lax.convert_element_type(x, dtypes[i]) if i in casts else x
          for i, x in enumerate(leaves)]


def holds(jaxpr, casts: dict, offset: int) -> bool:
  """Whether, in the jaxpr a bucket lowers (its inputs: ``offset`` leading ones, then the
  leaves), each cast leaf's only use is the upcast and the upcast's every use is the cast
  back to ``casts[i]``."""
  ups = {}
  for i in casts:
    ups[jaxpr.invars[offset + i]] = i
  found: dict = {}  # upcast output var -> (leaf index, the upcast's dtype)
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal) and v in ups:
        if eqn.primitive.name != CONVERT or len(eqn.outvars) != 1:
          return False
        i = ups[v]
        found[eqn.outvars[0]] = (i, np.dtype(eqn.params["new_dtype"]))
  if len(found) != len(casts):  # a leaf used twice, or not at all
    return False
  again = cast_uses(jaxpr, found)
  return all(again.get(i) == d for i, d in casts.items())


def of_executable(fam, exe, offset: int) -> tuple:
  """((leaf index, dtype), ...) an executable takes cast, from its own input dtypes (a bucket
  whose check failed, and a stored executable, say for themselves)."""
  if not fam.casts:
    return ()
  try:
    infos = jax.tree.leaves(exe.args_info)[offset:]
    return tuple((i, d) for i, d in sorted(fam.casts.items())
                 if np.dtype(infos[i].dtype) == d)
  except Exception:  # noqa: BLE001 - no input metadata: the store matched the family's avals
    return tuple(sorted(fam.casts.items()))


def _convert_all(xs, dtypes):
  return tuple(jax.lax.convert_element_type(x, d) for x, d in zip(xs, dtypes, strict=True))


# One dispatch converts every leaf a call misses (a training loop's new parameters each step:
# one executable call, not one per leaf); compiled once per set of shapes and dtypes.
_convert_many = jax.jit(_convert_all, static_argnums=1)


class Memo:
  """The cast copies of one family: leaf index -> (weakref to the source array, its copy)."""

  __slots__ = ("copies", "conversions", "lock")

  def __init__(self):
    self.copies: dict = {}
    self.conversions = 0  # leaves converted (misses); stats()["cast_once"]
    self.lock = threading.Lock()

  def hit(self, li: int, x):
    """The cached copy of leaf ``li`` while the caller passes the same live array, else None."""
    h = self.copies.get(li)
    return h[1] if h is not None and h[0]() is x and not x.is_deleted() else None

  def lookup(self, li: int, x, src: np.dtype):
    """(the cached copy of ``x``, None) while the caller passes the same array, else (None,
    the array to convert).  ``x`` was traced as ``src``: another dtype raises the
    executable's own signature error, so the call takes the general path and a new family
    (as a ``jax.jit`` retrace)."""
    hit = self.hit(li, x)
    if hit is not None:
      return hit, None
    if type(x) is np.ndarray:
      if x.dtype != src and _args.canonical(x.dtype) != src:
        raise TypeError(f"Argument types differ: leaf {li} is {x.dtype}, traced as {src}")
      # As jax.jit: a 64-bit host array is canonicalised first (x64 off), then cast.
      return None, np.asarray(x, src)
    if not isinstance(x, jax.Array) or x.dtype != src:
      raise TypeError(f"Argument types differ: leaf {li} is "
                      f"{getattr(x, 'dtype', type(x).__name__)}, traced as {src}")
    if x.is_deleted():
      raise RuntimeError(f"Array has been deleted: argument leaf {li} (donated or deleted by "
                         "its owner) cannot be used")
    return None, x

  def fill(self, misses: list) -> tuple:
    """The copies of ``misses`` ((leaf index, caller's object, array, dtype, ...)), converted
    in one dispatch; jax arrays' copies are kept (numpy can change in place: never)."""
    outs = _convert_many(tuple(m[2] for m in misses), tuple(m[3] for m in misses))
    with self.lock:
      self.conversions += len(misses)
    for m, out in zip(misses, outs, strict=True):
      if type(m[1]) is not np.ndarray:
        try:
          self.copies[m[0]] = (weakref.ref(m[1]), out)
        except TypeError:  # an array type without weak references: cast on every call
          pass
    return outs


class _Fallback(Exception):
  """A path walk met a container it cannot copy (not a plain dict/list/tuple)."""


def _key_paths(treedef) -> list | None:
  """Per leaf of ``treedef``: its path as plain keys (dict keys, sequence indices), or None
  when some container on a path is another kind of node (a dataclass, an NNX State)."""
  tu = jax.tree_util
  out = []
  for path, _ in tu.tree_flatten_with_path(tu.tree_unflatten(treedef, list(range(
      treedef.num_leaves))))[0]:
    keys = []
    for k in path:
      if isinstance(k, tu.DictKey):
        keys.append(k.key)
      elif isinstance(k, tu.SequenceKey):
        keys.append(k.idx)
      else:
        return None
    out.append(tuple(keys))
  return out


def _swap(node, plan: dict, items: tuple, memo: Memo):
  """``node`` with the leaves ``plan`` names (key -> sub-plan, or slot in ``items``) replaced
  by their cached copies, copying only the containers on their paths; ``_Fallback`` on a
  miss (or a container of another kind): the flatten path converts and explains."""
  t = type(node)
  if t is dict:
    new = dict(node)
  elif t is list or t is tuple:
    new = list(node)
  else:
    raise _Fallback
  for k, sub in plan.items():
    x = node[k]
    if type(sub) is int:
      hit = memo.hit(items[sub], x)
      if hit is None:
        raise _Fallback
      new[k] = hit
    else:
      new[k] = _swap(x, sub, items, memo)
  return tuple(new) if t is tuple else new


class Applier:
  """Swaps the cast leaves of one call (top-level arguments or flat leaves) for their copies.

  Top-level arguments that are plain dicts/lists/tuples down to the cast leaves (Flax's
  ``{"params": {...}}``) are patched by key path when every cast leaf hits: the leaves are
  looked up and only the containers on their paths copied, with no flatten of the argument
  (see the module docstring for the cost).  Misses and other containers (a FrozenDict, a
  dataclass, an NNX State) flatten and unflatten in C++.  Either way the executable checks
  the argument's whole structure itself.
  """

  __slots__ = ("memo", "flat", "by_arg", "counts", "paths")

  def __init__(self, fam, casts: tuple, top: bool):
    self.memo = fam.cast_memo
    casts = tuple((li, np.dtype(fam.avals[li].dtype), d) for li, d in casts)
    self.flat = None if top else casts
    self.by_arg = None
    self.paths = None
    if top:
      where = _forward.arg_positions(fam, [li for li, _, _ in casts])
      groups: dict[int, list] = {}
      for li, src, d in casts:
        pos, j = where[li]
        groups.setdefault(pos, []).append((j, li, src, d))
      children = fam.treedef.children()
      self.counts = {pos: children[pos].num_leaves for pos in groups}  # leaves an argument has
      self.by_arg = tuple((pos, tuple(items)) for pos, items in sorted(groups.items()))
      self.paths = self._plans(children)

  def _plans(self, children) -> tuple | None:
    """(argument position, leaf indices by slot, plan: key -> sub-plan or slot) per argument
    holding cast leaves, or None when one is not plain dicts/lists/tuples down to them (or is
    itself a cast leaf): those calls flatten."""
    plans = []
    for pos, items in self.by_arg:
      kp = _key_paths(children[pos])
      if kp is None or any(not kp[j] for j, _, _, _ in items):
        return None
      plan: dict = {}
      for slot, (j, _, _, _) in enumerate(items):
        node = plan
        for k in kp[j][:-1]:
          node = node.setdefault(k, {})
        node[kp[j][-1]] = slot
      plans.append((pos, tuple(li for _, li, _, _ in items), plan))
    return tuple(plans)

  def apply(self, vals) -> list:
    args = list(vals)
    if self.paths is not None:  # every cast leaf a hit: one walk, no flatten
      try:
        for pos, items, plan in self.paths:
          args[pos] = _swap(args[pos], plan, items, self.memo)
        return args
      # a miss, or another structure (a list where a dict was traced: TypeError on a str
      # index): the flatten path converts, or the executable's own check takes a new family
      except (_Fallback, KeyError, IndexError, TypeError):
        args = list(vals)
    return self._by_flatten(args)

  def _by_flatten(self, args: list) -> list:
    memo = self.memo
    misses = []  # (leaf index, caller's object, array to convert, dtype, where it goes)
    if self.flat is not None:
      for li, src, d in self.flat:
        hit, a = memo.lookup(li, args[li], src)
        if hit is None:
          misses.append((li, args[li], a, d, li))
        else:
          args[li] = hit
      for m, out in zip(misses, memo.fill(misses) if misses else (), strict=True):
        args[m[4]] = out
      return args
    flat = {}
    for pos, items in self.by_arg:
      leaves, tree = jax.tree_util.tree_flatten(args[pos])
      if len(leaves) != self.counts[pos]:  # another structure: a new family
        raise TypeError("Function compiled with input pytree does not match the argument")
      for j, li, src, d in items:
        hit, a = memo.lookup(li, leaves[j], src)
        if hit is None:
          misses.append((li, leaves[j], a, d, (pos, j)))
        else:
          leaves[j] = hit
      flat[pos] = (leaves, tree)
    for m, out in zip(misses, memo.fill(misses) if misses else (), strict=True):
      flat[m[4][0]][0][m[4][1]] = out
    for pos, (leaves, tree) in flat.items():
      args[pos] = jax.tree_util.tree_unflatten(tree, leaves)
    return args


def describe(fam) -> list[str]:
  """explain() lines: the leaves cast once."""
  return [f"{fam.leaf_paths[i]}: {fam.avals[i].dtype} -> {d}" for i, d in sorted(
      fam.casts.items())]
