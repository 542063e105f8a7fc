"""Padded numpy inputs written into pinned host memory, against numpy buffers (GPU).

  python benchmarks/probe_pinned_inputs.py --out $OUT

A host request's input that needs padding is copied into a padded host buffer, which the
call uploads.  From a numpy buffer the runtime first copies it again, into its own pinned
staging memory, then transfers it; written straight into a pinned host buffer (a
``pinned_host`` jax array, written through a numpy view of its memory) it is transferred at
once.  Per input size, median ms of ``--calls`` calls (best of ``--rounds`` rounds taking
turns), each on other (cold) data, waiting for the answer:

* ``numpy``: the padded input written into a reused numpy buffer, then the call;
* ``pinned_put``: written into a reused pinned host buffer, ``jax.device_put`` of it to the
  device, then the call;
* ``pinned_in``: written into the pinned buffer, an executable that takes it in pinned host
  memory (``in_shardings``) and moves it to the device itself;
* ``exact``: the exact numpy input, no padding (``jax.jit`` at the exact shape).

The function is a sum (the transfer is the cost), and flax's ResNet-18 for images of two
sizes.  Writes ``probe_pinned_inputs.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import median_ms, write_json  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--calls", type=int, default=15)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--small", action="store_true", help="CPU smoke")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  dev = jax.devices()[0]
  pin = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  dsh = jax.sharding.SingleDeviceSharding(dev)
  rng = np.random.default_rng(0)
  cases = []  # (name, fn(params, x), params, exact shape, padded shape)
  for rows in ((40, 200, 3000) if args.small else (40, 200, 1000, 3000, 10000)):
    cases.append((f"sum_{rows}x1000", lambda p, x: x.sum(axis=1) * p, jnp.float32(2.0),
                  (rows - rows // 7, 1000), (rows, 1000)))
  if not args.small:
    from benchmarks.bench_vision import B, _flax_resnet

    model = _flax_resnet((2, 2, 2, 2), 64)
    v = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 64, 64, 3))))
    for (h, w), (bh, bw) in (((200, 200), (256, 256)), ((296, 528), (320, 576))):
      cases.append((f"resnet18_{h}x{w}", lambda p, x: model.apply(p, x, train=False), v,
                    (B, h, w, 3), (B, bh, bw, 3)))
  out = {"jax": jax.__version__, "device": dev.device_kind, "backend": jax.default_backend(),
         "calls": args.calls, "rounds": args.rounds, "cases": {}}
  for name, fn, p, shape, padded in cases:
    xs = [rng.normal(size=shape).astype(np.float32) for _ in range(4)]
    prefix = tuple(slice(0, n) for n in shape)
    buf = np.zeros(padded, np.float32)
    exe = jax.jit(fn).lower(p, buf).compile()
    exact = jax.jit(fn)
    pinned = jax.device_put(np.zeros(padded, np.float32), pin)
    n = int(np.prod(padded))
    view = np.ctypeslib.as_array((ctypes.c_float * n).from_address(
        pinned.unsafe_buffer_pointer())).reshape(padded)
    pin_in = jax.jit(lambda p, x, fn=fn: fn(p, jax.device_put(x, dsh)),
                     in_shardings=(dsh, pin)).lower(p, pinned).compile()
    it = iter(range(10**9))

    def nxt(xs=xs, it=it):
      return xs[next(it) % 4]

    def m_numpy(buf=buf, exe=exe, p=p, prefix=prefix, nxt=nxt):
      buf[prefix] = nxt()
      return np.asarray(exe(p, buf))

    def m_put(view=view, exe=exe, p=p, prefix=prefix, nxt=nxt, pinned=pinned):
      view[prefix] = nxt()
      return np.asarray(exe(p, jax.device_put(pinned, dsh)))

    def m_in(view=view, pin_in=pin_in, p=p, prefix=prefix, nxt=nxt, pinned=pinned):
      view[prefix] = nxt()
      return np.asarray(pin_in(p, pinned))

    def m_exact(exact=exact, p=p, nxt=nxt):
      return np.asarray(exact(p, nxt()))

    modes = {"numpy": m_numpy, "pinned_put": m_put, "pinned_in": m_in, "exact": m_exact}
    for fnm in modes.values():
      fnm(), fnm()
    view[prefix] = xs[0]
    buf[prefix] = xs[0]
    same = bool(np.array_equal(np.asarray(exe(p, jax.device_put(pinned, dsh))),
                               np.asarray(exe(p, buf))))
    res = {}
    for _ in range(args.rounds):
      for k, fnm in modes.items():
        res.setdefault(k, []).append(median_ms(fnm, args.calls))
    rec = {k: min(t) for k, t in res.items()}
    rec.update(mb=buf.nbytes / 2**20, same_result=same)
    out["cases"][name] = rec
    print(f"{name:22s} {rec['mb']:7.2f} MB  " + "  ".join(
        f"{k} {rec[k]:7.3f}" for k in modes) + f"  same {same}", flush=True)
  write_json(args.out, "probe_pinned_inputs.json", out)
  return out


if __name__ == "__main__":
  main()
