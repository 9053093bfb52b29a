"""The logits GEMM with the softmax partials in its epilogue, in Triton: forward statistics without
a chunk of logits in memory.

`gemm_shard_stats(hidden_rows, weight, local_target, ...)` returns the same `ShardStats` as
`torch_backend.shard_stats(hidden_rows @ weight.T, ...)`, but no [n, V_local] tensor is written:
each program multiplies one [BLOCK_M, H] x [H, BLOCK_N] tile in fp32 (tensor cores), rounds it to
the input dtype exactly as the chunked path's logits are rounded (unless `round_logits=False`,
i.e. logits_dtype=float32), and reduces it to per-row partials of its BLOCK_N columns: max,
sum exp(z - max), the target logit when the label falls in the tile, sum z and
sum exp(z - max)(z - max) when asked. A second small kernel merges the partials of a row over the
column tiles. Extra memory: 8-16 bytes per row and column tile, about 3 % of the logits at
BLOCK_N = 256 (rows are processed in slices so that this stays bounded whatever the token count).

Why: the forward pass of reference / old-policy log-probs (no_grad) and of the recompute path
needs only these O(tokens) statistics. The chunked path writes each chunk of logits (2 B/element)
and reads it again in the stats kernel (2 B/element), and holds the chunk (50 % of the dense
logits at 8192 x 128256). Measured against cuBLAS GEMM + stats kernel: docs/design.md §10.3;
below fast.FUSED_STATS_MIN_BYTES of logits the op takes those instead (faster at RL micro-batches).

Hopper and newer use tensor descriptors (TMA) in a persistent grid that overlaps a tile's epilogue
with the next tile's loads; older GPUs use a pointer-based grouped GEMM. Needs bf16/fp16 inputs
with H a multiple of BLOCK_K (64) and 16-byte aligned rows; `supported()` says when.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from torch import Tensor

from . import ShardStats, chunk_rows
from .triton_common import (cached_launch, cdiv, compute_capability, interpreting as _interpreting,
                            sm_count as _programs)

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the best of 8 configurations on an H100 at the three
# benchmark shapes (docs/design.md §10.3). Module-level so that tests can shrink them.
TILE = (128, 256, 64, 8, 3)
GROUP_M = 16  # row tiles that share a column tile consecutively (L2 reuse of the weight)
PARTIALS_BYTES = 64 * 1024 * 1024  # bound on the per-tile partials of one launch
MERGE_BLOCK_R, MERGE_BLOCK_T = 32, 64


def supported(hidden_rows: Tensor, weight: Tensor, block_k: int = 0) -> bool:
    """Whether this kernel (or another of BLOCK_K `block_k`) can multiply these inputs."""
    block_k = block_k or TILE[2]
    if hidden_rows.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden_rows.dtype:
        return False
    if not (hidden_rows.is_cuda or _interpreting()):
        return False
    h = hidden_rows.shape[1]
    return (h % block_k == 0 and hidden_rows.stride(1) == 1 and weight.stride(1) == 1
            and (hidden_rows.stride(0) * 2) % 16 == 0 and (weight.stride(0) * 2) % 16 == 0
            and hidden_rows.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP: tl.constexpr):
    in_group = GROUP * num_pid_n
    first_m = (tile_id // in_group) * GROUP
    size_m = tl.minimum(num_pid_m - first_m, GROUP)
    return first_m + (tile_id % in_group) % size_m, (tile_id % in_group) // size_m


@triton.jit
def operand_descriptors(h_ptr, w_ptr, M, NV, K, stride_h, stride_w,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """K-major tensor descriptors of the hidden rows [M, K] and of the valid weight rows [NV, K]
    (the padding columns' products load as zeros: their weight rows are not read)."""
    a_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, K], strides=[stride_h, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(w_ptr, shape=[NV, K], strides=[stride_w, 1], block_shape=[BN, BK])
    return a_desc, b_desc


@triton.jit
def tile_product(a_desc, b_desc, pid_m, pid_n, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """fp32 [BM, BN] tile (pid_m, pid_n) of A @ B.T, both K-major tensor descriptors."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BK)):
        a = a_desc.load([pid_m * BM, ki * BK])
        b = b_desc.load([pid_n * BN, ki * BK])
        if DOT_F32:  # the CPU interpreter's bf16 tl.dot is wrong (Triton 3.9): upcast there
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def round_bf16_by_hand(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32. For the CPU interpreter only,
    whose fp32 -> bf16 cast truncates; compiled kernels cast."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _epilogue(acc, pid_m, pid_n, M, NV, inv_t, tgt_ptr, label_offset, ignore, parts_ptr, part_stride, tz_ptr, tz_offset,
              BM: tl.constexpr, BN: tl.constexpr, ROUND: tl.constexpr, WANT_SUM: tl.constexpr,
              WANT_ENTROPY: tl.constexpr, OUT_DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    # the partials: [max, sum exp, (sum z), (sum exp shifted)] x [column tiles, M], `part_stride` apart
    pm_ptr = parts_ptr
    ps_ptr = parts_ptr + part_stride
    pl_ptr = parts_ptr + 2 * part_stride
    pe_ptr = parts_ptr + (2 + WANT_SUM) * part_stride
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < NV
    if BF16_BY_HAND:  # the interpreter's fp32 -> bf16 cast truncates
        acc = round_bf16_by_hand(acc)
    elif ROUND:  # the chunked path's logits are the GEMM output rounded to the input dtype
        acc = acc.to(OUT_DTYPE).to(tl.float32)
    z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
    m = tl.max(z, axis=1)  # finite: every tile holds >= 1 valid column
    e = tl.exp(z - m[:, None])  # 0 at invalid columns
    out = pid_n.to(tl.int64) * M + rows
    tl.store(pm_ptr + out, m, mask=row_ok)
    tl.store(ps_ptr + out, tl.sum(e, axis=1), mask=row_ok)
    if WANT_SUM:
        tl.store(pl_ptr + out, tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1), mask=row_ok)
    if WANT_ENTROPY:
        shifted = tl.where(col_ok[None, :], z - m[:, None], 0.0)
        tl.store(pe_ptr + out, tl.sum(e * shifted, axis=1), mask=row_ok)
    label = tl.load(tgt_ptr + rows, mask=row_ok, other=ignore)
    t = label - label_offset
    t = tl.where((label != ignore) & (t >= 0) & (t < NV), t, -1)
    z_t = tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), axis=1)  # (0 where t = -1)
    # each row's target stored by one tile: its label's, or the first where the label is not on
    # this shard (its 0: no fill of the output before the launch)
    owner = tl.where(t < 0, 0, t) // BN
    tl.store(tz_ptr + tz_offset + rows, z_t, mask=row_ok & (owner == pid_n))


@cached_launch
@triton.jit
def _gemm_stats_tma(h_ptr, w_ptr, tgt_ptr, label_offset, ignore, parts_ptr, part_stride, tz_ptr, tz_offset,
                    M, NV, K, stride_h, stride_w, inv_t, num_progs,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                    ROUND: tl.constexpr, WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr,
                    DOT_F32: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    a_desc, b_desc = operand_descriptors(h_ptr, w_ptr, M, NV, K, stride_h, stride_w, BM, BN, BK)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(NV, BN)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP)
        acc = tile_product(a_desc, b_desc, pid_m, pid_n, K, BM, BN, BK, DOT_F32)
        _epilogue(acc, pid_m, pid_n, M, NV, inv_t, tgt_ptr, label_offset, ignore, parts_ptr, part_stride, tz_ptr,
                  tz_offset, BM, BN, ROUND, WANT_SUM, WANT_ENTROPY, h_ptr.dtype.element_ty, BF16_BY_HAND)


@cached_launch
@triton.jit
def _gemm_stats_ptr(h_ptr, w_ptr, tgt_ptr, label_offset, ignore, parts_ptr, part_stride, tz_ptr, tz_offset,
                    M, NV, K, stride_h, stride_w, inv_t,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                    ROUND: tl.constexpr, WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr,
                    DOT_F32: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(NV, BN), GROUP)
    rows = (pid_m * BM + tl.arange(0, BM)) % M  # wrapped rows/columns: loads need no mask
    cols = (pid_n * BN + tl.arange(0, BN)) % NV
    offs_k = tl.arange(0, BK)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    _epilogue(acc, pid_m, pid_n, M, NV, inv_t, tgt_ptr, label_offset, ignore, parts_ptr, part_stride, tz_ptr, tz_offset,
              BM, BN, ROUND, WANT_SUM, WANT_ENTROPY, h_ptr.dtype.element_ty, BF16_BY_HAND)


@cached_launch
@triton.jit
def _merge_tiles_kernel(parts_ptr, stats_ptr, stats_stride, M, T,
                        WANT_SUM: tl.constexpr, WANT_ENTROPY: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """[T, M] column-tile partials -> [M] row partials (online over T, like the stats kernel): the
    partials as the GEMM wrote them from `parts_ptr`, the row statistics [max, sum exp, target,
    (sum z), (sum exp shifted)] `stats_stride` apart from `stats_ptr` (the target the GEMM's)."""
    pm_ptr = parts_ptr
    ps_ptr = parts_ptr + T * M
    pl_ptr = parts_ptr + 2 * T * M
    pe_ptr = parts_ptr + (2 + WANT_SUM) * T * M
    m_ptr = stats_ptr
    s_ptr = stats_ptr + stats_stride
    l_ptr = stats_ptr + 3 * stats_stride
    e_ptr = stats_ptr + (3 + WANT_SUM) * stats_stride
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    sl = tl.zeros([BLOCK_R], tl.float32)
    se = tl.zeros([BLOCK_R], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        mask = (ts[:, None] < T) & row_ok[None, :]
        offs = ts.to(tl.int64)[:, None] * M + rows[None, :]
        pm = tl.load(pm_ptr + offs, mask=mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(pm, axis=0))
        m_safe = tl.where(row_ok, m_new, 0.0)
        alpha = tl.exp(m - m_safe)
        scale = tl.where(mask, tl.exp(pm - m_safe[None, :]), 0.0)
        ps = tl.load(ps_ptr + offs, mask=mask, other=0.0)
        if WANT_ENTROPY:  # sum e^(z-m')(z-m') = e^(m-m') (A + (m-m') S) for each part
            pe = tl.load(pe_ptr + offs, mask=mask, other=0.0)
            part = tl.sum((pe + tl.where(mask, pm - m_safe[None, :], 0.0) * ps) * scale, axis=0)
            se = alpha * (se + tl.where(m > float("-inf"), m - m_safe, 0.0) * s) + part
        s = s * alpha + tl.sum(ps * scale, axis=0)
        if WANT_SUM:
            sl += tl.sum(tl.load(pl_ptr + offs, mask=mask, other=0.0), axis=0)
        m = m_new
    tl.store(m_ptr + rows, m, mask=row_ok)
    tl.store(s_ptr + rows, s, mask=row_ok)
    if WANT_SUM:
        tl.store(l_ptr + rows, sl, mask=row_ok)
    if WANT_ENTROPY:
        tl.store(e_ptr + rows, se, mask=row_ok)




def _scratch(size: int, align: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def descriptor_scratch(device: torch.device) -> None:
    """Give Triton its allocator for device-side tensor descriptors. Set at every launch: Triton
    keeps it in a context variable, which autograd's backward thread does not inherit."""
    if device.type == "cuda":
        triton.set_allocator(_scratch)


def _use_tma(device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # the interpreter runs tensor descriptors too
    return compute_capability(device)[0] >= 9


def gemm_shard_stats(hidden_rows: Tensor, weight: Tensor, local_target: Tensor, num_valid_cols: int,
                     inv_temperature: float, want_sum_logits: bool = False, want_entropy: bool = False,
                     round_logits: bool = True, label_offset: int = 0, ignore_index: int = -1) -> ShardStats:
    """ShardStats of hidden_rows @ weight.T (see the module doc); `supported()` must hold.
    `local_target`: each row's target column on this shard (-1: none), or the rows' labels with
    `label_offset` (the shard's first vocab id) and `ignore_index`: the call's first GEMM is
    launched before the label kernel has made the targets (fast.EarlyProduct)."""
    n = hidden_rows.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden_rows.device)
    if num_valid_cols == 0 or n == 0:
        return ShardStats.empty(n, hidden_rows.device, want_sum_logits, want_entropy)
    bm, bn, bk, warps, stages = TILE
    tiles_n = cdiv(num_valid_cols, bn)
    per_tile = 2 + want_sum_logits + want_entropy  # the partials of a row and column tile
    slice_rows = max(bm, PARTIALS_BYTES // (4 * tiles_n * per_tile) // bm * bm)
    # the row statistics in one allocation, the partials of a slice in another, each passed whole
    # (base and stride) and split into views after the launches: a call's host time before its
    # GEMM is launched is the GPU's idle time at RL row counts
    stats = torch.empty(3 + want_sum_logits + want_entropy, n, **f32)
    tma = _use_tma(hidden_rows.device)
    if tma:
        descriptor_scratch(hidden_rows.device)
    interpreted = _interpreting()
    meta = dict(BM=bm, BN=bn, BK=bk, GROUP=GROUP_M, ROUND=round_logits, WANT_SUM=want_sum_logits,
                WANT_ENTROPY=want_entropy, DOT_F32=interpreted,
                BF16_BY_HAND=round_logits and interpreted and hidden_rows.dtype == torch.bfloat16,
                num_warps=warps, num_stages=stages)
    target = local_target if local_target.is_contiguous() else local_target.contiguous()
    for r0 in range(0, n, slice_rows):
        r1 = min(n, r0 + slice_rows)
        rows = r1 - r0
        parts = torch.empty(per_tile * tiles_n * rows, **f32)
        h = chunk_rows(hidden_rows, r0, r1)
        # (the GEMM writes the target, row r0 on at 2 n + r0 in `stats`: the merge leaves it)
        args = (h, weight, chunk_rows(target, r0, r1), int(label_offset), int(ignore_index), parts, tiles_n * rows,
                stats, 2 * n + r0, rows, num_valid_cols, h.shape[1], h.stride(0), weight.stride(0),
                float(inv_temperature))
        tiles = cdiv(rows, bm) * tiles_n
        if tma:
            progs = min(tiles, _programs(h.device))
            _gemm_stats_tma[(progs,)](*args, progs, **meta)
        else:
            _gemm_stats_ptr[(tiles,)](*args, **meta)
        _merge_tiles_kernel[(cdiv(rows, MERGE_BLOCK_R),)](
            parts, stats if r0 == 0 else stats[:, r0:], n, rows, tiles_n, WANT_SUM=want_sum_logits,
            WANT_ENTROPY=want_entropy, BLOCK_R=MERGE_BLOCK_R, BLOCK_T=MERGE_BLOCK_T, num_warps=4)
    fields = stats.unbind(0)
    return ShardStats(max=fields[0], sum_exp=fields[1], target=fields[2],
                      sum_logits=fields[3] if want_sum_logits else None,
                      sum_exp_shifted=fields[-1] if want_entropy else None)
