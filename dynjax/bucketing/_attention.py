"""Opt-in attention rewrite: scaled-dot-product attention -> ``jax.nn.dot_product_attention``
or dynjax's Pallas flash kernel (``_flash.py``: float32 too).

``dynjax.jit(..., attention="cudnn" | "pallas" | "xla")``.  A small pattern matcher over a jaxpr finds
attention written the way public Flax code writes it::

    s = einsum("bqhd,bkhd->bhqk", q, k) / sqrt(dh)       # dot_general, then div/mul by a constant
    s = s + bias                                          # optional additive bias
    s = jnp.where(key_mask, s, finfo.min)                 # optional mask (select_n), key-only
    w = jax.nn.softmax(s, axis=-1)                        # over the key axis (inlined or custom_jvp)
    o = einsum("bhqk,bkhd->bqhd", w, v)                   # dot_general with v

and replaces the chain from the first dot to the second by one call of
``jax.nn.dot_product_attention(q, k, v, bias, mask, scale=..., implementation=...)``; every other
equation is evaluated as traced.  The matcher (``_attention_match.py``): :func:`flatten` inlines
``jit``/``closed_call``/``custom_jvp_call``/``custom_vjp_call`` bodies into one list of nodes (the pattern crosses
``jnp.where``'s and ``softmax``'s own sub-jaxprs), :func:`find` matches each softmax it sees and
says for every one why it was or was not rewritten, :func:`evaluate` runs the nodes like
``jax.core.eval_jaxpr`` with the matched chains replaced.

Two callers:

* ``padding="trust"``: :func:`rewrite_fun` traces the bucket's function at the bucket shape and
  evaluates it with the substitutions (the user's mask becomes the ``mask`` argument).
* ``padding="auto"``: :func:`rewrite_jaxpr` rewrites the *symbolic* jaxpr before the padding
  pass; each match becomes one ``dynjax_attention`` equation whose padding rule (here) knows
  the true key length: padded keys are excluded through ``key_value_seq_lengths`` (cuDNN), or
  through a key mask (XLA; with a user mask too, a ``-inf`` bias on padded keys so that a row
  whose every real key is masked still averages over the real keys only, as unpadded).

Not rewritten (each with an ``explain()`` line): anything but one softmax over the key axis
feeding a dot with v (dropout on the weights, softmax over another axis, weights also used
elsewhere), masks that depend on the query axis (causal, 2-D padding masks), a mask fill that
is not very negative, explicit dot precisions, mixed q/k/v dtypes, grouped heads; with
``"cudnn"``: no GPU, dtypes other than float16/bfloat16, head dims cuDNN refuses.  The numerics
change (softmax in float32, scale folded into the logits, bf16 logits computed in float32), so
the rewrite is opt-in.  Cost of the rewrite itself (2-core CPU box, jax 0.10.2, BERT-base at
T=128: 1,001 flat equations, 12 sites): flatten + match ~5 ms, the re-trace with substitutions
0.07-0.15 s; once per family under ``auto``, per bucket under ``trust`` (plus one
``make_jaxpr`` of the function at the bucket shape: 0.23 s cold).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

from dynjax import _jax_private as jp
from dynjax.bucketing import _flash
from dynjax.bucketing._attention_match import Flat, Lit, Match, find, flatten
from dynjax.bucketing._padding_core import (
  PaddedValue,
  bind_plain,
  is_dynamic_dim,
  register,
  sub_jaxprs,
  unsupported,
)

IMPLS = ("cudnn", "pallas", "xla")
__all__ = ["IMPLS", "attention_p", "find", "flatten", "for_family", "fun_at", "rewrite_fun",
           "rewrite_jaxpr"]


# -- evaluation with substitutions -------------------------------------------------------------
def evaluate(flat: Flat, matches, emit, args):
  """Runs the flat program like ``eval_jaxpr``; each match's anchor output is ``emit(m, read)``."""
  env: dict = dict(zip(flat.invars, args, strict=True))
  skip = set().union(*(m.eliminated for m in matches)) if matches else set()
  anchors = {m.anchor: m for m in matches}

  def read(r):
    if isinstance(r, Lit):
      return r.val
    return env[r]

  for n in flat.nodes:
    if n in skip:
      continue
    m = anchors.get(n)
    with jp.eqn_context(n.eqn):
      if m is not None:
        env[n.outs[0]] = emit(m, read).astype(n.eqn.outvars[0].aval.dtype)
        continue
      outs = bind_plain(n.eqn, [read(r) for r in n.ins])
    for r, o in zip(n.outs, outs, strict=True):
      env[r] = o
  return [read(r) for r in flat.outvars]


def _operand(m: Match, which, read):
  """The mask/bias operand in BNTS (keepdims, broadcastable), from its smallest source."""
  src, small, sperm, negate = which
  val = jnp.transpose(jnp.reshape(read(src), small), sperm)
  if not m.heads:
    val = val[:, None]  # B T S -> B 1 T S
  if negate:
    val = jnp.logical_not(val)
  return val


def _qkv(m: Match, read):
  q = jnp.transpose(read(m.q), m.q_perm)
  k = jnp.transpose(read(m.k), m.k_perm)
  v = jnp.transpose(read(m.v), m.v_perm)
  if not m.heads:  # B T H -> B T 1 H
    q, k, v = q[:, :, None], k[:, :, None], v[:, :, None]
  return q, k, v


def _to_anchor(m: Match, out):
  """dot_product_attention's B T N H result in the anchor's own layout."""
  roles = ("B", "T", "N", "H") if m.heads else ("B", "T", "H")
  if not m.heads:
    out = out[:, :, 0]
  return jnp.transpose(out, tuple(roles.index(r) for r in m.out_roles))


def _full_ts(x, t, s):
  """cuDNN takes masks/biases as [B|1, N|1, T, S]: T and S in full."""
  return jnp.broadcast_to(x, x.shape[:2] + (t, s))


def _dpa(q, k, v, mask, bias, kv_len, *, scale, impl):
  t, s = q.shape[1], k.shape[1]
  if impl == "pallas":  # the matcher admitted key-only masks [B|1, 1, 1, S] and no bias
    assert bias is None
    key_mask = None if mask is None else jnp.reshape(mask, (mask.shape[0], mask.shape[-1]))
    return _flash.flash_attention(q, k, v, kv_len=kv_len, key_mask=key_mask, scale=scale)
  if impl == "cudnn":
    mask = None if mask is None else _full_ts(mask, t, s)
    bias = None if bias is None else _full_ts(bias, t, s)
  return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                      key_value_seq_lengths=kv_len, implementation=impl)


def _emit_direct(m: Match, read):
  q, k, v = _qkv(m, read)
  mask = None if m.mask is None else _operand(m, m.mask, read)
  bias = None if m.bias is None else _operand(m, m.bias, read)
  return _to_anchor(m, _dpa(q, k, v, mask, bias, None, scale=m.scale, impl=m.impl))


def rewrite_fun(fun, avals, impl: str):
  """``padding="trust"``: (function, notes); the function is ``fun`` itself when nothing
  matched, else ``fun`` traced at ``avals`` and evaluated with the substitutions."""
  closed = jax.make_jaxpr(fun)(*avals)
  flat = flatten(closed)
  rep = find(flat, impl)
  if not rep.matches:
    return fun, rep.notes

  def rewritten(*args):
    return evaluate(flat, rep.matches, _emit_direct, list(args))

  rewritten.__name__ = getattr(fun, "__name__", "rewritten")
  return rewritten, rep.notes


def for_family(closed, impl: str, rewrite: bool):
  """A family's view: (jaxpr, explain() lines, ok).  ``rewrite`` (``padding="auto"``): the
  symbolic jaxpr rewritten; otherwise only matched, for the lines (executables are rewritten
  by :func:`fun_at`).  A crash leaves every attention as written: a matcher bug must never
  change a result."""
  try:
    if rewrite:
      closed, notes = rewrite_jaxpr(closed, impl)
    else:
      notes = find(flatten(closed), impl).notes
  except Exception as e:  # noqa: BLE001
    return closed, (f"the attention rewrite failed ({type(e).__name__}: {e}): every attention "
                    "left unchanged; please report it",), False
  return closed, notes or ["no scaled-dot-product attention found"], True


def fun_at(fun, avals, impl: str | None, name: str):
  """:func:`rewrite_fun`'s function; ``fun`` itself when ``impl`` is None or (with a warning)
  when the rewrite fails."""
  if impl is None:
    return fun
  try:
    return rewrite_fun(fun, avals, impl)[0]
  except Exception:  # noqa: BLE001
    logging.getLogger("dynjax").warning(
        "dynjax.jit(%s): the attention rewrite failed at %s; running the function as written",
        name, [tuple(a.shape) for a in avals], exc_info=True)
    return fun


# -- padding="auto": one primitive per match, padded by its own rule ---------------------------
attention_p = jex_core.Primitive("dynjax_attention")


def _attention_impl(q, k, v, *rest, scale, impl, has_mask, has_bias, kv_lengths):
  it = iter(rest)
  mask = next(it) if has_mask else None
  bias = next(it) if has_bias else None
  kv_len = next(it) if kv_lengths else None
  return _dpa(q, k, v, mask, bias, kv_len, scale=scale, impl=impl)


def _attention_abstract(q, k, v, *rest, **params):
  return jp.shaped_array(q.shape, q.dtype)


attention_p.def_impl(_attention_impl)
attention_p.def_abstract_eval(_attention_abstract)
mlir.register_lowering(attention_p, mlir.lower_fun(_attention_impl, multiple_results=False))


def _emit_primitive(m: Match, read):
  q, k, v = _qkv(m, read)
  rest = []
  if m.mask is not None:
    rest.append(_operand(m, m.mask, read))
  if m.bias is not None:
    rest.append(_operand(m, m.bias, read))
  out = attention_p.bind(q, k, v, *rest, scale=float(m.scale), impl=m.impl,
                         has_mask=m.mask is not None, has_bias=m.bias is not None,
                         kv_lengths=False)
  return _to_anchor(m, out)


def rewrite_jaxpr(closed, impl: str):
  """``padding="auto"``: (closed jaxpr, notes).  The symbolic jaxpr with every match replaced
  by one ``dynjax_attention`` equation (the same jaxpr object when nothing matched)."""
  flat = flatten(closed)
  rep = find(flat, impl)
  if not rep.matches:
    return closed, rep.notes
  jaxpr = getattr(closed, "jaxpr", closed)
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
           for v in jaxpr.invars]

  def rewritten(*args):
    return evaluate(flat, rep.matches, _emit_primitive, list(args))

  return jax.make_jaxpr(rewritten)(*avals), rep.notes


@register(attention_p)
def _attention_rule(ctx, eqn, invals):
  """Padded keys never get weight; padded query rows and batch rows are don't-care."""
  p = dict(eqn.params)
  qa, ka, va = (v.aval for v in eqn.invars[:3])
  for aval, name in ((qa, "q"), (ka, "k")):
    for ax, what in ((2, "head count"), (3, "head dim")):
      if is_dynamic_dim(aval.shape[ax]):
        raise unsupported(eqn, f"dynamic {what} of {name}")
  q = invals[0].val
  k = ctx.mask(invals[1], ka, [1], np.zeros((), ka.dtype)[()], eqn, "k")
  v = ctx.mask(invals[2], va, [1], np.zeros((), va.dtype)[()], eqn, "v")
  rest = [pv.val for pv in invals[3:]]
  if not is_dynamic_dim(ka.shape[1]):
    return [PaddedValue(attention_p.bind(q, k, v, *rest, **p))]
  n_b = ctx.padded_dim(qa.shape[0])
  s_pad = ctx.padded_dim(ka.shape[1])
  s_true = ctx.true_dim(ka.shape[1])
  mask = rest[0] if p["has_mask"] else None
  bias = rest[int(p["has_mask"])] if p["has_bias"] else None
  if bias is not None:  # garbage (NaN) bias on padded keys must not reach the softmax
    baval = eqn.invars[3 + int(p["has_mask"])].aval
    bias = ctx.mask(invals[3 + int(p["has_mask"])], baval, [3], np.zeros((), baval.dtype)[()])
  if p["impl"] in ("cudnn", "pallas"):
    kv_len = jnp.full((n_b,), s_true, jnp.int32)
    ctx.note(eqn, f"cuDNN: key_value_seq_lengths = true {ka.shape[1]}" if p["impl"] == "cudnn"
             else f"Pallas: keys past the true {ka.shape[1]} excluded, their blocks skipped")
    out = _dpa(q, k, v, mask, bias, kv_len, scale=p["scale"], impl=p["impl"])
    return [PaddedValue(out)]
  valid = (jnp.arange(s_pad) < s_true)[None, None, None, :]
  if mask is None:
    ctx.note(eqn, f"XLA: padded keys masked (true {ka.shape[1]})")
    mask = valid
  else:
    # A row whose every real key is masked averages over the real keys (uniform over
    # large-negative logits): padded keys get -inf instead, and the user's mask is True there.
    mask = jnp.logical_or(mask, jnp.logical_not(valid))
    neg = jnp.where(valid, jnp.zeros((), q.dtype), jnp.asarray(-jnp.inf, q.dtype))
    bias = neg if bias is None else bias + neg.astype(bias.dtype)
    ctx.note(eqn, f"XLA: padded keys get a -inf bias (true {ka.shape[1]})")
  return [PaddedValue(_dpa(q, k, v, mask, bias, None, scale=p["scale"], impl="xla"))]


# cuDNN's kernels (fused attention, cuDNN fusions), by the primitive jax binds them with.
CUDNN_PRIMITIVES = ("dot_product_attention", "cudnn_fusion")


def runs_cudnn(jaxpr, attention: str | None) -> bool:
  """Whether a family's executables call cuDNN's kernels: ``attention="cudnn"``, or a
  primitive of :data:`CUDNN_PRIMITIVES` in its jaxpr (``jax.nn.dot_product_attention(...,
  implementation="cudnn")`` written in the model), nested jaxprs included.  Why: such a
  function's warm-up builds one bucket at a time (two at once crashed the process, SIGSEGV),
  and its executables are not run ahead on zeros (``jit/_prerun.py``: a prerun was in flight
  in each crash and hang seen; ``jit/_serving.py``)."""
  if attention == "cudnn":
    return True
  todo = [jaxpr] if jaxpr is not None else []
  while todo:
    j = todo.pop()
    for e in getattr(j, "jaxpr", j).eqns:  # (a ClosedJaxpr's jaxpr)
      if e.primitive.name.startswith(CUDNN_PRIMITIVES):
        return True
      todo.extend(sub_jaxprs(e.params))
  return False
