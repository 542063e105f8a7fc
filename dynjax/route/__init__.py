"""Routers and cells for sub-tensor dynamism: dropless Mixture-of-Experts and dynamic routing.

Example:
  >>> moe = dynjax.route.Routed(dynjax.route.Experts(dynjax.route.ffn()),
  ...                           dynjax.route.Router(8, k=2), mode="profiled")
  >>> y = jax.jit(moe)(params, x, logits)
  >>> gmm_moe = dynjax.route.Routed(dynjax.route.Experts(dynjax.route.ffn()),
  ...                               dynjax.route.Router(8, k=2, renormalize=True), mode="grouped")
  >>> y = jax.jit(gmm_moe)(params, x, logits)   # grouped-GEMM kernel on GPU/TPU
"""

from __future__ import annotations

from dynjax.route._dispatch import Plan as Plan
from dynjax.route._dispatch import apply as apply
from dynjax.route._dispatch import combine as combine
from dynjax.route._dispatch import dense_reference as dense_reference
from dynjax.route._dispatch import dispatch as dispatch
from dynjax.route._dispatch import make_plan as make_plan
from dynjax.route._gmm import Tiling as Tiling
from dynjax.route._gmm import gmm as gmm
from dynjax.route._grouped import grouped_layout as grouped_layout
from dynjax.route._paths import Branches as Branches
from dynjax.route._paths import Experts as Experts
from dynjax.route._paths import ffn as ffn
from dynjax.route._profile import Profile as Profile
from dynjax.route._ragged import ragged_dot as ragged_dot
from dynjax.route._routed import Routed as Routed
from dynjax.route._router import Router as Router
from dynjax.route._router import Routing as Routing

_FLAX_NAMES = ("LinenMoE", "NnxMoE")

__all__ = ["Branches", "Experts", "LinenMoE", "NnxMoE", "Plan", "Profile", "Routed", "Router",
           "Routing", "Tiling", "apply", "combine", "dense_reference", "dispatch", "ffn", "gmm",
           "grouped_layout", "make_plan", "ragged_dot"]


def __getattr__(name: str):
  # Flax is optional: the layers import it only when asked for.
  if name in _FLAX_NAMES:
    from dynjax.route import _flax

    return getattr(_flax, name)
  raise AttributeError(f"module 'dynjax.route' has no attribute {name!r}")
