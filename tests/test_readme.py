"""The README's code blocks run as written (documentation that cannot drift)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_control_flow_block_runs_and_prints_what_the_readme_says():
  text = README.read_text()
  block = re.search(r"## Control flow in a few lines.*?```python\n(.*?)```", text, re.S).group(1)
  r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  first, second = r.stdout.strip().splitlines()
  assert first == "(40,) 3"
  a, b = eval(second)  # noqa: S307 - our own printed list
  want_a = float(np.tanh(np.tanh(np.tanh(1.0) + np.tanh(2.0)) + np.tanh(3.0)))
  assert abs(a - want_a) < 1e-6 and 0 < b < 1
