#!/usr/bin/env python3
"""Where the time of one call goes: torch.profiler over a few calls of the op's paths, CUDA kernel
time by kernel name, and the GPU's busy time against the wall time (gaps = launch / host overhead).

    python tools/profile_op.py [--shape 8192x4096x128256] [--paths ce,logprobs,ce_lean,fwd]
    python tools/profile_op.py --paths ce_lean --lean-tiles 1152,16384,8192,4096   # try tile sizes
"""

import argparse
import math
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402
from megatron_fused_ce.ops import lean  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x4096x128256")
    p.add_argument("--paths", default="ce,logprobs,ce_lean,fwd")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="also the host-side ops by self CPU time")
    p.add_argument("--lean-tiles", help="rows_a,cols_a,rows_b,cols_b: lean mode's tiles instead of tile_sizes()")
    args = p.parse_args()
    if args.lean_tiles:
        tiles = lean.LeanTiles(*(int(x) for x in args.lean_tiles.split(",")))
        lean.tile_sizes = lambda *a, **k: tiles
    n, hdim, v = (int(x) for x in args.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hdim, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, hdim, device="cuda", generator=g) / math.sqrt(hdim) * 2).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    paths = {
        "ce": lambda: torch.autograd.grad(linear_cross_entropy(h, w, y), (h, w)),
        "ce_lean": lambda: torch.autograd.grad(linear_cross_entropy(h, w, y, memory_mode="lean"), (h, w)),
        "logprobs_lean": lambda: torch.autograd.grad(
            -linear_logprobs(h, w, y, memory_mode="lean").logprobs.mean(), (h, w)),
        "logprobs": lambda: torch.autograd.grad(-linear_logprobs(h, w, y).logprobs.mean(), (h, w)),
        "fwd": lambda: torch.no_grad()(lambda: linear_logprobs(h, w, y).logprobs)(),
    }
    for name in args.paths.split(","):
        fn = paths[name]
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            start.record()
            for _ in range(args.reps):
                fn()
            end.record()
            torch.cuda.synchronize()
        wall = start.elapsed_time(end) / args.reps
        kernels = {}
        for evt in prof.key_averages():
            t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if t and evt.device_type.name == "CUDA":
                kernels[evt.key] = t / 1e3 / args.reps
        busy = sum(kernels.values())
        print(f"\n== {name}: {wall:.2f} ms per call, GPU kernels {busy:.2f} ms ({100 * busy / wall:.0f} % busy)")
        for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {ms:8.3f} ms  {key[:110]}")
        if args.cpu:
            host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                          key=lambda e: -e.self_cpu_time_total)[:14]
            print(f"  host: {sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / args.reps:.2f} ms per call")
            for e in host:
                print(f"  {e.self_cpu_time_total / 1e3 / args.reps:8.3f} ms host  x{e.count // args.reps:<5d} {e.key[:90]}")


if __name__ == "__main__":
    main()
