"""Make a GPTModel's last stage return its final hidden states instead of the `[b, s, V/TP]` logits.

GPTModel's post-processing ends with

    logits, _ = self.output_layer(hidden, weight=output_weight, runtime_gather_output=...)
    return logits.transpose(0, 1).contiguous()          # when labels is None

`install_fused_output_layer` swaps the `output_layer` *attribute* of each last-stage model chunk for
a `FusedOutputLayer` that returns `hidden` unchanged. Nothing in GPTModel's code changes, so the
model returns `hidden.transpose(0, 1)`: `[b, s, h]` (`[b, s/TP, h]` under sequence parallelism).
The vocab projection then happens inside `LogprobsPostProcessor`, chunk by chunk.

What stays the same:
* the state dict: `FusedOutputLayer` holds the very same `weight` Parameter under the same name, so
  `output_layer.weight` (and `output_layer._extra_state`) keys are unchanged and checkpoints move
  freely between fused and unfused models; `sharded_state_dict` is the original layer's.
* gradients: the weight is a leaf of the same autograd graph (or gets its fp32 gradient added to
  `main_grad` under gradient-accumulation fusion), so Megatron's DDP hooks, the tied-embedding
  all-reduce in `finalize_model_grads` and the optimizer see it as before.
* tied embeddings: GPTModel passes the shared weight in `weight=`; the post-processor reads it back
  from `model.shared_embedding_or_output_weight()`.
* `model(..., labels=labels)` (Megatron-LM's pretrain_gpt style) still returns the per-token
  cross-entropy `[b, s]`: two hooks on the model instance (PyTorch's forward pre-/post-hooks, not
  a patched `forward`) take the labels out of the call and turn the returned hidden states into
  `-log p(label)` with the fused op, over the model's full (padded) vocab as megatron does.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Union

import torch

from .config import FusedCEConfig


class FusedOutputLayer(torch.nn.Module):
    """Stand-in for GPTModel's `ColumnParallelLinear` output layer: `forward` returns its input.

    `weight` is the original layer's Parameter (None on a stage whose output weight is the tied
    word-embedding weight, exactly as in the original). The original layer is kept, unregistered,
    for `sharded_state_dict`, attribute look-ups and `uninstall_fused_output_layer`.
    """

    def __init__(self, output_layer: torch.nn.Module, config: Optional[FusedCEConfig] = None):
        super().__init__()
        if getattr(output_layer, "bias", None) is not None:
            raise ValueError("install_fused_output_layer: an output layer with a bias is not supported")
        self.weight = output_layer.weight  # registers the same Parameter (or stays a None attribute)
        self.bias = None
        self.sequence_parallel = getattr(output_layer, "sequence_parallel", False)
        # Plain attributes: not submodules, no state-dict keys.
        self.__dict__["unfused"] = output_layer
        self.__dict__["fused_config"] = config or FusedCEConfig(enabled=True)
        self.__dict__["hook_handles"] = []

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if runtime_gather_output:
            raise RuntimeError(
                "the fused output layer returns hidden states, not logits; gathered logits were "
                "requested (inference/generation): call uninstall_fused_output_layer(model) first")
        return input_, None

    # ColumnParallelLinear has an (empty) extra state: keep the `output_layer._extra_state` key.
    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.unfused.sharded_state_dict(prefix, sharded_offsets, metadata)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Anything else callers read from the output layer (tp_group, sizes, ...).
            unfused = self.__dict__.get("unfused")
            if unfused is None:
                raise
            return getattr(unfused, name)

    def extra_repr(self):
        return f"returns hidden states; replaces {self.unfused!r}"


ModelOrChunks = Union[torch.nn.Module, List[torch.nn.Module]]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model inside Megatron's DDP / Float16Module (or torch DDP) wrappers."""
    inner = model
    while not hasattr(inner, "post_process"):
        if not hasattr(inner, "module"):
            raise TypeError(f"cannot find a GPT-style model (with post_process / output_layer) in "
                            f"{type(model).__name__}")
        inner = inner.module
    return inner


def _chunks(model: ModelOrChunks) -> Iterable[torch.nn.Module]:
    return model if isinstance(model, (list, tuple)) else [model]


def _check_supported(gpt: torch.nn.Module) -> None:
    config = gpt.config
    problems = []
    if getattr(config, "mtp_num_layers", None):
        problems.append("multi-token prediction (mtp_num_layers) computes its own loss from logits")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        problems.append("defer_embedding_wgrad_compute defers the output-layer GEMM")
    if getattr(config, "use_mup", False):
        problems.append("MuP scales the logits after the output layer")
    if getattr(gpt, "use_fused_lce", False):
        problems.append("the model already uses megatron's own fused linear cross-entropy")
    if problems:
        raise ValueError("install_fused_output_layer: unsupported model configuration: "
                         + "; ".join(problems))


# ------------------------------------------------------------------------------------------------
# `model(..., labels=labels)`: per-token loss, as GPTModel returns it without fusion.
# ------------------------------------------------------------------------------------------------
_LABELS_ARG = 4  # GPTModel.forward(input_ids, position_ids, attention_mask, decoder_input, labels, ...)


def _take_labels(gpt, args, kwargs):
    """Forward pre-hook: remove the labels from the call (GPTModel would compute a cross-entropy
    of the hidden states) and keep them for the post-hook."""
    labels = kwargs.pop("labels", None)
    if labels is None and len(args) > _LABELS_ARG:
        labels = args[_LABELS_ARG]
        args = args[:_LABELS_ARG] + (None,) + args[_LABELS_ARG + 1:]
    gpt.output_layer.__dict__["pending_labels"] = labels
    return args, kwargs


def _labels_to_loss(gpt, args, kwargs, output):
    """Forward post-hook: with labels, hidden states -> per-token cross-entropy `[b, s]`."""
    layer = gpt.output_layer
    labels = layer.__dict__.pop("pending_labels", None)
    if labels is None:
        return output
    from .postprocess import LogprobsPostProcessor  # postprocess imports this module

    return -LogprobsPostProcessor(layer.fused_config)(output, gpt, labels).logprobs


def install_fused_output_layer(model: ModelOrChunks, config: FusedCEConfig) -> ModelOrChunks:
    """In place: on every last-stage chunk, the output layer returns hidden states. Returns `model`.

    `model` is a GPTModel (possibly wrapped in DDP / Float16Module) or the list of virtual-pipeline
    chunks. With `config.enabled=False`, or on chunks without `post_process`, nothing changes.
    Installing twice is harmless.
    """
    if not config.enabled:
        return model
    for chunk in _chunks(model):
        gpt = unwrap_model(chunk)
        if not getattr(gpt, "post_process", False) or isinstance(gpt.output_layer, FusedOutputLayer):
            continue
        _check_supported(gpt)
        layer = FusedOutputLayer(gpt.output_layer, config)
        gpt.output_layer = layer
        layer.hook_handles.extend([
            gpt.register_forward_pre_hook(_take_labels, with_kwargs=True),
            gpt.register_forward_hook(_labels_to_loss, with_kwargs=True),
        ])
    return model


def uninstall_fused_output_layer(model: ModelOrChunks) -> ModelOrChunks:
    """Put the original output layers back (e.g. before generation). Returns `model`."""
    for chunk in _chunks(model):
        gpt = unwrap_model(chunk)
        layer = getattr(gpt, "output_layer", None)
        if isinstance(layer, FusedOutputLayer):
            for handle in layer.hook_handles:
                handle.remove()
            gpt.output_layer = layer.unfused
    return model


def is_fused(model: torch.nn.Module) -> bool:
    """True if this (last-stage) chunk returns hidden states."""
    return isinstance(getattr(unwrap_model(model), "output_layer", None), FusedOutputLayer)


def output_weight(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """This stage's output-projection weight shard `[V/TP, h]`, tied or not (None off the last stage)."""
    gpt = unwrap_model(model)
    if not getattr(gpt, "post_process", False):
        return None
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
