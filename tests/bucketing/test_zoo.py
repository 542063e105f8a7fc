"""padding="auto" on real models: exact against jax.jit at the exact shapes, zero
fallbacks, one compile per bucket; forward and training step (loss and parameter gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from tests.bucketing import _zoo  # noqa: E402


@pytest.fixture(scope="module")
def zoo():  # XLA optimisations are off suite-wide (conftest.py)
  """Built once (model init compiles many small eager ops: outside the compile count)."""
  for k in (2, 3):
    # dynjax's dispatch moves the int32[k] sizes vector with jnp.asarray: jax compiles a tiny
    # "stage" program once per process and k, which is not a bucket compile
    jnp.asarray(np.zeros(k, np.int32))
  return {e.name: e for e in _zoo.build()}


@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
@pytest.mark.parametrize(
  "name", ["bilstm", "transformer_tagger", "seq2seq", "audio_convnet", "graph_net"]
)
def test_zoo_model_is_exact_with_one_compile_per_bucket(zoo, name, train, compiles):
  entry = zoo[name]
  f = _zoo.wrap(entry, train, on_fallback="error")
  outs = [f(entry.params, *_zoo.call_args(entry, a, train)) for _, a in entry.calls]
  assert compiles() == len(_zoo.expected_buckets(entry))
  assert f.stats()["fallbacks"] == []
  ref = _zoo.reference(entry, train)
  for (sizes, a), got in zip(entry.calls, outs, strict=True):
    want = ref(entry.params, *_zoo.call_args(entry, a, train))
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl)
    for g, w in zip(gl, wl, strict=True):
      np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=f"{name} {sizes}"
      )
