"""The ``"hopper"`` backend of :func:`dynjax.route.gmm`: a warp-specialized grouped GEMM (Hopper).

The ``"mgpu"`` backend runs JAX's Mosaic GPU ragged dot: one warpgroup per program computes a
``tm x tn`` tile and issues its own copies, and a row tile that holds the end of one group and
the start of the next is computed once per group.  This kernel is JAX's warp-specialized Hopper
matmul (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``: a memory warpgroup streams the
operands through the tensor memory accelerator, two compute warpgroups each own half of a
``tm x 2*tn`` output tile and run wgmma, a persistent grid of one program per SM walks the tiles
in a snake order; here the halves are the tile's rows where ``tm`` is 128, and one wgmma group
stays in flight across k-steps: ``WG_SPLIT``, ``WGMMA_IN_FLIGHT``) on the *tile-aligned* layout
of the ``"pallas"`` backend: every ``tm``-row tile belongs to one group, so a tile reads its
group's weights ``rhs[g]`` and stores whole tiles (no ragged store ladder, no tile computed
twice).  The group of a tile comes from the tile ends of the groups (``G`` scalar reads per
tile).  Tiles past the last group are computed with the last group's weights, or
(``skip_unused``, the grouped layer) not at all: the loop then runs
over the groups' row tiles only, a bound read from device memory at run time, so a buffer
sized for any routing costs no compute beyond the routing it holds.

The activation of the FFN's first GEMM runs on the float32 accumulator before the store when the
layer is not differentiated.  The backward (``_gmm._hopper_bwd``) runs JAX's Mosaic GPU ragged
dots on the tile-aligned sizes, or the Triton kernels of the ``"pallas"`` backend.

Only on Hopper (compute capability 9.x) with bfloat16/float16 operands; the kernel is built by
Mosaic GPU (no interpret mode: the CPU tests lower it for CUDA, and the GPU run checks its
numbers).  Cost (H100, jax 0.11.2): see ``_gmm.resolve_backend``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dynjax import _jax_private
from dynjax._errors import RoutingError
from dynjax.route import _once

NUM_SMS = 132  # H100 SXM; the persistent grid (one program per SM) reads the device's count
# Tests set this to True: :func:`hopper_gmm` runs :func:`reference` (the same tile -> group
# rule in XLA) and the device check is lifted, so the CPU tests cover everything around it.
TEST_KERNEL = False
# The fused activation of a bfloat16 output runs with approximate transcendentals (tanh.approx.f32:
# relative error <= 2^-10.99, a quarter of bfloat16's rounding step; ex2.approx: 2 ulp of float32).
# H100, jax 0.11.2 (benchmarks/probe_moe_profile.py): GEMM 1 + GELU of the 8-expert FFN 142 ->
# 125 us (the same GEMM without the activation: 120 us), the layer 323 -> 307 us of device time;
# its error against a float32 reference unchanged (1.66e-3, bfloat16's rounding).
APPROX_BF16 = True
# How the two compute warpgroups share a tile: "n" its columns (tm x tn each), "m" its rows
# (tm/2 x 2 tn each: one m64n256 wgmma a k-step; only where tm/2 is a multiple of 64).
# WGMMA_IN_FLIGHT: wgmma groups left in flight across k-steps (1: a k-step's stage is released
# one step later, and the tensor cores are not left idle while a k-step waits for its own).
# H100, jax 0.11.2 (benchmarks/gpu_run_moe_knobs.sh, session 13), device us, n+0 -> m / w1 /
# m+w1: 8 experts GEMM 1 121.1 -> 119.6 / 116.9 / 115.7, GEMM 2 128.7 -> 127.2 / 134.5 / 128.3.
# The layer, n+0 -> m+w1 (another call): 8 experts k=1 306.0 -> 301.6 (Zipf 303.4 -> 299.3),
# k=2 468.1 -> 464.9; 64 experts (64-row tiles: w1 alone) 577.1 -> 556.7.  A few percent; the
# rest of the gap to cuBLAS is not these (64 x 256 warpgroup tiles at 64 experts: 333 vs 247;
# 3 stages with a 64 x 128 epilogue tile: GEMM 2 165 vs 129; GEMM 2 unhalved: 133).
WG_SPLIT = "m"
WGMMA_IN_FLIGHT = 1
# CHAIN_TILES: a program's output tiles run as one chain of pipelines (Pallas Mosaic GPU's
# "pipeline of pipelines", ``pipeline_state``): the memory warpgroup streams the next tile's
# first k-steps while the compute warpgroups finish a tile and run its epilogue, instead of
# each tile filling its pipeline from empty.  Pallas allows it where ``k_iters % num_stages
# == 0`` and no wgmma group stays in flight across k-steps (no ``delay_release``), so a chained
# kernel runs with ``wait=0``; it is used for 128-row tiles only.  H100, jax 0.11.2, device us
# (benchmarks/gpu_run_moe_chain.sh, results/probe_moe_profile_run17_chain_*), shipped -> chained:
# 8 experts, 8,192 tokens, GEMM 1 + GELU 122.2 -> 118.7, GEMM 2 127.9 -> 124.1 (Zipf 123.2 ->
# 118.4, 126.8 -> 122.9); the layer k=1 304.5 -> 293.7 (Zipf 301.8 -> 293.5), k=2 468.8 ->
# 459.2; 2,048 routed rows (the e2e's requests) GEMM 2 58.2 -> 56.3.  With 64-row tiles (64
# experts) the chained layer was slower: 559.3 -> 645.1 uniform, 635.3 -> 636.1 Zipf.  Run 16
# (each program's lone tile in a pipeline of its own: two pipelines in the program) was no
# faster and took 0.9-1.2 s to lower against 0.5-0.6 (CPU box, one GEMM of the e2e).
CHAIN_TILES = True
CHAIN_MIN_ROWS = 128  # row tiles of fewer rows stay unchained (64-row tiles: slower chained)
# PAIR_TILES (64-row tiles with ``skip_unused``, the grouped layer past 16 paths): a program
# computes two row tiles *of one group* at once (one a compute warpgroup, 64 x 256 each), so a
# weight tile crosses L2 once a pair of row tiles instead of once a row tile; a group with an
# odd count of row tiles leaves its last pair half used (the second warpgroup neither
# multiplies nor stores: PAIR_SKIP_MMA).  Each pair's group and first tile come from a table
# computed in XLA (:func:`pair_table`).  None: by device, on for the kinds in PAIRED_DEVICES.
# Session 31, H200 (jax 0.11.2): Nsight Compute found the 64-expert GEMMs bound by L2 (83-92%
# of its throughput, 80% of the traffic the weight tiles; benchmarks/gpu_run_moe_ncu.sh); the
# layer's device time (d=1024, ffn=4096, 8,192 tokens, k=1; benchmarks/gpu_run_moe_pairs.sh)
# unpaired -> paired: uniform 452.8 -> 422.3 us (the dropping layer 438.5), Zipf 493.5 ->
# 477.6 (dropping 435.8); errors against float32 unchanged (1.66e-3).  Session 16 measured an
# earlier form on an H100 (half pairs computed): uniform 557 -> 586 us, Zipf 635 -> 619, so the
# H100 stays unpaired until measured again.
PAIR_TILES: bool | None = None
PAIRED_DEVICES = ("H200",)
PAIR_SKIP_MMA = True  # a half pair's second warpgroup issues no wgmma (its rows are not stored)


def reference(lhs, rhs, tile_end, tiling, activation=None):
  """What the kernel computes, in XLA: each ``tm``-row tile times its group's ``rhs``."""
  m, k = lhs.shape
  tm = tiling.tm
  tiles = jnp.arange(m // tm, dtype=jnp.int32)
  g = jnp.sum(tile_end[:-1][None, :] <= tiles[:, None], axis=1)
  out = jnp.einsum("tmk,tkn->tmn", lhs.reshape(-1, tm, k).astype(jnp.float32),
                   rhs[g].astype(jnp.float32))
  if activation is not None:
    out = activation(out)
  return out.reshape(m, -1).astype(lhs.dtype)


def unavailable_reason(dtype) -> str | None:
  """Why the kernel cannot run on the default device for ``dtype`` (None: it can)."""
  if TEST_KERNEL:
    return None
  from dynjax.route._mgpu import hopper_refusal  # noqa: PLC0415

  why = hopper_refusal(dtype)
  if why is not None:
    return why
  # Found, not imported: a process whose kernels are kept on disk (route._once) never builds
  # one, and the import costs 0.40 s of a cold process on the H100 host (jax 0.11.2).
  try:
    found = importlib.util.find_spec("jax.experimental.pallas.mosaic_gpu") is not None
  except ImportError as e:
    found, why = False, str(e)
  if not found:
    return f"this jax ({jax.__version__}) has no Mosaic GPU Pallas ({why or 'no module'})"
  if _jax_private.mosaic_gpu_runtime() is None:
    return None
  try:  # the runtime not found the short way: this jax's own import decides
    _plgpu()
  except ImportError as e:
    return f"this jax ({jax.__version__}) has no Mosaic GPU Pallas ({e})"
  return None


def _plgpu():
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 - GPU only

  return plgpu


def _num_sms() -> int:
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or NUM_SMS) if dev.platform == "gpu" else NUM_SMS


def pair_slots(num_tiles: int, num_groups: int) -> int:
  """A bound on the pairs of row tiles of ``num_groups`` groups holding ``num_tiles`` tiles
  (``sum ceil(t_g / 2) <= (T + G) / 2``)."""
  return (num_tiles + num_groups) // 2 + 1


def pair_table(tile_end, num_groups: int, num_tiles: int):
  """The paired kernel's table, in XLA (small fusions, not timed apart: the layer's device
  times include them): ``[pairs, group of pair p...,
  2 * first row tile + (the next tile is the group's too)...]``, ``pair_slots`` entries each."""
  te = tile_end.astype(jnp.int32)
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), te[:-1]])
  pairs = (te - start + 1) // 2
  pair_end = jnp.cumsum(pairs)
  p = jnp.arange(pair_slots(num_tiles, num_groups), dtype=jnp.int32)
  g = jnp.sum((pair_end[None, :-1] <= p[:, None]).astype(jnp.int32), axis=1)
  first = start[g] + 2 * (p - (pair_end - pairs)[g])
  second = (first + 1 < te[g]).astype(jnp.int32)
  return jnp.concatenate([pair_end[-1:], g, 2 * first + second])


def pairs_tiles(tm: int) -> bool:
  """Whether a program computes two ``tm``-row tiles of one group (:data:`PAIR_TILES`: 64-row
  tiles, the warpgroups splitting rows); the grouped layer's buffer then has ``tm`` rows more
  than its groups can fill (:func:`dynjax.route._gmm.buffer_rows`), which the second tile of
  the last pair may read."""
  return _pairing() and WG_SPLIT == "m" and tm == 64


def _pairing() -> bool:
  if PAIR_TILES is not None:
    return PAIR_TILES
  dev = jax.devices()[0]
  kind = getattr(dev, "device_kind", "") or ""
  return dev.platform == "gpu" and any(k in kind for k in PAIRED_DEVICES)


def _body(tile_end_gmem, a_gmem, b_gmem, out_gmem, *, tm, tn, tk, stages, num_groups,
          activation, m_iters, n_iters, epi, snake, skip_unused, wg_m=False, wait=0,
          chain=False, pair=0):
  """One program per SM; the loop over output tiles ``(m_idx, n_idx)`` of ``tm x 2 tn``
  (``skip_unused``: only the row tiles of the groups, a loop bound read at run time).  The two
  compute warpgroups split a tile's columns (``tm x tn`` each), or with ``wg_m`` its rows
  (``tm/2 x 2 tn`` each: one ``m64n256`` wgmma a k-step where ``tm`` is 128); ``wait``: wgmma
  groups left in flight across k-steps (their stages released that much later); ``chain``:
  the program's tiles run as one chain of pipelines (:data:`CHAIN_TILES`); ``pair``
  (:data:`PAIR_TILES`, with ``wg_m`` and ``skip_unused``; ``KernelKey.pair``): a program's
  tile is two ``tm``-row tiles of one group, one a warpgroup, and ``tile_end_gmem`` holds
  :func:`pair_table`; 2: a half pair's second warpgroup issues no wgmma."""
  from jax.experimental import pallas as pl  # noqa: PLC0415

  plgpu = _plgpu()
  dtype = a_gmem.dtype
  itemsize = jnp.dtype(dtype).itemsize
  k_iters = a_gmem.shape[1] // tk
  swizzle = plgpu.find_swizzle(tk * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                plgpu.SwizzleTransform(swizzle))
  rows = 2 * tm if pair else tm  # a program's tile: rows x 2 tn
  wm, wn = (rows // 2, 2 * tn) if wg_m else (rows, tn)  # a compute warpgroup's share of it
  epi_m, epi_n = min(epi, wm), min(epi, wn)
  out_swizzle = plgpu.find_swizzle(epi_n * itemsize * 8)
  out_transforms = (plgpu.TilingTransform((8, out_swizzle // itemsize)),
                    plgpu.SwizzleTransform(out_swizzle))
  slots = min(2, (wm * wn) // (epi_m * epi_n))

  def pipeline(body, context, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=40, pipeline_state=state,
        in_specs=[
            plgpu.BlockSpec((rows, tk), lambda k: (0, k), transforms=transforms,
                            memory_space=plgpu.SMEM, delay_release=wait),
            plgpu.BlockSpec((tk, 2 * tn), lambda k: (k, 0), transforms=transforms,
                            memory_space=plgpu.SMEM, delay_release=wait),
        ],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages, compute_context=context)

  ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the bodies

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem.at[0]),
      out_smem=plgpu.SMEM((2, slots, epi_m, epi_n), dtype, transforms=out_transforms),
      collective_axes="wg")
  def _scope(allocs, out_smem):
    wg = lax.axis_index("wg")

    if pair:  # tile_end_gmem holds pair_table: the pairs, then each pair's group and tile
      rows_of_tiles = tile_end_gmem[0]
      slots = pair_slots(m_iters, num_groups)
    else:
      rows_of_tiles = tile_end_gmem[num_groups - 1] if skip_unused else m_iters

    @plgpu.nd_loop((rows_of_tiles * n_iters,), collective_axes="sm")
    def _tiles(info):
      (lin,) = info.index
      m_idx, n_idx = plgpu.planar_snake(lin, (rows_of_tiles, n_iters), 1, snake)
      if pair:  # m_idx counts pairs
        g = tile_end_gmem[1 + m_idx]
        code = tile_end_gmem[1 + slots + m_idx]
        mine = jnp.logical_or(wg == 0, (code & 1) == 1)  # this warpgroup's tile is the group's
        m_slice = pl.ds(lax.shift_right_logical(code, jnp.int32(1)) * tm, rows)
      else:
        g = jnp.int32(0)
        for i in range(num_groups - 1):  # the tile's group: how many groups end at or before
          g = g + (tile_end_gmem[i] <= m_idx).astype(jnp.int32)
        mine = None
        m_slice = pl.ds(m_idx * tm, tm)
      n_slice = pl.ds(n_idx * 2 * tn, 2 * tn)
      wg_rows = pl.ds(wg * wm, wm) if wg_m else slice(None)
      wg_cols = slice(None) if wg_m else pl.ds(wg * tn, tn)

      def context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
        def _acc(acc_ref):
          run(acc_ref)
          acc = acc_ref[...]
          if activation is not None:
            acc = activation(acc)
          acc = acc.astype(dtype)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

          def store():
            for mi in range(wm // epi_m):
              for ni in range(wn // epi_n):
                rs = slice(mi * epi_m, (mi + 1) * epi_m)
                cs = slice(ni * epi_n, (ni + 1) * epi_n)
                slot = (mi * (wn // epi_n) + ni) % 2
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg, slot] = acc[rs, cs]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg, slot],
                    out_gmem.at[m_slice, n_slice].at[wg_rows, wg_cols].at[rs, cs])

          if mine is None:
            store()
          else:  # a half pair's second tile: another group's rows, not stored
            pl.when(mine)(store)

      def mma(_, a_smem, b_smem, acc_ref):
        if mine is None or pair != 2:
          plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_smem.at[:, wg_cols])
        else:  # a half pair's second warpgroup multiplies nothing
          pl.when(mine)(lambda: plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_smem.at[:, wg_cols]))
        plgpu.wgmma_wait(wait)
        return acc_ref

      operands = (a_gmem.at[m_slice, :], b_gmem.at[g, :, n_slice])
      if not chain:
        pipeline(mma, context)(*operands, allocations=allocs)
        return
      # The chain: the program's first tile fills the stages (START), its last drains them
      # (STOP), the ones between start on stages the memory warpgroup filled while the tile
      # before finished (STEADY).  A program of one tile runs START alone: its memory
      # warpgroup skips the drain, which only readies the barriers for a next pipeline.
      local, count = info.local_index, info.num_local_steps
      states = plgpu.PipelinePipeline
      state = jnp.where(local == 0, jnp.int32(states.START),
                        jnp.where(local == count - 1, jnp.int32(states.STOP),
                                  jnp.int32(states.STEADY)))
      pipeline(mma, context, state)(*operands, allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def column_tile(m_tiles: int, n: int, tn: int, sms: int = NUM_SMS) -> int:
  """The column tile per warpgroup: ``tn``, or ``tn / 2`` where ``tn``'s output tiles fill
  the last wave of the ``sms`` programs badly and half-width tiles fill the waves better.

  Measured (H100, jax 0.11.2, bf16, 71 row tiles of 128): GEMM 2 of the FFN (N=1024: 284 tiles
  of 128 x 256 on 132 SMs, 2.15 waves) 0.213 ms, with 64-column tiles (4.3 waves) 0.180; GEMM 1
  (N=4096, 8.6 waves) 0.181 ms, 64-column tiles 0.201.  Session 17 (the layer at k=2, device
  time, GEMM 2 halved -> not): level at 8,192 routed rows (300.6 / 301.8 us), halved 7 us
  faster at 4,096, 13 us slower at 2,048 (benchmarks/results/probe_moe_profile_run15_*).
  """
  def fill(t):
    tiles = max(1, m_tiles) * (n // (2 * t))
    return tiles / (-(-tiles // sms) * sms)

  half = tn // 2
  if half >= 64 and n % (2 * half) == 0 and fill(tn) < 0.8 and fill(half) > fill(tn):
    return half
  return tn


def hopper_gmm(lhs, rhs, tile_end, tiling, activation=None, skip_unused: int = 0,
               wave_rows: int = 0):
  """``out[tile t] = activation(lhs[tile t] @ rhs[g(t)])`` over ``tiling.tm``-row tiles.

  ``tile_end`` int32 ``[G]``: one past the last row tile of each group (cumulative); a tile at
  or past ``tile_end[G-1]`` is computed with ``rhs[G-1]``, or with ``skip_unused`` (the rows
  any routing can fill, which may be fewer than ``lhs`` has) not at all (its rows are left
  unwritten: for callers that never read them).  Not differentiable by
  itself (see :func:`dynjax.route.gmm`).  ``tiling``: ``tm`` rows x ``2 tn`` columns an output
  tile (two compute warpgroups of ``tn`` columns; :func:`column_tile` may halve ``tn`` for the
  waves of ``wave_rows`` rows, default ``skip_unused`` or ``M``), ``tk``, ``num_stages`` copies
  in flight, ``grid_block_n`` the snake's tile width (row tiles a sweep covers).
  """
  m, k = lhs.shape
  g, k2, n = rhs.shape
  tm, tn, tk = tiling.tm, tiling.tn, tiling.tk
  bad = [f"{name}={v} (a multiple of {b})"
         for name, v, b in (("M", m, tm), ("K", k, tk), ("N", n, 2 * tn)) if v % b]
  if bad or k != k2:
    raise RoutingError(f"dynjax.route.gmm: backend='hopper' needs {', '.join(bad) or 'K equal'}"
                       f" for lhs {lhs.shape} and rhs {rhs.shape} with {tiling}; use "
                       "backend='pallas'")
  if TEST_KERNEL:
    out = reference(lhs, rhs, tile_end.astype(jnp.int32), tiling, activation)
    if skip_unused:  # unwritten rows: NaN here, so that a test reading them fails
      rows = jnp.arange(m)[:, None] < tile_end[-1] * tm
      out = jnp.where(rows, out, jnp.nan).astype(out.dtype)
    return out
  sms = _num_sms()
  waves = min(m, wave_rows or skip_unused or m)
  pair = pairs_tiles(tm) and bool(skip_unused) and m >= skip_unused + tm
  chain = (CHAIN_TILES and tm >= CHAIN_MIN_ROWS and not pair
           and (k // tk) % tiling.num_stages == 0)
  key = KernelKey(m=m, k=k, n=n, groups=g, dtype=jnp.dtype(lhs.dtype).name, tm=tm,
                  tn=column_tile(waves // (2 * tm if pair else tm), n, tn, sms), tk=tk,
                  stages=tiling.num_stages, snake=max(1, tiling.grid_block_n),
                  activation=activation, skip_unused=bool(skip_unused), sms=sms,
                  approx=APPROX_BF16 and activation is not None and lhs.dtype == jnp.bfloat16,
                  wg_m=WG_SPLIT == "m" and (tm % 128 == 0 or pair),
                  wait=0 if chain else WGMMA_IN_FLIGHT, chain=chain,
                  pair=(PAIR_SKIP_MMA + 1) if pair else 0)
  table = pair_table(tile_end, g, m // tm) if pair else tile_end.astype(jnp.int32)
  # The kernel is built only where it is exported: not where route._once loads it from disk.
  return _once.call(("hopper_gmm", key), functools.partial(_run_kernel, key), table, lhs, rhs,
                    keep=True)


def _run_kernel(key: KernelKey, *args):
  return _kernel(key)(*args)


class KernelKey(NamedTuple):
  """Everything the Mosaic GPU program of one kernel depends on (hashable)."""

  m: int
  k: int
  n: int
  groups: int
  dtype: str
  tm: int
  tn: int
  tk: int
  stages: int
  snake: int
  activation: Callable | None
  skip_unused: bool
  sms: int
  approx: bool = False
  wg_m: bool = False
  wait: int = 0
  chain: bool = False
  pair: int = 0  # 0: unpaired; 1: paired (PAIR_TILES); 2: paired, half pairs skip the mma


def _kernel(key: KernelKey):
  """The Mosaic GPU kernel ``(tile_end, lhs, rhs) -> out`` of ``key``."""
  plgpu = _plgpu()
  body = functools.partial(
      _body, tm=key.tm, tn=key.tn, tk=key.tk, stages=key.stages, num_groups=key.groups,
      activation=key.activation, m_iters=key.m // key.tm, n_iters=key.n // (2 * key.tn),
      epi=64, snake=key.snake, skip_unused=key.skip_unused, wg_m=key.wg_m, wait=key.wait,
      chain=key.chain, pair=key.pair)
  out = jax.ShapeDtypeStruct((key.m, key.n), key.dtype)
  # jax 0.10 renamed out_shape to out_type (the old name warns, and may go).
  named = {"out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters
           else "out_shape": out}
  return plgpu.kernel(
      body, **named, grid=(key.sms,),
      grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=key.approx))
