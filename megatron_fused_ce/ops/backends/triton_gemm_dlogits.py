"""The logits GEMM with dL/d(logits) in its epilogue, in Triton: backward tiles without a pass over
the logits.

`gemm_dlogits(h, weight, local_target, num_valid_cols, num_cols, ...)` returns the [n, num_cols]
dlogits that `shard_dlogits_` would leave in place of `h @ weight.T` (same arguments, same fp32
math, see triton_backend._dlogits_kernel): each program multiplies one [BLOCK_M, H] x [H, BLOCK_N]
tile in fp32 (tensor cores), rounds it to the input dtype as the chunk of logits would be (unless
`round_logits=False`: fp32 logits), turns it into
inv_T * (exp(z - lse) (c_p + c_pz log p) + c_u + c_t [k == y]) and stores that in the input dtype
(0 at padding columns, whose weight rows are not read).

Why: where the softmax offsets are already known (the recompute backward, lean mode's dW and dX
sweeps), the chunked path writes the logits (2 B per element) and its dlogits kernel reads and
writes them again (4 B). Here the logits never reach memory: one write of dlogits. The Triton GEMM
is a few % slower than cuBLAS, so this pays where the elementwise pass is a large part of the
tile's time (docs/design.md §10.4).

Hopper and newer (tensor descriptors, persistent grid: a tile's epilogue overlaps the next tile's
loads); bf16/fp16 inputs with H a multiple of BLOCK_K and 16-byte aligned rows (`supported()`).
The output rows are padded to 8 elements (16 bytes) for the descriptor store; callers get a view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import cached_launch, cdiv, f32 as _f32, interpreting as _interpreting, sm_count as _programs
from .triton_gemm_stats import (_tile_coords, _use_tma, descriptor_scratch, operand_descriptors, round_bf16_by_hand,
                                tile_product)
from .triton_gemm_stats import supported as _gemm_supported

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Module-level so that tests can shrink it.
TILE = (128, 256, 64, 8, 3)
GROUP_M = 16  # row tiles that share a column tile consecutively (L2 reuse of the weight)


def supported(h: Tensor, weight: Tensor) -> bool:
    """Whether this kernel can make the dlogits of these inputs (else: GEMM + shard_dlogits_)."""
    return _use_tma(h.device) and _gemm_supported(h, weight, block_k=TILE[2])


@cached_launch
@triton.jit
def _gemm_dlogits_tma(h_ptr, w_ptr, out_ptr, tgt_ptr, shift_ptr, rest_ptr, cp_ptr, cpz_ptr, ct_ptr, cu_ptr,
                      M, NV, NC, K, stride_h, stride_w, stride_out, col_start, inv_t, num_progs,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                      ROUND: tl.constexpr, HAS_PZ: tl.constexpr, HAS_TARGET: tl.constexpr,
                      HAS_UNIFORM: tl.constexpr, HAS_REST: tl.constexpr, DOT_F32: tl.constexpr,
                      BF16_BY_HAND: tl.constexpr):
    # BF16_BY_HAND: the CPU interpreter's fp32 -> bf16 cast truncates; round to nearest even by hand
    a_desc, b_desc = operand_descriptors(h_ptr, w_ptr, M, NV, K, stride_h, stride_w, BM, BN, BK)
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, NC], strides=[stride_out, 1], block_shape=[BM, BN])
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(NC, BN)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP)
        acc = tile_product(a_desc, b_desc, pid_m, pid_n, K, BM, BN, BK, DOT_F32)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < M
        if ROUND:  # the chunk of logits would hold the product rounded to the input dtype
            if BF16_BY_HAND:
                acc = round_bf16_by_hand(acc)
            else:
                acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        # the dlogits kernel's arithmetic, in its order (results equal for equal logits)
        log_p = acc * inv_t - tl.load(shift_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if HAS_REST:  # shift_ptr holds the row max: log p = (z - M) - log S
            log_p = log_p - tl.load(rest_ptr + rows, mask=row_ok, other=0.0)[:, None]
        coef = tl.load(cp_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if HAS_PZ:
            coef = coef + tl.load(cpz_ptr + rows, mask=row_ok, other=0.0)[:, None] * log_p
        grad = tl.exp(log_p) * coef
        if HAS_UNIFORM:
            grad += tl.load(cu_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if HAS_TARGET:  # a label outside [0, NV) of this block matches no column
            t = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col_start
            grad += tl.where(cols[None, :] == t[:, None], tl.load(ct_ptr + rows, mask=row_ok, other=0.0)[:, None], 0.0)
        grad = tl.where(cols[None, :] < NV, grad * inv_t, 0.0)
        if BF16_BY_HAND:
            grad = round_bf16_by_hand(grad)
        o_desc.store([pid_m * BM, pid_n * BN], grad.to(out_ptr.dtype.element_ty))


def gemm_dlogits(h: Tensor, weight: Tensor, local_target: Tensor, num_valid_cols: int, num_cols: int,
                 inv_temperature: float, lse: Tensor, coef_p: Tensor, coef_pz, coef_target, coef_uniform,
                 log_sum_exp=None, *, col_start: int = 0, round_logits: bool = True) -> Tensor:
    """dlogits [n, num_cols] (h's dtype) of h @ weight[:num_valid_cols].T, as shard_dlogits_ leaves
    them in place of a chunk of logits (same arguments; `round_logits=False`: fp32 logits, the
    result rounded once to h's dtype, as gemm_input() would). `supported(h, weight)` must hold."""
    n = h.shape[0]
    padded = cdiv(max(num_cols, 1), 8) * 8
    buffer = torch.empty(n, padded, dtype=h.dtype, device=h.device)
    if not h.is_cuda and padded > num_cols:
        # torch's CPU bf16/fp16 matmul of such a row-padded view reads the padding columns too (a
        # NaN left there by the allocator made whole dX rows NaN): zero them (the interpreter only)
        buffer[:, num_cols:].zero_()
    out = buffer if padded == num_cols else buffer[:, :num_cols]  # (no view where no column is padding)
    if n == 0 or num_cols == 0:
        return out
    if num_valid_cols == 0:
        return out.zero_()
    bm, bn, bk, warps, stages = TILE
    descriptor_scratch(h.device)
    coef_p = _f32(coef_p)
    pz, tgt, uni, rest = (None if c is None else _f32(c) for c in (coef_pz, coef_target, coef_uniform, log_sum_exp))
    tiles = cdiv(n, bm) * cdiv(num_cols, bn)
    progs = min(tiles, _programs(h.device))
    _gemm_dlogits_tma[(progs,)](
        h, weight, out, local_target.contiguous(), _f32(lse), coef_p if rest is None else rest, coef_p,
        coef_p if pz is None else pz, coef_p if tgt is None else tgt, coef_p if uni is None else uni,
        n, num_valid_cols, num_cols, h.shape[1], h.stride(0), weight.stride(0), out.stride(0), col_start,
        float(inv_temperature), progs,
        BM=bm, BN=bn, BK=bk, GROUP=GROUP_M, ROUND=round_logits, HAS_PZ=pz is not None,
        HAS_TARGET=tgt is not None, HAS_UNIFORM=uni is not None, HAS_REST=rest is not None,
        DOT_F32=_interpreting(), BF16_BY_HAND=_interpreting() and h.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages)
    return out
