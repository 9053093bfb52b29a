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

    rows with an empty set   the plain path's partials over the whole shard (fast.shard_partials)
    rows with a kept set     in order of their number of kept ids on this shard, split into
                             tiles of R rows; per tile the union U of its kept ids on this shard,
                             and the cheaper of (cost model below)
                               sparse: gather W[U], one GEMM [R, H] x [H, |U|]
                               dense:  the logits over the whole shard (runs of dense tiles
                                       grouped into chunks)
                             each piece's kept entries read off its block of logits into one
                             padded array of slots (rows in blocks of one width), whose statistics
                             are then taken a block at a time (backends/replay_torch.py): a
                             piece launches its GEMMs and a few gathers, not the entry math
    one TP merge             the partials of every row (entries on other shards count there)
                             merged by reductions.merge_shard_stats: max, then one sum

The backward makes every slot's d/dz of q at once (from the slots' z saved by the forward: no
recompute of the logits; O(rows x K) floats), writes each piece's into its block of dlogits, then
dX = dlogits @ W[U] and dW[U] += dlogits.T @ h (sparse; W[U] gathered again) or the two GEMMs over
the whole shard (dense). Rows with an empty set take the plain recompute backward. dW: the
whole-shard GEMMs first, the first writing the buffer and the last (where no sparse piece
follows) adding the others' fp32 sum and writing the weight's dtype, as the plain path does; with
sparse pieces only, dW is summed in fp32 over the distinct kept ids alone and written into a zero
dW. A call whose tiles are all dense is so 3 GEMMs per chunk (the plain path's recompute
backward has 4) and a plan, with no sparse bookkeeping.

Cost model (`_sparse_cost` / `_dense_cost` / `_sparse_plan_cost`, seconds on a nominal GPU; only
ratios matter): a GEMM [m, k] x [k, n] costs max(2mnk / GEMM_FLOPS, (mk + kn + mn) b / BANDWIDTH)
+ KERNEL_S (the roofline, b bytes per element). A sparse tile of r rows and union u: its 3 GEMMs
(logits, dX, dW of [r, u]) + gathering W[U] twice (4 u H b bytes) + adding its fp32 dW[U] (12 u H
bytes) + zero filling its dlogits (r u b) + KERNELS_PER_TILE small kernels, times
SPARSE_MEASURED_FACTOR (what a GPU measured over that sum), or, where longer, the host time of launching its OPS_PER_TILE ops (HOST_OP_S each: eager PyTorch's cost per op, which
many small tiles would otherwise pay while the GPU idles). Dense rows: 3 GEMMs of a chunk over the
whole shard, per row, + writing their dlogits. A plan with sparse tiles also pays for its fp32 dW.
Each tile takes the cheaper; R is the candidate (the chunk size, halved down to MIN_TILE_ROWS) with
the least total, unless all dense costs less. Overlapping sets (a trained model: the kept ids of
different tokens are mostly the same frequent tokens) make u small and large tiles sparse;
independent random sets make u ~ R K, so small tiles are sparse when K is small and everything is
dense when K is large.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import reductions
from .agreement import integer_argument, is_int
from .backends import ShardStats
from .chunked import ChunkSpec, autocast_off, coefficients, first_order_only, input_grad, labelled_rows
from .fast import backward_grads, chunk_logits, grad_gemms, shard_partials
from .main_grad import main_grad_added
from .gemm import logits_gemm, matmul_fp32

# Cost model (module doc). Nominal H100 figures: bf16 GEMMs reach ~600 of the 989 TFLOP/s peak,
# HBM3 ~2.8 of 3.35 TB/s; a small kernel keeps the GPU ~4 us however little it does.
GEMM_FLOPS = 600e12
BANDWIDTH = 2.8e12
KERNEL_S = 4e-6
# Host time of one op launched from Python in eager mode (argument parsing, dispatcher, allocator,
# the launch; index ops with out= or index_put_ sit at the high end of ~5-20 us) with the views and
# slices around it: while a tile's kernels take less than its launches, the GPU waits for the host.
HOST_OP_S = 15e-6
# A sparse tile's small kernels: W[U] gathered twice, its entries read off, its dlogits block
# zeroed and written, dW[U] added; the ops it launches are those and its 3 GEMMs (tests count them).
KERNELS_PER_TILE = 6
OPS_PER_TILE = 9
# A sparse tile's GPU time over the sum above, as measured (docs/benchmarks.md, "Sampling-mask
# replay": the gathers, the scatter-add and GEMMs of any width run below the roofline that sum
# assumes, dense rows at it). Without it, tiles whose union is a quarter of the shard were taken
# sparse and the call ran slower than the plain op.
SPARSE_MEASURED_FACTOR = 2.8
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
# The plan of a call: which rows are plain, which tiles are sparse or dense
# --------------------------------------------------------------------------------------------
def _gemm_s(m: int, n: int, k: int, b: int) -> float:
    return max(2.0 * m * n * k / GEMM_FLOPS, (m * k + k * n + m * n) * b / BANDWIDTH) + KERNEL_S


def _sparse_cost(rows: int, union: int, hidden: int, b: int) -> float:
    """A sparse tile: its GPU time, or its host time where that is longer (the GPU then waits for
    the launches)."""
    if union == 0:
        return 0.0
    device = SPARSE_MEASURED_FACTOR * (
        3 * _gemm_s(rows, union, hidden, b) + (4 * b + 12) * union * hidden / BANDWIDTH
        + rows * union * b / BANDWIDTH + KERNELS_PER_TILE * KERNEL_S)
    return max(device, OPS_PER_TILE * HOST_OP_S)


def _dense_cost(rows: int, cols: int, hidden: int, b: int, chunk: int) -> float:
    return rows * (3 * _gemm_s(chunk, cols, hidden, b) / chunk + cols * b / BANDWIDTH)


def _sparse_plan_cost(cols: int, hidden: int, only_sparse: bool, distinct: int) -> float:
    """Once per plan with sparse tiles, for dW. Beside whole-shard GEMMs: the shard's dW summed in
    fp32 and cast at the end (read 4, write 2 bytes per element). Sparse tiles only: the rows of the
    `distinct` kept ids summed in fp32 (zero fill, cast: 4 + 4 + 2 bytes), written into the zero
    filled dW (2 + 2 bytes), the other rows' zero fill (2 bytes)."""
    if only_sparse:
        return (14 * distinct + 2 * cols) * hidden / BANDWIDTH
    return 6 * cols * hidden / BANDWIDTH


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
    """Consecutive rows of the plan's order scored on one block of logits: the whole shard (`cols`
    None) or the gathered columns `cols` (sorted local ids, the rows' union)."""

    rows: Tensor  # [r] indices into the labelled rows (a view of Plan.set_rows)
    start: int  # the rows are Plan.set_rows[start:end]
    end: int
    cols: Optional[Tensor]
    num_cols: int
    union_rows: Optional[Tensor]  # sparse, with Plan.union_cols: the places of `cols` in it
    slot_start: int  # their entries are the slots [slot_start, slot_end) of the plan's slot arrays
    slot_end: int
    empty: bool  # none of the rows keeps an id on this shard (their slots are padding)


@dataclass
class Plan:
    plain_rows: Tensor  # labelled rows without truncation (empty set)
    pieces: list
    kept: Tensor  # [n] bool: the label is in its row's kept set (True where the set is empty)
    tile_rows: int
    set_rows: Tensor  # [S] the labelled rows with a set, in order of their number of kept ids here
    order: Tensor  # cat(plain_rows, set_rows): the labelled row of each statistic as computed
    # The kept entries here, padded: rows set_rows[start:end] hold `width` slots each, the slots
    # [base, base + (end - start) * width) of the arrays below, per block (start, end, width, base).
    blocks: list
    src: Tensor  # [slots] int64: the slot's place in its piece's block of logits (row * cols + col; 0 if empty)
    dst: Tensor  # [slots] int64: src, or for an empty slot the piece's spare element (rows * cols)
    valid: Tensor  # [slots] bool: the slot holds an entry
    is_target: Tensor  # [slots] bool: the entry is the row's label
    # Only sparse pieces (no plain row, no dense piece): the sorted kept ids here, the rows of dW
    # that the backward sums in fp32 (the others are 0).
    union_cols: Optional[Tensor] = None


def _width_blocks(class_end: list, class_width: list, num_rows: int) -> list:
    """(start, end, width, base) of the rows in entry-count octaves [1, 2), [2, 4), ... (count 0
    with 1): rows sorted by count, so a block's width (its last row's count) is less than twice any
    of its rows' count and the padded slots stay under 2 x (entries + rows)."""
    blocks, start, base = [], 0, 0
    for end, width in zip(class_end, class_width):
        if end > start:
            blocks.append((start, end, width, base))
            base += (end - start) * width
            start = end
    assert start == num_rows, (start, num_rows)
    return blocks


def _slot_of_row(blocks: list, row: int) -> int:
    """The first slot of row `row` of the plan's order (the total past the last row)."""
    for start, end, width, base in blocks:
        if row < end:
            return base + (row - start) * width
    return blocks[-1][3] + (blocks[-1][1] - blocks[-1][0]) * blocks[-1][2] if blocks else 0


ENTRY_COUNT_OCTAVES = 40  # entry-count classes [1, 2), ..., [2^39, 2^40): more than any shard holds


def make_plan(ids: Tensor, offsets: Tensor, positions: Optional[Tensor], labels: Tensor, vocab_start: int,
              num_valid_cols: int, shard_cols: int, hidden_size: int, element_size: int, chunk_size: int) -> Plan:
    """The rows of a call sorted into plain rows and pieces (module doc): `positions` are the flat
    positions of the labelled rows (None: every position, in order). Two host syncs. Counting
    is by prefix sums, not index_add_: an index_add_ of many entries into few counters serializes
    on the GPU's atomics."""
    device = ids.device
    total, e = offsets.numel() - 1, ids.numel()
    n = total if positions is None else positions.numel()

    def table(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    position_of = torch.repeat_interleave(torch.arange(total, device=device), offsets[1:] - offsets[:-1],
                                          output_size=e)
    local = ids - vocab_start
    here = (local >= 0) & (local < num_valid_cols)
    if positions is None:  # every position labelled, row i at position i
        hit = ids == labels.index_select(0, position_of)
        starts, ends = offsets[:-1], offsets[1:]
    else:
        row_of_position = torch.full((total,), -1, dtype=torch.int64, device=device)
        row_of_position[positions] = torch.arange(n, device=device)
        row_of = row_of_position.index_select(0, position_of)  # each entry's labelled row, -1 at ignored positions
        labelled = row_of >= 0
        hit = (labelled & (ids == labels.index_select(0, row_of.clamp(min=0)))) if n else torch.zeros_like(labelled)
        here &= labelled
        starts, ends = offsets.index_select(0, positions), offsets.index_select(0, positions + 1)
    # per labelled row: its entries that are the label, its entries on this shard, and how many
    # entries on this shard come before its first
    counts = []
    for flags in (hit, here):
        prefix = torch.zeros(e + 1, dtype=torch.int64, device=device)
        torch.cumsum(flags, 0, out=prefix[1:])
        counts.append((prefix.index_select(0, ends), prefix.index_select(0, starts)))
    hits = counts[0][0] - counts[0][1]
    here_before = counts[1][1]
    per_row_here = counts[1][0] - here_before
    has_set = ends > starts
    kept = ~has_set | (hits > 0)
    num_set_rows, num_here = torch.stack([has_set.sum(), per_row_here.sum()]).tolist()  # host sync 1

    plain_rows = torch.nonzero_static(~has_set, size=n - num_set_rows).squeeze(1)
    if num_set_rows == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Plan(plain_rows, [], kept, 0, empty, plain_rows, [], empty, empty, empty.bool(), empty.bool())
    mask_rows = torch.nonzero_static(has_set, size=num_set_rows).squeeze(1)
    # Rows in order of their number of kept ids here: a row's entries are padded to its block's
    # width, which is then never twice its own count.
    per_row, order = torch.sort(per_row_here.index_select(0, mask_rows), stable=True)
    set_rows = mask_rows.index_select(0, order)
    # the entries here, row after row in that order: (row, slot in the row, column, is the label)
    row_entry_start = torch.zeros(num_set_rows + 1, dtype=torch.int64, device=device)
    torch.cumsum(per_row, 0, out=row_entry_start[1:])
    entry_row = torch.repeat_interleave(torch.arange(num_set_rows, device=device), per_row, output_size=num_here)
    entry_slot = torch.arange(num_here, device=device) - row_entry_start.index_select(0, entry_row)
    chosen = torch.nonzero_static(here, size=num_here).squeeze(1)  # CSR order: a row's entries together
    entry = chosen.index_select(0, here_before.index_select(0, set_rows).index_select(0, entry_row) + entry_slot)
    entry_col = local.index_select(0, entry)
    entry_target = hit.index_select(0, entry)

    # Union of each tile, for every candidate tile size: an entry is new to its tile where the
    # previous row holding its column (-1: none) lies before the tile; one sort for all sizes.
    candidates = tile_candidates(chunk_size, num_set_rows)
    col_major = torch.argsort(entry_col * max(num_set_rows, 1) + entry_row)
    sorted_col, sorted_row = entry_col.index_select(0, col_major), entry_row.index_select(0, col_major)
    previous = torch.full((num_here,), -1, dtype=torch.int64, device=device)
    if num_here > 1:
        previous[1:] = torch.where(sorted_col[1:] == sorted_col[:-1], sorted_row[:-1], -1)
    previous_row = torch.empty_like(previous).index_copy_(0, col_major, previous)
    boundaries = [[min(t * size, num_set_rows) for t in range(-(-num_set_rows // size) + 1)] for size in candidates]
    summaries = []
    # candidates in groups of at most a chunk of logits' elements ([sizes, entries] tensors)
    group = max(1, chunk_size * shard_cols // (num_here + 1))
    for first in range(0, len(candidates), group):
        sizes = candidates[first:first + group]
        tile_start = entry_row - torch.remainder(entry_row, table(sizes).unsqueeze(1))
        new_in_tile = torch.zeros(len(sizes), num_here + 1, dtype=torch.int64, device=device)
        torch.cumsum(previous_row < tile_start, 1, out=new_in_tile[:, 1:])
        edges = [(i, row) for i, size in enumerate(sizes) for row in boundaries[first + i]]
        at = row_entry_start.index_select(0, table([row for _, row in edges])) + table([i * (num_here + 1)
                                                                                         for i, _ in edges])
        summaries.append(new_in_tile.view(-1).index_select(0, at))
    first_of_col = previous < 0
    summaries.append(first_of_col.sum().view(1))  # the distinct kept ids here
    # entry-count octaves: where each ends in the sorted counts, and its widest row
    class_end = torch.searchsorted(per_row, 2 ** torch.arange(1, ENTRY_COUNT_OCTAVES + 1, device=device))
    summaries += [class_end, per_row.index_select(0, (class_end - 1).clamp(min=0))]
    values = torch.cat(summaries).tolist()  # host sync 2

    unions, distinct = [], values.pop(-2 * ENTRY_COUNT_OCTAVES - 1)
    for edges in boundaries:
        at, values = values[:len(edges)], values[len(edges):]
        unions.append([b - a for a, b in zip(at[:-1], at[1:])])
    # Each tile takes the cheaper kind; a plan with sparse tiles also pays for dW in an fp32 buffer
    # (written in the weight's dtype by the last chunk GEMM otherwise); all dense is always an option.
    dense_chunk = min(chunk_size, num_set_rows)
    rows_of = [[b - a for a, b in zip(edges[:-1], edges[1:])] for edges in boundaries]
    all_dense = (sum(_dense_cost(r, num_valid_cols, hidden_size, element_size, dense_chunk) for r in rows_of[0]),
                 0, [False] * len(rows_of[0]))
    best = None if FORCE_PIECES == "sparse" else all_dense
    for index, (rows, union) in enumerate(zip(rows_of, unions)):
        if FORCE_PIECES is not None:
            break
        sparse = [_sparse_cost(r, u, hidden_size, element_size)
                  <= _dense_cost(r, num_valid_cols, hidden_size, element_size, dense_chunk)
                  for r, u in zip(rows, union)]
        if not any(sparse):
            continue
        cost = (sum(_sparse_cost(r, u, hidden_size, element_size) if s
                    else _dense_cost(r, num_valid_cols, hidden_size, element_size, dense_chunk)
                    for r, u, s in zip(rows, union, sparse))
                + _sparse_plan_cost(shard_cols, hidden_size, all(sparse) and plain_rows.numel() == 0, distinct))
        if cost < best[0]:
            best = (cost, index, sparse)
    if best is None:  # every tile sparse, at the largest size
        best = (0.0, 0, [True] * len(rows_of[0]))
    blocks = _width_blocks(values[:ENTRY_COUNT_OCTAVES], values[ENTRY_COUNT_OCTAVES:], num_set_rows)
    _, index, sparse = best
    union_cols = None
    if all(sparse) and plain_rows.numel() == 0:
        union_cols = sorted_col.index_select(0, torch.nonzero_static(first_of_col, size=distinct).squeeze(1))
    return _layout(candidates[index], boundaries[index], unions[index], sparse, blocks, plain_rows, set_rows, kept,
                   entry_row, entry_slot, entry_col, entry_target, num_valid_cols, shard_cols, chunk_size, union_cols)


def _layout(size, edges, union, sparse, blocks, plain_rows, set_rows, kept, entry_row, entry_slot, entry_col,
            entry_target, num_valid_cols, shard_cols, chunk_size, union_cols) -> Plan:
    """The pieces of the chosen tiling (each sparse tile alone, runs of dense tiles grouped into
    chunks) and the slot arrays of every entry, made for all pieces at once."""
    device = set_rows.device

    def table(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    tiles = len(edges) - 1
    group = max(1, chunk_size // size)
    runs, t = [], 0  # (first tile, end tile, sparse)
    while t < tiles:
        end = t + 1
        if not sparse[t]:
            while end < tiles and not sparse[end] and end - t < group:
                end += 1
        runs.append((t, end, sparse[t]))
        t = end
    sparse_tiles = [t for t in range(tiles) if sparse[t]]
    union_start, running = [0] * tiles, 0
    for t in sparse_tiles:
        union_start[t] = running
        running += union[t]
    num_slots = _slot_of_row(blocks, edges[-1])

    # per tile: the first row of its piece and the piece's block width
    piece_row, piece_cols = [0] * tiles, [0] * tiles
    for first, end, is_sparse in runs:
        for t in range(first, end):
            piece_row[t] = edges[first]
            piece_cols[t] = union[t] if is_sparse else shard_cols
    entry_tile = torch.div(entry_row, size, rounding_mode="floor")
    col_in_piece = entry_col
    if sparse_tiles:  # each sparse tile's union, sorted: keys tile * V + column, unique
        keys = entry_tile * num_valid_cols + entry_col
        if len(sparse_tiles) < tiles:
            is_sparse = table([int(s) for s in sparse]).index_select(0, entry_tile).bool()
            # entries of dense tiles sort last, as one key that is never kept (no host sync to drop them)
            sorted_keys = torch.where(is_sparse, keys, torch.iinfo(torch.int64).max).sort().values
        else:
            sorted_keys = keys.sort().values
        fresh = torch.ones_like(sorted_keys, dtype=torch.bool)
        fresh[1:] = sorted_keys[1:] != sorted_keys[:-1]
        if len(sparse_tiles) < tiles:
            fresh &= sorted_keys != torch.iinfo(torch.int64).max
        unique_keys = sorted_keys.index_select(0, torch.nonzero_static(fresh, size=running).squeeze(1))
        rank = torch.searchsorted(unique_keys, keys) - table(union_start).index_select(0, entry_tile)
        col_in_piece = rank if len(sparse_tiles) == tiles else torch.where(is_sparse, rank, entry_col)
        all_cols = torch.remainder(unique_keys, num_valid_cols)
        if union_cols is not None:
            all_union_rows = torch.searchsorted(union_cols, all_cols)
    src_entry = ((entry_row - table(piece_row).index_select(0, entry_tile))
                 * table(piece_cols).index_select(0, entry_tile) + col_in_piece)
    # each row's first slot: its block's base + its place in the block x the block's width
    lengths = table([end - start for start, end, _, _ in blocks])
    row_slot = (torch.repeat_interleave(table([base - start * w for start, _, w, base in blocks]), lengths,
                                        output_size=set_rows.numel())
                + torch.arange(set_rows.numel(), device=device)
                * torch.repeat_interleave(table([w for _, _, w, _ in blocks]), lengths, output_size=set_rows.numel()))
    slot = row_slot.index_select(0, entry_row) + entry_slot
    valid = torch.zeros(num_slots, dtype=torch.bool, device=device).index_fill_(0, slot, True)
    is_target = torch.zeros(num_slots, dtype=torch.bool, device=device).index_put_((slot,), entry_target)
    src = torch.zeros(num_slots, dtype=torch.int64, device=device).index_copy_(0, slot, src_entry)
    # dst: an empty slot's write in the backward goes to its piece's spare element (rows x cols)
    slot_edges = [_slot_of_row(blocks, edges[first]) for first, _, _ in runs] + [num_slots]
    spare = [(edges[end] - edges[first]) * piece_cols[first] for first, end, _ in runs]
    dst = torch.repeat_interleave(table(spare), table([b - a for a, b in zip(slot_edges[:-1], slot_edges[1:])]),
                                  output_size=num_slots).index_copy_(0, slot, src_entry)

    pieces = []
    for first, end, is_sparse in runs:
        start, stop = edges[first], edges[end]
        span = slice(union_start[first], union_start[first] + union[first])
        piece = Piece(rows=set_rows[start:stop], start=start, end=stop, cols=all_cols[span] if is_sparse else None,
                      num_cols=union[first] if is_sparse else shard_cols,
                      union_rows=all_union_rows[span] if union_cols is not None else None,
                      slot_start=slot_edges[len(pieces)], slot_end=slot_edges[len(pieces) + 1],
                      empty=sum(union[first:end]) == 0)
        pieces.append(piece)
        PIECE_COUNTS["sparse_pieces" if is_sparse else "dense_pieces"] += 1
        PIECE_COUNTS["sparse_rows" if is_sparse else "dense_rows"] += stop - start
        if is_sparse:
            PIECE_COUNTS["sparse_union_cols"] += piece.num_cols
    return Plan(plain_rows, pieces, kept, size, set_rows, torch.cat([plain_rows, set_rows]), blocks, src, dst, valid,
                is_target, union_cols)


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


def _piece_logits(h: Tensor, weight: Tensor, piece: Piece, spec: ChunkSpec) -> Tensor:
    if piece.cols is None:
        return chunk_logits(h, weight, spec)
    return logits_gemm(h, weight.index_select(0, piece.cols), spec.logits_dtype)


def _forward(rows: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec, plan: Plan):
    """(MergedStats of every labelled row, the fp32 z of the entry slots, None without a set)."""
    plain = plan.plain_rows
    PIECE_COUNTS["plain_rows"] += plain.numel()
    parts, z = [], None
    if plain.numel() or not plan.set_rows.numel():
        parts.append(shard_partials(rows.index_select(0, plain), weight, local_target.index_select(0, plain), spec))
    if plan.set_rows.numel():
        h_sorted = rows.index_select(0, plan.set_rows)
        raw = torch.zeros(plan.src.numel(), dtype=spec.logits_dtype or rows.dtype, device=rows.device)
        for piece in plan.pieces:
            if piece.empty:  # no kept id of these rows on this shard
                continue
            logits = _piece_logits(h_sorted[piece.start:piece.end], weight, piece, spec)
            span = slice(piece.slot_start, piece.slot_end)
            torch.index_select(logits.view(-1), 0, plan.src[span], out=raw[span])
            del logits
        z = raw.float()
        if spec.inv_temperature != 1.0:
            z = z * spec.inv_temperature
        parts.append(spec.backend.entry_stats(z, plan.valid, plan.is_target, plan.blocks, spec.want_entropy))
    n = rows.shape[0]

    def in_row_order(name):
        if getattr(parts[0], name) is None:
            return None
        values = torch.cat([getattr(p, name) for p in parts]) if len(parts) > 1 else getattr(parts[0], name)
        return torch.empty(n, dtype=values.dtype, device=values.device).index_copy_(0, plan.order, values)

    stats = ShardStats(max=in_row_order("max"), sum_exp=in_row_order("sum_exp"), target=in_row_order("target"),
                       sum_exp_shifted=in_row_order("sum_exp_shifted"))
    return reductions.merge_shard_stats(stats, spec.tp_group), z


class LinearReplayStats(torch.autograd.Function):
    """(hidden, weight shard) -> z_y, lse and entropy over each labelled row's kept set
    (differentiable), plus lse's parts (max, log_sum_exp) for precise log-probs."""

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, plan: Plan):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        merged, z = _forward(labelled_rows(full_hidden, row_index), weight, local_target, spec, plan)
        ctx.spec, ctx.plan, ctx.full_shape = spec, plan, full_hidden.shape
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, row_index, local_target, merged.lse, merged.entropy, merged.max,
                              merged.log_sum_exp, z)
        ctx.mark_non_differentiable(merged.max, merged.log_sum_exp)
        return merged.target, merged.lse, merged.entropy, merged.max, merged.log_sum_exp

    @staticmethod
    @first_order_only
    def backward(ctx, g_target, g_lse, g_entropy, *unused):
        hidden, weight, row_index, local_target, lse, entropy, row_max, log_sum_exp, z = ctx.saved_tensors
        spec, plan = ctx.spec, ctx.plan
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        coefs = coefficients(g_target, g_lse, None, g_entropy, entropy, lse)
        into_main_grad = needs_dw and spec.main_grad_param is not None
        with autocast_off(hidden.device):
            full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
            rows = labelled_rows(full_hidden, row_index)
            if coefs is not None and rows.shape[0] > 0:
                dx_rows, dw = _backward(rows, weight, local_target, spec, plan, coefs, row_max, log_sum_exp, z,
                                        needs_dx, needs_dw)
            else:  # nothing depends on the statistics: zero gradients
                dx_rows = rows.new_zeros(rows.shape) if needs_dx else None
                dw = torch.zeros_like(weight) if needs_dw and not into_main_grad else None
            grad_hidden = input_grad(dx_rows, row_index, ctx.full_shape, spec) if needs_dx else None
        grad_weight = main_grad_added(spec.main_grad_param, weight) if into_main_grad else dw
        return grad_hidden, grad_weight, None, None, None, None


def _backward(rows, weight, local_target, spec: ChunkSpec, plan: Plan, coefs: dict, row_max, log_sum_exp, z,
              needs_dx: bool, needs_dw: bool):
    """(dX of the labelled rows or None, dW in the weight's dtype, or None where it went into
    main_grad or is not needed).

    dW: the GEMMs over the whole shard (plain chunks, dense pieces) run first, the first of them
    writing the buffer (no zero fill), the last adding the fp32 sum of the others and writing the
    weight's dtype where nothing follows (fast.last_weight_grad); sparse pieces add their rows into
    the fp32 sum after them."""
    into_main_grad = needs_dw and spec.main_grad_param is not None

    def pick(index):
        return {k: None if c is None else c.index_select(0, index) for k, c in coefs.items()}

    plain, set_rows = plan.plain_rows, plan.set_rows
    pieces = [p for p in plan.pieces if not p.empty]
    dense = [p for p in pieces if p.cols is None]
    sparse = [p for p in pieces if p.cols is not None]
    plain_chunks = -(-plain.numel() // spec.chunk_size)
    full_writes = plain_chunks + len(dense)
    dw = None
    compact = needs_dw and not into_main_grad and plan.union_cols is not None
    if needs_dw:
        if into_main_grad:
            dw = spec.main_grad_param.main_grad
        elif compact:  # only sparse pieces: dW's rows of the kept ids, in fp32
            dw = torch.zeros((plan.union_cols.numel(), weight.shape[1]), dtype=torch.float32, device=weight.device)
        elif full_writes == 1 and not sparse:  # one GEMM writes dW in the weight's dtype (fp32 inside)
            dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        else:
            dw = (torch.empty if full_writes else torch.zeros)(weight.shape, dtype=torch.float32, device=weight.device)
    cast_last = (weight.dtype if dw is not None and not into_main_grad and not sparse and dw.dtype != weight.dtype
                 else None)
    dw_done = None  # dW in the weight's dtype, written by the last full-shard GEMM
    dx_rows = rows.new_empty(rows.shape) if needs_dx else None
    if plain.numel():  # the plain recompute backward on these rows, into the same dX / dW
        dx_plain = None if dx_rows is None else rows.new_empty((plain.numel(), rows.shape[1]))
        dw_done = backward_grads(rows.index_select(0, plain), weight, local_target.index_select(0, plain), spec,
                                 (row_max.index_select(0, plain), log_sum_exp.index_select(0, plain)), pick(plain),
                                 dx_plain, dw, dw_accumulate=into_main_grad, cast_dw_to=None if dense else cast_last)
        if dx_plain is not None:
            dx_rows.index_copy_(0, plain, dx_plain)
    if set_rows.numel():
        c = pick(set_rows)
        # the entries' dlogits, every slot of every piece at once (0 in empty slots)
        grads = spec.backend.entry_dlogits(z, plan.valid, plan.is_target, plan.blocks, spec.inv_temperature,
                                           row_max.index_select(0, set_rows), log_sum_exp.index_select(0, set_rows),
                                           c["p"], c["pz"], c["target"], rows.dtype)
        h_sorted = rows.index_select(0, set_rows)
        dx_sorted = rows.new_zeros((set_rows.numel(), rows.shape[1])) if dx_rows is not None else None
        written = plain_chunks
        for piece in dense + sparse:
            span = slice(piece.slot_start, piece.slot_end)
            r = piece.end - piece.start
            # the piece's block of dlogits: zeros, the entries written in (one spare element past
            # the block takes the empty slots' writes; every entry's place is unique)
            dlogits = torch.zeros(r * piece.num_cols + 1, dtype=rows.dtype, device=rows.device)
            dlogits.index_put_((plan.dst[span],), grads[span])
            dlogits = dlogits[:-1].view(r, piece.num_cols)
            h = h_sorted[piece.start:piece.end]
            dx_out = None if dx_sorted is None else dx_sorted[piece.start:piece.end]
            if piece.cols is None:
                last = written == full_writes - 1
                done = grad_gemms(dlogits, h, weight, spec, dx_out, dw, dw_accumulate=into_main_grad or written > 0,
                                  cast_dw_to=cast_last if last and written > 0 else None)
                written += 1
                dw_done = done if done is not None else dw_done
            else:
                block = weight.index_select(0, piece.cols)
                if dx_out is not None:
                    torch.mm(dlogits, block, out=dx_out)
                if dw is not None:
                    dw.index_add_(0, piece.union_rows if compact else piece.cols, matmul_fp32(dlogits.t(), h))
                del block
            del dlogits
        if dx_sorted is not None:
            dx_rows.index_copy_(0, set_rows, dx_sorted)
    if dw is None or into_main_grad:
        return dx_rows, None
    if compact:
        return dx_rows, torch.zeros_like(weight).index_copy_(0, plan.union_cols, dw.to(weight.dtype))
    if dw_done is not None:
        return dx_rows, dw_done
    return dx_rows, dw if dw.dtype == weight.dtype else dw.to(weight.dtype)


def replay_statistics(hidden2d: Tensor, weight: Tensor, row_index: Optional[Tensor], local_target: Tensor,
                      labels: Tensor, spec: ChunkSpec, ids: Tensor, offsets: Tensor, vocab_start: int,
                      needs_grad: bool) -> ReplayStats:
    """api.token_statistics' replay path: per labelled row (`labels` its global ids, `row_index`
    their flat positions, None = all), the statistics over its kept set."""
    plan = make_plan(ids, offsets, row_index, labels, vocab_start, spec.num_valid_cols, weight.shape[0],
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

