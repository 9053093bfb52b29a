"""Megatron distributed checkpoints of the examples' policy: `--save DIR` and `--load DIR`.

The weights go through megatron-core's `dist_checkpointing` (the format Megatron-LM and NeMo
load): `save` writes each rank's shards of `GPTModel.sharded_state_dict()`, `load` reads them back
into a model of any tensor / pipeline / data-parallel layout (resharding on load). Megatron pads
the vocab to a multiple of `make_vocab_size_divisible_by x TP`, so the embedding and output
weights of two layouts can differ in their number of padding rows: their sharded tensors allow
that shape mismatch, and the rows of the true vocab are read (the padding starts as zeros; the
post-processor leaves it out of the softmax anyway). No optimizer state is written: each stage
starts its own optimizer.

Beside the weights, `model_config.json` records the model the checkpoint belongs to (the
`model` section and the sequence length of the position embeddings, plus where it came from).
`--load` compares it with the config before any process starts, and a model that differs ends in
one line naming each difference.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

MODEL_CONFIG = "model_config.json"

# what makes two policies the same network: these must match for a checkpoint to load
# (make_vocab_size_divisible_by only changes the padding rows, which loading handles)
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
              "tie_embeddings")


def model_identity(cfg: dict) -> dict:
    """{"model.num_layers": 4, ..., "data.seq_length": 16}: the settings that must match."""
    m = cfg["model"]
    identity = {f"model.{k}": m[k] for k in MODEL_KEYS}
    if identity["model.ffn_hidden_size"] is None:  # TransformerConfig's default
        identity["model.ffn_hidden_size"] = 4 * m["hidden_size"]
    identity["data.seq_length"] = cfg["data"]["seq_length"]  # learned position embeddings
    return identity


def check_save_dir(path: str) -> Optional[str]:
    """None if `--save path` may write there (new, empty, or a checkpoint of these examples, which
    is replaced), else the one-line reason."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--save {path}: exists and is not a directory"
    if os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, MODEL_CONFIG)):
        return (f"--save {path}: the directory holds files that are not a checkpoint of these "
                f"examples (no {MODEL_CONFIG}); choose a new or empty directory")
    return None


def check_load(path: str, cfg: dict) -> Optional[str]:
    """None if the checkpoint at `path` holds the model `cfg` describes, else one line naming
    every setting that differs (checkpoint value, then the config's)."""
    meta = os.path.join(path, MODEL_CONFIG)
    if not os.path.isdir(path):
        return f"--load {path}: no such directory"
    if not os.path.exists(meta):
        return f"--load {path}: not a checkpoint written by --save (no {MODEL_CONFIG} in it)"
    try:
        with open(meta) as f:
            stored = json.load(f)["model"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"--load {path}: cannot read {MODEL_CONFIG} ({err})"
    wanted = model_identity(cfg)
    differences = [f"{key} {stored.get(key)!r} in the checkpoint, {value!r} in the config"
                   for key, value in wanted.items() if stored.get(key) != value]
    if differences:
        return (f"--load {path}: the checkpoint's model does not match the config: "
                f"{'; '.join(differences)} (set them with section.key=VALUE)")
    return None


def read_info(path: str) -> dict:
    with open(os.path.join(path, MODEL_CONFIG)) as f:
        return json.load(f)


def save(model, cfg: dict, path: str, example: str, step: int) -> None:
    """Every rank writes its shards of the model into `path` (`dist_checkpointing.save`); rank 0
    then writes `model_config.json`, which marks the checkpoint complete."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_fused_ce.megatron import unwrap_model

    _allow_missing_psutil()
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):  # a checkpoint of these examples (check_save_dir): replaced
            _remove(os.path.join(path, name))
    dist.barrier()
    dist_checkpointing.save(unwrap_model(model).sharded_state_dict(), path)
    if dist.get_rank() == 0:
        mcfg = cfg["megatron_cfg"]
        info = {"model": model_identity(cfg),
                "make_vocab_size_divisible_by": cfg["model"]["make_vocab_size_divisible_by"],
                "saved_by": f"examples/{example}.py", "steps": step, "task": cfg["rollout"]["task"],
                "layout": {"tensor_model_parallel_size": mcfg["tensor_model_parallel_size"],
                           "pipeline_model_parallel_size": mcfg["pipeline_model_parallel_size"],
                           "context_parallel_size": mcfg["context_parallel_size"],
                           "data_parallel_size": parallel_state.get_data_parallel_world_size()},
                "dtype": mcfg["dtype"]}
        with open(os.path.join(path, MODEL_CONFIG), "w") as f:
            json.dump(info, f, indent=1)
    dist.barrier()


def load(model, path: str) -> None:
    """The weights of the checkpoint at `path` into `model` (this rank's shards, any layout)."""
    from megatron.core import dist_checkpointing

    from megatron_fused_ce.megatron import unwrap_model

    gpt = unwrap_model(model)
    with warnings.catch_warnings():
        # megatron-core 0.16 calls torch's deprecated `load_state_dict` and ShardedTensor: nothing
        # a user of the examples can act on
        warnings.filterwarnings("ignore", category=FutureWarning,
                                module=r"(megatron\.core|torch\.distributed\.checkpoint)\.")
        state = dist_checkpointing.load(gpt.sharded_state_dict(), path)
    # GPTModel's sharded state dict leaves out the (empty) `_extra_state` of an output layer whose
    # weight is the tied embedding's: the only keys a complete checkpoint may miss
    result = gpt.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint {path}: missing {missing}, unexpected {result.unexpected_keys}")


def _allow_missing_psutil() -> None:
    """megatron-core's checkpoint writer reads its memory with psutil (the `megatron` extra brings
    it) for a debug log line only, and raises where psutil is missing: there, that reading is 0."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if hasattr(filesystem_async, "_process_memory"):
            filesystem_async._process_memory = lambda: 0


def _remove(path: str) -> None:
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
