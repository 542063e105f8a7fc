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

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax import route
from dynjax._errors import RoutingError
from dynjax.route import _hopper
from tests.route.test_gmm import dense  # the independent dense reference

TILING = route.Tiling(tm=16, tk=16, tn=16, num_stages=2, grid_block_n=2)  # tiles 16 x 32
K_DIM, N_DIM = 32, 64


@pytest.fixture
def stand_in(monkeypatch):
  monkeypatch.setattr(_hopper, "TEST_KERNEL", True)


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


E, D, F, N = 4, 32, 64, 40


@pytest.mark.parametrize("k", [1, 2])
def test_grouped_mode_hopper_equals_dense_with_grads_and_mask(stand_in, k):
  ks = jax.random.split(jax.random.PRNGKey(k), 4)
  params = {"w1": jax.random.normal(ks[0], (E, D, F)) / np.sqrt(D),
            "w2": jax.random.normal(ks[1], (E, F, D)) / np.sqrt(F)}
  x = jax.random.normal(ks[2], (N, D))
  logits = jax.random.normal(ks[3], (N, E)) + jnp.asarray([2.0, 0.0, 0.0, -30.0])
  mask = jnp.arange(N) < 33
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E, k=k, renormalize=k > 1),
                     mode="grouped", kernel="hopper", tiling=TILING)
  assert moe.grouped_kernel(params) == "hopper"
  ct = jax.random.normal(jax.random.PRNGKey(7), (N, D))

  def grads(fn):
    return jax.jit(jax.value_and_grad(lambda p, x, lg: jnp.sum(fn(p, x, lg) * ct), (0, 1, 2)))(
        params, x, logits)

  got = grads(lambda p, x, lg: moe(p, x, lg, mask=mask))
  want = grads(lambda p, x, lg: dense(p, x, lg, k, mask.astype(jnp.float32)))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation", [None, jax.nn.gelu])
def test_the_kernel_lowers_for_cuda(activation):
  # The Mosaic GPU program is built at lowering (a CUDA lowering works on a CPU machine).
  t = route.Tiling(tm=128, tk=64, tn=128, num_stages=4, grid_block_n=8)
  fn = jax.jit(lambda a, b, te: _hopper.hopper_gmm(a, b, te, t, activation))
  lowered = fn.trace(jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
                     jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16),
                     jax.ShapeDtypeStruct((8,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_hopper_backend_says_why_it_cannot_run_here():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU message")
  with pytest.raises(RoutingError, match=re.escape(
      "backend='hopper' cannot run here: the default device is cpu, not a GPU; use "
      "backend='pallas' (Triton) or 'xla'")):
    route.gmm(jnp.zeros((16, K_DIM), jnp.bfloat16), jnp.zeros((2, K_DIM, N_DIM), jnp.bfloat16),
              jnp.array([3, 4]), tiling=TILING, backend="hopper")


def test_shapes_the_kernel_cannot_tile_are_refused(stand_in):
  with pytest.raises(RoutingError, match=re.escape("backend='hopper' needs N=48 (a multiple of "
                                                   "32)")):
    route.gmm(jnp.zeros((32, K_DIM)), jnp.zeros((2, K_DIM, 48)), jnp.array([3, 4]),
              tiling=TILING, backend="hopper")
