"""Per-chunk math of the sampler-fidelity path (sampling.py), in plain torch: the reference.

Same conventions as torch_backend.py: `logits[n, v]` is one chunk on this rank's vocab shard, in
the input dtype; z = fp32(logits) * inv_temperature over the first `num_valid_cols` columns (the
rest is Megatron's vocab padding and is never kept, chosen or differentiated). Column c of the
shard is global token id `vocab_start + c`.

The kept set of a row (sampling.py) is a prefix of the total order "z descending, then global id
ascending", so one pair (z_cut, id_cut) describes it:

    kept(k)  <=>  z_k > z_cut  or  (z_k == z_cut and id_k <= id_cut)

`id_cut = ID_ALL` keeps every token tied at z_cut ("z >= z_cut"), `id_cut = ID_NONE` none of
them ("z > z_cut").

Three functions make a sampling backend (sampling_triton.py has the same three, same arguments):

- `shard_candidates`: this shard's `num_candidates` first tokens in the total order, as int64
  keys (below) sorted descending, padded with KEY_NONE;
- `kept_sums`: per row, sum over kept columns of exp(z - row_max) (and of exp(z - row_max) *
  (z - row_max), the kept count, the sum over all columns, the target logit), optionally for a
  subset of rows;
- `kept_dlogits_`: overwrite the chunk with d(loss)/d(logits) for the renormalized kept-set
  distribution q (log q_k = (z_k - M) - log S on kept columns, q_k = 0 elsewhere; M the row max,
  S the kept sum of exp(z - M), kept apart for precision as in torch_backend.py):

      dL/dz_k = kept(k) * q_k * (coef_p + coef_pz * log q_k) + coef_target * [k == y]

`tie_id` (the j-th token tied at a given value, for the rare exact-search rows) is plain torch and
shared by both backends.

Candidate keys: an fp32 value maps to an int32 whose signed order is the float order
(`ordered_int32`); key = ordered_int32(z) * 2^32 + (2^32 - 1 - id), so that int64 order is
exactly "z descending, id ascending" and candidates of several ranks merge with one top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


def scaled_fp32(logits: Tensor, num_valid_cols: int, inv_temperature: float) -> Tensor:
    """z = fp32(logits) / T over the valid (unpadded) columns: what every torch kernel reduces
    (the chunk backend's too: torch_backend.py)."""
    z = logits[:, :num_valid_cols].float()
    if inv_temperature != 1.0:
        z = z * inv_temperature
    return z


KEY_NONE = -(2**63)  # an empty candidate slot: below every real key
ID_ALL = 2**63 - 1  # id_cut: every token tied at z_cut is kept
ID_NONE = -1  # id_cut: no token tied at z_cut is kept
TIE_ROWS = 64  # rows per step of tie_id (bounds its [rows, V_local] temporaries)
_LOW32 = 0xFFFFFFFF


# ------------------------------------------------------------------------------ order keys
def ordered_int32(z: Tensor) -> Tensor:
    """fp32 -> int32 with the same order (a < b <=> key(a) < key(b)); -0.0 counts as +0.0."""
    bits = (z.float() + 0.0).view(torch.int32)  # x + 0.0 turns -0.0 into +0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def float_from_ordered(key: Tensor) -> Tensor:
    """Inverse of ordered_int32 (int32 or int64 holding an int32 value) -> fp32."""
    key = key.to(torch.int32)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).view(torch.float32)


def candidate_keys(z: Tensor, token_ids: Tensor) -> Tensor:
    """int64 keys ordered by (z descending, id ascending) under a descending sort."""
    return (ordered_int32(z).to(torch.int64) << 32) | (_LOW32 - token_ids.to(torch.int64))


def decode_keys(keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """keys -> (z fp32, global id int64, valid bool); empty slots get z = -inf, id = -1."""
    valid = keys != KEY_NONE
    z = float_from_ordered(keys >> 32)
    ids = _LOW32 - (keys & _LOW32)
    return (torch.where(valid, z, float("-inf")), torch.where(valid, ids, -1), valid)


def kept_mask(z: Tensor, token_ids: Tensor, z_cut: Tensor, id_cut: Tensor) -> Tensor:
    """[n, v] bool: the (z_cut, id_cut) prefix of the total order (see the module doc)."""
    zc, idc = z_cut.unsqueeze(1), id_cut.unsqueeze(1)
    return (z > zc) | ((z == zc) & (token_ids.unsqueeze(0) <= idc))


# ------------------------------------------------------------------------------ candidates
def shard_candidates(logits: Tensor, num_valid_cols: int, inv_temperature: float, vocab_start: int,
                     num_candidates: int) -> Tensor:
    """[n, num_candidates] int64 keys of this shard's first tokens in the total order."""
    n = logits.shape[0]
    out = torch.full((n, num_candidates), KEY_NONE, dtype=torch.int64, device=logits.device)
    take = min(num_candidates, num_valid_cols)
    if n == 0 or take == 0:
        return out
    z = scaled_fp32(logits, num_valid_cols, inv_temperature)
    ids = torch.arange(vocab_start, vocab_start + num_valid_cols, device=logits.device)
    # unique keys: torch.topk's arbitrary choice among equal values cannot matter
    out[:, :take] = candidate_keys(z, ids).topk(take, dim=1, sorted=True).values
    return out


# ------------------------------------------------------------------------------ kept sums
@dataclass
class KeptSums:
    """Per-row partials over this shard (fp32 [rows]; count int64)."""

    sum_exp: Tensor  # sum over kept columns of exp(z - row_max)
    target: Optional[Tensor] = None  # z_y when the label lives on this shard, else 0
    sum_exp_shifted: Optional[Tensor] = None  # sum over kept columns of exp(z - m) * (z - m) (entropy)
    count: Optional[Tensor] = None  # number of kept columns
    total: Optional[Tensor] = None  # sum over all valid columns of exp(z - row_max)


def empty_kept_sums(n: int, device, want_target: bool, want_entropy: bool, want_count: bool,
                    want_total: bool) -> KeptSums:
    """The kept sums of rows with no valid column (or of no rows): zeros, in KeptSums's layout."""
    zeros = torch.zeros(n, dtype=torch.float32, device=device)
    return KeptSums(
        sum_exp=zeros, target=zeros.clone() if want_target else None,
        sum_exp_shifted=zeros.clone() if want_entropy else None,
        count=torch.zeros(n, dtype=torch.int64, device=device) if want_count else None,
        total=zeros.clone() if want_total else None)


def kept_sums(logits: Tensor, local_target: Optional[Tensor], num_valid_cols: int,
              inv_temperature: float, vocab_start: int, row_max: Tensor, z_cut: Tensor,
              id_cut: Tensor, *, rows: Optional[Tensor] = None, want_entropy: bool = False,
              want_count: bool = False, want_total: bool = False) -> KeptSums:
    """Sums over the kept columns of each row. `rows` (optional) selects rows of `logits`; every
    per-row argument (local_target, row_max, z_cut, id_cut) is then given for those rows only.
    `row_max` is the row's global max z (so exp(z - row_max) <= 1)."""
    if rows is not None:
        logits = logits.index_select(0, rows)
    n = logits.shape[0]
    if num_valid_cols == 0 or n == 0:
        return empty_kept_sums(n, logits.device, local_target is not None, want_entropy, want_count,
                               want_total)
    z = scaled_fp32(logits, num_valid_cols, inv_temperature)
    ids = torch.arange(vocab_start, vocab_start + num_valid_cols, device=logits.device)
    keep = kept_mask(z, ids, z_cut, id_cut)
    shifted = z - row_max.unsqueeze(1)
    e = torch.exp(shifted)
    kept_e = torch.where(keep, e, 0.0)
    target = None
    if local_target is not None:
        on_shard = local_target >= 0
        target = torch.where(on_shard, z.gather(1, local_target.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    return KeptSums(
        sum_exp=kept_e.sum(dim=1),
        target=target,
        sum_exp_shifted=(kept_e * shifted).sum(dim=1) if want_entropy else None,
        count=keep.sum(dim=1) if want_count else None,
        total=e.sum(dim=1) if want_total else None,
    )


# ------------------------------------------------------------------------------ dlogits
def kept_dlogits_(logits: Tensor, local_target: Tensor, num_valid_cols: int, inv_temperature: float,
                  vocab_start: int, row_max: Tensor, log_sum_exp: Tensor, z_cut: Tensor, id_cut: Tensor,
                  coef_p: Tensor, coef_pz: Optional[Tensor], coef_target: Optional[Tensor]) -> Tensor:
    """Overwrite `logits` with dL/d(logits) of the kept-set distribution (chain rule through
    z = logits / T included); columns outside the kept set and padding columns get 0."""
    if num_valid_cols < logits.shape[1]:
        logits[:, num_valid_cols:].zero_()
    if num_valid_cols == 0 or logits.shape[0] == 0:
        return logits
    z = scaled_fp32(logits, num_valid_cols, inv_temperature)
    ids = torch.arange(vocab_start, vocab_start + num_valid_cols, device=logits.device)
    keep = kept_mask(z, ids, z_cut, id_cut)
    log_q = (z - row_max.unsqueeze(1)) - log_sum_exp.unsqueeze(1)
    coef = coef_p.unsqueeze(1)
    if coef_pz is not None:
        coef = coef + coef_pz.unsqueeze(1) * log_q
    grad = torch.where(keep, torch.exp(log_q) * coef, 0.0)
    if coef_target is not None:
        on_shard = local_target >= 0
        grad.scatter_add_(1, local_target.clamp(min=0).unsqueeze(1),
                          torch.where(on_shard, coef_target, 0.0).unsqueeze(1))
    if inv_temperature != 1.0:
        grad.mul_(inv_temperature)
    logits[:, :num_valid_cols].copy_(grad)
    return logits


# ------------------------------------------------------------------------------ ties
def tie_id(logits: Tensor, rows: Tensor, num_valid_cols: int, inv_temperature: float,
           vocab_start: int, value: Tensor, position: Tensor) -> Tensor:
    """Global id of the `position`-th (1-based, in id order) column of each selected row whose z
    equals `value`; -1 where position is 0 or the shard holds fewer such columns."""
    n = rows.numel()
    out = torch.full((n,), -1, dtype=torch.int64, device=logits.device)
    if num_valid_cols == 0:
        return out
    for start in range(0, n, TIE_ROWS):  # a few rows at a time: int32 cumsums of whole rows
        block = slice(start, min(start + TIE_ROWS, n))
        z = scaled_fp32(logits.index_select(0, rows[block]), num_valid_cols, inv_temperature)
        tied = z == value[block].unsqueeze(1)
        hit = tied & (tied.cumsum(dim=1, dtype=torch.int32) == position[block].unsqueeze(1))
        found = hit.any(dim=1) & (position[block] > 0)
        out[block] = torch.where(found, vocab_start + hit.to(torch.int8).argmax(dim=1), -1)
    return out
