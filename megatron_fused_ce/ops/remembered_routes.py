"""A remembered signature's call, straight through: the route the general path took, without its
argument handling.

At the row counts RL runs (1–4k tokens per rank) a call's time is its host time, and most of that
is deciding, not launching: checking and normalizing arguments, picking the backend, the tiling and
the chunk plan, building the chunk spec, the statistics' and the loss's bookkeeping (~1 ms of
Python around ~10 launches for cross-entropy at 2048×2048×19008 on an H200 host, where the same
launches in straight-line code take ~0.5 ms: docs/benchmarks.md, "RL shapes"). Every one of those
decisions is a function of the call's signature — shapes, dtypes, requires_grad, grad mode, the
Python-level options — and of what the signature's first call agreed (agreement.py). So where the
general path makes a later call of a remembered signature along a route listed here, it records
the route under the call's raw arguments, and the next calls with the same arguments run it
straight: the same backend functions, in the same order, on the same tensors — the same bits
(tests/test_remembered_routes.py compares values, dX and dW with the general path's, bit for bit).

Routes:

- `CrossEntropyRoute`: `linear_cross_entropy` "mean" / "sum" without label smoothing, z-loss,
  main_grad or an expected upstream gradient, at TP = 1, of one chunk whose statistics and dlogits
  come from the backend's one launch (fast.StatsWithDlogits): the logits GEMM, the label kernel
  (which checks the labels on the device, deferred_errors.py), stats_dlogits, the dX and dW GEMMs,
  the loss's sum, the loss itself the node's output (`StraightCrossEntropy`: the general path's
  first backward, and its second through a retained graph, from the same coefficients).
- `LogprobRoute`: `linear_logprobs` of one chunk at TP = 1 without entropy, sampler or sampling
  mask: forward-only (the reference and old-policy passes) or with the dlogits made in the forward.
- `ForwardGradRoute`: a loss on the forward-gradient contract of one chunk at TP = 1 without
  main_grad (`linear_grpo_loss`; cross-entropy where the one-launch statistics do not apply,
  `CrossEntropyThroughNode`): the label kernel with the loss's mask, then the general path's node
  with the call's own ForwardGradLoss; the loss builds that and its value (GRPO: its metrics) as
  the general path does.

A route is dropped with its signature (agreement.forget_signatures, or the signature's eviction),
and not taken where something outside its key decides otherwise: autocast on, saved-tensor hooks
in force, another backend selected, the one-launch kernel switched off or not applying. `ENABLED`
(module level, not an API) sends every call through the general path, for comparisons.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import agreement as agreement_memo, api, backends, deferred_errors
from .api import LabelledCount, LogprobsOutput, StraightFacts
from .chunked import (LinearLogprobDlogitsInForward, LinearLossGradInForward, first_order_only,
                      input_grad_from_coefs, token_coefficients, weight_grad_from_coefs)
from .fast import StatsWithDlogits, chunk_logits, fused_statistics, grad_gemms, runs_stats_dlogits
from .gemm import gemm_input
from .main_grad import saved_tensors_hooks_active

ENABLED = True

# call key -> route; bounded like the remembered signatures (a route whose signature was evicted
# is not taken: _Route.__call__)
_ROUTES: "OrderedDict[tuple, object]" = OrderedDict()
agreement_memo.MEMOS.append(_ROUTES)


def call_key(fn_name: str, hidden, weight, labels, tp_group, options: tuple) -> Optional[tuple]:
    """The raw arguments of a call as a route's key: what the general path's decisions depend on
    (shapes, dtypes, devices, requires_grad, grad mode, every Python-level option); None where no
    route applies (off, TP > 1, something that is not a tensor, under torch.compile's tracing)."""
    if not (ENABLED and tp_group is None and isinstance(hidden, Tensor) and isinstance(weight, Tensor)
            and isinstance(labels, Tensor)) or torch.compiler.is_compiling():  # (traced: the general path)
        return None
    return (fn_name, hidden.shape, hidden.dtype, hidden.device, hidden.requires_grad, weight.shape, weight.dtype,
            weight.device, weight.requires_grad, labels.shape, labels.dtype, labels.device, torch.is_grad_enabled(),
            tuple([(type(v), v) for v in options]))


def layout(value):
    """An argument as a key holds it: a tensor by its shape, dtype and device (not its values),
    anything else as it is."""
    if isinstance(value, Tensor):
        return ("tensor", value.shape, value.dtype, value.device)
    return value


def lookup(key: Optional[tuple]):
    """The route recorded under `key`, or None."""
    if key is None or not _ROUTES:
        return None
    try:
        route = _ROUTES.get(key)
    except TypeError:  # an unhashable option: no route
        return None
    if route is None:
        return None
    _ROUTES.move_to_end(key)
    return route


def remember(key: Optional[tuple], route) -> None:
    if key is None:
        return
    try:
        _ROUTES[key] = route
    except TypeError:
        return
    while len(_ROUTES) > agreement_memo.REMEMBERED_SIGNATURES:
        _ROUTES.popitem(last=False)


def _autocast_on(device: torch.device) -> bool:
    try:
        return torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError, ValueError):
        return False


class _Route:
    """A recorded route: the general path's decisions for its key (`facts`), run on a call's tensors."""

    def __init__(self, facts: StraightFacts, impl: str):
        self.facts, self.impl = facts, impl

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, **call):
        """The entry point's result, as the general path makes it; None where the route does not hold.
        `call`: what `run` takes beyond the tensors (a loss's per-call objects)."""
        hidden2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
        if not (agreement_memo.still_remembered(self.facts.signature)
                and backends.select(self.impl, hidden.device) is self.facts.spec.backend
                and not _autocast_on(hidden.device) and self.holds(hidden2d, weight)):
            return None
        if labels.dtype == torch.int32:
            labels = labels.long()
        return self.run(hidden2d, weight, labels if labels.dim() == 1 else labels.reshape(-1), labels.shape, **call)

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        """Whether the general path would take this route now, beyond the key, the signature, the
        backend and autocast."""
        raise NotImplementedError

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape):
        raise NotImplementedError

    def label_targets(self, flat_labels: Tensor, weight: Tensor, label_mask: Optional[Tensor] = None) -> tuple:
        """The label kernel as the general path's remembered signature runs it (_DeviceChecks):
        targets on the shard, labelled rows, counts, scalars (poison first); bad labels recorded."""
        facts = self.facts
        return facts.spec.backend.label_targets(flat_labels, facts.ignore_index, facts.true_vocab, 0, weight.shape[0],
                                                deferred_errors.flags(flat_labels.device), label_mask=label_mask)


class CrossEntropyRoute(_Route):
    """linear_cross_entropy's route of one whole-vocab chunk (module doc); `forward_grad` the call's
    CrossEntropyGrads ("mean" / "sum", no smoothing or z-loss)."""

    def __init__(self, facts: StraightFacts, forward_grad, impl: str):
        super().__init__(facts, impl)
        self.forward_grad = forward_grad

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        return not saved_tensors_hooks_active() and runs_stats_dlogits(self.facts.spec, hidden, weight)

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape) -> Tensor:
        return StraightCrossEntropy.apply(hidden, weight, flat_labels, self)


class StraightCrossEntropy(torch.autograd.Function):
    """CrossEntropyRoute's node: the general path's kernels for its one chunk (EarlyProduct's logits
    GEMM, _DeviceChecks' label kernel, LinearLossGradInForward's step with a StatsWithDlogits plan,
    TokenStats.negative_logprob_total), the loss itself as the output (the general path adds a zero
    anchor to it, which changes no bit). Backward: dX and dW made in the forward, scaled by the
    upstream gradient as LinearLossGradInForward's first backward scales them; a second backward
    through a retained graph recomputes them from the coefficients, as that node's does."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, route: CrossEntropyRoute):
        spec, forward_grad = route.facts.spec, route.forward_grad
        backend = spec.backend
        logits = chunk_logits(hidden, weight, spec)
        local_target, labelled, counts, scalars = route.label_targets(labels, weight)
        count = LabelledCount(counts, scalars, labelled)
        merged = StatsWithDlogits(forward_grad.scale_before_statistics(count)).run_(logits, local_target, spec,
                                                                                   labelled)
        dx = hidden.new_empty(hidden.shape) if hidden.requires_grad else None
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if weight.requires_grad else None
        grad_gemms(gemm_input(logits, hidden), hidden, weight, spec, dx, dw, dw_accumulate=False)
        del logits  # (its dlogits: freed once the GEMMs are queued, as the general path's chunk)
        loss = backend.labelled_loss_sum(merged.target, merged.max, merged.log_sum_exp, labelled,
                                         count.inverse if forward_grad.mean else None, scalars[:1])
        ctx.route, ctx.dx, ctx.dw = route, dx, dw
        # (for a second backward only: the coefficients are made from these there)
        ctx.merged, ctx.labelled, ctx.count = merged, labelled, count
        ctx.save_for_backward(hidden, weight, local_target)
        return loss

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        dx, dw = ctx.dx, ctx.dw
        if dx is not None or dw is not None:  # the first backward: what the forward made, times g
            ctx.dx = ctx.dw = None
            backend = ctx.route.facts.spec.backend
            if dx is None:
                return None, backend.scale_(dw, g), None, None
            return backend.scale_(dx, g, dw), dw, None, None
        hidden, weight, local_target = ctx.saved_tensors
        spec, merged = ctx.route.facts.spec, ctx.merged
        coefs = token_coefficients(ctx.route.forward_grad, merged, slice(0, hidden.shape[0]), ctx.count, ctx.labelled)
        coef_list = [coefs[k] for k in ("p", "pz", "target", "uniform")]
        offsets = (merged.max, merged.log_sum_exp)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = input_grad_from_coefs(spec, hidden, weight, None, local_target, offsets, coef_list, g,
                                                hidden.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad_from_coefs(spec, False, hidden, weight, None, local_target, offsets, coef_list,
                                                 g)
        return grad_hidden, grad_weight, None, None


class LogprobRoute(_Route):
    """linear_logprobs' routes of one chunk at TP = 1 without entropy, sampler or sampling mask
    (module doc): forward-only (the reference and old-policy passes: the logits GEMM, the label
    kernel, the stats kernel finishing each row's log-prob), or with the dlogits made in the forward
    (chunked.LinearLogprobDlogitsInForward, the general path's node)."""

    def __init__(self, facts: StraightFacts, impl: str):
        super().__init__(facts, impl)
        self.differentiable = facts.route == "log-probs dlogits in forward"

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        if self.differentiable:
            return (not saved_tensors_hooks_active()
                    and hidden.shape[0] * weight.shape[0] * weight.element_size() <= api.DLOGITS_IN_FORWARD_MAX_BYTES)
        return not fused_statistics(self.facts.spec.backend, hidden, weight)

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape) -> LogprobsOutput:
        spec = self.facts.spec
        if self.differentiable:
            local_target, labelled, _, scalars = self.label_targets(flat_labels, weight)
            logprob = LinearLogprobDlogitsInForward.apply(hidden, weight, local_target, labelled, spec,
                                                          lambda: scalars[:1])[0]
        else:
            logits = chunk_logits(hidden, weight, spec)
            local_target, _, _, scalars = self.label_targets(flat_labels, weight)
            logprob = spec.backend.shard_logprob(logits, local_target, spec.num_valid_cols, spec.inv_temperature,
                                                 scalars[:1])[0]
        return LogprobsOutput(logprob if logprob.shape == shape else logprob.reshape(shape))


class NodeStatistics(NamedTuple):
    """What ForwardGradRoute's node gives its loss: as api.TokenStats holds them."""

    anchor: Tensor
    target: Tensor
    max: Tensor
    log_sum_exp: Tensor
    labelled: Tensor
    num_labelled: LabelledCount
    poison: Tensor


class ForwardGradRoute(_Route):
    """A loss on the forward-gradient contract of one chunk at TP = 1 (linear_grpo_loss;
    cross-entropy where the one-launch statistics do not apply): the label kernel (with the loss's
    label mask), then the general path's node (chunked.LinearLossGradInForward, which plans the
    chunk as the general path does) with the call's own ForwardGradLoss; the loss adds the anchor
    to its value."""

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        return not saved_tensors_hooks_active()

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape, *, forward_grad,
            label_mask: Optional[Tensor] = None) -> NodeStatistics:
        local_target, labelled, counts, scalars = self.label_targets(flat_labels, weight, label_mask)
        count = LabelledCount(counts, scalars, labelled)
        anchor, target, _, _, _, row_max, log_sum_exp = LinearLossGradInForward.apply(
            hidden, weight, None, local_target, self.facts.spec, forward_grad, None, labelled, count)
        return NodeStatistics(anchor, target, row_max, log_sum_exp, labelled, count, scalars[:1])


class CrossEntropyThroughNode(ForwardGradRoute):
    """linear_cross_entropy's route where the one-launch statistics do not apply (fewer rows than
    they need, a backend's one-pass row kernel): ForwardGradRoute with the call's
    CrossEntropyGrads, then the loss kernel as TokenStats.negative_logprob_total calls it."""

    def __init__(self, facts: StraightFacts, forward_grad, impl: str):
        super().__init__(facts, impl)
        self.forward_grad = forward_grad

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape) -> Tensor:
        made = super().run(hidden, weight, flat_labels, shape, forward_grad=self.forward_grad)
        total = self.facts.spec.backend.labelled_loss_sum(
            made.target, made.max, made.log_sum_exp, made.labelled,
            made.num_labelled.inverse if self.forward_grad.mean else None, made.poison)
        return total + made.anchor
