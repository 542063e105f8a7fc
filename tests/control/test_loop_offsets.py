"""Carry axes a constant apart (a KV cache one shorter than the tokens) share one loop dim.

Each loop is checked against a Python loop of exact-shape ``jax.jit`` steps, and its buckets
against what one dim visits: a crossing of 16 costs one more bucket, not two (before, the
tokens ``t`` and a cache ``t - 1`` were two dims that crossed one iteration apart: three
buckets and three compiles for one crossing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
import dynjax.control as dc
from dynjax.control import _loop
from tests.control._reference import jit_loop

V, D = 11, 8
_RS = np.random.RandomState(0)
W = {k: jnp.asarray(_RS.randn(*s).astype(np.float32) * 0.5) for k, s in
     dict(emb=(V, D), q=(D, D), k=(D, D), v=(D, D), out=(D, V)).items()}


def _decode_step(c):
  """One greedy step of single-head attention over a KV cache grown by concatenation."""
  x = W["emb"][c["last"]]  # (b, D)
  k = jnp.concatenate([c["k"], (x @ W["k"])[:, None]], 1)
  v = jnp.concatenate([c["v"], (x @ W["v"])[:, None]], 1)
  a = jax.nn.softmax(jnp.einsum("bd,btd->bt", x @ W["q"], k) / np.sqrt(D), -1)
  nxt = jnp.argmax(jnp.einsum("bt,btd->bd", a, v) @ W["out"], -1).astype(jnp.int32)
  return dict(tokens=jnp.concatenate([c["tokens"], nxt[:, None]], 1), k=k, v=v, last=nxt,
              i=c["i"] + 1)


def _decode_cond(c):
  return c["i"] < 19


def _prompt(b, t, lag, seed=0):
  rs = np.random.RandomState(seed)
  toks = jnp.asarray(rs.randint(0, V, (b, t)), jnp.int32)
  cache = jnp.asarray(rs.randn(b, t - lag, D).astype(np.float32))
  return dict(tokens=toks, k=cache, v=cache * 0.5, last=toks[:, -1], i=jnp.int32(t))


def _same(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lag", [1, 3, 13], ids=["cache_t-1", "cache_t-3", "empty_cache"])
def test_a_cache_a_constant_behind_the_tokens_is_one_dim(lag):
  init = _prompt(2, 13, lag)
  want = jit_loop(_decode_cond, _decode_step, init)
  got = dc.while_loop(_decode_cond, _decode_step, init, bucket_from="init", unroll=1)
  _same(got, want)
  st = dc.loop_stats()
  assert st["mode"] == "hoisted", st
  # t goes 13 -> 19: one crossing of 16, so two buckets of one dim, one sync and compile each
  assert st["buckets"] == [(16,), (32,)], st
  assert st["compiles"] == 2 and st["host_syncs"] == 2, st


def test_the_tied_loop_serves_other_prompt_lengths_and_not_other_offsets():
  dc.while_loop(_decode_cond, _decode_step, _prompt(2, 12, 1), bucket_from="init", unroll=1)
  built = sum(len(v) for v in _loop._CACHE.values())
  init = _prompt(2, 14, 1, seed=1)  # another prompt length, the same offset: the same loop
  got = dc.while_loop(_decode_cond, _decode_step, init, bucket_from="init", unroll=1)
  _same(got, jit_loop(_decode_cond, _decode_step, init))
  assert sum(len(v) for v in _loop._CACHE.values()) == built
  assert dc.loop_stats()["compiles"] == 0  # both buckets were compiled by the first run
  init = _prompt(2, 14, 2, seed=2)  # the cache two behind: a loop of its own, exact too
  got = dc.while_loop(_decode_cond, _decode_step, init, bucket_from="init", unroll=1)
  _same(got, jit_loop(_decode_cond, _decode_step, init))
  assert sum(len(v) for v in _loop._CACHE.values()) == built + 1


def test_axes_a_constant_apart_that_do_not_stay_so_are_two_dims():
  # Both grow by one at the init's sizes (5 -> 6 and 6 -> 7), but b becomes 2*b - 4: tying
  # b to a - 1 fails the symbolic check, and the loop runs with two dims as before.
  def body(c):
    a, b, i = c
    return jnp.concatenate([a, a[:1] + 1]), jnp.concatenate([b, b[4:] * 0.5]), i + 1

  def cond(c):
    return c[2] < 4

  init = (jnp.arange(6.0), jnp.arange(5.0), jnp.int32(0))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init, bucket_from="init", unroll=1)
  _same(got, want)
  assert got[1].shape == (20,)
  st = dc.loop_stats()
  assert st["mode"] == "hoisted" and all(len(bk) == 2 for bk in st["buckets"]), st


def test_shrinking_axes_a_constant_apart_share_a_dim():
  def body(c):
    a, b = c
    return a[1:] * 0.5, b[:-1] + a[0]

  def cond(c):
    return jnp.asarray(c[1].shape[0]) > 1

  init = (jnp.arange(12.0), jnp.arange(9.0))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init, bucket_from="init", unroll=1)
  _same(got, want)
  assert got[0].shape == (4,) and got[1].shape == (1,)
  st = dc.loop_stats()
  assert st["mode"] == "hoisted" and all(len(bk) == 1 for bk in st["buckets"]), st


def test_two_tokens_a_step_with_a_cache_two_behind():
  def body(c):
    toks, cache = c
    new = (toks[-2:] + 1) % V
    return jnp.concatenate([toks, new]), jnp.concatenate([cache, toks[-2:].astype(cache.dtype)])

  def cond(c):
    return jnp.asarray(c[0].shape[0]) < 30

  init = (jnp.arange(4, dtype=jnp.int32), jnp.zeros(2))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init, bucket_from="init", unroll=1)
  _same(got, want)
  assert [len(bk) for bk in dc.loop_stats()["buckets"]] == [1, 1]


def test_a_staged_kv_cache_loop_visits_one_bucket_a_crossing():
  def decode(tokens):
    b, t = tokens.shape
    z = jnp.zeros((b, t - 1, D))
    c = dc.while_loop(_decode_cond, _decode_step,
                      dict(tokens=tokens, k=z, v=z, last=tokens[:, -1], i=jnp.int32(t)),
                      bucket_from="init", unroll=1)
    return c["tokens"], c["k"]

  f = dynjax.jit(decode, dims={"tokens": "b, t"})
  toks = np.random.RandomState(3).randint(0, V, (2, 13)).astype(np.int32)
  got = f(toks)
  z = jnp.zeros((2, 12, D))
  want = jit_loop(_decode_cond, _decode_step, dict(tokens=jnp.asarray(toks), k=z, v=z,
                                                    last=jnp.asarray(toks[:, -1]),
                                                    i=jnp.int32(13)))
  _same(got, (want["tokens"], want["k"]))
  st = dc.loop_stats()
  assert st["mode"] == "hoisted", st
  # one loop dim (and the batch of the program): 16, then 32
  assert [bk[0] for bk in st["buckets"]] == [16, 32] and st["compiles"] == 2, st


def test_dims_may_name_an_axis_at_an_offset():
  init = _prompt(2, 13, 1)
  spec = dict(tokens="2, t", k="2, t - 1, 8", v="2, t-1, 8", last=None, i=None)
  got = dc.while_loop(_decode_cond, _decode_step, init, dims=spec, bucket_from="init",
                      unroll=1, buckets={"t": dynjax.buckets.pow2(min=8)})
  _same(got, jit_loop(_decode_cond, _decode_step, init))
  assert dc.loop_stats()["buckets"] == [(16,), (32,)]


@pytest.mark.parametrize("spec, message", [
    (dict(tokens="2, t", k="2, t - 2, 8", v="2, t - 1, 8", last=None, i=None),
     r"init\['k'\].shape\[1\]: spec says t - 2 = 11 \(t = 13 from init\['tokens'\].shape\[1\]\), "
     r"got 12"),
    (dict(tokens="2, 13", k="2, t - 1, 8", v=None, last=None, i=None),
     r"init\['k'\].shape\[1\]: 't - 1': t names no axis by itself; name one axis t"),
    (dict(tokens="2, t", k="2, t * 2, 8", v=None, last=None, i=None),
     r"'t \* 2': a carry axis must be a name, a name plus or minus an integer \(t - 1\), or "
     r"an integer"),
])
def test_dims_at_an_offset_that_do_not_fit_init_are_refused(spec, message):
  with pytest.raises(dynjax.ControlFlowError,
                     match=message):
    dc.while_loop(_decode_cond, _decode_step, _prompt(2, 13, 1), dims=spec)


def test_dims_at_an_offset_the_body_does_not_keep_are_refused():
  # the cache grows by one, the tokens by two: "t - 1" does not stay true
  def body(c):
    toks, cache = c
    return jnp.concatenate([toks, toks[:2]]), jnp.concatenate([cache, cache[:1]])

  with pytest.raises(dynjax.ControlFlowError,
                     match=r"init\[1\].shape\[0\]: t - 1 -> t, but t - 1 of the next sizes is "
                     r"t \+ 1; an axis tied to a dimension must stay tied"):
    dc.while_loop(lambda c: c[0][0] < 0, body, (jnp.arange(4.0), jnp.arange(3.0)),
                  dims=("t", "t - 1"))


def test_a_staged_loop_with_dims_at_an_offset():
  def decode(tokens):
    b, t = tokens.shape
    z = jnp.zeros((b, t - 1, D))
    spec = dict(tokens="2, s", k="2, s - 1, 8", v="2, s - 1, 8", last=None, i=None)
    c = dc.while_loop(_decode_cond, _decode_step,
                      dict(tokens=tokens, k=z, v=z, last=tokens[:, -1], i=jnp.int32(t)),
                      dims=spec, bucket_from="init", unroll=1)
    return c["tokens"]

  toks = np.random.RandomState(4).randint(0, V, (2, 13)).astype(np.int32)
  got = dynjax.jit(decode, dims={"tokens": "b, t"})(toks)
  z = jnp.zeros((2, 12, D))
  want = jit_loop(_decode_cond, _decode_step, dict(tokens=jnp.asarray(toks), k=z, v=z,
                                                    last=jnp.asarray(toks[:, -1]),
                                                    i=jnp.int32(13)))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want["tokens"]))
  assert [bk[0] for bk in dc.loop_stats()["buckets"]] == [16, 32]


def test_a_tied_dim_past_the_largest_bucket_names_every_axis_it_sizes():
  with pytest.raises(dynjax.OutOfBucketsError, match=(
      r"n0 = 17 \(init\['tokens'\].shape\[1\], init\['k'\].shape\[1\] = n0 - 1, "
      r"init\['v'\].shape\[1\] = n0 - 1\) is above the largest bucket 16")):
    dc.while_loop(lambda c: c["i"] < 30, _decode_step, _prompt(2, 13, 1),
                  buckets=dynjax.buckets.pow2(8, 16), bucket_from="init", unroll=1)


def test_an_empty_cache_that_the_body_slices_is_exact():
  # The body reads the cache's last entry where there is one (x[:, -1:] of an empty cache is
  # empty: the max is its initial value): traced as JAX takes it at size 0, not under an assumption that the cache is >= 1.
  def body(c):
    toks, cache = c
    last = jnp.max(cache[:, -1:], axis=1, initial=-5.0)  # (b,): -5 while the cache is empty
    new = (toks[:, -1] + last.astype(toks.dtype) + 1) % V
    return (jnp.concatenate([toks, new[:, None]], 1),
            jnp.concatenate([cache, toks[:, -1:].astype(cache.dtype) * 0.5], 1))

  def cond(c):
    return jnp.asarray(c[0].shape[1]) < 14

  init = (jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.zeros((2, 0)))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init, bucket_from="init", unroll=1)
  _same(got, want)
  assert {len(bk) for bk in dc.loop_stats()["buckets"]} == {1}  # one dim, tied


def _empty_cache_body(rate):
  def body(c):
    toks, cache = c
    last = jnp.max(cache[:, -1:], axis=1, initial=-5.0)  # -5 while the cache is empty
    new = (toks[:, -1] + last.astype(toks.dtype) + 1) % V
    return (jnp.concatenate([toks, new[:, None]], 1),
            jnp.concatenate([cache, jnp.repeat(toks[:, -1:].astype(cache.dtype), rate, 1)], 1))
  return body


@pytest.mark.parametrize("dims", [None, ("b, t", "b, c")], ids=["found", "named"])
def test_a_dim_of_its_own_that_starts_empty_is_exact(dims):
  # The cache grows by two, the tokens by one: two dims, the cache's starting at 0.  JAX
  # takes a dim variable to be >= 1, so the cache's var is its size + 1 (before: the body's
  # slice of the empty cache was traced as one entry, and the loop's tokens were wrong).
  body = _empty_cache_body(2)

  def cond(c):
    return jnp.asarray(c[0].shape[1]) < 12

  init = (jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.zeros((2, 0)))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init, dims=dims, bucket_from="init", unroll=1)
  _same(got, want)
  st = dc.loop_stats()
  assert st["mode"] == "hoisted" and {len(bk) for bk in st["buckets"]} == {
      2 if dims is None else 3}, st


def _sentence_step(c):
  return {**_decode_step(c), "stop": c["stop"]}


def _outer(loop):
  """An outer loop whose body decodes 3 tokens with an inner KV-cache loop (host mode)."""
  def body(c):
    toks, k, n = c
    t = toks.shape[1]
    inner = loop(lambda s: s["i"] < s["stop"], _sentence_step,
                 dict(tokens=toks, k=k, v=k * 0.5, last=toks[:, -1], i=jnp.int32(t),
                      stop=jnp.int32(t) + 3))
    return inner["tokens"], inner["k"], n + 1
  return body


@pytest.mark.parametrize("dims", [None, ("2, t", "2, t - 1, 8", None)], ids=["found", "named"])
def test_a_host_mode_loop_around_a_kv_loop_is_exact(dims):
  rs = np.random.RandomState(5)
  init = (jnp.asarray(rs.randint(0, V, (2, 6)), jnp.int32),
          jnp.asarray(rs.randn(2, 5, D), jnp.float32), jnp.int32(0))

  def cond(c):
    return jnp.asarray(c[0].shape[1]) < 12

  want = init
  while bool(cond(want)):
    want = _outer(jit_loop)(want)
  got = dc.while_loop(cond, _outer(dc.while_loop), init, dims=dims)
  _same(got, want)
  st = dc.loop_stats()
  assert st["mode"] == "host", st  # staged, not the eager fallback
  assert {len(bk) for bk in st["buckets"]} == {2 if dims is None else 1}, st


def test_an_inner_loop_over_an_outer_cache_that_starts_empty_is_exact():
  # The outer loop (host mode) holds an empty cache; its staged body's inner loop starts
  # from the outer var's dim n1 - 1, which may be 0: the inner var is one more than it.
  inner_body = _empty_cache_body(2)

  def outer(loop):
    def body(c):
      toks, cache, n = c
      inner = loop(lambda s: s[2] < 2, lambda s: (*inner_body(s[:2]), s[2] + 1),
                   (toks, cache, jnp.int32(0)))
      return inner[0], inner[1], n + 1
    return body

  def cond(c):
    return c[2] < 3

  init = (jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.zeros((2, 0)), jnp.int32(0))
  want = init
  while bool(cond(want)):
    want = outer(jit_loop)(want)
  got = dc.while_loop(cond, outer(dc.while_loop), init)
  _same(got, want)
  assert dc.loop_stats()["mode"] == "host"


def test_a_tied_axis_emptied_while_its_dim_is_still_one_stops_the_padded_loop():
  # t and the cache one behind both lose a column a step: one dim n0 (t), the cache n0 - 1,
  # traced under n0 >= 2 (the cache non-empty).  At n0 = 1 the cache is empty: the padded
  # loop went on and the cache came back with 6 columns of garbage where JAX gives 0.
  def body(s):
    t, c, i, a = s
    return t[:, 1:], c[:, 1:], i + 1, a + jnp.sum(c[:, -1:]) + jnp.sum(t)

  def cond(s):
    return (jnp.asarray(s[0].shape[1]) < 10) & (s[2] < 10)

  init = (jnp.ones((2, 3), jnp.int32), jnp.ones((2, 2, 4)), jnp.int32(0), jnp.float32(0))
  want = jit_loop(cond, body, init)
  for start in ("init", "auto"):
    got = dc.while_loop(cond, body, init, bucket_from=start)
    assert [g.shape for g in got] == [w.shape for w in want], (start, got)
    assert float(got[3]) == float(want[3]) and int(got[2]) == int(want[2]) == 10
    assert "n0 = 1 (< 2: an axis tied to it is empty)" in dc.loop_stats()["fallback"]
