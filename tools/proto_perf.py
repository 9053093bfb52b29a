#!/usr/bin/env python3
"""Prototype schedules for issue 15 (performance frontier), one GPU, bf16, TP=1.

Standalone: measures candidate schedules against the same-run cuBLAS floors, to decide what goes
into the package. Sections (each prints a short table; everything also goes to $OUT/proto.json):

  floors     1-GEMM (logits) and 3-GEMM (logits, dX, dW) cuBLAS times
  overlap    one [C, V] chunk: GEMM alone, Triton stats / dlogits alone, and both on two streams
             (does an elementwise kernel hide behind a cuBLAS GEMM on this GPU?)
  fused      Triton GEMM with the softmax statistics in its epilogue (pointer and TMA-persistent
             variants, several tile configs) against cuBLAS; the same kernel without statistics
  forward    RL forward pass (no_grad log-probs): package today, vocab-tiled (+ 2 streams), fused
  lean       lean CE (fwd+bwd): sweep A (FlashAttention-style dX + stats, token-outer) and sweep B
             (vocab-blocked dW, K = tokens), with and without 2 streams
  fast       fast CE (fwd+bwd): package today, one chunk, vocab-block pipeline (with/without streams)
  main_grad  CE with dW added straight into an fp32 main_grad (no V x H fp32 buffer of its own)

    python tools/proto_perf.py [--shapes NxHxV,...] [--sections a,b,...] [--out DIR]
    python tools/proto_perf.py --quick      # tiny shapes; on CPU under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402
from megatron_fused_ce.ops import triton_backend as tb  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
GIB = 1024.0 ** 3
RESULTS = {"rows": []}


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------ timing
def sync():
    if CUDA:
        torch.cuda.synchronize()


def bench(fn, warmup=2, min_reps=3, max_reps=20, budget_ms=300.0):
    if not CUDA:
        warmup, min_reps, max_reps = 0, 1, 1
    for _ in range(warmup):
        fn()
    sync()
    times = []
    while True:
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        if len(times) >= max_reps or (len(times) >= min_reps and sum(times) >= budget_ms):
            return statistics.median(times)


def extra_memory(fn, returned_bytes=0):
    """Peak bytes during fn beyond what was allocated before it, minus what it returns."""
    if not CUDA:
        fn()
        return None
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    sync()
    peak = torch.cuda.max_memory_allocated()
    del out
    return peak - base - returned_bytes


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    d = b.norm().item()
    return (a - b).norm().item() / d if d > 0 else (a - b).norm().item()


def record(section, shape, name, **kw):
    row = dict(section=section, N=shape[0], H=shape[1], V=shape[2], name=name, **kw)
    RESULTS["rows"].append(row)
    parts = []
    for k, v in kw.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    log(f"  [{section}] {name:38s} " + " ".join(parts))
    return row


_SIDE = {}


def side_stream():
    if not CUDA:
        return None
    if "s" not in _SIDE:
        lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
        _SIDE["s"] = torch.cuda.Stream(priority=hi)
        _SIDE["lo"] = torch.cuda.Stream()
    return _SIDE["s"]


def on(stream):
    return torch.cuda.stream(stream) if (CUDA and stream is not None) else contextlib.nullcontext()


class Ev:
    """A CUDA event, or nothing on CPU."""

    def __init__(self):
        self.e = torch.cuda.Event() if CUDA else None

    def record(self, stream=None):
        if self.e is not None:
            self.e.record(stream or torch.cuda.current_stream())

    def wait(self, stream=None):
        if self.e is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.e)


def make_inputs(n, hdim, v, seed=0, spread=2.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(n, hdim, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, hdim, device=DEV, generator=g) / math.sqrt(hdim) * spread).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    return h, w, y


# ------------------------------------------------------------------------------------ kernels
@triton.jit
def _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    in_group = GROUP_M * num_pid_n
    group = tile_id // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % in_group) % size_m
    pid_n = (tile_id % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _stats_epilogue(acc, pid_m, pid_n, M, NV, inv_t, tgt_ptr, pm_ptr, ps_ptr, pe_ptr, tz_ptr,
                    c_ptr, stride_c, BM: tl.constexpr, BN: tl.constexpr, STATS: tl.constexpr,
                    WANT_ENT: tl.constexpr, STORE: tl.constexpr):
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < NV
    if STORE:
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if STATS:
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        m = tl.max(z, axis=1)
        e = tl.exp(z - m[:, None])
        out = pid_n.to(tl.int64) * M + rows
        tl.store(pm_ptr + out, m, mask=row_ok)
        tl.store(ps_ptr + out, tl.sum(e, axis=1), mask=row_ok)
        if WANT_ENT:
            d = tl.where(col_ok[None, :], z - m[:, None], 0.0)
            tl.store(pe_ptr + out, tl.sum(e * d, axis=1), mask=row_ok)
        t = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        zt = tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), axis=1)
        tl.store(tz_ptr + rows, zt, mask=row_ok & (t >= pid_n * BN) & (t < pid_n * BN + BN))


@triton.jit
def _gemm_stats_ptr(h_ptr, w_ptr, c_ptr, tgt_ptr, pm_ptr, ps_ptr, pe_ptr, tz_ptr,
                    M, NV, K, stride_h, stride_w, stride_c, inv_t,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    STATS: tl.constexpr, WANT_ENT: tl.constexpr, STORE: tl.constexpr,
                    DOT_F32: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(NV, BN)
    pid_m, pid_n = _tile_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    rows = (pid_m * BM + tl.arange(0, BM)) % M
    cols = (pid_n * BN + tl.arange(0, BN)) % NV
    offs_k = tl.arange(0, BK)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if DOT_F32:  # the CPU interpreter's bf16 tl.dot is wrong (Triton 3.9): upcast there only
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    _stats_epilogue(acc, pid_m, pid_n, M, NV, inv_t, tgt_ptr, pm_ptr, ps_ptr, pe_ptr, tz_ptr,
                    c_ptr, stride_c, BM, BN, STATS, WANT_ENT, STORE)


@triton.jit
def _gemm_stats_tma(h_ptr, w_ptr, c_ptr, tgt_ptr, pm_ptr, ps_ptr, pe_ptr, tz_ptr,
                    M, NV, K, stride_h, stride_w, stride_c, inv_t, NUM_PROGS,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    STATS: tl.constexpr, WANT_ENT: tl.constexpr, STORE: tl.constexpr,
                    FLATTEN: tl.constexpr, DOT_F32: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, K], strides=[stride_h, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(w_ptr, shape=[NV, K], strides=[stride_w, 1], block_shape=[BN, BK])
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(NV, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            if DOT_F32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        _stats_epilogue(acc, pid_m, pid_n, M, NV, inv_t, tgt_ptr, pm_ptr, ps_ptr, pe_ptr, tz_ptr,
                        c_ptr, stride_c, BM, BN, STATS, WANT_ENT, STORE)


_ALLOC = {}


def _set_allocator():
    if "done" not in _ALLOC:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=DEV))
        _ALLOC["done"] = True


def gemm_stats(h, w, local_target, nv, inv_t, cfg, *, stats=True, want_ent=False, store=None):
    """Triton logits GEMM with the softmax partials of each [BM, BN] tile in its epilogue.

    Returns (pm, ps, pe, tz) with pm/ps/pe [col_tiles, M] and tz [M] (0 where the target is
    elsewhere); `store` (a [M, >= nv] tensor) also receives the bf16 logits."""
    kind, BM, BN, BK, warps, stages, group = cfg[:7]
    M, K = h.shape
    assert K % BK == 0
    T = triton.cdiv(nv, BN)
    f32 = dict(dtype=torch.float32, device=h.device)
    if stats:
        pm, ps = torch.empty(T, M, **f32), torch.empty(T, M, **f32)
        pe = torch.empty(T, M, **f32) if want_ent else pm
        tz = torch.zeros(M, **f32)
    else:
        pm = ps = pe = tz = torch.empty(1, **f32)
    c = store if store is not None else pm
    stride_c = store.stride(0) if store is not None else 0
    tiles = triton.cdiv(M, BM) * T
    common = (h, w, c, local_target, pm, ps, pe, tz, M, nv, K, h.stride(0), w.stride(0), stride_c, float(inv_t))
    meta = dict(BM=BM, BN=BN, BK=BK, GROUP_M=group, STATS=stats, WANT_ENT=want_ent, STORE=store is not None,
                DOT_F32=not CUDA, num_warps=warps, num_stages=stages)
    if kind == "ptr":
        _gemm_stats_ptr[(tiles,)](*common, **meta)
    else:
        _set_allocator()
        progs = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 4)
        _gemm_stats_tma[(progs,)](*common, progs, FLATTEN=cfg[7], **meta)
    return pm, ps, (pe if want_ent else None), tz


def merge_partials(pm, ps, pe=None):
    """[T, M] per-tile (max, sum exp(z - max), sum exp(z - max)(z - max)) -> (lse, entropy)."""
    m = pm.max(0).values
    scale = torch.exp(pm - m)
    s = (ps * scale).sum(0)
    lse = m + torch.log(s)
    ent = None
    if pe is not None:  # sum_k e^{z_k - m} (z_k - m) over all tiles, then H = log s - that / s
        se = ((pe + (pm - m) * ps) * scale).sum(0)
        ent = torch.log(s) - se / s
    return lse, ent


@triton.jit
def _ptile_kernel(tile_ptr, stride_row, tgt_ptr, mref_ptr, s_ptr, mseen_ptr, tz_ptr,
                  ncols, nvalid, inv_t, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """Sweep A of the lean schedule, one row of a [Ct, Cv] logits tile per program: overwrite the
    tile with P = exp(z - mref) (mref = this row's max over the first vocab block), add sum P to
    s, keep the largest z seen (mseen) and the target logit (tile-relative target, -1 elsewhere)."""
    row = tl.program_id(0)
    rp = tile_ptr + row.to(tl.int64) * stride_row
    t = tl.load(tgt_ptr + row)
    z_t = tl.load(rp + tl.maximum(t, 0)).to(tl.float32) * inv_t
    if FIRST:
        m = tl.full([], float("-inf"), tl.float32)
        for c0 in range(0, nvalid, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            z = tl.load(rp + cols, mask=cols < nvalid, other=float("-inf")).to(tl.float32) * inv_t
            m = tl.maximum(m, tl.max(z, axis=0))
        mref = m
        tl.store(mref_ptr + row, mref)
        s = tl.zeros([], tl.float32)
        mseen = m
    else:
        mref = tl.load(mref_ptr + row)
        s = tl.load(s_ptr + row)
        mseen = tl.load(mseen_ptr + row)
    for c0 in range(0, ncols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        valid = cols < nvalid
        z = tl.load(rp + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        mseen = tl.maximum(mseen, tl.max(z, axis=0))
        e = tl.exp(z - mref)
        s += tl.sum(e, axis=0)
        tl.store(rp + cols, e.to(tile_ptr.dtype.element_ty), mask=cols < ncols)
    tl.store(s_ptr + row, s)
    tl.store(mseen_ptr + row, mseen)
    if t >= 0:
        tl.store(tz_ptr + row, z_t)


def ptile_(tile, tgt_rel, mref, s, mseen, tz, nvalid, inv_t, first):
    n, ncols = tile.shape
    _ptile_kernel[(n,)](tile, tile.stride(0), tgt_rel, mref, s, mseen, tz, ncols, max(nvalid, 0),
                        float(inv_t), FIRST=first, BLOCK=2048 if CUDA else 64, num_warps=8)


def rel_target(y, start, end):
    t = y - start
    return torch.where((t >= 0) & (t < end - start), t, -1).contiguous()


# ------------------------------------------------------------------------------------ schedules
def forward_tiled(h, w, y, cv, streams):
    """RL forward, no_grad: vocab tiles [N, cv] (all rows), stats of tile j on a side stream while
    the GEMM of tile j+1 runs. Returns (logprobs, lse)."""
    n, v = h.shape[0], w.shape[0]
    nb = triton.cdiv(v, cv)
    f32 = dict(dtype=torch.float32, device=h.device)
    pm, ps, tz = torch.empty(nb, n, **f32), torch.empty(nb, n, **f32), torch.zeros(n, **f32)
    bufs = [torch.empty(n, cv, dtype=h.dtype, device=h.device) for _ in range(2 if streams else 1)]
    side = side_stream() if streams else None
    free = [Ev() for _ in bufs]
    for j in range(nb):
        start, end = j * cv, min(v, (j + 1) * cv)
        buf = bufs[j % len(bufs)][:, :end - start]
        free[j % len(bufs)].wait()
        torch.mm(h, w[start:end].t(), out=buf)
        ready = Ev()
        ready.record()
        with on(side):
            ready.wait(side)
            st = tb.shard_stats(buf, rel_target(y, start, end), end - start, 1.0)
            pm[j].copy_(st.max)
            ps[j].copy_(st.sum_exp)
            tz.add_(st.target)
            free[j % len(bufs)].record(side)
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    lse, _ = merge_partials(pm, ps)
    return tz - lse, lse


def forward_fused(h, w, y, cfg, want_ent=False):
    pm, ps, pe, tz = gemm_stats(h, w, y, w.shape[0], 1.0, cfg, want_ent=want_ent)
    lse, ent = merge_partials(pm, ps, pe)
    return tz - lse, lse


def pipelined_tiles(keys, bufs, gemm_in, side_op, gemm_out, streams):
    """For each tile key: gemm_in (main stream) writes a logits tile into a buffer, side_op (side
    stream, or main) transforms it in place, gemm_out (main) consumes it. With 2 streams and 2
    buffers, tile k's side_op runs while tile k+1's gemm_in does: gemm_out(k) is issued after
    gemm_in(k+1)."""
    side = side_stream() if streams else None
    pending = None
    for k, key in enumerate(keys):
        buf = bufs[k % len(bufs)]
        gemm_in(key, buf)
        ready = Ev()
        ready.record()
        with on(side):
            ready.wait(side)
            side_op(key, buf)
            done = Ev()
            done.record(side)
        if side is None:
            gemm_out(key, buf)
            continue
        if pending is not None:
            pending[2].wait()
            gemm_out(pending[0], pending[1])
        pending = (key, buf, done)
    if pending is not None:
        pending[2].wait()
        gemm_out(pending[0], pending[1])


def _mm_f32(a, b, out, accumulate):
    if CUDA:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.add_(a.float() @ b.float())
    else:
        out.copy_(a.float() @ b.float())


def lean_ce(h, w, y, *, ct_a, cv_a, ct_b, cv_b, streams=False, overflow_limit=60.0):
    """Lean CE mean (TP=1): fwd+bwd gradients with O(tile) working memory. Returns (loss, dx, dw).

    Sweep A (token chunks outer, vocab blocks inner): P = exp(z - mref) tiles, acc += P @ W_j in
    fp32 -> lse and E = sum_k p_k W_k per token -> dX = (E - W_y) / N (exact fp32 accumulation).
    Sweep B (vocab blocks outer, token chunks inner): dlogits tiles, dW_j = dlogits^T @ h with
    K = tokens (one GEMM when ct_b >= N, else an fp32 [cv_b, H] accumulator)."""
    n, hd = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    nbuf = 2 if streams else 1
    inv_n = 1.0 / n
    lse = torch.empty(n, **f32)
    tz = torch.zeros(n, **f32)
    dx = torch.empty_like(h)
    # ---- sweep A
    row_chunks = [(r0, min(n, r0 + ct_a)) for r0 in range(0, n, ct_a)]
    col_blocks = [(c0, min(v, c0 + cv_a)) for c0 in range(0, v, cv_a)]
    state = {r: dict(mref=torch.empty(r[1] - r[0], **f32), s=torch.empty(r[1] - r[0], **f32),
                     mseen=torch.empty(r[1] - r[0], **f32)) for r in row_chunks}
    acc_a = torch.empty(ct_a, hd, **f32)  # gemm_out runs in tile order: one chunk's accumulator at a time
    bufs = [torch.empty(ct_a, cv_a, dtype=h.dtype, device=h.device) for _ in range(nbuf)]
    keys = [(ri, r, ci, c) for ri, r in enumerate(row_chunks) for ci, c in enumerate(col_blocks)]
    flags = []

    def view(key, buf):
        _, (r0, r1), _, (c0, c1) = key
        return buf[:r1 - r0, :c1 - c0]

    def gemm_in(key, buf):
        _, (r0, r1), _, (c0, c1) = key
        torch.mm(h[r0:r1], w[c0:c1].t(), out=view(key, buf))

    def side_op(key, buf):
        _, r, ci, (c0, c1) = key
        st = state[r]
        ptile_(view(key, buf), rel_target(y[r[0]:r[1]], c0, c1), st["mref"], st["s"], st["mseen"],
               tz[r[0]:r[1]], c1 - c0, 1.0, ci == 0)

    def gemm_out(key, buf):
        ri, (r0, r1), ci, (c0, c1) = key
        acc = acc_a[:r1 - r0]
        _mm_f32(view(key, buf), w[c0:c1], acc, accumulate=ci > 0)
        if ci == len(col_blocks) - 1:  # chunk done: lse, dX = (E - W_y) / N
            st = state.pop((r0, r1))
            lse[r0:r1] = st["mref"] + torch.log(st["s"])
            flags.append((st["mseen"] - st["mref"]).max())
            dx[r0:r1] = ((acc / st["s"][:, None] - w[y[r0:r1]].float()) * inv_n).to(dx.dtype)

    pipelined_tiles(keys, bufs, gemm_in, side_op, gemm_out, streams)
    overflow = bool(torch.stack(flags).max() > overflow_limit)  # one host sync per call
    loss = (lse - tz).mean()
    # ---- sweep B
    dw = torch.empty_like(w)
    coef_p = torch.full((n,), inv_n, **f32)
    coef_t = torch.full((n,), -inv_n, **f32)
    one_k = ct_b >= n
    row_chunks = [(r0, min(n, r0 + ct_b)) for r0 in range(0, n, ct_b)]
    col_blocks = [(c0, min(v, c0 + cv_b)) for c0 in range(0, v, cv_b)]
    keys = [(ri, r, ci, c) for ci, c in enumerate(col_blocks) for ri, r in enumerate(row_chunks)]
    bufs = [torch.empty(min(ct_b, n), cv_b, dtype=h.dtype, device=h.device) for _ in range(nbuf)]
    accb = None if one_k else torch.empty(cv_b, hd, **f32)

    def side_op_b(key, buf):
        _, (r0, r1), _, (c0, c1) = key
        tb.shard_dlogits_(view(key, buf), rel_target(y[r0:r1], c0, c1), c1 - c0, 1.0, lse[r0:r1],
                          coef_p[r0:r1], None, coef_t[r0:r1], None)

    def gemm_out_b(key, buf):
        ri, (r0, r1), ci, (c0, c1) = key
        tile = view(key, buf)
        if one_k:
            torch.mm(tile.t(), h[r0:r1], out=dw[c0:c1])
            return
        acc = accb[:c1 - c0]
        _mm_f32(tile.t(), h[r0:r1], acc, accumulate=ri > 0)
        if ri == len(row_chunks) - 1:
            dw[c0:c1] = acc

    pipelined_tiles(keys, bufs, gemm_in, side_op_b, gemm_out_b, streams)
    return loss, dx, dw, overflow


def fast_ce_vocab_pipeline(h, w, y, cv, streams):
    """Fast CE mean (TP=1), one token chunk of all rows: logits GEMM per vocab block (stats of block
    j on a side stream under GEMM j+1), then dlogits of block j (side) under the dW GEMM of block
    j-1 (main), dW per block with K = N in the weight dtype, dX one GEMM with K = V."""
    n, hd = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    nb = triton.cdiv(v, cv)
    logits = torch.empty(n, v, dtype=h.dtype, device=h.device)
    pm, ps, tz = torch.empty(nb, n, **f32), torch.empty(nb, n, **f32), torch.zeros(n, **f32)
    side = side_stream() if streams else None
    blocks = [(j * cv, min(v, (j + 1) * cv)) for j in range(nb)]
    for j, (c0, c1) in enumerate(blocks):
        blk = logits[:, c0:c1]
        torch.mm(h, w[c0:c1].t(), out=blk)
        ready = Ev()
        ready.record()
        with on(side):
            ready.wait(side)
            st = tb.shard_stats(blk, rel_target(y, c0, c1), c1 - c0, 1.0)
            pm[j].copy_(st.max)
            ps[j].copy_(st.sum_exp)
            tz.add_(st.target)
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    lse, _ = merge_partials(pm, ps)
    loss = (lse - tz).mean()
    coef_p = torch.full((n,), 1.0 / n, **f32)
    coef_t = torch.full((n,), -1.0 / n, **f32)
    dw = torch.empty_like(w)
    done = []
    start = Ev()
    start.record()
    with on(side):
        start.wait(side)
        for c0, c1 in blocks:
            tb.shard_dlogits_(logits[:, c0:c1], rel_target(y, c0, c1), c1 - c0, 1.0, lse, coef_p, None, coef_t, None)
            e = Ev()
            e.record(side)
            done.append(e)
    for (c0, c1), e in zip(blocks, done):
        e.wait()
        torch.mm(logits[:, c0:c1].t(), h, out=dw[c0:c1])
    dx = torch.mm(logits, w)
    return loss, dx, dw


def ce_into_main_grad(h, w, y, main_grad, chunk):
    """Grad-in-forward CE mean with dW added straight into fp32 main_grad (no buffer of its own)."""
    n = h.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    dx = torch.empty_like(h)
    losses = []
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        logits = torch.mm(h[r0:r1], w.t())
        st = tb.shard_stats(logits, y[r0:r1], w.shape[0], 1.0)
        lse = st.max + torch.log(st.sum_exp)
        losses.append((lse - st.target).sum())
        tb.shard_dlogits_(logits, y[r0:r1], w.shape[0], 1.0, lse, torch.full((r1 - r0,), 1.0 / n, **f32), None,
                          torch.full((r1 - r0,), -1.0 / n, **f32), None)
        torch.mm(logits, w, out=dx[r0:r1])
        torch.addmm(main_grad, logits.t(), h[r0:r1], out_dtype=torch.float32, out=main_grad)
        del logits
    return torch.stack(losses).sum() / n, dx


# ------------------------------------------------------------------------------------ sections
def reference(h, w, y):
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy((hh @ ww.t()).float(), y)
    dx, dw = torch.autograd.grad(loss, (hh, ww))
    return loss.detach(), dx, dw


def sec_floors(shape, h, w, y, ctx):
    n, hd, v = shape
    f1 = bench(lambda: h @ w.t())
    def three():
        lg = h @ w.t()
        return lg @ w, lg.t() @ h
    f3 = bench(three)
    ctx.update(floor1=f1, floor3=f3)
    record("floors", shape, "floor 1 GEMM", ms=f1, tflops=2 * n * hd * v / f1 / 1e9)
    record("floors", shape, "floor 3 GEMMs", ms=f3, tflops=6 * n * hd * v / f3 / 1e9)


def sec_overlap(shape, h, w, y, ctx):
    n, hd, v = shape
    c = min(n, 4096)
    hc, yc = h[:c], y[:c]
    a = torch.mm(hc, w.t())
    b = a.clone()
    lse = torch.logsumexp(a.float(), 1)
    ones = torch.ones(c, device=DEV)
    side = side_stream()
    g = lambda: torch.mm(hc, w.t(), out=a)  # noqa: E731
    s = lambda: tb.shard_stats(b, yc, v, 1.0)  # noqa: E731
    d = lambda: tb.shard_dlogits_(b, yc, v, 1.0, lse, ones, None, -ones, None)  # noqa: E731
    gw = lambda: torch.mm(a.t(), hc)  # noqa: E731
    t_g, t_s, t_d, t_gw = bench(g), bench(s), bench(d), bench(gw)

    def conc(first, second, stream):
        def fn():
            ev = Ev()
            ev.record()
            first()
            with on(stream):
                ev.wait(stream)
                second()
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
        return fn

    def serial(first, second):
        def fn():
            first()
            second()
        return fn
    rows = {
        "gemm alone": t_g, "stats alone": t_s, "dlogits alone": t_d, "dW gemm alone": t_gw,
        "gemm+stats serial": bench(serial(g, s)),
        "gemm+stats 2 streams (hi prio)": bench(conc(g, s, side)) if CUDA else None,
        "gemm+stats 2 streams (normal prio)": bench(conc(g, s, _SIDE.get("lo"))) if CUDA else None,
        "dWgemm+dlogits serial": bench(serial(gw, d)),
        "dWgemm+dlogits 2 streams (hi prio)": bench(conc(gw, d, side)) if CUDA else None,
    }
    for k, val in rows.items():
        if val is None:
            continue
        extra = {}
        if "2 streams" in k:
            base, small = (t_g, t_s) if "stats" in k else (t_gw, t_d)
            extra["hidden_frac"] = (base + small - val) / small
        record("overlap", shape, k, ms=val, **extra)


FUSED_CONFIGS = [
    # kind, BM, BN, BK, warps, stages, group, flatten
    ("ptr", 128, 256, 64, 8, 3, 8, False),
    ("ptr", 128, 256, 64, 8, 4, 8, False),
    ("ptr", 128, 128, 64, 8, 4, 8, False),
    ("ptr", 256, 128, 64, 8, 3, 8, False),
    ("tma", 128, 256, 64, 8, 3, 8, False),
    ("tma", 128, 256, 64, 8, 4, 8, True),
    ("tma", 128, 128, 64, 8, 4, 8, True),
    ("tma", 128, 256, 64, 8, 3, 8, True),
]


def sec_fused(shape, h, w, y, ctx):
    n, hd, v = shape
    z32 = h.float() @ w.float().t()  # the fused kernel keeps the fp32 logits (no bf16 rounding)
    ref_lse = torch.logsumexp(z32, 1)
    ref_t = z32.gather(1, y[:, None]).squeeze(1)
    del z32
    best = None
    configs = FUSED_CONFIGS if CUDA else [("ptr", 16, 32, 16, 4, 1, 2, False), ("tma", 16, 32, 16, 4, 1, 2, True)]
    for cfg in configs:
        name = "fused " + ",".join(str(x) for x in cfg)
        try:
            pm, ps, _, tz = gemm_stats(h, w, y, v, 1.0, cfg)
            lse, _ = merge_partials(pm, ps)
            err = max(rel(lse, ref_lse), rel(tz, ref_t))
            del pm, ps, tz
            t = bench(lambda: gemm_stats(h, w, y, v, 1.0, cfg))
            t_plain = bench(lambda: gemm_stats(h, w, y, v, 1.0, cfg, stats=False, store=torch.empty(n, v, dtype=h.dtype, device=DEV))) if CUDA else float("nan")
            record("fused", shape, name, ms=t, x_floor1=t / ctx.get("floor1", float("nan")),
                   plain_gemm_ms=t_plain, err=err)
            if err < 5e-3 and (best is None or t < best[0]):
                best = (t, cfg)
        except Exception as exc:  # noqa: BLE001
            record("fused", shape, name, failed=f"{type(exc).__name__}: {str(exc)[:300]}")
    ctx["fused_cfg"] = best[1] if best else None


def sec_forward(shape, h, w, y, ctx):
    n, hd, v = shape
    f1 = ctx.get("floor1", float("nan"))
    ref_lp = torch.log_softmax((h @ w.t()).float(), 1).gather(1, y[:, None]).squeeze(1)
    dense = 2.0 * n * v
    variants = {
        "package no_grad (auto)": lambda: linear_logprobs(h, w, y, impl="triton").logprobs,
        "package no_grad +entropy": lambda: linear_logprobs(h, w, y, impl="triton", return_entropy=True).logprobs,
    }
    for cv in (8192, 16384):
        if cv < v:
            variants[f"tiled cv={cv}"] = lambda cv=cv: forward_tiled(h, w, y, cv, False)[0]
            variants[f"tiled cv={cv} 2 streams"] = lambda cv=cv: forward_tiled(h, w, y, cv, True)[0]
    if ctx.get("fused_cfg"):
        cfg = ctx["fused_cfg"]
        variants["fused " + ",".join(str(x) for x in cfg)] = lambda: forward_fused(h, w, y, cfg)[0]
        variants["fused +entropy"] = lambda: forward_fused(h, w, y, cfg, want_ent=True)[0]
    with torch.no_grad():
        for name, fn in variants.items():
            try:
                err = rel(fn(), ref_lp)
                mem = extra_memory(fn, 4 * n)
                t = bench(fn)
                record("forward", shape, name, ms=t, x_floor1=t / f1, err=err,
                       extra_pct=None if mem is None else 100.0 * mem / dense)
            except Exception as exc:  # noqa: BLE001
                record("forward", shape, name, failed=f"{type(exc).__name__}: {str(exc)[:300]}")


def lean_sizes(n, hd, v, budget):
    cv_a = min(v, 16384)
    ct_a = max(128, min(n, (budget // (2 * cv_a + 4 * hd)) // 128 * 128))
    ct_b = min(n, 16384)
    if ct_b >= n:
        cv_b = max(256, budget // (2 * ct_b) // 256 * 256)
    else:
        ct_b = 8192
        cv_b = max(256, budget // (2 * ct_b + 4 * hd) // 256 * 256)
    return dict(ct_a=ct_a, cv_a=cv_a, ct_b=ct_b, cv_b=min(cv_b, v))


def sec_lean_fast(shape, h, w, y, ctx):
    n, hd, v = shape
    f3 = ctx.get("floor3", float("nan"))
    dense = 2.0 * n * v
    ref = reference(h, w, y)
    ret = (h.numel() + w.numel()) * 2
    budget = int(0.025 * 2 * 8192 * v) if CUDA else 4 * 2 * 16 * v
    sizes = lean_sizes(n, hd, v, budget)
    variants = {
        "package CE (auto)": lambda: _pkg_ce(h, w, y, None),
        "package CE one chunk": lambda: _pkg_ce(h, w, y, n),
        "package logprobs fwd+bwd (auto)": lambda: _pkg_lp(h, w, y),
        f"lean {sizes}": lambda: lean_ce(h, w, y, **sizes)[:3],
        "lean 2 streams": lambda: lean_ce(h, w, y, streams=True, **sizes)[:3],
        "fast vocab pipeline cv=16384": lambda: fast_ce_vocab_pipeline(h, w, y, 16384 if CUDA else 64, False),
        "fast vocab pipeline cv=16384 2 streams": lambda: fast_ce_vocab_pipeline(h, w, y, 16384 if CUDA else 64, True),
        "fast vocab pipeline cv=32768 2 streams": lambda: fast_ce_vocab_pipeline(h, w, y, 32768 if CUDA else 128, True),
    }
    for name, fn in variants.items():
        try:
            out = fn()
            errs = dict(err_loss=rel(out[0], ref[0]), err_dx=rel(out[1], ref[1]), err_dw=rel(out[2], ref[2]))
            del out
            mem = extra_memory(fn, ret)
            t = bench(fn)
            record("ce", shape, name, ms=t, x_floor3=t / f3, extra_pct=None if mem is None else 100.0 * mem / dense,
                   extra_pct_at_8192=None if mem is None else 100.0 * mem / (2.0 * 8192 * v), **errs)
        except Exception as exc:  # noqa: BLE001
            record("ce", shape, name, failed=f"{type(exc).__name__}: {str(exc)[:300]}",
                   tb=traceback.format_exc()[-800:])
    # main_grad: package path vs dW straight into main_grad
    for name, chunk in (("package CE main_grad (auto)", None), ("into main_grad, chunk 4096", 4096),
                        ("into main_grad, one chunk", n)):
        try:
            mg = torch.zeros(w.shape, dtype=torch.float32, device=DEV)
            if name.startswith("package"):
                ww = w.detach().clone().requires_grad_()
                ww.main_grad = mg
                hh = h.detach().clone().requires_grad_()

                def fn():
                    loss = linear_cross_entropy(hh, ww, y, impl="triton", accumulate_into_main_grad=True)
                    dx, _ = torch.autograd.grad(loss, (hh, ww), allow_unused=True)
                    return dx
            else:
                def fn(chunk=min(chunk, n)):
                    return ce_into_main_grad(h, w, y, mg, chunk)[1]
            mg.zero_()
            dx = fn()
            errs = dict(err_dx=rel(dx, ref[1]), err_dw=rel(mg, ref[2]))
            del dx
            mem = extra_memory(fn, h.numel() * 2)
            t = bench(fn)
            record("main_grad", shape, name, ms=t, x_floor3=t / f3,
                   extra_pct=None if mem is None else 100.0 * mem / dense, **errs)
        except Exception as exc:  # noqa: BLE001
            record("main_grad", shape, name, failed=f"{type(exc).__name__}: {str(exc)[:300]}")


def _pkg_ce(h, w, y, chunk):
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, chunk_size=chunk, impl="triton")
    dx, dw = torch.autograd.grad(loss, (hh, ww))
    return loss.detach(), dx, dw


def _pkg_lp(h, w, y):
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = -linear_logprobs(hh, ww, y, impl="triton").logprobs.mean()
    dx, dw = torch.autograd.grad(loss, (hh, ww))
    return loss.detach(), dx, dw


SECTIONS = {"floors": sec_floors, "overlap": sec_overlap, "fused": sec_fused, "forward": sec_forward,
            "ce": sec_lean_fast}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x4096x128256,8192x2304x256000,16384x3584x152064")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/proto_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.quick or not CUDA:
        shapes = [(96, 32, 300)]
    RESULTS["env"] = dict(torch=torch.__version__, triton=triton.__version__,
                          device=torch.cuda.get_device_name(0) if CUDA else "cpu")
    log(json.dumps(RESULTS["env"]))
    t0 = time.time()
    for shape in shapes:
        log(f"\n== N={shape[0]} H={shape[1]} V={shape[2]}")
        h, w, y = make_inputs(*shape)
        ctx = {}
        for sec in args.sections.split(","):
            try:
                SECTIONS[sec](shape, h, w, y, ctx)
            except Exception as exc:  # noqa: BLE001
                record(sec, shape, "SECTION FAILED", failed=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()[-1500:])
            with open(os.path.join(args.out, "proto.json"), "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)
            if CUDA:
                torch.cuda.empty_cache()
        log(f"  [{time.time() - t0:.0f} s]")
        del h, w, y
    log("\n== summary")
    for r in RESULTS["rows"]:
        keys = [k for k in ("ms", "x_floor1", "x_floor3", "hidden_frac", "extra_pct", "err", "err_dx", "err_dw", "failed")
                if k in r and r[k] is not None]
        log(f"{r['N']}x{r['H']}x{r['V']} {r['section']:9s} {r['name'][:60]:60s} " +
            " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={str(r[k])[:80]}" for k in keys))


if __name__ == "__main__":
    main()
