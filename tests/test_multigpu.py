"""TP=2 over NCCL on CUDA: the parity suite of test_ops.py (float64 dense reference, values, dX and
dW, SP on/off, fp32 and bf16) with the Triton backend, plus a larger bf16 shape.

    torchrun --nproc_per_node 2 -m pytest tests/test_multigpu.py -m multigpu -q

Every rank runs the same tests in the same order; results are all-gathered and every rank checks
every rank's result, so a failure fails on all ranks alike (no rank left waiting in a collective).
Skipped unless launched by torchrun with >= 2 CUDA devices.

Also: the sampler-fidelity cases of test_sampling.py (top_k / top_p / min_p / return_topk, with
the exact searches forced too) and a large bf16 Triton-vs-torch comparison of them.

Also: a real bf16 GPTModel (Float16Module) trained one step with `get_forward_backward_func`,
fused vs unfused, for SFT, DPO and GRPO (with and without entropy), comparing every micro-batch's
loss, the forward-only log-probs and the gradient of every parameter after Megatron's DDP +
`finalize_model_grads` (the CPU test's `megatron_workers.parity_worker`, on CUDA/NCCL; Triton
backend). Layouts: TP=2 + SP, TP=1 x PP=2, TP=2 x PP=2 (with and without SP), each tied and
untied; DP fills the rest of the world, and a layout that does not divide the world is skipped
(TP=2 x PP=2 needs 4 GPUs):

    torchrun --nproc_per_node 4 -m pytest tests/test_multigpu.py -m multigpu -q

And context parallelism (tests/megatron_cp_workers.py's worker, fp32: CP=2 on 2 GPUs, TP=2 x
CP=2 + SP and CP=2 x DP=2 on 4, each against CP=1 on the same world; CP=2 with sampler settings;
CP=2 with torch FSDP2 sharding the weights over DP x CP, fused against unfused), multi-token
prediction (tests/megatron_workers.py's MTP worker, bf16, with the Triton backend), and megatron's
DistributedOptimizer with overlap_param_gather + overlap_grad_reduce, the fused layer installed
before or after the DDP wrap (tests/megatron_workers.py's worker; the optimizer needs CUDA, so
this is its only run), and megatron's optimizers stepping while a fused forward is alive without
its backward (the step raises before any update).
"""

import gc
import os
import sys
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist

import reference
from dist import init_nccl_once
from megatron_fused_ce import linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss
from megatron_fused_ce.testing.gc_cycles import kinds, left_in_cycles

pytestmark = pytest.mark.multigpu
GRPO_EVERY_OPTION = GRPOConfig(loss_type="dapo", delta=3.0, dual_clip_c=3.0, beta=0.05, kl_estimator="k3",
                               use_bias_correction_kl=True, is_correction="token_truncate", is_clip_max=2.0)

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if WORLD < 2 or not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
    pytest.skip("needs torchrun with >= 2 CUDA GPUs", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def nccl():
    init_nccl_once()
    yield
    dist.barrier()


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nccl_logprobs_match_dense_reference(impl, sp, dtype):
    from op_cases import check_against_reference, logprobs_worker, make_case

    tp, rank = dist.get_world_size(), dist.get_rank()
    # a seed that is the same in every process (str hashes are salted per process)
    case = make_case(zlib.crc32(repr((impl, sp, str(dtype))).encode()) % 1000, tp, dtype=dtype, sp=sp, ignored=0.3)
    cuda_case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out = logprobs_worker(rank, tp, cuda_case, impl=impl)
    results = _gather([t.cpu() for t in out])
    check_against_reference(case, results, what_prefix="nccl ")


def _large_bf16_case(seed: int) -> tuple:
    """N=4096, H=1024, V=32000 (+64 padding columns a rank) bf16 on the GPU, every 7th label
    ignored: (vocab, v_local, hidden, the whole weight, labels, the generator for more draws)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, h_size, vocab = 4096, 1024, 32000
    v_local = -(-vocab // dist.get_world_size()) + 64
    hidden = torch.randn(n, h_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v_local * dist.get_world_size(), h_size, device="cuda", generator=g) / h_size**0.5
              * 2).bfloat16()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = -100
    return vocab, v_local, hidden, weight, labels, g


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("sp", [False, True])
def test_nccl_large_bf16_cross_entropy_and_logprobs(impl, sp):
    """N=4096, H=1024, V=32000 (+pad) bf16 against float64 math on the GPU."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    vocab, v_local, hidden, weight, labels, g = _large_bf16_case(123)
    n = hidden.shape[0]
    grad_lp = torch.randn(n, device="cuda", generator=g)

    n_local = n // tp
    h_in = (hidden[rank * n_local:(rank + 1) * n_local] if sp else hidden).clone().requires_grad_()
    w_in = weight[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    lp = linear_logprobs(h_in, w_in, labels, tp_group=dist.group.WORLD, vocab_size=vocab,
                         temperature=0.8, chunk_size=1000, sequence_parallel=sp, impl=impl).logprobs
    (lp * grad_lp).sum().backward()
    dx, dw = h_in.grad, w_in.grad
    h_in.grad, w_in.grad = None, None
    ce = linear_cross_entropy(h_in, w_in, labels, tp_group=dist.group.WORLD, vocab_size=vocab,
                              temperature=0.8, chunk_size=1000, sequence_parallel=sp, impl=impl,
                              label_smoothing=0.1)
    (3.0 * ce).backward()

    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, _, z = reference.dense_stats(hd, wd, labels, vocab_size=vocab, temperature=0.8)
    ref_dx, ref_dw = torch.autograd.grad((ref_lp * grad_lp.double()).sum(), (hd, wd), retain_graph=True)
    ref_ce = torch.nn.functional.cross_entropy(z, labels, label_smoothing=0.1)
    ce_dx, ce_dw = torch.autograd.grad(3.0 * ref_ce, (hd, wd))
    rows = slice(rank * n_local, (rank + 1) * n_local) if sp else slice(None)
    vrows = slice(rank * v_local, (rank + 1) * v_local)
    errors = {
        "logprobs": reference.rel_err(lp, ref_lp), "dX": reference.rel_err(dx, ref_dx[rows]),
        "dW": reference.rel_err(dw, ref_dw[vrows]), "ce_loss": reference.rel_err(ce, ref_ce),
        "ce_dX": reference.rel_err(h_in.grad, ce_dx[rows]), "ce_dW": reference.rel_err(w_in.grad, ce_dw[vrows]),
    }
    for rank_errors in _gather(errors):
        for name, err in rank_errors.items():
            reference.record(f"nccl big {name}", tp, torch.bfloat16, err)
            assert err < 2e-2, (name, err)


@pytest.mark.parametrize("chunk_size", [None, 1000], ids=["one-chunk", "chunks"])
def test_nccl_forward_only_route_of_the_fused_statistics_gemm(chunk_size, monkeypatch):
    """TP over NCCL, bf16, Triton: forward-only log-probs whose statistics come from the fused
    statistics GEMM (every call here: its bound at 0 bytes) take the remembered route once the
    signature is remembered (the GEMM first, then the label kernel, the merge and the log-probs):
    the same bits as the general path's call, float64 within the bf16 tolerance of the large case,
    and a routed call whose labels differ on one rank gives NaN on every rank, and every rank
    raises at the next check."""
    from megatron_fused_ce import check_deferred_errors
    from megatron_fused_ce.ops import agreement, fast, remembered_routes

    monkeypatch.setattr(fast, "FUSED_STATS_MIN_BYTES", 0)
    routed_calls = []
    run = remembered_routes.LogprobRoute.run
    monkeypatch.setattr(remembered_routes.LogprobRoute, "run",
                        lambda self, *a, **k: routed_calls.append(self.fused) or run(self, *a, **k))
    agreement.forget_signatures()
    rank = dist.get_rank()
    vocab, v_local, hidden, weight, labels, _ = _large_bf16_case(77)
    shard = weight[rank * v_local:(rank + 1) * v_local]

    def call(y):
        with torch.no_grad():
            return linear_logprobs(hidden, shard, y, tp_group=dist.group.WORLD, vocab_size=vocab,
                                   chunk_size=chunk_size, impl="triton").logprobs

    call(labels)  # (the signature's first call: its agreement)
    general = call(labels)  # (a remembered signature's call through the general path: the route recorded)
    routed = call(labels)
    ref_lp, _, _ = reference.dense_stats(hidden.double(), weight.double(), labels, vocab_size=vocab)
    err = reference.rel_err(routed, ref_lp)
    other = labels.clone()
    if rank == 1:
        other[5] = (other[5] + 1) % vocab
    nan_everywhere = bool(torch.isnan(call(other)).all())
    try:
        check_deferred_errors()
        raised = ""
    except ValueError as error:
        raised = str(error)
    results = _gather((routed_calls, torch.equal(general, routed), err, nan_everywhere, raised))
    for calls, same, rank_err, nan, error in results:
        assert calls == [True, True] and same and rank_err < 2e-2 and nan and "differ across" in error, results


@pytest.mark.parametrize("case", ["labels_swapped", "temperature", "sequence_parallel", "bad_label"])
def test_nccl_arguments_that_differ_raise_on_every_rank(case):
    """The agreement collective over NCCL: an argument that differs on the last rank (or a bad label
    there only) raises the same ValueError on every rank; none hangs in a collective. (Each case
    starts from no remembered signature: a rank whose arguments change after the ranks agreed on
    both signatures is caught by the steady state's rank check, tests/test_steady_state.py; one
    agreed on the old signature only would skip the agreement its peer runs.)"""
    from megatron_fused_ce.ops import agreement

    agreement.forget_signatures()
    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(8 * tp, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = torch.randn(100, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 100 * tp, (8 * tp,), device="cuda", generator=g)
    labels[:2] = torch.tensor([3, 11], device="cuda")
    kw, last = {}, rank == tp - 1
    if case == "labels_swapped" and last:
        labels[:2] = torch.tensor([11, 3], device="cuda")
    elif case == "temperature":
        kw["temperature"] = 0.9 if last else 1.0
    elif case == "sequence_parallel" and last:
        hidden, kw["sequence_parallel"] = hidden[:8].clone(), True
    elif case == "bad_label" and last:
        labels[5] = 100 * tp
    message = None
    try:
        linear_cross_entropy(hidden.requires_grad_(), weight, labels, tp_group=dist.group.WORLD, **kw)
    except ValueError as err:
        message = str(err)
    name = {"labels_swapped": "labels", "temperature": "temperature",
            "sequence_parallel": "sequence_parallel", "bad_label": "labels"}[case]
    for r, msg in enumerate(_gather(message)):
        assert msg is not None and name in msg, (r, msg)


def _steady_call_inputs(seed, kept_sets=False):
    """A steady call's inputs at TP = world, made before the call (their copies are not the op's):
    bf16 hidden states [4, 256, 512] and this rank's shard of 4032 ids, labels with a prompt of 8
    ignored positions, and a rollout's GRPO inputs; with `kept_sets`, replay's kept sets (20
    global ids per position, its label among them, the same on every rank)."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(4, 256, 512, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w_full = torch.randn(4032 * tp, 512, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    w = w_full[rank * 4032:(rank + 1) * 4032].clone().requires_grad_()
    y = torch.randint(0, 4032 * tp, (4, 256), device="cuda", generator=g)
    y[:, :8] = -100
    old = -torch.rand(4, 256, device="cuda", generator=g) * 4
    rollout = dict(old=old, reference=old - 0.1, sampling=old + 0.05, mask=(y != -100).float(),
                   adv=torch.randn(4, device="cuda", generator=g), labels=y.clamp(min=0))
    if kept_sets:
        scores = torch.rand(4 * 256, 4032 * tp, device="cuda", generator=g)
        scores.scatter_(1, y.reshape(-1, 1).clamp(min=0), 2.0)
        rollout["kept"] = (scores.topk(20, dim=1).indices.reshape(-1), torch.arange(4 * 256 + 1, device="cuda") * 20)
    return h, w, y, rollout


_STEADY_GRPO = GRPOConfig(loss_type="dapo", delta=3.0, dual_clip_c=3.0, beta=0.05, use_bias_correction_kl=True,
                          is_correction="token_truncate", is_clip_max=2.0)
STEADY_PATHS = ["forward_only", "logprobs", "logprobs_entropy", "cross_entropy", "grpo", "replay", "replay_tiles"]


def _steady_path_call(path, h, w, y, r):
    """One call of `path` (its forward and backward) at TP over the world's NCCL group."""
    kw = dict(tp_group=dist.group.WORLD)
    if path.startswith("replay"):
        out = linear_logprobs(h, w, y, **kw, sampling_mask=r["kept"])
        out.logprobs.sum().backward()
        return out.logprobs
    if path == "forward_only":
        with torch.no_grad():
            return linear_logprobs(h, w, y, **kw).logprobs
    if path.startswith("logprobs"):
        out = linear_logprobs(h, w, y, **kw, return_entropy=path.endswith("entropy"))
        (out.logprobs.sum() + (out.entropy.sum() if out.entropy is not None else 0)).backward()
        return out.logprobs
    if path == "cross_entropy":
        loss = linear_cross_entropy(h, w, y, **kw)
    else:
        loss, _ = linear_grpo_loss(h, w, r["labels"], r["adv"], r["mask"], _STEADY_GRPO, old_logprobs=r["old"],
                                   reference_logprobs=r["reference"], sampling_logprobs=r["sampling"], **kw)
    loss.backward()
    return loss


@pytest.mark.parametrize("path", STEADY_PATHS)
def test_nccl_second_call_makes_no_host_synchronization(path, monkeypatch):
    """TP over NCCL, bf16, Triton: the second call of a signature runs under
    torch.cuda.set_sync_debug_mode("error") (no agreement read-back, nothing sized by a count; the
    rank check rides on the statistics' all-gather) and gives finite values (replay's union tiles:
    their layout sized from what the host knows)."""
    from megatron_fused_ce import check_deferred_errors
    from megatron_fused_ce.ops import replay

    if path == "replay_tiles":
        monkeypatch.setattr(replay, "FORCE_PIECES", "tiles")

    _steady_path_call(path, *_steady_call_inputs(1, kept_sets=path.startswith("replay")))
    second = _steady_call_inputs(2, kept_sets=path.startswith("replay"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    error = None
    try:
        out = _steady_path_call(path, *second)
    except RuntimeError as err:
        error = str(err)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    gathered = _gather((error, error is None and bool(torch.isfinite(out).all())))
    assert all(e is None and finite for e, finite in gathered), gathered
    check_deferred_errors()


@pytest.mark.parametrize("path", STEADY_PATHS)
def test_nccl_first_and_later_calls_leave_no_reference_cycles(path, monkeypatch):
    """TP over NCCL: a first call and later ones (the remembered routes, dX's sum started in the
    forward) leave nothing to Python's cyclic collector (tests/test_reference_cycles.py says why),
    their kernels compiled before (Triton's compiler leaves cycles of its own, once)."""
    from megatron_fused_ce.ops import agreement, replay

    if path == "replay_tiles":
        monkeypatch.setattr(replay, "FORCE_PIECES", "tiles")
    kept_sets = path.startswith("replay")
    first_inputs = _steady_call_inputs(1, kept_sets=kept_sets)
    later_inputs = _steady_call_inputs(2, kept_sets=kept_sets)
    for inputs in (first_inputs, later_inputs, later_inputs):  # every kernel compiled (Triton's garbage)
        _steady_path_call(path, *inputs)
    agreement.forget_signatures()
    first = kinds(left_in_cycles(lambda: _steady_path_call(path, *first_inputs)))
    later = kinds(left_in_cycles(lambda: _steady_path_call(path, *later_inputs), 3))
    gathered = _gather((first, later))  # (every rank's)
    assert all(not left_by_first and not left_by_later for left_by_first, left_by_later in gathered), gathered


@pytest.mark.parametrize("what", ["labels", "advantages", "mask", "none"])
def test_nccl_steady_inputs_that_differ_give_nan_and_raise_on_every_rank(what):
    """TP over NCCL, bf16, Triton: in a steady GRPO call (its signature agreed by a first call),
    labels, advantages or a mask that differ on one rank are caught by the rank check riding on the
    statistics' all-gather (the labels' and the loss inputs' fingerprints from the label launch,
    the verdict from the merge's kernel): the loss is NaN on every rank and the next check raises
    on every rank; the same inputs everywhere give a finite loss and no error."""
    from megatron_fused_ce import check_deferred_errors

    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(4, 128, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(2016 * tp, 256, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05)[
        rank * 2016:(rank + 1) * 2016].clone()
    y = torch.randint(0, 2016 * tp, (4, 128), device="cuda", generator=g)
    adv, mask = torch.randn(4, device="cuda", generator=g), torch.ones(4, 128, device="cuda")
    mask[:, :8] = 0
    old = -torch.rand(4, 128, device="cuda", generator=g) * 3
    config = GRPOConfig(loss_type="dapo", beta=0.05, is_correction="token_truncate", is_clip_max=2.0)

    def loss(labels, advantages, loss_mask):
        value, _ = linear_grpo_loss(h.requires_grad_(), w.requires_grad_(), labels, advantages, loss_mask, config,
                                    old_logprobs=old, reference_logprobs=old - 0.1, sampling_logprobs=old + 0.05,
                                    tp_group=dist.group.WORLD)
        value.backward()
        return value.detach()

    loss(y, adv, mask)  # the signature, agreed
    labels, advantages, loss_mask = y.clone(), adv.clone(), mask.clone()
    if rank == 1:
        if what == "labels":
            labels[2, 50] = (labels[2, 50] + 1) % (2016 * tp)  # (not at a masked position: no label there)
        elif what == "advantages":
            advantages[1] += 0.5
        elif what == "mask":
            loss_mask[3, 40] = 0.0
    value = loss(labels, advantages, loss_mask)
    try:
        check_deferred_errors()
        raised = None
    except ValueError as error:
        raised = str(error)
    for r, (nan, message) in enumerate(_gather((bool(torch.isnan(value)), raised))):
        if what == "none":
            assert not nan and message is None, (r, message)
        else:
            assert nan and message is not None and "differ across tensor-parallel ranks" in message, (r, message)


def test_nccl_garbage_labels_where_the_mask_is_zero_are_never_read():
    """TP over NCCL, bf16, Triton: GRPO's masked tokens have no label. Garbage there (out of range,
    and different on each rank) is neither refused by the first call's agreement nor flagged by the
    steady calls' device checks (the label kernel reads the mask), and every call's loss, metrics,
    dX and dW equal bit for bit those of the same call with ignore_index there."""
    from megatron_fused_ce import check_deferred_errors

    rank = dist.get_rank()
    h, w, _, r = _steady_call_inputs(7)
    r["mask"][:, 100:110] = 0  # masked tokens inside the response too, not only the prompt
    dropped = r["mask"] == 0
    garbage = r["labels"].masked_fill(dropped, 10**6 + rank)
    ignored = r["labels"].masked_fill(dropped, -100)
    config = GRPOConfig(loss_type="grpo", beta=0.05, is_correction="token_truncate", is_clip_max=2.0)
    runs = {}
    for name, labels in (("garbage", garbage), ("ignored", ignored)):
        runs[name] = []
        for _ in range(3):  # the signature's first call (full agreement), then steady ones
            hx, wx = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            loss, metrics = linear_grpo_loss(hx, wx, labels, r["adv"], r["mask"], config, old_logprobs=r["old"],
                                             reference_logprobs=r["reference"], tp_group=dist.group.WORLD)
            loss.backward()
            runs[name].append([loss.detach(), hx.grad, wx.grad] + [metrics[k].detach() for k in sorted(metrics)])
    try:
        check_deferred_errors()
        raised = None
    except ValueError as error:
        raised = str(error)
    equal = all(torch.equal(a, b) for got, want in zip(runs["garbage"], runs["ignored"]) for a, b in zip(got, want))
    assert all(e is None and same for e, same in _gather((raised, equal))), _gather((raised, equal))


# CUDA kernels of a steady call at TP = 2, the NCCL collectives among them (printed by the test);
# measured on 2 x H200 (torch 2.11, Triton 3.6): forward-only 6, log-probs 16, cross-entropy 14, GRPO
# with every option 18, with the merge one all-gather between a packing launch and one launch that
# also writes a one-chunk call's log-probs (10 / 22 / 18 / 23 with the merge of two all-reduces and
# the backward's copies of a sum's gradient; 28 / 43 / 32 for the first three with the merge made of
# torch's elementwise ops and reductions). GRPO: at most 40, as at TP = 1
NCCL_MAX_KERNELS = {"forward_only": 8, "logprobs": 18, "cross_entropy": 16, "grpo_every_option": 40}


@pytest.mark.parametrize("path", list(NCCL_MAX_KERNELS))
def test_nccl_kernels_per_call_are_bounded(path):
    """TP over NCCL, bf16, Triton: the kernels of a steady call (the profiler's CUDA kernels, the
    collectives among them; copies and memsets aside) are at most NCCL_MAX_KERNELS: the TP merge
    is its partials' packing, one all-gather and one launch after, a forward-only call's log-probs
    one more."""
    tp, rank = dist.get_world_size(), dist.get_rank()

    def call(h, w, y, rollout):
        kw = dict(tp_group=dist.group.WORLD)
        if path == "forward_only":
            with torch.no_grad():
                return linear_logprobs(h, w, y, **kw).logprobs
        if path == "logprobs":
            out = linear_logprobs(h, w, y, **kw)
            out.logprobs.sum().backward()
            return out.logprobs
        if path == "grpo_every_option":
            r = rollout
            loss, _ = linear_grpo_loss(h, w, r["labels"], r["adv"], r["mask"], GRPO_EVERY_OPTION,
                                       old_logprobs=r["old"], reference_logprobs=r["reference"],
                                       sampling_logprobs=r["sampling"], **kw)
        else:
            loss = linear_cross_entropy(h, w, y, **kw)
        loss.backward()
        return loss

    call(*_steady_call_inputs(1))
    call(*_steady_call_inputs(2))
    third = _steady_call_inputs(3)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(*third)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    print(f"TP={tp} rank {rank} {path}: {len(kernels)} CUDA kernels per call: " + " | ".join(k[:50] for k in kernels))
    counts = _gather(len(kernels))
    assert all(c <= NCCL_MAX_KERNELS[path] for c in counts), (counts, kernels)


@pytest.mark.parametrize("path", ["cross_entropy", "grpo", "replay", "replay_tiles"])
def test_nccl_graphed_calls_equal_eager(path, monkeypatch):
    """make_graphed_callables over NCCL in the thread-local capture mode (megatron_fused_ce.cuda_graphs),
    captured right after eager calls whose collectives NCCL's watchdog still tracks (what made the
    default global mode fail such captures from one shape to the next), then replayed on new
    inputs: the loss and dX, dW equal the eager call's on the same inputs, bit for bit."""
    from megatron_fused_ce.cuda_graphs import thread_local_capture
    from megatron_fused_ce.ops import replay

    if path == "replay_tiles":  # (K = 20 of a 4032-id shard takes the dense route by sizes)
        monkeypatch.setattr(replay, "FORCE_PIECES", "tiles")
    tp, rank = dist.get_world_size(), dist.get_rank()
    config = GRPOConfig(loss_type="dapo", beta=0.05, is_correction="token_truncate", is_clip_max=2.0)
    g = torch.Generator(device="cuda").manual_seed(5)
    w_full = torch.randn(4032 * tp, 512, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    shard = w_full[rank * 4032:(rank + 1) * 4032].clone()

    def inputs(seed):  # (h, labels, old log-probs, advantages, GRPO labels, mask, kept ids, offsets)
        g = torch.Generator(device="cuda").manual_seed(seed)
        h = torch.randn(4, 256, 512, device="cuda", generator=g, dtype=torch.bfloat16)
        y = torch.randint(0, 4032 * tp, (4, 256), device="cuda", generator=g)
        y[:, :8] = -100
        old = -torch.rand(4, 256, device="cuda", generator=g) * 4
        scores = torch.rand(4 * 256, 4032 * tp, device="cuda", generator=g)
        scores.scatter_(1, y.reshape(-1, 1).clamp(min=0), 2.0)
        ids = scores.topk(20, dim=1).indices.reshape(-1)
        return (h, y, old, torch.randn(4, device="cuda", generator=g), y.clamp(min=0), (y != -100).float(), ids,
                torch.arange(4 * 256 + 1, device="cuda") * 20)

    def loss_of(h, w, y, old, adv, grpo_labels, mask, ids, offsets):
        kw = dict(tp_group=dist.group.WORLD)
        if path.startswith("replay"):
            return -linear_logprobs(h, w, y, **kw, sampling_mask=(ids, offsets)).logprobs.sum()
        if path == "cross_entropy":
            return linear_cross_entropy(h, w, y, **kw)
        return linear_grpo_loss(h, w, grpo_labels, adv, mask, config, old_logprobs=old,
                                reference_logprobs=old - 0.1, **kw)[0]

    def run(fn, w, args):  # -> (loss, dX, dW), copied out of any captured buffer
        h = args[0].clone().requires_grad_()
        loss = fn(h, w, *args[1:])
        dx, dw = torch.autograd.grad(loss, (h, w))
        return loss.detach().clone(), dx.clone(), dw.clone()

    # eager calls first (the signature's agreement; collectives in flight), each on leaves of its own
    for seed in (1, 2):
        run(loss_of, shard.clone().requires_grad_(), inputs(seed))
    w_graph = shard.clone().requires_grad_()
    static = inputs(1)
    sample = (static[0].clone().requires_grad_(), w_graph) + static[1:]
    gc.collect()  # earlier graphs freed now, not by a collection during the capture (docs/performance.md)
    with thread_local_capture():
        graphed = torch.cuda.make_graphed_callables(loss_of, sample)
    results = []
    for seed in (3, 4):
        args = inputs(seed)
        eager = run(loss_of, shard.clone().requires_grad_(), args)
        replayed = run(graphed, w_graph, args)
        results.append(all(torch.equal(a, b) for a, b in zip(eager, replayed))
                       and all(bool(torch.isfinite(t).all()) for t in eager))
    torch.cuda.synchronize()
    gathered = _gather(results)
    assert all(all(r) for r in gathered), gathered


# ------------------------------------------------------------------------------------------------
# Sampling-mask replay over NCCL
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("force", [None, "sparse", "tiles", "dense"])
@pytest.mark.parametrize("dtype,ints", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16"])
def test_nccl_replay_matches_dense_reference(force, dtype, ints):
    """Replay's float64 cases of test_sampling_mask.py (sampling_mask_cases.py: ignored labels,
    empty sets, padded vocab, temperature, SP) on the GPUs with the Triton kernels, every route: the
    mask's agreement across ranks compares what every rank's mask can equal (its sizes and device
    type, not each rank's own device index)."""
    import sampling_mask_cases

    tp, rank = dist.get_world_size(), dist.get_rank()
    case = sampling_mask_cases.make_case(sampling_mask_cases.case_seed("nccl", tp, str(dtype)), tp, dtype=dtype,
                                         ints=ints, sp=True, seq=4 * tp)
    cuda_case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    cuda_case["mask"] = type(case["mask"])(*(t.cuda() for t in case["mask"]))
    out = sampling_mask_cases.run_case(rank, tp, cuda_case, force)
    results = _gather({k: v.cpu() for k, v in out.items()})
    sampling_mask_cases.check(case, results, f"nccl {dtype} pieces={force}")


# ------------------------------------------------------------------------------------------------
# Sampler fidelity (top_k / top_p / min_p / return_topk) over NCCL
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype,ints", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-ties"])
@pytest.mark.parametrize("searched", [False, True], ids=["candidates", "searched"])
def test_nccl_sampled_logprobs_match_dense_reference(impl, dtype, ints, searched, monkeypatch):
    """The float64 reference cases of test_sampling.py (sampling_cases.py) on the GPU (searched:
    every exact search forced)."""
    import sampling_cases
    from megatron_fused_ce.ops import sampling

    if searched:
        monkeypatch.setattr(sampling, "CANDIDATES", 2)
        monkeypatch.setattr(sampling, "MAX_TOP_K_CANDIDATES", 2)
    tp, rank = dist.get_world_size(), dist.get_rank()
    case = sampling_cases.make_case(zlib.crc32(repr((impl, str(dtype), searched)).encode()) % 1000, tp,
                                   dtype=dtype, ints=ints, sp=True, seq=4 * tp)
    cuda_case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    for params in sampling_cases.PARAMS:
        out = sampling_cases.run_case(rank, tp, cuda_case, params, impl=impl)
        results = _gather({k: None if v is None else v.cpu() for k, v in out.items()})
        sampling_cases.check(case, params, results, what="nccl sampled ")


@pytest.mark.parametrize("sp", [False, True])
def test_nccl_large_bf16_sampled_triton_matches_torch(sp):
    """N=4096, H=1024, V=32000 (+pad) bf16 at T=0.25 (peaked rows): top_p=0.9 + top_k=50 +
    return_topk=20 with the Triton kernels equal the torch backend: the same kept sets and top-k
    ids on every rank, values and gradients to bf16 rounding; prints the share of searched rows."""
    from megatron_fused_ce.ops import sampling

    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device="cuda").manual_seed(321)
    n, h_size, vocab = 4096, 1024, 32000
    v_local = -(-vocab // tp) + 64
    hidden = torch.randn(n, h_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v_local * tp, h_size, device="cuda", generator=g) / h_size**0.5 * 2).bfloat16()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::3] = (hidden.float() @ weight[:vocab].float().t()).argmax(dim=1)[::3]  # kept tokens
    labels[::7] = -100
    n_local = n // tp
    runs = {}
    for impl in ("triton", "torch"):
        sampling.SEARCH_COUNTS.clear()
        h_in = (hidden[rank * n_local:(rank + 1) * n_local] if sp else hidden).clone().requires_grad_()
        w_in = weight[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        out = linear_logprobs(h_in, w_in, labels, tp_group=dist.group.WORLD, vocab_size=vocab, temperature=0.25,
                              chunk_size=1000, sequence_parallel=sp, impl=impl, top_p=0.9, top_k=50,
                              return_topk=20, return_entropy=True)
        finite = torch.isfinite(out.logprobs)
        (torch.where(finite, out.logprobs, 0.0).sum() + out.entropy.sum()).backward()
        runs[impl] = (out, h_in.grad, w_in.grad, dict(sampling.SEARCH_COUNTS))
    (a, dxa, dwa, counts), (b, dxb, dwb, _) = runs["triton"], runs["torch"]
    finite = torch.isfinite(b.logprobs)
    checks = {
        "same kept labels": bool(torch.equal(torch.isfinite(a.logprobs), finite)),
        "same topk ids": bool(torch.equal(a.topk_ids, b.topk_ids)),
        "some labels outside": bool((~finite).any()) and bool(finite[labels != -100].any()),
        "lp": reference.rel_err(a.logprobs[finite], b.logprobs[finite]),
        "entropy": reference.rel_err(a.entropy, b.entropy),
        "topk_lp": reference.rel_err(a.topk_logprobs, b.topk_logprobs),
        "dX": reference.rel_err(dxa, dxb), "dW": reference.rel_err(dwa, dwb),
    }
    print(f"rank {rank}: searched rows {counts}")
    gathered = _gather((checks, a.logprobs.cpu(), a.topk_ids.cpu()))
    for rank_checks, lp, ids in gathered:
        for name, value in rank_checks.items():
            assert value is True or (not isinstance(value, bool) and value < 1e-2), (name, value)
        assert torch.equal(lp, gathered[0][1]) and torch.equal(ids, gathered[0][2])


# ------------------------------------------------------------------------------------------------
# GPTModel + get_forward_backward_func, fused vs unfused, bf16, over NCCL
# ------------------------------------------------------------------------------------------------
GPT_LAYOUTS = {  # name: (tp, pp, sequence_parallel); dp = world // (tp * pp)
    "tp2-sp": (2, 1, True),
    "tp1-pp2": (1, 2, False),
    "tp2-pp2": (2, 2, False),
    "tp2-pp2-sp": (2, 2, True),
}
GPT_KINDS = ("sft", "dpo", "grpo", "grpo_entropy")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # e.g. LogprobsOutput
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def gpt_setup(layout: str, tied: bool, world: int):
    """The layout's `Setup` (bf16) for `world` ranks, or None when it does not divide the world."""
    from megatron_harness import Setup

    tp, pp, sp = GPT_LAYOUTS[layout]
    if world % (tp * pp):
        return None
    return Setup(tp=tp, pp=pp, dp=world // (tp * pp), sp=sp, tied=tied, bf16=True)


def gpt_parity_body(layout: str, tied: bool, device: str, kinds=GPT_KINDS,
                    loss_rtol=None, grad_rtol=None):
    """Fused vs unfused GPTModel training step on every rank of the initialized default group.

    Calls the CPU parity test's `parity_worker(rank, world, setup, kinds)` (which builds megatron's
    parallel_state on the default group, a bf16 Float16Module GPTModel in DDP, and runs unfused
    then fused), with its batches moved to `device`. Every rank's report is all-gathered and every
    rank runs the same checks on all of them, so all ranks pass or fail together. `device="cuda"`
    under NCCL (the test below); `device="cpu"` under gloo after `enable_cpu_mode()` runs the same
    body on CPU. Returns the worst relative difference per loss kind.
    """
    import megatron_harness as common
    from megatron.core import parallel_state
    from megatron_harness import GRAD_RTOL_BF16, LOSS_RTOL_BF16
    from megatron_workers import NUM_MICROBATCHES, parity_worker

    from megatron_fused_ce.megatron import loss_funcs

    loss_rtol = LOSS_RTOL_BF16 if loss_rtol is None else loss_rtol
    grad_rtol = GRAD_RTOL_BF16 if grad_rtol is None else grad_rtol
    world, rank = dist.get_world_size(), dist.get_rank()
    setup = gpt_setup(layout, tied, world)
    assert setup is not None and setup.world == world, (layout, world)

    # parity_worker wraps these two with call counters for good; put the originals back after.
    counted = {name: getattr(loss_funcs, name) for name in ("linear_cross_entropy", "linear_grpo_loss")}
    from megatron_fused_ce.ops import backends as op_backends

    make_batches, select = common.make_batches, op_backends.select
    backends = set()

    def batches_on_device(*args, **kwargs):
        return [{k: v.to(device) for k, v in batch.items()} for batch in make_batches(*args, **kwargs)]

    def recording_select(impl, dev):
        backend = select(impl, dev)
        backends.add(backend.name)
        return backend

    common.make_batches, op_backends.select = batches_on_device, recording_select
    report, error = None, None
    try:
        report = _to_cpu(parity_worker(rank, world, setup, kinds))
        report["backends"] = sorted(backends)
    except Exception:  # noqa: BLE001  (re-raised on every rank after the gather)
        error = traceback.format_exc()
        # Printed now: a stage that fails leaves its pipeline peer blocked in a p2p receive, so
        # the gather below may never complete (the NCCL timeout then aborts every rank).
        print(f"rank {rank} failed in {layout} {'tied' if tied else 'untied'}:\n{error}",
              file=sys.stderr, flush=True)
    finally:
        common.make_batches, op_backends.select = make_batches, select
        for name, fn in counted.items():
            setattr(loss_funcs, name, fn)
        parallel_state.destroy_model_parallel()
    gathered = _gather((report, error))
    errors = [f"--- rank {r} ---\n{e}" for r, (_, e) in enumerate(gathered) if e is not None]
    assert not errors, "\n".join(errors)
    reports = [r for r, _ in gathered]

    # The checks of test_megatron_parity.test_fused_matches_unfused, bf16 tolerances.
    worst = {}
    for rank_, report in enumerate(reports):
        if report["last_stage"]:
            if device == "cuda":  # the fused loss (last stage only) ran the Triton kernels
                assert "triton" in report["backends"], (rank_, report["backends"])
            assert report["grad_added_to_main_grad"] == setup.grad_acc_fusion, rank_
        for kind in kinds:
            r = report[kind]
            assert r["same_keys"], (rank_, kind)
            assert r["grad_norm"] > 0, (rank_, kind)
            if report["last_stage"]:
                assert r["num_metrics"] == NUM_MICROBATCHES, (rank_, kind, r["num_metrics"])
                expected = {"linear_cross_entropy": NUM_MICROBATCHES if kind == "sft" else 0,
                            "linear_grpo_loss": NUM_MICROBATCHES if kind == "grpo" else 0}
                assert r["gradients_in_forward_calls"] == expected, (rank_, kind, r)
                assert r["loss_diff"] <= loss_rtol, (rank_, kind, "loss", r["loss_diff"])
            bad = {n: d for n, d in r["grad_diff"].items() if d > grad_rtol}
            assert not bad, (rank_, kind, "grads", bad)
            assert r["forward_only_diff"] <= loss_rtol, (rank_, kind, "logprobs", r["forward_only_diff"])
            worst[kind] = max(worst.get(kind, 0.0), r["loss_diff"], r["forward_only_diff"],
                              max(r["grad_diff"].values()))
    # Forward-only log-probs are identical (bitwise) on every rank of a data-parallel replica.
    for kind in kinds:
        if kind == "sft":
            continue
        for dp_rank in {r["dp_rank"] for r in reports}:
            replica = [r[kind]["forward_only"] for r in reports if r["dp_rank"] == dp_rank]
            for other in replica[1:]:
                for a, b in zip(replica[0], other):
                    assert torch.equal(a, b), (kind, dp_rank)
    return worst


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", list(GPT_LAYOUTS))
def test_nccl_gpt_fused_matches_unfused_bf16(layout, tied, record_property):
    """bf16 GPTModel step, fused vs unfused: losses to 1e-3 relative, forward-only log-probs to
    1e-3, each parameter's gradient to 2e-2 of its largest entry (the CPU bf16 test's tolerances)."""
    setup = gpt_setup(layout, tied, dist.get_world_size())
    if setup is None:  # the same decision on every rank
        pytest.skip(f"{layout} needs a world size divisible by its TP x PP, got {dist.get_world_size()}")
    worst = gpt_parity_body(layout, tied, "cuda")
    record_property("max_rel_diff", worst)
    print(f"{setup}: max relative fused-vs-unfused difference {worst}")


# ------------------------------------------------------------------------------------------------
# Multi-token prediction and the distributed optimizer over NCCL
# ------------------------------------------------------------------------------------------------
def _on_every_rank(what: str, worker, *args):
    """`worker(rank, world, *args)` of a CPU test on every rank of the default group, micro-batches
    on the GPU; every rank's (report, error) is all-gathered and a failure raises on all ranks."""
    import megatron_harness as common
    from megatron.core import parallel_state

    make_batches = common.make_batches
    common.make_batches = lambda *a, **k: [{key: v.cuda() for key, v in batch.items()}
                                           for batch in make_batches(*a, **k)]
    report, error = None, None
    try:
        report = _to_cpu(worker(dist.get_rank(), dist.get_world_size(), *args))
    except Exception:  # noqa: BLE001  (re-raised on every rank after the gather)
        error = traceback.format_exc()
        print(f"rank {dist.get_rank()} failed in {what}:\n{error}", file=sys.stderr, flush=True)
    finally:
        common.make_batches = make_batches
        parallel_state.destroy_model_parallel()
    gathered = _gather((report, error))
    errors = [f"--- rank {r} ---\n{e}" for r, (_, e) in enumerate(gathered) if e is not None]
    assert not errors, "\n".join(errors)
    return [r for r, _ in gathered]


MTP_GPU_LAYOUTS = {  # name: (tp, pp, sp, tied, mtp depths); dp = world // (tp * pp)
    "tp2-sp-mtp2": (2, 1, True, False, 2),
    "tp1-pp2-tied-mtp1": (1, 2, False, True, 1),
}


@pytest.mark.parametrize("layout", list(MTP_GPU_LAYOUTS))
def test_nccl_mtp_fused_matches_unfused_bf16(layout, record_property):
    """bf16 GPTModel with MTP, fused vs unfused: losses, megatron's MTP logging (argmax acceptance
    counts within 2 % on >= 0.19: bf16 logits tie), every gradient; the CPU test's checks, bf16
    tolerances."""
    from megatron_harness import GRAD_RTOL_BF16, LOSS_RTOL_BF16, Setup
    from megatron_workers import check_mtp_reports, mtp_worker

    tp, pp, sp, tied, depths = MTP_GPU_LAYOUTS[layout]
    world = dist.get_world_size()
    if world % (tp * pp):
        pytest.skip(f"{layout} needs a world size divisible by {tp * pp}")
    setup = Setup(tp=tp, pp=pp, dp=world // (tp * pp), sp=sp, tied=tied, mtp_layers=depths, bf16=True)
    kinds = ("labels", "sft", "grpo")
    reports = _on_every_rank(layout, mtp_worker, setup, kinds)
    worst = check_mtp_reports(reports, setup, kinds, loss_rtol=LOSS_RTOL_BF16,
                              grad_rtol=GRAD_RTOL_BF16, count_rtol=0.02)
    record_property("max_rel_diff", worst)
    print(f"{setup}: max relative fused-vs-unfused difference {worst}")


def test_nccl_distributed_optimizer_overlap_both_install_orders():
    """megatron's DistributedOptimizer (fp32, SGD), overlap_param_gather + overlap_grad_reduce,
    data-parallel over every GPU, MTP: three steps unfused, fused installed before the DDP wrap, and
    after it. Every fused read of the output weight comes after its all-gather; losses of every
    step and the parameters after the steps match unfused (fp32: 1e-5)."""
    from megatron_harness import Setup
    from megatron_workers import check_distributed_optimizer, distributed_optimizer_worker

    setup = Setup(dp=dist.get_world_size(), overlap=True, mtp_layers=1)
    runs = {order: _on_every_rank(f"distributed optimizer, install {order}",
                                  distributed_optimizer_worker, setup, order)
            for order in (None, "before", "after")}
    for order in ("before", "after"):
        check_distributed_optimizer(runs[None], runs[order], loss_rtol=1e-5, param_rtol=1e-5)


HELD_FORWARD_DDP = {  # DDP / optimizer settings on top of Setup(dp=world, grad_acc_fusion=True)
    "ddp": {},
    "ddp-overlap-grad-reduce": {"overlap_grad_reduce": True},
    "distributed-optimizer": {"distributed_optimizer": True},
    "distributed-optimizer-overlap": {"overlap": True},
}


@pytest.mark.parametrize("ddp", list(HELD_FORWARD_DDP))
def test_nccl_optimizer_step_with_a_fused_forward_alive_raises(ddp):
    """megatron's own optimizers (Adam; the distributed one with and without overlap): a step taken
    while an evaluation loss (or a stored micro-batch loss) still holds its fused forward's graph
    raises before any update; plain and recomputed loss funcs step alike (the CPU test's worker)."""
    from megatron_harness import Setup
    from megatron_workers import check_held_forward_reports, held_forward_worker

    setup = Setup(dp=dist.get_world_size(), grad_acc_fusion=True, **HELD_FORWARD_DDP[ddp])
    check_held_forward_reports(_on_every_rank(f"held forward, {ddp}", held_forward_worker, setup, "megatron"))


# ------------------------------------------------------------------------------------------------
# Context parallelism over NCCL: CP=N equals CP=1 (fp32 GPTModel with GatheredKVAttention)
# ------------------------------------------------------------------------------------------------
CP_GPU_LAYOUTS = {  # name: (tp, cp, sequence_parallel); dp = world // (tp * cp)
    "cp2": (1, 2, False),
    "tp2-cp2": (2, 2, True),
}


@pytest.mark.parametrize("layout", list(CP_GPU_LAYOUTS))
def test_nccl_context_parallel_equals_cp1(layout, record_property):
    """tests/test_megatron_cp.py's fp32 GPTModel step on the GPUs (fused path: Triton backend): SFT,
    DPO, GRPO and GSPO loss funcs, fused and unfused, at CP=2 (2 GPUs; CP=2 x DP=2 on 4) and
    TP=2 x CP=2 + SP (4 GPUs), against the same model at CP=1 unfused on the same world (its extra
    data-parallel ranks repeat the CP run's data): logged metrics, every parameter's gradient,
    gathered and sharded forward-only log-probs; the CPU test's tolerances (1e-5 on metrics and
    log-probs, 1e-4 of each gradient's largest entry)."""
    from megatron_cp_workers import KINDS, check_cp_reports, parity_worker
    from megatron_harness import Setup

    tp, cp, sp = CP_GPU_LAYOUTS[layout]
    world = dist.get_world_size()
    if world % (tp * cp):
        pytest.skip(f"{layout} needs a world size divisible by {tp * cp}")
    setup = Setup(tp=tp, cp=cp, dp=world // (tp * cp), sp=sp)
    reference_setup = Setup(tp=tp, dp=world // tp, sp=sp, gathered_attention=True)
    reference = _on_every_rank(f"{layout} CP=1 reference", parity_worker, reference_setup, KINDS, setup.dp)
    results = _on_every_rank(layout, parity_worker, setup, KINDS, setup.dp)
    worst = check_cp_reports(results, reference, KINDS)
    record_property("max_rel_diff", worst)
    print(f"{setup}: max relative difference to CP=1 {worst}")


def test_nccl_context_parallel_with_sampler_settings(record_property):
    """The rollouts' sampler settings (top_k, top_p, return_topk: the Triton sampler kernels on the
    fused path) under CP=2 (CP=2 x DP on more GPUs): SFT and GRPO equal CP=1, labels outside the
    kept set excluded, top-k fields gathered (tests/test_megatron_cp.py's sampler case)."""
    from megatron_cp_workers import check_cp_reports, parity_worker
    from megatron_harness import Setup

    world = dist.get_world_size()
    if world % 2:
        pytest.skip("CP=2 needs an even world size")
    kinds, sampler = ("sft", "grpo"), dict(top_k=40, top_p=0.9, return_topk=3)
    setup = Setup(cp=2, dp=world // 2)
    reference = _on_every_rank("cp2 sampler CP=1 reference", parity_worker,
                               Setup(dp=world, gathered_attention=True), kinds, setup.dp, sampler)
    results = _on_every_rank("cp2 sampler", parity_worker, setup, kinds, setup.dp, sampler)
    worst = check_cp_reports(results, reference, kinds)
    record_property("max_rel_diff", worst)
    print(f"{setup} {sampler}: max relative difference to CP=1 {worst}")


def test_nccl_context_parallel_with_fsdp_sharded_weights():
    """CP=2 (x DP on more GPUs) with torch FSDP2 sharding every weight over the data-parallel x CP
    group (tests/megatron_cp_workers.py's FSDP worker, fp32, Triton backend on the fused path): the
    fused ops run inside the output layer's call, where FSDP gathers the weight; SFT, DPO and GRPO
    losses, forward-only log-probs (both layouts) and every gradient equal the unfused run's."""
    from megatron_cp_workers import check_fsdp_reports, fsdp_worker

    if dist.get_world_size() % 2:
        pytest.skip("CP=2 needs an even world size")
    check_fsdp_reports(_on_every_rank("cp2 fsdp2", fsdp_worker, ("sft", "dpo", "grpo")))
