"""Megatron `loss_func` factories for SFT / pretraining, DPO and GRPO on per-token log-probs.

A Megatron `forward_step_func` returns `(output_tensor, loss_func)`; the schedule calls
`loss_func(output_tensor)` on the last pipeline stage. The factories here build that callable for
one micro-batch:

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return output, sft_loss_func(post_processor, model, batch["labels"], batch["loss_mask"])

Each loss func returns `(loss_sum, count, {name: tensor([sum, count])})`, Megatron's contract for
`calculate_per_token_loss=True`: `loss_sum` is *not* normalized; the schedule adds up `count` over
micro-batches and `finalize_model_grads` divides the gradients by the total over data-parallel
ranks. So the gradient is that of the design-§3 loss with the *global* normalizer, without knowing
it in advance. The count is what the loss is normalized by: loss tokens (SFT; GRPO's token-level
types), preference pairs (DPO) or sequences (GRPO's `grpo` / `dr_grpo`). Each metric is a
`[sum, count]` pair, so that summing pairs over micro-batches and ranks and dividing gives the
count-weighted mean (Megatron-LM's training loop does exactly this).

A mask is the loss mask (× tool mask): float weights or bool. The count is the number of positions
with a non-zero weight (Megatron keeps counts as ints); for 0/1 masks this is `Σ mask`.

With fusion on, SFT (0/1 mask) and GRPO go through the gradients-in-forward losses
(`linear_cross_entropy`, `linear_grpo_loss`): the weight and input gradients are produced while
the chunk's logits are in hand, 3 GEMMs per chunk instead of 4. The value and every gradient are
those of the log-probs path (`linear_logprobs` + `megatron_fused_ce.losses`), which is used
otherwise (DPO, weighted masks, entropy requested, logits input).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from megatron_fused_ce import linear_cross_entropy
from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, linear_grpo_loss, nll_loss

from .output_layer import run_in_output_layer
from .postprocess import LogprobsPostProcessor, packed_sequence_labels

LossFunc = Callable[[Tensor], tuple]


def _pairs(metrics: Dict[str, Tensor], count: Tensor, sums: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """`{name: [mean·count, count]}` for mean metrics, `{name: [sum, count]}` for given sums."""
    count = count.to(torch.float32)
    out = {name: torch.stack([value.detach().float(), count]) for name, value in sums.items()}
    for name, value in metrics.items():
        if name not in out:
            out[name] = torch.stack([value.detach().float() * count, count])
    return out


def _scored_mask(loss_mask: Tensor, labels: Tensor, cu_seqlens: Optional[Tensor],
                 ignore_index: int) -> Tensor:
    """The loss mask, zero where the post-processor does not score a token (packed boundaries,
    ignored labels)."""
    scored = packed_sequence_labels(labels, cu_seqlens, ignore_index) != ignore_index
    return torch.where(scored, loss_mask.float(), torch.zeros((), device=loss_mask.device))


def _count(mask: Tensor) -> Tensor:
    return (mask != 0).sum().to(torch.int)


def _without_excluded(mask: Tensor, *logprobs: Optional[Tensor]) -> Tensor:
    """The mask, zero at tokens the losses exclude (a -inf log-prob: the label is outside a
    sampler's kept set), so that Megatron's count is of the tokens that do reach the loss."""
    for values in logprobs:
        if values is not None:
            mask = torch.where(values.detach() == float("-inf"), torch.zeros_like(mask), mask)
    return mask


def _in_label_layout(mask: Tensor, inputs: dict) -> Tensor:
    """A `[b, s]` mask in the layout of the fused op's labels (`[s, b]` under sequence parallel)."""
    return mask.t() if inputs["sequence_parallel"] else mask


# ------------------------------------------------------------------------------------------------
# SFT / pretraining
# ------------------------------------------------------------------------------------------------
def sft_loss_func(post_processor: LogprobsPostProcessor, model: torch.nn.Module, labels: Tensor,
                  loss_mask: Tensor, *, cu_seqlens: Optional[Tensor] = None) -> LossFunc:
    """Token-level NLL: `loss_sum = -Σ m·lp`, count = loss tokens; metric `"lm loss"`."""

    def loss_func(output_tensor: Tensor):
        mask = _scored_mask(loss_mask, labels, cu_seqlens, post_processor.ignore_index)
        count = _count(mask)
        inputs = None if getattr(post_processor, "filters", False) else \
            post_processor.fused_inputs(output_tensor, model, labels, cu_seqlens=cu_seqlens)
        if inputs is not None and bool(((mask == 0) | (mask == 1)).all()):
            # Σ over loss tokens of -log p(label) = the summed cross-entropy of those tokens.
            keep = _in_label_layout(mask, inputs) != 0
            inputs["labels"] = torch.where(keep, inputs["labels"], post_processor.ignore_index)
            loss_sum = run_in_output_layer(model, linear_cross_entropy, **inputs, reduction="sum")
        else:
            lp = post_processor(output_tensor, model, labels, cu_seqlens=cu_seqlens).logprobs
            loss_sum, _ = nll_loss(lp, mask, normalizer=1)
            count = _count(_without_excluded(mask, lp))
        return loss_sum, count, _pairs({}, count, {"lm loss": loss_sum})

    return loss_func


# ------------------------------------------------------------------------------------------------
# DPO
# ------------------------------------------------------------------------------------------------
def dpo_loss_func(post_processor: LogprobsPostProcessor, model: torch.nn.Module, labels: Tensor,
                  loss_mask: Tensor, reference_logprobs: Tensor, *,
                  global_num_pairs: Optional[int] = None,
                  global_num_sft_tokens: Optional[int] = None, **dpo_kwargs) -> LossFunc:
    """DPO on interleaved pairs (chosen = rows 0::2, rejected = rows 1::2); count = local pairs.

    `reference_logprobs` `[2P, s]` come from a forward-only pass of the reference model
    (`compute_logprobs`). `dpo_kwargs` go to `megatron_fused_ce.losses.dpo_loss` (beta, loss_type,
    label_smoothing, average_log_probs, sft_weight, preference_weight).

    The SFT term is normalized by chosen tokens, the preference term by pairs, while Megatron
    divides everything by the total pair count; the SFT term is therefore rescaled by
    `global pairs / global chosen tokens`. Pass both global counts for an exact result with
    several micro-batches or data-parallel ranks; without them the micro-batch's own ratio is used.
    """
    for key in ("normalizer", "sft_normalizer"):
        if key in dpo_kwargs:
            raise ValueError(f"dpo_loss_func sets {key} itself (Megatron normalizes by pair count)")

    def loss_func(output_tensor: Tensor):
        lp = post_processor(output_tensor, model, labels).logprobs
        mask = _scored_mask(loss_mask, labels, None, post_processor.ignore_index)
        pairs = torch.tensor(lp.shape[0] // 2, dtype=torch.int, device=lp.device)
        chosen_mask = mask[0::2]
        if global_num_pairs is not None and global_num_sft_tokens is not None:
            sft_normalizer = global_num_sft_tokens / global_num_pairs
        else:  # no chosen token: the SFT sum is 0 whatever the (positive) normalizer
            chosen_tokens = chosen_mask.sum()
            sft_normalizer = torch.where(chosen_tokens > 0, chosen_tokens, 1.0) / max(int(pairs), 1)
        loss_sum, metrics = dpo_loss(lp, reference_logprobs, mask, normalizer=1,
                                     sft_normalizer=sft_normalizer, **dpo_kwargs)
        with torch.no_grad():
            sft_sum, _ = nll_loss(lp[0::2], chosen_mask, normalizer=1)
        out = _pairs(metrics, pairs, {"loss": loss_sum, "preference_loss": metrics["preference_loss"],
                                      "num_excluded_tokens": metrics["num_excluded_tokens"]})
        out["sft_loss"] = torch.stack([sft_sum.float(), chosen_mask.sum().float()])
        return loss_sum, pairs, out

    return loss_func


# ------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------
def grpo_logprob_passes(config: GRPOConfig) -> Dict[str, bool]:
    """Which forward-only log-prob passes a GRPO step must run before training on a batch.

    `reference`: only with a KL penalty (`beta > 0`). `old`: not with `force_on_policy_ratio`
    (the loss then uses the current log-probs, detached). Everything else is skipped.
    """
    return {"reference": config.needs_reference_logprobs, "old": config.needs_old_logprobs}


def grpo_loss_func(post_processor: LogprobsPostProcessor, model: torch.nn.Module, labels: Tensor,
                   loss_mask: Tensor, advantages: Tensor, config: GRPOConfig, *,
                   old_logprobs: Optional[Tensor] = None,
                   reference_logprobs: Optional[Tensor] = None,
                   sampling_logprobs: Optional[Tensor] = None) -> LossFunc:
    """GRPO-family loss (`megatron_fused_ce.losses.grpo_loss`) on one micro-batch of rollouts.

    `loss_mask` is the loss mask × tool mask over the `[B, s]` rollout rows (0 on prompt, padding
    and tool tokens); `advantages` `[B]` or `[B, s]`. The count is loss tokens for
    dapo/bnpo/cispo/sapo and sequences for grpo/dr_grpo (`config.normalizer_unit`), so the
    reduction is over the whole global batch. Pass `old_logprobs` / `reference_logprobs` only when
    `grpo_logprob_passes(config)` asks for them; `sampling_logprobs` (inference engine) enable
    the importance-sampling correction. The post-processor's entropy, if on, is reported.

    Rollouts sampled with top-k / top-p / min-p: give the post-processor the rollout's sampler
    settings (`LogprobsPostProcessor(..., top_k=, top_p=, min_p=)`, and use the same one for the
    old-policy pass): the log-probs are then those of the distribution the engine sampled from, a
    token outside the trainer's kept set gets -inf and is excluded (`num_excluded_tokens`) and
    left out of the count. This takes the log-probs path (no gradients in the forward pass).
    """
    if config.needs_reference_logprobs and reference_logprobs is None:
        raise ValueError(f"reference_logprobs are required when beta > 0 (beta={config.beta})")

    def loss_func(output_tensor: Tensor):
        mask = _scored_mask(loss_mask, labels, None, post_processor.ignore_index)
        kwargs = dict(old_logprobs=old_logprobs, sampling_logprobs=sampling_logprobs, normalizer=1,
                      reference_logprobs=reference_logprobs if config.needs_reference_logprobs else None)
        inputs = None if post_processor.return_entropy or getattr(post_processor, "filters", False) else \
            post_processor.fused_inputs(output_tensor, model, labels)
        policy_logprobs = None
        if inputs is not None:
            loss_sum, metrics = run_in_output_layer(model, linear_grpo_loss, advantages=advantages,
                                                    mask=mask, config=config, **inputs, **kwargs)
        else:
            out = post_processor(output_tensor, model, labels)
            policy_logprobs = out.logprobs
            loss_sum, metrics = grpo_loss(out.logprobs, advantages, mask, config, **kwargs,
                                          entropy=out.entropy)
        # Megatron's count: the tokens (sequences) that reach the loss, excluded ones left out
        old = None if config.force_on_policy_ratio else old_logprobs
        mask = _without_excluded(mask, policy_logprobs, old, sampling_logprobs)
        if config.normalizer_unit == "sequences" and (config.count_empty_sequences or not config.per_sequence_mean):
            count = torch.tensor(mask.shape[0], dtype=torch.int, device=mask.device)
        elif config.normalizer_unit == "sequences":  # sequences with a loss token
            count = (mask != 0).any(-1).sum().to(torch.int)
        else:
            count = _count(mask)
        # loss, pg_loss, kl and num_excluded_tokens are sums here (normalizer=1); the rest are means.
        sums = {name: metrics[name] for name in ("loss", "pg_loss", "kl", "num_excluded_tokens")}
        return loss_sum, count, _pairs(metrics, count, sums)

    return loss_func
