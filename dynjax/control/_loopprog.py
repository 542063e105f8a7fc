"""A built ``while_loop`` (:class:`Loop`) and the VM programs it runs.

Hoisted program (see ``as_text()``): pick the bucket, pad on the host, then loop
``invoke hoisted[bucket]; read status; if pred: repad to the next bucket, goto loop``.  The host
reads ONE small status vector per bucket visited: host syncs = buckets crossed + 1 (+1 for the
cap's counter).  Finally the carry is unpadded to its exact shapes (small leaves via the host).
The ``padded_io`` variant (a loop staged inside a host program) takes and returns padded values.

Exact program (``padding="exact"`` or a body the padding pass refuses): one executable per
exact shape, one host sync per iteration for the predicate.
"""

from __future__ import annotations

import jax
import numpy as np

from dynjax._errors import PaddingUnsupportedError
from dynjax.control._carry import LAST_RUN, emptied_error, max_iterations_error
from dynjax.control._loopspec import (
  LoopSpec,
  bucket_for,
  capped_bucket,
  empties,
  over_max,
  overflow_error,
  pad_jaxpr,
  padded_shapes,
)
from dynjax.runtime import VM, ProgramBuilder
from dynjax.runtime._vm import record


class Loop:
  """A built loop: its spec and its VM programs (hoisted, exact, hoisted with padded I/O)."""

  def __init__(self, spec: LoopSpec):
    self.spec = spec
    self.mode = "hoisted"
    if spec.exact_only:  # (its fallback_reason says why)
      self.mode = "exact"
    elif spec.padding == "exact":
      self.mode, spec.fallback_reason = "exact", 'padding="exact"'
    elif pad_jaxpr is None:
      self.mode, spec.fallback_reason = "exact", "the padding pass is not available"
    self._vms: dict[str, VM] = {}
    self._budget = {"left": spec.max_iterations}
    self._fixed = [tuple((ax, int(d)) for ax, d in enumerate(ld) if not isinstance(d, str))
                   for ld in spec.leaf_dims]

  def accepts(self, shapes) -> bool:
    """Whether concrete carry shapes fit this loop's dims (static axes and shared sizes)."""
    spec = self.spec
    if spec.exact_only:
      return True
    for fixed, shape in zip(self._fixed, shapes, strict=True):
      for ax, n in fixed:
        if shape[ax] != n:
          return False
    sizes = [0] * len(spec.var_order)
    for li, ax, vi, k in spec.solve:
      sizes[vi] = shapes[li][ax] + k
    if any(n < m for n, m in zip(sizes, spec.least, strict=True)):
      return False  # (a tied axis empty where the spec's trace took it non-empty)
    return tuple(map(tuple, spec.shapes_fn(*sizes))) == tuple(map(tuple, shapes))

  def vm(self, mode: str) -> VM:
    v = self._vms.get(mode)
    if v is None:
      if mode == "exact":
        prog = exact_program(self.spec, self._budget)
      else:
        prog = hoisted_program(self.spec, padded_io=mode == "padded_io")
      v = self._vms[mode] = VM(prog)
    return v

  def run(self, leaves: list) -> list:
    spec = self.spec
    consts = [*spec.body_consts, *spec.cond_consts]
    self._budget["left"] = spec.max_iterations
    if self.mode == "hoisted":
      try:
        vm = self.vm("hoisted")
        outs = vm.run(*consts, *leaves)
      except PaddingUnsupportedError as e:
        self.mode = "exact"
        spec.fallback_reason = f"padding pass: {str(e).splitlines()[0]}"
        return self.run(leaves)
      if spills(spec):
        *outs, spilled = outs
        why = LAST_RUN.get("info", {}).pop("spill", None)
        info = self._record(vm)
        if spilled:  # sizes past the policy's max, or emptied: the rest runs exact
          return self._run_exact_rest(consts, outs, info, why)
        return list(outs)
    else:
      vm = self.vm("exact")
      outs = vm.run(*consts, *leaves)
    self._record(vm)
    return list(outs)

  def _run_exact_rest(self, consts, leaves, info, why=None) -> list:
    spec = self.spec
    if spec.max_iterations is not None:
      self._budget["left"] = spec.max_iterations - info["iterations"]
    vm = self.vm("exact")
    outs = vm.run(*consts, *leaves)
    st = vm.take_stats()
    n = st.invokes // 2
    info.update(exact_iterations=n, iterations=info["iterations"] + n,
                host_syncs=info["host_syncs"] + st.host_syncs,
                fallback=why or 'sizes past the policy\'s max (overflow="exact")')
    record(st)
    return list(outs)

  def run_padded(self, consts: list, leaves: list, sizes: tuple, buckets: tuple) -> tuple:
    """Padded carry in (any padded shapes holding ``sizes``), padded carry out.

    ``buckets``: per variable a bucket to use (fixed program dims) or None (the loop's own
    choice).  Returns ``(padded carry, final sizes, final bucket)``.
    """
    vm = self.vm("padded_io")
    try:
      *outs, status, bk = vm.run(*consts, *leaves, sizes, buckets)
    finally:  # (an emptied carry raises: its iterations still count)
      self._record(vm)
    nv = len(self.spec.var_order)
    return list(outs), tuple(int(x) for x in status[1:1 + nv]), tuple(bk)

  def _record(self, vm: VM) -> dict:
    spec = self.spec
    st = vm.take_stats()
    info = dict(mode=self.mode, host_syncs=st.host_syncs, invokes=st.invokes,
                repads=st.repads, compiles=st.compiles, instructions=st.instructions,
                unroll=spec.unroll)
    if self.mode == "hoisted":
      info.update(LAST_RUN.pop("info", {}))
      extra = info.pop("host_syncs_cap", 0)  # the cap's read of the counter
      info["host_syncs"] += extra
      st.host_syncs += extra
    else:
      info["iterations"] = st.invokes // 2
      info["buckets"] = []
      info["fallback"] = spec.fallback_reason
    info["buckets_crossed"] = max(0, len(info["buckets"]) - 1)
    st.loops.append(info)
    LAST_RUN["loop"] = info
    record(st)
    return info


def spills(spec: LoopSpec) -> bool:
  """Whether the standalone hoisted program may hand the rest of the loop to exact mode:
  sizes past the policy's max with ``overflow="exact"``, or a shrinking dim emptied."""
  return spec.overflow == "exact" or bool(spec.shrinks)


def use_cap(spec: LoopSpec) -> bool:
  if spec.cap is None:
    return False
  if spec.bucket_from == "auto":
    return jax.default_backend() != "cpu"
  return spec.bucket_from == "cap"


def hoisted_program(spec: LoopSpec, padded_io: bool = False):
  """The hoisted loop's program.  ``padded_io``: takes padded carries plus host ``sizes`` and
  ``buckets`` (fixed dims of an enclosing program), returns the padded carry, the status and the
  final bucket (no host padding, no unpadding: the caller keeps the data padded)."""
  nb, nc, n = len(spec.body_consts), len(spec.cond_consts), len(spec.leaf_dims)
  names = ([f"bc{i}" for i in range(nb)] + [f"cc{i}" for i in range(nc)]
           + [f"carry{i}" for i in range(n)] + (["sizes", "buckets"] if padded_io else []))
  b = ProgramBuilder("while_loop.padded_io" if padded_io else "while_loop",
                     nb + nc + n + (2 if padded_io else 0), names)
  consts, carry = b.args[:nb + nc], b.args[nb + nc:nb + nc + n]
  solve = spec.solve
  nv = len(spec.var_order)
  from_cap = use_cap(spec)
  cap_leaf = spec.cap.leaf if spec.cap is not None else None

  def sizes_of(*xs):
    sizes = [0] * nv
    for li, ax, vi, k in solve:
      sizes[vi] = xs[li].shape[ax] + k
    return tuple(sizes)

  def start_info(sizes):
    info = {"iterations": 0, "buckets": [], "cap": None}
    LAST_RUN["info"] = info
    return sizes

  def checked(sizes, given=None):
    """The bucket of ``sizes``; past a policy's max: raise, None (spill to exact) or grow;
    a shrinking dim below 1 (emptied): None (spill)."""
    low = empties(spec, sizes)
    if low:
      names = ", ".join(f"{spec.var_order[i]} = {sizes[i]}" + (
          f" (< {spec.least[i]}: an axis tied to it is empty)" if spec.least[i] > 1 else "")
          for i in low)
      if padded_io:  # staged in a program: no exact rest here; the caller runs the call exact
        raise emptied_error("while_loop staged in a program", names)
      LAST_RUN["info"]["spill"] = (f"a shrinking carry dim reached {names}: the rest ran "
                                   "exact (JAX dims are >= 1: no padded form of an empty dim)")
      return None
    if spec.overflow != "grow":
      over = over_max(spec, sizes, given)
      if over:
        if spec.overflow == "error":
          raise overflow_error(spec, sizes, over)
        return None
    return bucket_for(spec, sizes)

  def start_bucket(sizes, given=None, counter=None):
    info = LAST_RUN["info"]
    bk = checked(sizes, given)
    if bk is None:
      return None
    if given is not None:
      bk = tuple(g if g is not None else x for g, x in zip(given, bk, strict=True))
    if from_cap:
      capped = capped_bucket(spec, sizes, counter)  # reads the counter: one sync
      info["host_syncs_cap"] = 1
      if capped is not None:
        info["cap"] = capped
        bk = tuple(max(a, c) if given is None or given[i] is None else a
                   for i, (a, c) in enumerate(zip(bk, capped, strict=True)))
    info["buckets"].append(bk)
    return bk

  def bucket_of(sizes):
    bk = checked(sizes)
    if bk is not None:
      LAST_RUN["info"]["buckets"].append(bk)
    return bk

  def fits(bk):
    return bk is not None

  def shapes_of(bucket):
    return padded_shapes(spec, bucket)

  max_it = spec.max_iterations

  def sizes_array(sizes):
    if max_it is None:
      return np.asarray(sizes, np.int32).reshape(nv)
    # The iteration budget rides at the end of the sizes vector.
    return np.asarray([*sizes, max_it - LAST_RUN["info"]["iterations"]], np.int32)

  def keep_going(status):
    info = LAST_RUN["info"]
    info["iterations"] += int(status[-1])
    # an emptied shrinking dim stopped the loop: its pred (and so the budget's check) is the
    # exact loop's to compute
    emptied = bool(empties(spec, [int(x) for x in status[1:1 + nv]]))
    go = bool(status[0]) or emptied
    if go and not emptied and max_it is not None and info["iterations"] >= max_it:
      raise max_iterations_error(max_it)
    return go

  def grow_sizes(status):
    cur = tuple(int(x) for x in status[1:1 + nv])
    nxt = tuple(int(x) for x in spec.next_host(*cur))
    # an emptied shrinking dim keeps its size (< least): checked() spills to exact
    low = empties(spec, cur)
    return tuple(a if i in low else max(a, c)
                 for i, (a, c) in enumerate(zip(cur, nxt, strict=True))), cur

  def first(pair):
    return pair[0]

  def second(pair):
    return pair[1]

  def final_shapes(status):
    return padded_shapes(spec, tuple(int(x) for x in status[1:1 + nv]))

  if padded_io:
    sizes_in, given = b.args[-2], b.args[-1]
    sizes = b.emit_host_op(start_info, [sizes_in])
  else:
    sizes = b.emit_host_op(sizes_of, carry)
    b.emit_host_op(start_info, [sizes], dst=sizes)
  counter = [carry[cap_leaf]] if from_cap else []
  if padded_io:
    bk = b.emit_host_op(start_bucket, [sizes, given, *counter])
  else:
    def start(s, *c):
      return start_bucket(s, None, *c)

    start.__name__ = "start_bucket"
    bk = b.emit_host_op(start, [sizes, *counter])
  spill = spills(spec) and not padded_io  # the Loop continues in exact mode
  if spill:
    b.emit_if(b.emit_host_op(fits, [bk]), "enter", "spill_init")
    b.block("spill_init")
    b.emit_ret([*carry, b.emit_const(True)])
    b.block("enter")
  shp = b.emit_host_op(shapes_of, [bk])
  if padded_io:
    b.emit_repad(carry, shp, dsts=carry)
  else:
    b.emit_pad(carry, shp, dsts=carry)
  sz = b.emit_host_op(sizes_array, [sizes])
  status = b.new_reg("status")
  status_h = b.new_reg("st")
  b.block("loop")
  b.emit_invoke_into(spec.hoisted, None, [*consts, sz, *carry], [*carry, status], key_reg=bk)
  b.emit_read_scalar(status, dst=status_h)
  go = b.emit_host_op(keep_going, [status_h])
  b.emit_if(go, "grow", "done")
  b.block("grow")
  pair = b.emit_host_op(grow_sizes, [status_h])
  need = b.emit_host_op(first, [pair])
  b.emit_host_op(bucket_of, [need], dst=bk)
  if spill:
    b.emit_if(b.emit_host_op(fits, [bk]), "repad", "spill")
    b.block("spill")
    fs = b.emit_host_op(final_shapes, [status_h])
    b.emit_ret([*b.emit_unpad(carry, fs), b.emit_const(True)])
    b.block("repad")
  b.emit_host_op(shapes_of, [bk], dst=shp)
  b.emit_repad(carry, shp, dsts=carry)
  cur = b.emit_host_op(second, [pair])
  b.emit_host_op(sizes_array, [cur], dst=sz)
  b.emit_goto("loop")
  b.block("done")
  if padded_io:
    b.emit_ret([*carry, status_h, bk])
  else:
    fs = b.emit_host_op(final_shapes, [status_h])
    out = b.emit_unpad(carry, fs)
    b.emit_ret([*out, b.emit_const(False)] if spill else out)
  return b.finish()


def exact_program(spec: LoopSpec, budget: dict):
  """One executable per exact shape, one sync per iteration.  ``budget["left"]``: iterations
  left before ``max_iterations`` is exceeded (None: no limit), set by the caller per run."""
  nb, nc, n = len(spec.body_consts), len(spec.cond_consts), len(spec.leaf_dims)
  b = ProgramBuilder("while_loop.exact", nb + nc + n,
                     [f"bc{i}" for i in range(nb)] + [f"cc{i}" for i in range(nc)]
                     + [f"carry{i}" for i in range(n)])
  carry = b.args[nb + nc:]
  key = b.new_reg("shapes")
  pred = b.new_reg("pred")
  ph = b.new_reg("pred_h")
  b.block("loop")
  b.emit_host_op(_shapes_key, carry, dst=key)
  b.emit_invoke_into(spec.exact_cond, None, carry, [pred], key_reg=key)
  b.emit_read_scalar(pred, dst=ph)
  b.emit_if(ph, "body", "done")
  b.block("body")
  if spec.max_iterations is not None:
    def tick():
      if budget["left"] <= 0:
        raise max_iterations_error(spec.max_iterations)
      budget["left"] -= 1

    b.emit_host_op(tick, [])
  b.emit_invoke_into(spec.exact_body, None, carry, carry, key_reg=key)
  b.emit_goto("loop")
  b.block("done")
  b.emit_ret(carry)
  return b.finish()


def _shapes_key(*xs):
  return tuple(x.shape for x in xs)


