#!/usr/bin/env python3
"""Cost of the argument agreement of one call (ops/agreement.py), per call, on one GPU or TP ranks.

    python tools/agreement_cost.py                                  # one GPU (no collective)
    torchrun --nproc_per_node 2 tools/agreement_cost.py             # TP=2 over NCCL
    torchrun --nproc_per_node 2 tools/agreement_cost.py --device cpu  # gloo smoke test

Rows, per number of labels N (the fingerprint is O(N)):
  collective_floor  one all-reduce MAX of an int64 vector of the agreement's length + .tolist()
                    (the one collective and host sync every call has paid since the first version)
  labels_counts     + the labelled-token and out-of-range counts of the labels (what the check did
                    before the agreement carried every argument)
  agreement         the checks of linear_cross_entropy as token_statistics runs them (all
                    arguments, the labels fingerprint, the options)
  op_forward_backward  a whole linear_cross_entropy call at H=4096, V_local=32000 (bf16), for scale
Medians of CUDA-event timings over 200 calls after warm-up, max over ranks, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_fused_ce import linear_cross_entropy  # noqa: E402
from megatron_fused_ce.ops import api, reductions  # noqa: E402


def timed(fn, device, reps=200, warmup=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="8192,65536,262144,1048576")
    args = parser.parse_args()
    group = None
    if "WORLD_SIZE" in os.environ:
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        group = dist.group.WORLD if dist.get_world_size() > 1 else None
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    tp = reductions.group_size(group)
    rank = dist.get_rank() if dist.is_initialized() else 0
    hidden_size, v_local = 4096, 32000
    weight = torch.randn(v_local, hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        g = torch.Generator().manual_seed(n)
        labels = torch.randint(0, v_local * tp, (n,), generator=g).to(device)
        labels[::5] = -100
        hidden = torch.empty(n, hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)

        def agreement():
            api._check_arguments(
                "linear_cross_entropy", hidden, weight, labels, group, vocab_size=None, temperature=1.0,
                chunk_size=None, sequence_parallel=False, impl="auto", ignore_index=-100,
                logits_dtype=None, memory_mode="fast", want_entropy=False, grad_path=(True, True, True),
                max_chunk_bytes=None,
                extra_checks={"reduction": None, "label_smoothing": None, "z_loss_weight": None},
                must_agree={"reduction": "mean", "label_smoothing": 0.0, "z_loss_weight": 0.0})

        length = 64  # about the agreement vector's length for linear_cross_entropy

        def collective_floor():
            reductions.max_over_ranks(torch.zeros(length, dtype=torch.int64).to(device), group).tolist()

        def labels_counts():
            labelled = (labels != -100).sum()
            outside = (((labels < 0) | (labels >= v_local * tp)) & (labels != -100)).sum()
            vector = torch.cat([torch.zeros(length - 2, dtype=torch.int64).to(device),
                                torch.stack([labelled, outside])])
            reductions.max_over_ranks(vector, group).tolist()

        result = {"N": n}
        for name, fn in (("collective_floor", collective_floor), ("labels_counts", labels_counts),
                         ("agreement", agreement)):
            result[name] = timed(fn, device)
        if n <= 65536 and device.type == "cuda":
            h = torch.randn(n, hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)

            def op():
                linear_cross_entropy(h, weight, labels, tp_group=group).backward()
            result["op_forward_backward"] = timed(op, device, reps=10, warmup=2)
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            result = {k: max(r[k] for r in gathered) for k in result}
        rows.append(result)
    if rank == 0:
        print(f"TP={tp} device={device} (microseconds per call, median; max over ranks)")
        keys = ["N", "collective_floor", "labels_counts", "agreement", "op_forward_backward"]
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(f"{r[k]:.0f}" if k in r else "-" for k in keys))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
