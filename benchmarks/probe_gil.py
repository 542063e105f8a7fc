"""How much of the GIL each step of building one bucket takes from the rest of the process.

  python benchmarks/probe_gil.py --size base --out $OUT        (BERT-base, padding="auto")

A spinner thread counts loop iterations (pure Python, as a server's own start-up code or its
request handling); each step of one bucket's build runs on the main thread, and the record is
the step's wall seconds and the spinner's speed meanwhile, as a fraction of its speed while
the main thread sleeps (1.0: the step leaves the GIL to others; ~0: it holds it).  Steps:
``lower`` (dynjax's per-bucket trace + padding pass + StableHLO), ``compile`` (XLA, serving's
quick tier on GPU) with JAX's persistent compilation cache off and on (the cache key
serializes the module), ``serialize`` (the executable store's write), ``deserialize`` (a
restart's load) and the first two runs.  Where a cold server's start-up Python slows down
while it warms up (issue 18, goal 3).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402


def spin_share(step, base_rate: float):
  """(step's result, wall seconds, spinner's rate meanwhile / base_rate)."""
  stop, out = [False], []

  def spin():
    n = 0
    while not stop[0]:
      n += 1
    out.append(n)

  t = threading.Thread(target=spin)
  t.start()
  time.sleep(0.05)  # the spinner's lead-in, counted in its time below
  t0 = time.perf_counter()
  res = step()
  dt = time.perf_counter() - t0
  stop[0] = True
  t.join()
  return res, dt, out[0] / (base_rate * (dt + 0.05))


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size", default="base")
  ap.add_argument("--t", type=int, default=128)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import serialize_executable

  import dynjax
  from dynjax.jit import _serving
  from examples.models import ENCODER_SIZES, BertEncoder, init_encoder_params, to_device

  cfg = ENCODER_SIZES[args.size]
  params = {"params": to_device(init_encoder_params(cfg))}
  f = dynjax.flax.jit(BertEncoder(cfg), dims={"tokens": "b, t", "lengths": "b"},
                      buckets={"t": dynjax.buckets.pow2(16, 512)})
  tok = np.random.RandomState(0).randint(1, 1000, (8, args.t - 3)).astype(np.int32)
  lens = np.full((8,), args.t - 3, np.int32)
  fam = f.trace(params, tok, lens).family
  bkey = (8, args.t)
  on_gpu = jax.default_backend() == "gpu"
  opts = _serving.QUICK_GPU_OPTIONS if on_gpu else {}
  # The spinner's speed (iterations a second) with the main thread asleep.
  _, _, base = spin_share(lambda: time.sleep(1.0), 1.0)
  rec: dict = {"jax": jax.__version__, "backend": jax.default_backend(),
               "device": str(jax.devices()[0].device_kind), "bucket": list(bkey), "steps": {}}

  def note(name, dt, share, **kw):
    rec["steps"][name] = {"seconds": round(dt, 4), "gil_left": round(share, 3), **kw}
    print(f"  {name:28s} {dt:7.3f} s   others get {share:5.2f} of their speed {kw or ''}",
          flush=True)

  (lo, _), dt, sh = spin_share(lambda: fam.lower_bucket(bkey), base)
  note("lower", dt, sh)
  (lo2, _) = fam.lower_bucket(bkey)
  exe, dt, sh = spin_share(lambda: lo.compile(compiler_options=opts) if opts else lo.compile(),
                           base)
  note("compile (no JAX cache)", dt, sh)
  blob, dt, sh = spin_share(lambda: serialize_executable.serialize(exe), base)
  note("serialize (store write)", dt, sh, bytes=len(blob[0]))
  _, dt, sh = spin_share(lambda: serialize_executable.deserialize_and_load(*blob), base)
  note("deserialize (store load)", dt, sh)
  sizes = jnp.asarray(bkey, jnp.int32)
  x = (jnp.asarray(np.zeros(bkey, np.int32)), jnp.asarray(np.full((8,), 4, np.int32)))  # rngs=None last
  for i in (1, 2):
    _, dt, sh = spin_share(lambda: jax.block_until_ready(exe(sizes, params, *x, None)), base)
    note(f"run {i}", dt, sh)
  # Last: JAX's persistent cache stays on for the process once a compile used it.
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="probe_gil_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _, dt, sh = spin_share(lambda: lo2.compile(compiler_options=opts) if opts else lo2.compile(),
                         base)
  note("compile (JAX cache on, write)", dt, sh)
  write_json(args.out, "probe_gil.json", rec)
  return rec


if __name__ == "__main__":
  main()
