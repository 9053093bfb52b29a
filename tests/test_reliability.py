"""No silent wrong answers: fp16 loss scaling, second-order gradients, autocast, entropy at large
|logits / T|, fp32 logits, and one small agreement collective per call.

Each test compares with a float64 dense reference (or with the unfused computation a user would
otherwise run) and would fail on the code before the fix it covers (see the comment of each).
Multi-rank cases run at TP=2 (with sequence parallelism) over forked gloo workers.
"""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, grpo_loss, linear_grpo_loss
from megatron_fused_ce.ops import agreement, reductions
from op_cases import (
    BF16_TOL,
    autocast_loss,
    autocast_reference_loss,
    check_entropy_precision,
    entropy_case,
    entropy_worker,
    local_inputs,
    make_case,
    reference_ce,
    reference_logprobs,
)


def _rel(out, ref):
    return reference.rel_err(out, ref)


# ------------------------------------------------------------------ 1. fp16 and the loss scale
def _fp16_grads(h32, w32, y, reduction, scale, fused):
    """dX, dW / scale of reduction(CE) in fp16 with the loss scale applied (GradScaler style)."""
    h, w = h32.half().requires_grad_(), w32.half().requires_grad_()
    if fused:
        loss = linear_cross_entropy(h, w, y, reduction=reduction, chunk_size=4096, impl="torch")
    else:  # what a user runs without the op: fp16 logits, fp32 loss, autograd
        loss = F.cross_entropy((h @ w.t()).float(), y, reduction=reduction)
    (loss * scale).backward()
    return h.grad.double() / scale, w.grad.double() / scale


@pytest.mark.parametrize("reduction,scale", [("mean", 65536.0), ("sum", 65536.0), ("sum", 2.0)])
def test_fp16_loss_scale_matches_unfused(reduction, scale):
    """Before: gradients-in-forward stored dX for a unit upstream gradient in fp16 and then cast
    the loss scale to fp16 (65536 -> inf): dX was NaN for "mean" and the per-token p/N flushed to
    zero. Now fp16 takes the recompute path and must be as accurate as the unfused fp16 path (and
    overflow exactly when it does: "sum" at 65536 overflows fp16 in both, GradScaler skips)."""
    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 16384, 16, 128  # small H, V: CPU fp16 GEMMs are slow; N is what matters
    h32 = torch.randn(n, hidden, generator=g)
    w32 = torch.randn(vocab, hidden, generator=g) * 0.3
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::7] = -100
    hd, wd = h32.half().double().requires_grad_(), w32.half().double().requires_grad_()
    F.cross_entropy(hd @ wd.t(), y, reduction=reduction).backward()
    fused = _fp16_grads(h32, w32, y, reduction, scale, fused=True)
    unfused = _fp16_grads(h32, w32, y, reduction, scale, fused=False)
    for name, ours, theirs, ref in (("dX", fused[0], unfused[0], hd.grad), ("dW", fused[1], unfused[1], wd.grad)):
        assert torch.isfinite(ours).all() == torch.isfinite(theirs).all(), name
        if torch.isfinite(theirs).all():
            err, unfused_err = _rel(ours, ref), _rel(theirs, ref)
            reference.record(f"fp16 {reduction} {name}", 1, torch.float16, err)
            assert err <= max(2 * unfused_err, 1e-4), f"{name}: {err:.2e} vs unfused {unfused_err:.2e}"


def test_fp16_grpo_loss_scale_matches_recompute():
    """linear_grpo_loss in fp16 (gradients-in-forward before the fix: NaN/inf dX under a loss
    scale of 65536): finite, and the gradients of grpo_loss on linear_logprobs (fp16 dX rounding)."""
    g = torch.Generator().manual_seed(1)
    b, t, hidden, vocab = 8, 256, 32, 128
    h32, w32 = torch.randn(b, t, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.3
    y = torch.randint(0, vocab, (b, t), generator=g)
    adv, mask = torch.randn(b, generator=g), (torch.rand(b, t, generator=g) < 0.8).float()
    old = -torch.rand(b, t, generator=g) * 5
    config = GRPOConfig()
    grads = []
    for fused in (True, False):
        h, w = h32.half().requires_grad_(), w32.half().requires_grad_()
        if fused:
            loss, _ = linear_grpo_loss(h, w, y, adv, mask, config, old_logprobs=old, impl="torch")
        else:
            lp = linear_logprobs(h, w, y, impl="torch").logprobs
            loss, _ = grpo_loss(lp, adv, mask, config, old_logprobs=old)
        (loss * 65536.0).backward()
        grads.append((h.grad, w.grad))
    for (a, b_) in zip(*grads):
        assert torch.isfinite(a).all()
        # the same recompute math; the log-prob values fed to grpo_loss may differ in the last bit
        assert _rel(a, b_) <= 1e-3


# ------------------------------------------------------------------ 4. second-order gradients
def _penalty_case(fn):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 6, 8, generator=g).requires_grad_()
    w = torch.randn(20, 8, generator=g).requires_grad_()
    y = torch.randint(0, 20, (4, 6), generator=g)
    if fn == "logprobs":
        out = linear_logprobs(h, w, y, return_entropy=True, chunk_size=5)
        return h, w, (out.logprobs * 0.3).sum() + out.entropy.sum()
    if fn == "ce_mean":  # gradients in the forward pass
        return h, w, linear_cross_entropy(h, w, y, chunk_size=5)
    if fn == "ce_none":
        return h, w, linear_cross_entropy(h, w, y, reduction="none", chunk_size=5).sum()
    loss, _ = linear_grpo_loss(h, w, y, torch.randn(4, generator=g), torch.ones(4, 6), GRPOConfig(),
                               chunk_size=5)
    return h, w, loss


@pytest.mark.parametrize("fn", ["logprobs", "ce_mean", "ce_none", "grpo"])
def test_gradient_penalty_raises_instead_of_a_wrong_gradient(fn):
    """Before: a backward through dX (create_graph=True) returned a gradient without the
    second-order term (or garbage through the in-place dlogits). Now it raises; the first-order
    gradient under create_graph=True is unchanged."""
    h, w, loss = _penalty_case(fn)
    expected = torch.autograd.grad(loss, (h, w), retain_graph=True)
    dx, dw = torch.autograd.grad(loss, (h, w), create_graph=True)
    assert torch.equal(dx.detach(), expected[0]) and torch.equal(dw.detach(), expected[1])
    with pytest.raises(RuntimeError, match="second-order gradients"):
        (dx.square().sum() + loss).backward()


# ------------------------------------------------------------------ 5. torch.autocast


@pytest.mark.parametrize("fn", ["logprobs", "ce_mean", "ce_none", "grpo"])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_autocast_bf16_matches_bf16_inputs(fn, backward_inside):
    """Before: crashed under torch.autocast ("Expected out tensor to have dtype BFloat16") and,
    with the backward outside autocast, the recompute path saw other dtypes than the forward.
    Now: fp32 inputs under bf16 autocast give exactly the op's result on bf16 inputs (as F.linear
    casts), gradients in fp32 for the fp32 leaves, within the bf16 tolerance of float64."""
    g = torch.Generator().manual_seed(3)
    h32 = torch.randn(6, 50, 32, generator=g)
    w32 = torch.randn(120, 32, generator=g) * 0.3
    y = torch.randint(0, 120, (6, 50), generator=g)
    y[:, ::9] = -100

    h, w = h32.clone().requires_grad_(), w32.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = autocast_loss(fn, h, w, y)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32

    hb, wb = h32.bfloat16().requires_grad_(), w32.bfloat16().requires_grad_()
    autocast_loss(fn, hb, wb, y).backward()
    assert torch.equal(h.grad, hb.grad.float()) and torch.equal(w.grad, wb.grad.float())

    hd, wd = h32.bfloat16().double().requires_grad_(), w32.bfloat16().double().requires_grad_()
    ref_loss = autocast_reference_loss(fn, hd, wd, y)
    ref_loss.backward()
    for name, out, ref in (("loss", loss, ref_loss), ("dX", h.grad, hd.grad), ("dW", w.grad, wd.grad)):
        err = reference.record(f"autocast {name}", 1, torch.bfloat16, _rel(out, ref))
        assert err <= BF16_TOL, f"{name}: {err:.2e}"


def test_autocast_main_grad_reaches_the_fp32_parameter():
    """accumulate_into_main_grad under autocast: dW is added in fp32 to the fp32 parameter's
    main_grad (not lost on the bf16 copy); autograd gets Megatron's dummy gradient."""
    g = torch.Generator().manual_seed(4)
    h32, w32 = torch.randn(40, 16, generator=g), torch.randn(24, 16, generator=g)
    y = torch.randint(0, 24, (40,), generator=g)
    expected = []
    for fn in ("ce_mean", "logprobs"):
        hb, wb = h32.bfloat16(), w32.bfloat16().requires_grad_()
        autocast_loss(fn, hb, wb, y).backward()
        expected.append(wb.grad.float())
    for fn, exp in zip(("ce_mean", "logprobs"), expected):
        w = w32.clone().requires_grad_()
        w.main_grad = torch.full((24, 16), 0.25)
        w.grad_added_to_main_grad = False
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = autocast_loss(fn, h32, w, y, accumulate_into_main_grad=True)
        loss.backward()
        assert w.grad_added_to_main_grad is True and w.grad.shape == w.shape
        assert _rel(w.main_grad - 0.25, exp) < 1e-2


def _autocast_tp_worker(rank, world, h32, w32, y, v_local):
    h = h32[rank * (h32.shape[0] // world):(rank + 1) * (h32.shape[0] // world)].clone().requires_grad_()
    w = w32[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y, tp_group=dist.group.WORLD, sequence_parallel=True,
                                    chunk_size=11, vocab_size=70)
        out = linear_logprobs(h, w, y, tp_group=dist.group.WORLD, sequence_parallel=True,
                              chunk_size=11, vocab_size=70, return_entropy=True)
    (loss + out.logprobs.sum() * 0.1 + out.entropy.sum() * 0.1).backward()
    return loss.detach(), h.grad, w.grad


def test_autocast_tp2_sequence_parallel():
    g = torch.Generator().manual_seed(5)
    v_local = 40
    h32 = torch.randn(12, 2, 16, generator=g)
    w32 = torch.randn(2 * v_local, 16, generator=g) * 0.4
    y = torch.randint(0, 70, (12, 2), generator=g)
    y[::5] = -100
    results = run_workers(_autocast_tp_worker, 2, h32, w32, y, v_local)
    hd, wd = h32.bfloat16().double().requires_grad_(), w32.bfloat16().double().requires_grad_()
    lp, ent, z = reference.dense_stats(hd, wd, y, vocab_size=70)
    ref_loss = F.cross_entropy(z, y.reshape(-1))
    (ref_loss + lp.sum() * 0.1 + ent.sum() * 0.1).backward()
    for rank, (loss, dx, dw) in enumerate(results):
        assert dx.dtype == torch.float32
        for name, out, ref in (("loss", loss, ref_loss), ("dX", dx, hd.grad[rank * 6:(rank + 1) * 6]),
                               ("dW", dw, wd.grad[rank * v_local:(rank + 1) * v_local])):
            err = reference.record(f"autocast {name}", 2, torch.bfloat16, _rel(out, ref))
            assert err <= BF16_TOL, f"rank {rank} {name}: {err:.2e}"


# ------------------------------------------------------------------ 8. entropy at large |z|


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("spread,temperature", [(50.0, 1.0), (50.0, 1e-3)], ids=["z50", "T1e-3"])
def test_entropy_precision_at_large_logits(tp, spread, temperature):
    """Before: entropy = lse - sum exp(z - m) z / S cancelled at |z| ~ 50 (7x a plain fp32
    computation's error) and its gradient used z - E (8-16x). Now: relative to the max / to lse."""
    case = entropy_case(7 + tp, spread, temperature, tp)
    check_entropy_precision(case, run_workers(entropy_worker, tp, case), "large |z|")


# ------------------------------------------------------------------ 9. logits_dtype=float32
def _logits_dtype_worker(rank, world, case, logits_dtype):
    hidden, weight = local_inputs(rank, case)
    group = dist.group.WORLD if world > 1 else None
    common = dict(tp_group=group, vocab_size=case["vocab"], temperature=case["T"], chunk_size=case["chunk_size"],
                  sequence_parallel=case["sp"], impl="torch", logits_dtype=logits_dtype)
    out = linear_logprobs(hidden, weight, case["labels"], return_entropy=True, **common)
    ((out.logprobs * case["grad_lp"]).sum() + (out.entropy * case["grad_ent"]).sum()).backward()
    lp_grads = (hidden.grad, weight.grad)
    hidden.grad = weight.grad = None
    loss = linear_cross_entropy(hidden, weight, case["labels"], label_smoothing=0.1, **common)
    (loss * 3.0).backward()
    return out.logprobs.detach(), out.entropy.detach(), lp_grads, loss.detach(), (hidden.grad, weight.grad)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_logits_are_closer_to_float64(tp):
    """logits_dtype=torch.float32 on bf16 inputs: log-probs, entropy and the loss at fp32 accuracy
    (1e-5 where bf16 logits give ~1e-3), gradients within the bf16 tolerance. The default (None)
    keeps bf16 logits, as before."""
    case = make_case(40 + tp, tp, dtype=torch.bfloat16, sp=tp > 1)
    ref_lp, ref_ent, ref_dx, ref_dw = reference_logprobs(case)
    ref_loss, ref_ce_dx, ref_ce_dw = reference_ce(case, "mean", 0.1, 0.0, torch.tensor(3.0))
    errors = {}
    for logits_dtype in (None, torch.float32):
        for rank, (lp, ent, (dx, dw), loss, (ce_dx, ce_dw)) in enumerate(
                run_workers(_logits_dtype_worker, tp, case, logits_dtype)):
            s = ref_dx.shape[0] // tp
            rows = slice(rank * s, (rank + 1) * s) if case["sp"] else slice(None)
            vs = slice(rank * case["v_local"], (rank + 1) * case["v_local"])
            for name, out, ref in (("logprobs", lp, ref_lp), ("entropy", ent, ref_ent), ("ce_loss", loss, ref_loss),
                                   ("dX", dx, ref_dx[rows]), ("dW", dw, ref_dw[vs]),
                                   ("ce_dX", ce_dx, ref_ce_dx[rows]), ("ce_dW", ce_dw, ref_ce_dw[vs])):
                key = (name, logits_dtype)
                errors[key] = max(errors.get(key, 0.0), _rel(out, ref))
    for name in ("logprobs", "entropy", "ce_loss"):
        reference.record(f"fp32 logits {name}", tp, torch.bfloat16, errors[(name, torch.float32)])
        assert errors[(name, torch.float32)] <= 1e-5, (name, errors[(name, torch.float32)])
        assert errors[(name, None)] > 10 * errors[(name, torch.float32)], (name, errors[(name, None)])
    for name in ("dX", "dW", "ce_dX", "ce_dW"):
        reference.record(f"fp32 logits {name}", tp, torch.bfloat16, errors[(name, torch.float32)])
        assert errors[(name, torch.float32)] <= BF16_TOL


def test_fp32_logits_reach_linear_grpo_loss():
    """linear_grpo_loss(logits_dtype=torch.float32) on bf16 inputs: the loss at fp32 accuracy against
    a float64 GRPO loss (bf16 logits: ~100x further), on both of its paths (gradients in the forward
    pass; no_grad through linear_logprobs), and its gradients equal to grpo_loss over
    linear_logprobs(logits_dtype=torch.float32) within the bf16 tolerance."""
    g = torch.Generator().manual_seed(11)
    b, t, hdim, v = 3, 9, 16, 50
    h = (torch.randn(b, t, hdim, generator=g) * 2).bfloat16()
    w = (torch.randn(v, hdim, generator=g) * 0.5).bfloat16()
    y = torch.randint(0, v, (b, t), generator=g)
    adv, mask = torch.randn(b, generator=g), (torch.rand(b, t, generator=g) > 0.2).float()
    config = GRPOConfig()
    lp64 = torch.log_softmax(h.double() @ w.double().t(), -1).gather(-1, y[..., None]).squeeze(-1)
    # off-policy: the ratio exp(lp - old) makes the loss value depend on the log-probs
    old = (lp64 + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)).float()
    ref_loss, _ = grpo_loss(lp64, adv.double(), mask.double(), config, old_logprobs=old.double())
    errors = {}
    for logits_dtype in (None, torch.float32):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, _ = linear_grpo_loss(hh, ww, y, adv, mask, config, old_logprobs=old, logits_dtype=logits_dtype)
        loss.backward()
        with torch.no_grad():
            no_grad_loss, _ = linear_grpo_loss(h, w, y, adv, mask, config, old_logprobs=old,
                                               logits_dtype=logits_dtype)
        errors[logits_dtype] = max(_rel(loss.detach(), ref_loss), _rel(no_grad_loss, ref_loss))
        if logits_dtype is not None:
            h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp = linear_logprobs(h2, w2, y, logits_dtype=logits_dtype).logprobs
            grpo_loss(lp, adv, mask, config, old_logprobs=old)[0].backward()
            assert _rel(hh.grad, h2.grad) <= BF16_TOL and _rel(ww.grad, w2.grad) <= BF16_TOL
    reference.record("fp32 logits linear_grpo loss", 1, torch.bfloat16, errors[torch.float32])
    assert errors[torch.float32] <= 1e-5, errors
    assert errors[None] > 10 * errors[torch.float32], errors


def test_fp32_logits_option_is_a_no_op_for_fp32_inputs():
    g = torch.Generator().manual_seed(6)
    h, w, y = torch.randn(30, 8, generator=g), torch.randn(16, 8, generator=g), torch.randint(0, 16, (30,), generator=g)
    a = linear_logprobs(h, w, y, return_entropy=True, chunk_size=7)
    b = linear_logprobs(h, w, y, return_entropy=True, chunk_size=7, logits_dtype=torch.float32)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)


# ------------------------------------------------------------------ 2. the agreement stays one collective
def _count_agreements_worker(rank, world):
    calls = []
    original = reductions.max_over_ranks

    def counting(values, group):
        calls.append((values.dtype, values.numel()))
        return original(values, group)

    reductions.max_over_ranks = counting
    try:
        torch.manual_seed(0)
        h = torch.randn(3, 4, 8, requires_grad=True)
        w = torch.randn(10, 8, requires_grad=True)
        y = torch.randint(0, 20, (6, 4))
        counts = []
        for call in (
            lambda: linear_logprobs(h, w, y, tp_group=dist.group.WORLD, sequence_parallel=True,
                                    return_entropy=True).logprobs.sum().backward(),
            lambda: linear_cross_entropy(h, w, y, tp_group=dist.group.WORLD, sequence_parallel=True,
                                         label_smoothing=0.1).backward(),
            lambda: linear_grpo_loss(h, w, y, torch.randn(4), torch.ones(4, 6), GRPOConfig(),
                                     tp_group=dist.group.WORLD, sequence_parallel=True,
                                     old_logprobs=-torch.rand(4, 6))[0].backward(),
        ):
            calls.clear()
            call()
            counts.append(list(calls))
        return counts
    finally:
        reductions.max_over_ranks = original


def test_agreement_is_one_small_collective_per_call():
    for counts in run_workers(_count_agreements_worker, 2):
        for fn, calls in zip(("logprobs", "cross_entropy", "grpo"), counts):  # forward + backward
            # linear_grpo_loss first agrees on its own loss inputs over TP and CP
            # (losses/context_parallel.agree_on_inputs): one more small vector
            assert len(calls) == (2 if fn == "grpo" else 1), (fn, calls)
            for dtype, numel in calls:
                assert dtype == torch.int64 and numel <= 96, (fn, calls)


def test_fingerprint_separates_what_counts_cannot():
    y = torch.tensor([5, 7, -100, 3, 3, 9])
    same = agreement.tensor_fingerprint(y.clone())
    assert torch.equal(agreement.tensor_fingerprint(y), same)
    variants = [y[[1, 0, 2, 3, 4, 5]], y.roll(1), torch.where(y == 5, 6, y), y[[0, 1, 2, 3, 5, 4]]]
    for other in variants:
        assert not torch.equal(agreement.tensor_fingerprint(other), same), other
    # floats by their bits, huge and negative integers without overflow
    x = torch.tensor([0.5, -0.0, 1e-30], dtype=torch.bfloat16)
    assert not torch.equal(agreement.tensor_fingerprint(x), agreement.tensor_fingerprint(x * 1.01))
    big = torch.tensor([2**62, -(2**63), 2**63 - 1])
    assert agreement.tensor_fingerprint(big).min() >= 0


def _fingerprint_by_definition(t):
    """tensor_fingerprint of an int64 tensor from its definition (the weights made for its size)."""
    bits = t.reshape(-1).cpu()
    bits = bits ^ (bits >> 31)
    weights = agreement._position_weights(bits.numel(), bits.device)
    return ((bits & agreement._MASK) * weights & agreement._MASK).sum(1)


def test_fingerprint_weight_tables_grow_and_none_is_dropped(monkeypatch):
    """The position weights come from a table per device that only grows (doubling) and is never
    freed: a call fingerprints tensors of several sizes (GRPO's advantages [B] and mask [B, T]),
    and a table dropped for another size could be memory a captured CUDA graph still reads. Every
    size reads the prefix of the last table: the same fingerprint as weights made for it alone."""
    monkeypatch.setattr(agreement, "_WEIGHT_TABLES", {})
    g = torch.Generator().manual_seed(0)
    for numel in (4, 1024, 4, 1500, 7, 3000, 1024):
        t = torch.randint(-(2**40), 2**40, (numel,), generator=g)
        assert torch.equal(agreement.tensor_fingerprint(t), _fingerprint_by_definition(t)), numel
    assert [table.shape[1] for table in agreement._WEIGHT_TABLES[torch.device("cpu")]] == [4, 1024, 2048, 4096]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture")
def test_fingerprint_weights_made_in_a_graph_capture_are_not_kept(monkeypatch):
    """A table first needed inside a CUDA graph capture is made by kernels that run only when the
    graph is replayed: kept, the next eager call (the rank check of a TP call, right after
    make_graphed_callables) read unwritten memory: NaN results and a false "ranks differ". Made
    in the graph and not kept, both give the fingerprint of the definition."""
    monkeypatch.setattr(agreement, "_WEIGHT_TABLES", {})
    small = torch.randint(0, 2**40, (16,), device="cuda")
    large = torch.randint(0, 2**40, (4096,), device="cuda")
    agreement.tensor_fingerprint(small)  # a table of 16, made eagerly
    torch.cuda.synchronize()
    gc.collect()  # earlier graphs freed now, not by a collection during the capture (docs/performance.md)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = agreement.tensor_fingerprint(large)
    assert [table.shape[1] for table in agreement._WEIGHT_TABLES[large.device]] == [16]
    eager = agreement.tensor_fingerprint(large)  # before any replay
    graph.replay()
    torch.cuda.synchronize()
    expected = _fingerprint_by_definition(large)
    assert torch.equal(eager.cpu(), expected) and torch.equal(captured.cpu(), expected)
