"""dynjax's Pallas flash attention (``attention="pallas"``), in Pallas' interpret mode off GPU:
the kernel against the materialised reference and the model's own attention at exact shapes,
its gradient, the rewrite under ``padding="auto"``/``"trust"``, and the sites it refuses."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax.bucketing import _attention_match, _flash
from examples import models

B, H, DH = 3, 2, 16


def _qkv(t, s=None, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed + t)
  q = rng.standard_normal((B, t, H, DH)).astype(dtype)
  k, v = (rng.standard_normal((B, s or t, H, DH)).astype(dtype) for _ in range(2))
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _model_attention(q, k, v, key_mask):
  """The Flax idiom, at the exact (unpadded) shape: the ground truth."""
  return models.attend(q, k, v, key_mask)


@pytest.mark.parametrize("t,s", [(5, 5), (37, 37), (70, 130), (64, 1)])
def test_kernel_matches_the_model_at_the_true_length(t, s):
  # Keys past kv_len do not exist: the kernel on padded keys equals the model on the real ones.
  q, k, v = _qkv(t, s)
  kv_len = np.array([s, max(1, s // 2), 1], np.int32)
  rng = np.random.default_rng(s)
  user = rng.random((B, s)) > 0.3
  user[1, :] = False  # every real key masked: uniform over the real keys, as unpadded
  for mask, blocks in ((None, None), (user, None), (user, (16, 16))):  # 16: many key blocks
    got = _flash.flash_attention(q, k, v, kv_len=jnp.asarray(kv_len), blocks=blocks,
                                 key_mask=None if mask is None else jnp.asarray(mask))
    assert got.shape == q.shape
    for b in range(B):
      n = kv_len[b]
      km = None if mask is None else jnp.asarray(mask[b:b + 1, :n])
      want = _model_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], km)
      np.testing.assert_allclose(got[b:b + 1], want, rtol=2e-5, atol=2e-5,
                                 err_msg=f"t={t} s={s} b={b} mask={mask is not None} {blocks}")


def test_kernel_without_lengths_bf16_and_scale():
  q, k, v = _qkv(20, dtype=jnp.bfloat16)
  got = _flash.flash_attention(q, k, v, scale=0.3)
  want = _flash.reference(q, k, v, None, None, 0.3)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


def test_gradient_is_the_models():
  q, k, v = _qkv(9)
  kv_len = jnp.asarray([9, 4, 2])
  mask = jnp.arange(9)[None, :] < kv_len[:, None]

  def ours(q, k, v):
    return jnp.sum(_flash.flash_attention(q, k, v, kv_len=kv_len) ** 2)

  def model(q, k, v):  # the model's own masked attention (finfo.min fill) at full length
    return jnp.sum(_model_attention(q, k, v, mask) ** 2)

  for a, b in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(model, (0, 1, 2))(q, k, v),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_unsupported_operands_are_named():
  q, k, v = _qkv(4)
  with pytest.raises(ValueError, match=r"head dim 12 \(the kernel takes powers of two"):
    _flash.flash_attention(q[..., :12], k[..., :12], v[..., :12])
  with pytest.raises(ValueError, match=r"mixed dtypes float32/bfloat16/float32"):
    _flash.flash_attention(q, k.astype(jnp.bfloat16), v)


@pytest.fixture
def pallas_off_gpu(monkeypatch):
  monkeypatch.setattr(_attention_match, "PALLAS_OFF_GPU", True)
  calls = []
  real = _flash.flash_attention

  def counting(*a, **kw):
    calls.append(kw.get("kv_len") is not None)
    return real(*a, **kw)

  monkeypatch.setattr(_flash, "flash_attention", counting)
  return calls


def flax_attention(q, k, v, lengths):
  return models.attend(q, k, v, (jnp.arange(q.shape[1])[None, :] < lengths[:, None]))


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_rewrite_is_exact_on_the_valid_rows(padding, pallas_off_gpu):
  spec = f"b, t, {H}, {DH}"
  f = dynjax.jit(flax_attention, dims={"q": spec, "k": spec, "v": spec, "lengths": "b"},
                 padding=padding, buckets={"t": [8, 16], "b": [4]}, attention="pallas")
  for t, lengths in ((5, [5, 3, 1]), (11, [11, 6, 2]), (16, [16, 16, 9])):
    q, k, v = _qkv(t)
    lengths = np.asarray(lengths, np.int32)
    got = np.asarray(f(q, k, v, lengths))
    want = np.asarray(jax.jit(flax_attention)(q, k, v, lengths))
    valid = (np.arange(t)[None, :] < lengths[:, None])[:, :, None, None]
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0),
                               rtol=2e-5, atol=2e-5, err_msg=f"T={t}")
  assert pallas_off_gpu  # the kernel ran
  text = f.explain()
  assert "rewritten to dynjax's Pallas flash attention (scale=0.25, mask)" in text
  if padding == "auto":
    assert all(pallas_off_gpu)  # the true key length went in
    assert "Pallas: keys past the true t excluded" in text


def test_refused_sites_say_why(pallas_off_gpu):
  def with_bias(q, k, v, lengths):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DH)
    s = s + jnp.where(jnp.arange(q.shape[1])[None, :] < lengths[:, None], 0.0, -1e9)[
        :, None, None, :]
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

  def per_head_mask(q, k, v, lengths):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DH)
    m = jnp.arange(q.shape[1])[None, None, :] < (lengths[:, None, None]
                                                 + jnp.arange(H)[None, :, None])
    s = jnp.where(m[:, :, None, :], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

  spec = f"b, t, {H}, {DH}"
  for fun, why in ((with_bias, "an additive bias"), (per_head_mask, "a mask over heads")):
    f = dynjax.jit(fun, dims={"q": spec, "k": spec, "v": spec, "lengths": "b"},
                   buckets={"t": [8], "b": [4]}, attention="pallas")
    q, k, v = _qkv(6)
    lengths = np.asarray([6, 3, 1], np.int32)
    got = np.asarray(f(q, k, v, lengths))
    want = np.asarray(jax.jit(fun)(q, k, v, lengths))
    valid = (np.arange(6)[None, :] < lengths[:, None])[:, :, None, None]
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0),
                               rtol=1e-5, atol=1e-5)
    assert f"left unchanged: {why}" in f.explain(), f.explain()
  assert not pallas_off_gpu


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_pallas_off_gpu_left_unchanged():
  spec = f"b, t, {H}, {DH}"
  f = dynjax.jit(flax_attention, dims={"q": spec, "k": spec, "v": spec, "lengths": "b"},
                 buckets={"t": [8], "b": [4]}, attention="pallas")
  q, k, v = _qkv(6)
  f(q, k, v, np.asarray([6, 3, 1], np.int32))
  assert "left unchanged: no GPU (backend cpu): the Pallas kernel is Triton" in f.explain()
