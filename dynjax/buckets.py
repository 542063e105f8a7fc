"""Bucket policies, the public namespace ``dynjax.buckets``.

Example:
  >>> f = dynjax.jit(fun, dims={"x": "b, t"}, buckets={"t": dynjax.buckets.pow2(16, 1024)})
"""

from dynjax.bucketing._auto import auto as auto
from dynjax.bucketing._policies import BucketPolicy as BucketPolicy
from dynjax.bucketing._policies import explicit as explicit
from dynjax.bucketing._policies import geometric as geometric
from dynjax.bucketing._policies import linear as linear
from dynjax.bucketing._policies import pow2 as pow2

__all__ = ["BucketPolicy", "auto", "explicit", "geometric", "linear", "pow2"]
