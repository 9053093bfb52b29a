"""Context parallelism (CP) in the Megatron layer: which tokens a CP rank holds, and its group.

Megatron shards every sequence over the CP ranks before the model sees it
(`megatron.core.utils.get_batch_on_this_cp_rank`), so that the causal attention costs the same on
every rank:

* a batch of whole sequences `[b, s]`: the sequence is cut into 2·CP equal chunks and rank r keeps
  chunks r and 2·CP−1−r, in that order (CP=2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2);
* a packed batch (THD, `[1, T]` with `cu_seqlens_padded`: each document padded to a multiple of
  2·CP): the same split inside every document, documents in order (Transformer Engine's
  `thd_get_partitioned_indices`).

`positions_on_cp_rank` gives the original positions of a rank's local tokens in that order. Everything
else is derived from it: `batch_on_this_cp_rank` (the slicing, without Transformer Engine), `gather_in_
sequence_order` (all ranks' slices back in the original order), the packed-sequence label mask of
the post-processor (`postprocess.packed_sequence_labels`) and the CPU attention (`cp_attention.py`).

The losses need no positions: a loss on a CP slice sums its sequence-level terms over the group
(`megatron_fused_ce.losses`, `cp_group=`), and the loss funcs hand Megatron a share of each
sequence-level term (`loss_funcs.py`).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from megatron_fused_ce.ops import reductions

from . import compat

# batch entries that describe the packing rather than hold one value per token
PACKING_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def context_parallel_group(model: Optional[torch.nn.Module] = None):
    """The CP group of `model` (megatron's `pg_collection.cp`), else megatron's `parallel_state`
    one; None without context parallelism (CP = 1, or no megatron parallel state)."""
    group = None
    if model is not None:
        group = compat.cp_group_of(model)
    if group is None:
        try:
            from megatron.core import parallel_state
        except ImportError:
            return None
        if not parallel_state.model_parallel_is_initialized():
            return None
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group if reductions.group_size(group) > 1 else None


def _checked_bounds(cu_seqlens_padded, length: int, cp_size: int) -> Tensor:
    """`cu_seqlens_padded` as int64 on the host, or a ValueError saying why it cannot be sharded."""
    if not isinstance(cu_seqlens_padded, Tensor) or cu_seqlens_padded.dim() != 1 \
            or cu_seqlens_padded.numel() < 2 or cu_seqlens_padded.dtype.is_floating_point:
        raise ValueError("cu_seqlens_padded must be a 1-D integer tensor [num_seqs + 1]")
    bounds = cu_seqlens_padded.detach().to("cpu", torch.long)
    lengths = bounds[1:] - bounds[:-1]
    if bounds[0] != 0 or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens_padded must start at 0 and be non-decreasing, got {bounds.tolist()}")
    if int(bounds[-1]) != length:
        raise ValueError(f"cu_seqlens_padded ends at {int(bounds[-1])}, but the packed sequence has "
                         f"{length} tokens (local length x CP): every token belongs to a (padded) "
                         "document under context parallelism")
    if bool((lengths % (2 * cp_size) != 0).any()):
        raise ValueError(f"with context parallelism every padded document length must be a multiple "
                         f"of 2·CP = {2 * cp_size} (cu_seqlens_padded), got lengths {lengths.tolist()}")
    return bounds


def positions_on_cp_rank(length: int, cp_size: int, cp_rank: int, *,
                      cu_seqlens_padded: Optional[Tensor] = None) -> Tensor:
    """The original positions (int64, on the CPU) of CP rank `cp_rank`'s `length // cp_size` tokens,
    in its local order. `length` is the full sequence length (packed: the whole packed row)."""
    if cp_size == 1:
        return torch.arange(length)
    if cu_seqlens_padded is None:
        if length % (2 * cp_size):
            raise ValueError(f"with context parallelism the sequence length must be a multiple of "
                             f"2·CP = {2 * cp_size}, got {length}")
        chunk = length // (2 * cp_size)
        first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
        return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])
    bounds = _checked_bounds(cu_seqlens_padded, length, cp_size)
    chunks = (bounds[1:] - bounds[:-1]) // (2 * cp_size)  # per document
    local_lengths = 2 * chunks
    document = torch.repeat_interleave(torch.arange(chunks.numel()), local_lengths)
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths
    j = torch.arange(int(local_lengths.sum())) - local_starts[document]  # index in the document
    chunk, start = chunks[document], bounds[:-1][document]
    return torch.where(j < chunk, start + cp_rank * chunk + j,
                       start + (2 * cp_size - 1 - cp_rank) * chunk + (j - chunk))


def _size_and_rank(cp_group):
    return reductions.group_size(cp_group), reductions.group_rank(cp_group)


def batch_on_this_cp_rank(batch: Mapping, cp_group, *, cu_seqlens_padded: Optional[Tensor] = None) -> dict:
    """This CP rank's part of a micro-batch, as megatron's `get_batch_on_this_cp_rank` cuts it.

    Every tensor with a sequence dimension is sliced: dim 1 of the `[b, s, ...]` ones (tokens,
    labels, loss mask, position ids, per-token log-probs, ...), dim 2 of `attention_mask`
    (`[b, 1, s, s]`: its query rows). One-dimensional entries (per-sequence advantages) and the
    packing metadata (`cu_seqlens`, `cu_seqlens_padded`, `max_seqlen`: they stay global, as
    megatron keeps them) are passed through. A packed batch (`cu_seqlens_padded`, or
    `batch["cu_seqlens_padded"]`) is split document by document; without CP the batch is returned
    as it is.
    """
    cp_size, cp_rank = _size_and_rank(cp_group)
    if cp_size == 1:
        return dict(batch)
    if cu_seqlens_padded is None:
        cu_seqlens_padded = batch.get("cu_seqlens_padded")
    length = None
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and key not in PACKING_KEYS \
                and key != "attention_mask":
            length = value.shape[1] if length is None else length
            if value.shape[1] != length:
                raise ValueError(f"batch_on_this_cp_rank: {key} has {value.shape[1]} positions, other "
                                 f"entries {length}")
    out = dict(batch)
    if length is None:
        return out
    index = positions_on_cp_rank(length, cp_size, cp_rank, cu_seqlens_padded=cu_seqlens_padded)
    for key, value in batch.items():
        if not isinstance(value, Tensor) or value.dim() < 2 or key in PACKING_KEYS:
            continue
        dim = 2 if key == "attention_mask" else 1
        if key == "attention_mask" and value.shape[dim] != length:
            continue  # a broadcastable mask
        out[key] = value.index_select(dim, index.to(value.device))
    return out


def gather_from_cp_ranks(local: Tensor, cp_group, *,
                             cu_seqlens_padded: Optional[Tensor] = None) -> Tensor:
    """`[b, s]` from every CP rank's `[b, s / CP]` slice of it (dim 1), in the original order, on
    every rank of the group (an all-gather over CP). Differentiable as a sum over ranks: a slice's
    gradient is the sum of every rank's gradient for it, each rank's loss a part of the total (a
    loss computed alike on every rank from the gathered tensor counts CP times; divide it by CP,
    or use the losses' own CP sums). Without CP: `local`."""
    cp_size, _ = _size_and_rank(cp_group)
    if cp_size == 1:
        return local
    length = local.shape[1] * cp_size
    index = torch.cat([positions_on_cp_rank(length, cp_size, rank, cu_seqlens_padded=cu_seqlens_padded)
                       for rank in range(cp_size)]).to(local.device)
    gathered = reductions.gather_context_ranks(local, cp_group)  # [cp, b, s/cp, ...]
    by_rank = gathered.transpose(0, 1).reshape((local.shape[0], length) + tuple(local.shape[2:]))
    return torch.zeros_like(by_rank).index_copy(1, index, by_rank)
