"""Progressive serving (``serving=True``), the background compile scheduler, the executable
store behind ``cache_dir``, and the top-level-argument hot path."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynjax
from dynjax._errors import PaddingUnsupportedError
from dynjax.jit import _family, _scheduler
from dynjax.jit import _serving as serving_mod
from dynjax.jit._scheduler import CompileScheduler


def _model(params, x):
  h = jnp.tanh(x @ params["w"] + params["b"])
  return jax.nn.softmax(h, axis=-1).sum(1)


def _params(d=4):
  rng = np.random.RandomState(0)
  return {"w": jnp.asarray(rng.randn(d, d).astype(np.float32)),
          "b": jnp.asarray(rng.randn(d).astype(np.float32))}


def _x(t, b=2, d=4, seed=1):
  return np.random.RandomState(seed + t).randn(b, t, d).astype(np.float32)


EXACT = jax.jit(_model)


def _serving(**kw):
  return dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto", serving=True,
                    buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)}, **kw)


def test_first_call_compiles_only_the_covering_bucket_then_every_call_is_served(compiles,
                                                                                monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)  # one tier: counts builds
  p = _params()
  f = _serving(compile_workers=1)
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  s = f.stats()
  assert s["per_bucket_calls"] == {"b=2, t=64": 1}  # served on the covering bucket, which
  assert f._dispatcher.cache.compile_log[0][0][1] == (2, 64)  # compiled first (t=8 follows, background)
  assert s["waited_for_compile"] == 1
  for t in (3, 9, 17, 33, 5):  # never wait again: the top bucket covers everything
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert f.stats()["waited_for_compile"] == 1
  f.wait()
  before = compiles()
  for t in (3, 9, 17, 33, 5):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  s = f.stats()
  assert compiles() == before  # everything worth compiling was compiled in the background
  # Which small buckets are worth their compile depends on their measured run times (the
  # fitted cost model: on this CPU a tiny model's fixed cost can make t=4 no cheaper than
  # t=8), so the set is not fixed; every call ran on a compiled bucket that covers it, each
  # bucket compiled once, and the big ones (clearly cheaper than t=64) are there.
  used = {int(k.split("t=")[1]) for k in s["per_bucket_calls"]}
  assert used <= {4, 8, 16, 32, 64} and {16, 32} & used
  compiled = [key[1][1] for key, _ in f._dispatcher.cache.compile_log]
  assert sorted(compiled) == sorted(set(compiled)) == sorted(used)  # once each, each one used
  assert s["background"]["failed"] == 0


def test_a_dim_without_a_declared_max_does_not_hide_the_top_of_the_others(compiles):
  # "b" has no declared range (pow2 without max), "t" does: the first call compiles the
  # bucket covering every t at its own b, so the first long request never waits (on an
  # H100 a batch dim without max made a 274-token request wait 5 s behind a compile).
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto", serving=True,
                 buckets={"t": dynjax.buckets.pow2(4, 64)}, compile_workers=1)
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  assert f._dispatcher.cache.compile_log[0][0][1] == (2, 64)
  assert f.stats()["per_bucket_calls"] == {"b=2, t=64": 1}
  for t in (60, 33, 17):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert f.stats()["waited_for_compile"] == 1
  f.wait()


def test_calls_never_wait_behind_a_compile_a_compiled_bucket_covers(monkeypatch):
  p = _params()
  f = _serving(compile_workers=2)
  f(p, _x(40))  # compiles the top bucket (64)
  fam = next(iter(f._dispatcher.families.values()))
  slow = threading.Event()
  real = fam.compile_bucket

  def build(*a, **k):
    slow.wait(10)  # background compiles hang until released
    return real(*a, **k)

  monkeypatch.setattr(fam, "compile_bucket", build)
  t0 = time.perf_counter()
  for t in (3, 7, 12, 20, 3, 7):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert time.perf_counter() - t0 < 5  # served on t=64 while t=4..32 "compile"
  s = f.stats()
  assert s["served_on_larger_bucket"] == 6 and s["per_bucket_calls"]["b=2, t=64"] == 7
  slow.set()
  f.wait()
  f(p, _x(3))
  assert "b=2, t=4" in f.stats()["per_bucket_calls"]


def test_scheduler_runs_the_most_valuable_job_first_and_urgent_jobs_alone():
  values = {"a": 1.0, "b": 5.0, "c": 3.0, "zero": 0.0}
  order, gate = [], threading.Event()
  running_with_urgent = []
  sched = CompileScheduler(2, lambda job: values[job.key])

  def job(name):
    def build():
      if name == "urgent":
        gate.wait(5)
      else:
        running_with_urgent.append(any(k == "urgent" for k in sched.running()))
      order.append(name)
      return name
    return build

  fu = sched.submit("urgent", job("urgent"), urgent=True)
  time.sleep(0.1)
  futs = [sched.submit(k, job(k)) for k in ("a", "b", "c", "zero")]
  time.sleep(0.3)
  assert order == []  # nothing starts beside a running urgent job
  gate.set()
  assert fu.result(5) == "urgent"
  for f in futs[:3]:
    f.result(5)
  assert order[0] == "urgent" and set(order[1:]) == {"a", "b", "c"}
  assert order[1] == "b"  # the most valuable first
  assert not any(running_with_urgent)
  assert not futs[3].done()  # worth nothing: never runs
  assert sched.wait_idle(2)
  sched.close()
  assert futs[3].cancelled()
  late = sched.submit("late", lambda: "never")  # closed (at exit): told, not left waiting
  assert late.cancelled()


def test_gpu_tiers_quick_compile_first_then_full_options_replace_it(monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  seen = []
  real_compile = jax.stages.Lowered.compile

  def compile_spy(self, compiler_options=None):
    seen.append(dict(compiler_options or {}))
    return real_compile(self, compiler_options=compiler_options)

  monkeypatch.setattr(jax.stages.Lowered, "compile", compile_spy)
  p = _params()
  f = _serving(compile_workers=1)
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.families.values()))
  assert fam.buckets[(2, 64)].tier == 0
  quick = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 1}
  assert seen and all(o == quick for o in seen)
  # Tier 1 starts by itself once the queue is idle and traffic pauses (here: no more calls),
  # one at a time, after every tier-0 compile.
  sched = f._dispatcher.compiler.scheduler
  deadline = time.time() + 30
  while time.time() < deadline and not (fam.buckets[(2, 64)].tier == 1
                                        and fam.buckets[(2, 8)].tier == 1):
    time.sleep(0.05)
  assert sched.wait_idle(30)
  assert fam.buckets[(2, 64)].tier == 1 and fam.buckets[(2, 8)].tier == 1
  full = {"xla_gpu_enable_triton_gemm": False}
  first_full = seen.index(full)
  assert all(o == quick for o in seen[:first_full]) and all(o == full for o in seen[first_full:])
  starts = sorted((start, start + dt) for key, start, dt in sched.log if key[2] == 1)
  assert all(b[0] >= a[1] - 1e-6 for a, b in zip(starts, starts[1:], strict=False))  # never two at once
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)


def test_tier_up_waits_while_requests_keep_coming(monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  monkeypatch.setattr(serving_mod, "TIER_UP_IDLE_S", 0.5)
  monkeypatch.setattr(serving_mod, "CONTENTION", 0.0)  # any saving is worth a tier-0 compile
  p = _params()
  f = _serving(compile_workers=1)
  f(p, _x(5))
  fam = next(iter(f._dispatcher.families.values()))
  t_end = time.time() + 1.5
  while time.time() < t_end:  # busy traffic from the first call on: a call every few ms
    f(p, _x(5))
    time.sleep(0.005)
  assert (2, 8) in fam.buckets  # its tier-0 compile ran meanwhile
  assert fam.buckets[(2, 64)].tier == 0 and fam.buckets[(2, 8)].tier == 0
  deadline = time.time() + 30  # traffic stops: the gap lets tier 1 run
  while time.time() < deadline and fam.buckets[(2, 8)].tier == 0:
    time.sleep(0.05)
  assert fam.buckets[(2, 8)].tier == 1


def test_a_background_compile_waits_until_worth_the_requests_it_slows(monkeypatch):
  # A tier-0 job starts when what it would have saved on the traffic seen exceeds CONTENTION
  # x its compile seconds, or in a traffic gap, or when wait() asks for everything.
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  monkeypatch.setattr(serving_mod, "TIER_UP_IDLE_S", 0.5)
  monkeypatch.setattr(serving_mod, "CONTENTION", 1e9)
  p = _params()
  f = _serving(compile_workers=1)
  f(p, _x(5))
  fam = next(iter(f._dispatcher.families.values()))
  t_end = time.time() + 1.5
  while time.time() < t_end:  # busy traffic: (2, 8) is planned, never worth 1e9 x a compile
    np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
    time.sleep(0.005)
  assert (2, 8) not in fam.buckets and f.stats()["served_on_larger_bucket"] > 100
  deadline = time.time() + 30  # traffic stops: the gap lets it compile (then tier up)
  while time.time() < deadline and (2, 8) not in fam.buckets:
    time.sleep(0.05)
  assert (2, 8) in fam.buckets
  g = _serving(compile_workers=1)
  g(p, _x(5))
  g.wait()  # builds every planned bucket at once, whatever its value
  assert (2, 8) in next(iter(g._dispatcher.families.values())).buckets


def test_tier_up_after_steady_traffic_or_wait(monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  monkeypatch.setattr(serving_mod, "TIER_UP_IDLE_S", 1e9)  # never a gap
  monkeypatch.setattr(serving_mod, "TIER_UP_AFTER", 1000)
  p = _params()
  f = _serving(compile_workers=1)
  f(p, _x(5))
  fam = next(iter(f._dispatcher.families.values()))
  assert f._dispatcher.compiler.scheduler.wait_idle(5)
  assert fam.buckets[(2, 64)].tier == 0  # 1 call, not 1,000: still quick
  f.wait()  # runs the queued tier-1 recompiles now
  assert fam.buckets[(2, 64)].tier == 1


def test_tier_one_replaces_the_stored_quick_executable(monkeypatch, tmp_path):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  p = _params()
  f = _serving(compile_workers=1, cache_dir=str(tmp_path))
  f(p, _x(5))
  f.wait()
  fam = next(iter(f._dispatcher.families.values()))
  stored = fam.store().stored()
  assert stored and all(t == 1 for _, t in stored), stored
  g = _serving(compile_workers=1, cache_dir=str(tmp_path))  # a restart
  np.testing.assert_allclose(g(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  gfam = next(iter(g._dispatcher.families.values()))
  assert all(e.tier == 1 and e.source == "stored" for e in gfam.buckets.values())
  assert g.stats()["compiles"] == 0


def test_no_tiers_with_explicit_compiler_options_or_off_gpu(monkeypatch):
  f = _serving()
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)
  assert f._dispatcher.compiler.tiers() == 1  # CPU
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  assert f._dispatcher.compiler.tiers() == 2
  g = _serving(compiler_options={"xla_gpu_autotune_level": 2})
  assert g._dispatcher.compiler.tiers() == 1 and g._dispatcher.compiler.compile_options(0) == {"xla_gpu_autotune_level": 2}


def test_bad_serving_options_say_what_is_expected():
  with pytest.raises(dynjax.SpecError, match="compile_workers must be a positive integer"):
    dynjax.jit(_model, compile_workers=0)
  with pytest.raises(dynjax.SpecError, match="compiler_options must be a dict"):
    dynjax.jit(_model, compiler_options=[("a", 1)])
  with pytest.raises(dynjax.SpecError, match=r"compiler_options: \[3\] are not name"):
    dynjax.jit(_model, compiler_options={3: 1})


_RESTART = """
import jax, jax.numpy as jnp, numpy as np, dynjax
from dynjax.jit import _serving
_serving.on_gpu = lambda: False  # one tier (as on the CPU): the test counts builds
W = jnp.asarray(np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4) * {scale})
def model(x):
  return jax.nn.softmax(jnp.tanh(x @ W), axis=-1).sum(1)
f = dynjax.jit(model, dims={{"x": "b, t, 4"}}, padding="auto", serving=True,
               cache_dir={cache!r}, buckets={{"b": [2], "t": dynjax.buckets.pow2(4, 32)}})
exact = jax.jit(model)
for t in (3, 9, 20, 3, 9, 20):
  x = np.random.RandomState(t).randn(2, t, 4).astype(np.float32)
  np.testing.assert_allclose(f(x), exact(x), rtol=1e-6, atol=1e-6)
f.wait()
s = f.stats()
import os
jax_entries = [n for n in os.listdir({cache!r})  # (a GPU's XLA adds its autotune folder)
               if n != "dynjax-executables" and not n.startswith("xla_gpu_")]
print("COMPILES", s["compiles"], "LOADED", s["loaded_from_store"], "WAITS",
      s["waited_for_compile"], "JAXCACHE", len(jax_entries))
"""


def _run(script):
  r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                     text=True, timeout=240)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout.split()


def test_restarted_server_loads_every_bucket_and_compiles_nothing(tmp_path):
  cache = str(tmp_path / "cache")
  first = _run(_RESTART.format(cache=cache, scale=1.0))
  assert first[:4] == ["COMPILES", "3", "LOADED", "0"], first  # t = 4, 16 and 32 (the top)
  # Stored buckets are not also written to JAX's persistent cache (a second serialization
  # holding the GIL): it holds only the 3 exact-shape jax.jit compiles of the reference.
  assert first[6:8] == ["JAXCACHE", "3"], first
  second = _run(_RESTART.format(cache=cache, scale=1.0))
  assert second[:4] == ["COMPILES", "0", "LOADED", "3"], second
  # Another closed-over constant is another function: its executables are not reused.
  other = _run(_RESTART.format(cache=cache, scale=2.0))
  assert other[:4] == ["COMPILES", "3", "LOADED", "0"], other


def test_a_broken_stored_executable_is_compiled_again(tmp_path):
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, cache_dir=str(tmp_path),
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  f(p, _x(5))
  store = next(iter(f._dispatcher.families.values())).store()
  (bkey, tier), = store.stored()
  with open(store.path(bkey, tier), "wb") as fh:
    fh.write(b"not an executable")
  g = dynjax.jit(_model, dims={"x": "b, t, 4"}, cache_dir=str(tmp_path),
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  with pytest.warns(UserWarning, match="is discarded: not a dynjax executable file"):
    np.testing.assert_allclose(g(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  s = g.stats()
  assert s["compiles"] == 1 and s["loaded_from_store"] == 0
  assert next(iter(g._dispatcher.families.values())).store().load_errors == 1


def test_a_store_that_cannot_be_written_warns_once_and_serves(tmp_path, monkeypatch):
  # a read-only or full cache_dir (root ignores chmod, so the write itself fails here)
  from dynjax.jit import _store

  def refuse(*a, **k):
    raise PermissionError(13, "Read-only file system")

  monkeypatch.setattr(_store.tempfile, "mkstemp", refuse)
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, cache_dir=str(tmp_path),
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  with pytest.warns(UserWarning, match=r"cannot write the executable store .*Read-only file "
                    r"system.*compile again in the next process") as record:
    for t in (3, 5, 9, 17):  # four buckets, one warning
      np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert sum("cannot write" in str(w.message) for w in record) == 1
  assert f.stats()["compiles"] == 4


def _store_fn(cache, scale=1.0):
  def model(p, x):
    return _model(p, x) * scale

  return dynjax.jit(model, dims={"x": "b, t, 4"}, cache_dir=cache,
                    buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})


def test_swapped_or_copied_store_files_are_discarded_once_and_healed(tmp_path):
  import shutil
  import warnings

  p = _params()
  cache = str(tmp_path)
  f = _store_fn(cache)
  for t in (3, 12):  # buckets t=4 and t=16
    f(p, _x(t))
  store = next(iter(f._dispatcher.families.values())).store()
  (b4, tier), (b16, _) = store.stored()
  a, b = store.path(b4, tier), store.path(b16, tier)
  os.rename(a, a + ".swap")
  os.rename(b, a)
  os.rename(a + ".swap", b)
  # Another family (another constant) stores under another fingerprint: copy one of ours in.
  other = _store_fn(cache, scale=2.0)
  other(p, _x(3))
  ostore = next(iter(other._dispatcher.families.values())).store()
  shutil.copy(a, ostore.path(b4, tier))
  g = _store_fn(cache)
  with pytest.warns(UserWarning) as rec:
    for t in (3, 12, 3, 12):
      np.testing.assert_allclose(g(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  msgs = [str(w.message) for w in rec if "dynjax: stored executable" in str(w.message)]
  assert len(msgs) == 2 and all("(swapped or renamed)" in m for m in msgs), msgs
  assert g.stats()["compiles"] == 2 and g.stats()["loaded_from_store"] == 0
  h = _store_fn(cache, scale=2.0)
  with pytest.warns(UserWarning, match="copied from another family"):
    np.testing.assert_allclose(h(p, _x(3)), 2.0 * EXACT(p, _x(3)), rtol=1e-6, atol=1e-6)
  # Healed: the recompiled executables replaced the bad files; a restart loads them silently.
  k = _store_fn(cache)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for t in (3, 12):
      np.testing.assert_allclose(k(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert k.stats()["compiles"] == 0 and k.stats()["loaded_from_store"] == 2


def test_top_level_path_rechecks_parameters_through_the_executable(compiles):
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto",
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  p = _params()
  f(p, _x(5))
  fam = next(iter(f._dispatcher.families.values()))
  assert fam.top is not None and f._dispatcher.top  # f(params, x): x is a whole argument
  # New parameter values, same shapes: served by the same executable, never stale.
  p2 = {k: v * 2 for k, v in p.items()}
  np.testing.assert_allclose(f(p2, _x(5)), EXACT(p2, _x(5)), rtol=1e-6, atol=1e-6)
  # New parameter shapes: the executable rejects them, a new family serves them.
  p8 = {"w": p["w"], "b": p["b"][None]}
  np.testing.assert_allclose(f(p8, _x(5)), EXACT(p8, _x(5)), rtol=1e-6, atol=1e-6)
  # Another structure: the same.
  p3 = {**p, "extra": jnp.zeros(3)}
  np.testing.assert_allclose(f(p3, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  assert len(f._dispatcher.families) == 3


def test_trailing_defaults_and_keywords_take_the_same_executable():
  def model(params, x, scale=2.0):
    return _model(params, x) * scale

  f = dynjax.jit(model, dims={"x": "b, t, 4"}, padding="auto",
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  p = _params()
  want = 2.0 * np.asarray(EXACT(p, _x(5)))
  np.testing.assert_allclose(f(p, _x(5)), want, rtol=1e-6)
  np.testing.assert_allclose(f(p, x=_x(5)), want, rtol=1e-6)
  assert f.stats()["compiles"] == 1
  # passing scale traces it (a left-out default is a Python value): another signature, as
  # under jax.jit, and then one executable for it by position or keyword
  np.testing.assert_allclose(f(p, _x(5), 2.0), want, rtol=1e-6)
  np.testing.assert_allclose(f(p, _x(6), scale=2.0), 2.0 * np.asarray(EXACT(p, _x(6))),
                             rtol=1e-6)
  assert f.stats()["compiles"] == 2


@pytest.mark.parametrize("on_fallback", ["warn", "error"])
def test_a_bucket_whose_plan_refuses_falls_back_like_the_probe(monkeypatch, on_fallback):
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, on_fallback=on_fallback,
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  np.testing.assert_allclose(f(p, _x(3)), EXACT(p, _x(3)), rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.families.values()))
  real = fam.compile_bucket

  def build(lowered, rewrites, bkey, *a, **k):
    if bkey == (2, 32):
      raise PaddingUnsupportedError("no rule for 'frobnicate' at this size")
    return real(lowered, rewrites, bkey, *a, **k)

  monkeypatch.setattr(fam, "compile_bucket", build)
  if on_fallback == "error":
    with pytest.raises(dynjax.PaddingFallbackError, match="frobnicate"):
      f(p, _x(20))
    return
  with pytest.warns(UserWarning, match="at bucket \\(2, 32\\): no rule for 'frobnicate'"):
    np.testing.assert_allclose(f(p, _x(20)), EXACT(p, _x(20)), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(f(p, _x(3)), EXACT(p, _x(3)), rtol=1e-6, atol=1e-6)  # exact now
  s = f.stats()
  assert len(s["fallbacks"]) == 1 and s["exact_calls"] == 2


def test_serving_lowers_the_plan_while_the_first_bucket_compiles(monkeypatch):
  lowered_in = []
  real = _family.Family.lower_bucket

  def spy(self, bkey):
    lowered_in.append((bkey, threading.current_thread().name))
    return real(self, bkey)

  monkeypatch.setattr(_family.Family, "lower_bucket", spy)
  p = _params()
  f = _serving(compile_workers=1)
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.families.values()))
  for fut in list(fam.prelowered.values()):
    fut.result(timeout=60)
  # Serving lowers on one thread, the lane; by the end of the first call it has lowered the
  # top and (ahead of their compile jobs) other planned buckets.
  assert all(name.startswith("dynjax-lower") for _, name in lowered_in), lowered_in
  pre = {b for b, _ in lowered_in}
  assert (2, 64) in pre and len(pre) >= 2 and pre <= {(2, 4), (2, 8), (2, 16), (2, 32), (2, 64)}
  for t in (3, 9, 17, 33):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  f.wait()
  # Each bucket was lowered once: the compile jobs took the pre-lowered modules.
  assert sorted(b for b, _ in lowered_in) == [(2, 4), (2, 8), (2, 16), (2, 32), (2, 64)]
  assert not any(b in fam.prelowered for b in fam.buckets)  # handed over, not kept


def test_hot_path_hits_are_exact_counted_and_follow_new_buckets(compiles):
  p = _params()
  f = _serving(compile_workers=1)
  for t in (5, 5, 5):  # first call: the top bucket (64); then the hot path on it
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.families.values()))
  hit = fam.executors[(((2, 5, 4),), False, False)]
  assert hit.bkey == (2, 64) and hit.n >= 1  # served on the covering bucket for now
  f.wait()  # t=8 compiles in the background: the hit is stale and re-resolved
  assert fam.executors[(((2, 5, 4),), False, False)].gen != fam.gen
  before = compiles()
  for t in (5, 5):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert fam.executors[(((2, 5, 4),), False, False)].bkey == (2, 8) and compiles() == before
  s = f.stats()
  assert s["calls"] == 5 and s["per_bucket_calls"] == {"b=2, t=64": 3, "b=2, t=8": 2}
  assert s["served_on_larger_bucket"] == 3 and s["host_syncs"] == 5
  # Device inputs take their own hit (device outputs, cut on the host, put back).
  xd = jnp.asarray(_x(5))
  for _ in range(2):
    out = f(p, xd)
    assert isinstance(out, jax.Array) and out.shape == (2, 4)
    np.testing.assert_allclose(out, EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  assert (((2, 5, 4),), True, False) in fam.executors and f.stats()["host_syncs"] == 5


class _Learner(dynjax.buckets.BucketPolicy):
  """A user's policy that learns from traffic without telling anyone when its table moves."""

  name = "learner"

  def __init__(self):
    super().__init__(1, 64)
    self.seen = 0

  def _build_table(self):
    return (8, 64)

  def _rule(self, n):
    return 64

  def observe(self, n):
    self.seen += 1

  def _args(self):
    return ""

  def _clone(self, multiple):
    return _Learner()


def test_executors_are_kept_only_where_no_call_decides_something():
  p = _params()
  auto = dynjax.buckets.auto(max_compiles=3, max=64)
  for kw, kept in (({"check": True}, True), ({"return_padded": True}, True),
                   ({"max_executables": 2}, True),  # (each run renews its bucket)
                   ({"buckets": {"b": [2], "t": auto}}, True),  # the plan tells (Auto.watch)
                   ({"buckets": {"b": [2], "t": _Learner()}}, False),  # nothing tells
                   ({"buckets": auto}, True)):  # b and t planned jointly (JointPlan.watch)
    f = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto",
                   **{"buckets": {"b": [2], "t": dynjax.buckets.pow2(4, 64)}, **kw})
    for _ in range(3):
      out = f(p, _x(5))
    out = out.unpad() if isinstance(out, dynjax.Padded) else out
    np.testing.assert_allclose(out, EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
    assert f.stats()["calls"] == 3 and f.stats()["cache_hits"] == 2, kw
    fam = next(iter(f._dispatcher.families.values()))
    assert bool(fam.executors) == kept, kw


def test_an_auto_plan_keeps_its_executors_until_it_moves_a_size_and_sees_every_call(compiles):
  # An auto policy's calls take the kept executor (no per-call plan, entry and executor:
  # 86 -> 212 us a call before, 2-core box); the policy still sees every call, and a re-plan
  # that moves a size's bucket (8 observations of t=5: 64 -> 8) makes its executor stale.
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto",
                 buckets={"b": [2], "t": dynjax.buckets.auto(max_compiles=3, max=64)})
  want = EXACT(p, _x(5))  # (compiled here or by an earlier test: not counted below)
  before = compiles()
  for _ in range(12):
    np.testing.assert_allclose(f(p, _x(5)), want, rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.families.values()))
  (t_pol,) = [q for _, q in fam.observers]
  assert t_pol._n_obs == 12 and t_pol._hist[5] == 12  # every call seen, none twice
  s = f.stats()
  assert s["per_bucket_calls"] == {"b=2, t=64": 8, "b=2, t=8": 4}, s["per_bucket_calls"]
  assert s["cache_hits"] == 10 and compiles() - before == 2
  (ex,) = [e for e in fam.executors.values() if e.gen == fam.gen]  # the rest are stale
  assert ex.bkey == (2, 8)
  # A bucket adopted from outside (a restart's store) is a change of plan too.
  gen = fam.gen
  t_pol.adopt(16)
  assert fam.gen == gen + 1
  t_pol.adopt(16)  # no change, no stale executors
  assert fam.gen == gen + 1
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  assert f.stats()["per_bucket_calls"]["b=2, t=8"] == 5


def test_a_joint_plan_keeps_its_executors_and_sees_every_call(compiles):
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto",
                 buckets=dynjax.buckets.auto(max_compiles=3, max=64))
  want = EXACT(p, _x(5))  # (compiled here or by an earlier test: not counted below)
  before = compiles()
  for _ in range(12):
    np.testing.assert_allclose(f(p, _x(5)), want, rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.families.values()))
  assert fam.joint is not None and fam.watched_plan
  assert fam.joint._n == 12 and fam.joint._hist[(2, 5)] == 12  # every call seen, none twice
  s = f.stats()
  assert s["per_bucket_calls"] == {"b=64, t=64": 8, "b=8, t=8": 4}, s["per_bucket_calls"]
  assert s["cache_hits"] == 10 and compiles() - before == 2
  (ex,) = [e for e in fam.executors.values() if e.gen == fam.gen]
  assert ex.bkey == (8, 8)


def test_a_policy_that_does_not_tell_sees_every_call_through_a_fresh_executor():
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto",
                 buckets={"b": [2], "t": _Learner()})
  want = EXACT(p, _x(5))
  for _ in range(3):
    np.testing.assert_allclose(f(p, _x(5)), want, rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.families.values()))
  (q,) = [q for _, q in fam.observers]
  assert q.seen == 3 and not fam.executors and not fam.watched_plan


def test_background_lowering_switches_the_gil_quickly_and_restores_it():
  import sys

  before = sys.getswitchinterval()
  seen = []
  with serving_mod.quick_switches():
    with serving_mod.quick_switches():  # nested (two lanes): restored only after the last
      seen.append(sys.getswitchinterval())
    seen.append(sys.getswitchinterval())
  assert seen == [pytest.approx(min(before, 5e-4))] * 2
  assert sys.getswitchinterval() == before
  p = _params()
  f = _serving(compile_workers=1)
  f(p, _x(5))
  f.wait()
  f._dispatcher.compiler.lane().submit(lambda: None).result()  # the lane's queued pre-lowering is done
  assert sys.getswitchinterval() == before


def test_lowering_switches_the_gil_quickly_only_beside_traffic(monkeypatch):
  # A warm-up's lowering before the first call keeps the interpreter's switch interval (the
  # quick one saves no request and costs the start-up's Python); once the function has
  # traffic, every lowering switches quickly, as does one whose scheduler came after it.
  import contextlib

  quick = []

  @contextlib.contextmanager
  def recorded():
    quick.append(threading.current_thread().name)
    yield

  monkeypatch.setattr(serving_mod, "quick_switches", recorded)
  p = _params()
  f = _serving(compile_workers=2)
  f.warmup(p, _x(5), background=True)
  assert f.wait(60)
  c = f._dispatcher.compiler
  assert not quick and not c.has_traffic() and not c.scheduler._traffic
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  assert c.has_traffic() and c.scheduler._traffic
  g = _serving(compile_workers=2)  # no warm-up: the scheduler is made by the first call
  np.testing.assert_allclose(g(p, _x(33)), EXACT(p, _x(33)), rtol=1e-6, atol=1e-6)
  assert g.wait(60)
  d = g._dispatcher.compiler
  assert d.has_traffic() and d.scheduler._traffic
  assert quick and all(n.startswith(d.lane_name) for n in quick)  # its bucket, its plan's


def test_gpu_quick_tier_compiles_the_first_calls_own_bucket_alongside(monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  monkeypatch.setattr(serving_mod.os, "cpu_count", lambda: 16)
  p = _params()
  f = _serving(compile_workers=2)
  assert f._dispatcher.compiler._co_compile_own()
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  built = {k[1] for k, _ in f._dispatcher.cache.compile_log}
  started = built | {k[1] for k in f._dispatcher.compiler.scheduler.in_flight()}
  assert {(2, 8), (2, 64)} <= started  # both under way when the first call returned
  assert f.stats()["waited_for_compile"] == 1
  f.wait()
  monkeypatch.setattr(serving_mod.os, "cpu_count", lambda: 4)
  assert not _serving(compile_workers=2)._dispatcher.compiler._co_compile_own()
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)
  assert not _serving(compile_workers=4)._dispatcher.compiler._co_compile_own()


def test_background_compiles_are_ordered_by_the_fitted_cost_with_a_fixed_part():
  # Measured: 2.5 ms fixed plus a square (t=4: 2.53 ms, t=32: 4.38, t=64: 10.0).  200 calls
  # at t=3 and 100 at t=30 wait on t=64; t=32 would serve both.  Padded elements would compile
  # t=4 first (200 * 60 > 300 * 32 elements saved); seconds saved say t=32 (300 * 5.6 ms >
  # 200 * 7.5 ms).
  p = _params()
  f = _serving(compile_workers=1)
  f(p, _x(40))  # the top bucket (t=64) compiles and serves
  fam = next(iter(f._dispatcher.families.values()))
  comp = f._dispatcher.compiler
  fam.bucket_time.clear()
  fam.bucket_time.update({(2, 4): 2.53e-3, (2, 16): 2.97e-3, (2, 32): 4.375e-3,
                          (2, 64): 10e-3})
  fam.tuple_hist.clear()
  fam.tuple_hist.update({(2, 3): 200, (2, 30): 100})
  model = comp._cost_model(fam)
  assert model((2, 4)) == pytest.approx(2.53e-3, rel=0.02)  # not 1/16 of t=64
  assert model((2, 64)) == pytest.approx(10e-3, rel=0.02)
  v4, v32 = comp._tier0_value(fam, (2, 4)), comp._tier0_value(fam, (2, 32))
  assert v32 > v4 > 0
  # The same histogram under a padded-elements model orders them the other way round.
  comp._cost_model = lambda fam: (lambda b: float(np.prod(b)))
  assert comp._tier0_value(fam, (2, 4)) > comp._tier0_value(fam, (2, 32))
  f.wait()


def test_a_tier0_job_worth_nothing_does_not_hold_tier_ups_back(monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  monkeypatch.setattr(serving_mod, "TIER_UP_IDLE_S", 1e9)  # tier-ups only at wait()
  p = _params()
  f = _serving(compile_workers=1)
  f(p, _x(5))
  comp = f._dispatcher.compiler
  fam = next(iter(f._dispatcher.families.values()))
  assert comp.scheduler.wait_idle(10)
  assert all(e.tier == 0 for e in fam.buckets.values())
  # A queued tier-0 job the value function prices at 0 (its bucket saves nothing): wait()
  # must still run every tier-up.
  monkeypatch.setattr(comp, "_tier0_value", lambda fam_, bkey: 0.0)
  comp.schedule(fam, (2, 4), 0)
  f.wait()
  assert all(e.tier == 1 for e in fam.buckets.values()), {b: e.tier for b, e in fam.buckets.items()}


def _auto_server(cache, max_compiles: int, workers: int):
  return dynjax.jit(_model, dims={"x": "b, t, 4"}, serving=True, compile_workers=workers,
                    cache_dir=str(cache),
                    buckets={"b": [2], "t": dynjax.buckets.auto(max_compiles=max_compiles,
                                                                max=64)})


def test_restart_plans_with_its_stored_buckets_and_loads_the_own_one_first(tmp_path):
  """A restarted ``auto`` policy used to plan the first call with its cold table (one bucket
  at ``max``), so that call ran on (and waited for) the largest stored bucket."""
  p = _params()

  def make():
    return _auto_server(tmp_path, max_compiles=4, workers=1)

  f = make()
  for t in [5, 6, 7, 5, 6, 7, 30, 31, 5, 6, 7, 40, 5, 6, 7, 60] * 4:
    f(p, _x(t))
  f.wait()
  stored = sorted(b for b, _ in next(iter(f._dispatcher.families.values())).store().stored())
  assert len(stored) >= 2 and stored[0][1] < 64, stored
  small = stored[0][1]

  g = make()  # a restart
  np.testing.assert_allclose(g(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  s = g.stats()
  assert s["per_bucket_calls"] == {f"b=2, t={small}": 1}, s["per_bucket_calls"]
  # No compile, but for a stored executable healed after a failed first run (jax 0.11.2 CPU:
  # "NOT_FOUND: Function ... not found" on a deserialized executable, now and then).
  assert s["compiles"] == s["stored_rebuilt"] <= 1 and s["served_on_larger_bucket"] == 0
  sched = g._dispatcher.compiler.scheduler
  assert sched.log[0][0][1] == (2, small)  # its own bucket loaded first
  assert sched.wait_idle(10) and g.stats()["loaded_from_store"] == len(stored)


def test_serving_restart_over_broken_stored_files_compiles_them_again(tmp_path):
  """The preload adopts stored buckets into the plan before they load: one that fails to
  load is compiled instead, and every call stays exact."""
  import warnings

  p = _params()

  def make():
    return _auto_server(tmp_path, max_compiles=3, workers=2)

  f = make()
  for t in [5, 6, 7, 30, 31, 5, 6, 7] * 8:
    f(p, _x(t))
  f.wait()
  store = next(iter(f._dispatcher.families.values())).store()
  stored = store.stored()
  assert len(stored) >= 2, stored
  for bkey, tier in stored:
    with open(store.path(bkey, tier), "wb") as fh:
      fh.write(b"not an executable")
  g = make()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # "... is discarded", once per file
    for t in [5, 31, 6, 30, 64, 7]:
      np.testing.assert_allclose(g(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
    assert g.wait(10)
  s = g.stats()
  assert s["loaded_from_store"] == 0 and s["compiles"] >= len(stored), s
  assert next(iter(g._dispatcher.families.values())).store().load_errors == len(stored)


def test_a_restart_whose_first_call_has_another_length_loads_the_stored_buckets(tmp_path):
  # The store is keyed by the traced function, never by the sizes of the call that traced it
  # (before, a restart whose first request had another length compiled every bucket again).
  p = _params()
  kw = dict(dims={"x": "b, t, 4"}, cache_dir=str(tmp_path),
            buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  f = dynjax.jit(_model, **kw)
  for t in (5, 20):
    f(p, _x(t))
  g = dynjax.jit(_model, **kw)
  for t in (7, 17):  # buckets 8 and 32, stored by f's first call at t=5 and its second
    np.testing.assert_allclose(g(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert (g.stats()["compiles"], g.stats()["loaded_from_store"]) == (0, 2)


def test_warmup_from_shape_dtype_structs_builds_what_calls_use(tmp_path):
  # A server warms up at start-up from shapes (before its weights exist), as jax.jit's
  # .lower(jax.ShapeDtypeStruct(...)); the executables are the ones later calls run and store.
  p = _params()
  kw = dict(dims={"x": "b, t, 4"}, cache_dir=str(tmp_path),
            buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)
  f = dynjax.jit(_model, **kw)
  info = f.warmup(shapes, jax.ShapeDtypeStruct((2, 30, 4), np.float32))
  assert sorted(info["buckets"]) == [(2, 4), (2, 8), (2, 16), (2, 32), (2, 64)]
  assert f.stats()["compiles"] == 5
  for t in (3, 30, 64):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert f.stats()["compiles"] == 5  # the calls ran what the warmup built
  g = dynjax.jit(_model, **kw)  # a restart warming up from shapes loads them all
  g.warmup(shapes, jax.ShapeDtypeStruct((2, 9, 4), np.float32))
  assert (g.stats()["compiles"], g.stats()["loaded_from_store"]) == (0, 5)
  with pytest.raises(dynjax.SpecError, match=r"argument x is a jax.ShapeDtypeStruct\(2, 9, 4\) "
                     r"float32, but a call needs an array.*\.warmup"):
    g(p, jax.ShapeDtypeStruct((2, 9, 4), np.float32))
  with pytest.raises(dynjax.SpecError, match=r"argument params\['b'\] is a jax.ShapeDtypeStruct"):
    g(shapes, _x(9))


def test_cold_auto_warmup_builds_a_ladder_the_plans_keep(tmp_path, compiles, monkeypatch):
  # A cold auto policy plans one bucket at max; a warmup on it alone would answer every early
  # request there.  It builds max, max/2, max/4, max/8 instead, adopted: calls run them and
  # later plans keep them.  A restart warms up what its store holds, no ladder on top.
  # The plans run on the prior cost model: measured call and compile times, on a loaded CI
  # box, could decide that no bucket beyond the ladder pays (a flake seen once under -n 2).
  from dynjax.bucketing import _auto

  monkeypatch.setattr(_auto.Auto, "record_time", lambda self, bucket, seconds: None)
  monkeypatch.setattr(_auto.Auto, "record_compile", lambda self, *a, **k: None)
  p = _params()
  # host_outputs pinned: on a GPU the restart's first call (numpy) would otherwise choose
  # pinned host outputs, unlike the warmup from shapes: another fingerprint, another store.
  kw = dict(dims={"x": "b, t, 4"}, cache_dir=str(tmp_path), host_outputs=False,
            buckets={"b": [2], "t": dynjax.buckets.auto(max=64)})
  f = dynjax.jit(_model, **kw)
  info = f.warmup(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p),
                  jax.ShapeDtypeStruct((2, 30, 4), np.float32))
  assert sorted(info["buckets"]) == [(2, 8), (2, 16), (2, 32), (2, 64)]
  assert f.stats()["compiles"] == 4
  for t in (3, 9, 30, 33, 64):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert f.stats()["compiles"] == 4  # every call ran on the ladder
  for t in [5, 6, 7, 40, 41, 50] * 6:  # traffic: the re-plans add buckets, keep the ladder
    f(p, _x(t))
  fam = next(iter(f._dispatcher.families.values()))
  table = set(fam.policies[1].sizes())
  assert {8, 16, 32, 64} < table and fam.policies[1].replans >= 1
  stored = {b[1] for b in serving_mod.stored_buckets(fam)}
  assert stored == table  # every bucket the calls built went to the store
  g = dynjax.jit(_model, **kw)
  g.warmup(p, _x(9))
  assert (g.stats()["compiles"], g.stats()["loaded_from_store"]) == (0, len(stored))
  assert set(next(iter(g._dispatcher.families.values())).policies[1].sizes()) == stored


def test_auto_warmup_ladder_respects_a_small_budget_and_max(compiles):
  for pol, want in ((dynjax.buckets.auto(max_compiles=2, max=64), [64]),
                    (dynjax.buckets.auto(max_compiles=4, max=64), [32, 64]),
                    (dynjax.buckets.auto(max=20), [8, 16, 20]),
                    (dynjax.buckets.auto(max=64, min=24), [32, 64])):
    f = dynjax.jit(_model, dims={"x": "b, t, 4"}, buckets={"b": [2], "t": pol})
    info = f.warmup(_params(), _x(5))
    assert sorted(b[1] for b in info["buckets"]) == want, pol


def test_scheduler_runs_warm_jobs_in_order_a_few_at_a_time_and_a_caller_promotes_one():
  # warmup(background=True) at a server's start-up: its jobs go before value-ordered ones, in
  # submission order, warm_at_once at a time (the start-up code keeps its cores); a caller
  # that needs a queued one makes it urgent, and it starts beside the running one.
  gates = {k: threading.Event() for k in ("w1", "w2", "w3", "w4")}
  started, lock = [], threading.Lock()
  sched = CompileScheduler(4, lambda job: 1.0)

  def job(name):
    def build():
      with lock:
        started.append((name, sorted(sched.running())))
      gates[name].wait(5) if name in gates else None
      return name
    return build

  futs = {k: sched.submit(k, job(k), warm=True) for k in ("w1", "w2", "w3")}
  bg = sched.submit("bg", job("bg"))  # worth 1.0, but warm jobs come first
  time.sleep(0.3)
  assert [s[0] for s in started] == ["w1"]  # one at a time
  assert not sched.wait_idle(0.05)  # queued warm jobs count as work to wait for
  sched.submit("w3", job("w3"), urgent=True)  # a caller needs w3 now
  time.sleep(0.3)
  assert [s[0] for s in started] == ["w1", "w3"]
  gates["w1"].set()
  gates["w3"].set()
  time.sleep(0.3)
  assert [s[0] for s in started] == ["w1", "w3", "w2"]  # bg still waits behind w2
  gates["w2"].set()
  assert bg.result(5) == "bg" and started[-1][0] == "bg"
  assert all(f.result(5) for f in futs.values())
  sched.close()


def test_a_background_build_that_fails_says_so_and_a_waited_one_leaves_it_to_its_caller(
    caplog):
  # Nobody reads a warm-up job's future: its failure is logged (with the exception), not
  # dropped; an urgent job's caller gets the exception itself (no second report).
  sched = CompileScheduler(1, lambda job: 1.0)

  def boom(msg):
    def build():
      raise RuntimeError(msg)
    return build

  with caplog.at_level(logging.WARNING, logger="dynjax"):
    warm = sched.submit(("fam", (8, 512), 0), boom("warm failed"), warm=True)
    with pytest.raises(RuntimeError, match="warm failed"):
      warm.result(5)
    urgent = sched.submit(("fam", (8, 64), 0), boom("urgent failed"), urgent=True)
    with pytest.raises(RuntimeError, match="urgent failed"):
      urgent.result(5)
    # A thread pool refusing work at the interpreter's exit is not a failure to report.
    late = sched.submit(("fam", (8, 128), 0),
                        boom("cannot schedule new futures after interpreter shutdown"))
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
      late.result(5)
  sched.close()
  msgs = [r.getMessage() for r in caplog.records if r.name == "dynjax"]
  assert msgs == ["dynjax: the background build of ('fam', (8, 512), 0) failed (RuntimeError: "
                  "warm failed); a call that needs it builds it again"], msgs
  assert sched.failed == 3


def test_background_warmup_builds_largest_first_one_at_a_time_and_serves(compiles, monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)  # one tier: the log is warm jobs
  monkeypatch.setattr(_scheduler, "STARTUP_CORES", 10_000)  # a small host: one at a time
  f = _serving()
  p = _params()
  info = f.warmup(p, _x(5), background=True)
  assert info["pending"] >= 1
  assert f.wait(30)
  sched = f._dispatcher.compiler.scheduler
  log = sorted(sched.log, key=lambda r: r[1])
  assert [k[1] for k, _, _ in log] == sorted((k[1] for k, _, _ in log), reverse=True)
  for (_, s0, d0), (_, s1, _) in zip(log, log[1:], strict=False):
    assert s1 >= s0 + d0 - 1e-3  # never two at once
  assert f.stats()["compiles"] == len(log) == 5
  for t in (3, 30, 64):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert f.stats()["compiles"] == 5
  g = _serving()
  g.warmup(p, _x(5), background=True, max_workers=3)
  assert g._dispatcher.compiler.scheduler.warm_at_once == 3
  assert g.wait(30) and g.stats()["compiles"] == 5
  g.warmup(p, _x(5), background=True)  # a later warmup without max_workers: one at a time
  assert g._dispatcher.compiler.scheduler.warm_at_once == _scheduler.WARM_AT_ONCE == 1


def test_a_big_host_warms_up_two_at_once_until_traffic_comes(monkeypatch):
  # One GPU compile is one core's work: on hosts of STARTUP_CORES a start-up warm-up builds
  # STARTUP_AT_ONCE buckets at once (H200: the whole ladder before the first request); from
  # a function's first call on, one at a time (compiles beside requests slow them), unless
  # the warm-up named its max_workers.
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)
  monkeypatch.setattr(_scheduler, "STARTUP_CORES", 1)
  gate, started = threading.Event(), []
  built = serving_mod.Compiler.build_entry

  def held(self, fam, bkey, *a, **kw):
    started.append(bkey)
    gate.wait(30)
    return built(self, fam, bkey, *a, **kw)

  monkeypatch.setattr(serving_mod.Compiler, "build_entry", held)
  p = _params()
  f = _serving(compile_workers=3)  # (a 16-core host's default is 4 threads; one stays free)
  f.warmup(p, _x(5), background=True)
  sched = f._dispatcher.compiler.scheduler
  deadline = time.time() + 10
  while time.time() < deadline and len(started) < 2:
    time.sleep(0.01)
  time.sleep(0.05)
  assert sched.warm_at_once == _scheduler.STARTUP_AT_ONCE == 2
  assert started == [(2, 64), (2, 32)] and len(sched.running_jobs()) == 2  # largest first
  h = _serving(compile_workers=2)  # two threads: one warm job, one thread for a caller
  h.warmup(p, _x(5), background=True)
  assert h._dispatcher.compiler.scheduler.warm_at_once == 1
  f._dispatcher.compiler.preload(next(iter(f._dispatcher.families.values())), (2, 5))
  assert sched.warm_at_once == _scheduler.WARM_AT_ONCE  # the first call: traffic
  gate.set()
  assert f.wait(30) and h.wait(30)
  np.testing.assert_allclose(f(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  f.warmup(p, _x(5), background=True)  # a later warm-up, beside traffic: one at a time
  assert sched.warm_at_once == _scheduler.WARM_AT_ONCE and f.wait(30)
  g = _serving(compile_workers=3)
  g.warmup(p, _x(5), background=True, max_workers=3)  # named: kept after traffic starts
  gs = g._dispatcher.compiler.scheduler
  g._dispatcher.compiler.preload(next(iter(g._dispatcher.families.values())), (2, 5))
  assert gs.warm_at_once == 3
  assert g.wait(30)


def _fake_cudnn_primitive():
  """A primitive named as jax's cuDNN attention binds it (runs as tanh: CPU tests)."""
  from jax.extend import core as jex_core
  from jax.interpreters import mlir

  prim = jex_core.Primitive("dot_product_attention_fwd_test")
  prim.def_impl(jnp.tanh)
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  mlir.register_lowering(prim, mlir.lower_fun(jnp.tanh, multiple_results=False))
  return prim


_CUDNN = _fake_cudnn_primitive()


def test_a_warm_up_builds_cudnn_kernels_one_at_a_time(monkeypatch):
  # H200, bf16 BERT-base with attention="cudnn": 3 of 5 processes died of SIGSEGV while the
  # start-up warm-up built two buckets at once (one at a time, before session 35: none).
  from dynjax.bucketing import _attention

  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)
  monkeypatch.setattr(_scheduler, "STARTUP_CORES", 1)

  def model(params, x):  # the model's own cuDNN attention, inside a nested jit (pad-safe)
    return jax.jit(_CUDNN.bind)(x @ params["w"]).sum(1)

  def plain(params, x):
    return jnp.tanh(x @ params["w"]).sum(1)

  assert _attention.runs_cudnn(jax.make_jaxpr(model)(_params(), _x(5)), None)
  assert not _attention.runs_cudnn(jax.make_jaxpr(plain)(_params(), _x(5)), None)
  assert _attention.runs_cudnn(None, "cudnn") and not _attention.runs_cudnn(None, "pallas")
  p = _params()
  at_once = {}
  for name, fn in (("cudnn", model), ("plain", plain)):
    f = dynjax.jit(fn, dims={"x": "b, t, 4"}, padding="trust", serving=True,
                   compile_workers=3, buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
    f.warmup(p, _x(5), background=True)
    at_once[name] = f._dispatcher.compiler.scheduler.warm_at_once
    assert f.wait(30)
    want = jax.jit(fn)(p, _x(5))
    np.testing.assert_allclose(f(p, _x(5)), want, rtol=1e-6, atol=1e-6)
  assert at_once == {"cudnn": 1, "plain": _scheduler.STARTUP_AT_ONCE}


@pytest.mark.parametrize("keep", [16, 0])
def test_a_tier_up_compiles_its_tier_zero_lowering(monkeypatch, keep):
  # A tier-1 recompile compiles the module its tier-0 build lowered, with the full options:
  # lowering (trace, padding pass, StableHLO) holds the GIL while requests are served.
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  monkeypatch.setattr(serving_mod, "KEEP_LOWERED", keep)
  monkeypatch.setattr(serving_mod, "PRELOWER_MAX", 0)  # no lowering ahead of the builds
  p = _params()
  f = _serving(compile_workers=1)
  for t in (5, 9, 30):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  f.wait()
  fam = next(iter(f._dispatcher.families.values()))
  built = len(fam.buckets)
  assert built >= 2 and all(e.tier == 1 for e in fam.buckets.values())
  s = f.stats()
  assert s["lowerings"] == (built if keep else 2 * built), s
  assert s["lowerings_reused"] == (built if keep else 0)
  assert s["lowering_seconds"] > 0 and not fam.kept_lowered  # each taken by its tier-up
  for t in (5, 9, 30):  # the tier-1 executables, from the kept modules, are exact
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)


def test_kept_lowerings_are_bounded_and_a_blocking_warmup_tiers_up(monkeypatch):
  # (A blocking warmup's tier-0 builds ran before any scheduler existed and never tiered up.)
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  monkeypatch.setattr(serving_mod, "KEEP_LOWERED", 1)
  monkeypatch.setattr(serving_mod, "TIER_UP_IDLE_S", 1e9)  # no tier-up before wait()
  monkeypatch.setattr(serving_mod, "TIER_UP_AFTER", 10**9)
  p = _params()
  f = _serving(compile_workers=1)
  f.warmup(p, _x(5))  # every bucket of the range, tier 0 (no tier-up before wait())
  fam = next(iter(f._dispatcher.families.values()))
  assert len(fam.buckets) >= 2 and all(e.tier == 0 for e in fam.buckets.values())
  assert len(fam.kept_lowered) == 1
  # Each bucket lowered once: the lane does not lower ahead what a warmup build lowers.
  assert f.stats()["lowerings"] == len(fam.buckets) and not fam.prelowered
  f.wait()
  assert all(e.tier == 1 for e in fam.buckets.values())
  assert f.stats()["lowerings_reused"] == 1


def test_only_a_build_a_caller_waits_for_lowers_the_plan_ahead(monkeypatch):
  # Lowering holds the GIL: while a first call waits nothing else runs, so the plan's other
  # buckets lower then; a background build (a start-up warm-up's) runs beside the process's
  # own work and lowers only itself (an H200 restart's warm-up lowered 8 buckets nobody
  # compiled, 1.9 s of GIL, while its main thread built the request list).
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)
  p = _params()
  f = _serving(compile_workers=1)
  info = f.warmup(p, _x(5), background=True)
  assert info["pending"] >= 1 and f.wait(30)
  fam = next(iter(f._dispatcher.families.values()))
  assert not fam.prelowering and not fam.prelowered
  assert f.stats()["lowerings"] == f.stats()["compiles"] == len(fam.buckets)
  g = _serving(compile_workers=1)
  np.testing.assert_allclose(g(p, _x(5)), EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  gfam = next(iter(g._dispatcher.families.values()))
  assert gfam.prelowering  # the first call waited: the plan lowered meanwhile
  assert g.wait(30)


def test_pre_lowering_twice_lowers_each_planned_bucket_once(monkeypatch):
  # Two builds could both start the plan's pre-lowering (each checked fam.prelowering before
  # either set it); the second replaced the first one's queued futures, and each planned
  # bucket was lowered twice (an H100 warmup counted 6 lowerings for 5 buckets).
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: True)
  p = _params()
  f = _serving(compile_workers=1)
  f(p, _x(5))
  fam = next(iter(f._dispatcher.families.values()))
  comp = f._dispatcher.compiler
  comp.lane().submit(lambda: None).result()  # the first call's own pre-lowering is done
  before, queued = f.stats()["lowerings"], dict(fam.prelowered)
  fam.prelowering = False
  comp._prelower(fam, (2, 64))
  comp._prelower(fam, (2, 64))
  comp.lane().submit(lambda: None).result()
  assert fam.prelowered and all(fam.prelowered[b] is fut for b, fut in queued.items())
  assert f.stats()["lowerings"] - before == len(fam.prelowered) - len(queued)


@pytest.mark.parametrize("fails", [1, 2])
def test_a_stored_executable_that_fails_its_first_run_is_compiled_again(tmp_path, monkeypatch,
                                                                       fails):
  # An executable can load and still fail to run (jax 0.11.2 on CPU: "NOT_FOUND: Function
  # ... not found" on a deserialized executable's first call).  The call runs on a fresh
  # compile and the file is replaced; where the fresh one fails as well, its error is raised.
  from dynjax.jit import _store

  p = _params()
  kw = dict(dims={"x": "b, t, 4"}, cache_dir=str(tmp_path),
            buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  f = dynjax.jit(_model, **kw)
  f(p, _x(5))
  real_load = _store.ExecutableStore.load
  calls = {"n": 0}

  class Broken:
    def __init__(self, exe):
      self.exe = exe

    def __call__(self, *args):
      calls["n"] += 1
      raise jax.errors.JaxRuntimeError("NOT_FOUND: Function add_tanh_fusion not found")

    def __getattr__(self, name):
      return getattr(self.exe, name)

  monkeypatch.setattr(_store.ExecutableStore, "load",
                      lambda self, *a, **k: Broken(real_load(self, *a, **k)))
  g = dynjax.jit(_model, **kw)
  if fails == 2:  # the fresh compile fails too: its error reaches the caller
    monkeypatch.setattr(_family.Family, "compile_bucket", lambda *a, **k: _family.BucketEntry(
        Broken(None), (), 0))
    with pytest.warns(UserWarning, match="failed its first run"):
      with pytest.raises(jax.errors.JaxRuntimeError, match="NOT_FOUND"):
        g(p, _x(7))
    return
  with pytest.warns(UserWarning, match=r"bucket \(2, 8\) tier 0 failed its first run \("
                    r"JaxRuntimeError: NOT_FOUND"):
    np.testing.assert_allclose(g(p, _x(7)), EXACT(p, _x(7)), rtol=1e-6, atol=1e-6)
  assert calls["n"] == 1
  s = g.stats()
  assert (s["compiles"], s["loaded_from_store"], s["stored_rebuilt"]) == (1, 1, 1)
  fam = next(iter(g._dispatcher.families.values()))
  assert not isinstance(fam.buckets[(2, 8)].exe, _store.FirstRun)  # out of the hot path
  np.testing.assert_allclose(g(p, _x(6)), EXACT(p, _x(6)), rtol=1e-6, atol=1e-6)
  monkeypatch.setattr(_store.ExecutableStore, "load", real_load)
  h = dynjax.jit(_model, **kw)  # the replaced file loads and runs
  np.testing.assert_allclose(h(p, _x(7)), EXACT(p, _x(7)), rtol=1e-6, atol=1e-6)
  assert (h.stats()["compiles"], h.stats()["loaded_from_store"], h.stats()["stored_rebuilt"]) \
      == (0, 1, 0)


_AUTO_F = {}


@settings(max_examples=25, deadline=None)
@given(ts=st.lists(st.integers(1, 40), min_size=1, max_size=40),
       joint=st.booleans())
def test_property_kept_executors_follow_the_plan_and_every_call_is_seen_once(ts, joint):
  # One function per kind across examples (compiles are reused): whatever sizes come, in any
  # order, each call is exact, the plans see it exactly once, and once the calls are done a
  # size runs on the bucket the current plan gives it (no executor outlives a plan change).
  if joint not in _AUTO_F:
    buckets = (dynjax.buckets.auto(max_compiles=4, max=64) if joint else
               {"b": [2], "t": dynjax.buckets.auto(max_compiles=4, max=64)})
    _AUTO_F[joint] = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="auto", buckets=buckets)
  f, p = _AUTO_F[joint], _params()
  fam = None
  before = None
  for t in ts:
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-5, atol=1e-6)
    fam = fam or next(iter(f._dispatcher.families.values()))
    if before is None:
      before = fam.joint._n - 1 if joint else fam.observers[0][1]._n_obs - 1
  seen = fam.joint._n if joint else fam.observers[0][1]._n_obs
  assert seen - before == len(ts)
  for t in set(ts):
    sizes = (2, t)
    want = fam.bucket_of(sizes, observe=False)
    ex = next((e for e in fam.executors.values() if e.sizes == sizes and e.gen == fam.gen),
              None)
    if ex is not None:
      assert ex.bkey == want, (t, ex.bkey, want)


def test_replaced_executors_are_let_go_and_every_call_still_counts():
  # Each plan change replaces a family's executors; the replaced ones are folded and dropped
  # from the counters as the list grows (none keeps a replaced executable alive), and a call
  # that runs on one after that still counts (Executor.once).
  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, padding="trust",
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 128)})
  calls = 0
  for rnd in range(3):
    for t in range(1, 41):
      f(p, _x(t))
      calls += 1
    fam = next(iter(f._dispatcher.families.values()))
    if rnd == 0:  # (built after the last new bucket: executors before it were let go)
      f(p, _x(7))
      calls += 1
      old = fam.executors[(((2, 7, 4),), False, False)]
    fam.plan_changed()  # every executor stale
  counters = f._dispatcher.counters
  assert len(counters.live) <= 64  # 120 registered: the replaced ones went
  assert old not in counters.live and old.once  # swept: folded, let go
  old.run([p, _x(7)])  # a thread still holding it: its call counts all the same
  calls += 1
  assert f.stats()["calls"] == calls


def test_a_replaced_executable_goes_with_its_executors_at_the_next_miss():
  # A bucket replaced (a tier-up; here built again at tier 1 by hand) makes every executor
  # of its family stale.  The first miss after that lets them all go, from the family and
  # from the counters, so the replaced executable is freed then, not when each of their keys
  # comes back (before session 37 one that never came back kept it for good).
  import gc
  import weakref

  p = _params()
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, buckets={"b": [2], "t": dynjax.buckets.pow2(4, 128)})
  for t in [*range(1, 17)] * 2:  # (a new bucket moves the gen too: the second pass keeps)
    f(p, _x(t))
  d = f._dispatcher
  fam = next(iter(d.families.values()))
  assert len(fam.executors) == 16
  old = weakref.ref(fam.buckets[(2, 16)].exe)
  d.compiler.build_entry(fam, (2, 16), tier=1)
  assert len(fam.executors) == 16  # stale, still held
  np.testing.assert_allclose(f(p, _x(3)), EXACT(p, _x(3)), rtol=1e-6, atol=1e-6)
  assert list(fam.executors) == [(((2, 3, 4),), False, False)]
  assert all(ex.gen == fam.gen for ex in d.counters.live)
  gc.collect()
  assert old() is None
  for t in range(1, 17):
    np.testing.assert_allclose(f(p, _x(t)), EXACT(p, _x(t)), rtol=1e-6, atol=1e-6)
  assert f.stats()["calls"] == 49


def test_a_call_never_waits_on_a_covering_job_that_may_never_run(monkeypatch):
  # The race behind a hung restart test: the call found nothing compiled, then its covering
  # bucket finished before the call listed what it could wait for; the list held only a
  # queued job worth nothing now (it may never run), and the call waited on it forever.  The
  # call's own urgent future is always among those waited for.
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)
  p = _params()
  f = _serving(compile_workers=1)
  np.testing.assert_allclose(f(p, _x(40)), EXACT(p, _x(40)), rtol=1e-6, atol=1e-6)
  assert f.wait(30)
  fam = next(iter(f._dispatcher.families.values()))
  comp = f._dispatcher.compiler
  monkeypatch.setattr(serving_mod.Compiler, "job_value", lambda self, job: 0.0)
  comp.schedule(fam, (2, 32), 0)  # queued, covers t=5, never runs (worth nothing)
  real, looks = serving_mod.Compiler.larger_bucket, []

  def racy(self, fam_, bkey):  # the first look misses the top bucket (it finished just after)
    looks.append(bkey)
    return None if len(looks) == 1 else real(self, fam_, bkey)

  monkeypatch.setattr(serving_mod.Compiler, "larger_bucket", racy)
  got = []
  caller = threading.Thread(target=lambda: got.append(f(p, _x(5))), daemon=True)
  caller.start()
  caller.join(30)  # (it hung here before)
  assert not caller.is_alive() and len(got) == 1, "the call waited on a job that never runs"
  np.testing.assert_allclose(got[0], EXACT(p, _x(5)), rtol=1e-6, atol=1e-6)
  assert len(looks) == 2 and f.stats()["per_bucket_calls"]["b=2, t=64"] == 2


def test_at_exit_running_compiles_end_and_queued_ones_are_dropped(tmp_path):
  # A compile worker that came back from XLA while the interpreter finalized was ended inside
  # XLA's frames ("FATAL: exception not rethrown": the process aborted, once, 2-core box).  At
  # exit the schedulers are closed: a running job ends first, a queued one never starts.
  import subprocess
  import sys

  code = f"""
import os, time
from dynjax.jit import _scheduler
s = _scheduler.CompileScheduler(1, lambda job: 1.0, name="t")
def job(name, seconds):
  def build():
    time.sleep(seconds)
    open(os.path.join({str(tmp_path)!r}, name), "w").close()
  return build
s.submit("a", job("running", 1.0))
time.sleep(0.2)  # a runs
s.submit("b", job("queued", 0.0))
print("exit", flush=True)
"""
  got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert got.returncode == 0, got.stderr[-2000:]
  assert sorted(os.listdir(tmp_path)) == ["running"]
