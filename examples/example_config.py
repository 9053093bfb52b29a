"""The examples' configuration: YAML file -> command-line overrides -> checked against a schema.

Every section and key an example reads is listed in its schema (below), with its type and
default. A section or key that is not there, a value of the wrong type, or a missing required key
raises `ValueError` naming it (`train.stepz`: "did you mean 'train.steps'?"), before any process
group is created: a typo never silently falls back to a default. A file may build on others
(`include: rl_model.yaml`: the model the SFT, DPO and GRPO examples share; see `_read`). Values are read with YAML
semantics, except that `1e-3` and the like are floats (YAML 1.1, PyYAML's dialect, reads them as
strings).

`megatron_cfg` is checked like the other sections: it holds the Megatron settings these examples
act on (parallel sizes, dtype, layer implementation) and the fused-CE switches of
`FusedCEConfig.from_megatron_cfg`. (A real training job passes many more Megatron keys through
`megatron_cfg`; `FusedCEConfig.from_megatron_cfg` ignores those and only rejects near-misses of its
own keys. These small examples would silently ignore any key they do not read, so they reject it.)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import numbers
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Tuple

REQUIRED = object()  # default of a key that the YAML file (or an override) must set


@dataclass(frozen=True)
class Key:
    """One config key: its kind (`int`, `float`, `bool`, `str`, `int_range`), default, choices."""

    kind: str
    default: Any = REQUIRED
    choices: Tuple = ()
    nullable: bool = False
    positive: bool = False

    def check(self, name: str, value) -> Any:
        """The value converted to its kind (an int where a float is expected), or ValueError."""
        if value is None:
            if self.nullable:
                return None
            raise ValueError(f"{name} must not be null")
        if self.kind == "bool":
            ok = isinstance(value, bool)
            expected = "true or false"
        elif self.kind == "int":
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            expected = "an integer"
        elif self.kind == "float":
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            expected = "a number"
            value = float(value) if ok else value
        elif self.kind == "str":
            ok = isinstance(value, str)
            expected = "a string"
        elif self.kind == "int_range":
            ok = (isinstance(value, list) and len(value) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                  and 0 < value[0] <= value[1])
            expected = "[min, max] with 0 < min <= max"
        else:
            raise AssertionError(self.kind)
        if not ok:
            raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
        if self.choices and value not in self.choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, self.choices))}; got {value!r}")
        if self.positive and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
        return value


def Int(default=REQUIRED, **kw) -> Key:
    return Key("int", default, positive=kw.pop("positive", True), **kw)


def Float(default=REQUIRED, **kw) -> Key:
    return Key("float", default, **kw)


def Bool(default=REQUIRED) -> Key:
    return Key("bool", default)


def Choice(*choices, default=REQUIRED) -> Key:
    return Key("str", default, choices=choices)


Schema = Dict[str, Dict[str, Key]]

# ------------------------------------------------------------------------------------------------
# The schemas: what each example reads.
# ------------------------------------------------------------------------------------------------
MODEL = {
    "num_layers": Int(), "hidden_size": Int(), "num_attention_heads": Int(),
    "ffn_hidden_size": Int(None, nullable=True),
    "vocab_size": Int(), "make_vocab_size_divisible_by": Int(128), "tie_embeddings": Bool(True),
}
MEGATRON_CFG = {
    "tensor_model_parallel_size": Int(1), "pipeline_model_parallel_size": Int(1),
    "context_parallel_size": Int(1), "sequence_parallel": Bool(False),
    "transformer_impl": Choice("local", "transformer_engine", default="local"),
    "dtype": Choice("float32", "bfloat16", default="float32"),
    # FusedCEConfig.from_megatron_cfg's keys (canonical and NeMo-RL's newer aliases); null = default
    "use_linear_ce_fusion_loss": Key("bool", None, nullable=True),
    "linear_ce_fusion_chunk_size": Int(None, nullable=True),
    "use_fused_linear_logprobs": Key("bool", None, nullable=True),
    "fused_linear_logprobs_chunk_size": Int(None, nullable=True),
    # the values from_megatron_cfg accepts, so a typo names the key here: null = "fast" (chunks)
    "linear_ce_fusion_memory_mode": Key("str", None, choices=("fast", "lean"), nullable=True),
    "fused_linear_logprobs_memory_mode": Key("str", None, choices=("fast", "lean"), nullable=True),
    # null = logits in the input dtype; "float32" / "fp32" (one setting) keep the GEMM's fp32 output
    "linear_ce_fusion_logits_dtype": Key("str", None, choices=("float32", "fp32"), nullable=True),
    "fused_linear_logprobs_logits_dtype": Key("str", None, choices=("float32", "fp32"), nullable=True),
    # null = the op's bound on one chunk of logits (1 GiB) when no chunk size is set
    "linear_ce_fusion_max_chunk_bytes": Int(None, nullable=True),
    "fused_linear_logprobs_max_chunk_bytes": Int(None, nullable=True),
}
TRAIN = {"steps": Int(), "global_batch_size": Int(), "micro_batch_size": Int(),
         "lr": Float(positive=True), "seed": Int(1234, positive=False)}


def _grpo_section() -> Dict[str, Key]:
    """Every field of `GRPOConfig`, typed from its annotations (its own checks run at load)."""
    from megatron_fused_ce.losses import GRPOConfig

    hints = typing.get_type_hints(GRPOConfig)
    section = {}
    for field in dataclasses.fields(GRPOConfig):
        hint = hints[field.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if args else hint
        kind = {bool: "bool", int: "int", float: "float", str: "str"}[base]
        section[field.name] = Key(kind, field.default, nullable=bool(args))
    return section


def _dpo_section() -> Dict[str, Key]:
    from megatron_fused_ce.losses.dpo import DPO_LOSS_TYPES

    return {"beta": Float(0.1, positive=True), "loss_type": Choice(*DPO_LOSS_TYPES, default="sigmoid"),
            "label_smoothing": Float(0.0), "average_log_probs": Bool(False),
            "sft_weight": Float(0.0), "preference_weight": Float(1.0)}


def schema_for(example: str) -> Schema:
    """The sections and keys that `examples/<example>.py` reads."""
    common = {"model": dict(MODEL), "megatron_cfg": dict(MEGATRON_CFG)}
    if example == "pretrain_gpt":
        return {**common, "data": {"seq_length": Int()}, "train": dict(TRAIN)}
    if example in ("sft", "dpo"):
        # the task, sampler and sequence layout of the GRPO rollouts (configs/rl_model.yaml), so
        # that an SFT or DPO policy is evaluated (and DPO's pairs are sampled) as GRPO samples
        grpo = schema_for("grpo")
        rollout = {k: grpo["rollout"][k] for k in ("task", "temperature")}
        sampling = {k: v for k, v in grpo["sampling"].items() if k not in ("fidelity", "replay")}
        data = {"seq_length": Int(), "prompt_length": Int()}
        train = dict(TRAIN)
        if example == "sft":
            # pack: several shorter demonstrations per row (cu_seqlens; THD under CP)
            data["pack"] = Bool(False)
            # stop after the first evaluation whose reward reaches it (a partial policy for RL)
            train["stop_at_reward"] = Float(None, nullable=True)
        else:  # the samples that the preference pairs are drawn from
            rollout.update(num_prompts=Int(), samples_per_prompt=Int())
        sections = {**common, "data": data, "train": train, "rollout": rollout,
                    "sampling": sampling,
                    # every `every` steps (and after the last) the policy answers `num_prompts`
                    # held-out prompts with the sampler: `reward` and `accuracy` of the log
                    "eval": {"every": Int(10), "num_prompts": Int(64)}}
        if example == "dpo":
            sections["dpo"] = _dpo_section()
        return sections
    if example == "grpo":
        train = {k: v for k, v in TRAIN.items() if k != "global_batch_size"}
        train["updates_per_rollout"] = Int(1)
        rollout = {"num_prompts": Int(), "samples_per_prompt": Int(),
                   "temperature": Float(1.0, positive=True), "engine_logprob_noise": Float(0.0),
                   "task": Choice("count", "copy", "reverse", default="count"),
                   # where the old policy's log-probs come from: the sampler's record (no pass)
                   # or a forward-only pass of the trainer
                   "old_logprobs": Choice("sampler", "trainer", default="sampler")}
        # the rollouts' sampler (vLLM semantics and ranges, checked by `_check_sampling`;
        # defaults = off); fidelity: the trainer's log-probs are of the same distribution
        # (LogprobsPostProcessor top_k / top_p / min_p); replay: of the kept sets the sampler
        # reported (sampling_mask), instead of the filters recomputed on the trainer's logits
        sampling = {"top_k": Key("int", None, nullable=True), "top_p": Float(1.0), "min_p": Float(0.0),
                    "fidelity": Bool(True), "replay": Bool(False)}
        return {**common, "data": {"seq_length": Int(), "prompt_length": Int()}, "train": train,
                "rollout": rollout, "sampling": sampling, "grpo": _grpo_section()}
    raise ValueError(f"no config schema for example {example!r}")


# ------------------------------------------------------------------------------------------------
# YAML with `1e-3` as a float.
# ------------------------------------------------------------------------------------------------
_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)$")


def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML's safe loader (YAML 1.1) that also reads `1e-3`, `5E4` as floats (YAML 1.2)."""

    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Loader


def parse_yaml(text: str):
    import yaml

    return yaml.load(text, Loader=_loader())


def parse_value(text: str):
    """A command-line value, read as YAML: `1e-3` -> 0.001, `true` -> True, `[2,4]` -> [2, 4]."""
    return parse_yaml(text) if text.strip() else ""


# ------------------------------------------------------------------------------------------------
# Loading and checking.
# ------------------------------------------------------------------------------------------------
def load_config(example: str, path: str, settings: Iterable[Tuple[str, Any]] = (),
                overrides: Iterable[str] = ()) -> dict:
    """Read `path`, apply `settings` ((dotted key, value) from flags such as --tp) and `overrides`
    (`a.b=value` strings), check everything against `schema_for(example)` and fill the defaults.
    Raises ValueError naming the offending section, key or override."""
    schema = schema_for(example)
    cfg = _read(path, schema)
    for dotted, value in settings:
        _set(cfg, schema, dotted, value, "")
    for item in overrides:
        dotted, sep, text = item.partition("=")
        if not sep or not dotted:
            raise ValueError(f"override {item!r} is not KEY=VALUE (e.g. train.lr=1e-3)")
        _set(cfg, schema, dotted.strip(), parse_value(text), f" (override {item!r})")
    return _complete(cfg, schema, path)


INCLUDE = "include"


def _read(path: str, schema: Schema, including: Tuple[str, ...] = ()) -> dict:
    """The sections of `path`, on top of those of the files its `include:` names (one file or a
    list, relative to `path`; later ones win): a key set here replaces the included one, the
    included file's other keys stay. The RL examples share their model this way."""
    with open(path) as f:
        cfg = parse_yaml(f.read())
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected sections (model:, train:, ...), got {type(cfg).__name__}")
    names = cfg.pop(INCLUDE, None)
    names = [names] if isinstance(names, str) else names or []
    _check_names(cfg, schema, f"in {path}")
    merged: dict = {}
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{INCLUDE} in {path} must name YAML files, got {name!r}")
        base = os.path.join(os.path.dirname(path), name)
        if os.path.abspath(base) in including + (os.path.abspath(path),):
            raise ValueError(f"{path} includes {name}, which includes {path} (a cycle)")
        _merge(merged, _read(base, schema, including + (os.path.abspath(path),)))
    _merge(merged, copy.deepcopy(cfg))
    return merged


def _merge(into: dict, cfg: dict) -> None:
    for section, keys in cfg.items():
        if keys is None:  # an empty section adds nothing
            into.setdefault(section, None)
        else:
            into[section] = {**(into.get(section) or {}), **keys}


def _suggest(name: str, valid: Iterable[str]) -> str:
    """'did you mean ...?' for the closest valid name (difflib), else the list of valid names."""
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(valid)}"


def _check_names(cfg: dict, schema: Schema, where: str) -> None:
    for section, keys in cfg.items():
        if section not in schema:
            raise ValueError(f"unknown section {section!r} {where}; {_suggest(str(section), schema)}")
        if keys is None:
            continue
        if not isinstance(keys, dict):
            raise ValueError(f"section {section!r} {where} must hold key: value lines, got {keys!r}")
        for key in keys:
            if key not in schema[section]:
                full = [f"{section}.{k}" for k in schema[section]]
                raise ValueError(f"unknown key '{section}.{key}' {where}; {_suggest(f'{section}.{key}', full)}")


def _set(cfg: dict, schema: Schema, dotted: str, value, where: str) -> None:
    parts = dotted.split(".")
    section = parts[0]
    if section not in schema:
        raise ValueError(f"unknown section {section!r}{where}; {_suggest(section, schema)}")
    if len(parts) == 1:
        raise ValueError(f"{dotted!r}{where} names a section, not a key: use {section}.KEY=VALUE")
    key = ".".join(parts[1:])
    if key not in schema[section]:
        full = [f"{section}.{k}" for k in schema[section]]
        raise ValueError(f"unknown key {dotted!r}{where}; {_suggest(dotted, full)}")
    if cfg.get(section) is None:
        cfg[section] = {}
    cfg[section][key] = value


def _complete(cfg: dict, schema: Schema, path: str) -> dict:
    """Type-check every value and fill the defaults; GRPOConfig checks its own field values."""
    out = {}
    for section, keys in schema.items():
        given = cfg.get(section) or {}
        out[section] = {}
        for key, spec in keys.items():
            name = f"{section}.{key}"
            if key in given:
                out[section][key] = spec.check(name, given[key])
            elif spec.default is REQUIRED:
                raise ValueError(f"missing key {name!r}: set it in {path} or with {name}=VALUE")
            else:
                out[section][key] = copy.deepcopy(spec.default)
    _check_combinations(out)
    if "sampling" in out:
        _check_sampling(out)
        _check_replay(out)
    if "grpo" in out:
        from megatron_fused_ce.losses import GRPOConfig

        try:
            GRPOConfig(**out["grpo"])
        except ValueError as err:
            raise ValueError(f"grpo: {err}") from None
    from megatron_fused_ce.megatron import FusedCEConfig

    try:
        FusedCEConfig.from_megatron_cfg(out["megatron_cfg"])
    except ValueError as err:
        raise ValueError(f"megatron_cfg: {err}") from None
    return out


def _check_sampling(cfg: dict) -> None:
    """The sampler settings in the ranges vLLM's SamplingParams accepts (the op's own check):
    top_k null, 0 or -1 (off) or >= 1; top_p in (0, 1]; min_p in [0, 1]. top_k 0 / -1 become
    null, the one spelling of "off" that the rollouts' sampler reads."""
    from megatron_fused_ce.ops import sampling

    s = cfg["sampling"]
    problems = sampling.sampler_problems(s["top_k"], s["top_p"], s["min_p"], 0,
                                         true_vocab=cfg["model"]["vocab_size"])
    for name, message in problems.items():
        if message:
            raise ValueError(f"sampling.{message}")
    if sampling.top_k_off(s["top_k"]):
        s["top_k"] = None


def _check_replay(cfg: dict) -> None:
    """`sampling.replay` (GRPO) goes with fidelity and a filter that can cut tokens; checked after
    `_check_sampling`, so the values are in range."""
    from megatron_fused_ce.ops import sampling

    s = cfg["sampling"]
    if not s.get("replay"):
        return
    if not s["fidelity"]:
        raise ValueError("sampling.replay=true needs sampling.fidelity=true: replay scores each token over the "
                         "set the sampler kept, fidelity=false asks for plain-softmax log-probs")
    # Without a filter the sampler keeps every token: a switch that changes nothing would hide a
    # forgotten top_k / top_p / min_p.
    if sampling.top_k_off(s["top_k"], cfg["model"]["vocab_size"]) and s["top_p"] >= 1.0 and s["min_p"] <= 0.0:
        raise ValueError("sampling.replay=true needs a sampler filter to replay: set sampling.top_k, "
                         "sampling.top_p < 1 or sampling.min_p > 0 (without one the sampler keeps every "
                         "token and the log-probs are the plain softmax either way)")


def _check_combinations(cfg: dict) -> None:
    """Settings that are each valid but do not go together."""
    mcfg, train = cfg["megatron_cfg"], cfg["train"]
    if (mcfg["sequence_parallel"] and mcfg["tensor_model_parallel_size"] > 1
            and mcfg["transformer_impl"] == "local"):
        raise ValueError("megatron_cfg.sequence_parallel needs a norm that supports it: set "
                         "megatron_cfg.transformer_impl=transformer_engine (TE installed)")
    cp, seq = mcfg["context_parallel_size"], cfg["data"]["seq_length"]
    if seq % (2 * cp):
        raise ValueError(f"data.seq_length ({seq}) must be a multiple of 2 x "
                         f"megatron_cfg.context_parallel_size = {2 * cp}: each context-parallel rank "
                         "holds two of the 2·CP chunks of every sequence")
    if "global_batch_size" in train and train["global_batch_size"] % train["micro_batch_size"]:
        raise ValueError(f"train.global_batch_size ({train['global_batch_size']}) must be a "
                         f"multiple of train.micro_batch_size ({train['micro_batch_size']})")
    if "dpo" in cfg and train["micro_batch_size"] % 2:
        raise ValueError("train.micro_batch_size must be even for DPO (chosen/rejected row pairs)")
    if "dpo" in cfg and cfg["rollout"]["samples_per_prompt"] < 2:
        raise ValueError("rollout.samples_per_prompt must be >= 2 for DPO: a pair is two ranked "
                         "answers to one prompt")
