"""The last pipeline stage's results on every stage: `broadcast_from_last_stage` carries a tensor
or a `LogprobsOutput` over the pipeline group, and `compute_logprobs` runs a forward-only pass
(reference or old-policy log-probs) through Megatron's schedule with a `LogprobsPostProcessor` and
hands every stage the result; under context parallelism each rank's slice (default) or the whole
sequences (`layout="gathered"`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_fused_ce import LogprobsOutput
from megatron_fused_ce.losses.context_parallel import agree_on_inputs

from .context_parallel import gather_from_cp_ranks
from .postprocess import LogprobsPostProcessor, as_post_processor, check_model_output

# ------------------------------------------------------------------------------------------------
# Pipeline parallelism: results of the last stage on every stage.
# ------------------------------------------------------------------------------------------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.bool]
_MAX_DIMS = 6
_TENSOR, _LOGPROBS, _LOGPROBS_WITH_ENTROPY = 1, 2, 3
_WITH_TOPK = 2  # added to a _LOGPROBS kind: topk_logprobs / topk_ids follow (k in the header)
_UNSENDABLE = -1  # the header's kind where the last stage's value cannot be sent: every stage raises

BroadcastValue = Union[Tensor, LogprobsOutput]


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
        torch.device("cpu")


def _unsendable(value) -> Optional[str]:
    """Why the last stage's `value` cannot be sent as the header describes it (None: it can)."""
    if value is None:
        return "the last stage must pass a value"
    first = value.logprobs if isinstance(value, LogprobsOutput) else value
    if not isinstance(first, Tensor):
        return f"a tensor or LogprobsOutput, got {type(value).__name__}"
    if first.dim() > _MAX_DIMS:
        return f"at most {_MAX_DIMS} dims, got {first.dim()}"
    if first.dtype not in _DTYPES:
        return f"a dtype among {', '.join(map(str, _DTYPES))}, got {first.dtype}"
    if not isinstance(value, LogprobsOutput):
        return None
    # the other stages make their buffers from the log-probs' shape and dtype (top-k: fp32 / int64)
    entropy = value.entropy
    if entropy is not None and (not isinstance(entropy, Tensor) or entropy.shape != first.shape
                                or entropy.dtype != first.dtype):
        return "the entropy must have the log-probs' shape and dtype"
    if (value.topk_ids is None) != (value.topk_logprobs is None):
        return "topk_logprobs and topk_ids go together"
    if value.topk_ids is not None:
        k = value.topk_ids.shape[-1] if value.topk_ids.dim() else -1
        for name, tensor, dtype in (("topk_logprobs", value.topk_logprobs, torch.float32),
                                    ("topk_ids", value.topk_ids, torch.int64)):
            if tensor.shape != first.shape + (k,) or tensor.dtype != dtype:
                return f"{name} must be {dtype} of the log-probs' shape + (k,)"
    return None


def broadcast_from_last_stage(value: Optional[BroadcastValue] = None, *, pp_group=None,
                              src: Optional[int] = None) -> BroadcastValue:
    """Send a tensor or `LogprobsOutput` from the last pipeline stage to every stage.

    The last stage passes its value; the other stages pass None (they need not know the shape or
    dtype: a small header travels first). Returns the value on every stage. `pp_group`/`src`
    default to megatron's pipeline group and its last rank.
    """
    if pp_group is None:
        from megatron.core import parallel_state

        pp_group = parallel_state.get_pipeline_model_parallel_group()
        src = parallel_state.get_pipeline_model_parallel_last_rank() if src is None else src
    if src is None:
        src = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    if dist.get_world_size(pp_group) == 1:
        return value
    sender = dist.get_rank() == src

    header = torch.zeros(4 + _MAX_DIMS, dtype=torch.int64, device=_comm_device())
    # (a value that cannot be sent still sends the header, marked: a stage that raised alone would
    # leave the others waiting in the broadcast)
    problem = _unsendable(value) if sender else None
    if problem is not None:
        header[0] = _UNSENDABLE
    elif sender:
        first = value.logprobs if isinstance(value, LogprobsOutput) else value
        kind = _TENSOR
        if isinstance(value, LogprobsOutput):
            kind = _LOGPROBS if value.entropy is None else _LOGPROBS_WITH_ENTROPY
            if value.topk_ids is not None:
                kind += _WITH_TOPK
                header[3] = value.topk_ids.shape[-1]
        header[:3] = torch.tensor([kind, _DTYPES.index(first.dtype), first.dim()])
        header[4:4 + first.dim()] = torch.tensor(first.shape)
        header = header.to(first.device)
    dist.broadcast(header, src=src, group=pp_group)
    kind, dtype, ndim, topk = header[:4].tolist()
    if kind == _UNSENDABLE:
        raise ValueError(f"broadcast_from_last_stage: {problem}" if sender else
                         "broadcast_from_last_stage: the last stage's value cannot be sent (it raised why there)")
    shape = header[4:4 + ndim].tolist()

    def one(tensor: Optional[Tensor], shape=shape, dtype=_DTYPES[dtype]) -> Tensor:
        if sender:
            buffer = tensor.detach().contiguous()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=header.device)
        dist.broadcast(buffer, src=src, group=pp_group)
        return tensor if sender else buffer

    if kind == _TENSOR:
        return one(value if sender else None)
    with_topk = kind > _LOGPROBS_WITH_ENTROPY
    kind -= _WITH_TOPK if with_topk else 0
    logprobs = one(value.logprobs if sender else None)
    entropy = None
    if kind == _LOGPROBS_WITH_ENTROPY:
        entropy = one(value.entropy if sender else None)
    if not with_topk:
        return LogprobsOutput(logprobs, entropy)
    topk_logprobs = one(value.topk_logprobs if sender else None, shape + [topk], torch.float32)
    topk_ids = one(value.topk_ids if sender else None, shape + [topk], torch.int64)
    return LogprobsOutput(logprobs, entropy, topk_logprobs, topk_ids)


COMPUTE_LOGPROBS_LAYOUTS = ("sharded", "gathered")


def _masks_per_batch(sampling_mask, num_batches: int) -> list:
    """compute_logprobs' `sampling_mask`: one entry (a mask or None) per micro-batch."""
    if sampling_mask is None:
        return [None] * num_batches
    entries = list(sampling_mask) if isinstance(sampling_mask, (list, tuple)) else None
    if (entries is None or len(entries) != num_batches or hasattr(sampling_mask, "token_ids")
            or any(isinstance(entry, Tensor) for entry in entries)):
        raise ValueError(f"compute_logprobs: sampling_mask must be None or a list with one entry per "
                         f"micro-batch ({num_batches}), each a mask ((token_ids, offsets) or an object "
                         f"with .token_ids / .offsets) or None")
    return entries


def compute_logprobs(model, batches: Sequence[Mapping], forward_fn: Callable,
                     post_processor: LogprobsPostProcessor, *, seq_length: int,
                     micro_batch_size: int, layout: str = "sharded",
                     sampling_mask: Optional[Sequence] = None) -> List[LogprobsOutput]:
    """A forward-only pass (no autograd graph) returning each micro-batch's log-probs on every stage.

    For reference-policy / old-policy log-probs. `forward_fn(model_chunk, batch)` runs the model on
    one micro-batch (`model_chunk(tokens, position_ids, attention_mask)`, with the fused layer
    installed or not; or with `output_processor=FusedOutputProcessor(...)` on megatron-core >=
    0.18), `post_processor` is a `LogprobsPostProcessor` or that processor, `batch["labels"]` holds
    the shifted labels, `batch.get("cu_seqlens")` / `batch.get("cu_seqlens_padded")` the
    packed-sequence offsets. `model` is a model chunk or the list of virtual-pipeline chunks.
    `seq_length` is the full sequence length (megatron divides it by CP for the pipeline buffers).

    Context parallelism (the batches hold this CP rank's slices): `layout="sharded"` (default)
    returns each CP rank's log-probs in the layout of its batch, which is what that rank's loss
    func takes on the next forward, and costs no communication; `layout="gathered"` returns the
    whole `[b, s]` sequences in their original order on every CP rank (what an RL trainer stores).
    Without CP both are the same.

    `sampling_mask`: None, or one per micro-batch (a mask or None): the log-probs of the engine's
    kept sets (replay, see `LogprobsPostProcessor`), e.g. the old policy's; each in the `[b, s]`
    layout of its batch's labels, for the whole sequences under CP (the batches hold CP slices,
    the masks do not).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if layout not in COMPUTE_LOGPROBS_LAYOUTS:
        raise ValueError(f"layout must be one of {COMPUTE_LOGPROBS_LAYOUTS}, got {layout!r}")
    masks = _masks_per_batch(sampling_mask, len(batches))
    post_processor = as_post_processor(post_processor)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]

    def loss_func(index, batch, chunk, output_tensor):
        check_model_output(output_tensor)
        packing = dict(cu_seqlens=batch.get("cu_seqlens"), cu_seqlens_padded=batch.get("cu_seqlens_padded"))
        cp_group = post_processor.context_parallel_group(chunk) if layout == "gathered" else None
        outs = []
        # Under CP a rank that fails must not leave the others waiting in the gather: the error
        # is agreed over the CP group (and TP: the same batch) first.
        replay = {} if masks[index] is None else {"sampling_mask": masks[index]}
        agree_on_inputs("compute_logprobs", lambda: outs.append(post_processor(
                            output_tensor, chunk, batch["labels"], **packing, **replay)),
                        cp_group=cp_group,
                        other_groups=(post_processor.tensor_parallel_group(chunk),) if cp_group else (),
                        device=output_tensor.device,
                        flags=[("sampling_mask given", masks[index] is not None)])
        out = outs[0]
        if cp_group is not None:
            layout_offsets = packing["cu_seqlens_padded"] if packing["cu_seqlens_padded"] is not None \
                else packing["cu_seqlens"]

            # [b, s/CP, ...] -> [b, s, ...] (entropy, top-k too)
            out = out.map(lambda values: gather_from_cp_ranks(values, cp_group,
                                                              cu_seqlens_padded=layout_offsets))
        zero = torch.zeros((), device=output_tensor.device)  # (a HiddenStates has no new_zeros)
        return zero, torch.ones((), dtype=torch.int, device=zero.device), {"logprobs": out}

    def forward_step(data_iterator, chunk):
        index, batch = next(data_iterator)
        return forward_fn(chunk, batch), partial(loss_func, index, batch, chunk)

    iterators = [iter(list(enumerate(batches))) for _ in chunks]
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks, num_microbatches=len(batches), seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=True)
    last = parallel_state.is_pipeline_last_stage()
    return [broadcast_from_last_stage(outputs[i]["logprobs"] if last else None)
            for i in range(len(batches))]
