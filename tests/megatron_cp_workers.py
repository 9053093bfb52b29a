"""Context-parallel workers shared by tests/test_megatron_cp.py, tests/test_megatron_output_processor.py,
tests/test_megatron_replay.py and the NCCL suite (tests/test_multigpu.py), with the checks of their
reports: a training step per loss kind at CP=N against CP=1, CP=2 under torch FSDP2, and the packed
(THD) micro-batches of one row.

Tolerances as in test_megatron_parity (fp32, summation order only): metrics and log-probs 1e-5
relative (absolute for values below 1), each gradient 1e-4 of its largest entry.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_harness as common
from megatron_harness import MBS, SEQ, TRUE_VOCAB, Setup, megatron_lm_loss_func

from megatron_fused_ce.losses import GRPOConfig
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    compute_logprobs,
    context_parallel_group,
    dpo_loss_func,
    grpo_loss_func,
    install_fused_output_layer,
    positions_on_cp_rank,
    sft_loss_func,
    uninstall_fused_output_layer,
)

RTOL = 1e-5
GRAD_RTOL = 1e-4
NUM_MICROBATCHES = 2
KINDS = ("sft", "dpo", "grpo", "gspo")
DPO = dict(beta=0.5, sft_weight=0.3)
CONFIGS = {
    "grpo": GRPOConfig(loss_type="dapo", beta=0.05, is_correction="token_truncate", is_clip_max=1.05),
    "gspo": GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.05,
                       is_correction="sequence_truncate", is_clip_max=1.5),
}


# ------------------------------------------------------------------------------------------------
# CP=N against CP=1: SFT, DPO, GRPO, GSPO and Megatron-LM's labels route
# ------------------------------------------------------------------------------------------------
def cp_loss_func_maker(kind, post, forward_only):
    def make(chunk, batch, index):
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "sft":
            return sft_loss_func(post, chunk, labels, mask)
        if kind == "labels":  # Megatron-LM's route: the model returns per-token losses
            return megatron_lm_loss_func(mask)
        lp = forward_only[index]  # the sharded layout: this rank's slice, as the batch
        noise = batch["noise"] * (mask != 0)
        if kind == "dpo":
            return dpo_loss_func(post, chunk, labels, mask, lp + noise, **DPO)
        return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], CONFIGS[kind],
                              old_logprobs=lp + noise, reference_logprobs=lp - noise,
                              sampling_logprobs=lp + 0.5 * noise)

    return make


def labels_forward(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])


def reduce_metrics(metrics):
    """Megatron-LM's logging: `[sum, count]` pairs summed over micro-batches and DP x CP ranks."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    out = {}
    for name in metrics[0]:
        total = torch.stack([m[name].float() for m in metrics]).sum(0)
        dist.all_reduce(total, group=group)
        out[name] = float(total[0] / total[1]) if total[1] != 0 else 0.0
    return out


def parity_worker(rank, world, setup: Setup, kinds, data_replicas=None, sampler=None):
    """One training step per loss kind, unfused then fused, on this rank's CP slices.

    DP rank d trains on the micro-batches of seed 100 + d (100 + d % data_replicas: a CP=1
    reference on more DP ranks then repeats the CP run's data, which leaves every gradient and
    logged mean unchanged). `sampler`: the post-processor's sampler settings (top_k / top_p /
    min_p / return_topk)."""
    from megatron.core import parallel_state as ps

    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    last = ps.is_pipeline_last_stage()
    report = {"coords": (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                         ps.get_data_parallel_rank()),
              "cp_rank": ps.get_context_parallel_rank(), "last": last}
    cp_group = context_parallel_group()
    for kind in kinds:
        post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB, **(sampler or {}))
        dp_rank = ps.get_data_parallel_rank()
        whole = common.make_batches("sft" if kind in ("sft", "labels") else "grpo", NUM_MICROBATCHES,
                                    seed=100 + (dp_rank % data_replicas if data_replicas else dp_rank))
        batches = common.cp_batches(whole)
        report[kind] = {}
        for mode in ("unfused", "fused"):
            (install_fused_output_layer if mode == "fused" else uninstall_fused_output_layer)(
                chunks, *((fused,) if mode == "fused" else ()))
            sharded = gathered = gathered_topk = None
            if kind not in ("sft", "labels"):
                kw = dict(seq_length=SEQ, micro_batch_size=MBS)
                sharded = [o.logprobs for o in compute_logprobs(chunks, batches, common.forward_fn, post, **kw)]
                outs = compute_logprobs(chunks, batches, common.forward_fn, post, layout="gathered", **kw)
                gathered = [o.logprobs for o in outs]
                if post.return_topk:  # top-k log-probs and ids gathered like the log-probs
                    gathered_topk = [(o.topk_logprobs, o.topk_ids) for o in outs]
            metrics = common.run_step(chunks, batches, cp_loss_func_maker(kind, post, sharded),
                                      forward=labels_forward if kind == "labels" else common.forward_fn)
            run = {"grads": common.grads(chunks), "gathered": gathered, "gathered_topk": gathered_topk,
                   "metrics": reduce_metrics(metrics) if last else None}
            if gathered is not None:  # the sharded layout is this rank's slice of the gathered one
                index = positions_on_cp_rank(SEQ, ps.get_context_parallel_world_size(),
                                             ps.get_context_parallel_rank())
                run["sharded_is_gathered_slice"] = all(torch.equal(s, g[:, index])
                                                       for s, g in zip(sharded, gathered))
            report[kind][mode] = run
    assert cp_group is None or dist.get_world_size(cp_group) == setup.cp
    return report


def check_cp_reports(results, reference_results, kinds=KINDS, *, rtol=RTOL, grad_rtol=GRAD_RTOL):
    """Every CP rank's metrics, gradients and forward-only log-probs against the CP=1 reference
    rank at the same (pipeline, tensor, data-parallel) coordinates (data-parallel rank modulo the
    CP run's DP size). Returns the worst difference per kind."""
    replicas = 1 + max(r["coords"][2] for r in results)
    reference = {r["coords"]: r for r in reference_results if r["coords"][2] < replicas}
    worst = {}
    for result in results:
        ref = reference[result["coords"]]
        for kind in kinds:
            want = ref[kind]["unfused"]
            for mode in ("unfused", "fused"):
                got = result[kind][mode]
                assert got["grads"].keys() == want["grads"].keys()
                grad_diff = {name: common.max_rel_diff(got["grads"][name], g)
                             for name, g in want["grads"].items()}
                bad = {n: d for n, d in grad_diff.items() if d > grad_rtol}
                assert not bad, (kind, mode, result["cp_rank"], bad)
                errors = [max(grad_diff.values())]
                if result["last"]:
                    assert got["metrics"].keys() == want["metrics"].keys(), (kind, mode)
                    for name, value in want["metrics"].items():
                        # (absolute below 1: reward_margin is a small difference of large sums)
                        err = abs(got["metrics"][name] - value) / max(abs(value), 1.0)
                        assert err <= rtol, (kind, mode, name, got["metrics"][name], value)
                        errors.append(err)
                if want["gathered"] is not None:
                    for a, b in zip(got["gathered"], want["gathered"]):
                        errors.append(_finite_rel_diff(a, b))
                        assert errors[-1] <= rtol, (kind, mode, "gathered log-probs", errors[-1])
                    assert got["sharded_is_gathered_slice"], (kind, mode)
                if want["gathered_topk"] is not None:
                    for (lp, ids), (want_lp, want_ids) in zip(got["gathered_topk"], want["gathered_topk"]):
                        assert torch.equal(ids, want_ids), (kind, mode, "gathered top-k ids")
                        errors.append(common.max_rel_diff(lp, want_lp))
                        assert errors[-1] <= rtol, (kind, mode, "gathered top-k log-probs", errors[-1])
                worst[kind] = max(worst.get(kind, 0.0), *errors)
    return worst


def _finite_rel_diff(a, b):
    """`max_rel_diff` over the finite entries of `b`, which must be where `a`'s are (log-probs
    outside a sampler's kept set are -inf)."""
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite) and torch.equal(a[~finite], b[~finite])
    return common.max_rel_diff(a[finite], b[finite])


# ------------------------------------------------------------------------------------------------
# CP=2 with the weights sharded by torch FSDP2
# ------------------------------------------------------------------------------------------------
COMPUTE_LAYOUTS = ("sharded", "gathered")


def fsdp_worker(rank, world, kinds):
    """CP=2 with the weights sharded by torch FSDP2 (`fully_shard`, the output layer a unit of its
    own) over the data-parallel x CP group, as megatron's FSDP wrappers shard them: outside the
    output layer's call the output weight is a shard, so a fused op that read it there (instead of
    running inside the call, `run_in_output_layer`) would fail. Fused vs unfused (same engine, same
    weights): every micro-batch's loss, the forward-only log-probs in both layouts, every
    parameter's gradient (gathered from its shards)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from dist import init_megatron_parallel
    from megatron_fsdp_workers import device, gathered_grads
    from megatron_fused_ce.megatron import enable_cpu_mode
    from megatron_harness import HEADS, HIDDEN, PADDED_VOCAB

    setup = Setup(cp=2)  # x DP = world / 2
    enable_cpu_mode()
    init_megatron_parallel(1, 1, context_parallel_size=setup.cp)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               context_parallel_size=setup.cp, calculate_per_token_loss=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
    mesh = DeviceMesh.from_group(ps.get_data_parallel_group(with_context_parallel=True), device().type)
    models = {mode: GPTModel(config, common.layer_spec(config, setup), vocab_size=PADDED_VOCAB,
                             max_sequence_length=SEQ).to(device()) for mode in ("unfused", "fused")}
    models["fused"].load_state_dict(models["unfused"].state_dict())
    install_fused_output_layer(models["fused"], fused)  # before wrapping
    for mode, gpt in models.items():
        for layer in gpt.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(gpt.embedding, mesh=mesh)
        fully_shard(gpt.output_layer, mesh=mesh)
        models[mode] = fully_shard(gpt, mesh=mesh)
    report = {}
    kw = dict(seq_length=SEQ, micro_batch_size=MBS)
    for kind in kinds:
        batches = common.cp_batches(common.make_batches("sft" if kind == "sft" else "grpo",
                                                        NUM_MICROBATCHES, seed=100 + ps.get_data_parallel_rank()))
        report[kind] = {}
        for mode, model in models.items():
            run = {}
            sharded = None
            if kind != "sft":
                for layout in COMPUTE_LAYOUTS:
                    outs = compute_logprobs(model, batches, common.forward_fn, post, layout=layout, **kw)
                    run[layout] = [o.logprobs for o in outs]
                sharded = run["sharded"]
            make = cp_loss_func_maker(kind, post, sharded)

            def forward_step(data_iterator, chunk):
                index, batch = next(data_iterator)
                return common.forward_fn(chunk, batch), make(chunk, batch, index)

            model.zero_grad(set_to_none=True)
            metrics = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(list(enumerate(batches))),
                model=[model], num_microbatches=len(batches), **kw)
            run["losses"] = [m["loss" if "loss" in m else "lm loss"] for m in metrics]
            run["grads"] = gathered_grads(model)
            report[kind][mode] = run
    return report


def check_fsdp_reports(reports):
    for report in reports:
        for kind, runs in report.items():
            unfused, fused = runs["unfused"], runs["fused"]
            for a, b in zip(fused["losses"], unfused["losses"]):
                assert common.max_rel_diff(a, b) <= RTOL, kind
            for layout in COMPUTE_LAYOUTS if kind != "sft" else ():
                for a, b in zip(fused[layout], unfused[layout]):
                    assert common.max_rel_diff(a, b) <= RTOL, (kind, layout)
            assert fused["grads"].keys() == unfused["grads"].keys()
            for name, grad in unfused["grads"].items():
                assert grad is not None and float(grad.abs().max()) > 0, (kind, name)
                assert common.max_rel_diff(fused["grads"][name], grad) <= GRAD_RTOL, (kind, name)


# ------------------------------------------------------------------------------------------------
# Packed sequences (THD): one row of documents at their padded offsets
# ------------------------------------------------------------------------------------------------
DOCS = [3, 6, 2]  # real lengths; padded to multiples of 2·CP = 4: [4, 8, 4] (16 = SEQ)
DOCS_PADDED = [4, 8, 4]


def offsets(lengths):
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def packed_batch(seed: int):
    """One packed row [1, SEQ]: the documents at their padded offsets, labels = the next token of
    the stream (so the last token of a document is labelled with the next document's first token,
    padding with garbage: the post-processor must not score those)."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, TRUE_VOCAB, (SEQ + 1,), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in DOCS_PADDED])
    return {
        "tokens": stream[:-1].unsqueeze(0), "labels": stream[1:].unsqueeze(0),
        "loss_mask": (torch.rand(1, SEQ, generator=g) > 0.1).float(),
        "position_ids": position_ids.unsqueeze(0),
        "cu_seqlens": offsets(DOCS), "cu_seqlens_padded": offsets(DOCS_PADDED),
    }


def expected_scored_positions():
    """Positions of the packed row whose target lies in the same document."""
    starts = offsets(DOCS_PADDED)[:-1].tolist()
    return sorted(p for start, n in zip(starts, DOCS) for p in range(start, start + n - 1))


def packed_forward(chunk, batch):
    from megatron.core.packed_seq_params import PackedSeqParams

    real, padded = batch["cu_seqlens"], batch["cu_seqlens_padded"]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                             cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                             max_seqlen_q=max(DOCS_PADDED), max_seqlen_kv=max(DOCS_PADDED))
    return chunk(batch["tokens"], batch["position_ids"], None, packed_seq_params=params)
