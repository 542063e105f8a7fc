"""Greedy decoding with a growing token buffer: dynjax.while_loop vs what jax.jit would do.

Run: ``python examples/greedy_decode.py`` (CPU, < 1 min).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

import dynjax.control as dc

# The models and data are importable modules of examples/ (the repository root, not in the wheel).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import decode_lm as D  # noqa: E402

params = D.init_lm(D.LMConfig(d=32, heads=2, ffn=64))
new_tokens = 24
prompts = [np.frombuffer(s.encode()[:n], np.uint8).astype(np.int32)[None]
           for s, n in (("Return the sum of a and b.", 12), ("Parse a URL into six parts.", 20),
                        ("Compute the gcd of two integers.", 27))]
cond, body = D.make_step(params, new_tokens)

compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda ev, s, **kw: compiles.append(s) if ev == "/jax/core/compile/backend_compile_duration"
    else None)

print("dynjax.while_loop: one compiled lax.while_loop per length bucket")
for p in prompts:
  n0 = len(compiles)
  t0 = time.perf_counter()
  out = dc.while_loop(cond, body, D.init_carry(p))
  dt = time.perf_counter() - t0
  st = dc.loop_stats()
  print(f"  prompt {p.shape[1]:3d} -> {out[0].shape[1]:3d} tokens  {dt * 1e3:7.1f} ms  "
        f"host syncs {st['host_syncs']}  buckets {[b[0] for b in st['buckets']]}  "
        f"new compiles {len(compiles) - n0}")

print("plain Python loop of jax.jit on exact shapes: one compile per length, one sync per token")
for p in prompts:
  n0 = len(compiles)
  t0 = time.perf_counter()
  ref, syncs = D.decode_jit_exact(params, p, new_tokens)
  dt = time.perf_counter() - t0
  print(f"  prompt {p.shape[1]:3d} -> {ref[0].shape[1]:3d} tokens  {dt * 1e3:7.1f} ms  "
        f"host syncs {syncs}  new compiles {len(compiles) - n0}")
  out = dc.while_loop(cond, body, D.init_carry(p))
  assert np.array_equal(np.asarray(out[0]), np.asarray(ref[0])), "outputs differ"
print("outputs identical; the program dynjax runs:")
print(dc.loop_program(cond, body, D.init_carry(prompts[0])))
