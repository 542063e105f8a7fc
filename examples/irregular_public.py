"""A classifier of irregularly sampled time series written as public JAX/Flax code writes it.

Light curves, sensor logs and clinical records arrive with a different number of observations
at different times.  A common front end (the "interpolation" baselines of irregular-series
papers; astronomical light-curve classifiers) resamples each channel onto a fixed grid with
``jnp.interp`` and adds how densely each grid cell was observed, from ``jnp.digitize`` into the
grid's edges and a ``bincount``; a convolutional encoder then reads the regular grid.

Both ``jnp.interp`` and ``jnp.digitize`` search a sorted array whose length is the request's
number of observations, which JAX refuses for a symbolic length; under
``dynjax.flax.jit(padding="auto")`` this model therefore ran unpadded, one compile per number
of observations, until dynjax bound the search as a primitive (``dynjax/bucketing/
_search.py``).  ``benchmarks/bench_search.py`` serves it both ways.

Example:
  >>> model = IrregularClassifier(grid=128, channels=4)
  >>> variables = model.init(jax.random.key(0), times, values)   # times (n,), values (n, 4)
  >>> f = dynjax.flax.jit(model, dims={"times": "n", "values": "n, 4"})
  >>> logits = f(variables, times, values)                       # [classes]
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class Resample(nn.Module):
  """Each channel of ``values`` (n, c), observed at sorted ``times`` (n,) in [0, 1], linearly
  interpolated onto ``grid`` evenly spaced points, beside the fraction of observations that
  fall in each grid cell."""

  grid: int = 128

  @nn.compact
  def __call__(self, times, values):
    points = jnp.linspace(0.0, 1.0, self.grid)
    curves = jax.vmap(lambda v: jnp.interp(points, times, v), in_axes=1, out_axes=1)(values)
    edges = jnp.linspace(0.0, 1.0, self.grid + 1)[1:-1]
    cells = jnp.digitize(times, edges)
    density = jnp.bincount(cells, length=self.grid) / times.shape[0]
    return jnp.concatenate([curves, density[:, None]], axis=1)  # [grid, c + 1]


class IrregularClassifier(nn.Module):
  grid: int = 128
  channels: int = 4
  width: int = 64
  layers: int = 3
  classes: int = 8

  @nn.compact
  def __call__(self, times, values):
    x = Resample(self.grid)(times, values)
    x = nn.Dense(self.width)(x)
    for _ in range(self.layers):
      y = nn.LayerNorm()(x)
      y = nn.Conv(self.width, kernel_size=(5,))(y)
      x = x + nn.gelu(y)
    return nn.Dense(self.classes)(jnp.mean(x, axis=0))


def sample_series(rng: np.random.Generator, n: int, channels: int):
  """A request: ``n`` observation times in [0, 1] (sorted) and noisy values of a few sinusoids."""
  times = np.sort(rng.uniform(0.0, 1.0, n)).astype(np.float32)
  freq = rng.uniform(1.0, 6.0, channels)
  values = np.sin(2 * np.pi * freq[None, :] * times[:, None]) + 0.1 * rng.normal(size=(n, channels))
  return times, values.astype(np.float32)
