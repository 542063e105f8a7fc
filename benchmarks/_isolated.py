"""Probes that run each configuration in a fresh process (no shared jax caches, own XLA_FLAGS).

The child prints its record as one line tagged :data:`TAG` (:func:`emit`); the parent runs it
with :func:`run`, echoes the child's other output and returns the record, or
``{"error": ...}`` on a timeout or when no record came (the tail of its stderr).
"""

from __future__ import annotations

import json
import os
import subprocess

TAG = "CHILD_RESULT "


def emit(record) -> None:
  print(TAG + json.dumps(record), flush=True)


def env_with_xla_flags(flags: str) -> dict:
  """This process's environment with ``flags`` appended to ``XLA_FLAGS``."""
  return dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())


def run(cmd: list[str], env: dict | None, timeout: float):
  try:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    print(f"timed out after {timeout:.0f} s", flush=True)
    return {"error": f"timed out after {timeout:.0f} s"}
  lines = p.stdout.splitlines()
  print("\n".join(ln for ln in lines if not ln.startswith(TAG)), flush=True)
  found = [ln for ln in lines if ln.startswith(TAG)]
  if found:
    return json.loads(found[-1][len(TAG):])
  err = f"rc {p.returncode}: {p.stderr[-1500:]}"
  print(err, flush=True)
  return {"error": err}
