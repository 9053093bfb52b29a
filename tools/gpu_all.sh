#!/bin/bash
# One device call on a 4-GPU machine (run tool, kind nvidia-h200-x4, carry [".wheels"]): the NCCL
# parity suite at TP=2 and TP=4, then the TP=4 and TP=2 benchmarks at (8192, 4096, 128256).
# Each step has its own time limit so that one stuck step cannot eat the call; logs under $OUT.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; nvidia-smi topo -m; \
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
run="python3 -m torch.distributed.run --standalone"
step() {  # step NAME SECONDS GPUS NPROC ARGS...
  local name=$1 secs=$2 gpus=$3 np=$4; shift 4
  local t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpus timeout "$secs" $run --nproc_per_node "$np" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $(( $(date +%s) - t0 ))s"; tail -n 4 "$OUT/$name.log"
}
step pytest_tp2 130 0,1 2 -m pytest tests/test_multigpu*.py -m multigpu -q -p no:cacheprovider
step pytest_tp4 130 0,1,2,3 4 -m pytest tests/test_multigpu*.py -m multigpu -q -p no:cacheprovider
step bench_tp4 140 0,1,2,3 4 tools/benchmark.py --tp 4 --shapes 8192x4096x128256 --chunks auto,4096 --out "$OUT/tp4"
step bench_tp2 120 0,1 2 tools/benchmark.py --tp 2 --shapes 8192x4096x128256 --chunks auto,4096 --out "$OUT/tp2"
grep -h -A40 "^|" "$OUT"/tp4/tp4_results.md "$OUT"/tp2/tp2_results.md 2>/dev/null | head -80
