"""Runnable examples, and the models and data they share with the tests and the benchmarks.

The scripts (``python examples/bert_serving.py``, ...) put the repository root on ``sys.path``
and import their models from here; the tests import them as ``examples.*``; the benchmark
suite (``benchmarks/``) imports them too and keeps only its runners (timing, tables, JSON).
None of this is in the wheel.

* :mod:`examples.data`: deterministic loaders over the Python standard library (docstring
  lengths and texts, function ASTs as trees) and seeded request streams.
* :mod:`examples.models`: a jax.numpy BERT-style encoder, the same as a Flax Linen module, an
  LSTM classifier, numpy inits, and PyTorch twins that load the same weights.
* :mod:`examples.decode_lm`: a byte-level transformer LM and greedy decoding written every way
  (``dynjax.while_loop``, exact-shape ``jax.jit`` steps, a padded buffer), an encoder before
  the loop, nested loops.
* :mod:`examples.treelstm_model`: child-sum Tree-LSTM cells and encoders (``dynjax.recursive``,
  ``dynjax.control.fold``), their numpy references and PyTorch twins.
* :mod:`examples.moe_encoder`: a one-layer MoE transformer encoder whose FFN is
  ``dynjax.route`` (profiled, exact-sync), dense, or ``lax.ragged_dot``.
"""
