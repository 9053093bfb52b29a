"""DPO on preference pairs the policy sampled itself, with a frozen reference model, both running
fused log-probs: the SFT -> DPO branch of the RL chain (docs/rl.md).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/dpo.py --load CKPT --log-jsonl D.jsonl
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/dpo.py --load CKPT --tp 2 --pp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/dpo.py --load CKPT --tp 2 --cp 2 --compare-unfused

Before training, the starting policy (`--load`: the SFT checkpoint; the policy and the reference
model both start from it) answers `rollout.num_prompts` prompts `rollout.samples_per_prompt` times
each, with the sampler GRPO's rollouts use (examples/rollout.py), and the task's reward ranks the
answers of each prompt: the best is paired with the worst, the second best with the second
worst, and so on; a pair of equal rewards is dropped (it prefers nothing). That set is built once;
training is offline on it, `train.global_batch_size` rows (chosen and rejected interleaved) per
step, in a new order every pass.

Per step: a forward-only pass of the reference model gives the reference log-probs of every
micro-batch (computed on the last pipeline stage, broadcast to all stages), then the policy trains
on `dpo_loss_func`. The SFT term is normalized by the global number of chosen tokens, which is
all-reduced over data-parallel ranks first. Every `eval.every` steps and after the last one, the
policy answers held-out prompts: `reward` and `accuracy` (exact match) in `--log-jsonl`, next to
the loss's `preference_accuracy` (chosen scored above rejected).
"""

import time

import torch
import torch.distributed as dist

from example_checkpoint import load, save
from example_common import (
    OTHER_RANKS_WAIT_S,
    LogprobsPostProcessorFor,
    MainGradAdamW,
    Progress,
    build_frozen_copy,
    build_model,
    compare_unfused,
    data_generator,
    describe,
    device,
    fail,
    forward_fn,
    init_distributed,
    micro_batches,
    on_this_cp_rank,
    parse_args,
    reduce_metrics,
    rows_per_rank,
    run_batches,
    shutdown,
)
from rollout import JsonlLog, answer, check_rows, evaluate, mean_over_replicas, prompts, sampler_of

from megatron_fused_ce.megatron import compute_logprobs, dpo_loss_func


def preference_pairs(model, fused, cfg, parallel_state, sampler):
    """This data-parallel rank's pairs `[P, 2, seq_length + 1]` (chosen, rejected) from the
    policy's own answers, and a one-line summary over all ranks."""
    data, roll = cfg["data"], cfg["rollout"]
    rows = check_rows("rollout.num_prompts", roll["num_prompts"], data["prompt_length"],
                      data["seq_length"], parallel_state)
    group = roll["samples_per_prompt"]  # (>= 2: checked with the config)
    prompt = prompts(rows, data["prompt_length"], data_generator(cfg, parallel_state, -1))
    seed = cfg["train"]["seed"] * 7919 + 17 * parallel_state.get_data_parallel_rank() + 5
    tokens, _, reward, _ = answer(model, fused, cfg, prompt.repeat_interleave(group, dim=0), sampler,
                                  torch.Generator().manual_seed(seed))
    pairs, chosen_reward, rejected_reward = [], [], []
    for i in range(rows):
        r = reward[i * group:(i + 1) * group]
        order = torch.argsort(r, descending=True, stable=True)
        for k in range(group // 2):
            best, worst = int(order[k]), int(order[group - 1 - k])
            if r[best] > r[worst]:  # ties prefer nothing: dropped
                pairs.append(torch.stack([tokens[i * group + best], tokens[i * group + worst]]))
                chosen_reward.append(r[best])
                rejected_reward.append(r[worst])
    dp_group = parallel_state.get_data_parallel_group()
    total, fewest = (torch.tensor([len(pairs)], device=device()) for _ in range(2))
    dist.all_reduce(total, group=dp_group)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=dp_group)
    if int(fewest) == 0:
        if dist.get_rank() != 0:  # rank 0 prints the line; its exit ends the launch
            time.sleep(OTHER_RANKS_WAIT_S)
        fail("examples/dpo.py", "no preference pairs: every sampled answer to every prompt of a "
                                "data-parallel rank got the same reward; start from a policy that "
                                "sometimes gets it right (--load an SFT checkpoint) or raise "
                                "rollout.samples_per_prompt")
    chosen_mean, rejected_mean, answers_mean = (
        mean_over_replicas([torch.stack(chosen_reward)], parallel_state)
        + mean_over_replicas([torch.stack(rejected_reward)], parallel_state)
        + mean_over_replicas([reward], parallel_state))
    summary = (f"dpo: {int(total)} preference pairs from {roll['num_prompts']} prompts x {group} sampled "
               f"answers (mean reward {answers_mean:.3f}; chosen {chosen_mean:.3f}, rejected "
               f"{rejected_mean:.3f}; pairs of equal reward dropped)")
    return torch.stack(pairs), summary


def make_batches(cfg, pairs, parallel_state, step):
    """This step's `global_batch_size / DP` rows of this rank: its pairs in a seeded order, a new
    one every pass over them; rows 2i (chosen) and 2i+1 (rejected) share a prompt."""
    data = cfg["data"]
    seq, prompt = data["seq_length"], data["prompt_length"]
    wanted = rows_per_rank(cfg, parallel_state) // 2
    start = step * wanted
    take = []
    while len(take) < wanted:
        epoch, offset = divmod(start + len(take), len(pairs))
        order = torch.randperm(len(pairs), generator=data_generator(cfg, parallel_state, 10 ** 6 + epoch))
        take.extend(order[offset:offset + wanted - len(take)].tolist())
    tokens = pairs[take].reshape(2 * wanted, seq + 1)
    loss_mask = (torch.arange(1, seq + 1) >= prompt).float().expand(2 * wanted, seq)
    return micro_batches({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                          "loss_mask": loss_mask.contiguous()}, cfg["train"]["micro_batch_size"])


def global_counts(batches, parallel_state):
    """(pairs, chosen loss tokens) over all micro-batches and data-parallel ranks."""
    local = torch.tensor([sum(b["tokens"].shape[0] // 2 for b in batches),
                          sum(float(b["loss_mask"][0::2].sum()) for b in batches)], device=device())
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return int(local[0]), float(local[1])


def evaluation_due(step: int, cfg) -> bool:
    """Every `eval.every` steps from the first, and after the last."""
    return step % cfg["eval"]["every"] == 0 or step == cfg["train"]["steps"] - 1


def main():
    args = parse_args("dpo", __doc__)
    cfg, train = args.cfg, args.cfg["train"]
    parallel_state = init_distributed(cfg, train["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    if args.load:
        load(model, args.load)
    reference = build_frozen_copy(model, cfg, parallel_state)  # (the policy as loaded)
    post = LogprobsPostProcessorFor(cfg, fused)
    sampler = sampler_of(cfg)
    optimizer = MainGradAdamW(model, lr=train["lr"])
    seq = cfg["data"]["seq_length"]
    mbs = train["micro_batch_size"]

    progress = Progress(train["steps"], "dpo")
    progress.write(describe("dpo", cfg, fused, parallel_state,
                            f"; task {cfg['rollout']['task']}, sampler {sampler.describe()}"))
    pairs, summary = preference_pairs(model, fused, cfg, parallel_state, sampler)
    progress.write(summary)
    log = JsonlLog(args.log_jsonl, progress.is_reporter)
    evaluated = {}
    for step in range(train["steps"]):
        whole = make_batches(cfg, pairs, parallel_state, step)
        num_pairs, sft_tokens = global_counts(whole, parallel_state)  # (of the whole sequences)
        batches = on_this_cp_rank(whole)
        ref = compute_logprobs(reference, batches, forward_fn, post, seq_length=seq,
                               micro_batch_size=mbs)
        for batch, ref_out in zip(batches, ref):
            batch["reference_logprobs"] = ref_out.logprobs  # this CP rank's slice, as the batch

        def make_loss_func(chunk, batch):
            return dpo_loss_func(post, chunk, batch["labels"], batch["loss_mask"],
                                 batch["reference_logprobs"], global_num_pairs=num_pairs,
                                 global_num_sft_tokens=sft_tokens, **cfg["dpo"])

        if step == 0 and args.compare_unfused:
            progress.write(compare_unfused(model, fused, batches, make_loss_func, parallel_state,
                                           "loss"))
        optimizer.zero_grad()
        with progress.measure_memory(model):
            metrics = run_batches(model, batches, make_loss_func)
        optimizer.step()
        reduced = reduce_metrics(metrics, parallel_state)
        # the loss's accuracy is the pairs' (chosen above rejected), not the task's exact match
        shown = {"loss": reduced["loss"], "reward_margin": reduced["reward_margin"],
                 "preference_accuracy": reduced["accuracy"]} if reduced else {}
        record = {"step": step, **shown}
        if evaluation_due(step, cfg):
            reward, accuracy = evaluate(model, fused, cfg, parallel_state, sampler)
            evaluated = {"reward": f"{reward:.3f}", "accuracy": f"{accuracy:.3f}"}
            record.update(reward=reward, accuracy=accuracy)
        log.write(record)
        progress.update(shown, tokens=train["global_batch_size"] * seq * 2, **evaluated)  # + reference
    log.close()
    progress.close()
    if args.save:
        save(model, cfg, args.save, "dpo", train["steps"])
        progress.write(f"dpo: saved the policy to {args.save}")
    shutdown()


if __name__ == "__main__":
    main()
