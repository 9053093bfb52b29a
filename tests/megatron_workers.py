"""Megatron workers shared by several test files and by the NCCL suites (tests/test_multigpu.py),
with the checks of their reports: fused vs unfused training steps (tests/test_megatron_parity.py),
multi-token prediction (tests/test_megatron_mtp.py), and DDP's param-gather overlap and megatron's
distributed optimizer (tests/test_megatron_ddp_overlap.py).

The workers call the harness through its module (`common.make_batches`, ...): the NCCL suites
replace `megatron_harness.make_batches` to put the batches on the GPU.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import megatron_harness as common
from megatron_harness import (
    DPO,
    GRAD_RTOL,
    GRPO,
    LOSS_RTOL,
    MBS,
    SEQ,
    TRUE_VOCAB,
    Setup,
    megatron_lm_loss_func,
)

from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    compute_logprobs,
    dpo_loss_func,
    grpo_loss_func,
    install_fused_output_layer,
    output_weight,
    sft_loss_func,
    uninstall_fused_output_layer,
    unwrap_model,
)

NUM_MICROBATCHES = 2


# ------------------------------------------------------------------------------------------------
# Fused vs unfused training steps: SFT, DPO, GRPO (tests/test_megatron_parity.py)
# ------------------------------------------------------------------------------------------------
def parity_loss_func_maker(kind, post, batches, forward_only):
    """Build the loss func of micro-batch `index` for the given loss kind."""

    def make(chunk, batch, index):
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "sft":
            return sft_loss_func(post, chunk, labels, mask)
        lp = forward_only[index]
        noise = batch["noise"] * (mask != 0)
        if kind == "dpo":
            return dpo_loss_func(post, chunk, labels, mask, lp + noise, **DPO)
        return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], GRPO,  # grpo*
                              old_logprobs=lp + noise, reference_logprobs=lp - noise,
                              sampling_logprobs=lp + 0.5 * noise)

    return make


def count_calls(module, names):
    """Wrap module-level functions of `module` with call counters (in a forked worker only)."""
    calls = {name: 0 for name in names}
    for name in names:
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)
    return calls


def parity_worker(rank, world, setup: Setup, kinds):
    from megatron.core import parallel_state

    from megatron_fused_ce.megatron import loss_funcs

    calls = count_calls(loss_funcs, ["linear_cross_entropy", "linear_grpo_loss"])
    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    dp_rank = parallel_state.get_data_parallel_rank()
    last = parallel_state.is_pipeline_last_stage()
    report = {"last_stage": last, "dp_rank": dp_rank}
    for kind in kinds:
        # With entropy requested, GRPO takes the log-probs path instead of gradients-in-forward.
        post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB,
                                     return_entropy=kind == "grpo_entropy")
        batches = common.make_batches(kind.split("_")[0], NUM_MICROBATCHES, seed=100 + dp_rank)
        before = dict(calls)
        runs = {}
        for mode in ("unfused", "fused"):
            if mode == "fused":
                install_fused_output_layer(chunks, fused)
            else:
                uninstall_fused_output_layer(chunks)
            # Megatron's layers read gradient_accumulation_fusion when they are built (it needs a
            # CUDA extension); switched on now, only the post-processor sees it and has the op add
            # the weight gradient straight into DDP's main_grad.
            config = unwrap_model(chunks[0]).config
            config.gradient_accumulation_fusion = setup.grad_acc_fusion and mode == "fused"
            forward_only = None
            if kind != "sft":
                outs = compute_logprobs(chunks, batches, common.forward_fn, post,
                                        seq_length=SEQ, micro_batch_size=MBS)
                forward_only = [out.logprobs for out in outs]
            metrics = common.run_step(chunks, batches,
                                      parity_loss_func_maker(kind, post, batches, forward_only))
            runs[mode] = {"metrics": metrics, "grads": common.grads(chunks),
                          "forward_only": forward_only}
            if mode == "fused" and last:
                weight = output_weight(chunks[-1])
                report["grad_added_to_main_grad"] = bool(weight.grad_added_to_main_grad)
        uninstall_fused_output_layer(chunks)

        u, f = runs["unfused"], runs["fused"]
        loss_diff = 0.0
        for mu, mf in zip(u["metrics"], f["metrics"]):
            for name in mu:
                loss_diff = max(loss_diff, common.max_rel_diff(mf[name], mu[name]))
        grad_diff = {name: common.max_rel_diff(f["grads"][name], g) for name, g in u["grads"].items()}
        grad_norm = sum(g.double().norm().item() ** 2 for g in u["grads"].values()) ** 0.5
        lp_diff = 0.0
        if u["forward_only"] is not None:
            lp_diff = max(common.max_rel_diff(a, b) for a, b in zip(f["forward_only"], u["forward_only"]))
        report[kind] = {
            "gradients_in_forward_calls": {k: calls[k] - before[k] for k in calls},
            "num_metrics": len(u["metrics"]),
            "loss_diff": loss_diff,
            "grad_diff": grad_diff,
            "grad_norm": grad_norm,
            "same_keys": set(u["grads"]) == set(f["grads"]),
            "forward_only_diff": lp_diff,
            "forward_only": u["forward_only"],
        }
    return report


# ------------------------------------------------------------------------------------------------
# Multi-token prediction (tests/test_megatron_mtp.py)
# ------------------------------------------------------------------------------------------------
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


def mtp_model_call(kind, fused, capture):
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


def mtp_loss_func_maker(kind, post, forward_only):
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
            forward = mtp_model_call(kind, fused, capture)
            MTPLossLoggingHelper.tracker.clear()
            forward_only = None
            if kind == "grpo":
                outs = compute_logprobs(chunks, batches, forward, post, seq_length=SEQ,
                                        micro_batch_size=MBS)
                forward_only = [out.logprobs for out in outs]
            metrics = common.run_step(chunks, batches, mtp_loss_func_maker(kind, post, forward_only),
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


# ------------------------------------------------------------------------------------------------
# DDP's param-gather overlap and megatron's distributed optimizer (tests/test_megatron_ddp_overlap.py)
# ------------------------------------------------------------------------------------------------
FUSED = FusedCEConfig(enabled=True, chunk_size=8)
FUSED_OPS = {"lazy_logits": ["linear_cross_entropy"],
             "loss_funcs": ["linear_cross_entropy", "linear_grpo_loss"],
             "postprocess": ["linear_logprobs"]}


class ParamGatherRecorder:
    """Which bucket groups' `finish_param_sync` (DDP's wait for a param all-gather) ran this step,
    and, at every fused-op call, whether the output weight's had."""

    def __init__(self, ddp, weight):
        from megatron_fused_ce.megatron import lazy_logits, loss_funcs, postprocess

        self.finished, self.reads, self.originals = set(), [], []
        if weight is None:  # not the last pipeline stage: no fused op here
            return
        self.weight_group = ddp.param_to_bucket_group[weight]
        for group in ddp.bucket_groups:
            original = group.finish_param_sync

            def finish(*args, _group=group, _original=original, **kwargs):
                self.finished.add(id(_group))
                return _original(*args, **kwargs)

            group.finish_param_sync = finish
        modules = {"lazy_logits": lazy_logits, "loss_funcs": loss_funcs, "postprocess": postprocess}
        for module_name, names in FUSED_OPS.items():
            module = modules[module_name]
            for name in names:
                original = getattr(module, name)
                self.originals.append((module, name, original))

                def checked(*args, _original=original, **kwargs):
                    self.reads.append(id(self.weight_group) in self.finished)
                    return _original(*args, **kwargs)

                setattr(module, name, checked)

    def restore(self):
        for module, name, original in self.originals:
            setattr(module, name, original)

    def new_step(self):
        self.finished.clear()
        reads, self.reads = self.reads, []
        return reads


def grad_buffers(ddp):
    return [buffer.grad_data.clone() for buffer in ddp.buffers]


def megatron_lm_forward(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                 labels=batch["labels"], loss_mask=batch["loss_mask"])


def megatron_lm_make_loss(chunk, batch, index):
    """Megatron-LM's loss_func of one micro-batch (run_step's make_loss_func)."""
    mask = batch["loss_mask"]

    def loss_func(output):
        loss = torch.sum(output.float() * mask)
        return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}

    return loss_func


def distributed_optimizer_worker(rank, world, setup: Setup, order: Optional[str], steps: int = 3):
    """`steps` SGD steps of megatron's DistributedOptimizer (overlap_param_gather +
    overlap_grad_reduce) on a model called Megatron-LM style; `order`: None = unfused, "before" /
    "after" = fused layer installed before / after the DDP wrap. Returns the per-step losses, whether
    every fused read of the output weight came after its all-gather, and the final parameters."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = common.build(setup, install_before_wrap=FUSED if order == "before" else None)
    (ddp,) = chunks
    if order == "after":
        install_fused_output_layer(chunks, FUSED)
    config = unwrap_model(ddp).config
    config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        # Adam: megatron >= 0.19's distributed optimizer takes Adam only. eps=1 keeps its step
        # ~lr*g (like SGD), so tiny gradient differences stay tiny in the parameters.
        OptimizerConfig(optimizer="adam", lr=0.1, adam_eps=1.0, weight_decay=0.0, bf16=setup.bf16,
                        params_dtype=torch.bfloat16 if setup.bf16 else torch.float32,
                        use_distributed_optimizer=True), chunks)
    gather = ParamGatherRecorder(ddp, output_weight(ddp))
    losses, reads = [], []
    try:
        for step in range(steps):
            batches = common.make_batches("sft", 2, seed=1000 * step + parallel_state.get_data_parallel_rank())
            optimizer.zero_grad()
            metrics = common.run_step(chunks, batches, megatron_lm_make_loss, forward=megatron_lm_forward)
            update_ok, _, _ = optimizer.step()
            assert update_ok
            reads += gather.new_step()
            losses.append([m["lm loss"].detach().cpu() for m in metrics])
    finally:
        gather.restore()
    ddp.disable_forward_pre_hook()  # as Megatron-LM before evaluation: all-gathers every param
    params = {name: p.detach().float().cpu() for name, p in ddp.named_parameters()}
    ddp.enable_forward_pre_hook()
    return {"losses": losses, "reads": reads, "params": params,
            "last_stage": parallel_state.is_pipeline_last_stage()}


def check_distributed_optimizer(unfused, fused, loss_rtol, param_rtol):
    """Per rank: the fused run read the weight only after its all-gather, and its losses and
    parameters after the steps match the unfused run."""
    for u, f in zip(unfused, fused):
        if f["last_stage"]:
            assert f["reads"] and all(f["reads"]), f["reads"]
        for step_u, step_f in zip(u["losses"], f["losses"]):
            for a, b in zip(step_f, step_u):
                assert common.max_rel_diff(a, b) <= loss_rtol, (a, b)
        bad = {n: common.max_rel_diff(f["params"][n], p) for n, p in u["params"].items()}
        bad = {n: d for n, d in bad.items() if d > param_rtol}
        assert not bad, bad


# ------------------------------------------------------------------------------------------------
# An optimizer step while a fused forward is still alive without its backward
# (tests/test_megatron_pairing.py on CPU with a stand-in optimizer; tests/test_multigpu.py with
# megatron's optimizers)
# ------------------------------------------------------------------------------------------------
class MainGradOptimizerStandIn:
    """Megatron's optimizer step where its classes cannot run (they allocate CUDA tensors): the
    fp32 main parameters take each parameter's main_grad as their gradient, a torch optimizer steps
    them (its step pre-hooks run there, as under megatron's optimizers), the model parameters are
    copied back. The order of FP32Optimizer / Float16OptimizerWithFloat16Params.step."""

    def __init__(self, chunks, lr: float):
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.main = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.SGD(self.main, lr=lr)

    def zero_grad(self):
        for main in self.main:
            main.grad = None

    @torch.no_grad()
    def step(self):
        for param, main in zip(self.params, self.main):
            main.grad = param.main_grad.float().clone()
        self.optimizer.step()
        for param, main in zip(self.params, self.main):
            param.copy_(main)
        return True, None, None


def main_grad_optimizer(chunks, setup: Setup, kind: str):
    if kind == "stand_in":
        return MainGradOptimizerStandIn(chunks, lr=0.1)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=0.1, adam_eps=1.0, weight_decay=0.0,
        use_distributed_optimizer=setup.distributed_optimizer or setup.overlap), chunks)


def megatron_recomputed(make):
    """A loss func run under megatron's reentrant recompute (tensor_parallel.checkpoint), which takes
    and returns tensors only: its forward runs under no_grad, then again during backward."""
    from megatron.core import tensor_parallel

    def recomputed(chunk, batch, index):
        loss_func = make(chunk, batch, index)
        names = []

        def flat(output):
            loss, count, metrics = loss_func(output)
            names[:] = list(metrics)
            return (loss, count.float(), *metrics.values())

        def run(output):
            loss, count, *values = tensor_parallel.checkpoint(flat, False, output)
            return loss, count.to(torch.int), dict(zip(names, (v.detach() for v in values)))
        return run
    return recomputed


def held_forward_worker(rank, world, setup: Setup, optimizer_kind: str):
    """Megatron's schedules on a fused GPTModel with gradient-accumulation fusion (the SFT loss func
    adds dW into main_grad during the forward), then an optimizer step, per scenario:

    - "plain", "recomputed" (the loss func under megatron's recompute): the step runs, and both
      leave the same main_grad;
    - "evaluation_held": a forward-only pass under grad mode whose losses are kept (for logging)
      past the step; "loss_list" (no pipelining): a micro-batch's loss stored in a list without a
      backward. The step must raise on the ranks that hold the output layer, before updating
      anything; after the buffer is zeroed, the next step runs.
    Returns what each scenario did on this rank."""
    from megatron.core import parallel_state

    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    install_fused_output_layer(chunks, fused)
    for chunk in chunks:
        unwrap_model(chunk).config.gradient_accumulation_fusion = True
    post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
    optimizer = main_grad_optimizer(chunks, setup, optimizer_kind)
    batches = common.make_batches("sft", NUM_MICROBATCHES, seed=300 + parallel_state.get_data_parallel_rank())

    def make(chunk, batch, index):
        return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"])

    def params():
        return [p.detach().float().clone() for chunk in chunks for p in chunk.parameters()]

    def step():
        optimizer.step()  # megatron's returns (ok, grad norm, zeros); the stand-in the same
        return "stepped"

    report = {"last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True)}
    common.run_step(chunks, batches, make)
    plain = common.grads(chunks)
    common.run_step(chunks, batches, megatron_recomputed(make))
    report["recomputed_diff"] = max(common.max_rel_diff(g, plain[n]) for n, g in common.grads(chunks).items())
    report["recomputed_step"] = step()

    scenarios = ["evaluation_held"] + (["loss_list"] if setup.pp == 1 else [])
    for scenario in scenarios:
        kept = []
        common.run_step(chunks, batches, make)
        if scenario == "evaluation_held":
            def keeping(chunk, batch, index):
                loss_func = make(chunk, batch, index)

                def run(output):
                    result = loss_func(output)
                    kept.append(result[0])
                    return result
                return run
            _forward_only_without_zeroing(chunks, batches, keeping)
        else:
            chunk, batch = chunks[0], batches[0]
            kept.append(make(chunk, batch, 0)(common.forward_fn(chunk, batch))[0])
        before = params()
        try:
            report[scenario] = step()
        except RuntimeError as error:
            report[scenario] = str(error)
        report[f"{scenario}_unchanged"] = all(torch.equal(a, b) for a, b in zip(params(), before))
        kept.clear()  # the graphs go (main_grad was poisoned once, by the step check)
        common.run_step(chunks, batches, make)  # zeroes the buffer first
        report[f"{scenario}_finite_after"] = all(torch.isfinite(g).all().item() for g in common.grads(chunks).values())
        report[f"{scenario}_next_step"] = step()
    return report


def _forward_only_without_zeroing(chunks, batches, make_loss_func):
    """A forward-only schedule pass (an evaluation) under grad mode, inside a step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        index, batch = next(data_iterator)
        return common.forward_fn(chunk, batch), make_loss_func(chunk, batch, index)

    iterators = [iter(list(enumerate(batches))) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS, forward_only=True)


def check_held_forward_reports(reports) -> None:
    """Every rank: plain and recomputed steps agree and step; on the ranks with the output layer a
    step with a forward still alive raises before any update; the next step after zeroing runs."""
    for rank, report in enumerate(reports):
        assert report["recomputed_diff"] < GRAD_RTOL, (rank, report["recomputed_diff"])
        assert report["recomputed_step"] == "stepped", (rank, report["recomputed_step"])
        for scenario in ("evaluation_held", "loss_list"):
            if scenario not in report:
                continue
            if report["last_stage"]:
                assert "graph alive without a backward" in report[scenario], (rank, scenario, report[scenario])
                assert report[f"{scenario}_unchanged"], (rank, scenario)
            assert report[f"{scenario}_finite_after"], (rank, scenario)
            assert report[f"{scenario}_next_step"] == "stepped", (rank, scenario)
