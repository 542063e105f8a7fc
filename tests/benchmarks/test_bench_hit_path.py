"""benchmarks/bench_hit_path.py on the CPU: the tiny BERT's cases, both padding modes."""

from __future__ import annotations

from benchmarks import bench_hit_path


def test_bert_cases_time_dynjax_beside_aot_and_the_padding_pass_own_executable():
  # The "auto" cases also call the bucket's own executable on padded inputs (its arguments
  # include dynjax's placeholder for an omitted parameter): that call broke once unnoticed.
  out = bench_hit_path.bert_cases("tiny", iters=2)
  assert set(out) == {f"bert-tiny {p} T={t}->{b}" for p in ("trust", "auto")
                      for t, b in ((100, 128), (200, 256))} | {"profile"}
  for key, rec in out.items():
    if key == "profile":
      assert "ncalls" in rec
      continue
    assert rec["aot_us"] > 0 and rec["dynjax_us"] > 0
    assert rec["overhead_us"] == rec["dynjax_us"] - rec["aot_us"]
    assert ("own_bucket_exe_us" in rec) == (" auto " in key)
