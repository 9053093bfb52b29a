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
  (+)= sum_g dZ[g, s] src[uids[g]] over the tile's whole union (as src^T dZ: the tile's slots the
  MMA's narrow side), fp32, one rounding. dX: tiles of
  slots, unions of columns, src the weight, out the slots' rows of dX. dW: tiles of BM columns
  consecutive in the order of their use (replay.UnionTiles.of_columns), unions of the slots whose
  sets name them, src the hidden rows, out dW's rows (the tile's columns). Each
  output row belongs to one tile, so no atomic adds: the fp32 atomics of a dW by tiles of slots (a
  column added once per tile whose union holds it) cost 4x the dX product's time on an H200.

The interpreter (CPU tests) multiplies in fp32 (its bf16 tl.dot is wrong) and rounds fp32 ->
bf16 by hand (its cast truncates); compiled kernels take bf16 / fp16 operands into tl.dot.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import cached_launch, cdiv, interpreting as _interpreting, next_power_of_2
from .triton_gemm_stats import round_bf16_by_hand

# Launch settings (module-level so that tests can shrink them; not a public API). Every tl.dot
# dimension must stay >= 16. Measured on an H200 at BM = 32 (replay's tiles, K = 50), each product
# alone from its captured arguments (CUDA events, L2 flushed before each), the layouts of a step
# at 2048 x 4096 x 19008 / 8192 x 4096 x 19008 with Zipf / random sets:
# - the logits with 256 union entries a block and 8 warps (was 128 and 4): 96 -> 62 / 134 -> 125 us
#   at 2048 rows, 257 -> 245 / 449 -> 445 at 8192 (2048 x 4096 x 32064 random 154 -> 136; fewer
#   programs reading each tile's hidden rows). 512 entries won with random sets only, 128-wide
#   steps over H, 4 stages or 8 / 32 programs a tile were level or slower.
# - the sums with 32 union entries a step and 4 warps (was 64 and 8): dX 86 -> 78 / 142 -> 132 at
#   2048 rows, 291 -> 272 / 497 -> 477 at 8192; dW by tiles of columns 175 -> 130 / 225 -> 158 at
#   2048 rows with 2 stages (141 / 176 with 3), 421 -> 412 / 544 -> 492 at 8192, 2048 x 4096 x 32064
#   random 290 -> 192: its unions are mostly a few dozen rows (a column named by few sets), where
#   a shallower pipeline leaves room for more programs on an SM; dX's are the tile's whole union
#   (3 stages: 2 were 1-3 % slower). 16 entries a step, 2 warps, 64- or 256-wide blocks of H slower.
# - the order of the sums' programs: dW's tiles of columns come most-used first, and with Zipf
#   sets the first tiles' unions hold nearly every row (the longest programs): taken by groups of
#   32 tiles, each group's blocks of H together, those start first: 136 -> 111 us at 2048 rows,
#   424 -> 338 at 8192, 4096 x 4096 x 32064 264 -> 216; random sets within 2 % at 2048 rows, +7 %
#   at 8192 (groups of 1 tile: +12 %, the hidden rows' blocks of H then less often in L2). dX's
#   tiles are alike: by blocks of H (a block of W's columns in L2 for every tile), 4-10 % ahead.
# - an empty union's rows: where the sums add (into main_grad's fp32 dW, or after the plain pass)
#   they are neither read nor written: dW into an fp32 sum with Zipf sets 223 -> 189 us at 2048 x
#   4096 x 19008 (386 of 594 tiles of columns with a union), 332 -> 249 at 2048 x 4096 x 32064 (479
#   of 1002), random sets within 1 %. Where they overwrite, the zeros cost nothing seen: dW zeroed
#   first and those programs idle made a step slower (2048 x 4096 x 19008, one graph a step: 342 ->
#   371 us with Zipf sets, the fill 47 us, the sums 183 -> 181).
# With bf16 / fp16 operands no register spills on sm_90; 4-byte operands' stages fit in shared
# memory at these blocks.
MAX_PROGRAMS_PER_TILE = 16  # P's bound: programs of one tile striding over its union blocks
LOGITS_BLOCK_U = 256  # union entries per block: the [BLOCK_U, BM] accumulator's rows
LOGITS_BLOCK_K = 64  # steps over H
LOGITS_WARPS = 8
LOGITS_STAGES = 3
SUM_BLOCK_U = 32  # the reduction's step over the tile's union
SUM_BLOCK_H = 128
SUM_WARPS = 4
SUM_STAGES = 3  # dX: the slots' tiles
SUM_STAGES_BY_COLUMNS = 2  # dW: tiles of columns
SUM_GROUP_TILES = 0  # dX: the programs by blocks of H
SUM_GROUP_TILES_BY_COLUMNS = 32  # dW: by groups of 32 tiles of columns
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
    BF16_BY_HAND: tl.constexpr, PRECISION: tl.constexpr, HAS_SET_ROWS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    s = tl.arange(0, BM)
    slot_ok = t * BM + s < S
    if HAS_SET_ROWS:
        row = tl.load(set_rows_ptr + t * BM + s, mask=slot_ok, other=0)
    else:  # (the slots are the rows)
        row = t * BM + s
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
    GROUP_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles = tl.cdiv(S, BM)
    if GROUP_TILES == 0:  # by blocks of H: every tile's first block, then every tile's second, ...
        t = (pid % tiles).to(tl.int64)
        block_h = pid // tiles
    else:  # by groups of GROUP_TILES tiles, each group's blocks of H before the next group's
        in_group = GROUP_TILES * tl.cdiv(H, BLOCK_H)
        first = (pid // in_group) * GROUP_TILES
        size = tl.minimum(tiles - first, GROUP_TILES)
        t = (first + (pid % in_group) % size).to(tl.int64)
        block_h = (pid % in_group) // size
    hh = block_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    s = tl.arange(0, BM)
    slot_ok = t * BM + s < S
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_start_ptr + t + 1)
    # the product transposed, [BLOCK_H, BM] = src^T dZ: a tile's BM slots (32) are the MMA's N,
    # the block of H its M (with the slots as M, one call's sums at 8192 x 4096 x 19008 took 976
    # against 752 us with Zipf sets, 1483 against 1072 with random ones, on an H200)
    acc_t = tl.zeros([BLOCK_H, BM], dtype=tl.float32)
    for u0 in range(start, end, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        u_ok = u < end
        src_row = tl.load(uids_ptr + u, mask=u_ok, other=0)
        src = tl.load(src_ptr + src_row[:, None] * stride_src + hh[None, :], mask=u_ok[:, None] & h_ok[None, :],
                      other=0.0)
        # dZ [BLOCK_U, BM]; the entries of slots past S were never written: masked
        dz = tl.load(dz_ptr + u[:, None] * stride_dz + s[None, :], mask=u_ok[:, None] & slot_ok[None, :], other=0.0)
        dz, src = _as_dot_operands(dz, src, UPCAST)
        acc_t = tl.dot(tl.trans(src), dz, acc_t, input_precision=PRECISION)
    acc = tl.trans(acc_t)
    if HAS_OUT_ROWS:
        out_row = tl.load(out_rows_ptr + t * BM + s, mask=slot_ok, other=0)
    else:
        out_row = t * BM + s
    at = out_ptr + out_row[:, None] * stride_out + hh[None, :]
    ok = slot_ok[:, None] & h_ok[None, :]
    if ACCUMULATE:  # an empty union adds nothing: its rows neither read nor written
        ok = ok & (tl.full([BM, BLOCK_H], 0, tl.int64) + end > start)  # (a block: the interpreter's masks)
        acc += tl.load(at, mask=ok, other=0.0).to(tl.float32)
    tl.store(at, _to_store(acc, out_ptr.dtype.element_ty, BF16_BY_HAND), mask=ok)


def _programs_per_tile(max_union: int, block_u: int) -> int:
    return min(cdiv(max_union, block_u), MAX_PROGRAMS_PER_TILE)


def union_logits(rows: Tensor, weight: Tensor, set_rows: Optional[Tensor], tile_start: Tensor, uids: Tensor,
                 out: Tensor, max_union: int, tile_rows: int) -> Tensor:
    """out[g, s] = rows[set_rows[t * BM + s]] . weight[uids[g]] for tile t's union entries g and
    its slots s < S - t * BM (BM = tile_rows; S the slots: set_rows' length, or with `set_rows`
    None the rows, each slot its row), fp32 sums written in out's dtype (rows' or fp32); out's
    other elements are left as they are. out: [U_cap, BM], last dim contiguous; max_union: a
    host-known bound on any tile's union size."""
    count = rows.shape[0] if set_rows is None else set_rows.numel()
    tiles = cdiv(count, tile_rows)
    programs = _programs_per_tile(max_union, LOGITS_BLOCK_U)
    if tiles and programs > 0:
        interpreted = _interpreting()  # (an environment read: host time, once)
        _union_logits_kernel[(tiles, programs)](
            rows, rows.stride(0), weight, weight.stride(0), rows if set_rows is None else set_rows, tile_start, uids,
            out, out.stride(0), count, rows.shape[1], BM=tile_rows, BLOCK_U=LOGITS_BLOCK_U, BLOCK_K=LOGITS_BLOCK_K,
            UPCAST=interpreted, BF16_BY_HAND=interpreted and out.dtype == torch.bfloat16,
            PRECISION=FP32_PRECISION, HAS_SET_ROWS=set_rows is not None, num_warps=LOGITS_WARPS,
            num_stages=LOGITS_STAGES)
    return out


def union_sum_rows(dz: Tensor, src: Tensor, tile_start: Tensor, uids: Tensor, out: Tensor, tile_rows: int, *,
                   out_rows: Optional[Tensor] = None, accumulate: bool = False, by_columns: bool = False) -> Tensor:
    """out[r(t * BM + s)] (+)= sum over tile t's union entries g of dz[g, s] * src[uids[g]] (BM =
    tile_rows; r: `out_rows`, or the slot itself), fp32 sums rounded once to out's dtype, added to
    what out holds with `accumulate` (a tile whose union is empty leaves its rows unread and
    unwritten; else overwritten, zeros for such a tile).
    The tiles are the slots [0, S): S = out_rows' length, or out's rows. Two uses: dX of the slots'
    rows (src the weight, uids columns, out_rows the slots' rows) and dW of blocks of columns (src
    the hidden rows, uids rows, out_rows the columns in their tiles' order, out the weight's
    gradient; `by_columns`: its launch settings). Each output row is written by one
    program per H block: no atomics (a row that several slots name may only be added zeros:
    replay's padding slots)."""
    count = out.shape[0] if out_rows is None else out_rows.numel()
    hidden = out.shape[1]
    tiles = cdiv(count, tile_rows)
    if tiles and hidden:
        group = SUM_GROUP_TILES_BY_COLUMNS if by_columns else SUM_GROUP_TILES
        interpreted = _interpreting()
        _union_sum_rows_kernel[(tiles * cdiv(hidden, SUM_BLOCK_H),)](
            dz, dz.stride(0), src, src.stride(0), tile_start, uids, out if out_rows is None else out_rows, out,
            out.stride(0), count, hidden, BM=tile_rows, BLOCK_U=SUM_BLOCK_U, BLOCK_H=SUM_BLOCK_H,
            UPCAST=interpreted or dz.dtype != src.dtype,
            BF16_BY_HAND=interpreted and out.dtype == torch.bfloat16, PRECISION=FP32_PRECISION,
            HAS_OUT_ROWS=out_rows is not None, ACCUMULATE=accumulate, num_warps=SUM_WARPS,
            GROUP_TILES=group, num_stages=SUM_STAGES_BY_COLUMNS if by_columns else SUM_STAGES)
    return out


# ---------------------------------------------------------------------------------------------
# The tiles' layouts (replay.UnionTiles defines one in torch): the (tile, member) pairs the entries
# name, flagged in a byte table, packed into words of 32 bits and numbered by a prefix sum of the
# words' counts (the pack launch's: each block of words adds the blocks before it, read back from
# their published sums) and the bits below a pair in its word; the entries then write their places,
# their pairs' union ids (every entry of a pair writes the same) and the tiles' starts. Three
# launches and one zero fill, for one layout or for both of a call's (the slots' and dW's columns':
# their tables end to end, the second numbered from the first's total). (An int32 table and its
# prefix sum read and wrote 20 bytes a pair: the two layouts of a call at 8192 x 4096 x 19008 with
# tiles of 32 took 155 us of kernels, 65 with the bits and torch's cumsum, on an H200; bits set by
# atomic or-s stalled on Zipf sets' shared pairs.) dW's tiles by columns first order the columns by
# use (two launches, three where the entries are counted here: columns_by_use).
# ---------------------------------------------------------------------------------------------
# Entries a program of the layout launches, words a block of the pack launch. On an H200 (a replay
# step at 2048 and 8192 x 4096 x 19008 / 32064, K = 50, torch.profiler): the name and place
# launches 21 -> 12 us at 2048 rows and 47 -> 29 at 8192 with 256 entries against 1024; the pack
# 10-15 -> 7-10 and 27 -> 17 us with 128 words against 64 (32: slower).
LAYOUT_BLOCK = 256
PACK_BLOCK_WORDS = 128
# columns_by_use: columns a block (a power of 2; the order is the same for any): at least
# ORDER_BLOCK, more where the columns would make more than ORDER_MAX_BLOCKS blocks (every block
# reads every block's histogram). Each block sorts its keys: 2048 columns a block made the order
# launch 18 us at 19008-32064 columns, 256 made it 4 (one H200). Classes of use: replay.USE_CLASSES.
# The interpreter runs a sort network step by step (about a second a program at 1024 keys): small
# blocks there.
ORDER_BLOCK = 256
ORDER_MAX_BLOCKS = 128
INTERPRETED_ORDER_BLOCK = 64
USE_CLASSES = 32


@triton.jit
def _pair_of_entry(slot_ptr, col_ptr, valid_ptr, rank_ptr, e, inside, members, width, BY_COLUMNS: tl.constexpr):
    """(whether entry e is valid, its (tile, member) pair's index in the table, its member, its
    place within the tile); by columns, a column stands at its place in the columns' order (`rank`)."""
    ok = inside & (tl.load(valid_ptr + e, mask=inside, other=0) != 0)
    slot = tl.load(slot_ptr + e, mask=ok, other=0)
    col = tl.load(col_ptr + e, mask=ok, other=0)
    if BY_COLUMNS:
        col = tl.load(rank_ptr + col, mask=ok, other=0)
        return ok, (col // width) * members + slot, slot, col % width
    return ok, (slot // width) * members + col, col, slot % width


@cached_launch
@triton.jit
def _column_use_kernel(col_ptr, valid_ptr, counts_ptr, total, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = (e < total) & (tl.load(valid_ptr + e, mask=e < total, other=0) != 0)
    col = tl.load(col_ptr + e, mask=ok, other=0)
    tl.atomic_add(counts_ptr + col, tl.full([BLOCK], 1, tl.int32), mask=ok, sem="relaxed")


@triton.jit
def _use_class(count, CLASSES: tl.constexpr):
    """replay.use_class: from the float32 count's exponent and first mantissa bit."""
    classes = (count.to(tl.float32).to(tl.int32, bitcast=True) >> 22) - 253
    return tl.where(count > 0, tl.minimum(classes, CLASSES - 1), 0)


@cached_launch
@triton.jit
def _use_histogram_kernel(counts_ptr, table_ptr, num_cols, CLASSES: tl.constexpr, BLOCK: tl.constexpr):
    """table[b, c]: the columns of block b in class c."""
    b = tl.program_id(0)
    c = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = c < num_cols
    classes = _use_class(tl.load(counts_ptr + c, mask=ok, other=0), CLASSES)  # (past the columns: class 0)
    histogram = tl.histogram(classes, CLASSES)
    histogram -= tl.where(tl.arange(0, CLASSES) == 0, tl.sum((~ok).to(tl.int32), axis=0), 0)
    tl.store(table_ptr + b * CLASSES + tl.arange(0, CLASSES), histogram)


@cached_launch
@triton.jit
def _use_order_kernel(counts_ptr, table_ptr, order_ptr, rank_ptr, num_cols, blocks, CLASSES: tl.constexpr,
                      BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """Block b's columns at their places: its (class, column) keys sorted, a key at position p
    going to base[class] + p, where base[c] = the columns of classes above c + those of class c in
    the blocks before b - those of classes above c in b (every block's histogram read here)."""
    b = tl.program_id(0)
    j = tl.arange(0, BLOCKS)[:, None]
    k = tl.arange(0, CLASSES)
    table = tl.load(table_ptr + j * CLASSES + k[None, :], mask=j < blocks, other=0)
    total = tl.sum(table, axis=0)
    mine = tl.sum(tl.where(j == b, table, 0), axis=0)
    base = (tl.sum(total, axis=0) - tl.cumsum(total, 0)) + tl.sum(tl.where(j < b, table, 0), axis=0) - (
        tl.sum(mine, axis=0) - tl.cumsum(mine, 0))
    base_ptr = table_ptr + (blocks + b) * CLASSES  # (this block's row past the histograms)
    tl.store(base_ptr + k, base)
    tl.debug_barrier()  # (the row stored before its threads read it)
    i = tl.arange(0, BLOCK)
    c = b.to(tl.int64) * BLOCK + i
    ok = c < num_cols
    classes = tl.where(ok, _use_class(tl.load(counts_ptr + c, mask=ok, other=0), CLASSES), -1)
    ordered = tl.sort(((CLASSES - 1 - classes) << LOG_BLOCK) | i, 0)  # (past the columns: last)
    rank_class = CLASSES - 1 - (ordered >> LOG_BLOCK)
    valid = rank_class >= 0
    col = b.to(tl.int64) * BLOCK + (ordered & (BLOCK - 1))
    place = tl.load(base_ptr + rank_class, mask=valid, other=0).to(tl.int64) + i
    tl.store(rank_ptr + col, place, mask=valid)
    tl.store(order_ptr + place, col, mask=valid)


def columns_by_use(col: Tensor, valid: Tensor, num_cols: int, counts: Optional[Tensor] = None) -> tuple:
    """replay.columns_by_use's (order, rank), rank by column (the layout kernels read it): the valid
    entries counted per column with integer atomics (exact, in any order; or int32 `counts` given,
    kept_layout's), then two launches over blocks of ORDER_BLOCK columns (their histograms of
    classes; each block's places). torch's sort of the counts and the inverse took 16 launches."""
    device = col.device
    if counts is None:
        counts = torch.zeros(num_cols, dtype=torch.int32, device=device)
        total = valid.numel()
        if total:
            _column_use_kernel[(cdiv(total, LAYOUT_BLOCK),)](col, valid.view(torch.uint8), counts, total,
                                                             BLOCK=LAYOUT_BLOCK, num_warps=4)
    block = (min(ORDER_BLOCK, INTERPRETED_ORDER_BLOCK) if _interpreting()
             else max(ORDER_BLOCK, next_power_of_2(cdiv(num_cols, ORDER_MAX_BLOCKS))))
    blocks = cdiv(num_cols, block)
    table = torch.empty(2 * blocks * USE_CLASSES, dtype=torch.int32, device=device)  # histograms, bases
    order_rank = torch.empty(2 * num_cols, dtype=torch.int64, device=device)
    order, rank = order_rank[:num_cols], order_rank[num_cols:]
    if blocks:
        _use_histogram_kernel[(blocks,)](counts, table, num_cols, CLASSES=USE_CLASSES, BLOCK=block, num_warps=4)
        _use_order_kernel[(blocks,)](counts, table, order, rank, num_cols, blocks, CLASSES=USE_CLASSES, BLOCK=block,
                                     LOG_BLOCK=block.bit_length() - 1, BLOCKS=next_power_of_2(blocks), num_warps=8)
    return order, rank


@triton.jit
def _bits_below(word, bit):
    """How many of the uint32 `word`'s bits below `bit` (0..31) are set (a SWAR popcount)."""
    below = word & ((tl.full(word.shape, 1, tl.uint32) << bit.to(tl.uint32)) - 1)
    below = below - ((below >> 1) & 0x55555555)
    below = (below & 0x33333333) + ((below >> 2) & 0x33333333)
    below = (below + (below >> 4)) & 0x0F0F0F0F
    return ((below * 0x01010101) >> 24).to(tl.int64)


@triton.jit
def _named_before(bits_ptr, upto_ptr, pair, ok):
    """How many pairs before `pair` are named: the words' running count up to the word before
    pair's, plus its word's bits below it."""
    w = pair // 32
    word = tl.load(bits_ptr + w, mask=ok, other=0).to(tl.uint32, bitcast=True)
    before = tl.load(upto_ptr + w - 1, mask=ok & (w > 0), other=0).to(tl.int64)
    return before + _bits_below(word, (pair % 32).to(tl.int32))


@triton.jit
def _name_pairs(slot_ptr, col_ptr, valid_ptr, rank_ptr, named_ptr, e, inside, members, width, first_pair,
                BY_COLUMNS: tl.constexpr):
    ok, pair, _, _ = _pair_of_entry(slot_ptr, col_ptr, valid_ptr, rank_ptr, e, inside, members, width, BY_COLUMNS)
    tl.store(named_ptr + first_pair + pair, tl.full(e.shape, 1, tl.int8), mask=ok)  # (entries of one pair store alike)


@cached_launch
@triton.jit
def _union_name_kernel(slot_ptr, col_ptr, valid_ptr, rank_ptr, named_ptr, total, members, width, members_b, width_b,
                       first_pair_b, BY_COLUMNS: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    """The pairs each entry names in the first layout (by columns or slots) and, with HAS_B, in
    the second (by columns), whose table starts at pair `first_pair_b`."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = e < total
    _name_pairs(slot_ptr, col_ptr, valid_ptr, rank_ptr, named_ptr, e, inside, members, width, 0, BY_COLUMNS)
    if HAS_B:
        _name_pairs(slot_ptr, col_ptr, valid_ptr, rank_ptr, named_ptr, e, inside, members_b, width_b, first_pair_b,
                    True)


# a block's published sum in the pack launch: its value in the low SUM_BITS bits, a flag above
# them (1: the block's own count; 2: with every block before it)
SUM_BITS = 40
LOOK_BACK = 128  # blocks read at a time, looking back


@cached_launch
@triton.jit
def _union_pack_kernel(named_ptr, bits_ptr, upto_ptr, status_ptr, ticket_ptr, num_words, BLOCK_W: tl.constexpr,
                       WINDOW: tl.constexpr, SUM_BITS: tl.constexpr):
    """Words of 32 pairs' flags, and `upto`: the pairs named up to each word's end (a prefix sum
    over the whole table). A block takes its number from a ticket (so every block before it has
    started: one that waits on them cannot wait forever), publishes its count, reads the blocks
    before it back to the last that has published its inclusive sum (windows of WINDOW; it waits
    for a block of the window that has not published yet), then publishes its own inclusive sum
    (a decoupled look-back, as CUB's scans do)."""
    b = tl.atomic_add(ticket_ptr, 1)
    w = b.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    bit = tl.arange(0, 32)
    w_ok = w < num_words
    named = tl.load(named_ptr + w[:, None] * 32 + bit[None, :], mask=w_ok[:, None], other=0).to(tl.uint32)
    word = tl.sum(named << bit[None, :].to(tl.uint32), axis=1)  # (distinct bits: their sum is their or)
    count = tl.sum(named, axis=1).to(tl.int64)
    block_sum = tl.sum(count, axis=0)
    value_mask = (tl.full([WINDOW], 1, tl.int64) << SUM_BITS) - 1
    inclusive = tl.full([WINDOW], 2, tl.int64) << SUM_BITS  # (blocks before the first: a sum of 0)
    tl.atomic_xchg(status_ptr + b, (tl.where(b == 0, 2, 1).to(tl.int64) << SUM_BITS) | block_sum)
    before = tl.full([], 0, tl.int64)
    hi = b
    looking = b > 0
    while looking:
        j = hi - WINDOW + tl.arange(0, WINDOW)
        status = tl.load(status_ptr + j, mask=j >= 0, other=inclusive, volatile=True)
        while tl.min(status >> SUM_BITS, axis=0) == 0:  # (a block of the window not published yet)
            status = tl.load(status_ptr + j, mask=j >= 0, other=inclusive, volatile=True)
        last_inclusive = tl.max(tl.where((status >> SUM_BITS) == 2, j, hi - WINDOW - 1), axis=0)
        before += tl.sum(tl.where(j >= last_inclusive, status & value_mask, 0), axis=0)
        looking = last_inclusive < hi - WINDOW
        hi -= WINDOW
    if b > 0:
        tl.atomic_xchg(status_ptr + b, (tl.full([], 2, tl.int64) << SUM_BITS) | (before + block_sum))
    tl.store(bits_ptr + w, word.to(tl.int32, bitcast=True), mask=w_ok)
    tl.store(upto_ptr + w, (before + tl.cumsum(count, 0)).to(tl.int32), mask=w_ok)


@triton.jit
def _place_entries(e, slot_ptr, col_ptr, valid_ptr, rank_ptr, bits_ptr, upto_ptr, values_ptr, place_ptr, uids_ptr,
                   tile_start_ptr, total, members, width, pairs, tiles, first_pair, BY_COLUMNS: tl.constexpr,
                   HAS_VALUES: tl.constexpr, FIRST: tl.constexpr):
    """One layout's places, union ids and tile starts (its table from pair `first_pair` on, a
    whole word, numbered from the pairs named before it: none where FIRST)."""
    inside = e < total
    ok, pair, member, within = _pair_of_entry(slot_ptr, col_ptr, valid_ptr, rank_ptr, e, inside, members, width,
                                              BY_COLUMNS)
    if FIRST:
        first_count = 0
    else:
        first_count = tl.load(upto_ptr + first_pair // 32 - 1).to(tl.int64)
    before = _named_before(bits_ptr, upto_ptr, first_pair + pair, ok) - first_count
    tl.store(place_ptr + e, tl.where(ok, before * width + within, -1), mask=inside)
    if HAS_VALUES:  # (dW's tiles: a slot's row of the hidden states)
        member = tl.load(values_ptr + member, mask=ok, other=0)
    tl.store(uids_ptr + before, member, mask=ok)  # (entries of one pair store alike)
    # tile t starts after the pairs named before its first pair; the last one ends at their total
    # (e here a tile)
    tl.store(tile_start_ptr + e, _named_before(bits_ptr, upto_ptr, first_pair + e * members, e < tiles) - first_count,
             mask=e < tiles)
    named_total = tl.load(upto_ptr + (first_pair + pairs - 1) // 32).to(tl.int64) - first_count
    tl.store(tile_start_ptr + e, tl.where(e == tiles, named_total, 0), mask=e == tiles)


@cached_launch
@triton.jit
def _union_place_kernel(slot_ptr, col_ptr, valid_ptr, rank_ptr, bits_ptr, upto_ptr, values_ptr, place_ptr, uids_ptr,
                        tile_start_ptr, total, members, width, pairs, tiles, place_b_ptr, uids_b_ptr,
                        tile_start_b_ptr, members_b, width_b, pairs_b, tiles_b, first_pair_b,
                        BY_COLUMNS: tl.constexpr, HAS_VALUES: tl.constexpr, HAS_B: tl.constexpr,
                        VALUES_B: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _place_entries(e, slot_ptr, col_ptr, valid_ptr, rank_ptr, bits_ptr, upto_ptr, values_ptr, place_ptr, uids_ptr,
                   tile_start_ptr, total, members, width, pairs, tiles, 0, BY_COLUMNS, HAS_VALUES, True)
    if HAS_B:
        _place_entries(e, slot_ptr, col_ptr, valid_ptr, rank_ptr, bits_ptr, upto_ptr, values_ptr, place_b_ptr,
                       uids_b_ptr, tile_start_b_ptr, total, members_b, width_b, pairs_b, tiles_b, first_pair_b, True,
                       VALUES_B, False)


class Layout(NamedTuple):
    """What union_layouts makes one layout from: the columns' `rank` (their places in
    columns_by_use's order: tiles of `width` places whose members are slots) or None (tiles of
    `width` slots whose members are columns); `capacity`: the most union entries of all its tiles."""

    rank: Optional[Tensor]
    tiles: int
    members: int
    width: int
    capacity: int


def union_layouts(slot: Tensor, col: Tensor, valid: Tensor, set_rows: Optional[Tensor], layouts) -> list:
    """replay.UnionTiles' (tile_start, uids, place) of the entries (their slot, col and valid, as
    replay.KeptEntries holds them) for each of `layouts` (`Layout`s or their tuples: one, or two,
    the first by slots and the second by columns), in one set of launches; a layout by columns'
    uids are the slots' set_rows (the slots themselves where `set_rows` is None)."""
    layouts = [Layout(*layout) for layout in layouts]
    first = layouts[0]
    second = layouts[1] if len(layouts) > 1 else None
    assert len(layouts) <= 2 and (second is None or (first.rank is None and second.rank is not None))
    total, device = valid.numel(), valid.device
    # the tables end to end, each from a whole word (replay takes tiles with a slot: pairs > 0)
    pairs = [layout.tiles * layout.members for layout in layouts]
    first_words = cdiv(pairs[0], 32)
    num_words = first_words + (cdiv(pairs[1], 32) if second is not None else 0)
    blocks = cdiv(num_words, PACK_BLOCK_WORDS)
    # one zero fill: the flags (a byte a pair), the pack launch's published sums and its ticket
    named, status, ticket = torch.zeros(num_words * 4 + blocks + 1, dtype=torch.int64, device=device).split(
        (num_words * 4, blocks, 1))
    named = named.view(torch.int8)
    bits, upto = torch.empty(2 * num_words, dtype=torch.int32, device=device).split((num_words, num_words))
    sizes = [size for layout in layouts for size in (layout.tiles + 1, layout.capacity + 1, total)]
    outputs = torch.empty(sum(sizes), dtype=torch.int64, device=device).split(sizes)
    valid = valid.view(torch.uint8)
    by_columns = first.rank is not None
    b = second if second is not None else first  # (without a second layout, the kernels' b arguments unused)
    rank = b.rank if b.rank is not None else col  # (the one layout by columns reads: at most one does)
    if total:
        _union_name_kernel[(cdiv(total, LAYOUT_BLOCK),)](
            slot, col, valid, rank, named, total, first.members, first.width, b.members, b.width, first_words * 32,
            BY_COLUMNS=by_columns, HAS_B=second is not None, BLOCK=LAYOUT_BLOCK, num_warps=4)
    _union_pack_kernel[(blocks,)](named, bits, upto, status, ticket.view(torch.int32), num_words,
                                  BLOCK_W=PACK_BLOCK_WORDS, WINDOW=LOOK_BACK, SUM_BITS=SUM_BITS, num_warps=4)
    values = slot if set_rows is None else set_rows
    out_b = outputs[3:] if second is not None else outputs[:3]
    _union_place_kernel[(cdiv(max(total, first.tiles + 1, b.tiles + 1), LAYOUT_BLOCK),)](
        slot, col, valid, rank, bits, upto, values, outputs[2], outputs[1],
        outputs[0], total, first.members, first.width, pairs[0], first.tiles, out_b[2], out_b[1], out_b[0],
        b.members, b.width, pairs[-1], b.tiles, first_words * 32, BY_COLUMNS=by_columns,
        HAS_VALUES=by_columns and set_rows is not None, HAS_B=second is not None,
        VALUES_B=set_rows is not None, BLOCK=LAYOUT_BLOCK, num_warps=4)
    return [tuple(outputs[3 * i:3 * i + 3]) for i in range(len(layouts))]
