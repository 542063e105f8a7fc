"""``benchmarks/probe_input_streams.py``: its DLPack producer (timed on the GPU)."""

from __future__ import annotations

from benchmarks import probe_input_streams


def test_the_producers_capsules_import_as_their_bytes(tmp_path):
  rep = probe_input_streams.main(["--check", "--out", str(tmp_path)])
  assert rep["check"] == {"int32": True, "float32": True, "uint8": True, "bool": True}
  assert (tmp_path / "probe_input_streams.json").exists()
