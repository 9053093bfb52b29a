"""The chunk loop and its autograd Function (backend-agnostic).

`LinearSoftmaxStats` maps (hidden, weight shard, targets) to four differentiable per-token fp32
statistics of z = hidden @ W_full.T / T over the global unpadded vocab:

    target          z_y
    lse             log sum_k exp(z_k)
    sum_logits      sum_k z_k            (only when asked: label smoothing)
    entropy         H = -sum_k p_k log p_k  (only when asked)

Everything users want is an O(tokens) expression of these (api.py): log p_y = target - lse,
cross-entropy with label smoothing and z-loss, ... lse also comes in its two parts, the row max M
and log S = log sum_k exp(z_k - M) (not differentiable): log p_k = (z_k - M) - log S keeps digits
that rounding M + log S to fp32 loses (saturated tokens, |z| ~ 50), in values and in dlogits.

Forward: the per-token partials of this shard, merged across TP ranks with one all-gather after
the loop. Where the backend has it (Triton, bf16/fp16), the logits GEMM's epilogue computes them:
no logits in memory at all. Otherwise the tiling walks the rows (fast.py: for each chunk of rows,
logits = h_chunk @ W.T, the only [chunk, V_local] tensor, reduced by backend.shard_stats). Only
hidden, weight, row indices and per-token lse (M, log S) / entropy are saved. The logits are in
the input dtype (like Megatron's output layer), or fp32 with `logits_dtype=torch.float32` (an
fp32-output GEMM; its dlogits are rounded to the input dtype for the two backward GEMMs).

Backward: the upstream gradients of the four statistics become per-token coefficients
(see backends/torch_backend.shard_dlogits_):

    d target / dz_k          = [k == y]                 -> coef_target  += g_target
    d lse / dz_k             = p_k                      -> coef_p       += g_lse
    d sum_logits / dz_k      = 1                        -> coef_uniform += g_sum
    d H / dz_k               = -p_k (log p_k + H)       -> coef_p -= g_H H, coef_pz -= g_H
                                                           (coef_pz multiplies log p_k = z_k - lse)

and each chunk's logits are recomputed as dlogits (gemm.dlogits_gemm: on the Triton backend the
logits GEMM's epilogue writes dlogits, no logits in memory; else the logits, overwritten in place)
and multiplied into dX (rows of this chunk) and dW (accumulated in fp32 over chunks, straight into
Megatron's `weight.main_grad` when asked). dX is then summed over TP ranks (reduce-scattered under sequence
parallelism), as Megatron's ColumnParallelLinear does.

How the rows and the vocab are walked is `spec.tiling`'s: fast.FastChunks (chunks of rows, each one
GEMM over the whole vocab shard; the default), lean.LeanTiles (memory_mode="lean": tiles within a
fixed working set), sampling.SamplerChunks (the sampler settings: fast chunks with each row's
kept set decided per chunk; its statistics add the set and the top-k) or replay.ReplayChunks (a
sampling mask: each row's kept entries, scored on their gathered W rows or on chunks of logits;
its statistics add whether the label is kept). They offer the same
methods (merged_statistics, recompute_grads, weight_grad_dtype; fast and lean also the
gradients-in-forward steps), and the code here calls them without knowing which.

Both autograd Functions are first-order only: a second backward through their gradients (a
gradient penalty, create_graph=True) raises instead of silently dropping the second-order term.
They run with autocast off (api.py has already cast the inputs as F.linear would), so forward and a
backward called inside or outside autocast see the same dtypes.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import Tensor

from . import reductions
from .backends import Backend, chunk_rows
from .forward_grad import ForwardGradLoss
from . import fast, main_grad
from .main_grad import MainGradSideEffect, main_grad_added
from .fast import FAST_CHUNKS, last_of_several, row_chunks, weight_grad_cast_target


@dataclass(frozen=True)
class ChunkSpec:
    """Static settings of one call (everything but tensors)."""

    tp_group: Any
    backend: Backend  # the per-chunk math and its capabilities (backends/__init__.py)
    num_valid_cols: int  # columns of this shard below the true vocab size
    inv_temperature: float
    chunk_size: int
    want_sum_logits: bool
    want_entropy: bool
    sequence_parallel: bool
    # Megatron's gradient-accumulation fusion: the parameter whose fp32 `main_grad` receives dW
    # (under autocast, the fp32 parameter of which `weight` is a cast copy); None = autograd.
    main_grad_param: Optional[Tensor] = None
    logits_dtype: Optional[torch.dtype] = None  # None: the input dtype
    tiling: Any = FAST_CHUNKS  # how rows and vocab are walked: fast.FastChunks, lean.LeanTiles, ... (module doc)
    # values every TP rank must share, compared by the first statistics all-reduce of the call
    # (a call after the first of its signature: reductions.RankCheck); None: nothing to compare
    rank_check: Any = None
    # the call's first GEMM, launched ahead of the host's bookkeeping (fast.EarlyProduct); None: none
    first_product: Any = None


def autocast_off(device: torch.device):
    """A context without autocast for the op's own GEMMs (a no-op when autocast is off)."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        enabled = False
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()


_SECOND_ORDER_ERROR = (
    b"megatron_fused_ce: second-order gradients (a backward through the gradient of "
    b"linear_logprobs / linear_cross_entropy / linear_grpo_loss, e.g. a gradient penalty with "
    b"create_graph=True) are not supported; compute that term with materialized logits")


def first_order_only(backward):
    """Run `backward` without building a graph. Under create_graph=True its gradients are
    returned attached to a node that raises when differentiated again (as torch's
    once_differentiable does, but whatever the upstream gradients, and with our message): the
    chunk loop's gradient is not itself differentiable, and dropping the second-order term
    would give a wrong gradient penalty without a word."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled():
            return grads
        delayed_error = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
        if delayed_error is None:
            raise RuntimeError(_SECOND_ORDER_ERROR.decode())
        tensors = [g for g in grads if isinstance(g, Tensor)]
        raising = delayed_error(_SECOND_ORDER_ERROR, len(tensors))(
            *[g.detach().requires_grad_() for g in tensors])
        raising = iter(raising if isinstance(raising, tuple) else (raising,))
        return tuple(next(raising) if isinstance(g, Tensor) else g for g in grads)

    return wrapper


def labelled_rows(full_hidden: Tensor, row_index: Optional[Tensor]) -> Tensor:
    """Hidden rows that have a label (all rows when row_index is None)."""
    return full_hidden if row_index is None else full_hidden.index_select(0, row_index)


def forward_stats(hidden_rows: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec):
    """The forward pass's statistics over the rows given, merged over TP ranks:
    `spec.tiling.statistics_type` (reductions.MergedStats; the sampler's adds its kept set)."""
    return spec.tiling.merged_statistics(hidden_rows, weight, local_target, spec)


def input_grad(dx_rows: Tensor, row_index: Optional[Tensor], full_shape, spec: ChunkSpec) -> Tensor:
    """This rank's partial dX of the labelled rows -> the full input gradient of `hidden`: scatter
    back to all (gathered) rows, then sum over TP ranks (reduce-scatter under SP), as Megatron's
    ColumnParallelLinear does in its backward."""
    dx_full = dx_rows if row_index is None else dx_rows.new_zeros(full_shape).index_copy_(0, row_index, dx_rows)
    return reductions.InputGradSum(dx_full, spec.tp_group, spec.sequence_parallel).result()


def coefficients(g_target, g_lse, g_sum, g_entropy, entropy, lse) -> Optional[dict]:
    """Upstream grads of the four statistics -> per-token dlogits coefficients (see module doc)."""
    if all(g is None for g in (g_target, g_lse, g_sum, g_entropy)):
        return None
    # (no copy of g_lse where nothing is added to it: every launch counts at RL shapes)
    coef_p = g_lse.contiguous() if g_lse is not None else torch.zeros_like(lse)
    coef_pz = None
    if g_entropy is not None:
        coef_p = torch.addcmul(coef_p, g_entropy, entropy, value=-1.0)  # coef_p - g_entropy * entropy
        coef_pz = -g_entropy
    return {"p": coef_p, "pz": coef_pz, "target": g_target, "uniform": g_sum}


class LinearSoftmaxStats(torch.autograd.Function):
    """(hidden [n, H], weight [V_local, H]) -> the fields of `spec.tiling.statistics_type` in the
    order of its `output_names`: per-token target, lse, sum_logits, entropy (differentiable), then
    plain values: lse's two parts max and log_sum_exp (for precise log-probs) and, for the
    sampler's tiling, its kept-set cut and top-k.

    Backward: the upstream gradients become per-token coefficients (`coefficients`), and the
    tiling's recompute_grads walks the rows again with the offsets the statistics named
    (`grad_offsets`)."""

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        merged = forward_stats(labelled_rows(full_hidden, row_index), weight, local_target, spec)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        saved_entropy = merged.entropy if spec.want_entropy else None
        # Only the local hidden slice is kept under SP: backward all-gathers it again, as
        # Megatron's ColumnParallelLinear does, instead of holding the tp-times larger copy.
        ctx.save_for_backward(hidden, weight, row_index, local_target, merged.lse, saved_entropy,
                              *merged.grad_offsets())
        outputs = merged.as_outputs()
        plain = outputs[len(merged.DIFFERENTIABLE):]
        ctx.mark_non_differentiable(*(t for t in plain if t is not None))
        return outputs

    @staticmethod
    @first_order_only
    def backward(ctx, g_target, g_lse, g_sum, g_entropy, *unused_plain_values):
        hidden, weight, row_index, local_target, lse, entropy, *offsets = ctx.saved_tensors
        coefs = coefficients(g_target, g_lse, g_sum, g_entropy, entropy, lse)
        grad_hidden, grad_weight = recompute_grads(hidden, weight, row_index, local_target, ctx.spec, tuple(offsets),
                                                   coefs, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_hidden, grad_weight, None, None, None


class LinearLogprobDlogitsInForward(torch.autograd.Function):
    """(hidden [n, H], weight [V_local, H]) of a call of fast chunks -> (log p_y of every row, 0
    where `labelled` is False, plus the call's poison, `call_poison()`; differentiable), then plain
    values: target, lse, max, log_sum_exp.

    The forward makes the chunk of logits (one GEMM) and its statistics, merged over TP ranks,
    then turns that chunk into the dlogits of log p_y and multiplies them by W
    (fast.DlogitsMadeInForward: they do not depend on the upstream gradient); the backward scales
    them by each row's upstream gradient and makes dW: three GEMMs, as cross-entropy's, where the
    recompute path makes four (the logits again in the backward). A call of several chunks does so
    for its last chunk and makes the others' dlogits again in the backward. Under sequence
    parallelism the forward gathers the rows, the backward gathers them again. For log-probs
    without entropy, no sampler or sampling mask, a held chunk of dlogits of at most
    api.DLOGITS_IN_FORWARD_MAX_BYTES (api.token_statistics decides, from its `logprob_only`)."""

    @staticmethod
    def forward(ctx, hidden, weight, local_target, labelled, spec: ChunkSpec, call_poison):
        # (under SP the gathered rows are the forward's only: backward gathers them again, as
        # LinearSoftmaxStats does, instead of holding the tp-times larger copy)
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        logprob, merged, made = logprobs_with_dlogits(full_hidden, weight, local_target, labelled, spec, call_poison,
                                                      needs_dx=ctx.needs_input_grad[0])
        ctx.spec = replace(spec, tiling=made, first_product=None)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, local_target)
        ctx.mark_non_differentiable(merged.target, merged.lse, merged.max, merged.log_sum_exp)
        return logprob, merged.target, merged.lse, merged.max, merged.log_sum_exp

    @staticmethod
    @first_order_only
    def backward(ctx, g_logprob, *unused_plain_values):
        hidden, weight, local_target = ctx.saved_tensors
        # (g in the rows of ignored labels is taken as 0 by the tiling's scaling launches)
        coefs = None if g_logprob is None else {"target": g_logprob}
        grad_hidden, grad_weight = recompute_grads(hidden, weight, None, local_target, ctx.spec, (), coefs,
                                                   ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_hidden, grad_weight, None, None, None, None


def logprobs_with_dlogits(hidden, weight, local_target, labelled, spec: ChunkSpec, call_poison,
                          logits: Optional[Tensor] = None, needs_dx: Optional[bool] = None) -> tuple:
    """LinearLogprobDlogitsInForward's forward work -> (log-probs, merged statistics,
    fast.DlogitsMadeInForward): the chunk of logits (`logits` where the caller launched them), its
    statistics and log-probs (plus the call's poison, `call_poison()`), then D = one_hot - softmax
    in place of the logits and D·W (where `needs_dx`; None: hidden.requires_grad). A call of
    several chunks takes every chunk's statistics (merged once, as the recompute path's) and keeps
    the last chunk for D."""
    if needs_dx is None:
        needs_dx = hidden.requires_grad
    if hidden.shape[0] > spec.chunk_size:
        return _several_chunks_with_last_dlogits(hidden, weight, local_target, labelled, spec, call_poison, needs_dx)
    one_launch = fast.runs_stats_dlogits(spec, hidden, weight)
    if logits is None:
        logits = fast.chunk_logits(hidden, weight, spec)
    if one_launch:  # the statistics, log-probs and D in one launch (fast.StatsWithDlogits' kernel)
        row_max, target, log_sum_exp, lse, logprob = spec.backend.stats_dlogits.run_(
            logits, local_target, spec.num_valid_cols, spec.inv_temperature, labelled, logprob=True,
            poison=call_poison())
        merged = reductions.MergedStats(lse=lse, target=target, max=row_max, log_sum_exp=log_sum_exp)
        return logprob, merged, fast.DlogitsMadeInForward.of(logits, weight, needs_dx, labelled)
    # (the poison added by the launch that makes the log-probs: their gradient passes through it)
    merged, logprob = fast.merged_chunk_statistics(logits, local_target, spec, labelled, call_poison)
    made = fast.DlogitsMadeInForward.make(logits, weight, local_target, spec, (merged.max, merged.log_sum_exp),
                                          needs_dx, labelled)
    return logprob, merged, made


def _several_chunks_with_last_dlogits(hidden, weight, local_target, labelled, spec: ChunkSpec, call_poison,
                                      needs_dx: bool) -> tuple:
    """logprobs_with_dlogits of several chunks: the forward's chunk loop (fast.map_chunk_logits:
    each chunk's logits and this shard's partials, one chunk alive at a time) keeping the last
    chunk's logits; the partials merged over TP ranks once with the log-probs; then that chunk
    turned into D and D·W (fast.DlogitsMadeInForward, `held_from` its first row)."""
    num_rows = hidden.shape[0]
    held_from = fast.last_chunk_start(num_rows, spec.chunk_size)
    last = []

    def partials_keeping_the_last(start, end, logits):
        if end == num_rows:
            last.append(logits)
        return fast.logits_partials(logits, chunk_rows(local_target, start, end), spec)

    partials = fast.map_chunk_logits(hidden, weight, spec, partials_keeping_the_last)
    merged, logprob = reductions.merged_logprobs(fast.concat_partials(partials, hidden, spec), spec.tp_group,
                                                 spec.backend, spec.rank_check, labelled, call_poison)
    offsets = (merged.max, merged.log_sum_exp)
    dlogits = fast.log_prob_dlogits_(last.pop(), local_target[held_from:], spec,
                                     tuple(o[held_from:] for o in offsets))
    made = fast.DlogitsMadeInForward.of(dlogits, weight, needs_dx, labelled, held_from, offsets)
    return logprob, merged, made


def softmax_statistics(hidden: Tensor, weight: Tensor, row_index: Optional[Tensor], local_target: Tensor,
                       spec: ChunkSpec, differentiable: bool):
    """The labelled rows' statistics (`spec.tiling.statistics_type`): through LinearSoftmaxStats
    when they are `differentiable`, else as plain values (reference / old-policy passes: nothing
    saved)."""
    if differentiable:
        outputs = LinearSoftmaxStats.apply(hidden, weight, row_index, local_target, spec)
        return spec.tiling.statistics_type.from_outputs(outputs)
    full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
    return forward_stats(labelled_rows(full_hidden, row_index), weight, local_target, spec)


def recompute_grads(hidden, weight, row_index, local_target, spec: ChunkSpec, offsets: tuple,
                    coefs: Optional[dict], needs_dx: bool, needs_dw: bool) -> tuple:
    """The recompute backward: gather the SP hidden states again, allocate the dX rows and the dW
    buffer (or use Megatron's main_grad), let the tiling's recompute_grads fill them (skipped,
    gradients zero, when nothing depends on the statistics: `coefs` None; it may return dW
    already in the weight dtype instead of filling an fp32 buffer), and return (grad_hidden,
    grad_weight) for autograd."""
    with autocast_off(hidden.device):
        full_hidden = (reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel
                       else hidden)
        rows = labelled_rows(full_hidden, row_index)
        dx_rows = rows.new_empty(rows.shape) if needs_dx else None
        into_main_grad = needs_dw and spec.main_grad_param is not None
        dw_out = grad_weight = dw_done = None
        if needs_dw:
            dw_dtype = spec.tiling.weight_grad_dtype(weight, rows.shape[0], spec)
            dw_out = spec.main_grad_param.main_grad if into_main_grad else torch.empty(
                weight.shape, dtype=dw_dtype, device=weight.device)
        if coefs is None or rows.shape[0] == 0:  # nothing to differentiate: zero gradients
            if dx_rows is not None:
                dx_rows.zero_()
            if dw_out is not None and not into_main_grad:
                dw_out.zero_()
        else:
            dw_done = spec.tiling.recompute_grads(rows, weight, local_target, spec, offsets, coefs, dx_rows, dw_out,
                                                  into_main_grad)
        if needs_dw and not into_main_grad:
            if dw_done is not None:
                grad_weight = dw_done
            else:
                grad_weight = dw_out if dw_out.dtype == weight.dtype else dw_out.to(weight.dtype)
        grad_hidden = input_grad(dx_rows, row_index, full_hidden.shape, spec) if needs_dx else None
    if into_main_grad:
        grad_weight = main_grad_added(spec.main_grad_param, weight)
    return grad_hidden, grad_weight


class LinearLossGradInForward(torch.autograd.Function):
    """Gradients during the forward pass: 3 GEMMs per chunk instead of 4 (no backward recompute).

    Valid for a scalar loss whose gradient w.r.t. each token's statistics is known as soon as that
    token's chunk has been merged across TP ranks: `forward_grad`, a ForwardGradLoss (its
    contract: forward_grad.py).

    Outputs: (anchor, target, lse, sum_logits, entropy, max, log_sum_exp). The statistics are plain values;
    `anchor` is a zero scalar that carries the gradient: callers return `loss_value + anchor`, and
    backward scales the dX and dW computed here by the anchor's upstream gradient g (loss scaling,
    averaging over micro-batches ...). Costs: the chunk merge is done per chunk (2 collectives per
    chunk instead of 2 per call) and dX / dW (fp32 when summed over several chunks, unless QuACK's
    GEMM adds the sum while writing the last chunk's dW in the weight dtype) live from
    forward to backward. Not for fp16 (api.py takes the recompute path there): dX would be stored in
    fp16 under a unit upstream gradient, before the loss scale, and per-token terms like p/N underflow.

    Megatron's main_grad (gradient-accumulation fusion). g is only known in the backward, and
    g·dW must never be formed as a difference (1·dW added in the forward, then (g - 1)·dW: for
    g = 1e-5, Megatron's default loss scaling, that keeps nothing of the gradient in bf16):
    * `expected_grad` given (the caller knows g at forward time: Megatron's loss funcs): the dW GEMMs
      add expected_grad·dW straight into main_grad, no [V_local, H] buffer of the op's own. The
      first backward checks that g is that value (one host sync); if it is not, main_grad cannot be
      repaired exactly, so it is poisoned as for an unpaired forward (UpstreamGradMismatch).
    * otherwise: dW is summed in a private fp32 [V_local, H] buffer and the backward adds g·dW to
      main_grad (one pass, no host sync).
    A forward that added into main_grad has a side effect, so it must pair with exactly one first
    backward: a forward whose graph is freed without any backward poisons main_grad with NaN and
    makes the next fused call raise (MainGradSideEffect); a forward run again during backward
    (torch.utils.checkpoint with use_reentrant=False) never gets here: under saved-tensor hooks
    api.py takes the recompute path. Any further backward through the same graph recomputes
    g·dW from the saved per-token coefficients and adds it.

    Lean mode (lean.LeanTiles): the forward runs lean sweep A (statistics and dX, tile by tile) and the
    backward lean sweep B (dW with the exact upstream gradient, into main_grad or the weight
    dtype): 4 GEMMs, no chunk of logits and no [V_local, H] buffer.
    """

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, forward_grad: ForwardGradLoss,
                expected_grad: Optional[float] = None, labelled: Optional[Tensor] = None, num_labelled=None):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        rows = labelled_rows(full_hidden, row_index)
        needs_dx, needs_dw = hidden.requires_grad, weight.requires_grad
        into_main_grad = needs_dw and spec.main_grad_param is not None
        # dW added into main_grad by this forward (times expected_grad), or held until backward
        makes_dw = spec.tiling.weight_grad_in_forward
        adds_in_forward = into_main_grad and makes_dw and expected_grad is not None
        dx_rows = rows.new_empty(rows.shape) if needs_dx else None
        dw_acc = None
        if needs_dw and makes_dw and not adds_in_forward:
            # fp32 for main_grad (added times g in backward); else the weight dtype for one chunk
            dw_dtype = torch.float32 if into_main_grad else spec.tiling.weight_grad_dtype(weight, rows.shape[0], spec)
            dw_acc = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device)
            if rows.shape[0] == 0:
                dw_acc.zero_()
        dw_out = spec.main_grad_param.main_grad if adds_in_forward else dw_acc
        # owned by the node from before the first add: freed without a backward (also when this
        # forward raises half-way), it poisons main_grad instead of leaving it wrong
        ctx.main_grad_side_effect = MainGradSideEffect(spec.main_grad_param) if adds_in_forward else None
        # dX's TP sum starts as soon as the last chunk's dX is made (beside its dW GEMM)
        dx_sum = None
        if dx_rows is not None and row_index is None:
            dx_sum = reductions.InputGradSum(dx_rows, spec.tp_group, spec.sequence_parallel)
        merged_chunks, coef_chunks, dw_last = _forward_chunks(
            rows, weight, row_index, local_target, spec, forward_grad, dx_rows, dw_out, adds_in_forward,
            cast_dw_to=weight_grad_cast_target(dw_acc, weight, accumulate=into_main_grad),
            dw_scale=expected_grad if adds_in_forward else 1.0, labelled=labelled,
            num_labelled=rows.shape[0] if num_labelled is None else num_labelled,
            after_last_dx=None if dx_sum is None else dx_sum.start)
        if dx_sum is not None:
            dx_sum.start()  # (a tiling that makes no dX GEMM, lean's: here)
        if dw_last is not None:  # dW in the weight dtype already: the fp32 sum is not needed any more
            dw_acc = dw_last

        def cat(values, wanted=True):
            if not wanted:
                return None
            if not values:  # no row
                return rows.new_zeros(0, dtype=torch.float32)
            return values[0] if len(values) == 1 else torch.cat(values)  # (one chunk: no copy)

        ctx.spec = spec
        ctx.into_main_grad = into_main_grad
        ctx.full_shape = full_hidden.shape
        # the g the first backward must bring, main_grad already holding g·dW (None: nothing added)
        ctx.expected_grad_in_main_grad = expected_grad if adds_in_forward else None
        ctx.needs_dw = needs_dw
        # The gradients made here are handed to autograd by the first backward without a copy
        # (which would be one more [tokens, H] and [V_local, H] buffer), scaled in place by g (no
        # pass when g == 1). They are kept outside save_for_backward, whose version
        # check would reject that; a second backward (retain_graph) recomputes them from the saved
        # per-token coefficients.
        ctx.dx_buffer, ctx.dw_buffer = (dx_rows if dx_sum is None else dx_sum), dw_acc
        ctx.save_for_backward(
            row_index, weight, hidden, local_target, cat([m.max for m in merged_chunks]),
            cat([m.log_sum_exp for m in merged_chunks]),
            *(cat([c[k] for c in coef_chunks], bool(coef_chunks) and coef_chunks[0][k] is not None)
              for k in ("p", "pz", "target", "uniform")))
        outputs = (cat([m.target for m in merged_chunks]), cat([m.lse for m in merged_chunks]),
                   cat([m.sum_logits for m in merged_chunks], spec.want_sum_logits),
                   cat([m.entropy for m in merged_chunks], spec.want_entropy),
                   cat([m.max for m in merged_chunks]), cat([m.log_sum_exp for m in merged_chunks]))
        # one call with every output: each call of mark_non_differentiable replaces the last one's set
        ctx.mark_non_differentiable(*(out for out in outputs if out is not None))
        # only the anchor's gradient is read: no zero tensors made for the statistics' (none)
        ctx.set_materialize_grads(False)
        return (fast.device_zero(hidden.device),) + outputs  # (the anchor)

    @staticmethod
    @first_order_only
    def backward(ctx, g_anchor, *unused_stat_grads):
        row_index, weight, hidden, local_target, row_max, log_sum_exp, *coef_list = ctx.saved_tensors
        spec: ChunkSpec = ctx.spec
        offsets = (row_max, log_sum_exp)
        dx, dw = ctx.dx_buffer, ctx.dw_buffer
        ctx.dx_buffer = ctx.dw_buffer = None
        if ctx.main_grad_side_effect is not None:
            ctx.main_grad_side_effect.backpropagated()
        expected = ctx.expected_grad_in_main_grad  # main_grad holds expected·dW of this forward
        ctx.expected_grad_in_main_grad = None
        # dX and a dW made in the weight dtype are scaled by backend.scale_, which reads g on the GPU
        # (no pass when g == 1), and an fp32 dW summed over chunks is cast or added into main_grad
        # with g applied in one pass: a host sync would leave the GPU idle while the host queues
        # what follows. Only the check of g against expected_grad reads g on the host.
        grad_hidden = grad_weight = None
        # a dW made in the weight dtype is scaled with dX, in the same launch
        scaled_with_dx = dx is not None and dw is not None and not ctx.into_main_grad and dw.dtype == weight.dtype
        if isinstance(dx, reductions.InputGradSum):  # summed over TP ranks already (started in the forward)
            grad_hidden = spec.backend.scale_(dx.result(), g_anchor, dw if scaled_with_dx else None)
        elif dx is not None:
            spec.backend.scale_(dx, g_anchor, dw if scaled_with_dx else None)
            grad_hidden = input_grad(dx, row_index, ctx.full_shape, spec)
        elif ctx.needs_input_grad[0]:  # a second backward through the same graph: recompute dX
            grad_hidden = input_grad_from_coefs(spec, hidden, weight, row_index, local_target, offsets, coef_list,
                                                g_anchor, ctx.full_shape)
        if dw is not None and ctx.into_main_grad:  # fp32 dW of the forward: main_grad += g·dW
            spec.main_grad_param.main_grad.addcmul_(dw, g_anchor.to(torch.float32))
            grad_weight = main_grad_added(spec.main_grad_param, weight)
        elif dw is not None:  # fast mode, no main_grad: made in the forward
            if dw.dtype == weight.dtype:
                grad_weight = dw if scaled_with_dx else spec.backend.scale_(dw, g_anchor)
            else:  # summed over chunks in fp32: scale and cast in one pass
                grad_weight = spec.backend.scale_cast(dw, g_anchor, weight.dtype)
        elif expected is not None:
            main_grad.check_upstream_grad(spec.main_grad_param, float(g_anchor), expected)
            grad_weight = main_grad_added(spec.main_grad_param, weight)
        elif ctx.needs_dw:  # lean mode, or a second backward: g·dW from the coefficients
            grad_weight = weight_grad_from_coefs(
                spec, ctx.into_main_grad, hidden, weight, row_index, local_target, offsets, coef_list, g_anchor)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _forward_chunks(rows, weight, row_index, local_target, spec: ChunkSpec, forward_grad: ForwardGradLoss, dx_rows,
                    dw_out, into_main_grad: bool, cast_dw_to: Optional[torch.dtype] = None, dw_scale: float = 1.0,
                    labelled: Optional[Tensor] = None, num_labelled=None, after_last_dx=None):
    """LinearLossGradInForward's loop -> (merged statistics, coefficients per step, dW): per step of
    rows (spec.tiling's: a chunk of logits, or lean sweep A over a token chunk), the statistics
    merged over TP ranks, the per-token coefficients, then dX (and, where the tiling makes it in
    the forward, dW times `dw_scale`) into `dx_rows` / `dw_out` (`into_main_grad`: dw_out is
    main_grad, added to from the first step on). With `cast_dw_to` (dw_out an fp32 sum over
    chunks), the last chunk may add the sum and write dW in that dtype in one GEMM: that dW is
    returned, else None. `labelled` (bool [rows]; None: every row is labelled) zeroes the
    gradients of the rows of ignored labels; `num_labelled` is what the loss divides by.
    `after_last_dx` runs right after the last step's dX GEMM (where the tiling makes one)."""
    tiling = spec.tiling
    plan = tiling.forward_plan(rows, weight, spec, forward_grad, needs_dx=dx_rows is not None,
                               num_labelled=num_labelled)
    merged_chunks, coef_chunks = [], []
    dw_last = None
    for index, (start, end) in enumerate(row_chunks(rows.shape[0], tiling.forward_rows(spec))):
        h, target = chunk_rows(rows, start, end), chunk_rows(local_target, start, end)
        merged, pending = tiling.forward_statistics(plan, h, weight, target, spec, chunk_rows(labelled, start, end))
        merged_chunks.append(merged)
        # the chunk's positions among all rows: indices, or a slice of consecutive rows (no kernel)
        positions = row_index[start:end] if row_index is not None else slice(start, end)
        coefs = token_coefficients(forward_grad, merged, positions, num_labelled, chunk_rows(labelled, start, end))
        coef_chunks.append(coefs)
        dw_last = tiling.forward_grads(
            plan, pending, h, weight, target, spec, merged, coefs, chunk_rows(dx_rows, start, end),
            dw_out, dw_accumulate=into_main_grad or index > 0, dw_scale=dw_scale,
            cast_dw_to=last_of_several(cast_dw_to, index, end, rows.shape[0]),
            after_dx=after_last_dx if end == rows.shape[0] else None)
        del pending  # one chunk alive at the peak
    return merged_chunks, coef_chunks, dw_last


def token_coefficients(forward_grad: ForwardGradLoss, merged, positions, num_labelled,
                       labelled: Optional[Tensor]) -> dict:
    """A chunk's per-token dlogits coefficients under a unit upstream gradient, from the loss's
    gradient w.r.t. its statistics (forward_grad.token_grads), 0 in the rows of ignored labels
    (`labelled`, bool [rows] of the chunk; None: every row)."""
    grads = forward_grad.token_grads(merged, positions, num_labelled)
    if not forward_grad.masks_unlabelled and not grads.masked:
        grads = grads.only_rows(labelled)
    coefs = coefficients(grads.target, grads.lse, grads.sum_logits, grads.entropy, merged.entropy, merged.lse)
    if coefs is None:
        coefs = coefficients(None, torch.zeros_like(merged.lse), None, None, None, merged.lse)
    return coefs


def _scaled_coefs(coef_list, scale: Tensor) -> dict:
    return {k: None if c is None else c * scale for k, c in zip(("p", "pz", "target", "uniform"), coef_list)}


def input_grad_from_coefs(spec: ChunkSpec, hidden, weight, row_index, local_target, offsets, coef_list,
                          scale: Tensor, full_shape) -> Tensor:
    """scale x dX from the saved per-token coefficients (a second backward through a retained graph)."""
    coefs = _scaled_coefs(coef_list, scale)
    with autocast_off(hidden.device):
        rows = labelled_rows(reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel
                             else hidden, row_index)
        dx = rows.new_empty(rows.shape)
        if rows.shape[0] == 0:
            dx.zero_()
        else:
            spec.tiling.recompute_grads(rows, weight, local_target, spec, offsets, coefs, dx, None, False)
        return input_grad(dx, row_index, full_shape, spec)


def weight_grad_from_coefs(spec: ChunkSpec, into_main_grad: bool, hidden, weight, row_index, local_target,
                            offsets, coef_list, scale: Tensor):
    """scale x dW from the saved per-token coefficients (LinearLossGradInForward.backward): added
    into main_grad, or returned in the weight dtype (fp32-accumulated over chunks)."""
    main_grad = spec.main_grad_param.main_grad if into_main_grad else None
    full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
    rows = labelled_rows(full_hidden, row_index)
    coefs = _scaled_coefs(coef_list, scale)
    with autocast_off(hidden.device):
        dw_out = main_grad if main_grad is not None else torch.empty(
            weight.shape, dtype=spec.tiling.weight_grad_dtype(weight, rows.shape[0], spec), device=weight.device)
        if rows.shape[0] > 0:
            dw_done = spec.tiling.recompute_grads(rows, weight, local_target, spec, offsets, coefs, None, dw_out,
                                                  main_grad is not None)
            if dw_done is not None:
                return dw_done
        elif main_grad is None:
            dw_out.zero_()
    if main_grad is not None:
        return main_grad_added(spec.main_grad_param, weight)
    return dw_out if dw_out.dtype == weight.dtype else dw_out.to(weight.dtype)
