"""QuACK's one-pass cross-entropy row kernel (ops/cute_backend.py) inside the chunk loop.

On CPU the kernel is replaced by `cute_backend.reference_kernel` (QuACK's contract in torch), so
that what the chunk loop does around it is checked against the float64 dense reference: dlogits
= softmax - one_hot scaled by the GEMMs' alpha (1/labelled tokens or 1), the statistics rebuilt
from (loss, lse), the offsets saved for a second backward and for main_grad's (g - 1) dW, and
where the kernel must not be used (smoothing, z-loss, temperature, vocab padding, TP > 1,
log-probs, lean mode, an explicit impl). On a Hopper GPU with QuACK installed the last test runs
QuACK's kernel itself.
"""

import pytest
import torch

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.ops import cute_backend
from test_ops import TOL, _reference_ce, make_case


@pytest.fixture
def reference_kernel(monkeypatch):
    """QuACK's kernel replaced by its torch contract; returns the list of calls (row counts)."""
    calls = []

    def counted(x, target, *args, **kwargs):
        calls.append(x.shape[0])
        return cute_backend.reference_kernel(x, target, *args, **kwargs)

    monkeypatch.setattr(cute_backend, "_kernel", lambda: counted)
    monkeypatch.setattr(cute_backend, "_available", lambda device: True)
    return calls


def _case(seed, **kwargs):
    # vocab a multiple of 8 and no padding rows: the kernel's conditions at TP = 1
    return make_case(seed, 1, dtype=torch.bfloat16, seq=23, batch=3, hidden=32, vocab=104, extra_pad=0,
                     temperature=1.0, **kwargs)


def _run_ce(case, *, reduction="mean", upstream=3.5, main_grad=False, retain=False, **kwargs):
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    if main_grad:
        w.main_grad = torch.full(w.shape, 0.25, device=w.device)
        w.grad_added_to_main_grad = False
    loss = linear_cross_entropy(h, w, case["labels"], vocab_size=case["vocab"], reduction=reduction,
                                temperature=case["T"], chunk_size=case["chunk_size"],
                                accumulate_into_main_grad=main_grad, **kwargs)
    (loss * upstream).backward(retain_graph=retain)
    if retain:  # a second backward recomputes dX, dW from the saved coefficients and offsets
        h.grad = w.grad = None
        if main_grad:
            w.main_grad.fill_(0.25)
        (loss * upstream).backward()
    dw = w.main_grad - 0.25 if main_grad else w.grad
    return loss.detach(), h.grad, dw


def _check(case, got, reduction, upstream, what):
    ref = _reference_ce(case, reduction, 0.0, 0.0, torch.tensor(upstream))
    for name, out, expected in zip(("loss", "dX", "dW"), got, ref):
        err = reference.record(f"cute {name}", 1, case["dtype"], reference.rel_err(out, expected))
        assert err <= TOL[case["dtype"]], f"{what} {name}: {err:.2e}"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("retain", [False, True])
def test_one_pass_matches_float64_reference(reference_kernel, reduction, main_grad, retain):
    """Ignored tokens, chunks of 7 rows (not dividing the labelled rows), an upstream gradient
    != 1, Megatron's main_grad (with its (g - 1) dW recomputed from the saved offsets) and a second
    backward through a retained graph."""
    case = _case(5)
    got = _run_ce(case, reduction=reduction, main_grad=main_grad, retain=retain)
    labelled = int((case["labels"] != -100).sum())
    assert reference_kernel == [7] * (labelled // 7) + ([labelled % 7] if labelled % 7 else [])
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


@pytest.mark.parametrize("main_grad", [True, False], ids=["main_grad", "grad"])
def test_one_pass_under_every_forward_backward_pairing(reference_kernel, main_grad):
    """The pairings of test_forward_backward_pairing (activation checkpointing both ways, a second
    backward, the loss used twice, a changing loss scale) with the one-pass kernel: dX and dW stay
    the float64 reference's multiple; a forward freed without backward under main_grad poisons it
    and the next call raises, as on the two-pass path."""
    import warnings

    from test_forward_backward_pairing import SCENARIOS

    case = _case(31)
    ref_loss, ref_dx, ref_dw = _reference_ce(case, "mean", 0.0, 0.0, torch.tensor(1.0))

    def leaves():
        h = case["hidden"].clone().requires_grad_()
        w = case["weight"].clone().requires_grad_()
        if main_grad:
            w.main_grad = torch.zeros(w.shape)
            w.grad_added_to_main_grad = False
        return h, w

    def loss_fn(h, w):
        return linear_cross_entropy(h, w, case["labels"], vocab_size=case["vocab"], chunk_size=7,
                                    accumulate_into_main_grad=main_grad)

    for scenario in SCENARIOS:
        h, w = leaves()
        loss, scale = scenario(loss_fn, h, w)
        dw = w.main_grad if main_grad else w.grad
        assert reference.rel_err(loss, ref_loss) < TOL[case["dtype"]], scenario.__name__
        assert reference.rel_err(h.grad, scale * ref_dx) < TOL[case["dtype"]], scenario.__name__
        assert reference.rel_err(dw, scale * ref_dw) < TOL[case["dtype"]], scenario.__name__
    assert reference_kernel
    if main_grad:
        h, w = leaves()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(h, w)  # graph freed without a backward
        assert torch.isnan(w.main_grad).all()
        with pytest.raises(ValueError, match="never backpropagated"):
            loss_fn(h, w)


def _tp2_worker(rank, world, case):
    import torch.distributed as dist

    from megatron_fused_ce.ops import cute_backend as cb

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
    assert not cute_backend.supported(torch.bfloat16, 64, 1024, 1024, 1.0, torch.device("cpu"))
    assert not cute_backend.supported(torch.float32, 64, 1024, 1024, 1.0, torch.device("cpu"))


def test_chunks_of_2_to_the_31_elements_keep_the_triton_kernels(reference_kernel):
    """A chunk of 2^31 or more logits (an explicit chunk_size or max_chunk_bytes above the default
    1 GiB) is not handed to QuACK's kernel: its indexing is not known to be 64-bit."""
    cpu = torch.device("cpu")
    assert cute_backend.supported(torch.bfloat16, 16383, 131072, 131072, 1.0, cpu)
    assert not cute_backend.supported(torch.bfloat16, 16384, 131072, 131072, 1.0, cpu)
    assert not cute_backend.supported(torch.bfloat16, 16384, 152064, 152064, 1.0, cpu)


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
    _check(case, tuple(t.cpu() for t in got), "mean", 3.5, f"QuACK main_grad={main_grad}")
