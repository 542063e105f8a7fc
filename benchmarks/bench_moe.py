"""Dropless MoE benchmark (thin wrapper): the body is ``dynjax/bench/_moe.py``.

    python benchmarks/bench_moe.py --out DIR            # H100 sizes, all settings incl. e2e
    python benchmarks/bench_moe.py --small --out DIR    # CPU sizes
    python benchmarks/bench_moe.py --small --e2e        # only the end-to-end MoE transformer

Same as ``python -m dynjax.bench moe [-- flags]``; ``--help`` lists the flags.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynjax.bench._moe import main  # noqa: E402

if __name__ == "__main__":
  main()
