"""Sampling-distribution replay: log-probs over the kept sets an inference engine's sampler used.

`linear_logprobs(..., sampling_mask=(token_ids, offsets))`: the engine returns, per generated
token, the ids its top-k / top-p / min-p filters kept (vLLM's `SamplingMask`, CSR). Position i of
`labels` (row-major, ignored positions included, normally empty) keeps
K_i = token_ids[offsets[i]:offsets[i + 1]] (global ids), and with z = logits / T:

    log q_i(y) = z_y - logsumexp_{k in K_i} z_k     (-inf, no gradient, where y is not in K_i)

An empty K_i means no truncation (plain softmax). Recomputing the filters from the trainer's own
logits (sampling.py) gives the same sets only where engine and trainer logits agree to the last
bit; replay scores exactly the sets the engine sampled from, on the trainer's logits.

Per call, on each TP rank (the mask is the same on every rank: checked):

    rows with an empty set   the plain path's partials over the whole shard (chunked.shard_partials)
    rows with a kept set     in order of their number of kept ids on this shard, split into
                             tiles of R rows; per tile the union U of its kept ids on this shard,
                             and the cheaper of (cost model below)
                               sparse: gather W[U], one GEMM [R, H] x [H, |U|], the kept entries
                                       read off it
                               dense:  the logits over the whole shard (tiles grouped into chunks),
                                       the kept entries read off them
    one TP merge             the partials of every row (entries on other shards count there)
                             merged by reductions.merge_shard_stats: max, then one sum

The backward writes d/dz of q only at the kept entries (backends/replay_torch.py), from the
entries' z saved by the forward (no recompute of the logits; O(rows x K) floats), then
dX = dlogits @ W[U] and dW[U] += dlogits.T @ h (sparse; W[U] gathered again) or the two GEMMs over
the whole shard (dense). Rows with an empty set take the plain recompute backward.

Cost model (`_sparse_cost` / `_dense_cost`, seconds on a nominal GPU; only ratios matter): a GEMM
[m, k] x [k, n] costs max(2mnk / GEMM_FLOPS, (mk + kn + mn) b / BANDWIDTH) + KERNEL_S (the
roofline, b bytes per element). A sparse tile of r rows and union u: its 3 GEMMs (logits, dX, dW
of [r, u]) + gathering W[U] twice (4 u H b bytes) + adding its fp32 dW[U] into the shard's
(12 u H bytes) + KERNELS_PER_TILE small kernels. Dense rows: 3 GEMMs of a chunk over the whole
shard, per row, + writing their dlogits. Each tile takes the cheaper; R is the candidate (the
chunk size, halved down to MIN_TILE_ROWS) with the least total. Overlapping sets (a trained
model: the kept ids of different tokens are mostly the same frequent tokens) make u small and
large tiles sparse; independent random sets make u ~ R K, so small tiles are sparse when K is small
and everything is dense when K is large (then 3 GEMMs per chunk: the plain path's recompute
backward has 4).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import reductions
from .backends import ShardStats
from .chunked import ChunkSpec, autocast_off, coefficients, first_order_only, input_grad, labelled_rows, shard_partials
from .fast import backward_grads, chunk_logits
from .main_grad import main_grad_added
from .gemm import logits_gemm, matmul_fp32, matmul_into_

# Cost model (module doc). Nominal H100 figures: bf16 GEMMs reach ~600 of the 989 TFLOP/s peak,
# HBM3 ~2.8 of 3.35 TB/s; a small kernel costs ~4 us however little it does.
GEMM_FLOPS = 600e12
BANDWIDTH = 2.8e12
KERNEL_S = 4e-6
KERNELS_PER_TILE = 24  # a sparse tile's small kernels: gathers, entry math, index_add, copies
MIN_TILE_ROWS = 128  # smaller tiles make GEMMs too thin to pay for their fixed costs
# Tests force one kind of piece: None (the cost model decides), "sparse" or "dense".
FORCE_PIECES: Optional[str] = None
# Rows and pieces of each kind since import (read by tools/sampling_mask_bench.py).
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
        agreement.equal_tensor("sampling_mask", torch.cat([self.offsets, self.ids]) if usable else None,
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
        if positions > 0 and isinstance(self.labels, Tensor) and isinstance(self.ignore_index, int):
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
    positions = torch.as_tensor(positions, dtype=torch.int64).to(offsets.device).reshape(-1)
    total = offsets.numel() - 1
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= total):
        raise ValueError(f"positions must lie in [0, {total}) (the mask's positions)")
    sizes = (offsets[1:] - offsets[:-1]).index_select(0, positions)
    return _gather_sets(ids, sizes, offsets[:-1].index_select(0, positions))


def flat_positions(seq_positions, batch_size: int, length: int, *, sequence_first: bool = False) -> Tensor:
    """Flat row-major positions of labels [B, len(seq)] (or [len(seq), B] with `sequence_first`)
    cut at sequence positions `seq_positions` of full labels [B, length] ([length, B])."""
    seq = torch.as_tensor(seq_positions, dtype=torch.int64).reshape(-1)
    rows = torch.arange(batch_size, dtype=torch.int64)
    if sequence_first:
        return (seq.unsqueeze(1) * batch_size + rows.unsqueeze(0)).reshape(-1)
    return (rows.unsqueeze(1) * length + seq.unsqueeze(0)).reshape(-1)


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
# The plan of a call: which rows are plain, which tiles are sparse or dense
# --------------------------------------------------------------------------------------------
def _gemm_s(m: int, n: int, k: int, b: int) -> float:
    return max(2.0 * m * n * k / GEMM_FLOPS, (m * k + k * n + m * n) * b / BANDWIDTH) + KERNEL_S


def _sparse_cost(rows: int, union: int, hidden: int, b: int) -> float:
    if union == 0:
        return 0.0
    return (3 * _gemm_s(rows, union, hidden, b) + (4 * b + 12) * union * hidden / BANDWIDTH
            + KERNELS_PER_TILE * KERNEL_S)


def _dense_cost(rows: int, cols: int, hidden: int, b: int, chunk: int) -> float:
    return rows * (3 * _gemm_s(chunk, cols, hidden, b) / chunk + cols * b / BANDWIDTH)


def tile_candidates(chunk_size: int, mask_rows: int) -> list:
    """Tile sizes tried: the chunk size (at most the rows), halved down to MIN_TILE_ROWS."""
    first = max(1, min(chunk_size, mask_rows))
    out, size = [first], first // 2
    while size >= MIN_TILE_ROWS:
        out.append(size)
        size //= 2
    return out


@dataclass
class Piece:
    """Rows scored on one block of logits: the whole shard (`cols` None) or the gathered columns
    `cols` (sorted local ids, the rows' union)."""

    rows: Tensor  # [r] indices into the labelled rows
    cols: Optional[Tensor]
    num_cols: int
    flat_index: Tensor  # [r, slots] int64: row * num_cols + column of each kept entry, -1 = empty slot
    is_target: Tensor  # [r, slots] bool: the entry is the row's label


@dataclass
class Plan:
    plain_rows: Tensor  # labelled rows without truncation (empty set)
    pieces: list
    kept: Tensor  # [n] bool: the label is in its row's kept set (True where the set is empty)
    tile_rows: int


def make_plan(ids: Tensor, offsets: Tensor, positions: Tensor, labels: Tensor, vocab_start: int,
              num_valid_cols: int, shard_cols: int, hidden_size: int, element_size: int, chunk_size: int) -> Plan:
    """The rows of a call sorted into plain rows and pieces (module doc); two host syncs."""
    device = ids.device
    n, total, e = positions.numel(), offsets.numel() - 1, ids.numel()
    sizes = offsets[1:] - offsets[:-1]
    position_of = torch.repeat_interleave(torch.arange(total, device=device), sizes, output_size=e)
    row_of_position = torch.full((total,), -1, dtype=torch.int64, device=device)
    row_of_position[positions] = torch.arange(n, device=device)
    row_of = row_of_position[position_of]  # the labelled row of each entry, -1 at ignored positions
    row_safe = row_of.clamp(min=0)
    hit = (row_of >= 0) & (ids == labels[row_safe]) if n else torch.zeros_like(row_of, dtype=torch.bool)
    has_set = sizes.index_select(0, positions) > 0
    kept = ~has_set | (torch.zeros(n, dtype=torch.int64, device=device).index_add_(0, row_safe, hit.long()) > 0)
    local = ids - vocab_start
    here = (row_of >= 0) & (local >= 0) & (local < num_valid_cols)
    num_set_rows, num_here = torch.stack([has_set.sum(), here.sum()]).tolist()  # host sync 1

    mask_rows = torch.nonzero_static(has_set, size=num_set_rows).squeeze(1)
    plain_rows = torch.nonzero_static(~has_set, size=n - num_set_rows).squeeze(1)
    rank = torch.cumsum(has_set, 0) - 1  # a labelled row's index among the rows with a set
    chosen = torch.nonzero_static(here, size=num_here).squeeze(1)
    entry_row = rank.index_select(0, row_of.index_select(0, chosen))  # non-decreasing (CSR order)
    entry_col = local.index_select(0, chosen)
    entry_target = hit.index_select(0, chosen)
    per_row = torch.zeros(num_set_rows, dtype=torch.int64, device=device).index_add_(  # (bincount syncs)
        0, entry_row, torch.ones_like(entry_row))
    entry_slot = torch.arange(num_here, device=device) - (torch.cumsum(per_row, 0) - per_row).index_select(0, entry_row)
    # Tiles take the rows in order of their number of kept ids here: a tile's entries are padded to
    # its widest row, so a few large sets among small ones would otherwise pad every tile they fall
    # in (up to [N, largest set]); sorted, the padded entries stay about the mask's own size.
    per_row, order = torch.sort(per_row, stable=True)
    position = torch.empty_like(order).index_copy_(0, order, torch.arange(num_set_rows, device=device))
    entry_row = position.index_select(0, entry_row)  # from here on, a row's place in that order
    mask_rows = mask_rows.index_select(0, order)

    # union size and widest row of every tile, for each candidate tile size: one sort shared
    candidates = tile_candidates(chunk_size, num_set_rows)
    order = torch.argsort(entry_col * max(num_set_rows, 1) + entry_row)
    sorted_col, sorted_row = entry_col[order], entry_row[order]
    same_col = sorted_col[1:] == sorted_col[:-1]
    summaries = []
    for size in candidates:
        tiles = -(-num_set_rows // size)
        tile = sorted_row // size
        first_in_tile = torch.ones_like(tile, dtype=torch.bool)
        first_in_tile[1:] = ~(same_col & (tile[1:] == tile[:-1]))
        union = torch.zeros(tiles, dtype=torch.int64, device=device).index_add_(0, tile, first_in_tile.long())
        padded = torch.zeros(tiles * size, dtype=torch.int64, device=device)
        padded[:num_set_rows] = per_row
        summaries += [union, padded.view(tiles, size).amax(dim=1)]
    values = torch.cat(summaries).tolist() if summaries else []  # host sync 2

    best = None
    for size in candidates:
        tiles = -(-num_set_rows // size)
        union, slots = values[:tiles], values[tiles:2 * tiles]
        values = values[2 * tiles:]
        rows = [min(size, num_set_rows - t * size) for t in range(tiles)]
        dense_chunk = min(chunk_size, num_set_rows)
        sparse = [_sparse_cost(r, u, hidden_size, element_size) <= _dense_cost(r, num_valid_cols, hidden_size,
                                                                              element_size, dense_chunk)
                  for r, u in zip(rows, union)]
        if FORCE_PIECES is not None:
            sparse = [FORCE_PIECES == "sparse"] * tiles
        cost = sum(_sparse_cost(r, u, hidden_size, element_size) if s
                   else _dense_cost(r, num_valid_cols, hidden_size, element_size, dense_chunk)
                   for r, u, s in zip(rows, union, sparse))
        if best is None or cost < best[0]:
            best = (cost, size, union, slots, rows, sparse)
        if FORCE_PIECES is not None:
            break
    if best is None:
        return Plan(plain_rows, [], kept, 0)
    _, size, union, slots, rows, sparse = best
    return Plan(plain_rows, _pieces(size, union, slots, rows, sparse, mask_rows, entry_row, entry_col, entry_slot,
                                    entry_target, num_valid_cols, shard_cols, chunk_size), kept, size)


def _pieces(size, union, slots, rows, sparse, mask_rows, entry_row, entry_col, entry_slot, entry_target,
            num_valid_cols, shard_cols, chunk_size) -> list:
    """Pieces of the chosen tiling: each sparse tile alone, dense tiles grouped into chunks; every
    entry's padded slot and its position in its piece's block, made for all pieces at once."""
    device = mask_rows.device
    tiles = len(rows)
    group = max(1, chunk_size // size)
    dense = [t for t in range(tiles) if not sparse[t]]
    members = [[t] for t in range(tiles) if sparse[t]] + [dense[i:i + group] for i in range(0, len(dense), group)]
    piece_of, offset_in_piece = [0] * tiles, [0] * tiles
    piece_rows, piece_slots, piece_cols, bases = [], [], [], []
    union_start, base = [0] * tiles, 0
    sparse_tiles = [t for t in range(tiles) if sparse[t]]
    running = 0
    for t in sparse_tiles:
        union_start[t] = running
        running += union[t]
    for index, tiles_of in enumerate(members):
        count = 0
        for t in tiles_of:
            piece_of[t], offset_in_piece[t] = index, count
            count += rows[t]
        width = max(slots[t] for t in tiles_of)
        piece_rows.append(count)
        piece_slots.append(width)
        piece_cols.append(union[tiles_of[0]] if sparse[tiles_of[0]] else shard_cols)  # dense: padding too
        bases.append(base)
        base += count * width

    def table(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    entry_tile = entry_row // size
    piece = table(piece_of).index_select(0, entry_tile) if tiles else entry_tile
    row_in_piece = table(offset_in_piece).index_select(0, entry_tile) + entry_row - entry_tile * size
    col_in_piece = entry_col
    is_sparse = table([int(s) for s in sparse]).index_select(0, entry_tile).bool()
    unique_keys = None
    if sparse_tiles:  # each sparse tile's union, sorted: keys tile * V + column, unique
        keys = entry_tile * num_valid_cols + entry_col
        # entries of dense tiles sort last, as one key that is never kept (no host sync to drop them)
        never = torch.iinfo(torch.int64).max
        sorted_keys = torch.where(is_sparse, keys, never).sort().values
        fresh = sorted_keys != never
        fresh[1:] &= sorted_keys[1:] != sorted_keys[:-1]
        unique_keys = sorted_keys[torch.nonzero_static(fresh, size=running).squeeze(1)]
        rank = torch.searchsorted(unique_keys, keys) - table(union_start).index_select(0, entry_tile)
        col_in_piece = torch.where(is_sparse, rank, entry_col)
    width = table(piece_slots).index_select(0, piece)
    where = table(bases).index_select(0, piece) + row_in_piece * width + entry_slot
    flat = torch.full((base,), -1, dtype=torch.int64, device=device)
    flat[where] = row_in_piece * table(piece_cols).index_select(0, piece) + col_in_piece
    target = torch.zeros(base, dtype=torch.bool, device=device)
    target[where] = entry_target

    pieces = []
    for index, tiles_of in enumerate(members):
        ranges = [torch.arange(t * size, t * size + rows[t], device=device) for t in tiles_of]
        piece_block = slice(bases[index], bases[index] + piece_rows[index] * piece_slots[index])
        cols = None
        if sparse[tiles_of[0]]:
            t = tiles_of[0]
            cols = unique_keys[union_start[t]:union_start[t] + union[t]] - t * num_valid_cols
        pieces.append(Piece(
            rows=mask_rows.index_select(0, ranges[0] if len(ranges) == 1 else torch.cat(ranges)),
            cols=cols, num_cols=piece_cols[index],
            flat_index=flat[piece_block].view(piece_rows[index], piece_slots[index]),
            is_target=target[piece_block].view(piece_rows[index], piece_slots[index])))
        PIECE_COUNTS["sparse_pieces" if cols is not None else "dense_pieces"] += 1
        PIECE_COUNTS["sparse_rows" if cols is not None else "dense_rows"] += piece_rows[index]
        if cols is not None:
            PIECE_COUNTS["sparse_union_cols"] += piece_cols[index]
    return pieces


# --------------------------------------------------------------------------------------------
# Forward and backward
# --------------------------------------------------------------------------------------------
@dataclass
class ReplayStats:
    """Per labelled row (fp32 [n] unless noted), over its kept set (the whole vocab where the set
    is empty): lse = max + log_sum_exp."""

    target: Tensor  # z_y (0 where y is not kept)
    lse: Tensor
    entropy: Optional[Tensor]  # of q
    max: Tensor  # not differentiable
    log_sum_exp: Tensor  # not differentiable
    kept: Tensor  # bool


def _piece_block(piece: Piece, weight: Tensor) -> Tensor:
    """The weight rows of a piece's block: the whole shard, or its gathered union."""
    return weight if piece.cols is None else weight.index_select(0, piece.cols)


def _forward(rows: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec, plan: Plan):
    """(MergedStats of every labelled row, the entries' z of each piece)."""
    backend = spec.backend
    parts, order, entry_z = [], [], []
    plain = plan.plain_rows
    PIECE_COUNTS["plain_rows"] += plain.numel()
    parts.append(shard_partials(rows.index_select(0, plain), weight, local_target.index_select(0, plain), spec))
    order.append(plain)
    for piece in plan.pieces:
        if piece.flat_index.shape[1] == 0:  # no kept id of these rows on this shard
            stats, z = backend.entry_stats(rows.new_zeros(0, 0), piece.flat_index, piece.is_target,
                                           spec.inv_temperature, spec.want_entropy)
        else:
            h = rows.index_select(0, piece.rows)
            logits = (chunk_logits(h, weight, spec) if piece.cols is None
                      else logits_gemm(h, _piece_block(piece, weight), spec.logits_dtype))
            stats, z = backend.entry_stats(logits, piece.flat_index, piece.is_target, spec.inv_temperature,
                                           spec.want_entropy)
            del logits
        parts.append(stats)
        order.append(piece.rows)
        entry_z.append(z)
    order = torch.cat(order)
    n = rows.shape[0]

    def in_row_order(name):
        if getattr(parts[0], name) is None:
            return None
        values = torch.cat([getattr(p, name) for p in parts])
        return torch.empty(n, dtype=values.dtype, device=values.device).index_copy_(0, order, values)

    stats = ShardStats(max=in_row_order("max"), sum_exp=in_row_order("sum_exp"), target=in_row_order("target"),
                       sum_exp_shifted=in_row_order("sum_exp_shifted"))
    return reductions.merge_shard_stats(stats, spec.tp_group), entry_z


class LinearReplayStats(torch.autograd.Function):
    """(hidden, weight shard) -> z_y, lse and entropy over each labelled row's kept set
    (differentiable), plus lse's parts (max, log_sum_exp) for precise log-probs."""

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, plan: Plan):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        merged, entry_z = _forward(labelled_rows(full_hidden, row_index), weight, local_target, spec, plan)
        ctx.spec, ctx.plan, ctx.full_shape = spec, plan, full_hidden.shape
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, row_index, local_target, merged.lse, merged.entropy, merged.max,
                              merged.log_sum_exp, *entry_z)
        ctx.mark_non_differentiable(merged.max, merged.log_sum_exp)
        return merged.target, merged.lse, merged.entropy, merged.max, merged.log_sum_exp

    @staticmethod
    @first_order_only
    def backward(ctx, g_target, g_lse, g_entropy, *unused):
        hidden, weight, row_index, local_target, lse, entropy, row_max, log_sum_exp, *entry_z = ctx.saved_tensors
        spec, plan = ctx.spec, ctx.plan
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        coefs = coefficients(g_target, g_lse, None, g_entropy, entropy, lse)
        with autocast_off(hidden.device):
            full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
            rows = labelled_rows(full_hidden, row_index)
            dx_rows = rows.new_zeros(rows.shape) if needs_dx else None
            into_main_grad = needs_dw and spec.main_grad_param is not None
            dw = None
            if needs_dw:  # fp32: sparse pieces add into rows of it, pieces and chunks accumulate
                dw = spec.main_grad_param.main_grad if into_main_grad else torch.zeros(
                    weight.shape, dtype=torch.float32, device=weight.device)
            if coefs is not None and rows.shape[0] > 0:
                _backward_pieces(rows, weight, local_target, spec, plan, coefs, row_max, log_sum_exp, entry_z,
                                 dx_rows, dw)
            grad_hidden = input_grad(dx_rows, row_index, ctx.full_shape, spec) if needs_dx else None
        grad_weight = None
        if into_main_grad:
            grad_weight = main_grad_added(spec.main_grad_param, weight)
        elif needs_dw:
            grad_weight = dw.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _backward_pieces(rows, weight, local_target, spec: ChunkSpec, plan: Plan, coefs: dict, row_max, log_sum_exp,
                     entry_z, dx_rows, dw) -> None:
    def pick(index):
        return {k: None if c is None else c.index_select(0, index) for k, c in coefs.items()}

    plain = plan.plain_rows
    if plain.numel():  # the plain recompute backward on these rows, into the same dX / dW
        dx_plain = None if dx_rows is None else rows.new_empty((plain.numel(), rows.shape[1]))
        backward_grads(rows.index_select(0, plain), weight, local_target.index_select(0, plain), spec,
                       (row_max.index_select(0, plain), log_sum_exp.index_select(0, plain)), pick(plain),
                       dx_plain, dw, dw_accumulate=True)
        if dx_plain is not None:
            dx_rows.index_copy_(0, plain, dx_plain)
    for piece, z in zip(plan.pieces, entry_z):
        if piece.flat_index.shape[1] == 0:
            continue  # no entry here: dX rows stay 0 (summed over TP ranks), dW untouched
        c = pick(piece.rows)
        h = rows.index_select(0, piece.rows)
        dlogits = spec.backend.entry_dlogits(
            piece.num_cols, h.dtype, piece.flat_index, piece.is_target, z, spec.inv_temperature,
            row_max.index_select(0, piece.rows), log_sum_exp.index_select(0, piece.rows), c["p"], c["pz"],
            c["target"])
        block = _piece_block(piece, weight)
        if dx_rows is not None:
            dx_rows.index_copy_(0, piece.rows, torch.mm(dlogits, block))
        if dw is not None:
            if piece.cols is None:
                matmul_into_(dw, dlogits.t(), h, accumulate=True, weight_grad_gemm=spec.backend.weight_grad_gemm)
            else:
                dw.index_add_(0, piece.cols, matmul_fp32(dlogits.t(), h))
        del dlogits, block


def replay_statistics(hidden2d: Tensor, weight: Tensor, row_index: Optional[Tensor], local_target: Tensor,
                      labels: Tensor, spec: ChunkSpec, ids: Tensor, offsets: Tensor, vocab_start: int,
                      needs_grad: bool) -> ReplayStats:
    """api.token_statistics' replay path: per labelled row (`labels` its global ids, `row_index`
    their flat positions, None = all), the statistics over its kept set."""
    positions = row_index if row_index is not None else torch.arange(labels.numel(), device=labels.device)
    plan = make_plan(ids, offsets, positions, labels, vocab_start, spec.num_valid_cols, weight.shape[0],
                     weight.shape[1], weight.element_size() if spec.logits_dtype is None else 4, spec.chunk_size)
    if needs_grad:
        target, lse, entropy, row_max, log_sum_exp = LinearReplayStats.apply(
            hidden2d, weight, row_index, local_target, spec, plan)
    else:  # reference / old log-prob passes: nothing saved
        full = reductions.gather_sequence(hidden2d, spec.tp_group) if spec.sequence_parallel else hidden2d
        merged, _ = _forward(labelled_rows(full, row_index), weight, local_target, spec, plan)
        target, lse, entropy = merged.target, merged.lse, merged.entropy
        row_max, log_sum_exp = merged.max, merged.log_sum_exp
    return ReplayStats(target=target, lse=lse, entropy=entropy, max=row_max, log_sum_exp=log_sum_exp,
                       kept=plan.kept)


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

