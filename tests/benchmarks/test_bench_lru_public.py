"""``benchmarks/bench_lru_public.py`` at ``--small`` sizes on CPU: the public-idiom LRU
(``jax.lax.associative_scan`` over time) serves and trains on length buckets under
``padding="auto"``, exact against ``jax.jit`` at each request's shape, one compile a bucket."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flax")

from benchmarks import bench_lru_public  # noqa: E402


def test_small_bench_buckets_the_public_lru_and_its_training_step(tmp_path):
  rep = bench_lru_public.main(["--small", "--requests", "3", "--modes",
                               "exact,auto,train-exact,train-auto", "--at", "40",
                               "--iters", "2", "--out", str(tmp_path)])
  assert json.loads((tmp_path / "bench_lru_public.json").read_text()) == rep
  modes = rep["modes"]
  assert modes["exact"]["compiles"] == rep["distinct_lengths"] > len(rep["buckets"])
  for m in ("auto", "train-auto"):
    assert modes[m]["fallbacks"] == [] and modes[m]["exact_calls"] == 0
    assert modes[m]["compiles"] == len(rep["buckets"])
  assert modes["auto"]["max_abs_diff_vs_exact"] < 1e-5
  assert modes["train-auto"]["max_abs_diff_vs_exact"] < 1e-4  # gradients, float32
  assert set(rep["at"]["40"]) == {"fwd exact", "fwd auto", "step exact", "step auto"}
  with pytest.raises(SystemExit, match="unknown"):
    bench_lru_public.main(["--small", "--modes", "exact,turbo"])
