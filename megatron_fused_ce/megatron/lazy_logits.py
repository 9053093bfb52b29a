"""`LazyLogits`: what the fused output layer returns where Megatron expects logits.

GPTModel does three things with the output layer's logits, on every megatron-core version we
support, and MTP adds a fourth:

    loss = self.compute_language_model_loss(labels, logits)    # labels given (main head, MTP)
    return logits.transpose(0, 1).contiguous()                  # labels=None: [s, b] -> [b, s]
    preds = torch.argmax(logits, dim=-1)                        # >= 0.19: MTP acceptance rate

A `LazyLogits` stands for the gathered logits `[s, b, V]` of one output-layer call and holds what
they would be computed from (the hidden states and the weight shard). Each of those uses is
answered without ever forming them:

* the cross-entropy goes through the fused op, chunk by chunk (`cross_entropy`; the model's
  `compute_language_model_loss` is pointed here by `install_fused_output_layer`);
* the `[s, b] -> [b, s]` transpose returns the hidden states `[b, s, h]`: that is how the last
  stage hands hidden states to the loss function instead of logits;
* `argmax` over the vocab runs a forward-only chunked argmax (ops/argmax.py); the fused layer
  reports `gather_output=True`, so megatron takes the argmax of these "gathered" logits directly
  (global ids, no vocab-parallel merge of its own).

Anything else raises: an operation we do not know would otherwise read values that do not exist.
Both computations run *inside a call of the output-layer module* (`layer.run(hidden, compute)`),
so module hooks of sharding engines (Megatron's param-gather wait, FSDP's unshard and gradient
reduce-scatter) fire around the weight's use.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_fused_ce import linear_cross_entropy
from megatron_fused_ce.ops import reductions
from megatron_fused_ce.ops.argmax import linear_argmax

# Properties read from `Tensor` that only look at metadata (no values).
_METADATA_PROPERTIES = tuple(getattr(torch.Tensor, name) for name in (
    "shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_sparse",
    "grad_fn", "is_leaf"))
_METADATA_METHODS = (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__, torch.Tensor.numel)


def _is_metadata(func) -> bool:
    if func in _METADATA_METHODS:
        return True
    return getattr(func, "__name__", None) == "__get__" and getattr(func, "__self__", None) in \
        _METADATA_PROPERTIES


def _last_dim(dim, ndim: int) -> bool:
    return dim is not None and dim % ndim == ndim - 1


class LazyLogits(torch.Tensor):
    """The gathered logits `hidden @ W_full.T` of one output-layer call, never materialized.

    Shape/dtype/device are those of the logits (`[s, b, V]`, s gathered under sequence
    parallelism). `hidden` (Megatron's `[s(/TP), b, h]`), `weight` (`[V/TP, h]`), `layer` (the
    FusedOutputLayer that made it) and `given_weight` (the weight GPTModel passed in, e.g. the
    tied one; None when it is the layer's own) are plain attributes.
    """

    @staticmethod
    def __new__(cls, hidden: Tensor, weight: Tensor, layer, given_weight: Optional[Tensor] = None):
        tp = reductions.group_size(layer.tp_group)
        shape = list(hidden.shape[:-1]) + [weight.shape[0] * tp]
        if layer.splits_sequence:
            shape[0] *= tp
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=weight.dtype,
                                                   device=hidden.device, requires_grad=False)
        self.hidden, self.weight, self.layer, self.given_weight = hidden, weight, layer, given_weight
        return self

    def __repr__(self):
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, never materialized)"

    # -- what megatron does with logits ----------------------------------------------------------
    def cross_entropy(self, labels: Tensor) -> Tensor:
        """Per-token `-log softmax(logits)[label]` over the full (padded) vocab, `[b, s]` fp32, as
        `compute_language_model_loss(labels [b, s], logits)`; differentiable."""
        layer = self.layer

        def fused(hidden, weight):
            return linear_cross_entropy(hidden.to(weight.dtype), weight, labels.t(), reduction="none",
                                        **layer.fused_op_kwargs(weight))

        return layer.run(self.hidden, fused, weight=self.given_weight).t().contiguous()

    def hidden_states(self) -> Tensor:
        """`[b, s, h]` (`[b, s/TP, h]` under sequence parallelism): the last stage's output."""
        return self.hidden.transpose(0, 1)

    def argmax(self, dim: Optional[int] = None, keepdim: bool = False) -> Tensor:
        # (no dim: torch's flat argmax over every element, which is not the vocab's: refused)
        if not _last_dim(dim, self.dim()) or keepdim:
            raise RuntimeError(f"LazyLogits.argmax: only over the vocab (dim=-1), got dim={dim}, "
                               f"keepdim={keepdim}")
        layer = self.layer

        def fused(hidden, weight):
            kwargs = layer.fused_op_kwargs(weight)
            for name in ("accumulate_into_main_grad", "memory_mode", "logits_dtype", "max_chunk_bytes"):
                del kwargs[name]
            return linear_argmax(hidden, weight, **kwargs)

        return layer.run(self.hidden, fused, weight=self.given_weight)

    # -- dispatch ---------------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_metadata(func):
            return super().__torch_function__(func, types, args, kwargs)
        self = args[0] if args and isinstance(args[0], LazyLogits) else None
        if self is not None:
            if func in (torch.Tensor.transpose, torch.transpose):
                dims = sorted(d % self.dim() for d in list(args[1:3]) + list(kwargs.values()))
                if dims == [0, 1]:
                    return self.hidden_states()
            if func in (torch.Tensor.argmax, torch.argmax):
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                return self.argmax(dim, kwargs.get("keepdim", False))
            if func is torch.Tensor.__repr__:
                return self.__repr__()
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"the fused output layer returns LazyLogits, which are never materialized: {name} is "
            f"not supported (only cross-entropy via compute_language_model_loss, the [s, b] -> "
            f"[b, s] transpose and argmax over the vocab). For real logits (generation, "
            f"evaluation) call uninstall_fused_output_layer(model) first.")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"LazyLogits have no values ({func}); see LazyLogits.__torch_function__")
