"""The examples run (with small streams) and say what dynjax did next to jax.jit."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  path = os.path.join(ROOT, "examples", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_bert_serving(capsys):
  pytest.importorskip("flax")
  res = _load("bert_serving").main(["--requests", "12", "--max_len", "64", "--check", "2"])
  out = capsys.readouterr().out
  assert "dynjax :" in out and "jax.jit: would compile" in out
  assert res["compiles"] == len(res["warmup"]["buckets"]) == 3  # t in {16, 32, 64}
  assert res["checked"] == 2 and res["distinct_shapes"] >= 3


def test_lstm_classifier(capsys):
  res = _load("lstm_classifier").main(["--requests", "24", "--max_len", "64"])
  out = capsys.readouterr().out
  assert "dynjax :" in out and "jax.jit: would compile" in out
  assert 1 <= res["compiles"] <= 6 and res["checked"] >= 1
