"""Sampling-mask replay through the Triton backend (impl="triton") against the torch backend, and
replay_triton's kept-set kernels against the torch math of backends/replay_torch.py.

On the Triton backend the rows with a set are scored by replay_triton's kernels (gathered W rows,
their dots and statistics in one kernel; dX per row; dW by a segmented sum over the entries sorted
by id and fp32 atomic adds), the rows without one by the plain path's epilogue GEMMs. Without a
GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set at import),
as in tests/test_triton_backend.py. Integer-valued inputs: both backends see the same z, so the
kept labels match exactly and the values to fp32 rounding.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from triton_interpret import kernel_modules  # noqa: E402
from megatron_fused_ce import linear_logprobs  # noqa: E402
from megatron_fused_ce.ops import replay  # noqa: E402
from sampling_mask_cases import random_sets  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def triton_kernels():
    """{name: kernel module}, interpreted off CUDA."""
    if DEVICE.type != "cuda":
        return kernel_modules()
    from megatron_fused_ce.ops.backends import replay_triton

    return {"replay_triton": replay_triton}


@pytest.mark.parametrize("force", [None, "sparse", "dense"])
def test_triton_backend_matches_torch(triton_kernels, force, monkeypatch):
    monkeypatch.setattr(replay, "FORCE_PIECES", force)
    g = torch.Generator().manual_seed(7)
    n, hidden, vocab, v_local = 24, 64, 61, 64  # H = the epilogue GEMMs' BLOCK_K: they run
    h = torch.randint(-2, 3, (n, hidden), generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randint(-2, 3, (v_local, hidden), generator=g) * 0.25).to(torch.bfloat16).to(DEVICE)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::6] = -100
    ids, offsets = random_sets(g, n, vocab, y, sizes=(1, 4, 20))
    grad = torch.randn(n, generator=g).to(DEVICE)
    results = []
    for impl in ("torch", "triton"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_logprobs(hh, ww, y.to(DEVICE), vocab_size=vocab, temperature=0.7, chunk_size=9,
                              return_entropy=True, impl=impl, sampling_mask=(ids.to(DEVICE), offsets.to(DEVICE)))
        finite = torch.isfinite(out.logprobs)
        ((torch.where(finite, out.logprobs, 0.0) * grad).sum() + out.entropy.sum()).backward()
        results.append((finite, out.logprobs.detach(), out.entropy.detach(), hh.grad, ww.grad))
    (fa, *a), (fb, *b) = results
    assert torch.equal(fa, fb) and not fa.all()
    for name, x, z in zip(("lp", "entropy", "dX", "dW"), a, b):
        x, z = x.float(), z.float()
        if name == "lp":
            x, z = x[fa], z[fa]
        assert (x - z).norm() <= 1e-2 * z.norm() + 1e-6, name  # bf16 dX / dW: GEMMs round differently


# ---------------------------------------------------------------- the kept-set kernels against the torch math
def _kept_entries(seed, *, dtype, pool, hidden=40, positions=60, vocab=97, tp=2, rank=1, max_k=11):
    """Inputs of one shard's kept-set math: sets drawn from `pool` ids (a small pool: ids shared
    by many rows, long runs of one id in the sorted entries), a fifth empty, a fifth of
    the positions unlabelled, the shard [rank * V_local, ...) of a padded vocab."""
    g = torch.Generator().manual_seed(seed)
    v_local = -(-(vocab + 3) // tp)
    vocab_start, num_valid = rank * v_local, min(max(vocab - rank * v_local, 0), v_local)
    # a small pool: four ids of this shard and two of the other's
    pool_ids = torch.arange(vocab) if pool >= vocab else torch.cat([torch.arange(vocab_start, vocab_start + pool - 2),
                                                                    torch.arange(2)])
    sizes = torch.randint(1, max_k + 1, (positions,), generator=g).clamp(max=pool_ids.numel())
    sizes[torch.rand(positions, generator=g) < 0.2] = 0
    ids = torch.cat([pool_ids[torch.randperm(pool_ids.numel(), generator=g)[:int(k)]] for k in sizes])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    labels = torch.randint(0, vocab, (positions,), generator=g)
    hit = torch.rand(positions, generator=g) < 0.6  # labels in their sets
    labels[hit & (sizes > 0)] = ids[offsets[:-1][hit & (sizes > 0)]]
    labelled = torch.rand(positions, generator=g) > 0.2
    # three padding slots past the rows with a set, as a call sized from the host's counts has
    entries = replay.KeptEntries(ids.to(DEVICE), offsets.to(DEVICE), labels.to(DEVICE), labelled.to(DEVICE),
                                 vocab_start, num_valid, int(((sizes > 0) & labelled).sum()) + 3)
    h = torch.randint(-2, 3, (positions, hidden), generator=g).to(dtype).to(DEVICE)
    w = (torch.randint(-2, 3, (v_local, hidden), generator=g) * 0.25).to(dtype).to(DEVICE)
    return entries, h, w, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool", [6, 97], ids=["shared-ids", "spread-ids"])
def test_kept_kernels_match_the_torch_math(triton_kernels, dtype, pool, monkeypatch):
    """replay_triton's kernels give replay_torch's statistics, z and gradients: rows spanning
    several entry blocks (online max), H not a multiple of the H block, ids off this shard and in
    the padding, rows without an entry here, labels in and out of their sets, and dW added into
    a buffer that holds values (main_grad) where one id's entries span several blocks."""
    from megatron_fused_ce.ops.backends import replay_torch

    replay_triton = triton_kernels["replay_triton"]
    for name, value in (("STATS_BLOCK_E", 4), ("STATS_BLOCK_H", 16), ("GRAD_BLOCK_E", 4), ("GRAD_BLOCK_H", 16)):
        monkeypatch.setattr(replay_triton, name, value)
    entries, h, w, g = _kept_entries(11, dtype=dtype, pool=pool, max_k=4 if pool < 97 else 11)
    round_to = None if dtype == torch.float32 else dtype
    got, z = replay_triton.kept_stats(h, w, entries, 0.7, round_to, True, True, 0)
    want, z_ref = replay_torch.kept_stats(h, w, entries, 0.7, round_to, True, True, 1 << 20)
    assert torch.equal(torch.isfinite(got.max), torch.isfinite(want.max)) and not torch.isfinite(got.max).all()
    torch.testing.assert_close(z, z_ref, rtol=1e-6, atol=1e-6)
    for field in ("max", "sum_exp", "target", "sum_exp_shifted"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=1e-6)
    d = torch.where(entries.valid, torch.randn(entries.ids.numel(), generator=g).to(DEVICE), 0.0)
    start = torch.randn(w.shape, generator=g).to(DEVICE)
    results = []
    for math, blocks in ((replay_triton, 0), (replay_torch, 1 << 20)):
        dx, dw = torch.full_like(h, 7.0), start.clone()
        dx[entries.has_set] = 0.0  # the plain pass leaves zeros in the set rows; the kernels add
        math.kept_grads(h, w, entries, d, dx, dw, blocks)
        results.append((dx, dw))
    (dx, dw), (dx_ref, dw_ref) = results
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5)
    set_rows = entries.has_set.nonzero().squeeze(1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dx[set_rows].float(), dx_ref[set_rows].float(), rtol=tol, atol=tol)
    assert bool((dx[~entries.has_set] == 7.0).all())  # rows without a set: padding slots add zeros
