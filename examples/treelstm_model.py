"""Child-sum Tree-LSTM (Tai et al. 2015) over trees, written as a dynjax user would.

The model for node j with input x_j and children k:
``h~ = sum_k h_k``; ``i, o, u = sigma/sigma/tanh(W x + U h~ + b)``;
``f_k = sigma(W_f x + U_f h_k + b_f)``; ``c = i*u + sum_k f_k*c_k``; ``h = o*tanh(c)``.

Two ways to write it:

* child-sum over child lists (:func:`encode`, ``dynjax.recursive``): four small cells --
  ``forget`` per child (``f_k*c_k``), ``add`` in a balanced pairwise tree, ``node`` for the
  gates, ``leaf`` -- so the variable number of children becomes batched work;
  :func:`encode_per_node` runs the same cells jitted node by node, :func:`reference` is the
  numpy float64 oracle and :func:`torch_per_node` the PyTorch eager twin.
* by arity over the binarized (first-child / next-sibling) tree, where a node has 0, 1 or 2
  children: three cells (``arity_leaf``, ``arity_one``, ``arity_two``) with the parameters an
  ordinary argument, in every argument form of :data:`FORMS` (:class:`ArityForm` builds each
  form's encoders: :func:`binary_encoder` for ``dynjax.recursive``, ``dynjax.control.fold``,
  and the per-node jitted twin); :func:`arity_reference` is the oracle.

Trees are :class:`examples.data.Tree` (ASTs of standard-library functions); the benchmark is
``python -m benchmarks treelstm``.

Example:
  >>> p = init_params(n_types=len(data.node_types()))
  >>> h, c = encode(p, tree)              # one tree
  >>> outs = encode.batch(p, trees)       # a forest, batched per cell
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dynjax.control import cell, fold, recursive


def init_params(n_types: int, d_in: int = 16, d_h: int = 32, seed: int = 0) -> dict:
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  s_in, s_h = 1.0 / np.sqrt(d_in), 1.0 / np.sqrt(d_h)
  return {
      "emb": jax.random.normal(k[0], (n_types, d_in)),
      "W": jax.random.normal(k[1], (d_in, 3 * d_h)) * s_in,
      "U": jax.random.normal(k[2], (d_h, 3 * d_h)) * s_h,
      "b": jnp.zeros((3 * d_h,)),
      "Wf": jax.random.normal(k[3], (d_in, d_h)) * s_in,
      "Uf": jax.random.normal(k[4], (d_h, d_h)) * s_h,
      "bf": jnp.ones((d_h,)),
  }


def _gates(p, x, hsum, fcsum):
  z = x @ p["W"] + hsum @ p["U"] + p["b"]
  i, o, u = jnp.split(z, 3)
  c = jax.nn.sigmoid(i) * jnp.tanh(u) + fcsum
  return jax.nn.sigmoid(o) * jnp.tanh(c), c


@cell
def leaf(p, tok):
  x = p["emb"][tok]
  zero = jnp.zeros(p["Uf"].shape[0], x.dtype)
  return _gates(p, x, zero, zero)


@cell
def node(p, tok, hsum, fcsum):
  return _gates(p, p["emb"][tok], hsum, fcsum)


@cell
def forget(p, tok, h, c):
  f = jax.nn.sigmoid(p["emb"][tok] @ p["Wf"] + h @ p["Uf"] + p["bf"])
  return h, f * c


@cell
def add(a, b):
  return a[0] + b[0], a[1] + b[1]


def _pairwise(items, add_fn=add):
  """Sums (h, c) pairs as a balanced tree of ``add_fn`` calls (the cell, or its jitted twin)."""
  while len(items) > 1:
    nxt = [add_fn(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
    if len(items) % 2:
      nxt.append(items[-1])
    items = nxt
  return items[0]


_jit_leaf, _jit_node, _jit_forget, _jit_add = (jax.jit(c.fn) for c in (leaf, node, forget, add))


def _encode(p, tree, i):
  tok = int(tree.types[i])
  kids = tree.children[i]
  if not kids:
    return _jit_leaf(p, tok)
  items = [_jit_forget(p, tok, *_encode(p, tree, k)) for k in kids]
  return _jit_node(p, tok, *_pairwise(items, _jit_add))


@recursive
def encode(p, tree, i=0):
  """(h, c) of node ``i`` of ``tree`` (any object with ``types`` and ``children``)."""
  return _encode_rec(p, tree, i)


def _encode_rec(p, tree, i):
  tok = int(tree.types[i])
  kids = tree.children[i]
  if not kids:
    return leaf(p, tok)
  terms = [forget(p, tok, *encode(p, tree, k)) for k in kids]
  hsum, fcsum = _pairwise(terms)
  return node(p, tok, hsum, fcsum)


def encode_per_node(p, tree, i=0):
  """The same recursion, every cell a plain ``jax.jit`` call on one node (no batching)."""
  return _encode(p, tree, i)


def reference(p, tree, i=0):
  """Direct child-sum formula per node in numpy float64 (sequential sums): the oracle."""
  P = {k: np.asarray(v, np.float64) for k, v in p.items()}

  def sig(z):
    return 1.0 / (1.0 + np.exp(-z))

  def go(j):
    x = P["emb"][int(tree.types[j])]
    kids = [go(k) for k in tree.children[j]]
    d = P["Uf"].shape[0]
    hs = np.stack([h for h, _ in kids]) if kids else np.zeros((0, d))
    cs = np.stack([c for _, c in kids]) if kids else np.zeros((0, d))
    z = x @ P["W"] + hs.sum(0) @ P["U"] + P["b"]
    ig, og, ug = np.split(z, 3)
    f = sig(x @ P["Wf"] + hs @ P["Uf"] + P["bf"])
    c = sig(ig) * np.tanh(ug) + (f * cs).sum(0)
    return sig(og) * np.tanh(c), c

  return go(i)


def torch_per_node(p, tree, device="cpu"):
  """PyTorch eager, one node at a time (lazy import; same weights)."""
  import torch

  P = {k: torch.as_tensor(np.asarray(v), device=device) for k, v in p.items()}
  d = P["Uf"].shape[0]

  def go(j):
    x = P["emb"][int(tree.types[j])]
    kids = [go(k) for k in tree.children[j]]
    if kids:
      hs = torch.stack([h for h, _ in kids])
      cs = torch.stack([c for _, c in kids])
      hsum = hs.sum(0)
      f = torch.sigmoid(x @ P["Wf"] + hs @ P["Uf"] + P["bf"])
      fc = (f * cs).sum(0)
    else:
      hsum = torch.zeros(d, device=device)
      fc = torch.zeros(d, device=device)
    return _torch_gates(P, x, hsum, fc)

  with torch.no_grad():
    return go(0)


def _torch_gates(P, x, hsum, fc):
  """The node update of both PyTorch twins: (h, c) from the input, child-h sum, forget sum."""
  import torch

  z = x @ P["W"] + hsum @ P["U"] + P["b"]
  ig, og, ug = torch.split(z, P["Uf"].shape[0])
  c = torch.sigmoid(ig) * torch.tanh(ug) + fc
  return torch.sigmoid(og) * torch.tanh(c), c


# -- the model: three cells by arity over binarized trees ---------------------------
# Child-sum Tree-LSTM on the first-child / next-sibling form of each AST: a node has 0, 1 or
# 2 children there, and one cell per arity does the whole node (no pairwise adds, no separate
# forget cell).  Parameters are an ordinary argument, in any of the forms of ``FORMS``.
FORMS = ("numpy_dict", "jnp_dict", "nested", "closed", "per_node_x")
FORM_NOTES = {
    "numpy_dict": "params: dict of numpy arrays, the same object in every call",
    "jnp_dict": "params: dict of jax arrays, the same object in every call",
    "nested": "params: nested pytree {emb, gates: {W, U, b}, forget: (Wf, Uf, bf)} of jax arrays",
    "closed": "params closed over by the cells (constants of the executables)",
    "per_node_x": "jnp params + a per-node input row (numpy, a different object per call)",
}


def init_arity_params(n_types: int, d_h: int = 16, seed: int = 0) -> dict:
  """Numpy float32 weights (seeded; no device work): ``emb`` [n_types, d_h] and the gates."""
  rng = np.random.default_rng(seed)
  s = 1.0 / np.sqrt(d_h)

  def w(*shape, scale=s):
    return (rng.standard_normal(shape) * scale).astype(np.float32)

  return {"emb": w(n_types, d_h, scale=1.0), "W": w(d_h, 3 * d_h), "U": w(d_h, 3 * d_h),
          "b": np.zeros(3 * d_h, np.float32), "Wf": w(d_h, d_h), "Uf": w(d_h, d_h),
          "bf": np.ones(d_h, np.float32)}


def nest(p: dict) -> dict:
  """The same weights as a nested pytree (dict, sub-dict, tuple)."""
  return {"emb": p["emb"], "gates": {"W": p["W"], "U": p["U"], "b": p["b"]},
          "forget": (p["Wf"], p["Uf"], p["bf"])}


def _flat(p):
  if "gates" in p:
    g, (wf, uf, bf) = p["gates"], p["forget"]
    return {"emb": p["emb"], "W": g["W"], "U": g["U"], "b": g["b"], "Wf": wf, "Uf": uf, "bf": bf}
  return p


def _input(p, x):
  # a token id (looked up in the cell) or the node's input row itself
  return p["emb"][x] if jnp.issubdtype(jnp.result_type(x), jnp.integer) else x


def _forget(p, x, h, c):
  return jax.nn.sigmoid(x @ p["Wf"] + h @ p["Uf"] + p["bf"]) * c


def arity_leaf_fn(p, x):
  p = _flat(p)
  x = _input(p, x)
  zero = jnp.zeros(p["Uf"].shape[0], x.dtype)
  return _gates(p, x, zero, zero)


def arity_one_fn(p, x, h, c):
  p = _flat(p)
  x = _input(p, x)
  return _gates(p, x, h, _forget(p, x, h, c))


def arity_two_fn(p, x, h1, c1, h2, c2):
  p = _flat(p)
  x = _input(p, x)
  return _gates(p, x, h1 + h2, _forget(p, x, h1, c1) + _forget(p, x, h2, c2))


arity_leaf = cell(arity_leaf_fn, name="leaf")
arity_one = cell(arity_one_fn, name="one")
arity_two = cell(arity_two_fn, name="two")


def closed_cells(p, buckets=None) -> tuple:
  """The three cells closing over ``p`` (its arrays become constants of the executables)."""
  return (cell(lambda x: arity_leaf_fn(p, x), name="leaf_c", batch_buckets=buckets),
          cell(lambda x, h, c: arity_one_fn(p, x, h, c), name="one_c", batch_buckets=buckets),
          cell(lambda x, h1, c1, h2, c2: arity_two_fn(p, x, h1, c1, h2, c2), name="two_c",
               batch_buckets=buckets))


def binary_encoder(leaf_c, one_c, two_c, wrap=recursive):
  """``enc(p, tree, i=0) -> (h, c)`` written as a user would: recurse, call a cell by arity.

  ``wrap=dynjax.recursive`` gives the batched recursion; ``wrap=lambda f: f`` with jitted
  cells gives the per-node baseline (same Python, one executable call per node).
  """
  def enc(p, tree, i=0):
    left, right = tree.first_child[i], tree.next_sibling[i]
    tok = int(tree.types[i])
    if left < 0:
      if right < 0:
        return leaf_c(p, tok)
      return one_c(p, tok, *rec(p, tree, right))
    if right < 0:
      return one_c(p, tok, *rec(p, tree, left))
    return two_c(p, tok, *rec(p, tree, left), *rec(p, tree, right))

  rec = wrap(enc)
  return rec


def binary_encoder_closed(leaf_c, one_c, two_c, wrap=recursive):
  """``enc(tree, i=0)``: the cells close over the parameters."""
  def enc(tree, i=0):
    left, right = tree.first_child[i], tree.next_sibling[i]
    tok = int(tree.types[i])
    if left < 0:
      if right < 0:
        return leaf_c(tok)
      return one_c(tok, *rec(tree, right))
    if right < 0:
      return one_c(tok, *rec(tree, left))
    return two_c(tok, *rec(tree, left), *rec(tree, right))

  rec = wrap(enc)
  return rec


def binary_encoder_x(leaf_c, one_c, two_c, wrap=recursive):
  """``enc(p, tree, xs, i=0)``: node i's input is the row ``xs[i]`` (a new object per call)."""
  def enc(p, tree, xs, i=0):
    left, right = tree.first_child[i], tree.next_sibling[i]
    x = xs[i]
    if left < 0:
      if right < 0:
        return leaf_c(p, x)
      return one_c(p, x, *rec(p, tree, xs, right))
    if right < 0:
      return one_c(p, x, *rec(p, tree, xs, left))
    return two_c(p, x, *rec(p, tree, xs, left), *rec(p, tree, xs, right))

  rec = wrap(enc)
  return rec


def arity_reference(p, tree, i=0):
  """The binarized model per node in numpy float64 (the oracle)."""
  P = {k: np.asarray(v, np.float64) for k, v in _flat(p).items()}
  d = P["Uf"].shape[0]

  def sig(z):
    return 1.0 / (1.0 + np.exp(-z))

  def go(j):
    x = P["emb"][int(tree.types[j])]
    kids = [go(int(k)) for k in (tree.first_child[j], tree.next_sibling[j]) if k >= 0]
    hsum = sum((h for h, _ in kids), np.zeros(d))
    fc = sum((sig(x @ P["Wf"] + h @ P["Uf"] + P["bf"]) * c for h, c in kids), np.zeros(d))
    z = x @ P["W"] + hsum @ P["U"] + P["b"]
    ig, og, ug = np.split(z, 3)
    c = sig(ig) * np.tanh(ug) + fc
    return sig(og) * np.tanh(c), c

  return go(i)


def torch_arity_params(p, device="cpu") -> dict:
  import torch

  return {k: torch.as_tensor(np.asarray(v), device=device) for k, v in _flat(p).items()}


def torch_arity_per_node(P, tree):
  """PyTorch eager, one node at a time, the binarized model (``P`` from torch_arity_params)."""
  import torch

  d = P["Uf"].shape[0]
  dev = P["Uf"].device

  def go(j):
    x = P["emb"][int(tree.types[j])]
    kids = [go(int(k)) for k in (tree.first_child[j], tree.next_sibling[j]) if k >= 0]
    if kids:
      hsum = sum(h for h, _ in kids)
      fc = sum(torch.sigmoid(x @ P["Wf"] + h @ P["Uf"] + P["bf"]) * c for h, c in kids)
    else:
      hsum = torch.zeros(d, device=dev)
      fc = torch.zeros(d, device=dev)
    return _torch_gates(P, x, hsum, fc)

  with torch.no_grad():
    return go(0)


class ArityForm:
  """One argument form: the batched encoders (recursive, fold), the per-node twin, calls."""

  def __init__(self, form: str, p_np: dict, fresh: bool = False, cells: tuple | None = None,
               buckets=None):
    self.form = form
    p_dev = {k: jnp.asarray(v) for k, v in p_np.items()}
    self.emb = p_np["emb"]
    base = (arity_leaf, arity_one, arity_two) if cells is None else cells
    if fresh:  # new cell objects: nothing compiled yet (the no-warm-up compile count)
      base = tuple(cell(c.fn, name=c.name, batch_buckets=buckets) for c in base)
    jitted = tuple(jax.jit(c.fn) for c in base)
    ident = lambda f: f  # noqa: E731
    kids = lambda t: (t.first_child, t.next_sibling)  # noqa: E731
    if form == "closed":
      cells = closed_cells(p_dev, buckets)
      self.enc = binary_encoder_closed(*cells)
      self.per_node = binary_encoder_closed(*(jax.jit(c.fn) for c in cells), wrap=ident)
      self.fold = fold(list(cells), children=kids, inputs=lambda t: t.types)
      self.params = None
    elif form == "per_node_x":
      self.enc = binary_encoder_x(*base)
      self.per_node = binary_encoder_x(*jitted, wrap=ident)
      self.fold = fold(list(base), children=lambda s: kids(s[0]), inputs=lambda s: s[1])
      self.params = p_dev
    else:
      self.enc = binary_encoder(*base)
      self.per_node = binary_encoder(*jitted, wrap=ident)
      self.fold = fold(list(base), children=kids, inputs=lambda t: t.types)
      self.params = {"numpy_dict": p_np, "jnp_dict": p_dev, "nested": nest(p_dev)}[form]

  def items(self, trees) -> list[tuple]:
    """Argument tuples of ``enc.batch`` (and of the per-node recursion)."""
    if self.form == "closed":
      return [(t,) for t in trees]
    if self.form == "per_node_x":
      return [(self.params, t, self.emb[t.types]) for t in trees]
    return [(self.params, t) for t in trees]

  def fold_args(self, items) -> tuple:
    """(structures, *shared) of ``fold.batch`` for the same items."""
    if self.form == "closed":
      return ([it[0] for it in items],)
    if self.form == "per_node_x":
      return [(it[1], it[2]) for it in items], self.params
    return [it[1] for it in items], self.params
