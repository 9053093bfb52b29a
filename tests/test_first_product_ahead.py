"""The call's first GEMM launched before its argument handling (fast.EarlyProduct.launch_remembered).

A call whose key (entry point, the inputs' shapes / dtypes / devices, whether a gradient is
needed, the options that choose the first product) made a chunk of logits first last time
launches that product at once; the call takes it over where it is what the call makes. What this
protects: the product taken over is the call's own (values and gradients bit for bit those of a
call without it, one logits GEMM per chunk as before), a product that is not the call's is dropped
(never used), a call that raises after the launch ahead leaves nothing behind, and the memo stays
bounded. Runs on the CPU (the path is the same on every device)."""

import math

import pytest
import torch

from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss
from megatron_fused_ce.ops import fast, remembered_routes

N, H, V = 24, 16, 40


@pytest.fixture
def gemms(monkeypatch):
    """Every logits GEMM of the op, by who launched it: 'ahead', 'launch' (EarlyProduct.launch) or 'loop'."""
    calls = []
    original = fast.logits_gemm

    def counting(rows, weight, logits_dtype=None):
        import inspect

        caller = inspect.stack()[1].function
        calls.append({"launch_remembered": "ahead", "launch": "launch"}.get(caller, "loop"))
        return original(rows, weight, logits_dtype)

    monkeypatch.setattr(fast, "logits_gemm", counting)
    # the general path's product ahead is tested here: no remembered route (ops/remembered_routes.py)
    # runs a later call straight, without it
    monkeypatch.setattr(remembered_routes, "ENABLED", False)
    fast.EarlyProduct._REMEMBERED.clear()
    yield calls
    fast.EarlyProduct._REMEMBERED.clear()


def _inputs(seed, n=N):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g)
    w = torch.randn(V, H, generator=g) / math.sqrt(H) * 3
    y = torch.randint(0, V, (n,), generator=g)
    y[::5] = -100
    return h, w, y


def _paths():
    def forward_only(h, w, y):
        with torch.no_grad():
            return (linear_logprobs(h, w, y, temperature=0.7).logprobs,)

    def logprobs(h, w, y):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_logprobs(h, w, y, return_entropy=True)
        ((out.logprobs * torch.linspace(-1, 1, y.numel())).sum() + out.entropy.sum()).backward()
        return out.logprobs.detach(), h.grad, w.grad

    def cross_entropy(h, w, y):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, y)
        (loss * 1e-5).backward()
        return loss.detach(), h.grad, w.grad

    def grpo(h, w, y):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        yy = y.clamp(min=0).view(4, -1)
        mask = (y != -100).float().view(4, -1)
        loss, _ = linear_grpo_loss(h.view(4, -1, H), w, yy, torch.tensor([0.5, -1.0, 2.0, 0.25]), mask,
                                   GRPOConfig(), old_logprobs=torch.full(yy.shape, -3.0))
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def replay_dense(h, w, y):  # sampling-mask replay's dense route over the rows (a set at every row)
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        ids = torch.stack([y.clamp(min=0), (y.clamp(min=0) + 1) % V, (y.clamp(min=0) + 7) % V], 1)
        ids[::3, 0] = (ids[::3, 0] + 3) % V  # (some labels off their sets)
        mask = (ids.reshape(-1), torch.arange(y.numel() + 1) * 3)
        out = linear_logprobs(h, w, y, sampling_mask=mask)
        lp = torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0)
        (lp * torch.linspace(-1, 1, y.numel())).sum().backward()
        return lp.detach(), h.grad, w.grad

    return {"forward_only": forward_only, "logprobs": logprobs, "cross_entropy": cross_entropy, "grpo": grpo,
            "replay_dense": replay_dense}


@pytest.mark.parametrize("path", list(_paths()))
def test_a_later_call_takes_over_the_product_launched_ahead(gemms, path):
    call = _paths()[path]
    h, w, y = _inputs(1)
    first = call(h, w, y)
    assert "ahead" not in gemms  # a new key: nothing launched ahead
    per_call = len(gemms)
    gemms.clear()
    h2, w2, y2 = _inputs(2)
    second = call(h2, w2, y2)
    assert gemms.count("ahead") == 1 and "launch" not in gemms, gemms  # taken over, not made again
    assert len(gemms) == per_call
    fast.EarlyProduct._REMEMBERED.clear()
    for got, want in zip(second, call(h2, w2, y2)):  # the same call without the product ahead
        assert torch.equal(got, want)
    for got, want in zip(first, call(h, w, y)):
        assert torch.equal(got, want)


def test_a_product_launched_ahead_that_is_not_the_calls_is_dropped(gemms):
    call = _paths()["cross_entropy"]
    h, w, y = _inputs(3)
    want = call(h, w, y)
    (key, plan), = fast.EarlyProduct._REMEMBERED.items()
    for wrong in ((plan[0] - 1, plan[1]), (plan[0], torch.float64)):  # other rows, another dtype
        fast.EarlyProduct._REMEMBERED[key] = wrong
        gemms.clear()
        got = call(h, w, y)
        assert gemms[:2] == ["ahead", "launch"], gemms  # the call made its own
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert fast.EarlyProduct._REMEMBERED[key] == plan  # what the call made is remembered


def test_a_call_that_raises_after_the_launch_ahead_leaves_nothing_behind(gemms):
    call = _paths()["forward_only"]
    h, w, y = _inputs(4)
    want = call(h, w, y)
    gemms.clear()
    with pytest.raises(ValueError, match="labels"):
        call(h, w, y[:-1])  # the same hidden and weight: the product is launched, then the checks fail
    assert gemms == ["ahead"]
    for a, b in zip(call(h, w, y), want):
        assert torch.equal(a, b)


def test_the_key_holds_the_options_and_the_memo_is_bounded(gemms, monkeypatch):
    h, w, y = _inputs(5)
    with torch.no_grad():
        linear_logprobs(h, w, y, chunk_size=7)
        gemms.clear()
        linear_logprobs(h, w, y, chunk_size=8)  # another chunk size: another key, nothing ahead
        assert "ahead" not in gemms
        gemms.clear()
        linear_logprobs(h, w, y, chunk_size=7, impl="torch")  # another backend: another key
        assert "ahead" not in gemms
        gemms.clear()
        linear_logprobs(h, w, y, chunk_size=7)
        assert gemms.count("ahead") == 1 and "launch" not in gemms
    monkeypatch.setattr(fast.EarlyProduct, "MAX_REMEMBERED", 3)
    with torch.no_grad():
        for n in range(10, 16):
            linear_logprobs(*_inputs(6, n))
    assert len(fast.EarlyProduct._REMEMBERED) == 3


def test_the_entry_points_launch_it_before_their_own_checks(gemms, monkeypatch):
    """linear_grpo_loss launches the product before its GRPO checks (its argument handling costs
    the host as much as the op's own at RL shapes); a call that fails them drops it."""
    from megatron_fused_ce.losses import linear_grpo

    original = linear_grpo.check_grpo_arguments

    def checks(*args, **kwargs):
        gemms.append("checks")
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_grpo, "check_grpo_arguments", checks)
    call = _paths()["grpo"]
    h, w, y = _inputs(7)
    want = call(h, w, y)
    gemms.clear()
    got = call(h, w, y)
    assert gemms[:2] == ["ahead", "checks"] and "launch" not in gemms, gemms
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    gemms.clear()
    with pytest.raises(ValueError):  # advantages of the wrong length: refused by the checks
        linear_grpo_loss(h.view(4, -1, H).requires_grad_(), w, y.clamp(min=0).view(4, -1), torch.ones(3),
                         torch.ones(4, N // 4), GRPOConfig(), old_logprobs=torch.full((4, N // 4), -3.0))
    assert gemms == ["ahead", "checks"]
