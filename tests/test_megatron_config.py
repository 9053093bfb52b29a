"""FusedCEConfig.from_megatron_cfg: the keys NeMo-RL users write, their aliases, near-misses of
them, bad input, and the default (automatic) chunk."""

from __future__ import annotations

import dataclasses
import glob
import os
import sys

import numpy as np
import pytest
import torch

import megatron_harness as common
from dist import run_workers
from megatron_harness import TRUE_VOCAB, Setup

from megatron_fused_ce.megatron import (
    FusedCEConfig,
    LogprobsPostProcessor,
    install_fused_output_layer,
)
from megatron_fused_ce.megatron.config import OWN_KEYS, near_miss

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
# every example's config (rl_model*.yaml are not: they hold the policy the RL examples share and
# come into those configs through `include:`; tests/test_example_config.py checks them there)
EXAMPLE_CONFIGS = sorted(p for p in glob.glob(os.path.join(EXAMPLES_DIR, "configs", "*.yaml"))
                         if not os.path.basename(p).startswith("rl_model"))


def test_defaults():
    assert FusedCEConfig() == FusedCEConfig(enabled=False, chunk_size=None)
    assert FusedCEConfig.from_megatron_cfg({}) == FusedCEConfig()
    assert FusedCEConfig.from_megatron_cfg(None) == FusedCEConfig()
    # no chunk size given: the op's automatic chunk (None), not a fixed number of rows
    assert FusedCEConfig.from_megatron_cfg({"use_linear_ce_fusion_loss": True}).chunk_size is None
    assert FusedCEConfig.from_megatron_cfg({"use_fused_linear_logprobs": True}).chunk_size is None


@pytest.mark.parametrize("enabled_key,chunk_key", [
    ("use_linear_ce_fusion_loss", "linear_ce_fusion_chunk_size"),
    ("use_fused_linear_logprobs", "fused_linear_logprobs_chunk_size"),
])
def test_keys_and_aliases(enabled_key, chunk_key):
    cfg = {enabled_key: True, chunk_key: 128, "tensor_model_parallel_size": 2,
           "optimizer": {"lr": 1e-4}, "sequence_parallel": True}  # unrelated keys are ignored
    assert FusedCEConfig.from_megatron_cfg(cfg) == FusedCEConfig(enabled=True, chunk_size=128)
    assert FusedCEConfig.from_megatron_cfg({enabled_key: False}) == FusedCEConfig()


def test_null_and_numpy_values():
    cfg = {"use_linear_ce_fusion_loss": True, "linear_ce_fusion_chunk_size": None}
    assert FusedCEConfig.from_megatron_cfg(cfg) == FusedCEConfig(enabled=True)
    cfg = {"linear_ce_fusion_chunk_size": np.int64(64)}
    assert FusedCEConfig.from_megatron_cfg(cfg).chunk_size == 64


@pytest.mark.parametrize("key,value", [
    ("use_linear_ce_fusion_loss", "true"),
    ("use_linear_ce_fusion_loss", 1),
    ("use_fused_linear_logprobs", "yes"),
    ("linear_ce_fusion_chunk_size", "256"),
    ("linear_ce_fusion_chunk_size", 12.5),
    ("linear_ce_fusion_chunk_size", True),
    ("linear_ce_fusion_chunk_size", 0),
    ("fused_linear_logprobs_chunk_size", -3),
])
def test_wrong_types_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        FusedCEConfig.from_megatron_cfg({key: value})


def test_conflicting_aliases():
    with pytest.raises(ValueError, match="use_linear_ce_fusion_loss"):
        FusedCEConfig.from_megatron_cfg({"use_linear_ce_fusion_loss": True,
                                         "use_fused_linear_logprobs": False})
    same = {"linear_ce_fusion_chunk_size": 64, "fused_linear_logprobs_chunk_size": 64}
    assert FusedCEConfig.from_megatron_cfg(same).chunk_size == 64


def test_not_a_mapping():
    with pytest.raises(ValueError, match="mapping"):
        FusedCEConfig.from_megatron_cfg(["use_linear_ce_fusion_loss"])


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="chunk_size"):
        FusedCEConfig(enabled=True, chunk_size=0)
    with pytest.raises(ValueError, match="enabled"):
        FusedCEConfig(enabled="yes")


@pytest.mark.parametrize("key", ["linear_ce_fusion_memory_mode", "fused_linear_logprobs_memory_mode"])
def test_memory_mode_key(key):
    assert FusedCEConfig().memory_mode == "fast"
    assert FusedCEConfig.from_megatron_cfg({key: "lean"}) == FusedCEConfig(memory_mode="lean")
    with pytest.raises(ValueError, match=key):
        FusedCEConfig.from_megatron_cfg({key: "small"})
    with pytest.raises(ValueError, match="memory_mode"):
        FusedCEConfig(memory_mode="Lean")
    assert near_miss(key[:-1]) == key


def test_megatron_lm_flag_memory_mode():
    """`--linear-ce-fusion-memory-mode` (add_fused_ce_args) reaches FusedCEConfig through
    from_megatron_cfg(vars(args)); absent, the mode is "fast"; another value is an argparse error."""
    import argparse

    from megatron_fused_ce.megatron import add_fused_ce_args

    def parse(*argv):
        return FusedCEConfig.from_megatron_cfg(vars(add_fused_ce_args(argparse.ArgumentParser()).parse_args(argv)))

    assert parse("--use-linear-ce-fusion-loss", "--linear-ce-fusion-memory-mode", "lean").memory_mode == "lean"
    assert parse("--use-linear-ce-fusion-loss").memory_mode == "fast"
    with pytest.raises(SystemExit):
        parse("--linear-ce-fusion-memory-mode", "tiny")


def test_memory_mode_reaches_the_op(monkeypatch):
    """FusedCEConfig(memory_mode="lean") runs the op's lean tiles from the fused output layer
    (same values and gradients as the fast mode)."""
    import types

    from megatron_fused_ce.megatron.output_layer import FusedOutputLayer
    from megatron_fused_ce.ops import lean

    calls = []
    tile_stats = lean.tile_stats
    monkeypatch.setattr(lean, "tile_stats", lambda *a, **k: calls.append(1) or tile_stats(*a, **k))
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(6, 2, 8, generator=g), torch.randn(40, 8, generator=g) / 3
    labels = torch.randint(0, 40, (2, 6), generator=g)
    results = {}
    for mode in ("fast", "lean"):
        linear = torch.nn.Linear(8, 40, bias=False)
        linear.weight = torch.nn.Parameter(weight.clone())
        linear.tp_group, linear.sequence_parallel = None, False
        linear.config = types.SimpleNamespace(gradient_accumulation_fusion=False)
        layer = FusedOutputLayer(linear, FusedCEConfig(enabled=True, memory_mode=mode))
        assert layer.fused_op_kwargs(linear.weight)["memory_mode"] == mode
        h = hidden.clone().requires_grad_()
        calls.clear()
        ce = layer(h)[0].cross_entropy(labels)
        ce.sum().backward()
        results[mode] = (ce, h.grad, linear.weight.grad, bool(calls))
    assert results["lean"][3] and not results["fast"][3]
    for fast, leaned in zip(results["fast"][:3], results["lean"][:3]):
        assert torch.allclose(fast, leaned, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", ["linear_ce_fusion_logits_dtype", "fused_linear_logprobs_logits_dtype"])
def test_logits_dtype_key(key):
    """null (default) or "float32" / "fp32" (one spelling kept); anything else names the key; an
    alias that says the same in another spelling agrees, one that says otherwise does not."""
    assert FusedCEConfig().logits_dtype is None and FusedCEConfig().op_logits_dtype() is None
    for value in ("float32", "fp32"):
        config = FusedCEConfig.from_megatron_cfg({key: value})
        assert config == FusedCEConfig(logits_dtype="float32") == FusedCEConfig(logits_dtype=torch.float32)
        assert config.op_logits_dtype() is torch.float32
    assert FusedCEConfig.from_megatron_cfg({key: None}).logits_dtype is None
    for bad in ("bf16", "float16", True, 32):
        with pytest.raises(ValueError, match=key):
            FusedCEConfig.from_megatron_cfg({key: bad})
    with pytest.raises(ValueError, match="logits_dtype"):
        FusedCEConfig(logits_dtype=torch.bfloat16)
    both = {"linear_ce_fusion_logits_dtype": "fp32", "fused_linear_logprobs_logits_dtype": "float32"}
    assert FusedCEConfig.from_megatron_cfg(both).logits_dtype == "float32"
    assert near_miss(key[:-1]) == key


def test_megatron_lm_flag_logits_dtype():
    import argparse

    from megatron_fused_ce.megatron import add_fused_ce_args

    def parse(*argv):
        return FusedCEConfig.from_megatron_cfg(vars(add_fused_ce_args(argparse.ArgumentParser()).parse_args(argv)))

    assert parse("--use-linear-ce-fusion-loss", "--linear-ce-fusion-logits-dtype", "float32").logits_dtype == "float32"
    assert parse("--use-linear-ce-fusion-loss").logits_dtype is None
    with pytest.raises(SystemExit):
        parse("--linear-ce-fusion-logits-dtype", "bfloat16")


def test_logits_dtype_reaches_the_op():
    """FusedCEConfig(logits_dtype="float32") in the fused output layer: bf16 inputs give the
    per-token cross-entropy at fp32 accuracy against float64 (bf16 logits: >10x further), and the
    greedy argmax (which takes no logits_dtype) still runs; without a dim it is refused (torch's
    argmax() of a tensor is the flat one, not the vocab's)."""
    import types

    from megatron_fused_ce.megatron.output_layer import FusedOutputLayer

    g = torch.Generator().manual_seed(4)
    hidden = (torch.randn(6, 2, 8, generator=g) * 2).bfloat16()
    weight = (torch.randn(40, 8, generator=g) / 2).bfloat16()
    labels = torch.randint(0, 40, (2, 6), generator=g)
    z = hidden.double().transpose(0, 1) @ weight.double().t()  # [b, s, V]
    ref = -torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    errors = {}
    for dtype in (None, "float32"):
        linear = torch.nn.Linear(8, 40, bias=False, dtype=torch.bfloat16)
        linear.weight = torch.nn.Parameter(weight.clone())
        linear.tp_group, linear.sequence_parallel = None, False
        linear.config = types.SimpleNamespace(gradient_accumulation_fusion=False)
        layer = FusedOutputLayer(linear, FusedCEConfig(enabled=True, logits_dtype=dtype))
        lazy = layer(hidden)[0]
        ce = lazy.cross_entropy(labels)
        errors[dtype] = ((ce.double() - ref).norm() / ref.norm()).item()
        assert lazy.argmax(-1).shape == (6, 2)
        with pytest.raises(RuntimeError, match="only over the vocab"):  # torch's no-dim argmax is flat
            lazy.argmax()
    assert errors["float32"] <= 1e-5 and errors[None] > 10 * errors["float32"], errors


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=os.path.basename)
def test_example_configs(path):
    sys.path.insert(0, EXAMPLES_DIR)
    try:
        from example_config import load_config
    finally:
        sys.path.remove(EXAMPLES_DIR)
    name = os.path.basename(path)[:-len(".yaml")]
    example = name[:-len("_gpu")] if name.endswith("_gpu") else name  # a larger GPU config of it
    cfg = load_config(example, path)
    assert FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"]).enabled


# ---------------------------------------------------------------- near-misses of the package's keys
@pytest.mark.parametrize("typo,intended", [
    ("use_linear_ce_fusion_los", "use_linear_ce_fusion_loss"),
    ("use_linear_ce_fusion", "use_linear_ce_fusion_loss"),
    ("use_linear_ce_fusion_loss_", "use_linear_ce_fusion_loss"),
    ("Use-Linear-CE-Fusion-Loss", "use_linear_ce_fusion_loss"),
    ("linear_ce_fusion_chunk", "linear_ce_fusion_chunk_size"),
    ("linear_ce_fusion_chunksize", "linear_ce_fusion_chunk_size"),
    ("linear_ce_chunk_size", "linear_ce_fusion_chunk_size"),
    ("use_fused_linear_logprob", "use_fused_linear_logprobs"),
    ("fused_linear_logprobs_chunk", "fused_linear_logprobs_chunk_size"),
])
def test_near_miss_raises_naming_key_and_intended(typo, intended):
    assert near_miss(typo) == intended
    for value in (True, 64):  # whatever the value: the typo alone would leave fusion off
        with pytest.raises(ValueError, match=f"'{typo}'.*did you mean '{intended}'"):
            FusedCEConfig.from_megatron_cfg({typo: value, "tensor_model_parallel_size": 2})


def test_megatron_keys_pass_through():
    """Every field of megatron-core's Transformer / DDP / optimizer configs, and NeMo-RL's own
    megatron_cfg keys, are not near-misses: a full megatron_cfg is read without complaint."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    keys = {f.name for c in (TransformerConfig, DistributedDataParallelConfig, OptimizerConfig)
            for f in dataclasses.fields(c)}
    keys |= {"enabled", "empty_unused_memory_level", "activation_checkpointing", "converter_type",
             "expert_tensor_parallel_size", "num_layers_in_first_pipeline_stage", "freeze_moe_router",
             "moe_router_dtype", "defer_fp32_logits", "apply_rope_fusion", "env_vars", "optimizer",
             "scheduler", "distributed_data_parallel_config", "cross_entropy_loss_fusion"}
    assert len(keys) > 200
    assert [k for k in keys if near_miss(k)] == []
    cfg = dict.fromkeys(keys, 1)
    cfg.update({"use_linear_ce_fusion_loss": True, "linear_ce_fusion_chunk_size": 32})
    assert FusedCEConfig.from_megatron_cfg(cfg) == FusedCEConfig(enabled=True, chunk_size=32)
    assert all(near_miss(k) is None for k in OWN_KEYS)


# ---------------------------------------------------------------- default chunk = the op's auto chunk
def default_chunk_worker(rank, world):
    from megatron_fused_ce.ops import api

    chosen = []
    auto = api.auto_chunk_size

    def recording_auto_chunk_size(*args, **kwargs):
        chosen.append(auto(*args, **kwargs))
        return chosen[-1]

    api.auto_chunk_size = recording_auto_chunk_size
    (model,) = common.build(Setup())
    batch = common.make_batches("sft", 1, seed=3)[0]
    out = {}
    for cfg in ({"use_linear_ce_fusion_loss": True},
                {"use_linear_ce_fusion_loss": True, "linear_ce_fusion_chunk_size": 8}):
        fused = FusedCEConfig.from_megatron_cfg(cfg)
        install_fused_output_layer(model, fused)
        post = LogprobsPostProcessor(fused, vocab_size=TRUE_VOCAB)
        chosen.clear()
        with torch.no_grad():
            lp = post(common.forward_fn(model, batch), model, batch["labels"]).logprobs
        out[fused.chunk_size] = (list(chosen), lp)
    return out, batch["labels"].numel()


def test_default_chunk_is_the_ops_automatic_chunk():
    (out, tokens), = run_workers(default_chunk_worker, 1)
    auto_chosen, auto_lp = out[None]
    explicit_chosen, explicit_lp = out[8]
    assert auto_chosen == [tokens]  # the op chose (on the CPU, all rows of this tiny batch at once)
    assert explicit_chosen == []  # an explicit size is used as given
    torch.testing.assert_close(auto_lp, explicit_lp, rtol=1e-5, atol=1e-5)


def test_memory_modes_match_the_ops():
    """The config, the Megatron-LM flag and the ops accept the same memory modes."""
    from megatron_fused_ce.megatron.config import MEMORY_MODES
    from megatron_fused_ce.ops.api import MEMORY_MODES as OP_MEMORY_MODES

    assert MEMORY_MODES == OP_MEMORY_MODES
