"""Shared set-up of the arity-cell Tree-LSTM tests (one set of cells: compiles are shared)."""

from __future__ import annotations

from _trees import binary_trees

import dynjax.control as dc
from examples import treelstm_model as T

TREES, N_TYPES = binary_trees()
P_NP = T.init_arity_params(N_TYPES, d_h=8, seed=0)
RTOL, ATOL = 2e-5, 2e-6
# Coarse batch buckets keep the compiles (and the test time) down: 2-3 sizes per cell.
BUCKETS = [32, 256, 2048]
CELLS = tuple(dc.cell(c.fn, name=c.name, batch_buckets=BUCKETS)
              for c in (T.arity_leaf, T.arity_one, T.arity_two))


def form(name: str, p=P_NP) -> T.ArityForm:
  return T.ArityForm(name, p, cells=CELLS, buckets=BUCKETS)
