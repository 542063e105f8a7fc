"""``python -m benchmarks WORKLOAD [flags]``: the benchmark suite on real data.

Workloads: bert (Flax Linen, --size tiny|small|base), encoder (jax.numpy), lstm, and, once their
issues land, decode, treelstm (control-flow VM) and moe (routing).  Examples:

  python -m benchmarks bert --size tiny --quick          # ~1 min on 2 CPU cores (make demo)
  python -m benchmarks bert --size base --requests 1000 --jit_budget_s 240 \
      --oracle_max_shapes 48 --out bench_out               # the GPU run
  python -m benchmarks lstm --modes jit,oracle,dynjax_pow2
  python -m benchmarks moe -- --its-own-flags            # a stand-alone script

Writes a table to stdout, ``<out>/<workload>.json`` and ``<out>/<workload>.png``.
"""

from __future__ import annotations

import sys

from absl import app, flags

from benchmarks import _suite

_SIZE = flags.DEFINE_string("size", "tiny", "model size: tiny, small or base")
_REQUESTS = flags.DEFINE_integer(
    "requests", None, "requests in the stream (default 1000 on GPU/TPU, 200 on CPU, 48 --quick)")
_MAX_LEN = flags.DEFINE_integer("max_len", 512, "lengths are clipped to this; largest bucket")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per request")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the request stream and the weights")
_MODES = flags.DEFINE_list("modes", list(_suite.DEFAULT_MODES),
                           f"modes to compare, in order; known: {list(_suite.DEFAULT_MODES)}")
_SYNC = flags.DEFINE_boolean(
    "device_sync", True, "convert every result to numpy (a sync per request); off: results stay "
    "on the device and only the end of each pass is synced (latencies are then dispatch times)")
_CACHE = flags.DEFINE_string(
    "persistent_cache_dir", None, "persistent compilation cache for the dynjax modes (a second "
    "run then compiles nothing)")
_OUT = flags.DEFINE_string("out", "bench_out", "directory for the JSON and PNG ('' for none)")
_PADDING = flags.DEFINE_enum("padding", "trust", ["auto", "trust", "exact"],
                             "dynjax padding mode (the models mask their own padding)")
_STEADY = flags.DEFINE_integer("steady_passes", 1,
                               "warm passes over the stream; the fastest time per request counts")
_JIT_BUDGET = flags.DEFINE_float(
    "jit_budget_s", None, "stop the jit mode after this many seconds and extrapolate the rest")
_ORACLE_SHAPES = flags.DEFINE_integer(
    "oracle_max_shapes", 0, "compile the oracle for at most this many distinct shapes (0: all)")
_ASYNC = flags.DEFINE_boolean(
    "async_compile", False, "dynjax modes: serve a request on a larger compiled bucket while its "
    "own bucket compiles in the background")
_DISPATCH = flags.DEFINE_integer("dispatch_iters", None,
                                 "calls per loop of the dispatch-overhead measurement (0: skip)")
_PLOT = flags.DEFINE_boolean("plot", True, "write the PNG plot")
_PROGRESS = flags.DEFINE_boolean("progress", True, "progress bars on stderr")
_ISOLATE = flags.DEFINE_list(
    "isolate", None, "modes that run start to end in a fresh process each (XLA's in-process "
    "caches, e.g. GPU autotuning results, would make a mode run after another compile faster "
    "than a user's fresh process); default on GPU/TPU: every dynjax_*, pad_max and torch_* "
    "mode; on CPU: none ('' for none)")
_QUICK = flags.DEFINE_boolean("quick", False, "a short run for a CPU: 48 requests, fewer "
                              "dispatch iterations (about a minute on 2 cores for bert tiny)")


def config_from_flags(argv: list[str]) -> _suite.Config:
  import jax

  rest = argv[1:]
  if not rest:
    raise app.UsageError(f"give a workload: one of {sorted(_suite.WORKLOADS)}")
  workload, extra = rest[0], tuple(rest[1:])
  accel = jax.default_backend() != "cpu"
  requests = _REQUESTS.value
  if requests is None:
    requests = 48 if _QUICK.value else (1000 if accel else 200)
  isolate = _ISOLATE.value
  if isolate is None:
    isolate = [m for m in _MODES.value
               if m.startswith(("dynjax_pow2", "dynjax_auto", "dynjax_warmup", "dynjax_serve",
                                "pad_max", "torch_"))] if accel else []
  dispatch = _DISPATCH.value
  if dispatch is None:
    dispatch = 300 if _QUICK.value else 2000
  return _suite.Config(
      workload=workload, size=_SIZE.value, requests=requests, max_len=_MAX_LEN.value,
      batch=_BATCH.value, seed=_SEED.value, modes=tuple(_MODES.value),
      device_sync=_SYNC.value, persistent_cache_dir=_CACHE.value or None,
      out=_OUT.value or None, padding=_PADDING.value, steady_passes=_STEADY.value,
      jit_budget_s=_JIT_BUDGET.value, oracle_max_shapes=_ORACLE_SHAPES.value,
      async_compile=_ASYNC.value, dispatch_iters=dispatch, plot=_PLOT.value,
      progress=_PROGRESS.value and sys.stderr.isatty(), quick=_QUICK.value, extra_args=extra,
      isolate=tuple(m for m in isolate if m))


def main(argv: list[str]) -> int:
  cfg = config_from_flags(argv)
  try:
    result = _suite.run(cfg)
  except _suite.WorkloadNotAvailable as e:
    print(str(e), file=sys.stderr)
    return 2
  return result if isinstance(result, int) else 0


def run() -> None:
  app.run(main)


if __name__ == "__main__":
  run()
