"""benchmarks/probe_list_cpu.py without a GPU: one mode's record in-process, bad modes."""

from __future__ import annotations

import pytest

from benchmarks import probe_list_cpu


def test_a_child_records_the_lists_wall_cpu_wait_and_collector_time():
  rec = probe_list_cpu.child("bare", "tiny")
  assert rec["mode"] == "bare"
  assert rec["list_wall_s"] > 0 and rec["list_main_cpu_s"] > 0 and rec["list_gc_s"] >= 0
  # One thread's CPU never exceeds the wall time (the marks round to 0.1 ms).
  assert rec["list_main_cpu_s"] <= rec["list_wall_s"] + 2e-3
  assert rec["list_gc_s"] <= rec["list_wall_s"] + 2e-3
  assert rec["list_wait_s"] == pytest.approx(rec["list_wall_s"] - rec["list_main_cpu_s"],
                                             abs=2e-3)


def test_unknown_modes_are_named():
  with pytest.raises(SystemExit, match=r"unknown \['cuda'\]; choose from bare, torch, jax"):
    probe_list_cpu.main(["--modes", "bare,cuda"])
