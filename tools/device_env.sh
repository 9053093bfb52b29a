# Sourced by the device scripts (tools/gpu_*.sh): $OUT, unbuffered Python, an inductor cache, and the
# peers carried as wheels in .wheels/ (installed --no-deps, so the machine's torch/triton stay in charge).
export OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
