"""Dynamic routing beyond MoE: per-sample early exit and layer skipping with dynjax.route.

    python examples/dynamic_routing.py

A small residual MLP classifier.  After the first block a confidence head decides, per sample,
whether it exits there (cheap branch) or runs the remaining blocks (deep branch); a second demo
routes each sample to 0, 2 or 4 extra blocks (layer skipping) by a tiny policy head.  Samples are
*cells*, branches are *paths*: each branch runs on a batch whose size is bucketed (pow2), so a
stream of batches with ever-changing splits compiles a handful of executables, and every sample
gets exactly the result of its branch (checked against running each sample alone).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynjax import buckets, route  # noqa: E402

D, CLASSES, BLOCKS, BATCH = 512, 10, 8, 512


def block(w, h):
  return h + jnp.tanh(h @ w)


def init(key):
  ks = jax.random.split(key, BLOCKS + 3)
  return {"blocks": [jax.random.normal(k, (D, D)) * (0.5 / D**0.5) for k in ks[:BLOCKS]],
          "head": jax.random.normal(ks[-3], (D, CLASSES)) * 0.2,
          "exit": jax.random.normal(ks[-2], (D, CLASSES)) * 0.2,
          "policy": jax.random.normal(ks[-1], (D, 3))}


def exit_branch(p, h):  # cheap: classify from the first block's features
  return h @ p["exit"]


def deep_branch(p, h):  # the remaining blocks, then the head
  for w in p["blocks"][1:]:
    h = block(w, h)
  return h @ p["head"]


def skip_branch(n_extra):
  def run(p, h):
    for w in p["blocks"][1:1 + n_extra]:
      h = block(w, h)
    return h @ p["head"]
  return run


def main():
  params = init(jax.random.PRNGKey(0))
  first = jax.jit(lambda p, x: block(p["blocks"][0], x))
  confidence = jax.jit(lambda p, h: jax.nn.softmax(h @ p["exit"]).max(-1))

  # -- early exit: label routing (0 = exit, 1 = deep) --------------------------------------
  early = route.Routed(route.Branches([exit_branch, deep_branch]), route.Router(2, "label"),
                       mode="exact-sync", buckets=buckets.pow2(min=16), fusion="none")
  rng = np.random.default_rng(0)
  t_routed = t_dense = 0.0
  hot = 0
  dense = jax.jit(lambda p, h: deep_branch(p, h))
  for step in range(30):
    x = jnp.asarray(rng.normal(size=(BATCH, D)) * rng.uniform(0.2, 2.0), jnp.float32)
    h = first(params, x)
    tau = float(rng.uniform(0.15, 0.5))  # the exit threshold drifts: splits change every batch
    labels = (confidence(params, h) < tau).astype(jnp.int32)
    compiles = early.stats()["compiles"]
    t0 = time.perf_counter()
    y = jax.block_until_ready(early([params, params], h, labels=labels))
    t1 = time.perf_counter()
    jax.block_until_ready(dense(params, h))
    if step and early.stats()["compiles"] == compiles:  # cached signature: steady state
      hot += 1
      t_routed += t1 - t0
      t_dense += time.perf_counter() - t1
    if step % 10 == 0:  # exact: each sample equals its own branch run alone
      lab = np.asarray(labels)
      for i in rng.choice(BATCH, 8, replace=False):
        fn = deep_branch if lab[i] else exit_branch
        np.testing.assert_allclose(np.asarray(y[i]), np.asarray(fn(params, h[i:i + 1])[0]),
                                   rtol=1e-5, atol=1e-5)
  s = early.stats()
  print(f"early exit: 30 batches of {BATCH}, {s['compiles']} executables for "
        f"{len(s['signatures'])} capacity signatures, {s['host_syncs']} host syncs, padded "
        f"fraction {s['padded_fraction']:.2f}")
  print(f"  cached-signature batches ({hot}): routed {t_routed / max(hot, 1) * 1e3:.2f} ms/batch "
        f"(one host sync each) vs deep-for-all {t_dense / max(hot, 1) * 1e3:.2f} ms/batch (CPU)")
  print(f"  mean deep fraction {np.mean(early.profile.fractions()[:, 1]):.2f}")

  # -- layer skipping: top-1 routing over 3 depths (gate renormalised to 1) -----------------
  skip = route.Routed(route.Branches([skip_branch(0), skip_branch(2), skip_branch(4)]),
                      route.Router(3, k=1, renormalize=True), mode="profiled",
                      buckets=buckets.pow2(min=16), capacity_factor=1.0)
  step_fn = jax.jit(lambda p, x: skip([p, p, p], first(p, x), first(p, x) @ p["policy"]))
  x = jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32)
  y = step_fn(params, x)
  h = first(params, x)
  choice = np.asarray(jnp.argmax(h @ params["policy"], -1))
  ref = np.stack([np.asarray(skip_branch(2 * int(c))(params, h[i:i + 1])[0])
                  for i, c in enumerate(choice)])
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
  print(f"layer skipping: depths {np.bincount(choice, minlength=3).tolist()} samples at 0/2/4 "
        f"extra blocks, one jitted executable, capacities {skip.profiled_capacities(BATCH)} "
        "(overflow path covers the rest), exact")


if __name__ == "__main__":
  main()
