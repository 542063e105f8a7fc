"""benchmarks/probe_family_export.py on the CPU: a tiny BERT, two buckets."""

from __future__ import annotations

import json

import jax

from benchmarks import probe_family_export


def test_the_probe_times_both_lowerings_per_bucket_and_the_outputs_agree(tmp_path):
  rec = probe_family_export.main(["--size", "tiny", "--buckets", "16,32", "--batch", "2",
                                  "--out", str(tmp_path)])
  assert json.loads((tmp_path / "probe_family_export_tiny.json").read_text()) == rec
  assert rec["backend"] == jax.default_backend() and rec["export_seconds"] > 0
  assert set(rec["buckets"]) == {"16", "32"}
  for b in rec["buckets"].values():
    assert b["direct_lower_seconds"] > 0 and b["call_lower_seconds"] > 0
  assert rec["compile_seconds"]["bucket"] == 16
  assert rec["max_abs_diff"] < 1e-5  # the exported module at t=16 is the same program
