"""FusedCEConfig.from_megatron_cfg: the keys NeMo-RL users write, their aliases, and bad input."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import yaml

from megatron_fused_ce.megatron import FusedCEConfig

EXAMPLE_CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples",
                                                "configs", "*.yaml")))


def test_defaults():
    assert FusedCEConfig() == FusedCEConfig(enabled=False, chunk_size=256)
    assert FusedCEConfig.from_megatron_cfg({}) == FusedCEConfig()
    assert FusedCEConfig.from_megatron_cfg(None) == FusedCEConfig()


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


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=os.path.basename)
def test_example_configs(path):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    assert FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"]).enabled
