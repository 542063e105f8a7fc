"""An on-disk store of compiled bucket executables: a restarted server loads, never lowers.

JAX's persistent compilation cache is keyed by the *lowered* module, so a restarted process
must still trace and lower every bucket before the cache can answer (H100, BERT-base: 0.33 s
of GIL-bound lowering per bucket plus 0.16 s load; 3 s for six buckets).  This store is keyed
by what the build side knows *before* lowering (a fingerprint of the family's symbolic jaxpr,
constants, options and versions, plus the bucket), and holds executables serialized with
``jax.experimental.serialize_executable``: six BERT-base buckets load in 0.29 s in parallel.

Layout: ``<dir>/<fingerprint[:24]>/<bucket>.<tier>.exe`` and ``<fingerprint[:24]>/family.json``
(what the fingerprint covered, for people).  A ``.exe`` file is a pickle of ``(header, blob)``:
the header names the fingerprint, bucket, tier and input avals the executable was compiled
for and the sha256 of ``blob`` (the serialized executable and its pytree defs).  A file is
verified before its blob is unpickled: one that was swapped with another bucket's, copied
from another family, truncated or corrupted, or written by an older dynjax is discarded with
one warning and compiled again, and the new executable replaces it on disk (the store heals).
Writes go to a temporary file first and are renamed into place, so a reader never sees a
half-written file.

Loading runs code from the file (pickle + XLA executables): only point ``cache_dir`` at a
directory you trust, as with any executable cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import tempfile
import threading
import warnings

import jax
import numpy as np

from dynjax import _jax_private
from dynjax._fingerprint import fingerprint_parts, versions
from dynjax.jit import _placement

_FORMAT = 2

logger = logging.getLogger("dynjax")


def _bucket_name(bkey: tuple) -> str:
  return "x".join(str(int(b)) for b in bkey) or "scalar"


class ExecutableStore:
  """Serialized executables of one family (``fingerprint``) under ``root``."""

  def __init__(self, root: str, fingerprint: str, describe: dict | None = None):
    self.root = root
    self.fingerprint = fingerprint
    self.dir = os.path.join(root, fingerprint[:24])
    self._lock = threading.Lock()
    self.saved = 0
    self.loaded = 0
    self.load_errors = 0
    self.write_failed = False  # warned once: a read-only or full cache_dir
    self._described = describe

  def path(self, bkey: tuple, tier: int) -> str:
    return os.path.join(self.dir, f"{_bucket_name(bkey)}.{tier}.exe")

  def stored(self) -> list[tuple[tuple[int, ...], int]]:
    """(bucket, tier) of every stored executable of this family."""
    try:
      names = os.listdir(self.dir)
    except OSError:
      return []
    out = []
    for n in names:
      parts = n.split(".")
      if len(parts) != 3 or parts[2] != "exe":
        continue
      try:
        bkey = tuple(int(x) for x in parts[0].split("x")) if parts[0] != "scalar" else ()
        out.append((bkey, int(parts[1])))
      except ValueError:
        continue
    return sorted(out)

  def _header(self, bkey: tuple, tier: int, in_avals) -> dict:
    return {"format": _FORMAT, "fingerprint": self.fingerprint,
            "bucket": tuple(int(b) for b in bkey), "tier": int(tier),
            "in_avals": [list(a) for a in in_avals]}

  def save(self, bkey: tuple, tier: int, compiled, in_avals=()) -> bool:
    """Serializes ``compiled`` (a ``jax.stages.Compiled`` for ``in_avals``, a list of
    ``(shape, dtype name)``); False when it cannot be."""
    from jax.experimental import serialize_executable

    try:
      payload, in_tree, out_tree = serialize_executable.serialize(compiled)
      devices = _device_ids(compiled)
      inner = pickle.dumps((payload, in_tree, out_tree, devices),
                           protocol=pickle.HIGHEST_PROTOCOL)
      header = self._header(bkey, tier, in_avals)
      header["sha256"] = hashlib.sha256(inner).hexdigest()
      blob = pickle.dumps((header, inner), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - e.g. executables with constants; not fatal
      logger.info("dynjax: executable of bucket %s not stored (%s: %s)", bkey,
                  type(e).__name__, e)
      return False
    try:
      os.makedirs(self.dir, exist_ok=True)
      with self._lock:
        if self._described is not None:
          with open(os.path.join(self.dir, "family.json"), "w") as fh:
            json.dump(self._described, fh, indent=1, default=str)
          self._described = None
      fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
      with os.fdopen(fd, "wb") as fh:
        fh.write(blob)
      os.replace(tmp, self.path(bkey, tier))
    except OSError as e:
      with self._lock:
        first, self.write_failed = not self.write_failed, True
      if first:  # one warning a store, not one a bucket
        warnings.warn(f"dynjax: cannot write the executable store {self.dir} ({e}): these "
                      "executables compile again in the next process. Make cache_dir "
                      "writable, or pass another one", stacklevel=2)
      return False
    with self._lock:
      self.saved += 1
    return True

  def drop_below(self, bkey: tuple, tier: int) -> int:
    """Removes the bucket's stored executables of tiers below ``tier`` (replaced by a better
    one); returns how many."""
    n = 0
    for b, t in self.stored():
      if b == tuple(bkey) and t < tier:
        try:
          os.remove(self.path(b, t))
          n += 1
        except OSError:  # another process removed it first
          pass
    return n

  def load(self, bkey: tuple, tier: int, in_avals=(), also=None):
    """The stored ``jax.stages.Compiled`` for (bucket, tier) compiled for ``in_avals`` (or
    ``also``: a bucket that lowered without the family's casts once), or None: missing, or
    discarded with a warning because it does not fit (see the module)."""
    from jax.experimental import serialize_executable

    path = self.path(bkey, tier)
    try:
      with open(path, "rb") as fh:
        raw = fh.read()
    except FileNotFoundError:
      return None
    except OSError as e:
      return self._discard(path, bkey, f"unreadable ({e})")
    why = None
    try:
      header, inner = pickle.loads(raw)
      want = self._header(bkey, tier, in_avals)
      if not isinstance(header, dict) or header.get("format") != _FORMAT:
        why = "written by another dynjax version"
      elif header.get("fingerprint") != self.fingerprint:
        why = "compiled for another function or configuration (copied from another family)"
      elif tuple(header.get("bucket", ())) != want["bucket"] or header.get("tier") != tier:
        why = (f"compiled for bucket {tuple(header.get('bucket', ()))} tier "
               f"{header.get('tier')} (swapped or renamed)")
      elif in_avals and header.get("in_avals") != want["in_avals"] and (
          also is None or header.get("in_avals") != [list(a) for a in also]):
        why = f"compiled for inputs {header.get('in_avals')}, not {want['in_avals']}"
      elif hashlib.sha256(inner).hexdigest() != header.get("sha256"):
        why = "its checksum does not match (truncated or corrupted)"
    except Exception as e:  # noqa: BLE001 - not our format at all
      why = f"not a dynjax executable file ({type(e).__name__})"
    if why is not None:
      return self._discard(path, bkey, why)
    try:
      payload, in_tree, out_tree, device_ids = pickle.loads(inner)
      import jax

      by_id = {d.id: d for d in jax.devices()}
      exe = serialize_executable.deserialize_and_load(
          payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
    except Exception as e:  # noqa: BLE001 - a stale or broken file is a cache miss
      return self._discard(path, bkey, f"did not load ({type(e).__name__}: {e})")
    with self._lock:
      self.loaded += 1
    return exe

  def _discard(self, path: str, bkey: tuple, why: str):
    """One warning; the bucket compiles again and its save replaces the file."""
    with self._lock:
      self.load_errors += 1
    warnings.warn(f"dynjax: stored executable {path} for bucket {tuple(bkey)} is discarded: "
                  f"{why}; the bucket is compiled again (and stored again where the store "
                  "is writable)", stacklevel=2)
    try:
      os.remove(path)
    except OSError:
      pass
    return None


class FirstRun:
  """A stored executable until its first run succeeds.

  An executable can load and still fail to run: jax 0.11.2 on CPU, in a process that had
  compiled the same function, sometimes raised ``NOT_FOUND: Function add_tanh_fusion not
  found`` on a deserialized executable's first call (once, in a full run of the suite).
  A first run that raises a ``JaxRuntimeError`` calls ``rebuild()`` (the bucket compiled
  again, its file replaced), warns, and runs the call on the new executable; if that fails
  too, its error is raised.  Once a run succeeds, ``proven(exe)`` hands the plain executable
  back (the caller takes this wrapper out of its hot path); until then each call costs one
  flag check more.
  """

  __slots__ = ("exe", "rebuild", "proven", "done", "lock", "what")

  def __init__(self, exe, rebuild, proven, what: str):
    self.exe = exe
    self.rebuild = rebuild
    self.proven = proven
    self.done = False
    self.lock = threading.Lock()
    self.what = what

  def __call__(self, *args, **kwargs):
    if self.done:
      return self.exe(*args, **kwargs)
    exe = self.exe
    try:
      out = exe(*args, **kwargs)
    except jax.errors.JaxRuntimeError as e:
      with self.lock:
        if self.exe is exe:  # not rebuilt by another thread meanwhile
          warnings.warn(f"dynjax: stored executable {self.what} failed its first run "
                        f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); "
                        "the bucket is compiled again (and stored again where the store is "
                        "writable)", stacklevel=2)
          self.exe = self.rebuild()
      out = self.exe(*args, **kwargs)
    if not self.done:
      self.done = True
      self.proven(self.exe)
    return out

  def __getattr__(self, name):  # as_text(), input_shardings, ... of the executable
    return getattr(self.exe, name)


def _device_ids(compiled) -> list[int]:
  """Ids of the devices the executable runs on (in the order of its device assignment)."""
  import jax

  for sh in jax.tree_util.tree_leaves(compiled.input_shardings):
    return sorted(d.id for d in sh.device_set)  # the store holds one-device executables
  return [jax.devices()[0].id]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def family_parts(fam) -> dict:
  """Everything a stored executable depends on, known before lowering.

  The symbolic jaxpr (memory addresses in reprs removed) and a hash of its constants, the
  signature, padding mode, donation, compiler options, jax/jaxlib/dynjax versions (dynjax as
  a hash of its own source, so a changed padding pass never reuses an executable), the
  backend and device, the jax configuration that changes lowering, and ``XLA_FLAGS``.
  """
  consts = hashlib.sha256()
  for c in fam.jaxpr.consts:
    a = np.asarray(c)
    consts.update(f"{a.dtype}{a.shape}".encode())
    consts.update(np.ascontiguousarray(a).tobytes())
  opts = fam.ctx.opts
  dev = jax.devices()[0]
  return {
      "jaxpr": _ADDRESS.sub("", str(fam.jaxpr.jaxpr)),
      "consts": consts.hexdigest(),
      "mode": fam.mode,
      "vars": fam.sig.var_order,
      "specs": [(p, None if s is None else s.text) for p, s in
                zip(fam.leaf_paths, fam.sig.leaves, strict=True)],
      # A leaf with dims is keyed by its rank (its spec is in "specs"), never by the sizes
      # of the call that traced it: a restart whose first request has another length (or a
      # warmup from shapes) finds the executables (before, it missed and compiled them all).
      "avals": [(str(a.dtype), tuple(a.shape) if s is None else len(a.shape), a.weak_type)
                for a, s in zip(fam.avals, fam.sig.leaves, strict=True)],
      "treedef": str(fam.treedef),
      "donate": opts.donate_argnames,
      "compiler_options": opts.compiler_options,
      "attention": opts.attention,
      "ragged_dot": opts.ragged_dot,
      "casts": sorted((i, str(d)) for i, d in fam.casts.items()),
      "host_outputs": fam.host_out,
      "versions": versions(),
      "backend": (jax.default_backend(), dev.device_kind, jax.device_count()),
      "config": _jax_private.lowering_config(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def family_store(fam, padded: bool) -> ExecutableStore | None:
  """The executable store of a family, or None (no ``cache_dir``, sharded, not ``padded``, or
  a fingerprint that cannot be taken)."""
  root = fam.ctx.opts.store_root
  if root is None or not fam.structured or not padded:
    return None
  try:
    parts = family_parts(fam)
  except Exception as e:  # noqa: BLE001 - no store, never a wrong executable
    logger.info("dynjax: %s is not stored (fingerprint failed: %s: %s)",
                fam.name, type(e).__name__, e)
    return None
  store = _store_of(fam, root, parts)
  other = _placement.alternative(fam)
  if other is not None and not store.stored():
    alt = _store_of(fam, root, {**parts, "host_outputs": other})
    if alt.stored():  # a restart serves what it has (before any of its buckets lowers)
      fam.host_out, fam.reads_out = other, False  # (a READS plan's alternative is pinned)
      fam.host_out_reason += (f"; its cache_dir holds executables with "
                              f"{'pinned host' if other else 'device'} outputs only")
      logger.info("dynjax: %s takes the output placement its cache_dir holds: %s", fam.name,
                  fam.host_out_reason)
      return alt
  return store


def _store_of(fam, root: str, parts: dict) -> ExecutableStore:
  fp = fingerprint_parts(parts)
  describe = {"function": fam.name, "fingerprint": fp,
              **{k: (v if len(str(v)) < 400 else str(v)[:400] + "...")
                 for k, v in parts.items() if k != "consts"}}
  return ExecutableStore(root, fp, describe)
