"""Direct Preference Optimization on per-token log-probs (design.md §3, "DPO").

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

from .nll import Normalizer, as_weights, masked_mean, masked_sum, nll_loss, safe_divide

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")

__all__ = ["DPO_LOSS_TYPES", "dpo_loss", "sequence_scores"]


def sequence_scores(logprobs: torch.Tensor, weights: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence score ``s = Σ_t m·lp`` (``/ Σ_t m`` if ``average``; 0 for an empty sequence)."""
    total = masked_sum(logprobs, weights, dim=-1)
    return safe_divide(total, weights.sum(-1)) if average else total


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


def _validate(policy_logprobs, reference_logprobs, mask, beta, loss_type, label_smoothing):
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if label_smoothing != 0.0 and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing is only defined for loss_type='sigmoid', got {loss_type!r}")
    if policy_logprobs.dim() != 2:
        raise ValueError(f"policy_logprobs must be [2*pairs, T], got shape {tuple(policy_logprobs.shape)}")
    if policy_logprobs.shape[0] % 2 != 0:
        raise ValueError("policy_logprobs must have an even number of rows "
                         "(chosen = rows 0::2, rejected = rows 1::2)")
    for name, tensor in (("reference_logprobs", reference_logprobs), ("mask", mask)):
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
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """DPO / IPO / hinge preference loss plus an optional SFT term on the chosen responses.

    Args:
        policy_logprobs: ``[2P, T]`` per-token log-probs of the policy; chosen = rows ``0::2``,
            rejected = rows ``1::2``.
        reference_logprobs: ``[2P, T]`` the same under the reference model; a constant (detached).
        mask: ``[2P, T]`` float or bool weights (loss mask × tool mask).
        beta: β > 0.
        loss_type: ``"sigmoid"`` (DPO, with ``label_smoothing`` ε: conservative DPO), ``"ipo"``,
            ``"hinge"``.
        average_log_probs: score a sequence by its mean instead of its sum of log-probs.
        sft_weight, preference_weight: weights of the two terms.
        normalizer: ``N_p``, the global number of pairs (all micro-batches and data-parallel
            ranks); default: the local number of pairs.
        sft_normalizer: normalizer of the SFT term, the global number of chosen loss tokens;
            default: the local ``Σ m`` over chosen rows (see ``nll_loss``).

    Returns:
        ``(loss, metrics)``. Metrics (detached, means over local pairs): ``loss``,
        ``preference_loss`` (``Σ_p L_p / N_p``), ``sft_loss``, ``rewards_chosen``
        (``β(s_c - s_c_ref)``), ``rewards_rejected``, ``reward_margin``, ``accuracy``
        (fraction of pairs with ``rewards_chosen > rewards_rejected``).
    """
    _validate(policy_logprobs, reference_logprobs, mask, beta, loss_type, label_smoothing)
    weights = as_weights(mask, policy_logprobs)
    policy_scores = sequence_scores(policy_logprobs, weights, average_log_probs)
    reference_scores = sequence_scores(reference_logprobs.detach().to(policy_logprobs.dtype),
                                       weights, average_log_probs)
    chosen_logratio = policy_scores[0::2] - reference_scores[0::2]
    rejected_logratio = policy_scores[1::2] - reference_scores[1::2]
    margin = chosen_logratio - rejected_logratio

    num_pairs = margin.shape[0]
    per_pair = preference_loss_per_pair(margin, beta, loss_type, label_smoothing)
    preference = safe_divide(per_pair.sum(), num_pairs if normalizer is None else normalizer)
    sft, _ = nll_loss(policy_logprobs[0::2], mask[0::2], normalizer=sft_normalizer)

    loss = preference_weight * preference
    if sft_weight != 0.0:  # skip the term entirely so it cannot leak into the gradient
        loss = loss + sft_weight * sft

    with torch.no_grad():
        pair_weights = torch.ones_like(margin)
        rewards_chosen = beta * chosen_logratio
        rewards_rejected = beta * rejected_logratio
        metrics = {
            "loss": loss.detach(),
            "preference_loss": preference.detach(),
            "sft_loss": sft.detach(),
            "rewards_chosen": masked_mean(rewards_chosen, pair_weights),
            "rewards_rejected": masked_mean(rewards_rejected, pair_weights),
            "reward_margin": masked_mean(rewards_chosen - rewards_rejected, pair_weights),
            "accuracy": masked_mean((rewards_chosen > rewards_rejected).to(margin.dtype), pair_weights),
        }
    return loss, metrics
