"""``benchmarks/bench_moe_kernels.py`` end to end at ``--small`` sizes on CPU (Mosaic GPU stand-ins):
the parts a device call runs keep working, and what cannot run here says why."""

from __future__ import annotations

import jax
import pytest

from benchmarks import bench_moe_kernels
from dynjax.route import _mgpu


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU smoke run (stand-ins, "
                    "what cannot run here): on a GPU the device calls run the bench itself")
def test_small_check_and_layer_parts_run_and_report(tmp_path, monkeypatch):
  monkeypatch.setattr(_mgpu, "TEST_KERNELS", _mgpu.TEST_KERNELS)  # --fake-mgpu sets them
  rep = bench_moe_kernels.main([
      "--small", "--fake-mgpu", "--out", str(tmp_path), "--parts", "env,check,layer",
      "--settings", "uniform8", "--k", "1", "--train", "", "--layer-timing", "x4,pipelined",
      "--layer-kernels", "mgpu,hopper", "--xla-options", "nocb"])
  # mgpu runs through its stand-ins; the hopper kernel has none here and says why.
  assert rep["check"]["gmm_fwd_rel_err"] < 1e-2
  assert "not a GPU" in rep["check"]["gmm_hopper_error"]
  methods = rep["layer"]["uniform8 k=1"]["methods"]
  assert methods["capacity 1.25 (drops tokens)"]["median_ms"] > 0
  assert "median_ms" in methods["grouped mgpu 128x64x128x4x4g4"]
  assert "not a GPU" in methods["grouped hopper 128x64x128x4x4g8"]["error"]
  # the second timing mode and the XLA option set: tagged rows beside the plain ones
  for tag in (" [nocb]", " <pipelined>", " <pipelined> [nocb]"):
    assert methods["capacity 1.25 (drops tokens)" + tag]["median_ms"] > 0
  pipelined = methods["capacity 1.25 (drops tokens) <pipelined>"]
  assert "first_call_s" not in pipelined
  assert 0 < pipelined["enqueue_ms"] < 10 * pipelined["median_ms"]  # the host's launching
  assert (tmp_path / "bench_moe_kernels.json").exists()


def test_bad_timing_mode_and_option_set_are_named(capsys):
  with pytest.raises(SystemExit):
    bench_moe_kernels.main(["--small", "--fake-mgpu", "--layer-timing", "x4,bogus"])
  assert "['bogus'] not among call, x4, pipelined" in capsys.readouterr().err
  from benchmarks import _xla_options

  with pytest.raises(SystemExit, match="unknown set 'nope'; known: nocb, nocc, cball"):
    _xla_options.parse("nocb,nope")
