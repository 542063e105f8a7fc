"""Fingerprints of what a stored artifact depends on: named parts hashed stably, and the
versions that decide what dynjax builds (jax, jaxlib, dynjax's own source, the jax
configuration that changes lowering).

Two on-disk caches key their files with these: the executable store (``jit._store``: compiled
bucket executables) and the kept GPU kernels (``route._once``: exported Mosaic GPU kernels).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Hashable

import jax

from dynjax import _jax_private


def fingerprint_parts(parts: dict[str, Hashable | str]) -> str:
  """A stable sha256 over named text parts (sorted by name)."""
  h = hashlib.sha256()
  for k in sorted(parts):
    h.update(k.encode())
    h.update(b"\0")
    v = parts[k]
    h.update(v if isinstance(v, bytes) else str(v).encode())
    h.update(b"\1")
  return h.hexdigest()


_SOURCE_HASH: list[str] = []


def dynjax_source_hash() -> str:
  """A hash of dynjax's own source: artifacts built by other dynjax code are not reused."""
  if not _SOURCE_HASH:
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(root):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
      for f in sorted(files):
        if f.endswith(".py"):
          with open(os.path.join(dirpath, f), "rb") as fh:
            h.update(os.path.relpath(os.path.join(dirpath, f), root).encode())
            h.update(fh.read())
    _SOURCE_HASH.append(h.hexdigest()[:16])
  return _SOURCE_HASH[0]


def versions() -> tuple[str, str, str]:
  """``(jax, jaxlib, dynjax source hash)``: what built an artifact."""
  return (jax.__version__, _jax_private.jaxlib_version(), dynjax_source_hash())
