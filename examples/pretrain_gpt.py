"""Pretrain a tiny GPT on mock data with megatron-core, the loss computed without the logits.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/pretrain_gpt.py --tp 2 --pp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/pretrain_gpt.py --cp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/pretrain_gpt.py megatron_cfg.use_linear_ce_fusion_loss=false

The loss is the token-level cross-entropy, computed as -log p(label) by the post-processor:
from the final hidden states and the output-weight shard when `use_linear_ce_fusion_loss` is on,
from megatron's `[b, s, V/TP]` logits when it is off.
"""

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


def make_batches(cfg, parallel_state, step):
    seq, vocab = cfg["data"]["seq_length"], cfg["model"]["vocab_size"]
    tokens = pattern_sequences(rows_per_rank(cfg, parallel_state), seq + 1, vocab,
                               data_generator(cfg, parallel_state, step))
    rows = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": tokens.new_ones(tokens.shape[0], seq).float()}
    return micro_batches(rows, cfg["train"]["micro_batch_size"])


def main():
    args = parse_args("pretrain_gpt", __doc__)
    cfg, train = args.cfg, args.cfg["train"]
    parallel_state = init_distributed(cfg, train["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    post = LogprobsPostProcessorFor(cfg, fused)

    def make_loss_func(chunk, batch):
        return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"])

    train_sft(args, cfg, model, fused, parallel_state, make_batches, make_loss_func, "pretrain")


if __name__ == "__main__":
    main()
