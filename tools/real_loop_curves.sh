#!/usr/bin/env bash
# Fused vs unfused output layer in Megatron-LM's own training loop on one GPU: tools/real_loop_curves.py
# with its folders from the environment (OUT: summary, plot and logs, default ./real_loop_out;
# WORK: dataset and checkpoints, default /tmp/real_loop). Needs megatron-core >= 0.19
# (megatron.training, Python >= 3.12), tokenizers, transformers and matplotlib; the tool says what
# is missing.
#   OUT=/tmp/out tools/real_loop_curves.sh full --stages main               # ~350M GPT, 500 steps
#   OUT=/tmp/out tools/real_loop_curves.sh full --stages main,resume,resume_full --main-iters 252 --parallel
#   OUT=/tmp/out tools/real_loop_curves.sh full --stages mtp --serial-mtp
#   OUT=/tmp/out tools/real_loop_curves.sh tiny --parallel                  # a quick check
# Megatron-LM's default stack (TE layers, gradient-accumulation fusion, distributed optimizer), the
# pair with today's package code and with that of an older revision, four runs on two GPUs:
#   OUT=/tmp/out tools/real_loop_curves.sh full --stages main --stack te --old-code 3990de5 \
#       --parallel --gpus 2 --no-save --iters 500 --deadline 250
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-full}
shift || true
exec "${PYTHON:-python3}" tools/real_loop_curves.py --preset "$preset" --work "${WORK:-/tmp/real_loop}" \
  --out "${OUT:-$PWD/real_loop_out}" "$@"
