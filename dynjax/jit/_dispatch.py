"""Dispatch: from a call's arguments to the executable that runs them.

One run routine.  Every padded call runs through :meth:`Executor.run` (pad -> run -> unpad
-> count).  A call whose (family, shapes of the leaves with dims, host/device) was seen
before finds its executor in ``family.executors``; a miss plans the bucket, gets the entry
from the compiler (compiled, loaded, or a larger one while its own compiles), builds the
executor and runs it through the same routine.  Executors are kept while the family's
``gen`` is unchanged (a bucket added, replaced or dropped bumps it) and only where no call
decides anything (an ``auto`` policy that re-plans with traffic decides per call; so does an
LRU bound, which may evict the bucket).

:class:`Dispatcher` is the per-function state behind ``Wrapped``: families, the executable
cache, the compiler, counters.  Exact-shape and host-program calls (``run_exact``,
``_programs.run_program``) are not padded and have routines of their own.
"""

from __future__ import annotations

import itertools
import math
import threading
import time

import jax
import numpy as np

from dynjax import _symbolic
from dynjax._config import config
from dynjax._errors import PaddingMismatchError, PaddingUnsupportedError
from dynjax._padded import Padded
from dynjax.jit import _args, _casts, _cuda, _devpad, _forward, _placement, _programs, _serving
from dynjax.jit._args import is_key, is_padded, leaf_key, on_device, tree_flatten, tree_unflatten
from dynjax.jit._cache import ExecutableCache
from dynjax.jit._family import PADDED_MODES, Family
from dynjax.jit._options import Policies
from dynjax.jit._placement import to_host
from dynjax.jit._serving import Compiler
from dynjax.jit._stats import Counters


class Executor:
  """The run routine of padded calls of one (family, shapes, host/device) on one bucket.

  Measured (2-core box, jax 0.10.2, ``x * 2 + 1``, timeit, session 35): numpy (8, 13) in and
  out 71-72 us against 51-52 for the AOT executable with hand-written padding; a (8, 16) device
  array 34 us against 17-20.  BERT-base, H200 host, taking turns (probe_cost_curve.py): 3.28
  ms a request against 3.70 for hand-written pow2 buckets.  Building one: ~0.2 ms (2-core).
  """

  __slots__ = ("fam", "gen", "sizes", "bkey", "exe", "pads", "zero_pad", "shard", "full_shapes",
               "in_shapes", "tree", "dev_sizes", "out_slices", "out_shapes", "out_tree",
               "single", "sync", "device", "return_padded", "timed", "check", "ctx", "n", "lock",
               "padded_elems", "true_elems", "larger", "bucket_id", "out_dynamic", "top",
               "plain_out", "casts", "fwd", "to_device", "numpy_out", "pad_sites", "cut_sites",
               "reads", "as_is", "watch", "once", "lru")

  def __init__(self, ctx, fam: Family, sizes, own, bkey, entry, shapes, device: bool,
               top: bool, dev_sizes, out_shapes, true_elems: int, all_leaves: bool):
    opts = ctx.opts
    self.ctx = ctx
    self.fam = fam
    self.gen = fam.gen
    self.sizes = sizes
    self.bkey = bkey
    self.exe = entry.exe
    self.in_shapes = entry.in_shapes
    self.top = top
    where = fam.top_pos if top else fam.spec_idx
    # A host request gets numpy results for its outputs with dims (cut to the exact shapes
    # on the host); outputs without dims (a training step's new parameters) stay device
    # arrays, as jax.jit returns them: never a round trip of the state.
    host = not device and not opts.return_padded
    kept = [i for i in range(len(out_shapes)) if i not in fam.forward]
    self.numpy_out = tuple(host and fam.out_dynamic[i] for i in kept)
    self.sync = any(self.numpy_out)  # the call blocks for its numpy results
    # ... read by the CUDA driver from device outputs (jit/_placement.py READS), up to the
    # size pinned host outputs stop at (above it both leave large results to the runtime)
    self.reads = (self.sync and not entry.host_out and _placement.reads_planned(fam)
                  and _placement.read_bytes(fam, bkey, kept) <= _placement.MAX_BYTES)
    # Leaves to pad: (position in the call's values, true shape, bucket shape, prefix, how its
    # host buffer is reused: sync calls only).  With a Padded among them (``all_leaves``) every
    # leaf with dims goes through pad_leaf; a sync call's leaves the driver copies to the
    # device (_placement.DIRECT, jit/_cuda.py) are taken whether padded or not.
    donated = set(fam.donate_leaves()) if self.sync and fam.shard is None else None
    padded, pads = [], []  # (the leaf indices, for pad_sites below)
    for p, li in zip(where, fam.spec_idx, strict=True):
      pad = all_leaves or shapes[li] != entry.in_shapes[li]
      if not pad and donated is None:
        continue  # (only a sync call's leaf may take the driver's copy unpadded)
      pool = _placement.pool_of(self.exe, entry.in_shapes[li], fam.avals[li].dtype,
                                direct=donated is not None and li not in donated)
      if pad or (type(pool) is tuple and pool[2] == _placement.DIRECT):
        padded.append(li)
        pads.append((p, shapes[li], entry.in_shapes[li],
                     tuple(slice(0, n) for n in shapes[li]), pool))
    self.pads = tuple(pads)
    # auto reads no padded value: stale ones may stay.  Not with a kernel rewrite: a fused
    # attention multiplies masked (0) probabilities by padded values (an old inf: NaN).
    self.zero_pad = fam.mode != "auto" or bool(opts.attention or opts.ragged_dot)
    self.shard = fam.shard
    # Parameters the executable takes cast (jit/_casts.py): their cached copies go in.
    self.casts = _casts.Applier(fam, entry.casts, top) if entry.casts else None
    self.full_shapes = ([shapes.get(i, s) for i, s in enumerate(fam.avals_shapes)]
                        if fam.shard is not None else None)
    self.tree = fam.treedef if (fam.structured and not top) else None
    self.dev_sizes = dev_sizes  # the true-sizes vector on the device (padding="auto")
    # Outputs that are inputs are not computed: the call's own objects go back (_forward).
    self.fwd = _forward.Inserter(fam, top) if fam.forward else None
    padded_out = [fam.out_shape_fns[i](bkey) for i in kept]  # output dims at the bucket
    self.out_shapes = out_shapes = [out_shapes[i] for i in kept]
    self.out_slices = tuple(None if tuple(o) == tuple(p) else tuple(slice(0, n) for n in o)
                            for o, p in zip(out_shapes, padded_out, strict=True))
    self.out_dynamic = [fam.out_dynamic[i] for i in kept]
    self.out_tree = fam.out_tree
    # one array out: no unflatten
    self.single = fam.out_tree == _args.LEAF_TREEDEF and self.fwd is None
    self.plain_out = not any(is_key(fam.out_avals[i]) for i in kept)  # no PRNG keys among them
    self.return_padded = opts.return_padded
    self.device = device
    # pinned host outputs (jit/_placement.py) of a device request go back to the device
    self.to_device = entry.host_out and not host
    self.as_is = not (self.sync or opts.return_padded or self.to_device or any(self.out_slices))
    # Device arrays padded / outputs cut on the device once their shape has paid for it
    # (jit/_devpad.py): one site per padded leaf and per cut output of a device request.
    self.pad_sites = self.cut_sites = None
    dev = (_placement.exe_device(self.exe) if device and fam.shard is None
           and config.device_pad else None)
    if dev is not None:
      sites = ctx.devpads
      self.pad_sites = tuple(
          sites.site("pad", shapes[li], entry.in_shapes[li], fam.avals[li].dtype, dev)
          for li in padded)
      if not self.to_device and not opts.return_padded:
        self.cut_sites = tuple(
            None if sl is None else sites.site("cut", p, o, fam.out_avals[i].dtype, dev)
            for sl, p, o, i in zip(self.out_slices, padded_out, out_shapes, kept, strict=True))
    self.timed = bool(fam.observers) or (opts.serving and self.sync)
    self.check = opts.check
    self.n = 0  # calls served, summed into the counters by stats()
    self.lock = ctx.counters.lock
    self.padded_elems = entry.padded_elems
    self.true_elems = true_elems
    self.larger = bkey != own  # served on a larger bucket than its own (still compiling)
    # (policy, size) of each learning policy that sees the kept executor's calls (Family)
    self.watch = fam.watch_items(sizes) if fam.watched_plan else None
    self.bucket_id = (fam.fid, bkey)
    self.once = False  # not kept (Dispatcher.resolve): its count folds in as its call ends
    self.lru = ctx.lru  # max_executables: the cache whose recency each run renews

  def run(self, vals):
    """pad -> run -> unpad -> count.  ``vals``: the dynamic arguments (top-level path) or
    the flat leaves."""
    fam = self.fam
    taken = None
    if self.lru is not None:  # (a lock and an OrderedDict move: 61 vs 59 us a tiny call, 2-core)
      self.lru.touch(self.bucket_id)
    for p, n in self.watch if self.watch is not None and self.n else ():  # (1st: resolve's)
      p.observe(n)
    if self.shard is not None:  # placed with their shardings, straight from the host
      args = self.shard.pad(fam, vals, self.full_shapes, self.in_shapes, fam.mode == "trust")
    elif self.pads:
      args = list(vals)
      copies = None
      for k, (pos, shape, target, prefix, pool) in enumerate(self.pads):
        x = vals[pos]
        if type(x) is np.ndarray:  # a zero-padded host buffer: see pad_leaf
          if pool is not None and self.sync:  # reused (_placement.HostBuffers)
            dev, kind = (None, None) if pool is True or x.dtype != pool[1] else pool[::2]
            buf, src = fam.host_buffers.take(target, x.dtype, prefix, dev, self.zero_pad, kind)
            taken = (taken or []) + [(target, x.dtype, buf, src, prefix)]
            if src is None and shape == target:  # no padding, no pair for it: as it came
              args[pos] = x
              continue
            _placement.copy_into(buf, prefix, x)  # (>= 8 MiB, 8+ cores: over 4 threads)
            if src is None:
              args[pos] = buf
            elif type(src) is _cuda.Slot:  # the driver's copy, below (jit/_cuda.py)
              args[pos] = src.array
              copies = (copies or []) + [src]
            else:  # pinned (>= 2 MiB on a GPU): the transfer alone, no staging copy (H100,
              # a 296x528 image batch: 7.19 -> 4.37 ms a ResNet-18 request)
              args[pos] = jax.device_put(src, _placement.device_sharding(dev))
          else:
            buf = np.zeros(target, x.dtype)
            buf[prefix] = x
            args[pos] = buf
        elif self.pad_sites is not None and self.pad_sites[k] is not None and (
            type(x) is not Padded):
          args[pos] = self.pad_sites[k].run(x, pad_leaf, shape, target)
        else:
          args[pos] = pad_leaf(x, shape, target)
      if copies is not None:
        fam.host_buffers.copy(copies, args)
    else:
      args = vals
    if self.casts is not None:
      args = self.casts.apply(args)
    if self.tree is not None:
      args = tree_unflatten(self.tree, args)
    if self.timed:
      t0 = time.perf_counter()
    try:
      outs = (self.exe(self.dev_sizes, *args) if self.dev_sizes is not None
              else self.exe(*args))
    except ValueError as e:  # (no cost on the way through: Python 3.11's zero-cost try)
      if fam.shard is None and _placement.is_wrong_device(e):
        raise _placement.wrong_device(fam, self.exe, vals) from e
      raise
    if self.sync:  # a host request: numpy results, cut to the exact shapes (views)
      if self.reads:
        res = [h if sl is None else h[sl] for h, sl in zip(
            _placement.read_host(fam, outs, self.numpy_out), self.out_slices, strict=True)]
      elif self.single and self.plain_out:
        h = np.asarray(outs[0])
        sl = self.out_slices[0]
        res = h if sl is None else h[sl]
      else:
        res = [h if sl is None else h[sl] for h, sl in zip(
            to_host(outs, self.numpy_out), self.out_slices, strict=True)]
      if taken is not None:  # the computation is done: its padded inputs can be reused
        for item in taken:
          fam.host_buffers.give(*item)
    elif self.as_is:  # outputs at their own shapes, where they are (the listcomp below: ~7 us)
      res = outs if type(outs) is list else list(outs)
    elif self.return_padded:
      if self.to_device:
        outs = [_placement.to_device(o) for o in outs]
      res = [Padded._of(o, s) if dyn else o
             for o, s, dyn in zip(outs, self.out_shapes, self.out_dynamic, strict=True)]
    else:  # a sliced output: through the host, or cut on the device once paid (cut_sites)
      mv = _placement.to_device if self.to_device else None
      cuts = self.cut_sites
      res = [(o if mv is None else mv(o)) if sl is None
             else self._unpad_device(o, s) if cuts is None or cuts[i] is None
             else cuts[i].run(o, self._unpad_device, s)
             for i, (o, sl, s) in enumerate(zip(outs, self.out_slices, self.out_shapes,
                                                strict=True))]
    if self.timed:
      fam.record_time(self.bkey, time.perf_counter() - t0)
    if self.fwd is not None:
      res = self.fwd.insert(res, vals)
    with self.lock:
      self.n += 1
    if self.once:  # not registered (Counters.register): its count goes in now
      self.ctx.counters.fold(self)
    fam.tuple_hist[self.sizes] += 1
    if type(res) is list:
      out = res[0] if self.single else tree_unflatten(self.out_tree, res)
    else:
      out = res
    if self.check:
      leaves = tree_flatten(vals, is_leaf=is_padded)[0] if self.top else vals
      self.ctx.maybe_check(fam, leaves, out)
    return out

  def _unpad_device(self, o, shape):
    if self.shard is not None:
      return self.shard.unpad(o, shape, self.ctx.devpads)
    # The host route: a sync plus two copies (~0.1-0.3 ms on H100).  A shape that keeps coming
    # back is cut on the device instead, once its trips pay for the slice's compile (~70 ms on
    # H100): ``cut_sites``, jit/_devpad.py.
    return jax.device_put(np.asarray(o)[tuple(slice(0, n) for n in shape)])


class Dispatcher:
  """Everything behind one ``Wrapped``: its families, cache, compiler and counters."""

  # Families may trace under guards they infer (``t >= 3``): ``resolve`` runs the sizes
  # outside them exact (``Family.guard_ok``).
  checks_guards = True

  def __init__(self, opts, binder, name: str):
    self.opts = opts
    self.binder = binder
    self.name = name
    self.policies = Policies(opts.buckets, lambda: opts.serving and _serving.on_gpu())
    self.cache = ExecutableCache(opts.max_executables, name=name, log=config.log_compiles)
    self.counters = Counters()
    self.devpads = _devpad.Sites()  # device arrays padded / outputs cut on the device
    self.compiler = Compiler(self)
    self.fallbacks: list[str] = []
    self.families: dict = {}  # full key -> Family (the latest one, with dims="auto")
    self.all_families: dict[int, Family] = {}
    self.fast: dict = {}  # (static, treedef) -> (last family used, its StaticLeaves or None)
    self.statics: dict = {}  # family id -> _args.StaticLeaves (leaves that are not arrays)
    self.static_scalars: set = set()  # (static, treedef) whose Python numbers are static
    self.top: dict = {}  # static key -> family with the top-level hot path
    self.padded_trees: set = set()  # treedefs (flattened through Padded) that hold a Padded
    self.family_lock = threading.Lock()
    self._fids = itertools.count()
    self._auto_state: dict = {}
    self._sizes_on_device: dict = {}
    # Executors are kept where a size's bucket moves only when the family is told (Family.
    # keeps_executors); under max_executables each run renews its bucket (Executor.lru).
    self.lru = self.cache if opts.max_executables is not None else None

  def note_fallback(self, reason: str) -> None:
    self.fallbacks.append(reason)

  # -- the general path --------------------------------------------------------------------
  def call(self, static, dyn):
    """A call that the top-level path did not serve: flatten, find the family, run."""
    leaves, treedef = tree_flatten(dyn)
    # (a treedef lookup hashes and compares the whole structure: ~10 us for 200 leaves)
    if self.padded_trees and treedef in self.padded_trees:  # a Padded inside: keep it whole
      leaves, treedef = tree_flatten(dyn, is_leaf=is_padded)
    fam, statics = self.fast.get((static, treedef), (None, None))
    run_leaves = leaves if statics is None else statics.strip(leaves)  # a function leaf...
    if fam is not None and run_leaves is not None and fam.accepts(run_leaves):
      # Leaves with dims checked here; a changed other leaf by the executable, then slow path.
      try:
        return self.run(fam, run_leaves)
      except TypeError as e:
        if not _args.is_signature_error(e):
          raise
    if any(map(is_padded, jax.tree_util.tree_leaves(dyn, is_leaf=is_padded))):
      self.padded_trees.add(tree_flatten(dyn)[1])
      leaves, treedef = tree_flatten(dyn, is_leaf=is_padded)
    if _args.has_tracer(leaves):  # not a family of traced values: see ``inline``
      return self.inline(static, dyn)
    fam = self.family(static, dyn, leaves, treedef)
    statics = self.statics.get(fam.fid)
    self.fast[(static, treedef)] = (fam, statics)
    if fam.top is not None and statics is None:
      self.top[static] = fam
    return self.run(fam, self.arg_leaves(fam, leaves))

  def arg_leaves(self, fam, leaves) -> list:
    """The call's flat leaves as ``fam``'s executables take them: without its static leaves."""
    statics = self.statics.get(fam.fid)
    return leaves if statics is None else statics.keep(leaves)

  def inline(self, static, dyn):
    """A call with traced arguments (inside jax.jit/grad/vmap or another dynjax trace): traced
    into the caller's computation, as a nested ``jax.jit``; the outer trace compiles."""
    args, kwargs = self.binder.call_args(static, dyn)
    return self.binder.fun(*args, **kwargs)

  def run(self, fam: Family, leaves):
    """Runs one call of ``fam`` given its flat leaves, by the family's mode."""
    if fam.mode in PADDED_MODES:
      device = padded_in = False
      shapes = []
      for i in fam.spec_idx:
        x = leaves[i]
        if type(x) is np.ndarray and x.dtype.itemsize >= 8 and x.dtype != fam.avals[i].dtype:
          fam.note_converted(i, x.dtype, fam.avals[i].dtype)
        device = device or on_device(x)
        padded_in = padded_in or type(x) is Padded
        shapes.append(getattr(x, "shape", ()))
      key = (tuple(shapes), device, padded_in, "flat")  # top-level keys have no 4th item
      ex = fam.executors.get(key)
      if ex is None or ex.gen != fam.gen:
        ex = self.resolve(fam, leaves, False, key)
        if ex is None:
          return self.run_exact(fam, leaves, device)
      return ex.run(leaves)
    device = any(on_device(leaves[i]) for i in fam.dyn_leaves)
    if fam.mode == "program":
      return _programs.run_program(self, fam, leaves, device)
    return self.run_exact(fam, leaves, device)

  # -- a miss: plan the bucket, get the entry, build the executor --------------------------
  def resolve(self, fam: Family, vals, top: bool, key) -> Executor | None:
    """The executor of a call whose key has none (or a stale one); None: run exact."""
    shapes_t, device, padded_in = key[:3]
    shapes = dict(zip(fam.spec_idx, shapes_t, strict=True))
    sizes = _symbolic.solve_sizes(fam.sig, shapes)
    if self.opts.async_compile and not fam.preloaded:
      self.compiler.preload(fam, sizes)  # stored buckets join the plan first
    own, out_shapes, true_elems = fam.size_info(sizes)
    if own is None:  # overflow="exact", a size of 0, or outside the inferred guards
      if not fam.guard_ok(sizes):
        fam.outside_guards(sizes)  # raises under on_fallback="error"
      fam.tuple_hist[sizes] += 1
      return None
    try:
      entry, bkey, ready = self.compiler.entry_for(fam, own)
    except PaddingUnsupportedError as e:  # this bucket's plan refused (the probe's did not)
      fam.fall_back(f"at bucket {own}: {e}")
      return None
    if not ready:
      self.counters.miss()
    dev_sizes = None
    if fam.mode == "auto":
      # A host request sends its sizes with its (numpy) inputs in the same call: a separate
      # device_put per new size tuple cost ~130 us of Python on a miss (2-core CPU box).
      dev_sizes = (np.asarray(sizes, np.int32) if not device and fam.shard is None
                   else self.sizes_vector(fam, sizes))
    ex = Executor(self, fam, sizes, own, bkey, entry, shapes, device, top, dev_sizes,
                  out_shapes, true_elems, padded_in)
    if fam.keeps_executors:
      if fam.swept != fam.gen:  # once a gen: replaced executors (and executables) go now
        fam.swept = fam.gen
        fam.executors = {k: e for k, e in list(fam.executors.items()) if e.gen == fam.gen}
        self.counters.sweep()
      if len(fam.executors) > 4096:
        fam.executors.clear()
      fam.executors[key] = ex
      self.counters.register(ex)  # counted on read (Counters.register lets replaced ones go)
    else:
      ex.once = True
    return ex

  def sizes_vector(self, fam: Family, sizes):
    """The true sizes on the device, once per distinct tuple (a dict hit afterwards), not a
    fresh host->device copy on every call."""
    dev = self._sizes_on_device.get(sizes)
    if dev is None or (fam.shard is not None and dev.sharding != fam.shard.replicated):
      if len(self._sizes_on_device) > 4096:
        self._sizes_on_device.clear()
      dev = self._sizes_on_device[sizes] = (
          jax.device_put(np.asarray(sizes, np.int32)) if fam.shard is None
          else fam.shard.put_sizes(sizes))  # replicated over the mesh: no per-call reshard
    return dev

  # -- unpadded runs -----------------------------------------------------------------------
  def run_exact(self, fam: Family, leaves, device: bool):
    leaves = [x.unpad() if is_padded(x) else x for x in leaves]
    try:
      exe = fam.exact_executable(leaves)
    except Exception as e:
      from dynjax.control._frontend import NeedsProgram
      if not isinstance(e, NeedsProgram):
        raise
      # A dynjax control op that has an XLA form symbolically (a cond whose branches agree
      # on n) but not at these sizes (at n = 0 they differ): this call runs op by op.
      return _programs.op_by_op(self, fam, leaves, device)
    flat = exe(*leaves)
    tree = fam.flat_fun.out_tree
    if not device:  # as the padded path: with dims numpy, without dims device arrays
      dyn = fam.out_dynamic
      flat = _placement.exact_to_host(
          fam, flat, dyn if fam.sig.var_order and len(dyn) == len(flat) else None)
    self.counters.unpadded(fam.fid, "exact",
                           sum(math.prod(np.shape(leaves[i])) for i in fam.dyn_leaves),
                           not device)
    if self.opts.return_padded:
      flat = [Padded(o, np.shape(o)) for o in flat]
    return tree_unflatten(tree, flat)

  def maybe_check(self, fam: Family, leaves, result) -> None:
    """``check=True``: every ``DYNJAX_CHECK_EVERY``-th call is run exact and compared."""
    with self.counters.lock:
      self.counters.checks += 1
      n = self.counters.checks
    if (n - 1) % config.check_every:
      return
    exact_leaves = [x.unpad() if is_padded(x) else np.asarray(x) for x in leaves]
    want = to_host(fam.exact_executable(exact_leaves)(*exact_leaves))
    got, _ = tree_flatten(result, is_leaf=is_padded)
    got = [g.unpad() if is_padded(g) else np.asarray(g) for g in got]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
      w = np.asarray(w)
      ok = g.shape == w.shape and (
          np.allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)
          if np.issubdtype(w.dtype, np.inexact) else np.array_equal(g, w))
      if not ok:
        diff = (f"max abs diff {np.max(np.abs(g.astype(np.float64) - w)):.3g}"
                if g.shape == w.shape else f"shape {g.shape} vs {w.shape}")
        raise PaddingMismatchError(
            f"{self.name}: check=True found output {i} of the padded executable differs "
            f"from the exact-shape function ({diff}). Please report this with the function; "
            "padding='exact' avoids it meanwhile.")

  # -- families ----------------------------------------------------------------------------
  def family(self, static, dyn, leaves, treedef) -> Family:
    """The family of a call's arguments, found or built.  Where the function cannot be
    traced with its Python numbers traced (as jax.jit traces them) but can with them static
    (an Equinox module's ``if self.inference:``, a float field the optimizer state left
    out), they are static, as ``eqx.filter_jit`` holds them: one family per value."""
    scalars = (static, treedef) in self.static_scalars
    try:
      return self._family(static, dyn, leaves, treedef, scalars)
    except Exception as e:
      if scalars or not any(type(x) in _args.PY_SCALARS for x in leaves) or (
          _args.has_tracer(leaves)):
        raise
      try:
        fam = self._family(static, dyn, leaves, treedef, True)
      except Exception:  # noqa: BLE001 - not the cause: the first error is the function's
        raise e from None
      self.static_scalars.add((static, treedef))
      return fam

  def _family(self, static, dyn, leaves, treedef, scalars: bool) -> Family:
    # The full key (slow path): dtype and rank of every leaf, plus the whole shape of leaves
    # without dims (a parameter of a new shape is a new family, as a retrace in jax.jit).
    # Leaves that are not arrays (an Equinox module's activation function) are static: the
    # family is keyed by their values and traces and runs the other leaves (eqx.filter_jit).
    statics = _args.StaticLeaves.find(self.name, self.binder, dyn, leaves, scalars)
    run_tree = treedef
    if statics is not None:
      leaves, treedef, run_tree = statics.keep(leaves), statics.fun_tree, statics.exec_tree
    avals = [_args.aval(x) for x in leaves]
    auto = self.opts.dims == "auto"
    specs = None if auto else self.binder.leaf_specs(self.opts.dims, dyn)
    if statics is not None and specs is not None:
      self._no_dims_on_static(specs, statics, dyn)
      specs = statics.keep(specs)
    static_shapes = () if auto else tuple(
        tuple(a.shape) for text, a in zip(specs, avals, strict=True) if text is None)
    key = (static, treedef, tuple(map(leaf_key, leaves)), static_shapes)
    fam = self.families.get(key)
    if fam is not None and not auto:
      return fam
    with self.family_lock:
      fam = self.families.get(key)
      if auto:
        state = self._auto_state.get(key)
        shapes = [a.shape for a in avals]
        if fam is not None and state is not None and _args.auto_fits(state, shapes):
          return fam
        state = self._auto_state[key] = _args.auto_promote(state, shapes)
        specs = _args.auto_specs(state)
      paths = self.binder.leaf_paths(dyn)
      if statics is not None:
        paths = statics.keep(paths)
      if not auto and fam is not None:
        return fam
      fam = Family(self, self.binder.flat_fun(static, treedef, scalars), paths, specs, avals,
                   run_tree, key, next(self._fids), first_leaves=leaves)
      if statics is not None:
        self.statics[fam.fid] = statics
      for i, (x, a) in enumerate(zip(leaves, avals, strict=True)):
        if type(x) is np.ndarray and x.dtype != a.dtype:
          fam.note_converted(i, x.dtype, a.dtype)
      self.families[key] = fam
      self.all_families[fam.fid] = self.cache.owners[fam.fid] = fam
      return fam

  def _no_dims_on_static(self, specs, statics, dyn) -> None:
    # A leaf with dims must be an array: the same error as a warm function's (``aval``).
    for i, x in statics.items:
      if specs[i]:
        _args.aval(x)

  def clear(self) -> None:
    with self.family_lock:
      self.families.clear()
      self.fast.clear()
      self.top.clear()
      self.statics.clear()
      self.static_scalars.clear()
      self._auto_state.clear()
      self.cache.clear()
      for fam in self.all_families.values():
        fam.executors.clear()
        fam.gen += 1


def top_key(fam: Family, dyn):
  """The executor key of a call through the top-level path (the shapes of the arguments with
  dims, host or device, Padded among them), or None: the general path decides."""
  if fam.mode not in PADDED_MODES:
    return None  # fell back to exact after a bucket's plan refused
  shapes = ()
  device = padded_in = False
  for pos, li, lkey in fam.top:
    x = dyn[pos]
    t = type(x)
    if t is np.ndarray:
      if x.dtype != lkey[0]:
        if _args.canonical(x.dtype) != lkey[0]:
          return None
        fam.note_converted(li, x.dtype, lkey[0])  # float64 -> float32 with x64 off
      if x.ndim != lkey[1] or lkey[2]:
        return None
    elif t is _args.ARRAY_IMPL or t is Padded:
      if leaf_key(x) != lkey:
        return None
      device = device or on_device(x)
      padded_in = padded_in or t is Padded
    else:  # scalars, lists, None, other array types: the general path checks them
      return None
    shapes += (x.shape,)
  return shapes, device, padded_in


def pad_leaf(x, shape, target):
  """One argument leaf padded to its bucket shape (a ``Padded`` of that shape passes as is).

  Host buffers are fresh on every call, never pooled: on CPU a jit call may alias a numpy
  argument instead of copying it, and the device and ``return_padded`` paths do not wait for
  the result, so a reused buffer could be overwritten while an earlier computation still
  reads it (seen as a wrong result).  ~1.5 us for (8, 37) -> (8, 64) float32 (calloc + copy).
  """
  if type(x) is Padded:
    buf = x.buffer
    if tuple(buf.shape) == target:
      return buf
    x = x.unpad()
    shape = x.shape
  if shape == target:
    return x
  if not isinstance(x, np.ndarray):
    x = np.asarray(x)  # a device array of a non-bucket shape: one host round trip
  buf = np.zeros(target, x.dtype)
  buf[tuple(slice(0, n) for n in x.shape)] = x
  return buf
