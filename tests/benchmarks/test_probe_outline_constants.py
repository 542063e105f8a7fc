"""``benchmarks/probe_outline_constants.py`` on CPU, small: depth-scaled layers are one template
with outlining on, flat with it off, and as close to ``jax.jit`` either way."""

from __future__ import annotations

import json

from benchmarks import probe_outline_constants
from dynjax.bucketing import _outline


def test_depth_scaled_layers_are_one_template_only_with_outlining(tmp_path):
  report = probe_outline_constants.main(["--layers", "2", "--rounds", "2", "--out",
                                         str(tmp_path)])
  assert _outline.config.outline  # the switch is left as it was
  rows = report["rows"]
  assert [r["one_template"] for r in rows["on"]] == [True, True]
  assert [r["one_template"] for r in rows["off"]] == [False, False]
  assert all(r["error"] < 1e-4 and r["first_s"] > 0 and r["second_s"] > 0
             for rs in rows.values() for r in rs)
  saved = json.loads((tmp_path / "probe_outline_constants.json").read_text())
  assert saved["layers"] == 2 and set(saved["rows"]) == {"on", "off"}
