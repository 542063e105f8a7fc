"""The reference every loop test checks ``dynjax.while_loop`` against."""

from __future__ import annotations

import jax


def jit_loop(cond, body, init):
  """A Python loop of exact-shape ``jax.jit`` steps (a compile per new carry shape)."""
  step = jax.jit(body)
  c = init
  while bool(cond(c)):
    c = step(c)
  return c
