"""Per-token log-probs on the last pipeline stage, from hidden states (fused) or logits (unfused).

`LogprobsPostProcessor(...)(output_tensor, model, labels)` is what a Megatron `loss_func` calls on
the model output. Follow one token t of row i:

1. `labels[i, t]` is Megatron-style, already shifted: the id of token t+1. With packed sequences
   (`cu_seqlens`) the last position of each sequence would be scored against the first token of
   the next one, so it gets `ignore_index` (log-prob exactly 0, no gradient), as does the padding
   after the last sequence (and, THD with `cu_seqlens_padded`, each sequence's padding).
   Under context parallelism, row i and position t are this CP rank's slice (megatron's layout,
   `context_parallel.py`); a packed boundary is found on whichever rank holds it.
2. Fusion on (`install_fused_output_layer`): `output_tensor[i, t]` is the final hidden state. It
   goes to `linear_logprobs` with this rank's vocab shard of the output weight; the `[tokens, V/TP]`
   logits never exist. Under sequence parallelism `output_tensor` is `[b, s/TP, h]` and the op
   all-gathers it along the sequence.
3. Fusion off: `output_tensor[i, t]` is the row of logits `[V/TP]`; the same softmax statistics
   (max, sum-exp, target logit, expected logit) are merged over tensor-parallel ranks
   (`unfused_logprobs.vocab_parallel_logprobs`).
Both give `LogprobsOutput(logprobs [b, s], entropy [b, s] | None)`, fp32, identical on all TP
ranks, of `softmax(z[:vocab_size] / temperature)` -- or, with the rollouts' sampler settings
(`top_k` / `top_p` / `min_p`), of the distribution the inference engine sampled from (tokens it
could not have sampled get -inf; `linear_logprobs` documents the semantics), plus
`topk_logprobs` / `topk_ids` `[b, s, k]` with `return_topk=k`.

Sampling-distribution replay (`sampling_mask=`, per call): the kept sets the inference engine's
sampler drew each token from (vLLM's Mask Replay layout, `linear_logprobs`), given in the `[b, s]`
batch layout of the labels as `ops.replay.build_sampling_mask` makes it; under context parallelism
for the whole sequences (each CP rank cuts out its own positions). The fused path hands the op the
mask in its label layout (`[s, b]` under sequence parallelism), the unfused path scores the same
sets on the logits (`ops.replay.kept_columns`), so both give the same log-probs.

`pipeline.py` carries the result of a forward-only pass (reference / old policy log-probs) to
every pipeline stage (`compute_logprobs`, `broadcast_from_last_stage`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_fused_ce import LogprobsOutput, linear_logprobs
from megatron_fused_ce.ops import reductions, replay, sampling
from megatron_fused_ce.ops.agreement import Agreement, finite_real, fits_int64, flag_argument, integer_argument, is_int

from . import compat
from .config import FusedCEConfig
from .context_parallel import context_parallel_group, positions_on_cp_rank
from .output_layer import HiddenStates, is_fused, output_weight, unwrap_model
from .unfused_logprobs import IGNORE_INDEX, vocab_parallel_logprobs


def _tp_group(gpt):
    return compat.tp_group_of(gpt)


def check_model_output(output) -> None:
    """Refuse log-probs an output processor already computed: the post-processor, the loss funcs
    and compute_logprobs read logits, the installed layer's hidden states or `HiddenStates`."""
    if isinstance(output, tuple):
        raise TypeError(
            "the model returned log-probs already (FusedOutputProcessor(returns='logprobs'), a "
            "LogprobsOutput or the plain tuple Float16Module makes of it): the post-processor, the "
            "loss funcs and compute_logprobs take the hidden states, "
            "FusedOutputProcessor(returns='hidden_states') (the default)")


def as_post_processor(post_processor):
    """The `LogprobsPostProcessor` behind `post_processor`: itself, or the one a
    `FusedOutputProcessor` holds (the same settings), so that the loss funcs take either."""
    inner = getattr(post_processor, "post_processor", None)
    if not isinstance(post_processor, LogprobsPostProcessor) and isinstance(inner, LogprobsPostProcessor):
        return inner
    return post_processor


def packed_sequence_labels(labels: Tensor, cu_seqlens: Optional[Tensor],
                           ignore_index: int = IGNORE_INDEX, *,
                           cu_seqlens_padded: Optional[Tensor] = None, cp_group=None) -> Tensor:
    """`labels` with the positions that would cross a sequence boundary set to `ignore_index`.

    `cu_seqlens` (int, `[num_seqs + 1]`, starting at 0) are offsets into the row-major flattened
    `[b * s]` token stream (for the usual packed batch, b = 1: offsets along the sequence). The
    last position of each sequence and every position outside the sequences (after
    `cu_seqlens[-1]`) are not scored.

    `cu_seqlens_padded` (THD with padding, as megatron's `PackedSeqParams.cu_seqlens_q_padded`):
    sequence i then starts at `cu_seqlens_padded[i]` and holds `cu_seqlens[i+1] - cu_seqlens[i]`
    real tokens; its padding is not scored either. With a context-parallel `cp_group`, `labels` is
    this CP rank's `[1, T / CP]` slice of the packed row, cut document by document as megatron
    does (`context_parallel.positions_on_cp_rank`; `cu_seqlens_padded`, or `cu_seqlens` when each
    document length is already a multiple of 2·CP): the boundary is found wherever it landed.
    """
    if cu_seqlens is None:
        return labels
    cp_size, cp_rank = reductions.group_size(cp_group), reductions.group_rank(cp_group)
    if cp_size > 1 and labels.dim() == 2 and labels.shape[0] != 1:
        raise ValueError(f"packed sequences under context parallelism are one packed row: labels "
                         f"must be [1, T / CP], got {tuple(labels.shape)}")
    length = labels.numel() * cp_size
    bounds = _checked_cu_seqlens(cu_seqlens, length)
    starts = bounds[:-1]
    if cu_seqlens_padded is not None:
        padded = _checked_cu_seqlens(cu_seqlens_padded, length, name="cu_seqlens_padded")
        if padded.numel() != bounds.numel() or bool(((padded[1:] - padded[:-1])
                                                     < (bounds[1:] - bounds[:-1])).any()):
            raise ValueError("cu_seqlens_padded must hold the same sequences as cu_seqlens, each "
                             "at least as long")
        starts = padded[:-1]
    # scored: start <= p < start + len - 1 for each sequence (a difference array over positions)
    lengths = bounds[1:] - bounds[:-1]
    starts, ends = starts[lengths > 1], (starts + lengths - 1)[lengths > 1]
    edges = torch.zeros(length + 1, dtype=torch.long)
    edges.index_add_(0, starts, torch.ones_like(starts))
    edges.index_add_(0, ends, -torch.ones_like(ends))
    scored = torch.cumsum(edges[:-1], 0) > 0
    if cp_size > 1:
        layout = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        scored = scored[positions_on_cp_rank(length, cp_size, cp_rank, cu_seqlens_padded=layout)]
    scored = scored.reshape(labels.shape).to(labels.device)
    return torch.where(scored, labels, torch.full_like(labels, ignore_index))


def _checked_cu_seqlens(cu_seqlens, num_tokens: int, name: str = "cu_seqlens") -> Tensor:
    """Sequence offsets as int64 on the host, or a ValueError saying what is wrong with them (a bad
    offset would score tokens across sequence boundaries or index past the batch)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D integer tensor [num_seqs + 1], got "
                         f"{cu_seqlens.shape if isinstance(cu_seqlens, Tensor) else type(cu_seqlens)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer offsets, got dtype {cu_seqlens.dtype}")
    bounds = cu_seqlens.to(torch.long).cpu()  # num_seqs + 1 values: checked on the host
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0].item()}")
    if bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {bounds.tolist()}")
    if bounds[-1] > num_tokens:
        raise ValueError(f"{name} ends at {bounds[-1].item()}, past the {num_tokens} tokens of "
                         f"the batch")
    return bounds


# ------------------------------------------------------------------------------------------------
# Sampling-mask replay: the batch's mask in the layout of the op's labels
# ------------------------------------------------------------------------------------------------
def local_sampling_mask(sampling_mask, labels_shape, *, sequence_first: bool = False, cp_group=None,
                        cu_seqlens_padded: Optional[Tensor] = None,
                        vocab_size: Optional[int] = None) -> replay.SamplingMask:
    """The part of a batch's sampling mask that goes with this rank's labels, in the op's order.

    `sampling_mask`: CSR over the positions of the whole `[b, S]` sequences in row-major order
    (`build_sampling_mask(requests, (b, S))`; S = the full sequence length, the packed row's
    length for THD); `labels_shape`: this rank's `(b, s)` labels, s = S / CP. Returns the kept sets
    of this CP rank's positions (megatron's layout, `positions_on_cp_rank`; a packed row document
    by document, `cu_seqlens_padded`), in `[s, b]` order with `sequence_first` (the op's labels
    under sequence parallelism), as int64 tensors on the mask's device.

    ValueError for a mask that cannot be read so: not `(token_ids, offsets)` of integers, not one
    set per position of the whole sequences, offsets not from 0, decreasing or not ending at
    `len(token_ids)`; under CP also ids outside `[0, vocab_size)` (negative ones without
    `vocab_size`) and an id twice at one position, checked over the whole mask on every rank (each
    rank's op sees its own positions only)."""
    cp_size, cp_rank = reductions.group_size(cp_group), reductions.group_rank(cp_group)
    if len(labels_shape) != 2:
        raise ValueError(f"sampling_mask goes with [b, s] labels, got labels of shape {tuple(labels_shape)}")
    batch, local = (int(n) for n in labels_shape)
    length = local * cp_size
    check = replay.MaskCheck(sampling_mask, None, None, vocab_size if vocab_size is not None else 1)
    if check.problem:
        raise ValueError(check.problem)
    ids, offsets = check.ids, check.offsets
    if vocab_size is None:  # no range to check ids against (the op checks them): above the largest
        check.true_vocab = int(ids.max()) + 1 if ids.numel() else 1
    if offsets.numel() != batch * length + 1:
        whole = (f"{batch} rows x {length} positions of the whole sequences ({cp_size} context-parallel "
                 f"ranks x {local})" if cp_size > 1 else f"{batch} rows x {length} positions")
        raise ValueError(f"sampling_mask: offsets has {offsets.numel()} entries, but the labels have {whole}: "
                         f"one kept set per position of the [b, s] labels in row-major order, ignored "
                         f"positions included (len(offsets) == {batch * length + 1}; "
                         f"build_sampling_mask(requests, (b, s)) makes it)")
    if cp_size > 1:  # every check of the op, over the whole mask (nothing is communicated)
        agreement = Agreement("LogprobsPostProcessor", None, offsets.device, ("sampling_mask",))
        check.register(agreement, offsets.device)
        agreement.agree(check.messages)
    else:  # the offsets' shape, which the reordering reads (the op checks the rest)
        first, last, decreasing = torch.stack([offsets[0], offsets[-1], (offsets[1:] < offsets[:-1]).sum()]).tolist()
        if first != 0 or decreasing or last != ids.numel():
            raise ValueError(f"sampling_mask: offsets must start at 0, never decrease and end at "
                             f"len(token_ids) = {ids.numel()} (position i keeps "
                             f"token_ids[offsets[i]:offsets[i + 1]])")
    seq = (positions_on_cp_rank(length, cp_size, cp_rank, cu_seqlens_padded=cu_seqlens_padded)
           if cp_size > 1 else torch.arange(length))
    positions = replay.flat_positions(seq, batch, length)  # [b, s] order
    if sequence_first:
        positions = positions.view(batch, local).t().reshape(-1)
    return replay.slice_sampling_mask((ids, offsets), positions)


def _padded_vocab(head: HiddenStates) -> int:
    """The model's (padded) vocab size behind these hidden states: the output weight's rows x TP."""
    weight = head.output_weight if head.output_weight is not None else head.output_layer.weight
    return weight.shape[0] * reductions.group_size(head.tp_group)


class _RefusedMask:
    """Handed to the op in place of a mask this rank could not reorder: the op refuses it in its
    one agreement, so that every tensor-parallel rank raises before any collective of the
    computation (the others with "invalid on another rank"); this rank then raises `message`."""

    def __init__(self, message: str):
        self.message = message


class ReplayErrors:
    """`with ReplayErrors(mask):` around an op given a mask from `_mask_for_op`: where it is a
    `_RefusedMask`, the op's ValueError becomes the mask's own message."""

    def __init__(self, mask):
        self.refused = mask if isinstance(mask, _RefusedMask) else None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if self.refused is not None and (kind is None or issubclass(kind, ValueError)):
            raise ValueError(self.refused.message) from None
        return False


def labels_in_kept_sets(sampling_mask, labels: Tensor) -> Tensor:
    """bool, labels' shape: the label is in its position's kept set, or the set is empty (no
    truncation); `sampling_mask` in the row-major order of `labels`, already checked (the op's).
    False marks the tokens whose replayed log-prob is -inf."""
    ids, offsets = replay.as_sampling_mask(sampling_mask)
    ids, offsets = ids.to(labels.device), offsets.to(labels.device)
    flat = labels.reshape(-1)
    sizes = offsets[1:] - offsets[:-1]
    position = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), sizes,
                                       output_size=ids.numel())
    hits = torch.zeros(flat.numel(), dtype=torch.int64, device=flat.device).index_add_(
        0, position, (ids == flat.index_select(0, position)).long())
    return ((sizes == 0) | (hits > 0)).view(labels.shape)


class LogprobsPostProcessor:
    """Turn a last-stage model output into per-token log-probs (and entropy).

    Args:
        config: the `FusedCEConfig` (its `chunk_size`, `memory_mode` and `logits_dtype` are used
            on the fused path).
        vocab_size: the true vocab size; ids >= vocab_size (Megatron's padding of the vocab to a
            multiple of TP x 128) take no part in the softmax. Default: the model's vocab size.
        temperature: logits are divided by it before the softmax (sampling temperature of the
            rollouts in RL). Applied here, i.e. only on the last stage.
        return_entropy: also return the full-vocab entropy per token (of the sampled-from
            distribution when a sampler filter is set).
        top_k, top_p, min_p: the rollouts' sampler settings (vLLM semantics, see
            `linear_logprobs`): log-probs of the truncated, renormalized distribution; a token
            outside it gets -inf (the losses exclude and count those). None / top_p=1 / min_p=0
            / top_k 0 or -1 = off; min_p=1 keeps the tokens tied with the most likely one (the
            ranges vLLM's `SamplingParams` accepts, so the engine's settings pass through).
        return_topk: also return `topk_logprobs` / `topk_ids` `[b, s, k]` (full softmax).
        cp_group: the context-parallel group. Default: the model's (megatron's `pg_collection.cp`,
            else `parallel_state`'s); a group of one rank means no context parallelism.

    Context parallelism: `output_tensor`, `labels` (and the loss funcs' masks) are this CP rank's
    slice of every sequence, cut as megatron's `get_batch_on_this_cp_rank` does; the log-probs
    come back in the same layout (`compute_logprobs` can gather them in sequence order). Per-token
    values need nothing from other CP ranks; packed sequences use the group to find where their
    boundaries landed, and the loss funcs to sum sequence-level terms.

    Replay (`sampling_mask=` on a call): the engine's kept sets (`linear_logprobs`), one per
    position of the `[b, s]` labels in row-major order, of the whole sequences under CP (this rank
    takes its positions: `local_sampling_mask`); log q = z_y / T - logsumexp over the kept ids,
    -inf where the label is not kept, the plain softmax where a set is empty. Not with this
    post-processor's `top_k` / `top_p` / `min_p` / `return_topk` (the mask is what the engine's
    filters kept; the op refuses the combination on every rank). Replay runs in chunks of rows
    whatever `config.memory_mode` says (lean tiles do not apply to it). A bad mask raises the
    same ValueError on every tensor-parallel rank (the op's agreement); under CP every rank checks
    the whole mask.
    """

    def __init__(self, config: FusedCEConfig, *, vocab_size: Optional[int] = None,
                 temperature: float = 1.0, return_entropy: bool = False,
                 ignore_index: int = IGNORE_INDEX, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, min_p: Optional[float] = None, return_topk: int = 0,
                 cp_group=None):
        vocab_size, ignore_index, top_k, return_topk = map(integer_argument, (vocab_size, ignore_index, top_k, return_topk))
        return_entropy = flag_argument(return_entropy)
        if not finite_real(temperature) or not temperature > 0:
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if vocab_size is not None and (not is_int(vocab_size) or vocab_size <= 0):
            raise ValueError(f"vocab_size must be a positive integer or None, got {vocab_size!r}")
        if not fits_int64(ignore_index):
            raise ValueError(f"ignore_index must be an integer (int64), got {ignore_index!r}")
        problems = sampling.sampler_problems(top_k, top_p, min_p, return_topk,
                                             vocab_size if vocab_size is not None else return_topk)
        for message in problems.values():
            if message:
                raise ValueError(message)
        self.config = config
        self.vocab_size = vocab_size
        self.temperature = float(temperature)
        self.return_entropy = return_entropy
        self.ignore_index = ignore_index
        self.cp_group = cp_group
        self.top_k, self.top_p, self.min_p, self.return_topk = top_k, top_p, min_p, return_topk

    @property
    def sampler(self) -> dict:
        """The sampler settings, as `linear_logprobs` takes them."""
        return dict(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, return_topk=self.return_topk)

    @property
    def filters(self) -> bool:
        """Whether a sampler filter may drop tokens (log-probs can then be -inf)."""
        return sampling.filters_on(self.top_k, self.top_p, self.min_p, self.vocab_size)

    def tensor_parallel_group(self, model: torch.nn.Module):
        """The model's tensor-parallel group (the vocab shards)."""
        return _tp_group(unwrap_model(model))

    def context_parallel_group(self, model: Optional[torch.nn.Module] = None):
        """The CP group in use (see `cp_group`), None without context parallelism."""
        if self.cp_group is not None:
            return self.cp_group if reductions.group_size(self.cp_group) > 1 else None
        return context_parallel_group(None if model is None else unwrap_model(model))

    def scored_labels(self, labels: Tensor, model: Optional[torch.nn.Module] = None, *,
                      cu_seqlens: Optional[Tensor] = None,
                      cu_seqlens_padded: Optional[Tensor] = None) -> Tensor:
        """`labels` (int64) with `ignore_index` wherever this post-processor does not score a token:
        packed-sequence boundaries and padding (`packed_sequence_labels`, under CP too)."""
        return packed_sequence_labels(labels.long(), cu_seqlens, self.ignore_index,
                                      cu_seqlens_padded=cu_seqlens_padded,
                                      cp_group=self.context_parallel_group(model))

    def token_shape(self, output_tensor, model: torch.nn.Module) -> Tuple[int, int]:
        """`(b, s)`: the shape of the labels that go with this model output (`[b, s, V/TP]` logits,
        `[b, s, h]` hidden states, `[b, s/TP, h]` under sequence parallelism, or `HiddenStates`)."""
        check_model_output(output_tensor)
        head = self._hidden_states(output_tensor, unwrap_model(model), check=False)
        if head is not None:
            return head.token_shape()
        return output_tensor.shape[0], output_tensor.shape[1]

    def __call__(self, output_tensor, model: torch.nn.Module, labels: Tensor, *,
                 cu_seqlens: Optional[Tensor] = None,
                 cu_seqlens_padded: Optional[Tensor] = None, sampling_mask=None) -> LogprobsOutput:
        gpt = unwrap_model(model)
        if not getattr(gpt, "post_process", False):
            raise RuntimeError("LogprobsPostProcessor runs on the last pipeline stage only")
        check_model_output(output_tensor)
        labels = self.scored_labels(labels, gpt, cu_seqlens=cu_seqlens,
                                    cu_seqlens_padded=cu_seqlens_padded)
        packing = dict(cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
        head = self._hidden_states(output_tensor, gpt)
        if head is not None:
            return self._from_hidden(head, labels, sampling_mask, gpt, packing)
        return self._from_logits(output_tensor, labels, _tp_group(gpt), output_weight(gpt).shape[0],
                                 sampling_mask, gpt, packing)

    # -- replay ----------------------------------------------------------------------------------
    def _mask_for_op(self, sampling_mask, labels: Tensor, *, sequence_first: bool, model, packing: dict,
                     padded_vocab: int):
        """`sampling_mask` as the op takes it: unchanged where the op's labels are the `[b, s]`
        labels (the op checks it), else `local_sampling_mask`'s reordering, or a `_RefusedMask`
        when it cannot be read."""
        cp_group = self.context_parallel_group(model)
        if sampling_mask is None or (not sequence_first and cp_group is None):
            return sampling_mask
        if self.filters or self.return_topk:  # the op refuses the combination, with its reason
            return sampling_mask
        layout = packing.get("cu_seqlens_padded")
        if layout is None:
            layout = packing.get("cu_seqlens")
        try:
            return local_sampling_mask(
                sampling_mask, tuple(labels.shape), sequence_first=sequence_first, cp_group=cp_group,
                cu_seqlens_padded=layout if cp_group is not None else None,
                vocab_size=self.vocab_size if self.vocab_size is not None else padded_vocab)
        except ValueError as error:
            return _RefusedMask(str(error))

    @staticmethod
    def _replay_kwargs(inputs: dict, mask) -> dict:
        """The op's arguments with the mask (replay runs in chunks of rows: memory_mode "fast")."""
        if mask is None:
            return inputs
        return dict(inputs, sampling_mask=mask, memory_mode="fast")

    # -- fusion on -------------------------------------------------------------------------------
    @staticmethod
    def _hidden_states(output, gpt, check: bool = True) -> Optional[HiddenStates]:
        """The model output read as hidden states: the output processor's `HiddenStates`, or the
        installed fused layer's `[b, s, h]`; None for logits."""
        if isinstance(output, HiddenStates):
            if check and output.output_layer is not getattr(gpt, "output_layer", None):
                raise ValueError("these HiddenStates come from another model's output layer: pass the "
                                 "model chunk whose forward returned them")
            return output
        if not is_fused(gpt):
            return None
        weight = output_weight(gpt)
        if check and output.shape[-1] != weight.shape[1]:
            raise RuntimeError(
                f"the fused output layer is installed but the model returned [..., "
                f"{output.shape[-1]}], not hidden states of size {weight.shape[1]}: this "
                f"megatron-core version does not route the logits through model.output_layer")
        return HiddenStates.of_installed(gpt, output)

    def fused_inputs(self, output_tensor, model: torch.nn.Module, labels: Tensor, *,
                     cu_seqlens: Optional[Tensor] = None,
                     cu_seqlens_padded: Optional[Tensor] = None, sampling_mask=None) -> Optional[dict]:
        """The fused op's arguments for this output, or None when the model returns logits.

        The output is the installed fused layer's `[b, s, h]` or the output processor's
        `HiddenStates`. `hidden` and `labels` are in the op's layout: `[b, s, h]` / `[b, s]`, or
        Megatron's sequence-first `[s/TP, b, h]` / `[s, b]` when `sequence_parallel` is True. The
        weight is not among them: ops run as `run_in_output_layer(model, op, **inputs, ...)`,
        which passes it inside a call of the output layer (where sharding engines gather it). The
        loss funcs use this to call the gradients-in-forward losses (`linear_cross_entropy`,
        `linear_grpo_loss`) on exactly what `linear_logprobs` would see. With `sampling_mask`
        (see the class doc) they include it in the op's label layout, and memory_mode "fast";
        run the op inside `ReplayErrors(inputs["sampling_mask"])` for the mask's own error.
        """
        gpt = unwrap_model(model)
        check_model_output(output_tensor)
        head = self._hidden_states(output_tensor, gpt)
        if head is None:
            return None
        labels = self.scored_labels(labels, gpt, cu_seqlens=cu_seqlens,
                                    cu_seqlens_padded=cu_seqlens_padded)
        inputs = self._op_inputs(head, labels)
        mask = self._mask_for_op(sampling_mask, labels, sequence_first=inputs["sequence_parallel"], model=gpt,
                                 packing=dict(cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded),
                                 padded_vocab=_padded_vocab(head))
        return self._replay_kwargs(inputs, mask)

    def _op_inputs(self, head: HiddenStates, labels: Tensor) -> dict:
        """The op's arguments for hidden states and their (scored) `[b, s]` labels."""
        kwargs = head.op_kwargs(self.config)
        if kwargs["sequence_parallel"]:  # the op gathers along dim 0: Megatron's [s/TP, b, h]
            hidden, labels = head.states, labels.t()
        else:
            hidden = head.batch_first()
        return dict(hidden=hidden, labels=labels, vocab_size=self.vocab_size,
                    temperature=self.temperature, ignore_index=self.ignore_index, **kwargs)

    def logprobs_of(self, hidden_states: HiddenStates, labels: Tensor, *,
                    cu_seqlens: Optional[Tensor] = None,
                    cu_seqlens_padded: Optional[Tensor] = None, sampling_mask=None) -> LogprobsOutput:
        """`LogprobsOutput [b, s]` of `HiddenStates` without the model (the output processor's
        `returns="logprobs"`); the CP group is this post-processor's `cp_group` or megatron's."""
        labels = self.scored_labels(labels, None, cu_seqlens=cu_seqlens,
                                    cu_seqlens_padded=cu_seqlens_padded)
        return self._from_hidden(hidden_states, labels, sampling_mask, None,
                                 dict(cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded))

    def _from_hidden(self, head: HiddenStates, labels: Tensor, sampling_mask=None, model=None,
                     packing: Optional[dict] = None) -> LogprobsOutput:
        inputs = self._op_inputs(head, labels)
        mask = self._mask_for_op(sampling_mask, labels, sequence_first=inputs["sequence_parallel"], model=model,
                                 packing=packing or {}, padded_vocab=_padded_vocab(head))
        with ReplayErrors(mask):
            out = head.run(linear_logprobs, **self._replay_kwargs(inputs, mask),
                           return_entropy=self.return_entropy, **self.sampler)
        if inputs["sequence_parallel"]:  # [s, b] -> [b, s]
            out = out.map(lambda t: t.transpose(0, 1))
        return out

    # -- fusion off ------------------------------------------------------------------------------
    def _from_logits(self, logits: Tensor, labels: Tensor, tp_group, v_local: int, sampling_mask=None,
                     model=None, packing: Optional[dict] = None) -> LogprobsOutput:
        """`v_local`: the rows of this rank's output-weight shard (tells gathered logits apart).
        `model`: for its CP group (None: this post-processor's or megatron's)."""
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        padded_vocab = v_local * tp_size
        if logits.shape[-1] == v_local * tp_size and tp_size > 1:  # gathered (parallel_output=False)
            tp_group, tp_size, tp_rank, v_local = None, 1, 0, logits.shape[-1]
        # logits are [b, s, V/TP] whatever the parallelism: the mask needs this CP rank's part only
        mask = self._mask_for_op(sampling_mask, labels, sequence_first=False, model=model, packing=packing or {},
                                 padded_vocab=padded_vocab)
        with ReplayErrors(mask):
            return vocab_parallel_logprobs(
                logits, labels, tp_group=tp_group, tp_rank=tp_rank, tp_size=tp_size,
                vocab_size=self.vocab_size, temperature=self.temperature,
                ignore_index=self.ignore_index, return_entropy=self.return_entropy, **self.sampler,
                sampling_mask=mask)
