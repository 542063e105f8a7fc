"""The grouped layer's kernels on Hopper: JAX's Mosaic GPU ragged dot ("mgpu") against our Triton
kernel ("pallas"), kernel by kernel, piece by piece, and layer by layer.

    python benchmarks/bench_moe_kernels.py --out DIR                       # H100, every part
    python benchmarks/bench_moe_kernels.py --small --fake-mgpu             # CPU smoke run

Parts (``--parts``, in the order given):
  env     jax version, device, whether the Mosaic GPU kernels import (their source files are
          copied to DIR so that their signatures can be read back).
  check   route.gmm(backend="mgpu") forward and grads against float32 lax.ragged_dot on awkward
          packed group sizes, and the grouped layer (k=1, 2; forward + grads) in bf16 against the
          float32 dense reference.
  sweep   each of the FFN's two GEMMs alone ([8192, 1024] x [E, 1024, 4096] and [8192, 4096] x
          [E, 4096, 1024], bf16, the routing's loads), per --mgpu / --hopper / --triton tiling,
          and cuBLAS'
          dense [8192, 1024] x [1024, 4096] for scale.  Four calls inside one executable on
          rotating inputs, time / 4: no dispatch in the figure.
  pieces  the layer split: router, layout + row gather, GEMM 1 (+ GELU), GEMM 2, combine, and the
          whole layer in one executable (same x4 timing) and per call (block_until_ready each).
  layer   the whole layer per call (as bench_moe_gmm.py times it; --layer-timing x4: four in one
          executable, time / 4; pipelined: 16 calls back to back, one block): grouped
          kernel="auto", and
          beside it each --layer-kernels kernel auto did not pick (mgpu, pallas = Triton) and
          --mgpu-layer tilings, capacity 1.25 (drops),
          optionally lax.ragged_dot and dense (--layer-extra), per setting and k; a training step
          (loss + grads) on --train settings.

Writes DIR/bench_moe_kernels.json after every part.  Every figure: median of --iters calls
after a warm-up over every rotating input.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _xla_options as xla_options  # noqa: E402
from benchmarks._report import write_json  # noqa: E402
from benchmarks.bench_moe_gmm import (  # noqa: E402
  dense_ffn,
  grad_rel_errs,
  layer_inputs,
  ragged_dot_ffn,
  rel_err,
  timeit,
  zipf_probs,
)
from benchmarks.bench_moe_gmm import (
  parse_tiling as parse,
)
from dynjax import route  # noqa: E402
from dynjax.route import _gmm, _mgpu  # noqa: E402

T0 = time.perf_counter()
REPS = 4
PIPELINE_BURST = 16  # --layer-timing pipelined: calls launched back to back per sample


def elapsed() -> float:
  return time.perf_counter() - T0


def name(t: route.Tiling) -> str:
  return f"{t.tm}x{t.tk}x{t.tn}x{t.num_warps}x{t.num_stages}g{t.grid_block_n}"


def fake_mgpu() -> None:
  """CPU smoke runs: lax.ragged_dot stand-ins for the Mosaic GPU kernels."""
  def rd(lhs, rhs, *, group_sizes, transpose_rhs=False, **_):
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs,
                              group_sizes).astype(lhs.dtype)

  def tr(lhs, rhs, *, group_sizes, **_):
    dims = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims).astype(lhs.dtype)

  _mgpu.TEST_KERNELS = {"ragged_dot": rd, "transposed_ragged_dot": tr, "transpose_rhs": True,
                        "error": None}


def timed(label: str, results: dict, fn, args_list, iters: int, per: int = 1, **extra) -> None:
  """Times ``fn(*a)`` over the rotating ``args_list``; stores ms / ``per`` or the error."""
  try:
    r = timeit([lambda a=a: fn(*a) for a in args_list], iters)
    r = {key: v / per for key, v in r.items()}
  except Exception as e:  # one failing variant must not lose the others' figures
    results[label] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
    print(f"  {label:52s} FAILED {results[label]['error'][:400]}", flush=True)
    return
  r.update(extra)
  results[label] = r
  print(f"  {label:52s} {r['median_ms']:8.4f} ms  (min {r['min_ms']:.4f})", flush=True)


# -----------------------------------------------------------------------------------------------
def run_env(args) -> dict:
  k = _mgpu.kernels()
  dev = jax.devices()[0]
  out = {"jax": jax.__version__, "device": dev.device_kind,
         "compute_capability": str(getattr(dev, "compute_capability", "")),
         "mgpu_import_error": k["error"], "mgpu_transpose_rhs": k["transpose_rhs"],
         "mgpu_transposed_kernel": k["transposed_ragged_dot"] is not None,
         "mgpu_unavailable_reason": _mgpu.unavailable_reason(jnp.bfloat16),
         "auto_backend_bf16": _gmm.resolve_backend("auto", jnp.bfloat16)}
  for fn in (k["ragged_dot"], k["transposed_ragged_dot"]):
    if fn is not None and args.out:
      import inspect

      try:
        src = inspect.getsourcefile(fn)
        shutil.copy(src, os.path.join(args.out, os.path.basename(src)))
        out.setdefault("signatures", {})[fn.__name__] = str(inspect.signature(fn))
      except (OSError, TypeError) as e:
        out["copy_error"] = str(e)
  for key, v in out.items():
    print(f"  {key}: {v}", flush=True)
  return out


def run_check(args) -> dict:
  res = {}
  rng = np.random.default_rng(0)
  d, f = args.d, args.ffn
  sizes = np.array([0, 389, 1, 0, 128, 700, 0, 17], np.int32)
  rows = -(-int(sizes.sum()) // 128) * 128 + 128  # 128 rows past the last group
  lhs = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), d, f)) / math.sqrt(d), jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((rows, f)), jnp.float32)
  full = sizes.copy()
  full[-1] += rows - sizes.sum()  # the mgpu backend gives the rows past the end to the last group
  # "hopper": tile-aligned groups (128-row tiles), the rows past them belong to the last group.
  tiled = ((sizes + 127) // 128) * 128
  tiled_full = tiled.copy()
  tiled_full[-1] += rows - tiled.sum()
  gs = jnp.asarray(sizes)
  for backend, t, gref in (("mgpu", _gmm.MGPU_TILING, jnp.asarray(full)),
                           ("hopper", _gmm.HOPPER_TILING, jnp.asarray(tiled_full))):
    if backend not in args.check_kernels.split(","):
      continue

    def ref(a, b, gref=gref):
      return jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), gref)

    def mg(a, b, t=t, backend=backend):
      return route.gmm(a, b, gs, tiling=t, backend=backend)

    pre = "gmm" if backend == "mgpu" else f"gmm_{backend}"
    try:
      y = jax.jit(mg)(lhs, rhs)
      res[f"{pre}_fwd_rel_err"] = rel_err(y, jax.jit(ref)(lhs, rhs))
      res[f"{pre}_fwd_all_finite"] = bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
      if backend == "hopper":  # the fused activation in the epilogue
        ya = jax.jit(lambda a, b, t=t: route.gmm(a, b, gs, tiling=t, backend="hopper",
                                                 activation=jax.nn.gelu))(lhs, rhs)
        res[f"{pre}_fwd_gelu_rel_err"] = rel_err(ya, jax.nn.gelu(jax.jit(ref)(lhs, rhs)))
      got = jax.jit(jax.grad(lambda a, b, mg=mg: jnp.sum(mg(a, b).astype(jnp.float32) * ct),
                             (0, 1)))(lhs, rhs)
      want = jax.jit(jax.grad(lambda a, b, ref=ref: jnp.sum(ref(a, b) * ct), (0, 1)))(lhs, rhs)
      res[f"{pre}_dlhs_rel_err"] = rel_err(got[0], want[0])
      res[f"{pre}_drhs_rel_err"] = rel_err(got[1], want[1])
    except Exception as e:
      res[f"{pre}_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
  e, n, dm, fm = (8, 200, 128, 256) if args.small else (args.check_experts, 1000, 256, 512)
  params, x, logits, ks = layer_inputs(e, n, dm, fm, n_keys=5)
  ctl = jax.random.normal(ks[4], (n, dm))
  mask = jnp.arange(n) < n - 37
  for kernel, k in [(kn, k) for kn in args.check_kernels.split(",") for k in (1, 2)]:
    moe = route.Routed(route.Experts(route.ffn()), route.Router(e, k=k, renormalize=k > 1),
                       mode="grouped", kernel=kernel)
    pre = f"layer_k{k}" if kernel == "mgpu" else f"layer_{kernel}_k{k}"

    def ours(p, x, lg, moe=moe):
      pb = {key: val.astype(jnp.bfloat16) for key, val in p.items()}
      return moe(pb, x.astype(jnp.bfloat16), lg, mask=mask)

    def dense_k(p, x, lg, k=k):
      return dense_ffn(x, lg, p["w1"], p["w2"], k, mask)

    try:
      errs = grad_rel_errs(ours, dense_k, (params, x, logits), ctl)
      res[f"{pre}_bf16_max_rel_err(loss,dW1,dW2,dx,dlogits)"] = max(errs)
      res[f"{pre}_bf16_rel_errs"] = [float(v) for v in errs]
    except Exception as ex:
      res[f"{pre}_error"] = f"{type(ex).__name__}: {str(ex)[:1500]}"
  for key, v in res.items():
    print(f"  {key:52s} {v:.2e}" if isinstance(v, float) else f"  {key:52s} {v}", flush=True)
  return res


# -----------------------------------------------------------------------------------------------
class Setting:
  """Inputs of one routing setting: weights, rotating inputs, router, logits."""

  def __init__(self, setting: str, k: int, args):
    kind = "zipf" if setting.startswith("zipf") else "uniform"
    self.name, self.k, self.e = setting, k, int(setting[len(kind):])
    d, f, n = args.d, args.ffn, args.tokens
    rng = np.random.default_rng(args.seed)
    probs = zipf_probs(self.e, args.zipf) if kind == "zipf" else np.full(self.e, 1.0 / self.e)
    ks = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    self.wr = (jax.random.normal(ks[1], (d, self.e)) * (0.01 / math.sqrt(d))).astype(jnp.bfloat16)
    self.params = {
        "w1": (jax.random.normal(ks[2], (self.e, d, f)) / math.sqrt(d)).astype(jnp.bfloat16),
        "w2": (jax.random.normal(ks[3], (self.e, f, d)) / math.sqrt(f)).astype(jnp.bfloat16)}
    self.inputs = [
        (jax.random.normal(jax.random.fold_in(ks[0], i), (n, d)).astype(jnp.bfloat16),
         jnp.asarray(np.log(probs)[None, :] + rng.gumbel(size=(n, self.e)), jnp.float32))
        for i in range(args.rotate)]
    self.router = route.Router(self.e, k=k, renormalize=k > 1)
    self.experts = route.Experts(route.ffn())

  def logits(self, x, b):
    return jnp.dot(x, self.wr, preferred_element_type=jnp.float32) + b

  def routed(self, kernel: str, tiling=None) -> route.Routed:
    return route.Routed(self.experts, self.router, mode="grouped", kernel=kernel, tiling=tiling)


SWEEP_BEST: dict[tuple[str, str], tuple[str, float]] = {}  # (backend, setting) -> (tiling, ms)


def run_sweep(args) -> dict:
  out = {}
  d, f, n = args.d, args.ffn, args.tokens
  key = jax.random.PRNGKey(3)
  xs = [jax.random.normal(jax.random.fold_in(key, i), (n + 1024, d)).astype(jnp.bfloat16)
        for i in range(REPS)]
  hs = [jax.random.normal(jax.random.fold_in(key, 10 + i), (n + 1024, f)).astype(jnp.bfloat16)
        for i in range(REPS)]
  w = (jax.random.normal(key, (d, f)) / math.sqrt(d)).astype(jnp.bfloat16)
  cublas = {}
  timed("cuBLAS dense [N,d]x[d,ffn]", cublas,
        jax.jit(lambda *a: [jnp.dot(x, w) for x in a]), [[x[:n] for x in xs]], args.iters, REPS)
  out["cublas"] = cublas
  for setting in args.sweep_settings.split(","):
    if elapsed() > args.budget:
      break
    s = Setting(setting, 1, args)
    loads = jnp.asarray(s.router(s.logits(*s.inputs[0])).loads, jnp.int32)
    res = {"loads": np.asarray(loads).tolist()}
    print(f"\n== sweep {setting} (k=1)  [{elapsed():.0f} s]", flush=True)
    cands = [("mgpu", parse(t)) for t in filter(None, args.mgpu.split(","))] + \
            [("hopper", parse(t)) for t in filter(None, args.hopper.split(","))] + \
            [("pallas", parse(t)) for t in filter(None, args.triton.split(","))]
    for backend, t in cands:
      if elapsed() > args.budget:
        break
      rows = _gmm.buffer_rows(n, s.e, t, backend)
      both = []  # the two GEMMs' medians (None where one failed)
      for gi, (src, wt) in enumerate(((xs, s.params["w1"]), (hs, s.params["w2"]))):
        fn = jax.jit(lambda *a, wt=wt, t=t, backend=backend, loads=loads: [
            route.gmm(x, wt, loads, tiling=t, backend=backend) for x in a])
        label = f"gemm{gi + 1} {backend} {name(t)} ({rows} rows)"
        timed(label, res, fn, [[x[:rows] for x in src]], args.iters, REPS)
        both.append(res[label].get("median_ms"))
      if backend in ("mgpu", "hopper") and None not in both:  # --*-layer best: fastest pair
        best = SWEEP_BEST.get((backend, setting))
        if best is None or sum(both) < best[1]:
          SWEEP_BEST[(backend, setting)] = (name(t), sum(both))
    out[setting] = res
    for backend in ("mgpu", "hopper"):
      if (backend, setting) in SWEEP_BEST:
        res[f"best_{backend}"] = SWEEP_BEST[(backend, setting)]
  return out


def layer_pieces(s: Setting, kernel: str, tiling: route.Tiling | None):
  """The grouped layer's pieces as separate functions (mirrors grouped_ffn)."""
  n = s.inputs[0][0].shape[0]
  t = tiling or route.Tiling.auto(n * s.k, s.e, kernel)
  rows = _gmm.buffer_rows(n * s.k, s.e, t, kernel)
  align = _gmm.row_alignment(t, kernel)

  def routing(x, b):
    return s.router(s.logits(x, b))

  def gather(x, r):
    lay = route.grouped_layout(r, s.e, align, rows)
    return jnp.take(x, lay.table, axis=0, mode="fill", fill_value=0), lay

  def gemm1(xs, sizes):
    return route.gmm(xs, s.params["w1"], sizes, tiling=t, backend=kernel,
                     activation=jax.nn.gelu)

  def gemm2(h, sizes):
    return route.gmm(h, s.params["w2"], sizes, tiling=t, backend=kernel)

  def combine(ys, r, slots):
    gates = r.gates.astype(jnp.float32)
    picked = jnp.take(ys, slots.reshape(-1), axis=0, mode="fill", fill_value=0)
    picked = picked.astype(jnp.float32).reshape(n, -1, ys.shape[1]) * gates[..., None]
    return jnp.sum(picked, axis=1).astype(ys.dtype)

  return routing, gather, gemm1, gemm2, combine, t


def run_pieces(args) -> dict:
  out = {}
  for spec in args.pieces.split(","):
    setting, _, k = spec.partition(":")
    s = Setting(setting, int(k or 1), args)
    for kernel in args.kernels.split(","):
      if elapsed() > args.budget:
        break
      label = f"{setting} k={s.k} {kernel}"
      print(f"\n== pieces {label}  [{elapsed():.0f} s]", flush=True)
      out[label] = pieces_one(s, kernel, args)
  return out


def pieces_one(s: Setting, kernel: str, args) -> dict:
  res = {}
  routing, gather, gemm1, gemm2, combine, t = layer_pieces(s, kernel, None)
  res["tiling"] = name(t)
  try:
    r0 = [jax.jit(routing)(x, b) for x, b in s.inputs[:REPS]]
    g0 = [jax.jit(gather)(x, r) for (x, _), r in zip(s.inputs, r0, strict=False)]
    h0 = [jax.jit(gemm1)(xs, lay.group_sizes) for xs, lay in g0]
    y0 = [jax.jit(gemm2)(h, lay.group_sizes) for h, (_, lay) in zip(h0, g0, strict=True)]
  except Exception as e:
    res["error"] = f"{type(e).__name__}: {str(e)[:800]}"
    print(f"  FAILED {res['error'][:400]}", flush=True)
    return res
  xb = list(s.inputs[:REPS])
  timed("router (logits, top-k, positions)", res,
        jax.jit(lambda *a: [routing(x, b) for x, b in a]), [xb], args.iters, REPS)
  timed("layout + row gather", res, jax.jit(lambda *a: [gather(x, r) for x, r in a]),
        [[(x, r) for (x, _), r in zip(xb, r0, strict=True)]], args.iters, REPS)
  timed("gemm 1 + gelu", res, jax.jit(lambda *a: [gemm1(xs, lay.group_sizes) for xs, lay in a]),
        [g0], args.iters, REPS)
  timed("gemm 2", res, jax.jit(lambda *a: [gemm2(h, lay.group_sizes) for h, (_, lay) in a]),
        [list(zip(h0, g0, strict=True))], args.iters, REPS)
  timed("combine (gather k rows x gates)", res,
        jax.jit(lambda *a: [combine(y, r, lay.slots) for y, r, (_, lay) in a]),
        [list(zip(y0, r0, g0, strict=True))], args.iters, REPS)
  moe = s.routed(kernel)
  timed("whole layer, x4 in one executable", res,
        jax.jit(lambda *a: [moe(s.params, x, s.logits(x, b)) for x, b in a]), [xb], args.iters,
        REPS)
  timed("whole layer, per call", res, jax.jit(lambda x, b: moe(s.params, x, s.logits(x, b))),
        s.inputs, args.iters)
  return res


def run_layer(args, out: dict | None = None, save=lambda: None) -> dict:
  """Every setting's layer table into ``out``, saved after each (a time limit keeps the
  settings done)."""
  out = {} if out is None else out
  for k in (int(v) for v in args.k.split(",")):
    for setting in args.settings.split(","):
      if elapsed() > args.budget:
        break
      print(f"\n== layer {setting} k={k}  [{elapsed():.0f} s]", flush=True)
      out[f"{setting} k={k}"] = layer_one(Setting(setting, k, args), args)
      save()
  return out


def enqueue_ms(burst, iters: int) -> float:
  """Median ms the host takes to launch ``burst()``'s calls (each sample blocks after)."""
  out, samples = [], []
  for _ in range(max(3, iters)):
    t0 = time.perf_counter()
    out = burst()
    samples.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
  return 1e3 * float(np.median(samples))


def time_layer(label: str, res: dict, s: Setting, fn, jf, mode: str, opts: dict | None,
               iters: int, extra: dict) -> None:
  """One layer variant timed one way (``--layer-timing``: call, x4 or pipelined), compiled
  with XLA's defaults or the option set ``opts``; the figure (or the error) into ``res``."""
  x0, b0 = s.inputs[0]
  try:
    if mode == "x4":  # REPS layers on rotating inputs in one executable, / REPS
      xf = jax.jit(lambda *a: [fn(s.params, x, b) for x, b in a])
      c = xf.lower(*s.inputs[:REPS]).compile(opts) if opts else xf
      timed(label, res, c, [list(s.inputs[:REPS])], iters, REPS, **extra)
      return
    c = jf.lower(s.params, x0, b0).compile(opts) if opts else jf
    if mode == "pipelined":  # PIPELINE_BURST calls on rotating inputs back to back, one block
      calls = [functools.partial(c, s.params, x, b) for x, b in s.inputs]
      burst = lambda: [calls[j % len(calls)]() for j in range(PIPELINE_BURST)]  # noqa: E731
      timed(label, res, burst, [()], iters, PIPELINE_BURST, **extra)
      if label in res and "error" not in res[label]:
        # the host's share: launching a burst, before its block (host-bound where it is
        # most of the pipelined figure)
        res[label]["enqueue_ms"] = enqueue_ms(burst, iters) / PIPELINE_BURST
        print(f"  {'':52s} {res[label]['enqueue_ms']:8.4f} ms of it launching", flush=True)
    else:
      timed(label, res, lambda x, b: c(s.params, x, b), s.inputs, iters, **extra)
  except Exception as e:  # noqa: BLE001 -- one failing variant must not lose the others
    res[label] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
    print(f"  {label:52s} FAILED {res[label]['error'][:300]}", flush=True)


def layer_one(s: Setting, args) -> dict:
  n, d, f, e, k = args.tokens, args.d, args.ffn, s.e, s.k
  x0, b0 = s.inputs[0]
  ref = jax.jit(lambda p, x, b: ragged_dot_ffn(x, s.logits(x, b), p["w1"], p["w2"], k))(
      s.params, x0, b0)
  loads = np.asarray(s.router(s.logits(x0, b0)).loads)
  res: dict = {}
  auto = s.routed("auto").grouped_kernel(s.params, jnp.bfloat16, n * k)
  variants = {f"grouped auto={auto} {name(route.Tiling.auto(n * k, e, auto))}":
              s.routed("auto")}
  for kn in ("mgpu", "hopper"):
    if auto != kn and kn in args.layer_kernels:
      variants[f"grouped {kn} {name(route.Tiling.auto(n * k, e, kn))}"] = s.routed(kn)
    for tt in filter(None, getattr(args, f"{kn}_layer").split(",")):
      if tt == "best":  # the sweep's fastest tiling of this kernel for this setting (this run)
        if (kn, s.name) not in SWEEP_BEST:
          continue
        tt = SWEEP_BEST[(kn, s.name)][0]
      variants[f"grouped {kn} {tt}"] = s.routed(kn, parse(tt))
  if auto != "pallas" and "pallas" in args.layer_kernels:
    variants[f"grouped pallas (Triton) {name(route.Tiling.auto(n * k, e))}"] = \
        s.routed("pallas")
  cap = math.ceil(1.25 * n * k / e)
  plan = route.make_plan((cap,) * e)
  fns = {label: (lambda p, x, b, m=m: m(p, x, s.logits(x, b))) for label, m in variants.items()}
  fns["capacity 1.25 (drops tokens)"] = lambda p, x, b: route.apply(
      s.experts, p, x, s.router(s.logits(x, b)), plan)
  if "ragged_dot" in args.layer_extra:
    fns["lax.ragged_dot (sort)"] = lambda p, x, b: ragged_dot_ffn(
        x, s.logits(x, b), p["w1"], p["w2"], k)
  if "dense" in args.layer_extra:
    fns["dense (every expert)"] = lambda p, x, b: dense_ffn(x, s.logits(x, b), p["w1"],
                                                            p["w2"], k)
  if "ffn" in args.layer_extra:  # the floor: the same FLOPs as one dense FFN (cuBLAS), no routing
    fns["one dense FFN, same FLOPs (no routing)"] = lambda p, x, b: jnp.dot(jax.nn.gelu(
        jnp.dot(jnp.concatenate([x] * k) if k > 1 else x, p["w1"][0]).astype(x.dtype)),
        p["w2"][0]).astype(x.dtype)
  for label, fn in fns.items():
    if elapsed() > args.budget:
      break
    if any(label.startswith(p) for p in filter(None, args.layer_skip.split(","))):
      continue
    jf = jax.jit(fn)
    extra = {}
    if label.startswith("capacity"):
      extra["dropped_fraction"] = float(np.maximum(loads - cap, 0).sum() / (n * k))
    try:
      t0 = time.perf_counter()
      y0 = jax.block_until_ready(jf(s.params, x0, b0))
      extra["first_call_s"] = time.perf_counter() - t0  # trace + compile + one run
      if not label.startswith("one dense"):  # another function: no error to report
        extra["rel_err_vs_ragged_dot"] = rel_err(y0, ref)
    except Exception:
      pass
    modes = args.layer_timing.split(",")
    for mode in modes:  # the first mode's figures under the plain label, the others' tagged
      for oname, opts in {"": None, **xla_options.parse(args.xla_options)}.items():
        tag = (f" <{mode}>" if mode != modes[0] else "") + (f" [{oname}]" if oname else "")
        time_layer(f"{label}{tag}", res, s, fn, jf, mode, opts, args.iters,
                   extra if not tag else {})
  flops = 4.0 * n * k * d * f
  nbytes = 2.0 * (int((loads > 0).sum()) * 2 * d * f + 2 * n * d)
  roof = max(flops / 800e12, nbytes / 3.3e12) * 1e3
  entry = {"setting": s.name, "k": k, "loads": loads.tolist(), "roofline_ms": roof,
           "auto_kernel": auto, "methods": res}
  if s.name in args.train.split(",") and elapsed() < args.budget:
    ct = jnp.ones((n, d), jnp.float32) / n
    train = {}
    for label in [lb for lb in fns if lb.startswith("grouped")]:
      g = jax.jit(jax.value_and_grad(
          lambda p, x, b, fn=fns[label]: jnp.sum(fn(p, x, b).astype(jnp.float32) * ct), (0, 1)))
      timed(f"train {label}", train, lambda x, b, g=g: g(s.params, x, b), s.inputs, args.iters)
    entry["train"] = train
  return entry


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--fake-mgpu", action="store_true", help="CPU smoke: lax.ragged_dot stand-ins")
  ap.add_argument("--parts", default="env,check,sweep,pieces,layer")
  ap.add_argument("--mgpu", default="128x64x128x4x4g1,128x64x128x4x6g1,128x64x128x4x4g4,"
                  "64x64x256x4x4g1,64x64x128x4x4g1,128x128x128x4x3g1",
                  help="mgpu tilings for the sweep: tm x tk x tn x warps x stages g grid_block_n")
  ap.add_argument("--hopper", default="128x64x128x4x4g8,128x64x64x4x4g8,128x64x128x4x5g8,"
                  "128x64x128x4x4g1,128x64x128x4x4g16",
                  help="hopper tilings for the sweep (an output tile is tm x 2 tn; g: the "
                  "snake's width in row tiles)")
  ap.add_argument("--triton", default="128x64x128x8x3,128x64x128x8x4,128x128x128x8x3,"
                  "64x64x128x4x4")
  ap.add_argument("--sweep-settings", default="uniform8,uniform64")
  ap.add_argument("--pieces", default="uniform8:1,uniform8:2")
  ap.add_argument("--kernels", default="mgpu,pallas")
  ap.add_argument("--settings", default="uniform8,zipf8,uniform64,zipf64")
  ap.add_argument("--k", default="1,2")
  ap.add_argument("--mgpu-layer", default="",
                  help="extra mgpu tilings in the layer part ('best': the sweep's fastest)")
  ap.add_argument("--hopper-layer", default="",
                  help="extra hopper tilings in the layer part ('best': the sweep's fastest)")
  ap.add_argument("--check-experts", type=int, default=8,
                  help="paths of the check part's layer (64: 64-row tiles, paired on an H200)")
  ap.add_argument("--check-kernels", default="mgpu,hopper",
                  help="kernels the check part compares with the references")
  ap.add_argument("--layer-extra", default="", help="ragged_dot,dense,ffn")
  ap.add_argument("--layer-skip", default="",
                  help="layer rows to leave out, by label prefix (e.g. 'capacity')")
  ap.add_argument("--layer-kernels", default="mgpu,hopper,pallas",
                  help="kernels timed beside the auto choice in the layer part")
  ap.add_argument("--layer-timing", default="call",
                  help="layer part, one or more of (comma-separated; the first one's figures "
                  "keep the plain labels): call (block_until_ready each; noisy: one "
                  "configuration timed twice in one H100 run gave 0.509 and 0.670 ms), x4 (4 "
                  "layers on rotating inputs in one executable, time / 4: one call's launch and "
                  "sync shared by four), pipelined (16 calls launched back to back, one block: "
                  "the device's time a layer when launches keep ahead)")
  ap.add_argument("--xla-options", default="",
                  help="also time every layer compiled with these named XLA option sets "
                  f"({', '.join(xla_options.OPTION_SETS)}; benchmarks/_xla_options.py)")
  ap.add_argument("--train", default="uniform8")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--rotate", type=int, default=3)
  ap.add_argument("--zipf", type=float, default=1.2)
  ap.add_argument("--budget", type=float, default=1e9)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.small:
    args.d, args.ffn, args.tokens = 128, 256, 512
    args.iters, args.rotate = 2, 2
    args.mgpu, args.triton, args.hopper = "32x32x64x4x2g2", "32x32x64x4x2", ""
  else:
    args.d, args.ffn, args.tokens = 1024, 4096, 8192
  bad = set(args.layer_timing.split(",")) - {"call", "x4", "pipelined"}
  if bad:
    ap.error(f"--layer-timing: {sorted(bad)} not among call, x4, pipelined")
  args.rotate = (max(args.rotate, REPS)
                 if "pieces" in args.parts or "x4" in args.layer_timing.split(",")
                 else args.rotate)
  if args.fake_mgpu:
    fake_mgpu()
  report = open_report(args, argv)
  for part in args.parts.split(","):
    if elapsed() > args.budget:
      print(f"skipped {part} (budget)", flush=True)
      continue
    print(f"\n==== {part}  [{elapsed():.0f} s]", flush=True)
    fn = {"env": run_env, "check": run_check, "sweep": run_sweep, "pieces": run_pieces,
          "layer": functools.partial(run_layer, out=report.setdefault("layer", {}),
                                     save=lambda: save(report, args))}[part]
    try:
      report[part] = fn(args)
    except Exception as e:
      report[part] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
      print(f"  {part} FAILED {report[part]['error'][:600]}", flush=True)
    save(report, args)
  return report


def open_report(args, argv) -> dict:
  """The report's head (jax, device, argv), printed; ``args.out`` created."""
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "argv": sys.argv[1:] if argv is None else argv}
  print(f"device {report['device']}, jax {report['jax']}", flush=True)
  return report


def save(report: dict, args) -> None:
  report["elapsed_s"] = elapsed()
  write_json(args.out, "bench_moe_kernels.json", report, default=str)


if __name__ == "__main__":
  main()
