"""megatron-core's own extension point for the last stage: `GPTModel.forward(..., output_processor=)`.

From megatron-core 0.18 on, GPTModel's post-processing hands the final hidden states to a callable
the caller passes, instead of running the output layer (after multi-token prediction has run):

    return output_processor(hidden_states=hidden, output_layer=self.output_layer,
                            output_weight=output_weight, labels=labels, loss_mask=loss_mask,
                            packed_seq_params=packed_seq_params, context=output_processor_context,
                            compute_language_model_loss=self.compute_language_model_loss,
                            runtime_gather_output=..., config=self.config, ...)

and the model returns what it returns (on the last stage only; the other stages return their hidden
states as always). `FusedOutputProcessor` is such a callable: nothing is installed on the model,
GPTModel is called as is, and the result is one of

* `returns="hidden_states"` (default): `HiddenStates`, what this package's loss funcs
  (`sft_loss_func`, `dpo_loss_func`, `grpo_loss_func`), `LogprobsPostProcessor` and
  `compute_logprobs` take, exactly as they take the installed layer's output: SFT and GRPO then
  run the gradients-in-forward losses on it;
* `returns="logprobs"`: `LogprobsOutput [b, s]` of the labels GPTModel was given (temperature,
  entropy, sampler settings top_k / top_p / min_p, top-k log-probs, packed sequences from
  `packed_seq_params`, the engine's kept sets from `output_processor_context["sampling_mask"]`),
  for a caller with its own loss on log-probs;
* `returns="loss"`: the per-token cross-entropy `[b, s]` over the full padded vocab, what
  `model(..., labels=labels)` returns unfused (Megatron-LM's `loss_func` takes it unchanged).

The numbers and gradients are those of the installed layer (`install_fused_output_layer`): the
same op on the same hidden states and weight, inside a call of the output layer so that its module
hooks (DDP's param-gather wait, FSDP's gather) surround the weight's use (output_layer.run_in_layer),
with tied embeddings, sequence parallelism, context parallelism, packed sequences and
gradient-accumulation fusion (`main_grad`, `expected_upstream_grad` from the loss funcs) alike.

Multi-token prediction: megatron-core computes the MTP depths' losses *before* it calls the
processor, through `self.output_layer` and `self.compute_language_model_loss`. On this route alone
those are megatron's own, so each MTP depth forms its `[tokens, V/TP]` logits (the main head does
not). Install the fused layer too (`install_fused_output_layer`) and the depths are fused as well;
the processor then runs the main head through the fused layer. (With gradient-accumulation fusion,
megatron's own layers must use it too, as they do on GPUs: the op adds dW into `main_grad`.)

What GPTModel does to the logits after its output layer is matched, or refused with an error that
names it, never dropped. MuP's output multiplier (GPTModel passes `scale_logits=self._scale_logits`,
`logits * config.mup_output_mult` with `use_mup`) is a known constant c, folded into the hidden
states: `(c * hidden) @ W^T == c * logits`, gradients included. It is read from megatron's own
`LanguageModule._scale_logits` and the config of the model it belongs to; any other `scale_logits`
(a model that overrides `_scale_logits`, a caller's function) cannot be read and raises ValueError.
Of the other keywords GPTModel passes, those the processor does not read (`IGNORED_KEYWORDS`)
cannot change its result; any other keyword with a value raises TypeError. Inference's last-token
logits (an `inference_context` with `materialize_only_last_token_logits`) are refused too.

With `config.enabled` False the processor does what GPTModel does without one (logits, megatron's
loss), so a `use_linear_ce_fusion_loss` switch needs no second code path. On megatron-core without
the hook (0.16) constructing a processor raises a RuntimeError naming the version: use
`install_fused_output_layer` there.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
from torch import Tensor

from . import compat
from .config import FusedCEConfig
from .output_layer import HiddenStates, layer_tp_group, unsupported_configuration
from .postprocess import IGNORE_INDEX, LogprobsPostProcessor

RETURNS = ("hidden_states", "logprobs", "loss")
# What `output_processor_context` may set for one call (a mapping; None = nothing).
CONTEXT_KEYS = ("returns", "cu_seqlens", "cu_seqlens_padded", "sampling_mask")
# Keywords GPTModel passes (megatron-core 0.18, 0.19) that the processor does not read, because
# they cannot change its result: the decoder has consumed the inputs, and the loss mask is applied
# after the per-token values (by the loss funcs, as by megatron's own loss_func).
IGNORED_KEYWORDS = ("loss_mask", "input_ids", "position_ids", "attention_mask", "decoder_input")


class FusedOutputProcessor:
    """GPTModel's `output_processor` (megatron-core >= 0.18) computing from the hidden states.

        proc = FusedOutputProcessor(fused_config, vocab_size=tokenizer_vocab_size)
        output = model(tokens, position_ids, attention_mask, output_processor=proc)
        loss_func = sft_loss_func(proc, model, labels, loss_mask)   # or dpo_ / grpo_loss_func

    Args:
        config: the `FusedCEConfig` (chunking, memory mode; `enabled=False`: unfused, see module).
        returns: "hidden_states" (default), "logprobs" or "loss" (module doc). One call can ask
            for another with `output_processor_context={"returns": ...}`.
        vocab_size, temperature, return_entropy, ignore_index, top_k, top_p, min_p, return_topk,
        cp_group: the log-probs' settings, as for `LogprobsPostProcessor` (`.post_processor`
            holds one with them; the loss funcs and `compute_logprobs` take this processor in its
            place). "loss" ignores them: it is megatron's cross-entropy over the padded vocab.

    `output_processor_context`: None, or a mapping with any of `returns`, `cu_seqlens`,
    `cu_seqlens_padded` (packed-sequence offsets for "logprobs"; default: GPTModel's
    `packed_seq_params.cu_seqlens_q` / `cu_seqlens_q_padded`), `sampling_mask` ("logprobs" only:
    the engine's kept sets of this call's labels, replayed as `LogprobsPostProcessor(...,
    sampling_mask=)` does; `[b, s]` layout, the whole sequences under context parallelism; not
    with this processor's top_k / top_p / min_p / return_topk). "logprobs" and "loss" read the
    `labels` GPTModel is called with. (With "hidden_states" the mask goes to the loss func:
    `grpo_loss_func(..., sampling_mask=)`.)

    `LogprobsOutput` is a NamedTuple: megatron's Float16Module (bf16 / fp16 models) rebuilds
    tuples in the last stage's output as plain `(logprobs, entropy)` tuples, dropping the top-k
    fields; `HiddenStates` passes it unchanged.
    """

    def __init__(self, config: FusedCEConfig, *, returns: str = "hidden_states",
                 vocab_size: Optional[int] = None, temperature: float = 1.0,
                 return_entropy: bool = False, ignore_index: int = IGNORE_INDEX,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 min_p: Optional[float] = None, return_topk: int = 0, cp_group=None):
        compat.require_output_processor("FusedOutputProcessor")
        if not isinstance(config, FusedCEConfig):
            raise TypeError(f"config must be a FusedCEConfig, got {type(config).__name__}")
        _check_returns(returns)
        self.config = config
        self.returns = returns
        self.post_processor = LogprobsPostProcessor(
            config, vocab_size=vocab_size, temperature=temperature, return_entropy=return_entropy,
            ignore_index=ignore_index, top_k=top_k, top_p=top_p, min_p=min_p,
            return_topk=return_topk, cp_group=cp_group)

    def __repr__(self):
        return f"FusedOutputProcessor(returns={self.returns!r}, enabled={self.config.enabled})"

    def __call__(self, *, hidden_states: Tensor, output_layer: torch.nn.Module,
                 output_weight: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                 packed_seq_params=None, runtime_gather_output: Optional[bool] = None,
                 context: Optional[Mapping] = None, compute_language_model_loss=None,
                 scale_logits=None, config=None, inference_context=None, **others):
        """Called by GPTModel on the last stage (keyword arguments only). Of the others it passes,
        `IGNORED_KEYWORDS` are accepted unread; an unknown keyword raises TypeError unless None."""
        _check_other_keywords(others)
        _check_inference_context(inference_context)
        returns, packing, sampling_mask = self._call_options(context, packed_seq_params)
        if returns != "hidden_states" and labels is None:
            raise ValueError(f"FusedOutputProcessor(returns={returns!r}) needs labels: call "
                             f"model(..., labels=labels, output_processor=...)")
        if not self.config.enabled:
            return self._unfused(returns, hidden_states, output_layer, output_weight, labels,
                                 packing, runtime_gather_output, compute_language_model_loss,
                                 scale_logits, sampling_mask)
        if runtime_gather_output:
            raise RuntimeError(
                "FusedOutputProcessor computes no logits; gathered logits were requested "
                "(inference / generation): call the model without output_processor for logits")
        scale, mup_folded = _logit_scale(scale_logits)
        model_config = config if config is not None else getattr(output_layer, "config", None)
        problems = unsupported_configuration(model_config, mup_folded=mup_folded)
        if problems:
            raise ValueError("FusedOutputProcessor: unsupported model configuration: "
                             + "; ".join(problems) + f"; {_NOT_FUSED}")
        if scale != 1.0:  # logits * c == (c * hidden) @ W^T; the weight's gradient alike
            hidden_states = hidden_states * scale
        states = HiddenStates(hidden_states, output_layer, output_weight, model_config)
        if returns == "hidden_states":
            return states
        if returns == "loss":
            return states.cross_entropy(labels, self.config)
        return self.post_processor.logprobs_of(states, labels, **packing, sampling_mask=sampling_mask)

    def _call_options(self, context, packed_seq_params):
        """(returns, packing offsets, sampling mask) of one call, from `output_processor_context`."""
        if context is None:
            context = {}
        if not isinstance(context, Mapping):
            raise TypeError(f"output_processor_context for FusedOutputProcessor must be None or a "
                            f"mapping with keys among {CONTEXT_KEYS}, got {type(context).__name__}")
        unknown = sorted(set(context) - set(CONTEXT_KEYS))
        if unknown:
            raise ValueError(f"output_processor_context: unknown keys {unknown}; "
                             f"FusedOutputProcessor reads {CONTEXT_KEYS}")
        returns = context.get("returns", self.returns)
        _check_returns(returns)
        packing = dict(cu_seqlens=getattr(packed_seq_params, "cu_seqlens_q", None),
                       cu_seqlens_padded=getattr(packed_seq_params, "cu_seqlens_q_padded", None))
        if "cu_seqlens" in context or "cu_seqlens_padded" in context:
            packing = dict(cu_seqlens=context.get("cu_seqlens"),
                           cu_seqlens_padded=context.get("cu_seqlens_padded"))
        sampling_mask = context.get("sampling_mask")
        if sampling_mask is not None and returns != "logprobs":
            raise ValueError(
                f"output_processor_context['sampling_mask'] is read with returns='logprobs' only, this "
                f"call returns {returns!r}: pass the mask to the loss func instead "
                f"(grpo_loss_func(..., sampling_mask=) on the hidden states)")
        return returns, packing, sampling_mask

    def _unfused(self, returns, hidden_states, output_layer, output_weight, labels, packing,
                 runtime_gather_output, compute_language_model_loss, scale_logits, sampling_mask=None):
        """Fusion off: GPTModel's own post-processing (logits from the output layer)."""
        logits, _ = output_layer(hidden_states, weight=output_weight,
                                 runtime_gather_output=runtime_gather_output)
        if scale_logits is not None:
            logits = scale_logits(logits)
        if returns == "loss":
            return compute_language_model_loss(labels, logits)
        logits = logits.transpose(0, 1).contiguous()  # [s, b, V/TP] -> [b, s, V/TP], as GPTModel
        if returns == "hidden_states":  # what the loss funcs take with fusion off: the logits
            return logits
        post = self.post_processor
        labels = post.scored_labels(labels, None, **packing)
        weight = output_weight if output_weight is not None else output_layer.weight
        return post._from_logits(logits, labels, layer_tp_group(output_layer), weight.shape[0],
                                 sampling_mask, None, packing)


def _check_returns(returns) -> None:
    if returns not in RETURNS:
        raise ValueError(f"returns must be one of {RETURNS}, got {returns!r}")


_NOT_FUSED = "call the model without output_processor, or with fusion off (FusedCEConfig(enabled=False))"
# Values of all signs and magnitudes: the multiplier read from the config must be what the
# function does to them, bit for bit.
_PROBE = (-3.0, -0.5, 0.0, 1.0, 7.25, 1.0e4)


def _logit_scale(scale_logits) -> tuple:
    """`(c, from_mup)`: the constant c with `scale_logits(logits) == logits * c` (None: 1.0), and
    whether it is MuP's output multiplier. c is known exactly for megatron's own
    `LanguageModule._scale_logits` only (not overridden): its model config's `mup_output_mult`
    with `use_mup`, else 1. Any other callable may do anything to the logits: ValueError."""
    if scale_logits is None:
        return 1.0, False
    model_config = _megatron_scale_owner_config(scale_logits)
    if model_config is not None:
        scale = float(model_config.mup_output_mult) if model_config.use_mup else 1.0
        probe = torch.tensor(_PROBE, dtype=torch.float64)
        scaled = scale_logits(probe)
        # a megatron-core whose _scale_logits does more than this multiplication is not read
        if math.isfinite(scale) and isinstance(scaled, Tensor) and torch.equal(scaled, probe * scale):
            return scale, True
    raise ValueError(
        f"FusedOutputProcessor: scale_logits={_describe(scale_logits)} cannot be folded into the fused "
        f"ops: only megatron's own LanguageModule._scale_logits (MuP's mup_output_mult, a "
        f"constant) can be, and a model that overrides it or a caller's function may change the "
        f"logits in any way; {_NOT_FUSED}")


def _megatron_scale_owner_config(scale_logits):
    """The config megatron's own `_scale_logits`, bound to a model, reads (None: not that)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    megatron_scale = getattr(LanguageModule, "_scale_logits", None)
    owner = getattr(scale_logits, "__self__", None)
    if megatron_scale is None or getattr(scale_logits, "__func__", None) is not megatron_scale:
        return None
    config = getattr(owner, "config", None)
    if not (hasattr(config, "use_mup") and hasattr(config, "mup_output_mult")):
        return None
    return config


def _check_other_keywords(others: Mapping) -> None:
    """Keywords outside the signature: the known harmless ones, or None. Another value may change
    the logits in a way this processor cannot know (a newer megatron-core): TypeError."""
    unknown = {name: value for name, value in others.items()
               if name not in IGNORED_KEYWORDS and value is not None}
    if unknown:
        given = ", ".join(f"{name}={_describe(value)}" for name, value in sorted(unknown.items()))
        raise TypeError(
            f"FusedOutputProcessor was called with keyword arguments it does not know: {given}; "
            f"they may change the logits, which it cannot tell: {_NOT_FUSED}")


def _check_inference_context(inference_context) -> None:
    """GPTModel keeps the logits of the last tokens only where the inference context asks for it;
    neither the fused ops nor the unfused path here do that: refused."""
    if inference_context is None:
        return
    inference_config = getattr(inference_context, "config", None)
    if getattr(inference_config, "materialize_only_last_token_logits", False):
        raise ValueError(
            f"FusedOutputProcessor: inference_context={_describe(inference_context)} asks for the "
            f"last tokens' logits only (materialize_only_last_token_logits): call the model "
            f"without output_processor for inference")


def _describe(value) -> str:
    """A short description of a keyword's value for an error message (a bound method's repr
    would print its whole model)."""
    if isinstance(value, Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    owner, func = getattr(value, "__self__", None), getattr(value, "__func__", None)
    if owner is not None and func is not None:
        return f"<bound method {getattr(func, '__qualname__', func)} of a {type(owner).__name__}>"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"<function {value.__qualname__}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
