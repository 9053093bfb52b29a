"""Sampling-distribution replay: linear_logprobs(sampling_mask=(token_ids, offsets)) against a
float64 dense reference (full logits, log-softmax over each position's kept set), at TP 1/2 over
gloo, with padded vocab, temperature 0.7, chunks of 7 rows (dividing nothing), ignored positions
(some holding sets, which are not scored), empty sets (no truncation), labels inside and outside
their sets, and sets from one id to nearly the whole vocab. Each case runs with the choice made from
sizes and with the kept rows forced sparse (gathered W rows per entry) and dense (whole-shard GEMMs).

Tolerances as tests/test_sampling.py: fp32 2e-5, bf16 2e-2 (relative norm vs float64); which
labels are kept must match exactly.
"""

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import reference
from dist import run_workers
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, grpo_loss, linear_grpo_loss
from megatron_fused_ce.ops import replay
from megatron_fused_ce.ops.replay import SamplingMask, build_sampling_mask, flat_positions, slice_sampling_mask
from sampling_mask_cases import (
    case_seed,
    check,
    keep_matrix,
    local_inputs,
    make_case,
    random_sets,
    run_case,
    world_group,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORCES = (None, "sparse", "dense")


def _forces_worker(rank, world, cases):
    return [[run_case(rank, world, case, force) for force in FORCES] for case in cases]


@pytest.mark.parametrize("tp", [1, 2])
def test_matches_dense_reference(tp):
    cases = [make_case(case_seed("ref", tp), tp),
             make_case(case_seed("ref-bf16", tp), tp, dtype=torch.bfloat16, ints=True)]
    for case, per_force in zip(cases, zip(*run_workers(_forces_worker, tp, cases))):
        for f, force in enumerate(FORCES):
            check(case, [per_rank[f] for per_rank in per_force], f"{case['dtype']} pieces={force}")


def _every_row_worker(rank, world, cases):
    from unittest import mock

    calls = []
    original = replay.ReplayChunks._dw_in_one_product

    def spy(self, spec):
        calls.append(original(self, spec))
        return calls[-1]

    with mock.patch.object(replay.ReplayChunks, "_dw_in_one_product", spy):
        out = [[run_case(rank, world, case, force) for force in FORCES] for case in cases]
    return out, any(calls)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_labelled_row_with_a_set(tp):
    """No plain pass (every position has a set, or every labelled one): the kept sets alone give
    the values and dX / dW, on both routes, one chunk of set rows (the dense route's dW then its one
    GEMM, written in the weight's dtype) and several; the dense route over the rows themselves
    (as many slots as rows) and, where the entries are fewer than the rows (most positions
    unlabelled, without a set), over gathered slots with dX copied back."""
    cases = []
    for dtype, chunk, few in ((torch.float32, 64, False), (torch.bfloat16, 64, False), (torch.float32, 7, False),
                              (torch.float32, 64, True), (torch.float32, 5, True)):
        case = make_case(case_seed("every-row", tp, str(dtype), chunk, few), tp, dtype=dtype,
                         ints=dtype == torch.bfloat16, chunk_size=chunk)
        g = torch.Generator().manual_seed(case_seed("every-row-sets", tp, str(dtype), chunk, few))
        labels = case["labels"].reshape(-1)
        if few:  # a few labelled positions with a set of one or two ids (the label in most), the others without
            labels[torch.rand(labels.numel(), generator=g) < 0.7] = -100
            nth = (labels >= 0).cumsum(0).tolist()  # (every third labelled position: its label off its set)
            sets = [torch.zeros(0, dtype=torch.int64) if y < 0
                    else torch.tensor([y + (nth[i] % 3 == 0), y + 2]).remainder(case["vocab"])[:1 + i % 2]
                    for i, y in enumerate(labels.tolist())]
            case["mask"] = SamplingMask(torch.cat(sets), torch.tensor([0] + [len(x) for x in sets]).cumsum(0))
            assert case["mask"][0].numel() < labels.numel()
        else:
            case["mask"] = random_sets(g, labels.numel(), case["vocab"], labels, empty=0.0)
        cases.append(case)
    results = run_workers(_every_row_worker, tp, cases)
    assert all(one_gemm for _, one_gemm in results)  # the one-GEMM dW ran
    for c, case in enumerate(cases):
        for f, force in enumerate(FORCES):
            check(case, [out[c][f] for out, _ in results], f"{case['dtype']} chunk={case['chunk_size']} pieces={force}")


def _options_worker(rank, world, case):
    out = [run_case(rank, world, case, force) for force in FORCES]
    # Megatron's main_grad: the same dW lands there
    hidden, weight = local_inputs(rank, case)
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(weight.shape), False
    lp = linear_logprobs(hidden, weight, case["labels"], tp_group=world_group(world), vocab_size=case["vocab"],
                         temperature=case["T"], chunk_size=case["chunk_size"], sequence_parallel=case["sp"],
                         sampling_mask=case["mask"], accumulate_into_main_grad=True).logprobs
    (torch.where(torch.isfinite(lp), lp, 0.0) * case["grad_lp"]).sum().backward()
    plain = run_case(rank, world, dict(case, grad_ent=torch.zeros_like(case["grad_ent"])))
    return out, (weight.main_grad, weight.grad_added_to_main_grad, plain["dw"])


def test_sequence_parallel_and_main_grad():
    case = make_case(case_seed("sp"), 2, sp=True)
    results = run_workers(_options_worker, 2, case)
    for f, force in enumerate(FORCES):
        check(case, [r[0][f] for r in results], f"sp pieces={force}")
    for _, (main_grad, added, dw) in results:
        assert added and reference.rel_err(main_grad, dw) < 1e-6


# ---------------------------------------------------------------- plain where nothing is truncated
def test_mask_of_empty_sets_is_todays_result_bit_for_bit():
    case = make_case(case_seed("empty"), 1, dtype=torch.bfloat16, ints=True)
    n = case["labels"].numel()
    empty = SamplingMask(torch.zeros(0, dtype=torch.int64), torch.zeros(n + 1, dtype=torch.int64))
    # sets at ignored positions only: nothing labelled is truncated
    ignored = (case["labels"].reshape(-1) == -100).nonzero().squeeze(1)
    sizes = torch.zeros(n, dtype=torch.int64)
    sizes[ignored] = 2
    only_ignored = SamplingMask(torch.arange(2 * ignored.numel()) % case["vocab"],
                                torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]))
    plain = linear_logprobs(case["hidden"], case["weight"], case["labels"], vocab_size=case["vocab"],
                            temperature=case["T"], return_entropy=True, chunk_size=7)
    for mask in (empty, only_ignored):
        out = linear_logprobs(case["hidden"], case["weight"], case["labels"], vocab_size=case["vocab"],
                              temperature=case["T"], return_entropy=True, chunk_size=7, sampling_mask=mask)
        assert torch.equal(out.logprobs, plain.logprobs) and torch.equal(out.entropy, plain.entropy)


def test_no_grad_matches_grad_path_and_input_forms():
    case = make_case(case_seed("nograd"), 1)
    h, w, y = case["hidden"], case["weight"], case["labels"]
    kw = dict(vocab_size=case["vocab"], temperature=case["T"], chunk_size=5, return_entropy=True)
    ids, offsets = case["mask"]

    class EngineMask:  # vLLM's SamplingMask: .token_ids / .offsets, here a list and int32
        def __init__(self):
            self.token_ids, self.offsets = ids.tolist(), offsets.to(torch.int32)

    with torch.no_grad():
        a = linear_logprobs(h, w, y, sampling_mask=case["mask"], **kw)
    b = linear_logprobs(h.clone().requires_grad_(), w, y, sampling_mask=EngineMask(), **kw)
    assert torch.equal(a.logprobs, b.logprobs.detach()) and torch.equal(a.entropy, b.entropy.detach())


# ---------------------------------------------------------------- helpers: batch and CP masks
def test_build_sampling_mask_from_requests():
    # two requests in a [3, 6] labels batch: row 0 from position 2 (3 tokens), row 2 from 0 (2 tokens)
    r0 = SamplingMask(torch.tensor([5, 1, 7, 7, 2, 9]), torch.tensor([0, 2, 3, 6]))
    r1 = ([4, 0], [0, 1, 2])  # plain lists, as an engine may return them
    mask = build_sampling_mask([(0, 2, r0), (2, 0, r1)], (3, 6))
    assert mask.offsets.tolist() == [0, 0, 0, 2, 3, 6, 6] + [6] * 6 + [7, 8, 8, 8, 8, 8]
    assert mask.token_ids.tolist() == [5, 1, 7, 7, 2, 9, 4, 0]
    # [S, B] (sequence first): the same sets at (position, row)
    first = build_sampling_mask([(0, 2, r0), (2, 0, r1)], (6, 3), sequence_first=True)
    sets = {i: first.token_ids[first.offsets[i]:first.offsets[i + 1]].tolist() for i in range(18)}
    assert sets[2 * 3 + 0] == [5, 1] and sets[3 * 3 + 0] == [7] and sets[4 * 3 + 0] == [7, 2, 9]
    assert sets[0 * 3 + 2] == [4] and sets[1 * 3 + 2] == [0] and sum(map(len, sets.values())) == 8
    with pytest.raises(ValueError, match="overlaps"):
        build_sampling_mask([(0, 2, r0), (0, 4, r1)], (3, 6))
    with pytest.raises(ValueError, match="do not fit"):
        build_sampling_mask([(0, 4, r0)], (3, 6))


def test_kept_columns_of_a_shard():
    """replay.kept_columns (for materialized vocab-parallel logits): each shard's columns of the
    kept sets, every column where a set is empty."""
    g = torch.Generator().manual_seed(4)
    labels = torch.randint(0, 50, (20,), generator=g)
    mask = random_sets(g, 20, 50, labels)
    full = keep_matrix(mask, 20, 50)
    for start, width in ((0, 25), (25, 25), (40, 13)):
        cols = replay.kept_columns(mask, start, width)
        assert torch.equal(cols[:, :min(width, 50 - start)], full[:, start:start + width])


def test_context_parallel_slice_matches_the_full_sequence():
    """A CP rank's labels [B, S/CP] at megatron's load-balanced positions, its mask cut by
    slice_sampling_mask: the log-probs of those positions equal the full call's."""
    from megatron_fused_ce.megatron.context_parallel import positions_on_cp_rank

    g = torch.Generator().manual_seed(5)
    batch, length, hidden, vocab, cp = 3, 8, 16, 40, 2
    h = torch.randn(batch, length, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    y = torch.randint(0, vocab, (batch, length), generator=g)
    mask = random_sets(g, batch * length, vocab, y.reshape(-1))
    full = linear_logprobs(h, w, y, return_entropy=True, sampling_mask=mask)
    for rank in range(cp):
        seq = positions_on_cp_rank(length, cp, rank)
        local = slice_sampling_mask(mask, flat_positions(seq, batch, length))
        out = linear_logprobs(h[:, seq], w, y[:, seq], return_entropy=True, sampling_mask=local)
        torch.testing.assert_close(out.logprobs, full.logprobs[:, seq], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.entropy, full.entropy[:, seq], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="positions"):
        slice_sampling_mask(mask, [batch * length])


# ---------------------------------------------------------------- GRPO
def test_linear_grpo_loss_with_sampling_mask():
    """linear_grpo_loss(sampling_mask=) == grpo_loss on linear_logprobs(sampling_mask=), values
    and gradients; a sampled token outside its own kept set is excluded, as with the filters."""
    g = torch.Generator().manual_seed(11)
    batch, length, hidden, vocab = 2, 9, 16, 37
    h = torch.randn(batch, length, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    y = torch.randint(0, vocab, (batch, length), generator=g)
    mask = random_sets(g, batch * length, vocab, y.reshape(-1))
    loss_mask = (torch.rand(batch, length, generator=g) < 0.8).float()
    adv, old = torch.randn(batch, generator=g), -torch.rand(batch, length, generator=g)
    config = GRPOConfig(loss_type="dapo", beta=0.0)
    grads = []
    for fused in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            loss, metrics = linear_grpo_loss(hh, ww, y, adv, loss_mask, config, old_logprobs=old, chunk_size=4,
                                             sampling_mask=mask)
        else:
            lp = linear_logprobs(hh, ww, y, chunk_size=4, sampling_mask=mask).logprobs
            loss, metrics = grpo_loss(lp, adv, loss_mask, config, old_logprobs=old)
        loss.backward()
        grads.append((loss.detach(), metrics["num_excluded_tokens"], hh.grad, ww.grad))
    (a, ea, dxa, dwa), (b, eb, dxb, dwb) = grads
    assert ea == eb and ea > 0
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(dxa, dxb)
    torch.testing.assert_close(dwa, dwb)


# ---------------------------------------------------------------- bad masks
def _bad_cases(n, vocab):
    ok_ids, ok_offsets = torch.arange(n) % vocab, torch.arange(n + 1)
    return {
        "not_a_mask": (42, "sampling_mask must be"),
        "float_ids": ((ok_ids.float(), ok_offsets), "integer"),
        "bool_offsets": ((ok_ids, ok_offsets > 0), "integer"),
        "2d_ids": ((ok_ids.view(1, -1), ok_offsets), "1-D"),
        "offsets_too_short": ((ok_ids, ok_offsets[:-1]), "len(offsets)"),
        "offsets_not_from_0": ((ok_ids, ok_offsets + 1), "start at 0"),
        "offsets_decrease": ((ok_ids, torch.tensor([0, 1, 3, 2, 4, 5, 6])), "never decrease"),
        "offsets_end": ((ok_ids[:-1], ok_offsets), "end at len"),
        "id_negative": ((torch.where(ok_ids == 3, -1, ok_ids), ok_offsets), "outside [0, vocab_size"),
        "id_in_padding": ((torch.where(ok_ids == 3, vocab + 1, ok_ids), ok_offsets), "outside [0, vocab_size"),
        "duplicate": ((torch.tensor([0, 1, 1, 2, 3, 4, 5]), torch.tensor([0, 1, 3, 4, 5, 6, 7])), "twice"),
        "with_top_p": (("ok", dict(top_p=0.9)), "top_p"),
        "with_return_topk": (("ok", dict(return_topk=2)), "return_topk"),
        "lean": (("ok", dict(memory_mode="lean")), "lean"),
        "differs_across_ranks": ("differs", "differs across tensor-parallel ranks"),
        "on_one_rank_only": ("one rank", "differs across tensor-parallel ranks"),
        "bad_on_one_rank": ("bad on one rank", "invalid on another"),
    }


def _bad_worker(rank, world):
    torch.manual_seed(0)
    n, vocab = 6, 16
    h, w, y = torch.randn(n, 8), torch.randn(vocab // world + 2, 8), torch.randint(0, vocab, (n,))
    ok = (torch.arange(n) % vocab, torch.arange(n + 1))
    messages = {}
    for name, (mask, _) in _bad_cases(n, vocab).items():
        kwargs = {}
        if isinstance(mask, tuple) and mask[0] == "ok":
            mask, kwargs = ok, mask[1]
        elif mask == "differs":
            mask = (ok[0] if rank == 0 else (ok[0] + 1) % vocab, ok[1])
        elif mask == "one rank":
            mask = ok if rank == 0 else None
        elif mask == "bad on one rank":
            mask = ok if rank == 0 else (ok[0].float(), ok[1])
        try:
            linear_logprobs(h.requires_grad_(), w.requires_grad_(), y, tp_group=dist.group.WORLD, vocab_size=vocab,
                            sampling_mask=mask, **kwargs)
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    return messages


def test_bad_masks_raise_on_every_rank():
    results = run_workers(_bad_worker, 2, timeout=60)
    for name, (_, expected) in _bad_cases(6, 16).items():
        for rank, messages in enumerate(results):
            msg = messages[name]
            assert msg is not None, f"rank {rank} did not raise for {name}"
            if not (name == "bad_on_one_rank" and rank == 1):  # the rank with the bad mask names it
                assert expected in msg, f"rank {rank} {name}: {msg!r}"
    assert "integer" in results[1]["bad_on_one_rank"]


# ---------------------------------------------------------------- memory
@pytest.mark.parametrize("force", FORCES)
def test_largest_intermediate_is_one_chunk(force, monkeypatch):
    monkeypatch.setattr(replay, "FORCE_PIECES", force)
    n, hidden, v_local, chunk = 1024, 32, 512, 128
    g = torch.Generator().manual_seed(1)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = torch.randn(v_local, hidden, generator=g).requires_grad_()
    y = torch.randint(0, v_local, (n,), generator=g)
    y[::5] = -100
    mask = random_sets(g, n, v_local, y, sizes=(4, 20, 60))
    with reference.LargestTensor() as mode:
        out = linear_logprobs(h, w, y, chunk_size=chunk, return_entropy=True, sampling_mask=mask)
        (torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0).sum() + out.entropy.sum()).backward()
    reference.record_memory(f"linear_logprobs sampling_mask, pieces {force or 'by cost'} (chunk {chunk} of {n} "
                            f"rows): largest tensor / dense [N, V] logits", mode.largest / (n * v_local))
    # (+1: the dense dlogits block's spare element, where the other chunks' entries write: replay.py)
    assert mode.largest <= chunk * v_local + 1, (mode.largest, chunk * v_local)


def test_a_few_large_sets_do_not_pad_every_tile():
    """Rows are tiled in order of their set size: the padded entries stay about the mask's size,
    not [rows, largest set] (here the largest set is 300 of 512 ids, one row in four)."""
    n, hidden, v_local, chunk = 1024, 32, 512, 128
    g = torch.Generator().manual_seed(2)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = torch.randn(v_local, hidden, generator=g)
    y = torch.randint(0, v_local, (n,), generator=g)
    mask = random_sets(g, n, v_local, y, sizes=(1, 2, 3, 300))
    with reference.LargestTensor() as mode:
        out = linear_logprobs(h, w, y, chunk_size=chunk, sampling_mask=mask)
        torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0).sum().backward()
    entries = mask.token_ids.numel()
    assert mode.largest <= max(chunk * v_local + 1, 2 * entries), (mode.largest, entries)


# ---------------------------------------------------------------- sparse or dense, from sizes
def test_sparse_for_small_sets_dense_for_large_ones():
    """From sizes the host knows (entries, rows with a set, vocab): the K a top-k sampler keeps
    (50 of 32000 ids or more) is scored on gathered rows; from about V / 600 (K = 512 of 128256,
    where the sparse route measured 1.3-1.7x plain on an H200) the whole shard (dense: never
    slower than the plain op)."""
    vocab = 128256
    assert replay.sparse_is_cheaper(8192 * 50, 8192, vocab)
    assert replay.sparse_is_cheaper(8192 * 50, 8192, 32000)
    assert not replay.sparse_is_cheaper(8192 * 512, 8192, vocab)
    assert not replay.sparse_is_cheaper(8192 * 2048, 8192, vocab)
    assert not replay.sparse_is_cheaper(10 * 5, 10, 101)  # tiny vocabularies: dense


def test_sparse_or_dense_is_decided_on_the_ranks_shard():
    """Under TP the choice compares K with the rank's shard, not the global vocabulary: every
    rank's kept-set kernels walk every entry (those off its shard masked) while the dense GEMMs
    shrink with the shard. K = 4 over a 4000-id vocabulary split in two shards of 2000 is dense
    (4 / 2000 > 1 / 640), though 4 / 4000 would be sparse; on one rank of 4000 it is sparse."""
    g = torch.Generator().manual_seed(3)
    rows, k = 64, 4
    ids = torch.stack([torch.randperm(4000, generator=g)[:k] for _ in range(rows)]).reshape(-1)
    offsets = torch.arange(rows + 1) * k
    labels = ids[offsets[:-1]].clone()
    labelled = torch.ones(rows, dtype=torch.bool)

    def tiling(vocab_start, num_valid_cols):
        check = replay.MaskCheck((ids, offsets), labels, -100, 4000)
        return replay.replay_tiling(check, labels, labelled, vocab_start, num_valid_cols, 4000, needs_grad=True,
                                    plain_pass=True)

    assert not tiling(2000, 2000).sparse and not tiling(0, 2000).sparse
    assert tiling(0, 4000).sparse


def test_union_tiles_where_the_backend_has_them_and_the_unions_are_small():
    """replay_route: with union-tile kernels, K = 50 is tiles at the RL shards (V 19008-32064,
    where the sparse kernels cost more than plain) and on the large ones, and so is K = 512 at V =
    128256 (measured 0.21 / 0.35 of plain against the dense route's 0.70); K = 512 at V = 19008
    (even a tile's union bound past the dense route's columns) and tiles whose products would pass
    a chunk's elements (or whose layouts' tables would) are not; without those kernels the choice
    is sparse or dense as before."""
    from types import SimpleNamespace

    tiles, none = SimpleNamespace(union_logits=object()), SimpleNamespace()
    budget = 2**30
    assert replay.replay_route(8192 * 50, 8192, 19008, tiles, budget) == "tiles"
    assert replay.replay_route(8192 * 50, 8192, 128256, tiles, budget) == "tiles"
    assert replay.replay_route(8192 * 512, 8192, 19008, tiles, budget) == "dense"
    assert replay.replay_route(8192 * 512, 8192, 128256, tiles, budget) == "tiles"
    # the boundary, K = V / 128 at tiles of 32 (measured: tiles ahead of the dense route at V / 160
    # even with random sets, behind at V / 95)
    assert replay.replay_route(8192 * 148, 8192, 19008, tiles, budget) == "tiles"
    assert replay.replay_route(8192 * 149, 8192, 19008, tiles, budget) == "dense"
    width = replay.TILE_ROWS
    assert replay.COLUMN_TILE == width
    assert replay.replay_route(8192 * 50, 8192, 19008, tiles, 8192 * 50 * width) == "tiles"
    assert replay.replay_route(8192 * 50, 8192, 19008, tiles, 8192 * 50 * width - 1) == "dense"
    # the layouts' [tiles, members] tables too (K = 1 over 2**20 rows: products of 2**20 x width
    # elements, tables of (2**20 / width + 1) x (19008 + width) bytes, half as many elements, the
    # larger)
    table = (2**20 // width + 1) * (19008 + width) // 2
    assert table > 2**20 * width
    assert replay.replay_route(2**20, 2**20, 19008, tiles, table) == "tiles"
    assert replay.replay_route(2**20, 2**20, 19008, tiles, table - 1) == "sparse"
    assert replay.replay_route(8192 * 50, 8192, 19008, none, budget) == "dense"
    assert replay.replay_route(8192 * 50, 8192, 128256, none, budget) == "sparse"


# ---------------------------------------------------------------- why replay: engine and trainer drift
def _bench_tool():
    spec = importlib.util.spec_from_file_location("sampling_mask_bench",
                                                  os.path.join(REPO, "tools", "sampling_mask_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("filters,noise", [(dict(top_p=0.9), 0.0), (dict(top_k=50, top_p=0.95), 0.02)],
                         ids=["top_p-bf16", "top_k_top_p-bf16+noise"])
def test_replay_scores_the_engines_sets_where_recomputed_filters_drift(filters, noise):
    """With engine logits a bf16 rounding (and noise) away from the trainer's, recomputing the
    filters on the trainer's logits drops some sampled tokens (-inf) and renormalizes others over
    a different set; replay scores every sampled token, over exactly the engine's set."""
    row = _bench_tool().drift_table_row(filters, noise, seed=1, n=2048, vocab=1000)
    assert row["excluded"] > 0 and row["sets_differ"] > row["excluded"] and row["ratio_error"] > 1e-4, row
    assert row["replay_excluded"] == 0 and row["replay_error"] < 1e-5, row


# ---------------------------------------------------------------- the GPU benchmark's CPU smoke run
def test_sampling_mask_bench_runs_on_cpu():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "sampling_mask_bench.py"), "--device", "cpu",
         "--shapes", "256x32x3000", "--ks", "5,50", "--reps", "1", "--chunk-size", "128", "--pieces", "sparse"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("| 256x32x3000")]
    assert len(lines) == 4, out.stdout  # {zipf, random} x K
    for line in lines:  # union / V of the (forced) sparse tiles, replay / plain
        assert 0 < float(line.split("|")[4]) <= 1 and math.isfinite(float(line.split("|")[8])), out.stdout


def test_sampling_mask_bench_paired_times_replay_between_plain_calls():
    """`--paired`: replay's reps alternate with plain log-probs' (plain, replay, plain, ...: both timed
    in the same GPU state), warm-up and steady phase included, and each row's plain ms are the plain
    calls timed between its own (the CLI on the CPU)."""
    tool = _bench_tool()
    calls = []

    class Step:
        device = torch.device("cpu")

        def __init__(self, name):
            self.name = name

        def __call__(self):
            calls.append(self.name)

    replay_ms, plain_ms = tool.time_paired_ms(Step("replay"), Step("plain"), warmup=1, reps=3)
    assert calls == ["plain", "replay"] * 4 and replay_ms >= 0 and plain_ms >= 0
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "sampling_mask_bench.py"), "--device", "cpu",
         "--shapes", "256x32x3000", "--ks", "5", "--sets", "zipf", "--reps", "2", "--chunk-size", "128",
         "--paired", "--steady-ms", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("| 256x32x3000")]
    plain, replay_, ratio = (float(line.split("|")[i]) for i in (6, 7, 8))
    assert ratio == pytest.approx(replay_ / plain, rel=0.02, abs=0.006), line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("mode", [[], ["step"]], ids=["forward-and-backward-graphs", "one-graph-a-step"])
def test_sampling_mask_bench_replays_from_cuda_graphs(mode):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "sampling_mask_bench.py"), "--graphed", *mode,
         "--shapes", "512x256x3000", "--ks", "5,50", "--reps", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"CUDA graphs ({mode[0] if mode else 'callables'})" in out.stdout, out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("| 512x256x3000")]
    assert len(lines) == 4, out.stdout  # {zipf, random} x K
    for line in lines:  # replay / plain, and replay's log-probs against float64
        ratio, err = float(line.split("|")[8]), float(line.split("|")[10])
        assert 0 < ratio < 100 and err < 0.1, out.stdout
