#!/bin/bash
# Device-machine script (run tool): peers from carried wheels, the Triton backend's tests on the GPU,
# then tools/benchmark.py with the arguments given. Everything is logged under $OUT (at most 8 files
# come back: bench.log with the GPU, pytest and benchmark output; results.json, results.md, the
# Pareto PNGs and sweep.png).
#   run(command="bash tools/gpu_bench.sh [benchmark args]", carry=[".wheels"])
# SKIP_TESTS=1 skips pytest.
set -o pipefail
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/bench.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.limit \
  --format=csv 2>&1 | tee "$LOG"
if [ -z "$SKIP_TESTS" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_backend.py 2>&1 | tail -3 | tee -a "$LOG"
fi
python3 tools/benchmark.py "$@" 2>&1 | tee -a "$LOG"
