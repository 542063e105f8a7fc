"""benchmarks/probe_cost_curve.py at CPU size: the curve and the request paths side by side."""

from __future__ import annotations

import json

from benchmarks import probe_cost_curve


def test_probe_times_each_size_and_each_request_path(tmp_path):
  res = probe_cost_curve.main([
      "--size", "tiny", "--sizes", "16:32:16", "--extra", "24", "--options", "quick",
      "--reps", "2", "--rounds", "2", "--ab", "8", "--workers", "2",
      "--ab-variants", "hand,auto16s,auto16s_loaded", "--out", str(tmp_path)])
  assert json.loads((tmp_path / "probe_cost_curve.json").read_text())["ab"]["requests"] == 8
  ms = res["curve"]["ms"]
  assert set(ms) == {"quick"} and set(ms["quick"]) == {16, 24, 32}
  assert all(x > 0 for v in ms.values() for x in v.values())
  ab = res["ab"]
  for name in ("hand", "auto16s", "auto16s_loaded"):
    assert ab[name]["mean_ms"] > 0 and ab[name]["bins_ms"], name
  # The restart-like function loads what the first one stored; the kept / per-call passes ran.
  assert ab["auto16s_loaded_stats"]["loaded_from_store"] >= 1
  assert ab["auto16s_stats"]["compiles"] >= 1
  assert set(ab["executors"]) == {"keep", "perc"}
