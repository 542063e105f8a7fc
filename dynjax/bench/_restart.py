"""The child process of the ``dynjax_restart*`` benchmark modes: a restarted server.

``python -m dynjax.bench._restart '<json>'`` rebuilds the run's workload (same seed: the same
requests and weights), builds the serving mode on the given ``cache_dir`` and times its cold
pass over the whole stream, as :func:`dynjax.bench._suite.cold_mode` times every mode.  The last
line of stdout is the JSON record.  Not timed: imports, the data set and the parameters (no mode
of the suite counts those).
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
  payload = json.loads(argv[1])
  from dynjax.bench import _suite

  raw = payload["config"]
  cfg = _suite.Config(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items()})
  mode = payload["mode"]
  counter = _suite.CompileCounter.get()
  wl = _suite.load_workload(cfg)
  ctx = _suite.ModeContext(config=cfg, workload=wl, oracle_indices=[],
                           shared={"restart_cache": {mode: payload["cache_dir"]}})
  res, m, _ = _suite.cold_mode(mode, wl.modes[mode], ctx, counter)
  if m is not None and m.stats is not None:
    res["stats"] = _suite._jsonable(m.stats())
  keep = ("total_s", "compiles", "persistent_cache_hits", "compile_seconds_monitored", "stats",
          "pass1_latency_ms", "build_s", "error")
  print(json.dumps({k: res[k] for k in keep if k in res}), flush=True)
  os._exit(0)  # background compile threads (tier-1 recompiles) need not finish


if __name__ == "__main__":
  main(sys.argv)
