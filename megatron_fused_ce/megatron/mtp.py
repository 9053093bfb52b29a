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

The checks here: the megatron-core versions whose MTP loop has that shape, and labels (the
version probes themselves are in compat.py).

Through megatron-core's `output_processor` hook alone (FusedOutputProcessor, nothing installed),
the MTP depths are megatron's own: it runs them through `self.output_layer` before it calls the
processor, so their logits are formed. Install the fused layer as well to keep them fused.
"""

from __future__ import annotations

from . import compat


def has_mtp(gpt) -> bool:
    return bool(getattr(gpt.config, "mtp_num_layers", None))


def check_mtp_model(gpt) -> None:
    """At install time: MTP is supported where megatron computes its losses through
    `output_layer` + `compute_language_model_loss` (compat.mtp_through_output_layer)."""
    if not has_mtp(gpt):
        return
    if not compat.mtp_through_output_layer():
        raise ValueError(
            f"install_fused_output_layer: multi-token prediction (mtp_num_layers="
            f"{gpt.config.mtp_num_layers}) is supported with megatron-core >= "
            f"{compat.version_string(compat.MTP_MIN_VERSION)}, found "
            f"{compat.version_string(compat.megatron_core_version())}")


def check_mtp_call(gpt, labels) -> None:
    """Per forward call of the last stage: where megatron needs labels for the MTP losses, say so
    (instead of megatron's `'NoneType' object has no attribute 'clone'`)."""
    if labels is None and has_mtp(gpt) and not compat.mtp_labels_from_input_ids():
        raise ValueError(
            f"a model with multi-token prediction needs labels on megatron-core "
            f"{compat.version_string(compat.megatron_core_version())}: call model(..., "
            f"labels=labels, loss_mask=loss_mask) (add return_hidden_states=True to get the hidden "
            f"states back for this package's loss functions)")
