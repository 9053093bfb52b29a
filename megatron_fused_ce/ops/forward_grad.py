"""The contract of a loss whose gradients are made in the forward pass.

A fused loss over the labelled tokens is a scalar L(statistics) of each token's statistics (its
target logit z_y, lse, and on request sum_k z_k and the entropy, all over the global vocab). When
dL/d(statistics of token i) is known as soon as token i's chunk has been merged across TP ranks,
the chunk loop can turn it into that chunk's dlogits, dX and dW right away: 3 GEMMs per chunk
instead of the recompute path's 4, and no logits kept for the backward (docs/design.md §4.5).

A loss says how, by subclassing `ForwardGradLoss`:

* `token_grads(stats, positions, num_labelled) -> TokenGrads`: the gradient under a unit upstream
  gradient w.r.t. each statistic of the chunk's tokens (`stats`: reductions.MergedStats of the
  chunk; `positions`: the tokens' flat indices into `labels.reshape(-1)`; `num_labelled`: the
  labelled tokens of the whole call). Everything it needs from other tokens must be known before
  the chunk loop (linear_grpo_loss computes its batch totals first).
* `one_hot_scale(num_labelled)`: where each token's dlogits are c_i (softmax - one_hot(y)), a
  backend's one-pass row kernel can make them in the same pass that takes lse: return c (a float,
  the same for every token: the GEMMs' alpha) or `PER_ROW` (c_i = the token's coefficient of lse,
  read from `token_grads`); None (the default) where the gradient has any other form.
* `scale_before_statistics(num_labelled)`: where each labelled token's dlogits are c (softmax -
  one_hot(y)), 0 in the rows of ignored labels, with c known before the statistics, a backend's
  `stats_dlogits` makes them in the launch that takes the statistics: return c (a float, or a 0-d
  fp32 tensor on the device); None (the default) otherwise.
* `want_sum_logits`: whether `token_grads` reads `sum_logits` (label smoothing).

Then `api.token_statistics(..., forward_grad=loss)` runs the chunk loop and returns the statistics
as plain values with an `anchor`, a zero scalar carrying dX and dW: the loss returns
`value + anchor`, and the backward scales what the forward made by the anchor's upstream gradient.
losses/linear_cross_entropy.py and losses/linear_grpo.py are the two such losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

PER_ROW = "per_row"  # one_hot_scale: c_i differs per token (the coefficient of lse)


@dataclass
class TokenGrads:
    """d loss / d statistic for each token of a chunk ([rows] fp32; None: the loss does not depend
    on that statistic)."""

    target: Optional[Tensor] = None
    lse: Optional[Tensor] = None
    sum_logits: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    masked: bool = False  # 0 in the rows of ignored labels already

    def only_rows(self, keep: Optional[Tensor]) -> "TokenGrads":
        """Zero where `keep` (bool [rows]) is False: rows of ignored labels that went through the
        chunk loop (a remembered signature does not drop them); None keeps every row."""
        if keep is None or self.masked:
            return self
        return TokenGrads(*(None if g is None else torch.where(keep, g, 0.0)
                            for g in (self.target, self.lse, self.sum_logits, self.entropy)))


class ForwardGradLoss:
    """Base of the losses whose gradients are made in the forward pass (module doc)."""

    want_sum_logits: bool = False
    masks_unlabelled: bool = False  # token_grads gives 0 in rows of ignored labels itself (else the loop does)

    def token_grads(self, stats, positions: Tensor, num_labelled) -> TokenGrads:
        """`positions`: the chunk's rows among all rows of the call (flat positions of the
        labels): a tensor of indices, or a `slice` of consecutive rows; either indexes a tensor.
        `num_labelled`: the labelled tokens of the call, an int, or an `api.LabelledCount` on the
        device where no count was read back (the rows then include ignored ones, whose gradients
        the chunk loop zeroes: they may hold anything here)."""
        raise NotImplementedError

    def one_hot_scale(self, num_labelled) -> Union[float, str, None]:
        return None

    def scale_before_statistics(self, num_labelled) -> Union[float, Tensor, None]:
        return None

    def terms_in_launch_applies(self, spec, rows: Tensor, weight: Tensor) -> bool:
        """Whether this call's one chunk of every row may take its statistics, the loss's per-token
        terms and its dlogits from one launch (`stats_and_terms_`: fast.TermsInLaunch), beyond the
        chunk's own conditions."""
        return False

    def stats_and_terms_(self, logits: Tensor, spec, **label_checks):
        """The one launch of fast.TermsInLaunch on the chunk's logits (dlogits in their place): the
        loss's terms kept for token_grads and its value, -> the launch's statistics and label checks."""
        raise NotImplementedError
