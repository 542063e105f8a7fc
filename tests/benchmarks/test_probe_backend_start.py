"""benchmarks/probe_backend_start.py: each phase of a fresh process, in the variant's order."""

from __future__ import annotations

from benchmarks import probe_backend_start as pb


def test_a_variant_times_its_phases_in_its_order_under_the_given_environment(tmp_path):
  out = pb.main(["--reps", "1", "--variants", "backend_first", "--size", "tiny",
                 "--envs", "XLA_PYTHON_CLIENT_PREALLOCATE=false", "--profile", "random key",
                 "--out", str(tmp_path)])
  (rec,) = out["results"]
  assert rec["env"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  assert [p[0] for p in rec["phases"]] == ["import jax", "backend", "import flax+dynjax",
                                           "random key", "eval_shape(init)"]
  assert all(wall >= 0 and cpu >= 0 for _, wall, cpu in rec["phases"])
  assert "random_seed" in rec["profile"]  # the profiled phase's cProfile, by cumulative time
  assert (tmp_path / "probe_backend_start.json").exists()
