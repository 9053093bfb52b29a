"""Log-probs of fast chunks: the dlogits of the chunk held from forward to backward, and their
product with W, made in the forward.

`linear_logprobs` without entropy makes d log p / d logits = one_hot - softmax and D·W in the
forward (chunked.LinearLogprobDlogitsInForward) for its only chunk (an RL micro-batch) or, with
several chunks, its last one; the backward scales them by each row's upstream gradient and makes
the other chunks' dlogits again. Protected here:

* which calls take it (a held chunk of at most api.DLOGITS_IN_FORWARD_MAX_BYTES, the default
  chunk budget; no entropy, not fp16, gradients wanted, no saved-tensor hooks) and which keep the
  recompute path; linear_cross_entropy's per-token losses (reduction="none", Megatron's output
  layer) without smoothing or z-loss take it too, as -log p_y;
* values, dX and dW against float64 dense math at TP 1/2/4 over gloo (with and without sequence
  parallelism), with ignored labels, padded vocab, temperature and non-uniform upstream gradients
  (the tolerances of tests/test_ops.py), in one chunk and in several whose size does not divide
  the rows;
* Megatron's main_grad at loss scales 1 to 1e-5 (dW added in the backward, from the exact g);
* three GEMMs in forward + backward for one chunk (its logits made once, turned into D in place),
  one fewer than the recompute path's for several;
* with several chunks, one chunk of logits alive at a time (D freed before the others are made
  again): tests/test_chunk_policy.py's test_one_chunk_of_logits_alive_at_a_time;
* a second backward through a retained graph, and a graph freed without backward (nothing written);
* the Triton backend (its dlogits kernel with unit coefficients) equal to the torch one.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import reference
from dist import run_workers
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.ops import api
from op_cases import TOL, CountMatmuls, autograd_nodes, check_against_reference, local_inputs, make_case, world_group

# the node that makes the dlogits in the forward: the general path's, or a remembered route's
# (ops/remembered_routes.py: a later call of a signature the suite called before)
PATHS = ("LinearLogprobDlogitsInForwardBackward", "StraightLogprobsBackward")


def _nodes(tensor):
    """{name: node} of the autograd nodes behind `tensor`."""
    return {type(node).__name__: node for node in autograd_nodes(tensor)}


def _path_node(tensor):
    """The node behind `tensor` that made its dlogits in the forward, or None."""
    nodes = _nodes(tensor)
    return next((nodes[name] for name in PATHS if name in nodes), None)


def _worker(rank, world, case):
    hidden, weight = local_inputs(rank, case)
    group = world_group(world)
    kwargs = dict(tp_group=group, vocab_size=case["vocab"], temperature=case["T"], chunk_size=case["chunk_size"],
                  sequence_parallel=case["sp"], impl="torch")
    out = linear_logprobs(hidden, weight, case["labels"], **kwargs)
    took = _path_node(out.logprobs) is not None
    (out.logprobs * case["grad_lp"]).sum().backward()
    with torch.no_grad():  # (the reference check compares an entropy too: the other path's)
        entropy = linear_logprobs(hidden, weight, case["labels"], **kwargs, return_entropy=True).entropy
    return out.logprobs.detach(), entropy, hidden.grad, weight.grad, took


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)],
                         ids=["tp1", "tp2", "tp4", "tp2_sp", "tp4_sp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [None, 13], ids=["one_chunk", "chunks_of_13"])
def test_matches_dense_reference(tp, sp, dtype, chunk_size):
    """60 rows: one chunk, or chunks of 13 (the held last chunk 8 rows); under sequence
    parallelism each rank holds 60 / TP of the rows, gathered in the forward and again in the
    backward, dX reduce-scattered."""
    seed = zlib.crc32(repr(("dlogits_in_forward", tp, sp, str(dtype), chunk_size)).encode()) % 10_000
    case = make_case(seed, tp, dtype=dtype, chunk_size=chunk_size, ignored=0.3, sp=sp)
    case["grad_ent"] = torch.zeros_like(case["grad_ent"])
    results = run_workers(_worker, tp, case)
    assert all(took for *_, took in results), "the call did not make its dlogits in the forward"
    check_against_reference(case, [r[:4] for r in results], what_prefix=f"chunk_size={chunk_size}{' SP' if sp else ''} ")


def _per_token_ce_worker(rank, world, case):
    """linear_cross_entropy(reduction="none") as the log-probs it negates: (-loss, the entropy of
    the recompute path, dX, dW of Σ loss · (-grad_lp), whether it made its dlogits in the forward)."""
    hidden, weight = local_inputs(rank, case)
    kwargs = dict(tp_group=world_group(world), vocab_size=case["vocab"], temperature=case["T"],
                  chunk_size=case["chunk_size"], sequence_parallel=case["sp"], impl="torch")
    loss = linear_cross_entropy(hidden, weight, case["labels"], reduction="none", **kwargs)
    took = _path_node(loss) is not None
    (loss * -case["grad_lp"]).sum().backward()
    with torch.no_grad():
        entropy = linear_logprobs(hidden, weight, case["labels"], **kwargs, return_entropy=True).entropy
    return -loss.detach(), entropy, hidden.grad, weight.grad, took


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)],
                         ids=["tp1", "tp2", "tp4", "tp2_sp", "tp4_sp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [None, 13], ids=["one_chunk", "chunks_of_13"])
def test_per_token_cross_entropy_matches_dense_reference(tp, sp, dtype, chunk_size):
    """Megatron's output layer asks for per-token losses (reduction="none", with sequence
    parallelism where TP > 1): -log p_y, whose dlogits -(one_hot - softmax) are made in the
    forward as log-probs' are."""
    seed = zlib.crc32(repr(("per_token_ce", tp, sp, str(dtype), chunk_size)).encode()) % 10_000
    case = make_case(seed, tp, dtype=dtype, chunk_size=chunk_size, ignored=0.3, sp=sp)
    case["grad_ent"] = torch.zeros_like(case["grad_ent"])
    results = run_workers(_per_token_ce_worker, tp, case)
    assert all(took for *_, took in results), "the call did not make its dlogits in the forward"
    check_against_reference(case, [r[:4] for r in results],
                            what_prefix=f"per-token CE chunk_size={chunk_size}{' SP' if sp else ''} ")


def test_per_token_cross_entropy_is_minus_the_log_probs():
    """The same bits as -linear_logprobs, values and gradients (the same node, negated); with
    smoothing or z-loss (another gradient per token) the recompute path."""
    g = torch.Generator().manual_seed(16)
    h = torch.randn(12, 8, generator=g)
    w = torch.randn(30, 8, generator=g)
    y = torch.randint(0, 30, (12,), generator=g)
    y[::4] = -100
    upstream = torch.randn(12, generator=g)
    results = []
    for entry in ("ce", "logprobs"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = (linear_cross_entropy(hh, ww, y, reduction="none", chunk_size=5) if entry == "ce"
               else -linear_logprobs(hh, ww, y, chunk_size=5).logprobs)
        (out * upstream).sum().backward()
        results.append((out.detach(), hh.grad, ww.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    for extra in (dict(label_smoothing=0.1), dict(z_loss_weight=1e-3)):
        hh = h.clone().requires_grad_()
        assert _path_node(linear_cross_entropy(hh, w, y, reduction="none", **extra)) is None


def _takes_the_path(**kwargs) -> bool:
    g = torch.Generator().manual_seed(3)
    dtype = kwargs.pop("dtype", torch.float32)
    h = torch.randn(12, 8, generator=g).to(dtype).requires_grad_()
    w = torch.randn(30, 8, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, 30, (12,), generator=g)
    return _path_node(linear_logprobs(h, w, y, **kwargs).logprobs) is not None


def test_which_calls_make_their_dlogits_in_the_forward():
    assert _takes_the_path()
    assert _takes_the_path(chunk_size=12)
    assert _takes_the_path(dtype=torch.bfloat16)
    assert _takes_the_path(chunk_size=5)  # several chunks: the last one's D held
    assert not _takes_the_path(return_entropy=True)  # the entropy's gradient is not one per row
    assert not _takes_the_path(dtype=torch.float16)
    assert not _takes_the_path(memory_mode="lean")
    assert not _takes_the_path(top_k=5)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not _takes_the_path()
    # the bound does not send a call of one chunk under the default chunk budget (up to 1 GiB of
    # logits: 16k-row calls, 64k-128k-wide shards) back to the recompute path's fourth GEMM
    assert api.DLOGITS_IN_FORWARD_MAX_BYTES >= api.DEFAULT_MAX_CHUNK_BYTES


def test_three_gemms_make_values_and_gradients():
    """The forward makes the chunk of logits once and turns it into D in place (a second logits
    GEMM for D is the recompute path's cost): logits, D·W, then dW in the backward."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(12, 8, generator=g).requires_grad_()
    w = torch.randn(30, 8, generator=g).requires_grad_()
    y = torch.randint(0, 30, (12,), generator=g)
    with CountMatmuls() as gemms:
        out = linear_logprobs(h, w, y)
        assert _path_node(out.logprobs) is not None
        (out.logprobs * torch.randn(12, generator=g)).sum().backward()
    assert gemms.count == 3, gemms.count


@pytest.mark.parametrize("chunk_size", [5, 4], ids=["last_chunk_shorter", "chunks_divide_the_rows"])
def test_several_chunks_make_one_gemm_fewer_than_recompute(chunk_size):
    """With several chunks the last one is made once and turned into D: 3 GEMMs for it, 4 for each
    of the others (statistics, then logits again, dX and dW), against 4 each on the recompute path
    (the call with entropy, whose gradient is zero here)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(12, 8, generator=g).requires_grad_()
    w = torch.randn(30, 8, generator=g).requires_grad_()
    y = torch.randint(0, 30, (12,), generator=g)
    upstream = torch.randn(12, generator=g)
    chunks = -(-12 // chunk_size)
    counts = []
    for entropy in (False, True):
        with CountMatmuls() as gemms:
            out = linear_logprobs(h, w, y, chunk_size=chunk_size, return_entropy=entropy)
            assert (_path_node(out.logprobs) is not None) != entropy
            (out.logprobs * upstream).sum().backward()
        counts.append(gemms.count)
    assert counts == [4 * chunks - 1, 4 * chunks], counts


def test_a_chunk_above_the_bound_keeps_the_recompute_path(monkeypatch):
    """D and D·W are held from forward to backward: only for chunks of dlogits up to
    api.DLOGITS_IN_FORWARD_MAX_BYTES (12 rows x 30 fp32 columns = 1440 bytes here); with several
    chunks the held one is the last (chunks of 5 rows: 2 rows, 240 bytes)."""
    monkeypatch.setattr(api, "DLOGITS_IN_FORWARD_MAX_BYTES", 1440)
    assert _takes_the_path()
    monkeypatch.setattr(api, "DLOGITS_IN_FORWARD_MAX_BYTES", 1439)
    assert not _takes_the_path()
    assert _takes_the_path(chunk_size=5)
    monkeypatch.setattr(api, "DLOGITS_IN_FORWARD_MAX_BYTES", 239)
    assert not _takes_the_path(chunk_size=5)


@pytest.mark.parametrize("chunk_size", [None, 16], ids=["one_chunk", "chunks_of_16"])
@pytest.mark.parametrize("scale", [1.0, 1e-2, 1e-5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_main_grad_gets_the_exact_weight_gradient(scale, dtype, chunk_size):
    """dW goes into main_grad in the backward, from the exact upstream gradient (no difference of
    large terms at a loss scale of 1e-5): as close to float64 as the same op without main_grad."""
    g = torch.Generator().manual_seed(11)
    h64 = torch.randn(40, 16, generator=g, dtype=torch.float64)
    w64 = torch.randn(70, 16, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, 64, (40,), generator=g)
    y[::6] = -100
    upstream = torch.randn(40, generator=g, dtype=torch.float64) * scale
    hr, wr = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    lp = reference.dense_stats(hr, wr, y, vocab_size=64, temperature=1.0)[0]
    (lp * upstream).sum().backward()
    errors = {}
    for main_grad in (False, True):
        h, w = h64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
        if main_grad:  # (zero: an fp32 sum with O(1) entries would round a 1e-5 dW by itself)
            w.main_grad = torch.zeros(70, 16)
        out = linear_logprobs(h, w, y, vocab_size=64, accumulate_into_main_grad=main_grad, chunk_size=chunk_size)
        assert _path_node(out.logprobs) is not None
        (out.logprobs * upstream.to(torch.float32)).sum().backward()
        dw = w.main_grad if main_grad else w.grad.float()
        errors[main_grad] = reference.rel_err(dw, wr.grad)
        if main_grad:
            assert w.grad is None
    tol = 1e-6 if dtype == torch.float32 else 1.5 * errors[False]
    assert errors[True] <= max(tol, 1e-6), errors


def test_the_row_product_is_freed_once_dx_is_made():
    """D·W ([rows, H] fp32) is held from the forward to the first backward only: freed once dX is
    made, before g·h is allocated, so that one of the two is alive at a time (a second backward
    through a retained graph makes it again: test_second_backward_and_freed_graph)."""
    g = torch.Generator().manual_seed(14)
    h = torch.randn(16, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 30, (16,), generator=g)
    out = linear_logprobs(h, w, y)
    node = _path_node(out.logprobs)
    made = node.made if hasattr(node, "made") else node.spec.tiling
    assert made.product is not None and made.product.shape == (16, 8) and made.product.dtype == torch.float32
    out.logprobs.sum().backward()
    assert made.product is None and made.dlogits is not None


@pytest.mark.parametrize("chunk_size", [None, 7], ids=["one_chunk", "chunks_of_7"])
def test_second_backward_and_freed_graph(chunk_size):
    """One chunk: the saved dlogits are read, not consumed. Several: the first backward frees the
    held chunk's D (one chunk alive at the peak), a second one makes it again as the forward did:
    the same gradients, bit for bit."""
    g = torch.Generator().manual_seed(12)
    h = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 30, (20,), generator=g)
    y[::3] = -100
    upstream = torch.randn(20, generator=g)
    out = linear_logprobs(h, w, y, chunk_size=chunk_size)
    assert _path_node(out.logprobs) is not None
    loss = (out.logprobs * upstream).sum()
    loss.backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    loss.backward(retain_graph=True)
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])
    loss.backward()
    torch.testing.assert_close(h.grad, 2 * first[0])
    torch.testing.assert_close(w.grad, 2 * first[1])
    h.grad = w.grad = None
    w.main_grad = torch.zeros(30, 8)
    out = linear_logprobs(h, w, y, accumulate_into_main_grad=True, chunk_size=chunk_size)
    del out  # a graph freed without backward: the forward wrote nothing
    assert h.grad is None and w.grad is None and torch.equal(w.main_grad, torch.zeros(30, 8))
    out = linear_logprobs(h, w, y, accumulate_into_main_grad=True, chunk_size=chunk_size)
    (out.logprobs * upstream).sum().backward()
    torch.testing.assert_close(w.main_grad, first[1])


@pytest.mark.parametrize("chunk_size", [None, 10], ids=["one_chunk", "chunks_of_10"])
def test_triton_backend_matches_torch(chunk_size):
    """The Triton backend's statistics and dlogits kernels (D made in place on the chunk of
    logits; with several chunks, the others' dlogits made again in the backward) and D·W against
    the torch backend's, values and gradients."""
    pytest.importorskip("triton")
    from triton_interpret import kernel_modules

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        kernel_modules()
    g = torch.Generator().manual_seed(13)
    h = torch.randint(-2, 3, (24, 64), generator=g).to(torch.bfloat16)
    w = (torch.randint(-2, 3, (64, 64), generator=g) * 0.25).to(torch.bfloat16)
    y = torch.randint(0, 61, (24,), generator=g)
    y[::5] = -100
    upstream = torch.randn(24, generator=g)
    results = []
    for impl in ("torch", "triton"):
        hh, ww = h.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
        out = linear_logprobs(hh, ww, y.to(device), vocab_size=61, temperature=0.7, impl=impl, chunk_size=chunk_size)
        assert _path_node(out.logprobs) is not None
        (out.logprobs * upstream.to(device)).sum().backward()
        results.append((out.logprobs.detach().cpu(), hh.grad.float().cpu(), ww.grad.float().cpu()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=TOL[torch.bfloat16], atol=1e-3)
