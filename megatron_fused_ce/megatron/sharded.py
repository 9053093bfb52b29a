"""Output weights sharded over the data-parallel group: torch FSDP2 and Megatron-FSDP.

Both engines keep each parameter as a shard and gather it for use with module hooks of the module
that owns it, and learn from autograd when its gradient is ready:

* torch FSDP2 (`fully_shard`; megatron's `use_torch_fsdp2` wrapper, TorchFullyShardedDataParallel):
  a forward pre-hook of an FSDP unit all-gathers its parameters and sets the unsharded ones on
  the module; a hook on the unit's *inputs* fires once their gradient is computed and
  reduce-scatters the unit's gradients; the parameters are resharded after forward (unless
  `reshard_after_forward=False`) and after backward.
* Megatron-FSDP (`use_megatron_fsdp`, FullyShardedDataParallel): a forward pre-hook of every module
  all-gathers its own parameters (an FSDP unit's: all of them, released after its forward and
  backward; any other module's stay gathered); a per-parameter post-accumulate-grad hook
  reduce-scatters each gradient as autograd accumulates it.

So the fused path reads the output weight only inside a call of the output-layer module, as the
layer's own `self.weight`, never as an argument of the call (`output_layer.run_in_output_layer`):
the engines' hooks then surround the fused op, the weight is the gathered one, and its
gradient reaches the parameter (FSDP2's input hook fires after the op's backward, which produced
dX and dW at once). What this module adds:

* install order: the fused layer must be installed *before* the model is wrapped (the engines
  keep their hooks and parameter bookkeeping on the module they wrapped, so a layer swapped in
  afterwards would hold a stale, sharded weight); install / uninstall on a wrapped model raise.
* one all-gather per forward: GPTModel's call of the fused layer reads nothing and skips the
  module hooks (it only returns `LazyLogits`); the loss's call gathers the weight. An FSDP2 unit
  holding the fused layer keeps it gathered from that call to its post-backward reshard (no
  second all-gather for backward: one all-gather, one reduce-scatter per forward-backward); a
  forward-only pass reshards it after the fused op. Megatron-FSDP's default units (transformer
  layers) leave the output layer a non-unit module, gathered once and kept through the step, as
  for the unfused layer; with the fused layer among `fsdp_unit_modules` it is released after the
  loss's call and gathered again for its backward, like any Megatron-FSDP unit.
* megatron's TorchFullyShardedDataParallel makes every `ColumnParallelLinear` (not under the local
  spec) a unit; it makes the fused layer one too (`FusedOutputLayer._fsdp_modules`). Otherwise the
  weight belongs to the root unit, which that wrapper reshards after forward: a fused op would
  then find it still sharded, and raises saying so.
* no data-parallel collective from the op: its collectives are on the tensor-parallel group, and
  every rank produces a weight gradient (zeros without labelled tokens), so the engines issue the
  same collectives on every data-parallel rank whatever its number of tokens or chunks.
* tied embeddings: GPTModel passes the embedding's weight to the output layer, so it must be the
  gathered one when the loss runs: under Megatron-FSDP (the embedding a non-unit module) and under
  FSDP2 with the embedding in the root unit it is; an FSDP2 unit of the embedding's own reshards
  it after the embedding's forward, and the fused op raises (the unfused layer fails there too).
* the gradient is left to the engine: Megatron-FSDP allocates `main_grad` when the gradient
  arrives, so the op never adds into a `main_grad` it finds there.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

TORCH_FSDP2 = "torch FSDP2"
MEGATRON_FSDP = "Megatron-FSDP"

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch without FSDP2
    FSDPModule = ()
try:
    from torch.distributed.tensor import DTensor
except ImportError:
    DTensor = ()

_GATHER_KEPT = "_fused_ce_gather_kept"  # FusedOutputLayer.__dict__ key: FSDP2 policy set


def is_fsdp2_module(module: torch.nn.Module) -> bool:
    return bool(FSDPModule) and isinstance(module, FSDPModule)


def is_sharded_tensor(tensor) -> bool:
    """A DTensor: a parameter as FSDP2 (or Megatron-FSDP) stores it between its uses."""
    return bool(DTensor) and isinstance(tensor, DTensor)


def is_megatron_fsdp_param(param) -> bool:
    """Megatron-FSDP marks every parameter of the module it wraps."""
    return bool(getattr(param, "__fsdp_param__", False))


def _wrapper_chain(chunk: torch.nn.Module) -> Iterable[torch.nn.Module]:
    """`chunk`, the modules it wraps (`.module`), down to the language model."""
    module = chunk
    while module is not None:
        yield module
        if hasattr(module, "post_process"):
            return
        module = getattr(module, "module", None)


def sharding_engine(chunk: torch.nn.Module, gpt: torch.nn.Module) -> Optional[str]:
    """The FSDP engine that already wraps this model chunk's output layer, or None."""
    modules = list(_wrapper_chain(chunk))
    layer = getattr(gpt, "output_layer", None)
    if layer is not None:
        modules.append(layer)
    megatron_classes = {type(m).__name__ for m in modules if type(m).__module__.startswith("megatron")}
    weight = getattr(layer, "weight", None)
    if {"MegatronFSDP", "FullyShardedDataParallel"} & megatron_classes or is_megatron_fsdp_param(weight):
        return MEGATRON_FSDP
    if "TorchFullyShardedDataParallel" in megatron_classes or any(map(is_fsdp2_module, modules)) \
            or is_sharded_tensor(weight):
        return TORCH_FSDP2
    return None


def check_not_wrapped(chunk: torch.nn.Module, gpt: torch.nn.Module, action: str) -> None:
    """Raise if an FSDP engine already wraps the model: the fused layer is installed (and stays)
    before wrapping."""
    engine = sharding_engine(chunk, gpt)
    if engine is None:
        return
    if action == "install_fused_output_layer":
        raise ValueError(
            f"install_fused_output_layer: the model is already wrapped in {engine}. Install the "
            f"fused output layer before wrapping (before fully_shard / megatron's "
            f"TorchFullyShardedDataParallel or FullyShardedDataParallel, e.g. in the model "
            f"provider): the engine keeps its hooks and sharded parameters on the layer it "
            f"wrapped, so a layer swapped in afterwards would hold a stale weight.")
    raise ValueError(
        f"{action}: the model is wrapped in {engine}, whose hooks and sharded parameters belong "
        f"to the fused output layer now; swapping it back would leave the original layer with a "
        f"stale weight. For logits, build the model without the fused layer (same checkpoint keys).")


def keep_gathered_through_forward(layer: torch.nn.Module) -> None:
    """FSDP2 unit holding the fused layer: no reshard between GPTModel's call and the loss's call
    (one all-gather per forward-backward). Called before each forward of the model; acts once."""
    if not is_fsdp2_module(layer) or layer.__dict__.get(_GATHER_KEPT):
        return
    layer.set_reshard_after_forward(False, recurse=False)
    layer.__dict__[_GATHER_KEPT] = True


def after_fused_op(layer: torch.nn.Module) -> None:
    """After the fused op ran in the layer's call: a forward-only pass (no backward will reshard
    it) gives the FSDP2 unit's weight back to its shard."""
    if layer.__dict__.get(_GATHER_KEPT) and not torch.is_grad_enabled():
        layer.reshard()


def check_gathered(weight: torch.Tensor, *, tied: bool) -> None:
    """Inside the output layer's call the weight must be the gathered one."""
    if not is_sharded_tensor(weight):
        return
    if tied:
        raise ValueError(
            "the fused output layer was given a sharded (DTensor) tied output weight: under torch "
            "FSDP2 the word embedding's unit reshards it after the embedding's forward (the unfused "
            "layer cannot use it either); use untied output weights (as megatron's use_torch_fsdp2 "
            "requires) or leave the embedding to the root unit (kept gathered through the forward)")
    raise ValueError(
        "the fused output layer found its weight still sharded (a DTensor) when the fused op ran: "
        "the weight belongs to an FSDP2 unit that was resharded after the model's forward (e.g. "
        "the root unit with reshard_after_forward=True). Make the output layer a unit of its own: "
        "fully_shard(model.output_layer) after install_fused_output_layer and before "
        "fully_shard(model) (megatron's TorchFullyShardedDataParallel does this).")


def may_add_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether the op may add dW into a `main_grad` it finds on the weight (gradient-accumulation
    fusion). Not under Megatron-FSDP: it sets `main_grad` when the gradient arrives."""
    return not is_megatron_fsdp_param(weight)
