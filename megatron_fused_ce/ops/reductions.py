"""Every collective of the op lives here: merging per-shard softmax partials across the
tensor-parallel group, the sequence-parallel gather/scatter of hidden states, the dX reduction and
the pre-flight agreement on arguments (agreement.py builds its vector). No other module of the op
calls torch.distributed.

A forward pass makes one O(tokens) collective whatever the number of chunks: all chunks' partials
are merged at once, by an all-gather of every rank's partials packed into one vector (each rank
then merges them in rank order: the same bits everywhere, and one collective where an all-reduce
MAX of the maxima and an all-reduce SUM of the rescaled partials would make two). The dX sum over
the group is the second: in the backward, or, where the gradients are made in the forward,
started there beside the last dW GEMM (`InputGradSum`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import deferred_errors
from .backends import ShardStats, torch_backend


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_rows(out: Tensor, local: Tensor, group) -> None:
    """Every rank's `local` (contiguous) into `out`, concatenated along dim 0 in rank order: torch's
    all_gather_into_tensor, which torch >= 2.13 names all_gather_single."""
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, local, group=group)


@dataclass
class MergedStats:
    """Per-token statistics over the full (unpadded) vocab, identical on every rank (fp32, [n])."""

    lse: Tensor  # log sum_k exp(z_k)
    target: Tensor  # z_y
    sum_logits: Optional[Tensor] = None  # sum_k z_k
    entropy: Optional[Tensor] = None  # -sum_k p_k log p_k
    # lse = max + log_sum_exp. Kept apart: log p_k = (z_k - M) - log S keeps the digits that
    # rounding M + log S to fp32 loses (|z| ~ 50, or log p_y ~ -1e-5 next to M ~ 8).
    max: Optional[Tensor] = None  # M = max_k z_k
    log_sum_exp: Optional[Tensor] = None  # log S = log sum_k exp(z_k - M)
    # a forward's labelled log-probs, where the tail's launch made them (merge_shard_stats' logprob_of)
    forward_logprob: Optional[Tensor] = None

    # the fields an autograd Function differentiates; the others are plain values
    DIFFERENTIABLE = ("target", "lse", "sum_logits", "entropy")

    def logprob(self) -> Tensor:
        """log p_y = (z_y - M) - log S."""
        return log_prob(self.target, self.max, self.log_sum_exp)

    def grad_offsets(self) -> tuple:
        """What a tiling's recompute_grads needs of each row besides its coefficients: the
        softmax's offsets (M, log S)."""
        return (self.max, self.log_sum_exp)

    @classmethod
    def output_names(cls) -> tuple:
        """The fields in the order of an autograd Function's outputs: differentiable first."""
        return cls.DIFFERENTIABLE + tuple(f for f in cls.__dataclass_fields__ if f not in cls.DIFFERENTIABLE)

    def as_outputs(self) -> tuple:
        return tuple(getattr(self, name) for name in self.output_names())

    @classmethod
    def from_outputs(cls, outputs) -> "MergedStats":
        return cls(**dict(zip(cls.output_names(), outputs)))


def log_prob(target: Tensor, row_max: Tensor, log_sum_exp: Tensor) -> Tensor:
    """log p_y = (z_y - M) - log S: exact where z_y - lse would round at lse's scale (|z| ~ 50)."""
    return (target - row_max) - log_sum_exp


def labelled_log_prob(target: Tensor, row_max: Tensor, log_sum_exp: Tensor, labelled: Optional[Tensor],
                      negative: bool = False) -> Tensor:
    """log_prob (or its negation), 0 in rows whose label is ignored (`labelled` False; None: every row)."""
    if not negative:  # (the backends' labelled_logprob, here without a poison)
        return torch_backend.labelled_logprob(target, row_max, log_sum_exp, labelled, None)
    # (z_y - M) - log S negated term by term: M - z_y is z_y - M negated exactly, one kernel fewer
    value = (row_max - target) + log_sum_exp
    return value if labelled is None else torch.where(labelled, value, 0.0)


def combine_blocks(parts: list) -> ShardStats:
    """Merge the ShardStats of disjoint column blocks of one shard (same rows: lean mode's tiles)
    into one, with the math merge_shard_stats merges shards with (without a collective)."""
    if len(parts) == 1:
        return parts[0]
    maxes = torch.stack([p.max for p in parts])
    row_max = maxes.amax(0)
    safe_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    rescale = torch.exp(maxes - safe_max)  # a block without valid columns: exp(-inf) = 0
    sums = torch.stack([p.sum_exp for p in parts])
    sum_exp_shifted = None
    if parts[0].sum_exp_shifted is not None:
        shift = torch.where(torch.isfinite(maxes), maxes - safe_max, 0.0)
        shifted = torch.stack([p.sum_exp_shifted for p in parts])
        sum_exp_shifted = ((shifted + shift * sums) * rescale).sum(0)
    return ShardStats(
        max=row_max,
        sum_exp=(sums * rescale).sum(0),
        target=torch.stack([p.target for p in parts]).sum(0),
        sum_logits=None if parts[0].sum_logits is None else torch.stack([p.sum_logits for p in parts]).sum(0),
        sum_exp_shifted=sum_exp_shifted,
    )


class RankCheck:
    """Values that must be equal on every rank of the group (fp32 pieces of fingerprints, exact
    integers), compared on the device by riding on the merge's all-gather: packed after the
    partials, every rank sees every rank's values and computes the same verdict without a
    collective or a host read of its own (deferred_errors.py): the merge replaces `poison` (fp32
    [1], the call's device checks so far: NaN where they found bad contents, else 0) by one with
    the verdict in it, and records the verdict in `flags` (the device's word of deferred errors)."""

    def __init__(self, values: Tensor, poison: Tensor, flags: Optional[Tensor]):
        self.values: Optional[Tensor] = values
        self.poison = poison
        self.flags = flags

    def take(self) -> Optional[Tensor]:
        values, self.values = self.values, None
        return values

    def verdict_inputs(self) -> tuple:
        """backend.merge_gathered's `rank_verdict`."""
        return self.poison, self.flags, deferred_errors.RANKS_DIFFER


def packed_partials(stats: ShardStats, check: Optional[Tensor] = None) -> Tensor:
    """A shard's partials as one fp32 vector for the merge's all-gather (one launch): [m |
    sum exp(z - m) | z_y | (sum z) | (sum exp(z - m)(z - m)) | (the rank check's values)], the
    fields n long each (backend.merge_gathered's layout)."""
    parts = [stats.max, stats.sum_exp, stats.target]
    parts += [t for t in (stats.sum_logits, stats.sum_exp_shifted) if t is not None]
    if check is not None:
        parts.append(check)
    return torch.cat(parts)


def merge_shard_stats(stats: ShardStats, group, backend, rank_check: Optional[RankCheck] = None,
                      logprob_of: Optional[tuple] = None) -> MergedStats:
    """This shard's partials -> the statistics over the whole vocab, identical on every rank: the
    partials packed with the rank check's values (one launch), one all-gather, the backend's merge
    in rank order with log S / lse / entropy and the verdict (one launch). At TP = 1 the tail alone,
    and with `logprob_of` (labelled, kept, poison: backend.labelled_logprob's) the labelled
    log-probs in the tail's launch (`forward_logprob`)."""
    if group_size(group) == 1:
        tail = backend.merged_tail(stats.max, stats.sum_exp, stats.sum_exp_shifted,
                                   None if logprob_of is None else (stats.target, *logprob_of))
        return MergedStats(lse=tail[1], target=stats.target, sum_logits=stats.sum_logits, entropy=tail[2],
                           max=stats.max, log_sum_exp=tail[0], forward_logprob=None if logprob_of is None else tail[3])
    return _gathered_merge(stats, group, backend, rank_check)[0]


def merged_logprobs(stats: ShardStats, group, backend, rank_check: Optional[RankCheck], labelled: Optional[Tensor],
                    call_poison: Callable[[], Tensor]) -> tuple:
    """merge_shard_stats, and a forward-only call's result: the `labelled` rows' log-probs (0
    elsewhere) plus the call's poison, in the merge's own launch (one launch fewer): at TP = 1 the
    tail's, `call_poison()` (the label checks') read before it; at TP > 1 the gathered merge's,
    `call_poison()` read after the gather (the rank check it holds is decided there) or the rank
    check's poison taken in the kernel. -> (statistics, log-probs)."""
    if group_size(group) == 1:
        merged = merge_shard_stats(stats, group, backend, logprob_of=(labelled, None, call_poison()))
        return merged, merged.forward_logprob
    return _gathered_merge(stats, group, backend, rank_check, labelled=labelled, call_poison=call_poison)


def _gathered_merge(stats: ShardStats, group, backend, rank_check: Optional[RankCheck], labelled=None,
                    call_poison: Optional[Callable[[], Tensor]] = None) -> tuple:
    """TP > 1: pack, all-gather, merge (with the log-probs where `call_poison` is given). -> (statistics,
    log-probs or None)."""
    check = rank_check.take() if rank_check is not None else None
    payload = packed_partials(stats, check)
    ranks = dist.get_world_size(group)
    gathered = payload.new_empty(ranks * payload.numel())
    all_gather_rows(gathered, payload, group)
    # the log-probs' poison: the verdict's where the rank check rides here, else the call's own
    poison = call_poison() if call_poison is not None and check is None else None
    row_max, log_sum_exp, lse, target, sum_logits, entropy, verdict_poison, logprob = backend.merge_gathered(
        gathered.view(ranks, -1), stats.max.numel(), stats.sum_logits is not None, stats.sum_exp_shifted is not None,
        rank_check.verdict_inputs() if check is not None else None, call_poison is not None, labelled, poison)
    if verdict_poison is not None:
        rank_check.poison = verdict_poison
    return MergedStats(lse=lse, target=target, sum_logits=sum_logits, entropy=entropy, max=row_max,
                       log_sum_exp=log_sum_exp), logprob


class InputGradSum:
    """This rank's partial dX -> the full input gradient (summed over the TP group; reduce-scattered
    under SP), the collective started by `start()` and waited for by `result()` (which starts it
    if it was not: the backward's dX sum, as ColumnParallelLinear's backward makes it).

    Gradients-in-forward start it in the forward, right after the last chunk's dX GEMM, so that it
    runs beside the dW GEMM (as Megatron's ColumnParallelLinear overlaps its dX all-reduce with
    the weight gradient); the backward then only waits. The sum is of the unscaled partials: the
    upstream gradient g, one scalar on every TP rank (the loss every rank computes from the same
    merged statistics), is applied after it. While a CUDA graph is being captured the collective
    completes where it starts: one graph cannot wait for an event of another (make_graphed_callables
    captures the forward and the backward apart)."""

    def __init__(self, partial: Tensor, group, sequence_parallel: bool):
        self.partial, self.group, self.sequence_parallel = partial, group, sequence_parallel
        self.summed: Optional[Tensor] = None
        self.work = None

    def start(self) -> None:
        if self.summed is not None:
            return
        if group_size(self.group) == 1:
            self.summed = self.partial
            return
        asynchronous = not (self.partial.is_cuda and torch.cuda.is_current_stream_capturing())
        if self.sequence_parallel:
            self.summed = self.partial.new_empty((self.partial.shape[0] // group_size(self.group),)
                                                 + tuple(self.partial.shape[1:]))
            self.work = dist.reduce_scatter_tensor(self.summed, self.partial, op=dist.ReduceOp.SUM,
                                                   group=self.group, async_op=asynchronous)
        else:
            self.summed = self.partial
            self.work = dist.all_reduce(self.partial, op=dist.ReduceOp.SUM, group=self.group,
                                        async_op=asynchronous)

    def result(self) -> Tensor:
        self.start()
        if self.work is not None:
            self.work.wait()  # (NCCL: the current stream waits on the collective; no host wait)
            self.work = None
        self.partial = None
        return self.summed


def gather_sequence(local: Tensor, group) -> Tensor:
    """Sequence parallel: all-gather [n_local, ...] slices along dim 0 into [n_local * tp, ...]."""
    world = group_size(group)
    if world == 1:
        return local
    out = local.new_empty((local.shape[0] * world,) + tuple(local.shape[1:]))
    all_gather_rows(out, local.contiguous(), group)
    return out


def max_over_ranks(values: Tensor, group) -> Tensor:
    """Element-wise max over the group, in place: the int64 vector of the argument agreement
    (agreement.py), the row maxima of the unfused post-processor."""
    if group_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


def argmax_over_ranks(values: Tensor, indices: Tensor, group) -> Tensor:
    """Per row, the index (int64) of the largest of the shards' best values; among equal values the
    smallest index, as `argmax` over the gathered row would give."""
    if group_size(group) == 1:
        return indices
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    candidate = torch.where(values == best, indices, torch.iinfo(torch.int64).max)
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


# --------------------------------------------------------------------------------------------
# Sampler fidelity (sampling.py): candidates of every rank, sums of kept-set partials, and the
# exact-search steps. Every call is made by all ranks in the same order: the decisions that lead
# to one (which rows need a search, how many steps) are taken on values already identical on
# every rank (gathered candidates, all-reduced sums).
# --------------------------------------------------------------------------------------------
def gather_over_ranks(values: Tensor, group) -> Tensor:
    """[...] per rank -> [tp, ...] in rank order, which is vocab-id order (one all-gather). Used for
    the [n, M] candidate keys (O(n * M)) and the per-rank counts of tokens tied at a cut."""
    world = group_size(group)
    if world == 1:
        return values.unsqueeze(0)
    out = values.new_empty((world * values.shape[0],) + tuple(values.shape[1:]))
    all_gather_rows(out, values.contiguous(), group)
    return out.view((world,) + tuple(values.shape))


def sum_over_ranks(partials: Tensor, group) -> Tensor:
    """Element-wise sum of per-rank partials (kept-set sums, counts), identical on every rank."""
    if group_size(group) > 1:
        partials = partials.clone()
        dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=group)
    return partials


# ------------------------------------------------------------------------------------------------
# Context parallelism: the collectives of the losses (megatron_fused_ce.losses).
#
# Under context parallelism (CP) each rank holds a slice of every sequence. A loss that needs a sum
# over a sequence or over the batch adds up the ranks' partial sums; every rank then evaluates the
# same loss f(S), S = Σ_r s_r, and the gradient that rank r must see for its own partial s_r is
# f'(S): the CP=1 gradient at its positions. Hence the all-reduce below has the identity as its
# backward (not the all-reduce that a plain "sum of per-rank losses" would call for): summing the
# parameter gradients over the data x context-parallel group, as Megatron's finalize_model_grads
# does, then yields the CP=1 gradient.
#
# One exception: a sum that is an input of further per-rank partials (GSPO's per-sequence ratio
# weighs every rank's tokens, whose partial losses are summed again). Rank r's backward then only
# holds d(its own partials)/dS, and the full dL/dS is the sum of those over the ranks: that sum's
# backward is an all-reduce (`feeds_partials=True`), valid as long as S reaches the loss only
# through per-rank partials. Every rank must backpropagate the same upstream gradient (Megatron
# scales the loss alike on every rank). The losses stack what they need into one vector per step,
# so the number of CP collectives per call is small and never depends on the data.
# ------------------------------------------------------------------------------------------------
class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, group, sum_gradients: bool) -> Tensor:
        ctx.group, ctx.sum_gradients = group, sum_gradients
        total = values.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        if ctx.sum_gradients:
            grad_total = grad_total.clone()
            dist.all_reduce(grad_total, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_total, None, None


def sum_over_context_ranks(values: Tensor, group, *, feeds_partials: bool = False) -> Tensor:
    """Element-wise sum over the CP group of a small vector of partial sums.

    Differentiable. The backward is the identity (every rank's loss is the same f(S)), or, with
    ``feeds_partials``, an all-reduce of the gradient (S is an input of per-rank partials; see above).
    """
    if group_size(group) == 1:
        return values
    return _SumOverRanks.apply(values, group, feeds_partials)


@torch.no_grad()
def max_over_context_ranks(values: Tensor, group) -> Tensor:
    """Element-wise max over the CP group of a small float vector (metrics only: no gradient).

    Pass ``-x`` for a minimum.
    """
    values = values.detach().clone()
    if group_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


# ------------------------------------------------------------------------------------------------
# Context parallelism: the collectives of the Megatron layer (megatron_fused_ce.megatron).
#
# A CP rank holds a slice of every sequence; putting the slices back together is an all-gather of
# equal-sized [..] slices, stacked by CP rank. Which original positions each slice holds is the
# caller's business (megatron/context_parallel.py).
# ------------------------------------------------------------------------------------------------
class _GatherContextRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        ctx.group = group
        local = local.contiguous()
        flat = local.reshape((1,) + tuple(local.shape)) if local.dim() == 0 else local
        out = flat.new_empty((group_size(group) * flat.shape[0],) + tuple(flat.shape[1:]))
        all_gather_rows(out, flat, group)
        return out.view((group_size(group),) + tuple(local.shape))

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        # Every rank used every slice: a slice's gradient is the sum of all ranks' gradients for it.
        grad = grad_out.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[group_rank(ctx.group)], None


def gather_context_ranks(local: Tensor, group) -> Tensor:
    """``[cp, *local.shape]``: every CP rank's ``local`` (same shape on all), stacked by CP rank.

    Differentiable (the backward sums the gradients of all ranks for this rank's slice): the
    CPU context-parallel attention gathers keys and values with it. Without a group of more than
    one rank: ``local.unsqueeze(0)``.
    """
    if group_size(group) == 1:
        return local.unsqueeze(0)
    return _GatherContextRanks.apply(local, group)
