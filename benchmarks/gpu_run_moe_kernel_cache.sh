#!/usr/bin/env bash
# Device call (H100, ~7 min): issue 19's end-to-end MoE encoder (bench_moe_gmm.py --parts e2e:
# grouped, lax.ragged_dot, dense; 200 requests; cold start = the first pass over them) in three
# fresh processes sharing one kernel directory (DYNJAX_KERNEL_CACHE): the first finds it empty
# (a cold machine), the second and third load the grouped layer's two Mosaic GPU kernels from
# it (a later process on the same machine), the third with the variants in the opposite order.
# Where jax's export serialization lacks flatbuffers, a copy carried in bench_old/pkgs is used.
source benchmarks/_gpu_head.sh
python3 -c "import flatbuffers" 2>/dev/null || export PYTHONPATH="$PWD/bench_old/pkgs:$PYTHONPATH"
python3 -c "import flatbuffers; print('flatbuffers', flatbuffers.__file__)" | tee -a "$OUT/versions.txt"
export DYNJAX_KERNEL_CACHE=/tmp/dynjax_kernels_$$
rm -rf "$DYNJAX_KERNEL_CACHE"
E2E_ARGS="--parts e2e --e2e-requests 200 --budget 200"
run() {  # name, variants
  mkdir -p "$OUT/$1"
  timeout "${TE:-150}" python3 benchmarks/bench_moe_gmm.py --out "$OUT/$1" $E2E_ARGS \
    --e2e-variants "$2" > "$OUT/$1.log" 2>&1
  echo "$1 rc=$? kernels on disk: $(ls "$DYNJAX_KERNEL_CACHE" 2>/dev/null | wc -l)"
  grep -E "e2e|warm-up|no MoE|FAILED|kernel" "$OUT/$1.log" | cut -c1-220
}
run e2e_empty grouped,ragged_dot,dense
run e2e_kept grouped,ragged_dot,dense
run e2e_kept_rev dense,ragged_dot,grouped
rm -f "$OUT"/e2e*/*.py
(cd "$OUT" && cat e2e_*.log > e2e_all.log && rm -f e2e_empty.log e2e_kept.log e2e_kept_rev.log)
