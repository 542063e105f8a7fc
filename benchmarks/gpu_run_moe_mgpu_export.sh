#!/usr/bin/env bash
# Device call (H100, ~4 min): the mgpu and hopper kernels checked through jax.export (route._once),
# then the e2e MoE encoder with the "mgpu" grouped layer beside lax.ragged_dot, and again in
# a process that lowers the kernels in every executable (--no-kernel-export): the cold starts.
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/chk $OUT/e2e $OUT/e2e_noexp
timeout 90 python3 benchmarks/bench_moe_kernels.py --out $OUT/chk --parts env,check --check-kernels mgpu,hopper > $OUT/chk.log 2>&1; echo chk rc=$?
grep -E "rel_err|FAILED|error|finite" $OUT/chk.log | cut -c1-160
A="--parts e2e --e2e-requests 200 --budget 200"
timeout 100 python3 benchmarks/bench_moe_gmm.py --out $OUT/e2e $A --e2e-variants grouped-mgpu,ragged_dot > $OUT/e2e.log 2>&1; echo e2e rc=$?
grep -E "e2e|train|no MoE|FAILED" $OUT/e2e.log | cut -c1-220
timeout 80 python3 benchmarks/bench_moe_gmm.py --out $OUT/e2e_noexp $A --e2e-variants grouped-mgpu --no-kernel-export > $OUT/e2e_noexp.log 2>&1; echo noexp rc=$?
grep -E "e2e|FAILED" $OUT/e2e_noexp.log | cut -c1-220
rm -f $OUT/*/*.py
