"""How a method is measured: the GEMM floor, timing, memory, the float64 reference, the inputs."""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from . import REPO  # noqa: F401  (re-exported for the other modules)

GIB = 1024.0 ** 3


class Skip(Exception):
    """A method that cannot run here (not installed, not applicable): reported, never fatal."""


QUIET = False  # tensor parallel: only rank 0 prints


def log(*args):
    if not QUIET:
        print(*args, flush=True)


def add_backward_thread_option(parser) -> None:
    """--backward-thread: where autograd runs the backward of CUDA tensors (docs/performance.md,
    "RL passes"): on its device thread (torch's default: the calling thread hands the graph over and
    waits) or on the calling thread."""
    parser.add_argument("--backward-thread", choices=("device", "calling"), default="device",
                        help="autograd's backward on its device thread (torch's default) or on the calling thread "
                             "(torch.autograd.set_multithreading_enabled(False): no hand-off, ~0.3 ms of host a "
                             "backward on the H200 hosts measured); every method alike")


def set_backward_thread(choice: str) -> None:
    """Apply --backward-thread to this thread (the setting is thread-local; the methods run here)."""
    torch.autograd.set_multithreading_enabled(choice == "device")


# ------------------------------------------------------------------------------ the methods
def _grads(loss, h, w):
    dx, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), dx, dw


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
        step()
    sync()
    times = []
    while True:
        times.append(_timed_call(step))
        if len(times) >= max_reps or (len(times) >= min_reps and sum(times) >= budget_ms):
            break
    return statistics.median(times), times


def _timed_call(step):
    """One call from an idle GPU: ms by CUDA events around it (host clock off CUDA)."""
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step()
        end.record()
        end.synchronize()
        del out
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    out = step()
    del out
    return (time.perf_counter() - t0) * 1e3


def time_paired(step, floor_step, warmup, min_reps, max_reps, budget_ms, steady_ms=0.0, timed_call=None,
                agree_count=None):
    """A method and its floor timed in alternation (floor, method, floor, method, ...), each call
    from an idle GPU -> (method ms, its times, floor ms, the floor's times), medians.

    Under a sustained load an H200's GEMMs run up to ~20 % slower than from a cool start (the same
    GEMMs 0.81 -> 0.98 ms after 1.5 s of back-to-back calls; its SM clock read 1980 MHz idle,
    1380-1650 under load), so a floor timed a few seconds apart from a method moves the method's
    x floor by as much. In alternation both see the GPU in the same state. `steady_ms`: first run
    both in turn about that long, so that they are timed at the clocks a training loop holds the
    GPU at. `timed_call(step) -> ms` times one call (default: CUDA events from an idle GPU);
    `agree_count(n) -> n` makes the steady phase's number of pairs the same on every rank where the
    steps hold collectives (a phase by each rank's own clock would pair them unevenly)."""
    timed_call = timed_call or _timed_call
    for _ in range(warmup):
        floor_step()
        step()
    sync()
    if steady_ms > 0:
        t0 = time.perf_counter()
        floor_step()
        step()
        sync()
        pairs = math.ceil(steady_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)) - 1
        for _ in range(agree_count(pairs) if agree_count else pairs):
            floor_step()
            step()
        sync()
    times, floor_times = [], []
    while True:
        floor_times.append(timed_call(floor_step))
        times.append(timed_call(step))
        if len(times) >= max_reps or (len(times) >= min_reps and sum(times) >= budget_ms):
            break
    return statistics.median(times), times, statistics.median(floor_times), floor_times


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

