"""Device arrays of a shape that is not their bucket's: padded through the host or on the
device (``dynjax/jit/_devpad.py``), side by side in one process.

Parts:

* ``parts``: what each route costs for one array: the host trip (``np.asarray``, a zeroed
  buffer, ``device_put``), the pad program's compile and one call of it.
* ``train``: a Mixtral-style MoE training step (value and gradients of the expert weights,
  ``lax.ragged_dot``) on device inputs of varying row counts, a loop that cycles through
  ``--shapes`` for ``--steps`` steps: ``jax.jit`` at each exact shape, ``dynjax.jit`` (pow2
  buckets, ``padding="auto"``) with the device route off (``DYNJAX_DEVICE_PAD=0``'s
  behaviour) and on.  Wall time of the whole loop (compiles included), then the median step
  once every route is warm.
* ``infer``: the same block forward (an output with the rows' dim, cut back to the exact
  rows) on device inputs, per-call median.
* ``sharded``: a data-parallel function over every local device (batch sharded, sequence
  padded), per-call median.

  python benchmarks/probe_device_pad.py [--quick] [--out DIR]

``--quick`` is a CPU-sized run where every site buys its program at once (tests).  Milliseconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402


def _moe(d, e, f, dtype, seed=0):
  rng = np.random.default_rng(seed)
  gate = jnp.asarray(rng.normal(size=(d, e)), dtype)
  w1 = jnp.asarray(rng.normal(size=(e, d, f)) / d ** 0.5, dtype)
  w2 = jnp.asarray(rng.normal(size=(e, f, d)) / f ** 0.5, dtype)

  def block(x, w1, w2):
    ex = jnp.argmax(x @ gate, axis=-1)
    order = jnp.argsort(ex)
    sizes = jnp.bincount(ex, length=e)
    h = jax.nn.silu(jax.lax.ragged_dot(x[order], w1, sizes))
    y = jax.lax.ragged_dot(h, w2, sizes)
    return jnp.zeros_like(y).at[order].set(y)

  def step(x, w1, w2):
    return jax.value_and_grad(
        lambda a, b: jnp.sum(block(x, a, b).astype(jnp.float32) ** 2), (0, 1))(w1, w2)

  return block, step, w1, w2


def _wrapped(fn, d, on: bool, buckets):
  """A dynjax function with the device route on or off (the config is read per executor)."""
  import dynjax
  from dynjax.jit import _devpad

  _devpad.config.device_pad = on
  return dynjax.jit(fn, dims={"x": f"t, {d}", "w1": None, "w2": None},
                    buckets={"t": buckets}, on_fallback="error")


def _parts(shapes, dtype, n) -> list[dict]:
  from dynjax.jit import _devpad, _dispatch

  dev = jax.devices()[0]
  out = []
  for shape, target in shapes:
    x = jax.device_put(np.ones(shape, dtype), dev)
    ts = []
    for _ in range(n):
      jax.block_until_ready(x)
      t0 = time.perf_counter()
      jax.block_until_ready(jax.device_put(_dispatch.pad_leaf(x, shape, target), dev))
      ts.append(time.perf_counter() - t0)
    site = _devpad.Sites().site("pad", shape, target, dtype, dev)
    rec = {"shape": list(shape), "target": list(target), "dtype": np.dtype(dtype).name,
           "mbytes": float(np.prod(shape) * np.dtype(dtype).itemsize / 1e6),
           "host_trip_ms": float(np.median(ts) * 1e3)}
    if site is not None:
      t0 = time.perf_counter()
      site._buy()
      rec["compile_ms"] = (time.perf_counter() - t0) * 1e3
      ts = []
      for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(site.run(x, None))
        ts.append(time.perf_counter() - t0)
      rec["device_call_ms"] = float(np.median(ts) * 1e3)
    out.append(rec)
  return out


def _sharded(quick: bool, n: int) -> dict:
  """A data-parallel function over every local device: arrays sharded along the batch (a
  bucket size), their sequence axis padded; per-call median, host route vs device route."""
  import dynjax
  from dynjax.jit import _devpad

  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
  data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  k = len(devices)
  b, d, ts = (2 * k, 16, (20, 27)) if quick else (8 * k, 1024, (300, 400))

  def fn(x):
    return jnp.tanh(x) * 2

  rng = np.random.default_rng(2)
  # the sequence grows (a pad within each shard); then the batch too (7 rows a device: the
  # rows move between devices, where there are several)
  shapes = [(b, t, d) for t in ts] + [(b - k, ts[-1], d)] * (k > 1)
  xs = [jax.device_put(rng.normal(size=s).astype(np.float32), data) for s in shapes]
  want = [np.asarray(jax.jit(fn)(x)) for x in xs]
  out = {"devices": k, "shapes": [list(x.shape) for x in xs]}
  for name, on in (("dynjax host route", False), ("dynjax device route", True)):
    _devpad.config.device_pad = on
    f = dynjax.jit(fn, dims={"x": f"b, t, {d}"}, in_shardings={"x": data},
                   out_shardings=data)
    for _ in range(3 if quick else 30):
      for x in xs:
        f(x)
    ts_ = []
    for i in range(n * len(xs)):
      t0 = time.perf_counter()
      y = jax.block_until_ready(f(xs[i % len(xs)]))
      ts_.append(time.perf_counter() - t0)
      if i < len(xs):
        assert np.array_equal(np.asarray(y), want[i]), name
    per_shape = [float(np.median(ts_[j::len(xs)]) * 1e3) for j in range(len(xs))]
    out[name] = {"median_ms": float(np.median(ts_) * 1e3), "per_shape_median_ms": per_shape,
                 "device_pads": f.stats()["device_pads"]}
  return out


def _loop(fn, xs, w1, w2, steps) -> dict:
  """Wall time of ``steps`` steps cycling through ``xs`` (compiles included), then the
  median step over two more cycles, warm."""
  t0 = time.perf_counter()
  for i in range(steps):
    out = fn(xs[i % len(xs)], w1, w2)
  jax.block_until_ready(out)
  wall = time.perf_counter() - t0
  ts = []
  for i in range(2 * len(xs) * 5):
    t1 = time.perf_counter()
    jax.block_until_ready(fn(xs[i % len(xs)], w1, w2))
    ts.append(time.perf_counter() - t1)
  return {"loop_s": wall, "steady_median_ms": float(np.median(ts) * 1e3)}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--shapes", default=None, help="row counts the loop cycles through")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  from dynjax.jit import _devpad

  config = _devpad.config

  gpu = jax.default_backend() != "cpu"
  saved = config.device_pad, _devpad.PLATFORMS, _devpad.price
  try:
    return _run(args, gpu)
  finally:
    config.device_pad, _devpad.PLATFORMS, _devpad.price = saved


def _run(args, gpu) -> dict:
  import dynjax
  from dynjax.jit import _devpad

  if args.quick:
    _devpad.price = lambda: 0.0  # every site buys at its first trip: the programs run
    d, e, f, dtype = 16, 4, 32, jnp.float32
    rows = [int(r) for r in (args.shapes or "20,27,40").split(",")]
    steps, n = args.steps or 12, 5
    parts = [((3, 7), (4, 8))]
    buckets = dynjax.buckets.pow2(min=8, max=64)
  else:
    d, e, f, dtype = 1024, 8, 4096, jnp.bfloat16 if gpu else jnp.float32
    rows = [int(r) for r in (args.shapes or "2000,2600,3000,3500").split(",")]
    steps, n = args.steps or 200, 30
    parts = [((8, 37), (8, 64)), ((8, 300, 1024), (8, 512, 1024)), ((3000, 1024), (4096, 1024))]
    buckets = dynjax.buckets.pow2(min=256, max=8192)
  res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "prior_s": _devpad.PRIOR_S, "rows": rows, "steps": steps}
  res["parts"] = _parts([(s, t) for s, t in parts], np.int32 if args.quick else dtype, n)
  for p in res["parts"]:
    print("part", p, flush=True)
  block, step, w1, w2 = _moe(d, e, f, dtype)
  rng = np.random.default_rng(1)
  xs = [jax.device_put(jnp.asarray(rng.normal(size=(r, d)), dtype)) for r in rows]
  res["train"] = {"jax.jit exact": _loop(jax.jit(step), xs, w1, w2, steps)}
  for name, on in (("dynjax host route", False), ("dynjax device route", True)):
    g = _wrapped(step, d, on, buckets)
    rec = _loop(g, xs, w1, w2, steps)
    rec["device_pads"] = g.stats()["device_pads"]
    res["train"][name] = rec
  want = jax.jit(step)(xs[0], w1, w2)[1]
  got = _wrapped(step, d, True, buckets)(xs[0], w1, w2)[1]
  res["train_grad_max_abs_diff"] = float(max(
      np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
      for a, b in zip(want, got, strict=True)))
  res["infer"] = {}
  warm = 3 if args.quick else 40  # at ~3-6 ms a trip a site pays its ~80 ms in ~15-30 calls
  ref = jax.jit(block)
  for name, on in (("jax.jit exact", None), ("dynjax host route", False),
                   ("dynjax device route", True)):
    fn = ref if on is None else _wrapped(block, d, on, buckets)
    for _ in range(warm):  # the device route's sites buy their programs in the warm-up
      for x in xs:
        y = fn(x, w1, w2)
    trips = 0 if on is None else fn.stats()["device_pads"]["host_trips"]
    ts = []
    for i in range(n * len(xs)):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(xs[i % len(xs)], w1, w2))
      ts.append(time.perf_counter() - t0)
    res["infer"][name] = {"median_ms": float(np.median(ts) * 1e3)}
    if name != "jax.jit exact":
      res["infer"][name]["device_pads"] = fn.stats()["device_pads"]
      res["infer"][name]["timed_host_trips"] = fn.stats()["device_pads"]["host_trips"] - trips
      res["infer"][name]["max_abs_diff"] = float(np.abs(
          np.asarray(y, np.float32) - np.asarray(ref(xs[-1], w1, w2), np.float32)).max())
  res["sharded"] = _sharded(args.quick, n)
  for part in ("train", "infer", "sharded"):
    for k, v in res[part].items():
      if isinstance(v, dict):
        print(part, k, {a: b for a, b in v.items() if a != "device_pads"},
              v.get("device_pads", ""), flush=True)
  if args.out:
    write_json(args.out, "probe_device_pad.json", res)
  return res


if __name__ == "__main__":
  main()
