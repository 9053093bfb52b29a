"""Negative log-likelihood (SFT / pretraining) on per-token log-probs.

This module also holds the small masked reductions that the DPO and GRPO losses share. They all
follow two rules:

* a masked-out position never reaches the result, even when it holds ``inf``/``NaN`` (padding
  positions of materialized logits may hold anything), and it receives a zero gradient;
* a reduction over zero valid tokens is ``0.0`` with zero gradients, never ``NaN``.

A mask is a float weight per token (the product of the loss mask and, for agentic rollouts, the
tool mask); a bool mask is read as 0/1 weights.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

Normalizer = Union[int, float, torch.Tensor]

__all__ = [
    "nll_loss",
    "as_weights",
    "masked_sum",
    "masked_mean",
    "masked_min_max",
    "safe_divide",
]


def as_weights(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as float weights with the dtype and device of ``like``."""
    return mask.to(dtype=like.dtype, device=like.device)


def safe_divide(numerator: torch.Tensor, denominator: Normalizer) -> torch.Tensor:
    """``numerator / denominator``, and 0 where the denominator is 0.

    Only used where a zero denominator means "no valid tokens", so the numerator is 0 as well;
    dividing by 1 there keeps both the value and the gradient finite. The denominator is a count
    and never carries a gradient.
    """
    den = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device).detach()
    return numerator / torch.where(den != 0, den, torch.ones_like(den))


def masked_sum(values: torch.Tensor, weights: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``Σ weights·values`` (over ``dim``, or everything), ignoring values where the weight is 0."""
    # where() first: 0·inf would be NaN, and the masked positions must get exactly zero gradient.
    values = torch.where(weights != 0, values, torch.zeros_like(values))
    product = values * weights
    return product.sum() if dim is None else product.sum(dim)


def masked_mean(values: torch.Tensor, weights: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Weighted mean ``Σ w·v / Σ w``; 0 where ``Σ w`` is 0."""
    total_weight = weights.sum() if dim is None else weights.sum(dim)
    return safe_divide(masked_sum(values, weights, dim), total_weight)


@torch.no_grad()
def masked_min_max(values: torch.Tensor, weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``values`` over positions with a nonzero weight (for metrics; detached).

    Both are 0 when no position is valid.
    """
    zero = values.new_zeros(())
    if values.numel() == 0:
        return zero, zero.clone()
    valid = weights != 0
    any_valid = valid.any()
    # Fill masked positions with ±inf instead of indexing: no host sync, no dynamic shapes.
    smallest = values.masked_fill(~valid, float("inf")).min()
    largest = values.masked_fill(~valid, float("-inf")).max()
    return torch.where(any_valid, smallest, zero), torch.where(any_valid, largest, zero)


def nll_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: Optional[Normalizer] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Masked negative log-likelihood ``L = -Σ m·lp / N``.

    Args:
        logprobs: per-token log-probs of the targets, any shape (e.g. ``[B, T]``).
        mask: same shape; float weights or bool (loss mask × tool mask).
        normalizer: ``N``. Pass the global number of loss tokens (all micro-batches and
            data-parallel ranks) so that per-rank gradients add up to the gradient of the whole
            batch; ``1`` gives the plain sum. Default: the local ``Σ m``.

    Returns:
        ``(loss, metrics)``; ``loss`` is a 0-dim tensor, ``metrics`` holds detached ``loss`` and
        ``num_tokens`` (the local ``Σ m``). With no valid token the loss is 0 with zero gradients.
    """
    if logprobs.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(logprobs.shape)}")
    weights = as_weights(mask, logprobs)
    num_tokens = weights.sum()
    loss = safe_divide(-masked_sum(logprobs, weights), num_tokens if normalizer is None else normalizer)
    metrics = {"loss": loss.detach(), "num_tokens": num_tokens.detach()}
    return loss, metrics
