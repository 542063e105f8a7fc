"""``benchmarks/probe_moe_call.py``: the e2e MoE encoder's call paths (timed on the GPU)."""

from __future__ import annotations

import json

from benchmarks import probe_moe_call


def test_small_probe_times_every_call_path_and_each_returns_jax_jits_result(tmp_path):
  rep = probe_moe_call.main(["--small", "--out", str(tmp_path), "--t", "16", "--models",
                             "none,grouped", "--n", "8", "--rounds", "2"])
  res = rep["results"]["16"]
  assert set(res) == {"none", "grouped"}
  for r in res.values():
    assert set(r["median_us"]) == set(probe_moe_call.ROWS)
    assert all(us > 0 for us in r["median_us"].values())
    # every path's output is jax.jit's (float32 params cast once vs bfloat16 weights: equal
    # values, the same executable's arithmetic up to XLA's fusion)
    assert max(r["max_abs_diff"].values()) < 1e-2, r["max_abs_diff"]
  assert json.loads((tmp_path / "probe_moe_call.json").read_text())["results"]["16"]
