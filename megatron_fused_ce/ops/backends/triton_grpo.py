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

`terms_in_launch_` takes the same terms into the launch that reads the logits (fast.TermsInLaunch:
TP = 1, one chunk of every row, where the host sets a call's time): each row's statistics, its
token's terms (`_token_terms`, the code the walk above runs), its dlogits, and the metric vector
from the programs' partial sums, which the last program to finish reduces (docs/design.md §10.9).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...losses.grpo import applies_correction, field_values, metric_names  # the options' meaning, the metrics' order
from .. import deferred_errors
from . import triton_backend
from .triton_backend import _label_totals, _online_softmax_sums, _row_label, _store_totals, _target_logit
from .triton_gemm_stats import round_bf16_by_hand
from .triton_common import cached_launch, f32 as _f32, next_power_of_2
from .triton_math import precise_log as _log

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
    return _weights_at(mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st,
                       b.to(tl.int64)[:, None], t.to(tl.int64)[None, :], ok, HAS_OLD, HAS_SAMPLING)


@triton.jit
def _weights_at(mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, b64, t64, ok,
                HAS_OLD: tl.constexpr, HAS_SAMPLING: tl.constexpr):
    """_token_weights at positions (b64, t64) (a tile, or one token), `ok` where they are in the batch."""
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
def _put(ptr, value, poison, HAS_POISON: tl.constexpr):
    """Store a metric, plus the call's poison (NaN where the device checks found bad contents,
    else 0) where the kernel is given it."""
    if HAS_POISON:
        value = value + poison
    tl.store(ptr, value)


@triton.jit
def _batch_totals(mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, scratch_ptr,
                  num_rows, row_length, HAS_OLD: tl.constexpr, HAS_SAMPLING: tl.constexpr, CORRECTION: tl.constexpr,
                  STORE_SEQUENCES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """grpo._batch_totals from one walk of the [B, T] batch: (total weight, excluded tokens,
    non-empty sequences); with STORE_SEQUENCES each sequence's weight (and, for a sequence-level
    correction, its Σ m·(old - sampling)) in the scratch rows."""
    offs_b = tl.arange(0, BLOCK_B)
    offs_t = tl.arange(0, BLOCK_T)
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
        if STORE_SEQUENCES:
            tl.store(scratch_ptr + b, sequence_weight, mask=b_ok)
            if CORRECTION == 2:
                tl.store(scratch_ptr + num_rows + b, tl.sum(log_rho_tile, 1), mask=b_ok)
        weight_sum += sequence_weight
        excluded_sum += tl.sum(excluded_tile, 1)
        nonempty += (sequence_weight != 0).to(tl.float32)
    return tl.sum(weight_sum, 0), tl.sum(excluded_sum, 0), tl.sum(nonempty, 0)


@triton.jit
def _sequence_sums(mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, b, row_length,
                   HAS_OLD: tl.constexpr, HAS_SAMPLING: tl.constexpr, CORRECTION: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """One sequence's weight and (sequence-level correction) Σ m·(old - sampling): _batch_totals'
    scratch row of sequence b, for a kernel that takes one token at a time."""
    offs_t = tl.arange(0, BLOCK_T)
    b64 = tl.full([], 0, tl.int64) + b
    weight_sum = tl.zeros([BLOCK_T], tl.float32)
    log_rho_sum = tl.zeros([BLOCK_T], tl.float32)
    for t0 in range(0, row_length, BLOCK_T):
        t = t0 + offs_t
        _ok, weights, _excluded, old, sampling = _weights_at(
            mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, b64, t.to(tl.int64),
            t < row_length, HAS_OLD, HAS_SAMPLING)
        weight_sum += weights
        if CORRECTION == 2:
            log_rho_sum += tl.where(weights != 0, old - sampling, 0.0) * weights
    return tl.sum(weight_sum, 0), tl.sum(log_rho_sum, 0)


@triton.jit
def _given_normalizer(normalizer_ptr, normalizer_value, NORMALIZER: tl.constexpr,
                      FP32_TINY: tl.constexpr, FP32_MAX: tl.constexpr):
    """(the normalizer the call gives, whether it is usable): a tensor's value (NORMALIZER 1), checked
    as nll.given_count checks it (3: NaN where it is not a finite count > 0 in fp32), or a number (2)."""
    given = 0.0
    count_ok = True
    if NORMALIZER == 1 or NORMALIZER == 3:
        given = tl.load(normalizer_ptr).to(tl.float32)
        if NORMALIZER == 3:
            count_ok = (given >= FP32_TINY) & (given <= FP32_MAX)  # (NaN is not)
            given = tl.where(count_ok, given, float("nan"))
    elif NORMALIZER == 2:
        given = normalizer_value
    return given, count_ok


@triton.jit
def _normalization(given, total_weight, nonempty, num_rows_f, NORM: tl.constexpr, COUNT_EMPTY: tl.constexpr,
                   NORMALIZER: tl.constexpr, MAX_LENGTH: tl.constexpr):
    """grpo._normalization_weight: (s of a token-level normalization, 0 for a per-sequence mean;
    the per-sequence mean's number of sequences)."""
    num_sequences = 1.0
    if NORM == 1:  # per-sequence mean: s = 1 / (Σ_t m · N_sequences)
        if NORMALIZER != 0:
            num_sequences = given
        elif COUNT_EMPTY:
            num_sequences = num_rows_f
        else:
            num_sequences = nonempty
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
    return token_scale, num_sequences


@triton.jit
def _token_terms(logprob, labelled, weights, adv, old, sampling, reference, sequence_log_rho, scale,
                 LOSS: tl.constexpr, CLIP_LOW: tl.constexpr, CLIP_HIGH: tl.constexpr,
                 HAS_DELTA: tl.constexpr, DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, DUAL_C: tl.constexpr,
                 CISPO_LOW: tl.constexpr, CISPO_MAX: tl.constexpr, SAPO_POS: tl.constexpr, SAPO_NEG: tl.constexpr,
                 KL: tl.constexpr, BETA: tl.constexpr, HAS_KL_IN: tl.constexpr, KL_IN: tl.constexpr,
                 HAS_KL_OUT: tl.constexpr, KL_OUT: tl.constexpr, BIAS_KL: tl.constexpr,
                 HAS_OLD: tl.constexpr, HAS_SAMPLING: tl.constexpr, CORRECTION: tl.constexpr, TRUNCATE: tl.constexpr,
                 HAS_IS_LO: tl.constexpr, IS_LO: tl.constexpr, HAS_IS_HI: tl.constexpr, IS_HI: tl.constexpr):
    """grpo.token_terms of a tile of tokens (or one token), whose weights m, advantages, old /
    sampling / reference log-probs and normalization weight s (`scale`) are given, their log-probs
    `logprob`: (d loss / d lp, 0 without a label; s·m·policy; s·m·kl; the ratio; the clip flags
    low / high / dual; rho as computed and as applied; m·exp|old - sampling|; whether the token
    takes no part)."""
    zero = tl.zeros_like(weights)
    invalid = weights == 0  # every input 0 there (token_terms' known())
    lp = tl.where(invalid, 0.0, logprob)
    adv = tl.where(invalid, 0.0, adv)
    if HAS_OLD:
        old_lp = tl.where(invalid, 0.0, old)
    else:
        old_lp = lp
    ratio = tl.exp(lp - old_lp)

    # the policy objective and its derivatives (grpo._ppo_clip_terms, _cispo_terms, _sapo_terms)
    d_dlp = zero
    d_dr = zero
    flag_low = zero != 0
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
        share = tl.where(unclipped_branch == clipped_branch, 0.5, (unclipped_branch > clipped_branch).to(tl.float32))
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
    token_log_rho = zero
    rho_raw = zero
    rho = zero
    if HAS_SAMPLING:
        token_log_rho = old_lp - tl.where(invalid, 0.0, sampling)
    if CORRECTION != 0:
        if CORRECTION == 2:
            rho_raw = tl.exp(tl.where(invalid, 0.0, sequence_log_rho + zero))
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

    loss_weight = scale * weights

    # the KL penalty (grpo._kl_terms)
    kl_term = zero
    if KL != 0:
        d = tl.where(invalid, 0.0, reference) - lp
        clamped = zero != 0
        if HAS_KL_IN:
            clamped = (d < -KL_IN) | (d > KL_IN)
            d = tl.minimum(tl.maximum(d, -KL_IN), KL_IN)
        if KL == 1:
            kl = -d
            dkl_dlp = zero + 1.0
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
        kl_term = loss_weight * kl

    # d loss / d lp = d/dlp at fixed r + d/dr · dr/dlp (= r), 0 without a label; the second term 0
    # where d/dr is (r may be inf there: grpo.reduce_token_terms)
    through_ratio = loss_weight * d_dr
    grad = loss_weight * d_dlp + tl.where(through_ratio == 0.0, 0.0, through_ratio * ratio)
    grad = tl.where(labelled, grad, 0.0)
    error = zero
    if HAS_SAMPLING:
        error = weights * tl.exp(tl.abs(token_log_rho))
    return (grad, loss_weight * policy, kl_term, ratio, flag_low, flag_high, flag_dual, rho_raw, rho, error,
            invalid)


@triton.jit
def _add_token_metrics(pg_sum, kl_sum, ratio_sum, clip_low_sum, clip_high_sum, clip_sum, dual_sum, rho_sum,
                       rho_clip_sum, error_sum, any_max, ratio_max, ratio_min, rho_max, rho_min,
                       ok, pg_term, kl_term, weights, ratio, flag_low, flag_high, flag_dual, rho_raw, rho, error, invalid,
                       CORRECTION: tl.constexpr):
    """The metrics' running sums and extremes (minima as max(-x)) with a token's (or a tile's) terms
    added, `ok` where they are in the batch."""
    pg_sum += tl.where(ok, pg_term, 0.0)
    kl_sum += tl.where(ok, kl_term, 0.0)
    ratio_sum += tl.where(ok, weights * ratio, 0.0)
    clip_low_sum += weights * flag_low.to(tl.float32)
    clip_high_sum += weights * flag_high.to(tl.float32)
    clip_sum += weights * (flag_low | flag_high).to(tl.float32)
    dual_sum += weights * flag_dual.to(tl.float32)
    any_max = tl.maximum(any_max, tl.where(invalid, 0.0, 1.0))
    ratio_max = tl.maximum(ratio_max, tl.where(invalid, float("-inf"), ratio))
    ratio_min = tl.maximum(ratio_min, tl.where(invalid, float("-inf"), -ratio))
    if CORRECTION != 0:
        rho_sum += tl.where(ok, weights * rho_raw, 0.0)
        rho_clip_sum += weights * (rho != rho_raw).to(tl.float32)
        rho_max = tl.maximum(rho_max, tl.where(invalid, float("-inf"), rho_raw))
        rho_min = tl.maximum(rho_min, tl.where(invalid, float("-inf"), -rho_raw))
    error_sum += tl.where(ok, error, 0.0)
    return (pg_sum, kl_sum, ratio_sum, clip_low_sum, clip_high_sum, clip_sum, dual_sum, rho_sum, rho_clip_sum,
            error_sum, any_max, ratio_max, ratio_min, rho_max, rho_min)


@triton.jit
def _store_metrics(metrics_ptr, loss_ptr, poison, pg, kl_total, ratio_sum, ratio_max, ratio_min, clip_low_sum,
                   clip_high_sum, clip_sum, dual_sum, rho_sum, rho_max, rho_min, rho_clip_sum, error_sum,
                   any_valid, total_weight, num_excluded,
                   KL: tl.constexpr, BETA: tl.constexpr, HAS_DUAL: tl.constexpr, CORRECTION: tl.constexpr,
                   HAS_SAMPLING: tl.constexpr, AT_DUAL: tl.constexpr, AT_IS: tl.constexpr, AT_ERROR: tl.constexpr,
                   AT_EXCLUDED: tl.constexpr, HAS_POISON: tl.constexpr, LOSS_APART: tl.constexpr):
    """The metric vector (grpo.metric_vector), its entries at grpo.metric_names' indices, from the
    call's sums and extremes (`ratio_min` / `rho_min` as max(-x)); the loss on its own too
    (LOSS_APART: a remembered route's output, remembered_routes.py)."""
    weight = _safe(total_weight)
    loss = pg
    if KL != 0:
        loss = pg + BETA * kl_total
    _put(metrics_ptr, loss, poison, HAS_POISON)
    if LOSS_APART:
        _put(loss_ptr, loss, poison, HAS_POISON)
    _put(metrics_ptr + 1, pg, poison, HAS_POISON)
    _put(metrics_ptr + 2, kl_total, poison, HAS_POISON)
    _put(metrics_ptr + 3, ratio_sum / weight, poison, HAS_POISON)
    _put(metrics_ptr + 4, tl.where(any_valid, -ratio_min, 0.0), poison, HAS_POISON)
    _put(metrics_ptr + 5, tl.where(any_valid, ratio_max, 0.0), poison, HAS_POISON)
    _put(metrics_ptr + 6, clip_low_sum / weight, poison, HAS_POISON)
    _put(metrics_ptr + 7, clip_high_sum / weight, poison, HAS_POISON)
    _put(metrics_ptr + 8, clip_sum / weight, poison, HAS_POISON)
    if HAS_DUAL:
        _put(metrics_ptr + AT_DUAL, dual_sum / weight, poison, HAS_POISON)
    if CORRECTION != 0:
        _put(metrics_ptr + AT_IS, rho_sum / weight, poison, HAS_POISON)
        _put(metrics_ptr + AT_IS + 1, tl.where(any_valid, -rho_min, 0.0), poison, HAS_POISON)
        _put(metrics_ptr + AT_IS + 2, tl.where(any_valid, rho_max, 0.0), poison, HAS_POISON)
        _put(metrics_ptr + AT_IS + 3, rho_clip_sum / weight, poison, HAS_POISON)
    if HAS_SAMPLING:
        _put(metrics_ptr + AT_ERROR, error_sum / weight, poison, HAS_POISON)
    _put(metrics_ptr + AT_EXCLUDED, num_excluded, poison, HAS_POISON)


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

    # ---- pass 1: the batch totals (grpo._batch_totals), each sequence's in the scratch rows
    total_weight, num_excluded, nonempty = _batch_totals(
        mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, scratch_ptr, num_rows,
        row_length, HAS_OLD, HAS_SAMPLING, CORRECTION, True, BLOCK_B, BLOCK_T)
    tl.debug_barrier()  # the scratch rows are read back by other threads of this program

    # ---- the normalization weight s (grpo._normalization_weight)
    given, count_ok = _given_normalizer(normalizer_ptr, normalizer_value, NORMALIZER, FP32_TINY, FP32_MAX)
    if NORMALIZER == 3:  # the error recorded as nll.given_count records it
        tl.store(flags_ptr, tl.load(flags_ptr) | tl.where(count_ok, 0, BAD_NORMALIZER).to(tl.int64))
    token_scale, num_sequences = _normalization(given, total_weight, nonempty, num_rows_f, NORM, COUNT_EMPTY,
                                                NORMALIZER, MAX_LENGTH)

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
        scale = zero_tile + token_scale
        if NORM == 1:
            sequence_weight = tl.load(scratch_ptr + b, mask=b_ok, other=0.0)
            scale = zero_tile + ((1.0 / _safe(sequence_weight)) / num_sequences)[:, None]
        sequence_log_rho = zero_tile
        if CORRECTION == 2:
            sequence_log_rho = zero_tile + tl.load(scratch_ptr + num_rows + b, mask=b_ok, other=0.0)[:, None]
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
            reference = zero_tile
            if KL != 0:
                reference = tl.load(ref_ptr + b64 * ref_sb + t64 * ref_st, mask=ok, other=0).to(tl.float32)
            grad, pg_term, kl_term, ratio, flag_low, flag_high, flag_dual, rho_raw, rho, error, invalid = _token_terms(
                logprob, labelled, weights, adv, old, sampling, reference, sequence_log_rho, scale,
                LOSS, CLIP_LOW, CLIP_HIGH, HAS_DELTA, DELTA, HAS_DUAL, DUAL_C, CISPO_LOW, CISPO_MAX, SAPO_POS,
                SAPO_NEG, KL, BETA, HAS_KL_IN, KL_IN, HAS_KL_OUT, KL_OUT, BIAS_KL, HAS_OLD, HAS_SAMPLING,
                CORRECTION, TRUNCATE, HAS_IS_LO, IS_LO, HAS_IS_HI, IS_HI)
            tl.store(grad_ptr + position, grad, mask=ok)
            tl.store(neg_grad_ptr + position, -grad, mask=ok)

            (pg_sum, kl_sum, ratio_sum, clip_low_sum, clip_high_sum, clip_sum, dual_sum, rho_sum, rho_clip_sum,
             error_sum, any_max, ratio_max, ratio_min, rho_max, rho_min) = _add_token_metrics(
                pg_sum, kl_sum, ratio_sum, clip_low_sum, clip_high_sum, clip_sum, dual_sum, rho_sum, rho_clip_sum,
                error_sum, any_max, ratio_max, ratio_min, rho_max, rho_min, ok, pg_term, kl_term, weights, ratio,
                flag_low, flag_high, flag_dual, rho_raw, rho, error, invalid, CORRECTION)

    # ---- the metric vector (grpo.metric_vector)
    poison = 0.0
    if HAS_POISON:
        poison = tl.load(poison_ptr)
    _store_metrics(metrics_ptr, loss_ptr, poison, tl.sum(tl.sum(pg_sum, 1), 0), tl.sum(tl.sum(kl_sum, 1), 0),
                   tl.sum(tl.sum(ratio_sum, 1), 0), tl.max(tl.max(ratio_max, 1), 0), tl.max(tl.max(ratio_min, 1), 0),
                   tl.sum(tl.sum(clip_low_sum, 1), 0), tl.sum(tl.sum(clip_high_sum, 1), 0),
                   tl.sum(tl.sum(clip_sum, 1), 0), tl.sum(tl.sum(dual_sum, 1), 0), tl.sum(tl.sum(rho_sum, 1), 0),
                   tl.max(tl.max(rho_max, 1), 0), tl.max(tl.max(rho_min, 1), 0), tl.sum(tl.sum(rho_clip_sum, 1), 0),
                   tl.sum(tl.sum(error_sum, 1), 0), tl.max(tl.max(any_max, 1), 0) > 0, total_weight, num_excluded,
                   KL, BETA, HAS_DUAL, CORRECTION, HAS_SAMPLING, AT_DUAL, AT_IS, AT_ERROR, AT_EXCLUDED, HAS_POISON,
                   HAS_POISON)


# the per-program partial sums of the launch below, in this order (then the extremes, as max(x))
_PARTIALS = ("pg", "kl", "ratio", "clip_low", "clip_high", "clip", "dual", "rho", "rho_clip", "error",
             "any", "ratio_max", "ratio_min", "rho_max", "rho_min")
_NUM_SUMS = 10
PARTIALS_STRIDE = 16  # a program's row of partials (a power of 2: the reduction's tile)


@triton.jit
def _publish(bits_ptr, value):
    """Store an fp32 partial for the other programs: an atomic exchange of its bits (at L2, where
    every program reads), relaxed: the count's acq_rel after the program's partials orders them."""
    tl.atomic_xchg(bits_ptr, value.to(tl.float32).to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _partial(values, columns, index: tl.constexpr):
    """Entry `index` of a reduced [NUM_PARTIALS] row, as a scalar."""
    return tl.sum(tl.where(columns == index, values, 0.0), 0)


@cached_launch
@triton.jit
def _terms_in_launch_kernel(
    logits_ptr, stride_row, labels_ptr, ignore_index, true_vocab, vocab_start, lmask_ptr, lmask_cols, lmask_s0,
    lmask_s1, local_target_ptr, labelled_ptr, poison_ptr, counts_ptr, scalars_ptr, flags_ptr,
    adv_ptr, adv_sb, adv_st, mask_ptr, mask_sb, mask_st,
    old_ptr, old_sb, old_st, ref_ptr, ref_sb, ref_st, samp_ptr, samp_sb, samp_st,
    normalizer_ptr, normalizer_value,
    max_ptr, target_out_ptr, log_sum_exp_ptr, lse_ptr, grad_ptr, neg_grad_ptr, metrics_ptr, loss_ptr,
    partials_ptr, partial_bits_ptr, arrivals_ptr,
    num_rows, row_length, num_rows_f, n, num_cols, num_valid_cols, inv_temperature,
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
    LABELS: tl.constexpr, HAS_LABELLED: tl.constexpr, HAS_POISON: tl.constexpr, LABEL_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr, STATS_N: tl.constexpr, DLOGITS_N: tl.constexpr, ROUND_BF16: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
    NUM_PARTIALS: tl.constexpr = PARTIALS_STRIDE, USED_PARTIALS: tl.constexpr = len(_PARTIALS),
    NUM_SUMS: tl.constexpr = _NUM_SUMS,
    BAD_LABELS: tl.constexpr = deferred_errors.LABELS_OUT_OF_RANGE,
    BAD_NORMALIZER: tl.constexpr = deferred_errors.BAD_NORMALIZER,
    FP32_TINY: tl.constexpr = float(torch.finfo(torch.float32).tiny),
    FP32_MAX: tl.constexpr = float(torch.finfo(torch.float32).max),
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # ---- the call's totals, the same values in every program: with LABELS label_targets' (with the
    # loss's mask; written by the first program), then the batch's (grpo._batch_totals)
    poison = 0.0
    if HAS_POISON and not LABELS:
        poison = tl.load(poison_ptr)
    if LABELS:
        count, bad = _label_totals(labels_ptr, 1, n, ignore_index, true_vocab, lmask_ptr, lmask_cols, lmask_s0,
                                   lmask_s1, True, LABEL_BLOCK)
        poison = tl.where(bad != 0, float("nan"), 0.0)
        if pid == 0:
            _store_totals(counts_ptr, scalars_ptr, flags_ptr, count, bad, poison,
                          1.0 / tl.maximum(count, 1).to(tl.float32), BAD_LABELS)
    total_weight, num_excluded, nonempty = _batch_totals(
        mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, mask_ptr, num_rows,
        row_length, HAS_OLD, HAS_SAMPLING, CORRECTION, False, BLOCK_B, BLOCK_T)
    given, count_ok = _given_normalizer(normalizer_ptr, normalizer_value, NORMALIZER, FP32_TINY, FP32_MAX)
    if NORMALIZER == 3:
        if pid == programs - 1:  # (another program than the labels': flags' bits are set by one each)
            tl.store(flags_ptr, tl.load(flags_ptr) | tl.where(count_ok, 0, BAD_NORMALIZER).to(tl.int64))
    token_scale, num_sequences = _normalization(given, total_weight, nonempty, num_rows_f, NORM, COUNT_EMPTY,
                                                NORMALIZER, MAX_LENGTH)

    # ---- persistent over the rows (tokens): statistics, the token's terms, then its dlogits
    pg_sum = 0.0
    kl_sum = 0.0
    ratio_sum = 0.0
    clip_low_sum = 0.0
    clip_high_sum = 0.0
    clip_sum = 0.0
    dual_sum = 0.0
    rho_sum = 0.0
    rho_clip_sum = 0.0
    error_sum = 0.0
    any_max = 0.0
    ratio_max = float("-inf")
    ratio_min = float("-inf")
    rho_max = float("-inf")
    rho_min = float("-inf")
    for row in range(pid, n, programs):
        if LABELS:
            t_col, labelled = _row_label(labels_ptr, 1, row, ignore_index, true_vocab, vocab_start, num_cols,
                                         lmask_ptr, lmask_cols, lmask_s0, lmask_s1, True)
            tl.store(local_target_ptr + row, t_col)
            tl.store(labelled_ptr + row, labelled.to(tl.int8))
        else:
            t_col = tl.load(local_target_ptr + row)
            labelled = (tl.load(labelled_ptr + row) != 0) if HAS_LABELLED else (row >= 0)  # (true, as a tensor)
        # the token's inputs first: their reads in flight while the row's statistics stream
        if SEQUENCE_FIRST:  # labels and statistics are [T, B]
            b = row % num_rows
            t = row // num_rows
        else:
            b = row // row_length
            t = row % row_length
        b64 = tl.full([], 0, tl.int64) + b
        t64 = tl.full([], 0, tl.int64) + t
        _ok, weights, _excluded, old, sampling = _weights_at(
            mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, b64, t64, row >= 0,
            HAS_OLD, HAS_SAMPLING)
        adv = tl.load(adv_ptr + b64 * adv_sb + t64 * adv_st).to(tl.float32)
        reference = 0.0
        if KL != 0:
            reference = tl.load(ref_ptr + b64 * ref_sb + t64 * ref_st).to(tl.float32)
        # the terms read the caller's label (as whole_call_terms does): a position the mask drops
        # keeps its gradient (0 · its terms: NaN where the normalizer poisons the call)
        has_label = tl.load(labels_ptr + row) != ignore_index
        scale = token_scale
        sequence_log_rho = 0.0
        if NORM == 1 or CORRECTION == 2:
            sequence_weight, sequence_log_rho = _sequence_sums(
                mask_ptr, mask_sb, mask_st, old_ptr, old_sb, old_st, samp_ptr, samp_sb, samp_st, b, row_length,
                HAS_OLD, HAS_SAMPLING, CORRECTION, BLOCK_T)
            if NORM == 1:
                scale = (1.0 / _safe(sequence_weight)) / num_sequences

        row_ptr = logits_ptr + (tl.full([], 0, tl.int64) + row) * stride_row  # (64-bit offsets)
        m, s, _, _ = _online_softmax_sums(row_ptr, 0, num_valid_cols, inv_temperature, False, False, STATS_N)
        z_t, _ = _target_logit(row_ptr, t_col, num_valid_cols, inv_temperature)
        log_s = _log(s, PRECISE_LOG)
        tl.store(max_ptr + row, m)
        tl.store(target_out_ptr + row, z_t)
        tl.store(log_sum_exp_ptr + row, log_s)
        tl.store(lse_ptr + row, m + log_s)
        logprob = tl.where(has_label, (z_t - m) - log_s, 0.0)
        grad, pg_term, kl_term, ratio, flag_low, flag_high, flag_dual, rho_raw, rho, error, invalid = _token_terms(
            logprob, has_label, weights, adv, old, sampling, reference, sequence_log_rho, scale,
            LOSS, CLIP_LOW, CLIP_HIGH, HAS_DELTA, DELTA, HAS_DUAL, DUAL_C, CISPO_LOW, CISPO_MAX, SAPO_POS,
            SAPO_NEG, KL, BETA, HAS_KL_IN, KL_IN, HAS_KL_OUT, KL_OUT, BIAS_KL, HAS_OLD, HAS_SAMPLING,
            CORRECTION, TRUNCATE, HAS_IS_LO, IS_LO, HAS_IS_HI, IS_HI)
        tl.store(grad_ptr + row, grad)
        tl.store(neg_grad_ptr + row, -grad)

        # dlogits = d loss / d lp · (one_hot - softmax), through z = logits / T (the dlogits kernel's
        # math with the coefficients -grad of softmax and grad of the target)
        for col0 in range(0, num_cols, DLOGITS_N):
            cols = col0 + tl.arange(0, DLOGITS_N)
            valid = cols < num_valid_cols
            z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
            dz = tl.exp((z - m) - log_s) * -grad
            dz += tl.where(cols == t_col, grad, 0.0)
            dz = tl.where(valid, dz * inv_temperature, 0.0)
            if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates
                dz = round_bf16_by_hand(dz)
            tl.store(row_ptr + cols, dz.to(logits_ptr.dtype.element_ty), mask=cols < num_cols)

        (pg_sum, kl_sum, ratio_sum, clip_low_sum, clip_high_sum, clip_sum, dual_sum, rho_sum, rho_clip_sum,
         error_sum, any_max, ratio_max, ratio_min, rho_max, rho_min) = _add_token_metrics(
            pg_sum, kl_sum, ratio_sum, clip_low_sum, clip_high_sum, clip_sum, dual_sum, rho_sum, rho_clip_sum,
            error_sum, any_max, ratio_max, ratio_min, rho_max, rho_min, row >= 0, pg_term, kl_term, weights, ratio,
            flag_low, flag_high, flag_dual, rho_raw, rho, error, invalid, CORRECTION)

    # ---- this program's partials; the last program to arrive sums them in program order (the same
    # bits whichever program that is) into the metric vector and the loss, and re-arms the count.
    # Written with atomics (at L2: visible across programs; as int32 bits, which every Triton
    # backend exchanges), the count's acq_rel after them; read past L1.
    row_partials = partial_bits_ptr + pid * NUM_PARTIALS
    _publish(row_partials + 0, pg_sum)
    _publish(row_partials + 1, kl_sum)
    _publish(row_partials + 2, ratio_sum)
    _publish(row_partials + 3, clip_low_sum)
    _publish(row_partials + 4, clip_high_sum)
    _publish(row_partials + 5, clip_sum)
    _publish(row_partials + 6, dual_sum)
    _publish(row_partials + 7, rho_sum)
    _publish(row_partials + 8, rho_clip_sum)
    _publish(row_partials + 9, error_sum)
    _publish(row_partials + 10, any_max)
    _publish(row_partials + 11, ratio_max)
    _publish(row_partials + 12, ratio_min)
    _publish(row_partials + 13, rho_max)
    _publish(row_partials + 14, rho_min)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    if arrived == programs - 1:
        tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed")
        # every program's row at once, [BLOCK_P, NUM_PARTIALS] a step: sums of the first
        # NUM_SUMS columns, maxima of the others
        columns = tl.arange(0, NUM_PARTIALS)
        is_max = columns >= NUM_SUMS
        sums = tl.zeros([BLOCK_P, NUM_PARTIALS], tl.float32)
        maxima = tl.full([BLOCK_P, NUM_PARTIALS], float("-inf"), tl.float32)
        for p0 in range(0, programs, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            inside = (p < programs)[:, None] & (columns < USED_PARTIALS)[None, :]
            block = tl.load(partials_ptr + p[:, None] * NUM_PARTIALS + columns[None, :], mask=inside, other=0.0,
                            cache_modifier=".cg")
            sums += tl.where(is_max[None, :], 0.0, block)
            maxima = tl.maximum(maxima, tl.where(inside & is_max[None, :], block, float("-inf")))
        sums = tl.sum(sums, 0)
        maxima = tl.max(maxima, 0)
        _store_metrics(
            metrics_ptr, loss_ptr, poison, _partial(sums, columns, 0), _partial(sums, columns, 1),
            _partial(sums, columns, 2), _partial(maxima, columns, 11), _partial(maxima, columns, 12),
            _partial(sums, columns, 3), _partial(sums, columns, 4), _partial(sums, columns, 5),
            _partial(sums, columns, 6), _partial(sums, columns, 7), _partial(maxima, columns, 13),
            _partial(maxima, columns, 14), _partial(sums, columns, 8), _partial(sums, columns, 9),
            _partial(maxima, columns, 10) > 0, total_weight, num_excluded,
            KL, BETA, HAS_DUAL, CORRECTION, HAS_SAMPLING, AT_DUAL, AT_IS, AT_ERROR, AT_EXCLUDED, HAS_POISON,
            HAS_POISON)


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


# terms_in_launch_ runs where rows x hidden is at most this. On an H200 (bf16, 19008 columns) the one
# launch took 48 / 95 / 178 us of GPU time at 1024 / 2048 / 4096 rows against 42 / 86 / 168 for the
# stats launch, the per-token kernel and the dlogits kernel, and saved ~20 us of host time a call:
# a gain where the host sets a call's time (2048 x 2048 and below: 2-3 % from an idle GPU), a loss
# where the GPU does (2048 x 4096: +0.6 %).
TERMS_IN_LAUNCH_MAX_WORK = 2048 * 2048
# persistent programs per SM of terms_in_launch_ (each reads the call's labels and mask before its rows)
TERMS_PROGRAMS_PER_SM = 4  # (4 / 8 / 16 on an H200: 4 the fastest at 1024-4096 x 19008)
# the programs' partials are reduced in blocks of this many programs (the last program's reduction;
# 512 held registers that every program then lacked: 30-40 % slower on an H200)
PARTIALS_BLOCK = 128


def terms_in_launch_applies(num_rows: int, hidden: int, num_valid_cols: int, row_bytes: int,
                            device: torch.device) -> bool:
    """Where `terms_in_launch_` runs: where the one launch of statistics and dlogits with the label
    checks in it does (triton_backend.stats_dlogits_with_labels_applies: TP = 1, up to a few thousand
    rows, each row one program's), for calls whose GEMMs are short enough that the host sets their
    time (rows x hidden at most TERMS_IN_LAUNCH_MAX_WORK)."""
    return (num_rows * hidden <= TERMS_IN_LAUNCH_MAX_WORK
            and triton_backend.stats_dlogits_with_labels_applies(num_rows, num_valid_cols, row_bytes, device))


def terms_in_launch_(config, logits: Tensor, advantages: Tensor, mask: Tensor, old, reference, sampling, normalizer,
                     labels: Tensor, ignore_index: int, sequence_first: bool, num_valid_cols: int,
                     inv_temperature: float, *, local_target: Optional[Tensor] = None,
                     labelled: Optional[Tensor] = None, poison: Optional[Tensor] = None,
                     label_mask: Optional[Tensor] = None, true_vocab: int = 0, vocab_start: int = 0,
                     flags: Optional[Tensor] = None, check_normalizer: bool = False) -> tuple:
    """A GRPO call of one chunk of every row at TP = 1 in one launch: each row's statistics (the
    one launch of statistics and dlogits', triton_backend.stats_dlogits_: max, z_y, log S, lse), its
    token's terms (`_token_terms`: d loss / d lp and the metrics' numerators), its dlogits in place of
    its logits (d loss / d lp times one_hot - softmax), and the call's metric vector and loss from the
    programs' partial sums. `labels`: the caller's, flat (int64 [rows]), whose kept positions the
    token terms read, as whole_call_terms'. The rows' targets on the shard and labelled flags are
    given (`local_target`, `labelled`: label_targets', with the call's `poison`), or made from
    `labels` with the loss's `label_mask` (label_targets' checks in the launch: `flags`, the labels'
    verdict and poison). `normalizer`, `check_normalizer` as in whole_call_terms.
    -> (max, target, log S, lse, d loss / d lp, its negative, metric vector, the loss with the poison
    in it or None without one, targets on the shard, labelled (bool), counts, scalars): the last
    four label_targets' where the labels are checked here, else None."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, num_cols = logits.shape
    num_rows, row_length = mask.shape
    device = logits.device
    with_labels = local_target is None
    on_policy = old is None or config.force_on_policy_ratio
    normalizer_kind = (0 if normalizer is None else (3 if check_normalizer else 1) if isinstance(normalizer, Tensor)
                       else 2)
    names, options = _options(config, sampling is not None, on_policy, sequence_first, normalizer_kind)
    programs = max(1, min(n, TERMS_PROGRAMS_PER_SM * triton_backend._sm_count(device)))
    # one allocation cut by one split (an allocation apiece is host time at RL row counts); the loss
    # apart (a node's output, not a view)
    *outs, metrics, scalars, partials = torch.empty(
        6 * n + len(names) + 3 + programs * PARTIALS_STRIDE, dtype=torch.float32, device=device).split(
        (n, n, n, n, n, n, len(names), 3, programs * PARTIALS_STRIDE))
    has_poison = with_labels or poison is not None
    loss = torch.empty((), dtype=torch.float32, device=device) if has_poison else None
    arrivals = torch.zeros(1, dtype=torch.int32, device=device)  # (the kernel leaves it at 0 again)
    counts = None
    if with_labels:
        local_target, counts = torch.empty(n + 2, dtype=torch.int64, device=device).split((n, 2))
        labelled = torch.empty(n, dtype=torch.uint8, device=device)
        label_mask_args = triton_backend._label_mask_arguments(label_mask, labels)
    else:
        label_mask_args = (labels, 1, 0, 0)
    block_t = min(next_power_of_2(row_length), TILE_ELEMENTS)
    block_b = max(TILE_ELEMENTS // block_t, 1)
    old = None if on_policy else old
    dummy = outs[0]  # stands for the inputs that are not given (never read)
    optional = [(x, *_strides(x)) if x is not None else (dummy, 0, 0) for x in (old, reference, sampling)]
    _terms_in_launch_kernel[(programs,)](
        logits, logits.stride(0), labels, int(ignore_index), int(true_vocab),
        int(vocab_start), *label_mask_args, local_target,
        labelled.view(torch.uint8) if labelled is not None else local_target,
        _f32(poison) if poison is not None else dummy, counts if with_labels else local_target,
        scalars, flags if flags is not None else local_target,
        advantages, *_strides(advantages), mask, *_strides(mask), *optional[0], *optional[1], *optional[2],
        normalizer if isinstance(normalizer, Tensor) else dummy,
        0.0 if normalizer is None or isinstance(normalizer, Tensor) else float(normalizer),
        *outs, metrics, loss if loss is not None else dummy, partials, partials.view(torch.int32), arrivals,
        num_rows, row_length, float(num_rows), n, num_cols, num_valid_cols, float(inv_temperature), **options,
        LABELS=with_labels, HAS_LABELLED=labelled is not None, HAS_POISON=has_poison, LABEL_BLOCK=triton_backend.LABEL_BLOCK,
        BLOCK_B=block_b, BLOCK_T=block_t, BLOCK_P=min(PARTIALS_BLOCK, next_power_of_2(programs)),
        STATS_N=triton_backend.STATS_BLOCK_N, DLOGITS_N=triton_backend.DLOGITS_BLOCK_N,
        ROUND_BF16=triton_backend._interpreting() and logits.dtype == torch.bfloat16,
        PRECISE_LOG=not triton_backend._interpreting(),
        num_warps=triton_backend.STATS_WARPS,  # (the statistics' reduction order: the stats kernel's)
    )
    return (*outs, metrics, loss, local_target if with_labels else None,
            labelled.view(torch.bool) if with_labels else None, counts, scalars if with_labels else None)
