"""GRPO with mocked rollouts, fused log-probs, and only the log-prob passes the config needs.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/grpo.py --tp 2 --pp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/grpo.py --tp 2 --cp 2 --compare-unfused
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/grpo.py grpo.beta=0 grpo.force_on_policy_ratio=true
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/grpo.py --tp 2 sampling.top_p=0.9 sampling.top_k=50

Per rollout step:
1. rollout (mocked): responses, rewards -> group advantages, and the inference engine's
   log-probs (simulated: the current policy's, at the sampling temperature, plus noise);
2. forward-only log-prob passes, broadcast to every pipeline stage: the old policy's (unless
   `force_on_policy_ratio`) and the reference model's (only if `beta > 0`); whatever
   `grpo_logprob_passes(config)` does not ask for is not run (the reference model is not even built);
3. `updates_per_rollout` optimizer steps, each on a minibatch of the rollout.

`sampling.top_k` / `sampling.top_p` / `sampling.min_p` are the rollouts' sampler settings: every
log-prob pass (old policy, training) is then of the distribution the engine sampled from, and a
token outside its kept set gets -inf and is excluded from the loss (shown as `excluded`, the
fraction of loss tokens, token-level losses).
"""

import torch

from example_common import (
    LogprobsPostProcessorFor,
    MainGradAdamW,
    Progress,
    build_frozen_copy,
    build_model,
    compare_unfused,
    data_generator,
    describe,
    forward_fn,
    init_distributed,
    micro_batches,
    on_this_cp_rank,
    parse_args,
    pattern_sequences,
    reduce_metrics,
    run_batches,
    shutdown,
)

from megatron_fused_ce.losses import GRPOConfig
from megatron_fused_ce.megatron import compute_logprobs, grpo_logprob_passes, grpo_loss_func


def mock_rollout(cfg, parallel_state, step):
    """This DP rank's prompts x samples: tokens, loss mask (response only), advantages."""
    data, rollout, vocab = cfg["data"], cfg["rollout"], cfg["model"]["vocab_size"]
    seq, prompt = data["seq_length"], data["prompt_length"]
    dp = parallel_state.get_data_parallel_world_size()
    if rollout["num_prompts"] % dp:
        raise SystemExit(f"rollout.num_prompts must be a multiple of DP={dp}")
    prompts, group = rollout["num_prompts"] // dp, rollout["samples_per_prompt"]
    g = data_generator(cfg, parallel_state, step)
    tokens = pattern_sequences(prompts, seq + 1, vocab, g).repeat_interleave(group, dim=0)
    # "Sampling": each response keeps the progression with its own probability.
    keep = torch.rand(prompts * group, 1, generator=g)
    random_tokens = torch.randint(0, vocab, tokens.shape, generator=g)
    resample = (torch.rand(tokens.shape, generator=g) > keep) & (torch.arange(seq + 1) >= prompt)
    tokens = torch.where(resample, random_tokens, tokens)
    # Reward: fraction of the response that is correct, plus noise; advantages per group.
    correct = 1.0 - resample.float().sum(1) / (seq + 1 - prompt)
    reward = correct + 0.1 * torch.randn(prompts * group, generator=g)
    grouped = reward.view(prompts, group)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    advantages = advantages.view(-1)
    loss_mask = (torch.arange(1, seq + 1) >= prompt).float().expand(prompts * group, seq).contiguous()
    rows = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "advantages": advantages}
    return micro_batches(rows, cfg["train"]["micro_batch_size"]), reward.mean().item()


def logprob_passes(policy, reference, batches, config, post, cfg, g):
    """Fill each micro-batch with the log-probs the loss needs; returns the passes that ran."""
    seq, mbs = cfg["data"]["seq_length"], cfg["train"]["micro_batch_size"]
    needed = grpo_logprob_passes(config)
    ran = []
    # The current policy's log-probs: the old-policy log-probs if the config needs them, and in
    # any case the base of the simulated inference-engine log-probs (a real job gets those from
    # vLLM/SGLang together with the samples).
    current = compute_logprobs(policy, batches, forward_fn, post, seq_length=seq, micro_batch_size=mbs)
    ran.append("old" if needed["old"] else "engine-sim")
    noise = cfg["rollout"]["engine_logprob_noise"]
    for batch, out in zip(batches, current):
        mask = batch["loss_mask"] != 0
        engine = out.logprobs + noise * torch.randn(out.logprobs.shape, generator=g).to(out.logprobs.device)
        batch["sampling_logprobs"] = torch.where(mask, engine, torch.zeros_like(engine))
        if needed["old"]:
            batch["old_logprobs"] = out.logprobs
    if needed["reference"]:
        for batch, out in zip(batches, compute_logprobs(reference, batches, forward_fn, post,
                                                         seq_length=seq, micro_batch_size=mbs)):
            batch["reference_logprobs"] = out.logprobs
        ran.append("ref")
    return ran


def main():
    args = parse_args("grpo", __doc__)
    cfg, train = args.cfg, args.cfg["train"]
    config = GRPOConfig(**cfg["grpo"])
    parallel_state = init_distributed(cfg, train["seed"])
    model, _, fused = build_model(cfg, parallel_state)
    reference = None
    if grpo_logprob_passes(config)["reference"]:
        reference = build_frozen_copy(model, cfg, parallel_state)
    # No entropy requested: the fused loss then makes its gradients in the forward pass (unless a
    # sampler filter is set: the log-probs path then serves the loss).
    post = LogprobsPostProcessorFor(cfg, fused, temperature=cfg["rollout"]["temperature"], **cfg["sampling"])
    optimizer = MainGradAdamW(model, lr=train["lr"])
    seq = cfg["data"]["seq_length"]

    def make_loss_func(chunk, batch):
        return grpo_loss_func(post, chunk, batch["labels"], batch["loss_mask"], batch["advantages"],
                              config, old_logprobs=batch.get("old_logprobs"),
                              reference_logprobs=batch.get("reference_logprobs"),
                              sampling_logprobs=batch["sampling_logprobs"])

    updates = train["updates_per_rollout"]
    progress = Progress(train["steps"], "grpo")
    passes = grpo_logprob_passes(config)
    progress.write(describe("grpo", cfg, fused, parallel_state,
                            f"; GRPO {config.loss_type}, log-prob passes: old "
                            f"{'yes' if passes['old'] else 'no'}, reference "
                            f"{'yes' if passes['reference'] else 'no'}"))
    # the simulated engine noise: the same on the ranks of a tensor-parallel group (they score the
    # same samples), different across data-parallel replicas
    g = torch.Generator().manual_seed(train["seed"] + parallel_state.get_data_parallel_rank())
    for step in range(train["steps"]):
        batches, reward = mock_rollout(cfg, parallel_state, step)
        batches = on_this_cp_rank(batches)  # (the advantages, one per sequence, stay whole)
        ran = logprob_passes(model, reference, batches, config, post, cfg, g)
        if step == 0 and args.compare_unfused:
            progress.write(compare_unfused(model, fused, batches, make_loss_func, parallel_state,
                                           "loss"))
        if len(batches) % updates:
            raise SystemExit("micro-batches per rank must be a multiple of updates_per_rollout")
        per_update = len(batches) // updates
        metrics = []
        for u in range(updates):
            optimizer.zero_grad()
            with progress.measure_memory(model):
                metrics += run_batches(model, batches[u * per_update:(u + 1) * per_update],
                                       make_loss_func)
            optimizer.step()
        reduced = reduce_metrics(metrics, parallel_state)
        shown = {k: reduced[k] for k in ("loss", "kl", "ratio_mean", "is_ratio_mean") if k in reduced}
        if post.filters and "num_excluded_tokens" in reduced and config.normalizer_unit == "tokens":
            per_kept = reduced["num_excluded_tokens"]  # excluded per counted (kept) loss token
            shown["excluded"] = per_kept / (1.0 + per_kept)
        tokens = cfg["rollout"]["num_prompts"] * cfg["rollout"]["samples_per_prompt"] * seq
        progress.update(shown, tokens=tokens * (1 + len(ran)), reward=f"{reward:.3f}",
                        passes="+".join(ran))
    progress.close()
    shutdown()


if __name__ == "__main__":
    main()
