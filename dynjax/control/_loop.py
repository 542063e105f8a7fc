"""``dynjax.while_loop``: loops whose carry changes shape, hoisted into one XLA loop per bucket.

Build (once per body/cond/carry signature):

1. Find the dynamic axes.  With ``dims=None`` the body is run abstractly on the initial carry
   (``jax.eval_shape``); every axis whose size changes becomes a dimension variable (axes with the
   same initial size and the same change share one).  With ``dims=`` the caller names them.
2. Trace ``body_fun`` and ``cond_fun`` with ``jax.export`` symbolic shapes.  The output carry's
   dims are expressions of the variables (``t + 1``, ``2*t``); they give the *next sizes* as a
   function of the current ones.  A carry whose new shape cannot be written that way (it depends
   on data, an axis changes rank, two axes sharing a variable disagree) is a
   :class:`~dynjax.ControlFlowError` listing every offending leaf.
3. Per bucket, the padding pass (``dynjax.bucketing._padding.pad_jaxpr``) makes the body and
   cond exact on the padded carry, and a *hoisted* executable runs
   ``lax.while_loop(pred & next_sizes_fit_bucket, body)`` on the padded carry, the true sizes
   riding along as int32 scalars; a growing axis is a write at the true length.  It returns the
   carry and a status vector ``[pred, sizes..., iterations]``.  Carry buffers are donated.

Run (the VM program, see ``as_text()``): pick the bucket of the initial sizes, repad, then loop
``invoke hoisted[bucket]; read status; if pred: repad to the next bucket, goto loop``.  The host
reads ONE small status vector per bucket visited: host syncs = buckets crossed + 1.  Finally the
carry is unpadded to its exact shapes (small leaves via the host, no compile).

When the padding pass cannot make the body exact (or ``padding="exact"``), the loop runs in
exact mode: one executable per exact shape (compiled on first use, cached by ``jax.jit``), one
host sync per iteration for the predicate.  ``loop_stats()["mode"]`` says which ran and why.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export, lax

from dynjax._errors import ControlFlowError, PaddingUnsupportedError, format_list
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.control._frontend import any_tracer, building, needs_vm
from dynjax.runtime import VM, Kernel, ProgramBuilder
from dynjax.runtime._vm import _fit
from dynjax.runtime._vm import record as _record_stats

try:  # the padding pass (issue 3); without it loops run in exact mode
  from dynjax.bucketing._padding import pad_jaxpr as _pad_jaxpr
except ImportError:  # pragma: no cover - depends on the padding pass being present
  _pad_jaxpr = None

_DEFAULT_POLICY = pow2(min=16)

# Evaluating dim expressions (jax prints them with these helpers) on host ints / traced int32.
_HOST_NS = {"floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "max": max, "min": min,
            "non_negative": lambda a: max(a, 0), "__builtins__": {}}
_DEV_NS = {"floordiv": jnp.floor_divide, "mod": jnp.mod, "max": jnp.maximum,
           "min": jnp.minimum, "non_negative": lambda a: jnp.maximum(a, 0), "__builtins__": {}}


def _compile_exprs(exprs: list[str], var_order: tuple[str, ...], ns: dict) -> Callable:
  src = f"lambda {', '.join(var_order)}: ({', '.join(exprs)},)" if var_order else "lambda: ()"
  return eval(src, dict(ns))  # noqa: S307 - text from jax's own printer of dim expressions


def _is_sym(d) -> bool:
  return not isinstance(d, int | np.integer)


def _keypaths(treedef) -> list[str]:
  dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  return [("init" + jax.tree_util.keystr(p)) for p, _ in
          jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _trace_symbolic(part: str, fn, sym_avals):
  """``make_jaxpr`` of the loop's body or cond over symbolic carries, errors named for the user."""
  try:
    with building(f"while_loop {part}"):
      return jax.make_jaxpr(fn)(*sym_avals)
  except ControlFlowError:
    raise
  except Exception as e:
    raise _trace_error(f"{part}_fun", e) from None


def _trace_error(what: str, e: Exception) -> ControlFlowError:
  first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  if isinstance(e, jax.errors.ConcretizationTypeError | jax.errors.TracerBoolConversionError
                | jax.errors.TracerIntegerConversionError | jax.errors.NonConcreteBooleanIndexError):
    return ControlFlowError(
        f"{what} makes a shape depend on data values ({type(e).__name__}: {first}). "
        "dynjax.while_loop needs every carry dim to be a function of the carry's dims (e.g. "
        "t + 1), not of array contents; give such ops a static size (jnp.nonzero(x, size=n)), "
        "or move the data-dependent part into cond_fun.")
  if type(e).__name__ == "InconclusiveDimensionOperation":
    return ControlFlowError(
        f"{what} compares a dynamic carry dim in Python ({first}). With shapes that change, "
        "dims are symbolic while dynjax traces the loop: write the comparison as an array "
        "op, e.g. jnp.asarray(x.shape[0]) < 8 instead of x.shape[0] < 8.")
  return ControlFlowError(f"{what} could not be traced with symbolic dims: "
                          f"{type(e).__name__}: {first}")


@dataclasses.dataclass
class _LoopSpec:
  """Everything traced once per (cond, body, carry signature)."""

  treedef: Any
  paths: list[str]
  dtypes: list
  var_order: tuple[str, ...]
  leaf_dims: list[tuple]  # per leaf: per axis an int or a var name
  solve: list[tuple[int, int, int]]  # (leaf, axis, var index) to read sizes from shapes
  next_exprs: list[str]  # per var: the expression of its next size
  body_cj: Any  # closed jaxpr, constvars turned into leading invars
  body_consts: list
  cond_cj: Any
  cond_consts: list
  policies: list[BucketPolicy]
  padding: str
  cond_fun: Callable
  body_fun: Callable
  next_host: Callable = None
  next_dev: Callable = None
  hoisted: Kernel = None
  exact_body: Kernel = None
  exact_cond: Kernel = None
  programs: dict = dataclasses.field(default_factory=dict)
  fallback_reason: str | None = None
  rewrites: list = dataclasses.field(default_factory=list)


def _hoist_consts(closed):
  j = closed.jaxpr
  j2 = j.replace(constvars=[], invars=list(j.constvars) + list(j.invars))
  return jax.extend.core.ClosedJaxpr(j2, []), list(closed.consts)


def _auto_dims(body_flat, avals, paths) -> tuple[list[tuple], list[str]]:
  """Per leaf the axes that change (as var names) -- from one abstract concrete step."""
  try:
    with building("while_loop body"):
      outs = jax.eval_shape(body_flat, *avals)
  except ControlFlowError:
    raise
  except Exception as e:
    raise _trace_error("body_fun", e) from None
  _check_structure("body_fun", avals, outs, None, None, paths)
  groups: dict[tuple[int, int], str] = {}
  dims = []
  for a, o in zip(avals, outs, strict=True):
    per = []
    for d_in, d_out in zip(a.shape, o.shape, strict=False):
      if d_in == d_out:
        per.append(int(d_in))
      else:
        name = groups.setdefault((d_in, d_out), f"n{len(groups)}")
        per.append(name)
    dims.append(tuple(per))
  return dims, sorted(set(groups.values()), key=lambda s: int(s[1:]))


def _check_structure(what, avals_in, outs, treedef, out_tree, paths) -> None:
  if out_tree != treedef:
    raise ControlFlowError(f"{what} must return a carry with the structure of init: expected "
                           f"{treedef}, got {out_tree}")
  bad = []
  for p, a, o in zip(paths, avals_in, outs, strict=True):
    if jnp.dtype(a.dtype) != jnp.dtype(o.dtype):
      bad.append(f"{p}: dtype {jnp.dtype(a.dtype).name} -> {jnp.dtype(o.dtype).name}")
    if len(a.shape) != len(o.shape):
      bad.append(f"{p}: rank {len(a.shape)} -> {len(o.shape)} (shape {tuple(a.shape)} -> "
                 f"{tuple(o.shape)})")
  if bad:
    raise ControlFlowError(
        f"{what} changes the carry in ways dims cannot express:\n" + format_list(bad)
        + "\nA carry leaf may change its sizes along axes, but not its dtype or rank.")


def _build_spec(cond_fun, body_fun, treedef, avals, dims, buckets, padding) -> _LoopSpec:
  paths = _keypaths(treedef)

  def body_flat(*leaves):
    out = body_fun(jax.tree_util.tree_unflatten(treedef, leaves))
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    if out_tree != treedef:
      raise ControlFlowError(f"body_fun must return a carry with the structure of init: "
                             f"expected {treedef}, got {out_tree}")
    return out_leaves

  def cond_flat(*leaves):
    return cond_fun(jax.tree_util.tree_unflatten(treedef, leaves))

  # 1. which axes are dynamic
  if dims is None:
    leaf_dims, var_order = _auto_dims(body_flat, avals, paths)
  else:
    leaf_dims, var_order = _explicit_dims(dims, treedef, avals, paths)
  var_order = tuple(var_order)
  # 2. symbolic trace
  sym = export.symbolic_shape(", ".join(var_order)) if var_order else ()
  sym_of = dict(zip(var_order, sym, strict=True))
  sym_avals = [jax.ShapeDtypeStruct(tuple(sym_of[d] if isinstance(d, str) else d for d in ld),
                                    a.dtype) for ld, a in zip(leaf_dims, avals, strict=True)]
  body_closed = _trace_symbolic("body", body_flat, sym_avals)
  cond_closed = _trace_symbolic("cond", cond_flat, sym_avals)
  outs = body_closed.out_avals
  _check_structure("body_fun", sym_avals, outs, treedef, treedef, paths)
  (pa,) = cond_closed.out_avals if len(cond_closed.out_avals) == 1 else (None,)
  if pa is None or tuple(pa.shape) != () or not (jnp.issubdtype(pa.dtype, jnp.bool_)
                                                 or jnp.issubdtype(pa.dtype, jnp.integer)):
    raise ControlFlowError(
        f"cond_fun must return one scalar boolean, got {cond_closed.out_avals}")
  # 3. next sizes: each variable's new value, consistently across every axis that uses it
  next_of: dict[str, str] = {}
  where_of: dict[str, str] = {}
  bad = []
  for p, ld, o in zip(paths, leaf_dims, outs, strict=True):
    for ax, (d_in, d_out) in enumerate(zip(ld, o.shape, strict=True)):
      if isinstance(d_in, str):
        text = str(d_out)
        prev = next_of.setdefault(d_in, text)
        where_of.setdefault(d_in, f"{p}.shape[{ax}]")
        if prev != text:
          bad.append(f"{p}.shape[{ax}]: {d_in} -> {text}, but {where_of[d_in]}: {d_in} -> "
                     f"{prev}; axes sharing a dimension must change alike")
      elif _is_sym(d_out):
        bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out} (a fixed axis whose new size depends "
                   "on other dims); declare it dynamic with dims=")
      elif int(d_out) != int(d_in):
        bad.append(f"{p}.shape[{ax}]: {d_in} -> {d_out}")
  if bad:
    raise ControlFlowError(
        "body_fun changes the carry's shape in a way its dims cannot express:\n"
        + format_list(bad)
        + "\nEach dynamic axis must become an expression of the carry's dims (e.g. t + 1).")
  for v in var_order:
    txt = next_of.get(v, v)
    if re.search(r"[A-Za-z_]\w*", txt) and not set(re.findall(r"[A-Za-z_]\w*", txt)) <= (
        set(var_order) | {"floordiv", "mod", "max", "min", "non_negative"}):
      raise ControlFlowError(f"next size of {v} is {txt}, which uses unknown names")
  next_exprs = [next_of.get(v, v) for v in var_order]
  solve = []
  for li, ld in enumerate(leaf_dims):
    for ax, d in enumerate(ld):
      if isinstance(d, str):
        solve.append((li, ax, var_order.index(d)))
  policies = _policies(buckets, var_order)
  bcj, bconsts = _hoist_consts(body_closed)
  ccj, cconsts = _hoist_consts(cond_closed)
  if any_tracer(bconsts) or any_tracer(cconsts):
    raise needs_vm("while_loop", "body_fun/cond_fun close over JAX tracers")
  spec = _LoopSpec(treedef, paths, [a.dtype for a in avals], var_order, leaf_dims, solve,
                   next_exprs, bcj, bconsts, ccj, cconsts, policies, padding, cond_fun, body_fun)
  spec.next_host = _compile_exprs(next_exprs, var_order, _HOST_NS)
  spec.next_dev = _compile_exprs(next_exprs, var_order, _DEV_NS)
  spec.hoisted = Kernel("while.hoisted", lambda key: _build_hoisted(spec, key),
                        lambda key: f"bucket={dict(zip(var_order, key, strict=True))}")
  spec.exact_body = Kernel("while.body_exact", lambda key: jax.jit(body_flat),
                           lambda key: "exact")
  spec.exact_cond = Kernel("while.cond_exact", lambda key: jax.jit(
      lambda *xs: (jnp.asarray(cond_flat(*xs)),)), lambda key: "exact")
  return spec


def _explicit_dims(dims, treedef, avals, paths):
  try:
    specs = treedef.flatten_up_to(dims) if treedef.num_leaves != 1 or not isinstance(
        dims, str | type(None)) else [dims]
  except (ValueError, TypeError) as e:
    raise ControlFlowError(f"dims must match the structure of init ({treedef}): {e}") from None
  leaf_dims, names, bad = [], set(), []
  for p, s, a in zip(paths, specs, avals, strict=True):
    if s is None:
      leaf_dims.append(tuple(int(d) for d in a.shape))
      continue
    parts = [x.strip() for x in s.split(",") if x.strip()]
    if len(parts) != len(a.shape):
      bad.append(f"{p}: spec {s!r} has {len(parts)} axes, the array has shape {tuple(a.shape)}")
      leaf_dims.append(tuple(int(d) for d in a.shape))
      continue
    per = []
    for ax, (t, n) in enumerate(zip(parts, a.shape, strict=True)):
      if t.isdigit():
        if int(t) != n:
          bad.append(f"{p}.shape[{ax}]: spec says {t}, got {n}")
        per.append(int(t))
      elif re.fullmatch(r"[A-Za-z_]\w*", t):
        per.append(t)
        names.add(t)
      else:
        bad.append(f"{p}.shape[{ax}]: {t!r}: a carry axis must be a name or an integer")
        per.append(int(n))
    leaf_dims.append(tuple(per))
  if bad:
    raise ControlFlowError("dims do not fit init:\n" + format_list(bad))
  return leaf_dims, sorted(names)


def _policies(buckets, var_order) -> list[BucketPolicy]:
  if buckets is None:
    return [_DEFAULT_POLICY] * len(var_order)
  if isinstance(buckets, Mapping):
    unknown = sorted(set(buckets) - set(var_order))
    if unknown:
      raise ControlFlowError(f"buckets names {unknown}, which are not carry dims {var_order}")
    return [as_policy(buckets[v], f"[{v!r}]") if v in buckets else _DEFAULT_POLICY
            for v in var_order]
  pol = as_policy(buckets, "")
  return [pol] * len(var_order)


def _bucket_for(spec: _LoopSpec, sizes) -> tuple[int, ...]:
  out = []
  for p, n in zip(spec.policies, sizes, strict=True):
    b = p.bucket(n)
    out.append(p.grow(n) if b is None else b)
  return tuple(out)


def _padded_shapes(spec: _LoopSpec, sizes) -> tuple[tuple[int, ...], ...]:
  env = dict(zip(spec.var_order, sizes, strict=True))
  return tuple(tuple(env[d] if isinstance(d, str) else d for d in ld) for ld in spec.leaf_dims)


def _build_hoisted(spec: _LoopSpec, bucket: tuple[int, ...]):
  env = dict(zip(spec.var_order, bucket, strict=True))
  body_plan = _pad_jaxpr(spec.body_cj, spec.var_order, env)
  cond_plan = _pad_jaxpr(spec.cond_cj, spec.var_order, env)
  spec.rewrites = list(body_plan.rewrites) + list(cond_plan.rewrites)
  shapes = _padded_shapes(spec, bucket)
  nb, nc, nv = len(spec.body_consts), len(spec.cond_consts), len(spec.var_order)
  limit = jnp.asarray(bucket, jnp.int32) if nv else None
  next_dev = spec.next_dev

  def pred_of(sizes, cconsts, carry):
    (p,) = cond_plan.fun(tuple(sizes), *cconsts, *carry)
    return jnp.asarray(p).astype(jnp.bool_)

  def run(*args):
    bconsts, cconsts = args[:nb], args[nb:nb + nc]
    sizes0, carry0 = args[nb + nc], args[nb + nc + 1:]
    s0 = tuple(sizes0[i] for i in range(nv))

    def fits(s):
      if not nv:
        return jnp.bool_(True)
      ns = jnp.stack([jnp.asarray(x, jnp.int32) for x in next_dev(*s)])
      return jnp.all(ns <= limit)

    def c(state):
      s, _, p, _ = state
      return p & fits(s)

    def b(state):
      s, carry, _, it = state
      out = body_plan.fun(tuple(s), *bconsts, *carry)
      out = tuple(_fit(o, shp).astype(o.dtype) for o, shp in zip(out, shapes, strict=True))
      ns = tuple(jnp.asarray(x, jnp.int32) for x in next_dev(*s))
      return ns, out, pred_of(ns, cconsts, out), it + 1

    state = (s0, tuple(carry0), pred_of(s0, cconsts, carry0), jnp.int32(0))
    s, carry, p, it = lax.while_loop(c, b, state)
    status = jnp.stack([p.astype(jnp.int32), *[jnp.asarray(x, jnp.int32) for x in s], it])
    return (*carry, status)

  carry_pos = tuple(range(nb + nc + 1, nb + nc + 1 + len(shapes)))
  return jax.jit(run, donate_argnums=carry_pos)


class _Loop:
  """A built loop: its spec and its two VM programs (hoisted, exact)."""

  def __init__(self, spec: _LoopSpec):
    self.spec = spec
    self.mode = "hoisted"
    if spec.padding == "exact":
      self.mode, spec.fallback_reason = "exact", 'padding="exact"'
    elif _pad_jaxpr is None:
      self.mode, spec.fallback_reason = "exact", "the padding pass is not available"
    self._vms: dict[str, VM] = {}

  def vm(self, mode: str) -> VM:
    v = self._vms.get(mode)
    if v is None:
      prog = (_hoisted_program if mode == "hoisted" else _exact_program)(self.spec)
      v = self._vms[mode] = VM(prog)
    return v

  def run(self, leaves: list) -> list:
    spec = self.spec
    consts = [*spec.body_consts, *spec.cond_consts]
    if self.mode == "hoisted":
      try:
        vm = self.vm("hoisted")
        outs = vm.run(*consts, *leaves)
      except PaddingUnsupportedError as e:
        self.mode = "exact"
        spec.fallback_reason = f"padding pass: {str(e).splitlines()[0]}"
        return self.run(leaves)
    else:
      vm = self.vm("exact")
      outs = vm.run(*consts, *leaves)
    st = vm.take_stats()
    info = dict(mode=self.mode, host_syncs=st.host_syncs, invokes=st.invokes,
                repads=st.repads, compiles=st.compiles, instructions=st.instructions)
    if self.mode == "hoisted":
      info.update(_LAST_RUN.pop("info", {}))
    else:
      info["iterations"] = st.invokes // 2
      info["buckets"] = []
      info["fallback"] = spec.fallback_reason
    info["buckets_crossed"] = max(0, len(info["buckets"]) - 1)
    st.loops.append(info)
    _LAST_RUN["loop"] = info
    _record_stats(st)
    return list(outs)


_LAST_RUN: dict = {}


def _hoisted_program(spec: _LoopSpec):
  nb, nc, n = len(spec.body_consts), len(spec.cond_consts), len(spec.leaf_dims)
  b = ProgramBuilder("while_loop", nb + nc + n,
                     [f"bc{i}" for i in range(nb)] + [f"cc{i}" for i in range(nc)]
                     + [f"carry{i}" for i in range(n)])
  consts, carry = b.args[:nb + nc], b.args[nb + nc:]
  solve = spec.solve
  nv = len(spec.var_order)
  info: dict = {}

  def sizes_of(*xs):
    sizes = [0] * nv
    for li, ax, vi in solve:
      sizes[vi] = xs[li].shape[ax]
    info.clear()
    info.update(iterations=0, buckets=[])
    _LAST_RUN["info"] = info
    return tuple(sizes)

  def bucket_of(sizes):
    bk = _bucket_for(spec, sizes)
    info["buckets"].append(bk)
    return bk

  def shapes_of(bucket):
    return _padded_shapes(spec, bucket)

  def sizes_array(sizes):
    return np.asarray(sizes, np.int32).reshape(nv)

  def keep_going(status):
    info["iterations"] += int(status[-1])
    return bool(status[0])

  def grow_sizes(status):
    cur = tuple(int(x) for x in status[1:1 + nv])
    nxt = tuple(int(x) for x in spec.next_host(*cur))
    return tuple(max(a, c) for a, c in zip(cur, nxt, strict=True)), cur

  def first(pair):
    return pair[0]

  def second(pair):
    return pair[1]

  def final_shapes(status):
    return _padded_shapes(spec, tuple(int(x) for x in status[1:1 + nv]))

  sizes = b.emit_host_op(sizes_of, carry)
  bk = b.emit_host_op(bucket_of, [sizes])
  shp = b.emit_host_op(shapes_of, [bk])
  b.emit_repad(carry, shp, dsts=carry)
  sz = b.emit_host_op(sizes_array, [sizes])
  status = b.new_reg("status")
  status_h = b.new_reg("st")
  b.block("loop")
  b.emit_invoke_into(spec.hoisted, None, [*consts, sz, *carry], [*carry, status], key_reg=bk)
  b.emit_read_scalar(status, dst=status_h)
  go = b.emit_host_op(keep_going, [status_h])
  b.emit_if(go, "grow", "done")
  b.block("grow")
  pair = b.emit_host_op(grow_sizes, [status_h])
  need = b.emit_host_op(first, [pair])
  b.emit_host_op(bucket_of, [need], dst=bk)
  b.emit_host_op(shapes_of, [bk], dst=shp)
  b.emit_repad(carry, shp, dsts=carry)
  cur = b.emit_host_op(second, [pair])
  b.emit_host_op(sizes_array, [cur], dst=sz)
  b.emit_goto("loop")
  b.block("done")
  fs = b.emit_host_op(final_shapes, [status_h])
  out = b.emit_unpad(carry, fs)
  b.emit_ret(out)
  return b.finish()


def _exact_program(spec: _LoopSpec):
  nb, nc, n = len(spec.body_consts), len(spec.cond_consts), len(spec.leaf_dims)
  b = ProgramBuilder("while_loop.exact", nb + nc + n,
                     [f"bc{i}" for i in range(nb)] + [f"cc{i}" for i in range(nc)]
                     + [f"carry{i}" for i in range(n)])
  carry = b.args[nb + nc:]
  key = b.new_reg("shapes")
  pred = b.new_reg("pred")
  ph = b.new_reg("pred_h")
  b.block("loop")
  b.emit_host_op(_shapes_key, carry, dst=key)
  b.emit_invoke_into(spec.exact_cond, None, carry, [pred], key_reg=key)
  b.emit_read_scalar(pred, dst=ph)
  b.emit_if(ph, "body", "done")
  b.block("body")
  b.emit_invoke_into(spec.exact_body, None, carry, carry, key_reg=key)
  b.emit_goto("loop")
  b.block("done")
  b.emit_ret(carry)
  return b.finish()


def _shapes_key(*xs):
  return tuple(x.shape for x in xs)


# -- cache of built loops --------------------------------------------------------------------
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_MAX = 64


def _get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding) -> _Loop:
  dkey = None if dims is None else repr(dims)
  bkey = repr(buckets)
  key = (cond_fun, body_fun, treedef, tuple((tuple(a.shape), str(a.dtype)) for a in avals),
         dkey, bkey, padding)
  loop = _CACHE.get(key)
  if loop is None:
    loop = _Loop(_build_spec(cond_fun, body_fun, treedef, avals, dims, buckets, padding))
    _CACHE[key] = loop
    if len(_CACHE) > _CACHE_MAX:
      _CACHE.popitem(last=False)
  else:
    _CACHE.move_to_end(key)
  return loop


def while_loop(cond_fun: Callable, body_fun: Callable, init_val, *, dims=None,
               buckets: BucketPolicy | Mapping[str, Any] | list | None = None,
               padding: str = "auto"):
  """``lax.while_loop`` whose carry may change shape from one iteration to the next.

  While the carry stays inside its bucket, iterations run inside ONE compiled
  ``lax.while_loop`` on the padded carry; the host syncs once per bucket visited (see the module
  docstring).  ``cond_fun`` may depend on device values.

  Args:
    cond_fun: ``carry -> bool scalar``.
    body_fun: ``carry -> carry``; leaves keep dtype and rank, sizes may change along axes as
      expressions of the carry's sizes (``t -> t + 1``).
    init_val: the initial carry (a pytree of arrays).
    dims: ``None`` (axes that change are found automatically) or a pytree like ``init_val``
      of spec strings (``"b, t"``) / ``None`` naming the dynamic axes.
    buckets: one policy for every dim, or ``{name: policy}`` (default ``pow2(min=16)``).
    padding: ``"auto"`` (hoisted, exact through the padding pass; exact mode when it cannot)
      or ``"exact"`` (one executable per exact shape, one host sync per iteration).

  Returns:
    The final carry, exact shapes.

  Example:
    >>> out = dynjax.while_loop(lambda c: c[-1] < 5,
    ...                         lambda c: jnp.concatenate([c, c[-1:] + 1]), jnp.zeros(1))
    >>> out
    Array([0., 1., 2., 3., 4., 5.], dtype=float32)
  """
  if padding not in ("auto", "exact"):
    raise ControlFlowError(f'padding must be "auto" or "exact", got {padding!r}')
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  if any_tracer(leaves):
    return _traced_while(cond_fun, body_fun, init_val, leaves, treedef)
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  loop = _get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding)
  return jax.tree_util.tree_unflatten(treedef, loop.run(leaves))


def _traced_while(cond_fun, body_fun, init_val, leaves, treedef):
  try:
    out = jax.eval_shape(body_fun, init_val)
  except Exception as e:
    raise _trace_error("body_fun", e) from None
  out_leaves, out_tree = jax.tree_util.tree_flatten(out)
  changed = []
  if out_tree == treedef:
    for p, a, o in zip(_keypaths(treedef), leaves, out_leaves, strict=True):
      if tuple(a.shape) != tuple(o.shape) or jnp.dtype(a.dtype) != jnp.dtype(o.dtype):
        changed.append(f"{p}: {tuple(a.shape)} -> {tuple(o.shape)}")
  else:
    changed.append(f"structure {treedef} -> {out_tree}")
  if not changed:
    return lax.while_loop(cond_fun, body_fun, init_val)  # shape-invariant: plain XLA loop
  raise needs_vm("while_loop", "its carry changes shape (" + "; ".join(changed) + ")")


def loop_stats() -> dict:
  """What the last ``while_loop`` of this thread did: mode, iterations, host syncs, buckets.

  Example:
    >>> _ = dynjax.while_loop(lambda c: jnp.asarray(c.shape[0]) < 40,
    ...                       lambda c: jnp.concatenate([c, c[:1]]), jnp.zeros(1))
    >>> dynjax.control.loop_stats()["host_syncs"]
    3
  """
  return dict(_LAST_RUN.get("loop", {}))


def loop_program(cond_fun, body_fun, init_val, *, dims=None, buckets=None,
                 padding: str = "auto") -> str:
  """The VM program ``while_loop`` runs for these arguments, as text (builds, runs nothing)."""
  leaves, treedef = jax.tree_util.tree_flatten(init_val)
  avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
  loop = _get_loop(cond_fun, body_fun, treedef, avals, dims, buckets, padding)
  return loop.vm(loop.mode).program.as_text()
