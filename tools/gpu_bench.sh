#!/bin/bash
# Device-machine script (run tool): peers from carried wheels, the Triton backend's tests on the GPU,
# then tools/benchmark.py with the arguments given. Everything is logged under $OUT.
#   run(command="bash tools/gpu_bench.sh [benchmark args]", carry=[".wheels"])
set -o pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.limit \
  --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
if [ -z "$SKIP_TESTS" ]; then
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_triton_backend.py 2>&1 | tee "$OUT/pytest.log" | tail -3
fi
python3 tools/benchmark.py "$@" 2>&1 | tee "$OUT/bench.log"
