"""benchmarks/probe_gil_holders.py: py-spy's raw samples read back per thread."""

from __future__ import annotations

from benchmarks import probe_gil_holders as pg

RAW = """\
thread (0x7F01): MainThread;<module> (/r/benchmarks/serve_fresh.py:9);parse (/usr/lib/ast.py:50) 70
thread (0x7F01): MainThread;<module> (/r/benchmarks/serve_fresh.py:9);_tree_of (/r/examples/data.py:197) 10
thread (0x7F02): dynjax-compile_0;_bootstrap (/usr/lib/threading.py:1);Family._lower_bucket (/r/dynjax/jit/_family.py:490);lower (/j/jax/_src/mlir.py:10) 15
thread (0x7F03): dynjax-compile_1;_bootstrap (/usr/lib/threading.py:1);ExecutableStore.save (/r/dynjax/jit/_store.py:98);serialize (/j/jax/serialize_executable.py:44) 5
not a sample line
"""


def test_raw_lines_are_read_per_thread_and_the_gil_is_shared_out():
  rows = pg.parse_raw(RAW)
  assert [(t, name, n) for t, name, _, n in rows] == [
      ("0x7F01", "MainThread", 70), ("0x7F01", "MainThread", 10),
      ("0x7F02", "dynjax-compile_0", 15), ("0x7F03", "dynjax-compile_1", 5)]
  assert rows[2][2][-1] == "lower (/j/jax/_src/mlir.py:10)"
  s = pg.summarize(rows, rows)
  assert s["gil_samples"] == 100
  assert s["gil_share"] == {"main": 0.8, "other threads": 0.2}
  # what the other threads held it for, by the innermost dynjax frame that asked
  assert s["other_threads_by_dynjax_frame"] == [
      ("Family._lower_bucket (_family.py:490)", 15), ("ExecutableStore.save (_store.py:98)", 5)]
  assert s["other_threads_holding"][0] == (
      "lower (mlir.py:10) < Family._lower_bucket (_family.py:490) < _bootstrap (threading.py:1)",
      15)
  assert s["main_running_samples"] == 80
  assert s["main_by_function"] == [("parse (ast.py:50)", 0.875), ("_tree_of (data.py:197)", 0.125)]


def test_no_samples_summarize_to_zeros_not_an_error():
  s = pg.summarize([], [])
  assert s["gil_samples"] == 0 and s["gil_share"] == {} and s["main_running_samples"] == 0
