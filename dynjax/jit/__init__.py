"""``dynjax.jit``: bucketed, padded XLA executables for functions with dynamic shapes.

The package behind the public ``dynjax.jit`` (modules are private: ``_api`` the entry point
and ``Wrapped``; ``_options`` option checks; ``_args`` argument binding; ``_family`` one
static signature; ``_dispatch`` the run routine; ``_serving`` the compiler; ``_stats``
counters and reports; ``_stages`` Traced/Lowered/Compiled; ``_cache``, ``_store``,
``_scheduler``, ``_sharding`` their collaborators).
"""

from dynjax.jit._api import Wrapped as Wrapped
from dynjax.jit._api import jit as jit
from dynjax.jit._stages import Compiled as Compiled
from dynjax.jit._stages import Lowered as Lowered
from dynjax.jit._stages import Traced as Traced

__all__ = ["Compiled", "Lowered", "Traced", "Wrapped", "jit"]
