"""Small real trees for tests: ASTs of a few standard-library functions (parsed with ``ast``)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import numpy as np


@dataclasses.dataclass(frozen=True)
class SmallTree:
  name: str
  types: tuple[int, ...]
  children: tuple[tuple[int, ...], ...]

  @property
  def size(self) -> int:
    return len(self.types)


def _tree(fn_node: ast.AST, name: str, type_ids: dict[str, int]) -> SmallTree:
  types, children = [], []

  def visit(n):
    i = len(types)
    types.append(type_ids.setdefault(type(n).__name__, len(type_ids)))
    children.append([])
    for c in ast.iter_child_nodes(n):
      children[i].append(visit(c))
    return i

  visit(fn_node)
  return SmallTree(name, tuple(types), tuple(tuple(c) for c in children))


def stdlib_trees(modules=("textwrap", "json.decoder", "fnmatch"), max_nodes=120):
  """Function ASTs of a few stdlib modules, sorted walk, deterministic."""
  import importlib

  type_ids: dict[str, int] = {}
  out = []
  for mod in modules:
    src = inspect.getsource(importlib.import_module(mod))
    for n in ast.walk(ast.parse(src)):
      if isinstance(n, ast.FunctionDef):
        t = _tree(n, f"{mod}:{n.name}", type_ids)
        if t.size <= max_nodes:
          out.append(t)
  return out, 64


@dataclasses.dataclass(frozen=True, eq=False)
class BinTree:
  """A tree in the first-child / next-sibling form (what ``examples.data.Tree`` has)."""

  name: str
  types: np.ndarray
  first_child: np.ndarray
  next_sibling: np.ndarray

  @property
  def size(self) -> int:
    return len(self.types)


def binarize(t: SmallTree) -> BinTree:
  n = t.size
  first, nxt = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
  for i, kids in enumerate(t.children):
    if kids:
      first[i] = kids[0]
    for a, b in zip(kids[:-1], kids[1:], strict=True):
      nxt[a] = b
  return BinTree(t.name, np.asarray(t.types, np.int32), first, nxt)


ARITY_MODULES = ("textwrap", "json.decoder", "fnmatch", "shlex", "colorsys", "heapq",
                 "calendar", "bisect")


def binary_trees(max_nodes=60):
  """83 binarized function ASTs (2,580 nodes; type ids < 96) for the arity-cell tests."""
  trees, _ = stdlib_trees(ARITY_MODULES, max_nodes=max_nodes)
  return [binarize(t) for t in trees], 96
