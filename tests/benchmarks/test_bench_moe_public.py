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
