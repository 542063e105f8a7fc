"""Bucket policies: which padded size serves a true size.

A policy is a plain object, testable without JAX.  The dispatcher asks ``bucket(n)`` on every
call (hot path: a bisect over a precomputed tuple, ~0.3 us), ``sizes()`` for warm-up, and
``observe(n)`` so that the profile-guided :func:`auto` policy can re-plan.

Every policy has a ``min`` and a ``max`` (``None``: unbounded).  ``bucket(n)`` returns ``None``
when ``n > max``; what happens then is the function's ``overflow`` option, and ``grow(n)``
gives the bucket the policy's own rule would pick past ``max``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

import numpy as np

from dynjax._errors import PolicyError


def _check_int(name: str, value, minimum: int, policy: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise PolicyError(
        f"dynjax.buckets.{policy}: {name} must be an integer, got {type(value).__name__} "
        f"{value!r}")
  if value < minimum:
    raise PolicyError(f"dynjax.buckets.{policy}: {name} must be >= {minimum}, got {value}")
  return int(value)


def _check_range(lo: int, hi: int | None, policy: str) -> None:
  if hi is not None and hi < lo:
    raise PolicyError(
        f"dynjax.buckets.{policy}: max={hi} is smaller than min={lo}; give max >= min")


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


class BucketPolicy:
  """Base class: maps a true size to a padded size.

  Subclasses define ``_rule(n)`` (the unbounded rule) and may precompute ``_table``.
  """

  name = "policy"

  def __init__(self, min: int, max: int | None, multiple: int = 1):
    self.min = min
    self.max = max
    self.multiple = multiple
    self._table: tuple[int, ...] | None = None
    if max is not None:
      self._table = self._build_table()

  # -- to override -------------------------------------------------------------------------
  def _rule(self, n: int) -> int:
    """The smallest size >= n that the unbounded policy would use (before ``multiple``)."""
    raise NotImplementedError

  def _args(self) -> str:
    raise NotImplementedError

  def _clone(self, multiple: int) -> BucketPolicy:
    raise NotImplementedError

  # -- shared machinery --------------------------------------------------------------------
  def _aligned_rule(self, n: int) -> int:
    return _round_up(self._rule(max(n, self.min)), self.multiple)

  def _build_table(self) -> tuple[int, ...]:
    out: list[int] = []
    n = self.min
    while True:
      b = self._aligned_rule(n)
      if b > self.max:
        break
      out.append(b)
      n = b + 1
    top = _round_up(self.max, self.multiple)
    if not out or out[-1] < top:
      out.append(top)  # the declared max is always a bucket, so every n <= max is served
    return tuple(out)

  def bucket(self, n: int) -> int | None:
    """The padded size for true size ``n``; ``None`` when ``n`` is above ``max``."""
    table = self._table
    if table is not None:
      i = bisect.bisect_left(table, n)
      return table[i] if i < len(table) else None
    return self._aligned_rule(n)

  def grow(self, n: int) -> int:
    """The bucket past ``max`` for ``overflow="grow"``: the policy's rule, unbounded."""
    return self._aligned_rule(n)

  def sizes(self) -> tuple[int, ...]:
    """Every bucket size in ``[min, max]`` (needs a ``max``)."""
    if self._table is None:
      raise PolicyError(
          f"{self!r} has no max, so its buckets cannot be listed (warm-up needs them); "
          "give max=...")
    return self._table

  def warm_sizes(self) -> tuple[int, ...]:
    """The buckets ``warmup()`` builds: every size of the table (``Auto`` overrides it)."""
    return self.sizes()

  def observe(self, n: int) -> None:
    """Records one call's true size (used by profile-guided policies)."""

  def is_bucket(self, b: int) -> bool:
    """Whether ``b`` is one of this policy's buckets now (no side effects)."""
    table = self._table
    if table is not None:
      i = bisect.bisect_left(table, b)
      return i < len(table) and table[i] == b
    return self._aligned_rule(b) == b

  def adopt(self, b: int) -> None:
    """Told that bucket ``b`` exists already (loaded from an executable store)."""

  def record_time(self, bucket: int, seconds: float) -> None:
    """Records a measured run time of ``bucket`` (used by profile-guided policies)."""

  def record_compile(self, bucket: int, seconds: float,
                     max_executables: int | None = None) -> None:
    """Records that ``bucket`` took ``seconds`` to build, in a function that keeps at most
    ``max_executables`` executables (used by value-decided policies)."""

  def aligned(self, multiple: int) -> BucketPolicy:
    """This policy with every bucket a multiple of ``multiple`` (e.g. a mesh axis size)."""
    multiple = _check_int("multiple", multiple, 1, self.name)
    if multiple == self.multiple:
      return self
    return self._clone(math.lcm(multiple, self.multiple))

  def fresh(self) -> BucketPolicy:
    """A copy with no recorded observations (one per dimension variable and function)."""
    return self._clone(self.multiple)

  def expected_waste(self, sizes: Iterable[int]) -> float:
    """Padded fraction ``1 - sum(n) / sum(bucket(n))`` over a sample of true sizes."""
    true = padded = 0
    for n in sizes:
      b = self.bucket(n)
      b = self.grow(n) if b is None else b
      true += n
      padded += b
    return 0.0 if padded == 0 else 1.0 - true / padded

  def __repr__(self) -> str:
    extra = f", multiple={self.multiple}" if self.multiple != 1 else ""
    return f"dynjax.buckets.{self.name}({self._args()}{extra})"


class Pow2(BucketPolicy):
  name = "pow2"

  def _rule(self, n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

  def _args(self) -> str:
    return f"min={self.min}, max={self.max}"

  def _clone(self, multiple):
    return Pow2(self.min, self.max, multiple)


class Linear(BucketPolicy):
  name = "linear"

  def __init__(self, step: int, min: int, max: int | None, multiple: int = 1):
    self.step = step
    super().__init__(min, max, multiple)

  def _rule(self, n: int) -> int:
    return _round_up(n, self.step)

  def _args(self) -> str:
    return f"step={self.step}, min={self.min}, max={self.max}"

  def _clone(self, multiple):
    return Linear(self.step, self.min, self.max, multiple)


class Geometric(BucketPolicy):
  name = "geometric"

  def __init__(self, ratio: float, min: int, max: int | None, multiple: int = 1):
    self.ratio = ratio
    super().__init__(min, max, multiple)

  def _rule(self, n: int) -> int:
    # Sizes min, ceil(min*r), ceil(min*r^2), ...; computed by iteration so it is exact.
    b = max(self.min, 1)
    while b < n:
      b = max(b + 1, math.ceil(b * self.ratio))
    return b

  def _args(self) -> str:
    return f"ratio={self.ratio}, min={self.min}, max={self.max}"

  def _clone(self, multiple):
    return Geometric(self.ratio, self.min, self.max, multiple)


class Explicit(BucketPolicy):
  name = "explicit"

  def __init__(self, sizes: Sequence[int], multiple: int = 1):
    self.explicit = tuple(sorted(set(sizes)))
    super().__init__(self.explicit[0] if self.explicit else 1,
                     self.explicit[-1] if self.explicit else 1, multiple)

  def _build_table(self) -> tuple[int, ...]:
    return tuple(sorted({_round_up(s, self.multiple) for s in self.explicit}))

  def _rule(self, n: int) -> int:
    # Past the largest size ("grow"), continue with powers of two.
    i = bisect.bisect_left(self.explicit, n)
    return self.explicit[i] if i < len(self.explicit) else 1 << (n - 1).bit_length()

  def _args(self) -> str:
    return f"{list(self.explicit)}"

  def _clone(self, multiple):
    return Explicit(self.explicit, multiple)


# -- public constructors ---------------------------------------------------------------------
def pow2(min: int = 1, max: int | None = None) -> BucketPolicy:
  """Powers of two between ``min`` and ``max`` (``max`` itself is always a bucket).

  Example:
    >>> dynjax.buckets.pow2(min=16, max=100).sizes()
    (16, 32, 64, 100)
  """
  lo = _check_int("min", min, 1, "pow2")
  hi = None if max is None else _check_int("max", max, 1, "pow2")
  _check_range(lo, hi, "pow2")
  return Pow2(lo, hi)


def linear(step: int, min: int = 1, max: int | None = None) -> BucketPolicy:
  """Multiples of ``step`` between ``min`` and ``max``.

  Example:
    >>> dynjax.buckets.linear(32, min=1, max=128).sizes()
    (32, 64, 96, 128)
  """
  step = _check_int("step", step, 1, "linear")
  lo = _check_int("min", min, 1, "linear")
  hi = None if max is None else _check_int("max", max, 1, "linear")
  _check_range(lo, hi, "linear")
  return Linear(step, lo, hi)


def geometric(ratio: float = 1.5, min: int = 1, max: int | None = None) -> BucketPolicy:
  """Sizes ``min, ceil(min*ratio), ...`` up to ``max``: constant relative waste.

  Example:
    >>> dynjax.buckets.geometric(2.0, min=10, max=100).sizes()
    (10, 20, 40, 80, 100)
  """
  if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 1.0:
    raise PolicyError(f"dynjax.buckets.geometric: ratio must be a number > 1, got {ratio!r}")
  lo = _check_int("min", min, 1, "geometric")
  hi = None if max is None else _check_int("max", max, 1, "geometric")
  _check_range(lo, hi, "geometric")
  return Geometric(float(ratio), lo, hi)


def explicit(sizes: Iterable[int]) -> BucketPolicy:
  """Exactly the given sizes (a plain list passed as a policy means the same).

  Example:
    >>> dynjax.buckets.explicit([8, 32, 128]).bucket(20)
    32
  """
  try:
    sizes = list(sizes)
  except TypeError:
    raise PolicyError(
        f"dynjax.buckets.explicit: sizes must be an iterable of integers, got {sizes!r}") from None
  if not sizes:
    raise PolicyError("dynjax.buckets.explicit: sizes is empty; give at least one size")
  checked = [_check_int(f"sizes[{i}]", s, 1, "explicit") for i, s in enumerate(sizes)]
  return Explicit(checked)


def as_policy(value, where: str) -> BucketPolicy:
  """Accepts a policy, a list of sizes (explicit) or None; raises naming ``where``."""
  if isinstance(value, BucketPolicy):
    return value
  if isinstance(value, list | tuple):
    return explicit(value)
  raise PolicyError(
      f"buckets{where}: expected a dynjax.buckets policy (pow2, linear, geometric, explicit, "
      f"auto) or a list of sizes, got {type(value).__name__} {value!r}")
