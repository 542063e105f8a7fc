"""tests/jit/test_sharding.py in its own process with 8 fake CPU devices.

jax fixes the device count when its backend starts, and 8 fake devices slow every other test
of a process by ~13% (tests/conftest.py), so the suite's processes have one device and the
sharding tests run here, in a child whose conftest asks for 8 (``DYNJAX_TEST_DEVICES``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_sharding_module_passes_on_8_devices_in_its_own_process():
  if jax.device_count() >= 8:
    pytest.skip("this process has 8 devices: test_sharding.py runs in it directly")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the child's conftest sets them
  env["DYNJAX_TEST_DEVICES"] = "8"
  env["JAX_PLATFORMS"] = "cpu"  # 8 fake CPU devices also on a machine with one GPU
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       os.path.join(HERE, "test_sharding.py")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  tail = proc.stdout[-4000:] + proc.stderr[-2000:]
  assert proc.returncode == 0, tail
  summary = proc.stdout.strip().splitlines()[-1]
  passed = re.search(r"(\d+) passed", summary)
  assert passed and int(passed.group(1)) >= 10, summary  # ran, not skipped
  assert "skipped" not in summary and "failed" not in summary, summary
