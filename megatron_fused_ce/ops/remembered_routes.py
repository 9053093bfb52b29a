"""A remembered signature's call, straight through: the route the general path took, without its
argument handling.

At the row counts RL runs (1–4k tokens per rank) a call's time is its host time, and most of that
is deciding, not launching: checking and normalizing arguments, picking the backend, the tiling and
the chunk plan, building the chunk spec, the statistics' and the loss's bookkeeping (~1 ms of
Python around ~10 launches for cross-entropy at 2048×2048×19008 on an H200 host, where the same
launches in straight-line code take ~0.5 ms: docs/design.md §10.9). Every one of those
decisions is a function of the call's signature — shapes, dtypes, requires_grad, grad mode, the
Python-level options — and of what the signature's first call agreed (agreement.py). So where the
general path makes a later call of a remembered signature along a route listed here, it records
the route under the call's raw arguments, and the next calls with the same arguments run it
straight: the same backend functions, in the same order, on the same tensors — the same bits
(tests/test_remembered_routes.py compares values, dX and dW with the general path's, bit for bit).

Routes:

- `CrossEntropyRoute`: `linear_cross_entropy` "mean" / "sum" without label smoothing, z-loss,
  main_grad or an expected upstream gradient, of one chunk; `GRPORoute`: `linear_grpo_loss` of one
  chunk without context parallelism, a sampling mask or main_grad. Both run one lean node,
  `StraightLoss`: (under sequence parallelism the gather of the sequence,) the logits GEMM, the
  label kernel (which checks the labels on the device, deferred_errors.py; GRPO's with its mask),
  the statistics and dlogits (at TP = 1 one launch, fast.StatsWithDlogits, where cross-entropy
  takes it, and GRPO's statistics, terms, metrics and dlogits in one, fast.TermsInLaunch, where it
  takes that; else the statistics (fast.merged_chunk_statistics), the loss's per-token coefficients
  — GRPO's per-token kernel with its metrics — and the dlogits kernel), the dX GEMM and the start
  of dX's TP sum, the dW GEMM, the loss value itself the node's output; the general path's first
  backward, and its second through a retained graph, from the same coefficients. Where the
  backend's one-pass row kernel takes the chunk (QuACK's, TP = 1), it makes the statistics and
  softmax - one_hot, and each row's factor is applied in the dX and dW GEMMs
  (fast.row_scaled_grad_gemms), as the general path does with a count on the device.
- `LogprobRoute`: `linear_logprobs` of one chunk without entropy, sampler or sampling mask:
  forward-only (the reference and old-policy passes; at TP = 1 up to a few thousand rows the label
  checks and log-probs in one launch, backends.LabelLogprob) or with the dlogits made in the
  forward; and forward-only from the fused statistics GEMM (no logits in memory), in any number of
  chunks.
  `PerTokenLossRoute`: `linear_cross_entropy`'s per-token losses ("none" without label smoothing
  or z-loss: Megatron's output layer) on the same routes, negated.
- `ReplayRoute`: `linear_logprobs` with a sampling mask (replay.py), with or without entropy,
  without sequence parallelism: its key holds the mask's layout, not how many ids it keeps; each
  call makes its layout, device checks and pieces from its own mask (replay.replay_tiling), then
  the statistics, the log-probs (one launch) and `StraightReplay`'s backward, the general path's
  nodes' in one.

Every route but the replay's launches its call's first GEMM (the logits, or the fused statistics)
before the rest of its host work, its own checks included (where one fails, the general path runs
and the product is dropped): at RL row counts an eager call from an idle GPU waits for what the
host does before that launch. At TP = 1, up to a few thousand rows, the label kernel's work
rides in the launch that then reads the logits (the stats launch finishing each row:
backends.LabelLogprob; cross-entropy's and log-probs' one launch of statistics and dlogits:
stats_dlogits.with_labels), the same bits a launch fewer.

At TP > 1 a route makes what the general path's remembered signature makes for the ranks to agree
on: the label kernel's fingerprints of the signature, the labels and the loss's must-agree
tensors, riding on the statistics' all-gather (reductions.RankCheck), whose verdict poisons
the results; the same collectives in the same order, so a rank whose call takes the general path
meets its peers' routed calls.

A route is dropped with its signature (agreement.forget_signatures, or the signature's eviction),
and not taken where something outside its key decides otherwise: autocast on, saved-tensor hooks
in force, another backend selected, the one-launch kernel switched off or not applying. `ENABLED`
(module level, not an API) sends every call through the general path, for comparisons.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from . import agreement as agreement_memo, api, backends, deferred_errors, reductions, replay
from .api import LabelledCount, LogprobsOutput, StraightFacts
from .chunked import (coefficients, first_order_only, forward_stats, input_grad_from_coefs,
                      logprobs_with_dlogits, recompute_grads, token_coefficients, weight_grad_from_coefs)
from .fast import (FAST_CHUNKS, FUSED_STATS_MIN_BYTES, DlogitsMadeInForward, StatsWithDlogits, TermsInLaunch,
                   chunk_logits,
                   fused_statistics, labelled_gemm_statistics, logits_partials, row_kernel_takes, runs_stats_dlogits)
from .forward_grad import PER_ROW
from .gemm import logits_gemm
from .main_grad import saved_tensors_hooks_active
from .reductions import merged_logprobs

ENABLED = True

# call key -> route; bounded like the remembered signatures (a route whose signature was evicted
# is not taken: _Route.__call__)
_ROUTES: "OrderedDict[tuple, object]" = OrderedDict()
agreement_memo.MEMOS.append(_ROUTES)


def call_key(fn_name: str, hidden, weight, labels, tp_group, options: tuple) -> Optional[tuple]:
    """The raw arguments of a call as a route's key: what the general path's decisions depend on
    (shapes, dtypes, devices, requires_grad, grad mode, the TP group, every Python-level option);
    None where no route applies (off, something that is not a tensor, under torch.compile's
    tracing, an option given as a tensor: agreement.typed_options)."""
    if not (ENABLED and isinstance(hidden, Tensor) and isinstance(weight, Tensor)
            and isinstance(labels, Tensor)) or torch.compiler.is_compiling():  # (traced: the general path)
        return None
    typed = agreement_memo.typed_options(options)
    if typed is None:
        return None
    return (fn_name, hidden.shape, hidden.dtype, hidden.device, hidden.requires_grad, weight.shape, weight.dtype,
            weight.device, weight.requires_grad, labels.shape, labels.dtype, labels.device, torch.is_grad_enabled(),
            None if tp_group is None else id(tp_group), typed)


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
        shape = labels.shape
        flat_labels = labels if labels.dim() == 1 else labels.reshape(-1)
        if flat_labels.dtype == torch.int32:
            flat_labels = flat_labels.long()
        # the call's first GEMM before the checks below: an eager call from an idle GPU waits for
        # the host's work before that launch (the checks took 20-45 us of it on an H200 host); where
        # one fails, the general path runs and this product is dropped unused
        first = self.first_product(hidden2d, weight, flat_labels)
        if not (agreement_memo.still_remembered(self.facts.signature)
                and (self.facts.group is None or self.facts.group() is not None)
                and backends.select(self.impl, hidden.device) is self.facts.spec.backend
                and not _autocast_on(hidden.device) and self.holds(hidden2d, weight)):
            return None
        return self.run(hidden2d, weight, flat_labels, shape, first, **call)

    def first_product(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor):
        """The route's first GEMM, launched before the rest of the call's host work: its logits
        (first_logits), or None where the route makes it later."""
        return self.first_logits(hidden, weight)

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        """Whether the general path would take this route now, beyond the key, the signature, the
        backend and autocast."""
        raise NotImplementedError

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape, first):
        """The route's work; `first`: first_product's."""
        raise NotImplementedError

    def device_checks(self, flat_labels: Tensor, weight: Tensor, label_mask: Optional[Tensor] = None,
                      agree_tensors: tuple = (), call_values: tuple = ()) -> tuple:
        """The label kernel as the general path's remembered signature runs it (_DeviceChecks) and,
        at TP > 1, the rank check its pieces ride on (token_statistics'): (targets on the shard,
        labelled rows, counts, scalars (poison first), the call's spec (with its rank check)); bad
        labels recorded. `agree_tensors`: the loss's tensors every rank must share, in the general
        path's order (its must_agree's); `call_values`: its numbers that may change per call
        (api.call_values), mixed into the rank check's code as the general path mixes them."""
        facts = self.facts
        local_target, labelled, counts, scalars, flags = self.label_checks(flat_labels, weight, label_mask,
                                                                           agree_tensors, call_values)
        spec = facts.spec
        if facts.group is not None:  # (TP > 1: the group, and the call's rank check)
            spec = replace(spec, tp_group=self.group(), rank_check=reductions.RankCheck(scalars[3:],
                                                                                        poison=scalars[:1], flags=flags))
        return local_target, labelled, counts, scalars, spec

    def label_checks(self, flat_labels: Tensor, weight: Tensor, label_mask: Optional[Tensor] = None,
                     agree_tensors: tuple = (), call_values: tuple = ()) -> tuple:
        """The label kernel alone (device_checks' first step): (targets on the shard, labelled rows,
        counts, scalars (poison first, then at TP > 1 the rank check's pieces), the flags word)."""
        facts = self.facts
        flags = deferred_errors.flags(flat_labels.device)
        local_target, labelled, counts, scalars = facts.spec.backend.label_targets(
            flat_labels, facts.ignore_index, facts.true_vocab, facts.vocab_start, weight.shape[0], flags,
            api.call_code(facts.signature_code, call_values), agree_tensors if facts.signature_code is not None else (),
            label_mask)
        return local_target, labelled, counts, scalars, flags

    def labels_in_stats_launch(self, rows: Tensor) -> bool:
        """Whether a chunk of `rows` at TP = 1 whose statistics the stats launch finishes takes the
        label kernel's work in that launch (backends.LabelLogprob: the two launches' results, the
        same bits): the route's host time at RL row counts is its launches and their allocations."""
        spec = self.facts.spec
        return (self.facts.group is None and spec.backend.label_logprob is not None
                and not (spec.want_sum_logits or spec.want_entropy)
                and spec.backend.label_logprob.applies(rows.shape[0], spec.num_valid_cols, rows.device))

    def labels_in_one_launch(self, rows: Tensor, weight: Tensor) -> bool:
        """Whether a chunk of `rows` takes its label checks in its launch of statistics and dlogits
        (TP = 1, where the backend's stats_dlogits.with_labels applies: a launch and its host work
        fewer, the same bits as the label kernel and that launch)."""
        spec = self.facts.spec
        with_labels = None if spec.backend.stats_dlogits is None else spec.backend.stats_dlogits.with_labels
        row_bytes = weight.shape[0] * (4 if spec.logits_dtype is not None else weight.element_size())
        return (with_labels is not None and self.facts.group is None and rows.shape[0] <= spec.chunk_size
                and with_labels.applies(rows.shape[0], spec.num_valid_cols, row_bytes, rows.device))

    def stats_with_labels(self, logits: Tensor, flat_labels: Tensor, label_mask: Optional[Tensor]) -> tuple:
        """backends.LabelLogprob's with_statistics on the chunk (where labels_in_stats_launch), its
        device checks recorded as the label kernel records them."""
        facts, spec = self.facts, self.facts.spec
        return spec.backend.label_logprob.with_statistics(
            logits, flat_labels, facts.ignore_index, facts.true_vocab, facts.vocab_start, spec.num_valid_cols,
            spec.inv_temperature, deferred_errors.flags(logits.device), label_mask)

    def stats_dlogits_with_labels_(self, logits: Tensor, flat_labels: Tensor, **kind) -> tuple:
        """backends.LabelsInLaunch's run_ on the chunk (`kind`: mean=, scale= or logprob=), its
        device checks recorded in deferred_errors' flags as the label kernel records them."""
        facts, spec = self.facts, self.facts.spec
        return spec.backend.stats_dlogits.with_labels.run_(
            logits, flat_labels, facts.ignore_index, facts.true_vocab, facts.vocab_start, spec.num_valid_cols,
            spec.inv_temperature, deferred_errors.flags(logits.device), **kind)

    def stats_and_terms_with_labels_(self, forward_grad, logits: Tensor, label_mask: Optional[Tensor]) -> tuple:
        """fast.TermsInLaunch's launch on the chunk with the label checks in it (the loss's
        stats_and_terms_ on its own labels, given its label mask), recorded as the label kernel
        records them -> stats_dlogits_with_labels_' tuple."""
        facts = self.facts
        return forward_grad.stats_and_terms_(
            logits, facts.spec, label_mask=label_mask, true_vocab=facts.true_vocab, vocab_start=facts.vocab_start,
            flags=deferred_errors.flags(logits.device))

    def first_logits(self, hidden: Tensor, weight: Tensor) -> Optional[Tensor]:
        """The call's logits GEMM, launched before the rest of its host work (the route's checks,
        the node, the label kernel, a loss's per-call objects). None under sequence parallelism
        (the node gathers the sequence first)."""
        spec = self.facts.spec
        if spec.sequence_parallel:
            return None
        with torch.no_grad():
            return logits_gemm(hidden, weight, spec.logits_dtype)

    def group(self):
        """The TP group (None at TP = 1)."""
        return None if self.facts.group is None else self.facts.group()

    @staticmethod
    def poison(scalars: Tensor, spec) -> Tensor:
        """The call's poison once its statistics are merged: the rank check's (with its verdict), or
        the label kernel's."""
        return scalars[:1] if spec.rank_check is None else spec.rank_check.poison


class _LossRoute(_Route):
    """A loss on the forward-gradient contract (forward_grad.py) of one whole-vocab chunk: its node
    is `StraightLoss`; the loss's value from `loss`. At TP = 1, `row_kernel`: the backend's one-pass
    row kernel makes the statistics and softmax - one_hot, a factor per row applied in the GEMMs
    (the general path's plan PER_ROW); `one_launch`: the statistics and dlogits come from the
    backend's one launch (fast.StatsWithDlogits); else from the statistics' launch(es) (merged over
    TP ranks) and the dlogits kernel (the general path's plan None)."""

    def __init__(self, facts: StraightFacts, impl: str):
        super().__init__(facts, impl)
        self.one_launch = facts.route == "gradients in forward, one launch"
        self.row_kernel = facts.route == "gradients in forward, row kernel"

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        # (the row kernel, then the one launch, are the general path's choices where they run and
        # the loss takes them: both at TP = 1 only)
        if saved_tensors_hooks_active():
            return False
        if self.facts.group is not None:
            return True
        if row_kernel_takes(self.facts.spec, hidden, weight, hidden.shape[0]) != self.row_kernel:
            return False
        return (self.row_kernel or not self.may_take_one_launch
                or runs_stats_dlogits(self.facts.spec, hidden, weight) == self.one_launch)

    may_take_one_launch = True  # the loss's dlogits may come from the one launch (its c is known before)

    def before_coefficients(self, forward_grad, poison: Tensor) -> None:
        """What the loss takes before its per-token coefficients: the call's poison."""

    def loss(self, forward_grad, merged, labelled: Tensor, count: LabelledCount, poison: Tensor) -> Tensor:
        """The loss value (a new tensor: the node's output) from the chunk's merged statistics."""
        raise NotImplementedError


class CrossEntropyRoute(_LossRoute):
    """linear_cross_entropy's route (module doc); `forward_grad` the call's CrossEntropyGrads
    ("mean" / "sum", no smoothing or z-loss: the same for every call of the key)."""

    def __init__(self, facts: StraightFacts, forward_grad, impl: str):
        super().__init__(facts, impl)
        self.forward_grad = forward_grad

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape, first) -> Tensor:
        return StraightLoss.apply(hidden, weight, flat_labels, self, self.forward_grad, None, (), (), first)

    def loss(self, forward_grad, merged, labelled, count, poison) -> Tensor:
        # TokenStats.negative_logprob_total's kernel
        return self.facts.spec.backend.labelled_loss_sum(merged.target, merged.max, merged.log_sum_exp, labelled,
                                                         count.inverse if forward_grad.mean else None, poison)


class GRPORoute(_LossRoute):
    """linear_grpo_loss' route (module doc): the call's GRPOGrads (its own per-token table), label
    mask and the tensors every TP rank must share (`agree_tensors`, in the general path's order);
    the metrics are GRPOGrads.metrics', the loss (the node's output) the per-token kernel's own,
    given the call's poison before the coefficients (where the torch definition runs instead: a
    copy of the metrics' entry)."""

    may_take_one_launch = False  # (a GRPO token's coefficient needs its log-prob first)

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape, first, *, per_call) -> tuple:
        """`per_call()`: the call's (GRPOGrads, label mask, agree_tensors, call_values), made while
        the logits GEMM runs."""
        forward_grad, label_mask, agree_tensors, call_values = per_call()
        loss = StraightLoss.apply(hidden, weight, flat_labels, self, forward_grad, label_mask, agree_tensors,
                                  call_values, first)
        return loss, forward_grad.reported

    def before_coefficients(self, forward_grad, poison: Tensor) -> None:
        forward_grad.poison = poison  # (the per-token kernel adds it and writes the loss apart)

    def loss(self, forward_grad, merged, labelled, count, poison) -> Tensor:
        forward_grad.reported = forward_grad.metrics(labelled.shape[0], None, poison)
        # handed over, not kept: this output's node holds forward_grad (its ctx), so a reference to
        # the output from there would be a cycle, left to Python's collector every call
        loss, forward_grad.loss_value = forward_grad.loss_value, None
        if loss is not None:
            return loss
        return forward_grad.reported["loss"].clone()  # (not a view: the output may be changed in place)


class StraightLoss(torch.autograd.Function):
    """A _LossRoute's node: the general path's work for its one chunk, in its order —
    LinearLossGradInForward's gather of the sequence (sequence parallelism), EarlyProduct's logits
    GEMM, _DeviceChecks' label kernel (with the loss's label mask; at TP > 1 with the rank check's
    pieces), the statistics and dlogits of LinearLossGradInForward's step by the plan the general
    path chose (fast.FastChunks' logits_statistics_ and forward_grads: StatsWithDlogits' one
    launch; the row kernel; or fast.merged_chunk_statistics — over TP ranks, the rank check riding
    on the merge — the loss's per-token coefficients and the dlogits kernel), the dX GEMM and the
    start of dX's TP sum, the dW GEMM — and the loss value as the output (the general path adds a
    zero anchor to it, which changes no bit). Backward: dX (summed over TP ranks) and dW made in the
    forward, scaled by the upstream gradient as LinearLossGradInForward's first backward scales
    them; a second backward through a retained graph recomputes them from the coefficients, as that
    node's does."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, route: _LossRoute, forward_grad, label_mask, agree_tensors, call_values,
                logits):
        facts = route.facts
        full = reductions.gather_sequence(hidden, route.group()) if facts.spec.sequence_parallel else hidden
        if logits is None:  # (route.first_product's where it launched them)
            logits = chunk_logits(full, weight, facts.spec)
        # at TP = 1 the label kernel's work in the launch that reads the logits, where one applies:
        # the one launch of statistics and dlogits (cross-entropy's route: its c 1 / labelled rows,
        # "mean", or 1, "sum": CrossEntropyGrads.scale_before_statistics'), GRPO's one launch of
        # statistics, terms and dlogits, or the stats launch that finishes each row (GRPO's route
        # beyond that launch's rows; its mask joins the labels there)
        in_launch = plan = None
        if route.one_launch and label_mask is None and route.labels_in_one_launch(full, weight):
            plan = StatsWithDlogits(None)
            in_launch = route.stats_dlogits_with_labels_(logits, labels, mean=forward_grad.mean)
        elif (not (route.one_launch or route.row_kernel) and facts.group is None
              and TermsInLaunch.applies(facts.spec, forward_grad, full, weight)):
            # (GRPO's at TP = 1: the general path's plan where it applies; the remembered spec holds
            # no group, a call's own is set by device_checks) the statistics, the loss's terms and
            # metrics and the dlogits in one launch, the label checks in it; where it does not
            # compile, the launches apart below (the logits untouched)
            in_launch = route.stats_and_terms_with_labels_(forward_grad, logits, label_mask)
            plan = None if in_launch is None else TermsInLaunch(forward_grad, None)
        if in_launch is None and not (route.one_launch or route.row_kernel) and route.labels_in_stats_launch(full):
            in_launch = route.stats_with_labels(logits, labels, label_mask)
        if in_launch is not None:
            row_max, target, log_sum_exp, lse, _, local_target, labelled, counts, scalars = in_launch
            spec = facts.spec
            merged = reductions.MergedStats(lse=lse, target=target, max=row_max, log_sum_exp=log_sum_exp)
            count = LabelledCount(counts, scalars, labelled)
        else:
            local_target, labelled, counts, scalars, spec = route.device_checks(labels, weight, label_mask,
                                                                                agree_tensors, call_values)
            count = LabelledCount(counts, scalars, labelled)
            # the general path's plan for the chunk (fast.FastChunks.forward_plan's choice, remembered)
            plan = (StatsWithDlogits(forward_grad.scale_before_statistics(count)) if route.one_launch
                    else PER_ROW if route.row_kernel else None)
            merged = FAST_CHUNKS.logits_statistics_(plan, logits, local_target, spec, labelled)
        poison = route.poison(scalars, spec)  # (after the merge: the rank check's verdict in it)
        coefs = None
        if not route.one_launch:  # (with the one launch: the coefficients only if a second backward comes)
            route.before_coefficients(forward_grad, poison)
            coefs = token_coefficients(forward_grad, merged, slice(0, full.shape[0]), count, labelled)
        dx = full.new_empty(full.shape) if hidden.requires_grad else None
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if weight.requires_grad else None
        # (dX's sum over TP ranks starts right after its GEMM, beside the dW GEMM)
        dx_sum = None if dx is None or spec.tp_group is None else reductions.InputGradSum(dx, spec.tp_group,
                                                                                           spec.sequence_parallel)
        FAST_CHUNKS.forward_grads(plan, logits, full, weight, local_target, spec, merged, coefs, dx, dw,
                                  dw_accumulate=False, dw_scale=1.0, cast_dw_to=None,
                                  after_dx=None if dx_sum is None else dx_sum.start)
        del logits  # (its dlogits: freed once the GEMMs are queued, as the general path's chunk)
        loss = route.loss(forward_grad, merged, labelled, count, poison)
        ctx.route, ctx.spec, ctx.dx, ctx.dw = route, spec, dx if dx_sum is None else dx_sum, dw
        # (for a second backward only)
        ctx.forward_grad, ctx.merged, ctx.labelled, ctx.count, ctx.coefs = forward_grad, merged, labelled, count, coefs
        ctx.full_shape = full.shape
        ctx.save_for_backward(hidden, weight, local_target)
        return loss

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        dx, dw = ctx.dx, ctx.dw
        hidden, weight, local_target = ctx.saved_tensors  # (autograd's check: not changed in place since)
        if dx is not None or dw is not None:  # the first backward: what the forward made, times g
            ctx.dx = ctx.dw = None
            backend = ctx.route.facts.spec.backend
            if dx is None:
                return None, backend.scale_(dw, g), None, None, None, None, None, None, None
            if isinstance(dx, reductions.InputGradSum):  # (summed over TP ranks: started in the forward)
                dx = dx.result()
            return backend.scale_(dx, g, dw), dw, None, None, None, None, None, None, None
        spec, merged, coefs = ctx.spec, ctx.merged, ctx.coefs
        if coefs is None:
            coefs = token_coefficients(ctx.forward_grad, merged, slice(0, ctx.full_shape[0]), ctx.count,
                                       ctx.labelled)
        coef_list = [coefs[k] for k in ("p", "pz", "target", "uniform")]
        offsets = (merged.max, merged.log_sum_exp)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = input_grad_from_coefs(spec, hidden, weight, None, local_target, offsets, coef_list, g,
                                                ctx.full_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad_from_coefs(spec, False, hidden, weight, None, local_target, offsets, coef_list,
                                                 g)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


# the general path's log-prob routes (StraightFacts.route) LogprobRoute runs
LOGPROB_ROUTES = ("log-probs forward-only", "log-probs forward-only, merged", "log-probs forward-only, fused statistics",
                  "log-probs dlogits in forward")


class LogprobRoute(_Route):
    """linear_logprobs' routes of one chunk without entropy, sampler or sampling mask (module doc):
    forward-only (the reference and old-policy passes: the logits GEMM, the label kernel, then at
    TP = 1 the stats kernel finishing each row's log-prob — the two in one launch where the
    backend's label_logprob applies —, at TP > 1 the statistics merged over
    the ranks — the rank check riding on the merge — and the labelled log-probs' kernel; or, above
    fast.FUSED_STATS_MIN_BYTES of logits, the fused statistics GEMM over every row, the label
    kernel, the merge and the log-probs), or with
    the dlogits made in the forward (`StraightLogprobs`: the general path's
    LinearLogprobDlogitsInForward, leaner)."""

    def __init__(self, facts: StraightFacts, impl: str):
        super().__init__(facts, impl)
        self.differentiable = facts.route == "log-probs dlogits in forward"
        self.merged = facts.route == "log-probs forward-only, merged"
        self.fused = facts.route == "log-probs forward-only, fused statistics"

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        if self.differentiable:
            return (not saved_tensors_hooks_active() and hidden.shape[0] > 0
                    and hidden.shape[0] * weight.shape[0] * weight.element_size() <= api.DLOGITS_IN_FORWARD_MAX_BYTES)
        if self.facts.spec.sequence_parallel:  # (the gathered rows: below the fused statistics' bound)
            rows = hidden.shape[0] * reductions.group_size(self.group())
            return rows * weight.shape[0] * weight.element_size() <= FUSED_STATS_MIN_BYTES
        return fused_statistics(self.facts.spec.backend, hidden, weight) == self.fused

    def first_product(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor):
        """The logits, or with `fused` the statistics GEMM's partials (it reads the labels itself,
        as fast.EarlyProduct launches it); none where that GEMM cannot take these inputs (the key
        holds no strides or alignment: `holds` then sends the call to the general path)."""
        if self.fused:
            facts = self.facts
            if not fused_statistics(facts.spec.backend, hidden, weight):
                return None
            return labelled_gemm_statistics(hidden, weight, flat_labels, facts.spec, facts.vocab_start,
                                            facts.ignore_index)
        return self.first_logits(hidden, weight)

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape, first) -> LogprobsOutput:
        facts = self.facts
        if self.differentiable:
            logprob = StraightLogprobs.apply(hidden, weight, flat_labels, self, first)
        elif self.fused:  # (`first`: the statistics GEMM's partials)
            _, labelled, _, scalars, spec = self.device_checks(flat_labels, weight)
            _, logprob = merged_logprobs(first, spec.tp_group, spec.backend, spec.rank_check, labelled,
                                         lambda: self.poison(scalars, spec))
        elif not self.merged and self.labels_in_stats_launch(hidden):  # (TP = 1: the label and stats kernels' work)
            spec = facts.spec
            logprob = spec.backend.label_logprob.run(
                first, flat_labels, facts.ignore_index, facts.true_vocab, facts.vocab_start, spec.num_valid_cols,
                spec.inv_temperature, deferred_errors.flags(hidden.device))
        else:
            full = reductions.gather_sequence(hidden, self.group()) if facts.spec.sequence_parallel else hidden
            logits = first if first is not None else chunk_logits(full, weight, facts.spec)
            local_target, labelled, _, scalars, spec = self.device_checks(flat_labels, weight)
            if self.merged:  # (the log-probs in the merge's launch)
                _, logprob = merged_logprobs(logits_partials(logits, local_target, spec), spec.tp_group, spec.backend,
                                             spec.rank_check, labelled, lambda: self.poison(scalars, spec))
            else:
                logprob = spec.backend.shard_logprob(logits, local_target, spec.num_valid_cols, spec.inv_temperature,
                                                     scalars[:1])[0]
        return LogprobsOutput(logprob if logprob.shape == shape else logprob.reshape(shape))


class PerTokenLossRoute(LogprobRoute):
    """linear_cross_entropy's per-token losses (reduction="none", no label smoothing or z-loss:
    Megatron's output layer and MTP heads) on LogprobRoute's routes: -log p_y, as the general path
    makes them (TokenStats.negative_logprob of the log-prob routes' values: the same bits)."""

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape, first) -> Tensor:
        return -super().run(hidden, weight, flat_labels, shape, first).logprobs


class StraightLogprobs(torch.autograd.Function):
    """LogprobRoute's node with the dlogits made in the forward: the label kernel, then
    chunked.LinearLogprobDlogitsInForward's forward work (chunked.logprobs_with_dlogits; at TP > 1
    the rank check rides on its merge), the log-probs its only output; its backward that node's
    (fast.DlogitsMadeInForward: g·(D·W) summed over TP ranks, g·h, then the dW GEMM), without the
    general backward's bookkeeping."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, route: LogprobRoute, logits):
        if logits is not None and route.labels_in_one_launch(hidden, weight):
            # the label kernel's work in the launch of statistics, log-probs and D (TP = 1)
            spec = route.facts.spec
            _, _, _, _, logprob, _, labelled, _, _ = route.stats_dlogits_with_labels_(logits, labels, logprob=True)
            made = DlogitsMadeInForward.of(logits, weight, hidden.requires_grad, labelled)
        else:
            local_target, labelled, _, scalars, spec = route.device_checks(labels, weight)
            logprob, _, made = logprobs_with_dlogits(hidden, weight, local_target, labelled, spec,
                                                     lambda: route.poison(scalars, spec), logits)
        ctx.spec, ctx.made = spec, made
        ctx.save_for_backward(hidden, weight)
        return logprob

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        hidden, weight = ctx.saved_tensors
        dx = hidden.new_empty(hidden.shape) if ctx.needs_input_grad[0] else None
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        # (g in the rows of ignored labels is taken as 0 by the scaling launches)
        ctx.made.recompute_grads(hidden, weight, None, ctx.spec, (), {"target": g}, dx, dw, False)
        if dx is not None and ctx.spec.tp_group is not None:  # this rank's part: summed over TP ranks
            dx = reductions.InputGradSum(dx, ctx.spec.tp_group, False).result()
        return dx, dw, None, None, None


class ReplayRoute(_Route):
    """linear_logprobs' route with a sampling mask (replay.py), with or without entropy, without
    sequence parallelism: the general path's replay branch of token_statistics without its
    argument handling. Each call runs the label kernel (at TP = 1 without the plain pass, none: the
    layout's launches check the labels), makes its own layout and checks from its mask
    (replay.replay_tiling: whatever number of ids it keeps, the pieces the sizes choose, the device
    checks of a remembered signature), then the kept sets' statistics
    (at TP > 1 the rank check, the labels' and the mask's fingerprints in it, riding on the merge),
    the labelled log-probs, -inf where the label is not kept, and the entropy, 0 where the label is
    ignored, each plus the call's poison; `StraightReplay`'s backward is the general path's nodes'
    (the coefficients of target - lse and of the entropy, the tiling's recompute_grads). A mask
    that is not usable, or keeps no id, takes the general path (its errors are raised there)."""

    def __init__(self, facts: StraightFacts, impl: str):
        super().__init__(facts, impl)
        self.plain_pass = facts.route.endswith("plain pass")

    def holds(self, hidden: Tensor, weight: Tensor) -> bool:
        return hidden.shape[0] > 0

    def first_product(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor):
        return None  # (the mask's layout decides the products)

    def run(self, hidden: Tensor, weight: Tensor, flat_labels: Tensor, shape, first, *,
            sampling_mask) -> Optional[LogprobsOutput]:
        facts = self.facts
        mask_check = replay.MaskCheck(sampling_mask, flat_labels, facts.ignore_index, facts.true_vocab)
        if not mask_check.usable or mask_check.ids.numel() == 0:
            return None
        spec, group = facts.spec, self.group()
        needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        if group is None and not self.plain_pass and replay.layout_checks_labels(spec.backend, mask_check.ids):
            # TP = 1, no plain pass (which alone reads the targets on the shard): the layout's launch
            # makes the labelled flags and checks the labels (the label kernel's launch fewer)
            local_target = labelled = label_poison = None
        else:  # (the rank check is made below: the mask's fingerprint joins the labels' pieces)
            local_target, labelled, _, scalars, flags = self.label_checks(flat_labels, weight)
            label_poison = scalars[:1]
        tiling = replay.replay_tiling(mask_check, flat_labels, labelled, facts.vocab_start, spec.num_valid_cols,
                                      facts.true_vocab, needs_grad, plain_pass=self.plain_pass, backend=spec.backend,
                                      check=True, num_cols=weight.shape[0], fingerprint=group is not None,
                                      label_poison=label_poison, max_elements=spec.chunk_size * weight.shape[0],
                                      weight_grad=weight.requires_grad, ignore_index=facts.ignore_index)
        labelled = tiling.entries.labelled
        rank_check = None
        if group is not None:  # (the labels' pieces from the label launch, then the mask's fingerprint)
            rank_check = reductions.RankCheck(api._rank_check_values(scalars[3:], tiling.fingerprint),
                                              poison=tiling.poison, flags=flags)
        else:  # (the log-probs in the statistics' tail launch: replay_outputs)
            tiling.logprobs_in_tail = True
        spec = replace(spec, tp_group=group, rank_check=rank_check, tiling=tiling)
        if needs_grad:
            outputs = StraightReplay.apply(hidden, weight, local_target, labelled, spec)
        else:
            outputs = replay_outputs(forward_stats(hidden, weight, local_target, spec), labelled, spec)
        logprob, entropy = outputs if spec.want_entropy else (outputs, None)
        return LogprobsOutput(*(t if t is None or t.shape == shape else t.reshape(shape) for t in (logprob, entropy)))


def replay_outputs(merged, labelled: Tensor, spec):
    """The general path's results of a replay call from its merged statistics (TokenStats' logprob,
    where and to_full): the log-probs in the labelled log-probs' one launch (at TP = 1 the
    statistics' tail launch, ReplayChunks.logprobs_in_tail), -inf where the label is not kept, plus
    the call's poison (the rank check's once merged, else the mask's, the labels' in it); with
    entropy, (log-probs, the entropy with 0 where the label is ignored, plus the poison)."""
    poison = spec.tiling.poison if spec.rank_check is None else spec.rank_check.poison
    logprob = merged.forward_logprob if merged.forward_logprob is not None else spec.backend.labelled_logprob(
        merged.target, merged.max, merged.log_sum_exp, labelled, poison, kept=merged.kept)
    if not spec.want_entropy:
        return logprob
    return logprob, torch.where(labelled, merged.entropy, 0) + poison


class StraightReplay(torch.autograd.Function):
    """ReplayRoute's node: chunked.LinearSoftmaxStats' forward and the results made from it
    (`replay_outputs`); backward: the log-probs' upstream gradient where the label is kept and
    labelled, as the coefficients of target - lse, and the entropy's where the label is labelled
    (the gradients of the general path's where, _LabelledLogprob and to_full), into the tiling's
    recompute_grads, as LinearSoftmaxStats' backward does."""

    @staticmethod
    def forward(ctx, hidden, weight, local_target, labelled, spec):
        merged = forward_stats(hidden, weight, local_target, spec)
        ctx.spec, ctx.kept, ctx.labelled = spec, merged.kept, labelled
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, local_target, merged.lse, merged.entropy if spec.want_entropy else None,
                              *merged.grad_offsets())
        return replay_outputs(merged, labelled, spec)

    @staticmethod
    @first_order_only
    def backward(ctx, g, g_entropy=None):
        if g is None and g_entropy is None:
            return None, None, None, None, None
        hidden, weight, local_target, lse, entropy, *offsets = ctx.saved_tensors
        if g_entropy is None and not ctx.spec.tiling.plain_pass:
            # the log-probs' gradient alone, read where the label is labelled and kept by the
            # entries' dlogits kernel itself (coefficients' target and -target)
            coefs = {"p": None, "target": g, "gate": (ctx.labelled, ctx.kept)}
        else:
            grad = None if g is None else torch.where(ctx.labelled, torch.where(ctx.kept, g, 0.0), 0.0)
            if g_entropy is not None:
                g_entropy = torch.where(ctx.labelled, g_entropy, 0.0)
            coefs = coefficients(grad, None if grad is None else -grad, None, g_entropy, entropy, lse)
        grad_hidden, grad_weight = recompute_grads(hidden, weight, None, local_target, ctx.spec, tuple(offsets), coefs,
                                                   ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_hidden, grad_weight, None, None, None
