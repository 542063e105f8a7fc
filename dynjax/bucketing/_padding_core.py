"""Core of the padding pass: padded values, the per-bucket context and the jaxpr interpreter.

The interpreter reads like ``jax._src.core.eval_jaxpr``: an ``env`` with ``read``/``write`` and
a per-primitive rule table (``RULES``, filled by ``_padding_rules``).  It runs *inside* the
function the core jits, so every array it handles is a tracer of the padded bucket shapes and the
true sizes are traced int32 scalars.

Invariant of every value (``PaddedValue``) bound to a jaxpr variable whose aval has symbolic
dims ``(d_0, ..., d_n)``: the array has the shape of those dims evaluated at the bucket sizes,
and its prefix ``[0:d_0, ..., 0:d_n]`` (dims evaluated at the true sizes) holds exactly what the
unpadded program holds.  Outside the prefix ("the padded region") it holds either anything
(``fill is None``) or one known constant (``fill``).  Values with static avals have no padded
region and are exact.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from dynjax import _jax_private as jp
from dynjax._errors import PaddingUnsupportedError, format_list
from dynjax.bucketing import _outline
from dynjax.bucketing._padded_value import PaddedValue, common_fill, same_fill

Rule = Callable[["Context", Any, list["PaddedValue"]], list["PaddedValue"]]

# primitive -> rule.  Filled by dynjax.bucketing._padding_rules (imported by _padding).
RULES: dict[Any, Rule] = {}
# Fused rules (superinstructions), keyed by the primitive a chain starts with:
# ``fuse(ctx, eqns, i, uses, read) -> (index after the chain, output var, PaddedValue) | None``
# (None: the per-equation rules apply).  ``_padding_rules.fused_softmax`` is one.
FUSED: dict[Any, Callable] = {}
# primitive name -> why it has no exact rule (for the fallback message).
WHY_NO_RULE: dict[str, str] = {}


is_dynamic_dim = jp.is_dim_expr


def dynamic_axes(aval) -> list[int]:
  return [i for i, d in enumerate(getattr(aval, "shape", ())) if is_dynamic_dim(d)]


def has_dim_expr(obj) -> bool:
  """Whether a (nested) parameter holds a symbolic dimension."""
  if isinstance(obj, (tuple, list)):
    return any(has_dim_expr(o) for o in obj)
  return jp.is_dim_expr(obj)


def sub_jaxprs(params) -> list:
  """The jaxprs an equation holds in its params (bodies of jit, scan, while, cond...)."""
  out = []
  for v in params.values():
    for item in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(item, jex_core.ClosedJaxpr):
        out.append(item.jaxpr)
      elif isinstance(item, jex_core.Jaxpr):
        out.append(item)
  return out


class JaxprInfo:
  """What the interpreter needs of a jaxpr whatever the bucket, found once a jaxpr: which
  equations touch a dynamic axis, which are live, and how often each variable is read.
  Every bucket of a family re-interprets the same jaxpr (BERT-base, CPU box: these took
  ~15 ms of a bucket's ~125 ms padding pass)."""

  __slots__ = ("touches", "live", "any_touch", "_uses", "_runs")

  def __init__(self, jaxpr):
    self.touches = [eqn_touches_dynamic(e) for e in jaxpr.eqns]
    self.live = _live_eqns(jaxpr)
    self.any_touch = any(self.touches) or any(
        dynamic_axes(v.aval) for v in (*jaxpr.invars, *jaxpr.constvars))
    self._uses = None
    self._runs = None

  def runs(self, jaxpr) -> dict:
    """Runs of repeated blocks (``_outline.find_runs``), found at the first bucket."""
    if self._runs is None:
      self._runs = _outline.find_runs(jaxpr)
    return self._runs

  def uses(self, jaxpr) -> dict:
    if self._uses is None:
      self._uses = _use_counts(jaxpr)
    return self._uses


# Keyed by the jaxpr itself (weakly: a family's jaxprs go when it does).
_INFO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INFO_LOCK = threading.Lock()


def jaxpr_info(jaxpr) -> JaxprInfo:
  info = _INFO.get(jaxpr)
  if info is None:
    info = JaxprInfo(jaxpr)  # outside the lock: it may recurse into sub-jaxprs
    with _INFO_LOCK:
      info = _INFO.setdefault(jaxpr, info)
  return info


def jaxpr_touches_dynamic(jaxpr) -> bool:
  return jaxpr_info(jaxpr).any_touch


def eqn_touches_dynamic(eqn) -> bool:
  """Whether an equation involves a dynamic axis (then it needs a padding rule)."""
  for v in (*eqn.invars, *eqn.outvars):
    if dynamic_axes(v.aval):
      return True
  for k, p in eqn.params.items():
    if isinstance(p, (jex_core.ClosedJaxpr, jex_core.Jaxpr)) or (
      isinstance(p, (tuple, list))
      and p
      and isinstance(p[0], (jex_core.ClosedJaxpr, jex_core.Jaxpr))
    ):
      continue
    if k.endswith("jaxpr_thunk") or k.endswith("jaxpr_fun") or callable(p):
      continue
    if has_dim_expr(p):
      return True
  return any(jaxpr_touches_dynamic(j) for j in sub_jaxprs(eqn.params))


_ENCLOSING = threading.local()


def source_of(eqn) -> str:
  """The user's source line of ``eqn``; inside library code (e.g. ``jnp.roll``'s own jit), the
  line of the innermost enclosing call that has one."""
  s = jp.summarize_source(eqn)
  if s and s != "<unknown source>":
    return s
  for outer in reversed(getattr(_ENCLOSING, "stack", [])):
    outer = jp.summarize_source(outer)
    if outer and outer != "<unknown source>":
      return outer
  return s or "<unknown source>"


@contextlib.contextmanager
def enclosing(eqn):
  """Marks ``eqn`` (a call/loop/cond) as the enclosing equation of the sub-jaxpr interpreted."""
  stack = getattr(_ENCLOSING, "stack", None)
  if stack is None:
    stack = _ENCLOSING.stack = []
  stack.append(eqn)  # its source line is looked up only when a message needs it (~20 us)
  try:
    yield
  finally:
    stack.pop()


def unsupported(eqn, why: str) -> PaddingUnsupportedError:
  # What happens next (run unpadded, or refuse under on_fallback="error") is the caller's to
  # say: the message only names the equation.
  problem = f"'{eqn.primitive.name}' at {source_of(eqn)}: {why}"
  err = PaddingUnsupportedError(f"the padding pass has no exact rule for {problem}")
  err.problems = (problem,)
  return err


def unsupported_all(problems: Sequence[str]) -> PaddingUnsupportedError:
  """One error listing every equation the pass cannot pad (``problems``: from ``unsupported``)."""
  problems = list(dict.fromkeys(problems))
  if len(problems) == 1:
    err = PaddingUnsupportedError(f"the padding pass has no exact rule for {problems[0]}")
  else:
    err = PaddingUnsupportedError(
      f"the padding pass has no exact rule for {len(problems)} equations:\n" + format_list(problems)
    )
  err.problems = tuple(problems)
  return err


def problems_of(err: PaddingUnsupportedError) -> tuple[str, ...]:
  """The equations an error names (its message when it did not come from ``unsupported``)."""
  return getattr(err, "problems", None) or (str(err),)


_BOUND_CACHE: dict[Any, int] = {}


class Context:
  """Per-trace state: true sizes (traced), bucket sizes (ints), the rewrite log."""

  def __init__(self, sizes_env: dict[str, Any], bucket_env: dict[str, int], log: list[str] | None,
               size_max: dict[str, int] | None = None, problems: list[str] | None = None):
    self.sizes_env = sizes_env
    self.bucket_env = bucket_env
    self.log = log
    # Plan time (``pad_jaxpr``'s abstract trace): the interpreter records each equation it
    # cannot pad here and goes on with a placeholder, so one error can name all of them.
    # ``None``: raise at the first.
    self.problems = problems
    # Rule-to-rule memos within one trace (keyed by equation operands and the trace state):
    # the associative scan's forward leaves its backward's residuals here (bucketing/_scan).
    self.stash: dict[Any, Any] = {}
    self._true_cache: dict[Any, Any] = {}
    self._padded: dict[int, tuple] = {}  # id(dim) -> (dim, padded size)
    # (id(run), input fills) -> the jitted template of a run of repeated blocks (_outline)
    self.blocks: dict[Any, Any] = {}
    size_max = size_max or {}
    self.box = {v: (1, min(n, size_max.get(v, n))) for v, n in bucket_env.items()}
    self._box_key = tuple(sorted(self.box.items()))

  def with_sizes(self, sizes_env: dict[str, Any], problems: list[str] | None) -> Context:
    """This bucket's context with other traced true sizes (a jitted template's arguments)."""
    sub = copy.copy(self)
    sub.sizes_env, sub.problems, sub._true_cache, sub.blocks = sizes_env, problems, {}, {}
    return sub

  # -- dimensions -------------------------------------------------------------------------
  def padded_dim(self, d) -> int:
    """The padded size of a dim: its largest value over true sizes in ``[1, bucket]``.

    For monotone dims (``t``, ``b*t``, ``t + 1``, ``max(t, 3)``) that is the dim at the bucket
    sizes; non-monotone intermediate dims (``t - mod(t, 5)`` from ``jnp.roll``) get a sound
    interval upper bound so that no true extent ever exceeds its buffer.  With ``size_max``
    (true sizes known to stay below the bucket, e.g. inside a hoisted loop whose next size must
    fit) a bare variable keeps its bucket-sized buffer and compound dims use the smaller range:
    ``t + 1`` then fits the bucket of ``t`` and a concatenation at the true length becomes an
    in-place ``dynamic_update_slice`` of the carry.
    """
    if not is_dynamic_dim(d):
      return int(d)
    # Keyed by identity: a dim's ``__eq__`` is a symbolic comparison (~20 us), its ``str``
    # ~10 us, and a jaxpr's avals share few dim objects (BERT-base: ~40 for ~3,000 asks).
    hit = self._padded.get(id(d))
    if hit is not None and hit[0] is d:
      return hit[1]
    n = self.bucket_env.get(str(d))
    if n is None:
      n = self.dim_range(d)[1]
    self._padded[id(d)] = (d, n)
    return n

  def dim_range(self, d) -> tuple[int, int]:
    """Smallest and largest value of a dim over true sizes in ``[1, bucket]``: exact (by
    enumeration) when the dim has few possible inputs, else sound interval bounds."""
    if not is_dynamic_dim(d):
      return int(d), int(d)
    key = (d, self._box_key)
    hit = _BOUND_CACHE.get(key)
    if hit is None:
      names = sorted(jp.dim_expr_vars(d))
      if math.prod(self.box[v][1] for v in names) <= 4096:
        vals = [
          int(jp.eval_dim_expr(d, dict(zip(names, combo, strict=True))))
          for combo in itertools.product(*(range(1, self.box[v][1] + 1) for v in names))
        ]
        hit = (min(vals), max(vals))
      else:
        hit = jp.dim_interval(d, self.box)
      _BOUND_CACHE[key] = hit
    return hit

  def padded_shape(self, shape) -> tuple[int, ...]:
    return tuple([self.padded_dim(d) for d in shape])

  def true_dim(self, d):
    """The true size of a dim: a Python int when static, else a traced int32 scalar."""
    if not is_dynamic_dim(d):
      return int(d)
    # Cached for the trace it was computed in only: a rule of a loop or a branch interprets
    # its body in an inner trace, and a value of that trace used after it (``2*t`` first
    # needed in a loop body, then after the loop) would leak into the outer jaxpr.
    state = jex_core.get_opaque_trace_state()
    hit = self._true_cache.get(d)
    if hit is not None and hit[0] == state:
      return hit[1]
    val = jnp.asarray(jp.eval_dim_expr(d, self.sizes_env), jnp.int32)
    self._true_cache[d] = (state, val)
    return val

  def subst(self, obj):
    """Replaces every symbolic dim inside a (nested) parameter by its bucket value."""
    if isinstance(obj, tuple):
      items = [self.subst(o) for o in obj]
      return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
      return [self.subst(o) for o in obj]
    if has_dim_expr(obj):
      return self.padded_dim(obj)
    return obj

  def subst_params(self, params: dict) -> dict:
    return {k: self.subst(v) for k, v in params.items()}

  # -- masks ------------------------------------------------------------------------------
  def axis_valid(self, aval, axis: int, shape: Sequence[int] | None = None):
    """Boolean array (of the padded shape) true where index along ``axis`` < true extent."""
    shape = tuple(shape) if shape is not None else self.padded_shape(aval.shape)
    return lax.broadcasted_iota(jnp.int32, shape, axis) < self.true_dim(aval.shape[axis])

  def valid_mask(self, aval, axes: Sequence[int]):
    """Boolean mask of the valid prefix along ``axes`` (only dynamic ones count), or None."""
    shape = self.padded_shape(aval.shape)
    m = None
    for a in axes:
      if not is_dynamic_dim(aval.shape[a]):
        continue
      ma = self.axis_valid(aval, a, shape)
      m = ma if m is None else m & ma
    return m

  def mask(self, pv: PaddedValue, aval, axes: Sequence[int], identity, eqn=None, what=""):
    """The array of ``pv`` with its padded region along ``axes`` set to ``identity``."""
    dyn = [a for a in axes if is_dynamic_dim(aval.shape[a])]
    if not dyn:
      return pv.val
    if same_fill(pv.fill, identity) or (
        len(dyn) == 1 and sum_like(identity) and same_fill(pv.fill_along(dyn[0]), identity)):
      if eqn is not None:
        self.note(eqn, f"no mask needed on {what or 'operand'}: padded region already {identity}")
      return pv.val
    m = self.valid_mask(aval, dyn)
    if eqn is not None:
      names = ", ".join(f"{a}:{aval.shape[a]}" for a in dyn)
      self.note(eqn, f"masked {what or 'operand'} axes ({names}) with {identity}")
    return jnp.where(m, pv.val, jnp.asarray(identity, pv.val.dtype))

  def note(self, eqn, msg: str) -> None:
    if self.log is not None:
      name = eqn.primitive.name
      if isinstance(eqn.params.get("name"), str):
        name = f"{name}[{eqn.params['name']}]"
      line = f"{name} at {source_of(eqn)}: {msg}"
      if not self.log or self.log[-1] != line:
        self.log.append(line)


def sum_like(identity) -> bool:
  """Whether ``identity`` is a sum's (0): the only reductions that may trust ``axis_fill``
  (a NaN-row there gives NaN either way)."""
  try:
    return bool(np.asarray(identity) == 0) and np.asarray(identity).dtype != np.bool_
  except Exception:  # noqa: BLE001
    return False


def identity_for(kind: str, dtype):
  """The identity element of a reduction ``kind`` in ``dtype`` (a Python/NumPy scalar)."""
  dtype = np.dtype(dtype)
  if kind in ("sum", "or", "xor"):
    return False if dtype == np.bool_ else dtype.type(0)
  if kind == "prod" or kind == "and":
    return True if dtype == np.bool_ else dtype.type(1)
  if kind in ("max", "min"):
    if dtype == np.bool_:
      return kind == "min"
    if jnp.issubdtype(dtype, jnp.floating):
      return dtype.type(-np.inf if kind == "max" else np.inf)
    if jnp.issubdtype(dtype, jnp.integer):
      info = jnp.iinfo(dtype)
      return dtype.type(info.min if kind == "max" else info.max)
  raise TypeError(f"no {kind} identity for {dtype}")


# -- the interpreter ------------------------------------------------------------------------


def _live_eqns(jaxpr) -> list[bool]:
  live_vars = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
  live = [False] * len(jaxpr.eqns)
  for i in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[i]
    if eqn.effects or any(v in live_vars for v in eqn.outvars):
      live[i] = True
      live_vars.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
  return live


def bind_plain(eqn, args: list) -> list:
  """Binds an equation's primitive as ``eval_jaxpr`` does (no padding concerns)."""
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  out = eqn.primitive.bind(*args, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def interpret(ctx: Context, jaxpr, consts: Sequence[PaddedValue], args: Sequence[PaddedValue]):
  """Evaluates ``jaxpr`` on padded values; returns the padded values of its outputs."""
  env: dict[Any, PaddedValue] = {}

  def read(v) -> PaddedValue:
    if isinstance(v, jex_core.Literal):
      val = v.val
      if not hasattr(val, "astype"):
        val = np.asarray(val, v.aval.dtype)
      return PaddedValue(val)
    return env[v]

  def write(v, pv: PaddedValue) -> None:
    if not isinstance(v, jex_core.DropVar):
      env[v] = pv

  assert len(consts) == len(jaxpr.constvars) and len(args) == len(jaxpr.invars)
  for v, pv in zip(jaxpr.constvars, consts, strict=False):
    write(v, pv)
  for v, pv in zip(jaxpr.invars, args, strict=False):
    write(v, pv)
  eqns = jaxpr.eqns
  info = jaxpr_info(jaxpr)
  runs = info.runs(jaxpr)
  uses = None

  def one(eqn, touches) -> None:  # an equation by its rule (or as it is, if it is static)
    invals = [read(v) for v in eqn.invars]
    if not touches:
      outs = [PaddedValue(o) for o in bind_plain(eqn, [pv.val for pv in invals])]
    else:
      try:
        outs = _apply_rule(ctx, eqn, invals)
      except PaddingUnsupportedError as e:
        if ctx.problems is None:
          raise
        ctx.problems.extend(problems_of(e))
        outs = _placeholders(ctx, eqn, e)
    assert len(outs) == len(eqn.outvars), eqn
    for v, pv in zip(eqn.outvars, outs, strict=False):
      write(v, pv)

  skip_to = 0
  done = ()  # holes already interpreted, when their run went flat
  for i, (eqn, live, touches) in enumerate(zip(eqns, info.live, info.touches, strict=True)):
    if i < skip_to or i in done:
      continue
    run = runs.get(i) if runs else None
    if run is not None:  # a run of repeated blocks: each layer's own equations, then blocks
      for h in run.holes:
        if info.live[h]:
          one(eqns[h], info.touches[h])
      if _outline.call_run(ctx, run, env, write, interpret):
        skip_to = run.end
        continue
      done = set(run.holes)
    if not live:
      if touches:
        ctx.note(eqn, "left alone: its result cannot reach an output")
      continue
    fuse = FUSED.get(eqn.primitive) if touches else None
    if fuse is not None:
      if uses is None:
        uses = info.uses(jaxpr)
      fused = fuse(ctx, eqns, i, uses, read)
      if fused is not None:
        skip_to, outvar, pv = fused
        write(outvar, pv)
        continue
    one(eqn, touches)
  return [read(v) for v in jaxpr.outvars]


def _use_counts(jaxpr) -> dict:
  uses: dict = {}
  for e in jaxpr.eqns:
    for v in e.invars:
      if not isinstance(v, jex_core.Literal):
        uses[v] = uses.get(v, 0) + 1
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal):
      uses[v] = uses.get(v, 0) + 2  # an output is never an internal value of a chain
  return uses


def _apply_rule(ctx: Context, eqn, invals: list[PaddedValue]) -> list[PaddedValue]:
  rule = RULES.get(eqn.primitive)
  if rule is None:
    why = WHY_NO_RULE.get(eqn.primitive.name, "no rule is implemented for it")
    raise unsupported(eqn, f"it touches a dynamic axis: {why}")
  try:
    with enclosing(eqn):
      outs = rule(ctx, eqn, invals)
      shapes = [
        (ctx.padded_shape(v.aval.shape), tuple(np.shape(pv.val)))
        for v, pv in zip(eqn.outvars, outs, strict=True)
      ]
  except PaddingUnsupportedError:
    raise
  except Exception as e:  # a rule that cannot build its rewrite: fall back, never guess
    raise unsupported(
      eqn, f"its rule crashed ({type(e).__name__}: {e}), a dynjax bug: please report it"
    ) from e
  for want, got in shapes:
    if want != got:
      raise unsupported(eqn, f"padded result has shape {got}, expected {want}")
  return outs


def _placeholders(ctx: Context, eqn, err: PaddingUnsupportedError) -> list[PaddedValue]:
  """Garbage-padded zeros of the outputs' padded shapes, so that planning goes on past an
  equation it cannot pad (the plan is refused anyway); when they cannot be built (key
  arrays, tokens), the problems found so far are raised."""
  try:
    return [
      PaddedValue(jnp.zeros(ctx.padded_shape(v.aval.shape), v.aval.dtype)) for v in eqn.outvars
    ]
  except Exception:
    raise unsupported_all(ctx.problems) from err


def interpret_closed(ctx: Context, closed, args: Sequence[PaddedValue]) -> list[PaddedValue]:
  """Interprets a closed jaxpr, or an open one (no consts: its constvars come first in ``args``).

  jax >= 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (``consts`` attached, ``.jaxpr`` is itself);
  older open ``Jaxpr`` objects have neither attribute.
  """
  consts = [PaddedValue(c) for c in getattr(closed, "consts", ())]
  jaxpr = getattr(closed, "jaxpr", closed)
  if not consts and jaxpr.constvars:
    n = len(jaxpr.constvars)
    return interpret(ctx, jaxpr, list(args[:n]), list(args[n:]))
  return interpret(ctx, jaxpr, consts, args)


def register(*prims) -> Callable[[Rule], Rule]:
  def deco(rule: Rule) -> Rule:
    for p in prims:
      if p is not None:
        RULES[p] = rule
    return rule

  return deco


__all__ = [
  "RULES",
  "WHY_NO_RULE",
  "Context",
  "PaddedValue",
  "bind_plain",
  "common_fill",
  "same_fill",
  "dynamic_axes",
  "identity_for",
  "interpret",
  "interpret_closed",
  "is_dynamic_dim",
  "register",
  "problems_of",
  "unsupported",
  "unsupported_all",
]
