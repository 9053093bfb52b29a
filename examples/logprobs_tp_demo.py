"""Fused vs dense vocab-parallel log-probs on a toy problem, under torchrun.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/logprobs_tp_demo.py --tokens 4096 --vocab 32000

Each rank holds a contiguous vocab shard of the output weight. The fused op computes per-token
log-probs (and their gradients) chunk by chunk; the dense path materializes the [tokens, V/TP]
logits and a vocab-parallel log-softmax, as Megatron does without fusion. Prints the largest
difference between the two, for values and gradients, their times, and the peak tensor memory
each allocates (forward+backward; `megatron_fused_ce.memory.PeakTensorMemory`: CUDA's
max_memory_allocated on GPUs, live tensor bytes on the CPU). gloo on CPU, NCCL on CUDA.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

# (example_common also puts the checkout on sys.path)
from example_common import ExampleArgumentParser, fail, require_torchrun

from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.testing import PeakTensorMemory


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM whose backward is the identity: every rank computes the same loss from the
    summed value, so each rank's partial gets the upstream gradient unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def dense_vocab_parallel_logprobs(hidden, weight_shard, labels, group):
    """Materialized logits + vocab-parallel log-softmax (the unfused baseline)."""
    rank, v_local = dist.get_rank(group), weight_shard.shape[0]
    logits = (hidden @ weight_shard.t()).float()
    local_max = logits.max(-1).values.detach()
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(-1)
    sum_exp = _SumOverRanks.apply(sum_exp, group)
    local = labels - rank * v_local
    on_shard = (local >= 0) & (local < v_local)
    target = torch.where(on_shard, shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    target = _SumOverRanks.apply(target, group)
    return target - sum_exp.log()


def main():
    parser = ExampleArgumentParser(prog="examples/logprobs_tp_demo.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens N (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size H (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=32000,
                        help="vocab size V, split evenly over the ranks (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=512,
                        help="tokens per chunk of the fused op; 0 = its automatic chunk "
                             "(default: %(default)s)")
    args = parser.parse_args()
    for name in ("tokens", "hidden", "vocab"):
        if getattr(args, name) <= 0:
            fail(parser.prog, f"--{name} must be > 0")
    require_torchrun(parser.prog, 2)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.vocab % world:
        fail(parser.prog, f"--vocab {args.vocab} must divide by the number of ranks ({world})")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # share the cores between the processes on this machine
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = torch.bfloat16 if cuda else torch.float32
    chunk_size = args.chunk_size or None

    g = torch.Generator().manual_seed(0)  # same global problem on every rank
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device, dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    shard = weight.chunk(world)[rank].contiguous()

    results = {}
    for name in ("fused", "dense"):
        h = hidden.clone().requires_grad_()
        w = shard.clone().requires_grad_()
        with PeakTensorMemory(device) as memory:
            start = time.perf_counter()
            if name == "fused":
                lp = linear_logprobs(h, w, labels, tp_group=dist.group.WORLD, chunk_size=chunk_size).logprobs
            else:
                lp = dense_vocab_parallel_logprobs(h, w, labels, dist.group.WORLD)
            lp.sum().backward()
            if name == "dense":  # ColumnParallelLinear's backward: sum the partial dX over TP ranks
                dist.all_reduce(h.grad)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        results[name] = (lp.detach(), h.grad, w.grad, elapsed, memory.peak_bytes)

    f, d = results["fused"], results["dense"]
    if rank == 0:
        logits = args.tokens * (args.vocab // world) * torch.finfo(torch.float32).bits // 8
        print(f"TP={world} on {device.type}, {dtype}: tokens={args.tokens} hidden={args.hidden} "
              f"vocab={args.vocab} (fp32 logits per rank: {logits / 2**20:.1f} MiB)")
        for i, what in enumerate(("log-probs", "dX", "dW(shard)")):
            diff = (f[i].float() - d[i].float()).abs().max().item()
            print(f"  max |fused - dense| {what:10s} {diff:.3e}")
        print(f"  time fwd+bwd: fused {f[3] * 1e3:.1f} ms, dense {d[3] * 1e3:.1f} ms")
        print(f"  peak tensor memory fwd+bwd: fused {f[4] / 2**20:.1f} MiB, dense {d[4] / 2**20:.1f} MiB "
              f"(chunk {chunk_size or 'auto'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
