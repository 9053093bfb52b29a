#!/bin/bash
# Device-machine script for tensor parallel (run tool, a multi-GPU kind): peers from carried wheels,
# the multi-GPU pytest suite (NCCL, tests/test_multigpu*.py), then the TP benchmark (tools/benchmark.py --tp N). Logs under $OUT.
#   run(command="bash tools/gpu_tp.sh 2 [benchmark args]", carry=[".wheels"], kind="nvidia-h200-x2")
#   run(command="bash tools/gpu_tp.sh 4 [benchmark args]", carry=[".wheels"], kind="nvidia-h200-x4")
# SKIP_TESTS=1 skips pytest; SKIP_BENCH=1 skips the benchmark.
set -o pipefail
NP=${1:-2}
shift || true
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.limit \
    --format=csv; nvidia-smi topo -m; } > "$OUT/gpu_tp$NP.txt" 2>&1
cat "$OUT/gpu_tp$NP.txt"
rc=0
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m torch.distributed.run --standalone --nproc_per_node "$NP" \
    -m pytest tests/test_multigpu*.py -m multigpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_multigpu_tp$NP.log" | tail -15
  rc=$?
  echo "multi-GPU pytest exit status: $rc"
fi
if [ -z "$SKIP_BENCH" ]; then
  python3 -m torch.distributed.run --standalone --nproc_per_node "$NP" tools/benchmark.py --tp "$NP" "$@" 2>&1 \
    | tee "$OUT/bench_tp$NP.log"
  brc=$?
  [ $rc -eq 0 ] && rc=$brc
fi
exit $rc
