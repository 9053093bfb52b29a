#!/usr/bin/env python3
"""Sampling-mask replay against plain log-probs: linear_logprobs(..., sampling_mask=) fwd+bwd vs
linear_logprobs(...) fwd+bwd, same inputs, same process, bf16.

    python tools/sampling_mask_bench.py                  # GPU: the three shapes x {zipf, random} x K in {50, 512}
    python tools/sampling_mask_bench.py --shapes 8192x4096x128256 --ks 50 --sets zipf
    python tools/sampling_mask_bench.py --pieces sparse   # every kept row on its gathered ids (dense: on the shard)
    python tools/sampling_mask_bench.py --breakdown      # + where each call's time goes (below)
    python tools/sampling_mask_bench.py --smoke           # CPU smoke test (one small shape)
    python tools/sampling_mask_bench.py --fidelity       # the drift table of docs/design.md §8.3 (CPU)
    python tools/sampling_mask_bench.py --graphed        # both ops replayed from CUDA graphs (GPU)
    python tools/sampling_mask_bench.py --graphed step   # ... each step (forward + backward) one graph
    python tools/sampling_mask_bench.py --main-grad      # dW added into an fp32 main_grad (Megatron's way)
    python tools/sampling_mask_bench.py --paired --steady-ms 300   # each row timed in alternation with plain
    torchrun --nproc_per_node 4 tools/sampling_mask_bench.py --tp 4 --shapes 8192x4096x32064  # V: per rank

Kept sets (K ids per token, the sampled label one of them):
  zipf    a trained model's sets overlap: every token keeps K distinct ids drawn without
          replacement with p(id) ~ 1 / (rank + 1)^1.1 over one fixed random ranking of the vocab
          (frequent tokens are in most sets, each set also reaches into the tail);
  random  K distinct ids uniformly at random per token: sets of different tokens share only
          what chance gives (the worst case for the cache: every gathered W row a miss).
Both ops run on the same random bf16 hidden states and weights (logit std 2): replay's cost does
not depend on the logits, only on the sets. Timing: CUDA events, warm-up first, median. "K / V" is
the kept share of the vocab; "route" how the rows with a set were scored (replay.PIECE_COUNTS):
"sparse" (the backend's kept-set kernels, a row at a time), "tiles" (the union tiles' GEMMs over
the columns a tile's sets name) or "dense" (GEMMs over the whole shard). "lp err" is
replay's log-probs against float64 on 64 tokens. Targets: K <= 50 at most 0.25x plain with zipf
sets, 0.40x with random ones; larger K at most 0.8x; every row at most 1x. `--pieces sparse` /
`tiles` / `dense` overrides the choice made from sizes (replay.FORCE_PIECES): run each to see
whether it was the fastest. `--general-path` sends every call through the general path, as the
first calls of a signature go (a later call runs its remembered route straight:
ops/remembered_routes.py).

`--breakdown` adds, under each row, replay's time per phase: the kept entries' layout
(replay.KeptEntries), the forward (ReplayChunks.merged_statistics) and the backward
(ReplayChunks.recompute_grads), each timed from a synchronized start to a synchronized end
(torch.cuda.synchronize), "host" the time until its Python call returned (host time close to the
phase's time: the GPU waited for the launches), "ops" the torch ops it dispatched (views left out;
one more call, counted), "rest" what the call spent outside them (argument and mask checks,
autograd); how many rows each kind scored; and once per shape the plain op's forward and backward.
The synchronizations cost some overlap: the phases add up to a little more than the row's time.

`--graphed`: both ops' forward and backward replayed from the CUDA graphs
torch.cuda.make_graphed_callables captures (a training loop's autograd between them: the host's
bookkeeping between the two graphs remains, ~150 us at 2048 tokens on an H200 host); `--graphed
step`: each step's forward and backward captured in one graph (as a whole-iteration capture
replays them: the GPU's cost alone).

`--smoke`: a CPU run of one small shape (the CI's check that the tool and the path run).

`--tp N` (under `torchrun --nproc_per_node N`, one process per GPU; NCCL, or gloo with `--device
cpu`): both ops at tensor parallelism N, `tp_group` the N ranks. V in `--shapes` is then each rank's
vocab shard: the global vocab is V x N, and "K / V" the kept share of it. The hidden states, the
labels and the kept sets (global ids, drawn as above over the global vocab) are the same draws on
every rank (one seed); each rank's weight is its own shard. A rep's time is the slowest rank's (every rank starts it
from a barrier); "lp err" compares against the float64 logits gathered from every shard. Rank 0
prints. `--breakdown` and `--fidelity` run at TP 1 only.
"""

import argparse
import collections
import gc
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_fused_ce import linear_logprobs  # noqa: E402
from megatron_fused_ce.cuda_graphs import thread_local_capture  # noqa: E402
from megatron_fused_ce.ops import remembered_routes, replay  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench.measure import add_backward_thread_option, set_backward_thread, time_paired  # noqa: E402

SHAPES = "8192x4096x128256,8192x2304x256000,16384x3584x152064"
ZIPF_EXPONENT = 1.1


def kept_sets(kind: str, n: int, vocab: int, k: int, device, generator) -> tuple:
    """(token_ids [n * k], offsets [n + 1], labels [n]) of `kind` sets (module doc), on `device`."""
    if kind == "zipf":
        rank = torch.randperm(vocab, device=device, generator=generator)  # rank of each id
        log_p = -ZIPF_EXPONENT * torch.log1p(rank.float())
    elif kind == "random":
        log_p = torch.zeros(vocab, device=device)
    else:
        raise SystemExit(f"unknown --sets {kind!r}")
    ids = []
    for start in range(0, n, 256):  # Gumbel top-k: k draws without replacement, [256, V] at a time
        rows = min(256, n - start)
        u = torch.rand(rows, vocab, device=device, generator=generator).clamp_(1e-20, 1.0)
        ids.append((log_p - torch.log(-torch.log(u))).topk(k, dim=1).indices)
    ids = torch.cat(ids)
    pick = torch.randint(0, k, (n, 1), device=device, generator=generator)
    labels = ids.gather(1, pick).squeeze(1)
    offsets = torch.arange(n + 1, device=device, dtype=torch.int64) * k
    return ids.reshape(-1), offsets, labels


def time_ms(step, warmup: int, reps: int, group=None) -> float:
    """Median over `reps` of a rep's time; with a TP `group`, of the slowest rank's time of each rep."""
    for _ in range(warmup):
        step()
    return statistics.median(_slowest(step.device, [_rep_ms(step, group) for _ in range(reps)], group))


def time_paired_ms(step, plain_step, warmup: int, reps: int, group=None, steady_ms: float = 0.0) -> tuple:
    """(replay ms, plain ms): medians of reps timed in alternation, plain, replay, plain, replay, ...
    (`--paired`; bench/measure.time_paired), so that both see the GPU in the same state: under a
    sustained load an H200's GEMMs slow down (docs/bench/rl_grid_paired_h200.md), and plain
    log-probs are GEMMs where replay is mostly not. `steady_ms`: first run both in turn that long
    (with a TP `group`, the same number of times on every rank: the steps hold collectives)."""
    def agree(count: int) -> int:
        most = torch.tensor([count], dtype=torch.int64, device=step.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return int(most.item())

    _, times, _, plain_times = time_paired(step, plain_step, warmup, reps, reps, 0.0, steady_ms,
                                           timed_call=lambda fn: _rep_ms(fn, group),
                                           agree_count=agree if group is not None else None)
    return (statistics.median(_slowest(step.device, times, group)),
            statistics.median(_slowest(step.device, plain_times, group)))


def _rep_ms(step, group=None) -> float:
    """One call's time from an idle device: CUDA events, the host's clock off CUDA."""
    _sync(step.device)
    if group is not None:
        # every rank starts the rep together: no rank's time includes waiting for a late peer
        dist.barrier(group=group)
        _sync(step.device)
    if torch.cuda.is_available() and step.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def _slowest(device, times: list, group=None) -> list:
    """With a TP `group`, each rep's time on its slowest rank; else the times."""
    if group is None:
        return times
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.tolist()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# replay.py's phases: (class, method)
PHASES = {"entries": (replay.KeptEntries, "__init__"), "forward": (replay.ReplayChunks, "merged_statistics"),
          "backward": (replay.ReplayChunks, "recompute_grads")}
VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "expand", "alias",
            "as_strided", "detach", "lift_fresh", "permute", "split", "unbind", "reshape"}


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops dispatched (views left out) by phase: `phase[0]` names the current one."""

    def __init__(self, phase):
        super().__init__()
        self.phase, self.counts = phase, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEW_OPS:
            self.counts[self.phase[0]] += 1
        return func(*args, **(kwargs or {}))


def phase_breakdown(step, device, reps: int) -> dict:
    """{phase: (ms synchronized, host ms, ops)} of replay's phases in `step` (ms: means per call),
    plus "rest" (the call outside them: the median call's time less the phases') and "total"."""
    wall, host, phase = collections.defaultdict(list), collections.defaultdict(list), ["rest"]
    originals = {name: getattr(owner, fn) for name, (owner, fn) in PHASES.items()}

    def timed(name, fn):
        def wrapped(*args, **kwargs):
            _sync(device)
            before, phase[0] = phase[0], name
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                _sync(device)
                phase[0] = before
            host[name].append((t1 - t0) * 1e3)
            wall[name].append((time.perf_counter() - t0) * 1e3)
            return out
        return wrapped

    for name, (owner, fn) in PHASES.items():
        setattr(owner, fn, timed(name, originals[name]))
    try:
        step()  # warm
        wall.clear(), host.clear()
        totals = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            totals.append((time.perf_counter() - t0) * 1e3)
        per_call = {name: sum(times) / reps for name, times in wall.items()}  # (a phase may run twice a call)
        host_per_call = {name: sum(times) / reps for name, times in host.items()}
        counter = _OpCounter(phase)
        with counter:
            step()
    finally:
        for name, (owner, fn) in PHASES.items():
            setattr(owner, fn, originals[name])
    out = {name: (per_call[name], host_per_call[name], counter.counts[name]) for name in PHASES if name in per_call}
    total = statistics.median(totals)
    out["rest"] = (total - sum(per_call.values()), None, counter.counts["rest"])
    out["total"] = (total, None, sum(counter.counts.values()))
    return out


def format_breakdown(parts: dict) -> str:
    cells = []
    for name, (ms, host_ms, ops) in parts.items():
        extra = ([f"host {host_ms:.2f}"] if host_ms is not None else []) + [f"{ops} ops"]
        cells.append(f"{name} {ms:.2f} ({', '.join(extra)})")
    return "    breakdown ms: " + "; ".join(cells)


def plain_breakdown(h, w, y, chunk, device, reps: int) -> str:
    """The plain op's forward alone and forward + backward, synchronized."""
    def forward():
        return linear_logprobs(h, w, y, chunk_size=chunk).logprobs

    step = make_step(h, w, y, chunk)
    times = collections.defaultdict(list)
    for name, fn in (("forward", forward), ("forward+backward", step)):
        fn()
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            out = fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
            del out
    fwd, total = statistics.median(times["forward"]), statistics.median(times["forward+backward"])
    return f"    plain breakdown ms: forward {fwd:.2f}; backward {total - fwd:.2f}; total {total:.2f}"


def make_step(h, w, y, chunk, mask=None, group=None, graphed=False, main_grad=False):
    """One forward + backward of the op (replay where `mask` is given); with `graphed`, replayed
    from CUDA graphs captured once (torch.cuda.make_graphed_callables, the mask's tensors among the
    captured inputs); with `main_grad`, dW added into an fp32 `w.main_grad` (Megatron's
    gradient-accumulation fusion) instead of returned."""
    def loss_of(h, w, y, *mask):
        lp = linear_logprobs(h, w, y, chunk_size=chunk, sampling_mask=mask or None, tp_group=group,
                             accumulate_into_main_grad=main_grad).logprobs
        return -lp.sum() / lp.numel()

    if graphed or main_grad:  # leaves of its own: no autograd node of an earlier step's graph on
        # them, and the main_grad this step adds to on its own weight, not on the caller's
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    if main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    inputs = (h, w, y) + tuple(mask or ())
    if graphed == "step":
        step = step_graph(lambda: torch.autograd.grad(loss_of(*inputs), (h, w), allow_unused=main_grad), h.device)
        step.weight = w
        return step
    loss = loss_of
    if graphed:
        # an earlier row's graphs destroyed now, not by a garbage collection during this capture
        # (a graph's destruction is not permitted while a stream captures: the capture fails); the
        # thread-local capture mode (megatron_fused_ce/cuda_graphs.py), so that no other thread's
        # CUDA call (NCCL's watchdog, autograd's device thread) can invalidate it
        gc.collect()
        with thread_local_capture():
            loss = torch.cuda.make_graphed_callables(loss_of, inputs)

    def step():
        return torch.autograd.grad(loss(*inputs), (h, w), allow_unused=main_grad)
    step.device, step.weight = h.device, w  # (the weight whose main_grad the steps add to)
    return step


def step_graph(body, device):
    """`body` (a forward + backward) captured in one CUDA graph after warm-up calls on a side stream
    (the routes remembered, the kernels compiled); the step replays it."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    gc.collect()  # (an earlier row's graphs destroyed now, not during this capture: make_step)
    graph = torch.cuda.CUDAGraph()
    with thread_local_capture(), torch.cuda.graph(graph):
        body()

    def step():
        graph.replay()
    step.device, step.graph = device, graph
    return step


def replay_error(h, w, y, mask, rows=64, group=None) -> float:
    """Replay's log-probs of the first `rows` tokens against float64 over their kept sets (with a
    TP `group`: `w` this rank's shard, the logits gathered from every shard in rank order)."""
    ids, offsets = mask
    with torch.no_grad():
        sub_offsets = offsets[:rows + 1]
        sub = (ids[:int(sub_offsets[-1])], sub_offsets)
        got = linear_logprobs(h[:rows], w, y[:rows], sampling_mask=sub, tp_group=group).logprobs.double()
        z = h[:rows].double() @ w.double().t()
        if group is not None:
            shards = [torch.empty_like(z) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, z, group=group)
            z = torch.cat(shards, dim=1)
        k = int(offsets[1] - offsets[0])
        kept = ids[:rows * k].view(rows, k)
        want = z.gather(1, y[:rows].unsqueeze(1)).squeeze(1) - torch.logsumexp(z.gather(1, kept), dim=1)
        return ((got - want).norm() / want.norm()).item()


def target_ratio(kind: str, k: int) -> float:
    """replay / plain to reach (module doc)."""
    if k <= 50:
        return 0.25 if kind == "zipf" else 0.40
    return 0.8


def tp_setup(tp: int, device: torch.device):
    """(device, group, rank): at TP 1 the device, no group; else this torchrun rank's device and the
    group of all `tp` ranks (NCCL on CUDA, gloo on the CPU)."""
    if tp == 1:
        return device, None, 0
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != tp:
        raise SystemExit(f"--tp {tp}: launch with torchrun --nproc_per_node {tp} (WORLD_SIZE is {world})")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device, dist.group.WORLD, dist.get_rank()


def benchmark(args):
    device, group, rank = tp_setup(args.tp, torch.device(args.device))
    say = print if rank == 0 else (lambda *a, **k: None)
    replay.FORCE_PIECES = None if args.pieces == "auto" else args.pieces
    remembered_routes.ENABLED = not args.general_path
    say(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"chunk_size {args.chunk_size or 'auto'}, pieces {args.pieces}, tp {args.tp}"
        + (f", CUDA graphs ({args.graphed})" if args.graphed else "")
        + (", backward on the calling thread" if args.backward_thread == "calling" else "")
        + (", dW into main_grad" if args.main_grad else ""))
    say("| shape NxHxV | sets | K | K / V | route | plain ms | replay ms | replay / plain | target | lp err |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    failed = 0
    for shape in args.shapes.split(","):
        n, hdim, vocab = (int(x) for x in shape.split("x"))
        full_vocab = vocab * args.tp  # V is the shard
        # the hidden states, labels and kept sets from one seed on every rank (the same draws: Zipf
        # sets differ in size from draw to draw, so a broadcast could not carry them); each rank's
        # weight its own shard, seeded by rank
        g = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(n, hdim, device=device, generator=g).bfloat16().requires_grad_()
        own = torch.Generator(device=device).manual_seed(1 + rank)
        w = (torch.randn(vocab, hdim, device=device, generator=own) * (2 / math.sqrt(hdim))).bfloat16().requires_grad_()
        y_plain = torch.randint(0, full_vocab, (n,), device=device, generator=g)
        plain_step = make_step(h, w, y_plain, args.chunk_size, group=group, graphed=args.graphed,
                               main_grad=args.main_grad)
        # (--paired: each row times plain between its own calls instead)
        plain_ms = None if args.paired else time_ms(plain_step, args.warmup, args.reps, group)
        if args.breakdown:
            say(plain_breakdown(h, w, y_plain, args.chunk_size, device, args.reps), flush=True)
        for kind in args.sets.split(","):
            for k in (int(x) for x in args.ks.split(",")):
                ids, offsets, labels = kept_sets(kind, n, full_vocab, k, device, g)
                mask = (ids, offsets)
                before = dict(replay.PIECE_COUNTS)
                make_step(h, w, labels, args.chunk_size, mask, group)()  # one eager call: which kind scored the rows
                counts = {key: replay.PIECE_COUNTS[key] - before.get(key, 0) for key in replay.PIECE_COUNTS}
                step = make_step(h, w, labels, args.chunk_size, mask, group, args.graphed, args.main_grad)
                route = max(("sparse", "tiles", "dense"), key=lambda name: counts.get(name + "_rows", 0))
                if args.paired:  # this row's plain time: the plain calls timed between its own
                    replay_ms, plain_ms = time_paired_ms(step, plain_step, args.warmup, args.reps, group,
                                                         args.steady_ms)
                else:
                    replay_ms = time_ms(step, args.warmup, args.reps, group)
                ratio = replay_ms / plain_ms
                target = target_ratio(kind, k)
                met = ratio <= target
                failed += not met
                err = replay_error(h, w, labels, mask, group=group)
                say(f"| {shape} | {kind} | {k} | {k / full_vocab:.4f} | {route} | {plain_ms:.2f} | "
                      f"{replay_ms:.2f} | {ratio:.3f} | <= {target:g}x {'ok' if met else 'MISSED'} | {err:.1e} |",
                      flush=True)
                if args.breakdown:
                    say(format_breakdown(phase_breakdown(step, device, args.reps)), flush=True)
                    say(f"    kept rows: {counts.get('sparse_rows', 0)} sparse, {counts.get('tiles_rows', 0)} tiles, "
                        f"{counts.get('dense_rows', 0)} dense, "
                          f"{counts.get('plain_rows', 0)} plain (empty set)", flush=True)
                del ids, offsets, labels, mask, step
        del plain_step
    if group is not None:
        if device.type == "cuda":  # the CUDA graphs holding NCCL collectives go before their communicator
            gc.collect()
            torch.cuda.synchronize()
        dist.destroy_process_group()
    return failed if rank == 0 else None


def _float64_reference():
    """tests/sampling_reference.py: the float64 filters and kept-set log-probs, from the definition."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import sampling_reference

    return sampling_reference


def drift_case(filters: dict, engine_noise: float, seed: int, n=4096, hidden=64, vocab=2000):
    """Trainer logits: fp32 from fp32 weights. Engine logits: the same model run in bf16, plus
    Gaussian noise of std `engine_noise` (another kernel, another TP layout). The engine samples
    from its own filtered distribution: (h, w, sampled tokens, the kept sets it used as a mask,
    as [n, vocab] bool)."""
    sref = _float64_reference()
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (3.0 / hidden**0.5)  # logits of std ~3: peaked rows
    engine_z = (h.bfloat16() @ w.bfloat16().t()).float() + engine_noise * torch.randn(n, vocab, generator=g)
    keep = sref.kept_set(engine_z.double(), **filters)
    q = torch.softmax(torch.where(keep, engine_z.double(), float("-inf")), dim=-1)
    y = torch.multinomial(q, 1, generator=g).squeeze(1)
    _, cols = keep.nonzero(as_tuple=True)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), keep.sum(1).cumsum(0)])
    return h, w, y, replay.SamplingMask(cols, offsets), keep


def drift_table_row(filters: dict, engine_noise: float, seed: int = 0, **sizes) -> dict:
    """Recomputing the engine's filters on the trainer's logits vs replaying its kept sets:
    sampled tokens the recomputed filter excludes (-inf), tokens whose recomputed set differs
    from the engine's, the largest |p_recomputed / p_replayed - 1| over the tokens both keep (the
    error of an importance ratio), and replay's exclusions and largest error against float64
    log-probs over the engine's sets on the trainer's logits."""
    sref = _float64_reference()
    h, w, y, mask, keep = drift_case(filters, engine_noise, seed, **sizes)
    recomputed = linear_logprobs(h, w, y, **filters).logprobs
    replayed = linear_logprobs(h, w, y, sampling_mask=mask).logprobs
    z = h.double() @ w.double().t()
    ref, _ = sref.processed_stats(z, y, keep)
    trainer_keep = sref.kept_set(z, **filters)
    both = torch.isfinite(recomputed)
    ratio_error = (recomputed[both].double() - replayed[both].double()).exp().sub(1).abs().max().item()
    return dict(tokens=y.numel(), excluded=int((~both).sum()),
                sets_differ=int((trainer_keep != keep).any(1).sum()), ratio_error=ratio_error,
                replay_excluded=int((~torch.isfinite(replayed)).sum()),
                replay_error=(replayed.double() - ref).abs().max().item())


def fidelity():
    """The drift table: engine logits = the same model in bf16 (+ noise), trainer in fp32."""
    print("| engine vs trainer logits | filters | tokens | recompute: sampled tokens excluded | recompute: "
          "sets that differ | recompute: max abs(ratio - 1), kept tokens | replay: excluded | "
          "replay: max err vs fp64 |")
    print("|---|---|---|---|---|---|---|---|")
    for filters, noise in ((dict(top_p=0.9), 0.0), (dict(top_k=50, top_p=0.95), 0.0),
                           (dict(top_p=0.9), 0.02), (dict(top_k=50, top_p=0.95), 0.02),
                           (dict(min_p=0.05), 0.02)):
        row = drift_table_row(filters, noise)
        name = ", ".join(f"{k}={v}" for k, v in filters.items())
        drift = "bf16 rounding" + (f" + N(0, {noise}^2)" if noise else "")
        print(f"| {drift} | {name} | {row['tokens']} | {row['excluded']} ({row['excluded'] / row['tokens']:.2%}) | "
              f"{row['sets_differ']} ({row['sets_differ'] / row['tokens']:.1%}) | {row['ratio_error']:.2e} | "
              f"{row['replay_excluded']} | {row['replay_error']:.1e} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES,
                   help="NxHxV,...: tokens x hidden x vocab; with --tp, V is each rank's shard (global vocab V x TP)")
    p.add_argument("--sets", default="zipf,random")
    p.add_argument("--ks", default="50,512")
    p.add_argument("--chunk-size", type=int, default=None, help="default: the op's automatic chunk")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--pieces", choices=("auto", "sparse", "tiles", "dense"), default="auto",
                   help="auto: chosen from sizes; sparse / tiles / dense: every row with a set so")
    p.add_argument("--general-path", action="store_true",
                   help="every call through the general path (no remembered route run straight: "
                        "ops/remembered_routes.py), for the routes' share of an eager call")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--breakdown", action="store_true",
                   help="under each row, replay's time per phase (entries, forward, backward; synchronized) and "
                        "its ops, and the plain op's forward / backward")
    p.add_argument("--graphed", nargs="?", const="callables", choices=("callables", "step"),
                   help="both ops replayed from CUDA graphs: make_graphed_callables' forward and backward graphs "
                        "(autograd between them), or with 'step' each forward + backward one graph (the GPU's cost "
                        "alone)")
    p.add_argument("--main-grad", action="store_true",
                   help="both ops add dW into an fp32 weight.main_grad (accumulate_into_main_grad, Megatron's "
                        "gradient-accumulation fusion) instead of returning it")
    p.add_argument("--paired", action="store_true",
                   help="time each replay row in alternation with plain log-probs (plain, replay, plain, ...): "
                        "the row's plain ms are the plain calls timed between its own")
    p.add_argument("--steady-ms", type=float, default=0.0,
                   help="with --paired: run both in turn this long before timing them")
    p.add_argument("--fidelity", action="store_true", help="print the engine/trainer drift table instead")
    p.add_argument("--smoke", action="store_true", help="a CPU run of one small shape, both kinds of rows")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism: launch with torchrun --nproc_per_node TP (one process per GPU; "
                        "gloo with --device cpu); V in --shapes is then the per-rank shard")
    add_backward_thread_option(p)
    args = p.parse_args(argv)
    set_backward_thread(args.backward_thread)
    if args.tp < 1:
        p.error("--tp must be at least 1")
    if args.tp > 1 and (args.breakdown or args.fidelity):
        p.error("--breakdown and --fidelity run at --tp 1 only")
    if args.graphed and (args.breakdown or args.device != "cuda"):
        p.error("--graphed needs --device cuda and times whole calls (no --breakdown)")
    if args.smoke:
        args.device, args.shapes, args.ks, args.reps, args.warmup = "cpu", "256x32x3000", "4,50", 1, 1
        args.chunk_size = args.chunk_size or 128
    if args.fidelity:
        fidelity()
        return 0
    failed = benchmark(args)
    if failed is not None:  # rank 0 reports
        print(f"{failed} row(s) missed their target" if failed else "every row met its target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
