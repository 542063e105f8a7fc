"""What a numpy request's transfers cost on the device: one or several host-to-device puts,
the device-to-host copy of the result, and a small executable's call with numpy vs device vs
packed (one buffer) inputs.  Medians of 300 calls, microseconds.

  python benchmarks/probe_transfers.py [--out DIR] [--t 128]

Rows: ``put1`` one (8, t) int32 put + block; ``put2`` two puts (tokens, lengths) + block;
``put_list`` ``jax.device_put([tok, lens])``; ``put_packed`` the two concatenated into one int32
vector, one put; ``get`` ``np.asarray`` of a ready (8, 1024) float32 result; ``sync`` a ready
executable's call + block with device inputs; ``call_numpy`` / ``call_device`` /
``call_packed`` the same executable (embedding-sized gather + reduction) fed numpy, pre-put,
or one packed numpy buffer it slices itself, each with ``np.asarray`` of the result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402


def med(fn, n=300) -> float:
  for _ in range(10):
    fn()
  xs = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    xs.append(time.perf_counter() - t0)
  return float(np.median(xs)) * 1e6


def embed_sum(emb, tok, lens):
  """The probes' small call: an embedding gather over (b, t) tokens, masked by the lengths,
  summed over t."""
  x = emb[tok]
  m = (jnp.arange(tok.shape[1])[None] < lens[:, None]).astype(x.dtype)
  return (x * m[..., None]).sum(1)


def packed_embed_sum(b: int, t: int):
  """:func:`embed_sum` taking its tokens and lengths as one int32 vector (b*t, then b)."""
  def f_packed(emb, buf):
    return embed_sum(emb, buf[:b * t].reshape(b, t), buf[b * t:])
  return f_packed


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--t", type=int, default=128)
  args = ap.parse_args(argv)
  b, t, d = 8, args.t, 1024
  rng = np.random.default_rng(0)
  tok = rng.integers(1, 30000, (b, t)).astype(np.int32)
  lens = np.full(b, t, np.int32)
  emb = jax.device_put(rng.standard_normal((30522, d)).astype(np.float32))

  f, f_packed = embed_sum, packed_embed_sum(b, t)
  exe = jax.jit(f).lower(emb, tok, lens).compile()
  exe_p = jax.jit(f_packed).lower(emb, np.zeros(b * t + b, np.int32)).compile()
  dtok, dlens = jax.device_put(tok), jax.device_put(lens)
  y = exe(emb, dtok, dlens).block_until_ready()
  res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "t": t}
  res["put1"] = med(lambda: jax.device_put(tok).block_until_ready())
  res["put2"] = med(lambda: jax.block_until_ready((jax.device_put(tok), jax.device_put(lens))))
  res["put_list"] = med(lambda: jax.block_until_ready(jax.device_put([tok, lens])))
  res["put_packed"] = med(lambda: jax.device_put(
      np.concatenate([tok.ravel(), lens])).block_until_ready())

  def get():
    z = y + 0  # a fresh, ready array each time (its host copy is not cached)
    z.block_until_ready()
    t0 = time.perf_counter()
    np.asarray(z)
    return time.perf_counter() - t0
  for _ in range(10):
    get()
  res["get"] = float(np.median([get() for _ in range(300)])) * 1e6
  res["sync"] = med(lambda: exe(emb, dtok, dlens).block_until_ready())
  res["call_numpy"] = med(lambda: np.asarray(exe(emb, tok, lens)))
  res["call_device"] = med(lambda: np.asarray(exe(emb, dtok, dlens)))
  res["call_put_list"] = med(lambda: np.asarray(exe(emb, *jax.device_put([tok, lens]))))
  res["call_packed"] = med(lambda: np.asarray(exe_p(emb, np.concatenate([tok.ravel(), lens]))))
  # the device-to-host copy of the result: started at once, or into pinned host memory by the
  # executable itself (an output with memory kind pinned_host), or through device_get
  def async_copy():
    z = exe(emb, dtok, dlens)
    z.copy_to_host_async()
    return np.asarray(z)
  res["call_async_copy"] = med(async_copy)
  res["call_device_get"] = med(lambda: jax.device_get(exe(emb, dtok, dlens)))
  dev = jax.devices()[0]
  try:
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    exe_pin = jax.jit(f, out_shardings=pinned).lower(emb, tok, lens).compile()
    zp = exe_pin(emb, dtok, dlens)
    res["pinned_out_kind"] = str(zp.sharding.memory_kind)
    res["call_pinned_out"] = med(lambda: np.asarray(exe_pin(emb, dtok, dlens)))
    res["call_pinned_out_numpy_in"] = med(lambda: np.asarray(exe_pin(emb, tok, lens)))
    res["pinned_out_err"] = float(np.abs(np.asarray(zp) - np.asarray(y)).max())
    # the bucket executable unchanged, its output moved by device_put / by a copy executable
    res["call_put_pinned"] = med(lambda: np.asarray(jax.device_put(exe(emb, dtok, dlens),
                                                                   pinned)))
    to_pinned = jax.jit(lambda x: x, out_shardings=pinned).lower(y).compile()
    res["call_copy_exe"] = med(lambda: np.asarray(to_pinned(exe(emb, dtok, dlens))))
    res["call_copy_exe_numpy_in"] = med(lambda: np.asarray(to_pinned(exe(emb, tok, lens))))
    res["put_pinned"] = med(lambda: jax.device_put(tok, pinned).block_until_ready())
    on_dev = jax.sharding.SingleDeviceSharding(dev)

    def f_io(emb, tok, lens):
      return f(emb, jax.device_put(tok, on_dev), jax.device_put(lens, on_dev))
    exe_io = jax.jit(f_io, in_shardings=(on_dev, pinned, pinned), out_shardings=pinned).lower(
        emb, tok, lens).compile()
    # numpy inputs put into pinned host memory first (a host memcpy), moved by the executable
    res["call_pinned_inout"] = med(lambda: np.asarray(exe_io(
        emb, jax.device_put(tok, pinned), jax.device_put(lens, pinned))))
    res["pinned_inout_err"] = float(np.abs(np.asarray(exe_io(
        emb, jax.device_put(tok, pinned), jax.device_put(lens, pinned))) - np.asarray(y)).max())
    res["put_pinned_noblock"] = med(lambda: jax.device_put(tok, pinned))
    res["put2_pinned_list"] = med(lambda: jax.device_put([tok, lens], pinned))
    res["call_pinned_inout_list"] = med(lambda: np.asarray(exe_io(
        emb, *jax.device_put([tok, lens], pinned))))
  except Exception as e:  # noqa: BLE001 - a row of the report
    res["pinned_out_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  try:
    import torch

    if torch.cuda.is_available():
      xt = torch.randn(b, d, device="cuda")
      torch.cuda.synchronize()
      res["torch_get"] = med(lambda: xt.cpu().numpy())
      res["torch_put"] = med(lambda: (torch.from_numpy(tok).cuda(), torch.cuda.synchronize()))
      embt = torch.from_numpy(np.asarray(emb)).cuda()
      res["torch_call_numpy"] = med(lambda: embt[torch.from_numpy(tok).cuda()].sum(1).cpu()
                                    .numpy())
      res["torch"] = torch.__version__
  except Exception as e:  # noqa: BLE001
    res["torch_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  tiny = jax.jit(lambda x: x + 1).lower(jnp.zeros(8)).compile()
  z8 = jnp.zeros(8)
  res["tiny_sync"] = med(lambda: tiny(z8).block_until_ready())
  res["tiny_numpy"] = med(lambda: np.asarray(tiny(np.zeros(8, np.float32))))
  for k, v in res.items():
    print(f"  {k:14s} {v:10.1f}" if isinstance(v, float) else f"  {k:14s} {v}", flush=True)
  write_json(args.out, f"probe_transfers_t{t}.json", res)
  return res


if __name__ == "__main__":
  main()
