"""The unfused reference on logits: per-token log-probs from this rank's `[..., V/TP]` logits.

`vocab_parallel_logprobs` merges the same softmax statistics as the fused op (max, sum-exp,
target logit, expected logit) over the tensor-parallel ranks; `LogprobsPostProcessor` takes this
path when the output layer is not fused, and tests hold the fused path to it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_fused_ce import LogprobsOutput
from megatron_fused_ce.ops import reductions, replay, sampling
from megatron_fused_ce.ops.agreement import (Agreement, finite_real, fits_int64, flag_argument, integer_argument, is_int,
                                            real_argument)

IGNORE_INDEX = -100


def vocab_parallel_logprobs(logits: Tensor, labels: Tensor, *, tp_group=None, tp_rank: int = 0,
                            tp_size: int = 1, vocab_size: Optional[int] = None,
                            temperature: float = 1.0, ignore_index: int = IGNORE_INDEX,
                            return_entropy: bool = False, top_k: Optional[int] = None,
                            top_p: Optional[float] = None, min_p: Optional[float] = None,
                            return_topk: int = 0, sampling_mask=None) -> LogprobsOutput:
    """Log-softmax over materialized vocab-parallel logits `[..., V/TP]` (the unfused path).

    The same statistics as the fused op, with autograd through the logits: a max (detached) and
    sums of `exp(z - max)`, `exp(z - max) * (z - max)` and the target logit, each all-reduced over
    TP with an identity backward (each rank's partial depends only on its own shard). Bad input
    raises the same ValueError on every rank before the first all-reduce, as in the fused op.
    With sampler settings the sums run over each row's kept set, found by the fused op's own code
    (`sampling.sample_logits`), so that both paths keep the same tokens. With `sampling_mask`
    (`linear_logprobs`' replay; CSR in the row-major order of `labels`) they run over each
    position's kept ids (`replay.kept_columns`), checked as the op checks them.
    """
    vocab_size, ignore_index, top_k, return_topk, tp_rank, tp_size = map(
        integer_argument, (vocab_size, ignore_index, top_k, return_topk, tp_rank, tp_size))
    return_entropy = flag_argument(return_entropy)
    temperature = real_argument(temperature)
    sampler = dict(top_k=top_k, top_p=top_p, min_p=min_p, return_topk=return_topk)
    mask_check = _check_logits_arguments(logits, labels, tp_group if tp_size > 1 else None, vocab_size,
                                         temperature, ignore_index, return_entropy, sampler, sampling_mask)

    def tp_sum(x):
        if tp_size == 1:
            return x
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x, group=tp_group)

    v_local = logits.shape[-1]
    vocab_size = vocab_size if vocab_size is not None else v_local * tp_size
    start = tp_rank * v_local

    valid_col = torch.arange(start, start + v_local, device=logits.device) < vocab_size
    sp = sampling.sampling_spec(**sampler, true_vocab=vocab_size, vocab_start=start)
    sampled = None
    if sp is not None:
        num_valid_cols = min(max(vocab_size - start, 0), v_local)
        flat = logits.reshape(-1, v_local)
        sampled = sampling.sample_logits(flat, tp_group=tp_group if tp_size > 1 else None,
                                         num_valid_cols=num_valid_cols, inv_temperature=1.0 / temperature,
                                         sp=sp)
        if sp.filters:  # the sums run over the kept set only
            kept = sampled.kept_columns(flat, num_valid_cols, 1.0 / temperature, start)
            valid_col = valid_col & kept.reshape(logits.shape)
    restricted = sampled is not None and sampled.z_cut is not None
    if mask_check.present:  # replay: the sums run over each position's kept ids
        kept = replay.kept_columns((mask_check.ids, mask_check.offsets), start, v_local)
        valid_col = valid_col & kept.to(logits.device).reshape(logits.shape)
        restricted = True
    z = logits.float() / temperature
    z = torch.where(valid_col, z, torch.zeros_like(z))  # padded columns: finite, then excluded
    global_max = z.masked_fill(~valid_col, float("-inf")).amax(-1).detach()
    if tp_size > 1:
        global_max = reductions.max_over_ranks(global_max, tp_group)
    shifted = z - global_max.unsqueeze(-1)
    exp = torch.exp(shifted) * valid_col
    sum_exp = tp_sum(exp.sum(-1))
    log_sum_exp = torch.log(sum_exp)
    lse = global_max + log_sum_exp

    scored = labels != ignore_index
    local_label = labels - start
    in_shard = scored & (local_label >= 0) & (local_label < v_local)
    target = z.gather(-1, local_label.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target = tp_sum(torch.where(in_shard, target, torch.zeros_like(target)))
    logprobs = target - lse
    if restricted:  # a label outside the kept set: -inf
        local_kept = valid_col.gather(-1, local_label.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
        label_kept = reductions.sum_over_ranks((local_kept & in_shard).to(torch.int32),
                                               tp_group if tp_size > 1 else None)
        logprobs = torch.where(label_kept > 0, logprobs, float("-inf"))
    logprobs = torch.where(scored, logprobs, torch.zeros_like(lse))

    entropy = None
    if return_entropy:
        # H = log S - E[z - M], relative to the max: lse - E[z] would cancel at large |z|
        mean_shifted = tp_sum((exp * shifted).sum(-1)) / sum_exp
        entropy = torch.where(scored, log_sum_exp - mean_shifted, torch.zeros_like(lse))
    if sampled is None or sampled.topk_ids is None:
        return LogprobsOutput(logprobs, entropy)
    shape = tuple(labels.shape) + (sp.return_topk,)
    scored_k = scored.unsqueeze(-1)
    return LogprobsOutput(logprobs, entropy,
                          torch.where(scored_k, sampled.topk_logprobs.reshape(shape), 0.0),
                          torch.where(scored_k, sampled.topk_ids.reshape(shape), -1))


def _check_logits_arguments(logits, labels, tp_group, vocab_size, temperature, ignore_index,
                            return_entropy, sampler, sampling_mask=None) -> "replay.MaskCheck":
    """The unfused path's checks, agreed over the TP group in one collective (the fused op's
    machinery, ops/agreement.py): every rank raises the same ValueError, none waits in an
    all-reduce for a rank that raised. Returns the sampling mask's check (its int64 tensors)."""
    device = logits.device if isinstance(logits, Tensor) else torch.device("cpu")
    mask_names = ("sampling_mask", "sampling_mask_with_filters", "sampling_mask_with_return_topk",
                  "sampling_mask_memory_mode")
    agreement = Agreement("vocab_parallel_logprobs", tp_group, device,
                          ("logits", "labels", "vocab_size", "temperature", "ignore_index", *sampler, *mask_names))
    fail = agreement.fail
    tp_size = reductions.group_size(tp_group)
    if not isinstance(logits, Tensor) or logits.dim() < 1 or not logits.dtype.is_floating_point:
        fail("logits", "logits must be a floating-point tensor [..., V/TP]")
    if not isinstance(labels, Tensor) or labels.dtype not in (torch.int64, torch.int32):
        fail("labels", f"labels must be an int64 (or int32) tensor, got "
                       f"{labels.dtype if isinstance(labels, Tensor) else type(labels)}")
    elif not agreement.failed("logits") and tuple(labels.shape) != tuple(logits.shape[:-1]):
        fail("labels", f"labels shape {tuple(labels.shape)} does not match logits.shape[:-1] = "
                       f"{tuple(logits.shape[:-1])}")
    if not finite_real(temperature) or not temperature > 0:
        fail("temperature", f"temperature must be a finite number > 0, got {temperature!r}")
    if not fits_int64(ignore_index):
        fail("ignore_index", f"ignore_index must be an integer (int64), got {ignore_index!r}")
    v_local = logits.shape[-1] if not agreement.failed("logits") else -1
    padded = max(v_local, 0) * tp_size
    if vocab_size is not None and (not is_int(vocab_size) or not 0 < vocab_size <= padded):
        fail("vocab_size", f"vocab_size must be an integer in [1, {padded}], got {vocab_size!r}")
    true_vocab = vocab_size if vocab_size is not None and not agreement.failed("vocab_size") else padded
    problems = sampling.sampler_problems(**sampler, true_vocab=true_vocab)
    for name, message in problems.items():
        if message:
            fail(name, message)
    active = sampling.agreed_values(sampler, problems, true_vocab)
    labels_ok = isinstance(labels, Tensor) and not agreement.failed("labels")
    mask_check = replay.MaskCheck(sampling_mask, labels if labels_ok else None, ignore_index, true_vocab)
    mask_problems = {"sampling_mask": mask_check.problem,
                     **replay.sampling_mask_problems(sampling_mask, active, "fast")}
    for name, message in mask_problems.items():
        if message:
            fail(name, message)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    ok = not agreement.failed("logits", "labels", "ignore_index")
    if ok and labels.numel() > 0:
        bad = (((labels < 0) | (labels >= true_vocab)) & (labels != ignore_index)).sum()
    agreement.equal("logits", v_local, "logits: vocab shards differ in size across tensor-parallel "
                    "ranks", show_range=True)
    agreement.equal_tensor("labels", labels if ok else None,
                           "labels: differ across tensor-parallel ranks; every rank must pass the "
                           "same labels")
    bad_key = agreement.maximum_count("labels", bad)
    agreement.equal("vocab_size", true_vocab)
    agreement.equal("temperature", float(temperature) if not agreement.failed("temperature") else None)
    agreement.equal("ignore_index", ignore_index if not agreement.failed("ignore_index") else None)
    agreement.equal("return_entropy", bool(return_entropy))
    for name, value in active.items():  # they decide the collectives
        agreement.equal(name, value)
    mask_check.register(agreement, device)  # the mask's entries, on every rank with or without one
    agreement.agree(lambda agreed: ([
        f"labels: labels outside [0, vocab_size={true_vocab}) that are not ignore_index="
        f"{ignore_index} (on this or another tensor-parallel rank)"] if agreed[bad_key] else [])
        + mask_check.messages(agreed))
    return mask_check
