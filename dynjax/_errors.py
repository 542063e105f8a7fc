"""The dynjax exception hierarchy.

Every error derives from :class:`DynjaxError` and from the builtin that matches it, so
``except ValueError`` keeps working for callers that do not know dynjax.  Messages say what was
expected, what came, where (the argument keypath) and how to fix it, and list every mismatch
rather than the first one.
"""

from __future__ import annotations

import sys


class DynjaxError(Exception):
  """Base class of every error raised by dynjax."""


class SpecError(DynjaxError, ValueError):
  """A ``dims``/``buckets``/option given to ``dynjax.jit`` is malformed."""


class PolicyError(DynjaxError, ValueError):
  """A bucket policy was built with invalid arguments."""


class ShapeMismatchError(DynjaxError, ValueError):
  """Call arguments do not match the declared symbolic shapes (rank, static dim, variable)."""


class DtypeMismatchError(DynjaxError, TypeError):
  """No longer raised: an argument of another dtype is traced again, as ``jax.jit`` does (a
  family of its own).  Kept so that ``except dynjax.DtypeMismatchError`` still works."""


class OutOfBucketsError(DynjaxError, ValueError):
  """A dimension is larger than the largest bucket and ``overflow="error"``."""


class PaddingMismatchError(DynjaxError, AssertionError):
  """``check=True``: the padded executable disagreed with the exact-shape function."""


class PaddingUnsupportedError(DynjaxError, NotImplementedError):
  """The padding pass has no exact rule for an equation (internal: triggers exact fallback)."""


class PaddingFallbackError(DynjaxError, RuntimeError):
  """``on_fallback="error"``: the function would run unpadded (one compile per shape)."""


class ControlFlowError(DynjaxError, ValueError):
  """A ``while_loop``/``cond``/``recursive`` program cannot be built or run as written."""


class RoutingError(DynjaxError, ValueError):
  """A router, gate or path was given inputs it cannot route."""


class ShardingError(DynjaxError, ValueError):
  """A sharding does not fit the function's shapes or the mesh."""


def format_list(lines: list[str], indent: str = "  ") -> str:
  """Joins mismatch lines into the indented block used by every multi-line message."""
  return "\n".join(indent + line for line in lines)


def user_stacklevel() -> int:
  """The ``warnings.warn`` stacklevel of the first frame outside dynjax (the user's call)."""
  level, frame = 1, sys._getframe(1)
  while frame is not None and frame.f_globals.get("__name__", "").startswith("dynjax"):
    frame = frame.f_back
    level += 1
  return level


def needs_program(e: BaseException) -> bool:
  """True when tracing stopped at a dynjax control-flow op (dynjax.control.NeedsProgram)."""
  while e is not None:
    if type(e).__name__ == "NeedsProgram" and type(e).__module__.startswith("dynjax.control"):
      return True
    e = e.__cause__ or e.__context__
  return False
