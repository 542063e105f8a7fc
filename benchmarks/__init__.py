"""The benchmark suite: ``python -m benchmarks WORKLOAD [flags]``.

* :mod:`benchmarks._suite`: the modes compared in one run, timing, table, JSON and plot;
  :mod:`benchmarks._workloads` the bert / encoder / lstm workloads.
* :mod:`benchmarks.decode`, :mod:`benchmarks.treelstm`, :mod:`benchmarks.moe`: the runners of
  the control-flow and routing benchmarks.

Only runners live here: the models and the real data they run are in ``examples/``
(:mod:`examples.data`, :mod:`examples.models`, :mod:`examples.decode_lm`,
:mod:`examples.treelstm_model`, :mod:`examples.moe_encoder`), where the tests and the example
scripts import them too.  Nothing here is imported by ``import dynjax``, nor is it in the wheel.
"""
