"""75 public-code idioms over a dynamic axis (``_idioms.py``) under ``padding="auto"``: each is
exact against ``jax.jit`` at every shape, bucketed (no fallback) unless ``FALLS_BACK`` names
it with its cause.  A wrong result fails the test whatever the list says."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import dynjax
from tests.trials._idioms import FALLS_BACK, IDIOMS

pytest.importorskip("flax")  # the pooling idioms are Flax's


def test_public_idioms_are_exact_and_bucketed_or_fall_back_for_the_known_reason():
  wrong, unexpected = [], []
  for name, (f, dims, shapes) in IDIOMS.items():
    g = dynjax.jit(f, dims=dims, buckets={"t": dynjax.buckets.pow2(min=4)})
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      for t in (5, 13):
        rng = np.random.default_rng(t)
        args = [rng.normal(size=s).astype(np.float32) for s in shapes(t)]
        want = jax.tree.leaves(jax.jit(f)(*args))
        got = jax.tree.leaves(g(*args))
        if len(got) != len(want) or not all(
            np.shape(a) == np.shape(b) and np.allclose(a, b, rtol=1e-4, atol=1e-4,
                                                       equal_nan=True)
            for a, b in zip(got, want, strict=True)):
          wrong.append(f"{name} at t={t}")
    fallbacks = g.stats()["fallbacks"]
    if name in FALLS_BACK:
      if not fallbacks or FALLS_BACK[name] not in fallbacks[0]:
        unexpected.append(f"{name}: expected a fallback for {FALLS_BACK[name]!r}, got "
                          f"{fallbacks or 'none (update FALLS_BACK)'}")
    elif fallbacks:
      unexpected.append(f"{name}: {fallbacks[0]}")
  assert not wrong, f"wrong results: {wrong}"
  assert not unexpected, "\n".join(unexpected)
  assert len(IDIOMS) == 75 and len(FALLS_BACK) == 5
