"""How much of the GIL each step of building one bucket takes from the rest of the process.

  python benchmarks/probe_gil.py --size base --out $OUT        (BERT-base, padding="auto")

A spinner thread counts loop iterations (pure Python, as a server's own start-up code or its
request handling); each step of one bucket's build runs on the main thread, and the record is
the step's wall seconds and the spinner's speed meanwhile, as a fraction of its speed while
the main thread sleeps (1.0: the step leaves the GIL to others; ~0: it holds it); a spinner
*process* beside it measures what the step takes from other cores instead (XLA's compile
threads).  Steps:
``lower`` (dynjax's per-bucket trace + padding pass + StableHLO), ``compile`` (XLA, serving's
quick tier on GPU) with JAX's persistent compilation cache off and on (the cache key
serializes the module), ``serialize`` (the executable store's write), ``deserialize`` (a
restart's load), the first two runs, and compiles of other buckets with one XLA compile
thread (``xla_gpu_force_compilation_parallelism=1``), again as they are, and from a thread at
nice 10 (the threads XLA starts inherit it).  ``--attention pallas``: with the Pallas flash
attention.  Where a cold server's start-up Python slows down
while it warms up (issue 18, goal 3).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402

_PROC_SPIN = """
import signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print("go", flush=True)
n, t = 0, time.perf_counter()
while not stop:
  n += 1
print(n / (time.perf_counter() - t), flush=True)
"""


def spin_share(step, base_rate: float, proc_base: float | None = None):
  """(step's result, wall seconds, thread spinner's rate meanwhile / base_rate, and with
  ``proc_base`` a spinner *process*'s rate / proc_base: what the step takes from other cores
  rather than from the GIL)."""
  stop, out = [False], []

  def spin():
    n = 0
    while not stop[0]:
      n += 1
    out.append(n)

  proc = None
  if proc_base is not None:
    proc = subprocess.Popen([sys.executable, "-c", _PROC_SPIN], stdout=subprocess.PIPE,
                            text=True)
    proc.stdout.readline()
  t = threading.Thread(target=spin)
  t.start()
  time.sleep(0.05)  # the spinner's lead-in, counted in its time below
  t0 = time.perf_counter()
  try:
    res = step()
  finally:  # a step that raises must not leave the spinners running
    dt = time.perf_counter() - t0
    stop[0] = True
    t.join()
    if proc is not None:
      proc.send_signal(signal.SIGTERM)
  share = out[0] / (base_rate * (dt + 0.05))
  if proc is None:
    return res, dt, share
  rate = float(proc.stdout.readline())
  proc.wait()
  return res, dt, share, rate / proc_base


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size", default="base")
  ap.add_argument("--t", type=int, default=128)
  ap.add_argument("--out", default=None)
  ap.add_argument("--attention", default=None, help='dynjax.jit(attention=...): "pallas"')
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import serialize_executable

  import dynjax
  from dynjax.jit import _args, _serving  # rngs: left out (the flax wrapper's last argument)
  from examples.models import ENCODER_SIZES, BertEncoder, init_encoder_params, to_device

  cfg = ENCODER_SIZES[args.size]
  params = {"params": to_device(init_encoder_params(cfg))}
  f = dynjax.flax.jit(BertEncoder(cfg), dims={"tokens": "b, t", "lengths": "b"},
                      buckets={"t": dynjax.buckets.pow2(16, 512)},
                      attention=args.attention)
  tok = np.random.RandomState(0).randint(1, 1000, (8, args.t - 3)).astype(np.int32)
  lens = np.full((8,), args.t - 3, np.int32)
  fam = f.trace(params, tok, lens).family
  bkey = (8, args.t)
  on_gpu = jax.default_backend() == "gpu"
  opts = _serving.QUICK_GPU_OPTIONS if on_gpu else {}
  # The spinners' speeds (iterations a second) with the main thread asleep.
  _, _, base = spin_share(lambda: time.sleep(1.0), 1.0)
  _, _, _, pbase = spin_share(lambda: time.sleep(1.0), 1.0, 1.0)
  rec: dict = {"jax": jax.__version__, "backend": jax.default_backend(),
               "device": str(jax.devices()[0].device_kind), "bucket": list(bkey),
               "cpus": os.cpu_count(), "steps": {}}

  def measure(name, step, **kw):
    res, dt, sh, psh = spin_share(step, base, pbase)
    rec["steps"][name] = {"seconds": round(dt, 4), "gil_left": round(sh, 3),
                          "cores_left": round(psh, 3), **kw}
    print(f"  {name:34s} {dt:7.3f} s   a thread gets {sh:5.2f}, a process {psh:5.2f} of its "
          f"speed {kw or ''}", flush=True)
    return res

  def compile_with(lo, extra=None, nice=False):
    o = {**opts, **(extra or {})}

    def run():
      try:
        if nice:
          os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        box.append(lo.compile(compiler_options=o) if o else lo.compile())
      except BaseException as e:  # noqa: BLE001 - raised again on the measuring thread
        box.append(e)

    box: list = []
    t = threading.Thread(target=run)  # XLA's threads started by this one inherit its nice
    t.start()
    t.join()
    if isinstance(box[0], BaseException):
      raise box[0]
    return box[0]

  lo, _ = measure("lower", lambda: fam.lower_bucket(bkey))
  exe = measure("compile (no JAX cache)", lambda: compile_with(lo))
  blob = measure("serialize (store write)", lambda: serialize_executable.serialize(exe))
  rec["steps"]["serialize (store write)"]["bytes"] = len(blob[0])
  measure("deserialize (store load)", lambda: serialize_executable.deserialize_and_load(*blob))
  sizes = jnp.asarray(bkey, jnp.int32)
  x = (jnp.asarray(np.zeros(bkey, np.int32)), jnp.asarray(np.full((8,), 4, np.int32)))
  for i in (1, 2):
    measure(f"run {i}", lambda: jax.block_until_ready(exe(sizes, params, *x, _args.OMITTED)))
  # Other buckets (XLA's autotuning results are cached in-process by shape): compile threads.
  for dt_, name, extra, nice in (
      (16, "compile, compilation_parallelism=1", {"xla_gpu_force_compilation_parallelism": 1},
       False),
      (32, "compile again (another bucket)", None, False),
      (48, "compile on a thread at nice 10", None, True)):
    lo_x, _ = fam.lower_bucket((8, args.t + dt_))
    measure(name, lambda lo_x=lo_x, extra=extra, nice=nice: compile_with(lo_x, extra, nice))
  # Last: JAX's persistent cache stays on for the process once a compile used it.
  (lo2, _) = fam.lower_bucket(bkey)
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="probe_gil_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  measure("compile (JAX cache on, write)", lambda: compile_with(lo2))
  write_json(args.out, "probe_gil.json", rec)
  return rec


if __name__ == "__main__":
  main()
