"""Megatron's DDP for the distributed optimizer, `overlap_param_gather=True` and
`overlap_grad_reduce=True` (CPU, gloo, 2 data-parallel ranks; the optimizer itself needs CUDA:
tests/test_multigpu.py runs it, with megatron_workers.py's worker), with the fused output layer
installed before or after wrapping.

* The output weight is never read before its all-gather finished: DDP's forward pre-hook, which
  waits for the all-gather of a module's parameters (`finish_param_sync` of the bucket group),
  has run for the weight's bucket group before every fused op reads the weight. The weight has a
  bucket of its own (small buckets), so only the output layer's hook (tied: the embedding's)
  guards it.
* Its gradient reaches the bucket exactly once per step: DDP's per-parameter hook reports each
  parameter ready once (`register_grad_ready`), as unfused; the steps alternate unfused / fused /
  unfused, so megatron's check against the first step's counts passes only if they agree; the
  grad buffers (reduce-scattered) equal the unfused ones.
* Megatron-LM's evaluation path (`disable_forward_pre_hook` / `enable_forward_pre_hook`) works
  in both orders, and hooks of any other wrapper on the output layer make install raise.
* Over gloo the hooks dispatch and wait as above, but megatron's all-gathers and reduce-scatters
  run one at a time (megatron_harness.megatron_gloo_collectives_in_order): no collective is in
  flight when the next one of its group is issued.
"""

from __future__ import annotations

import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import GRAD_RTOL, LOSS_RTOL, TRUE_VOCAB, Setup
from megatron_workers import FUSED, ParamGatherRecorder, grad_buffers

from megatron_fused_ce.megatron import (
    LogprobsPostProcessor,
    install_fused_output_layer,
    output_weight,
    sft_loss_func,
    uninstall_fused_output_layer,
    unwrap_model,
)


class GradReadyCounter:
    """DDP's per-parameter "gradient ready" reports (`register_grad_ready`) per step."""

    def __init__(self, ddp):
        self.counts = {}
        names = {param: name for name, param in ddp.named_parameters()}
        for group in ddp.bucket_groups:
            original = group.register_grad_ready

            def ready(param, *args, _group=group, _original=original, **kwargs):
                if _group.is_last_microbatch:  # earlier micro-batches run under no_sync()
                    self.counts[names[param]] = self.counts.get(names[param], 0) + 1
                return _original(param, *args, **kwargs)

            group.register_grad_ready = ready

    def take(self):
        counts, self.counts = self.counts, {}
        return counts


def overlap_worker(rank, world, setup: Setup, order: str, kind: str):
    from megatron.core import parallel_state

    chunks = common.build(setup, install_before_wrap=FUSED if order == "before" else None)
    (ddp,) = chunks
    assert ddp.use_forward_hook  # the distributed optimizer's param-gather pre-hooks are on
    if order == "after":
        install_fused_output_layer(chunks, FUSED)
    weight = output_weight(chunks[0])
    gather = ParamGatherRecorder(ddp, weight)  # (forked worker: its patches die with it)
    ready = GradReadyCounter(ddp)
    in_flight = common.GlooCollectivesInFlight()
    post = LogprobsPostProcessor(FUSED, vocab_size=TRUE_VOCAB)
    batches = common.make_batches("sft", 2, seed=100 + parallel_state.get_data_parallel_rank())

    def forward(chunk, batch):
        if kind == "labels":  # Megatron-LM style: the model returns per-token losses
            return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                         labels=batch["labels"], loss_mask=batch["loss_mask"])
        return common.forward_fn(chunk, batch)

    def make_loss_func(chunk, batch, index):
        if kind == "labels":
            mask = batch["loss_mask"]

            def loss_func(output):
                loss = torch.sum(output.float() * mask)
                return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}

            return loss_func
        return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"])

    config = unwrap_model(ddp).config
    config.no_sync_func = ddp.no_sync  # as Megatron-LM's training loop: reduce on the last micro-batch
    steps = []
    for mode in ("unfused", "fused", "unfused", "fused"):
        if mode == "fused":
            install_fused_output_layer(chunks, FUSED)
        else:
            uninstall_fused_output_layer(chunks)
        config.gradient_accumulation_fusion = setup.grad_acc_fusion and mode == "fused"
        # Megatron-LM's evaluation toggles the pre-hooks: they must cover the current modules.
        ddp.disable_forward_pre_hook(param_sync=False)
        ddp.enable_forward_pre_hook()
        gather.new_step()
        # As after an optimizer step: every all-gather in flight, waited for by the pre-hooks.
        ddp.start_param_sync()
        metrics = common.run_step(chunks, batches, make_loss_func, forward=forward)
        steps.append({"mode": mode, "reads": gather.new_step(), "ready": ready.take(),
                      "grads": grad_buffers(ddp), "metrics": metrics, "in_flight": in_flight.take()})
    return steps


OVERLAP_CASES = [
    (Setup(dp=2, overlap=True), "before", "sft"),
    (Setup(dp=2, overlap=True), "after", "sft"),
    (Setup(dp=2, overlap=True), "after", "labels"),
    (Setup(dp=2, overlap=True, tied=True, mtp_layers=1), "before", "labels"),
    (Setup(dp=2, overlap=True, mtp_layers=1, grad_acc_fusion=True), "after", "labels"),
]


@pytest.mark.parametrize("setup,order,kind", OVERLAP_CASES,
                         ids=[f"{s}-install-{o}-wrap-{k}" for s, o, k in OVERLAP_CASES])
def test_param_gather_and_grad_reduce_overlap(setup, order, kind):
    for steps in run_workers(overlap_worker, setup.world, setup, order, kind, timeout=180):
        unfused, fused = steps[0], steps[1]
        for step in steps:
            if step["mode"] == "fused":
                # the fused ops read the weight, and only after its all-gather was waited for
                assert step["reads"] and all(step["reads"]), step["reads"]
            assert step["ready"] == unfused["ready"], (step["mode"], step["ready"])
            # over gloo, the all-gathers and reduce-scatters (all collectives) run one at a time
            assert step["in_flight"][0] == 0, (step["mode"], step["in_flight"])
        assert unfused["ready"] and set(unfused["ready"].values()) == {1}
        for a, b in zip(fused["grads"], unfused["grads"]):
            assert common.max_rel_diff(a, b) <= GRAD_RTOL
        for mf, mu in zip(fused["metrics"], unfused["metrics"]):
            assert common.max_rel_diff(mf["lm loss"], mu["lm loss"]) <= LOSS_RTOL
        for later in steps[2:]:  # no optimizer step: every step sees the same weights
            for a, b in zip(later["grads"], steps[int(later["mode"] == "fused")]["grads"]):
                assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Hooks of other wrappers: install/uninstall refuse to drop them.
# ------------------------------------------------------------------------------------------------
def foreign_hook_worker(rank, world):
    chunks = common.build(Setup())
    gpt = unwrap_model(chunks[0])
    original = gpt.output_layer
    handle = original.register_forward_pre_hook(lambda module, args: None)  # e.g. FSDP's unshard
    report = {}
    try:
        install_fused_output_layer(chunks, FUSED)
    except ValueError as error:
        report["install_error"] = str(error)
    report["untouched"] = (gpt.output_layer is original and "compute_language_model_loss" not in
                           vars(gpt) and not gpt._forward_pre_hooks)
    handle.remove()
    install_fused_output_layer(chunks, FUSED)
    gpt.output_layer.register_forward_hook(lambda module, args, output: None)
    try:
        uninstall_fused_output_layer(chunks)
    except ValueError as error:
        report["uninstall_error"] = str(error)
    return report


def test_foreign_hooks_on_the_output_layer_raise():
    (report,) = run_workers(foreign_hook_worker, 1)
    assert "before wrapping the model" in report["install_error"]
    assert "_forward_pre_hooks" in report["install_error"]
    assert report["untouched"]
    assert "_forward_hooks" in report["uninstall_error"]
