#!/usr/bin/env python3
"""What a call costs where the host sets the time (RL row counts): per method of tools/benchmark.py
(its steps and inputs), the time per call back to back (a training loop's view: the host queues
the next call while the GPU runs), the time of one call from an idle GPU (the benchmark's view,
CUDA events), and the host's own time per call (until the Python call returns). Medians over
rounds; one process, one shape.

    python tools/host_time.py --shape 2048x4096x19008
    python tools/host_time.py --device cpu --shape 64x32x100 --rounds 2 --calls 3   # smoke test
    torchrun --nproc_per_node 2 tools/host_time.py --tp 2 --shape 2048x4096x19008   # V per rank, NCCL

`--kernels` adds the CUDA kernels of one call (torch.profiler; copies and memsets aside, the
collectives among them). `--gc N` adds what a method leaves to Python's cyclic collector: the
objects a call leaves in reference cycles, and over N more calls (the collector on, as in a trainer)
the collections of each generation and the host time they took per 1000 calls, with the mean host
time a call (where collections show: medians hide them). `--general-path` adds each method with
every call through the general path (ops/remembered_routes.py off: no route run straight), in rounds
alternating with the default in the same process. `--alternate` times the methods themselves that
way (a round of each in turn, the order reversed every other round): an A/B of methods in one
process, which a GPU's clock and a host's state drift across less. For an A/B of two trees,
tools/host_ab.py runs both in one process, their calls alternating (hosts drift between processes
by more than most changes of host time).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.measure import add_backward_thread_option, make_inputs, set_backward_thread  # noqa: E402
from bench.methods import MAKERS  # noqa: E402
from megatron_fused_ce.ops import agreement, remembered_routes  # noqa: E402
from megatron_fused_ce.testing.gc_cycles import left_in_cycles  # noqa: E402

IMPLS = "floor_fwd,floor,ours_fwd,ours_ce,ours_logprobs,ours_grpo"
TP_IMPLS = "ours_fwd,ours_ce,ours_logprobs,ours_grpo"  # (tools/bench/tp.py's makers)


def measure(step, device, rounds, calls):
    """(µs per call back to back, µs of one call from an idle GPU, µs of host per call): medians."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):  # the signature's first call (agreement, compilation) and warm-up
        step()
    sync()
    back_to_back, from_idle, host = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        back_to_back.append((time.perf_counter() - t0) / calls * 1e6)
        for _ in range(calls):
            sync()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            if cuda:
                end.record()
                end.synchronize()
                from_idle.append(start.elapsed_time(end) * 1e3)
            else:
                from_idle.append((t1 - t0) * 1e6)
            host.append((t1 - t0) * 1e6)
    return statistics.median(back_to_back), statistics.median(from_idle), statistics.median(host)


def kernels_per_call(step) -> int:
    """CUDA kernels of one call (after measure's warm-up), copies and memsets aside."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def collector_cost(step, device, calls: int) -> dict:
    """What `step` leaves to the cyclic collector (after measure's warm-up): objects in reference
    cycles a call (20 calls under gc.DEBUG_SAVEALL), then over `calls` calls the collections of
    each generation and their host ms per 1000 calls, and the mean µs of host a call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    left = len(left_in_cycles(step, 20)) / 20
    collections, started = [], []

    def note(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        else:
            collections.append((info["generation"], time.perf_counter() - started.pop()))

    sync()
    gc.callbacks.append(note)
    host = 0.0
    try:
        for _ in range(calls):
            sync()
            t0 = time.perf_counter()
            step()
            host += time.perf_counter() - t0
    finally:
        gc.callbacks.remove(note)
    per_1000 = 1000 / calls
    return dict(cycle_objects_per_call=left,
                collections_per_1000=[sum(1 for g, _ in collections if g == gen) * per_1000 for gen in range(3)],
                collection_ms_per_1000=sum(t for _, t in collections) * 1e3 * per_1000,
                mean_host_us=host / calls * 1e6)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="2048x4096x19008", help="N x H x V (per rank)")
    p.add_argument("--impls", help=f"the benchmark's methods (tools/benchmark.py --impls; default {IMPLS}, "
                                   f"with --tp {TP_IMPLS})")
    p.add_argument("--tp", type=int, default=1, help="TP size: torchrun --nproc_per_node N, one GPU each")
    p.add_argument("--kernels", action="store_true", help="also the CUDA kernels of one call")
    p.add_argument("--general-path", action="store_true",
                   help="also every call through the general path (no remembered route), rounds alternating")
    p.add_argument("--gc", type=int, default=0, metavar="N",
                   help="also what the calls leave to Python's cyclic collector, over N more calls")
    p.add_argument("--alternate", action="store_true",
                   help="time the methods in alternating rounds (one round of each in turn, the order reversed "
                        "every other round), not one method's rounds after another's: an A/B of methods")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="calls per round")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the figures here")
    add_backward_thread_option(p)
    args = p.parse_args(argv)
    set_backward_thread(args.backward_thread)
    n, hdim, v = (int(x) for x in args.shape.split("x"))
    if args.tp > 1:  # every rank runs the same steps; the collectives keep them in step
        from bench.tp import TP_MAKERS, tp_context, tp_inputs

        ctx = tp_context(args.tp, args.device)
        device, rank = ctx.device, ctx.rank
        h, w, y = tp_inputs(n, hdim, v, ctx)
        make = lambda name: TP_MAKERS[name](h, w, y, None, ctx)  # noqa: E731
    else:
        device, rank = torch.device(args.device), 0
        h, w, y = make_inputs(n, hdim, v, device)
        make = lambda name: MAKERS[name](h, w, y, None)  # noqa: E731
    say = print if rank == 0 else (lambda *a, **k: None)
    results = {}
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    say(f"{args.shape}{f' per rank, TP = {args.tp}' if args.tp > 1 else ''} on {where}, µs a call (medians)"
        + (", backward on the calling thread" if args.backward_thread == "calling" else ""))
    say(f"{'method':24s} {'back to back':>13s} {'from idle':>10s} {'host':>8s}" + ("  kernels" if args.kernels else ""))
    names = (args.impls or (TP_IMPLS if args.tp > 1 else IMPLS)).split(",")
    settings = (True, False) if args.general_path else (True,)
    # what is timed in alternating rounds: every method and setting (--alternate), else each method's settings
    groups = ([[(name, routes) for name in names for routes in settings]] if args.alternate
              else [[(name, routes) for routes in settings] for name in names])
    for group in groups:
        rounds = {key: [] for key in group}
        alternating = len(group) > 1
        for r in range(args.rounds if alternating else 1):
            for name, routes in group if r % 2 == 0 else group[::-1]:  # (each from its signature's first call on)
                remembered_routes.ENABLED = routes
                agreement.forget_signatures()
                step = make(name)
                rounds[name, routes].append(measure(step, device, 1 if alternating else args.rounds, args.calls))
        remembered_routes.ENABLED = True
        report(group, rounds, results, args, make, device, say)
    if args.tp > 1:
        ctx.dist.destroy_process_group()
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": args.device, "backward_thread": args.backward_thread,
                       "alternate": args.alternate, "methods": results}, f, indent=1)


def with_routes(routes: bool, fn):
    """fn() with the remembered routes on or off (then on again)."""
    remembered_routes.ENABLED = routes
    try:
        return fn()
    finally:
        remembered_routes.ENABLED = True


def warmed_step(make, name):
    """A fresh step of the method `name` past its signature's first call, the one that records its
    route and the route's first (which compiles the route's own kernel variants)."""
    agreement.forget_signatures()
    step = make(name)
    for _ in range(3):
        step()
    return step


def report(group, rounds, results, args, make, device, say):
    """The medians of a group's rounds, each method's extras (--kernels, --gc), one line each."""
    for name, routes in group:
        label = name if routes else f"{name} (general)"
        results[label] = dict(zip(("back_to_back_us", "from_idle_us", "host_us"),
                                  (statistics.median(r[k] for r in rounds[name, routes]) for k in range(3))))
        if args.kernels and device.type == "cuda":
            results[label]["kernels"] = with_routes(routes, lambda: kernels_per_call(warmed_step(make, name)))
        if args.gc:
            results[label]["collector"] = with_routes(
                routes, lambda: collector_cost(warmed_step(make, name), device, args.gc))
        r = results[label]
        say(f"{label:24s} {r['back_to_back_us']:13.0f} {r['from_idle_us']:10.0f} {r['host_us']:8.0f}"
            + (f"  {r['kernels']:7d}" if "kernels" in r else ""), flush=True)
        if "collector" in r:
            c = r["collector"]
            say(f"{'':24s} {c['cycle_objects_per_call']:.0f} objects left in reference cycles a call; per 1000 "
                f"calls {'/'.join(f'{x:.0f}' for x in c['collections_per_1000'])} collections of generation "
                f"0/1/2 taking {c['collection_ms_per_1000']:.1f} ms; mean host {c['mean_host_us']:.0f} µs a call",
                flush=True)


if __name__ == "__main__":
    main()
