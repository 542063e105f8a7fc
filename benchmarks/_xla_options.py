"""Named sets of XLA options the GPU benchmarks compare (``--xla-options nocb,...``).

XLA:GPU runs an executable's kernels through CUDA graphs ("command buffers") by default; an
executable whose graph holds many small kernels, or custom calls such as the Mosaic GPU
kernels of ``dynjax.route``, pays that graph's launch (and update) on the host before its
first kernel starts.  These sets turn it off, or keep it for some command kinds only, so the
benchmarks can time one executable both ways in one process (``compile(options)``), or
run a whole child process with a set (:func:`as_flags`, ``XLA_FLAGS``).
"""

from __future__ import annotations

OPTION_SETS: dict[str, dict] = {
    # no CUDA graphs: every kernel launched on its own (XLA's thunk executor)
    "nocb": {"xla_gpu_enable_command_buffer": ""},
    # graphs of fusions and library calls only: custom calls (Mosaic GPU kernels) outside them
    "nocc": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN"},
    # graphs for every op type XLA can put in one, from 1 op up (probe_request_cost.py)
    "cball": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
              "xla_gpu_graph_min_graph_size": 1},
}


def as_flags(options: dict) -> str:
  """``options`` spelled for ``XLA_FLAGS`` (a process-wide setting: every compile of a child)."""
  return " ".join(f"--{name}={value}" for name, value in options.items())


def parse(names: str) -> dict[str, dict]:
  """``"nocb,nocc"`` -> {name: options}; an unknown name is an error naming the known ones."""
  out = {}
  for n in filter(None, (v.strip() for v in names.split(","))):
    if n not in OPTION_SETS:
      raise SystemExit(f"--xla-options: unknown set {n!r}; known: {', '.join(OPTION_SETS)}")
    out[n] = OPTION_SETS[n]
  return out
