"""Megatron's loss scaling with gradient-accumulation fusion: fused main_grad == unfused main_grad.

A bf16 GPTModel (Float16Module + DDP) under Megatron's schedules, PP=2, 4 micro-batches, with
`calculate_per_token_loss` off (Megatron's default: each micro-batch's loss divided by its count and
the number of micro-batches, so the loss's upstream gradient is ~1/(tokens x micro-batches)) and
on. The fused output layer adds dW straight into `main_grad` (gradient-accumulation fusion); the
unfused run is Megatron's own. Every rank's `main_grad` must agree at bf16 level for SFT, DPO and
GRPO, with the loss funcs told the schedule's number of micro-batches (dW added in the forward times
the expected upstream gradient) and not told (with calculate_per_token_loss off, dW is then held in
an fp32 buffer until the backward): dW added in the forward with a wrong expected upstream
gradient would put the output weight's gradient off by that factor. The output layer's gradient is
compared entry by entry, the rest of a rank's gradient as a whole (||fused - unfused|| /
||unfused||): single entries of a small parameter far from the output layer (the first layer's
32-wide norm weight) carry the two paths' different bf16 roundings of the logits, 1.5-2.5 % of
their largest entry depending on the torch / megatron-core / CPU they run on, while a wrong loss
scale moves the whole gradient.
"""

from __future__ import annotations

import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import TRUE_VOCAB, Setup

from megatron_fused_ce.losses import GRPOConfig
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    compute_logprobs,
    dpo_loss_func,
    grpo_loss_func,
    install_fused_output_layer,
    sft_loss_func,
    uninstall_fused_output_layer,
    unwrap_model,
)

NUM_MICROBATCHES = 4
GRAD_RTOL_BF16 = 2e-2  # as the bf16 parity runs: the two paths round the bf16 logits differently
GRPO = GRPOConfig(loss_type="dapo")
DPO = dict(beta=0.5, sft_weight=0.3)

SETUPS = [
    Setup(tp=2, pp=2, dp=1, bf16=True, grad_acc_fusion=True, per_token_loss=False),
    Setup(tp=1, pp=2, dp=2, tied=True, bf16=True, grad_acc_fusion=True, per_token_loss=False),
    Setup(tp=2, pp=2, dp=1, tied=True, sp=True, bf16=True, grad_acc_fusion=True, per_token_loss=True),
]


def _worker(rank, world, setup: Setup, kinds):
    from megatron.core import parallel_state

    from megatron_fused_ce.ops import main_grad

    checks = []  # backward checks of an expected upstream gradient (in this forked worker only)
    check = main_grad.check_upstream_grad
    main_grad.check_upstream_grad = lambda param, actual, expected: (checks.append(1), check(param, actual, expected))
    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
    dp_rank = parallel_state.get_data_parallel_rank()
    report = {}
    for kind in kinds:
        batches = common.make_batches(kind, NUM_MICROBATCHES, seed=300 + dp_rank)
        grads = {}
        for mode in ("unfused", "fused:expected", "fused:buffer"):
            if mode == "unfused":
                uninstall_fused_output_layer(chunks)
            else:
                install_fused_output_layer(chunks, fused)
            unwrap_model(chunks[0]).config.gradient_accumulation_fusion = mode != "unfused"
            mbs = NUM_MICROBATCHES if mode == "fused:expected" else None
            forward_only = None
            if kind != "sft":
                forward_only = [out.logprobs for out in compute_logprobs(
                    chunks, batches, common.forward_fn, post, seq_length=common.SEQ,
                    micro_batch_size=common.MBS)]

            def make(chunk, batch, index):
                labels, mask = batch["labels"], batch["loss_mask"]
                if kind == "sft":
                    return sft_loss_func(post, chunk, labels, mask, num_microbatches=mbs)
                noise = batch["noise"] * (mask != 0)
                if kind == "dpo":
                    return dpo_loss_func(post, chunk, labels, mask, forward_only[index] + noise, **DPO)
                return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], GRPO,
                                      old_logprobs=forward_only[index] + noise, num_microbatches=mbs)

            before = len(checks)
            common.run_step(chunks, batches, make)
            grads[mode] = common.grads(chunks)
            report[f"{kind} {mode} checks"] = len(checks) - before
            report["last_stage"] = parallel_state.is_pipeline_last_stage()
        uninstall_fused_output_layer(chunks)
        report[kind] = {mode: _differences(grads[mode], grads["unfused"])
                        for mode in ("fused:expected", "fused:buffer")}
    return report


def _differences(grads: dict, unfused: dict) -> dict:
    """The output layer's main_grad (the fused op's own write) entry by entry (max_rel_diff), and
    the rank's whole gradient, every parameter as one vector (rel_norm_diff): a wrong upstream
    gradient scales all of it."""
    diffs = {name: common.max_rel_diff(g, unfused[name]) for name, g in grads.items() if "output_layer" in name}
    diffs["whole gradient"] = common.rel_norm_diff(torch.cat([g.flatten() for g in grads.values()]),
                                                   torch.cat([unfused[name].flatten() for name in grads]))
    return diffs


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_main_grad_matches_unfused_under_megatron_loss_scaling(setup):
    kinds = ("sft", "dpo", "grpo")
    worst = {}
    for report in run_workers(_worker, setup.world, setup, kinds, timeout=300):
        # the expected upstream gradient was passed, and checked, where dW is made in the forward
        for kind in kinds:
            made_in_forward = report["last_stage"] and kind != "dpo"
            assert report[f"{kind} fused:expected checks"] == (NUM_MICROBATCHES if made_in_forward else 0), kind
            # calculate_per_token_loss: the upstream gradient is the loss scale, known without it
            buffer_checks = NUM_MICROBATCHES if made_in_forward and setup.per_token_loss else 0
            assert report[f"{kind} fused:buffer checks"] == buffer_checks, kind
        for kind in kinds:
            for mode, diffs in report[kind].items():
                bad = {name: d for name, d in diffs.items() if d > GRAD_RTOL_BF16}
                assert not bad, (kind, mode, bad)
                worst[(kind, mode)] = max([worst.get((kind, mode), 0.0), *diffs.values()])
    print(f"{setup}: worst fused-vs-unfused main_grad difference {worst}")
