"""Does XLA:GPU hang when cuDNN attention compiles in one thread while another copies to the
device?  Plain JAX, no dynjax (session 37).

What dynjax saw (H200, jax 0.11.2, bf16 BERT-base with ``attention="cudnn"``): a cold serving
process whose start-up warm-up compiled buckets in a background thread while the main thread
uploaded the weights hung in ``jax.block_until_ready(weights)`` for good (1 process in 3; every
compile worker idle, every compile finished); session 36 saw SIGSEGVs in the same phase.

Each variant runs in its own process: a worker thread compiles (and runs once) a small bf16
encoder with ``jax.nn.dot_product_attention(implementation=...)`` at a new sequence length per
round, while the main thread uploads ~``--mb`` MB of host arrays in many pieces and waits for
them.  A round past ``--round_timeout`` seconds is a hang: every thread's Python stack is
printed and the process exits 3.  Prints one JSON line per variant (rounds done, hang or not,
seconds).  Usage::

    python -m benchmarks.probe_cudnn_hang --out $OUT --variants cudnn,cudnn_at0,xla
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {  # name: (attention implementation, compiler options of every compile)
    "cudnn": ("cudnn", {}),
    "cudnn_at1": ("cudnn", {"xla_gpu_autotune_level": 1}),
    "cudnn_at0": ("cudnn", {"xla_gpu_autotune_level": 0}),
    "xla": ("xla", {}),
}


def _child(args) -> dict:
  import faulthandler
  import threading

  import jax
  import jax.numpy as jnp
  import numpy as np

  impl, opts = VARIANTS[args.child]
  d, h, layers = 256, 4, 4
  rng = np.random.default_rng(0)

  def w(*shape):
    return jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)

  params = [dict(q=w(d, d), k=w(d, d), v=w(d, d), o=w(d, d), a=w(d, 4 * d), b=w(4 * d, d))
            for _ in range(layers)]

  def model(params, x, lens):
    b, t, _ = x.shape
    for p in params:
      q, k, v = ((x @ p[m]).reshape(b, t, h, d // h) for m in "qkv")
      a = jax.nn.dot_product_attention(q, k, v,
                                       key_value_seq_lengths=lens, implementation=impl)
      x = x + a.reshape(b, t, d) @ p["o"]
      x = x + jax.nn.gelu(x @ p["a"]) @ p["b"]
    return x

  host = [rng.standard_normal((1024, 1024), dtype=np.float32).astype(jnp.bfloat16)
          for _ in range(max(1, args.mb // 2))]  # 2 MB each
  rounds, t_start = [], time.perf_counter()
  for i in range(args.rounds):
    t = 64 + 8 * i  # a new shape: a new compile
    x = jnp.zeros((8, t, d), jnp.bfloat16)
    lens = jnp.full((8,), t, jnp.int32)
    err: list = []

    def build(t=t, x=x, lens=lens, err=err):
      try:
        exe = jax.jit(model).lower(params, x, lens).compile(opts or None)
        jax.block_until_ready(exe(params, x, lens))
      except Exception as e:  # noqa: BLE001 - reported
        err.append(repr(e)[:300])

    t0 = time.perf_counter()
    th = threading.Thread(target=build, name=f"compile-{t}")
    th.start()
    done = threading.Event()

    def upload(done=done):
      jax.block_until_ready(jax.device_put(host))
      done.set()

    up = threading.Thread(target=upload, daemon=True, name="upload")
    up.start()
    if not done.wait(args.round_timeout):
      faulthandler.dump_traceback(all_threads=True)
      print("RESULT " + json.dumps({"variant": args.child, "hang_round": i, "t": t,
                                    "rounds": rounds}), flush=True)
      os._exit(3)
    th.join(args.round_timeout)
    if th.is_alive():
      faulthandler.dump_traceback(all_threads=True)
      print("RESULT " + json.dumps({"variant": args.child, "hang_round": i, "t": t,
                                    "in": "compile", "rounds": rounds}), flush=True)
      os._exit(3)
    rounds.append({"t": t, "s": round(time.perf_counter() - t0, 3), "error": err or None})
  return {"variant": args.child, "hang_round": None, "rounds": rounds,
          "seconds": round(time.perf_counter() - t_start, 2), "jax": jax.__version__}


def main(argv=None) -> list:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variants", default="cudnn,cudnn_at0,xla")
  p.add_argument("--repeat", type=int, default=1, help="processes per variant")
  p.add_argument("--rounds", type=int, default=12)
  p.add_argument("--mb", type=int, default=220, help="MB uploaded beside each compile")
  p.add_argument("--round_timeout", type=float, default=25.0)
  p.add_argument("--timeout", type=float, default=120.0, help="seconds per process")
  p.add_argument("--out", default=None)
  p.add_argument("--child", default=None)
  args = p.parse_args(argv)
  if args.child:
    print("RESULT " + json.dumps(_child(args)), flush=True)
    os._exit(0)
  results = []
  for name in [v for v in args.variants.split(",") if v] * args.repeat:
    if name not in VARIANTS:
      raise SystemExit(f"probe_cudnn_hang: unknown variant {name!r}; known: {list(VARIANTS)}")
    cmd = [sys.executable, "-m", "benchmarks.probe_cudnn_hang", "--child", name,
           "--rounds", str(args.rounds), "--mb", str(args.mb),
           "--round_timeout", str(args.round_timeout)]
    try:
      got = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
      lines = [ln for ln in got.stdout.splitlines() if ln.startswith("RESULT ")]
      rec = json.loads(lines[-1][7:]) if lines else {"variant": name,
                                                     "error": f"rc={got.returncode}"}
      rec["rc"], rec["stderr_tail"] = got.returncode, got.stderr[-3000:]
    except subprocess.TimeoutExpired as e:
      rec = {"variant": name, "error": f"timed out after {args.timeout:.0f} s",
             "stderr_tail": (e.stderr or b"")[-3000:].decode(errors="replace")
             if isinstance(e.stderr, bytes) else (e.stderr or "")[-3000:]}
    results.append(rec)
    brief = {k: rec.get(k) for k in ("variant", "hang_round", "seconds", "error", "rc")}
    print(json.dumps(brief), flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_cudnn_hang.json"), "w") as fh:
      json.dump(results, fh, indent=1)
  return results


if __name__ == "__main__":
  main()
