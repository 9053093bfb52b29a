#!/usr/bin/env python3
"""What the host costs a fused call: where it synchronizes, and its time with the argument
agreement's read-back removed.

    python tools/host_sync_cost.py                       # one GPU, the benchmark's three shapes
    python tools/host_sync_cost.py --device cpu --shapes 256x64x1000   # smoke test

1. Every synchronizing CUDA call of one forward + backward of linear_cross_entropy,
   linear_logprobs and linear_grpo_loss, with the package frames that made it
   (torch.cuda.set_sync_debug_mode; CUDA only).
2. Per shape (N x H x V, bf16), medians of CUDA-event timings (7 calls after 2 warm-ups):
     floor               the 3 cuBLAS GEMMs of a dense fwd+bwd
     ce                  linear_cross_entropy fwd+bwd, each call on an idle GPU (as tools/benchmark.py)
     ce_preloaded        the same behind ~8 GEMMs of queued GPU work: the call's host work before
                         its first kernel is hidden, its read-back still waits for the queue
     ce_back_to_back     7 calls queued without a sync between them, per call
     *_nosync            the same with the first call's agreement replayed (no label kernels, no
                         read-back: what removing the one host sync could gain at most)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss  # noqa: E402
from megatron_fused_ce.ops import api  # noqa: E402

from bench.measure import make_inputs  # noqa: E402  (the benchmark's inputs: logit std 2)

SHAPES = "8192x4096x128256,8192x2304x256000,16384x3584x152064"


def paths(h, w, y):
    n, hidden_size = h.shape
    sequences = 8 if n % 8 == 0 else 1
    adv = torch.randn(sequences, device=h.device)
    mask = torch.ones(sequences, n // sequences, device=h.device)
    return {
        "ce": lambda: torch.autograd.grad(linear_cross_entropy(h, w, y), (h, w)),
        "logprobs": lambda: torch.autograd.grad(-linear_logprobs(h, w, y).logprobs.mean(), (h, w)),
        "grpo": lambda: torch.autograd.grad(linear_grpo_loss(
            h.view(sequences, -1, hidden_size), w, y.view(sequences, -1), adv, mask, GRPOConfig())[0], (h, w)),
    }


def sync_sites(fn):
    """(message, package frames) of each synchronizing CUDA call one fn() makes."""
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "megatron_fused_ce" in f.filename]
        sites.append([f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:]])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, reps=7, preload=None, back_to_back=False):
    fn()
    fn()
    synchronize(device)
    if device.type != "cuda":  # wall clock: the smoke test's numbers
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    if back_to_back:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if preload is not None:
            preload()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    if device.type == "cuda":
        h, w, y = make_inputs(*shapes[0], device)
        for name, fn in paths(h, w, y).items():
            fn()
            torch.cuda.synchronize()
            sites = sync_sites(fn)
            print(f"{name}: {len(sites)} synchronizing call(s) per forward + backward", flush=True)
            for frames in sites:
                print("   " + " <- ".join(reversed(frames)), flush=True)
        del h, w, y

    square = torch.randn(8192 if device.type == "cuda" else 64, 8192 if device.type == "cuda" else 64,
                         device=device, dtype=torch.bfloat16)

    def preload():
        for _ in range(5):
            square @ square

    for shape in shapes:
        times = time_shape(shape, device, preload)
        print(f"{'x'.join(map(str, shape))} {device.type}: " + ", ".join(
            f"{k} {v:.2f} ms ({v / times['floor']:.3f})" for k, v in times.items()), flush=True)


def time_shape(shape, device, preload):
    """The timings of one shape, the last three with the first call's agreement replayed."""
    h, w, y = make_inputs(*shape, device)
    ce = paths(h, w, y)["ce"]

    def floor():
        logits = h @ w.t()
        return logits @ w, logits.t() @ h

    times = {"floor": median_ms(floor, device), "ce": median_ms(ce, device),
             "ce_preloaded": median_ms(ce, device, preload=preload),
             "ce_back_to_back": median_ms(ce, device, back_to_back=True)}
    real_check, cached = api._check_arguments, {}

    def replayed(*a, **k):
        if "agreed" not in cached:
            cached["agreed"] = real_check(*a, **k)
        return cached["agreed"]

    api._check_arguments = replayed
    try:
        times["ce_nosync"] = median_ms(ce, device)
        times["ce_nosync_preloaded"] = median_ms(ce, device, preload=preload)
        times["ce_nosync_back_to_back"] = median_ms(ce, device, back_to_back=True)
    finally:
        api._check_arguments = real_check
    return times

if __name__ == "__main__":
    main()
