"""benchmarks/probe_device_pad.py at CPU size (the CPU let onto the device route)."""

from __future__ import annotations

from benchmarks import probe_device_pad
from dynjax._config import config
from dynjax.jit import _devpad


def test_probe_times_both_routes_and_restores_the_switches(tmp_path):
  before = config.device_pad, _devpad.PLATFORMS, _devpad.price
  res = probe_device_pad.main(["--quick", "--out", str(tmp_path)])
  assert (config.device_pad, _devpad.PLATFORMS, _devpad.price) == before
  assert (tmp_path / "probe_device_pad.json").exists()
  (part,) = res["parts"]
  assert part["host_trip_ms"] > 0 and part["compile_ms"] > 0 and part["device_call_ms"] > 0
  train, infer = res["train"], res["infer"]
  assert set(train) == set(infer) == {"jax.jit exact", "dynjax host route",
                                      "dynjax device route"}
  assert train["dynjax host route"]["device_pads"]["sites"] == 0
  on = train["dynjax device route"]["device_pads"]
  assert on["sites"] == on["programs"] == 3  # x at each of the 3 row counts
  assert infer["dynjax device route"]["device_pads"]["programs"] == 6  # and the cuts
  assert res["train_grad_max_abs_diff"] < 1e-4
  assert infer["dynjax device route"]["max_abs_diff"] == 0.0
  sh = res["sharded"]
  assert sh["dynjax host route"]["device_pads"]["sites"] == 0
  assert sh["dynjax device route"]["device_pads"]["programs"] == 4  # 2 pads, 2 cuts
