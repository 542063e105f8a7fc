"""benchmarks/probe_cudnn_hang.py at CPU size: a variant's process runs its rounds and reports
them (the GPU's cuDNN variants fail to compile on the CPU and say so per round)."""

from __future__ import annotations

import json

import pytest

from benchmarks import probe_cudnn_hang as probe


def test_each_variant_runs_its_rounds_in_its_own_process(tmp_path):
  recs = probe.main(["--variants", "xla,cudnn", "--rounds", "2", "--mb", "4", "--out",
                     str(tmp_path)])
  by = {r["variant"]: r for r in recs}
  assert by["xla"]["hang_round"] is None and by["xla"]["rc"] == 0
  assert [r["t"] for r in by["xla"]["rounds"]] == [64, 72]
  assert all(r["error"] is None for r in by["xla"]["rounds"])
  assert json.load(open(tmp_path / "probe_cudnn_hang.json")) == recs
  with pytest.raises(SystemExit, match="unknown variant"):
    probe.main(["--variants", "nope"])
