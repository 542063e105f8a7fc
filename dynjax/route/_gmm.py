"""Grouped GEMM over tile-aligned groups of rows: the kernel of the ``"grouped"`` routed mode.

Layout.  ``lhs [M, K]`` holds the rows of ``G`` groups one after another, each group starting
on a multiple of the row tile ``tm`` (so a group is padded by at most ``tm - 1`` rows, never to a
capacity).  ``tile_group [M / tm]`` names the group of every row tile (``G``: the tile is past
the last group, unused).  :func:`gmm` computes ``out[rows of g] = lhs[rows of g] @ rhs[g]``.

Kernels, chosen by ``backend``:

- ``"pallas"`` on GPU: one Pallas (Triton) launch over ``(column tiles, row tiles)``; a program
  reads its group id from ``tile_group``, runs a ``fori_loop`` over ``K / tk`` blocks of
  ``lhs[tile] @ rhs[g]`` with a float32 accumulator and writes the tile.  Unused tiles write
  zeros.  On CPU the same kernel runs in Pallas interpret mode (slow: for tests).
- ``"pallas"`` on TPU: ``jax.experimental.pallas.ops.tpu.megablox.gmm`` on the same layout
  (group sizes = the tile-padded sizes).
- ``"hopper"`` on Hopper GPUs: a warp-specialized Mosaic GPU kernel (JAX's Hopper matmul with a
  group per row tile; see ``_hopper.py``) on the same tile-aligned layout; backward as
  ``"pallas"``.
- ``"mgpu"`` on Hopper GPUs: JAX's Mosaic GPU ragged-dot kernels (wgmma + TMA; see
  ``_mgpu.py``), on *packed* groups (row alignment 1: no tile padding at all).
- ``"xla"``: ``lax.ragged_dot`` on the same layout (portable; rows past the last group are 0).

Backward (``jax.custom_vjp``, Pallas kernels): ``dlhs = gmm(dy, rhs^T)`` (the same kernel,
reading ``rhs[g]`` transposed, no copy of the weights) and ``drhs[g] = lhs[rows of g]^T @
dy[rows of g]`` (``tgmm``: a launch over ``(N / tn, K / tk, G)`` that loops over the group's row
tiles; an empty group gets zeros).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dynjax._errors import RoutingError

BACKENDS = ("auto", "pallas", "hopper", "mgpu", "xla")


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Block sizes of the grouped GEMM (powers of two; ``K`` and ``N`` must divide by them).

  Attributes:
    tm: row tile; also the alignment of every group (at most ``tm - 1`` padding rows a group).
    tk: contraction block of the inner loop.
    tn: column tile.
    num_warps: Triton warps per program (GPU; unused by ``"mgpu"``: one warpgroup).
    num_stages: Triton software-pipelining depth (GPU); ``"mgpu"``: the kernel's
      ``max_concurrent_steps`` (copies in flight).
    grid_block_n: ``"mgpu"`` only: column tiles a program sweeps before the next row tile
      (the kernel's ``grid_block_n``; clamped to divide the column tiles).
    fuse_activation: in the ``"grouped"`` layer, apply the FFN activation in the first GEMM's
      epilogue (float32, before the bf16 store) when the layer is not differentiated: one
      write and one read of the ``[rows, ffn]`` hidden less.  Under ``jax.grad`` the forward
      stores the pre-activation instead (the backward needs it).

  Example:
    >>> dynjax.route.Tiling(tm=128, tk=64, tn=128, num_warps=8, num_stages=3)
  """

  tm: int = 128
  tk: int = 64
  tn: int = 128
  num_warps: int = 8
  num_stages: int = 3
  fuse_activation: bool = True
  grid_block_n: int = 1

  def __post_init__(self):
    bad = [f"{name}={getattr(self, name)!r}" for name in ("tm", "tk", "tn")
           if not isinstance(getattr(self, name), int) or getattr(self, name) < 1
           or getattr(self, name) & (getattr(self, name) - 1)]
    if bad:
      raise RoutingError(f"dynjax.route.Tiling: block sizes must be powers of two, got "
                         f"{', '.join(bad)}")

  @classmethod
  def auto(cls, rows: int, num_groups: int, backend: str = "pallas") -> Tiling:
    """The default tiling for ``rows`` routed rows (cells x k) over ``num_groups`` groups.

    ``backend="mgpu"``: 128x64x128 blocks, 4 copies in flight, 4 column tiles per row tile.
    ``backend="hopper"``: ``HOPPER_TILING`` (128-row tiles) up to 16 groups, else
    ``HOPPER_TILING_MANY`` (64-row tiles).

    Tile alignment pads each group by ``tm / 2`` rows on average: 128-row tiles while that is
    at most 1/8 of the rows (8 experts, 8,192 rows: 6%), else 64-row tiles (64 experts, 8,192
    rows: 128-row tiles would add ~50% rows, 64-row ones ~25%).

    Example:
      >>> dynjax.route.Tiling.auto(8192, 64).tm
      64
    """
    if backend == "mgpu":
      return MGPU_TILING
    if backend == "hopper":
      # By the paths alone (one tiling, so one kernel, for every call shape): 128-row tiles
      # up to 16 paths, else 64.  Measured (H100, 8,192 tokens, k=1): 8 experts 128-row 0.50-
      # 0.51 ms, 64-row 0.58-0.64; 64 experts 64-row 0.74, 128-row 0.80 (tile padding: 64
      # paths x 64 rows on average at 128-row tiles).
      return HOPPER_TILING if num_groups <= 16 else HOPPER_TILING_MANY
    # Measured (H100, jax 0.11.2, bf16, d=1024, ffn=4096, 8,192 tokens, k=1, the whole
    # grouped layer): 8 experts: 128x64x128 w8 s3 0.556 ms (128x64x256 0.656, 64-row tiles
    # 0.77); 64 experts uniform: 64x64x128 w4 s4 0.926 ms (128x64x128 1.244); but 64 experts
    # Zipf(1.2): 128x64x128 0.998, 64x64x128 1.114 (few experts hold most rows).
    if num_groups * 128 / 2 <= rows / 8:
      return cls()
    return cls(tm=64, tk=64, tn=128, num_warps=4, num_stages=4)


# "hopper": 128-row tiles of 2 x 128 columns (two compute warpgroups), 64-deep k blocks, 4
# copies in flight, a snake 8 row tiles wide.
HOPPER_TILING = Tiling(tm=128, tk=64, tn=128, num_warps=4, num_stages=4, grid_block_n=8)
HOPPER_TILING_MANY = dataclasses.replace(HOPPER_TILING, tm=64)  # many paths: less padding
HOPPER_MIN_ROWS = 8192  # routed rows the grouped layer's smallest "hopper" buffer holds: buffer_rows
# Power-of-two buffer classes up to this many rows: off.  H100 (session 7) e2e: no cold-start
# gain (its length buckets fall in 2 classes either way: 22.3 s floor only, 24.5 s with the
# classes, another host), and a buffer rounded past the rows a routing fills sends the layer's
# dlhs to the Triton kernel (the ragged dot spends a full tile on every row tile past the
# groups).  A serving model with many buckets past 8,192 rows would compile fewer kernels.
HOPPER_POW2_ROWS = 0

# Measured (H100, jax 0.11.2, bf16, 8 experts, 8,192 rows; GEMM 1 / GEMM 2 ms, min of 20): s4 g1
# 0.210 / 0.234, s6 g1 0.205 / 0.209, s4 g4 0.197 / 0.210 (a slice copy included in each).
MGPU_TILING = Tiling(tm=128, tk=64, tn=128, num_warps=4, num_stages=4, grid_block_n=4)


def row_alignment(tiling: Tiling, backend: str) -> int:
  """Rows a group is aligned to in :func:`gmm`'s layout: ``tiling.tm``, or 1 for ``"mgpu"``."""
  return 1 if backend == "mgpu" else tiling.tm


def buffer_rows(rows: int, num_groups: int, tiling: Tiling, backend: str) -> int:
  """Static row count of the grouped buffer that holds ``rows`` rows in ``num_groups`` groups
  (a multiple of ``tiling.tm``; any routing fits)."""
  if backend == "mgpu":
    unit = max(tiling.tm, tiling.tk)
    return max(unit, -(-rows // unit) * unit)
  bound = num_tiles(rows, num_groups, tiling.tm) * tiling.tm
  if backend == "hopper":
    from dynjax.route._hopper import pairs_tiles  # noqa: PLC0415

    # Paired row tiles (_hopper.PAIR_TILES): the last pair's second tile may start at the
    # groups' bound, so the buffer holds one tile more (64 rows of d).
    bound += tiling.tm if pairs_tiles(tiling.tm) else 0
    # At least the bound of HOPPER_MIN_ROWS routed rows (then, where HOPPER_POW2_ROWS is set,
    # the next power of two up to it): the kernel walks only the groups' tiles (a bound read at
    # run time), so extra rows cost no forward compute, and call shapes up to the floor share a
    # buffer shape, hence a kernel pair: Mosaic GPU compiles a kernel once a process (cached by
    # its hash), ~1-1.5 s each on the H100.  The price: the row gather writes the extra rows'
    # zeros (18 MB at 9,088 rows of d=1024 bf16: ~6-8 us on the H100), and the backward's dlhs
    # runs the Triton kernel (see _hopper_bwd).  A floor of HOPPER_MIN_ROWS buffer rows (session
    # 7) put the e2e's 512-token bucket (8,192 routed rows) in a second class.
    floor = hopper_floor_rows(num_groups, tiling.tm)
    if bound <= floor:
      return floor
    if bound <= HOPPER_POW2_ROWS:
      return max(tiling.tm, 1 << (bound - 1).bit_length())
  return bound


# "auto" on a Hopper GPU in bf16/f16 takes "hopper" (the warp-specialized kernel) where the
# widths tile (K a multiple of tk, N of 2 tn).  Measured (H100, jax 0.11.2, bf16, d=1024,
# ffn=4096, 8,192 tokens, the whole layer side by side; runs 5 / 6 of bench_moe_kernels,
# session 7), median ms, hopper / mgpu / capacity 1.25 (drops tokens): 8 experts uniform k=1
# 0.509 / 0.609 / 0.530 and 0.548 / 0.620 / 0.587; Zipf(1.2) 0.564 / 0.633 / 0.542; uniform
# k=2 0.720 / 0.935 / 0.951; 64 experts uniform k=1 0.743 / 0.925 / 0.702 and 0.802 / 1.065 /
# 0.854 (Triton 1.007 in run 4).  Its two kernels compile in ~1-1.5 s each (mgpu's: 2-7 s).  Otherwise JAX's Mosaic GPU ragged dot
# ("mgpu") where its ``num_groups - 1`` extra row tiles (a tile holding the end of one group and
# the start of the next is computed once per group) are at most ``MGPU_MAX_EXTRA_TILES`` of the
# rows: 8 experts uniform k=1 mgpu 0.589 ms, Triton 0.664; 64 experts mgpu 1.19, Triton 0.93
# (an earlier run).
MGPU_MAX_EXTRA_TILES = 1 / 8
# jnp.searchsorted's method for each row tile's group: "compare_all" (one [tiles, groups]
# compare and sum: one fusion) or "scan" (a while loop of log2(groups) steps, each its own
# lowered function).  H100, jax 0.11.2, the e2e MoE encoder's 4 length buckets, plain jax.jit
# (benchmarks/probe_moe_build.py, session 18): lowering 0.25-0.29 s against 0.43-0.51 with
# "scan", the same outputs (checksums), compile within its noise (12.8-15.4 s).
TILE_GROUP_SEARCH = "compare_all"


def hopper_floor_rows(num_groups: int, tm: int) -> int:
  """The smallest buffer of the grouped layer's ``"hopper"`` kernel: the tile bound of
  ``HOPPER_MIN_ROWS`` routed rows (8 paths, 128-row tiles: 9,088), so that every call shape up
  to that many routed rows shares one buffer shape, hence one kernel pair."""
  from dynjax.route._hopper import pairs_tiles  # noqa: PLC0415

  return (num_tiles(HOPPER_MIN_ROWS, num_groups, tm) + pairs_tiles(tm)) * tm


def hopper_fits(widths, tiling: Tiling | None = None) -> bool:
  """Whether every ``(K, N)`` of ``widths`` tiles for the ``"hopper"`` kernel."""
  t = tiling or HOPPER_TILING
  return all(k % t.tk == 0 and n % (2 * t.tn) == 0 for k, n in widths)


def resolve_backend(backend: str, dtype, rows: int | None = None,
                    num_groups: int | None = None, widths=None,
                    tiling: Tiling | None = None) -> str:
  """``"auto"`` -> ``"xla"`` on CPU, ``"pallas"`` on TPU; on GPU ``"hopper"`` where that
  kernel runs (Hopper, bf16/f16) and the ``(K, N)`` pairs of ``widths`` tile for it at
  ``tiling`` (default ``HOPPER_TILING``; None widths: assumed to), else ``"mgpu"`` where JAX's Mosaic GPU ragged dot runs and its
  ``num_groups - 1`` extra row tiles are at most ``MGPU_MAX_EXTRA_TILES`` of the ``rows``
  (unknown ``rows``: assumed many), else ``"pallas"``.  Other names unchanged.

  Example:
    >>> resolve_backend("auto", jnp.bfloat16, rows=8192, num_groups=8)   # H100: "hopper"
  """
  if backend != "auto":
    return backend
  platform = _platform()
  if platform == "cpu":
    return "xla"
  if platform == "gpu":
    from dynjax.route import _hopper, _mgpu

    if _hopper.unavailable_reason(dtype) is None and (
        widths is None or hopper_fits(widths, tiling)):
      return "hopper"
    few = rows is None or num_groups is None or (
        (num_groups - 1) * MGPU_TILING.tm <= MGPU_MAX_EXTRA_TILES * rows)
    if few and _mgpu.unavailable_reason(dtype) is None:
      return "mgpu"
  return "pallas"


def num_tiles(rows: int, num_groups: int, tm: int) -> int:
  """Static number of row tiles that holds ``rows`` rows in ``num_groups`` tile-aligned groups.

  ``sum_g ceil(l_g / tm) <= (rows + G (tm - 1)) / tm``, and never more tiles than rows.
  """
  if rows <= 0:
    return 0
  return max(1, min(rows, (rows + num_groups * (tm - 1)) // tm))


def _compiler_params(tiling: Tiling, dtype):
  # Triton's parameters also select the Triton backend (not Mosaic GPU) for pl.pallas_call.
  try:
    from jax.experimental.pallas import triton as plt

    cls = plt.CompilerParams
  except (ImportError, AttributeError):  # older jax
    cls = pl.TritonCompilerParams
  stages = tiling.num_stages
  if jnp.dtype(dtype).itemsize >= 4:
    # float32 blocks are twice the bytes: 3 stages of 128x64 + 64x128 plus the epilogue asked
    # the H100 for 256 KiB of shared memory (232 KiB available).  2 stages fit.
    stages = min(stages, 2)
  return cls(num_warps=tiling.num_warps, num_stages=stages)


def _platform() -> str:
  return jax.devices()[0].platform


def _gmm_kernel(tg_ref, lhs_ref, rhs_ref, out_ref, *, tiling, num_groups, k_blocks,
                transpose_rhs, activation):
  tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
  # Grid (column blocks, row tiles): axis 0 varies fastest on GPU (blockIdx.x), so programs
  # running together share one row tile (read from HBM once, then L2) and consecutive row tiles
  # mostly share their group's weights.  Row tiles fastest would stream the whole lhs once per
  # column block: for the second FFN GEMM (lhs = the [rows, 4096] hidden, 64 MB at 8,192 bf16
  # rows, above the H100's 50 MB L2) that is 8 passes over HBM.
  n = pl.program_id(0)
  t = pl.program_id(1)
  g = tg_ref[t]
  rows = pl.ds(pl.multiple_of(t * tm, tm), tm)
  cols = pl.ds(pl.multiple_of(n * tn, tn), tn)

  @pl.when(g < num_groups)
  def _():
    def body(i, acc):
      ks = pl.ds(pl.multiple_of(i * tk, tk), tk)
      a = lhs_ref[rows, ks]
      if transpose_rhs:  # rhs[g] is [N_out, K]: contract both on their axis 1
        b = rhs_ref[g, cols, ks]
        dims = (((1,), (1,)), ((), ()))
      else:
        b = rhs_ref[g, ks, cols]
        dims = (((1,), (0,)), ((), ()))
      return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros((tm, tn), jnp.float32))
    if activation is not None:
      acc = activation(acc)
    out_ref[rows, cols] = acc.astype(out_ref.dtype)

  @pl.when(g >= num_groups)
  def _():
    out_ref[rows, cols] = jnp.zeros((tm, tn), out_ref.dtype)


def _tgmm_kernel(start_ref, count_ref, lhs_ref, dy_ref, out_ref, *, tiling):
  tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
  # Grid (N blocks, K blocks, groups): programs running together work on one group, whose rows
  # of lhs and dy then stay in L2 (see _gmm_kernel).
  ns = pl.ds(pl.multiple_of(pl.program_id(0) * tn, tn), tn)
  ks = pl.ds(pl.multiple_of(pl.program_id(1) * tk, tk), tk)
  g = pl.program_id(2)
  start = start_ref[g]

  def body(t, acc):
    rows = pl.ds(pl.multiple_of(t * tm, tm), tm)
    a = lhs_ref[rows, ks]
    b = dy_ref[rows, ns]
    return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(start, start + count_ref[g], body, jnp.zeros((tk, tn), jnp.float32))
  out_ref[g, ks, ns] = acc.astype(out_ref.dtype)


def _check_dims(where: str, tiling: Tiling, **dims) -> None:
  bad = [f"{name}={v} (block {b})" for name, (v, b) in dims.items() if v % b]
  if bad:
    raise RoutingError(f"dynjax.route.{where}: dimensions must be multiples of the tiling "
                       f"{tiling}: {', '.join(bad)}; pick smaller blocks or use backend='xla'")


def _pallas_gmm(lhs, rhs, tile_group, tiling: Tiling, transpose_rhs: bool, activation=None):
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  _check_dims("gmm", tiling, M=(m, tiling.tm), K=(k, tiling.tk), N=(n, tiling.tn))
  interpret = _platform() == "cpu"
  kernel = functools.partial(_gmm_kernel, tiling=tiling, num_groups=g, k_blocks=k // tiling.tk,
                             transpose_rhs=transpose_rhs, activation=activation)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
      grid=(n // tiling.tn, m // tiling.tm), interpret=interpret,
      compiler_params=None if interpret else _compiler_params(tiling, lhs.dtype),
      name="dynjax_gmm_t" if transpose_rhs else "dynjax_gmm",
  )(tile_group, lhs, rhs)


def _pallas_tgmm(lhs, dy, group_start, group_count, num_groups: int, out_dtype, tiling: Tiling):
  m, k = lhs.shape
  n = dy.shape[1]
  _check_dims("gmm", tiling, M=(m, tiling.tm), K=(k, tiling.tk), N=(n, tiling.tn))
  interpret = _platform() == "cpu"
  return pl.pallas_call(
      functools.partial(_tgmm_kernel, tiling=tiling),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      grid=(n // tiling.tn, k // tiling.tk, num_groups), interpret=interpret,
      compiler_params=None if interpret else _compiler_params(tiling, lhs.dtype),
      name="dynjax_tgmm",
  )(group_start, group_count, lhs, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gmm_pallas_vjp(lhs, rhs, tile_group, group_start, group_count, tiling, activation):
  # Not differentiated: the activation (if any) runs in the kernel's epilogue.
  return _pallas_gmm(lhs, rhs, tile_group, tiling, transpose_rhs=False, activation=activation)


def _fwd(lhs, rhs, tile_group, group_start, group_count, tiling, activation):
  pre = _pallas_gmm(lhs, rhs, tile_group, tiling, transpose_rhs=False)
  out = pre if activation is None else activation(pre).astype(pre.dtype)
  return out, (lhs, rhs, tile_group, group_start, group_count, pre)


def _pre_activation_cotangent(activation, pre, dy, dtype):
  """The cotangent of the stored pre-activation ``pre`` (both GPU backwards), in ``dtype``."""
  if activation is not None:
    _, act_vjp = jax.vjp(lambda h: activation(h).astype(h.dtype), pre)
    (dy,) = act_vjp(dy.astype(pre.dtype))
  return dy.astype(dtype)


def _bwd(tiling, activation, res, dy):
  lhs, rhs, tile_group, group_start, group_count, pre = res
  dy = _pre_activation_cotangent(activation, pre, dy, lhs.dtype)
  dlhs = _pallas_gmm(dy, rhs, tile_group, tiling, transpose_rhs=True)
  drhs = _pallas_tgmm(lhs, dy, group_start, group_count, rhs.shape[0], rhs.dtype, tiling)
  return dlhs, drhs, None, None, None


_gmm_pallas_vjp.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _gmm_hopper_vjp(lhs, rhs, tile_group, group_start, group_count, tiling, activation, skip,
                    waves):
  from dynjax.route._hopper import hopper_gmm  # noqa: PLC0415 - Mosaic GPU, Hopper only

  return hopper_gmm(lhs, rhs, group_start + group_count, tiling, activation, skip, waves)


def _hopper_fwd(lhs, rhs, tile_group, group_start, group_count, tiling, activation, skip,
                waves):
  from dynjax.route._hopper import hopper_gmm  # noqa: PLC0415

  pre = hopper_gmm(lhs, rhs, group_start + group_count, tiling, None, skip, waves)
  out = pre if activation is None else activation(pre).astype(pre.dtype)
  return out, (lhs, rhs, tile_group, group_start, group_count, pre)


def _hopper_bwd(tiling, activation, skip, waves, res, dy):
  """``drhs``: JAX's Mosaic GPU transposed ragged dot on the tile-aligned sizes (it walks only
  the groups' rows) where this jax has it; ``dlhs``: its ragged dot on the transposed weights,
  except where the buffer has more rows than any routing fills (``skip`` is then the rows a
  routing can fill: that kernel spends a full tile on every row tile past the groups), which
  run the Triton kernel (a tile past the groups stores zeros and computes nothing).  Measured
  (H100, 8 experts, a training step of the layer): 1.39-1.55 ms with the Mosaic GPU backward,
  1.73 with Triton's.  Rows past the groups' tiles: with ``skip`` nobody reads them (their
  cotangents are the layout's zeros and their gradients are dropped), so the sizes stop at the
  groups; without, the forward gave them to the last group and so does the backward."""
  from dynjax.route import _mgpu  # noqa: PLC0415

  lhs, rhs, tile_group, group_start, group_count, pre = res
  triton = Tiling(tm=tiling.tm, tk=tiling.tk, tn=tiling.tn)
  k = _mgpu.kernels()
  if k["ragged_dot"] is None or _mgpu.unavailable_reason(lhs.dtype) is not None:
    return _bwd(triton, activation, res, dy)
  dy = _pre_activation_cotangent(activation, pre, dy, lhs.dtype)
  sizes = group_count * tiling.tm
  # The ragged dot's row block = our row tile: no group straddles a block.
  t = dataclasses.replace(MGPU_TILING, tm=tiling.tm, tk=min(MGPU_TILING.tk, tiling.tk),
                          tn=min(MGPU_TILING.tn, tiling.tn))
  if skip and lhs.shape[0] > skip:
    dlhs = _pallas_gmm(dy, rhs, tile_group, triton, transpose_rhs=True)
  else:
    dlhs = _mgpu._ragged(dy, rhs, sizes, t, transpose_rhs=True)  # noqa: SLF001 - our module
  drhs = _mgpu._transposed(lhs, dy, sizes, t).astype(rhs.dtype)  # noqa: SLF001
  return dlhs, drhs, None, None, None


_gmm_hopper_vjp.defvjp(_hopper_fwd, _hopper_bwd)


def hopper_grouped(lhs, rhs, sizes, tiling: Tiling, activation, skip_unused: int = 0,
                   wave_rows: int = 0):
  """The ``"hopper"`` backend of :func:`gmm`.  ``skip_unused`` (the grouped layer): the row
  tiles past the groups' are not computed (their rows are left unwritten), and its value is
  the rows a routing can fill (``lhs`` may have more: see ``buffer_rows``).  ``wave_rows``:
  the rows the kernel's column tile is chosen for (default: ``skip_unused`` or all)."""
  from dynjax.route._hopper import unavailable_reason  # noqa: PLC0415

  why = unavailable_reason(lhs.dtype)
  if why is not None:
    raise RoutingError(f"dynjax.route.gmm: backend='hopper' cannot run here: {why}; use "
                       "backend='pallas' (Triton) or 'xla'")
  m, tm = lhs.shape[0], tiling.tm
  tile_group, start, count = group_tiles(sizes, m // tm, tm)
  if not skip_unused:
    # Row tiles past the last group's belong to the last group, forward and backward (the
    # kernel computes them with its weights rather than branching to store zeros).
    last = rhs.shape[0] - 1
    tile_group = jnp.minimum(tile_group, last)
    count = count.at[last].set(m // tm - start[last])
  fused = activation if tiling.fuse_activation else None
  out = _gmm_hopper_vjp(lhs, rhs.astype(lhs.dtype), tile_group, start, count, tiling, fused,
                        skip_unused, wave_rows)
  return out if fused is activation else activation(out).astype(out.dtype)


def group_tiles(group_sizes: jax.Array, num_row_tiles: int, tm: int):
  """``(tile_group [T], group_start [G], group_count [G])`` of tile-aligned groups.

  ``group_start[g]``/``group_count[g]``: first row tile and number of row tiles of group ``g``.
  """
  sizes = group_sizes.astype(jnp.int32)
  count = (sizes + tm - 1) // tm
  end = jnp.cumsum(count)
  start = end - count
  tile_group = jnp.searchsorted(end, jnp.arange(num_row_tiles, dtype=jnp.int32), side="right",
                                method=TILE_GROUP_SEARCH)
  return tile_group.astype(jnp.int32), start.astype(jnp.int32), count.astype(jnp.int32)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, tiling: Tiling = Tiling(),
        backend: str = "auto", activation=None) -> jax.Array:
  """Grouped matmul over tile-aligned groups: ``out[rows of g] = lhs[rows of g] @ rhs[g]``.

  Group ``g`` holds ``group_sizes[g]`` rows starting at row ``a * sum_{h<g} ceil(
  group_sizes[h] / a)``, ``a = row_alignment(tiling, backend)`` (``tm``; 1 for ``"mgpu"``); the
  rows between a group's end and the next tile boundary are padding (computed, their values are
  whatever ``lhs`` holds there), rows after the last group's tiles come out 0 (``"mgpu"``: they
  are computed with the last group's ``rhs``).  Differentiable in ``lhs`` and ``rhs``.

  Args:
    lhs: ``[M, K]``, ``M`` a multiple of ``tiling.tm``.
    rhs: ``[G, K, N]``.
    group_sizes: int32 ``[G]`` (traced is fine).
    tiling: block sizes (:class:`Tiling`).
    backend: ``"pallas"`` (Triton on GPU, megablox on TPU, interpret mode on CPU: slow, for
      tests), ``"hopper"`` (Hopper, bf16/f16: a warp-specialized Mosaic GPU kernel, the same
      tile-aligned groups; rows past the last group's tiles belong to the last group, in the
      forward and the backward), ``"mgpu"`` (Hopper: JAX's Mosaic GPU ragged dot, packed
      groups), ``"xla"`` (``lax.ragged_dot`` on the tile-padded sizes) or ``"auto"`` (see
      :func:`resolve_backend`).
    activation: optional elementwise function applied to the output, ``activation(lhs @ rhs)``
      (fused into the Pallas GPU kernel's epilogue when not differentiated and
      ``tiling.fuse_activation``; rows past the last group's tiles hold 0 or ``activation(0)``).

  Example:
    >>> lhs = jnp.ones((256, 64), jnp.bfloat16); rhs = jnp.ones((4, 64, 128), jnp.bfloat16)
    >>> y = gmm(lhs, rhs, jnp.array([100, 0, 28, 0]), tiling=Tiling(tm=64, tk=64, tn=128))
  """
  if backend not in BACKENDS:
    raise RoutingError(f"dynjax.route.gmm: backend must be one of "
                       f"{', '.join(map(repr, BACKENDS))}, got {backend!r}")
  backend = resolve_backend(backend, lhs.dtype, widths=(rhs.shape[1:],), tiling=tiling)
  m = lhs.shape[0]
  tm = tiling.tm
  if m % tm:
    raise RoutingError(f"dynjax.route.gmm: lhs has {m} rows, expected a multiple of the row "
                       f"tile tm={tm}; pad the rows (see dynjax.route.grouped_layout)")
  sizes = group_sizes.astype(jnp.int32)
  if backend == "hopper":
    return hopper_grouped(lhs, rhs, sizes, tiling, activation)
  if backend == "mgpu":
    from dynjax.route._mgpu import gmm_mgpu

    out = gmm_mgpu(lhs, rhs.astype(lhs.dtype), sizes, tiling)
    return out if activation is None else activation(out).astype(out.dtype)
  padded = ((sizes + tm - 1) // tm) * tm
  unfused = activation is not None and (backend == "xla" or not tiling.fuse_activation or
                                        _platform() == "tpu")
  if backend == "xla":
    out = jax.lax.ragged_dot(lhs, rhs, padded).astype(lhs.dtype)
  elif _platform() == "tpu":
    from jax.experimental.pallas.ops.tpu import megablox

    out = megablox.gmm(lhs, rhs, padded, preferred_element_type=lhs.dtype,
                       tiling=(tiling.tm, tiling.tk, tiling.tn))
  else:
    tile_group, start, count = group_tiles(sizes, m // tm, tm)
    out = _gmm_pallas_vjp(lhs, rhs, tile_group, start, count, tiling,
                          None if unfused else activation)
  return activation(out).astype(out.dtype) if unfused else out
