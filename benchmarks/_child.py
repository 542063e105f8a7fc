"""The child process of isolated benchmark modes (``--isolate``) and of the restart modes.

``python -m benchmarks._child '<json>'`` rebuilds the run's workload (same seed: the same
requests and weights; the request stream comes from ``DYNJAX_BENCH_STREAM_CACHE`` when the
parent set it), builds one mode and times its cold pass over the whole stream exactly as
:func:`benchmarks._suite.cold_mode` does, then (``steady``) one steady pass.  The last line
of stdout is the mode's JSON record.  Not timed: imports, the data set and the parameters (no
mode of the suite counts those).
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
  payload = json.loads(argv[1])
  from benchmarks import _suite

  raw = payload["config"]
  cfg = _suite.Config(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items()})
  name = payload["mode"]
  counter = _suite.CompileCounter.get()
  wl = _suite.load_workload(cfg)
  ctx = _suite.ModeContext(config=cfg, workload=wl, oracle_indices=[],
                           shared={"cache_dirs": dict(payload.get("cache_dirs") or {})})
  res, mode, done = _suite.cold_mode(name, wl.modes[name], ctx, counter)
  if mode is not None:
    if payload.get("steady"):
      _suite.steady_phase([(res, mode, done)], cfg, wl, counter)
    else:
      res["steady_latency_ms"] = [float("nan")] * len(wl.requests)
    _suite.finish_mode(res, mode, wl, counter.snapshot())
    if not payload.get("steady"):
      del res["steady_latency_ms"]
  res.pop("_indices", None)
  res.pop("name", None)
  print(json.dumps(_suite._jsonable(res)), flush=True)
  os._exit(0)  # background compile threads (tier-1 recompiles) need not finish


if __name__ == "__main__":
  main(sys.argv)
