"""Gradients written during the forward pass stay exact however forward and backward are paired.

With `accumulate_into_main_grad=True` (Megatron's gradient-accumulation fusion) and the upstream
gradient known at forward time (`expected_upstream_grad`, as Megatron's loss funcs pass it), the
fast path of `linear_cross_entropy` and `linear_grpo_loss` adds dW into the fp32 `main_grad` while
the forward runs; without it, dW waits in an fp32 buffer for the backward. Each test below runs the
forward a different number of times than the backward, as users do by accident or on purpose, and
compares values, dX and dW (main_grad, or .grad without it) with a float64 dense reference, for both
entry points, both memory modes, with main_grad (upstream gradient expected or not) and without:

- torch.utils.checkpoint, non-reentrant (the forward runs again during backward) and reentrant;
- a forward whose graph is freed without backward (an evaluation pass outside torch.no_grad(), a
  micro-batch abandoned): exact where the forward has no side effect; where it added into main_grad,
  main_grad turns NaN with a warning and the next fused call raises on every rank, until the
  gradient buffer is zeroed (the same for an upstream gradient other than the expected one);
- retain_graph and a second backward, a loss used twice, a loss scale that changes between
  micro-batches (accumulation).
Rank-dependent cases run at TP=2 with sequence parallelism over forked gloo workers; Megatron's own
recompute (tensor_parallel.checkpoint) and a GPTModel under Megatron's schedules are in
test_megatron_pairing.py.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy
from megatron_fused_ce.losses import GRPOConfig, grpo_loss, linear_grpo_loss
from megatron_fused_ce.ops import api, chunked, lean
from megatron_fused_ce.ops import main_grad as main_grad_module
from op_cases import (
    SCENARIOS,
    changing_loss_scale,
    checkpoint_non_reentrant,
    megatron_loss_scaling,
    plain,
)

TOL = 1e-5  # fp32 inputs on the torch backend against float64: relative norm of the error
BATCH, SEQ, HIDDEN, VOCAB, TRUE_VOCAB = 3, 14, 16, 48, 45  # 42 tokens, padded vocab
CHUNK = 7  # does not divide the number of labelled tokens
CONFIG = GRPOConfig(loss_type="dapo")


@pytest.fixture
def lean_tiles(monkeypatch):
    """Several lean tiles on these small shapes (the default working set holds them all at once)."""
    monkeypatch.setattr(lean, "_MAX_COLS_A", 16)
    monkeypatch.setattr(lean, "_MAX_ROWS_B", 24)
    monkeypatch.setattr(api, "LEAN_WORKSET_BYTES", 6000)


def make_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    case = {
        "h": torch.randn(BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64),
        "w": torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.4,
        "y": torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=g),
        "mask": (torch.rand(BATCH, SEQ, generator=g) > 0.25).double(),
        "adv": torch.randn(BATCH, generator=g, dtype=torch.float64),
        "old": -torch.rand(BATCH, SEQ, generator=g, dtype=torch.float64) * 4,
    }
    case["y"][case["mask"] == 0] = -100  # ignored tokens for the cross-entropy
    return case


def dense_loss(entry, case, h, w):
    """The float64 reference: full logits, log_softmax over the unpadded vocab."""
    logits = (h @ w.t())[..., :TRUE_VOCAB]
    if entry == "ce":
        return F.cross_entropy(logits.reshape(-1, TRUE_VOCAB), case["y"].reshape(-1), ignore_index=-100,
                               label_smoothing=0.1)
    lp = torch.log_softmax(logits, -1).gather(-1, case["y"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return grpo_loss(lp, case["adv"], case["mask"], CONFIG, old_logprobs=case["old"])[0]


def reference_grads(entry, case):
    h, w = case["h"].clone().requires_grad_(), case["w"].clone().requires_grad_()
    loss = dense_loss(entry, case, h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


# Where dW goes: autograd's .grad, main_grad with the upstream gradient unknown at forward time (dW
# in an fp32 buffer until backward), main_grad with it given (dW added in the forward).
TARGETS = ["grad", "main_grad", "main_grad_expected"]


def fused_loss(entry, case, h, w, mode, target, tp_group=None, sp=False, g=1.0):
    """The fused loss; `h` is [B, T, H], or this rank's [T/TP, B, H] slice with `sp`; `g` the upstream
    gradient the caller will give it (passed on as expected_upstream_grad for "main_grad_expected")."""
    kw = dict(tp_group=tp_group, vocab_size=TRUE_VOCAB, chunk_size=CHUNK, impl="torch", memory_mode=mode,
              accumulate_into_main_grad=target != "grad", sequence_parallel=sp,
              expected_upstream_grad=g if target == "main_grad_expected" else None)
    if entry == "ce":
        labels = case["y"].t() if sp else case["y"]
        return linear_cross_entropy(h, w, labels, label_smoothing=0.1, **kw)
    labels = case["y"].clamp(min=0)
    return linear_grpo_loss(h, w, labels.t() if sp else labels, case["adv"].float(), case["mask"].float(),
                            CONFIG, old_logprobs=case["old"].float(), **kw)[0]


def leaves(case, target, h=None):
    h = (case["h"] if h is None else h).float().clone().requires_grad_()
    w = case["w"].float().clone().requires_grad_()
    if target != "grad":  # as Megatron's DDP sets them
        w.main_grad = torch.zeros(w.shape)
        w.grad_added_to_main_grad = False
    return h, w


def weight_grad(w, target):
    return w.grad if target == "grad" else w.main_grad


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_forward_backward_pairings_match_float64(lean_tiles, entry, mode, target, scenario):
    """Before: with main_grad in fast mode, the non-reentrant checkpoint left 2 x dW in main_grad,
    and an upstream gradient g != 1 was added as dW + (g - 1) dW (nothing of a g = 1e-5 left)."""
    case = make_case(seed=SCENARIOS.index(scenario) + 10 * TARGETS.index(target) + 100 * (mode == "lean"))
    ref_loss, ref_dx, ref_dw = reference_grads(entry, case)
    h, w = leaves(case, target)
    loss, scale = scenario(lambda x, wt, g: fused_loss(entry, case, x, wt, mode, target, g=g), h, w)
    assert abs(loss.double() - ref_loss) <= TOL * max(1.0, abs(ref_loss))
    assert reference.rel_err(h.grad, scale * ref_dx) < TOL, "dX"
    assert reference.rel_err(weight_grad(w, target), scale * ref_dw) < TOL, "dW"


def _unpaired_side_effect(target: str, mode: str) -> bool:
    return target == "main_grad_expected" and mode == "fast"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_forward_freed_without_backward(lean_tiles, entry, mode, target):
    """A loss computed under grad mode and dropped, then a training step on the same weight.
    Before: main_grad silently held the dropped pass's dW as well (fast mode). Now: exact where
    the forward has no side effect; else main_grad is NaN (with a RuntimeWarning), the next fused
    call raises, and once the buffer is zeroed (Megatron's zero_grad_buffer) the step is exact."""
    case = make_case(seed=7)
    ref_loss, ref_dx, ref_dw = reference_grads(entry, case)
    h, w = leaves(case, target)
    side_effect = _unpaired_side_effect(target, mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused_loss(entry, case, h, w, mode, target)  # graph freed right here
    unpaired = [c for c in caught if "never backpropagated" in str(c.message)]
    assert len(unpaired) == (1 if side_effect else 0)
    if side_effect:
        assert torch.isnan(w.main_grad).all()
        with pytest.raises(ValueError, match="never backpropagated"):
            fused_loss(entry, case, h, w, mode, target)
        w.main_grad.zero_()  # what zero_grad_buffer does before the next step
    loss_fn = lambda x, wt, g: fused_loss(entry, case, x, wt, mode, target, g=g)  # noqa: E731
    plain(loss_fn, h, w)
    assert reference.rel_err(h.grad, ref_dx) < TOL
    assert reference.rel_err(weight_grad(w, target), ref_dw) < TOL
    if side_effect:  # the mark is gone with the NaN: the next step needs nothing more
        plain(loss_fn, h, w)
        assert reference.rel_err(w.main_grad, 2 * ref_dw) < TOL


@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_unexpected_upstream_grad_poisons_main_grad(entry):
    """expected_upstream_grad=1 but the backward brings 1e-5: main_grad already holds 1 x dW, and
    no correction can make it 1e-5 x dW exactly, so it is NaN, with a warning naming both values;
    the next call raises on every rank until the buffer is zeroed."""
    case = make_case(seed=13)
    _, ref_dx, ref_dw = reference_grads(entry, case)
    h, w = leaves(case, "main_grad_expected")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (fused_loss(entry, case, h, w, "fast", "main_grad_expected", g=1.0) * 1e-5).backward()
    assert any("expected_upstream_grad=1 was 1e-05" in str(c.message) for c in caught)
    assert torch.isnan(w.main_grad).all()
    with pytest.raises(ValueError, match="expected_upstream_grad"):
        fused_loss(entry, case, h, w, "fast", "main_grad_expected")
    w.main_grad.zero_()
    h.grad = None
    (fused_loss(entry, case, h, w, "fast", "main_grad_expected", g=1e-5) * 1e-5).backward()
    assert reference.rel_err(h.grad, 1e-5 * ref_dx) < TOL
    assert reference.rel_err(w.main_grad, 1e-5 * ref_dw) < TOL


def test_zero_upstream_grad_leaves_main_grad_unchanged():
    """g = 0 (a micro-batch whose loss is multiplied away): main_grad keeps its bits, no warning."""
    case = make_case(seed=14)
    for entry in ("ce", "grpo"):
        h, w = leaves(case, "main_grad")
        w.main_grad.normal_()
        before = w.main_grad.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (fused_loss(entry, case, h, w, "fast", "main_grad") * 0.0).backward()
        assert torch.equal(w.main_grad.view(torch.int32), before.view(torch.int32)), entry


def test_expected_upstream_grad_must_be_a_finite_nonzero_number():
    """0 would add nothing the backward could check, NaN / inf nothing at all: refused."""
    case = make_case(seed=15)
    h, w = leaves(case, "main_grad_expected")
    for bad in (0.0, float("nan"), float("inf"), torch.tensor(1.0), "1"):
        with pytest.raises(ValueError, match="expected_upstream_grad"):
            linear_cross_entropy(h, w, case["y"], vocab_size=TRUE_VOCAB, impl="torch",
                                 accumulate_into_main_grad=True, expected_upstream_grad=bad)


def test_forward_that_raises_midway_poisons_main_grad(monkeypatch):
    """An exception inside the fast forward after a first chunk was added to main_grad: main_grad
    must not keep the partial sum silently."""
    case = make_case(seed=11)
    h, w = leaves(case, "main_grad_expected")
    coefficients, calls = chunked.coefficients, []

    def failing_on_the_second_chunk(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("failure in the second chunk")
        return coefficients(*args)

    monkeypatch.setattr(chunked, "coefficients", failing_on_the_second_chunk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="second chunk"):
            fused_loss("ce", case, h, w, "fast", "main_grad_expected")
    assert any("never backpropagated" in str(c.message) for c in caught)
    assert torch.isnan(w.main_grad).all()


def _megatron_like_step(optimizer, w):
    """How Megatron's optimizers step: the parameter's gradient is read from main_grad, then a torch
    optimizer steps (its step pre-hooks run first)."""
    w.grad = w.main_grad.detach().clone()
    optimizer.step()


@pytest.mark.parametrize("held", ["evaluation_loss", "loss_list"])
@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_optimizer_step_with_a_forward_still_alive_raises(entry, held):
    """A fused loss computed under grad mode and kept past the optimizer step without a backward (an
    evaluation loss held for logging; a micro-batch loss kept in a list). Its forward added dW to
    main_grad. Before: the step trained on the step's gradient plus that dW (relative error ~1),
    no NaN, no error. Now: the step raises before the update, the parameter keeps its values and
    main_grad is NaN; once the buffer is zeroed, the next step is exact and steps."""
    case = make_case(seed=21)
    _, _, ref_dw = reference_grads(entry, case)
    h, w = leaves(case, "main_grad_expected")
    optimizer = torch.optim.SGD([w], lr=0.5)
    loss_fn = lambda x, wt, g: fused_loss(entry, case, x, wt, "fast", "main_grad_expected", g=g)  # noqa: E731
    kept = []
    if held == "evaluation_loss":
        plain(loss_fn, h, w)
        kept.append(fused_loss(entry, case, h.detach(), w, "fast", "main_grad_expected"))
    else:  # two micro-batches, the second one's loss only stored
        kept = [loss_fn(h, w, 1.0) for _ in range(2)]
        kept[0].backward()
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match="graph alive without a backward"):
        _megatron_like_step(optimizer, w)
    assert torch.equal(w.detach(), before)
    assert torch.isnan(w.main_grad).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error said it: no second warning when the graph goes
        kept.clear()
    w.main_grad.zero_()  # zero_grad_buffer at the next step
    h.grad = None
    plain(loss_fn, h, w)
    assert reference.rel_err(w.main_grad, ref_dw) < TOL
    _megatron_like_step(optimizer, w)
    assert reference.rel_err(before - w.detach(), 0.5 * ref_dw) < TOL


def test_optimizer_step_on_a_poisoned_main_grad_raises():
    """A forward dropped without a backward inside a step (main_grad already NaN), then the step
    taken without another fused call: it raises instead of stepping on NaN; after zeroing it steps."""
    case = make_case(seed=22)
    h, w = leaves(case, "main_grad_expected")
    optimizer = torch.optim.SGD([w], lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fused_loss("ce", case, h, w, "fast", "main_grad_expected")  # graph freed right here
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match="never backpropagated"):
        _megatron_like_step(optimizer, w)
    assert torch.equal(w.detach(), before)
    w.main_grad.zero_()
    _megatron_like_step(optimizer, w)  # no fused call in between: the check sees the zeroed buffer


def test_correct_loops_step_without_a_check_of_their_own():
    """Every forward backpropagated, evaluation under no_grad, a loss kept after its backward: no
    side effect outstanding, nothing poisoned; the steps read nothing (no host sync)."""
    case = make_case(seed=23)
    _, _, ref_dw = reference_grads("ce", case)
    h, w = leaves(case, "main_grad_expected")
    optimizer = torch.optim.SGD([w], lr=0.5)
    loss_fn = lambda x, wt, g: fused_loss("ce", case, x, wt, "fast", "main_grad_expected", g=g)  # noqa: E731
    kept = [loss_fn(h, w, 1.0)]
    kept[0].backward()
    with torch.no_grad():
        kept.append(loss_fn(h, w, 1.0))
    assert not main_grad_module._OUTSTANDING and not main_grad_module._POISONED
    before = w.detach().clone()
    _megatron_like_step(optimizer, w)
    assert reference.rel_err(before - w.detach(), 0.5 * ref_dw) < TOL


# ------------------------------------------------------------- TP=2 with sequence parallelism
def _tp_worker(rank, world, case, entry):
    import torch.distributed as dist

    group = dist.group.WORLD
    v_local = VOCAB // world
    seq_slice = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    hidden_slice = case["h"].transpose(0, 1)[seq_slice].contiguous()  # [T/TP, B, H]
    w_shard = case["w"][rank * v_local:(rank + 1) * v_local]
    out = {}

    def loss_fn(target):
        return lambda x, wt, g: fused_loss(entry, case, x, wt, "fast", target, group, sp=True, g=g)

    for target in ("main_grad", "main_grad_expected"):
        for scenario in (checkpoint_non_reentrant, changing_loss_scale, megatron_loss_scaling):
            h, w = leaves({"h": hidden_slice, "w": w_shard}, target)
            loss, scale = scenario(loss_fn(target), h, w)
            out[f"{target}:{scenario.__name__}"] = (loss, scale, h.grad.transpose(0, 1).clone(),
                                                    w.main_grad.clone())
    # dropped forward, then the next call raises on both ranks (no hang), then zeroed and exact
    h, w = leaves({"h": hidden_slice, "w": w_shard}, "main_grad_expected")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fused_loss(entry, case, h, w, "fast", "main_grad_expected", group, sp=True)
    try:
        fused_loss(entry, case, h, w, "fast", "main_grad_expected", group, sp=True)
        out["raised"] = None
    except ValueError as error:
        out["raised"] = str(error)
    w.main_grad.zero_()
    loss, scale = plain(loss_fn("main_grad_expected"), h, w)
    out["dropped_then_step"] = (loss, scale, h.grad.transpose(0, 1).clone(), w.main_grad.clone())
    return out


@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_tp2_sequence_parallel_pairings(entry):
    """TP=2 + SP, main_grad, fast mode: each rank's dX slice and dW shard against float64 after a
    non-reentrant checkpoint, a changing loss scale and Megatron's tiny per-micro-batch loss
    scales (upstream gradient expected or not), and a dropped forward (raises on both ranks)."""
    case = make_case(seed=3)
    ref_loss, ref_dx, ref_dw = reference_grads(entry, case)
    results = run_workers(_tp_worker, 2, case, entry)
    v_local = VOCAB // 2
    for rank, out in enumerate(results):
        assert out["raised"] is not None and "never backpropagated" in out["raised"], rank
        seq_slice = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
        for name in [k for k in out if k != "raised"]:
            loss, scale, dx, dw = out[name]
            assert abs(loss.double() - ref_loss) <= TOL * max(1.0, abs(ref_loss)), (rank, name)
            assert reference.rel_err(dx, scale * ref_dx[:, seq_slice]) < TOL, (rank, name, "dX")
            assert reference.rel_err(dw, scale * ref_dw[rank * v_local:(rank + 1) * v_local]) < TOL, (
                rank, name, "dW")


# ------------------------------------------------------------------ the Triton backend on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("entry", ["ce", "grpo"])
def test_cuda_bf16_checkpoint_and_dropped_forward(entry):
    """bf16 on the GPU (Triton kernels, fast mode, main_grad): the non-reentrant checkpoint gives
    the plain step's gradients, and a dropped forward poisons main_grad and raises."""
    case = {k: v.cuda() for k, v in make_case(seed=5).items()}
    grads = {}
    for name, scenario in (("plain", plain), ("checkpoint", checkpoint_non_reentrant)):
        h = case["h"].bfloat16().clone().requires_grad_()
        w = case["w"].bfloat16().clone().requires_grad_()
        w.main_grad = torch.zeros(w.shape, device="cuda")
        scenario(lambda x, wt, g: _cuda_loss(entry, case, x, wt, g), h, w)
        grads[name] = (h.grad.float(), w.main_grad.clone())
    for a, b in zip(grads["plain"], grads["checkpoint"]):
        assert reference.rel_err(b, a) < 2e-2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _cuda_loss(entry, case, h, w)
    assert torch.isnan(w.main_grad).all()
    with pytest.raises(ValueError, match="never backpropagated"):
        _cuda_loss(entry, case, h, w)


def _cuda_loss(entry, case, h, w, g=1.0):
    kw = dict(vocab_size=TRUE_VOCAB, impl="triton", accumulate_into_main_grad=True, expected_upstream_grad=g)
    if entry == "ce":
        return linear_cross_entropy(h, w, case["y"], label_smoothing=0.1, **kw)
    return linear_grpo_loss(h, w, case["y"].clamp(min=0), case["adv"].float(), case["mask"].float(), CONFIG,
                            old_logprobs=case["old"].float(), **kw)[0]


# --------------------------------------------------- context parallelism: each rank a CP slice
CP_POSITIONS = ([0, 1, 2, 3, 10, 11, 12, 13], [4, 5, 6, 7, 8, 9])  # megatron-like: ends on rank 0


def _cp_worker(rank, world, case):
    import torch.distributed as dist

    pos = CP_POSITIONS[rank]
    mine = {k: (v[:, pos] if k in ("h", "y", "mask", "old") else v) for k, v in case.items()}

    def cp_loss(h, w, g):
        return linear_grpo_loss(h, w, mine["y"].clamp(min=0), mine["adv"].float(), mine["mask"].float(), CONFIG,
                                old_logprobs=mine["old"].float(), cp_group=dist.group.WORLD, vocab_size=TRUE_VOCAB,
                                chunk_size=CHUNK, impl="torch", accumulate_into_main_grad=True,
                                expected_upstream_grad=g)[0]

    out = {}
    for scenario in (checkpoint_non_reentrant, changing_loss_scale, megatron_loss_scaling):
        h, w = leaves(mine, "main_grad_expected")
        loss, scale = scenario(cp_loss, h, w)
        out[scenario.__name__] = (loss, scale, h.grad.clone(), w.main_grad.clone())
    h, w = leaves(mine, "main_grad_expected")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cp_loss(h, w, 1.0)  # dropped
    try:
        cp_loss(h, w, 1.0)
        out["raised"] = None
    except ValueError as error:
        out["raised"] = str(error)
    return out


def test_cp2_slices_pairings():
    """GRPO with each of 2 context-parallel ranks holding a slice of every sequence, main_grad in
    fast mode: under a non-reentrant checkpoint and a changing loss scale each rank's dX slice is
    the float64 one and the ranks' main_grads add up to the float64 dW (Megatron sums them over
    DP x CP); a dropped forward raises on both ranks."""
    case = make_case(seed=9)
    ref_loss, ref_dx, ref_dw = reference_grads("grpo", case)
    results = run_workers(_cp_worker, 2, case)
    for name in ("checkpoint_non_reentrant", "changing_loss_scale", "megatron_loss_scaling"):
        total_dw = sum(out[name][3].double() for out in results)
        for rank, out in enumerate(results):
            loss, scale, dx, _ = out[name]
            assert abs(loss.double() - ref_loss) <= TOL * max(1.0, abs(ref_loss)), (rank, name)
            assert reference.rel_err(dx, scale * ref_dx[:, CP_POSITIONS[rank]]) < TOL, (rank, name, "dX")
        assert reference.rel_err(total_dw, results[0][name][1] * ref_dw) < TOL, (name, "dW")
    for rank, out in enumerate(results):
        assert out["raised"] is not None and "never backpropagated" in out["raised"], rank
