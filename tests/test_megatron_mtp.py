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
parameter's largest entry; bf16 with Float16Module: 1e-3 and 2e-2).
"""

from __future__ import annotations

import pytest
import torch

import test_megatron_common as common
from dist import run_workers
from test_megatron_common import MBS, SEQ, TRUE_VOCAB, Setup
from test_megatron_parity import DPO, GRAD_RTOL, GRAD_RTOL_BF16, GRPO, LOSS_RTOL, LOSS_RTOL_BF16

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

NUM_MICROBATCHES = 2


def megatron_lm_loss_func(loss_mask):
    """pretrain_gpt.py's loss_func on the per-token losses the model returns."""

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.float() * loss_mask)
        count = loss_mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return loss_func


class MainLogits:
    """Unfused reference for the package's loss funcs: GPTModel called with labels returns the main
    head's loss; the main head's logits are the output layer's last result of the call."""

    def __init__(self, gpt):
        self.last = None
        self.handle = gpt.output_layer.register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        # A copy: megatron's cross-entropy of fp32 logits overwrites them in place.
        self.last = output[0].clone()

    def take(self):
        logits, self.last = self.last, None
        return logits.transpose(0, 1).contiguous()  # [s, b, V/TP] -> [b, s, V/TP], as GPTModel

    def remove(self):
        self.handle.remove()


def model_call(kind, fused, capture):
    """forward(chunk, batch) for the loss kind and mode."""

    def forward(chunk, batch):
        kwargs = dict(labels=batch["labels"], loss_mask=batch["loss_mask"])
        if kind != "labels" and fused:
            kwargs["return_hidden_states"] = True
        out = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], **kwargs)
        if kind != "labels" and not fused and capture is not None:
            out = capture.take()  # last stage: the main logits instead of their loss
        return out

    return forward


def loss_func_maker(kind, post, forward_only):
    def make(chunk, batch, index):
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "labels":
            return megatron_lm_loss_func(mask)
        if kind == "sft":
            return sft_loss_func(post, chunk, labels, mask)
        noise = batch["noise"] * (mask != 0)
        if kind == "dpo":
            return dpo_loss_func(post, chunk, labels, mask, noise - 3.0, **DPO)
        lp = forward_only[index]
        return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], GRPO,
                              old_logprobs=lp + noise, reference_logprobs=lp - noise,
                              sampling_logprobs=lp + 0.5 * noise)

    return make


class Counter:
    """Calls of megatron's dense cross-entropy and of the original output layer (logits formed)."""

    def __init__(self, gpt):
        from megatron.core import tensor_parallel

        self.calls = {"vocab_parallel_cross_entropy": 0, "original_output_layer": 0}
        original_ce = tensor_parallel.vocab_parallel_cross_entropy
        layer = gpt.output_layer if getattr(gpt, "post_process", False) else None
        original_forward = type(layer).forward if layer is not None else None

        def counted_ce(*args, **kwargs):
            self.calls["vocab_parallel_cross_entropy"] += 1
            return original_ce(*args, **kwargs)

        def counted_forward(module, *args, **kwargs):
            if module is layer:
                self.calls["original_output_layer"] += 1
            return original_forward(module, *args, **kwargs)

        tensor_parallel.vocab_parallel_cross_entropy = counted_ce
        if layer is not None:
            type(layer).forward = counted_forward

        def restore():
            tensor_parallel.vocab_parallel_cross_entropy = original_ce
            if layer is not None:
                type(layer).forward = original_forward

        self.restore = restore

    def take(self):
        out, self.calls = self.calls, {k: 0 for k in self.calls}
        return out


def mtp_tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}


def logged_mtp_losses():
    """megatron's own MTP logging of the step (all-reduced over data-parallel ranks)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    logged = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0 / NUM_MICROBATCHES, 0, None, total_loss_dict=logged)
    return {k: float(v) for k, v in logged.items()}


def mtp_worker(rank, world, setup: Setup, kinds):
    chunks = common.build(setup)
    gpt = unwrap_model(chunks[-1])
    counter = Counter(gpt)
    try:
        return _mtp_runs(chunks, gpt, counter, setup, kinds)
    finally:
        counter.restore()  # (the NCCL suite runs this in its own process, not a forked worker)


def _mtp_runs(chunks, gpt, counter, setup: Setup, kinds):
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    fused_config = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    post = LogprobsPostProcessor(fused_config, vocab_size=TRUE_VOCAB)
    dp_rank = parallel_state.get_data_parallel_rank()
    last = parallel_state.is_pipeline_last_stage()
    report = {"last_stage": last}
    for kind in kinds:
        batches = common.make_batches("grpo" if kind == "labels" else kind, NUM_MICROBATCHES,
                                      seed=100 + dp_rank)
        runs = {}
        for mode in ("unfused", "fused"):
            fused = mode == "fused"
            if fused:
                install_fused_output_layer(chunks, fused_config)
            # switched on after building (Megatron's own layers would need its CUDA extension): the
            # fused output layer and MTP heads add dW straight into main_grad
            unwrap_model(chunks[0]).config.gradient_accumulation_fusion = setup.grad_acc_fusion and fused
            capture = MainLogits(gpt) if last and not fused and kind != "labels" else None
            forward = model_call(kind, fused, capture)
            MTPLossLoggingHelper.tracker.clear()
            forward_only = None
            if kind == "grpo":
                outs = compute_logprobs(chunks, batches, forward, post, seq_length=SEQ,
                                        micro_batch_size=MBS)
                forward_only = [out.logprobs for out in outs]
            metrics = common.run_step(chunks, batches, loss_func_maker(kind, post, forward_only),
                                      forward=forward)
            runs[mode] = {"metrics": metrics, "grads": common.grads(chunks), "tracker": mtp_tracker(),
                          "logged": logged_mtp_losses(), "calls": counter.take(),
                          "forward_only": forward_only}
            if capture is not None:
                capture.remove()
            if fused:
                uninstall_fused_output_layer(chunks)

        u, f = runs["unfused"], runs["fused"]
        loss_diff = max([common.max_rel_diff(mf[name], mu[name])
                         for mu, mf in zip(u["metrics"], f["metrics"]) for name in mu], default=0.0)
        if u["forward_only"] is not None:
            loss_diff = max([loss_diff] + [common.max_rel_diff(a, b) for a, b in
                                           zip(f["forward_only"], u["forward_only"])])
        report[kind] = {
            "num_metrics": len(u["metrics"]),
            "loss_diff": loss_diff,
            "grad_diff": {n: common.max_rel_diff(f["grads"][n], g) for n, g in u["grads"].items()},
            "same_keys": set(u["grads"]) == set(f["grads"]),
            "mtp_grad_norm": sum(g.double().norm().item() ** 2 for n, g in u["grads"].items()
                                 if ".mtp." in n) ** 0.5,
            "tracker": (u["tracker"], f["tracker"]),
            "logged": (u["logged"], f["logged"]),
            "calls": (u["calls"], f["calls"]),
        }
    return report


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


def check_mtp_reports(reports, setup: Setup, kinds, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL,
                      count_rtol=0.0):
    """The checks of one layout; returns the worst relative difference per kind. `count_rtol`:
    allowed relative difference of the argmax acceptance counts (bf16 logits can tie)."""
    assert any(r["last_stage"] for r in reports)
    worst = {}
    for report in reports:
        for kind in kinds:
            r = report[kind]
            assert r["same_keys"]
            bad = {n: d for n, d in r["grad_diff"].items() if d > grad_rtol}
            assert not bad, (kind, bad)
            (tracker_u, tracker_f), (logged_u, logged_f) = r["tracker"], r["logged"]
            assert tracker_u.keys() == tracker_f.keys() and logged_u.keys() == logged_f.keys()
            if not report["last_stage"]:
                assert not tracker_u
                continue
            # MTP ran, was logged under megatron's names, and has gradients.
            assert r["mtp_grad_norm"] > 0
            assert sorted(logged_u) == [f"mtp_{d + 1} loss" for d in range(setup.mtp_layers)]
            assert r["num_metrics"] == NUM_MICROBATCHES
            assert r["loss_diff"] <= loss_rtol, (kind, r["loss_diff"])
            for name, value in tracker_u.items():
                if "correct" in name or "total" in name:  # acceptance counts (>= 0.19): argmax
                    diff = (tracker_f[name] - value).abs().max().item()
                    assert diff <= count_rtol * value.abs().max().item(), (kind, name, tracker_f[name], value)
                else:
                    assert common.max_rel_diff(tracker_f[name], value) <= loss_rtol, (kind, name)
            for name, value in logged_u.items():
                assert logged_f[name] == pytest.approx(value, rel=loss_rtol), (kind, name)
            # No logits: neither the original output layer nor megatron's cross-entropy ran fused.
            calls_u, calls_f = r["calls"]
            assert calls_u["original_output_layer"] > 0 and calls_u["vocab_parallel_cross_entropy"] > 0
            assert calls_f == {"original_output_layer": 0, "vocab_parallel_cross_entropy": 0}, calls_f
            worst[kind] = max(worst.get(kind, 0.0), r["loss_diff"], max(r["grad_diff"].values()))
    return worst


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
