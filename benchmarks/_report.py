"""Writing a benchmark's JSON report (the one helper every script's ``--out`` goes through), and
the summary line of a mode served over a request stream."""

from __future__ import annotations

import json
import os
import time


def write_json(out_dir: str | None, name: str, data, **dump_kw) -> str | None:
  """Writes ``data`` to ``out_dir/name`` (folder created; ``json.dump`` with ``indent=1`` unless
  ``dump_kw`` says otherwise) and returns the path; nothing where ``out_dir`` is empty."""
  if not out_dir:
    return None
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, name)
  with open(path, "w") as fh:
    json.dump(data, fh, **{"indent": 1, **dump_kw})
  return path


def mode_line(mode: str, rec: dict, width: int = 6) -> str:
  """One mode of a served stream: cold pass, compiles, steady mean / median, and where the
  record has them the largest difference from the exact mode and the fallbacks."""
  return (f"  {mode:{width}s} cold {rec['cold_s']:7.2f} s  compiles {rec['compiles']:3d}  "
          f"steady mean {rec['mean_ms']:8.3f} ms  p50 {rec['median_ms']:8.3f}"
          + (f"  max |diff| vs exact {rec['max_abs_diff_vs_exact']:.2e}"
             if "max_abs_diff_vs_exact" in rec else "")
          + (f"  fallbacks {len(rec['fallbacks'])}" if "fallbacks" in rec else ""))


def turn_medians(fns: dict, args_of, iters: int) -> dict:
  """Median milliseconds of each of ``fns`` (name -> function), called on ``args_of(name)``,
  each warmed once, then ``iters`` turns in which every function runs once (phases of the
  host land on all alike)."""
  import time

  import jax
  import numpy as np

  for name, f in fns.items():
    jax.block_until_ready(f(*args_of(name)))
  ts = {name: [] for name in fns}
  for _ in range(iters):
    for name, f in fns.items():
      t1 = time.perf_counter()
      jax.block_until_ready(f(*args_of(name)))
      ts[name].append(time.perf_counter() - t1)
  return {name: float(np.median(v)) * 1e3 for name, v in ts.items()}


def short_reason(reason: str, width: int = 200) -> str:
  """A fallback reason on one table line: dynjax's advice and JAX's own explanation cut."""
  text = reason.replace("\n", " ")
  for cut in ("The function runs unpadded", "This error arises"):
    text = text.split(cut)[0]
  return text.replace("the padding pass has no exact rule: ", "")[:width]


def median_ms(fn, calls: int) -> float:
  """Median milliseconds of ``calls`` calls of ``fn()`` (each one timed alone)."""
  ts = []
  for _ in range(calls):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  ts.sort()
  return ts[len(ts) // 2] * 1e3
