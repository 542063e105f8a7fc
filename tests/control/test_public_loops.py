"""Loops and recursions written as public JAX/Flax code writes them, against plain JAX.

Each trial is checked against a reference that JAX runs at exact shapes (a Python loop of
``jax.jit`` steps, or the plain recursion), and against what the docs promise of the VM's
stats (one host sync per bucket visited; one batched invoke per level group, no sync).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
import dynjax.control as dc
from dynjax._errors import ControlFlowError
from tests.control import _public as P
from tests.control._reference import jit_loop

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check_syncs(st):
  assert st["mode"] == "hoisted", st
  assert len(st["buckets"]) == st["buckets_crossed"] + 1, st
  # One sync a bucket; off the CPU a loop with a cap starts at the cap's bucket
  # (bucket_from="auto"), which reads the step counter once more (H100, session 24).
  extra = st["host_syncs"] - len(st["buckets"])
  assert extra in ((0,) if jax.default_backend() == "cpu" else (0, 1)), st


# -- greedy decoding of a Flax Linen LM, the whole prefix re-run each step ---------------------
_LM = P.LM()
_LM_PARAMS = _LM.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))


def _greedy(eos):
  def cond(c):
    tokens, done, cur = c
    return ~jnp.all(done) & (cur < 20)

  def body(c):
    tokens, done, cur = c
    nxt = jnp.argmax(_LM.apply(_LM_PARAMS, tokens)[:, -1], axis=-1).astype(tokens.dtype)
    nxt = jnp.where(done, P.PAD, nxt)  # finished rows emit padding
    return jnp.concatenate([tokens, nxt[:, None]], axis=1), done | (nxt == eos), cur + 1
  return cond, body


def test_flax_greedy_decode_with_per_row_eos_matches_a_jit_loop():
  prompts = jnp.asarray(np.random.RandomState(1).randint(2, P.V, (3, 5)), jnp.int32)
  init = (prompts, jnp.zeros(3, bool), jnp.int32(5))
  free = jit_loop(*_greedy(-1), init)  # no EOS: pick one row's 9th token as the EOS
  eos = int(np.asarray(free[0])[1, 5 + 8])
  cond, body = _greedy(eos)
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  assert int(got[2]) == int(want[2])
  assert bool(np.asarray(want[1])[1]) and (np.asarray(want[0])[1, 5 + 9:] == P.PAD).all()
  st = dc.loop_stats()
  _check_syncs(st)
  assert st["iterations"] == int(want[2]) - 5


# -- the same with a KV cache per layer that grows by concatenation ---------------------------
_CLM = P.CachedLM()
_CLM_PARAMS = _CLM.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32), P.empty_caches(1), 0)


def _kv_cond(c):
  return ~jnp.all(c["done"]) & (c["pos"] < 22)


def _kv_body(c):
  logits, caches = _CLM.apply(_CLM_PARAMS, c["last"][:, None], c["caches"], c["pos"])
  nxt = jnp.where(c["done"], P.PAD, jnp.argmax(logits[:, -1], -1).astype(jnp.int32))
  return dict(tokens=jnp.concatenate([c["tokens"], nxt[:, None]], 1), caches=caches,
              done=c["done"] | (nxt == P.EOS), pos=c["pos"] + 1, last=nxt)


def test_flax_kv_cache_decode_with_a_pytree_of_growing_caches_matches_a_jit_loop():
  b = 3
  prompts = jnp.asarray(np.random.RandomState(2).randint(2, P.V, (b, 6)), jnp.int32)
  _, caches = jax.jit(_CLM.apply)(_CLM_PARAMS, prompts[:, :-1], P.empty_caches(b), 0)  # prefill
  init = dict(tokens=prompts, caches=caches, done=jnp.zeros(b, bool), pos=jnp.int32(5),
              last=prompts[:, -1])
  want = jit_loop(_kv_cond, _kv_body, init)
  got = dc.while_loop(_kv_cond, _kv_body, init)
  np.testing.assert_array_equal(np.asarray(got["tokens"]), np.asarray(want["tokens"]))
  assert int(got["pos"]) == int(want["pos"]) and got["caches"][1]["k"].shape == (
      b, int(want["pos"]), P.HEADS, P.D // P.HEADS)
  for g, w in zip(jax.tree.leaves(got["caches"]), jax.tree.leaves(want["caches"]), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  st = dc.loop_stats()
  _check_syncs(st)
  # The tokens (t) and the caches (t - 1) are one carry dim, the caches padded to the bucket
  # less one: two buckets for the loop's one crossing of 16 (t = 6 .. 22).  As two dims they
  # crossed one iteration apart: three buckets, three compiles.
  assert [len(bk) for bk in st["buckets"]] == [1] * len(st["buckets"]), st
  assert len(st["buckets"]) == (1 if jax.default_backend() != "cpu" else 2), st


# -- sampling: a PRNG key in the carry, split each step ------------------------------------
_W = jnp.asarray(np.random.RandomState(0).randn(P.V, P.V).astype(np.float32))


def _sample_body(temperature, top_k):
  def body(c):  # as public sampling loops write it: split, scale, cut to the top k, draw
    tokens, key, i = c
    key, sub = jax.random.split(key)
    logits = (jax.nn.one_hot(tokens, P.V).mean(1) @ _W) / temperature
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    nxt = jax.random.categorical(sub, logits, axis=-1).astype(tokens.dtype)
    return jnp.concatenate([tokens, nxt[:, None]], axis=1), key, i + 1
  return body


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key],
                         ids=["raw_uint32_key", "typed_key"])
def test_sampling_with_a_key_in_the_carry_draws_what_the_jit_loop_draws(make_key):
  # A typed key (jax.random.key, dtype key<fry>) in the carry crashed the structure check
  # (jnp.dtype refuses key dtypes); it now runs like the raw uint32 key.
  cond = lambda c: c[2] < 20  # noqa: E731
  body = _sample_body(0.7, 5)
  init = (jnp.ones((2, 3), jnp.int32), make_key(0), jnp.int32(0))
  want = jit_loop(cond, body, init)
  got = dc.while_loop(cond, body, init)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(got[1])),
                                np.asarray(jax.random.key_data(want[1])))
  assert got[1].dtype == want[1].dtype
  _check_syncs(dc.loop_stats())
  f = dynjax.jit(lambda toks, key: dc.while_loop(cond, body, (toks, key, jnp.int32(0))),
                 dims={"toks": "b, t"})
  np.testing.assert_array_equal(np.asarray(f(init[0], init[1])[0]), np.asarray(want[0]))


# -- a child-sum Tree-LSTM over nested-tuple parse trees ------------------------------------
_TL_PARAMS = P.tree_lstm_params(20, 8)
_node = dc.cell(P.tree_lstm_node, name="node")
_embed = dc.cell(P.embed, name="embed")
_tree_lstm = dc.recursive(P.make_tree_lstm(_node, _embed, lambda: _tree_lstm))
_plain = P.make_tree_lstm(P.tree_lstm_node, P.embed, lambda: _plain)
_TREES = [(3, [1, 2, (4, [5, 6, 7])]), 9, (1, [(2, [3]), (4, [5, 6])]), (7, [8]),
          (0, [(1, [(2, [(3, [4])])]), 5])]


def _loss(encode, params, trees):
  return sum(jnp.sum(encode(params, t)[0] ** 2) for t in trees)


def test_child_sum_tree_lstm_batches_levels_and_equals_the_plain_recursion():
  out = _tree_lstm.batch([(_TL_PARAMS, t) for t in _TREES])
  for (h, c), t in zip(out, _TREES, strict=True):
    wh, wc = jax.jit(lambda p, t=t: _plain(p, t))(_TL_PARAMS)
    np.testing.assert_allclose(np.asarray(h), np.asarray(wh), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(c), np.asarray(wc), rtol=1e-5, atol=1e-6)
  st = _tree_lstm.last_stats
  assert st.host_syncs == 0 and len(st.batches) == 1
  # one invoke per (level, arity) group, not one per node
  assert st.invokes == st.batches[0]["groups"] < st.batches[0]["nodes"]


def test_gradients_of_a_recursion_say_it_cannot_be_differentiated_and_what_to_do():
  # jax.grad through rec.batch used to say "call it ... inside dynjax.jit", which fails the
  # same way; and rec.batch under dynjax.jit did not reach the VM (see the next test).
  def batched_loss(p):
    return sum(jnp.sum(h ** 2) for h, _ in _tree_lstm.batch([(p, t) for t in _TREES]))

  for f in (jax.grad(batched_loss), jax.grad(lambda p: _loss(_tree_lstm, p, _TREES)),
            dynjax.jit(jax.grad(lambda p: _loss(_tree_lstm, p, _TREES[:2])))):
    with pytest.raises(ControlFlowError) as e:
      f(_TL_PARAMS)
    msg = str(e.value)
    assert msg.startswith("dynjax.recursive cannot be differentiated (jax.grad/jvp/vjp): ")
    assert "no backward pass, inside dynjax.jit either" in msg
    assert "Differentiate a plain-JAX version of the same recursion" in msg
  # the advice works: the same cells as plain functions under jax.grad
  g = jax.grad(lambda p: _loss(_plain, p, _TREES))(_TL_PARAMS)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
  assert float(jnp.abs(g["U_f"]).sum()) > 0


def test_a_recursion_batch_inside_dynjax_jit_runs_on_the_vm():
  # rec.batch (not rec(...)) met the tracers first in a cell's argument, which raised a plain
  # error; dynjax.jit only reroutes NeedsProgram to the VM.
  f = dynjax.jit(lambda p: [h for h, _ in _tree_lstm.batch([(p, t) for t in _TREES[:3]])])
  got = f(_TL_PARAMS)
  for h, t in zip(got, _TREES[:3], strict=True):
    np.testing.assert_allclose(np.asarray(h), np.asarray(_plain(_TL_PARAMS, t)[0]), rtol=1e-5,
                               atol=1e-6)
  with pytest.raises(dc.NeedsProgram, match=r"cell 'embed' got a JAX tracer"):
    jax.jit(lambda p: _tree_lstm.batch([(p, 3)])[0][0])(_TL_PARAMS)


# -- an expression evaluator over dict nodes: three node types, lists of any arity ----------
_EP = P.expr_params()
_ev = dc.recursive(P.make_eval(dc.cell(P.f_num), dc.cell(P.f_bin), dc.cell(P.f_call),
                               lambda: _ev))
_ev_plain = P.make_eval(P.f_num, P.f_bin, P.f_call, lambda: _ev_plain)


def test_dict_node_expression_evaluator_equals_the_plain_recursion():
  n, b, c = P.num, P.binop, P.call
  trees = [b("+", n(1.0), c(n(2.0), b("*", n(3.0), n(4.0)), n(5))), c(n(0.5)), n(2),
           c(b("-", n(1), n(2)), n(3.0), c(n(1.5), n(2.5))), b("*", c(n(1.0)), c(n(1.0)))]
  out = _ev.batch([(_EP, t) for t in trees])
  for o, t in zip(out, trees, strict=True):
    np.testing.assert_allclose(np.asarray(o), np.asarray(_ev_plain(_EP, t)), rtol=1e-6,
                               atol=1e-6)
  assert _ev.last_stats.host_syncs == 0
  with pytest.raises(ControlFlowError) as e:
    _ev(_EP, {"type": "num", "value": "2.5"})  # a value left as text by a parser
  assert str(e.value) == (
      "cell 'f_num': a cell argument must be an array, a number or a cell result; got str "
      "'2.5'. Pass host structures to the recursive function, not to cells (e.g. map a word "
      "to its id before the cell call).")


# -- carries that shrink, or grow at two rates; Python scalars in the carry -----------------
def test_a_halving_reduction_shrinks_the_carry_to_one_element():
  def cond(x):
    return jnp.asarray(x.shape[0]) > 1

  def body(x):  # fold the upper half onto the lower half (padded by zeros when odd)
    h = (x.shape[0] + 1) // 2
    return x[:h] + jnp.pad(x[h:], (0, 2 * h - x.shape[0]))

  for n in (1, 37, 100):
    x = jnp.asarray(np.random.RandomState(n).rand(n).astype(np.float32))
    want = jit_loop(cond, body, x)
    got = dc.while_loop(cond, body, x)
    assert got.shape == want.shape == (1,)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_two_arrays_growing_at_different_rates_with_python_scalars():
  def cond(c):
    return c[2] < 12

  def body(c):
    a, b, i, flag, s = c
    return (jnp.concatenate([a, a[-1:] + 1]), jnp.concatenate([b, b[-2:] * 0.5]), i + 1,
            ~flag, s * 1.5)

  init = (jnp.zeros(3), jnp.ones(4), 0, True, 1.0)
  want = jit_loop(cond, body, jax.tree.map(jnp.asarray, init))
  got = dc.while_loop(cond, body, init)
  assert got[0].shape == (15,) and got[1].shape == (28,)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  st = dc.loop_stats()
  _check_syncs(st)
  # a grows 3 -> 15, b 4 -> 28; off the CPU the loop may start at the cap's bucket
  assert st["buckets"][-1] == (16, 32)
  assert jax.default_backend() != "cpu" or st["buckets"] == [(16, 16), (16, 32)]


_WEAK_CODE = """
import jax, jax.numpy as jnp, numpy as np
from jax import lax
import dynjax.control as dc

def cond(c):
  return c[2] < 10

def grow(c):
  a, b, i, flag, s, k = c
  return (jnp.concatenate([a, a[-1:] + 1]), b + 1, i + 1, ~flag, s * 1.5, k + jnp.int8(1))

def fixed(c):
  a, b, i, flag, s, k = c
  return (a + 1, b + 1, i + 1, ~flag, s * 1.5, k + jnp.int8(1))

init = (jnp.zeros(3), jnp.ones(2), 0, True, 1.0, 0)
want = lax.while_loop(cond, fixed, init)
types = lambda out: [(str(o.dtype), o.weak_type) for o in out]
for body in (fixed, grow):
  for padding in ("auto", "exact"):
    got = dc.while_loop(cond, body, init, padding=padding)
    assert types(got) == types(want), (body.__name__, padding, types(got), types(want))
    assert int(got[2]) == 10 and int(got[5]) == 10 and float(got[4]) == 1.5 ** 10
    # what a weak scalar is for: it takes the other operand's dtype
    assert (got[4] * jnp.ones(2, jnp.float32)).dtype == jnp.float32
print("ok")
"""


@pytest.mark.parametrize("x64", [False, True])
def test_python_scalars_in_the_carry_keep_the_types_lax_while_loop_gives_them(x64):
  # A hoisted loop returned Python-scalar leaves strong (its exact mode weak, as
  # lax.while_loop): under x64 a carry ``s = 1.0`` came back a strong float64, so
  # ``s * x_f32`` turned float64.  And ``0`` plus an int8 was refused as a dtype change,
  # where lax.while_loop starts that leaf as an int8.  A process of its own: x64 is global.
  env = {**os.environ, "JAX_ENABLE_X64": "1" if x64 else "0", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", _WEAK_CODE], env=env, capture_output=True,
                       text=True, timeout=180, cwd=_ROOT)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# -- bad inputs: what the errors say ---------------------------------------------------------
def _grow(t):
  return jnp.concatenate([t, t[-1:] + 1])


def test_a_step_that_changes_dtype_names_the_leaf_and_the_fix():
  with pytest.raises(ControlFlowError) as e:
    dc.while_loop(lambda c: c[1] < 5, lambda c: (_grow(c[0]).astype(jnp.float32), c[1] + 1),
                  (jnp.zeros(3, jnp.int32), jnp.int32(0)))
  assert str(e.value).startswith("body_fun changes the carry in ways dims cannot express:\n"
                                 "  init[0]: dtype int32 -> float32\n")
  assert "cast the body's result back (x.astype(init's dtype))" in str(e.value)


def test_a_carry_whose_structure_changes_names_the_key():
  with pytest.raises(ControlFlowError) as e:
    dc.while_loop(lambda c: c["i"] < 5,
                  lambda c: {"t": _grow(c["t"]), "i": c["i"] + 1, "last": c["t"][-1]},
                  {"t": jnp.zeros(3), "i": jnp.int32(0)})
  assert str(e.value) == (
      "body_fun must return a carry with the structure of init (expected PyTreeDef({'i': *, "
      "'t': *}), got PyTreeDef({'i': *, 'last': *, 't': *})):\n"
      "  result['last']: not in init\n"
      "Return the same containers with the same keys every iteration (e.g. a tuple, not a "
      "list; keep a leaf that may be unused as an array, not None).")
  with pytest.raises(ControlFlowError, match=r"containers differ: init is PyTreeDef\(\(\*, \*\)"
                     r"\), the result PyTreeDef\(\[\*, \*\]\)"):
    dc.while_loop(lambda c: c[1] < 5, lambda c: [_grow(c[0]), c[1] + 1],
                  (jnp.zeros(3), jnp.int32(0)))


def test_a_cond_that_returns_an_array_says_which_dim_and_how_to_reduce_it():
  with pytest.raises(ControlFlowError) as e:
    dc.while_loop(lambda c: c[0] < 5, lambda c: (_grow(c[0]), c[1] + 1),
                  (jnp.zeros(3), jnp.int32(0)))
  assert str(e.value) == (
      "cond_fun must return one scalar boolean (shape (), bool or integer), got bool[n0] "
      "(n0 = init[0].shape[0]): reduce it to one value, e.g. jnp.all(...) or jnp.any(...), or "
      "index the element that decides.")
  with pytest.raises(ControlFlowError, match=r"got float32\[\]: compare it, e.g. x > 0\.$"):
    dc.while_loop(lambda c: c[1] * 0.5, lambda c: (_grow(c[0]), c[1] + 1.0),
                  (jnp.zeros(3), jnp.float32(0)))
