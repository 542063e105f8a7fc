"""Would lowering once per family cut a cold server's Python? (issue 18, goal 3)

  python benchmarks/probe_family_export.py --size base --buckets 64,128,256,512 --out $OUT

The lever session 15 named for the GIL a cold server's warm-up holds: lower a model once with a
symbolic length (``jax.export`` shape polymorphism) and, per bucket, only call the exported
module at the bucket's shape (jax inlines the serialized module; XLA refines its shapes).
This times, for BERT-base with a lengths mask (``padding="trust"`` semantics: no padding
pass), in one process:

* ``export_seconds``: the one symbolic export (trace + StableHLO with a symbolic ``t``);
* per bucket ``call_lower_seconds``: ``jax.jit(exported.call).trace(...).lower()``;
* per bucket ``direct_lower_seconds``: ``jax.jit(apply).trace(...).lower()`` (a user's
  per-bucket lowering, the Flax trace included);
* ``compile_seconds`` of one bucket both ways and the largest difference of their outputs.

Compare with ``probe_lowering.py`` (dynjax's per-bucket lowering and JAX's floor).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--size", default="base")
  ap.add_argument("--buckets", default="64,128,256,512")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import export

  from examples.models import ENCODER_SIZES, BertEncoder, init_encoder_params, to_device

  cfg = ENCODER_SIZES[args.size]
  params = {"params": to_device(init_encoder_params(cfg))}
  module = BertEncoder(cfg)

  def apply(p, tok, lens):
    return module.apply(p, tok, lens)

  buckets = [int(b) for b in args.buckets.split(",")]
  b = args.batch
  pavals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

  def avals(t):
    return pavals, jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)

  t0 = time.perf_counter()
  (sym,) = export.symbolic_shape("t", constraints=[f"t <= {max(buckets)}"])
  exp = export.export(jax.jit(apply))(*avals(sym))
  rec = {"jax": jax.__version__, "backend": jax.default_backend(),
         "device": jax.devices()[0].device_kind, "size": args.size,
         "export_seconds": round(time.perf_counter() - t0, 4), "buckets": {}}
  lowered = {}
  for t in buckets:
    t0 = time.perf_counter()
    direct = jax.jit(apply).trace(*avals(t)).lower()
    t1 = time.perf_counter()
    called = jax.jit(exp.call).trace(*avals(t)).lower()
    t2 = time.perf_counter()
    lowered[t] = direct, called
    rec["buckets"][str(t)] = {"direct_lower_seconds": round(t1 - t0, 4),
                              "call_lower_seconds": round(t2 - t1, 4)}
    print(f"  t={t:4d} direct lower {t1 - t0:.3f} s  exported call lower {t2 - t1:.3f} s",
          flush=True)
  t = buckets[0]
  direct, called = lowered[t]
  t0 = time.perf_counter()
  c_direct = direct.compile()
  t1 = time.perf_counter()
  c_called = called.compile()
  t2 = time.perf_counter()
  tok = np.random.RandomState(0).randint(1, cfg.vocab, (b, t)).astype(np.int32)
  lens = np.full((b,), max(1, t - 3), np.int32)
  diff = float(jnp.max(jnp.abs(c_direct(params, tok, lens) - c_called(params, tok, lens))))
  rec["compile_seconds"] = {"direct": round(t1 - t0, 4), "exported": round(t2 - t1, 4),
                            "bucket": t}
  rec["max_abs_diff"] = diff
  print(f"  symbolic export {rec['export_seconds']:.3f} s; compile at t={t}: direct "
        f"{t1 - t0:.2f} s, exported {t2 - t1:.2f} s; max |diff| {diff:.2e}", flush=True)
  write_json(args.out, f"probe_family_export_{args.size}.json", rec)
  return rec


if __name__ == "__main__":
  main()
