"""dynjax: a dynamic-shape compiler frontend for JAX/XLA.

``dynjax.jit`` traces a function once with symbolic dimensions, compiles a small family of
padded, bucketed XLA executables and dispatches each call to the right one, returning results
of the exact unpadded shapes.
"""

import importlib

from dynjax import buckets as buckets
from dynjax import flax as flax
from dynjax._errors import ControlFlowError as ControlFlowError
from dynjax._errors import DtypeMismatchError as DtypeMismatchError
from dynjax._errors import DynjaxError as DynjaxError
from dynjax._errors import OutOfBucketsError as OutOfBucketsError
from dynjax._errors import PaddingFallbackError as PaddingFallbackError
from dynjax._errors import PaddingMismatchError as PaddingMismatchError
from dynjax._errors import PolicyError as PolicyError
from dynjax._errors import RoutingError as RoutingError
from dynjax._errors import ShapeMismatchError as ShapeMismatchError
from dynjax._errors import ShardingError as ShardingError
from dynjax._errors import SpecError as SpecError
from dynjax._padded import Padded as Padded
from dynjax.jit import Compiled as Compiled
from dynjax.jit import Lowered as Lowered
from dynjax.jit import Traced as Traced
from dynjax.jit import Wrapped as Wrapped
from dynjax.jit import jit as jit

__version__ = "0.1.0"

# Imported on first use (PEP 562): the control-flow VM and the routers are ~0.13 s of imports
# (Pallas among them) that a server using only dynjax.jit does not need at start-up.
_LAZY_MODULES = ("control", "route", "runtime")
_LAZY_NAMES = {"cell": "control", "cond": "control", "recursive": "control",
               "while_loop": "control"}


def __getattr__(name: str):
  if name in _LAZY_MODULES:
    mod = importlib.import_module(f"dynjax.{name}")
  elif name in _LAZY_NAMES:
    mod = getattr(importlib.import_module(f"dynjax.{_LAZY_NAMES[name]}"), name)
  else:
    raise AttributeError(f"module 'dynjax' has no attribute {name!r}")
  globals()[name] = mod
  return mod


def __dir__():
  return sorted(set(globals()) | set(__all__))

__all__ = [
    "Compiled",
    "ControlFlowError",
    "DtypeMismatchError",
    "DynjaxError",
    "Lowered",
    "OutOfBucketsError",
    "Padded",
    "PaddingFallbackError",
    "PaddingMismatchError",
    "PolicyError",
    "RoutingError",
    "ShapeMismatchError",
    "ShardingError",
    "SpecError",
    "Traced",
    "Wrapped",
    "buckets",
    "cell",
    "cond",
    "control",
    "flax",
    "jit",
    "recursive",
    "route",
    "runtime",
    "while_loop",
]
