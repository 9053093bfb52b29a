#!/usr/bin/env python3
"""Fused linear cross-entropy / log-probs: everything side by side, one process, one GPU, bf16.

    python tools/benchmark.py                       # all shapes and spreads, memory sweep; writes to $OUT or ./bench_out
    python tools/benchmark.py --quick               # tiny shapes (smoke test; runs on CPU too)
    python tools/benchmark.py --shapes 8192x4096x128256 --impls floor,ours_ce,ours_ce_lean --spreads peaked

What is measured, per shape (N tokens, H hidden, V vocab) and logit spread:
  floor              the 3 GEMMs every fwd+bwd method must do (logits, dX, dW: 6*N*H*V flops),
                     cuBLAS, measured in this run. x_floor of a method = its time / this time.
  floor_fwd          the 1 logits GEMM (2*N*H*V): the floor of the forward-only rows (*_fwd).
  torch_eager        materialized logits, .float(), F.cross_entropy (what users write)
  torch_compile      torch.compile of the same function
  torch_compile_fwd  torch.compile of log_softmax(logits).gather(label) under no_grad
  torch_lce          PyTorch >= 2.13 F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())
                     (skipped where that torch is not installed)
  megatron           megatron.core vocab_parallel_cross_entropy on materialized bf16 logits (TP=1)
  liger              liger_kernel LigerFusedLinearCrossEntropyLoss
  cce                Apple cut_cross_entropy.linear_cross_entropy, default gradient filter (skips
                     vocab blocks whose probabilities are all tiny: its speed depends on the spread)
  cce_exact          the same with filter_eps=None (no filtering: exact gradients)
  ours_ce@C          linear_cross_entropy(..., chunk_size=C) (mean), memory_mode="fast"
  ours_ce_lean       the same with memory_mode="lean"
  ours_logprobs@C    linear_logprobs(...), backward through -sum(lp)/N (recompute path); _lean too
  ours_grpo@C        losses.linear_grpo_loss (DAPO, beta=0); _lean too
  ours_ce_main_grad@C  ours_ce with Megatron's accumulate_into_main_grad (weight.main_grad fp32
                     pre-allocated, as Megatron's DDP buffers are: not counted); _lean too
  ours_fwd           linear_logprobs under torch.no_grad (reference / old-policy log-probs);
  ours_fwd_entropy   the same with return_entropy=True
  ours_ce_fp32_logits@C, ours_logprobs_fp32_logits@C  ours_ce / ours_logprobs with
                     logits_dtype=torch.float32 (fp32-output logits GEMM; the cost of the option; not
                     in the default set)
  ours_top_p@C, ours_top_k@C, ours_topk20@C
                     linear_logprobs with top_p=0.9 / top_k=50 / return_topk=20 (sampler
                     fidelity), backward through -sum(finite lp)/N, at --sampler-temperature
                     (default 0.25: logits of std ~8, a peaked next-token distribution like a
                     trained LM's; the random inputs at T=1 are nearly flat over the vocab);
                     "× plain" = time / ours_logprobs at the same chunk, same run. Notes give the
                     rows that took the exact search (nucleus longer than the candidates).
  ours_top_p_flat@C  top_p=0.9 at T=1 (flat rows: every row takes the exact search; worst case)
C = "auto" uses the package's default chunk size. Peers that are not installed, or fail, are
skipped with a note. Every method's loss, dX and dW (forward rows: log-probs) are checked against
a float64 reference computed from the same bf16 inputs (relative norm error; rows in chunks): with
bf16 dX / dW every exact method sits at the bf16 rounding (~1e-3), and one that accumulates in
bf16 shows above it.

Spreads (--spreads): "random" = random bf16 hidden states and weights (logit std 2: a flat softmax,
top token p ~ 1e-2); "peaked" = each hidden row is pushed towards one token so that its
probability is 0.3-0.9 (uniform per row), 60 % of the labels being that token: the spread of a
trained model, where CCE's gradient filter can skip most vocab blocks.

Memory: "extra" = torch.cuda.max_memory_allocated during one call minus what was allocated before it
(inputs, warm caches) minus what it returns (dX and dW in bf16; for main_grad rows dW lives in the
pre-allocated fp32 main_grad; forward rows return [N] fp32 log-probs), the same definition for
every method; compared with the dense bf16 logits N*V*2 bytes.
Timing: CUDA events around each call, warm-up first, median of the repetitions.
Optionally (no --no-kernels) a per-chunk breakdown (GEMMs vs the Triton kernels) and a kernel
check of the Triton backend against the torch backend on the GPU.
Outputs (in --out): results.json (every number), results.md (tables), pareto_<N>x<H>x<V>.png
(extra memory vs x floor, every peer and both our modes, both spreads), sweep.png (memory vs N).

Tensor parallel (one process per GPU, NCCL; tools/gpu_tp.sh runs it with the multi-GPU tests):
    torchrun --nproc_per_node 2 tools/benchmark.py --tp 2 [--shapes ...] [--chunks auto,4096] [--out DIR]
Same global shapes; every rank holds the full hidden [N, H] (no sequence parallel) and a V/TP shard
of the bf16 weight. Per GPU, forward+backward, dist.barrier() before each timed region, median over
repeats, max over ranks. Rows: floor_gemm (the shard's 3 GEMMs), allreduce (dX [N, H] bf16), floor =
their sum; ours_ce@C, ours_logprobs@C (tp_group=WORLD); megatron (vocab_parallel_cross_entropy on
materialized logits.float()) and megatron_fused (fused_vocab_parallel_cross_entropy on bf16 logits),
both + the dX all-reduce after backward; liger_tp (LigerFusedLinearScaledCrossEntropyTPFunction).
Errors vs an fp32 reference with explicit collectives. Scaling vs TP=1: measured on rank 0 alone
before each shape (default; --tp1 none to skip) or read from a single-GPU results.json
(--tp1-json PATH); fraction = t_TP / t_1, efficiency = t_1 / (TP * t_TP). A failure on any rank
skips that item on every rank (agreed after each phase). Rank 0 writes tp{N}_results.json / .md.
Debug on CPU: torchrun --nproc_per_node 2 tools/benchmark.py --tp 2 --device cpu --quick (gloo).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():  # smoke tests on CPU: Triton kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import megatron_fused_ce  # noqa: E402
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402

SHAPES = [(8192, 4096, 128256), (8192, 2304, 256000), (16384, 3584, 152064)]
SWEEP_HV = (4096, 128256)
SWEEP_N = [8192, 16384, 32768, 65536, 131072]
QUICK_SHAPES_GPU = [(2048, 1024, 32000)]
QUICK_SHAPES_CPU = [(48, 32, 500)]
DEFAULT_IMPLS = ("floor,floor_fwd,torch_eager,torch_compile,torch_compile_fwd,torch_lce,megatron,liger,cce,"
                 "cce_exact,ours_ce,ours_ce_lean,ours_logprobs,ours_logprobs_lean,ours_grpo,ours_grpo_lean,"
                 "ours_ce_main_grad,ours_ce_main_grad_lean,ours_fwd,ours_fwd_entropy,"
                 "ours_top_p,ours_top_k,ours_topk20")
SWEEP_IMPLS = "floor,torch_compile,liger,cce,ours_ce,ours_ce_lean,ours_logprobs_lean,ours_fwd"
SPREADS = ("random", "peaked")
GIB = 1024.0 ** 3


class Skip(Exception):
    """A method that cannot run here (not installed, not applicable): reported, never fatal."""


def log(*args):
    print(*args, flush=True)


# ------------------------------------------------------------------------------ the methods
def _grads(loss, h, w):
    dx, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), dx, dw


def _eager_loss(h, w, y):
    logits = (h @ w.t()).float()
    return F.cross_entropy(logits, y)


def make_floor(h, w, y, chunk):
    def step():
        logits = h @ w.t()
        dx = logits @ w
        dw = logits.t() @ h
        return None, dx, dw
    step.is_floor = True
    return step


def _forward_only(fn):
    """A forward-only step: no_grad, returns (log-probs, None, None); x_floor against floor_fwd."""
    def step():
        with torch.no_grad():
            return fn(), None, None
    step.forward_only = True
    return step


def make_floor_fwd(h, w, y, chunk):
    step = _forward_only(lambda: h @ w.t())
    step.is_floor = True
    return step


def make_torch_eager(h, w, y, chunk):
    return lambda: _grads(_eager_loss(h, w, y), h, w)


_COMPILED = {}


def make_torch_compile(h, w, y, chunk):
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_eager_loss)
    fn = _COMPILED["fn"]
    return lambda: _grads(fn(h, w, y), h, w)


def float64_reference(h, w, y, rows=1024):
    """(mean CE, dX, dW, log-probs) of the bf16 inputs in float64, `rows` tokens at a time (dX,
    dW stored in fp32: their own rounding is ~1e-7, far below the bf16 outputs checked)."""
    n = h.shape[0]
    w64 = w.detach().double()
    dw = torch.zeros_like(w64)
    dx = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    lp = torch.empty(n, dtype=torch.float64, device=h.device)
    for start in range(0, n, rows):
        h64, labels = h[start:start + rows].detach().double(), y[start:start + rows]
        logp = torch.log_softmax(h64 @ w64.t(), dim=1)
        lp[start:start + rows] = logp.gather(1, labels[:, None])[:, 0]
        grad = logp.exp_()
        grad[torch.arange(labels.shape[0], device=h.device), labels] -= 1.0
        grad.div_(n)
        dx[start:start + rows] = grad @ w64
        dw.addmm_(grad.t(), h64)
        del logp, grad
    del w64
    return -lp.mean(), dx, dw.float(), lp


def _eager_logprobs(h, w, y):
    return torch.log_softmax((h @ w.t()).float(), -1).gather(1, y[:, None]).squeeze(1)


def make_torch_compile_fwd(h, w, y, chunk):
    if "fwd" not in _COMPILED:
        _COMPILED["fwd"] = torch.compile(_eager_logprobs)
    fn = _COMPILED["fwd"]
    return _forward_only(lambda: fn(h, w, y))


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


def make_liger(h, w, y, chunk):
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"liger-kernel not importable: {type(exc).__name__}: {exc}")
    if h.device.type != "cuda":
        raise Skip("liger needs CUDA")
    loss_fn = LigerFusedLinearCrossEntropyLoss()
    return lambda: _grads(loss_fn(w, h, y), h, w)


def _cce():
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"cut-cross-entropy not importable: {type(exc).__name__}: {exc}")
    if not torch.cuda.is_available():
        raise Skip("cce needs CUDA")
    return cce


def make_cce(h, w, y, chunk):
    cce = _cce()
    return lambda: _grads(cce(h, w, y), h, w)  # default gradient filter


def make_cce_exact(h, w, y, chunk):
    cce = _cce()
    return lambda: _grads(cce(h, w, y, filter_eps=None), h, w)


def _impl():
    return "triton"


def make_ours_logprobs(h, w, y, chunk, memory_mode="fast"):
    n = h.shape[0]
    return lambda: _grads(-linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl(),
                                           memory_mode=memory_mode).logprobs.sum() / n, h, w)


def make_ours_ce(h, w, y, chunk, memory_mode="fast"):
    return lambda: _grads(linear_cross_entropy(h, w, y, chunk_size=chunk, impl=_impl(), memory_mode=memory_mode), h, w)


def make_ours_ce_torch(h, w, y, chunk):
    return lambda: _grads(linear_cross_entropy(h, w, y, chunk_size=chunk, impl="torch"), h, w)


def make_ours_ce_main_grad(h, w, y, chunk, memory_mode="fast"):
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    w.grad_added_to_main_grad = False  # as Megatron's DDP sets it: autograd gets the dummy gradient

    def step():
        loss = linear_cross_entropy(h, w, y, chunk_size=chunk, impl=_impl(), accumulate_into_main_grad=True,
                                    memory_mode=memory_mode)
        dx, _ = torch.autograd.grad(loss, (h, w), allow_unused=True)
        return loss.detach(), dx, w.main_grad
    step.main_grad = True
    return step


def make_ours_fwd(h, w, y, chunk, entropy=False):
    return _forward_only(lambda: linear_logprobs(h, w, y, chunk_size=chunk, impl=_impl(),
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


def make_ours_grpo(h, w, y, chunk, memory_mode="fast"):
    fn, GRPOConfig = _linear_grpo()
    batch, adv, mask = _grpo_inputs(h, y)
    config = GRPOConfig()
    hb, yb = h.view(batch, -1, h.shape[-1]), y.view(batch, -1)

    def step():
        loss, _ = fn(hb, w, yb, adv, mask, config, chunk_size=chunk, impl=_impl(), memory_mode=memory_mode)
        return _grads(loss, h, w)
    step.loss_kind = "grpo"
    return step


def _lean(maker):
    return lambda h, w, y, chunk: maker(h, w, y, chunk, memory_mode="lean")


make_ours_ce_lean = _lean(make_ours_ce)
make_ours_logprobs_lean = _lean(make_ours_logprobs)
make_ours_grpo_lean = _lean(make_ours_grpo)
make_ours_ce_main_grad_lean = _lean(make_ours_ce_main_grad)


def make_ours_fwd_entropy(h, w, y, chunk):
    return make_ours_fwd(h, w, y, chunk, entropy=True)


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

MAKERS = {name[len("make_"):]: fn for name, fn in globals().items() if name.startswith("make_")}
CHUNKED = {"ours_logprobs", "ours_ce", "ours_ce_torch", "ours_ce_main_grad", "ours_grpo", "ours_fwd",
           "ours_fwd_entropy", "ours_ce_fp32_logits", "ours_logprobs_fp32_logits",
           *SAMPLERS}  # lean rows take no chunk size
ALL_CHUNKS = {"ours_logprobs", "ours_ce"}  # run at every --chunks value
MAIN_GRAD = {"ours_ce_main_grad", "ours_ce_main_grad_lean"}


# ------------------------------------------------------------------------------ measuring
def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_step(step, warmup, min_reps, max_reps, budget_ms):
    for _ in range(warmup):
        out = step()
        del out
    sync()
    times = []
    while True:
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - t0) * 1e3)
        del out
        if len(times) >= max_reps or (len(times) >= min_reps and sum(times) >= budget_ms):
            break
    return statistics.median(times), times


def _nbytes(t):
    return 0 if t is None else t.numel() * t.element_size()


def measure_memory(step):
    """Extra bytes one call needs beyond what exists before it and what it returns (dX, dW; for
    main_grad rows dW is in the pre-allocated main_grad; forward rows return log-probs)."""
    if not torch.cuda.is_available():
        return None, step()
    free()
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    sync()
    peak = torch.cuda.max_memory_allocated()
    first, dx, dw = out
    if getattr(step, "forward_only", False):
        out_bytes = _nbytes(first)
    else:
        out_bytes = _nbytes(dx) + (0 if getattr(step, "main_grad", False) else _nbytes(dw))
    return peak - base - out_bytes, out


def rel_err(a, b):
    if a is None or b is None:
        return None
    a, b = a.detach().float(), b.detach().float()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def make_inputs(n, hdim, v, device, seed=0, spread="random"):
    """bf16 hidden [N, H], weight [V, H] (logit std 2) and labels. spread="peaked": each row is
    pushed towards one token t so that p(t) is uniform in [0.3, 0.9] (the flat background of V
    logits of std 2 sums to about V e^2), and 60 % of the labels are t."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, hdim, device=device, generator=g, dtype=torch.float32)
    w = (torch.randn(v, hdim, device=device, generator=g, dtype=torch.float32) / math.sqrt(hdim) * 2)
    w = w.to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device=device, generator=g)
    if spread == "peaked":
        top = torch.randint(0, v, (n,), device=device, generator=g)
        p_top = 0.3 + 0.6 * torch.rand(n, device=device, generator=g)
        z_top = math.log(v) + 2.0 + torch.log(p_top / (1 - p_top))
        wt = w[top].float()
        h = h + ((z_top - (h * wt).sum(1)) / wt.square().sum(1))[:, None] * wt
        y = torch.where(torch.rand(n, device=device, generator=g) < 0.6, top, y)
    elif spread != "random":
        raise SystemExit(f"unknown spread {spread!r}")
    return h.to(torch.bfloat16).requires_grad_(), w.requires_grad_(), y


def top_probability(h, w, rows=1024):
    """Mean probability of each row's most likely token (describes the spread; no_grad, chunked)."""
    with torch.no_grad():
        tops = []
        for start in range(0, h.shape[0], rows):
            z = (h[start:start + rows] @ w.t()).float()
            tops.append(torch.exp(z.max(1).values - torch.logsumexp(z, 1)))
        return torch.cat(tops).mean().item()


def resolved_auto_chunk(n, v_local, device, hdim, method):
    """The package's auto chunk size for this call (its signature has changed over time); None if
    unknown. With main_grad the weight gradient needs no fp32 buffer of its own."""
    try:
        from megatron_fused_ce.ops import api
        fn = getattr(api, "auto_chunk_size", None)
        if fn is None:
            return None
        try:
            kwargs = dict(logits_element_size=4) if method.endswith("fp32_logits") else {}
            return fn(n, v_local, device, hidden_size=hdim, element_size=2,
                      fp32_weight_grad_buffer=method not in MAIN_GRAD and not method.startswith("ours_fwd"),
                      **kwargs)
        except TypeError:
            return fn(n, v_local, device)
    except Exception:  # noqa: BLE001
        return None


def _search_note(first_call):
    """Run the first call with the sampler's search counters reset -> (its output, note)."""
    from megatron_fused_ce.ops import sampling

    sampling.SEARCH_COUNTS.clear()
    out = first_call()
    c = dict(sampling.SEARCH_COUNTS)
    if not c.get("rows"):
        return out, "no filter: candidates only"
    rows = c["rows"]
    searched = c.get("top_p_search_rows", 0) + c.get("top_k_search_rows", 0)
    return out, f"exact search {searched}/{rows} rows ({100.0 * searched / rows:.1f}%)"


def add_x_plain(rows):
    """Sampler rows: time / ours_logprobs at the same chunk (and TP), same run."""
    plain = {r["chunk"]: r for r in rows if r["method"] in ("ours_logprobs",) and "ms" in r}
    for r in rows:
        if r["method"] in SAMPLERS and "ms" in r and r["chunk"] in plain:
            r["x_plain"] = r["ms"] / plain[r["chunk"]]["ms"]
            r["note"] = (r.get("note", "") + "; " if r.get("note") else "") + f"× plain {r['x_plain']:.3f}"


def run_one(name, chunk, h, w, y, args, reference=None):
    n, hdim = h.shape
    v = w.shape[0]
    label = f"{name}@{chunk or 'auto'}" if name in CHUNKED else name
    row = dict(impl=label, method=name, chunk=(chunk or "auto") if name in CHUNKED else None,
               N=n, H=hdim, V=v, flops=6.0 * n * hdim * v, dense_logits_bytes=2 * n * v)
    if name in CHUNKED and chunk is None:
        row["chunk_resolved"] = resolved_auto_chunk(n, v, h.device, hdim, name)
    out = None
    try:
        step = MAKERS[name](h, w, y, chunk)
        row["forward_only"] = getattr(step, "forward_only", False)
        if row["forward_only"]:
            row["flops"] = 2.0 * n * hdim * v
        t0 = time.perf_counter()
        if name in SAMPLERS:
            out, row["note"] = _search_note(step)
        else:
            out = step()  # first call: compiles (torch.compile, Triton JIT)
        sync()
        row["first_call_s"] = time.perf_counter() - t0
        if reference is not None and not getattr(step, "is_floor", False):
            first, dx, dw = out
            if row["forward_only"]:
                row["err_logprobs"] = rel_err(first, reference[3])
            elif getattr(step, "loss_kind", "ce") == "ce":
                row["err_loss"] = rel_err(first, reference[0])
                row["err_dx"], row["err_dw"] = rel_err(dx, reference[1]), rel_err(dw, reference[2])
        del out
        out = None
        if name in MAIN_GRAD:
            w.main_grad.zero_()
        extra, out = measure_memory(step)
        del out
        out = None
        row["extra_bytes"] = extra
        if extra is not None:
            row["extra_gib"] = extra / GIB
            row["extra_pct_dense_logits"] = 100.0 * extra / row["dense_logits_bytes"]
            row["extra_pct_dense_logits_8192"] = 100.0 * extra / (2 * 8192 * v)
        ms, times = time_step(step, args.warmup, args.min_reps, args.max_reps, args.budget_ms)
        row.update(ms=ms, times_ms=times, tflops=row["flops"] / ms / 1e9)
    except Skip as exc:
        row["skipped"] = str(exc)
    except torch.cuda.OutOfMemoryError as exc:
        row["skipped"] = "OOM: " + str(exc).split("\n")[0][:200]
    except Exception as exc:  # noqa: BLE001  (a broken peer must not stop the run)
        row["skipped"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        row["traceback"] = traceback.format_exc()[-2000:]
    finally:
        out = None
        if hasattr(w, "main_grad"):
            del w.main_grad
        if hasattr(w, "grad_added_to_main_grad"):
            del w.grad_added_to_main_grad
        free()
    err = row.get("err_logprobs") if row.get("forward_only") else row.get("err_dx")
    status = row.get("skipped") or (f"{row['ms']:.2f} ms  {row['tflops']:.0f} TFLOP/s  "
                                    f"extra {row.get('extra_gib', float('nan')):.3f} GiB  "
                                    f"err {'lp' if row.get('forward_only') else 'dx'} {err} dw {row.get('err_dw')}")
    log(f"  {label:28s} {status}")
    return row


def impl_list(spec, chunks):
    out = []
    for name in spec.split(","):
        name = name.strip()
        if not name:
            continue
        if name not in MAKERS:
            raise SystemExit(f"unknown impl {name!r}; known: {', '.join(MAKERS)}")
        if name in CHUNKED:
            cs = chunks if name in ALL_CHUNKS else chunks[:1]  # the first --chunks value
            out.extend((name, c) for c in cs)
        else:
            out.append((name, None))
    return out


def bench_shape(shape, impls, args, device, results, section, check=True, spread="random"):
    n, hdim, v = shape
    log(f"\n== {section} ({spread} logits): N={n} H={hdim} V={v}  "
        f"(floor flops 6NHV = {6.0 * n * hdim * v / 1e12:.1f} TFLOP)")
    free()
    h, w, y = make_inputs(n, hdim, v, device, spread=spread)
    p_top = top_probability(h, w)
    log(f"  mean probability of the top token: {p_top:.3f}")
    reference = None
    rows = []
    if check and any(not name.startswith("floor") for name, _ in impls):
        try:
            reference = float64_reference(h, w, y)
        except torch.cuda.OutOfMemoryError:
            log("  (no float64 reference: OOM; errors not checked)")
        free()
    floors = {}
    seen = set()
    for name, chunk in impls:
        effective = (name, None if chunk is None else min(chunk, n))
        if effective in seen:  # chunk >= N: the same run as chunk = N
            continue
        seen.add(effective)
        row = run_one(name, chunk, h, w, y, args, reference)
        row.update(section=section, spread=spread, p_top=p_top)
        if name in ("floor", "floor_fwd") and "ms" in row:
            floors[name] = row["ms"]
        rows.append(row)
        results["rows"].append(row)
        write_json(results, args.out)
    for row in rows:
        floor = floors.get("floor_fwd" if row.get("forward_only") else "floor")
        if floor and "ms" in row:
            row["x_floor"] = row["ms"] / floor
            row["floor_ms"] = floor
    add_x_plain(rows)
    write_json(results, args.out)
    del h, w, y, reference
    free()
    return rows


# ------------------------------------------------------------------------------ kernel check + breakdown
def kernel_check_and_breakdown(args, device, results, shape, chunk):
    """Triton backend vs torch backend on production block sizes, and one chunk's cost split."""
    from megatron_fused_ce.ops import torch_backend, triton_backend as tb
    n_tok, hdim, v = shape
    out = dict(shape=list(shape), chunk=chunk, checks={}, times_ms={})
    log(f"\n== kernel check + per-chunk breakdown: chunk [{chunk}, {v}] bf16, H={hdim}")
    g = torch.Generator(device=device).manual_seed(5)
    h = torch.randn(chunk, hdim, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, hdim, device=device, generator=g) / math.sqrt(hdim) * 2).to(torch.bfloat16)
    nvc = v - 17  # some padding columns
    tgt = torch.randint(-1, nvc, (chunk,), device=device, generator=g)
    logits = h @ w.t()
    for rows in sorted({chunk, min(256, chunk), 7}, reverse=True):  # few rows: the column-split path
        lg = logits[:rows]
        for temp in (1.0, 0.7):
            a = tb.shard_stats(lg, tgt[:rows], nvc, 1 / temp, True, True)
            b = torch_backend.shard_stats(lg, tgt[:rows], nvc, 1 / temp, True, True)
            for f in ("max", "sum_exp", "target", "sum_logits", "sum_exp_shifted"):
                out["checks"][f"stats.{f} rows={rows} T={temp}"] = rel_err(getattr(a, f), getattr(b, f))
            lse = b.max + torch.log(b.sum_exp)
            cp, cpz, ct, cu = (torch.randn(rows, device=device, generator=g) for _ in range(4))
            ga = tb.shard_dlogits_(lg.clone(), tgt[:rows], nvc, 1 / temp, lse, cp, cpz, ct, cu)
            gb = torch_backend.shard_dlogits_(lg.clone(), tgt[:rows], nvc, 1 / temp, lse, cp, cpz, ct, cu)
            out["checks"][f"dlogits rows={rows} T={temp}"] = rel_err(ga, gb)
            out["checks"][f"dlogits padding zero rows={rows}"] = bool((ga[:, nvc:] == 0).all().item())
            ulp = ((ga.float() - gb.float()).abs() > 0).float().mean().item()
            out["checks"][f"dlogits frac elements differing rows={rows} T={temp}"] = ulp
    bad = [k for k, e in out["checks"].items() if isinstance(e, float) and "frac" not in k and not e < 1e-4]
    bad += [k for k, e in out["checks"].items() if e is False]
    out["ok"] = not bad
    log("  kernel check: " + ("OK" if not bad else f"FAILED: {bad}"))
    for k, e in out["checks"].items():
        log(f"    {k:48s} {e}")

    lse = torch.logsumexp(logits.float(), 1)
    ones = torch.ones(chunk, device=device)
    dw_acc = torch.zeros(v, hdim, dtype=torch.float32, device=device)
    dx = torch.empty_like(h)
    buf = logits.clone()

    def t(fn):
        return time_step(fn, 2, 5, 20, 150)[0]

    elems = chunk * v
    ops = {
        "logits GEMM (bf16 out)": lambda: torch.mm(h, w.t(), out=buf),
        "logits GEMM (fp32 out, out_dtype)": lambda: torch.mm(h, w.t(), out_dtype=torch.float32),
        "triton shard_stats": lambda: tb.shard_stats(logits, tgt, v, 1.0),
        "triton shard_stats +entropy+sum": lambda: tb.shard_stats(logits, tgt, v, 1.0, True, True),
        "torch shard_stats": lambda: torch_backend.shard_stats(logits, tgt, v, 1.0),
        "triton shard_dlogits_": lambda: tb.shard_dlogits_(buf, tgt, v, 1.0, lse, ones, None, -ones, None),
        "torch shard_dlogits_": lambda: torch_backend.shard_dlogits_(buf, tgt, v, 1.0, lse, ones, None, -ones, None),
        "dX GEMM": lambda: torch.mm(logits, w, out=dx),
        "dW GEMM bf16 out": lambda: torch.mm(logits.t(), h),
        "dW addmm into fp32 acc (out_dtype)": lambda: torch.addmm(dw_acc, logits.t(), h,
                                                                   out_dtype=torch.float32, out=dw_acc),
        "dW mm fp32 out + add_": lambda: dw_acc.add_(torch.mm(logits.t(), h, out_dtype=torch.float32)),
    }
    for name, fn in ops.items():
        try:
            ms = t(fn)
            out["times_ms"][name] = ms
            extra = ""
            if "stats" in name and "triton" in name:
                extra = f"  {2 * elems / ms / 1e6:.0f} GB/s (2 B/elt read)"
            if "dlogits" in name and "triton" in name:
                extra = f"  {4 * elems / ms / 1e6:.0f} GB/s (2 B/elt read + 2 written)"
            if "GEMM" in name or "addmm" in name:
                extra = f"  {2.0 * chunk * hdim * v / ms / 1e9:.0f} TFLOP/s"
            log(f"    {name:40s} {ms:8.3f} ms{extra}")
        except Exception as exc:  # noqa: BLE001
            out["times_ms"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            log(f"    {name:40s} failed: {exc}")
        free()
    # launch-setting variants of the two kernels (module attributes; restored afterwards)
    saved = {k: getattr(tb, k) for k in ("STATS_BLOCK_N", "STATS_WARPS", "DLOGITS_BLOCK_N", "DLOGITS_WARPS")}
    variants = [(1024, 4), (2048, 8), (4096, 8), (4096, 16)] if not args.quick else [(64, 4)]
    for block, warps in variants:
        tb.STATS_BLOCK_N, tb.STATS_WARPS, tb.DLOGITS_BLOCK_N, tb.DLOGITS_WARPS = block, warps, block, warps
        try:
            ms_s = t(lambda: tb.shard_stats(logits, tgt, v, 1.0))
            ms_d = t(lambda: tb.shard_dlogits_(buf, tgt, v, 1.0, lse, ones, None, -ones, None))
            out["times_ms"][f"variant block={block} warps={warps}: stats"] = ms_s
            out["times_ms"][f"variant block={block} warps={warps}: dlogits"] = ms_d
            log(f"    variant block={block:5d} warps={warps:2d}: stats {ms_s:.3f} ms "
                f"({2 * elems / ms_s / 1e6:.0f} GB/s), dlogits {ms_d:.3f} ms ({4 * elems / ms_d / 1e6:.0f} GB/s)")
        except Exception as exc:  # noqa: BLE001
            log(f"    variant block={block} warps={warps} failed: {exc}")
    for k, val in saved.items():
        setattr(tb, k, val)
    # few rows (TP / small microbatch): the column-split path
    for rows in (min(256, chunk),):
        ms = t(lambda: tb.shard_stats(logits[:rows], tgt[:rows], v, 1.0))
        out["times_ms"][f"triton shard_stats rows={rows}"] = ms
        log(f"    {'triton shard_stats rows=' + str(rows):40s} {ms:8.3f} ms  {2 * rows * v / ms / 1e6:.0f} GB/s")
    results["kernels"] = out
    write_json(results, args.out)
    del h, w, logits, buf, dw_acc, dx
    free()
    return out["ok"]


# ------------------------------------------------------------------------------ reports
def sampler_kernel_check(args, device, results, shape, chunk):
    """The sampler-fidelity Triton kernels vs their torch reference on one production chunk
    (candidates must be identical), and their cost next to the plain stats kernel."""
    from megatron_fused_ce.ops import sampling_torch as st, sampling_triton as sx, triton_backend as tb
    _, hdim, v = shape
    out = dict(shape=list(shape), chunk=chunk, checks={}, times_ms={})
    log(f"\n== sampler kernels: chunk [{chunk}, {v}] bf16, H={hdim}, T={SAMPLER_TEMPERATURE}")
    g = torch.Generator(device=device).manual_seed(6)
    h = torch.randn(chunk, hdim, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, hdim, device=device, generator=g) / math.sqrt(hdim) * 2).to(torch.bfloat16)
    logits, nvc, inv_t, start = h @ w.t(), v - 17, 1.0 / SAMPLER_TEMPERATURE, 1000
    tgt = torch.randint(-1, nvc, (chunk,), device=device, generator=g)
    for m in (20, 50, 128):
        a, b = sx.shard_candidates(logits, nvc, inv_t, start, m), st.shard_candidates(logits, nvc, inv_t, start, m)
        out["checks"][f"candidates M={m} identical"] = bool(torch.equal(a, b))
    cz, cid, _ = st.decode_keys(st.shard_candidates(logits, nvc, inv_t, start, 128))
    row_max, z_cut, id_cut = cz[:, 0], cz[:, 9], cid[:, 9]  # keep the first 10 tokens
    a = sx.kept_sums(logits, tgt, nvc, inv_t, start, row_max, z_cut, id_cut, want_entropy=True, want_total=True)
    b = st.kept_sums(logits, tgt, nvc, inv_t, start, row_max, z_cut, id_cut, want_entropy=True, want_total=True)
    for f in ("sum_exp", "sum_exp_shifted", "total", "target"):
        out["checks"][f"kept_sums.{f}"] = rel_err(getattr(a, f), getattr(b, f))
    log_s = torch.log(b.sum_exp)
    cp, cpz, ct = (torch.randn(chunk, device=device, generator=g) for _ in range(3))
    args_d = (tgt, nvc, inv_t, start, row_max, log_s, z_cut, id_cut, cp, cpz, ct)
    out["checks"]["kept_dlogits"] = rel_err(sx.kept_dlogits_(logits.clone(), *args_d),
                                            st.kept_dlogits_(logits.clone(), *args_d))
    bad = [k for k, e in out["checks"].items() if e is False or (isinstance(e, float) and not e < 1e-4)]
    out["ok"] = not bad
    log("  sampler kernel check: " + ("OK" if not bad else f"FAILED: {bad}"))
    buf = logits.clone()
    ones = torch.ones(chunk, device=device)
    ops = {
        "plain: triton shard_stats": lambda: tb.shard_stats(logits, tgt, nvc, inv_t),
        "plain: triton shard_dlogits_": lambda: tb.shard_dlogits_(buf, tgt, nvc, inv_t, row_max, ones, None, -ones,
                                                                  None, log_sum_exp=log_s),
        "candidates M=20 (return_topk=20)": lambda: sx.shard_candidates(logits, nvc, inv_t, start, 20),
        "candidates M=50 (top_k=50)": lambda: sx.shard_candidates(logits, nvc, inv_t, start, 50),
        "candidates M=128 (top_p)": lambda: sx.shard_candidates(logits, nvc, inv_t, start, 128),
        "torch.topk k=128 of the chunk (for scale)": lambda: logits.topk(128, dim=1),
        "kept_sums (+target, +total)": lambda: sx.kept_sums(logits, tgt, nvc, inv_t, start, row_max, z_cut,
                                                            id_cut, want_total=True),
        "kept_dlogits_": lambda: sx.kept_dlogits_(buf, tgt, nvc, inv_t, start, row_max, log_s, z_cut, id_cut, ones,
                                                  None, -ones),
    }
    for name, fn in ops.items():
        try:
            ms = time_step(fn, 2, 5, 20, 150)[0]
            out["times_ms"][name] = ms
            log(f"    {name:44s} {ms:8.3f} ms  {2 * chunk * v / ms / 1e6:.0f} GB/s (2 B/elt read)")
        except Exception as exc:  # noqa: BLE001
            out["times_ms"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            log(f"    {name:44s} failed: {exc}")
        free()
    results["sampler_kernels"] = out
    write_json(results, args.out)
    del h, w, logits, buf
    free()
    return out["ok"]


def write_json(results, out_dir, name="results.json"):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1, default=str)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(results):
    lines = [f"Device: {results['env'].get('device')}; torch {results['env']['torch']}, "
             f"triton {results['env'].get('triton')}; peers: megatron-core {results['env'].get('megatron-core')}, "
             f"liger-kernel {results['env'].get('liger-kernel')}, cut-cross-entropy "
             f"{results['env'].get('cut-cross-entropy')}; command: `{results['command']}`", ""]
    main = [r for r in results["rows"] if r["section"] == "shapes"]
    shapes = list(dict.fromkeys((r["N"], r["H"], r["V"]) for r in main))
    for spread in dict.fromkeys(r.get("spread", "random") for r in main):
        rows = [r for r in main if r.get("spread", "random") == spread]
        ptop = {(r["N"], r["H"], r["V"]): r.get("p_top") for r in rows}
        lines += [f"### Summary, {spread} logits: x floor (extra memory, % of the dense bf16 logits)", "",
                  "Fwd+bwd rows against the 3-GEMM floor, forward-only rows (`*_fwd`) against the 1-GEMM "
                  "floor, both measured in this run. Mean top-token probability: "
                  + ", ".join(f"{s[0]}x{s[1]}x{s[2]}: {ptop.get(s, float('nan')):.3f}" for s in shapes), "",
                  "| method | " + " | ".join(f"{s[0]}x{s[1]}x{s[2]}" for s in shapes) + " |",
                  "|---|" + "---|" * len(shapes)]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            cells = []
            for shape in shapes:
                r = next((r for r in rows if r["impl"] == impl and (r["N"], r["H"], r["V"]) == shape), None)
                if r is None:
                    cells.append("")
                elif "ms" not in r:
                    cells.append("skipped")
                elif r["method"] in ("floor", "floor_fwd"):
                    cells.append(f"{r['ms']:.2f} ms")
                else:
                    mem = r.get("extra_pct_dense_logits")
                    cells.append(f"{_fmt(r.get('x_floor'), '.3f')} ({_fmt(mem, '.1f')} %)")
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(targets_markdown(results))
    for section in dict.fromkeys(r["section"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["section"] == section]
        for key in dict.fromkeys((r.get("spread", "random"), r["N"], r["H"], r["V"]) for r in rows):
            sr = [r for r in rows if (r.get("spread", "random"), r["N"], r["H"], r["V"]) == key]
            floor = next((r for r in sr if r["method"] == "floor" and "ms" in r), None)
            lines.append(f"### {section}, {key[0]} logits: N={key[1]}, H={key[2]}, V={key[3]}"
                         + (f" — floor {floor['ms']:.2f} ms" if floor else ""))
            lines.append("")
            lines.append("| method | ms | TFLOP/s | × floor | extra GiB | extra % dense logits | "
                         "% of N=8192 logits | err loss/log-probs | err dX | err dW | note |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
            for r in sr:
                if "ms" not in r:
                    lines.append(f"| {r['impl']} | - | - | - | - | - | - | - | - | - | {r.get('skipped', '')[:120]} |")
                    continue
                note = f"auto = {r['chunk_resolved']} rows" if r.get("chunk_resolved") else ""
                if r.get("forward_only"):
                    note = (note + "; " if note else "") + "forward only: x 1-GEMM floor"
                err_first = r.get("err_logprobs") if r.get("forward_only") else r.get("err_loss")
                if r.get("note"):
                    note = (note + "; " if note else "") + r["note"]
                lines.append(
                    f"| {r['impl']} | {r['ms']:.2f} | {r['tflops']:.0f} | {_fmt(r.get('x_floor'), '.3f')} | "
                    f"{_fmt(r.get('extra_gib'), '.3f')} | {_fmt(r.get('extra_pct_dense_logits'), '.1f')} | "
                    f"{_fmt(r.get('extra_pct_dense_logits_8192'), '.2f')} | {_fmt(err_first, '.1e')} | "
                    f"{_fmt(r.get('err_dx'), '.1e')} | {_fmt(r.get('err_dw'), '.1e')} | {note} |")
            lines.append("")
    if "kernels" in results:
        k = results["kernels"]
        lines.append(f"### Per-chunk breakdown: [{k['chunk']}, {k['shape'][2]}] bf16 chunk, H={k['shape'][1]}")
        lines.append("")
        lines.append("| op | ms |")
        lines.append("|---|---|")
        for name, ms in k["times_ms"].items():
            lines.append(f"| {name} | {ms if isinstance(ms, str) else format(ms, '.3f')} |")
        lines.append("")
        lines.append(f"Kernel check (triton vs torch backend, rel. err.): {'OK' if k['ok'] else 'FAILED'}; "
                     f"worst {max((v for v in k['checks'].values() if isinstance(v, float)), default=0):.2e}")
    if "sampler_kernels" in results:
        k = results["sampler_kernels"]
        lines += ["", f"### Sampler kernels: [{k['chunk']}, {k['shape'][2]}] bf16 chunk, "
                  f"T={SAMPLER_TEMPERATURE}; check vs torch: {'OK' if k['ok'] else 'FAILED'}", "",
                  "| op | ms |", "|---|---|"]
        lines += [f"| {name} | {ms if isinstance(ms, str) else format(ms, '.3f')} |" for name, ms in k["times_ms"].items()]
    return "\n".join(lines) + "\n"


def _targets(rows_by_impl, sweep_rows):
    """(target, {shape: (value text, ok)}) of issue 15's single-GPU targets for one spread."""

    def x(impl, shape):
        r = rows_by_impl.get((impl, shape))
        return None if r is None or "x_floor" not in r else r

    def check(impl, test, text, needs=(), peers=()):
        def per_shape(shape):  # None: not measured (no row, no memory figure on the CPU, a peer absent)
            r = x(impl, shape)
            if r is None or any(r.get(key) is None for key in needs) or any(x(p, shape) is None for p in peers):
                return None
            return text(r, shape), bool(test(r, shape))
        return per_shape

    def faster(a, b):  # a's x_floor below b's (same shape, spread)
        return lambda r, s: x(b, s) is None or r["x_floor"] < x(b, s)["x_floor"]

    mem = lambda r: r.get("extra_pct_dense_logits_8192", float("nan"))
    out = [
        ("fast SFT CE (`ours_ce`) ≤ 1.05× floor", check("ours_ce@auto", lambda r, s: r["x_floor"] <= 1.05,
                                                         lambda r, s: f"{r['x_floor']:.3f}")),
        ("fast SFT CE faster than torch.compile", check(
            "ours_ce@auto", faster("ours_ce@auto", "torch_compile"),
            lambda r, s: f"{r['x_floor']:.3f} vs {_fmt((x('torch_compile', s) or {}).get('x_floor'), '.3f')}",
            peers=("torch_compile",))),
        ("fast GRPO (`ours_grpo`) ≤ 1.08×", check("ours_grpo@auto", lambda r, s: r["x_floor"] <= 1.08,
                                                   lambda r, s: f"{r['x_floor']:.3f}")),
        ("log-probs fwd+bwd (`ours_logprobs`) ≤ 1.38×", check(
            "ours_logprobs@auto", lambda r, s: r["x_floor"] <= 1.38, lambda r, s: f"{r['x_floor']:.3f}")),
        ("lean CE extra ≤ 3 % of the N=8192 dense logits", check(
            "ours_ce_lean", lambda r, s: mem(r) <= 3.0, lambda r, s: f"{mem(r):.2f} %",
            needs=("extra_pct_dense_logits_8192",))),
        ("lean CE ≤ 1.40×", check("ours_ce_lean", lambda r, s: r["x_floor"] <= 1.40,
                                  lambda r, s: f"{r['x_floor']:.3f}")),
        ("lean CE faster than Liger and exact CCE", check(
            "ours_ce_lean", lambda r, s: faster("ours_ce_lean", "liger")(r, s) and faster("ours_ce_lean", "cce_exact")(r, s),
            lambda r, s: f"{r['x_floor']:.3f} vs {_fmt((x('liger', s) or {}).get('x_floor'), '.3f')} / "
                         f"{_fmt((x('cce_exact', s) or {}).get('x_floor'), '.3f')}",
            peers=("liger", "cce_exact"))),
        ("lean CE dW error ≤ 2× fast mode's", check(
            "ours_ce_lean", lambda r, s: x("ours_ce@auto", s) is None or r.get("err_dw", 1) <= 2 * x("ours_ce@auto", s).get("err_dw", 0),
            lambda r, s: f"{_fmt(r.get('err_dw'), '.1e')} vs {_fmt((x('ours_ce@auto', s) or {}).get('err_dw'), '.1e')}")),
        ("RL forward (`ours_fwd`) ≤ 1.05× 1-GEMM floor", check(
            "ours_fwd@auto", lambda r, s: r["x_floor"] <= 1.05, lambda r, s: f"{r['x_floor']:.3f}")),
        ("RL forward extra ≤ 15 % of the dense logits", check(
            "ours_fwd@auto", lambda r, s: r.get("extra_pct_dense_logits", 1e9) <= 15.0,
            lambda r, s: f"{r.get('extra_pct_dense_logits', float('nan')):.1f} %", needs=("extra_pct_dense_logits",))),
        ("main_grad extra ≤ one chunk of logits", check(
            "ours_ce_main_grad@auto",
            lambda r, s: r.get("extra_bytes", 1e30) <= 2 * r.get("chunk_resolved", s[0]) * s[2] * 1.01,
            lambda r, s: f"{r.get('extra_gib', float('nan')):.3f} GiB vs {2 * r.get('chunk_resolved', s[0]) * s[2] / GIB:.3f}",
            needs=("extra_bytes",))),
        ("main_grad time ≤ plain path's", check(
            "ours_ce_main_grad@auto", lambda r, s: x("ours_ce@auto", s) is None or r["ms"] <= x("ours_ce@auto", s)["ms"],
            lambda r, s: f"{r['ms']:.1f} vs {_fmt((x('ours_ce@auto', s) or {}).get('ms'), '.1f')} ms")),
    ]
    if sweep_rows:
        lean = sorted((r["N"], r) for r in sweep_rows if r["method"] == "ours_ce_lean" and "ms" in r
                      and r.get("extra_pct_dense_logits_8192") is not None)
        if lean:
            worst = max(mem(r) for _, r in lean)
            text = ", ".join(f"N={n}: {mem(r):.2f} %" for n, r in lean)
            out.append(("lean CE flat in N (sweep; % of the N=8192 logits)", lambda s, t=text, w=worst: (t, w <= 3.0)))
    return out


def targets_markdown(results):
    """Each single-GPU target of issue 15 met / missed, per spread, with the measured numbers."""
    main = [r for r in results["rows"] if r["section"] == "shapes"]
    sweep = [r for r in results["rows"] if r["section"] != "shapes"]
    shapes = list(dict.fromkeys((r["N"], r["H"], r["V"]) for r in main))
    lines = []
    for spread in dict.fromkeys(r.get("spread", "random") for r in main):
        by_impl = {(r["impl"], (r["N"], r["H"], r["V"])): r for r in main if r.get("spread", "random") == spread}
        lines += [f"### Targets, {spread} logits (met / missed, measured in this run)", "",
                  "| target | " + " | ".join(f"{s[0]}x{s[1]}x{s[2]}" for s in shapes) + " | verdict |",
                  "|---|" + "---|" * (len(shapes) + 1)]
        for name, per_shape in _targets(by_impl, sweep):
            if name.startswith("lean CE flat"):
                text, ok = per_shape(None)
                lines.append(f"| {name} | {text} |" + " |" * (len(shapes) - 1) + f" **{'met' if ok else 'missed'}** |")
                continue
            cells = [per_shape(s) for s in shapes]
            measured = [c for c in cells if c is not None]
            verdict = "not measured" if not measured else ("met" if all(ok for _, ok in measured) else "missed")
            lines.append(f"| {name} | " + " | ".join("-" if c is None else c[0] + ("" if c[1] else " ✗")
                                                    for c in cells) + f" | **{verdict}** |")
        lines.append("")
    return "\n".join(lines) + "\n"


OURS_STYLE = {"ours_ce": ("fast", "tab:red"), "ours_ce_lean": ("lean", "tab:red"),
              "ours_grpo": ("fast", "tab:orange"), "ours_grpo_lean": ("lean", "tab:orange"),
              "ours_logprobs": ("fast", "tab:purple"), "ours_logprobs_lean": ("lean", "tab:purple"),
              "ours_ce_main_grad": ("fast", "tab:brown"), "ours_ce_main_grad_lean": ("lean", "tab:brown")}


def plot(results, out_dir):
    """One Pareto plot per shape (extra memory vs x floor; fwd+bwd rows, both spreads) and the
    memory sweep."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return []
    paths = []
    main = [r for r in results["rows"] if r["section"] == "shapes" and "x_floor" in r
            and not r.get("forward_only") and r["method"] != "floor" and r.get("extra_bytes") is not None]
    markers = {"random": "o", "peaked": "^"}
    peers = sorted({r["method"] for r in main if r["method"] not in OURS_STYLE})
    colors = dict(zip(peers, plt.get_cmap("tab10").colors[:len(peers)]))
    for shape in dict.fromkeys((r["N"], r["H"], r["V"]) for r in main):
        fig, ax = plt.subplots(figsize=(9, 6))
        for r in (r for r in main if (r["N"], r["H"], r["V"]) == shape):
            mem = max(r["extra_pct_dense_logits"], 0.01)
            mode, color = OURS_STYLE.get(r["method"], (None, colors.get(r["method"], "gray")))
            ax.scatter(mem, r["x_floor"], marker=markers.get(r.get("spread"), "s"), s=55 if mode else 35,
                       color=color, edgecolors="k" if mode == "lean" else "none", linewidths=1.2)
            ax.annotate(r["impl"].replace("@auto", ""), (mem, r["x_floor"]), fontsize=6,
                        xytext=(4, 2), textcoords="offset points")
        ax.axhline(1.0, color="k", lw=0.8)
        for level, style in ((1.05, ":"), (1.40, "--")):
            ax.axhline(level, color="gray", ls=style, lw=0.8)
        ax.axvline(3.0, color="gray", ls="-.", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("extra memory, % of the dense bf16 logits (peak - inputs - returned gradients)")
        ax.set_ylabel("time / 3-GEMM floor (fwd+bwd, same run)")
        ax.set_title(f"N={shape[0]} H={shape[1]} V={shape[2]} on {results['env'].get('device')}\n"
                     "o random logits, ^ peaked logits; ours: red CE, orange GRPO, purple log-probs, "
                     "brown main_grad; black edge = lean", fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"pareto_{shape[0]}x{shape[1]}x{shape[2]}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
        log(f"plot: {path}")
    sweep = [r for r in results["rows"] if r["section"] == "memory sweep" and r.get("extra_gib") is not None
             and not r["method"].startswith("floor")]
    if sweep:
        fig, ax = plt.subplots(figsize=(9, 6))
        for impl in dict.fromkeys(r["impl"] for r in sweep):
            pts = sorted((r["N"], r["extra_gib"]) for r in sweep if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [max(p[1], 1e-4) for p in pts], marker="o", label=impl)
        ns = sorted({r["N"] for r in sweep})
        v = sweep[0]["V"]
        ax.plot(ns, [n * v * 2 / GIB for n in ns], "k--", lw=0.8, label="dense bf16 logits")
        ax.plot(ns, [0.03 * 8192 * v * 2 / GIB for _ in ns], "k:", lw=0.8, label="3 % of the N=8192 logits")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("extra memory, GiB")
        ax.set_title("Extra memory vs tokens (H=%d, V=%d)" % (sweep[0]["H"], v))
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "sweep.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def environment():
    env = dict(python=platform.python_version(), torch=torch.__version__,
               package=getattr(megatron_fused_ce, "__version__", None))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), sms=p.multi_processor_count,
                   memory_gib=p.total_memory / GIB, cuda=torch.version.cuda)
    else:
        env["device"] = "cpu (TRITON_INTERPRET=1)"
    for mod, dist in (("megatron.core", "megatron-core"), ("liger_kernel", "liger-kernel"),
                      ("cut_cross_entropy", "cut-cross-entropy")):
        try:
            from importlib.metadata import version
            env[dist] = version(dist)
        except Exception:  # noqa: BLE001
            env[dist] = None
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git"] = None
    return env


# ------------------------------------------------------------------------------ tensor-parallel mode
# torchrun --nproc_per_node N tools/benchmark.py --tp N: one process per GPU (NCCL), the same global
# shapes (N tokens, H, V); every rank holds the full hidden [N, H] (no sequence parallel) and a V/TP
# vocab shard of the weight. Every method's dX is the full (TP-summed) input gradient, so the
# Megatron rows all-reduce it after backward, as ColumnParallelLinear's backward does.
TP_IMPLS = ("floor,ours_ce,ours_ce_lean,ours_logprobs,ours_logprobs_lean,megatron,megatron_fused,liger_tp,"
            "ours_top_p,ours_top_k,ours_topk20")
# measured on rank 0 alone for the scaling table
TP1_IMPLS = ("floor", "ours_ce", "ours_ce_lean", "ours_logprobs", "ours_logprobs_lean")
SCALED = ("floor", "ours_ce", "ours_ce_lean", "ours_logprobs", "ours_logprobs_lean")
TP_CHUNKED = ("ours_ce", "ours_logprobs")


class _TPCtx:
    def __init__(self, dist, group, tp, rank, device):
        self.dist, self.group, self.tp, self.rank, self.device = dist, group, tp, rank, device


def tp_make_floor_gemm(h, w, y, chunk, ctx):
    return make_floor(h, w, y, chunk)


def tp_make_allreduce(h, w, y, chunk, ctx):
    buf = torch.zeros(h.shape, dtype=h.dtype, device=h.device)

    def step():
        ctx.dist.all_reduce(buf, group=ctx.group)
        return None, None, None
    return step


def tp_make_ours_ce(h, w, y, chunk, ctx, memory_mode="fast"):
    return lambda: _grads(linear_cross_entropy(h, w, y, tp_group=ctx.group, chunk_size=chunk, impl=_impl(),
                                               memory_mode=memory_mode), h, w)


def tp_make_ours_logprobs(h, w, y, chunk, ctx, memory_mode="fast"):
    n = h.shape[0]
    return lambda: _grads(-linear_logprobs(h, w, y, tp_group=ctx.group, chunk_size=chunk,
                                           impl=_impl(), memory_mode=memory_mode).logprobs.sum() / n, h, w)


def tp_make_ours_ce_lean(h, w, y, chunk, ctx):
    return tp_make_ours_ce(h, w, y, None, ctx, memory_mode="lean")


def tp_make_ours_logprobs_lean(h, w, y, chunk, ctx):
    return tp_make_ours_logprobs(h, w, y, None, ctx, memory_mode="lean")


def _tp_sampler_maker(name):
    def make(h, w, y, chunk, ctx):
        step = lambda: _grads(_sampled_logprobs_loss(name, h, w, y, chunk, tp_group=ctx.group), h, w)  # noqa: E731
        step.loss_kind = "sampled"
        return step
    return make


for _name in SAMPLERS:
    globals()["tp_make_" + _name] = _tp_sampler_maker(_name)


def _tp_grads_allreduce(loss, h, w, ctx):
    dx, dw = torch.autograd.grad(loss, (h, w))
    ctx.dist.all_reduce(dx, group=ctx.group)  # ColumnParallelLinear's backward: dX summed over TP
    return loss.detach(), dx, dw


def tp_make_megatron(h, w, y, chunk, ctx):
    try:
        from megatron.core import tensor_parallel
        vpce = tensor_parallel.vocab_parallel_cross_entropy
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"megatron-core not importable: {type(exc).__name__}: {exc}")
    if ctx.megatron_error:
        raise Skip(ctx.megatron_error)
    return lambda: _tp_grads_allreduce(vpce((h @ w.t()).float(), y).mean(), h, w, ctx)


def tp_make_megatron_fused(h, w, y, chunk, ctx):
    try:
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy as fvpce
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"megatron fused_vocab_parallel_cross_entropy not importable: {type(exc).__name__}: {exc}")
    if ctx.megatron_error:
        raise Skip(ctx.megatron_error)
    group = parallel_state.get_tensor_model_parallel_group()
    # bf16 logits in, as Megatron's language module calls it (cross_entropy_loss_fusion=True)
    return lambda: _tp_grads_allreduce(fvpce(h @ w.t(), y, group).mean(), h, w, ctx)


def tp_make_liger_tp(h, w, y, chunk, ctx):
    try:
        from liger_kernel.ops import fused_linear_scaled_cross_entropy as lfsce
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"liger-kernel not importable: {type(exc).__name__}: {exc}")
    fn = getattr(lfsce, "LigerFusedLinearScaledCrossEntropyTPFunction", None)
    if fn is None:
        raise Skip("this liger-kernel has no LigerFusedLinearScaledCrossEntropyTPFunction")
    if h.device.type != "cuda":
        raise Skip("liger TP needs CUDA")
    native = False
    try:
        native = bool(lfsce._supports_native_tp_architecture(h.device) and lfsce._load_native_tp_function())
    except Exception:  # noqa: BLE001
        native = False
    n = h.shape[0]

    def step():
        return _grads(fn.apply(h, w, y, ctx.group).sum() / n, h, w)  # dX comes back TP-reduced
    step.note = ("native CUTLASS+NVSHMEM path" if native else
                 "fallback path (512-token chunks; native CuTe/NVSHMEM backend not available)")
    return step


TP_MAKERS = {name[len("tp_make_"):]: fn for name, fn in globals().items() if name.startswith("tp_make_")}


def tp_reference(h, w, y, ctx):
    """Mean CE over the sharded vocab in fp32 with explicit collectives: (loss, dX summed, dW shard)."""
    dist, g = ctx.dist, ctx.group
    v_local = w.shape[0]
    start = ctx.rank * v_local
    logits = h.detach().float() @ w.detach().float().t()
    m = logits.max(1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=g)
    logits.sub_(m[:, None])
    se = logits.exp().sum(1)
    dist.all_reduce(se, group=g)
    local = (y >= start) & (y < start + v_local)
    idx = (y - start).clamp(0, v_local - 1)
    tgt = torch.where(local, logits.gather(1, idx[:, None])[:, 0], torch.zeros_like(se))
    dist.all_reduce(tgt, group=g)
    lse = torch.log(se)
    n = h.shape[0]
    loss = (lse - tgt).mean()
    logits.sub_(lse[:, None]).exp_()  # softmax of the shard
    rows = torch.arange(n, device=h.device)[local]
    logits[rows, idx[local]] -= 1.0
    logits.div_(n)
    dx = logits @ w.detach().float()
    dist.all_reduce(dx, group=g)
    dw = logits.t() @ h.detach().float()
    return loss, dx, dw


class _ItemFailed(Exception):
    pass


def _tp_agree(ctx, fn):
    """fn() on every rank; if it raised on any rank, raise _ItemFailed on every rank (same message),
    so that all ranks skip the same item and stay in step for the next one's collectives."""
    err, res = None, None
    try:
        res = fn()
    except Skip as exc:
        err = str(exc)
    except torch.cuda.OutOfMemoryError as exc:
        err = "OOM: " + str(exc).split("\n")[0][:200]
    except Exception as exc:  # noqa: BLE001
        err = (f"failed: {type(exc).__name__}: {str(exc)[:300]}", traceback.format_exc()[-1500:])
    if err is not None:
        res = None
        free()
    errs = [None] * ctx.tp
    ctx.dist.all_gather_object(errs, err)
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        r, e = bad[0]
        msg, tb = (e if isinstance(e, tuple) else (e, None))
        exc = _ItemFailed(msg if r == 0 else f"{msg} (rank {r})")
        exc.tb = tb
        raise exc
    return res


def tp_time_step(step, args, ctx):
    """Median of per-rep CUDA-event times; a barrier before each timed region. The repetition count is
    agreed over ranks (from the slowest rank's first timed rep) so every rank runs the same number."""
    dist = ctx.dist
    cuda = ctx.device.type == "cuda"
    for _ in range(args.warmup):
        out = step()
        del out
    sync()

    def one():
        dist.barrier(group=ctx.group)
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            out = step()
            ms = (time.perf_counter() - t0) * 1e3
        del out
        return ms

    times = [one()]
    t = torch.tensor([times[0]], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    reps = max(args.min_reps, min(args.max_reps, int(args.budget_ms / max(t.item(), 1e-3))))
    times += [one() for _ in range(reps - 1)]
    return statistics.median(times), times


def tp_run_one(name, chunk, h, w, y, args, ctx, reference):
    n, hdim = h.shape
    v_local = w.shape[0]
    chunked = name in TP_CHUNKED or name in SAMPLERS
    label = f"{name}@{chunk or 'auto'}" if chunked else name
    row = dict(impl=label, method=name, chunk=(chunk or "auto") if chunked else None, N=n, H=hdim,
               V=v_local * ctx.tp, V_local=v_local, tp=ctx.tp, flops_per_gpu=6.0 * n * hdim * v_local,
               dense_logits_bytes_per_gpu=2 * n * v_local)
    if chunked and chunk is None:
        row["chunk_resolved"] = resolved_auto_chunk(n, v_local, h.device, hdim, name)
    try:
        step = _tp_agree(ctx, lambda: TP_MAKERS[name](h, w, y, chunk, ctx))
        if getattr(step, "note", None):
            row["note"] = step.note

        def first():
            t0 = time.perf_counter()
            if name in SAMPLERS:
                out, row["note"] = _search_note(step)
            else:
                out = step()  # compiles (Triton JIT)
            sync()
            errs = {}
            if reference is not None and name not in ("floor_gemm", "allreduce") and name not in SAMPLERS:
                loss, dx, dw = out
                errs = dict(err_loss=rel_err(loss, reference[0]), err_dx=rel_err(dx, reference[1]),
                            err_dw=rel_err(dw, reference[2]))
            return time.perf_counter() - t0, errs
        row["first_call_s"], errs = _tp_agree(ctx, first)
        row.update(errs)  # errors of dX are the same on every rank (reduced); dW: rank 0's shard

        def memory():
            extra, out = measure_memory(step)
            del out
            return extra
        extra = _tp_agree(ctx, memory)
        ms, times = _tp_agree(ctx, lambda: tp_time_step(step, args, ctx))
        per_rank = [None] * ctx.tp
        ctx.dist.all_gather_object(per_rank, (ms, extra))
        row["ms_ranks"] = [p[0] for p in per_rank]
        row["ms"] = max(row["ms_ranks"])  # the step takes as long as its slowest rank
        row["times_ms_rank0"] = times
        row["tflops_per_gpu"] = row["flops_per_gpu"] / row["ms"] / 1e9
        if extra is not None:
            row["extra_bytes_ranks"] = [p[1] for p in per_rank]
            row["extra_bytes"] = max(row["extra_bytes_ranks"])
            row["extra_gib"] = row["extra_bytes"] / GIB
            row["extra_pct_dense_logits"] = 100.0 * row["extra_bytes"] / row["dense_logits_bytes_per_gpu"]
    except _ItemFailed as exc:
        row["skipped"] = str(exc)
        if getattr(exc, "tb", None):
            row["traceback"] = exc.tb
    finally:
        step = None
        free()
    status = row.get("skipped") or (f"{row['ms']:.3f} ms (ranks {', '.join(f'{m:.3f}' for m in row['ms_ranks'])})"
                                    f"  extra {row.get('extra_gib', float('nan')):.3f} GiB"
                                    f"  err dx {row.get('err_dx')} dw {row.get('err_dw')}")
    log(f"  {label:24s} {status}")
    return row


def tp_inputs(n, hdim, v_local, ctx, seed=0):
    """hidden and labels identical on every rank (rank 0's, broadcast); a per-rank weight shard."""
    device = ctx.device
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, hdim, device=device, generator=g, dtype=torch.float32).to(torch.bfloat16)
    y = torch.randint(0, v_local * ctx.tp, (n,), device=device, generator=g)
    ctx.dist.broadcast(h, 0, group=ctx.group)
    ctx.dist.broadcast(y, 0, group=ctx.group)
    gw = torch.Generator(device=device).manual_seed(seed + 1000 + ctx.rank)
    w = (torch.randn(v_local, hdim, device=device, generator=gw, dtype=torch.float32) / math.sqrt(hdim) * 2)
    return h.requires_grad_(), w.to(torch.bfloat16).requires_grad_(), y


def tp1_measure(shape, chunks, args, ctx, results):
    """TP=1 on rank 0 alone (the other ranks wait at a barrier): floor and ours at the full vocab."""
    rows = []
    if ctx.rank == 0:
        log(f"\n== TP=1 on rank 0 alone: N={shape[0]} H={shape[1]} V={shape[2]}")
        try:
            h, w, y = make_inputs(*shape, ctx.device)
            seen = set()
            wanted = {"floor"} | {name for name, _ in getattr(ctx, "impls", [])}
            for name in (m for m in TP1_IMPLS if m in wanted):
                for chunk in (chunks if name in TP_CHUNKED else [None]):
                    key = (name, None if chunk is None else min(chunk, shape[0]))
                    if key in seen:
                        continue
                    seen.add(key)
                    row = run_one(name, chunk, h, w, y, args)
                    row.update(section="tp1", tp=1, source="measured on rank 0 alone in this run")
                    rows.append(row)
            del h, w, y
        except Exception as exc:  # noqa: BLE001
            log(f"  TP=1 measurement failed: {type(exc).__name__}: {exc}")
        free()
        results["rows"].extend(rows)
    ctx.dist.barrier(group=ctx.group)
    return rows


def tp1_from_json(path, shape):
    with open(path) as f:
        data = json.load(f)
    rows = []
    for r in data.get("rows", []):
        if (r.get("N"), r.get("H"), r.get("V")) == tuple(shape) and r.get("method") in TP1_IMPLS and "ms" in r:
            rows.append(dict(r, section="tp1", tp=1, source=path))
    return rows


def _best(rows, method):
    cands = [r for r in rows if r.get("method") == method and "ms" in r]
    return min(cands, key=lambda r: r["ms"]) if cands else None


def tp_scaling(shape, tp, tp_rows, tp1_rows):
    out = []
    for method in SCALED:
        r1, rn = _best(tp1_rows, method), _best(tp_rows, method)
        if r1 is None or rn is None:
            continue
        out.append(dict(N=shape[0], H=shape[1], V=shape[2], tp=tp, method=method, impl_tp1=r1["impl"],
                        impl_tp=rn["impl"], t1_ms=r1["ms"], tN_ms=rn["ms"], fraction=rn["ms"] / r1["ms"],
                        efficiency=r1["ms"] / (tp * rn["ms"]), source=r1.get("source")))
    return out


def tp_bench_shape(shape, impls, chunks, args, ctx, results, tp1_rows):
    n, hdim, v = shape
    tp = ctx.tp
    v_local = -(-v // tp)
    if v_local * tp != v:
        log(f"  note: V={v} is not divisible by TP={tp}; using V={v_local * tp}")
    log(f"\n== TP={tp}: N={n} H={hdim} V={v_local * tp} (per GPU: [{n},{hdim}] x [{hdim},{v_local}], "
        f"3-GEMM floor {6.0 * n * hdim * v_local / 1e12:.2f} TFLOP per GPU)")
    free()
    h, w, y = tp_inputs(n, hdim, v_local, ctx)
    reference = None
    if not args.no_check:
        try:
            reference = _tp_agree(ctx, lambda: tp_reference(h, w, y, ctx))
        except _ItemFailed as exc:
            log(f"  (no fp32 reference: {exc}; errors not checked)")
        free()
    rows = []
    for name, chunk in [("floor_gemm", None), ("allreduce", None)] + impls:
        row = tp_run_one(name, chunk, h, w, y, args, ctx, reference)
        row["section"] = f"tp{tp}"
        rows.append(row)
        if ctx.rank == 0:
            results["rows"].append(row)
            write_json(results, args.out, f"tp{tp}_results.json")
    gemm = next((r for r in rows if r["method"] == "floor_gemm" and "ms" in r), None)
    ar = next((r for r in rows if r["method"] == "allreduce" and "ms" in r), None)
    if gemm and ar:
        floor = dict(impl="floor", method="floor", chunk=None, N=n, H=hdim, V=v_local * tp, V_local=v_local,
                     tp=tp, section=f"tp{tp}", floor_gemm_ms=gemm["ms"], allreduce_ms=ar["ms"],
                     ms=gemm["ms"] + ar["ms"], flops_per_gpu=gemm["flops_per_gpu"],
                     note="floor_gemm + allreduce of dX [N, H] bf16, measured separately")
        rows.append(floor)
        if ctx.rank == 0:
            results["rows"].append(floor)
        for r in rows:
            if "ms" in r:
                r["floor_ms"], r["floor_gemm_ms"], r["allreduce_ms"] = floor["ms"], gemm["ms"], ar["ms"]
                r["x_floor"] = r["ms"] / floor["ms"]
                r["x_floor_gemm"] = r["ms"] / gemm["ms"]
    add_x_plain(rows)
    if ctx.rank == 0:
        results["scaling"].extend(tp_scaling((n, hdim, v_local * tp), tp, rows, tp1_rows))
        write_json(results, args.out, f"tp{tp}_results.json")
    del h, w, y, reference
    free()
    return rows


def tp_markdown(results):
    tp = results["tp"]
    lines = [f"Device: {results['env'].get('device')} × {tp} ({results['backend']}); torch {results['env']['torch']}, "
             f"triton {results['env'].get('triton')}; command: `{results['command']}`", "",
             "Per GPU, forward+backward, median over repeats (max over ranks), barrier before each timed "
             "region; every dX is the full TP-summed input gradient (Megatron rows include the "
             "all-reduce after backward). Floor = the 3 GEMMs of one vocab shard + the dX all-reduce "
             "([N, H] bf16), each measured in this run.", ""]
    sec = f"tp{tp}"
    rows = [r for r in results["rows"] if r.get("section") == sec]
    for shape in dict.fromkeys((r["N"], r["H"], r["V"]) for r in rows):
        sr = [r for r in rows if (r["N"], r["H"], r["V"]) == shape]
        floor = next((r for r in sr if r["method"] == "floor"), None)
        head = f"### TP={tp}: N={shape[0]}, H={shape[1]}, V={shape[2]}"
        if floor:
            head += (f" — per-GPU floor {floor['ms']:.2f} ms = GEMMs {floor['floor_gemm_ms']:.2f} + "
                     f"dX all-reduce {floor['allreduce_ms']:.2f}")
        lines += [head, "", "| method | ms | × per-GPU floor | × floor GEMMs | extra GiB | extra % dense logits "
                  "(shard) | err loss | err dX | err dW | note |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sr:
            if r["method"] == "floor":
                continue
            if "ms" not in r:
                lines.append(f"| {r['impl']} | - | - | - | - | - | - | - | - | {r.get('skipped', '')[:160]} |")
                continue
            note = r.get("note", "")
            if r.get("chunk_resolved"):
                note = (note + "; " if note else "") + f"auto = {r['chunk_resolved']} rows"
            lines.append(
                f"| {r['impl']} | {r['ms']:.2f} | {_fmt(r.get('x_floor'), '.3f')} | {_fmt(r.get('x_floor_gemm'), '.3f')} | "
                f"{_fmt(r.get('extra_gib'), '.3f')} | {_fmt(r.get('extra_pct_dense_logits'), '.1f')} | "
                f"{_fmt(r.get('err_loss'), '.1e')} | {_fmt(r.get('err_dx'), '.1e')} | {_fmt(r.get('err_dw'), '.1e')} | "
                f"{note} |")
        lines.append("")
    if results["scaling"]:
        lines += [f"### Scaling TP=1 → TP={tp} (best chunk per method; targets: fraction ≤ 0.55 at TP=2, "
                  f"efficiency ≥ 85% at TP=4)", "",
                  "| N, H, V | method | TP=1 ms | TP=%d ms per GPU | fraction of TP=1 | efficiency t1/(TP·tN) | "
                  "TP=1 source |" % tp, "|---|---|---|---|---|---|---|"]
        for s in results["scaling"]:
            lines.append(f"| {s['N']}, {s['H']}, {s['V']} | {s['method']} ({s['impl_tp1']} → {s['impl_tp']}) | "
                         f"{s['t1_ms']:.2f} | {s['tN_ms']:.2f} | {s['fraction']:.3f} | {100 * s['efficiency']:.1f}% | "
                         f"{s.get('source') or ''} |")
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def tp_main(args):
    import datetime

    import torch.distributed as dist
    global log
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} needs torchrun --nproc_per_node {args.tp} (WORLD_SIZE is {world})")
    dev_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.backend or ("nccl" if dev_type == "cuda" else "gloo")
    if dev_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    kw = dict(device_id=device) if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30), **kw)
    if rank != 0:
        log = lambda *a: None  # noqa: E731  (only rank 0 prints)
    ctx = _TPCtx(dist, dist.group.WORLD, world, rank, device)
    ctx.megatron_error = None
    try:
        from megatron.core import parallel_state
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    except Exception as exc:  # noqa: BLE001
        ctx.megatron_error = f"megatron parallel_state not initialized: {type(exc).__name__}: {str(exc)[:200]}"
    flags = [None] * world
    dist.all_gather_object(flags, ctx.megatron_error)
    ctx.megatron_error = next((f for f in flags if f), None)

    quick_dev = "cuda" if dev_type == "cuda" else "cpu"
    if args.quick:
        shapes = parse_shapes(args.shapes) if args.shapes else (
            QUICK_SHAPES_GPU if quick_dev == "cuda" else QUICK_SHAPES_CPU)
        args.warmup, args.min_reps, args.max_reps, args.budget_ms = 1, 2, 3, 1.0
        if args.chunks == "4096,8192,auto":
            args.chunks = "auto,512" if quick_dev == "cuda" else "auto,16"
    else:
        shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
        if args.chunks == "4096,8192,auto":
            args.chunks = "auto,4096"
        if args.max_reps == 15:
            args.max_reps = 20
    chunks = parse_chunks(args.chunks)
    spec = TP_IMPLS if args.impls == DEFAULT_IMPLS else args.impls
    impls = []
    for name in (s.strip() for s in spec.split(",")):
        if not name or name == "floor":  # the floor (GEMMs + all-reduce) always runs
            continue
        if name not in TP_MAKERS:
            raise SystemExit(f"unknown TP impl {name!r}; known: {', '.join(m for m in TP_MAKERS)}")
        if name in TP_CHUNKED:
            impls.extend((name, c) for c in chunks)
        elif name in SAMPLERS:
            impls.append((name, chunks[0]))
        else:
            impls.append((name, None))

    ctx.impls = impls
    results = dict(command=" ".join(["torchrun", f"--nproc_per_node {world}", os.path.relpath(sys.argv[0], REPO)]
                                    + sys.argv[1:]), tp=world, backend=backend, quick=args.quick,
                   rows=[], scaling=[], notes=[])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        results["env"] = environment()
        if dev_type != "cuda":
            results["env"]["device"] = "cpu (debug; TRITON_INTERPRET=1)"
        try:
            results["env"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if dev_type == "cuda" else None
        except Exception:  # noqa: BLE001
            results["env"]["nccl"] = None
        log(json.dumps(results["env"]))
        if ctx.megatron_error:
            results["notes"].append(ctx.megatron_error)
    t_start = time.time()
    tp1_mode = "json" if args.tp1_json else args.tp1
    for shape in shapes:
        tp1_rows = []
        if tp1_mode == "json":
            try:
                tp1_rows = tp1_from_json(args.tp1_json, shape) if rank == 0 else []
                if rank == 0 and not tp1_rows:
                    results["notes"].append(f"{args.tp1_json}: no TP=1 rows for shape {shape}")
            except Exception as exc:  # noqa: BLE001
                if rank == 0:
                    results["notes"].append(f"--tp1-json {args.tp1_json} unreadable: {exc}")
        elif tp1_mode == "measure":
            tp1_rows = tp1_measure(shape, chunks, args, ctx, results)
        tp_bench_shape(shape, impls, chunks, args, ctx, results, tp1_rows)
        log(f"  [{time.time() - t_start:.0f} s elapsed]")
    if rank == 0:
        results["elapsed_s"] = time.time() - t_start
        write_json(results, args.out, f"tp{world}_results.json")
        md = tp_markdown(results)
        with open(os.path.join(args.out, f"tp{world}_results.md"), "w") as f:
            f.write(md)
        log("\n" + md)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def parse_chunks(spec):
    return [None if c.strip() == "auto" else int(c) for c in spec.split(",") if c.strip()]


def parse_shapes(spec):
    return [tuple(int(x) for x in s.lower().split("x")) for s in spec.split(",") if s.strip()]


def main(argv=None):
    global SAMPLER_TEMPERATURE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", help="comma list of NxHxV (default: the 3 design shapes)")
    p.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma list (default {DEFAULT_IMPLS})")
    p.add_argument("--chunks", default="auto", help="chunk sizes for ours (rows; 'auto')")
    p.add_argument("--spreads", default=",".join(SPREADS), help="logit spreads: random,peaked (see the doc)")
    p.add_argument("--sweep", default=None, help="memory sweep N list at H=4096, V=128256 ('' = none)")
    p.add_argument("--sweep-impls", default=SWEEP_IMPLS)
    p.add_argument("--sweep-chunk", default="auto", help="chunk size for ours in the sweep")
    p.add_argument("--kernels", action="store_true", help="also the Triton kernel check / per-chunk breakdown")
    p.add_argument("--no-kernels", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (smoke test)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench_out"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=15)
    p.add_argument("--budget-ms", type=float, default=400.0, help="time to spend per method")
    p.add_argument("--report", help="only write results.md and the plots from this results.json")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="start no further shape / sweep point after this many seconds (0: no limit)")
    p.add_argument("--sampler-temperature", type=float, default=SAMPLER_TEMPERATURE,
                   help="temperature of the top_p/top_k/topk20 rows (0.25: peaked rows like an LM's)")
    tpg = p.add_argument_group("tensor parallel (torchrun --nproc_per_node N tools/benchmark.py --tp N)")
    tpg.add_argument("--tp", type=int, default=0, help="TP size = number of torchrun processes (one per GPU)")
    tpg.add_argument("--tp1", choices=("measure", "none"), default="measure",
                     help="TP=1 times for the scaling table: measured on rank 0 alone before each shape "
                          "(default) or none")
    tpg.add_argument("--tp1-json", help="take TP=1 times from a single-GPU results.json instead")
    tpg.add_argument("--no-check", action="store_true", help="TP: skip the fp32 reference (errors)")
    tpg.add_argument("--device", choices=("cuda", "cpu"), help=argparse.SUPPRESS)  # debug: --device cpu
    tpg.add_argument("--backend", choices=("nccl", "gloo"), help=argparse.SUPPRESS)  # debug: --backend gloo
    args = p.parse_args(argv)
    SAMPLER_TEMPERATURE = args.sampler_temperature
    if args.report:  # tables and plots again from a results.json (e.g. after a timed-out run)
        with open(args.report) as f:
            results = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown(results))
        plot(results, args.out)
        print(markdown(results))
        return 0
    if args.tp:
        return tp_main(args)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        shapes = parse_shapes(args.shapes) if args.shapes else (
            QUICK_SHAPES_GPU if device.type == "cuda" else QUICK_SHAPES_CPU)
        sweep = parse_chunks(args.sweep) if args.sweep is not None else ([2048, 4096] if device.type == "cuda" else [32, 64])
        args.warmup, args.min_reps, args.max_reps, args.budget_ms = 1, 2, 3, 1.0
    else:
        shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
        sweep = SWEEP_N if args.sweep is None else parse_chunks(args.sweep)
    chunks = parse_chunks(args.chunks)
    results = dict(command=" ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]) if argv is None
                   else " ".join(argv), env=environment(), quick=args.quick, rows=[])
    log(json.dumps(results["env"]))
    t_start = time.time()
    impls = impl_list(args.impls, chunks)

    if args.kernels and not args.no_kernels:
        kshape = shapes[0]
        kernel_chunk = min(4096 if not args.quick else 64, kshape[0])
        results["kernel_ok"] = kernel_check_and_breakdown(args, device, results, kshape, kernel_chunk)
        if any(name in SAMPLERS for name, _ in impls):
            results["sampler_kernel_ok"] = sampler_kernel_check(args, device, results, kshape, kernel_chunk)

    def checkpoint():  # what is measured so far survives a time limit or a crash
        results["elapsed_s"] = time.time() - t_start
        write_json(results, args.out)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown(results))
        log(f"  [{results['elapsed_s']:.0f} s elapsed]")

    def out_of_time(what):
        if args.time_limit_s and time.time() - t_start > args.time_limit_s:
            results.setdefault("not_run", []).append(what)
            log(f"  (time limit {args.time_limit_s:.0f} s: {what} not run)")
            return True
        return False

    spreads = [s.strip() for s in args.spreads.split(",") if s.strip()]
    for spread in spreads:
        for shape in shapes:
            if not out_of_time(f"{spread} {shape}"):
                bench_shape(shape, impls, args, device, results, "shapes", spread=spread)
                checkpoint()
    if sweep:
        sweep_impls = impl_list(args.sweep_impls, parse_chunks(args.sweep_chunk))
        hv = (shapes[0][1], shapes[0][2]) if args.quick else SWEEP_HV
        for n in sweep:
            if not out_of_time(f"sweep N={n}"):
                bench_shape((n, *hv), sweep_impls, args, device, results, "memory sweep", check=False,
                            spread=spreads[0] if spreads else "random")
                checkpoint()

    checkpoint()
    md = markdown(results)
    plot(results, args.out)
    log("\n" + md)
    return 0 if results.get("kernel_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
