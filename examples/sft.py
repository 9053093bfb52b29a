"""Supervised fine-tuning on the digit task's demonstrations, fused log-probs: the first stage of
the RL chain (SFT, then GRPO or DPO from its checkpoint; docs/rl.md).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/sft.py --task count --save CKPT
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/sft.py --tp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/sft.py --tp 2 --cp 2 data.pack=true

A demonstration is a prompt of the task (`rollout.task`: random digits, then `=`) and the right
response, which the task computes (examples/rollout.py); the loss covers the response tokens only.
By default every row is one demonstration laid out as GRPO's rollouts (`data.prompt_length`
prompt tokens, the response filling `data.seq_length`). With `data.pack` several shorter ones
(fewer digits, a shorter response) share a row: the attention mask is block-diagonal, positions
restart per demonstration, and `cu_seqlens` tells the post-processor where each one ends, so its
last position is not scored against the next one's first token. With context parallelism
(`--cp N`) the rows are megatron's THD layout instead: each micro-batch is one packed row, every
demonstration padded to a multiple of 2·N positions and split over the N ranks document by
document (`cu_seqlens` + `cu_seqlens_padded`).

Every `eval.every` steps and after the last one, the policy answers held-out prompts with the
rollouts' sampler: `reward` (the task's mean reward, 0-1) and `accuracy` (exact match) in the
progress bar and in `--log-jsonl`. `--save DIR` then writes the policy for `grpo.py --load DIR`
and `dpo.py --load DIR`.
"""

import torch

from example_checkpoint import load, save
from example_common import (
    LogprobsPostProcessorFor,
    MainGradAdamW,
    Progress,
    build_model,
    compare_unfused,
    data_generator,
    describe,
    device,
    init_distributed,
    micro_batches,
    on_this_cp_rank,
    optimizer_step,
    parse_args,
    rows_per_rank,
    shutdown,
)
from rollout import SEPARATOR, JsonlLog, evaluate, prompts, sampler_of, targets

from megatron_fused_ce.megatron import sft_loss_func


def sample_example(cfg, g):
    """(tokens, loss mask over next-token targets) of one demonstration: the RL layout (prompt of
    `data.prompt_length`, response to `data.seq_length + 1` tokens), or with `data.pack` a
    shorter prompt and response of random lengths."""
    data, task = cfg["data"], cfg["rollout"]["task"]
    prompt_length, total = data["prompt_length"], data["seq_length"] + 1
    response_length = total - prompt_length
    if data["pack"]:
        prompt_length = int(torch.randint(2, prompt_length + 1, (1,), generator=g))
        response_length = int(torch.randint(1, response_length + 1, (1,), generator=g))
    prompt = prompts(1, prompt_length, g)
    tokens = torch.cat([prompt, targets(prompt, response_length, task)], dim=1)[0]
    n = prompt_length + response_length
    target_is_response = torch.arange(1, n) >= prompt_length  # target of position t is t+1
    return tokens, target_is_response.float()


def make_row(cfg, g, slot_multiple: int = 1):
    """One row of `seq_length` positions: demonstrations packed back to back (or one, padded),
    each in a slot whose length is a multiple of `slot_multiple` (context parallelism: 2·CP, see
    `make_batches`). Returns tokens, labels, loss_mask, position_ids, the block-diagonal attention
    mask, and the real and slot lengths of its segments (the demonstrations, then the trailing
    padding, whose real length is 0 in slots)."""
    seq = cfg["data"]["seq_length"]
    tokens = torch.full((seq + 1,), SEPARATOR, dtype=torch.long)
    loss_mask = torch.zeros(seq)
    position_ids = torch.zeros(seq, dtype=torch.long)
    allowed = torch.zeros(seq, seq, dtype=torch.bool)
    real, slots, used = [], [], 0
    while True:
        ex_tokens, ex_mask = sample_example(cfg, g)
        n = ex_tokens.numel() - 1  # positions: all but the last token (it only is a target)
        slot = -(-n // slot_multiple) * slot_multiple
        if used + slot > seq:
            if used == 0:
                raise SystemExit(f"a demonstration ({n} positions in a slot of {slot}) is longer "
                                 f"than data.seq_length ({seq})")
            break
        tokens[used:used + n + 1] = ex_tokens
        loss_mask[used:used + n] = ex_mask
        position_ids[used:used + slot] = torch.arange(slot)
        allowed[used:used + slot, used:used + slot] = True
        used += slot
        real.append(n)
        slots.append(slot)
        if not cfg["data"]["pack"]:
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
    mbs = cfg["train"]["micro_batch_size"]
    cp = parallel_state.get_context_parallel_world_size()
    g = data_generator(cfg, parallel_state, step)
    rows = [make_row(cfg, g, 2 * cp if cp > 1 else 1) for _ in range(rows_per_rank(cfg, parallel_state))]
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
    # micro-batch's rows become one packed row [1, mbs * s], every demonstration in a slot of a
    # multiple of 2·CP positions: `cu_seqlens` holds the real lengths, `cu_seqlens_padded` the
    # slots (the attention reads both through PackedSeqParams, the post-processor finds each
    # demonstration's last position wherever it landed).
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


def evaluation_due(step: int, cfg) -> bool:
    """Every `eval.every` steps from the first, and after the last."""
    return step % cfg["eval"]["every"] == 0 or step == cfg["train"]["steps"] - 1


def main():
    args = parse_args("sft", __doc__)
    cfg, train = args.cfg, args.cfg["train"]
    parallel_state = init_distributed(cfg, train["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    if args.load:
        load(model, args.load)
    post = LogprobsPostProcessorFor(cfg, fused)
    sampler = sampler_of(cfg)
    optimizer = MainGradAdamW(model, lr=train["lr"])

    def make_loss_func(chunk, batch):
        return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"],
                             cu_seqlens=batch["cu_seqlens"],
                             cu_seqlens_padded=batch.get("cu_seqlens_padded"))

    progress = Progress(train["steps"], "sft")
    progress.write(describe("sft", cfg, fused, parallel_state,
                            f"; task {cfg['rollout']['task']}, evaluated with sampler "
                            f"{sampler.describe()}"))
    log = JsonlLog(args.log_jsonl, progress.is_reporter)
    evaluated = {}
    for step in range(train["steps"]):
        batches = on_this_cp_rank(make_batches(cfg, parallel_state, step))
        if step == 0 and args.compare_unfused:
            progress.write(compare_unfused(model, fused, batches, make_loss_func, parallel_state,
                                           "lm loss"))
        shown = optimizer_step(model, optimizer, progress, batches, make_loss_func, parallel_state)
        record = {"step": step, **({"loss": shown["lm loss"]} if shown else {})}
        if evaluation_due(step, cfg):
            reward, accuracy = evaluate(model, fused, cfg, parallel_state, sampler)
            evaluated = {"reward": f"{reward:.3f}", "accuracy": f"{accuracy:.3f}"}
            record.update(reward=reward, accuracy=accuracy)
        log.write(record)
        progress.update(shown, tokens=train["global_batch_size"] * cfg["data"]["seq_length"],
                        **evaluated)
        if "reward" in record and train["stop_at_reward"] is not None \
                and record["reward"] >= train["stop_at_reward"]:
            progress.write(f"sft: stopped after step {step}: the evaluation's reward {record['reward']:.3f} "
                           f"reached train.stop_at_reward = {train['stop_at_reward']:g}")
            break
    log.close()
    progress.close()
    if args.save:
        save(model, cfg, args.save, "sft", step + 1)
        progress.write(f"sft: saved the policy to {args.save}")
    shutdown()


if __name__ == "__main__":
    main()
