"""Replay's kept-set math in Triton: replay_torch.py's `kept_stats`, `entry_stats`,
`entry_dlogits` and `kept_grads` (same arguments, same results up to the order of fp32 sums and
exp's last bit; tests/test_sampling_mask_triton.py checks them against it, on CPU under
TRITON_INTERPRET=1).

No W[U] copy, no logits block, no per-tile host work: each kernel reads the kept ids from the
mask's CSR and gathers the weight rows itself.

- `_kept_stats_kernel`, one program per row with a set: its entries in blocks of BLOCK_E, each
  entry's dot h_row . W_id over H in blocks of BLOCK_H (fp32), rounded to the input dtype as the
  chunk GEMM's logits are, then an online max / sum exp / entropy sum over the blocks and the
  label's z; it writes each entry's z for the backward. With FROM_Z it reads the entries' z
  instead (`entry_stats`: the dense route, whose z come off its chunks of logits), or with GATHER
  reads them at the entries' places in the union tiles' products (and writes them). With FINISH
  (TP = 1, every row a slot: no merge follows) it also writes the row's log S, lse, entropy and
  log-prob, and a row without a set's placeholders and theirs: the tail launch's math
  (triton_math), the same bits, one launch and a fill fewer.
- `_entry_dlogits_kernel`, one program per block of entries: each entry's dlogit from its z, its
  row's merged max and log-sum-exp and the upstream coefficients (`entry_dlogits`), in fp32 or
  rounded to the dense route's GEMM dtype; a log-prob's upstream gradient gated by two row masks
  (labelled, label kept) where the caller passes them, and the result written into one or two
  blocks at the entries' places (the union tiles' products) instead of a vector.
- `_kept_input_grad_kernel`, one program per (row with a set, block of H): dX = sum_e d_e W_id.
- `_kept_weight_grad_kernel`: the entries sorted by column (one device sort, no host sync), one
  program per (block of sorted entries, block of H): d_e h_row for each entry, a segmented scan
  that sums the entries of one column, one fp32 atomic add per column and block into dW (the
  op's fp32 buffer or Megatron's main_grad). A frequent id (in most sets: Zipf) costs one add per
  block of its entries, not one per entry.
- `kept_layout`: replay.KeptEntries' fields and MaskCheck's device checks (replay.py's module doc)
  in two launches and a fill (the verdict recorded by the last of the entries' programs; where
  asked, the rows' labelled flags made from the labels and their range checked too), and
  where asked each column's count of valid entries (dW's column
  order: replay_union_triton.columns_by_use); `gather_chunk` / `scatter_chunk`: the dense route's
  entries of one chunk of logits in one launch each, `slot_rows` its block of dlogits (zeros and
  the entries) in one. These move values only (no arithmetic but z = fp32(logit) / T's one multiply, as torch's),
  so they give torch's results bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..deferred_errors import LABELS_OUT_OF_RANGE, SAMPLING_MASK_BAD, SAMPLING_MASK_NEW_EMPTY_SET
from . import ShardStats
from .triton_common import cached_launch, cdiv, interpreting as _interpreting, next_power_of_2
from .triton_gemm_stats import round_bf16_by_hand
from .triton_math import store_merged_tail

# Launch settings (module-level so that tests can shrink them; not a public API).
STATS_BLOCK_E = 32
STATS_BLOCK_H = 128
# dX (one program per set row and H block): wide entry blocks, fewer loop trips over a row's set;
# dW (a segmented sum and one atomic add per column and block): narrow blocks, a short scan and
# more programs. Swept on an H200 at 4096 x 4096 x 32064, K = 50: dX 1.35 -> 0.79 ms, dW 3.9 -> 1.8 ms
# against 32 x 128 for both.
DX_BLOCK_E = 64
DX_BLOCK_H = 128
DW_BLOCK_E = 16
DW_BLOCK_H = 64
WARPS = 4

_ROUND = {None: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _dots(h_ptr, stride_h, row, w_ptr, stride_w, col, valid, H, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 [BLOCK_E]: h_row . W_col of each entry (0 where not valid)."""
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        h_ok = hh < H
        x = tl.load(h_ptr + row * stride_h + hh, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col[:, None] * stride_w + hh[None, :], mask=valid[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


@cached_launch
@triton.jit
def _kept_stats_kernel(
    h_ptr, stride_h, w_ptr, stride_w, ids_ptr, set_rows_ptr, starts_ptr, ends_ptr, labels_ptr,
    z_ptr, max_ptr, sum_ptr, target_ptr, shifted_ptr, dest_ptr,
    log_sum_exp_ptr, lse_ptr, entropy_ptr, logprob_ptr, has_set_ptr, labelled_ptr, kept_ptr, poison_ptr,
    H, vocab_start, num_valid_cols, inv_temperature,
    ROUND: tl.constexpr, BF16_BY_HAND: tl.constexpr, WANT_ENTROPY: tl.constexpr, STORE_Z: tl.constexpr,
    TO_DEST: tl.constexpr, FROM_Z: tl.constexpr, GATHER: tl.constexpr, FINISH: tl.constexpr, LOGPROB: tl.constexpr,
    HAS_POISON: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    at = i
    if TO_DEST:  # the statistics go to the slot's row (replay_torch.into_columns)
        at = tl.load(dest_ptr + i)
    row = tl.load(set_rows_ptr + i)
    start = tl.load(starts_ptr + i)
    end = tl.load(ends_ptr + i)
    label = tl.load(labels_ptr + i)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    se = tl.zeros([], dtype=tl.float32)
    t = tl.zeros([], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < end
        ids = tl.load(ids_ptr + e, mask=inside, other=-1)
        col = ids - vocab_start
        valid = inside & (col >= 0) & (col < num_valid_cols)
        if GATHER:  # the union tiles' z: read at each entry's place in their products (w_ptr), and stored
            place = tl.load(w_ptr + e, mask=valid, other=0)
            z = tl.load(h_ptr + place, mask=valid, other=0.0).to(tl.float32) * inv_temperature
            tl.store(z_ptr + e, tl.where(valid, z, 0.0), mask=inside)
        elif FROM_Z:  # the dense route's z, read off its chunks of logits (entry_stats)
            z = tl.load(z_ptr + e, mask=valid, other=0.0)
        else:
            acc = _dots(h_ptr, stride_h, row, w_ptr, stride_w, col, valid, H, BLOCK_E, BLOCK_H)
            if BF16_BY_HAND:  # the interpreter's fp32 -> bf16 cast truncates
                acc = round_bf16_by_hand(acc)
            elif ROUND == 1:
                acc = acc.to(tl.bfloat16).to(tl.float32)
            elif ROUND == 2:
                acc = acc.to(tl.float16).to(tl.float32)
            z = acc * inv_temperature
            if STORE_Z:
                tl.store(z_ptr + e, tl.where(valid, z, 0.0), mask=inside)
        new_m = tl.maximum(m, tl.max(tl.where(valid, z, float("-inf")), axis=0))
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        rescale = tl.exp(m - safe)  # 0 while m is -inf
        shifted = tl.where(valid, z - safe, 0.0)
        p = tl.where(valid, tl.exp(shifted), 0.0)
        if WANT_ENTROPY:
            # sum exp(z - m')(z - m') = e^(m - m') (sum exp(z - m)(z - m) + (m - m') sum exp(z - m))
            moved = tl.where(m == float("-inf"), 0.0, m - safe)
            se = rescale * (se + moved * s) + tl.sum(p * shifted, axis=0)
        s = s * rescale + tl.sum(p, axis=0)
        t += tl.sum(tl.where(valid & (ids == label), z, 0.0), axis=0)
        m = new_m
    tl.store(max_ptr + at, m)
    tl.store(sum_ptr + at, s)
    tl.store(target_ptr + at, t)
    if WANT_ENTROPY:
        tl.store(shifted_ptr + at, se)
    if FINISH:  # (no merge follows: the tail launch's math here; every row is a slot, i a row too)
        store_merged_tail(at, at >= 0, m, s, se, t, log_sum_exp_ptr, lse_ptr, entropy_ptr, labelled_ptr, kept_ptr,
                          poison_ptr, logprob_ptr, WANT_ENTROPY, PRECISE, LOGPROB, True, True, HAS_POISON)
        if tl.load(has_set_ptr + i) == 0:  # row i has no set: the placeholders' (1 each) and their tail
            one = tl.full([], 1.0, tl.float32)
            tl.store(max_ptr + i, one)
            tl.store(sum_ptr + i, one)
            tl.store(target_ptr + i, one)
            if WANT_ENTROPY:
                tl.store(shifted_ptr + i, one)
            store_merged_tail(i, i >= 0, one, one, one, one, log_sum_exp_ptr, lse_ptr, entropy_ptr, labelled_ptr,
                              kept_ptr, poison_ptr, logprob_ptr, WANT_ENTROPY, PRECISE, LOGPROB, True, True,
                              HAS_POISON)


def kept_stats(rows: Tensor, weight: Tensor, entries, inv_temperature: float, round_to: Optional[torch.dtype],
               want_entropy: bool, want_z: bool, max_elements: int, into: Optional[Tensor] = None):
    """replay_torch.kept_stats in one launch (max_elements: unused, nothing is gathered); with
    `into`, the kernel writes each slot's statistics at its column set_dest there."""
    count = entries.set_rows.numel()
    f32 = dict(dtype=torch.float32, device=rows.device)
    fields = 4 if want_entropy else 3
    out = into if into is not None else torch.empty(fields, count, **f32)
    row_max, sum_exp, target = out[0], out[1], out[2]
    shifted = out[3] if want_entropy else row_max
    # (entries of positions without a labelled row are never visited)
    z = torch.zeros(entries.ids.numel(), **f32) if want_z else row_max
    if count:
        by_hand = _interpreting() and round_to is torch.bfloat16
        _kept_stats_kernel[(count,)](
            rows, rows.stride(0), weight, weight.stride(0), entries.ids, entries.set_rows, entries.starts,
            entries.ends, entries.set_labels, z, row_max, sum_exp, target, shifted, entries.set_dest,
            *(row_max,) * 8, rows.shape[1], entries.vocab_start, entries.num_valid_cols, float(inv_temperature),
            ROUND=_ROUND.get(round_to, 0), BF16_BY_HAND=by_hand, WANT_ENTROPY=want_entropy, STORE_Z=want_z,
            TO_DEST=into is not None, FROM_Z=False, GATHER=False, FINISH=False, LOGPROB=False, HAS_POISON=False,
            PRECISE=False, BLOCK_E=STATS_BLOCK_E, BLOCK_H=STATS_BLOCK_H, num_warps=WARPS)
    stats = None if into is not None else ShardStats(max=row_max, sum_exp=sum_exp, target=target,
                                                     sum_exp_shifted=shifted if want_entropy else None)
    return stats, z if want_z else None


def entry_stats(z: Tensor, entries, want_entropy: bool, into: Optional[Tensor] = None, *,
                gather: Optional[tuple] = None, finish: Optional[tuple] = None) -> Optional[ShardStats]:
    """replay_torch.entry_stats (the dense route's statistics from the entries' z) in one launch:
    the kept-stats kernel reading z instead of taking dots; with `into`, written at set_dest; with
    `gather`, z read at the entries' places first (and stored), in the same launch; with `finish`,
    the tail too, in the same launch (replay_torch.entry_stats says what)."""
    count = entries.set_rows.numel()
    out = into if into is not None else torch.empty(4 if want_entropy else 3, count, dtype=torch.float32,
                                                    device=z.device)
    row_max, sum_exp, target = out[0], out[1], out[2]
    shifted = out[3] if want_entropy else row_max
    if finish is not None and (into is None or count != entries.labelled.numel()):
        raise ValueError("entry_stats: finish needs `into` and a slot for every row")
    if count:
        values, place, inv_temperature = gather if gather is not None else (z, z, 1.0)
        tail_args, logprob_of = (row_max,) * 8, None
        if finish is not None:
            tail, logprob_of = finish
            labelled, kept, poison = logprob_of if logprob_of is not None else (entries.has_set,) * 2 + (None,)
            tail_args = (*tail[:4], entries.has_set.view(torch.uint8), labelled.view(torch.uint8),
                         kept.view(torch.uint8), row_max if poison is None else poison)
        _kept_stats_kernel[(count,)](
            values, 0, place, 0, entries.ids, entries.set_rows, entries.starts, entries.ends, entries.set_labels, z,
            row_max, sum_exp, target, shifted, entries.set_dest, *tail_args, 0, entries.vocab_start,
            entries.num_valid_cols, float(inv_temperature), ROUND=0, BF16_BY_HAND=False, WANT_ENTROPY=want_entropy,
            STORE_Z=False, TO_DEST=into is not None, FROM_Z=True, GATHER=gather is not None,
            FINISH=finish is not None, LOGPROB=logprob_of is not None,
            HAS_POISON=logprob_of is not None and logprob_of[2] is not None, PRECISE=not _interpreting(),
            BLOCK_E=STATS_BLOCK_E, BLOCK_H=STATS_BLOCK_H, num_warps=WARPS)
    if into is not None:
        return None
    return ShardStats(max=row_max, sum_exp=sum_exp, target=target, sum_exp_shifted=shifted if want_entropy else None)


# The backward's dlogits of every entry from the forward's z (replay_torch.entry_dlogits).
DLOGITS_BLOCK = 1024


@cached_launch
@triton.jit
def _entry_dlogits_kernel(z_ptr, row_of_ptr, valid_ptr, is_label_ptr, max_ptr, lse_ptr, p_ptr, pz_ptr, target_ptr,
                          gate_a_ptr, gate_b_ptr, d_ptr, place_a_ptr, place_b_ptr, block_b_ptr,
                          total, stride_max, stride_lse, stride_p, stride_pz, stride_target, inv_temperature,
                          HAS_P: tl.constexpr, HAS_PZ: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_GATE: tl.constexpr,
                          INTO: tl.constexpr, SCALE: tl.constexpr, BF16_BY_HAND: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = e < total
    row = tl.load(row_of_ptr + e, mask=inside, other=0)
    valid = inside & (tl.load(valid_ptr + e, mask=inside, other=0) != 0)
    z = tl.load(z_ptr + e, mask=valid, other=0.0)
    # (the same operations in the same order as the torch definition)
    log_q = (z - tl.load(max_ptr + row * stride_max, mask=valid, other=0.0)) - tl.load(
        lse_ptr + row * stride_lse, mask=valid, other=0.0)
    if HAS_TARGET:
        target = tl.load(target_ptr + row * stride_target, mask=valid, other=0.0).to(tl.float32)
        if HAS_GATE:
            open_row = (tl.load(gate_a_ptr + row, mask=valid, other=0) != 0) & (
                tl.load(gate_b_ptr + row, mask=valid, other=0) != 0)
            target = tl.where(open_row, target, 0.0)
    if HAS_P:
        coef = tl.load(p_ptr + row * stride_p, mask=valid, other=0.0).to(tl.float32)
    else:
        coef = -target
    if HAS_PZ:
        coef = coef + tl.load(pz_ptr + row * stride_pz, mask=valid, other=0.0).to(tl.float32) * log_q
    grad = tl.where(valid, tl.exp(log_q) * coef, 0.0)
    if HAS_TARGET:
        hit = valid & (tl.load(is_label_ptr + e, mask=inside, other=0) != 0)
        grad = grad + tl.where(hit, target, 0.0)
    if SCALE:
        grad = grad * inv_temperature
    if BF16_BY_HAND:  # the interpreter's fp32 -> bf16 cast truncates
        grad = round_bf16_by_hand(grad)
    grad = grad.to(d_ptr.dtype.element_ty)
    if INTO == 0:
        tl.store(d_ptr + e, grad, mask=inside)
    else:  # each entry at its place in one or two blocks (d_ptr the first), none where the place is -1
        place = tl.load(place_a_ptr + e, mask=inside, other=-1)
        tl.store(d_ptr + place, grad, mask=place >= 0)
        if INTO == 2:
            place = tl.load(place_b_ptr + e, mask=inside, other=-1)
            tl.store(block_b_ptr + place, grad, mask=place >= 0)


def entry_dlogits(z: Tensor, entries, inv_temperature: float, row_max: Tensor, log_sum_exp: Tensor,
                  coef_p: Optional[Tensor], coef_pz: Optional[Tensor], coef_target: Optional[Tensor],
                  dtype: torch.dtype = torch.float32, *, gate: tuple = (), into: tuple = ()) -> Optional[Tensor]:
    """replay_torch.entry_dlogits in one launch (`dtype`: the result's, rounded from fp32); with
    `into`, the dlogits written straight into those blocks (at most two, of one dtype)."""
    total = entries.ids.numel()
    if len(gate) not in (0, 2) or len(into) > 2 or len({block.dtype for _, block in into}) > 1 or (
            coef_p is None and coef_target is None):
        raise ValueError("entry_dlogits: two gates or none, at most two blocks of one dtype, coef_p or coef_target")
    d = torch.empty(total, dtype=dtype, device=z.device) if not into else into[0][1]
    if total:
        # (a coefficient may be an expanded scalar: its stride is 0)
        per_row = [t if t is not None else row_max for t in (row_max, log_sum_exp, coef_p, coef_pz, coef_target)]
        gates = [g.view(torch.uint8) for g in gate] or [entries.valid.view(torch.uint8)] * 2
        # (where fewer blocks are given, the kernel does not read the pointers standing for the others)
        (place_a, _), (place_b, block_b) = (tuple(into) + ((entries.col, d),) * 2)[:2]
        _entry_dlogits_kernel[(cdiv(total, DLOGITS_BLOCK),)](
            z, entries.row_of_entry(), entries.valid.view(torch.uint8), entries.is_label.view(torch.uint8), *per_row,
            *gates, d, place_a, place_b, block_b, total, *(t.stride(0) for t in per_row), float(inv_temperature),
            HAS_P=coef_p is not None, HAS_PZ=coef_pz is not None, HAS_TARGET=coef_target is not None,
            HAS_GATE=bool(gate), INTO=len(into), SCALE=inv_temperature != 1.0,
            BF16_BY_HAND=_interpreting() and d.dtype == torch.bfloat16, BLOCK=DLOGITS_BLOCK, num_warps=4)
    return None if into else d


@cached_launch
@triton.jit
def _kept_input_grad_kernel(
    w_ptr, stride_w, ids_ptr, set_rows_ptr, starts_ptr, ends_ptr, d_ptr, dx_ptr, stride_dx,
    H, vocab_start, num_valid_cols, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    row = tl.load(set_rows_ptr + i)
    start = tl.load(starts_ptr + i)
    end = tl.load(ends_ptr + i)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < end
        col = tl.load(ids_ptr + e, mask=inside, other=-1) - vocab_start
        valid = inside & (col >= 0) & (col < num_valid_cols)
        d = tl.load(d_ptr + e, mask=valid, other=0.0)
        w = tl.load(w_ptr + col[:, None] * stride_w + hh[None, :], mask=valid[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * d[:, None], axis=0)
    # added: the plain pass left zeros in a set row; padding slots add zeros to a row without a set
    at = dx_ptr + row * stride_dx + hh
    old = tl.load(at, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(at, (old + acc).to(dx_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _segmented_sum(a_value, a_start, b_value, b_start):
    """Scan step of a sum that restarts where b starts a segment."""
    return tl.where(b_start != 0, b_value, a_value + b_value), a_start | b_start


@cached_launch
@triton.jit
def _kept_weight_grad_kernel(
    h_ptr, stride_h, cols_ptr, order_ptr, rows_ptr, d_ptr, dw_ptr, stride_dw, num_entries, H, num_cols,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    inside = e < num_entries
    col = tl.load(cols_ptr + e, mask=inside, other=num_cols)  # sorted; num_cols: not a column here
    previous = tl.load(cols_ptr + e - 1, mask=inside & (e > tl.program_id(0) * BLOCK_E), other=-1)
    following = tl.load(cols_ptr + e + 1, mask=(e + 1 < num_entries) & (tl.arange(0, BLOCK_E) + 1 < BLOCK_E),
                        other=-1)
    used = inside & (col < num_cols)
    entry = tl.load(order_ptr + e, mask=used, other=0)  # (rows and d in entry order: no permuted copies)
    row = tl.load(rows_ptr + entry, mask=used, other=0)
    d = tl.load(d_ptr + entry, mask=used, other=0.0)
    x = tl.load(h_ptr + row[:, None] * stride_h + hh[None, :], mask=used[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)
    starts = tl.broadcast_to((col != previous).to(tl.int32)[:, None], (BLOCK_E, BLOCK_H))
    sums, _ = tl.associative_scan((x * d[:, None], starts), 0, _segmented_sum)
    last = used & (col != following)  # a column's last entry in this block holds its sum
    tl.atomic_add(dw_ptr + col[:, None] * stride_dw + hh[None, :], sums, mask=last[:, None] & h_ok[None, :])


def kept_grads(rows: Tensor, weight: Tensor, entries, d: Tensor, dx_rows: Optional[Tensor], dw_out: Optional[Tensor],
               max_elements: int) -> None:
    """replay_torch.kept_grads: dX rows of the set rows added, dW rows added into the fp32
    dw_out (max_elements: unused)."""
    count, hidden = entries.set_rows.numel(), rows.shape[1]
    d = d.contiguous()
    if dx_rows is not None and count:
        _kept_input_grad_kernel[(count, cdiv(hidden, DX_BLOCK_H))](
            weight, weight.stride(0), entries.ids, entries.set_rows, entries.starts, entries.ends, d, dx_rows,
            dx_rows.stride(0), hidden, entries.vocab_start, entries.num_valid_cols,
            BLOCK_E=DX_BLOCK_E, BLOCK_H=DX_BLOCK_H, num_warps=WARPS)
    total = entries.ids.numel()
    if dw_out is not None and count and total:
        num_cols = weight.shape[0]
        # the layout kernel's key where it made one for this shard's width, else the same here
        key = (entries.dw_key if getattr(entries, "dw_key_cols", None) == num_cols
               else torch.where(entries.valid, entries.col, num_cols))
        cols, order = torch.sort(key)
        _kept_weight_grad_kernel[(cdiv(total, DW_BLOCK_E), cdiv(hidden, DW_BLOCK_H))](
            rows, rows.stride(0), cols, order, entries.row_of_entry(), d, dw_out, dw_out.stride(0), total, hidden,
            num_cols,
            BLOCK_E=DW_BLOCK_E, BLOCK_H=DW_BLOCK_H, num_warps=WARPS)


# ---------------------------------------------------------------------------------------------
# The mask's layout and checks (replay.KeptEntries, replay.MaskCheck: the torch definitions are
# the reference): two launches and a fill instead of some eighty elementwise ops.
# ---------------------------------------------------------------------------------------------
LAYOUT_BLOCK_E = 64
# The rows' scan (one program, a carry from block to block): blocks of ROWS_SCAN_BLOCK positions.
# On an H200 (Zipf sets of 50 ids): 2048 by 8 warps 51 -> 36 us at 8192 rows, 112 -> 75 at 16384
# against 1024 by 4; 4096 or 8192 by 8-32 warps were slower (each block's reductions and scans
# wait on the one before). A block's two running maxima in one scan and its eight totals in one
# reduction (each had its own): 11.2 -> 9.7 us at 2048 rows, 40.9 -> 34.9 at 8192, 80.4 -> 68.1 at
# 16384; with the fingerprint (TP > 1) 10.4 -> 8.4, 35.6 -> 27.6, 70.7 -> 55.1 (the same outputs);
# 2048 by 8 warps still the fastest of 512-4096 by 2-16 at 2048-16384 rows.
# (Under the interpreter, blocks of 64: it reduces and scans lane by lane in Python, masked lanes
# too, so that 2048 lanes for a test's few dozen rows were most of a replay test's time.)
ROWS_SCAN_BLOCK = 64 if _interpreting() else 2048
ROWS_SCAN_WARPS = 8
# The scan and the block's reduction in int32 where the mask holds fewer than 2^31 ids (the offsets
# clamped into [0, E] first; int64 otherwise): on an H200, Zipf sets of 50 ids, 9.3 -> 5.1 us at
# 2048 rows, 35.3 -> 18.0 at 8192, 84.5 -> 37.0 at 16384 (the same outputs).
NARROW_SCAN = True
# A set is checked for duplicates by a sort in its program where it holds at most the sort's block of
# ids: the power of 2 at or above the call's mean set size, at most LAYOUT_SORT_BLOCK; a larger set
# by a hash table. On an H200, 8192 sets of 512 ids: the layout 267 us sorting by 512, 594 by 1024,
# 604 by hash tables, about 600 with the call's keys sorted by torch. (The interpreter runs a sort
# network's steps one by one, about a second a program at 1024: hash tables only there, but where a
# test sets a block.)
LAYOUT_SORT_BLOCK = 1 if _interpreting() else 1024
# counts: bad offsets, bad ids, duplicates, labelled rows with a (raw) set, without one, rows with a
# (layout) set, labelled rows without one, the first row without a set, set_rows[0], the mask's
# fingerprint (agreement.tensor_fingerprint of cat([offsets, ids])), two sums, and the labelled rows
# whose label lies outside [0, vocab) where the layout checks the labels (kept_layout without
# `labelled`)
_COUNTS = 12


@triton.jit
def fingerprint_terms(values, index, inside, FOLD: tl.constexpr):
    """agreement.tensor_fingerprint's two terms of int64 values at flat positions `index`, summed
    where `inside` (2^31 - 1: its _MASK; 2654435761: its _SCRAMBLE); FOLD: values of 64 bits, whose
    high 33 bits are folded in (narrower ones arrive sign-extended, as torch's `.to(int64)`)."""
    if FOLD:
        values = values ^ (values >> 31)
    bits = values & 2147483647
    weight = (2 * index + 1) & 2147483647
    scramble = ((index * tl.full(index.shape, 2654435761, tl.int64)) | 1) & 2147483647
    by_position = tl.sum(tl.where(inside, (bits * weight) & 2147483647, 0), axis=0)
    by_hash = tl.sum(tl.where(inside, (bits * scramble) & 2147483647, 0), axis=0)
    return by_position, by_hash


@triton.jit
def _running_max_pair(end_a, start_a, end_b, start_b):
    return tl.maximum(end_a, end_b), tl.maximum(start_a, start_b)


@triton.jit
def _block_totals(bad_a, with_a, without_a, missing_a, count_a, plain_a, set_a, top_a,
                  bad_b, with_b, without_b, missing_b, count_b, plain_b, set_b, top_b):
    return (bad_a + bad_b, with_a + with_b, without_a + without_b, missing_a + missing_b, count_a + count_b,
            tl.minimum(plain_a, plain_b), tl.minimum(set_a, set_b), tl.maximum(top_a, top_b))


@cached_launch
@triton.jit
def _mask_rows_kernel(offsets_ptr, labelled_ptr, layout_ptr, has_set_ptr, rank_ptr, counts_ptr, rows, total,
                      labels_ptr, ignore_index, FINGERPRINT: tl.constexpr, BLOCK: tl.constexpr,
                      NARROW: tl.constexpr = False, LABELS: tl.constexpr = False):
    """One program over the positions in blocks (a scan: the layout offsets are a running max).
    A block's two running maxima are one scan and its eight totals one reduction: each pass is a
    round of the block's warps through shared memory, which the next block waits for. LABELS: a
    row is labelled where its label is not ignore_index (label_targets' definition), read off the
    labels here (the entries' launch writes the flags and checks the labels' range)."""
    first = tl.load(offsets_ptr)
    bad = (first != 0).to(tl.int64)
    tl.store(layout_ptr, first * 0)
    carry = first * 0  # the layout offsets' running max (the first is 0)
    count = first * 0
    with_set = first * 0
    without_set = first * 0
    missing = first * 0
    first_plain = first * 0 + rows
    first_set = first * 0 + rows
    by_position = first * 0
    by_hash = first * 0
    if FINGERPRINT:  # the offsets' fingerprint terms
        for b in range(0, rows + 1, BLOCK):
            j = b + tl.arange(0, BLOCK).to(tl.int64)
            inside = j <= rows
            position_terms, hash_terms = fingerprint_terms(tl.load(offsets_ptr + j, mask=inside, other=0), j,
                                                           inside, True)
            by_position += position_terms
            by_hash += hash_terms
    for b in range(1, rows + 1, BLOCK):
        j = b + tl.arange(0, BLOCK)
        inside = j <= rows
        raw = tl.load(offsets_ptr + j, mask=inside, other=0)
        before = tl.load(offsets_ptr + j - 1, mask=inside, other=0)
        # clamped into [0, E], the last one E; L[j] its running max, L[j - 1] the one before
        clamped = tl.where(j == rows, total, tl.minimum(tl.maximum(raw, 0), total))
        clamped_before = tl.where(j == 1, 0, tl.minimum(tl.maximum(before, 0), total))
        if NARROW:  # (in [0, total], which int32 holds: the scan and the reduction at half the width)
            clamped, clamped_before = clamped.to(tl.int32), clamped_before.to(tl.int32)
        end, start = tl.associative_scan((tl.where(inside, clamped, 0), tl.where(inside, clamped_before, 0)), 0,
                                         _running_max_pair)
        end = tl.maximum(end, carry)
        start = tl.maximum(start, carry)
        r = j - 1
        if LABELS:
            labelled = inside & (tl.load(labels_ptr + r, mask=inside, other=ignore_index) != ignore_index)
        else:
            labelled = inside & (tl.load(labelled_ptr + r, mask=inside, other=0) != 0)
        has = labelled & (end > start)
        has32 = has.to(tl.int32)
        tl.store(layout_ptr + j, end, mask=inside)
        tl.store(has_set_ptr + r, has.to(tl.uint8), mask=inside)
        tl.store(rank_ptr + r, count + (tl.cumsum(has32, 0) - has32).to(tl.int64), mask=inside)
        block_bad, block_with, block_without, block_missing, block_count, block_plain, block_set, block_top = \
            tl.reduce(((inside & (raw < before)).to(tl.int32), (labelled & (raw > before)).to(tl.int32),
                       (labelled & (raw <= before)).to(tl.int32), (labelled & (end <= start)).to(tl.int32), has32,
                       tl.where(inside & ~has, r, rows), tl.where(has, r, rows), tl.where(inside, clamped, 0)),
                      0, _block_totals)
        bad += block_bad.to(tl.int64)
        with_set += block_with.to(tl.int64)
        without_set += block_without.to(tl.int64)
        missing += block_missing.to(tl.int64)
        count += block_count.to(tl.int64)
        first_plain = tl.minimum(first_plain, block_plain)
        first_set = tl.minimum(first_set, block_set)
        carry = tl.maximum(carry, block_top)
    bad += (tl.load(offsets_ptr + rows) != total).to(tl.int64)
    tl.store(layout_ptr + rows + 1, first * 0 + total)  # the spare position's (empty) set
    first_plain = tl.where(first_plain == rows, 0, first_plain)  # (none: padding needs none)
    tl.store(counts_ptr + 0, bad)
    tl.store(counts_ptr + 1, first * 0)
    tl.store(counts_ptr + 2, first * 0)
    tl.store(counts_ptr + 3, with_set)
    tl.store(counts_ptr + 4, without_set)
    tl.store(counts_ptr + 5, count)
    tl.store(counts_ptr + 6, missing)
    tl.store(counts_ptr + 7, first_plain)
    tl.store(counts_ptr + 8, tl.where(count > 0, first_set, first_plain))
    tl.store(counts_ptr + 9, by_position)  # (the entries kernel adds the ids')
    tl.store(counts_ptr + 10, by_hash)
    tl.store(counts_ptr + 11, first * 0)


@cached_launch
@triton.jit
def _mask_entries_kernel(ids_ptr, layout_ptr, has_set_ptr, rank_ptr, labels_ptr, counts_ptr,
                         set_dest_ptr, set_rows_ptr, starts_ptr, ends_ptr, set_labels_ptr, kept_ptr,
                         slot_ptr, col_ptr, position_ptr, row_of_ptr, table_ptr, dw_key_ptr, place_ptr, row_place_ptr,
                         valid_ptr, is_label_ptr, use_ptr, ticket_ptr, flags_ptr, poison_ptr, base_ptr,
                         rows, total, max_set_rows, vocab, vocab_start, num_valid_cols, num_cols, labelled_ptr,
                         ignore_index, FINGERPRINT: tl.constexpr, COUNT_USE: tl.constexpr, BLOCK_E: tl.constexpr,
                         SORT_BLOCK: tl.constexpr, VERDICT: tl.constexpr, BAD_FLAG: tl.constexpr,
                         MISSING_FLAG: tl.constexpr, LABELS_FLAG: tl.constexpr, CHECK_MISSING: tl.constexpr,
                         HAS_BASE: tl.constexpr, LABELS: tl.constexpr):
    """One program per row: its slot (or a padding slot), and its entries over its layout range.
    An id twice in the row's set: a set of at most SORT_BLOCK ids is sorted in the program (equal
    neighbours); a larger one is inserted into the row's own hash table (`table_ptr`, int32, 0
    where empty, an id stored as id + 1: 2 slots per entry at 2 x the row's layout start, open
    addressing), where an insert that finds its id already there is a duplicate. No sort of the
    call's entries. COUNT_USE: each column's valid entries counted into `use_ptr` (int32, zeros).
    VERDICT: the last program to finish (`ticket_ptr`, int32, zero) records the mask's verdict
    from every program's counts (`_record_verdict`): no launch of its own. LABELS: each row's
    labelled flag written to `labelled_ptr` (label_targets' definition, as the rows' launch read
    it) and a labelled row's label outside [0, vocab) counted (counts[11]) for the verdict."""
    r = tl.program_id(0).to(tl.int64)
    lo = tl.load(layout_ptr + r)
    hi = tl.load(layout_ptr + r + 1)
    has = tl.load(has_set_ptr + r) != 0
    rank = tl.load(rank_ptr + r)
    label = tl.load(labels_ptr + r)
    if LABELS:
        labelled = label != ignore_index
        tl.store(labelled_ptr + r, labelled.to(tl.uint8))
        tl.atomic_add(counts_ptr + 11, r * 0 + 1, mask=labelled & ((label < 0) | (label >= vocab)))
    count = tl.load(counts_ptr + 5)
    row0 = tl.load(counts_ptr + 8)
    tl.store(set_dest_ptr + rank, r, mask=has)
    tl.store(set_rows_ptr + rank, r, mask=has)
    tl.store(starts_ptr + rank, lo, mask=has)
    tl.store(ends_ptr + rank, hi, mask=has)
    tl.store(set_labels_ptr + rank, label, mask=has)
    # the slots past the set rows, one per row without a set while they last: padding
    pad = count + (r - rank)
    is_pad = (~has) & (pad < max_set_rows)
    tl.store(set_dest_ptr + pad, r * 0 + rows, mask=is_pad)
    tl.store(set_rows_ptr + pad, tl.load(counts_ptr + 7), mask=is_pad)
    tl.store(starts_ptr + pad, r * 0 + total, mask=is_pad)
    tl.store(ends_ptr + pad, r * 0 + total, mask=is_pad)
    tl.store(set_labels_ptr + pad, r * 0 - 1, mask=is_pad)
    slot = tl.where(has, rank, -1)
    row_of = tl.where(has, r, row0)
    found = r * 0
    bad_ids = r * 0
    duplicates = r * 0
    by_position = r * 0
    by_hash = r * 0
    for e0 in range(lo, hi, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        inside = e < hi
        ids = tl.load(ids_ptr + e, mask=inside, other=0)
        col = ids - vocab_start
        valid = has & (col >= 0) & (col < num_valid_cols)
        hit = inside & has & (ids == label)
        tl.store(slot_ptr + e, slot + e * 0, mask=inside)
        tl.store(col_ptr + e, col, mask=inside)
        tl.store(position_ptr + e, r + e * 0, mask=inside)
        tl.store(row_of_ptr + e, row_of + e * 0, mask=inside)
        tl.store(dw_key_ptr + e, tl.where(valid, col, num_cols), mask=inside)
        tl.store(place_ptr + e, tl.where(valid, slot * num_cols + col, -1), mask=inside)
        tl.store(row_place_ptr + e, tl.where(valid, r * num_cols + col, -1), mask=inside)
        tl.store(valid_ptr + e, valid.to(tl.uint8), mask=inside)
        tl.store(is_label_ptr + e, (hit & valid).to(tl.uint8), mask=inside)
        if COUNT_USE:  # (its mask a comparison: the interpreter refuses an atomic's mask and-ed with a scalar)
            named = tl.where(inside & valid, col, -1)
            tl.atomic_add(use_ptr + named, tl.full([BLOCK_E], 1, tl.int32), mask=named >= 0, sem="relaxed")
        found += tl.sum(hit.to(tl.int64), axis=0)
        bad_ids += tl.sum((inside & ((ids < 0) | (ids >= vocab))).to(tl.int64), axis=0)
        if FINGERPRINT:  # the ids follow the offsets in the fingerprinted vector
            position_terms, hash_terms = fingerprint_terms(ids, rows + 1 + e, inside, True)
            by_position += position_terms
            by_hash += hash_terms
    # (ids out of range count as their clamped neighbour, as MaskCheck's keys do)
    if hi - lo <= SORT_BLOCK:
        j = tl.arange(0, SORT_BLOCK)
        inside = j < hi - lo
        ids = tl.load(ids_ptr + lo + j, mask=inside, other=0)
        key = tl.where(inside, tl.minimum(tl.maximum(ids, 0), vocab - 1), vocab + j).to(tl.int32)  # (distinct past n)
        ordered = tl.sort(key, 0)
        following = tl.gather(ordered, tl.minimum(j + 1, SORT_BLOCK - 1), 0)
        duplicates = tl.sum(((j + 1 < SORT_BLOCK) & (ordered == following)).to(tl.int64), axis=0)
    else:
        table = table_ptr + 2 * lo
        size = 2 * (hi - lo)
        for e0 in range(lo, hi, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            inside = e < hi
            key = tl.minimum(tl.maximum(tl.load(ids_ptr + e, mask=inside, other=0), 0), vocab - 1).to(tl.int32)
            # (a lane that is done, or outside the set, swaps its key for itself: no change;
            # tl.atomic_cas has no mask)
            probe = tl.where(inside, ((key.to(tl.int64) * 2654435761) & 2147483647) % size, (e - lo) % size)
            key = key + 1  # (0: empty)
            pending = inside
            while tl.sum(pending.to(tl.int32), axis=0) > 0:
                before = tl.atomic_cas(table + probe, tl.where(pending, 0, key), key)
                duplicates += tl.sum((pending & (before == key)).to(tl.int64), axis=0)
                pending = pending & (before != 0) & (before != key)
                probe = tl.where(pending, (probe + 1) % size, probe)
    tl.store(kept_ptr + r, ((~has) | (found > 0)).to(tl.uint8))
    tl.atomic_add(counts_ptr + 1, bad_ids, mask=bad_ids > 0)
    tl.atomic_add(counts_ptr + 2, duplicates, mask=duplicates > 0)
    if FINGERPRINT:
        tl.atomic_add(counts_ptr + 9, by_position, mask=hi > lo)
        tl.atomic_add(counts_ptr + 10, by_hash, mask=hi > lo)
    if VERDICT:  # (the ticket's acquire orders every earlier program's counts before the reads)
        if tl.atomic_add(ticket_ptr, 1) == rows - 1:
            _record_verdict(counts_ptr, flags_ptr, poison_ptr, base_ptr, BAD_FLAG, MISSING_FLAG, LABELS_FLAG,
                            CHECK_MISSING, HAS_BASE)


@triton.jit
def _record_verdict(counts_ptr, flags_ptr, poison_ptr, base_ptr, BAD_FLAG: tl.constexpr, MISSING_FLAG: tl.constexpr,
                    LABELS_FLAG: tl.constexpr, CHECK_MISSING: tl.constexpr, HAS_BASE: tl.constexpr):
    """deferred_errors' flags and the call's fp32 poison from the counts (plus the labels' poison
    where the label kernel checked them, or their flag where this launch did).
    The counts read by atomics: other programs of the same launch added to them (a plain load
    could return a line this program's cache held from before)."""
    bad = (tl.atomic_add(counts_ptr + 0, 0) + tl.atomic_add(counts_ptr + 1, 0) + tl.atomic_add(counts_ptr + 2, 0)) > 0
    flags = tl.where(bad, BAD_FLAG, 0).to(tl.int64)
    flags = flags | tl.where(tl.atomic_add(counts_ptr + 11, 0) > 0, LABELS_FLAG, 0).to(tl.int64)
    if CHECK_MISSING:
        missing = tl.atomic_add(counts_ptr + 6, 0) > 0
        flags = flags | tl.where(missing, MISSING_FLAG, 0).to(tl.int64)
    tl.store(flags_ptr, tl.load(flags_ptr) | flags)
    poison = tl.where(flags != 0, float("nan"), 0.0)
    if HAS_BASE:  # (base + 0 is base, base + NaN is NaN: torch's sum)
        poison = tl.load(base_ptr) + poison
    tl.store(poison_ptr, poison)


def kept_layout(ids: Tensor, offsets: Tensor, labels: Tensor, labelled: Optional[Tensor], vocab_start: int,
                num_valid_cols: int, max_set_rows: int, vocab: int, num_cols: int, flags: Optional[Tensor],
                check_missing: bool, fingerprint: bool = False, base_poison: Optional[Tensor] = None,
                count_use: bool = False, ignore_index: Optional[int] = None) -> dict:
    """replay.KeptEntries' fields from the mask's raw offsets (the layout offsets made here, as
    MaskCheck.layout_offsets makes them), the counts of MaskCheck's device checks, and with
    `flags` (deferred_errors' word) the verdict recorded there and a fp32 [1] poison; `dw_key`,
    kept_grads' sort key of the entries over a shard of `num_cols` columns; `chunk_place` /
    `row_place`, the dense route's place of each entry in the [slots, num_cols] / [rows,
    num_cols] logits, and its kernels; with
    `fingerprint`, counts[9:11] are MaskCheck.fingerprint()'s; `base_poison` (fp32 [1]) is added
    into the poison; with `count_use`, `column_use` (int32 [num_cols]): how many valid entries name
    each column (replay_union_triton.columns_by_use's counts, counted here while the entries are
    read). With `labelled` None, the rows' launch makes it from the labels and `ignore_index`
    (label_targets' definition; `labelled` among the fields) and checks them: a labelled row's
    label outside [0, vocab) records deferred_errors' LABELS_OUT_OF_RANGE with the verdict (which
    `flags` must then hold) and poisons the call, as the label kernel's check does."""
    device = ids.device
    total, rows = ids.numel(), offsets.numel() - 1
    ids, offsets, labels = ids.contiguous(), offsets.contiguous(), labels.reshape(-1).contiguous()
    m = max_set_rows
    # four allocations (the int64 fields, the zeroed int32 ones, the bool ones, the poison), each cut
    # by one split: a view op apiece is host time at every call
    words = torch.empty(_COUNTS + 2 * rows + 2 + 5 * m + 7 * total, dtype=torch.int64, device=device)
    (counts, layout, rank, set_dest, set_rows, starts, ends, set_labels, slot, col, position, row_of, dw_key, place,
     row_place) = words.split((_COUNTS, rows + 2, rows) + (m,) * 5 + (total,) * 7)
    # each row's duplicate check, then the columns' use, then the verdict's ticket
    use_cols = num_cols if count_use else 0
    table = torch.zeros(2 * total + use_cols + 1, dtype=torch.int32, device=device)
    column_use, ticket = table.split((2 * total, use_cols, 1))[1:]
    check_labels = labelled is None
    if check_labels and (flags is None or ignore_index is None):
        raise ValueError("kept_layout: labels checked here need the flags word and ignore_index")
    has_set, kept, valid, is_label, made_labelled = torch.empty(
        (3 if check_labels else 2) * rows + 2 * total, dtype=torch.uint8, device=device).split(
        (rows, rows, total, total, rows if check_labels else 0))
    labelled = made_labelled if check_labels else labelled.view(torch.uint8)
    poison = None if flags is None else torch.empty(1, dtype=torch.float32, device=device)
    ignored = int(ignore_index if check_labels else 0)
    _mask_rows_kernel[(1,)](offsets, labelled, layout, has_set, rank, counts, rows, total, labels, ignored,
                            FINGERPRINT=fingerprint, BLOCK=ROWS_SCAN_BLOCK, NARROW=NARROW_SCAN and total < 2**31,
                            LABELS=check_labels, num_warps=ROWS_SCAN_WARPS)
    # (the verdict by the entries' last program: a mask has at least one position, replay_tiling's)
    _mask_entries_kernel[(rows,)](ids, layout, has_set, rank, labels, counts, set_dest, set_rows, starts, ends,
                                  set_labels, kept, slot, col, position, row_of, table, dw_key, place, row_place, valid,
                                  is_label, column_use, ticket, counts if flags is None else flags,
                                  counts if poison is None else poison,
                                  counts if base_poison is None else base_poison,
                                  rows,
                                  total, m, int(vocab), int(vocab_start), int(num_valid_cols), int(num_cols),
                                  labelled, ignored,
                                  FINGERPRINT=fingerprint, COUNT_USE=count_use, BLOCK_E=LAYOUT_BLOCK_E,
                                  SORT_BLOCK=min(LAYOUT_SORT_BLOCK, next_power_of_2(-(-total // max(rows, 1)))),
                                  VERDICT=flags is not None, BAD_FLAG=SAMPLING_MASK_BAD,
                                  MISSING_FLAG=SAMPLING_MASK_NEW_EMPTY_SET, LABELS_FLAG=LABELS_OUT_OF_RANGE,
                                  CHECK_MISSING=check_missing,
                                  HAS_BASE=base_poison is not None, LABELS=check_labels, num_warps=2)
    return dict(offsets=layout, has_set=has_set.view(torch.bool), set_dest=set_dest, set_rows=set_rows,
                starts=starts, ends=ends, set_labels=set_labels, kept=kept.view(torch.bool), slot=slot, col=col,
                position=position, row_of_entry=row_of, fingerprint=counts[9:11] if fingerprint else None,
                valid=valid.view(torch.bool), is_label=is_label.view(torch.bool),
                dw_key=dw_key, dw_key_cols=int(num_cols), chunk_place=(int(num_cols), place),
                row_place=(int(num_cols), row_place), counts=counts,
                column_use=column_use if count_use else None, poison=poison,
                chunk_kernels=(gather_chunk, scatter_chunk, slot_rows),
                **({"labelled": made_labelled.view(torch.bool)} if check_labels else {}))


# The dense route's entries of one chunk of slots: their places in its block of logits, one launch
# (replay.KeptEntries.gather_chunk / scatter_chunk define them in torch).
CHUNK_BLOCK = 1024


@cached_launch
@triton.jit
def _gather_chunk_kernel(place_ptr, logits_ptr, z_ptr, total, lo, hi, inv_temperature, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    place = tl.load(place_ptr + e, mask=e < total, other=-1)
    inside = (place >= lo) & (place < hi)
    value = tl.load(logits_ptr + (place - lo), mask=inside, other=0.0).to(tl.float32)
    tl.store(z_ptr + e, value * inv_temperature, mask=inside)


@cached_launch
@triton.jit
def _scatter_chunk_kernel(place_ptr, d_ptr, block_ptr, total, lo, hi, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    place = tl.load(place_ptr + e, mask=e < total, other=-1)
    inside = (place >= lo) & (place < hi)
    tl.store(block_ptr + (place - lo), tl.load(d_ptr + e, mask=inside), mask=inside)


def gather_chunk(place: Tensor, logits: Tensor, z: Tensor, lo: int, hi: int, inv_temperature: float) -> None:
    """z[e] = fp32(logits.flat[place[e] - lo]) * inv_temperature where lo <= place[e] < hi."""
    total = place.numel()
    _gather_chunk_kernel[(cdiv(total, CHUNK_BLOCK),)](place, logits.contiguous(), z, total, lo, hi,
                                                      float(inv_temperature), BLOCK=CHUNK_BLOCK, num_warps=4)


def scatter_chunk(place: Tensor, d: Tensor, block: Tensor, lo: int, hi: int) -> None:
    """block.flat[place[e] - lo] = d[e] where lo <= place[e] < hi (d in the block's dtype)."""
    total = place.numel()
    _scatter_chunk_kernel[(cdiv(total, CHUNK_BLOCK),)](place, d, block, total, lo, hi, BLOCK=CHUNK_BLOCK,
                                                       num_warps=4)


# The dense route's block of dlogits of a chunk of slots, one program per slot: its row's zeros, then
# its entries (contiguous in the CSR: starts / ends) written in. torch's zeros and a scatter of every
# entry over the block were two passes, the scatter's 2-byte writes spread over the whole block; here
# a row's entries land on the row its program has just written.
# (8192 x 19008, 512 ids a row, on an H200: 232 us at 1024 columns and 8 warps, 313 at 4 warps, 320
# for torch's zeros and the scatter kernel)
SLOT_ROW_BLOCK_V = 1024
SLOT_ROW_BLOCK_E = 128


@cached_launch
@triton.jit
def _slot_rows_kernel(d_ptr, col_ptr, valid_ptr, starts_ptr, ends_ptr, block_ptr, first_slot, cols,
                      BLOCK_V: tl.constexpr, BLOCK_E: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    row = block_ptr + s * cols
    zeros = tl.zeros([BLOCK_V], dtype=block_ptr.dtype.element_ty)
    for c0 in range(0, cols, BLOCK_V):
        c = c0 + tl.arange(0, BLOCK_V)
        tl.store(row + c, zeros, mask=c < cols)
    tl.debug_barrier()  # (the program's zeros stored before its entries)
    lo = tl.load(starts_ptr + first_slot + s)
    hi = tl.load(ends_ptr + first_slot + s)
    for e0 in range(lo, hi, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        valid = (e < hi) & (tl.load(valid_ptr + e, mask=e < hi, other=0) != 0)
        col = tl.load(col_ptr + e, mask=valid, other=0)
        tl.store(row + col, tl.load(d_ptr + e, mask=valid), mask=valid)


def slot_rows(entries, d: Tensor, start: int, end: int, cols: int, by_rows: bool = False) -> Tensor:
    """replay.KeptEntries.scatter_chunk: the [end - start, cols] block of slots (with `by_rows`:
    rows) [start, end), zeros and d[e] (in its dtype) at each valid entry's column."""
    block = torch.empty((end - start, cols), dtype=d.dtype, device=d.device)
    # (a row's entries are its layout range; valid only where it has a set)
    starts, ends = (entries.offsets[:-1], entries.offsets[1:]) if by_rows else (entries.starts, entries.ends)
    if end > start:
        _slot_rows_kernel[(end - start,)](d, entries.col, entries.valid.view(torch.uint8), starts,
                                          ends, block, int(start), int(cols), BLOCK_V=SLOT_ROW_BLOCK_V,
                                          BLOCK_E=SLOT_ROW_BLOCK_E, num_warps=8)
    return block
