"""Losses on per-token log-probs: SFT (NLL), DPO and the GRPO family; and the two fused losses whose
gradients are made in the forward pass from hidden states (``linear_cross_entropy``,
``linear_grpo_loss``: ops/forward_grad.py is their contract).

Pure functions of tensors: they give the same result on log-probs from ``linear_logprobs`` (no
logits tensor) and on ``log_softmax`` of materialized logits. Each returns ``(loss, metrics)`` with
a 0-dim loss and a dict of detached 0-dim metrics.

Data parallelism is handled through ``normalizer`` (> 0): pass the global count (tokens, pairs or
sequences, as each loss documents) and the per-rank gradients add up to the gradient of the whole
batch; ``normalizer=1`` returns a plain sum (Megatron's ``calculate_per_token_loss``).

Context parallelism is handled through ``cp_group``: each rank passes its slice of every sequence
and the losses sum what they need over the group (``context_parallel.py``); the loss and metrics
are then the CP=1 values on every rank, and each rank's gradient the CP=1 gradient at its tokens.

A token whose log-prob is ``-inf`` (outside a top-k / top-p / min-p sampler's kept set) is treated
as masked and counted in the ``num_excluded_tokens`` metric (see ``nll.py``).

    from megatron_fused_ce.losses import GRPOConfig, grpo_loss
    config = GRPOConfig(loss_type="dapo", beta=0.0)
    if config.needs_reference_logprobs: ...   # False: skip the reference pass
    loss, metrics = grpo_loss(logprobs, advantages, mask, config, old_logprobs=old)
"""

from .dpo import DPO_LOSS_TYPES, dpo_loss
from .grpo import (
    GRPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    PPO_CLIP_LOSS_TYPES,
    SAPO_REDUCTIONS,
    GRPOConfig,
    grpo_loss,
)
from .linear_cross_entropy import linear_cross_entropy
from .linear_grpo import linear_grpo_loss
from .nll import masked_mean, masked_sum, nll_loss, safe_divide


__all__ = [
    "nll_loss",
    "dpo_loss",
    "GRPOConfig",
    "grpo_loss",
    "linear_grpo_loss",
    "linear_cross_entropy",
    "masked_sum",
    "masked_mean",
    "safe_divide",
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "PPO_CLIP_LOSS_TYPES",
    "KL_ESTIMATORS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_CORRECTIONS",
    "SAPO_REDUCTIONS",
]
