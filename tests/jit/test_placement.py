"""Outputs in pinned host memory (``dynjax.jit(host_outputs=...)``, ``jit/_placement.py``):
the executables of a host-request family write their outputs to pinned host memory, so a
numpy result needs no separate device-to-host copy.  On CPU (these tests) pinned host memory
exists, so ``host_outputs=True`` runs the real path; the automatic rule is GPU-only and is
exercised here by letting it apply to the CPU."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax._config import config
from dynjax._errors import SpecError
from dynjax.jit import _placement
from dynjax.jit import _serving as serving_mod


def fn(p, x):
  h = jnp.tanh(x @ p["w"]) * p["b"]  # pad-safe (padding="trust" runs it as written)
  return {"pooled": h.sum(1), "h": h, "n": jnp.sum(x > 0.5, axis=(1, 2)).astype(jnp.int32)}


REF = jax.jit(fn)
P = {"w": jnp.asarray(np.random.RandomState(0).randn(8, 4).astype(np.float32)),
     "b": jnp.asarray(np.arange(4, dtype=np.float32))}


def _x(b, t, seed=0):
  return np.random.RandomState(seed + 31 * t + b).rand(b, t, 8).astype(np.float32)


def _family(f):
  return next(iter(f._dispatcher.all_families.values()))


def _same(got, want, device: bool):
  for k in want:
    assert isinstance(got[k], jax.Array if device else np.ndarray), (k, type(got[k]))
    if device:
      assert got[k].sharding.memory_kind != _placement.HOST_KIND
    # (tanh at another shape may take XLA:CPU's other vector path: 1 ulp)
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-6)
    assert np.asarray(got[k]).dtype == want[k].dtype


@pytest.fixture(autouse=True)
def pinned_rule(monkeypatch):
  """This module tests the pinned host placement: on a GPU, without the driver's reads of
  device outputs that replace it there by default (tests/jit/test_direct_outputs.py)."""
  monkeypatch.setattr(config, "direct_outputs", False)


@pytest.fixture
def auto_on_cpu(monkeypatch):
  """The automatic rule (GPU only) applied to this CPU."""
  monkeypatch.setattr(_placement, "AUTO_PLATFORMS", ("gpu", jax.devices()[0].platform))


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_host_outputs_exact_for_host_and_device_requests(padding, compiles):
  f = dynjax.jit(fn, dims={"x": "b, t, 8"}, padding=padding, host_outputs=True)
  cases = [(x, jnp.asarray(x), REF(P, x)) for x in (_x(3, 13), _x(4, 16), _x(3, 9))]
  start = compiles()
  for x, dx, want in cases:  # sliced outputs, and the bucket's own shape
    _same(f(P, x), want, device=False)
    _same(f(P, dx), want, device=True)  # moved back to the device
  fam = _family(f)
  assert fam.host_out and all(e.host_out for e in fam.buckets.values())
  assert compiles() - start == len(fam.buckets) == 1  # no extra executable for the outputs
  assert f.stats()["host_outputs"] == 1
  assert "outputs in pinned host memory (host_outputs=True)" in f.explain()


def test_return_padded_device_request_gets_device_buffers():
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"}, host_outputs=True)
  x = np.arange(15, dtype=np.float32).reshape(3, 5)
  np.testing.assert_array_equal(f(x), x * 2)
  y = f(jnp.asarray(x))
  assert y.sharding.memory_kind != _placement.HOST_KIND
  np.testing.assert_array_equal(np.asarray(y), x * 2)


def test_default_is_device_memory_on_cpu():
  if jax.default_backend() in _placement.AUTO_PLATFORMS:
    pytest.skip("the CPU default (on GPU host_outputs=None turns them on)")
  f = dynjax.jit(fn, dims={"x": "b, t, 8"})
  _same(f(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  fam = _family(f)
  assert not fam.host_out and not any(e.host_out for e in fam.buckets.values())
  assert "measured on GPU only" in f.explain()


def test_auto_rule_follows_the_first_request(auto_on_cpu):
  host = dynjax.jit(fn, dims={"x": "b, t, 8"})
  _same(host(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  assert _family(host).host_out
  assert "the first call was a host request" in host.explain()
  dev = dynjax.jit(fn, dims={"x": "b, t, 8"})
  _same(dev(P, jnp.asarray(_x(3, 13))), REF(P, _x(3, 13)), device=True)
  assert not _family(dev).host_out
  assert "the first call was a device request" in dev.explain()


@pytest.mark.parametrize("serving", [True, False])
def test_auto_rule_for_a_warmup_from_shapes(auto_on_cpu, serving):
  f = dynjax.jit(fn, dims={"x": "b, t, 8"}, buckets=dynjax.buckets.pow2(4, 16),
                 serving=serving)
  f.warmup(P, jax.ShapeDtypeStruct((4, 16, 8), jnp.float32))
  f.wait()
  assert _family(f).host_out is serving
  _same(f(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)


@pytest.mark.parametrize("kw", [dict(host_outputs=False), dict(return_padded=True),
                                dict(donate_argnames="x")])
def test_auto_rule_exclusions(auto_on_cpu, kw):
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"}, **kw)
  x = np.ones((3, 5), np.float32)
  y = f(x)
  np.testing.assert_array_equal(np.asarray(y.unpad() if hasattr(y, "unpad") else y), x * 2)
  assert not _family(f).host_out


def test_prng_key_outputs_stay_on_the_device(auto_on_cpu):
  f = dynjax.jit(lambda k, x: (jax.random.split(k), x + 1), dims={"x": "b, t"})
  k, y = f(jax.random.key(0), np.ones((3, 5), np.float32))
  assert not _family(f).host_out and "PRNG-key outputs" in f.explain()
  np.testing.assert_array_equal(jax.random.key_data(k),
                                jax.random.key_data(jax.random.split(jax.random.key(0))))


def test_store_round_trip_keeps_the_placement(tmp_path):
  kw = dict(dims={"x": "b, t, 8"}, cache_dir=str(tmp_path))
  f = dynjax.jit(fn, host_outputs=True, **kw)
  _same(f(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  g = dynjax.jit(fn, host_outputs=True, **kw)  # a restart loads it, outputs still on the host
  _same(g(P, _x(3, 11)), REF(P, _x(3, 11)), device=False)
  _same(g(P, jnp.asarray(_x(3, 11))), REF(P, _x(3, 11)), device=True)
  assert g.stats()["loaded_from_store"] == 1
  assert all(e.host_out for e in _family(g).buckets.values())
  h = dynjax.jit(fn, host_outputs=False, **kw)  # another fingerprint: compiled anew
  _same(h(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  assert h.stats()["loaded_from_store"] == 0
  assert not any(e.host_out for e in _family(h).buckets.values())


def test_flax_forwarded_and_cast_params_with_host_outputs(monkeypatch):
  from dynjax.jit import _casts

  monkeypatch.setattr(_casts, "MIN_BYTES", 0)
  monkeypatch.setattr(_casts, "MIN_SAVED_SECONDS", 0.0)

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, dtype=jnp.bfloat16)(x)

  m = M()
  v = m.init(jax.random.key(0), np.ones((2, 3, 8), np.float32))

  def step(v, x):
    return m.apply(v, x), v  # the params come back unchanged: forwarded, not copied

  f = dynjax.jit(step, dims={"x": "b, t, 8"}, host_outputs=True)
  x = _x(3, 5)
  y, v2 = f(v, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(step)(v, x)[0]))
  assert all(a is b for a, b in zip(jax.tree.leaves(v2), jax.tree.leaves(v), strict=True))
  assert _family(f).host_out


def test_bad_option_names_it():
  with pytest.raises(SpecError, match=r"host_outputs must be True, False or None, got 'yes'"):
    dynjax.jit(lambda x: x, host_outputs="yes")


def test_a_bucket_with_large_outputs_keeps_them_on_the_device(monkeypatch):
  monkeypatch.setattr(_placement, "MAX_BYTES", 4 * 16 * 4)  # (4, 16) float32 fits, (4, 32) not
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"}, host_outputs=True)
  for t in (13, 30):
    x = np.ones((3, t), np.float32)
    np.testing.assert_array_equal(f(x), x * 2)
  fam = _family(f)
  assert {b: e.host_out for b, e in fam.buckets.items()} == {(4, 16): True, (4, 32): False}


# -- which outputs come back as numpy -------------------------------------------------------
def train_step(params, x, y):
  """A training step in the idiom of public JAX code: new params, the loss, per-example."""
  def loss_fn(p):
    err = jnp.tanh(x @ p["w"]).sum(1) @ p["v"] - y  # (b,)
    return jnp.mean(err ** 2), err

  (loss, err), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return jax.tree.map(lambda a, b: a - 0.01 * b, params, g), loss, err


TP = {"w": jnp.asarray(np.random.RandomState(1).randn(8, 4).astype(np.float32) * 0.3),
      "v": jnp.asarray(np.random.RandomState(2).randn(4).astype(np.float32))}


@pytest.mark.parametrize("host_outputs", [None, True])
def test_training_step_with_numpy_batches_keeps_its_state_on_the_device(host_outputs):
  """numpy batches (a data loader's): the per-example output comes back as numpy (it has the
  request's dims), the new parameters and the loss stay device arrays, as from jax.jit, so
  the next step takes them without an upload (before: every output came back as numpy)."""
  f = dynjax.jit(train_step, dims={"x": "b, t, 8", "y": "b"}, host_outputs=host_outputs)
  ref = jax.jit(train_step)
  p = TP
  for step, (b, t) in enumerate(((3, 13), (4, 9), (3, 16))):
    x = _x(b, t, seed=step)
    y = np.random.RandomState(step).randn(b).astype(np.float32)
    p_ref, loss_ref, err_ref = ref(p, x, y)  # from the same parameters: no drift compounds
    p, loss, err = f(p, x, y)  # the step's own outputs feed the next step
    assert isinstance(err, np.ndarray) and err.shape == (b,)
    assert isinstance(loss, jax.Array) and loss.shape == ()
    for k in p:
      assert type(p[k]) is type(p_ref[k]) and p[k].sharding.memory_kind != _placement.HOST_KIND
      np.testing.assert_allclose(np.asarray(p[k]), np.asarray(p_ref[k]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(err, np.asarray(err_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
  assert f.stats()["host_syncs"] == 3  # each step blocks for its numpy per-example output
  text = f.explain()
  assert text.count("(no dims: a device array, numpy requests too)") == 3  # w, v and the loss
  on = host_outputs or jax.default_backend() in _placement.AUTO_PLATFORMS
  assert _family(f).host_out is on


def test_outputs_without_dims_only_do_not_block():
  f = dynjax.jit(lambda p, x: (p["w"] * 2, jnp.sum(x)), dims={"x": "b, t"})
  w, s = f({"w": jnp.ones(3)}, np.ones((3, 5), np.float32))
  assert isinstance(w, jax.Array) and isinstance(s, jax.Array) and float(s) == 15.0
  assert f.stats()["host_syncs"] == 0


def test_exact_runs_return_the_same_kinds_as_padded_ones():
  """A size past the largest bucket runs exact (overflow="exact"): same output kinds."""
  f = dynjax.jit(train_step, dims={"x": "b, t, 8", "y": "b"}, overflow="exact",
                 buckets={"t": dynjax.buckets.pow2(4, 16)})
  kinds = []
  for t in (9, 40):  # padded, then exact
    x = _x(3, t)
    y = np.ones(3, np.float32)
    p, loss, err = f(TP, x, y)
    kinds.append((type(p["w"]), type(loss), type(err)))
    want = jax.jit(train_step)(TP, x, y)
    np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(want[0]["w"]), rtol=1e-5, atol=1e-6)
  assert kinds[0] == kinds[1] and kinds[0][2] is np.ndarray
  assert f.stats()["exact_calls"] == 1


@pytest.mark.parametrize("dims,fixups,kind", [({"x": "b, t, 16"}, 0, np.ndarray),
                                              ("auto", 1, jax.Array)])
def test_nnx_state_needs_no_fix_up_when_it_has_no_dims(monkeypatch, dims, fixups, kind):
  """NNX state (BatchNorm statistics) has no dims, so a numpy request gets it back as device
  arrays and the wrapper skips its fix-up (a flatten of the state).  A family without dims
  (dims="auto", first shape) keeps the fix-up: there every leaf decides (the state is on the
  device, so this call is a device request and gets device outputs)."""
  from flax import nnx

  import dynjax.flax as dflax

  calls = []
  real = dflax._state_where_it_was
  monkeypatch.setattr(dflax, "_state_where_it_was", lambda new, old: calls.append(1) or
                      real(new, old))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(16, 8, rngs=rngs)
      self.bn = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
      return self.bn(self.lin(x)).sum(1)

  model, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  f = dflax.nnx_jit(Net.__call__, dims=dims)
  x = np.random.RandomState(0).randn(3, 7, 16).astype(np.float32)
  got = f(model, x)
  want = nnx.jit(Net.__call__)(twin, x)
  assert isinstance(got, kind)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert isinstance(model.bn.mean[...], jax.Array)
  np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.asarray(twin.bn.mean[...]),
                             rtol=1e-5, atol=1e-6)
  assert len(calls) == fixups


# -- padded host input buffers, reused (_placement.HostBuffers) ------------------------------


def _pool_fn(padding):
  # trust sums the padded axis unmasked: exact only while the padding is zeros
  return dynjax.jit(lambda x: (x.sum(1), x[:, :, :4] * 2), dims={"x": "b, t, 256"},
                    buckets={"b": [8], "t": [128]}, padding=padding)


@pytest.fixture(params=["numpy", "pinned"])
def pinned(request, monkeypatch):
  """Reused padded buffers as numpy arrays, or pinned host ones (GPU only by default: here
  on this CPU, for every pooled size)."""
  # (on a GPU a leaf below 2 MiB goes by the driver's copies instead: test_direct_inputs.py)
  monkeypatch.setattr(_placement, "DIRECT_PLATFORMS", ())
  if request.param == "pinned":
    monkeypatch.setattr(_placement, "PINNED_PLATFORMS", (jax.devices()[0].platform,))
    monkeypatch.setattr(_placement, "PINNED_MIN_BYTES", _placement.POOL_MIN_BYTES)
    monkeypatch.setattr(_placement, "PINNED_MIN_JAX", (0,))  # (CPU: checked on 0.10.2 too)
  return _placement.PINNED if request.param == "pinned" else None


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_large_padded_inputs_reuse_one_zeroed_buffer(padding, pinned):
  f = _pool_fn(padding)
  rng = np.random.default_rng(0)
  seen = set()
  for t in (100, 90, 120, 100, 7, 128, 60):  # shorter after longer: stale values zeroed
    x = rng.normal(size=(8, t, 256)).astype(np.float32)
    s, h = f(x)
    np.testing.assert_allclose(s, x.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(h, x[:, :, :4] * 2)
    fam = _family(f)
    for kept in fam.host_buffers.free.values():
      seen.update(id(buf) for buf, _, _ in kept)
  assert len(seen) == 1  # one buffer for the bucket, calls one after another
  assert [((8, 128, 256), np.dtype(np.float32), pinned)] == list(fam.host_buffers.free)
  # after t=128 then t=60: trust (the function sees the padding) zeroed the old values; auto
  # (reads no padded value) left them (a memset saved a call)
  (buf, _, last), = next(iter(fam.host_buffers.free.values()))
  assert last[1] == slice(0, 60)
  assert (np.abs(buf[:, 60:]).sum() == 0) == (padding == "trust")
  assert fam.host_buffers.pinned_bytes == (8 * 128 * 256 * 4 if pinned else 0)
  assert fam.host_buffers.pinned_failed is None
  st = f.stats()
  assert (st["pinned_input_bytes"], st["pinned_inputs_failed"]) == (
      fam.host_buffers.pinned_bytes, None)


def test_a_pinned_buffer_that_cannot_be_made_leaves_numpy_buffers(pinned, monkeypatch):
  if not pinned:
    pytest.skip("pinned buffers only")

  def refuse(*a, **k):
    raise RuntimeError("no pinned memory here")

  monkeypatch.setattr(_placement.jax, "device_put", refuse)
  f = _pool_fn("auto")
  for t in (100, 60):
    x = np.random.default_rng(t).normal(size=(8, t, 256)).astype(np.float32)
    np.testing.assert_allclose(f(x)[0], x.sum(1), rtol=1e-5, atol=1e-4)
  hb = _family(f).host_buffers
  assert list(hb.free) == [((8, 128, 256), np.dtype(np.float32), None)]
  assert len(hb.free[((8, 128, 256), np.dtype(np.float32), None)]) == 1  # one, reused
  assert "RuntimeError: no pinned memory here" in f.stats()["pinned_inputs_failed"]


def test_kernel_rewrites_keep_zeroed_padding():
  # a fused attention multiplies masked (0) probabilities by padded values: zeros, not stale
  f = dynjax.jit(lambda x: (x.sum(1), x[:, :, :4] * 2), dims={"x": "b, t, 256"},
                 buckets={"b": [8], "t": [128]}, padding="auto", attention="xla")
  for t in (100, 60):
    x = np.ones((8, t, 256), np.float32)
    np.testing.assert_allclose(f(x)[0], x.sum(1))
  fam = _family(f)
  assert fam.executors and all(e.zero_pad for e in fam.executors.values())
  assert not any(e.zero_pad for e in _family(_called(_pool_fn("auto"))).executors.values())


def _called(f):
  f(np.ones((8, 100, 256), np.float32))
  return f


def test_pinned_buffers_only_for_the_executables_dtype_and_within_their_budget(
    pinned, monkeypatch):
  if not pinned:
    pytest.skip("pinned buffers only")
  f = _pool_fn("trust")
  x64 = np.random.default_rng(2).normal(size=(8, 100, 256))  # float64: the call converts it
  s, _ = f(x64)
  np.testing.assert_allclose(s, x64.astype(np.float32).sum(1), rtol=1e-5, atol=1e-4)
  hb = _family(f).host_buffers
  assert list(hb.free) == [((8, 128, 256), np.dtype(np.float64), None)]
  assert hb.pinned_bytes == 0 and hb.pinned_failed is None
  monkeypatch.setattr(_placement, "PINNED_MAX_BYTES", 8 * 128 * 256 * 4 - 1)
  x = x64.astype(np.float32)
  np.testing.assert_allclose(f(x)[0], x.sum(1), rtol=1e-5, atol=1e-4)  # over budget: numpy
  assert ((8, 128, 256), np.dtype(np.float32), None) in hb.free and hb.pinned_bytes == 0
  (buf, _, _), = hb.free[((8, 128, 256), np.dtype(np.float32), None)]
  np.testing.assert_allclose(f(x[:, :90])[0], x[:, :90].sum(1), rtol=1e-5, atol=1e-4)
  assert [b for b, _, _ in hb.free[((8, 128, 256), np.dtype(np.float32), None)]] == [buf]


def test_reused_buffers_under_threads_and_not_for_calls_that_do_not_wait(pinned):
  import concurrent.futures

  f = _pool_fn("trust")
  rng = np.random.default_rng(1)
  xs = [rng.normal(size=(8, int(t), 256)).astype(np.float32) for t in rng.integers(1, 129, 48)]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    outs = list(pool.map(f, xs))
  for x, (s, h) in zip(xs, outs, strict=True):
    np.testing.assert_allclose(s, x.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(h, x[:, :, :4] * 2)
  kept = _family(f).host_buffers.free[((8, 128, 256), np.dtype(np.float32), pinned)]
  assert 1 <= len(kept) <= _placement.POOL_PER_KEY
  # a call that returns without waiting for its results (return_padded) takes no buffer
  g = dynjax.jit(lambda x: x * 2, dims={"x": "b, t, 256"}, buckets={"b": [8], "t": [128]},
                 return_padded=True)
  out = g(xs[0])
  np.testing.assert_array_equal(out.unpad(), xs[0] * 2)
  assert _family(g).host_buffers.free == {}


@pytest.mark.parametrize("first", ["shapes", "device"])
def test_a_restart_takes_the_placement_its_store_holds(auto_on_cpu, tmp_path, first):
  # A process warmed up from shapes without serving=True (or first called with device arrays)
  # stores executables with device outputs; its restart's first request is numpy, which
  # plans pinned host outputs: another fingerprint, so it compiled every bucket again.  It
  # takes the stored placement now (the same results; no compile), and says so.
  kw = dict(dims={"x": "b, t, 8"}, cache_dir=str(tmp_path), buckets=dynjax.buckets.pow2(4, 16))
  f = dynjax.jit(fn, **kw)
  if first == "shapes":
    f.warmup(P, jax.ShapeDtypeStruct((4, 16, 8), jnp.float32))
  else:
    f(P, jnp.asarray(_x(4, 16)))
  assert not _family(f).host_out
  stored = len(serving_mod.stored_buckets(_family(f)))
  assert stored >= 1
  g = dynjax.jit(fn, **kw)
  xd = jnp.asarray(_x(3, 13))
  # (bucket executables counted: on a GPU a device request may also pay for a pad program)
  _same(g(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  _same(g(P, xd), REF(P, _x(3, 13)), device=True)
  assert g.stats()["compiles"] == 0 and g.stats()["loaded_from_store"] == 1
  fam = _family(g)
  assert not fam.host_out and not any(e.host_out for e in fam.buckets.values())
  assert ("device memory (the first call was a host request; its cache_dir holds executables "
          "with device outputs only)") in g.explain()
  # and back: a store of pinned host outputs serves a restart whose first call is on device
  h = dynjax.jit(fn, **{**kw, "cache_dir": str(tmp_path / "h")})
  _same(h(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  assert _family(h).host_out
  k = dynjax.jit(fn, **{**kw, "cache_dir": str(tmp_path / "h")})
  _same(k(P, xd), REF(P, _x(3, 13)), device=True)
  assert k.stats()["compiles"] == 0 and _family(k).host_out


def test_an_explicit_placement_keeps_its_own_store(auto_on_cpu, tmp_path, compiles):
  kw = dict(dims={"x": "b, t, 8"}, cache_dir=str(tmp_path))
  f = dynjax.jit(fn, host_outputs=False, **kw)
  _same(f(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  g = dynjax.jit(fn, host_outputs=True, **kw)  # asked for: compiled anew, as asked
  start = compiles()
  _same(g(P, _x(3, 13)), REF(P, _x(3, 13)), device=False)
  assert compiles() == start + 1 and _family(g).host_out


@pytest.fixture
def parallel_copies(monkeypatch):
  """Every padded copy split over threads, on this small CPU box too."""
  monkeypatch.setattr(_placement, "PARALLEL_COPY_MIN_BYTES", 0)
  monkeypatch.setattr(_placement, "_cores", lambda: 64)


@pytest.mark.parametrize("shape, target", [
    ((8, 100, 256), (8, 128, 256)), ((5, 7), (8, 8)), ((1, 3, 2), (2, 4, 4)),
    ((1, 1, 9), (1, 2, 16)), ((3,), (4,)), ((0, 5), (4, 8)), ((4, 6, 3, 2), (4, 8, 3, 4))])
def test_a_split_copy_is_the_copy(parallel_copies, monkeypatch, shape, target):
  monkeypatch.setattr(_placement, "_copy_pool", [])
  rng = np.random.default_rng(0)
  for dtype in (np.float32, np.int8):
    x = rng.normal(size=shape).astype(np.float64)  # converted as buf[prefix] = x converts it
    prefix = tuple(slice(0, n) for n in shape)
    want = np.full(target, 7, dtype)
    want[prefix] = x
    got = np.full(target, 7, dtype)
    _placement.copy_into(got, prefix, x)
    np.testing.assert_array_equal(got, want)
  # split where an axis has copy_threads rows or more: the copy threads exist then
  k = _placement.config.copy_threads
  assert bool(_placement._copy_pool) == any(n >= k for n in shape)


def test_one_copy_thread_never_splits(parallel_copies, monkeypatch):
  monkeypatch.setattr(_placement, "_copy_pool", [])
  monkeypatch.setattr(_placement.config, "copy_threads", 1)
  x = np.arange(8 * 100 * 4, dtype=np.float32).reshape(8, 100, 4)
  got = np.zeros((8, 128, 4), np.float32)
  _placement.copy_into(got, (slice(0, 8), slice(0, 100), slice(0, 4)), x)
  np.testing.assert_array_equal(got[:, :100], x)
  assert not _placement._copy_pool


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_padded_calls_with_split_copies_are_exact(parallel_copies, pinned, padding):
  f = _pool_fn(padding)
  rng = np.random.default_rng(3)
  for t in (100, 7, 128, 61):
    x = rng.normal(size=(8, t, 256)).astype(np.float32)
    s, h = f(x)
    np.testing.assert_allclose(s, x.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(h, x[:, :, :4] * 2)


def test_an_executables_device_is_read_once_and_forgotten_with_it():
  # jax rebuilds input_shardings (every parameter's) on each read: kept per executable.
  reads = []

  class Exe:
    @property
    def input_shardings(self):
      reads.append(1)
      return ((jax.sharding.SingleDeviceSharding(jax.devices()[0]),) * 3, {})

  exe = Exe()
  assert _placement.exe_device(exe) == jax.devices()[0] == _placement.exe_device(exe)
  assert len(reads) == 1 and exe in _placement._EXE_DEVICE
  del exe
  assert not any(type(k).__name__ == "Exe" for k in list(_placement._EXE_DEVICE))
  # A real executable too; one that cannot be weakly referenced is read each time.
  c = jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
  assert _placement.exe_device(c) == jax.devices()[0] and c in _placement._EXE_DEVICE

  class Slotted:
    __slots__ = ()
    input_shardings = Exe.input_shardings

  assert _placement.exe_device(Slotted()) == jax.devices()[0] and len(reads) == 2
