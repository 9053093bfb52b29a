#!/usr/bin/env bash
# Fused vs unfused output layer in Megatron-LM's own training loop on one GPU (see
# tools/real_loop_curves.py). megatron.training comes from the megatron-core >= 0.19 wheel in
# .wheels/ when the interpreter lacks it (fetch it where an index is reachable:
#   pip download --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_28_x86_64 -d .wheels "megatron-core>=0.19").
# Needs tokenizers, transformers and matplotlib (present with the CUDA image's torch).
#   OUT=/tmp/out tools/real_loop_curves.sh full --stages main               # ~350M GPT, 500 steps
#   OUT=/tmp/out tools/real_loop_curves.sh full --stages main,resume,resume_full --main-iters 252 --parallel
#   OUT=/tmp/out tools/real_loop_curves.sh full --stages mtp --serial-mtp
#   OUT=/tmp/out tools/real_loop_curves.sh tiny --parallel                  # a quick check
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/real_loop_out}
WORK=${WORK:-/tmp/real_loop}
SITE=${SITE:-/tmp/real_loop_site}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import megatron.training.argument_utils" >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .wheels/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# Megatron-LM's initialization runs `make` in megatron/core/datasets (its checkout has a Makefile);
# the wheel ships the built helpers_cpp module but no Makefile: give it one that checks the module.
datasets_dir=$(python3 -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))")
if [ ! -e "$datasets_dir/Makefile" ] && [ -w "$datasets_dir" ]; then
  printf 'all:\n\t@python3 -c "import megatron.core.datasets.helpers_cpp"\n' >"$datasets_dir/Makefile"
fi
python3 -c "import sys, torch, megatron.core, tokenizers, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'tokenizers', tokenizers.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
preset=${1:-full}
shift || true
python3 tools/real_loop_curves.py --preset "$preset" --work "$WORK" --out "$OUT" "$@"
