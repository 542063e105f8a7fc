"""The issue's Tree-LSTM (three cells by arity) under dynjax.recursive in every argument form.

Exact against the same cells jitted and called node by node, and against the float64 oracle
at "highest" matmul precision (conftest sets it); shared arguments known by identity must
stay correct when the caller mutates them between batches; compiles stop after warmup().
"""

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
from _arity import ATOL, CELLS, N_TYPES, P_NP, RTOL, TREES  # noqa: E402
from _arity import form as _form  # noqa: E402


def _per_node(form: T.ArityForm, items):
  return [form.per_node(*it) for it in items]


def _assert_close(got, want):
  for (h, c), (rh, rc) in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(h), np.asarray(rh), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(c), np.asarray(rc), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("form", T.FORMS)
def test_every_argument_form_equals_per_node_and_reference(form):
  f = _form(form)
  trees = TREES[:10]
  items = f.items(trees)
  out = f.enc.batch(items)
  _assert_close(out, _per_node(f, items))
  for (h, _), t in zip(out, trees, strict=True):
    np.testing.assert_allclose(np.asarray(h), T.arity_reference(P_NP, t)[0], rtol=RTOL,
                               atol=ATOL)
  (meta,) = f.enc.last_stats.batches
  assert meta["groups"] < meta["nodes"] / 4
  text = f.enc.last_programs[0].as_text()
  if form == "per_node_x":
    assert "item" in text  # the per-node rows are stacked per call
  elif form != "closed":
    assert "item" not in text and "table" not in text  # params broadcast, never stacked
  if form == "numpy_dict":
    assert meta["uploads"] == len(P_NP)  # each numpy leaf put on the device once per batch


def test_mutating_shared_params_between_batches():
  p = {k: v.copy() for k, v in P_NP.items()}
  f = _form("numpy_dict", p)
  trees = TREES[:6]
  f.enc.batch(f.items(trees))
  p["W"] *= 0.5  # in place: same dict, same array object, new contents
  p["b"] = p["b"] + 0.25  # a new array in the same dict
  out = f.enc.batch(f.items(trees))
  for (h, _), t in zip(out, trees, strict=True):
    np.testing.assert_allclose(np.asarray(h), T.arity_reference(p, t)[0], rtol=RTOL, atol=ATOL)
  pj = {k: jnp.asarray(v) for k, v in p.items()}
  fj = _form("jnp_dict", p)
  fj.params = pj
  fj.enc.batch(fj.items(trees))
  pj["U"] = pj["U"] * 2.0
  p2 = dict(p, U=p["U"] * 2.0)
  out = fj.enc.batch(fj.items(trees))
  for (h, _), t in zip(out, trees, strict=True):
    np.testing.assert_allclose(np.asarray(h), T.arity_reference(p2, t)[0], rtol=RTOL,
                               atol=ATOL)


def test_mutating_a_container_during_a_batch_is_an_error():
  pj = {k: jnp.asarray(v) for k, v in P_NP.items()}
  enc = T.binary_encoder(*CELLS)

  @dc.recursive
  def sneaky(p, tree):
    out = enc(p, tree)
    p["W"] = p["W"] + 1.0  # changes the object the recorded calls will read
    return out

  with pytest.raises(ControlFlowError) as e:
    sneaky(dict(pj), TREES[0])
  assert str(e.value) == (
      "sneaky: argument object(s) were modified while the batch was recording:\n"
      "  dict passed to cell 'leaf': structure or leaves changed after its first use\n"
      "dynjax reads a container passed to cells once per batch (it is known by identity, so "
      "later calls cost one lookup). Pass a new object for new values, or modify it only "
      "between batches.")


def test_distinct_params_per_tree_and_device_rows_per_call():
  # Params that differ per tree (two objects): one table per distinct leaf, gathered per item.
  p2 = T.init_arity_params(N_TYPES, d_h=8, seed=1)
  f = _form("jnp_dict")
  pj2 = {k: jnp.asarray(v) for k, v in p2.items()}
  trees = TREES[:4]
  items = [(f.params if i % 2 else pj2, t) for i, t in enumerate(trees)]
  out = f.enc.batch(items)
  for (p, t), (h, _) in zip(items, out, strict=True):
    ref = T.arity_reference(P_NP if p is f.params else p2, t)[0]
    np.testing.assert_allclose(np.asarray(h), ref, rtol=RTOL, atol=ATOL)
  assert "table" in f.enc.last_programs[0].as_text()
  # Device arrays different per call (rows of a per-type table): per-item stacks.
  rows = [jnp.asarray(r) for r in P_NP["emb"]]
  fx = _form("per_node_x")
  enc = T.binary_encoder_x(*CELLS)
  got = enc.batch([(fx.params, t, [rows[int(k)] for k in t.types]) for t in trees])
  _assert_close(got, fx.enc.batch(fx.items(trees)))


def test_no_compiles_after_warmup_over_new_forests(compiles):
  f = _form("jnp_dict")
  forests = [TREES[i:i + 12] for i in range(0, 72, 12)]
  w = f.enc.warmup(f.items(forests[0]))
  assert w["buckets"]["two"] == [32, 256] and w["caps"]  # seen 32, + the next one up
  before = compiles()
  per_batch = []
  for forest in forests[1:]:
    c0 = compiles()
    jax.block_until_ready(f.enc.batch(f.items(forest)))
    per_batch.append(compiles() - c0)
  assert per_batch == [0] * 5, per_batch
  assert compiles() == before


def test_numpy_scalar_tokens_record_like_python_ints():
  f = _form("jnp_dict")
  leaf, one, two = CELLS

  @dc.recursive
  def enc(p, tree, i=0):  # tree.types[i] is np.int32: no int() needed
    left, right = tree.first_child[i], tree.next_sibling[i]
    kids = [enc(p, tree, int(k)) for k in (left, right) if k >= 0]
    cells = (leaf, one, two)
    return cells[len(kids)](p, tree.types[i], *[x for kid in kids for x in kid])

  trees = TREES[:5]
  got = enc.batch([(f.params, t) for t in trees])
  want = f.enc.batch(f.items(trees))
  for (h, _), (rh, _) in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(h), np.asarray(rh))
  assert "hostid" in enc.last_programs[0].as_text()
