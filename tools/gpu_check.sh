#!/usr/bin/env bash
# The GPU check: what the CPU-only CI cannot run, on one machine with the GPUs it can see (1, 2,
# 4 or 8; CUDA_VISIBLE_DEVICES chooses), then one summary table. Each stage runs well inside ten
# minutes (every step has its own time limit), so the stages can run as separate commands:
#
#   tools/gpu_check.sh                        # every stage, then the summary
#   tools/gpu_check.sh tests                  # one stage (or several: tools/gpu_check.sh tools bench)
#   tools/gpu_check.sh summary                # the table again, from the logs so far
#   tools/gpu_check.sh --dry-run [--gpus 4]   # print the commands, run nothing (works without GPUs)
#
# Stages:
#   env        the GPUs, driver, Python and package versions
#   tests      the test suite on CUDA (python -m pytest tests -q), its files dealt out to
#              GPU_CHECK_TEST_SHARDS (default 8) pytest processes run side by side, each under
#              its own limit (in one process the suite takes well over ten minutes on one H100:
#              its gloo-worker tests start fresh processes on a CUDA machine). A shard that runs
#              out of time shows its progress in the table; more shards, or its files (the first
#              line of its log) run on their own, finish it
#   cute       the tests of the paths through QuACK's kernels (the `cute` extra: its row kernel on
#              the remembered routes, its dW GEMM, the steady state with it), which the tests stage
#              runs with the extra only where it is installed; skipped, with the reason, where
#              quack-kernels / nvidia-cutlass-dsl do not import
#   multigpu   the NCCL suites at the visible GPU count N (skipped below 2 GPUs):
#              torchrun --nproc_per_node N -m pytest tests/test_multigpu*.py -m multigpu
#   pretrain   the README's main job on the GPUs: examples/pretrain_gpt.py, TP 2 (and PP 2 on a
#              multiple of 4 GPUs), --compare-unfused
#   examples   SFT, DPO and GRPO with their GPU configurations (examples/configs/<name>_gpu.yaml
#              where one exists, else the default config) for a few steps, and the
#              Megatron-LM-style example (bf16, distributed optimizer, MTP)
#   real_loop  Megatron-LM's own training loop on real text, fused and unfused (megatron-core >= 0.19)
#   tools      each tool's smoke run on the GPUs: e2e_seqlen (TP = N, sequence parallel, all three
#              losses), profile_op, host_sync_cost, host_time, main_grad_loss_scale, sampling_mask_bench,
#              make_text_dataset, benchmark --quick
#   bench      tools/benchmark.py at 8192x4096x128256 on one GPU, and at TP = N (2 or more GPUs)
#   bench_rl   tools/benchmark.py --grid rl at two RL shapes (2048 and 8192 tokens, a 32064-id shard; each
#              row timed in alternation with its floor), and
#              tools/host_ab.py's in-process A/B of host time run against this checkout itself
#   summary    one table (stage, step, result, time, key figure) from the logs: summary.md
#
# Options: --out DIR (or GPU_CHECK_OUT; default ./gpu_check_out): every step writes DIR/<step>.log
# and DIR/<step>.status, and steps.txt lists the steps in the order they ran; --gpus N (or
# GPU_CHECK_GPUS): the GPU count to plan for (default: what torch sees); --steps N (or
# GPU_CHECK_STEPS, default 5): optimizer steps of each example. PYTHON picks the interpreter.
# Exit status: 1 if a step of this invocation failed or timed out (the summary's, if it ran).
#
# The examples' flags live in stage_examples below: edit them there when the examples change.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-$PWD/gpu_check_out}
N=${GPU_CHECK_GPUS:-}
EXAMPLE_STEPS=${GPU_CHECK_STEPS:-5}
TEST_SHARDS=${GPU_CHECK_TEST_SHARDS:-8}
DRY=0
ALL_STAGES=(env tests cute multigpu pretrain examples real_loop tools bench bench_rl summary)
stages=()
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) OUT=$2; shift ;;
    --out=*) OUT=${1#--out=} ;;
    --gpus) N=$2; shift ;;
    --gpus=*) N=${1#--gpus=} ;;
    --steps) EXAMPLE_STEPS=$2; shift ;;
    --steps=*) EXAMPLE_STEPS=${1#--steps=} ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) stages+=("$1") ;;
  esac
  shift
done
[ ${#stages[@]} -eq 0 ] && stages=("${ALL_STAGES[@]}")
for stage in "${stages[@]}"; do
  case " ${ALL_STAGES[*]} " in
    *" $stage "*) ;;
    *) echo "gpu_check: unknown stage '$stage'; stages: ${ALL_STAGES[*]}" >&2; exit 2 ;;
  esac
done
if [ $DRY = 1 ]; then
  OUT=$(realpath -m "$OUT")  # (a dry run creates nothing)
else
  OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd) || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
fi

needs_gpus=0
for stage in "${stages[@]}"; do [ "$stage" != summary ] && needs_gpus=1; done
if [ -z "$N" ] && [ $needs_gpus = 1 ]; then
  N=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  if [ "$N" = 0 ]; then
    if [ $DRY = 1 ]; then
      echo "(no GPU visible: the commands for 1 GPU; --gpus N for more)"
      N=1
    else
      echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.device_count() is 0)" >&2
      exit 2
    fi
  fi
fi
N=${N:-1}
TORCHRUN=("$PY" -m torch.distributed.run --standalone)
export PYTHONUNBUFFERED=1
# Tensor parallelism of the multi-GPU runs: 2 on an even GPU count (the rest is data / pipeline
# parallelism), none on one GPU.
TP=1
[ "$N" -ge 2 ] && [ $((N % 2)) = 0 ] && TP=2

quote() {  # the command as it could be pasted into a shell
  local arg out=()
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$arg"); else out+=("$(printf '%q' "$arg")"); fi
  done
  echo "${out[*]}"
}

STAGE=""
FAILED=0
run_step() {  # run_step NAME SECONDS COMMAND...: COMMAND under a time limit, its output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "\$ $(quote "$@")" > "$OUT/$name.log"
  echo "[$STAGE] $name: running (limit ${limit}s, log $OUT/$name.log)"
  local t0=$SECONDS rc
  timeout -k 30 "$limit" "$@" >> "$OUT/$name.log" 2>&1
  rc=$?
  printf 'stage=%s\nrc=%s\nseconds=%s\nlimit=%s\n' "$STAGE" "$rc" "$((SECONDS - t0))" "$limit" > "$OUT/$name.status"
  echo "[$STAGE] $name: exit status $rc after $((SECONDS - t0)) s"
  return $rc
}

step() {  # step NAME SECONDS COMMAND...: one step, the next starts when it has ended
  if [ $DRY = 1 ]; then
    echo "[$STAGE] $1 (limit ${2}s): $(quote "${@:3}")"
    return 0
  fi
  echo "$1" >> "$OUT/steps.txt"
  rm -f "$OUT/$1.status"
  run_step "$@" || FAILED=1
  return 0
}

BACKGROUND=()
step_side_by_side() {  # the same, started in the background; wait_side_by_side waits for them all
  if [ $DRY = 1 ]; then
    echo "[$STAGE] $1 (limit ${2}s, side by side): $(quote "${@:3}")"
    return 0
  fi
  echo "$1" >> "$OUT/steps.txt"
  rm -f "$OUT/$1.status"
  run_step "$@" &
  BACKGROUND+=($!)
}

wait_side_by_side() {
  local pid
  for pid in "${BACKGROUND[@]}"; do wait "$pid" || FAILED=1; done
  BACKGROUND=()
}

skip() {  # skip NAME REASON: a step that does not apply here (a line of the table all the same)
  local name=$1 reason=$2
  if [ $DRY = 1 ]; then
    echo "[$STAGE] $name: skipped ($reason)"
    return 0
  fi
  echo "$name" >> "$OUT/steps.txt"
  echo "skipped: $reason" > "$OUT/$name.log"
  printf 'stage=%s\nrc=skip\nseconds=0\nreason=%s\n' "$STAGE" "$reason" > "$OUT/$name.status"
  echo "[$STAGE] $name: skipped ($reason)"
}

config() {  # config NAME: the example's GPU configuration where one exists, else its default
  if [ -e "examples/configs/$1_gpu.yaml" ]; then echo "examples/configs/$1_gpu.yaml"; else echo "examples/configs/$1.yaml"; fi
}

stage_env() {
  step env 120 "$PY" tools/gpu_check_report.py env
}

stage_tests() {  # the test files dealt out largest first, each to the shard with the fewest bytes so far
  local i size file best
  local -a load=() files=()
  for ((i = 0; i < TEST_SHARDS; i++)); do load[i]=0; files[i]=""; done
  while read -r size file; do
    best=0
    for ((i = 1; i < TEST_SHARDS; i++)); do [ "${load[i]}" -lt "${load[best]}" ] && best=$i; done
    load[best]=$((load[best] + size))
    files[best]="${files[best]} $file"
  done < <(stat -c '%s %n' tests/test_*.py | sort -k1,1nr -k2)
  for ((i = 0; i < TEST_SHARDS; i++)); do
    # shellcheck disable=SC2086  # (the file list splits into its words on purpose)
    step_side_by_side "tests_$((i + 1))" 590 "$PY" -m pytest ${files[i]} -q -p no:cacheprovider
  done
  wait_side_by_side
}

stage_cute() {
  if [ $DRY = 0 ] && ! "$PY" -c "import quack, cutlass" > /dev/null 2>&1; then
    skip cute_tests "the cute extra does not import here (pip install -e '.[cute]')"
    return
  fi
  step cute_tests 500 "$PY" -m pytest tests/test_cute_backend.py tests/test_cuda_steady_state.py -q \
    -p no:cacheprovider
}

stage_multigpu() {
  if [ "$N" -lt 2 ]; then
    skip multigpu "needs 2 or more GPUs, $N visible"
    return
  fi
  step multigpu 590 "${TORCHRUN[@]}" --nproc_per_node "$N" -m pytest tests/test_multigpu*.py -m multigpu -q \
    -p no:cacheprovider
}

stage_pretrain() {  # README: torchrun --nproc_per_node 4 examples/pretrain_gpt.py --tp 2 --pp 2 --compare-unfused
  local parallel=()
  [ "$TP" = 2 ] && parallel+=(--tp 2)
  [ $((N % 4)) = 0 ] && parallel+=(--pp 2)
  step pretrain 300 "${TORCHRUN[@]}" --nproc_per_node "$N" examples/pretrain_gpt.py "${parallel[@]}" --compare-unfused
}

stage_examples() {
  local tp=()
  [ "$TP" = 2 ] && tp=(--tp 2)
  local name
  for name in sft dpo grpo; do
    step "examples_$name" 140 "${TORCHRUN[@]}" --nproc_per_node "$N" "examples/$name.py" --config "$(config $name)" \
      --steps "$EXAMPLE_STEPS" "${tp[@]}" --compare-unfused --log-jsonl "$OUT/examples_$name.jsonl"
  done
  step examples_rl_curves 30 "$PY" tools/rl_curves.py "sft=$OUT/examples_sft.jsonl" \
    "dpo=$OUT/examples_dpo.jsonl" "grpo=$OUT/examples_grpo.jsonl"
  step examples_megatron_lm 140 "${TORCHRUN[@]}" --nproc_per_node "$N" examples/megatron_lm_pretrain.py \
    --tensor-model-parallel-size "$TP" --bf16 --use-distributed-optimizer --overlap-grad-reduce \
    --overlap-param-gather --mtp-num-layers 1 --use-linear-ce-fusion-loss --train-iters 20 --compare-unfused
}

stage_real_loop() {  # one GPU; the dataset and checkpoints stay in $OUT/real_loop_work
  step real_loop 570 env OUT="$OUT/real_loop" WORK="$OUT/real_loop_work" PYTHON="$PY" \
    tools/real_loop_curves.sh tiny --stages main --parallel --deadline 420
}

stage_tools() {
  step tools_e2e_seqlen 120 "${TORCHRUN[@]}" --nproc_per_node "$N" tools/e2e_seqlen.py --tp "$N" \
    --hidden 1024 --layers 4 --heads 16 --vocab 128256 --seqs 2048,4096,8192 --steps 3 \
    --modes fused,unfused,megatron --out "$OUT/tools_e2e_seqlen"
  step tools_profile_op 60 "$PY" tools/profile_op.py --shape 8192x4096x128256 --paths ce,logprobs,fwd,grpo --reps 2
  step tools_host_sync_cost 60 "$PY" tools/host_sync_cost.py --shapes 8192x4096x128256
  step tools_host_time 30 "$PY" tools/host_time.py --shape 2048x4096x19008 --rounds 3
  step tools_main_grad_loss_scale 60 "$PY" tools/main_grad_loss_scale.py
  step tools_sampling_mask_bench 60 "$PY" tools/sampling_mask_bench.py --shapes 8192x4096x128256 --sets zipf \
    --ks 50,512
  step tools_make_text_dataset 60 "$PY" tools/make_text_dataset.py --output-dir "$OUT/tools_make_text_dataset" \
    --vocab-size 512 --max-files 40
  step tools_benchmark_quick 150 "$PY" tools/benchmark.py --quick --out "$OUT/tools_benchmark_quick"
}

stage_bench() {
  local shape=8192x4096x128256
  step bench_one_gpu 300 "$PY" tools/benchmark.py --shapes "$shape" --spreads random --sweep "" \
    --impls floor,floor_fwd,torch_compile,megatron,quack_c4096,ours_ce,ours_ce_lean,ours_logprobs,ours_grpo,ours_ce_main_grad,ours_fwd \
    --time-limit-s 240 --out "$OUT/bench_one_gpu"
  if [ "$N" -lt 2 ]; then
    skip bench_tp "tensor parallelism needs 2 or more GPUs"
    return
  fi
  step bench_tp 280 "${TORCHRUN[@]}" --nproc_per_node "$N" tools/benchmark.py --tp "$N" --shapes "$shape" \
    --chunks auto --out "$OUT/bench_tp"
}

stage_bench_rl() {
  # RL shapes (micro-batches of 2048 and 8192 tokens, a vocab shard of 32064): the host's work per call shows;
  # each row timed in alternation with its floor (the GPU's GEMMs slow under load: docs/bench/rl_grid_paired_h200.md)
  step bench_rl 300 "$PY" tools/benchmark.py --grid rl --shapes 2048x4096x32064,8192x4096x32064 \
    --impls floor,floor_fwd,torch_compile,torch_compile_fwd,megatron_fused,ours_ce,ours_logprobs,ours_grpo,ours_fwd,ours_ce_graphed,ours_fwd_graphed \
    --paired-floor --steady-ms 200 --time-limit-s 240 --out "$OUT/bench_rl"
  step bench_rl_host_ab 60 "$PY" tools/host_ab.py --against . --shape 2048x4096x19008 --method replay,logprobs \
    --calls 50
}

stage_summary() {
  if [ $DRY = 1 ]; then
    echo "[summary] $(quote "$PY" tools/gpu_check_report.py summary "$OUT")"
    return 0
  fi
  "$PY" tools/gpu_check_report.py summary "$OUT"
  SUMMARY_RC=$?
}

[ $DRY = 1 ] || echo "gpu_check: $N GPU(s), output in $OUT"
SUMMARY_RC=""
for STAGE in "${stages[@]}"; do
  "stage_$STAGE"
done
if [ -n "$SUMMARY_RC" ]; then
  exit "$SUMMARY_RC"
fi
exit $FAILED
