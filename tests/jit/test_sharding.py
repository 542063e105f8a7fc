"""dynjax.jit on a device mesh: GSPMD shardings, aligned buckets, exactness, errors.

Runs on the 8 fake CPU devices of conftest.py (``--xla_force_host_platform_device_count=8``);
the multi-process test starts two fresh interpreters with ``jax.distributed``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynjax
from dynjax.jit import _sharding

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

D, HEADS, FFN = 16, 4, 32


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), ("data", "model"))


@pytest.fixture(params=["auto", "trust"])
def padding(request):
  return request.param


def _params(seed=0):
  rng = np.random.default_rng(seed)

  def w(*shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

  return {"wq": w(D, D), "wk": w(D, D), "wv": w(D, D), "wo": w(D, D),
          "w1": w(D, FFN), "w2": w(FFN, D),
          "ln": {"scale": np.ones(D, np.float32), "bias": np.zeros(D, np.float32)}}


def _ln(x, p):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(v + 1e-6) * p["scale"] + p["bias"]


def encoder_block(params, x):
  """A BERT-style post-LN encoder block over x: f32[b, t, D] that attends to ALL t positions
  (no mask), so padding it naively is wrong: only the padding pass makes it exact."""
  b, t, _ = x.shape
  dh = D // HEADS

  def heads(y):
    return y.reshape(b, t, HEADS, dh)

  q, k, v = (heads(x @ params[n]) for n in ("wq", "wk", "wv"))
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
  a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, D)
  x = _ln(x + a @ params["wo"], params["ln"])
  return _ln(x + jax.nn.gelu(x @ params["w1"]) @ params["w2"], params["ln"])


def pooled(params, x):
  return encoder_block(params, x).mean(1)


def mlp_block(params, x):
  """Position-wise (pad-safe along b and t): the function for padding="trust"."""
  return _ln(x + jax.nn.gelu(x @ params["w1"]) @ params["w2"], params["ln"])


# padding mode -> function: "auto" gets the full block (mixes over t), "trust" a pad-safe one.
FUNS = {"auto": pooled, "trust": mlp_block}


def _tp(mesh):
  """Megatron-style tensor parallel: column-parallel in, row-parallel out, over "model"."""
  col, row = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None))
  return {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row, "ln": None}


def _x(b, t, seed=0):
  return np.random.default_rng(seed * 1000 + b * 37 + t).standard_normal((b, t, D)).astype(
      np.float32)


def _close(got, want, rtol=2e-5, atol=2e-5):
  assert isinstance(got, np.ndarray), type(got)
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_allclose(got, np.asarray(want), rtol=rtol, atol=atol)


SHAPES = [(3, 5), (6, 7), (2, 12)]


def test_data_parallel_matches_jax_jit(mesh, padding, compiles):
  fn = FUNS[padding]
  f = dynjax.jit(fn, dims={"x": "b, t, 16"}, padding=padding,
                 in_shardings={"x": NamedSharding(mesh, P("data"))})
  params = _params()
  wants = [jax.jit(fn)(params, _x(b, t)) for b, t in SHAPES]
  n0 = compiles()
  for (b, t), want in zip(SHAPES, wants, strict=True):
    _close(f(params, _x(b, t)), want)
  s = f.stats()
  assert "multiple=2" in s["policies"]["b"]
  assert all(int(k.split(",")[0].split("=")[1]) % 2 == 0 for k in s["per_bucket_calls"])
  assert not s["fallbacks"] and s["exact_calls"] == 0
  assert s["compiles"] == len(s["per_bucket_calls"]) == compiles() - n0
  n = compiles()
  for b, t in SHAPES:
    f(params, _x(b, t, seed=1))
  assert compiles() == n  # repeat calls compile nothing


def test_trust_data_parallel_pad_safe(mesh, compiles):
  w = np.random.default_rng(1).standard_normal((D, 8)).astype(np.float32)

  def fn(x, w):
    return jnp.tanh(x @ w) * 2.0

  f = dynjax.jit(fn, dims={"x": "b, t, 16"}, padding="trust",
                 in_shardings=(NamedSharding(mesh, P("data")), None))
  wants = [jax.jit(fn)(_x(b, t), w) for b, t in SHAPES]
  n0 = compiles()
  for (b, t), want in zip(SHAPES, wants, strict=True):
    _close(f(_x(b, t), w), want)
  s = f.stats()
  assert s["compiles"] == len(s["per_bucket_calls"]) == compiles() - n0


def test_tensor_parallel_encoder_block_exact(mesh, compiles):
  f = dynjax.jit(pooled, dims={"x": "b, t, 16"}, in_shardings={"params": _tp(mesh)})
  params = _params()
  wants = [jax.jit(pooled)(params, _x(b, t)) for b, t in SHAPES]
  n0 = compiles()
  for (b, t), want in zip(SHAPES, wants, strict=True):
    _close(f(params, _x(b, t)), want)
  s = f.stats()
  assert not s["fallbacks"] and s["exact_calls"] == 0
  assert s["compiles"] == len(s["per_bucket_calls"]) == compiles() - n0
  assert "multiple" not in s["policies"]["b"]  # nothing dynamic is sharded


def test_data_and_tensor_parallel_2x4(mesh, padding):
  fn = encoder_block if padding == "auto" else mlp_block
  spec = P("data", None, "model")
  f = dynjax.jit(fn, dims={"x": "b, t, 16"}, padding=padding, return_padded=True,
                 in_shardings={"params": _tp(mesh), "x": NamedSharding(mesh, P("data"))},
                 out_shardings=NamedSharding(mesh, spec))
  params = _params()
  for b, t in SHAPES[:3]:
    x = _x(b, t)
    out = f(params, x)
    assert isinstance(out, dynjax.Padded) and out.shape == (b, t, D)
    assert out.buffer.shape[0] % 2 == 0 and out.buffer.sharding == NamedSharding(mesh, spec)
    _close(out.unpad(), jax.jit(fn)(params, x))
    # the padded value feeds another sharded dynjax function without re-padding
    again = f(params, out)
    assert again.buffer.shape == out.buffer.shape


def test_device_inputs_keep_outputs_sharded(mesh):
  sh = NamedSharding(mesh, P("data", None, "model"))
  f = dynjax.jit(lambda x: jnp.sin(x) * 3, dims={"x": "b, t, 16"},
                 in_shardings=NamedSharding(mesh, P("data")), out_shardings=sh)
  for b, t in [(4, 5), (3, 6)]:
    x = jax.device_put(_x(b, t))
    out = f(x)
    assert isinstance(out, jax.Array) and out.shape == (b, t, D)
    # b=4 divides the "data" axis: the full sharding is kept; b=3 does not: that axis replicates
    want_spec = P("data", None, "model") if b % 2 == 0 else P(None, None, "model")
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 3), out.sharding
    np.testing.assert_allclose(np.asarray(out), np.sin(_x(b, t)) * 3, rtol=1e-6)


def test_host_inputs_are_placed_with_their_sharding(mesh):
  sh = NamedSharding(mesh, P("data", None, "model"))
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t, 16"}, in_shardings=sh)
  x = _x(3, 5)
  fam = f.trace(x).family
  placed = fam.shard.pad(fam, [x], [x.shape], [(4, 8, D)], zero=False)[0]
  assert placed.sharding == sh and placed.shape == (4, 8, D)
  # each device holds only its shard: (4/2, 8, 16/4)
  assert {s.data.shape for s in placed.addressable_shards} == {(2, 8, 4)}
  np.testing.assert_array_equal(np.asarray(placed)[:3, :5], x)
  x[:] = 7  # the padder's buffer is not aliased by the device array
  assert not np.any(np.asarray(placed) == 7)


def test_partition_specs_under_set_mesh(mesh):
  f = dynjax.jit(pooled, dims={"x": "b, t, 16"},
                 in_shardings={"x": P("data"), "params": {**{k: P(None, "model") for k in
                                                             ("wq", "wk", "wv", "w1")},
                                                          "wo": P("model"), "w2": P("model"),
                                                          "ln": None}})
  params = _params()
  x = _x(3, 5)
  with jax.set_mesh(mesh):
    got = f(params, x)
  _close(got, jax.jit(pooled)(params, x))
  fam = f.trace(params, x).family
  assert fam.shard.mesh == mesh
  assert fam.shard.inputs[-1] == NamedSharding(mesh, P("data"))


def test_exact_mode_with_shardings(mesh, compiles):
  f = dynjax.jit(pooled, dims={"x": "b, t, 16"}, padding="exact",
                 in_shardings={"x": NamedSharding(mesh, P("data")), "params": _tp(mesh)})
  params = _params()
  shapes = [(3, 5), (4, 5)]  # b=3 cannot be split over "data": that axis replicates
  wants = [jax.jit(pooled)(params, _x(b, t)) for b, t in shapes]
  n0 = compiles()
  for (b, t), want in zip(shapes, wants, strict=True):
    _close(f(params, _x(b, t)), want)
  assert compiles() - n0 == 2


def test_compile_counts_bounded_with_declared_buckets(mesh, compiles):
  f = dynjax.jit(pooled, dims={"x": "b, t, 16"},
                 buckets={"b": dynjax.buckets.pow2(1, 8), "t": dynjax.buckets.pow2(4, 16)},
                 in_shardings={"x": NamedSharding(mesh, P("data")), "params": _tp(mesh)})
  params = _params()
  for b in (1, 2, 3, 5, 8):
    for t in (3, 9, 16):
      f(params, _x(b, t))
  s = f.stats()
  # b buckets: pow2(1, 8) aligned to 2 -> {2, 4, 8}; t buckets {4, 16}: at most 3 * 2
  assert s["compiles"] == len(s["per_bucket_calls"]) == compiles() == 6
  assert {k.split(",")[0] for k in s["per_bucket_calls"]} == {"b=2", "b=4", "b=8"}


# -- errors -----------------------------------------------------------------------------------
def test_static_dim_not_divisible(mesh):
  f = dynjax.jit(lambda x, w: x @ w, dims={"x": "b, 6"},
                 in_shardings={"x": NamedSharding(mesh, P(None, "model")),
                               "w": NamedSharding(mesh, P("data", "model"))})
  with pytest.raises(dynjax.ShardingError) as e:
    f(np.ones((3, 6), np.float32), np.ones((6, 5), np.float32))
  assert str(e.value) == (
      "<lambda>: the shardings do not fit the arguments or the mesh:\n"
      "  in_shardings for argument x: axis 1 has static size 6, which mesh axis 'model' "
      "(size 4) does not divide\n"
      "  in_shardings for argument w: axis 1 has static size 5, which mesh axis 'model' "
      "(size 4) does not divide\n"
      "Fix: use axis names of the mesh; shard only axes whose static size is a multiple of the "
      "mesh axis size (dynamic dims are bucketed to multiples of it), or replicate them (None "
      "in the PartitionSpec).")
  assert isinstance(e.value, ValueError)


def test_unknown_mesh_axis(mesh):
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"}, in_shardings={"x": P("batch")})
  with jax.set_mesh(mesh), pytest.raises(dynjax.ShardingError) as e:
    f(np.ones((4, 3), np.float32))
  assert str(e.value) == (
      "<lambda>: the shardings do not fit the arguments or the mesh:\n"
      "  in_shardings for argument x: P('batch',) names mesh axes ['batch'], which the mesh "
      "does not have; its axes are {'data': 2, 'model': 4}\n"
      "Fix: use axis names of the mesh; shard only axes whose static size is a multiple of the "
      "mesh axis size (dynamic dims are bucketed to multiples of it), or replicate them (None "
      "in the PartitionSpec).")


def test_partition_spec_without_mesh():
  f = dynjax.jit(lambda x: x * 2, dims={"x": "b, t"}, in_shardings={"x": P("data")})
  with pytest.raises(dynjax.ShardingError, match=r"there is no mesh: call the function under "
                     r"`with jax.set_mesh\(mesh\):`"):
    f(np.ones((4, 3), np.float32))


def test_option_errors():
  def g(x, w):
    return x

  with pytest.raises(dynjax.ShardingError, match=r"in_shardings names \['y'\]: \['y'\] are not "
                     r"parameters of g; its non-static parameters are \['x', 'w'\]"):
    dynjax.jit(g, in_shardings={"y": P()})
  with pytest.raises(dynjax.ShardingError, match=r"static arguments are not sharded"):
    dynjax.jit(g, in_shardings={"w": P()}, static_argnames="w")
  with pytest.raises(dynjax.ShardingError, match=r"in_shardings has 1 entries but g has 2 "
                     r"non-static parameters \['x', 'w'\]"):
    dynjax.jit(g, in_shardings=(P(),))
  with pytest.raises(dynjax.ShardingError, match=r"unsupported sharding value"):
    dynjax.jit(g, in_shardings={"x": "data"})


def test_fit_and_axis_size(mesh):
  sh = NamedSharding(mesh, P(("data", "model"), None))
  assert _sharding._axis_size(mesh, ("data", "model")) == 8
  assert _sharding._fit(sh, (4, 6)).spec == P(None, None)
  assert _sharding._fit(sh, (16, 6)) is sh


# -- multi-process ----------------------------------------------------------------------------
_WORKER = textwrap.dedent("""
    import json, sys
    pid, port = int(sys.argv[1]), sys.argv[2]
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=40)
    import numpy as np, jax.numpy as jnp
    import dynjax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sh = NamedSharding(mesh, P("data"))

    def f(x):
      return jnp.tanh(x).sum(-1) * 2.0   # mixes over the padded t: the padding pass masks it

    res = {"pid": pid, "devices": jax.device_count()}
    for mode in ("padded", "plain"):
      g = dynjax.jit(f, dims={"x": "b, t"}, in_shardings={"x": sh},
                     return_padded=mode == "padded")
      errs = []
      for t in (5, 11, 7):
        local = np.random.RandomState(pid * 100 + t).randn(4, t).astype(np.float32)
        x = jax.make_array_from_process_local_data(sh, local)   # this process's 4 rows
        out = g(x)
        buf = out.buffer if mode == "padded" else out
        mine = np.concatenate([np.asarray(s.data) for s in
                               sorted(buf.addressable_shards, key=lambda s: s.index[0].start)])
        errs.append(float(np.abs(mine - np.tanh(local).sum(-1) * 2.0).max()))
      s = g.stats()
      res[mode] = {"errs": errs, "compiles": s["compiles"], "buckets": s["per_bucket_calls"]}
    # an output padded along the unsharded t: cut shard by shard on each process, still sharded
    h = dynjax.jit(lambda x: jnp.tanh(x), dims={"x": "b, t"}, in_shardings={"x": sh})
    local = np.random.RandomState(pid).randn(4, 5).astype(np.float32)
    out = h(jax.make_array_from_process_local_data(sh, local))
    mine = np.concatenate([np.asarray(s.data) for s in
                           sorted(out.addressable_shards, key=lambda s: s.index[0].start)])
    res["cut"] = {"shape": list(out.shape), "local": list(mine.shape),
                  "err": float(np.abs(mine - np.tanh(local)).max()),
                  "sharded": out.sharding == sh}
    print("RESULT " + json.dumps(res), flush=True)
    jax.distributed.shutdown()
""")


def test_two_processes_jax_distributed(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=90)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  results = []
  for p, out in zip(procs, outs, strict=True):
    assert p.returncode == 0, out[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert line, out[-3000:]
    results.append(json.loads(line[0][7:]))
  for r in results:
    assert r["devices"] == 4
    for mode in ("padded", "plain"):
      assert max(r[mode]["errs"]) < 1e-5, r
      # global b = 8 (4 rows per process), t in {5, 7} -> 8 and 11 -> 16: two buckets
      assert r[mode]["compiles"] == 2, r
      assert r[mode]["buckets"] == {"b=8, t=16": 1, "b=8, t=8": 2}, r
    assert r["cut"] == {"shape": [8, 5], "local": [4, 5], "err": r["cut"]["err"],
                        "sharded": True} and r["cut"]["err"] < 1e-6, r


def test_a_device_array_on_another_device_keeps_the_host_route(monkeypatch):
  """jit/_devpad.py pads on the executable's own device only: an array committed to another
  device goes through the host (as before), padded and moved in one trip, and buys nothing."""
  from dynjax.jit import _devpad

  monkeypatch.setattr(_devpad, "price", lambda: 0.0)
  f = dynjax.jit(lambda x: jnp.cumsum(x, axis=0) * 2, dims={"x": "t, 3"})
  for t in (5, 5, 6):
    x = jax.device_put(np.arange(t * 3, dtype=np.float32).reshape(t, 3), jax.devices()[1])
    np.testing.assert_array_equal(np.asarray(f(x)), np.cumsum(np.asarray(x), axis=0) * 2)
  d = f.stats()["device_pads"]
  assert d["programs"] == 2 and d["host_trips"] == 2  # the outputs' cuts, on device 0
  x0 = jnp.arange(15, dtype=jnp.float32).reshape(5, 3)  # on the default device: padded there
  np.testing.assert_array_equal(np.asarray(f(x0)), np.cumsum(np.asarray(x0), axis=0) * 2)
  assert f.stats()["device_pads"]["programs"] == 3


def test_an_array_on_another_device_at_the_bucket_shape_gets_an_error_that_says_what_to_do():
  """The executables of an unsharded function run on one device: an argument committed to
  another one is named in a ShardingError (jax's own check said only "shardings disagree"),
  and the advice it gives works."""
  f = dynjax.jit(lambda x, w: x @ w, dims={"x": "t, 4", "w": None})
  w0 = jnp.ones((4, 2))
  f(np.ones((3, 4), np.float32), w0)
  w1 = jax.device_put(w0, jax.devices()[1])
  with pytest.raises(dynjax.ShardingError) as e:
    f(np.ones((4, 4), np.float32), w1)
  lines = str(e.value).split("\n")
  assert lines[1] == f"  w: on {jax.devices()[1]}"  # only the misplaced argument, by name
  assert "jax.device_put(x, jax.devices()[0])" in lines[2] and "jax.default_device" in lines[2]
  w_back = jax.device_put(w1, jax.devices()[0])
  np.testing.assert_array_equal(f(np.ones((4, 4), np.float32), w_back),
                                np.full((4, 2), 4.0, np.float32))
  g = dynjax.jit(lambda x, w: x @ w, dims={"x": "t, 4", "w": None})
  with jax.default_device(jax.devices()[1]):  # a replica on device 1: its own function
    y = g(jax.device_put(np.ones((3, 4), np.float32), jax.devices()[1]), w1)
  assert y.devices() == {jax.devices()[1]}


def test_sharded_device_arrays_pad_and_cut_in_place_once_paid(mesh, padding, monkeypatch,
                                                               compiles):
  """jit/_devpad.py on a mesh: a sharded device array of a non-bucket shape is padded by a
  program (in place, no gather through the host) once its trips pay, and the output cut the
  same way; a pad that would move rows between devices (the sharded batch axis grows) keeps
  the host route.  Results as jax.jit's throughout."""
  from dynjax.jit import _devpad

  monkeypatch.setattr(_devpad, "price", lambda: 0.0)
  data = NamedSharding(mesh, P("data"))
  fun = FUNS[padding]
  f = dynjax.jit(lambda x, params: fun(params, x) * 1.0, dims={"x": "b, t, 16"},
                 in_shardings={"x": data, "params": _tp(mesh)}, padding=padding)
  params = _params()
  ref = jax.jit(lambda x, params: fun(params, x) * 1.0)

  def check(b, t):
    x = jax.device_put(_x(b, t), data)
    got, want = f(x, params), ref(x, params)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)

  for b, t in [(4, 5), (4, 5), (4, 7), (4, 5), (4, 7)]:  # t grows: a local pad per shard
    check(b, t)
  d = f.stats()["device_pads"]
  cuts = 0 if padding == "auto" else 2  # auto pools t away; trust's (b, t, 16) is cut
  assert d["sites"] == d["programs"] == 2 + cuts and d["refused"] == 0
  assert d["host_trips"] == 2 + cuts
  before = compiles()
  check(4, 7)
  assert f.stats()["device_pads"]["host_trips"] == 2 + cuts and compiles() == before
  for _ in range(2):  # b=6 -> 8 on a batch sharded over 2 devices: rows would move
    check(6, 7)
  d = f.stats()["device_pads"]
  assert d["refused"] >= 1 and d["programs"] - d["refused"] == 2 + cuts
