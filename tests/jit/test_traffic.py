"""An ``auto`` policy's traffic kept beside a family's executables (``jit/_traffic.py``): a
restart plans from what the processes before it served."""

from __future__ import annotations

import json
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dynjax
from dynjax._config import config
from dynjax.jit import _scheduler, _traffic
from dynjax.jit import _serving as serving_mod
from dynjax.jit._scheduler import CompileScheduler


def _model(params, x):
  h = jnp.tanh(x @ params["w"] + params["b"])
  return jax.nn.softmax(h, axis=-1).sum(1)


P = {"w": jnp.asarray(np.random.RandomState(0).randn(4, 4).astype(np.float32)),
     "b": jnp.asarray(np.random.RandomState(1).randn(4).astype(np.float32))}
EXACT = jax.jit(_model)
SHAPES = jax.ShapeDtypeStruct((2, 5, 4), jnp.float32)
# Short requests most of the time, a few long ones: a plan of 6 puts buckets where they are.
STREAM = [5, 6, 7, 5, 6, 9, 20, 21, 5, 6, 7, 40, 5, 6, 7, 12] * 4  # 64 calls: a re-plan at the last


def _x(t):
  return np.random.RandomState(t).randn(2, t, 4).astype(np.float32)


_MADE: list = []


@pytest.fixture(autouse=True)
def _idle_after():
  """Every server of a test is idle when it ends: a background compile left running would
  write (or fail to write) its store during the next test."""
  yield
  while _MADE:
    assert _MADE.pop().wait(60)


def _server(cache, workers=1):
  f = dynjax.jit(_model, dims={"x": "b, t, 4"}, serving=True, compile_workers=workers,
                 cache_dir=str(cache),
                 buckets={"b": [2], "t": dynjax.buckets.auto(max_compiles=6, max=64)})
  _MADE.append(f)
  return f


def _family(f):
  return next(iter(f._dispatcher.families.values()))


def _kept(cache, f, calls, timeout=10.0):
  """The traffic file of ``f``'s family once it records ``calls`` calls (saves are async)."""
  path = _traffic.path(_family(f).store())
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      with open(path) as fh:
        rec = json.load(fh)
      if rec["policies"][1]["observations"] >= calls:
        return rec
    except (OSError, ValueError):
      pass
    time.sleep(0.02)
  raise AssertionError(f"{path} never recorded {calls} calls")


@pytest.fixture
def one_tier(monkeypatch):
  monkeypatch.setattr(serving_mod, "on_gpu", lambda: False)  # one tier: counts builds


def _serve_on_top_bucket_only(f):
  """The process of a server stopped before its background compiles caught up: every call
  served on the first covering bucket (max), none of its own buckets built."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(serving_mod.Compiler, "_tier0_value", lambda self, fam, bkey: 0.0)
    for t in STREAM:
      f(P, _x(t))


def test_a_restart_warms_up_the_plan_of_its_predecessors_traffic(tmp_path, monkeypatch,
                                                                  one_tier):
  f = _server(tmp_path)
  _serve_on_top_bucket_only(f)
  fam = _family(f)
  assert [b for b, _ in fam.store().stored()] == [(2, 64)]
  rec = _kept(tmp_path, f, len(STREAM))
  sizes = dict((n, c) for n, c in rec["policies"][1]["sizes"])
  assert sizes == {t: STREAM.count(t) for t in set(STREAM)} and rec["policies"][0] is None
  plan = _restored_plan(rec)
  assert len(plan) > 2 and 64 in plan, plan  # the traffic planned more than the top bucket

  g = _server(tmp_path)  # a restart: its warm-up builds the plan, not only what is stored
  summary = g.warmup(P, SHAPES, progress=False)
  assert sorted(b[1] for b in summary["buckets"]) == list(plan)
  assert summary["loaded"] == 1 and summary["compiled"] == len(plan) - 1
  for t in (5, 7, 9, 21, 40, 64, 3):
    np.testing.assert_allclose(g(P, _x(t)), EXACT(P, _x(t)), rtol=1e-6, atol=1e-6)
  s = g.stats()
  assert s["compiles"] == len(plan) - 1 and s["served_on_larger_bucket"] == 0, s

  # Without kept traffic, the same restart builds what is stored and nothing else.
  monkeypatch.setattr(config, "keep_traffic", False)
  h = _server(tmp_path)
  assert h.warmup(P, SHAPES, progress=False)["compiled"] == 0


def _restored_plan(rec):
  """The plan of a fresh policy that holds the stored bucket and takes the kept record."""
  p = dynjax.buckets.auto(max_compiles=6, max=64)
  p.adopt(64)
  assert p.restore(rec["policies"][1])
  return p.sizes()


def test_a_restart_without_warmup_plans_its_first_call_from_the_kept_traffic(
    tmp_path, monkeypatch, one_tier):
  f = _server(tmp_path)
  _serve_on_top_bucket_only(f)
  rec = _kept(tmp_path, f, len(STREAM))
  g = _server(tmp_path)
  np.testing.assert_allclose(g(P, _x(5)), EXACT(P, _x(5)), rtol=1e-6, atol=1e-6)
  pol = _family(g).policies[1]
  assert pol.sizes() == _restored_plan(rec) != (64,)  # planned before its first observe
  assert pol.traffic()["observations"] == len(STREAM) + 1


@pytest.mark.parametrize("cores", [1, 10_000])
def test_the_restored_plans_new_buckets_wait_for_traffic_on_every_host(
    tmp_path, monkeypatch, one_tier, cores):
  # cores: STARTUP_CORES; 1 (every host has spare cores) or 10,000 (none has): the restored
  # plan's new buckets are value-ordered jobs from the start, not warm jobs built before
  # traffic (session 37: on the H200 those slowed a restart's start-up by 2.2 s on average).
  monkeypatch.setattr(_scheduler, "STARTUP_CORES", cores)
  monkeypatch.setattr(_scheduler, "STARTUP_AT_ONCE", 1)
  f = _server(tmp_path)
  _serve_on_top_bucket_only(f)
  _kept(tmp_path, f, len(STREAM))
  gate = threading.Event()
  built = serving_mod.Compiler.build_entry

  def slow(self, fam, bkey, *a, **kw):  # the restored plan's buckets wait for the gate
    if bkey != (2, 64):
      gate.wait(30)
    return built(self, fam, bkey, *a, **kw)

  monkeypatch.setattr(serving_mod.Compiler, "build_entry", slow)
  g = _server(tmp_path)
  summary = g.warmup(P, SHAPES, background=True)
  new = [b for b in summary["buckets"] if b != (2, 64)]
  assert new
  sched = g._dispatcher.compiler.scheduler
  deadline = time.time() + 10
  while time.time() < deadline and (2, 64) not in _family(g).buckets:  # the stored one loads
    time.sleep(0.01)
  time.sleep(0.05)
  queued = [j for j in sched.pending_jobs() if j.info[1] in new]
  assert queued and not any(j.warm for j in queued)
  assert not sched.running_jobs()  # (none is worth a compile before traffic)
  np.testing.assert_allclose(g(P, _x(40)), EXACT(P, _x(40)), rtol=1e-6, atol=1e-6)
  assert not any(j.warm for j in sched.pending_jobs() if j.info[1] in new)
  assert sched.warm_at_once == _scheduler.WARM_AT_ONCE  # traffic: one at a time from here
  gate.set()
  assert g.wait(30)
  for t in (5, 21):
    np.testing.assert_allclose(g(P, _x(t)), EXACT(P, _x(t)), rtol=1e-6, atol=1e-6)


def test_a_damaged_or_foreign_traffic_file_is_ignored_and_replaced(tmp_path, monkeypatch,
                                                                   one_tier, caplog):
  f = _server(tmp_path)
  _serve_on_top_bucket_only(f)
  _kept(tmp_path, f, len(STREAM))
  path = _traffic.path(_family(f).store())
  good = open(path).read()
  for bad in ("{not json", json.dumps({"format": 1, "fingerprint": "another",
                                       "policies": [None, None]}),
              good.replace('"observations": ', '"observations": -')):
    with open(path, "w") as fh:
      fh.write(bad)
    g = _server(tmp_path)
    with caplog.at_level(logging.INFO, logger="dynjax"):
      summary = g.warmup(P, SHAPES, progress=False)
    # Planned from nothing: the cold ladder (max, max/2, max/4), not the kept traffic's plan.
    assert sorted(b[1] for b in summary["buckets"]) == [16, 32, 64]
    assert "ignored" in caplog.text
    caplog.clear()
  for t in STREAM[:16]:  # its own re-plans (8, 16 calls) write the file again
    g(P, _x(t))
  assert _kept(tmp_path, g, 16)["fingerprint"] == _family(g).store().fingerprint


def test_a_record_of_another_policy_is_not_taken():
  a = dynjax.buckets.auto(max_compiles=4, max=64)
  for n in STREAM:
    a.observe(a.bucket(n) and n)
  b = dynjax.buckets.auto(max_compiles=5, max=64)
  assert not b.restore(a.traffic()) and b.traffic()["observations"] == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=8, max_size=300), st.integers(2, 12))
@example(sizes=[1, 1, 1, 1, 1, 1, 9, 25, 1, 41, 57], k=10)  # the fit saw the buckets in the
# order they were first timed: (8, 32, 48, 64, 512) restored against (8, 16, 32, 64, 512)
def test_a_restored_policy_plans_as_the_one_that_saw_the_traffic(sizes, k):
  a = dynjax.buckets.auto(max_compiles=k, max=512)
  for n in sizes:
    a.observe(n)
    a.record_time(a.bucket(n), 1e-3 * (1 + a.bucket(n) / 64))
  rec = json.loads(json.dumps(a.traffic()))  # through JSON, as in the file
  r = dynjax.buckets.auto(max_compiles=k, max=512)
  assert r.restore(rec)
  fresh = dynjax.buckets.auto(max_compiles=k, max=512)
  fresh._hist.update(a._hist)  # the same evidence, planned once
  fresh._n_obs = a._n_obs
  fresh._times = {b: list(v) for b, v in a._times.items()}
  fresh._replan()
  assert r.sizes() == fresh.sizes()
  assert r.traffic()["sizes"] == a.traffic()["sizes"]


def test_value_order_adds_the_bucket_that_saves_the_most_first():
  p = dynjax.buckets.auto(max_compiles=8, max=512)
  for n, c in ((40, 50), (150, 30), (300, 15), (450, 5)):
    for _ in range(c):
      p.observe(n)
  for b in (64, 128, 256, 512):
    p.record_time(b, 1e-3 * (1 + (b / 128) ** 2))
  have, new = {512}, [64, 160, 304, 456]
  order = p.value_order(new, have)
  assert sorted(order) == sorted(new)
  table = set(have)
  p._model = p.cost_model()
  for b in order:  # each pick is the best of what is left
    left = [x for x in new if x not in table]
    assert p.expected_cost(table | {b}) == min(p.expected_cost(table | {x}) for x in left)
    table.add(b)
  p._model = None


def test_demote_turns_queued_warm_jobs_value_ordered():
  gate = threading.Event()
  sched = CompileScheduler(1, value=lambda job: 0.0)
  try:
    sched.submit("running", lambda: gate.wait(10), warm=True, info=(None, "running"))
    deadline = time.time() + 10
    while not sched.running() and time.time() < deadline:
      time.sleep(0.01)
    futs = [sched.submit(k, lambda: None, warm=True, info=(None, k)) for k in ("a", "b")]
    assert sched.demote(lambda j: j.info[1] == "a") == 1
    jobs = {j.key: j for j in sched.pending_jobs()}
    assert not jobs["a"].warm and jobs["b"].warm
    gate.set()
    futs[1].result(10)  # a warm job still runs; the demoted one waits for a value > 0
    time.sleep(0.1)
    assert not futs[0].done()
  finally:
    gate.set()
    sched.close()
