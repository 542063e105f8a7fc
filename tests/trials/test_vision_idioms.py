"""Vision models at variable image sizes (``benchmarks/probe_vision.py``) under
``dynjax.flax.jit`` / ``dynjax.jit``: every output leaf compared with ``jax.jit`` at the exact
shape, compiles and buckets counted.

Images of one size within a batch, the size changing between calls; ``pow2(16, 128)`` on h
and w.  The sizes (37, 45), (41, 41), (23, 30) fall in two buckets, (64, 64) and (32, 32).

Three public idioms fell back until dynjax inferred the facts their traces need (session 26,
``jit/_facts.py``), each a JAX symbolic-shape limit that plain ``jax.export`` hits too:

* big_vision ViT: ``reshape(n, h * w, c)`` after the VALID patch conv: ``floordiv(h - 4, 4) *
  floordiv(w - 4, 4) + ... >= 0`` is inconclusive (true at every h >= 1): a fact checked over
  a grid of sizes, then on every call and bucket.
* U-Net padded to a multiple of 4 as ``(-h) % 4``: the ``nn.ConvTranspose`` output and the
  skip are one size written two ways, ``concatenate`` refused them: a shape identity.
* Swin padded to a multiple of the window as ``(ws - h % ws) % ws``: ``window_reverse``'s
  ``reshape(b, hp, wp, -1)`` cannot prove ``hp`` divides by the window.  One stage's windows
  pad now (a remainder 0 at every size checked, a ``-1`` that is 3 at every size); the full
  model's second stage needs facts too long to adopt, and still falls back.

Training steps run with both sides in float64: in float32 the gradient of a BatchNorm bias
that feeds another BatchNorm (0 in exact arithmetic) is rounding noise that differs with the
reduction order, so a per-leaf relative tolerance cannot hold there in float32.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("flax.linen")
pytest.importorskip("optax")

from benchmarks import probe_vision  # noqa: E402
from tests.trials import _clients  # noqa: E402

SIZES = ((37, 45), (41, 41), (23, 30))
BUCKETS = {"b=2, h=64, w=64": 2, "b=2, h=32, w=32": 1}


@pytest.fixture(scope="module", autouse=True)
def _warm():
  _clients.warm_jax()


def _run(name, mode, **kw):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return probe_vision.run_case(name, mode, SIZES, **kw)


def _bucketed(rec):
  assert rec["exact"], rec["bad"]
  assert rec["fallbacks"] == []
  assert rec["exact_calls"] == 0
  assert rec["per_bucket_calls"] == BUCKETS
  assert rec["compiles"] == 2


@pytest.mark.parametrize("name", [
  "resnet",  # flax imagenet example: strided 3x3 + 1x1 projection, max_pool SAME, BatchNorm
  "vit_patchify",  # MAE patchify reshape after padding to the patch, sincos2d posemb (mgrid)
  "unet_resize",  # avg_pool (floor), GroupNorm, decoder resized to the skip's odd shape
  "convnext",  # 4x4/4 stem, depthwise 7x7, LayerNorm, exact GELU
  "mobilenetv2",  # depthwise strided 3x3 with padding 1, inverted residuals, relu6
  "efficientnet",  # MBConv, squeeze-and-excitation (mean over h, w), depthwise 5x5/2 SAME
  "fcn",  # dilated conv, logits resized to the input size with jax.image.resize
  "unet_ceilpad",  # U-Net padded as -(-h // 4) * 4 - h, ConvTranspose, skip concat, crop
  "swin_ceilpad",  # Swin: window pad, cyclic roll, img_mask slices, window reshapes, crop
  "vit_h>=4",  # big_vision ViT, posemb resized to the grid, constraints=("h >= 4", "w >= 4")
])
def test_vision_model_is_exact_and_bucketed(name):
  _bucketed(_run(name, "flax", on_fallback="error"))


def test_model_apply_under_dynjax_jit_is_exact_and_bucketed():
  _bucketed(_run("efficientnet", "apply", on_fallback="error"))


@pytest.mark.parametrize("name", ["resnet", "mobilenetv2", "fcn", "unet_ceilpad"])
def test_train_step_with_batch_stats_is_exact_and_bucketed(name):
  # TrainState.apply_gradients (SGD momentum), mutable batch_stats, grads returned
  _bucketed(_run(name, "train", on_fallback="error", x64=True))


@pytest.mark.parametrize("name", ["vit", "unet"])
def test_public_idioms_that_fell_back_are_bucketed_under_inferred_facts(name):
  rec = _run(name, "flax", on_fallback="error")
  _bucketed(rec)


def test_the_full_swin_still_falls_back_naming_the_reshape():
  """The window reshapes of the full model's second stage (after PatchMerging) need facts
  whose expressions are too long for JAX's symbolic comparisons (minutes a trace):
  ``_facts.MAX_RULE_CHARS`` refuses them, so it falls back at once, as before, with the
  advice; ``tests/jit/test_shape_identities.py`` pads one stage's windows."""
  rec = _run("swin", "flax")
  assert rec["exact"], rec["bad"]  # unpadded, one compile per shape
  (fallback,) = rec["fallbacks"]
  assert "Cannot divide evenly the sizes of shapes" in fallback, fallback
  assert rec["exact_calls"] == rec["calls"] == len(SIZES)
