"""Kept-set math of sampling-distribution replay (replay.py), in plain torch: the reference of every
backend's, the CPU path, and the pieces the GPU path shares.

The kept entries come as replay.KeptEntries: the mask's CSR (`offsets` over positions, `ids`)
with, per entry e, `slot[e]` (the labelled row with a set it belongs to, an index into
`set_rows`; -1 at positions without one), `col[e]` (its local column on this shard), `valid[e]`
(a labelled row's entry on this shard's valid columns), `is_label[e]` (valid and its id is the
row's label) and `position[e]`. With z_e = fp32(h_row . W_col) / T (the dot rounded to the input
dtype first, as the chunk GEMM's logits are, unless logits_dtype is fp32):

- `kept_stats` -> the ShardStats of each set row over its valid entries (max, sum exp(z - max),
  the label's z (0 where it is not among them), sum exp(z - max)(z - max) for the entropy; a row
  without an entry here has max -inf and zero sums, which the TP merge weighs by exp(-inf) = 0),
  and the entries' z when the backward will need them;
- `entry_stats` -> the same statistics from the entries' z (the dense route reads z off its chunks
  of logits);
- `entry_dlogits` -> d(loss)/d(logit) of every entry for the kept-set distribution q:

      dL/dz_k = q_k (coef_p + coef_pz log q_k) + coef_target [k == y]   for the kept k

  (log q_k = (z_k - M) - log S with the merged row offsets; times 1/T, the chain rule through
  z = logit / T), 0 at invalid entries (O(entries) elementwise);
- `kept_grads` -> dX of the set rows and dW of their kept ids (both added; dW in fp32).

Statistics are segment reductions over the CSR (`torch.segment_reduce`: no atomics, the same sums
whatever the device). The gather-dots and the gradient sums run on blocks of entries, so that no
intermediate exceeds a chunk of logits.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ShardStats


def _entry_blocks(entries, hidden_size: int, max_elements: int):
    """(start, end) of blocks of entries whose [entries, H] gathers hold at most max_elements."""
    total = entries.ids.numel()
    block = max(1, max_elements // max(hidden_size, 1))
    return [(a, min(a + block, total)) for a in range(0, total, block)]


def entry_logits(rows: Tensor, weight: Tensor, entries, inv_temperature: float, round_to: Optional[torch.dtype],
                 max_elements: int) -> Tensor:
    """fp32 [E]: z of every valid entry (0 elsewhere), by blocks of gathered rows."""
    z = torch.zeros(entries.ids.numel(), dtype=torch.float32, device=rows.device)
    row_of, col = entries.row_of_entry(), entries.col.clamp(0, max(weight.shape[0] - 1, 0))
    for a, b in _entry_blocks(entries, rows.shape[1], max_elements):
        dots = (rows.index_select(0, row_of[a:b]).float() * weight.index_select(0, col[a:b]).float()).sum(1)
        if round_to is not None:
            dots = dots.to(round_to).float()
        z[a:b] = torch.where(entries.valid[a:b], dots * inv_temperature, 0.0)
    return z


def entry_stats(z: Tensor, entries, want_entropy: bool, into: Optional[Tensor] = None, *,
                gather: Optional[tuple] = None, finish: Optional[tuple] = None) -> Optional[ShardStats]:
    """ShardStats of the set rows (in set_rows order) over their valid entries, from the entries' z;
    with `into`, written there instead (`into_columns`) and None returned. With `gather` (values,
    place [E], 1 / T): the valid entries' z read first, z[e] = fp32(values.flat[place[e]]) / T
    (the union tiles' products; KeptEntries.gather_places). With `finish` (tail, logprob_of), where
    no merge over TP ranks follows and every row is a slot (`into` given): a row without a set
    takes placeholders of 1 (max, sum exp, target, and the entropy's sum), and every row's merged
    tail (torch_backend.merged_tail: log S, lse, entropy, and with `logprob_of` (labelled, kept,
    poison) the labelled log-probs) is written into tail's rows (fp32 [4, rows + 1])."""
    if finish is not None and (into is None or entries.set_rows.numel() != entries.labelled.numel()):
        raise ValueError("entry_stats: finish needs `into` and a slot for every row")
    valid, offsets = entries.valid, entries.offsets
    if gather is not None:
        values, place, inv_temperature = gather
        read = values.reshape(-1).index_select(0, place.clamp(0, values.numel() - 1)).float()
        torch.where(valid & (place >= 0) & (place < values.numel()), read * inv_temperature, z, out=z)
    per_position_max = torch.segment_reduce(torch.where(valid, z, float("-inf")), "max", offsets=offsets)
    safe = torch.where(torch.isfinite(per_position_max), per_position_max, 0.0)
    shifted = torch.where(valid, z - safe.index_select(0, entries.position), 0.0)
    e = torch.where(valid, torch.exp(shifted), 0.0)
    at = entries.set_positions

    def row_sums(values):
        return torch.segment_reduce(values, "sum", offsets=offsets).index_select(0, at)

    stats = ShardStats(max=per_position_max.index_select(0, at), sum_exp=row_sums(e),
                       target=row_sums(torch.where(entries.is_label, z, 0.0)),
                       sum_exp_shifted=row_sums(e * shifted) if want_entropy else None)
    if into is None:
        return stats
    into_columns(stats, entries, into)
    if finish is not None:
        rows = entries.labelled.numel()
        fields = into[:, :rows]
        fields.masked_fill_(~entries.has_set, 1.0)
        tail, logprob_of = finish
        shifted = fields[3] if want_entropy else None
        from . import torch_backend  # (it imports this module)

        made = torch_backend.merged_tail(fields[0], fields[1], shifted,
                                         None if logprob_of is None else (fields[2], *logprob_of))
        for i, value in enumerate(made):
            if value is not None:
                tail[i, :rows] = value
    return None


def into_columns(stats: ShardStats, entries, into: Tensor) -> None:
    """Each set row's fields (max, sum_exp, target, sum_exp_shifted: `into`'s rows) written into
    `into` at its column set_dest (padding slots: the spare last column)."""
    names = ("max", "sum_exp", "target", "sum_exp_shifted")[:into.shape[0]]
    into.index_copy_(1, entries.set_dest, torch.stack([getattr(stats, name) for name in names]))


def kept_stats(rows: Tensor, weight: Tensor, entries, inv_temperature: float, round_to: Optional[torch.dtype],
               want_entropy: bool, want_z: bool, max_elements: int, into: Optional[Tensor] = None):
    """(ShardStats of the set rows over their kept entries here, the entries' z or None); with
    `into`, the statistics are written there instead (`into_columns`) and None returned for them."""
    z = entry_logits(rows, weight, entries, inv_temperature, round_to, max_elements)
    return entry_stats(z, entries, want_entropy, into), z if want_z else None


def entry_dlogits(z: Tensor, entries, inv_temperature: float, row_max: Tensor, log_sum_exp: Tensor,
                  coef_p: Optional[Tensor], coef_pz: Optional[Tensor], coef_target: Optional[Tensor],
                  dtype: torch.dtype = torch.float32, *, gate: tuple = (), into: tuple = ()) -> Optional[Tensor]:
    """[E] dlogits of every entry (0 at invalid ones; computed in fp32, returned in `dtype`); the
    per-row tensors over the call's rows. `gate` (bool [rows] tensors): the rows whose target
    coefficient counts (0 in the others); `coef_p` None: minus the (gated) target coefficient (a
    log-prob's upstream gradient: target - lse). With `into` ((place [E], block), ...): each valid
    entry's dlogit written at block.view(-1)[place] in the block's dtype instead (the blocks'
    other elements left), and None returned."""
    row_of = entries.row_of_entry()  # (an entry outside a set reads a row: it is not valid)

    def per_entry(t):  # (one [E] gather each: no [fields, E] block past a chunk of logits)
        return t.index_select(0, row_of)

    if coef_target is not None:
        for open_rows in gate:
            coef_target = torch.where(open_rows, coef_target, 0.0)
    if coef_p is None:
        coef_p = -coef_target
    log_q = (z - per_entry(row_max)) - per_entry(log_sum_exp)
    coef = per_entry(coef_p)
    if coef_pz is not None:
        coef = coef + per_entry(coef_pz) * log_q
    grad = torch.where(entries.valid, torch.exp(log_q) * coef, 0.0)
    if coef_target is not None:
        grad = grad + torch.where(entries.is_label, per_entry(coef_target), 0.0)
    if inv_temperature != 1.0:
        grad = grad * inv_temperature
    if not into:
        return grad.to(dtype)
    for place, block in into:  # (an entry that is not valid has place -1: outside every block)
        entries.scatter_places(grad.to(block.dtype), place, 0, block.shape, into=block)
    return None


def kept_grads(rows: Tensor, weight: Tensor, entries, d: Tensor, dx_rows: Optional[Tensor], dw_out: Optional[Tensor],
               max_elements: int) -> None:
    """dX of the set rows added into dx_rows (a padding slot adds zeros to the row it gathers) and
    their entries' dW rows added into the fp32 dw_out, by blocks of entries (fp32 sums)."""
    row_of, col = entries.row_of_entry(), entries.col.clamp(0, max(weight.shape[0] - 1, 0))
    slot = entries.slot.clamp(min=0)
    dx_set = None
    if dx_rows is not None:
        dx_set = torch.zeros(entries.set_rows.numel(), rows.shape[1], dtype=torch.float32, device=rows.device)
    for a, b in _entry_blocks(entries, rows.shape[1], max_elements):
        coef = d[a:b].unsqueeze(1)
        if dx_set is not None:
            dx_set.index_add_(0, slot[a:b], coef * weight.index_select(0, col[a:b]).float())
        if dw_out is not None:
            dw_out.index_add_(0, col[a:b], coef * rows.index_select(0, row_of[a:b]).float())
    if dx_set is not None:  # added: a set row's dX from the plain pass is zero, and so is a padding slot's
        dx_rows.index_add_(0, entries.set_rows, dx_set.to(dx_rows.dtype))
