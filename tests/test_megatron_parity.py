"""Fused vs unfused on a real GPTModel + get_forward_backward_func (CPU, gloo, fp32).

For every parallel layout and SFT, DPO and GRPO (reference / old log-probs from forward-only
passes, broadcast to every pipeline stage), the same model, data and loss are run twice: with the
logits (unfused) and with `install_fused_output_layer` (no logits). Compared: every micro-batch's
loss, the forward-only log-probs, and the gradient of every parameter after Megatron's DDP +
`finalize_model_grads`. Fused SFT and GRPO take the gradients-in-forward losses; GRPO with entropy
reporting ("grpo_entropy") takes the log-probs path.

Tolerances (fp32; the fused path sums the softmax over chunks and vocab shards in another order):
losses and log-probs to 1e-5 relative, each parameter's gradient to 1e-4 of its largest entry
(measured: <= 4e-6). bf16 with Float16Module: 1e-3 and 2e-2 (measured: ~5e-3 on gradients).
The worker (`megatron_workers.parity_worker`) is shared with the NCCL suite.
"""

from __future__ import annotations

import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import GRAD_RTOL, GRAD_RTOL_BF16, LOSS_RTOL, LOSS_RTOL_BF16, MBS, SEQ, Setup
from megatron_workers import NUM_MICROBATCHES, parity_worker

from megatron_fused_ce.megatron import FusedCEConfig, install_fused_output_layer


SETUPS = [
    Setup(tp=1, pp=1, dp=2),
    Setup(tp=2, pp=1, dp=2, tied=True),
    Setup(tp=2, pp=1, dp=2, sp=True),
    Setup(tp=1, pp=2, dp=2, tied=True),
    Setup(tp=2, pp=2, dp=1),
    Setup(tp=2, pp=2, dp=1, tied=True, sp=True),
    Setup(tp=1, pp=2, dp=2, vp=2, layers=4, tied=True),
    Setup(tp=2, pp=2, dp=1, tied=True, grad_acc_fusion=True),
    Setup(tp=1, pp=1, dp=2, tied=True, grad_acc_fusion=True),
    Setup(tp=2, pp=2, dp=1, tied=True, bf16=True),
]


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_fused_matches_unfused(setup, record_property):
    kinds = ("sft", "dpo", "grpo", "grpo_entropy")
    reports = run_workers(parity_worker, setup.world, setup, kinds, timeout=180)
    loss_rtol, grad_rtol = (LOSS_RTOL_BF16, GRAD_RTOL_BF16) if setup.bf16 else (LOSS_RTOL, GRAD_RTOL)
    worst = {}
    for report in reports:
        if report["last_stage"]:  # the op wrote dW into main_grad itself only when asked to
            assert report["grad_added_to_main_grad"] == setup.grad_acc_fusion
        for kind in kinds:
            r = report[kind]
            assert r["same_keys"]
            assert r["grad_norm"] > 0
            if report["last_stage"]:
                assert r["num_metrics"] == NUM_MICROBATCHES
                # the fused run used the gradients-in-forward losses where they apply
                expected = {"linear_cross_entropy": NUM_MICROBATCHES if kind == "sft" else 0,
                            "linear_grpo_loss": NUM_MICROBATCHES if kind == "grpo" else 0}
                assert r["gradients_in_forward_calls"] == expected, (kind, r)
                assert r["loss_diff"] <= loss_rtol, (kind, r["loss_diff"])
            bad = {n: d for n, d in r["grad_diff"].items() if d > grad_rtol}
            assert not bad, (kind, bad)
            assert r["forward_only_diff"] <= loss_rtol, (kind, r["forward_only_diff"])
            worst[kind] = max(worst.get(kind, 0.0), r["loss_diff"], r["forward_only_diff"],
                              max(r["grad_diff"].values()))
    # Forward-only log-probs are identical (bitwise) on every rank of a data-parallel replica.
    for kind in ("dpo", "grpo", "grpo_entropy"):
        for dp_rank in {r["dp_rank"] for r in reports}:
            replica = [r[kind]["forward_only"] for r in reports if r["dp_rank"] == dp_rank]
            for other in replica[1:]:
                for a, b in zip(replica[0], other):
                    assert torch.equal(a, b)
    record_property("max_rel_diff", worst)
    print(f"{setup}: max relative fused-vs-unfused difference {worst}")


# ------------------------------------------------------------------------------------------------
# Megatron-LM's own pretraining style: labels go into the model, which returns per-token losses.
# ------------------------------------------------------------------------------------------------
def labels_worker(rank, world, setup: Setup, positional: bool):
    from megatron.core import parallel_state

    chunks = common.build(setup)
    dp_rank = parallel_state.get_data_parallel_rank()
    batches = common.make_batches("sft", NUM_MICROBATCHES, seed=100 + dp_rank)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)

    def forward_step(data_iterator, chunk):
        _, batch = next(data_iterator)
        args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
        if positional:
            per_token = chunk(*args, None, batch["labels"])
        else:
            per_token = chunk(*args, labels=batch["labels"])

        def loss_func(output):  # as in Megatron-LM's pretrain_gpt.py
            mask = batch["loss_mask"]
            loss = torch.sum(output.float() * mask)
            count = mask.sum().to(torch.int)
            return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

        return per_token, loss_func

    runs = {}
    for mode in ("unfused", "fused"):
        if mode == "fused":
            install_fused_output_layer(chunks, fused)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for chunk in chunks:
            chunk.zero_grad_buffer()
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(list(enumerate(batches))),
            model=chunks, num_microbatches=NUM_MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
        runs[mode] = (metrics, common.grads(chunks))
    (mu, gu), (mf, gf) = runs["unfused"], runs["fused"]
    loss_diff = max([common.max_rel_diff(f["lm loss"], u["lm loss"]) for u, f in zip(mu, mf)],
                    default=0.0)
    return {"loss_diff": loss_diff, "num_metrics": len(mu),
            "grad_diff": max(common.max_rel_diff(gf[n], g) for n, g in gu.items())}


@pytest.mark.parametrize("setup,positional", [
    (Setup(tp=1, pp=1, dp=2), False),
    (Setup(tp=2, pp=2, tied=True, sp=True), False),
    (Setup(tp=2, pp=1, dp=2, tied=True), True),
], ids=["tp1-pp1-dp2", "tp2-pp2-tied-sp", "tp2-pp1-dp2-tied-positional"])
def test_labels_into_model_like_megatron_lm(setup, positional):
    """`model(..., labels=labels)` with fusion on returns megatron's per-token loss (full padded
    vocab, as megatron computes it), with the same gradients."""
    for r in run_workers(labels_worker, setup.world, setup, positional):
        assert r["num_metrics"] in (0, NUM_MICROBATCHES)
        assert r["loss_diff"] <= LOSS_RTOL
        assert r["grad_diff"] <= GRAD_RTOL
