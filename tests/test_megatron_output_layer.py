"""install_fused_output_layer: what changes (the last stage returns hidden states) and what does
not (GPTModel's code, other stages, parameters, state-dict keys, checkpoints in both directions)."""

from __future__ import annotations

import io
import types

import pytest
import torch

import test_megatron_common as common
from dist import run_workers
from test_megatron_common import Setup

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


def test_rejects_unsupported_models():
    layer = types.SimpleNamespace(weight=None, bias=None)
    for config in (types.SimpleNamespace(mtp_num_layers=1),
                   types.SimpleNamespace(defer_embedding_wgrad_compute=True),
                   types.SimpleNamespace(use_mup=True)):
        model = types.SimpleNamespace(post_process=True, config=config, output_layer=layer)
        with pytest.raises(ValueError, match="unsupported"):
            install_fused_output_layer(model, FUSED)


def test_output_layer_refuses_gathered_logits():
    linear = torch.nn.Linear(4, 8, bias=False)
    linear.sequence_parallel = False
    fused = FusedOutputLayer(linear)
    hidden = torch.randn(3, 2, 4)
    out, bias = fused(hidden, weight=linear.weight)
    assert out is hidden and bias is None
    assert fused.weight is linear.weight and fused.in_features == 4  # other attributes: the original's
    assert list(fused.state_dict()) == ["weight", "_extra_state"]
    with pytest.raises(RuntimeError, match="uninstall_fused_output_layer"):
        fused(hidden, runtime_gather_output=True)
