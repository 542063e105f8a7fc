"""Configuration read from ``DYNJAX_*`` environment variables, validated once at import.

| variable              | values                 | effect |
|-----------------------|------------------------|--------|
| DYNJAX_CACHE_DIR      | a directory path       | persistent XLA compilation cache for bucket executables |
| DYNJAX_LOG_COMPILES   | 0 / 1                  | log every bucket compile through ``logging`` (logger "dynjax") |
| DYNJAX_CHECK          | 0 / 1                  | ``check=True`` on every ``dynjax.jit`` function |
| DYNJAX_CHECK_EVERY    | integer >= 1           | with check: compare one call in N against the exact function (default 1) |
| DYNJAX_PROGRESS       | 0 / 1                  | progress bar in ``warmup`` (default 1 when stderr is a terminal) |
| DYNJAX_TIER_UP_AFTER  | integer >= 0           | serving on GPU: full-option recompiles start after N calls since the last quick compile, or at the first 1-second gap in traffic (default 1000) |
| DYNJAX_PRERUN         | 0 / 1                  | GPU: an executable built in the background (warmup, background compile, tier-up, a restart's loads) runs once on zeros before it serves (default 1) |
| DYNJAX_DEVICE_PAD     | 0 / 1                  | device arrays of a shape that keeps coming back are padded (and outputs cut) on the device by a small program each, once their host round trips add up to its compile (default 1; ``jit/_devpad.py``) |
| DYNJAX_PINNED_INPUTS  | 0 / 1                  | on a GPU, padded numpy inputs of >= 2 MiB are written into reused pinned host buffers, then transferred (default 1; ``jit/_placement.py``) |
| DYNJAX_DIRECT_INPUTS  | 0 / 1                  | on a GPU, the numpy inputs of < 2 MiB of a call that returns numpy go to the device by the CUDA driver's copy into kept device arrays, not JAX's per-argument transfer (default 1; ``jit/_cuda.py``) |
| DYNJAX_DIRECT_OUTPUTS | 0 / 1                  | on a GPU, a call that returns numpy gets its results read by the CUDA driver on a stream that waits for them on the device, its executables' outputs in device memory (default 1; else pinned host outputs; ``jit/_cuda.py``) |
| DYNJAX_OUTLINE        | 0 / 1                  | the padding pass pads a block of equations repeated in a row (a model's layers) once a bucket, and JAX lowers it once (default 1; ``bucketing/_outline.py``) |
| DYNJAX_KEEP_TRAFFIC   | 0 / 1                  | with a ``cache_dir``: an ``auto`` policy's traffic (sizes seen, seconds per call) is kept beside a family's executables, and a restart's warm-up and first call plan from it (default 1; ``jit/_traffic.py``) |
| DYNJAX_KERNEL_CACHE   | a directory, or 0      | where ``dynjax.route``'s exported GPU kernels are kept across processes (default ``~/.cache/dynjax/kernels``; ``0`` off); read at each export by ``route._once`` |

Nothing here changes compiled output, so none of it is part of the executable cache key.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from dynjax._errors import SpecError

_BOOLS = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True,
          "off": False, "on": True, "": False}


def _bool(name: str, default: bool) -> bool:
  raw = os.environ.get(name)
  if raw is None:
    return default
  try:
    return _BOOLS[raw.strip().lower()]
  except KeyError:
    raise SpecError(
        f"environment variable {name}={raw!r} is not a boolean; "
        f"use one of {sorted(k for k in _BOOLS if k)}") from None


def _int(name: str, default: int, minimum: int) -> int:
  raw = os.environ.get(name)
  if raw is None or raw.strip() == "":
    return default
  try:
    value = int(raw)
  except ValueError:
    value = minimum - 1
  if value < minimum:
    raise SpecError(f"environment variable {name}={raw!r} must be an integer >= {minimum}")
  return value


@dataclasses.dataclass
class Config:
  cache_dir: str | None
  log_compiles: bool
  check: bool
  check_every: int
  progress: bool
  tier_up_after: int = 1000
  prerun: bool = True
  device_pad: bool = True
  pinned_inputs: bool = True
  direct_inputs: bool = True
  direct_outputs: bool = True
  copy_threads: int = 4
  outline: bool = True
  keep_traffic: bool = True

  @classmethod
  def from_env(cls) -> Config:
    return cls(
        cache_dir=os.environ.get("DYNJAX_CACHE_DIR") or None,
        log_compiles=_bool("DYNJAX_LOG_COMPILES", False),
        check=_bool("DYNJAX_CHECK", False),
        check_every=_int("DYNJAX_CHECK_EVERY", 1, 1),
        progress=_bool("DYNJAX_PROGRESS", sys.stderr.isatty()),
        tier_up_after=_int("DYNJAX_TIER_UP_AFTER", 1000, 0),
        prerun=_bool("DYNJAX_PRERUN", True),
        device_pad=_bool("DYNJAX_DEVICE_PAD", True),
        pinned_inputs=_bool("DYNJAX_PINNED_INPUTS", True),
        direct_inputs=_bool("DYNJAX_DIRECT_INPUTS", True),
        direct_outputs=_bool("DYNJAX_DIRECT_OUTPUTS", True),
        copy_threads=_int("DYNJAX_COPY_THREADS", 4, 1),
        outline=_bool("DYNJAX_OUTLINE", True),
        keep_traffic=_bool("DYNJAX_KEEP_TRAFFIC", True),
    )


config = Config.from_env()
