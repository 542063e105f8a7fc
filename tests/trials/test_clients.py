"""Real-client trials (``_clients.py``) under ``padding="auto"``: every call compared with
``jax.jit`` (``nnx.jit``) at the exact shape, compiles counted through ``jax.monitoring``.

Where dynjax does not yet run a client padded, the test states today's behaviour exactly (the
fallback's reason, one compile per exact shape) with the root cause in a comment, so that it
fails once the cause is fixed and someone updates it.  A wrong result is a bug: it is marked
``xfail(strict=True)``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from tests.trials import _clients  # noqa: E402

# the fallbacks' warnings are what the tests assert on (through stats()["fallbacks"])
pytestmark = pytest.mark.filterwarnings("ignore:dynjax.jit.*running unpadded:UserWarning")

PER_SHAPE = 3  # every trial makes three calls of three distinct shapes over two buckets


class _Trials:
  def __getitem__(self, name):
    return _clients.get(name)  # each group built once per process, outside the compile counts


@pytest.fixture(scope="module")
def trials():  # XLA optimisations are off suite-wide (conftest.py)
  _clients.warm_jax()  # jax's one-off "stage" compile of dynjax's int32[k] sizes vector
  return _Trials()


def _run(trials, name, compiles, **kw):
  trial = trials[name]
  start = compiles()
  r = _clients.run(trial, **kw)
  assert r["exact"], r["bad"]
  # run() counts the dynjax calls only (the reference compiles after them), through the same
  # jax.monitoring listener as the ``compiles`` fixture
  assert r["compiles"] <= compiles() - start
  assert r["fn"].stats()["compiles"] == r["compiles"]
  return r


def _padded(r):
  assert r["fallbacks"] == []
  assert r["compiles"] == r["buckets"] == 2  # one compile per bucket


def _fell_back(r, *words):
  """Today's behaviour: one fallback whose reason names ``words``; one compile per shape."""
  assert len(r["fallbacks"]) == 1, r["fallbacks"]
  for w in words:
    assert w in r["fallbacks"][0], r["fallbacks"][0]
  assert r["compiles"] == PER_SHAPE


# -- 1. beam search (flax examples/wmt/decode.py) ----------------------------------------------


def test_beam_search_is_padded(trials, compiles):
  # WMT's add_beam_dim tiles (b, 1, s, d) by reps (1, beam, 1, 1) and beam_init tiles a row by
  # [batch_size, 1]: jax's `tile` primitive, padded by its rule (copies along static axes run
  # as is; along a dynamic axis the copies are gathered back to back into the prefix).
  _padded(_run(trials, "beam_search", compiles))


# -- 2. speech front end + optax.ctc_loss -----------------------------------------------------


def test_speech_forward_is_padded(trials, compiles):
  _padded(_run(trials, "speech_ctc forward", compiles))


def test_speech_ctc_train_is_padded_under_an_inferred_guard(trials, compiles):
  r = _run(trials, "speech_ctc train", compiles)
  # optax's ctc_loss_with_forward_probs takes logalpha_phi[-1] of the scan over the subsampled
  # length T' = floordiv(floordiv(floordiv(t - 3, 2) - 2, 2) - ...); jax's gather shape rule
  # (lax/slicing.py _gather_shape_rule) asks T' >= 1, undecidable without a constraint.  Until
  # session 25 this fell back (only ``t + c OP k`` became a guard); _guards._split finds where
  # that one-variable comparison flips (t = 11) and the family re-traces under t >= 11.
  _padded(r)
  fam = next(iter(r["fn"]._dispatcher.families.values()))
  assert fam.guards == ("t >= 11",)


def test_speech_ctc_train_with_constraint_is_padded(trials, compiles):
  r = _run(trials, "speech_ctc train t>=15", compiles)
  # Until session 24 this fell back: jax/_src/lax/convolution.py _conv_general_vjp_lhs_padding
  # computes the transposed conv's padding from the shapes; for a strided conv whose input
  # length is not a multiple of the stride it is a symbolic expression (t -
  # 2*floordiv(t - 3, 2) - ...), and conv_general_dilated accepts only integer padding.
  # dynjax/bucketing/_conv_vjp.py now pads the input by lax.pad first (tests/bucketing/
  # test_conv_vjp.py).
  _padded(r)


def test_speech_slice_paddings_are_padded_under_a_shape_identity(trials, compiles):
  # paddings[:, 2::2] has length ceil((t - 2) / 2) and the VALID conv floordiv(t - 3, 2) + 1:
  # jax cannot prove them equal, so `x * (1 - paddings)` failed to broadcast and the model ran
  # one compile per length (until session 26; with t >= 7 inferred since session 25).  They
  # are one size at every length: the family adds that rule (jit/_facts.py) and pads.
  _padded(_run(trials, "speech_ctc (slice paddings) forward", compiles))
  _padded(_run(trials, "speech_ctc (slice paddings) forward t>=15", compiles))


# -- 3. masked-LM training step with optax ----------------------------------------------------


def test_mlm_train_step_numpy_and_device_batches_are_padded(trials, compiles):
  # One test for both batch kinds: they share the reference's exact-shape compiles (~8 s of
  # CPU when they ran as two tests on two workers).
  # The step returns its new PRNG key: with numpy batches the outputs come back as numpy,
  # except arrays of an extended dtype (keys), which stay jax arrays (they have no numpy form).
  _padded(_run(trials, "mlm_optax train", compiles))
  # dropout and the 80/10/10 masking draw jax.random bits of shape (b, t): bit-identical padded
  _padded(_run(trials, "mlm_optax train device batch", compiles))


# -- 4. GNN with jraph's padding conventions --------------------------------------------------


@pytest.mark.parametrize("name", ["jraph_gnn forward", "jraph_gnn train"])
def test_jraph_gnn_is_padded(trials, name, compiles):
  _padded(_run(trials, name, compiles))


# -- 5. scan over layers ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["scan_layers linen train", "scan_layers nnx train+opt"])
def test_scan_layers_lm_loss_traces_under_an_inferred_guard(trials, name, compiles):
  r = _run(trials, name, compiles)
  # The shifted LM loss gathers take_along_axis(logp[:, :-1], tokens[:, 1:]); jax's gather
  # shape rule asks whether t - 1 >= 1, which tracing cannot decide: dynjax infers the guard
  # t >= 2 (the side that holds for more of the policy's sizes), traces under it, and would run
  # a t = 1 call exact.  Without guards this fell back (one compile per shape).
  _padded(r)
  fam = next(iter(r["fn"]._dispatcher.families.values())) if hasattr(r["fn"], "_dispatcher") \
      else None
  if fam is not None:
    assert fam.guards == ("t >= 2",)


@pytest.mark.parametrize("name", ["scan_layers linen train t>=2", "scan_layers nnx train+opt t>=2"])
def test_scan_layers_with_constraint_is_padded(trials, name, compiles):
  _padded(_run(trials, name, compiles))
