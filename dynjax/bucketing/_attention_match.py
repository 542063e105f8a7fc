"""The attention matcher: a flat view of a jaxpr and the scaled-dot-product pattern in it.

See ``_attention.py`` for the rewrite it serves.  :func:`flatten` inlines ``jit``/
``closed_call``/``custom_jvp_call``/``custom_vjp_call`` bodies into one list of nodes (the pattern
crosses ``jnp.where``'s and ``jax.nn.softmax``'s own sub-jaxprs); :func:`find` tries every
``dot_general`` as the weights-by-values product of an attention (:func:`match_site` walks back
through the softmax, mask, bias and scale to the q.k product) and returns the matches and one
``explain()`` line per site, rewritten or not and why.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from dynjax.bucketing import _flash
from dynjax.bucketing._padding_core import is_dynamic_dim, source_of

_INLINE = {P.jit_p, P.closed_call_p, P.custom_jvp_call_p, P.custom_vjp_call_p}


# -- a flat view of a jaxpr ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Lit:
  """A constant operand: a jaxpr literal or a closed-over constant."""

  val: Any


@dataclasses.dataclass(eq=False)
class Node:
  eqn: Any  # the original equation: primitive, params, source
  ins: list  # int refs or Lit
  outs: list  # int refs (None for a dropped output)


@dataclasses.dataclass
class Flat:
  nodes: list
  invars: list
  outvars: list  # int refs or Lit
  avals: dict  # ref -> aval
  producer: dict = dataclasses.field(default_factory=dict)  # ref -> Node
  users: dict = dataclasses.field(default_factory=dict)  # ref -> list of Node

  def index(self) -> None:
    for n in self.nodes:
      for r in n.outs:
        if r is not None:
          self.producer[r] = n
      for r in n.ins:
        if not isinstance(r, Lit):
          self.users.setdefault(r, []).append(n)


def _sub_jaxpr(eqn):
  p = eqn.params
  closed = p.get("jaxpr", p.get("call_jaxpr"))
  if closed is None:
    return None
  return getattr(closed, "jaxpr", closed), list(getattr(closed, "consts", ()))


def flatten(closed) -> Flat:
  """One list of nodes: call-like sub-jaxprs inlined (their derivatives were already traced)."""
  jaxpr = getattr(closed, "jaxpr", closed)
  consts = list(getattr(closed, "consts", ()))
  counter = itertools.count()
  nodes: list = []
  avals: dict = {}

  def new(aval):
    r = next(counter)
    avals[r] = aval
    return r

  def read(env, v):
    return Lit(v.val) if isinstance(v, jex_core.Literal) else env[v]

  def walk(jx, env):
    for eqn in jx.eqns:
      ins = [read(env, v) for v in eqn.invars]
      sub = _sub_jaxpr(eqn) if eqn.primitive in _INLINE else None
      if sub is not None and len(sub[0].invars) == len(ins) and len(sub[0].constvars) == len(
          sub[1]):
        inner, inner_consts = sub
        ienv = {cv: Lit(c) for cv, c in zip(inner.constvars, inner_consts, strict=True)}
        ienv.update(zip(inner.invars, ins, strict=True))
        walk(inner, ienv)
        for ov, iv in zip(eqn.outvars, inner.outvars, strict=True):
          env[ov] = read(ienv, iv)
        continue
      outs = []
      for ov in eqn.outvars:
        r = new(ov.aval)
        outs.append(r)
        env[ov] = r
      nodes.append(Node(eqn, ins, outs))

  env: dict = {cv: Lit(c) for cv, c in zip(jaxpr.constvars, consts, strict=False)}
  invars = [new(v.aval) for v in jaxpr.invars]
  env.update(zip(jaxpr.invars, invars, strict=True))
  walk(jaxpr, env)
  flat = Flat(nodes, invars, [read(env, v) for v in jaxpr.outvars], avals)
  flat.index()
  return flat


# -- matching --------------------------------------------------------------------------------
@dataclasses.dataclass
class Match:
  """One attention site: where q, k, v, mask and bias come from and how to lay them out."""

  anchor: Node  # the weights-by-values dot_general, replaced
  eliminated: set  # nodes between the two dots (not evaluated)
  q: Any
  k: Any
  v: Any
  q_perm: tuple  # q axes -> B T N H (N absent for one-batch-dim attention)
  k_perm: tuple
  v_perm: tuple
  out_roles: tuple  # roles of the anchor's output axes, e.g. ("B", "N", "T", "H")
  heads: bool  # False: one batch dim, no head axis (N = 1 is inserted)
  scale: float
  mask: Any = None  # (ref, small shape in BNTS, transpose perm into BNTS, negate)
  bias: Any = None  # (ref, small shape in BNTS, perm)
  dtype: Any = None
  head_dim: int = 0
  where: str = ""
  impl: str = "xla"


class NoMatch(Exception):  # noqa: N818  (a control-flow signal, never raised to users)
  pass


def _prim(flat: Flat, ref, *names):
  """The node producing ``ref`` if its primitive is one of ``names``, else None."""
  if isinstance(ref, Lit):
    return None
  n = flat.producer.get(ref)
  if n is not None and n.eqn.primitive.name in names:
    return n
  return None


def _const(flat: Flat, ref):
  """The scalar a constant operand holds (through converts and broadcasts), else None."""
  for _ in range(8):
    if isinstance(ref, Lit):
      a = np.asarray(ref.val)
      if a.size == 1 and a.dtype != object:
        return float(np.asarray(a, np.float64).reshape(()))
      if a.size and a.dtype != object and np.all(a == a.reshape(-1)[0]):
        return float(np.asarray(a, np.float64).reshape(-1)[0])
      return None
    n = _prim(flat, ref, "convert_element_type", "broadcast_in_dim", "reshape")
    if n is None:
      return None
    ref = n.ins[0]
  return None


def _through(flat: Flat, ref, names, chain):
  """Follows producers of ``ref`` while they are single-input ops in ``names``."""
  while True:
    n = _prim(flat, ref, *names)
    if n is None:
      return ref
    chain.append(n)
    ref = n.ins[0]


def _keepdims_of(flat, ref, axis, chain):
  """``ref`` = broadcast_in_dim(x) re-inserting ``axis`` of a reduction over it: x's ref."""
  n = _prim(flat, ref, "broadcast_in_dim")
  if n is None:
    raise NoMatch("softmax: expected a keepdims broadcast")
  rank = len(n.eqn.params["shape"])
  if tuple(n.eqn.params["broadcast_dimensions"]) != tuple(i for i in range(rank) if i != axis):
    raise NoMatch("softmax: reduction broadcast back along another axis")
  chain.append(n)
  return n.ins[0]


def _softmax(flat: Flat, w_ref, chain):
  """Matches a softmax producing ``w_ref``: returns (its input ref, its axis)."""
  div = _prim(flat, w_ref, "div")
  if div is None:
    raise NoMatch("no softmax: the weights are not exp(x - max) / sum")
  chain.append(div)
  e_ref, den = div.ins
  exp = _prim(flat, e_ref, "exp")
  if exp is None:
    raise NoMatch("no softmax: numerator is not exp")
  chain.append(exp)
  sub = _prim(flat, exp.ins[0], "sub")
  if sub is None:
    raise NoMatch("no softmax: exp of something other than x - max")
  chain.append(sub)
  x_ref, m_ref = sub.ins
  den = _through(flat, den, ("convert_element_type",), chain)
  bsum = _prim(flat, den, "broadcast_in_dim")
  rsum = None if bsum is None else _prim(flat, bsum.ins[0], "reduce_sum")
  if rsum is None or len(rsum.eqn.params["axes"]) != 1:
    raise NoMatch("no softmax: the denominator is not a sum over one axis")
  axis = rsum.eqn.params["axes"][0]
  _keepdims_of(flat, den, axis, chain)
  chain.append(rsum)
  if _through(flat, rsum.ins[0], ("convert_element_type",), chain) != e_ref:
    raise NoMatch("no softmax: the denominator sums something else")
  m_ref = _through(flat, m_ref, ("stop_gradient",), chain)
  m_ref = _keepdims_of(flat, m_ref, axis, chain)
  mx = _prim(flat, m_ref, "max")
  if mx is not None:  # max(-inf, reduce_max(x)): the ``initial`` of jnp.max
    a, b = mx.ins
    other = b if _const(flat, a) == -math.inf else a if _const(flat, b) == -math.inf else None
    if other is None:
      raise NoMatch("no softmax: max with a finite constant")
    chain.append(mx)
    m_ref = other
  rmax = _prim(flat, m_ref, "reduce_max")
  if rmax is None or tuple(rmax.eqn.params["axes"]) != (axis,) or rmax.ins[0] != x_ref:
    raise NoMatch("no softmax: x - max(x) over another axis or another x")
  chain.append(rmax)
  return x_ref, axis


def _small(flat: Flat, ref):
  """(source ref, keepdims shape): ``reshape(source, shape)`` broadcasts to ``ref``'s value,
  through any chain of ``broadcast_in_dim`` (a ``[b, s]`` key mask under ``[b, h, t, s]``)."""
  shape = tuple(flat.avals[ref].shape)
  n = _prim(flat, ref, "broadcast_in_dim")
  if n is None or isinstance(n.ins[0], Lit):
    return ref, shape
  src_ref, src_small = _small(flat, n.ins[0])
  out = [1] * len(shape)
  for i, d in enumerate(n.eqn.params["broadcast_dimensions"]):
    out[d] = src_small[i]
  return src_ref, tuple(out)


def _default_precision(prec) -> bool:
  """Whether a dot's precision is what ``precision=None`` gives under the current config
  (``jax_default_matmul_precision`` is written into the equation at trace time), i.e. what
  ``dot_product_attention``'s own float32 dots get."""
  if prec is None:
    return True
  items = prec if isinstance(prec, tuple | list) else (prec,)
  if all(p is None or p == jax.lax.Precision.DEFAULT for p in items):
    return True
  return prec == _config_precision()


def _config_precision():
  a = jax.ShapeDtypeStruct((2, 2), jnp.float32)
  closed = jax.make_jaxpr(lambda x, y: jax.lax.dot_general(x, y, (((1,), (0,)), ((), ()))))(a, a)
  return closed.jaxpr.eqns[0].params.get("precision")


def _roles_perm(roles, order):
  return tuple(roles.index(r) for r in order if r in roles)


def match_site(flat: Flat, anchor: Node, impl: str) -> Match:
  """Matches the attention whose weights-by-values dot is ``anchor`` (raises NoMatch)."""
  dn = anchor.eqn.params["dimension_numbers"]
  (lc, rc), (lb, rb) = dn
  if not _default_precision(anchor.eqn.params.get("precision")):
    raise NoMatch("the value product has an explicit precision")
  chain: list = []
  # Which operand is the softmax output?
  found = None
  for wi in (0, 1):
    ref = _through(flat, anchor.ins[wi], ("convert_element_type",), chain)
    try:
      sub_chain: list = []
      x_ref, axis = _softmax(flat, ref, sub_chain)
      found = (wi, x_ref, axis, sub_chain)
      break
    except NoMatch as e:
      err = e
      chain.clear()
  if found is None:
    raise err
  wi, x_ref, sm_axis, sm_chain = found
  chain.extend(sm_chain)
  w_ref = anchor.ins[wi]
  w_rank = len(flat.avals[w_ref].shape)
  w_c, w_b = (lc, lb) if wi == 0 else (rc, rb)
  v_c, v_b = (rc, rb) if wi == 0 else (lc, lb)
  v_ref = anchor.ins[1 - wi]
  if tuple(w_c) != (sm_axis,):
    raise NoMatch(f"softmax over axis {sm_axis}, not the key axis the value product "
                  f"contracts ({', '.join(map(str, w_c))})")
  # Scores: peel mask, bias, scale, converts, transpose back to the q.k dot.
  ref = _through(flat, x_ref, ("convert_element_type",), chain)
  mask = bias = None
  scale = 1.0
  sel = _prim(flat, ref, "select_n")
  if sel is not None:
    if len(sel.ins) != 3 or isinstance(sel.ins[0], Lit) or (
        flat.avals[sel.ins[0]].dtype != np.bool_):
      raise NoMatch("a select that is not a boolean where")
    pred, c0, c1 = sel.ins
    f0, f1 = _const(flat, c0), _const(flat, c1)
    if f0 is not None and f1 is None:
      fill, ref, negate = f0, c1, False  # where(mask, s, fill)
    elif f1 is not None and f0 is None:
      fill, ref, negate = f1, c0, True  # where(~mask, fill, s)
    else:
      raise NoMatch("a where whose fill is not one constant")
    dt = flat.avals[ref].dtype
    big = float(jnp.finfo(dt).max)
    if not (fill == -math.inf or fill <= -0.5 * big or fill <= -1e9):
      raise NoMatch(f"mask fill {fill:g} is not very negative (-inf, finfo.min or <= -1e9): "
                    "masked keys might keep weight")
    chain.append(sel)
    mask = (pred, negate)
    ref = _through(flat, ref, ("convert_element_type",), chain)
  add = _prim(flat, ref, "add")
  if add is not None:
    chain.append(add)
    a, b = add.ins
    ref, bias = (a, b) if _leads_to_dot(flat, a) else (b, a)
    ref = _through(flat, ref, ("convert_element_type",), chain)
  sc = _prim(flat, ref, "div", "mul")
  if sc is not None:
    a, b = sc.ins
    ca, cb = _const(flat, a), _const(flat, b)
    if cb is not None and sc.eqn.primitive.name == "div" and cb != 0:
      scale, ref = 1.0 / cb, a
    elif cb is not None and sc.eqn.primitive.name == "mul":
      scale, ref = cb, a
    elif ca is not None and sc.eqn.primitive.name == "mul":
      scale, ref = ca, b
    else:
      raise NoMatch("the scores are scaled by something that is not a constant")
    chain.append(sc)
  ref = _through(flat, ref, ("convert_element_type",), chain)
  perm = None
  tr = _prim(flat, ref, "transpose")
  if tr is not None:
    chain.append(tr)
    perm = tuple(tr.eqn.params["permutation"])
    ref = tr.ins[0]
  ref = _through(flat, ref, ("convert_element_type",), chain)
  qk = _prim(flat, ref, "dot_general")
  if qk is None:
    raise NoMatch("the softmax input does not come from a q.k dot_general")
  chain.append(qk)
  if not _default_precision(qk.eqn.params.get("precision")):
    raise NoMatch("the q.k product has an explicit precision")
  (qlc, qrc), (qlb, qrb) = qk.eqn.params["dimension_numbers"]
  nb = len(qlb)
  if len(qlc) != 1 or nb not in (1, 2):
    raise NoMatch("the q.k product contracts more than one axis or has no batch axes")
  lhs, rhs = qk.ins
  lr, rr = (len(flat.avals[x].shape) if not isinstance(x, Lit) else 0 for x in (lhs, rhs))
  if lr != nb + 2 or rr != nb + 2:
    raise NoMatch("q or k has more than one sequence axis")
  # Roles of the q.k output: batch dims (B, N), lhs free, rhs free.
  dot_roles = (["B", "N"][:nb]) + ["L", "R"]
  scores_roles = dot_roles if perm is None else [dot_roles[p] for p in perm]
  key_side = scores_roles[sm_axis]
  if key_side not in ("L", "R"):
    raise NoMatch(f"softmax over axis {sm_axis}, a batch/head axis, not the key axis")
  q_side = "R" if key_side == "L" else "L"
  roles_w = ["S" if r == key_side else "T" if r == q_side else r for r in scores_roles]

  def operand_roles(rank, contract, batch, batch_roles, free_role, contract_role):
    roles = [None] * rank
    roles[contract[0]] = contract_role
    for ax, role in zip(batch, batch_roles, strict=True):
      roles[ax] = role
    free = [i for i in range(rank) if roles[i] is None]
    if len(free) != 1:
      raise NoMatch("operand with more than one free axis")
    roles[free[0]] = free_role
    return roles

  q_ref, k_ref = (lhs, rhs) if q_side == "L" else (rhs, lhs)
  qc, qb = (qlc, qlb) if q_side == "L" else (qrc, qrb)
  kc, kb = (qrc, qrb) if q_side == "L" else (qlc, qlb)
  batch_roles = ["B", "N"][:nb]
  q_roles = operand_roles(nb + 2, qc, qb, batch_roles, "T", "H")
  k_roles = operand_roles(nb + 2, kc, kb, batch_roles, "S", "H")
  # The value product: w's batch axes carry roles; v's pair with them.
  if sorted(roles_w[a] for a in w_b) != sorted(batch_roles):
    raise NoMatch("the value product batches other axes than the scores")
  v_rank = len(flat.avals[v_ref].shape)
  v_roles = operand_roles(v_rank, v_c, v_b, [roles_w[a] for a in w_b], "H", "S")
  w_free = [roles_w[i] for i in range(w_rank) if i not in w_c and i not in w_b]
  if w_free != ["T"]:
    raise NoMatch("the weights have other free axes than the queries")
  pair_roles = [roles_w[a] for a in w_b]
  out_roles = tuple(pair_roles + (["T", "H"] if wi == 0 else ["H", "T"]))
  # Single-use check: nothing between the two dots is used outside the chain.
  elim = set(chain)
  outs = {r for r in flat.outvars if not isinstance(r, Lit)}
  for n in elim:
    for r in n.outs:
      if r in outs or any(u not in elim and u is not anchor for u in flat.users.get(r, ())):
        raise NoMatch(f"an intermediate ({n.eqn.primitive.name}) is also used elsewhere "
                      "(returned attention weights, or a gradient)")
  qa, ka, va = (flat.avals[x] for x in (q_ref, k_ref, v_ref))
  if not (qa.dtype == ka.dtype == va.dtype):
    raise NoMatch(f"q, k, v dtypes differ ({qa.dtype}, {ka.dtype}, {va.dtype})")
  hq = qa.shape[q_roles.index("H")]
  hv = va.shape[v_roles.index("H")]
  if not _same_dim(hq, hv):
    raise NoMatch(f"value head dim {hv} differs from the query's {hq}")
  if is_dynamic_dim(hq):
    raise NoMatch("the head dim is dynamic")
  order_q = ("B", "T", "N", "H")
  order_k = ("B", "S", "N", "H")
  m = Match(anchor=anchor, eliminated=elim, q=q_ref, k=k_ref, v=v_ref,
            q_perm=_roles_perm(q_roles, order_q), k_perm=_roles_perm(k_roles, order_k),
            v_perm=_roles_perm(v_roles, order_k), out_roles=out_roles, heads=nb == 2,
            scale=scale, dtype=np.dtype(qa.dtype), head_dim=int(hq),
            where=source_of(anchor.eqn), impl=impl)
  bnts = ("B", "N", "T", "S")
  sperm = tuple(roles_w.index(r) for r in bnts if r in roles_w)
  if mask is not None:
    pred, negate = mask
    src, small = _small(flat, pred)
    if not _same_dim(small[roles_w.index("T")], 1):
      raise NoMatch("the mask depends on the query axis (causal or per-query masks are not "
                    "rewritten)")
    m.mask = (src, small, sperm, negate)
  if bias is not None:
    if isinstance(bias, Lit):
      raise NoMatch("a constant added to the scores")
    src, small = _small(flat, bias)
    m.bias = (src, small, sperm, False)
  return m


def _same_dim(a, b) -> bool:
  try:
    return bool(a == b)
  except Exception:  # noqa: BLE001  (inconclusive symbolic comparison)
    return False


def _leads_to_dot(flat: Flat, ref) -> bool:
  for _ in range(6):
    n = _prim(flat, ref, "convert_element_type", "transpose", "div", "mul", "dot_general")
    if n is None:
      return False
    if n.eqn.primitive.name == "dot_general":
      return True
    ref = n.ins[0] if n.eqn.primitive.name != "mul" or _const(flat, n.ins[0]) is None \
        else n.ins[1]
  return False


def _cudnn_refusal(m: Match) -> str | None:
  if jax.default_backend() != "gpu":
    return f"no GPU (backend {jax.default_backend()}): cuDNN fused attention runs on NVIDIA GPUs"
  if m.dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
    return (f"{m.dtype}: cuDNN fused attention needs float16/bfloat16 (cast the model, or "
            "use attention='xla')")
  try:
    cc = tuple(int(x) for x in str(jax.devices()[0].compute_capability).split("."))
  except Exception:  # noqa: BLE001
    cc = (8, 0)
  hmax = 256 if cc >= (9, 0) else 128
  if m.head_dim % 8 or m.head_dim > hmax:
    return f"head dim {m.head_dim}: cuDNN needs a multiple of 8 <= {hmax}"
  return None


def _pallas_refusal(m: Match) -> str | None:
  """Why dynjax's Pallas flash kernel (``_flash.py``) cannot take a site (None: it can)."""
  if jax.default_backend() != "gpu" and not PALLAS_OFF_GPU:
    return (f"no GPU (backend {jax.default_backend()}): the Pallas kernel is Triton (off GPU "
            "it would run in Pallas' interpret mode); use attention='xla'")
  why = _flash.operand_refusal(m.dtype, m.head_dim)
  if why is not None:
    return why
  if m.bias is not None:
    return "an additive bias: the Pallas kernel takes key masks only (use attention='xla')"
  if m.mask is not None:
    _, small, perm, _ = m.mask
    shape = tuple(small[i] for i in perm)  # dims may be symbolic
    if not m.heads:
      shape = shape[:1] + (1,) + shape[1:]
    if not all(isinstance(d, int) and d == 1 for d in shape[1:3]):
      return ("a mask over heads or queries: the Pallas kernel takes key-only masks (one "
              "per batch row)")
  return None


# Tests only: let attention="pallas" match off GPU (the kernel then runs interpreted).
PALLAS_OFF_GPU = False


@dataclasses.dataclass
class Report:
  matches: list
  notes: list  # explain() lines


def find(flat: Flat, impl: str) -> Report:
  """Every softmax-like site: a match (rewritten) or a line saying why not."""
  matches, notes = [], []
  seen = set()
  for n in flat.nodes:
    if n.eqn.primitive is not P.dot_general_p or n in seen:
      continue
    try:
      m = match_site(flat, n, impl)
    except NoMatch as e:
      if _feeds_from_softmax(flat, n):
        notes.append(f"attention at {source_of(n.eqn)}: left unchanged: {e}")
      continue
    if impl in ("cudnn", "pallas"):
      why = _cudnn_refusal(m) if impl == "cudnn" else _pallas_refusal(m)
      if why is not None:
        notes.append(f"attention at {m.where}: left unchanged: {why}")
        continue
    seen.update(m.eliminated)
    matches.append(m)
    parts = [f"scale={m.scale:.6g}"]
    if m.mask is not None:
      parts.append("mask")
    if m.bias is not None:
      parts.append("bias")
    to = ("dynjax's Pallas flash attention (" if impl == "pallas"
          else f"jax.nn.dot_product_attention(implementation={impl!r}, ")
    notes.append(f"attention at {m.where}: rewritten to {to}{', '.join(parts)}) [{m.dtype}, "
                 f"head dim {m.head_dim}]")
  # Softmaxes whose weights never reach a dot with v (dropout, another consumer).
  for n in flat.nodes:
    if n.eqn.primitive.name == "div" and _prim(flat, n.ins[0], "exp") is not None:
      users = flat.users.get(n.outs[0], [])
      if users and not any(u.eqn.primitive is P.dot_general_p for u in users) and not any(
          u in m.eliminated for m in matches for u in users):
        names = sorted({u.eqn.primitive.name for u in users})
        notes.append(f"attention at {source_of(n.eqn)}: left unchanged: the softmax weights "
                     f"go through {', '.join(names)} before the value product (dropout?)")
  return Report(matches, _counted(notes))


def _counted(notes: list) -> list:
  """Identical lines once, with a count (twelve layers share one source line)."""
  counts: dict = {}
  for n in notes:
    counts[n] = counts.get(n, 0) + 1
  return [n if c == 1 else f"{n} (x{c})" for n, c in counts.items()]


def _feeds_from_softmax(flat: Flat, dot: Node) -> bool:
  for r in dot.ins:
    r = _through(flat, r, ("convert_element_type",), [])
    d = _prim(flat, r, "div")
    if d is not None and _prim(flat, d.ins[0], "exp") is not None:
      return True
  return False
