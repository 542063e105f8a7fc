"""``benchmarks/bench_moe_public.py`` at ``--small`` sizes on CPU: the public-idiom MoE
(``lax.ragged_dot`` experts) runs on length buckets under ``padding="auto"``, exact against
``jax.jit`` at each request's shape, with one compile per bucket and no fallback."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flax")

from benchmarks import bench_moe_public  # noqa: E402


def test_small_bench_buckets_the_public_moe_exactly(tmp_path):
  rep = bench_moe_public.main(["--small", "--requests", "4", "--out", str(tmp_path)])
  assert json.loads((tmp_path / "bench_moe_public.json").read_text()) == rep
  exact, auto, trust = (rep["modes"][m] for m in ("exact", "auto", "trust"))
  assert exact["compiles"] == rep["distinct_lengths"] > len(rep["buckets"])
  for r in (auto, trust):
    assert r["fallbacks"] == []
    assert r["compiles"] == len(rep["buckets"])
    assert r["max_abs_diff_vs_exact"] < 1e-5
    assert r["mean_ms"] > 0 and r["cold_s"] > 0


def test_the_kernels_mode_runs_the_model_as_written_with_the_rewrite(tmp_path):
  rep = bench_moe_public.main(["--small", "--requests", "3", "--modes", "exact,trust+kernels",
                               "--out", str(tmp_path)])
  r = rep["modes"]["trust+kernels"]
  assert r["fallbacks"] == [] and r["compiles"] == len(rep["buckets"])
  assert r["max_abs_diff_vs_exact"] < 1e-5
  with pytest.raises(SystemExit, match="auto/trust\\+kernels"):
    bench_moe_public.main(["--small", "--modes", "exact+kernels"])


def test_probe_ragged_dot_reports_values_kernel_and_times(tmp_path):
  from benchmarks import probe_ragged_dot

  rep = probe_ragged_dot.main(["--rows", "32,48", "--k", "16", "--n", "32", "--groups", "4",
                               "--out", str(tmp_path)])
  assert json.loads((tmp_path / "probe_ragged_dot.json").read_text()) == rep
  for rec in rep["rows"].values():  # CPU: route.ragged_dot is lax.ragged_dot
    assert rec["max_abs_diff"] == 0 and rec["mosaic_gpu_custom_calls"] == 0
    assert sum(rec["sizes"]) in (32, 48) and rec["route_ms"] > 0 and rec["lax_ms"] > 0
    assert rec["grad_max_rel_diff"] == 0 and rec["route_grad_ms"] > 0
