"""GRPO's per-token epilogue kernel (ops/backends/triton_grpo.py) against its definition.

The kernel transcribes grpo.token_terms, the batch totals, the normalization weights and the metric
vector for a call of one chunk; `linear_grpo._whole_call_terms` is the same computation written
once in torch (what runs on CPU, and compiled, on CUDA with impl="torch"). Both are run on the same
inputs for every option: loss types, delta, dual clip, KL estimators and clamps, bias correction,
train/inference corrections, excluded (-inf) tokens, normalizers, empty sequences, ignored labels,
[B] and [B, T] advantages, bool and float masks, sequence-first layout. Without a GPU the kernel
runs under Triton's interpreter. fp32 on both sides: values agree to fp32 rounding (rtol 2e-6,
the kernel's exp / division and its sum order), flags and counts exactly.

Then linear_grpo_loss with impl="triton" (the kernel) against impl="torch" (the definition), values
and gradients, so that the kernel's wiring into the chunk loop is covered as well.
"""

import math
import re
import warnings
from dataclasses import replace
from functools import partial

import pytest
import torch

from grpo_cases import CONFIGS, DEVICE, triton_grpo  # noqa: F401  (first: it sets the interpreter up; the fixture)

pytest.importorskip("triton")

from megatron_fused_ce.losses import GRPOConfig, grpo_loss, linear_grpo_loss  # noqa: E402
from megatron_fused_ce.losses import linear_grpo  # noqa: E402
from megatron_fused_ce.losses.grpo import metric_names  # noqa: E402

# the interpreter evaluates both sides of a select: -inf - -inf where an excluded token is masked
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")




def _inputs(seed: int, batch: int, length: int, *, sequence_first: bool, per_token_adv: bool, bool_mask: bool):
    g = torch.Generator().manual_seed(seed)
    n = batch * length
    target = torch.randn(n, generator=g)
    row_max = target + torch.rand(n, generator=g)
    lse = torch.rand(n, generator=g) * 2
    logprobs = (target - row_max) - lse  # in the labels' layout
    lp_bt = logprobs.reshape(length, batch).t() if sequence_first else logprobs.reshape(batch, length)
    mask = torch.rand(batch, length, generator=g) > 0.25
    mask[1] = False  # an empty sequence
    mask = mask if bool_mask else mask.float() * (1 + torch.rand(batch, length, generator=g))
    adv = torch.randn(batch, length, generator=g) if per_token_adv else torch.randn(batch, generator=g)
    old = lp_bt + 0.4 * torch.randn(batch, length, generator=g)
    old[0, 2] = float("-inf")  # excluded tokens (under the mask or not)
    old[2, 0] = float("-inf")
    sampling = old + 0.3 * torch.randn(batch, length, generator=g)
    sampling[3, 1] = float("-inf")
    reference = lp_bt + 0.5 * torch.randn(batch, length, generator=g)
    shape = (length, batch) if sequence_first else (batch, length)
    labels = torch.randint(0, 50, shape, generator=g)
    labels.view(-1)[::7] = -100  # ignored labels where the mask may be nonzero
    return dict(target=target, row_max=row_max, lse=lse, advantages=adv, mask=mask, old=old,
                sampling=sampling, reference=reference, labels=labels)


def _run(fn, config, x, *, with_old, with_sampling, normalizer, sequence_first):
    to = (lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t)
    return fn(config, to(x["target"]), to(x["row_max"]), to(x["lse"]), to(x["advantages"]), to(x["mask"]),
              to(x["old"]) if with_old else None, to(x["reference"]) if config.beta > 0 else None,
              to(x["sampling"]) if with_sampling else None, to(normalizer), to(x["labels"]), -100, sequence_first)


def _compare(triton_grpo, config, x, **kw):
    expected = _run(linear_grpo._whole_call_terms, config, x, **kw)
    got = _run(triton_grpo.whole_call_terms, config, x, **kw)
    names = metric_names(config, kw["with_sampling"])
    assert got[2].shape == (len(names),)
    for name, a, b in zip(names, got[2].cpu(), expected[2].cpu()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(got[0].cpu(), expected[0].cpu(), rtol=2e-6, atol=1e-8)
    assert torch.equal(got[1], -got[0])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kernel_matches_the_definition_for_every_option(triton_grpo, name):
    config = GRPOConfig(**CONFIGS[name])
    x = _inputs(1, 5, 11, sequence_first=False, per_token_adv=False, bool_mask=True)
    with_sampling = config.is_correction != "none" or name == "dapo"
    _compare(triton_grpo, config, x, with_old=True, with_sampling=with_sampling, normalizer=None,
             sequence_first=False)


@pytest.mark.parametrize("sequence_first", [False, True])
@pytest.mark.parametrize("normalizer", [None, 7.0, 0.0])
@pytest.mark.parametrize("name", ["dapo", "grpo_nonempty", "dr_grpo_k2"])
def test_kernel_layouts_and_normalizers(triton_grpo, name, normalizer, sequence_first):
    """[T, B] labels and statistics, per-token advantages, float masks, a given normalizer (a
    number or a tensor; a zero one stands for 'no valid token' and divides by 1), on-policy (no old
    log-probs)."""
    config = GRPOConfig(**CONFIGS[name])
    # more tokens than one tile (1024): the walk's second tile and its row offsets
    x = _inputs(2, 37, 41, sequence_first=sequence_first, per_token_adv=True, bool_mask=False)
    norm = None if normalizer is None else torch.tensor(normalizer) if sequence_first else normalizer
    for with_old in (True, False):
        _compare(triton_grpo, config, x, with_old=with_old, with_sampling=False, normalizer=norm,
                 sequence_first=sequence_first)


@pytest.mark.parametrize("batch,length", [(8, 256), (1, 2048), (64, 32), (2, 1500)])
@pytest.mark.parametrize("name", ["dapo", "grpo", "sequence_mask_high"])
def test_kernel_tile_shapes(triton_grpo, name, batch, length):
    """Tiles of one long row, of many short ones, and rows longer than a tile but not a multiple
    of it (each shape of tile is its own compilation on a GPU)."""
    config = GRPOConfig(**CONFIGS[name])
    x = _inputs(6, batch + 4, length, sequence_first=False, per_token_adv=False, bool_mask=True)
    x = {k: (v[:batch] if v.dim() == 2 or k == "advantages" else v[:batch * length]) for k, v in x.items()}
    with_old = name != "dapo"
    _compare(triton_grpo, config, x, with_old=with_old, with_sampling=with_old, normalizer=None,
             sequence_first=False)


def test_no_valid_token(triton_grpo):
    """Every token masked: loss and gradient 0, extremes 0, nothing divided by zero."""
    config = GRPOConfig(**CONFIGS["sequence_truncate"])
    x = _inputs(3, 4, 6, sequence_first=False, per_token_adv=False, bool_mask=True)
    x["mask"] = torch.zeros_like(x["mask"])
    _compare(triton_grpo, config, x, with_old=True, with_sampling=True, normalizer=None, sequence_first=False)


@pytest.mark.parametrize("launch", ["terms in one launch", "per-token kernel"])
@pytest.mark.parametrize("name", ["dapo_delta_dual", "grpo", "sequence_truncate", "dapo_k3_bias"])
def test_linear_grpo_loss_takes_the_kernel(triton_grpo, name, launch, monkeypatch):
    """linear_grpo_loss with impl="triton" runs its kernel (counted): the one launch of statistics,
    terms and dlogits where it applies (a chunk of every row at TP = 1), else the per-token kernel
    between the statistics and dlogits launches; either gives the values and gradients of
    impl="torch", whose epilogue is the torch definition."""
    calls = []
    if launch == "per-token kernel":  # (where the one launch does not apply)
        monkeypatch.setattr(triton_grpo, "terms_in_launch_applies", lambda *args: False)
    name_of = "terms_in_launch_" if launch == "terms in one launch" else "whole_call_terms"
    kernel = getattr(triton_grpo, name_of)

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_grpo, name_of, counted)
    monkeypatch.setattr(linear_grpo, "_kernel_module", lambda: triton_grpo)
    config = GRPOConfig(**CONFIGS[name])
    g = torch.Generator().manual_seed(4)
    batch, length, hidden, vocab = 3, 8, 16, 40
    h = torch.randn(batch, length, hidden, generator=g, dtype=torch.float64).float()
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    labels[0, 3] = -100
    mask = torch.rand(batch, length, generator=g) > 0.2
    adv = torch.randn(batch, generator=g)
    old = torch.randn(batch, length, generator=g) * 0.3 - 3.5
    sampling = old + 0.1 * torch.randn(batch, length, generator=g)
    reference = old + 0.2 * torch.randn(batch, length, generator=g)
    results = []
    for impl in ("torch", "triton"):
        hh, ww = h.clone().to(DEVICE).requires_grad_(), w.clone().to(DEVICE).requires_grad_()
        loss, metrics = linear_grpo_loss(
            hh, ww, labels.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), config, impl=impl,
            old_logprobs=old.to(DEVICE), sampling_logprobs=sampling.to(DEVICE),
            reference_logprobs=reference.to(DEVICE) if config.beta > 0 else None)
        loss.backward()
        results.append((metrics, hh.grad, ww.grad))
    assert calls, "the kernel did not run"
    (m_torch, dx_torch, dw_torch), (m_triton, dx_triton, dw_triton) = results
    assert m_torch.keys() == m_triton.keys()
    for key in m_torch:
        torch.testing.assert_close(m_triton[key], m_torch[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(dx_triton, dx_torch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw_triton, dw_torch, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # (the interpreter's numpy)
@pytest.mark.parametrize("launch", ["terms in one launch", "per-token kernel"])
@pytest.mark.parametrize("name", ["dapo", "cispo", "sapo", "dapo_delta_dual"])
def test_a_ratio_that_overflows_leaves_the_gradient_finite(triton_grpo, name, launch, monkeypatch):
    """A token whose ratio exp(lp - old) overflows fp32 (lp - old > 88.7: an old log-prob of -200)
    where the loss does not depend on the ratio — clipped (A > 0), dual-clipped (A < 0), CISPO's
    detached ratio, SAPO's saturated gate — has the gradient of the formula there: d loss/dr is 0,
    and 0 · inf made the token's gradient NaN, and with it dX and all of dW. Both the definition
    (impl="torch") and the kernel against the same call in float64, where the ratio is finite."""
    if launch == "per-token kernel":
        monkeypatch.setattr(triton_grpo, "terms_in_launch_applies", lambda *args: False)
    monkeypatch.setattr(linear_grpo, "_kernel_module", lambda: triton_grpo)
    config = GRPOConfig(**CONFIGS[name])
    g = torch.Generator().manual_seed(5)
    batch, length, hidden, vocab = 2, 6, 16, 40
    h = torch.randn(batch, length, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    # the far token in each row clipped (A > 0), and with A < 0 dual-clipped or its gate saturated
    # (plain PPO has no bound there: the loss itself overflows, as in float64 it is ~1e85)
    adv = torch.tensor([1.0, 1.0 if name == "dapo" else -1.0], dtype=torch.float64)
    old = torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.3 - 3.5
    old[:, 2] = -200.0
    mask = torch.ones(batch, length, dtype=torch.float64)
    # float64 dense log-probs under grpo_loss: exp(196) is finite there
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp64 = torch.log_softmax(h64 @ w64.T, dim=-1).gather(-1, labels[..., None])[..., 0]
    loss64, _ = grpo_loss(lp64, adv, mask, config, old_logprobs=old)
    expected = (loss64.detach(), *torch.autograd.grad(loss64, (h64, w64)))
    assert all(torch.isfinite(t).all() for t in expected)
    results = {}
    for impl in ("torch", "triton"):
        hh = h.to(DEVICE, torch.float32).requires_grad_()
        ww = w.to(DEVICE, torch.float32).requires_grad_()
        loss, metrics = linear_grpo_loss(hh, ww, labels.to(DEVICE), adv.to(DEVICE, torch.float32),
                                         mask.to(DEVICE, torch.float32), config, impl=impl,
                                         old_logprobs=old.to(DEVICE, torch.float32))
        loss.backward()
        results[impl] = (loss.detach().cpu(), hh.grad.cpu(), ww.grad.cpu())
    for impl, got in results.items():
        for what, a, b in zip(("loss", "dX", "dW"), got, expected):
            assert torch.isfinite(a).all(), (impl, what)
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{impl} {what}: {m}")


@pytest.mark.parametrize("value", [7.0, 0.0, -1.0, math.inf, math.nan], ids=repr)
@pytest.mark.parametrize("name", ["dapo", "grpo", "dr_grpo_k2"])
def test_the_kernel_checks_a_tensor_normalizer(triton_grpo, name, value):
    """A normalizer tensor on the call's device reaches the kernel as given (any dtype) and is
    checked there as nll.given_count checks it (five launches otherwise): a good one gives
    given_count's values bit for bit, a bad one the NaN that given_count's gives (never a result
    scaled by it) and the error at the next check."""
    from megatron_fused_ce import check_deferred_errors
    from megatron_fused_ce.losses.nll import given_count

    config = GRPOConfig(**CONFIGS[name])
    x = _inputs(9, 5, 11, sequence_first=False, per_token_adv=False, bool_mask=True)
    kw = dict(with_old=True, with_sampling=False, sequence_first=False)
    for dtype in (torch.float64, torch.float32) + ((torch.int64,) if value == 7.0 else ()):
        raw = torch.tensor(value, dtype=dtype, device=DEVICE)
        want = _run(triton_grpo.whole_call_terms, config, x, normalizer=given_count(raw, dtype=torch.float32,
                                                                                      device=DEVICE), **kw)
        if math.isnan(value) or value <= 0 or math.isinf(value):
            with pytest.raises(ValueError, match="normalizer"):
                check_deferred_errors()
        got = _run(partial(triton_grpo.whole_call_terms, check_normalizer=True), config, x, normalizer=raw, **kw)
        for a, b in zip(got[:3], want[:3]):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), dtype
        if value == 7.0:
            check_deferred_errors()  # nothing found
            assert not got[2].isnan().any()
        else:
            assert got[2][0].isnan(), "the loss"
            with pytest.raises(ValueError, match="normalizer"):
                check_deferred_errors()


def test_linear_grpo_loss_leaves_a_gpu_normalizer_to_the_kernel(triton_grpo, monkeypatch):
    """linear_grpo_loss (impl="triton", one chunk) hands a normalizer tensor on the call's device to
    the per-token kernel unchecked (no given_count launches) and gives impl="torch"'s values, on
    the general path and on the remembered route; a bad one gives a NaN loss and the error. (On a
    CPU machine the CPU stands for the GPU: nll.read_on_host says no.)"""
    from megatron_fused_ce import check_deferred_errors
    from megatron_fused_ce.losses import nll
    from megatron_fused_ce.ops import agreement

    monkeypatch.setattr(linear_grpo, "read_on_host", lambda count: False)
    monkeypatch.setattr(nll, "read_on_host", lambda count: False)
    checks = []
    original = linear_grpo.given_count
    monkeypatch.setattr(linear_grpo, "given_count", lambda *a, **k: checks.append(1) or original(*a, **k))
    g = torch.Generator().manual_seed(5)
    batch, length, hidden, vocab = 3, 8, 16, 40
    h = torch.randn(batch, length, hidden, generator=g).to(DEVICE)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(DEVICE)
    labels = torch.randint(0, vocab, (batch, length), generator=g).to(DEVICE)
    mask = (torch.rand(batch, length, generator=g) > 0.2).to(DEVICE)
    adv = torch.randn(batch, generator=g).to(DEVICE)
    old = (torch.randn(batch, length, generator=g) * 0.3 - 3.5).to(DEVICE)

    def call(impl, normalizer):
        hh = h.clone().requires_grad_()
        loss, _ = linear_grpo_loss(hh, w, labels, adv, mask, GRPOConfig(), impl=impl, old_logprobs=old,
                                   normalizer=normalizer, vocab_size=vocab)
        loss.backward()
        return loss.detach(), hh.grad

    agreement.forget_signatures()
    for count in (17.0, 18.0, 19.0):  # the first call, the general path, the route
        checks.clear()
        got = call("triton", torch.tensor(count, device=DEVICE))
        assert checks == [], count
        want = call("torch", torch.tensor(count, device=DEVICE))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    check_deferred_errors()
    loss, dx = call("triton", torch.tensor(0.0, device=DEVICE))
    assert loss.isnan() and dx.isnan().all()
    with pytest.raises(ValueError, match="normalizer"):
        check_deferred_errors()
    agreement.forget_signatures()


@pytest.mark.parametrize("name", ["dapo", "dapo_k3_bias", "sequence_truncate"])
def test_the_poison_given_to_the_kernel(triton_grpo, name):
    """With the call's poison (a remembered route's), the kernel adds it to every metric, as
    GRPOGrads.metrics adds it, and writes the loss on its own: 0 changes no bit, NaN reaches every
    metric and the loss."""
    config = GRPOConfig(**CONFIGS[name])
    x = _inputs(8, 5, 11, sequence_first=False, per_token_adv=False, bool_mask=True)
    kw = dict(with_old=True, with_sampling=config.is_correction != "none", normalizer=None, sequence_first=False)
    plain = _run(triton_grpo.whole_call_terms, config, x, **kw)
    assert plain[3] is None
    for value in (0.0, float("nan")):
        poison = torch.full((1,), value, device=DEVICE)
        grad, neg, metrics, loss = _run(partial(triton_grpo.whole_call_terms, poison=poison), config, x, **kw)
        assert torch.equal(grad, plain[0]) and torch.equal(neg, plain[1])
        assert loss.shape == () and torch.equal(metrics, plain[2] + poison) == (value == 0.0)
        assert torch.equal(loss, metrics[0]) if value == 0.0 else (metrics.isnan().all() and loss.isnan())


def test_config_mutation_is_seen(triton_grpo):
    """The options are the kernel's constants: a changed option gives another kernel, not the
    first one's values."""
    x = _inputs(5, 4, 5, sequence_first=False, per_token_adv=True, bool_mask=True)
    config = GRPOConfig(epsilon_high=0.01)
    kw = dict(with_old=True, with_sampling=False, normalizer=None, sequence_first=False)
    first = _run(triton_grpo.whole_call_terms, config, x, **kw)[2]
    _compare(triton_grpo, replace(config, epsilon_high=0.5), x, **kw)
    second = _run(triton_grpo.whole_call_terms, replace(config, epsilon_high=0.5), x, **kw)[2]
    assert not torch.equal(first, second)


# what the per-token kernel's launch may raise that is not the compiler's: (error, whether a CUDA
# graph is being captured)
NOT_THE_COMPILERS = {
    "out of memory": (torch.OutOfMemoryError("CUDA out of memory"), False),
    "sync debug mode": (RuntimeError("called a synchronizing CUDA operation"), False),
    "CUDA error": (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    "launch refused": (RuntimeError("Triton Error [CUDA]: operation not permitted when stream is capturing"), False),
    "cpu tensor": (ValueError("Pointer argument (at 5) cannot be accessed from Triton (cpu tensor?)"), False),
    "while capturing": (RuntimeError("an error of any kind"), True),
}


@pytest.mark.parametrize("case", list(NOT_THE_COMPILERS))
def test_a_kernel_failure_outside_the_compiler_is_raised_not_taken_for_one(monkeypatch, case):
    """The per-token kernel's launch (or the one launch of statistics, terms and dlogits) running
    out of memory, meeting a CUDA error, a synchronizing
    call under the sync debug mode's "error", a tensor it cannot read, or failing while a CUDA
    graph is captured raises to the caller: none is a compiler failure, so the config stays on the
    kernel for later calls (no fallback to the definition for the rest of the process, no
    warning)."""
    error, capturing = NOT_THE_COMPILERS[case]

    def failing():
        def kernel(*args, **kwargs):
            raise error
        return kernel

    monkeypatch.setattr(linear_grpo, "_whole_call_kernel", failing)
    monkeypatch.setattr(linear_grpo, "_one_launch_kernel", failing)
    monkeypatch.setattr(linear_grpo, "_FAILED_CONFIGS", set())
    if capturing:
        for name in ("is_available", "is_initialized", "is_current_stream_capturing"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(2, 6, 8, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(20, 8, generator=g).to(DEVICE)
    labels = torch.randint(0, 20, (2, 6), generator=g).to(DEVICE)
    adv, mask = torch.randn(2, generator=g).to(DEVICE), torch.ones(2, 6).to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (a fallback warns)
        with pytest.raises(type(error), match=re.escape(str(error))):
            linear_grpo_loss(h, w, labels, adv, mask, GRPOConfig(epsilon_low=0.19), impl="triton")
    assert not linear_grpo._FAILED_CONFIGS


@pytest.mark.skipif(DEVICE.type != "cuda", reason="per-token inputs on another device than hidden's: a GPU")
def test_per_token_inputs_on_the_cpu_keep_the_kernel(triton_grpo, monkeypatch):
    """Advantages, mask and old log-probs given on the CPU beside CUDA hidden states move to the
    GPU (as grpo_loss moves them): the per-token kernel runs on them (no fallback, which would
    then hold for every later call of the config) and gives the values of the same call with
    every input on the GPU, bit for bit."""
    monkeypatch.setattr(linear_grpo, "_FAILED_CONFIGS", set())
    g = torch.Generator().manual_seed(9)
    batch, length, hidden, vocab = 2, 8, 16, 40
    h = torch.randn(batch, length, hidden, generator=g).to(DEVICE)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(DEVICE)
    labels = torch.randint(0, vocab, (batch, length), generator=g).to(DEVICE)
    adv, mask = torch.randn(batch, generator=g), torch.rand(batch, length, generator=g) > 0.2
    old = torch.randn(batch, length, generator=g) * 0.3 - 3.5
    results = []
    for device in ("cpu", DEVICE, "cpu"):  # (the third call: a remembered route's)
        hh = h.clone().requires_grad_()
        loss, _ = linear_grpo_loss(hh, w, labels, adv.to(device), mask.to(device), GRPOConfig(), impl="triton",
                                   old_logprobs=old.to(device), vocab_size=vocab)
        loss.backward()
        results.append((loss.detach(), hh.grad))
    assert not linear_grpo._FAILED_CONFIGS
    for got in (results[0], results[2]):
        assert all(map(torch.equal, got, results[1]))


def test_a_kernel_that_fails_falls_back_to_the_definition(monkeypatch):
    """A kernel that does not compile (a compiler bug of some Triton version) leaves the call to the
    definition, with one warning, and is not tried again for that config."""
    attempts = []

    def broken():
        def kernel(*args, **kwargs):
            attempts.append(1)
            raise RuntimeError("PassManager::run failed")
        return kernel

    monkeypatch.setattr(linear_grpo, "_whole_call_kernel", broken)
    monkeypatch.setattr(linear_grpo, "_one_launch_kernel", broken)  # (the one launch fails first: one attempt)
    monkeypatch.setattr(linear_grpo, "_FAILED_CONFIGS", set())
    config = GRPOConfig(epsilon_low=0.17)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(2, 6, 8, generator=g).to(DEVICE)
    w = torch.randn(20, 8, generator=g).to(DEVICE)
    labels = torch.randint(0, 20, (2, 6), generator=g).to(DEVICE)
    adv, mask = torch.randn(2, generator=g).to(DEVICE), torch.ones(2, 6).to(DEVICE)
    results = []
    with pytest.warns(RuntimeWarning, match="per-token kernel failed"):
        for impl in ("triton", "triton", "torch"):
            hh = h.clone().requires_grad_()
            loss, _ = linear_grpo_loss(hh, w, labels, adv, mask, config, impl=impl)
            loss.backward()
            results.append((loss.detach(), hh.grad))
    assert len(attempts) == 1
    for loss, grad in results[:2]:
        torch.testing.assert_close(loss, results[2][0])
        torch.testing.assert_close(grad, results[2][1])
