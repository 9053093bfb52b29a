"""Every method that is not ours, at TP=1: what users write (eager, torch.compile), PyTorch's own
fused op, Megatron, Liger and Apple's cut-cross-entropy. Each `make_<name>(h, w, y, chunk)`
returns a step () -> (loss or log-probs, dX, dW); a peer that cannot run here raises Skip."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .measure import Skip, _forward_only, _grads


def _eager_loss(h, w, y):
    logits = (h @ w.t()).float()
    return F.cross_entropy(logits, y)


def make_torch_eager(h, w, y, chunk):
    return lambda: _grads(_eager_loss(h, w, y), h, w)


_COMPILED = {}


def _compiled(fn, mode=None):
    """One torch.compile of `fn` per mode for the whole run (shapes recompile inside it)."""
    key = (fn, mode)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn) if mode is None else torch.compile(fn, mode=mode)
    return _COMPILED[key]


def make_torch_compile(h, w, y, chunk):
    fn = _compiled(_eager_loss)
    return lambda: _grads(fn(h, w, y), h, w)


def _eager_logprobs(h, w, y):
    return torch.log_softmax((h @ w.t()).float(), -1).gather(1, y[:, None]).squeeze(1)


def make_torch_compile_fwd(h, w, y, chunk):
    fn = _compiled(_eager_logprobs)
    return _forward_only(lambda: fn(h, w, y))


def make_torch_compile_graphed(h, w, y, chunk):
    """torch.compile with CUDA graphs (mode="reduce-overhead"): the peer of our graphed rows."""
    if not torch.cuda.is_available():
        raise Skip("CUDA graphs need a GPU")
    fn = _compiled(_eager_loss, mode="reduce-overhead")
    step = lambda: _grads(fn(h, w, y), h, w)  # noqa: E731
    step.graphed = True
    return step


def make_torch_compile_fwd_graphed(h, w, y, chunk):
    if not torch.cuda.is_available():
        raise Skip("CUDA graphs need a GPU")
    fn = _compiled(_eager_logprobs, mode="reduce-overhead")
    step = _forward_only(lambda: fn(h, w, y).clone())  # (a graph's output is overwritten by its next replay)
    step.graphed = True
    return step


def make_torch_lce(h, w, y, chunk):
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or not hasattr(F, "linear_cross_entropy"):
        raise Skip(f"needs PyTorch >= 2.13 (F.linear_cross_entropy with LinearCrossEntropyOptions); "
                   f"this is {torch.__version__}")
    return lambda: _grads(F.linear_cross_entropy(h, w, y, options=options()), h, w)


_MEGATRON = {}


def _megatron_init():
    if "vpce" in _MEGATRON:
        return _MEGATRON["vpce"]
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"megatron-core not importable: {type(exc).__name__}: {exc}")
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store,
                                rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    _MEGATRON["vpce"] = vocab_parallel_cross_entropy
    return vocab_parallel_cross_entropy


def make_megatron(h, w, y, chunk):
    vpce = _megatron_init()
    return lambda: _grads(vpce(h @ w.t(), y).mean(), h, w)


def make_megatron_fused(h, w, y, chunk):
    """megatron.core's fused_vocab_parallel_cross_entropy on bf16 logits (TP=1), as its language
    module calls it with cross_entropy_loss_fusion=True."""
    _megatron_init()
    try:
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy as fvpce
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"megatron fused_vocab_parallel_cross_entropy not importable: {type(exc).__name__}: {exc}")
    group = parallel_state.get_tensor_model_parallel_group()
    return lambda: _grads(fvpce(h @ w.t(), y, group).mean(), h, w)


def make_liger(h, w, y, chunk):
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"liger-kernel not importable: {type(exc).__name__}: {exc}")
    if h.device.type != "cuda":
        raise Skip("liger needs CUDA")
    loss_fn = LigerFusedLinearCrossEntropyLoss()
    return lambda: _grads(loss_fn(w, h, y), h, w)


def _cuda_peer(name, load):
    """The peer's entry point from `load()`, or Skip when it is not installed or there is no GPU."""
    try:
        fn = load()
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"{name} not importable: {type(exc).__name__}: {exc}")
    if not torch.cuda.is_available():
        raise Skip(f"{name} needs CUDA")
    return fn


def _cce():
    def load():
        from cut_cross_entropy import linear_cross_entropy
        return linear_cross_entropy
    return _cuda_peer("cut-cross-entropy", load)


def make_cce(h, w, y, chunk):
    cce = _cce()
    return lambda: _grads(cce(h, w, y), h, w)  # default gradient filter


def make_cce_exact(h, w, y, chunk):
    cce = _cce()
    return lambda: _grads(cce(h, w, y, filter_eps=None), h, w)


# QuACK (Dao-AILab quack-kernels, CuTe DSL): chunked_linear_cross_entropy. "base" = its cuBLAS
# logits GEMM + CuTe cross-entropy row kernel + dW accumulated by its own GEMM epilogue; "scaled_exp"
# = its fused-backward pipeline (SM90, bf16, V % 128 == 0). The *_tuned rows autotune on the first
# call of each shape (minutes): the benchmark's first call is outside the timing and reported as
# first_call_s.
def _quack():
    def load():
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
        return chunked_linear_cross_entropy
    return _cuda_peer("quack-kernels", load)


def _quack_maker(chunk_rows, tuned, scaled_exp=False):
    def make(h, w, y, chunk):
        fn = _quack()
        rows = h.shape[0] if chunk_rows is None else chunk_rows
        rows = -(-rows // 128) * 128  # its TMA GEMMs want multiples of 8 (scaled-exp: of 128)
        return lambda: _grads(fn(h, w, y, chunk_size=rows, tuned=tuned, use_scaled_exp=scaled_exp), h, w)
    return make


make_quack_c4096 = _quack_maker(4096, tuned=False)
make_quack_one_chunk = _quack_maker(None, tuned=False)
make_quack_c4096_tuned = _quack_maker(4096, tuned=True)
make_quack_one_chunk_tuned = _quack_maker(None, tuned=True)
make_quack_scaled_exp_c4096 = _quack_maker(4096, tuned=False, scaled_exp=True)
