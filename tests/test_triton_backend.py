"""The Triton backend against the torch backend (the reference), kernel by kernel and end to end.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set
here at import; tests/triton_interpret.py redefines the kernels under it). The interpreter is
slow: shapes are small, and the launch settings are shrunk (blocks of 32-64 columns) so that the
column-split + merge path of `shard_stats` and the multi-block grid of `shard_dlogits_` both run.
The fused GEMMs (triton_gemm_stats, triton_gemm_dlogits) and lean mode's `exp_tile_` are checked
the same way.

Tolerances: the two backends do the same fp32 math on the same inputs (the torch backend in one
shot, the kernel with an online max/sum-exp), so fp32 results agree to ~1e-6 relative; bf16
dlogits are rounded to nearest-even by both and agree to one bf16 ulp where the fp32 values sit
on either side of a rounding boundary.
"""

import math
import os

import dataclasses

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from dist import run_workers  # noqa: E402
from triton_interpret import kernel_modules  # noqa: E402
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402
from megatron_fused_ce.ops.backends import torch_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL_BLOCKS = dict(STATS_BLOCK_N=64, DLOGITS_BLOCK_N=64, MERGE_BLOCK_R=4)


@pytest.fixture(scope="module")
def tb():
    if DEVICE.type == "cuda":
        from megatron_fused_ce.ops.backends import triton_backend

        return triton_backend
    return kernel_modules()["triton_backend"]


@pytest.fixture
def small_blocks(tb, monkeypatch):
    for name, value in SMALL_BLOCKS.items():
        monkeypatch.setattr(tb, name, value)
    return tb


def _chunk(n, v, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(dtype).to(DEVICE)
    return logits, g


def _targets(n, num_valid_cols, g):
    t = torch.randint(0, max(num_valid_cols, 1), (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -1  # label on another shard
    t[0] = -1
    if num_valid_cols == 0:
        t[:] = -1
    return t.to(DEVICE)


def _close(out, ref, dtype=torch.float32, what=""):
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6, msg=lambda m: f"{what}: {m}")
    else:  # one ulp of the low-precision type
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-5, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------- shard_stats
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("n, v, pad", [(5, 300, 13), (40, 100, 0), (3, 64, 64)])
def test_shard_stats(small_blocks, dtype, temperature, n, v, pad):
    tb = small_blocks
    logits, g = _chunk(n, v, dtype, seed=n * v + pad)
    nvc = v - pad
    target = _targets(n, nvc, g)
    for want_sum, want_ent in ((False, False), (True, True), (True, False)):
        got = tb.shard_stats(logits, target, nvc, 1.0 / temperature, want_sum, want_ent)
        ref = torch_backend.shard_stats(logits, target, nvc, 1.0 / temperature, want_sum, want_ent)
        for name in ("max", "sum_exp", "target", "sum_logits", "sum_exp_shifted"):
            a, b = getattr(got, name), getattr(ref, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == torch.float32 and a.shape == (n,)
                _close(a, b, what=name)
        assert torch.equal(got.target.cpu(), ref.target.cpu())  # same fp32 op on the same element
        assert torch.all(got.target[target.cpu() < 0] == 0)


def test_shard_stats_default_blocks_and_zero_valid_columns(tb):
    logits, g = _chunk(7, 500, torch.bfloat16, seed=3)
    target = _targets(7, 450, g)
    got = tb.shard_stats(logits, target, 450, 1.3, True, True)
    ref = torch_backend.shard_stats(logits, target, 450, 1.3, True, True)
    for name in ("max", "sum_exp", "target", "sum_logits", "sum_exp_shifted"):
        _close(getattr(got, name), getattr(ref, name), what=name)
    # a shard made only of padding columns
    empty = tb.shard_stats(logits, _targets(7, 0, g), 0, 1.0, True, True)
    assert torch.all(empty.max == float("-inf"))
    for name in ("sum_exp", "target", "sum_logits", "sum_exp_shifted"):
        assert torch.all(getattr(empty, name) == 0), name
    # no rows
    none = tb.shard_stats(logits[:0], target[:0], 450, 1.0, False, True)
    assert none.max.shape == (0,) and none.sum_logits is None and none.sum_exp_shifted.shape == (0,)


# ----------------------------------------------------------------------------- shard_logprob
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("n, v, pad", [(3, 300, 13), (40, 100, 0), (2, 64, 9)])
def test_shard_logprob_matches_torch(small_blocks, dtype, temperature, n, v, pad):
    """A forward-only call's per-token epilogue in the statistics' launches (the stats kernel over
    whole rows: n = 40; the merge of column splits: n = 2, 3) against torch_backend.shard_logprob:
    log p_y, M, log S, z_y, lse; 0 at ignored rows; NaN everywhere under a NaN poison."""
    tb = small_blocks
    logits, g = _chunk(n, v, dtype, seed=n * v + pad + 1)
    nvc = v - pad
    target = _targets(n, nvc, g)
    names = ("logprob", "max", "log_sum_exp", "target", "lse")
    for poison_value in (0.0, float("nan")):
        poison = torch.full((1,), poison_value, device=DEVICE)
        got = tb.shard_logprob(logits, target, nvc, 1.0 / temperature, poison)
        ref = torch_backend.shard_logprob(logits, target, nvc, 1.0 / temperature, poison)
        if poison_value != 0:
            assert torch.isnan(got[0]).all()
            continue
        for name, a, b in zip(names, got, ref):
            assert a.dtype == torch.float32 and a.shape == (n,), name
            _close(a, b, what=name)
        assert torch.equal(got[3].cpu(), ref[3].cpu())  # z_y: the same fp32 op on the same element
        assert torch.all(got[0][target < 0] == 0)
        if DEVICE.type == "cuda":  # log S as torch's CUDA log computes it: log-probs equal to the merge's
            stats = tb.shard_stats(logits, target, nvc, 1.0 / temperature)
            assert torch.equal(got[2], torch.log(stats.sum_exp))
            merged = (stats.target - stats.max) - torch.log(stats.sum_exp)
            assert torch.equal(got[0], torch.where(target >= 0, merged, 0.0))
        # what a chunk at TP = 1 takes from these launches (fast.merged_chunk_statistics): the stats
        # kernel's statistics and merged_tail's log S and lse, bit for bit
        stats = tb.shard_stats(logits, target, nvc, 1.0 / temperature)
        log_sum_exp, lse, _ = tb.merged_tail(stats.max, stats.sum_exp, None)
        for name, a, b in zip(names[1:], got[1:], (stats.max, log_sum_exp, stats.target, lse)):
            assert torch.equal(a, b), name
    # no rows
    none = tb.shard_logprob(logits[:0], target[:0], nvc, 1.0, torch.zeros(1, device=DEVICE))
    assert all(t.shape == (0,) for t in none)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_forward_only_logprobs_of_one_chunk_take_the_fused_epilogue(small_blocks, monkeypatch, impl):
    """A forward-only call of one chunk at TP = 1 takes backend.shard_logprob (no merge, no
    elementwise tail); the log-probs equal the float64 reference (ignored labels, a padded vocab,
    temperature) and, on the torch backend and on CUDA, the values of the differentiable call bit
    for bit (an old-policy pass gives ratio 1 on the policy it came from). Several chunks keep
    the general path; a differentiable call of one chunk takes its statistics from it too, unless
    they come with its dlogits from one launch (stats_dlogits)."""
    from megatron_fused_ce.ops import api

    backend = torch_backend.BACKEND if impl == "torch" else small_blocks.BACKEND
    calls, original = [], backend.shard_logprob

    def spy(*args):
        calls.append(args[0].shape[0])
        return original(*args)

    patched = dataclasses.replace(backend, shard_logprob=spy)
    monkeypatch.setattr(api.backends, "select", lambda impl, device: patched)
    g = torch.Generator().manual_seed(11)
    n, hdim, vocab, padded = 45, 32, 90, 96
    h = torch.randn(n, hdim, generator=g).to(DEVICE)
    w = (torch.randn(padded, hdim, generator=g) / math.sqrt(hdim) * 3).to(DEVICE)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::4] = -100
    y = y.to(DEVICE)
    z = (h.double() @ w.double()[:vocab].t()) / 0.7
    ref = torch.log_softmax(z, -1).gather(1, y.clamp(min=0)[:, None])[:, 0]
    ref = torch.where(y >= 0, ref, 0.0)
    kwargs = dict(vocab_size=vocab, temperature=0.7, impl=impl)
    for chunk_size, fused in ((None, True), (16, False)):
        calls.clear()
        with torch.no_grad():
            out = linear_logprobs(h, w, y, chunk_size=chunk_size, **kwargs).logprobs
        assert calls == ([n] if fused else []), (chunk_size, calls)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.all(out[y < 0] == 0)
        calls.clear()
        with_grad = linear_logprobs(h.clone().requires_grad_(), w, y, chunk_size=chunk_size, **kwargs).logprobs
        one_launch = patched.stats_dlogits is not None and patched.stats_dlogits.applies(
            n, vocab, padded * w.element_size(), w.device)
        assert calls == ([n] if fused and not one_launch else []), (chunk_size, calls)
        if impl == "torch" or DEVICE.type == "cuda":
            assert torch.equal(out, with_grad.detach())


# ----------------------------------------------------------------------------- label_logprob
@pytest.mark.parametrize("dtype, temperature", [(torch.float32, 1.0), (torch.bfloat16, 0.7)])
@pytest.mark.parametrize("rows, v, pad", [("programs + 5", 300, 13), ("2 x programs", 100, 0), (6, 64, 9)])
def test_label_logprob_is_the_label_and_stats_kernels(small_blocks, monkeypatch, dtype, temperature, rows, v, pad):
    """backends.LabelLogprob (a forward-only chunk at TP = 1: the label checks and the log-probs in
    one launch) against the two launches it stands for, label_targets then shard_logprob: the same
    log-probs bit for bit from the raw labels (ignored ones, a padded vocab, temperature, labels
    read through a stride); a label outside [0, true_vocab) anywhere — negative, in the padding or
    past it — NaN in every row and deferred_errors' flag, as the label kernel records them; the
    float64 reference otherwise."""
    tb = small_blocks
    monkeypatch.setattr(tb, "LABEL_BLOCK", 8)  # (the verdict's read in several steps)
    programs = tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE)  # (from these rows the stats kernel takes rows whole)
    n = {"programs + 5": programs + 5, "2 x programs": 2 * programs}.get(rows, rows)
    logits, g = _chunk(n, v, dtype, seed=v + pad + 2)
    nvc = v - pad
    assert tb.label_logprob_applies(n, nvc, DEVICE)
    labels = torch.randint(0, nvc, (n, 2), generator=g)
    labels[torch.rand(n, generator=g) < 0.3, 0] = -100
    labels = labels.to(DEVICE)[:, 0]  # (strided)
    for bad in (None, -7, nvc, v + 5):
        y = labels.clone() if bad is None else labels.clone().index_fill_(0, torch.tensor([n // 2], device=DEVICE), bad)
        y = torch.stack([y, y], 1)[:, 0]
        flags, want_flags = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
        got = tb.label_logprob(logits, y, -100, nvc, 0, nvc, 1.0 / temperature, flags)
        target, _, _, scalars = tb.label_targets(y, -100, nvc, 0, v, want_flags)
        want = tb.shard_logprob(logits, target, nvc, 1.0 / temperature, scalars[:1])[0]
        assert got.dtype == torch.float32 and got.shape == (n,)
        assert torch.equal(flags, want_flags) and flags.item() == (0 if bad is None else 1), bad
        if bad is not None:
            assert torch.isnan(got).all() and torch.isnan(want).all(), bad
            continue
        assert torch.equal(got, want)
        z = logits.double() / temperature
        ref = torch.log_softmax(z[:, :nvc], -1).gather(1, y.clamp(min=0)[:, None])[:, 0].where(y >= 0, 0.0)
        _close(got, ref, dtype, "log-probs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "bool [B, T]", "float [T, B] read transposed"])
def test_label_statistics_is_the_label_kernel_then_shard_logprob(small_blocks, monkeypatch, dtype, mask):
    """backends.LabelLogprob's with_statistics (GRPO's route at TP = 1: the label checks, its label
    mask among them, in the stats launch that finishes each row) against label_targets then
    shard_logprob with the labels' poison: statistics, log-probs, targets, labelled rows, counts
    and scalars bit for bit (NaN where the other has NaN), the verdict's flag; positions the mask
    drops are ignored, whatever their label."""
    tb = small_blocks
    monkeypatch.setattr(tb, "LABEL_BLOCK", 8)
    n = 2 * (tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE) + 3)
    v, pad = 120, 7
    nvc = v - pad
    logits, g = _chunk(n, v, dtype, seed=41)
    labels = torch.randint(0, nvc, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = -100
    keep = torch.rand(2, n // 2, generator=g) > 0.3
    keep[0, 1] = keep[1, 0] = True  # (position 1 kept by either layout of the mask: the bad label's below)
    label_mask = None
    if mask == "bool [B, T]":
        label_mask = keep.to(DEVICE)
    elif mask is not None:  # labels [T, B] (sequence first), the mask [B, T] read through its transpose
        label_mask = keep.float().to(DEVICE).t()
    for bad in (None, nvc + 4):
        y = labels.clone()
        if bad is not None:
            y[1] = bad
        y = y.to(DEVICE)
        flags, want_flags = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
        got = tb.label_statistics(logits, y, -100, nvc, 0, nvc, 1 / 0.7, flags, label_mask)
        target, labelled, counts, scalars = tb.label_targets(y, -100, nvc, 0, v, want_flags, label_mask=label_mask)
        logprob, row_max, log_sum_exp, z_t, lse = tb.shard_logprob(logits, target, nvc, 1 / 0.7, scalars[:1])
        assert torch.equal(flags, want_flags) and flags.item() == (0 if bad is None else 1)
        names = ("max", "target", "log S", "lse", "log-probs", "targets", "labelled", "counts", "scalars")
        for name, a, b in zip(names, got, (row_max, z_t, log_sum_exp, lse, logprob, target, labelled, counts,
                                           scalars)):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
        if mask is not None:
            dropped = ~label_mask.bool().reshape(-1)
            assert not got[6][dropped].any() and (got[5][dropped] == -1).all()


def test_label_logprob_applies_to_the_stats_kernels_whole_rows_up_to_its_bound(tb, monkeypatch):
    """Where the stats kernel would split rows (fewer rows than its programs fill, wide rows) or
    above LABELS_IN_LAUNCH_MAX_ROWS rows, the two launches stay."""
    rows = tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE)
    assert tb.label_logprob_applies(rows, 5 * tb.STATS_BLOCK_N, DEVICE)
    assert not tb.label_logprob_applies(rows - 1, 5 * tb.STATS_BLOCK_N, DEVICE)
    assert tb.label_logprob_applies(rows - 1, tb.STATS_BLOCK_N, DEVICE)
    assert not tb.label_logprob_applies(0, tb.STATS_BLOCK_N, DEVICE)
    assert not tb.label_logprob_applies(rows, 0, DEVICE)
    monkeypatch.setattr(tb, "LABELS_IN_LAUNCH_MAX_ROWS", rows)
    assert not tb.label_logprob_applies(rows + 1, tb.STATS_BLOCK_N, DEVICE)


# ---------------------------------------------------------------------------- shard_dlogits_
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shard_dlogits_all_coefficient_combinations(small_blocks, dtype, temperature):
    tb = small_blocks
    n, v, pad = 6, 150, 11
    nvc = v - pad
    for combo in (*range(8), 9, 15):  # + lse split as max + log-sum-exp, with entropy terms
        logits, g = _chunk(n, v, dtype, seed=combo)
        target = _targets(n, nvc, g)
        z = logits[:, :nvc].float() / temperature
        lse = torch.logsumexp(z, dim=1) + torch.randn(n, generator=g).to(DEVICE) * 0.1
        coef_p = torch.randn(n, generator=g).to(DEVICE)
        coef_pz = torch.randn(n, generator=g).to(DEVICE) if combo & 1 else None
        coef_t = torch.randn(n, generator=g).to(DEVICE) if combo & 2 else None
        coef_u = torch.randn(n, generator=g).to(DEVICE) * 1e-2 if combo & 4 else None
        log_sum_exp = None
        if combo & 8:  # lse given as row max + log-sum-exp (the entropy path)
            row_max = z.amax(dim=1)
            lse, log_sum_exp = row_max, lse - row_max
        args = (target, nvc, 1.0 / temperature, lse, coef_p, coef_pz, coef_t, coef_u, log_sum_exp)
        got = logits.clone()
        out = tb.shard_dlogits_(got, *args)
        assert out.data_ptr() == got.data_ptr() and out.dtype == dtype  # in place
        ref = torch_backend.shard_dlogits_(logits.clone(), *args)
        _close(got, ref, dtype, what=f"combo {combo}")
        assert torch.all(got[:, nvc:] == 0)  # padding columns, poisoned by random logits before


def test_shard_dlogits_zero_valid_columns_and_default_blocks(tb):
    logits, g = _chunk(4, 70, torch.bfloat16, seed=9)
    ones = torch.ones(4, device=DEVICE)
    out = tb.shard_dlogits_(logits, _targets(4, 0, g), 0, 1.0, ones, ones, ones, ones, ones)
    assert torch.all(out == 0)
    logits, g = _chunk(4, 2100, torch.float32, seed=10)  # two column blocks of 2048
    target = _targets(4, 2090, g)
    lse = torch.logsumexp(logits[:, :2090] * 2.0, dim=1)
    args = (target, 2090, 2.0, lse, -ones, None, ones, None)
    _close(tb.shard_dlogits_(logits.clone(), *args), torch_backend.shard_dlogits_(logits.clone(), *args))


# ----------------------------------------------------------------------------- stats_dlogits_
def logits_bytes(dtype):
    return torch.finfo(dtype).bits // 8


def _two_kernels(tb, logits, target, nvc, inv_t, labelled, scale, logprob, poison):
    """What stats_dlogits_ stands for, by the kernels it replaces (as the chunk loop calls them)."""
    stats = tb.shard_stats(logits, target, nvc, inv_t)
    log_sum_exp, lse, _ = tb.merged_tail(stats.max, stats.sum_exp, None)
    n = logits.shape[0]
    if logprob:
        out = tb.labelled_logprob(stats.target, stats.max, log_sum_exp, labelled, poison)
        ones = torch.ones(n, device=logits.device)
        coef_p, coef_t = -ones, ones
    else:  # cross-entropy's coefficients: token_grads' (a device count's products, or a Python c)
        out = None
        keep = labelled if labelled is not None else torch.ones(n, dtype=torch.bool, device=logits.device)
        if isinstance(scale, torch.Tensor):
            coef_p, coef_t = (torch.stack([scale, -scale])[:, None] * keep).unbind(0)
        else:
            coef_p = torch.where(keep, torch.full((n,), scale, device=logits.device), 0.0)
            coef_t = torch.where(keep, torch.full((n,), -scale, device=logits.device), 0.0)
    tb.shard_dlogits_(logits, target, nvc, inv_t, stats.max, coef_p, None, coef_t, None, log_sum_exp=log_sum_exp)
    return stats.max, stats.target, log_sum_exp, lse, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("mode", ["ce count on the device", "ce python scale", "ce every row", "logprobs",
                                  "logprobs every row"])
def test_stats_dlogits_equals_the_stats_and_dlogits_kernels(small_blocks, dtype, temperature, mode):
    """One launch for the statistics and the dlogits of a whole-vocab chunk gives, bit for bit,
    what the stats kernel, the merge's tail, the log-probs' launch and the dlogits kernel give
    with the coefficients the chunk loop builds (ignored rows, padded vocab, temperature); it
    applies where the stats kernel takes each row in one program."""
    tb = small_blocks
    n = tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE) + 5
    v, pad = 150, 13
    nvc = v - pad
    row_bytes = v * logits_bytes(dtype)
    assert tb.stats_dlogits_applies(n, nvc, row_bytes, DEVICE) and not tb.stats_dlogits_applies(n - 6, nvc, row_bytes,
                                                                                                DEVICE)
    assert tb.stats_dlogits_applies(3, tb.STATS_BLOCK_N, row_bytes, DEVICE)  # rows of one block: one program each
    wide = tb.STATS_DLOGITS_MAX_ROW_BYTES + 2  # wide rows: in chunks small enough for L2 only
    assert tb.stats_dlogits_applies(n, nvc, wide, DEVICE)
    assert not tb.stats_dlogits_applies(tb.STATS_DLOGITS_MAX_CHUNK_BYTES // wide + 1, nvc, wide, DEVICE)
    logits, g = _chunk(n, v, dtype, seed=31)
    target = _targets(n, nvc, g)
    labelled = None if mode.endswith("every row") else (target >= 0) | (torch.rand(n, generator=g) < 0.2).to(DEVICE)
    logprob = mode.startswith("logprobs")
    scale = torch.tensor(1 / 37, device=DEVICE) if mode == "ce count on the device" else 0.03
    poison = torch.zeros(1, device=DEVICE) if logprob else None
    inv_t = 1.0 / temperature
    want, got = logits.clone(), logits.clone()
    expected = _two_kernels(tb, want, target, nvc, inv_t, labelled, scale, logprob, poison)
    result = tb.stats_dlogits_(got, target, nvc, inv_t, labelled, scale=None if logprob else scale,
                               logprob=logprob, poison=poison)
    assert torch.equal(got, want), mode
    for name, a, b in zip(("max", "target", "log S", "lse", "log-probs"), result, expected):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{mode}: {name}"
    if logprob:  # the poison reaches every log-prob
        assert tb.stats_dlogits_(logits.clone(), target, nvc, inv_t, labelled, logprob=True,
                                 poison=torch.full((1,), float("nan"), device=DEVICE))[4].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["ce mean", "ce sum", "logprobs"])
def test_stats_dlogits_with_labels_is_the_label_kernel_then_stats_dlogits(small_blocks, monkeypatch, dtype, mode):
    """The one launch with the label checks in it (TP = 1, a few thousand rows) gives, bit for bit,
    what label_targets then stats_dlogits_ give (cross-entropy's mean with the device count's
    1 / labelled rows, a sum's c, log-probs with the labels' poison): the statistics, the dlogits in
    place, the log-probs, and the label kernel's targets, labelled rows, counts and scalars, from
    raw labels read through a stride (ignored ones, a padded vocab, temperature); a label outside
    [0, true_vocab) anywhere: the same verdict, flag and poison."""
    tb = small_blocks
    monkeypatch.setattr(tb, "LABEL_BLOCK", 8)  # (the totals' read in several steps)
    n = tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE) + 5
    v, pad = 150, 13
    nvc = v - pad
    row_bytes = v * logits_bytes(dtype)
    assert tb.stats_dlogits_with_labels_applies(n, nvc, row_bytes, DEVICE)
    assert not tb.stats_dlogits_with_labels_applies(n - 6, nvc, row_bytes, DEVICE)  # (stats_dlogits' rows)
    monkeypatch.setattr(tb, "LABELS_IN_LAUNCH_MAX_ROWS", n - 1)
    assert not tb.stats_dlogits_with_labels_applies(n, nvc, row_bytes, DEVICE)
    logits, g = _chunk(n, v, dtype, seed=37)
    labels = torch.randint(0, nvc, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    labels = labels.to(DEVICE)
    inv_t = 1.0 / 0.7
    logprob, mean = mode == "logprobs", mode == "ce mean"
    for bad in (None, -3, nvc + 1):
        y = labels.clone()
        if bad is not None:
            y[n // 3] = bad
        y = torch.stack([y, y], 1)[:, 0]  # (strided)
        flags, want_flags = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
        got_logits, want_logits = logits.clone(), logits.clone()
        got = tb.stats_dlogits_with_labels_(got_logits, y, -100, nvc, 0, nvc, inv_t, flags, mean=mean, scale=0.25,
                                           logprob=logprob)
        target, labelled, counts, scalars = tb.label_targets(y, -100, nvc, 0, v, want_flags)
        want = tb.stats_dlogits_(want_logits, target, nvc, inv_t, labelled,
                                 scale=None if logprob else scalars[1] if mean else 0.25, logprob=logprob,
                                 poison=scalars[:1] if logprob else None)
        assert torch.equal(flags, want_flags) and flags.item() == (0 if bad is None else 1), bad
        names = ("max", "target", "log S", "lse", "log-probs", "targets", "labelled", "counts", "scalars")
        for name, a, b in zip(names, got, (*want, target, labelled, counts, scalars)):
            assert (a is None) == (b is None), name
            if a is not None:  # (bit for bit, NaN where the other has NaN: the poison)
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
        assert torch.equal(got_logits, want_logits), mode
        if logprob:
            assert got[4].isnan().all() == (bad is not None)


@pytest.mark.parametrize("what", ["ce mean", "ce sum", "logprobs"])
def test_calls_of_whole_vocab_chunks_take_one_launch_for_statistics_and_dlogits(small_blocks, monkeypatch, what):
    """Cross-entropy ("mean" / "sum", no smoothing or z-loss) and log-probs of one chunk at TP = 1
    take backend.stats_dlogits for every chunk where it applies, and their values, dX and dW are
    those of the stats and dlogits kernels bit for bit (STATS_DLOGITS off), the log-probs those of
    a forward-only call too (an old-policy pass gives ratio 1 on the policy it came from); a chunk
    where it does not apply (a short last chunk) keeps the two kernels for the whole call; label
    smoothing, whose dlogits need the statistics, never takes it."""
    from megatron_fused_ce.ops import api

    tb = small_blocks
    calls, original = [], tb.BACKEND.stats_dlogits

    def spy(logits, *args, **kwargs):
        calls.append(logits.shape[0])
        return original.run_(logits, *args, **kwargs)

    patched = dataclasses.replace(tb.BACKEND, stats_dlogits=dataclasses.replace(original, run_=spy))
    monkeypatch.setattr(api.backends, "select", lambda impl, device: patched)
    rows = tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE)
    g = torch.Generator().manual_seed(5)
    n, hdim, vocab, padded = 2 * rows + 4, 16, 140, 150
    h0 = torch.randn(n, hdim, generator=g).to(DEVICE)
    w0 = (torch.randn(padded, hdim, generator=g) / math.sqrt(hdim) * 3).to(DEVICE)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::5] = -100
    y = y.to(DEVICE)

    def run(chunk_size, **extra):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        kwargs = dict(vocab_size=vocab, temperature=0.7, impl="triton", chunk_size=chunk_size, **extra)
        if what == "logprobs":
            value = linear_logprobs(h, w, y, **kwargs).logprobs
            (value * torch.linspace(-1, 2, n, device=DEVICE)).sum().backward()
        else:
            value = linear_cross_entropy(h, w, y, reduction=what.split()[1], **kwargs)
            (value * 3.0).backward()
        return value.detach(), h.grad, w.grad

    chunkings = ((None, [n]),) if what == "logprobs" else ((None, [n]), (rows + 2, [rows + 2, rows + 2]),
                                                             (rows, []))  # (the last chunk of 4 rows)
    for chunk_size, expected_calls in chunkings:
        calls.clear()
        got = run(chunk_size)
        assert calls == expected_calls, (chunk_size, calls)
        monkeypatch.setattr(tb, "STATS_DLOGITS", False)
        want = run(chunk_size)
        monkeypatch.setattr(tb, "STATS_DLOGITS", True)
        for name, a, b in zip(("value", "dX", "dW"), got, want):
            assert torch.equal(a, b), f"{what} chunk_size={chunk_size}: {name}"
    if what == "logprobs":  # the forward-only pass (an old-policy one) gives the same log-probs, bit for bit
        with torch.no_grad():
            old = linear_logprobs(h0, w0, y, vocab_size=vocab, temperature=0.7, impl="triton").logprobs
        assert torch.equal(old, got[0])
    else:
        calls.clear()
        run(None, label_smoothing=0.1)
        assert calls == []


@pytest.mark.parametrize("backend_name", ["triton", "torch"])
def test_col_start_matches_targets_relative_to_the_block(small_blocks, backend_name):
    """Each kernel given shard-wide targets and `col_start` (the block's first column) equals the
    same kernel given targets made relative to the block (-1 where the label is elsewhere, before,
    inside or after the block): the chunk loop and lean mode rely on it instead of re-indexing."""
    backend = small_blocks if backend_name == "triton" else torch_backend
    g = torch.Generator().manual_seed(12)
    n, width, start = 12, 90, 200
    shard_targets = torch.tensor([-1, 0, 199, 200, 201, 250, 289, 290, 291, 500, 210, 288]).to(DEVICE)
    relative = torch.where((shard_targets >= start) & (shard_targets < start + width), shard_targets - start, -1)
    block = (torch.randn(n, width, generator=g) * 3).to(DEVICE)
    for nvc in (width, 85):
        a = backend.shard_stats(block, shard_targets, nvc, 0.7, True, True, col_start=start)
        b = backend.shard_stats(block, relative, nvc, 0.7, True, True)
        for name in ("max", "sum_exp", "target", "sum_logits", "sum_exp_shifted"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        coefs = [torch.randn(n, generator=g).to(DEVICE) for _ in range(4)]
        lse = torch.logsumexp(block * 0.7, dim=1)
        a = backend.shard_dlogits_(block.clone(), shard_targets, nvc, 0.7, lse, *coefs, col_start=start)
        b = backend.shard_dlogits_(block.clone(), relative, nvc, 0.7, lse, *coefs)
        assert torch.equal(a, b)
        states = [[torch.zeros(n, device=DEVICE) for _ in range(4)] for _ in range(2)]
        a = backend.exp_tile_(block.clone(), shard_targets, nvc, 0.7, *states[0], None, first=True, ref_margin=60.0,
                              col_start=start)
        b = backend.exp_tile_(block.clone(), relative, nvc, 0.7, *states[1], None, first=True, ref_margin=60.0)
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(*states))
    assert torch.count_nonzero(states[0][2]) == 4  # 200, 201, 210, 250: inside the 85 valid columns


# ------------------------------------------------------------------------- end to end, TP 1/2
def _case(seed, tp, dtype, hidden=16):
    g = torch.Generator().manual_seed(seed)
    vocab, hidden_size, v_local = 101, hidden, -(-101 // tp) + 3  # padded vocab: last shard pads
    return dict(
        tp=tp, vocab=vocab, v_local=v_local,
        hidden=torch.randn(6, 4, hidden_size, generator=g).to(dtype),
        weight=(torch.randn(v_local * tp, hidden_size, generator=g) * 0.5).to(dtype),
        labels=torch.where(torch.rand(6, 4, generator=g) < 0.25, -100,
                           torch.randint(0, vocab, (6, 4), generator=g)),
        grad_lp=torch.randn(6, 4, generator=g), grad_ent=torch.randn(6, 4, generator=g),
    )


def _e2e_worker(rank, world, case, impl):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    v_local = case["v_local"]
    results = []
    for what in ("logprobs", "ce"):
        h = case["hidden"].clone().requires_grad_()
        w = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        common = dict(tp_group=group, vocab_size=case["vocab"], temperature=0.7, chunk_size=7, impl=impl)
        if what == "logprobs":
            out = linear_logprobs(h, w, case["labels"], return_entropy=True, **common)
            value = torch.stack([out.logprobs, out.entropy])
            loss = (out.logprobs * case["grad_lp"]).sum() + (out.entropy * case["grad_ent"]).sum()
        else:
            value = linear_cross_entropy(h, w, case["labels"], label_smoothing=0.1, z_loss_weight=1e-3,
                                         **common)
            loss = value * 3.0
        loss.backward()
        results.append((value.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_end_to_end_matches_torch_backend(small_blocks, tp, dtype):
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors; tests/test_ops-style GPU runs use tools/")
    case = _case(17 * tp, tp, dtype)
    got = run_workers(_e2e_worker, tp, case, "triton")
    ref = run_workers(_e2e_worker, tp, case, "torch")
    for rank in range(tp):
        for what, (v, dx, dw), (rv, rdx, rdw) in zip(("logprobs", "ce"), got[rank], ref[rank]):
            _close(v, rv, what=f"{what} value rank {rank}")
            for name, a, b in (("dX", dx, rdx), ("dW", dw, rdw)):
                assert a.dtype == dtype
                # bf16: products of dlogits that may differ by one ulp, summed: compare by norm
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err <= (1e-5 if dtype == torch.float32 else 4e-3), f"{what} {name} rank {rank}: {err:.2e}"


# ------------------------------------------------ entropy at large |z|, fp32 logits, autocast
@pytest.mark.parametrize("tp", [2])
def test_entropy_precision_at_large_logits(small_blocks, tp):
    """The kernels carry the entropy relative to the (running, per-split) max and its gradient
    relative to lse: within 2x of a plain fp32 dense computation at |z| ~ 50 (test_reliability)."""
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors")
    from op_cases import check_entropy_precision, entropy_case, entropy_worker

    case = entropy_case(31 + tp, 50.0, 1e-3, tp, n=24)
    check_entropy_precision(case, run_workers(entropy_worker, tp, case, "triton"), "triton large |z|")


def _fp32_logits_worker(rank, world, case, impl):
    import torch.distributed as dist

    v_local = case["v_local"]
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    common = dict(tp_group=dist.group.WORLD if world > 1 else None, vocab_size=case["vocab"],
                  temperature=0.7, chunk_size=7, impl=impl, logits_dtype=torch.float32)
    out = linear_logprobs(h, w, case["labels"], return_entropy=True, **common)
    loss = linear_cross_entropy(h, w, case["labels"], label_smoothing=0.1, **common)
    ((out.logprobs * case["grad_lp"]).sum() + (out.entropy * case["grad_ent"]).sum() + loss).backward()
    return torch.stack([out.logprobs, out.entropy]).detach(), loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_logits_match_torch_backend(small_blocks, tp):
    """logits_dtype=torch.float32 on bf16 inputs: the kernels read and write fp32 chunks."""
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors")
    case = _case(5 + tp, tp, torch.bfloat16)
    got = run_workers(_fp32_logits_worker, tp, case, "triton")
    ref = run_workers(_fp32_logits_worker, tp, case, "torch")
    for rank in range(tp):
        (values, loss, dx, dw), (rvalues, rloss, rdx, rdw) = got[rank], ref[rank]
        _close(values, rvalues, what="logprobs/entropy")
        _close(loss, rloss, what="loss")
        for name, a, b in (("dX", dx, rdx), ("dW", dw, rdw)):
            assert a.dtype == torch.bfloat16
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert err <= 4e-3, f"{name} rank {rank}: {err:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast")
@pytest.mark.parametrize("fn", ["ce_mean", "logprobs", "grpo"])
def test_cuda_autocast_bf16(fn):
    """torch.autocast("cuda", bf16) on fp32 inputs == the op on bf16 inputs (Triton backend),
    forward inside and backward outside autocast, within the bf16 tolerance of float64."""
    from op_cases import BF16_TOL, autocast_loss, autocast_reference_loss

    g = torch.Generator().manual_seed(8)
    h32 = torch.randn(8, 512, 256, generator=g).cuda()
    w32 = (torch.randn(4000, 256, generator=g) * 0.1).cuda()
    y = torch.randint(0, 4000, (8, 512), generator=g).cuda()
    y[:, ::9] = -100
    h, w = h32.clone().requires_grad_(), w32.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = autocast_loss(fn, h, w, y)
    loss.backward()
    hb, wb = h32.bfloat16().requires_grad_(), w32.bfloat16().requires_grad_()
    autocast_loss(fn, hb, wb, y).backward()
    assert torch.equal(h.grad, hb.grad.float()) and torch.equal(w.grad, wb.grad.float())
    hd, wd = h32.bfloat16().double().requires_grad_(), w32.bfloat16().double().requires_grad_()
    ref = autocast_reference_loss(fn, hd, wd, y)
    ref.backward()
    for name, out, r in (("loss", loss, ref), ("dX", h.grad, hd.grad), ("dW", w.grad, wd.grad)):
        err = ((out.double() - r).norm() / r.norm()).item()
        assert err <= BF16_TOL, f"{name}: {err:.2e}"


# ------------------------------------- fused GEMM + stats (triton_gemm_stats), lean exp_tile_
@pytest.fixture
def small_tiles(tb, monkeypatch):
    from megatron_fused_ce.ops.backends import triton_gemm_dlogits, triton_gemm_stats

    monkeypatch.setattr(triton_gemm_stats, "TILE", (16, 32, 32, 4, 1))
    monkeypatch.setattr(triton_gemm_stats, "MERGE_BLOCK_T", 4)
    monkeypatch.setattr(triton_gemm_dlogits, "TILE", (16, 32, 32, 4, 1))
    return triton_gemm_stats


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature, round_logits", [(1.0, True), (0.7, True), (0.7, False)])
@pytest.mark.parametrize("tma", [True, False])
def test_gemm_shard_stats_matches_chunked_stats(small_tiles, monkeypatch, dtype, temperature, round_logits, tma):
    """The logits GEMM with the statistics in its epilogue == GEMM (rounded to the input dtype, or
    fp32 logits) + shard_stats, for every ShardStats field; rows in several launches (the
    partials bound), padding columns, labels on other shards, both the TMA and pointer kernels.
    Fresh memory holds NaN: every field is written whole by the launches (a row whose label is on
    another shard gets its 0 from a store, not from a fill)."""
    gs = small_tiles
    monkeypatch.setattr(gs, "PARTIALS_BYTES", 4 * 4 * 10 * 16 * 2)  # 10 column tiles -> 2 row slices
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(gs, "_use_tma", lambda device: tma)
    g = torch.Generator().manual_seed(3 + tma)
    n, hdim, v, nv = 45, 64, 310, 290
    h = torch.randn(n, hdim, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(v, hdim, generator=g) * 0.4).to(dtype).to(DEVICE)
    tgt = _targets(n, nv, g)
    assert gs.supported(h, w)
    got = gs.gemm_shard_stats(h, w, tgt, nv, 1 / temperature, True, True, round_logits=round_logits)
    logits = h @ w.t() if round_logits else h.float() @ w.float().t()
    ref = torch_backend.shard_stats(logits, tgt, nv, 1 / temperature, True, True)
    for field in ("max", "sum_exp", "target", "sum_logits", "sum_exp_shifted"):
        a, b = getattr(got, field).float().cpu(), getattr(ref, field).float().cpu()
        # fp16 logits: fp32 sums in another order may round a logit to the neighbouring fp16 value
        tol = 2e-5 if dtype == torch.bfloat16 or not round_logits else 3e-3
        atol = max(tol, 2e-7 * float(b.abs().max()) * n)  # fp32 sums of ~300 terms in another order
        if round_logits and field == "sum_logits":  # a logit on a rounding boundary may round apart
            atol = 2 * 2.0 ** -7 * float(logits.float().abs().max())  # two bf16 ulps of a logit
        torch.testing.assert_close(a, b, rtol=tol, atol=atol, msg=lambda m: f"{field}: {m}")
    assert not gs.supported(h[:, :48], w[:, :48])  # H not a multiple of BLOCK_K
    assert not gs.supported(h.float(), w.float())  # fp32 inputs take the chunked path


@pytest.mark.parametrize("tma", [True, False])
def test_gemm_shard_stats_reads_the_labels_themselves(small_tiles, monkeypatch, tma):
    """The call's first GEMM is launched before the label kernel (fast.EarlyProduct), so the fused
    statistics read the labels with the shard's first vocab id and the ignore index: the same
    statistics, bit for bit, as from the label kernel's targets, for labels on this shard, on others
    below and above it, in its padding columns, ignored (an ignore index inside the shard's range
    too) and negative."""
    gs = small_tiles
    monkeypatch.setattr(gs, "_use_tma", lambda device: tma)
    g = torch.Generator().manual_seed(5)
    n, hdim, v, nv, start = 48, 64, 96, 80, 96
    h = torch.randn(n, hdim, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(v, hdim, generator=g) * 0.4).bfloat16().to(DEVICE)
    for ignore_index in (-100, start + 7):
        labels = torch.randint(0, 3 * v, (n,), generator=g)
        labels[:6] = torch.tensor([ignore_index, start, start + nv - 1, start + nv, start + v - 1, -5])
        local = labels - start
        targets = torch.where((labels != ignore_index) & (local >= 0) & (local < nv), local, -1)
        assert 0 < int((targets >= 0).sum()) < n
        labels, targets = labels.to(DEVICE), targets.to(DEVICE)
        ref = gs.gemm_shard_stats(h, w, targets, nv, 1.3, True, True)
        got = gs.gemm_shard_stats(h, w, labels, nv, 1.3, True, True, label_offset=start, ignore_index=ignore_index)
        for field in ("max", "sum_exp", "target", "sum_logits", "sum_exp_shifted"):
            assert torch.equal(getattr(got, field), getattr(ref, field)), field


def _count_fused_gemm(triton_backend, field: str, calls: list):
    """Make the Triton backend count the calls of its fused GEMM `field` ("gemm_stats",
    "gemm_dlogits") in `calls`; returns the backend to put back."""
    original = triton_backend.BACKEND
    fused = getattr(original, field)
    triton_backend.BACKEND = dataclasses.replace(original, **{field: dataclasses.replace(
        fused, run=lambda *a, **k: calls.append(1) or fused.run(*a, **k))})
    return original


def _count_gemm_stats(triton_backend, calls: list):
    return _count_fused_gemm(triton_backend, "gemm_stats", calls)


def _fused_forward_worker(rank, world, case):
    import torch.distributed as dist

    from megatron_fused_ce.ops import fast
    from megatron_fused_ce.ops.backends import triton_backend

    v_local = case["v_local"]
    group = dist.group.WORLD if world > 1 else None
    out, calls = [], []
    bound, original = fast.FUSED_STATS_MIN_BYTES, _count_gemm_stats(triton_backend, calls)
    fast.FUSED_STATS_MIN_BYTES = 0  # the fused GEMM at these small shapes too
    try:
        for impl in ("triton", "torch"):
            h = case["hidden"].clone().requires_grad_()
            w = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
            kw = dict(tp_group=group, vocab_size=case["vocab"], temperature=0.7, impl=impl, return_entropy=True)
            with torch.no_grad():
                plain = linear_logprobs(h, w, case["labels"], **kw)
            res = linear_logprobs(h, w, case["labels"], **kw)
            ((res.logprobs * case["grad_lp"]).sum() + (res.entropy * case["grad_ent"]).sum()).backward()
            out.append((plain.logprobs, plain.entropy, res.logprobs.detach(), h.grad, w.grad))
    finally:
        fast.FUSED_STATS_MIN_BYTES, triton_backend.BACKEND = bound, original
    assert len(calls) == 2, f"the fused statistics GEMM ran {len(calls)} times, not once per forward"
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_forward_end_to_end(small_tiles, tp):
    """linear_logprobs on the Triton backend with H = 64: the forward statistics come from the
    fused kernel (no_grad and recompute path) and match the torch backend's chunked path."""
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors")
    case = _case(40 + tp, tp, torch.bfloat16, hidden=64)
    for got, ref in run_workers(_fused_forward_worker, tp, case):
        for name, a, b in zip(("no_grad logprobs", "no_grad entropy", "logprobs", "dX", "dW"), got, ref):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert err <= (2e-5 if "no_grad" in name or name == "logprobs" else 4e-3), f"{name}: {err:.2e}"


def test_small_forward_statistics_come_from_cublas_and_the_stats_kernel(tb, small_tiles, monkeypatch):
    """Forward statistics of rows whose logits are at most fast.FUSED_STATS_MIN_BYTES come from the
    logits GEMM and the stats kernel (at RL micro-batches the fused GEMM was slower and cost the
    host a launch ahead of the GPU's work), larger ones from the fused GEMM; the same values."""
    from megatron_fused_ce.ops import fast

    original = tb.BACKEND
    monkeypatch.setattr(tb, "BACKEND", original)  # put back after the test
    g = torch.Generator().manual_seed(9)
    h = torch.randn(24, 64, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(96, 64, generator=g) * 0.5).bfloat16().to(DEVICE)
    y = torch.randint(0, 96, (24,), generator=g).to(DEVICE)
    logits_bytes = 24 * 96 * 2
    results = []
    for bound, fused_calls in ((logits_bytes, 0), (logits_bytes - 1, 1)):
        monkeypatch.setattr(fast, "FUSED_STATS_MIN_BYTES", bound)
        calls = []
        tb.BACKEND = original
        _count_gemm_stats(tb, calls)
        with torch.no_grad():
            results.append(linear_logprobs(h, w, y, impl="triton", return_entropy=True))
        assert len(calls) == fused_calls, (bound, len(calls))
    with torch.no_grad():
        ref = linear_logprobs(h.cpu(), w.cpu(), y.cpu(), impl="torch", return_entropy=True)
    for out in results:
        torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(out.entropy.cpu(), ref.entropy, rtol=2e-5, atol=2e-5)


def test_dlogits_row_padding_holds_zeros(small_tiles, monkeypatch):
    """gemm_dlogits returns a view of a buffer whose rows are padded to 8 elements. torch's CPU
    bf16 matmul of such a view reads the padding columns as well: dX = dlogits @ W turned NaN on
    whole rows wherever the allocator had left NaN there (a flaky TP=2 end-to-end failure).
    Uninitialized memory is filled with NaN here, so the check fails every time, not now and then."""
    from megatron_fused_ce.ops.backends import triton_gemm_dlogits

    if DEVICE.type == "cuda":
        pytest.skip("cuBLAS reads only the view; the interpreter's CPU path is the one at risk")
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # (fill_uninitialized_memory needs it)
    try:
        g = torch.Generator().manual_seed(8)
        n, hdim, cols, valid = 19, 64, 54, 50  # 54 columns: rows padded to 56
        h = torch.randn(n, hdim, generator=g).bfloat16()
        w = (torch.randn(cols, hdim, generator=g) * 0.4).bfloat16()
        target = torch.randint(0, valid, (n,), generator=g)
        lse = torch.logsumexp((h.float() @ w[:valid].float().t()), dim=1)
        coef = torch.randn(n, generator=g)
        dlogits = triton_gemm_dlogits.gemm_dlogits(h, w, target, valid, cols, 1.0, lse, coef, None, coef, None)
        assert dlogits.stride(0) == 56  # the padded layout this test is about
        assert torch.isfinite(torch.mm(dlogits, w)).all()
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _exact_product_inputs(n, hdim, v, dtype, g):
    """h, w whose products and their fp32 sums are exact (multiples of 1/32, |sum| < 64): the
    logits are the same numbers whatever the GEMM's order of summation."""
    h = (torch.randint(-4, 5, (n, hdim), generator=g) / 4).to(dtype).to(DEVICE)
    w = (torch.randint(-4, 5, (v, hdim), generator=g) / 8).to(dtype).to(DEVICE)
    return h, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature, round_logits", [(1.0, True), (0.7, True), (0.7, False)])
def test_gemm_dlogits_matches_gemm_then_dlogits_kernel(small_tiles, dtype, temperature, round_logits):
    """The logits GEMM with dlogits in its epilogue == GEMM (rounded to the input dtype, or fp32
    logits) + shard_dlogits_, for every coefficient combination, with padding columns (whose
    weight rows hold NaN: never read), a width that is not a multiple of 8 (padded store), labels
    before / inside / after the block (col_start), rows and columns not multiples of the tile."""
    from megatron_fused_ce.ops.backends import triton_gemm_dlogits

    g = torch.Generator().manual_seed(21 + round_logits)
    n, hdim, cols, nv, start = 45, 64, 150, 139, 300
    h, w = _exact_product_inputs(n, hdim, cols, dtype, g)
    w[nv:] = float("nan")  # padding rows: must not be read
    assert triton_gemm_dlogits.supported(h, w)
    shard_targets = torch.randint(-1, start + cols + 20, (n,), generator=g).to(DEVICE)
    logits = h.float() @ w[:nv].float().t()
    logits = torch.cat([logits, torch.zeros(n, cols - nv, device=DEVICE)], 1)
    if round_logits:
        logits = logits.to(dtype)
    z = logits[:, :nv].float() * (1 / temperature)
    for combo in (0, 1, 2, 4, 7, 15):
        coefs = [torch.randn(n, generator=g).to(DEVICE) for _ in range(4)]
        coef_p, coef_pz, coef_t, coef_u = (c if combo & bit or bit == 0 else None
                                           for c, bit in zip(coefs, (0, 1, 2, 4)))
        lse, log_sum_exp = torch.logsumexp(z, dim=1), None
        if combo & 8:  # lse as row max + log-sum-exp (the precise split)
            lse, log_sum_exp = z.amax(dim=1), lse - z.amax(dim=1)
        args = (shard_targets, nv, 1 / temperature, lse, coef_p, coef_pz, coef_t, coef_u, log_sum_exp)
        got = triton_gemm_dlogits.gemm_dlogits(h, w, shard_targets, nv, cols, 1 / temperature, lse, coef_p,
                                               coef_pz, coef_t, coef_u, log_sum_exp, col_start=start,
                                               round_logits=round_logits)
        ref = torch_backend.shard_dlogits_(logits.clone(), *args, col_start=start).to(dtype)
        assert got.shape == (n, cols) and got.dtype == dtype
        _close(got, ref, dtype, what=f"combo {combo}")
        assert torch.all(got[:, nv:] == 0)
    assert not triton_gemm_dlogits.supported(h[:, :48], w[:, :48])  # H not a multiple of BLOCK_K
    assert not triton_gemm_dlogits.supported(h.float(), w.float())  # fp32 inputs: GEMM + kernel


def _count_gemm_dlogits(triton_backend, calls: list):
    return _count_fused_gemm(triton_backend, "gemm_dlogits", calls)


def _fused_dlogits_worker(rank, world, case):
    import torch.distributed as dist

    from megatron_fused_ce.ops.backends import triton_backend

    v_local = case["v_local"]
    group = dist.group.WORLD if world > 1 else None
    calls = []
    original = _count_gemm_dlogits(triton_backend, calls)
    out = []
    try:
        for impl in ("triton", "torch"):
            for mode in ("fast", "lean"):
                h = case["hidden"].clone().requires_grad_()
                w = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
                kw = dict(tp_group=group, vocab_size=case["vocab"], temperature=0.7, impl=impl, memory_mode=mode,
                          chunk_size=7)  # fast mode: chunks that do not divide the rows
                lp = linear_logprobs(h, w, case["labels"], return_entropy=True, **kw)
                ce = linear_cross_entropy(h, w, case["labels"], label_smoothing=0.1, reduction="none", **kw)
                ce_mean = linear_cross_entropy(h, w, case["labels"], **kw)  # lean: sweep B in backward
                ((lp.logprobs * case["grad_lp"]).sum() + (lp.entropy * case["grad_ent"]).sum()
                 + (ce * case["grad_lp"]).sum() + 3 * ce_mean).backward()
                out.append((mode, lp.logprobs.detach(), h.grad, w.grad))
    finally:
        triton_backend.BACKEND = original
    return out, len(calls)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_dlogits_end_to_end(small_tiles, tp):
    """Backward passes whose dlogits come from the GEMM's epilogue (recompute path, lean sweeps
    A' and B; log-probs with entropy, label smoothing, padded vocab) == the torch backend's."""
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors")
    case = _case(60 + tp, tp, torch.bfloat16, hidden=64)
    for (results, calls) in run_workers(_fused_dlogits_worker, tp, case):
        assert calls >= 6  # fast: a recompute per chunk; lean: A' + B for log-probs, B for each CE
        for (mode, *got), (_, *ref) in zip(results[:2], results[2:]):
            for name, a, b in zip(("logprobs", "dX", "dW"), got, ref):
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err <= (2e-5 if name == "logprobs" else 4e-3), f"{mode} {name}: {err:.2e}"


def _host_syncs(fn):
    """Host synchronizations made by fn(), as torch's sync debug mode reports them."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs of CUDA calls")
def test_host_syncs_per_call():
    """One host sync on the first call of a signature (the argument agreement), none on the later
    ones (the contents are checked on the device; ignored tokens are not indexed by a count). No
    backward reads g on the host: dX and a dW made in the weight dtype (one chunk, or QuACK's
    last-chunk GEMM) are scaled by `scale_`, which decides g == 1 on the GPU, an fp32 dW summed
    over chunks is cast with g in one pass, and lean's sweep A moves references on the device. A
    sync there would leave the GPU idle while the host queues what follows."""
    g = torch.Generator().manual_seed(5)
    n, hdim, v = 300, 64, 1000
    h = torch.randn(n, hdim, generator=g).bfloat16().cuda().requires_grad_()
    w = (torch.randn(v, hdim, generator=g) * 0.1).bfloat16().cuda().requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[::4] = -100
    y = y.cuda()

    def forward_only():
        with torch.no_grad():
            linear_logprobs(h, w, y)

    def train(mode, chunk_size=None):
        return lambda: torch.autograd.grad(linear_cross_entropy(h, w, y, memory_mode=mode, chunk_size=chunk_size),
                                           (h, w))

    from megatron_fused_ce.ops import agreement

    for fn in (forward_only, train("lean"), train("fast"), train("fast", 64)):  # compile the kernels first
        fn()
    assert _host_syncs(forward_only) == 0
    assert _host_syncs(train("lean")) == 0
    assert _host_syncs(train("fast")) == 0  # one chunk of all 300 rows: dW made in bf16
    assert _host_syncs(train("fast", 64)) == 0  # an fp32 sum, or QuACK's last GEMM writing bf16
    agreement.forget_signatures()
    assert _host_syncs(forward_only) == 1  # the first call of a signature: its agreement


@pytest.mark.parametrize("n", [1, 1000, 3 * 1024 + 17])
def test_label_targets_matches_torch(tb, n):
    """One launch for each row's target on the shard, the labelled rows, their count and the
    bad-label flag (OR-ed into the deferred-errors word), as the torch backend's dozen ops do:
    ignored rows, labels on other shards, out of range (negative, >= vocab) and in the padding."""
    g = torch.Generator().manual_seed(n)
    labels = torch.randint(-3, 130, (n,), generator=g)
    labels[::5] = -100
    for bad in (False, True):
        y = labels.clamp(0, 119) if not bad else labels
        y = torch.where(labels == -100, -100, y)
        for vocab_start in (0, 40, 80):
            want = torch_backend.label_targets(y, -100, 120, vocab_start, 40)
            flags = torch.tensor([4], dtype=torch.int64, device=DEVICE)  # a flag recorded before
            kernel = tb._label_targets_kernel
            target = torch.empty(n, dtype=torch.int64, device=DEVICE)
            labelled = torch.empty(n, dtype=torch.uint8, device=DEVICE)
            counts = torch.empty(2, dtype=torch.int64, device=DEVICE)
            scalars = torch.empty(3, dtype=torch.float32, device=DEVICE)
            kernel[(1,)](y.to(DEVICE), target, labelled, counts, scalars, flags, n, -100, 120, vocab_start, 40,
                         0, 0, 0, counts, 1, 0, 0, HAS_FLAGS=True, HAS_CHECK=False, HAS_MASK=False, BLOCK=1024)
            assert torch.equal(target.cpu(), want[0]) and torch.equal(labelled.cpu().bool(), want[1])
            torch.testing.assert_close(scalars.cpu(), want[3], equal_nan=True, rtol=0, atol=0)
            assert torch.equal(counts.cpu(), want[2]) and int(want[2][1]) == int(bad and bool(((y < 0) & (y != -100)).any() or (y >= 120).any()))
            assert int(flags) == 4 | int(want[2][1])


@pytest.mark.parametrize("n", [1, 1000, 3 * 1024 + 17])
def test_label_kernel_makes_the_rank_check_of_the_labels(tb, n):
    """With a signature code, the label kernel also writes what TP ranks compare on a remembered
    signature: agreement.fingerprint_pieces of [the code, the labels' two fingerprint sums], equal
    to the torch backend's (agreement's own functions) for ids of every size (negative, ignored,
    beyond 2^31) and codes of 1 to 2^32 - 1; a changed label changes them."""
    g = torch.Generator().manual_seed(n)
    labels = torch.randint(-3, 1 << 20, (n,), generator=g)
    labels[::5] = -100
    labels[::7] = (1 << 40) + 3  # ids beyond 2^31 fold their high bits in

    def kernel_pieces(y, code):
        target = torch.empty(n, dtype=torch.int64, device=DEVICE)
        labelled = torch.empty(n, dtype=torch.uint8, device=DEVICE)
        counts = torch.empty(2, dtype=torch.int64, device=DEVICE)
        scalars = torch.empty(12, dtype=torch.float32, device=DEVICE)
        tb._label_targets_kernel[(1,)](y.to(DEVICE), target, labelled, counts, scalars, counts, n, -100, 1 << 20, 0,
                                       1 << 19, *tb._pieces(code), counts, 1, 0, 0, HAS_FLAGS=False, HAS_CHECK=True,
                                       HAS_MASK=False, BLOCK=1024)
        return scalars.cpu()

    for code in (1, 16, 0xDEADBEEF, 2**32 - 1):
        want = torch_backend.label_targets(labels, -100, 1 << 20, 0, 1 << 19, None, code)[3]
        got = kernel_pieces(labels, code)
        assert want.shape == (12,) and torch.equal(got[3:], want[3:]), code  # (the first 3: NaN for bad ids)
        torch.testing.assert_close(got[:3], want[:3], equal_nan=True, rtol=0, atol=0)
    changed = labels.clone()
    changed[n // 2] += 1
    assert not torch.equal(kernel_pieces(changed, 16)[3:], kernel_pieces(labels, 16)[3:])


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
@pytest.mark.parametrize("transposed", [False, True])
def test_label_kernel_ignores_the_positions_a_mask_drops(tb, mask_dtype, transposed):
    """`label_mask` (GRPO's mask, in the labels' layout, a transposed view included): where it is 0
    the label counts as ignore_index for everything the kernel makes (targets, labelled rows and
    their count, the bad-label flag, the rank check's fingerprint), equal to the labels filled with
    ignore_index there (the torch backend's definition); garbage there (ids out of range) is not
    a bad label."""
    g = torch.Generator().manual_seed(7)
    rows, cols = 37, 29
    labels = torch.randint(0, 120, (rows, cols), generator=g)
    labels[::4, ::3] = -100
    keep = torch.rand(rows, cols, generator=g) > 0.3
    labels[~keep] = torch.randint(-5, 10**6, (int((~keep).sum()),), generator=g)  # garbage where dropped
    if transposed:  # labels [T, B] against a [B, T] mask read through its transposed view (sequence parallelism)
        labels, keep = labels.t().contiguous(), keep.t()
    mask = keep.to(mask_dtype).to(DEVICE)
    filled = labels.masked_fill(~keep, -100)
    n = labels.numel()

    def kernel(vocab_start):  # the launch itself (under the interpreter on a CPU machine)
        out = (torch.empty(n, dtype=torch.int64, device=DEVICE), torch.empty(n, dtype=torch.uint8, device=DEVICE),
               torch.empty(2, dtype=torch.int64, device=DEVICE), torch.empty(12, dtype=torch.float32, device=DEVICE))
        read = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        tb._label_targets_kernel[(1,)](labels.reshape(-1).to(DEVICE), *out, out[2], n, -100, 120, vocab_start, 40,
                                       *tb._pieces(77), read, read.shape[1], read.stride(0), read.stride(1),
                                       HAS_FLAGS=False, HAS_CHECK=True, HAS_MASK=True, BLOCK=1024)
        return out[0], out[1].bool(), out[2], out[3]

    for vocab_start in (0, 40):
        want = torch_backend.label_targets(filled.reshape(-1), -100, 120, vocab_start, 40, None, 77)
        for got in (kernel(vocab_start), tb.label_targets(labels.reshape(-1).to(DEVICE), -100, 120, vocab_start, 40,
                                                          None, 77, (), label_mask=mask)):
            for g_, w_ in zip(got, want):
                torch.testing.assert_close(g_.cpu(), w_, equal_nan=True, rtol=0, atol=0)
            assert int(got[2][1]) == 0  # no bad label: the garbage is where the mask drops it
        unmasked = torch_backend.label_targets(labels.reshape(-1), -100, 120, vocab_start, 40, None, 77,
                                               label_mask=keep.to(mask_dtype))
        for g_, w_ in zip(unmasked, want):
            torch.testing.assert_close(g_, w_, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 1000, 3 * 1024 + 17])
def test_fingerprint_pieces_kernel_matches_agreement(tb, n):
    """A must-agree tensor's rank-check pieces in one launch (GRPO's advantages and mask at TP > 1:
    some seven launches each in torch): agreement.fingerprint_pieces of agreement.tensor_fingerprint,
    equal to the torch definition for every dtype (the bits of fp32 / bf16 / fp16 / fp64 values,
    negative ints, bools, int64 beyond 2^31) and for a non-contiguous tensor; a changed or swapped
    element changes them. On CUDA also through the label launch's `agree_tensors`."""
    from megatron_fused_ce.ops import agreement

    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g) * 3
    tensors = {
        "fp32": base, "bf16": base.bfloat16(), "fp16": base.half(), "fp64": base.double() * 1e5,
        "int32": torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32),
        "int64": torch.randint(-2**40, 2**40, (n,), generator=g), "bool": torch.rand(n, generator=g) > 0.5,
        "uint8": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8),
        "int8": torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8),
        "strided": torch.randn(n, 3, generator=g)[:, 1],
    }
    for name, t in tensors.items():
        want = agreement.fingerprint_pieces(agreement.tensor_fingerprint(t))
        got = tb.tensor_fingerprint_pieces(t.to(DEVICE))
        assert torch.equal(got.cpu(), want), name
        assert torch.equal(torch_backend.tensor_fingerprint_pieces(t), want), name
        if n > 1 and name not in ("bool", "uint8", "int8"):
            changed = t.clone()
            changed[0], changed[1] = t[1].item(), t[0].item()  # swapped
            if not torch.equal(changed, t):
                assert not torch.equal(tb.tensor_fingerprint_pieces(changed.to(DEVICE)).cpu(), want), name
    if DEVICE.type == "cuda":  # the label launch writes them after its own pieces
        labels = torch.randint(0, 100, (n,), generator=g).to(DEVICE)
        agree = (tensors["fp32"].to(DEVICE), tensors["bool"].to(DEVICE))
        got = tb.label_targets(labels, -100, 100, 0, 100, None, 77, agree)[3]
        want = torch_backend.label_targets(labels, -100, 100, 0, 100, None, 77, agree)[3]
        assert got.shape == want.shape == (3 + 9 + 12,) and torch.equal(got[3:], want[3:])


@pytest.mark.parametrize("src_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("rows,cols", [(1, 7), (5, 1024), (33, 2500)])
@pytest.mark.parametrize("masked", [False, True])
def test_row_scale_matches_torch_math(tb, src_dtype, out_dtype, rows, cols, masked):
    """`row_scale`: out = src * g[row] in fp32, rounded once to out's dtype (dX rows from an fp32
    product, g·h for dW), as torch's broadcast product writes it: bit for bit, on views whose rows
    are strided (a chunk of the rows, columns of a wider buffer), with g = 0 at unlabelled rows, or
    (`keep`) g taken as 0 outside a row mask whatever it is there (NaN included). The
    interpreter's fp32 -> bf16 cast truncates: on CPU the kernel runs for fp32 outputs only."""
    g = torch.Generator().manual_seed(rows * cols)
    wide = (torch.randn(rows, cols + 9, generator=g) * 3).to(src_dtype).to(DEVICE)
    src = wide[:, 4:4 + cols]  # rows strided past the columns
    scale = torch.randn(rows, generator=g).to(DEVICE)
    scale[::3] = 0.0
    keep = None
    applied = scale
    if masked:
        keep = (torch.arange(rows) % 2 == 0).to(DEVICE)
        scale[1::4] = float("nan")  # outside the mask: taken as 0
        applied = torch.where(keep, scale, 0.0)
    want = torch.mul(src, applied.unsqueeze(1), out=torch.empty(rows, cols, dtype=out_dtype, device=DEVICE))
    out_wide = torch.full((rows, cols + 3), float("nan"), dtype=out_dtype, device=DEVICE)
    out = out_wide[:, :cols]
    assert torch_backend.row_scale(out.clone(), src, scale, keep).equal(want)
    assert tb.row_scale(out, src, scale, keep) is out
    assert torch.equal(out, want)
    assert out_wide[:, cols:].isnan().all()  # nothing written past the columns


@pytest.mark.parametrize("layout", ["expanded", "strided", "bf16"])
def test_row_scale_reads_the_scale_as_given(tb, layout):
    """`row_scale` reads g in its own layout: an upstream gradient of a sum (or a mean) arrives
    expanded from one element (stride 0), a per-token one may be a strided view or in bf16; the
    result is torch's product with that g, bit for bit, whatever the layout (no copy made first)."""
    rows, cols = 37, 1500
    g = torch.Generator().manual_seed(7)
    src = (torch.randn(rows, cols, generator=g) * 3).to(DEVICE)
    if layout == "expanded":
        scale = torch.tensor([0.37]).to(DEVICE).expand(rows)
    elif layout == "strided":
        scale = torch.randn(2 * rows, generator=g).to(DEVICE)[::2]
    else:
        scale = torch.randn(rows, generator=g).to(torch.bfloat16).to(DEVICE)
    want = torch.mul(src, scale.float().unsqueeze(1))
    out = torch.full((rows, cols), float("nan"), device=DEVICE)
    assert tb.row_scale(out, src, scale) is out
    assert torch.equal(out, want)


# ------------------------------------------------------------ the upstream gradient g in backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 4096, 3 * 4096 + 17])
def test_scale_matches_torch_math(tb, dtype, numel):
    """`scale_`: t * g in fp32 with the fp32 g, rounded once to t's dtype, in place, whatever g
    (1, not representable in bf16, negative); the torch backend's pieces give the same. The
    interpreter's fp32 -> bf16 cast truncates, so on CPU the kernel is checked in fp32."""
    g = torch.Generator().manual_seed(numel)
    src = (torch.randn(numel, generator=g) * 3).to(dtype)
    for scale in (1.0, 1.0 / 3.0, -2.5):
        s = torch.tensor(scale, dtype=torch.float32)
        want = (src.float() * s).to(dtype)
        other = torch.arange(5, dtype=torch.float32) - 2.0  # a second tensor (dW with dX), one launch
        t, o = src.clone(), other.clone()
        assert torch_backend.scale_(t, s, o) is t
        assert torch.equal(t, want) and torch.equal(o, other * s), f"torch backend, g = {scale}"
        if DEVICE.type == "cuda" or dtype == torch.float32:
            blocks = -(-numel // 1024)
            for programs in (blocks + 1, 2):  # a program per block, and two walking all the blocks
                t, o = src.clone().to(DEVICE), other.clone().to(DEVICE)
                tb._scale_kernel[(programs,)](t, o, s.reshape(1).to(DEVICE), numel, o.numel(), blocks, blocks + 1,
                                              BLOCK=1024)
                assert torch.equal(t.cpu(), want), f"Triton kernel, g = {scale}, {programs} programs"
                assert torch.equal(o.cpu(), other * s), f"Triton kernel, second tensor, g = {scale}"
            if DEVICE.type == "cuda":  # the launcher, one tensor and two
                t, o = src.clone().to(DEVICE), other.clone().to(DEVICE)
                assert tb.scale_(t, s.to(DEVICE), o) is t
                assert torch.equal(t.cpu(), want) and torch.equal(o.cpu(), other * s)


@pytest.mark.parametrize("n", [1, 2048, 3 * 2048 + 5])
def test_labelled_loss_sum_matches_torch(tb, n):
    """Cross-entropy's loss value in one launch: Σ over labelled rows of (max - z_y) + log S, times
    the mean's 1/count, plus the poison (NaN stays NaN), as the torch backend's ops give it;
    float64 is the reference (the kernel adds in another order than torch.sum)."""
    g = torch.Generator().manual_seed(n)
    target, row_max = torch.randn(n, generator=g) * 4, torch.randn(n, generator=g) * 4 + 6
    log_sum_exp = torch.rand(n, generator=g) * 3
    labelled = torch.rand(n, generator=g) > 0.3
    scale = torch.tensor(1.0 / max(int(labelled.sum()), 1))
    want64 = float(torch.where(labelled, (row_max.double() - target.double()) + log_sum_exp.double(), 0.0).sum()
                   * scale.double())
    for poison in (torch.zeros(1), torch.full((1,), float("nan"))):
        for mask, sc in ((labelled, scale), (None, None)):
            want = torch_backend.labelled_loss_sum(target, row_max, log_sum_exp, mask, sc, poison)
            inputs = [t.to(DEVICE) for t in (target, row_max, log_sum_exp)]
            out = torch.empty((), device=DEVICE)
            tb._labelled_loss_sum_kernel[(1,)](
                *inputs, inputs[0] if mask is None else mask.to(DEVICE).view(torch.uint8),
                inputs[0] if sc is None else sc.reshape(1).to(DEVICE), poison.to(DEVICE), out, n,
                HAS_LABELLED=mask is not None, HAS_SCALE=sc is not None, HAS_POISON=True, BLOCK=2048)
            got = [out.cpu()]
            if DEVICE.type == "cuda":  # the launcher
                got.append(tb.labelled_loss_sum(*inputs, None if mask is None else mask.to(DEVICE),
                                                None if sc is None else sc.to(DEVICE), poison.to(DEVICE)).cpu())
            for value in got:
                torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-5, equal_nan=True)
            if mask is not None and not poison.isnan().any():
                torch.testing.assert_close(want.double(), torch.tensor(want64, dtype=torch.float64),
                                           rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 7, 2500])
def test_tp_merge_kernels_match_torch(tb, n):
    """The TP merge's per-row math, one launch each, against its torch definition and a float64
    merge: every rank's packed partials (reductions.packed_partials, gathered in rank order) merged
    into M, log S, lse, z_y, sum z and the entropy (a rank without valid columns of a row, max -inf,
    contributes 0; with and without sum z and the entropy's sum; 2 and 4 ranks), the rank check's
    verdict (the poison NaN and the flag recorded only where one rank's values differ from rank
    0's; a poison already NaN stays NaN), the forward-only log-probs the merge's launch writes
    (0 at ignored rows; NaN everywhere under the verdict's or a given NaN poison), a whole-vocab
    shard's log S, lse and entropy, and a forward-only call's labelled log-probs apart.
    On CUDA every output is equal bit for bit (the sums in rank order, unfused products, and
    libdevice's expf and logf are torch's)."""
    from megatron_fused_ce.ops.backends import ShardStats
    from megatron_fused_ce.ops.reductions import packed_partials

    g = torch.Generator().manual_seed(n)
    cuda = DEVICE.type == "cuda"
    v = torch.randint(0, 2**21, (6,), generator=g).float()
    labelled = torch.rand(n, generator=g) > 0.3
    for ranks in (2, 4):
        shards = []
        for rank in range(ranks):
            row_max = torch.randn(n, generator=g) * 5
            if rank > 0:
                row_max[rank::3] = float("-inf")  # this shard holds no valid column of these rows
            sum_exp = torch.where(torch.isfinite(row_max), torch.rand(n, generator=g) * 50 + 1, 0.0)
            shards.append(ShardStats(max=row_max, sum_exp=sum_exp, target=torch.randn(n, generator=g),
                                     sum_logits=torch.randn(n, generator=g) * 100,
                                     sum_exp_shifted=-torch.rand(n, generator=g) * 9))
        # the float64 merge
        maxes = torch.stack([s.max for s in shards]).double()
        want_max = maxes.amax(0)
        rescale = torch.exp(maxes - want_max)
        sums = torch.stack([s.sum_exp for s in shards]).double()
        want_s = (sums * rescale).sum(0)
        shift = torch.where(torch.isfinite(maxes), maxes - want_max, 0.0)
        shifted = ((torch.stack([s.sum_exp_shifted for s in shards]).double() + shift * sums) * rescale).sum(0)
        want64 = {"max": want_max, "log_sum_exp": want_s.log(), "lse": want_max + want_s.log(),
                  "target": torch.stack([s.target for s in shards]).double().sum(0),
                  "sum_logits": torch.stack([s.sum_logits for s in shards]).double().sum(0),
                  "entropy": want_s.log() - shifted / want_s}
        names = ("max", "log_sum_exp", "lse", "target", "sum_logits", "entropy")
        for fields in (("sum_logits", "sum_exp_shifted"), ("sum_exp_shifted",), ()):
            dropped = {f: None for f in ("sum_logits", "sum_exp_shifted") if f not in fields}
            for differ, poison_so_far in ((False, 0.0), (True, 0.0), (False, float("nan"))):
                checks = [v.clone() for _ in range(ranks)]
                if differ:
                    checks[-1][2] += 1  # the last rank's values differ at one place
                gathered = torch.stack([packed_partials(dataclasses.replace(s, **dropped), c)
                                        for s, c in zip(shards, checks)]).to(DEVICE)
                flags, results = {}, {}
                for name, backend in (("torch", torch_backend), ("triton", tb)):
                    flags[name] = torch.full((1,), 4, dtype=torch.int64, device=DEVICE)
                    verdict = (torch.full((1,), poison_so_far, device=DEVICE), flags[name], 2)
                    results[name] = backend.merge_gathered(gathered, n, "sum_logits" in fields,
                                                           "sum_exp_shifted" in fields, verdict, True,
                                                           labelled.to(DEVICE))
                got, want = results["triton"], results["torch"]
                for name, a, b in zip(names, got, want):
                    expected = ((name == "sum_logits" and "sum_logits" not in fields)
                                or (name == "entropy" and "sum_exp_shifted" not in fields))
                    assert (a is None) == (b is None) == expected, (name, fields)
                    if a is None:
                        continue
                    _close(a, b, what=f"{name} {fields} at {ranks} ranks")
                    if cuda:
                        assert torch.equal(a, b), (name, fields, ranks)
                    torch.testing.assert_close(b.cpu().double(), want64[name], rtol=1e-5, atol=1e-5)
                (poison, logprob), (want_poison, want_logprob) = got[6:], want[6:]
                poisoned = differ or poison_so_far != 0.0
                assert torch.isnan(poison).item() == poisoned, (differ, poison_so_far)
                assert torch.equal(poison.isnan(), want_poison.isnan())
                assert flags["triton"].item() == flags["torch"].item() == 4 | (2 if differ else 0)
                # the log-probs in the same launch take the verdict: NaN everywhere, else the
                # labelled rows' (z_y - M) - log S and 0 at the others
                if poisoned:
                    assert torch.isnan(logprob).all() and torch.isnan(want_logprob).all()
                else:
                    _close(logprob, want_logprob, what=f"log-probs {fields} at {ranks} ranks")
                    if cuda:
                        assert torch.equal(logprob, want_logprob)
                    want_lp = torch.where(labelled, (want64["target"] - want_max) - want64["log_sum_exp"], 0.0)
                    torch.testing.assert_close(want_logprob.cpu().double(), want_lp, rtol=1e-5, atol=1e-5)
        gathered = torch.stack([packed_partials(s) for s in shards]).to(DEVICE)
        for poison_value in (None, 0.0, float("nan")):  # without a verdict: the log-probs take `poison`
            poison = None if poison_value is None else torch.full((1,), poison_value, device=DEVICE)
            got = tb.merge_gathered(gathered, n, True, True, None, True, None, poison)
            want = torch_backend.merge_gathered(gathered, n, True, True, None, True, None, poison)
            assert got[6] is None and want[6] is None  # no verdict, no poison out
            if poison_value is not None and poison_value != 0:
                assert torch.isnan(got[7]).all() and torch.isnan(want[7]).all()
            else:
                _close(got[7], want[7], what="log-probs without a verdict")
                if cuda:
                    assert torch.equal(got[7], want[7])
        assert tb.merge_gathered(gathered, n, True, True)[6:] == (None, None)

    def on_device(x):
        return None if x is None else x.to(DEVICE)

    global_max = torch.randn(n, generator=g) * 5
    total = torch.rand(n, generator=g) * 1e4 + 1
    shifted = torch.rand(n, generator=g) * 1e3
    for with_entropy in (True, False):
        got = tb.merged_tail(global_max.to(DEVICE), total.to(DEVICE), shifted.to(DEVICE) if with_entropy else None)
        want = torch_backend.merged_tail(global_max.to(DEVICE), total.to(DEVICE),
                                         shifted.to(DEVICE) if with_entropy else None)
        assert (got[2] is None) == (not with_entropy)
        for name, a, b in zip(("log_sum_exp", "lse", "entropy"), got, want):
            if a is not None:
                _close(a, b, what=name)
                if cuda:
                    assert torch.equal(a, b), name

    target = torch.randn(n, generator=g) + global_max
    log_sum_exp = torch.rand(n, generator=g) * 5
    labelled = torch.rand(n, generator=g) > 0.3
    # replay's: the label not in its kept set gives -inf (an ignored row's 0 where kept is True there)
    label_kept = (torch.rand(n, generator=g) > 0.2) | ~labelled
    for mask in (labelled, None):
        for poison_value in (0.0, float("nan"), None):
            for kept in (None, label_kept):
                poison = None if poison_value is None else torch.full((1,), poison_value, device=DEVICE)
                args = (target.to(DEVICE), global_max.to(DEVICE), log_sum_exp.to(DEVICE), on_device(mask), poison,
                        on_device(kept))
                got, want = tb.labelled_logprob(*args), torch_backend.labelled_logprob(*args)
                if poison_value is not None and poison_value != 0:
                    assert torch.isnan(got).all()
                    continue
                _close(got, want, what="labelled_logprob")
                if cuda:
                    assert torch.equal(got, want)
                if mask is not None:
                    assert torch.all(got.cpu()[~mask] == 0)
                if kept is not None:
                    assert torch.all(got.cpu()[~kept] == float("-inf"))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_merged_logprobs_without_a_group_is_the_tail_and_the_labelled_logprobs(impl):
    """reductions.merged_logprobs at TP = 1 (nothing to gather): merge_shard_stats' tail and the
    labelled rows' log-probs plus the call's poison, read when the call asks for it (NaN everywhere
    under a NaN poison), in the tail's launch: bit for bit backend.labelled_logprob's, with
    replay's kept sets too."""
    from megatron_fused_ce.ops import backends, reductions
    from megatron_fused_ce.ops.backends import ShardStats

    backend = backends.select(impl, DEVICE)
    g = torch.Generator().manual_seed(5)
    n = 37
    stats = ShardStats(max=torch.randn(n, generator=g).to(DEVICE), sum_exp=(torch.rand(n, generator=g) + 1).to(DEVICE),
                       target=torch.randn(n, generator=g).to(DEVICE))
    labelled = (torch.rand(n, generator=g) > 0.3).to(DEVICE)
    for poison_value in (0.0, float("nan")):
        read = []
        poison = torch.full((1,), poison_value, device=DEVICE)
        merged, logprob = reductions.merged_logprobs(stats, None, backend, None, labelled,
                                                     lambda: read.append(1) or poison)
        assert read == [1]
        want = reductions.merge_shard_stats(stats, None, backend)
        for name in ("max", "log_sum_exp", "lse", "target"):
            assert torch.equal(getattr(merged, name), getattr(want, name)), name
        expected = backend.labelled_logprob(want.target, want.max, want.log_sum_exp, labelled, poison)
        assert torch.equal(logprob.isnan(), expected.isnan())
        if poison_value == 0.0:
            assert torch.equal(logprob, expected) and torch.all(logprob.cpu()[~labelled.cpu()] == 0)
    # replay's at TP = 1: the kept sets' -inf in the tail's launch too, the entropy beside it unchanged
    kept = (torch.rand(n, generator=g) > 0.2).to(DEVICE)
    with_entropy = ShardStats(max=stats.max, sum_exp=stats.sum_exp, target=stats.target,
                              sum_exp_shifted=torch.rand(n, generator=g).to(DEVICE))
    poison = torch.zeros(1, device=DEVICE)
    merged = reductions.merge_shard_stats(with_entropy, None, backend, logprob_of=(labelled, kept, poison))
    want = reductions.merge_shard_stats(with_entropy, None, backend)
    assert want.forward_logprob is None
    for name in ("max", "log_sum_exp", "lse", "target", "entropy"):
        assert torch.equal(getattr(merged, name), getattr(want, name)), name
    expected = backend.labelled_logprob(want.target, want.max, want.log_sum_exp, labelled, poison, kept=kept)
    assert torch.equal(merged.forward_logprob, expected)
    assert torch.all(expected.cpu()[~kept.cpu()] == float("-inf"))


def _forward_only_worker(rank, world, case, impl, chunk_size):
    import torch.distributed as dist

    from megatron_fused_ce.ops import backends

    group = dist.group.WORLD
    v_local = case["v_local"]
    launches = []
    backend = backends.select(impl, torch.device("cpu"))
    original = backend.labelled_logprob

    def spy(*args):
        launches.append(args[0].shape[0])
        return original(*args)

    object.__setattr__(backend, "labelled_logprob", spy)  # (a frozen dataclass: this worker's copy only)
    try:
        h = case["hidden"].clone()
        w = case["weight"][rank * v_local:(rank + 1) * v_local].clone()
        common = dict(tp_group=group, vocab_size=case["vocab"], temperature=0.7, chunk_size=chunk_size, impl=impl)
        with torch.no_grad():
            forward_only = linear_logprobs(h, w, case["labels"], **common).logprobs
        taken = list(launches)
        with_grad = linear_logprobs(h.requires_grad_(), w, case["labels"], **common).logprobs.detach()
        # a remembered signature (the rank check rides on the merge), labels that differ on one rank
        labels = case["labels"].clone()
        if rank == 1:
            labels[0, 1] = (labels[0, 1] + 1) % case["vocab"]
        with torch.no_grad():
            linear_logprobs(h.detach(), w, case["labels"], **common)
            differing = linear_logprobs(h.detach(), w, labels, **common).logprobs
        try:
            from megatron_fused_ce import check_deferred_errors

            check_deferred_errors()
            raised = None
        except ValueError as error:
            raised = str(error)
    finally:
        object.__setattr__(backend, "labelled_logprob", original)
    return forward_only, with_grad, taken, bool(torch.isnan(differing).all()), raised


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_forward_only_logprobs_over_tp_ranks_end_in_one_launch(small_blocks, impl, chunk_size):
    """A forward-only log-prob call at TP = 2 (one chunk, several) ends in backend.labelled_logprob
    after the merge's launch (a signature's first call; later one-chunk calls, on their route, in the
    merge's launch itself): values equal to the float64 reference (ignored labels, a padded vocab,
    temperature) and to the differentiable call's (bit for bit on the torch backend); labels that
    differ across ranks on a remembered signature give NaN on every rank and raise at the next
    check (the merge's kernel records the verdict and poisons the log-probs it writes)."""
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors; tests/test_multigpu.py runs NCCL")
    tp = 2
    case = _case(29, tp, torch.float32)
    z = (case["hidden"].double().reshape(-1, case["hidden"].shape[-1]) @ case["weight"].double()[:case["vocab"]].t())
    labels = case["labels"].reshape(-1)
    ref = torch.log_softmax(z / 0.7, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    ref = torch.where(labels >= 0, ref, 0.0).reshape(case["labels"].shape)
    for rank, (forward_only, with_grad, taken, nan, raised) in enumerate(
            run_workers(_forward_only_worker, tp, case, impl, chunk_size)):
        assert taken == [labels.numel()], (rank, taken)
        torch.testing.assert_close(forward_only.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.all(forward_only[case["labels"] < 0] == 0)
        if impl == "torch":
            assert torch.equal(forward_only, with_grad)
        else:
            _close(forward_only, with_grad, what="forward-only against the differentiable call")
        assert nan, rank
        assert raised is not None and "differ across tensor-parallel ranks" in raised, (rank, raised)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_upstream_gradient_is_applied_in_fp32(small_blocks, impl, chunk_size):
    """With g = 1/3 (Megatron's 1 / num_microbatches; not a bf16 number), the dX made in the
    forward, and a dW made there in bf16 (one chunk), come out as bf16(fp32 grad x g): g is not
    rounded to bf16 before it multiplies (a 0.2 % bias on every element if it were)."""
    if DEVICE.type == "cpu" and impl == "triton" and chunk_size is None:
        pytest.skip("same scaling path as chunk_size=16 under the slow interpreter")
    g = torch.Generator().manual_seed(8)
    n, hdim, v = 40, 32, 100
    h = torch.randn(n, hdim, generator=g).bfloat16().to(DEVICE).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) * 0.3).bfloat16().to(DEVICE).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    y = y.to(DEVICE)
    third = torch.tensor(1.0 / 3.0, device=DEVICE)
    grads = {}
    for name, upstream in (("unit", None), ("third", third)):
        loss = linear_cross_entropy(h, w, y, impl=impl, chunk_size=chunk_size)
        grads[name] = torch.autograd.grad(loss, (h, w), grad_outputs=upstream)
    (dx1, dw1), (dx3, dw3) = grads["unit"], grads["third"]
    assert torch.equal(dx3, (dx1.float() * third).bfloat16())
    if chunk_size is None:  # one chunk: dW made in bf16 in the forward (several: an fp32 sum)
        assert torch.equal(dw3, (dw1.float() * third).bfloat16())


def test_backend_parts_swapped_at_run_time_are_what_select_hands_out():
    """backends.select keeps its modules between calls (no import per call) but reads each one's
    BACKEND on every call: a backend swapped at run time (tests counting kernel calls, QuACK's
    parts) is the one the op runs."""
    from megatron_fused_ce.ops import backends
    from megatron_fused_ce.ops.backends import triton_backend

    cuda = torch.device("cuda")  # ("auto" only looks at the device type: no GPU needed)
    originals = triton_backend.BACKEND, torch_backend.BACKEND
    backends.select("auto", cuda), backends.select("triton", cuda), backends.select("torch", cuda)  # cached
    # parts of their own, told apart by identity
    swapped_triton = dataclasses.replace(originals[0], gemm_dlogits=dataclasses.replace(originals[0].gemm_dlogits))
    swapped_torch = dataclasses.replace(originals[1], label_targets=lambda *a, **k: originals[1].label_targets(*a, **k))
    try:
        triton_backend.BACKEND, torch_backend.BACKEND = swapped_triton, swapped_torch
        assert backends.select("triton", cuda) is swapped_triton
        assert backends.select("torch", cuda) is swapped_torch
        assert backends.select("auto", cuda).gemm_dlogits is swapped_triton.gemm_dlogits
        assert backends.select("auto", torch.device("cpu")).label_targets is swapped_torch.label_targets
    finally:
        triton_backend.BACKEND, torch_backend.BACKEND = originals
    assert backends.select("triton", cuda) is originals[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor descriptors' scratch allocator is CUDA's")
def test_fused_gemms_run_in_threads_that_did_not_make_the_first_call(monkeypatch):
    """Triton keeps its scratch allocator (device-side tensor descriptors) in a context variable:
    the fused GEMMs also run in autograd's backward thread (recompute backward) and in other
    threads (activation recomputation, data-loader-side reference passes)."""
    import threading

    from megatron_fused_ce.ops import fast
    from megatron_fused_ce.ops.backends import triton_backend

    monkeypatch.setattr(fast, "FUSED_STATS_MIN_BYTES", 0)  # the fused statistics GEMM at this small shape
    g = torch.Generator(device="cuda").manual_seed(4)
    h = torch.randn(256, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(1000, 128, device="cuda", generator=g) / 8).bfloat16().requires_grad_()
    y = torch.randint(0, 1000, (256,), device="cuda", generator=g)
    calls, stats_calls = [], []
    original = _count_gemm_dlogits(triton_backend, calls)
    _count_gemm_stats(triton_backend, stats_calls)
    try:
        with torch.no_grad():
            first = linear_logprobs(h, w, y).logprobs  # main thread: the stats GEMM
        results = []
        thread = threading.Thread(target=lambda: results.append(torch.no_grad()(linear_logprobs)(h, w, y).logprobs))
        thread.start()
        thread.join()
        # two chunks: the recompute path, its dlogits GEMM in the backward thread
        linear_logprobs(h, w, y, chunk_size=128).logprobs.sum().backward()
    finally:
        triton_backend.BACKEND = original
    assert results and torch.equal(results[0], first)
    assert len(stats_calls) >= 2 and calls and h.grad is not None and torch.isfinite(w.grad.float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exp_tile_matches_torch_backend(tb, dtype):
    """Lean sweep A's tile transform over four tiles of the same rows (first, later, one with
    padding columns, one whose rows 1 and 4 go past the reference margin) on both backends: P in
    place, the accumulated partials, and the accumulator rows rescaled where the reference moved
    (and only there)."""
    g = torch.Generator().manual_seed(9)
    n, c, hidden, margin = 9, 150, 70, 20.0
    tiles = [(torch.randn(n, c, generator=g) * 3).to(dtype).to(DEVICE) for _ in range(4)]
    tiles[3][[1, 4], 7] = 40.0  # z = 40 / 0.7: past ref + margin; rows 1 and 4 move
    targets = [_targets(n, c, g) for _ in range(4)]
    acc0 = torch.randn(n, hidden, generator=g).to(DEVICE)
    results = []
    for backend in (tb, torch_backend):
        state = [torch.zeros(n, device=DEVICE) for _ in range(4)]
        acc = acc0.clone()
        outs, refs = [], []
        for k, tile in enumerate(tiles):
            t = tile.clone()
            backend.exp_tile_(t, targets[k], 140 if k == 2 else c, 1 / 0.7, *state, None if k == 0 else acc,
                              first=k == 0, ref_margin=margin)
            outs.append(t)
            refs.append(state[0].clone())
        results.append((state, outs, acc, refs))
    (state, outs, acc, refs), (ref_state, ref_outs, ref_acc, _) = results
    for name, a, b in zip(("ref_max", "sum_exp", "target", "sum_logits"), state, ref_state):
        _close(a, b, what=name)
    for a, b in zip(outs, ref_outs):
        _close(a, b, dtype, what="P")
    assert torch.all(outs[2][:, 140:] == 0)
    moved = torch.zeros(n, dtype=torch.bool)
    moved[[1, 4]] = True
    assert torch.equal((refs[3] != refs[2]).cpu(), moved)
    assert torch.allclose(refs[3][moved.to(DEVICE)].cpu(), torch.tensor(40.0).to(dtype).float() / 0.7)
    assert float(outs[3].float().max()) <= math.exp(margin) * (1 + 1e-2)  # P stays below e^margin
    assert torch.equal(refs[2], refs[0])  # no earlier move
    scale = torch.exp(refs[2] - refs[3]).unsqueeze(1).cpu()  # 1 where the reference stayed
    _close(acc, acc0.cpu() * scale, what="acc")
    _close(acc, ref_acc, what="acc vs torch")
    assert torch.equal(acc[~moved.to(DEVICE)], acc0[~moved.to(DEVICE)])
