#!/usr/bin/env python3
"""Fused linear cross-entropy / log-probs: everything side by side, one process, one GPU, bf16.

    python tools/benchmark.py                       # all shapes and spreads, memory sweep; writes to $OUT or ./bench_out
    python tools/benchmark.py --quick               # tiny shapes (smoke test; runs on CPU too)
    python tools/benchmark.py --shapes 8192x4096x128256 --impls floor,ours_ce,ours_ce_lean --spreads peaked
    python tools/benchmark.py --grid rl             # the RL shapes: x floor against N (rl_grid.png)
    python tools/benchmark.py --grid rl --paired-floor --steady-ms 250   # each row timed in alternation with its floor

What is measured, per shape (N tokens, H hidden, V vocab) and logit spread:
  floor              the 3 GEMMs every fwd+bwd method must do (logits, dX, dW: 6*N*H*V flops),
                     cuBLAS, measured in this run. x_floor of a method = its time / this time
                     (--paired-floor: / the floor calls timed in alternation with the method's).
  floor_fwd          the 1 logits GEMM (2*N*H*V): the floor of the forward-only rows (*_fwd).
  torch_eager        materialized logits, .float(), F.cross_entropy (what users write)
  torch_compile      torch.compile of the same function
  torch_compile_fwd  torch.compile of log_softmax(logits).gather(label) under no_grad
  torch_compile_graphed, torch_compile_fwd_graphed   the same with mode="reduce-overhead" (its
                     CUDA graphs; GPU only)
  torch_lce          PyTorch >= 2.13 F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())
                     (skipped where that torch is not installed)
  megatron           megatron.core vocab_parallel_cross_entropy on materialized bf16 logits (TP=1)
  megatron_fused     megatron.core fused_vocab_parallel_cross_entropy on the bf16 logits (TP=1)
  liger              liger_kernel LigerFusedLinearCrossEntropyLoss
  cce                Apple cut_cross_entropy.linear_cross_entropy, default gradient filter (skips
                     vocab blocks whose probabilities are all tiny: its speed depends on the spread)
  cce_exact          the same with filter_eps=None (no filtering: exact gradients)
  quack_c4096, quack_one_chunk   QuACK's chunked_linear_cross_entropy (CuTe DSL kernels), chunks of
                     4096 rows / one chunk of all rows, tuned=False (its default configurations);
                     *_tuned: tuned=True (autotuned on the first call, minutes; first_call_s says);
                     quack_scaled_exp_c4096: its scaled-exp fused-backward pipeline (SM90)
  ours_ce@C          linear_cross_entropy(..., chunk_size=C) (mean), memory_mode="fast"
  ours_ce_lean       the same with memory_mode="lean"
  ours_logprobs@C    linear_logprobs(...), backward through -sum(lp)/N (recompute path); _lean too
  ours_grpo@C        losses.linear_grpo_loss (DAPO, beta=0); _lean too
  ours_grpo_every_option@C  the same with old / reference / engine log-probs, delta, dual clip, k3 KL
                     with bias correction and token IS truncation
  ours_ce_main_grad@C  ours_ce with Megatron's accumulate_into_main_grad (weight.main_grad fp32
                     pre-allocated, as Megatron's DDP buffers are: not counted); _lean too
  ours_fwd           linear_logprobs under torch.no_grad (reference / old-policy log-probs);
  ours_fwd_entropy   the same with return_entropy=True
  ours_fwd_fused, ours_fwd_fused_graphed   ours_fwd / ours_fwd_graphed with the statistics from the
                     fused statistics GEMM at every size (the default takes cuBLAS's GEMM and the
                     stats kernel up to 256 MiB of logits; docs/design.md §10.3)
  ours_ce_graphed, ours_logprobs_graphed, ours_grpo_graphed, ours_fwd_graphed   ours_ce / ours_logprobs /
                     ours_grpo replayed from torch.cuda.make_graphed_callables' graphs, ours_fwd from a
                     torch.cuda.graph capture, each captured once per shape (docs/performance.md, "RL
                     passes"; GPU only; the graphs' memory pool is not measured)
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

Tensor parallel (one process per GPU, NCCL; tools/gpu_check.sh's bench stage runs it at TP = the
number of visible GPUs):
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
import json
import os
import sys
import time

import torch

from bench import methods
from bench.kernels import kernel_check_and_breakdown, sampler_kernel_check
from bench.measure import REPO, add_backward_thread_option, log, set_backward_thread
from bench.methods import (DEFAULT_IMPLS, QUICK_SHAPES_CPU, QUICK_SHAPES_GPU, RL_GRID, RL_IMPLS, SAMPLERS, SHAPES,
                           SPREADS, SWEEP_HV, SWEEP_IMPLS, SWEEP_N, parse_chunks, parse_shapes)
from bench.report import environment, grid_plot, markdown, plot, write_json
from bench.run import bench_shape, impl_list
from bench.tp import tp_main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", help="comma list of NxHxV (default: the 3 design shapes)")
    p.add_argument("--grid", choices=("rl",), help="a preset: 'rl' = N in 1024..16384 x V per rank in "
                   "19008..128256 x H in 2048, 4096, the rows RL runs (--impls, --shapes narrow it), random "
                   "logits, no memory sweep; adds rl_grid.png (x floor against N)")
    p.add_argument("--impls", default=None, help=f"comma list (default {DEFAULT_IMPLS}; with --grid rl: {RL_IMPLS})")
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
    p.add_argument("--paired-floor", action="store_true",
                   help="time each row in alternation with its floor (floor, row, floor, row, ...): x floor "
                        "against floor times taken in the same GPU state (bench/measure.time_paired)")
    p.add_argument("--steady-ms", type=float, default=0.0,
                   help="with --paired-floor: run the row and its floor in turn this long before timing them")
    p.add_argument("--report", help="only write results.md and the plots from this results.json")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="start no further shape / sweep point after this many seconds (0: no limit)")
    p.add_argument("--sampler-temperature", type=float, default=methods.SAMPLER_TEMPERATURE,
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
    add_backward_thread_option(p)
    args = p.parse_args(argv)
    set_backward_thread(args.backward_thread)
    if args.grid == "rl":
        args.impls = args.impls or RL_IMPLS
        args.shapes = args.shapes or ",".join("x".join(map(str, shape)) for shape in RL_GRID)
        args.spreads, args.sweep = "random", ""
    args.impls = args.impls or DEFAULT_IMPLS
    methods.SAMPLER_TEMPERATURE = args.sampler_temperature
    if args.report:  # tables and plots again from a results.json (e.g. after a timed-out run)
        with open(args.report) as f:
            results = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown(results))
        plot(results, args.out)
        if args.grid or "--grid" in results.get("command", ""):
            grid_plot(results, args.out)
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
    if args.grid:
        grid_plot(results, args.out)
    log("\n" + md)
    return 0 if results.get("kernel_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
