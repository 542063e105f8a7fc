"""The opt-in attention rewrite (dynjax/bucketing/_attention.py, ``dynjax.jit(attention=...)``).

On CPU the rewrite targets ``implementation="xla"``: every rewritten function must equal
``jax.jit`` of the original at the exact shape (fp32, 1e-5) on its valid rows, under
``padding="trust"`` and ``"auto"``.  Patterns it must not rewrite stay as written (exact) and
``explain()`` says why.  The cuDNN path runs where a GPU is (bf16 tolerance).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax._errors import SpecError
from examples import models

B, H, DH = 3, 2, 8
LENGTHS = {5: [5, 3, 1], 11: [11, 6, 2], 16: [16, 16, 9]}


@pytest.fixture
def dpa_calls(monkeypatch):
  """Counts jax.nn.dot_product_attention calls (each is one rewritten site being traced)."""
  calls = []
  real = jax.nn.dot_product_attention

  def counting(*a, **kw):
    calls.append(kw.get("implementation"))
    return real(*a, **kw)

  monkeypatch.setattr(jax.nn, "dot_product_attention", counting)
  return calls


def _dims(dh):
  spec = f"b, t, {H}, {dh}"
  return {"q": spec, "k": spec, "v": spec, "lengths": "b"}


def _qkv(t, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed + t)
  return [rng.standard_normal((B, t, H, DH)).astype(dtype) for _ in range(3)]


def _check(fun, padding, masked, attention="xla", ts=(5, 11, 16), tol=1e-5, layout=None):
  """Runs ``fun(q, k, v[, lengths])`` through dynjax.jit and compares with jax.jit per T."""
  dims = _dims(DH)
  if not masked:
    del dims["lengths"]
  f = dynjax.jit(fun, dims=dims, padding=padding, buckets={"t": [8, 16], "b": [4]},
                 attention=attention)
  for t in ts:
    q, k, v = _qkv(t)
    lengths = np.asarray(LENGTHS[t], np.int32)
    args = (q, k, v, lengths) if masked else (q, k, v)
    got = np.asarray(f(*args))
    want = np.asarray(jax.jit(fun)(*args))
    assert got.shape == want.shape
    if masked:
      valid = (np.arange(t)[None, :] < lengths[:, None]).reshape(B, t, *([1] * (got.ndim - 2)))
      got, want = np.where(valid, got, 0), np.where(valid, want, 0)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"T={t}")
  return f


def _key_mask(lengths, t):
  return jnp.arange(t)[None, :] < lengths[:, None]


def flax_attention(q, k, v, lengths):
  return models.attend(q, k, v, _key_mask(lengths, q.shape[1]))


def unmasked_attention(q, k, v):
  return models.attend(q, k, v, None)


# -- rewritten -------------------------------------------------------------------------------
@pytest.mark.parametrize("padding", ["trust", "auto"])
def test_flax_idiom_rewritten_and_exact(padding, dpa_calls):
  f = _check(flax_attention, padding, masked=True)
  assert dpa_calls and set(dpa_calls) == {"xla"}
  text = f.explain()
  assert "attention='xla':" in text
  assert "rewritten to jax.nn.dot_product_attention(implementation='xla', scale=0.353553, mask)" \
      in text


def test_unmasked_under_auto_uses_true_key_length(dpa_calls):
  f = _check(unmasked_attention, "auto", masked=False)
  assert dpa_calls
  assert "XLA: padded keys masked (true t)" in f.explain()


def test_all_masked_row_averages_over_real_keys_only(dpa_calls):
  # A row whose every real key is masked: unpadded softmax is uniform over the real keys.
  def fun(q, k, v, lengths):
    mask = (jnp.arange(q.shape[1])[None, :] < lengths[:, None]) & (lengths[:, None] > 2)
    return models.attend(q, k, v, mask)

  f = _check(fun, "auto", masked=True)
  assert "padded keys get a -inf bias" in f.explain()


@pytest.mark.parametrize("padding", ["trust", "auto"])
def test_variants_rewritten(padding, dpa_calls):
  def scaled_by_mul_negated_where(q, k, v, lengths):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(DH))
    s = jnp.where(~_key_mask(lengths, q.shape[1])[:, None, None, :], -jnp.inf, s)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

  def bias_and_heads_first(q, k, v, lengths):  # q, k, v laid out [b, h, t, d] by the user
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(DH)
    s = s + jnp.where(_key_mask(lengths, q.shape[2]), 0.0, -1e9)[:, None, None, :]
    w = jax.nn.softmax(s, axis=-1)
    return jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", w, v), 1, 2)

  def single_head(q, k, v, lengths):
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    s = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(DH)
    s = jnp.where(_key_mask(lengths, q.shape[1])[:, None, :], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)

  for fun in (scaled_by_mul_negated_where, bias_and_heads_first, single_head):
    dpa_calls.clear()
    f = _check(fun, padding, masked=True)
    assert dpa_calls, fun.__name__
    assert "rewritten to" in f.explain(), fun.__name__


def test_encoder_auto_and_trust(dpa_calls):
  cfg = models.EncoderConfig(vocab=97, d_model=16, heads=2, layers=2, ffn=32, max_len=16)
  params = models.init_encoder_params(cfg)
  module = models.BertEncoder(cfg)

  def pooled(p, tokens, lengths):
    return module.apply({"params": p}, tokens, lengths)

  def unmasked(p, tokens):
    return module.apply({"params": p}, tokens, None, method="sequence")

  for padding, fun, masked in (("trust", pooled, True), ("auto", pooled, True),
                               ("auto", unmasked, False)):
    dims = {"tokens": "b, t", "lengths": "b"} if masked else {"tokens": "b, t"}
    f = dynjax.jit(fun, dims=dims, padding=padding, buckets={"t": [16], "b": [4]},
                   attention="xla")
    for t in (5, 13):
      rng = np.random.default_rng(t)
      tokens = rng.integers(1, 97, (B, t)).astype(np.int32)
      lengths = np.asarray([t, t // 2, 1], np.int32)
      args = (params, tokens, lengths) if masked else (params, tokens)
      np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(jax.jit(fun)(*args)),
                                 rtol=1e-5, atol=1e-5)
    assert "(x2)" in f.explain()  # both layers
  assert dpa_calls


def test_exact_mode_families_rewritten_too(dpa_calls):
  f = dynjax.jit(flax_attention, padding="auto", attention="xla")  # dims="auto": exact first
  q, k, v = _qkv(5)
  lengths = np.asarray(LENGTHS[5], np.int32)
  np.testing.assert_allclose(np.asarray(f(q, k, v, lengths)),
                             np.asarray(jax.jit(flax_attention)(q, k, v, lengths)),
                             rtol=1e-5, atol=1e-5)
  assert dpa_calls


# -- not rewritten ---------------------------------------------------------------------------
def softmax_over_queries(q, k, v, lengths):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DH)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-2), v)


def causal(q, k, v, lengths):
  t = q.shape[1]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DH)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def dropout_on_weights(q, k, v, lengths):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DH)
  s = jnp.where(_key_mask(lengths, q.shape[1])[:, None, None, :], s, jnp.finfo(s.dtype).min)
  w = jax.nn.softmax(s, axis=-1)
  keep = (jnp.arange(q.shape[1]) % 3 != 0).astype(w.dtype)  # a fixed "dropout" pattern
  return jnp.einsum("bhqk,bkhd->bqhd", w * keep / 0.9, v)


def weights_returned(q, k, v, lengths):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DH)
  s = jnp.where(_key_mask(lengths, q.shape[1])[:, None, None, :], s, jnp.finfo(s.dtype).min)
  w = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", w, v), jnp.sum(w, axis=(1, 3))


def weak_mask_fill(q, k, v, lengths):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DH)
  s = jnp.where(_key_mask(lengths, q.shape[1])[:, None, None, :], s, -1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("fun, padding, why", [
    (softmax_over_queries, "trust", "left unchanged: softmax over axis 2, not the key axis "
                                    "the value product contracts (3)"),
    (causal, "trust", "left unchanged: the mask depends on the query axis"),
    (dropout_on_weights, "trust", "left unchanged: the softmax weights go through mul before "
                                  "the value product (dropout?)"),
    (weights_returned, "auto", "is also used elsewhere"),
    (weak_mask_fill, "auto", "left unchanged: mask fill -1 is not very negative"),
])
def test_not_rewritten_and_exact(fun, padding, why, dpa_calls):
  # Unmasked padding under trust would change these functions' results: compare exact sizes.
  f = dynjax.jit(fun, dims=_dims(DH), padding=padding, buckets={"t": [5, 16], "b": [3, 4]},
                 attention="xla")
  q, k, v = _qkv(5)
  lengths = np.asarray(LENGTHS[5], np.int32)
  got, want = f(q, k, v, lengths), jax.jit(fun)(q, k, v, lengths)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
  assert not dpa_calls
  assert why in f.explain(), f.explain()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_cudnn_on_cpu_left_unchanged(dpa_calls):
  f = _check(flax_attention, "auto", masked=True, attention="cudnn", ts=(5,))
  assert not dpa_calls
  assert "left unchanged: no GPU (backend cpu)" in f.explain()


def test_nothing_found():
  f = dynjax.jit(lambda x: jnp.tanh(x), dims={"x": "b, t"}, attention="xla")
  f(np.ones((2, 3), np.float32))
  assert "no scaled-dot-product attention found" in f.explain()


def test_option_errors():
  with pytest.raises(SpecError, match=r"attention='flash' is not valid; use one of None, "
                                      r"'cudnn', 'pallas', 'xla'"):
    dynjax.jit(flax_attention, attention="flash")
  with pytest.raises(SpecError, match=r"attention='xla' needs padding=\"auto\" or \"trust\""):
    dynjax.jit(flax_attention, padding="exact", attention="xla")


# -- cuDNN (GPU only) ------------------------------------------------------------------------
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN fused attention needs a GPU")
@pytest.mark.parametrize("padding", ["trust", "auto"])
def test_cudnn_bf16_within_tolerance(padding, dpa_calls):
  global DH
  old, DH = DH, 64  # cuDNN: head dim a multiple of 8
  try:
    def fun(q, k, v, lengths):
      return models.attend(q, k, v, _key_mask(lengths, q.shape[1]))

    f = dynjax.jit(fun, dims=_dims(64), padding=padding, buckets={"t": [16], "b": [4]},
                   attention="cudnn")
    for t in (5, 11, 16):
      rng = np.random.default_rng(t)
      q, k, v = (jnp.asarray(rng.standard_normal((B, t, H, 64)), jnp.bfloat16)
                 for _ in range(3))
      lengths = np.asarray(LENGTHS[t], np.int32)
      got = np.asarray(f(q, k, v, lengths), np.float32)
      want = np.asarray(jax.jit(fun)(q, k, v, lengths), np.float32)
      valid = (np.arange(t)[None, :] < lengths[:, None])[:, :, None, None]
      np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0),
                                 atol=6e-2, rtol=6e-2)
    assert "cudnn" in dpa_calls
    assert "implementation='cudnn'" in f.explain()
  finally:
    DH = old


def test_softmax_as_custom_jvp_call(dpa_calls):
  # jax >= 0.11 may trace jax.nn.softmax as one custom_jvp_call (jax_softmax_custom_jvp).
  if not hasattr(jax.config, "jax_softmax_custom_jvp"):
    pytest.skip("this jax has no jax_softmax_custom_jvp flag")
  old = jax.config.jax_softmax_custom_jvp
  jax.config.update("jax_softmax_custom_jvp", True)
  try:
    q = jnp.zeros((B, 5, H, DH))
    closed = jax.make_jaxpr(unmasked_attention)(q, q, q)
    assert "custom_jvp_call" in str(closed)
    for padding in ("trust", "auto"):
      dpa_calls.clear()
      f = _check(flax_attention, padding, masked=True)
      assert dpa_calls and "rewritten to" in f.explain()
  finally:
    jax.config.update("jax_softmax_custom_jvp", old)


def test_gradient_left_unchanged_and_exact(dpa_calls):
  # A training step: the softmax weights feed the backward pass too, so nothing is rewritten.
  def loss_grad(q, k, v, lengths):
    return jax.grad(lambda q: jnp.sum(flax_attention(q, k, v, lengths) ** 2))(q)

  f = _check(loss_grad, "auto", masked=True, tol=1e-4)
  assert not dpa_calls
  assert "is also used elsewhere" in f.explain()
