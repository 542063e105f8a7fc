"""The benchmark suite: ``python -m benchmarks WORKLOAD [flags]``, and its real data.

* :mod:`benchmarks.data`: deterministic loaders over the Python standard library
  (docstring lengths and texts, function ASTs as trees) and seeded request streams.
* :mod:`benchmarks.models`: the benchmark models (a jax.numpy encoder, a Linen BERT-style
  encoder, an LSTM classifier) and PyTorch twins that load the same weights.
* :mod:`benchmarks._suite`: the modes compared in one run, timing, table, JSON and plot.

Nothing here is imported by ``import dynjax``.
"""
