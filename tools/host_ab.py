#!/usr/bin/env python3
"""Two versions of the package in one process, their calls alternating on the same inputs: the
host time of a call (until the Python call returns), its time from an idle GPU, and its CUDA
kernels. At the row counts RL runs a call's time is its host's, and hosts drift by up to ±30 %
between processes on the machines measured here (docs/benchmarks.md), so an A/B of two trees run
one process after the other cannot see a 10 % change; one process can.

    python tools/host_ab.py --against HEAD~1 --shape 2048x4096x19008 --method replay
    python tools/host_ab.py --against ../older_checkout --method logprobs,ce
    python tools/host_ab.py --against HEAD --device cpu --shape 64x32x300 --calls 3   # smoke test

`--against`: a git revision of this checkout, or a folder holding an older checkout's
megatron_fused_ce/; its package is imported under another name (the package imports itself
relatively), beside this tree's. Methods (forward + backward of a mean over the tokens, bf16 on
GPUs): `replay` (linear_logprobs with a sampling mask of K ids a token, `--sets` zipf or random as
tools/sampling_mask_bench.py draws them), `logprobs`, `ce` (linear_cross_entropy), `grpo`
(linear_grpo_loss with the default GRPOConfig over 8 sequences, as tools/benchmark.py's
`ours_grpo`), and `forward` (log-probs under no_grad, a forward pass alone). Per method and
version: medians (and quartiles) over `--calls` calls of each, and how far the two versions' dX
and dW (forward: log-probs) are apart (max |difference| / max |value|): 0 where they compute alike.
"""

import argparse
import collections
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))
import megatron_fused_ce  # noqa: E402
from bench.measure import add_backward_thread_option, set_backward_thread  # noqa: E402
from real_loop_curves import package_source  # noqa: E402  (a revision's or a checkout's package code)
from sampling_mask_bench import kept_sets  # noqa: E402

OTHER = "megatron_fused_ce_against"


def import_against(spec: str, work: str):
    """(the other version's package, its label): `spec` a git revision or a folder with megatron_fused_ce/."""
    label = package_source(spec, work)
    folder = os.path.join(work, "megatron_fused_ce")
    module_spec = importlib.util.spec_from_file_location(OTHER, os.path.join(folder, "__init__.py"),
                                                         submodule_search_locations=[folder])
    package = importlib.util.module_from_spec(module_spec)
    sys.modules[OTHER] = package
    module_spec.loader.exec_module(package)
    return package, label


def make_step(package, method: str, h, w, y, mask):
    batch = 8 if h.shape[0] % 8 == 0 else 1  # (grpo: sequences of the tokens)
    advantages = torch.linspace(-1.0, 1.0, batch, device=h.device)
    sequence_mask = torch.ones(batch, h.shape[0] // batch, device=h.device)

    def step():
        if method == "forward":  # the reference / old-policy pass: its log-probs, no graph
            with torch.no_grad():
                return (package.linear_logprobs(h, w, y).logprobs,)
        if method == "ce":
            loss = package.linear_cross_entropy(h, w, y)
        elif method == "grpo":
            loss, _ = package.losses.linear_grpo_loss(h.view(batch, -1, h.shape[-1]), w, y.view(batch, -1),
                                                      advantages, sequence_mask, package.losses.GRPOConfig())
        else:
            lp = package.linear_logprobs(h, w, y, sampling_mask=mask if method == "replay" else None).logprobs
            loss = -lp.sum() / lp.numel()
        return torch.autograd.grad(loss, (h, w))
    return step


def kernels_per_call(step, cuda: bool):
    """(CUDA kernels, their µs) of one call (torch.profiler, the mean of three); (0, 0) off CUDA."""
    if not cuda:
        return 0, 0.0
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events) / 3, sum(e.device_time_total for e in events) / 3


def compare(steps: dict, calls: int, cuda: bool) -> tuple:
    """{version: (host µs list, from-idle µs list, kernels, kernel µs)} and the results' distance."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = {name: step() for name, step in steps.items()}  # (each signature's first call)
    ours, theirs = results.values()
    apart = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()
             for a, b in zip(ours, theirs)]
    for step in steps.values():
        for _ in range(3):
            step()
    host, idle = collections.defaultdict(list), collections.defaultdict(list)
    names = list(steps)
    for i in range(calls):
        for name in (names if i % 2 else names[::-1]):  # (alternating which goes first)
            sync()
            t0 = time.perf_counter()
            steps[name]()
            t1 = time.perf_counter()
            sync()
            host[name].append((t1 - t0) * 1e6)
            idle[name].append((time.perf_counter() - t0) * 1e6)
    table = {name: (host[name], idle[name]) + kernels_per_call(steps[name], cuda) for name in names}
    return table, apart


def quartiles(values) -> str:
    if len(values) < 2:
        return f"{values[0]:.0f}"
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"{q2:.0f} ({q1:.0f}-{q3:.0f})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True,
                   help="a git revision of this checkout, or a folder with megatron_fused_ce/")
    p.add_argument("--shape", default="2048x4096x19008", help="NxHxV")
    p.add_argument("--method", default="replay", help="comma list of replay, logprobs, ce, grpo, forward")
    p.add_argument("--sets", default="zipf", choices=("zipf", "random"))
    p.add_argument("--k", type=int, default=50, help="kept ids a token (replay)")
    p.add_argument("--calls", type=int, default=200, help="calls of each version, alternating")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    add_backward_thread_option(p)
    args = p.parse_args(argv)
    set_backward_thread(args.backward_thread)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    n, hidden, vocab = (int(x) for x in args.shape.split("x"))
    with tempfile.TemporaryDirectory() as work:
        other, label = import_against(args.against, work)
        g = torch.Generator(device=device).manual_seed(0)
        dtype = torch.bfloat16 if cuda else torch.float32
        h = torch.randn(n, hidden, device=device, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(vocab, hidden, device=device, generator=g) * (2 / math.sqrt(hidden))).to(dtype)
        w.requires_grad_()
        ids, offsets, labels = kept_sets(args.sets, n, vocab, args.k, device, g)
        print(f"{args.shape} on {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}; "
              f"this tree against {label}; {args.calls} calls of each, alternating"
              + ("; backward on the calling thread" if args.backward_thread == "calling" else ""))
        print("| method | version | host µs | from idle µs | kernels | kernel µs |")
        print("|---|---|---|---|---|---|")
        for method in args.method.split(","):
            steps = {"this tree": make_step(megatron_fused_ce, method, h, w, labels, (ids, offsets)),
                     label: make_step(other, method, h, w, labels, (ids, offsets))}
            table, apart = compare(steps, args.calls, cuda)
            name = f"replay ({args.sets}, K = {args.k})" if method == "replay" else method
            for version, (host, idle, kernels, kernel_us) in table.items():
                print(f"| {name} | {version} | {quartiles(host)} | {quartiles(idle)} | {kernels:.0f} | "
                      f"{kernel_us:.0f} |")
            outputs = ("log-probs",) if method == "forward" else ("dX", "dW")
            print(f"  {name}: " + ", ".join(f"{o} apart {a:.1e}" for o, a in zip(outputs, apart))
                  + " (max |difference| / max |value|)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
