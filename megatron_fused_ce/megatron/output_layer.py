"""Make a GPTModel's last stage work without the `[b, s, V/TP]` logits.

GPTModel's post-processing ends with

    logits, _ = self.output_layer(hidden, weight=output_weight, runtime_gather_output=...)
    if labels is None:
        return logits.transpose(0, 1).contiguous()
    return self.compute_language_model_loss(labels, logits)          # per-token loss [b, s]

(and, with multi-token prediction, one more output-layer call + `compute_language_model_loss` per
MTP depth before that: mtp.py). `install_fused_output_layer` swaps the `output_layer` *attribute*
of each last-stage model chunk for a `FusedOutputLayer`, whose result is `LazyLogits`
(lazy_logits.py): the logits, never computed. Without labels the model returns
`logits.transpose(0, 1)`, which for `LazyLogits` is the hidden states `[b, s, h]` (`[b, s/TP, h]`
under sequence parallelism); `LogprobsPostProcessor` then does the vocab projection chunk by chunk.
With labels (Megatron-LM's `model(..., labels=labels)`, and every MTP depth), the model's
`compute_language_model_loss` is pointed, on this model instance only, at the fused cross-entropy
of `LazyLogits` (and falls back to megatron's own for real logits). No GPTModel code changes.

What stays the same:
* the state dict: `FusedOutputLayer` holds the very same `weight` Parameter under the same name, so
  `output_layer.weight` (and `output_layer._extra_state`) keys are unchanged and checkpoints move
  freely between fused and unfused models; `sharded_state_dict` is the original layer's.
* gradients: the weight is a leaf of the same autograd graph (or gets its fp32 gradient added to
  `main_grad` under gradient-accumulation fusion), so Megatron's DDP hooks, the tied-embedding
  all-reduce in `finalize_model_grads` and the optimizer see it as before, once per backward.
* tied embeddings: GPTModel passes the shared weight in `weight=`; the post-processor reads it back
  from `model.shared_embedding_or_output_weight()`.
* module hooks: every fused op (the cross-entropy and argmax of `LazyLogits`, the post-processor's
  log-probs, the loss funcs' losses) runs inside a call of the output-layer module
  (`run_in_output_layer`), reading the layer's own weight there, so the layer's module hooks fire
  around each use of the weight. (GPTModel's own call, which only returns `LazyLogits`, reads
  nothing and skips them.) Megatron's DDP with `overlap_param_gather` waits for the weight's
  all-gather in such a hook: its hooks are moved to the new module whether the model was wrapped
  before or after install. FSDP engines (torch FSDP2, Megatron-FSDP) gather the weight in such a
  hook and reduce-scatter its gradient when autograd delivers it: install before wrapping
  (sharded.py). Hooks of any other wrapper cannot be moved: install before wrapping, or it raises.

`model(..., labels=labels, loss_mask=loss_mask, return_hidden_states=True)` keeps the labels for
the MTP losses but returns the main head's hidden states (for this package's loss functions).

The other route, megatron-core >= 0.18's `output_processor` hook (output_processor.py), installs
nothing: GPTModel hands its hidden states, its output layer (megatron's own) and the tied weight
to the processor. Both routes meet in `HiddenStates` (the hidden states, the layer and the weight
it is given) and `run_in_layer` (a fused op inside a call of that layer, fused or megatron's own,
with its module hooks), so the post-processor and the loss funcs read either the same way.
"""

from __future__ import annotations

import types
from typing import Iterable, List, Optional, Union

import torch

from megatron_fused_ce import linear_cross_entropy
from megatron_fused_ce.ops import LogprobsOutput, reductions

from . import compat, mtp, sharded
from .config import FusedCEConfig
from .lazy_logits import LazyLogits


class FusedOutputLayer(torch.nn.Module):
    """Stand-in for GPTModel's `ColumnParallelLinear` output layer: returns `LazyLogits`.

    `weight` is the original layer's Parameter (None on a stage whose output weight is the tied
    word-embedding weight, exactly as in the original). The original layer is kept, unregistered,
    for `sharded_state_dict`, attribute look-ups and `uninstall_fused_output_layer`.
    `layer(hidden, compute=fn)` returns `fn(hidden, weight)`, computed inside this module's call
    (see the module docs); `weight=` is given only for a weight the layer does not own (tied).
    """

    def __init__(self, output_layer: torch.nn.Module, config: Optional[FusedCEConfig] = None):
        super().__init__()
        if getattr(output_layer, "bias", None) is not None:
            raise ValueError("install_fused_output_layer: an output layer with a bias is not supported")
        self.weight = output_layer.weight  # registers the same Parameter (or stays a None attribute)
        self.bias = None
        self.sequence_parallel = getattr(output_layer, "sequence_parallel", False)
        # LazyLogits stand for the gathered logits: megatron's MTP argmax reads this flag.
        self.gather_output = True
        # Plain attributes: not submodules, no state-dict keys.
        self.__dict__["unfused"] = output_layer
        self.__dict__["fused_config"] = config or FusedCEConfig(enabled=True)
        self.__dict__["labels_for_hidden"] = None  # see _before_forward

    # megatron's TorchFullyShardedDataParallel makes every module type listed here an FSDP unit.
    @property
    def _fsdp_modules(self):
        return [type(self)]

    def __call__(self, *args, compute=None, **kwargs):
        if compute is None:
            # GPTModel's own call only wraps the hidden states in LazyLogits and reads nothing:
            # no module hooks (an FSDP engine would gather the weight for nothing, and record a
            # use that its backward prefetching would gather it again for). Every fused op calls
            # the layer with `compute`, hooks and all.
            return self.forward(*args, **kwargs)
        return super().__call__(*args, compute=compute, **kwargs)

    def forward(self, input_, weight=None, runtime_gather_output=None, compute=None):
        given = weight  # the tied weight (or MTP's detached one); None = this layer's own
        weight = self.weight if weight is None else weight
        if weight is None:
            raise RuntimeError("FusedOutputLayer: no weight (tied embeddings pass it in weight=)")
        if compute is not None:
            sharded.check_gathered(weight, tied=given is not None)
            return _without_views(compute(input_, weight))
        if runtime_gather_output:
            raise RuntimeError(
                "the fused output layer does not compute logits; gathered logits were requested "
                "(inference/generation): call uninstall_fused_output_layer(model) first")
        return LazyLogits(input_, weight, self, None if given is self.weight else given), None

    def run(self, hidden, compute, weight=None):
        """`compute(hidden, weight)` inside a call of this module (its hooks around it). Pass
        `weight` only if this layer does not own it: an FSDP engine gathers the layer's own
        weight in its pre-hook, and would see the gradient of one passed in too early."""
        out = self(hidden, weight=weight, compute=compute)
        sharded.after_fused_op(self)
        return out

    @property
    def tp_group(self):
        """The original layer's tensor-parallel group (None: no tensor parallelism)."""
        return compat.tp_group_of(self.unfused)

    @property
    def splits_sequence(self) -> bool:
        """Sequence parallelism with TP > 1: the input is this rank's `[s/TP, b, h]` slice."""
        return splits_sequence(self)

    def fused_op_kwargs(self, weight) -> dict:
        """Keyword arguments of the fused ops for this layer's inputs (Megatron's `[s, b, h]`)."""
        return fused_op_kwargs(self, self.fused_config, self.config, weight)

    # ColumnParallelLinear has an (empty) extra state: keep the `output_layer._extra_state` key.
    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        if "weight" in self._parameters:  # an FSDP engine may have replaced the Parameter
            self.unfused._parameters["weight"] = self._parameters["weight"]
        return self.unfused.sharded_state_dict(prefix, sharded_offsets, metadata)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Anything else callers read from the output layer (config, sizes, ...).
            unfused = self.__dict__.get("unfused")
            if unfused is None:
                raise
            return getattr(unfused, name)

    def extra_repr(self):
        return f"returns LazyLogits (no logits); replaces {self.unfused!r}"


def layer_tp_group(layer: torch.nn.Module):
    """The tensor-parallel group of an output layer, fused or megatron's own."""
    return layer.tp_group if isinstance(layer, FusedOutputLayer) else compat.tp_group_of(layer)


def splits_sequence(layer: torch.nn.Module) -> bool:
    """Sequence parallelism with TP > 1 on this output layer: its input is the rank's
    `[s/TP, b, h]` slice, gathered along dim 0 by the op."""
    return bool(getattr(layer, "sequence_parallel", False)) and \
        reductions.group_size(layer_tp_group(layer)) > 1


def fused_op_kwargs(layer: torch.nn.Module, fused_config: FusedCEConfig, model_config,
                    weight: Optional[torch.Tensor] = None) -> dict:
    """Keyword arguments of the fused ops (`linear_cross_entropy`, `linear_logprobs`, ...) for the
    inputs of `layer` (fused or megatron's own; Megatron's `[s, b, h]`), under `fused_config`'s
    chunking and the model's gradient-accumulation fusion (narrowed to what `weight` allows, when
    it is known)."""
    return _op_kwargs(layer_tp_group(layer), splits_sequence(layer), fused_config, model_config, weight)


def _op_kwargs(tp_group, sequence_parallel: bool, fused_config: FusedCEConfig, model_config,
               weight: Optional[torch.Tensor] = None) -> dict:
    accumulate = bool(getattr(model_config, "gradient_accumulation_fusion", False))
    if accumulate and weight is not None:
        accumulate = sharded.may_add_into_main_grad(weight)
    return dict(
        tp_group=tp_group, chunk_size=fused_config.chunk_size,
        memory_mode=fused_config.memory_mode, logits_dtype=fused_config.op_logits_dtype(),
        max_chunk_bytes=fused_config.max_chunk_bytes, sequence_parallel=sequence_parallel,
        accumulate_into_main_grad=accumulate)


_NO_FORWARD = object()
_LAYERS_GROUP = object()  # HiddenStates: the output layer's tensor-parallel group


def run_in_layer(layer: torch.nn.Module, hidden, compute, weight=None):
    """`compute(hidden, weight)` inside a call of the output-layer module `layer`, with its
    module hooks around it; `weight` only for one the layer does not own (tied).

    The fused layer has a `run` for this. Megatron's own layer (the output_processor route, nothing
    installed) is called with `compute` as its forward for that one call: Megatron's DDP waits for
    the weight's all-gather (overlap_param_gather) and FSDP engines gather the weight in that
    module's pre-hooks, so a fused op reading the weight outside a call of it could read a stale or
    sharded weight. The instance attribute is removed again before this returns."""
    if isinstance(layer, FusedOutputLayer):
        return layer.run(hidden, compute, weight=weight)

    def forward(input_, weight=None):
        own = weight is None
        weight = layer.weight if own else weight
        sharded.check_gathered(weight, tied=not own)
        return _without_views(compute(input_, weight))

    saved = layer.__dict__.get("forward", _NO_FORWARD)
    layer.__dict__["forward"] = forward
    try:
        return layer(hidden, weight=weight)
    finally:
        if saved is _NO_FORWARD:
            del layer.__dict__["forward"]
        else:
            layer.__dict__["forward"] = saved


def given_weight(layer: torch.nn.Module, weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The weight to pass to `run_in_layer`: None where it is the layer's own (the last stage's
    copy of a tied weight at PP > 1 is), so that a sharding engine gathers it in the layer's call."""
    return None if weight is None or weight is getattr(layer, "weight", None) else weight


class HiddenStates:
    """The last stage's final hidden states where Megatron would form the logits, and what the
    fused ops need to project them: the output layer and the weight GPTModel hands it.

    `FusedOutputProcessor` (megatron-core's `output_processor` hook) returns one; the installed
    layer's `[b, s, h]` model output is read as one (`of_installed`). `states` is in Megatron's
    sequence-first layout, `[s, b, h]` (`[s/TP, b, h]` under sequence parallelism: this rank's
    slice). Neither a tensor nor a tuple on purpose: megatron's Float16Module upcasts tensors and
    rebuilds tuples in the last stage's output, and passes anything else through unchanged.
    `model_config`: the model's TransformerConfig (default: the layer's); `tp_group`: the
    model's tensor-parallel group (default: the layer's)."""

    def __init__(self, states: torch.Tensor, output_layer: torch.nn.Module,
                 output_weight: Optional[torch.Tensor] = None, model_config=None,
                 tp_group=_LAYERS_GROUP):
        if getattr(output_layer, "bias", None) is not None:
            raise ValueError("the fused ops do not support an output layer with a bias")
        self.states = states
        self.output_layer = output_layer
        self.output_weight = given_weight(output_layer, output_weight)
        self.model_config = model_config if model_config is not None else getattr(output_layer, "config", None)
        self.tp_group = layer_tp_group(output_layer) if tp_group is _LAYERS_GROUP else tp_group
        # the op gathers a sequence-parallel input along dim 0 (Megatron's [s/TP, b, h])
        self.sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False)) and \
            reductions.group_size(self.tp_group) > 1

    @classmethod
    def of_installed(cls, gpt: torch.nn.Module, output: torch.Tensor) -> "HiddenStates":
        """The installed fused layer's model output `[b, s, h]` (`[b, s/TP, h]` under SP)."""
        return cls(output.transpose(0, 1), gpt.output_layer, _tied_weight(gpt), gpt.config,
                   tp_group=compat.tp_group_of(gpt))

    @property
    def device(self) -> torch.device:
        return self.states.device

    def token_shape(self):
        """`(b, s)`: the labels' shape for these hidden states (s gathered under SP)."""
        s, b = self.states.shape[0], self.states.shape[1]
        if self.sequence_parallel:
            s *= reductions.group_size(self.tp_group)
        return b, s

    def batch_first(self) -> torch.Tensor:
        """`[b, s, h]` (`[b, s/TP, h]` under SP), the layout of the installed layer's output."""
        return self.states.transpose(0, 1)

    def op_kwargs(self, fused_config: FusedCEConfig, weight: Optional[torch.Tensor] = None) -> dict:
        """The fused ops' keyword arguments for these hidden states (without `weight`,
        `accumulate_into_main_grad` is the model's setting; `run` narrows it to the weight's)."""
        return _op_kwargs(self.tp_group, self.sequence_parallel, fused_config, self.model_config, weight)

    def run(self, op, hidden, **op_kwargs):
        """`op(hidden, weight, **op_kwargs)` inside a call of the output layer (run_in_layer)."""
        return run_in_layer(self.output_layer, hidden, _cast_and_call(op, op_kwargs),
                            weight=self.output_weight)

    def cross_entropy(self, labels: torch.Tensor, fused_config: FusedCEConfig) -> torch.Tensor:
        """Per-token `-log softmax(logits)[label]` over the full (padded) vocab, `[b, s]` fp32, as
        megatron's `compute_language_model_loss(labels [b, s], logits)`; differentiable."""
        def fused(hidden, weight):
            return linear_cross_entropy(hidden.to(weight.dtype), weight, labels.t(), reduction="none",
                                        **self.op_kwargs(fused_config, weight))

        return run_in_layer(self.output_layer, self.states, fused,
                            weight=self.output_weight).t().contiguous()

    def __repr__(self):
        return (f"HiddenStates(states={tuple(self.states.shape)} {self.states.dtype}, "
                f"output_layer={type(self.output_layer).__name__})")


def _cast_and_call(op, op_kwargs):
    def compute(hidden, weight):
        kwargs = dict(op_kwargs)
        if kwargs.get("accumulate_into_main_grad"):
            kwargs["accumulate_into_main_grad"] = sharded.may_add_into_main_grad(weight)
        return op(hidden.to(weight.dtype), weight, **kwargs)

    return compute


def _without_views(out):
    """The op's outputs, views copied (O(tokens)): FSDP2 hooks the outputs of a module call for
    its backward, and an in-place op on a view of them would drop that hook."""
    if isinstance(out, torch.Tensor):
        return out.clone() if out._base is not None else out
    if isinstance(out, LogprobsOutput):  # top-k outputs are attributes outside the tuple
        return out.map(_without_views)
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # other NamedTuples
        return type(out)(*map(_without_views, out))
    if isinstance(out, (tuple, list)):
        return type(out)(map(_without_views, out))
    if isinstance(out, dict):
        return {key: _without_views(value) for key, value in out.items()}
    return out


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


def unsupported_configuration(config, gpt: Optional[torch.nn.Module] = None, *,
                              mup_folded: bool = False) -> List[str]:
    """Why the fused ops cannot stand in for this model's output layer (empty: they can).
    `mup_folded`: the caller applies MuP's output multiplier itself (the output processor)."""
    problems = []
    if getattr(config, "defer_embedding_wgrad_compute", False):
        problems.append("defer_embedding_wgrad_compute defers the output-layer GEMM")
    if compat.uses_mup(config) and not mup_folded:
        problems.append("MuP scales the logits after the output layer")
    # GPTModel then builds a Transformer Engine LM head that quantizes the GEMM; the fused ops
    # project in the weight's dtype
    if getattr(config, "fp8_output_proj", False) and getattr(config, "fp8", None):
        problems.append("fp8_output_proj runs the output projection in MXFP8")
    if gpt is not None and compat.has_own_fused_linear_ce(gpt):
        problems.append("the model already uses megatron's own fused linear cross-entropy")
    return problems


def _check_supported(gpt: torch.nn.Module) -> None:
    problems = unsupported_configuration(gpt.config, gpt)
    if problems:
        raise ValueError("install_fused_output_layer: unsupported model configuration: "
                         + "; ".join(problems))
    mtp.check_mtp_model(gpt)


# ------------------------------------------------------------------------------------------------
# Per model instance: a forward pre-/post-hook pair, and `compute_language_model_loss`.
# ------------------------------------------------------------------------------------------------
_LABELS_ARG = 4  # GPTModel.forward(input_ids, position_ids, attention_mask, decoder_input, labels, ...)
_RETURN_HIDDEN = "return_hidden_states"
_HOOKS = "_fused_ce_hooks"  # gpt.__dict__ key of the hook handles (installed marker)


def _before_forward(gpt, args, kwargs):
    """Take `return_hidden_states` out of the call (GPTModel does not know it) and remember which
    labels tensor is the main head's: its cross-entropy then returns the hidden states instead."""
    return_hidden = bool(kwargs.pop(_RETURN_HIDDEN, False))
    labels = kwargs.get("labels", args[_LABELS_ARG] if len(args) > _LABELS_ARG else None)
    mtp.check_mtp_call(gpt, labels)  # on every stage: all ranks raise alike
    layer = getattr(gpt, "output_layer", None)
    if getattr(gpt, "post_process", False) and isinstance(layer, FusedOutputLayer):
        layer.__dict__["labels_for_hidden"] = labels if return_hidden else None
        sharded.keep_gathered_through_forward(layer)
    return args, kwargs


def _after_forward(gpt, args, kwargs, output):
    layer = getattr(gpt, "output_layer", None)
    if isinstance(layer, FusedOutputLayer):
        layer.__dict__["labels_for_hidden"] = None
    return output


def _language_model_loss(gpt, labels, logits):
    """`compute_language_model_loss` of a fused model: `[b, s]` cross-entropy of LazyLogits from
    the hidden states (megatron's own method for real logits)."""
    if not isinstance(logits, LazyLogits):
        return type(gpt).compute_language_model_loss(gpt, labels, logits)
    if labels is logits.layer.labels_for_hidden:  # the main head, return_hidden_states=True
        return logits.hidden_states()
    return logits.cross_entropy(labels)


# ------------------------------------------------------------------------------------------------
# Swapping the output layer under Megatron's DDP.
# ------------------------------------------------------------------------------------------------
def _param_gather_wrappers(chunk: torch.nn.Module) -> list:
    """Megatron DDP wrappers around `chunk` whose forward pre-hooks wait for parameter all-gathers
    (distributed optimizer with overlap_param_gather) and are currently registered."""
    wrappers, module = [], chunk
    while module is not None and not hasattr(module, "post_process"):
        if getattr(module, "use_forward_hook", False) and getattr(
                module, "remove_forward_pre_hook_handles", None):
            wrappers.append(module)
        module = getattr(module, "module", None)
    return wrappers


def _foreign_hooks(layer: torch.nn.Module, wrappers: list) -> List[str]:
    """Hooks on `layer` that a swap would drop: all but those of `wrappers`."""
    known = {w.remove_forward_pre_hook_handles[layer].id for w in wrappers
             if layer in w.remove_forward_pre_hook_handles}
    found = []
    for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        found += [f"{kind}[{key}]" for key in getattr(layer, kind, {}) if key not in known]
    return found


def _check_swappable(chunk, gpt) -> None:
    foreign = _foreign_hooks(gpt.output_layer, _param_gather_wrappers(chunk))
    if foreign:
        raise ValueError(
            f"install_fused_output_layer: the output layer ({type(gpt.output_layer).__name__}) has "
            f"module hooks that are not megatron DDP's ({', '.join(foreign)}), e.g. from FSDP or "
            f"another wrapper; swapping the layer would drop them. Call install_fused_output_layer "
            f"(and uninstall_fused_output_layer) before wrapping the model.")


def _swap_output_layer(chunk, gpt, new_layer) -> None:
    """`gpt.output_layer = new_layer`, with megatron DDP's param-gather pre-hooks moved along
    (its public disable/enable pair re-registers them on the current modules)."""
    wrappers = _param_gather_wrappers(chunk)
    for wrapper in wrappers:
        wrapper.disable_forward_pre_hook(param_sync=False)
    gpt.output_layer = new_layer
    for wrapper in wrappers:
        wrapper.enable_forward_pre_hook()


def install_fused_output_layer(model: ModelOrChunks, config: FusedCEConfig) -> ModelOrChunks:
    """In place: on every last-stage chunk, the output layer returns `LazyLogits`. Returns `model`.

    `model` is a GPTModel (possibly wrapped in DDP / Float16Module) or the list of virtual-pipeline
    chunks. With `config.enabled=False` nothing changes. Installing twice is harmless. Call it
    before or after wrapping in megatron's DDP; other wrappers' module hooks on the output layer
    make it raise (install first). Bad configurations raise before anything changes.
    """
    if not config.enabled:
        return model
    todo = []
    for chunk in _chunks(model):
        gpt = unwrap_model(chunk)
        if _HOOKS in gpt.__dict__:
            continue
        last = bool(getattr(gpt, "post_process", False))
        if last:
            _check_supported(gpt)
            sharded.check_not_wrapped(chunk, gpt, "install_fused_output_layer")
            _check_swappable(chunk, gpt)
        todo.append((chunk, gpt, last))
    for chunk, gpt, last in todo:
        gpt.__dict__[_HOOKS] = [
            gpt.register_forward_pre_hook(_before_forward, with_kwargs=True),
            gpt.register_forward_hook(_after_forward, with_kwargs=True),
        ]
        if last:
            _swap_output_layer(chunk, gpt, FusedOutputLayer(gpt.output_layer, config))
            # On this instance only; the class keeps megatron's method (used for real logits).
            gpt.compute_language_model_loss = types.MethodType(_language_model_loss, gpt)
    return model


def uninstall_fused_output_layer(model: ModelOrChunks) -> ModelOrChunks:
    """Put the original output layers back (e.g. before generation). Returns `model`.

    Parameters, gradients and optimizer state are untouched; `install_fused_output_layer` again
    resumes fused training."""
    todo = []
    for chunk in _chunks(model):
        gpt = unwrap_model(chunk)
        if _HOOKS not in gpt.__dict__:
            continue
        if isinstance(getattr(gpt, "output_layer", None), FusedOutputLayer):
            sharded.check_not_wrapped(chunk, gpt, "uninstall_fused_output_layer")
            foreign = _foreign_hooks(gpt.output_layer, _param_gather_wrappers(chunk))
            if foreign:
                raise ValueError(f"uninstall_fused_output_layer: the fused output layer has module "
                                 f"hooks that are not megatron DDP's ({', '.join(foreign)})")
        todo.append((chunk, gpt))
    for chunk, gpt in todo:
        for handle in gpt.__dict__.pop(_HOOKS):
            handle.remove()
        layer = getattr(gpt, "output_layer", None)
        if isinstance(layer, FusedOutputLayer):
            _swap_output_layer(chunk, gpt, layer.unfused)
            gpt.__dict__.pop("compute_language_model_loss", None)
    return model


def is_fused(model: torch.nn.Module) -> bool:
    """True if this (last-stage) chunk returns hidden states."""
    return isinstance(getattr(unwrap_model(model), "output_layer", None), FusedOutputLayer)


def run_in_output_layer(model: torch.nn.Module, op, hidden, **op_kwargs):
    """`op(hidden, weight, **op_kwargs)` on this stage's output weight, inside a call of the
    output layer (`run_in_layer`: the fused layer when installed, else megatron's own, as on the
    output_processor route), so that sharding engines' hooks surround it: DDP waits for the
    weight's all-gather there, FSDP gathers it and takes its gradient when autograd delivers it.
    `hidden` is cast to the weight's dtype (Float16Module hands the last stage's output back in
    fp32; exact for bf16/fp16 values)."""
    gpt = unwrap_model(model)
    return run_in_layer(gpt.output_layer, hidden, _cast_and_call(op, op_kwargs),
                        weight=_tied_weight(gpt))


def _tied_weight(gpt: torch.nn.Module) -> Optional[torch.Tensor]:
    """The tied weight GPTModel passes to its output layer (None when untied, and for the last
    stage's copy at PP > 1, which is the layer's own)."""
    if not getattr(gpt, "share_embeddings_and_output_weights", False):
        return None
    return given_weight(gpt.output_layer, gpt.shared_embedding_or_output_weight())


def output_weight(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """This stage's output-projection weight shard `[V/TP, h]`, tied or not (None off the last stage).

    Under an FSDP engine, outside the output layer's call this may be the sharded parameter."""
    gpt = unwrap_model(model)
    if not getattr(gpt, "post_process", False):
        return None
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
