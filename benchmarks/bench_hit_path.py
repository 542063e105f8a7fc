"""Issue 10's hit-path target, side by side: dynjax vs the bucket's own AOT executable.

  python benchmarks/bench_hit_path.py [--size base] [--iters 200] [--out DIR]

For each case the baseline is what a user who padded by hand would call: ``jax.jit(fun)``
lowered and compiled AOT at the bucket shape, called with the model's own pytree arguments and
the request already padded on the host (numpy in, numpy out).  dynjax gets the unpadded
request.  Blocks of calls alternate between the two (noise hits both alike); the figure is the
median over blocks of the mean per call.  Then a cProfile of the dynjax calls (by tottime)
says where the microseconds go.

Cases: the Flax BERT of ``--size`` at T=100 (bucket 128) and T=200 (bucket 256), batch 8,
``padding="trust"`` and ``"auto"`` (the unmasked-model path: a sizes vector rides along);
a tiny elementwise function on (8, 13) -> (8, 16), numpy and device inputs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import dynjax  # noqa: E402
from benchmarks._report import write_json  # noqa: E402
from dynjax import flax as dynjax_flax  # noqa: E402
from examples import models  # noqa: E402


def _blocks(fns, iters: int, block: int = 20) -> list[float]:
  """Median over alternating blocks of the mean us per call, one figure per function."""
  for fn in fns:
    for _ in range(5):
      fn()
  per = [[] for _ in fns]
  for _ in range(max(1, iters // block)):
    for i, fn in enumerate(fns):
      t0 = time.perf_counter()
      for _ in range(block):
        fn()
      per[i].append((time.perf_counter() - t0) / block * 1e6)
  return [float(np.median(p)) for p in per]


def _profile(fn, n: int) -> str:
  pr = cProfile.Profile()
  pr.enable()
  for _ in range(n):
    fn()
  pr.disable()
  s = io.StringIO()
  pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
  return s.getvalue()


def bert_cases(size: str, iters: int) -> dict:
  cfg = models.ENCODER_SIZES[size]
  module = models.BertEncoder(cfg)
  variables = models.to_device({"params": models.init_encoder_params(cfg, seed=0)})

  def apply(v, tokens, lengths):
    return module.apply(v, tokens, lengths)

  out = {}
  rng = np.random.default_rng(0)
  for padding in ("trust", "auto"):
    f = dynjax_flax.jit(module, dims={"tokens": "b, t", "lengths": "b"}, padding=padding,
                        buckets={"t": dynjax.buckets.pow2(16, 512)})
    for t, bucket in ((100, 128), (200, 256)):
      tok = rng.integers(1, cfg.vocab, (8, t)).astype(np.int32)
      lens = np.full((8,), t, np.int32)
      padded = np.zeros((8, bucket), np.int32)
      padded[:, :t] = tok
      aot = jax.jit(apply).lower(variables, padded, lens).compile()
      f(variables, tok, lens)
      np.testing.assert_allclose(np.asarray(f(variables, tok, lens)),
                                 np.asarray(aot(variables, padded, lens)), rtol=2e-3, atol=2e-3)

      def run_aot(aot=aot, padded=padded, lens=lens):
        return np.asarray(aot(variables, padded, lens))

      def run_dyn(f=f, tok=tok, lens=lens):
        return f(variables, tok, lens)

      fns = [run_aot, run_dyn]
      if padding == "auto":
        # The padding pass's own executable at the bucket, called on padded inputs with the
        # true sizes: separates dynjax's per-call cost from the pass's extra device work.
        # f.lower(...).compile() is the bucket's stage object; its ``entry.exe`` is the XLA
        # executable itself (dynjax has no public "run on padded inputs" call yet).
        # Its arguments are the call's bound parameters, an omitted one (BertEncoder's
        # ``mask``) as a leafless placeholder: built from the executable's own input tree.
        exe = f.lower(variables, tok, lens).compile().entry.exe
        sizes = jax.device_put(np.asarray((8, t), np.int32))
        own_args, own_kw = jax.tree.unflatten(
            exe.in_tree, jax.tree.leaves((sizes, variables, padded, lens)))

        def run_own(exe=exe, own_args=own_args, own_kw=own_kw):
          return np.asarray(exe(*own_args, **own_kw))

        fns.append(run_own)
      times = _blocks(fns, iters)
      a, d = times[0], times[1]
      key = f"bert-{size} {padding} T={t}->{bucket}"
      out[key] = {"aot_us": a, "dynjax_us": d, "overhead_us": d - a,
                  "overhead_pct": 100 * (d - a) / a}
      line = (f"{key:<32} AOT {a:9.1f} us  dynjax {d:9.1f} us  {d - a:+8.1f} us "
              f"({100 * (d - a) / a:+.2f}%)")
      if len(times) > 2:
        own = times[2]
        out[key].update({"own_bucket_exe_us": own, "overhead_vs_own_us": d - own,
                         "overhead_vs_own_pct": 100 * (d - own) / own})
        line += f"; vs its own bucket executable {own:.1f} us: {100 * (d - own) / own:+.2f}%"
      print(line, flush=True)
      if padding == "trust" and t == 100:
        out["profile"] = _profile(run_dyn, max(20, iters // 4))
  return out


def tiny_cases(iters: int) -> dict:
  def tiny(x):
    return x * 2.0 + 1.0

  f = dynjax.jit(tiny, dims={"x": "b, t"}, padding="trust",
                 buckets={"b": [8], "t": dynjax.buckets.pow2(16, 64)})
  x13 = np.ones((8, 13), np.float32)
  x16 = np.ones((8, 16), np.float32)
  d16 = jnp.asarray(x16)
  aot = jax.jit(tiny).lower(x16).compile()
  f(x13)
  f(d16)
  out = {}
  a, d = _blocks([lambda: np.asarray(aot(x16)), lambda: f(x13)], iters * 10)
  out["tiny numpy (8,13)->16"] = {"aot_us": a, "dynjax_us": d, "overhead_us": d - a}
  print(f"{'tiny numpy (8,13)->(8,16)':<32} AOT {a:9.1f} us  dynjax {d:9.1f} us  {d - a:+8.1f} us",
        flush=True)

  def dev_aot():
    jax.block_until_ready(aot(d16))

  def dev_dyn():
    jax.block_until_ready(f(d16))

  a, d = _blocks([dev_aot, dev_dyn], iters * 10)
  out["tiny device (8,16), synced"] = {"aot_us": a, "dynjax_us": d, "overhead_us": d - a}
  print(f"{'tiny device (8,16), synced':<32} AOT {a:9.1f} us  dynjax {d:9.1f} us  {d - a:+8.1f} us",
        flush=True)
  out["tiny_profile"] = _profile(lambda: f(x13), iters * 10)
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--size", default="base")
  ap.add_argument("--iters", type=int, default=200)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  print(f"hit path, python {platform.python_version()}, jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}", flush=True)
  res = {"versions": {"python": platform.python_version(), "jax": jax.__version__,
                      "device": jax.devices()[0].device_kind,
                      "dynjax": os.path.dirname(os.path.abspath(dynjax.__file__))}}
  res.update(tiny_cases(args.iters))
  res.update(bert_cases(args.size, args.iters))
  print(res["profile"])
  write_json(args.out, "hit_path.json", res)


if __name__ == "__main__":
  main()
