"""Fused GRPO: the GRPO-family loss straight from hidden states, gradients made in the forward pass.

    linear_grpo_loss(hidden, weight, labels, advantages, mask, config, ...)
        == grpo_loss(linear_logprobs(hidden, weight, labels, ...).logprobs, advantages, mask, config, ...)

for values and gradients, at 3 GEMMs per chunk instead of 4 (no backward recompute of the logits).

Why it is exact: once the batch totals are known (per-sequence and batch counts, and with given old
log-probs the sequence-level correction; ``grpo.BatchTotals``), every GRPO variant with token-level
importance ratios is a weighted sum of per-token terms, so d loss / d lp_t depends on lp_t and
constants alone. The totals depend on the mask and old / sampling log-probs only, so they are
computed (and summed over ``cp_group``) before the chunk loop. As soon as a chunk's log-probs are
known (merged over TP ranks), the loss given those totals is evaluated with autograd on a [B, T]
buffer holding them and its gradient w.r.t. those tokens is read off (``GRPOGrads``, on the
forward-gradient contract of ops/forward_grad.py); the chunk's dlogits, dX and dW follow at once. No context-parallel collective runs inside the chunk loop (CP ranks may have
different numbers of chunks). The loss value and metrics come from one final `grpo_loss` call on
all log-probs. Reusing `grpo.py` keeps one definition of every option.

Not decomposable, hence computed with the recompute path (same result, 4 GEMMs): sequence-level
ratios (GSPO), and sequence-level train/inference correction when the old log-probs are the
policy's own (on-policy), since then rho of one token depends on the others' log-probs.

Excluded tokens (a ``-inf`` log-prob, see ``grpo.py``): those of the old / sampling log-probs are
known before the loop and enter the totals; the policy's own log-probs here are those of the full
softmax, never ``-inf``. A sampling mask (``sampling_mask``: the engine's kept sets, replayed by
``linear_logprobs``) makes some of them ``-inf``, which changes the totals during the loop: with a
mask the loss takes the recompute path (``grpo_loss`` on ``linear_logprobs(..., sampling_mask=)``).
The reference model's log-probs stay those of the plain softmax (passed in, never masked here).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..ops.api import linear_logprobs, token_statistics
from ..ops.forward_grad import PER_ROW, ForwardGradLoss, TokenGrads
from .grpo import GRPOConfig, batch_totals, check_grpo_arguments, grpo_loss, loss_given_totals
from .nll import Normalizer


class GRPOGrads(ForwardGradLoss):
    """d loss / d (target, lse) of each token of a chunk under token-level ratios: the loss given the
    batch totals (grpo.loss_given_totals) is differentiated w.r.t. the chunk's log-probs, placed in
    a [B, T] buffer (module doc). `totals` may be None: computed by `totals_of_batch` at the first
    chunk (while its logits GEMM runs)."""

    def __init__(self, totals, totals_of_batch, batch: int, length: int, sequence_first: bool,
                 placeholder: Tensor, loss_given):
        self.totals, self.totals_of_batch = totals, totals_of_batch
        self.batch, self.length, self.sequence_first = batch, length, sequence_first
        self.placeholder, self.loss_given = placeholder, loss_given

    def token_grads(self, stats, positions: Tensor, num_labelled: int) -> TokenGrads:
        if self.totals is None:
            self.totals = self.totals_of_batch()
        if self.sequence_first:  # flat index t * B + b in [T, B] -> b * T + t in [B, T]
            positions = (positions % self.batch) * self.length + positions // self.batch
        with torch.enable_grad():
            chunk_logprobs = stats.logprob().detach().requires_grad_()
            logprobs = self.placeholder.index_put((positions,), chunk_logprobs).view(self.batch, self.length)
            (grad,) = torch.autograd.grad(self.loss_given(logprobs, self.totals), chunk_logprobs)
        return TokenGrads(target=grad, lse=-grad)  # log p = target - lse

    def one_hot_scale(self, num_labelled: int) -> str:
        # each token's dlogits are -grad_i (softmax - one_hot): a row kernel's softmax - one_hot
        # times the per-token factor, applied in the GEMMs
        return PER_ROW


def gradients_in_forward_apply(config: GRPOConfig, old_logprobs, sampling_logprobs) -> bool:
    """Whether each token's loss gradient is known once its own log-prob is (see module doc)."""
    if config.importance_sampling_level != "token":
        return False
    on_policy = old_logprobs is None or config.force_on_policy_ratio
    sequence_correction = sampling_logprobs is not None and config.is_correction.startswith("sequence")
    return not (sequence_correction and on_policy)


def linear_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    *,
    tp_group=None,
    cp_group=None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    old_logprobs: Optional[Tensor] = None,
    reference_logprobs: Optional[Tensor] = None,
    sampling_logprobs: Optional[Tensor] = None,
    normalizer: Optional[Normalizer] = None,
    chunk_size: Optional[int] = None,
    sequence_parallel: bool = False,
    impl: str = "auto",
    ignore_index: int = -100,
    accumulate_into_main_grad: bool = False,
    memory_mode: str = "fast",
    logits_dtype: Optional[torch.dtype] = None,
    max_chunk_bytes: Optional[int] = None,
    expected_upstream_grad: Optional[float] = None,
    sampling_mask=None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GRPO loss and metrics from hidden states (see the module doc and `grpo_loss`).

    `mask`, `advantages` and the old / reference / sampling log-probs are [B, T] (advantages may be
    [B]). `hidden` / `labels` are [B, T, H] / [B, T], or Megatron's sequence-first [T, B, H] /
    [T, B] when `sequence_parallel=True` (hidden then being this rank's [T/TP, B, H] slice).
    Tokens where mask == 0 are skipped before the first GEMM. With `cp_group`, T is this rank's
    context-parallel slice of every sequence (as for `grpo_loss`); TP and CP groups may be combined.
    Argument errors raise the same ValueError on every rank of `tp_group` and `cp_group`.
    `memory_mode`: "fast" or "lean"; `logits_dtype`: None or torch.float32; `max_chunk_bytes`: the
    bound of a chunk of logits without `chunk_size` (see `linear_logprobs`).
    `expected_upstream_grad`: the gradient the loss will receive, if known at forward time; with
    `accumulate_into_main_grad` dW then goes into main_grad in the forward with no fp32 buffer (see
    `linear_cross_entropy`).
    `sampling_mask`: the kept sets the engine sampled from (see `linear_logprobs`), in the
    row-major order of `labels` as passed ([T, B] under `sequence_parallel`; this rank's positions
    under `cp_group`: ops.replay.slice_sampling_mask): the policy's log-probs are those of the
    engine's sampling distribution, and a sampled token outside its set is excluded. Recompute
    path (module doc).
    """
    sequence_first = bool(sequence_parallel)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (hidden, weight))
    loss_kwargs = dict(old_logprobs=old_logprobs, reference_logprobs=reference_logprobs,
                       sampling_logprobs=sampling_logprobs, normalizer=normalizer)

    def check_mask_and_labels():
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise ValueError(f"mask must be a [B, T] tensor, got "
                             f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
        layout = tuple(mask.t().shape if sequence_first else mask.shape)
        if not isinstance(labels, Tensor) or tuple(labels.shape) != layout:
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match labels {got}: labels must "
                             f"be {'[T, B] (sequence_parallel)' if sequence_first else '[B, T]'} = {layout}")

    check_grpo_arguments("linear_grpo_loss", mask, advantages, mask, config, **loss_kwargs,
                         cp_group=cp_group, other_groups=(tp_group,), extra_check=check_mask_and_labels,
                         extra_flags=[("needs_grad", needs_grad), ("sampling_mask given", sampling_mask is not None)],
                         shape_source="mask")

    # masked tokens never reach the loss: drop their rows before any GEMM
    keep = (mask.t() if sequence_first else mask) != 0
    labels = torch.where(keep, labels, torch.full_like(labels, ignore_index))
    op_kwargs = dict(tp_group=tp_group, vocab_size=vocab_size, temperature=temperature,
                     ignore_index=ignore_index, chunk_size=chunk_size,
                     sequence_parallel=sequence_parallel, impl=impl,
                     accumulate_into_main_grad=accumulate_into_main_grad, memory_mode=memory_mode,
                     logits_dtype=logits_dtype, max_chunk_bytes=max_chunk_bytes)

    def to_batch_layout(logprobs: Tensor) -> Tensor:
        return logprobs.t() if sequence_first else logprobs

    if (sampling_mask is not None or not needs_grad
            or not gradients_in_forward_apply(config, old_logprobs, sampling_logprobs)):
        logprobs = linear_logprobs(hidden, weight, labels, **op_kwargs, sampling_mask=sampling_mask).logprobs
        return grpo_loss(to_batch_layout(logprobs), advantages, mask, config, **loss_kwargs,
                         cp_group=cp_group)

    batch, length = mask.shape
    placeholder = torch.zeros(batch * length, dtype=torch.float32, device=hidden.device)

    def totals_of_batch():
        """Everything a token's gradient needs from other tokens (and other CP ranks)."""
        return batch_totals(placeholder.view(batch, length), advantages, mask, config,
                            old_logprobs=old_logprobs, sampling_logprobs=sampling_logprobs,
                            reference_logprobs=reference_logprobs, cp_group=cp_group)

    # With cp_group the totals' collectives run here, on every CP rank (a rank may have no labelled
    # chunk). Without, they are computed at the first chunk's merge, while its logits GEMM runs:
    # ~30 small kernels fewer before the first GEMM, where the GPU would wait for the host.
    totals = totals_of_batch() if cp_group is not None else None

    forward_grad = GRPOGrads(totals, totals_of_batch, batch, length, sequence_first, placeholder,
                             lambda logprobs, totals: loss_given_totals(logprobs, advantages, mask, config, totals,
                                                                        **loss_kwargs))

    # every per-token gradient depends on these: TP ranks that differ would sum unrelated dX parts
    must_agree = dict(loss_kwargs, advantages=advantages, mask=mask)
    stats = token_statistics("linear_grpo_loss", hidden, weight, labels, **op_kwargs,
                             want_sum_logits=False, want_entropy=False, forward_grad=forward_grad,
                             must_agree=must_agree, expected_upstream_grad=expected_upstream_grad)
    with torch.no_grad():
        logprobs = to_batch_layout(stats.to_full(stats.logprob()))
        loss, metrics = grpo_loss(logprobs, advantages, mask, config, **loss_kwargs, cp_group=cp_group)
    return loss + stats.anchor, metrics
