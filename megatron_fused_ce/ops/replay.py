"""Sampling-distribution replay: log-probs over the kept sets an inference engine's sampler used.

`linear_logprobs(..., sampling_mask=(token_ids, offsets))`: the engine returns, per generated
token, the ids its top-k / top-p / min-p filters kept (vLLM's `SamplingMask`, CSR). Position i of
`labels` (row-major, ignored positions included, normally empty) keeps
K_i = token_ids[offsets[i]:offsets[i + 1]] (global ids), and with z = logits / T:

    log q_i(y) = z_y - logsumexp_{k in K_i} z_k     (-inf, no gradient, where y is not in K_i)

An empty K_i means no truncation (plain softmax). Recomputing the filters from the trainer's own
logits (sampling.py) gives the same sets only where engine and trainer logits agree to the last
bit; replay scores exactly the sets the engine sampled from, on the trainer's logits.

What is particular to kept sets lives here: reading and checking a mask, building a batch's or a
context-parallel rank's mask, the layout of a call's kept entries on this shard (`KeptEntries`,
made on the device: no host sync), and `ReplayChunks`, the tiling of the one chunk loop
(chunked.py; the methods fast.FastChunks, lean.LeanTiles and sampling.SamplerChunks have) that
scores them. Per call, on each TP rank (the mask is the same on every rank: checked):

    rows with an empty set   the plain path's partials over the whole shard (fast.py's chunks)
    rows with a kept set     sparse: the backend's `kept_stats` (Triton: one kernel, a program per
                             row gathering the W rows of its kept ids and taking their dots, the
                             online max / sum-exp / entropy sums and the label's z; torch: the
                             same by blocks of entries and segment reductions), or
                             dense: fast.py's chunk GEMM over the whole shard, the kept entries
                             read off each chunk of logits
    one TP merge             the partials of every row merged by reductions.merge_shard_stats

Backward (the chunk loop's recompute_grads): every entry's dlogits from the z the forward saved
(O(entries) floats, no recompute of the logits; backends/replay_torch.entry_dlogits, both
backends), then sparse: the backend's `kept_grads` (Triton: dX per row from the gathered W rows;
dW from the entries sorted by id on the device, a segmented sum per block and one fp32 atomic add
per id and block, into the fp32 dW or Megatron's main_grad) or dense: each chunk's dlogits block
(zeros, the entries written in) times W and h, fast.py's GEMMs. Rows with an empty set take the
plain recompute backward.

Sparse or dense is decided from sizes the host already knows (no sync): sparse while the kept
entries are at most SPARSE_MAX_SHARE of the set rows x the vocab (mean K <= V / 640). Measured on
an H200 (tools/sampling_mask_bench.py --pieces sparse, three shapes, Zipf and random sets), a call
of sparse rows costs about 0.07 + 410 x K / V of plain log-probs (the backward's fp32 dW adds
dominate), the dense route about 0.75 (3 GEMMs per chunk against plain's 4): they cross near
K = V / 600.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import reductions
from .agreement import integer_argument, is_int
from .backends import ShardStats, replay_torch
from .fast import FAST_CHUNKS, backward_grads, chunk_logits, grad_gemms, row_chunks, shard_partials

# Sparse while entries <= SPARSE_MAX_SHARE x set rows x vocab (module doc).
SPARSE_MAX_SHARE = 1 / 640
# Tests and the benchmark force one kind: None (by sizes), "sparse" or "dense".
FORCE_PIECES: Optional[str] = None
# Rows of each kind since import (read by tools/sampling_mask_bench.py).
PIECE_COUNTS = Counter()


class SamplingMask(NamedTuple):
    """The kept sets of a batch, CSR: position i keeps token_ids[offsets[i]:offsets[i + 1]]."""

    token_ids: Tensor  # int64 [E], global vocab ids
    offsets: Tensor  # int64 [positions + 1], offsets[0] == 0, non-decreasing, offsets[-1] == E


# --------------------------------------------------------------------------------------------
# Reading and checking a mask (joined to api.py's one agreement)
# --------------------------------------------------------------------------------------------
def _fields(mask):
    """(token_ids, offsets) of a pair or of an object with those attributes, else None."""
    if hasattr(mask, "token_ids") and hasattr(mask, "offsets"):
        return mask.token_ids, mask.offsets
    if isinstance(mask, (tuple, list)) and len(mask) == 2:
        return mask[0], mask[1]
    return None


def _as_index_tensor(values, name: str):
    """(1-D int64 tensor, None) or (None, problem)."""
    if not isinstance(values, Tensor):
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            return None, f"sampling_mask: {name} must be a 1-D integer tensor (or sequence of ints)"
        if values.numel() == 0:
            values = values.long()
    if values.dtype in (torch.bool,) or values.is_floating_point() or values.is_complex():
        return None, f"sampling_mask: {name} must be integers, got dtype {values.dtype}"
    if values.dim() != 1:
        return None, f"sampling_mask: {name} must be 1-D, got shape {tuple(values.shape)}"
    return values.long(), None


def as_sampling_mask(mask) -> SamplingMask:
    """A mask given as a pair or an object with .token_ids / .offsets (tensors or sequences of
    ints) -> SamplingMask of int64 tensors (on the CPU unless they were tensors elsewhere).
    ValueError for anything else (the shape of its offsets is not checked here)."""
    fields = _fields(mask)
    if fields is None:
        raise ValueError("sampling_mask must be (token_ids, offsets) or have .token_ids / .offsets")
    (ids, problem), (offsets, problem2) = (_as_index_tensor(f, n) for f, n in zip(fields, ("token_ids", "offsets")))
    if problem or problem2:
        raise ValueError(problem or problem2)
    return SamplingMask(ids, offsets)


class MaskCheck:
    """linear_logprobs' checks of `sampling_mask`. Host checks are read at construction
    (`problem`); the ones on the device (offsets, ids, duplicates) and the mask's fingerprint join
    the one agreement through `register`, the same entries on every rank whether or not it holds
    a mask, so that a rank without a mask raises with its peers instead of hanging."""

    def __init__(self, mask, labels, ignore_index, true_vocab: int):
        self.present = mask is not None
        self.problem: Optional[str] = None
        self.ids = self.offsets = None
        self.true_vocab = int(true_vocab)
        self.labels, self.ignore_index = labels, ignore_index
        self._key = None
        if not self.present:
            return
        fields = _fields(mask)
        if fields is None:
            self.problem = ("sampling_mask must be (token_ids, offsets) or an object with .token_ids / "
                            f".offsets (vLLM's SamplingMask), got {type(mask).__name__}")
            return
        ids, self.problem = _as_index_tensor(fields[0], "token_ids")
        if self.problem:
            return
        offsets, self.problem = _as_index_tensor(fields[1], "offsets")
        if self.problem:
            return
        if isinstance(labels, Tensor):
            if offsets.numel() != labels.numel() + 1:
                self.problem = (f"sampling_mask: offsets has {offsets.numel()} entries but labels has "
                                f"{labels.numel()} positions: one kept set per position of labels in "
                                f"row-major order, ignored positions included (len(offsets) == "
                                f"labels.numel() + 1 = {labels.numel() + 1})")
                return
            ids, offsets = ids.to(labels.device), offsets.to(labels.device)
        self.ids, self.offsets = ids, offsets

    def register(self, agreement, device) -> None:
        """Add the mask's entries to the agreement (call at the same point on every rank)."""
        usable = self.ids is not None and self.problem is None
        compared = usable and not getattr(agreement, "single_rank", False)  # (one rank: no copy of the mask)
        agreement.equal_tensor("sampling_mask", torch.cat([self.offsets, self.ids]) if compared else None,
                               "sampling_mask: differs across tensor-parallel ranks (token ids or offsets, "
                               "or a rank passed none); every rank of tp_group must pass the same mask")
        counts = torch.zeros(4, dtype=torch.int64, device=device)
        if usable:
            counts = self._device_counts()
        self._key = agreement.maximum_counts("sampling_mask", counts)

    def _device_counts(self) -> Tensor:
        """[bad offsets, ids out of range, duplicated ids, labelled positions with a kept set]."""
        ids, offsets, vocab = self.ids, self.offsets, self.true_vocab
        e, positions = ids.numel(), offsets.numel() - 1
        bad_offsets = ((offsets[0] != 0).long() + (offsets[1:] < offsets[:-1]).sum()
                       + (offsets[-1] != e).long())
        bad_ids = ((ids < 0) | (ids >= vocab)).sum()
        duplicates = torch.zeros((), dtype=torch.int64, device=ids.device)
        if e > 1 and positions > 0:  # meaningful once offsets and ids are valid (messages gate it)
            position = (torch.searchsorted(offsets, torch.arange(e, device=ids.device), right=True) - 1
                        ).clamp(0, positions - 1)
            keys = position * vocab + ids.clamp(0, vocab - 1)
            duplicates = (keys.sort().values.diff() == 0).sum()
        with_set = torch.zeros((), dtype=torch.int64, device=ids.device)
        if positions > 0 and isinstance(self.labels, Tensor) and is_int(self.ignore_index):
            sizes = offsets[1:] - offsets[:-1]
            with_set = ((sizes > 0) & (self.labels.reshape(-1) != self.ignore_index)).sum()
        return torch.stack([bad_offsets, bad_ids, duplicates, with_set])

    def rows_with_set(self, agreed) -> int:
        """Labelled positions that keep a set (agreed; 0 without a mask)."""
        return int(agreed[self._key][3]) if self._key is not None else 0

    def messages(self, agreed) -> list:
        if self._key is None:
            return []
        bad_offsets, bad_ids, duplicates, _ = agreed[self._key]
        if bad_offsets:
            return ["sampling_mask: offsets must start at 0, never decrease and end at len(token_ids)"
                    + (f" = {self.ids.numel()}" if self.ids is not None else "")
                    + " (position i keeps token_ids[offsets[i]:offsets[i + 1]])"]
        if bad_ids:
            message = (f"sampling_mask: {bad_ids} token id(s) outside [0, vocab_size={self.true_vocab}) "
                       f"(ids of Megatron's vocab padding are never kept)")
            if self.ids is not None:  # an example, read only on the way to the error
                bad = self.ids[(self.ids < 0) | (self.ids >= self.true_vocab)]
                if bad.numel():
                    message += f", e.g. {int(bad[0])}"
            return [message]
        if duplicates:
            return [f"sampling_mask: {duplicates} token id(s) listed twice at one position; a kept set "
                    f"lists each id once"]
        return []


# --------------------------------------------------------------------------------------------
# Building masks: a batch from per-request masks, a context-parallel rank's positions
# --------------------------------------------------------------------------------------------
def build_sampling_mask(requests: Sequence, labels_shape, *, sequence_first: bool = False) -> SamplingMask:
    """The batch's mask from per-request masks as an engine returns them (vLLM: one
    `SamplingMask` per request over its generated tokens only).

    `requests`: (row, start, mask) per request: its generated tokens are the labels at
    [row, start : start + g] of a [B, S] labels tensor (`labels_shape`; with
    `sequence_first=True`, labels are [S, B] and those positions are [start : start + g, row]),
    g = len(mask.offsets) - 1 (with Megatron's shifted labels, `start` is the prompt length - 1:
    labels[:, t] is the token at t + 1). Every other position (prompts, padding) gets an empty
    set. Spans may not overlap. Returns int64 CPU tensors."""
    if len(labels_shape) != 2:
        raise ValueError(f"labels_shape must be 2-D ([B, S], or [S, B] with sequence_first), got {tuple(labels_shape)}")
    batch, length = (labels_shape[1], labels_shape[0]) if sequence_first else tuple(labels_shape)
    sizes = torch.zeros(batch * length, dtype=torch.int64)  # per (row, position) in [B, S] order
    source_start = torch.zeros(batch * length, dtype=torch.int64)
    owner = torch.full((batch * length,), -1, dtype=torch.int64)
    pieces, base = [], 0
    for index, request in enumerate(requests):
        try:
            row, start, mask = request
        except (TypeError, ValueError):
            raise ValueError(f"requests[{index}] must be (row, start, mask)") from None
        row, start = integer_argument(row), integer_argument(start)
        if not (is_int(row) and is_int(start)):
            raise ValueError(f"requests[{index}]: row and start must be integers, got {row!r}, {start!r}")
        ids, offsets = as_sampling_mask(mask)
        ids, offsets = ids.cpu(), offsets.cpu()
        generated = offsets.numel() - 1
        if (generated < 0 or int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())
                or int(offsets[-1]) != ids.numel()):
            raise ValueError(f"requests[{index}]: offsets must start at 0, never decrease and end at "
                             f"len(token_ids) = {ids.numel()}")
        if not (0 <= int(row) < batch and 0 <= int(start) and int(start) + generated <= length):
            raise ValueError(f"requests[{index}]: {generated} generated tokens from position {start} of "
                             f"row {row} do not fit in labels of {batch} rows x {length} positions")
        span = slice(int(row) * length + int(start), int(row) * length + int(start) + generated)
        if bool((owner[span] >= 0).any()):
            raise ValueError(f"requests[{index}]: its span overlaps request {int(owner[span].max())}")
        owner[span] = index
        sizes[span] = offsets[1:] - offsets[:-1]
        source_start[span] = offsets[:-1] + base
        pieces.append(ids)
        base += ids.numel()
    token_ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    if sequence_first:  # [B, S] bookkeeping -> positions in [S, B] row-major order
        sizes = sizes.view(batch, length).t().reshape(-1)
        source_start = source_start.view(batch, length).t().reshape(-1)
    return _gather_sets(token_ids, sizes, source_start)


def slice_sampling_mask(mask, positions) -> SamplingMask:
    """The mask of a subset of positions, in the order given: `positions` are flat row-major
    indices into the full labels (int, any device). Context parallelism: a CP rank holding
    [B, S / CP] of [B, S] labels at sequence positions `seq` (megatron's
    context_parallel.positions_on_cp_rank) passes `flat_positions(seq, B, S)`."""
    ids, offsets = as_sampling_mask(mask)
    positions = _integer_positions(positions, "positions").to(offsets.device)
    total = offsets.numel() - 1
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= total):
        raise ValueError(f"positions must lie in [0, {total}) (the mask's positions)")
    sizes = (offsets[1:] - offsets[:-1]).index_select(0, positions)
    return _gather_sets(ids, sizes, offsets[:-1].index_select(0, positions))


def flat_positions(seq_positions, batch_size: int, length: int, *, sequence_first: bool = False) -> Tensor:
    """Flat row-major positions of labels [B, len(seq)] (or [len(seq), B] with `sequence_first`)
    cut at sequence positions `seq_positions` of full labels [B, length] ([length, B])."""
    seq = _integer_positions(seq_positions, "seq_positions")
    batch_size, length = integer_argument(batch_size), integer_argument(length)
    if not (is_int(batch_size) and is_int(length) and batch_size >= 0 and length >= 0):
        raise ValueError(f"batch_size and length must be integers >= 0, got {batch_size!r}, {length!r}")
    rows = torch.arange(batch_size, dtype=torch.int64)
    if sequence_first:
        return (seq.unsqueeze(1) * batch_size + rows.unsqueeze(0)).reshape(-1)
    return (rows.unsqueeze(1) * length + seq.unsqueeze(0)).reshape(-1)


def _integer_positions(positions, name: str) -> Tensor:
    """Positions as a 1-D int64 tensor; bools and floats refused (a bool tensor would read as the
    indices 0 and 1, a float be truncated)."""
    values = torch.as_tensor(positions)
    if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
        raise ValueError(f"{name} must be integer indices, got dtype {values.dtype}")
    return values.to(torch.int64).reshape(-1)


def kept_columns(mask, vocab_start: int, v_local: int) -> Tensor:
    """[positions, v_local] bool: each position's kept ids on the shard of columns
    [vocab_start, vocab_start + v_local), every column where the set is empty (AND it with the
    valid, unpadded columns). For materialized vocab-parallel logits (an unfused path), on the
    mask's device; the fused op never forms it."""
    ids, offsets = as_sampling_mask(mask)
    sizes = offsets[1:] - offsets[:-1]
    keep = torch.zeros(sizes.numel(), v_local, dtype=torch.bool, device=ids.device)
    keep[sizes.to(ids.device) == 0] = True
    position = torch.repeat_interleave(torch.arange(sizes.numel(), device=ids.device), sizes.to(ids.device),
                                       output_size=ids.numel())
    local = ids - vocab_start
    here = (local >= 0) & (local < v_local)
    keep[position[here], local[here]] = True
    return keep


def _gather_sets(ids: Tensor, sizes: Tensor, source_start: Tensor) -> SamplingMask:
    """CSR whose position p keeps ids[source_start[p] : source_start[p] + sizes[p]]."""
    offsets = torch.zeros(sizes.numel() + 1, dtype=torch.int64, device=sizes.device)
    torch.cumsum(sizes, 0, out=offsets[1:])
    total = int(offsets[-1])
    position = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes, output_size=total)
    within = torch.arange(total, device=sizes.device) - offsets[:-1].index_select(0, position)
    return SamplingMask(ids.index_select(0, (source_start.index_select(0, position) + within).to(ids.device)), offsets)



# --------------------------------------------------------------------------------------------
# A call's kept entries, and the tiling that scores them
# --------------------------------------------------------------------------------------------
def sparse_is_cheaper(num_entries: int, num_set_rows: int, vocab: int) -> bool:
    """Sparse (gathered rows) or dense (whole-shard GEMMs), from sizes the host knows."""
    if FORCE_PIECES is not None:
        return FORCE_PIECES == "sparse"
    return num_entries <= SPARSE_MAX_SHARE * num_set_rows * vocab


class KeptEntries:
    """The kept entries of a call on this shard, all on the device (sizes from the host's counts:
    no sync). Rows are the labelled rows of the call (`positions`: their flat positions, None =
    every position); `labels` are the global labels of every position.

    Per row with a set (`set_rows`, in row order): its position, its CSR range [starts, ends)
    and label. Per entry e of the CSR: `position`, `slot` (its row's index in set_rows, -1 where
    the position has no labelled row), `col` (id - vocab_start), `valid` (a labelled row's entry
    on this shard's valid columns), `is_label` (valid and the row's label). Per row: `kept`, the
    label is in its set (every shard sees the whole set: no collective)."""

    def __init__(self, ids: Tensor, offsets: Tensor, positions: Optional[Tensor], labels: Tensor, vocab_start: int,
                 num_valid_cols: int, num_rows: int, num_set_rows: int):
        device = ids.device
        total, num_positions = ids.numel(), offsets.numel() - 1
        self.ids, self.offsets = ids.contiguous(), offsets.contiguous()
        self.vocab_start, self.num_valid_cols = int(vocab_start), int(num_valid_cols)
        row_position = torch.arange(num_rows, device=device) if positions is None else positions
        sizes = offsets[1:] - offsets[:-1]
        has_set = sizes.index_select(0, row_position) > 0
        self.set_rows = torch.nonzero_static(has_set, size=num_set_rows).squeeze(1)
        self.plain_rows = torch.nonzero_static(~has_set, size=num_rows - num_set_rows).squeeze(1)
        self.set_positions = row_position.index_select(0, self.set_rows)
        self.starts = offsets.index_select(0, self.set_positions)
        self.ends = offsets.index_select(0, self.set_positions + 1)
        self.set_labels = labels.reshape(-1).index_select(0, self.set_positions)
        slot_of_position = torch.full((num_positions,), -1, dtype=torch.int64, device=device).index_copy_(
            0, self.set_positions, torch.arange(num_set_rows, device=device))
        self.position = torch.repeat_interleave(torch.arange(num_positions, device=device), sizes, output_size=total)
        self.slot = slot_of_position.index_select(0, self.position)
        self.col = ids - vocab_start
        labelled = self.slot >= 0
        self.valid = labelled & (self.col >= 0) & (self.col < num_valid_cols)
        hit = labelled & (ids == self.set_labels.index_select(0, self.slot.clamp(min=0)))
        self.is_label = hit & self.valid
        # the label among the row's ids (on any shard): prefix sums, not atomic adds
        prefix = torch.zeros(total + 1, dtype=torch.int64, device=device)
        torch.cumsum(hit, 0, out=prefix[1:])
        found = prefix.index_select(0, self.ends) > prefix.index_select(0, self.starts)
        self.kept = torch.ones(num_rows, dtype=torch.bool, device=device).index_copy_(0, self.set_rows, found)
        self._row_of_entry = None

    def row_of_entry(self) -> Tensor:
        """[E] each entry's row (an index into the call's rows; 0 where it has none)."""
        if self._row_of_entry is None:
            self._row_of_entry = self.set_rows.index_select(0, self.slot.clamp(min=0))
        return self._row_of_entry

    def chunk_places(self, start: int, end: int, cols: int) -> tuple:
        """Entries of set rows [start, end): (in the chunk, their place in its [rows, cols] block
        of logits; the block's size past the others)."""
        inside = self.valid & (self.slot >= start) & (self.slot < end)
        return inside, torch.where(inside, (self.slot - start) * cols + self.col, (end - start) * cols)


@dataclass
class ReplayStats(reductions.MergedStats):
    """MergedStats over each row's kept set (the whole vocab where it is empty), plus whether the
    label is kept and the entries' z (what the backward's dlogits need)."""

    kept: Optional[Tensor] = None  # bool [n]
    entry_z: Optional[Tensor] = None  # fp32 [E], temperature applied (None without gradients)

    def grad_offsets(self) -> tuple:
        return (self.max, self.log_sum_exp, self.entry_z)


def _pick(coefs: dict, index: Tensor) -> dict:
    return {k: None if c is None else c.index_select(0, index) for k, c in coefs.items()}


def _in_row_order(parts: list, n: int, device) -> ShardStats:
    """ShardStats of [n] rows from (row indices, ShardStats) parts covering them."""
    def field(name):
        if getattr(parts[0][1], name) is None:
            return None
        out = torch.empty(n, dtype=torch.float32, device=device)
        for index, stats in parts:
            out.index_copy_(0, index, getattr(stats, name))
        return out

    return ShardStats(max=field("max"), sum_exp=field("sum_exp"), target=field("target"),
                      sum_exp_shifted=field("sum_exp_shifted"))


@dataclass(eq=False)
class ReplayChunks:
    """`spec.tiling` of a call with kept sets: plain rows in fast chunks, rows with a set sparse
    (the backend's kept-set kernels) or dense (chunk GEMMs over the whole shard); module doc."""

    entries: KeptEntries
    sparse: bool
    want_z: bool  # the backward will need the entries' z
    statistics_type = ReplayStats
    _z = None  # the entries' z between _kept_partials and merged_statistics

    def weight_grad_dtype(self, weight: Tensor, num_rows: int, spec) -> torch.dtype:
        return torch.float32  # sparse rows add into dW, dense chunks sum over chunks

    def statistics(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ShardStats:
        """The plain rows' walk (fast.shard_partials asks the tiling)."""
        return FAST_CHUNKS.statistics(rows, weight, local_target, spec)

    def _max_elements(self, weight: Tensor, spec) -> int:
        return spec.chunk_size * weight.shape[0]  # the torch path's gathers: at most a chunk of logits

    def merged_statistics(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ReplayStats:
        entries, n = self.entries, rows.shape[0]
        plain = entries.plain_rows
        parts = []
        PIECE_COUNTS["plain_rows"] += plain.numel()
        if plain.numel():
            parts.append((plain, shard_partials(rows.index_select(0, plain), weight, local_target.index_select(0, plain),
                                                spec)))
        parts.append((entries.set_rows, self._kept_partials(rows, weight, spec)))
        z = self._z
        self._z = None
        merged = reductions.merge_shard_stats(_in_row_order(parts, n, rows.device), spec.tp_group, spec.rank_check)
        return ReplayStats(**vars(merged), kept=entries.kept, entry_z=z)

    def _kept_partials(self, rows: Tensor, weight: Tensor, spec) -> ShardStats:
        entries = self.entries
        PIECE_COUNTS["sparse_rows" if self.sparse else "dense_rows"] += entries.set_rows.numel()
        if self.sparse:
            round_to = None if spec.logits_dtype is not None or rows.dtype == torch.float32 else rows.dtype
            stats, self._z = spec.backend.kept_stats(rows, weight, entries, spec.inv_temperature, round_to,
                                                     spec.want_entropy, self.want_z, self._max_elements(weight, spec))
            return stats
        z = torch.zeros(entries.ids.numel(), dtype=torch.float32, device=rows.device)
        for start, end in row_chunks(entries.set_rows.numel(), spec.chunk_size):
            logits = chunk_logits(rows.index_select(0, entries.set_rows[start:end]), weight, spec)
            inside, at = entries.chunk_places(start, end, logits.shape[1])
            values = logits.reshape(-1).index_select(0, at.clamp(max=logits.numel() - 1)).float()
            z = torch.where(inside, values * spec.inv_temperature, z)
            del logits
        self._z = z if self.want_z else None
        return replay_torch.entry_stats(z, entries, spec.want_entropy)

    def recompute_grads(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                        coefs: dict, dx_rows: Optional[Tensor], dw_out: Optional[Tensor], accumulate: bool) -> None:
        """dX rows and fp32 dW: the plain rows' recompute backward (writing dW first), then the
        kept entries' dlogits into the sparse kernels or the dense chunks' GEMMs (adding)."""
        entries = self.entries
        row_max, log_sum_exp, z = offsets
        plain = entries.plain_rows
        if plain.numel():
            dx_plain = None if dx_rows is None else rows.new_empty((plain.numel(), rows.shape[1]))
            backward_grads(rows.index_select(0, plain), weight, local_target.index_select(0, plain), spec,
                           (row_max.index_select(0, plain), log_sum_exp.index_select(0, plain)), _pick(coefs, plain),
                           dx_plain, dw_out, dw_accumulate=accumulate)
            if dx_plain is not None:
                dx_rows.index_copy_(0, plain, dx_plain)
        elif dw_out is not None and not accumulate:
            dw_out.zero_()
        set_rows = entries.set_rows
        c = _pick(coefs, set_rows)
        d = replay_torch.entry_dlogits(z, entries, spec.inv_temperature, row_max.index_select(0, set_rows),
                                       log_sum_exp.index_select(0, set_rows), c["p"], c["pz"], c["target"])
        if self.sparse:
            spec.backend.kept_grads(rows, weight, entries, d, dx_rows, dw_out, self._max_elements(weight, spec))
            return None
        d = d.to(rows.dtype)  # the GEMMs' input dtype
        cols = weight.shape[0]
        for start, end in row_chunks(set_rows.numel(), spec.chunk_size):
            r = end - start
            _, at = entries.chunk_places(start, end, cols)
            # the chunk's block of dlogits: zeros, its entries written in (the others' writes land
            # on one spare element past the block)
            dlogits = torch.zeros(r * cols + 1, dtype=rows.dtype, device=rows.device).index_put_((at,), d)
            dx_chunk = None if dx_rows is None else rows.new_empty((r, rows.shape[1]))
            grad_gemms(dlogits[:-1].view(r, cols), rows.index_select(0, set_rows[start:end]), weight, spec, dx_chunk,
                       dw_out, dw_accumulate=True)
            del dlogits
            if dx_chunk is not None:
                dx_rows.index_copy_(0, set_rows[start:end], dx_chunk)
        return None



def replay_tiling(ids: Tensor, offsets: Tensor, positions: Optional[Tensor], labels: Tensor, vocab_start: int,
                  num_valid_cols: int, num_rows: int, num_set_rows: int, true_vocab: int,
                  needs_grad: bool) -> ReplayChunks:
    """api.token_statistics' tiling for a call whose mask keeps a set at `num_set_rows` (> 0) of
    its `num_rows` labelled rows (the agreement's counts)."""
    entries = KeptEntries(ids, offsets, positions, labels, vocab_start, num_valid_cols, num_rows, num_set_rows)
    return ReplayChunks(entries, sparse_is_cheaper(ids.numel(), num_set_rows, true_vocab), want_z=needs_grad)


def sampling_mask_problems(sampling_mask, active_sampler: dict, memory_mode: str) -> dict:
    """linear_logprobs' checks of what the mask cannot be combined with ({name: message or None})."""
    present = sampling_mask is not None
    filters = [k for k in ("top_k", "top_p", "min_p") if active_sampler.get(k) is not None]
    return {
        "sampling_mask_with_filters": (
            f"sampling_mask cannot be combined with {' / '.join(filters)}: the mask is the set the "
            f"engine's filters kept (replay), the filters recompute it from the trainer's logits "
            f"(sampler fidelity); pass one or the other" if present and filters else None),
        "sampling_mask_with_return_topk": (
            "return_topk cannot be combined with sampling_mask: the top-k of the full softmax needs "
            "the whole-vocab pass that replay avoids; call linear_logprobs(..., return_topk=k) "
            "without the mask for it" if present and active_sampler.get("return_topk") else None),
        "sampling_mask_memory_mode": (
            "memory_mode='lean' cannot be combined with sampling_mask (replay scores the kept ids "
            "in chunks of rows): use memory_mode='fast'" if present and memory_mode == "lean" else None),
    }

