"""Child-sum Tree-LSTM over real trees (ASTs of standard-library functions).

The model (Tai et al. 2015, child-sum) for node j with input x_j and children k:
``h~ = sum_k h_k``; ``i, o, u = sigma/sigma/tanh(W x + U h~ + b)``;
``f_k = sigma(W_f x + U_f h_k + b_f)``; ``c = i*u + sum_k f_k*c_k``; ``h = o*tanh(c)``.

Two ways to write it, two benchmarks (``run(flags)`` runs both; ``models=`` picks):

* ``childsum`` (the first one): four small cells over child lists, so the variable number
  of children becomes batched work: ``forget`` per child (``f_k*c_k``), ``add`` in a balanced
  pairwise tree, ``node`` for the gates (leaves call ``node`` with zero sums via ``leaf``).
  Modes: ``dynjax`` (``encode.batch``), ``jax_per_node`` (the same cells jitted, node by node),
  ``torch_per_node`` (PyTorch eager, same weights; when ``torch`` imports).
* ``arity`` (the VM host-speed issue): the binarized (first-child / next-sibling) tree, where
  a node has 0, 1 or 2 children, written as three cells by arity (``leaf``, ``one``, ``two``)
  with the parameters an ordinary argument ``enc(params, tree)``, in every argument form of
  ``FORMS`` (numpy dict, jax dict, nested pytree, closed over, a per-node input row), through
  both front ends (``dynjax.recursive`` and the vectorised ``dynjax.control.fold``), against
  the same cells jitted and called node by node, and PyTorch per node.  See :func:`run_arity`.

The model (cells, encoders, references, PyTorch twins) is :mod:`examples.treelstm_model`; this
module is the runner (timing, compile counts, table, JSON).

  python -m benchmarks treelstm --quick                   # CPU, both models (~1.5 min)
  python -m benchmarks.treelstm --full models=arity --out $OUT   # the GPU run
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Sequence

import jax
import numpy as np

from benchmarks._report import write_json
from examples.treelstm_model import (
  FORM_NOTES,
  FORMS,
  ArityForm,
  arity_reference,
  encode,
  encode_per_node,
  init_arity_params,
  init_params,
  reference,
  torch_arity_params,
  torch_arity_per_node,
  torch_per_node,
)


class _CompileCount:
  def __init__(self):
    self.n = 0
    jax.monitoring.register_event_duration_secs_listener(self)

  def __call__(self, event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      self.n += 1


_COMPILES: _CompileCount | None = None


def compile_counter() -> _CompileCount:
  """A process-wide counter of XLA backend compiles (``jax.monitoring``)."""
  global _COMPILES
  if _COMPILES is None:
    _COMPILES = _CompileCount()
  return _COMPILES


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return out, time.perf_counter() - t0


def _time_frontend(run_batch, stats_of, warmup, warm_items, timed_items, counter) -> dict:
  """Warm-up, then per forest a first and a second call (compiles counted on the first)."""
  c0 = counter.n
  w = warmup(warm_items)
  warm = {"warmup_compiles": counter.n - c0, "warmup_s": w["seconds"]}
  first, second, comp, host_us = [], [], [], []
  for items in timed_items:
    c0 = counter.n
    _, t1 = _timed(lambda items=items: run_batch(items))
    comp.append(counter.n - c0)
    _, t2 = _timed(lambda items=items: run_batch(items))
    first.append(t1)
    second.append(t2)
    meta = stats_of()
    host_s = meta["record_s"] if "record_s" in meta else meta["linearize_s"]
    host_us.append(1e6 * host_s / meta["nodes"])
  return {**warm, "first": first, "second": second, "compiles": comp, "host_us": host_us,
          "meta": meta}


def run_arity(flags: dict | None = None) -> dict:
  """The issue's table: every argument form, dynjax vs per-node jitted recursion.

  Per form and front end (``recursive``: the decorator form; ``fold``: the vectorised one):
  ``warmup()`` on its own forest, then ``forests`` new forests of ``batch`` trees, each run
  twice (first call: whatever compiles a new forest needs, counted with ``jax.monitoring``;
  second call: steady state).  The per-node twin (same cells, ``jax.jit``, node by node)
  runs on the first ``per_node_forests`` of them; ratios use the same forests.
  ``record_us_per_node`` is the host time that discovers the schedule: the recording of the
  user's recursion (recursive) or the numpy linearisation (fold).
  """
  import sys

  from examples import data

  flags = dict(flags or {})
  quick = bool(flags.get("quick", jax.default_backend() == "cpu"))
  batch = int(flags.get("batch", 64))
  n_forests = int(flags.get("forests", 20))
  pn_forests = int(flags.get("per_node_forests", 3))
  max_nodes = int(flags.get("max_nodes", 150 if quick else 200))
  d_h = int(flags.get("d_h", 16 if quick else 256))
  seed = int(flags.get("seed", 0))
  forms = flags.get("forms", FORMS)
  forms = forms.split(",") if isinstance(forms, str) else list(forms)
  frontends = flags.get("frontends", "recursive,fold")
  frontends = frontends.split(",") if isinstance(frontends, str) else list(frontends)
  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
  counter = compile_counter()
  p_np = init_arity_params(len(data.node_types()), d_h=d_h, seed=seed)
  trees = data.sample_trees(batch * (n_forests + 1), seed=seed + 1, max_nodes=max_nodes)
  forests = [trees[i * batch:(i + 1) * batch] for i in range(n_forests + 1)]
  warm, timed = forests[0], forests[1:]
  nodes = [sum(t.size for t in f) for f in timed]
  rows = []
  for form in forms:
    f = ArityForm(form, p_np)
    warm_items = f.items(warm)
    timed_items = [f.items(forest) for forest in timed]
    _timed(lambda f=f, w=warm_items: [f.per_node(*it) for it in w[:4]])  # jit compiles
    runs = {}
    for fe in frontends:
      if fe == "recursive":
        enc = f.enc
        runs[fe] = (enc.batch, lambda enc=enc: enc.last_stats.batches[0], enc.warmup)
      else:
        fo, fa = f.fold, f.fold_args
        runs[fe] = (lambda items, fo=fo, fa=fa: fo.batch(*fa(items)),
                    lambda fo=fo: fo.last_stats.batches[0],
                    lambda items, fo=fo, fa=fa: fo.warmup(*fa(items)))
    res_fe = {fe: _time_frontend(*runs[fe], warm_items, timed_items, counter)
              for fe in frontends}
    # Per node vs dynjax, interleaved forest by forest (the 2-core box is shared: a ratio
    # of runs minutes apart would measure the neighbours), median of per-forest ratios.  Each
    # side runs twice and its second run counts, so neither pays for the other's garbage.
    pn, ratio, err = [], defaultdict(list), defaultdict(float)
    for k in range(min(pn_forests, n_forests)):
      for _ in range(2):
        out, t = _timed(lambda f=f, its=timed_items[k]: [f.per_node(*it) for it in its])
      pn.append(t)
      for fe in frontends:
        for _ in range(2):
          dyn_out, td = _timed(lambda its=timed_items[k], run=runs[fe][0]: run(its))
        ratio[fe].append(t / td)
        err[fe] = max([err[fe]] + [float(np.max(np.abs(np.asarray(a[0]) - np.asarray(b[0]))))
                                   for a, b in zip(dyn_out, out, strict=True)])
    k = len(pn)
    pn_s = float(np.median(pn))
    for fe in frontends:
      r = res_fe[fe]
      meta = r["meta"]
      host = float(np.median(r["host_us"]))
      cost = (f"{'recording' if fe == 'recursive' else 'numpy schedule'} {host:.2f} us/node; "
              f"{meta['groups']} executable calls/batch ({meta['levels']} levels); "
              f"{meta['uploads']} numpy leaves uploaded/batch")
      rows.append({
          "form": form, "frontend": fe, "note": FORM_NOTES[form], "cost": cost,
          "invokes_per_batch": meta["groups"], "uploads_per_batch": meta["uploads"],
          "dynjax_ms": round(1e3 * float(np.median(r["second"])), 2),
          "dynjax_first_ms": round(1e3 * float(np.median(r["first"])), 2),
          "first_call_after_warmup_ms": round(1e3 * r["first"][0], 2),
          "dynjax_us_per_node": round(1e6 * float(np.median(
              [t / n for t, n in zip(r["second"], nodes, strict=True)])), 2),
          "per_node_ms": round(1e3 * pn_s, 2),
          "per_node_us_per_node": round(1e6 * pn_s / float(np.mean(nodes[:k])), 2),
          "x_faster_than_per_node": round(float(np.median(ratio[fe])), 2),
          "record_us_per_node": round(host, 2),
          "warmup_compiles": r["warmup_compiles"], "warmup_s": r["warmup_s"],
          "compiles_per_batch": r["compiles"],
          "max_abs_diff_vs_per_node": err[fe],
          "first_ms_all": [round(1e3 * t, 3) for t in r["first"]],
          "second_ms_all": [round(1e3 * t, 3) for t in r["second"]],
          "per_node_ms_all": [round(1e3 * t, 3) for t in pn],
          "ratio_all": [round(x, 3) for x in ratio[fe]],
      })
  base = next((r for r in rows if r["form"] == "jnp_dict"), None)
  if base is not None:
    for r in rows:  # against the fastest natural per-node baseline (jnp params)
      r["x_faster_than_per_node_jnp"] = round(base["per_node_ms"] / r["dynjax_ms"], 2)
  res = {"model": "child-sum Tree-LSTM, 3 cells by arity (leaf/one/two), binarized ASTs",
         "config": {"batch": batch, "forests": n_forests, "per_node_forests": pn_forests,
                    "max_nodes": max_nodes, "d_h": d_h, "mean_nodes": float(np.mean(nodes)),
                    "forms": forms, "frontends": frontends},
         "rows": rows}
  if flags.get("no_warmup_check", True):
    res["no_warmup"] = _no_warmup_compiles(p_np, warm, timed, counter)
  f = ArityForm("jnp_dict", p_np)
  check = timed[0][:int(flags.get("check_trees", 8))]
  with jax.default_matmul_precision("highest"):
    out = f.enc.batch(f.items(check))
    out_f = f.fold.batch(check, f.params)
  errs = {}
  for name, o in (("recursive", out), ("fold", out_f)):
    errs[name] = max(
        float(np.max(np.abs(np.asarray(h, np.float64) - arity_reference(p_np, t)[0])))
        for (h, _), t in zip(o, check, strict=True))
  res["check"] = {"trees": len(check), "max_abs_err_vs_float64": errs,
                  "tolerance": CHECK_ATOL, "ok": max(errs.values()) <= CHECK_ATOL}
  if flags.get("torch", True):
    res["torch"] = _torch_arity(p_np, warm, timed[:max(1, pn_forests)], nodes)
  return res


def _no_warmup_compiles(p_np, warm, timed, counter) -> dict:
  """Compiles per batch when a user skips ``warmup()`` (fresh cells; jnp params)."""
  f = ArityForm("jnp_dict", p_np, fresh=True)
  c0 = counter.n
  _timed(lambda: f.enc.batch(f.items(warm)))
  first = counter.n - c0
  comp = []
  for forest in timed:
    c0 = counter.n
    _timed(lambda forest=forest: f.enc.batch(f.items(forest)))
    comp.append(counter.n - c0)
  return {"frontend": "recursive", "form": "jnp_dict", "first_batch_compiles": first,
          "compiles_per_batch": comp}


def _torch_arity(p_np, warm, forests, nodes) -> dict:
  try:
    import torch
  except ImportError:
    return {"skipped": "torch not importable"}
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  P = torch_arity_params(p_np, dev)
  torch_arity_per_node(P, warm[0])
  ts = []
  for forest in forests:
    t0 = time.perf_counter()
    [torch_arity_per_node(P, t) for t in forest]
    if dev == "cuda":
      torch.cuda.synchronize()
    ts.append(time.perf_counter() - t0)
  t = float(np.median(ts))
  return {"device": dev, "torch": torch.__version__, "per_node_ms": round(1e3 * t, 2),
          "per_node_us_per_node": round(1e6 * t / float(np.mean(nodes[:len(ts)])), 2)}


# -- the benchmark ----------------------------------------------------------------------------
CHECK_ATOL = 1e-4  # float32 vs float64 over trees up to ~40 levels deep (CPU: ~1e-6)


def _precision_check(p, trees, use_torch: bool) -> dict:
  """Every mode at full float32 precision vs the float64 numpy oracle, on a few trees.

  On GPUs, JAX's default float32 matmul precision uses TF32 (10-bit mantissa), and it does so
  for the batched GEMMs of dynjax but not always for the per-node matrix-vector products, so
  the timed runs can differ by ~1e-2 after tens of levels.  This check runs under
  ``jax.default_matmul_precision("highest")`` (and torch with TF32 off) so a real error is not
  hidden by, nor confused with, TF32 rounding.  It also reports the default-precision error.
  """
  refs = [reference(p, t)[0] for t in trees]

  def err(hs):
    return max(float(np.max(np.abs(np.asarray(h, np.float64) - r)))
               for h, r in zip(hs, refs, strict=True))

  out: dict = {}
  out["dynjax_default_precision"] = err(
      [r[0] for r in encode.batch([(p, t) for t in trees])])
  with jax.default_matmul_precision("highest"):
    out["dynjax"] = err([r[0] for r in encode.batch([(p, t) for t in trees])])
    out["jax_per_node"] = err([encode_per_node(p, t)[0] for t in trees])
  if use_torch:
    try:
      import torch
    except ImportError:
      pass
    else:
      dev = "cuda" if torch.cuda.is_available() else "cpu"
      saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
      torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
      try:
        out["torch_per_node"] = err([torch_per_node(p, t, dev)[0].cpu().numpy()
                                     for t in trees])
      finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
  checked = {k: v for k, v in out.items() if k != "dynjax_default_precision"}
  return {"trees": len(trees), "tolerance": f"atol {CHECK_ATOL:g} at highest precision",
          "max_abs_err": out, "ok": all(v <= CHECK_ATOL for v in checked.values())}


def run(flags: dict | None = None, out_dir: str | None = None) -> dict:
  """Tree-LSTM over minibatches of real trees; returns (and writes ``treelstm.json``) a dict.

  Two models: ``childsum`` (four cells over child lists: ``rows``, ``check``) and ``arity``
  (the issue's three cells by arity over binarized trees, every argument form, both front
  ends: ``arity``; see :func:`run_arity`).  Flags (all optional): ``models``
  ("childsum,arity"), ``quick`` (CPU setting), ``batch``, ``batches``, ``max_nodes``, ``d_h``,
  ``seed``, ``torch`` (default True), and :func:`run_arity`'s ``forests``, ``forms``,
  ``frontends``, ``per_node_forests``, ``no_warmup_check``.

  Example:
    >>> res = run({"quick": True})  # doctest: +SKIP
    >>> res["rows"][0]["mode"]  # doctest: +SKIP
    'dynjax'
  """
  flags = dict(flags or {})
  models = flags.get("models", "childsum,arity")
  models = models.split(",") if isinstance(models, str) else list(models)
  res = {"workload": "treelstm", "backend": jax.default_backend(), "jax": jax.__version__,
         "versions": _versions()}
  if "childsum" in models:
    res.update(_run_childsum(flags))
  if "arity" in models:
    res["arity"] = run_arity(flags)
  write_json(out_dir, "treelstm.json", res)
  return res


def _versions() -> dict:
  from benchmarks._suite import versions

  return versions()


def _run_childsum(flags: dict) -> dict:
  """The four-cell child-sum model over child lists (forget/add/node; the first benchmark)."""
  from examples import data

  quick = bool(flags.get("quick", jax.default_backend() == "cpu"))
  batch = int(flags.get("batch", 16 if quick else 64))
  n_batches = int(flags.get("batches", 2 if quick else 5))
  max_nodes = int(flags.get("max_nodes", 80 if quick else 400))
  d_h = int(flags.get("d_h", 32 if quick else 256))
  seed = int(flags.get("seed", 0))
  n_types = len(data.node_types())
  p = init_params(n_types, d_in=d_h // 2, d_h=d_h, seed=seed)
  trees = data.sample_trees(batch * (n_batches + 1), seed=seed, max_nodes=max_nodes)
  warm, timed = trees[:batch], trees[batch:]
  minibatches = [timed[i * batch:(i + 1) * batch] for i in range(n_batches)]
  n_nodes = sum(t.size for t in timed)
  rows = []

  # dynjax: warm-up batch compiles the buckets; then timed minibatches.
  # Cold = first pass over every minibatch (compiles of batch buckets / arena capacities).
  t0 = time.perf_counter()
  jax.block_until_ready(encode.batch([(p, t) for t in warm]))
  for mb in minibatches:
    jax.block_until_ready(encode.batch([(p, t) for t in mb]))
  cold = time.perf_counter() - t0
  t0 = time.perf_counter()
  outs = []
  meta = []
  for mb in minibatches:
    res = encode.batch([(p, t) for t in mb])
    outs.extend(r[0] for r in res)
    meta.extend(encode.last_stats.batches)
  jax.block_until_ready(outs)
  dt = time.perf_counter() - t0
  dyn_h = [np.asarray(h) for h in outs]
  rows.append({"mode": "dynjax", "seconds": round(dt, 4), "us_per_node": round(1e6 * dt / n_nodes, 2),
               "cold_warmup_s": round(cold, 3),
               "invokes_per_batch": float(np.mean([m["groups"] for m in meta])),
               "levels_per_batch": float(np.mean([m["levels"] for m in meta])),
               "record_ms_per_batch": round(1e3 * float(np.mean([m["record_s"] for m in meta])), 2),
               "flush_ms_per_batch": round(1e3 * float(np.mean([m["flush_s"] for m in meta])), 2)})

  # JAX per node (jitted cells), warm-up then timed.
  jax.block_until_ready([encode_per_node(p, t) for t in warm[:4]])
  t0 = time.perf_counter()
  outs = [encode_per_node(p, t)[0] for t in timed]
  jax.block_until_ready(outs)
  dt = time.perf_counter() - t0
  err = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(outs, dyn_h, strict=True))
  rows.append({"mode": "jax_per_node", "seconds": round(dt, 4),
               "us_per_node": round(1e6 * dt / n_nodes, 2), "max_abs_diff_vs_dynjax": err})

  if flags.get("torch", True):
    try:
      import torch  # noqa: F401
    except ImportError:
      rows.append({"mode": "torch_per_node", "skipped": "torch not importable"})
    else:
      dev = "cuda" if torch.cuda.is_available() else "cpu"
      torch_per_node(p, warm[0], dev)
      t0 = time.perf_counter()
      outs = [torch_per_node(p, t, dev)[0] for t in timed]
      if dev == "cuda":
        torch.cuda.synchronize()
      dt = time.perf_counter() - t0
      err = max(float(np.max(np.abs(a.cpu().numpy() - b))) for a, b in zip(outs, dyn_h,
                                                                           strict=True))
      rows.append({"mode": "torch_per_node", "seconds": round(dt, 4),
                   "us_per_node": round(1e6 * dt / n_nodes, 2), "max_abs_diff_vs_dynjax": err})
  res_check = _precision_check(p, minibatches[0][:int(flags.get("check_trees", 8))],
                               bool(flags.get("torch", True)))
  base = rows[0]["seconds"]
  for r in rows:
    if "seconds" in r:
      r["x_slower_than_dynjax"] = round(r["seconds"] / base, 2)
  return {"quick": quick, "config": {"batch": batch, "batches": n_batches,
                                     "max_nodes": max_nodes, "d_h": d_h,
                                     "nodes_timed": n_nodes},
          "rows": rows, "check": res_check}


def format_table(res: dict) -> str:
  lines = []
  if "rows" in res:
    cols = ["mode", "seconds", "us_per_node", "x_slower_than_dynjax", "invokes_per_batch",
            "levels_per_batch", "record_ms_per_batch", "flush_ms_per_batch",
            "max_abs_diff_vs_dynjax"]
    lines.append("childsum model (4 cells over child lists):")
    lines.append(" | ".join(cols))
    for r in res["rows"]:
      lines.append(" | ".join(str(r.get(c, "")) for c in cols))
    chk = res.get("check")
    if chk:
      lines.append(f"correctness ({chk['trees']} trees vs float64 numpy, {chk['tolerance']}): "
                   + ", ".join(f"{k} {v:.2e}" for k, v in chk["max_abs_err"].items())
                   + f" -> {'ok' if chk['ok'] else 'FAILED'}")
  ar = res.get("arity")
  if ar:
    cfg = ar["config"]
    lines.append(f"arity model ({ar['model']}): {cfg['batch']} trees/batch, mean "
                 f"{cfg['mean_nodes']:.0f} nodes, H={cfg['d_h']}, {cfg['forests']} forests")
    cols = ["form", "frontend", "dynjax_ms", "per_node_ms", "x_faster_than_per_node",
            "x_faster_than_per_node_jnp", "dynjax_us_per_node", "record_us_per_node",
            "first_call_after_warmup_ms", "dynjax_first_ms", "warmup_compiles"]
    lines.append(" | ".join(cols) + " | compiles/batch (sum, max)")
    for r in ar["rows"]:
      c = r["compiles_per_batch"]
      lines.append(" | ".join(str(r.get(k, "")) for k in cols) + f" | {sum(c)}, {max(c)}")
    for r in ar["rows"]:
      lines.append(f"  {r['form']}/{r['frontend']}: {r['note']}; {r['cost']}")
    nw = ar.get("no_warmup")
    if nw:
      lines.append(f"without warmup() ({nw['frontend']}, {nw['form']}): first batch "
                   f"{nw['first_batch_compiles']} compiles, then per batch "
                   f"{nw['compiles_per_batch']}")
    chk = ar["check"]
    lines.append("correctness vs float64 numpy at highest precision: " + ", ".join(
        f"{k} {v:.2e}" for k, v in chk["max_abs_err_vs_float64"].items())
        + f" (atol {chk['tolerance']:g}) -> {'ok' if chk['ok'] else 'FAILED'}")
    t = ar.get("torch")
    if t:
      lines.append("torch per node: " + ", ".join(f"{k} {v}" for k, v in t.items()))
  return "\n".join(lines)


def _main(argv: Sequence[str] | None = None) -> None:
  """``python -m benchmarks.treelstm [--full] [--out DIR] [key=value ...]``."""
  import sys

  argv = list(sys.argv[1:] if argv is None else argv)
  flags: dict = {"quick": "--full" not in argv}
  out = None
  for i, a in enumerate(argv):
    if a == "--out" and i + 1 < len(argv):
      out = argv[i + 1]
    elif a.startswith("--out="):
      out = a.split("=", 1)[1]
    elif "=" in a and not a.startswith("--"):
      k, v = a.split("=", 1)
      try:
        flags[k] = json.loads(v)
      except ValueError:
        flags[k] = v
  res = run(flags, out)
  print(format_table(res))
  if out:
    print(f"results in {out}/treelstm.json")


if __name__ == "__main__":
  _main()
