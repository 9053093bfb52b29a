"""Supervised fine-tuning on mock prompt/response data, packed sequences, fused log-probs.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/sft.py --tp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/sft.py --pp 2 data.pack=false

Each example is a prompt (the start of an arithmetic progression of tokens) and its response
(the continuation). With `data.pack` several examples share a row: the attention mask is
block-diagonal, positions restart per example, and `cu_seqlens` tells the post-processor where
each example ends, so its last position is not scored against the next example's first token.
"""

import torch

from example_common import (
    LogprobsPostProcessorFor,
    build_model,
    data_generator,
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


def make_row(data, vocab, g):
    """One row of `seq_length` positions: examples packed back to back (or one, padded).
    Returns tokens, labels, loss_mask, position_ids, the block-diagonal attention mask and the
    boundaries of its segments (examples and the trailing padding)."""
    seq = data["seq_length"]
    tokens = torch.zeros(seq + 1, dtype=torch.long)
    loss_mask = torch.zeros(seq)
    position_ids = torch.zeros(seq, dtype=torch.long)
    allowed = torch.zeros(seq, seq, dtype=torch.bool)
    bounds, used = [0], 0
    while True:
        ex_tokens, ex_mask = sample_example(data, vocab, g)
        n = ex_tokens.numel() - 1  # positions: all but the last token (it only is a target)
        if used + n > seq:
            if used == 0:
                raise SystemExit("an example is longer than seq_length")
            break
        tokens[used:used + n + 1] = ex_tokens
        loss_mask[used:used + n] = ex_mask
        position_ids[used:used + n] = torch.arange(n)
        allowed[used:used + n, used:used + n] = True
        used += n
        bounds.append(used)
        if not data["pack"]:
            break
    if used < seq:  # padding: attends to itself only, never trained on
        allowed[used:, used:] = torch.eye(seq - used, dtype=torch.bool)
        bounds.append(seq)
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    attention_mask = ~(allowed & causal)  # True = masked
    return (tokens[:-1], tokens[1:], loss_mask, position_ids, attention_mask,
            torch.tensor(bounds, dtype=torch.int32))


def make_batches(cfg, parallel_state, step):
    data, vocab = cfg["data"], cfg["model"]["vocab_size"]
    g = data_generator(cfg, parallel_state, step)
    rows = [make_row(data, vocab, g) for _ in range(rows_per_rank(cfg, parallel_state))]
    tokens, labels, loss_mask, position_ids, attention_mask, bounds = zip(*rows)
    batches = micro_batches({
        "tokens": torch.stack(tokens), "labels": torch.stack(labels),
        "loss_mask": torch.stack(loss_mask), "position_ids": torch.stack(position_ids),
        "attention_mask": torch.stack(attention_mask).unsqueeze(1),
    }, cfg["train"]["micro_batch_size"])
    # cu_seqlens index the flattened [b * s] positions of a micro-batch (every row ends at s).
    seq, mbs = data["seq_length"], cfg["train"]["micro_batch_size"]
    for i, batch in enumerate(batches):
        rows_bounds = bounds[i * mbs:(i + 1) * mbs]
        ends = [row[1:] + r * seq for r, row in enumerate(rows_bounds)]
        batch["cu_seqlens"] = torch.cat([ends[0].new_zeros(1)] + ends).to(batch["tokens"].device)
    return batches


def main():
    args = parse_args("sft", __doc__)
    cfg, train = args.cfg, args.cfg["train"]
    parallel_state = init_distributed(cfg, train["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    post = LogprobsPostProcessorFor(cfg, fused)

    def make_loss_func(chunk, batch):
        return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"],
                             cu_seqlens=batch["cu_seqlens"])

    train_sft(args, cfg, model, fused, parallel_state, make_batches, make_loss_func, "sft")


if __name__ == "__main__":
    main()
