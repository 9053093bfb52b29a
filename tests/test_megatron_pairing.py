"""A GPTModel with the fused output layer under Megatron's schedules, with gradient-accumulation
fusion (the fused losses add the output weight's gradient into DDP's main_grad during the forward),
where forward and backward do not pair one to one (CPU, gloo, TP=2 with sequence parallelism).

Compared with the same step run plainly (whose gradients test_megatron_parity.py and
test_megatron_mtp.py tie to the unfused model), every parameter's main_grad after
`finalize_model_grads`:
- the loss func under torch.utils.checkpoint (non-reentrant: its forward runs again in backward);
- the loss func under Megatron's own recompute, `tensor_parallel.checkpoint` (reentrant);
- a forward-only pass under grad mode (an evaluation without torch.no_grad()) between steps:
  harmless, since the next step zeroes the gradient buffer; inside a step (after the buffer was
  zeroed) the next fused call raises on every rank instead of training on a wrong gradient;
- an optimizer step while a fused forward is alive without its backward (an evaluation loss held
  past the step, a micro-batch loss kept in a list): it raises before any update, under DDP with
  and without grad-reduce overlap, DDP for the distributed optimizer with and without overlap,
  and 1F1B / interleaved pipelining; the recomputed loss func and the plain one step alike;
- MTP (the fused per-depth losses of `model(..., labels=)` and the package's SFT loss func) with
  the whole model call under a non-reentrant checkpoint, and after a dropped forward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import megatron_harness as common
from dist import run_workers
from megatron_harness import MBS, SEQ, TRUE_VOCAB, Setup
from megatron_workers import (
    check_held_forward_reports,
    held_forward_worker,
    megatron_recomputed,
    mtp_loss_func_maker,
    mtp_model_call,
)

from megatron_fused_ce.losses import GRPOConfig
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    grpo_loss_func,
    install_fused_output_layer,
    sft_loss_func,
    unwrap_model,
)

GRAD_RTOL = 1e-5  # the same fp32 computation, only paired differently
GRPO = GRPOConfig(loss_type="dapo", beta=0.05)
NUM_MICROBATCHES = 2


def _loss_func_maker(kind, post):
    def make(chunk, batch, index):
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "sft":
            return sft_loss_func(post, chunk, labels, mask)
        old = -1.0 + batch["noise"]  # off-policy: the ratio depends on the log-probs
        return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], GRPO, old_logprobs=old,
                              reference_logprobs=old - 0.1)
    return make


def _torch_checkpointed(make):
    def checkpointed(chunk, batch, index):
        loss_func = make(chunk, batch, index)
        return lambda output: checkpoint(loss_func, output, use_reentrant=False)
    return checkpointed


def _forward_backward(chunks, batches, make_loss_func, forward_only, forward=common.forward_fn):
    """get_forward_backward_func without zeroing the gradient buffer first (common.run_step does)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        index, batch = next(data_iterator)
        return forward(chunk, batch), make_loss_func(chunk, batch, index)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(list(enumerate(batches))), model=chunks,
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only)


def _grad_diff(grads, reference):
    return max(common.max_rel_diff(grads[name], ref) for name, ref in reference.items())


def _fused_model(setup: Setup):
    """The DDP-wrapped GPTModel with the fused output layer adding dW into main_grad, and its
    post-processor."""
    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    install_fused_output_layer(chunks, fused)
    unwrap_model(chunks[0]).config.gradient_accumulation_fusion = True
    return chunks, LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)


def pairing_worker(rank, world, setup: Setup, kind):
    chunks, post = _fused_model(setup)
    batches = common.make_batches(kind, NUM_MICROBATCHES, seed=100)
    make = _loss_func_maker(kind, post)
    report = {}

    common.run_step(chunks, batches, make)
    plain = common.grads(chunks)
    report["plain_norm"] = sum(g.norm() ** 2 for g in plain.values()).item() ** 0.5
    common.run_step(chunks, batches, _torch_checkpointed(make))
    report["torch_checkpoint"] = _grad_diff(common.grads(chunks), plain)
    common.run_step(chunks, batches, megatron_recomputed(make))
    report["megatron_recompute"] = _grad_diff(common.grads(chunks), plain)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _forward_backward(chunks, batches, make, forward_only=True)  # evaluation between steps
    common.run_step(chunks, batches, make)  # zeroes the buffer first, as every step does
    report["dropped_between_steps"] = _grad_diff(common.grads(chunks), plain)

    for chunk in chunks:
        chunk.zero_grad_buffer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _forward_backward(chunks, batches, make, forward_only=True)  # inside the step
    report["warned"] = any("never backpropagated" in str(c.message) for c in caught)
    try:
        _forward_backward(chunks, batches, make, forward_only=False)
        report["raised"] = None
    except ValueError as error:
        report["raised"] = str(error)
    return report


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_megatron_schedules_with_unpaired_forwards(kind):
    """Before: the non-reentrant checkpoint doubled the output weight's gradient, and a forward-only
    pass inside a step added its gradient to the step's without a word."""
    setup = Setup(tp=2, sp=True, grad_acc_fusion=True)
    for report in run_workers(pairing_worker, setup.world, setup, kind, timeout=180):
        assert report["plain_norm"] > 0
        for name in ("torch_checkpoint", "megatron_recompute", "dropped_between_steps"):
            assert report[name] < GRAD_RTOL, (name, report[name])
        assert report["warned"]
        assert report["raised"] is not None and "never backpropagated" in report["raised"]


def mtp_pairing_worker(rank, world, setup: Setup, kind):
    chunks, post = _fused_model(setup)
    batches = common.make_batches("grpo" if kind == "labels" else kind, NUM_MICROBATCHES, seed=100)
    make = mtp_loss_func_maker(kind, post, None)
    forward = mtp_model_call(kind, True, None)
    report = {}

    common.run_step(chunks, batches, make, forward=forward)
    plain = common.grads(chunks)
    report["plain_norm"] = sum(g.norm() ** 2 for g in plain.values()).item() ** 0.5

    def checkpointed_forward(chunk, batch):
        return checkpoint(forward, chunk, batch, use_reentrant=False)

    common.run_step(chunks, batches, make, forward=checkpointed_forward)
    report["torch_checkpoint"] = _grad_diff(common.grads(chunks), plain)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _forward_backward(chunks, batches, make, forward_only=True, forward=forward)
    try:
        common.run_step(chunks, batches, make, forward=forward)
        report["dropped_then_step"] = _grad_diff(common.grads(chunks), plain)
    except ValueError as error:
        report["dropped_then_step"] = str(error)
    return report


@pytest.mark.parametrize("kind", ["labels", "sft"])
def test_mtp_with_unpaired_forwards(kind):
    """MTP depths (fused per-token losses of model(..., labels=)) and the main head: the model call
    under a non-reentrant checkpoint, and a dropped forward before a step, give the plain step's
    gradients."""
    setup = Setup(tp=2, sp=True, grad_acc_fusion=True, mtp_layers=1)
    for report in run_workers(mtp_pairing_worker, setup.world, setup, kind, timeout=180):
        assert report["plain_norm"] > 0
        assert report["torch_checkpoint"] < GRAD_RTOL, report["torch_checkpoint"]
        assert report["dropped_then_step"] < GRAD_RTOL, report["dropped_then_step"]


HELD_FORWARD_SETUPS = [
    Setup(tp=2, sp=True, grad_acc_fusion=True),
    Setup(dp=2, grad_acc_fusion=True, overlap_grad_reduce=True),
    Setup(dp=2, grad_acc_fusion=True, distributed_optimizer=True),
    Setup(dp=2, grad_acc_fusion=True, overlap=True),
    Setup(pp=2, grad_acc_fusion=True),
    Setup(pp=2, vp=2, layers=4, grad_acc_fusion=True),
]


@pytest.mark.parametrize("setup", HELD_FORWARD_SETUPS, ids=str)
def test_optimizer_step_with_a_fused_forward_alive_raises(setup):
    """Before: the eval pass's (or the stored micro-batch's) dW stayed in main_grad and the step
    trained on it, no NaN, no error (the NaN came only when the graph was freed, after the step).
    Megatron's optimizers allocate CUDA tensors: on CPU a stand-in with their step order (main_grad
    into the fp32 main params, a torch optimizer steps); tests/test_multigpu.py runs megatron's own."""
    check_held_forward_reports(run_workers(held_forward_worker, setup.world, setup, "stand_in", timeout=240))
