"""Greedy decoding with a KV cache under ``dynjax.while_loop``: what a stream of prompts costs.

  python benchmarks/probe_kv_decode.py --out $OUT
  PYTHONPATH=<another tree>:$PWD python benchmarks/probe_kv_decode.py   # that tree's dynjax

The carry of :func:`examples.decode_lm.make_kv_step` holds the tokens ``(b, t)`` and the
caches ``(b, t - 1, heads, dh)``.  A stream of prompts of several lengths is decoded, first
pass (every compile inside it) and the median of later passes, with the same stream as a Python loop of
``jax.jit`` steps at exact shapes (``kv_jit_exact``) and dynjax's loop over the whole prefix
without a cache (``prefix``).  Each row says which buckets the loops visited and how many
executables were compiled; ``tokens_equal_first_mode`` compares each mode's tokens with the
first mode's (``kv`` against ``kv_jit_exact``: equal on the CPU; ``prefix`` is another
computation of the same model, and on a GPU its TF32 rounding flips some argmaxes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Appended, not prepended: PYTHONPATH=<another tree>:$PWD probes that tree's dynjax.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402


def _stream(n: int, batch: int, lo: int, hi: int, seed: int):
  import numpy as np

  rs = np.random.RandomState(seed)
  return [rs.randint(2, 256, (batch, int(t))).astype(np.int32)
          for t in rs.randint(lo, hi + 1, n)]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--requests", type=int, default=12)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--prompt", default="5,40", help="lo,hi prompt lengths")
  ap.add_argument("--new-tokens", type=int, default=40)
  ap.add_argument("--modes", default="kv,kv_jit_exact,prefix")
  ap.add_argument("--bucket-from", default="init")
  ap.add_argument("--passes", type=int, default=5, help="passes after the first (median)")
  ap.add_argument("--tag", default="")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax
  import numpy as np

  import dynjax
  from examples import decode_lm as D

  lo, hi = (int(x) for x in args.prompt.split(","))
  params = D.init_lm(D.LMConfig(), seed=0)
  stream = _stream(args.requests, args.batch, lo, hi, seed=0)
  compiles = [0]
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.__setitem__(0, compiles[0] + 1)
      if name == "/jax/core/compile/backend_compile_duration" else None)
  rec: dict = {"dynjax": os.path.dirname(dynjax.__file__), "jax": jax.__version__,
               "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
               "cpus": os.cpu_count(), "tag": args.tag, "args": vars(args), "rows": []}
  want = None
  for mode in args.modes.split(","):
    def run(pr, mode=mode):
      if mode == "kv":
        out, st = D.decode_kv_dynjax(params, pr, args.new_tokens, bucket_from=args.bucket_from)
        return out[0], st
      if mode == "prefix":
        out, st = D.decode_dynjax(params, pr, args.new_tokens, bucket_from=args.bucket_from)
        return out[0], st
      out, syncs = D.decode_kv_jit_exact(params, pr, args.new_tokens)
      return out[0], {"host_syncs": syncs, "buckets": []}

    row: dict = {"mode": mode}
    for name in ("first_pass", "later_passes"):
      c0, buckets, syncs, walls = compiles[0], 0, 0, []
      for _ in range(1 if name == "first_pass" else args.passes):
        toks = []
        t0 = time.perf_counter()
        for pr in stream:
          out, st = run(pr)
          toks.append(np.asarray(out))
          buckets += len(st["buckets"])
          syncs += st["host_syncs"]
        walls.append(time.perf_counter() - t0)
      n = len(walls)
      row[name] = {"seconds": round(float(np.median(walls)), 4),
                   "compiles": compiles[0] - c0, "buckets_visited": buckets // n,
                   "host_syncs": syncs // n}
    if want is None:
      want = toks
    row["tokens_equal_first_mode"] = all(np.array_equal(a, b) for a, b in zip(toks, want,
                                                                                strict=True))
    rec["rows"].append(row)
    print(f"  {mode:14s} first pass {row['first_pass']}  later (median) {row['later_passes']}  "
          f"tokens equal: {row['tokens_equal_first_mode']}", flush=True)
  write_json(args.out, f"probe_kv_decode{('_' + args.tag) if args.tag else ''}.json", rec)
  return rec


if __name__ == "__main__":
  main()
