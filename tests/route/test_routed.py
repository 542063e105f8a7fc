"""Routed layers equal a dense reference (outputs and gradients), in both capacity modes."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax import buckets, route
from dynjax._errors import RoutingError

E, D, F, N = 4, 8, 16, 24
RTOL, ATOL = 1e-5, 1e-5
BIASES = {
    "uniform": [0.0, 0.0, 0.0, 0.0],
    "skewed": [3.0, 1.0, 0.0, -1.0],
    "one_expert": [0.0, 0.0, 30.0, 0.0],
    "empty_expert": [0.0, 0.0, 0.0, -30.0],
}


def expert_fn(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def make(seed=0, n=N, bias="uniform"):
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(seed), 5)
  params = {"w1": jax.random.normal(k1, (E, D, F)) / 3, "b1": jax.random.normal(k5, (E, F)),
            "w2": jax.random.normal(k2, (E, F, D)) / 4}
  x = jax.random.normal(k3, (n, D))
  logits = jax.random.normal(k4, (n, E)) + jnp.asarray(BIASES[bias])
  return params, x, logits


def dense(params, x, logits, k, renormalize=False):
  """Every token through every expert; weights from an independent top-k."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), -1)
  _, idx = jax.lax.top_k(logits, k)
  gates = jnp.take_along_axis(probs, idx, -1)
  if renormalize:
    gates = gates / gates.sum(-1, keepdims=True)
  w = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], idx].set(gates)
  ys = jax.vmap(expert_fn, in_axes=(0, None))(params, x)  # [E, N, D]
  return jnp.einsum("ne,end->nd", w, ys)


def grads_of(fn, params, x, logits, ct):
  return jax.jit(jax.grad(lambda p, x, lg: jnp.sum(fn(p, x, lg) * ct), argnums=(0, 1, 2)))(
      params, x, logits)


def assert_trees_close(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bias", list(BIASES))
@pytest.mark.parametrize("k", [1, 2])
def test_exact_sync_equals_dense(k, bias):
  params, x, logits = make(1, bias=bias)
  moe = route.Routed(route.Experts(expert_fn), route.Router(E, k=k), mode="exact-sync")
  y = moe(params, x, logits)
  np.testing.assert_allclose(np.asarray(y), np.asarray(dense(params, x, logits, k)),
                             rtol=RTOL, atol=ATOL)
  assert moe.stats()["host_syncs"] == 1
  # Gradients: capacities read outside, the routed function differentiated inside.
  routing = moe.route(logits)
  caps = moe.capacities(routing)
  assert all(c >= n for c, n in zip(caps, np.asarray(routing.loads), strict=True))
  ct = jax.random.normal(jax.random.PRNGKey(9), y.shape)
  g = grads_of(lambda p, x, lg: moe.apply(p, x, moe.route(lg), caps, overflow=False),
               params, x, logits, ct)
  assert_trees_close(g, grads_of(lambda p, x, lg: dense(p, x, lg, k), params, x, logits, ct))


@pytest.mark.parametrize("k,bias", [(1, "one_expert"), (2, "skewed"), (2, "empty_expert")])
def test_profiled_with_overflow_equals_dense(k, bias):
  params, x, logits = make(2, bias=bias)
  # A uniform profile: skewed batches overflow the profiled capacities.
  prof = route.Profile(E)
  for _ in range(3):
    prof.record([N * k // E] * E, N)
  moe = route.Routed(route.Experts(expert_fn), route.Router(E, k=k, renormalize=k > 1),
                     mode="profiled", profile=prof, buckets=buckets.linear(2), overflow_chunk=4)
  caps = moe.profiled_capacities(N)
  loads = np.asarray(moe.route(logits).loads)
  assert (loads > np.asarray(caps)).any(), "test must exercise the overflow path"
  f = jax.jit(moe)
  y = f(params, x, logits)
  ref = dense(params, x, logits, k, renormalize=k > 1)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=RTOL, atol=ATOL)
  ct = jax.random.normal(jax.random.PRNGKey(3), y.shape)
  assert_trees_close(grads_of(moe, params, x, logits, ct),
                     grads_of(lambda p, x, lg: dense(p, x, lg, k, k > 1), params, x, logits, ct))


def test_forced_overflow_everything():
  params, x, logits = make(3, bias="skewed")
  moe = route.Routed(route.Experts(expert_fn), route.Router(E, k=2), mode="profiled",
                     overflow_chunk=5)
  routing = moe.route(logits)
  y = jax.jit(lambda p, x, r: moe.apply(p, x, r, (0, 0, 0, 0)))(params, x, routing)
  np.testing.assert_allclose(np.asarray(y), np.asarray(dense(params, x, logits, 2)),
                             rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fusion", ["auto", "bucket", "runs", "none"])
def test_fusion_modes_agree(fusion):
  params, x, logits = make(4, bias="skewed")
  moe = route.Routed(route.Experts(expert_fn), route.Router(E, k=2), fusion=fusion,
                     buckets=buckets.pow2(min=1))
  np.testing.assert_allclose(np.asarray(moe(params, x, logits)),
                             np.asarray(dense(params, x, logits, 2)), rtol=RTOL, atol=ATOL)


def test_bucket_fusion_batches_paths_of_one_bucket():
  plan = route.make_plan((8, 4, 8, 0, 4), fusion="bucket")
  assert plan.groups == (((0, 2), 8), ((1, 4), 4))
  assert route.make_plan((8, 8, 4, 4, 0, 4), fusion="runs").groups == (
      ((0, 1), 8), ((2, 3), 4), ((5,), 4))


def test_branches_exact_and_profiled():
  fns = [lambda p, x: x * 2.0, lambda p, x: jnp.sin(x @ p), lambda p, x: x @ p + 1.0]
  w = jax.random.normal(jax.random.PRNGKey(0), (D, D))
  params = [None, w, w.T]
  x = jax.random.normal(jax.random.PRNGKey(1), (N, D))
  labels = jnp.arange(N, dtype=jnp.int32) % 3
  ref = jnp.stack([f(p, x) for f, p in zip(fns, params, strict=True)])[labels, jnp.arange(N)]
  for mode in ("exact-sync", "profiled"):
    moe = route.Routed(route.Branches(fns), route.Router(3, "label"), mode=mode,
                       capacity_factor=0.5, overflow_chunk=3)
    y = moe(params, x, labels=labels)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=RTOL, atol=ATOL)


def test_signature_cache_and_stats():
  params, x, logits = make(5)
  moe = route.Routed(route.Experts(expert_fn), route.Router(E, k=1))
  moe(params, x, logits)
  moe(params, x, logits)
  s = moe.stats()
  assert s["compiles"] == 1 and s["signature_hits"] == 1 and s["host_syncs"] == 2
  assert len(moe.profile) == 2
  assert 0.0 <= s["padded_fraction"] < 1.0


def test_covering_signature_reused():
  moe = route.Routed(route.Experts(expert_fn), route.Router(E), fusion="none",
                     buckets=buckets.linear(1), slack=0.5)
  moe._execs[route.make_plan((10, 10, 10, 10), "none")] = object()
  assert moe._signature(np.array([9, 10, 10, 8]), N).caps == (10, 10, 10, 10)
  assert moe.stats()["covered_hits"] == 1
  assert moe._signature(np.array([9, 10, 10, 8]), N).caps == (10, 10, 10, 10)  # plan cache
  assert moe.stats()["covered_hits"] == 2 and len(moe._sigs) == 1
  assert moe._signature(np.array([1, 1, 1, 1]), N).caps == (1, 1, 1, 1)  # covering wastes


@pytest.mark.parametrize("fusion", ["auto", "bucket"])
def test_plan_cache_matches_planner(fusion):
  """Cached signatures give the planner's capacities; a new executable clears the cache."""
  from dynjax.route._dispatch import auto_capacities, bucket_capacity

  policy = buckets.geometric(1.25, min=8).aligned(8)
  moe = route.Routed(route.Experts(expert_fn), route.Router(16), fusion=fusion, buckets=policy,
                     group_overhead=16)
  rng = np.random.default_rng(0)
  for _ in range(40):
    loads = rng.integers(0, 60, size=16) * (rng.random(16) < 0.8)
    want = (auto_capacities(loads, policy, 16, 200) if fusion == "auto" else
            tuple(bucket_capacity(policy, int(v), 200) for v in loads))
    assert moe._signature(loads, 200).caps == want
  params, x, logits = make(3)
  moe2 = route.Routed(route.Experts(expert_fn), route.Router(E))
  moe2(params, x, logits)
  assert not moe2._sigs  # cleared by the compile
  moe2(params, x, logits)
  assert len(moe2._sigs) == 1 and moe2.stats()["signature_hits"] == 1


def test_profile_save_load(tmp_path):
  prof = route.Profile(4)
  prof.record([10, 2, 0, 4], 16)
  prof.record(np.array([8, 4, 0, 4]), 16)
  path = tmp_path / "profile.json"
  prof.save(path)
  data = json.loads(path.read_text())
  assert data["format"] == "dynjax.route.Profile" and data["loads"][1] == [8, 4, 0, 4]
  back = route.Profile.load(path)
  pol = buckets.pow2(min=1)
  assert len(back) == 2
  assert back.capacities(16, pol) == prof.capacities(16, pol) == (16, 4, 0, 4)
  assert back.capacities(32, pol, quantile=0.0) == (16, 4, 0, 8)
  moe = route.Routed(route.Experts(expert_fn), route.Router(4), mode="profiled",
                     profile=str(path))
  assert len(moe.profile) == 2


def test_exact_sync_under_jit_raises():
  params, x, logits = make(6)
  moe = route.Routed(route.Experts(expert_fn), route.Router(E))
  with pytest.raises(RoutingError, match=re.escape(
      "dynjax.route.Routed: mode='exact-sync' reads the loads on the host, but it was called "
      "inside jax.jit/grad/vmap (its inputs are tracers); call it outside the transformation, "
      "or use mode='profiled'")):
    jax.jit(moe)(params, x, logits)


def test_bad_params_and_x():
  params, x, logits = make(7)
  moe = route.Routed(route.Experts(expert_fn), route.Router(E))
  bad = dict(params, w2=params["w2"][:3])
  with pytest.raises(RoutingError, match=re.escape(
      "dynjax.route.Experts: parameters must be stacked with one slice per path (num_paths=4) "
      "along axis 0:\n  params['w2']: shape (3, 16, 8), expected leading axis 4\n")):
    moe(bad, x, logits)
  with pytest.raises(RoutingError, match=re.escape(
      "dynjax.route.Routed: x has shape (23, 8), expected its first axis to match the logits "
      "(24 cells); pass one routing row per cell of x")):
    moe(params, x[:23], logits)
  with pytest.raises(RoutingError, match=re.escape("logits has shape (24, 3), expected "
                                                   "(num_cells, 4)")):
    moe(params, x, logits[:, :3])


def test_bf16_runs_close():
  params, x, logits = make(8, bias="skewed")
  p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  moe = route.Routed(route.Experts(expert_fn), route.Router(E, k=2))
  y = moe(p16, x.astype(jnp.bfloat16), logits)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(dense(params, x, logits, 2)),
                             rtol=0.1, atol=0.1)


_PROFILED = route.Routed(route.Experts(expert_fn), route.Router(E, k=2), mode="profiled",
                         buckets=buckets.linear(2), capacity_factor=1.0, overflow_chunk=4)
_PROFILED_JIT = jax.jit(_PROFILED)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), skew=st.floats(0.0, 8.0), hot=st.integers(0, E - 1))
def test_profiled_property(seed, skew, hot):
  params, x, logits = make(seed)
  logits = logits.at[:, hot].add(skew)
  y = _PROFILED_JIT(params, x, logits)
  np.testing.assert_allclose(np.asarray(y), np.asarray(dense(params, x, logits, 2)),
                             rtol=RTOL, atol=ATOL)
