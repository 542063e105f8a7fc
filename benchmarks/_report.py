"""Writing a benchmark's JSON report (the one helper every script's ``--out`` goes through)."""

from __future__ import annotations

import json
import os


def write_json(out_dir: str | None, name: str, data, **dump_kw) -> str | None:
  """Writes ``data`` to ``out_dir/name`` (folder created; ``json.dump`` with ``indent=1`` unless
  ``dump_kw`` says otherwise) and returns the path; nothing where ``out_dir`` is empty."""
  if not out_dir:
    return None
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, name)
  with open(path, "w") as fh:
    json.dump(data, fh, **{"indent": 1, **dump_kw})
  return path
