"""What ``import dynjax`` does to the process: nothing a user must do before it is spoiled."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from dynjax.jit import _args


def test_importing_dynjax_starts_no_backend():
  # jax settings that must come before any backend exists (jax_num_cpu_devices,
  # jax.distributed.initialize(), jax_platforms) still work after importing every public
  # part of dynjax.  Before, making an array at import time started the default backend, and
  # this update raised "should be updated before backends are initialized".
  script = textwrap.dedent("""
      import dynjax, dynjax.flax, dynjax.route, dynjax.control, dynjax.runtime
      import jax, numpy as np
      jax.config.update("jax_num_cpu_devices", 3)
      print(len(jax.devices("cpu")))
      f = dynjax.jit(lambda x: x * 2, dims={"x": "t"}, padding="trust")
      print(float(f(jax.device_put(np.ones(5, np.float32))).sum()))
  """)
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.split() == ["3", "10.0"], r.stdout


def test_the_exact_array_type_is_the_one_jax_makes():
  # The dispatcher's fast path tests ``type(x) is ARRAY_IMPL``: it must be jax's class.
  assert type(jnp.zeros(3)) is _args.ARRAY_IMPL
  assert type(jax.device_put(np.zeros((), np.float32))) is _args.ARRAY_IMPL
  assert issubclass(_args.ARRAY_IMPL, jax.Array)
