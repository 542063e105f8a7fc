"""``jnp.searchsorted`` into a dynamic-length sorted array: one primitive, searched at each
bucket.

JAX's search records the sorted array's length as a Python integer (``out_dtype.type(n)``,
the ``log2(n + 1)`` levels of its binary search), so it refuses a symbolic length
(``InconclusiveDimensionOperation: ... used in a context that requires a constant``), and a
family traced with ``padding="auto"`` fell back to one compile per shape.  The idiom is
common wherever lengths vary: segment ids of packed sequences (``searchsorted(cu_seqlens,
positions, side="right") - 1``), ``jnp.digitize`` into data-dependent bin edges, resampling
an irregular time series, ``jnp.isin`` against a variable set.

While a family traces (``_rebind.family_tracing``), a search whose sorted array has a
symbolic length binds ``dynjax_searchsorted`` instead; at a bucket's padded shape its padding
rule reproduces JAX's answer at the true length ``n`` *for any contents* (the contract asks
for a sorted array; an unsorted one still gets JAX's, method by method):

* ``method="scan"`` / ``"scan_unrolled"`` (the default): JAX's binary search, started on
  ``[0, n)`` with its levels for the padded length.  Every probe ``mid`` is below ``n`` (the
  padded tail is never read), and the levels past ``log2(n + 1)`` leave the state as it is
  (each probe there repeats one already made), so the result is JAX's at length ``n``;
* ``"sort"`` / ``"compare_all"``: both count the elements below the query (``<=`` with
  ``side="right"``), whatever their order.  The padded tail is filled with the largest value
  of JAX's sort order (NaN for floats, the dtype's max for integers), which no query exceeds,
  and the count clamped to ``n`` (a query equal to that value counts every valid element).

``install()`` makes JAX's search function (one private attribute, ``_jax_private.
searchsorted_hook``) this wrapper; outside a family's trace, or at a static length, it is
JAX's.  A family installs it on the first trace that JAX refuses there, then traces again.
``jnp.interp`` also takes ``len()`` of the array: ``_jnp`` runs a copy of it.  Not covered
(the family falls back as before): a sorted array of more than one dimension passed to the
search directly.
"""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from dynjax import _jax_private as jp
from dynjax.bucketing._padding_core import PaddedValue, register
from dynjax.bucketing._padding_rules import sort_last
from dynjax.bucketing._rebind import family_tracing_active, rebind_hook
from dynjax.bucketing._rebind import register as register_rebinder

_HOOK = jp.searchsorted_hook()
_ORIGINAL = getattr(*_HOOK) if _HOOK else None  # JAX's function, before install()
METHODS = ("scan", "scan_unrolled", "sort", "compare_all")
jp.exclude_from_user_frames(__file__)


def is_refusal(e: BaseException) -> bool:
  """Whether ``e`` is JAX's search refusing a symbolic length (``... requires a constant``;
  its traceback passes through the search)."""
  if _ORIGINAL is None or "requires a constant" not in str(e):
    return False
  names = {f.name for f in traceback.extract_tb(e.__traceback__)}
  return bool(names & {"searchsorted", "searchsorted_via_expand"})


def install() -> bool:
  """Rebinds JAX's search function to :func:`searchsorted_via_expand`.  True when it rebound
  it (a trace that failed may then succeed), False when it was already (or cannot be: that
  JAX has no such function)."""
  return rebind_hook(_HOOK, searchsorted_via_expand)


register_rebinder(is_refusal, install)


def searchsorted_via_expand(sorted_arr, query, /, *, side="left", dimension=0, batch_dims=0,
                            method="scan", dtype="int32"):
  """JAX's search; inside a dynjax family's trace, into a 1-d array of symbolic length, the
  ``dynjax_searchsorted`` primitive (module docstring)."""
  kw = dict(side=side, dimension=dimension, batch_dims=batch_dims, method=method, dtype=dtype)
  if (not family_tracing_active() or not hasattr(sorted_arr, "shape")
      or not hasattr(query, "shape") or jnp.ndim(sorted_arr) != 1 or dimension != 0
      or batch_dims != 0 or not jp.is_dim_expr(sorted_arr.shape[0]) or side not in (
          "left", "right") or method not in METHODS or sorted_arr.dtype != query.dtype
      or not jnp.issubdtype(np.dtype(dtype), np.integer)):
    return _ORIGINAL(sorted_arr, query, **kw)  # JAX's answer, or its error
  dtype = np.dtype(dtype)
  if dtype == np.dtype(np.int64):
    # jnp.searchsorted's dtype for a symbolic length is the default int (int64 under x64);
    # at any true length below 2**31 JAX's is int32: the family's must be the same.
    dtype = np.dtype(np.int32)
  out = search_p.bind(jnp.asarray(sorted_arr)[None], jnp.asarray(query)[None], side=side,
                      method=method, dtype=dtype, batch_dims=1)
  return out[0]


if _ORIGINAL is not None:
  searchsorted_via_expand.__wrapped__ = _ORIGINAL
  searchsorted_via_expand.__name__ = _ORIGINAL.__name__


# -- the primitive: sorted (*B, n), query (*B, *Q) -> (*B, *Q), one search per batch index ----
search_p = jex_core.Primitive("dynjax_searchsorted")


def _impl(sorted_arr, query, *, side, method, dtype, batch_dims):
  return _ORIGINAL(sorted_arr, query, side=side, dimension=sorted_arr.ndim - 1,
                   batch_dims=batch_dims, method=method, dtype=dtype)


def _abstract(sorted_arr, query, *, side, method, dtype, batch_dims):
  return jp.shaped_array(query.shape, dtype)


def _batch(args, dims, **p):
  sorted_arr, query = args
  ds, dq = dims
  if ds is None:
    # One sorted array for the whole batch (``jnp.interp`` vmapped over channels): the
    # batch axis is one more query axis, after the search's own batch axes; no copy of it.
    k = p["batch_dims"]
    return search_p.bind(sorted_arr, jnp.moveaxis(query, dq, k), **p), k
  size = sorted_arr.shape[ds]
  sorted_arr = jnp.moveaxis(sorted_arr, ds, 0)
  query = jnp.broadcast_to(query, (size, *query.shape)) if dq is None else jnp.moveaxis(
      query, dq, 0)
  return search_p.bind(sorted_arr, query, **{**p, "batch_dims": p["batch_dims"] + 1}), 0


search_p.def_impl(_impl)
search_p.def_abstract_eval(_abstract)
mlir.register_lowering(search_p, mlir.lower_fun(_impl, multiple_results=False))
batching.primitive_batchers[search_p] = _batch


def _jvp(primals, tangents, **p):  # integer indices: no tangent
  out = search_p.bind(*primals, **p)
  return out, ad.Zero(jp.shaped_array(out.shape, out.dtype).to_tangent_aval())


ad.primitive_jvps[search_p] = _jvp


# -- JAX's sort order (lax's sort comparators), from public operations ----------------------


def _keys(x):
  """The keys JAX's sort order compares, lexicographically: -0.0 as 0.0, every NaN as +NaN
  (last); complex numbers by (real, imaginary)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return [*_keys(jnp.real(x)), *_keys(jnp.imag(x))]
  if jnp.issubdtype(x.dtype, jnp.floating):
    x = jnp.where(x == 0, jnp.zeros((), x.dtype), x)
    return [jnp.where(jnp.isnan(x), jnp.full((), np.nan, x.dtype), x)]
  return [x]


def _lt(a, b):
  """``a < b`` in a total order of the canonical keys (NaN last, equal to itself)."""
  if jnp.issubdtype(a.dtype, jnp.floating):
    return (a < b) | (jnp.isnan(b) & ~jnp.isnan(a))
  return a < b


def _eq(a, b):
  if jnp.issubdtype(a.dtype, jnp.floating):
    return (a == b) | (jnp.isnan(a) & jnp.isnan(b))
  return a == b


_COMPARATORS = jp.sort_comparators()


def _compare(x, y, or_equal: bool):
  """JAX's ``_sort_lt_comparator`` (``or_equal``: ``_sort_le_comparator``) of x and y."""
  if _COMPARATORS is not None:
    return _COMPARATORS[1 if or_equal else 0](x, y)
  p = None
  for xk, yk in zip(_keys(x)[::-1], _keys(y)[::-1], strict=True):
    p = (_lt(xk, yk) | (_eq(xk, yk) & p)) if p is not None else (
        (_lt(xk, yk) | _eq(xk, yk)) if or_equal else _lt(xk, yk))
  return p


def _largest(dtype):
  """The last value of JAX's sort order for ``dtype`` (NaN for a float type without one: a
  dtype no search of this kind has met)."""
  last = sort_last(dtype)
  return np.nan if last is None else last


# -- the padding rule --------------------------------------------------------------------------


def _binary_search(sorted_arr, query, n, side, unrolled):
  """JAX's ``_searchsorted_scan_impl`` over every query at once, started on ``[0, n)``
  (module docstring: exact at the true length ``n`` for any contents).  JAX's operations:
  unsigned bounds, one gather a level (vmapped over the batch), its comparator."""
  rows = sorted_arr.reshape((-1, sorted_arr.shape[-1]))  # (K, N)
  flat = query.reshape((rows.shape[0], -1))  # (K, M)
  levels = int(np.ceil(np.log2(sorted_arr.shape[-1] + 1)))
  gather = jax.vmap(lambda r, i: r.at[i].get(mode="promise_in_bounds"))
  or_equal = side == "left"

  def body(_, state):
    low, high = state
    mid = low + lax.shift_right_logical(high - low, jnp.uint32(1))
    go_left = _compare(flat, gather(rows, mid), or_equal)
    return lax.select(go_left, low, mid), lax.select(go_left, mid, high)

  init = (jnp.zeros(flat.shape, jnp.uint32),
          jnp.broadcast_to(n.astype(jnp.uint32), flat.shape))
  _, high = lax.fori_loop(0, levels, body, init, unroll=levels if unrolled else 1)
  return high.reshape(query.shape)


@register(search_p)
def _search_rule(ctx, eqn, invals):
  p = eqn.params
  aval = eqn.invars[0].aval
  sorted_arr, query = invals[0].val, invals[1].val
  if not jp.is_dim_expr(aval.shape[-1]):
    return [PaddedValue(_impl(sorted_arr, query, **p))]
  n = ctx.true_dim(aval.shape[-1])
  where = f"searchsorted into length {aval.shape[-1]} ({p['method']}, side={p['side']}): "
  if p["method"] in ("scan", "scan_unrolled"):
    out = _binary_search(sorted_arr, query, n, p["side"],
                         p["method"] == "scan_unrolled")
    ctx.note(eqn, where + "JAX's binary search on [0, true length): the padding is never read")
  else:
    i = lax.broadcasted_iota(jnp.int32, sorted_arr.shape, sorted_arr.ndim - 1)
    filled = jnp.where(i < n, sorted_arr, jnp.asarray(_largest(sorted_arr.dtype),
                                                        sorted_arr.dtype))
    out = jnp.minimum(_impl(filled, query, **p), n.astype(p["dtype"]))
    ctx.note(eqn, where + "a count of the elements below the query: the padding filled with "
             "the sort order's last value, the count clamped to the true length")
  return [PaddedValue(out.astype(p["dtype"]))]
