"""The ``"mgpu"`` backend of ``route.gmm`` (JAX's Mosaic GPU ragged dot, Hopper only) on CPU:
the library kernels are replaced by ``lax.ragged_dot`` stand-ins of the same signatures, so
what is tested is our side: packed layout, the rows past the last group, the ``custom_vjp``
(dlhs through the transposed-rhs call, drhs through the transposed ragged dot or its
``ragged_dot_general`` fallback) and the grouped layer, against float32 references."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax import route
from dynjax._errors import RoutingError
from dynjax.route import _mgpu
from tests.route.test_gmm import dense  # the independent dense reference

TILING = route.Tiling(tm=16, tk=16, tn=32, num_stages=2, grid_block_n=4)
K_DIM, N_DIM = 32, 64
CALLS: list = []


def fake_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                    grid_block_n, transpose_rhs=False):
  CALLS.append(("ragged_dot", lhs.shape[0], transpose_rhs, grid_block_n))
  assert lhs.shape[0] % block_m == 0 and lhs.shape[1] % block_k == 0
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  assert n % (block_n * grid_block_n) == 0 and max_concurrent_steps >= 1
  rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  return jax.lax.ragged_dot(lhs, rhs, group_sizes).astype(lhs.dtype)


def fake_transposed(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                    grid_block_n):
  CALLS.append(("transposed", lhs.shape[0]))
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims).astype(lhs.dtype)


@pytest.fixture(params=["current", "older"])
def kernels(request, monkeypatch):
  """``current``: jax 0.10's signatures; ``older``: no ``transpose_rhs``, no transposed kernel."""
  if request.param == "current":
    k = {"ragged_dot": fake_ragged_dot, "transposed_ragged_dot": fake_transposed,
         "transpose_rhs": True, "error": None}
  else:
    def old(lhs, rhs, **kw):
      assert "transpose_rhs" not in kw
      return fake_ragged_dot(lhs, rhs, **kw)

    k = {"ragged_dot": old, "transposed_ragged_dot": None, "transpose_rhs": False, "error": None}
  monkeypatch.setattr(_mgpu, "TEST_KERNELS", k)
  CALLS.clear()
  return request.param


def test_gmm_mgpu_packed_groups_forward_backward(kernels):
  sizes = [0, 37, 16, 0, 5]  # packed: rows 0..57; 6 rows past the last group
  m = 64
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  lhs = jax.random.normal(k1, (m, K_DIM))
  rhs = jax.random.normal(k2, (len(sizes), K_DIM, N_DIM)) / np.sqrt(K_DIM)
  ct = jax.random.normal(k3, (m, N_DIM))
  gs = jnp.asarray(sizes, jnp.int32)
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)

  def ref(a, b):
    parts = [a[lo:hi] @ b[g] for g, (lo, hi) in enumerate(zip(starts, ends, strict=True))]
    parts.append(a[ends[-1]:] @ b[-1])  # rows past the last group: the last group's weights
    return jnp.concatenate(parts)

  def f(a, b):
    return route.gmm(a, b, gs, tiling=TILING, backend="mgpu")

  np.testing.assert_allclose(np.asarray(jax.jit(f)(lhs, rhs)), np.asarray(ref(lhs, rhs)),
                             rtol=1e-5, atol=1e-5)
  got = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * ct), (0, 1)))(lhs, rhs)
  want = jax.grad(lambda a, b: jnp.sum(ref(a, b) * ct), (0, 1))(lhs, rhs)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # Forward + dlhs through the ragged dot (transposed rhs read in place where the kernel can),
  # drhs through the transposed kernel where present; grid_block_n 4 -> 2 for 64 columns.
  names = {c[0] for c in CALLS}
  assert names == ({"ragged_dot", "transposed"} if kernels == "current" else {"ragged_dot"})
  assert ("ragged_dot", m, True, 1) in CALLS or kernels == "older"  # 32 columns: 1 super-block
  assert ("ragged_dot", m, False, 2) in CALLS


E, D, F, N = 4, 32, 64, 40




def check_layer_against_dense(kernel: str, k: int, tiling) -> None:
  """The grouped layer with ``kernel``: values and gradients (params, cells, logits) equal the
  dense reference's, on a routing with an empty path and a mask."""
  ks = jax.random.split(jax.random.PRNGKey(k), 4)
  params = {"w1": jax.random.normal(ks[0], (E, D, F)) / np.sqrt(D),
            "w2": jax.random.normal(ks[1], (E, F, D)) / np.sqrt(F)}
  x = jax.random.normal(ks[2], (N, D))
  logits = jax.random.normal(ks[3], (N, E)) + jnp.asarray([2.0, 0.0, 0.0, -30.0])
  mask = jnp.arange(N) < 33
  moe = route.Routed(route.Experts(route.ffn()), route.Router(E, k=k, renormalize=k > 1),
                     mode="grouped", kernel=kernel, tiling=tiling)
  assert moe.grouped_kernel(params) == kernel
  ct = jax.random.normal(jax.random.PRNGKey(7), (N, D))

  def grads(fn):
    return jax.jit(jax.value_and_grad(lambda p, x, lg: jnp.sum(fn(p, x, lg) * ct), (0, 1, 2)))(
        params, x, logits)

  got = grads(lambda p, x, lg: moe(p, x, lg, mask=mask))
  want = grads(lambda p, x, lg: dense(p, x, lg, k, mask.astype(jnp.float32)))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_grouped_mode_mgpu_equals_dense_with_grads_and_mask(kernels, k):
  check_layer_against_dense("mgpu", k, TILING)
  # Packed rows: N*k routed rows rounded up to one 16-row tile, not one tile per path.
  assert ("ragged_dot", -(-N * k // 16) * 16, False, 2) in CALLS


def test_mgpu_layout_is_packed():
  r = route.Router(4)(jnp.eye(4)[jnp.array([1, 1, 3, 1, 3])] * 10.0)
  lay = route.grouped_layout(r, 4, 1, rows=8)
  assert lay.slots.ravel().tolist() == [0, 1, 3, 2, 4]
  assert lay.table.tolist() == [0, 1, 3, 2, 4, 5, 5, 5]
  assert route.Tiling.auto(8192, 64, "mgpu").tm == 128


@pytest.mark.parametrize("backend", ["mgpu", "hopper"])
def test_hopper_backends_say_why_they_cannot_run_here(backend):
  if jax.default_backend() != "cpu":
    pytest.skip("CPU message")
  with pytest.raises(RoutingError, match=re.escape(
      f"backend='{backend}' cannot run here: the default device is cpu, not a GPU; use "
      "backend='pallas' (Triton) or 'xla'")):
    route.gmm(jnp.zeros((16, K_DIM), jnp.bfloat16), jnp.zeros((2, K_DIM, N_DIM), jnp.bfloat16),
              jnp.array([3, 4]), tiling=TILING, backend=backend)
  assert route.gmm(jnp.zeros((16, K_DIM)), jnp.zeros((2, K_DIM, N_DIM)), jnp.array([3, 4]),
                   tiling=TILING).shape == (16, N_DIM)  # "auto" on CPU: XLA


def test_auto_takes_mgpu_only_where_its_boundary_tiles_are_few(kernels, monkeypatch):
  from dynjax.route import _gmm, _hopper

  monkeypatch.setattr(_gmm, "_platform", lambda: "gpu")
  # the rule after the hopper kernel (on an H100 "auto" takes that one first)
  monkeypatch.setattr(_hopper, "unavailable_reason", lambda dtype: "not this test's kernel")
  # (G - 1) * 128 <= rows / 8: 8 experts from 7,168 rows; 64 experts from 64,512.
  assert _gmm.resolve_backend("auto", jnp.bfloat16, 8192, 8) == "mgpu"
  assert _gmm.resolve_backend("auto", jnp.bfloat16, 4096, 8) == "pallas"
  assert _gmm.resolve_backend("auto", jnp.bfloat16, 16384, 64) == "pallas"
  assert _gmm.resolve_backend("pallas", jnp.bfloat16, 8192, 8) == "pallas"


def test_jax_kernels_lower_for_cuda_once_a_process(monkeypatch):
  # JAX's Mosaic GPU ragged dots (forward, dlhs, drhs) are lowered for CUDA once a process
  # (jax.export) and inlined into each executable that calls them.
  from dynjax.route import _once

  if _mgpu.kernels()["ragged_dot"] is None:
    pytest.skip(f"no Mosaic GPU ragged dot in this jax: {_mgpu.kernels()['error']}")
  monkeypatch.setattr(_mgpu, "TEST_KERNELS", None)
  real = jax.devices

  class _H100Like:  # JAX's kernels size their grid by the device's SM count
    core_count = 132

    def __init__(self, dev):
      self._dev = dev

    def __getattr__(self, name):
      return getattr(self._dev, name)

  monkeypatch.setattr(jax, "devices", lambda *a, **k: [_H100Like(d) for d in real(*a, **k)])
  _once.clear()
  t = route.Tiling(tm=128, tk=64, tn=128, num_stages=4, grid_block_n=4)
  sizes = jnp.array([300, 212], jnp.int32)
  for scale in (1.0, 2.0):
    def loss(a, b, s=scale):
      return jnp.sum(_mgpu._gmm(a * s, b, sizes, t).astype(jnp.float32))

    text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(
        jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 256, 512), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    want = 3 if _mgpu.kernels()["transposed_ragged_dot"] is not None else 2
    assert text.count("mosaic_gpu_v2") == want
  assert _once._exported.cache_info().misses == want  # the second executable reused them
