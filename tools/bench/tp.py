"""Tensor parallel (one process per GPU, NCCL): our ops and the TP peers on a vocab shard each,
timed per GPU (max over ranks), errors against an fp32 reference with explicit collectives, and
scaling against TP=1. Entry point: tp_main(args), from `tools/benchmark.py --tp N`."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

from megatron_fused_ce import linear_cross_entropy, linear_logprobs

from . import measure
from .measure import GIB, REPO, Skip, _grads, free, log, make_floor, make_inputs, measure_memory, rel_err, sync
# (graphed rows: forward + backward captured once with make_graphed_callables, the NCCL collectives
# inside the graphs; their memory lives in the graphs' pool, taken at capture: not measured per call)
from .methods import (DEFAULT_IMPLS, QUICK_SHAPES_CPU, QUICK_SHAPES_GPU, SAMPLERS, SHAPES, _graphed, _graphed_step,
                      _impl, _sampled_logprobs_loss, make_ours_fwd, make_ours_grpo, parse_chunks, parse_shapes)
from .report import environment, tp_markdown, write_json
from .run import _search_note, add_x_plain, resolved_auto_chunk, run_one

# shapes (N tokens, H, V); every rank holds the full hidden [N, H] (no sequence parallel) and a V/TP
# vocab shard of the weight. Every method's dX is the full (TP-summed) input gradient, so the
# Megatron rows all-reduce it after backward, as ColumnParallelLinear's backward does.
TP_IMPLS = ("floor,ours_ce,ours_ce_lean,ours_logprobs,ours_logprobs_lean,megatron,megatron_fused,liger_tp,"
            "ours_top_p,ours_top_k,ours_topk20")
# measured on rank 0 alone for the scaling table
TP1_IMPLS = ("floor", "ours_ce", "ours_ce_lean", "ours_logprobs", "ours_logprobs_lean", "ours_ce_graphed",
             "ours_logprobs_graphed")
SCALED = TP1_IMPLS
TP_CHUNKED = ("ours_ce", "ours_ce_per_token", "ours_logprobs", "ours_ce_graphed", "ours_logprobs_graphed")


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


def tp_make_ours_ce_per_token(h, w, y, chunk, ctx):
    """Megatron's output layer with the fused loss: per-token losses, then their mean."""
    n = h.shape[0]
    return lambda: _grads(linear_cross_entropy(h, w, y, tp_group=ctx.group, chunk_size=chunk, impl=_impl(),
                                               reduction="none").sum() / n, h, w)


def tp_make_ours_logprobs(h, w, y, chunk, ctx, memory_mode="fast"):
    n = h.shape[0]
    return lambda: _grads(-linear_logprobs(h, w, y, tp_group=ctx.group, chunk_size=chunk,
                                           impl=_impl(), memory_mode=memory_mode).logprobs.sum() / n, h, w)


def tp_make_ours_fwd(h, w, y, chunk, ctx):
    return make_ours_fwd(h, w, y, chunk, tp_group=ctx.group)


def tp_make_ours_grpo(h, w, y, chunk, ctx):
    return make_ours_grpo(h, w, y, chunk, tp_group=ctx.group)


def tp_make_ours_ce_graphed(h, w, y, chunk, ctx):
    graphed = _graphed(lambda h, w, y: linear_cross_entropy(h, w, y, tp_group=ctx.group, chunk_size=chunk,
                                                           impl=_impl()), (h, w, y))
    return _graphed_step(lambda: _grads(graphed(h, w, y), h, w))


def tp_make_ours_logprobs_graphed(h, w, y, chunk, ctx):
    n = h.shape[0]
    graphed = _graphed(lambda h, w, y: -linear_logprobs(h, w, y, tp_group=ctx.group, chunk_size=chunk,
                                                       impl=_impl()).logprobs.sum() / n, (h, w, y))
    return _graphed_step(lambda: _grads(graphed(h, w, y), h, w))



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
            if getattr(step, "graphed", False):
                return None
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



def tp_context(tp, device=None, backend=None) -> _TPCtx:
    """The process group of a torchrun of `tp` processes (one GPU each, NCCL; gloo on CPU)."""
    import datetime

    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world != tp:
        raise SystemExit(f"--tp {tp} needs torchrun --nproc_per_node {tp} (WORLD_SIZE is {world})")
    dev_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("nccl" if dev_type == "cuda" else "gloo")
    if dev_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    kw = dict(device_id=device) if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30), **kw)
    if rank != 0:
        measure.QUIET = True  # only rank 0 prints
    return _TPCtx(dist, dist.group.WORLD, world, rank, device)


def tp_main(args):
    ctx = tp_context(args.tp, args.device, args.backend)
    dist, dev_type, world, rank = ctx.dist, ctx.device.type, ctx.tp, ctx.rank
    backend = dist.get_backend(ctx.group)

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
    ctx.megatron_error = None
    if any(name.startswith("megatron") for name, _ in impls):  # (megatron-core is slow to import)
        try:
            from megatron.core import parallel_state
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
        except Exception as exc:  # noqa: BLE001
            ctx.megatron_error = f"megatron parallel_state not initialized: {type(exc).__name__}: {str(exc)[:200]}"
        flags = [None] * world
        dist.all_gather_object(flags, ctx.megatron_error)
        ctx.megatron_error = next((f for f in flags if f), None)
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


