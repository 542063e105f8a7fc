"""``benchmarks/bench_vision.py`` at ``--small`` sizes on CPU: a Flax ResNet over images of three
sizes, exact under dynjax's buckets (the strided blocks' shape identities), inexact padded to
the largest size by hand."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flax")

from benchmarks import bench_vision  # noqa: E402


def test_small_bench_buckets_a_resnet_exactly(tmp_path):
  rep = bench_vision.main(["--small", "--modes", "jit_exact,dynjax,pad_max",
                           "--out", str(tmp_path)])
  assert json.loads((tmp_path / "bench_vision.json").read_text()) == json.loads(
      json.dumps(rep))
  modes = rep["modes"]
  assert modes["jit_exact"]["compiles"] == len(rep["sizes"]) == 3
  dj = modes["dynjax"]
  assert dj["fallbacks"] == [] and dj["exact_calls"] == 0
  assert dj["compiles"] == len(rep["buckets"]) == len(dj["per_bucket_calls"])
  assert dj["max_rel_err_vs_exact"] < 1e-5
  assert modes["pad_max"]["max_rel_err_vs_exact"] > 1e-2  # the zeros change the answer
