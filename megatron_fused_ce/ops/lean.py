"""Lean mode: the chunk loop's work in tiles of [rows, cols] logits, with a working set of a few
tiles whatever the number of tokens, and both gradients still accumulated in fp32.

Fast mode holds one chunk of logits [C, V_local] and, when dW is summed over several chunks, an
fp32 [V_local, H] buffer. Lean mode never holds more than one logits tile and one fp32 accumulator
of [tile rows, H] or [tile cols, H] (sizes from api.py's working-set budget: `tile_sizes`). The
price is a fourth GEMM: dX needs every vocab block of a token, dW every token of a vocab block, so
one sweep cannot finish both without an fp32 accumulator the size of one gradient. Instead:

  sweep A  (token chunks outer, vocab blocks inner), for losses with gradients in the forward
           (cross-entropy, token-level GRPO). Each tile is overwritten with P = exp(z - ref) for a
           per-row reference (the row max of the first vocab block) and multiplied into an fp32
           accumulator: acc = sum_k P_k W_k, as FlashAttention accumulates P V. At the end of the
           chunk the partials give lse, and dX = inv_T (c_p e^(ref - lse) acc + c_t W_y + c_u sum_k W_k)
           for dlogits = p c_p + c_t [k = y] + c_u. Two GEMMs: logits, P @ W.
           The reference is not the row max: it stays while later blocks exceed it by at most
           _REF_MARGIN (P <= e^_REF_MARGIN, far inside fp32/bf16 range), so the accumulator is
           not rescaled block after block. Where a block goes further above it, the tile's kernel
           moves the row's reference to the block's max and rescales that row's sum and
           accumulator by e^(old - new) (rare: no host synchronization, nothing to redo).
  sweep A' (token chunks outer), on the recompute path (log-probs, entropy): the tiles' dlogits
           multiplied into an fp32 [rows, H] dX accumulator. Two GEMMs: logits, dlogits @ W.
  sweep B  (vocab blocks outer, token chunks inner): the tiles' dlogits multiplied into dW of the
           block, K = up to 16384 tokens per GEMM; one GEMM per block writes dW in the weight dtype
           when all tokens fit (cuBLAS accumulates in fp32), else an fp32 [cols, H] accumulator,
           or Megatron's fp32 main_grad directly. Two GEMMs: logits, dlogits^T @ h.
  stats    forward statistics: triton_gemm_stats (no tile at all) where it runs, else tiles.

Cross-entropy / GRPO: A in the forward, B in the backward (with the exact upstream gradient):
4 GEMMs. Log-probs: stats, A', B: 5 GEMMs. Padding columns (past num_valid_cols) are never
multiplied: their dW rows are zero.

The tiles are small enough that the host, not the GPU, can set the pace (thousands of tiles per
call at TP > 1): each tile of sweep A is three launches (logits GEMM, one Triton kernel, the
product GEMM), each tile of sweeps A' and B two (the logits GEMM that writes dlogits from its
epilogue, gemm.dlogits_gemm, and the product GEMM), targets are matched to a tile inside the
kernels (`col_start`), and the weight's blocks are sliced once per sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import reductions
from .backends import ShardStats
from .fast import MergedAfterLoop, concat_partials
from .gemm import dlogits_gemm, gemm_input, logits_gemm, matmul_into_
from .reductions import combine_blocks

_REF_MARGIN = 60.0  # largest z - ref in sweep A: e^60 * V_local * |W| stays far below fp32 max
_MAX_COLS_A = 16384  # vocab block of sweeps A / A' (K of the P @ W GEMM: amortizes the fp32 accumulator)
_MAX_ROWS_B = 16384  # token chunk of sweep B (K of the dW GEMM)


@dataclass(frozen=True)
class LeanTiles(MergedAfterLoop):
    """memory_mode="lean": the chunk loop's tiling (`spec.tiling`, the methods fast.FastChunks has)
    with these tile sizes."""

    rows_a: int  # sweeps A / A' / stats: token chunk ...
    cols_a: int  # ... x vocab block (fp32 accumulator [rows_a, H])
    rows_b: int  # sweep B: token chunk (K of the dW GEMM) ...
    cols_b: int  # ... x vocab block (fp32 accumulator [cols_b, H] when the tokens span chunks)

    # dW needs every token of a vocab block: sweep B, in the backward (with the exact upstream gradient)
    weight_grad_in_forward = False

    def forward_rows(self, spec) -> int:
        return self.rows_a

    def weight_grad_dtype(self, weight: Tensor, num_rows: int, spec) -> torch.dtype:
        return weight.dtype  # sweep B sums every token of a block in fp32 before writing it

    def statistics(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ShardStats:
        return tile_stats(rows, weight, local_target, spec)

    def recompute_grads(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                        coefs: dict, dx_rows: Optional[Tensor], dw_out: Optional[Tensor], accumulate: bool) -> None:
        """Two tile sweeps: dX token-outer (A'), dW vocab-outer (B)."""
        if dx_rows is not None:
            input_grad_sweep(rows, weight, local_target, spec, offsets, coefs, dx_rows)
        if dw_out is not None:
            weight_grad_sweep(rows, weight, local_target, spec, offsets, coefs, dw_out, accumulate=accumulate)

    def forward_plan(self, rows: Tensor, weight: Tensor, spec, forward_grad, needs_dx: bool,
                     num_labelled=None) -> "_SweepA":
        return _SweepA(weight_blocks(weight, spec.num_valid_cols, self.cols_a), needs_dx)

    def forward_statistics(self, plan: "_SweepA", h: Tensor, weight: Tensor, local_target: Tensor, spec,
                           labelled: Optional[Tensor] = None):
        """Sweep A over a token chunk -> (its statistics merged over TP ranks, (partials, accumulator))."""
        stats, acc = expected_rows(h, plan.blocks, local_target, spec, want_acc=plan.needs_dx)
        return reductions.merge_shard_stats(stats, spec.tp_group, spec.backend, spec.rank_check), (stats, acc)

    def forward_grads(self, plan: "_SweepA", pending, h: Tensor, weight: Tensor, local_target: Tensor, spec,
                      merged, coefs: dict, dx_chunk: Optional[Tensor], dw_out: Optional[Tensor], **unused) -> None:
        """dX of the chunk from sweep A's accumulator; dW waits for sweep B in the backward."""
        stats, acc = pending
        if dx_chunk is None:
            return None
        if coefs["uniform"] is not None and plan.column_sum is None:
            plan.column_sum = weight[:spec.num_valid_cols].sum(0, dtype=torch.float32)
        input_grad_from_expected(acc, stats.max, merged.lse, coefs, weight, local_target, spec, plan.column_sum,
                                 dx_chunk)
        return None


class _SweepA:
    """One call's sweep A: the weight's vocab blocks, and the column sum once a step needs it."""

    def __init__(self, blocks, needs_dx: bool):
        self.blocks, self.needs_dx, self.column_sum = blocks, needs_dx, None


def _round_down(x: int, multiple: int, minimum: int) -> int:
    return max(minimum, x // multiple * multiple)


_FULL_WAVE = 132 * 128 * 256  # output elements of a GEMM that fills an H100/H200 with 128x256 tiles
_MIN_COLS_A = 2048  # below this K the fp32 accumulator's read-modify-write outweighs the GEMM


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def tile_sizes(num_rows: int, v_local: int, hidden_size: int, element_size: int, workset_bytes: int,
               tile_bytes_per_element: int, weight_grad_accumulates: bool) -> LeanTiles:
    """Tiles whose working set (one tile + one fp32 accumulator + a gathered [rows, H] block of
    W) fits `workset_bytes`. Sweep A takes enough rows for its [rows, H] accumulator GEMM to fill
    the GPU, and as many columns as then fit (K of that GEMM); with a small budget it keeps
    _MIN_COLS_A columns and takes fewer rows. `tile_bytes_per_element`: bytes a backend touches per
    tile element (the Triton kernels work in place: the element size; the torch backend makes fp32
    copies). `weight_grad_accumulates`: dW goes into an existing fp32 buffer (main_grad)."""
    v_local, num_rows = max(v_local, 1), max(num_rows, 1)
    acc_row = hidden_size * (4 + element_size)
    # Token chunks of equal size (8192 tokens at H=4096: 8 x 1024, not 7 x 1152 + 128), each near one
    # full wave, or more rows where the working set holds them next to a full-width tile (fewer,
    # larger GEMMs). Why: docs/design.md §10.7.
    full_wave_rows = _round_up(_FULL_WAVE // max(hidden_size, 1), 128)
    fitting_rows = workset_bytes // (min(v_local, _MAX_COLS_A) * tile_bytes_per_element + acc_row)
    chunk_rows = max(full_wave_rows, fitting_rows)
    rows_a = min(num_rows, _round_up(-(-num_rows // -(-num_rows // chunk_rows)), 64))
    cols_a = min(v_local, _MAX_COLS_A, max(workset_bytes - rows_a * acc_row, 0) // (rows_a * tile_bytes_per_element))
    if cols_a >= 1024:
        cols_a = cols_a // 1024 * 1024
    if cols_a < min(v_local, _MAX_COLS_A, _MIN_COLS_A):
        cols_a = min(v_local, _MAX_COLS_A, _MIN_COLS_A)
        rows_a = _round_down(workset_bytes // (cols_a * tile_bytes_per_element + acc_row), 16, 16)
    rows_b = min(num_rows, _MAX_ROWS_B)
    spans = num_rows > rows_b and not weight_grad_accumulates
    if spans:
        rows_b = _MAX_ROWS_B // 2
    per_col = rows_b * tile_bytes_per_element + (4 * hidden_size if spans else 0)
    cols_b = min(v_local, _round_down(workset_bytes // per_col, 128, 16))
    return LeanTiles(min(rows_a, num_rows), cols_a, rows_b, cols_b)


def _spans(total: int, size: int):
    return [(start, min(total, start + size)) for start in range(0, total, size)]


def weight_blocks(weight: Tensor, num_valid_cols: int, width: int):
    """[(first column, the block of weight rows)] over the valid columns: sliced once per sweep."""
    return [(c0, weight[c0:c1]) for c0, c1 in _spans(num_valid_cols, width)]


def _empty_stats(n: int, device, spec) -> ShardStats:
    return ShardStats.empty(n, device, spec.want_sum_logits, spec.want_entropy)


def tile_stats(rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ShardStats:
    """Forward statistics of `rows` tile by tile (when triton_gemm_stats does not run)."""
    tiles: LeanTiles = spec.tiling
    blocks = weight_blocks(weight, spec.num_valid_cols, tiles.cols_a)
    out = []
    for r0, r1 in _spans(rows.shape[0], tiles.rows_a):
        parts = []
        for c0, w_block in blocks:
            tile = logits_gemm(rows[r0:r1], w_block, spec.logits_dtype)
            parts.append(spec.backend.shard_stats(
                tile, local_target[r0:r1], w_block.shape[0], spec.inv_temperature,
                want_sum_logits=spec.want_sum_logits, want_entropy=spec.want_entropy, col_start=c0))
            del tile
        out.append(combine_blocks(parts) if parts else _empty_stats(r1 - r0, rows.device, spec))
    return concat_partials(out, rows, spec)


def expected_rows(h: Tensor, blocks, local_target: Tensor, spec, want_acc: bool):
    """Sweep A over one token chunk -> (ShardStats with `max` = the reference, fp32 acc =
    sum_k exp(z_k - ref) W_k or None). `blocks`: weight_blocks(weight, ., cols_a). See the module doc."""
    n, hidden_size = h.shape
    f32 = dict(dtype=torch.float32, device=h.device)
    acc = torch.empty(n, hidden_size, **f32) if want_acc else None  # the first block writes it
    if not blocks:  # a shard made only of padding columns
        return _empty_stats(n, h.device, spec), None if acc is None else acc.zero_()
    # the first block sets ref, sum_exp and sum_logits
    ref, sum_exp = torch.empty(n, **f32), torch.empty(n, **f32)
    target = torch.zeros(n, **f32)
    sum_logits = torch.empty(n, **f32) if spec.want_sum_logits else None
    for j, (c0, w_block) in enumerate(blocks):
        tile = logits_gemm(h, w_block, spec.logits_dtype)
        # block j's P and any rescale of acc (rows whose reference moves) are queued before the
        # GEMM that adds P_j W_j
        spec.backend.exp_tile_(tile, local_target, w_block.shape[0], spec.inv_temperature, ref, sum_exp, target,
                               sum_logits, acc if j > 0 else None, first=j == 0, ref_margin=_REF_MARGIN,
                               col_start=c0)
        if acc is not None:
            matmul_into_(acc, gemm_input(tile, h), w_block, accumulate=j > 0)
        del tile
    return ShardStats(max=ref, sum_exp=sum_exp, target=target, sum_logits=sum_logits), acc


def input_grad_from_expected(acc: Tensor, ref: Tensor, lse: Tensor, coefs: dict, weight: Tensor,
                             local_target: Tensor, spec, column_sum: Optional[Tensor], out: Tensor) -> None:
    """dX rows of this shard from sweep A's accumulator (in place in acc, written to `out`):
    inv_T (c_p e^(ref - lse) acc + c_t W_y + c_u sum_k W_k) for dlogits = p c_p + c_t [k = y] + c_u."""
    if coefs["pz"] is not None:
        raise ValueError("lean sweep A: an entropy gradient needs the recompute path")
    acc.mul_((coefs["p"] * torch.exp(ref - lse)).unsqueeze(1))
    if coefs["target"] is not None:
        on_shard = local_target >= 0
        target_rows = weight.index_select(0, local_target.clamp(min=0))
        acc.addcmul_(target_rows, torch.where(on_shard, coefs["target"], 0.0).unsqueeze(1))
        del target_rows
    if coefs["uniform"] is not None:
        acc.addr_(coefs["uniform"], column_sum)
    if spec.inv_temperature != 1.0:
        acc.mul_(spec.inv_temperature)
    out.copy_(acc)


class _RowSlice(NamedTuple):
    """Rows [r0, r1) of everything a dlogits tile reads: sliced once per token chunk, not per tile."""

    h: Tensor
    local_target: Tensor
    shift: Tensor  # row max (or lse)
    c_p: Tensor
    c_pz: Optional[Tensor]
    c_target: Optional[Tensor]
    c_uniform: Optional[Tensor]
    log_sum_exp: Optional[Tensor]


def _row_slice(rows: Tensor, local_target: Tensor, offsets, coefs, r0: int, r1: int) -> _RowSlice:
    shift, log_sum_exp = offsets

    def part(t):
        return None if t is None else t[r0:r1]

    return _RowSlice(rows[r0:r1], local_target[r0:r1], shift[r0:r1],
                     *(part(coefs[k]) for k in ("p", "pz", "target", "uniform")), part(log_sum_exp))


def _dlogits_tile(rs: _RowSlice, w_block: Tensor, c0: int, spec) -> Tensor:
    return dlogits_gemm(rs.h, w_block, rs.local_target, w_block.shape[0], spec, (rs.shift, rs.log_sum_exp),
                        dict(p=rs.c_p, pz=rs.c_pz, target=rs.c_target, uniform=rs.c_uniform), c0)


def input_grad_sweep(rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets, coefs,
                     dx_rows: Tensor) -> None:
    """Sweep A': dX of the rows (this shard's part), fp32-accumulated over vocab blocks."""
    tiles: LeanTiles = spec.tiling
    blocks = weight_blocks(weight, spec.num_valid_cols, tiles.cols_a)
    if not blocks:
        dx_rows.zero_()
        return
    acc = torch.empty(min(tiles.rows_a, rows.shape[0]), rows.shape[1], dtype=torch.float32, device=rows.device)
    for r0, r1 in _spans(rows.shape[0], tiles.rows_a):
        a = acc[:r1 - r0]
        row_slice = _row_slice(rows, local_target, offsets, coefs, r0, r1)
        for j, (c0, w_block) in enumerate(blocks):
            dlogits = _dlogits_tile(row_slice, w_block, c0, spec)
            matmul_into_(a, dlogits, w_block, accumulate=j > 0)
            del dlogits
        dx_rows[r0:r1].copy_(a)


def weight_grad_sweep(rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets, coefs,
                      dw_out: Tensor, accumulate: bool) -> None:
    """Sweep B: dW of this shard into `dw_out` (weight dtype: written; fp32 main_grad with
    `accumulate`: added), fp32-accumulated over every token of each vocab block."""
    tiles: LeanTiles = spec.tiling
    row_chunks = _spans(rows.shape[0], tiles.rows_b)
    direct = accumulate or len(row_chunks) <= 1
    acc = None if direct else torch.empty(tiles.cols_b, rows.shape[1], dtype=torch.float32, device=rows.device)
    if not accumulate:
        if not row_chunks:
            dw_out.zero_()
            return
        dw_out[spec.num_valid_cols:].zero_()
    row_slices = [_row_slice(rows, local_target, offsets, coefs, r0, r1) for r0, r1 in row_chunks]
    for c0, w_block in weight_blocks(weight, spec.num_valid_cols, tiles.cols_b):
        out = dw_out[c0:c0 + w_block.shape[0]] if direct else acc[:w_block.shape[0]]
        for index, row_slice in enumerate(row_slices):
            dlogits = _dlogits_tile(row_slice, w_block, c0, spec)
            matmul_into_(out, dlogits.t(), row_slice.h, accumulate=(accumulate and direct) or index > 0)
            del dlogits
        if not direct:
            dw_out[c0:c0 + w_block.shape[0]].copy_(out)
