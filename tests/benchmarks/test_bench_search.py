"""``benchmarks/bench_search.py`` at ``--small`` sizes on CPU: the public-idiom irregular-series
classifier (``jnp.interp`` and ``jnp.digitize`` into each request's observation times) served
on count buckets under ``padding="auto"``, exact against ``jax.jit`` at each request's shape,
one compile a bucket."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flax")

from benchmarks import bench_search  # noqa: E402


def test_small_bench_buckets_the_irregular_series_model(tmp_path):
  rep = bench_search.main(["--small", "--requests", "4", "--at", "40", "--iters", "2",
                           "--out", str(tmp_path)])
  assert json.loads((tmp_path / "bench_search.json").read_text()) == rep
  modes = rep["modes"]
  assert modes["exact"]["compiles"] == rep["distinct_counts"] > len(rep["buckets"])
  assert modes["auto"]["fallbacks"] == []
  assert modes["auto"]["compiles"] == len(rep["buckets"])
  assert modes["auto"]["max_abs_diff_vs_exact"] < 1e-5
  assert set(rep["at"]["40"]) == {"fwd exact", "fwd auto", "scan exact", "scan auto",
                                  "sort exact", "sort auto"}
