"""Parameters cast once (``dynjax.jit(cast_once=True)``, ``jit/_casts.py``): float arguments
the function only casts to a narrower dtype go into the executables already cast, cached by
the identity of the caller's array, and the results stay exactly those of ``jax.jit``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax._errors import SpecError

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _every_leaf(monkeypatch):
  """The tests' parameters are tiny: cast them all (the default skips leaves < 256 KiB)."""
  from dynjax.jit import _casts

  monkeypatch.setattr(_casts, "MIN_BYTES", 0)
  monkeypatch.setattr(_casts, "MIN_SAVED_SECONDS", 0.0)


class Block(nn.Module):
  """The mixed-precision idiom of public Flax code: float32 params, bfloat16 compute."""

  @nn.compact
  def __call__(self, x, lengths):
    h = nn.Embed(50, 16, dtype=BF16)(x)
    h = nn.Dense(32, dtype=BF16)(h)
    h = nn.LayerNorm(dtype=BF16)(nn.gelu(h))  # scale/bias used in float32: not cast
    mask = (jnp.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]
    pooled = jnp.sum(jnp.where(mask, h, 0), axis=1) / lengths[:, None].astype(h.dtype)
    return nn.Dense(8, dtype=BF16)(pooled)  # bf16 out: no excess precision to differ in


def _data(b, t, seed=0):
  rng = np.random.RandomState(seed + t)
  return (rng.randint(0, 50, (b, t)).astype(np.int32),
          rng.randint(1, t + 1, (b,)).astype(np.int32))


MODEL = Block()
PARAMS = jax.device_put(MODEL.init(jax.random.key(0), *_data(2, 5)))
EXACT = jax.jit(MODEL.apply)
CAST = 5  # Embed_0 embedding, Dense_0 and Dense_1 kernel and bias


def _check(f, params, t, b=3):
  x, n = _data(b, t)
  got = np.asarray(f(params, x, n))
  want = np.asarray(EXACT(params, x, n))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_flax_params_cast_once_exact_and_cached(padding):
  f = dynjax.flax.jit(MODEL, dims={"x": "b, t", "lengths": "b"}, padding=padding)
  for t in (5, 3, 9, 5, 12):
    _check(f, PARAMS, t)
  s = f.stats()["cast_once"]
  assert s == {"leaves": CAST, "conversions": CAST}, s  # once, over 3 buckets and 5 calls
  text = f.explain()
  assert "cast once per array" in text
  assert "['Embed_0']['embedding']: float32 -> bfloat16" in text
  assert "LayerNorm" not in text.split("cast once per array")[1].split("padding pass")[0]
  # Every executable takes the cast copies.
  fam = next(iter(f._dispatcher.all_families.values()))
  for entry in fam.buckets.values():
    assert len(entry.casts) == CAST
    dtypes = [str(a.dtype) for a in jax.tree.leaves(entry.exe.args_info)]
    assert dtypes.count("bfloat16") == CAST


def test_new_params_are_cast_again_old_ones_freed():
  f = dynjax.flax.jit(MODEL, dims={"x": "b, t", "lengths": "b"})
  _check(f, PARAMS, 6)
  other = jax.tree.map(lambda a: a * 2, PARAMS)
  _check(f, other, 6)
  assert f.stats()["cast_once"]["conversions"] == 2 * CAST
  _check(f, other, 7)  # same arrays: the copies are reused
  assert f.stats()["cast_once"]["conversions"] == 2 * CAST
  # The memo holds the caller's arrays weakly: dropping them frees them.
  import gc
  import weakref
  ref = weakref.ref(jax.tree.leaves(other)[0])
  del other
  gc.collect()
  assert ref() is None


def test_numpy_params_cast_every_call():
  host = jax.tree.map(lambda a: np.array(a), PARAMS)  # writable copies
  f = dynjax.flax.jit(MODEL, dims={"x": "b, t", "lengths": "b"})
  _check(f, host, 6)
  _check(f, host, 6)
  # numpy arrays can change in place: never cached.
  assert f.stats()["cast_once"]["conversions"] == 2 * CAST
  host["params"]["Dense_1"]["kernel"][:] *= -1
  _check(f, host, 6)


def test_float64_numpy_params_canonicalised_first():
  """x64 off: a float64 host parameter runs as float32 under jax.jit, then the function's
  cast; casting float64 straight to bfloat16 would round twice differently."""
  w = np.random.RandomState(0).randn(16, 8)  # float64
  w[0, 0] = 1.0 + 2.0 ** -8 + 2.0 ** -30  # f64->bf16 rounds up, f64->f32->bf16 rounds down

  def fn(w, x):
    return x.astype(BF16) @ w.astype(BF16)

  f = dynjax.jit(fn, dims={"x": "b, 16"})
  x = np.zeros((3, 16), np.float32)
  x[:, 0] = 1.0
  np.testing.assert_array_equal(np.asarray(f(w, x)), np.asarray(jax.jit(fn)(w, x)))
  assert f.stats()["cast_once"] == {"leaves": 1, "conversions": 1}  # the cast-once path ran


def test_uses_other_than_the_cast_keep_float32():
  def fn(p, x):
    y = x.astype(BF16) @ p["both"].astype(BF16)  # also used in float32 below
    y = y.astype(jnp.float32) + p["both"].sum()
    y = y + (x.astype(jnp.float16) @ p["two"].astype(jnp.float16)).astype(jnp.float32)
    z = (x.astype(BF16) @ p["two"].astype(BF16)).astype(jnp.float32)  # a second dtype
    w = (x.astype(BF16) @ p["ok"].astype(BF16)).astype(jnp.float32)
    return y + z + w, p["out"]  # returned: not cast

  rng = np.random.RandomState(1)
  p = {k: jnp.asarray(rng.randn(4, 4).astype(np.float32)) for k in ("both", "two", "ok")}
  p["out"] = jnp.asarray(rng.randn(4).astype(np.float32))
  p["ok_out"] = p["out"]
  f = dynjax.jit(fn, dims={"x": "b, 4"})
  x = rng.randn(3, 4).astype(np.float32)
  for got, want in zip(f(p, x), jax.jit(fn)(p, x), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  fam = next(iter(f._dispatcher.all_families.values()))
  assert [fam.leaf_paths[i] for i in fam.casts] == ["p['ok']"]


def test_general_path_flat_leaves():
  """A cast leaf beside a leaf with dims in one argument: the flat-leaves path."""
  def fn(batch):  # a bfloat16 output: XLA's excess precision cannot skip its rounding
    return batch["x"].astype(BF16) @ batch["w"].astype(BF16)

  w = jnp.asarray(np.random.RandomState(2).randn(4, 6).astype(np.float32))
  f = dynjax.jit(fn, dims={"batch": {"x": "b, 4", "w": None}})
  for b in (3, 5, 3):
    x = np.random.RandomState(b).randn(b, 4).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(f({"x": x, "w": w})),
                                  np.asarray(jax.jit(fn)({"x": x, "w": w})))
  assert f.stats()["cast_once"] == {"leaves": 1, "conversions": 1}


def test_cast_once_off():
  f = dynjax.flax.jit(MODEL, dims={"x": "b, t", "lengths": "b"}, cast_once=False)
  _check(f, PARAMS, 5)
  assert f.stats()["cast_once"] == {"leaves": 0, "conversions": 0}
  fam = next(iter(f._dispatcher.all_families.values()))
  assert not any(e.casts for e in fam.buckets.values())
  with pytest.raises(SpecError, match="cast_once must be True or False"):
    dynjax.jit(lambda x: x, cast_once="yes")


def test_another_param_dtype_is_a_new_family():
  """The cast would hide a dtype change from the executable's own check: the call must take
  a new family (a jax.jit retrace), never run on the float32 family's executable."""
  f = dynjax.flax.jit(MODEL, dims={"x": "b, t", "lengths": "b"})
  _check(f, PARAMS, 5)
  half = jax.tree.map(lambda a: a.astype(jnp.float16), PARAMS)
  _check(f, half, 5)
  assert len(f._dispatcher.all_families) == 2
  _check(f, PARAMS, 5)


def test_deleted_params_raise():
  params = jax.tree.map(jnp.copy, PARAMS)
  f = dynjax.flax.jit(MODEL, dims={"x": "b, t", "lengths": "b"})
  _check(f, params, 5)
  jax.tree.leaves(params)[0].delete()
  x, n = _data(3, 5)
  with pytest.raises(RuntimeError, match="deleted"):
    f(params, x, n)


def test_bucket_that_uses_the_param_uncast_lowers_without_casts():
  """``trust`` re-traces the Python function per bucket: a bucket whose trace uses the
  parameter otherwise is checked and lowered uncast (its entry says so)."""
  raw = {"on": False}

  def fn(w, x):
    if raw["on"]:
      return x @ w  # float32 use
    return (x.astype(BF16) @ w.astype(BF16)).astype(jnp.float32)

  w = jnp.asarray(np.random.RandomState(3).randn(4, 4).astype(np.float32))
  f = dynjax.jit(fn, dims={"x": "b, 4"}, padding="trust")
  x = np.random.RandomState(4).randn(3, 4).astype(np.float32)
  f(w, x)  # bucket 4, cast
  raw["on"] = True
  x6 = np.random.RandomState(5).randn(6, 4).astype(np.float32)
  got = np.asarray(f(w, x6))  # bucket 8 traces the float32 use
  np.testing.assert_allclose(got, np.asarray(x6 @ np.asarray(w)), rtol=1e-6, atol=1e-6)
  fam = next(iter(f._dispatcher.all_families.values()))
  assert {b: bool(e.casts) for b, e in fam.buckets.items()} == {(4,): True, (8,): False}


def test_stages_and_store_round_trip(tmp_path):
  kw = dict(dims={"x": "b, t", "lengths": "b"}, cache_dir=str(tmp_path))
  f = dynjax.flax.jit(MODEL, **kw)
  _check(f, PARAMS, 6)  # compiled and stored
  x, n = _data(3, 6)
  compiled = f.lower(PARAMS, x, n).compile()
  np.testing.assert_array_equal(np.asarray(compiled(PARAMS, x, n)),
                                np.asarray(EXACT(PARAMS, x, n)))
  g = dynjax.flax.jit(MODEL, **kw)  # a restart: the stored executable takes the casts
  _check(g, PARAMS, 6)
  assert g.stats()["loaded_from_store"] == 1
  fam = next(iter(g._dispatcher.all_families.values()))
  assert all(len(e.casts) == CAST for e in fam.buckets.values())


# -- outputs that are inputs (jit/_forward.py) ------------------------------------------------
def test_forwarded_param_is_the_callers_own_object():
  """``return y, params['w']``: jax.jit hands back the very array; so does dynjax, for host
  and device requests on padded buckets, without computing it (and the leaf can still be
  cast once, since returning it unchanged is no use of its float32 values)."""
  def fn(p, x):  # (a bfloat16 output: see test_general_path_flat_leaves)
    return x.astype(BF16) @ p["w"].astype(BF16), p["w"], p["b"]

  rng = np.random.RandomState(6)
  p = {"w": jnp.asarray(rng.randn(4, 4).astype(np.float32)),
       "b": jnp.asarray(rng.randn(4).astype(np.float32))}
  for padding in ("auto", "trust", "exact"):
    f = dynjax.jit(fn, dims={"x": "b, 4"}, padding=padding)
    for x in (rng.randn(3, 4).astype(np.float32), jnp.asarray(rng.randn(5, 4), jnp.float32)):
      y, w, b = f(p, x)
      if padding == "exact":  # one trace per shape, unchecked: the executable's copies
        np.testing.assert_array_equal(np.asarray(w), np.asarray(p["w"]))
      else:
        assert w is p["w"] and b is p["b"]
      np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(fn)(p, x)[0]))
    fam = next(iter(f._dispatcher.all_families.values()))
    # leaves in key order: b, w (the exact path forwards nothing: one trace per shape)
    assert fam.forward == ({} if padding == "exact" else {1: 1, 2: 0})
    if padding != "exact":
      assert [fam.leaf_paths[i] for i in fam.casts] == ["p['w']"]
      for entry in fam.buckets.values():  # the executables compute one output
        assert len(jax.tree.leaves(entry.exe.out_info)) == 1


def test_nnx_model_keeps_its_arrays_under_numpy_requests():
  """A numpy request gets numpy outputs; the model's own state must stay on its device
  (before, every parameter came back as a numpy copy and was uploaded again next call)."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(16, 32, dtype=BF16, rngs=rngs)  # float32 params, bf16 compute
      self.bn = nnx.BatchNorm(32, rngs=rngs)

    def __call__(self, x):
      return self.bn(self.lin(x).astype(jnp.float32)).sum(1)

  model = Net(nnx.Rngs(0))
  twin = nnx.clone(model)
  kernel = model.lin.kernel[...]
  f = dynjax.flax.nnx_jit(Net.__call__, dims={"x": "b, t, 16"})
  for t in (7, 5, 7):
    x = np.random.RandomState(t).randn(3, t, 16).astype(np.float32)
    got = f(model, x)
    want = nnx.jit(Net.__call__)(twin, x)
    assert type(got) is np.ndarray
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
  assert model.lin.kernel[...] is kernel  # never copied, never numpy
  mean = model.bn.mean[...]
  assert isinstance(mean, jax.Array)  # changed state: back on the device
  np.testing.assert_allclose(np.asarray(mean), np.asarray(twin.bn.mean[...]), rtol=1e-5,
                             atol=1e-6)
  assert f.stats()["cast_once"] == {"leaves": 2, "conversions": 2}


def test_new_params_every_call_convert_in_one_dispatch(compiles):
  """A training loop passes new parameters each step: the misses of a call are converted by
  one executable (compiled once), and the gradients are jax.jit's."""
  def grads(p, x):
    def loss(p):
      h = jnp.tanh(x.astype(BF16) @ p["w1"].astype(BF16))
      return jnp.sum((h @ p["w2"].astype(BF16)).astype(jnp.float32) ** 2)
    return jax.grad(loss)(p)

  rng = np.random.RandomState(7)
  p = {"w1": jnp.asarray(rng.randn(4, 8).astype(np.float32)),
       "w2": jnp.asarray(rng.randn(8, 3).astype(np.float32))}
  f = dynjax.jit(grads, dims={"x": "b, 4"})
  x = rng.randn(3, 4).astype(np.float32)
  for step in range(5):
    g = f(p, x)
    want = jax.jit(grads)(p, x)
    for k in p:
      np.testing.assert_allclose(np.asarray(g[k]), np.asarray(want[k]), rtol=2e-2, atol=2e-2)
    if step == 1:
      start = compiles()
    p = jax.tree.map(lambda a, b: a - 0.01 * b, p, g)  # new arrays: misses
  assert compiles() - start == 0  # steps 2-4: no compile (the converter included)
  assert f.stats()["cast_once"] == {"leaves": 2, "conversions": 10}


def test_small_leaves_stay_as_they_are(monkeypatch):
  from dynjax.jit import _casts

  monkeypatch.setattr(_casts, "MIN_BYTES", 1 << 18)  # (the total bound stays off)

  def fn(p, x):
    return (x.astype(BF16) @ p["big"].astype(BF16)) + p["small"].astype(BF16)

  p = {"big": jnp.ones((256, 256), jnp.float32), "small": jnp.ones((256,), jnp.float32)}
  f = dynjax.jit(fn, dims={"x": "b, 256"})
  x = np.ones((3, 256), np.float32)
  np.testing.assert_array_equal(np.asarray(f(p, x)), np.asarray(jax.jit(fn)(p, x)))
  fam = next(iter(f._dispatcher.all_families.values()))
  assert [fam.leaf_paths[i] for i in fam.casts] == ["p['big']"]  # 256 KiB: cast; 1 KiB: not


def test_a_family_with_little_to_convert_casts_nothing(monkeypatch):
  """Casting once adds host work to every call (a flatten of the argument, a lookup a leaf):
  a family whose conversions would save less than MIN_SAVED_SECONDS a call keeps float32."""
  from dynjax.jit import _casts

  monkeypatch.setattr(_casts, "MIN_SAVED_SECONDS", 1e-4)  # CPU: 1e10 B/s -> 1 MB moved
  monkeypatch.setattr(_casts, "BANDWIDTH", {})  # every backend at the CPU's 1e10 B/s

  def fn(p, x):
    return x.astype(BF16) @ p["w"].astype(BF16)

  x = np.ones((3, 256), np.float32)
  for n, want in ((256, 0), (1024, 1)):  # 256 x 256 x 6 B = 393 KB; 1024 x 256: 1.6 MB
    p = {"w": jnp.ones((256, n), jnp.float32)}
    f = dynjax.jit(fn, dims={"x": "b, 256"})
    np.testing.assert_array_equal(np.asarray(f(p, x)), np.asarray(jax.jit(fn)(p, x)))
    assert f.stats()["cast_once"]["leaves"] == want


def test_a_bucket_that_does_not_forward_runs_exact():
  """``trust`` re-traces the Python per bucket: if a bucket's trace computes an output that
  the symbolic trace returned as an input, the family runs exact (with a warning), never
  handing back the input in its place."""
  state = {"other": False}

  def fn(p, x):
    return x * 2, (p * 3 if state["other"] else p)

  p = jnp.ones((4,), jnp.float32)
  f = dynjax.jit(fn, dims={"x": "b"}, padding="trust")
  y, q = f(p, np.ones((3,), np.float32))
  assert q is p
  state["other"] = True
  with pytest.warns(UserWarning, match="not in this bucket's"):
    y, q = f(p, np.ones((6,), np.float32))
  np.testing.assert_array_equal(np.asarray(q), np.full((4,), 3.0, np.float32))


# -- the per-call swap by key path (Applier.paths) --------------------------------------------
def _same(got, want):
  """Bitwise on the CPU.  On a GPU XLA keeps ``_mlp``'s bfloat16 intermediates in float32
  inside its fusions (excess precision), and a bucket's program fuses otherwise than
  ``jax.jit``'s at the exact shape: a bfloat16 rounding apart (H100: 1.4e-3 relative)."""
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)


def _mlp(p, x):
  h = jnp.tanh(x.astype(BF16) @ p["layers"][0]["w"].astype(BF16))
  h = h @ p["layers"][1]["w"].astype(BF16) * p["scale"]  # scale: float32 use, not cast
  return (h.astype(jnp.float32) + p["pair"][0].astype(BF16).astype(jnp.float32)).sum(1)


def _mlp_params(seed=0):
  rng = np.random.RandomState(seed)
  return {"layers": [{"w": jnp.asarray(rng.randn(4, 8).astype(np.float32))},
                     {"w": jnp.asarray(rng.randn(8, 8).astype(np.float32))}],
          "scale": jnp.asarray(rng.randn(8).astype(np.float32)),
          "pair": (jnp.asarray(rng.randn(8).astype(np.float32)), jnp.ones(3))}


def test_hits_swap_by_key_path_without_a_flatten(monkeypatch):
  """Dicts, lists and tuples down to the cast leaves: a call whose leaves all hit copies only
  the containers on their paths (no flatten); a rebuilt dict holding the same arrays still
  hits; a replaced leaf misses and is converted once; results stay jax.jit's."""
  from dynjax.jit import _casts

  flattens = []
  real = _casts.Applier._by_flatten
  monkeypatch.setattr(_casts.Applier, "_by_flatten",
                      lambda self, args: flattens.append(1) or real(self, args))
  f = dynjax.jit(_mlp, dims={"x": "b, 4"})
  p = _mlp_params()
  x = np.random.RandomState(1).randn(3, 4).astype(np.float32)
  want = np.asarray(jax.jit(_mlp)(p, x))
  _same(np.asarray(f(p, x)), want)  # misses: converted (flatten)
  n0 = len(flattens)
  fam = next(iter(f._dispatcher.all_families.values()))
  assert len(fam.casts) == 3  # two layer kernels and pair[0]
  for _ in range(3):
    _same(np.asarray(f(p, x)), want)
  rebuilt = {"layers": list(p["layers"]), "scale": p["scale"], "pair": tuple(p["pair"])}
  _same(np.asarray(f(rebuilt, x)), want)
  assert len(flattens) == n0  # every hit swapped by path
  assert f.stats()["cast_once"]["conversions"] == 3
  q = dict(p, layers=[p["layers"][0], {"w": p["layers"][1]["w"] * 2}])  # one new array
  _same(np.asarray(f(q, x)), np.asarray(jax.jit(_mlp)(q, x)))
  assert f.stats()["cast_once"]["conversions"] == 4 and len(flattens) == n0 + 1
  assert p["layers"][0]["w"].dtype == jnp.float32  # the caller's tree is never modified


def test_another_structure_takes_a_new_family():
  """An argument with an extra key walks its paths fine, but the executable's own structure
  check sends the call to a new family, as a jax.jit retrace."""
  f = dynjax.jit(_mlp, dims={"x": "b, 4"})
  p = _mlp_params()
  x = np.ones((3, 4), np.float32)
  f(p, x)
  f(p, x)
  q = dict(p, extra=jnp.zeros(2))
  _same(np.asarray(f(q, x)), np.asarray(jax.jit(_mlp)(q, x)))
  assert len(f._dispatcher.all_families) == 2


def test_frozen_dict_params_take_the_flatten_path(monkeypatch):
  """A container that is no plain dict/list/tuple (a FrozenDict) stops the path walk at once:
  its calls flatten and unflatten, and still hit the cache."""
  from flax.core import FrozenDict

  from dynjax.jit import _casts

  flattens = []
  real = _casts.Applier._by_flatten
  monkeypatch.setattr(_casts.Applier, "_by_flatten",
                      lambda self, args: flattens.append(1) or real(self, args))
  f = dynjax.jit(_mlp, dims={"x": "b, 4"})
  p = FrozenDict(_mlp_params())
  x = np.ones((3, 4), np.float32)
  for _ in range(3):
    _same(np.asarray(f(p, x)), np.asarray(jax.jit(_mlp)(p, x)))
  assert len(flattens) == 3
  assert f.stats()["cast_once"]["conversions"] == 3


def test_a_list_where_a_dict_was_traced_takes_a_new_family():
  """The key-path walk meets a list where the plan names dict keys: it falls back (before the
  fix a raw "list indices must be integers" TypeError reached the caller), and the call runs
  as a new family, as a jax.jit retrace."""
  def f(p, x):
    w = p["a"] if isinstance(p, dict) else p[0]
    return (x.astype(BF16) @ w.astype(BF16)).astype(jnp.float32)

  g = dynjax.jit(f, dims={"x": "b, 4"})
  w = jnp.asarray(np.random.RandomState(3).randn(4, 3).astype(np.float32))
  x = np.ones((2, 4), np.float32)
  g({"a": w}, x)
  g({"a": w}, x)  # warm: the key-path walk
  np.testing.assert_array_equal(np.asarray(g([w], x)), np.asarray(jax.jit(f)([w], x)))
  assert len(g._dispatcher.all_families) == 2
