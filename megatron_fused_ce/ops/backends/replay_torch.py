"""Entry math of sampling-distribution replay (replay.py), in plain torch: every backend's.

The kept entries of the rows with a set (the engine's sampling mask) on this rank's shard are laid
out in slots (replay.Plan): rows in order of their number of entries, in blocks of rows of one
width, a block `(start, end, width, base)` holding rows [start, end) as `[end - start, width]` at
slots [base, base + (end - start) * width) of the flat slot arrays; `valid` marks the slots that
hold an entry, `is_target` the entry whose id is the row's label. With z = fp32(logit) / T of the
slots (read off the pieces' blocks of logits by replay.py):

- `entry_stats` -> ShardStats of every row over its kept entries on this shard: max, sum
  exp(z - max), the label's z (0 where the label is not among the entries), and sum exp(z - max)
  (z - max) for the entropy; a row without an entry here has max -inf and zero sums, which the TP
  merge (reductions.merge_shard_stats) weighs by exp(-inf) = 0.
- `entry_dlogits` -> d(loss)/d(logits) at every slot for the kept-set distribution q:

      dL/dz_k = q_k (coef_p + coef_pz log q_k) + coef_target [k == y]   for the kept k

  (log q_k = (z_k - M) - log S with M, log S the merged row offsets; the chain rule through
  z = logit / T included), 0 in empty slots; replay.py writes them into each piece's block of
  dlogits for its GEMM pair (dX and dW).

The work is O(rows x K) next to the pieces' O(rows x cols x H) GEMMs: a few elementwise kernels
per block (not per piece: a call has few blocks), no Triton kernel of its own (it would not pay).
Entries are padded rows, not a flat list with scatter-adds, so that the sums are deterministic
(row reductions).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ShardStats


def _views(flat: Tensor, start: int, end: int, width: int, base: int) -> Tensor:
    return flat[base:base + (end - start) * width].view(end - start, width)


def _block_stats(z: Tensor, valid: Tensor, is_target: Tensor, want_entropy: bool) -> ShardStats:
    row_max = torch.where(valid, z, float("-inf")).amax(dim=1)
    safe_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # rows without an entry here
    shifted = torch.where(valid, z - safe_max.unsqueeze(1), 0.0)
    e = torch.where(valid, torch.exp(shifted), 0.0)
    return ShardStats(
        max=row_max,
        sum_exp=e.sum(dim=1),
        target=torch.where(is_target, z, 0.0).sum(dim=1),
        sum_exp_shifted=(e * shifted).sum(dim=1) if want_entropy else None,
    )


def entry_stats(z: Tensor, valid: Tensor, is_target: Tensor, blocks: list, want_entropy: bool) -> ShardStats:
    """This shard's partials of the rows of `blocks` (in their order) over their kept entries; `z`
    fp32 [slots], temperature applied."""
    parts = []
    for start, end, width, base in blocks:
        if width == 0:
            parts.append(ShardStats.empty(end - start, z.device, want_entropy=want_entropy))
            continue
        block = (start, end, width, base)
        parts.append(_block_stats(_views(z, *block), _views(valid, *block), _views(is_target, *block), want_entropy))
    if len(parts) == 1:
        return parts[0]
    return ShardStats(max=torch.cat([p.max for p in parts]), sum_exp=torch.cat([p.sum_exp for p in parts]),
                      target=torch.cat([p.target for p in parts]),
                      sum_exp_shifted=torch.cat([p.sum_exp_shifted for p in parts]) if want_entropy else None)


def entry_dlogits(z: Tensor, valid: Tensor, is_target: Tensor, blocks: list, inv_temperature: float,
                  row_max: Tensor, log_sum_exp: Tensor, coef_p: Tensor, coef_pz: Optional[Tensor],
                  coef_target: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """[slots] dlogits of every slot in `dtype` (the GEMMs' input dtype), 0 in empty slots; the
    per-row tensors in the blocks' row order."""
    parts = []
    for start, end, width, base in blocks:
        if width == 0:
            continue
        block = (start, end, width, base)
        zb, vb = _views(z, *block), _views(valid, *block)
        log_q = (zb - row_max[start:end].unsqueeze(1)) - log_sum_exp[start:end].unsqueeze(1)
        coef = coef_p[start:end].unsqueeze(1)
        if coef_pz is not None:
            coef = coef + coef_pz[start:end].unsqueeze(1) * log_q
        grad = torch.where(vb, torch.exp(log_q) * coef, 0.0)
        if coef_target is not None:
            grad = grad + torch.where(_views(is_target, *block), coef_target[start:end].unsqueeze(1), 0.0)
        if inv_temperature != 1.0:
            grad = grad * inv_temperature
        parts.append(grad.reshape(-1).to(dtype))
    if not parts:
        return torch.zeros(z.numel(), dtype=dtype, device=z.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
