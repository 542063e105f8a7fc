#!/usr/bin/env bash
# One device call: device arrays padded through the host or on the device (jit/_devpad.py):
# probe_device_pad.py (parts, a MoE training loop, the block forward), then the route's tests.
source benchmarks/_gpu_head.sh
python3 benchmarks/probe_device_pad.py --out "$OUT" 2>&1 | tee "$OUT/probe_device_pad.log"
python3 -m pytest -q -p no:cacheprovider tests/jit/test_devpad.py 2>&1 | tail -5 | tee "$OUT/test_devpad_gpu.log"
