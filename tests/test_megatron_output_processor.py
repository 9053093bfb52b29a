"""megatron-core's `output_processor` hook (>= 0.18) with `FusedOutputProcessor`, nothing installed,
against the installed fused layer and the unfused model (CPU, gloo, megatron's local spec).

The same model, data and loss run through every route of one layout:
* "unfused": GPTModel as is (logits, megatron's cross-entropy);
* "installed": `install_fused_output_layer`;
* "processor": nothing installed, `model(..., output_processor=FusedOutputProcessor(...))`;
* "both" (MTP): installed, and the processor passed as well.
Loss kinds: this package's loss funcs ("sft", "dpo", "grpo", "grpo_entropy"; the processor route
passes the processor itself as their post-processor, and to `compute_logprobs` for the reference /
old log-probs), Megatron-LM's `model(..., labels=labels)` per-token loss ("labels"; the processor
with `returns="loss"` chosen per call through `output_processor_context`), and a caller's own
loss on log-probs with entropy, sampler settings and top-k log-probs ("logprobs"; the processor
with `returns="logprobs"`, the other routes through `LogprobsPostProcessor`). Compared: every
micro-batch's metrics, the forward-only log-probs, every parameter's gradient after DDP +
`finalize_model_grads`; and that the processor route forms no logits (megatron's output layer
never runs; with MTP and nothing installed only the MTP depths run it, which is what the hook
allows), takes the gradients-in-forward losses where the installed layer does, and adds the
weight gradient into `main_grad` under gradient-accumulation fusion.

Tolerances: those of test_megatron_parity.py (fp32: losses 1e-5 relative, gradients 1e-4 of each
parameter's largest entry; bf16 with Float16Module: 1e-3 and 2e-2).

A MuP model runs the same comparison: GPTModel multiplies its logits by `mup_output_mult` after the
output layer, the processor folds that into the fused math. What it cannot fold (a model's own
`_scale_logits`, a caller's `scale_logits`) or does not know (a keyword with a value) is checked
to raise, naming it.

On megatron-core without the hook (0.16) the route tests skip, and constructing the processor is
checked to raise the error naming the version.
"""

from __future__ import annotations

import functools

import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import (
    DPO,
    GRAD_RTOL,
    GRAD_RTOL_BF16,
    GRPO,
    LOSS_RTOL,
    LOSS_RTOL_BF16,
    MBS,
    SEQ,
    TRUE_VOCAB,
    Setup,
)

from megatron_fused_ce.losses import nll_loss
from megatron_fused_ce.megatron import (
    FusedCEConfig,
    FusedOutputProcessor,
    HiddenStates,
    LogprobsPostProcessor,
    compat,
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
SAMPLER = dict(top_k=40, top_p=0.95, return_topk=3)  # the "logprobs" kind's sampler settings

HAS_HOOK = compat.has_output_processor()
needs_hook = pytest.mark.skipif(
    not HAS_HOOK, reason=f"megatron-core {compat.megatron_core_version_string()} has no "
                         f"GPTModel output_processor (>= 0.18)")


def test_processor_needs_the_hook():
    """Without the hook the processor cannot be built, and says which megatron-core it needs;
    with it, it can."""
    fused = FusedCEConfig(enabled=True)
    if HAS_HOOK:
        assert FusedOutputProcessor(fused).returns == "hidden_states"
        return
    with pytest.raises(RuntimeError) as error:
        FusedOutputProcessor(fused)
    message = str(error.value)
    assert "megatron-core >= 0.18" in message and compat.megatron_core_version_string() in message
    assert "install_fused_output_layer" in message


# ------------------------------------------------------------------------------------------------
# Route parity
# ------------------------------------------------------------------------------------------------
def _count_calls(module, names, calls):
    """Wrap module-level functions of `module` with call counters (in a forked worker only)."""
    for name in names:
        original = getattr(module, name)

        def counted(*args, _name=f"{module.__name__.rsplit('.', 1)[-1]}.{name}", _original=original,
                    **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)


def _settings(kind):
    """The log-prob settings of a kind, for LogprobsPostProcessor and FusedOutputProcessor."""
    settings = dict(vocab_size=TRUE_VOCAB)
    if kind == "grpo_entropy":
        settings["return_entropy"] = True
    if kind == "logprobs":
        settings.update(return_entropy=True, **SAMPLER)
    return settings


def _forward(kind, route, proc, mtp):
    """forward(chunk, batch) of a route."""

    def forward(chunk, batch):
        args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
        kwargs = {}
        if route in ("processor", "both"):
            if kind in ("labels", "logprobs") or mtp:  # the processor's labels; MTP's labels
                kwargs = dict(labels=batch["labels"], loss_mask=batch["loss_mask"])
            kwargs["output_processor"] = proc
            if kind == "labels":  # one processor, the call picks what it returns
                kwargs["output_processor_context"] = {"returns": "loss"}
            return chunk(*args, **kwargs)
        if kind == "labels" or mtp:
            kwargs = dict(labels=batch["labels"], loss_mask=batch["loss_mask"])
        if mtp and kind != "labels" and route == "installed":
            kwargs["return_hidden_states"] = True
        out = chunk(*args, **kwargs)
        # unfused MTP model called with labels: megatron returns the main loss, the loss funcs
        # take the main head's logits (captured on the last stage)
        capture = unwrap_model(chunk).__dict__.get("_main_logits")
        return capture.take() if capture is not None else out

    return forward


def _logprobs_loss_func(post, chunk, batch, from_model):
    """A caller's own loss on log-probs (NLL minus an entropy bonus), with the top-k log-probs as
    metrics: on the model's `LogprobsOutput` (processor) or the post-processor's."""
    mask = batch["loss_mask"]

    def loss_func(output):
        out = output if from_model else post(output, chunk, batch["labels"])
        loss, metrics = nll_loss(out.logprobs, mask, normalizer=1)
        loss = loss - 0.01 * (out.entropy * mask).sum()
        count = (mask != 0).sum().to(torch.int)
        one = torch.ones(())
        return loss, count, {"loss": torch.stack([loss.detach(), count.float()]),
                             "excluded": torch.stack([metrics["num_excluded_tokens"].float(), one]),
                             "topk_logprobs": torch.stack([out.topk_logprobs.sum().detach(), one]),
                             "topk_ids": torch.stack([out.topk_ids.sum().float(), one])}

    return loss_func


def _loss_func_maker(kind, post, forward_only, setup: Setup, from_model):
    num_mb = None if setup.per_token_loss else NUM_MICROBATCHES  # the upstream gradient is then known

    def make(chunk, batch, index):
        labels, mask = batch["labels"], batch["loss_mask"]
        if kind == "labels":
            from megatron_harness import megatron_lm_loss_func

            return megatron_lm_loss_func(mask)
        if kind == "logprobs":
            return _logprobs_loss_func(post, chunk, batch, from_model)
        if kind == "sft":
            return sft_loss_func(post, chunk, labels, mask, num_microbatches=num_mb)
        lp = forward_only[index]
        noise = batch["noise"] * (mask != 0)
        if kind == "dpo":
            return dpo_loss_func(post, chunk, labels, mask, lp + noise, **DPO)
        return grpo_loss_func(post, chunk, labels, mask, batch["advantages"], GRPO,
                              old_logprobs=lp + noise, reference_logprobs=lp - noise,
                              sampling_logprobs=lp + 0.5 * noise, num_microbatches=num_mb)

    return make


def route_worker(rank, world, setup: Setup, kinds, routes, mup_output_mult=None):
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_fused_ce.megatron import lazy_logits, loss_funcs, output_layer, postprocess
    from megatron_workers import Counter, MainLogits, logged_mtp_losses

    calls = {}
    _count_calls(loss_funcs, ["linear_cross_entropy", "linear_grpo_loss"], calls)
    _count_calls(output_layer, ["linear_cross_entropy"], calls)
    _count_calls(lazy_logits, ["linear_cross_entropy"], calls)
    _count_calls(postprocess, ["linear_logprobs"], calls)
    chunks = common.build(setup)
    gpt = unwrap_model(chunks[-1])
    if mup_output_mult is not None:
        # MuP as GPTModel's forward sees it: logits (main head and MTP depths) times the
        # multiplier (MuP's initialisation does not matter to the comparison)
        config = unwrap_model(chunks[0]).config
        config.use_mup, config.mup_output_mult = True, mup_output_mult
    counter = Counter(gpt)
    fused = FusedCEConfig(enabled=True, chunk_size=setup.chunk_size)
    dp_rank = parallel_state.get_data_parallel_rank()
    last = parallel_state.is_pipeline_last_stage()
    mtp = bool(setup.mtp_layers)
    report = {"last_stage": last}
    for kind in kinds:
        batches = common.make_batches("sft" if kind in ("labels", "logprobs") else kind.split("_")[0],
                                      NUM_MICROBATCHES, seed=100 + dp_rank)
        report[kind] = {}
        for route in routes:
            if route in ("installed", "both"):
                install_fused_output_layer(chunks, fused)
            else:
                uninstall_fused_output_layer(chunks)
            # Megatron's own layers read gradient_accumulation_fusion when built (it needs a CUDA
            # extension); switched on now, only the fused ops see it and add dW into main_grad.
            unwrap_model(chunks[0]).config.gradient_accumulation_fusion = \
                setup.grad_acc_fusion and route != "unfused"
            with_proc = route in ("processor", "both")
            if with_proc:
                post = FusedOutputProcessor(fused, returns="logprobs" if kind == "logprobs" else
                                            "hidden_states", **_settings(kind))
            else:
                post = LogprobsPostProcessor(fused, **_settings(kind))
            capture = None
            if last and mtp and route == "unfused" and kind != "labels":
                capture = MainLogits(gpt)
                if mup_output_mult is not None:  # the layer's output, which GPTModel then scales
                    capture.take = functools.partial(_scaled, gpt, capture.take)
                gpt.__dict__["_main_logits"] = capture
            forward = _forward(kind, route, post, mtp)
            MTPLossLoggingHelper.tracker.clear()
            counter.take()
            for key in calls:
                calls[key] = 0
            forward_only = None
            if kind in ("dpo", "grpo", "grpo_entropy"):
                outs = compute_logprobs(chunks, batches, forward, post, seq_length=SEQ,
                                        micro_batch_size=MBS)
                forward_only = [out.logprobs for out in outs]
            metrics = common.run_step(chunks, batches,
                                      _loss_func_maker(kind, post, forward_only, setup, with_proc),
                                      forward=forward)
            run = {"metrics": metrics, "grads": common.grads(chunks), "forward_only": forward_only,
                   "calls": dict(calls), "layer_calls": counter.take(),
                   "mtp_logged": logged_mtp_losses() if mtp else {}}
            if last:
                weight = output_weight(chunks[-1])
                run["grad_added_to_main_grad"] = bool(getattr(weight, "grad_added_to_main_grad", False))
            if capture is not None:
                capture.remove()
                del gpt.__dict__["_main_logits"]
            report[kind][route] = run
    uninstall_fused_output_layer(chunks)
    counter.restore()
    return report


def _scaled(gpt, take):
    return gpt._scale_logits(take())


def _diffs(a, b):
    """Largest relative differences of run `a` against run `b`: metrics (with forward-only
    log-probs) and per-parameter gradients."""
    loss = 0.0
    for ma, mb in zip(a["metrics"], b["metrics"]):
        for name in mb:
            loss = max(loss, common.max_rel_diff(ma[name], mb[name]))
    if b["forward_only"] is not None:
        loss = max([loss] + [common.max_rel_diff(x, y) for x, y in zip(a["forward_only"], b["forward_only"])])
    for name, value in b["mtp_logged"].items():
        loss = max(loss, abs(a["mtp_logged"][name] - value) / max(abs(value), 1e-30))
    assert a["grads"].keys() == b["grads"].keys()
    grads = {name: common.max_rel_diff(a["grads"][name], g) for name, g in b["grads"].items()}
    return loss, grads


def check_routes(reports, setup: Setup, kinds, routes):
    loss_rtol, grad_rtol = (LOSS_RTOL_BF16, GRAD_RTOL_BF16) if setup.bf16 else (LOSS_RTOL, GRAD_RTOL)
    worst = {}
    assert any(r["last_stage"] for r in reports)
    for report in reports:
        for kind in kinds:
            runs = report[kind]
            for route in routes:
                if route == "unfused":
                    continue
                for reference in ("unfused", "installed"):
                    if reference not in runs or reference == route:
                        continue
                    loss_diff, grad_diff = _diffs(runs[route], runs[reference])
                    bad = {n: d for n, d in grad_diff.items() if d > grad_rtol}
                    assert not bad, (kind, route, reference, bad)
                    if report["last_stage"]:
                        assert loss_diff <= loss_rtol, (kind, route, reference, loss_diff)
                    key = f"{route} vs {reference}"
                    worst[key] = max(worst.get(key, 0.0), loss_diff, max(grad_diff.values()))
            if not report["last_stage"]:
                continue
            unfused = runs["unfused"]
            assert len(unfused["metrics"]) == NUM_MICROBATCHES
            assert sum(g.double().norm().item() ** 2 for g in unfused["grads"].values()) > 0
            assert unfused["layer_calls"]["original_output_layer"] > 0  # the reference has logits
            for route in routes:
                run = runs[route]
                if route == "unfused":
                    continue
                # no logits: megatron's output layer runs only for MTP depths, and only where the
                # fused layer is not installed (the hook comes after megatron's MTP)
                layer_calls = run["layer_calls"]["original_output_layer"]
                assert (layer_calls > 0) == (bool(setup.mtp_layers) and route == "processor"), \
                    (kind, route, run["layer_calls"])
                if not setup.mtp_layers:
                    assert run["layer_calls"]["vocab_parallel_cross_entropy"] == 0
                assert run["grad_added_to_main_grad"] == setup.grad_acc_fusion, (kind, route)
            # the processor route takes the gradients-in-forward losses exactly where the
            # installed layer does, and the fused ops run on every route but the unfused one
            if "installed" in runs:
                for route in routes:
                    if route in ("processor", "both"):
                        for op in ("loss_funcs.linear_cross_entropy", "loss_funcs.linear_grpo_loss"):
                            assert runs[route]["calls"].get(op, 0) == runs["installed"]["calls"].get(op, 0), \
                                (kind, route, op, runs[route]["calls"], runs["installed"]["calls"])
            for route in routes:
                if route != "unfused":
                    assert sum(runs[route]["calls"].values()) > 0, (kind, route)
            assert sum(unfused["calls"].values()) == 0
    return worst


ROUTES = ("unfused", "installed", "processor")
ROUTE_CASES = [
    (Setup(dp=2), ("sft", "dpo", "grpo", "labels", "logprobs")),
    (Setup(tp=2, tied=True, sp=True), ("sft", "grpo", "grpo_entropy", "labels", "logprobs")),
    (Setup(pp=2, dp=2, tied=True), ("sft", "dpo", "grpo", "labels")),
    (Setup(tp=2, pp=2, tied=True, grad_acc_fusion=True), ("sft", "grpo", "labels")),
    # Megatron's default loss scaling: the loss funcs pass the upstream gradient the schedule will
    # send (expected_upstream_grad) and the op adds dW into main_grad during the forward
    (Setup(tp=2, dp=2, grad_acc_fusion=True, per_token_loss=False), ("sft", "grpo")),
    (Setup(tp=2, pp=2, tied=True, bf16=True), ("sft", "grpo", "labels")),
]


@needs_hook
@pytest.mark.parametrize("setup,kinds", ROUTE_CASES, ids=[str(s) for s, _ in ROUTE_CASES])
def test_processor_route_matches_installed_and_unfused(setup, kinds, record_property):
    reports = run_workers(route_worker, setup.world, setup, kinds, ROUTES, timeout=300)
    for report in reports:
        if report["last_stage"]:
            for kind in kinds:
                expected = {"loss_funcs.linear_cross_entropy": NUM_MICROBATCHES if kind == "sft" else 0,
                            "loss_funcs.linear_grpo_loss": NUM_MICROBATCHES if kind == "grpo" else 0}
                got = {op: report[kind]["processor"]["calls"].get(op, 0) for op in expected}
                assert got == expected, (kind, got)
    worst = check_routes(reports, setup, kinds, ROUTES)
    record_property("max_rel_diff", worst)
    print(f"{setup}: max relative differences {worst}")


MTP_CASES = [
    (Setup(mtp_layers=2), ("labels", "sft", "grpo"), ("unfused", "installed", "processor", "both")),
    (Setup(tp=2, pp=2, tied=True, sp=True, mtp_layers=1), ("labels", "sft"),
     ("unfused", "installed", "processor", "both")),
    # gradient-accumulation fusion: megatron's own layers would need their CUDA extension for it
    # (the MTP depths of the processor-only route), so here with the fused layer installed
    (Setup(tp=2, dp=2, mtp_layers=1, grad_acc_fusion=True, per_token_loss=False), ("labels", "sft"),
     ("unfused", "installed", "both")),
]


@needs_hook
@pytest.mark.parametrize("setup,kinds,routes", MTP_CASES, ids=[str(s) for s, _, _ in MTP_CASES])
def test_processor_route_with_multi_token_prediction(setup, kinds, routes, record_property):
    """megatron runs its MTP depths before the hook: through its own output layer on the processor
    route alone (logits formed, losses megatron's), through the fused layer when installed too;
    main loss, every logged MTP depth loss and every gradient match either way."""
    reports = run_workers(route_worker, setup.world, setup, kinds, routes, timeout=300)
    for report in reports:
        if report["last_stage"]:
            for kind in kinds:
                for route in routes:
                    logged = report[kind][route]["mtp_logged"]
                    assert sorted(logged) == [f"mtp_{d + 1} loss" for d in range(setup.mtp_layers)]
    worst = check_routes(reports, setup, kinds, routes)
    record_property("max_rel_diff", worst)
    print(f"{setup}: max relative differences {worst}")


# ------------------------------------------------------------------------------------------------
# MuP's output multiplier: GPTModel scales the logits after its output layer, the processor folds it
# ------------------------------------------------------------------------------------------------
MUP_OUTPUT_MULT = 0.37  # not a power of two: the scaled values are rounded, as megatron's are
MUP_CASES = [
    (Setup(tp=2, tied=True, sp=True), ("sft", "grpo_entropy", "labels", "logprobs")),
    (Setup(tp=2, pp=2, tied=True, grad_acc_fusion=True), ("sft", "dpo", "labels")),
    # the MTP depths: megatron's own layer scales their logits before the hook
    (Setup(mtp_layers=1), ("labels", "sft")),
]


@needs_hook
@pytest.mark.parametrize("setup,kinds", MUP_CASES, ids=[str(s) for s, _ in MUP_CASES])
def test_processor_route_folds_the_mup_output_multiplier(setup, kinds, record_property):
    """A MuP model (`use_mup`, `mup_output_mult`): the processor's losses, log-probs and every
    gradient are those of GPTModel's own path, which multiplies its logits by the multiplier."""
    routes = ("unfused", "processor")
    reports = run_workers(route_worker, setup.world, setup, kinds, routes, MUP_OUTPUT_MULT, timeout=300)
    worst = check_routes(reports, setup, kinds, routes)
    record_property("max_rel_diff", worst)
    print(f"{setup} with MuP: max relative differences {worst}")


def _errors_of(attempts) -> dict:
    """{name: None, or (error type, message)} of each attempt (a call that should raise or not)."""
    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = None
        except (ValueError, TypeError, RuntimeError) as error:
            errors[name] = (type(error).__name__, str(error))
    return errors


def scaling_worker(rank, world):
    """Logit scaling and the keywords GPTModel passes, TP = 2: direct processor calls on the last
    stage's hidden states against a float64 reference and megatron's own output layer."""
    import inspect
    import types

    from megatron_fused_ce.megatron import output_processor as output_processor_module
    from megatron_harness import all_gather_cat

    chunks = common.build(Setup(tp=2))
    (chunk,) = chunks
    gpt = unwrap_model(chunk)
    config = gpt.config
    layer = gpt.output_layer
    batch = common.make_batches("sft", 1, seed=5)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    labels = batch["labels"]
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(SEQ, MBS, common.HIDDEN, generator=g)
    upstream = torch.randn(MBS, SEQ, generator=g)
    fused = FusedCEConfig(enabled=True, chunk_size=8)
    on = FusedOutputProcessor(fused, vocab_size=TRUE_VOCAB)
    off = FusedOutputProcessor(FusedCEConfig(enabled=False), vocab_size=TRUE_VOCAB)
    report = {}

    # the keywords GPTModel passes: each one a parameter of the processor or a known harmless one
    passed = {}

    def recorder(**kwargs):
        passed.update(kwargs)
        return on(**kwargs)

    with torch.no_grad():
        chunk(*args, output_processor=recorder)
    named = set(inspect.signature(FusedOutputProcessor.__call__).parameters) - {"self", "others"}
    report["passed"] = sorted(passed)
    report["unread"] = sorted(set(passed) - named - set(output_processor_module.IGNORED_KEYWORDS))

    megatron_scale = gpt._scale_logits  # bound before a test overrides it on the model

    def direct(proc, returns="loss", h=None, **overrides):
        kwargs = dict(hidden_states=hidden if h is None else h, output_layer=layer, output_weight=None,
                      labels=labels, loss_mask=batch["loss_mask"], context={"returns": returns},
                      compute_language_model_loss=gpt.compute_language_model_loss,
                      scale_logits=megatron_scale, config=config)
        kwargs.update(overrides)
        return proc(**kwargs)

    # MuP: the fused per-token loss and its gradients against float64 logits * multiplier
    config.use_mup, config.mup_output_mult = True, MUP_OUTPUT_MULT
    h = hidden.clone().requires_grad_()
    loss = direct(on, h=h)
    grad_h, grad_w = torch.autograd.grad((loss * upstream).sum(), [h, layer.weight])
    tp_group = layer.tp_group
    full_weight = all_gather_cat(layer.weight.detach(), 0, tp_group).double().requires_grad_()
    h64 = hidden.double().requires_grad_()

    def reference(scale):
        logits = (h64 @ full_weight.t()) * scale  # [s, b, V]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.t().flatten(), reduction="none").view(SEQ, MBS).t()

    want = reference(MUP_OUTPUT_MULT)
    want_h, want_w = torch.autograd.grad((want * upstream).sum(), [h64, full_weight])
    rows = layer.weight.shape[0]
    tp_rank = torch.distributed.get_rank(tp_group)
    shard = slice(tp_rank * rows, (tp_rank + 1) * rows)  # this rank's vocab rows
    report["mup_vs_float64"] = (common.max_rel_diff(loss.double(), want),
                                common.max_rel_diff(grad_h.double(), want_h),
                                common.max_rel_diff(grad_w.double(), want_w[shard]))
    with torch.no_grad():
        report["unscaled_vs_float64"] = common.max_rel_diff(reference(1.0), want)
        # megatron's own output layer, multiplier and cross-entropy on the same hidden states
        logits, _ = layer(hidden)
        megatron_loss = gpt.compute_language_model_loss(labels, gpt._scale_logits(logits))
        report["mup_vs_megatron"] = common.max_rel_diff(direct(on), megatron_loss)
        report["mup_off_vs_megatron"] = common.max_rel_diff(direct(off), megatron_loss)
        report["mup_model_vs_megatron"] = common.max_rel_diff(
            chunk(*args, labels=labels, output_processor=on, output_processor_context={"returns": "loss"}),
            chunk(*args, labels=labels))
    config.use_mup, config.mup_output_mult = False, 1.0

    def softcap(logits):  # a model's own logit scaling, e.g. a soft cap
        return 2.0 * torch.tanh(logits / 2.0)

    last_token = types.SimpleNamespace(config=types.SimpleNamespace(materialize_only_last_token_logits=True))
    errors = {}
    attempts = {
        "callable": lambda: direct(on, scale_logits=lambda logits: logits * 2.0),
        "overridden": lambda: chunk(*args, labels=labels, output_processor=on,
                                    output_processor_context={"returns": "loss"}),
        "mup_without_scale_logits": lambda: direct(on, scale_logits=None, config=types.SimpleNamespace(
            use_mup=True, mup_output_mult=0.5)),
        "unknown_keyword": lambda: direct(on, logit_softcapping=30.0),
        "unknown_keyword_off": lambda: direct(off, logit_softcapping=30.0),
        "unknown_none": lambda: direct(on, logit_softcapping=None),
        "last_token_logits": lambda: direct(off, returns="hidden_states", inference_context=last_token),
        "fp8_output_proj": lambda: direct(on, config=types.SimpleNamespace(fp8_output_proj=True, fp8="e4m3")),
    }
    gpt._scale_logits = softcap  # GPTModel passes the model's own `_scale_logits`
    try:
        with torch.no_grad():
            # fusion off applies it, as GPTModel does; the cap changes the loss
            capped = chunk(*args, labels=labels)
            report["softcap_off"] = torch.equal(
                chunk(*args, labels=labels, output_processor=off,
                      output_processor_context={"returns": "loss"}),
                capped)
            report["softcap_matters"] = common.max_rel_diff(capped, megatron_loss) > 1e-2
            errors.update(_errors_of(attempts))
    finally:
        del gpt._scale_logits
    report["errors"] = errors
    return report


@needs_hook
def test_processor_folds_megatron_scale_logits_and_refuses_what_it_cannot():
    """GPTModel's `scale_logits` (MuP's multiplier, a constant read from the config) is folded into
    the fused math: float64 `logits * mult` and megatron's own output layer are matched, values and
    gradients. What cannot be folded or is unknown raises, naming it, rather than be dropped: a
    model's own `_scale_logits`, a caller's function, MuP without `scale_logits`, an unknown keyword
    with a value, inference's last-token logits, an MXFP8 output projection."""
    for r in run_workers(scaling_worker, 2):
        assert r["unread"] == [], r["passed"]
        assert {"scale_logits", "config", "inference_context", "loss_mask"} <= set(r["passed"])
        assert max(r["mup_vs_float64"]) <= LOSS_RTOL, r["mup_vs_float64"]
        assert r["unscaled_vs_float64"] > 1e-2  # the multiplier matters
        assert r["mup_vs_megatron"] <= LOSS_RTOL and r["mup_model_vs_megatron"] <= LOSS_RTOL
        assert r["mup_off_vs_megatron"] == 0.0
        assert r["softcap_off"] and r["softcap_matters"]
        errors = r["errors"]
        for name in ("callable", "overridden"):
            kind, message = errors[name]
            assert kind == "ValueError" and "scale_logits=" in message, (name, message)
            assert "without output_processor" in message and "enabled=False" in message
        assert "softcap" in errors["overridden"][1]
        kind, message = errors["mup_without_scale_logits"]
        assert kind == "ValueError" and "MuP" in message
        for name in ("unknown_keyword", "unknown_keyword_off"):
            kind, message = errors[name]
            assert kind == "TypeError" and "logit_softcapping=30.0" in message, (name, message)
            assert "without output_processor" in message
        assert errors["unknown_none"] is None
        kind, message = errors["last_token_logits"]
        assert kind == "ValueError" and "materialize_only_last_token_logits" in message
        kind, message = errors["fp8_output_proj"]
        assert kind == "ValueError" and "fp8_output_proj" in message


# ------------------------------------------------------------------------------------------------
# Packed sequences under context parallelism: the packing from GPTModel's packed_seq_params
# ------------------------------------------------------------------------------------------------
def packed_worker(rank, world, setup: Setup):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_cp_workers import DOCS_PADDED, packed_batch, reduce_metrics
    from megatron_fused_ce.megatron import context_parallel_group

    chunks = common.build(setup)
    fused = FusedCEConfig(enabled=True, chunk_size=5)
    batches = common.cp_batches([packed_batch(seed) for seed in range(NUM_MICROBATCHES)])

    def params(batch):
        real, padded = batch["cu_seqlens"], batch["cu_seqlens_padded"]
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                               cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                               max_seqlen_q=max(DOCS_PADDED), max_seqlen_kv=max(DOCS_PADDED))

    def forward(proc=None, **extra):
        def run(chunk, batch):
            kwargs = dict(packed_seq_params=params(batch), **extra)
            if proc is not None:
                kwargs["output_processor"] = proc
            return chunk(batch["tokens"], batch["position_ids"], None, **kwargs)

        return run

    report = {"cp": world, "cp_group_size": torch.distributed.get_world_size(context_parallel_group())}
    for route in ("unfused", "installed", "processor"):
        if route == "installed":
            install_fused_output_layer(chunks, fused)
        else:
            uninstall_fused_output_layer(chunks)
        proc = FusedOutputProcessor(fused, vocab_size=TRUE_VOCAB) if route == "processor" else None
        post = proc or LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)

        def make(chunk, batch, index):
            return sft_loss_func(post, chunk, batch["labels"], batch["loss_mask"],
                                 cu_seqlens=batch["cu_seqlens"], cu_seqlens_padded=batch["cu_seqlens_padded"])

        gathered = compute_logprobs(chunks, batches, forward(proc), post, seq_length=SEQ,
                                    micro_batch_size=1, layout="gathered")
        metrics = common.run_step(chunks, batches, make, forward=forward(proc))
        run = {"metrics": reduce_metrics(metrics), "grads": common.grads(chunks),
               "gathered": [o.logprobs for o in gathered]}
        # the processor's own log-probs: packing read from GPTModel's packed_seq_params
        with torch.no_grad():
            batch = batches[0]
            if route == "processor":
                lp_proc = FusedOutputProcessor(fused, returns="logprobs", vocab_size=TRUE_VOCAB)
                run["direct"] = forward(lp_proc, labels=batch["labels"])(chunks[0], batch).logprobs
            else:
                output = forward()(chunks[0], batch)
                run["direct"] = post(output, chunks[0], batch["labels"], cu_seqlens=batch["cu_seqlens"],
                                     cu_seqlens_padded=batch["cu_seqlens_padded"]).logprobs
        report[route] = run
    return report


@needs_hook
def test_processor_route_packed_sequences_under_context_parallelism():
    from megatron_cp_workers import expected_scored_positions

    setup = Setup(cp=2)
    results = run_workers(packed_worker, setup.world, setup, timeout=240)
    want_scored = expected_scored_positions()
    for r in results:
        assert r["cp_group_size"] == 2
        for route in ("installed", "processor"):
            got, want = r[route], r["unfused"]
            assert abs(got["metrics"]["lm loss"] - want["metrics"]["lm loss"]) <= \
                LOSS_RTOL * abs(want["metrics"]["lm loss"])
            for name, grad in want["grads"].items():
                assert common.max_rel_diff(got["grads"][name], grad) <= GRAD_RTOL, (route, name)
            for a, b in zip(got["gathered"], want["gathered"]):
                assert common.max_rel_diff(a, b) <= LOSS_RTOL
                assert sorted(a[0].nonzero().squeeze(1).tolist()) == want_scored
            assert common.max_rel_diff(got["direct"], want["direct"]) <= LOSS_RTOL
        # the boundary masking really happened on this rank's slice (zeros where not scored)
        assert (r["processor"]["direct"] == 0).any()


# ------------------------------------------------------------------------------------------------
# Megatron's DDP with overlap_param_gather: the weight is read only after its all-gather
# ------------------------------------------------------------------------------------------------
def overlap_worker(rank, world, kind):
    from megatron.core import parallel_state

    from megatron_fused_ce.megatron import output_layer
    from megatron_workers import ParamGatherRecorder, grad_buffers

    setup = Setup(dp=2, overlap=True)
    chunks = common.build(setup)
    (ddp,) = chunks
    assert ddp.use_forward_hook
    fused = FusedCEConfig(enabled=True, chunk_size=8)
    gather = ParamGatherRecorder(ddp, output_weight(ddp))
    # the processor's own cross-entropy ("labels") is read too
    original = output_layer.linear_cross_entropy

    def checked(*args, **kwargs):
        gather.reads.append(id(gather.weight_group) in gather.finished)
        return original(*args, **kwargs)

    output_layer.linear_cross_entropy = checked
    batches = common.make_batches("sft", 2, seed=100 + parallel_state.get_data_parallel_rank())
    config = unwrap_model(ddp).config
    config.no_sync_func = ddp.no_sync
    steps = []
    for route in ("unfused", "processor"):
        proc = FusedOutputProcessor(fused, vocab_size=TRUE_VOCAB)
        forward = _forward(kind, route, proc, mtp=False)
        gather.new_step()
        ddp.start_param_sync()  # as after an optimizer step: all-gathers in flight
        metrics = common.run_step(
            chunks, batches, _loss_func_maker(kind, proc if route == "processor" else
                                              LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB),
                                              None, setup, route == "processor"), forward=forward)
        steps.append({"reads": gather.new_step(), "grads": grad_buffers(ddp), "metrics": metrics})
    return steps


@needs_hook
@pytest.mark.parametrize("kind", ["sft", "labels"])
def test_processor_route_waits_for_the_weight_all_gather(kind):
    for unfused, processor in run_workers(overlap_worker, 2, kind, timeout=180):
        assert processor["reads"] and all(processor["reads"]), processor["reads"]
        for a, b in zip(processor["grads"], unfused["grads"]):
            assert common.max_rel_diff(a, b) <= GRAD_RTOL
        for mp, mu in zip(processor["metrics"], unfused["metrics"]):
            assert common.max_rel_diff(mp["lm loss"], mu["lm loss"]) <= LOSS_RTOL


# ------------------------------------------------------------------------------------------------
# Fusion off, call options and bad input
# ------------------------------------------------------------------------------------------------
def calls_worker(rank, world):
    chunks = common.build(Setup(tp=2))
    (chunk,) = chunks
    batch = common.make_batches("sft", 1, seed=3)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    labels = batch["labels"]
    report = {}
    # fusion off: exactly what GPTModel does without a processor
    off = FusedOutputProcessor(FusedCEConfig(enabled=False), vocab_size=TRUE_VOCAB, return_entropy=True)
    post = LogprobsPostProcessor(FusedCEConfig(enabled=False), vocab_size=TRUE_VOCAB, return_entropy=True)
    with torch.no_grad():
        logits = chunk(*args)
        loss = chunk(*args, labels=labels)
        lp = post(logits, chunk, labels)
        lp_off = chunk(*args, labels=labels, output_processor=off,
                       output_processor_context={"returns": "logprobs"})
        report["off"] = {
            "logits": torch.equal(chunk(*args, output_processor=off), logits),
            "loss": torch.equal(chunk(*args, labels=labels, output_processor=off,
                                      output_processor_context={"returns": "loss"}), loss),
            "logprobs": torch.equal(lp_off.logprobs, lp.logprobs) and torch.equal(lp_off.entropy, lp.entropy),
        }
        on = FusedOutputProcessor(FusedCEConfig(enabled=True, chunk_size=8), vocab_size=TRUE_VOCAB)
        states = chunk(*args, output_processor=on)
        report["states"] = (type(states).__name__, tuple(states.states.shape), states.token_shape())
        # returns="loss" is megatron's cross-entropy over the full padded vocab, per token
        fused_loss = chunk(*args, labels=labels, output_processor=on,
                           output_processor_context={"returns": "loss"})
        report["loss_diff"] = common.max_rel_diff(fused_loss, loss)
    errors = {}
    attempts = {
        "no_labels": lambda: chunk(*args, output_processor=on, output_processor_context={"returns": "loss"}),
        "bad_context_key": lambda: chunk(*args, output_processor=on,
                                         output_processor_context={"return": "loss"}),
        "bad_context": lambda: chunk(*args, output_processor=on, output_processor_context="loss"),
        "gathered": lambda: chunk(*args, output_processor=on, runtime_gather_output=True),
        "bad_returns": lambda: FusedOutputProcessor(FusedCEConfig(enabled=True), returns="logits"),
        "logprobs_to_loss_func": lambda: sft_loss_func(on, chunk, labels, batch["loss_mask"])(
            chunk(*args, labels=labels, output_processor=on,
                  output_processor_context={"returns": "logprobs"})),
        "other_model": lambda: on.post_processor(HiddenStates(states.states, torch.nn.Linear(2, 2, bias=False)),
                                                 chunk, labels),
    }
    errors.update(_errors_of(attempts))
    report["errors"] = errors
    return report


@needs_hook
def test_processor_call_options_and_errors():
    """Fusion off reproduces GPTModel bit for bit; bad calls raise clear errors on every rank
    (TP = 2: none is left waiting in a collective)."""
    for r in run_workers(calls_worker, 2):
        assert r["off"] == {"logits": True, "loss": True, "logprobs": True}
        assert r["states"] == ("HiddenStates", (SEQ, MBS, common.HIDDEN), (MBS, SEQ))
        assert r["loss_diff"] <= LOSS_RTOL
        errors = r["errors"]
        assert errors["no_labels"][0] == "ValueError" and "needs labels" in errors["no_labels"][1]
        assert errors["bad_context_key"][0] == "ValueError" and "'return'" in errors["bad_context_key"][1]
        assert errors["bad_context"][0] == "TypeError" and "mapping" in errors["bad_context"][1]
        assert errors["gathered"][0] == "RuntimeError" and "without output_processor" in errors["gathered"][1]
        assert errors["bad_returns"][0] == "ValueError" and "'logits'" in errors["bad_returns"][1]
        assert errors["logprobs_to_loss_func"][0] == "TypeError" and \
            "returns='hidden_states'" in errors["logprobs_to_loss_func"][1]
        assert errors["other_model"][0] == "ValueError" and "another model" in errors["other_model"][1]
