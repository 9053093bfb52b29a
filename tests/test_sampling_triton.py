"""The Triton sampling kernels (sampling_triton.py) against the torch reference (sampling_torch.py),
kernel by kernel and end to end through linear_logprobs(impl="triton").

As tests/test_triton_backend.py: without a GPU the kernels run on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, set at import), shapes are small and the launch settings are
shrunk so that the threshold (group maxima), the column splits and the buffer overflow of the
candidate kernel all run. Candidate keys and kept-set decisions must be identical (same fp32 z);
sums agree to fp32 rounding.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from dist import run_workers  # noqa: E402
from triton_interpret import kernel_modules  # noqa: E402
from megatron_fused_ce import linear_logprobs  # noqa: E402
from megatron_fused_ce.ops import sampling  # noqa: E402
from megatron_fused_ce.ops.backends import sampling_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = dict(GROUP_COLS=4, CAPACITY_PER_CANDIDATE=4, COMPACT_BLOCK_N=16, KEPT_BLOCK_N=32,
             DLOGITS_BLOCK_N=32)


@pytest.fixture(scope="module")
def st():
    if DEVICE.type == "cuda":
        from megatron_fused_ce.ops.backends import sampling_triton

        return sampling_triton
    return kernel_modules()["sampling_triton"]


@pytest.fixture
def small(st, monkeypatch):
    for name, value in SMALL.items():
        monkeypatch.setattr(st, name, value)
    return st


def _chunk(n, v, dtype, seed, ints=False):
    g = torch.Generator().manual_seed(seed)
    if ints:
        logits = torch.randint(-4, 5, (n, v), generator=g).to(dtype)
    else:
        logits = (torch.randn(n, v, generator=g) * 3.0).to(dtype)
    return logits.to(DEVICE), g


@pytest.mark.parametrize("dtype,ints", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("n,v,pad,m", [(6, 200, 7, 5), (3, 40, 0, 12), (4, 30, 30, 3)])
def test_shard_candidates(small, dtype, ints, n, v, pad, m):
    logits, _ = _chunk(n, v, dtype, seed=n * v + m, ints=ints)
    for inv_t in (1.0, 1 / 0.7):
        args = (logits, v - pad, inv_t, 1000, m)
        got = small.shard_candidates(*args)
        assert torch.equal(got.cpu(), sampling_torch.shard_candidates(*args).cpu())


def test_shard_candidates_overflow_and_default_settings(st, monkeypatch):
    logits, _ = _chunk(5, 300, torch.bfloat16, seed=1, ints=True)
    logits[1] = 2.0  # a whole row tied: more tokens at the threshold than the buffer holds
    ref = sampling_torch.shard_candidates(logits, 290, 1.0, 0, 6)
    assert torch.equal(st.shard_candidates(logits, 290, 1.0, 0, 6).cpu(), ref.cpu())
    monkeypatch.setattr(st, "GROUP_COLS", 8)
    monkeypatch.setattr(st, "CAPACITY_PER_CANDIDATE", 2)
    assert torch.equal(st.shard_candidates(logits, 290, 1.0, 0, 6).cpu(), ref.cpu())


def _cuts(logits, nvc, inv_t, vocab_start, g):
    z = logits[:, :nvc].float() * inv_t
    n = z.shape[0]
    cols = torch.randint(0, nvc, (n,), generator=g).to(DEVICE)
    z_cut = z.gather(1, cols[:, None]).squeeze(1)
    choice = torch.randint(0, 3, (n,), generator=g).to(DEVICE)
    id_cut = torch.where(choice == 0, sampling_torch.ID_ALL,
                         torch.where(choice == 1, sampling_torch.ID_NONE, vocab_start + cols))
    return z.amax(dim=1), z_cut, id_cut


@pytest.mark.parametrize("dtype,ints", [(torch.float32, False), (torch.bfloat16, True)])
def test_kept_sums(small, dtype, ints):
    n, v, pad, vocab_start = 5, 100, 9, 300
    logits, g = _chunk(n, v, dtype, seed=3, ints=ints)
    target = torch.randint(-1, v - pad, (n,), generator=g).to(DEVICE)
    for inv_t in (1.0, 1 / 0.7):
        row_max, z_cut, id_cut = _cuts(logits, v - pad, inv_t, vocab_start, g)
        want = dict(want_entropy=True, want_count=True, want_total=True)
        got = small.kept_sums(logits, target, v - pad, inv_t, vocab_start, row_max, z_cut, id_cut, **want)
        ref = sampling_torch.kept_sums(logits, target, v - pad, inv_t, vocab_start, row_max, z_cut, id_cut, **want)
        for name in ("sum_exp", "sum_exp_shifted", "total"):
            torch.testing.assert_close(getattr(got, name).cpu(), getattr(ref, name).cpu(), rtol=2e-6, atol=1e-6)
        assert torch.equal(got.count.cpu(), ref.count.cpu()) and torch.equal(got.target.cpu(), ref.target.cpu())
        rows = torch.tensor([4, 0, 3], device=DEVICE)
        got = small.kept_sums(logits, None, v - pad, inv_t, vocab_start, row_max[rows], z_cut[rows],
                              id_cut[rows], rows=rows, want_count=True)
        ref = sampling_torch.kept_sums(logits, None, v - pad, inv_t, vocab_start, row_max[rows], z_cut[rows],
                                       id_cut[rows], rows=rows, want_count=True)
        torch.testing.assert_close(got.sum_exp.cpu(), ref.sum_exp.cpu(), rtol=2e-6, atol=1e-6)
        assert torch.equal(got.count.cpu(), ref.count.cpu()) and got.target is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_dlogits(small, dtype):
    n, v, pad, vocab_start = 6, 100, 5, 40
    logits, g = _chunk(n, v, dtype, seed=4, ints=dtype == torch.bfloat16)
    target = torch.randint(-1, v - pad, (n,), generator=g).to(DEVICE)
    for inv_t, with_pz in ((1.0, False), (1 / 0.7, True)):
        row_max, z_cut, id_cut = _cuts(logits, v - pad, inv_t, vocab_start, g)
        log_sum_exp = torch.rand(n, generator=g).to(DEVICE)
        coefs = [torch.randn(n, generator=g).to(DEVICE) for _ in range(3)]
        args = (target, v - pad, inv_t, vocab_start, row_max, log_sum_exp, z_cut, id_cut, coefs[0],
                coefs[1] if with_pz else None, coefs[2])
        got = small.kept_dlogits_(logits.clone(), *args)
        ref = sampling_torch.kept_dlogits_(logits.clone(), *args)
        tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
        torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), **tol)
        assert torch.all(got[:, v - pad:] == 0)


# ------------------------------------------------------------------------- end to end, TP 1/2
def _e2e_worker(rank, world, case, impl, forced, chunk_size):
    import torch.distributed as dist

    if forced:
        sampling.CANDIDATES, sampling.MAX_TOP_K_CANDIDATES = 2, 2
    v_local = case["v_local"]
    results = []
    for params in case["params"]:
        h = case["hidden"].clone().requires_grad_()
        w = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        out = linear_logprobs(h, w, case["labels"], tp_group=dist.group.WORLD if world > 1 else None,
                              vocab_size=case["vocab"], temperature=0.7, chunk_size=chunk_size, return_entropy=True,
                              impl=impl, **params)
        finite = torch.isfinite(out.logprobs)
        ((torch.where(finite, out.logprobs, 0.0) * case["g"]).sum() + out.entropy.sum()).backward()
        results.append((out.logprobs.detach(), out.entropy.detach(), out.topk_ids, h.grad, w.grad))
    return results


@pytest.mark.parametrize("tp,forced", [(1, False), (2, False), (2, True)],
                         ids=["tp1", "tp2", "tp2-searched"])
def test_end_to_end_matches_torch(small, tp, forced):
    """forced: CANDIDATES = MAX_TOP_K_CANDIDATES = 2, so both exact searches run (slow under the
    interpreter: one chunk, one setting)."""
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors")
    g = torch.Generator().manual_seed(5 + tp)
    vocab, hidden = 61, 8
    v_local = -(-vocab // tp) + 2
    case = dict(
        vocab=vocab, v_local=v_local,
        hidden=torch.randint(-2, 3, (12, hidden), generator=g).to(torch.bfloat16),
        weight=(torch.randint(-2, 3, (v_local * tp, hidden), generator=g) * 0.25).to(torch.bfloat16),
        labels=torch.randint(0, vocab, (12,), generator=g), g=torch.randn(12, generator=g),
        params=[dict(top_p=0.9, return_topk=3), dict(top_k=4, min_p=0.05)])
    case["labels"][::4] = -100
    chunk_size = 5
    if forced:  # 4 labelled rows, one chunk
        case["params"], chunk_size = [dict(top_k=4, top_p=0.9, return_topk=3)], 12
        case["labels"][torch.arange(12) % 3 != 1] = -100
    got = run_workers(_e2e_worker, tp, case, "triton", forced, chunk_size, timeout=240)
    ref = run_workers(_e2e_worker, tp, case, "torch", forced, chunk_size)
    for rank in range(tp):
        for (lp, ent, ids, dx, dw), (rlp, rent, rids, rdx, rdw) in zip(got[rank], ref[rank]):
            assert torch.equal(torch.isfinite(lp), torch.isfinite(rlp))
            torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-6)
            assert (ids is None and rids is None) or torch.equal(ids, rids)
            for a, b in ((dx, rdx), (dw, rdw)):
                assert ((a.float() - b.float()).norm() / b.float().norm()).item() <= 4e-3
