"""Negative log-likelihood (SFT / pretraining) on per-token log-probs.

This module also holds the small masked reductions that the DPO and GRPO losses share. They all
follow two rules:

* a masked-out position never reaches the result, even when it holds ``inf``/``NaN`` (padding
  positions of materialized logits may hold anything), and it receives a zero gradient;
* a reduction over zero valid tokens is ``0.0`` with zero gradients, never ``NaN``.

A mask is a float weight per token (the product of the loss mask and, for agentic rollouts, the
tool mask); a bool mask is read as 0/1 weights.

Excluded tokens: a token whose log-prob is ``-inf`` (its label lies outside the set that a
top-k / top-p / min-p sampler keeps, so the trainer's distribution says it could not have been
sampled) is treated as masked: zero weight, zero gradient, not counted in any default normalizer.
Each loss reports how many there were as ``num_excluded_tokens``.
"""

from __future__ import annotations

import math
import numbers
from typing import Dict, Optional, Tuple, Union

import torch

from ..ops import deferred_errors
from .context_parallel import agree_on_inputs, sum_over_cp

Normalizer = Union[int, float, torch.Tensor]

__all__ = [
    "nll_loss",
    "as_weights",
    "check_normalizer",
    "given_count",
    "check_number",
    "check_bool",
    "exclude_impossible_tokens",
    "masked_sum",
    "masked_mean",
    "safe_divide",
]


def at_least_fp32(logprobs: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 log-probs as fp32 (their gradient flows back in their own dtype), others as they
    are: the losses sum hundreds of log-probs per sequence or batch, and in bf16 a sum near -1000
    moves in steps of 4, where a DPO margin (a difference of two such sums) or a loss value lives
    in the last digits (a bf16 margin of 0 for a float64 one of -0.022)."""
    return logprobs.float() if logprobs.dtype in (torch.bfloat16, torch.float16) else logprobs


def as_weights(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as float weights with the dtype and device of ``like``."""
    return mask.to(dtype=like.dtype, device=like.device)


def check_number(name: str, value, *, optional: bool = False) -> None:
    """``value`` must be a finite real number (not a bool), or None if ``optional``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{' or None' if optional else ''}, got {value!r}")


def check_bool(name: str, value) -> None:
    """``value`` must be a bool (a truthy string such as 'no' must not switch an option on)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_normalizer(name: str, value: Optional[Normalizer]) -> None:
    """A normalizer is a count: a finite number > 0 (or None = the loss's default).

    A tensor must have one real element. Its value is read here where that costs no host
    synchronization (a CPU tensor); a count on a GPU (a global token count from an all-reduce,
    given on every micro-batch) is checked where it is used instead (`given_count`): NaN results
    and a ValueError at the package's next host synchronization, as the op's contents checks.
    """
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name} must be a number or a one-element real tensor, got a "
                             f"{value.dtype} tensor of shape {tuple(value.shape)}")
        if not read_on_host(value):
            return
        number = value.detach().item()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = value
    else:
        raise ValueError(f"{name} must be a number > 0 or a one-element tensor, got {value!r}")
    if not is_count(number):
        raise ValueError(f"{name} must be a finite number > 0, got {number!r}")


def read_on_host(count: torch.Tensor) -> bool:
    """Whether a normalizer tensor's value is checked on the host (check_normalizer) rather than on
    its device (given_count): where reading it is no host synchronization."""
    return count.device.type == "cpu"


def is_count(number: float) -> bool:
    """Whether a normalizer's value is a finite number > 0."""
    return math.isfinite(number) and number > 0


def given_count(value: Normalizer, like: Optional[torch.Tensor] = None, *, dtype: Optional[torch.dtype] = None,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """A given normalizer as a 0-d tensor of ``like``'s dtype and device (or those given; a Python
    number by a fill kernel: a copy from the host would make the host wait), NaN where it is not a
    finite count > 0, recorded for the next host synchronization (ops/deferred_errors.py), so that
    no loss is silently scaled by it: a count on a GPU checked there (check_normalizer did not read
    it), a number or a CPU count on the host where a path skipped check_normalizer (a remembered
    route; raising on one rank alone would leave its peers in the next collective)."""
    dtype, device = (like.dtype, like.device) if like is not None else (dtype, device)
    if isinstance(value, torch.Tensor):
        count = value.detach().to(dtype=dtype, device=device).reshape(())
        if not read_on_host(value):
            # not in (0, inf) where clamping into [the smallest normal, the largest finite]
            # changes it (NaN too): five small kernels, no scalar tensor made on the device
            limits = torch.finfo(count.dtype)
            bad = count.clamp(min=limits.tiny, max=limits.max).ne(count)
            deferred_errors.record(bad * deferred_errors.BAD_NORMALIZER)
            return count.masked_fill(bad, math.nan)
        if is_count(float(value.detach().item())):  # (a CPU value: no synchronization)
            return count
    elif is_count(float(value)):
        return torch.full((), float(value), dtype=dtype, device=device)
    deferred_errors.record(torch.full((), deferred_errors.BAD_NORMALIZER, dtype=torch.int64, device=device))
    return torch.full((), math.nan, dtype=dtype, device=device)


def exclude_impossible_tokens(weights: torch.Tensor, *logprobs: Optional[torch.Tensor]):
    """``(weights, excluded)``: the weights with 0 wherever one of ``logprobs`` is ``-inf``, and the
    bool map of the weighted tokens so dropped (see the module doc). ``None`` entries are skipped."""
    impossible = torch.zeros_like(weights, dtype=torch.bool)
    for values in logprobs:
        if values is not None:
            impossible |= values.detach() == float("-inf")
    excluded = impossible & (weights != 0)
    return torch.where(excluded, torch.zeros_like(weights), weights), excluded


def safe_divide(numerator: torch.Tensor, denominator: Normalizer) -> torch.Tensor:
    """``numerator / denominator``, and 0 where the denominator is 0.

    Only used where a zero denominator means "no valid tokens", so the numerator is 0 as well;
    dividing by 1 there keeps both the value and the gradient finite. The denominator is a count
    and never carries a gradient.
    """
    den = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device).detach()
    if den.numel() == 1:
        den = den.reshape(())  # a one-element normalizer tensor keeps the loss 0-dim
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


def nll_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: Optional[Normalizer] = None,
    cp_group=None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Masked negative log-likelihood ``L = -Σ m·lp / N``.

    Args:
        logprobs: per-token log-probs of the targets, any shape (e.g. ``[B, T]``). A ``-inf`` entry
            is an excluded token (module doc): masked out and counted in ``num_excluded_tokens``.
        mask: same shape; float weights or bool (loss mask × tool mask).
        normalizer: ``N`` > 0. Pass the global number of loss tokens (all micro-batches and
            data-parallel ranks) so that per-rank gradients add up to the gradient of the whole
            batch; ``1`` gives the plain sum. Default: ``Σ m`` over the non-excluded tokens (summed
            over ``cp_group``). An explicit normalizer is used as given: excluded tokens leave the
            numerator only (subtract the global ``num_excluded_tokens`` to drop them from it too).
        cp_group: context-parallel group; each rank passes its slice of the tokens (see
            ``megatron_fused_ce.losses.context_parallel``). The loss and metrics are then the same
            on every rank and equal to the CP=1 values.

    Returns:
        ``(loss, metrics)``; ``loss`` is a 0-dim tensor, ``metrics`` holds detached ``loss``,
        ``num_tokens`` (``Σ m`` over non-excluded tokens) and ``num_excluded_tokens``. With no
        valid token the loss is 0 with zero gradients.
    """
    def check():
        if not isinstance(logprobs, torch.Tensor) or not isinstance(mask, torch.Tensor):
            raise ValueError("logprobs and mask must be tensors")
        if logprobs.shape != mask.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(logprobs.shape)}")
        check_normalizer("normalizer", normalizer)

    agree_on_inputs("nll_loss", check, cp_group=cp_group, device=getattr(logprobs, "device", None),
                    flags=[("normalizer", normalizer is not None)])
    logprobs = at_least_fp32(logprobs)
    weights, excluded = exclude_impossible_tokens(as_weights(mask, logprobs), logprobs)
    sums = sum_over_cp({"total": masked_sum(logprobs, weights), "tokens": weights.sum(),
                        "excluded": excluded.sum().to(weights.dtype)}, cp_group)
    loss = safe_divide(-sums["total"], sums["tokens"] if normalizer is None else given_count(normalizer, logprobs))
    metrics = {"loss": loss.detach(), "num_tokens": sums["tokens"].detach(),
               "num_excluded_tokens": sums["excluded"].detach()}
    return loss, metrics
