"""Our methods (the package's ops in each mode) and the registry of every row tools/benchmark.py
can run: MAKERS[name](h, w, y, chunk) -> a step () -> (loss or log-probs, dX, dW)."""

from __future__ import annotations

import torch

from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.cuda_graphs import thread_local_capture

from . import measure, peers
from .measure import Skip, _forward_only, _grads

SHAPES = [(8192, 4096, 128256), (8192, 2304, 256000), (16384, 3584, 152064)]
SWEEP_HV = (4096, 128256)
SWEEP_N = [8192, 16384, 32768, 65536, 131072]
QUICK_SHAPES_GPU = [(2048, 1024, 32000)]
QUICK_SHAPES_CPU = [(48, 32, 500)]
DEFAULT_IMPLS = ("floor,floor_fwd,torch_eager,torch_compile,torch_compile_fwd,torch_lce,megatron,liger,cce,"
                 "cce_exact,ours_ce,ours_ce_lean,ours_logprobs,ours_logprobs_lean,ours_grpo,ours_grpo_lean,"
                 "ours_ce_main_grad,ours_ce_main_grad_buffer,ours_ce_main_grad_lean,ours_fwd,ours_fwd_entropy,"
                 "ours_top_p,ours_top_k,ours_topk20")
SWEEP_IMPLS = "floor,torch_compile,liger,cce,ours_ce,ours_ce_lean,ours_logprobs_lean,ours_fwd"
SPREADS = ("random", "peaked")
# --grid rl: the shapes RL trainers run (micro-batches of 1-16k tokens per rank, the vocab split over
# 1-8 ranks: 152064 / 8 = 19008 ... 128256 whole) against the floor and the peers that run there
RL_GRID = [(n, h, v) for h in (2048, 4096) for v in (19008, 32064, 64128, 128256)
           for n in (1024, 2048, 4096, 8192, 16384)]
RL_IMPLS = ("floor,floor_fwd,torch_compile,torch_compile_fwd,torch_compile_graphed,torch_compile_fwd_graphed,megatron,"
            "megatron_fused,ours_ce,ours_logprobs,ours_grpo,ours_grpo_every_option,ours_fwd,ours_ce_graphed,"
            "ours_logprobs_graphed,ours_grpo_graphed,ours_fwd_graphed")


def parse_chunks(spec):
    return [None if c.strip() == "auto" else int(c) for c in spec.split(",") if c.strip()]


def parse_shapes(spec):
    return [tuple(int(x) for x in s.lower().split("x")) for s in spec.split(",") if s.strip()]


def _impl():
    # the package's default on a GPU: the Triton kernels, and QuACK's one-pass cross-entropy row
    # kernel where quack-kernels is installed and it applies (ops/cute_backend.py)
    return "auto"


def make_ours_logprobs(h, w, y, chunk, memory_mode="fast"):
    n = h.shape[0]
    return lambda: _grads(-linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl(),
                                           memory_mode=memory_mode).logprobs.sum() / n, h, w)


def make_ours_ce(h, w, y, chunk, memory_mode="fast", impl=None):
    return lambda: _grads(linear_cross_entropy(h, w, y, chunk_size=chunk, impl=impl or _impl(), memory_mode=memory_mode),
                          h, w)


def make_ours_ce_triton(h, w, y, chunk):
    """ours_ce on the Triton kernels and cuBLAS alone (impl="triton"): none of QuACK's kernels, where
    the `cute` extra is installed, whatever the chunk's size (cute_backend.MIN_CHUNK_WORK)."""
    return make_ours_ce(h, w, y, chunk, impl="triton")


def make_ours_ce_per_token(h, w, y, chunk):
    """Megatron's output layer with the fused loss: per-token losses (reduction="none"), then the
    loss function's mean over the tokens."""
    n = h.shape[0]
    return lambda: _grads(linear_cross_entropy(h, w, y, chunk_size=chunk, impl=_impl(), reduction="none").sum() / n,
                          h, w)


def make_ours_ce_torch(h, w, y, chunk):
    return lambda: _grads(linear_cross_entropy(h, w, y, chunk_size=chunk, impl="torch"), h, w)


def make_ours_ce_main_grad(h, w, y, chunk, memory_mode="fast", expected_upstream_grad=1.0):
    """Megatron's gradient-accumulation fusion as its loss funcs call it: the upstream gradient (1
    here) known at forward time, dW added into main_grad by the forward's GEMMs."""
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    w.grad_added_to_main_grad = False  # as Megatron's DDP sets it: autograd gets the dummy gradient

    def step():
        loss = linear_cross_entropy(h, w, y, chunk_size=chunk, impl=_impl(), accumulate_into_main_grad=True,
                                    memory_mode=memory_mode, expected_upstream_grad=expected_upstream_grad)
        dx, _ = torch.autograd.grad(loss, (h, w), allow_unused=True)
        return loss.detach(), dx, w.main_grad
    step.main_grad = True
    return step


def make_ours_fwd(h, w, y, chunk, entropy=False, tp_group=None):
    return _forward_only(lambda: linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl(), tp_group=tp_group,
                                                 return_entropy=entropy).logprobs)


def make_ours_ce_fp32_logits(h, w, y, chunk):
    return lambda: _grads(linear_cross_entropy(h, w, y, chunk_size=chunk, impl=_impl(),
                                               logits_dtype=torch.float32), h, w)


def make_ours_logprobs_fp32_logits(h, w, y, chunk):
    n = h.shape[0]
    return lambda: _grads(-linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl(),
                                           logits_dtype=torch.float32).logprobs.sum() / n, h, w)


def _linear_grpo():
    try:
        from megatron_fused_ce import losses
        fn = getattr(losses, "linear_grpo_loss", None)
        if fn is None:
            from megatron_fused_ce.losses.linear_grpo import linear_grpo_loss as fn
        from megatron_fused_ce.losses import GRPOConfig
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"fused GRPO not available: {type(exc).__name__}: {exc}")
    return fn, GRPOConfig


def _grpo_inputs(h, y):
    n = h.shape[0]
    batch = 8 if n % 8 == 0 else 1
    g = torch.Generator(device=h.device).manual_seed(1)
    adv = torch.randn(batch, device=h.device, generator=g)
    mask = torch.ones(batch, n // batch, device=h.device)
    return batch, adv, mask


def make_ours_grpo(h, w, y, chunk, memory_mode="fast", tp_group=None, impl=None):
    fn, GRPOConfig = _linear_grpo()
    batch, adv, mask = _grpo_inputs(h, y)
    config = GRPOConfig()
    hb, yb = h.view(batch, -1, h.shape[-1]), y.view(batch, -1)

    def step():
        loss, _ = fn(hb, w, yb, adv, mask, config, chunk_size=chunk, impl=impl or _impl(), memory_mode=memory_mode,
                     tp_group=tp_group)
        return _grads(loss, h, w)
    step.loss_kind = "grpo"
    return step


def make_ours_grpo_triton(h, w, y, chunk):
    """ours_grpo on the Triton kernels and cuBLAS alone (impl="triton"; see make_ours_ce_triton)."""
    return make_ours_grpo(h, w, y, chunk, impl="triton")


def make_ours_grpo_every_option(h, w, y, chunk):
    """linear_grpo_loss with old / reference / engine log-probs and every per-token option on:
    delta, dual clip, a k3 KL with bias correction, token-level IS truncation."""
    fn, GRPOConfig = _linear_grpo()
    batch, adv, mask = _grpo_inputs(h, y)
    config = GRPOConfig(loss_type="dapo", delta=3.0, dual_clip_c=3.0, beta=0.05, kl_estimator="k3",
                        use_bias_correction_kl=True, is_correction="token_truncate", is_clip_max=2.0)
    hb, yb = h.view(batch, -1, h.shape[-1]), y.view(batch, -1)
    g = torch.Generator(device=h.device).manual_seed(0)
    old = -torch.rand(yb.shape, device=h.device, generator=g) * 4

    def step():
        loss, _ = fn(hb, w, yb, adv, mask, config, chunk_size=chunk, impl=_impl(), old_logprobs=old,
                     reference_logprobs=old - 0.1, sampling_logprobs=old + 0.05)
        return _grads(loss, h, w)
    step.loss_kind = "grpo"
    return step


def _lean(maker):
    return lambda h, w, y, chunk: maker(h, w, y, chunk, memory_mode="lean")


make_ours_ce_lean = _lean(make_ours_ce)
make_ours_logprobs_lean = _lean(make_ours_logprobs)
make_ours_grpo_lean = _lean(make_ours_grpo)
make_ours_ce_main_grad_lean = _lean(make_ours_ce_main_grad)


def make_ours_ce_main_grad_buffer(h, w, y, chunk):
    """main_grad with the upstream gradient unknown at forward time: dW in an fp32 buffer until the
    backward adds g x dW."""
    return make_ours_ce_main_grad(h, w, y, chunk, expected_upstream_grad=None)


def make_ours_fwd_entropy(h, w, y, chunk):
    return make_ours_fwd(h, w, y, chunk, entropy=True)


# CUDA-graphed rows: the call replayed from graphs captured once per shape (docs/performance.md's
# recipe for the RL passes: torch.cuda.make_graphed_callables for forward + backward, torch.cuda.graph
# for the forward-only pass), inputs copied into the captured ones by each step
def _graphed(loss_of, args):
    if not torch.cuda.is_available():
        raise Skip("CUDA graphs need a GPU")
    # the thread-local capture mode: over NCCL (tp.py's rows) the watchdog's event queries would
    # invalidate a global-mode capture (megatron_fused_ce/cuda_graphs.py)
    with thread_local_capture():
        return torch.cuda.make_graphed_callables(loss_of, args)


def _graphed_step(step, loss_kind="ce"):
    step.graphed, step.loss_kind = True, loss_kind
    return step


def make_ours_ce_graphed(h, w, y, chunk):
    graphed = _graphed(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=chunk, impl=_impl()), (h, w, y))
    return _graphed_step(lambda: _grads(graphed(h, w, y), h, w))


def make_ours_logprobs_graphed(h, w, y, chunk):
    n = h.shape[0]
    graphed = _graphed(lambda h, w, y: -linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl()).logprobs.sum() / n,
                       (h, w, y))
    return _graphed_step(lambda: _grads(graphed(h, w, y), h, w))


def make_ours_grpo_graphed(h, w, y, chunk):
    fn, GRPOConfig = _linear_grpo()
    batch, adv, mask = _grpo_inputs(h, y)
    config = GRPOConfig()

    def loss_of(h, w, y, adv, mask):
        return fn(h.view(batch, -1, h.shape[-1]), w, y.view(batch, -1), adv, mask, config, chunk_size=chunk,
                  impl=_impl())[0]
    graphed = _graphed(loss_of, (h, w, y, adv, mask))
    return _graphed_step(lambda: _grads(graphed(h, w, y, adv, mask), h, w), "grpo")


def make_ours_fwd_graphed(h, w, y, chunk):
    if not torch.cuda.is_available():
        raise Skip("CUDA graphs need a GPU")
    static_h, static_y = h.detach().clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):  # warm-ups: the signature is agreed and remembered before the capture
            linear_logprobs(static_h, w, static_y, chunk_size=chunk, impl=_impl())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_out = linear_logprobs(static_h, w, static_y, chunk_size=chunk, impl=_impl()).logprobs

    def replay():
        static_h.copy_(h)
        static_y.copy_(y)
        graph.replay()
        return static_out.clone()
    step = _forward_only(replay)
    step.graphed = True
    return step


class _FusedStatisticsAtEverySize:
    """While in force, forward-only statistics of any size come from the fused statistics GEMM
    (fast.FUSED_STATS_MIN_BYTES = 0), as they do above that bound: the two kernels' comparison
    behind the bound (docs/design.md §10.3)."""

    def __enter__(self):
        from megatron_fused_ce.ops import fast
        self.fast, self.bound = fast, fast.FUSED_STATS_MIN_BYTES
        fast.FUSED_STATS_MIN_BYTES = 0

    def __exit__(self, *exc):
        self.fast.FUSED_STATS_MIN_BYTES = self.bound


def make_ours_fwd_fused(h, w, y, chunk):
    def call():
        with _FusedStatisticsAtEverySize():
            return linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl()).logprobs
    return _forward_only(call)


def make_ours_fwd_fused_graphed(h, w, y, chunk):
    with _FusedStatisticsAtEverySize():  # (captured with the fused GEMM; a replay reads no setting)
        return make_ours_fwd_graphed(h, w, y, chunk)


SAMPLER_TEMPERATURE = 0.25  # --sampler-temperature
SAMPLERS = {"ours_top_p": dict(top_p=0.9), "ours_top_k": dict(top_k=50), "ours_topk20": dict(return_topk=20),
            "ours_top_p_flat": dict(top_p=0.9)}


def _sampled_logprobs_loss(name, h, w, y, chunk, **kwargs):
    """-sum of the finite log-probs / N under the sampler settings of `name`."""
    temperature = 1.0 if name.endswith("_flat") else SAMPLER_TEMPERATURE
    lp = linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl(), temperature=temperature,
                         **SAMPLERS[name], **kwargs).logprobs
    return -torch.where(torch.isfinite(lp), lp, 0.0).sum() / h.shape[0]


def _sampler_maker(name):
    def make(h, w, y, chunk):
        step = lambda: _grads(_sampled_logprobs_loss(name, h, w, y, chunk), h, w)  # noqa: E731
        step.loss_kind = "sampled"  # not the CE of torch_eager: no error check here
        return step
    return make


for _name in SAMPLERS:
    globals()["make_" + _name] = _sampler_maker(_name)

def _makers(namespace):
    return {name[len("make_"):]: fn for name, fn in namespace.items() if name.startswith("make_")}


MAKERS = {**_makers(vars(measure)), **_makers(vars(peers)), **_makers(globals())}
CHUNKED = {"ours_logprobs", "ours_ce", "ours_ce_per_token", "ours_ce_graphed", "ours_logprobs_graphed", "ours_grpo_graphed",
           "ours_fwd_graphed", "ours_ce_torch", "ours_ce_main_grad", "ours_ce_main_grad_buffer", "ours_grpo",
           "ours_grpo_every_option", "ours_ce_triton", "ours_grpo_triton",
           "ours_fwd", "ours_fwd_fused", "ours_fwd_fused_graphed",
           "ours_fwd_entropy", "ours_ce_fp32_logits", "ours_logprobs_fp32_logits",
           *SAMPLERS}  # lean rows take no chunk size
ALL_CHUNKS = {"ours_logprobs", "ours_ce"}  # run at every --chunks value
MAIN_GRAD = {"ours_ce_main_grad", "ours_ce_main_grad_buffer", "ours_ce_main_grad_lean"}

