"""`linear_argmax`: the most likely token of each row, argmax_k (hidden @ W_full.T)[k], chunk by chunk.

Forward only (no gradient): each chunk's logits on this rank's vocab shard give a per-row best
value and its global id; the shards' bests are merged with reductions.argmax_over_ranks (one
all-reduce MAX of the values, one all-reduce MIN of the ids that reach it). Ties go to the smallest
id, as `torch.argmax` over the gathered logits. Values are compared in the weight's dtype, as
Megatron compares its materialized logits.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reductions
from .api import auto_chunk_size


def linear_argmax(hidden: Tensor, weight: Tensor, *, tp_group=None, chunk_size: Optional[int] = None,
                  sequence_parallel: bool = False) -> Tensor:
    """int64 ids of shape `hidden.shape[:-1]` (dim 0 times TP under `sequence_parallel`), identical
    on every rank of `tp_group`, over every column of the (padded) vocab as Megatron's argmax of
    its logits."""
    tp_size, tp_rank = reductions.group_size(tp_group), reductions.group_rank(tp_group)
    v_local, hidden_size = weight.shape
    if hidden.shape[-1] != hidden_size:
        raise ValueError(f"linear_argmax: hidden size {hidden.shape[-1]} != weight's {hidden_size}")
    start = tp_rank * v_local
    with torch.no_grad():
        rows = hidden.reshape(-1, hidden_size).to(weight.dtype)
        out_shape = tuple(hidden.shape[:-1])
        if sequence_parallel and tp_size > 1:
            rows = reductions.gather_sequence(rows, tp_group)
            out_shape = (out_shape[0] * tp_size,) + out_shape[1:]
        best_value = torch.full((rows.shape[0],), float("-inf"), device=rows.device)
        best_id = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
        step = chunk_size or auto_chunk_size(rows.shape[0], v_local, rows.device,
                                             logits_element_size=weight.element_size())
        for begin in range(0, rows.shape[0], step):
            values, ids = torch.mm(rows[begin:begin + step], weight.t()).max(dim=-1)
            best_value[begin:begin + step] = values.float()  # exact: bf16/fp16 -> fp32
            best_id[begin:begin + step] = ids + start
        return reductions.argmax_over_ranks(best_value, best_id, tp_group).reshape(out_shape)
