"""GRPO-family policy-gradient losses on per-token log-probs.

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

In code, one call runs: checks (agreed over ``cp_group``) -> per-token inputs (``_Tokens``) ->
batch totals (``BatchTotals``: per-sequence sums and counts, summed over ``cp_group``) -> per-token
terms -> sums of the loss and metric terms (summed over ``cp_group``) -> reduction and metrics.
Without ``cp_group`` the "summed over" steps are plain local sums.

A trainer can skip whole log-prob passes: ``config.needs_reference_logprobs`` is False when
``beta == 0`` and ``config.needs_old_logprobs`` is False with ``force_on_policy_ratio``.

Excluded tokens: a token whose policy, old or sampling log-prob is ``-inf`` (its label is outside
the kept set of a top-k / top-p / min-p sampler, under the trainer's or the engine's distribution)
is treated as masked and counted in ``num_excluded_tokens``. Reference log-probs are not a reason:
the reference model is not the sampler, and a ``-inf`` there only saturates the KL clamps.
"""

from __future__ import annotations

import numbers
import zlib
from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .context_parallel import agree_on_inputs, max_over_cp, sum_over_cp
from .nll import (
    Normalizer,
    as_weights,
    check_bool,
    check_normalizer,
    check_number,
    exclude_impossible_tokens,
    masked_sum,
    safe_divide,
)

PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
GRPO_LOSS_TYPES = PPO_CLIP_LOSS_TYPES + ("cispo", "sapo")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SAPO_REDUCTIONS = ("sequence", "token")

__all__ = ["GRPOConfig", "BatchTotals", "grpo_loss", "GRPO_LOSS_TYPES", "PPO_CLIP_LOSS_TYPES", "KL_ESTIMATORS",
           "IMPORTANCE_SAMPLING_LEVELS", "IS_CORRECTIONS", "SAPO_REDUCTIONS"]


@dataclass
class GRPOConfig:
    """Options of ``grpo_loss`` (formulas: the module doc).

    Policy objective:
        loss_type: ``"grpo" | "bnpo" | "dr_grpo" | "dapo"`` (PPO clip, differing only in the
            reduction), ``"cispo"`` or ``"sapo"``.
        epsilon_low, epsilon_high: PPO clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        delta: optional cap ``min(r, delta)`` on the unclipped PPO branch (INTELLECT-2); > 1.
        dual_clip_c: optional dual clip ``min(ℓ, -A·c)`` where ``A < 0``; > 1.
        cispo_max_ratio: CISPO truncation ``min(r, cispo_max_ratio)`` of the (detached) ratio.
        cispo_min_ratio: lower CISPO bound ``max(r, cispo_min_ratio)``. Default None means
            ``1 - epsilon_low``: both sides bounded, as verl (``core_algos.compute_policy_loss_cispo``:
            ``clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``) and NeMo-RL (``ClippedPGLossFn``
            with ``use_cispo``: ``clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max)``) do. ``0.0``
            removes the lower bound, as TRL (``GRPOTrainer._compute_loss``:
            ``clamp(r, max=epsilon_high)``), Liger (``chunked_loss/grpo_loss.clip_coef_fn``) and the
            MiniMax-M1 paper's experiments do.
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
        sapo_reduction: ``"sequence"`` (default) — SAPO's loss is the mean over sequences of each
            sequence's token mean, as in TRL (``GRPOTrainer._compute_loss``: ``loss_type in
            ["grpo", "sapo"]``), verl (``core_algos.compute_policy_loss_sapo`` forces
            ``agg_loss(..., "seq-mean-token-mean")``) and Liger (``chunked_loss/grpo_loss``,
            ``loss_type == "grpo" or loss_type == "sapo"``); ``"token"``: ``Σ m·x / N_tokens``
            like dapo.
        count_empty_sequences: for the per-sequence means (``"grpo"``; ``"sapo"`` with
            ``sapo_reduction="sequence"``), whether a sequence without loss tokens counts in the
            default number of sequences. True (default): the mean is over all B rows, as in TRL
            (``.mean()`` over rows), Liger (``/ full_attention_mask.shape[0]``) and NeMo-RL
            (``global_valid_seqs`` counts samples, not their tokens). False: such rows are left
            out, as verl's ``agg_loss`` "seq-mean-token-mean" does ("exclude fully masked
            sequences"). An explicit ``normalizer`` overrides both.
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
    cispo_min_ratio: Optional[float] = None
    sapo_reduction: str = "sequence"
    count_empty_sequences: bool = True

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
    def cispo_lower_bound(self) -> float:
        """CISPO's lower bound on the ratio: ``cispo_min_ratio``, or ``1 - epsilon_low`` if None."""
        return 1.0 - self.epsilon_low if self.cispo_min_ratio is None else float(self.cispo_min_ratio)

    @property
    def needs_sampling_logprobs(self) -> bool:
        """True iff an importance-sampling correction is configured (it uses sampling log-probs)."""
        return self.is_correction != "none"

    @property
    def per_sequence_mean(self) -> bool:
        """True iff the loss is a mean over sequences of per-sequence token means."""
        return self.loss_type == "grpo" or (self.loss_type == "sapo" and self.sapo_reduction == "sequence")

    @property
    def normalizer_unit(self) -> str:
        """What ``normalizer`` counts for this loss type: ``"sequences"`` or ``"tokens"``."""
        return "sequences" if self.per_sequence_mean or self.loss_type == "dr_grpo" else "tokens"

    # -- validation ---------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field for an inconsistent configuration."""
        _check_choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("importance_sampling_level", self.importance_sampling_level,
                      IMPORTANCE_SAMPLING_LEVELS)
        _check_choice("is_correction", self.is_correction, IS_CORRECTIONS)
        _check_choice("sapo_reduction", self.sapo_reduction, SAPO_REDUCTIONS)
        for name in ("use_bias_correction_kl", "force_on_policy_ratio", "count_empty_sequences"):
            check_bool(name, getattr(self, name))
        # Every float must be finite: an infinite epsilon, beta or clamp is a typo, not a setting
        # (None already means "no bound" where a bound is optional).
        for name in ("epsilon_low", "epsilon_high", "cispo_max_ratio", "sapo_temperature_pos",
                     "sapo_temperature_neg", "beta"):
            check_number(name, getattr(self, name))
        for name in ("delta", "dual_clip_c", "cispo_min_ratio", "kl_input_clamp", "kl_output_clamp",
                     "is_clip_min", "is_clip_max"):
            check_number(name, getattr(self, name), optional=True)
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
        if self.cispo_min_ratio is not None and not 0 <= self.cispo_min_ratio <= self.cispo_max_ratio:
            raise ValueError(f"cispo_min_ratio must be in [0, cispo_max_ratio={self.cispo_max_ratio}]"
                             f" (or None for 1 - epsilon_low), got {self.cispo_min_ratio}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        for name in ("kl_input_clamp", "kl_output_clamp"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or None), got {value}")
        self._validate_is_bounds()
        length = self.max_completion_length
        if length is not None or self.loss_type == "dr_grpo":
            if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length <= 0:
                raise ValueError("max_completion_length must be a positive int (required for "
                                 f"loss_type='dr_grpo'), got {length!r}")

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

    def fingerprint(self) -> int:
        """A number that differs between configs (context-parallel ranks must agree on it)."""
        text = repr(tuple(getattr(self, f.name) for f in fields(self)))
        return zlib.crc32(text.encode())


def _check_choice(name: str, value: str, choices: Tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# ---- step 1: inputs --------------------------------------------------------------------------------


def _check_inputs(logprobs, advantages, mask, config, optional: Dict[str, Optional[Tensor]],
                  normalizer, cp_group, shape_source="logprobs") -> None:
    """Raise ValueError for anything wrong with one rank's arguments (shapes are compared with
    ``logprobs``, named ``shape_source``: the fused loss passes its mask there)."""
    if not isinstance(config, GRPOConfig):
        raise ValueError(f"config must be a GRPOConfig, got {type(config).__name__}")
    config.validate()  # the dataclass may have been mutated since __post_init__
    for name, tensor in (("logprobs", logprobs), ("advantages", advantages), ("mask", mask),
                         *optional.items()):
        if tensor is not None and not isinstance(tensor, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"{shape_source} must be [B, T], got shape {tuple(logprobs.shape)}")
    batch, length = logprobs.shape
    sliced = (" (with cp_group, every per-token argument is this rank's slice [B, T_local] of the "
              "same positions)" if cp_group is not None else "")
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != {shape_source} shape {tuple(logprobs.shape)}"
                         + sliced)
    if tuple(advantages.shape) not in ((batch,), (batch, 1), (batch, length)):
        raise ValueError(f"advantages must be [B], [B, 1] or [B, T] with B={batch}, T={length}; "
                         f"got shape {tuple(advantages.shape)}" + sliced)
    for name, tensor in optional.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != {shape_source} shape "
                             f"{tuple(logprobs.shape)}" + sliced)
    if config.needs_reference_logprobs and optional.get("reference_logprobs") is None:
        raise ValueError(f"reference_logprobs are required when beta > 0 (beta={config.beta})")
    check_normalizer("normalizer", normalizer)


def check_grpo_arguments(fn_name, logprobs, advantages, mask, config, *, old_logprobs=None,
                         reference_logprobs=None, sampling_logprobs=None, entropy=None,
                         normalizer=None, cp_group=None, other_groups=(), extra_check=None,
                         extra_flags=(), shape_source="logprobs") -> None:
    """The checks of ``grpo_loss``, raised on every rank of ``cp_group`` (and ``other_groups``)."""
    optional = {"old_logprobs": old_logprobs, "reference_logprobs": reference_logprobs,
                "sampling_logprobs": sampling_logprobs, "entropy": entropy}

    def check():
        if extra_check is not None:
            extra_check()
        _check_inputs(logprobs, advantages, mask, config, optional, normalizer, cp_group, shape_source)

    is_tensor = isinstance(logprobs, Tensor)
    flags = [(f"{name} given", tensor is not None) for name, tensor in optional.items()]
    flags += [("normalizer given", normalizer is not None),
              ("config", config.fingerprint() if isinstance(config, GRPOConfig) else 0), *extra_flags]
    agree_on_inputs(fn_name, check, cp_group=cp_group, other_groups=other_groups,
                    device=logprobs.device if is_tensor else None,
                    batch_size=logprobs.shape[0] if is_tensor and logprobs.dim() > 0 else None,
                    flags=flags)


def _constant(tensor: Tensor, like: Tensor) -> Tensor:
    """Old / reference / sampling log-probs are data, not parameters: detached, in lp's dtype."""
    return tensor.detach().to(dtype=like.dtype, device=like.device)


def _masked_difference(a: Tensor, b: Tensor, valid: Tensor) -> Tensor:
    """``a - b`` on valid tokens, 0 elsewhere.

    Done before any exp(): a padding position may hold garbage, and exp(garbage) = inf would
    turn the (zero) gradient there into 0·inf = NaN.
    """
    return torch.where(valid, a - b, torch.zeros_like(a))


@dataclass
class _Tokens:
    """One rank's per-token inputs, in the policy's dtype (everything but ``logprobs`` detached)."""

    logprobs: Tensor
    adv: Tensor  # [B, 1] or [B, T]
    weights: Tensor  # the mask, 0 on excluded tokens
    valid: Tensor  # weights != 0
    excluded: Tensor  # weighted tokens dropped for a -inf log-prob
    old: Tensor
    log_ratio: Tensor  # lp - old on valid tokens (differentiable), 0 elsewhere
    log_rho: Optional[Tensor]  # old - sampling on valid tokens (detached), when sampling is given
    reference: Optional[Tensor]  # only with beta > 0
    sampling: Optional[Tensor]


def _tokens(logprobs, advantages, mask, config: GRPOConfig, old_logprobs, reference_logprobs,
            sampling_logprobs) -> _Tokens:
    on_policy = old_logprobs is None or config.force_on_policy_ratio
    old = logprobs.detach() if on_policy else _constant(old_logprobs, logprobs)
    sampling = None if sampling_logprobs is None else _constant(sampling_logprobs, logprobs)
    weights, excluded = exclude_impossible_tokens(as_weights(mask, logprobs), logprobs,
                                                  None if on_policy else old, sampling)
    valid = weights != 0
    adv = advantages.detach().to(dtype=logprobs.dtype, device=logprobs.device)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    log_rho = None
    if sampling is not None:
        log_rho = _masked_difference(old, sampling, valid).detach()
    reference = _constant(reference_logprobs, logprobs) if config.beta > 0 else None
    return _Tokens(logprobs, adv, weights, valid, excluded, old,
                   _masked_difference(logprobs, old, valid), log_rho, reference, sampling)


# ---- step 2: batch totals (the only coupling between tokens) --------------------------------------


@dataclass
class BatchTotals:
    """What one token's loss needs from the rest of the batch, summed over context-parallel ranks.

    Given these, the loss is a sum of per-token terms (for token-level ratios and corrections),
    which is what lets ``linear_grpo_loss`` compute gradients chunk by chunk without collectives.
    """

    sequence_weight: Tensor  # [B] Σ_t m per sequence
    total_weight: Tensor  # Σ m
    num_excluded: Tensor  # number of excluded tokens
    sequence_log_ratio: Optional[Tensor] = None  # [B] Σ_t m·(lp - old): GSPO, differentiable
    sequence_log_rho: Optional[Tensor] = None  # [B] Σ_t m·(old - sampling): sequence correction


def _batch_totals(tokens: _Tokens, config: GRPOConfig, cp_group) -> BatchTotals:
    weights = tokens.weights
    parts = {"sequence_weight": weights.sum(-1), "excluded": tokens.excluded.sum().to(weights.dtype)}
    if config.importance_sampling_level == "sequence":
        parts["log_ratio"] = masked_sum(tokens.log_ratio, weights, dim=-1)
    if tokens.log_rho is not None and config.is_correction.startswith("sequence"):
        parts["log_rho"] = masked_sum(tokens.log_rho, weights, dim=-1)
    # GSPO's log-ratio sums weigh every rank's tokens, whose partial losses are summed again
    sums = sum_over_cp(parts, cp_group, feeds_partials=True)
    return BatchTotals(sums["sequence_weight"].detach(), sums["sequence_weight"].sum().detach(),
                       sums["excluded"].detach(), sums.get("log_ratio"),
                       None if "log_rho" not in sums else sums["log_rho"].detach())


# ---- step 3: importance ratio r ------------------------------------------------------------------


def _importance_ratio(tokens: _Tokens, totals: BatchTotals, config: GRPOConfig) -> Tensor:
    """``r`` per token: ``exp(lp - old)``, or GSPO's ``exp(masked mean over the sequence)``.

    A sequence without valid tokens gets r = 1. Gradients flow through ``lp`` in both cases.
    """
    if config.importance_sampling_level == "token":
        return torch.exp(tokens.log_ratio)
    sequence_log_ratio = safe_divide(totals.sequence_log_ratio, totals.sequence_weight)  # [B]
    return torch.exp(sequence_log_ratio).unsqueeze(-1).expand_as(tokens.log_ratio)


# ---- step 4: policy objective ℓ ------------------------------------------------------------------


def _ppo_clip_objective(ratio: Tensor, adv: Tensor, config: GRPOConfig):
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
    """``ℓ = -A · sg(clamp(r, low, cispo_max_ratio)) · lp``: the ratio only weights the gradient
    of lp; ``low = cispo_min_ratio``, or ``1 - epsilon_low`` when that is None."""
    low = config.cispo_lower_bound
    weight = ratio.clamp(min=low, max=config.cispo_max_ratio).detach()
    return -adv * weight * logprobs, {"clip_low": ratio < low, "clip_high": ratio > config.cispo_max_ratio}


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


# ---- step 5: train/inference importance-sampling correction ρ --------------------------------------


@torch.no_grad()
def _is_correction_weight(tokens: _Tokens, totals: BatchTotals, config: GRPOConfig):
    """``(ρ_raw, ρ)``, both detached: ``ρ_raw = exp(old - sampling)`` per token, or
    ``exp(Σ_t m·(old - sampling))`` per sequence broadcast to its tokens; ``ρ`` is ``ρ_raw``
    truncated to ``[is_clip_min, is_clip_max]`` ("*_truncate") or zeroed outside it ("*_mask").
    """
    log_rho = tokens.log_rho
    if config.is_correction.startswith("sequence"):
        log_rho = totals.sequence_log_rho.unsqueeze(-1).expand_as(log_rho)
    rho_raw = torch.exp(log_rho)
    lo, hi = config.is_clip_min, config.is_clip_max
    if config.is_correction.endswith("_truncate"):
        rho = rho_raw.clamp(min=lo, max=hi)
    else:
        inside = torch.ones_like(tokens.valid)
        if lo is not None:
            inside &= rho_raw >= lo
        if hi is not None:
            inside &= rho_raw <= hi
        rho = torch.where(inside, rho_raw, torch.zeros_like(rho_raw))  # not ρ·1[...]: inf·0 = NaN
    return rho_raw, rho


# ---- step 6: KL penalty ----------------------------------------------------------------------------


def _kl_penalty(tokens: _Tokens, ratio: Tensor, config: GRPOConfig) -> Tensor:
    """Per-token estimate of KL(π || π_ref) from ``d = clamp(ref - lp, ±kl_input_clamp)``.

    ``k1 = -d``, ``k2 = d²/2``, ``k3 = exp(d) - 1 - d``; then clamped to ``±kl_output_clamp``;
    with ``use_bias_correction_kl`` multiplied by the importance ratio r (sampling from π_old,
    not π). Never multiplied by the train/inference correction ρ.
    """
    d = _masked_difference(tokens.reference, tokens.logprobs, tokens.valid)
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


@dataclass
class _Terms:
    ratio: Tensor
    policy: Tensor  # ℓ·ρ per token
    kl: Optional[Tensor]
    clip_flags: Dict[str, Tensor]
    correction: Optional[Tuple[Tensor, Tensor]]  # (ρ_raw, ρ)


def _token_terms(tokens: _Tokens, totals: BatchTotals, config: GRPOConfig) -> _Terms:
    ratio = _importance_ratio(tokens, totals, config)
    safe_logprobs = torch.where(tokens.valid, tokens.logprobs, torch.zeros_like(tokens.logprobs))
    policy, clip_flags = _policy_objective(ratio, tokens.adv, safe_logprobs, config)  # cispo: ·lp
    correction = None
    if tokens.sampling is not None and config.is_correction != "none":
        correction = _is_correction_weight(tokens, totals, config)
        policy = policy * correction[1]
    kl = _kl_penalty(tokens, ratio, config) if config.beta > 0 else None
    return _Terms(ratio, policy, kl, clip_flags, correction)


# ---- step 7: reduction -----------------------------------------------------------------------------


def _loss_sums(terms: _Terms, weights: Tensor, config: GRPOConfig) -> Dict[str, Tensor]:
    """This rank's part of the loss: per-sequence sums ``[B]`` for the per-sequence means, else
    one sum over all tokens."""
    dim = -1 if config.per_sequence_mean else None
    sums = {"pg": masked_sum(terms.policy, weights, dim)}
    if terms.kl is not None:
        sums["kl"] = masked_sum(terms.kl, weights, dim)
    return sums


def _reduce(total: Tensor, totals: BatchTotals, config: GRPOConfig,
            normalizer: Optional[Normalizer]) -> Tensor:
    """Batch reduction of the summed per-token loss; ``normalizer`` overrides the default count.

    * ``dapo``, ``bnpo``, ``cispo``, ``sapo`` with ``sapo_reduction="token"``: ``Σ m·x / N_tokens``;
    * ``grpo``, ``sapo`` (per sequence): ``Σ_i (Σ_t m·x / Σ_t m) / N_sequences``; an empty
      sequence contributes 0, and counts in the default ``N_sequences`` iff
      ``count_empty_sequences``;
    * ``dr_grpo``: ``Σ m·x / (N_sequences · max_completion_length)``, ``N_sequences = B``.
    """
    num_rows = totals.sequence_weight.shape[0]
    if config.per_sequence_mean:
        sequence_means = safe_divide(total, totals.sequence_weight)
        if normalizer is None:
            normalizer = num_rows if config.count_empty_sequences else (totals.sequence_weight != 0).sum()
        return safe_divide(sequence_means.sum(), normalizer)
    if config.loss_type == "dr_grpo":
        num_sequences = torch.as_tensor(num_rows if normalizer is None else normalizer,
                                        dtype=total.dtype, device=total.device)
        return safe_divide(total, num_sequences * config.max_completion_length)
    return safe_divide(total, totals.total_weight if normalizer is None else normalizer)


# ---- the loss ----------------------------------------------------------------------------------------


def grpo_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    *,
    old_logprobs: Optional[Tensor] = None,
    reference_logprobs: Optional[Tensor] = None,
    sampling_logprobs: Optional[Tensor] = None,
    normalizer: Optional[Normalizer] = None,
    entropy: Optional[Tensor] = None,
    cp_group=None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
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
        normalizer: global count (> 0) for the reduction (see ``config.normalizer_unit``): the
            number of loss tokens of the whole generation batch across micro-batches and
            data-parallel ranks (TRL's ``num_items_in_batch``) for token-level reductions, the
            global number of sequences for grpo / dr_grpo / per-sequence sapo. Default: the count
            of this batch (summed over ``cp_group``). ``1`` gives a plain sum. An explicit token
            normalizer is used as given: excluded tokens (module doc) leave only the numerator.
        entropy: optional ``[B, T]`` per-token entropy, only reported (masked mean) in the metrics.
        cp_group: context-parallel group: each rank passes its slice ``[B, T_local]`` of every
            sequence (all per-token arguments sliced alike; ``megatron_fused_ce.losses.
            context_parallel`` states the rule). Sequence sums (GSPO ratio, sequence correction,
            per-sequence means), default normalizers and metrics are reduced over the group: the
            loss and metrics equal the CP=1 values on every rank, and each rank's gradient is the
            CP=1 gradient at its positions.

    Returns:
        ``(loss, metrics)``: a 0-dim loss and detached 0-dim metrics: ``loss``, ``pg_loss``,
        ``kl`` (reduced like the loss, so ``loss = pg_loss + beta·kl``; 0 when beta = 0),
        ``ratio_mean/min/max`` of r over masked tokens, ``clip_ratio_low``, ``clip_ratio_high``,
        ``clip_ratio`` (either; cispo: r outside its bounds; sapo: 0), ``dual_clip_ratio`` (with
        ``dual_clip_c``); with an active correction ``is_ratio_mean/min/max`` (of ρ before
        truncation/masking) and ``is_clip_ratio`` (tokens where it was truncated or masked);
        ``token_mult_prob_error = masked mean of exp(|sampling - old|)`` when sampling log-probs
        are given; ``entropy`` when given; ``num_excluded_tokens``. Fractions and means are
        weighted by the mask.
    """
    check_grpo_arguments("grpo_loss", logprobs, advantages, mask, config, old_logprobs=old_logprobs,
                         reference_logprobs=reference_logprobs, sampling_logprobs=sampling_logprobs,
                         entropy=entropy, normalizer=normalizer, cp_group=cp_group)
    tokens = _tokens(logprobs, advantages, mask, config, old_logprobs, reference_logprobs,
                     sampling_logprobs)
    totals = _batch_totals(tokens, config, cp_group)
    terms = _token_terms(tokens, totals, config)
    # The loss sums (differentiable) and the metric sums (detached) in one CP all-reduce.
    loss_parts = _loss_sums(terms, tokens.weights, config)
    metric_parts = _metric_sums(terms, tokens, entropy)
    sums = sum_over_cp({**loss_parts, **{f"metric:{k}": v for k, v in metric_parts.items()}}, cp_group)

    pg_loss = _reduce(sums["pg"], totals, config, normalizer)
    if config.beta > 0:
        kl_loss = _reduce(sums["kl"], totals, config, normalizer)
        loss = pg_loss + config.beta * kl_loss
    else:
        kl_loss = torch.zeros_like(pg_loss)
        loss = pg_loss

    metric_sums = {k[len("metric:"):]: v for k, v in sums.items() if k.startswith("metric:")}
    metrics = _metrics(loss, pg_loss, kl_loss, metric_sums, _extremes(terms, tokens, cp_group), totals)
    return loss, metrics


def batch_totals(logprobs, advantages, mask, config: GRPOConfig, *, old_logprobs=None,
                 reference_logprobs=None, sampling_logprobs=None, cp_group=None) -> BatchTotals:
    """The ``BatchTotals`` of a call with these arguments (checks not included)."""
    tokens = _tokens(logprobs, advantages, mask, config, old_logprobs, reference_logprobs,
                     sampling_logprobs)
    return _batch_totals(tokens, config, cp_group)


def loss_given_totals(logprobs, advantages, mask, config: GRPOConfig, totals: BatchTotals, *,
                      old_logprobs=None, reference_logprobs=None, sampling_logprobs=None,
                      normalizer=None) -> Tensor:
    """The loss of this rank's tokens with the batch totals given (no checks, no collectives).

    Where the loss is a sum of per-token terms once the totals are known (token-level ratio; a
    sequence-level correction only with given old log-probs), its gradient w.r.t. ``logprobs``
    is that of ``grpo_loss`` (with ``cp_group``) at this rank's positions: the fused loss reads
    per-chunk gradients off it.
    """
    tokens = _tokens(logprobs, advantages, mask, config, old_logprobs, reference_logprobs,
                     sampling_logprobs)
    terms = _token_terms(tokens, totals, config)
    sums = _loss_sums(terms, tokens.weights, config)
    loss = _reduce(sums["pg"], totals, config, normalizer)
    if config.beta > 0:
        loss = loss + config.beta * _reduce(sums["kl"], totals, config, normalizer)
    return loss


# ---- metrics -----------------------------------------------------------------------------------------


@torch.no_grad()
def _metric_sums(terms: _Terms, tokens: _Tokens, entropy: Optional[Tensor]) -> Dict[str, Tensor]:
    """Numerators of the mask-weighted metric means (their denominator is ``Σ m``)."""
    weights = tokens.weights

    def weighted(values: Tensor) -> Tensor:
        return masked_sum(values.to(weights.dtype), weights)

    flags = terms.clip_flags
    sums = {
        "ratio_mean": weighted(terms.ratio),
        "clip_ratio_low": weighted(flags["clip_low"]),
        "clip_ratio_high": weighted(flags["clip_high"]),
        "clip_ratio": weighted(flags["clip_low"] | flags["clip_high"]),
    }
    if "dual_clip" in flags:
        sums["dual_clip_ratio"] = weighted(flags["dual_clip"])
    if terms.correction is not None:
        rho_raw, rho = terms.correction
        sums.update(is_ratio_mean=weighted(rho_raw), is_clip_ratio=weighted(rho != rho_raw))
    if tokens.sampling is not None:
        sums["token_mult_prob_error"] = weighted(
            torch.exp(_masked_difference(tokens.sampling, tokens.old, tokens.valid).abs()))
    if entropy is not None:
        sums["entropy"] = weighted(entropy.detach().to(weights.dtype))
    return sums


@torch.no_grad()
def _extremes(terms: _Terms, tokens: _Tokens, cp_group) -> Dict[str, Tensor]:
    """Min and max of r (and ρ_raw) over valid tokens of the whole batch; 0 if there are none."""
    valid = tokens.valid

    def largest(values: Tensor) -> Tensor:
        filled = values.masked_fill(~valid, float("-inf"))
        return filled.max() if filled.numel() else filled.new_full((), float("-inf"))

    parts = {"any": valid.any().to(terms.ratio.dtype).reshape(()),
             "ratio_max": largest(terms.ratio), "ratio_min": largest(-terms.ratio)}
    if terms.correction is not None:
        parts.update(is_ratio_max=largest(terms.correction[0]), is_ratio_min=largest(-terms.correction[0]))
    parts = max_over_cp(parts, cp_group)  # one all-reduce MAX; a minimum is -max(-x)
    any_valid = parts.pop("any") > 0
    zero = torch.zeros_like(parts["ratio_max"])
    return {name: torch.where(any_valid, -value if name.endswith("_min") else value, zero)
            for name, value in parts.items()}


def _metrics(loss, pg_loss, kl_loss, metric_sums, extremes, totals: BatchTotals) -> Dict[str, Tensor]:
    with torch.no_grad():
        metrics = {"loss": loss.detach(), "pg_loss": pg_loss.detach(), "kl": kl_loss.detach()}
        means = {name: safe_divide(value, totals.total_weight) for name, value in metric_sums.items()}
        metrics["ratio_mean"] = means.pop("ratio_mean")
        metrics.update(ratio_min=extremes["ratio_min"], ratio_max=extremes["ratio_max"])
        for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio", "dual_clip_ratio"):
            if name in means:
                metrics[name] = means.pop(name)
        if "is_ratio_mean" in means:
            metrics.update(is_ratio_mean=means.pop("is_ratio_mean"), is_ratio_min=extremes["is_ratio_min"],
                           is_ratio_max=extremes["is_ratio_max"], is_clip_ratio=means.pop("is_clip_ratio"))
        metrics.update(means)  # token_mult_prob_error, entropy
        metrics["num_excluded_tokens"] = totals.num_excluded
    return metrics
