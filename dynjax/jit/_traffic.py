"""A family's traffic kept beside its executables: a restarted server plans from what the
processes before it saw, not from nothing.

An ``auto`` policy learns its buckets from the sizes a process serves and the seconds each
bucket takes.  Until now that knowledge died with the process: a server restarted on its
``cache_dir`` loaded the executables its predecessor had stored (often only the start-up
ladder, ``max``, ``max/2``, ... when that process stopped before its background compiles
caught up) and planned again from nothing.  H100 cost curve of issue 18 (BERT-base fp32,
``benchmarks/sim_buckets.py``'s stream): the ladder of four serves at 1.225x the exact-shape
cost, the plan of 16 at 1.045x; the two most valuable planned buckets alone reach 1.114x.

Kept: ``<cache_dir>/<fingerprint>/traffic.json`` (the family's store directory): per dimension
variable, its ``auto`` policy's :meth:`~dynjax.bucketing._auto.Auto.traffic` (sizes seen,
seconds per call and compile seconds per bucket).  Written by a daemon thread after each
re-plan of a policy (at 8, 16, 32, ... calls: a few times a process; a temporary file renamed
into place), so it holds the process's traffic merged with what it restored.

Restored (:func:`restore`, once a family, where a restart already looks at its store: the
warm-up and the first call of a function with ``async_compile``/``serving``): each policy takes
its record back (:meth:`~dynjax.bucketing._auto.Auto.restore`) and re-plans; the buckets that
plan adds to the stored ones are built by ``warmup(background=True)`` in the order that saves
the most first (:func:`warm_order`), as value-ordered jobs (:func:`at_startup`: not before
traffic, where they slowed a server's own start-up): they compile when the traffic the process
sees makes them worth it (the contention rule), as any other bucket.  Where they were queued
as warm jobs (before session 37, on hosts of ``_scheduler.STARTUP_CORES`` cores), the first
call (:func:`first_call`) demotes those not yet started.

A record of another policy (its ``repr`` differs), of another fingerprint, or one that cannot
be read is ignored (logged; the next save replaces it).  Joint plans (several ``auto`` dims)
keep nothing.  ``DYNJAX_KEEP_TRAFFIC=0`` turns it off.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import weakref

from dynjax._config import config
from dynjax.bucketing import _auto

FILE = "traffic.json"
_FORMAT = 1
logger = logging.getLogger("dynjax")
# family -> {"restored": a kept record was taken, "new": buckets the restored plan added to
# the stored ones (warm jobs until the first call)}
_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _keeps(fam) -> list[tuple[int, _auto.Auto]]:
  """(index, policy) of the family's ``auto`` policies that keep their traffic."""
  joint = () if fam.joint is None else fam.joint.idx
  return [(i, p) for i, p in enumerate(fam.policies)
          if isinstance(p, _auto.Auto) and i not in joint]


def path(store) -> str:
  return os.path.join(store.dir, FILE)


def load(store) -> list | None:
  """The kept per-variable records (None where a variable keeps nothing), or None."""
  try:
    with open(path(store)) as fh:
      rec = json.load(fh)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    logger.info("dynjax: %s ignored (%s: %s)", path(store), type(e).__name__, e)
    return None
  if (not isinstance(rec, dict) or rec.get("format") != _FORMAT
      or rec.get("fingerprint") != store.fingerprint or not isinstance(rec.get("policies"), list)):
    logger.info("dynjax: %s ignored (another format or family)", path(store))
    return None
  return rec["policies"]


def save(fam) -> bool:
  """Writes the family's traffic (its policies' records) into its store directory."""
  store = fam.store()
  keeps = _keeps(fam)
  if store is None or not keeps:
    return False
  recs: list = [None] * len(fam.policies)
  for i, p in keeps:
    recs[i] = p.traffic()
  data = {"format": _FORMAT, "fingerprint": store.fingerprint, "function": fam.name,
          "policies": recs}
  try:
    os.makedirs(store.dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=store.dir, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
      json.dump(data, fh)
    os.replace(tmp, path(store))
  except OSError as e:  # a read-only cache_dir: the store itself warns about it
    logger.info("dynjax: %s not written (%s)", path(store), e)
    return False
  return True


def _save_soon(ref) -> None:
  fam = ref()
  if fam is not None:  # a re-plan runs on a serving thread: the file is written off it
    threading.Thread(target=save, args=(fam,), name="dynjax-traffic", daemon=True).start()


def restore(fam) -> bool:
  """Once a family: its policies take back the traffic its store kept and re-plan, and start
  keeping their own.  Whether a record was taken."""
  with _LOCK:
    if fam in _STATE:
      return False
    _STATE[fam] = st = {"restored": False, "new": set()}
  store = fam.store()
  keeps = _keeps(fam)
  if not config.keep_traffic or store is None or not keeps:
    return False
  ref = weakref.ref(fam)
  for _, p in keeps:
    p.on_replan = lambda ref=ref: _save_soon(ref)
  recs = load(store)
  if recs is None or len(recs) != len(fam.policies):
    return False
  taken = 0
  for i, p in keeps:
    try:
      if recs[i] is not None and p.restore(recs[i]):
        taken = max(taken, int(recs[i]["observations"]))
    except (KeyError, TypeError, ValueError) as e:
      logger.info("dynjax: %s: variable %d's record ignored (%s: %s)", path(store), i,
                  type(e).__name__, e)
  st["restored"] = bool(taken)
  if taken:
    logger.info("dynjax: %s plans from the traffic its cache_dir kept (%d calls): %s", fam.name,
                taken, ", ".join(f"{fam.sig.var_order[i]} {p.table}" for i, p in keeps))
  return bool(taken)


def warm_order(fam, todo, stored) -> list[tuple]:
  """The warm-up's build order: the ``stored`` buckets and the cold ladder largest first (as
  before), then the buckets a restored plan adds to the stored ones, the most valuable first
  (by the family's one ``auto`` variable's policy; by size where there are several)."""
  st = _STATE.get(fam, {})
  new = set()
  if st.get("restored"):
    new = set(todo) - set(stored)
    st["new"] = st["new"] | new
  rest = sorted(set(todo) - new, key=math.prod, reverse=True)
  keeps = _keeps(fam)
  if not new:
    return rest
  if len(keeps) != 1:
    return rest + sorted(new, key=math.prod, reverse=True)
  i, p = keeps[0]
  by_size: dict = {}
  for b in new:
    by_size.setdefault(b[i], []).append(b)
  order = p.value_order(set(by_size), {b[i] for b in rest})
  return rest + [b for s in order for b in sorted(by_size[s], key=math.prod, reverse=True)]


def at_startup(fam, bkey) -> bool:
  """Whether a background warm-up builds ``bkey`` now, before traffic (a warm job): every
  bucket it built before (stored) and the cold ladder, not the buckets a restored plan adds.
  Those wait for the traffic the process sees, as value-ordered jobs, on every host.  Why:
  H200 (jax 0.11.2, BERT-base fp32, serve_fresh, four paired rounds, session 37), restarts
  that compiled the 4-5 new buckets before traffic (two at once, 16 cores) against restarts
  that left them to traffic (none was worth building during the first 1,000 requests):
  start to the 1,000th answer 16.3 / 21.2 / 18.0 / 19.1 s against 17.8 / 14.9 / 17.1 / 15.8,
  the stream 3.88 / 3.40 / 3.78 / 3.83 s against 3.44 / 3.38 / 3.45 / 3.31; their lowering
  and compiles slowed the server's own start-up, and the buckets they added did not pay for
  it in the first 1,000 requests.  (On a 2-core CPU box, ten of them took 9 s more of a
  start-up building its requests: session 35.)"""
  return bkey not in _STATE.get(fam, {}).get("new", ())


def first_call(fam, sched) -> int:
  """The family's first call: the restored plan's buckets still queued as warm jobs become
  value-ordered jobs (the contention rule decides them from here).  Returns how many.  With
  today's :func:`at_startup` none is queued warm (0); kept for a rule that queues them so,
  as serve_fresh's ``_startnew`` experiment does (the rule of sessions 35-36)."""
  new = _STATE.get(fam, {}).get("new")
  if not new or sched is None:
    return 0
  return sched.demote(lambda job: job.info is not None and job.info[0] is fam
                      and job.info[1] in new)
