"""The examples' config loader (examples/example_config.py): YAML + overrides against a schema.

Every mistake of a newcomer's first hour raises a ValueError that names the section or key (and
the closest valid one) before any process starts: `train.lr=1e-3` is a float, `train.stepz=3`, a
misspelled `trian:` section, and a misspelled fusion flag in the YAML are rejected."""

from __future__ import annotations

import os
import sys

import pytest

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.append(EXAMPLES_DIR)  # appended: shadows nothing

from example_config import load_config, parse_value, parse_yaml, schema_for  # noqa: E402

EXAMPLES = ("pretrain_gpt", "sft", "dpo", "grpo")


def config_path(example):
    return os.path.join(EXAMPLES_DIR, "configs", f"{example}.yaml")


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


MINIMAL = """
model: {num_layers: 2, hidden_size: 32, num_attention_heads: 4, vocab_size: 100}
data: {seq_length: 16}
train: {steps: 3, global_batch_size: 4, micro_batch_size: 2, lr: 1e-3}
megatron_cfg: {use_linear_ce_fusion_loss: true}
"""


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_configs_load(example):
    cfg = load_config(example, config_path(example))
    assert set(cfg) == set(schema_for(example))
    assert isinstance(cfg["train"]["lr"], float)
    assert cfg["megatron_cfg"]["use_linear_ce_fusion_loss"] or cfg["megatron_cfg"]["use_fused_linear_logprobs"]


def test_exponent_numbers_are_floats():
    # PyYAML (YAML 1.1) reads these as strings; AdamW then fails with "'<=' not supported"
    for text, value in (("1e-3", 1e-3), ("5E4", 5e4), ("-2.5e-1", -0.25), ("1.0e-3", 1e-3), (".5e1", 5.0)):
        assert parse_value(text) == value and isinstance(parse_value(text), float), text
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("true") is True and parse_value("false") is False
    assert parse_value("[2,4]") == [2, 4]
    assert parse_value("sigmoid") == "sigmoid"
    assert parse_yaml("lr: 1e-3") == {"lr": 1e-3}
    cfg = load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=["train.lr=1e-3"])
    assert cfg["train"]["lr"] == 1e-3


def test_defaults_filled_and_ints_accepted_as_floats(tmp_path):
    cfg = load_config("pretrain_gpt", write(tmp_path, MINIMAL), overrides=["train.lr=1"])
    assert cfg["train"]["lr"] == 1.0 and isinstance(cfg["train"]["lr"], float)
    assert cfg["train"]["seed"] == 1234
    assert cfg["megatron_cfg"]["tensor_model_parallel_size"] == 1
    assert cfg["megatron_cfg"]["linear_ce_fusion_chunk_size"] is None  # the op's automatic chunk
    assert cfg["model"]["tie_embeddings"] is True


@pytest.mark.parametrize("override,message", [
    ("train.stepz=3", r"unknown key 'train\.stepz' \(override 'train\.stepz=3'\); did you mean 'train\.steps'\?"),
    ("trian.steps=3", r"unknown section 'trian'.*did you mean 'train'\?"),
    ("megatron_cfg.use_linear_ce_fusion_los=true",
     r"'megatron_cfg\.use_linear_ce_fusion_los'.*did you mean 'megatron_cfg\.use_linear_ce_fusion_loss'\?"),
    ("train.lr=fast", r"train\.lr must be a number, got 'fast' \(str\)"),
    ("train.steps=2.5", r"train\.steps must be an integer, got 2\.5"),
    ("train.steps=0", r"train\.steps must be > 0"),
    ("megatron_cfg.use_linear_ce_fusion_loss=1", r"megatron_cfg\.use_linear_ce_fusion_loss must be true or false"),
    ("megatron_cfg.dtype=fp16", r"megatron_cfg\.dtype must be one of float32, bfloat16"),
    ("train=3", r"'train' .* names a section, not a key"),
    ("train.lr", r"is not KEY=VALUE"),
    ("model.vocab_size.x=3", r"unknown key 'model\.vocab_size\.x'"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=[override])


@pytest.mark.parametrize("edit,message", [
    (("train:", "trian:"), r"unknown section 'trian' in .*cfg\.yaml; did you mean 'train'\?"),
    (("use_linear_ce_fusion_loss:", "use_linear_ce_fusion_los:"),
     r"unknown key 'megatron_cfg\.use_linear_ce_fusion_los' in .*; "
     r"did you mean 'megatron_cfg\.use_linear_ce_fusion_loss'\?"),
    (("steps: 3", "stepz: 3"), r"unknown key 'train\.stepz'.*did you mean 'train\.steps'\?"),
    (("lr: 1e-3", "lr: 1e-3x"), r"train\.lr must be a number, got '1e-3x'"),
    (("steps: 3, ", ""), r"missing key 'train\.steps'"),
])
def test_yaml_mistakes_name_the_key(tmp_path, edit, message):
    text = MINIMAL.replace(*edit)
    assert text != MINIMAL
    with pytest.raises(ValueError, match=message):
        load_config("pretrain_gpt", write(tmp_path, text))


def test_fusion_flag_cannot_be_silently_lost(tmp_path):
    """A misspelled flag used to leave fusion off without a word."""
    text = MINIMAL.replace("use_linear_ce_fusion_loss", "use_linear_ce_fusion_los")
    with pytest.raises(ValueError, match="use_linear_ce_fusion_loss"):
        load_config("pretrain_gpt", write(tmp_path, text))
    cfg = load_config("pretrain_gpt", write(tmp_path, MINIMAL))
    assert cfg["megatron_cfg"]["use_linear_ce_fusion_loss"] is True


def test_section_of_another_example_is_rejected():
    with pytest.raises(ValueError, match=r"unknown section 'grpo'"):
        load_config("sft", config_path("sft"), overrides=["grpo.beta=0.1"])
    with pytest.raises(ValueError, match=r"unknown key 'train\.global_batch_size'"):
        load_config("grpo", config_path("grpo"), overrides=["train.global_batch_size=8"])


def test_grpo_and_dpo_values_are_checked_at_load():
    with pytest.raises(ValueError, match=r"grpo: .*loss_type"):
        load_config("grpo", config_path("grpo"), overrides=["grpo.loss_type=ppo"])
    with pytest.raises(ValueError, match=r"grpo\.epsilon_low must be a number"):
        load_config("grpo", config_path("grpo"), overrides=["grpo.epsilon_low=[1]"])
    cfg = load_config("grpo", config_path("grpo"), overrides=["grpo.beta=0", "grpo.kl_output_clamp=null"])
    assert cfg["grpo"]["beta"] == 0.0 and cfg["grpo"]["kl_output_clamp"] is None
    with pytest.raises(ValueError, match=r"dpo\.loss_type must be one of sigmoid, ipo, hinge"):
        load_config("dpo", config_path("dpo"), overrides=["dpo.loss_type=logistic"])
    with pytest.raises(ValueError, match=r"micro_batch_size must be even"):
        load_config("dpo", config_path("dpo"), overrides=["train.micro_batch_size=1", "train.global_batch_size=3"])


def test_combinations_are_checked():
    with pytest.raises(ValueError, match=r"sequence_parallel needs a norm"):
        load_config("pretrain_gpt", config_path("pretrain_gpt"),
                    settings=[("megatron_cfg.tensor_model_parallel_size", 2)],
                    overrides=["megatron_cfg.sequence_parallel=true"])
    with pytest.raises(ValueError, match=r"global_batch_size \(15\) must be a multiple"):
        load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=["train.global_batch_size=15"])
    with pytest.raises(ValueError, match=r"both set and disagree"):
        load_config("sft", config_path("sft"), overrides=["megatron_cfg.use_linear_ce_fusion_loss=false"])


def test_settings_from_flags():
    cfg = load_config("sft", config_path("sft"), settings=[("megatron_cfg.tensor_model_parallel_size", 2),
                                                           ("train.steps", 5)])
    assert cfg["megatron_cfg"]["tensor_model_parallel_size"] == 2 and cfg["train"]["steps"] == 5


FUSED_CE_KEYS = {  # the newer from_megatron_cfg keys: FusedCEConfig field, {valid value: field value}
    "linear_ce_fusion_memory_mode": ("memory_mode", {"lean": "lean", "fast": "fast"}),
    "fused_linear_logprobs_memory_mode": ("memory_mode", {"lean": "lean", "fast": "fast"}),
    "linear_ce_fusion_logits_dtype": ("logits_dtype", {"float32": "float32", "fp32": "float32"}),
    "fused_linear_logprobs_logits_dtype": ("logits_dtype", {"float32": "float32", "fp32": "float32"}),
}


@pytest.mark.parametrize("key", FUSED_CE_KEYS)
def test_memory_mode_and_logits_dtype_reach_fused_ce_config(key):
    """`megatron_cfg.linear_ce_fusion_memory_mode=lean` & co. are example keys, passed through."""
    from megatron_fused_ce.megatron import FusedCEConfig

    field, expected = FUSED_CE_KEYS[key]
    for value in expected:
        cfg = load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=[f"megatron_cfg.{key}={value}"])
        assert cfg["megatron_cfg"][key] == value
        fused = FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"])  # what build_model does with it
        assert getattr(fused, field) == expected[value]
        assert fused.enabled and fused.chunk_size == 64  # the YAML's other switches kept
    cfg = load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=[f"megatron_cfg.{key}=null"])
    assert cfg["megatron_cfg"][key] is None
    assert getattr(FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"]), field) == getattr(FusedCEConfig(), field)


def test_lean_fp32_in_yaml(tmp_path):
    from megatron_fused_ce.megatron import FusedCEConfig

    text = MINIMAL.replace("{use_linear_ce_fusion_loss: true}", "{use_linear_ce_fusion_loss: true, "
                           "linear_ce_fusion_memory_mode: lean, fused_linear_logprobs_logits_dtype: fp32}")
    cfg = load_config("pretrain_gpt", write(tmp_path, text))
    fused = FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"])
    assert fused.memory_mode == "lean" and fused.logits_dtype == "float32"
    assert str(fused.op_logits_dtype()) == "torch.float32"  # the ops' argument


@pytest.mark.parametrize("override,message", [
    ("megatron_cfg.linear_ce_fusion_memory_mode=leen",
     r"megatron_cfg\.linear_ce_fusion_memory_mode must be one of fast, lean; got 'leen'"),
    ("megatron_cfg.fused_linear_logprobs_memory_mode=Lean",
     r"megatron_cfg\.fused_linear_logprobs_memory_mode must be one of fast, lean"),
    ("megatron_cfg.linear_ce_fusion_logits_dtype=bfloat16",
     r"megatron_cfg\.linear_ce_fusion_logits_dtype must be one of float32, fp32; got 'bfloat16'"),
    ("megatron_cfg.fused_linear_logprobs_logits_dtype=true",
     r"megatron_cfg\.fused_linear_logprobs_logits_dtype must be a string, got True"),
    ("megatron_cfg.linear_ce_fusion_memory_mod=lean",
     r"unknown key 'megatron_cfg\.linear_ce_fusion_memory_mod'.*"
     r"did you mean 'megatron_cfg\.linear_ce_fusion_memory_mode'\?"),
])
def test_bad_memory_mode_or_logits_dtype_names_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=[override])


def test_memory_mode_aliases_must_agree():
    with pytest.raises(ValueError, match=r"both set and disagree"):
        load_config("pretrain_gpt", config_path("pretrain_gpt"),
                    overrides=["megatron_cfg.linear_ce_fusion_memory_mode=lean",
                               "megatron_cfg.fused_linear_logprobs_memory_mode=fast"])
    cfg = load_config("pretrain_gpt", config_path("pretrain_gpt"),  # two spellings of fp32 agree
                      overrides=["megatron_cfg.linear_ce_fusion_logits_dtype=float32",
                                 "megatron_cfg.fused_linear_logprobs_logits_dtype=fp32"])
    assert cfg["megatron_cfg"]["fused_linear_logprobs_logits_dtype"] == "fp32"


@pytest.mark.parametrize("example", EXAMPLES)
def test_memory_mode_and_logits_dtype_default_to_fused_ce_defaults(tmp_path, example):
    from megatron_fused_ce.megatron import FusedCEConfig

    for cfg in (load_config(example, config_path(example)),
                load_config("pretrain_gpt", write(tmp_path, MINIMAL))):
        assert all(cfg["megatron_cfg"][key] is None for key in FUSED_CE_KEYS)
        fused = FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"])
        assert fused.memory_mode == FusedCEConfig().memory_mode == "fast"
        assert fused.logits_dtype is FusedCEConfig().logits_dtype is None


def test_run_header_names_memory_mode_and_logits_dtype(monkeypatch):
    """The header line of a run says which fused path the YAML chose (lean tiles, fp32 logits)."""
    import example_common
    from megatron_fused_ce.megatron import FusedCEConfig

    class OneRank:
        def __getattr__(self, name):  # get_*_world_size
            return lambda: 1

    monkeypatch.setattr(example_common.dist, "get_world_size", lambda: 1)
    cfg = load_config("pretrain_gpt", config_path("pretrain_gpt"))

    def header(*overrides):
        mcfg = load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=list(overrides))["megatron_cfg"]
        return example_common.describe("pretrain", cfg, FusedCEConfig.from_megatron_cfg(mcfg), OneRank())

    assert header().endswith("fused linear CE: on (chunk 64)")
    assert header("megatron_cfg.linear_ce_fusion_memory_mode=lean").endswith("fused linear CE: on (lean tiles)")
    assert header("megatron_cfg.linear_ce_fusion_logits_dtype=fp32").endswith(
        "fused linear CE: on (chunk 64, float32 logits)")
