"""Who holds the GIL, and where the main thread's CPU goes, while a fresh serving process
builds its request list (issue 18, goal 3: a cold dynjax process spends 0.5-0.9 s more wall
than CPU on that list, and torch's process none).

  python -m benchmarks.probe_gil_holders --out $OUT \\
      --modes torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart --rounds 2

Each mode runs as ``serve_fresh``'s child (the same command and environment; a restart mode
on a copy of the cache its cold mode left).  Two py-spy samplers attach without pausing the
child (``--nonblocking``) from the mark that starts the phase (torch: ``backend``; dynjax:
``warmup_started``) until the ``requests`` mark: one records only the threads that hold the
GIL (``--gil``: each thread's share of it, and what the other threads run while they hold
it), the other every running thread (where the main thread's own samples go, function by
function, to set beside torch's process).  py-spy comes from ``--py-spy`` or ``PATH`` (the GPU
machine has none: carry a copy in ``.tools/``).  Writes ``probe_gil_holders.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import serve_fresh
from benchmarks._report import write_json

_LINE = re.compile(r"^thread \((\w+)\): (.*) (\d+)$")


def parse_raw(text: str) -> list[tuple[str, str, list[str], int]]:
  """py-spy's raw (collapsed) output with ``--threads``: ``(thread id, thread name, frames
  from the outermost, samples)`` per line."""
  out = []
  for line in text.splitlines():
    m = _LINE.match(line.strip())
    if not m:
      continue
    tid, stack, n = m.groups()
    name, *frames = stack.split(";")
    out.append((tid, name, frames, int(n)))
  return out


def _where(frames: list[str], depth: int = 3) -> str:
  """The innermost ``depth`` frames of a stack, innermost last (file names without dirs)."""
  short = [re.sub(r"\(.*/", "(", f) for f in frames[-depth:]]
  return " < ".join(reversed(short))


def _owner(frames: list[str]) -> str:
  """The innermost frame in dynjax, examples or benchmarks code (who asked for the work)."""
  for f in reversed(frames):
    if re.search(r"/(dynjax|examples|benchmarks)/", f):
      return re.sub(r"\(.*/", "(", f)
  return "(no dynjax/benchmark frame)"


def summarize(gil: list, cpu: list, top: int = 15) -> dict:
  """Shares of the GIL per thread, what the other threads run while they hold it, and the
  main thread's running samples by innermost function."""
  held = collections.Counter()
  others = collections.Counter()
  owners = collections.Counter()
  for _, name, frames, n in gil:
    main = name == "MainThread"
    held["main" if main else "other threads"] += n
    if not main:
      others[_where(frames)] += n
      owners[_owner(frames)] += n
  total = sum(held.values()) or 1
  main_fn = collections.Counter()
  main_n = 0
  for _, name, frames, n in cpu:
    if name == "MainThread":
      main_fn[_where(frames, 1)] += n
      main_n += n
  return {"gil_samples": sum(held.values()),
          "gil_share": {k: round(v / total, 4) for k, v in held.items()},
          "other_threads_holding": [(k, v) for k, v in others.most_common(top)],
          "other_threads_by_dynjax_frame": [(k, v) for k, v in owners.most_common(top)],
          "main_running_samples": main_n,
          "main_by_function": [(k, round(v / (main_n or 1), 4))
                               for k, v in main_fn.most_common(top)]}


def _watch(args, mode, cache, pyspy, workdir) -> dict:
  """Runs ``mode``'s child; samples it between the marks; returns the child's record with
  the samples' summary under ``gil_probe``."""
  cmd, env = serve_fresh.child_command(args, mode, cache)
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)
  start = "backend" if mode == "torch_eager" else "warmup_started"
  spies: list[subprocess.Popen] = []
  outs = {k: os.path.join(workdir, f"{mode}-{k}-{proc.pid}.txt") for k in ("gil", "cpu")}
  marks: dict[str, float] = {}
  tail: list[str] = []

  def read_stderr():
    for line in proc.stderr:
      tail.append(line)
      m = re.search(r"serve_fresh mark (\S+) ([\d.]+)", line)
      if not m:
        continue
      marks[m.group(1)] = float(m.group(2))
      if m.group(1) == start and not spies:
        for k, extra in (("gil", ["--gil"]), ("cpu", [])):
          spies.append(subprocess.Popen(
              [pyspy, "record", "--pid", str(proc.pid), "--nonblocking", "--threads",
               "--full-filenames",
               "-r", str(args.rate), "-f", "raw", "-o", outs[k], *extra],
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
      elif m.group(1) == "requests":
        for s in spies:
          s.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits

  got: list[str] = []
  reader = threading.Thread(target=read_stderr, daemon=True)
  reader.start()  # (stderr has this one reader: communicate() would race it for lines)
  out_reader = threading.Thread(target=lambda: got.append(proc.stdout.read()), daemon=True)
  out_reader.start()
  try:
    proc.wait(timeout=args.timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    for s in spies:
      s.kill()
    return {"mode": mode, "error": f"timed out after {args.timeout:.0f} s"}
  reader.join(5)
  out_reader.join(5)
  stdout = got[0] if got else ""
  for s in spies:
    try:
      s.wait(20)
    except subprocess.TimeoutExpired:
      s.kill()
  lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
  rec = (json.loads(lines[-1][len("RESULT "):]) if lines else
         {"mode": mode, "error": f"rc={proc.returncode}: {''.join(tail)[-2000:]}"})
  samples = {}
  for k, path in outs.items():
    try:
      with open(path) as fh:
        samples[k] = parse_raw(fh.read())
    except OSError:
      samples[k] = []
  rec["gil_probe"] = {"window": [marks.get(start), marks.get("requests")],
                      "marks_seen": sorted(marks),
                      **summarize(samples["gil"], samples["cpu"])}
  return rec


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None)
  p.add_argument("--modes", default="torch_eager,dynjax_auto16_warm,dynjax_auto16_warm_restart")
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
  p.add_argument("--py-spy", dest="pyspy", default=None)
  p.add_argument("--timeout", type=float, default=90.0)
  p.add_argument("--size", default="base")
  p.add_argument("--requests", type=int, default=1000)
  ours = p.parse_args(argv)
  pyspy = ours.pyspy or shutil.which("py-spy")
  if not pyspy:
    raise SystemExit("probe_gil_holders: py-spy not found: pass --py-spy PATH")
  args = serve_fresh._parse(["--size", ours.size, "--requests", str(ours.requests)])
  args.rate, args.timeout = ours.rate, ours.timeout
  tmp = tempfile.mkdtemp(prefix="gil_holders_")
  args.bytecode = serve_fresh._compile_checkout(os.path.join(tmp, "pyc"))
  serve_fresh._requests(args)  # the stdlib's sources in the page cache, as serve_fresh does
  results: list = []
  caches: dict = {}
  for k in range(ours.rounds):
    for mode in serve_fresh.round_order([m for m in ours.modes.split(",") if m], k):
      cache, why = serve_fresh.mode_cache(mode, caches, tmp, len(results), pristine=True)
      if why is not None:
        results.append({"mode": mode, "round": k, "error": why})
        continue
      t = time.time()
      rec = _watch(args, mode, cache, pyspy, tmp)
      rec["round"], rec["wall_s"] = k, round(time.time() - t, 2)
      serve_fresh.keep_cold(mode, cache)  # what the restarts start from
      results.append(rec)
      g = rec.get("gil_probe", {})
      print(f"{mode} round {k}: start->last {rec.get('start_to_last_s')}, window "
            f"{g.get('window')}, GIL {g.get('gil_share')}, main running samples "
            f"{g.get('main_running_samples')}", flush=True)
      for where, n in g.get("other_threads_by_dynjax_frame", [])[:6]:
        print(f"    {n:6d}  {where}", flush=True)
  out = {"python": sys.version.split()[0], "results": results}
  write_json(ours.out, "probe_gil_holders.json", out)
  shutil.rmtree(tmp, ignore_errors=True)
  return out


if __name__ == "__main__":
  main()
