"""Every difference between the megatron-core versions this package supports, in one place.

Supported: megatron-core 0.16.1 (Python 3.11; the CPU CI) and >= 0.18 (Python 3.12; tested on
0.19.2). The rest of `megatron_fused_ce.megatron` asks the functions here instead of probing
megatron-core itself, so that a new megatron-core release is adapted to by reading this file.
Each probe checks the feature it needs (a signature, an attribute) rather than a version number
where it can: a backport or a development build then does the right thing. Nothing here is
imported by `import megatron_fused_ce.megatron`; megatron-core is imported on first use.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional, Tuple

# MTP losses computed through `output_layer` + `compute_language_model_loss` on the last stage, the
# two things the fused layer replaces (inline in GPTModel._postprocess in 0.16, process_mtp_loss
# from 0.17 on).
MTP_MIN_VERSION = (0, 16)
# `GPTModel.forward(..., output_processor=, output_processor_context=)`: the official hook.
OUTPUT_PROCESSOR_MIN_VERSION = (0, 18)


def megatron_core_version() -> Tuple[int, int]:
    """(major, minor) of the installed megatron-core (its package_info, present in every release)."""
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def megatron_core_version_string() -> str:
    """The installed megatron-core's full version, for error messages."""
    from megatron.core import package_info

    return str(getattr(package_info, "__version__", ".".join(map(str, megatron_core_version()))))


def version_string(version: Tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# ------------------------------------------------------------------------------------------------
# The output_processor hook (>= 0.18)
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def has_output_processor() -> bool:
    """GPTModel.forward takes `output_processor` (megatron-core >= 0.18; 0.16 has no such hook)."""
    from megatron.core.models.gpt import GPTModel

    return "output_processor" in inspect.signature(GPTModel.forward).parameters


def require_output_processor(what: str) -> None:
    """A RuntimeError naming the installed version where GPTModel has no `output_processor`."""
    if not has_output_processor():
        raise RuntimeError(
            f"{what} needs megatron-core >= {version_string(OUTPUT_PROCESSOR_MIN_VERSION)} "
            f"(GPTModel.forward(..., output_processor=...)); the installed megatron-core "
            f"{megatron_core_version_string()} has no such hook: use "
            f"install_fused_output_layer(model, config) instead (same numbers and gradients)")


# ------------------------------------------------------------------------------------------------
# Multi-token prediction
# ------------------------------------------------------------------------------------------------
def mtp_through_output_layer() -> bool:
    """MTP losses go through `output_layer` + `compute_language_model_loss` (>= 0.16), so the
    fused layer can replace both."""
    return megatron_core_version() >= MTP_MIN_VERSION


@functools.lru_cache(maxsize=None)
def mtp_labels_from_input_ids() -> bool:
    """megatron-core >= 0.19 computes MTP losses without `labels` (from the shifted input ids:
    `process_mtp_loss(..., input_ids=)`); before, GPTModel needs `labels` for an MTP model."""
    try:
        from megatron.core.transformer.multi_token_prediction import process_mtp_loss
    except ImportError:  # 0.16: computed inline in GPTModel._postprocess, from labels
        return False
    return "input_ids" in inspect.signature(process_mtp_loss).parameters


# ------------------------------------------------------------------------------------------------
# Configuration fields that exist in some versions only
# ------------------------------------------------------------------------------------------------
def uses_mup(config) -> bool:
    """`TransformerConfig.use_mup` (megatron-core >= 0.18): MuP scales the logits after the output
    layer, which the fused ops never form (the output processor folds the scale into the hidden
    states)."""
    return bool(getattr(config, "use_mup", False))


def has_own_fused_linear_ce(gpt) -> bool:
    """A GPTModel with megatron's own fused linear cross-entropy switched on (`use_fused_lce`, a
    Megatron-LM development feature, absent from 0.16.1 and 0.19.2)."""
    return bool(getattr(gpt, "use_fused_lce", False))


# ------------------------------------------------------------------------------------------------
# Process groups: held by the modules (`tp_group`, `pg_collection`) or by parallel_state
# ------------------------------------------------------------------------------------------------
def tp_group_of(module) -> Optional[object]:
    """The tensor-parallel group of a megatron module: its `tp_group` (ColumnParallelLinear and
    the language models carry one since megatron-core 0.14; None there means no tensor
    parallelism), else parallel_state's."""
    if hasattr(module, "tp_group"):
        return module.tp_group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def pg_collection_group(pg_collection, name: str):
    """`pg_collection.<name>` ('tp', 'cp'), or None where megatron built the module without a
    process-group collection (then parallel_state's groups are the model's)."""
    return getattr(pg_collection, name, None)


def cp_group_of(module) -> Optional[object]:
    """The context-parallel group a megatron model was built with (`pg_collection.cp`), or None:
    then parallel_state's is the model's."""
    return pg_collection_group(getattr(module, "pg_collection", None), "cp")
