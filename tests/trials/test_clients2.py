"""Real-client trials, second set (``_clients2.py``) under ``padding="auto"``: every call
compared with ``jax.jit`` at the exact shape (rtol = atol = 1e-5), compiles counted through
``jax.monitoring``, as ``test_clients.py`` does for the first set.

A fallback that cannot be avoided is stated exactly (its reason, one compile per shape), with
the cause in a comment.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from tests.trials import _clients, _clients2  # noqa: E402
from tests.trials.test_clients import _fell_back, _padded, _run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:dynjax.jit.*running unpadded:UserWarning")


class _Trials:
  def __getitem__(self, name):
    return _clients2.get(name)  # each group built once per process, outside the compile counts


@pytest.fixture(scope="module")
def trials():
  _clients.warm_jax()
  return _Trials()


PADDED = [
  # HF FlaxT5 relative position bias (log buckets of jnp.arange differences, nn.Embed)
  "t5_encoder forward",
  "t5_encoder train",
  # HF FlaxLlama: left padding, positions by cumsum, a sliced max-length causal mask
  "llama_decoder forward",
  "llama_decoder train",
  # nn.Bidirectional(nn.RNN(GRUCell / OptimizedLSTMCell), seq_lengths=), final carries
  "bigru_tagger forward",
  "bigru_tagger train",
  # T5X/MaxText packing: segment_ids masks, jax.nn.dot_product_attention (mask= / seq lengths)
  "packed_lm forward",
  "packed_lm train",
  "packed_lm seq_lengths forward",
  # Whisper-like: SAME conv, stride-2 conv (its gradient: bucketing/_conv_vjp.py since
  # session 24; before, the training step fell back on JAX's symbolic transpose padding)
  "conv_audio forward",
  "conv_audio train",
  # HF *ForSequenceClassification last-token pooling, take_along_axis, segment_sum
  "last_token_pool forward",
  "last_token_pool train",
]


@pytest.mark.parametrize("name", PADDED)
def test_client_is_exact_and_bucketed(trials, name, compiles):
  _padded(_run(trials, name, compiles))


def test_the_llama_loss_traces_under_the_inferred_guard(trials, compiles):
  # logits[:, :-1] against input_ids[:, 1:] asks t - 1 >= 1: dynjax guards t >= 2 (the trial's
  # smallest call is t = 2; a t = 1 call would run exact)
  r = _run(trials, "llama_decoder train", compiles)
  fam = next(iter(r["fn"]._dispatcher.families.values()))
  assert fam.guards == ("t >= 2",)


def test_a_numpy_positions_table_sliced_by_the_length_falls_back_with_advice(trials, compiles):
  r = _run(trials, "conv_audio numpy table forward", compiles)
  # Unavoidable: sinusoids_np(n, d)[: x.shape[1]] asks NumPy to slice by a symbolic size
  # (TypeError: slice indices must be integers ...); NumPy cannot hold an array of one.  The
  # warning names the line and says what to do (jnp.asarray(table)[:t], as "conv_audio" does).
  _fell_back(r, "symbolic tracing failed", "slice indices must be integers",
             "_clients2.py:", "x = x + table(MAX_POS, D)[: x.shape[1]]",
             "jnp.asarray(table)[:t]")
