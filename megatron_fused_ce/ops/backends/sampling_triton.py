"""Per-chunk math of the sampler-fidelity path in Triton: the GPU side of sampling_torch.py.

Same functions, arguments and results as sampling_torch.py (read its module doc);
tests/test_sampling_triton.py checks them against it, on CPU under TRITON_INTERPRET=1.

- `shard_candidates`: the first M tokens of each row in the total order without sorting or
  top-k over the whole row. (1) The max of every group of GROUP_COLS columns (one torch `amax`
  read of the chunk) and the M-th largest of those maxima, tau: at least M tokens have z >= tau,
  so the first M are among them. (2) `_compact_kernel` (one read) writes the int64 keys of the
  tokens with z >= tau into a [n, CAPACITY_PER_CANDIDATE * M] buffer (a prefix sum gives each its
  slot). (3) a top-M of that small buffer. Rows with more such tokens than the buffer holds (long
  runs of equal logits) are redone exactly by the torch reference.
- `kept_sums`: one read of the chunk (or of the selected rows), columns split over several
  programs when rows are few, as triton_backend.shard_stats does; exp(z - row max) needs no
  online rescaling (the global max is known).
- `kept_dlogits_`: triton_backend's dlogits kernel with the kept-set mask (log q = (z - M) - log S,
  the two parts kept apart as there): one read and one write.

z = fp32(logits) * inv_temperature exactly as in the torch backends, so kept-set decisions,
candidate keys and target logits are bit-identical to sampling_torch.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import sampling_torch
from .sampling_torch import KEY_NONE, KeptSums
from .triton_common import cached_launch, cdiv, f32 as _f32, interpreting as _interpreting, sm_count as _sm_count
from .triton_gemm_stats import round_bf16_by_hand

# Launch settings (module-level so that tests can shrink them; not a public API).
GROUP_COLS = 64  # columns per group maximum (the threshold tau)
CAPACITY_PER_CANDIDATE = 8  # compaction buffer: this many slots per candidate
COMPACT_BLOCK_N = 1024
KEPT_BLOCK_N = 4096
KEPT_WARPS = 8
DLOGITS_BLOCK_N = 2048
DLOGITS_WARPS = 8
PROGRAMS_PER_SM = 8


@triton.jit
def _order_key(z, ids):
    """int64 key: ordered fp32 bits in the high word, (2^32 - 1 - id) in the low word."""
    z = tl.where(z == 0.0, 0.0, z)  # -0.0 -> +0.0
    bits = z.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ordered.to(tl.int64) * 4294967296 + (4294967295 - ids.to(tl.int64))


@cached_launch
@triton.jit
def _compact_kernel(
    logits_ptr, stride_row, tau_ptr, keys_ptr, count_ptr,
    num_valid_cols, inv_temperature, vocab_start, capacity,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    out_ptr = keys_ptr + row.to(tl.int64) * capacity
    tau = tl.load(tau_ptr + row)
    count = tl.zeros([], tl.int32)
    for col0 in range(0, num_valid_cols, BLOCK_N):
        cols = col0 + tl.arange(0, BLOCK_N)
        valid = cols < num_valid_cols
        z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
        take = valid & (z >= tau)
        slot = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + slot, _order_key(z, cols + vocab_start), mask=take & (slot < capacity))
        count += tl.sum(take.to(tl.int32), axis=0)
    tl.store(count_ptr + row, count)


def shard_candidates(logits: Tensor, num_valid_cols: int, inv_temperature: float, vocab_start: int,
                     num_candidates: int) -> Tensor:
    n = logits.shape[0]
    out = torch.full((n, num_candidates), KEY_NONE, dtype=torch.int64, device=logits.device)
    if n == 0 or num_valid_cols == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    groups = num_valid_cols // GROUP_COLS
    if groups >= num_candidates:
        group_max = logits[:, :groups * GROUP_COLS].unflatten(1, (groups, GROUP_COLS)).amax(dim=2)
        tau = group_max.topk(num_candidates, dim=1, sorted=False).values.amin(dim=1)
        tau = tau.float() * inv_temperature  # the same fp32 z as the kernel's
    else:  # few columns: every one is a candidate
        tau = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
    capacity = max(CAPACITY_PER_CANDIDATE * num_candidates, 1)
    keys = torch.full((n, capacity), KEY_NONE, dtype=torch.int64, device=logits.device)
    count = torch.empty(n, dtype=torch.int32, device=logits.device)
    _compact_kernel[(n,)](
        logits, logits.stride(0), tau.contiguous(), keys, count,
        num_valid_cols, float(inv_temperature), vocab_start, capacity,
        BLOCK_N=COMPACT_BLOCK_N, num_warps=4,
    )
    take = min(num_candidates, num_valid_cols)
    out[:, :take] = keys.topk(take, dim=1, sorted=True).values
    overflow = (count > capacity).nonzero().squeeze(1)
    for start in range(0, overflow.numel(), sampling_torch.TIE_ROWS):
        # long runs of equal logits: the exact torch reference for those rows, a few at a time
        rows = overflow[start:start + sampling_torch.TIE_ROWS]
        out[rows] = sampling_torch.shard_candidates(logits.index_select(0, rows), num_valid_cols,
                                                    inv_temperature, vocab_start, num_candidates)
    return out


@cached_launch
@triton.jit
def _kept_sums_kernel(
    logits_ptr, stride_row, rows_ptr, target_ptr, max_ptr, zcut_ptr, idcut_ptr,
    sum_ptr, sum_shifted_ptr, count_ptr, total_ptr, target_out_ptr,
    num_valid_cols, cols_per_split, num_splits, inv_temperature, vocab_start,
    HAS_ROWS: tl.constexpr, HAS_TARGET: tl.constexpr, WANT_ENTROPY: tl.constexpr,
    WANT_COUNT: tl.constexpr, WANT_TOTAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i = tl.program_id(0)
    split = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    m = tl.load(max_ptr + i)
    z_cut = tl.load(zcut_ptr + i)
    id_cut = tl.load(idcut_ptr + i)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, num_valid_cols)
    s = tl.zeros([], tl.float32)
    s_shifted = tl.zeros([], tl.float32)
    c = tl.zeros([], tl.int32)
    total = tl.zeros([], tl.float32)
    for col0 in range(start, end, BLOCK_N):
        cols = col0 + tl.arange(0, BLOCK_N)
        valid = cols < end
        z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
        ids = (cols + vocab_start).to(tl.int64)
        keep = valid & ((z > z_cut) | ((z == z_cut) & (ids <= id_cut)))
        e = tl.exp(z - m)
        s += tl.sum(tl.where(keep, e, 0.0), axis=0)
        if WANT_ENTROPY:
            s_shifted += tl.sum(tl.where(keep, e * (z - m), 0.0), axis=0)
        if WANT_COUNT:
            c += tl.sum(keep.to(tl.int32), axis=0)
        if WANT_TOTAL:
            total += tl.sum(tl.where(valid, e, 0.0), axis=0)
    out = i.to(tl.int64) * num_splits + split
    tl.store(sum_ptr + out, s)
    if WANT_ENTROPY:
        tl.store(sum_shifted_ptr + out, s_shifted)
    if WANT_COUNT:
        tl.store(count_ptr + out, c)
    if WANT_TOTAL:
        tl.store(total_ptr + out, total)
    if HAS_TARGET:
        if split == 0:
            t = tl.load(target_ptr + i)
            z_t = tl.load(row_ptr + tl.maximum(t, 0)).to(tl.float32) * inv_temperature
            tl.store(target_out_ptr + i, tl.where(t >= 0, z_t, 0.0))


def kept_sums(logits: Tensor, local_target: Optional[Tensor], num_valid_cols: int,
              inv_temperature: float, vocab_start: int, row_max: Tensor, z_cut: Tensor,
              id_cut: Tensor, *, rows: Optional[Tensor] = None, want_entropy: bool = False,
              want_count: bool = False, want_total: bool = False) -> KeptSums:
    n = logits.shape[0] if rows is None else rows.numel()
    f32 = dict(dtype=torch.float32, device=logits.device)
    if num_valid_cols == 0 or n == 0:
        return sampling_torch.empty_kept_sums(n, logits.device, local_target is not None, want_entropy,
                                              want_count, want_total)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_n = KEPT_BLOCK_N
    col_blocks = cdiv(num_valid_cols, block_n)
    splits = max(1, min(col_blocks, cdiv(PROGRAMS_PER_SM * _sm_count(logits.device), n)))
    cols_per_split = cdiv(col_blocks, splits) * block_n
    splits = cdiv(num_valid_cols, cols_per_split)
    parts = {name: torch.empty((n, splits), **f32) for name in ("sum", "sum_shifted", "total")}
    count = torch.empty((n, splits), dtype=torch.int32, device=logits.device)
    target = torch.empty(n, **f32)
    dummy_int = id_cut  # never read when the matching flag is off
    _kept_sums_kernel[(n, splits)](
        logits, logits.stride(0), rows if rows is not None else dummy_int,
        local_target.contiguous() if local_target is not None else dummy_int,
        _f32(row_max), _f32(z_cut), id_cut.to(torch.int64).contiguous(),
        parts["sum"], parts["sum_shifted"], count, parts["total"], target,
        num_valid_cols, cols_per_split, splits, float(inv_temperature), vocab_start,
        HAS_ROWS=rows is not None, HAS_TARGET=local_target is not None, WANT_ENTROPY=want_entropy,
        WANT_COUNT=want_count, WANT_TOTAL=want_total, BLOCK_N=block_n, num_warps=KEPT_WARPS,
    )
    return KeptSums(
        sum_exp=parts["sum"].sum(dim=1),
        target=target if local_target is not None else None,
        sum_exp_shifted=parts["sum_shifted"].sum(dim=1) if want_entropy else None,
        count=count.sum(dim=1, dtype=torch.int64) if want_count else None,
        total=parts["total"].sum(dim=1) if want_total else None,
    )


@cached_launch
@triton.jit
def _kept_dlogits_kernel(
    logits_ptr, stride_row, target_ptr, max_ptr, lsexp_ptr, zcut_ptr, idcut_ptr,
    coef_p_ptr, coef_pz_ptr, coef_target_ptr,
    num_cols, num_valid_cols, inv_temperature, vocab_start,
    HAS_PZ: tl.constexpr, HAS_TARGET: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    valid = cols < num_valid_cols
    z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
    z_cut = tl.load(zcut_ptr + row)
    id_cut = tl.load(idcut_ptr + row)
    ids = (cols + vocab_start).to(tl.int64)
    keep = valid & ((z > z_cut) | ((z == z_cut) & (ids <= id_cut)))
    log_q = (z - tl.load(max_ptr + row)) - tl.load(lsexp_ptr + row)
    coef = tl.load(coef_p_ptr + row)
    if HAS_PZ:
        coef = coef + tl.load(coef_pz_ptr + row) * log_q
    grad = tl.where(keep, tl.exp(log_q) * coef, 0.0)
    if HAS_TARGET:
        t = tl.load(target_ptr + row)
        grad += tl.where(cols == t, tl.load(coef_target_ptr + row), 0.0)
    grad = tl.where(valid, grad * inv_temperature, 0.0)
    if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates
        grad = round_bf16_by_hand(grad)
    tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < num_cols)


def kept_dlogits_(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                  vocab_start: int, row_max: Tensor, log_sum_exp: Tensor, z_cut: Tensor, id_cut: Tensor,
                  coef_p: Tensor, coef_pz: Optional[Tensor], coef_target: Optional[Tensor]) -> Tensor:
    n, num_cols = logits.shape
    if n == 0 or num_cols == 0:
        return logits
    if num_valid_cols == 0:
        return logits.zero_()
    if logits.stride(1) != 1:
        return logits.copy_(kept_dlogits_(logits.contiguous(), local_target, num_valid_cols, inv_temperature,
                                          vocab_start, row_max, log_sum_exp, z_cut, id_cut, coef_p, coef_pz,
                                          coef_target))
    coef_p = _f32(coef_p)
    pz, tgt = (None if c is None else _f32(c) for c in (coef_pz, coef_target))
    _kept_dlogits_kernel[(n, cdiv(num_cols, DLOGITS_BLOCK_N))](
        logits, logits.stride(0), local_target.contiguous(), _f32(row_max), _f32(log_sum_exp), _f32(z_cut),
        id_cut.to(torch.int64).contiguous(), coef_p, coef_p if pz is None else pz,
        coef_p if tgt is None else tgt,
        num_cols, num_valid_cols, float(inv_temperature), vocab_start,
        HAS_PZ=pz is not None, HAS_TARGET=tgt is not None, BLOCK_N=DLOGITS_BLOCK_N,
        ROUND_BF16=_interpreting() and logits.dtype == torch.bfloat16, num_warps=DLOGITS_WARPS,
    )
    return logits
