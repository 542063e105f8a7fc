"""Vision models at variable image sizes under ``dynjax.flax.jit`` / ``dynjax.jit(model.apply)``
/ a ``dynjax.jit`` train step, against ``jax.jit`` at the exact shape.

  python benchmarks/probe_vision.py [--out DIR] [--cases resnet,vit:train] [--sizes 37x45,...]

Images of one size within a batch, the size changing between calls (detection, segmentation,
OCR).  Linen models copied from public code, not shaped around dynjax (widths 8-32):
``resnet`` (flax examples/imagenet/models.py; ``axis_name`` dropped: one device), ``vit``
(big_vision vit.py, FlexiViT's learned posemb ``jax.image.resize``d to the patch grid, gap),
``vit_patchify`` (MAE ``patchify`` reshape after padding to the patch, big_vision
``posemb_sincos_2d``, cls token), ``unet`` (pad to a multiple of 4 as ``(-h) % m``, BatchNorm,
``max_pool``, ``nn.ConvTranspose``, skip concat, crop), ``unet_resize`` (``avg_pool`` floor,
GroupNorm, decoder resized to the skip's shape), ``convnext`` (depthwise 7x7, LayerNorm, GELU,
layer scale 1.0: 1e-6 would hide the blocks from the comparison), ``mobilenetv2``
(torchvision's layout), ``efficientnet`` (MBConv + squeeze-and-excitation), ``fcn`` (dilated
conv, logits resized to the input), ``swin`` (torch Swin: pad to the window as ``(ws - h % ws)
% ws``, cyclic ``jnp.roll``, the shifted-window ``img_mask`` slices, window reshapes, crop,
PatchMerging).  ``unet_ceilpad`` / ``swin_ceilpad`` / ``vit_h>=4``: what a user wrote where
``vit``, ``unet`` and ``swin`` fell back before session 26's inferred facts (padding written
``-(-h // k) * k - h``; ``constraints=("h >= 4", "w >= 4")``); all six pad now.

Batch 2 at each of ``--sizes``; ``pow2(16, 128)`` on h and w.  Train steps: the imagenet
example's ``TrainState`` (SGD momentum, ``mutable=["batch_stats"]``), loss, grads returned.
Every output leaf compared: max abs error / the leaf's max abs value <= ``TOL``; a case that
differs in float32 is rerun with both sides in float64 (rounding, or a wrong result?).
Writes ``DIR/probe_vision_cpu.json`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import short_reason, write_json  # noqa: E402
from benchmarks._vision_models import NUM_CLASSES, SEG_CLASSES, B, models  # noqa: E402

SIZES = ((37, 45), (50, 31), (64, 64), (23, 77), (41, 41))
TOL = 1e-5  # max abs error relative to the leaf's max abs value (f32)


SEGMENTATION = ("unet", "unet_resize", "fcn", "unet_ceilpad")
EXTRA_OPTS = {"vit_h>=4": {"constraints": ("h >= 4", "w >= 4")}}



def has_train_flag(name: str) -> bool:
  return name in ("resnet", "unet", "mobilenetv2", "efficientnet", "fcn", "unet_ceilpad")


# -- inputs, init ---------------------------------------------------------------------------------
def images(h: int, w: int, seed: int = 0, b: int = B):
  rng = np.random.default_rng(seed * 7919 + h * 131 + w)
  x = rng.normal(size=(b, h, w, 3)).astype(np.float32)
  labels = rng.integers(0, NUM_CLASSES, (b,)).astype(np.int32)
  seg = rng.integers(0, SEG_CLASSES, (b, h, w)).astype(np.int32)
  return x, labels, seg


def f64(tree):
  """Float leaves as float64 (the x64 check: both sides in double precision)."""
  return jax.tree.map(lambda a: np.asarray(a, np.float64)
                      if jnp.issubdtype(np.asarray(a).dtype, jnp.floating) else a, tree)


@functools.cache
def init(name: str, x64: bool = False):
  """(module, variables), initialised at a 32x32 image (in float32; cast for the x64 check)."""
  cls = models()[name]
  module = cls()
  x = jnp.zeros((B, 32, 32, 3), jnp.float32)
  kw = {"train": False} if has_train_flag(name) else {}
  variables = jax.jit(functools.partial(module.init, **kw))(jax.random.key(0), x)
  if not x64:
    return module, variables
  return (cls(dtype=jnp.float64) if name == "resnet" else module), f64(variables)


# -- train step (flax examples/imagenet/train.py) ---------------------------------------------
def train_state(name: str, lr: float = 0.1, x64: bool = False):
  import optax
  from flax.training import train_state as ts

  class TrainState(ts.TrainState):
    batch_stats: Any

  module, variables = init(name, x64)
  return TrainState.create(apply_fn=module.apply, params=variables["params"],
                           tx=optax.sgd(lr, momentum=0.9),
                           batch_stats=variables.get("batch_stats", {}))


def make_train_step(name: str):
  import optax

  seg = name in SEGMENTATION
  flag = has_train_flag(name)

  def train_step(state, images, labels):
    def loss_fn(params):
      variables = {"params": params, "batch_stats": state.batch_stats}
      if flag:
        logits, new_model_state = state.apply_fn(variables, images, train=True,
                                                 mutable=["batch_stats"])
      else:
        logits, new_model_state = state.apply_fn(variables, images), {"batch_stats": {}}
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, (new_model_state, logits)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (new_model_state, logits)), grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    acc = jnp.mean(jnp.argmax(logits, -1) == labels)
    return new_state, {"loss": loss, "accuracy": acc, "grads": grads}

  label_dims = "b, h, w" if seg else "b"
  return train_step, {"state": None, "images": "b, h, w, 3", "labels": label_dims}


# -- comparison -----------------------------------------------------------------------------------
def max_rel_err(got, want, tol: float = TOL, floor: float = 0.0):
  """(max over leaves of max abs err / the leaf's max abs value, failing keypaths).  A leaf
  passes at ``err <= tol * its scale``, or ``err <= floor * the scale of the whole output``
  (``floor``: only in the float64 check, where a gradient that is 0 in exact arithmetic, a
  BatchNorm's bias before another BatchNorm, is rounding noise of ~1e-17)."""
  gl = jax.tree_util.tree_leaves_with_path(got)
  wl = [np.asarray(w, np.float64) for w in jax.tree_util.tree_leaves(want)]
  if len(gl) != len(wl):
    return float("inf"), [f"{len(gl)} leaves != {len(wl)}"]
  whole = max((float(np.nanmax(np.abs(w), initial=0.0)) for w in wl), default=0.0)
  worst, bad = 0.0, []
  for (path, g), w in zip(gl, wl, strict=True):
    key = jax.tree_util.keystr(path)
    # a float32 leaf of the float64 check (jnp.mean of a bool stays float32) at float32's TOL
    leaf_tol = max(tol, TOL) if np.asarray(g).dtype == np.float32 else tol
    g = np.asarray(g, np.float64)
    if g.shape != w.shape:
      bad.append(f"{key}: shape {g.shape} != {w.shape}")
      worst = float("inf")
      continue
    if not g.size:
      continue
    d = float(np.nanmax(np.abs(g - w)))
    scale = float(np.nanmax(np.abs(w)))
    rel = d / scale if scale > 1e-30 else d
    if np.isnan(g).any() != np.isnan(w).any():
      rel = d = float("inf")
    worst = max(worst, rel)
    if rel > leaf_tol and d > floor * whole:
      bad.append(f"{key}: max abs err {d:.3g} (scale {scale:.3g}, rel {rel:.3g})")
  return worst, bad


# -- cases ----------------------------------------------------------------------------------------
def buckets():
  import dynjax

  return {"h": dynjax.buckets.pow2(16, 128), "w": dynjax.buckets.pow2(16, 128)}


def wrap(name: str, mode: str, on_fallback: str = "warn", x64: bool = False):
  """(dynjax-wrapped function, jax.jit reference, args_of(h, w), the function with stats())
  of one case."""
  import dynjax
  import dynjax.flax

  module, variables = init(name, x64)
  cast = f64 if x64 else (lambda a: a)
  opts = dict(buckets=buckets(), on_fallback=on_fallback, **EXTRA_OPTS.get(name, {}))
  seg = name in SEGMENTATION
  if mode == "train":
    step, dims = make_train_step(name)
    fn = dynjax.jit(step, dims=dims, **opts)
    return (fn, jax.jit(step), lambda h, w: (cast(images(h, w)[0]), images(h, w)[2 if seg else 1]),
            fn)
  kw = {"train": False} if has_train_flag(name) else {}
  ref = jax.jit(functools.partial(module.apply, **kw))
  if mode == "flax":  # dynjax.flax.jit(module): fn(variables, x, train=False)
    import inspect

    arg = list(inspect.signature(type(module).__call__).parameters)[1]  # x, image
    fn = dynjax.flax.jit(module, dims={arg: "b, h, w, 3"}, **opts,
                         static_argnames=tuple(kw))
    return functools.partial(fn, **kw), ref, lambda h, w: (cast(images(h, w)[0]),), fn
  fn = dynjax.jit(module.apply, dims={"args": ("b, h, w, 3",)},
                  static_argnames=tuple(kw), **opts)
  return functools.partial(fn, **kw), ref, lambda h, w: (cast(images(h, w)[0]),), fn


_REF: dict = {}


def run_case(name: str, mode: str, sizes=SIZES, on_fallback: str = "warn",
             x64: bool = False) -> dict:
  """Calls the dynjax-wrapped function and its reference at every size; the row's record.
  ``x64``: both sides in float64 (under ``jax.enable_x64``), the weights cast from float32."""
  if x64:
    with jax.enable_x64(True):
      return run_case(name, mode, sizes, on_fallback) | {"x64": True}
  x64 = bool(jax.config.jax_enable_x64)
  fn, ref, args_of, stats_of = wrap(name, mode, on_fallback, x64)
  if mode == "train":
    mine = theirs = train_state(name, x64=x64)
  else:
    _, variables = init(name, x64)
  errs, bad = [], []
  for h, w in sizes:
    args = args_of(h, w)
    if mode == "train":
      (mine, got), (theirs, want) = fn(mine, *args), ref(theirs, *args)
      got, want = (got, mine.params, mine.batch_stats), (want, theirs.params, theirs.batch_stats)
    else:
      key = (name, h, w, x64)
      if key not in _REF:  # the reference is one function for both wrappers
        _REF[key] = jax.device_get(ref(variables, *args))
      got, want = fn(variables, *args), _REF[key]
    e, b = max_rel_err(got, want, *((1e-9, 1e-13) if x64 else ()))
    errs.append(e)
    bad += [f"{h}x{w} {x}" for x in b]
  st = stats_of.stats()
  return {"sizes": [list(s) for s in sizes], "exact": not bad, "max_rel_err": max(errs),
          "bad": bad[:8], "fallbacks": [str(x) for x in st["fallbacks"]],
          "compiles": st["compiles"], "calls": st["calls"], "exact_calls": st["exact_calls"],
          "per_bucket_calls": st["per_bucket_calls"]}


CASES = [(n, m) for n in models() for m in ("flax", "apply")] + [
  (n, "train") for n in ("resnet", "mobilenetv2", "efficientnet", "fcn", "convnext", "unet",
                         "unet_ceilpad", "vit", "vit_h>=4", "swin", "swin_ceilpad")]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="", help="comma-separated model[:mode] prefixes")
  ap.add_argument("--sizes", default=",".join(f"{h}x{w}" for h, w in SIZES))
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--no-x64-check", dest="x64_check", action="store_false",
                  help="do not rerun a case that differs in float32 with both sides in float64")
  ap.add_argument("--fast", action="store_true",
                  help="XLA's optimisations off on both sides (as the test suite compiles)")
  args = ap.parse_args(argv)
  import flax
  import optax

  warnings.simplefilter("ignore")
  if args.fast:
    jax.config.update("jax_disable_most_optimizations", True)
  sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
  report = {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "device": jax.devices()[0].device_kind, "sizes": [list(s) for s in sizes],
            "batch": B, "buckets": "h, w: pow2(16, 128)", "tol_rel": TOL,
            "xla_optimizations": not args.fast, "cases": {}}
  wanted = [p for p in args.cases.split(",") if p]
  print("| model | via | exact? | max rel err | compiles/calls | exact calls | buckets | "
        "fallbacks: reason | s |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, mode in CASES:
    label = f"{name}:{mode}"
    if wanted and not any(label.startswith(p) for p in wanted):
      continue
    t0 = time.perf_counter()
    try:
      rec = run_case(name, mode, sizes)
    except Exception as e:  # noqa: BLE001 - one case must not lose the others
      rec = {"exact": None, "error": f"{type(e).__name__}: {str(e)[:800]}", "fallbacks": []}
    ok = {True: "yes", False: "NO", None: "ERROR"}[rec["exact"]]
    if rec["exact"] is False and args.x64_check:  # rounding, or a wrong result?
      x = run_case(name, mode, sizes, x64=True)
      rec["x64_check"] = {k: x[k] for k in ("exact", "max_rel_err", "bad", "fallbacks")}
      ok = "yes (f64; f32 rounding)" if x["exact"] else "NO (f64 too)"
    rec["verdict"] = ok
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    report["cases"][label] = rec
    fb = "; ".join(short_reason(x, 220) for x in rec["fallbacks"])
    fb = f"{len(rec['fallbacks'])}: {fb}" if fb else "0"
    via = {"flax": "dynjax.flax.jit", "apply": "dynjax.jit(apply)", "train": "train step"}[mode]
    nb = len([k for k in rec.get("per_bucket_calls", {}) if not k.startswith("exact")])
    print(f"| {name} | {via} | {ok} | {rec.get('max_rel_err', float('nan')):.1e} | "
          f"{rec.get('compiles', '-')}/{rec.get('calls', '-')} | {rec.get('exact_calls', '-')} "
          f"| {nb} | {fb} | {rec['seconds']} |", flush=True)
    for b in rec.get("bad", [])[:4]:
      print(f"|   |   | {b} | | | | | | |")
    if "error" in rec:
      print(f"|   |   | {rec['error'][:400]} | | | | | | |")
  path = write_json(args.out, "probe_vision_cpu.json", report)
  if path:
    print(f"wrote {path}")
  return report


if __name__ == "__main__":
  main()
