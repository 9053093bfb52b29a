#!/usr/bin/env python3
"""Where the time of one call goes: torch.profiler over a few calls of the op's paths, CUDA kernel
time by kernel name, and the GPU's busy time against the wall time (gaps = launch / host overhead).

    python tools/profile_op.py [--shape 8192x4096x128256] [--paths ce,logprobs,ce_lean,fwd,grpo]
    python tools/profile_op.py --paths ce_lean --lean-tiles 1152,16384,8192,4096   # try tile sizes
    python tools/profile_op.py --gaps   # where the GPU waits: after host syncs, at the call's start, else
    python tools/profile_op.py --device cpu --shape 64x32x100 --paths ce,grpo --reps 1   # smoke test

On the CPU (`--device cpu`, the torch backend) the table lists the ops by self CPU time instead of
the CUDA kernels; `--gaps` needs CUDA.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss  # noqa: E402
from megatron_fused_ce.ops import lean  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192x4096x128256")
    p.add_argument("--paths", default="ce,logprobs,ce_lean,fwd")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="also the host-side ops by self CPU time")
    p.add_argument("--gaps", action="store_true",
                   help="the GPU's idle time per call: at the call's start, after each host sync, the rest")
    p.add_argument("--lean-tiles", help="rows_a,cols_a,rows_b,cols_b: lean mode's tiles instead of tile_sizes()")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if args.gaps and not cuda:
        p.error("--gaps reads the GPU's idle time: it needs --device cuda")
    if args.lean_tiles:
        tiles = lean.LeanTiles(*(int(x) for x in args.lean_tiles.split(",")))
        lean.tile_sizes = lambda *a, **k: tiles
    n, hdim, v = (int(x) for x in args.shape.split("x"))
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, hdim, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, hdim, device=dev, generator=g) / math.sqrt(hdim) * 2).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    adv, mask = torch.randn(8, device=dev, generator=g), torch.ones(8, n // 8, device=dev)  # grpo: 8 sequences
    paths = {
        "ce": lambda: torch.autograd.grad(linear_cross_entropy(h, w, y), (h, w)),
        "ce_lean": lambda: torch.autograd.grad(linear_cross_entropy(h, w, y, memory_mode="lean"), (h, w)),
        "logprobs_lean": lambda: torch.autograd.grad(
            -linear_logprobs(h, w, y, memory_mode="lean").logprobs.mean(), (h, w)),
        "logprobs": lambda: torch.autograd.grad(-linear_logprobs(h, w, y).logprobs.mean(), (h, w)),
        "fwd": lambda: torch.no_grad()(lambda: linear_logprobs(h, w, y).logprobs)(),
        "grpo": lambda: torch.autograd.grad(
            linear_grpo_loss(h.view(8, -1, hdim), w, y.view(8, -1), adv, mask, GRPOConfig())[0], (h, w)),
    }
    unknown = [name for name in args.paths.split(",") if name not in paths]
    if unknown:
        p.error(f"unknown --paths {unknown}: choose from {sorted(paths)}")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU]
    for name in args.paths.split(","):
        fn = paths[name]
        # a signature's first call, the one that records its route, and the route's first, which
        # launches its own kernel variants (the label checks in the launch): compiled there, once
        for _ in range(3):
            fn()
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(args.reps):
                sync()  # each call starts on an idle GPU, as in tools/benchmark.py
                with torch.profiler.record_function("profiled_call"):
                    fn()
            sync()
            wall = (time.perf_counter() - t0) * 1e3 / args.reps
        if args.gaps:
            print_gaps(name, prof, args.reps)
        if cuda:
            kernels = {}
            for evt in prof.key_averages():
                t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
                # (the "profiled_call" annotation has a GPU-side span too: the whole call, not a kernel)
                if t and evt.device_type.name == "CUDA" and evt.key != "profiled_call":
                    kernels[evt.key] = t / 1e3 / args.reps
            busy = sum(kernels.values())
            print(f"\n== {name}: {wall:.2f} ms per call, GPU kernels {busy:.2f} ms ({100 * busy / wall:.0f} % busy)")
        else:  # the ops themselves are the work; "profiled_call" (the whole call) is not an op
            kernels = {e.key: e.self_cpu_time_total / 1e3 / args.reps for e in prof.key_averages()
                       if e.self_cpu_time_total > 0 and e.key != "profiled_call"}
            busy = sum(kernels.values())
            print(f"\n== {name}: {wall:.2f} ms per call, CPU ops {busy:.2f} ms (self time)")
        for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {ms:8.3f} ms  {key[:110]}")
        if args.cpu and cuda:
            host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                          key=lambda e: -e.self_cpu_time_total)[:14]
            print(f"  host: {sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / args.reps:.2f} ms per call")
            for e in host:
                print(f"  {e.self_cpu_time_total / 1e3 / args.reps:8.3f} ms host  x{e.count // args.reps:<5d} {e.key[:90]}")


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def print_gaps(name, prof, reps):
    """Idle GPU time inside the profiled calls, split into: before the call's first kernel (host
    work at the start), after a host sync (the queue drained: the GPU waits for the next launch),
    and the rest (the host launching slower than the GPU runs). Times are under the profiler, which
    slows the host: compare variants, not absolute numbers."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    calls = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "profiled_call" and "dur" in e)
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e)
    syncs = sorted(e["ts"] + e["dur"] for e in events
                   if e.get("cat") == "cuda_runtime" and e.get("name", "").startswith(_SYNCS) and "dur" in e)
    total = at_start = after_sync = 0.0
    num_kernels = num_syncs = 0
    for c0, c1 in calls:
        inside = [(max(a, c0), min(b, c1)) for a, b in kernels if b > c0 and a < c1]
        num_kernels += len(inside)
        call_syncs = [t for t in syncs if c0 <= t <= c1]
        num_syncs += len(call_syncs)
        cursor = c0
        for k, (a, b) in enumerate(inside + [(c1, c1)]):
            if a > cursor:
                gap = a - cursor
                total += gap
                if k == 0:
                    at_start += gap
                elif any(cursor <= t <= a for t in call_syncs):
                    after_sync += gap
            cursor = max(cursor, b)
    per = 1e3 * reps
    if calls:  # the largest gaps of the last call: where in the call, and the host op that ended each
        c0, c1 = calls[-1]
        inside = [(max(a, c0), min(b, c1)) for a, b in kernels if b > c0 and a < c1]
        ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e
                     and c0 <= e["ts"] <= c1 and e.get("name") != "profiled_call")
        gaps, cursor = [], c0
        for a, b in inside:
            if a > cursor:
                gaps.append((a - cursor, cursor - c0, a))
            cursor = max(cursor, b)
        for gap, at, until in sorted(gaps, reverse=True)[:8]:
            launching = [op for op in ops if op[0] <= until and op[1] >= until - 1]
            print(f"    gap {gap / 1e3:6.3f} ms at {at / 1e3:7.3f} ms; host then in: "
                  f"{', '.join(op[2][:40] for op in launching[:4])}")
    print(f"  gaps {name}: idle {total / per:.2f} ms per call = at start {at_start / per:.2f} + after "
          f"{num_syncs / reps:.0f} host syncs {after_sync / per:.2f} + launch-bound "
          f"{(total - at_start - after_sync) / per:.2f}; {num_kernels / reps:.0f} kernels per call")


if __name__ == "__main__":
    main()
