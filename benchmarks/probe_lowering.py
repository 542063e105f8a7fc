"""Where one bucket's lowering spends its time (issue 18, goal 3: the Python a cold server runs
beside its own start-up, holding the GIL).

  python benchmarks/probe_lowering.py --size base --attention none,pallas --out $OUT

BERT-base under ``dynjax.flax.jit`` (``padding="auto"``): the family's trace (symbolic, with
the padding pass's probe plan), then per bucket the public ``f.trace(...).lower(bucket=...)``
(the padding pass interpreting the symbolic jaxpr inside JAX's trace, then StableHLO), timed
each, and the floor of the same bucket: JAX re-tracing the bucket's padded jaxpr with
``eval_jaxpr`` (no padding rules) and lowering that.  One more bucket runs under cProfile;
its top functions (cumulative and own time) go to the record, as do the seconds of the
stages named in ``STAGES``.  Every record names the JAX version and the device.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

# Appended, not prepended: PYTHONPATH=<another tree>:$PWD probes that tree's dynjax.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402

# (label, file suffix, function name): cumulative seconds read from the profile.
STAGES = (
  ("padding pass (interpreter inside JAX's trace)", "_padding.py", "fun"),
  ("JAX trace of the bucket", "pjit.py", "jit_trace"),
  ("StableHLO lowering", "jax/_src/stages.py", "lower"),
  ("attention rewrite", "_attention.py", "rewrite_jaxpr"),
  ("Pallas kernel lowering", "pallas_call_registration.py", "pallas_call_lowering"),
  ("MLIR module to bytes", "mlir.py", "module_to_bytecode"),
)


def _stage_seconds(stats: pstats.Stats) -> dict:
  out = {}
  for label, suffix, name in STAGES:
    cum = sum(v[3] for (fname, _, fn), v in stats.stats.items()
              if fname.endswith(suffix) and fn == name)
    if cum:
      out[label] = round(cum, 4)
  return out


def _top(stats: pstats.Stats, key: str, n: int) -> list[str]:
  buf = io.StringIO()
  stats.stream = buf
  stats.sort_stats(key).print_stats(n)
  lines = buf.getvalue().splitlines()
  start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
  return [ln.rstrip() for ln in lines[start:] if ln.strip()]


def probe(size: str, attention: str | None, buckets: list[int], batch: int) -> dict:
  import jax
  import numpy as np

  import dynjax
  from examples.models import ENCODER_SIZES, BertEncoder, init_encoder_params, to_device

  cfg = ENCODER_SIZES[size]
  params = {"params": to_device(init_encoder_params(cfg))}
  f = dynjax.flax.jit(BertEncoder(cfg), dims={"tokens": "b, t", "lengths": "b"},
                      buckets={"t": dynjax.buckets.pow2(16, 512)}, attention=attention)
  tok = np.random.RandomState(0).randint(1, 1000, (batch, 20)).astype(np.int32)
  lens = np.full((batch,), 20, np.int32)
  t0 = time.perf_counter()
  traced = f.trace(params, tok, lens)
  rec: dict = {"attention": attention or "xla", "family_trace_seconds":
               round(time.perf_counter() - t0, 4), "buckets": {}}
  for t in buckets:
    t0 = time.perf_counter()
    lo = traced.lower(bucket={"b": batch, "t": t})
    total = time.perf_counter() - t0
    # The floor: JAX alone re-tracing and lowering the padded jaxpr this bucket produced.
    del lo
    # (a family's own per-bucket trace: the one private call of this probe)
    jaxpr = traced.family._trace_bucket((batch, t), {})[0].jaxpr
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.jaxpr.invars]
    floor = float("inf")
    for _ in range(2):  # a fresh function each time (no trace cache hit); the faster
      t0 = time.perf_counter()
      jax.jit(lambda *a, j=jaxpr: jax.core.eval_jaxpr(j.jaxpr, j.consts, *a)).trace(
          *avals).lower()
      floor = min(floor, time.perf_counter() - t0)
    floor = round(floor, 4)
    rec["buckets"][str(t)] = {"lower_seconds": round(total, 4), "floor_seconds": floor,
                              "eqns": len(jaxpr.jaxpr.eqns)}
    print(f"  {rec['attention']:6s} t={t:4d}  lower {total:6.3f} s  floor (JAX re-trace + "
          f"lower of the padded jaxpr) {floor} s", flush=True)
  prof = cProfile.Profile()
  t = buckets[-1] + 16
  prof.enable()
  traced.lower(bucket={"b": batch, "t": t})
  prof.disable()
  stats = pstats.Stats(prof)
  rec["profiled_bucket"] = t
  rec["profiled_stages"] = _stage_seconds(stats)
  rec["profile_cumulative"] = _top(stats, "cumulative", 45)
  rec["profile_tottime"] = _top(stats, "tottime", 30)
  print("   profiled:", rec["profiled_stages"], flush=True)
  return rec


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size", default="base")
  ap.add_argument("--attention", default="none", help='comma list of "none", "pallas", ...')
  ap.add_argument("--buckets", default="64,128,256,512")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--tag", default="")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax

  import dynjax

  rec: dict = {"dynjax": os.path.dirname(dynjax.__file__), "jax": jax.__version__, "backend": jax.default_backend(),
               "device": str(jax.devices()[0].device_kind), "cpus": os.cpu_count(),
               "size": args.size, "tag": args.tag, "modes": [],
               "outline": os.environ.get("DYNJAX_OUTLINE", "1")}
  buckets = [int(b) for b in args.buckets.split(",")]
  for att in args.attention.split(","):
    rec["modes"].append(probe(args.size, None if att == "none" else att, buckets, args.batch))
  name = f"probe_lowering{('_' + args.tag) if args.tag else ''}.json"
  write_json(args.out, name, rec)
  return rec


if __name__ == "__main__":
  main()
