"""dynjax.jit core: results equal jax.jit at the exact shape, compile counts, threads, stages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynjax

W = np.random.RandomState(0).randn(6, 5).astype(np.float32)

# Pad-safe functions (prefix of the padded result = exact result): run with padding="trust".
# Each takes x: f32[b, t, 6] (b, t dynamic).
PAD_SAFE = {
    "tanh": lambda x: jnp.tanh(x),
    "affine": lambda x: x * 2.0 + 1.0,
    "matmul_static": lambda x: x @ W,
    "sum_features": lambda x: x.sum(-1),
    "max_features": lambda x: x.max(-1),
    "softmax_features": lambda x: jax.nn.softmax(x, axis=-1),
    "layernorm_features": lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(
        x.var(-1, keepdims=True) + 1e-5),
    "gelu_mlp": lambda x: jax.nn.gelu(x @ W) @ W.T,
    "where": lambda x: jnp.where(x > 0, x, 0.1 * x),
    "abs_sqrt": lambda x: jnp.sqrt(jnp.abs(x) + 1.0),
    "exp_log": lambda x: jnp.log1p(jnp.exp(-jnp.abs(x))),
    "two_outputs": lambda x: (jnp.sin(x), x.sum(-1) * 3),
    "dict_output": lambda x: {"a": jnp.cos(x), "b": x[..., :2]},
    "einsum_static": lambda x: jnp.einsum("btd,de->bte", x, W),
    "argmax_features": lambda x: jnp.argmax(x, -1),
    "clip_round": lambda x: jnp.round(jnp.clip(x, -1, 1) * 4) / 4,
    "cast_int": lambda x: (x * 10).astype(jnp.int32),
    "sort_features": lambda x: jnp.sort(x, axis=-1),
    "logsumexp_features": lambda x: jax.nn.logsumexp(x, axis=-1),
    "cumsum_features": lambda x: jnp.cumsum(x, axis=-1),
}
# Functions that mix along a dynamic axis: only exact execution is right for them here.
MIXING = {
    "sum_time": lambda x: x.sum(1),
    "mean_time": lambda x: x.mean(1),
    "cumsum_time": lambda x: jnp.cumsum(x, axis=1),
    "attention": lambda x: jax.nn.softmax(x @ jnp.swapaxes(x, 1, 2), -1) @ x,
    "flip_time": lambda x: x[:, ::-1],
}


def _check(got, want, rtol=1e-6, atol=1e-6):
  got_l, got_t = jax.tree_util.tree_flatten(got)
  want_l, want_t = jax.tree_util.tree_flatten(want)
  assert got_t == want_t
  for g, w in zip(got_l, want_l, strict=True):
    assert isinstance(g, np.ndarray), type(g)
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(g, np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(PAD_SAFE))
@settings(max_examples=12)  # each example compiles jax.jit at its exact shape: 12 x 15 functions
@given(b=st.integers(1, 5), t=st.integers(1, 40))
def test_trust_matches_jax_jit(name, b, t):
  fn = PAD_SAFE[name]
  f = _wrapped("trust", name)
  x = np.random.RandomState(b * 100 + t).randn(b, t, 6).astype(np.float32)
  _check(f(x), jax.jit(fn)(x))


@pytest.mark.parametrize("name", sorted(MIXING))
@settings(max_examples=12)
@given(b=st.integers(1, 4), t=st.integers(1, 30))
def test_exact_matches_jax_jit(name, b, t):
  fn = MIXING[name]
  f = _wrapped("exact", name)
  x = np.random.RandomState(b * 100 + t).randn(b, t, 6).astype(np.float32)
  _check(f(x), jax.jit(fn)(x))


_WRAPPED: dict = {}


def _wrapped(padding, name):
  key = (padding, name)
  if key not in _WRAPPED:
    fn = (PAD_SAFE if padding == "trust" else MIXING)[name]
    _WRAPPED[key] = dynjax.jit(fn, dims={"x": "b, t, 6"}, padding=padding,
                               buckets={"b": dynjax.buckets.pow2(1, 8),
                                        "t": dynjax.buckets.pow2(4, 64)})
  return _WRAPPED[key]


def test_compiles_at_most_buckets_touched(compiles):
  f = dynjax.jit(lambda x: jnp.tanh(x) * 2, dims={"x": "b, t"}, padding="trust",
                 buckets={"b": [8], "t": dynjax.buckets.pow2(8, 256)})
  rng = np.random.RandomState(0)
  lengths = rng.randint(1, 257, size=60)
  for t in lengths:
    x = rng.randn(8, int(t)).astype(np.float32)
    np.testing.assert_allclose(f(x), np.tanh(x) * 2, rtol=1e-6)
  touched = {max(8, 1 << (int(t) - 1).bit_length()) for t in lengths}
  assert compiles() == len(touched) == f.stats()["compiles"]
  before = compiles()
  for t in lengths[:20]:
    f(rng.randn(8, int(t)).astype(np.float32))
  assert compiles() == before  # repeat calls compile nothing
  s = f.stats()
  assert s["calls"] == 80 and s["cache_hits"] == 80 - len(touched)
  assert 0.0 < s["padded_fraction"] < 0.5
  assert s["host_syncs"] == 80


def test_numpy_in_numpy_out_device_in_device_out():
  f = dynjax.jit(lambda x: x + 1, dims={"x": "t"}, padding="trust")
  x = np.arange(5, dtype=np.float32)
  y = f(x)
  assert isinstance(y, np.ndarray) and y.shape == (5,)
  yd = f(jnp.asarray(x))
  assert isinstance(yd, jax.Array) and yd.shape == (5,)
  np.testing.assert_array_equal(np.asarray(yd), x + 1)


def test_queued_results_never_see_a_later_calls_input():
  # return_padded does not wait for results: 300 queued calls, each with its own padded input,
  # must all come out right. (A pooled host buffer, which the CPU client may alias, gave 293
  # wrong results of 300 here.)
  fn = lambda x: jnp.cumsum(jnp.sin(x), axis=1) + x
  f = dynjax.jit(fn, dims={"x": "b, t"}, padding="trust", return_padded=True,
                 buckets={"b": [64], "t": dynjax.buckets.pow2(64, 256)})
  xs = [np.full((64, 200 + i % 7), float(i), np.float32) for i in range(300)]
  outs = [f(x) for x in xs]
  ref = jax.jit(fn)
  for x, p in zip(xs, outs, strict=True):
    np.testing.assert_allclose(p.unpad(), np.asarray(ref(x)), rtol=1e-6, atol=1e-5)


def test_threads_compile_each_bucket_once(compiles):
  f = dynjax.jit(lambda x: jnp.sin(x) + x.sum(-1, keepdims=True), dims={"x": "b, t, 4"},
                 padding="trust", buckets={"b": [4], "t": dynjax.buckets.pow2(4, 64)})
  errors = []

  def worker(seed):
    rng = np.random.RandomState(seed)
    try:
      for _ in range(50):
        x = rng.randn(int(rng.randint(1, 5)), int(rng.randint(1, 65)), 4).astype(np.float32)
        np.testing.assert_allclose(f(x), np.sin(x) + x.sum(-1, keepdims=True), rtol=1e-5,
                                   atol=1e-6)
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors[0]
  s = f.stats()
  assert s["calls"] == 400
  assert s["compiles"] == len(s["per_bucket_calls"]) == compiles()


def test_padded_passthrough_and_return_padded(compiles):
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"}, padding="trust", return_padded=True,
                 buckets={"b": [4], "t": dynjax.buckets.pow2(8, 64)})
  g = dynjax.jit(lambda x: x + 1, dims={"x": "b, t"}, padding="trust",
                 buckets={"b": [4], "t": dynjax.buckets.pow2(8, 64)})
  x = np.random.RandomState(0).randn(3, 13).astype(np.float32)
  p = f(x)
  assert isinstance(p, dynjax.Padded) and p.shape == (3, 13) and p.buffer.shape == (4, 16)
  np.testing.assert_allclose(p.unpad(), x * 2)
  y = g(p)  # the buffer already has g's bucket shape: no re-padding
  np.testing.assert_allclose(np.asarray(y), x * 2 + 1, rtol=1e-6)
  assert y.shape == (3, 13)


def test_dims_auto_promotes_changed_axes():
  f = dynjax.jit(lambda x, m: x * m, padding="trust")
  x5, m5 = np.ones((2, 5), np.float32), np.ones((2, 5), np.float32)
  np.testing.assert_array_equal(f(x5, m5), x5)
  x7 = np.full((2, 7), 2.0, np.float32)
  np.testing.assert_array_equal(f(x7, x7), x7 * x7)
  for t in (3, 9, 12):
    x = np.full((2, t), 3.0, np.float32)
    np.testing.assert_array_equal(f(x, x), x * x)
  text = f.explain()
  assert "x: float32[2, d0]" in text and "m: float32[2, d0]" in text  # shared variable


def test_bare_decorator_is_auto():
  @dynjax.jit
  def f(x):
    return x + 1

  assert f(np.ones(3, np.float32)).shape == (3,)
  assert f(np.ones(4, np.float32)).shape == (4,)


def test_static_argnames():
  @dynjax.jit(dims={"x": "t"}, static_argnames="k", padding="trust")
  def f(x, k):
    return x * k

  np.testing.assert_array_equal(f(np.ones(3, np.float32), 3), np.full(3, 3.0))
  np.testing.assert_array_equal(f(np.ones(3, np.float32), k=4), np.full(3, 4.0))


def test_kwargs_and_pytree_dims():
  @dynjax.jit(dims={"batch": {"tokens": "b, t", "mask": "b, t"}}, padding="trust")
  def f(batch, scale):
    return batch["tokens"] * batch["mask"] * scale

  tok = np.arange(12, dtype=np.float32).reshape(3, 4)
  mask = (tok % 2).astype(np.float32)
  np.testing.assert_array_equal(f(scale=np.float32(2), batch={"tokens": tok, "mask": mask}),
                                tok * mask * 2)


def test_overflow_modes():
  f = dynjax.jit(lambda x: x + 1, dims={"x": "t"}, padding="trust",
                 buckets={"t": dynjax.buckets.pow2(4, 16)})
  with pytest.raises(dynjax.OutOfBucketsError) as e:
    f(np.ones(17, np.float32))
  assert str(e.value) == (
      "f: dimension over the largest bucket:\n"
      "  t = 17 (x.shape[0]) is above the largest bucket 16 of "
      "dynjax.buckets.pow2(min=4, max=16)\n"
      "Raise the policy's max, or pass overflow=\"grow\" (compile a larger bucket) or "
      "overflow=\"exact\" (run unpadded).".replace("f:", "<lambda>:"))
  g = dynjax.jit(lambda x: x + 1, dims={"x": "t"}, padding="trust", overflow="exact",
                 buckets={"t": dynjax.buckets.pow2(4, 16)})
  assert g(np.ones(17, np.float32)).shape == (17,)
  assert g.stats()["exact_calls"] == 1
  h = dynjax.jit(lambda x: x + 1, dims={"x": "t"}, padding="trust", overflow="grow",
                 buckets={"t": dynjax.buckets.pow2(4, 16)})
  assert h(np.ones(17, np.float32)).shape == (17,)
  assert "t=32" in h.stats()["per_bucket_calls"]


def test_max_executables_evicts_lru(compiles):
  f = dynjax.jit(lambda x: x - 1, dims={"x": "t"}, padding="trust", max_executables=2,
                 buckets={"t": dynjax.buckets.pow2(1, 1024)})
  for t in [1, 2, 4, 8, 16, 1, 2]:
    np.testing.assert_array_equal(f(np.ones(t, np.float32)), np.zeros(t))
  s = f.stats()
  assert s["executables"] == 2 and s["evictions"] == 5 and s["compiles"] == 7
  # The family holds only the two buckets the cache holds (session 36: it held all five;
  # that their executables are collected: test_an_lru_bound_keeps_memory_flat_over_many_shapes).
  fam = next(iter(f._dispatcher.families.values()))
  assert sorted(fam.buckets) == [(1,), (2,)]
  # ... and a size whose bucket was evicted compiles it again, exact.
  np.testing.assert_array_equal(f(np.ones(16, np.float32)), np.zeros(16))
  assert f.stats()["compiles"] == 8 and sorted(fam.buckets) == [(2,), (16,)]


def test_max_executables_evicts_the_least_recently_run_bucket(compiles):
  # Every run renews its bucket, a kept executor's too (before session 37 a call that found
  # its bucket built did not: the bound evicted the oldest build, here t=1, used just now).
  f = dynjax.jit(lambda x: x - 1, dims={"x": "t"}, padding="trust", max_executables=2,
                 buckets={"t": dynjax.buckets.pow2(1, 1024)})
  for t in [1, 2, 1, 1, 4]:
    np.testing.assert_array_equal(f(np.ones(t, np.float32)), np.zeros(t))
  fam = next(iter(f._dispatcher.families.values()))
  assert sorted(fam.buckets) == [(1,), (4,)] and compiles() == 3
  assert len(fam.executors) == 1  # kept; those of the evicted bucket went stale and were let go
  for t in [2, 4, 1, 3]:  # 2: built again (evicts 1); 4 kept; 1 built again (evicts 2); 3 runs on 4
    np.testing.assert_array_equal(f(np.ones(t, np.float32)), np.zeros(t))
  assert compiles() == 5 and sorted(fam.buckets) == [(1,), (4,)]
  assert f.stats()["calls"] == 9


def test_an_lru_bound_keeps_memory_flat_over_many_shapes():
  # 12 buckets through a bound of 3: the executables of the 9 evicted ones are collected.
  import gc
  import weakref

  f = dynjax.jit(lambda x: x * 3, dims={"x": "t"}, padding="trust", max_executables=3,
                 buckets={"t": dynjax.buckets.pow2(1, 1 << 12)})
  refs = []
  for k in range(12):
    t = 1 << k
    np.testing.assert_array_equal(f(np.ones(t, np.float32)), np.full(t, 3, np.float32))
    fam = next(iter(f._dispatcher.families.values()))
    refs.append(weakref.ref(fam.buckets[(t,)].exe))
  gc.collect()
  assert [r() is not None for r in refs] == [False] * 9 + [True] * 3


def test_warmup_compiles_every_bucket_concurrently(compiles):
  f = dynjax.jit(lambda x: jnp.cos(x), dims={"x": "b, t"}, padding="trust",
                 buckets={"b": [2, 4], "t": dynjax.buckets.pow2(8, 64)})
  summary = f.warmup(np.zeros((2, 8), np.float32), progress=False)
  assert sorted(summary["buckets"]) == [(b, t) for b in (2, 4) for t in (8, 16, 32, 64)]
  assert summary["compiled"] == 8 == compiles()
  for b, t in [(1, 3), (4, 64), (3, 20)]:
    f(np.ones((b, t), np.float32))
  assert compiles() == 8


def test_stages():
  f = dynjax.jit(lambda x: (x * 2).sum(-1), dims={"x": "b, t, 3"}, padding="trust",
                 buckets={"b": [4], "t": dynjax.buckets.pow2(8, 32)})
  x = np.ones((2, 5, 3), np.float32)
  traced = f.trace(x)
  assert traced.dim_vars == ("b", "t") and traced.sizes == (2, 5)
  assert "f32[b,t,3]" in traced.as_text()
  assert str(traced.out_shapes) .startswith("ShapeDtypeStruct(shape=(b, t)")
  lowered = traced.lower()
  assert lowered.bucket == (4, 8)
  assert "stablehlo" in lowered.as_text() or "mhlo" in lowered.as_text()
  compiled = lowered.compile()
  np.testing.assert_array_equal(compiled(x), np.full((2, 5), 6.0))
  with pytest.raises(dynjax.ShapeMismatchError, match="need bucket"):
    compiled(np.ones((2, 20, 3), np.float32))


def test_trust_compound_output_falls_back_with_warning():
  f = dynjax.jit(lambda x: x.reshape(-1), dims={"x": "b, t"}, padding="trust")
  with pytest.warns(UserWarning, match=r"output 0 has shape \(b\*t\)"):
    y = f(np.arange(6, dtype=np.float32).reshape(2, 3))
  np.testing.assert_array_equal(y, np.arange(6))
  assert f.stats()["fallbacks"] and "FALLBACK" in f.explain()


def test_shape_dependent_python_branch_traces_under_a_guard():
  def f(x):
    if x.shape[0] > 3:  # shape-dependent Python control flow: decided by an inferred guard
      return x * 2
    return x

  g = dynjax.jit(f, dims={"x": "t"}, padding="trust")
  np.testing.assert_array_equal(g(np.ones(5, np.float32)), np.full(5, 2.0))
  fam = next(iter(g._dispatcher.families.values()))
  assert fam.guards == ("t >= 4",) and fam.mode == "trust" and g.stats()["fallbacks"] == []
  assert "guards inferred while tracing: t >= 4" in g.explain()
  with pytest.warns(UserWarning, match=r"sizes t = 2 violate the guard\(s\) t >= 4"):
    np.testing.assert_array_equal(g(np.ones(2, np.float32)), np.ones(2))  # runs exact
  assert g.stats()["exact_calls"] == 1


def test_untraceable_function_falls_back():
  def f(x):
    return x * float(x.shape[0] % 2)  # a symbolic dim cannot become a Python float

  g = dynjax.jit(f, dims={"x": "t"}, padding="trust")
  with pytest.warns(UserWarning, match="symbolic tracing failed"):
    np.testing.assert_array_equal(g(np.ones(5, np.float32)), np.ones(5))
  np.testing.assert_array_equal(g(np.ones(2, np.float32)), np.zeros(2))


def test_constraints_let_models_slice_static_tables():
  table = jnp.arange(32, dtype=jnp.float32)

  @dynjax.jit(dims={"x": "t"}, buckets={"t": dynjax.buckets.pow2(4, 32)}, padding="trust")
  def f(x):
    return x + table[: x.shape[0]]

  np.testing.assert_array_equal(f(np.zeros(7, np.float32)), table[:7])
  assert f.stats()["fallbacks"] == []


def test_persistent_cache_second_process_compiles_nothing(tmp_path):
  # jax records backend_compile_duration around cache lookups too, so count the persistent
  # cache's own hit/miss events: a restarted process must miss nothing.
  script = textwrap.dedent(f"""
      import collections, jax, jax.numpy as jnp, numpy as np, jax.monitoring
      ev = collections.Counter()
      jax.monitoring.register_event_listener(lambda e, **k: ev.update([e]))
      import dynjax
      f = dynjax.jit(lambda x: jnp.tanh(x) @ jnp.ones((x.shape[1], 3)), dims={{"x": "b, t"}},
                     padding="trust", cache_dir={str(tmp_path)!r},
                     buckets={{"b": [4], "t": dynjax.buckets.pow2(8, 64)}})
      for t in (3, 9, 20, 40):
        f(np.ones((4, t), np.float32))
      print("MISSES", ev["/jax/compilation_cache/cache_misses"],
            "HITS", ev["/jax/compilation_cache/cache_hits"],
            "LOADED", f.stats()["loaded_from_store"], "COMPILES", f.stats()["compiles"])
      np.testing.assert_allclose(f(np.full((4, 5), 0.5, np.float32)),
                                 np.full((4, 3), 5 * np.tanh(0.5), np.float32), rtol=1e-6)
  """)
  runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120) for _ in range(2)]
  for r in runs:
    assert r.returncode == 0, r.stderr
  # Buckets that go to dynjax's executable store are not written to JAX's persistent cache
  # as well (no cache-miss event is recorded for them either).
  assert runs[0].stdout.split() == ["MISSES", "0", "HITS", "0", "LOADED", "0", "COMPILES",
                                    "4"], runs[0].stdout
  # The restarted process neither compiles nor lowers: dynjax's executable store answers
  # before JAX's persistent cache is even asked.
  assert runs[1].stdout.split() == ["MISSES", "0", "HITS", "0", "LOADED", "4", "COMPILES",
                                    "0"], runs[1].stdout


_JAX_CACHE = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
              "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def jax_cache_config(monkeypatch):
  """JAX's compilation-cache settings as they were, after the test; dynjax's record of the
  directory it set, empty during it."""
  from dynjax import _jax_private

  saved = {k: getattr(jax.config, k) for k in _JAX_CACHE}
  monkeypatch.setattr(_jax_private, "_CACHE_SET", [])
  yield
  for k, v in saved.items():
    jax.config.update(k, v)


def test_cache_dir_leaves_the_jax_cache_a_process_chose_alone(tmp_path, jax_cache_config,
                                                              caplog):
  # A process that set JAX's compilation cache keeps it, thresholds included: dynjax's store
  # still goes to its own cache_dir.  Before, every jax.jit of the process moved into
  # dynjax's directory and persisted each compile.
  mine = str(tmp_path / "mine")
  jax.config.update("jax_compilation_cache_dir", mine)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
  with caplog.at_level("INFO", logger="dynjax"):
    f = dynjax.jit(lambda x: x * 2, dims={"x": "t"}, padding="trust",
                   cache_dir=str(tmp_path / "dj"))
  assert jax.config.jax_compilation_cache_dir == mine
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
  assert f"JAX's own compilation cache stays where this process put it ({mine})" in caplog.text
  np.testing.assert_array_equal(f(np.ones(3, np.float32)), np.full(3, 2.0))
  assert any((tmp_path / "dj").iterdir())  # the bucket went to dynjax's store


def test_cache_dir_points_an_unset_jax_cache_at_itself(tmp_path, jax_cache_config):
  jax.config.update("jax_compilation_cache_dir", None)
  dynjax.jit(lambda x: x, dims={"x": "t"}, cache_dir=str(tmp_path / "a"))
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
  # dynjax's own setting is dynjax's to move: a later function with another cache_dir
  dynjax.jit(lambda x: x, dims={"x": "t"}, cache_dir=str(tmp_path / "b"))
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "b")


def test_async_compile_serves_on_a_larger_bucket_while_compiling(compiles):
  f = dynjax.jit(lambda x: x * 2, dims={"x": "t"}, padding="trust", async_compile=True,
                 buckets={"t": dynjax.buckets.pow2(4, 64)})
  np.testing.assert_array_equal(f(np.ones(60, np.float32)), np.full(60, 2.0))  # blocks: first
  np.testing.assert_array_equal(f(np.ones(3, np.float32)), np.full(3, 2.0))  # served on t=64
  assert f.stats()["per_bucket_calls"]["t=64"] == 2
  f.wait()
  np.testing.assert_array_equal(f(np.ones(3, np.float32)), np.full(3, 2.0))
  s = f.stats()
  assert s["per_bucket_calls"]["t=4"] == 1 and s["compiles"] == 2 == compiles()


def test_device_inputs_with_padded_outputs_stay_on_device():
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"}, padding="trust", return_padded=True,
                 buckets={"b": [2], "t": dynjax.buckets.pow2(4, 64)})
  p = f(jnp.ones((2, 5)))
  assert isinstance(p.buffer, jax.Array) and p.buffer.shape == (2, 8) and p.shape == (2, 5)
  assert f.stats()["host_syncs"] == 0


def test_background_warmup_with_async_compile_never_blocks_after_the_largest(compiles):
  f = dynjax.jit(lambda x: x + 1, dims={"x": "t"}, padding="trust", async_compile=True,
                 buckets={"t": dynjax.buckets.pow2(4, 64)})
  summary = f.warmup(np.zeros(4, np.float32), background=True)
  assert summary["pending"] == 5
  for t in (3, 50, 7, 20):
    np.testing.assert_array_equal(f(np.zeros(t, np.float32)), np.ones(t))
  f.wait()
  assert f.stats()["compiles"] == 5 == compiles()


def test_parameter_of_a_new_shape_or_dtype_retraces_like_jax_jit(compiles):
  # Leaves without dims are checked by the executable on the hot path; a change goes to the slow
  # path and builds a new family instead of failing.
  f = dynjax.jit(lambda w, x: x @ w, dims={"x": "t, 3"}, padding="trust")
  x = np.ones((5, 3), np.float32)
  w2, w4 = jax.device_put(np.ones((3, 2), np.float32)), jax.device_put(np.ones((3, 4), np.float32))
  w4i = jax.device_put(np.ones((3, 4), np.int32))
  before = compiles()
  np.testing.assert_allclose(f(w2, x), np.full((5, 2), 3.0))
  np.testing.assert_allclose(f(w4, x), np.full((5, 4), 3.0))
  np.testing.assert_allclose(f(w4i, x), np.full((5, 4), 3.0))
  np.testing.assert_allclose(f(w2, x), np.full((5, 2), 3.0))
  assert compiles() - before == 3


def test_padded_inside_a_pytree_argument():
  f = dynjax.jit(lambda x: x * 2, dims={"x": "t"}, padding="trust", return_padded=True,
                 buckets={"t": dynjax.buckets.pow2(8, 64)})
  g = dynjax.jit(lambda d: d["a"] + d["b"], dims={"d": {"a": "t", "b": "t"}}, padding="trust",
                 buckets={"t": dynjax.buckets.pow2(8, 64)})
  p = f(np.arange(5, dtype=np.float32))
  out = g({"a": p, "b": np.ones(5, np.float32)})
  np.testing.assert_array_equal(out, np.arange(5) * 2 + 1)
  out = g({"a": np.ones(6, np.float32), "b": np.ones(6, np.float32)})  # same g, no Padded
  np.testing.assert_array_equal(out, np.full(6, 2.0))


def test_log_compiles_env_var_prints_each_compile():
  script = ("import numpy as np, dynjax\n"
            "f = dynjax.jit(lambda x: x + 1, dims={'x': 't'}, padding='trust',"
            " buckets={'t': dynjax.buckets.pow2(4, 16)})\n"
            "f(np.ones(3, np.float32)); f(np.ones(9, np.float32)); f(np.ones(2, np.float32))\n")
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "DYNJAX_LOG_COMPILES": "1"})
  assert r.returncode == 0, r.stderr
  lines = [ln for ln in r.stderr.splitlines() if "dynjax: compiled <lambda>" in ln]
  assert len(lines) == 2, r.stderr
