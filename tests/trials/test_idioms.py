"""89 public-code idioms over a dynamic axis (``_idioms.py``) under ``padding="auto"``: each is
exact against ``jax.jit`` at every shape (dtypes included), bucketed (no fallback) unless
``FALLS_BACK`` names it with its cause.  A wrong result fails the test whatever the list
says.  Once with x64 off (float32), once in a process of its own with x64 on (float64: index
dtypes differ there; a rule mixing int32 and int64 indices crashed until session 22)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

import dynjax
from tests.trials._idioms import FALLS_BACK, IDIOMS

pytest.importorskip("flax")  # the pooling idioms are Flax's

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_all(dtype, tol: float) -> list[str]:
  """Every idiom at two lengths (two buckets): the problems found, as lines."""
  problems = []
  for name, (f, dims, shapes) in IDIOMS.items():
    g = dynjax.jit(f, dims=dims, buckets={"t": dynjax.buckets.pow2(min=4)})
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      for t in (5, 13):
        rng = np.random.default_rng(t)
        args = [rng.normal(size=s).astype(dtype) for s in shapes(t)]
        want = jax.tree.leaves(jax.jit(f)(*args))
        got = jax.tree.leaves(g(*args))
        if len(got) != len(want) or not all(
            a.dtype == b.dtype and np.shape(a) == np.shape(b)
            and np.allclose(a, b, rtol=tol, atol=tol, equal_nan=True)
            for a, b in zip(got, want, strict=True)):
          problems.append(f"WRONG {name} at t={t}")
    fallbacks = g.stats()["fallbacks"]
    if name in FALLS_BACK:
      if not fallbacks or FALLS_BACK[name] not in fallbacks[0]:
        problems.append(f"{name}: expected a fallback for {FALLS_BACK[name]!r}, got "
                        f"{fallbacks or 'none (update FALLS_BACK)'}")
    elif fallbacks:
      problems.append(f"{name}: {fallbacks[0]}")
  return problems


def test_public_idioms_are_exact_and_bucketed_or_fall_back_for_the_known_reason():
  assert len(IDIOMS) == 89 and len(FALLS_BACK) == 3
  problems = check_all(np.float32, 1e-4)
  assert not problems, "\n".join(problems)


def test_the_same_idioms_with_x64_on():
  code = ("import numpy as np; from tests.trials.test_idioms import check_all; "
          "print('\\n'.join(check_all(np.float64, 1e-9)) or 'ok')")
  env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout[-3000:]
