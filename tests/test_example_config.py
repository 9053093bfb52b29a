"""The examples' config loader (examples/example_config.py): YAML + overrides against a schema.

Every mistake of a newcomer's first hour raises a ValueError that names the section or key (and
the closest valid one) before any process starts: `train.lr=1e-3` is a float, `train.stepz=3`, a
misspelled `trian:` section, and a misspelled fusion flag in the YAML are rejected."""

from __future__ import annotations

import glob
import os
import re
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


# ---------------------------------------------------------------- every documented megatron_cfg key
ROOT = os.path.dirname(EXAMPLES_DIR)
# a fused-CE key as the docs spell it (backticked, in a YAML line or after `megatron_cfg.`)
_FUSED_KEY = re.compile(r"\b((?:use_)?(?:linear_ce_fusion|fused_linear_logprobs)[a-z_]*)")


def documented_megatron_cfg_keys():
    """The megatron_cfg keys the README and the docs pages document, with FusedCEConfig's keys and
    aliases (config.OWN_KEYS); their examples of typos (near-misses of a real key) left out."""
    from megatron_fused_ce.megatron.config import OWN_KEYS, near_miss

    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    text = "\n".join(open(page).read() for page in pages)
    found = set(_FUSED_KEY.findall(text)) | set(re.findall(r"megatron_cfg\.([a-z_]+)", text))
    keys = {key for key in found if near_miss(key) is None} | set(OWN_KEYS)
    assert {"linear_ce_fusion_max_chunk_bytes", "use_fused_linear_logprobs"} <= keys  # the parse works
    return sorted(keys)


_VALUES = (("_max_chunk_bytes", 1 << 20), ("_chunk_size", 32), ("_memory_mode", "lean"),
           ("_logits_dtype", "float32"), ("_loss", True), ("_logprobs", True))


def _valid_value(key):
    """A value FusedCEConfig accepts for one of its keys (None: not one of its keys)."""
    for suffix, value in _VALUES:
        if key.endswith(suffix):
            return value
    return None


def _same_setting(key):
    """The keys of the setting `key` names (canonical and alias), `key` first."""
    from megatron_fused_ce.megatron.config import OWN_KEYS

    suffix = next(suffix for suffix, _ in _VALUES if key.endswith(suffix))
    group = [k for k in OWN_KEYS if next(s for s, _ in _VALUES if k.endswith(s)) == suffix]
    return [key] + [k for k in group if k != key]


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_documented_megatron_cfg_key_is_accepted_and_listed(example):
    """What the README documents, every example reads: set from the command line, passed to
    FusedCEConfig, and named in --help."""
    import example_common
    from megatron_fused_ce.megatron import FusedCEConfig
    from megatron_fused_ce.megatron.config import OWN_KEYS

    help_text = " ".join(example_common.build_parser(example, "doc").format_help().split())
    listed = help_text.split("megatron_cfg:")[1].split(" data:")[0]
    for key in documented_megatron_cfg_keys():
        assert re.search(rf"\b{key}\b", listed), f"--help of {example} does not list megatron_cfg.{key}"
        value = _valid_value(key)
        if value is None:  # one of the examples' own Megatron settings
            assert key in schema_for(example)["megatron_cfg"], key
            continue
        assert key in OWN_KEYS, f"the README documents megatron_cfg.{key}, FusedCEConfig does not read it"
        # the example's YAML may set the other spelling of the same setting: cleared here
        others = [f"megatron_cfg.{other}=null" for other in _same_setting(key)[1:]]
        cfg = load_config(example, config_path(example), overrides=[f"megatron_cfg.{key}={value}"] + others)
        assert cfg["megatron_cfg"][key] == value
        FusedCEConfig.from_megatron_cfg({key: value})  # a value the library takes


def test_max_chunk_bytes_reaches_fused_ce_config():
    from megatron_fused_ce.megatron import FusedCEConfig

    for key in ("linear_ce_fusion_max_chunk_bytes", "fused_linear_logprobs_max_chunk_bytes"):
        cfg = load_config("pretrain_gpt", config_path("pretrain_gpt"),
                          overrides=[f"megatron_cfg.{key}=1048576",
                                     "megatron_cfg.linear_ce_fusion_chunk_size=null"])
        fused = FusedCEConfig.from_megatron_cfg(cfg["megatron_cfg"])  # what build_model does with it
        assert fused.max_chunk_bytes == 1048576 and fused.chunk_size is None
        with pytest.raises(ValueError, match=rf"megatron_cfg\.{key} must be > 0"):
            load_config("pretrain_gpt", config_path("pretrain_gpt"), overrides=[f"megatron_cfg.{key}=0"])
    sft = load_config("sft", config_path("sft"))
    assert FusedCEConfig.from_megatron_cfg(sft["megatron_cfg"]).max_chunk_bytes is None


# ---------------------------------------------------------------- the rollouts' sampler settings
@pytest.mark.parametrize("overrides,expected", [
    (["sampling.top_k=0"], dict(top_k=None)),  # vLLM's "off" spellings
    (["sampling.top_k=-1"], dict(top_k=None)),
    (["sampling.top_k=50", "sampling.min_p=1.0", "sampling.top_p=1"], dict(top_k=50, min_p=1.0, top_p=1.0)),
    (["sampling.min_p=0"], dict(min_p=0.0)),
])
def test_sampler_settings_as_the_engine_reads_them(overrides, expected):
    sampling = load_config("grpo", config_path("grpo"), overrides=overrides)["sampling"]
    assert {k: sampling[k] for k in expected} == expected


@pytest.mark.parametrize("override,message", [
    ("sampling.top_k=-2", r"sampling\.top_k must be None, 0 or -1 \(off\), or an integer >= 1, got -2"),
    ("sampling.top_k=2.5", r"sampling\.top_k must be an integer"),
    ("sampling.min_p=1.5", r"sampling\.min_p must be None or a number in \[0, 1\], got 1\.5"),
    ("sampling.min_p=-0.1", r"sampling\.min_p must be None or a number in \[0, 1\]"),
    ("sampling.min_p=.nan", r"sampling\.min_p must be None or a number in \[0, 1\], got nan"),
    ("sampling.top_p=0", r"sampling\.top_p must be None or a number in \(0, 1\]"),
    ("sampling.top_p=1.5", r"sampling\.top_p must be None or a number in \(0, 1\]"),
])
def test_sampler_settings_no_engine_accepts_are_rejected(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("grpo", config_path("grpo"), overrides=[override])


# ---------------------------------------------------------------- the RL examples' shared model
@pytest.mark.parametrize("suffix", ["", "_gpu"])
def test_rl_examples_share_one_model(suffix):
    """sft, dpo and grpo read their model, sequence layout, task and sampler from one file
    (configs/rl_model{suffix}.yaml), so that a checkpoint of one loads into the others with their
    defaults: what --load compares is the same for the three."""
    from example_checkpoint import model_identity

    cfgs = {name: load_config(name, config_path(name + suffix)) for name in ("sft", "dpo", "grpo")}
    for name, cfg in cfgs.items():
        assert model_identity(cfg) == model_identity(cfgs["sft"]), name
        assert cfg["data"]["prompt_length"] == cfgs["sft"]["data"]["prompt_length"], name
        assert cfg["rollout"]["task"] == cfgs["sft"]["rollout"]["task"] == "count", name
        sampler = {k: cfg["sampling"][k] for k in ("top_k", "top_p", "min_p")}
        assert sampler == {k: cfgs["sft"]["sampling"][k] for k in ("top_k", "top_p", "min_p")}, name
        assert cfg["rollout"]["temperature"] == cfgs["sft"]["rollout"]["temperature"], name
    assert cfgs["sft"]["train"]["stop_at_reward"] is not None  # SFT kept partial for RL


def test_rl_gpu_configs_are_of_the_promised_scale():
    """>= 100M parameters, a vocab of >= 32k tokens, sequences of >= 128 tokens."""
    from example_checkpoint import model_identity

    cfg = load_config("grpo", config_path("grpo_gpu"))
    m = model_identity(cfg)
    h, layers = m["model.hidden_size"], m["model.num_layers"]
    per_layer = 4 * h * h + 2 * h * m["model.ffn_hidden_size"]  # attention + MLP weights
    params = m["model.vocab_size"] * h + layers * per_layer + m["data.seq_length"] * h
    assert params >= 100e6 and m["model.vocab_size"] >= 32000 and m["data.seq_length"] >= 128
    assert cfg["megatron_cfg"]["dtype"] == "bfloat16"


def test_include(tmp_path):
    """A file's `include:` names files (relative to it) whose sections it extends: its own keys win,
    the included file's others stay; a mistake in the included file names that file."""
    (tmp_path / "base.yaml").write_text(MINIMAL)
    path = write(tmp_path, "include: base.yaml\ntrain: {steps: 7}\nmodel: {hidden_size: 64}\n")
    cfg = load_config("pretrain_gpt", path)
    assert cfg["train"]["steps"] == 7 and cfg["train"]["global_batch_size"] == 4
    assert cfg["model"]["hidden_size"] == 64 and cfg["model"]["num_layers"] == 2
    (tmp_path / "base.yaml").write_text(MINIMAL.replace("steps: 3", "stepz: 3"))
    with pytest.raises(ValueError, match=r"unknown key 'train\.stepz' in .*base\.yaml"):
        load_config("pretrain_gpt", path)
    (tmp_path / "base.yaml").write_text("include: cfg.yaml\n")
    with pytest.raises(ValueError, match=r"base\.yaml includes cfg\.yaml, which includes .*base\.yaml \(a cycle\)"):
        load_config("pretrain_gpt", path)
    with pytest.raises(OSError, match=r"nowhere\.yaml"):
        load_config("pretrain_gpt", write(tmp_path, "include: nowhere.yaml\n"))
