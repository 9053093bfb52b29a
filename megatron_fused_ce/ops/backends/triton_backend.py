"""Per-chunk softmax math on one vocab shard, in Triton: the GPU backend.

Same functions, arguments and results as torch_backend.py (read its module docstring for the
math), and two capabilities of its own (backends/__init__.py); tests/test_triton_backend.py checks
them against the torch backend, on CPU under TRITON_INTERPRET=1.

- `shard_stats`: one read of the [n, V_local] chunk. Each program takes one row and one contiguous
  range ("split") of its valid columns and walks it in blocks of BLOCK_N columns, keeping an online
  max / sum-exp (one exp per element: the block's exps are taken against the running max, the old
  sum is rescaled once per block), plus sum z and sum exp(z - m) (z - m) when asked (the entropy
  term relative to the running max, shifted with it: exp(m - m') (A + (m - m') S)). When there are few
  rows (n=256 against V_local=128k) the columns are split over several programs so that the GPU
  fills up, and a tiny second kernel merges the per-split partials of each row.
- `scale_cast`: dtype(fp32 dW * upstream gradient) in one pass (6 bytes/element instead of 14 for
  a multiply followed by a cast).
- `scale_`: dX, or a dW made in the weight dtype, times the upstream gradient g in place; each
  program reads g and returns at once when g == 1, so the host need not read g (no sync) and
  Megatron's g == 1 costs no pass.
- `exp_tile_` (lean mode, lean.py): two reads and one write of a tile
  of logits, in place: one program per row takes the row's max, moves the reference when that max
  is too far above it (rescaling the row's sums and its row of the accumulator), overwrites the row
  with exp(z - ref_max) and accumulates the row's partials.
- `gemm_stats` (triton_gemm_stats.py): the logits GEMM with the statistics in its epilogue,
  for forward passes that need no logits afterwards.
- `gemm_dlogits` (triton_gemm_dlogits.py): the logits GEMM with `shard_dlogits_`'s math in its
  epilogue, where the softmax offsets are known before the GEMM (backward recompute, lean sweeps).
- the sampler filters' kernels: sampling_triton.py.
- `stats_dlogits_` (TP = 1, the coefficients known before the statistics: cross-entropy, log-probs):
  `shard_stats`, `merged_tail` and `shard_dlogits_` in one launch, the same bits (design.md §10.6).
- `shard_dlogits_`: one read and one write of the chunk, in place. A 2-D grid of (row, column
  block) programs; each computes dL/dlogits = inv_T * (exp(z - lse) (c_p + c_pz (z - lse)) + c_u
  + c_t [k == y]) in fp32 and stores it in the chunk's dtype; padding columns get 0.

Math is fp32 whatever the chunk dtype (bf16/fp16/fp32); z = fp32(logits) * inv_temperature exactly
as in the torch backend, so the target logit is bit-identical. Row offsets are 64-bit (a chunk may
hold more than 2^31 elements).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from ..deferred_errors import LABELS_OUT_OF_RANGE
from . import (Backend, FusedGemm, LabelLogprob, LabelsInLaunch, ShardStats, StatsDlogits, torch_backend,
               triton_gemm_dlogits, triton_gemm_stats)
from .triton_common import (cached_launch, cdiv, f32 as _f32, interpreting as _interpreting, next_power_of_2,
                            sm_count as _sm_count)
from .replay_triton import fingerprint_terms
from .triton_gemm_stats import round_bf16_by_hand
from .triton_math import precise_log as _log, store_labelled_logprob as _store_labelled_logprob
from .triton_math import store_merged_tail

# Launch settings (measured: docs/design.md §10.6). Module-level so that
# tools/benchmark.py can try a variant; not a public API.
STATS_BLOCK_N = 4096  # columns per step of the online softmax
STATS_WARPS = 4  # (8 read 10-15 % slower on an H200: design.md §10.6)
DLOGITS_BLOCK_N = 2048  # columns per program of the dlogits kernel
DLOGITS_WARPS = 8
# split columns until the stats grid has this many programs per SM (4, not 8: from 4 x SMs rows a
# row is one program's, and cross-entropy and log-probs take their one launch: design.md §10.6)
PROGRAMS_PER_SM = 4
MERGE_BLOCK_R = 64
GEMM_DLOGITS = True  # dlogits from the logits GEMM's epilogue where it runs (off: GEMM + dlogits kernel)
STATS_DLOGITS = True  # stats_dlogits_ where it applies (off: the stats and dlogits kernels apart)
STATS_DLOGITS_PROGRAMS_PER_SM = 16  # its persistent programs
STATS_DLOGITS_MAX_ROW_BYTES = 48 * 1024  # where it runs (stats_dlogits_applies)
STATS_DLOGITS_MAX_CHUNK_BYTES = 192 * 1024 * 1024


def gemm_dlogits_supported(h: Tensor, weight: Tensor) -> bool:
    """Whether `gemm_dlogits` (triton_gemm_dlogits.py) runs for these inputs."""
    return GEMM_DLOGITS and triton_gemm_dlogits.supported(h, weight)


@triton.jit
def _online_softmax_sums(row_ptr, start, end, inv_temperature, WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """(max m, sum exp(z - m), sum z, sum exp(z - m) (z - m)) of z = logits[start:end] * inv_T, in
    blocks of BLOCK_N columns with an online max (the stats kernels' one definition: their bits)."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    s_logits = tl.zeros([], tl.float32)
    s_exp_shifted = tl.zeros([], tl.float32)  # sum exp(z - m) (z - m), relative to the running m
    for col0 in range(start, end, BLOCK_N):
        cols = col0 + tl.arange(0, BLOCK_N)
        valid = cols < end
        z = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))  # finite: each block holds >= 1 valid column
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 at masked columns
        if WANT_ENTROPY:
            # move the old sum from m to m_new first (m = -inf before the first block: nothing to move)
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)
            block = tl.sum(e * tl.where(valid, z - m_new, 0.0), axis=0)
            s_exp_shifted = alpha * (s_exp_shifted + shift * s) + block
        s = s * alpha + tl.sum(e, axis=0)
        if WANT_SUM:
            s_logits += tl.sum(tl.where(valid, z, 0.0), axis=0)  # -inf -> 0 at masked columns
        m = m_new
    return m, s, s_logits, s_exp_shifted


@triton.jit
def _target_logit(row_ptr, t, num_valid_cols, inv_temperature):
    """(z_t, whether column t is a valid column of the row): z_t = 0 where it is not."""
    in_block = (t >= 0) & (t < num_valid_cols)
    return tl.where(in_block, tl.load(row_ptr + tl.where(in_block, t, 0)).to(tl.float32) * inv_temperature, 0.0), in_block


@cached_launch
@triton.jit
def _stats_kernel(
    logits_ptr, stride_row, target_ptr, col_start,
    max_ptr, sum_exp_ptr, target_out_ptr, sum_logits_ptr, sum_exp_shifted_ptr,
    num_valid_cols, cols_per_split, num_splits, inv_temperature,
    log_sum_exp_ptr, lse_ptr, logprob_ptr, poison_ptr,
    WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr,
    FINISH: tl.constexpr = False, PRECISE_LOG: tl.constexpr = False,
):
    # FINISH (shard_logprob; one split): the row's log S, lse and log-prob as well
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, num_valid_cols)  # every split holds >= 1 column

    m, s, s_logits, s_exp_shifted = _online_softmax_sums(row_ptr, start, end, inv_temperature, WANT_SUM,
                                                         WANT_ENTROPY, BLOCK_N)
    out = row.to(tl.int64) * num_splits + split
    tl.store(max_ptr + out, m)
    tl.store(sum_exp_ptr + out, s)
    if WANT_SUM:
        tl.store(sum_logits_ptr + out, s_logits)
    if WANT_ENTROPY:
        tl.store(sum_exp_shifted_ptr + out, s_exp_shifted)
    if split == 0:
        t = tl.load(target_ptr + row) - col_start  # the label's column in this block
        z_t, in_block = _target_logit(row_ptr, t, num_valid_cols, inv_temperature)
        tl.store(target_out_ptr + row, z_t)
        if FINISH:
            _finish_row(row, m, s, z_t, in_block, log_sum_exp_ptr, lse_ptr, logprob_ptr, tl.load(poison_ptr),
                        PRECISE_LOG)


@triton.jit
def _finish_row(rows, m, s, z_t, labelled, log_sum_exp_ptr, lse_ptr, logprob_ptr, poison, PRECISE_LOG: tl.constexpr,
                mask=None):
    """torch_backend.finish_logprob of rows whose merged max m, sum exp(z - m) s and target z_t are
    known; `poison` the call's (0, or NaN where its device checks failed)."""
    log_s = _log(s, PRECISE_LOG)
    tl.store(log_sum_exp_ptr + rows, log_s, mask=mask)
    tl.store(lse_ptr + rows, m + log_s, mask=mask)
    logprob = tl.where(labelled, (z_t - m) - log_s, 0.0) + poison
    tl.store(logprob_ptr + rows, logprob, mask=mask)


@cached_launch
@triton.jit
def _merge_kernel(
    pmax_ptr, psum_ptr, psum_logits_ptr, psum_exp_shifted_ptr,
    max_ptr, sum_exp_ptr, sum_logits_ptr, sum_exp_shifted_ptr,
    n, num_splits,
    target_ptr, label_ptr, num_valid_cols, log_sum_exp_ptr, lse_ptr, logprob_ptr, poison_ptr,
    WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    FINISH: tl.constexpr = False, PRECISE_LOG: tl.constexpr = False,
):
    # FINISH (shard_logprob): each row's log S, lse and log-prob from the merged max and sum
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    splits = tl.arange(0, BLOCK_S)
    row_ok = rows < n
    mask = row_ok[:, None] & (splits[None, :] < num_splits)
    offs = rows.to(tl.int64)[:, None] * num_splits + splits[None, :]
    pm = tl.load(pmax_ptr + offs, mask=mask, other=float("-inf"))
    m = tl.max(pm, axis=1)
    scale = tl.where(mask, tl.exp(pm - tl.where(row_ok, m, 0.0)[:, None]), 0.0)
    tl.store(max_ptr + rows, m, mask=row_ok)
    ps = tl.load(psum_ptr + offs, mask=mask, other=0.0)
    s = tl.sum(ps * scale, axis=1)
    tl.store(sum_exp_ptr + rows, s, mask=row_ok)
    if FINISH:
        t = tl.load(label_ptr + rows, mask=row_ok, other=-1)
        z_t = tl.load(target_ptr + rows, mask=row_ok, other=0.0)
        _finish_row(rows, m, tl.where(row_ok, s, 1.0), z_t, (t >= 0) & (t < num_valid_cols), log_sum_exp_ptr,
                    lse_ptr, logprob_ptr, tl.load(poison_ptr), PRECISE_LOG, mask=row_ok)
    if WANT_SUM:
        pl = tl.load(psum_logits_ptr + offs, mask=mask, other=0.0)
        tl.store(sum_logits_ptr + rows, tl.sum(pl, axis=1), mask=row_ok)
    if WANT_ENTROPY:  # each split's sum moved from its max to the row max
        pe = tl.load(psum_exp_shifted_ptr + offs, mask=mask, other=0.0)
        shift = tl.where(mask, pm - tl.where(row_ok, m, 0.0)[:, None], 0.0)
        tl.store(sum_exp_shifted_ptr + rows, tl.sum((pe + shift * ps) * scale, axis=1), mask=row_ok)


@cached_launch
@triton.jit
def _dlogits_kernel(
    logits_ptr, stride_row, target_ptr, col_start, lse_ptr,
    coef_p_ptr, coef_pz_ptr, coef_target_ptr, coef_uniform_ptr, log_sum_exp_ptr,
    num_cols, num_valid_cols, inv_temperature,
    HAS_PZ: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_UNIFORM: tl.constexpr, HAS_LOG_SUM_EXP: tl.constexpr,
    BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    valid = cols < num_valid_cols
    z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
    log_p = z - tl.load(lse_ptr + row)
    if HAS_LOG_SUM_EXP:  # lse_ptr holds the row max: log p = (z - M) - log S
        log_p = log_p - tl.load(log_sum_exp_ptr + row)
    coef = tl.load(coef_p_ptr + row)
    if HAS_PZ:
        coef = coef + tl.load(coef_pz_ptr + row) * log_p
    grad = tl.exp(log_p) * coef
    if HAS_UNIFORM:
        grad += tl.load(coef_uniform_ptr + row)
    if HAS_TARGET:
        t = tl.load(target_ptr + row) - col_start  # outside [0, num_valid_cols): matches no column
        grad += tl.where(cols == t, tl.load(coef_target_ptr + row), 0.0)
    grad = tl.where(valid, grad * inv_temperature, 0.0)
    if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates
        grad = round_bf16_by_hand(grad)
    tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < num_cols)




@triton.jit
def _stats_dlogits_row(logits_ptr, stride_row, row, t, labelled, scale, poison, max_ptr, target_out_ptr,
                       log_sum_exp_ptr, lse_ptr, logprob_ptr, num_cols, num_valid_cols, inv_temperature,
                       LOGPROB: tl.constexpr, STATS_N: tl.constexpr, DLOGITS_N: tl.constexpr,
                       ROUND_BF16: tl.constexpr, PRECISE_LOG: tl.constexpr):
    """One row of stats_dlogits_: its statistics' loop (the stats kernel's, and merged_tail's log:
    the same bits; the log-probs shard_logprob's), then again its logits, into dlogits (the
    dlogits kernel's math with the row's coefficients). `t`: its target on the shard (-1: none);
    `labelled`: whether its label is kept; `poison`: the call's (LOGPROB)."""
    row_ptr = logits_ptr + (tl.full([], 0, tl.int64) + row) * stride_row  # (64-bit offsets)
    m, s, _, _ = _online_softmax_sums(row_ptr, 0, num_valid_cols, inv_temperature, False, False, STATS_N)
    z_t, _ = _target_logit(row_ptr, t, num_valid_cols, inv_temperature)
    tl.store(max_ptr + row, m)
    tl.store(target_out_ptr + row, z_t)
    log_s = _log(s, PRECISE_LOG)
    if LOGPROB:  # d log p_y / d z = one_hot - softmax (every row: the backward masks g)
        _finish_row(row, m, s, z_t, labelled, log_sum_exp_ptr, lse_ptr, logprob_ptr, poison, PRECISE_LOG)
        coef_p = -1.0
        coef_t = 1.0
    else:  # c (softmax - one_hot), c = 0 in the rows of ignored labels
        tl.store(log_sum_exp_ptr + row, log_s)
        tl.store(lse_ptr + row, m + log_s)
        coef_p = scale * labelled.to(tl.float32)
        coef_t = -coef_p
    for col0 in range(0, num_cols, DLOGITS_N):
        cols = col0 + tl.arange(0, DLOGITS_N)
        valid = cols < num_valid_cols
        z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
        grad = tl.exp((z - m) - log_s) * coef_p
        grad += tl.where(cols == t, coef_t, 0.0)
        grad = tl.where(valid, grad * inv_temperature, 0.0)
        if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates
            grad = round_bf16_by_hand(grad)
        tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < num_cols)


@cached_launch
@triton.jit
def _stats_dlogits_kernel(
    logits_ptr, stride_row, target_ptr, labelled_ptr, scale_ptr, scale, poison_ptr,
    max_ptr, target_out_ptr, log_sum_exp_ptr, lse_ptr, logprob_ptr,
    n, num_cols, num_valid_cols, inv_temperature,
    LOGPROB: tl.constexpr, HAS_LABELLED: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr,
    STATS_N: tl.constexpr, DLOGITS_N: tl.constexpr, ROUND_BF16: tl.constexpr, PRECISE_LOG: tl.constexpr,
):
    # persistent over rows, each row read twice (_stats_dlogits_row)
    if SCALE_IN_MEMORY:
        scale = tl.load(scale_ptr)
    poison = 0.0
    if LOGPROB:
        poison = tl.load(poison_ptr)
    for row in range(tl.program_id(0), n, tl.num_programs(0)):
        labelled = (tl.load(labelled_ptr + row) != 0) if HAS_LABELLED else (row >= 0)  # (true, as a tensor)
        _stats_dlogits_row(logits_ptr, stride_row, row, tl.load(target_ptr + row), labelled, scale, poison, max_ptr,
                           target_out_ptr, log_sum_exp_ptr, lse_ptr, logprob_ptr, num_cols, num_valid_cols,
                           inv_temperature, LOGPROB, STATS_N, DLOGITS_N, ROUND_BF16, PRECISE_LOG)


def shard_stats(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                want_sum_logits: bool = False, want_entropy: bool = False, *, col_start: int = 0) -> ShardStats:
    """torch_backend.shard_stats (same arguments, same results) in Triton."""
    n = logits.shape[0]
    if num_valid_cols == 0 or n == 0:  # a shard made only of padding columns, or no rows
        return ShardStats.empty(n, logits.device, want_sum_logits, want_entropy)
    return _launch_stats(logits, local_target, num_valid_cols, inv_temperature, want_sum_logits, want_entropy,
                         col_start)


def shard_logprob(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                  poison: Tensor) -> tuple:
    """torch_backend.shard_logprob in the statistics' launches: the last of them (the stats kernel
    over whole rows, else the merge of the splits) finishes each row."""
    n = logits.shape[0]
    if num_valid_cols == 0 or n == 0:
        return torch_backend.finish_logprob(ShardStats.empty(n, logits.device), local_target, num_valid_cols,
                                            poison)
    f32 = dict(dtype=torch.float32, device=logits.device)
    finished = (torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32))  # log S, lse, log p_y
    stats = _launch_stats(logits, local_target, num_valid_cols, inv_temperature, False, False, 0,
                          finish=finished + (_f32(poison),))
    log_sum_exp, lse, logprob = finished
    return logprob, stats.max, log_sum_exp, stats.target, lse


# Labels in the statistics' launch. A chunk of at most LABELS_IN_LAUNCH_MAX_ROWS rows at TP = 1 (the
# passes of RL micro-batches, where a call's time is its host's) takes label_targets' work from the
# launch that reads its logits instead of a launch of its own: forward-only log-probs
# (`label_logprob`), cross-entropy's and log-probs' statistics with their dlogits
# (`stats_dlogits_with_labels_`). Every program reads every label for the call's totals (the
# verdict: bad labels poison every row; the labelled count: a mean's 1 / count), so that no
# program waits for another: bytes that grow with rows x programs, hence the bound (above it the
# GPU sets the call's time, and a launch more costs nothing there).
LABELS_IN_LAUNCH_MAX_ROWS = 4096
LABEL_BLOCK = 1024  # labels per step of the totals' read
# label_logprob's persistent programs: on an H200 (bf16, 1024-4096 rows x 19008-64128 columns), 16
# per SM as fast as a program per row (whose reads of the labels would grow with rows squared); 4
# per SM 10-35 % slower
LABEL_LOGPROB_PROGRAMS_PER_SM = 16


@triton.jit
def _label_target(label, ignore_index, true_vocab, vocab_start, v_local):
    """What a label means (label_targets' definition, for a label or a block of them): (its target
    on this shard, -1 where none; whether it is kept; whether it is kept and outside [0,
    true_vocab): a bad label)."""
    labelled = label != ignore_index
    in_range = (label >= 0) & (label < true_vocab)
    local = label - vocab_start
    on_shard = labelled & in_range & (local >= 0) & (local < v_local)
    return tl.where(on_shard, local, -1), labelled, labelled & ~in_range


@triton.jit
def _masked_labels(labels_ptr, labels_stride, positions, inside, ignore_index, mask_ptr, mask_cols, mask_stride0,
                   mask_stride1, HAS_MASK: tl.constexpr):
    """The labels at `positions` (ignore_index outside), ignore_index where the label mask is 0
    (label_targets' `label_mask`, read in the labels' layout)."""
    label = tl.load(labels_ptr + positions * labels_stride, mask=inside, other=ignore_index)
    if HAS_MASK:
        at = (positions // mask_cols) * mask_stride0 + (positions % mask_cols) * mask_stride1
        label = tl.where(tl.load(mask_ptr + at, mask=inside, other=1) != 0, label, ignore_index)
    return label


@triton.jit
def _label_totals(labels_ptr, labels_stride, n, ignore_index, true_vocab, mask_ptr, mask_cols, mask_stride0,
                  mask_stride1, HAS_MASK: tl.constexpr, LABEL_BLOCK: tl.constexpr):
    """(labelled rows, whether a labelled row's label lies outside [0, true_vocab)) of the call:
    label_targets' count and verdict (the same integer sums)."""
    labelled_rows = tl.zeros([LABEL_BLOCK], tl.int64)
    bad_rows = tl.zeros([LABEL_BLOCK], tl.int32)
    for start in range(0, n, LABEL_BLOCK):
        offsets = start + tl.arange(0, LABEL_BLOCK)
        label = _masked_labels(labels_ptr, labels_stride, offsets.to(tl.int64), offsets < n, ignore_index, mask_ptr,
                               mask_cols, mask_stride0, mask_stride1, HAS_MASK)
        _target, labelled, bad_block = _label_target(label, ignore_index, true_vocab, 0, 1)  # (no shard's target)
        labelled_rows += labelled.to(tl.int64)
        bad_rows = tl.maximum(bad_rows, bad_block.to(tl.int32))
    return tl.sum(labelled_rows, axis=0), tl.max(bad_rows, axis=0)


@triton.jit
def _row_label(labels_ptr, labels_stride, row, ignore_index, true_vocab, vocab_start, v_local, mask_ptr, mask_cols,
               mask_stride0, mask_stride1, HAS_MASK: tl.constexpr):
    """(the row's target on this shard, -1 where none; whether its label is kept): label_targets'."""
    label = _masked_labels(labels_ptr, labels_stride, tl.full([], 0, tl.int64) + row, row >= 0, ignore_index,
                           mask_ptr, mask_cols, mask_stride0, mask_stride1, HAS_MASK)
    target, labelled, _bad = _label_target(label, ignore_index, true_vocab, vocab_start, v_local)
    return target, labelled


@triton.jit
def _store_totals(counts_ptr, scalars_ptr, flags_ptr, count, bad, poison, inverse, BAD_LABELS: tl.constexpr):
    """label_targets' counts (labelled rows, verdict) and scalars (poison, 1 / count, its negative),
    and the verdict's flag."""
    tl.store(counts_ptr, count)
    tl.store(counts_ptr + 1, bad.to(tl.int64))
    tl.store(scalars_ptr, poison)
    tl.store(scalars_ptr + 1, inverse)
    tl.store(scalars_ptr + 2, -inverse)
    tl.store(flags_ptr, tl.load(flags_ptr) | (bad.to(tl.int64) * BAD_LABELS))


@cached_launch
@triton.jit
def _label_logprob_kernel(logits_ptr, stride_row, labels_ptr, labels_stride, logprob_ptr, flags_ptr, n, ignore_index,
                          true_vocab, vocab_start, v_local, num_valid_cols, inv_temperature,
                          max_ptr, target_out_ptr, log_sum_exp_ptr, lse_ptr, local_target_ptr, labelled_ptr,
                          counts_ptr, scalars_ptr, mask_ptr, mask_cols, mask_stride0, mask_stride1,
                          BLOCK_N: tl.constexpr, LABEL_BLOCK: tl.constexpr, PRECISE_LOG: tl.constexpr,
                          BAD_LABELS: tl.constexpr, EVERY_OUTPUT: tl.constexpr, HAS_MASK: tl.constexpr):
    # (no `_` before the loop: Triton would carry it through the loop with the count's type)
    count, bad = _label_totals(labels_ptr, labels_stride, n, ignore_index, true_vocab, mask_ptr, mask_cols,
                               mask_stride0, mask_stride1, HAS_MASK, LABEL_BLOCK)
    poison = tl.where(bad != 0, float("nan"), 0.0)  # (label_targets' poison: x + 0 is x)
    if tl.program_id(0) == 0:
        if EVERY_OUTPUT:
            _store_totals(counts_ptr, scalars_ptr, flags_ptr, count, bad, poison,
                          1.0 / tl.maximum(count, 1).to(tl.float32), BAD_LABELS)
        else:
            tl.store(flags_ptr, tl.load(flags_ptr) | (bad.to(tl.int64) * BAD_LABELS))
    # persistent over rows; each row the stats kernel's (one split) and _finish_row's log-prob
    for row in range(tl.program_id(0), n, tl.num_programs(0)):
        row_ptr = logits_ptr + (tl.full([], 0, tl.int64) + row) * stride_row  # (64-bit offsets)
        t, labelled = _row_label(labels_ptr, labels_stride, row, ignore_index, true_vocab, vocab_start, v_local,
                                 mask_ptr, mask_cols, mask_stride0, mask_stride1, HAS_MASK)
        m, s, _, _ = _online_softmax_sums(row_ptr, 0, num_valid_cols, inv_temperature, False, False, BLOCK_N)
        z_t, in_block = _target_logit(row_ptr, t, num_valid_cols, inv_temperature)
        if EVERY_OUTPUT:  # (shard_logprob's, and label_targets' per row)
            tl.store(max_ptr + row, m)
            tl.store(target_out_ptr + row, z_t)
            tl.store(local_target_ptr + row, t)
            tl.store(labelled_ptr + row, labelled.to(tl.int8))
            _finish_row(row, m, s, z_t, in_block, log_sum_exp_ptr, lse_ptr, logprob_ptr, poison, PRECISE_LOG)
        else:
            log_s = _log(s, PRECISE_LOG)
            tl.store(logprob_ptr + row, tl.where(in_block, (z_t - m) - log_s, 0.0) + poison)


@cached_launch
@triton.jit
def _stats_dlogits_labels_kernel(
    logits_ptr, stride_row, labels_ptr, labels_stride, scale, max_ptr, target_out_ptr, log_sum_exp_ptr, lse_ptr,
    logprob_ptr, local_target_ptr, labelled_ptr, counts_ptr, scalars_ptr, flags_ptr,
    n, ignore_index, true_vocab, vocab_start, num_cols, num_valid_cols, inv_temperature,
    LOGPROB: tl.constexpr, MEAN: tl.constexpr, LABEL_BLOCK: tl.constexpr, BAD_LABELS: tl.constexpr,
    STATS_N: tl.constexpr, DLOGITS_N: tl.constexpr, ROUND_BF16: tl.constexpr, PRECISE_LOG: tl.constexpr,
):
    # the call's totals, label_targets' (the same values in every program), written by the first
    count, bad = _label_totals(labels_ptr, labels_stride, n, ignore_index, true_vocab, labels_ptr, 1, 0, 0, False,
                               LABEL_BLOCK)
    poison = tl.where(bad != 0, float("nan"), 0.0)
    inverse = 1.0 / tl.maximum(count, 1).to(tl.float32)
    if tl.program_id(0) == 0:
        _store_totals(counts_ptr, scalars_ptr, flags_ptr, count, bad, poison, inverse, BAD_LABELS)
    if MEAN:  # cross-entropy's mean: c = 1 / labelled rows
        scale = inverse
    for row in range(tl.program_id(0), n, tl.num_programs(0)):
        t, labelled = _row_label(labels_ptr, labels_stride, row, ignore_index, true_vocab, vocab_start, num_cols,
                                 labels_ptr, 1, 0, 0, False)
        tl.store(local_target_ptr + row, t)
        tl.store(labelled_ptr + row, labelled.to(tl.int8))
        _stats_dlogits_row(logits_ptr, stride_row, row, t, labelled, scale, poison, max_ptr, target_out_ptr,
                           log_sum_exp_ptr, lse_ptr, logprob_ptr, num_cols, num_valid_cols, inv_temperature, LOGPROB,
                           STATS_N, DLOGITS_N, ROUND_BF16, PRECISE_LOG)


def label_logprob_applies(num_rows: int, num_valid_cols: int, device: torch.device) -> bool:
    """Where `label_logprob` runs: at most LABELS_IN_LAUNCH_MAX_ROWS rows, each of which the stats
    kernel would take whole (one split: as many rows as PROGRAMS_PER_SM fills, or rows of one
    block), so that its log-probs are shard_logprob's."""
    return (0 < num_rows <= LABELS_IN_LAUNCH_MAX_ROWS and num_valid_cols > 0
            and (num_rows >= PROGRAMS_PER_SM * _sm_count(device) or num_valid_cols <= STATS_BLOCK_N))


def label_logprob(logits: Tensor, labels: Tensor, ignore_index: int, true_vocab: int, vocab_start: int,
                  num_valid_cols: int, inv_temperature: float, flags: Tensor) -> Tensor:
    """backends.LabelLogprob's run: the log-probs (fp32 [rows]) of `labels` (int64, the raw labels
    of the chunk's rows) over a whole-vocab chunk of `logits`, where label_logprob_applies."""
    return _launch_label_logprob(logits, labels, ignore_index, true_vocab, vocab_start, num_valid_cols,
                                 inv_temperature, flags, None, False)


def label_statistics(logits: Tensor, labels: Tensor, ignore_index: int, true_vocab: int, vocab_start: int,
                     num_valid_cols: int, inv_temperature: float, flags: Tensor,
                     label_mask: Optional[Tensor] = None) -> tuple:
    """backends.LabelLogprob's with_statistics: label_targets (with `label_mask`, without a rank
    check) then shard_logprob with the labels' poison, in the same launch -> (max, target, log S,
    lse, log-probs, targets on the shard, labelled (bool), counts, scalars), where
    label_logprob_applies."""
    return _launch_label_logprob(logits, labels, ignore_index, true_vocab, vocab_start, num_valid_cols,
                                 inv_temperature, flags, label_mask, True)


def _label_mask_arguments(label_mask: Optional[Tensor], stand_in: Tensor) -> tuple:
    """The label kernels' (mask, columns, stride 0, stride 1) of a label mask, read in the labels'
    layout whatever its strides (a bool mask as its bytes); `stand_in` and a layout no kernel reads
    where there is none."""
    if label_mask is None:
        return stand_in, 1, 0, 0
    mask = label_mask if label_mask.dim() == 2 else label_mask.reshape(1, -1)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask, mask.shape[1], mask.stride(0), mask.stride(1)


def _launch_label_logprob(logits, labels, ignore_index, true_vocab, vocab_start, num_valid_cols, inv_temperature,
                          flags, label_mask, every_output: bool):
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n = logits.shape[0]
    device = logits.device
    if every_output:  # (one split a buffer, as stats_dlogits_with_labels_ cuts its own)
        *outs, scalars = torch.empty(5 * n + 3, dtype=torch.float32, device=device).split((n, n, n, n, n, 3))
        local_target, counts = torch.empty(n + 2, dtype=torch.int64, device=device).split((n, 2))
        labelled = torch.empty(n, dtype=torch.uint8, device=device)
    else:  # (the log-probs only: the other pointers unused)
        logprob = torch.empty(n, dtype=torch.float32, device=device)
        outs, scalars, local_target, counts, labelled = (logprob,) * 5, logprob, labels, labels, labels
    _label_logprob_kernel[(min(n, LABEL_LOGPROB_PROGRAMS_PER_SM * _sm_count(device)),)](
        logits, logits.stride(0), labels, labels.stride(0), outs[4], flags, n, int(ignore_index), int(true_vocab),
        int(vocab_start), logits.shape[1], num_valid_cols, float(inv_temperature), *outs[:4], local_target,
        labelled, counts, scalars,
        *_label_mask_arguments(label_mask, labels),
        BLOCK_N=STATS_BLOCK_N, LABEL_BLOCK=LABEL_BLOCK, PRECISE_LOG=not _interpreting(),
        BAD_LABELS=LABELS_OUT_OF_RANGE, EVERY_OUTPUT=every_output, HAS_MASK=label_mask is not None,
        num_warps=STATS_WARPS,  # (the statistics' reduction order: the stats kernel's)
    )
    if not every_output:
        return outs[4]
    return (*outs, local_target, labelled.view(torch.bool), counts, scalars)


def _launch_stats(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                  want_sum_logits: bool, want_entropy: bool, col_start: int,
                  finish: Optional[tuple] = None) -> ShardStats:
    """The stats kernel (and the merge of its splits); `finish`: (log S, lse, log p_y, poison) of
    shard_logprob, written by the last launch."""
    f32 = dict(dtype=torch.float32, device=logits.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    local_target = local_target.contiguous()
    n = logits.shape[0]

    block_n = STATS_BLOCK_N
    col_blocks = cdiv(num_valid_cols, block_n)
    wanted_splits = cdiv(PROGRAMS_PER_SM * _sm_count(logits.device), n)
    splits = max(1, min(col_blocks, wanted_splits))
    cols_per_split = cdiv(col_blocks, splits) * block_n
    splits = cdiv(num_valid_cols, cols_per_split)  # no empty split

    target = torch.empty(n, **f32)
    if splits == 1:
        part_shape = (n,)
    else:
        part_shape = (n, splits)
    pmax, psum = torch.empty(part_shape, **f32), torch.empty(part_shape, **f32)
    psum_logits = torch.empty(part_shape, **f32) if want_sum_logits else pmax  # dummy when unused
    psum_exp_shifted = torch.empty(part_shape, **f32) if want_entropy else pmax
    finish_here = finish is not None and splits == 1
    finish_args = finish if finish is not None else (pmax,) * 4  # (dummies when unused)
    _stats_kernel[(n, splits)](
        logits, logits.stride(0), local_target, col_start,
        pmax, psum, target, psum_logits, psum_exp_shifted,
        num_valid_cols, cols_per_split, splits, float(inv_temperature),
        *finish_args,
        WANT_SUM=want_sum_logits, WANT_ENTROPY=want_entropy, BLOCK_N=block_n,
        FINISH=finish_here, PRECISE_LOG=finish_here and not _interpreting(),
        num_warps=STATS_WARPS,
    )
    if splits == 1:
        row_max, sum_exp, sum_logits, sum_exp_shifted = pmax, psum, psum_logits, psum_exp_shifted
    else:
        row_max, sum_exp = torch.empty(n, **f32), torch.empty(n, **f32)
        sum_logits = torch.empty(n, **f32) if want_sum_logits else row_max
        sum_exp_shifted = torch.empty(n, **f32) if want_entropy else row_max
        _merge_kernel[(cdiv(n, MERGE_BLOCK_R),)](
            pmax, psum, psum_logits, psum_exp_shifted,
            row_max, sum_exp, sum_logits, sum_exp_shifted,
            n, splits,
            target, local_target, num_valid_cols, *finish_args,
            WANT_SUM=want_sum_logits, WANT_ENTROPY=want_entropy,
            BLOCK_R=MERGE_BLOCK_R, BLOCK_S=next_power_of_2(splits),
            FINISH=finish is not None, PRECISE_LOG=finish is not None and not _interpreting(), num_warps=4,
        )
    return ShardStats(
        max=row_max,
        sum_exp=sum_exp,
        target=target,
        sum_logits=sum_logits if want_sum_logits else None,
        sum_exp_shifted=sum_exp_shifted if want_entropy else None,
    )


def shard_dlogits_(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                   lse: Tensor, coef_p: Tensor, coef_pz: Optional[Tensor], coef_target: Optional[Tensor],
                   coef_uniform: Optional[Tensor], log_sum_exp: Optional[Tensor] = None, *,
                   col_start: int = 0) -> Tensor:
    """Overwrite `logits` with dL/d(logits) (chain rule through z = logits / T included);
    `log_sum_exp`, `col_start` as in torch_backend.shard_dlogits_."""
    n, num_cols = logits.shape
    if n == 0 or num_cols == 0:
        return logits
    if num_valid_cols == 0:
        return logits.zero_()
    if logits.stride(1) != 1:  # not produced by torch.mm: work on a contiguous copy
        return logits.copy_(shard_dlogits_(logits.contiguous(), local_target, num_valid_cols,
                                           inv_temperature, lse, coef_p, coef_pz, coef_target,
                                           coef_uniform, log_sum_exp, col_start=col_start))
    coef_p = _f32(coef_p)
    pz, tgt, uni, lse_rest = (None if c is None else _f32(c)
                              for c in (coef_pz, coef_target, coef_uniform, log_sum_exp))
    block_n = DLOGITS_BLOCK_N
    _dlogits_kernel[(n, cdiv(num_cols, block_n))](
        logits, logits.stride(0), local_target.contiguous(), col_start, _f32(lse),
        coef_p, coef_p if pz is None else pz, coef_p if tgt is None else tgt,
        coef_p if uni is None else uni, coef_p if lse_rest is None else lse_rest,
        num_cols, num_valid_cols, float(inv_temperature),
        HAS_PZ=pz is not None, HAS_TARGET=tgt is not None, HAS_UNIFORM=uni is not None,
        HAS_LOG_SUM_EXP=lse_rest is not None, BLOCK_N=block_n, ROUND_BF16=_interpreting() and logits.dtype == torch.bfloat16,
        num_warps=DLOGITS_WARPS,
    )
    return logits


def stats_dlogits_applies(num_rows: int, num_valid_cols: int, row_bytes: int, device: torch.device) -> bool:
    """Where `stats_dlogits_` runs: chunks the stats kernel takes in one split per row (every row
    by one program: the same bits as shard_stats'), i.e. as many rows as PROGRAMS_PER_SM fills, or
    rows of one block; and where it measured no slower than the two kernels on an H200: rows of
    at most STATS_DLOGITS_MAX_ROW_BYTES, or chunks of at most STATS_DLOGITS_MAX_CHUNK_BYTES
    (`row_bytes`: a row of the chunk's logits; 8192 x 32064 and 4096 x 64128 bf16 took 3-9 % longer)."""
    return (STATS_DLOGITS and (num_rows >= PROGRAMS_PER_SM * _sm_count(device) or num_valid_cols <= STATS_BLOCK_N)
            and (row_bytes <= STATS_DLOGITS_MAX_ROW_BYTES or num_rows * row_bytes <= STATS_DLOGITS_MAX_CHUNK_BYTES))


def stats_dlogits_(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                   labelled: Optional[Tensor], scale=None, logprob: bool = False,
                   poison: Optional[Tensor] = None) -> tuple:
    """One launch over a chunk whose shard is the whole vocab (TP = 1, where `stats_dlogits_applies`):
    each row's statistics, bit for bit those of shard_stats + merged_tail (max, z_y, log S, lse), and
    its dlogits in place of its logits, bit for bit those of shard_dlogits_ with the coefficients
    they stand for: `scale` c (a float, or an fp32 0-d tensor on the device) for c (softmax -
    one_hot) in labelled rows (`labelled`, bool [rows]; None: every row) and 0 elsewhere
    (cross-entropy); with `logprob`, one_hot - softmax in every row and the labelled log-probs plus
    `poison` (fp32 [1], required: shard_logprob's). -> (max, target, log S, lse, log-probs or None)."""
    if logprob and poison is None:
        raise ValueError("stats_dlogits_: logprob=True needs the call's poison")
    n, num_cols = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    outs = tuple(torch.empty(n, **f32) for _ in range(5 if logprob else 4))
    in_memory = isinstance(scale, Tensor)
    programs = max(1, min(n, STATS_DLOGITS_PROGRAMS_PER_SM * _sm_count(logits.device)))
    _stats_dlogits_kernel[(programs,)](
        logits, logits.stride(0), local_target, outs[0] if labelled is None else labelled.view(torch.uint8),
        _f32(scale) if in_memory else outs[0], 0.0 if in_memory or scale is None else float(scale),
        _f32(poison) if logprob else outs[0],
        *outs[:4], outs[-1],
        n, num_cols, num_valid_cols, float(inv_temperature),
        LOGPROB=logprob, HAS_LABELLED=labelled is not None, SCALE_IN_MEMORY=in_memory,
        STATS_N=STATS_BLOCK_N, DLOGITS_N=DLOGITS_BLOCK_N,
        ROUND_BF16=_interpreting() and logits.dtype == torch.bfloat16, PRECISE_LOG=not _interpreting(),
        num_warps=STATS_WARPS,  # (the statistics' reduction order: the stats kernel's)
    )
    return outs if logprob else outs + (None,)


def stats_dlogits_with_labels_applies(num_rows: int, num_valid_cols: int, row_bytes: int,
                                     device: torch.device) -> bool:
    """Where `stats_dlogits_with_labels_` runs: where stats_dlogits_ does, up to
    LABELS_IN_LAUNCH_MAX_ROWS rows."""
    return num_rows <= LABELS_IN_LAUNCH_MAX_ROWS and stats_dlogits_applies(num_rows, num_valid_cols, row_bytes, device)


def stats_dlogits_with_labels_(logits: Tensor, labels: Tensor, ignore_index: int, true_vocab: int, vocab_start: int,
                               num_valid_cols: int, inv_temperature: float, flags: Tensor, *, mean: bool = False,
                               scale: float = 1.0, logprob: bool = False) -> tuple:
    """label_targets (without a mask or a rank check) then stats_dlogits_, in one launch: from the
    raw `labels` (int64 [rows]) each row's target and whether it is kept, the call's labelled count,
    its verdict and poison (`flags`: deferred_errors' word), then the statistics and dlogits with
    c = 1 / labelled rows (`mean`) or `scale`, or (`logprob`) one_hot - softmax and the log-probs
    plus the poison; the same bits as the two launches. -> (max, target, log S, lse, log-probs or
    None, targets on the shard, labelled (bool), counts (int64 [2]), scalars (fp32 [3])):
    label_targets' last four."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, num_cols = logits.shape
    device = logits.device
    # three allocations, each cut by one split (a view op apiece is host time at RL row counts)
    *outs, scalars = torch.empty(5 * n + 3, dtype=torch.float32, device=device).split((n, n, n, n, n, 3))
    local_target, counts = torch.empty(n + 2, dtype=torch.int64, device=device).split((n, 2))
    labelled = torch.empty(n, dtype=torch.uint8, device=device)
    programs = max(1, min(n, STATS_DLOGITS_PROGRAMS_PER_SM * _sm_count(device)))
    _stats_dlogits_labels_kernel[(programs,)](
        logits, logits.stride(0), labels, labels.stride(0), float(scale), *outs, local_target, labelled, counts, scalars,
        flags, n, int(ignore_index), int(true_vocab), int(vocab_start), num_cols, num_valid_cols,
        float(inv_temperature), LOGPROB=logprob, MEAN=mean, LABEL_BLOCK=LABEL_BLOCK, BAD_LABELS=LABELS_OUT_OF_RANGE,
        STATS_N=STATS_BLOCK_N, DLOGITS_N=DLOGITS_BLOCK_N,
        ROUND_BF16=_interpreting() and logits.dtype == torch.bfloat16, PRECISE_LOG=not _interpreting(),
        num_warps=STATS_WARPS,  # (the statistics' reduction order: the stats kernel's)
    )
    return (*outs[:4], outs[4] if logprob else None, local_target, labelled.view(torch.bool), counts, scalars)


@cached_launch
@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < numel
    scaled = tl.load(src_ptr + offsets, mask=in_range) * tl.load(scale_ptr)
    tl.store(dst_ptr + offsets, scaled.to(dst_ptr.dtype.element_ty), mask=in_range)


def scale_cast(src: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """dtype(src * scale) in one pass over the weight gradient (fp32, or already `dtype`)."""
    # Off CUDA (incl. the interpreter, whose fp32 -> bf16 cast truncates) the torch math is used.
    if dtype == torch.float32 or not src.is_cuda or not src.is_contiguous():
        return (src * scale).to(dtype)
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    block = 4096
    _scale_cast_kernel[(cdiv(src.numel(), block),)](
        src, out, _f32(scale), src.numel(), BLOCK=block, num_warps=8)
    return out


SCALE_PROGRAMS_PER_SM = 4  # the scaling's grid: where g == 1 (no pass) its programs are its whole cost


@cached_launch
@triton.jit
def _scale_kernel(ptr, other_ptr, scale_ptr, numel, other_numel, blocks, total_blocks, BLOCK: tl.constexpr):
    # blocks [0, blocks) of `ptr`, the rest of `other_ptr` (two tensors, one launch), walked by a
    # few programs per SM: where g == 1 each returns at once (one program per block, 128k of them
    # for a 128256 x 4096 dW, took ~80 us on an H200 to do nothing)
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        for block in range(tl.program_id(0), total_blocks, tl.num_programs(0)):
            if block < blocks:
                offsets = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
                in_range = offsets < numel
                scaled = tl.load(ptr + offsets, mask=in_range).to(tl.float32) * scale
                tl.store(ptr + offsets, scaled.to(ptr.dtype.element_ty), mask=in_range)
            else:
                offsets = tl.cast(block - blocks, tl.int64) * BLOCK + tl.arange(0, BLOCK)
                in_range = offsets < other_numel
                scaled = tl.load(other_ptr + offsets, mask=in_range).to(tl.float32) * scale
                tl.store(other_ptr + offsets, scaled.to(other_ptr.dtype.element_ty), mask=in_range)


def scale_(t: Tensor, scale: Tensor, other: Optional[Tensor] = None) -> Tensor:
    """t *= scale (and other *= scale) in place, in fp32 with the fp32 upstream gradient, decided on
    the GPU: g == 1 (Megatron's loss functions) reads and writes nothing, and the host never waits
    for g. dX and dW in one launch: every launch of the backward is host time at RL shapes."""
    # Off CUDA (incl. the interpreter, whose fp32 -> bf16 cast truncates) the torch math is used.
    if not all(x.is_cuda and x.is_contiguous() for x in ((t,) if other is None else (t, other))):
        return torch_backend.scale_(t, scale, other)
    block = 4096
    blocks = cdiv(t.numel(), block)
    total = blocks + (0 if other is None else cdiv(other.numel(), block))
    _scale_kernel[(max(1, min(total, SCALE_PROGRAMS_PER_SM * _sm_count(t.device))),)](
        t, t if other is None else other, _f32(scale), t.numel(), 0 if other is None else other.numel(), blocks,
        total, BLOCK=block, num_warps=8)
    return t


@cached_launch
@triton.jit
def _exp_tile_kernel(
    tile_ptr, stride_row, target_ptr, col_start, ref_ptr, sum_exp_ptr, target_out_ptr, sum_logits_ptr,
    acc_ptr, acc_stride, acc_cols, num_cols, num_valid_cols, inv_temperature, ref_margin,
    FIRST: tl.constexpr, WANT_SUM: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK_N: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = tile_ptr + row.to(tl.int64) * stride_row
    t = tl.load(target_ptr + row) - col_start  # the label's column in this tile
    in_tile = (t >= 0) & (t < num_valid_cols)
    z_t = tl.load(row_ptr + tl.where(in_tile, t, 0)).to(tl.float32) * inv_temperature  # before overwriting
    block_max = tl.full([], float("-inf"), tl.float32)  # first of two reads of the row
    for col0 in range(0, num_valid_cols, BLOCK_N):
        cols = col0 + tl.arange(0, BLOCK_N)
        z = tl.load(row_ptr + cols, mask=cols < num_valid_cols, other=float("-inf")).to(tl.float32)
        block_max = tl.maximum(block_max, tl.max(z * inv_temperature, axis=0))
    s_logits = tl.zeros([], tl.float32)
    if FIRST:  # the reference is this tile's row max
        ref = block_max
        s = tl.zeros([], tl.float32)
    else:
        old = tl.load(ref_ptr + row)
        s = tl.load(sum_exp_ptr + row)
        if WANT_SUM:
            s_logits = tl.load(sum_logits_ptr + row)
        ref = old
        if block_max > old + ref_margin:  # rare: move the reference, rescale what was summed against it
            ref = block_max
            scale = tl.exp(old - block_max)
            s = s * scale
            if HAS_ACC:
                acc_row = acc_ptr + row.to(tl.int64) * acc_stride
                for col0 in range(0, acc_cols, BLOCK_N):
                    cols = col0 + tl.arange(0, BLOCK_N)
                    a = tl.load(acc_row + cols, mask=cols < acc_cols)
                    tl.store(acc_row + cols, a * scale, mask=cols < acc_cols)
    tl.store(ref_ptr + row, ref)
    for col0 in range(0, num_cols, BLOCK_N):
        cols = col0 + tl.arange(0, BLOCK_N)
        valid = cols < num_valid_cols
        z = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
        p = tl.exp(z - ref)  # 0 at padding columns
        s += tl.sum(p, axis=0)
        if WANT_SUM:
            s_logits += tl.sum(tl.where(valid, z, 0.0), axis=0)
        if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates
            p = round_bf16_by_hand(p)
        tl.store(row_ptr + cols, p.to(tile_ptr.dtype.element_ty), mask=cols < num_cols)
    tl.store(sum_exp_ptr + row, s)
    if WANT_SUM:
        tl.store(sum_logits_ptr + row, s_logits)
    if in_tile:
        tl.store(target_out_ptr + row, z_t)


def exp_tile_(tile: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float, ref_max: Tensor,
              sum_exp: Tensor, target: Tensor, sum_logits: Optional[Tensor], acc: Optional[Tensor], first: bool,
              *, ref_margin: float, col_start: int = 0) -> Tensor:
    """Same as torch_backend.exp_tile_ (lean sweep A), in place; all partials fp32 contiguous,
    `acc` fp32 with unit column stride."""
    n, num_cols = tile.shape
    if n == 0 or num_cols == 0:
        return tile
    if tile.stride(1) != 1 or (acc is not None and acc.stride(1) != 1):
        raise ValueError("exp_tile_ needs a tile and an accumulator with unit column stride")
    _exp_tile_kernel[(n,)](
        tile, tile.stride(0), local_target.contiguous(), col_start, ref_max, sum_exp, target,
        ref_max if sum_logits is None else sum_logits,
        ref_max if acc is None else acc, 0 if acc is None else acc.stride(0), 0 if acc is None else acc.shape[1],
        num_cols, min(num_valid_cols, num_cols), float(inv_temperature), float(ref_margin),
        FIRST=first, WANT_SUM=sum_logits is not None, HAS_ACC=acc is not None,
        BLOCK_N=STATS_BLOCK_N if tile.is_cuda else 64,
        ROUND_BF16=_interpreting() and tile.dtype == torch.bfloat16, num_warps=STATS_WARPS,
    )
    return tile


PIECE_MASK = tl.constexpr(2**21 - 1)  # agreement.fingerprint_pieces


# (the signature code's pieces arrive as plain ints: a value of 1 would otherwise become a constexpr)
@cached_launch
@triton.jit(do_not_specialize=["code0", "code1", "code2"])
def _label_targets_kernel(labels_ptr, target_ptr, labelled_ptr, counts_ptr, scalars_ptr, flags_ptr, n, ignore_index,
                          true_vocab, vocab_start, v_local, code0, code1, code2,
                          mask_ptr, mask_cols, mask_stride0, mask_stride1, HAS_FLAGS: tl.constexpr,
                          HAS_CHECK: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    # one program walks every row: a launch, not a reduction tree, is what costs at these sizes
    labelled_rows = tl.zeros([BLOCK], tl.int64)
    bad_rows = tl.zeros([BLOCK], tl.int32)
    # the labels' fingerprint (agreement.tensor_fingerprint: 31-bit terms v_i * w_i, summed)
    position_sum = tl.zeros([], tl.int64)
    hash_sum = tl.zeros([], tl.int64)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_rows = offsets < n
        label = tl.load(labels_ptr + offsets, mask=in_rows, other=ignore_index)
        if HAS_MASK:  # a position whose mask is 0 is ignored: its label is ignore_index from here on
            at = (offsets // mask_cols).to(tl.int64) * mask_stride0 + (offsets % mask_cols).to(tl.int64) * mask_stride1
            label = tl.where(tl.load(mask_ptr + at, mask=in_rows, other=1) != 0, label, ignore_index)
        if HAS_CHECK:
            position_terms, hash_terms = fingerprint_terms(label, offsets.to(tl.int64), in_rows, True)
            position_sum += position_terms
            hash_sum += hash_terms
        # (a position past the rows reads ignore_index: not kept, not bad)
        target, labelled, bad_block = _label_target(label, ignore_index, true_vocab, vocab_start, v_local)
        tl.store(target_ptr + offsets, target, mask=in_rows)
        tl.store(labelled_ptr + offsets, labelled.to(tl.int8), mask=in_rows)
        labelled_rows += labelled.to(tl.int64)
        bad_rows = tl.maximum(bad_rows, bad_block.to(tl.int32))
    bad = tl.max(bad_rows, axis=0).to(tl.int64)
    tl.store(counts_ptr, tl.sum(labelled_rows, axis=0))
    tl.store(counts_ptr + 1, bad)
    tl.store(scalars_ptr, tl.where(bad != 0, float("nan"), 0.0))
    inverse = 1.0 / tl.maximum(tl.sum(labelled_rows, axis=0), 1).to(tl.float32)
    tl.store(scalars_ptr + 1, inverse)
    tl.store(scalars_ptr + 2, -inverse)
    if HAS_FLAGS:
        tl.store(flags_ptr, tl.load(flags_ptr) | bad)
    if HAS_CHECK:  # agreement.fingerprint_pieces of [signature code, position_sum, hash_sum]: 21 bits each
        tl.store(scalars_ptr + 3, code0.to(tl.float32))
        tl.store(scalars_ptr + 6, code1.to(tl.float32))
        tl.store(scalars_ptr + 9, code2.to(tl.float32))
        for part in tl.static_range(3):
            tl.store(scalars_ptr + 4 + 3 * part, ((position_sum >> (21 * part)) & PIECE_MASK).to(tl.float32))
            tl.store(scalars_ptr + 5 + 3 * part, ((hash_sum >> (21 * part)) & PIECE_MASK).to(tl.float32))



def _pieces(code: int) -> tuple:
    """agreement.fingerprint_pieces of one non-negative int, on the host."""
    return tuple((int(code) >> (21 * part)) & (2**21 - 1) for part in range(3))


def label_targets(labels: Tensor, ignore_index: int, true_vocab: int, vocab_start: int, v_local: int,
                  flags: Optional[Tensor] = None, signature_code: Optional[int] = None,
                  agree_tensors: tuple = (), label_mask: Optional[Tensor] = None) -> tuple:
    """torch_backend.label_targets in one launch (the dozen elementwise ops and reductions of the
    torch version each cost a launch before the first GEMM; the rank check's fingerprint a dozen
    more; the mask's two), and one more per tensor of `agree_tensors`, writing its pieces in place
    (some seven launches each in torch)."""
    if not labels.is_cuda:
        return torch_backend.label_targets(labels, ignore_index, true_vocab, vocab_start, v_local, flags,
                                           signature_code, agree_tensors, label_mask)
    labels = labels.contiguous()
    n = labels.numel()
    local_target = torch.empty(n, dtype=torch.int64, device=labels.device)
    labelled = torch.empty(n, dtype=torch.uint8, device=labels.device)
    counts = torch.empty(2, dtype=torch.int64, device=labels.device)
    checked = signature_code is not None
    scalars = torch.empty(3 + (9 + 6 * len(agree_tensors) if checked else 0), dtype=torch.float32,
                          device=labels.device)
    _label_targets_kernel[(1,)](labels, local_target, labelled, counts, scalars, flags if flags is not None else counts,
                                n, int(ignore_index), int(true_vocab), int(vocab_start), int(v_local),
                                *_pieces(signature_code or 0),
                                *_label_mask_arguments(label_mask, counts),
                                HAS_FLAGS=flags is not None, HAS_CHECK=checked, HAS_MASK=label_mask is not None,
                                BLOCK=1024, num_warps=4)
    if checked:
        for i, tensor in enumerate(agree_tensors):
            tensor_fingerprint_pieces(tensor, out=scalars[12 + 6 * i:18 + 6 * i])
    return local_target, labelled.view(torch.bool), counts, scalars


# the integer type of the same width whose bits agreement.tensor_fingerprint sums, by element size
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@cached_launch
@triton.jit
def _fingerprint_pieces_kernel(values_ptr, n, out_ptr, FOLD: tl.constexpr, BLOCK: tl.constexpr):
    # one program, as the label kernel's fingerprint: agreement.tensor_fingerprint's two sums
    position_sum = tl.zeros([], tl.int64)
    hash_sum = tl.zeros([], tl.int64)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n
        value = tl.load(values_ptr + offsets, mask=inside, other=0).to(tl.int64)  # sign-extended, as torch's
        position_terms, hash_terms = fingerprint_terms(value, offsets.to(tl.int64), inside, FOLD)
        position_sum += position_terms
        hash_sum += hash_terms
    for part in tl.static_range(3):  # agreement.fingerprint_pieces of [by_position, by_hash]
        tl.store(out_ptr + 2 * part, ((position_sum >> (21 * part)) & PIECE_MASK).to(tl.float32))
        tl.store(out_ptr + 2 * part + 1, ((hash_sum >> (21 * part)) & PIECE_MASK).to(tl.float32))


def tensor_fingerprint_pieces(tensor: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """torch_backend.tensor_fingerprint_pieces in one launch, written into `out` (fp32 [6]) where
    given; the torch definition for what the kernel does not read (a tensor on another device,
    complex values)."""
    if out is None:
        out = torch.empty(6, dtype=torch.float32, device=tensor.device)
    flat = tensor.detach().reshape(-1).contiguous()  # (a strided 1-d tensor reshapes to itself)
    if flat.device != out.device or not _runs_kernel(flat) or flat.is_complex() or flat.numel() == 0:
        return out.copy_(torch_backend.tensor_fingerprint_pieces(tensor))
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.is_floating_point():
        flat = flat.view(_SAME_WIDTH_INT[flat.element_size()])
    _fingerprint_pieces_kernel[(1,)](flat, flat.numel(), out, FOLD=flat.element_size() == 8, BLOCK=1024,
                                     num_warps=4)
    return out


@cached_launch
@triton.jit
def _labelled_loss_sum_kernel(target_ptr, max_ptr, log_sum_exp_ptr, labelled_ptr, scale_ptr, poison_ptr, out_ptr,
                              n, HAS_LABELLED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_POISON: tl.constexpr,
                              BLOCK: tl.constexpr):
    # one program: a fixed order of additions, the same total on every call
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        in_range = rows < n
        value = (tl.load(max_ptr + rows, mask=in_range, other=0.0) - tl.load(target_ptr + rows, mask=in_range, other=0.0)
                 + tl.load(log_sum_exp_ptr + rows, mask=in_range, other=0.0))
        keep = in_range
        if HAS_LABELLED:
            keep = keep & (tl.load(labelled_ptr + rows, mask=in_range, other=0) != 0)
        acc += tl.where(keep, value, 0.0)
    total = tl.sum(acc, axis=0)
    if HAS_SCALE:
        total = total * tl.load(scale_ptr)
    if HAS_POISON:
        total = total + tl.load(poison_ptr)
    tl.store(out_ptr, total)


def labelled_loss_sum(target: Tensor, row_max: Tensor, log_sum_exp: Tensor, labelled: Optional[Tensor],
                      scale: Optional[Tensor], poison: Optional[Tensor]) -> Tensor:
    """torch_backend.labelled_loss_sum in one launch (the loss value's five elementwise ops and its
    sum each cost a launch of host time at RL shapes)."""
    if not target.is_cuda:
        return torch_backend.labelled_loss_sum(target, row_max, log_sum_exp, labelled, scale, poison)
    out = torch.empty((), dtype=torch.float32, device=target.device)
    args = [_f32(t) for t in (target, row_max, log_sum_exp)]
    _labelled_loss_sum_kernel[(1,)](
        *args, args[0] if labelled is None else labelled.contiguous().view(torch.uint8),
        args[0] if scale is None else _f32(scale), args[0] if poison is None else _f32(poison), out, target.numel(),
        HAS_LABELLED=labelled is not None, HAS_SCALE=scale is not None, HAS_POISON=poison is not None,
        BLOCK=2048, num_warps=8)
    return out


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """exp as torch's CUDA exp computes it (libdevice's expf), where PRECISE; else tl.exp."""
    if PRECISE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _rank_terms(base, rows, ok, n, row_max, WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr,
                PRECISE: tl.constexpr):
    """One rank's packed partials moved to the rows' max over the ranks: sum exp(z - m) exp(m - M) (a
    rank without valid columns, m = -inf: exp(-inf) = 0), z_y, sum z, and the entropy's
    exp(m - M) (sum exp(z - m)(z - m) + (m - M) sum exp(z - m)) (zeros where not asked)."""
    m = tl.load(base + rows, mask=ok, other=0.0)
    s = tl.load(base + n + rows, mask=ok, other=0.0)
    rescale = _exp(m - row_max, PRECISE)
    z_sum = tl.zeros_like(s)
    shifted = tl.zeros_like(s)
    if WANT_SUM:
        z_sum = tl.load(base + 3 * n + rows, mask=ok, other=0.0)
    if WANT_ENTROPY:
        shift = tl.where((m > float("-inf")) & (m < float("inf")), m - row_max, 0.0)
        shifted = (tl.load(base + (3 + WANT_SUM) * n + rows, mask=ok, other=0.0) + shift * s) * rescale
    return s * rescale, tl.load(base + 2 * n + rows, mask=ok, other=0.0), z_sum, shifted


@cached_launch
@triton.jit
def _merge_gathered_kernel(gathered_ptr, length, ranks, n, max_out, log_sum_exp_out, lse_out, target_out, sum_logits_out,
                           entropy_out, poison_ptr, poison_out, flags_ptr, flag, check_width, labelled_ptr, logprob_out,
                           WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr, HAS_POISON: tl.constexpr,
                           VERDICT: tl.constexpr, HAS_FLAGS: tl.constexpr, WANT_LOGPROB: tl.constexpr,
                           HAS_LABELLED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                           PRECISE: tl.constexpr):
    # (launched without FMA contraction: each product rounds before it is added, as in torch)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    row_max = tl.load(gathered_ptr + rows, mask=ok, other=0.0)
    for rank in range(1, ranks):
        row_max = tl.maximum(row_max, tl.load(gathered_ptr + rank * length + rows, mask=ok, other=0.0))
    # rank 0's terms, then the others' added in rank order (as torch_backend._in_rank_order)
    sum_exp, target, sum_logits, sum_shifted = _rank_terms(gathered_ptr, rows, ok, n, row_max, WANT_SUM,
                                                           WANT_ENTROPY, PRECISE)
    for rank in range(1, ranks):
        s, t, z_sum, shifted = _rank_terms(gathered_ptr + rank * length, rows, ok, n, row_max, WANT_SUM,
                                           WANT_ENTROPY, PRECISE)
        sum_exp, target = sum_exp + s, target + t
        if WANT_SUM:
            sum_logits = sum_logits + z_sum
        if WANT_ENTROPY:
            sum_shifted = sum_shifted + shifted
    tl.store(max_out + rows, row_max, mask=ok)
    tl.store(target_out + rows, target, mask=ok)
    log_s = _log(tl.where(ok, sum_exp, 1.0), PRECISE)
    tl.store(log_sum_exp_out + rows, log_s, mask=ok)
    tl.store(lse_out + rows, row_max + log_s, mask=ok)
    if WANT_SUM:
        tl.store(sum_logits_out + rows, sum_logits, mask=ok)
    if WANT_ENTROPY:
        # (div_rn: torch's division, rounded to nearest; `/` is the approximate division)
        tl.store(entropy_out + rows, log_s - tl.div_rn(sum_shifted, tl.where(ok, sum_exp, 1.0)), mask=ok)
    poison = 0.0
    if HAS_POISON:
        poison = tl.load(poison_ptr)
    if VERDICT:  # (every program decides it: the log-probs of its rows take it)
        i = tl.arange(0, BLOCK_W)
        in_width = i < check_width
        checks = (3 + WANT_SUM + WANT_ENTROPY) * n
        first = tl.load(gathered_ptr + checks + i, mask=in_width, other=0.0)
        differ = tl.zeros([BLOCK_W], dtype=tl.int32)
        for rank in range(1, ranks):
            other = tl.load(gathered_ptr + rank * length + checks + i, mask=in_width, other=0.0)
            differ = differ | (other != first).to(tl.int32)
        differs = tl.max(differ, axis=0)
        poison = poison + tl.where(differs != 0, float("nan"), 0.0)
        if tl.program_id(0) == 0:
            tl.store(poison_out, poison)
            if HAS_FLAGS:
                tl.store(flags_ptr, tl.load(flags_ptr) | (differs.to(tl.int64) * flag))
    if WANT_LOGPROB:  # labelled_logprob's: (z_y - M) - log S, 0 where not labelled, plus the poison
        value = (target - row_max) - log_s
        if HAS_LABELLED:
            value = tl.where(tl.load(labelled_ptr + rows, mask=ok, other=0) != 0, value, 0.0)
        if HAS_POISON or VERDICT:
            value = value + poison
        tl.store(logprob_out + rows, value, mask=ok)


def merge_gathered(gathered: Tensor, n: int, want_sum_logits: bool, want_entropy: bool,
                   rank_verdict: Optional[tuple] = None, want_logprob: bool = False,
                   labelled: Optional[Tensor] = None, poison: Optional[Tensor] = None) -> tuple:
    """torch_backend.merge_gathered in one launch, the same bits on CUDA (the rank-order sums, and
    libdevice's expf and logf are torch's)."""
    if not _runs_kernel(gathered):
        return torch_backend.merge_gathered(gathered, n, want_sum_logits, want_entropy, rank_verdict, want_logprob,
                                            labelled, poison)
    ranks, length = gathered.shape
    gathered = _f32(gathered)
    f32 = dict(dtype=torch.float32, device=gathered.device)
    outputs = [torch.empty(n, **f32) for _ in range(4 + want_sum_logits + want_entropy + want_logprob)]
    row_max, log_sum_exp, lse, target = outputs[:4]
    sum_logits = outputs[4] if want_sum_logits else None
    entropy = outputs[4 + want_sum_logits] if want_entropy else None
    logprob = outputs[-1] if want_logprob else None
    check_width = length - (3 + want_sum_logits + want_entropy) * n
    poison_out, flags, flag = None, None, 0
    if rank_verdict is not None:  # the log-probs take the verdict's poison (the call's so far, + NaN)
        poison, flags, flag = rank_verdict
        poison_out = torch.empty(1, **f32)
    block = 1024
    _merge_gathered_kernel[(max(1, cdiv(n, block)),)](
        gathered, length, ranks, n, row_max, log_sum_exp, lse, target,
        sum_logits if want_sum_logits else row_max, entropy if want_entropy else row_max,
        row_max if poison is None else _f32(poison), row_max if poison_out is None else poison_out,
        row_max if flags is None else flags, int(flag), check_width,
        row_max if labelled is None else labelled.contiguous().view(torch.uint8),
        row_max if logprob is None else logprob,
        WANT_SUM=want_sum_logits, WANT_ENTROPY=want_entropy, HAS_POISON=poison is not None,
        VERDICT=rank_verdict is not None, HAS_FLAGS=flags is not None, WANT_LOGPROB=want_logprob,
        HAS_LABELLED=labelled is not None, BLOCK=block, BLOCK_W=next_power_of_2(max(check_width, 1)),
        PRECISE=not _interpreting(), num_warps=4, enable_fp_fusion=False)
    return row_max, log_sum_exp, lse, target, sum_logits, entropy, poison_out, logprob


@cached_launch
@triton.jit
def _merged_tail_kernel(max_ptr, sum_exp_ptr, shifted_ptr, log_sum_exp_ptr, lse_ptr, entropy_ptr,
                        target_ptr, labelled_ptr, kept_ptr, poison_ptr, logprob_ptr, n,
                        WANT_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr,
                        LOGPROB: tl.constexpr = False, HAS_LABELLED: tl.constexpr = False,
                        HAS_KEPT: tl.constexpr = False, HAS_POISON: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    row_max = tl.load(max_ptr + rows, mask=ok, other=0.0)
    s = tl.load(sum_exp_ptr + rows, mask=ok, other=1.0)
    shifted = s  # (read only WANT_ENTROPY)
    if WANT_ENTROPY:
        shifted = tl.load(shifted_ptr + rows, mask=ok, other=0.0)
    target = s  # (read only with LOGPROB)
    if LOGPROB:
        target = tl.load(target_ptr + rows, mask=ok, other=0.0)
    store_merged_tail(rows, ok, row_max, s, shifted, target, log_sum_exp_ptr, lse_ptr, entropy_ptr, labelled_ptr,
                      kept_ptr, poison_ptr, logprob_ptr, WANT_ENTROPY, PRECISE, LOGPROB, HAS_LABELLED, HAS_KEPT,
                      HAS_POISON)


def merged_tail(row_max: Tensor, sum_exp: Tensor, sum_exp_shifted: Optional[Tensor],
                logprob_of: Optional[tuple] = None) -> tuple:
    """torch_backend.merged_tail in one launch (with `logprob_of`, labelled_logprob's in it too)."""
    if not _runs_kernel(row_max):
        return torch_backend.merged_tail(row_max, sum_exp, sum_exp_shifted, logprob_of)
    n = row_max.numel()
    f32 = dict(dtype=torch.float32, device=row_max.device)
    log_sum_exp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n, **f32) if sum_exp_shifted is not None else None
    logprob, extra, flags = None, (lse,) * 5, {}
    if logprob_of is not None:
        target, labelled, kept, poison = logprob_of
        logprob = torch.empty(n, **f32)
        extra = (_f32(target), lse if labelled is None else labelled.contiguous().view(torch.uint8),
                 lse if kept is None else kept.contiguous().view(torch.uint8), lse if poison is None else _f32(poison),
                 logprob)
        flags = dict(LOGPROB=True, HAS_LABELLED=labelled is not None, HAS_KEPT=kept is not None,
                     HAS_POISON=poison is not None)
    block = 1024
    _merged_tail_kernel[(max(1, cdiv(n, block)),)](
        _f32(row_max), _f32(sum_exp), _f32(sum_exp_shifted) if entropy is not None else lse, log_sum_exp, lse,
        entropy if entropy is not None else lse, *extra, n, WANT_ENTROPY=entropy is not None, BLOCK=block,
        PRECISE=not _interpreting(), **flags, num_warps=4)
    return (log_sum_exp, lse, entropy) if logprob_of is None else (log_sum_exp, lse, entropy, logprob)


@cached_launch
@triton.jit
def _labelled_logprob_kernel(target_ptr, max_ptr, log_sum_exp_ptr, labelled_ptr, kept_ptr, poison_ptr, out_ptr, n,
                             HAS_LABELLED: tl.constexpr, HAS_KEPT: tl.constexpr, HAS_POISON: tl.constexpr,
                             BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    _store_labelled_logprob(rows, ok, tl.load(target_ptr + rows, mask=ok, other=0.0),
                            tl.load(max_ptr + rows, mask=ok, other=0.0), tl.load(log_sum_exp_ptr + rows, mask=ok,
                                                                                 other=0.0),
                            labelled_ptr, kept_ptr, poison_ptr, out_ptr, HAS_LABELLED, HAS_KEPT, HAS_POISON)


def labelled_logprob(target: Tensor, row_max: Tensor, log_sum_exp: Tensor, labelled: Optional[Tensor],
                     poison: Optional[Tensor], kept: Optional[Tensor] = None) -> Tensor:
    """torch_backend.labelled_logprob in one launch (four to six elementwise ones there)."""
    if not _runs_kernel(target):
        return torch_backend.labelled_logprob(target, row_max, log_sum_exp, labelled, poison, kept)
    n = target.numel()
    out = torch.empty(n, dtype=torch.float32, device=target.device)
    args = [_f32(t) for t in (target, row_max, log_sum_exp)]
    block = 1024
    _labelled_logprob_kernel[(max(1, cdiv(n, block)),)](
        *args, args[0] if labelled is None else labelled.contiguous().view(torch.uint8),
        args[0] if kept is None else kept.contiguous().view(torch.uint8), args[0] if poison is None else _f32(poison),
        out, n, HAS_LABELLED=labelled is not None, HAS_KEPT=kept is not None, HAS_POISON=poison is not None,
        BLOCK=block, num_warps=4)
    return out


def _runs_kernel(t: Tensor) -> bool:
    """Where the per-row kernels run: CUDA tensors, and CPU ones under the interpreter (the CPU
    tests' Triton backend); elsewhere their torch definitions."""
    return t.is_cuda or _interpreting()


@cached_launch
@triton.jit
def _row_scale_kernel(out_ptr, out_stride, src_ptr, src_stride, scale_ptr, scale_stride, keep_ptr, cols,
                      HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < cols
    value = tl.load(src_ptr + row.to(tl.int64) * src_stride + offsets, mask=in_range).to(tl.float32)
    scale = tl.load(scale_ptr + row.to(tl.int64) * scale_stride).to(tl.float32)
    if HAS_KEEP:
        scale = tl.where(tl.load(keep_ptr + row) != 0, scale, 0.0)
    scaled = value * scale
    tl.store(out_ptr + row.to(tl.int64) * out_stride + offsets, scaled.to(out_ptr.dtype.element_ty), mask=in_range)


def row_scale(out: Tensor, src: Tensor, scale: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    """torch_backend.row_scale at the memory's speed: torch's broadcast product of mixed dtypes
    runs its slow strided kernel (~37 us for 2048 x 4096 on an H200, ~2.5x the traffic's time);
    `keep` read in the same launch; `scale` read as it is, in its dtype and with its stride (an
    upstream gradient of a sum arrives expanded from one element: no copy launch to make it
    contiguous fp32)."""
    rows, cols = src.shape
    # (the interpreter's cast to bf16 / fp16 truncates: there only fp32 outputs run the kernel)
    kernel = src.is_cuda or (_interpreting() and out.dtype == torch.float32)
    if not kernel or rows == 0 or cols == 0 or src.stride(1) != 1 or out.stride(1) != 1:
        return torch_backend.row_scale(out, src, scale, keep)
    block = 1024
    if scale.dim() != 1 or not scale.is_floating_point():
        scale = _f32(scale).reshape(rows)
    _row_scale_kernel[(rows, cdiv(cols, block))](
        out, out.stride(0), src, src.stride(0), scale, scale.stride(0),
        scale if keep is None else keep.contiguous().view(torch.uint8), cols, HAS_KEEP=keep is not None, BLOCK=block,
        num_warps=4)
    return out


from . import replay_triton, replay_union_triton, sampling_triton  # noqa: E402  (it uses the helpers above)

BACKEND = Backend(
    name="triton", shard_stats=shard_stats, shard_logprob=shard_logprob, shard_dlogits_=shard_dlogits_, scale_=scale_,
    scale_cast=scale_cast, exp_tile_=exp_tile_, shard_candidates=sampling_triton.shard_candidates,
    kept_sums=sampling_triton.kept_sums, kept_dlogits_=sampling_triton.kept_dlogits_,
    kept_stats=replay_triton.kept_stats, kept_grads=replay_triton.kept_grads, label_targets=label_targets,
    entry_stats=replay_triton.entry_stats, entry_dlogits=replay_triton.entry_dlogits,
    kept_layout=replay_triton.kept_layout, union_logits=replay_union_triton.union_logits,
    union_sum_rows=replay_union_triton.union_sum_rows, union_layouts=replay_union_triton.union_layouts,
    columns_by_use=replay_union_triton.columns_by_use,
    labelled_loss_sum=labelled_loss_sum, row_scale=row_scale,
    merge_gathered=merge_gathered, merged_tail=merged_tail, labelled_logprob=labelled_logprob,
    gemm_stats=FusedGemm(supported=triton_gemm_stats.supported, run=triton_gemm_stats.gemm_shard_stats),
    gemm_dlogits=FusedGemm(supported=gemm_dlogits_supported, run=triton_gemm_dlogits.gemm_dlogits),
    stats_dlogits=StatsDlogits(applies=stats_dlogits_applies, run_=stats_dlogits_,
                               with_labels=LabelsInLaunch(applies=stats_dlogits_with_labels_applies,
                                                          run_=stats_dlogits_with_labels_)),
    label_logprob=LabelLogprob(applies=label_logprob_applies, run=label_logprob, with_statistics=label_statistics),
)
