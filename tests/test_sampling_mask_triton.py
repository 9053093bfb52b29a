"""Sampling-mask replay through the Triton backend (impl="triton") against the torch backend, and
replay_triton's kept-set kernels against the torch math of backends/replay_torch.py.

On the Triton backend the rows with a set are scored by replay_triton's kernels (gathered W rows,
their dots and statistics in one kernel; dX per row; dW by a segmented sum over the entries sorted
by id and fp32 atomic adds), the rows without one by the plain path's epilogue GEMMs. Without a
GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set at import),
as in tests/test_triton_backend.py. Integer-valued inputs: both backends see the same z, so the
kept labels match exactly and the values to fp32 rounding.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

import reference  # noqa: E402
from dist import run_workers  # noqa: E402
from sampling_cases import local_inputs, world_group  # noqa: E402
from triton_interpret import kernel_modules  # noqa: E402
from megatron_fused_ce import linear_logprobs  # noqa: E402
from megatron_fused_ce.ops import replay  # noqa: E402
from megatron_fused_ce.ops.backends import replay_union_triton  # noqa: E402
from sampling_mask_cases import VIEWS, label_phases, random_sets  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def triton_kernels():
    """{name: kernel module}, interpreted off CUDA."""
    if DEVICE.type != "cuda":
        return kernel_modules()
    from megatron_fused_ce.ops.backends import replay_triton

    return {"replay_triton": replay_triton}


@pytest.mark.parametrize("force", [None, "sparse", "tiles", "dense"])
def test_triton_backend_matches_torch(triton_kernels, force, monkeypatch, request):
    monkeypatch.setattr(replay, "FORCE_PIECES", force)
    if force == "tiles":  # (the torch backend has no union tiles: it takes the dense route)
        request.getfixturevalue("small_tiles")
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
def _kept_entries(seed, *, dtype, pool, hidden=40, positions=60, vocab=97, tp=2, rank=1, max_k=11,
                  every_row_a_slot=False):
    """Inputs of one shard's kept-set math: sets drawn from `pool` ids (a small pool: ids shared
    by many rows, long runs of one id in the sorted entries), a fifth empty, a fifth of
    the positions unlabelled, the shard [rank * V_local, ...) of a padded vocab; three padding
    slots past the rows with a set, or with `every_row_a_slot` as many slots as rows."""
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
                                 vocab_start, num_valid,
                                 positions if every_row_a_slot else int(((sizes > 0) & labelled).sum()) + 3)
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
    for name, value in (("STATS_BLOCK_E", 4), ("STATS_BLOCK_H", 16), ("DX_BLOCK_E", 4), ("DX_BLOCK_H", 16),
                        ("DW_BLOCK_E", 4), ("DW_BLOCK_H", 16)):
        monkeypatch.setattr(replay_triton, name, value)
    entries, h, w, g = _kept_entries(11, dtype=dtype, pool=pool, max_k=4 if pool < 97 else 11)
    round_to = None if dtype == torch.float32 else dtype
    got, z = replay_triton.kept_stats(h, w, entries, 0.7, round_to, True, True, 0)
    want, z_ref = replay_torch.kept_stats(h, w, entries, 0.7, round_to, True, True, 1 << 20)
    assert torch.equal(torch.isfinite(got.max), torch.isfinite(want.max)) and not torch.isfinite(got.max).all()
    torch.testing.assert_close(z, z_ref, rtol=1e-6, atol=1e-6)
    for field in ("max", "sum_exp", "target", "sum_exp_shifted"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=1e-6)
    # written into the rows' columns instead (replay's forward): the same values at set_dest
    rows = entries.labelled.numel()
    into, into_ref = torch.full((4, rows + 1), 3.0).to(DEVICE), torch.full((4, rows + 1), 3.0).to(DEVICE)
    assert replay_triton.kept_stats(h, w, entries, 0.7, round_to, True, False, 0, into=into)[0] is None
    replay_torch.into_columns(got, entries, into_ref)
    assert torch.equal(into[:, :rows], into_ref[:, :rows])
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


@pytest.mark.parametrize("terms", ["p", "all"])
def test_entry_kernels_match_the_torch_math(triton_kernels, terms, monkeypatch):
    """replay_triton's entry_stats (the dense route's statistics from z) and entry_dlogits (the
    backward's) give replay_torch's: rows spanning several entry blocks, rows without an entry on
    this shard, padding slots, labels in and out of their sets, an expanded (stride 0) coefficient,
    with and without the entropy and target terms and a temperature, fp32 and bf16 results. Only
    exp and the order of fp32 sums differ: fp32 to 1e-5 relative (1e-6 absolute), bf16 to one of
    its units in the last place."""
    from megatron_fused_ce.ops.backends import replay_torch

    replay_triton = triton_kernels["replay_triton"]
    monkeypatch.setattr(replay_triton, "STATS_BLOCK_E", 4)
    monkeypatch.setattr(replay_triton, "DLOGITS_BLOCK", 64)
    entries, h, w, g = _kept_entries(13, dtype=torch.float32, pool=97)
    z = replay_torch.entry_logits(h, w, entries, 0.7, None, 1 << 20)
    rows = entries.labelled.numel()
    for want_entropy in (True, False):
        got, want = (math.entry_stats(z, entries, want_entropy) for math in (replay_triton, replay_torch))
        assert torch.equal(torch.isfinite(got.max), torch.isfinite(want.max)) and not torch.isfinite(got.max).all()
        for field in ("max", "sum_exp", "target") + (("sum_exp_shifted",) if want_entropy else ()):
            torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=1e-6)
        fields = 4 if want_entropy else 3
        into, into_ref = torch.full((fields, rows + 1), 3.0).to(DEVICE), torch.full((fields, rows + 1), 3.0).to(DEVICE)
        assert replay_triton.entry_stats(z, entries, want_entropy, into) is None
        replay_torch.entry_stats(z, entries, want_entropy, into_ref)
        torch.testing.assert_close(into[:, :rows], into_ref[:, :rows], rtol=1e-5, atol=1e-6)
    # each row's offsets as the merge gives them: its set's statistics (placeholders elsewhere)
    stats = torch.zeros(4, rows + 1).to(DEVICE)
    stats[1] = 1.0
    replay_torch.entry_stats(z, entries, True, stats)
    row_max, log_sum_exp = stats[0, :rows], stats[1, :rows].log()
    coef_p = torch.randn(rows, generator=g).to(DEVICE)
    coef_pz = torch.randn(rows, generator=g).to(DEVICE) if terms == "all" else None
    coef_target = torch.full((1,), -0.5).to(DEVICE).expand(rows) if terms == "all" else None
    inv_temperature = 1 / 0.7 if terms == "all" else 1.0
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        got, want = (math.entry_dlogits(z, entries, inv_temperature, row_max, log_sum_exp, coef_p, coef_pz,
                                        coef_target, dtype) for math in (replay_triton, replay_torch))
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-6)
        assert bool((got[~entries.valid] == 0).all()) and bool((got[entries.valid] != 0).any())


@pytest.mark.parametrize("want_entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("logprobs", ["logprobs", "poisoned", "no-logprobs"])
def test_entry_stats_finish_the_rows_as_the_tail_launch_does(triton_kernels, want_entropy, logprobs, monkeypatch):
    """Where every row is a slot and no merge over TP ranks follows (replay at TP = 1 without a
    plain pass), the statistics' launch finishes the rows itself: the fields (a row without a set
    holding the placeholders, 1), log S, lse, the entropy and the labelled log-probs (0 where not
    labelled, -inf where the label is not kept, plus the poison, NaN included) are, bit for bit,
    those of the placeholders filled first, the launch without `finish` and then the tail's launch
    (merged_tail), on each backend; the two backends agree to fp32 rounding. Rows whose slots are
    not all the rows are refused (their rows without a set would keep no placeholders)."""
    from megatron_fused_ce.ops.backends import replay_torch, torch_backend

    replay_triton = triton_kernels["replay_triton"]
    if DEVICE.type == "cuda":
        from megatron_fused_ce.ops.backends import triton_backend
    else:
        triton_backend = triton_kernels["triton_backend"]
    monkeypatch.setattr(replay_triton, "STATS_BLOCK_E", 4)
    entries, h, w, g = _kept_entries(5, dtype=torch.float32, pool=97, every_row_a_slot=True)
    rows = entries.labelled.numel()
    assert not bool(entries.has_set.all()) and not bool(entries.kept.all()) and bool(entries.has_set.any())
    z = replay_torch.entry_logits(h, w, entries, 0.7, None, 1 << 20)
    fields = 4 if want_entropy else 3
    poison = torch.full((1,), float("nan") if logprobs == "poisoned" else 0.0, device=DEVICE)
    logprob_of = None if logprobs == "no-logprobs" else (entries.labelled, entries.kept, poison)
    made = {}
    for math, tail_math in ((replay_triton, triton_backend), (replay_torch, torch_backend)):
        into, tail = torch.full((fields, rows + 1), 3.0, device=DEVICE), torch.full((4, rows + 1), 5.0, device=DEVICE)
        assert math.entry_stats(z.clone(), entries, want_entropy, into, finish=(tail, logprob_of)) is None
        placeholders = torch.ones(fields, rows + 1, device=DEVICE)
        math.entry_stats(z.clone(), entries, want_entropy, placeholders)
        want = tail_math.merged_tail(placeholders[0, :rows], placeholders[1, :rows],
                                     placeholders[3, :rows] if want_entropy else None,
                                     None if logprob_of is None else (placeholders[2, :rows], *logprob_of))
        bits = dict(rtol=0, atol=0, equal_nan=True)  # (a row with no entry on this shard: -inf, NaN entropy)
        torch.testing.assert_close(into[:, :rows], placeholders[:, :rows], **bits)
        for i, value in enumerate(want):
            if value is not None:
                torch.testing.assert_close(tail[i, :rows], value, **bits, msg=f"{math.__name__}: tail row {i}")
        made[math] = (into[:, :rows], tail[:, :rows])
        with pytest.raises(ValueError, match="a slot for every row"):
            short, _, _, _ = _kept_entries(5, dtype=torch.float32, pool=97)
            math.entry_stats(z.clone(), short, want_entropy, into, finish=(tail, logprob_of))
    (into, tail), (into_ref, tail_ref) = made[replay_triton], made[replay_torch]
    torch.testing.assert_close(into, into_ref, rtol=1e-5, atol=1e-6)
    written = [0, 1] + ([2] if want_entropy else []) + ([3] if logprob_of is not None else [])
    torch.testing.assert_close(tail[written], tail_ref[written], rtol=1e-5, atol=1e-5, equal_nan=True)
    if logprob_of is not None:
        logprob = tail[3]
        assert bool((logprob[~entries.labelled] == 0).all()) if logprobs == "logprobs" else bool(logprob.isnan().all())
        if logprobs == "logprobs":
            assert bool((logprob[entries.labelled & ~entries.kept] == float("-inf")).all())


def test_entry_kernels_gather_gate_and_write_blocks(triton_kernels, monkeypatch):
    """The union tiles' forward and backward take their entries' z and dlogits straight from and
    into the tiles' blocks: entry_stats reading z at each entry's place in a block of products
    (and storing it), entry_dlogits with the log-probs' upstream gradient gated by two row masks
    (labelled, label kept; coef_p None: minus the gated target) and written into two blocks at the
    entries' places. Triton against the torch definitions, and the gated form bit for bit the
    explicit one (two wheres and a negation: what the general path's coefficients are)."""
    from megatron_fused_ce.ops.backends import replay_torch

    replay_triton = triton_kernels["replay_triton"]
    monkeypatch.setattr(replay_triton, "STATS_BLOCK_E", 4)
    monkeypatch.setattr(replay_triton, "DLOGITS_BLOCK", 64)
    entries, _, _, g = _kept_entries(21, dtype=torch.float32, pool=97)
    rows, total = entries.labelled.numel(), entries.ids.numel()
    width = 8
    products = torch.randn(total, width, generator=g).to(torch.bfloat16).to(DEVICE)
    place = torch.where(entries.valid, torch.randperm(total * width, generator=g)[:total].to(DEVICE), -1)
    z_ref = torch.zeros(total, device=DEVICE)
    entries.gather_places(z_ref, products, place, 0, 1 / 0.7)
    stats = {}
    for math in (replay_triton, replay_torch):
        z = torch.zeros(total, device=DEVICE)
        stats[math] = math.entry_stats(z, entries, True, gather=(products, place, 1 / 0.7))
        assert torch.equal(z, z_ref)
    for field in ("max", "sum_exp", "target", "sum_exp_shifted"):
        torch.testing.assert_close(getattr(stats[replay_triton], field), getattr(stats[replay_torch], field),
                                   rtol=1e-5, atol=1e-6)
    # the offsets each row's dlogits take: its set's statistics, placeholders where it has none
    row_max = torch.zeros(rows, device=DEVICE).index_copy(0, entries.set_dest.clamp(max=rows - 1),
                                                          stats[replay_torch].max.nan_to_num(neginf=0.0))
    log_sum_exp = torch.ones(rows, device=DEVICE)
    upstream = torch.randn(rows, generator=g).to(DEVICE)
    gate = (entries.labelled, entries.kept)
    assert not bool(entries.kept.all()) and not bool(entries.labelled.all())
    explicit = torch.where(entries.labelled, torch.where(entries.kept, upstream, 0.0), 0.0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        want = replay_torch.entry_dlogits(z_ref, entries, 1 / 0.7, row_max, log_sum_exp, -explicit, None, explicit,
                                          dtype)
        gated = replay_torch.entry_dlogits(z_ref, entries, 1 / 0.7, row_max, log_sum_exp, None, None, upstream,
                                           dtype, gate=gate)
        assert torch.equal(gated, want)
        got = replay_triton.entry_dlogits(z_ref, entries, 1 / 0.7, row_max, log_sum_exp, None, None, upstream,
                                          dtype, gate=gate)
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-6)
        assert bool((got[entries.valid] != 0).any())
        # into two blocks at two sets of places: the entries' dlogits there, the blocks' zeros elsewhere
        other = torch.where(entries.valid, torch.randperm(total * width, generator=g)[:total].to(DEVICE), -1)
        for math in (replay_triton, replay_torch):
            blocks = [torch.zeros(total, width, dtype=dtype, device=DEVICE) for _ in range(2)]
            assert math.entry_dlogits(z_ref, entries, 1 / 0.7, row_max, log_sum_exp, None, None, upstream, dtype,
                                      gate=gate, into=((place, blocks[0]), (other, blocks[1]))) is None
            d = got if math is replay_triton else want
            for block, at in zip(blocks, (place, other)):
                expected = torch.zeros(total * width, dtype=dtype, device=DEVICE)
                expected[at[entries.valid]] = d[entries.valid]
                assert torch.equal(block.reshape(-1), expected)


# ---------------------------------------------------------------- the layout and checks kernels against torch's
_LAYOUT_FIELDS = ("offsets", "has_set", "set_dest", "set_rows", "starts", "ends", "set_labels", "kept", "slot", "col",
                  "position", "valid", "is_label", "set_positions")


def _layouts(replay_triton, ids, offsets, labels, labelled, vocab, vocab_start, num_valid, max_set_rows,
             flags=None, check_missing=False):
    """(torch KeptEntries, kernel KeptEntries, torch counts [5], missing) of one mask."""
    from functools import partial

    check = replay.MaskCheck((ids, offsets), labels, -100, vocab)
    torch_entries = replay.KeptEntries(ids, check.layout_offsets(), labels, labelled, vocab_start, num_valid,
                                       max_set_rows)
    kernel = partial(replay_triton.kept_layout, vocab=vocab, num_cols=num_valid + 2, flags=flags,
                     check_missing=check_missing, fingerprint=True, count_use=True)
    kernel_entries = replay.KeptEntries(ids, offsets, labels, labelled, vocab_start, num_valid, max_set_rows,
                                        kernel=kernel)
    counts = torch.cat([check._device_counts(), check._row_counts()])
    missing = int((labelled & ~torch_entries.has_set).sum())
    assert torch.equal(kernel_entries.fingerprint, check.fingerprint())  # (the TP rank check's)
    return torch_entries, kernel_entries, counts, missing


# (the int64 scan, taken by a mask of 2^31 ids or more, on the carried blocks of seed 1)
@pytest.mark.parametrize("seed, narrow", [(0, True), (1, True), (2, True), (1, False)],
                         ids=["0", "1", "2", "1-int64 scan"])
def test_layout_kernels_match_the_torch_layout(triton_kernels, seed, narrow, monkeypatch):
    """replay_triton.kept_layout gives KeptEntries' torch fields exactly (rows without a set,
    unlabelled rows, padding slots, ids off this shard, labels in and out of their sets, several
    blocks of rows and of entries), MaskCheck's device counts and the mask's fingerprint, with the
    rows' scan in int32 (a mask of fewer than 2^31 ids) or in int64."""
    replay_triton = triton_kernels["replay_triton"]
    monkeypatch.setattr(replay_triton, "NARROW_SCAN", narrow)
    monkeypatch.setattr(replay_triton, "LAYOUT_BLOCK_E", 4)
    monkeypatch.setattr(replay_triton, "SLOT_ROW_BLOCK_V", 16)  # (the dense blocks' rows in several blocks)
    monkeypatch.setattr(replay_triton, "SLOT_ROW_BLOCK_E", 4)
    # (the positions in one block of the scan, or in several: its carries)
    monkeypatch.setattr(replay_triton, "ROWS_SCAN_BLOCK", 64 if seed == 0 else 16)
    g = torch.Generator().manual_seed(seed)
    vocab, positions = 97, 60
    sizes = torch.randint(1, 12, (positions,), generator=g)
    sizes[torch.rand(positions, generator=g) < 0.2] = 0
    ids = torch.cat([torch.randperm(vocab, generator=g)[:int(k)] for k in sizes])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    labels = torch.randint(0, vocab, (positions,), generator=g)
    hit = (torch.rand(positions, generator=g) < 0.6) & (sizes > 0)
    labels[hit] = ids[offsets[:-1][hit]]
    labelled = torch.rand(positions, generator=g) > 0.2
    labels[~labelled] = -100
    max_set_rows = int(((sizes > 0) & labelled).sum()) + 3
    num_valid = 48
    ids, offsets, labels, labelled = (t.to(DEVICE) for t in (ids, offsets, labels, labelled))
    ref, got, counts, missing = _layouts(replay_triton, ids, offsets, labels, labelled, vocab, 49, num_valid,
                                         max_set_rows)
    for name in _LAYOUT_FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.equal(got.row_of_entry(), ref.row_of_entry())
    assert torch.equal(got.dw_key, torch.where(ref.valid, ref.col, num_valid + 2))
    assert torch.equal(got.row_place[1], torch.where(ref.valid, ref.position * (num_valid + 2) + ref.col, -1))
    assert torch.equal(got.counts[:5], counts) and int(got.counts[6]) == missing, (got.counts, counts, missing)
    assert got.poison is None
    # each column's valid entries, counted with the layout (dW's column tiles order by them)
    use = torch.bincount(ref.col[ref.valid], minlength=num_valid + 2)
    assert got.column_use.dtype == torch.int32 and torch.equal(got.column_use.long(), use)
    assert ref.column_use is None
    # the labelled flags made by the rows' launch from the labels (where it checks them, with no
    # label kernel before it): the same layout, and no label outside [0, vocab) found
    flags = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    kernel = functools.partial(replay_triton.kept_layout, vocab=vocab, num_cols=num_valid + 2, flags=flags,
                               check_missing=False, ignore_index=-100)
    made = replay.KeptEntries(ids, offsets, labels, None, 49, num_valid, max_set_rows, kernel=kernel)
    assert made.labelled.dtype == torch.bool and torch.equal(made.labelled, labelled)
    for name in _LAYOUT_FIELDS:
        assert torch.equal(getattr(made, name), getattr(ref, name)), name
    assert int(made.counts[11]) == 0 and int(flags) == 0 and float(made.poison) == 0.0
    # the dense route's chunks: the kernels read and write the places torch does
    cols = num_valid + 2
    logits = torch.randn(max_set_rows, cols, generator=g).to(torch.bfloat16).to(DEVICE)
    d = torch.randn(ids.numel(), generator=g).to(torch.bfloat16).to(DEVICE)
    for start, end in ((0, 7), (7, max_set_rows)):
        z_ref, z_got = torch.full((ids.numel(),), 5.0, device=DEVICE), torch.full((ids.numel(),), 5.0, device=DEVICE)
        ref.gather_chunk(z_ref, logits[start:end], start, 0.7)
        got.gather_chunk(z_got, logits[start:end], start, 0.7)
        assert torch.equal(z_got, z_ref)
        assert torch.equal(got.scatter_chunk(d, start, end, cols), ref.scatter_chunk(d, start, end, cols))
    # and by rows (the dense route without a plain pass): every row's block, zeros where it has no set
    for start, end in ((0, 7), (7, positions)):
        z_ref, z_got = torch.full((ids.numel(),), 5.0, device=DEVICE), torch.full((ids.numel(),), 5.0, device=DEVICE)
        rows_logits = torch.randn(end - start, cols, generator=g).to(torch.bfloat16).to(DEVICE)
        ref.gather_chunk(z_ref, rows_logits, start, 0.7, by_rows=True)
        got.gather_chunk(z_got, rows_logits, start, 0.7, by_rows=True)
        assert torch.equal(z_got, z_ref)
        block = got.scatter_chunk(d, start, end, cols, by_rows=True)
        assert torch.equal(block, ref.scatter_chunk(d, start, end, cols, by_rows=True))
        assert not block[~ref.has_set[start:end]].any()


# the 12 positions in one block of the scan (16), or in several (4); the int64 scan, taken by a mask
# of 2^31 ids or more, on the bad offsets
_BAD_MASKS = ["none", "offsets", "offsets beyond int32", "ids", "duplicate", "missing"]


@pytest.mark.parametrize("bad, scan_block, narrow", [
    *((bad, block, True) for bad in _BAD_MASKS for block in (16, 4)),
    *((bad, block, False) for bad in _BAD_MASKS[1:3] for block in (16, 4))])
def test_layout_kernels_check_the_mask(triton_kernels, bad, scan_block, narrow, monkeypatch):
    """The kernels' verdict (deferred_errors' flags, NaN poison) is MaskCheck.deferred_poison's and
    missing_set_poison's, and the layout of a bad mask stays in range, in one block of rows or
    carried from block to block (an offset that falls back across blocks among them, one beyond
    what int32 holds: clamped before the int32 scan narrows it)."""
    from megatron_fused_ce.ops import deferred_errors

    replay_triton = triton_kernels["replay_triton"]
    monkeypatch.setattr(replay_triton, "ROWS_SCAN_BLOCK", scan_block)
    monkeypatch.setattr(replay_triton, "NARROW_SCAN", narrow)
    g = torch.Generator().manual_seed(5)
    vocab, positions, k = 50, 12, 4
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(positions)]).reshape(-1)
    offsets = torch.arange(positions + 1) * k
    labels = ids[offsets[:-1]].clone()
    labelled = torch.ones(positions, dtype=torch.bool)
    if bad == "offsets":
        offsets[4] = offsets[6] + 2  # (falls back across a block of 4 rows: the carried running max)
    elif bad == "offsets beyond int32":
        offsets[5] = 2 ** 40 + offsets[5]  # (its low 32 bits a valid offset)
    elif bad == "ids":
        ids[9] = vocab + 3
    elif bad == "duplicate":
        ids[13] = ids[12]
    elif bad == "missing":
        offsets[3:] -= k
        ids = ids[k:]
    ids, offsets, labels, labelled = (t.to(DEVICE) for t in (ids, offsets, labels, labelled))
    flags = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    ref, got, counts, missing = _layouts(replay_triton, ids, offsets, labels, labelled, vocab, 0, vocab,
                                         min(positions, ids.numel()), flags=flags, check_missing=True)
    want = ((deferred_errors.SAMPLING_MASK_BAD if bool((counts[:3] > 0).any()) else 0)
            | (deferred_errors.SAMPLING_MASK_NEW_EMPTY_SET if missing else 0))
    # (the torch definitions find what was broken; a bad offset also empties a row's layout range)
    bad_offsets = bad.startswith("offsets")
    assert bool(want & deferred_errors.SAMPLING_MASK_BAD) == (bad_offsets or bad in ("ids", "duplicate")), want
    assert bool(want & deferred_errors.SAMPLING_MASK_NEW_EMPTY_SET) == (bad_offsets or bad == "missing"), want
    assert int(flags) == want
    assert bool(torch.isnan(got.poison).all()) == bool(want) and (want or float(got.poison) == 0.0)
    assert torch.equal(got.counts[3:5], counts[3:5]) and int(got.counts[6]) == missing
    assert bool((got.counts[:3] > 0).any()) == bool((counts[:3] > 0).any())
    if not bad_offsets:  # (valid offsets: the counts are MaskCheck's)
        assert torch.equal(got.counts[:3], counts[:3])
    # the labels' poison added in (the call's one poison): NaN stays NaN, 0 gives the verdict's
    for base in (0.0, float("nan")):
        fields = replay_triton.kept_layout(ids, offsets, labels, labelled, 0, vocab, min(positions, ids.numel()),
                                           vocab=vocab, num_cols=vocab, flags=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                           check_missing=True, base_poison=torch.full((1,), base, device=DEVICE))
        assert bool(torch.isnan(fields["poison"]).all()) == (bool(want) or base != base)
        assert bool(want) or base != base or float(fields["poison"]) == 0.0
    for name in _LAYOUT_FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


@pytest.mark.parametrize("seed,sort_block", [(0, 16), (1, 16), (2, 64), (3, 1)])
def test_layout_kernels_count_every_duplicate(triton_kernels, seed, sort_block, monkeypatch):
    """The entries kernel's per-row sorts (sets of at most LAYOUT_SORT_BLOCK ids) and hash tables
    (larger ones) count what MaskCheck's sort of the call's keys counts: every extra
    copy of an id in a set (pairs and triples, copies blocks of entries apart, in sets of one to
    forty ids, ids out of range counted as their clamped neighbour), and nothing in sets that
    share ids with other rows' sets."""
    replay_triton = triton_kernels["replay_triton"]
    monkeypatch.setattr(replay_triton, "LAYOUT_BLOCK_E", 4)
    monkeypatch.setattr(replay_triton, "LAYOUT_SORT_BLOCK", sort_block)  # (sets above it: the hash tables)
    g = torch.Generator().manual_seed(seed)
    vocab, positions = 61, 30
    sets = [torch.randperm(vocab, generator=g)[:int(torch.randint(1, 41, (1,), generator=g))] for _ in range(positions)]
    for row in range(0, positions, 3):  # copies of ids already in the set, anywhere in it
        copies = sets[row][torch.randint(0, sets[row].numel(), (row % 4,), generator=g)]
        sets[row] = torch.cat([sets[row], copies])[torch.randperm(sets[row].numel() + copies.numel(), generator=g)]
    sets[4] = torch.cat([sets[4], torch.tensor([vocab + 5, vocab + 9, -3, -1])])  # (clamped: two pairs)
    ids = torch.cat(sets)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor([s.numel() for s in sets]).cumsum(0)])
    labels = ids[offsets[:-1]].clone()
    labelled = torch.ones(positions, dtype=torch.bool)
    ids, offsets, labels, labelled = (t.to(DEVICE) for t in (ids, offsets, labels, labelled))
    _, got, counts, _ = _layouts(replay_triton, ids, offsets, labels, labelled, vocab, 0, vocab, positions)
    assert int(counts[2]) > 10
    assert torch.equal(got.counts[:3], counts[:3]), (got.counts[:3], counts[:3])


# ---------------------------------------------------------------- what a call dispatches on the Triton backend
def _interpreter_launches(monkeypatch, on_launch=lambda: None) -> list:
    """[flag]: True while an interpreted Triton launch runs (the torch ops inside it are the
    interpreter's copies of the kernel's arguments, not the GPU path's); `on_launch()` at each."""
    import sys

    launching = [False]
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if DEVICE.type != "cuda" and interpreter is not None:
        launch = interpreter.GridExecutor.__call__

        def flagged(executor, *args, **kwargs):
            on_launch()
            launching[0] = True
            try:
                return launch(executor, *args, **kwargs)
            finally:
                launching[0] = False

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", flagged)
    return launching


class _Dispatched:
    """Ops dispatched per replay phase (views left out), a Triton launch counting as one op (the
    interpreter's own torch ops inside a launch are not the GPU path's)."""

    def __init__(self, monkeypatch):
        import collections

        from torch.utils._python_dispatch import TorchDispatchMode

        self.ops = collections.defaultdict(list)
        phase, outer = ["other"], self
        label_phases(monkeypatch, phase)
        launching = _interpreter_launches(monkeypatch, lambda: outer.ops[phase[0]].append("triton"))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name not in VIEWS and not launching[0]:
                    outer.ops[phase[0]].append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def replay_ops(self) -> int:
        return sum(len(self.ops[phase]) for phase in ("entries", "forward", "backward"))


def _dispatched_call(monkeypatch, force, chunk, n=32, k=3):
    monkeypatch.setattr(replay, "FORCE_PIECES", force)
    g = torch.Generator().manual_seed(3)
    hidden, vocab = 64, 64
    h = torch.randn(n, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    y = ids[:, 0].contiguous().to(DEVICE)
    mask = (ids.reshape(-1).to(DEVICE), (torch.arange(n + 1) * k).to(DEVICE))

    def call():
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        linear_logprobs(hh, ww, y, chunk_size=chunk, impl="triton", sampling_mask=mask).logprobs.sum().backward()

    for _ in range(2):  # the signature's first call, then a remembered one
        call()
    counter = _Dispatched(monkeypatch)
    with counter.mode:
        call()
    monkeypatch.undo()
    return counter


def test_replay_dispatches_a_fixed_handful_of_ops(triton_kernels, monkeypatch):
    """What one replay call (a remembered signature, every row with a set: RL) dispatches in its
    layout, forward and backward on the Triton backend, each launch one op: the sparse route 20
    (the layout and checks 7: three allocations, the fill of the duplicate check's hash tables and
    three launches; the backward 7: the
    dlogits kernel and its output, the dX and dW kernels and the sort, and the zeros of dX and dW
    that stand in for the plain pass), at most 24; the dense route 11-12 more per chunk of rows (its
    row gathers, GEMMs, entry gathers and dlogits block), at most 12, and 14 besides, at most 21; the
    union tiles 20 (the forward's product and the statistics reading z off it; the backward's
    dlogits written into both products' blocks, one zeroed allocation, and the two products) and 11
    before the forward, with the tiling: both tilings' layouts in one set of launches, as a call
    that will need dW makes them (the zeroed flags, two allocations and their split, three
    launches), and dW's columns ordered by use (two allocations and two launches, the counts made
    by the layout kernel); 37 with each layout made apart with a cumsum of its own (the columns'
    in the backward), 42 with the counts, the sort and the ranks apart, the z gather and the
    dlogits scattered into each block.
    Protects the per-call host cost of replay: every op costs a launch and its Python while the
    GPU idles (about 100 ops in these phases with the layout and checks in torch; 32, and 54
    fixed, with the entries' dlogits and the dense statistics in torch)."""
    sparse = _dispatched_call(monkeypatch, "sparse", 32)
    assert sparse.replay_ops() <= 24, dict(sparse.ops)
    assert len(sparse.ops["entries"]) <= 7, sparse.ops["entries"]
    assert len(sparse.ops["backward"]) <= 8, sparse.ops["backward"]
    # the rest of the call (42 here, the label checks in torch off CUDA; the labelled log-probs one
    # launch and its output): the log-probs' kept flag and the poison take no ops of their own
    # beyond one where and one add
    assert len(sparse.ops["other"]) <= 45, sparse.ops["other"]
    dense = {chunks: _dispatched_call(monkeypatch, "dense", 32 // chunks).replay_ops() for chunks in (1, 4)}
    per_chunk = (dense[4] - dense[1]) / 3
    assert per_chunk <= 12 and dense[1] - per_chunk <= 21, (dense, sparse.replay_ops())
    monkeypatch.setattr(replay, "TILE_ROWS", 16)
    monkeypatch.setattr(replay, "COLUMN_TILE", 16)
    tiles = _dispatched_call(monkeypatch, "tiles", 64)  # (both blocks of dlogits within a chunk of logits)
    assert tiles.replay_ops() <= 20 and len(tiles.ops["entries"]) <= 7, dict(tiles.ops)
    assert len(tiles.ops["backward"]) <= 5, tiles.ops["backward"]
    assert len(tiles.ops["other"]) <= len(sparse.ops["other"]) + 11, tiles.ops["other"]  # (the tilings)


def _same_layout(got, want, by_columns):
    used = int(want.tile_start[-1])
    assert torch.equal(got.tile_start, want.tile_start)
    assert torch.equal(got.uids[:used], want.uids[:used]) and torch.equal(got.place, want.place)
    assert (got.capacity, got.max_union) == (want.capacity, want.max_union)
    assert 0 < used <= want.capacity
    assert (got.out_rows is None) == (want.out_rows is None) == (not by_columns)
    if by_columns:
        assert torch.equal(got.out_rows, want.out_rows)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("by_columns", [False, True, "both"], ids=["slot-tiles", "column-tiles", "both"])
def test_union_layout_kernels_match_the_torch_layout(triton_kernels, seed, by_columns, monkeypatch):
    """replay_union_triton.union_layouts (and columns_by_use) give replay.UnionTiles' torch layout
    field by field, one tiling at a time or both in one set of launches (the second table numbered
    from the first's total): ids shared by many rows or spread, off this shard, in the padding,
    rows without a set (slot -1), padding slots, tiles of 2 (many, some with empty unions) and of
    16 (a partial last one); the pack launch's prefix sum over blocks of 2 words (many blocks, each
    adding the ones before it)."""
    from types import SimpleNamespace

    entries, _, w, _ = _kept_entries(seed, dtype=torch.float32, pool=6 if seed == 0 else 97)
    module = triton_kernels.get("replay_union_triton", replay_union_triton)
    monkeypatch.setattr(module, "PACK_BLOCK_WORDS", 2)
    kernels = SimpleNamespace(union_layouts=module.union_layouts, columns_by_use=module.columns_by_use)
    for width in (2, 16):
        if by_columns == "both":
            want = (replay.UnionTiles.of_slots(entries, w.shape[0], width),
                    replay.UnionTiles.of_columns(entries, w.shape[0], 16 // width))
            got = replay.UnionTiles.of_slots_and_columns(entries, w.shape[0], width, 16 // width, kernels)
            _same_layout(got[0], want[0], False)
            _same_layout(got[1], want[1], True)
            continue
        make = replay.UnionTiles.of_columns if by_columns else replay.UnionTiles.of_slots
        _same_layout(make(entries, w.shape[0], width, kernels), make(entries, w.shape[0], width), by_columns)


def test_union_pack_looks_back_over_blocks_that_have_not_finished(triton_kernels):
    """The pack launch's prefix sum where the blocks before one have published only their own
    counts, or their inclusive sums, in any mix (on a GPU they run at once; under the interpreter
    one after another, so this sets their published sums by hand and runs one block): its words'
    running counts add every block before it, read back window by window to the nearest
    inclusive sum, whichever window holds it."""
    module = triton_kernels.get("replay_union_triton", replay_union_triton)
    words_a_block, window, block = 2, 4, 11
    bits = module.SUM_BITS
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 64, (block,), generator=g)
    for inclusive_at in (None, 0, 3, 6, 9, 10):  # (None: only block 0's, which is always inclusive)
        status = torch.zeros(block + 1, dtype=torch.int64)
        for j in range(block):
            if j == 0 or j == inclusive_at:
                status[j] = (2 << bits) | int(counts[:j + 1].sum())
            else:
                status[j] = (1 << bits) | int(counts[j])
        named = torch.zeros((block + 1) * words_a_block * 32, dtype=torch.int8)
        mine = named.view(block + 1, words_a_block * 32)[block]
        mine[torch.tensor([0, 5, 31, 40, 63])] = 1  # (its two words: 3 and 2 pairs named)
        ticket = torch.tensor([block, 0], dtype=torch.int32)
        table = torch.zeros(2 * (block + 1) * words_a_block, dtype=torch.int32)
        num_words = (block + 1) * words_a_block
        kernel = module._union_pack_kernel
        kernel[(1,)](named.to(DEVICE), table[:num_words].to(DEVICE), upto := table[num_words:].to(DEVICE),
                     status := status.to(DEVICE), ticket.to(DEVICE), num_words, BLOCK_W=words_a_block, WINDOW=window,
                     SUM_BITS=bits)
        before = int(counts.sum())
        got = upto.cpu()[block * words_a_block:]
        assert got.tolist() == [before + 3, before + 5], inclusive_at
        assert int(status.cpu()[block]) == (2 << bits) | (before + 5)


def test_column_tiles_put_the_columns_most_sets_name_together():
    """dW's tiles by columns order the columns by use: with two columns named by every set and the
    other ids each by one, the two share the first tile, so that only it holds every row; in
    column order each would have pulled every row into its own tile. Protects dW's cost where sets
    overlap (a trained model's frequent ids): nearly the dense product's work otherwise."""
    rows, vocab, width = 32, 64, 8
    common = torch.tensor([5, 50])  # in different tiles of columns in column order
    rest = torch.arange(vocab)[(torch.arange(vocab) != 5) & (torch.arange(vocab) != 50)]
    sets = [torch.cat([common, rest[i:i + 1]]) for i in range(rows)]
    ids = torch.cat(sets)
    offsets = torch.arange(rows + 1) * 3
    labels = ids[::3].clone()
    labelled = torch.ones(rows, dtype=torch.bool)
    entries = replay.KeptEntries(ids, offsets, labels, labelled, 0, vocab, rows)
    tiles = replay.UnionTiles.of_columns(entries, vocab, width)
    assert set(tiles.out_rows[:2].tolist()) == {5, 50}
    union_sizes = (tiles.tile_start[1:] - tiles.tile_start[:-1]).tolist()
    assert union_sizes[0] == rows  # the shared tile: every row
    # besides, a (tile, row) pair for each row whose own id is not among the first tile's other
    # width - 2 columns (in column order: 89 pairs, every row in two tiles)
    assert sum(union_sizes) == rows + rows - (width - 2), union_sizes
    # the order is by class of use, ties by column (here the classes of 32, 1 and 0 uses)
    named = torch.bincount(ids, minlength=vocab)
    assert torch.equal(tiles.out_rows, torch.sort(named, descending=True, stable=True).indices)
    assert replay.use_class(named.int()).unique().tolist() == [0, 1, 11]


def test_use_classes_are_two_an_octave():
    """replay.use_class, which dW's column tiles order by: 0 unused, 1 for one use, then two
    classes an octave ([2, 3), [3, 4), [4, 6), [6, 8), ...), so that the columns of a class are used
    within a factor of 1.5 of each other; the last class holds every count from 2^15 on."""
    counts = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 2**15 - 1, 2**15, 2**20], dtype=torch.int32)
    assert replay.use_class(counts).tolist() == [0, 1, 3, 4, 5, 5, 6, 6, 7, 7, 8, 30, 31, 31]
    assert replay_union_triton.USE_CLASSES == replay.USE_CLASSES  # (the kernels' classes are these)


@pytest.mark.parametrize("order_block", [16, 256])
def test_columns_by_use_kernels_match_the_torch_order(triton_kernels, order_block, monkeypatch):
    """replay_union_triton.columns_by_use (two launches over blocks of columns: their histograms of
    classes, then each block's places from a sort of its own keys) gives replay.columns_by_use's
    order and ranks exactly: every class from unused to the last (2^15 entries and more), columns
    of one class spread over many blocks, a partial last block, entries that are not valid, and
    the counts given (the layout kernel's) or counted here."""
    module = triton_kernels.get("replay_union_triton", replay_union_triton)
    monkeypatch.setattr(module, "ORDER_BLOCK", order_block)
    monkeypatch.setattr(module, "INTERPRETED_ORDER_BLOCK", order_block)  # (the interpreter's cap: off here)
    g = torch.Generator().manual_seed(order_block)
    num_cols = 203
    uses = torch.randint(0, 40, (num_cols,), generator=g)
    uses[torch.randperm(num_cols, generator=g)[:30]] = 0
    uses[5], uses[150] = 2**16, 2**15  # (about 90 % of them valid: the last class, and the one below)
    col = torch.repeat_interleave(torch.arange(num_cols), uses)
    col = col[torch.randperm(col.numel(), generator=g)]
    valid = torch.rand(col.numel(), generator=g) > 0.1
    col, valid = col.to(DEVICE), valid.to(DEVICE)
    order, rank = replay.columns_by_use(col, valid, num_cols)
    counts = torch.bincount(col[valid], minlength=num_cols).int()
    assert len(set(replay.use_class(counts).tolist())) >= 12 and int(replay.use_class(counts)[5]) == 31
    for given in (None, counts):
        got_order, got_rank = module.columns_by_use(col, valid, num_cols, counts=given)
        assert torch.equal(got_order, order) and torch.equal(got_rank, rank)
    assert torch.equal(rank[order], torch.arange(num_cols, device=DEVICE))
    assert int(order[0]) == 5 and int(order[1]) == 150


# ---------------------------------------------------------------- union tiles, end to end against float64
@pytest.fixture
def small_tiles(triton_kernels, monkeypatch):
    """Tiles of 16 rows (and columns) and 16-wide blocks, so that a case of a few dozen positions
    spans several tiles, the last one partial, and a program strides over more than one union block
    (every tl.dot dimension stays >= 16)."""
    monkeypatch.setattr(replay, "TILE_ROWS", 16)
    monkeypatch.setattr(replay, "COLUMN_TILE", 16)
    module = triton_kernels.get("replay_union_triton", replay_union_triton)
    for name, value in dict(LOGITS_BLOCK_U=16, LOGITS_BLOCK_K=16, SUM_BLOCK_U=16, SUM_BLOCK_H=16,
                            MAX_PROGRAMS_PER_TILE=2).items():
        monkeypatch.setattr(module, name, value)


def _tiles_worker(rank, world, cases):
    from sampling_mask_cases import run_case

    before = replay.PIECE_COUNTS["tiles_rows"]
    # which cases' tiles were the rows themselves (no plain pass, a slot per row: dX written whole)
    build, by_rows = replay.UnionTiles._build, []

    def spy(entries, rows, *args, **kwargs):
        by_rows[-1] |= bool(rows)
        return build(entries, rows, *args, **kwargs)

    replay.UnionTiles._build = staticmethod(spy)
    try:
        results = []
        for case in cases:
            by_rows.append(False)
            results.append(run_case(rank, world, case, "tiles", impl="triton"))
    finally:
        replay.UnionTiles._build = staticmethod(build)
    # Megatron's main_grad: the tiles' dW added into it
    hidden, weight = local_inputs(rank, cases[0])
    weight.main_grad, weight.grad_added_to_main_grad = torch.full(weight.shape, 0.5), False
    replay.FORCE_PIECES = "tiles"
    try:
        out = linear_logprobs(hidden, weight, cases[0]["labels"], tp_group=world_group(world),
                              vocab_size=cases[0]["vocab"], temperature=cases[0]["T"],
                              chunk_size=cases[0]["chunk_size"], sequence_parallel=cases[0]["sp"],
                              sampling_mask=cases[0]["mask"], accumulate_into_main_grad=True, impl="triton")
        finite = torch.isfinite(out.logprobs)
        (torch.where(finite, out.logprobs, 0.0) * cases[0]["grad_lp"]).sum().backward()
    finally:
        replay.FORCE_PIECES = None
    plain = run_case(rank, world, dict(cases[0], grad_ent=torch.zeros_like(cases[0]["grad_ent"])), "tiles",
                     impl="triton")
    return results, replay.PIECE_COUNTS["tiles_rows"] - before, (weight.main_grad - 0.5, plain["dw"]), by_rows


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_union_tiles_match_dense_reference(small_tiles, tp):
    """The union tiles (each tile of rows times the W rows its sets name, gathered in the kernels)
    against float64: log-probs, entropy, dX and dW at TP 1, 2 and 4 with ignored labels, a padded
    vocab, temperature, fp32 and bf16, rows without a set (the plain pass) and every row with one
    (without it: the tiles are the rows themselves, dX written whole, an ignored row's zeros),
    chunk sizes that do not divide the rows, sequence parallelism, and dW added into Megatron's
    main_grad."""
    if DEVICE.type == "cuda":
        pytest.skip("the gloo harness runs on CPU tensors (tests/test_replay_union_triton.py runs the kernels on GPUs)")
    from sampling_mask_cases import case_seed, check, make_case

    cases = [make_case(case_seed("tiles", tp), tp, sp=tp == 2),
             make_case(case_seed("tiles-bf16", tp), tp, dtype=torch.bfloat16, ints=True, chunk_size=64)]
    every_row = make_case(case_seed("tiles-every-row", tp), tp, chunk_size=64, sp=tp == 2)
    g = torch.Generator().manual_seed(case_seed("tiles-every-row-sets", tp))
    every_row["mask"] = random_sets(g, every_row["labels"].numel(), every_row["vocab"],
                                    every_row["labels"].reshape(-1), empty=0.0)
    cases.append(every_row)
    every_row_bf16 = make_case(case_seed("tiles-every-row-bf16", tp, 1), tp, dtype=torch.bfloat16, ints=True,
                               chunk_size=9)
    every_row_bf16["mask"] = random_sets(g, every_row_bf16["labels"].numel(), every_row_bf16["vocab"],
                                         every_row_bf16["labels"].reshape(-1), empty=0.0)
    cases.append(every_row_bf16)  # (dW written in the weight's dtype by the one product)
    results = run_workers(_tiles_worker, tp, cases, timeout=240)
    for c, case in enumerate(cases):
        check(case, [per_rank[0][c] for per_rank in results], f"{case['dtype']} tiles")
    for rank, (_, tiles_rows, (main_grad, dw), by_rows) in enumerate(results):
        assert tiles_rows > 0, rank  # the tiles scored the rows
        assert reference.rel_err(main_grad, dw) < 1e-6, rank
        assert by_rows == [False, False, True, True], (rank, by_rows)  # (the plain pass: slots gathered)


def test_union_tiles_hold_at_most_a_chunk_of_logits(small_tiles, monkeypatch):
    """The tiles taken by sizes (replay_route: their [unions, TILE_ROWS] products within a chunk of
    logits' elements): the largest tensor of a call, forward and backward, is at most a chunk of
    [rows, V_local] logits, never the set rows' [N, V_local]."""
    if DEVICE.type == "cuda":
        pytest.skip("the interpreter's run of the kernels on CPU tensors (GPU runs: tests/test_cuda_steady_state.py)")
    n, hidden, v_local, chunk = 256, 32, 512, 128
    g = torch.Generator().manual_seed(1)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = torch.randn(v_local, hidden, generator=g).requires_grad_()
    ids = torch.stack([torch.randperm(v_local, generator=g)[:8] for _ in range(n)])
    y = ids[:, 0].clone()  # (each label in its set)
    y[::5] = -100
    mask = (ids.reshape(-1), torch.arange(n + 1) * 8)
    launching = _interpreter_launches(monkeypatch)  # (the tensors the op allocates, not the interpreter's)

    class OutsideKernels(reference.LargestTensor):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if launching[0]:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    before = replay.PIECE_COUNTS["tiles_rows"]
    with OutsideKernels() as mode:
        out = linear_logprobs(h, w, y, chunk_size=chunk, return_entropy=True, sampling_mask=mask, impl="triton")
        (out.logprobs.sum() + out.entropy.sum()).backward()
    assert replay.PIECE_COUNTS["tiles_rows"] > before  # (K = 8: 8 x 16 <= 512 / 2)
    reference.record_memory(f"linear_logprobs sampling_mask, union tiles (chunk {chunk} of {n} rows): largest "
                            f"tensor / dense [N, V] logits", mode.largest / (n * v_local))
    assert mode.largest <= chunk * v_local, (mode.largest, chunk * v_local)
