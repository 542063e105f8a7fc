"""First runs of built executables, on zero inputs, before a request needs them (GPU).

The first run of an executable on a GPU costs more than the ones after it: JAX's first-call
path (the C++ fast path has no entry yet) and CUDA's lazy module loading (each kernel's module
loads at its first launch).  On the H100 (jax 0.11.2, BERT-base, 16 stored buckets; cProfile of
a restart, serve_fresh run 18) each loaded executable's first run took ~22 ms more than its
second: 0.37 s of the restart's first 1,000 requests, paid by requests.  A build nobody waits
for (a warmup, a value-ordered background compile, a tier-up, the stored loads of a restart
other than the call's own bucket) now runs its executable once on zeros before the executable
serves, so that cost lands on a compile worker.

Skipped, with the reason counted in ``stats()["preruns"]``: ``DYNJAX_PRERUN=0`` ("off"),
platforms other than GPU (a CPU executable's first run costs ~ms: ``PLATFORMS``), functions
with effects (a ``jax.debug.print`` or callback must not run on data nobody sent), donated
arguments, extended dtypes (PRNG keys), functions whose executables call cuDNN ("cuDNN": bf16
BERT-base with ``attention="cudnn"`` on the H200, sessions 36-37: both SIGSEGV stacks recorded,
of a cold process and of a restart, had a worker in a prerun's ``device_put``, and the one
hang, a cold process stuck for good in its weights' upload, began as a prerun did; the first
request runs them, as under plain JAX), and zero inputs of more than ``MAX_BYTES`` (one buffer
per distinct shape, dtype and sharding: ~110 MB for BERT-base's float32 parameters, whose 440
MB repeat a few shapes). The executable cache's build seconds include the first run (H100,
BERT-base: 0.79 s for 16 buckets, ~50 ms each with the zeros' copy).
"""

from __future__ import annotations

import collections
import threading
import time

import jax
import numpy as np

from dynjax._config import config

PLATFORMS = ("gpu",)  # where an executable's first run costs enough to move (tests add "cpu")
MAX_BYTES = 1 << 30  # more zeros than this: skipped (a large model's weights)


class Prerunner:
  """Runs built executables once on zeros; counts what it ran and what it skipped."""

  def __init__(self):
    self._lock = threading.Lock()
    self.runs = 0
    self.seconds = 0.0
    self.skipped: collections.Counter = collections.Counter()

  def describe(self) -> dict:
    with self._lock:
      return {"runs": self.runs, "seconds": self.seconds, "skipped": dict(self.skipped)}

  def skip(self, why: str) -> None:
    with self._lock:
      self.skipped[why] += 1

  def run(self, fam, bkey, entry) -> bool:
    """Runs ``entry``'s executable once on zero inputs (true sizes = the bucket's own under
    ``padding="auto"``); False, with the reason counted, when it must not or need not."""
    exe = entry.exe
    args, why = _zero_args(fam, bkey, exe)
    if why is not None:
      self.skip(why)
      return False
    t0 = time.perf_counter()
    try:
      jax.block_until_ready(exe(*args[0], **args[1]))
    except Exception as e:  # noqa: BLE001 - the build stands; its first request runs it
      with self._lock:
        self.skipped[f"failed ({type(e).__name__})"] += 1
      return False
    with self._lock:
      self.runs += 1
      self.seconds += time.perf_counter() - t0
    return True


def _zero_args(fam, bkey, exe):
  """((args, kwargs) of device zeros, None), or (None, why ``exe`` of ``fam`` is not run
  ahead)."""
  if not config.prerun:
    return None, "off"
  try:
    infos, tree = jax.tree.flatten(exe.args_info)
    shardings = jax.tree.leaves(exe.input_shardings)
  except Exception:  # noqa: BLE001 - an executable without the metadata is not run ahead
    return None, "no input metadata"
  if len(infos) != len(shardings):
    return None, "no input metadata"
  platforms = {d.platform for s in shardings for d in s.device_set}
  if not platforms or not platforms <= set(PLATFORMS):
    return None, "platform"
  if fam.jaxpr is None or fam.jaxpr.effects:
    return None, "effects"
  if any(getattr(a, "donated", False) for a in infos):
    return None, "donated arguments"
  zeros: dict = {}  # one buffer per (shape, dtype, sharding): arguments may share it
  nbytes = 0
  leaves = []
  for i, (info, sharding) in enumerate(zip(infos, shardings, strict=True)):
    shape, dtype = tuple(info.shape), info.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      return None, "extended dtype"
    if i == 0 and fam.mode == "auto":  # the true-sizes vector: the bucket's own sizes
      leaves.append(jax.device_put(np.asarray(bkey, dtype).reshape(shape), sharding))
      continue
    key = (shape, np.dtype(dtype), sharding)
    if key not in zeros:
      nbytes += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
      if nbytes > MAX_BYTES:
        return None, "too large"
      zeros[key] = jax.device_put(np.zeros(shape, dtype), sharding)
    leaves.append(zeros[key])
  return jax.tree.unflatten(tree, leaves), None
