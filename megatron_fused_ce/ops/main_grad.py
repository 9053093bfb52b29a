"""Megatron's `main_grad` (gradient-accumulation fusion): the weight gradient written straight into
the parameter's fp32 buffer, and what keeps it exact when that happens during the forward pass.

A fused loss whose gradients are made in the forward (ops/forward_grad.py) and that is told the
upstream gradient g in advance (`expected_upstream_grad`) adds g x dW into `main_grad` while the
forward runs (chunked.LinearLossGradInForward). That is a side effect, so:

- `MainGradSideEffect`: a forward whose graph is freed without any backward (an evaluation pass
  outside torch.no_grad(), a micro-batch abandoned after an error) poisons main_grad with NaN
  instead of leaving it silently wrong (`poison_main_grad`);
- a forward whose graph is still alive, without a backward, when an optimizer steps (an evaluation
  loss held for logging, a micro-batch loss kept in a list) would have its dW read as part of the
  step's gradient: a step pre-hook on every torch optimizer (`check_before_optimizer_step`;
  Megatron's optimizers step a torch optimizer on the fp32 main parameters) poisons main_grad and
  raises before the update is applied;
- `check_upstream_grad`: the first backward compares the g it receives with the expected one; a
  different g cannot be corrected exactly, so main_grad is poisoned too;
- `unpaired_forward_error`: the next fused call on a poisoned parameter raises on every rank (the
  argument agreement), until the buffer is zeroed (Megatron's zero_grad_buffer); the optimizer-step
  check raises too while a poisoned main_grad still holds NaN.
Every other path applies g in the backward and has no side effect (docs/design.md §4.5).

Why a check and not a private buffer: keeping each forward's dW out of main_grad until its
backward arrives is the `expected_upstream_grad=None` path, one fp32 [V_local, H] buffer per
forward in flight (2 GiB at V_local=128256, H=4096) and 1-4 % slower; the check costs a look at
an empty set per optimizer step.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch
from torch import Tensor

from .step_checks import before_optimizer_steps


def adds_into_main_grad(weight: Tensor, accumulate_into_main_grad: bool) -> bool:
    """Whether dW goes into Megatron's fp32 `weight.main_grad` (gradient-accumulation fusion)."""
    return weight.requires_grad and accumulate_into_main_grad and hasattr(weight, "main_grad")


UNPAIRED_FORWARD_ATTR = "fused_ce_unpaired_forward"
UNPAIRED_FORWARD_MESSAGE = (
    "weight.main_grad holds the weight gradient of a forward pass that was never backpropagated "
    "(its autograd graph was freed without a backward: a loss computed under grad mode and dropped, "
    "e.g. an evaluation or log-prob pass outside torch.no_grad(), or a micro-batch abandoned after an "
    "error). With accumulate_into_main_grad the fast path adds dW to main_grad during the forward, so "
    "main_grad was filled with NaN instead of being left silently wrong. Zero the gradient buffer "
    "(Megatron: model.zero_grad_buffer()) before the next step, and run forward-only passes under "
    "torch.no_grad()")


class MainGradSideEffect:
    """The dW that LinearLossGradInForward (fast mode) added to `param.main_grad` during its forward,
    owned by the op's autograd node until a backward through it runs (`backpropagated`).

    If the node is freed with no backward ever run (the graph dropped, an exception after the
    forward), main_grad holds a gradient nobody asked for. It cannot be taken back here: that needs
    the chunk GEMMs again (and, under sequence parallelism, a collective on every rank at once),
    and the buffer may have been zeroed since. So main_grad is filled with NaN and the parameter
    marked: the next fused call on it raises on every rank (api.py) unless the buffer was zeroed
    in between, and the next optimizer step raises while it holds NaN. While the node is alive
    without a backward, the next optimizer step poisons and raises (check_before_optimizer_step)."""

    def __init__(self, param: Tensor):
        self.param = param
        self.backward_ran = False
        self.poisoned = False
        _OUTSTANDING.add(self)
        watch_optimizer_steps()

    def backpropagated(self) -> None:
        self.backward_ran = True
        _OUTSTANDING.discard(self)

    def poison(self, message: str) -> None:
        """main_grad filled with NaN and the parameter marked (once per side effect)."""
        _OUTSTANDING.discard(self)
        if self.poisoned or getattr(self.param, "main_grad", None) is None:
            return
        self.poisoned = True
        poison_main_grad(self.param, message)

    def __del__(self):
        if self.backward_ran:
            return
        try:
            self.poison(UNPAIRED_FORWARD_MESSAGE)
        except Exception:  # interpreter shutdown: nothing left to protect
            pass


# Side effects whose backward has not run yet (alive, weakly held), and parameters whose main_grad
# was poisoned: what the optimizer-step check reads. Both are empty in a correct training loop.
_OUTSTANDING: "weakref.WeakSet[MainGradSideEffect]" = weakref.WeakSet()
_POISONED: "weakref.WeakValueDictionary[int, Tensor]" = weakref.WeakValueDictionary()  # by id: tensors compare by value

OUTSTANDING_AT_STEP_MESSAGE = (
    "an optimizer step was taken while a fused loss computed with accumulate_into_main_grad (and "
    "expected_upstream_grad) in this process still had its autograd graph alive without a backward: "
    "an evaluation or log-prob loss computed outside torch.no_grad() and held (for logging), or a "
    "micro-batch loss kept in a list without loss.backward(). That forward added its weight gradient "
    "to main_grad, so the step would have trained on it; main_grad was filled with NaN and the update "
    "was not applied. Run forward-only passes under torch.no_grad() (or backpropagate every training "
    "loss before the step), then zero the gradient buffer (Megatron: model.zero_grad_buffer())")


def check_before_optimizer_step() -> None:
    """Run before every torch optimizer step (step_checks.py): raise (and poison main_grad) where a
    fused forward's dW sits in main_grad without its backward, or a poisoned main_grad still holds
    NaN. Nothing to read, no host sync, in a correct loop."""
    pending = [effect for effect in list(_OUTSTANDING) if not effect.backward_ran]
    if pending:
        for effect in pending:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the error below says it
                effect.poison(OUTSTANDING_AT_STEP_MESSAGE)
        raise RuntimeError("megatron_fused_ce: " + OUTSTANDING_AT_STEP_MESSAGE)
    for param in list(_POISONED.values()):
        message = unpaired_forward_error(param)  # reads main_grad only while the mark is set
        if message:
            raise RuntimeError("megatron_fused_ce: an optimizer step was taken on a gradient that "
                               "holds NaN on purpose: " + message)


def watch_optimizer_steps() -> None:
    before_optimizer_steps(check_before_optimizer_step)


def poison_main_grad(param: Tensor, message: str) -> None:
    """Fill `param.main_grad` with NaN and mark the parameter with `message`: an optimizer step sees
    NaN, and the next fused call on it raises `message` on every rank (unpaired_forward_error)."""
    param.main_grad.fill_(float("nan"))
    setattr(param, UNPAIRED_FORWARD_ATTR, message)
    _POISONED[id(param)] = param
    watch_optimizer_steps()
    warnings.warn("megatron_fused_ce: " + message, RuntimeWarning, stacklevel=3)


# g may differ from the expected value by the rounding of how each side computes it (Megatron
# divides the loss by the token count, then by the number of micro-batches, in fp32): a few ulps.
EXPECTED_GRAD_RTOL = 2.0 ** -20

UPSTREAM_GRAD_MISMATCH_MESSAGE = (
    "the upstream gradient of a loss computed with expected_upstream_grad={expected:.7g} was {actual:.7g}. "
    "With accumulate_into_main_grad the fast path added expected_upstream_grad x dW to main_grad during "
    "the forward; a different gradient cannot be corrected exactly (the difference of two terms of the "
    "size of dW keeps nothing of a small gradient), so main_grad was filled with NaN instead. Pass the "
    "gradient the backward will bring (Megatron's loss funcs: num_microbatches for "
    "calculate_per_token_loss=False), or leave expected_upstream_grad=None (dW then waits in an fp32 "
    "buffer for the backward). Zero the gradient buffer (model.zero_grad_buffer()) before the next step")


def check_upstream_grad(param: Tensor, actual: float, expected: float) -> None:
    """The first backward of a forward that added expected·dW into main_grad: poison main_grad
    unless the upstream gradient is the expected one (up to EXPECTED_GRAD_RTOL)."""
    if abs(actual - expected) <= EXPECTED_GRAD_RTOL * abs(expected):
        return
    poison_main_grad(param, UPSTREAM_GRAD_MISMATCH_MESSAGE.format(expected=expected, actual=actual))


def unpaired_forward_error(param: Optional[Tensor]) -> Optional[str]:
    """The error for a fused call that adds into `param.main_grad` while it still holds NaN from a
    gradient that could not be made exact (an unpaired forward: MainGradSideEffect; an unexpected
    upstream gradient: check_upstream_grad); None, and the mark cleared, once it was zeroed.
    Reads main_grad (one pass, one host sync) only while the mark is set."""
    message = None if param is None else getattr(param, UNPAIRED_FORWARD_ATTR, None)
    if not message:
        return None
    if bool(torch.isnan(param.main_grad).any()):
        return message if isinstance(message, str) else UNPAIRED_FORWARD_MESSAGE
    setattr(param, UNPAIRED_FORWARD_ATTR, None)
    _POISONED.pop(id(param), None)
    return None


def main_grad_added(param: Tensor, weight: Tensor) -> Optional[Tensor]:
    """Megatron's gradient-accumulation-fusion convention (its ColumnParallelLinear backward): the
    gradient is already in main_grad; hand autograd a dummy gradient so that DDP's per-parameter
    hook still fires. DDP ignores it unless the parameter has `zero_out_wgrad` (a weight tied to
    the embedding on the same stage: DDP then adds .grad, the embedding's gradient plus this
    dummy, to main_grad), so it is zeros only then; uninitialized otherwise (no [V, H] memset
    per micro-batch)."""
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        if getattr(param, "zero_out_wgrad", False):
            return torch.zeros_like(weight)
        return torch.empty_like(weight)
    return None


def saved_tensors_hooks_active() -> bool:
    """Whether autograd's saved-tensor hooks are in force (torch.utils.checkpoint with
    use_reentrant=False, activation offloading): tensors saved for backward may then be dropped
    and the forward run again during backward, so a forward pass must have no side effect."""
    top = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None
