"""Shared fixtures: a jax.monitoring compile counter, x64 off, deterministic hypothesis.

Compiles dominate the suite's time on the 2-core CI box (~70% of its CPU time), so XLA's
optimisation passes are off (``jax_disable_most_optimizations``: about half the compile time)
and, on jaxlib 0.10, XLA:CPU uses its elemental emitters (``_xla_flags``: ~4x faster
compiles again).  Every exactness test
compares dynjax with ``jax.jit`` under the same setting, and the padding pass works on jaxprs,
before XLA.  ``DYNJAX_TEST_OPTIMIZE=1`` runs the suite with XLA's defaults instead.
Fake CPU devices (``DYNJAX_TEST_DEVICES=8``) only where asked: tests/jit/test_sharding.py needs
8 and jax fixes the device count at start-up, so tests/jit/test_sharding_process.py runs that
module in its own 8-device process; in every other process the devices would cost the tests
~13% more CPU time (measured on tests/jit/test_jit.py -k trust_matches: 41 vs 36 user-seconds).
"""

from __future__ import annotations

import os
import tempfile


def _xla_flags() -> str:
  devices = os.environ.get("DYNJAX_TEST_DEVICES")
  flags = [f"--xla_force_host_platform_device_count={int(devices)}"] if devices else []
  try:
    from importlib.metadata import version

    major_minor = tuple(int(p) for p in version("jaxlib").split(".")[:2])
  except Exception:  # noqa: BLE001 - unknown jaxlib: only the flag every version knows
    major_minor = ()
  if major_minor == (0, 10):  # flags this version knows (XLA aborts on unknown flags;
    # jaxlib 0.11 no longer has the first one)
    # XLA:CPU's MLIR fusion emitters are most of a compile on this suite's small programs;
    # the elemental emitters compile the same programs ~4x faster, and one codegen split
    # saves another third of the CPU time (measured on a Flax block's gradient, 10 shapes:
    # 7.2 -> 1.2 CPU-seconds).
    flags += ["--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"]
  elif major_minor == (0, 11):
    flags += ["--xla_cpu_parallel_codegen_split_count=1"]
  return " ".join(flags)


os.environ.setdefault("XLA_FLAGS", _xla_flags())
# Exactness tests compare padded and exact runs: on GPU, TF32 matmuls differ by shape.  The
# environment variable carries this to the tests' subprocesses (jax.config below: this one).
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# No route kernel kept on disk across test processes (a test that patches a kernel's code
# without changing its key would otherwise load another run's kernel); test_once turns it on.
os.environ["DYNJAX_KERNEL_CACHE"] = "0"
# The stdlib corpus (examples/data.py) parsed once for the whole run, not once per worker and
# per benchmark child process (~10 s each on 2 cores).
os.environ.setdefault(
  "DYNJAX_BENCH_STREAM_CACHE",
  os.path.join(
    tempfile.gettempdir(), f"dynjax-test-corpus-{os.getuid() if hasattr(os, 'getuid') else 0}"
  ),
)

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Exactness tests compare padded and exact runs: on GPU, TF32 matmuls differ by shape.
jax.config.update("jax_default_matmul_precision", "highest")
if os.environ.get("DYNJAX_TEST_OPTIMIZE", "") not in ("1", "true"):
  jax.config.update("jax_disable_most_optimizations", True)

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("ci")

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Counts XLA backend compiles through jax.monitoring (not through dynjax's own counters)."""

  def __init__(self):
    self.count = 0

  def __call__(self, event, duration, **_):
    if event == _COMPILE_EVENT:
      self.count += 1


_counter = CompileCounter()
jax.monitoring.register_event_duration_secs_listener(_counter)


@pytest.fixture(autouse=True)
def _own_background_compiles():
  """A test's background compiles end with it: the schedulers it started are closed (queued
  jobs dropped) and their running jobs finish before the next test, so that no compile of
  one test lands in another's count (a tier-up queued under a patched ``on_gpu`` ran in a
  later test once its traffic gap had passed)."""
  from dynjax.jit import _scheduler

  before = set(_scheduler.LIVE)
  yield
  mine = [s for s in list(_scheduler.LIVE) if s not in before]
  for sched in mine:
    sched.close()
  for sched in mine:
    sched.wait_idle(timeout=60)


@pytest.fixture
def compiles():
  """``compiles()`` returns the number of backend compiles since the test started (after
  the background compiles an earlier test left running have finished: they are not its)."""
  from dynjax.jit import _scheduler

  for sched in list(_scheduler.LIVE):
    sched.wait_idle(timeout=60)
  start = _counter.count
  return lambda: _counter.count - start


# -- tiers: ``make test`` runs the tests not marked ``slow`` (tests/_slow.py lists them) -------


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "slow: a test of the slow tier (tests/_slow.py); make test-slow runs them"
  )


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
  from tests import _slow

  seen = set()
  for item in items:
    module = item.nodeid.split("::")[0]
    if item.nodeid in _slow.TESTS or module in _slow.MODULES:
      item.add_marker(pytest.mark.slow)
      seen.add(item.nodeid)
  collected = {item.nodeid.split("::")[0] for item in items}
  gone = sorted(n for n in _slow.TESTS if n.split("::")[0] in collected and n not in seen)
  by_id = any("::" in str(a) for a in config.args)  # a run of chosen ids: not whole modules
  if gone and not (by_id or config.option.keyword or config.option.deselect):
    raise pytest.UsageError(
      "tests/_slow.py lists tests that their modules no longer have (renamed or removed?): "
      + ", ".join(gone)
      + ". Update tests/_slow.py: move each entry to the test's new id, or delete it."
    )
