"""The end-to-end MoE encoder of the benchmark equals its dense reference (f32, small sizes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax import buckets, route
from examples import moe_encoder as _moe
from examples.data import Request

CFG = dict(vocab=64, d=16, heads=2, ffn=32, experts=4, max_len=64, batch=4, min_bucket=8)


def requests(lengths_list, seed):
  rng = np.random.default_rng(seed)
  out = []
  for lengths in lengths_list:
    lengths = np.asarray(lengths, np.int32)
    tok = np.zeros((len(lengths), int(lengths.max())), np.int32)
    for i, n in enumerate(lengths):
      tok[i, :n] = rng.integers(1, CFG["vocab"], n)
    out.append(Request(tokens=tok, lengths=lengths, doc_ids=np.zeros(len(lengths), np.int64)))
  return out


@pytest.mark.parametrize("fill", [None, 0.05])  # calibrated capacities; forced overflow
def test_e2e_variants_equal_dense_reference(fill):
  k = 2
  params = _moe.init_moe_encoder(CFG, seed=0, dtype=jnp.float32)
  calib = requests([[3, 7, 2, 5], [11, 4, 9, 1]], seed=1)
  stream = requests([[30, 17, 3, 9], [2, 1, 6, 4]], seed=2)  # buckets 32 and 16
  variants = _moe.make_e2e_variants(params, CFG, k, buckets.linear(8, min=8), calib=calib,
                                    overflow_chunk=8, fill=fill)
  moe = variants.pop("_moe")
  variants.pop("_fill")
  if fill is not None:  # only the profiled variant changes
    variants = {n: f for n, f in variants.items() if n.startswith("dynjax profiled")}
  router = route.Router(CFG["experts"], k=k)
  dense = _moe.dense_moe_ffn(router, route.ffn(jax.nn.gelu))
  ref_fn = jax.jit(lambda p, tok, lens: _moe.moe_encoder_apply(p, tok, lens, dense, CFG["heads"]))
  for r in stream:
    ref = np.asarray(ref_fn(params, r.tokens, r.lengths))
    for name, fn in variants.items():
      np.testing.assert_allclose(fn(r.tokens, r.lengths), ref, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{name}, lengths {r.lengths.tolist()}")
  assert len(moe.profile) == len(calib)
  caps = moe.stats()["profiled_capacities"]
  assert caps and all(c % 8 == 0 for cs in caps.values() for c in cs)
  if fill is not None:  # capacities far below the loads: the overflow path ran
    assert any(sum(cs) < 2 * 4 * 32 * 0.5 for cs in caps.values())


def test_mask_routes_padding_nowhere():
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 4))
  logits = jax.random.normal(jax.random.PRNGKey(1), (6, 3))
  mask = jnp.array([True, True, False, True, False, True])
  params = {"w": jax.random.normal(jax.random.PRNGKey(2), (3, 4, 4))}
  m = np.asarray(mask)
  experts, router = route.Experts(lambda p, x: x @ p["w"]), route.Router(3, k=2)
  full = np.asarray(route.dense_reference(experts, params, x, router(logits)))
  sync = route.Routed(experts, router, mode="exact-sync")
  assert int(sync.route(logits, mask=mask).loads.sum()) == 2 * 4
  prof = route.Routed(experts, router, mode="profiled")
  for y in (sync(params, x, logits, mask=mask),
            jax.jit(lambda p, x, lg, mk: prof(p, x, lg, mask=mk))(params, x, logits, mask)):
    y = np.asarray(y)
    np.testing.assert_array_equal(y[~m], 0.0)
    np.testing.assert_allclose(y[m], full[m], rtol=1e-6, atol=1e-6)
