"""The performance schedules (lean tiles, vocab blocks, main_grad) against float64 dense references,
on CPU over gloo:

- memory_mode="lean" (ops/lean.py): tile sweeps with a fixed working set; values, dX and dW at
  TP 1/2/4 with ignored tokens, padded vocab, temperature, sequence parallel; its memory bound
  (largest allocation inside the op, flat in the number of tokens, no fp32 [V_local, H] buffer);
  sweep A's reference moving (and its sums rescaled) where a later vocab block is far above it.
- Megatron's main_grad with gradients in the forward pass: dW added to main_grad during the
  forward when the upstream gradient is expected (no [V_local, H] buffer of its own), else held in
  an fp32 buffer until the backward; retained graphs, SP.

The tile / block sizes are shrunk (monkeypatched module constants, which tests/dist.py applies in
the gloo workers too) so that every sweep runs over several tiles in both directions. Tolerances as in
test_ops.py (fp32 2e-5, bf16 2e-2 relative norm).
"""

import pytest
import torch

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss
from megatron_fused_ce.ops import api, lean
from op_cases import TOL, check_against_reference, local_inputs, make_case, reference_ce, world_group


@pytest.fixture
def small_tiles(monkeypatch):
    """Lean tiles of 16 rows x 16 columns (sweeps A/A'), dW over 12-token chunks in 16-column
    blocks (sweep B)."""
    monkeypatch.setattr(lean, "_MAX_COLS_A", 16)
    monkeypatch.setattr(lean, "_MAX_ROWS_B", 24)
    monkeypatch.setattr(api, "LEAN_WORKSET_BYTES", 6000)
    monkeypatch.setattr(api, "LEAN_WORKSET_PER_VOCAB_ROW", 0)


def _logprobs_worker(rank, world, case, memory_mode):
    hidden, weight = local_inputs(rank, case)
    out = linear_logprobs(hidden, weight, case["labels"], tp_group=world_group(world), vocab_size=case["vocab"],
                          temperature=case["T"], return_entropy=True, chunk_size=case["chunk_size"],
                          sequence_parallel=case["sp"], impl="torch", memory_mode=memory_mode)
    ((out.logprobs * case["grad_lp"]).sum() + (out.entropy * case["grad_ent"]).sum()).backward()
    return out.logprobs.detach(), out.entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("memory_mode", ["lean", "fast"])
@pytest.mark.parametrize("tp, sp, dtype", [(1, False, torch.float32), (1, False, torch.bfloat16),
                                           (2, True, torch.float32), (2, False, torch.bfloat16),
                                           (4, True, torch.bfloat16)])
def test_logprobs_modes_match_dense_reference(small_tiles, memory_mode, tp, sp, dtype):
    case = make_case(300 + 7 * tp + sp, tp, dtype=dtype, sp=sp, seq=24, batch=3, vocab=150)
    check_against_reference(case, run_workers(_logprobs_worker, tp, case, memory_mode), f"{memory_mode} ")


def test_lean_shard_of_padding_only(small_tiles):
    # vocab 50 over 4 ranks of 20 rows: rank 2 holds 10 padding rows, rank 3 only padding.
    case = make_case(11, 4, vocab=50, extra_pad=7, chunk_size=1000)
    check_against_reference(case, run_workers(_logprobs_worker, 4, case, "lean"), "lean ")
    check_against_reference(case, run_workers(_logprobs_worker, 4, case, "fast"), "fast ")


def _ce_worker(rank, world, case, reduction, smoothing, z_loss, upstream, memory_mode, main_grad):
    hidden, weight = local_inputs(rank, case)
    if main_grad:
        weight.main_grad = torch.full(weight.shape, 0.25)
        weight.grad_added_to_main_grad = False
    loss = linear_cross_entropy(hidden, weight, case["labels"], tp_group=world_group(world),
                                vocab_size=case["vocab"], reduction=reduction, label_smoothing=smoothing,
                                z_loss_weight=z_loss, temperature=case["T"], chunk_size=case["chunk_size"],
                                sequence_parallel=case["sp"], impl="torch", memory_mode=memory_mode,
                                accumulate_into_main_grad=main_grad)
    (loss * upstream).sum().backward()
    dw = weight.main_grad - 0.25 if main_grad else weight.grad
    if main_grad:
        assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape
    return loss.detach(), hidden.grad, dw


def check_ce(case, results, reduction, smoothing, z_loss, upstream, what):
    ref_loss, ref_dx, ref_dw = reference_ce(case, reduction, smoothing, z_loss, upstream)
    tp, tol, v_local = case["tp"], TOL[case["dtype"]], case["v_local"]
    for rank, (loss, dx, dw) in enumerate(results):
        ref_dx_rank = ref_dx
        if case["sp"]:
            s_local = ref_dx.shape[0] // tp
            ref_dx_rank = ref_dx[rank * s_local:(rank + 1) * s_local]
        for name, out, ref in (("ce_loss", loss, ref_loss), ("ce_dX", dx, ref_dx_rank),
                               ("ce_dW", dw, ref_dw[rank * v_local:(rank + 1) * v_local])):
            err = reference.record(f"{what} {name}", tp, case["dtype"], reference.rel_err(out, ref))
            assert err <= tol, f"{what} {reduction} rank {rank} {name}: {err:.2e}"


@pytest.mark.parametrize("memory_mode, main_grad", [("lean", False), ("lean", True), ("fast", False),
                                                    ("fast", True)])
@pytest.mark.parametrize("tp, reduction, dtype", [(1, "mean", torch.float32), (1, "sum", torch.bfloat16),
                                                  (2, "mean", torch.bfloat16), (2, "none", torch.float32),
                                                  (4, "sum", torch.float32)])
def test_cross_entropy_modes_match_dense_reference(small_tiles, memory_mode, main_grad, tp, reduction, dtype):
    """Label smoothing, z-loss, padded vocab, ignored tokens, temperature, and an upstream gradient
    != 1 (grad-in-forward must scale, main_grad too)."""
    case = make_case(400 + tp, tp, dtype=dtype, sp=tp > 1, seq=24, batch=3, vocab=150)
    g = torch.Generator().manual_seed(7)
    upstream = torch.randn(case["labels"].shape, generator=g) if reduction == "none" else torch.tensor(3.5)
    args = (reduction, 0.1, 1e-3, upstream, memory_mode, main_grad)
    check_ce(case, run_workers(_ce_worker, tp, case, *args), *args[:4], f"{memory_mode}{'+mg' if main_grad else ''}")


# ---------------------------------------------------------------- main_grad: dW in the forward
class _Created(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an aten op allocates while active: (shape, dtype, bytes); and the matmul count."""

    MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
               torch.ops.aten.addmm_.default, torch.ops.aten.addmm.out)

    def __init__(self):
        super().__init__()
        self.created, self.matmuls = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.MATMULS:
            self.matmuls += 1
        # new memory only: outputs that alias an input's storage (views, in-place ops) are not counted
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.created.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return out


@pytest.mark.parametrize("expected", [True, False], ids=["expected", "unknown"])
@pytest.mark.parametrize("upstream, chunk", [(1.0, 10), (1.0, None), (2.5, 10), (1e-5, None)])
def test_main_grad_gets_weight_grad_in_forward(small_tiles, upstream, chunk, expected):
    """Gradients in the forward pass with Megatron's main_grad: 3 GEMMs per chunk (logits, dW, dX)
    whatever the upstream gradient g, none in the backward. With g expected at forward time, dW
    goes straight into main_grad: no [V_local, H] fp32 tensor is created (on CPU the chunk's
    product is made in bf16 and added: a bf16 temporary); with g unknown, exactly one, the fp32
    buffer that waits for g."""
    torch.manual_seed(5)
    n, hdim, v = 40, 16, 30
    h = torch.randn(n, hdim, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, hdim, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (n,))
    y[::7] = -100
    prior = 0.5 * upstream  # earlier micro-batches' sum, of the size of this one's (fp32 rounding)
    w.main_grad = torch.full((v, hdim), prior)
    w.grad_added_to_main_grad = False
    with _Created() as mode:
        loss = linear_cross_entropy(h, w, y, chunk_size=chunk, label_smoothing=0.05, accumulate_into_main_grad=True,
                                    expected_upstream_grad=upstream if expected else None)
        (loss * upstream).backward()
    buffers = [c for c in mode.created if c[0] == (v, hdim) and c[1] == torch.float32]
    assert len(buffers) == (0 if expected else 1), mode.created
    chunks = -(-int((y != -100).sum()) // (chunk or n))
    assert mode.matmuls == 3 * chunks
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(hd @ wd.t(), y, label_smoothing=0.05) * upstream
    ref_dx, ref_dw = torch.autograd.grad(ref, (hd, wd))
    assert reference.rel_err(w.main_grad - prior, ref_dw) < TOL[torch.bfloat16]
    assert reference.rel_err(h.grad, ref_dx) < TOL[torch.bfloat16]
    assert w.grad_added_to_main_grad and w.grad.shape == w.shape


@pytest.mark.parametrize("memory_mode, main_grad", [("fast", True), ("lean", True), ("lean", False)])
def test_second_backward_with_retained_graph(small_tiles, memory_mode, main_grad):
    """g1 dX + g2 dX and g1 dW + g2 dW over two backwards through the same graph (main_grad: the
    forward's unit dW counted once; lean: dX scaled in place the first time, recomputed the second)."""
    torch.manual_seed(6)
    h = torch.randn(30, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (30,))
    if main_grad:
        w.main_grad = torch.zeros(40, 16)
    loss = linear_cross_entropy(h, w, y, chunk_size=8, memory_mode=memory_mode, accumulate_into_main_grad=main_grad)
    (2.0 * loss).backward(retain_graph=True)
    (3.0 * loss).backward()
    if not main_grad:
        w.main_grad = w.grad
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_dx, ref_dw = torch.autograd.grad(torch.nn.functional.cross_entropy(hd @ wd.t(), y), (hd, wd))
    assert reference.rel_err(w.main_grad, 5.0 * ref_dw) < 2e-5
    assert reference.rel_err(h.grad, 5.0 * ref_dx) < 2e-5


def _grpo_worker(rank, world, case, memory_mode, main_grad):
    hidden, weight = local_inputs(rank, case)
    if main_grad:
        weight.main_grad = torch.zeros(weight.shape)
    labels = case["labels"].t()  # [B, T] layout
    mask = (labels != -100).float()
    g = torch.Generator().manual_seed(11)
    advantages = torch.randn(labels.shape[0], generator=g)
    old = torch.randn(labels.shape, generator=g) * 0.1 - 3.0
    loss, _ = linear_grpo_loss(hidden.transpose(0, 1), weight, labels, advantages, mask, GRPOConfig(),
                               old_logprobs=old, tp_group=world_group(world), vocab_size=case["vocab"],
                               temperature=case["T"], chunk_size=case["chunk_size"], impl="torch",
                               memory_mode=memory_mode, accumulate_into_main_grad=main_grad)
    (2.0 * loss).backward()
    return loss.detach(), hidden.grad, weight.main_grad if main_grad else weight.grad


@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_modes_agree(small_tiles, tp):
    """linear_grpo_loss: lean and main_grad give the fast mode's loss and gradients."""
    case = make_case(500 + tp, tp, dtype=torch.float32, seq=16, batch=4, vocab=120)
    base = run_workers(_grpo_worker, tp, case, "fast", False)
    for mode, main_grad in (("lean", False), ("lean", True), ("fast", True)):
        for (loss, dx, dw), (rloss, rdx, rdw) in zip(run_workers(_grpo_worker, tp, case, mode, main_grad), base):
            for name, a, b in (("loss", loss, rloss), ("dX", dx, rdx), ("dW", dw, rdw)):
                assert reference.rel_err(a, b) < 2e-5, (mode, main_grad, name)


# ---------------------------------------------------------- lean: memory bound, reference that moves
@pytest.mark.parametrize("fn", ["cross_entropy", "logprobs"])
def test_lean_memory_bound_is_flat_in_tokens(monkeypatch, fn):
    """Every tensor the lean op creates, except the returned gradients (one [N, H] dX, [V, H] dW
    in the weight dtype), fits the working set; the largest is the same at N and 4N; no fp32
    [V_local, H] buffer and nothing of [N, V_local] / [chunk, V_local] size. (Sweep B's dW GEMMs
    take up to _MAX_ROWS_B tokens at once: shrunk here so that both N are past it.)"""
    workset = 256 * 1024
    monkeypatch.setattr(api, "LEAN_WORKSET_BYTES", workset)
    monkeypatch.setattr(api, "LEAN_WORKSET_PER_VOCAB_ROW", 0)
    monkeypatch.setattr(lean, "_MAX_ROWS_B", 64)
    v, hdim = 1000, 16
    largest = []
    for n in (200, 800):
        torch.manual_seed(n)
        h = torch.randn(n, hdim, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, hdim) * 0.2).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, v, (n,))
        with _Created() as mode:
            if fn == "logprobs":
                out = linear_logprobs(h, w, y, return_entropy=True, memory_mode="lean")
                (out.logprobs.sum() + out.entropy.sum()).backward()
            else:
                linear_cross_entropy(h, w, y, label_smoothing=0.1, memory_mode="lean").backward()
        returned = {((n, hdim), torch.bfloat16), ((v, hdim), torch.bfloat16)}
        working = [c for c in mode.created if (c[0], c[1]) not in returned]
        # one [N, H] buffer: dX, scaled in place (not a second, scaled copy of it)
        assert sum(c[:2] == ((n, hdim), torch.bfloat16) for c in mode.created) == 1
        assert not [c for c in mode.created if c[0] == (v, hdim) and c[1] == torch.float32]
        biggest = max(working, key=lambda c: c[2])
        assert biggest[2] <= workset, biggest
        largest.append(biggest[2])
        reference.record_memory(f"linear_{fn} lean: largest working tensor / lean working set",
                                biggest[2] / workset)
    assert largest[0] == largest[1], largest  # flat in N


def test_lean_reference_moves_where_a_later_block_is_far_above_it(small_tiles):
    """Sweep A takes the row max of the first vocab block as its reference: a later block 200
    above it would overflow exp; the reference moves to that block's max, the row's sums and dX
    accumulator are rescaled, and loss, dX and dW stay exact."""
    torch.manual_seed(8)
    n, hdim, v = 20, 8, 64
    h = torch.randn(n, hdim, dtype=torch.float64).float()
    w = torch.randn(v, hdim) * 0.1
    w[50] = h[3] / h[3].square().sum() * 200.0  # z[3, 50] = 200, far above the first block's max
    y = torch.randint(0, v, (n,))
    y[3] = 50
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, memory_mode="lean")
    loss.backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    z = hd @ wd.t()
    assert (z[3, 50] - z[3, :16].max()).item() > 60  # the reference must move
    ref = torch.nn.functional.cross_entropy(z, y)
    ref.backward()
    for out, r in ((loss, ref), (hh.grad, hd.grad), (ww.grad, wd.grad)):
        assert torch.isfinite(out).all() and reference.rel_err(out, r) < 2e-5


def _overflow_worker(rank, world, h, w, y):
    v_local = w.shape[0] // world
    hh = h.clone().requires_grad_()
    ww = w[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, tp_group=world_group(world), label_smoothing=0.1, memory_mode="lean")
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


def test_lean_reference_that_moves_on_one_rank_only(small_tiles):
    """Under TP only rank 1's shard goes far above its first block: only rank 1's references
    move (no collective of its own, so nothing the other ranks must join), the merges over the
    ranks take each shard's reference as its partial max, and the result is exact."""
    torch.manual_seed(9)
    n, hdim, v = 40, 8, 128
    h = torch.randn(n, hdim, dtype=torch.float64).float()
    w = torch.randn(v, hdim) * 0.1
    w[64 + 40] = h[5] / h[5].square().sum() * 150.0  # rank 1's 41st column: z[5, 104] = 150
    y = torch.randint(0, v, (n,))
    y[5] = 3
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    z = hd @ wd.t()
    assert (z[5, 104] - z[5, 64:80].max()).item() > 60  # rank 1's reference moves, rank 0's need not
    ref = torch.nn.functional.cross_entropy(z, y, label_smoothing=0.1)
    ref.backward()
    for rank, (loss, dx, dw) in enumerate(run_workers(_overflow_worker, 2, h, w, y)):
        assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
        assert reference.rel_err(loss, ref) < 2e-5 and reference.rel_err(dx, hd.grad) < 2e-5
        assert reference.rel_err(dw, wd.grad[rank * 64:(rank + 1) * 64]) < 2e-5


def _bad_mode_worker(rank, world):
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(8, 4, requires_grad=True)
    try:
        linear_logprobs(h, w, torch.randint(0, 16, (6,)), tp_group=world_group(world),
                        memory_mode="lean" if rank == 0 else "tiny")
    except ValueError as exc:
        return str(exc)
    return None


def test_memory_mode_errors_on_every_rank():
    for message in run_workers(_bad_mode_worker, 2, timeout=30):
        assert message is not None and "memory_mode" in message


@pytest.mark.parametrize("n, hdim, v", [(8192, 4096, 128256), (8192, 2304, 256000), (16384, 3584, 152064),
                                        (131072, 4096, 128256)])
def test_lean_default_workset_is_under_3_percent_of_the_8192_token_logits(n, hdim, v):
    """The documented budget (README, api.LEAN_WORKSET_PER_VOCAB_ROW: 400 B per row of the whole vocab,
    >= 32 MiB, about 2.4 % of the bf16 logits of 8192 tokens, whatever N) at the benchmark shapes, and the CUDA tiles
    (Triton kernels work in place: 2 B per tile element) fit it in every sweep: tile + fp32
    accumulator + gathered W rows (A), tile + fp32 dW accumulator when token chunks span (B)."""
    workset = api.lean_workset_bytes(v, 1)
    assert workset <= 0.03 * 2 * 8192 * v
    for accumulates in (False, True):
        t = lean.tile_sizes(n, v, hdim, 2, workset, tile_bytes_per_element=2, weight_grad_accumulates=accumulates)
        assert t.rows_a * t.cols_a * 2 + t.rows_a * hdim * (4 + 2) <= workset, t
        spans = n > lean._MAX_ROWS_B and not accumulates
        assert t.cols_b * (t.rows_b * 2 + (4 * hdim if spans else 0)) <= workset, t
        assert min(t.rows_a, t.cols_a, t.rows_b, t.cols_b) >= 16, t


@pytest.mark.parametrize("n, hdim, v, rows_a, cols_a", [(8192, 4096, 128256, 1024, 12288),
                                                        (8192, 2304, 256000, 2048, 16384),
                                                        (16384, 3584, 152064, 1280, 12288)])
def test_lean_token_chunks_fill_the_working_set(n, hdim, v, rows_a, cols_a):
    """Sweep A's token chunks hold about one full wave of its P @ W GEMM's output ([rows, H]), or
    more rows where the working set holds them next to a full-width (_MAX_COLS_A) tile: at
    8192x2304x256000, 4 chunks of 2048 rows x 16384 columns instead of 5 of 1664 (faster on an
    H100: docs/design.md §10.7)."""
    t = lean.tile_sizes(n, v, hdim, 2, api.lean_workset_bytes(v, 1), tile_bytes_per_element=2,
                        weight_grad_accumulates=False)
    assert (t.rows_a, t.cols_a) == (rows_a, cols_a)


def test_lean_with_sampler_settings():
    """The sampler's statistics run in chunks of logits: lean + a filter / return_topk is a
    ValueError naming memory_mode; settings that are off (top_p=1, min_p=0, top_k=0 as vLLM
    spells it) are today's lean call."""
    torch.manual_seed(3)
    h, w, y = torch.randn(6, 4), torch.randn(10, 4), torch.randint(0, 10, (6,))
    for sampler in (dict(top_k=3), dict(top_p=0.5), dict(min_p=0.1), dict(return_topk=2)):
        with pytest.raises(ValueError, match="memory_mode"):
            linear_logprobs(h, w, y, memory_mode="lean", **sampler)
    off = linear_logprobs(h, w, y, memory_mode="lean", top_p=1.0, min_p=0.0, top_k=0).logprobs
    ref = torch.log_softmax(h.double() @ w.double().t(), -1).gather(1, y[:, None]).squeeze(1)
    assert reference.rel_err(off, ref) < 2e-5


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_lean_tiles_keep_their_size_under_tensor_parallelism(tp):
    """The working set is per row of the whole vocab: a TP shard gets the TP=1 budget and the same
    tile sizes (a per-shard budget shrinks them at TP=2 until the sweeps are launch-bound, about 3x
    slower on 2 x H200), i.e. a larger share of its own logits."""
    v, hdim, n = 128256, 4096, 8192
    assert api.lean_workset_bytes(v // tp, tp) == api.lean_workset_bytes(v, 1)
    one = lean.tile_sizes(n, v, hdim, 2, api.lean_workset_bytes(v, 1), tile_bytes_per_element=2,
                          weight_grad_accumulates=False)
    shard = lean.tile_sizes(n, v // tp, hdim, 2, api.lean_workset_bytes(v // tp, tp), tile_bytes_per_element=2,
                            weight_grad_accumulates=False)
    assert (shard.rows_a, shard.rows_b) == (one.rows_a, one.rows_b)
    assert shard.cols_a == min(one.cols_a, v // tp) and shard.cols_b == min(one.cols_b, v // tp)
