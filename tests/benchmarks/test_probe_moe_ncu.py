"""``benchmarks/probe_moe_ncu.py`` on CPU: its cases build (the hopper kernel's XLA stand-in)
and its summary reads ncu's ``--csv --page details`` output, ncu's own log lines among it."""

from __future__ import annotations

import jax
import pytest

from benchmarks import probe_moe_ncu
from dynjax.route import _hopper

_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
         '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
         '"Metric Value"\n')


def _row(kid, kernel, section, name, unit, value):
  return (f'"{kid}","1","python3","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0",'
          f'"9.0","{section}","{name}","{unit}","{value}"\n')


def test_summary_takes_each_kernels_figures_in_their_units(tmp_path, capsys):
  path = tmp_path / "ncu_gemm1.csv"
  path.write_text(
      "==PROF== Connected to process 1\ncase gemm1:uniform64: hopper ...\n" + _HEAD
      + _row(0, "mosaic_kernel", "GPU Speed Of Light Throughput", "Duration", "ns", "212,896")
      + _row(0, "mosaic_kernel", "GPU Speed Of Light Throughput", "Memory Throughput", "%",
             "64.91")
      # the same name in another section, in bytes a second: not the percentage
      + _row(0, "mosaic_kernel", "Memory Workload Analysis", "Memory Throughput", "byte/s",
             "3,122,947,241,845.78")
      + _row(0, "mosaic_kernel", "Memory Workload Analysis", "Local Memory Spilling Requests",
             "", "199,296")
      + _row(1, "cublas", "GPU Speed Of Light Throughput", "Duration", "ms", "0.15")
      + _row(1, "cublas", "GPU Speed Of Light Throughput", "L2 Cache Throughput", "%", "94.25"))
  rows = probe_moe_ncu.summarize([str(path)])
  assert rows == [
      {"file": "ncu_gemm1.csv", "kernel": "mosaic_kernel", "us": 212.9, "mem %": 64.91,
       "spills": 199296.0},
      {"file": "ncu_gemm1.csv", "kernel": "cublas", "us": 150.0, "L2 %": 94.25}]
  assert "us=212.9" in capsys.readouterr().out


@pytest.mark.parametrize("case,shape", [("gemm1:zipf64", ("rows", 512)),
                                        ("gemm2:uniform8", ("rows", 256)),
                                        ("dense1", (512, 512)), ("capacity1:zipf64", (64, 10, 512))])
def test_cases_build_and_run_with_the_kernel_stand_in(case, shape, monkeypatch):
  # 512 tokens, d=256, ffn=512: the grouped GEMMs over the layer's buffer (its rows in the
  # description), cuBLAS's dense shape, the dropping layer's 64 capacities of ceil(1.25 * 8)
  monkeypatch.setattr(_hopper, "TEST_KERNEL", True)
  args = probe_moe_ncu._parse(["--case", case, "--tokens", "512", "--d", "256", "--ffn", "512"])
  fn, fargs, what = probe_moe_ncu.build(args)
  out = jax.block_until_ready(fn(*fargs))
  if shape[0] == "rows":
    shape = (fargs[0].shape[0], shape[1])
    assert f"buffer {shape[0]} rows" in what
  assert out.shape == shape


def test_a_case_is_asked_for():
  with pytest.raises(SystemExit, match="--case"):
    probe_moe_ncu.main([])
