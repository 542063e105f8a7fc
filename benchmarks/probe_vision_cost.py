"""Where a request's time goes when dynjax serves images of many sizes (README "What images
of many sizes cost": 1.9x ``jax.jit``'s exact shapes per request on the H100).

  python benchmarks/probe_vision_cost.py --out $OUT [--sizes 4] [--calls 15] [--small]

``bench_vision.py``'s ResNet (flax's imagenet ResNet-18, batch 8, fp32) at a few image sizes,
each timed in one process, rounds taking turns, median ms of ``--calls`` calls that each
wait for their answer:

* ``exact_dev`` / ``exact_np``: ``jax.jit`` at the exact shape, the image already on the
  device / as numpy;
* ``bucket_dev`` / ``bucket_np``: ``jax.jit`` at dynjax's bucket on an image zero-padded
  beforehand (device compute at the bucket; numpy: the bucket's bytes uploaded, no host pad);
* ``dynjax_np``: ``dynjax.jit`` with a numpy image (host pad into a reused buffer, upload);
* ``aot_bucket_np`` / ``aot_bucket_put``: the bucket's ``jax.jit(...).lower().compile()``
  executable (what dynjax calls) on the padded numpy image / after ``jax.device_put`` of it;
  ``put_bucket`` / ``put_exact``: the upload alone of the padded / exact image;
* ``dynjax_put``: ``dynjax.jit`` on ``jax.device_put`` of the exact numpy image (upload, then
  the device pad);
* ``dynjax_dev``: the image on the device at its exact shape (a pad program on the device,
  once its site has paid for one);
* ``dynjax_padded``: a ``dynjax.Padded`` already at the bucket's shape (the padded program
  alone: masks, shifts);
* ``host_pad``: numpy alone, zeroing and filling a reused bucket buffer (dynjax_np's host
  part for a size change before session 27; ``padding="auto"`` no longer zeroes);
* ``torch_dev`` / ``torch_np``: PyTorch eager, when torch and a GPU are there.

Writes ``probe_vision_cost.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import median_ms, write_json  # noqa: E402
from benchmarks.bench_vision import B, _flax_resnet, _torch_resnet  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sizes", default="200x200,224x296,264x264,296x528",
                  help="comma-separated HxW")
  ap.add_argument("--step", type=int, default=64, help="dynjax's linear bucket step")
  ap.add_argument("--calls", type=int, default=15)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--depth", type=int, default=18, choices=(10, 18))
  ap.add_argument("--width", type=int, default=64)
  ap.add_argument("--small", action="store_true", help="CPU smoke: depth 10, width 8")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.small:
    args.depth, args.width, args.sizes, args.step, args.calls, args.rounds = (
        10, 8, "24x40,36x36", 16, 3, 1)
  import jax
  import jax.numpy as jnp
  import numpy as np

  import dynjax

  sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
  stages = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2)}[args.depth]
  rng = np.random.default_rng(0)
  model = _flax_resnet(stages, args.width)
  v = model.init(jax.random.key(0), jnp.ones((1, 64, 64, 3)))
  v = jax.tree.map(lambda a: a + 0.05 * jnp.asarray(rng.normal(size=a.shape), a.dtype), v)
  dv = jax.device_put(v)

  def apply(variables, x):
    return model.apply(variables, x, train=False)

  hi = max(max(s) for s in sizes)
  step = dynjax.buckets.linear(args.step, min=args.step, max=-(-hi // args.step) * args.step)
  f = dynjax.jit(apply, dims={"x": "b, h, w, 3"}, buckets={"h": step, "w": step})
  exact, at_bucket = jax.jit(apply), jax.jit(apply)
  cases = {}
  for s in sizes:
    x = rng.normal(size=(B, *s, 3)).astype(np.float32)
    bk = tuple(step.bucket(n) for n in s)
    buf = np.zeros((B, *bk, 3), np.float32)
    buf[:, :s[0], :s[1]] = x
    cases[s] = dict(x=x, xd=jax.device_put(x), bk=bk, buf=buf, bufd=jax.device_put(buf),
                    pool=np.zeros_like(buf), aot=at_bucket.lower(dv, buf).compile())
  torch_net = None
  if not args.small:
    try:
      import torch

      if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch_net = _torch_resnet(stages, args.width).cuda().eval()
    except ImportError:
      pass

  def modes(c):
    x, xd, buf, bufd = c["x"], c["xd"], c["buf"], c["bufd"]
    padded = dynjax.Padded(bufd, x.shape)
    pool, s = c["pool"], x.shape

    def host_pad():
      pool[:, :s[1], :s[2]] = 0  # the previous call's prefix, then the new one
      pool[:, :s[1], :s[2]] = x

    out = {
        "exact_dev": lambda: exact(dv, xd).block_until_ready(),
        "exact_np": lambda: np.asarray(exact(dv, x)),
        "bucket_dev": lambda: at_bucket(dv, bufd).block_until_ready(),
        "bucket_np": lambda: np.asarray(at_bucket(dv, buf)),
        "aot_bucket_np": lambda: np.asarray(c["aot"](dv, buf)),
        "aot_bucket_put": lambda: np.asarray(c["aot"](dv, jax.device_put(buf))),
        "put_bucket": lambda: jax.device_put(buf).block_until_ready(),
        "put_exact": lambda: jax.device_put(x).block_until_ready(),
        "dynjax_np": lambda: np.asarray(f(dv, x)),
        "dynjax_put": lambda: np.asarray(f(dv, jax.device_put(x))),
        "dynjax_dev": lambda: jax.block_until_ready(f(dv, xd)),
        "dynjax_padded": lambda: jax.block_until_ready(f(dv, padded)),
        "host_pad": host_pad,
    }
    if torch_net is not None:
      import torch

      xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
      xtd = xt.cuda()

      def tdev():
        with torch.no_grad():
          torch_net(xtd)
        torch.cuda.synchronize()

      def tnp():
        with torch.no_grad():
          torch_net(torch.from_numpy(x).permute(0, 3, 1, 2).cuda()).cpu()

      out.update(torch_dev=tdev, torch_np=tnp)
    return out

  t0 = time.perf_counter()
  for c in cases.values():  # a server's first call (numpy: the outputs' placement follows it)
    f(dv, c["x"])
  for c in cases.values():  # compiles, device pad sites paid for, cuDNN picks
    for _ in range(40):
      f(dv, c["xd"])
    for fn in modes(c).values():
      fn(), fn()
  warm_s = time.perf_counter() - t0
  res = {f"{h}x{w}": {} for h, w in sizes}
  for _ in range(args.rounds):
    for s, c in cases.items():
      for name, fn in modes(c).items():
        res[f"{s[0]}x{s[1]}"].setdefault(name, []).append(median_ms(fn, args.calls))
  table = {k: {m: min(ts) for m, ts in r.items()} for k, r in res.items()}
  st = f.stats()
  out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "backend": jax.default_backend(), "depth": args.depth, "width": args.width,
         "batch": B, "calls": args.calls, "rounds": args.rounds, "warm_s": warm_s,
         "buckets": {f"{h}x{w}": list(cases[(h, w)]["bk"]) for h, w in sizes},
         "ms_best_of_rounds": table, "ms_rounds": res,
         "dynjax": {k: st[k] for k in ("compiles", "exact_calls", "device_pads")
                    if k in st}}
  if torch_net is not None:
    import torch

    out["torch"] = torch.__version__
  names = list(next(iter(table.values())))
  print("size      bucket     " + " ".join(f"{n:>13s}" for n in names))
  for k, r in table.items():
    h, w = (int(v) for v in k.split("x"))
    print(f"{k:9s} {'x'.join(map(str, cases[(h, w)]['bk'])):10s} "
          + " ".join(f"{r[n]:13.3f}" for n in names))
  write_json(args.out, "probe_vision_cost.json", out)
  return out


if __name__ == "__main__":
  main()
