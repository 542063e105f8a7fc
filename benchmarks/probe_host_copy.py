"""How fast the host copies a request into its padded buffer, one thread or several.

  python benchmarks/probe_host_copy.py --out $OUT

A padded numpy input costs one host copy into its (reused) buffer.  numpy releases the GIL
while it copies, so the copy can be split along the first axis over a few threads.  Per
input size and thread count: median ms of ``--calls`` copies (cold source data each call) into
a numpy buffer and, where the backend has ``pinned_host`` memory, into a pinned one written
through a numpy view (``dynjax.jit``'s buffers on a GPU).  Writes ``probe_host_copy.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import median_ms, write_json  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--calls", type=int, default=21)
  ap.add_argument("--threads", default="1,2,4,8")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax
  import numpy as np

  dev = jax.devices()[0]
  pool = concurrent.futures.ThreadPoolExecutor(16)
  threads = [int(t) for t in args.threads.split(",")]
  out = {"jax": jax.__version__, "device": dev.device_kind, "cpus": os.cpu_count(),
         "calls": args.calls, "cases": {}}
  rng = np.random.default_rng(0)
  for shape, padded in (((8, 200, 200, 3), (8, 256, 256, 3)),
                        ((8, 296, 528, 3), (8, 320, 576, 3)),
                        ((8, 600, 800, 3), (8, 640, 832, 3))):
    xs = [rng.normal(size=shape).astype(np.float32) for _ in range(4)]
    prefix = tuple(slice(0, n) for n in shape)
    bufs = {"numpy": np.zeros(padded, np.float32)}
    try:
      src = jax.device_put(np.zeros(padded, np.float32), jax.sharding.SingleDeviceSharding(
          dev, memory_kind="pinned_host"))
      src.block_until_ready()
      raw = (ctypes.c_char * src.nbytes).from_address(src.unsafe_buffer_pointer())
      bufs["pinned"] = np.frombuffer(raw, np.float32).reshape(padded)
    except Exception as e:  # noqa: BLE001
      out["pinned_error"] = f"{type(e).__name__}: {e}"
    rec = {"mb": xs[0].nbytes / 2**20}
    for kind, buf in bufs.items():
      for k in threads:
        it = iter(range(10**9))
        step = -(-shape[0] // k)

        def copy(buf=buf, k=k, it=it, step=step, xs=xs, prefix=prefix):
          x = xs[next(it) % 4]
          if k == 1:
            buf[prefix] = x
            return
          futs = [pool.submit(buf.__setitem__, (slice(i, i + step), *prefix[1:]), x[i:i + step])
                  for i in range(0, len(x), step)]
          for f in futs:
            f.result()

        copy(), copy()
        rec[f"{kind}_{k}"] = median_ms(copy, args.calls)
    out["cases"]["x".join(map(str, shape))] = rec
    print(f"{'x'.join(map(str, shape)):14s} {rec['mb']:6.1f} MB  " + "  ".join(
        f"{k} {v:6.3f}" for k, v in rec.items() if k != "mb"), flush=True)
  write_json(args.out, "probe_host_copy.json", out)
  return out


if __name__ == "__main__":
  main()
