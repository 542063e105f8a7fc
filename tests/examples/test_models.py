"""The shared models (examples/models.py): one weight layout across jax.numpy, Linen and PyTorch;
pad-safety."""

from __future__ import annotations

import numpy as np
import pytest

from examples import models

CFG = models.EncoderConfig(vocab=97, d_model=32, heads=4, layers=2, ffn=64, max_len=48)
LCFG = models.LstmConfig(vocab=97, embed=8, hidden=16, classes=3)


def _batch(t=10, pad_to=None, seed=0):
  rng = np.random.default_rng(seed)
  tok = rng.integers(1, 97, (3, t)).astype(np.int32)
  lens = np.array([t, max(1, t // 2), 1], np.int32)
  if pad_to is not None:
    big = np.full((3, pad_to), 5, np.int32)  # garbage in the padded region on purpose
    big[:, :t] = tok
    tok = big
  return tok, lens


def test_linen_params_layout_matches_numpy_init():
  import jax

  params = models.init_encoder_params(CFG)
  tok, lens = _batch()
  variables = models.BertEncoder(CFG).init(jax.random.key(0), tok, lens)
  assert jax.tree.structure(variables["params"]) == jax.tree.structure(params)
  assert jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape, variables["params"],
                                      params))


def test_linen_equals_jnp_and_is_pad_safe():
  params = models.init_encoder_params(CFG)
  tok, lens = _batch()
  a = np.asarray(models.BertEncoder(CFG).apply({"params": params}, tok, lens))
  b = np.asarray(models.encoder_apply(params, tok, lens, cfg=CFG))
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  tok_p, _ = _batch(pad_to=32)
  c = np.asarray(models.encoder_apply(params, tok_p, lens, cfg=CFG))
  np.testing.assert_allclose(c, b, rtol=1e-5, atol=1e-6)
  # The unmasked natural model equals the masked one on an unpadded row.
  u = np.asarray(models.encoder_apply_unmasked(params, tok[1:2, :lens[1]], cfg=CFG))
  np.testing.assert_allclose(u, b[1:2], rtol=1e-5, atol=1e-6)


def test_lstm_is_pad_safe():
  params = models.init_lstm_params(LCFG)
  tok, lens = _batch()
  a = np.asarray(models.lstm_apply(params, tok, lens))
  b = np.asarray(models.lstm_apply(params, _batch(pad_to=40)[0], lens))
  c = np.asarray(models.lstm_apply(params, tok[1:2, :lens[1]], lens[1:2]))
  assert a.shape == (3, 3)
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(a[1:2], c, rtol=1e-5, atol=1e-6)


def test_torch_twins_match():
  torch = pytest.importorskip("torch")
  params = models.init_encoder_params(CFG)
  tok, lens = _batch()
  m = models.torch_bert(params, CFG, device="cpu")
  with torch.inference_mode():
    got = m(torch.from_numpy(tok), torch.from_numpy(lens)).numpy()
  want = np.asarray(models.encoder_apply(params, tok, lens, cfg=CFG))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  lp = models.init_lstm_params(LCFG)
  ml = models.torch_lstm(lp, device="cpu")
  with torch.inference_mode():
    got = ml(torch.from_numpy(tok), torch.from_numpy(lens)).numpy()
  np.testing.assert_allclose(got, np.asarray(models.lstm_apply(lp, tok, lens)), rtol=1e-4,
                             atol=1e-5)


def test_torch_absent_is_reported():
  try:
    import torch  # noqa: F401
  except ImportError:
    assert not models.torch_available()
  else:
    assert models.torch_available()


@pytest.mark.parametrize("impl", ["xla", "xla_lengths"])
def test_attention_impl_same_weights_same_result(impl):
  import dataclasses

  import jax

  params = models.init_encoder_params(CFG)
  tok, lens = _batch()
  want = np.asarray(models.BertEncoder(CFG).apply({"params": params}, tok, lens))
  cfg = dataclasses.replace(CFG, attention_impl=impl)
  module = models.BertEncoder(cfg)
  variables = module.init(jax.random.key(0), tok, lens)
  assert jax.tree.structure(variables["params"]) == jax.tree.structure(params)
  got = np.asarray(module.apply({"params": params}, tok, lens))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  got_jnp = np.asarray(models.encoder_apply(params, tok, lens, cfg=cfg))
  np.testing.assert_allclose(got_jnp, want, rtol=1e-5, atol=1e-5)
