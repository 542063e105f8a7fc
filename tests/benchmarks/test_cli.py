"""Smoke tests of ``python -m benchmarks`` with a tiny stream (well under 30 s)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import _suite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_tiny_stream(tmp_path):
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "benchmarks", "lstm", "--size", "tiny", "--requests", "6",
         "--max_len", "64", "--modes", "jit,oracle,pad_max,dynjax_pow2,dynjax_auto,torch_eager",
         "--dispatch_iters", "30", "--out", str(out), "--noprogress"]
  # The suite's cheap-compile settings (tests/conftest.py), without its 8 fake devices.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags),
         "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "x oracle" in proc.stdout and "dynjax_pow2" in proc.stdout
  report = json.loads((out / "lstm.json").read_text())
  if importlib.util.find_spec("matplotlib") is not None:  # the plot is skipped without it
    assert (out / "lstm.png").exists()
  assert report["versions"]["python"] and report["versions"]["jax"]
  by = {m["name"]: m for m in report["modes"]}
  assert by["jit"]["compiles"] == report["stream"]["distinct_shapes"]
  assert by["oracle"]["compiles"] == 0
  assert by["pad_max"]["compiles"] == 1
  assert by["dynjax_pow2"]["compiles"] <= 3  # t buckets 16, 32, 64
  assert abs(by["oracle"]["ratio_vs_oracle"] - 1.0) < 1e-9
  for name in ("jit", "pad_max", "dynjax_pow2", "dynjax_auto"):
    assert by[name]["p50_ms"] > 0 and by[name]["total_s"] > 0
  if "skipped" in by["torch_eager"]:
    assert "torch" in by["torch_eager"]["skipped"]
  assert report["dispatch"]["dynjax_async_us"] > 0


def test_missing_workload_says_not_available():
  cfg = _suite.Config(workload="treelstm", out=None)
  saved = _suite.WORKLOADS["treelstm"]
  _suite.register_workload("treelstm", _suite.WorkloadEntry(
      "x", ("benchmarks._no_such_module",), owner="the VM issue (4)"))
  try:
    with pytest.raises(_suite.WorkloadNotAvailable, match="not available yet"):
      _suite.load_workload(cfg)
  finally:
    _suite.register_workload("treelstm", saved)
  with pytest.raises(_suite.WorkloadNotAvailable, match="unknown workload 'nope'"):
    _suite.load_workload(_suite.Config(workload="nope"))
