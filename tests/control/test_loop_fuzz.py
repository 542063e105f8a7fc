"""Random loops against the exact-shape loop: growing, shrinking, emptied and parted carries;
and random functions with a shape-changing ``dynjax.cond`` under ``dynjax.jit``.

Each example is a body of 1-4 everyday ops on a carry of two vectors (``q``, ``r``), a
counter and an accumulator, a cond from a small table, random initial sizes (0 included)
and a way to run it: a standalone loop from each ``bucket_from``, small buckets with
``overflow="grow"``/``"exact"``, staged inside ``dynjax.jit``, in host mode (the body also
runs a shape-changing inner loop), or both.  Every result must equal
``tests/control/_reference.jit_loop`` (``jax.jit`` steps at each exact shape).  Session 29's
fuzzer of this form found five silently wrong or needlessly refused loop forms.

No op concatenates ``q`` onto ``r``: a slice of a concatenate with an empty operand
(``jnp.concatenate([r, q])[2:]`` at sizes 1 and 0) aborts the process on XLA:CPU with jaxlib
0.10.2 (an XLA bug that the exact-shape reference, and any exact fallback, would meet).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dynjax
import dynjax.control as dc
from tests.control._reference import jit_loop

OPS = {
  "grow_q": lambda q, r, i, acc: (jnp.concatenate([q, q[:1] * 0.5 + 1.0]), r, i, acc),
  "grow_q2": lambda q, r, i, acc: (jnp.concatenate([q, jnp.full((2,), i, q.dtype)]), r, i,
                                   acc),
  "shrink_q": lambda q, r, i, acc: (q[1:], r, i, acc),
  "shrink_q_end": lambda q, r, i, acc: (q[:-1], r, i, acc),
  "grow_r": lambda q, r, i, acc: (q, jnp.concatenate([r, r[-2:] + 1.0]), i, acc),
  "shrink_r2": lambda q, r, i, acc: (q, r[2:], i, acc),
  "rev_r": lambda q, r, i, acc: (q, r[::-1] * 0.9, i, acc),
  "half_r": lambda q, r, i, acc: (q, r[::2] + 0.5, i, acc),
  "tail3_q": lambda q, r, i, acc: (q[-3:] * 1.5, r, i, acc),
  "pad_q": lambda q, r, i, acc: (jnp.pad(q, (0, 1), constant_values=2.0), r, i, acc),
  "acc_q": lambda q, r, i, acc: (q, r, i, acc + jnp.sum(q) + jnp.max(q[-1:], initial=-3.0)),
  "acc_r": lambda q, r, i, acc: (q, r, i, acc + jnp.min(r, initial=7.0) + r[:1].sum()),
  "mix": lambda q, r, i, acc: (q + jnp.sum(r) * 0.01, r, i, acc),
  "cum": lambda q, r, i, acc: (jnp.cumsum(q) * 0.5, r, i, acc),
  "sort": lambda q, r, i, acc: (q, jnp.sort(r), i, acc + jnp.argmax(
      jnp.concatenate([r, jnp.zeros(1)])).astype(jnp.float32)),
}
CONDS = {
  "count": lambda k: (lambda c: c[2] < k),
  "count_and_q": lambda k: (lambda c: (c[2] < k) & (jnp.asarray(c[0].shape[0]) > 0)),
  "q_below": lambda k: (lambda c: (jnp.asarray(c[0].shape[0]) < k + 3) & (c[2] < 12)),
  "r_any": lambda k: (lambda c: ((c[2] < k) | (jnp.asarray(c[1].shape[0]) > 30))
                      & (c[2] < 12)),
}
MODES = ("init", "auto", "cap", "small_grow", "small_exact", "staged", "host", "staged_host")


def _body_of(ops):
  def body(c):
    q, r, i, acc = c
    for o in ops:
      q, r, i, acc = OPS[o](q, r, i, acc)
    return q, r, i + 1, acc
  return body


def _with_inner_loop(body):  # a shape-changing inner loop: the outer loop runs in host mode
  def host_body(c):
    q, r, i, acc = body(c)
    z = dc.while_loop(lambda z: jnp.asarray(z.shape[0]) < 3,
                      lambda z: jnp.concatenate([z, z[:1]]), jnp.ones(1))
    return q, r, i, acc + jnp.sum(z) - 3.0
  return host_body


def _run(mode, cond, body, init, unroll):
  opts = dict(max_iterations=100)
  if mode in ("init", "auto", "cap"):
    return dc.while_loop(cond, body, init, bucket_from=mode, unroll=unroll, **opts)
  if mode.startswith("small"):
    return dc.while_loop(cond, body, init, unroll=unroll, buckets=dynjax.buckets.pow2(2, 8),
                         overflow=mode.split("_")[1], **opts)
  if mode in ("host", "staged_host"):
    body = _with_inner_loop(body)
  if mode == "host":
    return dc.while_loop(cond, body, init, **opts)
  f = dynjax.jit(lambda a, b: dc.while_loop(cond, body, (a, b, jnp.int32(0), jnp.float32(0)),
                                            **opts), dims={"a": "n", "b": "m"})
  return f(np.asarray(init[0]), np.asarray(init[1]))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=4),
       cond=st.sampled_from(sorted(CONDS)), k=st.integers(1, 6),
       nq=st.integers(0, 6), nr=st.integers(0, 6), mode=st.sampled_from(MODES),
       unroll=st.sampled_from([1, 2, 4]))
def test_random_loops_equal_the_exact_shape_loop(ops, cond, k, nq, nr, mode, unroll):
  body, cond_fun = _body_of(ops), CONDS[cond](k)
  init = (jnp.arange(float(nq)) + 1.0, jnp.arange(float(nr)) * 0.5, jnp.int32(0),
          jnp.float32(0))
  want = jit_loop(cond_fun, body, init)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # a loop that runs exact says so; its result is checked
    got = _run(mode, cond_fun, body, init, unroll)
  for g, w in zip(got, want, strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape, (ops, cond, k, nq, nr, mode, [np.shape(x) for x in got])
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=str((ops, cond, mode)))


# -- random functions with a shape-changing cond under dynjax.jit ----------------------------
VEC = {
  "drop1": lambda v: v[1:],
  "drop_end": lambda v: v[:-1],
  "dup": lambda v: jnp.concatenate([v, v]),
  "head3": lambda v: v[:3],
  "tail2": lambda v: v[-2:] * 2,
  "cum": jnp.cumsum,
  "rev": lambda v: v[::-1] + 1,
  "pad": lambda v: jnp.pad(v, (1, 0), constant_values=3.0),
  "empty": lambda v: v[:0],
  "sort": lambda v: jnp.sort(-v),
  "half": lambda v: v[::2],
}
RED = {
  "sum": jnp.sum,
  "maxlast": lambda v: jnp.max(v[-1:], initial=-5.0),
  "mean": lambda v: jnp.sum(v) / jnp.maximum(v.shape[0], 1),
  "len": lambda v: jnp.asarray(v.shape[0], jnp.float32),
}


def _chain(ops):
  def g(v):
    for o in ops:
      v = VEC[o](v)
    return v
  return g


def _py_cond(pred, t, f, v):
  return t(v) if bool(pred) else f(v)


ops_ = st.lists(st.sampled_from(sorted(VEC)), max_size=2)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pre=ops_, a=ops_, b=ops_, post=ops_, red=st.sampled_from(sorted(RED)),
       thr=st.floats(-3, 10), sizes=st.lists(st.integers(0, 9), min_size=3, max_size=3))
# the three forms the ad-hoc fuzzer found (each failed on the session's start tree): a cond
# read only for its shape, sizes outside the family's guard, branches that part at n = 0
@example(pre=["rev"], a=[], b=["drop1", "tail2"], post=["sort", "empty"], red="len",
         thr=4.81, sizes=[8, 6, 2])
@example(pre=["head3"], a=["half", "tail2"], b=["drop1", "rev"], post=["half", "dup"],
         red="mean", thr=8.0, sizes=[5, 1, 2])
@example(pre=["cum"], a=["sort"], b=["drop_end", "pad"], post=["drop_end"], red="sum",
         thr=-2.84, sizes=[0, 3, 0])
def test_random_conds_in_dynjax_jit_equal_python_if(pre, a, b, post, red, thr, sizes):
  def make(cond):
    def f(x):
      y = _chain(pre)(x)
      z = cond(jnp.sum(y) > thr, _chain(a), _chain(b), y)
      w = _chain(post)(z)
      return w, RED[red](w) + RED[red](z)
    return f

  g = dynjax.jit(make(dc.cond), dims={"x": "n"})
  for n in sizes:
    x = np.random.default_rng(n).normal(size=n).astype(np.float32) + 1.0
    want = make(_py_cond)(jnp.asarray(x))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # sizes outside a guard run op by op and say so
      got = g(x)
    for gg, ww in zip(got, want, strict=True):
      assert np.shape(gg) == np.shape(ww), (pre, a, b, post, n)
      np.testing.assert_allclose(np.asarray(gg), np.asarray(ww), rtol=1e-5, atol=1e-5)
