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
compute_logprobs' layouts are tested end to end, fused and unfused.

Compared for SFT, DPO (+ SFT term), GRPO (dapo, KL, token-level IS correction; fused: gradients in
forward) and GSPO (sequence-level ratio and IS correction, per-sequence mean): every metric as
Megatron-LM logs it (`[sum, count]` pairs summed over micro-batches and DP x CP ranks), every
parameter's gradient after finalize_model_grads, and the forward-only log-probs (gathered layout
vs CP=1, sharded layout vs the rank's slice). Layouts: CP=2, TP=2 x CP=2 (+SP, tied), PP=2 x
CP=2, CP=2 x DP=2, CP=4, and CP=2 with calculate_per_token_loss=False.
Tolerances as in test_megatron_parity (fp32, summation order only): metrics and log-probs 1e-5
relative (absolute for values below 1), each gradient 1e-4 of its largest entry.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import test_megatron_common as common
from dist import run_workers
from test_megatron_common import MBS, SEQ, TRUE_VOCAB, Setup

from megatron_fused_ce.losses import GRPOConfig
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    batch_on_this_cp_rank,
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


def _loss_func_maker(kind, post, forward_only):
    def make(chunk, batch, index):
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "sft":
            return sft_loss_func(post, chunk, labels, mask)
        lp = forward_only[index]  # the sharded layout: this rank's slice, as the batch
        noise = batch["noise"] * (mask != 0)
        if kind == "dpo":
            return dpo_loss_func(post, chunk, labels, mask, lp + noise, **DPO)
        return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], CONFIGS[kind],
                              old_logprobs=lp + noise, reference_logprobs=lp - noise,
                              sampling_logprobs=lp + 0.5 * noise)

    return make


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


def parity_worker(rank, world, setup: Setup, kinds):
    from megatron.core import parallel_state as ps

    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    last = ps.is_pipeline_last_stage()
    report = {"coords": (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                         ps.get_data_parallel_rank()),
              "cp_rank": ps.get_context_parallel_rank(), "last": last}
    cp_group = context_parallel_group()
    for kind in kinds:
        post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
        whole = common.make_batches("sft" if kind == "sft" else "grpo", NUM_MICROBATCHES,
                                    seed=100 + ps.get_data_parallel_rank())
        batches = common.cp_batches(whole)
        report[kind] = {}
        for mode in ("unfused", "fused"):
            (install_fused_output_layer if mode == "fused" else uninstall_fused_output_layer)(
                chunks, *((fused,) if mode == "fused" else ()))
            sharded = gathered = None
            if kind != "sft":
                kw = dict(seq_length=SEQ, micro_batch_size=MBS)
                sharded = [o.logprobs for o in compute_logprobs(chunks, batches, common.forward_fn, post, **kw)]
                gathered = [o.logprobs for o in compute_logprobs(chunks, batches, common.forward_fn, post,
                                                                 layout="gathered", **kw)]
            metrics = common.run_step(chunks, batches, _loss_func_maker(kind, post, sharded))
            run = {"grads": common.grads(chunks), "gathered": gathered,
                   "metrics": reduce_metrics(metrics) if last else None}
            if gathered is not None:  # the sharded layout is this rank's slice of the gathered one
                index = positions_on_cp_rank(SEQ, ps.get_context_parallel_world_size(),
                                             ps.get_context_parallel_rank())
                run["sharded_vs_gathered"] = max(float((s - g[:, index]).abs().max())
                                                 for s, g in zip(sharded, gathered))
            report[kind][mode] = run
    assert cp_group is None or dist.get_world_size(cp_group) == setup.cp
    return report


def _check_parity(setup: Setup, kinds=KINDS):
    reference_setup = Setup(tp=setup.tp, pp=setup.pp, dp=setup.dp, tied=setup.tied, sp=setup.sp,
                            per_token_loss=setup.per_token_loss, gathered_attention=True)
    reference = {r["coords"]: r for r in run_workers(parity_worker, reference_setup.world,
                                                      reference_setup, kinds, timeout=240)}
    results = run_workers(parity_worker, setup.world, setup, kinds, timeout=240)
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
                bad = {n: d for n, d in grad_diff.items() if d > GRAD_RTOL}
                assert not bad, (kind, mode, result["cp_rank"], bad)
                errors = [max(grad_diff.values())]
                if result["last"]:
                    assert got["metrics"].keys() == want["metrics"].keys(), (kind, mode)
                    for name, value in want["metrics"].items():
                        # (absolute below 1: reward_margin is a small difference of large sums)
                        err = abs(got["metrics"][name] - value) / max(abs(value), 1.0)
                        assert err <= RTOL, (kind, mode, name, got["metrics"][name], value)
                        errors.append(err)
                if want["gathered"] is not None:
                    for a, b in zip(got["gathered"], want["gathered"]):
                        errors.append(common.max_rel_diff(a, b))
                        assert errors[-1] <= RTOL, (kind, mode, "gathered log-probs", errors[-1])
                    assert got["sharded_vs_gathered"] == 0.0
                worst[kind] = max(worst.get(kind, 0.0), *errors)
    print(f"{setup}: max relative difference to CP=1 {worst}")
    return worst


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
    record_property("max_rel_diff", _check_parity(setup))
