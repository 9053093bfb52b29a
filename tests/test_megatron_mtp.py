"""Multi-token prediction, fused vs unfused, on a real GPTModel + get_forward_backward_func (CPU,
gloo, fp32, megatron's local spec).

For each layout (TP 1/2, SP, PP=2 with the MTP layers on the last stage, tied and untied,
`calculate_per_token_loss` on and off) the same model and data run unfused, then with
`install_fused_output_layer`, and are compared: every micro-batch's loss, megatron's MTP logging
(`MTPLossLoggingHelper`: per-depth losses; on megatron-core >= 0.19 also the acceptance counts,
argmax of the logits), and the gradient of every parameter, MTP layers included, after DDP +
`finalize_model_grads`. The fused runs never call the original output layer nor megatron's
vocab-parallel cross-entropy: no depth has logits.

Two ways of calling the model:
* "labels": Megatron-LM's `model(..., labels=labels, loss_mask=loss_mask)`, which returns the
  per-token loss of the main head (loss_func as in pretrain_gpt.py);
* "sft", "dpo", "grpo": this package's loss funcs. Fused: the same call with
  `return_hidden_states=True`. Unfused reference: the same call without, the main head's logits
  taken from the output layer (megatron returns their loss, not them, when labels are given).
  GRPO also runs a forward-only log-prob pass (`compute_logprobs`) through the MTP model.

Tolerances: those of test_megatron_parity.py (fp32: losses 1e-5 relative, gradients 1e-4 of the
parameter's largest entry; bf16 with Float16Module: 1e-3 and 2e-2). The worker and its checks
(`megatron_workers.mtp_worker`, `check_mtp_reports`) are shared with the NCCL suite.
"""

from __future__ import annotations

import pytest

import megatron_harness as common
from dist import run_workers
from megatron_harness import GRAD_RTOL_BF16, LOSS_RTOL_BF16, MBS, SEQ, Setup
from megatron_workers import check_mtp_reports, mtp_worker

from megatron_fused_ce.megatron import FusedCEConfig, install_fused_output_layer


MTP_CASES = [
    (Setup(mtp_layers=2), ("labels", "sft", "dpo", "grpo")),
    (Setup(dp=2, tied=True, mtp_layers=1, per_token_loss=False), ("labels", "sft")),
    (Setup(tp=2, sp=True, mtp_layers=2), ("labels", "grpo")),
    (Setup(tp=2, tied=True, mtp_layers=1, per_token_loss=False), ("labels", "dpo")),
    (Setup(pp=2, mtp_layers=2), ("labels", "sft")),
    (Setup(pp=2, tied=True, mtp_layers=1, per_token_loss=False), ("labels", "grpo")),
    (Setup(tp=2, pp=2, tied=True, sp=True, mtp_layers=2), ("labels",)),
    (Setup(tp=2, sp=True, mtp_layers=1, bf16=True), ("labels", "sft")),
    # Megatron's default loss scaling (calculate_per_token_loss off: the MTP heads' loss scale is set
    # by the schedule after their forward) with gradient-accumulation fusion, bf16
    (Setup(tp=2, pp=2, mtp_layers=1, bf16=True, grad_acc_fusion=True, per_token_loss=False),
     ("labels", "sft", "grpo")),
    (Setup(tied=True, mtp_layers=2, mtp_detach_heads=True), ("labels",)),
]


@pytest.mark.parametrize("setup,kinds", MTP_CASES, ids=[str(s) for s, _ in MTP_CASES])
def test_mtp_fused_matches_unfused(setup, kinds, record_property):
    if setup.mtp_detach_heads:
        from megatron.core.transformer import TransformerConfig

        if "mtp_detach_heads" not in TransformerConfig.__dataclass_fields__:
            pytest.skip("mtp_detach_heads arrives in megatron-core 0.19")
    reports = run_workers(mtp_worker, setup.world, setup, kinds, timeout=240)
    if setup.bf16:  # Float16Module; the two paths round the bf16 logits differently
        worst = check_mtp_reports(reports, setup, kinds, LOSS_RTOL_BF16, GRAD_RTOL_BF16, count_rtol=0.02)
    else:
        worst = check_mtp_reports(reports, setup, kinds)
    record_property("max_rel_diff", worst)
    print(f"{setup}: max relative fused-vs-unfused difference {worst}")


def no_labels_worker(rank, world):
    from megatron_fused_ce.megatron import compat

    (chunk,) = common.build(Setup(mtp_layers=1))
    install_fused_output_layer(chunk, FusedCEConfig(enabled=True, chunk_size=8))
    batch = common.make_batches("sft", 1, seed=0)[0]
    try:
        out = common.forward_fn(chunk, batch)
        return {"derives": compat.mtp_labels_from_input_ids(), "shape": tuple(out.shape)}
    except ValueError as error:
        return {"derives": compat.mtp_labels_from_input_ids(), "error": str(error)}


def test_mtp_without_labels():
    """megatron-core < 0.19 needs labels for the MTP losses: a clear error naming the call to make;
    >= 0.19 takes them from the input ids, and the fused model returns hidden states."""
    (r,) = run_workers(no_labels_worker, 1)
    if r["derives"]:
        assert r["shape"] == (MBS, SEQ, common.HIDDEN)
    else:
        assert "needs labels" in r["error"] and "return_hidden_states=True" in r["error"]
