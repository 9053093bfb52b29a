"""linear_logprobs / linear_cross_entropy against a float64 dense reference, at TP 1/2/4 over gloo.

Every case draws fresh random inputs, pads the vocab (the last shard holds padding columns), uses
a temperature != 1, a chunk size that divides neither the token count nor the labelled-token count,
3-D hidden [S, B, H], and non-uniform upstream gradients; values, dX and dW are all compared.

Stated tolerances, as ||out - ref|| / ||ref|| against float64 math on the same (rounded) inputs:
  float32 inputs: 2e-5 for every quantity.
  bfloat16 inputs: 2e-2 (logits are produced in bf16 like Megatron's output layer, dlogits are
  rounded to bf16 before the two backward GEMMs; softmax math is fp32).
"""

import zlib

import pytest
import torch
import torch.nn.functional as F

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from op_cases import (
    TOL,
    CountMatmuls,
    check_against_reference,
    local_inputs,
    logprobs_worker,
    make_case,
    reference_ce,
    world_group,
)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ignored", [0.0, 0.5])
def test_logprobs_match_dense_reference(tp, sp, dtype, ignored):
    if sp and tp == 1:
        pytest.skip("sequence parallel needs TP > 1")
    seed = zlib.crc32(repr((tp, sp, str(dtype), ignored)).encode()) % 10_000
    case = make_case(seed, tp, dtype=dtype, sp=sp, ignored=ignored)
    check_against_reference(case, run_workers(logprobs_worker, tp, case))


@pytest.mark.parametrize("tp", [1, 4])
def test_whole_shard_of_padding_and_large_chunk(tp):
    # vocab 50 over 4 ranks of 20 rows: rank 2 holds 10 padding rows, rank 3 only padding.
    case = make_case(11, tp, vocab=50, extra_pad=20 - 13 if tp == 4 else 3, chunk_size=1000)
    assert tp == 1 or case["v_local"] == 20
    check_against_reference(case, run_workers(logprobs_worker, tp, case))


def test_float16_and_2d_hidden():
    case = make_case(5, 2, dtype=torch.float16)
    case["hidden"] = case["hidden"].reshape(-1, case["hidden"].shape[-1])
    for key in ("labels", "grad_lp", "grad_ent"):
        case[key] = case[key].reshape(-1)
    check_against_reference(case, run_workers(logprobs_worker, 2, case))


def test_auto_chunk_size():
    case = make_case(6, 2, chunk_size=None)
    check_against_reference(case, run_workers(logprobs_worker, 2, case))


# ---------------------------------------------------------------- linear_cross_entropy
def _ce_worker(rank, world, case, reduction, smoothing, z_loss, upstream):
    hidden, weight = local_inputs(rank, case)
    loss = linear_cross_entropy(hidden, weight, case["labels"], tp_group=world_group(world),
                                vocab_size=case["vocab"], reduction=reduction, label_smoothing=smoothing,
                                z_loss_weight=z_loss, temperature=case["T"], chunk_size=case["chunk_size"],
                                sequence_parallel=case["sp"], impl="torch")
    (loss * upstream).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_matches_dense_reference(tp, reduction, dtype):
    case = make_case(100 + tp, tp, dtype=dtype, sp=tp > 1 and reduction != "sum")
    smoothing, z_loss = 0.1, 1e-3
    g = torch.Generator().manual_seed(7)
    # a scaled loss / arbitrary per-token upstream gradients: grad-in-forward must not assume 1
    upstream = torch.randn(case["labels"].shape, generator=g) if reduction == "none" else torch.tensor(3.5)
    results = run_workers(_ce_worker, tp, case, reduction, smoothing, z_loss, upstream)
    ref_loss, ref_dx, ref_dw = reference_ce(case, reduction, smoothing, z_loss, upstream)
    tol, v_local = TOL[dtype], case["v_local"]
    for rank, (loss, dx, dw) in enumerate(results):
        ref_dx_rank = ref_dx
        if case["sp"]:
            s_local = ref_dx.shape[0] // tp
            ref_dx_rank = ref_dx[rank * s_local:(rank + 1) * s_local]
        for name, out, ref in (("ce_loss", loss, ref_loss), ("ce_dX", dx, ref_dx_rank),
                               ("ce_dW", dw, ref_dw[rank * v_local:(rank + 1) * v_local])):
            err = reference.record(name, tp, dtype, reference.rel_err(out, ref))
            assert err <= tol, f"{reduction} rank {rank} {name}: {err:.2e}"


# ---------------------------------------------------------------- degenerate inputs
def _degenerate_worker(rank, world):
    group = world_group(world)
    w = torch.randn(8, 4, requires_grad=True)
    # no tokens at all
    out = linear_logprobs(torch.randn(0, 4, requires_grad=True), w, torch.zeros(0, dtype=torch.long),
                          tp_group=group, return_entropy=True)
    assert out.logprobs.shape == (0,) and out.entropy.shape == (0,)
    # every token ignored
    h = torch.randn(5, 3, 4, requires_grad=True)
    y = torch.full((5, 3), -100)
    out = linear_logprobs(h, w, y, tp_group=group, return_entropy=True)
    loss = linear_cross_entropy(h, w, y, tp_group=group, reduction="mean", label_smoothing=0.1,
                                z_loss_weight=0.1)
    (out.logprobs.sum() + out.entropy.sum() + loss).backward()
    return out.logprobs, out.entropy, loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("tp", [1, 2])
def test_empty_and_all_ignored(tp):
    for lp, ent, loss, dx, dw in run_workers(_degenerate_worker, tp):
        assert torch.all(lp == 0) and torch.all(ent == 0)
        assert loss.item() == 0.0
        assert dx is not None and dw is not None
        assert torch.all(dx == 0) and torch.all(dw == 0)


# ---------------------------------------------------------------- determinism, no_grad, memory
def _twice_worker(rank, world, case):
    first = logprobs_worker(rank, world, case)
    second = logprobs_worker(rank, world, case)
    return all(torch.equal(a, b) for a, b in zip(first, second))


def test_bitwise_deterministic():
    case = make_case(21, 2, dtype=torch.bfloat16, sp=True)
    assert all(run_workers(_twice_worker, 2, case))


def test_no_grad_saves_nothing():
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(10, 4, requires_grad=True)
    y = torch.randint(0, 10, (6,))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with torch.no_grad():
            out = linear_logprobs(h, w, y, return_entropy=True)
            loss = linear_cross_entropy(h, w, y)
    assert out.logprobs.grad_fn is None and loss.grad_fn is None
    assert packed == []
    with torch.no_grad():
        ref = linear_logprobs(h, w, y).logprobs
    assert torch.allclose(ref, linear_logprobs(h, w, y).logprobs)


@pytest.mark.parametrize("fn", ["logprobs", "cross_entropy"])
def test_largest_intermediate_is_one_chunk(fn):
    n, hidden, v_local, chunk = 2048, 32, 512, 128
    h = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(v_local, hidden, requires_grad=True)
    y = torch.randint(0, v_local, (n,))
    y[::5] = -100
    with reference.LargestTensor() as mode:
        if fn == "logprobs":
            out = linear_logprobs(h, w, y, chunk_size=chunk, return_entropy=True)
            (out.logprobs.sum() + out.entropy.sum()).backward()
        else:
            linear_cross_entropy(h, w, y, chunk_size=chunk, label_smoothing=0.1).backward()
    fraction = mode.largest / (n * v_local)
    reference.record_memory(f"linear_{fn} (chunk {chunk} of {n} rows): largest tensor / dense [N, V] logits",
                            fraction)
    # one chunk of logits: chunk / n = 1/16 of the dense [N, V_local] tensor
    assert mode.largest <= chunk * v_local, (mode.largest, chunk * v_local)


# ---------------------------------------------------------------- Megatron main_grad
def test_accumulates_into_main_grad():
    torch.manual_seed(3)
    h = torch.randn(9, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 16, (9,))
    linear_logprobs(h, w, y, chunk_size=4).logprobs.sum().backward()
    expected = w.grad.float()
    w.grad = None
    w.main_grad = torch.ones(16, 8)  # fp32 buffer with something already accumulated
    w.grad_added_to_main_grad = False
    linear_logprobs(h, w, y, chunk_size=4, accumulate_into_main_grad=True).logprobs.sum().backward()
    assert w.grad_added_to_main_grad is True
    assert w.grad.shape == w.shape and w.grad.dtype == w.dtype  # Megatron's dummy gradient
    assert reference.rel_err(w.main_grad - 1.0, expected) < 1e-2


def _ddp_grad_hook(w):
    """What Megatron's DDP does with a parameter's .grad after its backward (_make_backward_post_hook)."""
    if w.grad is not None and (not w.grad_added_to_main_grad or getattr(w, "zero_out_wgrad", False)):
        w.main_grad.add_(w.grad.float())
    w.grad = None


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fn", ["cross_entropy", "logprobs"])
def test_main_grad_dummy_gradient_follows_megatron(monkeypatch, fn, tied):
    """The dummy gradient is uninitialized (here: poisoned with NaN) unless the weight asks for zeros
    with `zero_out_wgrad`, which Megatron sets on an output weight tied to the embedding on the same
    stage: DDP then adds .grad (the embedding's gradient + the dummy) to main_grad, and only a zero
    dummy keeps main_grad exact."""
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
    g = torch.Generator().manual_seed(12)
    tokens, y = torch.randint(0, 16, (10,), generator=g), torch.randint(0, 16, (10,), generator=g)
    w0 = torch.randn(16, 8, generator=g)

    def loss_of(w, **kw):
        h = F.embedding(tokens, w) if tied else w0[tokens] * 0.5  # the embedding shares w when tied
        if fn == "cross_entropy":
            return linear_cross_entropy(h, w, y, chunk_size=4, **kw)
        return -linear_logprobs(h, w, y, chunk_size=4, **kw).logprobs.sum()

    w = w0.clone().requires_grad_()
    loss_of(w).backward()
    expected = w.grad.clone()
    w = w0.clone().requires_grad_()
    w.main_grad, w.grad_added_to_main_grad = torch.ones(16, 8), False
    if tied:
        w.zero_out_wgrad = True
    loss_of(w, accumulate_into_main_grad=True).backward()
    assert w.grad_added_to_main_grad is True
    assert bool(torch.isnan(w.grad).any()) != tied  # zeros (+ the embedding's gradient) only when asked
    _ddp_grad_hook(w)
    assert torch.allclose(w.main_grad - 1.0, expected, atol=1e-5)


# ---------------------------------------------------------------- gradients in the forward pass


@pytest.mark.parametrize("reduction,label_smoothing,gemms", [("mean", 0.0, 12), ("sum", 0.0, 12), ("none", 0.0, 15),
                                                               ("none", 0.1, 16)])
def test_cross_entropy_gradients_in_forward_use_three_gemms(reduction, label_smoothing, gemms):
    """4 chunks: 3 GEMMs each with the gradients made in the forward ("mean", "sum"); per-token
    losses ("none": any upstream gradient) hold the last chunk's dlogits of -log p_y from the
    forward and recompute the others (4 GEMMs each); with smoothing every chunk is recomputed."""
    h = torch.randn(40, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    y = torch.randint(0, 30, (40,))
    with CountMatmuls() as mode:
        loss = linear_cross_entropy(h, w, y, reduction=reduction, chunk_size=10, label_smoothing=label_smoothing)
        loss.sum().backward()
    assert mode.count == gemms


def test_cross_entropy_gradients_in_forward_into_main_grad():
    torch.manual_seed(4)
    h = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    y = torch.randint(0, 16, (12,))
    (2.0 * linear_cross_entropy(h, w, y, chunk_size=5, z_loss_weight=0.01)).backward()
    expected_dw, expected_dx = w.grad.clone(), h.grad.clone()
    h.grad, w.grad = None, None
    w.main_grad = torch.full((16, 8), 0.5)
    w.grad_added_to_main_grad = False
    (2.0 * linear_cross_entropy(h, w, y, chunk_size=5, z_loss_weight=0.01,
                                accumulate_into_main_grad=True)).backward()
    assert w.grad_added_to_main_grad is True and w.grad.shape == w.shape
    assert torch.allclose(w.main_grad - 0.5, expected_dw, atol=1e-6)
    assert torch.allclose(h.grad, expected_dx, atol=1e-6)


@pytest.mark.parametrize("fn", ["cross_entropy", "logprobs"])
def test_second_backward_with_retained_graph(fn):
    """A second backward through a retained graph gets the right gradients although the first
    handed its buffers over (scaled in place): the second recomputes them (in bf16: other
    roundings than the first, so each backward is checked against float64 at the bf16 tolerance)."""
    h = torch.randn(20, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(12, 8, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 12, (20,))

    def total(hidden, weight):
        return (linear_cross_entropy(hidden, weight, y, chunk_size=6) if fn == "cross_entropy"
                else linear_logprobs(hidden, weight, y, chunk_size=6).logprobs.sum())

    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t(), dim=-1).gather(1, y[:, None]).squeeze(1)
    ref_dx, ref_dw = torch.autograd.grad(3.0 * (-logp.mean() if fn == "cross_entropy" else logp.sum()), (h64, w64))
    loss = total(h, w)
    (3.0 * loss).backward(retain_graph=True)
    first_dx, first_dw = h.grad.clone(), w.grad.clone()
    (3.0 * loss).backward()
    for first, both, ref in ((first_dx, h.grad, ref_dx), (first_dw, w.grad, ref_dw)):
        assert reference.rel_err(first, ref) < TOL[torch.bfloat16]
        assert reference.rel_err(both.double() - first.double(), ref) < TOL[torch.bfloat16]


class _WeightGradBuffers(torch.utils._python_dispatch.TorchDispatchMode):
    """Dtypes of every tensor created with the weight's shape, casts of existing tensors aside (on
    CPU an fp32-output product of bf16 inputs casts the weight: gemm.matmul_fp32; cuBLAS writes
    fp32 from bf16 itself), so that what is seen is a buffer made to hold dW."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.dtypes = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            return out
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape:
                self.dtypes.append(t.dtype)
        return out


@pytest.mark.parametrize("fn", ["logprobs", "cross_entropy"])
@pytest.mark.parametrize("chunk", [64, 40])
def test_one_gemm_weight_grad_needs_no_fp32_buffer(fn, chunk):
    """With one chunk of all rows, dW comes out of one GEMM in bf16: no fp32 [V_local, H] tensor
    (chunk 40 < 50 rows: several chunks sum dW in fp32, so the check can fail)."""
    torch.manual_seed(0)
    h = torch.randn(50, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(24, 16, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 24, (50,))
    with _WeightGradBuffers(w.shape) as mode:
        if fn == "logprobs":
            (linear_logprobs(h, w, y, chunk_size=chunk).logprobs * 0.7).sum().backward()
        else:
            (2.5 * linear_cross_entropy(h, w, y, chunk_size=chunk)).backward()
    assert (torch.float32 in mode.dtypes) == (chunk < 50), mode.dtypes
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = torch.log_softmax(hd @ wd.t(), -1).gather(1, y[:, None]).squeeze(1)
    ref = (logp * 0.7).sum() if fn == "logprobs" else -2.5 * logp.mean()
    ref_dw, = torch.autograd.grad(ref, wd)
    assert w.grad.dtype == torch.bfloat16
    assert reference.rel_err(w.grad, ref_dw) < 2e-2


def test_the_package_runs_without_triton():
    """`pip install -e ".[megatron]"` (the README's main job) brings no Triton: the package imports
    and runs on the torch backend, and impl="triton" is refused with a message, not an
    ImportError at import time (a module the torch path imports once needed Triton)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` raises ImportError
        "import torch\n"
        "from megatron_fused_ce import linear_cross_entropy, linear_logprobs\n"
        "from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss\n"
        "from megatron_fused_ce.ops import backends\n"
        "assert not backends.triton_available()\n"
        "h = torch.randn(8, 16, requires_grad=True); w = torch.randn(32, 16, requires_grad=True)\n"
        "y = torch.randint(0, 32, (8,))\n"
        "linear_cross_entropy(h, w, y).backward()\n"
        "linear_logprobs(h, w, y).logprobs.sum().backward()\n"
        "linear_grpo_loss(h.view(2, 4, 16), w, y.view(2, 4), torch.randn(2), torch.ones(2, 4), GRPOConfig())[0].backward()\n"
        "try:\n"
        "    linear_cross_entropy(h, w, y, impl='triton')\n"
        "except ValueError as error:\n"
        "    assert 'triton' in str(error)\n"
        "else:\n"
        "    raise AssertionError('impl=triton ran without Triton')\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
