"""``dynjax.jit(ragged_dot="kernels")``: ``lax.ragged_dot`` in code as written, run on
:func:`dynjax.route.ragged_dot`'s grouped-GEMM kernels without editing it.

For a Mixture-of-Experts in a library you import (a MaxText-style block that calls
``jax.lax.ragged_dot`` over tokens sorted by expert), not one you can change to
``dynjax.route.ragged_dot``.  The traced jaxpr is flattened (``jit``, ``custom_jvp`` and
``custom_vjp`` bodies inlined: ``bucketing/_attention_match.flatten``) and every
``ragged_dot_general`` equation of one of two forms is evaluated as ``route.ragged_dot``:

* ``lax.ragged_dot``'s own: ``lhs [M, K]`` in consecutive groups along M, ``rhs [G, K, N]``;
* its gradient in ``lhs`` (``jax.grad`` of the above traces it): ``dy [M, N]`` times
  ``rhs [G, K, N]`` contracted on N, run as ``route.ragged_dot(dy, rhs^T)``;
* its gradient in ``rhs``: ``x [M, K]`` and ``dy [M, N]`` contracted over the ragged rows
  into ``[G, K, N]``, run as ``route.ragged_dot``'s backward in its rhs (``jax.vjp`` at
  zero weights: the forward it computes is unused and dropped).

Everything else is left as written, each with an ``explain()`` line saying why: ragged
contractions of another layout, a ``group_offset``, a
``precision`` (``jax_default_matmul_precision`` sets one too) or a wider
``preferred_element_type``, mixed dtypes, other dimension numbers, and ragged dots inside
``scan``/``while``/``cond``/``remat`` bodies (not flattened).  ``route.ragged_dot`` is ``lax.ragged_dot`` itself wherever no kernel runs
(CPU, a ``precision`` or ``preferred_element_type``, dtypes and widths the kernels do not
take), so on the CI box the rewrite changes nothing but the jaxpr.  Numerics: the kernels'
(float32 accumulation, outputs in ``lhs``'s dtype: bitwise equal to ``lax.ragged_dot`` on the
H100 in session 19's probe); opt-in all the same, as ``attention=``.

Under ``padding="auto"`` the family's symbolic jaxpr is rewritten once (``route.ragged_dot``
binds its ``dynjax_ragged_dot`` primitive at a symbolic row count, lowered to the kernel per
bucket); under ``"trust"`` and ``"exact"`` each executable's function is traced at its shape
and evaluated with the substitutions.  A rewrite that fails leaves the function as written
(``explain()`` says so); it never fails a call.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from dynjax import _jax_private as jp
from dynjax.bucketing._attention import evaluate
from dynjax.bucketing._attention_match import Flat, Node, flatten
from dynjax.bucketing._padding_core import source_of

MODES = ("kernels",)
KERNEL, TILING = "auto", None  # route.ragged_dot's kernel= and tiling= (tests: the stand-in)
_RAGGED = jp.private_primitives().get("ragged_dot_general")


@dataclasses.dataclass(eq=False)
class Site:
  """One ``ragged_dot_general`` rewritten (``evaluate``'s match: an anchor, nothing else)."""

  anchor: Node
  form: str  # "forward", "grad_lhs" (rhs contracted on its last axis), "grad_rhs"
  eliminated: frozenset = frozenset()


FORMS = {"forward": "forward", "grad_lhs": "gradient in lhs", "grad_rhs": "gradient in rhs"}


def _form(eqn) -> tuple[str | None, str]:
  """(form, "") for a rewritable equation, else (None, why not)."""
  p = eqn.params
  rdn = p["ragged_dot_dimension_numbers"]
  (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
  la, ra = eqn.invars[0].aval, eqn.invars[1].aval
  if p.get("group_offset") is not None or len(eqn.invars) > 3:
    return None, "a group_offset (a sharded ragged dot)"
  if any(d in lc for d in rdn.lhs_ragged_dimensions):
    # The weights' gradient: x [M, K] and dy [M, N] contracted over the ragged rows into
    # [G, K, N], which the kernels' backward computes (route.ragged_dot's vjp in rhs).
    out = eqn.outvars[0].aval
    if (tuple(lc), tuple(rc), tuple(rdn.lhs_ragged_dimensions)) != ((0,), (0,), (0,)) or (
        lb or rb or rdn.rhs_group_dimensions or la.ndim != 2 or ra.ndim != 2
        or out.ndim != 3):
      return None, "a ragged contraction of another layout than the weights' gradient"
    why = _numerics(p, la, ra)
    return (None, why) if why else ("grad_rhs", "")
  if lb or rb or la.ndim != 2 or ra.ndim != 3:
    return None, f"batch axes or ranks lhs {la.ndim} / rhs {ra.ndim} (the kernels take 2 / 3)"
  if tuple(rdn.lhs_ragged_dimensions) != (0,) or tuple(rdn.rhs_group_dimensions) != (0,):
    return None, f"ragged dimensions {tuple(rdn.lhs_ragged_dimensions)} / groups " \
                 f"{tuple(rdn.rhs_group_dimensions)}"
  why = _numerics(p, la, ra)
  if why:
    return None, why
  if tuple(lc) == (1,) and tuple(rc) == (1,):
    return "forward", ""
  if tuple(lc) == (1,) and tuple(rc) == (2,):
    return "grad_lhs", ""
  return None, f"contracting dimensions {tuple(lc)} / {tuple(rc)}"


def _numerics(p, la, ra) -> str:
  """Why the kernels would not compute what the equation asks ("" where they would)."""
  prec = p.get("precision")  # (jax_default_matmul_precision sets one too)
  if prec is not None and any(q != jax.lax.Precision.DEFAULT for q in (
      prec if isinstance(prec, tuple) else (prec,))):
    return f"precision={prec} (the kernels compute at the default precision)"
  pet = p.get("preferred_element_type")
  if pet is not None and jnp.dtype(pet) != la.dtype:
    return f"preferred_element_type={jnp.dtype(pet).name} (the kernels give lhs's dtype)"
  if la.dtype != ra.dtype:
    return f"mixed dtypes {la.dtype} / {ra.dtype}"
  return ""


def _nested(eqn) -> bool:
  """Whether a sub-jaxpr of ``eqn`` (a scan, while, cond or remat body) holds a ragged dot."""
  for v in eqn.params.values():
    for sub in (v if isinstance(v, tuple | list) else (v,)):
      jx = getattr(sub, "jaxpr", sub)
      eqns = getattr(jx, "eqns", None)
      if eqns is None:
        continue
      if any(e.primitive is _RAGGED or _nested(e) for e in eqns):
        return True
  return False


def find(flat: Flat) -> tuple[list[Site], list[str]]:
  """The sites to rewrite, and an ``explain()`` line for every ragged dot seen."""
  sites, notes = [], []
  for n in flat.nodes:
    if n.eqn.primitive is not _RAGGED:
      if _nested(n.eqn):
        notes.append(f"ragged_dot inside {n.eqn.primitive.name} at {source_of(n.eqn)}: left "
                     "as written (bodies of scan/while/cond/remat are not rewritten)")
      continue
    form, why = _form(n.eqn)
    if form is None:
      notes.append(f"ragged_dot at {source_of(n.eqn)}: left as written: {why}")
      continue
    sites.append(Site(n, form))
    notes.append(f"ragged_dot ({FORMS[form]}) at {source_of(n.eqn)}: route.ragged_dot")
  return sites, notes


def _emit(site: Site, read):
  from dynjax.route._ragged import ragged_dot

  lhs, rhs, sizes = (read(r) for r in site.anchor.ins[:3])
  if site.form == "grad_rhs":  # x^T dy by groups: route.ragged_dot's backward in its rhs
    shape = site.anchor.eqn.outvars[0].aval.shape
    _, pull = jax.vjp(lambda w: ragged_dot(lhs, w, sizes, kernel=KERNEL, tiling=TILING),
                      jnp.zeros(shape, lhs.dtype))
    return pull(rhs.astype(lhs.dtype))[0]
  if site.form == "grad_lhs":
    rhs = jnp.swapaxes(rhs, 1, 2)
  return ragged_dot(lhs, rhs, sizes, kernel=KERNEL, tiling=TILING)


def rewrite_jaxpr(closed):
  """(closed jaxpr, notes): ``closed`` with every site rewritten (the same object when none
  is), for ``padding="auto"``'s symbolic jaxpr."""
  flat = flatten(closed)
  sites, notes = find(flat)
  if not sites:
    return closed, notes
  jaxpr = getattr(closed, "jaxpr", closed)
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
           for v in jaxpr.invars]

  def rewritten(*args):
    return evaluate(flat, sites, _emit, list(args))

  return jax.make_jaxpr(rewritten)(*avals), notes


def for_family(closed, rewrite: bool):
  """A family's view: (jaxpr, explain() lines, ok).  ``rewrite`` (``padding="auto"``): the
  symbolic jaxpr rewritten; otherwise only found, for the lines (:func:`fun_at` rewrites each
  executable's function)."""
  try:
    if rewrite:
      closed, notes = rewrite_jaxpr(closed)
    else:
      notes = find(flatten(closed))[1]
  except Exception as e:  # noqa: BLE001 - a rewriter bug must never change a result
    return closed, (f"the ragged_dot rewrite failed ({type(e).__name__}: {e}): every ragged "
                    "dot left as written; please report it",), False
  return closed, notes or ["no lax.ragged_dot found"], True


def fun_at(fun, avals, on: bool, name: str):
  """``fun`` traced at ``avals`` and evaluated with the sites rewritten (``padding="trust"``
  and exact executables); ``fun`` itself when off, when nothing matched, or (with a warning)
  when the rewrite fails."""
  if not on:
    return fun
  try:
    closed = jax.make_jaxpr(fun)(*avals)
    flat = flatten(closed)
    sites, _ = find(flat)
  except Exception:  # noqa: BLE001
    logging.getLogger("dynjax").warning(
        "dynjax.jit(%s): the ragged_dot rewrite failed at %s; running the function as written",
        name, [tuple(a.shape) for a in avals], exc_info=True)
    return fun
  if not sites:
    return fun

  def rewritten(*args):
    return evaluate(flat, sites, _emit, list(args))

  rewritten.__name__ = getattr(fun, "__name__", "rewritten")
  return rewritten
