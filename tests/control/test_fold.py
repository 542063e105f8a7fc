"""dynjax.control.fold: the vectorised front end equals recursive, per form; DAGs; errors."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax.control as dc
from dynjax._errors import ControlFlowError
from examples import treelstm_model as T

sys.path.insert(0, os.path.dirname(__file__))
from _arity import ATOL, CELLS, N_TYPES, P_NP, RTOL, TREES, form  # noqa: E402
from _trees import BinTree  # noqa: E402


@pytest.mark.parametrize("name", T.FORMS)
def test_fold_equals_recursive_in_every_form(name):
  f = form(name)
  items = f.items(TREES[:10])
  want = f.enc.batch(items)
  got = f.fold.batch(*f.fold_args(items))
  # Same step executables, so bit for bit -- except per-node rows: recursive broadcasts the
  # row of a one-call group (one distinct object), fold stacks it (last-ulp differences).
  check = (np.testing.assert_array_equal if name != "per_node_x" else
           lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL))
  for (h, c), (rh, rc) in zip(got, want, strict=True):
    check(np.asarray(h), np.asarray(rh))
    check(np.asarray(c), np.asarray(rc))
  (meta,) = f.fold.last_stats.batches
  assert meta["nodes"] == sum(t.size for t in TREES[:10])
  assert f.fold.last_stats.host_syncs == 0


def test_fold_warmup_then_no_compiles_and_reference(compiles):
  f = form("numpy_dict")
  forests = [TREES[i:i + 12] for i in range(0, 60, 12)]
  f.fold.warmup(forests[0], f.params)
  c0 = compiles()
  for forest in forests[1:]:
    out = f.fold.batch(forest, f.params)
    jax.block_until_ready(out)
  assert compiles() == c0
  for (h, _), t in zip(out, forests[-1], strict=True):
    np.testing.assert_allclose(np.asarray(h), T.arity_reference(P_NP, t)[0], rtol=RTOL,
                               atol=ATOL)
  # numpy params mutated in place between batches: re-read by the next batch
  p = {k: v.copy() for k, v in P_NP.items()}
  out1 = f.fold.batch(forests[1], p)
  # Results first: on CPU jax may alias a numpy argument, and mutating it while the batch
  # still runs is a data race (this test once compared out1 computed with the new weights).
  jax.block_until_ready(out1)
  p["Wf"] *= -1.0
  out2 = f.fold.batch(forests[1], p)
  for (h2, _), t in zip(out2, forests[1], strict=True):
    np.testing.assert_allclose(np.asarray(h2), T.arity_reference(p, t)[0], rtol=RTOL, atol=ATOL)
  assert any(not np.allclose(np.asarray(a[0]), np.asarray(b[0]))
             for a, b in zip(out1, out2, strict=True))


def _tree(types, children):
  """A BinTree-like structure from explicit child lists (first child, next sibling)."""
  n = len(types)
  fc, ns = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
  for i, (a, b) in enumerate(children):
    fc[i], ns[i] = a, b
  return BinTree("t", np.asarray(types, np.int32), fc, ns)


def test_an_empty_minibatch_gives_no_results_as_recursive_batch_does():
  assert _fold().batch([], PJ) == [] and _fold().batch((), PJ) == []  # it raised before


def test_fold_dag_runs_a_shared_child_once():
  # node 0 reads nodes 1 and 2; node 1 reads node 2 as well (a DAG: 2 is shared)
  dag = _tree([3, 5, 7], [(1, 2), (2, -1), (-1, -1)])
  f = form("jnp_dict")
  (got,) = f.fold.batch([dag], f.params)
  assert f.fold.last_stats.batches[0]["nodes"] == 3
  (want,) = f.enc.batch(f.items([dag]))  # the recursion computes node 2 twice: same value
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=RTOL, atol=ATOL)


def test_fold_accepts_child_lists_and_matrices():
  t = TREES[3]
  f = form("jnp_dict")
  (want,) = f.fold.batch([t], f.params)
  kids = [[int(c) for c in (a, b) if c >= 0]
          for a, b in zip(t.first_child, t.next_sibling, strict=True)]
  by_lists = dc.fold(list(CELLS), children=lambda s: kids, inputs=lambda s: s.types)
  by_matrix = dc.fold(list(CELLS), children=lambda s: np.stack(
      [s.first_child, s.next_sibling], 1), inputs=lambda s: s.types)
  for enc in (by_lists, by_matrix):
    (got,) = enc.batch([t], f.params)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def _fold(**kw):
  args = dict(children=lambda s: (s.first_child, s.next_sibling), inputs=lambda s: s.types)
  args.update(kw)
  return dc.fold(list(CELLS), **args)


PJ = {k: jnp.asarray(v) for k, v in P_NP.items()}


def test_fold_errors():
  bad_child = _tree([1, 2], [(1, -1), (5, -1)])
  with pytest.raises(ControlFlowError) as e:
    _fold().batch([TREES[0], bad_child], PJ)
  assert str(e.value) == (
      "fold: child indices out of range:\n"
      "  structure 1 node 1: child 5 (it has 2 nodes)\n"
      "A child index is a node of the same structure, or -1 for none.")

  cyclic = _tree([1, 2, 3], [(1, -1), (2, -1), (1, -1)])
  with pytest.raises(ControlFlowError) as e:
    _fold().batch([cyclic], PJ)
  assert str(e.value) == (
      "fold: the structures have a cycle (these nodes are on it or depend on it through "
      "their children):\n"
      "  structure 0: nodes [0, 1, 2]\n"
      "fold runs trees and DAGs (acyclic).")

  three = np.array([[1, 2, 3], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]])
  with pytest.raises(ControlFlowError) as e:
    _fold(children=lambda s: three, inputs=lambda s: np.arange(4)).batch([None], PJ)
  assert str(e.value) == (
      "fold: the structures have nodes with [3] children but no cell for that arity; cells "
      "are given for arities [0, 1, 2]. Pass cells[k] for every k, or binarize the structure "
      "(first-child / next-sibling).")

  empty = _tree([], [])  # a structure of no nodes: named (it was numpy's IndexError)
  with pytest.raises(ControlFlowError, match=r"^fold: structure 1 has no nodes \(its children "
                     r"array has 0 rows\); a structure needs at least its root node\.$"):
    _fold().batch([TREES[0], empty], PJ)

  with pytest.raises(ControlFlowError) as e:
    _fold(inputs=lambda s: s.types[:-1]).batch([TREES[0]], PJ)
  assert str(e.value) == (
      f"fold: structure 0 has {TREES[0].size} nodes (rows of its children array) but:\n"
      f"  inputs[0] has {TREES[0].size - 1} rows\n"
      "inputs(structure) must return arrays with one row per node.")

  @dc.cell
  def other(p, x, h, c):
    return h

  with pytest.raises(ControlFlowError) as e:
    dc.fold([CELLS[0], other, CELLS[2]], children=lambda s: (s.first_child, s.next_sibling),
            inputs=lambda s: s.types).batch([TREES[0]], PJ)
  assert str(e.value) == (
      "fold: every cell must return the same structure as cells[0] (leaf: (float32[8], "
      "float32[8])), since a child's result feeds a parent of any arity; but:\n"
      "  cells[1] (other) returns float32[8]")

  with pytest.raises(ControlFlowError) as e:
    dc.fold([CELLS[0], T.arity_one_fn], children=lambda s: s)
  assert str(e.value).startswith(
      "fold: every cell must be a dynjax.cell; got:\n  arity 1: function <function "
      "arity_one_fn")
  assert str(e.value).endswith("\nWrap the functions with @dynjax.cell.")


def test_fold_n_types_fit():
  assert max(int(t.types.max()) for t in TREES) < N_TYPES


def test_fold_under_jit_needs_program():
  with pytest.raises(dc.NeedsProgram, match=r"^dynjax.control.fold cannot run inside a JAX "
                     r"trace here: fold\(leaf,one,two\) was called with JAX tracers"):
    jax.jit(lambda p: _fold().batch(TREES[:2], p)[0][0])(PJ)
