"""Replay's kept-set math in Triton: replay_torch.py's `kept_stats` and `kept_grads` (same
arguments, same results up to the order of fp32 sums; tests/test_sampling_mask_triton.py checks
them against it, on CPU under TRITON_INTERPRET=1).

No W[U] copy, no logits block, no per-tile host work: each kernel reads the kept ids from the
mask's CSR and gathers the weight rows itself.

- `_kept_stats_kernel`, one program per row with a set: its entries in blocks of BLOCK_E, each
  entry's dot h_row . W_id over H in blocks of BLOCK_H (fp32), rounded to the input dtype as the
  chunk GEMM's logits are, then an online max / sum exp / entropy sum over the blocks and the
  label's z; it writes each entry's z for the backward.
- `_kept_input_grad_kernel`, one program per (row with a set, block of H): dX = sum_e d_e W_id.
- `_kept_weight_grad_kernel`: the entries sorted by column (one device sort, no host sync), one
  program per (block of sorted entries, block of H): d_e h_row for each entry, a segmented scan
  that sums the entries of one column, one fp32 atomic add per column and block into dW (the
  op's fp32 buffer or Megatron's main_grad). A frequent id (in most sets: Zipf) costs one add per
  block of its entries, not one per entry.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import ShardStats
from .triton_common import interpreting as _interpreting
from .triton_gemm_stats import round_bf16_by_hand

# Launch settings (module-level so that tests can shrink them; not a public API).
STATS_BLOCK_E = 32
STATS_BLOCK_H = 128
GRAD_BLOCK_E = 32
GRAD_BLOCK_H = 128
WARPS = 4

_ROUND = {None: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _dots(h_ptr, stride_h, row, w_ptr, stride_w, col, valid, H, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 [BLOCK_E]: h_row . W_col of each entry (0 where not valid)."""
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        h_ok = hh < H
        x = tl.load(h_ptr + row * stride_h + hh, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col[:, None] * stride_w + hh[None, :], mask=valid[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


@triton.jit
def _kept_stats_kernel(
    h_ptr, stride_h, w_ptr, stride_w, ids_ptr, set_rows_ptr, starts_ptr, ends_ptr, labels_ptr,
    z_ptr, max_ptr, sum_ptr, target_ptr, shifted_ptr,
    H, vocab_start, num_valid_cols, inv_temperature,
    ROUND: tl.constexpr, BF16_BY_HAND: tl.constexpr, WANT_ENTROPY: tl.constexpr, STORE_Z: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(set_rows_ptr + i)
    start = tl.load(starts_ptr + i)
    end = tl.load(ends_ptr + i)
    label = tl.load(labels_ptr + i)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    se = tl.zeros([], dtype=tl.float32)
    t = tl.zeros([], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < end
        ids = tl.load(ids_ptr + e, mask=inside, other=-1)
        col = ids - vocab_start
        valid = inside & (col >= 0) & (col < num_valid_cols)
        acc = _dots(h_ptr, stride_h, row, w_ptr, stride_w, col, valid, H, BLOCK_E, BLOCK_H)
        if BF16_BY_HAND:  # the interpreter's fp32 -> bf16 cast truncates
            acc = round_bf16_by_hand(acc)
        elif ROUND == 1:
            acc = acc.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            acc = acc.to(tl.float16).to(tl.float32)
        z = acc * inv_temperature
        if STORE_Z:
            tl.store(z_ptr + e, tl.where(valid, z, 0.0), mask=inside)
        new_m = tl.maximum(m, tl.max(tl.where(valid, z, float("-inf")), axis=0))
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        rescale = tl.exp(m - safe)  # 0 while m is -inf
        shifted = tl.where(valid, z - safe, 0.0)
        p = tl.where(valid, tl.exp(shifted), 0.0)
        if WANT_ENTROPY:
            # sum exp(z - m')(z - m') = e^(m - m') (sum exp(z - m)(z - m) + (m - m') sum exp(z - m))
            moved = tl.where(m == float("-inf"), 0.0, m - safe)
            se = rescale * (se + moved * s) + tl.sum(p * shifted, axis=0)
        s = s * rescale + tl.sum(p, axis=0)
        t += tl.sum(tl.where(valid & (ids == label), z, 0.0), axis=0)
        m = new_m
    tl.store(max_ptr + i, m)
    tl.store(sum_ptr + i, s)
    tl.store(target_ptr + i, t)
    if WANT_ENTROPY:
        tl.store(shifted_ptr + i, se)


def kept_stats(rows: Tensor, weight: Tensor, entries, inv_temperature: float, round_to: Optional[torch.dtype],
               want_entropy: bool, want_z: bool, max_elements: int):
    """replay_torch.kept_stats in one launch (max_elements: unused, nothing is gathered)."""
    count = entries.set_rows.numel()
    f32 = dict(dtype=torch.float32, device=rows.device)
    row_max, sum_exp, target = torch.empty(count, **f32), torch.empty(count, **f32), torch.empty(count, **f32)
    shifted = torch.empty(count, **f32) if want_entropy else row_max
    z = torch.empty(entries.ids.numel(), **f32) if want_z else row_max
    if want_z:  # entries of positions without a labelled row are never visited
        z.zero_()
    if count:
        by_hand = _interpreting() and round_to is torch.bfloat16
        _kept_stats_kernel[(count,)](
            rows, rows.stride(0), weight, weight.stride(0), entries.ids, entries.set_rows, entries.starts,
            entries.ends, entries.set_labels, z, row_max, sum_exp, target, shifted,
            rows.shape[1], entries.vocab_start, entries.num_valid_cols, float(inv_temperature),
            ROUND=_ROUND.get(round_to, 0), BF16_BY_HAND=by_hand, WANT_ENTROPY=want_entropy, STORE_Z=want_z,
            BLOCK_E=STATS_BLOCK_E, BLOCK_H=STATS_BLOCK_H, num_warps=WARPS)
    stats = ShardStats(max=row_max, sum_exp=sum_exp, target=target, sum_exp_shifted=shifted if want_entropy else None)
    return stats, z if want_z else None


@triton.jit
def _kept_input_grad_kernel(
    w_ptr, stride_w, ids_ptr, set_rows_ptr, starts_ptr, ends_ptr, d_ptr, dx_ptr, stride_dx,
    H, vocab_start, num_valid_cols, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    row = tl.load(set_rows_ptr + i)
    start = tl.load(starts_ptr + i)
    end = tl.load(ends_ptr + i)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < end
        col = tl.load(ids_ptr + e, mask=inside, other=-1) - vocab_start
        valid = inside & (col >= 0) & (col < num_valid_cols)
        d = tl.load(d_ptr + e, mask=valid, other=0.0)
        w = tl.load(w_ptr + col[:, None] * stride_w + hh[None, :], mask=valid[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * d[:, None], axis=0)
    # added: the plain pass left zeros in a set row; padding slots add zeros to a row without a set
    at = dx_ptr + row * stride_dx + hh
    old = tl.load(at, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(at, (old + acc).to(dx_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _segmented_sum(a_value, a_start, b_value, b_start):
    """Scan step of a sum that restarts where b starts a segment."""
    return tl.where(b_start != 0, b_value, a_value + b_value), a_start | b_start


@triton.jit
def _kept_weight_grad_kernel(
    h_ptr, stride_h, cols_ptr, rows_ptr, d_ptr, dw_ptr, stride_dw, num_entries, H, num_cols,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    inside = e < num_entries
    col = tl.load(cols_ptr + e, mask=inside, other=num_cols)  # sorted; num_cols: not a column here
    previous = tl.load(cols_ptr + e - 1, mask=inside & (e > tl.program_id(0) * BLOCK_E), other=-1)
    following = tl.load(cols_ptr + e + 1, mask=(e + 1 < num_entries) & (tl.arange(0, BLOCK_E) + 1 < BLOCK_E),
                        other=-1)
    used = inside & (col < num_cols)
    row = tl.load(rows_ptr + e, mask=used, other=0)
    d = tl.load(d_ptr + e, mask=used, other=0.0)
    x = tl.load(h_ptr + row[:, None] * stride_h + hh[None, :], mask=used[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)
    starts = tl.broadcast_to((col != previous).to(tl.int32)[:, None], (BLOCK_E, BLOCK_H))
    sums, _ = tl.associative_scan((x * d[:, None], starts), 0, _segmented_sum)
    last = used & (col != following)  # a column's last entry in this block holds its sum
    tl.atomic_add(dw_ptr + col[:, None] * stride_dw + hh[None, :], sums, mask=last[:, None] & h_ok[None, :])


def kept_grads(rows: Tensor, weight: Tensor, entries, d: Tensor, dx_rows: Optional[Tensor], dw_out: Optional[Tensor],
               max_elements: int) -> None:
    """replay_torch.kept_grads: dX rows of the set rows added, dW rows added into the fp32
    dw_out (max_elements: unused)."""
    count, hidden = entries.set_rows.numel(), rows.shape[1]
    d = d.contiguous()
    if dx_rows is not None and count:
        _kept_input_grad_kernel[(count, triton.cdiv(hidden, GRAD_BLOCK_H))](
            weight, weight.stride(0), entries.ids, entries.set_rows, entries.starts, entries.ends, d, dx_rows,
            dx_rows.stride(0), hidden, entries.vocab_start, entries.num_valid_cols,
            BLOCK_E=GRAD_BLOCK_E, BLOCK_H=GRAD_BLOCK_H, num_warps=WARPS)
    total = entries.ids.numel()
    if dw_out is not None and count and total:
        num_cols = weight.shape[0]
        cols, order = torch.sort(torch.where(entries.valid, entries.col, num_cols))
        _kept_weight_grad_kernel[(triton.cdiv(total, GRAD_BLOCK_E), triton.cdiv(hidden, GRAD_BLOCK_H))](
            rows, rows.stride(0), cols, entries.row_of_entry().index_select(0, order), d.index_select(0, order),
            dw_out, dw_out.stride(0), total, hidden, num_cols,
            BLOCK_E=GRAD_BLOCK_E, BLOCK_H=GRAD_BLOCK_H, num_warps=WARPS)
