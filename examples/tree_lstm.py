"""Child-sum Tree-LSTM over ASTs of standard-library functions, batched by dynjax.recursive.

Run: ``python examples/tree_lstm.py`` (CPU, < 1 min).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json.decoder
import os
import sys
import textwrap
import time

import jax
import numpy as np

# The models and data are importable modules of examples/ (the repository root, not in the wheel).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import treelstm_model as T  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Tree:
  types: tuple
  children: tuple


def tree_of(fn, type_ids):
  types, kids = [], []

  def visit(n):
    i = len(types)
    types.append(type_ids.setdefault(type(n).__name__, len(type_ids)))
    kids.append([])
    for c in ast.iter_child_nodes(n):
      kids[i].append(visit(c))
    return i

  visit(fn)
  return Tree(tuple(types), tuple(map(tuple, kids)))


def trees_of(module, type_ids):
  fns = [n for n in ast.walk(ast.parse(inspect.getsource(module)))
         if isinstance(n, ast.FunctionDef)]
  return [t for t in (tree_of(f, type_ids) for f in fns) if len(t.types) <= 150]


type_ids: dict = {}
trees = trees_of(textwrap, type_ids) + trees_of(json.decoder, type_ids)
params = T.init_params(64, d_in=16, d_h=32)
print(f"{len(trees)} trees, {sum(len(t.types) for t in trees)} nodes")

t0 = time.perf_counter()
out = T.encode.batch([(params, t) for t in trees])
jax.block_until_ready(out)
cold = time.perf_counter() - t0
t0 = time.perf_counter()
out = T.encode.batch([(params, t) for t in trees])
jax.block_until_ready(out)
warm = time.perf_counter() - t0
(meta,) = T.encode.last_stats.batches
print(f"dynjax.recursive: {meta['nodes']} cell calls in {meta['levels']} levels ran as "
      f"{meta['groups']} batched executable calls; cold {cold:.2f} s, warm {warm * 1e3:.1f} ms, "
      f"host syncs {T.encode.last_stats.host_syncs}")

T.encode_per_node(params, trees[0])
t0 = time.perf_counter()
ref = [T.encode_per_node(params, t) for t in trees]
jax.block_until_ready(ref)
dt = time.perf_counter() - t0
print(f"jax.jit per node: {meta['nodes']} executable calls, {dt * 1e3:.1f} ms")
err = max(float(np.abs(np.asarray(a[0]) - np.asarray(b[0])).max()) for a, b in zip(out, ref, strict=True))
print(f"max |h_dynjax - h_per_node| = {err:.2e}")
print("first lines of the batch program:")
print("\n".join(T.encode.last_programs[0].as_text().splitlines()[:8]))
