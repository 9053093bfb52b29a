"""install_fused_output_layer: what changes (the last stage returns hidden states) and what does
not (GPTModel's code, other stages, parameters, state-dict keys, checkpoints in both directions)."""

from __future__ import annotations

import io
import types

import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import Setup

from megatron_fused_ce.megatron import (
    FusedCEConfig,
    FusedOutputLayer,
    LogprobsPostProcessor,
    install_fused_output_layer,
    is_fused,
    sft_loss_func,
    uninstall_fused_output_layer,
    unwrap_model,
)

FUSED = FusedCEConfig(enabled=True, chunk_size=8)
LOSS_RTOL = 1e-5


def _loss(chunks, batches):
    """Per-micro-batch SFT loss sums of a forward-only pass (last stage; [] elsewhere)."""
    post = LogprobsPostProcessor(FUSED, vocab_size=common.TRUE_VOCAB)
    with torch.no_grad():
        out = common.run_step(chunks, batches, lambda chunk, batch, _: sft_loss_func(
            post, chunk, batch["labels"], batch["loss_mask"]), forward_only=True)
    return [float(m["lm loss"][0]) for m in out]


def _sharded_summary(gpt):
    summary = {}
    for key, value in gpt.sharded_state_dict().items():
        summary[key] = (getattr(value, "key", None), tuple(getattr(value, "global_shape", ()) or ()),
                        tuple(getattr(value, "global_offset", ()) or ()),
                        getattr(value, "replica_id", None))
    return summary


def _state_dict_bytes(gpt) -> bytes:
    buffer = io.BytesIO()
    torch.save(gpt.state_dict(), buffer)
    return buffer.getvalue()


def _load(gpt, blob: bytes):
    state = torch.load(io.BytesIO(blob), weights_only=False)
    result = gpt.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def checkpoint_worker(rank, world, setup: Setup):
    from megatron.core.models.gpt import GPTModel

    forward_before = GPTModel.forward
    batches = common.make_batches("sft", 2, seed=11)
    report = {}

    # Model A, unfused: its state dict, sharded state dict, loss.
    (a,) = common.build(setup, seed=1)
    gpt_a = unwrap_model(a)
    keys_unfused = list(gpt_a.state_dict().keys())
    sharded_unfused = _sharded_summary(gpt_a)
    names_unfused = [n for n, _ in a.named_parameters()]
    original_layer = getattr(gpt_a, "output_layer", None)
    hooks_before = (len(gpt_a._forward_pre_hooks), len(gpt_a._forward_hooks))
    loss_a_unfused = _loss([a], batches)
    blob_unfused = _state_dict_bytes(gpt_a)

    # Fusion off: nothing happens. Fusion on: only the output layer attribute of the last stage.
    install_fused_output_layer(a, FusedCEConfig(enabled=False))
    report["disabled_untouched"] = getattr(gpt_a, "output_layer", None) is original_layer
    install_fused_output_layer([a], FUSED)
    layer = getattr(gpt_a, "output_layer", None)
    install_fused_output_layer(a, FUSED)  # twice: harmless
    report["idempotent"] = getattr(gpt_a, "output_layer", None) is layer
    report["last_stage"] = bool(gpt_a.post_process)
    report["fused_here"] = isinstance(layer, FusedOutputLayer)
    report["same_weight_object"] = (layer is None or layer.weight is original_layer.weight)
    report["same_state_dict_keys"] = list(gpt_a.state_dict().keys()) == keys_unfused
    report["same_sharded_state_dict"] = _sharded_summary(gpt_a) == sharded_unfused
    report["same_parameter_names"] = [n for n, _ in a.named_parameters()] == names_unfused
    report["gpt_forward_untouched"] = GPTModel.forward is forward_before and "forward" not in vars(gpt_a)
    loss_a_fused = _loss([a], batches)
    uninstall_fused_output_layer(a)
    report["uninstall_restores"] = (getattr(gpt_a, "output_layer", None) is original_layer and
                                    (len(gpt_a._forward_pre_hooks), len(gpt_a._forward_hooks))
                                    == hooks_before)

    # Unfused checkpoint -> fused model B (different init) -> same loss as A.
    (b,) = common.build(setup, seed=2)
    install_fused_output_layer(b, FUSED)
    loss_b_before = _loss([b], batches)
    _load(unwrap_model(b), blob_unfused)
    loss_b = _loss([b], batches)
    # Fused checkpoint (B's) -> unfused model C -> same loss again.
    (c,) = common.build(setup, seed=3)
    _load(unwrap_model(c), _state_dict_bytes(unwrap_model(b)))
    loss_c = _loss([c], batches)
    report["is_fused_b"] = is_fused(b) if report["last_stage"] else None
    report["losses"] = {"a_unfused": loss_a_unfused, "a_fused": loss_a_fused,
                        "b_before_load": loss_b_before, "b_fused_loaded": loss_b,
                        "c_unfused_loaded": loss_c}
    return report


@pytest.mark.parametrize("setup", [
    Setup(tp=1, pp=1, tied=True),
    Setup(tp=2, pp=2, tied=True),
    Setup(tp=2, pp=2, tied=False),
], ids=str)
def test_install_and_checkpoint_round_trip(setup):
    reports = run_workers(checkpoint_worker, setup.world, setup)
    assert any(r["last_stage"] for r in reports)
    for r in reports:
        for key in ("disabled_untouched", "idempotent", "same_weight_object", "same_state_dict_keys",
                    "same_sharded_state_dict", "same_parameter_names", "gpt_forward_untouched",
                    "uninstall_restores"):
            assert r[key], (key, r)
        assert r["fused_here"] == r["last_stage"]  # other stages are left alone
        if r["last_stage"]:
            assert r["is_fused_b"]
            losses = r["losses"]
            ref = losses["a_unfused"]
            assert losses["b_before_load"] != pytest.approx(ref, rel=1e-3)  # the load matters
            for name in ("a_fused", "b_fused_loaded", "c_unfused_loaded"):
                assert losses[name] == pytest.approx(ref, rel=LOSS_RTOL), (name, losses)


def test_rejects_unsupported_models(monkeypatch):
    from megatron_fused_ce.megatron import compat

    layer = types.SimpleNamespace(weight=None, bias=None)
    configs = [types.SimpleNamespace(defer_embedding_wgrad_compute=True),
               types.SimpleNamespace(use_mup=True)]
    for config in configs:
        model = types.SimpleNamespace(post_process=True, config=config, output_layer=layer)
        with pytest.raises(ValueError, match="unsupported"):
            install_fused_output_layer(model, FUSED)
    # MTP: supported from megatron-core 0.16 on; older versions are named in the error.
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 15))
    model = types.SimpleNamespace(post_process=True, config=types.SimpleNamespace(mtp_num_layers=1),
                                  output_layer=layer)
    with pytest.raises(ValueError, match=r"multi-token prediction .* megatron-core >= 0.16, found 0.15"):
        install_fused_output_layer(model, FUSED)


# ------------------------------------------------------------------------------------------------
# LazyLogits: what the fused layer returns instead of logits.
# ------------------------------------------------------------------------------------------------
S, B, H, V_LOCAL = 12, 2, 16, 20


def lazy_logits_worker(rank, world, sp: bool):
    import torch.distributed as dist
    import torch.nn.functional as F

    import reference

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(V_LOCAL * world, H, generator=g) / H ** 0.5
    weight[V_LOCAL * world - 1] = weight[3]  # an exact tie across shards (TP=2): lowest id wins
    hidden[0, 0] = weight[3] * 10  # ... and it is row (0, 0)'s clear argmax
    labels = torch.randint(0, V_LOCAL * world, (B, S), generator=g)
    grad_out = torch.randn(B, S, generator=g)

    linear = torch.nn.Linear(H, V_LOCAL, bias=False)
    linear.weight = torch.nn.Parameter(weight[rank * V_LOCAL:(rank + 1) * V_LOCAL].clone())
    linear.tp_group = dist.group.WORLD if world > 1 else None
    linear.sequence_parallel = sp
    linear.config = types.SimpleNamespace(gradient_accumulation_fusion=False)
    layer = FusedOutputLayer(linear, FusedCEConfig(enabled=True, chunk_size=5))
    rows = slice(rank * S // world, (rank + 1) * S // world) if sp and world > 1 else slice(None)
    h_in = hidden[rows].clone().requires_grad_()

    logits, bias = layer(h_in)
    report = {"shape": tuple(logits.shape), "bias": bias, "dtype": logits.dtype,
              "transposed_is_hidden": torch.equal(logits.transpose(0, 1), h_in.transpose(0, 1))}
    ce = logits.cross_entropy(labels)
    (ce * grad_out).sum().backward()
    argmax = torch.argmax(logits, dim=-1)

    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = hd @ wd.t()
    ref_ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.t().reshape(-1),
                             reduction="none").reshape(S, B).t()
    ref_dx, ref_dw = torch.autograd.grad((ref_ce * grad_out).sum(), (hd, wd))
    tp_rows = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    report["errors"] = {
        "lazy ce": reference.rel_err(ce, ref_ce),
        "lazy ce dX": reference.rel_err(h_in.grad, ref_dx[rows]),
        "lazy ce dW": reference.rel_err(linear.weight.grad, ref_dw[tp_rows]),
    }
    top2 = z.detach().topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-6
    report["argmax_ok"] = bool(((argmax == z.detach().argmax(-1)) | ~clear).all())
    report["tie"] = int(argmax[0, 0])
    failures = []
    for name, attempt in [("float", lambda: logits.float()), ("add", lambda: logits + 1),
                          ("softmax", lambda: torch.softmax(logits, -1)),
                          ("gathered", lambda: layer(h_in, runtime_gather_output=True))]:
        try:
            attempt()
        except RuntimeError as error:
            failures.append((name, "uninstall_fused_output_layer" in str(error)))
    report["failures"] = failures
    return report


@pytest.mark.parametrize("world,sp", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"])
def test_lazy_logits(world, sp):
    """The few things megatron does with logits, without them: cross-entropy (value, dX, dW vs a
    float64 dense reference), argmax (ties -> lowest id, as torch.argmax over gathered logits),
    the [s, b] -> [b, s] transpose (the hidden states); anything else raises."""
    import reference

    for r in run_workers(lazy_logits_worker, world, sp):
        assert r["shape"] == (S, B, V_LOCAL * world) and r["bias"] is None
        assert r["transposed_is_hidden"]
        for name, err in r["errors"].items():
            reference.record(name, world, torch.float32, err)
            assert err < 2e-5, (name, err)
        assert r["argmax_ok"] and r["tie"] == 3
        assert r["failures"] == [("float", True), ("add", True), ("softmax", True), ("gathered", True)]


def test_output_layer_keeps_the_original_weight_and_state():
    linear = torch.nn.Linear(4, 8, bias=False)
    linear.sequence_parallel = False
    fused = FusedOutputLayer(linear)
    assert fused.weight is linear.weight and fused.in_features == 4  # other attributes: the original's
    assert list(fused.state_dict()) == ["weight", "_extra_state"]
    assert fused.gather_output  # LazyLogits stand for gathered logits


# ------------------------------------------------------------------------------------------------
# uninstall / install in the middle of a run (generation, evaluation).
# ------------------------------------------------------------------------------------------------
def _snapshot(chunks, optimizer):
    params = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    state = {k: v.clone() for p, st in optimizer.state.items() for k, v in st.items()
             if torch.is_tensor(v)}
    return params, state


def _same(a, b):
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and \
        a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def round_trip_worker(rank, world, setup: Setup):
    from megatron.core import parallel_state

    chunks = common.build(setup, seed=7)
    gpt = unwrap_model(chunks[-1])
    params = [p for c in chunks for p in c.parameters()]
    initial = [p.detach().clone() for p in params]
    keys_unfused = list(gpt.state_dict().keys())
    batches = common.make_batches("sft", 2, seed=3 + parallel_state.get_data_parallel_rank())
    post = LogprobsPostProcessor(FUSED, vocab_size=common.TRUE_VOCAB)
    last = parallel_state.is_pipeline_last_stage()

    def train_step(optimizer):
        out = common.run_step(chunks, batches, lambda chunk, batch, _: sft_loss_func(
            post, chunk, batch["labels"], batch["loss_mask"]))
        for p in params:
            p.grad = p.main_grad.to(p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return [float(m["lm loss"][0]) for m in out]

    def generate():  # a forward-only pass that wants real logits (last stage: [b, s, V/TP])
        with torch.no_grad():
            out = common.run_step(chunks, batches[:1], lambda chunk, batch, _: (
                lambda output: (output.new_zeros(()), torch.ones((), dtype=torch.int),
                                {"logits": output.detach().clone()})), forward_only=True)
        return out[0]["logits"] if last else None

    runs, report = {}, {"last_stage": last}
    for mode in ("fused", "unfused"):
        with torch.no_grad():
            for p, value in zip(params, initial):
                p.copy_(value)
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        if mode == "fused":
            install_fused_output_layer(chunks, FUSED)
        losses = train_step(optimizer)
        if mode == "fused":
            before = _snapshot(chunks, optimizer)
            uninstall_fused_output_layer(chunks)
            report["uninstall_untouched"] = _same(before, _snapshot(chunks, optimizer))
            report["same_keys"] = list(gpt.state_dict().keys()) == keys_unfused
        logits = generate()
        if mode == "fused":
            install_fused_output_layer(chunks, FUSED)
            report["install_untouched"] = _same(before, _snapshot(chunks, optimizer))
        losses += train_step(optimizer)
        if mode == "fused":
            uninstall_fused_output_layer(chunks)
        runs[mode] = (losses, logits, [p.detach().clone() for p in params])
    (lf, gf, pf), (lu, gu, pu) = runs["fused"], runs["unfused"]
    report["loss_diff"] = max([abs(a - b) / abs(b) for a, b in zip(lf, lu)], default=0.0)
    report["logits_diff"] = common.max_rel_diff(gf, gu) if last else 0.0
    report["logits_shape"] = tuple(gf.shape) if last else None
    report["param_diff"] = max(common.max_rel_diff(a, b) for a, b in zip(pf, pu))
    return report


@pytest.mark.parametrize("setup", [Setup(tp=2, sp=True), Setup(pp=2, tied=True)], ids=str)
def test_uninstall_round_trip(setup):
    """Train a step fused, uninstall, generate logits (those of a never-fused run), reinstall,
    train on: install/uninstall leave parameters and optimizer state bit for bit as they were."""
    for r in run_workers(round_trip_worker, setup.world, setup):
        assert r["uninstall_untouched"] and r["install_untouched"] and r["same_keys"]
        assert r["loss_diff"] <= LOSS_RTOL
        assert r["param_diff"] <= 1e-5
        if r["last_stage"]:
            assert r["logits_shape"] == (common.MBS, common.SEQ, common.PADDED_VOCAB // setup.tp)
            assert r["logits_diff"] <= 1e-5
