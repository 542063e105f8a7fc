"""The ``"hopper"`` backend of ``route.gmm`` (a warp-specialized Mosaic GPU kernel, Hopper only)
on CPU.  Mosaic GPU has no interpret mode for warp-specialized kernels, so:

- the kernel itself is lowered for CUDA here (its Mosaic GPU program is built: API breakage of
  this jax shows up on CPU), and its numbers are checked on the H100 by
  ``benchmarks/bench_moe_kernels.py --parts check``;
- everything around it runs with ``_hopper.TEST_KERNEL`` (the same tile -> group rule in XLA):
  the tile-aligned layout, the rows past the last group's tiles, the ``custom_vjp`` with its
  Triton backward (interpret mode), the fused activation, and the grouped layer, against
  float32 references."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax import route
from dynjax._errors import RoutingError
from dynjax.route import _hopper, _mgpu, _once
from tests.route.test_gmm_mgpu import (
  CALLS,
  E,
  N,
  check_layer_against_dense,
  fake_ragged_dot,
  fake_transposed,
)

TILING = route.Tiling(tm=16, tk=16, tn=16, num_stages=2, grid_block_n=2)  # tiles 16 x 32
K_DIM, N_DIM = 32, 64


@pytest.fixture(params=["mgpu backward", "triton backward"])
def stand_in(request, monkeypatch):
  """The kernel's stand-in; the backward through JAX's Mosaic GPU ragged dots (their
  ``lax.ragged_dot`` stand-ins) or, where this jax has none, the Triton kernels."""
  monkeypatch.setattr(_hopper, "TEST_KERNEL", True)
  if request.param == "mgpu backward":
    monkeypatch.setattr(_mgpu, "TEST_KERNELS", {
        "ragged_dot": fake_ragged_dot, "transposed_ragged_dot": fake_transposed,
        "transpose_rhs": True, "error": None})
  else:
    monkeypatch.setattr(_mgpu, "TEST_KERNELS", {
        "ragged_dot": None, "transposed_ragged_dot": None, "transpose_rhs": False,
        "error": "none in this jax"})
  CALLS.clear()
  return request.param


def _ref(a, b, sizes, m, tm):
  """Tile-aligned groups; the rows past the last group's tiles belong to the last group."""
  parts, lo = [], 0
  for g, s in enumerate(sizes):
    hi = lo + -(-s // tm) * tm
    parts.append(a[lo:hi] @ b[g])
    lo = hi
  parts.append(a[lo:m] @ b[-1])
  return jnp.concatenate(parts)


@pytest.mark.parametrize("sizes", [[0, 37, 16, 0, 5], [20, 0, 0, 0, 0], [3, 3, 3, 3, 3]])
def test_gmm_hopper_forward_backward_on_tile_aligned_groups(stand_in, sizes):
  m = 112  # 7 tiles of 16 rows: tiles past the groups' tiles in every case
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  lhs = jax.random.normal(k1, (m, K_DIM))
  rhs = jax.random.normal(k2, (len(sizes), K_DIM, N_DIM)) / np.sqrt(K_DIM)
  ct = jax.random.normal(k3, (m, N_DIM))
  gs = jnp.asarray(sizes, jnp.int32)

  def f(a, b):
    return route.gmm(a, b, gs, tiling=TILING, backend="hopper")

  want_y = _ref(lhs, rhs, sizes, m, 16)
  np.testing.assert_allclose(np.asarray(jax.jit(f)(lhs, rhs)), np.asarray(want_y), rtol=1e-5,
                             atol=1e-5)
  got = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * ct), (0, 1)))(lhs, rhs)
  want = jax.grad(lambda a, b: jnp.sum(_ref(a, b, sizes, m, 16) * ct), (0, 1))(lhs, rhs)
  for a, b in zip(got, want, strict=True):  # the backward agrees with the forward's groups
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # The fused activation: act(lhs @ rhs), and under grad the pre-activation is kept.
  act = jax.jit(lambda a, b: route.gmm(a, b, gs, tiling=TILING, backend="hopper",
                                       activation=jax.nn.gelu))(lhs, rhs)
  np.testing.assert_allclose(np.asarray(act), np.asarray(jax.nn.gelu(want_y)), rtol=1e-5,
                             atol=1e-5)
  ga = jax.grad(lambda a: jnp.sum(route.gmm(a, rhs, gs, tiling=TILING, backend="hopper",
                                            activation=jax.nn.gelu) * ct))(lhs)
  wa = jax.grad(lambda a: jnp.sum(jax.nn.gelu(_ref(a, rhs, sizes, m, 16)) * ct))(lhs)
  np.testing.assert_allclose(np.asarray(ga), np.asarray(wa), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k,min_rows,pow2", [(1, 0, 0), (2, 0, 0), (2, 256, 0), (1, 64, 4096)])
def test_grouped_mode_hopper_equals_dense_with_grads_and_mask(stand_in, k, min_rows, pow2,
                                                              monkeypatch):
  # min_rows 256 (or a power of two past 64): the buffer has more rows than a routing can fill
  # (one kernel for many call shapes); dlhs then runs the Triton kernel, which skips the tiles
  # past the groups.
  from dynjax.route import _gmm

  monkeypatch.setattr(_gmm, "HOPPER_MIN_ROWS", min_rows)
  monkeypatch.setattr(_gmm, "HOPPER_POW2_ROWS", pow2)
  # The layer skips the row tiles past the paths' (the stand-in writes NaN there, as an
  # unwritten buffer may hold): nothing of them reaches the values or the gradients.
  check_layer_against_dense("hopper", k, TILING)
  bound = _gmm.num_tiles(N * k, E, 16) * 16
  rows = _gmm.buffer_rows(N * k, E, TILING, "hopper")
  floor = _gmm.hopper_floor_rows(E, 16)
  assert rows == (floor if bound <= floor else
                  1 << (bound - 1).bit_length() if bound <= pow2 else bound)
  if stand_in == "mgpu backward":  # drhs (and dlhs where no row is extra) on the tiled sizes
    want_calls = ["transposed"] if rows > bound else ["ragged_dot", "transposed"]
    assert sorted({c[0] for c in CALLS}) == want_calls


def test_column_tiles_fill_the_waves():
  # GEMM 2 of the FFN at 8,192 rows (71 row tiles, N=1024): 284 tiles of 2 x 128 columns fill
  # 2.15 waves of 132 programs; 64-column tiles fill 4.3.  GEMM 1 (N=4096) keeps 128.
  assert _hopper.column_tile(71, 1024, 128) == 64
  assert _hopper.column_tile(71, 4096, 128) == 128
  assert _hopper.column_tile(16, 1024, 128) == 64  # a short bucket: 64 tiles on 132 SMs
  assert _hopper.column_tile(71, 1024, 64) == 64  # never below 64
  assert _hopper.column_tile(33, 1024, 128) == 128  # 132 tiles: one full wave
  assert _hopper.column_tile(0, 1024, 128) == 64  # no rows: as one row tile


def test_the_waves_are_those_of_the_rows_a_routing_fills(monkeypatch):
  # The layer's buffer is rounded up past what a routing fills (8,192 tokens, k=1, 8 experts:
  # 9,088 rows -> 16,384): the column tile follows the 71 row tiles, not the buffer's 128.
  seen = []
  monkeypatch.setattr(_hopper, "column_tile",
                      lambda m_tiles, n, tn, sms=132: seen.append(m_tiles) or tn)
  t = route.Tiling(tm=128, tk=64, tn=128, num_stages=4, grid_block_n=8)
  for skip, waves in ((9088, 0), (0, 0), (2048, 9088)):
    jax.jit(lambda a, b, te, skip=skip, waves=waves: _hopper.hopper_gmm(
        a, b, te, t, None, skip, waves)).trace(
        jax.ShapeDtypeStruct((16384, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 256, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert seen == [71, 128, 71]


def test_call_shapes_below_the_floor_share_one_kernel_pair(monkeypatch):
  # The e2e's length buckets (8 paths, k=2, batch 8 x 16..512 tokens: 256..8,192 routed rows)
  # all fall in the floor's buffer, and their column tiles follow its waves: one kernel for
  # each GEMM, so one Mosaic GPU compile each a process.
  from dynjax.route import _gmm

  tiling = route.Tiling.auto(8192, 8, "hopper")
  assert {_gmm.buffer_rows(r, 8, tiling, "hopper") for r in (256, 2048, 8192)} == {9088}
  assert _gmm.buffer_rows(8400, 8, tiling, "hopper") > 9088
  keys = []
  monkeypatch.setattr(_once, "call", lambda key, fn, *a, **kw: keys.append(key[1]) or jnp.zeros(
      (key[1].m, key[1].n), key[1].dtype))
  monkeypatch.setattr(_hopper, "unavailable_reason", lambda dtype: None)
  moe = route.Routed(route.Experts(route.ffn()), route.Router(8, k=2), mode="grouped",
                     kernel="hopper")
  params = {"w1": jnp.zeros((8, 1024, 4096), jnp.bfloat16),
            "w2": jnp.zeros((8, 4096, 1024), jnp.bfloat16)}
  for tokens in (128, 1024, 4096):
    jax.eval_shape(moe, params, jax.ShapeDtypeStruct((tokens, 1024), jnp.bfloat16),
                   jax.ShapeDtypeStruct((tokens, 8), jnp.float32))
  assert len(keys) == 6 and len(set(keys)) == 2, keys
  assert sorted(k.tn for k in set(keys)) == [64, 128]  # GEMM 2 (N=1024) halves its tiles


def test_only_a_bfloat16_fused_activation_runs_approximate_math(monkeypatch):
  # tanh.approx.f32 is within a quarter of bfloat16's rounding step, not of float16's: the
  # kernel's approx_math is on for a fused activation of bfloat16 operands only, and the
  # lowered program carries it (a kernel key of its own).
  keys = []
  monkeypatch.setattr(_once, "call", lambda key, fn, *a, **kw: keys.append(key[1]) or jnp.zeros(
      (key[1].m, key[1].n), key[1].dtype))
  t = route.Tiling(tm=128, tk=64, tn=128, num_stages=4, grid_block_n=8)
  te = jnp.array([1, 2], jnp.int32)
  for dtype, act in ((jnp.bfloat16, jax.nn.gelu), (jnp.float16, jax.nn.gelu),
                     (jnp.bfloat16, None)):
    _hopper.hopper_gmm(jnp.zeros((256, 128), dtype), jnp.zeros((2, 128, 256), dtype), te, t, act)
  monkeypatch.setattr(_hopper, "APPROX_BF16", False)
  _hopper.hopper_gmm(jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((2, 128, 256), jnp.bfloat16),
                     te, t, jax.nn.gelu)
  assert [k.approx for k in keys] == [True, False, False, False]
  monkeypatch.undo()
  args = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32))
  texts = []
  for approx in (False, True):
    monkeypatch.setattr(_hopper, "APPROX_BF16", approx)
    _once.clear()
    fn = jax.jit(lambda a, b, te: _hopper.hopper_gmm(a, b, te, t, jax.nn.gelu))
    texts.append(fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
  assert [tx.count("approx") for tx in texts] == [0, 1]  # the Mosaic GPU program's tanh


@pytest.mark.parametrize("split,wait", [("n", 0), ("m", 1)])
def test_the_warpgroup_split_and_wgmma_depth_are_kernel_keys_that_lower(split, wait,
                                                                        monkeypatch):
  # The two compute warpgroups split a tile's columns ("n") or rows ("m": 64 rows each, so only
  # for 128-row tiles), with 0 or 1 wgmma groups in flight across k-steps; each is a kernel of
  # its own (its key), and each lowers for CUDA (the program differs: the rows a warpgroup
  # multiplies, the stages released a step later).
  monkeypatch.setattr(_hopper, "WG_SPLIT", split)
  monkeypatch.setattr(_hopper, "WGMMA_IN_FLIGHT", wait)
  monkeypatch.setattr(_hopper, "CHAIN_TILES", False)  # a chained kernel has no wgmma in flight
  monkeypatch.setattr(_hopper, "PAIR_TILES", False)  # (on an H200, 64-row tiles pair)
  keys = []
  real_call = _once.call
  monkeypatch.setattr(_once, "call", lambda key, fn, *a, **kw: keys.append(key[1]) or real_call(
      key, fn, *a, **kw))
  _once.clear()
  args = (jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
          jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
  texts = []
  for tm in (128, 64):
    t = route.Tiling(tm=tm, tk=64, tn=128, num_stages=4, grid_block_n=8)
    fn = jax.jit(lambda a, b, te, t=t: _hopper.hopper_gmm(a, b, te, t, jax.nn.gelu, 384))
    texts.append(fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
  assert [(k.tm, k.wg_m, k.wait) for k in keys] == [(128, split == "m", wait), (64, False, wait)]
  assert all(tx.count("mosaic_gpu_v2") == 1 for tx in texts)


def test_128_row_tiles_run_chained_and_the_chain_lowers(monkeypatch):
  # A program's 128-row tiles run as one chain of pipelines (the next tile's operands stream in
  # during a tile's epilogue): a kernel key of its own, with no wgmma group in flight (Pallas
  # refuses delay_release in a chain); 64-row tiles (slower chained on the H100, unless
  # CHAIN_MIN_ROWS says 64) and a K whose k-steps the stages do not divide stay unchained.  Each program lowers for CUDA (its numbers
  # are checked on the H100: benchmarks/gpu_run_moe_chain.sh).
  keys = []
  real_call = _once.call
  monkeypatch.setattr(_once, "call", lambda key, fn, *a, **kw: keys.append(key[1]) or real_call(
      key, fn, *a, **kw))
  monkeypatch.setattr(_hopper, "PAIR_TILES", False)  # (on an H200, 64-row tiles pair)
  texts = {}
  for chain_on, min_rows in ((True, 128), (False, 128), (True, 64)):
    monkeypatch.setattr(_hopper, "CHAIN_TILES", chain_on)
    monkeypatch.setattr(_hopper, "CHAIN_MIN_ROWS", min_rows)
    _once.clear()
    for tm, k in ((128, 256), (64, 256), (128, 192)):  # 192: 3 k-steps, 4 stages
      t = route.Tiling(tm=tm, tk=64, tn=128, num_stages=4, grid_block_n=8)
      args = (jax.ShapeDtypeStruct((512, k), jnp.bfloat16),
              jax.ShapeDtypeStruct((4, k, 512), jnp.bfloat16),
              jax.ShapeDtypeStruct((4,), jnp.int32))
      fn = jax.jit(lambda a, b, te, t=t: _hopper.hopper_gmm(a, b, te, t, jax.nn.gelu, 384))
      texts[chain_on, min_rows, tm, k] = fn.trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
  got = [(k.tm, k.k, k.chain, k.wait) for k in keys]
  w = _hopper.WGMMA_IN_FLIGHT
  assert got[:3] == [(128, 256, True, 0), (64, 256, False, w), (128, 192, False, w)]
  assert got[3:6] == [(128, 256, False, w), (64, 256, False, w), (128, 192, False, w)]
  assert got[6:] == [(128, 256, True, 0), (64, 256, True, 0), (128, 192, False, w)]  # c64
  assert all(tx.count("mosaic_gpu_v2") == 1 for tx in texts.values())


def _pairs_cover_every_tile_once(counts, spare):
  # The paired kernel's program p computes row tiles first and first + 1 with one group's
  # weights and stores the second only where it is the group's: every row tile of every group
  # is stored exactly once, by a program holding that group, and nothing else is stored.
  tile_end = jnp.asarray(np.cumsum(counts), jnp.int32)
  num_tiles = sum(counts) + spare
  table = np.asarray(_hopper.pair_table(tile_end, len(counts), num_tiles))
  slots = _hopper.pair_slots(num_tiles, len(counts))
  assert table.shape == (1 + 2 * slots,)
  pairs = int(table[0])
  assert pairs == sum((c + 1) // 2 for c in counts) <= slots
  stored = []
  for p in range(pairs):
    g, code = int(table[1 + p]), int(table[1 + slots + p])
    first = code >> 1
    assert first + 1 < num_tiles + 1  # the second tile's rows exist (the spare tile)
    stored += [(first, g)] + ([(first + 1, g)] if code & 1 else [])
  want = [(t, g) for g, c in enumerate(counts) for t in range(sum(counts[:g]), sum(counts[:g]) + c)]
  assert sorted(stored) == want


@pytest.mark.parametrize("counts,spare", [([3, 0, 5, 1], 1), ([0, 0, 2], 0), ([1, 1, 1, 1, 4], 3),
                                          ([0, 0, 0], 2)])
def test_paired_row_tiles_cover_every_tile_of_every_group_once(counts, spare):
  _pairs_cover_every_tile_once(counts, spare)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=9), st.integers(0, 3))
def test_any_group_sizes_pair_every_tile_once(counts, spare):
  _pairs_cover_every_tile_once(counts, spare)


@pytest.mark.parametrize("skip_mma", [False, True])
def test_paired_tiles_need_a_spare_row_tile_and_lower(skip_mma, monkeypatch):
  # With PAIR_TILES a program computes two 64-row tiles of one group (the warpgroups split its
  # rows); the last pair's second tile may start at the groups' bound, so the kernel pairs only
  # where the buffer has a tile more than the groups can fill (buffer_rows adds it).  A half
  # pair's second warpgroup skips its wgmma (PAIR_SKIP_MMA) or multiplies unstored rows; each
  # is a kernel of its own that lowers for CUDA, reading the pair table.
  from dynjax.route import _gmm

  monkeypatch.setattr(_hopper, "PAIR_TILES", True)
  monkeypatch.setattr(_hopper, "PAIR_SKIP_MMA", skip_mma)
  keys, tables = [], []
  real_call = _once.call

  def spy(key, fn, *a, **kw):
    keys.append(key[1])
    tables.append(a[0].shape)
    return real_call(key, fn, *a, **kw)

  monkeypatch.setattr(_once, "call", spy)
  _once.clear()
  t = route.Tiling(tm=64, tk=64, tn=128, num_stages=4, grid_block_n=8)
  texts = []
  for skip in (448, 512):
    args = (jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
    texts.append(jax.jit(lambda a, b, te, s=skip: _hopper.hopper_gmm(a, b, te, t, jax.nn.gelu, s))
                 .trace(*args).lower(lowering_platforms=("cuda",)).as_text())
  assert [(k.pair, k.wg_m) for k in keys] == [(2 if skip_mma else 1, True), (0, False)]
  assert tables == [(1 + 2 * _hopper.pair_slots(8, 4),), (4,)]
  assert all(tx.count("mosaic_gpu_v2") == 1 for tx in texts)
  assert _gmm.buffer_rows(8192, 64, t, "hopper") == _gmm.hopper_floor_rows(64, 64)
  assert _gmm.hopper_floor_rows(64, 64) == (_gmm.num_tiles(8192, 64, 64) + 1) * 64
  monkeypatch.setattr(_hopper, "PAIR_TILES", False)
  assert _gmm.hopper_floor_rows(64, 64) == _gmm.num_tiles(8192, 64, 64) * 64


def test_pairs_are_on_by_device_where_measured_faster(monkeypatch):
  # PAIR_TILES=None pairs 64-row tiles on the device kinds where pairs measured faster (the
  # H200), not elsewhere (the H100, the CPU); True/False force it.
  class Dev:
    def __init__(self, platform, kind):
      self.platform, self.device_kind = platform, kind

  monkeypatch.setattr(_hopper, "PAIR_TILES", None)
  for platform, kind, want in (("gpu", "NVIDIA H200", True), ("gpu", "NVIDIA H100 80GB HBM3", False),
                               ("cpu", "cpu", False)):
    monkeypatch.setattr(_hopper.jax, "devices", lambda d=Dev(platform, kind): [d])
    assert _hopper.pairs_tiles(64) is want and not _hopper.pairs_tiles(128)
  monkeypatch.setattr(_hopper, "PAIR_TILES", False)
  assert not _hopper.pairs_tiles(64)


@pytest.mark.parametrize("activation,skip,export", [(None, 0, True), (jax.nn.gelu, 384, True),
                                                    (jax.nn.gelu, 384, False)])
def test_the_kernel_lowers_for_cuda(activation, skip, export, monkeypatch):
  # The Mosaic GPU program is built at lowering (a CUDA lowering works on a CPU machine): by
  # jax.export once a process (EXPORT), or in every executable.
  monkeypatch.setattr(_once, "EXPORT", export)
  _once.clear()
  t = route.Tiling(tm=128, tk=64, tn=128, num_stages=4, grid_block_n=8)
  for scale in (1.0, 2.0):  # two executables calling the same kernel
    fn = jax.jit(lambda a, b, te, s=scale: _hopper.hopper_gmm(a * s, b, te, t, activation, skip))
    text = fn.trace(jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
                    jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16),
                    jax.ShapeDtypeStruct((8,), jnp.int32)).lower(
                        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == 1
  assert _once._exported.cache_info().misses == (1 if export else 0)


def test_shapes_the_kernel_cannot_tile_are_refused(stand_in):
  with pytest.raises(RoutingError, match=re.escape("backend='hopper' needs N=48 (a multiple of "
                                                   "32)")):
    route.gmm(jnp.zeros((32, K_DIM)), jnp.zeros((2, K_DIM, 48)), jnp.array([3, 4]),
              tiling=TILING, backend="hopper")


def test_auto_takes_hopper_where_it_runs_and_the_widths_tile(monkeypatch):
  from dynjax.route import _gmm

  monkeypatch.setattr(_gmm, "_platform", lambda: "gpu")
  monkeypatch.setattr(_hopper, "TEST_KERNEL", True)
  assert _gmm.resolve_backend("auto", jnp.bfloat16, 8192, 8) == "hopper"
  assert _gmm.resolve_backend("auto", jnp.bfloat16, 8192, 64, widths=((1024, 4096),)) == "hopper"
  # N=1000 does not tile (2 x 128 columns); neither does K=1000: the next kernel in line.
  assert _gmm.resolve_backend("auto", jnp.bfloat16, 8192, 8, widths=((1024, 1000),)) != "hopper"
  assert _gmm.resolve_backend("auto", jnp.bfloat16, 8192, 8, widths=((1000, 1024),)) != "hopper"
  assert route.Tiling.auto(8192, 8, "hopper").tm == 128
  assert route.Tiling.auto(512, 8, "hopper").tm == 128  # by the paths alone: one kernel
  assert route.Tiling.auto(8192, 64, "hopper").tm == 64
  assert _gmm.buffer_rows(512, 8, route.Tiling.auto(512, 8, "hopper"), "hopper") == 9088
  # At 8,192 rows the floor (their bound), past it the bound (power-of-two classes are off
  # by default).
  assert _gmm.buffer_rows(8192, 8, route.Tiling.auto(8192, 8, "hopper"), "hopper") == 9088
  monkeypatch.setattr(_gmm, "HOPPER_POW2_ROWS", 65536)
  assert _gmm.buffer_rows(8192, 8, route.Tiling.auto(8192, 8, "hopper"), "hopper") == 9088
  assert _gmm.buffer_rows(16384, 8, route.Tiling.auto(8192, 8, "hopper"), "hopper") == 32768
  assert _gmm.buffer_rows(65536, 8, route.Tiling.auto(65536, 8, "hopper"), "hopper") == (
      65536 + 8 * 127) // 128 * 128
  moe = route.Routed(route.Experts(route.ffn()), route.Router(8), mode="grouped")
  wide = {"w1": jnp.zeros((8, 256, 512), jnp.bfloat16)}
  narrow = {"w1": jnp.zeros((8, 128, 384), jnp.bfloat16)}  # 128 does not tile 2 x 128
  with monkeypatch.context() as m:  # the layer's choice as on a GPU
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert moe.grouped_kernel(wide, jnp.bfloat16, 4096) == "hopper"
    assert moe.grouped_kernel(narrow, jnp.bfloat16, 4096) != "hopper"


def test_a_kept_kernel_is_neither_built_nor_its_pallas_imported(tmp_path, monkeypatch):
  # A later process loads the kernel from disk: Mosaic GPU's Pallas (0.40 s of a cold process on
  # the H100 host) is neither imported to check the device nor to build the kernel.
  from dynjax import _jax_private
  from dynjax.route import _mgpu

  monkeypatch.setenv("DYNJAX_KERNEL_CACHE", str(tmp_path))
  monkeypatch.setattr(_once, "PRECOMPILE_ON", ())
  t = route.Tiling(tm=128, tk=64, tn=128, num_stages=4, grid_block_n=8)
  args = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32))

  def lower():
    fn = jax.jit(lambda a, b, te: _hopper.hopper_gmm(a, b, te, t, jax.nn.gelu))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

  _once.clear()
  first = lower()  # exported (the kernel built) and kept
  assert first.count("mosaic_gpu_v2") == 1 and len(list(tmp_path.iterdir())) == 1
  _once.clear()  # a new process
  monkeypatch.setattr(_hopper, "_plgpu", lambda: pytest.fail("Mosaic GPU's Pallas imported"))
  assert lower() == first
  # The device check finds the module without importing it.
  monkeypatch.setattr(_mgpu, "hopper_refusal", lambda dtype: None)
  monkeypatch.setattr(_jax_private, "mosaic_gpu_runtime", lambda: None)
  assert _hopper.unavailable_reason(jnp.bfloat16) is None
  # The short way fails: this jax's own import decides (here it fails too).
  monkeypatch.setattr(_jax_private, "mosaic_gpu_runtime", lambda: "no bindings")

  def no_pallas():
    raise ImportError("no Mosaic GPU bindings")

  monkeypatch.setattr(_hopper, "_plgpu", no_pallas)
  assert _hopper.unavailable_reason(jnp.bfloat16) == (
      f"this jax ({jax.__version__}) has no Mosaic GPU Pallas (no Mosaic GPU bindings)")
  monkeypatch.setattr(_hopper, "_plgpu", lambda: None)
  assert _hopper.unavailable_reason(jnp.bfloat16) is None
  monkeypatch.setattr(_jax_private, "mosaic_gpu_runtime", lambda: None)
  import importlib.util
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  assert _hopper.unavailable_reason(jnp.bfloat16) == (
      f"this jax ({jax.__version__}) has no Mosaic GPU Pallas (no module)")


@pytest.mark.parametrize("sizes", [[0, 37, 16, 0, 5], [30, 40, 0, 9, 1],  # past M: cut
                                   [60, 60, 60, 60, 60]])
@pytest.mark.parametrize("kernel", ["hopper", "pallas"])
def test_ragged_dot_is_lax_ragged_dot_on_the_kernels(stand_in, sizes, kernel):
  # Packed rows in consecutive groups (public MoE code's layout), through the tile layout and
  # back: values and gradients equal lax.ragged_dot's, rows past the groups 0, sizes past M cut.
  m = 64
  a = jax.random.normal(jax.random.key(0), (m, K_DIM), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (len(sizes), K_DIM, N_DIM), jnp.float32) / 4
  s = jnp.asarray(sizes, jnp.int32)
  ct = jax.random.normal(jax.random.key(2), (m, N_DIM), jnp.float32)
  mine = lambda a, b: route.ragged_dot(a, b, s, kernel=kernel, tiling=TILING)
  want = lambda a, b: jax.lax.ragged_dot(a, b, s)
  np.testing.assert_allclose(jax.jit(mine)(a, b), want(a, b), rtol=1e-5, atol=1e-5)
  if sum(sizes) < m:
    assert not np.asarray(jax.jit(mine)(a, b))[sum(sizes):].any()
  g_mine = jax.jit(jax.grad(lambda a, b: jnp.sum(mine(a, b) * ct), (0, 1)))(a, b)
  g_want = jax.grad(lambda a, b: jnp.sum(want(a, b) * ct), (0, 1))(a, b)
  for x, y in zip(g_mine, g_want, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_ragged_dot_is_lax_ragged_dot_where_no_kernel_runs():
  a = jnp.ones((6, 4), jnp.float32)
  b = jnp.ones((2, 4, 3), jnp.float32)
  s = jnp.array([2, 1], jnp.int32)
  plain = str(jax.make_jaxpr(jax.lax.ragged_dot)(a, b, s))
  # CPU ("auto" -> "xla"), a precision or an output type the kernels do not take, mixed dtypes
  for kw in ({}, {"precision": jax.lax.Precision.HIGHEST},
             {"preferred_element_type": jnp.float32}):
    jaxpr = str(jax.make_jaxpr(functools.partial(route.ragged_dot, **kw))(a, b, s))
    assert "ragged_dot_general" in jaxpr and "gather" not in jaxpr
  assert str(jax.make_jaxpr(route.ragged_dot)(a, b, s)) == plain
  # a symbolic row count where no kernel runs (CPU, "auto"): lax.ragged_dot; where one does,
  # the primitive each bucket lowers to the kernel
  (t,) = jax.export.symbolic_shape("t")
  sym = jax.ShapeDtypeStruct((t, 4), jnp.float32)
  jaxpr = str(jax.make_jaxpr(lambda a: route.ragged_dot(a, b, s))(sym))
  if jax.default_backend() == "cpu":
    assert "ragged_dot_general" in jaxpr and "dynjax_ragged_dot" not in jaxpr
  else:  # a GPU: "auto" takes a kernel
    assert "dynjax_ragged_dot" in jaxpr
  jaxpr = str(jax.make_jaxpr(lambda a: route.ragged_dot(a, b, s, kernel="pallas"))(sym))
  assert "dynjax_ragged_dot" in jaxpr and "pallas_call" not in jaxpr
  # widths the kernel's blocks do not divide (K=4 against the tiling's 16): lax's, exactly
  assert str(jax.make_jaxpr(lambda a, b, s: route.ragged_dot(
      a, b, s, kernel="pallas", tiling=TILING))(a, b, s)) == plain


def test_ragged_dot_names_bad_operands():
  b = jnp.ones((2, 4, 3))
  with pytest.raises(RoutingError, match=r"expected lhs \[M, K\], rhs \[G, K, N\] and "
                     r"group_sizes \[G\], got lhs \(6, 5\)"):
    route.ragged_dot(jnp.ones((6, 5)), b, jnp.array([1, 2]))
  with pytest.raises(RoutingError, match=r"group_sizes \(3,\)"):
    route.ragged_dot(jnp.ones((6, 4)), b, jnp.array([1, 2, 3]))
  with pytest.raises(RoutingError, match="group_sizes has dtype float32"):
    route.ragged_dot(jnp.ones((6, 4)), b, jnp.array([1.0, 2.0]))


def test_ragged_dot_never_asks_the_kernel_for_tiles_past_its_buffer(stand_in, monkeypatch):
  # Group sizes past M are cut before the layout: the kernel walks the groups' tiles up to a
  # bound read at run time, so uncut sizes would send it past the buffer (only the real
  # kernel would show it: the stand-in indexes in XLA).
  from dynjax.route import _ragged

  seen = []
  real = _ragged._on_groups

  def spy(xs, w, sizes, *rest):
    seen.append((xs.shape[0], np.asarray(sizes)))
    return real(xs, w, sizes, *rest)

  monkeypatch.setattr(_ragged, "_on_groups", spy)
  a = jnp.ones((64, K_DIM), jnp.float32)
  b = jnp.ones((5, K_DIM, N_DIM), jnp.float32)
  route.ragged_dot(a, b, jnp.array([60, 60, 60, 60, 60]), kernel="hopper", tiling=TILING)
  (rows, sizes), = seen
  assert sizes.tolist() == [60, 4, 0, 0, 0]
  assert sum(-(-s // TILING.tm) for s in sizes) * TILING.tm <= rows


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_ragged_dot_in_a_bucketed_moe_is_exact_with_gradients(stand_in, padding):
  # Public MoE code with route.ragged_dot in place of lax.ragged_dot, under dynjax.jit: the
  # family trace (symbolic rows) binds the primitive, each bucket runs the kernel (its
  # stand-in) at its padded rows; values and gradients equal jax.jit with lax.ragged_dot at
  # each exact shape.
  import dynjax

  w = jax.random.normal(jax.random.key(3), (E, K_DIM, N_DIM), jnp.float32) / 4
  gate = jax.random.normal(jax.random.key(4), (K_DIM, E), jnp.float32)

  def moe(x, w, dot):
    experts = jnp.argmax(x @ gate, axis=-1)
    order = jnp.argsort(experts)
    y = dot(x[order], w, jnp.bincount(experts, length=E))
    return jnp.zeros_like(y).at[order].set(y)

  def step(x, w, dot):
    return jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(moe(x, w, dot))))(w)

  ours = functools.partial(route.ragged_dot, kernel="hopper", tiling=TILING)
  f = dynjax.jit(lambda x, w: step(x, w, ours), dims={"x": "t, 32", "w": None},
                 buckets={"t": [16, 64]}, padding=padding, on_fallback="error")
  ref = jax.jit(lambda x, w: step(x, w, jax.lax.ragged_dot))
  for t in (5, 16, 40):
    x = jax.random.normal(jax.random.key(t), (t, K_DIM), jnp.float32)
    (v, g), (v0, g0) = f(x, w), ref(x, w)
    np.testing.assert_allclose(v, v0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g, g0, rtol=1e-4, atol=1e-4)
  assert f.stats()["fallbacks"] == [] and len(f.stats()["per_bucket_calls"]) == 2
  if padding == "auto":  # the forward and the backward (a training step) at the bucket's rows
    assert "the grouped-GEMM kernel at the bucket's rows" in f.explain()
    assert "the backward of the grouped-GEMM kernel at the bucket's rows" in f.explain()


def test_ragged_dot_under_vmap(stand_in):
  # Every operand batched (as lax.ragged_dot's batching takes), unbatched weights (which it
  # does not: NotImplementedError), and the primitive of a family trace batched after the
  # fact (vmap of a jitted function at a symbolic row count).
  x = jax.random.normal(jax.random.key(0), (3, 40, K_DIM), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (3, E, K_DIM, N_DIM), jnp.float32)
  s = jnp.array([[10, 0, 20, 5], [40, 0, 0, 0], [1, 2, 3, 4]], jnp.int32)
  ours = functools.partial(route.ragged_dot, kernel="hopper", tiling=TILING)
  for fn in (jax.vmap(ours), jax.vmap(jax.jit(ours)), jax.jit(jax.vmap(ours))):
    np.testing.assert_allclose(fn(x, w, s), jax.vmap(jax.lax.ragged_dot)(x, w, s),
                               rtol=1e-5, atol=1e-5)
  want = jnp.stack([jax.lax.ragged_dot(x[i], w[0], s[i]) for i in range(3)])
  np.testing.assert_allclose(jax.vmap(ours, in_axes=(0, None, 0))(x, w[0], s), want,
                             rtol=1e-5, atol=1e-5)
  from dynjax.route import _ragged

  (t,) = jax.export.symbolic_shape("t")
  sym = jax.eval_shape(jax.vmap(jax.jit(lambda x, s: ours(x, w[0], s))),
                       jax.ShapeDtypeStruct((3, t, K_DIM), jnp.float32),
                       jax.ShapeDtypeStruct((3, E), jnp.int32))
  assert sym.shape[0] == 3 and sym.shape[2] == N_DIM
  out = _ragged._batch([x, w[0], s], (0, None, 0), kernel="hopper", tiling=TILING)[0]
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_the_ragged_dot_option_runs_lax_ragged_dot_as_written_on_the_kernels(
    stand_in, padding, monkeypatch):
  # The same public MoE, lax.ragged_dot as written, dynjax.jit(ragged_dot="kernels"): the
  # forward and both gradients run as route.ragged_dot (the kernel's stand-in; the weights'
  # through its backward); values and gradients equal jax.jit's.
  import dynjax
  from dynjax.route import _ragged, _rewrite
  from tests.route.test_rewrite import public_moe

  monkeypatch.setattr(_rewrite, "KERNEL", "hopper")
  monkeypatch.setattr(_rewrite, "TILING", TILING)
  seen = []
  real = _ragged.ragged_dot
  monkeypatch.setattr(_ragged, "ragged_dot",
                      lambda *a, **kw: seen.append(kw["kernel"]) or real(*a, **kw))
  w = jax.random.normal(jax.random.key(3), (E, K_DIM, N_DIM), jnp.float32) / 4
  moe = public_moe(jax.random.normal(jax.random.key(4), (K_DIM, E), jnp.float32))

  def step(x, w):
    return jax.value_and_grad(lambda x, w: jnp.sum(jnp.tanh(moe(x, w))), (0, 1))(x, w)

  f = dynjax.jit(step, dims={"x": "t, 32", "w": None}, buckets={"t": [16, 64]},
                 padding=padding, on_fallback="error", ragged_dot="kernels")
  ref = jax.jit(step)
  for t in (5, 16, 40):
    x = jax.random.normal(jax.random.key(t), (t, K_DIM), jnp.float32)
    # (the suite's "highest" matmul precision would leave every site to lax: a precision)
    with jax.default_matmul_precision("default"):
      v, g = f(x, w)
      v0, g0 = ref(x, w)
    # A GPU's "default" float32 matmuls round their inputs (TF32), each kernel its own way: the
    # values 2e-4 apart on the H100, two of 8,192 weight-gradient entries 3e-3 (1% of 0.34)
    # apart after two such matmuls and a tanh (session 24, jax 0.11.2).
    tol, gtol = (1e-5, 1e-4) if jax.default_backend() == "cpu" else (2e-3, 1e-2)
    np.testing.assert_allclose(v, v0, rtol=tol, atol=tol)
    for a, b in zip(g, g0, strict=True):
      np.testing.assert_allclose(a, b, rtol=gtol, atol=gtol)
  assert seen and set(seen) == {"hopper"}
  text = f.explain()
  assert "ragged_dot='kernels':" in text
  assert re.search(r"ragged_dot \(forward\) at .*: route\.ragged_dot", text)
  assert re.search(r"ragged_dot \(gradient in lhs\) at .*: route\.ragged_dot", text)
  assert re.search(r"ragged_dot \(gradient in rhs\) at .*: route\.ragged_dot", text)
  if padding == "auto":  # the primitive's padding rule: the kernel at each bucket's rows
    assert "the grouped-GEMM kernel at the bucket's rows" in text
