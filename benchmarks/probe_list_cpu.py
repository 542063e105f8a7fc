"""What a process's runtime costs the Python beside it: issue 18's request list, built alone in
fresh processes that hold different runtimes (issue 18, goal 3).

  python benchmarks/probe_list_cpu.py --rounds 3 --out $OUT

``serve_fresh.py`` found dynjax's main thread spending more CPU than torch eager's on the same
stdlib request list (median +1.0 s over runs 34-36), a restarted dynjax process too.  Here each
mode sets up what its process holds, then builds the list (``examples.data.request_stream``,
1,000 requests of batch 8) and records the list's wall seconds, the main thread's CPU seconds
and the garbage collector's seconds:

* ``bare``: numpy only;
* ``torch``: torch imported, CUDA initialised, BERT-base on the device (as ``torch_eager``);
* ``jax``: jax and flax imported, the backend started, BERT-base's weights on the device;
* ``dynjax_idle``: ``jax`` plus the dynjax function built and its family traced (nothing in
  the background);
* ``dynjax_warm``: ``dynjax_idle`` with ``warmup(background=True)`` started (the
  ``dynjax_pallas_auto16_warm`` start-up of serve_fresh: lowering and compiles beside the
  list).

Modes take turns in each round, each in a fresh process.  Figures: one JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402

MODES = ("bare", "torch", "jax", "dynjax_idle", "dynjax_warm")


def _setup(mode: str, size: str) -> dict:
  import numpy as np

  info: dict = {}
  if mode == "bare":
    return info
  from examples import models

  cfg = models.ENCODER_SIZES[size]
  if mode == "torch":
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models.torch_bert(models.init_encoder_params(cfg, seed=0), cfg, device=str(dev))
    info["torch"] = torch.__version__
    return info
  import jax

  params = jax.device_put({"params": models.init_encoder_params(cfg, seed=0)})
  jax.block_until_ready(params)
  info["jax"] = jax.__version__
  if mode == "jax":
    return info
  import dynjax

  attention = "pallas" if jax.default_backend() == "gpu" else None
  f = dynjax.flax.jit(models.BertEncoder(cfg), dims={"tokens": "b, t", "lengths": "b"},
                      buckets={"t": dynjax.buckets.auto(max_compiles=16, min=16, max=512)},
                      serving=True, attention=attention)
  tokens = jax.ShapeDtypeStruct((8, 512), np.int32)
  lengths = jax.ShapeDtypeStruct((8,), np.int32)
  if mode == "dynjax_idle":
    f.trace(params, tokens, lengths)
  else:
    f.warmup(params, tokens, lengths, background=True)
  info["_keep"] = f
  return info


def child(mode: str, size: str) -> dict:
  from benchmarks.serve_fresh import _Clock  # the same CPU and collector accounting

  t0 = time.perf_counter()
  info = _setup(mode, size)
  setup_s = time.perf_counter() - t0
  from examples import data

  clock = _Clock()
  clock.mark("list_start")
  data.request_stream(1000, batch=8, max_len=512, seed=0, vocab=30522)
  clock.mark("list_end")
  info.pop("_keep", None)
  a, b = clock.work["list_start"], clock.work["list_end"]
  wall = clock.marks["list_end"] - clock.marks["list_start"]
  cpu = b["main_cpu_s"] - a["main_cpu_s"]
  return {"mode": mode, "setup_s": round(setup_s, 3), "list_wall_s": round(wall, 3),
          "list_main_cpu_s": round(cpu, 3), "list_wait_s": round(wall - cpu, 3),
          "list_gc_s": round(b["gc_s"] - a["gc_s"], 3),
          "list_other_threads_cpu_s": round(b["process_cpu_s"] - a["process_cpu_s"] - cpu, 3),
          "busiest_threads": b["busiest_threads"], **info}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--size", default="base")
  ap.add_argument("--timeout", type=float, default=120.0)
  ap.add_argument("--out", default=None)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print("RESULT " + json.dumps(child(args.child, args.size)), flush=True)
    os._exit(0)  # background compiles of dynjax_warm need not finish
  modes = args.modes.split(",")
  unknown = sorted(set(modes) - set(MODES))
  if unknown:
    raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
  rows = []
  for r in range(args.rounds):
    for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # rotate the order
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                             "--size", args.size], capture_output=True, text=True,
                            timeout=args.timeout)
      line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
      row = ({"mode": mode, "error": proc.stderr[-1500:]} if line is None
             else json.loads(line[len("RESULT "):]))
      row["round"] = r + 1
      rows.append(row)
      print(row, flush=True)
  summary = {}
  for mode in modes:
    ok = [x for x in rows if x["mode"] == mode and "error" not in x]
    if ok:
      summary[mode] = {k: round(sorted(x[k] for x in ok)[len(ok) // 2], 3)
                       for k in ("list_wall_s", "list_main_cpu_s", "list_wait_s", "list_gc_s")}
  rec = {"python": sys.version.split()[0], "size": args.size, "rounds": rows,
         "median_by_mode": summary}
  for mode, s in summary.items():
    print(f"{mode:12s} median {s}")
  write_json(args.out, "probe_list_cpu.json", rec)
  return rec


if __name__ == "__main__":
  main()
