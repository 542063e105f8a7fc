"""Bucketing: policies (which padded size serves a true size) and the padding pass."""

from dynjax.bucketing._auto import auto as auto
from dynjax.bucketing._padding import PaddingPlan as PaddingPlan
from dynjax.bucketing._padding import pad_jaxpr as pad_jaxpr
from dynjax.bucketing._padding import rule_coverage as rule_coverage
from dynjax.bucketing._policies import BucketPolicy as BucketPolicy
from dynjax.bucketing._policies import explicit as explicit
from dynjax.bucketing._policies import geometric as geometric
from dynjax.bucketing._policies import linear as linear
from dynjax.bucketing._policies import pow2 as pow2

__all__ = ["BucketPolicy", "PaddingPlan", "auto", "explicit", "geometric", "linear", "pad_jaxpr",
           "pow2", "rule_coverage"]
