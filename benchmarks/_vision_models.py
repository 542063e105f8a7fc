"""The vision model zoo of ``benchmarks/probe_vision.py``: Linen models copied from public
Flax/JAX code (the probe's docstring says which), small widths so CPU runs are quick."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

B, NUM_CLASSES, SEG_CLASSES = 2, 10, 5


def pad_amount(n, k, ceil: bool = False):
  """What public code pads ``n`` by to reach a multiple of ``k``: ``(k - n % k) % k`` (torch
  Swin, ``(-n) % k`` alike); ``ceil``: the same written ``-(-n // k) * k - n``, the form JAX's
  symbolic shapes know to divide by ``k`` (the workaround rows)."""
  return -(-n // k) * k - n if ceil else (k - n % k) % k


def _nn():
  import flax.linen as nn

  return nn


# -- models ---------------------------------------------------------------------------------------
def models() -> dict[str, Any]:  # noqa: C901 - the model zoo, one class after another
  nn = _nn()
  ModuleDef = Any
  # flax examples/imagenet/models.py
  class ResNetBlock(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)
    @nn.compact
    def __call__(self, x):
      residual = x
      y = self.conv(self.filters, (3, 3), self.strides)(x)
      y = self.norm()(y)
      y = self.act(y)
      y = self.conv(self.filters, (3, 3))(y)
      y = self.norm(scale_init=nn.initializers.zeros_init())(y)
      if residual.shape != y.shape:
        residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
        residual = self.norm(name="norm_proj")(residual)
      return self.act(residual + y)
  class ResNet(nn.Module):
    stage_sizes: Sequence[int] = (1, 1, 1)
    num_classes: int = NUM_CLASSES
    num_filters: int = 8
    dtype: Any = jnp.float32
    @nn.compact
    def __call__(self, x, train: bool = True):
      conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
      norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                               epsilon=1e-5, dtype=self.dtype)
      x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
      x = norm(name="bn_init")(x)
      x = nn.relu(x)
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
      for i, block_size in enumerate(self.stage_sizes):
        for j in range(block_size):
          strides = (2, 2) if i > 0 and j == 0 else (1, 1)
          x = ResNetBlock(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm,
                          act=nn.relu)(x)
      x = jnp.mean(x, axis=(1, 2))
      x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
      return jnp.asarray(x, self.dtype)
  # big_vision models/vit.py (+ FlexiViT's posemb resize)
  class MlpBlock(nn.Module):
    mlp_dim: int | None = None
    @nn.compact
    def __call__(self, x):
      d = x.shape[-1]
      x = nn.Dense(self.mlp_dim or 4 * d)(x)
      x = nn.gelu(x)
      return nn.Dense(d)(x)
  class Encoder1DBlock(nn.Module):
    num_heads: int = 2
    @nn.compact
    def __call__(self, x):
      y = nn.LayerNorm()(x)
      y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, deterministic=True)(y, y)
      x = x + y
      y = nn.LayerNorm()(x)
      return x + MlpBlock()(y)
  class ViT(nn.Module):
    patch_size: tuple[int, int] = (4, 4)
    width: int = 16
    depth: int = 2
    posemb_size: tuple[int, int] = (8, 8)
    num_classes: int = NUM_CLASSES
    @nn.compact
    def __call__(self, image):
      x = nn.Conv(self.width, self.patch_size, strides=self.patch_size, padding="VALID",
                  name="embedding")(image)
      n, h, w, c = x.shape
      x = jnp.reshape(x, [n, h * w, c])
      posemb = self.param("pos_embedding", nn.initializers.normal(stddev=1 / np.sqrt(c)),
                          (1, *self.posemb_size, c))
      posemb = jax.image.resize(posemb, (1, h, w, c), method="bilinear")
      x = x + jnp.reshape(posemb, (1, h * w, c))
      for lyr in range(self.depth):
        x = Encoder1DBlock(name=f"encoderblock_{lyr}")(x)
      x = nn.LayerNorm(name="encoder_norm")(x)
      x = jnp.mean(x, axis=1)  # pool_type="gap"
      return nn.Dense(self.num_classes, name="head")(x)
  def posemb_sincos_2d(h, w, width, temperature=10_000.0, dtype=jnp.float32):
    y, x = jnp.mgrid[:h, :w]
    omega = jnp.arange(width // 4) / (width // 4 - 1)
    omega = 1.0 / (temperature**omega)
    y = jnp.einsum("m,d->md", y.flatten(), omega)
    x = jnp.einsum("m,d->md", x.flatten(), omega)
    pe = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
    return jnp.asarray(pe, dtype)[None, :, :]
  def patchify(imgs, p):  # MAE
    n, h, w, c = imgs.shape
    x = imgs.reshape(n, h // p, p, w // p, p, c)
    x = jnp.einsum("nhpwqc->nhwpqc", x)
    return x.reshape(n, (h // p) * (w // p), p * p * c), (h // p, w // p)
  class ViTPatchify(nn.Module):
    patch: int = 4
    width: int = 16
    num_classes: int = NUM_CLASSES
    @nn.compact
    def __call__(self, image):
      _, h, w, _ = image.shape
      ph, pw = (-h) % self.patch, (-w) % self.patch
      image = jnp.pad(image, ((0, 0), (0, ph), (0, pw), (0, 0)))
      x, (gh, gw) = patchify(image, self.patch)
      x = nn.Dense(self.width, name="embedding")(x)
      x = x + posemb_sincos_2d(gh, gw, self.width)
      cls = self.param("cls", nn.initializers.normal(0.02), (1, 1, self.width))
      x = jnp.concatenate([jnp.tile(cls, [x.shape[0], 1, 1]), x], axis=1)
      x = Encoder1DBlock()(x)
      x = nn.LayerNorm()(x)[:, 0]
      return nn.Dense(self.num_classes)(x)
  # U-Nets
  class DoubleConv(nn.Module):
    features: int
    norm: str = "batch"
    @nn.compact
    def __call__(self, x, train: bool = True):
      for _ in range(2):
        x = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(x)
        x = (nn.BatchNorm(use_running_average=not train)(x) if self.norm == "batch"
             else nn.GroupNorm(num_groups=4)(x))
        x = nn.relu(x)
      return x
  class UNet(nn.Module):
    features: Sequence[int] = (8, 16, 32)
    num_classes: int = SEG_CLASSES
    pad_ceil: bool = False
    @nn.compact
    def __call__(self, x, train: bool = True):
      _, h, w, _ = x.shape
      m = 2 ** (len(self.features) - 1)
      if self.pad_ceil:
        x = jnp.pad(x, ((0, 0), (0, pad_amount(h, m, True)), (0, pad_amount(w, m, True)),
                        (0, 0)))
      else:
        x = jnp.pad(x, ((0, 0), (0, (-h) % m), (0, (-w) % m), (0, 0)))
      skips = []
      for f in self.features[:-1]:
        x = DoubleConv(f)(x, train)
        skips.append(x)
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
      x = DoubleConv(self.features[-1])(x, train)
      for f, skip in zip(reversed(self.features[:-1]), reversed(skips), strict=True):
        x = nn.ConvTranspose(f, (2, 2), strides=(2, 2))(x)
        x = jnp.concatenate([skip, x], axis=-1)
        x = DoubleConv(f)(x, train)
      x = nn.Conv(self.num_classes, (1, 1))(x)
      return x[:, :h, :w]
  class UNetResize(nn.Module):
    features: Sequence[int] = (8, 16, 32)
    num_classes: int = SEG_CLASSES
    @nn.compact
    def __call__(self, x):
      skips = []
      for f in self.features[:-1]:
        x = DoubleConv(f, norm="group")(x)
        skips.append(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
      x = DoubleConv(self.features[-1], norm="group")(x)
      for f, skip in zip(reversed(self.features[:-1]), reversed(skips), strict=True):
        n, sh, sw, _ = skip.shape
        x = jax.image.resize(x, (n, sh, sw, x.shape[-1]), method="bilinear")
        x = jnp.concatenate([skip, x], axis=-1)
        x = DoubleConv(f, norm="group")(x)
      return nn.Conv(self.num_classes, (1, 1))(x)
  # ConvNeXt
  class ConvNeXtBlock(nn.Module):
    dim: int
    layer_scale_init_value: float = 1.0
    @nn.compact
    def __call__(self, x):
      inp = x
      x = nn.Conv(self.dim, (7, 7), padding=((3, 3), (3, 3)), feature_group_count=self.dim,
                  name="dwconv")(x)
      x = nn.LayerNorm(epsilon=1e-6, name="norm")(x)
      x = nn.Dense(4 * self.dim, name="pwconv1")(x)
      x = nn.gelu(x, approximate=False)
      x = nn.Dense(self.dim, name="pwconv2")(x)
      gamma = self.param("gamma", nn.initializers.constant(self.layer_scale_init_value),
                         (self.dim,))
      return inp + gamma * x
  class ConvNeXt(nn.Module):
    dims: Sequence[int] = (8, 16)
    depths: Sequence[int] = (1, 1)
    num_classes: int = NUM_CLASSES
    @nn.compact
    def __call__(self, x):
      for i, (dim, depth) in enumerate(zip(self.dims, self.depths, strict=True)):
        if i == 0:
          x = nn.Conv(dim, (4, 4), strides=(4, 4), padding="VALID", name="stem")(x)
          x = nn.LayerNorm(epsilon=1e-6)(x)
        else:
          x = nn.LayerNorm(epsilon=1e-6)(x)
          x = nn.Conv(dim, (2, 2), strides=(2, 2), padding="VALID")(x)
        for _ in range(depth):
          x = ConvNeXtBlock(dim)(x)
      x = nn.LayerNorm(epsilon=1e-6)(x.mean((1, 2)))
      return nn.Dense(self.num_classes)(x)
  # MobileNetV2 (torchvision's layout)
  class InvertedResidual(nn.Module):
    out: int
    stride: int
    expand: int
    @nn.compact
    def __call__(self, x, train: bool = True):
      bn = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
      inp = x.shape[-1]
      hidden = inp * self.expand
      y = x
      if self.expand != 1:
        y = jnp.minimum(nn.relu(bn()(nn.Conv(hidden, (1, 1), use_bias=False)(y))), 6.0)
      y = nn.Conv(hidden, (3, 3), strides=self.stride, padding=((1, 1), (1, 1)),
                  feature_group_count=hidden, use_bias=False)(y)
      y = nn.relu6(bn()(y))
      y = bn()(nn.Conv(self.out, (1, 1), use_bias=False)(y))
      return x + y if self.stride == 1 and inp == self.out else y
  class MobileNetV2(nn.Module):
    setting: Sequence[tuple[int, int, int, int]] = ((1, 8, 1, 1), (6, 12, 2, 2), (6, 16, 2, 2))
    num_classes: int = NUM_CLASSES
    @nn.compact
    def __call__(self, x, train: bool = True):
      x = nn.Conv(16, (3, 3), strides=2, padding=((1, 1), (1, 1)), use_bias=False)(x)
      x = nn.relu6(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      for t, c, n, s in self.setting:
        for i in range(n):
          x = InvertedResidual(c, s if i == 0 else 1, t)(x, train)
      x = nn.Conv(32, (1, 1), use_bias=False)(x)
      x = nn.relu6(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))
  # EfficientNet MBConv + squeeze-and-excitation
  class SqueezeExcite(nn.Module):
    reduced: int
    @nn.compact
    def __call__(self, x):
      s = jnp.mean(x, axis=(1, 2), keepdims=True)
      s = nn.swish(nn.Conv(self.reduced, (1, 1))(s))
      s = nn.Conv(x.shape[-1], (1, 1))(s)
      return x * nn.sigmoid(s)
  class MBConv(nn.Module):
    out: int
    kernel: int
    stride: int
    expand: int = 4
    @nn.compact
    def __call__(self, x, train: bool = True):
      bn = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.99,
                             epsilon=1e-3)
      inp = x.shape[-1]
      hidden = inp * self.expand
      y = nn.swish(bn()(nn.Conv(hidden, (1, 1), use_bias=False)(x)))
      y = nn.Conv(hidden, (self.kernel, self.kernel), strides=self.stride, padding="SAME",
                  feature_group_count=hidden, use_bias=False)(y)
      y = nn.swish(bn()(y))
      y = SqueezeExcite(max(1, inp // 4))(y)
      y = bn()(nn.Conv(self.out, (1, 1), use_bias=False)(y))
      return x + y if self.stride == 1 and inp == self.out else y
  class EfficientNet(nn.Module):
    num_classes: int = NUM_CLASSES
    @nn.compact
    def __call__(self, x, train: bool = True):
      x = nn.Conv(8, (3, 3), strides=2, padding="SAME", use_bias=False)(x)
      x = nn.swish(nn.BatchNorm(use_running_average=not train, momentum=0.99)(x))
      x = MBConv(8, 3, 1, expand=1)(x, train)
      x = MBConv(12, 5, 2)(x, train)
      x = MBConv(12, 3, 1)(x, train)
      x = MBConv(16, 5, 2)(x, train)
      return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))
  # FCN / DeepLab-style segmentation head
  class FCN(nn.Module):
    num_classes: int = SEG_CLASSES
    @nn.compact
    def __call__(self, x, train: bool = True):
      n, h, w, _ = x.shape
      for f in (8, 16):
        x = nn.Conv(f, (3, 3), strides=2, padding="SAME", use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      x = nn.Conv(16, (3, 3), kernel_dilation=2, padding="SAME", use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      x = nn.Conv(self.num_classes, (1, 1))(x)
      return jax.image.resize(x, (n, h, w, self.num_classes), method="bilinear")
  # Swin
  def window_partition(x, ws):
    b, h, w, c = x.shape
    x = x.reshape(b, h // ws, ws, w // ws, ws, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
  def window_reverse(windows, ws, h, w):
    b = windows.shape[0] // ((h // ws) * (w // ws))
    x = windows.reshape(b, h // ws, w // ws, ws, ws, -1)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)
  def relative_position_index(ws):
    coords = np.stack(np.meshgrid(np.arange(ws), np.arange(ws), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (ws - 1)
    return rel[..., 0] * (2 * ws - 1) + rel[..., 1]
  class WindowAttention(nn.Module):
    dim: int
    ws: int
    heads: int
    @nn.compact
    def __call__(self, x, mask=None):
      b_, n, c = x.shape
      qkv = nn.Dense(3 * c)(x).reshape(b_, n, 3, self.heads, c // self.heads)
      q, k, v = qkv.transpose(2, 0, 3, 1, 4)
      attn = (q * (c // self.heads) ** -0.5) @ k.swapaxes(-2, -1)
      table = self.param("relative_position_bias_table", nn.initializers.truncated_normal(0.02),
                         ((2 * self.ws - 1) ** 2, self.heads))
      bias = table[relative_position_index(self.ws).reshape(-1)].reshape(n, n, -1)
      attn = attn + bias.transpose(2, 0, 1)[None]
      if mask is not None:
        nw = mask.shape[0]
        attn = attn.reshape(b_ // nw, nw, self.heads, n, n) + mask[None, :, None]
        attn = attn.reshape(-1, self.heads, n, n)
      attn = jax.nn.softmax(attn, axis=-1)
      x = (attn @ v).transpose(0, 2, 1, 3).reshape(b_, n, c)
      return nn.Dense(c)(x)
  class SwinBlock(nn.Module):
    dim: int
    heads: int = 2
    ws: int = 4
    shift: int = 0
    pad_ceil: bool = False
    @nn.compact
    def __call__(self, x):
      _, h, w, c = x.shape
      shortcut = x
      x = nn.LayerNorm()(x)
      ws, s, pc = self.ws, self.shift, self.pad_ceil
      x = jnp.pad(x, ((0, 0), (0, pad_amount(h, ws, pc)), (0, pad_amount(w, ws, pc)), (0, 0)))
      _, hp, wp, _ = x.shape
      mask = None
      if s:
        x = jnp.roll(x, (-s, -s), axis=(1, 2))
        img_mask = jnp.zeros((1, hp, wp, 1))
        cnt = 0
        for hs in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
          for wsl in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
            img_mask = img_mask.at[:, hs, wsl, :].set(cnt)
            cnt += 1
        mw = window_partition(img_mask, ws).reshape(-1, ws * ws)
        mask = jnp.where(mw[:, None, :] - mw[:, :, None] != 0, -100.0, 0.0)
      x = WindowAttention(c, ws, self.heads)(window_partition(x, ws), mask)
      x = window_reverse(x, ws, hp, wp)
      if s:
        x = jnp.roll(x, (s, s), axis=(1, 2))
      x = shortcut + x[:, :h, :w, :]
      return x + MlpBlock()(nn.LayerNorm()(x))
  class PatchMerging(nn.Module):
    pad_ceil: bool = False
    @nn.compact
    def __call__(self, x):
      _, h, w, c = x.shape
      pc = self.pad_ceil
      x = jnp.pad(x, ((0, 0), (0, pad_amount(h, 2, pc)), (0, pad_amount(w, 2, pc)), (0, 0)))
      x0, x1 = x[:, 0::2, 0::2], x[:, 1::2, 0::2]
      x2, x3 = x[:, 0::2, 1::2], x[:, 1::2, 1::2]
      x = nn.LayerNorm()(jnp.concatenate([x0, x1, x2, x3], -1))
      return nn.Dense(2 * c, use_bias=False)(x)
  class Swin(nn.Module):
    patch: int = 2
    dim: int = 16
    num_classes: int = NUM_CLASSES
    pad_ceil: bool = False
    @nn.compact
    def __call__(self, x):
      _, h, w, _ = x.shape
      p, pc = self.patch, self.pad_ceil
      x = jnp.pad(x, ((0, 0), (0, pad_amount(h, p, pc)), (0, pad_amount(w, p, pc)), (0, 0)))
      x = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID")(x)
      x = nn.LayerNorm()(x)
      x = SwinBlock(self.dim, pad_ceil=pc)(x)
      x = SwinBlock(self.dim, shift=2, pad_ceil=pc)(x)
      x = PatchMerging(pad_ceil=pc)(x)
      x = SwinBlock(2 * self.dim, pad_ceil=pc)(x)
      x = nn.LayerNorm()(x).mean((1, 2))
      return nn.Dense(self.num_classes)(x)
  return {"resnet": ResNet, "vit": ViT, "vit_patchify": ViTPatchify, "unet": UNet,
          "unet_resize": UNetResize, "convnext": ConvNeXt, "mobilenetv2": MobileNetV2,
          "efficientnet": EfficientNet, "fcn": FCN, "swin": Swin,
          # workarounds of the three fallbacks: the padding written as JAX can divide it, and
          # the ViT's sizes bounded below by a constraint
          "unet_ceilpad": functools.partial(UNet, pad_ceil=True),
          "swin_ceilpad": functools.partial(Swin, pad_ceil=True), "vit_h>=4": ViT}
