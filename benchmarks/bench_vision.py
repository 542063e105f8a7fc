"""Images of many sizes through a ResNet: dynjax buckets against ``jax.jit`` per exact shape,
``jax.jit`` padded to the largest size by hand, and PyTorch eager.

  python benchmarks/bench_vision.py --out $OUT [--requests 24] [--depth 18] [--small]

The model is flax's ``examples/imagenet/models.py`` ResNet (``_vision_models.py``;
``ResNetBlock``, BatchNorm in inference, a 7x7 stride-2 stem, a SAME 3x3 max pool, global
mean, Dense), batch 8, images of one size within a request and sizes that vary between requests (photos resized to a shorter
side, as a detector's or classifier's server gets them). Under ``dynjax.jit`` the strided
blocks' residual adds need the shape identities dynjax infers (README "Shape identities").

Each mode takes the same requests (every size twice, shuffled) in its own pass:
* ``jit_exact``: ``jax.jit`` at each exact shape (one compile a size);
* ``dynjax``: ``dynjax.jit(..., buckets=linear(step))`` on h and w, exact by the padding pass;
* ``jit_bucket``: ``jax.jit`` of the zero-padded image at dynjax's bucket (what the bucket's
  compute costs without the padding pass's masks; its output is NOT the exact one);
* ``pad_max``: every image zero-padded to the largest size by hand, one compile (the usual
  workaround; inexact: the convs see the zeros and the mean counts them);
* ``torch_eager``: the same architecture in PyTorch (cuDNN, fp32 with TF32 as jax's default
  convs), when torch and a GPU are there.
Per mode: the first pass (compiles included), the second pass's mean ms a request, compiles,
and the largest error against ``jit_exact`` relative to the logits' scale. Writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402

B = 8
CLASSES = 10


def _flax_resnet(stage_sizes, width):
  """flax's ``examples/imagenet/models.py`` ResNet (``benchmarks/_vision_models.py``: the
  vision probe's copy); call it with ``train=False``."""
  from benchmarks._vision_models import models

  return models()["resnet"](stage_sizes=stage_sizes, num_filters=width, num_classes=CLASSES)


def _torch_resnet(stage_sizes, width):
  import torch
  from torch import nn

  class Block(nn.Module):
    def __init__(self, cin, cout, stride):
      super().__init__()
      self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
      self.b1 = nn.BatchNorm2d(cout)
      self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
      self.b2 = nn.BatchNorm2d(cout)
      self.proj = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                 nn.BatchNorm2d(cout)) if stride != 1 or cin != cout else None)

    def forward(self, x):
      y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
      return torch.relu(y + (x if self.proj is None else self.proj(x)))

  layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1)]
  cin = width
  for i, n in enumerate(stage_sizes):
    for j in range(n):
      cout = width * 2 ** i
      layers.append(Block(cin, cout, 2 if i > 0 and j == 0 else 1))
      cin = cout
  body = nn.Sequential(*layers)

  class Net(nn.Module):
    def __init__(self):
      super().__init__()
      self.body, self.fc = body, nn.Linear(cin, CLASSES)

    def forward(self, x):
      return self.fc(self.body(x).mean((2, 3)))

  return Net()


def _sizes(rng, n, lo, hi, step):
  """``n`` distinct (h, w): a shorter side in [lo, hi], an aspect of 3:4, 1:1, 4:3 or 16:9
  (landscape or portrait), rounded to ``step`` pixels as a resize leaves them."""
  out = set()
  while len(out) < n:
    short = int(rng.integers(lo, hi + 1))
    aspect = float(rng.choice([4 / 3, 1.0, 16 / 9]))
    long = min(int(short * aspect), hi * 16 // 9)
    hw = (short, long) if rng.random() < 0.5 else (long, short)
    out.add(tuple(max(step, step * round(v / step)) for v in hw))
  return sorted(out)


def _time_pass(fn, requests, sync, each=None):
  t0 = time.perf_counter()
  outs = []
  for x in requests:
    t1 = time.perf_counter()
    outs.append(fn(x))
    if each is not None:
      each.append(time.perf_counter() - t1)
  sync(outs)
  return time.perf_counter() - t0, outs


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--requests", type=int, default=12, help="distinct sizes (each twice)")
  ap.add_argument("--depth", type=int, default=18, choices=(10, 18, 34))
  ap.add_argument("--width", type=int, default=64)
  ap.add_argument("--lo", type=int, default=160)
  ap.add_argument("--hi", type=int, default=320)
  ap.add_argument("--round", type=int, default=8, help="sizes are multiples of this")
  ap.add_argument("--step", type=int, default=64, help="dynjax's linear bucket step")
  ap.add_argument("--modes", default="jit_exact,dynjax,jit_bucket,pad_max,torch_eager")
  ap.add_argument("--small", action="store_true", help="CPU smoke: depth 10, width 8, 3 sizes")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.small:
    args.depth, args.width, args.requests, args.lo, args.hi = 10, 8, 3, 24, 48
    args.step, args.round = 16, 1
  import jax
  import jax.numpy as jnp
  import numpy as np

  import dynjax

  stages = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}[args.depth]
  rng = np.random.default_rng(0)
  sizes = _sizes(rng, args.requests, args.lo, args.hi, args.round)
  order = [s for s in sizes for _ in range(2)]
  rng.shuffle(order)
  images = {s: rng.normal(size=(B, *s, 3)).astype(np.float32) for s in sizes}
  model = _flax_resnet(stages, args.width)
  v = model.init(jax.random.key(0), jnp.ones((1, 64, 64, 3)))
  # non-trivial batch statistics, as a trained model has
  v = jax.tree.map(lambda a: a + 0.05 * jnp.asarray(rng.normal(size=a.shape), a.dtype), v)

  def apply(variables, x):
    return model.apply(variables, x, train=False)

  step = dynjax.buckets.linear(args.step, min=args.step, max=-(-args.hi * 16 // 9 // args.step)
                               * args.step)
  bucket_of = {s: tuple(step.bucket(n) for n in s) for s in sizes}
  hmax = max(max(s) for s in sizes)
  out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "backend": jax.default_backend(), "depth": args.depth, "width": args.width,
         "batch": B, "sizes": [list(s) for s in sizes], "requests": len(order),
         "buckets": sorted(set(bucket_of.values())), "modes": {},
         "DYNJAX_PINNED_INPUTS": os.environ.get("DYNJAX_PINNED_INPUTS", "1"),
         "dynjax_path": os.path.dirname(dynjax.__file__)}
  exact_ref = {}
  sync = jax.block_until_ready  # (every mode returns numpy: a served request's answer)
  dv = jax.device_put(v)
  modes = args.modes.split(",")

  def record(name, fn, first_outs=None, err_of=None, compiles=None):
    t1, outs = _time_pass(fn, [images[s] for s in order], sync)
    each = []
    t2, outs2 = _time_pass(fn, [images[s] for s in order], sync, each)
    rec = {"first_pass_s": t1, "second_pass_mean_ms": t2 / len(order) * 1e3,
           "second_pass_median_ms": float(np.median(each)) * 1e3}
    if compiles is not None:
      rec["compiles"] = compiles()
    if err_of is not None:
      errs = [err_of(s, o) for s, o in zip(order, outs2, strict=True)]
      rec["max_rel_err_vs_exact"] = max(errs)
    out["modes"][name] = rec
    print(f"{name:12s} first pass {t1:7.2f} s, then {rec['second_pass_mean_ms']:7.2f} ms a "
          f"request (median {rec['second_pass_median_ms']:.2f})" + (f", compiles {rec['compiles']}" if "compiles" in rec else "")
          + (f", max rel err {rec['max_rel_err_vs_exact']:.1e}" if err_of else ""), flush=True)
    return outs2

  def rel(s, o):
    want = exact_ref[s]
    return float(np.abs(np.asarray(o, np.float32) - want).max() / np.abs(want).max())

  # jax.jit per exact shape: the reference (always run: the others are checked against it)
  jit_exact = jax.jit(apply)
  outs = record("jit_exact", lambda x: np.asarray(jit_exact(dv, x)),
                compiles=lambda: len(sizes))
  for s, o in zip(order, outs, strict=True):
    exact_ref[s] = np.asarray(o, np.float32)
  if "dynjax" in modes:
    f = dynjax.jit(apply, dims={"x": "b, h, w, 3"}, buckets={"h": step, "w": step})
    record("dynjax", lambda x: f(dv, x), err_of=rel, compiles=lambda: f.stats()["compiles"])
    st = f.stats()
    out["modes"]["dynjax"].update(fallbacks=st["fallbacks"], exact_calls=st["exact_calls"],
                                  per_bucket_calls=st["per_bucket_calls"],
                                  padded_fraction=st["padded_fraction"])
  if "jit_bucket" in modes:
    jb = jax.jit(apply)

    def at_bucket(x):
      h, w = bucket_of[x.shape[1:3]]
      buf = np.zeros((B, h, w, 3), np.float32)
      buf[:, :x.shape[1], :x.shape[2]] = x
      return np.asarray(jb(dv, buf))

    record("jit_bucket", at_bucket, compiles=lambda: len(out["buckets"]))
  if "pad_max" in modes:
    jm = jax.jit(apply)

    def at_max(x):
      buf = np.zeros((B, hmax, hmax, 3), np.float32)
      buf[:, :x.shape[1], :x.shape[2]] = x
      return np.asarray(jm(dv, buf))

    record("pad_max", at_max, err_of=rel, compiles=lambda: 1)
  if "torch_eager" in modes:
    try:
      import torch
    except ImportError:
      torch = None
    if torch is not None and torch.cuda.is_available():
      torch.backends.cuda.matmul.allow_tf32 = True
      torch.backends.cudnn.allow_tf32 = True
      net = _torch_resnet(stages, args.width).cuda().eval()

      def run_torch(x):
        with torch.inference_mode():
          return net(torch.from_numpy(x).cuda().permute(0, 3, 1, 2)).cpu().numpy()

      record("torch_eager", run_torch, compiles=None)
      out["torch"] = torch.__version__
  write_json(args.out, "bench_vision.json", out)
  return out


if __name__ == "__main__":
  main()
