"""Context parallelism in the Megatron layer: CP=N equals CP=1 (CPU, gloo, fp32 GPTModel).

What runs: a tiny GPTModel whose layers use `GatheredKVAttention` (megatron's CP attention is
Transformer Engine's only; this one is exact under CP: each rank attends from its own queries over
the all-gathered keys/values at their original positions, so hidden states genuinely depend on
tokens held by other CP ranks), driven by `get_forward_backward_func` with DDP and
`finalize_model_grads` (gradients and token counts summed over data-parallel x CP ranks), micro-
batches cut by `batch_on_this_cp_rank` exactly as megatron's `get_batch_on_this_cp_rank` does
(checked against it below). The CP=1 reference is the same model (same weights: CP does not
change the initialization) on the whole sequences. So the loss funcs' CP design (partial token
sums, shares of sequence-level terms, counts on CP rank 0), the post-processor on CP slices and
compute_logprobs' layouts are tested end to end, fused and unfused. Every fused op of these CP
paths runs inside a call of the fused output layer (`run_in_output_layer`, where FSDP engines
gather the weight): counted below at CP=2 and TP=2 x CP=2, and run for real at CP=2 with torch
FSDP2 sharding every weight over the data-parallel x CP group (fused equals unfused).

Compared for SFT, DPO (+ SFT term), GRPO (dapo, KL, token-level IS correction; fused: gradients in
forward) and GSPO (sequence-level ratio and IS correction, per-sequence mean): every metric as
Megatron-LM logs it (`[sum, count]` pairs summed over micro-batches and DP x CP ranks), every
parameter's gradient after finalize_model_grads, and the forward-only log-probs (gathered layout
vs CP=1, sharded layout vs the rank's slice); Megatron-LM's route (`model(..., labels=labels)` and
its own loss_func) at CP=2 and TP=2 x CP=2. Layouts: CP=2, TP=2 x CP=2 (+SP, tied), PP=2 x
CP=2, CP=2 x DP=2, CP=4, and CP=2 with calculate_per_token_loss=False.
Tolerances as in test_megatron_parity (fp32, summation order only): metrics and log-probs 1e-5
relative (absolute for values below 1), each gradient 1e-4 of its largest entry. The workers
shared with other files and the NCCL suite are in megatron_cp_workers.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import megatron_harness as common
from dist import run_workers
from megatron_cp_workers import (
    COMPUTE_LAYOUTS,
    CONFIGS,
    GRAD_RTOL,
    KINDS,
    NUM_MICROBATCHES,
    RTOL,
    check_cp_reports,
    check_fsdp_reports,
    cp_loss_func_maker,
    expected_scored_positions,
    fsdp_worker,
    offsets,
    packed_batch,
    packed_forward,
    parity_worker,
    reduce_metrics,
)
from megatron_harness import MBS, SEQ, TRUE_VOCAB, Setup

from megatron_fused_ce.losses import GRPOConfig
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    batch_on_this_cp_rank,
    compute_logprobs,
    context_parallel_group,
    dpo_loss_func,
    gather_from_cp_ranks,
    grpo_loss_func,
    install_fused_output_layer,
    positions_on_cp_rank,
    sft_loss_func,
    uninstall_fused_output_layer,
)


def _check_parity(setup: Setup, kinds=KINDS, sampler=None):
    reference_setup = Setup(tp=setup.tp, pp=setup.pp, dp=setup.dp, tied=setup.tied, sp=setup.sp,
                            per_token_loss=setup.per_token_loss, gathered_attention=True)
    reference = run_workers(parity_worker, reference_setup.world, reference_setup, kinds, None, sampler,
                            timeout=240)
    results = run_workers(parity_worker, setup.world, setup, kinds, None, sampler, timeout=240)
    worst = check_cp_reports(results, reference, kinds)
    print(f"{setup}{' ' + str(sampler) if sampler else ''}: max relative difference to CP=1 {worst}")
    return worst, reference


CP_SETUPS = [
    Setup(cp=2),
    Setup(tp=2, cp=2, sp=True, tied=True),
    Setup(pp=2, cp=2),
    Setup(dp=2, cp=2, tied=True),
    Setup(cp=4, tied=True),
    Setup(cp=2, per_token_loss=False),
]


@pytest.mark.parametrize("setup", CP_SETUPS, ids=str)
def test_context_parallel_equals_cp1(setup, record_property):
    record_property("max_rel_diff", _check_parity(setup)[0])


@pytest.mark.parametrize("setup", [Setup(cp=2), Setup(tp=2, cp=2, sp=True, tied=True)], ids=str)
def test_megatron_lm_labels_route_under_context_parallelism(setup, record_property):
    """`model(..., labels=labels)` with Megatron-LM's own loss_func (the per-token losses of this
    CP rank's slice, summed with its local token count): the fused layer's per-token losses under
    CP equal CP=1's."""
    record_property("max_rel_diff", _check_parity(setup, ("labels",))[0])


def test_context_parallel_with_sampler_settings(record_property):
    """The rollouts' sampler settings (top_p, top_k, return_topk) compose with CP: SFT and GRPO
    at CP=2 equal CP=1, with labels outside the kept set (-inf log-probs) excluded from the loss
    and from Megatron's count on the rank that holds them, and the top-k fields gathered."""
    worst, reference = _check_parity(Setup(cp=2), ("sft", "grpo"),
                                     dict(top_k=40, top_p=0.9, return_topk=3))
    last = [r for r in reference if r["last"]]
    assert all(r["grpo"]["fused"]["metrics"]["num_excluded_tokens"] > 0 for r in last)
    assert any(bool(torch.isinf(lp).any()) for r in last for lp in r["grpo"]["fused"]["gathered"])
    record_property("max_rel_diff", worst)


def output_layer_worker(rank, world, setup: Setup):
    """Every fused op of the CP paths (compute_logprobs in both layouts, the SFT / DPO / GRPO /
    GSPO loss funcs) runs inside a call of the fused output layer (`run_in_output_layer`), where
    an FSDP engine has the weight gathered: counts the op calls made inside and outside one."""
    import importlib

    from megatron_fused_ce.megatron import FusedOutputLayer

    loss_funcs = importlib.import_module("megatron_fused_ce.megatron.loss_funcs")
    postprocess = importlib.import_module("megatron_fused_ce.megatron.postprocess")
    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    install_fused_output_layer(chunks, fused)
    depth, calls = [0], {}
    original_run = FusedOutputLayer.run

    def run(self, hidden, compute, weight=None):
        depth[0] += 1
        try:
            return original_run(self, hidden, compute, weight)
        finally:
            depth[0] -= 1

    def watched(module, name):
        op = getattr(module, name)
        originals.append((module, name, op))

        def call(*args, **kwargs):
            key = (current[0], name, "inside" if depth[0] else "outside")
            calls[key] = calls.get(key, 0) + 1
            return op(*args, **kwargs)

        setattr(module, name, call)

    current, originals = [None], []
    FusedOutputLayer.run = run
    try:
        for module, name in ((loss_funcs, "linear_cross_entropy"), (loss_funcs, "linear_grpo_loss"),
                             (postprocess, "linear_logprobs")):
            watched(module, name)
        post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
        kw = dict(seq_length=SEQ, micro_batch_size=MBS)
        for kind in KINDS:
            batches = common.cp_batches(common.make_batches("sft" if kind == "sft" else "grpo",
                                                            NUM_MICROBATCHES, seed=100))
            sharded = None
            if kind != "sft":
                for layout in COMPUTE_LAYOUTS:
                    current[0] = f"compute_logprobs {layout}"
                    outs = compute_logprobs(chunks, batches, common.forward_fn, post, layout=layout, **kw)
                    sharded = [o.logprobs for o in outs] if layout == "sharded" else sharded
            current[0] = kind
            common.run_step(chunks, batches, cp_loss_func_maker(kind, post, sharded))
    finally:
        FusedOutputLayer.run = original_run
        for module, name, op in originals:
            setattr(module, name, op)
    return calls


@pytest.mark.parametrize("setup", [Setup(cp=2), Setup(tp=2, cp=2, sp=True, tied=True)], ids=str)
def test_context_parallel_ops_run_inside_the_output_layer(setup):
    for calls in run_workers(output_layer_worker, setup.world, setup, timeout=240):
        assert not [key for key in calls if key[2] == "outside"], calls
        entered = {key[0] for key in calls}
        assert entered == {*KINDS, *(f"compute_logprobs {layout}" for layout in COMPUTE_LAYOUTS)}, calls
        # the gradients-in-forward losses where they apply (SFT 0/1 mask, GRPO / GSPO)
        assert calls.get(("sft", "linear_cross_entropy", "inside")) and \
            calls.get(("grpo", "linear_grpo_loss", "inside")), calls


def test_context_parallel_with_fsdp_sharded_weights():
    check_fsdp_reports(run_workers(fsdp_worker, 2, ("sft", "dpo", "grpo"), timeout=240))


# ------------------------------------------------------------------------------------------------
# Packed sequences (THD) under CP: every document split over the CP ranks (chunks r and 2·CP−1−r of
# each padded document), document-causal attention; no target crosses a document boundary.
# ------------------------------------------------------------------------------------------------


def packed_worker(rank, world, setup: Setup):
    from megatron.core import parallel_state as ps

    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=5)
    cp_group = context_parallel_group()
    post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
    batches = common.cp_batches([packed_batch(seed) for seed in range(NUM_MICROBATCHES)])
    cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    index = positions_on_cp_rank(SEQ, cp_size, cp_rank, cu_seqlens_padded=batches[0]["cu_seqlens_padded"])
    scored = post.scored_labels(batches[0]["labels"], chunks[0], cu_seqlens=batches[0]["cu_seqlens"],
                                cu_seqlens_padded=batches[0]["cu_seqlens_padded"]) != -100
    report = {"coords": (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                         ps.get_data_parallel_rank()),
              "scored_positions": index[scored[0]].tolist(), "local_tokens": batches[0]["tokens"].shape}

    def make(chunk, batch, index):
        return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"],
                             cu_seqlens=batch["cu_seqlens"], cu_seqlens_padded=batch["cu_seqlens_padded"])

    for mode in ("unfused", "fused"):
        (install_fused_output_layer if mode == "fused" else uninstall_fused_output_layer)(
            chunks, *((fused,) if mode == "fused" else ()))
        gathered = compute_logprobs(chunks, batches, packed_forward, post, seq_length=SEQ,
                                    micro_batch_size=1, layout="gathered")
        metrics = common.run_step(chunks, batches, make, forward=packed_forward)
        report[mode] = {"metrics": reduce_metrics(metrics), "grads": common.grads(chunks),
                        "gathered": [o.logprobs for o in gathered]}
    assert (1 if cp_group is None else dist.get_world_size(cp_group)) == setup.cp
    return report


@pytest.mark.parametrize("setup", [Setup(cp=2), Setup(tp=2, cp=2)], ids=str)
def test_packed_sequences_under_context_parallelism(setup):
    reference_setup = Setup(tp=setup.tp, gathered_attention=True)
    reference = {r["coords"]: r for r in run_workers(packed_worker, reference_setup.world, reference_setup)}
    results = run_workers(packed_worker, setup.world, setup)
    want_scored = expected_scored_positions()
    assert all(r["scored_positions"] == want_scored for r in reference.values())
    scored = sorted(p for r in results if r["coords"][1] == 0 for p in r["scored_positions"])
    assert scored == want_scored  # each document boundary found on whichever rank holds it
    for result in results:
        ref = reference[result["coords"]]
        assert tuple(result["local_tokens"]) == (1, SEQ // setup.cp)
        for mode in ("unfused", "fused"):
            got, want = result[mode], ref["unfused"]
            assert abs(got["metrics"]["lm loss"] - want["metrics"]["lm loss"]) <= RTOL * abs(want["metrics"]["lm loss"])
            for name, grad in want["grads"].items():
                assert common.max_rel_diff(got["grads"][name], grad) <= GRAD_RTOL, (mode, name)
            for a, b in zip(got["gathered"], want["gathered"]):
                assert common.max_rel_diff(a, b) <= RTOL
                # zero exactly where the target is in another document or in the padding
                assert sorted(a[0].nonzero().squeeze(1).tolist()) == want_scored


# ------------------------------------------------------------------------------------------------
# The layouts: megatron's own slicing, Transformer Engine's THD partition, and back.
# ------------------------------------------------------------------------------------------------
def _megatron_slices(batch, group):
    """megatron-core's `get_batch_on_this_cp_rank` (0.16: (batch, cp_group); >= 0.18: (batch,
    is_hybrid_cp, cp_group))."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = dict(batch)
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def te_thd_partition(cu_seqlens_padded, total, world, rank):
    """Transformer Engine's `thd_partition_indices_kernel`, token by token (its CUDA loop)."""
    local = [int(x) // world for x in cu_seqlens_padded]
    out = []
    for token in range(total // world):
        seq = max(i for i in range(len(local) - 1) if local[i] <= token)
        seq_len = local[seq + 1] - local[seq]
        index = token - local[seq]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + local[seq] * world + seq_len // 2 * offset)
    return out


def layout_worker(rank, world):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(3)
    length = 4 * world
    batch = {"tokens": torch.randint(0, 100, (2, length), generator=g),
             "loss_mask": torch.rand(2, length, generator=g),
             "position_ids": torch.arange(length).expand(2, length).contiguous(),
             "attention_mask": torch.rand(1, 1, length, length, generator=g) > 0.5}
    ours, theirs = batch_on_this_cp_rank(batch, group), _megatron_slices(batch, group)
    same_as_megatron = all(torch.equal(ours[k], theirs[k]) for k in batch)
    gathered = gather_from_cp_ranks(ours["loss_mask"], group)
    # packed: documents of padded lengths 2·CP·[1, 3, 2]
    padded = offsets([2 * world * n for n in (1, 3, 2)])
    total = int(padded[-1])
    thd = positions_on_cp_rank(total, world, rank, cu_seqlens_padded=padded).tolist()
    values = torch.randn(1, total, 3, generator=g)
    local = batch_on_this_cp_rank({"x": values, "cu_seqlens_padded": padded}, group)["x"]
    # differentiable: each rank's gradient is the upstream gradient at its positions, summed
    leaf = local.clone().requires_grad_()
    weights = torch.randn(1, total, 3, generator=torch.Generator().manual_seed(4))
    (gather_from_cp_ranks(leaf, group, cu_seqlens_padded=padded) * weights).sum().backward()
    return {"same_as_megatron": same_as_megatron, "gathered": torch.equal(gathered, batch["loss_mask"]),
            "thd": thd, "te": te_thd_partition(padded.tolist(), total, world, rank),
            "thd_gathered": torch.equal(gather_from_cp_ranks(local, group, cu_seqlens_padded=padded), values),
            "grad": torch.equal(leaf.grad, world * weights[:, thd])}


@pytest.mark.parametrize("cp", [2, 4])
def test_layouts_match_megatron_and_transformer_engine(cp):
    results = run_workers(layout_worker, cp)
    for r in results:
        assert r["same_as_megatron"] and r["gathered"] and r["thd_gathered"] and r["grad"], r
        assert r["thd"] == r["te"]
    assert sorted(p for r in results for p in r["thd"]) == list(range(len(results[0]["thd"]) * cp))


def test_layout_errors():
    with pytest.raises(ValueError, match="multiple of 2·CP"):
        positions_on_cp_rank(12, 4, 0)
    with pytest.raises(ValueError, match="multiple of 2·CP"):
        positions_on_cp_rank(12, 2, 0, cu_seqlens_padded=torch.tensor([0, 6, 12]))
    with pytest.raises(ValueError, match="ends at"):
        positions_on_cp_rank(16, 2, 0, cu_seqlens_padded=torch.tensor([0, 4, 12]))
    assert positions_on_cp_rank(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert positions_on_cp_rank(6, 1, 0, cu_seqlens_padded=torch.tensor([0, 3, 6])).tolist() == list(range(6))
    assert positions_on_cp_rank(12, 2, 0, cu_seqlens_padded=torch.tensor([0, 4, 12])).tolist() == \
        [0, 3, 4, 5, 10, 11]


def attention_worker(rank, world, groups):
    """GatheredKVAttention at CP=1 against megatron's DotProductAttention (causal mask)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.core import tensor_parallel

    from dist import init_megatron_parallel
    from megatron_fused_ce.megatron import GatheredKVAttention

    common.enable_cpu_mode()
    init_megatron_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               num_query_groups=groups, attention_dropout=0.0,
                               masked_softmax_fusion=False)
    g = torch.Generator().manual_seed(0)
    s, b, d = 12, 2, 8
    q = torch.randn(s, b, 4, d, generator=g)
    k, v = torch.randn(s, b, groups, d, generator=g), torch.randn(s, b, groups, d, generator=g)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    want = DotProductAttention(config, **kwargs)(q, k, v, mask)
    got = GatheredKVAttention(config, **kwargs)(q, k, v, None)
    return float((got - want).abs().max()), tuple(got.shape) == tuple(want.shape)


@pytest.mark.parametrize("groups", [4, 2])
def test_gathered_attention_is_megatrons_at_cp1(groups):
    ((err, same_shape),) = run_workers(attention_worker, 1, groups)
    assert same_shape and err < 1e-6


# ------------------------------------------------------------------------------------------------
# Bad input under CP: the same ValueError on every rank, before any collective (never a hang).
# ------------------------------------------------------------------------------------------------
def _bad_cases():
    """name -> (what rank 1 (or every rank, "all") passes wrong, expected message)."""
    return {
        "sft_batch": ("sft", "rank1_rows", "different numbers of sequences"),
        "sft_unsliced_mask": ("sft", "rank1_mask", "loss_mask shape"),
        "sft_unsliced_labels": ("sft", "all_labels", "does not match the model output"),
        "dpo_unsliced_reference": ("dpo", "rank1_other", "reference_logprobs shape"),
        "grpo_unsliced_old": ("grpo", "rank1_other", "old_logprobs shape"),
        "grpo_batch": ("grpo", "rank1_rows", "different numbers of sequences"),
        "grpo_missing_sampling": ("grpo", "rank1_missing", "disagree"),
        "packed_bad_padding": ("packed", "all_padding", "multiple of 2·CP"),
    }


def bad_input_worker(rank, world):
    from megatron.core import parallel_state as ps

    fused = FusedCEConfig(enabled=True, chunk_size=4)
    (model,) = common.build(Setup(cp=world))
    install_fused_output_layer(model, fused)
    post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
    group = ps.get_context_parallel_group()
    whole = common.make_batches("grpo", 1, seed=5)[0]
    messages = {}
    for name, (kind, problem, _) in _bad_cases().items():
        batch = batch_on_this_cp_rank(whole, group)
        other = batch["noise"] - 4.0  # stands in for old / reference log-probs
        hidden = torch.randn(MBS, SEQ // world, common.HIDDEN, requires_grad=True)
        culprit = problem.startswith("all") or rank == 1
        if culprit and problem == "rank1_rows":
            batch = {k: v[:1] for k, v in batch.items()}
            other, hidden = other[:1], hidden[:1]
        if culprit and problem == "rank1_mask":
            batch["loss_mask"] = whole["loss_mask"]
        if culprit and problem == "all_labels":
            batch["labels"] = whole["labels"]
        if culprit and problem == "rank1_other":
            other = whole["noise"]
        packing = {}
        if kind == "packed":
            batch, hidden = {k: v[:1] for k, v in batch.items()}, hidden[:1]
            packing = dict(cu_seqlens=torch.tensor([0, 5, 14]), cu_seqlens_padded=torch.tensor([0, 6, 16]))
        try:
            if kind in ("sft", "packed"):
                loss_func = sft_loss_func(post, model, batch["labels"], batch["loss_mask"], **packing)
            elif kind == "dpo":
                loss_func = dpo_loss_func(post, model, batch["labels"], batch["loss_mask"], other)
            else:
                sampling = None if culprit and problem == "rank1_missing" else other
                loss_func = grpo_loss_func(post, model, batch["labels"], batch["loss_mask"],
                                           batch["advantages"], CONFIGS["grpo"], old_logprobs=other,
                                           reference_logprobs=other, sampling_logprobs=sampling)
            loss_func(hidden)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    # still in step: a good call runs its collectives on every rank
    batch = batch_on_this_cp_rank(whole, group)
    loss_sum, count, _ = grpo_loss_func(post, model, batch["labels"], batch["loss_mask"], batch["advantages"],
                                        CONFIGS["gspo"], old_logprobs=batch["noise"] - 4.0,
                                        reference_logprobs=batch["noise"] - 4.1,
                                        sampling_logprobs=batch["noise"] - 3.9)(
        torch.randn(MBS, SEQ // world, common.HIDDEN, requires_grad=True))
    loss_sum.backward()
    with pytest.raises(ValueError, match="layout"):
        compute_logprobs(model, [batch], common.forward_fn, post, seq_length=SEQ, micro_batch_size=MBS,
                         layout="whole")
    return messages


def test_bad_input_under_context_parallelism_raises_on_every_rank():
    results = run_workers(bad_input_worker, 2, timeout=90)
    for name, (_, _, expected) in _bad_cases().items():
        messages = [r[name] for r in results]
        assert all(m is not None for m in messages), (name, messages)
        assert any(expected in m for m in messages), (name, messages)


# ------------------------------------------------------------------------------------------------
# The loss funcs' float64 contract under CP: what Megatron makes of (loss_sum, count) over the CP
# ranks equals the float64 dense reference (full logits, log_softmax) in value, dX and dW.
# ------------------------------------------------------------------------------------------------
B, H, V_LOCAL = 4, 16, 23
F64 = torch.float64
CONTRACT_TOL = 2e-5  # fp32, relative norm


class FakeLastStage(torch.nn.Module):
    """The last pipeline stage as the post-processor and loss funcs see it (no transformer): its
    config, groups and output weight shard; fused or returning logits."""

    post_process = True
    share_embeddings_and_output_weights = False

    def __init__(self, weight, tp_group, cp_group, fused: bool):
        """`cp_group=None`: the model does not say (the post-processor is given the group)."""
        from types import SimpleNamespace

        from megatron_fused_ce.megatron import FusedOutputLayer

        super().__init__()
        layer = torch.nn.Module()
        layer.weight, layer.bias = torch.nn.Parameter(weight), None
        self.output_layer = FusedOutputLayer(layer, FusedCEConfig(enabled=True, chunk_size=5)) if fused else layer
        self.config = SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=False,
                                      calculate_per_token_loss=True)
        self.tp_group = tp_group
        self.pg_collection = SimpleNamespace(tp=tp_group, cp=cp_group)


def contract_inputs(tp):
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, SEQ, H, generator=g)
    weight = torch.randn(V_LOCAL * tp, H, generator=g) / H**0.5 * 3
    labels = torch.randint(0, V_LOCAL * tp - 3, (B, SEQ), generator=g)
    labels[0, 5] = labels[3, 12] = -100
    mask = (torch.rand(B, SEQ, generator=g) > 0.3).float()
    mask[:, :2] = 0.0
    mask[1] = 0.0  # an empty sequence (a rejected response without loss tokens)
    weighted = mask * (0.5 + torch.rand(B, SEQ, generator=g))
    base = -4.0 + torch.randn(B, SEQ, generator=g)
    return dict(hidden=hidden, weight=weight, labels=labels, mask=mask, weighted=weighted,
                adv=torch.randn(B, generator=g), old=base, ref=base + 0.3 * torch.randn(B, SEQ, generator=g),
                sampling=base + 0.2 * torch.randn(B, SEQ, generator=g))


CONTRACT_CASES = {
    "sft": ("sft", "mask", None),
    "sft_weighted": ("sft", "weighted", None),
    "dpo": ("dpo", "mask", dict(beta=0.5, sft_weight=0.3, average_log_probs=True)),
    "dpo_ipo": ("dpo", "weighted", dict(beta=0.2, loss_type="ipo")),
    "grpo_dapo": ("grpo", "mask", GRPOConfig(beta=0.05, is_correction="token_truncate", is_clip_max=1.1)),
    "gspo": ("grpo", "mask", GRPOConfig(loss_type="grpo", importance_sampling_level="sequence",
                                        is_correction="sequence_truncate", is_clip_max=1.5)),
    "grpo_nonempty": ("grpo", "mask", GRPOConfig(loss_type="grpo", count_empty_sequences=False, beta=0.1)),
    "dr_grpo": ("grpo", "weighted", GRPOConfig(loss_type="dr_grpo", max_completion_length=20)),
}
VOCAB_SHIFT, TEMPERATURE = 3, 0.8


def _call(name, post, model, d, output):
    kind, mask_key, options = CONTRACT_CASES[name]
    if kind == "sft":
        return sft_loss_func(post, model, d["labels"], d[mask_key])(output)
    if kind == "dpo":
        return dpo_loss_func(post, model, d["labels"], d[mask_key], d["ref"], **options)(output)
    return grpo_loss_func(post, model, d["labels"], d[mask_key], d["adv"], options, old_logprobs=d["old"],
                          reference_logprobs=d["ref"] if options.beta > 0 else None,
                          sampling_logprobs=d["sampling"])(output)


def contract_worker(rank, world, tp):
    cp = world // tp
    tp_rank, cp_rank = rank % tp, rank // tp
    groups = {}
    for c in range(cp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(c * tp, (c + 1) * tp)))
        groups["tp"] = group if c == cp_rank else groups.get("tp")
    for t in range(tp):
        group = dist.new_group(list(range(t, world, tp)))
        groups["cp"] = group if t == tp_rank else groups.get("cp")
    d = contract_inputs(tp)
    index = positions_on_cp_rank(SEQ, cp, cp_rank)
    d = {k: (v[:, index] if v.dim() >= 2 and k != "weight" else v) for k, v in d.items()}
    shard = d["weight"][tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
    results = {}
    for fused in (False, True):
        # the CP group from the model (unfused runs), or given to the post-processor (fused runs)
        post = LogprobsPostProcessor(FusedCEConfig(enabled=True, chunk_size=5),
                                     vocab_size=V_LOCAL * tp - VOCAB_SHIFT, temperature=TEMPERATURE,
                                     cp_group=groups["cp"] if fused else None)
        for name in CONTRACT_CASES:
            model = FakeLastStage(shard.clone(), groups["tp"], None if fused else groups["cp"], fused)
            hidden = d["hidden"].clone().requires_grad_()
            output = hidden
            if not fused:  # ColumnParallelLinear: dX all-reduced over TP in the backward
                from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

                output = copy_to_tensor_model_parallel_region(hidden, group=groups["tp"]) \
                    @ model.output_layer.weight.t()
            loss_sum, count, metrics = _call(name, post, model, d, output)
            loss_sum.backward()
            results[(name, fused)] = (loss_sum.detach(), count, metrics, hidden.grad,
                                      model.output_layer.weight.grad)
    return {"tp_rank": tp_rank, "cp_rank": cp_rank, "index": index, "results": results}


def contract_reference(name, tp):
    """float64: dense log-probs, the loss func's documented (loss_sum, count)."""
    from megatron_fused_ce.losses import dpo_loss, grpo_loss, nll_loss

    d = contract_inputs(tp)
    kind, mask_key, options = CONTRACT_CASES[name]
    h = d["hidden"].double().requires_grad_()
    w = d["weight"].double().requires_grad_()
    vocab = V_LOCAL * tp - VOCAB_SHIFT
    logp = torch.log_softmax((h @ w.t())[..., :vocab] / TEMPERATURE, dim=-1)
    labels = d["labels"]
    scored = labels != -100
    lp = torch.where(scored, logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    mask = d[mask_key].double() * scored
    if kind == "sft":
        loss, _ = nll_loss(lp, mask, normalizer=1)
        count = int((mask != 0).sum())
    elif kind == "dpo":
        pairs = B // 2
        loss, _ = dpo_loss(lp, d["ref"].double(), mask, normalizer=1,
                           sft_normalizer=float(mask[0::2].sum()) / pairs, **options)
        count = pairs
    else:
        loss, _ = grpo_loss(lp, d["adv"].double(), mask, options, normalizer=1, old_logprobs=d["old"].double(),
                            reference_logprobs=d["ref"].double() if options.beta > 0 else None,
                            sampling_logprobs=d["sampling"].double())
        if options.normalizer_unit == "tokens":
            count = int((mask != 0).sum())
        elif options.count_empty_sequences or not options.per_sequence_mean:
            count = B
        else:
            count = int((mask != 0).any(-1).sum())
    loss.backward()
    return loss.detach(), count, h.grad, w.grad


def _megatron_view(reports, key, tp):
    """What Megatron makes of the CP ranks' outputs: sums over CP of loss_sum, count and metric
    pairs (TP rank 0), dX in sequence order, dW summed over CP per vocab shard."""
    first = [r for r in reports if r["tp_rank"] == 0]
    loss = sum(float(r["results"][key][0]) for r in first)
    count = sum(int(r["results"][key][1]) for r in first)
    names = first[0]["results"][key][2]
    metrics = {}
    for n in names:
        total = sum(r["results"][key][2][n] for r in first)
        metrics[n] = float(total[0] / total[1]) if total[1] != 0 else 0.0
    dx = torch.zeros(B, SEQ, H)
    for r in first:
        dx[:, r["index"]] = r["results"][key][3]
    dw = torch.cat([sum(r["results"][key][4] for r in reports if r["tp_rank"] == t) for t in range(tp)])
    return loss, count, metrics, dx, dw


@pytest.mark.parametrize("tp,cp", [(1, 2), (1, 4), (2, 2)], ids=["cp2", "cp4", "tp2-cp2"])
def test_loss_funcs_float64_contract_under_context_parallelism(tp, cp):
    import reference

    reports = run_workers(contract_worker, tp * cp, tp)
    cp1 = run_workers(contract_worker, tp, tp)
    for name in CONTRACT_CASES:
        want_loss, want_count, want_dx, want_dw = contract_reference(name, tp)
        assert want_dx.abs().max() > 0 and want_dw.abs().max() > 0, name
        for fused in (False, True):
            loss, count, metrics, dx, dw = _megatron_view(reports, (name, fused), tp)
            _, _, cp1_metrics, _, _ = _megatron_view(cp1, (name, fused), tp)
            label = f"loss func {'fused' if fused else 'unfused'} CP={cp}"
            errors = {"value": abs(loss - float(want_loss)) / abs(float(want_loss)),
                      "dX": reference.rel_err(dx, want_dx), "dW": reference.rel_err(dw, want_dw)}
            for what, err in errors.items():
                reference.record(f"{label} {what}", tp, torch.float32, err)
                assert err < CONTRACT_TOL, (name, fused, what, err)
            assert count == want_count, (name, fused, count, want_count)
            assert metrics.keys() == cp1_metrics.keys()
            for n, value in cp1_metrics.items():
                assert abs(metrics[n] - value) <= 1e-5 * max(abs(value), 1.0), (name, fused, n, metrics[n], value)
