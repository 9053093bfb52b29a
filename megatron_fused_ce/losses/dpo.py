"""Direct Preference Optimization on per-token log-probs.

Layout (NeMo-RL): the batch interleaves pairs, chosen = rows ``0::2``, rejected = rows ``1::2``.
For pair p, with ``s = Σ_t m·lp`` (or ``Σ_t m·lp / Σ_t m`` with ``average_log_probs``) and
``s_ref`` the same on the reference log-probs::

    h   = (s_c - s_c_ref) - (s_r - s_r_ref)
    L_p = -(1-ε)·logσ(β·h) - ε·logσ(-β·h)     "sigmoid"   (ε = label_smoothing)
        = (h - 1/(2β))²                       "ipo"
        = relu(1 - β·h)                       "hinge"
    loss = preference_weight · Σ_p L_p / N_p + sft_weight · NLL(chosen rows)
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..ops.agreement import flag_argument
from .context_parallel import agree_on_inputs, sum_over_cp
from .nll import (Normalizer, as_weights, at_least_fp32, check_bool, check_normalizer, check_number,
                  exclude_impossible_tokens, given_count, masked_sum, safe_divide)

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")

__all__ = ["DPO_LOSS_TYPES", "dpo_loss"]


def preference_loss_per_pair(
    margin: torch.Tensor, beta: float, loss_type: str, label_smoothing: float
) -> torch.Tensor:
    """``L_p`` from the implicit-reward margin ``h`` (one value per pair)."""
    if loss_type == "sigmoid":
        return (-(1.0 - label_smoothing) * F.logsigmoid(beta * margin)
                - label_smoothing * F.logsigmoid(-beta * margin))
    if loss_type == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * margin)
    raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")


def _validate(policy_logprobs, reference_logprobs, mask, beta, loss_type, label_smoothing,
              average_log_probs, sft_weight, preference_weight, normalizer, sft_normalizer):
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    check_number("beta", beta)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    check_number("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if label_smoothing != 0.0 and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing is only defined for loss_type='sigmoid', got {loss_type!r}")
    check_bool("average_log_probs", average_log_probs)
    for name, weight in (("sft_weight", sft_weight), ("preference_weight", preference_weight)):
        check_number(name, weight)
        if not weight >= 0:
            raise ValueError(f"{name} must be >= 0, got {weight}")
    check_normalizer("normalizer", normalizer)
    check_normalizer("sft_normalizer", sft_normalizer)
    tensors = (("policy_logprobs", policy_logprobs), ("reference_logprobs", reference_logprobs),
               ("mask", mask))
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if policy_logprobs.dim() != 2:
        raise ValueError(f"policy_logprobs must be [2*pairs, T], got shape {tuple(policy_logprobs.shape)}")
    if policy_logprobs.shape[0] % 2 != 0:
        raise ValueError("policy_logprobs must have an even number of rows "
                         "(chosen = rows 0::2, rejected = rows 1::2)")
    for name, tensor in tensors[1:]:
        if tensor.shape != policy_logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != policy_logprobs shape "
                             f"{tuple(policy_logprobs.shape)}")


def dpo_loss(
    policy_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    average_log_probs: bool = False,
    sft_weight: float = 0.0,
    preference_weight: float = 1.0,
    normalizer: Optional[Normalizer] = None,
    sft_normalizer: Optional[Normalizer] = None,
    cp_group=None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """DPO / IPO / hinge preference loss plus an optional SFT term on the chosen responses.

    Args:
        policy_logprobs: ``[2P, T]`` per-token log-probs of the policy; chosen = rows ``0::2``,
            rejected = rows ``1::2``.
        reference_logprobs: ``[2P, T]`` the same under the reference model; a constant (detached).
        mask: ``[2P, T]`` float or bool weights (loss mask × tool mask).
        beta: β > 0 (finite).
        loss_type: ``"sigmoid"`` (DPO, with ``label_smoothing`` ε: conservative DPO), ``"ipo"``,
            ``"hinge"``.
        average_log_probs: score a sequence by its mean instead of its sum of log-probs.
        sft_weight, preference_weight: weights (finite, >= 0) of the two terms.
        normalizer: ``N_p`` > 0, the global number of pairs (all micro-batches and data-parallel
            ranks); default: the local number of pairs.
        sft_normalizer: normalizer (> 0) of the SFT term, the global number of chosen loss tokens;
            default: ``Σ m`` over the chosen rows' non-excluded tokens (see ``nll_loss``).
        cp_group: context-parallel group: each rank passes its slice ``[2P, T_local]`` of every
            sequence; the per-sequence sums are added up over the group, so the loss and metrics
            are those of CP=1 on every rank (``megatron_fused_ce.losses.context_parallel``).

    Excluded tokens: a token whose policy *or* reference log-prob is ``-inf`` (outside a sampler's
    kept set) is dropped from both scores of its sequence, so that ``s - s_ref`` compares the same
    tokens, and from the SFT term; it gets zero gradient and is counted in
    ``num_excluded_tokens``. An explicit ``sft_normalizer`` is used as given.

    Returns:
        ``(loss, metrics)``. Metrics (detached, means over local pairs): ``loss``,
        ``preference_loss`` (``Σ_p L_p / N_p``), ``sft_loss``, ``rewards_chosen``
        (``β(s_c - s_c_ref)``), ``rewards_rejected``, ``reward_margin``, ``accuracy``
        (fraction of pairs with ``rewards_chosen > rewards_rejected``), ``num_excluded_tokens``.
    """
    average_log_probs = flag_argument(average_log_probs)
    agree_on_inputs(
        "dpo_loss",
        lambda: _validate(policy_logprobs, reference_logprobs, mask, beta, loss_type, label_smoothing,
                          average_log_probs, sft_weight, preference_weight, normalizer, sft_normalizer),
        cp_group=cp_group, device=getattr(policy_logprobs, "device", None),
        batch_size=policy_logprobs.shape[0] if isinstance(policy_logprobs, torch.Tensor)
        and policy_logprobs.dim() > 0 else None,
        flags=[("normalizer", normalizer is not None), ("sft_normalizer", sft_normalizer is not None)])
    policy_logprobs = at_least_fp32(policy_logprobs)
    reference = reference_logprobs.detach().to(policy_logprobs.dtype)
    weights, excluded = exclude_impossible_tokens(as_weights(mask, policy_logprobs),
                                                  policy_logprobs, reference)
    # Every sequence-level sum at once: one CP all-reduce.
    sums = sum_over_cp({
        "policy": masked_sum(policy_logprobs, weights, dim=-1),
        "reference": masked_sum(reference, weights, dim=-1),
        "tokens": weights.sum(-1),
        "excluded": excluded.sum().to(weights.dtype),
    }, cp_group)
    policy_scores, reference_scores = sums["policy"], sums["reference"]
    if average_log_probs:
        policy_scores = safe_divide(policy_scores, sums["tokens"])
        reference_scores = safe_divide(reference_scores, sums["tokens"])
    chosen_logratio = policy_scores[0::2] - reference_scores[0::2]
    rejected_logratio = policy_scores[1::2] - reference_scores[1::2]
    margin = chosen_logratio - rejected_logratio

    num_pairs = margin.shape[0]
    per_pair = preference_loss_per_pair(margin, beta, loss_type, label_smoothing)
    preference = safe_divide(per_pair.sum(), num_pairs if normalizer is None else given_count(normalizer, margin))
    chosen_tokens = sums["tokens"][0::2].sum()
    sft = safe_divide(-sums["policy"][0::2].sum(),
                      chosen_tokens if sft_normalizer is None else given_count(sft_normalizer, margin))

    loss = preference_weight * preference
    if sft_weight != 0.0:  # skip the term entirely so it cannot leak into the gradient
        loss = loss + sft_weight * sft

    with torch.no_grad():
        rewards_chosen = beta * chosen_logratio
        rewards_rejected = beta * rejected_logratio

        def pair_mean(values):
            return safe_divide(values.sum(), num_pairs)

        metrics = {
            "loss": loss.detach(),
            "preference_loss": preference.detach(),
            "sft_loss": sft.detach(),
            "rewards_chosen": pair_mean(rewards_chosen),
            "rewards_rejected": pair_mean(rewards_rejected),
            "reward_margin": pair_mean(rewards_chosen - rewards_rejected),
            "accuracy": pair_mean((rewards_chosen > rewards_rejected).to(margin.dtype)),
            "num_excluded_tokens": sums["excluded"].detach(),
        }
    return loss, metrics
