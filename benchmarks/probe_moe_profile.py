"""Where the grouped MoE layer's time goes, kernel by kernel (jax.profiler, one executable).

    python benchmarks/probe_moe_profile.py --out DIR                 # H100 sizes
    python benchmarks/probe_moe_profile.py --small --out /tmp/p      # CPU smoke run

Parts: ``requests``, issue 19's e2e encoder one request at a time (``run_requests``);
``gemms``, the layer's two grouped GEMMs alone per hopper-kernel knob (``--knobs``:
approximate math in the fused activation on / off, ``_hopper.APPROX_BF16``) beside cuBLAS; ``layers``: for each ``--specs`` entry (``setting:k``, settings as in bench_moe_kernels.py) and each
variant (the grouped layer at kernel="auto", the capacity-1.25 dropping layer, one dense FFN of
the same FLOPs), four layers on rotating inputs in one executable are run ``--iters`` times
under ``jax.profiler.trace``; the device events are summed by kernel name and divided by
``iters * 4``, so each row is microseconds per layer.  The executables' optimized HLO goes to
``DIR/hlo_<variant>.txt`` so that a fusion's name can be read back to its ops.
Writes DIR/probe_moe_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import itertools
import json
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _xla_options as xla_options  # noqa: E402
from benchmarks._report import write_json  # noqa: E402
from benchmarks.bench_moe_kernels import REPS, Setting, open_report  # noqa: E402
from dynjax import route  # noqa: E402


def trace_events(log_dir: str) -> list[dict]:
  """The Chrome-format events of the newest trace under ``log_dir``."""
  files = sorted(glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True) +
                 glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise RuntimeError(f"no trace file under {log_dir}: "
                       f"{glob.glob(os.path.join(log_dir, '**'), recursive=True)[:20]}")
  with gzip.open(files[-1], "rt") as fh:
    data = json.load(fh)
  return data["traceEvents"] if isinstance(data, dict) else data


def device_kernels(events: list[dict]) -> tuple[dict, list[str], dict]:
  """Sum of durations (us) and count per event name on device processes, and the idle time
  on a device thread (stream) before each event, summed by the name of the event after it
  (gaps over 200 us, between iterations, left out)."""
  names = {}
  for ev in events:
    if ev.get("ph") == "M" and ev.get("name") == "process_name":
      names[ev.get("pid")] = str(ev.get("args", {}).get("name", ""))
  dev = {pid for pid, nm in names.items() if "GPU" in nm or "TPU" in nm or "/device:" in nm}
  if not dev:  # CPU: XLA's ops on the host threads
    dev = {pid for pid, nm in names.items() if "CPU" in nm or "host" in nm.lower()}
  agg: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  streams = collections.defaultdict(list)
  for ev in events:
    if ev.get("ph") == "X" and ev.get("pid") in dev:
      a = agg[str(ev.get("name"))]
      a[0] += float(ev.get("dur", 0.0))
      a[1] += 1
      streams[(ev.get("pid"), ev.get("tid"))].append(
          (float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0)), str(ev.get("name"))))
  gaps: dict[str, float] = collections.defaultdict(float)
  for evs in streams.values():
    evs.sort()
    for (t0, d0, _), (t1, _, nm) in zip(evs, evs[1:], strict=False):
      if 0 < t1 - (t0 + d0) < 200:
        gaps[nm] += t1 - (t0 + d0)
  return dict(agg), sorted(set(names.values())), dict(gaps)


def call_timeline(events: list[dict]) -> dict:
  """Per annotated call (median over calls): its span, the time from its start to the first
  device event and from the last device event to its end, and the host events (by name,
  summed, median call) that run before its first device event."""
  names = {ev.get("pid"): str(ev.get("args", {}).get("name", "")) for ev in events
           if ev.get("ph") == "M" and ev.get("name") == "process_name"}
  dev = {pid for pid, nm in names.items() if "GPU" in nm or "/device:" in nm}
  xs = [ev for ev in events if ev.get("ph") == "X"]
  marks = [ev for ev in xs if str(ev.get("name", "")).startswith("probe_call_")]
  devs = sorted((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))) for ev in xs
                if ev.get("pid") in dev)
  rows = []
  for m in marks:
    t0, t1 = float(m["ts"]), float(m["ts"]) + float(m.get("dur", 0))
    inside = [(a, b) for a, b in devs if t0 <= a <= t1]
    if not inside:
      continue
    first, last = inside[0][0], max(b for _, b in inside)
    host = collections.defaultdict(float)
    for ev in xs:
      if ev.get("pid") not in dev and ev is not m and t0 <= float(ev["ts"]) < first:
        host[str(ev.get("name"))] += float(ev.get("dur", 0))
    rows.append((t1 - t0, first - t0, t1 - last, host))
  if not rows:
    return {}
  rows.sort(key=lambda r: r[0])
  span, to_first, after, host = rows[len(rows) // 2]
  return {"call_us": span, "to_first_kernel_us": to_first, "after_last_kernel_us": after,
          "host_before_first_kernel": sorted(host.items(), key=lambda r: -r[1])[:12]}


def profile(label: str, fn, args_list, iters: int, out_dir: str | None, top: int = 25,
            per_call: int = REPS, compiler_options: dict | None = None) -> dict:
  """``per_call``: layers a call of ``fn`` runs (each row is per layer); 1: per call.
  ``compiler_options``: XLA options for the executable (``benchmarks/_xla_options.py``)."""
  compiled = jax.jit(fn).lower(*args_list).compile(compiler_options)
  jf = compiled  # the compiled stage: called as jax.jit's executable is
  jax.block_until_ready(jf(*args_list))  # warm
  if out_dir:
    with open(os.path.join(out_dir, f"hlo_{label.split()[0]}.txt"), "w") as fh:
      fh.write(compiled.as_text())
  walls = []
  for _ in range(max(30, iters)):
    t0 = time.perf_counter()
    jax.block_until_ready(jf(*args_list))
    walls.append(time.perf_counter() - t0)
  wall = float(np.median(walls)) / per_call * 1e6
  log_dir = tempfile.mkdtemp(prefix="moe_prof_")
  with jax.profiler.trace(log_dir):
    for i in range(iters):
      with jax.profiler.TraceAnnotation(f"probe_call_{i}"):
        jax.block_until_ready(jf(*args_list))
  events = trace_events(log_dir)
  agg, procs, gaps = device_kernels(events)
  calls = call_timeline(events)
  per = iters * per_call
  rows = sorted(((nm, dur / per, cnt / per) for nm, (dur, cnt) in agg.items()),
                key=lambda r: -r[1])
  total = sum(r[1] for r in rows)
  gap_rows = sorted(((nm, g / per) for nm, g in gaps.items()), key=lambda r: -r[1])
  print(f"\n  {label}: wall {wall:.1f} us a {'layer' if per_call > 1 else 'call'}, device "
        f"events {total:.1f} us, idle "
        f"between them {sum(g for _, g in gap_rows):.1f} us", flush=True)
  for nm, us, cnt in rows[:top]:
    print(f"    {us:8.2f} us  x{cnt:4.2f}  {nm[:110]}", flush=True)
  for nm, us in gap_rows[:6]:
    print(f"    idle {us:8.2f} us before {nm[:100]}", flush=True)
  print(f"    a call (median): {calls.get('call_us', 0):.1f} us; first kernel after "
        f"{calls.get('to_first_kernel_us', 0):.1f} us, host returns "
        f"{calls.get('after_last_kernel_us', 0):.1f} us after the last", flush=True)
  for nm, us in calls.get("host_before_first_kernel", [])[:5]:
    print(f"      host {us:8.2f} us  {nm[:100]}", flush=True)
  return {"wall_us": wall, "device_us": total, "idle_us": sum(g for _, g in gap_rows),
          "call": calls,
          "processes": procs, "idle_before": dict(gap_rows[:20]),
          "kernels": [{"name": nm, "us": us, "count": cnt} for nm, us, cnt in rows]}


def _defaults() -> tuple:
  from dynjax.route import _hopper  # noqa: PLC0415

  return (_hopper.APPROX_BF16, _hopper.WG_SPLIT, _hopper.WGMMA_IN_FLIGHT, _hopper.CHAIN_TILES,
          _hopper.CHAIN_MIN_ROWS, _hopper.PAIR_TILES, _hopper.PAIR_SKIP_MMA)


_DEFAULTS = _defaults()  # the kernel's knobs as shipped: set_knob starts from them


def set_knob(knob: str) -> tuple[str, route.Tiling | None]:
  """Sets the hopper kernel's module knobs from ``knob``, ``+``-joined tokens: ``0``/``1``
  the fused bfloat16 activation with exact or approximate transcendentals
  (``_hopper.APPROX_BF16``), ``n``/``m`` the compute warpgroups splitting a tile's columns or
  rows (``_hopper.WG_SPLIT``), ``w0``/``w1`` wgmma groups left in flight across k-steps
  (``_hopper.WGMMA_IN_FLIGHT``), ``c0``/``c1``/``c64`` a program's tiles unchained, chained
  where they have ``_hopper.CHAIN_MIN_ROWS`` rows, or chained from 64 rows
  (``_hopper.CHAIN_TILES``; chained runs with ``w0``), ``tTMxTKxTNxWxS`` a tiling instead of
  ``Tiling.auto``.
  Returns the knob's tag and tiling.  (Session 12 also tried 2-CTA clusters multicasting the
  token tile, session 13 a 64 x 128 epilogue tile and GEMM 2 without its halved column tile
  (commit e2ba4ff): none faster, README "Routed layers"; those knobs are gone.)"""
  from benchmarks.bench_moe_gmm import parse_tiling  # noqa: PLC0415
  from dynjax.route import _hopper  # noqa: PLC0415

  (_hopper.APPROX_BF16, _hopper.WG_SPLIT, _hopper.WGMMA_IN_FLIGHT, _hopper.CHAIN_TILES,
   _hopper.CHAIN_MIN_ROWS, _hopper.PAIR_TILES, _hopper.PAIR_SKIP_MMA) = _DEFAULTS
  tiling = None
  for tok in knob.split("+"):
    if tok in ("0", "1"):
      _hopper.APPROX_BF16 = bool(int(tok))
    elif tok in ("n", "m"):
      _hopper.WG_SPLIT = tok
    elif tok in ("w0", "w1"):
      _hopper.WGMMA_IN_FLIGHT = int(tok[1])
    elif tok in ("c0", "c1", "c64"):
      _hopper.CHAIN_TILES = tok != "c0"
      if tok == "c64":  # 64-row tiles chained too
        _hopper.CHAIN_MIN_ROWS = 64
    elif tok in ("p0", "p1", "p2"):
      _hopper.PAIR_TILES, _hopper.PAIR_SKIP_MMA = tok != "p0", tok == "p2"
    elif tok.startswith("t"):
      tiling = parse_tiling(tok[1:])
    else:
      raise SystemExit(f"--knobs: unknown token {tok!r} in {knob!r} (0/1, n/m, w0/w1, "
                       "c0/c1/c64, p0/p1/p2, tTMxTKxTNxWxS)")
  return f"approx{int(_hopper.APPROX_BF16)}" if knob in ("0", "1") else knob, tiling


def grouped_gemm_inputs(s: Setting, n: int, t: route.Tiling):
  """The grouped layer's first GEMM operands for setting ``s`` at ``n`` tokens (k=1) and tiling
  ``t``: ``(buffer rows, rows a routing can fill, rows the kernel's waves are chosen for, each
  rotated input's layout, its tokens gathered into that layout)``, as the layer builds them."""
  from dynjax.route import _gmm  # noqa: PLC0415

  e = s.e
  rows = _gmm.buffer_rows(n, e, t, "hopper")
  fill = _gmm.num_tiles(n, e, t.tm) * t.tm
  waves = max(fill, _gmm.hopper_floor_rows(e, t.tm))
  lays = [route.grouped_layout(s.router(s.logits(x, b)), e, t.tm, rows) for x, b in s.inputs]
  xs = [jnp.take(x, lay.table, axis=0, mode="fill", fill_value=0)
        for (x, _), lay in zip(s.inputs, lays, strict=True)]
  return rows, fill, waves, lays, xs


def run_gemms(args) -> dict:
  """The layer's two grouped GEMMs alone (each of ``--gemm-settings``, k=1, the layer's buffer
  and bounds) per knob, beside cuBLAS on the dense shapes of the same FLOPs; errors vs float32."""
  from dynjax.route import _gmm, _hopper  # noqa: PLC0415

  out: dict = {}
  for setting in args.gemm_settings.split(","):
    s = Setting(setting, 1, args)
    n, e = args.tokens, s.e
    w1, w2 = s.params["w1"], s.params["w2"]
    res: dict = {}
    out[setting] = res
    print(f"\n== gemms {setting}", flush=True)
    timed = set()  # (tiling, split, wait) whose GEMMs without activation were timed
    for knob in args.knobs.split(","):
      tag, t = set_knob(knob)
      t = t or route.Tiling.auto(n, e, "hopper")
      rows, fill, waves, lays, xs = grouped_gemm_inputs(s, n, t)
      key = jax.random.PRNGKey(7)
      hs = [jax.random.normal(jax.random.fold_in(key, j), (rows, args.ffn)).astype(jnp.bfloat16)
            for j in range(REPS)]
      sizes = [lay.group_sizes for lay in lays]
      res.setdefault("rows", {})[tag] = rows
      res.setdefault("tiling", {})[tag] = str(t)

      def ref(a, w, sz, act, t=t):  # float32 ragged dot on the tile-aligned sizes
        tiles = ((sz + t.tm - 1) // t.tm) * t.tm
        y = jax.lax.ragged_dot(a.astype(jnp.float32), w.astype(jnp.float32),
                               tiles.at[-1].add(a.shape[0] - tiles.sum()))
        return act(y) if act else y

      cases = [("gemm1+gelu", xs, w1, jax.nn.gelu), ("gemm1", xs, w1, None),
               ("gemm2", hs, w2, None)]
      plain = (str(t), _hopper.WG_SPLIT, _hopper.WGMMA_IN_FLIGHT, _hopper.CHAIN_TILES,
               _hopper.PAIR_TILES, _hopper.PAIR_SKIP_MMA)
      for label, lhs, w, act in cases:
        if act is None and plain in timed:
          continue  # approximate math changes only the activation: timed at another knob

        def f(w, *a, w_=w, act=act, t=t, fill=fill, waves=waves):
          return [_gmm.hopper_grouped(x, w_, sz, t, act, skip_unused=fill, wave_rows=waves)
                  for x, sz in a]

        try:
          r = profile(f"{label} {tag}", f, [w] + list(zip(lhs, sizes, strict=True)),
                      args.iters, None, top=3)
          y = jax.jit(lambda x, sz, w=w, act=act, t=t, fill=fill, waves=waves:
                      _gmm.hopper_grouped(x, w, sz, t, act, skip_unused=fill,
                                          wave_rows=waves))(lhs[0], sizes[0])
          want = ref(lhs[0], w, sizes[0], act)
          used = jnp.sum(((sizes[0] + t.tm - 1) // t.tm) * t.tm)  # rows past are unwritten
          live = jnp.arange(rows)[:, None] < used
          y32 = jnp.where(live, y.astype(jnp.float32), 0)
          r["rel_err"] = float(jnp.linalg.norm(y32 - jnp.where(live, want, 0)) /
                               jnp.linalg.norm(jnp.where(live, want, 0)))
          print(f"    rel err vs f32 {r['rel_err']:.2e}", flush=True)
        except Exception as ex:
          r = {"error": f"{type(ex).__name__}: {str(ex)[:800]}"}
          print(f"  {label} {tag} FAILED {r['error'][:400]}", flush=True)
        res[f"{label} {tag}"] = r
      timed.add(plain)
    set_knob("1")
    if args.cublas:
      xs = [x for x, _ in s.inputs]
      hs = [jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(7), j),
                              (n, args.ffn)).astype(jnp.bfloat16) for j in range(REPS)]
      res["cublas gemm1 [N,d]x[d,f] (+ XLA gelu)"] = profile(
          "cublas gemm1+gelu", lambda w, *a: [jax.nn.gelu(jnp.dot(x, w)) for x in a],
          [w1[0]] + xs, args.iters, None, top=4)
      res["cublas gemm2 [N,f]x[f,d]"] = profile(
          "cublas gemm2", lambda w, *a: [jnp.dot(h, w) for h in a], [w2[0]] + hs, args.iters,
          None, top=3)
  return out


def run_layers(args) -> dict:
  out = {}
  for spec in args.specs.split(","):
    setting, _, k = spec.partition(":")
    s = Setting(setting, int(k or 1), args)
    n, e, k = args.tokens, s.e, s.k
    cap = math.ceil(1.25 * n * k / e)
    plan = route.make_plan((cap,) * e)
    fns = {
        "capacity": lambda p, x, b, s=s, plan=plan: route.apply(
            s.experts, p, x, s.router(s.logits(x, b)), plan),
        "ffn": lambda p, x, b, k=k: jnp.dot(jax.nn.gelu(jnp.dot(
            jnp.concatenate([x] * k) if k > 1 else x, p["w1"][0]).astype(x.dtype)),
            p["w2"][0]).astype(x.dtype)}
    res = {"auto_kernel": s.routed("auto").grouped_kernel(s.params, jnp.bfloat16, n * k)}
    print(f"\n== {spec} (auto kernel {res['auto_kernel']})", flush=True)
    variants = [v for v in args.variants.split(",") if v != "grouped"]
    if "grouped" in args.variants.split(","):
      variants = [f"grouped {kn}" for kn in args.knobs.split(",")] + variants
    for v in variants:
      if v.startswith("grouped"):
        tag, tiling = set_knob(v.split()[1])
        moe = s.routed("auto", tiling)
        f = lambda p, x, b, moe=moe, s=s: moe(p, x, s.logits(x, b))  # noqa: E731
        v = f"grouped {tag}"
      else:
        f = fns[v]
      try:
        res[v] = profile(f"{v} {spec}", lambda p, *a, f=f: [f(p, x, b) for x, b in a],
                         [s.params] + list(s.inputs[:REPS]), args.iters,
                         args.out if spec == args.specs.split(",")[0] else None,
                         top=args.top)
      except Exception as ex:  # one failing variant must not lose the others
        res[v] = {"error": f"{type(ex).__name__}: {str(ex)[:800]}"}
        print(f"  {v} FAILED {res[v]['error'][:400]}", flush=True)
    set_knob("1")
    out[spec] = res
  return out


REQUEST_MODELS = ("none", "grouped", "dense", "ragged_dot")


def run_requests(args) -> dict:
  """Issue 19's e2e MoE encoder (``bench_moe_gmm.build_flax_model``: 8 experts, k=2, batch 8)
  as one request runs it: ``jax.jit`` of the model's apply at each ``--request-lengths`` t, one
  call at a time (a block after each), bf16 weights on the device, for the models ``none`` (the
  block without experts), ``grouped`` (kernel auto) and ``dense``: device time by kernel, and
  the host's time before the first kernel and after the last; the optimized HLO of each goes
  to ``DIR/hlo_<model>_t<t>.txt``."""
  from benchmarks import bench_moe_gmm as bm  # noqa: PLC0415

  models = [(name, *bm.layer_option(name, "--request-models"))
            for name in args.request_models.split(",")]
  # each model also compiled with these XLA option sets (no CUDA graphs, ...), one after another
  option_sets = {"": None} | xla_options.parse(args.request_xla_options)
  bad = [name for name, base, apart in models
         if base not in REQUEST_MODELS or (apart is not None and base != "grouped")]
  if bad:
    raise SystemExit(f"--request-models: unknown {', '.join(map(repr, bad))} (known: "
                     f"{', '.join(REQUEST_MODELS)}; grouped+" + ", grouped+".join(bm.LAYER_OPTIONS) + ")")
  cfg = dict(vocab=512 if args.small else 30522, d=args.d, heads=4 if args.small else 16,
             ffn=args.ffn, experts=8, k=2, max_len=128 if args.small else 512, batch=8)
  routed = route.Routed(route.Experts(route.ffn()),
                        route.Router(cfg["experts"], k=cfg["k"], renormalize=True),
                        mode="grouped", kernel="auto" if jax.default_backend() == "gpu" else "xla")
  out: dict = {}
  for t in [int(x) for x in args.request_lengths.split(",")]:
    rng = np.random.RandomState(args.seed)
    tok = jnp.asarray(rng.randint(1, cfg["vocab"], (cfg["batch"], t)), jnp.int32)
    lens = jnp.asarray(rng.randint(t // 2 + 1, t + 1, cfg["batch"]), jnp.int32)
    variables = jax.jit(bm.build_flax_model(cfg, "dense", None).init)(
        jax.random.PRNGKey(0), tok, lens)
    v16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 else x, variables)
    res = out.setdefault(str(t), {})
    print(f"\n== request t={t} (batch {cfg['batch']})", flush=True)
    for (name, base, apart), (oname, opts) in itertools.product(models, option_sets.items()):
      model = bm.build_flax_model(cfg, base, routed if base == "grouped" else None)
      key = f"{name}[{oname}]" if oname else name
      try:
        with bm.layer_options(apart):  # profile() traces the model
          res[key] = profile(f"{name}{'_' + oname if oname else ''}_t{t} ", model.apply,
                             [v16, tok, lens], args.iters, args.out, top=args.top, per_call=1,
                             compiler_options=opts)
      except Exception as ex:  # one failing model must not lose the others
        res[key] = {"error": f"{type(ex).__name__}: {str(ex)[:800]}"}
        print(f"  {key} FAILED {res[key]['error'][:400]}", flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--parts", default="gemms,layers")
  ap.add_argument("--specs", default="uniform8:1,zipf8:1,uniform64:1,uniform8:2")
  ap.add_argument("--variants", default="grouped,capacity,ffn")
  ap.add_argument("--knobs", default="1", help="hopper kernel knobs, comma-separated (each "
                  "timed): '+'-joined tokens 1/0 (approximate math on/off), n/m (warpgroups "
                  "split columns/rows), w0/w1 (wgmma in flight), tTMxTKxTNxWxS (tiling)")
  ap.add_argument("--gemm-settings", default="uniform8", help="the gemms part's routings")
  ap.add_argument("--no-cublas", dest="cublas", action="store_false",
                  help="gemms: skip cuBLAS on the dense shapes")
  ap.add_argument("--tokens", type=int, default=0,
                  help="tokens a layer (default 8,192; --small 512); e.g. 1,024 = a request of "
                  "batch 8 at length 128, as issue 19's e2e serves them")
  ap.add_argument("--request-lengths", default="128,256",
                  help="requests part: the lengths t of the e2e's requests (batch 8)")
  ap.add_argument("--request-models", default="none,grouped,dense",
                  help="requests part: none, grouped, dense, ragged_dot; grouped+OPTION: "
                  "the grouped layer with one of bench_moe_gmm.LAYER_OPTIONS (+apart / "
                  "+fused: the combine on its own or fused into its consumer; +sort: positions "
                  "by a sort; without: the library's defaults)")
  ap.add_argument("--request-xla-options", default="",
                  help="requests part: each model also compiled with these XLA option sets "
                  f"({', '.join(xla_options.OPTION_SETS)})")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--top", type=int, default=12)
  ap.add_argument("--zipf", type=float, default=1.2)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  args.d, args.ffn, tokens = (128, 256, 512) if args.small else (1024, 4096, 8192)
  args.tokens = args.tokens or tokens
  args.rotate = REPS
  report = open_report(args, argv)
  for part in args.parts.split(","):
    report[part] = {"gemms": run_gemms, "layers": run_layers,
                    "requests": run_requests}[part](args)
    write_json(args.out, "probe_moe_profile.json", report, default=str)
  return report


if __name__ == "__main__":
  main()
