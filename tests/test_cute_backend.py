"""QuACK's one-pass cross-entropy row kernel (ops/cute_backend.py) inside the chunk loop.

On CPU the kernel is replaced by `cute_backend.reference_kernel` (QuACK's contract in torch), so
that what the chunk loop does around it is checked against the float64 dense reference: dlogits
= softmax - one_hot scaled by the GEMMs' alpha (1/labelled tokens or 1), the statistics rebuilt
from (loss, lse), the offsets saved for a second backward, and
where the kernel must not be used (smoothing, z-loss, temperature, vocab padding, TP > 1,
log-probs, lean mode, an explicit impl). On a Hopper GPU with QuACK installed the last test runs
QuACK's kernel itself.
"""

import dataclasses

import pytest
import torch

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.ops import agreement, remembered_routes
from megatron_fused_ce.ops.backends import cute_backend
from op_cases import TOL, make_case, reference_ce
from route_checks import count_general_calls, routed_equals_general


@pytest.fixture(autouse=True)
def every_chunk_worth_launching(monkeypatch):
    """The tests' chunks hold far less work than cute_backend.MIN_CHUNK_WORK: QuACK's kernels are
    taken at every size here, except where a test sets the threshold itself."""
    monkeypatch.setattr(cute_backend, "MIN_CHUNK_WORK", 0)


def _case(seed, **kwargs):
    # vocab a multiple of 8 and no padding rows: the kernel's conditions at TP = 1
    return make_case(seed, 1, dtype=torch.bfloat16, seq=23, batch=3, hidden=32, vocab=104, extra_pad=0,
                     temperature=1.0, **kwargs)


def _leaves(case, main_grad, device=None, train_weight=True):
    """Fresh hidden / weight leaves (on `device`, else the case's); with `main_grad`, Megatron's fp32
    main_grad at 0.25."""
    device = device or case["hidden"].device
    h = case["hidden"].detach().clone().to(device).requires_grad_()
    w = case["weight"].detach().clone().to(device).requires_grad_(train_weight)
    if main_grad:
        w.main_grad = torch.full(w.shape, 0.25, device=device)
        w.grad_added_to_main_grad = False
    return h, w


def _backward(loss, h, w, upstream, main_grad, retain):
    """(dX, dW) of upstream * loss; with `retain`, those of a second backward through the retained
    graph, which recomputes them from the saved coefficients and offsets."""
    (loss * upstream).backward(retain_graph=retain)
    if retain:
        h.grad = w.grad = None
        if main_grad:
            w.main_grad.fill_(0.25)
        (loss * upstream).backward()
    return h.grad, (w.main_grad - 0.25 if main_grad else w.grad)


def _run_ce(case, *, reduction="mean", upstream=3.5, main_grad=False, retain=False, **kwargs):
    h, w = _leaves(case, main_grad)
    loss = linear_cross_entropy(h, w, case["labels"], vocab_size=case["vocab"], reduction=reduction,
                                temperature=case["T"], chunk_size=case["chunk_size"],
                                accumulate_into_main_grad=main_grad, **kwargs)
    return (loss.detach(),) + _backward(loss, h, w, upstream, main_grad, retain)


def _check(case, got, reduction, upstream, what, row=None):
    """Loss, dX, dW against float64; `row`: the summary table's row (only where QuACK's own
    kernels ran: a torch stand-in of them is no QuACK result)."""
    ref = reference_ce(case, reduction, 0.0, 0.0, torch.tensor(upstream))
    for name, out, expected in zip(("loss", "dX", "dW"), got, ref):
        err = reference.rel_err(out, expected)
        if row is not None:
            reference.record(f"{row} ce_{name}", 1, case["dtype"], err)
        assert err <= TOL[case["dtype"]], f"{what} {name}: {err:.2e}"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("retain", [False, True])
def test_one_pass_matches_float64_reference(reference_kernel, reduction, main_grad, retain):
    """Ignored tokens, chunks of 7 rows (not dividing the rows), an upstream gradient
    != 1, Megatron's main_grad (dW summed in fp32 until the backward adds g x dW) and a second
    backward through a retained graph (recomputed from the saved offsets)."""
    case = _case(5)
    got = _run_ce(case, reduction=reduction, main_grad=main_grad, retain=retain)
    rows = case["labels"].numel()  # ignored rows go through the loop too, with a zero gradient
    assert reference_kernel == [7] * (rows // 7) + ([rows % 7] if rows % 7 else [])
    _check(case, got, reduction, 3.5, f"{reduction} main_grad={main_grad} retain={retain}")


def test_one_pass_equals_two_passes(reference_kernel):
    """The same loss and gradients as the statistics + dlogits path (impl="torch"), within bf16
    rounding of dlogits: the kernel changes where dlogits come from, not what they are."""
    case = _case(9)
    one_pass = _run_ce(case, upstream=1.0)
    calls = len(reference_kernel)
    assert calls > 0
    two_pass = _run_ce(case, upstream=1.0, impl="torch")
    assert len(reference_kernel) == calls  # not called by impl="torch"
    torch.testing.assert_close(one_pass[0], two_pass[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(one_pass[1:], two_pass[1:]):
        assert reference.rel_err(a, b) < 1e-2


@pytest.mark.parametrize("change", ["label_smoothing", "z_loss", "temperature", "padded_vocab", "lean",
                                    "logprobs", "impl_torch", "fp32", "switched_off"])
def test_one_pass_not_taken_where_it_does_not_apply(reference_kernel, monkeypatch, change):
    """Where the per-token gradient is not c (softmax - one_hot) on whole unpadded bf16 rows at
    temperature 1, another path was asked for, or MEGATRON_FUSED_CE_CUTE=0 switched it off, the
    kernel is not called."""
    case = _case(13)
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    args = dict(vocab_size=case["vocab"], chunk_size=7)
    if change == "label_smoothing":
        args["label_smoothing"] = 0.1
    elif change == "z_loss":
        args["z_loss_weight"] = 1e-3
    elif change == "temperature":
        args["temperature"] = 0.7
    elif change == "padded_vocab":
        args["vocab_size"] = case["vocab"] - 3
        labels = case["labels"].clamp(max=case["vocab"] - 4)
    elif change == "lean":
        args["memory_mode"] = "lean"
    elif change == "impl_torch":
        args["impl"] = "torch"
    elif change == "fp32":
        h, w = (t.detach().float().requires_grad_() for t in (h, w))
    elif change == "switched_off":
        monkeypatch.setattr(cute_backend, "ENABLED", False)
    labels = labels if change == "padded_vocab" else case["labels"]
    if change == "logprobs":
        linear_logprobs(h, w, labels, **args).logprobs.sum().backward()
    else:
        linear_cross_entropy(h, w, labels, **args).backward()
    assert reference_kernel == []


@pytest.mark.parametrize("target", ["grad", "main_grad", "main_grad_expected"])
def test_one_pass_under_every_forward_backward_pairing(reference_kernel, target):
    """The pairings of test_forward_backward_pairing (activation checkpointing both ways, a second
    backward, the loss used twice, changing and Megatron-sized loss scales) with the one-pass
    kernel: dX and dW stay the float64 reference's multiple; a forward freed without backward
    that added into main_grad poisons it and the next call raises, as on the two-pass path."""
    import warnings

    from op_cases import SCENARIOS

    main_grad = target != "grad"

    case = _case(31)
    ref_loss, ref_dx, ref_dw = reference_ce(case, "mean", 0.0, 0.0, torch.tensor(1.0))

    def leaves():
        h = case["hidden"].clone().requires_grad_()
        w = case["weight"].clone().requires_grad_()
        if main_grad:
            w.main_grad = torch.zeros(w.shape)
            w.grad_added_to_main_grad = False
        return h, w

    def loss_fn(h, w, g=1.0):
        return linear_cross_entropy(h, w, case["labels"], vocab_size=case["vocab"], chunk_size=7,
                                    accumulate_into_main_grad=main_grad,
                                    expected_upstream_grad=g if target == "main_grad_expected" else None)

    for scenario in SCENARIOS:
        h, w = leaves()
        loss, scale = scenario(loss_fn, h, w)
        dw = w.main_grad if main_grad else w.grad
        assert reference.rel_err(loss, ref_loss) < TOL[case["dtype"]], scenario.__name__
        assert reference.rel_err(h.grad, scale * ref_dx) < TOL[case["dtype"]], scenario.__name__
        assert reference.rel_err(dw, scale * ref_dw) < TOL[case["dtype"]], scenario.__name__
    assert reference_kernel
    if target == "main_grad_expected":
        h, w = leaves()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(h, w)  # graph freed without a backward
        assert torch.isnan(w.main_grad).all()
        with pytest.raises(ValueError, match="never backpropagated"):
            loss_fn(h, w)


def _run_grpo(case, *, upstream=2.5, main_grad=False, retain=False, device="cpu", train_weight=True, **kwargs):
    """linear_grpo_loss (token-level ratios against old log-probs 0.1 * w away, per-token
    advantages: clipped and unclipped tokens) and its float64 reference: grpo_loss on the dense
    log-probs. Returns ((loss, dX, dW), (reference loss, dX, dW)); dW is None for a frozen weight."""
    from megatron_fused_ce.losses import GRPOConfig, grpo_loss
    from megatron_fused_ce.losses.linear_grpo import linear_grpo_loss

    g = torch.Generator().manual_seed(1)
    token_weight = torch.randn(case["labels"].shape, generator=g, dtype=torch.float64)
    mask = (case["labels"] != -100).double()
    labels = case["labels"].clamp(min=0)  # GRPO masks by `mask`
    h64 = case["hidden"].double().requires_grad_()
    w64 = case["weight"].double().requires_grad_()
    ref_lp, _, _ = reference.dense_stats(h64, w64, labels, vocab_size=case["vocab"], temperature=case["T"])
    ref_lp = ref_lp.reshape(labels.shape)
    old = ref_lp.detach() + 0.1 * token_weight
    ref_loss, _ = grpo_loss(ref_lp, token_weight, mask, GRPOConfig(), old_logprobs=old)
    (upstream * ref_loss).backward()

    h, w = _leaves(case, main_grad, device, train_weight)
    args = [t.to(device) for t in (labels, token_weight.float(), mask.float())]
    loss, _ = linear_grpo_loss(h, w, *args, GRPOConfig(), old_logprobs=old.float().to(device),
                               vocab_size=case["vocab"], chunk_size=case["chunk_size"],
                               accumulate_into_main_grad=main_grad, **kwargs)
    got = (loss,) + _backward(loss, h, w, upstream, main_grad, retain)
    return tuple(None if t is None else t.detach().cpu() for t in got), (ref_loss, h64.grad, w64.grad)


@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("retain", [False, True])
def test_one_pass_with_a_factor_per_token_matches_float64(reference_kernel, main_grad, retain):
    """GRPO's per-token gradient is c_i (softmax - one_hot) with c_i = -dloss/dlogp_i: the kernel's
    softmax - one_hot, dX scaled per row after its GEMM and dW from the scaled hidden rows give the
    float64 reference's loss, dX and dW (chunks of 7, masked tokens, an upstream gradient != 1,
    main_grad, a second backward)."""
    case = _case(37)
    got, ref = _run_grpo(case, main_grad=main_grad, retain=retain)
    rows = case["labels"].numel()  # ignored rows go through the loop too, with a zero gradient
    assert reference_kernel == [7] * (rows // 7) + ([rows % 7] if rows % 7 else [])
    for name, out, expected in zip(("loss", "dX", "dW"), got, ref):
        err = reference.rel_err(out, expected)
        assert err <= TOL[torch.bfloat16], f"GRPO main_grad={main_grad} retain={retain} {name}: {err:.2e}"


def test_one_pass_with_a_factor_per_token_and_a_frozen_weight(reference_kernel):
    """A frozen output weight (adapters trained, the vocab projection not): only dX is made, and it
    matches the float64 reference's."""
    got, ref = _run_grpo(_case(43), train_weight=False)
    assert reference_kernel
    assert reference.rel_err(got[1], ref[1]) <= TOL[torch.bfloat16]


def test_one_pass_with_a_factor_per_token_equals_two_passes(reference_kernel):
    """The same GRPO loss and gradients as the statistics + dlogits path (impl="torch"), within bf16
    rounding: a wrong factor (its sign, the row it goes to) is far outside that."""
    case = _case(41)
    one_pass, _ = _run_grpo(case)
    assert reference_kernel
    two_pass, _ = _run_grpo(case, impl="torch")
    torch.testing.assert_close(one_pass[0], two_pass[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(one_pass[1:], two_pass[1:]):
        assert reference.rel_err(a, b) < 1e-2


def test_ignored_rows_reach_the_kernel_as_its_ignore_index(monkeypatch):
    """Rows of ignored labels stay in a later call's chunk (their factor 0): the row kernel is called
    with the label kernel's target of such a row as its ignore_index, so that QuACK's kernel reads
    no target logit there (at index -1 it read before the chunk: an illegal address on the GPU
    where the chunk starts an allocation) and gives them zero dlogits and loss 0; the loss and
    gradients stay the float64 reference's."""
    seen = []

    def kernel(x, target, target_logit, loss, lse, dx, weight, ignore_index=-100):
        seen.append((target.clone(), ignore_index))
        cute_backend.reference_kernel(x, target, target_logit, loss, lse, dx, weight, ignore_index)
        ignored = target == ignore_index
        assert (dx[ignored] == 0).all() and (loss[ignored] == 0).all()

    monkeypatch.setattr(cute_backend, "_kernel", lambda: kernel)
    monkeypatch.setattr(cute_backend, "_available", lambda device: True)
    case = dict(_case(67), chunk_size=None)
    labels = case["labels"].reshape(-1)
    assert (labels == -100).any()
    for _ in range(3):  # the later calls keep every row
        got = _run_ce(case)
    target, ignore_index = seen[-1]
    assert target.numel() == labels.numel()
    assert ((target == ignore_index) == (labels == -100)).all()
    _check(case, got, "mean", 3.5, "ignored rows in the chunk")


ROUTE_CASES = ["ce mean", "ce sum", "grpo", "ce mean, second backward", "grpo, second backward"]


def _route_equals_general_path(monkeypatch, case, loss, kernel_rows, device="cpu"):
    """route_checks.routed_equals_general for a loss on the row kernel: the routed call's loss, dX
    and dW are the general path's bit for bit, each routed call calls the kernel once over the
    chunk (the third, the route, too: `kernel_rows` the row counts of its calls), the route taken
    is the row kernel's; then, the kernel switched off, a call does not take that route."""
    import sys

    module = sys.modules["megatron_fused_ce.losses.linear_grpo" if loss.startswith("grpo")
                         else "megatron_fused_ce.losses.linear_cross_entropy"]
    general = count_general_calls(monkeypatch, module)
    retain = loss.endswith("second backward")

    def call():
        if loss.startswith("grpo"):
            return _run_grpo(case, retain=retain, device=device)[0]
        return _run_ce(case, reduction=loss.split()[1].rstrip(","), retain=retain)

    agreement.forget_signatures()
    before = len(kernel_rows) + 3  # (the general path's three calls)
    routed_equals_general(monkeypatch, call, general, ("loss", "dX", "dW"), loss)
    assert kernel_rows[before:] == [case["labels"].numel()] * 3
    assert next(reversed(remembered_routes._ROUTES.values())).row_kernel
    monkeypatch.setattr(cute_backend, "ENABLED", False)
    general.clear()
    call()
    assert len(general) == 1 and len(kernel_rows) == before + 3
    agreement.forget_signatures()


@pytest.mark.parametrize("loss", ROUTE_CASES)
def test_one_pass_on_the_remembered_route_equals_the_general_path(reference_kernel, monkeypatch, loss):
    """A remembered signature's route (ops/remembered_routes.py) takes the row kernel where the
    general path takes it (one chunk, a count on the device: a factor per row in the dX and dW
    GEMMs, ignored rows at zero) and gives its loss, dX and dW bit for bit, those of a second
    backward through the retained graph too (recomputed from the saved offsets and coefficients);
    with the kernel switched off the recorded route is not taken (_route_equals_general_path)."""
    _route_equals_general_path(monkeypatch, dict(_case(61), chunk_size=None), loss, reference_kernel)


def _grpo_cp_data():
    """[B, T] = [3, 8] bf16 GRPO inputs (unpadded vocab 104, temperature 1: the kernel's conditions),
    masked tokens, per-sequence advantages, old log-probs near the policy's."""
    g = torch.Generator().manual_seed(53)
    hidden = torch.randn(3, 8, 32, generator=g).bfloat16()
    weight = (torch.randn(104, 32, generator=g) * 2.0 / 32**0.5).bfloat16()
    labels = torch.randint(0, 104, (3, 8), generator=g)
    mask = (torch.rand(3, 8, generator=g) > 0.25).float()
    advantages = torch.randn(3, generator=g)
    lp64, _, _ = reference.dense_stats(hidden.double(), weight.double(), labels, vocab_size=104, temperature=1.0)
    old = lp64.reshape(3, 8) + 0.1 * torch.randn(3, 8, generator=g, dtype=torch.float64)
    return hidden, weight, labels, mask, advantages, old


def _cp2_grpo_worker(rank, world):
    import torch.distributed as dist

    from megatron_fused_ce.losses import GRPOConfig
    from megatron_fused_ce.losses.linear_grpo import linear_grpo_loss
    from megatron_fused_ce.ops.backends import cute_backend as cb

    calls = []
    cb._available = lambda device: True
    cb._kernel = lambda: calls.append(1) or cb.reference_kernel
    hidden, weight, labels, mask, advantages, old = _grpo_cp_data()
    index = _CP2_POSITIONS[rank]
    h = hidden[:, index].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss, _ = linear_grpo_loss(h, w, labels[:, index], advantages, mask[:, index], GRPOConfig(),
                               old_logprobs=old[:, index].float(), cp_group=dist.group.WORLD, chunk_size=5)
    (2.5 * loss).backward()
    return loss.detach(), h.grad, w.grad, len(calls)


_CP2_POSITIONS = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]  # Megatron's balanced split


def test_one_pass_with_a_factor_per_token_under_context_parallelism():
    """GRPO at CP = 2 with the kernel on each rank's slice of every sequence (the batch totals summed
    over CP before the chunk loop): each rank's loss is the float64 CP=1 loss, its dX the CP=1 dX at
    its positions, and the ranks' dW add up to the CP=1 dW."""
    from megatron_fused_ce.losses import GRPOConfig, grpo_loss

    hidden, weight, labels, mask, advantages, old = _grpo_cp_data()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, _, _ = reference.dense_stats(h64, w64, labels, vocab_size=104, temperature=1.0)
    ref_loss, _ = grpo_loss(lp.reshape(3, 8), advantages.double(), mask.double(), GRPOConfig(), old_logprobs=old)
    (2.5 * ref_loss).backward()
    results = run_workers(_cp2_grpo_worker, 2)
    for rank, (loss, dx, dw, calls) in enumerate(results):
        assert calls > 0, rank
        assert reference.rel_err(loss, ref_loss) <= TOL[torch.bfloat16], rank
        assert reference.rel_err(dx, h64.grad[:, _CP2_POSITIONS[rank]]) <= TOL[torch.bfloat16], rank
    assert reference.rel_err(results[0][2].double() + results[1][2].double(), w64.grad) <= TOL[torch.bfloat16]


def _tp2_worker(rank, world, case):
    import torch.distributed as dist

    from megatron_fused_ce.ops.backends import cute_backend as cb

    calls = []
    cb._available = lambda device: True
    cb._kernel = lambda: calls.append(1) or cb.reference_kernel
    v_local = case["v_local"]
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    linear_cross_entropy(h, w, case["labels"], tp_group=dist.group.WORLD, vocab_size=case["vocab"],
                         chunk_size=7).backward()
    return len(calls)


def test_one_pass_not_taken_under_tensor_parallelism():
    """At TP = 2 a shard holds half of each row: the statistics must be merged before dlogits."""
    case = make_case(17, 2, dtype=torch.bfloat16, seq=12, batch=2, hidden=16, vocab=96, extra_pad=0,
                     temperature=1.0)
    assert run_workers(_tp2_worker, 2, case) == [0, 0]


def test_without_quack_or_a_hopper_gpu_nothing_changes():
    """Where QuACK does not import (CPU CI) or the device is not SM90/SM100, `supported` is False
    and the chunk loop keeps the statistics + dlogits kernels."""
    assert not cute_backend.supported(torch.bfloat16, 64, 1024, 1024, 1.0, torch.device("cpu"), 4096)
    assert not cute_backend.supported(torch.float32, 64, 1024, 1024, 1.0, torch.device("cpu"), 4096)


def test_chunks_of_2_to_the_31_elements_keep_the_triton_kernels(reference_kernel):
    """A chunk of 2^31 or more logits (an explicit chunk_size or max_chunk_bytes above the default
    1 GiB) is not handed to QuACK's kernel: its indexing is not known to be 64-bit."""
    cpu = torch.device("cpu")
    assert cute_backend.supported(torch.bfloat16, 16383, 131072, 131072, 1.0, cpu, 4096)
    assert not cute_backend.supported(torch.bfloat16, 16384, 131072, 131072, 1.0, cpu, 4096)
    assert not cute_backend.supported(torch.bfloat16, 16384, 152064, 152064, 1.0, cpu, 4096)


def test_chunks_below_the_work_threshold_keep_the_triton_kernels_and_cublas(reference_kernel, reference_gemms,
                                                                           monkeypatch):
    """QuACK's row kernel and dW GEMM run only for chunks of at least MIN_CHUNK_WORK multiply-adds
    (rows x vocab x hidden): below it their launches' host time would set a small call's time.
    Chunks of 7 rows of 104 x 32: with the threshold one above a chunk's work neither runs; at it
    both do, but the last chunk's dW GEMM (6 rows, less work) runs on cuBLAS, added to the fp32 sum
    of the others and cast. Loss, dX and dW the float64 reference's either way."""
    case = _case(41)
    rows, vocab, hidden = case["labels"].numel(), case["weight"].shape[0], case["hidden"].shape[-1]
    assert case["chunk_size"] == 7 and rows % 7 == 6
    chunk_work = 7 * vocab * hidden
    monkeypatch.setattr(cute_backend, "MIN_CHUNK_WORK", chunk_work + 1)
    _check(case, _run_ce(case), "mean", 3.5, "below the threshold")
    assert reference_kernel == [] and reference_gemms == []
    monkeypatch.setattr(cute_backend, "MIN_CHUNK_WORK", chunk_work)
    _check(case, _run_ce(case), "mean", 3.5, "at the threshold")
    assert reference_kernel == [7] * (rows // 7) + [6]
    assert len(reference_gemms) == rows // 7 and all(kind != "add_cast" for _, kind in reference_gemms)


def _quack_on_this_gpu() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)
            and cute_backend._kernel() is not None)


@pytest.mark.skipif(not _quack_on_this_gpu(), reason="QuACK's kernel runs on an SM90/SM100 GPU with quack-kernels")
@pytest.mark.parametrize("main_grad", [False, True])
def test_quack_kernel_on_gpu_matches_float64(monkeypatch, main_grad):
    """QuACK's own kernel on the GPU, vocab 50304 (a column count its clusters split), 1037 labelled
    rows in chunks of 300: loss, dX and dW against the float64 dense reference, and the kernel
    was called (the Triton kernels were not)."""
    case = make_case(23, 1, dtype=torch.bfloat16, seq=61, batch=17, hidden=64, vocab=50304, extra_pad=0,
                     temperature=1.0, chunk_size=300)
    gpu = dict(case, hidden=case["hidden"].cuda(), weight=case["weight"].cuda(), labels=case["labels"].cuda())
    kernel = cute_backend._kernel()
    calls = []
    monkeypatch.setattr(cute_backend, "_kernel", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k))
    got = _run_ce(gpu, main_grad=main_grad)
    assert calls
    _check(case, tuple(t.cpu() for t in got), "mean", 3.5, f"QuACK main_grad={main_grad}",
           row="QuACK row kernel (GPU)")


@pytest.mark.skipif(not _quack_on_this_gpu(), reason="QuACK's kernel runs on an SM90/SM100 GPU with quack-kernels")
@pytest.mark.parametrize("loss", ROUTE_CASES)
def test_quack_kernel_on_the_remembered_route_on_gpu(monkeypatch, loss):
    """QuACK's own kernel on the remembered route (vocab 16384, 1037 rows in one chunk, ignored
    labels): the route's loss, dX and dW are the general path's bit for bit
    (_route_equals_general_path)."""
    case = make_case(29, 1, dtype=torch.bfloat16, seq=61, batch=17, hidden=64, vocab=16384, extra_pad=0,
                     temperature=1.0, chunk_size=None)
    if not loss.startswith("grpo"):  # (GRPO's helper moves its leaves itself, its reference on CPU)
        case = dict(case, hidden=case["hidden"].cuda(), weight=case["weight"].cuda(), labels=case["labels"].cuda())
    kernel = cute_backend._kernel()
    rows = []
    monkeypatch.setattr(cute_backend, "_kernel", lambda: lambda x, *a, **k: rows.append(x.shape[0]) or kernel(x, *a, **k))
    _route_equals_general_path(monkeypatch, case, loss, rows, device="cuda")


@pytest.mark.skipif(not _quack_on_this_gpu(), reason="QuACK's kernel runs on an SM90/SM100 GPU with quack-kernels")
def test_quack_kernel_on_gpu_with_a_factor_per_token_matches_float64(monkeypatch):
    """GRPO through QuACK's kernel on the GPU (vocab 50304, chunks of 300): loss, dX and dW against
    the float64 reference, and the kernel was called."""
    case = make_case(47, 1, dtype=torch.bfloat16, seq=61, batch=17, hidden=64, vocab=50304, extra_pad=0,
                     temperature=1.0, chunk_size=300)
    kernel = cute_backend._kernel()
    calls = []
    monkeypatch.setattr(cute_backend, "_kernel", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k))
    got, ref = _run_grpo(case, device="cuda")
    assert calls
    for name, out, expected in zip(("loss", "dX", "dW"), got, ref):
        assert reference.rel_err(out, expected) <= TOL[torch.bfloat16], name


# --------------------------------------------------------------------------------------------
# QuACK's GEMM for the weight gradients (cute_backend.weight_grad_into_): written, added in place, and
# the last chunk's dW written in the weight dtype with the fp32 sum of the other chunks added in the GEMM.


@pytest.fixture
def reference_gemms(monkeypatch):
    """QuACK's GEMM replaced by its torch contract; returns its calls as (configuration,
    "write" / "accumulate" / "add_cast")."""
    calls = []

    def counted(a, b, out, c, *, alpha=1.0, beta=1.0, add_to_output=False, config=None):
        calls.append((config, "add_cast" if c is not None else "accumulate" if add_to_output else "write"))
        cute_backend.reference_gemm(a, b, out, c, alpha=alpha, beta=beta, add_to_output=add_to_output)

    monkeypatch.setattr(cute_backend, "_gemm", lambda: (counted, {key: key for key in cute_backend.GEMM_CONFIGS}))
    monkeypatch.setattr(cute_backend, "_gemm_available", lambda device: True)
    return calls


@pytest.mark.parametrize("row_kernel", [False, True], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("target", ["grad", "main_grad", "main_grad_expected"])
@pytest.mark.parametrize("upstream", [1.0, 3.5])
@pytest.mark.parametrize("retain", [False, True])
def test_quack_gemms_match_float64_reference(reference_gemms, monkeypatch, row_kernel, target, upstream, retain):
    """Cross-entropy with the dW GEMMs on QuACK (the row kernel on or off), chunks of 7 rows:
    loss, dX and dW against float64. Without main_grad the last chunk's GEMM adds the fp32 sum of
    the others and writes dW in bf16 during the forward, which the backward scales by g (checked
    with g = 1 and 3.5, and through a second backward, which recomputes). With main_grad, dW is
    summed in fp32 (a buffer when g is unknown at forward time, main_grad itself when expected)."""
    if row_kernel:
        monkeypatch.setattr(cute_backend, "_kernel", lambda: cute_backend.reference_kernel)
        monkeypatch.setattr(cute_backend, "_available", lambda device: True)
    main_grad = target != "grad"
    case = _case(41)
    got = _run_ce(case, upstream=upstream, main_grad=main_grad, retain=retain,
                  expected_upstream_grad=upstream if target == "main_grad_expected" else None)
    _check(case, got, "mean", upstream, f"QuACK GEMMs row_kernel={row_kernel} {target} g={upstream}")
    assert ("add", "accumulate") in reference_gemms
    # the first chunk writes its buffer; into main_grad every chunk adds
    assert (("write", "write") in reference_gemms) == (target != "main_grad_expected")
    forward_add_casts = 0 if main_grad else 1
    second_backward_add_casts = 1 if retain and not main_grad else 0
    assert reference_gemms.count(("add", "add_cast")) == forward_add_casts + second_backward_add_casts


@pytest.mark.parametrize("entry", ["logprobs", "grpo"])
def test_quack_gemms_on_the_recompute_path(reference_gemms, entry):
    """Log-probs and GRPO recompute dlogits in the backward (temperature 0.7, a padded vocab, TP = 1,
    chunks of 7): their dW GEMMs run on QuACK and the backward's last chunk writes bf16 dW with the
    fp32 sum added; log-probs (the loss), dX and dW against float64."""
    case = make_case(43, 1, dtype=torch.bfloat16, seq=23, batch=3, hidden=32, vocab=101, extra_pad=3,
                     temperature=0.7)
    g = torch.Generator().manual_seed(1)
    token_weight = torch.randn(case["labels"].shape, generator=g, dtype=torch.float64)
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    h64 = case["hidden"].double().requires_grad_()
    w64 = case["weight"].double().requires_grad_()
    mask = case["labels"] != -100
    if entry == "logprobs":
        ref_lp, _, _ = reference.dense_stats(h64, w64, case["labels"], vocab_size=case["vocab"],
                                             temperature=case["T"])
        ref_lp = ref_lp.reshape(case["labels"].shape)
        lp = linear_logprobs(h, w, case["labels"], vocab_size=case["vocab"], temperature=case["T"],
                             chunk_size=7).logprobs
        (lp.double() * token_weight * mask).sum().backward()
        (ref_lp * token_weight * mask).sum().backward()
        assert reference.rel_err(lp[mask], ref_lp[mask]) < TOL[torch.bfloat16]
    else:  # the package's GRPO formula on the float64 dense log-probs is the reference
        from megatron_fused_ce.losses import GRPOConfig, grpo_loss
        from megatron_fused_ce.losses.linear_grpo import linear_grpo_loss

        labels = case["labels"].clamp(min=0)  # GRPO masks by `mask`, not by ignore_index
        ref_lp, _, _ = reference.dense_stats(h64, w64, labels, vocab_size=case["vocab"], temperature=case["T"])
        ref_lp = ref_lp.reshape(labels.shape)
        old = (ref_lp.detach() + 0.1 * token_weight).float()
        advantages = token_weight.float()
        fmask = mask.float()
        loss, _ = linear_grpo_loss(h, w, labels, advantages, fmask, GRPOConfig(), old_logprobs=old,
                                   vocab_size=case["vocab"], temperature=case["T"], chunk_size=7)
        ref_loss, _ = grpo_loss(ref_lp, advantages.double(), fmask.double(), GRPOConfig(), old_logprobs=old.double())
        (2.5 * loss).backward()
        (2.5 * ref_loss).backward()
        assert reference.rel_err(loss, ref_loss) < TOL[torch.bfloat16]
    assert reference.rel_err(h.grad, h64.grad) < TOL[torch.bfloat16]
    assert reference.rel_err(w.grad, w64.grad) < TOL[torch.bfloat16]
    assert ("add", "add_cast") in reference_gemms and ("write", "write") in reference_gemms


def test_quack_gemms_in_the_sampler_filters_backward(reference_gemms):
    """Log-probs under top-k / top-p / min-p (ops/sampling.py) recompute the kept set's dlogits in
    the backward: their dW GEMMs run on QuACK too, the last chunk writing bf16 dW with the fp32 sum
    added; log-probs, entropy, dX and dW against the float64 filtered reference (chunks of 7)."""
    from sampling_cases import check, run_case
    from sampling_cases import make_case as sampling_case

    case = sampling_case(61, 1, dtype=torch.bfloat16, ints=True)
    params = dict(top_k=12, top_p=0.9, min_p=0.02)
    check(case, params, [run_case(0, 1, case, params, impl="auto")], what="QuACK sampled", record=False)
    assert ("add", "add_cast") in reference_gemms and ("write", "write") in reference_gemms


@pytest.mark.parametrize("change", ["impl_triton_or_torch", "fp32", "switched_off", "unaligned_hidden", "lean"])
def test_quack_gemms_not_taken_where_they_do_not_apply(reference_gemms, monkeypatch, change):
    """An explicit impl, fp32 inputs, MEGATRON_FUSED_CE_CUTE=0, a hidden size whose rows TMA cannot
    address (36 bf16 = 72 bytes, not a multiple of 16) and lean mode keep cuBLAS: QuACK's GEMM is
    not called, and the result is the float64 reference's."""
    hidden = 36 if change == "unaligned_hidden" else 32
    case = make_case(47, 1, dtype=torch.bfloat16, seq=23, batch=3, hidden=hidden, vocab=104, extra_pad=0,
                     temperature=1.0)
    kwargs = {}
    if change == "impl_triton_or_torch":
        kwargs["impl"] = "torch"  # on CPU "triton" runs the same GEMM calls (no role named)
    elif change == "fp32":
        case = dict(case, hidden=case["hidden"].float(), weight=case["weight"].float(), dtype=torch.float32)
    elif change == "switched_off":
        monkeypatch.setattr(cute_backend, "ENABLED", False)
    elif change == "lean":
        kwargs["memory_mode"] = "lean"
    got = _run_ce(case, **kwargs)
    assert reference_gemms == []
    _check(case, got, "mean", 3.5, change)


@pytest.mark.parametrize("target", ["grad", "main_grad", "main_grad_expected"])
def test_quack_gemms_under_every_forward_backward_pairing(reference_gemms, reference_kernel, target):
    """The pairings of test_forward_backward_pairing with QuACK's GEMMs and row kernel: the bf16 dW
    written in the forward is scaled by each backward's upstream gradient (or recomputed on a
    second backward) and matches the float64 reference's multiple."""
    from op_cases import SCENARIOS

    main_grad = target != "grad"

    case = _case(59)
    ref_loss, ref_dx, ref_dw = reference_ce(case, "mean", 0.0, 0.0, torch.tensor(1.0))
    for scenario in SCENARIOS:
        h = case["hidden"].clone().requires_grad_()
        w = case["weight"].clone().requires_grad_()
        if main_grad:
            w.main_grad = torch.zeros(w.shape)
            w.grad_added_to_main_grad = False
        loss, scale = scenario(lambda h, w, g: linear_cross_entropy(
            h, w, case["labels"], vocab_size=case["vocab"], chunk_size=7, accumulate_into_main_grad=main_grad,
            expected_upstream_grad=g if target == "main_grad_expected" else None), h, w)
        dw = w.main_grad if main_grad else w.grad
        assert reference.rel_err(loss, ref_loss) < TOL[case["dtype"]], scenario.__name__
        assert reference.rel_err(h.grad, scale * ref_dx) < TOL[case["dtype"]], scenario.__name__
        assert reference.rel_err(dw, scale * ref_dw) < TOL[case["dtype"]], scenario.__name__
    assert ("add", "add_cast" if not main_grad else "accumulate") in reference_gemms


def _quack_gemms_on_this_gpu() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
            and cute_backend._gemm() is not None)


@pytest.mark.skipif(not _quack_gemms_on_this_gpu(), reason="QuACK's GEMM runs on an SM90 GPU with quack-kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quack_weight_grad_gemms_on_gpu_match_float64(dtype):
    """Both fixed configurations on the GPU, on a chunk whose row and column counts are not
    multiples of their tiles (300 rows, 50312 columns, hidden 72): dW written in fp32 with alpha,
    added in place, and added to an fp32 sum while written in the input dtype, against float64."""
    g = torch.Generator(device="cuda").manual_seed(3)
    n, v, hd = 300, 50312, 72
    h = torch.randn(n, hd, device="cuda", generator=g).to(dtype)
    dl = (torch.randn(n, v, device="cuda", generator=g) * 0.01).to(dtype)
    total = torch.randn(v, hd, device="cuda", generator=g)
    product = dl.double().t() @ h.double()

    def err(out, ref):
        return ((out.double() - ref).norm() / ref.norm()).item()

    acc = torch.full((v, hd), float("nan"), device="cuda")
    assert cute_backend.weight_grad_into_(acc, dl.t(), h, alpha=0.25)  # overwrite: `out` not read
    assert err(acc, 0.25 * product) < 1e-5
    acc.copy_(total)
    assert cute_backend.weight_grad_into_(acc, dl.t(), h, accumulate=True, alpha=0.25)
    assert err(acc, total.double() + 0.25 * product) < 1e-5
    out = torch.empty(v, hd, device="cuda", dtype=dtype)
    assert cute_backend.weight_grad_into_(out, dl.t(), h, alpha=0.25, add=total)
    assert err(out, total.double() + 0.25 * product) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.skipif(not _quack_gemms_on_this_gpu(), reason="QuACK's GEMMs run on an SM90 GPU with quack-kernels")
@pytest.mark.parametrize("entry", ["ce_upstream_1", "ce_main_grad", "logprobs_temperature_padded"])
def test_quack_gemms_on_gpu_inside_the_op_match_float64(monkeypatch, entry):
    """The op on the GPU with QuACK's dW GEMMs (and its row kernel where it applies): 1037
    labelled rows in chunks of 300, vocab 50304 (log-probs: temperature 0.7 and 5 padding columns);
    values, dX and dW against float64, and QuACK's GEMM ran, including the last chunk's add + cast."""
    gemm, configs = cute_backend._gemm()
    calls = []
    monkeypatch.setattr(cute_backend, "_gemm", lambda: (
        lambda *a, **k: calls.append(a[3] is not None) or gemm(*a, **k), configs))
    padded = entry.startswith("logprobs")
    case = make_case(29, 1, dtype=torch.bfloat16, seq=61, batch=17, hidden=64, vocab=50304 - (5 if padded else 0),
                     extra_pad=5 if padded else 0, temperature=0.7 if padded else 1.0, chunk_size=300)
    gpu = dict(case, hidden=case["hidden"].cuda(), weight=case["weight"].cuda(), labels=case["labels"].cuda())
    if not padded:
        got = _run_ce(gpu, upstream=1.0, main_grad=entry == "ce_main_grad")
        _check(case, tuple(t.cpu() for t in got), "mean", 1.0, f"QuACK GEMMs {entry}",
               row="QuACK dW GEMMs (GPU)")
    else:
        h = gpu["hidden"].clone().requires_grad_()
        w = gpu["weight"].clone().requires_grad_()
        lp = linear_logprobs(h, w, gpu["labels"], vocab_size=case["vocab"], temperature=case["T"],
                             chunk_size=300).logprobs
        mask = case["labels"] != -100
        (lp * mask.cuda()).sum().backward()
        h64 = case["hidden"].double().requires_grad_()
        w64 = case["weight"].double().requires_grad_()
        ref_lp, _, _ = reference.dense_stats(h64, w64, case["labels"], vocab_size=case["vocab"], temperature=case["T"])
        ref_lp = ref_lp.reshape(case["labels"].shape)
        (ref_lp * mask).sum().backward()
        assert reference.rel_err(lp.cpu()[mask], ref_lp[mask]) < TOL[torch.bfloat16]
        assert reference.rel_err(h.grad.cpu(), h64.grad) < TOL[torch.bfloat16]
        assert reference.rel_err(w.grad.cpu(), w64.grad) < TOL[torch.bfloat16]
    assert calls
    assert any(calls) == (entry != "ce_main_grad")  # the last chunk's add + cast, not into main_grad


def _tp2_gemms_worker(rank, world, case):
    import torch.distributed as dist

    from megatron_fused_ce.ops.backends import cute_backend as cb

    calls = []

    def counted(a, b, out, c, **kwargs):
        calls.append(c is not None)
        cb.reference_gemm(a, b, out, c, **{k: v for k, v in kwargs.items() if k != "config"})

    cb._gemm_available = lambda device: True
    cb._gemm = lambda: (counted, {key: key for key in cb.GEMM_CONFIGS})
    v_local = case["v_local"]
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"][rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    loss = linear_cross_entropy(h, w, case["labels"], tp_group=dist.group.WORLD, vocab_size=case["vocab"],
                                chunk_size=7)
    (loss * 3.5).backward()
    return loss.detach(), h.grad, w.grad, calls


def test_quack_gemms_under_tensor_parallelism():
    """At TP = 2 (gloo) each rank's dW GEMMs run on QuACK (the stand-in), the last chunk's writing
    bf16 dW with its fp32 sum added; loss, dX and each rank's dW shard against float64."""
    case = make_case(61, 2, dtype=torch.bfloat16, seq=12, batch=3, hidden=16, vocab=92, extra_pad=2,
                     temperature=1.0)
    ref_loss, ref_dx, ref_dw = reference_ce(case, "mean", 0.0, 0.0, torch.tensor(3.5))
    v_local = case["v_local"]
    for rank, (loss, dx, dw, calls) in enumerate(run_workers(_tp2_gemms_worker, 2, case)):
        assert calls.count(True) == 1 and False in calls
        assert reference.rel_err(loss, ref_loss) < TOL[torch.bfloat16]
        assert reference.rel_err(dx, ref_dx) < TOL[torch.bfloat16]
        assert reference.rel_err(dw, ref_dw[rank * v_local:(rank + 1) * v_local]) < TOL[torch.bfloat16]


@pytest.mark.parametrize("quack", [False, True], ids=["without_quack", "with_quack"])
def test_last_chunk_gemm_allocates_dw_only_where_it_runs(request, quack):
    """The last chunk's add + cast allocates the [V, H] dW in the weight dtype only when QuACK's
    GEMM will write it: without QuACK (CUDA machines without the extra, CPU) it returns None having
    allocated nothing, so the peak stays one chunk plus the fp32 sum."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_fused_ce.ops import chunked, fast
    from megatron_fused_ce.ops.backends import torch_backend

    if quack:
        request.getfixturevalue("reference_gemms")
    v, hd = 104, 32
    backend = dataclasses.replace(torch_backend.BACKEND, weight_grad_gemm=cute_backend.WEIGHT_GRAD_GEMM)
    spec = chunked.ChunkSpec(tp_group=None, backend=backend, num_valid_cols=v, inv_temperature=1.0,
                             chunk_size=7, want_sum_logits=False, want_entropy=False, sequence_parallel=False)
    dlogits, h = torch.randn(7, v).bfloat16(), torch.randn(7, hd).bfloat16()
    dw_sum = torch.randn(v, hd)

    class Allocations(TorchDispatchMode):
        shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and func.__name__.startswith("empty"):
                self.shapes.append((tuple(out.shape), out.dtype))
            return out

    with Allocations() as allocations:
        dw = fast.last_weight_grad(dlogits, h, spec, dw_sum, torch.bfloat16, scale=0.5)
    weight_sized = [s for s in allocations.shapes if s[0] == (v, hd)]
    if quack:
        assert dw.dtype == torch.bfloat16 and weight_sized == [((v, hd), torch.bfloat16)]
        expected = dw_sum.double() + 0.5 * dlogits.double().t() @ h.double()
        assert reference.rel_err(dw, expected) < 1e-2
    else:
        assert dw is None and weight_sized == []
