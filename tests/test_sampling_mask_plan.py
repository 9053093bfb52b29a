"""Sampling-mask replay's plan and launches (ops/replay.py): what a call dispatches per tile and
per phase, the all-dense route, the dW of calls made of sparse pieces only, and the cost model's
tile choice. Values against the float64 dense reference as in tests/test_sampling_mask.py."""

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist import run_workers
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.ops import replay
from megatron_fused_ce.ops.replay import make_plan
from sampling_mask_cases import case_seed, check, make_case, random_sets, run_case

VIEWS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "expand", "alias",
         "as_strided", "detach", "lift_fresh", "permute", "split", "unbind", "reshape"}
PHASES = ("make_plan", "_forward", "_backward")
GEMMS = {"mm", "addmm", "matmul", "bmm"}


class _Ops(TorchDispatchMode):
    """The ops dispatched (views left out) per replay phase, with their outputs' sizes and dtypes."""

    def __init__(self, phase):
        super().__init__()
        self.phase = phase
        self.ops = collections.defaultdict(list)  # phase -> [(name, [(numel, dtype) of outputs])]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            outs = [(t.numel(), t.dtype) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.ops[self.phase[0]].append((name, outs))
        return out


def _traced(monkeypatch, fn):
    """Run fn() with replay's phases labelled: {phase: [(op, outputs)]} ("other": outside them)."""
    phase = ["other"]
    for name in PHASES:
        original = getattr(replay, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            before, phase[0] = phase[0], _name
            try:
                return _original(*args, **kwargs)
            finally:
                phase[0] = before

        monkeypatch.setattr(replay, name, wrapped)
    mode = _Ops(phase)
    with mode:
        fn()
    for name in PHASES:
        monkeypatch.undo()
    return mode.ops


def _fwd_bwd(h, w, y, mask, chunk, **kwargs):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_logprobs(hh, ww, y, chunk_size=chunk, sampling_mask=mask, **kwargs)
    torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0).sum().backward()
    return out.logprobs.detach(), hh.grad, ww.grad


def _inputs(n=256, hidden=32, vocab=600, k=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype)
    sets = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    y = sets[torch.arange(n), torch.randint(0, k, (n,), generator=g)]
    return h, w, y, (sets.reshape(-1), torch.arange(n + 1) * k)


# ---------------------------------------------------------------- launches per tile
def test_a_sparse_tile_launches_OPS_PER_TILE_ops_and_the_plan_no_more_with_more_tiles(monkeypatch):
    """The cost model charges each sparse tile OPS_PER_TILE launches: the entry math runs once
    per call (per block of rows), not per tile, and the plan's ops do not grow with the tiles."""
    monkeypatch.setattr(replay, "FORCE_PIECES", "sparse")
    h, w, y, mask = _inputs()
    counts = {}
    for chunk in (64, 16):  # every tile sparse, at the chunk size: 4 and 16 tiles
        ops = _traced(monkeypatch, lambda: _fwd_bwd(h, w, y, mask, chunk))
        monkeypatch.setattr(replay, "FORCE_PIECES", "sparse")
        counts[256 // chunk] = {phase: len(ops[phase]) for phase in PHASES}
    few, many = counts[4], counts[16]
    assert many["make_plan"] == few["make_plan"], counts
    per_tile = (many["_forward"] + many["_backward"] - few["_forward"] - few["_backward"]) / (16 - 4)
    assert per_tile == replay.OPS_PER_TILE, counts


def test_the_plan_counts_without_atomic_adds(monkeypatch):
    """Counts by prefix sums: an index_add_ of every entry into a few counters serializes on the
    GPU's atomics (sets of hundreds of ids: milliseconds per count)."""
    h, w, y, mask = _inputs(k=40)
    ops = _traced(monkeypatch, lambda: _fwd_bwd(h, w, y, mask, 64))
    names = {name for name, _ in ops["make_plan"]}
    assert not names & {"index_add", "index_add_", "bincount", "scatter_add", "scatter_add_", "index_put"}, names


# ---------------------------------------------------------------- all dense: 3 GEMMs per chunk
@pytest.mark.parametrize("n,chunk", [(256, 256), (256, 96)], ids=["one_chunk", "three_chunks"])
def test_all_dense_is_three_gemms_per_chunk_and_no_dw_zero_fill(n, chunk, monkeypatch):
    """Large random sets: every tile dense, pieces are whole chunks, each one logits GEMM forward
    and the dX / dW pair backward (the plain path recomputes: 4); dW is written by its GEMMs (one
    chunk: in the weight's dtype), never zero filled first; values match the plain path's GEMMs."""
    h, w, y, mask = _inputs(n=n, vocab=300, k=200, dtype=torch.bfloat16)
    plan = make_plan(mask[0], mask[1], None, y, 0, 300, 300, 32, 2, chunk)
    assert all(p.cols is None for p in plan.pieces) and plan.union_cols is None
    assert plan.tile_rows == chunk and [p.end - p.start for p in plan.pieces] == [
        min(chunk, n - s) for s in range(0, n, chunk)]
    ops = _traced(monkeypatch, lambda: _fwd_bwd(h, w, y, mask, chunk))
    chunks = math.ceil(n / chunk)
    gemms = {phase: sum(name in GEMMS for name, _ in ops[phase]) for phase in ("_forward", "_backward")}
    assert gemms == {"_forward": chunks, "_backward": 2 * chunks}, gemms
    weight_sized = [(name, outs) for name, outs in ops["_backward"] if any(m == w.numel() for m, _ in outs)]
    assert not any(name in ("zeros", "zero_", "fill_", "new_zeros", "zeros_like") for name, _ in weight_sized)
    if chunks == 1:
        assert all(dtype == w.dtype for _, outs in weight_sized for m, dtype in outs if m == w.numel())
    # fp32: the same values as every tile forced dense at another chunk size
    h, w = h.float(), w.float()
    got = _fwd_bwd(h, w, y, mask, chunk)
    monkeypatch.setattr(replay, "FORCE_PIECES", "dense")
    want = _fwd_bwd(h, w, y, mask, 100)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- sparse pieces only: dW over the kept ids
def _no_empty_sets(case, seed, labelled_everywhere=False, sizes=(1, 3, 8, 30, 90)):
    g = torch.Generator().manual_seed(seed)
    labels = case["labels"]
    if labelled_everywhere:
        labels = torch.randint(0, case["vocab"], labels.shape, generator=g)
    mask = random_sets(g, labels.numel(), case["vocab"], labels.reshape(-1), empty=0.0, sizes=sizes)
    return dict(case, labels=labels, mask=mask)


def _sparse_worker(rank, world, cases):
    out = []
    for case in cases:
        out.append(run_case(rank, world, case, "sparse"))
        # the plan: sparse pieces only, dW summed over this shard's kept ids
        v_local = case["v_local"]
        labels = case["labels"].reshape(-1)
        positions = (labels != -100).nonzero().squeeze(1)
        replay.FORCE_PIECES = "sparse"
        try:
            plan = make_plan(case["mask"].token_ids, case["mask"].offsets, positions, labels[positions],
                             rank * v_local, min(max(case["vocab"] - rank * v_local, 0), v_local), v_local,
                             case["hidden"].shape[-1], 4, case["chunk_size"])
        finally:
            replay.FORCE_PIECES = None
        ids = case["mask"].token_ids
        local = ids[(ids >= rank * v_local) & (ids < rank * v_local + v_local)] - rank * v_local
        out.append((plan.union_cols, local))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_sparse_pieces_only_sum_dw_over_the_kept_ids(tp):
    """No plain row, no dense piece: dW is summed in fp32 over the kept ids here alone, then
    written into a zero dW (padding rows included); the same values as the float64 reference."""
    cases = [_no_empty_sets(make_case(case_seed("compact", tp), tp), 1),
             _no_empty_sets(make_case(case_seed("compact-bf16", tp), tp, dtype=torch.bfloat16, ints=True), 2),
             _no_empty_sets(make_case(case_seed("compact-all", tp), tp), 3, labelled_everywhere=True, sizes=(1, 2, 4))]
    results = run_workers(_sparse_worker, tp, cases)
    for index, case in enumerate(cases):
        check(case, [r[2 * index] for r in results], f"{case['dtype']} sparse only")
        for union_cols, local in (r[2 * index + 1] for r in results):
            # sorted, distinct, among this shard's kept ids (those of ignored positions left out)
            assert union_cols is not None and bool((union_cols[1:] > union_cols[:-1]).all())
            assert set(union_cols.tolist()) <= set(local.tolist())
    last = results[0][-1][0]
    assert last.numel() < cases[-1]["v_local"] - 10  # some rows of dW are no kept id's: left 0


def test_sparse_pieces_only_into_main_grad(monkeypatch):
    """Megatron's main_grad takes the sparse pieces' rows directly (no dW of the op's own)."""
    monkeypatch.setattr(replay, "FORCE_PIECES", "sparse")
    h, w, y, mask = _inputs(n=64, k=5)
    _, _, dw = _fwd_bwd(h, w, y, mask, 16)
    weight = w.clone().requires_grad_()
    weight.main_grad, weight.grad_added_to_main_grad = torch.full(w.shape, 0.5), False
    lp = linear_logprobs(h.clone().requires_grad_(), weight, y, chunk_size=16, sampling_mask=mask,
                         accumulate_into_main_grad=True).logprobs
    torch.where(torch.isfinite(lp), lp, 0.0).sum().backward()
    assert weight.grad_added_to_main_grad
    torch.testing.assert_close(weight.main_grad - 0.5, dw, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- blocks of one width
def test_entry_slots_stay_under_twice_the_entries():
    """Rows in blocks of entry counts [2^k, 2^(k+1)): few blocks, padded slots < 2 (entries + rows)."""
    g = torch.Generator().manual_seed(4)
    sizes = torch.cat([torch.full((300,), 1), torch.randint(1, 700, (300,), generator=g), torch.full((10,), 900)])
    sizes = sizes[torch.randperm(sizes.numel(), generator=g)]
    n, vocab = sizes.numel(), 1000
    ids = torch.cat([torch.randperm(vocab, generator=g)[:k] for k in sizes.tolist()])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    y = ids[offsets[:-1]]
    plan = make_plan(ids, offsets, None, y, 0, vocab, vocab, 64, 2, 128)
    assert len(plan.blocks) <= math.ceil(math.log2(900)) + 1
    assert plan.src.numel() < 2 * (ids.numel() + n)
    assert int(plan.valid.sum()) == ids.numel()
    for start, end, width, base in plan.blocks:  # every row fits its block, none is padded twice over
        counts = sizes[plan.set_rows[start:end]]
        assert int(counts.max()) == width and bool((2 * counts.clamp(min=1) > width).all())


# ---------------------------------------------------------------- the cost model's tiles
def test_host_cost_makes_tiles_larger(monkeypatch):
    """Disjoint sets (a tile's union is its rows' ids): fewer tiles save fixed costs, larger ones
    cost more GEMM work per row. Where a tile's kernels take less time than launching them, the
    launches decide: the model then takes larger tiles than GPU time alone would. (On the
    roofline sum alone, SPARSE_MEASURED_FACTOR 1: with the measured factor, these tiles' GPU time
    already outweighs their launches.)"""
    monkeypatch.setattr(replay, "SPARSE_MEASURED_FACTOR", 1.0)
    n, vocab, hidden, k = 8192, 65536, 4096, 8
    sets = (torch.arange(n).unsqueeze(1) * k + torch.arange(k)) % vocab
    offsets = torch.arange(n + 1) * k
    plans = {}
    for host in (replay.HOST_OP_S, 0.0):
        monkeypatch.setattr(replay, "HOST_OP_S", host)
        plans[host] = make_plan(sets.reshape(-1), offsets, None, sets[:, 0], 0, vocab, vocab, hidden, 2, 4096)
    with_host, without = plans.values()
    assert all(p.cols is not None for p in with_host.pieces + without.pieces)
    assert with_host.tile_rows > without.tile_rows, (with_host.tile_rows, without.tile_rows)
    tile = with_host.pieces[0]
    assert tile.num_cols == k * (tile.end - tile.start)


def _sliding_sets(n: int, k: int, step: int, vocab: int):
    """Row i keeps k consecutive ids from i * step: a tile of r rows has a union of about r * step
    + k ids (neighbouring tokens share most of their kept ids, as a trained model's do)."""
    sets = (torch.arange(n).unsqueeze(1) * step + torch.arange(k)) % vocab
    return sets.reshape(-1), torch.arange(n + 1) * k, sets[:, 0]


@pytest.mark.parametrize("factor,sparse", [(None, False), (1.0, True)], ids=["measured", "roofline-only"])
def test_tiles_with_a_quarter_of_the_vocab_go_dense(factor, sparse, monkeypatch):
    """Kept sets of 512 ids whose 512-row tiles span a quarter of a 256000-token vocab at H=2304:
    sparse tiles there measured slower than the plain op (the roofline sum alone prefers them,
    which the roofline-only case keeps visible); with the measured factor the plan takes every
    tile dense, so replay is never slower than the plain op."""
    if factor is not None:
        monkeypatch.setattr(replay, "SPARSE_MEASURED_FACTOR", factor)
    vocab, hidden = 256000, 2304
    ids, offsets, labels = _sliding_sets(4096, 512, 125, vocab)
    plan = make_plan(ids, offsets, None, labels, 0, vocab, vocab, hidden, 2, 4096)
    kinds = {p.cols is not None for p in plan.pieces}
    assert kinds == {sparse}, kinds


def test_overlapping_small_sets_stay_sparse():
    """A trained model's K = 50 sets (tiles' unions a few percent of the vocab): sparse tiles,
    the case replay is for."""
    vocab, hidden = 128256, 4096
    ids, offsets, labels = _sliding_sets(4096, 50, 16, vocab)
    plan = make_plan(ids, offsets, None, labels, 0, vocab, vocab, hidden, 2, 4096)
    assert plan.pieces and all(p.cols is not None for p in plan.pieces)


# ---------------------------------------------------------------- the benchmark's per-phase breakdown
def test_sampling_mask_bench_breakdown_runs_on_cpu():
    """--breakdown: a line per row with the plan, forward, backward and the rest (time, host time,
    ops) and the plan's tiles, a plain line per shape; the table the GPU check reads is unchanged."""
    import importlib.util
    import os
    import re
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(repo, "tools", "sampling_mask_bench.py"), "--device", "cpu", "--shapes",
         "256x32x3000", "--sets", "zipf", "--ks", "5", "--reps", "1", "--chunk-size", "64", "--pieces", "sparse",
         "--breakdown"], capture_output=True, text=True, timeout=300, cwd=repo)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    breakdown = [line for line in lines if line.startswith("    breakdown ms: ")]
    assert len(breakdown) == 1, out.stdout
    for phase in ("plan", "forward", "backward"):
        assert re.search(rf"{phase} [\d.]+ \(host [\d.]+, \d+ ops\)", breakdown[0]), breakdown[0]
    assert re.search(r"rest -?[\d.]+ \(\d+ ops\); total [\d.]+ \(\d+ ops\)", breakdown[0]), breakdown[0]
    assert any(re.match(r"    plan: tiles of 64 rows, 4 sparse piece\(s\)", line) for line in lines), out.stdout
    assert sum(line.startswith("    plain breakdown ms: forward ") for line in lines) == 1, out.stdout
    spec = importlib.util.spec_from_file_location("gpu_check_report",
                                                  os.path.join(repo, "tools", "gpu_check_report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert re.fullmatch(r"zipf K=5 x[\d.]+; (every row met its target|1 row\(s\) missed their target)",
                        report.sampling_mask_figure(out.stdout)), report.sampling_mask_figure(out.stdout)
