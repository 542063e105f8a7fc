"""``benchmarks/bench_moe_gmm.py``'s e2e variant options (the e2e itself runs on the H100)."""

from __future__ import annotations

import pytest

from benchmarks import bench_moe_gmm


def test_an_unknown_combine_option_is_named_with_the_known_ones():
  with pytest.raises(SystemExit, match=r"unknown option \+bogus of 'grouped\+bogus' "
                                       r"\(\+apart, \+fused, \+sort\)"):
    bench_moe_gmm.main(["--small", "--parts", "e2e", "--e2e-requests", "2",
                        "--e2e-variants", "grouped+bogus"])
