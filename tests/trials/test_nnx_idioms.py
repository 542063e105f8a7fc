"""Flax NNX client idioms (``benchmarks/probe_nnx.py``) under ``dynjax.flax.nnx_jit`` /
``dynjax.jit``: every call compared with ``nnx.jit`` / ``jax.jit`` at the exact shape
(rtol = atol = 1e-5), the state each call writes back compared too, compiles counted.

Two failures the probe found, reduced:

* ``nnx.cached_partial(nnx_jit_step, model, optimizer)`` (the NNX performance guide's training
  loop) raised "GRAPH_CONTEXT.tmp_static_cache should be None, no context consumed it" after
  every step: flax hands the wrapped function a traversal cache through its graph context and
  expects an NNX transform to take it.  ``nnx_jit`` now takes and drops it (``flax.py``
  ``_take_static_cache``).
* A fallback whose trace failed inside flax named flax's ``raise`` line only
  (``attention.py:704``); it now names the user's line that called into flax as well
  (``jit/_guards.py`` ``trace_failure_hint``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import dynjax  # noqa: E402
import dynjax.flax  # noqa: E402
from benchmarks import probe_nnx  # noqa: E402
from tests.trials import _clients  # noqa: E402

LENGTHS = (5, 9, 16)  # buckets 8 and 16 of pow2(8, 64)


@pytest.fixture(scope="module", autouse=True)
def _warm():
  _clients.warm_jax()  # jax's one-off "stage" compile of dynjax's int32[k] sizes vector


def _step(model, optimizer, tokens):
  loss, grads = nnx.value_and_grad(lambda m: probe_nnx.minigpt_loss(m, tokens)[0])(model)
  optimizer.update(model, grads)
  return loss


def _fresh():
  model = probe_nnx.minigpt(seed=1, layers=1)
  return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def test_cached_partial_of_an_nnx_jit_step_trains_like_nnx_jit(compiles):
  # flax's performance guide: train_step = nnx.cached_partial(train_step, model, optimizer).
  # The step trains with dropout drawn from the model's Rngs: the RNG counters are state too.
  mine, theirs = _fresh(), _fresh()
  f = dynjax.flax.nnx_jit(_step, dims={"tokens": "b, t"}, padding="auto",
                          buckets={"t": dynjax.buckets.pow2(8, 64)})
  step = nnx.cached_partial(f, *mine)
  ref = nnx.cached_partial(nnx.jit(_step), *theirs)
  n = 0
  for t in LENGTHS:
    tokens = probe_nnx.batch(t)[0]
    before = compiles()
    got = step(tokens)
    n += compiles() - before  # dynjax's calls only, not the reference's
    np.testing.assert_allclose(got, ref(tokens), rtol=1e-5, atol=1e-5)
    # SGD: every leaf compared, the attention key bias too (only Adam magnifies its noise)
    _, bad = probe_nnx.max_err(probe_nnx._pure(mine), probe_nnx._pure(theirs), loose=())
    assert not bad, bad
  assert n == f.stats()["compiles"] == 2  # one per bucket (8, 16)
  assert f.stats()["fallbacks"] == []


def test_cached_partial_leaves_no_cache_behind_for_the_next_transform():
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  f = dynjax.flax.nnx_jit(lambda m, x: m(x), dims={"x": "b, 4"})
  nnx.cached_partial(f, model)(np.ones((3, 4), np.float32))
  # the next nnx.jit call must not find a stale cache of another function's arguments
  other = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
  assert nnx.jit(lambda m, x: m(x))(other, np.ones((2, 4), np.float32)).shape == (2, 3)


def test_a_trace_failure_inside_flax_names_the_users_line_that_called_it():
  # A decode cache made by init_cache((3, 64, 16)) has a static batch; dims "b, 1" on the
  # token asks for a symbolic one, and flax's own shape check raises inside the trace.
  model = probe_nnx.minigpt_decode_model()
  f = dynjax.flax.nnx_jit(lambda m, token: m(token), dims={"token": "b, 1"})
  ref_model = probe_nnx.minigpt_decode_model()
  tokens = probe_nnx.batch(5)[0]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for i in range(2):
      got = f(model, tokens[:, i:i + 1])
      np.testing.assert_allclose(got, nnx.jit(lambda m, token: m(token))(
          ref_model, tokens[:, i:i + 1]), rtol=1e-5, atol=1e-5)
  (reason,) = f.stats()["fallbacks"]
  assert "Autoregressive cache shape error" in reason
  assert "flax/nnx/nn/attention.py:" in reason
  assert ("called from " in reason and "probe_nnx.py:" in reason
          and "(return self.out(self.block(self.embed(token))))" in reason), reason
  _, bad = probe_nnx.max_err(probe_nnx._pure([model]), probe_nnx._pure([ref_model]), loose=())
  assert not bad, bad  # the cache index and contents written back as nnx.jit writes them


CASES = [  # (the miniGPT tutorial's train step: the cached_partial test above)
  # nnx.BatchNorm(use_running_average=False, mask=) over padded frames: batch statistics and
  # the running averages written back; nnx.Sequential head, dropout with Rngs
  "conv+batchnorm(mask)+dropout train",
  # nnx.Bidirectional(nnx.RNN(GRUCell)) with seq_lengths (flip_sequences), SGD step
  "bigru seq_lengths train",
  # the NNX functional API: dynjax.jit over nnx.split state, nnx.merge inside
  "split/merge dropout (dynjax.jit)",
]


@pytest.mark.parametrize("name", CASES)
def test_nnx_client_is_exact_and_bucketed(name):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    rec = probe_nnx.run_case(name, probe_nnx.cases()[name], LENGTHS, on_fallback="error")
  assert rec["exact"], rec["bad"]
  assert rec["fallbacks"] == []
  assert rec["compiles"] == 2  # one per bucket (8, 16)
