"""``benchmarks/probe_moe_profile.py`` at ``--small`` sizes on CPU (the hopper kernel's XLA
stand-in): both parts run, compare against float32, and write their report."""

from __future__ import annotations

import json

import jax
import pytest

from benchmarks import probe_moe_profile
from dynjax.route import _gmm, _hopper


def test_small_probe_runs_both_parts_and_reports(tmp_path, monkeypatch):
  monkeypatch.setattr(_hopper, "TEST_KERNEL", True)
  for knob in ("APPROX_BF16", "WG_SPLIT", "WGMMA_IN_FLIGHT", "CHAIN_TILES", "CHAIN_MIN_ROWS"):
    monkeypatch.setattr(_hopper, knob, getattr(_hopper, knob))
  monkeypatch.setattr(_gmm, "hopper_floor_rows", lambda groups, tm: 0)  # no 9,088-row buffer
  rep = probe_moe_profile.main([
      "--small", "--out", str(tmp_path), "--parts", "gemms,layers", "--specs", "uniform8:1",
      "--variants", "capacity", "--iters", "1", "--knobs", "0,1,m+w1+t64x64x64x4x4",
      "--no-cublas", "--tokens", "256"])
  gemms = rep["gemms"]["uniform8"]
  for label in ("gemm1+gelu approx0", "gemm1 approx0", "gemm1+gelu approx1",
                "gemm1 m+w1+t64x64x64x4x4"):
    assert gemms[label]["rel_err"] < 1e-2, (label, gemms[label])
    assert gemms[label]["device_us"] > 0
  assert "gemm1 approx1" not in gemms  # approximate math changes only the activation
  assert "multiple of" in gemms["gemm2 approx0"]["error"]  # N=128 at --small: refused, said why
  assert gemms["tiling"]["m+w1+t64x64x64x4x4"].startswith("Tiling(tm=64")
  assert probe_moe_profile._defaults() == probe_moe_profile._DEFAULTS  # knobs set back
  layer = rep["layers"]["uniform8:1"]
  assert set(layer) == {"auto_kernel", "capacity"}
  # --tokens: the buffer of 256 routed rows (--small alone: 512)
  assert gemms["rows"]["approx0"] == _gmm.num_tiles(256, 8, 128) * 128
  assert layer["capacity"]["wall_us"] > 0 and layer["capacity"]["kernels"]
  saved = json.loads((tmp_path / "probe_moe_profile.json").read_text())
  assert set(saved) >= {"jax", "device", "gemms", "layers"}


def test_small_requests_part_profiles_each_model_per_call(tmp_path):
  rep = probe_moe_profile.main([
      "--small", "--out", str(tmp_path), "--parts", "requests", "--request-lengths", "16",
      "--request-models", "none,grouped", "--iters", "1", "--top", "2"])
  res = rep["requests"]["16"]
  assert set(res) == {"none", "grouped"}
  for r in res.values():
    assert r["wall_us"] > 0 and r["device_us"] > 0 and r["kernels"], r
  # Per call, not per layer (the layers part divides by its 4 layers): each call's one
  # annotation counts once.
  counts = {k["name"]: k["count"] for k in res["none"]["kernels"]}
  if jax.default_backend() == "cpu":  # (a GPU's kernels carry their own names)
    # (the compiled stage's call: "PjitFunction(jit(apply))" on jax 0.10.2 and 0.11.2)
    assert counts["probe_call_0"] == 1.0
    assert max(c for n, c in counts.items() if n.startswith("PjitFunction(")) >= 1.0
  assert json.loads((tmp_path / "probe_moe_profile.json").read_text())["requests"]["16"]


def test_requests_part_combine_options_leave_the_default_as_it_was(monkeypatch):
  from dynjax.route import _grouped, _router

  monkeypatch.setattr(_grouped, "COMBINE_APART", True)
  max_paths = _router._ONE_HOT_MAX_PATHS
  seen = []
  monkeypatch.setattr(probe_moe_profile, "profile", lambda *a, **kw: seen.append(
      (_grouped.COMBINE_APART, _router._ONE_HOT_MAX_PATHS)) or {})
  probe_moe_profile.main(["--small", "--parts", "requests", "--request-lengths", "16",
                          "--request-models", "grouped+fused,grouped,grouped+apart,grouped+sort"])
  assert seen == [(False, max_paths), (True, max_paths), (True, max_paths), (True, 0)]
  assert _grouped.COMBINE_APART is True and _router._ONE_HOT_MAX_PATHS == max_paths
  with pytest.raises(SystemExit, match=r"unknown 'dense\+apart'"):
    probe_moe_profile.main(["--small", "--parts", "requests", "--request-lengths", "16",
                            "--request-models", "dense+apart"])
  with pytest.raises(SystemExit, match=r"unknown option \+bogus of 'grouped\+bogus'"):
    probe_moe_profile.main(["--small", "--parts", "requests", "--request-lengths", "16",
                            "--request-models", "grouped+bogus"])
