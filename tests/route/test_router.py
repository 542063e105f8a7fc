"""Router protocols, positions/loads, and input validation (exact messages)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax._errors import RoutingError
from dynjax.route import Router
from dynjax.route._router import positions_and_loads


def _np_positions(paths: np.ndarray, num_paths: int):
  flat = paths.reshape(-1)
  count = np.zeros(num_paths + 1, np.int64)
  pos = np.zeros_like(flat)
  for i, p in enumerate(flat):
    pos[i] = count[p] if p < num_paths else 0
    count[p] += 1
  return pos.reshape(paths.shape), count[:num_paths]


@pytest.mark.parametrize("n,num_paths,k", [(1, 1, 1), (7, 3, 2), (300, 8, 2), (130, 100, 1)])
def test_positions_and_loads_match_numpy(n, num_paths, k):
  rng = np.random.default_rng(n)
  paths = rng.integers(0, num_paths + 1, (n, k))  # num_paths = "no path"
  pos, loads = positions_and_loads(jnp.asarray(paths, jnp.int32), num_paths)
  ref_pos, ref_loads = _np_positions(paths, num_paths)
  np.testing.assert_array_equal(np.asarray(pos), ref_pos)
  np.testing.assert_array_equal(np.asarray(loads), ref_loads)


def test_top_k_gates_and_renormalize():
  logits = jnp.array([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
  r = Router(4, k=2)(logits)
  probs = jax.nn.softmax(logits, -1)
  np.testing.assert_array_equal(np.asarray(r.paths), [[3, 2], [0, 1]])
  np.testing.assert_allclose(np.asarray(r.gates), np.asarray(probs)[[[0], [1]], [[3, 2], [0, 1]]],
                             rtol=1e-6)
  rn = Router(4, k=2, renormalize=True)(logits)
  np.testing.assert_allclose(np.asarray(rn.gates).sum(-1), [1.0, 1.0], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(r.loads), [1, 1, 1, 1])


def test_threshold_keeps_top1_and_marks_no_path():
  logits = jnp.log(jnp.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]))
  r = Router(3, "threshold", threshold=0.3)(logits)
  np.testing.assert_array_equal(np.asarray(r.paths), [[0, 3, 3], [0, 1, 3]])
  np.testing.assert_allclose(np.asarray(r.gates), [[0.7, 0, 0], [0.4, 0.35, 0]], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(r.loads), [2, 1, 0])


def test_hash_and_label():
  labels = jnp.arange(10, dtype=jnp.int32)
  r = Router(4, "label")(labels=labels % 4)
  np.testing.assert_array_equal(np.asarray(r.paths[:, 0]), np.arange(10) % 4)
  h = Router(4, "hash")(labels=labels)
  assert np.asarray(h.loads).sum() == 10
  assert np.all(np.asarray(h.gates) == 1.0)


def test_bad_logits_shape():
  msg = ("dynjax.route.Router('top_k'): logits has shape (5, 3), expected (num_cells, 4) with one "
         "column per path (num_paths=4); pass logits of shape (N, 4) or build the Router with "
         "num_paths=3")
  with pytest.raises(RoutingError, match=re.escape(msg)):
    Router(4)(jnp.zeros((5, 3)))


def test_bad_logits_dtype():
  msg = ("dynjax.route.Router('top_k'): logits has dtype int32, expected a floating dtype "
         "(float32, bfloat16, float16); cast with logits.astype(jnp.float32)")
  with pytest.raises(RoutingError, match=re.escape(msg)):
    Router(4)(jnp.zeros((5, 4), jnp.int32))


def test_k_larger_than_paths():
  msg = ("dynjax.route.Router: k=3 is larger than num_paths=2; a cell cannot take more paths "
         "than exist: use k <= 2")
  with pytest.raises(RoutingError, match=re.escape(msg)):
    Router(2, k=3)
  with pytest.raises(ValueError):  # RoutingError is a ValueError
    Router(2, k=3)


def test_bad_protocol_and_labels():
  with pytest.raises(RoutingError, match=re.escape(
      "dynjax.route.Router: protocol must be one of 'top_k', 'threshold', 'hash', 'label', got "
      "'topk'")):
    Router(2, "topk")
  with pytest.raises(RoutingError, match=re.escape(
      "dynjax.route.Router('label'): labels has dtype float32, expected an integer dtype "
      "(int32); cast with labels.astype(jnp.int32)")):
    Router(2, "label")(labels=jnp.zeros((3,)))
  with pytest.raises(RoutingError, match=re.escape(
      "dynjax.route.Router: protocol 'threshold' needs threshold= a probability in [0, 1], got "
      "None")):
    Router(2, "threshold")
