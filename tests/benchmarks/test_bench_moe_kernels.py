"""``benchmarks/bench_moe_kernels.py`` end to end at ``--small`` sizes on CPU (Mosaic GPU stand-ins):
the parts a device call runs keep working, and what cannot run here says why."""

from __future__ import annotations

from benchmarks import bench_moe_kernels
from dynjax.route import _mgpu


def test_small_check_and_layer_parts_run_and_report(tmp_path, monkeypatch):
  monkeypatch.setattr(_mgpu, "TEST_KERNELS", _mgpu.TEST_KERNELS)  # --fake-mgpu sets them
  rep = bench_moe_kernels.main([
      "--small", "--fake-mgpu", "--out", str(tmp_path), "--parts", "env,check,layer",
      "--settings", "uniform8", "--k", "1", "--train", "", "--layer-timing", "x4",
      "--layer-kernels", "mgpu,hopper"])
  # mgpu runs through its stand-ins; the hopper kernel has none here and says why.
  assert rep["check"]["gmm_fwd_rel_err"] < 1e-2
  assert "not a GPU" in rep["check"]["gmm_hopper_error"]
  methods = rep["layer"]["uniform8 k=1"]["methods"]
  assert methods["capacity 1.25 (drops tokens)"]["median_ms"] > 0
  assert "median_ms" in methods["grouped mgpu 128x64x128x4x4g4"]
  assert "not a GPU" in methods["grouped hopper 128x64x128x4x4g8"]["error"]
  assert (tmp_path / "bench_moe_kernels.json").exists()
