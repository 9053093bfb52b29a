"""Sampling-mask replay cases (linear_logprobs(sampling_mask=...)) and their float64 check, shared by
tests/test_sampling_mask*.py.

Tolerances as tests/test_sampling.py: fp32 2e-5, bf16 2e-2 (relative norm vs float64); which labels
are kept must match exactly.
"""

import zlib

import torch

import reference
import sampling_reference as sref
from sampling_cases import compare_ranks, local_inputs, random_inputs, world_group  # the same inputs, sharding and comparison
from megatron_fused_ce import linear_logprobs
from megatron_fused_ce.ops import replay
from megatron_fused_ce.ops.replay import SamplingMask

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def case_seed(*key):
    return zlib.crc32(repr(key).encode()) % 10_000


def random_sets(g, n, vocab, labels, *, empty=0.2, sizes=(1, 3, 8, 30, 90)):
    """Kept sets per position: a fifth empty, the others of the given sizes, holding the label
    two times out of three; ignored positions get sets too (the engine may send them)."""
    sets = []
    for i in range(n):
        if torch.rand((), generator=g) < empty:
            sets.append(torch.zeros(0, dtype=torch.int64))
            continue
        k = sizes[int(torch.randint(0, len(sizes), (), generator=g))]
        ids = torch.randperm(vocab, generator=g)[:k]
        y = int(labels[i])
        if y >= 0 and torch.rand((), generator=g) < 2 / 3 and not bool((ids == y).any()):
            ids[0] = y
        sets.append(ids[torch.randperm(ids.numel(), generator=g)])  # any order within a position
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return SamplingMask(torch.cat(sets), offsets)


def make_case(seed, tp, *, dtype=torch.float32, ints=False, seq=10, batch=3, hidden=16, vocab=101, extra_pad=3,
              temperature=0.7, chunk_size=7, sp=False):
    g = torch.Generator().manual_seed(seed)
    v_local, hidden_full, weight_full = random_inputs(g, tp, dtype, ints, seq, batch, hidden, vocab, extra_pad)
    labels = torch.randint(0, vocab, (seq, batch), generator=g)
    labels[torch.rand(seq, batch, generator=g) < 0.25] = -100
    mask = random_sets(g, seq * batch, vocab, labels.reshape(-1))
    return dict(tp=tp, dtype=dtype, hidden=hidden_full, weight=weight_full, labels=labels, mask=mask,
                grad_lp=torch.randn(seq, batch, generator=g), grad_ent=torch.randn(seq, batch, generator=g),
                vocab=vocab, v_local=v_local, T=temperature, chunk_size=chunk_size, sp=sp)


def keep_matrix(mask, n, vocab):
    """[n, vocab] bool: each position's kept set, everything where it is empty."""
    ids, offsets = mask
    keep = torch.zeros(n, vocab, dtype=torch.bool)
    sizes = (offsets[1:] - offsets[:-1]).tolist()
    for i, (start, size) in enumerate(zip(offsets[:-1].tolist(), sizes)):
        if size:
            keep[i, ids[start:start + size]] = True
        else:
            keep[i] = True
    return keep


def dense_reference(case):
    h = case["hidden"].double().requires_grad_()
    w = case["weight"].double().requires_grad_()
    z = (h.reshape(-1, h.shape[-1]) @ w.t())[:, :case["vocab"]] / case["T"]
    keep = keep_matrix(case["mask"], z.shape[0], case["vocab"])
    lp, ent = sref.processed_stats(z, case["labels"].reshape(-1), keep)
    finite = torch.isfinite(lp)
    g_lp, g_ent = case["grad_lp"].reshape(-1).double(), case["grad_ent"].reshape(-1).double()
    ((torch.where(finite, lp, 0.0) * g_lp).sum() + (ent * g_ent).sum()).backward()
    shape = case["labels"].shape
    return dict(lp=lp.detach().reshape(shape), ent=ent.detach().reshape(shape), dx=h.grad, dw=w.grad)


def run_case(rank, world, case, force=None, mask=None, **kwargs):
    replay.FORCE_PIECES = force
    try:
        hidden, weight = local_inputs(rank, case)
        out = linear_logprobs(hidden, weight, case["labels"], tp_group=world_group(world), vocab_size=case["vocab"],
                              temperature=case["T"], return_entropy=True, chunk_size=case["chunk_size"],
                              sequence_parallel=case["sp"], sampling_mask=case["mask"] if mask is None else mask,
                              **kwargs)
        finite = torch.isfinite(out.logprobs)
        ((torch.where(finite, out.logprobs, 0.0) * case["grad_lp"]).sum()
         + (out.entropy * case["grad_ent"]).sum()).backward()
    finally:
        replay.FORCE_PIECES = None
    return dict(lp=out.logprobs.detach(), ent=out.entropy.detach(), dx=hidden.grad, dw=weight.grad)


def check(case, results, what):
    ref = dense_reference(case)
    tp, dtype, v_local, tol = case["tp"], case["dtype"], case["v_local"], TOL[case["dtype"]]
    labelled = case["labels"] != -100
    ref_finite = torch.isfinite(ref["lp"])
    assert ref_finite[labelled].any() and not ref_finite[labelled].all()  # labels in and out of sets
    compare_ranks(case, results, ref, tol,
                  lambda name, err: reference.record(f"replay {name}", tp, dtype, err), what)
    for rank, got in enumerate(results):
        assert torch.all(got["dw"][max(case["vocab"] - rank * v_local, 0):] == 0)  # padding rows
    for got in results[1:]:  # identical on every rank
        assert torch.equal(got["lp"], results[0]["lp"]) and torch.equal(got["ent"], results[0]["ent"])


# ops that only view their input: left out of the op-count tests' counts
VIEWS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "expand", "alias",
         "as_strided", "detach", "lift_fresh", "permute", "split", "split_with_sizes", "unbind", "reshape"}
# replay's phases, (owner, method): what a call does in each, for the op-count tests
PHASES = {"entries": (replay.KeptEntries, "__init__"), "forward": (replay.ReplayChunks, "merged_statistics"),
          "backward": (replay.ReplayChunks, "recompute_grads")}


def label_phases(monkeypatch, phase: list) -> None:
    """While a call runs, phase[0] names the replay phase it is in ("other" outside them)."""
    phase[0] = "other"
    for name, (owner, method) in PHASES.items():
        def wrapped(*args, _original=getattr(owner, method), _name=name, **kwargs):
            before, phase[0] = phase[0], _name
            try:
                return _original(*args, **kwargs)
            finally:
                phase[0] = before

        monkeypatch.setattr(owner, method, wrapped)
