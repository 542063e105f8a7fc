"""Runnable examples, and the models and data they share with the tests and the benchmarks.

The scripts (``python examples/bert_serving.py``, ...) put the repository root on ``sys.path``
and import their models from here; the tests import them as ``examples.*``; the benchmark
suite (``benchmarks/``) imports them too and keeps only its runners (timing, tables, JSON).
None of this is in the wheel.

* :mod:`examples.data`: deterministic loaders over the Python standard library (docstring
  lengths and texts, function ASTs as trees) and seeded request streams.
* :mod:`examples.models`: a jax.numpy BERT-style encoder, the same as a Flax Linen module, an
  LSTM classifier, numpy inits, and PyTorch twins that load the same weights.
"""
