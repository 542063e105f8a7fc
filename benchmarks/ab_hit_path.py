"""The hit path of two dynjax trees side by side: ``bench_hit_path.py`` run on each, alternating.

  python benchmarks/ab_hit_path.py --base DIR [--reps 2] [--size base] [--iters 200] [--out DIR]

``--base`` is another checkout of dynjax (e.g. ``git worktree add /tmp/base <commit>``); the
tree this script sits in is "new".  Each rep runs ``bench_hit_path.py`` in a fresh process per
tree (base, new, base, new, ...) with that tree's ``dynjax`` first on ``PYTHONPATH`` and this
tree's ``benchmarks`` package (models, data) for both, so the two differ only in the library.
The figure per case is the median over reps of dynjax's overhead above the bucket's own AOT
executable (``bench_hit_path.py`` already takes the median over alternating call blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._report import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_once(tree: str, args, out_dir: str) -> dict:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, ROOT]), PYTHONUNBUFFERED="1")
  cmd = [sys.executable, os.path.join(HERE, "bench_hit_path.py"), "--size", args.size,
         "--iters", str(args.iters), "--out", out_dir]
  subprocess.run(cmd, env=env, check=True, cwd=ROOT)
  with open(os.path.join(out_dir, "hit_path.json")) as fh:
    res = json.load(fh)
  used = res["versions"].get("dynjax", "")
  if not used.startswith(os.path.join(tree, "dynjax")):  # the comparison would be void
    raise RuntimeError(f"the run for {tree} imported dynjax from {used}")
  return res


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--base", required=True, help="a checkout of the baseline dynjax")
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--size", default="base")
  ap.add_argument("--iters", type=int, default=200)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  runs: dict[str, list[dict]] = {"base": [], "new": []}
  with tempfile.TemporaryDirectory() as tmp:
    for rep in range(args.reps):
      for name, tree in (("base", os.path.abspath(args.base)), ("new", ROOT)):
        print(f"--- rep {rep}: {name} ({tree})", flush=True)
        runs[name].append(run_once(tree, args, os.path.join(tmp, f"{name}{rep}")))
  cases = [k for k, v in runs["new"][0].items() if isinstance(v, dict) and "overhead_us" in v]
  table = {}
  print(f"\n{'case':<34} {'AOT us':>9} {'base +us':>9} {'new +us':>9} {'new-base':>9}")
  for case in cases:
    aot = float(np.median([r[case]["aot_us"] for side in runs.values() for r in side]))
    base = float(np.median([r[case]["overhead_us"] for r in runs["base"]]))
    new = float(np.median([r[case]["overhead_us"] for r in runs["new"]]))
    table[case] = {"aot_us": aot, "base_overhead_us": base, "new_overhead_us": new,
                   "base_runs": [r[case]["overhead_us"] for r in runs["base"]],
                   "new_runs": [r[case]["overhead_us"] for r in runs["new"]]}
    print(f"{case:<34} {aot:9.1f} {base:+9.1f} {new:+9.1f} {new - base:+9.1f}")
  res = {"versions": runs["new"][0].get("versions"), "reps": args.reps, "cases": table}
  write_json(args.out, "ab_hit_path.json", res)
  return res


if __name__ == "__main__":
  main()
