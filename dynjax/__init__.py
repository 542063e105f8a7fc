"""dynjax: a dynamic-shape compiler frontend for JAX/XLA."""
from dynjax import buckets as buckets
from dynjax._errors import *  # noqa: F403  (filled in by the core)
