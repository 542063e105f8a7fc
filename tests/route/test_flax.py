"""The Flax MoE layers (Linen, NNX) run under jit and grad and equal the dense reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dynjax import route

pytest.importorskip("flax")


def _dense(x, wr, w1, w2, k):
  xf = x.reshape(-1, x.shape[-1])
  routing = route.Router(w1.shape[0], k=k)(xf @ wr)
  y = route.dense_reference(route.Experts(route.ffn()), {"w1": w1, "w2": w2}, xf, routing)
  return y.reshape(x.shape)


def test_linen_moe_profiled_and_exact_sync():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 16))
  layer = route.LinenMoE(num_experts=4, hidden=32, k=2)
  v = layer.init(jax.random.PRNGKey(0), x)
  y = jax.jit(layer.apply)(v, x)
  p = v["params"]
  np.testing.assert_allclose(np.asarray(y), np.asarray(_dense(x, p["router"], p["w1"], p["w2"], 2)),
                             rtol=1e-5, atol=1e-5)
  eager = route.LinenMoE(num_experts=4, hidden=32, k=2, mode="exact-sync").apply(v, x)
  np.testing.assert_allclose(np.asarray(eager), np.asarray(y), rtol=1e-5, atol=1e-5)
  g = jax.grad(lambda v: jax.jit(layer.apply)(v, x).sum())(v)
  gd = jax.grad(lambda p: _dense(x, p["router"], p["w1"], p["w2"], 2).sum())(p)
  for a, b in zip(jax.tree.leaves(g["params"]), jax.tree.leaves(gd), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_nnx_moe_jit_and_grad():
  from flax import nnx

  x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16))
  m = route.NnxMoE(16, 32, 4, k=1, rngs=nnx.Rngs(0))
  y = nnx.jit(lambda m, x: m(x))(m, x)
  ref = _dense(x, m.router[...], m.w1[...], m.w2[...], 1)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
  grads = nnx.grad(lambda m: m(x).sum())(m)
  assert grads.w1[...].shape == (4, 16, 32)
