"""Per-chunk softmax math on one vocab shard, in plain torch: the reference backend (any device).

A chunk is `logits[n, v]` = hidden_chunk @ weight_shard.T in the input dtype, exactly what
Megatron's output layer would produce. Here it is scaled by 1/temperature (z = logits / T) and
reduced in fp32. Columns at or past `num_valid_cols` are Megatron's vocab padding: they take no part
in any sum and get zero gradient.

Two functions make the core of a backend (triton_backend.py has the same two, with the same
arguments; the interface and the other capabilities: backends/__init__.py):

- `shard_stats` -> `ShardStats`: this shard's per-token partials, to be merged across tensor-parallel
  ranks by `reductions.merge_shard_stats` (one all-gather, then `merge_gathered`).
- `shard_dlogits_`: overwrite the chunk with d(loss)/d(logits), given per-token coefficients that
  the chunk loop derived from the upstream gradients. With p = softmax(z) over the *global* vocab
  (p_k = exp(z_k - lse)) and y the target column on this shard (-1 if elsewhere):

      dL/dz_k = p_k * (coef_p + coef_pz * (z_k - lse)) + coef_target * [k == y] + coef_uniform

  Every statistic we expose has a gradient of this form (see chunked.py), so one kernel serves
  log-probs, entropy, cross-entropy with label smoothing and z-loss. The entropy terms are taken
  relative to the row max (forward) and to lse (backward, z_k - lse = log p_k): with |z| ~ 50 or
  T = 1e-3 a sum of exp(z) * z followed by lse - E[z] would cancel most of fp32's digits.

Column blocks: `local_target` holds column ids of the whole shard; with `col_start` (keyword) the
tensor is the block of columns [col_start, col_start + width) and a target outside it counts as on
another block (the chunk loop and lean mode walk the shard in blocks without re-indexing targets).

Lean mode (lean.py) adds one function, `exp_tile_`: overwrite a tile of logits with
exp(z - ref_max) against a per-row reference (moved, with what was summed against it rescaled,
when the tile goes too far above it) and accumulate its partials. `combine_blocks` (plain
math: reductions.py) merges the partials of column blocks of one shard.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import Backend, ShardStats, replay_torch, sampling_torch
from .sampling_torch import scaled_fp32 as _scaled_fp32


def _target_mask(local_target: Tensor, col_start: int, width: int) -> tuple[Tensor, Tensor]:
    """(label in the block [col_start, col_start + width), its column in the block (0 if not))."""
    col = local_target - col_start if col_start else local_target
    in_block = (col >= 0) & (col < width)
    return in_block, torch.where(in_block, col, 0).unsqueeze(1)


def shard_stats(
    logits: Tensor,
    local_target: Tensor,
    num_valid_cols: int,
    inv_temperature: float,
    want_sum_logits: bool = False,
    want_entropy: bool = False,
    *,
    col_start: int = 0,
) -> ShardStats:
    if num_valid_cols == 0:  # a shard made only of padding columns
        return ShardStats.empty(logits.shape[0], logits.device, want_sum_logits, want_entropy)
    z = _scaled_fp32(logits, num_valid_cols, inv_temperature)
    on_shard, target_col = _target_mask(local_target, col_start, num_valid_cols)
    row_max = z.amax(dim=1)
    shifted = z - row_max.unsqueeze(1)
    exp_shifted = torch.exp(shifted)
    target = torch.where(on_shard, z.gather(1, target_col).squeeze(1), 0.0)
    return ShardStats(
        max=row_max,
        sum_exp=exp_shifted.sum(dim=1),
        target=target,
        sum_logits=z.sum(dim=1) if want_sum_logits else None,
        sum_exp_shifted=(exp_shifted * shifted).sum(dim=1) if want_entropy else None,
    )


def shard_logprob(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                  poison: Tensor) -> tuple:
    """A chunk's log-probs where this shard is the whole vocab (TP = 1: nothing to merge), the
    per-token epilogue of a forward-only call: shard_stats, then finish_logprob."""
    return finish_logprob(shard_stats(logits, local_target, num_valid_cols, inv_temperature), local_target,
                          num_valid_cols, poison)


def finish_logprob(stats: ShardStats, local_target: Tensor, num_valid_cols: int, poison: Tensor) -> tuple:
    """ShardStats of the whole vocab -> (log p_y, M, log S, z_y, lse), fp32 [n]: log S = log(sum exp(z - M)),
    lse = M + log S and log p_y = (z_y - M) - log S: the merge's tail (merged_tail) and a
    forward-only call's result (labelled_logprob, here 0 where the label is not a column: ignored),
    `poison` (fp32 [1]: NaN where the device checks found bad contents, else 0) added to it."""
    log_sum_exp, lse, _ = merged_tail(stats.max, stats.sum_exp, None)
    on_shard, _ = _target_mask(local_target, 0, num_valid_cols)
    logprob = labelled_logprob(stats.target, stats.max, log_sum_exp, on_shard, poison)
    return logprob, stats.max, log_sum_exp, stats.target, lse


def _in_rank_order(values: Tensor) -> Tensor:
    """values[0] + values[1] + ... over the ranks (dim 0), one addition at a time: the order the Triton
    kernel sums in, so that both backends give the same bits on every rank."""
    total = values[0]
    for part in values[1:]:
        total = total + part
    return total


def merge_gathered(gathered: Tensor, n: int, want_sum_logits: bool, want_entropy: bool,
                   rank_verdict: Optional[tuple] = None, want_logprob: bool = False,
                   labelled: Optional[Tensor] = None, poison: Optional[Tensor] = None) -> tuple:
    """The TP merge of every rank's packed partials (reductions.packed_partials; `gathered`: [ranks,
    length], rank order), the same on every rank: M = the rows' max over the ranks, S = sum of sum exp(z - m) exp(m - M) (a rank
    without valid columns, m = -inf, contributes exp(-inf) = 0), z_y and sum z summed, the entropy's
    sum exp(z - M)(z - M) = exp(m - M) (sum exp(z - m)(z - m) + (m - M) sum exp(z - m)), then
    merged_tail's log S, lse and entropy. With `rank_verdict` (reductions.RankCheck.verdict_inputs:
    the call's poison so far, the flags word and the flag to record) also the poison with the
    verdict in it: NaN where any rank's check values differ from rank 0's (recorded), else None.
    `want_logprob`: also a forward-only call's result, labelled_logprob's of the merged rows (the
    `labelled` rows', 0 elsewhere), plus the verdict's poison, or without a verdict `poison`.
    Returns (M, log S, lse, z_y, sum z or None, entropy or None, poison, log-probs or None)."""
    fields = 3 + want_sum_logits + want_entropy
    rows = gathered[:, :fields * n].reshape(gathered.shape[0], fields, n)
    maxes, sums = rows[:, 0], rows[:, 1]
    row_max = maxes.amax(0)
    rescale = torch.exp(maxes - row_max)
    sum_exp = _in_rank_order(sums * rescale)
    target = _in_rank_order(rows[:, 2])
    sum_logits = _in_rank_order(rows[:, 3]) if want_sum_logits else None
    sum_exp_shifted = None
    if want_entropy:
        shift = torch.where(torch.isfinite(maxes), maxes - row_max, 0.0)
        sum_exp_shifted = _in_rank_order((rows[:, fields - 1] + shift * sums) * rescale)
    log_sum_exp, lse, entropy = merged_tail(row_max, sum_exp, sum_exp_shifted)
    verdict_poison = None
    if rank_verdict is not None:
        poison_so_far, flags, flag = rank_verdict
        checks = gathered[:, fields * n:]
        differ = (checks != checks[:1]).any()
        if flags is not None:
            flags.bitwise_or_((differ.to(torch.int64) * flag).reshape(1))
        verdict_poison = poison = poison_so_far + torch.where(differ, float("nan"), 0.0)
    logprob = labelled_logprob(target, row_max, log_sum_exp, labelled, poison) if want_logprob else None
    return row_max, log_sum_exp, lse, target, sum_logits, entropy, verdict_poison, logprob


def merged_tail(row_max: Tensor, sum_exp: Tensor, sum_exp_shifted: Optional[Tensor],
                logprob_of: Optional[tuple] = None) -> tuple:
    """The merged statistics' last step: (log S, lse = M + log S, entropy or None), fp32 [n], from
    the rows' max M, S = sum exp(z - M) and sum exp(z - M)(z - M) over the whole vocab. The entropy
    H = lse - E[z] = log S - E[z - M]: two non-negative terms, no cancellation at large |z|.
    `logprob_of` (target, labelled, kept, poison): labelled_logprob's arguments beside M and
    log S, its result a fourth value (a forward's log-probs at TP = 1, from the same launch)."""
    log_sum_exp = torch.log(sum_exp)
    entropy = None if sum_exp_shifted is None else log_sum_exp - sum_exp_shifted / sum_exp
    if logprob_of is None:
        return log_sum_exp, row_max + log_sum_exp, entropy
    target, labelled, kept, poison = logprob_of
    return (log_sum_exp, row_max + log_sum_exp, entropy,
            labelled_logprob(target, row_max, log_sum_exp, labelled, poison, kept))


def labelled_logprob(target: Tensor, row_max: Tensor, log_sum_exp: Tensor, labelled: Optional[Tensor],
                     poison: Optional[Tensor], kept: Optional[Tensor] = None) -> Tensor:
    """A forward-only call's result: log p_y = (z_y - M) - log S, 0 where the label is ignored
    (`labelled` False; None: every row), -inf where `kept` is False (replay: the label is not in
    its row's kept set), plus `poison` ([1]: NaN where the device checks found bad contents, else
    0; None: nothing to add)."""
    value = (target - row_max) - log_sum_exp
    if labelled is not None:
        value = torch.where(labelled, value, 0.0)
    if kept is not None:
        value = torch.where(kept, value, float("-inf"))
    return value if poison is None else value + poison


def shard_dlogits_(
    logits: Tensor,
    local_target: Tensor,
    num_valid_cols: int,
    inv_temperature: float,
    lse: Tensor,
    coef_p: Tensor,
    coef_pz: Optional[Tensor],
    coef_target: Optional[Tensor],
    coef_uniform: Optional[Tensor],
    log_sum_exp: Optional[Tensor] = None,
    *,
    col_start: int = 0,
) -> Tensor:
    """Overwrite `logits` with dL/d(logits) (chain rule through z = logits / T included).

    log p_k = z_k - lse; or, when `log_sum_exp` is given, `lse` is the row max M and
    log p_k = (z_k - M) - log_sum_exp (more digits at large |z|; used with entropy)."""
    if num_valid_cols < logits.shape[1]:
        logits[:, num_valid_cols:].zero_()
    if num_valid_cols == 0:
        return logits
    z = _scaled_fp32(logits, num_valid_cols, inv_temperature)
    if coef_pz is None and log_sum_exp is None:
        grad = torch.exp(z - lse.unsqueeze(1))  # p_k
        grad.mul_(coef_p.unsqueeze(1))
    else:
        log_p = z - lse.unsqueeze(1)
        if log_sum_exp is not None:
            log_p.sub_(log_sum_exp.unsqueeze(1))
        grad = torch.exp(log_p)
        grad.mul_(coef_p.unsqueeze(1) if coef_pz is None else coef_p.unsqueeze(1) + coef_pz.unsqueeze(1) * log_p)
    if coef_uniform is not None:
        grad.add_(coef_uniform.unsqueeze(1))
    if coef_target is not None:
        on_shard, target_col = _target_mask(local_target, col_start, num_valid_cols)
        grad.scatter_add_(1, target_col, torch.where(on_shard, coef_target, 0.0).unsqueeze(1))
    if inv_temperature != 1.0:
        grad.mul_(inv_temperature)
    logits[:, :num_valid_cols].copy_(grad)
    return logits


def scale_cast(src: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """dtype(src * scale): the weight gradient (fp32, or already in `dtype` when one GEMM made
    it) scaled by the upstream gradient."""
    return (src * scale).to(dtype)


def scale_(t: Tensor, scale: Tensor, other: Optional[Tensor] = None) -> Tensor:
    """t *= scale in place (and `other` *= scale), in fp32 with the fp32 upstream gradient (scale is
    not rounded to t's dtype first, as `t.mul_` would do for bf16): dX, and a dW made in the
    weight dtype. In pieces, so that no fp32 copy of a [V_local, H] dW exists; t is unchanged when
    scale == 1. Returns t."""
    scale = scale.to(torch.float32)
    for x in (t,) if other is None else (t, other):
        if not x.is_contiguous():
            x.copy_(x.float() * scale)
            continue
        flat = x.view(-1)
        for part in (flat,) if flat.numel() <= _SCALE_PIECE else flat.split(_SCALE_PIECE):  # (one: no split op)
            part.copy_(part.float() * scale)
    return t


_SCALE_PIECE = 1 << 22  # elements per piece of scale_ (an fp32 copy of 16 MiB at most)


def exp_tile_(
    tile: Tensor,
    local_target: Tensor,
    num_valid_cols: int,
    inv_temperature: float,
    ref_max: Tensor,
    sum_exp: Tensor,
    target: Tensor,
    sum_logits: Optional[Tensor],
    acc: Optional[Tensor],
    first: bool,
    *,
    ref_margin: float,
    col_start: int = 0,
) -> Tensor:
    """Lean sweep A on one [n, c] tile of logits (lean.py): overwrite it with P = exp(z - ref_max)
    (0 at padding columns) and accumulate fp32 [n] partials in place: sum_exp += sum P,
    target = z_y where the target is in the tile, sum_logits += sum z. `first`: the first tile of
    these rows sets ref_max to its row max and initializes the partials. Later tiles keep ref_max
    unless the tile's row max exceeds it by more than `ref_margin` (so P <= e^ref_margin): then
    ref_max moves to that max, and sum_exp and the row of `acc` (sum_k P_k W_k of the earlier
    tiles, fp32 [n, H], or None) are multiplied by exp(old ref - new ref)."""
    n, cols = tile.shape
    valid = min(num_valid_cols, cols)
    z = _scaled_fp32(tile, valid, inv_temperature)
    block_max = z.amax(dim=1) if valid > 0 else z.new_full((n,), float("-inf"))
    if first:
        ref_max.copy_(block_max)
        sum_exp.zero_()
        if sum_logits is not None:
            sum_logits.zero_()
    else:
        moved = torch.where(block_max > ref_max + ref_margin, block_max, ref_max)
        scale = torch.exp(ref_max - moved)  # exactly 1 where the reference stays
        sum_exp.mul_(scale)
        if acc is not None:
            acc.mul_(scale.unsqueeze(1))
        ref_max.copy_(moved)
    on_shard, target_col = _target_mask(local_target, col_start, valid)
    if valid > 0:
        target.copy_(torch.where(on_shard, z.gather(1, target_col).squeeze(1), target))
        if sum_logits is not None:
            sum_logits.add_(z.sum(dim=1))
    p = torch.exp(z - ref_max.unsqueeze(1))
    sum_exp.add_(p.sum(dim=1))
    if valid < cols:
        tile[:, valid:].zero_()
    tile[:, :valid].copy_(p)
    return tile


def label_targets(labels: Tensor, ignore_index: int, true_vocab: int, vocab_start: int, v_local: int,
                  flags: Optional[Tensor] = None, signature_code: Optional[int] = None,
                  agree_tensors: tuple = (), label_mask: Optional[Tensor] = None) -> tuple:
    """Flat labels -> (local_target int64 [n]: the column of the label on this shard, -1 where it is
    ignore_index, on another shard or outside [0, true_vocab); labelled bool [n]; int64 [2]:
    the number of labelled rows, and 1 if a labelled row's label lies outside [0, true_vocab)
    else 0; fp32 [3]: NaN if so else 0 (to add to the call's results), then 1 / max(labelled
    rows, 1) and its negative (a mean's coefficients)). With `flags` (an int64 [1] word,
    deferred_errors.py) that 1 is OR-ed into it. With `signature_code` (a non-negative int < 2^63)
    the fp32 vector has 9 more entries: agreement.fingerprint_pieces of [signature_code, the
    labels' two fingerprint sums (agreement.tensor_fingerprint)], what TP ranks compare on a
    remembered signature (reductions.RankCheck), and 6 more per tensor of `agree_tensors` (the
    call's other tensors that must agree: tensor_fingerprint_pieces). `label_mask` (the labels'
    shape; None: none): a position where it is 0 is ignored, its label taken as ignore_index for
    all of the above (GRPO's mask: masked tokens have no label)."""
    if label_mask is not None:
        labels = labels.masked_fill(label_mask.reshape(-1) == 0, ignore_index)
    labelled = labels != ignore_index
    in_range = (labels >= 0) & (labels < true_vocab)
    # on this shard: in range and in [vocab_start, vocab_start + v_local), as two comparisons
    on_shard = labelled & (labels >= max(vocab_start, 0)) & (labels < min(true_vocab, vocab_start + v_local))
    local_target = torch.where(on_shard, labels - vocab_start, -1)
    bad = (labelled & ~in_range).any()
    counts = torch.stack([labelled.sum(), bad.to(torch.int64)])
    if flags is not None:
        flags.bitwise_or_(counts[1:])
    # (in fp32 whatever torch's default dtype: an integer's reciprocal takes the default, bf16 after
    # torch.set_default_dtype(torch.bfloat16))
    inverse = counts[0].clamp(min=1).to(torch.float32).reciprocal()
    scalars = torch.stack([torch.where(bad, float("nan"), 0.0).to(torch.float32), inverse, -inverse])
    if signature_code is not None:
        from ..agreement import fingerprint_pieces, tensor_fingerprint  # (agreement imports the backends)

        code = torch.full((1,), signature_code, dtype=torch.int64, device=labels.device)
        scalars = torch.cat([scalars, fingerprint_pieces(torch.cat([code, tensor_fingerprint(labels)])),
                             *(tensor_fingerprint_pieces(t).to(labels.device) for t in agree_tensors)])
    return local_target, labelled, counts, scalars


def tensor_fingerprint_pieces(tensor: Tensor) -> Tensor:
    """fp32 [6]: agreement.fingerprint_pieces of agreement.tensor_fingerprint(tensor), the two sums'
    21-bit pieces (on the tensor's device)."""
    from ..agreement import fingerprint_pieces, tensor_fingerprint  # (agreement imports the backends)

    return fingerprint_pieces(tensor_fingerprint(tensor))


def labelled_loss_sum(target: Tensor, row_max: Tensor, log_sum_exp: Tensor, labelled: Optional[Tensor],
                      scale: Optional[Tensor], poison: Optional[Tensor]) -> Tensor:
    """Σ over the labelled rows of -log p_y = (max - z_y) + log S (fp32 0-d), times `scale` (0-d:
    a mean's 1 / count), plus `poison` ([1]: NaN where the device checks found bad contents, else
    0): cross-entropy's loss value from the merged statistics (plain values, no gradient)."""
    value = (row_max - target) + log_sum_exp
    total = (value if labelled is None else torch.where(labelled, value, 0.0)).sum()
    if scale is not None:
        total = total * scale
    return total if poison is None else total + poison[0]


def row_scale(out: Tensor, src: Tensor, scale: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    """out = src * scale[:, None] ([rows, H]): the product in fp32 with the fp32 per-row scale,
    rounded once to out's dtype (an upstream gradient applied to dX rows or to hidden rows);
    `keep` (bool [rows]; None: every row): the scale is 0 in the other rows (ignored labels)."""
    if keep is not None:
        scale = torch.where(keep, scale, 0.0)
    return torch.mul(src, scale.unsqueeze(1), out=out)


BACKEND = Backend(
    name="torch", shard_stats=shard_stats, shard_logprob=shard_logprob, shard_dlogits_=shard_dlogits_, scale_=scale_,
    scale_cast=scale_cast, exp_tile_=exp_tile_, shard_candidates=sampling_torch.shard_candidates,
    kept_sums=sampling_torch.kept_sums, kept_dlogits_=sampling_torch.kept_dlogits_,
    kept_stats=replay_torch.kept_stats, kept_grads=replay_torch.kept_grads, label_targets=label_targets,
    entry_stats=replay_torch.entry_stats, entry_dlogits=replay_torch.entry_dlogits,
    labelled_loss_sum=labelled_loss_sum, row_scale=row_scale, merge_gathered=merge_gathered,
    merged_tail=merged_tail, labelled_logprob=labelled_logprob,
    tile_scratch_bytes=12,  # fp32 copies of a tile: the scaled logits, exp, and a product
)
