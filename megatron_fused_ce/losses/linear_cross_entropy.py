"""Fused cross-entropy (SFT, pretraining): `linear_cross_entropy`, on the forward-gradient contract.

    linear_cross_entropy(hidden, weight, labels, ...)
        == F.cross_entropy(full_logits[..., :vocab_size] / T, labels, ...) + z-loss

Per labelled token: (1 - eps) (lse - z_y) + eps (lse - sum_k z_k / V) + lambda lse^2 (docs/design.md
§4.3). With reduction "mean" / "sum" the loss is a scalar whose gradient w.r.t. each token's
statistics is a constant (or, with z-loss, a function of the token's own lse): `CrossEntropyGrads`
gives it to the chunk loop, which makes dX and dW in the forward pass (ops/forward_grad.py).
"none" has arbitrary per-token upstream gradients and keeps the recompute path.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..ops import reductions, remembered_routes
from ..ops.agreement import finite_real, flag_argument, integer_argument
from ..ops.api import LabelledCount, first_product_ahead, token_statistics
from ..ops.forward_grad import PER_ROW, ForwardGradLoss, TokenGrads


class CrossEntropyGrads(ForwardGradLoss):
    """d loss / d statistics of cross-entropy with label smoothing `smoothing` over `vocab` ids and
    z-loss weight `z_weight`, summed (`mean`: divided by the labelled tokens)."""

    def __init__(self, mean: bool, smoothing: float, z_weight: float, vocab: int):
        self.mean, self.smoothing, self.z_weight, self.vocab = mean, smoothing, z_weight, vocab
        self.want_sum_logits = smoothing > 0

    def _scale(self, num_labelled):
        """1 / labelled tokens ("mean"; a 0-d tensor where the count is on the device) or 1 ("sum")."""
        if not self.mean:
            return 1.0
        if isinstance(num_labelled, LabelledCount):
            return num_labelled.inverse
        return 1.0 / max(num_labelled, 1)

    def token_grads(self, stats, positions, num_labelled) -> TokenGrads:
        if self.mean and not self.smoothing and not self.z_weight and isinstance(num_labelled, LabelledCount):
            inverse, negative_inverse = num_labelled.per_row(positions)  # 0 in the rows of ignored labels
            return TokenGrads(target=negative_inverse, lse=inverse, masked=True)
        scale = self._scale(num_labelled)
        lse = stats.lse

        def constant(c):  # c * scale for every token (a view of one number where it is a tensor)
            if isinstance(scale, Tensor):
                if c == -1.0 and isinstance(num_labelled, LabelledCount):
                    return num_labelled.negative_inverse.expand_as(lse)
                return (scale if c == 1.0 else scale * c).expand_as(lse)
            return torch.full_like(lse, c * scale)

        g_lse = lse * (2.0 * self.z_weight * scale) + scale if self.z_weight else constant(1.0)
        return TokenGrads(
            target=constant(-(1.0 - self.smoothing)), lse=g_lse,
            sum_logits=constant(-self.smoothing / self.vocab) if self.smoothing else None)

    def one_hot_scale(self, num_labelled):
        # without smoothing or z-loss every token's dlogits are c (softmax - one_hot), c the same;
        # a count on the device (rows of ignored labels included, c = 0 there): c per row
        if self.smoothing or self.z_weight:
            return None
        return PER_ROW if isinstance(num_labelled, LabelledCount) else self._scale(num_labelled)

    def scale_before_statistics(self, num_labelled):
        # c = 1 / labelled tokens ("mean"; on the device where the count is) or 1 ("sum"): token_grads' own
        if self.smoothing or self.z_weight:
            return None
        return self._scale(num_labelled)


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, tp_group=None, vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None, sequence_parallel: bool = False, impl: str = "auto",
    accumulate_into_main_grad: bool = False, logits_dtype: Optional[torch.dtype] = None,
    memory_mode: str = "fast", max_chunk_bytes: Optional[int] = None,
    expected_upstream_grad: Optional[float] = None,
) -> Tensor:
    """F.cross_entropy(full_logits[..., :vocab_size] / T, labels, ...) + z-loss, without the logits.

    Per labelled token: (1 - eps) * (lse - z_y) + eps * (lse - sum_k z_k / vocab_size)
    + z_loss_weight * lse**2, with eps = label_smoothing over the global unpadded vocab.
    "mean" divides by the number of labelled tokens (0.0 with zero gradients when there are none),
    "sum" adds, "none" returns fp32 per-token losses of labels.shape (0 at ignored positions).
    "mean" / "sum" compute dX and dW during the forward pass (3 GEMMs per chunk instead of 4),
    except for fp16 inputs, which take the recompute path so that the upstream gradient (a loss
    scale) multiplies the fp32 per-token gradients before anything is rounded to fp16.
    Every other argument as in `linear_logprobs` (logits_dtype, autocast, memory_mode ...).
    With `accumulate_into_main_grad` ("mean" / "sum", fast mode) dW is exact whatever the upstream
    gradient g (loss scaling, Megatron's 1/(tokens x micro-batches)): it waits in an fp32
    [V_local, H] buffer until the backward adds g x dW to main_grad, or, given
    `expected_upstream_grad` (g, known at forward time), goes straight into main_grad times g with
    no buffer; the backward then checks g (see `api.expected_upstream_grad_problem`).
    """
    # a later call of a route the general path recorded: straight through (remembered_routes.py)
    route_key = remembered_routes.call_key(
        "linear_cross_entropy", hidden, weight, labels, tp_group,
        (vocab_size, ignore_index, reduction, label_smoothing, z_loss_weight, temperature, chunk_size,
         sequence_parallel, impl, accumulate_into_main_grad, logits_dtype, memory_mode, max_chunk_bytes,
         expected_upstream_grad))
    route = remembered_routes.lookup(route_key)
    if route is not None:
        loss = route(hidden, weight, labels)
        if loss is not None:
            return loss
    ahead = first_product_ahead("linear_cross_entropy", hidden, weight, impl, chunk_size, max_chunk_bytes,
                                memory_mode, logits_dtype, sequence_parallel, reduction, label_smoothing,
                                z_loss_weight)
    vocab_size, ignore_index, chunk_size, max_chunk_bytes = map(
        integer_argument, (vocab_size, ignore_index, chunk_size, max_chunk_bytes))
    sequence_parallel, accumulate_into_main_grad = map(flag_argument, (sequence_parallel, accumulate_into_main_grad))
    extra = {"reduction": None, "label_smoothing": None, "z_loss_weight": None}  # None: passed
    if reduction not in ("mean", "sum", "none"):
        extra["reduction"] = f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
    if not finite_real(label_smoothing) or not 0.0 <= label_smoothing < 1.0:
        extra["label_smoothing"] = f"label_smoothing must be in [0, 1), got {label_smoothing!r}"
    if not finite_real(z_loss_weight) or not z_loss_weight >= 0.0:
        extra["z_loss_weight"] = f"z_loss_weight must be a finite number >= 0, got {z_loss_weight!r}"
    smoothing = float(label_smoothing) if not extra["label_smoothing"] else 0.0
    z_weight = float(z_loss_weight) if not extra["z_loss_weight"] else 0.0
    must_agree = {"reduction": reduction if not extra["reduction"] else None,
                  "label_smoothing": smoothing, "z_loss_weight": z_weight}
    true_vocab = vocab_size if vocab_size is not None else (
        weight.shape[0] * reductions.group_size(tp_group)
        if isinstance(weight, Tensor) and weight.dim() == 2 else 1)
    forward_grad = (CrossEntropyGrads(reduction == "mean", smoothing, z_weight, true_vocab)
                    if reduction in ("mean", "sum") and isinstance(labels, Tensor) else None)
    # per-token losses -log p_y (Megatron's output layer): d(-log p_y)/dz = -(one_hot - softmax)
    # whatever each token's upstream gradient, so they take log-probs' dlogits made in the forward
    per_token_logprob = reduction == "none" and not smoothing and not z_weight

    stats = token_statistics(
        "linear_cross_entropy", hidden, weight, labels, tp_group=tp_group, vocab_size=vocab_size,
        temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size,
        sequence_parallel=sequence_parallel, impl=impl,
        accumulate_into_main_grad=accumulate_into_main_grad, logits_dtype=logits_dtype,
        memory_mode=memory_mode, max_chunk_bytes=max_chunk_bytes, want_sum_logits=smoothing > 0.0,
        want_entropy=False, extra_checks=extra,
        must_agree=must_agree, forward_grad=forward_grad, expected_upstream_grad=expected_upstream_grad,
        logprob_only=per_token_logprob, ahead=ahead)

    if not smoothing and not z_weight and reduction != "none":
        total = stats.negative_logprob_total(mean=reduction == "mean")  # one kernel, where it applies
        if total is not None:
            if stats.straight is not None:
                remembered_routes.remember(route_key, remembered_routes.CrossEntropyRoute(stats.straight, forward_grad,
                                                                                          impl))
            return total + stats.anchor
    per_token = stats.negative_logprob()  # (0 in rows of ignored labels)
    masked = True
    if smoothing > 0.0:
        per_token = (1.0 - smoothing) * per_token + smoothing * (stats.lse - stats.sum_logits / true_vocab)
        masked = False
    if z_weight:
        per_token = per_token + z_weight * stats.lse.square()
        masked = False
    if reduction == "none":
        straight = stats.straight
        if per_token_logprob and straight is not None and straight.route in remembered_routes.LOGPROB_ROUTES:
            # a later call runs the log-prob route this call took, negated (remembered_routes.py)
            remembered_routes.remember(route_key, remembered_routes.PerTokenLossRoute(straight, impl))
        return stats.to_full(per_token, masked=masked)
    total = (per_token if masked else stats.only_labelled(per_token)).sum()
    if reduction == "mean":
        total = stats.mean_of_labelled(total)
    total = stats.poisoned(total)
    return total if stats.anchor is None else total + stats.anchor
