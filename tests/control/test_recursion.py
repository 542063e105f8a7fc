"""dynjax.cell / dynjax.recursive: Tree-LSTM over real ASTs, batching, errors."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax.control as dc
from dynjax._errors import ControlFlowError
from dynjax.runtime import collect_stats
from examples import treelstm_model as T

sys.path.insert(0, os.path.dirname(__file__))
from _trees import stdlib_trees  # noqa: E402

TREES, N_TYPES = stdlib_trees(max_nodes=40)
PARAMS = T.init_params(N_TYPES, d_in=8, d_h=8, seed=0)


def test_treelstm_batch_equals_per_node_reference():
  trees = TREES[:12]
  with collect_stats() as s:
    out = T.encode.batch([(PARAMS, t) for t in trees])
  assert s.host_syncs == 0
  for t, (h, c) in zip(trees, out, strict=True):
    rh, rc = T.reference(PARAMS, t)
    np.testing.assert_allclose(np.asarray(h), rh, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(c), rc, rtol=2e-5, atol=2e-6)
  (meta,) = s.batches
  assert meta["nodes"] > sum(t.size for t in trees)  # forget/add cells too
  assert meta["groups"] < meta["nodes"] / 4  # batched: far fewer calls than cell calls
  # per-node recursion with jitted cells agrees as well
  h0, _ = T.encode_per_node(PARAMS, trees[0])
  np.testing.assert_allclose(np.asarray(out[0][0]), np.asarray(h0), rtol=2e-5, atol=2e-6)


def test_single_call_and_second_batch_reuses_executables():
  h, _ = T.encode(PARAMS, TREES[3])
  np.testing.assert_allclose(np.asarray(h), T.reference(PARAMS, TREES[3])[0], rtol=2e-5,
                             atol=2e-6)
  T.encode.batch([(PARAMS, t) for t in TREES[:12]])
  with collect_stats() as s:
    T.encode.batch([(PARAMS, t) for t in TREES[:12]])
  assert s.compiles == 0


@dc.cell
def leaf(x):
  return jnp.full((2,), x, jnp.float32)


@dc.cell
def combine(a, b):
  return jnp.tanh(a + b)


@dc.recursive
def tree_sum(node):
  if isinstance(node, float):
    return leaf(node)
  return combine(tree_sum(node[0]), tree_sum(node[1]))


def _ref(node):
  if isinstance(node, float):
    return np.full(2, node, np.float32)
  return np.tanh(_ref(node[0]) + _ref(node[1]))


def test_results_kept_in_containers_and_materialised():
  @dc.recursive
  def both(node):
    v = tree_sum(node)
    return {"v": v, "pair": [v, leaf(1.0)], "n": 3}

  out = both(((0.5, 0.25), 1.0))
  np.testing.assert_allclose(out["v"], _ref(((0.5, 0.25), 1.0)), rtol=1e-6)
  assert out["n"] == 3 and out["pair"][1].tolist() == [1.0, 1.0]

  @dc.recursive
  def forced(node):
    v = tree_sum(node)
    scale = float(v[0])  # indexing materialises: the pending graph runs now
    return combine(v, leaf(scale))

  got = forced((0.5, 0.25))
  r = _ref((0.5, 0.25))
  np.testing.assert_allclose(got, np.tanh(r + r[0]), rtol=1e-6)


def test_cell_outside_recursion_is_jit():
  np.testing.assert_allclose(combine(jnp.ones(2), jnp.ones(2)), np.tanh([2.0, 2.0]), rtol=1e-6)


def test_cell_value_repr_and_shape():
  seen = {}

  @dc.recursive
  def peek(x):
    v = leaf(x)
    seen["shape"], seen["repr"] = v.shape, repr(v)
    return v

  peek(2.0)
  assert seen["shape"] == (2,)
  assert seen["repr"].startswith("CellValue(leaf#0[0], float32[2], pending)")


def test_error_cycle():
  a: list = []
  a.append(a)

  @dc.recursive
  def walk(node):
    return leaf(1.0) if not node else combine(walk(node[0]), leaf(0.0))

  with pytest.raises(ControlFlowError, match=r"walk: the structure has a cycle: it was called "
                     r"again with list \[\[\.\.\.\]\] while still processing that same call"):
    walk(a)


def test_error_too_deep():
  deep = 0.5
  for _ in range(5000):
    deep = (deep, 0.5)
  with pytest.raises(ControlFlowError, match=r"tree_sum: the structure nests deeper than "
                     r"Python's recursion limit"):
    tree_sum(deep)


def test_error_non_array_result():
  @dc.cell
  def bad(x):
    return x, "label"

  @dc.recursive
  def r(x):
    return bad(x)

  with pytest.raises(ControlFlowError) as e:
    r(jnp.ones(2))
  assert str(e.value) == (
      "cell 'bad' must return a pytree of arrays; got non-array leaves:\n"
      "  output[1]: str 'label'\n"
      "Return only arrays (keep host values outside cells).")


def test_error_side_effect():
  @dc.cell
  def noisy(x):
    jax.debug.print("x={x}", x=x)
    return x + 1

  @dc.recursive
  def r(x):
    return noisy(x)

  with pytest.raises(ControlFlowError, match=r"cell 'noisy' has side effects \(.*\): cells are "
                     r"batched and reordered, so they must be pure"):
    r(jnp.ones(2))


def test_error_closes_over_tracer():
  def outer(y):
    @dc.cell
    def uses_y(x):
      return x + y

    return uses_y.signature(jax.tree_util.tree_structure((1,)),
                             (("host", (2,), np.dtype("float32")),))

  with pytest.raises(ControlFlowError, match=r"cell 'uses_y' closes over JAX tracer\(s\) "
                     r"\['y'\]"):
    jax.jit(outer)(jnp.ones(2))


def test_error_host_structure_passed_to_cell():
  @dc.recursive
  def r(x):
    return leaf({"a": object()})

  with pytest.raises(ControlFlowError, match=r"a cell argument must be an array, a number or a "
                     r"cell result; got object"):
    r(1.0)


def test_recursive_under_jit_needs_program():
  with pytest.raises(dc.NeedsProgram, match=r"dynjax.recursive cannot run inside a JAX trace"):
    jax.jit(lambda x: tree_sum(x))(jnp.float32(1.0))


def test_batch_program_text():
  tree_sum.batch([((0.5, 0.25),), (((0.5, 0.5), 1.0),)])
  text = tree_sum.last_programs[0].as_text()
  assert text.splitlines()[:3] == ["program tree_sum.batch():", "entry:",
                                   "  %0 = alloc_tensor (16, 2) float32"]
  assert "invoke combine.step[B=8; arena0,arena0; caps=[16]]" in text


def test_per_item_params_are_stacked_and_highest_precision_matches_reference():
  # Two different params dicts (same structure) in one batch: one group, each distinct leaf
  # stacked once into a table gathered per item (a leaf object both share stays broadcast); under "highest" matmul precision (what the bench's GPU check uses) it still equals
  # the float64 oracle.
  p2 = T.init_params(N_TYPES, d_in=8, d_h=8, seed=1)
  trees = TREES[:4]
  items = [(PARAMS if i % 2 else p2, t) for i, t in enumerate(trees)]
  with jax.default_matmul_precision("highest"):
    out = T.encode.batch(items)
  for (p, t), (h, _) in zip(items, out, strict=True):
    np.testing.assert_allclose(np.asarray(h), T.reference(p, t)[0], rtol=2e-5, atol=2e-6)
  assert "table" in T.encode.last_programs[0].as_text()


def test_matmul_precision_is_part_of_the_step_key():
  items = [((0.5, 0.25),), (((0.5, 0.5), 1.0),)]

  def keys():
    prog = tree_sum.last_programs[0]
    return {ins.key for b in prog.blocks for ins in b.instrs if ins.kernel is not None}

  tree_sum.batch(items)
  k1 = keys()
  with jax.default_matmul_precision("bfloat16"):
    tree_sum.batch(items)
  k2 = keys()
  assert k1.isdisjoint(k2)
  assert all(("jax_default_matmul_precision", "'bfloat16'") in k[-1] for k in k2)
