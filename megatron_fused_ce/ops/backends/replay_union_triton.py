"""Replay's kept-set products by tiles, each against the union of what its members' kept sets name
(replay.UnionTiles makes the layouts; no W[uids] or h[rows] copy in memory: the kernels gather).

A tile is BM consecutive "slots" (the last one possibly partial); its union is
`uids[tile_start[t]:tile_start[t + 1]]` (distinct within a tile, in any order, possibly none). A
compact buffer Z of shape [U_cap, BM] holds the products: row g a union entry, column s a slot of
its tile. Z's rows past tile_start[T] (and uids' entries there) are never read or written.

- `_union_logits_kernel`, one program per (tile, p): the forward. Tiles of slots (gathered rows of
  the hidden states, rows[set_rows]), unions of kept columns: Z[g, s] = rows[set_rows[t * BM + s]] .
  weight[uids[g]] for the tile's g, in blocks of BLOCK_U (the tile's p-th, p + P-th, ... block)
  over H in blocks of BLOCK_K, fp32 accumulation, written once in Z's dtype. P = min(cdiv(max_union,
  BLOCK_U), MAX_PROGRAMS_PER_TILE) from a host-known bound on any union: no sync; programs past a
  short union do nothing.
- `_union_sum_rows_kernel`, one program per (tile, block of H): the backward's two products, out[r]
  (+)= sum_g dZ[g, s] src[uids[g]] over the tile's whole union, fp32, one rounding. dX: tiles of
  slots, unions of columns, src the weight, out the slots' rows of dX. dW: tiles of BM columns
  consecutive in the order of their use (replay.UnionTiles.of_columns), unions of the slots whose
  sets name them, src the hidden rows, out dW's rows (the tile's columns). Each
  output row belongs to one tile, so no atomic adds: the fp32 atomics of a dW by tiles of slots (a
  column added once per tile whose union holds it) cost 4x the dX product's time on an H200.

The interpreter (CPU tests) multiplies in fp32 (its bf16 tl.dot is wrong) and rounds fp32 ->
bf16 by hand (its cast truncates); compiled kernels take bf16 / fp16 operands into tl.dot.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import cached_launch, cdiv, interpreting as _interpreting
from .triton_gemm_stats import round_bf16_by_hand

# Launch settings (module-level so that tests can shrink them; not a public API). Every tl.dot
# dimension must stay >= 16. On an H200 (H = 4096, K = 50, 8192 x 4096 x 19008, one call's kernels)
# at BM = 128 with Zipf sets the sums of rows ran slower with SUM_BLOCK_U 128 (2.56 -> 3.24 ms),
# SUM_BLOCK_H 64 (3.19) or 4 warps (2.84); at BM = 64 (blocks of 256 of H), SUM_BLOCK_U 128 (0.77
# -> 0.88 ms of the two sums) or 4 warps (0.85), and 4 stages or blocks of 32 by 5 stages within
# 4 %; LOGITS_BLOCK_U 64 slower (0.25 -> 0.34 ms). With bf16 / fp16 operands they spill no registers on
# sm_90 and fit in shared memory at BM 64 and 128; 4-byte operands take blocks of at most 128 of H
# (SUM_BLOCK_H's stages of fp32 would not fit).
MAX_PROGRAMS_PER_TILE = 16  # P's bound: programs of one tile striding over its union blocks
LOGITS_BLOCK_U = 128  # union entries per block: the [BLOCK_U, BM] accumulator's rows
LOGITS_BLOCK_K = 64  # steps over H
LOGITS_WARPS = 4  # (8: 0.27 -> 0.25 ms at BM 64, Zipf sets, 0.53 -> 0.52 random; 0.09 -> 0.06 at 2048 rows)
LOGITS_STAGES = 3
SUM_BLOCK_U = 64  # the reduction's step over the tile's union
SUM_BLOCK_H = 256  # (128: 1.39 -> 1.25 ms at BM 64 with random sets, the same with Zipf ones)
SUM_WARPS = 8
SUM_STAGES = 3
# fp32 operands (fp32 inputs, or an fp32 dZ with the other side upcast): "tf32x3" keeps about fp32
# accuracy on tensor cores; "ieee" (exact fp32 FMAs) spilled registers in these tiles (Triton 3.9, sm_90)
FP32_PRECISION = "tf32x3"


@triton.jit
def _as_dot_operands(a, b, UPCAST: tl.constexpr):
    """a and b as tl.dot takes them: both in fp32 under the interpreter or where their dtypes differ."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return a, b


@triton.jit
def _to_store(acc, dtype: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """fp32 acc in the stored dtype, one rounding."""
    if BF16_BY_HAND:  # the interpreter's fp32 -> bf16 cast truncates
        acc = round_bf16_by_hand(acc)
    return acc.to(dtype)


@cached_launch
@triton.jit
def _union_logits_kernel(
    x_ptr, stride_x, w_ptr, stride_w, set_rows_ptr, tile_start_ptr, uids_ptr, z_ptr, stride_z, S, H,
    BM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    s = tl.arange(0, BM)
    slot_ok = t * BM + s < S
    row = tl.load(set_rows_ptr + t * BM + s, mask=slot_ok, other=0)
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_start_ptr + t + 1)
    for u0 in range(start + p * BLOCK_U, end, P * BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        u_ok = u < end
        col = tl.load(uids_ptr + u, mask=u_ok, other=0)
        # Z's rows are union entries: acc = W[uids] @ X_tile^T, stored row by row
        acc = tl.zeros([BLOCK_U, BM], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < H
            w = tl.load(w_ptr + col[:, None] * stride_w + kk[None, :], mask=u_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + row[:, None] * stride_x + kk[None, :], mask=slot_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w, x = _as_dot_operands(w, x, UPCAST)
            acc = tl.dot(w, x.T, acc, input_precision=PRECISION)  # (PRECISION: for fp32 operands only)
        tl.store(z_ptr + u[:, None] * stride_z + s[None, :], _to_store(acc, z_ptr.dtype.element_ty, BF16_BY_HAND),
                 mask=u_ok[:, None] & slot_ok[None, :])


@cached_launch
@triton.jit
def _union_sum_rows_kernel(
    dz_ptr, stride_dz, src_ptr, stride_src, tile_start_ptr, uids_ptr, out_rows_ptr, out_ptr, stride_out, S, H,
    BM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, PRECISION: tl.constexpr, HAS_OUT_ROWS: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    s = tl.arange(0, BM)
    slot_ok = t * BM + s < S
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_start_ptr + t + 1)
    acc = tl.zeros([BM, BLOCK_H], dtype=tl.float32)
    for u0 in range(start, end, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        u_ok = u < end
        src_row = tl.load(uids_ptr + u, mask=u_ok, other=0)
        # dZ^T [BM, BLOCK_U]; the entries of slots past S were never written: masked
        dz_t = tl.load(dz_ptr + u[None, :] * stride_dz + s[:, None], mask=slot_ok[:, None] & u_ok[None, :], other=0.0)
        src = tl.load(src_ptr + src_row[:, None] * stride_src + hh[None, :], mask=u_ok[:, None] & h_ok[None, :],
                      other=0.0)
        dz_t, src = _as_dot_operands(dz_t, src, UPCAST)
        acc = tl.dot(dz_t, src, acc, input_precision=PRECISION)
    if HAS_OUT_ROWS:
        out_row = tl.load(out_rows_ptr + t * BM + s, mask=slot_ok, other=0)
    else:
        out_row = t * BM + s
    at = out_ptr + out_row[:, None] * stride_out + hh[None, :]
    ok = slot_ok[:, None] & h_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(at, mask=ok, other=0.0).to(tl.float32)
    tl.store(at, _to_store(acc, out_ptr.dtype.element_ty, BF16_BY_HAND), mask=ok)


def _programs_per_tile(max_union: int, block_u: int) -> int:
    return min(cdiv(max_union, block_u), MAX_PROGRAMS_PER_TILE)


def union_logits(rows: Tensor, weight: Tensor, set_rows: Tensor, tile_start: Tensor, uids: Tensor, out: Tensor,
                 max_union: int, tile_rows: int) -> Tensor:
    """out[g, s] = rows[set_rows[t * BM + s]] . weight[uids[g]] for tile t's union entries g and
    its slots s < S - t * BM (BM = tile_rows), fp32 sums written in out's dtype (rows' or fp32);
    out's other elements are left as they are. out: [U_cap, BM], last dim contiguous; max_union:
    a host-known bound on any tile's union size."""
    count = set_rows.numel()
    tiles = cdiv(count, tile_rows)
    programs = _programs_per_tile(max_union, LOGITS_BLOCK_U)
    if tiles and programs > 0:
        _union_logits_kernel[(tiles, programs)](
            rows, rows.stride(0), weight, weight.stride(0), set_rows, tile_start, uids, out, out.stride(0), count,
            rows.shape[1], BM=tile_rows, BLOCK_U=LOGITS_BLOCK_U, BLOCK_K=LOGITS_BLOCK_K, UPCAST=_interpreting(),
            BF16_BY_HAND=_interpreting() and out.dtype == torch.bfloat16, PRECISION=FP32_PRECISION,
            num_warps=LOGITS_WARPS, num_stages=LOGITS_STAGES)
    return out


def union_sum_rows(dz: Tensor, src: Tensor, tile_start: Tensor, uids: Tensor, out: Tensor, tile_rows: int, *,
                   out_rows: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """out[r(t * BM + s)] (+)= sum over tile t's union entries g of dz[g, s] * src[uids[g]] (BM =
    tile_rows; r: `out_rows`, or the slot itself), fp32 sums rounded once to out's dtype, added to
    what out holds with `accumulate` (else overwritten; zeros for a tile whose union is empty).
    The tiles are the slots [0, S): S = out_rows' length, or out's rows. Two uses: dX of the slots'
    rows (src the weight, uids columns, out_rows the slots' rows) and dW of blocks of columns (src
    the hidden rows, uids rows, out_rows the columns in their tiles' order, out the weight's
    gradient). Each output row is written by one
    program per H block: no atomics (a row that several slots name may only be added zeros:
    replay's padding slots)."""
    count = out.shape[0] if out_rows is None else out_rows.numel()
    hidden = out.shape[1]
    tiles = cdiv(count, tile_rows)
    block_h = SUM_BLOCK_H if dz.element_size() == 2 and src.element_size() == 2 else min(SUM_BLOCK_H, 128)
    if tiles and hidden:
        _union_sum_rows_kernel[(tiles, cdiv(hidden, block_h))](
            dz, dz.stride(0), src, src.stride(0), tile_start, uids, out if out_rows is None else out_rows, out,
            out.stride(0), count, hidden, BM=tile_rows, BLOCK_U=SUM_BLOCK_U, BLOCK_H=block_h,
            UPCAST=_interpreting() or dz.dtype != src.dtype,
            BF16_BY_HAND=_interpreting() and out.dtype == torch.bfloat16, PRECISION=FP32_PRECISION,
            HAS_OUT_ROWS=out_rows is not None, ACCUMULATE=accumulate, num_warps=SUM_WARPS, num_stages=SUM_STAGES)
    return out


# ---------------------------------------------------------------------------------------------
# The tiles' layout (replay.UnionTiles defines it in torch): the (tile, member) pairs the entries
# name, marked in a table, numbered by its prefix sum. Three launches and torch's cumsum; dW's
# tiles by columns first order the columns by use (two launches and torch's sort).
# ---------------------------------------------------------------------------------------------
LAYOUT_BLOCK = 1024


@triton.jit
def _pair_of_entry(slot_ptr, col_ptr, valid_ptr, rank_ptr, e, inside, members, width, BY_COLUMNS: tl.constexpr):
    """(whether entry e is valid, its (tile, member) pair's index in the table, its place within the
    tile); by columns, a column stands at its place in the columns' order (`rank`)."""
    ok = inside & (tl.load(valid_ptr + e, mask=inside, other=0) != 0)
    slot = tl.load(slot_ptr + e, mask=ok, other=0)
    col = tl.load(col_ptr + e, mask=ok, other=0)
    if BY_COLUMNS:
        col = tl.load(rank_ptr + col, mask=ok, other=0)
        return ok, (col // width) * members + slot, col % width
    return ok, (slot // width) * members + col, slot % width


@cached_launch
@triton.jit
def _column_use_kernel(col_ptr, valid_ptr, counts_ptr, total, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = (e < total) & (tl.load(valid_ptr + e, mask=e < total, other=0) != 0)
    col = tl.load(col_ptr + e, mask=ok, other=0)
    tl.atomic_add(counts_ptr + col, tl.full([BLOCK], 1, tl.int32), mask=ok, sem="relaxed")


@cached_launch
@triton.jit
def _rank_kernel(order_ptr, rank_ptr, count, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < count
    tl.store(rank_ptr + tl.load(order_ptr + i, mask=ok, other=0), i, mask=ok)


def columns_by_use(col: Tensor, valid: Tensor, num_cols: int) -> tuple:
    """replay.columns_by_use's (order, rank), rank by column (the layout kernels read it): the valid
    entries counted per column with integer atomics (exact, in any order), torch's stable sort."""
    total = valid.numel()
    counts = torch.zeros(num_cols, dtype=torch.int32, device=col.device)
    if total:
        _column_use_kernel[(cdiv(total, LAYOUT_BLOCK),)](col, valid.view(torch.uint8), counts, total,
                                                         BLOCK=LAYOUT_BLOCK, num_warps=4)
    order = torch.sort(counts, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    _rank_kernel[(cdiv(num_cols, LAYOUT_BLOCK),)](order, rank, num_cols, BLOCK=LAYOUT_BLOCK, num_warps=4)
    return order, rank


@cached_launch
@triton.jit
def _union_name_kernel(slot_ptr, col_ptr, valid_ptr, rank_ptr, named_ptr, total, members, width,
                       BY_COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok, pair, _ = _pair_of_entry(slot_ptr, col_ptr, valid_ptr, rank_ptr, e, e < total, members, width, BY_COLUMNS)
    tl.store(named_ptr + pair, tl.full([BLOCK], 1, tl.int32), mask=ok)  # (entries of one pair store alike)


@cached_launch
@triton.jit
def _union_ids_kernel(named_ptr, count_ptr, values_ptr, uids_ptr, tile_start_ptr, pairs, members,
                      HAS_VALUES: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < pairs
    named = tl.load(named_ptr + i, mask=inside, other=0) != 0
    count = tl.load(count_ptr + i, mask=inside, other=0).to(tl.int64)
    member = i % members
    if HAS_VALUES:  # (dW's tiles: a slot's row of the hidden states)
        member = tl.load(values_ptr + member, mask=named, other=0)
    tl.store(uids_ptr + count - 1, member, mask=named)
    # a tile's last pair holds the count of the unions up to its end: the next tile's start
    tl.store(tile_start_ptr + (i + 1) // members, count, mask=inside & ((i + 1) % members == 0))
    tl.store(tile_start_ptr + i, tl.zeros([BLOCK], tl.int64), mask=i == 0)


@cached_launch
@triton.jit
def _union_place_kernel(slot_ptr, col_ptr, valid_ptr, rank_ptr, count_ptr, place_ptr, total, members, width,
                        BY_COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = e < total
    ok, pair, within = _pair_of_entry(slot_ptr, col_ptr, valid_ptr, rank_ptr, e, inside, members, width,
                                      BY_COLUMNS)
    count = tl.load(count_ptr + pair, mask=ok, other=0).to(tl.int64)
    tl.store(place_ptr + e, tl.where(ok, (count - 1) * width + within, -1), mask=inside)


def union_layout(slot: Tensor, col: Tensor, valid: Tensor, set_rows: Tensor, rank: Optional[Tensor], tiles: int,
                 members: int, width: int, capacity: int) -> tuple:
    """replay.UnionTiles' (tile_start, uids, place) of the entries (their slot, col and valid, as
    replay.KeptEntries holds them): tiles of `width` slots whose members are columns, or given the
    columns' `rank` (their places in columns_by_use's order) tiles of `width` places of that order
    whose members are slots (uids: their set_rows)."""
    by_columns = rank is not None
    total, pairs, device = valid.numel(), tiles * members, valid.device
    words = torch.empty(tiles + 1 + capacity + 1 + total, dtype=torch.int64, device=device)
    tile_start, uids, place = words[:tiles + 1], words[tiles + 1:tiles + capacity + 2], words[tiles + capacity + 2:]
    named = torch.zeros(pairs, dtype=torch.int32, device=device)  # (replay takes tiles with a slot: pairs > 0)
    valid = valid.view(torch.uint8)
    if total:
        _union_name_kernel[(cdiv(total, LAYOUT_BLOCK),)](slot, col, valid, rank if by_columns else col, named, total,
                                                         members, width, BY_COLUMNS=by_columns, BLOCK=LAYOUT_BLOCK,
                                                         num_warps=4)
    count = torch.cumsum(named, 0, dtype=torch.int32)
    _union_ids_kernel[(cdiv(pairs, LAYOUT_BLOCK),)](named, count, set_rows, uids, tile_start, pairs, members,
                                                    HAS_VALUES=by_columns, BLOCK=LAYOUT_BLOCK, num_warps=4)
    if total:
        _union_place_kernel[(cdiv(total, LAYOUT_BLOCK),)](slot, col, valid, rank if by_columns else col, count, place,
                                                          total, members, width, BY_COLUMNS=by_columns,
                                                          BLOCK=LAYOUT_BLOCK, num_warps=4)
    return tile_start, uids, place
