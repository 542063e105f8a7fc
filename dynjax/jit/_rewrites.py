"""The opt-in rewrites of a family's function: ``attention=`` (``bucketing/_attention.py``)
and ``ragged_dot=`` (``route/_rewrite.py``), in that order.

Under ``padding="auto"`` the symbolic jaxpr itself is rewritten, once (:func:`for_family`);
under ``"trust"`` and ``"exact"`` each executable's function is traced at its shape and
rewritten there (:func:`fun_at`).  Either rewrite that fails leaves the function as written,
with an ``explain()`` line or a warning.
"""

from __future__ import annotations

from dynjax.bucketing import _attention


def for_family(fam, closed):
  """The family's jaxpr after its rewrites (``auto``); sets its ``explain()`` lines and what
  :func:`fun_at` rewrites per shape (``trust``/``exact``)."""
  opts, auto = fam.ctx.opts, fam.mode == "auto"
  if opts.attention is not None:
    closed, fam.attention_notes, ok = _attention.for_family(closed, opts.attention, auto)
    fam.attention_impl = opts.attention if ok and not auto else None
  if opts.ragged_dot is not None:
    from dynjax.route import _rewrite  # (the routers' import, ~0.13 s, only when asked)

    closed, fam.ragged_notes, ok = _rewrite.for_family(closed, auto)
    fam.ragged_per_shape = ok and not auto
  return closed


def fun_at(fam, fun, avals):
  """``fun`` (a bucket's or an exact shape's) with the rewrites at ``avals``."""
  fun = _attention.fun_at(fun, avals, fam.attention_impl, fam.name)
  if fam.ragged_per_shape:
    from dynjax.route import _rewrite

    fun = _rewrite.fun_at(fun, avals, True, fam.name)
  return fun
