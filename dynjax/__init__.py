"""dynjax: a dynamic-shape compiler frontend for JAX/XLA.

``dynjax.jit`` traces a function once with symbolic dimensions, compiles a small family of
padded, bucketed XLA executables and dispatches each call to the right one, returning results
of the exact unpadded shapes.
"""

from dynjax import buckets as buckets
from dynjax import control as control
from dynjax import flax as flax
from dynjax import route as route
from dynjax import runtime as runtime
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
from dynjax.control import cell as cell
from dynjax.control import cond as cond
from dynjax.control import recursive as recursive
from dynjax.control import while_loop as while_loop
from dynjax.jit import Compiled as Compiled
from dynjax.jit import Lowered as Lowered
from dynjax.jit import Traced as Traced
from dynjax.jit import Wrapped as Wrapped
from dynjax.jit import jit as jit

__version__ = "0.1.0"

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
