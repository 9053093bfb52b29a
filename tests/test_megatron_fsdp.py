"""The fused output layer with its weight sharded over the data-parallel group (torch FSDP2,
Megatron-FSDP): GPTModel (local spec, fp32) on CPU/gloo, DP=2 and TP=2 x DP=2, driven by megatron's
`get_forward_backward_func` with this package's SFT and GRPO loss funcs and Megatron-LM's
`model(..., labels=...)`.

Five ways of sharding (`wrap`): "fully_shard" on every transformer layer, the embedding, the output
layer and the root; "megatron": megatron's own TorchFullyShardedDataParallel (`use_torch_fsdp2`; its
device mesh put on the CPU); "root": `fully_shard` of the layers and the root only, the output weight
then belonging to the root unit; "megatron_fsdp": megatron's FullyShardedDataParallel
(`use_megatron_fsdp`, optim_grads_params; its CUDA streams made no-ops on the CPU, needs einops),
default units; "megatron_fsdp_unit": the same with the fused output layer a unit of its own.
The fused layer is installed before wrapping. Checked per step:

* values and gradients: the fused run's losses and every parameter's gradient (gathered from its
  shards) equal the unfused run's (same engine) and a float64 dense reference (the same weights in
  float64, unwrapped, full logits, `log_softmax`, over every data-parallel rank's batches);
* FSDP2 units: the output weight's unit is all-gathered once per micro-batch (GPTModel and the loss
  both call the layer; no second gather in backward) and its gradient reduce-scattered once per
  backward, whatever the number of chunks; afterwards, and after a forward-only pass, its memory is
  back to the shard (the unsharded storage is freed); Megatron-FSDP, default units: the fused run
  issues exactly the unfused run's data-parallel collectives; the fused layer a unit: its bucket is
  gathered once in forward and once for backward per micro-batch, and released after the step
  and after a forward-only pass;
* collectives: every collective issued by this package is on the tensor-parallel group; the
  data-parallel collectives (FSDP's) are the same sequence on every data-parallel rank, also with
  very unequal numbers of labelled tokens per rank (3 vs 3000, 0 vs 3000: 0 to 375 chunks), with
  exact gradients and no hang; over gloo, no collective is in flight when the next one of its
  group is issued (megatron_harness.megatron_gloo_collectives_in_order).

Tied embeddings (`test_tied_weights`): fused equals unfused where the tied weight is gathered when
the loss runs (FSDP2's root unit, Megatron-FSDP); a clear error where it is not.

Install order: installing (or uninstalling) on a model already wrapped raises, and so does a fused
op that finds the weight still sharded (a root unit resharded after forward), on every rank.

The workers are in tests/megatron_fsdp_workers.py; tests/test_multigpu_fsdp.py runs them over NCCL
(fp32 against float64, and bf16).
"""

from __future__ import annotations

import pytest

import megatron_harness as common
from dist import run_workers
from megatron_fsdp_workers import (
    FUSED,
    build_gpt,
    check_reports,
    check_tied,
    dp_mesh,
    fsdp_worker,
    needs_engine,
    tied_worker,
    wrap,
)
from megatron_harness import TRUE_VOCAB

from megatron_fused_ce.megatron import (
    LogprobsPostProcessor,
    install_fused_output_layer,
    sft_loss_func,
    uninstall_fused_output_layer,
    unwrap_model,
)


# "labels": Megatron-LM's model(..., labels=labels), the cross-entropy computed inside the forward
CASES = [(1, "fully_shard", ("sft", "grpo", "labels")), (1, "megatron", ("sft", "grpo", "labels")),
         (1, "root", ("sft", "grpo")), (1, "megatron_fsdp", ("sft", "grpo", "labels")),
         (1, "megatron_fsdp_unit", ("sft", "grpo", "labels")),
         (2, "fully_shard", ("sft", "grpo")), (2, "megatron", ("sft", "grpo", "labels")),
         (2, "megatron_fsdp", ("sft", "grpo", "labels"))]


@pytest.mark.parametrize("tp,wrapper,kinds", CASES, ids=[f"tp{tp}-dp2-{w}" for tp, w, _ in CASES])
def test_fused_matches_unfused_and_float64(tp, wrapper, kinds):
    needs_engine(wrapper)
    reports = run_workers(fsdp_worker, 2 * tp, tp, wrapper, kinds, timeout=180)
    worst = check_reports(reports)
    print(f"tp{tp}-dp2-{wrapper}: worst gradient error vs float64 {worst:.2e}")


def test_megatron_fsdp_keeps_its_main_grad():
    """With gradient-accumulation fusion on, the fused op leaves Megatron-FSDP's main_grad alone
    (Megatron-FSDP sets it when the gradient arrives) and hands autograd the gradient."""
    needs_engine("megatron_fsdp")
    check_reports(run_workers(fsdp_worker, 2, 1, "megatron_fsdp", ("sft", "grpo"), None, False, True,
                              timeout=180))


def test_bf16_fused_matches_unfused():
    """bf16 parameters (Float16Module), FSDP2: fused vs unfused at the bf16 tolerances."""
    check_reports(run_workers(fsdp_worker, 2, 1, "fully_shard", ("sft", "grpo"), None, True,
                              timeout=180), bf16=True, exact=False)


UNEQUAL = [(1, (3, 3000), "fully_shard", ("sft", "grpo")), (2, (0, 3000), "megatron", ("grpo",)),
           (2, (3000, 0), "megatron_fsdp", ("sft",))]


@pytest.mark.parametrize("tp,token_counts,wrapper,kinds", UNEQUAL,
                         ids=[f"tp{tp}-dp2-tokens{a}vs{b}-{w}" for tp, (a, b), w, _ in UNEQUAL])
def test_unequal_token_counts(tp, token_counts, wrapper, kinds):
    """Data-parallel ranks with 3 (or 0) and 3000 labelled tokens: 1 (0) and 375 chunks. No hang,
    the same FSDP collectives on both, gradients equal to the float64 reference."""
    needs_engine(wrapper)
    reports = run_workers(fsdp_worker, 2 * tp, tp, wrapper, kinds, token_counts, timeout=120)
    check_reports(reports)


# ------------------------------------------------------------------------------------------------
# Install order and a weight left sharded
# ------------------------------------------------------------------------------------------------
def order_worker(rank, world, wrapper):
    gpt = build_gpt(1)
    model = wrap(gpt, wrapper)
    report = {}
    try:
        install_fused_output_layer(model, FUSED)
    except ValueError as error:
        report["install"] = str(error)
    report["untouched"] = type(unwrap_model(model).output_layer).__name__
    fused = wrap(install_fused_output_layer(build_gpt(1), FUSED), wrapper)
    try:
        uninstall_fused_output_layer(fused)
    except ValueError as error:
        report["uninstall"] = str(error)
    return report


@pytest.mark.parametrize("wrapper", ["fully_shard", "megatron", "megatron_fsdp"])
def test_install_after_wrapping_raises(wrapper):
    needs_engine(wrapper)
    engine = "Megatron-FSDP" if wrapper == "megatron_fsdp" else "torch FSDP2"
    for report in run_workers(order_worker, 2, wrapper):
        assert f"already wrapped in {engine}" in report["install"]
        assert "before wrapping" in report["install"]
        assert "ColumnParallelLinear" in report["untouched"]
        assert f"wrapped in {engine}" in report["uninstall"]


def resharded_root_worker(rank, world):
    """The output weight in the root unit, resharded after forward: the loss finds it sharded."""
    from torch.distributed.fsdp import fully_shard

    gpt = install_fused_output_layer(build_gpt(1), FUSED)
    mesh = dp_mesh()
    for layer in gpt.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(gpt, mesh=mesh, reshard_after_forward=True)
    batch = common.make_batches("sft", 1, seed=rank)[0]
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    hidden = gpt(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    try:
        sft_loss_func(post, gpt, batch["labels"], batch["loss_mask"])(hidden)
    except ValueError as error:
        return str(error)
    return None


def test_weight_still_sharded_raises_on_every_rank():
    for message in run_workers(resharded_root_worker, 2, timeout=60):
        assert message and "still sharded" in message and "fully_shard(model.output_layer)" in message


@pytest.mark.parametrize("wrapper", ["fully_shard", "root", "megatron_fsdp"])
def test_tied_weights(wrapper):
    needs_engine(wrapper)
    check_tied(run_workers(tied_worker, 2, wrapper, timeout=90), wrapper)


