"""benchmarks/probe_lowering.py on the CPU: a tiny BERT, two buckets, one mode."""

from __future__ import annotations

import json

import jax

from benchmarks import probe_lowering


def test_probe_lowering_times_buckets_beside_the_floor_and_profiles_one(tmp_path):
  rec = probe_lowering.main(["--size", "tiny", "--buckets", "16,32", "--batch", "2",
                             "--tag", "t", "--out", str(tmp_path)])
  assert json.loads((tmp_path / "probe_lowering_t.json").read_text()) == rec
  assert rec["jax"] and rec["backend"] == jax.default_backend() and rec["dynjax"].endswith("dynjax")
  (mode,) = rec["modes"]
  assert mode["attention"] == "xla" and mode["family_trace_seconds"] > 0
  assert set(mode["buckets"]) == {"16", "32"}
  for b in mode["buckets"].values():
    assert b["lower_seconds"] > 0 and b["floor_seconds"] > 0 and b["eqns"] > 10
  assert mode["profiled_bucket"] == 48
  # The padding pass ran inside JAX's trace, and the profile's rows came through.
  stages = mode["profiled_stages"]
  assert stages["padding pass (interpreter inside JAX's trace)"] > 0
  assert stages["StableHLO lowering"] > 0
  assert mode["profile_cumulative"][0].lstrip().startswith("ncalls")
  assert any("interpret" in row for row in mode["profile_cumulative"])
