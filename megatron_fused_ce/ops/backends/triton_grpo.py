"""GRPO's per-token epilogue of a call whose chunk loop has one chunk, as one Triton kernel.

`whole_call_terms` gives what `linear_grpo._whole_call_terms` gives (same arguments, same results):
from the chunk's merged statistics and the call's per-token inputs, each token's d loss / d lp (and
its negative) and the call's metric vector. The definition of the math is grpo.token_terms and its
neighbours (losses/grpo.py); this kernel is its transcription for the GPU, checked against it for
every option by tests/test_grpo_triton.py. Why a kernel of its own: at the token counts of RL
micro-batches the compiled function it replaces cost ~0.45 ms of host time per call (dynamo's
entry and ~17 launches) while the GPU, having finished the logits GEMM, waited for the gradient's
coefficients; one launch costs ~0.03 ms.

One program walks the [B, T] batch twice in [BLOCK_B, BLOCK_T] tiles (the token counts of one
chunk: a few passes of a few microseconds each):

1. the batch totals: each sequence's weight (the mask, 0 on tokens a -inf old / sampling log-prob
   excludes) and, for a sequence-level correction, its Σ m·(old - sampling), kept in a scratch
   row per sequence; the total weight, the excluded count, the number of non-empty sequences;
2. each token's terms (grpo.token_terms): the ratio, the policy objective (PPO clip with delta and
   dual clip, CISPO or SAPO), the train/inference correction, the KL estimate, the derivative
   written at the token's position in the labels' layout, the metric numerators and extremes
   summed in registers; at the end the metric vector (grpo.metric_vector), its entries at the
   indices grpo.metric_names gives.

Only token-level ratios (the gradients-in-forward path: linear_grpo.gradients_in_forward_apply).
Math in fp32, as the torch definition computes on fp32 log-probs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...losses.grpo import applies_correction, field_values, metric_names  # the options' meaning, the metrics' order
from .. import deferred_errors
from .triton_common import cached_launch, f32 as _f32, next_power_of_2

TILE_ELEMENTS = 1024  # tokens per tile of the walk
WARPS = 4

_LOSS_CODES = {"cispo": 1, "sapo": 2}  # every other loss type: PPO clip (0)
_KL_CODES = {"k1": 1, "k2": 2, "k3": 3}


@triton.jit
def _token_weights(mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st,
                   b, b_ok, t, row_length, HAS_OLD: tl.constexpr, HAS_SAMPLING: tl.constexpr):
    """(in range, m, excluded, old, sampling) of the tile of sequences b and positions t: the mask
    as fp32 weights, 0 where the old or sampling log-prob is -inf (nll.exclude_impossible_tokens);
    old / sampling 0 where not given; everything 0 outside the batch."""
    ok = b_ok[:, None] & (t < row_length)[None, :]
    b64 = b.to(tl.int64)[:, None]
    t64 = t.to(tl.int64)[None, :]
    weights = tl.load(mask_ptr + b64 * mask_sb + t64 * mask_st, mask=ok, other=0).to(tl.float32)
    impossible = tl.zeros_like(weights) != 0
    old = tl.zeros_like(weights)
    sampling = tl.zeros_like(weights)
    if HAS_OLD:
        old = tl.load(old_ptr + b64 * old_sb + t64 * old_st, mask=ok, other=0).to(tl.float32)
        impossible = impossible | (old == float("-inf"))
    if HAS_SAMPLING:
        sampling = tl.load(samp_ptr + b64 * samp_sb + t64 * samp_st, mask=ok, other=0).to(tl.float32)
        impossible = impossible | (sampling == float("-inf"))
    excluded = impossible & (weights != 0)
    return ok, tl.where(excluded, 0.0, weights), excluded, old, sampling


@triton.jit
def _safe(denominator):
    """safe_divide's denominator: 1 where it is 0."""
    return tl.where(denominator != 0, denominator, 1.0)


@triton.jit
def _put(ptr, value, poison_ptr, HAS_POISON: tl.constexpr):
    """Store a metric, plus the call's poison (NaN where the device checks found bad contents,
    else 0) where the kernel is given it."""
    if HAS_POISON:
        value = value + tl.load(poison_ptr)
    tl.store(ptr, value)


@cached_launch
@triton.jit
def _whole_call_kernel(
    target_ptr, row_max_ptr, lse_ptr, labels_ptr, ignore_index,
    adv_ptr, adv_sb, adv_st, mask_ptr, mask_sb, mask_st,
    old_ptr, old_sb, old_st, ref_ptr, ref_sb, ref_st, samp_ptr, samp_sb, samp_st,
    normalizer_ptr, normalizer_value, scratch_ptr, grad_ptr, neg_grad_ptr, metrics_ptr, poison_ptr, loss_ptr,
    flags_ptr, num_rows, row_length, num_rows_f,
    LOSS: tl.constexpr, CLIP_LOW: tl.constexpr, CLIP_HIGH: tl.constexpr,
    HAS_DELTA: tl.constexpr, DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, DUAL_C: tl.constexpr,
    CISPO_LOW: tl.constexpr, CISPO_MAX: tl.constexpr, SAPO_POS: tl.constexpr, SAPO_NEG: tl.constexpr,
    KL: tl.constexpr, BETA: tl.constexpr, HAS_KL_IN: tl.constexpr, KL_IN: tl.constexpr,
    HAS_KL_OUT: tl.constexpr, KL_OUT: tl.constexpr, BIAS_KL: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_SAMPLING: tl.constexpr, CORRECTION: tl.constexpr, TRUNCATE: tl.constexpr,
    HAS_IS_LO: tl.constexpr, IS_LO: tl.constexpr, HAS_IS_HI: tl.constexpr, IS_HI: tl.constexpr,
    NORM: tl.constexpr, COUNT_EMPTY: tl.constexpr, NORMALIZER: tl.constexpr, MAX_LENGTH: tl.constexpr,
    SEQUENCE_FIRST: tl.constexpr,
    AT_DUAL: tl.constexpr, AT_IS: tl.constexpr, AT_ERROR: tl.constexpr, AT_EXCLUDED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, HAS_POISON: tl.constexpr = False,
    BAD_NORMALIZER: tl.constexpr = deferred_errors.BAD_NORMALIZER,
    FP32_TINY: tl.constexpr = float(torch.finfo(torch.float32).tiny),
    FP32_MAX: tl.constexpr = float(torch.finfo(torch.float32).max),
):
    offs_b = tl.arange(0, BLOCK_B)
    offs_t = tl.arange(0, BLOCK_T)

    # ---- pass 1: the batch totals (grpo._batch_totals)
    weight_sum = tl.zeros([BLOCK_B], tl.float32)
    excluded_sum = tl.zeros([BLOCK_B], tl.float32)
    nonempty = tl.zeros([BLOCK_B], tl.float32)
    for b0 in range(0, num_rows, BLOCK_B):
        b = b0 + offs_b
        b_ok = b < num_rows
        # tiles summed elementwise, reduced once after the walk along T (a reduction inside the
        # loop, its result carried and used twice, trips Triton 3.6's thread-locality pass)
        weight_tile = tl.zeros([BLOCK_B, BLOCK_T], tl.float32)
        excluded_tile = tl.zeros([BLOCK_B, BLOCK_T], tl.float32)
        log_rho_tile = tl.zeros([BLOCK_B, BLOCK_T], tl.float32)
        for t0 in range(0, row_length, BLOCK_T):
            t = t0 + offs_t
            ok, weights, excluded, old, sampling = _token_weights(
                mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, b, b_ok, t,
                row_length, HAS_OLD, HAS_SAMPLING)
            weight_tile += weights
            excluded_tile += excluded.to(tl.float32)
            if CORRECTION == 2:  # masked_sum of the masked difference old - sampling
                log_rho_tile += tl.where(weights != 0, old - sampling, 0.0) * weights
        sequence_weight = tl.sum(weight_tile, 1)
        tl.store(scratch_ptr + b, sequence_weight, mask=b_ok)
        if CORRECTION == 2:
            tl.store(scratch_ptr + num_rows + b, tl.sum(log_rho_tile, 1), mask=b_ok)
        weight_sum += sequence_weight
        excluded_sum += tl.sum(excluded_tile, 1)
        nonempty += (sequence_weight != 0).to(tl.float32)
    total_weight = tl.sum(weight_sum, 0)
    num_excluded = tl.sum(excluded_sum, 0)
    tl.debug_barrier()  # the scratch rows are read back by other threads of this program

    # ---- the normalization weight s (grpo._normalization_weight)
    if NORMALIZER == 1 or NORMALIZER == 3:  # a tensor
        given = tl.load(normalizer_ptr).to(tl.float32)
        if NORMALIZER == 3:  # as given, checked here as nll.given_count checks it: NaN, and the error
            count_ok = (given >= FP32_TINY) & (given <= FP32_MAX)  # (a finite count > 0 in fp32; NaN is not)
            given = tl.where(count_ok, given, float("nan"))
            tl.store(flags_ptr, tl.load(flags_ptr) | tl.where(count_ok, 0, BAD_NORMALIZER).to(tl.int64))
    elif NORMALIZER == 2:  # a number
        given = normalizer_value
    if NORM == 1:  # per-sequence mean: s = 1 / (Σ_t m · N_sequences)
        if NORMALIZER != 0:
            num_sequences = given
        elif COUNT_EMPTY:
            num_sequences = num_rows_f
        else:
            num_sequences = tl.sum(nonempty, 0)
        num_sequences = _safe(num_sequences)
        token_scale = 0.0
    elif NORM == 2:  # dr_grpo: 1 / (N_sequences · max_completion_length)
        if NORMALIZER != 0:
            dr_sequences = given
        else:
            dr_sequences = num_rows_f
        token_scale = 1.0 / _safe(dr_sequences * MAX_LENGTH)
    else:  # 1 / N_tokens
        if NORMALIZER != 0:
            token_scale = 1.0 / _safe(given)
        else:
            token_scale = 1.0 / _safe(total_weight)

    # ---- pass 2: each token's terms (grpo.token_terms), summed in registers
    zero_tile = tl.zeros([BLOCK_B, BLOCK_T], tl.float32)
    pg_sum = zero_tile
    kl_sum = zero_tile
    ratio_sum = zero_tile
    clip_low_sum = zero_tile
    clip_high_sum = zero_tile
    clip_sum = zero_tile
    dual_sum = zero_tile
    rho_sum = zero_tile
    rho_clip_sum = zero_tile
    error_sum = zero_tile
    any_max = zero_tile
    ratio_max = zero_tile + float("-inf")
    ratio_min = zero_tile + float("-inf")
    rho_max = zero_tile + float("-inf")
    rho_min = zero_tile + float("-inf")
    for b0 in range(0, num_rows, BLOCK_B):
        b = b0 + offs_b
        b_ok = b < num_rows
        if NORM == 1:
            sequence_weight = tl.load(scratch_ptr + b, mask=b_ok, other=0.0)
            sequence_scale = ((1.0 / _safe(sequence_weight)) / num_sequences)[:, None]
        if CORRECTION == 2:
            sequence_log_rho = tl.load(scratch_ptr + num_rows + b, mask=b_ok, other=0.0)[:, None]
        for t0 in range(0, row_length, BLOCK_T):
            t = t0 + offs_t
            ok, weights, excluded, old, sampling = _token_weights(
                mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, b, b_ok, t,
                row_length, HAS_OLD, HAS_SAMPLING)
            b64 = b.to(tl.int64)[:, None]
            t64 = t.to(tl.int64)[None, :]
            if SEQUENCE_FIRST:  # labels and statistics are [T, B]
                position = t64 * num_rows + b64
            else:
                position = b64 * row_length + t64
            labels = tl.load(labels_ptr + position, mask=ok, other=ignore_index)
            labelled = labels != ignore_index
            target = tl.load(target_ptr + position, mask=ok, other=0.0)
            row_max = tl.load(row_max_ptr + position, mask=ok, other=0.0)
            lse = tl.load(lse_ptr + position, mask=ok, other=0.0)
            logprob = tl.where(labelled, (target - row_max) - lse, 0.0)
            adv = tl.load(adv_ptr + b64 * adv_sb + t64 * adv_st, mask=ok, other=0).to(tl.float32)

            invalid = weights == 0  # every input 0 there (token_terms' known())
            lp = tl.where(invalid, 0.0, logprob)
            adv = tl.where(invalid, 0.0, adv)
            if HAS_OLD:
                old_lp = tl.where(invalid, 0.0, old)
            else:
                old_lp = lp
            ratio = tl.exp(lp - old_lp)

            # the policy objective and its derivatives (grpo._ppo_clip_terms, _cispo_terms, _sapo_terms)
            d_dlp = zero_tile
            d_dr = zero_tile
            flag_low = zero_tile != 0
            flag_high = flag_low
            flag_dual = flag_low
            if LOSS == 1:  # CISPO
                coefficient = -adv * tl.minimum(tl.maximum(ratio, CISPO_LOW), CISPO_MAX)
                flag_low = ratio < CISPO_LOW
                flag_high = ratio > CISPO_MAX
                policy = coefficient * lp
                d_dlp = coefficient
            elif LOSS == 2:  # SAPO
                tau = tl.where(adv > 0, SAPO_POS, SAPO_NEG)
                gate = tl.sigmoid(tau * (ratio - 1.0))
                four_over_tau = 4.0 / tau
                policy = -adv * gate * four_over_tau
                d_dr = (four_over_tau * -adv) * ((1.0 - gate) * gate) * tau
            else:  # PPO clip
                below = ratio < CLIP_LOW
                above = ratio > CLIP_HIGH
                neg_adv = -adv
                unclipped = ratio
                if HAS_DELTA:
                    unclipped = tl.minimum(ratio, DELTA)
                unclipped_branch = neg_adv * unclipped
                clipped_branch = neg_adv * tl.minimum(tl.maximum(ratio, CLIP_LOW), CLIP_HIGH)
                policy = tl.maximum(unclipped_branch, clipped_branch)
                share = tl.where(unclipped_branch == clipped_branch, 0.5,
                                 (unclipped_branch > clipped_branch).to(tl.float32))
                through_unclipped = share
                if HAS_DELTA:
                    through_unclipped = tl.where(ratio > DELTA, 0.0, share)
                through_clipped = tl.where(below | above, 0.0, 1.0 - share)
                d_dr = neg_adv * (through_unclipped + through_clipped)
                flag_low = below & (adv < 0)
                flag_high = above & (adv > 0)
                if HAS_DUAL:
                    dual_bound = neg_adv * DUAL_C
                    flag_dual = (adv < 0) & (policy > dual_bound)
                    policy = tl.where(flag_dual, dual_bound, policy)
                    d_dr = tl.where(flag_dual, 0.0, d_dr)

            # the train/inference correction rho (grpo._is_correction_terms): a constant factor
            if HAS_SAMPLING:
                token_log_rho = old_lp - tl.where(invalid, 0.0, sampling)
            if CORRECTION != 0:
                if CORRECTION == 2:
                    rho_raw = tl.exp(tl.where(invalid, 0.0, sequence_log_rho + zero_tile))
                else:
                    rho_raw = tl.exp(token_log_rho)
                if TRUNCATE:
                    rho = rho_raw
                    if HAS_IS_LO:
                        rho = tl.maximum(rho, IS_LO)
                    rho = tl.minimum(rho, IS_HI)
                else:
                    inside = rho_raw == rho_raw
                    if HAS_IS_LO:
                        inside = rho_raw >= IS_LO
                    if HAS_IS_HI:
                        inside = inside & (rho_raw <= IS_HI)
                    rho = tl.where(inside, rho_raw, 0.0)
                policy = policy * rho
                d_dlp = d_dlp * rho
                d_dr = d_dr * rho

            if NORM == 1:
                loss_weight = sequence_scale * weights
            else:
                loss_weight = token_scale * weights

            # the KL penalty (grpo._kl_terms)
            if KL != 0:
                d = tl.where(invalid, 0.0, tl.load(ref_ptr + b64 * ref_sb + t64 * ref_st, mask=ok, other=0)
                             .to(tl.float32)) - lp
                clamped = zero_tile != 0
                if HAS_KL_IN:
                    clamped = (d < -KL_IN) | (d > KL_IN)
                    d = tl.minimum(tl.maximum(d, -KL_IN), KL_IN)
                if KL == 1:
                    kl = -d
                    dkl_dlp = zero_tile + 1.0
                elif KL == 2:
                    kl = 0.5 * d * d
                    dkl_dlp = -d
                else:
                    exp_d = tl.exp(d)
                    kl = exp_d - 1.0 - d
                    dkl_dlp = 1.0 - exp_d
                if HAS_KL_OUT:
                    clamped = clamped | (kl < -KL_OUT) | (kl > KL_OUT)
                    kl = tl.minimum(tl.maximum(kl, -KL_OUT), KL_OUT)
                dkl_dlp = tl.where(clamped, 0.0, dkl_dlp)
                if BIAS_KL:  # sampled from the old policy: kl·r
                    d_dr = d_dr + BETA * kl
                    kl = kl * ratio
                    dkl_dlp = dkl_dlp * ratio
                d_dlp = d_dlp + BETA * dkl_dlp
                kl_sum += tl.where(ok, loss_weight * kl, 0.0)

            # d loss / d lp = d/dlp at fixed r + d/dr · dr/dlp (= r), 0 without a label
            grad = loss_weight * d_dlp + (loss_weight * d_dr) * ratio
            grad = tl.where(labelled, grad, 0.0)
            tl.store(grad_ptr + position, grad, mask=ok)
            tl.store(neg_grad_ptr + position, -grad, mask=ok)

            pg_sum += tl.where(ok, loss_weight * policy, 0.0)
            ratio_sum += tl.where(ok, weights * ratio, 0.0)
            clip_low_sum += weights * flag_low.to(tl.float32)
            clip_high_sum += weights * flag_high.to(tl.float32)
            clip_sum += weights * (flag_low | flag_high).to(tl.float32)
            if HAS_DUAL:
                dual_sum += weights * flag_dual.to(tl.float32)
            any_max = tl.maximum(any_max, tl.where(invalid, 0.0, 1.0))
            ratio_max = tl.maximum(ratio_max, tl.where(invalid, float("-inf"), ratio))
            ratio_min = tl.maximum(ratio_min, tl.where(invalid, float("-inf"), -ratio))
            if CORRECTION != 0:
                rho_sum += tl.where(ok, weights * rho_raw, 0.0)
                rho_clip_sum += weights * (rho != rho_raw).to(tl.float32)
                rho_max = tl.maximum(rho_max, tl.where(invalid, float("-inf"), rho_raw))
                rho_min = tl.maximum(rho_min, tl.where(invalid, float("-inf"), -rho_raw))
            if HAS_SAMPLING:
                error_sum += tl.where(ok, weights * tl.exp(tl.abs(token_log_rho)), 0.0)

    # ---- the metric vector (grpo.metric_vector), entries at grpo.metric_names' indices
    any_valid = tl.max(tl.max(any_max, 1), 0) > 0
    pg = tl.sum(tl.sum(pg_sum, 1), 0)
    kl_total = tl.sum(tl.sum(kl_sum, 1), 0)
    weight = _safe(total_weight)
    loss = pg
    if KL != 0:
        loss = pg + BETA * kl_total
    _put(metrics_ptr, loss, poison_ptr, HAS_POISON)
    if HAS_POISON:  # (the loss on its own too: a remembered route's output, remembered_routes.py)
        _put(loss_ptr, loss, poison_ptr, HAS_POISON)
    _put(metrics_ptr + 1, pg, poison_ptr, HAS_POISON)
    _put(metrics_ptr + 2, kl_total, poison_ptr, HAS_POISON)
    _put(metrics_ptr + 3, tl.sum(tl.sum(ratio_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
    _put(metrics_ptr + 4, tl.where(any_valid, -tl.max(tl.max(ratio_min, 1), 0), 0.0), poison_ptr, HAS_POISON)
    _put(metrics_ptr + 5, tl.where(any_valid, tl.max(tl.max(ratio_max, 1), 0), 0.0), poison_ptr, HAS_POISON)
    _put(metrics_ptr + 6, tl.sum(tl.sum(clip_low_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
    _put(metrics_ptr + 7, tl.sum(tl.sum(clip_high_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
    _put(metrics_ptr + 8, tl.sum(tl.sum(clip_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
    if HAS_DUAL:
        _put(metrics_ptr + AT_DUAL, tl.sum(tl.sum(dual_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
    if CORRECTION != 0:
        _put(metrics_ptr + AT_IS, tl.sum(tl.sum(rho_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
        _put(metrics_ptr + AT_IS + 1, tl.where(any_valid, -tl.max(tl.max(rho_min, 1), 0), 0.0), poison_ptr,
             HAS_POISON)
        _put(metrics_ptr + AT_IS + 2, tl.where(any_valid, tl.max(tl.max(rho_max, 1), 0), 0.0), poison_ptr,
             HAS_POISON)
        _put(metrics_ptr + AT_IS + 3, tl.sum(tl.sum(rho_clip_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
    if HAS_SAMPLING:
        _put(metrics_ptr + AT_ERROR, tl.sum(tl.sum(error_sum, 1), 0) / weight, poison_ptr, HAS_POISON)
    _put(metrics_ptr + AT_EXCLUDED, num_excluded, poison_ptr, HAS_POISON)


def _strides(t: Tensor):
    """(b, t) strides of a [B, T] tensor, or of a [B] one read as [B, T] (t stride 0)."""
    return (t.stride(0), 0) if t.dim() == 1 else (t.stride(0), t.stride(1))


def supported(config, mask: Tensor) -> bool:
    """Whether `whole_call_terms` computes this call: token-level ratios (the only ones the
    gradients-in-forward path takes) and at least one token."""
    return config.importance_sampling_level == "token" and mask.numel() > 0


_OPTIONS: dict = {}  # what _options gives, by its arguments (a config by its field values)


def _options(config, has_sampling: bool, on_policy: bool, sequence_first: bool, normalizer_kind: int) -> tuple:
    """(the metric names, the kernel's constexpr options) of a config and the call's kinds of inputs:
    made once per config values (forty options from the config's fields were host time on every
    call of an RL micro-batch)."""
    key = (type(config), field_values(config), has_sampling, on_policy, sequence_first, normalizer_kind)
    found = _OPTIONS.get(key)
    if found is not None:
        return found
    names = metric_names(config, has_sampling)
    corrected = applies_correction(config, has_sampling)
    ppo = config.loss_type not in _LOSS_CODES
    options = dict(
        LOSS=_LOSS_CODES.get(config.loss_type, 0),
        CLIP_LOW=1.0 - config.epsilon_low, CLIP_HIGH=1.0 + config.epsilon_high,
        HAS_DELTA=ppo and config.delta is not None, DELTA=float(config.delta or 0.0),
        HAS_DUAL=ppo and config.dual_clip_c is not None, DUAL_C=float(config.dual_clip_c or 0.0),
        CISPO_LOW=config.cispo_lower_bound, CISPO_MAX=config.cispo_max_ratio,
        SAPO_POS=config.sapo_temperature_pos, SAPO_NEG=config.sapo_temperature_neg,
        KL=_KL_CODES[config.kl_estimator] if config.beta > 0 else 0, BETA=config.beta,
        HAS_KL_IN=config.kl_input_clamp is not None, KL_IN=float(config.kl_input_clamp or 0.0),
        HAS_KL_OUT=config.kl_output_clamp is not None, KL_OUT=float(config.kl_output_clamp or 0.0),
        BIAS_KL=config.use_bias_correction_kl,
        HAS_OLD=not on_policy, HAS_SAMPLING=has_sampling,
        CORRECTION=(2 if config.is_correction.startswith("sequence") else 1) if corrected else 0,
        TRUNCATE=config.is_correction.endswith("_truncate"),
        HAS_IS_LO=config.is_clip_min is not None, IS_LO=float(config.is_clip_min or 0.0),
        HAS_IS_HI=config.is_clip_max is not None, IS_HI=float(config.is_clip_max or 0.0),
        NORM=1 if config.per_sequence_mean else (2 if config.loss_type == "dr_grpo" else 0),
        COUNT_EMPTY=config.count_empty_sequences,
        NORMALIZER=normalizer_kind,
        MAX_LENGTH=int(config.max_completion_length or 0), SEQUENCE_FIRST=sequence_first,
        AT_DUAL=names.index("dual_clip_ratio") if "dual_clip_ratio" in names else 0,
        AT_IS=names.index("is_ratio_mean") if "is_ratio_mean" in names else 0,
        AT_ERROR=names.index("token_mult_prob_error") if "token_mult_prob_error" in names else 0,
        AT_EXCLUDED=names.index("num_excluded_tokens"),
    )
    if len(_OPTIONS) >= 256:  # (configs made anew with other values, call after call: bounded)
        _OPTIONS.clear()
    found = _OPTIONS[key] = (names, options)
    return found


def whole_call_terms(config, target, row_max, log_sum_exp, advantages, mask, old, reference, sampling,
                     normalizer, labels, ignore_index: int, sequence_first: bool, poison: Optional[Tensor] = None,
                     check_normalizer: bool = False):
    """linear_grpo._whole_call_terms' (d loss / d lp, its negative, metric vector), in one launch,
    and the loss on its own where `poison` is given (fp32 [1], the call's: added to every metric
    and to the loss, as GRPOGrads.metrics adds it), else None.
    `normalizer`: None, a one-element tensor or a number (a kernel argument: no fill kernel, no
    new compilation when it changes). `check_normalizer` (a tensor on this device, as the caller
    gave it): the kernel checks it as nll.given_count does — NaN where it is not a finite count
    > 0, the error recorded in deferred_errors' flags — instead of given_count's five launches."""
    num_rows, row_length = mask.shape
    on_policy = old is None or config.force_on_policy_ratio
    normalizer_kind = (0 if normalizer is None else (3 if check_normalizer else 1) if isinstance(normalizer, Tensor)
                       else 2)
    names, options = _options(config, sampling is not None, on_policy, sequence_first, normalizer_kind)
    device = target.device
    rows = target.shape[0]
    # one allocation cut by one split (an allocation apiece is host time at RL row counts); the loss
    # apart: it is the output of the route's node, which must not be a view
    grad, neg_grad, metrics, scratch = torch.empty(2 * rows + len(names) + 2 * num_rows, dtype=torch.float32,
                                                   device=device).split((rows, rows, len(names), 2 * num_rows))
    loss = None if poison is None else torch.empty((), dtype=torch.float32, device=device)
    block_t = min(next_power_of_2(row_length), TILE_ELEMENTS)
    block_b = max(TILE_ELEMENTS // block_t, 1)
    old = None if on_policy else old
    dummy = grad  # stands for the inputs that are not given (never read)
    optional = [(x, *_strides(x)) if x is not None else (dummy, 0, 0) for x in (old, reference, sampling)]
    _whole_call_kernel[(1,)](
        _f32(target), _f32(row_max), _f32(log_sum_exp), labels.reshape(-1), ignore_index,
        advantages, *_strides(advantages), mask, *_strides(mask), *optional[0], *optional[1], *optional[2],
        normalizer if isinstance(normalizer, Tensor) else dummy,
        0.0 if normalizer is None or isinstance(normalizer, Tensor) else float(normalizer), scratch, grad, neg_grad, metrics,
        dummy if poison is None else _f32(poison), dummy if loss is None else loss,
        deferred_errors.flags(device) if normalizer_kind == 3 else scratch,  # (read only where it checks)
        num_rows, row_length, float(num_rows), **options, BLOCK_B=block_b, BLOCK_T=block_t,
        HAS_POISON=poison is not None, num_warps=WARPS,
    )
    return grad, neg_grad, metrics, loss
