"""A context-parallel core attention without Transformer Engine, for CPU runs, tests and examples.

megatron-core's own context-parallel attention is Transformer Engine's (`TEDotProductAttention`;
the local `DotProductAttention` asserts CP = 1). `GatheredKVAttention` takes its place in the local
layer spec (`with_context_parallel_attention(spec)`): each CP rank all-gathers the keys and values
of the whole sequence and attends from its own queries, with the causal mask written in original
positions (`context_parallel.positions_on_cp_rank`: Megatron's load-balanced layout, or THD
per-document with `packed_seq_params`, where a token also sees only its own document). The
result at every position is the CP=1 attention's, whatever the layout; the price is O(s²) memory
per rank, fine for small models and the CPU.

This makes a GPTModel with context parallelism run end to end on gloo (the fused output layer, the
loss funcs' CP shares and Megatron's DP×CP gradient reduction are then tested for real), and keeps
the examples' `--cp` runnable where Transformer Engine is not installed. With Transformer Engine,
use its layer spec instead.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from megatron_fused_ce.ops import reductions

from megatron_fused_ce.megatron import compat
from megatron_fused_ce.megatron.context_parallel import positions_on_cp_rank


class GatheredKVAttention(torch.nn.Module):
    """Causal softmax attention that is exact under context parallelism (see the module doc).

    Built by megatron's `SelfAttention` like `DotProductAttention` (same arguments), called as
    `(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None)` with `[s/CP, b, heads/TP, d]` (THD: `[t/CP, heads/TP, d]`) inputs;
    returns `[s/CP, b, heads/TP · d]`. The scores and softmax are computed in fp32. The
    `attention_mask` argument is not read: the mask is causal by construction.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 **_):
        super().__init__()
        if "causal" not in getattr(attn_mask_type, "name", str(attn_mask_type)):
            raise ValueError(f"GatheredKVAttention is causal; got attn_mask_type={attn_mask_type}")
        from megatron.core import parallel_state

        self.config = config
        tp_group = compat.pg_collection_group(pg_collection, "tp") or \
            parallel_state.get_tensor_model_parallel_group()
        self.cp_group = compat.pg_collection_group(pg_collection, "cp") or \
            parallel_state.get_context_parallel_group()
        tp = reductions.group_size(tp_group)
        self.heads = config.num_attention_heads // tp
        self.query_groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        # (apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # scores back before the softmax: the same product)
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("GatheredKVAttention: attention_bias is not supported")
        bounds = None
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"GatheredKVAttention: packed_seq_params.qkv_format must be 'thd', "
                                 f"got {packed_seq_params.qkv_format!r}")
            bounds = packed_seq_params.cu_seqlens_q_padded
            if bounds is None:
                bounds = packed_seq_params.cu_seqlens_q
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        local_len, batch = query.shape[0], query.shape[1]
        cp_size, cp_rank = reductions.group_size(self.cp_group), reductions.group_rank(self.cp_group)
        length = local_len * cp_size

        # Keys and values of every rank (rank-major), and the original position of each.
        gathered = reductions.gather_context_ranks(torch.stack([key, value]), self.cp_group)
        keys, values = gathered.transpose(0, 1).flatten(1, 2).unbind(0)  # [s, b, groups, d]
        key_pos = torch.cat([positions_on_cp_rank(length, cp_size, rank, cu_seqlens_padded=bounds)
                             for rank in range(cp_size)]).to(query.device)
        query_pos = positions_on_cp_rank(length, cp_size, cp_rank, cu_seqlens_padded=bounds).to(query.device)
        allowed = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [s/cp, s]
        if bounds is not None:  # and the same document
            ends = bounds.to(device=query.device, dtype=torch.long)[1:]
            allowed &= (torch.bucketize(key_pos, ends, right=True).unsqueeze(0)
                        == torch.bucketize(query_pos, ends, right=True).unsqueeze(1))

        repeat = self.heads // self.query_groups
        if repeat > 1:
            keys, values = keys.repeat_interleave(repeat, dim=2), values.repeat_interleave(repeat, dim=2)
        scores = torch.einsum("qbnd,kbnd->bnqk", query.float(), keys.float()) * self.softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.einsum("bnqk,kbnd->qbnd", probs, values.float()).to(query.dtype)
        return out.reshape(local_len, batch, -1)


def with_context_parallel_attention(spec):
    """A copy of a local layer spec (a `TransformerLayer` ModuleSpec, or `TransformerBlockSubmodules`)
    whose self-attention's core attention is `GatheredKVAttention`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules
        return dataclasses.replace(spec, layer_specs=[with_context_parallel_attention(layer)
                                                      for layer in spec.layer_specs])
    attention = spec.submodules.self_attention
    attention = ModuleSpec(module=attention.module, params=dict(attention.params),
                           submodules=dataclasses.replace(attention.submodules,
                                                          core_attention=GatheredKVAttention))
    return ModuleSpec(module=spec.module, params=dict(spec.params),
                      submodules=dataclasses.replace(spec.submodules, self_attention=attention))
