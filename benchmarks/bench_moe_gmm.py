"""Dropless MoE with a grouped GEMM: dynjax.route mode="grouped" against every other dispatch.

    python benchmarks/bench_moe_gmm.py --out DIR                 # H100 sizes, every part
    python benchmarks/bench_moe_gmm.py --small                   # CPU smoke run (tiny sizes)
    python benchmarks/bench_moe_gmm.py --parts check,layer --k 1,2 --settings uniform8,zipf64

On the H100 in calls of <= 240 s each (--budget stops starting new rows past that many seconds):
    ... --out $OUT --parts check,layer --k 1 --budget 190
    ... --out $OUT --parts layer --k 2 --sweep none --train uniform8 --budget 190
    ... --out $OUT --parts e2e --budget 190

Parts (``--parts``):
  check   on the device: route.gmm (Pallas) forward and backward against lax.ragged_dot, and the
          grouped layer (forward + grads) against the float32 dense reference.
  layer   the MoE FFN layer alone (d=1024, ffn=4096, 8192 tokens, bf16), per setting (uniform /
          Zipf(1.2) routing, 8 / 64 experts) and k (1, or 2 with renormalised gates), side by side:
            grouped pallas default    Routed(mode="grouped", kernel="pallas"), Tiling.auto
            grouped pallas <tiling>   the same with each --tilings entry (--sweep settings)
            grouped xla               the same layout through lax.ragged_dot
            profiled, exact-sync      the capacity modes
            lax.ragged_dot            argsort by expert, two ragged_dot calls, unsort
            capacity 1.25 (drops)     [E, 1.25 N k / E] buffers, drops the rest (fraction shown)
            dense                     every expert on every token
          and a training step (loss + grads in x and the weights) on the --train settings.
  e2e     a Flax MoE encoder block (router and experts as nn.Modules, k=2) under
          dynjax.flax.jit on variable-length requests of batch 8: grouped vs ragged_dot vs
          dense vs profiled; cold start (first pass, compiles) and steady per-request latency;
          plus a jitted training step (loss and grads) at one length.

Every figure is the median of device-synchronised calls (block_until_ready per call) after a
warm-up pass over every rotating input (compiles excluded), inputs rotated call to call.
Writes DIR/bench_moe_gmm.json (after every setting) and prints one table at the end.
Uses only public dynjax / dynjax.route / dynjax.flax names.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import dynjax
from benchmarks import _xla_options as xla_options
from dynjax import route
from dynjax.route import _grouped, _router

NOMINAL_PEAK = 800e12  # H100 SXM dense bf16, FLOP/s
NOMINAL_BW = 3.3e12  # H100 SXM HBM3, bytes/s
T0 = time.perf_counter()


def elapsed() -> float:
  return time.perf_counter() - T0


def timeit(fns, iters: int) -> dict:
  """``fns``: zero-argument callables (one per rotating input); warm-up = one pass over all."""
  for f in fns:
    jax.block_until_ready(f())
  ts = []
  for i in range(iters):
    f = fns[i % len(fns)]
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    ts.append(time.perf_counter() - t0)
  ts = np.asarray(ts) * 1e3
  return {"median_ms": float(np.median(ts)), "p90_ms": float(np.percentile(ts, 90)),
          "min_ms": float(ts.min())}


# Options of the grouped layer, named after a variant's "+": module switches read as a bucket
# is traced.  apart / fused: the combine on its own (an optimization barrier) or fused into its
# consumer (route._grouped.COMBINE_APART); sort: each cell's position in its path from a stable
# sort of the path ids at every path count (route._router._ONE_HOT_MAX_PATHS = 0), instead of
# the one-hot's cumulative sum by triangular matmuls up to 64 paths.
LAYER_OPTIONS = {"apart": {(_grouped, "COMBINE_APART"): True},
                 "fused": {(_grouped, "COMBINE_APART"): False},
                 "sort": {(_router, "_ONE_HOT_MAX_PATHS"): 0}}


def layer_option(name: str, flag: str) -> tuple[str, str | None]:
  """``"grouped-hopper+apart"`` -> ``("grouped-hopper", "apart")``; without ``+``: ``(name,
  None)`` (the library's defaults); another option: an error naming ``flag``."""
  base, plus, option = name.partition("+")
  if plus and option not in LAYER_OPTIONS:
    raise SystemExit(f"{flag}: unknown option +{option} of {name!r} "
                     f"({', '.join('+' + o for o in LAYER_OPTIONS)})")
  return base, option if plus else None


@contextlib.contextmanager
def layer_options(option: str | None):
  """The switches of ``LAYER_OPTIONS[option]`` set (None: the defaults), restored after."""
  switches = LAYER_OPTIONS.get(option, {}) if option else {}
  saved = {(m, a): getattr(m, a) for m, a in switches}
  for (m, a), v in switches.items():
    setattr(m, a, v)
  try:
    yield
  finally:
    for (m, a), v in saved.items():
      setattr(m, a, v)


def rel_err(a, b) -> float:
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def grad_rel_errs(fn, ref, args, ct) -> list[float]:
  """``rel_err`` of ``value_and_grad`` of ``sum(f(*args) * ct)`` (f32) for ``fn`` against
  ``ref``: the loss, then the gradient of every argument's leaves."""
  def loss(*a, f):
    return jnp.sum(f(*a).astype(jnp.float32) * ct)

  argnums = tuple(range(len(args)))
  got = jax.jit(jax.value_and_grad(functools.partial(loss, f=fn), argnums))(*args)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, f=ref), argnums))(*args)
  return [rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                                        strict=True)]


def zipf_probs(n: int, s: float) -> np.ndarray:
  p = 1.0 / np.arange(1, n + 1) ** s
  return p / p.sum()


def parse_tiling(s: str) -> route.Tiling:
  """``tm x tk x tn x warps x stages [g grid_block_n]`` (also bench_moe_kernels.py's)."""
  s, _, g = s.partition("g")
  tm, tk, tn, w, st = (int(v) for v in s.split("x"))
  return route.Tiling(tm=tm, tk=tk, tn=tn, num_warps=w, num_stages=st,
                      grid_block_n=int(g) if g else 1)


def tiling_name(t: route.Tiling) -> str:
  return f"{t.tm}x{t.tk}x{t.tn}x{t.num_warps}x{t.num_stages}"


def top_k_gates(logits, k):
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  if k == 1:
    idx = jnp.argmax(logits, axis=-1)[:, None].astype(jnp.int32)
  else:
    _, idx = jax.lax.top_k(logits, k)
  gates = jnp.take_along_axis(probs, idx, axis=-1)
  if k > 1:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return idx.astype(jnp.int32), gates


def ragged_dot_ffn(x, logits, w1, w2, k, mask=None, activation=jax.nn.gelu):
  """Argsort by expert, two lax.ragged_dot calls, unsort, weight by the gates (dropless)."""
  e = w1.shape[0]
  idx, gates = top_k_gates(logits, k)
  if mask is not None:
    idx = jnp.where(mask[:, None], idx, e)
    gates = jnp.where(mask[:, None], gates, 0.0)
  flat = idx.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1, mode="drop")
  xs = jnp.take(x, order // k, axis=0)
  h = activation(jax.lax.ragged_dot(xs, w1, sizes)).astype(x.dtype)
  ys = jax.lax.ragged_dot(h, w2, sizes)
  y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
  y = y.astype(jnp.float32).reshape(x.shape[0], k, -1) * gates[..., None]
  return y.sum(1).astype(x.dtype)


def dense_ffn(x, logits, w1, w2, k, mask=None, activation=jax.nn.gelu):
  """Every expert on every token, weighted by the top-k gates."""
  e = w1.shape[0]
  idx, gates = top_k_gates(logits, k)
  if mask is not None:
    gates = jnp.where(mask[:, None], gates, 0.0)
  w = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].add(gates)
  h = activation(jnp.einsum("nd,edf->enf", x, w1)).astype(x.dtype)
  ys = jnp.einsum("enf,efd->end", h, w2)
  return jnp.einsum("ne,end->nd", w, ys.astype(jnp.float32)).astype(x.dtype)


# -----------------------------------------------------------------------------------------------
# check: correctness on the device
# -----------------------------------------------------------------------------------------------
def run_check(args) -> dict:
  out = {}
  t = args.tilings[0]
  rng = np.random.default_rng(0)
  sizes = np.array([0, 3 * t.tm + 5, 1, 0, t.tm, 700, 0, 17], np.int32)
  rows = int(sum(-(-s // t.tm) * t.tm for s in sizes)) + 2 * t.tm
  d, f = args.d, args.ffn
  lhs = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), d, f)) / math.sqrt(d), jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((rows, f)), jnp.float32)
  mask = np.zeros((rows, 1), np.float32)
  r = 0
  for s in sizes:
    mask[r:r + s] = 1
    r += -(-s // t.tm) * t.tm
  ct = ct * mask
  gs = jnp.asarray(sizes)
  for be in ("pallas", "xla"):
    fn = jax.jit(jax.value_and_grad(
        lambda a, b, be=be: jnp.sum(route.gmm(a, b, gs, tiling=t, backend=be).astype(
            jnp.float32) * ct), (0, 1)))
    out[be] = fn(lhs, rhs)
  y_p = jax.jit(lambda a, b: route.gmm(a, b, gs, tiling=t, backend="pallas"))(lhs, rhs)
  y_ref = jax.jit(lambda a, b: jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                                  ((gs + t.tm - 1) // t.tm) * t.tm))(lhs, rhs)
  res = {"gmm_fwd_rel_err_vs_f32": rel_err(np.asarray(y_p, np.float32) * mask,
                                           np.asarray(y_ref) * mask),
         "gmm_dlhs_rel_err_vs_xla": rel_err(np.asarray(out["pallas"][1][0], np.float32) * mask,
                                            np.asarray(out["xla"][1][0], np.float32) * mask),
         "gmm_drhs_rel_err_vs_xla": rel_err(out["pallas"][1][1], out["xla"][1][1])}
  for name, v in res.items():
    print(f"  {name:52s} {v:.2e}", flush=True)
  try:
    res.update(check_layer(args, t))
  except Exception as e:
    res["layer_error"] = f"{type(e).__name__}: {str(e)[:600]}"
    print(f"  layer check FAILED {res['layer_error']}", flush=True)
  return res


def layer_inputs(e, n, dm, fm, n_keys=4):
  """f32 expert weights, tokens and Zipf(1.2)-skewed router logits for a layer check, and the
  PRNG keys they came from (``n_keys`` >= 4)."""
  ks = jax.random.split(jax.random.PRNGKey(1), n_keys)
  params = {"w1": jax.random.normal(ks[0], (e, dm, fm)) / math.sqrt(dm),
            "w2": jax.random.normal(ks[1], (e, fm, dm)) / math.sqrt(fm)}
  x = jax.random.normal(ks[2], (n, dm))
  logits = jax.random.normal(ks[3], (n, e)) + jnp.asarray(np.log(zipf_probs(e, 1.2)))
  return params, x, logits, ks


def check_layer(args, t) -> dict:
  res = {}
  # The layer, f32: forward and grads against the dense reference (every expert, every token).
  e, n, dm, fm = (8, 200, 64, 128) if args.small else (8, 1000, 256, 512)
  params, x, logits, ks = layer_inputs(e, n, dm, fm)
  ct = jax.random.normal(ks[0], (n, dm))
  for k in (1, 2):
    moe = route.Routed(route.Experts(route.ffn()), route.Router(e, k=k, renormalize=k > 1),
                       mode="grouped", kernel="pallas", tiling=t)

    def dense_k(p, x, lg, k=k):
      return dense_ffn(x, lg, p["w1"], p["w2"], k)

    errs = grad_rel_errs(moe, dense_k, (params, x, logits), ct)
    res[f"layer_k{k}_f32_max_rel_err(loss,dW1,dW2,dx,dlogits)"] = max(errs)
    print(f"  layer k={k} f32 max rel err (loss, dW1, dW2, dx, dlogits) {max(errs):.2e}",
          flush=True)
  return res


# -----------------------------------------------------------------------------------------------
# layer: the MoE FFN alone
# -----------------------------------------------------------------------------------------------
def run_layer(name: str, k: int, args) -> dict:
  routing_kind = "zipf" if name.startswith("zipf") else "uniform"
  e = int(name[len(routing_kind):])
  d, f, n = args.d, args.ffn, args.tokens
  dtype = jnp.bfloat16
  rng = np.random.default_rng(args.seed)
  probs = zipf_probs(e, args.zipf) if routing_kind == "zipf" else np.full(e, 1.0 / e)

  def draw_bias():
    return jnp.asarray(np.log(probs)[None, :] + rng.gumbel(size=(n, e)), jnp.float32)

  ks = jax.random.split(jax.random.PRNGKey(args.seed), 4)
  wr = (jax.random.normal(ks[1], (d, e)) * (0.01 / math.sqrt(d))).astype(dtype)
  params = {"w1": (jax.random.normal(ks[2], (e, d, f)) / math.sqrt(d)).astype(dtype),
            "w2": (jax.random.normal(ks[3], (e, f, d)) / math.sqrt(f)).astype(dtype)}
  inputs = [(jax.random.normal(jax.random.fold_in(ks[0], i), (n, d)).astype(dtype), draw_bias())
            for i in range(args.rotate)]
  experts = route.Experts(route.ffn())
  router = route.Router(e, k=k, renormalize=k > 1)

  def logits_of(x, bias):
    return jnp.dot(x, wr, preferred_element_type=jnp.float32) + bias

  results: dict = {}
  x0, b0 = inputs[0]
  ref = jax.jit(lambda p, x, b: ragged_dot_ffn(x, logits_of(x, b), p["w1"], p["w2"], k))(
      params, x0, b0)
  loads = np.asarray(router(logits_of(x0, b0)).loads)

  def record(label, fn, jitted=True, **extra):
    if elapsed() > args.budget:
      print(f"  {label:44s} skipped (budget)", flush=True)
      return
    f = jax.jit(fn) if jitted else fn
    try:
      r = timeit([lambda x=x, b=b: f(params, x, b) for x, b in inputs], args.iters)
      r["rel_err_vs_ragged_dot"] = rel_err(f(params, x0, b0), ref)
    except Exception as e:  # one failing method must not lose the others' figures
      results[label] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
      print(f"  {label:44s} FAILED {results[label]['error'][:300]}", flush=True)
      return
    r.update(extra)
    results[label] = r
    print(f"  {label:44s} {r['median_ms']:8.3f} ms  p90 {r['p90_ms']:8.3f}  err "
          f"{r['rel_err_vs_ragged_dot']:.1e}", flush=True)

  # The default (tiling=None: 128- or 64-row tiles by the mean load), then the sweep.
  default = route.Tiling.auto(n * k, e)
  tilings = {f"grouped pallas default {tiling_name(default)}": None}
  if name in args.sweep:
    tilings.update({f"grouped pallas {tiling_name(t)}": t for t in args.tilings if t != default})
  for label, t in tilings.items():
    moe = route.Routed(experts, router, mode="grouped", kernel="pallas", tiling=t)
    record(label, lambda p, x, b, moe=moe: moe(p, x, logits_of(x, b)))
  gx = route.Routed(experts, router, mode="grouped", kernel="xla")
  record("grouped xla (ragged_dot, tile layout)", lambda p, x, b: gx(p, x, logits_of(x, b)))
  mb = args.min_bucket
  opts = dict(buckets=dynjax.buckets.linear(mb, min=mb), fusion="auto", group_overhead=256)
  sync = route.Routed(experts, router, mode="exact-sync", **opts)
  for _ in range(args.profile_draws):
    sync.capacities(sync.route(logits_of(x0, draw_bias())))
  prof = route.Routed(experts, router, mode="profiled", profile=sync.profile, quantile=1.0,
                      **opts)
  record("profiled", lambda p, x, b: prof(p, x, logits_of(x, b)))
  lj = jax.jit(logits_of)
  record("exact-sync", lambda p, x, b: sync(p, x, lj(x, b)), jitted=False)
  record("lax.ragged_dot (sort)",
         lambda p, x, b: ragged_dot_ffn(x, logits_of(x, b), p["w1"], p["w2"], k))
  cap = math.ceil(1.25 * n * k / e)
  plan = route.make_plan((cap,) * e)
  record("capacity 1.25 (drops tokens)",
         lambda p, x, b: route.apply(experts, p, x, router(logits_of(x, b)), plan),
         dropped_fraction=float(np.maximum(loads - cap, 0).sum() / (n * k)))
  record("dense (every expert)", lambda p, x, b: dense_ffn(x, logits_of(x, b), p["w1"], p["w2"],
                                                          k))
  flops = 4.0 * n * k * d * f
  nbytes = 2.0 * (int((loads > 0).sum()) * 2 * d * f + 2 * n * d)
  roof = max(flops / NOMINAL_PEAK, nbytes / NOMINAL_BW) * 1e3
  print(f"  {'roofline (800 TF/s, 3.3 TB/s)':44s} {roof:8.3f} ms", flush=True)
  out = {"setting": name, "k": k, "loads": loads.tolist(), "roofline_ms": roof,
         "default_tiling": tiling_name(route.Tiling.auto(n * k, e)), "methods": results}
  timed = [m for m in results if m.startswith("grouped pallas") and "median_ms" in results[m]]
  if name in args.train and elapsed() < args.budget and timed:
    best = min(timed, key=lambda m: results[m]["median_ms"])
    t = tilings[best]
    moe = route.Routed(experts, router, mode="grouped", kernel="pallas", tiling=t)
    ct = jnp.ones((n, d), jnp.float32) / n
    train = {}
    fns = {f"train {best}": lambda p, x, b: moe(p, x, logits_of(x, b)),
           "train profiled": lambda p, x, b: prof(p, x, logits_of(x, b)),
           "train lax.ragged_dot (sort)":
               lambda p, x, b: ragged_dot_ffn(x, logits_of(x, b), p["w1"], p["w2"], k)}
    for label, fn in fns.items():
      g = jax.jit(jax.value_and_grad(
          lambda p, x, b, fn=fn: jnp.sum(fn(p, x, b).astype(jnp.float32) * ct), (0, 1)))
      try:
        r = timeit([lambda x=x, b=b, g=g: g(params, x, b) for x, b in inputs], args.iters)
      except Exception as e:
        train[label] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(f"  {label:44s} FAILED {train[label]['error'][:300]}", flush=True)
        continue
      train[label] = r
      print(f"  {label:44s} {r['median_ms']:8.3f} ms  (loss + grads in W and x)", flush=True)
    out["train"] = train
  return out


# -----------------------------------------------------------------------------------------------
# e2e: a Flax MoE encoder block under dynjax.flax.jit
# -----------------------------------------------------------------------------------------------
def build_flax_model(cfg: dict, dispatch: str, routed):
  import flax.linen as nn

  dtype = jnp.bfloat16

  class MoERouter(nn.Module):
    """The gate: logits over the experts (float32)."""

    num_experts: int

    @nn.compact
    def __call__(self, x):
      return nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                      kernel_init=nn.initializers.normal(0.02), name="gate")(x)

  class MoEExperts(nn.Module):
    """Stacked expert FFNs ``gelu(x @ w1[e]) @ w2[e]``; how tokens reach them is ``dispatch``."""

    num_experts: int
    hidden: int
    k: int

    @nn.compact
    def __call__(self, x, logits, mask):
      d = x.shape[-1]
      init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1, out_axis=2)
      w1 = self.param("w1", init, (self.num_experts, d, self.hidden)).astype(dtype)
      w2 = self.param("w2", init, (self.num_experts, self.hidden, d)).astype(dtype)
      if dispatch == "none":  # the process warm-up model: everything but the experts
        return jnp.zeros_like(x) + 0 * logits[:, :1].astype(x.dtype)
      if dispatch in ("grouped", "profiled"):
        return routed({"w1": w1, "w2": w2}, x, logits, mask=mask)
      if dispatch == "ragged_dot" and isinstance(x.shape[0], int):
        return ragged_dot_ffn(x, logits, w1, w2, self.k, mask)
      return dense_ffn(x, logits, w1, w2, self.k, mask)  # also the symbolic shape trace

  class MoEBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      b, t, d = x.shape
      h = nn.LayerNorm(dtype=dtype)(x)
      attn_mask = nn.make_attention_mask(mask, mask)
      x = x + nn.MultiHeadDotProductAttention(num_heads=cfg["heads"], dtype=dtype)(
          h, h, mask=attn_mask)
      h = nn.LayerNorm(dtype=dtype)(x).reshape(b * t, d)
      logits = MoERouter(cfg["experts"])(h)
      y = MoEExperts(cfg["experts"], cfg["ffn"], cfg["k"])(h, logits, mask.reshape(-1))
      return x + y.reshape(b, t, d)

  class MoEEncoder(nn.Module):
    @nn.compact
    def __call__(self, tokens, lengths):
      b, t = tokens.shape
      mask = jnp.arange(t)[None, :] < lengths[:, None]
      x = nn.Embed(cfg["vocab"], cfg["d"], dtype=dtype)(tokens)
      pos = self.param("pos", nn.initializers.normal(0.02), (cfg["max_len"], cfg["d"]))
      x = x + pos[:t].astype(dtype)[None]
      x = MoEBlock()(x, mask)
      m = mask[..., None].astype(jnp.float32)
      return jnp.sum(x.astype(jnp.float32) * m, 1) / lengths[:, None].astype(jnp.float32)

  return MoEEncoder()


def request_stream(n: int, batch: int, max_len: int, vocab: int, seed: int):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    lengths = np.clip(rng.lognormal(4.3, 0.8, size=batch), 4, max_len).astype(np.int32)
    t = int(lengths.max())
    tokens = rng.integers(1, vocab, size=(batch, t)).astype(np.int32)
    tokens[np.arange(t)[None, :] >= lengths[:, None]] = 0
    out.append((tokens, lengths))
  return out


def time_stream(fn, variables, stream) -> np.ndarray:
  """Milliseconds of each request of ``stream`` (numpy in, numpy out), one after another."""
  ts = []
  for tok, lens in stream:
    t1 = time.perf_counter()
    np.asarray(fn(variables, tok, lens))
    ts.append(time.perf_counter() - t1)
  return np.asarray(ts) * 1e3


def time_interleaved(fns: dict, variables, stream, rounds: int) -> dict:
  """Milliseconds per request of every function, the functions taking turns on each request
  (the first one rotating), ``rounds`` passes over ``stream``: phases of the host (clocks,
  other tenants) land on every variant alike, unlike one whole stream after another."""
  names = list(fns)
  ts = {n: [] for n in names}
  i = 0
  for _ in range(rounds):
    for tok, lens in stream:
      for j in range(len(names)):
        n = names[(i + j) % len(names)]
        t1 = time.perf_counter()
        np.asarray(fns[n](variables, tok, lens))
        ts[n].append(time.perf_counter() - t1)
      i += 1
  return {n: np.asarray(v) * 1e3 for n, v in ts.items()}


def run_e2e(args) -> dict:
  import dynjax.flax

  cfg = dict(vocab=30522, d=args.d, heads=16, ffn=args.ffn, experts=8, k=2, max_len=512,
             batch=8, requests=args.e2e_requests)
  if args.small:
    cfg.update(vocab=512, heads=4, max_len=128)
  stream = request_stream(cfg["requests"], cfg["batch"], cfg["max_len"], cfg["vocab"], args.seed)
  t_policy = dynjax.buckets.pow2(min=16, max=cfg["max_len"])
  experts = route.Experts(route.ffn())
  router = route.Router(cfg["experts"], k=cfg["k"], renormalize=True)
  on_gpu = jax.default_backend() != "cpu"
  variants = {}
  combine = {}  # label -> its LAYER_OPTIONS name for its builds (grouped+sort, ...; else None)
  for v in args.e2e_variants.split(","):
    if v.startswith("grouped"):  # grouped (auto kernel), grouped-pallas, grouped-hopper:TILING
      base, combine[f"dynjax {v} (gmm kernel)"] = layer_option(v, "--e2e-variants")
      kernel, _, tiling = base.partition("-")[2].partition(":")
      kernel = kernel or ("auto" if on_gpu else "xla")
      variants[f"dynjax {v} (gmm kernel)"] = ("grouped", route.Routed(
          experts, router, mode="grouped", kernel=kernel,
          tiling=parse_tiling(tiling) if tiling else None))
    elif v == "profiled":
      variants["dynjax profiled"] = ("profiled", route.Routed(
          experts, router, mode="profiled",
          buckets=dynjax.buckets.geometric(1.25, min=64).aligned(64)))
    else:
      variants[{"ragged_dot": "lax.ragged_dot", "dense": "dense MoE"}[v]] = (v, None)
  if args.e2e_device_outputs:  # the same variants with host_outputs=False, in the same process
    variants |= {f"{label} [device outputs]": (d, r, False) for label, (d, r) in variants.items()}
  variants = {label: v if len(v) == 3 else (*v, None) for label, v in variants.items()}
  # the same variants compiled with other XLA options (benchmarks/_xla_options.py), e.g. no
  # CUDA graphs, in the same process: taking turns with the defaults below
  xla_sets = xla_options.parse(args.e2e_xla_options)
  variants = {label: (*v, None) for label, v in variants.items()} | {
      f"{label} [{o}]": (*v, opts) for o, opts in xla_sets.items()
      for label, v in variants.items() if v[0] in ("grouped", "dense")}
  if args.e2e_jax_put:  # the same variants with JAX's own input transfers, in the same process
    variants |= {f"{label} [jax put]": v for label, v in variants.items()
                 if v[0] in ("grouped", "dense")}
  grouped = next((r for d, r, _, _ in variants.values() if d == "grouped"), None)
  init_tok, init_len = stream[0]
  w1 = {"w1": jnp.zeros((1, cfg["d"], cfg["ffn"]))}
  ts = [16 << i for i in range(8) if 16 << i <= cfg["max_len"]]
  out = {"setting": cfg, "cast_once": not args.no_cast_once, "methods": {},
         "kernels": {  # per length bucket t (rows = batch t k)
      label: {t: r.grouped_kernel(w1, jnp.bfloat16, cfg["batch"] * t * cfg["k"]) for t in ts}
      for label, (d, r, _, _) in variants.items() if d == "grouped"}}
  variables = jax.jit(build_flax_model(cfg, "dense", None).init)(
      jax.random.PRNGKey(0), jnp.asarray(init_tok), jnp.asarray(init_len))
  # Process warm-up, untimed: the model without experts over every length bucket of the stream,
  # so that one-time costs (backend start, XLA's in-process autotuning of the attention and
  # embedding GEMMs, which every variant shares) do not land on whichever variant runs first.
  def serve(model, **kw):  # every variant wrapped alike (kw: host_outputs, compiler_options)
    return dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"},
                           buckets={"t": t_policy, "b": dynjax.buckets.explicit([cfg["batch"]])},
                           padding="trust", cast_once=not args.no_cast_once, **kw)

  def warm_up(fn) -> set:  # one call per length bucket of the stream
    seen = set()
    for tok, lens in stream:
      b = t_policy.bucket(tok.shape[1])
      if b not in seen:
        seen.add(b)
        np.asarray(fn(variables, tok, lens))
    return seen

  t0 = time.perf_counter()
  warm = serve(build_flax_model(cfg, "none", None))
  seen = warm_up(warm)
  out["warmup_s"] = time.perf_counter() - t0
  print(f"  process warm-up (model without experts, {len(seen)} length buckets) "
        f"{out['warmup_s']:.1f} s, untimed", flush=True)
  # The same model without its experts, timed on the stream: the share of every request that
  # is not the MoE layer (attention, norms, embedding, dispatch, transfers).
  ts = time_stream(warm, variables, stream)
  out["no_moe"] = {"mean_ms": float(ts.mean()), "median_ms": float(np.median(ts))}
  print(f"  {'no MoE (the block without experts)':32s} mean {ts.mean():8.3f} ms  p50 "
        f"{np.median(ts):8.3f}", flush=True)
  outputs = {}
  fns = {"no MoE": warm}
  for o, opts in xla_sets.items():  # the block without experts with those options, warmed up
    fns[f"no MoE [{o}]"] = serve(build_flax_model(cfg, "none", None), compiler_options=opts)
    warm_up(fns[f"no MoE [{o}]"])
  for label, (dispatch, routed, host_outputs, opts) in variants.items():
    if elapsed() > args.budget:
      print(f"  {label:32s} skipped (budget)", flush=True)
      continue
    model = build_flax_model(cfg, dispatch, routed)
    fn = serve(model, host_outputs=host_outputs, compiler_options=opts)
    if label.endswith("[jax put]"):
      fn = jax_put(fn)
    t0 = time.perf_counter()
    try:  # the cold pass builds every bucket
      with layer_options(combine.get(label.split(" [")[0])):
        ys = [np.asarray(fn(variables, tok, lens)) for tok, lens in stream]
    except Exception as e:  # one failing variant must not lose the others' figures
      out["methods"][label] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
      print(f"  {label:32s} FAILED {out['methods'][label]['error'][:600]}", flush=True)
      continue
    cold = time.perf_counter() - t0
    ts = time_stream(fn, variables, stream)
    outputs[label] = ys
    fns[label] = fn
    st = fn.stats()
    out["methods"][label] = {"mean_ms": float(ts.mean()), "median_ms": float(np.median(ts)),
                             "p90_ms": float(np.percentile(ts, 90)), "cold_s": cold,
                             # of the cold pass: the buckets' builds (trace excluded: lowering
                             # and XLA compile, Mosaic GPU kernels included), and how many
                             "build_s": float(st.get("compile_seconds", 0.0)),
                             "builds": int(st.get("compiles", 0)),
                             # of those, the Python side: trace + padding + JAX lowering
                             "lowering_s": float(st.get("lowering_seconds", 0.0)),
                             "cast_once": st.get("cast_once"),
                             "host_outputs": st.get("host_outputs"),
                             # results read by the CUDA driver (session 33), or why not
                             "output_reads": (st.get("direct_output_families"),
                                              st.get("direct_outputs_failed")),
                             # float32 copies of the expert weights left in the optimized
                             # HLO of the largest bucket (0: the casts folded away)
                             "hlo_f32_expert_weights": f32_expert_weights(fn, cfg)}
    print(f"  {label:32s} mean {ts.mean():8.3f} ms  p50 {np.median(ts):8.3f}  cold {cold:6.1f} s"
          f"  (builds {st.get('compiles', 0)}: {st.get('compile_seconds', 0.0):.1f} s, lowering "
          f"{st.get('lowering_seconds', 0.0):.1f} s)", flush=True)
  if args.e2e_interleave and len(fns) > 2:
    inter = time_interleaved(fns, variables, stream, args.e2e_interleave)
    out["interleaved"] = {n: {"mean_ms": float(v.mean()), "median_ms": float(np.median(v))}
                          for n, v in inter.items()}
    print(f"  interleaved ({args.e2e_interleave} rounds, variants taking turns per request):",
          flush=True)
    for n, v in inter.items():
      print(f"    {n:32s} mean {v.mean():8.3f} ms  p50 {np.median(v):8.3f}", flush=True)
  ref = outputs.get("dense MoE")
  for label, m in out["methods"].items():
    if ref is not None and label in outputs:
      m["rel_err_vs_dense"] = max(rel_err(a, b) for a, b in zip(outputs[label], ref, strict=True))
  # A training step at one length bucket: loss and grads of the grouped model.
  if elapsed() < args.budget and grouped is not None:
    model = build_flax_model(cfg, "grouped", grouped)
    tok, lens = stream[0]
    tgt = jnp.ones((cfg["batch"], cfg["d"]), jnp.float32)

    def loss(v):
      return jnp.mean(jnp.square(model.apply(v, jnp.asarray(tok), jnp.asarray(lens)) - tgt))

    step = jax.jit(jax.value_and_grad(loss))
    lv, grads = step(variables)
    finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    r = timeit([lambda: step(variables)], max(5, args.iters // 2))
    out["train_step"] = {"loss": float(lv), "grads_finite": finite, "tokens": list(tok.shape),
                         **r}
    print(f"  train step (grouped, loss+grads, {tok.shape}) {r['median_ms']:8.3f} ms  loss "
          f"{float(lv):.4f}  grads finite {finite}", flush=True)
  return out


def jax_put(fn):
  """``fn`` whose call paths, built inside its calls, leave a request's small numpy inputs to
  JAX's own transfers instead of the CUDA driver's copies (dynjax/jit/_cuda.py): the A/B of
  ``--e2e-jax-put`` in one process (single-threaded)."""
  from dynjax.jit import _placement  # its DIRECT_PLATFORMS, read as each call path is built

  def call(*args):
    saved = _placement.DIRECT_PLATFORMS
    _placement.DIRECT_PLATFORMS = ()
    try:
      return fn(*args)
    finally:
      _placement.DIRECT_PLATFORMS = saved

  call.stats, call._dispatcher = fn.stats, fn._dispatcher
  return call


def f32_expert_weights(fn, cfg) -> int | None:
  """How often a float32 array of an expert weight's shape appears in the optimized HLO of
  the function's largest compiled bucket (with every weight cast once and the casts folded:
  only in the router/none; without: the parameter and its convert)."""
  try:
    fam = max(fn._dispatcher.all_families.values(), key=lambda f: len(f.buckets))
    entry = fam.buckets[max(fam.buckets)]
    text = entry.exe.as_text()
  except Exception:  # noqa: BLE001 - a figure for the report only
    return None
  e, d, f = cfg["experts"], cfg["d"], cfg["ffn"]
  return text.count(f"f32[{e},{d},{f}]") + text.count(f"f32[{e},{f},{d}]")


def print_table(report: dict) -> None:
  print(f"\n== summary (median ms; jax {report['jax']}, {report['device']})")
  for s in report["layer"]:
    m = s["methods"]
    grouped = {k: v for k, v in m.items() if k.startswith("grouped pallas") and "median_ms" in v}
    best = min(grouped, key=lambda k: grouped[k]["median_ms"]) if grouped else None
    cols = [("gmm best", best), ("gmm xla", "grouped xla (ragged_dot, tile layout)"),
            ("profiled", "profiled"), ("exact-sync", "exact-sync"),
            ("ragged_dot", "lax.ragged_dot (sort)"), ("cap1.25", "capacity 1.25 (drops tokens)"),
            ("dense", "dense (every expert)")]
    row = "  ".join(f"{c} {m[key]['median_ms']:7.3f}" if "median_ms" in m.get(key, {})
                    else f"{c}    -  " for c, key in cols)
    print(f"{s['setting']:>9s} k={s['k']}  {row}  roof {s['roofline_ms']:.3f}  [{best}; "
          f"default {s['default_tiling']}]")
    for label, r in s.get("train", {}).items():
      print(f"{'':>13s} {label}: {r.get('median_ms', float('nan')):.3f} ms")
  if report.get("e2e"):
    print(f"  e2e kernels: {report['e2e'].get('kernels')}")
    for label, r in report["e2e"]["methods"].items():
      if "error" in r:
        print(f"  e2e {label:32s} FAILED")
        continue
      print(f"  e2e {label:32s} mean {r['mean_ms']:.3f} ms  cold {r['cold_s']:.1f} s  err "
            f"{r.get('rel_err_vs_dense', float('nan')):.1e}")
    if "train_step" in report["e2e"]:
      print(f"  e2e train step {report['e2e']['train_step']}")


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true", help="CPU sizes")
  ap.add_argument("--no-cast-once", action="store_true",
                  help="dynjax.jit(cast_once=False): the f32 weights are cast on every call")
  ap.add_argument("--no-kernel-export", action="store_true",
                  help="lower the GPU kernels in every executable (route._once.EXPORT off)")
  ap.add_argument("--parts", default="check,layer,e2e")
  ap.add_argument("--settings", default="uniform8,zipf8,uniform64,zipf64")
  ap.add_argument("--k", default="1,2")
  ap.add_argument("--tilings", default="128x64x128x8x3,128x64x256x8x3,64x64x128x4x4,"
                  "64x64x256x8x3",
                  help="tm x tk x tn x num_warps x num_stages, swept on --sweep settings")
  ap.add_argument("--sweep", default="uniform8,uniform64,zipf64",
                  help="settings that sweep --tilings (others: the default tiling only)")
  ap.add_argument("--train", default="uniform8,zipf64", help="settings timing a training step")
  ap.add_argument("--iters", type=int, default=30)
  ap.add_argument("--rotate", type=int, default=3)
  ap.add_argument("--profile-draws", type=int, default=16)
  ap.add_argument("--zipf", type=float, default=1.2)
  ap.add_argument("--e2e-requests", type=int, default=200)
  ap.add_argument("--e2e-interleave", type=int, default=3,
                  help="rounds of the stream with the variants taking turns per request (0: off)")
  ap.add_argument("--e2e-variants", default="grouped,ragged_dot,dense,profiled",
                  help="grouped (kernel auto), grouped-pallas, grouped-mgpu, grouped-hopper, "
                       "grouped-KERNEL:TILING (tm x tk x tn x warps x stages g grid_block_n), "
                       "any of them +apart, +fused (the combine on its own or fused into "
                       "its consumer) or +sort (positions by a sort; LAYER_OPTIONS), "
                       "ragged_dot, dense, profiled; the first grouped one also times the "
                       "training step")
  ap.add_argument("--e2e-device-outputs", action="store_true",
                  help="also every e2e variant with host_outputs=False (outputs in device "
                       "memory, the default before session 10), interleaved with the others")
  ap.add_argument("--e2e-xla-options", default="",
                  help="also the grouped and dense variants (and the block without experts) "
                       "compiled with these named XLA option sets "
                       f"({', '.join(xla_options.OPTION_SETS)}), taking turns with the others")
  ap.add_argument("--e2e-jax-put", action="store_true",
                  help="also the grouped and dense variants with the requests' numpy inputs "
                       "left to JAX's own transfers (no CUDA driver copies), taking turns "
                       "with the others")
  ap.add_argument("--budget", type=float, default=1e9, help="seconds; later rows are skipped")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  args.tilings = [parse_tiling(s) for s in args.tilings.split(",")]
  args.sweep = set(args.sweep.split(","))
  args.train = set(args.train.split(","))
  if args.no_kernel_export:
    from dynjax.route import _once

    _once.EXPORT = False
  if args.small:
    args.d, args.ffn, args.tokens, args.min_bucket = 128, 256, 256, 16
    args.tilings = [route.Tiling(tm=16, tk=16, tn=32)]
    args.iters, args.profile_draws, args.rotate = 3, 2, 2
    args.e2e_requests = min(args.e2e_requests, 6)
  else:
    args.d, args.ffn, args.tokens, args.min_bucket = 1024, 4096, 8192, 128
  dev = jax.devices()[0]
  report = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) if hasattr(jax, "lib") else None,
            "python": platform.python_version(),
            "args": {k: (v if not isinstance(v, set | list) else sorted(map(str, v)))
                     for k, v in vars(args).items()}, "layer": []}
  print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)

  def save():
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "bench_moe_gmm.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)

  for part in args.parts.split(","):  # in the order given
    run_part(part, args, report, save)
  print_table(report)
  report["elapsed_s"] = elapsed()
  save()
  return report


def run_part(part: str, args, report: dict, save) -> None:
  parts = [part]
  if "check" in parts:
    print("\n== check (on the device)", flush=True)
    try:
      report["check"] = run_check(args)
    except Exception as e:
      report["check"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
      print(f"  check FAILED {report['check']['error']}", flush=True)
    save()
  if "layer" in parts:
    for k in (int(v) for v in args.k.split(",")):
      for name in args.settings.split(","):
        if elapsed() > args.budget:
          break
        print(f"\n== layer {name}, k={k}, d={args.d}, ffn={args.ffn}, {args.tokens} tokens, "
              f"bf16  [{elapsed():.0f} s]", flush=True)
        report["layer"].append(run_layer(name, k, args))
        save()
  if "e2e" in parts and elapsed() < args.budget:
    print(f"\n== e2e: Flax MoE encoder block (k=2) under dynjax.flax.jit  [{elapsed():.0f} s]",
          flush=True)
    try:
      report["e2e"] = run_e2e(args)
    except Exception as e:
      report["e2e_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
      print(f"  e2e FAILED {report['e2e_error']}", flush=True)
    save()


if __name__ == "__main__":
  main()
