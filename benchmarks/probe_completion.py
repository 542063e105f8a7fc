"""How fast a GPU request's result reaches the host once its last kernel is done: JAX's own
paths against the result copied by the CUDA driver on a stream of ours that waits for it
(``__dlpack__(stream=...)``: the public way to make a stream wait for an array).

  python benchmarks/probe_completion.py [--out DIR] [--t 256] [--models none,grouped]

Issue 19's e2e MoE encoder (``bench_moe_gmm.build_flax_model``) under ``jax.jit`` with its
inputs on the device, batch 8 at length t; the result is (8, d) float32.  Rows, median us of
``--n`` calls taking turns (the order turned each round): ``block`` ``block_until_ready``
(PJRT's completion alone); ``asarray`` ``np.asarray`` of the device result (PJRT's copy);
``dlpack_copy`` ``__dlpack__(stream=s)`` (s waits for the result on the device), the
driver's async copy of the data pointer into a pinned numpy buffer on s, then
``cuStreamSynchronize(s)``; ``ctx_sync_asarray`` ``cuCtxSynchronize`` then ``np.asarray``;
``dynjax`` the e2e's ``dynjax.flax.jit`` call (numpy in and out).  ``dlpack_copy`` is checked
bitwise against ``np.asarray`` of the same call on every call of a first pass.
Writes DIR/probe_completion.json.  GPU only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402
from benchmarks.probe_moe_call import encoder_case, take_turns  # noqa: E402
from dynjax.jit import _cuda  # noqa: E402

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Reader:
  """The driver's copy of a device array into a pinned numpy buffer, on a stream of ours."""

  def __init__(self, like):
    self.drv = _cuda.driver()
    lib = self.drv.lib
    lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                         ctypes.c_void_p]
    ptr = like.unsafe_buffer_pointer()
    self.ctx = self.drv.context_of(ptr)
    self.drv.check(lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
    s = ctypes.c_void_p()
    self.drv.check(lib.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")
    self.stream = s.value
    self.host = self.drv.host_buffer(like.shape, like.dtype, self.ctx)

  def read(self, arr) -> np.ndarray:
    lib = self.drv.lib
    cap = arr.__dlpack__(stream=self.stream)  # the stream waits for arr on the device
    data = ctypes.c_void_p.from_address(_get_pointer(cap, b"dltensor")).value
    self.drv.check(lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
    self.drv.check(lib.cuMemcpyDtoHAsync_v2(self.host.ctypes.data, data, self.host.nbytes,
                                            self.stream), "cuMemcpyDtoHAsync")
    self.drv.check(lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
    del cap  # the capsule's reference to arr's buffer, held until the copy landed
    return self.host


def one_model(name: str, cfg: dict, t: int, args) -> dict:
  tok, lens, dt, dl, variables, v16, jf, fn = encoder_case(name, cfg, t, args.seed)
  reader = Reader(jf(v16, dt, dl))
  ctx_sync = reader.drv.lib.cuCtxSynchronize

  def ctx_sync_asarray():
    out = jf(v16, dt, dl)
    ctx_sync()
    return np.asarray(out)

  calls = {"block": lambda: jax.block_until_ready(jf(v16, dt, dl)),
           "asarray": lambda: np.asarray(jf(v16, dt, dl)),
           "dlpack_copy": lambda: reader.read(jf(v16, dt, dl)),
           "ctx_sync_asarray": ctx_sync_asarray,
           "dynjax": lambda: np.asarray(fn(variables, tok, lens))}
  mismatches = 0
  for i in range(50):  # warm, and the driver's copy against JAX's of the same result
    out = jf(v16, dt, dl if i % 2 else jnp.maximum(dl - 1, 1))
    got = reader.read(out).copy()
    mismatches += not np.array_equal(got, np.asarray(out))
    for c in calls.values():
      c()
  ts = take_turns(calls, args.n, args.rounds)
  res = {"median_us": {row: float(np.median(v) * 1e6) for row, v in ts.items()},
         "p10_us": {row: float(np.percentile(v, 10) * 1e6) for row, v in ts.items()},
         "dlpack_copy_mismatches": mismatches}
  line = "  ".join(f"{row} {us:7.1f}" for row, us in res["median_us"].items())
  print(f"  {name:8s} t={t:4d}  {line}  (us; mismatches {mismatches} of 50)", flush=True)
  return res


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--t", default="256")
  ap.add_argument("--models", default="none,grouped")
  ap.add_argument("--n", type=int, default=600)
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  cfg = dict(vocab=30522, d=1024, heads=16, ffn=4096, experts=8, k=2, max_len=512, batch=8)
  dev = jax.devices()[0]
  report = {"device": dev.device_kind, "jax": jax.__version__, "results": {}}
  print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
  for t in (int(x) for x in args.t.split(",")):
    for name in args.models.split(","):
      report["results"].setdefault(str(t), {})[name] = one_model(name, cfg, t, args)
      write_json(args.out, "probe_completion.json", report)
  return report


if __name__ == "__main__":
  main()
