"""Multi-token prediction (MTP, DeepSeek-V3 style) through the fused output layer.

With `mtp_num_layers = K`, the MTP block on the last stage returns the main hidden states and
the K depths' hidden states concatenated along the sequence, and megatron computes each depth's
loss itself (inline in `GPTModel._postprocess` on 0.16, in `process_mtp_loss` from 0.17 on):

    for k in range(K):
        logits_k, _ = self.output_layer(hidden[k + 1], weight=output_weight)    # [s, b, V/TP]
        labels_k = roll(labels, -1 - k)        # and the loss mask, CP- and packed-sequence aware
        loss_k = loss_mask_k * self.compute_language_model_loss(labels_k, logits_k)
        log loss_k (MTPLossLoggingHelper; on >= 0.19 also the argmax acceptance rate)
        hidden[0] = MTPLossAutoScaler.apply(hidden[0], scale * loss_k [/ num_tokens])

With the fused layer installed, the output layer returns `LazyLogits` and the model's
`compute_language_model_loss` computes the cross-entropy from the hidden states chunk by chunk
(lazy_logits.py): no depth forms its `[tokens, V/TP]` logits. Everything else in that loop is
megatron's own code, unchanged: the rolling of labels and loss mask (context parallelism, packed
sequences), `mtp_loss_scaling_factor`, `calculate_per_token_loss`, the `MTPLossAutoScaler`
gradient path, the logging, `mtp_detach_heads` (the detached weight arrives in `weight=`), and
where the MTP layers live in the pipeline. So the MTP losses and every gradient are megatron's.

The checks here: the megatron-core versions whose MTP loop has that shape, and labels.
"""

from __future__ import annotations

import inspect
from typing import Tuple

MIN_MEGATRON_CORE = (0, 16)


def megatron_core_version() -> Tuple[int, int]:
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def has_mtp(gpt) -> bool:
    return bool(getattr(gpt.config, "mtp_num_layers", None))


def check_mtp_model(gpt) -> None:
    """At install time: MTP is supported where megatron computes its losses through
    `output_layer` + `compute_language_model_loss` (megatron-core >= 0.16)."""
    if not has_mtp(gpt):
        return
    version = megatron_core_version()
    if version < MIN_MEGATRON_CORE:
        raise ValueError(
            f"install_fused_output_layer: multi-token prediction (mtp_num_layers="
            f"{gpt.config.mtp_num_layers}) is supported with megatron-core >= "
            f"{'.'.join(map(str, MIN_MEGATRON_CORE))}, found {'.'.join(map(str, version))}")


def derives_labels_from_input_ids() -> bool:
    """megatron-core >= 0.19 computes MTP losses without `labels` (from the shifted input ids);
    before, GPTModel needs `labels` whenever the model has MTP layers."""
    try:
        from megatron.core.transformer.multi_token_prediction import process_mtp_loss
    except ImportError:
        return False
    return "input_ids" in inspect.signature(process_mtp_loss).parameters


def check_mtp_call(gpt, labels) -> None:
    """Per forward call of the last stage: where megatron needs labels for the MTP losses, say so
    (instead of megatron's `'NoneType' object has no attribute 'clone'`)."""
    if labels is None and has_mtp(gpt) and not derives_labels_from_input_ids():
        raise ValueError(
            f"a model with multi-token prediction needs labels on megatron-core "
            f"{'.'.join(map(str, megatron_core_version()))}: call model(..., labels=labels, "
            f"loss_mask=loss_mask) (add return_hidden_states=True to get the hidden states back "
            f"for this package's loss functions)")
