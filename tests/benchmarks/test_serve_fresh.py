"""benchmarks/serve_fresh.py without a GPU or child processes: bins, table, mode tags."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from benchmarks import serve_fresh as sf


def _reqs(lengths):
  return [types.SimpleNamespace(tokens=np.zeros((8, t), np.int32)) for t in lengths]


def test_bins_average_the_second_half_by_padded_length():
  reqs = _reqs([10, 300, 10, 100, 64, 65, 300, 500])
  lat = [9.0, 9.0, 9.0, 9.0, 0.001, 0.002, 0.003, 0.005]  # first half must not count
  b = sf._bins(reqs, lat)
  assert b["1-64"] == 1.0 and b["65-128"] == 2.0
  assert b["257-512"] == 4.0 and b["129-256"] is None
  assert abs(b["all"] - 2.75) < 1e-9


def test_table_rows_and_after_wait_and_lengths():
  rec = {"mode": "dynjax_pow2_wait", "start_to_last_s": 20.0, "stream_s": 5.0,
         "bins_ms": {"1-64": 2.0, "65-128": 3.0, "129-256": None, "257-512": 8.0, "all": 4.0},
         "wait_s": 30.0, "after_wait": {"stream_s": 4.0, "bins_ms": {
             "1-64": 1.5, "65-128": 2.5, "129-256": 3.5, "257-512": 7.0, "all": 3.0}}}
  lengths = {"mode": "lengths", "per_length_ms": {"37": {"exact_aot": 1.9, "torch_eager": 5.9,
                                                          "loaded_from_store": 1}}}
  out = sf.table([rec, {"mode": "x", "error": "boom"}, lengths])
  lines = out.splitlines()
  assert lines[2].startswith("| dynjax_pow2_wait | 20.0 | 5.00 | 2.00 | 3.00 |  | 8.00 | 4.00 |")
  assert "after wait() (30 s)" in lines[3] and "| 4.00 |" in lines[3]
  assert "| 37 | 1.90 | 5.90 | 1 |" in out
  assert "boom" not in out  # errors are printed per mode, not in the table
  assert "ERROR boom" in sf._line({"mode": "x", "error": "boom"})


def test_mode_tags_pick_policy_padding_and_attention():
  args = types.SimpleNamespace(max_len=512)
  assert repr(sf._policy("dynjax_pow2", args)).startswith("dynjax.buckets.pow2")
  assert "max_compiles=8" in repr(sf._policy("dynjax_trust_auto_restart", args))
  assert "max_compiles=None" in repr(sf._policy("dynjax_value", args))


def test_x_exact_weighs_bins_by_traffic_over_the_exact_cost_curve():
  lengths = {"mode": "lengths", "per_length_ms": {
      "100": {"exact_aot": 2.0}, "200": {"exact_aot": 4.0}, "300": {"exact_aot": 3.5}}}
  cost = sf.exact_cost([lengths])
  assert cost(50) == 2.0  # flat below the first point
  assert cost(150) == 3.0  # linear between points
  assert cost(300) == 4.0  # made non-decreasing (3.5 was noise)
  assert cost(600) == 8.0  # proportional to T past the last point
  hist = {"100": 3, "150": 1, "300": 2}  # JSON keys are strings
  bins = {"1-64": None, "65-128": 2.2, "129-256": 3.3, "257-512": 4.4}
  want = (2.2 * 3 + 3.3 * 1 + 4.4 * 2) / (2.0 * 3 + 3.0 * 1 + 4.0 * 2)
  assert abs(sf.x_exact(bins, hist, cost) - want) < 1e-12
  assert sf.x_exact(bins, hist, sf.exact_cost([])) is None  # no lengths record in the run


def test_warm_and_prof_tags_share_the_cache_of_the_mode_they_restart():
  assert sf.cache_key("dynjax_auto16_warm_wait_restart") == (True, "dynjax_auto16_wait")
  assert sf.cache_key("dynjax_auto16_wait_restart") == (True, "dynjax_auto16_wait")
  assert sf.cache_key("dynjax_auto16_warm_wait") == (False, "dynjax_auto16_wait")
  assert sf.cache_key("hand_warm_restart") == (True, "hand")
  assert sf.cache_key("dynjax_pow2_restart_prof") == (True, "dynjax_pow2")
  assert sf.cache_key("torch_eager") == (False, "torch_eager")
  assert sf.cache_key("dynjax_auto16_warm_wait_restart_again") == (True, "dynjax_auto16_wait")
  assert sf.cache_key("hand_warm_restart_again") == (True, "hand")
  assert sf.cache_key("dynjax_pallas_auto16_warm_wait_restart_again_noprerun") == (
      True, "dynjax_pallas_auto16_wait")


def test_a_repeated_cold_mode_starts_on_a_fresh_cache_and_restarts_take_the_latest(
    monkeypatch, tmp_path):
  seen = []

  def spawn(args, mode, cache):
    seen.append((mode, cache))
    return {"mode": mode, "error": "not run"}

  monkeypatch.setattr(sf, "_spawn", spawn)
  monkeypatch.setattr(sf, "_prime", lambda args: seen.append(("prime", None)))
  modes = "torch_eager,dynjax_auto16_warm,dynjax_auto16_warm,dynjax_auto16_warm_restart"
  sf.main(["--modes", modes, "--out", str(tmp_path)])
  assert seen.pop(0) == ("prime", None)  # the libraries read once before the first mode
  (_, none), (_, first), (_, second), (_, restart) = seen
  assert none is None
  assert first != second  # the second cold run must not find the first one's executables
  assert restart == second


def test_clock_marks_record_main_thread_cpu_and_collector_time():
  import gc
  import threading

  clock = sf._Clock()
  try:
    clock.mark("a")

    # Work on another thread (cyclic garbage, collected there) and on this one.
    def churn():
      for _ in range(3):
        junk = [[] for _ in range(2000)]
        for x in junk:
          x.append(x)
        del junk
        gc.collect()

    t = threading.Thread(target=churn)
    t.start()
    t.join()
    sum(i * i for i in range(200_000))
    clock.mark("b")
  finally:
    gc.callbacks.remove(clock._on_gc)
  a, b = clock.work["a"], clock.work["b"]
  assert b["main_cpu_s"] > a["main_cpu_s"]
  assert b["gc_full"] - a["gc_full"] >= 3  # the other thread's collections count
  # the other thread's collections count in gc_s, not in gc_main_s
  assert b["gc_s"] - b["gc_main_s"] > a["gc_s"] - a["gc_main_s"]
  assert b["allocated_blocks"] > 0 and set(clock.marks) >= {"a", "b"}


def test_clock_marks_name_the_threads_that_kept_a_core_busy():
  import sys
  import threading

  if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc")
  clock = sf._Clock()
  try:
    clock.mark("a")
    stop = threading.Event()

    def spin():  # a thread that keeps a core busy beside the main thread's own work
      while not stop.is_set():
        sum(range(1000))

    t = threading.Thread(target=spin, name="spinner")
    t.start()
    import time

    time.sleep(0.25)  # the main thread waits: the spinner's CPU is the process's, not main's
    clock.mark("mid", threads=False)  # (as inside a timed stream: /proc is not read)
    time.sleep(0.25)
    clock.mark("b")  # (while the spinner lives: a thread that ended has left /proc)
    stop.set()
    t.join()
  finally:
    import gc

    gc.callbacks.remove(clock._on_gc)
  a, b = clock.work["a"], clock.work["b"]
  assert clock.work["mid"]["busiest_threads"] is None
  other = (b["process_cpu_s"] - a["process_cpu_s"]) - (b["main_cpu_s"] - a["main_cpu_s"])
  assert other > 0.2
  seconds, name = b["busiest_threads"][0]  # (s, "<OS name>/<tid>"), the busiest first
  assert seconds > 0.2 and name.endswith(f"/{t.native_id}"), b["busiest_threads"]


def test_nocb_tag_runs_the_child_without_cuda_graphs_and_lengths_variants_keep_their_name(
    monkeypatch, tmp_path):
  envs = []

  class Proc:
    returncode = 0

    def __init__(self, cmd, env, **_):
      envs.append((cmd[cmd.index("--child") + 1], env))

    def communicate(self, timeout=None):
      mode = envs[-1][0]
      rec = ({"mode": mode, "per_length_ms": {"37": {"exact_aot": 1.0}}}
             if mode.startswith("lengths") else {"mode": mode, "error": "not run"})
      return "RESULT " + sf.json.dumps(rec), ""

  monkeypatch.setattr(sf.subprocess, "Popen", Proc)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  sf.main(["--modes", "lengths,lengths_nocb,dynjax_pow2_nocb", "--out", str(tmp_path),
           "--no-prime"])
  flags = {mode: env.get("XLA_FLAGS") for mode, env in envs}
  assert flags["lengths"] == "--xla_dump_to=/tmp/x"  # the caller's flags, untouched
  assert flags["lengths_nocb"] == flags["dynjax_pow2_nocb"] == (
      "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer=")
  # both per-length records are shown, each under its own name; the exact-shape cost curve
  # comes from the plain one only
  text = sf.table([{"mode": "lengths", "per_length_ms": {"37": {"exact_aot": 1.0}}},
                   {"mode": "lengths_nocb", "per_length_ms": {"37": {"exact_aot": 9.0}}}])
  assert "lengths:" in text and "lengths_nocb:" in text
  assert sf.exact_cost([{"mode": "lengths_nocb",
                         "per_length_ms": {"37": {"exact_aot": 9.0}, "99": {"exact_aot": 9.5}}}
                        ]) is None


def test_the_checkout_is_compiled_once_for_every_child(tmp_path):
  # Every child reads the bytecode the parent compiled (PYTHONPYCACHEPREFIX), as an installed
  # package ships it: under PYTHONDONTWRITEBYTECODE=1 a child otherwise compiles dynjax anew.
  import os
  import subprocess
  import sys

  prefix = sf._compile_checkout(str(tmp_path / "pyc"))
  assert prefix == str(tmp_path / "pyc")
  assert sys.pycache_prefix != prefix  # the parent's own setting is left as it was
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  code = ("import builtins, importlib.util, sys; seen = []; real = builtins.compile\n"
          "builtins.compile = lambda *a, **k: seen.append(a[1]) or real(*a, **k)\n"
          "import dynjax.jit._api, dynjax.bucketing._outline\n"
          "print(sum('dynjax' in str(f) for f in seen))")
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=root)
  # the baseline reads bytecode from an empty prefix: a checkout's own __pycache__ (written
  # wherever bytecode may be, as in CI) would otherwise serve it
  empty = tmp_path / "empty"
  empty.mkdir()
  fresh = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPYCACHEPREFIX=str(empty)),
                         capture_output=True, text=True, check=True)
  cached = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPYCACHEPREFIX=prefix),
                          capture_output=True, text=True, check=True)
  assert int(fresh.stdout.split()[-1]) > 20  # dynjax's modules compiled from source
  assert int(cached.stdout.split()[-1]) == 0  # none: every one read from the prefix


def test_a_hung_child_leaves_its_stacks_and_threads(tmp_path, monkeypatch):
  # Session 37: a cold bf16 process hung on the H200 and was killed with nothing to show.  A
  # child past --timeout now prints every thread's Python stack (its SIGUSR1 handler) and the
  # parent writes its threads' wait channels (and native stacks where a tool is installed).
  import subprocess
  import sys

  monkeypatch.setattr("shutil.which", lambda name: None)  # no nvidia-smi, py-spy, gdb: /proc
  code = ("import faulthandler, signal, sys, time\n"
          "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
          "def stuck_here():\n"
          "  sys.stderr.write('ready\\n'); sys.stderr.flush()\n"  # (inside the frame we look for)
          "  time.sleep(60)\n"
          "stuck_here()\n")
  proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
  assert proc.stderr.readline() == "ready\n"
  args = types.SimpleNamespace(out=str(tmp_path))
  path = sf._hung_stacks(args, "dynjax_x", proc)
  proc.kill()
  err = proc.stderr.read()
  assert "stuck_here" in err and "Current thread" in err
  text = open(path).read()
  assert path.startswith(str(tmp_path)) and "threads (name, state, wchan)" in text
  assert f"{proc.pid} python" in text or str(proc.pid) in text


def test_rounds_alternate_torch_first_and_last_and_pair_each_mode_with_its_rounds_torch(
    monkeypatch, tmp_path):
  seen = []
  t = {"torch_eager": [20.0, 18.0], "dynjax_auto16_warm": [19.0, 19.5],
       "dynjax_auto16_warm_restart": [17.0, 18.5]}

  def spawn(args, mode, cache):
    seen.append((mode, cache))
    k = sum(m == mode for m, _ in seen) - 1
    return {"mode": mode, "start_to_last_s": t[mode][k], "stream_s": 4.0 if "torch" in mode
            else 3.0, "bins_ms": {"all": 1.0}, "marks": {}}

  monkeypatch.setattr(sf, "_spawn", spawn)
  modes = "torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart"
  out = sf.main(["--modes", modes, "--rounds", "2", "--out", str(tmp_path), "--no-prime"])
  assert [m for m, _ in seen] == ["torch_eager", "dynjax_auto16_warm",
                                  "dynjax_auto16_warm_restart", "dynjax_auto16_warm",
                                  "dynjax_auto16_warm_restart", "torch_eager"]
  assert seen[2][1] == seen[1][1] and seen[4][1] == seen[3][1] != seen[1][1]  # own round's cache
  assert [r["round"] for r in out["results"]] == [0, 0, 0, 1, 1, 1]
  pairs = sf.paired(out["results"])
  assert pairs["dynjax_auto16_warm"]["diff_s"] == [-1.0, 1.5]
  assert pairs["dynjax_auto16_warm"]["ahead"] == 1
  assert pairs["dynjax_auto16_warm_restart"]["median_s"] == pytest.approx(-1.25)
  assert pairs["dynjax_auto16_warm_restart"]["stream_x"] == [0.75, 0.75]
  assert "torch_eager" not in pairs
  text = sf.table(out["results"])
  assert "| dynjax_auto16_warm | 2 | +0.25 | +0.25 | -1.00 .. +1.50 | 1 of 2 | 0.75-0.75 |" in text
  assert sf.paired([{k: v for k, v in r.items() if k != "round"} for r in out["results"]]) == {}


def test_restarts_run_on_their_cold_modes_cache_or_a_pristine_copy_of_it(tmp_path):
  caches: dict = {}
  tmp = str(tmp_path)
  assert sf.mode_cache("torch_eager", caches, tmp, 0, True) == (None, None)
  assert sf.mode_cache("dynjax_auto_warm_restart", caches, tmp, 0, True) == (
      None, "needs dynjax_auto earlier in --modes")
  cold, why = sf.mode_cache("dynjax_auto_warm", caches, tmp, 1, True)
  assert why is None and cold == str(tmp_path / "dynjax_auto_warm-1")
  os.makedirs(cold)
  with open(os.path.join(cold, "exe"), "w") as fh:
    fh.write("cold")
  # no copy kept yet: a pristine restart has nothing to start from
  assert sf.mode_cache("dynjax_auto_warm_restart", caches, tmp, 2, True) == (
      None, "dynjax_auto left no cache to restart on")
  sf.keep_cold("dynjax_auto_warm", cold)
  with open(os.path.join(cold, "exe"), "w") as fh:  # what the cold process's later run left
    fh.write("later")
  copy, why = sf.mode_cache("dynjax_auto_warm_restart", caches, tmp, 3, True)
  assert why is None and copy == str(tmp_path / "dynjax_auto_warm_restart-3")
  with open(os.path.join(copy, "exe")) as fh:
    assert fh.read() == "cold"  # the cache as the cold process left it
  sf.keep_cold("dynjax_auto_warm_restart", copy)  # a restart keeps no copy of its own
  assert not os.path.exists(copy + ".cold")
  # without pristine restarts a restart shares the cold mode's directory
  assert sf.mode_cache("dynjax_auto_warm_restart", caches, tmp, 4, False) == (cold, None)
