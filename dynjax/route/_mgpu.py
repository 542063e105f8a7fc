"""The Hopper backend of :func:`dynjax.route.gmm`: JAX's own Mosaic GPU ragged-dot kernels.

``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`` (wgmma from shared memory fed by
the bulk tensor copy engine, a persistent grid of one program per SM) computes the forward and,
on the weights read transposed, ``dlhs``; ``transposed_ragged_dot_mgpu.transposed_ragged_dot``
computes ``drhs[g] = lhs[rows of g]^T @ dy[rows of g]``.  Both are library kernels kept by the
JAX team; this module only adapts our layout to them and wires the ``custom_vjp``.

Layout.  These kernels take *ragged* groups (a row tile may hold the end of one group and the
start of the next: it is computed once per group and stored under a row mask), so the grouped
layer packs the rows with no tile padding at all (row alignment 1, see
:func:`dynjax.route._gmm.row_alignment`).  The kernels leave rows past the last group unwritten
and spend a full tile of work on every grid step that maps to no group, so :func:`gmm_mgpu`
hands the rows after the last group to the last group (``sizes[-1] += M - sum(sizes)``): they
are computed with the last group's weights, ``0`` where ``lhs`` holds zeros (the grouped layer's
padding rows), and every output row is written.

Cost (H100, jax 0.11.2): see ``Tiling.auto`` and README "Routed layers".
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from dynjax._errors import RoutingError
from dynjax.route import _once

_DTYPES = (jnp.bfloat16, jnp.float16)
_KERNELS: dict | None = None  # found once
# Tests set this to stand-in kernels of the same signatures (CPU has no Mosaic GPU); it also
# lifts the device check.
TEST_KERNELS: dict | None = None


def kernels() -> dict:
  """``{"ragged_dot", "transposed_ragged_dot" (or None), "transpose_rhs", "error"}``.

  ``ragged_dot`` is None (and ``error`` says why) when this jax ships no Mosaic GPU ragged dot.
  """
  global _KERNELS
  if TEST_KERNELS is not None:
    return TEST_KERNELS
  if _KERNELS is None:
    found: dict = {"ragged_dot": None, "transposed_ragged_dot": None, "transpose_rhs": False,
                   "error": None}
    try:
      from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

      found["ragged_dot"] = ragged_dot_mgpu.ragged_dot
      found["transpose_rhs"] = "transpose_rhs" in inspect.signature(
          ragged_dot_mgpu.ragged_dot).parameters
    except Exception as e:  # ImportError, or a jax whose module fails to import
      found["error"] = f"{type(e).__name__}: {e}"
    try:
      from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

      found["transposed_ragged_dot"] = transposed_ragged_dot_mgpu.transposed_ragged_dot
    except Exception:
      pass  # drhs then runs through lax.ragged_dot_general
    _KERNELS = found
  return _KERNELS


def hopper_refusal(dtype) -> str | None:
  """Why a Hopper bf16/f16 kernel cannot run on the default device for ``dtype`` (None: it
  can): the ``"mgpu"`` and ``"hopper"`` backends' shared device check."""
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return f"the default device is {dev.platform}, not a GPU"
  cc = str(getattr(dev, "compute_capability", ""))
  if not cc.startswith("9."):
    return f"the GPU has compute capability {cc or 'unknown'}, the kernel is for Hopper (9.x)"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _DTYPES]:
    return f"dtype {jnp.dtype(dtype).name}: the kernel takes bfloat16 or float16"
  return None


def unavailable_reason(dtype) -> str | None:
  """Why the Mosaic GPU backend cannot run on the default device for ``dtype`` (None: it can)."""
  if TEST_KERNELS is not None:
    return None
  why = hopper_refusal(dtype)
  if why is not None:
    return why
  k = kernels()
  if k["ragged_dot"] is None:
    return f"this jax ({jax.__version__}) has no Mosaic GPU ragged dot ({k['error']})"
  return None


def _grid_block_n(n: int, tn: int, want: int) -> int:
  # The kernel's column super-blocks must tile the columns: the largest power of two <= want
  # that divides n / tn.
  g = max(1, want)
  while g > 1 and (n // tn) % g:
    g //= 2
  return g


def _kernel_call(name: str, lhs, rhs, sizes, **kw):
  """JAX's kernel ``name`` on ``(lhs, rhs, group_sizes=sizes, **kw)``: lowered once a process
  (``_once``), or the tests' stand-in as it is."""
  fn = kernels()[name]
  if TEST_KERNELS is not None:
    return fn(lhs, rhs, group_sizes=sizes, **kw)
  return _once.call((name, tuple(sorted(kw.items()))),
                    lambda a, b, s: fn(a, b, group_sizes=s, **kw), lhs, rhs, sizes, keep=True)


def _ragged(lhs, rhs, sizes, tiling, transpose_rhs: bool):
  k = kernels()
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  kw = dict(block_m=tiling.tm, block_n=tiling.tn, block_k=tiling.tk,
            max_concurrent_steps=tiling.num_stages,
            grid_block_n=_grid_block_n(n, tiling.tn, tiling.grid_block_n))
  if transpose_rhs:
    if k["transpose_rhs"]:
      kw["transpose_rhs"] = True
    else:  # an older kernel: one copy of the weights, transposed
      rhs = jnp.swapaxes(rhs, 1, 2)
  return _kernel_call("ragged_dot", lhs, rhs, sizes, **kw)


def _transposed(lhs, dy, sizes, tiling):
  """``out[g] = lhs[rows of g]^T @ dy[rows of g]``, ``[G, K, N]`` in ``lhs``'s dtype."""
  k = kernels()
  if k["transposed_ragged_dot"] is not None:
    return _kernel_call(
        "transposed_ragged_dot", lhs, dy, sizes, block_m=tiling.tm, block_n=tiling.tn,
        block_k=tiling.tk, max_concurrent_steps=tiling.num_stages,
        grid_block_n=_grid_block_n(dy.shape[1], tiling.tn, tiling.grid_block_n))
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, dy, sizes, dims,
                                    preferred_element_type=jnp.float32).astype(lhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, sizes, tiling):
  return _ragged(lhs, rhs, sizes, tiling, transpose_rhs=False)


def _fwd(lhs, rhs, sizes, tiling):
  return _gmm(lhs, rhs, sizes, tiling), (lhs, rhs, sizes)


def _bwd(tiling, res, dy):
  lhs, rhs, sizes = res
  dy = dy.astype(lhs.dtype)
  dlhs = _ragged(dy, rhs, sizes, tiling, transpose_rhs=True)
  drhs = _transposed(lhs, dy, sizes, tiling).astype(rhs.dtype)
  return dlhs, drhs, None


_gmm.defvjp(_fwd, _bwd)


def gmm_mgpu(lhs, rhs, group_sizes, tiling) -> jax.Array:
  """``out[rows of g] = lhs[rows of g] @ rhs[g]`` over *packed* groups (no alignment).

  Group ``g`` holds rows ``[sum_{h<g} s_h, sum_{h<=g} s_h)``; rows past the last group are
  computed with the last group's ``rhs`` (see the module docstring).  Differentiable in ``lhs``
  and ``rhs``.  ``tiling``: ``tm``/``tn``/``tk`` = the kernel's ``block_m``/``block_n``/
  ``block_k``, ``num_stages`` = ``max_concurrent_steps``, ``grid_block_n``; ``num_warps`` is
  unused (one warpgroup a program).
  """
  why = unavailable_reason(lhs.dtype)
  if why is not None:
    raise RoutingError(f"dynjax.route.gmm: backend='mgpu' cannot run here: {why}; use "
                       "backend='pallas' (Triton) or 'xla'")
  if lhs.dtype != rhs.dtype:
    raise RoutingError(f"dynjax.route.gmm: backend='mgpu' needs lhs and rhs of one dtype, got "
                       f"{lhs.dtype} and {rhs.dtype}; cast rhs")
  m = lhs.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  sizes = sizes.at[-1].add(m - jnp.sum(sizes))
  return _gmm(lhs, rhs, sizes, tiling)
