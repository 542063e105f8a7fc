"""What a small numpy request's inputs cost on a GPU, JAX's host-to-device path against a
synchronous driver copy from pinned host memory into device buffers kept per shape.

  python benchmarks/probe_direct_inputs.py [--out DIR] [--t 128,256]

The executable (``probe_transfers.py``'s embedding gather + masked sum; its ``med`` too) writes
its result into pinned host memory (dynjax's placement for host requests on a GPU).  Rows,
median us of ``--n`` calls, each call on other tokens (16 arrays in turn), ``np.asarray`` of
the result: ``numpy_in`` numpy tokens and lengths (JAX's per-argument put: dynjax's path
before session 32, and where the driver's copies cannot run);
``direct_in`` the two copied into pinned staging memory, then ``cuMemcpyHtoD`` into two kept
device arrays, then the call on them; ``async_pinned`` the same two copies queued on a stream,
one wait (``jit/_cuda.py``'s way); ``async_pageable`` those from the numpy arrays themselves; ``direct_packed`` one staging buffer and one copy into
one kept vector the executable slices; ``device_in`` inputs already on the device (the floor);
``torch_numpy`` torch's put + the same gather + get; ``dynjax_direct`` / ``dynjax_jax_put``
the call through ``dynjax.jit`` (its bucket at t) with the driver's copies (``jit/_cuda.py``)
on / off.  ``direct_exact`` (the three above) / ``dynjax_exact``: those results equal the numpy path's bitwise
over every token array (the copy is visible to the next executable); ``packed_max_diff``
(another executable).  Rounds alternate the order of the rows.  ``--sizes``: one float32
input of each size alone, JAX's transfer vs the driver's copy (where the copies stop paying).
``--bert N``: issue 18's BERT encoder served under ``dynjax.flax.jit``, the copies on and off,
taking turns per request (:func:`bert_ab`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import jax
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402
from benchmarks.probe_transfers import embed_sum, med, packed_embed_sum  # noqa: E402


class Driver:
  """The CUDA driver's primary context of device 0 (the one XLA runs in), through ctypes."""

  def __init__(self, ordinal: int = 0):
    self.lib = ctypes.CDLL("libcuda.so.1")
    self._check(self.lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    self.ctx = ctypes.c_void_p()
    self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "retain")
    self._check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
    self.lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    self.lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                        ctypes.c_uint]
    self.lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_void_p]
    self.lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    self.stream = ctypes.c_void_p()
    self._check(self.lib.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")

  @staticmethod
  def _check(rc, what):
    if rc != 0:
      raise RuntimeError(f"{what} failed: CUresult {rc}")

  def pinned(self, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    p = ctypes.c_void_p()
    self._check(self.lib.cuMemHostAlloc(ctypes.byref(p), max(n, 1), 0), "cuMemHostAlloc")
    buf = (ctypes.c_byte * n).from_address(p.value)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)

  def htod(self, dst: jax.Array, src: np.ndarray) -> None:
    ptr = dst.addressable_data(0).unsafe_buffer_pointer()
    self._check(self.lib.cuMemcpyHtoD_v2(ptr, src.ctypes.data, src.nbytes), "cuMemcpyHtoD")

  def htod_async(self, dst: jax.Array, src: np.ndarray) -> None:
    """On the probe's stream; pageable ``src`` is staged by the driver before this returns."""
    ptr = dst.addressable_data(0).unsafe_buffer_pointer()
    self._check(self.lib.cuMemcpyHtoDAsync_v2(ptr, src.ctypes.data, src.nbytes, self.stream),
                "cuMemcpyHtoDAsync")

  def sync(self) -> None:
    self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


def one_length(t: int, n: int, drv: Driver, emb, rounds: int) -> dict:
  b = 8
  rng = np.random.default_rng(t)
  toks = [rng.integers(1, emb.shape[0], (b, t)).astype(np.int32) for _ in range(16)]
  lens = [rng.integers(1, t + 1, b).astype(np.int32) for _ in range(16)]

  f, f_packed = embed_sum, packed_embed_sum(b, t)
  dev = jax.devices()[0]
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  exe = jax.jit(f, out_shardings=pinned).lower(emb, toks[0], lens[0]).compile()
  exe_p = jax.jit(f_packed, out_shardings=pinned).lower(
      emb, np.zeros(b * t + b, np.int32)).compile()
  kept_tok = jax.device_put(np.zeros((b, t), np.int32), dev)
  kept_len = jax.device_put(np.zeros(b, np.int32), dev)
  kept_buf = jax.device_put(np.zeros(b * t + b, np.int32), dev)
  jax.block_until_ready((kept_tok, kept_len, kept_buf))
  st_tok, st_len = drv.pinned((b, t), np.int32), drv.pinned((b,), np.int32)
  st_buf = drv.pinned((b * t + b,), np.int32)
  dtoks = [jax.device_put(x, dev) for x in toks]
  dlens = [jax.device_put(x, dev) for x in lens]
  i = [0]

  def nxt():
    i[0] = (i[0] + 1) % 16
    return i[0]

  def numpy_in():
    k = nxt()
    return np.asarray(exe(emb, toks[k], lens[k]))

  def direct_in():
    k = nxt()
    st_tok[...] = toks[k]
    st_len[...] = lens[k]
    drv.htod(kept_tok, st_tok)
    drv.htod(kept_len, st_len)
    return np.asarray(exe(emb, kept_tok, kept_len))

  def async_pinned():  # dynjax's way: both copies queued, one wait
    k = nxt()
    st_tok[...] = toks[k]
    st_len[...] = lens[k]
    drv.htod_async(kept_tok, st_tok)
    drv.htod_async(kept_len, st_len)
    drv.sync()
    return np.asarray(exe(emb, kept_tok, kept_len))

  def async_pageable():  # the same from the numpy arrays themselves (no pinned staging)
    k = nxt()
    drv.htod_async(kept_tok, toks[k])
    drv.htod_async(kept_len, lens[k])
    drv.sync()
    return np.asarray(exe(emb, kept_tok, kept_len))

  def direct_packed():
    k = nxt()
    st_buf[:b * t] = toks[k].ravel()
    st_buf[b * t:] = lens[k]
    drv.htod(kept_buf, st_buf)
    return np.asarray(exe_p(emb, kept_buf))

  def device_in():
    k = nxt()
    return np.asarray(exe(emb, dtoks[k], dlens[k]))

  rows = {"numpy_in": numpy_in, "direct_in": direct_in, "async_pinned": async_pinned,
          "async_pageable": async_pageable, "direct_packed": direct_packed,
          "device_in": device_in}
  # the same call through dynjax.jit (one bucket at t: no padding), the driver's copies on
  # (jit/_cuda.py) and off (JAX's transfer): two functions
  import dynjax
  from benchmarks.bench_moe_gmm import jax_put

  for name, on in (("dynjax_direct", True), ("dynjax_jax_put", False)):
    g = dynjax.jit(f, dims={"tok": "b, t", "lens": "b"}, buckets={"b": [b], "t": [t]},
                   padding="trust")
    g = g if on else jax_put(g)

    def call(g=g):
      k = nxt()
      return g(emb, toks[k], lens[k])

    rows[name] = call
  try:
    import torch

    if torch.cuda.is_available():
      embt = torch.from_numpy(np.asarray(emb)).cuda()
      tt = [torch.from_numpy(x.astype(np.int64)) for x in toks]

      def torch_numpy():
        k = nxt()
        return embt[tt[k].cuda()].sum(1).cpu().numpy()

      rows["torch_numpy"] = torch_numpy
  except ImportError:
    pass
  res = {name: [] for name in rows}
  names = list(rows)
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      res[name].append(med(rows[name], n))
  out = {name: float(np.median(v)) for name, v in res.items()}
  out["rounds"] = res
  exact, packed, dj = True, 0.0, True
  for k in range(16):  # every token array, in an order unlike the timed one
    got = {}
    for name in ("numpy_in", "direct_in", "async_pinned", "async_pageable", "direct_packed",
                 "dynjax_direct"):
      i[0] = k - 1
      got[name] = np.asarray(rows[name]())
    exact = exact and all(bool(np.array_equal(got[n], got["numpy_in"]))
                          for n in ("direct_in", "async_pinned", "async_pageable"))
    dj = dj and bool(np.array_equal(got["dynjax_direct"], got["numpy_in"]))
    # (another executable: its sum may round otherwise)
    packed = max(packed, float(np.abs(got["direct_packed"] - got["numpy_in"]).max()))
  out["direct_exact"], out["dynjax_exact"], out["packed_max_diff"] = exact, dj, packed
  return out


def one_size(nbytes: int, n: int, drv: Driver, rounds: int) -> dict:
  """A float32 (8, k) input of ``nbytes``: JAX's transfer vs the driver's copy (the sum over
  its rows, pinned host output)."""
  k = nbytes // 32
  xs = [np.random.default_rng(i).standard_normal((8, k)).astype(np.float32) for i in range(4)]
  dev = jax.devices()[0]
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  exe = jax.jit(lambda x: x.sum(1), out_shardings=pinned).lower(xs[0]).compile()
  kept = jax.device_put(np.zeros((8, k), np.float32), dev)
  st = drv.pinned((8, k), np.float32)
  i = [0]

  def numpy_in():
    i[0] = (i[0] + 1) % 4
    return np.asarray(exe(xs[i[0]]))

  def direct_in():
    i[0] = (i[0] + 1) % 4
    st[...] = xs[i[0]]
    drv.htod(kept, st)
    return np.asarray(exe(kept))

  res = {"numpy_in": [], "direct_in": []}
  for r in range(rounds):
    for name, fn in (((("numpy_in", numpy_in), ("direct_in", direct_in))) if r % 2 == 0 else
                     (("direct_in", direct_in), ("numpy_in", numpy_in))):
      res[name].append(med(fn, n))
  return {name: float(np.median(v)) for name, v in res.items()}


BINS = ((1, 64), (65, 128), (129, 256), (257, 512))


def bert_ab(n: int, size: str, rounds: int, ab: str = "inputs") -> dict:
  """Issue 18's model: the BERT encoder (``examples/models.py``) under ``dynjax.flax.jit``
  (pow2 buckets, blocking compiles) on ``n`` stdlib docstring requests of batch 8, two
  functions, every bucket built on both first, then ``rounds`` passes taking turns per
  request: mean / median ms and the mean per length bin.  ``ab="inputs"``: the driver's
  copies of the inputs on and off (``jax put``); ``"outputs"``: the results read by the driver
  from device outputs (``driver reads``, session 33) or pinned host outputs (``pinned``, the
  function planned with ``DYNJAX_DIRECT_OUTPUTS=0``)."""
  import dynjax
  import dynjax.flax
  from benchmarks.bench_moe_gmm import jax_put
  from dynjax import _config
  from examples import data, models

  cfg = models.ENCODER_SIZES[size]
  module = models.BertEncoder(cfg)
  variables = jax.device_put({"params": models.init_encoder_params(cfg, seed=0)})
  reqs = data.request_stream(n, batch=8, max_len=cfg.max_len, seed=0, vocab=cfg.vocab)
  fns = {}
  for name in ("direct", "jax put") if ab == "inputs" else ("driver reads", "pinned"):
    g = dynjax.flax.jit(module, dims={"tokens": "b, t", "lengths": "b"},
                        buckets={"t": dynjax.buckets.pow2(16, cfg.max_len)})
    fns[name] = jax_put(g) if name == "jax put" else g
  t0 = time.perf_counter()
  for r in reqs:  # every bucket built (and every request shape's call path) on both
    for name, g in fns.items():
      saved = _config.config.direct_outputs
      _config.config.direct_outputs = name != "pinned"  # (read as its family plans: 1st call)
      try:
        np.asarray(g(variables, r.tokens, r.lengths))
      finally:
        _config.config.direct_outputs = saved
  cold = time.perf_counter() - t0
  ts = {name: [] for name in fns}
  names = list(fns)
  for k in range(rounds):
    for i, r in enumerate(reqs):
      for name in (names if (i + k) % 2 == 0 else names[::-1]):
        t1 = time.perf_counter()
        np.asarray(fns[name](variables, r.tokens, r.lengths))
        ts[name].append(time.perf_counter() - t1)
  lengths = np.asarray([r.tokens.shape[1] for r in reqs] * rounds)
  first = next(iter(fns.values()))
  out = {"size": size, "requests": n, "rounds": rounds, "build_pass_s": cold, "ab": ab,
         "direct_failed": first.stats()["direct_inputs_failed"],
         "output_reads": {k: (g.stats()["direct_output_families"],
                              g.stats()["direct_outputs_failed"]) for k, g in fns.items()}}
  for name, v in ts.items():
    v = np.asarray(v) * 1e3
    out[name] = {"mean_ms": float(v.mean()), "median_ms": float(np.median(v)),
                 "bins_ms": {f"{lo}-{hi}": float(v[(lengths >= lo) & (lengths <= hi)].mean())
                             for lo, hi in BINS if ((lengths >= lo) & (lengths <= hi)).any()}}
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--t", default="128,256")
  ap.add_argument("--n", type=int, default=300)
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--bert", type=int, default=0, help="requests of the BERT A/B (0: none)")
  ap.add_argument("--bert-size", default="base")
  ap.add_argument("--bert-ab", default="inputs", choices=("inputs", "outputs"),
                  help="the BERT A/B: the driver's input copies on/off, or the results read "
                  "by the driver vs pinned host outputs")
  ap.add_argument("--sizes", default="65536,1048576,2097152,8388608",
                  help="bytes of a float32 input timed alone (numpy vs the driver's copy)")
  args = ap.parse_args(argv)
  ts = [int(x) for x in args.t.split(",") if x]
  sizes = [int(x) for x in args.sizes.split(",") if x]
  drv = Driver(0) if ts or sizes else None  # (the BERT A/B alone runs anywhere)
  emb = (jax.device_put(np.random.default_rng(0).standard_normal((30522, 1024)).astype(
      np.float32)) if ts else None)
  report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "lengths": {}}
  for t in ts:
    report["lengths"][t] = r = one_length(t, args.n, drv, emb, args.rounds)
    print(f"t={t}: " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()
                                 if isinstance(v, float)) + f"  exact {r['direct_exact']} "
          f"dynjax exact {r['dynjax_exact']}", flush=True)
  report["sizes"] = {}
  for nbytes in sizes:
    report["sizes"][nbytes] = r = one_size(nbytes, max(50, args.n // 3), drv, args.rounds)
    print(f"{nbytes} bytes: numpy_in {r['numpy_in']:.1f}  direct_in {r['direct_in']:.1f}",
          flush=True)
  if args.bert:
    report["bert"] = r = bert_ab(args.bert, args.bert_size, args.rounds, args.bert_ab)
    print(f"bert {args.bert_size}, {args.bert} requests x {args.rounds} (build pass "
          f"{r['build_pass_s']:.1f} s; direct failed: {r['direct_failed']}; reads "
          f"(families, failed): {r['output_reads']}):", flush=True)
    for name in [k for k in r if isinstance(r[k], dict) and "mean_ms" in r[k]]:
      print(f"  {name:8s} mean {r[name]['mean_ms']:.3f} ms  median {r[name]['median_ms']:.3f}  "
            + "  ".join(f"{k} {v:.3f}" for k, v in r[name]["bins_ms"].items()), flush=True)
  write_json(args.out, "probe_direct_inputs.json", report)
  return report


if __name__ == "__main__":
  main()
