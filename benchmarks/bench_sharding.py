"""Sharded bucketed serving: a BERT-base-like encoder on 1 device vs data/tensor parallel.

    python benchmarks/bench_sharding.py --out DIR            # bert base, 1,000 requests, all GPUs
    python benchmarks/bench_sharding.py --out DIR --quick    # CPU (2 fake devices), < 60 s

One process.  The encoder is ``examples.models.encoder_apply`` (jax.numpy, masked by the
lengths, so ``padding="trust"`` is exact); requests are batches of 8 standard-library docstrings
(``examples.data.request_stream``; a seeded lognormal if that import fails), lengths
bucketed with ``pow2(16, max_len)``.  Modes, every one a ``dynjax.jit`` of the same function:

  1 device        no shardings (the baseline)
  data parallel   ``tokens``/``lengths`` sharded over "data" (all local devices), weights
                  replicated; n consecutive requests are served by one call of batch 8*n, so
                  every device gets one request's 8 rows (requests grouped before timing)
  dp split        each request's batch of 8 split over the devices (per-request latency)
  tensor parallel weights sharded Megatron-style over "model" (qkv/mlp_in columns, out/mlp_out
                  rows), one request per call

Every mode compiles all its buckets first (``warmup``, concurrent), then serves the whole
stream from host numpy arrays to host numpy results (pad, sharded ``device_put``, run, unpad,
one sync per call), best of ``--passes`` passes.  Reported: requests/s, the ratio to 1 device
(goal >= 1.8x for data parallel on 2 GPUs), compiles counted with ``jax.monitoring`` per
bucket used (1.0 means one compile per bucket), and the maximum difference of the results
from the 1-device run.  JSON to DIR/bench_sharding.json, the table printed last.

Needs only jax and numpy (no network); jax 0.10 and 0.11 (public APIs only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if "jax" not in sys.modules:  # fake CPU devices for --quick; harmless on GPU machines
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dynjax  # noqa: E402
from examples import models  # noqa: E402

_COMPILES = [0]


def _on_event(event, duration, **_):
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def _requests(n: int, batch: int, max_len: int, vocab: int, seed: int = 0):
  """[(tokens [batch, t] int32, lengths [batch] int32)], and where they came from."""
  try:
    from examples import data

    stream = data.request_stream(n, batch=batch, max_len=max_len, seed=seed, vocab=vocab)
    return [(r.tokens, r.lengths) for r in stream], "stdlib docstrings"
  except Exception as e:  # noqa: BLE001 - the loader is optional: fall back, say so
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
      lengths = np.clip(rng.lognormal(3.0, 1.2, batch), 1, max_len).astype(np.int32)
      tokens = np.zeros((batch, int(lengths.max())), np.int32)
      for j, n_j in enumerate(lengths):
        tokens[j, :n_j] = rng.integers(1, vocab, n_j)
      out.append((tokens, lengths))
    return out, f"seeded lognormal (docstring loader failed: {type(e).__name__}: {e})"


def _group(reqs, n: int, window: int = 0):
  """n requests as one batch of 8*n rows, padded to the group's longest.

  ``window`` > 0: within each window of that many consecutive requests, requests are grouped
  in order of length (a length-aware scheduler, as servers do), so a group pads little.
  """
  order = list(range(len(reqs)))
  if window:
    order = []
    for w in range(0, len(reqs), window):
      idx = list(range(w, min(w + window, len(reqs))))
      order.extend(sorted(idx, key=lambda i: reqs[i][0].shape[1]))
    reqs = [reqs[i] for i in order]
  out = []
  for i in range(0, len(reqs) - len(reqs) % n, n):
    part = reqs[i:i + n]
    t = max(tok.shape[1] for tok, _ in part)
    tokens = np.concatenate([np.pad(tok, ((0, 0), (0, t - tok.shape[1]))) for tok, _ in part])
    out.append((tokens, np.concatenate([ln for _, ln in part])))
  return out, order[:len(out) * n]


def _tp_shardings(params, mesh):
  """Megatron-style: column-parallel qkv/mlp_in (kernel and bias), row-parallel out/mlp_out."""
  col, row = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None))
  vec = NamedSharding(mesh, P("model"))
  rep = NamedSharding(mesh, P())

  def pick(path, leaf):
    names = [getattr(k, "key", str(k)) for k in path]
    layer = names[-2] if len(names) >= 2 else ""
    if layer in ("qkv", "mlp_in"):
      return col if names[-1] == "kernel" else vec
    if layer in ("out", "mlp_out") and names[-1] == "kernel":
      return row
    return rep

  return jax.tree_util.tree_map_with_path(pick, params)


def _host(out):
  """A result to host numpy (Padded outputs are cut to their true shape)."""
  return out.unpad() if isinstance(out, dynjax.Padded) else np.asarray(out)


def _serve(f, params, calls, passes: int, pipeline: int = 1):
  """Best wall time of ``passes`` passes over ``calls``; the last pass's outputs.

  ``pipeline`` > 1: ``f`` returns ``dynjax.Padded`` (no sync) and up to ``pipeline`` calls are
  in flight; each result is copied to the host once a later call has been dispatched, so the
  host's padding/dispatch overlaps the devices' compute, as a serving loop would do it.
  """
  import collections

  best, outs = float("inf"), None
  for _ in range(passes):
    res = []
    inflight = collections.deque()
    t0 = time.perf_counter()
    for tokens, lengths in calls:
      out = f(params, tokens, lengths)
      if pipeline <= 1:
        res.append(np.asarray(out))  # one device->host copy (and sync) per call, as served
        continue
      inflight.append(out)
      if len(inflight) >= pipeline:
        res.append(_host(inflight.popleft()))
    while inflight:
      res.append(_host(inflight.popleft()))
    best = min(best, time.perf_counter() - t0)
    outs = res
  return best, outs


def run_mode(name, cfg, params, calls, batch, max_len, passes, in_shardings=None,
             place=None, pipeline: int = 1) -> dict:
  print(f"  {name}: {len(calls)} calls ...", flush=True)
  fn = models.make_encoder(cfg, masked=True)
  f = dynjax.jit(fn, dims={"tokens": f"{batch}, t", "lengths": f"{batch}"},
                 buckets={"t": dynjax.buckets.pow2(16, max_len)}, padding="trust",
                 in_shardings=in_shardings, return_padded=pipeline > 1)
  dev_params = jax.device_put(params, place) if place is not None else jax.device_put(params)
  jax.block_until_ready(dev_params)
  c0 = _COMPILES[0]
  t0 = time.perf_counter()
  warm = f.warmup(dev_params, *calls[0], progress=False)
  warm_s = time.perf_counter() - t0
  seconds, outs = _serve(f, dev_params, calls, passes, pipeline)
  s = f.stats()
  used = len(s["per_bucket_calls"])
  compiles = _COMPILES[0] - c0
  return {
      "mode": name, "calls": len(calls), "batch_per_call": batch,
      "seconds": seconds, "calls_per_s": len(calls) / seconds,
      "warmup_s": warm_s, "buckets_compiled": warm["compiled"], "buckets_used": used,
      "compiles": compiles, "compiles_per_bucket": compiles / max(warm["compiled"], 1),
      "per_bucket_calls": s["per_bucket_calls"], "policies": s["policies"], "pipeline": pipeline,
      "outputs": outs,
  }


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None, help="directory for bench_sharding.json")
  ap.add_argument("--quick", action="store_true", help="tiny encoder, 96 requests (CPU)")
  ap.add_argument("--size", default=None, help="encoder size: tiny, small, base")
  ap.add_argument("--requests", type=int, default=None)
  ap.add_argument("--max-len", type=int, default=None)
  ap.add_argument("--passes", type=int, default=None)
  ap.add_argument("--devices", type=int, default=None, help="devices to use (default: all)")
  ap.add_argument("--pipeline", type=int, default=3,
                  help="calls in flight in the pipelined modes (1: only the synced modes)")
  ap.add_argument("--sort-window", type=int, default=32,
                  help="pipelined data parallel: group requests by length within this window")
  args = ap.parse_args(argv)
  size = args.size or ("tiny" if args.quick else "base")
  n_req = args.requests or (96 if args.quick else 1000)
  max_len = args.max_len or (128 if args.quick else 512)
  passes = args.passes or (1 if args.quick else 2)
  batch = 8
  cfg = models.ENCODER_SIZES[size]
  if cfg.max_len < max_len:
    raise SystemExit(f"--max-len {max_len} exceeds the encoder's max_len {cfg.max_len}")
  devices = jax.local_devices()[:args.devices] if args.devices else jax.local_devices()
  n = len(devices)
  reqs, source = _requests(n_req, batch, max_len, cfg.vocab)
  params = models.init_encoder_params(cfg, seed=0)
  meta = {"jax": jax.__version__, "python": platform.python_version(),
          "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
          "devices": n, "model": size, "requests": n_req, "batch": batch, "max_len": max_len,
          "data": source, "passes": passes}
  print(f"bench_sharding: {size} encoder, {n_req} requests of {batch} ({source}), "
        f"{n} x {devices[0].device_kind}, jax {jax.__version__}", flush=True)

  # Each entry: (mode kwargs, baseline name). "sync": one host copy (and sync) per call, as
  # before; "pipelined": up to 3 calls in flight (see _serve), the way a server overlaps them.
  pipe = args.pipeline
  window = args.sort_window
  results, order_of = [], {}
  single = jax.sharding.SingleDeviceSharding(devices[0])
  results.append(run_mode("1 device", cfg, params, reqs, batch, max_len, passes, place=single))
  if pipe > 1:
    results.append(run_mode(f"1 device, pipelined {pipe}", cfg, params, reqs, batch, max_len,
                            passes, place=single, pipeline=pipe))
  if n > 1:
    dmesh = Mesh(np.array(devices), ("data",))
    rep = NamedSharding(dmesh, P())
    dp_in = {"tokens": NamedSharding(dmesh, P("data")), "lengths": NamedSharding(dmesh, P("data"))}
    grouped, order = _group(reqs, n)
    name = f"data parallel x{n} (batch {batch}x{n})"
    order_of[name] = order
    results.append(run_mode(name, cfg, params, grouped, batch * n, max_len, passes,
                            in_shardings=dp_in, place=rep))
    if pipe > 1:
      grouped, order = _group(reqs, n, window)
      name = f"data parallel x{n}, pipelined {pipe}, sorted/{window}"
      order_of[name] = order
      results.append(run_mode(name, cfg, params, grouped, batch * n, max_len, passes,
                              in_shardings=dp_in, place=rep, pipeline=pipe))
    if batch % n == 0:
      results.append(run_mode(f"dp split x{n} (batch {batch})", cfg, params, reqs, batch,
                              max_len, passes, in_shardings=dp_in, place=rep, pipeline=pipe))
    tmesh = Mesh(np.array(devices), ("model",))
    tp = _tp_shardings(params, tmesh)
    results.append(run_mode(f"tensor parallel x{n}", cfg, params, reqs, batch, max_len,
                            passes, in_shardings={"params": tp}, place=tp, pipeline=pipe))

  base = results[0]
  piped = results[1] if pipe > 1 else base
  per_req = np.stack(np.split(np.concatenate(base["outputs"]), len(base["outputs"])))
  rows = []
  for r in results:
    got = np.concatenate(r.pop("outputs"))
    got = np.stack(np.split(got, len(got) // batch))  # one entry per request
    order = order_of.get(r["mode"], list(range(len(got))))
    want = per_req[np.asarray(order)[:len(got)]]
    r["max_abs_diff_vs_1_device"] = float(np.max(np.abs(got - want)))
    r["requests_per_s"] = r["calls_per_s"] * r["batch_per_call"] / batch
    ref = piped if r.get("pipeline", 1) > 1 else base
    r["baseline"] = ref["mode"]
    r["ratio_vs_1_device"] = r["requests_per_s"] / (ref["calls_per_s"] * ref["batch_per_call"]
                                                    / batch)
    rows.append(r)
  out = {"meta": meta, "results": rows}
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sharding.json"), "w") as fh:
      json.dump(out, fh, indent=2)
  hdr = (f"{'mode':44s} {'req/s':>9s} {'ratio':>6s} {'buckets':>7s} {'compiles/bucket':>15s} "
         f"{'warmup s':>8s} {'max diff':>9s}")
  print("\n" + hdr + "\n" + "-" * len(hdr))
  for r in rows:
    print(f"{r['mode']:44s} {r['requests_per_s']:9.1f} {r['ratio_vs_1_device']:5.2f}x "
          f"{r['buckets_used']:7d} {r['compiles_per_bucket']:15.2f} {r['warmup_s']:8.1f} "
          f"{r['max_abs_diff_vs_1_device']:9.2e}")
  return out


if __name__ == "__main__":
  main()
