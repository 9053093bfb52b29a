"""DPO with a frozen reference model, both running fused log-probs.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/dpo.py --tp 2 --pp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/dpo.py --tp 2 --cp 2 --compare-unfused

Per step: a forward-only pass of the reference model gives the reference log-probs of every
micro-batch (computed on the last pipeline stage, broadcast to all stages), then the policy trains
on `dpo_loss_func`. The SFT term is normalized by the global number of chosen tokens, which is
all-reduced over data-parallel ranks first.
"""

import torch
import torch.distributed as dist

from example_common import (
    LogprobsPostProcessorFor,
    MainGradAdamW,
    Progress,
    build_frozen_copy,
    build_model,
    compare_unfused,
    data_generator,
    describe,
    device,
    forward_fn,
    init_distributed,
    micro_batches,
    on_this_cp_rank,
    parse_args,
    pattern_sequences,
    reduce_metrics,
    rows_per_rank,
    run_batches,
    shutdown,
)

from megatron_fused_ce.megatron import compute_logprobs, dpo_loss_func


def make_batches(cfg, parallel_state, step):
    """Rows 2i (chosen) and 2i+1 (rejected) share a prompt."""
    data, vocab = cfg["data"], cfg["model"]["vocab_size"]
    seq, prompt = data["seq_length"], data["prompt_length"]
    g = data_generator(cfg, parallel_state, step)
    pairs = rows_per_rank(cfg, parallel_state) // 2
    chosen = pattern_sequences(pairs, seq + 1, vocab, g)
    rejected = chosen.clone()
    rejected[:, prompt:] = torch.randint(0, vocab, (pairs, seq + 1 - prompt), generator=g)
    tokens = torch.stack([chosen, rejected], dim=1).reshape(2 * pairs, seq + 1)
    loss_mask = (torch.arange(1, seq + 1) >= prompt).float().expand(2 * pairs, seq)
    return micro_batches({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                          "loss_mask": loss_mask.contiguous()}, cfg["train"]["micro_batch_size"])


def global_counts(batches, parallel_state):
    """(pairs, chosen loss tokens) over all micro-batches and data-parallel ranks."""
    local = torch.tensor([sum(b["tokens"].shape[0] // 2 for b in batches),
                          sum(float(b["loss_mask"][0::2].sum()) for b in batches)], device=device())
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return int(local[0]), float(local[1])


def main():
    args = parse_args("dpo", __doc__)
    cfg, train = args.cfg, args.cfg["train"]
    parallel_state = init_distributed(cfg, train["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    reference = build_frozen_copy(model, cfg, parallel_state)
    post = LogprobsPostProcessorFor(cfg, fused)
    optimizer = MainGradAdamW(model, lr=train["lr"])
    seq = cfg["data"]["seq_length"]
    mbs = train["micro_batch_size"]

    progress = Progress(train["steps"], "dpo")
    progress.write(describe("dpo", cfg, fused, parallel_state))
    for step in range(train["steps"]):
        whole = make_batches(cfg, parallel_state, step)
        pairs, sft_tokens = global_counts(whole, parallel_state)  # (of the whole sequences)
        batches = on_this_cp_rank(whole)
        ref = compute_logprobs(reference, batches, forward_fn, post, seq_length=seq,
                               micro_batch_size=mbs)
        for batch, ref_out in zip(batches, ref):
            batch["reference_logprobs"] = ref_out.logprobs  # this CP rank's slice, as the batch

        def make_loss_func(chunk, batch):
            return dpo_loss_func(post, chunk, batch["labels"], batch["loss_mask"],
                                 batch["reference_logprobs"], global_num_pairs=pairs,
                                 global_num_sft_tokens=sft_tokens, **cfg["dpo"])

        if step == 0 and args.compare_unfused:
            progress.write(compare_unfused(model, fused, batches, make_loss_func, parallel_state,
                                           "loss"))
        optimizer.zero_grad()
        with progress.measure_memory(model):
            metrics = run_batches(model, batches, make_loss_func)
        optimizer.step()
        shown = reduce_metrics(metrics, parallel_state)
        shown = {k: shown[k] for k in ("loss", "reward_margin", "accuracy")} if shown else {}
        progress.update(shown, tokens=train["global_batch_size"] * seq * 2)  # policy + reference
    progress.close()
    shutdown()


if __name__ == "__main__":
    main()
