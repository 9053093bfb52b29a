"""Weight gradients stay exact whatever the upstream gradient g of the loss.

Megatron's default loss scaling (`calculate_per_token_loss=False`) divides each micro-batch's loss
by its token count and the number of micro-batches: g ~ 1e-5 at real sizes, different per
micro-batch. The gradients-in-forward losses (`linear_cross_entropy` "mean" / "sum",
`linear_grpo_loss`) make dW before g is known. Under gradient-accumulation fusion (`main_grad`)
they used to add 1 x dW in the forward and (g - 1) x dW in the backward: the difference of two
terms of the size of dW, which kept nothing of a g = 1e-5 gradient in bf16. Here, against float64:

* each micro-batch's contribution to `main_grad` for g from 1e-8 to 1e4, negative g, fp32 and
  bf16, both entry points, TP=1 and TP=2 with sequence parallelism over gloo, with the upstream
  gradient expected at forward time (Megatron's loss funcs) or not: fp32 within 1e-6 (`bound`),
  bf16 within 1.5x the error of the same op without `main_grad`;
* the other places that could form a gradient as a difference of large terms (sampler filters,
  lean mode, entropy, z-loss, label smoothing, the TP merge): the gradient at g equals g times the
  gradient at g = 1 to fp32 rounding, at g = 1e-8 and 1e4.
"""

import pytest
import torch

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, grpo_loss, linear_grpo_loss

N, HIDDEN, VOCAB, TRUE_VOCAB = 256, 64, 512, 500  # padded vocab
BATCH = 8
CHUNK = 96  # does not divide N: three chunks, the last one shorter
SCALES = (1.0, 1e-2, 1e-5)
EXTREME_SCALES = (1e-8, 1e4, -3e-3)
CONFIG = GRPOConfig(loss_type="dapo")
FP32_TOL = 1e-6
BF16_FACTOR = 1.5  # bf16: at most this times the error of the same op without main_grad


def bound(dtype, plain: float) -> float:
    """The error allowed to a main_grad path, `plain` being the same op's without main_grad. fp32:
    1e-6, or the op's own error where that is larger (GRPO's ratios exp(lp - old) carry the fp32
    rounding of log-probs of size ~10: ~1e-6 relative, with or without main_grad)."""
    if dtype == torch.float32:
        return max(FP32_TOL, 1.05 * plain)
    return BF16_FACTOR * plain


def make_case(seed, w=None):
    g = torch.Generator().manual_seed(seed)
    case = dict(
        h=torch.randn(N, HIDDEN, generator=g, dtype=torch.float64),
        w=torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.5 if w is None else w,
        y=torch.randint(0, TRUE_VOCAB, (N,), generator=g),
        adv=torch.randn(BATCH, generator=g, dtype=torch.float64),
        mask=(torch.rand(BATCH, N // BATCH, generator=g) > 0.2).double(),
    )
    case["y"][case["mask"].reshape(-1) == 0] = -100
    # old-policy log-probs near the policy's own, as after a few optimizer steps: ratios around 1
    logits = (case["h"] @ case["w"].t())[:, :TRUE_VOCAB]
    lp = torch.log_softmax(logits, -1).gather(1, case["y"].clamp(min=0)[:, None])[:, 0]
    case["old"] = (lp + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)).view(BATCH, -1)
    return case


def reference_dw(entry, case):
    """float64 dW (and dX) of the loss at g = 1: full logits, log_softmax over the true vocab."""
    h, w = case["h"].clone().requires_grad_(), case["w"].clone().requires_grad_()
    logits = (h @ w.t())[:, :TRUE_VOCAB]
    lp = torch.log_softmax(logits, -1).gather(1, case["y"].clamp(min=0)[:, None])[:, 0]
    if entry == "ce":
        loss = -(lp * (case["y"] != -100)).sum()
    else:
        loss = grpo_loss(lp.view(BATCH, -1), case["adv"], case["mask"], CONFIG, old_logprobs=case["old"])[0]
    loss.backward()
    return h.grad, w.grad


def fused(entry, case, h, w, target, g, tp_group=None, sp=False):
    """The fused loss on hidden [N, H] (or this rank's [N/TP, 1, H] slice with `sp`)."""
    kw = dict(tp_group=tp_group, vocab_size=TRUE_VOCAB, chunk_size=CHUNK, impl="torch", sequence_parallel=sp,
              accumulate_into_main_grad=target != "grad",
              expected_upstream_grad=g if target == "main_grad_expected" else None)
    if entry == "ce":
        labels = case["y"][:, None] if sp else case["y"]
        return linear_cross_entropy(h, w, labels, reduction="sum", **kw)
    labels = case["y"].clamp(min=0)
    if sp:  # sequence-first [T, B] layout; one long sequence per "batch" row is not needed here
        hb = h
        labels = labels.view(BATCH, -1).t().contiguous()
    else:
        hb = h.view(BATCH, -1, HIDDEN)
        labels = labels.view(BATCH, -1)
    return linear_grpo_loss(hb, w, labels, case["adv"].float(), case["mask"].float(), CONFIG,
                            old_logprobs=case["old"].float(), **kw)[0]


def leaves(h, w, dtype, target):
    h = h.to(dtype).clone().requires_grad_()
    w = w.to(dtype).clone().requires_grad_()
    if target != "grad":
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    return h, w


def micro_batch_dw(entry, case, dtype, target, g):
    """dW that one micro-batch with upstream gradient g adds to main_grad (or .grad), in fp32."""
    h, w = leaves(case["h"], case["w"], dtype, target)
    (fused(entry, case, h, w, target, g) * g).backward()
    return (w.grad if target == "grad" else w.main_grad).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_main_grad_exact_for_any_upstream_grad(entry, dtype):
    """Before: fp32 1.2e-2 and bf16 17 (CE) / 59 (GRPO) relative error at g = 1e-5."""
    case = make_case(seed=1)
    _, ref_dw = reference_dw(entry, case)
    for g in SCALES + EXTREME_SCALES:
        plain = reference.rel_err(micro_batch_dw(entry, case, dtype, "grad", g), g * ref_dw)
        for target in ("main_grad", "main_grad_expected"):
            err = reference.record(f"dW at g={g:g} {entry} {target}", 1, dtype,
                                   reference.rel_err(micro_batch_dw(entry, case, dtype, target, g), g * ref_dw))
            assert err <= bound(dtype, plain), (g, target, err, plain)


def test_micro_batches_with_different_upstream_grads_accumulate_exactly():
    """Four micro-batches into one main_grad, each with its own g (Megatron: its own token count)."""
    first = make_case(seed=10)
    cases = [first] + [make_case(seed=10 + i, w=first["w"]) for i in range(1, 4)]  # one weight
    scales = (1 / 1000, 1 / 37, 1e-6, 2.5)
    for entry in ("ce", "grpo"):
        expected = sum(g * reference_dw(entry, case)[1] for g, case in zip(scales, cases))
        errors = {}
        for target in ("grad", "main_grad", "main_grad_expected"):
            h, w = leaves(cases[0]["h"], cases[0]["w"], torch.float32, target)
            for g, case in zip(scales, cases):
                hc = case["h"].float().clone().requires_grad_()
                (fused(entry, case, hc, w, target, g) * g).backward()
            errors[target] = reference.rel_err(w.grad if target == "grad" else w.main_grad, expected)
        for target in ("main_grad", "main_grad_expected"):
            assert errors[target] <= bound(torch.float32, errors["grad"]), (entry, target, errors)


def test_a_new_expected_upstream_grad_needs_no_new_agreement(monkeypatch):
    """Megatron's g divides by each micro-batch's token count: the loss funcs pass a new
    `expected_upstream_grad` on every call. Its value is compared across ranks, not part of the
    call's signature: after a signature's first call, micro-batches with other g's run no
    agreement (before: one each, with its host synchronization), and main_grad stays exact
    (test_micro_batches_with_different_upstream_grads_accumulate_exactly)."""
    from megatron_fused_ce.ops import agreement

    runs = []
    original = agreement.Agreement.agree
    monkeypatch.setattr(agreement.Agreement, "agree", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    case = make_case(seed=20)
    for entry in ("ce", "grpo"):
        agreement.forget_signatures()
        runs.clear()
        _, w = leaves(case["h"], case["w"], torch.float32, "main_grad_expected")
        for g in (1 / 1000, 1 / 37, 1e-6, 2.5):
            h = case["h"].float().clone().requires_grad_()
            (fused(entry, case, h, w, "main_grad_expected", g) * g).backward()
        assert len(runs) == 1, (entry, len(runs))


def _differing_g_worker(rank, world):
    import torch.distributed as dist
    from megatron_fused_ce import check_deferred_errors

    case = make_case(seed=21)
    v_local = VOCAB // world
    _, w = leaves(case["h"], case["w"][rank * v_local:(rank + 1) * v_local], torch.float32, "main_grad_expected")
    for g in (0.1, 0.2 if rank == 0 else 0.3):  # the signature's first call, then g differing on one rank
        h = case["h"].float().clone().requires_grad_()
        loss = fused("ce", case, h, w, "main_grad_expected", g, dist.group.WORLD)
        (loss * g).backward()
    try:
        check_deferred_errors()
        return bool(torch.isnan(loss)), None
    except ValueError as error:
        return bool(torch.isnan(loss)), str(error)


def test_an_expected_upstream_grad_that_differs_across_ranks_is_caught():
    """A later call whose expected g differs on one rank (its value rides on the rank check, not
    on a new agreement): NaN and the same error on every rank, no hang."""
    for nan, raised in run_workers(_differing_g_worker, 2):
        assert nan
        assert raised is not None and "differ across tensor-parallel ranks" in raised, raised


# ------------------------------------------------------------------ TP=2, sequence parallelism
def _tp_worker(rank, world, case, entry, dtype):
    import torch.distributed as dist

    v_local = VOCAB // world
    h_slice = case["h"][rank * N // world:(rank + 1) * N // world].unsqueeze(1)  # [N/TP, 1, H]
    if entry == "grpo":  # [T/TP, B, H]: sequence-first, this rank's slice of every sequence
        t = N // BATCH
        h_slice = case["h"].view(BATCH, t, HIDDEN).transpose(0, 1)[rank * t // world:(rank + 1) * t // world]
    w_shard = case["w"][rank * v_local:(rank + 1) * v_local]
    out = {}
    for g in SCALES:
        for target in ("grad", "main_grad", "main_grad_expected"):
            h, w = leaves(h_slice, w_shard, dtype, target)
            (fused(entry, case, h, w, target, g, dist.group.WORLD, sp=True) * g).backward()
            out[(g, target)] = (w.grad if target == "grad" else w.main_grad).float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_main_grad_exact_for_any_upstream_grad_tp2_sequence_parallel(entry, dtype):
    case = make_case(seed=2)
    _, ref_dw = reference_dw(entry, case)
    results = run_workers(_tp_worker, 2, case, entry, dtype)
    v_local = VOCAB // 2
    for rank, out in enumerate(results):
        ref = ref_dw[rank * v_local:(rank + 1) * v_local]
        for g in SCALES:
            plain = reference.rel_err(out[(g, "grad")], g * ref)
            for target in ("main_grad", "main_grad_expected"):
                err = reference.record(f"dW at g={g:g} {entry} {target}", 2, dtype,
                                       reference.rel_err(out[(g, target)], g * ref))
                assert err <= bound(dtype, plain), (rank, g, target, err, plain)


# ---------------------------------------------- the other gradients: scale-invariant at extremes
def _grads_at(loss_fn, case, g, main_grad=False):
    h = case["h"].float().clone().requires_grad_()
    w = case["w"].float().clone().requires_grad_()
    if main_grad:
        w.main_grad = torch.zeros(w.shape)
    (loss_fn(h, w) * g).backward()
    return h.grad, (w.main_grad if main_grad else w.grad)


def _sampled_logprobs_loss(**sampler):
    def loss(h, w, case):
        lp = linear_logprobs(h, w, case["y"], vocab_size=TRUE_VOCAB, chunk_size=CHUNK, impl="torch",
                             temperature=0.7, **sampler).logprobs
        return -torch.where(torch.isfinite(lp), lp, 0.0).sum()
    return loss


AUDITED = {
    "sampler top_p": (_sampled_logprobs_loss(top_p=0.8), False),
    "sampler top_k + min_p": (_sampled_logprobs_loss(top_k=40, min_p=0.05), False),
    "lean CE + main_grad": (lambda h, w, case: linear_cross_entropy(
        h, w, case["y"], vocab_size=TRUE_VOCAB, impl="torch", memory_mode="lean", reduction="sum",
        accumulate_into_main_grad=True), True),
    "entropy": (lambda h, w, case: linear_logprobs(
        h, w, case["y"], vocab_size=TRUE_VOCAB, chunk_size=CHUNK, impl="torch",
        return_entropy=True).entropy.sum(), False),
    "z-loss + label smoothing": (lambda h, w, case: linear_cross_entropy(
        h, w, case["y"], vocab_size=TRUE_VOCAB, chunk_size=CHUNK, impl="torch", reduction="sum",
        label_smoothing=0.1, z_loss_weight=1e-3), False),
    "z-loss + label smoothing + main_grad": (lambda h, w, case: linear_cross_entropy(
        h, w, case["y"], vocab_size=TRUE_VOCAB, chunk_size=CHUNK, impl="torch", reduction="sum",
        label_smoothing=0.1, z_loss_weight=1e-3, accumulate_into_main_grad=True), True),
}


@pytest.mark.parametrize("name", list(AUDITED))
def test_gradients_scale_with_the_upstream_grad_at_extremes(name):
    """g x (gradient at g = 1) == gradient at g, to fp32 rounding, for g = 1e-8 and 1e4: a
    gradient formed anywhere as a difference of large terms would fail this at one end."""
    loss_fn, main_grad = AUDITED[name]
    case = make_case(seed=3)
    case["h"] = case["h"] * 3  # peaked rows: large |z|, where cancellation would show first
    dx1, dw1 = _grads_at(lambda h, w: loss_fn(h, w, case), case, 1.0, main_grad)
    for g in (1e-8, 1e4):
        dx, dw = _grads_at(lambda h, w: loss_fn(h, w, case), case, g, main_grad)
        assert reference.rel_err(dx, g * dx1) <= 1e-6, (name, g, "dX")
        assert reference.rel_err(dw, g * dw1) <= 1e-6, (name, g, "dW")


def _tp_merge_worker(rank, world, case):
    import torch.distributed as dist

    v_local = VOCAB // world
    out = {}
    for g in (1.0, 1e-8, 1e4):
        h = case["h"].float().clone().requires_grad_()
        w = case["w"][rank * v_local:(rank + 1) * v_local].float().clone().requires_grad_()
        res = linear_logprobs(h, w, case["y"], tp_group=dist.group.WORLD, vocab_size=TRUE_VOCAB,
                              chunk_size=CHUNK, impl="torch", return_entropy=True)
        ((res.logprobs.sum() + 0.3 * res.entropy.sum()) * g).backward()
        out[g] = (h.grad, w.grad)
    return out


def test_tp_merge_gradients_scale_with_the_upstream_grad():
    """The TP merge (max / sum-exp over ranks) of log-probs and entropy at TP=2, g = 1e-8 and 1e4."""
    case = make_case(seed=4)
    case["h"] = case["h"] * 3
    for out in run_workers(_tp_merge_worker, 2, case):
        for g in (1e-8, 1e4):
            for got, unit in zip(out[g], out[1.0]):
                assert reference.rel_err(got, g * unit) <= 1e-6, g


def test_main_grad_loss_scale_tool_smoke():
    """tools/main_grad_loss_scale.py (the table of docs/benchmarks.md) on tiny CPU shapes: every
    column at fp32 rounding, at a g where the old (g - 1) x dW correction lost 1e-2."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "tools", "main_grad_loss_scale.py")
    spec = importlib.util.spec_from_file_location("main_grad_loss_scale", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tool.table((64, 16, 96), torch.float32, torch.device("cpu"), [1e-5], impl="torch")
    assert set(out) == {("ce", 1e-5), ("grpo", 1e-5)}
    for errors in out.values():
        assert set(errors) == set(tool.TARGETS)
        assert max(errors.values()) < 1e-6, errors
