"""Real data for the benchmarks, tests and examples: the Python standard library, read from
this machine's CPython.

Nobody here wrote it and it is on every machine with Python, so figures are reproducible
without network access (DESIGN.md, "Real data"):

* **Docstrings** of the standard library's modules, classes and functions
  (``ast.get_docstring``), tokenized with the regex ``\\w+|[^\\w\\s]``: their lengths give
  realistic variable sequence lengths, their texts give decode prompts (as bytes) and token ids.
* **Trees**: the ASTs of the standard library's functions (node type ids as tokens), in a
  child-list form and a binarized first-child / next-sibling form, for Tree-LSTM.

What is read: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` in a sorted walk,
skipping the directories ``test``, ``tests``, ``idle_test`` (the test suites, including
idlelib's), ``site-packages``/``dist-packages`` (third-party code) and ``__pycache__``.
``idlelib`` itself is kept: it is ordinary standard-library application code.  Files that do
not parse (a few lib2to3 fixtures in some versions) are skipped and counted.

Everything is deterministic: the walk is sorted, token ids are ``crc32(token) % vocab`` (not
Python's salted ``hash``), and sampling uses ``numpy.random.default_rng(seed)``.  The parsed
corpus is cached in memory per process (parsing the standard library takes ~4 s).  The Python
version is part of every result's metadata, because the figures change with it.

Example:
  >>> from examples import data
  >>> lengths = data.docstring_lengths()
  >>> stream = data.request_stream(100, batch=8, max_len=512, seed=0)
  >>> stream[0].tokens.shape, stream[0].lengths
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import os
import pickle
import platform
import re
import sys
import sysconfig
import threading
import warnings
import zlib
from collections.abc import Sequence

import numpy as np

TOKEN_RE = re.compile(r"\w+|[^\w\s]")
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                           "__pycache__"})
PAD_ID = 0
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_FUN_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)

# Figures DESIGN.md quotes for CPython 3.11 (our own walk may differ slightly; see WORKSPACE.md).
DESIGN_FIGURES = {
    "docstrings": 8897, "length_p10": 6, "length_p50": 18, "length_p90": 101,
    "length_p99": 379, "length_max": 1492, "distinct_lengths_le_512": 353,
    "trees": 18642, "nodes_p10": 11, "nodes_p50": 34, "nodes_p90": 153, "nodes_p99": 456,
}


def tokenize(text: str) -> list[str]:
  """Splits text into words and single punctuation characters (``\\w+|[^\\w\\s]``)."""
  return TOKEN_RE.findall(text)


def token_id(token: str, vocab: int) -> int:
  """A deterministic id in ``[1, vocab)`` for a token (0 is padding)."""
  return 1 + zlib.crc32(token.encode("utf-8")) % (vocab - 1)


@dataclasses.dataclass(frozen=True)
class Tree:
  """One function's AST as a tree of node type ids, in preorder (node 0 is the root).

  Attributes:
    name: ``"relative/path.py:qualified.name"`` of the function.
    types: int32 ``[n]`` node type ids (indices into :func:`node_types`).
    children: child lists, ``children[i]`` the preorder indices of node i's children in
      source order (the child-list form, for an N-ary Tree-LSTM).
    first_child: int32 ``[n]``, first child of each node or -1 (binarized form).
    next_sibling: int32 ``[n]``, next sibling of each node or -1 (binarized form: the left
      child of a binary node is its first child, the right child its next sibling).
    parent: int32 ``[n]``, the parent of each node or -1 for the root.
  """

  name: str
  types: np.ndarray
  children: tuple[tuple[int, ...], ...]
  first_child: np.ndarray
  next_sibling: np.ndarray
  parent: np.ndarray

  @property
  def size(self) -> int:
    return len(self.types)

  def depth(self) -> int:
    """Height of the child-list tree (a single node has depth 1)."""
    d = np.ones(self.size, np.int64)
    for i in range(self.size - 1, -1, -1):  # preorder: children come after parents
      if self.children[i]:
        d[i] = 1 + max(d[c] for c in self.children[i])
    return int(d[0])

  def binary_depth(self) -> int:
    """Height of the binarized (first-child / next-sibling) tree."""
    d = np.ones(self.size, np.int64)
    for i in range(self.size - 1, -1, -1):
      kids = [c for c in (self.first_child[i], self.next_sibling[i]) if c >= 0]
      if kids:
        d[i] = 1 + max(d[c] for c in kids)
    return int(d[0])


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The parsed standard library (see the module docstring for what is read).

  Attributes:
    docstrings: docstring texts (``ast.get_docstring``, cleaned), in walk order.
    doc_names: ``"path:qualname"`` of each docstring's owner.
    lengths: int32 token counts of the docstrings.
    trees: one :class:`Tree` per function definition (nested ones included), in walk order.
    metadata: Python version, stdlib path, exclusions, file counts.
  """

  docstrings: tuple[str, ...]
  doc_names: tuple[str, ...]
  lengths: np.ndarray
  trees: tuple[Tree, ...]
  metadata: dict


@functools.cache
def node_types() -> tuple[str, ...]:
  """Sorted names of every concrete ``ast.AST`` subclass in this Python: the tree vocabulary."""
  names = set()
  todo = [ast.AST]
  while todo:
    cls = todo.pop()
    for sub in cls.__subclasses__():
      todo.append(sub)
      if sub.__module__ == "ast" and getattr(sub, "_fields", None) is not None:
        names.add(sub.__name__)
  return tuple(sorted(names))


def _child_nodes(node: ast.AST, _fields: dict = {}) -> list[ast.AST]:  # noqa: B006 (a cache)
  """``list(ast.iter_child_nodes(node))`` without its generators.  The corpus parse took
  11.1-11.4 s on the 2-core box, 8.2-9.1 s with this and :func:`_qualnames`' walk over
  statements only (identical corpus; ``ast.parse`` itself is ~3.4 s of it)."""
  t = type(node)
  fields = _fields.get(t)
  if fields is None:
    fields = _fields[t] = t._fields
  out = []
  for f in fields:
    v = getattr(node, f, None)
    if isinstance(v, ast.AST):
      out.append(v)
    elif isinstance(v, list):
      out.extend(x for x in v if isinstance(x, ast.AST))
  return out


def _tree_of(fun: ast.AST, name: str, type_ids: dict[str, int]) -> Tree:
  types: list[int] = []
  children: list[list[int]] = []
  parent: list[int] = []
  add_type, add_kids, add_parent = types.append, children.append, parent.append
  type_id, n_types, child_nodes = type_ids.get, len(type_ids), _child_nodes
  stack = [(fun, -1)]
  pop, push = stack.pop, stack.extend
  i = 0
  while stack:  # iterative preorder: deep ASTs must not hit the recursion limit
    node, par = pop()
    add_type(type_id(type(node).__name__, n_types))
    add_kids([])
    add_parent(par)
    if par >= 0:
      children[par].append(i)
    kids = child_nodes(node)
    if kids:
      kids.reverse()
      push([(k, i) for k in kids])
    i += 1
  n = len(types)
  first = np.full(n, -1, np.int32)
  nxt = np.full(n, -1, np.int32)
  for i, kids in enumerate(children):
    if kids:
      first[i] = kids[0]
      for a, b in zip(kids, kids[1:], strict=False):
        nxt[a] = b
  return Tree(name=name, types=np.asarray(types, np.int32),
              children=tuple(tuple(k) for k in children), first_child=first,
              next_sibling=nxt, parent=np.asarray(parent, np.int32))


# Nodes that can hold a class or function definition: expressions cannot (a lambda is not a
# FunctionDef), so the walk skips them, in the same breadth-first order over what remains.
_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)


def _qualnames(tree: ast.Module):
  """Yields (node, qualified name) for the module, classes and functions, in walk order."""
  yield tree, "<module>"
  queue = collections.deque([(tree, "")])
  while queue:
    node, prefix = queue.popleft()
    for child in _child_nodes(node):
      if isinstance(child, (ast.ClassDef, *_FUN_NODES)):
        q = f"{prefix}{child.name}"
        yield child, q
        queue.append((child, q + "."))
      elif isinstance(child, _HOLDERS):
        queue.append((child, prefix))


def stdlib_root() -> str:
  """The standard-library source directory of this interpreter."""
  return sysconfig.get_paths()["stdlib"]


def _walk_files(root: str) -> list[str]:
  files = []
  for d, dirs, names in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS)
    files.extend(os.path.join(d, f) for f in sorted(names) if f.endswith(".py"))
  return files


_lock = threading.Lock()
_cache: dict[str, Corpus] = {}


def load_corpus(root: str | None = None) -> Corpus:
  """Parses the standard library (cached in memory per ``root``); see the module docstring.

  Args:
    root: directory to read; defaults to :func:`stdlib_root`.

  Returns:
    The :class:`Corpus`.
  """
  root = root or stdlib_root()
  with _lock:
    if root in _cache:
      return _cache[root]
    corpus = _load_or_parse(root)
    _cache[root] = corpus
    return corpus


def _load_or_parse(root: str) -> Corpus:
  """``_parse(root)``, through a pickle under ``DYNJAX_BENCH_STREAM_CACHE`` when that is set
  (the test suite sets it: its workers and child processes then parse the stdlib once, ~10 s
  each on the 2-core box, instead of once per process)."""
  cache_dir = os.environ.get("DYNJAX_BENCH_STREAM_CACHE")
  if not cache_dir:
    return _parse(root)
  key = re.sub(r"[^\w.-]", "_", f"{platform.python_version()}-{root}")[-120:]
  path = os.path.join(cache_dir, f"corpus-{key}.pkl")
  try:
    with open(path, "rb") as fh:
      return pickle.load(fh)
  except (OSError, EOFError, pickle.UnpicklingError, AttributeError):
    corpus = _parse(root)
    try:
      os.makedirs(cache_dir, exist_ok=True)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "wb") as fh:
        pickle.dump(corpus, fh)
      os.replace(tmp, path)
    except OSError:
      pass
    return corpus


def _parse(root: str) -> Corpus:
  type_ids = {n: i for i, n in enumerate(node_types())}
  docs: list[str] = []
  doc_names: list[str] = []
  trees: list[Tree] = []
  files = _walk_files(root)
  skipped = []
  for path in files:
    rel = os.path.relpath(path, root)
    try:
      with open(path, "rb") as fh:
        src = fh.read()
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        module = ast.parse(src, path)
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
      skipped.append(rel)
      continue
    for node, qual in _qualnames(module):
      doc = ast.get_docstring(node)
      if doc:
        docs.append(doc)
        doc_names.append(f"{rel}:{qual}")
      if isinstance(node, _FUN_NODES):
        trees.append(_tree_of(node, f"{rel}:{qual}", type_ids))
  lengths = np.fromiter((len(TOKEN_RE.findall(d)) for d in docs), np.int32, len(docs))
  metadata = {
      "python_version": platform.python_version(),
      "python_implementation": platform.python_implementation(),
      "python": sys.version.split()[0],
      "stdlib_root": root,
      "excluded_dirs": sorted(EXCLUDED_DIRS),
      "files_parsed": len(files) - len(skipped),
      "files_skipped": skipped,
      "token_regex": TOKEN_RE.pattern,
      "node_types": len(type_ids),
  }
  return Corpus(docstrings=tuple(docs), doc_names=tuple(doc_names), lengths=lengths,
                trees=tuple(trees), metadata=metadata)


def docstring_lengths(root: str | None = None) -> np.ndarray:
  """Token counts of every standard-library docstring (int32, walk order)."""
  return load_corpus(root).lengths


def docstring_bytes(max_len: int | None = None, root: str | None = None) -> list[bytes]:
  """Docstring texts as UTF-8 bytes (decode prompts), each cut to ``max_len`` bytes if given."""
  out = [d.encode("utf-8") for d in load_corpus(root).docstrings]
  return out if max_len is None else [b[:max_len] for b in out]


def stdlib_trees(root: str | None = None) -> tuple[Tree, ...]:
  """The ASTs of every standard-library function as :class:`Tree` objects (walk order)."""
  return load_corpus(root).trees


def _pct(a: np.ndarray, q: float) -> int:
  return int(np.percentile(a, q, method="nearest")) if len(a) else 0


def summary(root: str | None = None, clip: int = 512) -> dict:
  """Headline figures of the corpus (the ones DESIGN.md quotes), plus the metadata."""
  c = load_corpus(root)
  lens = c.lengths
  sizes = np.array([t.size for t in c.trees], np.int64)
  return {
      **c.metadata,
      "docstrings": len(lens),
      "length_p10": _pct(lens, 10), "length_p50": _pct(lens, 50),
      "length_p90": _pct(lens, 90), "length_p99": _pct(lens, 99),
      "length_max": int(lens.max()) if len(lens) else 0,
      "length_mean": float(lens.mean()) if len(lens) else 0.0,
      f"distinct_lengths_le_{clip}": int(len(np.unique(lens[lens <= clip]))),
      "trees": len(sizes),
      "nodes_p10": _pct(sizes, 10), "nodes_p50": _pct(sizes, 50),
      "nodes_p90": _pct(sizes, 90), "nodes_p99": _pct(sizes, 99),
      "nodes_max": int(sizes.max()) if len(sizes) else 0,
  }


@dataclasses.dataclass(frozen=True)
class Request:
  """One batch of sequences, as a client would send it: padded to its own longest sequence.

  Attributes:
    tokens: int32 ``[batch, t]`` token ids, ``t = max(lengths)``, padded with ``PAD_ID``.
    lengths: int32 ``[batch]`` true lengths (each >= 1).
    doc_ids: indices into :attr:`Corpus.docstrings` of the sampled docstrings.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  doc_ids: np.ndarray

  @property
  def length(self) -> int:
    return int(self.tokens.shape[1])


def request_stream(n_requests: int, batch: int = 8, max_len: int = 512, seed: int = 0,
                   vocab: int = 30522, root: str | None = None) -> list[Request]:
  """A seeded, reproducible stream of batches of real docstrings.

  Each request samples ``batch`` docstrings uniformly (with replacement), tokenizes them,
  maps tokens to ids with :func:`token_id`, clips each to ``max_len`` tokens, and pads to the
  longest of the batch.  Empty docstrings do not occur (``get_docstring`` returns None), but
  docstrings made only of whitespace would: they are given length 1.

  Args:
    n_requests: number of requests.
    batch: sequences per request.
    max_len: lengths are clipped to this.
    seed: seed of ``numpy.random.default_rng``.
    vocab: vocabulary size of the token ids.
    root: standard-library directory (default: this interpreter's).

  Returns:
    A list of :class:`Request`.
  """
  cache_dir = os.environ.get("DYNJAX_BENCH_STREAM_CACHE")
  if cache_dir and root is None:  # benchmark child processes: parse the stdlib once per run
    path = os.path.join(cache_dir, f"stream-{n_requests}-{batch}-{max_len}-{seed}-{vocab}-"
                                   f"{sys.version_info[0]}.{sys.version_info[1]}.pkl")
    try:
      with open(path, "rb") as fh:
        return pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError):
      out = request_stream(n_requests, batch, max_len, seed, vocab, root=stdlib_root())
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "wb") as fh:
        pickle.dump(out, fh)
      os.replace(tmp, path)
      return out
  c = load_corpus(root)
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, len(c.docstrings), size=(n_requests, batch))
  cache: dict[int, np.ndarray] = {}

  def encode(i: int) -> np.ndarray:
    if i not in cache:
      toks = TOKEN_RE.findall(c.docstrings[i])[:max_len] or ["<empty>"]
      cache[i] = np.fromiter((token_id(t, vocab) for t in toks), np.int32, len(toks))
    return cache[i]

  out = []
  for row in ids:
    seqs = [encode(int(i)) for i in row]
    lengths = np.array([len(s) for s in seqs], np.int32)
    tokens = np.full((batch, int(lengths.max())), PAD_ID, np.int32)
    for j, s in enumerate(seqs):
      tokens[j, :len(s)] = s
    out.append(Request(tokens=tokens, lengths=lengths, doc_ids=row.astype(np.int64)))
  return out


def sample_lengths(n: int, max_len: int = 512, seed: int = 0,
                   root: str | None = None) -> np.ndarray:
  """``n`` docstring lengths sampled with replacement (seeded), clipped to ``[1, max_len]``."""
  lens = docstring_lengths(root)
  rng = np.random.default_rng(seed)
  return np.clip(lens[rng.integers(0, len(lens), size=n)], 1, max_len).astype(np.int32)


def sample_trees(n: int, seed: int = 0, max_nodes: int | None = None,
                 root: str | None = None) -> list[Tree]:
  """``n`` trees sampled with replacement (seeded), optionally only those <= ``max_nodes``."""
  trees = stdlib_trees(root)
  if max_nodes is not None:
    trees = tuple(t for t in trees if t.size <= max_nodes)
  rng = np.random.default_rng(seed)
  return [trees[int(i)] for i in rng.integers(0, len(trees), size=n)]


def stream_summary(stream: Sequence[Request]) -> dict:
  """Distinct padded lengths, mean length and total tokens of a request stream."""
  t = np.array([r.length for r in stream])
  return {"requests": len(stream), "distinct_lengths": int(len(np.unique(t))),
          "mean_length": float(t.mean()) if len(t) else 0.0,
          "max_length": int(t.max()) if len(t) else 0,
          "true_tokens": int(sum(int(r.lengths.sum()) for r in stream)),
          "padded_tokens": int(sum(r.tokens.size for r in stream))}


def main() -> None:
  """Prints the corpus figures next to DESIGN.md's (``python -m examples.data``)."""
  s = summary()
  print(f"standard library of Python {s['python_version']} at {s['stdlib_root']}")
  print(f"{'figure':<26}{'ours':>10}{'DESIGN.md (3.11)':>18}")
  for k, v in DESIGN_FIGURES.items():
    print(f"{k:<26}{s.get(k, '-'):>10}{v:>18}")
  st = stream_summary(request_stream(1000, 8, 512, seed=0))
  print(f"1000 requests of batch 8 (seed 0, clip 512): {st['distinct_lengths']} distinct "
        f"lengths, mean {st['mean_length']:.1f}")


if __name__ == "__main__":
  main()
