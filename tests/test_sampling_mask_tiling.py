"""Sampling-mask replay's tiling (ops/replay.py's ReplayChunks on the chunk loop): no host sync,
what a call dispatches (bounded, independent of the number of rows; GEMMs only on the dense
route), calls whose rows all keep a set, Megatron's main_grad, and the benchmark's breakdown.
Values against the float64 dense reference as in tests/test_sampling_mask.py."""

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist import run_workers
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.ops import agreement, replay
from sampling_mask_cases import PHASES, VIEWS, case_seed, check, label_phases, make_case, random_sets, run_case

GEMMS = {"mm", "addmm", "matmul", "bmm"}
# what reads a device value back to the host
SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "unique", "_unique2", "masked_select"}


class _Ops(TorchDispatchMode):
    """The ops dispatched (views left out) per replay phase."""

    def __init__(self, phase):
        super().__init__()
        self.phase = phase
        self.ops = collections.defaultdict(list)  # phase -> [op name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[self.phase[0]].append(name)
        return func(*args, **(kwargs or {}))


def _traced(monkeypatch, fn):
    """Run fn() with replay's phases labelled: {phase: [op]} ("other": outside them)."""
    phase = ["other"]
    label_phases(monkeypatch, phase)
    mode = _Ops(phase)
    with mode:
        fn()
    monkeypatch.undo()
    return mode.ops


def _fwd_bwd(h, w, y, mask, chunk, **kwargs):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_logprobs(hh, ww, y, chunk_size=chunk, sampling_mask=mask, **kwargs)
    torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0).sum().backward()
    return out.logprobs.detach(), hh.grad, ww.grad


def _inputs(n=256, hidden=32, vocab=600, k=6, seed=0, dtype=torch.float32, empty_every=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype)
    sets = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    y = sets[torch.arange(n), torch.randint(0, k, (n,), generator=g)]
    sizes = torch.full((n,), k)
    if empty_every:  # some rows without truncation: the plain path's
        sizes[::empty_every] = 0
    keep = torch.arange(k).unsqueeze(0) < sizes.unsqueeze(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    return h, w, y, (sets[keep], offsets)


# ---------------------------------------------------------------- no host sync, bounded launches
@pytest.mark.parametrize("force", ["sparse", "dense"])
def test_replay_reads_nothing_back_to_the_host(force, monkeypatch):
    """The kept entries' layout, the forward and the backward make no host sync (sizes come from
    the agreement's counts): replay is capturable like the other paths."""
    monkeypatch.setattr(replay, "FORCE_PIECES", force)
    h, w, y, mask = _inputs(empty_every=5)
    ops = _traced(monkeypatch, lambda: _fwd_bwd(h, w, y, mask, 64))
    for phase in PHASES:
        assert ops[phase], phase
        assert not set(ops[phase]) & SYNCS, (phase, set(ops[phase]) & SYNCS)


def test_sparse_launches_do_not_grow_with_rows_and_make_no_gemm(monkeypatch):
    """The sparse route dispatches the same ops for 64 and 256 rows (no per-tile work) and no
    GEMM; the dense route one logits GEMM per chunk forward (over the rows themselves here: the
    first chunk's launched before the replay phases, fast.EarlyProduct) and the dX / dW pair
    backward."""
    counts = {}
    for n in (64, 256):
        monkeypatch.setattr(replay, "FORCE_PIECES", "sparse")
        h, w, y, mask = _inputs(n=n)
        ops = _traced(monkeypatch, lambda: _fwd_bwd(h, w, y, mask, 256))
        counts[n] = {phase: len(ops[phase]) for phase in PHASES}
        assert not any(name in GEMMS for phase in PHASES for name in ops[phase]), ops
    assert counts[64] == counts[256], counts
    monkeypatch.setattr(replay, "FORCE_PIECES", "dense")
    h, w, y, mask = _inputs(n=256)
    ops = _traced(monkeypatch, lambda: _fwd_bwd(h, w, y, mask, 96))
    gemms = {phase: sum(name in GEMMS for name in ops[phase]) for phase in ("other", "forward", "backward")}
    assert gemms == {"other": 1, "forward": 2, "backward": 6}, gemms


def test_dense_and_sparse_routes_agree():
    """fp32: the two routes, and the sparse one with rows without a set, give the same values."""
    h, w, y, mask = _inputs(empty_every=7)
    got = {}
    for force in ("sparse", "dense"):
        replay.FORCE_PIECES = force
        try:
            got[force] = _fwd_bwd(h, w, y, mask, 100)
        finally:
            replay.FORCE_PIECES = None
    for a, b in zip(got["sparse"], got["dense"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- every row with a set
def _no_empty_sets(case, seed, labelled_everywhere=False, sizes=(1, 3, 8, 30, 90)):
    g = torch.Generator().manual_seed(seed)
    labels = case["labels"]
    if labelled_everywhere:
        labels = torch.randint(0, case["vocab"], labels.shape, generator=g)
    mask = random_sets(g, labels.numel(), case["vocab"], labels.reshape(-1), empty=0.0, sizes=sizes)
    return dict(case, labels=labels, mask=mask)


def _sets_worker(rank, world, cases):
    return [[run_case(rank, world, case, force) for force in ("sparse", "dense")] for case in cases]


@pytest.mark.parametrize("tp", [1, 2])
def test_every_row_with_a_set(tp):
    """No plain row: dW is the kept entries' alone (padding rows and ids no row keeps stay 0),
    fp32-summed, equal to the float64 reference on both routes."""
    cases = [_no_empty_sets(make_case(case_seed("compact", tp), tp), 1),
             _no_empty_sets(make_case(case_seed("compact-bf16", tp), tp, dtype=torch.bfloat16, ints=True), 2),
             _no_empty_sets(make_case(case_seed("compact-all", tp), tp), 3, labelled_everywhere=True, sizes=(1, 2, 4))]
    results = run_workers(_sets_worker, tp, cases)
    for index, case in enumerate(cases):
        for f, force in enumerate(("sparse", "dense")):
            check(case, [r[index][f] for r in results], f"{case['dtype']} {force}, every row with a set")
    # the last case keeps few ids: most rows of dW are no kept id's, exactly 0
    case, v_local = cases[-1], cases[-1]["v_local"]
    for rank, per_rank in enumerate(results):
        dw = per_rank[-1][0]["dw"]
        ids = case["mask"].token_ids
        local = set((ids[(ids >= rank * v_local) & (ids < (rank + 1) * v_local)] - rank * v_local).tolist())
        untouched = [c for c in range(v_local) if c not in local]
        assert untouched and bool((dw[untouched] == 0).all())


@pytest.mark.parametrize("force", ["sparse", "dense"])
def test_main_grad_takes_the_kept_rows(force, monkeypatch):
    """Megatron's main_grad receives dW (added to what it holds), with or without plain rows."""
    monkeypatch.setattr(replay, "FORCE_PIECES", force)
    for empty_every in (0, 3):
        # masks of the same positions share a signature, whatever their ids: the one with labelled
        # positions without a set needs the plain pass, which a signature whose first call had a set
        # everywhere skips (its later calls would give NaN there and raise) — a signature afresh
        agreement.forget_signatures()
        h, w, y, mask = _inputs(n=64, k=5, empty_every=empty_every)
        _, _, dw = _fwd_bwd(h, w, y, mask, 16)
        weight = w.clone().requires_grad_()
        weight.main_grad, weight.grad_added_to_main_grad = torch.full(w.shape, 0.5), False
        lp = linear_logprobs(h.clone().requires_grad_(), weight, y, chunk_size=16, sampling_mask=mask,
                             accumulate_into_main_grad=True).logprobs
        torch.where(torch.isfinite(lp), lp, 0.0).sum().backward()
        assert weight.grad_added_to_main_grad
        torch.testing.assert_close(weight.main_grad - 0.5, dw, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the benchmark's per-phase breakdown
def test_sampling_mask_bench_breakdown_runs_on_cpu():
    """--breakdown: a line per row with the entries' layout, forward, backward and the rest (time,
    host time, ops) and the rows of each kind, a plain line per shape; the table the GPU check
    reads is unchanged."""
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
    for phase in ("entries", "forward", "backward"):
        assert re.search(rf"{phase} [\d.]+ \(host [\d.]+, \d+ ops\)", breakdown[0]), breakdown[0]
    assert re.search(r"rest -?[\d.]+ \(\d+ ops\); total [\d.]+ \(\d+ ops\)", breakdown[0]), breakdown[0]
    assert any(re.match(r"    kept rows: 256 sparse, 0 tiles, 0 dense, 0 plain", line) for line in lines), out.stdout
    assert sum(line.startswith("    plain breakdown ms: forward ") for line in lines) == 1, out.stdout
    spec = importlib.util.spec_from_file_location("gpu_check_report",
                                                  os.path.join(repo, "tools", "gpu_check_report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert re.fullmatch(r"zipf K=5 x[\d.]+; (every row met its target|1 row\(s\) missed their target)",
                        report.sampling_mask_figure(out.stdout)), report.sampling_mask_figure(out.stdout)


def test_sampling_mask_bench_smoke_mode():
    """--smoke: the CPU run of one small shape scores rows on both routes."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(repo, "tools", "sampling_mask_bench.py"), "--smoke"],
                         capture_output=True, text=True, timeout=300, cwd=repo)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 256x32x3000")]
    assert len(rows) == 4, out.stdout
    routes = {row[5].strip() for row in rows}
    assert routes == {"sparse", "dense"}, out.stdout  # K=4 on gathered rows, K=50 (of 3000 ids) dense (CPU: no tiles)
    assert all(math.isfinite(float(row[8])) and float(row[10].strip()) < 1e-2 for row in rows), out.stdout


def test_sampling_mask_bench_main_grad_step():
    """--main-grad: a step adds replay's dW into the weight's fp32 main_grad, the dW a step without
    it returns (two steps: twice it), and dX is the same."""
    import importlib.util
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("sampling_mask_bench_under_test",
                                                  os.path.join(repo, "tools", "sampling_mask_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(96, 16, generator=g).requires_grad_()
    w = torch.randn(300, 16, generator=g).requires_grad_()
    ids, offsets, labels = bench.kept_sets("zipf", 96, 300, 8, torch.device("cpu"), g)
    dx, dw = bench.make_step(h, w, labels, 64, (ids, offsets))()
    step = bench.make_step(h, w, labels, 64, (ids, offsets), main_grad=True)
    dx_main, dw_returned = step()
    assert dw_returned is None and step.weight.main_grad.dtype == torch.float32
    torch.testing.assert_close(dx_main, dx, rtol=0, atol=0)
    torch.testing.assert_close(step.weight.main_grad, dw, rtol=1e-6, atol=1e-6)
    step()
    torch.testing.assert_close(step.weight.main_grad, 2 * dw, rtol=1e-6, atol=1e-6)


def test_sampling_mask_bench_tp2_on_cpu():
    """--tp 2 under torchrun (gloo): V is each rank's shard, the sets drawn over the global vocab;
    rank 0 alone prints the table, rows on both routes, replay's log-probs near float64."""
    import os
    import re
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")  # two ranks on a small machine
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(repo, "tools", "sampling_mask_bench.py"), "--tp", "2", "--device", "cpu", "--smoke"],
        capture_output=True, text=True, timeout=300, cwd=repo, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("device: cpu, ") and line.endswith(", tp 2") for line in lines) == 1, out.stdout
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| 256x32x3000")]
    assert [(row[1], row[2]) for row in rows] == [("zipf", "4"), ("zipf", "50"), ("random", "4"), ("random", "50")]
    for row in rows:
        assert row[3] == f"{int(row[2]) / 6000:.4f}", row  # K over the global vocab, 3000 x 2
        assert math.isfinite(float(row[7])) and float(row[9]) < 1e-2, row
    assert {row[4] for row in rows} == {"sparse", "dense"}, out.stdout  # K=4 on gathered rows, K=50 dense
    assert sum(bool(re.fullmatch(r"every row met its target|\d row\(s\) missed their target", line))
               for line in lines) == 1, out.stdout
