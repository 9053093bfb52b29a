"""Supervised fine-tuning on mock prompt/response data, packed sequences, fused log-probs.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/sft.py --tp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/sft.py --pp 2 data.pack=false
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/sft.py --tp 2 --cp 2 --compare-unfused

Each example is a prompt (the start of an arithmetic progression of tokens) and its response
(the continuation). With `data.pack` several examples share a row: the attention mask is
block-diagonal, positions restart per example, and `cu_seqlens` tells the post-processor where
each example ends, so its last position is not scored against the next example's first token.
With context parallelism (`--cp N`) the packing is megatron's THD layout instead: each
micro-batch is one packed row, every example padded to a multiple of 2·N positions and split over
the N ranks document by document (`cu_seqlens` + `cu_seqlens_padded`).
"""

import torch

from example_common import (
    LogprobsPostProcessorFor,
    build_model,
    data_generator,
    device,
    init_distributed,
    micro_batches,
    parse_args,
    pattern_sequences,
    rows_per_rank,
    train_sft,
)

from megatron_fused_ce.megatron import sft_loss_func


def sample_example(data, vocab, g):
    """(tokens, loss mask over next-token targets) of one prompt + response."""
    lo, hi = data["prompt_length"]
    prompt = int(torch.randint(lo, hi + 1, (1,), generator=g))
    lo, hi = data["response_length"]
    response = int(torch.randint(lo, hi + 1, (1,), generator=g))
    tokens = pattern_sequences(1, prompt + response, vocab, g)[0]
    target_is_response = torch.arange(1, prompt + response) >= prompt  # target of position t is t+1
    return tokens, target_is_response.float()


def make_row(data, vocab, g, slot_multiple: int = 1):
    """One row of `seq_length` positions: examples packed back to back (or one, padded), each in a
    slot whose length is a multiple of `slot_multiple` (context parallelism: 2·CP, see
    `make_batches`). Returns tokens, labels, loss_mask, position_ids, the block-diagonal attention
    mask, and the real and slot lengths of its segments (the examples, then the trailing padding,
    whose real length is 0 in slots)."""
    seq = data["seq_length"]
    tokens = torch.zeros(seq + 1, dtype=torch.long)
    loss_mask = torch.zeros(seq)
    position_ids = torch.zeros(seq, dtype=torch.long)
    allowed = torch.zeros(seq, seq, dtype=torch.bool)
    real, slots, used = [], [], 0
    while True:
        ex_tokens, ex_mask = sample_example(data, vocab, g)
        n = ex_tokens.numel() - 1  # positions: all but the last token (it only is a target)
        slot = -(-n // slot_multiple) * slot_multiple
        if used + slot > seq:
            if used == 0:
                raise SystemExit("an example is longer than seq_length")
            break
        tokens[used:used + n + 1] = ex_tokens
        loss_mask[used:used + n] = ex_mask
        position_ids[used:used + slot] = torch.arange(slot)
        allowed[used:used + slot, used:used + slot] = True
        used += slot
        real.append(n)
        slots.append(slot)
        if not data["pack"]:
            break
    if used < seq:  # padding: attends to itself only, never trained on
        allowed[used:, used:] = torch.eye(seq - used, dtype=torch.bool)
        real.append(0 if slot_multiple > 1 else seq - used)
        slots.append(seq - used)
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    attention_mask = ~(allowed & causal)  # True = masked
    return tokens[:-1], tokens[1:], loss_mask, position_ids, attention_mask, real, slots


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def make_batches(cfg, parallel_state, step):
    data, vocab = cfg["data"], cfg["model"]["vocab_size"]
    seq, mbs = data["seq_length"], cfg["train"]["micro_batch_size"]
    cp = parallel_state.get_context_parallel_world_size()
    g = data_generator(cfg, parallel_state, step)
    rows = [make_row(data, vocab, g, 2 * cp if cp > 1 else 1)
            for _ in range(rows_per_rank(cfg, parallel_state))]
    tokens, labels, loss_mask, position_ids, attention_mask, real, slots = zip(*rows)
    if cp == 1:
        batches = micro_batches({
            "tokens": torch.stack(tokens), "labels": torch.stack(labels),
            "loss_mask": torch.stack(loss_mask), "position_ids": torch.stack(position_ids),
            "attention_mask": torch.stack(attention_mask).unsqueeze(1),
        }, mbs)
        # cu_seqlens index the flattened [b * s] positions of a micro-batch (every row ends at s).
        for i, batch in enumerate(batches):
            lengths = [n for row in slots[i * mbs:(i + 1) * mbs] for n in row]
            batch["cu_seqlens"] = offsets(lengths).to(batch["tokens"].device)
        return batches
    # Context parallelism: megatron splits packed sequences document by document (THD). Each
    # micro-batch's rows become one packed row [1, mbs * s], every example in a slot of a
    # multiple of 2·CP positions: `cu_seqlens` holds the real lengths, `cu_seqlens_padded` the
    # slots (the attention reads both through PackedSeqParams, the post-processor finds each
    # example's last position wherever it landed).
    batches = []
    for i in range(0, len(rows), mbs):
        take = slice(i, i + mbs)
        batch = {"tokens": torch.cat(tokens[take]), "labels": torch.cat(labels[take]),
                 "loss_mask": torch.cat(loss_mask[take]), "position_ids": torch.cat(position_ids[take])}
        batch = {k: v.unsqueeze(0).to(device()) for k, v in batch.items()}
        batch["cu_seqlens"] = offsets([n for row in real[take] for n in row]).to(device())
        batch["cu_seqlens_padded"] = offsets([n for row in slots[take] for n in row]).to(device())
        batches.append(batch)
    return batches


def main():
    args = parse_args("sft", __doc__)
    cfg, train = args.cfg, args.cfg["train"]
    parallel_state = init_distributed(cfg, train["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    post = LogprobsPostProcessorFor(cfg, fused)

    def make_loss_func(chunk, batch):
        return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"],
                             cu_seqlens=batch["cu_seqlens"],
                             cu_seqlens_padded=batch.get("cu_seqlens_padded"))

    train_sft(args, cfg, model, fused, parallel_state, make_batches, make_loss_func, "sft")


if __name__ == "__main__":
    main()
