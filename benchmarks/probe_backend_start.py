"""Where a fresh JAX process's start-up goes, phase by phase, by the order it does things in
(issue 18, goal 3): imports, the backend's start, the first computation, Flax's abstract init.

  python -m benchmarks.probe_backend_start --out $OUT --reps 3

Each variant runs in a fresh process, the variants in turn, ``--reps`` times:

- ``import_then_backend``: ``import jax, flax.linen, dynjax``, then ``jax.devices()``, then
  ``jax.random.key(0)``, then ``jax.eval_shape(module.init, ...)`` of BERT-base (``--size``);
- ``backend_first``: ``import jax`` and ``jax.devices()`` first, then Flax and dynjax, ...;
- ``put_in_import``: as the first, with the array ``import dynjax`` made before session 39
  (``jax.device_put`` of a scalar right after ``import jax``: the backend started there).

Each phase's wall and main-thread CPU seconds; ``--profile PHASE`` adds a cProfile (top 25
by cumulative time) of that phase in every process.  Writes ``probe_backend_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks._report import write_json

VARIANTS = ("import_then_backend", "backend_first", "put_in_import")

_CHILD = r"""
import time, sys, json, os
t0 = time.perf_counter(); c0 = time.thread_time()
phases = []
prof = None
def mark(name):
  global t0, c0
  t, c = time.perf_counter(), time.thread_time()
  phases.append([name, round(t - t0, 4), round(c - c0, 4)])
  t0, c0 = time.perf_counter(), time.thread_time()
def start(name):
  global prof
  if name == PROFILE:
    import cProfile
    prof = cProfile.Profile(); prof.enable()
def stop(name):
  global prof
  if prof is not None and name == PROFILE:
    prof.disable()
    import io, pstats
    buf = io.StringIO(); pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    print("PROFILE " + json.dumps(buf.getvalue()[-5000:]))
    prof = None
  mark(name)
VARIANT, PROFILE, SIZE = sys.argv[1], sys.argv[2], sys.argv[3]
start("import jax"); import jax; stop("import jax")
if VARIANT == "backend_first":
  start("backend"); jax.devices(); stop("backend")
if VARIANT == "put_in_import":
  import numpy as np
  start("backend"); jax.device_put(np.zeros((), np.float32)); stop("backend")
start("import flax+dynjax")
import flax.linen, dynjax
from dynjax import flax as dynjax_flax
from examples import models
stop("import flax+dynjax")
if VARIANT == "import_then_backend":
  start("backend"); jax.devices(); stop("backend")
start("random key"); key = jax.random.key(0); stop("random key")
import numpy as np
start("eval_shape(init)")
m = models.BertEncoder(models.ENCODER_SIZES[SIZE])
tok = jax.ShapeDtypeStruct((8, 512), np.int32); lens = jax.ShapeDtypeStruct((8,), np.int32)
jax.eval_shape(m.init, key, tok, lens)
stop("eval_shape(init)")
print("RESULT " + json.dumps(phases))
"""


def run_one(variant: str, profile: str, size: str, extra_env: dict | None = None) -> dict:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
             **(extra_env or {}))
  t = time.perf_counter()
  r = subprocess.run([sys.executable, "-c", _CHILD, variant, profile, size], capture_output=True,
                     text=True, env=env, timeout=300, cwd=root)
  wall = time.perf_counter() - t
  rec: dict = {"variant": variant, "env": extra_env or {}, "process_s": round(wall, 3)}
  for line in r.stdout.splitlines():
    if line.startswith("RESULT "):
      rec["phases"] = json.loads(line[7:])
    elif line.startswith("PROFILE "):
      rec["profile"] = json.loads(line[8:])
  if "phases" not in rec:
    rec["error"] = f"rc={r.returncode}: {r.stderr[-2000:]}"
  return rec


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--profile", default="", help="a phase's name to cProfile, e.g. backend")
  p.add_argument("--size", default="base")
  p.add_argument("--envs", default="",
                 help="';'-separated environments each variant also runs under, as "
                      "KEY=VAL,KEY=VAL (an empty item: the process's own), e.g. "
                      "';XLA_PYTHON_CLIENT_PREALLOCATE=false'")
  args = p.parse_args(argv)
  envs = [dict(kv.split("=", 1) for kv in item.split(",") if kv)
          for item in (args.envs.split(";") if args.envs else [""])]
  results = []
  for k in range(args.reps):
    for env in envs:
      for v in args.variants.split(","):
        rec = run_one(v, args.profile, args.size, env)
        rec["rep"] = k
        results.append(rec)
        print(v, env, rec.get("process_s"), rec.get("phases") or rec.get("error"), flush=True)
  out = {"python": sys.version.split()[0], "results": results}
  write_json(args.out, "probe_backend_start.json", out)
  return out


if __name__ == "__main__":
  main()
