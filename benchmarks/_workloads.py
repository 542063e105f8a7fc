"""The array workloads of the suite: ``bert`` (Linen), ``encoder`` (jax.numpy), ``lstm``.

Each request is a :class:`examples.data.Request`: a batch of real docstrings as token ids,
padded to its own longest sequence (``tokens [batch, t]``, ``lengths [batch]``), exactly what a
client would send.  Every mode gets fresh function objects, so no two modes share JAX's
tracing or compilation caches.
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np

from benchmarks._suite import (
  Config,
  Mode,
  ModeContext,
  ModeUnavailable,
  Workload,
  _pool_map,
  child_mode,
)
from examples import data, models

DIMS = {"tokens": "b, t", "lengths": "b"}
MIN_BUCKET = 16


class _HostPad:
  """Pads token batches on the host into one reused buffer per (batch, width) (pad_max mode)."""

  def __init__(self, width: int):
    self.width = width
    self._bufs: dict[int, np.ndarray] = {}

  def __call__(self, tokens: np.ndarray) -> np.ndarray:
    b, t = tokens.shape
    buf = self._bufs.get(b)
    if buf is None:
      buf = self._bufs[b] = np.zeros((b, self.width), tokens.dtype)
    buf[:, :t] = tokens
    buf[:, t:] = data.PAD_ID
    return buf


def _array_workload(name: str, description: str, cfg: Config, *, make_fun, params,
                    linen_module=None, torch_factory=None, info=None) -> Workload:
  """Modes for a ``fun(params, tokens, lengths)`` model fed numpy batches.

  Args:
    make_fun: ``() -> fun(params, tokens, lengths)``, a fresh function object on every call.
    params: the first argument, already on the device.
    linen_module: when given, the dynjax modes wrap it with :func:`dynjax.flax.jit` (the way a
      Flax user would) and ``params`` is the ``variables`` dict.
    torch_factory: ``() -> torch.nn.Module`` twin, or None.
  """
  import jax

  import dynjax

  vocab = (info or {}).get("vocab", 30522)
  requests = data.request_stream(cfg.requests, batch=cfg.batch, max_len=cfg.max_len,
                                 seed=cfg.seed, vocab=vocab)
  modes = {}

  def jit_mode(ctx: ModeContext) -> Mode:
    jf = jax.jit(make_fun())
    ctx.shared["jit_fn"] = jf
    ctx.shared["jit_shapes"] = set()
    return Mode("jit", lambda r: jf(params, r.tokens, r.lengths), label="jax.jit per exact shape")

  def oracle_mode(ctx: ModeContext) -> Mode:
    reqs = ctx.workload.requests
    idx = ctx.oracle_indices
    jf = jax.jit(make_fun())
    reps = {}
    for i in idx:
      reps.setdefault(reqs[i].tokens.shape, reqs[i])
    exes = {}

    def setup():
      # AOT-compile every exact shape beforehand, concurrently (XLA compiles release the GIL),
      # and call the Compiled objects directly: no jax.jit dispatch or cache lookup per call.
      def build(r):
        exes[r.tokens.shape] = jf.lower(params, r.tokens, r.lengths).compile()
      _pool_map(build, list(reps.values()), min(8, os.cpu_count() or 2))

    sub = "" if len(idx) == len(reqs) else f" ({len(reps)} shapes, {len(idx)} requests)"
    return Mode("oracle", lambda r: exes[r.tokens.shape](params, r.tokens, r.lengths),
                setup=setup, setup_counted=False, only=idx,
                label="exact-shape AOT executables compiled beforehand" + sub)

  def aot_bucket_mode(ctx: ModeContext) -> Mode:
    # The bucket executables without dynjax: jax AOT at each pow2 bucket shape, fed requests
    # host-padded to their bucket.  dynjax_pow2 / this = dynjax's host cost; this / oracle =
    # the padding waste.
    jf = jax.jit(make_fun())
    pol = dynjax.buckets.pow2(MIN_BUCKET, cfg.max_len)
    reqs = ctx.workload.requests
    shapes = sorted({(r.tokens.shape[0], pol.bucket(r.tokens.shape[1])) for r in reqs})
    exes, pads = {}, {}

    def setup():
      def build(shape):
        lens = np.ones(shape[0], np.int32)
        exes[shape] = jf.lower(params, np.zeros(shape, np.int32), lens).compile()
      _pool_map(build, shapes, min(8, os.cpu_count() or 2))

    def run(r):
      b, t = r.tokens.shape
      shape = (b, pol.bucket(t))
      pad = pads.get(shape[1])
      if pad is None:
        pad = pads[shape[1]] = _HostPad(shape[1])
      return exes[shape](params, pad(r.tokens), r.lengths)

    return Mode("aot_bucket", run, setup=setup, setup_counted=False,
                label=f"jax AOT at the pow2 bucket shapes ({len(shapes)}), host-padded inputs")

  def pad_max_mode(ctx: ModeContext) -> Mode:
    jf = jax.jit(make_fun())
    pad = _HostPad(cfg.max_len)
    true = [0]
    padded = [0]

    def run(r):
      true[0] += r.tokens.size
      padded[0] += r.tokens.shape[0] * cfg.max_len
      return jf(params, pad(r.tokens), r.lengths)

    return Mode("pad_max", run, label=f"jax.jit, host-padded to {cfg.max_len}",
                padded_fraction=lambda: 1.0 - true[0] / max(padded[0], 1))

  def dynjax_fn(policy, serving=False, cache_dir=None):
    kw = dict(dims=DIMS, buckets={"t": policy}, padding=cfg.padding,
              cache_dir=cache_dir or cfg.persistent_cache_dir, async_compile=cfg.async_compile,
              serving=serving)
    if linen_module is not None:
      from dynjax import flax as dynjax_flax

      return dynjax_flax.jit(linen_module, **kw)
    return dynjax.jit(make_fun(), **kw)

  def dynjax_mode(name, policy, warm=False, serving=False):
    def factory(ctx: ModeContext) -> Mode:
      cache_dir = None
      if serving:
        # A fresh cache per serving mode: no mode profits from another's compiles.  The
        # restart modes serve from it in a new process (benchmarks._child).
        dirs = ctx.shared.setdefault("cache_dirs", {})
        cache_dir = dirs.get(name)
        if cache_dir is None:
          cache_dir = dirs[name] = tempfile.mkdtemp(prefix=f"dynjax_{name}_")
      f = dynjax_fn(policy, serving=serving, cache_dir=cache_dir)
      setup = None
      if warm:
        r0 = ctx.workload.requests[0]
        setup = functools.partial(f.warmup, params, r0.tokens, r0.lengths, progress=False)
      label = f"dynjax.jit, {policy!r}" + (", warmup() first" if warm else "")
      if serving:
        label += ", serving=True (fresh cache_dir)"
      elif cfg.async_compile:
        label += ", async_compile"
      return Mode(name, lambda r: f(params, r.tokens, r.lengths), label=label, setup=setup,
                  between_passes=getattr(f, "wait", None), stats=f.stats,
                  padded_fraction=lambda: f.stats()["padded_fraction"])
    return factory

  modes["jit"] = jit_mode
  modes["oracle"] = oracle_mode
  modes["pad_max"] = pad_max_mode
  modes["dynjax_pow2"] = dynjax_mode("dynjax_pow2", dynjax.buckets.pow2(MIN_BUCKET, cfg.max_len))
  modes["dynjax_auto"] = dynjax_mode(
      "dynjax_auto", dynjax.buckets.auto(max_compiles=8, min=MIN_BUCKET, max=cfg.max_len))
  modes["dynjax_warmup"] = dynjax_mode(
      "dynjax_warmup", dynjax.buckets.pow2(MIN_BUCKET, cfg.max_len), warm=True)
  modes["aot_bucket"] = aot_bucket_mode
  modes["dynjax_serve"] = dynjax_mode(
      "dynjax_serve", dynjax.buckets.pow2(MIN_BUCKET, cfg.max_len), serving=True)
  modes["dynjax_serve_auto"] = dynjax_mode(
      "dynjax_serve_auto", dynjax.buckets.auto(max_compiles=8, min=MIN_BUCKET, max=cfg.max_len),
      serving=True)
  modes["dynjax_restart"] = functools.partial(
      child_mode, "dynjax_restart", run_as="dynjax_serve", steady=False)
  modes["dynjax_restart_auto"] = functools.partial(
      child_mode, "dynjax_restart_auto", run_as="dynjax_serve_auto", steady=False)
  if torch_factory is not None:
    modes["torch_eager"] = _torch_mode("torch_eager", torch_factory, compiled=False)
    modes["torch_compile"] = _torch_mode("torch_compile", torch_factory, compiled=True)
  return Workload(name=name, description=description, requests=requests, modes=modes,
                  shape_key=lambda r: r.tokens.shape, info=dict(info or {}))


def _torch_mode(name: str, torch_factory, compiled: bool):
  def factory(ctx: ModeContext) -> Mode:
    if not models.torch_available():
      raise ModeUnavailable("torch is not installed")
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = torch_factory()
    dev = next(model.parameters()).device
    fn = torch.compile(model, dynamic=True) if compiled else model
    counts = None
    if compiled:
      try:
        from torch._dynamo.utils import counters as counts  # private; informative only
      except Exception:
        counts = None

    def run(r):
      with torch.inference_mode():
        tok = torch.from_numpy(r.tokens).to(dev, non_blocking=True)
        lens = torch.from_numpy(r.lengths).to(dev, non_blocking=True)
        return fn(tok, lens)

    def n_compiles():
      if counts is None:
        return None
      return int(counts["stats"].get("unique_graphs", 0))

    label = f"PyTorch {torch.__version__} on {dev}, TF32 on" + (
        ", torch.compile(dynamic=True)" if compiled else ", eager")
    return Mode(name, run, label=label, compiles=n_compiles if compiled else (lambda: 0))
  return factory


# -- builders (registered in benchmarks._suite.WORKLOADS) ---------------------------------
def bert(cfg: Config) -> Workload:
  """The Linen BERT-style encoder of ``--size`` served through ``dynjax.flax.jit``."""
  if cfg.size not in models.ENCODER_SIZES:
    raise ValueError(f"--size must be one of {sorted(models.ENCODER_SIZES)}, got {cfg.size!r}")
  ecfg = models.ENCODER_SIZES[cfg.size]
  if cfg.max_len > ecfg.max_len:
    ecfg = models.EncoderConfig(**{**ecfg.__dict__, "max_len": cfg.max_len})
  module = models.BertEncoder(ecfg)
  raw = models.init_encoder_params(ecfg, seed=cfg.seed)
  variables = models.to_device({"params": raw})

  def make_fun():
    def bert_apply(variables, tokens, lengths):
      return module.apply(variables, tokens, lengths)
    return bert_apply

  torch_factory = functools.partial(models.torch_bert, raw, ecfg)
  return _array_workload(
      "bert", f"Linen BERT-style encoder, size {cfg.size}: {ecfg.layers} layers, "
      f"d={ecfg.d_model}, {ecfg.heads} heads, ffn {ecfg.ffn}", cfg,
      make_fun=make_fun, params=variables, linen_module=module, torch_factory=torch_factory,
      info={"model": ecfg.__dict__, "vocab": ecfg.vocab})


def encoder(cfg: Config) -> Workload:
  """The Flax-free jax.numpy encoder (issue 2's benchmark model) under ``dynjax.jit``."""
  if cfg.size not in models.ENCODER_SIZES:
    raise ValueError(f"--size must be one of {sorted(models.ENCODER_SIZES)}, got {cfg.size!r}")
  ecfg = models.ENCODER_SIZES[cfg.size]
  if cfg.max_len > ecfg.max_len:
    ecfg = models.EncoderConfig(**{**ecfg.__dict__, "max_len": cfg.max_len})
  raw = models.init_encoder_params(ecfg, seed=cfg.seed)
  params = models.to_device(raw)
  torch_factory = functools.partial(models.torch_bert, raw, ecfg)
  wl = _array_workload(
      "encoder", f"jax.numpy encoder with a length mask, size {cfg.size}: {ecfg.layers} "
      f"layers, d={ecfg.d_model}", cfg, make_fun=lambda: models.make_encoder(ecfg),
      params=params, torch_factory=torch_factory,
      info={"model": ecfg.__dict__, "vocab": ecfg.vocab})
  wl.modes["dynjax_pass"] = functools.partial(_padding_pass_mode, cfg, ecfg, params)
  return wl


def _padding_pass_mode(cfg: Config, ecfg, params, ctx: ModeContext) -> Mode:
  """Issue 3's comparison: the UNMASKED natural encoder under padding="auto" (the padding pass
  makes it exact), pow2 buckets; compare its steady state with dynjax_pow2 (trust, masked).

  Before timing, a few requests are checked against jax.jit of the unmasked model at the
  exact shape; the largest relative error goes into the label.
  """
  import jax

  import dynjax

  unmasked = models.make_encoder(ecfg, masked=False)
  f = dynjax.jit(lambda params, tokens, lengths: unmasked(params, tokens), dims=DIMS,
                 buckets={"t": dynjax.buckets.pow2(MIN_BUCKET, cfg.max_len)}, padding="auto",
                 cache_dir=cfg.persistent_cache_dir, async_compile=cfg.async_compile)
  exact = jax.jit(unmasked)
  reqs = ctx.workload.requests
  errs = []
  for r in reqs[:: max(1, len(reqs) // 4)][:4]:
    got = np.asarray(f(params, r.tokens, r.lengths), np.float64)
    want = np.asarray(exact(params, r.tokens), np.float64)
    errs.append(float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)))
  label = (f"dynjax.jit, padding='auto' on the UNMASKED encoder, pow2; max rel err vs exact "
           f"{max(errs):.1e} over {len(errs)} requests")
  return Mode("dynjax_pass", lambda r: f(params, r.tokens, r.lengths), label=label,
              between_passes=getattr(f, "wait", None), stats=f.stats,
              padded_fraction=lambda: f.stats()["padded_fraction"])


def lstm(cfg: Config) -> Workload:
  """The LSTM text classifier of ``--size`` under ``dynjax.jit``."""
  if cfg.size not in models.LSTM_SIZES:
    raise ValueError(f"--size must be one of {sorted(models.LSTM_SIZES)}, got {cfg.size!r}")
  lcfg = models.LSTM_SIZES[cfg.size]
  raw = models.init_lstm_params(lcfg, seed=cfg.seed)
  params = models.to_device(raw)
  torch_factory = functools.partial(models.torch_lstm, raw)
  return _array_workload(
      "lstm", f"LSTM classifier, size {cfg.size}: embed {lcfg.embed}, hidden {lcfg.hidden}",
      cfg, make_fun=models.make_lstm, params=params, torch_factory=torch_factory,
      info={"model": lcfg.__dict__, "vocab": lcfg.vocab})
