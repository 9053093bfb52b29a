"""Per-piece math of sampling-distribution replay (replay.py), in plain torch: every backend's.

A piece is a set of token rows whose kept sets (the engine's sampling mask) are scored on one
block of logits `[rows, cols]` of this rank's shard: the whole shard, or the gathered columns of
the piece's union of kept ids (replay.py). The kept entries of the rows are laid out padded,
`[rows, slots]`: `flat_index` holds each entry's position `row * cols + col` in the block (-1 for
an empty slot), `is_target` marks the entry whose id is the row's label. With z = fp32(logit) / T
of the entries:

- `entry_stats` -> (ShardStats over the kept entries of this shard, z): max, sum exp(z - max),
  the label's z (0 where the label is not among the entries), and sum exp(z - max) (z - max) for
  the entropy; a row without an entry here has max -inf and zero sums, which the TP merge
  (reductions.merge_shard_stats) weighs by exp(-inf) = 0.
- `entry_dlogits` makes the block's d(loss)/d(logits) for the kept-set distribution q:

      dL/dz_k = q_k (coef_p + coef_pz log q_k) + coef_target [k == y]   for the kept k, 0 elsewhere

  (log q_k = (z_k - M) - log S with M, log S the merged row offsets; the chain rule through
  z = logit / T included), so one GEMM pair makes dX and dW from it.

The work is O(rows x slots) next to the piece's O(rows x cols x H) GEMMs: a few elementwise
kernels, no Triton kernel of its own (it would not pay). Entries are padded rows, not a flat list
with scatter-adds, so that the sums are deterministic (row reductions).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ShardStats


def entry_z(logits: Tensor, flat_index: Tensor, inv_temperature: float) -> Tensor:
    """[rows, slots] fp32 z of the entries (empty slots: the block's first element, unused)."""
    z = logits.reshape(-1).index_select(0, flat_index.clamp(min=0).reshape(-1)).view(flat_index.shape).float()
    if inv_temperature != 1.0:
        z = z * inv_temperature
    return z


def entry_stats(logits: Tensor, flat_index: Tensor, is_target: Tensor, inv_temperature: float,
                want_entropy: bool) -> tuple[ShardStats, Tensor]:
    """This shard's partials over each row's kept entries, and the entries' z (saved for the
    backward: the block need not be recomputed)."""
    rows = flat_index.shape[0]
    if flat_index.shape[1] == 0:
        return ShardStats.empty(rows, logits.device, want_entropy=want_entropy), \
            torch.zeros(flat_index.shape, dtype=torch.float32, device=logits.device)
    z = entry_z(logits, flat_index, inv_temperature)
    valid = flat_index >= 0
    row_max = torch.where(valid, z, float("-inf")).amax(dim=1)
    safe_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # rows without an entry here
    shifted = torch.where(valid, z - safe_max.unsqueeze(1), 0.0)
    e = torch.where(valid, torch.exp(shifted), 0.0)
    return ShardStats(
        max=row_max,
        sum_exp=e.sum(dim=1),
        target=torch.where(is_target, z, 0.0).sum(dim=1),
        sum_exp_shifted=(e * shifted).sum(dim=1) if want_entropy else None,
    ), z


def entry_dlogits(cols: int, dtype: torch.dtype, flat_index: Tensor, is_target: Tensor, z: Tensor,
                  inv_temperature: float, row_max: Tensor, log_sum_exp: Tensor, coef_p: Tensor,
                  coef_pz: Optional[Tensor], coef_target: Optional[Tensor]) -> Tensor:
    """[rows, cols] dlogits in `dtype` (the GEMMs' input dtype): the entries' values, 0 elsewhere."""
    rows = flat_index.shape[0]
    # one spare element past the block takes the empty slots' writes (every entry's position is
    # unique, so the block's values do not depend on the order of the writes)
    spare = rows * cols
    flat = torch.zeros(spare + 1, dtype=dtype, device=z.device)
    if flat_index.shape[1] > 0:
        valid = flat_index >= 0
        log_q = (z - row_max.unsqueeze(1)) - log_sum_exp.unsqueeze(1)
        coef = coef_p.unsqueeze(1)
        if coef_pz is not None:
            coef = coef + coef_pz.unsqueeze(1) * log_q
        grad = torch.where(valid, torch.exp(log_q) * coef, 0.0)
        if coef_target is not None:
            grad = grad + torch.where(is_target, coef_target.unsqueeze(1), 0.0)
        if inv_temperature != 1.0:
            grad = grad * inv_temperature
        flat.index_put_((torch.where(valid, flat_index, spare).reshape(-1),), grad.reshape(-1).to(dtype))
    return flat[:spare].view(rows, cols)
