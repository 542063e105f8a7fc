"""Repeated blocks of a jaxpr, padded and lowered once a bucket (issue 18, goal 3).

A model's layers trace to one run of equations repeated: BERT-base's 12 encoder layers are
~80 of its ~1,100 equations each.  The padding pass interprets every equation of a bucket
inside JAX's trace, and JAX then lowers each one to StableHLO: both scale with the layers,
and both hold the GIL, which a cold server's warm-up shares with the requests' own Python.

``find_runs`` finds, once a jaxpr, runs of ``count`` structurally equal blocks: the same
primitives, parameters, avals and dataflow, up to which outside values each block reads
(those must alias alike in every block).  The interpreter (``_padding_core.interpret``) then
pads block 0 inside a ``jax.jit`` of its own and calls that function for every block
(``call_run``): JAX traces it once a bucket (its trace cache: one function, equal avals) and
lowers it once (its lowering cache emits one private function and ``count`` calls).  XLA
inlines calls before it optimizes, so the executable computes what the flat program does.

The template computes every result that any block's successors read, so an equation the flat
program leaves out in one block (the last layer's unused output) runs in every block.  Where
that fails (its rule refuses it, or an input that a skipped equation would have made is
missing), the run is interpreted flat, as before, which names the problem if it is real.
``DYNJAX_OUTLINE=0`` turns this off.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from dynjax import _jax_private as jp
from dynjax._config import config
from dynjax._errors import PaddingUnsupportedError
from dynjax.bucketing._padded_value import PaddedValue

MIN_PERIOD = 8  # equations in a block
MIN_SAVED = 64  # equations a run must save: period * (count - 1)
MAX_RUNS = 4  # runs a jaxpr (a training step: the layers forward, then their backward)
CANDIDATES = 12  # periods tried a region: its most common distances between equal equations

# Parameters of custom_jvp / custom_vjp calls that only differentiation reads: the padding
# pass runs their primal ``call_jaxpr`` (and padded programs are never differentiated: a
# traced call of a dynjax function is inlined), so blocks differing only there are equal.
_DIFF_ONLY = {"custom_jvp_call": {"jvp_jaxpr_fun", "jvp_jaxpr_thunk"},
              "custom_vjp_call": {"fwd_jaxpr_thunk", "bwd", "out_trees"},
              "custom_vjp_call_jaxpr": {"fwd_jaxpr_thunk", "bwd", "out_trees"}}


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
  """``count`` blocks of ``period`` equations from ``start``; ``template`` is block 0 as an
  open jaxpr (invars: the outside values it reads, outvars: its results any block's
  successors read), ``ins[k]`` / ``outs[k]`` the variables block k binds to them.  ``holes``:
  equations at offsets where the blocks differ but that read only what exists before the
  run (HF BERT's ``head_mask[i]`` of layer i): interpreted flat first, read as inputs."""

  start: int
  period: int
  count: int
  template: Any
  ins: tuple
  outs: tuple
  holes: tuple = ()  # indices of equations run flat before the blocks (each layer's own)
  # the template's last ``hoisted`` inputs: scalar literals that differ between the blocks (a
  # per-layer Python scale); ``ins[k]`` holds block k's Literal objects there
  hoisted: int = 0

  @property
  def end(self) -> int:
    return self.start + self.period * self.count


class _Keys:
  """Structural keys of equations, interned as ints (one instance a ``find_runs`` call)."""

  def __init__(self):
    self._ids: dict = {}
    self._dims: dict = {}  # id(dim) -> (dim, str): a dim's str ~10 us, its == is symbolic
    self._subs: dict = {}  # id(jaxpr) -> (jaxpr, key)
    self._avals: dict = {}  # id(aval) -> (aval, key)

  def intern(self, key) -> int:
    return self._ids.setdefault(key, len(self._ids))

  def dim(self, d) -> str:
    hit = self._dims.get(id(d))
    if hit is None or hit[0] is not d:
      hit = self._dims[id(d)] = (d, str(d))
    return hit[1]

  def aval(self, a) -> tuple:
    hit = self._avals.get(id(a))
    if hit is None or hit[0] is not a:
      shape = getattr(a, "shape", None)
      key = (type(a).__name__,) if shape is None else (
        tuple(self.dim(d) if jp.is_dim_expr(d) else int(d) for d in shape), a.dtype,
        bool(getattr(a, "weak_type", False)))
      hit = self._avals[id(a)] = (a, key)
    return hit[1]

  def literal(self, v) -> tuple:
    val = np.asarray(v.val)
    if val.dtype == object:
      return ("id", id(v))
    return ("lit", self.aval(v.aval), val.dtype.str, val.tobytes())

  def value(self, v, diff_only: bool = False):
    if diff_only:  # a rule only differentiation reads: jax makes a new one each call (relu's
      # jvp_jaxpr_fun is a WrappedFun, not callable, so it was compared by == and every layer
      # with a jax.nn.relu differed: session 31, Flax NNX's miniGPT)
      return ("diff",)
    if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
      return ("jaxpr", self.sub(v))
    if jp.is_dim_expr(v):
      return ("dim", self.dim(v))
    if isinstance(v, (tuple, list)):
      return (type(v).__name__, tuple(self.value(x) for x in v))
    if isinstance(v, (np.ndarray, jax.Array)):
      return ("id", id(v))
    if callable(v) and not isinstance(v, type):
      return ("id", id(v))
    try:
      hash(v)
    except TypeError:
      return ("id", id(v))
    return ("v", type(v).__name__, v)

  def sub(self, j) -> int:
    """A sub-jaxpr's key: its whole structure (consts by identity unless scalars)."""
    hit = self._subs.get(id(j))
    if hit is None or hit[0] is not j:
      jaxpr = getattr(j, "jaxpr", j)
      consts = tuple(
        ("c", np.asarray(c).dtype.str, np.asarray(c).tobytes())
        if isinstance(c, (bool, int, float, complex, np.generic)) else ("id", id(c))
        for c in getattr(j, "consts", ()))
      keys, where = self.eqns(jaxpr, top=False)
      outs = tuple(self.literal(v) if isinstance(v, jex_core.Literal) else where.get(v, ("?",))
                   for v in jaxpr.outvars)  # (positions: the whole structure is the key)
      key = (tuple(self.aval(v.aval) for v in jaxpr.constvars),
             tuple(self.aval(v.aval) for v in jaxpr.invars), consts, tuple(keys), outs)
      hit = self._subs[id(j)] = (j, self.intern(key))
    return hit[1]

  def eqns(self, jaxpr, top: bool) -> tuple[list[int], dict]:
    """One int an equation.  Inside a sub-jaxpr operands are named by position (its whole
    structure is its key); at the top level only by kind, since blocks read other weights
    and values made at other distances (a mask made once, read by every layer):
    ``_make_run`` checks the top-level wiring of a candidate run block by block."""
    where: dict = {}
    for k, v in enumerate(jaxpr.constvars):
      where[v] = ("const", k)
    for k, v in enumerate(jaxpr.invars):
      where[v] = ("in", k)
    keys = []
    for i, e in enumerate(jaxpr.eqns):
      # (at the top level a scalar literal keys by its aval alone: blocks that differ only
      # there are one run, the differing ones its template's inputs: ``_hoist``)
      refs = tuple((("lit", self.aval(v.aval)) if top and _hoistable(v) else self.literal(v))
                   if isinstance(v, jex_core.Literal)
                   else ("v",) if top else where.get(v, ("?",)) for v in e.invars)
      for k, v in enumerate(e.outvars):
        where[v] = ("e", i, k)
      if e.effects:
        keys.append(-1 - i)  # never equal to another equation
        continue
      skip = _DIFF_ONLY.get(e.primitive.name, ())
      params = tuple(sorted((k, self.value(p, k in skip)) for k, p in e.params.items()))
      keys.append(self.intern((e.primitive, params, refs,
                               tuple(self.aval(v.aval) for v in e.invars),
                               tuple(self.aval(v.aval) for v in e.outvars))))
    return keys, where


def _hoistable(v) -> bool:
  """A scalar literal of a numeric dtype (what a template may take as an input)."""
  shape = getattr(v.aval, "shape", None)
  return shape == () and np.asarray(v.val).dtype != object


def _literal_bytes(v) -> tuple:
  val = np.asarray(v.val)
  return (val.dtype.str, val.tobytes())


def _hoist(blocks: list) -> tuple[list, list]:
  """Block 0's equations with each scalar literal that differs between ``blocks`` replaced
  by a new input variable, and those variables with every block's literals there (the
  blocks are wired alike: their literals sit at the same operands)."""
  eqns = list(blocks[0])
  hoisted: list = []  # (variable, [block k's Literal])
  for j, e in enumerate(blocks[0]):
    invars, before = list(e.invars), len(hoisted)
    for q, v in enumerate(e.invars):
      if not (isinstance(v, jex_core.Literal) and _hoistable(v)):
        continue
      lits = [b[j].invars[q] for b in blocks]
      if all(_literal_bytes(x) == _literal_bytes(v) for x in lits[1:]):
        continue  # equal everywhere: stays a literal (the padding rules read its value)
      invars[q] = jex_core.Var(v.aval)
      hoisted.append((invars[q], lits))
    if len(hoisted) > before:  # (not a list compare: == of literals compares their values)
      eqns[j] = e.replace(invars=invars)
  return eqns, hoisted


def _early(jaxpr) -> np.ndarray:
  """Per equation, the index of the latest equation whose result it reads (-1: only the
  jaxpr's inputs and literals).  Two equations a period apart where the later reads nothing
  newer than the earlier (HF BERT's ``head_mask[i]`` of each layer) may differ between
  blocks (``Run.holes``)."""
  where = {}
  out = np.full(len(jaxpr.eqns), -1, np.int64)
  for i, e in enumerate(jaxpr.eqns):
    out[i] = max((where.get(v, -1) for v in e.invars if not isinstance(v, jex_core.Literal)),
                 default=-1) if not e.effects else i
    for v in e.outvars:
      where[v] = i
  return out


def _best_run(keys: np.ndarray, early: np.ndarray, lo: int, hi: int
              ) -> tuple[int, int, int] | None:
  """The run in ``keys[lo:hi]`` that saves the most equations: ``(start, period, count)``;
  two equations a period apart that read nothing newer than the first count as equal
  (holes: ``_make_run`` checks them)."""
  seg = keys[lo:hi]
  m = len(seg)
  if m < 2 * MIN_PERIOD:
    return None
  last: dict = {}
  dist: collections.Counter = collections.Counter()
  for i, k in enumerate(seg.tolist()):
    j = last.get(k)
    if j is not None and i - j >= MIN_PERIOD:
      dist[i - j] += 1
    last[k] = i
  best = None
  for p, _ in dist.most_common(CANDIDATES):
    if 2 * p > m:
      continue
    strict = seg[:-p] == seg[p:]
    # a pair a period apart whose later one reads nothing newer than the earlier one does
    # (both read what exists before them: the same table, their own rows of it)
    loose = early[lo + p:hi] <= early[lo:hi - p]
    eq = np.concatenate(([False], strict | loose, [False])).astype(np.int8)
    edges = np.diff(eq)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
      count = (b - a) // p + 1
      if count < 2:
        continue
      # equations saved: only strictly equal ones (holes run flat), over whole blocks
      saved = int(np.count_nonzero(strict[a:a + p * (count - 1)]))
      if saved >= MIN_SAVED and (best is None or saved > best[0]):
        best = (saved, lo + a, p, count)
  return None if best is None else best[1:]


def _last_uses(jaxpr) -> dict:
  n = len(jaxpr.eqns)
  last: dict = {}
  for i, e in enumerate(jaxpr.eqns):
    for v in e.invars:
      if not isinstance(v, jex_core.Literal):
        last[v] = i
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal):
      last[v] = n
  return last


def _wiring(block: list) -> tuple[tuple, list]:
  """How a block's equations read: ``("i", j, k)`` output k of its equation j, ``("x", s)``
  its s-th outside value (in first-read order), None a literal; and those outside values."""
  made: dict = {}
  ext: list = []
  slot: dict = {}
  wires = []
  for j, e in enumerate(block):
    for v in e.invars:
      if isinstance(v, jex_core.Literal):
        wires.append(None)
      elif v in made:
        wires.append(made[v])
      else:
        if v not in slot:
          slot[v] = ("x", len(ext))
          ext.append(v)
        wires.append(slot[v])
    for k, v in enumerate(e.outvars):
      made[v] = ("i", j, k)
  return tuple(wires), ext


def _holes(jaxpr, keys, start: int, period: int, count: int) -> list[int] | None:
  """Offsets where some block's equation differs from block 0's; None unless each of those
  equations reads only values made before ``start`` or by other holes (then they run first)."""
  offs = [o for o in range(period)
          if any(keys[start + k * period + o] != keys[start + o] for k in range(1, count))]
  if not offs:
    return offs
  eqns = jaxpr.eqns
  made_late = {v for e in eqns[start:start + period * count] for v in e.outvars}
  hole_out: set = set()
  for k in range(count):
    for o in offs:
      e = eqns[start + k * period + o]
      if e.effects or any(v in made_late and v not in hole_out for v in e.invars
                          if not isinstance(v, jex_core.Literal)):
        return None
      hole_out.update(e.outvars)
  return offs


def _make_run(jaxpr, keys, start: int, period: int, count: int,
              last_use: dict) -> Run | None:
  """The run's template and bindings: the longest stretch of its blocks wired alike (equal
  equations may read other values: the keys name operands by kind only), its holes left out
  of the template."""
  eqns = jaxpr.eqns
  offs = _holes(jaxpr, keys, start, period, count)
  if offs is None or len(offs) > period // 4:  # holes are a layer's few own equations
    return None
  holes = set(offs)
  keep = [o for o in range(period) if o not in holes]

  def block(k):
    return [eqns[start + k * period + o] for o in keep]

  wired = [_wiring(block(k)) for k in range(count)]
  first, n, k = 0, 0, 0
  while k < count:  # the longest stretch of consecutive blocks with block k's wiring
    j = k
    while j < count and wired[j][0] == wired[k][0]:
      j += 1
    if j - k > n:
      first, n = k, j - k
    k = j
  if n < 2 or (period - len(offs)) * (n - 1) < MIN_SAVED:
    return None
  start, count = start + first * period, n
  ins = tuple(tuple(ext) for _, ext in wired[first:first + n])
  blocks = [block(k) for k in range(count)]
  positions = set()
  for k, eqs in enumerate(blocks):
    end = start + (k + 1) * period
    for j, e in enumerate(eqs):
      for q, v in enumerate(e.outvars):
        if not isinstance(v, jex_core.DropVar) and last_use.get(v, -1) >= end:
          positions.add((j, q))
  order = sorted(positions)
  outs = tuple(tuple(eqs[j].outvars[q] for j, q in order) for eqs in blocks)
  eqns0, hoisted = _hoist(blocks)
  ins = tuple(tuple(ins[k]) + tuple(lits[k] for _, lits in hoisted) for k in range(count))
  template = jaxpr.replace(constvars=[], invars=list(ins[0][:len(ins[0]) - len(hoisted)])
                           + [v for v, _ in hoisted], outvars=list(outs[0]), eqns=eqns0,
                           effects=jex_core.no_effects)
  return Run(start, period, count, template, ins, outs,
             tuple(start + k * period + o for k in range(count) for o in offs), len(hoisted))


def find_runs(jaxpr) -> dict[int, Run]:
  """The runs of repeated blocks in ``jaxpr``'s equations, keyed by their first equation.
  Once a jaxpr (``JaxprInfo``): BERT-base's 989 equations 0.03-0.05 s on the CPU box."""
  n = len(jaxpr.eqns)
  if not config.outline or n < MIN_SAVED + MIN_PERIOD:
    return {}
  keys = np.asarray(_Keys().eqns(jaxpr, top=True)[0], np.int64)
  early = _early(jaxpr)
  last_use = _last_uses(jaxpr)
  runs: dict[int, Run] = {}
  regions = [(0, n)]
  while regions and len(runs) < MAX_RUNS:
    lo, hi = regions.pop()
    found = _best_run(keys, early, lo, hi)
    if found is None:
      continue
    run = _make_run(jaxpr, keys, *found, last_use)
    if run is None:
      continue
    runs[run.start] = run
    regions += [(lo, run.start), (run.end, hi)]
  return runs


@dataclasses.dataclass
class _Block:
  """One run's jitted template for one set of input fills, and what its trace found."""

  fn: Any
  fills: list = dataclasses.field(default_factory=list)  # (fill, axis_fill) an output
  problems: list = dataclasses.field(default_factory=list)


def _block_fn(ctx, run: Run, names: tuple, in_fills: tuple, interpret) -> _Block:
  blk = _Block(None)
  collect = ctx.problems is not None

  weak = [getattr(v.aval, "weak_type", False) for v in run.template.invars]
  first_hoisted = len(weak) - run.hoisted

  def block(sizes, *vals):
    # a hoisted literal came in as a strong array of its dtype: its weak type back
    vals = [jp.as_weak(v) if k >= first_hoisted and weak[k] else v for k, v in enumerate(vals)]
    sub = ctx.with_sizes(dict(zip(names, sizes, strict=True)),
                         problems=blk.problems if collect else None)
    outs = interpret(sub, run.template, [], [
      PaddedValue(v, f, af) for v, (f, af) in zip(vals, in_fills, strict=True)])
    blk.fills[:] = [(o.fill, o.axis_fill) for o in outs]
    return [o.array(v.aval.dtype) for o, v in zip(outs, run.template.outvars, strict=True)]

  block.__name__ = f"dynjax_block{run.period}"
  blk.fn = jax.jit(block)
  return blk


def _scalar_key(obj):
  """Fills by dtype and bytes: 0.0 and -0.0 apart (a sum's mask may skip one only), a NaN
  equal to itself."""
  if isinstance(obj, tuple):
    return tuple(_scalar_key(o) for o in obj)
  if isinstance(obj, (np.generic, float, complex, bool)):
    a = np.asarray(obj)
    return (a.dtype.str, a.tobytes())
  return obj


def call_run(ctx, run: Run, env: dict, write, interpret) -> bool:
  """Pads the blocks of ``run`` in order through one jitted template (``interpret``: the
  padding pass's interpreter), writing each block's outputs (``write(var, PaddedValue)``)
  before the next reads them.  False where the run must be interpreted flat (the caller then
  interprets it from its start, writing over whatever the blocks before wrote)."""
  names = tuple(ctx.sizes_env)
  sizes = tuple(ctx.sizes_env[n] for n in names)
  mark = len(ctx.log) if ctx.log is not None else 0
  for ins, outvars in zip(run.ins, run.outs, strict=True):
    vals = [PaddedValue(np.asarray(v.val, v.aval.dtype)) if isinstance(v, jex_core.Literal)
            else env.get(v) for v in ins]  # (a hoisted literal: a scalar input, no padding)
    res = None
    if all(pv is not None for pv in vals):  # else made by an equation the flat run leaves out
      in_fills = tuple((pv.fill, pv.axis_fill) for pv in vals)
      key = (id(run), _scalar_key(in_fills))
      blk = ctx.blocks.get(key)
      if blk is None:
        blk = ctx.blocks[key] = _block_fn(ctx, run, names, in_fills, interpret)
      try:  # BERT-base, CPU box: the first block 59 ms (the template's trace), the others
        # 0.2 ms each (JAX's trace cache); flat, each layer took ~15 ms to pad and lower
        res = blk.fn(sizes, *[pv.val for pv in vals])
      except PaddingUnsupportedError:
        res = None
      if blk.problems:
        res = None
    if res is None:  # the flat interpretation says why, if it fails too
      if ctx.log is not None:
        del ctx.log[mark:]
      return False
    for v, r, (f, af) in zip(outvars, res, blk.fills, strict=True):
      write(v, PaddedValue(r, f, af))
  ctx.note(run.template.eqns[0], f"block of {run.period} equations repeated {run.count} "
                                 "times: padded and lowered once (one jitted template)")
  return True


__all__ = ["Run", "call_run", "find_runs"]
