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
           The reference is not the row max: if a later block exceeds it by more than
           _REF_MARGIN (e^_REF_MARGIN is far inside fp32/bf16 range), the chunk is redone with the
           row max now known (one host sync per chunk).
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .gemm import gemm_input, logits_gemm, matmul_into_
from .torch_backend import ShardStats, combine_blocks

_REF_MARGIN = 60.0  # largest z - ref allowed in sweep A: exp(60) * V_local stays far below fp32 max
_MAX_COLS_A = 16384  # vocab block of sweeps A / A' (K of the P @ W GEMM: amortizes the fp32 accumulator)
_MAX_ROWS_B = 16384  # token chunk of sweep B (K of the dW GEMM)


@dataclass(frozen=True)
class LeanTiles:
    rows_a: int  # sweeps A / A' / stats: token chunk ...
    cols_a: int  # ... x vocab block (fp32 accumulator [rows_a, H])
    rows_b: int  # sweep B: token chunk (K of the dW GEMM) ...
    cols_b: int  # ... x vocab block (fp32 accumulator [cols_b, H] when the tokens span chunks)


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
    rows_a = min(num_rows, _round_up(_FULL_WAVE // max(hidden_size, 1), 128))
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


class _BlockTargets:
    """Each tile's targets relative to its column block (-1 where the label is elsewhere), from
    every label's block and offset computed once per sweep: two small kernels per tile instead of
    five (at thousands of tiles per call the launches, not the GPU, set the pace)."""

    def __init__(self, local_target: Tensor, width: int):
        self.width = width
        self.block = torch.where(local_target >= 0, local_target // width, -1)
        self.offset = local_target.remainder(width)

    def of(self, c0: int, r0: int, r1: int) -> Tensor:
        """Targets of rows [r0, r1) relative to the block starting at column c0 (a multiple of width)."""
        return torch.where(self.block[r0:r1] == c0 // self.width, self.offset[r0:r1], -1)


def _empty_stats(n: int, device, spec) -> ShardStats:
    f32 = dict(dtype=torch.float32, device=device)
    zeros = torch.zeros(n, **f32)
    return ShardStats(max=torch.full((n,), float("-inf"), **f32), sum_exp=zeros, target=zeros.clone(),
                      sum_logits=zeros.clone() if spec.want_sum_logits else None,
                      sum_exp_shifted=zeros.clone() if spec.want_entropy else None)


def tile_stats(rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ShardStats:
    """Forward statistics of `rows` tile by tile (when triton_gemm_stats does not run)."""
    tiles: LeanTiles = spec.lean
    targets = _BlockTargets(local_target, tiles.cols_a)
    out = []
    for r0, r1 in _spans(rows.shape[0], tiles.rows_a):
        parts = []
        for c0, c1 in _spans(spec.num_valid_cols, tiles.cols_a):
            tile = logits_gemm(rows[r0:r1], weight[c0:c1], spec.logits_dtype)
            parts.append(spec.backend.shard_stats(
                tile, targets.of(c0, r0, r1), c1 - c0, spec.inv_temperature,
                want_sum_logits=spec.want_sum_logits, want_entropy=spec.want_entropy))
            del tile
        out.append(combine_blocks(parts) if parts else _empty_stats(r1 - r0, rows.device, spec))
    if not out:
        return _empty_stats(0, rows.device, spec)
    return ShardStats(**{name: None if getattr(out[0], name) is None else torch.cat([getattr(s, name) for s in out])
                         for name in ShardStats.__dataclass_fields__})


def expected_rows(h: Tensor, weight: Tensor, local_target: Tensor, spec, want_acc: bool):
    """Sweep A over one token chunk -> (ShardStats with `max` = the reference, fp32 acc =
    sum_k exp(z_k - ref) W_k or None). See the module doc."""
    n, hidden_size = h.shape
    f32 = dict(dtype=torch.float32, device=h.device)
    acc = torch.empty(n, hidden_size, **f32) if want_acc else None  # the first block writes it
    blocks = _spans(spec.num_valid_cols, spec.lean.cols_a)
    if not blocks:  # a shard made only of padding columns
        return _empty_stats(n, h.device, spec), None if acc is None else acc.zero_()
    ref, sum_exp, seen = (torch.empty(n, **f32) for _ in range(3))
    target = torch.zeros(n, **f32)
    sum_logits = torch.empty(n, **f32) if spec.want_sum_logits else None
    targets = _BlockTargets(local_target, spec.lean.cols_a)
    for attempt in range(2):
        for j, (c0, c1) in enumerate(blocks):
            tile = logits_gemm(h, weight[c0:c1], spec.logits_dtype)
            spec.backend.exp_tile_(tile, targets.of(c0, 0, n), c1 - c0, spec.inv_temperature,
                                   ref, sum_exp, seen, target, sum_logits, first=(j == 0 and attempt == 0))
            if acc is not None:
                matmul_into_(acc, gemm_input(tile, h), weight[c0:c1], accumulate=j > 0)
            del tile
        if attempt == 1 or not bool((seen - ref).max() > _REF_MARGIN):  # one host sync per chunk
            break
        # A later block exceeded the reference by too much: redo with the row max, now known.
        ref.copy_(seen)
        sum_exp.zero_()
        if sum_logits is not None:
            sum_logits.zero_()
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


def _dlogits_tile(rows: Tensor, weight: Tensor, targets: _BlockTargets, spec, offsets, coefs,
                  r0: int, r1: int, c0: int, c1: int) -> Tensor:
    shift, log_sum_exp = offsets
    tile = logits_gemm(rows[r0:r1], weight[c0:c1], spec.logits_dtype)
    spec.backend.shard_dlogits_(
        tile, targets.of(c0, r0, r1), c1 - c0, spec.inv_temperature, shift[r0:r1],
        *(None if coefs[k] is None else coefs[k][r0:r1] for k in ("p", "pz", "target", "uniform")),
        log_sum_exp=None if log_sum_exp is None else log_sum_exp[r0:r1])
    return gemm_input(tile, rows)


def input_grad_sweep(rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets, coefs,
                     dx_rows: Tensor) -> None:
    """Sweep A': dX of the rows (this shard's part), fp32-accumulated over vocab blocks."""
    tiles: LeanTiles = spec.lean
    blocks = _spans(spec.num_valid_cols, tiles.cols_a)
    if not blocks:
        dx_rows.zero_()
        return
    acc = torch.empty(min(tiles.rows_a, rows.shape[0]), rows.shape[1], dtype=torch.float32, device=rows.device)
    targets = _BlockTargets(local_target, tiles.cols_a)
    for r0, r1 in _spans(rows.shape[0], tiles.rows_a):
        a = acc[:r1 - r0]
        for j, (c0, c1) in enumerate(blocks):
            dlogits = _dlogits_tile(rows, weight, targets, spec, offsets, coefs, r0, r1, c0, c1)
            matmul_into_(a, dlogits, weight[c0:c1], accumulate=j > 0)
            del dlogits
        dx_rows[r0:r1].copy_(a)


def weight_grad_sweep(rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets, coefs,
                      dw_out: Tensor, accumulate: bool) -> None:
    """Sweep B: dW of this shard into `dw_out` (weight dtype: written; fp32 main_grad with
    `accumulate`: added), fp32-accumulated over every token of each vocab block."""
    tiles: LeanTiles = spec.lean
    row_chunks = _spans(rows.shape[0], tiles.rows_b)
    direct = accumulate or len(row_chunks) <= 1
    acc = None if direct else torch.empty(tiles.cols_b, rows.shape[1], dtype=torch.float32, device=rows.device)
    if not accumulate:
        if not row_chunks:
            dw_out.zero_()
            return
        dw_out[spec.num_valid_cols:].zero_()
    targets = _BlockTargets(local_target, tiles.cols_b)
    for c0, c1 in _spans(spec.num_valid_cols, tiles.cols_b):
        for index, (r0, r1) in enumerate(row_chunks):
            dlogits = _dlogits_tile(rows, weight, targets, spec, offsets, coefs, r0, r1, c0, c1)
            if direct:
                matmul_into_(dw_out[c0:c1], dlogits.t(), rows[r0:r1], accumulate=accumulate or index > 0)
            else:
                matmul_into_(acc[:c1 - c0], dlogits.t(), rows[r0:r1], accumulate=index > 0)
            del dlogits
        if not direct:
            dw_out[c0:c1].copy_(acc[:c1 - c0])
