"""Flax MoE layers (Linen and NNX) over :class:`dynjax.route.Routed`.

Imported only when ``dynjax.route.LinenMoE`` / ``dynjax.route.NnxMoE`` is first accessed, so
dynjax does not need flax.  Both layers hold a router kernel ``[d, E]`` and stacked expert FFN
weights ``w1 [E, d, hidden]``, ``w2 [E, hidden, d]``; tokens are the flattened leading axes.
The default mode is ``"profiled"`` (jittable, differentiable); ``"exact-sync"`` works when the
model is applied eagerly (outside ``jax.jit``).
"""

from __future__ import annotations

import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from dynjax.route._paths import Experts, ffn
from dynjax.route._routed import Routed
from dynjax.route._router import Router

_SHARED: dict[tuple, Routed] = {}
_SHARED_LOCK = threading.Lock()


def shared_routed(num_experts: int, k: int, mode: str, renormalize: bool,
                  options: tuple = ()) -> Routed:
  """One :class:`Routed` per layer configuration, so profile and executables survive across
  Linen ``apply`` calls (Linen rebuilds modules on every call)."""
  key = (num_experts, k, mode, renormalize, options)
  with _SHARED_LOCK:
    routed = _SHARED.get(key)
    if routed is None:
      routed = Routed(Experts(ffn()), Router(num_experts, k=k, renormalize=renormalize),
                      mode=mode, **dict(options))
      _SHARED[key] = routed
  return routed


def _run(routed: Routed, x, wr, w1, w2):
  d = x.shape[-1]
  xf = x.reshape(-1, d)
  logits = jnp.dot(xf, wr.astype(xf.dtype), preferred_element_type=jnp.float32)
  y = routed({"w1": w1.astype(xf.dtype), "w2": w2.astype(xf.dtype)}, xf, logits)
  return y.reshape(x.shape)


class LinenMoE(nn.Module):
  """A dropless MoE FFN for Linen models.

  Attributes:
    num_experts: number of experts.
    hidden: expert FFN width.
    k: experts per token.
    mode: ``"profiled"`` (default) or ``"exact-sync"``.
    renormalize: renormalise the top-k gates.
    routed: an explicit :class:`Routed` (shares its profile); default one per configuration.
    options: extra :class:`Routed` keyword arguments as a tuple of ``(name, value)`` pairs.

  Example:
    >>> layer = dynjax.route.LinenMoE(num_experts=8, hidden=256, k=2)
    >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((4, 16, 64)))
    >>> y = jax.jit(layer.apply)(variables, jnp.ones((4, 16, 64)))
  """

  num_experts: int
  hidden: int
  k: int = 1
  mode: str = "profiled"
  renormalize: bool = False
  routed: Any = None
  options: tuple = ()

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    init = nn.initializers.lecun_normal()
    e = self.num_experts
    wr = self.param("router", init, (d, e))
    w1 = self.param("w1", nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                                           in_axis=1, out_axis=2),
                    (e, d, self.hidden))
    w2 = self.param("w2", nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                                           in_axis=1, out_axis=2),
                    (e, self.hidden, d))
    routed = self.routed or shared_routed(e, self.k, self.mode, self.renormalize, self.options)
    return _run(routed, x, wr, w1, w2)


class NnxMoE(nnx.Module):
  """A dropless MoE FFN for NNX models.

  Args:
    d: model width.
    hidden: expert FFN width.
    num_experts: number of experts.
    k: experts per token.
    mode: ``"profiled"`` (default) or ``"exact-sync"``.
    renormalize: renormalise the top-k gates.
    routed: an explicit :class:`Routed`; default a new one (its profile is ``layer.routed.profile``).
    rngs: ``nnx.Rngs``.
    **options: extra :class:`Routed` keyword arguments.

  Example:
    >>> layer = dynjax.route.NnxMoE(64, 256, 8, k=2, rngs=nnx.Rngs(0))
    >>> y = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((4, 16, 64)))
  """

  def __init__(self, d: int, hidden: int, num_experts: int, *, k: int = 1,
               mode: str = "profiled", renormalize: bool = False, routed: Routed | None = None,
               rngs: nnx.Rngs, **options):
    key = rngs.params()
    k1, k2, k3 = jax.random.split(key, 3)
    self.router = nnx.Param(jax.random.normal(k1, (d, num_experts)) / jnp.sqrt(d))
    self.w1 = nnx.Param(jax.random.normal(k2, (num_experts, d, hidden)) / jnp.sqrt(d))
    self.w2 = nnx.Param(jax.random.normal(k3, (num_experts, hidden, d)) / jnp.sqrt(hidden))
    self.routed = routed or Routed(Experts(ffn()),
                                   Router(num_experts, k=k, renormalize=renormalize),
                                   mode=mode, **options)

  def __call__(self, x):
    return _run(self.routed, x, self.router[...], self.w1[...], self.w2[...])
