"""Fused vs dense vocab-parallel log-probs on a toy problem, under torchrun.

    torchrun --nproc_per_node 2 examples/logprobs_tp_demo.py [--tokens 4096 --hidden 256 --vocab 32000]

Each rank holds a contiguous vocab shard of the output weight. The fused op computes per-token
log-probs (and their gradients) chunk by chunk; the dense path materializes the [tokens, V/TP]
logits and a vocab-parallel log-softmax, as Megatron does without fusion. Prints the largest
difference between the two, for values and gradients, and the peak memory of each (CUDA) or the
size of the logits that the fused op never allocates (CPU). gloo on CPU, NCCL on CUDA.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from megatron_fused_ce import linear_logprobs


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
    return target - sum_exp.log(), logits.numel() * logits.element_size()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-size", type=int, default=512)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    assert args.vocab % world == 0, "--vocab must divide by the number of ranks"

    g = torch.Generator().manual_seed(0)  # same global problem on every rank
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device, dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    shard = weight.chunk(world)[rank].contiguous()

    results = {}
    for name in ("fused", "dense"):
        h = hidden.clone().requires_grad_()
        w = shard.clone().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        if name == "fused":
            lp = linear_logprobs(h, w, labels, tp_group=dist.group.WORLD, chunk_size=args.chunk_size).logprobs
            logits_bytes = 0
        else:
            lp, logits_bytes = dense_vocab_parallel_logprobs(h, w, labels, dist.group.WORLD)
        lp.sum().backward()
        if name == "dense":  # ColumnParallelLinear's backward: sum the partial dX over TP ranks
            dist.all_reduce(h.grad)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        results[name] = (lp.detach(), h.grad, w.grad, elapsed, peak, logits_bytes)

    f, d = results["fused"], results["dense"]
    if rank == 0:
        print(f"TP={world} on {device.type}, {dtype}: tokens={args.tokens} hidden={args.hidden} vocab={args.vocab}")
        for i, what in enumerate(("log-probs", "dX", "dW(shard)")):
            diff = (f[i].float() - d[i].float()).abs().max().item()
            print(f"  max |fused - dense| {what:10s} {diff:.3e}")
        print(f"  time fwd+bwd: fused {f[3] * 1e3:.1f} ms, dense {d[3] * 1e3:.1f} ms")
        if cuda:
            print(f"  peak extra memory: fused {f[4] / 2**20:.1f} MiB, dense {d[4] / 2**20:.1f} MiB")
        else:
            print(f"  fused never allocates the {d[5] / 2**20:.1f} MiB fp32 logits per rank that dense keeps "
                  f"(largest fused chunk: {args.chunk_size}/{args.tokens} of it)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
