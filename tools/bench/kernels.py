"""The Triton kernels on one production-size chunk: checked against the torch backend, then
timed (a per-chunk breakdown of GEMMs and kernels, and launch-setting variants)."""

from __future__ import annotations

import math

import torch

from . import methods
from .measure import free, log, rel_err, time_step
from .report import write_json

def _chunk_inputs(device, chunk, hdim, v, seed):
    """A generator and one chunk's bf16 hidden rows and weight (logits of std ~2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(chunk, hdim, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, hdim, device=device, generator=g) / math.sqrt(hdim) * 2).to(torch.bfloat16)
    return g, h, w


def kernel_check_and_breakdown(args, device, results, shape, chunk):
    """Triton backend vs torch backend on production block sizes, and one chunk's cost split."""
    from megatron_fused_ce.ops.backends import torch_backend, triton_backend as tb
    n_tok, hdim, v = shape
    out = dict(shape=list(shape), chunk=chunk, checks={}, times_ms={})
    log(f"\n== kernel check + per-chunk breakdown: chunk [{chunk}, {v}] bf16, H={hdim}")
    g, h, w = _chunk_inputs(device, chunk, hdim, v, seed=5)
    nvc = v - 17  # some padding columns
    tgt = torch.randint(-1, nvc, (chunk,), device=device, generator=g)
    logits = h @ w.t()
    for rows in sorted({chunk, min(256, chunk), 7}, reverse=True):  # few rows: the column-split path
        lg = logits[:rows]
        for temp in (1.0, 0.7):
            a = tb.shard_stats(lg, tgt[:rows], nvc, 1 / temp, True, True)
            b = torch_backend.shard_stats(lg, tgt[:rows], nvc, 1 / temp, True, True)
            for f in ("max", "sum_exp", "target", "sum_logits", "sum_exp_shifted"):
                out["checks"][f"stats.{f} rows={rows} T={temp}"] = rel_err(getattr(a, f), getattr(b, f))
            lse = b.max + torch.log(b.sum_exp)
            cp, cpz, ct, cu = (torch.randn(rows, device=device, generator=g) for _ in range(4))
            ga = tb.shard_dlogits_(lg.clone(), tgt[:rows], nvc, 1 / temp, lse, cp, cpz, ct, cu)
            gb = torch_backend.shard_dlogits_(lg.clone(), tgt[:rows], nvc, 1 / temp, lse, cp, cpz, ct, cu)
            out["checks"][f"dlogits rows={rows} T={temp}"] = rel_err(ga, gb)
            out["checks"][f"dlogits padding zero rows={rows}"] = bool((ga[:, nvc:] == 0).all().item())
            ulp = ((ga.float() - gb.float()).abs() > 0).float().mean().item()
            out["checks"][f"dlogits frac elements differing rows={rows} T={temp}"] = ulp
    bad = [k for k, e in out["checks"].items() if isinstance(e, float) and "frac" not in k and not e < 1e-4]
    bad += [k for k, e in out["checks"].items() if e is False]
    out["ok"] = not bad
    log("  kernel check: " + ("OK" if not bad else f"FAILED: {bad}"))
    for k, e in out["checks"].items():
        log(f"    {k:48s} {e}")

    lse = torch.logsumexp(logits.float(), 1)
    ones = torch.ones(chunk, device=device)
    dw_acc = torch.zeros(v, hdim, dtype=torch.float32, device=device)
    dx = torch.empty_like(h)
    buf = logits.clone()

    def t(fn):
        return time_step(fn, 2, 5, 20, 150)[0]

    elems = chunk * v
    ops = {
        "logits GEMM (bf16 out)": lambda: torch.mm(h, w.t(), out=buf),
        "logits GEMM (fp32 out, out_dtype)": lambda: torch.mm(h, w.t(), out_dtype=torch.float32),
        "triton shard_stats": lambda: tb.shard_stats(logits, tgt, v, 1.0),
        "triton shard_stats +entropy+sum": lambda: tb.shard_stats(logits, tgt, v, 1.0, True, True),
        "torch shard_stats": lambda: torch_backend.shard_stats(logits, tgt, v, 1.0),
        "triton shard_dlogits_": lambda: tb.shard_dlogits_(buf, tgt, v, 1.0, lse, ones, None, -ones, None),
        "torch shard_dlogits_": lambda: torch_backend.shard_dlogits_(buf, tgt, v, 1.0, lse, ones, None, -ones, None),
        "dX GEMM": lambda: torch.mm(logits, w, out=dx),
        "dW GEMM bf16 out": lambda: torch.mm(logits.t(), h),
        "dW addmm into fp32 acc (out_dtype)": lambda: torch.addmm(dw_acc, logits.t(), h,
                                                                   out_dtype=torch.float32, out=dw_acc),
        "dW mm fp32 out + add_": lambda: dw_acc.add_(torch.mm(logits.t(), h, out_dtype=torch.float32)),
    }
    for name, fn in ops.items():
        try:
            ms = t(fn)
            out["times_ms"][name] = ms
            extra = ""
            if "stats" in name and "triton" in name:
                extra = f"  {2 * elems / ms / 1e6:.0f} GB/s (2 B/elt read)"
            if "dlogits" in name and "triton" in name:
                extra = f"  {4 * elems / ms / 1e6:.0f} GB/s (2 B/elt read + 2 written)"
            if "GEMM" in name or "addmm" in name:
                extra = f"  {2.0 * chunk * hdim * v / ms / 1e9:.0f} TFLOP/s"
            log(f"    {name:40s} {ms:8.3f} ms{extra}")
        except Exception as exc:  # noqa: BLE001
            out["times_ms"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            log(f"    {name:40s} failed: {exc}")
        free()
    # launch-setting variants of the two kernels (module attributes; restored afterwards)
    saved = {k: getattr(tb, k) for k in ("STATS_BLOCK_N", "STATS_WARPS", "DLOGITS_BLOCK_N", "DLOGITS_WARPS")}
    variants = [(1024, 4), (2048, 8), (4096, 8), (4096, 16)] if not args.quick else [(64, 4)]
    for block, warps in variants:
        tb.STATS_BLOCK_N, tb.STATS_WARPS, tb.DLOGITS_BLOCK_N, tb.DLOGITS_WARPS = block, warps, block, warps
        try:
            ms_s = t(lambda: tb.shard_stats(logits, tgt, v, 1.0))
            ms_d = t(lambda: tb.shard_dlogits_(buf, tgt, v, 1.0, lse, ones, None, -ones, None))
            out["times_ms"][f"variant block={block} warps={warps}: stats"] = ms_s
            out["times_ms"][f"variant block={block} warps={warps}: dlogits"] = ms_d
            log(f"    variant block={block:5d} warps={warps:2d}: stats {ms_s:.3f} ms "
                f"({2 * elems / ms_s / 1e6:.0f} GB/s), dlogits {ms_d:.3f} ms ({4 * elems / ms_d / 1e6:.0f} GB/s)")
        except Exception as exc:  # noqa: BLE001
            log(f"    variant block={block} warps={warps} failed: {exc}")
    for k, val in saved.items():
        setattr(tb, k, val)
    # few rows (TP / small microbatch): the column-split path
    for rows in (min(256, chunk),):
        ms = t(lambda: tb.shard_stats(logits[:rows], tgt[:rows], v, 1.0))
        out["times_ms"][f"triton shard_stats rows={rows}"] = ms
        log(f"    {'triton shard_stats rows=' + str(rows):40s} {ms:8.3f} ms  {2 * rows * v / ms / 1e6:.0f} GB/s")
    results["kernels"] = out
    write_json(results, args.out)
    del h, w, logits, buf, dw_acc, dx
    free()
    return out["ok"]


def sampler_kernel_check(args, device, results, shape, chunk):
    """The sampler-fidelity Triton kernels vs their torch reference on one production chunk
    (candidates must be identical), and their cost next to the plain stats kernel."""
    from megatron_fused_ce.ops.backends import sampling_torch as st, sampling_triton as sx, triton_backend as tb
    _, hdim, v = shape
    out = dict(shape=list(shape), chunk=chunk, checks={}, times_ms={})
    log(f"\n== sampler kernels: chunk [{chunk}, {v}] bf16, H={hdim}, T={methods.SAMPLER_TEMPERATURE}")
    g, h, w = _chunk_inputs(device, chunk, hdim, v, seed=6)
    logits, nvc, inv_t, start = h @ w.t(), v - 17, 1.0 / methods.SAMPLER_TEMPERATURE, 1000
    tgt = torch.randint(-1, nvc, (chunk,), device=device, generator=g)
    for m in (20, 50, 128):
        a, b = sx.shard_candidates(logits, nvc, inv_t, start, m), st.shard_candidates(logits, nvc, inv_t, start, m)
        out["checks"][f"candidates M={m} identical"] = bool(torch.equal(a, b))
    cz, cid, _ = st.decode_keys(st.shard_candidates(logits, nvc, inv_t, start, 128))
    row_max, z_cut, id_cut = cz[:, 0], cz[:, 9], cid[:, 9]  # keep the first 10 tokens
    a = sx.kept_sums(logits, tgt, nvc, inv_t, start, row_max, z_cut, id_cut, want_entropy=True, want_total=True)
    b = st.kept_sums(logits, tgt, nvc, inv_t, start, row_max, z_cut, id_cut, want_entropy=True, want_total=True)
    for f in ("sum_exp", "sum_exp_shifted", "total", "target"):
        out["checks"][f"kept_sums.{f}"] = rel_err(getattr(a, f), getattr(b, f))
    log_s = torch.log(b.sum_exp)
    cp, cpz, ct = (torch.randn(chunk, device=device, generator=g) for _ in range(3))
    args_d = (tgt, nvc, inv_t, start, row_max, log_s, z_cut, id_cut, cp, cpz, ct)
    out["checks"]["kept_dlogits"] = rel_err(sx.kept_dlogits_(logits.clone(), *args_d),
                                            st.kept_dlogits_(logits.clone(), *args_d))
    bad = [k for k, e in out["checks"].items() if e is False or (isinstance(e, float) and not e < 1e-4)]
    out["ok"] = not bad
    log("  sampler kernel check: " + ("OK" if not bad else f"FAILED: {bad}"))
    buf = logits.clone()
    ones = torch.ones(chunk, device=device)
    ops = {
        "plain: triton shard_stats": lambda: tb.shard_stats(logits, tgt, nvc, inv_t),
        "plain: triton shard_dlogits_": lambda: tb.shard_dlogits_(buf, tgt, nvc, inv_t, row_max, ones, None, -ones,
                                                                  None, log_sum_exp=log_s),
        "candidates M=20 (return_topk=20)": lambda: sx.shard_candidates(logits, nvc, inv_t, start, 20),
        "candidates M=50 (top_k=50)": lambda: sx.shard_candidates(logits, nvc, inv_t, start, 50),
        "candidates M=128 (top_p)": lambda: sx.shard_candidates(logits, nvc, inv_t, start, 128),
        "torch.topk k=128 of the chunk (for scale)": lambda: logits.topk(128, dim=1),
        "kept_sums (+target, +total)": lambda: sx.kept_sums(logits, tgt, nvc, inv_t, start, row_max, z_cut,
                                                            id_cut, want_total=True),
        "kept_dlogits_": lambda: sx.kept_dlogits_(buf, tgt, nvc, inv_t, start, row_max, log_s, z_cut, id_cut, ones,
                                                  None, -ones),
    }
    for name, fn in ops.items():
        try:
            ms = time_step(fn, 2, 5, 20, 150)[0]
            out["times_ms"][name] = ms
            log(f"    {name:44s} {ms:8.3f} ms  {2 * chunk * v / ms / 1e6:.0f} GB/s (2 B/elt read)")
        except Exception as exc:  # noqa: BLE001
            out["times_ms"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            log(f"    {name:44s} failed: {exc}")
        free()
    results["sampler_kernels"] = out
    write_json(results, args.out)
    del h, w, logits, buf
    free()
    return out["ok"]

