"""GRPO-family policy-gradient losses on per-token log-probs.

Notation, per token t of sequence i: ``lp`` the policy log-prob (trainable), ``A`` the advantage,
``m`` the mask weight (loss mask × tool mask: prompt, padding and tool-output tokens get 0).

One token on its way to the loss::

    old   = old_logprobs, or lp.detach() (on-policy / force_on_policy_ratio)
    r     = exp(lp - old)                                    importance_sampling_level="token"
          = exp(Σ_t m·(lp - old) / Σ_t m), per sequence      "sequence" (GSPO)
    ℓ     = policy objective of r and A (PPO clip, CISPO or SAPO; see _ppo_clip_terms ...)
    ρ     = detached train/inference correction exp(old - sampling), truncated or masked
    kl    = k1/k2/k3 estimate of KL(π || π_ref) from d = clamp(ref - lp)   (only if beta > 0)
    x     = ℓ·ρ + beta·kl                                    ρ never touches the KL
    loss  = Σ s·m·x, s the token's normalization weight (depends on loss_type and normalizer)

In code, one call runs: checks (agreed over ``cp_group``) -> per-token inputs (``_Tokens``) ->
batch totals (``BatchTotals``: per-sequence sums and counts, summed over ``cp_group``) -> what the
totals give each token (``TokenInputs``: s, the sequence-level correction) -> ``token_terms``, the
one definition of the per-token math: each token's loss and metric terms and their closed-form
derivatives w.r.t. lp and r -> their sums (``term_sums``; one compiled kernel on CUDA), summed over
``cp_group`` -> loss and metrics. The backward multiplies the per-token derivatives by the upstream
gradient (GSPO: chained through the sequence sums by autograd). Without ``cp_group`` the "summed
over" steps are plain local sums. ``linear_grpo_loss`` runs the same ``term_sums`` chunk by chunk.

A trainer can skip whole log-prob passes: ``config.needs_reference_logprobs`` is False when
``beta == 0`` and ``config.needs_old_logprobs`` is False with ``force_on_policy_ratio``.

Excluded tokens: a token whose policy, old or sampling log-prob is ``-inf`` (its label is outside
the kept set of a top-k / top-p / min-p sampler, under the trainer's or the engine's distribution)
is treated as masked and counted in ``num_excluded_tokens``. Reference log-probs are not a reason:
the reference model is not the sampler, and a ``-inf`` there only saturates the KL clamps.
"""

from __future__ import annotations

import numbers
import operator
import types
import warnings
import zlib
from dataclasses import dataclass, fields, replace
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..ops.agreement import flag_argument, integer_argument, is_int, real_argument
from .context_parallel import agree_on_inputs, max_over_cp, sum_over_cp
from .nll import (
    Normalizer,
    as_weights,
    at_least_fp32,
    check_bool,
    check_normalizer,
    check_number,
    exclude_impossible_tokens,
    given_count,
    masked_sum,
    safe_divide,
)

PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
GRPO_LOSS_TYPES = PPO_CLIP_LOSS_TYPES + ("cispo", "sapo")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SAPO_REDUCTIONS = ("sequence", "token")
_FLAG_FIELDS = ("use_bias_correction_kl", "force_on_policy_ratio", "count_empty_sequences")

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
        """Raise ``ValueError`` naming the offending field for an inconsistent configuration.

        NumPy scalars and 0-d tensors given for numeric fields and flags become Python floats,
        ints and bools first (one type for one value: the fingerprint compares reprs).

        Values that passed before (same types and values) are not checked again: every loss call
        validates its config, which may have been mutated since, or be a new one each call."""
        if _validated_key(self) in _VALIDATED:
            return
        for name, value in vars(self).items():
            if name in _FLAG_FIELDS:
                normalized = flag_argument(value)
            elif name == "max_completion_length":
                normalized = integer_argument(value)
            else:  # a number field: 0 and 0.0 alike (an int of a float field becomes a float)
                normalized = real_argument(value)
                if is_int(normalized):
                    normalized = float(normalized)
            if normalized is not value:
                setattr(self, name, normalized)
        _check_choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("importance_sampling_level", self.importance_sampling_level,
                      IMPORTANCE_SAMPLING_LEVELS)
        _check_choice("is_correction", self.is_correction, IS_CORRECTIONS)
        _check_choice("sapo_reduction", self.sapo_reduction, SAPO_REDUCTIONS)
        for name in _FLAG_FIELDS:
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
        key = _validated_key(self)
        if key is not None:
            _VALIDATED[key] = None
            if len(_VALIDATED) > _VALIDATED_LIMIT:
                del _VALIDATED[next(iter(_VALIDATED))]

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
        return zlib.crc32(repr(field_values(self)).encode())


def field_values(config: GRPOConfig) -> tuple:
    """The values of the config's dataclass fields, in their order (one getter per class, built
    once: fields() and a generator on every call were host time in the steady state)."""
    getter = _FIELD_GETTERS.get(type(config))
    if getter is None:
        getter = _FIELD_GETTERS[type(config)] = operator.attrgetter(*(f.name for f in fields(config)))
    return getter(config)


_FIELD_GETTERS: Dict[type, Callable] = {}

# Configs whose values passed validate(), keyed by their types and values: only plain Python
# values (exactly str, float, int, bool or None), whose equality is that of the value itself.
_PLAIN_TYPES = frozenset((str, float, int, bool, type(None)))
_VALIDATED: Dict[tuple, None] = {}
_VALIDATED_LIMIT = 64


def _validated_key(config: GRPOConfig) -> Optional[tuple]:
    state = vars(config)
    kinds = tuple(map(type, state.values()))
    if not _PLAIN_TYPES.issuperset(kinds):
        return None
    return type(config), tuple(state), kinds, tuple(state.values())


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

    def flags():
        return [*((f"{name} given", tensor is not None) for name, tensor in optional.items()),
                ("normalizer given", normalizer is not None),
                ("config", config.fingerprint() if isinstance(config, GRPOConfig) else 0), *extra_flags]

    is_tensor = isinstance(logprobs, Tensor)
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
    excluded: Tensor  # weighted tokens dropped for a -inf log-prob
    on_policy: bool  # old = lp.detach()
    old: Tensor
    log_ratio: Optional[Tensor]  # GSPO: lp - old on valid tokens (differentiable), 0 elsewhere
    log_rho: Optional[Tensor]  # sequence correction: old - sampling on valid tokens (detached), 0 elsewhere
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
    # only the sequence sums read these; the per-token terms form their own differences
    log_ratio = None
    if config.importance_sampling_level == "sequence":
        log_ratio = _masked_difference(logprobs, old, valid)
    log_rho = None
    if sampling is not None and config.is_correction.startswith("sequence"):
        log_rho = _masked_difference(old, sampling, valid).detach()
    reference = _constant(reference_logprobs, logprobs) if config.beta > 0 else None
    return _Tokens(logprobs, adv, weights, excluded, on_policy, old, log_ratio, log_rho, reference, sampling)


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
    if tokens.log_ratio is not None:
        parts["log_ratio"] = masked_sum(tokens.log_ratio, weights, dim=-1)
    if tokens.log_rho is not None:
        parts["log_rho"] = masked_sum(tokens.log_rho, weights, dim=-1)
    # GSPO's log-ratio sums weigh every rank's tokens, whose partial losses are summed again
    sums = sum_over_cp(parts, cp_group, feeds_partials=True)
    return BatchTotals(sums["sequence_weight"].detach(), sums["sequence_weight"].sum().detach(),
                       sums["excluded"].detach(), sums.get("log_ratio"),
                       None if "log_rho" not in sums else sums["log_rho"].detach())


# ---- step 3: what the batch totals give each token -------------------------------------------------


def _count(value: Normalizer, like: Tensor) -> Tensor:
    """A count as a 0-dim tensor of ``like``'s dtype and device. A Python number is written by a
    fill kernel: copying it from the host would make the host wait for the device. (A given
    normalizer was checked by its entry point: grpo_loss, linear_grpo's _grpo_grads.)"""
    if isinstance(value, Tensor):
        return value.detach().to(dtype=like.dtype, device=like.device).reshape(())
    return torch.full((), float(value), dtype=like.dtype, device=like.device)


def _normalization_weight(totals: BatchTotals, config: GRPOConfig, normalizer: Optional[Normalizer],
                          like: Tensor) -> Tensor:
    """``s``: d loss / d (m·x) of a token, so that ``loss = Σ s·m·x`` (``[B, 1]`` or ``[1, 1]``).

    * ``dapo``, ``bnpo``, ``cispo``, ``sapo`` with ``sapo_reduction="token"``: ``1 / N_tokens``;
    * ``grpo``, ``sapo`` (per sequence): ``1 / (Σ_t m · N_sequences)`` for the tokens of a sequence,
      i.e. ``Σ_i (Σ_t m·x / Σ_t m) / N_sequences``; an empty sequence contributes 0, and counts in
      the default ``N_sequences`` iff ``count_empty_sequences``;
    * ``dr_grpo``: ``1 / (N_sequences · max_completion_length)``, ``N_sequences = B``.

    ``normalizer`` overrides the default count; a zero count gives 0 (no valid tokens).
    """
    num_rows = totals.sequence_weight.shape[0]
    # [1, 1], not 0-dim: torch.compile reads a 0-dim CPU tensor as a number, guarded by its value
    one = torch.ones((1, 1), dtype=like.dtype, device=like.device)
    if config.per_sequence_mean:
        if normalizer is None:
            normalizer = num_rows if config.count_empty_sequences else (totals.sequence_weight != 0).sum()
        per_token_of_sequence = safe_divide(one.expand(num_rows, 1), totals.sequence_weight.unsqueeze(-1))
        return safe_divide(per_token_of_sequence, _count(normalizer, like))
    if config.loss_type == "dr_grpo":
        num_sequences = _count(num_rows if normalizer is None else normalizer, like)
        return safe_divide(one, num_sequences * config.max_completion_length)
    return safe_divide(one, totals.total_weight if normalizer is None else _count(normalizer, like))


@dataclass
class TokenInputs:
    """What ``token_terms`` reads besides the policy log-probs, each broadcastable to them; all
    constants. ``old`` None: on-policy (the policy's own log-probs)."""

    advantages: Tensor
    weights: Tensor  # m: the mask, 0 on excluded tokens
    scale: Tensor  # s: the normalization weight (_normalization_weight)
    old: Optional[Tensor] = None
    reference: Optional[Tensor] = None  # only with beta > 0
    sampling: Optional[Tensor] = None
    sequence_log_rho: Optional[Tensor] = None  # Σ_t m·(old - sampling) of the token's sequence

    FIELDS = ("advantages", "weights", "scale", "old", "reference", "sampling", "sequence_log_rho")

    def present(self) -> Tuple[str, ...]:
        return tuple(name for name in self.FIELDS if getattr(self, name) is not None)


def _token_inputs(tokens: _Tokens, totals: BatchTotals, config: GRPOConfig,
                  normalizer: Optional[Normalizer]) -> TokenInputs:
    sequence_log_rho = None
    if tokens.sampling is not None and totals.sequence_log_rho is not None:
        sequence_log_rho = totals.sequence_log_rho.unsqueeze(-1)
    return TokenInputs(tokens.adv, tokens.weights,
                       _normalization_weight(totals, config, normalizer, tokens.logprobs),
                       None if tokens.on_policy else tokens.old, tokens.reference, tokens.sampling,
                       sequence_log_rho)


def token_inputs(advantages, mask, config: GRPOConfig, *, like: Tensor, old_logprobs=None,
                 reference_logprobs=None, sampling_logprobs=None, normalizer=None,
                 cp_group=None) -> Tuple[TokenInputs, BatchTotals]:
    """The ``TokenInputs`` ([B, T]-broadcastable) and ``BatchTotals`` of a call whose policy
    log-probs are not known yet (checks not included; the totals' CP all-reduce runs here).

    ``like``: a [B, T] tensor of the policy log-probs' dtype and device, standing in for them. Only
    for token-level ratios and, on-policy, token-level corrections: nothing here may depend on the
    policy log-probs (linear_grpo.gradients_in_forward_apply).
    """
    tokens = _tokens(like, advantages, mask, config, old_logprobs, reference_logprobs, sampling_logprobs)
    totals = _batch_totals(tokens, config, cp_group)
    return _token_inputs(tokens, totals, config, normalizer), totals


# ---- step 4: the per-token terms (the one definition of the GRPO per-token math) -------------------


@dataclass
class TokenTerms:
    """Everything the loss and its metrics need of each token (shapes: the broadcast of the inputs).

    Every entry is exactly 0 on a token of zero weight (masked or excluded), whatever its inputs
    hold there; its extremes are -inf.
    """

    pg: Tensor  # s·m·ℓ·ρ
    kl: Optional[Tensor]  # s·m·kl (only with beta > 0)
    grad_logprob: Tensor  # d(pg + beta·kl)/d lp with the ratio r held fixed
    grad_ratio: Tensor  # d(pg + beta·kl)/d r (token-level r: the full gradient is grad_logprob + grad_ratio·r)
    ratio: Tensor  # r
    numerators: Dict[str, Tensor]  # m·value of each mask-weighted mean metric, by metric name
    extremes: Dict[str, Tensor]  # values whose maximum is reported ("*_min": of -value); "any": 1 if valid


def _ppo_clip_terms(ratio: Tensor, adv: Tensor, config: GRPOConfig):
    """``ℓ = max(-A·r', -A·clip(r, 1-ε_low, 1+ε_high))`` with ``r' = min(r, delta)``; with
    ``dual_clip_c = c``, ``ℓ = min(ℓ, -A·c)`` where ``A < 0`` (bounds the loss of a negative-advantage
    token whose ratio exploded). Returns ``(ℓ, dℓ/dr, flags)``.

    Gradients as torch's autograd gives them: clamp passes it where ``min <= r <= max``
    (inclusive), maximum to the larger branch and half to each on a tie (both branches equal, as
    on-policy at r = 1 or at a clip boundary hit exactly).
    """
    low, high = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high
    below, above = ratio < low, ratio > high
    neg_adv = -adv
    unclipped = ratio if config.delta is None else ratio.clamp(max=config.delta)
    unclipped_branch, clipped_branch = neg_adv * unclipped, neg_adv * ratio.clamp(low, high)
    objective = torch.maximum(unclipped_branch, clipped_branch)
    share_unclipped = (unclipped_branch > clipped_branch).to(ratio.dtype).masked_fill(
        unclipped_branch == clipped_branch, 0.5)
    through_unclipped = share_unclipped
    if config.delta is not None:
        through_unclipped = share_unclipped.masked_fill(ratio > config.delta, 0.0)
    through_clipped = (1.0 - share_unclipped).masked_fill(below | above, 0.0)
    d_objective = neg_adv * (through_unclipped + through_clipped)
    flags = {"clip_low": below & (adv < 0), "clip_high": above & (adv > 0)}
    if config.dual_clip_c is not None:
        dual_bound = neg_adv * config.dual_clip_c
        dual_active = (adv < 0) & (objective > dual_bound)
        objective = torch.where(dual_active, dual_bound, objective)
        d_objective = d_objective.masked_fill(dual_active, 0.0)
        flags["dual_clip"] = dual_active
    return objective, d_objective, flags


def _cispo_terms(ratio: Tensor, adv: Tensor, logprobs: Tensor, config: GRPOConfig):
    """``ℓ = -A · sg(clamp(r, low, cispo_max_ratio)) · lp``: the (detached) ratio only weights the
    gradient of lp; ``low = cispo_min_ratio``, or ``1 - epsilon_low`` when that is None. Returns
    ``(ℓ, dℓ/dlp, flags)``."""
    low = config.cispo_lower_bound
    coefficient = -adv * ratio.clamp(min=low, max=config.cispo_max_ratio)
    flags = {"clip_low": ratio < low, "clip_high": ratio > config.cispo_max_ratio}
    return coefficient * logprobs, coefficient, flags


def _sapo_terms(ratio: Tensor, adv: Tensor, config: GRPOConfig):
    """``ℓ = -A · σ(τ(r-1)) · 4/τ``, ``τ = sapo_temperature_pos`` if A > 0 else ``_neg``.

    A smooth gate instead of a hard clip (its slope at r = 1 is 1, like the unclipped objective);
    nothing is clipped, so no clip flags. Returns ``(ℓ, dℓ/dr)``.
    """
    tau = torch.where(adv > 0, torch.full_like(adv, config.sapo_temperature_pos), config.sapo_temperature_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    four_over_tau = 4.0 / tau
    objective = -adv * gate * four_over_tau
    return objective, (four_over_tau * -adv) * ((1.0 - gate) * gate) * tau


def _is_correction_terms(log_rho: Tensor, config: GRPOConfig):
    """``(ρ_raw, ρ)``: ``ρ_raw = exp(old - sampling)`` of the token or ``exp(Σ_t m·(old - sampling))``
    of its sequence; ``ρ`` is ``ρ_raw`` truncated to ``[is_clip_min, is_clip_max]`` ("*_truncate")
    or zeroed outside it ("*_mask"). Both are constants (no gradient)."""
    rho_raw = torch.exp(log_rho)
    lo, hi = config.is_clip_min, config.is_clip_max
    if config.is_correction.endswith("_truncate"):
        return rho_raw, rho_raw.clamp(min=lo, max=hi)
    inside = None
    if lo is not None:
        inside = rho_raw >= lo
    if hi is not None:
        inside = rho_raw <= hi if inside is None else inside & (rho_raw <= hi)
    return rho_raw, torch.where(inside, rho_raw, 0.0)  # not ρ·1[...]: inf·0 = NaN


def _kl_terms(reference: Tensor, logprobs: Tensor, config: GRPOConfig):
    """Per-token estimate of KL(π || π_ref) from ``d = clamp(ref - lp, ±kl_input_clamp)`` and its
    derivative w.r.t. lp: ``k1 = -d``, ``k2 = d²/2``, ``k3 = exp(d) - 1 - d``, then clamped to
    ``±kl_output_clamp``. (The bias correction ``kl·r`` is the caller's; the train/inference
    correction ρ never touches the KL.)"""
    d = reference - logprobs
    clamped = None  # where a clamp stops the gradient (its bounds pass it: inclusive)
    if config.kl_input_clamp is not None:
        bound = config.kl_input_clamp
        clamped = (d < -bound) | (d > bound)
        d = d.clamp(-bound, bound)
    if config.kl_estimator == "k1":
        kl, dkl_dlp = -d, torch.ones_like(d)
    elif config.kl_estimator == "k2":
        kl, dkl_dlp = 0.5 * d * d, -d
    else:
        exp_d = torch.exp(d)
        kl, dkl_dlp = exp_d - 1.0 - d, 1.0 - exp_d
    if config.kl_output_clamp is not None:
        bound = config.kl_output_clamp
        outside = (kl < -bound) | (kl > bound)
        clamped = outside if clamped is None else clamped | outside
        kl = kl.clamp(-bound, bound)
    # a select, not a product: 1 - exp(d) may be -inf where the output clamp holds
    return kl, dkl_dlp if clamped is None else dkl_dlp.masked_fill(clamped, 0.0)


def applies_correction(config: GRPOConfig, has_sampling: bool) -> bool:
    """Whether the train/inference correction ρ is applied (it needs sampling log-probs)."""
    return has_sampling and config.is_correction != "none"


def token_terms(config: GRPOConfig, logprobs: Tensor, advantages: Tensor, weights: Tensor, scale: Tensor, *,
                old: Optional[Tensor] = None, reference: Optional[Tensor] = None,
                sampling: Optional[Tensor] = None, sequence_log_rho: Optional[Tensor] = None,
                sequence_log_ratio: Optional[Tensor] = None) -> TokenTerms:
    """The GRPO per-token math (module doc) and its closed-form derivatives, elementwise.

    ``logprobs`` are the policy's (values: the derivatives are returned, not traced); the other
    inputs are constants broadcastable to them (``TokenInputs``): ``old`` None = on-policy;
    ``sequence_log_rho`` for a sequence-level correction; ``sequence_log_ratio``: GSPO's
    ``Σ_t m·(lp - old) / Σ_t m`` of the token's sequence, which then gives r (the caller chains
    ``grad_ratio`` through that sequence mean).

    Plain elementwise ops and branches on the config only: no host sync, no data-dependent shape,
    so the same definition runs eagerly or as one compiled kernel.
    """
    invalid = weights == 0

    def known(values: Tensor) -> Tensor:
        # Masked positions may hold anything (NaN, ±inf): every input is 0 there, so that every
        # term is finite and its product with the zero weight exactly 0.
        return values.masked_fill(invalid, 0.0)

    lp, adv = known(logprobs), known(advantages)
    old_lp = lp if old is None else known(old)
    ratio = torch.exp(lp - old_lp if sequence_log_ratio is None else known(sequence_log_ratio))

    d_policy_dlp = d_policy_dr = None
    if config.loss_type == "cispo":
        policy, d_policy_dlp, flags = _cispo_terms(ratio, adv, lp, config)
    elif config.loss_type == "sapo":
        policy, d_policy_dr = _sapo_terms(ratio, adv, config)
        flags = None
    else:
        policy, d_policy_dr, flags = _ppo_clip_terms(ratio, adv, config)

    corrected = applies_correction(config, sampling is not None)
    if sampling is not None:
        token_log_rho = old_lp - known(sampling)
    if corrected:
        sequence_level = config.is_correction.startswith("sequence")
        rho_raw, rho = _is_correction_terms(known(sequence_log_rho) if sequence_level else token_log_rho, config)
        policy = policy * rho
        d_policy_dlp = None if d_policy_dlp is None else d_policy_dlp * rho
        d_policy_dr = None if d_policy_dr is None else d_policy_dr * rho

    loss_weight = scale * weights
    d_dlp, d_dr = d_policy_dlp, d_policy_dr
    kl = None
    if config.beta > 0:
        kl, dkl_dlp = _kl_terms(known(reference), lp, config)
        if config.use_bias_correction_kl:  # sampled from π_old, not π: kl·r
            d_dr = config.beta * kl if d_dr is None else d_dr + config.beta * kl
            kl, dkl_dlp = kl * ratio, dkl_dlp * ratio
        d_dlp = config.beta * dkl_dlp if d_dlp is None else d_dlp + config.beta * dkl_dlp
        kl = loss_weight * kl
    zero = torch.zeros_like(weights)

    def counted(flag: Tensor) -> Tensor:
        return weights * flag

    def valid_only(values: Tensor) -> Tensor:
        return values.masked_fill(invalid, float("-inf"))

    numerators = {"ratio_mean": weights * ratio}
    if flags is None:  # sapo clips nothing
        numerators.update(clip_ratio_low=zero, clip_ratio_high=zero, clip_ratio=zero)
    else:
        numerators.update(clip_ratio_low=counted(flags["clip_low"]), clip_ratio_high=counted(flags["clip_high"]),
                          clip_ratio=counted(flags["clip_low"] | flags["clip_high"]))
        if "dual_clip" in flags:
            numerators["dual_clip_ratio"] = counted(flags["dual_clip"])
    extremes = {"any": (~invalid).to(lp.dtype), "ratio_max": valid_only(ratio), "ratio_min": valid_only(-ratio)}
    if corrected:
        numerators.update(is_ratio_mean=weights * rho_raw, is_clip_ratio=counted(rho != rho_raw))
        extremes.update(is_ratio_max=valid_only(rho_raw), is_ratio_min=valid_only(-rho_raw))
    if sampling is not None:
        numerators["token_mult_prob_error"] = weights * torch.exp(token_log_rho.abs())
    return TokenTerms(loss_weight * policy, kl, zero if d_dlp is None else loss_weight * d_dlp,
                      zero if d_dr is None else loss_weight * d_dr, ratio, numerators, extremes)


# ---- step 5: sums of the per-token terms, evaluated once per block of tokens -----------------------


def metric_sum_names(config: GRPOConfig, has_sampling: bool) -> Tuple[str, ...]:
    """The entries of ``term_sums``' sum vector: ``"pg"``, ``"kl"`` (beta > 0), then the
    numerators of ``TokenTerms.numerators`` in their order."""
    names = ["pg"] + (["kl"] if config.beta > 0 else [])
    names += ["ratio_mean", "clip_ratio_low", "clip_ratio_high", "clip_ratio"]
    if config.dual_clip_c is not None:  # (PPO clip only)
        names.append("dual_clip_ratio")
    if applies_correction(config, has_sampling):
        names += ["is_ratio_mean", "is_clip_ratio"]
    if has_sampling:
        names.append("token_mult_prob_error")
    return tuple(names)


def extreme_names(config: GRPOConfig, has_sampling: bool) -> Tuple[str, ...]:
    """The entries of ``term_sums``' maxima vector (those of ``TokenTerms.extremes``)."""
    names = ("any", "ratio_max", "ratio_min")
    return names + (("is_ratio_max", "is_ratio_min") if applies_correction(config, has_sampling) else ())


def reduce_token_terms(config: GRPOConfig, logprobs, advantages, weights, scale, old, reference, sampling,
               sequence_log_rho, sequence_log_ratio):
    """``(grad, sequence_grad, sums, maxima)`` of a block of tokens (see ``term_sums``)."""
    terms = token_terms(config, logprobs, advantages, weights, scale, old=old, reference=reference,
                        sampling=sampling, sequence_log_rho=sequence_log_rho,
                        sequence_log_ratio=sequence_log_ratio)
    # d loss/dr · r, 0 where d loss/dr is 0 (a clipped token, CISPO's): there r may have overflowed
    # to inf (lp - old > 88.7 in fp32), and 0 · inf would make the token's gradient NaN
    through_ratio = torch.where(terms.grad_ratio == 0, 0.0, terms.grad_ratio * terms.ratio)
    if sequence_log_ratio is None:  # dr/dlp = r
        grad, sequence_grad = terms.grad_logprob + through_ratio, None
    else:  # GSPO: r = exp(sequence mean), dr/d(mean) = r, summed over the sequence's tokens
        grad, sequence_grad = terms.grad_logprob, through_ratio.sum(-1)
    per_token = [terms.pg] + ([terms.kl] if terms.kl is not None else []) + list(terms.numerators.values())
    count = len(per_token)
    sums = torch.stack(per_token).reshape(count, -1).sum(1)
    if logprobs.numel() == 0:
        maxima = logprobs.new_full((len(terms.extremes),), float("-inf"))
    else:
        maxima = torch.stack(list(terms.extremes.values())).reshape(len(terms.extremes), -1).amax(1)
    return grad, sequence_grad, sums, maxima


# On CUDA the per-token terms and their sums run as one compiled kernel (the eager version launches
# one kernel per elementwise op); elsewhere eagerly, the same definition.
FUSE_ON_CUDA = True
FUSE_ON_CPU = False  # for tests of the compiled path where there is no GPU
_compiled_functions: Dict[tuple, Optional[Callable]] = {}  # None: compilation failed, eager
_warned_compile_failure = False


def compiler_failure(error: Exception) -> bool:
    """Whether `error`, raised by a compiled evaluation or a kernel's launch, may be the compiler's
    (a version's bug: the definition computes the same, so the caller falls back to it for this
    config from then on). Not where the fault lies outside the compiler, which the caller must see
    and which the fallback would hide for the rest of the process: running out of memory, a CUDA
    error (a faulty launch, a device fault), a tensor the kernel cannot read (on the CPU), a
    synchronizing call under torch.cuda.set_sync_debug_mode("error"), anything raised while a CUDA
    graph is being captured."""
    if isinstance(error, _NOT_THE_COMPILERS):
        return False
    message = str(error)
    if any(sign in message for sign in _NOT_THE_COMPILERS_MESSAGES):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_initialized()
                and torch.cuda.is_current_stream_capturing())


_NOT_THE_COMPILERS = tuple(kind for kind in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None))
                           if kind is not None)
# torch's sync debug error, CUDA errors as torch and Triton's launcher word them, Triton's refusal of
# a CPU tensor
_NOT_THE_COMPILERS_MESSAGES = ("synchronizing CUDA operation", "CUDA error", "Triton Error [CUDA]",
                               "cannot be accessed from Triton")


def _fuses(device: torch.device) -> bool:
    wanted = (FUSE_ON_CUDA and device.type == "cuda") or (FUSE_ON_CPU and device.type == "cpu")
    # not while tracing (an enclosing torch.compile fuses the eager definition itself) nor under a
    # dispatch mode (op counters, debug modes): torch.compile does not run there
    return wanted and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def _compiled(function: Callable, config: GRPOConfig, key: tuple) -> Optional[Callable]:
    if key not in _compiled_functions:
        frozen = replace(config)  # the options as they are now (a config object may be mutated later)

        def evaluate(*args):
            return function(frozen, *args)

        # with a code object of its own: torch.compile keeps compiled graphs (and counts
        # recompilations against its limit) per code object, and every key is another graph
        evaluate = types.FunctionType(evaluate.__code__.replace(), evaluate.__globals__, evaluate.__name__,
                                      None, evaluate.__closure__)
        compiled = torch.compile(evaluate, dynamic=True, fullgraph=True)
        # The options are constants of the kernel. Left symbolic (torch's default for Python
        # floats), inductor's graph cache was seen to hand one config's kernel to another.
        _compiled_functions[key] = torch._dynamo.config.patch(specialize_float=True)(compiled)
    return _compiled_functions[key]


def fused(function: Callable, config: GRPOConfig, device: torch.device, *args, static: tuple = ()):
    """`function(config, *args)`, compiled into a few kernels where `_fuses(device)` (once per
    function, config, `static` values and pattern of None arguments), else eagerly: the same
    definition. A compiler failure falls back to the eager call, with one warning."""
    global _warned_compile_failure
    if _fuses(device):
        key = (function.__qualname__, field_values(config), static,
               tuple(a is None for a in args))
        try:
            compiled = _compiled(function, config, key)
            if compiled is not None:
                return compiled(*args)
        except Exception as error:  # noqa: BLE001 - a compiler failure: the eager definition is the same
            if not compiler_failure(error):
                raise
            _compiled_functions[key] = None
            if not _warned_compile_failure:
                _warned_compile_failure = True
                warnings.warn(f"grpo: compiling {function.__name__} failed ({type(error).__name__}: {error}); "
                              "evaluating it eagerly", RuntimeWarning, stacklevel=3)
    return function(config, *args)


def term_sums(config: GRPOConfig, logprobs: Tensor, inputs: TokenInputs,
              sequence_log_ratio: Optional[Tensor] = None):
    """``token_terms`` of a block of tokens, reduced: ``(grad, sequence_grad, sums, maxima)``.

    ``grad``: d(pg + beta·kl)/d lp per token (token-level r; for GSPO the part at fixed r), and
    ``sequence_grad`` (GSPO only): d(pg + beta·kl)/d(sequence mean log-ratio) summed over each
    sequence's tokens (last dim). ``sums``: the block's sums named by ``metric_sum_names``;
    ``maxima``: its maxima named by ``extreme_names`` (-inf for no valid token). On CUDA one
    compiled kernel (and the reductions'), elsewhere eagerly (`fused`).
    """
    return fused(reduce_token_terms, config, logprobs.device, logprobs, inputs.advantages, inputs.weights, inputs.scale,
                 inputs.old, inputs.reference, inputs.sampling, inputs.sequence_log_rho, sequence_log_ratio)


class _LossSums(torch.autograd.Function):
    """This rank's loss sum ``Σ s·m·(ℓ·ρ + beta·kl)`` with its metric sums and maxima; the backward
    applies the closed-form derivatives (no autograd graph through the per-token ops)."""

    @staticmethod
    def forward(ctx, logprobs, mean_log_ratio, config: GRPOConfig, inputs: TokenInputs):
        sequence_log_ratio = None if mean_log_ratio is None else mean_log_ratio.detach().unsqueeze(-1)
        grad, sequence_grad, sums, maxima = term_sums(config, logprobs.detach(), inputs, sequence_log_ratio)
        loss = sums[0] + config.beta * sums[1] if config.beta > 0 else sums[0].clone()
        ctx.save_for_backward(grad, sequence_grad)
        ctx.mark_non_differentiable(sums, maxima)
        return loss, sums, maxima

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums, _grad_maxima):
        grad, sequence_grad = ctx.saved_tensors
        return grad * grad_loss, None if sequence_grad is None else sequence_grad * grad_loss, None, None


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
    tokens = _tokens(at_least_fp32(logprobs), advantages, mask, config, old_logprobs, reference_logprobs,
                     sampling_logprobs)
    if isinstance(normalizer, Tensor):  # a count on a GPU, checked there (nll.given_count)
        normalizer = given_count(normalizer, tokens.logprobs)
    totals = _batch_totals(tokens, config, cp_group)
    inputs = _token_inputs(tokens, totals, config, normalizer)
    mean_log_ratio = None
    if totals.sequence_log_ratio is not None:  # GSPO: differentiable, its gradient chained by autograd
        mean_log_ratio = safe_divide(totals.sequence_log_ratio, totals.sequence_weight)
    loss_sum, sums, maxima = _LossSums.apply(logprobs, mean_log_ratio, config, inputs)
    entropy_sum = None
    if entropy is not None:
        entropy_sum = masked_sum(entropy.detach().to(tokens.weights.dtype), tokens.weights)
    return loss_and_metrics(config, tokens.sampling is not None, loss_sum, sums, maxima, totals, cp_group,
                            entropy_sum)


def loss_and_metrics(config: GRPOConfig, has_sampling: bool, loss_sum: Tensor, sums: Tensor, maxima: Tensor,
                     totals: BatchTotals, cp_group, entropy_sum: Optional[Tensor] = None
                     ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The loss and metrics from this rank's sums of the per-token terms (``term_sums``): one CP
    all-reduce SUM (the loss sum's backward: the identity) and one MAX."""
    parts = {"loss": loss_sum, "sums": sums}
    if entropy_sum is not None:
        parts["entropy"] = entropy_sum
    summed = sum_over_cp(parts, cp_group)
    maxima = max_over_cp({"maxima": maxima}, cp_group)["maxima"]
    loss = summed["loss"]
    with torch.no_grad():
        entropy = summed["entropy"].detach() if entropy_sum is not None else None
        values = metric_vector(config, loss.detach(), summed["sums"].detach(), maxima, totals.total_weight,
                               totals.num_excluded, has_sampling=has_sampling, entropy_sum=entropy)
        metrics = dict(zip(metric_names(config, has_sampling, entropy_sum is not None), values.unbind()))
    metrics["loss"] = loss.detach()
    return loss, metrics


def metric_names(config: GRPOConfig, has_sampling: bool, with_entropy: bool = False) -> Tuple[str, ...]:
    """The metrics of ``grpo_loss``, in the order of ``metric_vector``'s entries."""
    sums = metric_sum_names(config, has_sampling)
    names = ["loss", "pg_loss", "kl", "ratio_mean", "ratio_min", "ratio_max"]
    names += [name for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio", "dual_clip_ratio") if name in sums]
    if "is_ratio_mean" in sums:
        names += ["is_ratio_mean", "is_ratio_min", "is_ratio_max", "is_clip_ratio"]
    names += [name for name in ("token_mult_prob_error",) if name in sums] + (["entropy"] if with_entropy else [])
    return tuple(names) + ("num_excluded_tokens",)


def metric_vector(config: GRPOConfig, loss: Tensor, sums: Tensor, maxima: Tensor, total_weight: Tensor,
                  num_excluded: Tensor, *, has_sampling: bool, entropy_sum: Optional[Tensor] = None) -> Tensor:
    """The metrics (``metric_names`` order) from the summed per-token terms and maxima (over CP):
    means of the numerators over the mask's total weight, minima as -max(-x) and 0 without a valid
    token, as one vector (a few vector kernels, one compiled kernel in linear_grpo_loss)."""
    names = metric_sum_names(config, has_sampling)
    means = dict(zip(names, safe_divide(sums, total_weight).unbind()))
    totals = dict(zip(names, sums.unbind()))
    extremes = dict(zip(extreme_names(config, has_sampling), maxima.unbind()))
    any_valid = extremes.pop("any") > 0
    extremes = {name: torch.where(any_valid, -value if name.endswith("_min") else value, 0.0)
                for name, value in extremes.items()}
    values = {"loss": loss, "pg_loss": totals["pg"], "kl": totals.get("kl", torch.zeros_like(loss)),
              **{name: means[name] for name in names if name not in ("pg", "kl")}, **extremes,
              "num_excluded_tokens": num_excluded.to(loss.dtype)}
    if entropy_sum is not None:
        values["entropy"] = safe_divide(entropy_sum, total_weight)
    return torch.stack([values[name] for name in metric_names(config, has_sampling, entropy_sum is not None)])
