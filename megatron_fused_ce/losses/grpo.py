"""GRPO-family policy-gradient losses on per-token log-probs (design.md §3, "GRPO").

Notation, per token t of sequence i: ``lp`` the policy log-prob (trainable), ``A`` the advantage,
``m`` the mask weight (loss mask × tool mask: prompt, padding and tool-output tokens get 0).

One token on its way to the loss::

    old   = old_logprobs, or lp.detach() (on-policy / force_on_policy_ratio)
    r     = exp(lp - old)                                    importance_sampling_level="token"
          = exp(Σ_t m·(lp - old) / Σ_t m), per sequence      "sequence" (GSPO)
    ℓ     = policy objective of r and A (PPO clip, CISPO or SAPO; see _policy_objective)
    ρ     = detached train/inference correction exp(old - sampling), truncated or masked
    kl    = k1/k2/k3 estimate of KL(π || π_ref) from d = clamp(ref - lp)   (only if beta > 0)
    x     = ℓ·ρ + beta·kl                                    ρ never touches the KL
    loss  = reduction of m·x over the batch (depends on loss_type and normalizer)

A trainer can skip whole log-prob passes: ``config.needs_reference_logprobs`` is False when
``beta == 0`` and ``config.needs_old_logprobs`` is False with ``force_on_policy_ratio``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .nll import Normalizer, as_weights, masked_mean, masked_min_max, masked_sum, safe_divide

PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
GRPO_LOSS_TYPES = PPO_CLIP_LOSS_TYPES + ("cispo", "sapo")
SEQUENCE_NORMALIZED_LOSS_TYPES = ("grpo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

__all__ = [
    "GRPOConfig",
    "grpo_loss",
    "GRPO_LOSS_TYPES",
    "PPO_CLIP_LOSS_TYPES",
    "KL_ESTIMATORS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_CORRECTIONS",
]


@dataclass
class GRPOConfig:
    """Options of ``grpo_loss``; field names and defaults are those of design.md §3.

    Policy objective:
        loss_type: ``"grpo" | "bnpo" | "dr_grpo" | "dapo"`` (PPO clip, differing only in the
            reduction), ``"cispo"`` or ``"sapo"``.
        epsilon_low, epsilon_high: PPO clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        delta: optional cap ``min(r, delta)`` on the unclipped PPO branch (INTELLECT-2); > 1.
        dual_clip_c: optional dual clip ``min(ℓ, -A·c)`` where ``A < 0``; > 1.
        cispo_max_ratio: CISPO truncation of the (detached) ratio.
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperature for ``A > 0`` / ``A ≤ 0``.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        force_on_policy_ratio: use ``lp.detach()`` as the old log-probs even if given (r ≡ 1 in
            value); the old-log-prob pass can then be skipped.
    KL penalty (only when ``beta > 0``; needs reference log-probs):
        beta, kl_estimator (``"k1" | "k2" | "k3"``), kl_input_clamp (on ``ref - lp``),
        kl_output_clamp (on the estimate; None = no clamp), use_bias_correction_kl (``kl ·= r``).
    Train/inference mismatch correction (only when sampling log-probs are passed):
        is_correction: ``"none" | "token_truncate" | "token_mask" | "sequence_truncate" |
        "sequence_mask"``; is_clip_min / is_clip_max: bounds on ρ (truncate needs is_clip_max;
        mask needs at least one bound, a missing bound is open).
    Reduction:
        max_completion_length: the constant length used by ``"dr_grpo"`` (required there).
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    dual_clip_c: Optional[float] = None
    cispo_max_ratio: float = 5.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_input_clamp: Optional[float] = 20.0
    kl_output_clamp: Optional[float] = 10.0
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"
    is_correction: str = "none"
    is_clip_min: Optional[float] = None
    is_clip_max: Optional[float] = None
    force_on_policy_ratio: bool = False
    max_completion_length: Optional[int] = None

    def __post_init__(self) -> None:
        self.validate()

    # -- which log-prob passes a trainer must run -------------------------------------------------

    @property
    def needs_reference_logprobs(self) -> bool:
        """True iff the loss reads reference log-probs (only the KL term does: ``beta > 0``)."""
        return self.beta > 0

    @property
    def needs_old_logprobs(self) -> bool:
        """False with ``force_on_policy_ratio``: the old log-probs would be ignored.

        Without it, old log-probs are optional at call time (missing = on-policy, ``lp.detach()``)
        but needed as soon as the batch is reused for more than one optimizer step.
        """
        return not self.force_on_policy_ratio

    @property
    def needs_sampling_logprobs(self) -> bool:
        """True iff an importance-sampling correction is configured (it uses sampling log-probs)."""
        return self.is_correction != "none"

    @property
    def normalizer_unit(self) -> str:
        """What ``normalizer`` counts for this loss type: ``"sequences"`` or ``"tokens"``."""
        return "sequences" if self.loss_type in SEQUENCE_NORMALIZED_LOSS_TYPES else "tokens"

    # -- validation ---------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field for an inconsistent configuration."""
        _check_choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("importance_sampling_level", self.importance_sampling_level,
                      IMPORTANCE_SAMPLING_LEVELS)
        _check_choice("is_correction", self.is_correction, IS_CORRECTIONS)
        if not 0 <= self.epsilon_low < 1:
            raise ValueError(f"epsilon_low must be in [0, 1), got {self.epsilon_low}")
        if not self.epsilon_high >= 0:
            raise ValueError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        ppo_only = {"delta": self.delta, "dual_clip_c": self.dual_clip_c}
        for name, value in ppo_only.items():
            if value is None:
                continue
            if not value > 1:
                raise ValueError(f"{name} must be > 1 (or None), got {value}")
            if self.loss_type not in PPO_CLIP_LOSS_TYPES:
                raise ValueError(f"{name} applies only to the PPO-clip loss types "
                                 f"{PPO_CLIP_LOSS_TYPES}, not loss_type={self.loss_type!r}")
        for name in ("cispo_max_ratio", "sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        for name in ("kl_input_clamp", "kl_output_clamp"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or None), got {value}")
        self._validate_is_bounds()
        if self.loss_type == "dr_grpo":
            length = self.max_completion_length
            if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length <= 0:
                raise ValueError("max_completion_length must be a positive int for loss_type='dr_grpo', "
                                 f"got {length!r}")

    def _validate_is_bounds(self) -> None:
        lo, hi = self.is_clip_min, self.is_clip_max
        if lo is not None and not lo >= 0:
            raise ValueError(f"is_clip_min must be >= 0 (or None), got {lo}")
        if hi is not None and not hi > 0:
            raise ValueError(f"is_clip_max must be > 0 (or None), got {hi}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"is_clip_min ({lo}) must be <= is_clip_max ({hi})")
        if self.is_correction.endswith("_truncate") and hi is None:
            raise ValueError(f"is_correction={self.is_correction!r} needs is_clip_max")
        if self.is_correction.endswith("_mask") and lo is None and hi is None:
            raise ValueError(f"is_correction={self.is_correction!r} needs is_clip_min and/or is_clip_max")


def _check_choice(name: str, value: str, choices: Tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# ---- step 1: inputs --------------------------------------------------------------------------------


def _check_inputs(logprobs, advantages, mask, optional: Dict[str, Optional[torch.Tensor]]) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    batch, length = logprobs.shape
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if tuple(advantages.shape) not in ((batch,), (batch, 1), (batch, length)):
        raise ValueError(f"advantages must be [B], [B, 1] or [B, T] with B={batch}, T={length}; "
                         f"got shape {tuple(advantages.shape)}")
    for name, tensor in optional.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape "
                             f"{tuple(logprobs.shape)}")


def _constant(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Old / reference / sampling log-probs are data, not parameters: detached, in lp's dtype."""
    return tensor.detach().to(dtype=like.dtype, device=like.device)


def _masked_difference(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``a - b`` on valid tokens, 0 elsewhere.

    Done before any exp(): a padding position may hold garbage, and exp(garbage) = inf would
    turn the (zero) gradient there into 0·inf = NaN.
    """
    return torch.where(valid, a - b, torch.zeros_like(a))


# ---- step 2: importance ratio r ------------------------------------------------------------------


def _importance_ratio(log_ratio: torch.Tensor, weights: torch.Tensor, level: str) -> torch.Tensor:
    """``r`` per token: ``exp(lp - old)``, or GSPO's ``exp(masked mean over the sequence)``.

    A sequence without valid tokens gets r = 1. Gradients flow through ``lp`` in both cases.
    """
    if level == "token":
        return torch.exp(log_ratio)
    sequence_log_ratio = masked_mean(log_ratio, weights, dim=-1)  # [B], 0 for an empty sequence
    return torch.exp(sequence_log_ratio).unsqueeze(-1).expand_as(log_ratio)


# ---- step 3: policy objective ℓ ------------------------------------------------------------------


def _ppo_clip_objective(ratio: torch.Tensor, adv: torch.Tensor, config: GRPOConfig):
    """``ℓ = max(-A·r', -A·clip(r, 1-ε_low, 1+ε_high))`` with ``r' = min(r, delta)``.

    With ``dual_clip_c = c``: ``ℓ = min(ℓ, -A·c)`` where ``A < 0``, bounding the loss of a
    negative-advantage token whose ratio exploded.
    """
    unclipped = ratio if config.delta is None else ratio.clamp(max=config.delta)
    clipped = ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    objective = torch.maximum(-adv * unclipped, -adv * clipped)
    flags = {
        "clip_low": (ratio < 1.0 - config.epsilon_low) & (adv < 0),
        "clip_high": (ratio > 1.0 + config.epsilon_high) & (adv > 0),
    }
    if config.dual_clip_c is not None:
        dual_bound = -adv * config.dual_clip_c
        dual_active = (adv < 0) & (objective > dual_bound)
        objective = torch.where(dual_active, dual_bound, objective)
        flags["dual_clip"] = dual_active
    return objective, flags


def _cispo_objective(ratio, adv, logprobs, config: GRPOConfig):
    """``ℓ = -A · sg(min(r, cispo_max_ratio)) · lp``: the ratio only weights the gradient of lp."""
    weight = ratio.clamp(max=config.cispo_max_ratio).detach()
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return -adv * weight * logprobs, {"clip_low": never, "clip_high": ratio > config.cispo_max_ratio}


def _sapo_objective(ratio, adv, config: GRPOConfig):
    """``ℓ = -A · σ(τ(r-1)) · 4/τ``, ``τ = sapo_temperature_pos`` if A > 0 else ``_neg``.

    A smooth gate instead of a hard clip (its slope at r = 1 is 1, like the unclipped objective);
    nothing is clipped, so the clip fractions are 0.
    """
    tau = torch.where(adv > 0, torch.full_like(adv, config.sapo_temperature_pos),
                      torch.full_like(adv, config.sapo_temperature_neg))
    never = torch.zeros_like(ratio, dtype=torch.bool)
    objective = -adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return objective, {"clip_low": never, "clip_high": never}


def _policy_objective(ratio, adv, logprobs, config: GRPOConfig):
    """Per-token ``ℓ`` and bool flags of where each clip is active."""
    if config.loss_type == "cispo":
        return _cispo_objective(ratio, adv, logprobs, config)
    if config.loss_type == "sapo":
        return _sapo_objective(ratio, adv, config)
    return _ppo_clip_objective(ratio, adv, config)


# ---- step 4: train/inference importance-sampling correction ρ --------------------------------------


def _is_correction_weight(old, sampling, weights, valid, config: GRPOConfig):
    """``(ρ_raw, ρ)``, both detached: ``ρ_raw = exp(old - sampling)`` per token, or
    ``exp(Σ_t m·(old - sampling))`` per sequence broadcast to its tokens; ``ρ`` is ``ρ_raw``
    truncated to ``[is_clip_min, is_clip_max]`` ("*_truncate") or zeroed outside it ("*_mask").
    """
    with torch.no_grad():
        log_rho = _masked_difference(old, sampling, valid)
        if config.is_correction.startswith("sequence"):
            log_rho = masked_sum(log_rho, weights, dim=-1).unsqueeze(-1).expand_as(log_rho)
        rho_raw = torch.exp(log_rho)
        lo, hi = config.is_clip_min, config.is_clip_max
        if config.is_correction.endswith("_truncate"):
            rho = rho_raw.clamp(min=lo, max=hi)
        else:
            inside = torch.ones_like(valid)
            if lo is not None:
                inside &= rho_raw >= lo
            if hi is not None:
                inside &= rho_raw <= hi
            rho = torch.where(inside, rho_raw, torch.zeros_like(rho_raw))  # not ρ·1[...]: inf·0 = NaN
    return rho_raw, rho


# ---- step 5: KL penalty ----------------------------------------------------------------------------


def _kl_penalty(logprobs, reference, ratio, valid, config: GRPOConfig) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from ``d = clamp(ref - lp, ±kl_input_clamp)``.

    ``k1 = -d``, ``k2 = d²/2``, ``k3 = exp(d) - 1 - d``; then clamped to ``±kl_output_clamp``;
    with ``use_bias_correction_kl`` multiplied by the importance ratio r (sampling from π_old,
    not π). Never multiplied by the train/inference correction ρ.
    """
    d = _masked_difference(reference, logprobs, valid)
    if config.kl_input_clamp is not None:
        d = d.clamp(-config.kl_input_clamp, config.kl_input_clamp)
    if config.kl_estimator == "k1":
        kl = -d
    elif config.kl_estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.exp(d) - 1.0 - d
    if config.kl_output_clamp is not None:
        kl = kl.clamp(-config.kl_output_clamp, config.kl_output_clamp)
    if config.use_bias_correction_kl:
        kl = kl * ratio
    return kl


# ---- step 6: reduction -----------------------------------------------------------------------------


def _reduce(per_token: torch.Tensor, weights: torch.Tensor, config: GRPOConfig,
            normalizer: Optional[Normalizer]) -> torch.Tensor:
    """Batch reduction of the per-token loss; ``normalizer`` overrides the local count.

    * ``dapo``, ``bnpo``, ``cispo``, ``sapo``: ``Σ m·x / N_tokens``;
    * ``grpo``: ``Σ_i (Σ_t m·x / Σ_t m) / N_sequences`` (an empty sequence contributes 0, but is
      counted in the default ``N_sequences = B``);
    * ``dr_grpo``: ``Σ m·x / (N_sequences · max_completion_length)``.
    """
    num_sequences = per_token.shape[0] if normalizer is None else normalizer
    if config.loss_type == "grpo":
        return safe_divide(masked_mean(per_token, weights, dim=-1).sum(), num_sequences)
    total = masked_sum(per_token, weights)
    if config.loss_type == "dr_grpo":
        num_sequences = torch.as_tensor(num_sequences, dtype=total.dtype, device=total.device)
        return safe_divide(total, num_sequences * config.max_completion_length)
    return safe_divide(total, weights.sum() if normalizer is None else normalizer)


# ---- the loss ----------------------------------------------------------------------------------------


def grpo_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOConfig,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    reference_logprobs: Optional[torch.Tensor] = None,
    sampling_logprobs: Optional[torch.Tensor] = None,
    normalizer: Optional[Normalizer] = None,
    entropy: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GRPO / DAPO / Dr. GRPO / BNPO / CISPO / SAPO / GSPO loss (formulas: module docstring, §3).

    Args:
        logprobs: ``[B, T]`` policy log-probs of the sampled tokens (B sequences); the only input
            that receives a gradient.
        advantages: ``[B]`` (one per sequence) or ``[B, T]`` (per token).
        mask: ``[B, T]`` float or bool: the loss mask times the tool mask (tokens produced by tools
            or the environment must not be trained on), so 0 on prompt, padding and tool tokens.
        config: a ``GRPOConfig``.
        old_logprobs: ``[B, T]`` log-probs of the policy that generated the batch, as recomputed by
            the trainer; default (or with ``force_on_policy_ratio``) ``logprobs.detach()``.
        reference_logprobs: ``[B, T]`` reference-model log-probs; required iff ``config.beta > 0``,
            never read otherwise.
        sampling_logprobs: ``[B, T]`` log-probs reported by the inference engine; enables the
            ``is_correction`` and the ``token_mult_prob_error`` metric.
        normalizer: global count for the reduction (see ``config.normalizer_unit``): the number of
            loss tokens of the whole generation batch across micro-batches and data-parallel ranks
            (TRL's ``num_items_in_batch``) for dapo/bnpo/cispo/sapo, the global number of
            sequences for grpo/dr_grpo. Default: the local count. ``1`` gives a plain sum.
        entropy: optional ``[B, T]`` per-token entropy, only reported (masked mean) in the metrics.

    Returns:
        ``(loss, metrics)``: a 0-dim loss and detached 0-dim metrics: ``loss``, ``pg_loss``,
        ``kl`` (reduced like the loss, so ``loss = pg_loss + beta·kl``; 0 when beta = 0),
        ``ratio_mean/min/max`` of r over masked tokens, ``clip_ratio_low``, ``clip_ratio_high``,
        ``clip_ratio`` (either; cispo: r > cispo_max_ratio; sapo: 0), ``dual_clip_ratio`` (with
        ``dual_clip_c``); with an active correction ``is_ratio_mean/min/max`` (of ρ before
        truncation/masking) and ``is_clip_ratio`` (tokens where it was truncated or masked);
        ``token_mult_prob_error = masked mean of exp(|sampling - old|)`` when sampling log-probs
        are given; ``entropy`` when given. Fractions and means are weighted by the mask.
    """
    config.validate()  # the dataclass may have been mutated since __post_init__
    _check_inputs(logprobs, advantages, mask, {
        "old_logprobs": old_logprobs, "reference_logprobs": reference_logprobs,
        "sampling_logprobs": sampling_logprobs, "entropy": entropy})
    if config.needs_reference_logprobs and reference_logprobs is None:
        raise ValueError(f"reference_logprobs are required when beta > 0 (beta={config.beta})")

    weights = as_weights(mask, logprobs)
    valid = weights != 0
    adv = advantages.detach().to(dtype=logprobs.dtype, device=logprobs.device)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv

    on_policy = old_logprobs is None or config.force_on_policy_ratio
    old = logprobs.detach() if on_policy else _constant(old_logprobs, logprobs)
    ratio = _importance_ratio(_masked_difference(logprobs, old, valid), weights,
                              config.importance_sampling_level)

    safe_logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))  # cispo multiplies by lp
    per_token, clip_flags = _policy_objective(ratio, adv, safe_logprobs, config)

    sampling = None if sampling_logprobs is None else _constant(sampling_logprobs, logprobs)
    correction = None
    if sampling is not None and config.is_correction != "none":
        correction = _is_correction_weight(old, sampling, weights, valid, config)
        per_token = per_token * correction[1]

    pg_loss = _reduce(per_token, weights, config, normalizer)
    if config.beta > 0:
        kl = _kl_penalty(logprobs, _constant(reference_logprobs, logprobs), ratio, valid, config)
        kl_loss = _reduce(kl, weights, config, normalizer)
        loss = pg_loss + config.beta * kl_loss
    else:
        kl_loss = torch.zeros_like(pg_loss)
        loss = pg_loss

    metrics = _metrics(loss, pg_loss, kl_loss, ratio, clip_flags, correction, old, sampling,
                       entropy, weights, valid)
    return loss, metrics


@torch.no_grad()
def _metrics(loss, pg_loss, kl_loss, ratio, clip_flags, correction, old, sampling, entropy,
             weights, valid) -> Dict[str, torch.Tensor]:
    def fraction(flag: torch.Tensor) -> torch.Tensor:
        return masked_mean(flag.to(weights.dtype), weights)

    ratio_min, ratio_max = masked_min_max(ratio, weights)
    metrics = {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "kl": kl_loss.detach(),
        "ratio_mean": masked_mean(ratio, weights),
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
        "clip_ratio_low": fraction(clip_flags["clip_low"]),
        "clip_ratio_high": fraction(clip_flags["clip_high"]),
        "clip_ratio": fraction(clip_flags["clip_low"] | clip_flags["clip_high"]),
    }
    if "dual_clip" in clip_flags:
        metrics["dual_clip_ratio"] = fraction(clip_flags["dual_clip"])
    if correction is not None:
        rho_raw, rho = correction
        is_min, is_max = masked_min_max(rho_raw, weights)
        metrics.update(is_ratio_mean=masked_mean(rho_raw, weights), is_ratio_min=is_min,
                       is_ratio_max=is_max, is_clip_ratio=fraction(rho != rho_raw))
    if sampling is not None:
        error = torch.exp(_masked_difference(sampling, old, valid).abs())
        metrics["token_mult_prob_error"] = masked_mean(error, weights)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach().to(weights.dtype), weights)
    return metrics
