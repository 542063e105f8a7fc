"""A fused (flash) attention forward in Pallas for ``attention="pallas"``, float32 included.

cuDNN's fused attention takes float16/bfloat16 only; in float32 XLA materialises the
``[B, N, T, S]`` logits, and above 256 tokens that is where a BERT-base call spends its time.
H100, jax 0.11.2 (``benchmarks/probe_attention.py``): the masked attention block alone at
T=448, fp32, batch 8, 12 heads of 64: XLA 0.33 ms, PyTorch SDPA 0.25 ms, 12 of them in a
6.1 ms model call.

The kernel (after JAX's ``jax.experimental.pallas.ops.gpu.attention``, forward only): one
program per (query block, batch row, head); it keeps its query block on chip and walks the
key blocks with the online softmax (FlashAttention-2), never writing the logits.  Keys are
excluded by a per-row valid vector (the padding pass's true key length, and a key-only user
mask): a user-masked key scores the large negative ``MASK_VALUE`` (as the traced
``where(mask, s, finfo.min)``: a row whose every real key is masked averages over the real
keys), a key past the true length scores ``-inf`` (it does not exist unpadded).  The loop
stops at the last block holding a real key.  Dots run at the ambient matmul precision (TF32
for float32 under JAX's default, as XLA's and PyTorch's ``"high"``).

Backward: :func:`reference` (the same attention with the logits materialised, through XLA)
under ``jax.custom_vjp``: gradients are exact, not fused.

Shapes: q, k, v ``[B, T, N, H]`` (one dtype; ``H`` a power of two, else the caller keeps XLA);
``T``/``S`` are padded here to the block sizes (the padded queries are sliced off, the padded
keys are invalid).  Off GPU the kernel runs in Pallas' interpret mode (tests only: slow).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# ``jax.experimental.pallas`` is imported where a kernel is built, not here: it added ~30 ms to
# ``import dynjax`` (2-core box), which every process pays and few use.

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Default blocks (query rows x key rows).  H100, fp32 and bf16 at T=256 and 448: 128x64 was
# the fastest of 64x64, 128x64, 64x32, 32x32 in 3 of 4 (benchmarks/results/probe_flash_run1).
BLOCK_Q = 128
BLOCK_K = 64


def operand_refusal(dtype, head_dim: int) -> str | None:
  """Why the kernel cannot take operands of this dtype and head dim (None: it can); the
  attention matcher asks it too."""
  if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
    return f"{jnp.dtype(dtype)}: the kernel takes float32/float16/bfloat16"
  if head_dim < 16 or head_dim & (head_dim - 1):
    return f"head dim {head_dim} (the kernel takes powers of two >= 16)"
  return None


def supported(q, k, v) -> str | None:
  """Why the kernel cannot take these operands (None: it can)."""
  if not (q.dtype == k.dtype == v.dtype):
    return f"mixed dtypes {q.dtype}/{k.dtype}/{v.dtype}"
  if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
    return f"head dims {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} differ"
  if k.shape[2] != q.shape[2]:
    return "grouped heads"
  return operand_refusal(q.dtype, q.shape[-1])


def _kernel(q_ref, k_ref, v_ref, valid_ref, nblk_ref, o_ref, *, scale, block_k):
  from jax.experimental import pallas as pl  # noqa: PLC0415 - see the module's imports

  q = q_ref[...]
  bq, h = q.shape
  m0 = jnp.full((bq,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((bq,), jnp.float32)
  o0 = jnp.zeros((bq, h), jnp.float32)
  qk_scale = scale * math.log2(math.e)  # exp2 below

  def body(j, carry):
    o_prev, m_prev, l_prev = carry
    ks = pl.ds(j * block_k, block_k)
    k = k_ref[ks, :]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * qk_scale
    valid = valid_ref[ks]  # 1 real, 0 masked by the user, -1 past the true length
    s = jnp.where(valid[None, :] > 0, s, jnp.where(valid[None, :] == 0, MASK_VALUE, -jnp.inf))
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    corr = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = corr * l_prev + jnp.sum(p, axis=1)
    v = v_ref[ks, :]
    o_next = corr[:, None] * o_prev + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return o_next, m_next, l_next

  n = nblk_ref[0]
  o, _, denom = lax.fori_loop(0, n, body, (o0, m0, l0))
  o = o / jnp.where(denom == 0.0, 1.0, denom)[:, None]  # no real key at all: 0 (sizes of 0 run exact)
  o_ref[...] = o.astype(o_ref.dtype)


def _valid(b, s, s_pad, kv_len, key_mask):
  """[B, S_pad] int32: 1 a real key, 0 a real key the user masks, -1 no key (padding)."""
  pos = jnp.arange(s_pad)[None, :]
  limit = jnp.full((b, 1), s, jnp.int32) if kv_len is None else jnp.minimum(
      kv_len.astype(jnp.int32), s)[:, None]
  real = pos < limit
  keep = real
  if key_mask is not None:
    km = jnp.broadcast_to(key_mask, (b, s))
    keep = real & jnp.pad(km, ((0, 0), (0, s_pad - s)))
  return jnp.where(keep, 1, jnp.where(real, 0, -1)).astype(jnp.int32), limit


def _forward(q, k, v, kv_len, key_mask, scale, interpret, blocks):
  from jax.experimental import pallas as pl  # noqa: PLC0415 - see the module's imports

  b, t, n, h = q.shape
  s = k.shape[1]
  bq = min(blocks[0], pl.next_power_of_2(t))
  bk = min(blocks[1], pl.next_power_of_2(s))
  t_pad, s_pad = -(-t // bq) * bq, -(-s // bk) * bk
  if t_pad != t:
    q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
  if s_pad != s:
    k = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
  valid, limit = _valid(b, s, s_pad, kv_len, key_mask)
  nblk = ((limit + bk - 1) // bk).astype(jnp.int32)  # [B, 1]: blocks holding a real key
  kernel = functools.partial(_kernel, scale=scale, block_k=bk)
  kw = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415 - GPU only

    kw["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=2)
  out = pl.pallas_call(
      kernel,
      grid=(t_pad // bq, b, n),
      in_specs=[
          pl.BlockSpec((None, bq, None, h), lambda i, j, m: (j, i, m, 0)),
          pl.BlockSpec((None, s_pad, None, h), lambda i, j, m: (j, 0, m, 0)),
          pl.BlockSpec((None, s_pad, None, h), lambda i, j, m: (j, 0, m, 0)),
          pl.BlockSpec((None, s_pad), lambda i, j, m: (j, 0)),
          pl.BlockSpec((None, 1), lambda i, j, m: (j, 0)),
      ],
      out_specs=pl.BlockSpec((None, bq, None, h), lambda i, j, m: (j, i, m, 0)),
      out_shape=jax.ShapeDtypeStruct((b, t_pad, n, h), q.dtype),
      interpret=interpret,
      name="dynjax_flash_attention",
      **kw,
  )(q, k, v, valid, nblk)
  return out[:, :t]


def reference(q, k, v, kv_len, key_mask, scale):
  """The same attention through XLA, the logits materialised (what the backward
  differentiates): user-masked keys score ``finfo.min``, keys past ``kv_len`` ``-inf``."""
  b, s = q.shape[0], k.shape[1]
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
  if key_mask is not None:
    km = jnp.broadcast_to(key_mask, (b, s))[:, None, None, :]
    logits = jnp.where(km, logits, jnp.finfo(jnp.float32).min)
  if kv_len is not None:
    real = (jnp.arange(s)[None, :] < kv_len[:, None])[:, None, None, :]
    logits = jnp.where(real, logits, -jnp.inf)
  w = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", w.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attend(q, k, v, kv_len, key_mask, scale, interpret, blocks):
  return _forward(q, k, v, kv_len, key_mask, scale, interpret, blocks)


def _attend_fwd(q, k, v, kv_len, key_mask, scale, interpret, blocks):
  return (_forward(q, k, v, kv_len, key_mask, scale, interpret, blocks),
          (q, k, v, kv_len, key_mask))


def _attend_bwd(scale, interpret, blocks, res, g):
  q, k, v, kv_len, key_mask = res
  _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, kv_len, key_mask, scale), q, k, v)
  dq, dk, dv = vjp(g)
  zero = lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
  return dq, dk, dv, zero(kv_len), zero(key_mask)


_attend.defvjp(_attend_fwd, _attend_bwd)


def flash_attention(q, k, v, *, kv_len=None, key_mask=None, scale=None, interpret=None,
                    blocks=None):
  """Attention of ``q, k, v [B, T, N, H]`` over the keys ``s < kv_len[b]`` ([B] ints, or all),
  with a key-only boolean ``key_mask`` broadcastable to ``[B, S]`` (False: masked, as
  ``jnp.where(mask, logits, finfo.min)``); ``scale`` defaults to ``1/sqrt(H)``, ``blocks``
  (query rows, key rows; powers of two) to ``(BLOCK_Q, BLOCK_K)``.

  Example:
    >>> out = flash_attention(q, k, v, kv_len=jnp.array([5, 9]))   # [2, T, N, H]
  """
  why = supported(q, k, v)
  if why is not None:
    raise ValueError(f"flash_attention: unsupported operands: {why}")
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  blocks = (BLOCK_Q, BLOCK_K) if blocks is None else tuple(int(x) for x in blocks)
  return _attend_jit(q, k, v, kv_len, key_mask, scale=scale, interpret=bool(interpret),
                     blocks=blocks)


# One jit around the kernel: a model's layers call it with the same shapes, so JAX traces and
# lowers the Pallas kernel once per executable, not once per layer (Pallas' Triton lowering is
# Python and holds the GIL: 12 BERT-base layers lowered for cuda on the 2-core box took
# 0.18-0.23 s a bucket without it, 0.027 s with it; a start-up warmup takes that time from the
# server's own start-up code).
@functools.partial(jax.jit, static_argnames=("scale", "interpret", "blocks"))
def _attend_jit(q, k, v, kv_len, key_mask, *, scale, interpret, blocks):
  return _attend(q, k, v, kv_len, key_mask, scale, interpret, blocks)
