"""Sampling-mask replay through the Triton backend (impl="triton") against the torch backend.

Replay's own math is the same torch code on both backends (backends/replay_torch.py); what differs
is the plain path of the rows without truncation (statistics in the logits GEMM's epilogue,
dlogits from the GEMM's epilogue) and the kernels around the pieces. Without a GPU the kernels run
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set at import), as in
tests/test_triton_backend.py. Integer bf16 logits: both backends see the same z, so the kept
labels match exactly and the values to fp32 rounding.
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
    if DEVICE.type != "cuda":
        kernel_modules()


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
