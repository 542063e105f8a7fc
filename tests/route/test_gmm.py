"""The grouped GEMM (Pallas kernel in interpret mode, and the XLA form) and the ``"grouped"``
routed mode equal float32 references: outputs and gradients, on awkward group sizes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax import route
from dynjax._errors import RoutingError

TILING = route.Tiling(tm=16, tk=16, tn=32)
TM = TILING.tm
K_DIM, N_DIM = 32, 64
SIZES = {
    "empty_groups": [0, 37, 16, 0, 5],  # a group > 1 tile, sizes not multiples of the tile
    "one_group": [0, 0, 50, 0, 0],  # everything on one group
    "exact_tiles": [16, 32, 0, 16, 0],
    "all_empty": [0, 0, 0, 0, 0],
}


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def layout(sizes):
  """Row ranges of the tile-aligned groups and the total rows they need."""
  ranges, r = [], 0
  for s in sizes:
    ranges.append((r, r + s))
    r += -(-s // TM) * TM
  return ranges, r


def reference(lhs, rhs, sizes):
  lhs, rhs = np.asarray(lhs, np.float32), np.asarray(rhs, np.float32)
  out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
  for g, (a, b) in enumerate(layout(sizes)[0]):
    out[a:b] = lhs[a:b] @ rhs[g]
  return out


def inputs(sizes, dtype, seed=0):
  ranges, used = layout(sizes)
  m = used + 2 * TM  # two unused tiles past the last group
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  lhs = jax.random.normal(k1, (m, K_DIM), jnp.float32)
  rhs = jax.random.normal(k2, (len(sizes), K_DIM, N_DIM), jnp.float32) / np.sqrt(K_DIM)
  mask = np.zeros((m, 1), np.float32)
  for a, b in ranges:
    mask[a:b] = 1.0
  ct = jax.random.normal(k3, (m, N_DIM), jnp.float32) * mask  # only real rows get cotangents
  return lhs.astype(dtype), rhs.astype(dtype), ct, mask, used


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(SIZES))
def test_gmm_forward_and_backward_f32(case, backend):
  sizes = SIZES[case]
  lhs, rhs, ct, mask, used = inputs(sizes, jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def f(a, b):
    return route.gmm(a, b, gs, tiling=TILING, backend=backend)

  y = np.asarray(f(lhs, rhs))
  np.testing.assert_allclose(y * mask, reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(y[used:], 0.0)  # rows past the last group's tiles

  def ref_loss(a, b):
    tot = 0.0
    for g, (lo, hi) in enumerate(layout(sizes)[0]):
      tot += jnp.sum((a[lo:hi] @ b[g]) * ct[lo:hi])
    return tot

  da, db = jax.grad(lambda a, b: jnp.sum(f(a, b) * ct), (0, 1))(lhs, rhs)
  ra, rb = jax.grad(ref_loss, (0, 1))(lhs, rhs)
  np.testing.assert_allclose(np.asarray(da) * mask, np.asarray(ra), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(db), np.asarray(rb), rtol=1e-5, atol=1e-5)


def test_gmm_bf16_within_tolerance():
  sizes = SIZES["empty_groups"]
  lhs, rhs, ct, mask, _ = inputs(sizes, jnp.bfloat16, seed=3)
  gs = jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda a, b: route.gmm(a, b, gs, tiling=TILING, backend="pallas"))
  y = f(lhs, rhs)
  assert y.dtype == jnp.bfloat16
  assert rel_err(np.asarray(y, np.float32) * mask, reference(lhs, rhs, sizes)) < 1e-2
  da, db = jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * ct), (0, 1))(lhs, rhs)
  ra, rb = jax.grad(lambda a, b: jnp.sum(route.gmm(a, b, gs, tiling=TILING, backend="xla") * ct),
                    (0, 1))(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  assert rel_err(np.asarray(da, np.float32) * mask, ra) < 1e-2
  assert rel_err(np.asarray(db, np.float32), rb) < 1e-2


@pytest.mark.parametrize("fuse", [True, False])
def test_gmm_activation_fused_and_differentiated(fuse):
  sizes = SIZES["empty_groups"]
  lhs, rhs, ct, mask, _ = inputs(sizes, jnp.float32, seed=5)
  gs = jnp.asarray(sizes, jnp.int32)
  tiling = route.Tiling(tm=TM, tk=16, tn=32, fuse_activation=fuse)

  def f(a, b):
    return route.gmm(a, b, gs, tiling=tiling, backend="pallas", activation=jax.nn.gelu)

  want = jax.nn.gelu(reference(lhs, rhs, sizes)) * mask
  np.testing.assert_allclose(np.asarray(jax.jit(f)(lhs, rhs)) * mask, want, rtol=1e-5, atol=1e-5)
  da, db = jax.grad(lambda a, b: jnp.sum(f(a, b) * ct), (0, 1))(lhs, rhs)
  ra, rb = jax.grad(lambda a, b: jnp.sum(route.gmm(a, b, gs, tiling=tiling, backend="xla",
                                                   activation=jax.nn.gelu) * ct), (0, 1))(lhs, rhs)
  np.testing.assert_allclose(np.asarray(da) * mask, np.asarray(ra) * mask, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(db), np.asarray(rb), rtol=1e-5, atol=1e-5)


def test_gmm_errors():
  lhs = jnp.zeros((24, K_DIM))
  rhs = jnp.zeros((2, K_DIM, N_DIM))
  with pytest.raises(RoutingError, match=re.escape(
      "lhs has 24 rows, expected a multiple of the row tile tm=16")):
    route.gmm(lhs, rhs, jnp.array([3, 4]), tiling=TILING)
  with pytest.raises(RoutingError, match=re.escape(
      "backend must be one of 'auto', 'pallas', 'hopper', 'mgpu', 'xla', got 'cuda'")):
    route.gmm(lhs, rhs, jnp.array([3, 4]), backend="cuda")
  with pytest.raises(RoutingError, match=re.escape("block sizes must be powers of two, got "
                                                   "tm=48, tn=0")):
    route.Tiling(tm=48, tn=0)
  with pytest.raises(RoutingError, match=re.escape("dimensions must be multiples of the tiling")):
    route.gmm(jnp.zeros((16, 24)), jnp.zeros((2, 24, N_DIM)), jnp.array([3, 4]), tiling=TILING,
              backend="pallas")


def test_grouped_layout_pads_each_group_to_the_tile_only():
  r = route.Router(4)(jnp.eye(4)[jnp.array([1, 1, 3, 1, 3])] * 10.0)
  lay = route.grouped_layout(r, 4, 2)
  # loads (0, 3, 0, 2): path 1 at rows 0..2 (tiles 0-1), path 3 at rows 4..5 (tile 2).
  assert lay.slots.ravel().tolist() == [0, 1, 4, 2, 5]
  assert lay.table.tolist()[:6] == [0, 1, 3, 5, 2, 4]
  assert len(lay.table) == 8  # num_tiles(5, 4, 2): (5 + 4 * 1) // 2 = 4 tiles of 2 rows


# -- the routed layer ------------------------------------------------------------------------
E, D, F, N = 4, 32, 64, 40


def make(seed, k, bias):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  params = {"w1": jax.random.normal(ks[0], (E, D, F)) / np.sqrt(D),
            "w2": jax.random.normal(ks[1], (E, F, D)) / np.sqrt(F)}
  x = jax.random.normal(ks[2], (N, D))
  logits = jax.random.normal(ks[3], (N, E)) + jnp.asarray(bias)
  return params, x, logits


def dense(params, x, logits, k, mask=None):
  """An independent top-k (renormalised for k > 1), every expert on every token, f32."""
  probs = jax.nn.softmax(logits, -1)
  _, idx = jax.lax.top_k(logits, k)
  gates = jnp.take_along_axis(probs, idx, -1)
  if k > 1:
    gates = gates / gates.sum(-1, keepdims=True)
  w = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], idx].set(gates)
  if mask is not None:
    w = w * mask[:, None]
  ys = jax.vmap(lambda p, x: jax.nn.gelu(x @ p["w1"]) @ p["w2"], in_axes=(0, None))(params, x)
  return jnp.einsum("ne,end->nd", w, ys)


@pytest.mark.parametrize("kernel", ["pallas", "xla", "batched"])
@pytest.mark.parametrize("k,bias", [(1, [0.0, 0.0, 30.0, 0.0]), (2, [2.0, 1.0, 0.0, -30.0])])
def test_grouped_mode_equals_dense_with_grads(k, bias, kernel):
  params, x, logits = make(k, k, bias)
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E, k=k, renormalize=k > 1),
                     mode="grouped", kernel=kernel, tiling=TILING)
  y = jax.jit(moe)(params, x, logits)
  np.testing.assert_allclose(np.asarray(y), np.asarray(dense(params, x, logits, k)),
                             rtol=1e-5, atol=1e-5)
  ct = jax.random.normal(jax.random.PRNGKey(7), y.shape)

  def grads(fn):
    return jax.jit(jax.grad(lambda p, x, lg: jnp.sum(fn(p, x, lg) * ct), (0, 1, 2)))(
        params, x, logits)

  got = grads(moe)
  want = grads(lambda p, x, lg: dense(p, x, lg, k))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  assert moe.stats()["host_syncs"] == 0


def test_grouped_mode_mask_and_bf16():
  params, x, logits = make(5, 2, [0.0, 0.0, 0.0, 0.0])
  mask = jnp.arange(N) < 29
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E, k=2, renormalize=True),
                     mode="grouped", kernel="pallas", tiling=TILING)
  y = jax.jit(lambda p, x, lg: moe(p, x, lg, mask=mask))(params, x, logits)
  ref = dense(params, x, logits, 2, mask.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
  pb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  yb = jax.jit(moe)(pb, x.astype(jnp.bfloat16), logits)
  assert yb.dtype == jnp.bfloat16
  assert rel_err(np.asarray(yb, np.float32), dense(params, x, logits, 2)) < 2e-2


def test_grouped_kernel_auto_is_batched_on_cpu_and_errors():
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E), mode="grouped")
  params, x, logits = make(0, 1, [0.0] * E)
  if jax.default_backend() == "cpu":
    assert moe.grouped_kernel(params) == "batched"
  np.testing.assert_allclose(np.asarray(moe(params, x, logits)),
                             np.asarray(dense(params, x, logits, 1)), rtol=1e-5, atol=1e-5)
  with pytest.raises(RoutingError, match=re.escape(
      "kernel must be one of 'auto', 'pallas', 'hopper', 'mgpu', 'xla', 'batched', got 'cuda'")):
    route.Routed(route.Experts(route.ffn()), route.Router(E), mode="grouped", kernel="cuda")
  with pytest.raises(RoutingError, match=re.escape(
      "mode='grouped' with kernel='pallas' runs the expert FFN as grouped GEMMs")):
    route.Routed(route.Experts(lambda p, x: x @ p), route.Router(E), mode="grouped",
                 kernel="pallas")


def test_grouped_mode_under_dynjax_jit():
  import dynjax

  params, x, logits = make(6, 2, [1.0, 0.0, 0.0, -1.0])
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E, k=2, renormalize=True),
                     mode="grouped", kernel="xla", tiling=TILING)
  fn = dynjax.jit(lambda p, x, lg: moe(p, x, lg), dims={"x": f"n, {D}", "lg": f"n, {E}"},
                  buckets={"n": dynjax.buckets.pow2(min=8)}, padding="trust")
  for n in (40, 13, 29):  # buckets 64, 16, 32
    y = fn(params, x[:n], logits[:n])
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense(params, x[:n], logits[:n], 2)),
                               rtol=1e-5, atol=1e-5)


def test_linen_moe_grouped_jit_and_grad():
  pytest.importorskip("flax")
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, D))
  layer = route.LinenMoE(num_experts=E, hidden=F, k=2, renormalize=True, mode="grouped",
                         options=(("kernel", "xla"), ("tiling", TILING)))
  v = layer.init(jax.random.PRNGKey(0), x)
  p = v["params"]

  def ref(p):
    xf = x.reshape(-1, D)
    return dense({"w1": p["w1"], "w2": p["w2"]}, xf, xf @ p["router"], 2).reshape(x.shape)

  np.testing.assert_allclose(np.asarray(jax.jit(layer.apply)(v, x)), np.asarray(ref(p)),
                             rtol=1e-5, atol=1e-5)
  g = jax.grad(lambda v: jnp.sum(jnp.sin(layer.apply(v, x))))(v)["params"]
  gd = jax.grad(lambda p: jnp.sum(jnp.sin(ref(p))))(p)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gd), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_tiling_auto_keeps_tile_padding_small():
  assert route.Tiling.auto(8192, 8) == route.Tiling()  # ~6% padding rows with 128-row tiles
  assert route.Tiling.auto(8192, 64).tm == 64
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E), mode="grouped", kernel="xla")
  assert moe.stats()["tiling"] == "auto"


@pytest.mark.parametrize("search", ["compare_all", "scan"])
def test_group_tiles_maps_each_row_tile_to_its_group(search, monkeypatch):
  # Each row tile's group, first tile and tile count of tile-aligned groups, against a loop in
  # numpy, with empty groups and tiles past the last group's (which get the group count).
  from dynjax.route import _gmm

  monkeypatch.setattr(_gmm, "TILE_GROUP_SEARCH", search)
  rng = np.random.RandomState(0)
  fn = jax.jit(_gmm.group_tiles, static_argnums=(1, 2))
  for sizes in ([0, 0, 0], [5, 0, 17, 1], list(rng.randint(0, 40, 8)), [16, 16], [1]):
    tm, tiles = 8, 12
    count = [-(-s // tm) for s in sizes]
    start = list(np.cumsum([0] + count[:-1]))
    want = [next((g for g in range(len(sizes)) if start[g] <= t < start[g] + count[g]),
                 len(sizes)) for t in range(tiles)]
    got = fn(jnp.asarray(sizes, jnp.int32), tiles, tm)
    assert got[0].tolist() == want, (sizes, search)
    assert got[1].tolist() == start and got[2].tolist() == count


@pytest.mark.parametrize("apart", [True, False])
def test_the_combine_stands_apart_from_its_consumer_only_where_asked(apart, monkeypatch):
  # COMBINE_APART: the combine behind an optimization barrier (XLA then materializes it
  # instead of fusing its gather into the consumer); values and gradients as the dense layer's.
  from dynjax.route import _grouped

  monkeypatch.setattr(_grouped, "COMBINE_APART", apart)
  params, x, logits = make(2, 2, [2.0, 1.0, 0.0, -30.0])
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E, k=2, renormalize=True),
                     mode="grouped", kernel="xla", tiling=TILING)
  fn = lambda p, x, lg: jnp.tanh(moe(p, x, lg)) + x  # noqa: E731 - a consumer to fuse into
  assert ("optimization_barrier" in str(jax.make_jaxpr(fn)(params, x, logits))) == apart
  ct = jax.random.normal(jax.random.PRNGKey(7), x.shape)

  def value_and_grads(f):
    return jax.jit(jax.value_and_grad(lambda p, x, lg: jnp.sum(f(p, x, lg) * ct), (0, 1, 2)))(
        params, x, logits)

  got = value_and_grads(fn)
  want = value_and_grads(lambda p, x, lg: jnp.tanh(dense(p, x, lg, 2)) + x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
