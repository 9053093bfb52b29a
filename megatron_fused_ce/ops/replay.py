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
scores them.

Checks, as for the other paths (api.py, agreement.py): the mask's presence, its positions and
whether it keeps any id are part of the call's signature; its contents and how many ids it keeps
are not (a sampler's sets change size every step: `layout_key`). The first call of a signature checks everything in the
one agreement (`MaskCheck.register`: a clear ValueError on every rank) and reads back how many
labelled rows have a set and how many have none; the signature remembers whether none lacked one
(api.py). A later call reads nothing: `deferred_poison` checks the offsets, ids and duplicates on
the device (NaN results, the error raised at the next host synchronization, deferred_errors.py)
and the mask's fingerprint rides on the statistics' all-gather (reductions.RankCheck). Every
call of a signature, the first included, is sized from what the host knows (at most min(rows, E)
rows with a set; `layout_offsets` keeps a bad mask's indexing in range), so that they compute
alike, bit for bit. The next call with the same arguments (the mask's layout, not how
many ids it keeps: `route_key`) runs them straight, without the argument handling
(remembered_routes.ReplayRoute).

The layout (`KeptEntries`) and the later calls' checks are defined here in torch: the CPU path and
the reference. A backend with `kept_layout` (Triton: backends/replay_triton.py) makes the same
fields, counts and verdict in a few launches, since each torch op costs a launch and its Python
on every call (some eighty of them): one program scanning the rows (the layout offsets, which rows
have a set, their slots, the row counts and the missing-set count), one program per row (its slot
or a padding slot, its entries' slot / column / valid / is-label, its label-kept flag, its ids'
range check, and an id twice in its set: the set sorted in the program, or a larger one through a
hash table of its own), and on a remembered signature one that ORs the verdict into
deferred_errors' flags and makes the NaN poison (`ReplayChunks.poison`, the label checks' added
in: the call's one poison). Where a remembered call at TP = 1 runs no plain pass (which alone reads
the labels' targets on the shard), the same two launches also make the rows' labelled flags from
the labels and check their range (`layout_checks_labels`): the label kernel's launch fewer. Tests
compare them field by field.

Per call, on each TP rank (every row of labels, ignored ones included, as in the other paths):

    rows with an empty set   the plain path's partials over the whole shard (fast.py's chunks):
                             every row's (how many is not known on the host; a set row's are
                             replaced by its set's), on every call of a signature whose first call
                             had a labelled row without a set, on none otherwise (RL: every
                             generated token has its set), where a later call checks on the device
                             that no labelled row lacks one (`missing_set_poison`: NaN, and an
                             error at the next host synchronization naming forget_signatures)
    rows with a kept set     tiles: the backend's `union_logits` (Triton, backends/
                             replay_union_triton.py): the set rows in tiles of TILE_ROWS slots,
                             each tile's rows times the W rows of the union of its sets' columns
                             (`UnionTiles`, gathered in the GEMM: a tensor-core product over the
                             ids the tile names, not the shard), then `entry_stats` as dense,
                             its launch reading the entries' z off those products; or
                             sparse: the backend's `kept_stats` (Triton: one kernel, a program per
                             row gathering the W rows of its kept ids and taking their dots, the
                             online max / sum-exp / entropy sums and the label's z; torch: the
                             same by blocks of entries and segment reductions), or
                             dense: fast.py's chunk GEMM over the whole shard, the kept entries'
                             z read off each chunk of logits, then the backend's `entry_stats`
                             over them (Triton: the kept_stats kernel reading z instead of taking
                             dots, one launch; torch: segment reductions)
    one TP merge             the partials of every row merged by reductions.merge_shard_stats;
                             at TP = 1 where every row is a slot, none: the statistics' launch
                             finishes each row (log S, lse, entropy, log-prob: the tail launch's
                             math, triton_math.store_merged_tail) and a row without a set's
                             placeholders

Backward (the chunk loop's recompute_grads): every entry's dlogits from the z the forward saved
(O(entries) floats, no recompute of the logits), the backend's `entry_dlogits` (Triton: one launch
over the entries, each reading its row's offsets and coefficients; torch: a dozen elementwise ops
and gathers, replay_torch.entry_dlogits, the reference), then sparse: the backend's `kept_grads`
(Triton: dX per row from the gathered W rows; dW from the entries sorted by id on the device, a
segmented sum per block and one fp32 atomic add per id and block, into the fp32 dW or Megatron's
main_grad) or tiles: the entries' dlogits written by that launch straight into the [unions,
TILE_ROWS] block of the slots' tiles and the [unions, COLUMN_TILE] block of the columns' (where a
log-prob's gradient alone comes back, the launch gates it by the rows' labelled and kept masks
itself: StraightReplay), dX of each tile's rows from its union's W rows, and dW by tiles of
COLUMN_TILE columns, each from the hidden rows whose sets name one of them
(`UnionTiles.of_columns`, the columns by classes of use; its layout made in the forward with
the slots', in one set of launches): every output row written by one program, no atomic adds
(`union_sum_rows`) or dense: each chunk's dlogits block (zeros, the
entries written in) times W and h, fast.py's GEMMs. Rows with an empty set take the plain recompute
backward. The dense route finds each chunk's entries by their place in the set rows' [slots,
V_local] logits (`KeptEntries.gather_chunk` / `scatter_chunk`: one launch per chunk with the layout
kernels), so that a chunk adds only its GEMMs, its rows' gather and those launches; where no plain
pass runs and every row is a slot (`ReplayChunks.by_rows`: RL, a set at every generated
token), the slots are the rows themselves: the GEMMs read the hidden rows and write dX in place,
and the first chunk's logits are launched ahead of the call as the plain paths' are
(fast.EarlyProduct); the union tiles likewise read the rows and write dX whole (no zeroing
before, no gather of the rows).

The route is decided from sizes the host already knows (no sync, `replay_route`): the tiles where
the backend has them and even sets without a shared id would multiply at most TILES_MAX_SHARE of
the dense route's columns (mean K <= V / 128 at TILE_ROWS = 32); else sparse while the kept
entries are at most SPARSE_MAX_SHARE of the set rows x the shard's vocab (mean K <= V / 640, V the
rank's columns: the set kernels walk every entry on every rank, the GEMMs shrink with the shard). Measured on
an H200 (tools/sampling_mask_bench.py, Zipf and random sets, K / V from 1/5120 to 1/641), a call
of sparse rows costs about 0.03 + 380 x K / V of plain log-probs (the backward's gathers and fp32
dW adds dominate), the dense route 0.70-0.88 (3 GEMMs per chunk against plain's 4): they cross
near K = V / 530. The tiles cost what their unions do (a tile of 32 Zipf sets of K = 50 names
4.4 % of a 19008-id shard, of random ones 8.1 %): on an H200 at K = 50 0.03-0.06 of plain on
the large shapes and 0.15-0.34 from CUDA graphs at N = 4096-8192, V = 19008-32064 (0.50-0.56
eager, the host's time), at K = 512 on the large shapes 0.11-0.32 (replay_route's doc).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import deferred_errors, reductions
from .agreement import integer_argument, is_int, tensor_fingerprint
from .backends import ShardStats
from .backends.triton_common import interpreting as _interpreting
from .fast import FAST_CHUNKS, backward_grads, chunk_logits, grad_gemms, row_chunks, shard_partials

# Sparse while entries <= SPARSE_MAX_SHARE x set rows x vocab (module doc).
SPARSE_MAX_SHARE = 1 / 640
# Union tiles (a backend with `union_logits`): slots of TILE_ROWS rows, each tile's GEMMs over the
# union of its rows' kept columns; taken where even sets without a shared id (a tile's union is its
# TILE_ROWS x K entries) would multiply at most TILES_MAX_SHARE of the dense route's columns
# (K <= V / 128). Measured on an H200 from CUDA graphs, x plain log-probs, against the dense
# route: at the bound (8192 x 4096 x 19008, K = 148) the tiles 0.51 / 0.84 (Zipf / random sets)
# against 0.92 / 0.94; past it (K = V / 95, tiles of 64 then) 0.67 / 1.17 against 0.95. Tiles of
# 32 rows and columns against 64 at K = 50 (the union kernels of one call, 8192 x 4096 x 19008):
# 1.10 -> 1.07 ms with Zipf sets, 1.86 -> 1.59 with random ones (half the products' work for a few
# more gathers; 4096 x 4096 x 32064 Zipf 0.78 -> 0.69); 64 stays ahead only at 2048 rows with Zipf
# sets (0.34 against 0.39 ms).
TILE_ROWS = 32
TILES_MAX_SHARE = 0.25
# dW's tiles: blocks of COLUMN_TILE columns (in the order of their use: columns_by_use), each
# against the rows whose sets name one of them
COLUMN_TILE = 32
USE_CLASSES = 32  # columns_by_use's classes (use_class: 2^15 or more entries share the last)
# The plain backward's row offset in rows with a set (ReplayChunks.recompute_grads): exp(z - it) = 0.
_ABOVE_EVERY_LOGIT = 3.0e38
# Tests and the benchmark force one kind: None (by sizes), "sparse", "tiles" or "dense" ("tiles"
# needs the backend's union kernels: dense without them).
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


def layout_key(mask_check: "MaskCheck") -> tuple:
    """A usable mask's part of a call's signature and of its call key: whether it keeps any id
    (a mask without one is not replayed), its number of positions, its device (MaskCheck.register_layout)."""
    return (mask_check.ids.numel() > 0, tuple(mask_check.offsets.shape), mask_check.ids.device.type)


def route_key(mask) -> Optional[tuple]:
    """A mask's part of a remembered route's key (remembered_routes.ReplayRoute): its tensors'
    dtypes and devices and its number of positions, not how many ids it keeps (a sampler's sets
    change size every step: layout_key); None where it is not two tensors (the general path)."""
    fields = _fields(mask)
    if fields is None or not all(isinstance(t, Tensor) for t in fields):
        return None
    ids, offsets = fields
    return ("sampling mask", ids.dtype, ids.device, ids.dim(), offsets.shape, offsets.dtype, offsets.device)


_DIFFER = ("sampling_mask: differs across tensor-parallel ranks (token ids or offsets, or a rank passed "
           "none); every rank of tp_group must pass the same mask")


class MaskCheck:
    """linear_logprobs' checks of `sampling_mask`. Host checks are read at construction
    (`problem`); the mask's layout joins the signature (`register_layout`); the ones on the device
    (offsets, ids, duplicates) and the mask's fingerprint join the one agreement of a signature's
    first call (`register_contents`), the same entries on every rank whether or not it holds a
    mask, so that a rank without a mask raises with its peers instead of hanging. A later call
    checks them on the device (`deferred_poison`, `fingerprint`)."""

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

    @property
    def usable(self) -> bool:
        return self.ids is not None and self.problem is None

    def register(self, agreement, device) -> None:
        """Add the mask's entries to the agreement (call at the same point on every rank)."""
        self.register_layout(agreement)
        self.register_contents(agreement, device)

    def register_layout(self, agreement) -> None:
        """The mask's layout (or its absence): plain values, part of the call's signature — its
        positions and whether it keeps any id, not how many: a sampler's sets change size from one
        step to the next (top-p, min-p, the number of generated tokens), and a signature per size
        would run the full agreement, a host synchronization, on every call. What the number of
        ids decides (the route, the layout's sizes) is decided from it on every call, and no
        collective depends on it; the ids themselves are checked on the device and compared
        across ranks by the mask's fingerprint (MaskCheck.fingerprint)."""
        agreement.equal("sampling_mask", layout_key(self) if self.usable else ("no mask", self.present), _DIFFER)

    def register_contents(self, agreement, device) -> None:
        """The mask's values (fingerprint) and the counts of its bad entries, computed on the
        device: read back by the full agreement only."""
        usable = self.usable
        agreement.equal_values("sampling_mask", torch.cat([self.offsets, self.ids]) if usable else None, _DIFFER)
        counts = (torch.cat([self._device_counts(), self._row_counts()]) if usable
                  else torch.zeros(5, dtype=torch.int64, device=device))
        self._key = agreement.maximum_counts("sampling_mask", counts)

    def _row_counts(self) -> Tensor:
        """[labelled positions with a kept set, labelled positions without one]: the sizes the
        first call of a signature reads (whether it needs the plain pass: api.py)."""
        zero = torch.zeros(2, dtype=torch.int64, device=self.ids.device)
        if self.offsets.numel() < 2 or not isinstance(self.labels, Tensor) or not is_int(self.ignore_index):
            return zero
        has_set = (self.offsets[1:] - self.offsets[:-1]) > 0
        labelled = self.labels.reshape(-1) != self.ignore_index
        return torch.stack([(has_set & labelled).sum(), (~has_set & labelled).sum()])

    def row_counts(self, agreed) -> Optional[tuple]:
        """(labelled rows with a set, without one), as the full agreement read them back."""
        return tuple(agreed[self._key][3:]) if self._key is not None else None

    def _device_counts(self) -> Tensor:
        """[bad offsets, ids out of range, duplicated ids] (no host read)."""
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
        return torch.stack([bad_offsets, bad_ids, duplicates])

    def deferred_poison(self) -> Tensor:
        """A remembered signature's check of the contents (deferred_errors.py): fp32 [1], NaN if
        the offsets, ids or sets are bad (recorded for the next host synchronization), else 0."""
        bad = (self._device_counts() > 0).any()
        deferred_errors.record(bad.to(torch.int64) * deferred_errors.SAMPLING_MASK_BAD)
        return torch.where(bad, float("nan"), 0.0).reshape(1).to(torch.float32)

    def fingerprint(self) -> Tensor:
        """int64 [2]: what TP ranks compare on a remembered signature (reductions.RankCheck)."""
        return tensor_fingerprint(torch.cat([self.offsets, self.ids]))

    def layout_offsets(self) -> Tensor:
        """The offsets the layout reads: the mask's own where they are valid; else clamped into
        [0, E], made non-decreasing, from 0 to E, so that a bad mask in a call that checks it on
        the device indexes nothing out of range (its results are NaN)."""
        offsets, e = self.offsets, self.ids.numel()
        inner = torch.cummax(offsets[1:-1].clamp(0, e), 0).values
        return torch.cat([offsets.new_zeros(1), inner, offsets.new_full((1,), e)])

    def messages(self, agreed) -> list:
        if self._key is None:
            return []
        bad_offsets, bad_ids, duplicates = agreed[self._key][:3]
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
    """Sparse (gathered rows) or dense (whole-shard GEMMs), from sizes the host knows (`vocab`:
    the columns of this rank's shard)."""
    if FORCE_PIECES is not None:
        return FORCE_PIECES == "sparse"
    return num_entries <= SPARSE_MAX_SHARE * num_set_rows * vocab


def replay_route(num_entries: int, num_set_rows: int, vocab: int, backend, max_elements: int) -> str:
    """"tiles", "sparse" or "dense", from sizes the host knows (`vocab`: the columns of this rank's
    shard): union tiles where the backend has their kernels and even sets that share no id (a
    tile's union then holds all its TILE_ROWS x K entries) would multiply at most TILES_MAX_SHARE
    of the dense route's columns, their [unions, TILE_ROWS] products and their layouts' [tiles,
    members] tables (the kernels' a byte a pair: half an element) within a chunk's `max_elements`;
    else sparse below SPARSE_MAX_SHARE (module doc); else dense. Measured on an
    H200 (tools/sampling_mask_bench.py, x plain log-probs) at K = 50: the tiles 0.50-0.56 eager
    (0.15-0.34 from CUDA graphs) at N 4096-8192 and V 19008-32064, where the sparse kernels took
    0.96-1.38 and the dense route 1.06-1.21 (both measured against earlier tiles, 0.58-0.76
    then); 0.03-0.06 on the large shapes, where sparse took 0.11-0.17; at K = 512 on the large
    shapes (K <= V / 250) 0.11-0.32, where the dense route took 0.68-0.73."""
    has_tiles = getattr(backend, "union_logits", None) is not None
    if FORCE_PIECES is not None:
        return "dense" if FORCE_PIECES == "tiles" and not has_tiles else FORCE_PIECES
    width = min(TILE_ROWS, COLUMN_TILE)
    if (has_tiles and num_entries * TILE_ROWS <= TILES_MAX_SHARE * num_set_rows * vocab
            and max(num_entries * max(TILE_ROWS, COLUMN_TILE), (num_set_rows // width + 1) * (vocab + width) // 2)
            <= max_elements):
        return "tiles"
    return "sparse" if sparse_is_cheaper(num_entries, num_set_rows, vocab) else "dense"


class UnionTiles(NamedTuple):
    """Union tiles of a call's kept entries on this shard, made on the device from what the host
    knows (no sync). Tile t's union is `uids[tile_start[t]:tile_start[t + 1]]` (distinct,
    ascending); the tiles' products are [capacity, width] (row g a union entry, column s a member
    of its tile) and `place` is each entry's place there (-1 where not valid). Two tilings:
    `of_slots` (the forward and dX: tiles of `width` slots, unions of the columns their sets name)
    and `of_columns` (dW: tiles of `width` columns, unions of the rows whose sets name them).

    No sort: a [tiles, members] int32 table marks the (tile, member) pairs the entries name, and
    its prefix sum numbers them in (tile, member) order, which is the unions' layout (the table's
    bytes: 2 / width of the set rows' bf16 logits'). A backend's `union_layouts` makes the same
    fields in three launches and a fill, from a table of a byte per pair packed into bits and
    numbered by the packing launch, for one tiling or for both (`of_slots_and_columns`; about
    fifteen torch ops each here, each a launch and its Python).

    `of_columns` tiles the columns by how many entries name them (`columns_by_use`), most first: where
    sets overlap (a trained model's: the frequent ids are in most sets) the frequent columns share
    a few tiles whose unions are nearly every row, and the others' unions stay small; in column
    order each tile would hold a frequent id or two and its union nearly every row (dW as dense:
    2.3x the (tile, row) pairs at 8192 rows, K = 50, V 19008, Zipf sets). `out_rows`: the column
    at each place of that order (the output row of each tile member)."""

    tile_start: Tensor  # int64 [tiles + 1]
    uids: Tensor  # int64 [capacity + 1] (a spare element past the unions)
    place: Tensor  # int64 [E]
    capacity: int  # min(E, tiles x what a union may hold)
    max_union: int  # no one tile's union is larger
    out_rows: Optional[Tensor] = None  # of_columns: int64 [num_cols], the column at each place

    @staticmethod
    def of_slots(entries: "KeptEntries", num_cols: int, width: int, backend=None,
                 by_rows: bool = False) -> "UnionTiles":
        """With `by_rows` the slots are the rows (ReplayChunks.by_rows)."""
        return UnionTiles._build(entries, by_rows, [UnionTiles._slot_layout(entries, num_cols, width)],
                                 UnionTiles._kernels(entries, backend))[0]

    @staticmethod
    def of_columns(entries: "KeptEntries", num_cols: int, width: int, backend=None,
                   by_rows: bool = False) -> "UnionTiles":
        """uids: rows of the hidden states (the slots' set_rows, or with `by_rows` the entries'
        positions); the columns by use (class doc)."""
        kernels = UnionTiles._kernels(entries, backend)
        return UnionTiles._build(entries, by_rows, [UnionTiles._column_layout(entries, num_cols, width, kernels)],
                                 kernels)[0]

    @staticmethod
    def of_slots_and_columns(entries: "KeptEntries", num_cols: int, slot_width: int, column_width: int,
                             backend=None, by_rows: bool = False) -> tuple:
        """(of_slots, of_columns) in one set of the backend's launches (a call that will need dW
        makes both in its forward: three launches and a fill fewer than one at a time)."""
        kernels = UnionTiles._kernels(entries, backend)
        return tuple(UnionTiles._build(entries, by_rows, [UnionTiles._slot_layout(entries, num_cols, slot_width),
                                                          UnionTiles._column_layout(entries, num_cols, column_width,
                                                                                    kernels)], kernels))

    @staticmethod
    def _slot_layout(entries: "KeptEntries", num_cols: int, width: int) -> tuple:
        """(rank, tiles, members, width, out_rows): tiles of `width` slots, their members columns."""
        return None, -(-entries.set_rows.numel() // width), num_cols, width, None

    @staticmethod
    def _column_layout(entries: "KeptEntries", num_cols: int, width: int, kernels) -> tuple:
        """(rank, tiles, members, width, out_rows): tiles of `width` columns in the order of their
        use (`columns_by_use`; out_rows the order), their members slots."""
        if getattr(kernels, "columns_by_use", None) is not None:  # (with the layout's counts, where it made them)
            counts = entries.column_use if entries.column_use is not None and entries.column_use.numel() == num_cols \
                else None
            order, rank = kernels.columns_by_use(entries.col, entries.valid, num_cols, counts=counts)
        else:
            order, rank = columns_by_use(entries.col, entries.valid, num_cols)
        return rank, -(-num_cols // width), entries.set_rows.numel(), width, order

    @staticmethod
    def _kernels(entries: "KeptEntries", backend):
        """The backend's layout kernels (replay_union_triton) where they run on these entries, else None."""
        if getattr(backend, "union_layouts", None) is not None and (entries.ids.is_cuda or _interpreting()):
            return backend
        return None

    @staticmethod
    def _build(entries: "KeptEntries", by_rows: bool, layouts: list, kernels) -> list:
        """The tiles of each of `layouts` ((rank, tiles, members, width, out_rows): tiles of slots
        where rank is None, else of columns in the order `rank` gives (their places)); the slots
        the set rows', or with `by_rows` the rows themselves (KeptEntries.slots). The backend's
        kernels make them all in one set of launches."""
        slot, set_rows = entries.slots(by_rows)
        total = entries.ids.numel()
        capacities = [min(total, tiles * members) for _, tiles, members, _, _ in layouts]
        if kernels is not None:
            fields = kernels.union_layouts(slot, entries.col, entries.valid, set_rows,
                                           [(*layout[:4], capacity) for layout, capacity in zip(layouts, capacities)])
        else:
            fields = [UnionTiles._torch_layout(entries, slot, set_rows, *layout[:4], capacity)
                      for layout, capacity in zip(layouts, capacities)]
        return [UnionTiles(*f, capacity, min(total, members), out_rows)
                for f, capacity, (_, _, members, _, out_rows) in zip(fields, capacities, layouts)]

    @staticmethod
    def _torch_layout(entries: "KeptEntries", slot: Tensor, set_rows: Optional[Tensor], rank: Optional[Tensor],
                      tiles: int, members: int, width: int, capacity: int) -> tuple:
        """The layout's (tile_start, uids, place), defined in torch (about fifteen ops)."""
        by_columns = rank is not None
        slot, col = slot.clamp(min=0), entries.col
        if by_columns:  # (a column off the shard is not valid: any place stands for it)
            col = rank.index_select(0, col.clamp(0, rank.numel() - 1))
        tile, member, within = ((col // width, slot, col % width) if by_columns else (slot // width, col, slot % width))
        # (the pairs of entries that are not valid land on one spare element past the table)
        key = torch.where(entries.valid, tile * members + member, tiles * members)
        named = torch.zeros(tiles * members + 1, dtype=torch.int32, device=key.device)
        named.index_fill_(0, key, 1)
        named = named[:-1]
        count = torch.cumsum(named, 0)  # count[i]: pairs named up to i, in (tile, member) order
        pair_member = torch.arange(members, device=key.device).repeat(tiles)
        if by_columns and set_rows is not None:
            pair_member = set_rows.index_select(0, pair_member)
        uids = torch.empty(capacity + 1, dtype=torch.int64, device=key.device)
        uids.scatter_(0, torch.where(named > 0, count - 1, capacity), pair_member)
        tile_start = torch.cat([count.new_zeros(1), count.view(tiles, members)[:, -1]]).to(torch.int64)
        place = torch.where(entries.valid, (count.index_select(0, key.clamp(max=tiles * members - 1)) - 1) * width
                            + within, -1)
        return tile_start, uids, place


def use_class(counts: Tensor) -> Tensor:
    """A column's class of use from how many valid entries name it (int32): 0 for none, else
    1 + 2 floor(log2 count) + the bit below the leading one (two classes an octave), at most
    USE_CLASSES - 1; read off the count's float32 exponent and first mantissa bit (exact below
    2^24), as the backend's kernels read it."""
    classes = (counts.float().view(torch.int32) >> 22) - 253
    return torch.where(counts > 0, classes.clamp(max=USE_CLASSES - 1), 0)


def columns_by_use(col: Tensor, valid: Tensor, num_cols: int) -> tuple:
    """(order, rank): the shard's `num_cols` columns by their class of use (`use_class`), most used
    first, ties by column, and each column's place in that order. Classes, not the counts: within
    a factor of 1.5 of each other columns cost a tile alike, and classes let a backend order the
    columns by blocks in two launches (no sort of the shard's counts)."""
    counts = torch.zeros(num_cols, dtype=torch.int32, device=col.device)
    counts.index_add_(0, col.clamp(0, num_cols - 1), valid.to(torch.int32))
    columns = torch.arange(num_cols, device=col.device)
    order = torch.sort((USE_CLASSES - 1 - use_class(counts)) * num_cols + columns).indices  # (distinct keys)
    return order, torch.empty_like(order).scatter_(0, order, columns)


class KeptEntries:
    """The kept entries of a call on this shard, all on the device, sized from what the host knows
    (no sync): the call's rows are the positions of the mask (every row of labels, ignored ones
    included); `labels` their global labels, `labelled` whether each is labelled.

    A row has a set (`has_set`) where it is labelled and its set is not empty. The rows with a set,
    in row order, take the first slots of `max_set_rows` (min(rows, E): each holds an entry); the
    slots past them are padding: `set_rows` (the rows gathered: a row without a set there, whose
    gradients they add zeros to), `set_dest` (where a slot's statistics go: the row, or `num_rows`
    for padding, one spare place past the rows), `starts` / `ends` (the CSR range; empty for
    padding) and `set_labels`. Per entry e of the CSR: `position`, `slot` (its row's slot, -1
    where the row has no set), `col` (id - vocab_start), `valid` (in a set on this shard's valid
    columns), `is_label` (valid and the row's label). Per row: `kept`, the label is in its set
    (every shard sees the whole set: no collective)."""

    def __init__(self, ids: Tensor, offsets: Tensor, labels: Tensor, labelled: Tensor, vocab_start: int,
                 num_valid_cols: int, max_set_rows: int, kernel=None):
        """`offsets`: the layout offsets (MaskCheck.layout_offsets); with `kernel` (a backend's
        kept_layout, partially applied), the mask's own offsets, and the kernel makes the fields
        (and the device checks' `counts` and `poison`) that the code below defines."""
        self.ids = ids.contiguous()
        self.vocab_start, self.num_valid_cols = int(vocab_start), int(num_valid_cols)
        self.labelled = labelled
        self._row_of_entry = None
        self.counts = self.poison = self.fingerprint = None
        self.column_use = None  # int32 [num_cols] where the kernel counted each column's valid entries
        # the dense route's (cols, places) of slots and of rows, and its (gather, scatter, block of
        # rows) kernels (None: torch, made here)
        self.chunk_place = self.row_place = self.chunk_kernels = None
        if kernel is not None:
            fields = kernel(self.ids, offsets, labels, labelled, vocab_start, num_valid_cols, max_set_rows)
            self._row_of_entry = fields.pop("row_of_entry")
            for name, value in fields.items():
                setattr(self, name, value)
            self.set_positions = self.set_dest
            return
        device = ids.device
        total, num_rows = ids.numel(), offsets.numel() - 1
        # one spare position past the rows, with an empty set: the one padding slots read
        self.offsets = torch.cat([offsets, offsets[-1:]]).contiguous()
        sizes = self.offsets[1:] - self.offsets[:-1]
        self.has_set = (sizes[:num_rows] > 0) & labelled
        found = torch.nonzero_static(self.has_set, size=max_set_rows, fill_value=-1).squeeze(1)
        padding = found < 0
        self.set_dest = torch.where(padding, num_rows, found)
        self.set_positions = self.set_dest  # (rows are positions)
        # a padding slot gathers a row without a set (one exists wherever there is padding)
        first_plain = torch.nonzero_static(~self.has_set, size=1, fill_value=0).reshape(())
        self.set_rows = torch.where(padding, first_plain, found)
        self.starts = self.offsets.index_select(0, self.set_dest)
        self.ends = self.offsets.index_select(0, self.set_dest + 1)
        self.set_labels = torch.cat([labels.reshape(-1), labels.new_full((1,), -1)]).index_select(0, self.set_dest)
        # each row's slot: the rows with a set before it (a prefix sum, no scatter)
        slot_of_position = torch.where(self.has_set, torch.cumsum(self.has_set, 0) - 1, -1)
        slot_of_position = torch.cat([slot_of_position, slot_of_position.new_full((1,), -1)])
        self.position = torch.repeat_interleave(torch.arange(num_rows + 1, device=device), sizes, output_size=total)
        self.slot = slot_of_position.index_select(0, self.position)
        self.col = ids - vocab_start
        in_set = self.slot >= 0
        self.valid = in_set & (self.col >= 0) & (self.col < num_valid_cols)
        hit = in_set & (ids == self.set_labels.index_select(0, self.slot.clamp(min=0)))
        self.is_label = hit & self.valid
        # the label among the row's ids (on any shard): prefix sums, not atomic adds
        prefix = torch.zeros(total + 1, dtype=torch.int64, device=device)
        torch.cumsum(hit, 0, out=prefix[1:])
        found_label = prefix.index_select(0, self.offsets[1:num_rows + 1]) > prefix.index_select(0, offsets[:-1])
        self.kept = ~self.has_set | found_label

    def slots(self, by_rows: bool = False) -> tuple:
        """(each entry's slot, each slot's row): the set rows' slots (`slot`, `set_rows`), or with
        `by_rows` the rows themselves (each entry's `position`, None)."""
        return (self.position, None) if by_rows else (self.slot, self.set_rows)

    def row_of_entry(self) -> Tensor:
        """[E] each entry's row (an index into the call's rows; a gathered row where it has none)."""
        if self._row_of_entry is None:
            self._row_of_entry = self.set_rows.index_select(0, self.slot.clamp(min=0))
        return self._row_of_entry

    def _place(self, cols: int, by_rows: bool = False) -> Tensor:
        """[E] each entry's place in the [slots, cols] logits of the set rows, or with `by_rows` in
        the [rows, cols] logits of every row (-1 where not valid)."""
        name, index = ("row_place", self.position) if by_rows else ("chunk_place", self.slot)
        cached = getattr(self, name)
        if cached is None or cached[0] != cols:
            cached = (cols, torch.where(self.valid, index * cols + self.col, -1))
            setattr(self, name, cached)
        return cached[1]

    def gather_chunk(self, z: Tensor, logits: Tensor, start: int, inv_temperature: float,
                     by_rows: bool = False) -> None:
        """The dense route's forward: z of the entries of slots [start, start + rows of `logits`)
        (with `by_rows`: of those rows), read off their [rows, cols] block (fp32, times 1/T); the
        others' z are left."""
        cols = logits.shape[1]
        self.gather_places(z, logits, self._place(cols, by_rows), start * cols, inv_temperature)

    def gather_places(self, z: Tensor, values: Tensor, place: Tensor, lo: int, inv_temperature: float) -> None:
        """z[e] = fp32(values.flat[place[e] - lo]) / T where the place is inside `values`."""
        hi = lo + values.numel()
        if self.chunk_kernels is not None:
            return self.chunk_kernels[0](place, values, z, lo, hi, inv_temperature)
        inside = (place >= lo) & (place < hi)
        read = values.reshape(-1).index_select(0, (place - lo).clamp(0, values.numel() - 1)).float()
        torch.where(inside, read * inv_temperature, z, out=z)

    def scatter_chunk(self, d: Tensor, start: int, end: int, cols: int, by_rows: bool = False) -> Tensor:
        """The dense route's backward: the [end - start, cols] block of dlogits of slots (with
        `by_rows`: rows) [start, end): zeros, the entries' `d` (in the block's dtype) written in."""
        if self.chunk_kernels is not None:
            return self.chunk_kernels[2](self, d, start, end, cols, by_rows)
        return self.scatter_places(d, self._place(cols, by_rows), start * cols, (end - start, cols))

    def scatter_places(self, d: Tensor, place: Tensor, lo: int, shape: tuple, into: Optional[Tensor] = None) -> Tensor:
        """A block of `shape`: zeros (or `into`, its other elements left), d[e] (in the block's
        dtype) at place[e] - lo where inside."""
        block = torch.zeros(shape, dtype=d.dtype, device=d.device) if into is None else into
        hi = lo + block.numel()
        if self.chunk_kernels is not None:
            self.chunk_kernels[1](place, d, block, lo, hi)
            return block
        inside = (place >= lo) & (place < hi)
        # (the others' writes land on one spare element past the block)
        spare = torch.cat([block.reshape(-1), block.new_zeros(1)])
        spare.index_put_((torch.where(inside, place - lo, hi - lo),), d)
        if into is None:
            return spare[:-1].view(shape)
        return into.view(-1).copy_(spare[:-1]).view(shape)


@dataclass
class ReplayStats(reductions.MergedStats):
    """MergedStats over each row's kept set (the whole vocab where it is empty), plus whether the
    label is kept and the entries' z (what the backward's dlogits need)."""

    kept: Optional[Tensor] = None  # bool [n]
    entry_z: Optional[Tensor] = None  # fp32 [E], temperature applied (None without gradients)

    def grad_offsets(self) -> tuple:
        return (self.max, self.log_sum_exp, self.entry_z)


@dataclass(eq=False)
class ReplayChunks:
    """`spec.tiling` of a call with kept sets: every row's plain partials in fast chunks, the rows
    with a set scored again over their sets by `route`: "sparse" (the backend's kept-set kernels),
    "tiles" (the backend's union-tile GEMMs, `tiles` their layout) or "dense" (chunk GEMMs over the
    whole shard); module doc."""

    entries: KeptEntries
    route: str
    want_z: bool  # the backward will need the entries' z
    # False where the signature's first call found no labelled row without a set (api.py remembers it)
    plain_pass: bool = True
    # fp32 [1] NaN where the device checks of a remembered signature's call found a bad mask, and
    # int64 [2] the mask's fingerprint for the TP rank check (replay_tiling)
    poison: Optional[Tensor] = None
    fingerprint: Optional[Tensor] = None
    tiles: Optional[UnionTiles] = None
    # dW's tiles of columns, made with `tiles` in the forward where dW would be needed (else None:
    # the backward makes them)
    column_tiles: Optional[UnionTiles] = None
    # the forward's labelled log-probs made in the statistics' tail launch (TP = 1: the route's
    # forward, remembered_routes.replay_outputs, takes them there)
    logprobs_in_tail: bool = False
    statistics_type = ReplayStats
    _z = None  # the entries' z between _kept_partials and merged_statistics

    @property
    def sparse(self) -> bool:
        return self.route == "sparse"

    @property
    def by_rows(self) -> bool:
        """The slots are the call's rows themselves, in row order: where no plain pass runs and the
        slots are as many as the rows (every row a slot: a set row's, or padding's, whose logits
        count for nothing), the dense route's GEMMs and the union tiles read the hidden rows and
        write dX whole, a row without a set getting zeros (unlabelled: no plain pass means no
        labelled row lacks a set), with no gather of the rows and no zeroing of dX before."""
        return (self.route != "sparse" and not self.plain_pass
                and self.entries.set_rows.numel() == self.entries.labelled.numel())

    def weight_grad_dtype(self, weight: Tensor, num_rows: int, spec) -> torch.dtype:
        # sparse rows add into dW and dense chunks sum over chunks, in fp32; without the plain pass,
        # the union tiles' dW product or one dense chunk's GEMM writes every row, in the weight's
        # dtype (no fp32 buffer to zero and copy: at RL sizes that costs about what the dense
        # route's saved GEMM saves)
        return weight.dtype if self._dw_in_one_product(spec) else torch.float32

    def _dw_in_one_product(self, spec) -> bool:
        """Whether one product writes every row of dW (no plain pass before it): the union tiles'
        by tiles of columns, or the dense route's one chunk."""
        if self.plain_pass or self.route == "sparse":
            return False
        return self.route == "tiles" or 0 < self.entries.set_rows.numel() <= spec.chunk_size

    def statistics(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ShardStats:
        """The plain rows' walk (fast.shard_partials asks the tiling)."""
        return FAST_CHUNKS.statistics(rows, weight, local_target, spec)

    def _max_elements(self, weight: Tensor, spec) -> int:
        return spec.chunk_size * weight.shape[0]  # the torch path's gathers: at most a chunk of logits

    def missing_set_poison(self) -> Tensor:
        """Without the plain pass, a labelled row without a set would get placeholder statistics:
        fp32 [1], NaN if one exists (recorded for the next host synchronization, deferred_errors.py),
        else 0. The labels and the mask are the same on every rank (else the rank check flags it),
        so every rank finds the same."""
        entries = self.entries
        labelled = entries.labelled
        bad = (labelled & ~entries.has_set).any()
        deferred_errors.record(bad.to(torch.int64) * deferred_errors.SAMPLING_MASK_NEW_EMPTY_SET)
        return torch.where(bad, float("nan"), 0.0).reshape(1).to(torch.float32)

    def merged_statistics(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ReplayStats:
        entries = self.entries
        # every row's plain partials (how many rows have a set is not known on the host), the set
        # rows' replaced by their kept sets'; without a labelled row that needs them, placeholders
        # (finite: an ignored row's results are zeros)
        names = ("max", "sum_exp", "target") + (("sum_exp_shifted",) if spec.want_entropy else ())
        num_rows = rows.shape[0]
        # every row a slot and no merge over TP ranks after it: the statistics' launch finishes the
        # rows (the tail's launch and the placeholders' fill fewer; the same bits)
        finishes = self.by_rows and reductions.group_size(spec.tp_group) == 1
        if self.plain_pass:
            PIECE_COUNTS["plain_rows"] += num_rows
            plain = shard_partials(rows, weight, local_target, spec)
            per_row = torch.stack([getattr(plain, name) for name in names])
            per_row = torch.cat([per_row, per_row[:, :1]], 1)  # (the spare place padding slots land on)
        elif finishes:  # (the statistics' launch writes the placeholders; the tail's four rows after the fields)
            per_row = torch.empty(len(names) + 4, num_rows + 1, dtype=torch.float32, device=rows.device)
        else:
            # (max 1, sum_exp 1, target 1: finite, and one op where zeros and a fill are two)
            per_row = torch.ones(len(names), num_rows + 1, dtype=torch.float32, device=rows.device)
        logprob_of = (entries.labelled, entries.kept, self.poison) if self.logprobs_in_tail else None
        # the set rows' partials replace their plain ones (columns set_dest; padding: the spare one)
        self._kept_partials(rows, weight, spec, per_row[:len(names)],
                            finish=(per_row[len(names):], logprob_of) if finishes else None)
        z = self._z
        self._z = None
        stats = ShardStats(**{name: per_row[i, :num_rows] for i, name in enumerate(names)})
        if finishes:
            log_sum_exp, lse, entropy, logprob = per_row[len(names):, :num_rows]
            merged = reductions.MergedStats(
                lse=lse, target=stats.target, entropy=entropy if spec.want_entropy else None, max=stats.max,
                log_sum_exp=log_sum_exp, forward_logprob=logprob if logprob_of is not None else None)
        else:
            merged = reductions.merge_shard_stats(stats, spec.tp_group, spec.backend, spec.rank_check,
                                                  logprob_of=logprob_of)
        return ReplayStats(**vars(merged), kept=entries.kept, entry_z=z)

    def _kept_partials(self, rows: Tensor, weight: Tensor, spec, into: Tensor, finish: Optional[tuple] = None) -> None:
        """The set rows' partials written into `into` [fields, rows + 1] at columns set_dest; with
        `finish`, the backend's entry_stats' (every row a slot: the tiles and dense routes)."""
        entries = self.entries
        PIECE_COUNTS[self.route + "_rows"] += entries.set_rows.numel()
        if self.sparse:
            round_to = None if spec.logits_dtype is not None or rows.dtype == torch.float32 else rows.dtype
            _, self._z = spec.backend.kept_stats(rows, weight, entries, spec.inv_temperature, round_to,
                                                 spec.want_entropy, self.want_z, self._max_elements(weight, spec),
                                                 into=into)
            return
        # (the tiles' statistics launch stores every set entry's z, 0 where not valid; an entry of a
        # row without a set is read by no launch: no fill there)
        z = (torch.empty if self.route == "tiles" else torch.zeros)(entries.ids.numel(), dtype=torch.float32,
                                                                    device=rows.device)
        self._z = z if self.want_z else None
        if self.route == "tiles":  # each tile's rows times its union's W rows, gathered in the kernel
            tiles = self.tiles
            logits = torch.empty(tiles.capacity, TILE_ROWS, dtype=spec.logits_dtype or rows.dtype, device=rows.device)
            spec.backend.union_logits(rows, weight, None if self.by_rows else entries.set_rows, tiles.tile_start,
                                      tiles.uids, logits, tiles.max_union, TILE_ROWS)
            # (the entries' z read off the products by the statistics' launch)
            spec.backend.entry_stats(z, entries, spec.want_entropy, into,
                                     gather=(logits, tiles.place, spec.inv_temperature), finish=finish)
            return
        by_rows = self.by_rows
        for start, end in row_chunks(entries.set_rows.numel(), spec.chunk_size):
            chunk = rows[start:end] if by_rows else rows.index_select(0, entries.set_rows[start:end])
            logits = chunk_logits(chunk, weight, spec)
            entries.gather_chunk(z, logits, start, spec.inv_temperature, by_rows)
            del logits
        spec.backend.entry_stats(z, entries, spec.want_entropy, into, finish=finish)

    def recompute_grads(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                        coefs: dict, dx_rows: Optional[Tensor], dw_out: Optional[Tensor], accumulate: bool) -> None:
        """dX rows and fp32 dW: every row's plain recompute backward, with zero coefficients in
        the rows with a set (writing dX, and dW first), then the kept entries' dlogits into the
        sparse kernels or the dense chunks' GEMMs (adding)."""
        entries = self.entries
        row_max, log_sum_exp, z = offsets
        one_gemm = self._dw_in_one_product(spec)  # dW written by one product (weight_grad_dtype)
        if self.plain_pass:
            plain_coefs = {k: None if c is None else torch.where(entries.has_set, 0.0, c) for k, c in coefs.items()}
            # a set row's offsets are its set's: a logit off the set may exceed them by any amount, and
            # exp of that times a zero coefficient would be NaN; an offset above every logit gives 0
            plain_max = torch.where(entries.has_set, _ABOVE_EVERY_LOGIT, row_max)
            plain_lse = torch.where(entries.has_set, 0.0, log_sum_exp)
            backward_grads(rows, weight, local_target, spec, (plain_max, plain_lse), plain_coefs, dx_rows, dw_out,
                           dw_accumulate=accumulate)
        else:  # what the plain pass would write: zero dX, and dW where it is not added into
            if dx_rows is not None and not self.by_rows:  # (by rows: every row's written)
                dx_rows.zero_()
            if dw_out is not None and not accumulate and not one_gemm:
                dw_out.zero_()
        set_rows = entries.set_rows

        def entry_dlogits(dtype, into=()):  # the entries' dlogits (in `dtype`), or written into blocks
            return spec.backend.entry_dlogits(z, entries, spec.inv_temperature, row_max, log_sum_exp, coefs["p"],
                                              coefs.get("pz"), coefs.get("target"), dtype, gate=coefs.get("gate", ()),
                                              into=into)

        if self.sparse:
            spec.backend.kept_grads(rows, weight, entries, entry_dlogits(torch.float32), dx_rows, dw_out,
                                    self._max_elements(weight, spec))
            return None
        if self.route == "tiles":
            self._tile_grads(rows, weight, spec, entry_dlogits, dx_rows, dw_out, accumulate)
            return None
        d = entry_dlogits(rows.dtype)  # (in the GEMMs' input dtype)
        cols = weight.shape[0]
        by_rows = self.by_rows
        for start, end in row_chunks(set_rows.numel(), spec.chunk_size):
            dlogits = entries.scatter_chunk(d, start, end, cols, by_rows)  # the chunk's block of dlogits
            if by_rows:  # the rows themselves, dX written in place
                chunk, dx_chunk = rows[start:end], None if dx_rows is None else dx_rows[start:end]
            else:
                chunk = rows.index_select(0, set_rows[start:end])
                dx_chunk = None if dx_rows is None else rows.new_empty((end - start, rows.shape[1]))
            grad_gemms(dlogits, chunk, weight, spec, dx_chunk, dw_out, dw_accumulate=accumulate or not one_gemm)
            del dlogits
            if dx_chunk is None or by_rows:
                continue
            if self.plain_pass:  # added: the plain pass wrote zeros there (padding adds zeros)
                dx_rows.index_add_(0, set_rows[start:end], dx_chunk)
            else:  # copied: a row is one slot's, or padding's (zeros, onto a row that has no set)
                dx_rows.index_copy_(0, set_rows[start:end], dx_chunk)
        return None

    def _tile_grads(self, rows: Tensor, weight: Tensor, spec, entry_dlogits, dx_rows: Optional[Tensor],
                    dw_out: Optional[Tensor], accumulate: bool) -> None:
        """The union tiles' backward: the entries' dlogits written straight into the [unions, width]
        blocks of the slots' tiles (dX) and of the columns' (dW), one zeroed allocation and one
        launch for both where they fit in a chunk of logits together (else one block at a time),
        then the two products. dX by rows is written whole; else added: the plain pass (or the
        zeroing before) wrote zeros there (padding slots add zeros). dW: every row by one program,
        added, or written (one product)."""
        entries, by_rows = self.entries, self.by_rows
        products = []
        if dx_rows is not None:
            tiles = self.tiles
            products.append((tiles, TILE_ROWS, partial(
                spec.backend.union_sum_rows, src=weight, tile_start=tiles.tile_start, uids=tiles.uids, out=dx_rows,
                tile_rows=TILE_ROWS, out_rows=None if by_rows else entries.set_rows, accumulate=not by_rows)))
        if dw_out is not None:
            columns = self.column_tiles
            if columns is None:
                columns = UnionTiles.of_columns(entries, weight.shape[0], COLUMN_TILE, spec.backend, by_rows)
            products.append((columns, COLUMN_TILE, partial(
                spec.backend.union_sum_rows, src=rows, tile_start=columns.tile_start, uids=columns.uids, out=dw_out,
                tile_rows=COLUMN_TILE, out_rows=columns.out_rows, accumulate=accumulate or self.plain_pass,
                by_columns=True)))
        together = sum(layout.capacity * width for layout, width, _ in products) <= self._max_elements(weight, spec)
        for group in [products] if together else [[product] for product in products]:
            sizes = [layout.capacity * width for layout, width, _ in group]
            flat = torch.zeros(sum(sizes), dtype=rows.dtype, device=rows.device)
            blocks = [block.view(layout.capacity, width) for block, (layout, width, _)
                      in zip(flat.split(sizes), group)]
            entry_dlogits(rows.dtype, tuple((layout.place, block) for block, (layout, _, _) in zip(blocks, group)))
            for block, (_, _, product) in zip(blocks, group):
                product(block)
            del flat, blocks


def layout_checks_labels(backend, ids: Tensor) -> bool:
    """Whether replay_tiling's layout launch can make and check the rows' labelled flags itself
    (the backend's kept_layout kernels run on `ids`' device)."""
    return getattr(backend, "kept_layout", None) is not None and (ids.is_cuda or _interpreting())


def replay_tiling(mask_check: "MaskCheck", labels: Tensor, labelled: Tensor, vocab_start: int, num_valid_cols: int,
                  true_vocab: int, needs_grad: bool, plain_pass: bool, backend=None, check: bool = False,
                  num_cols: Optional[int] = None, fingerprint: bool = False,
                  label_poison: Optional[Tensor] = None, max_elements: Optional[int] = None,
                  weight_grad: bool = False, ignore_index: Optional[int] = None) -> ReplayChunks:
    """api.token_statistics' tiling for a call whose mask holds entries (E > 0) over its rows
    (every position of labels), sized from what the host knows on every call of a signature, the
    first included, so that they all compute alike: at most min(rows, E) rows with a set (each
    holds an entry). `plain_pass`: False where the signature's first call found a set at every
    labelled row. `check` (a remembered signature): the tiling's `poison` is the mask's device
    check (MaskCheck.deferred_poison) and, without the plain pass, `missing_set_poison`'s.
    `backend`: its `kept_layout` kernels make the layout and the checks where it has them
    (`num_cols`: the shard's columns, valid and padding). With `fingerprint` (a TP rank check), the
    tiling's `fingerprint` is MaskCheck.fingerprint()'s value. `label_poison` (fp32 [1], the label
    checks'): added into `poison`, so that the call's poison is this one (the kernel adds it).
    `max_elements`: a chunk of logits' elements, the most the union tiles' logits may take (None:
    no tiles). `weight_grad`: the backward will make dW (the union tiles of columns are then made
    here, with the slots' in one set of launches). `labelled` None (where `layout_checks_labels`,
    with `check` and `ignore_index`): the layout's launch makes the rows' labelled flags from the
    labels and checks them as the label kernel does (entries.labelled; deferred_errors' flag and
    the poison), one launch fewer."""
    ids = mask_check.ids
    if labelled is None and not (check and layout_checks_labels(backend, ids)):
        raise ValueError("replay_tiling: the labels are checked by the layout's launch only with its kernels "
                         "and the device checks")
    max_set_rows = min(mask_check.offsets.numel() - 1, ids.numel())
    # against the rank's own shard: every rank's set kernels walk every entry (the ids off its shard
    # masked), while the dense route's GEMMs shrink with the shard
    route = replay_route(ids.numel(), max(max_set_rows, 1), num_valid_cols, backend,
                         -1 if max_elements is None else max_elements)
    if route == "tiles" and (max_set_rows == 0 or not (ids.is_cuda or _interpreting())):
        route = "dense"  # (the union kernels run on CUDA, or on CPU under Triton's interpreter)
    layout = getattr(backend, "kept_layout", None)
    if layout is not None and (ids.is_cuda or _interpreting()):
        # (the columns' use counted with the layout where dW's tiles by columns will order them)
        kernel = partial(layout, vocab=true_vocab, num_cols=num_cols,
                         flags=deferred_errors.flags(ids.device) if check else None, check_missing=not plain_pass,
                         fingerprint=fingerprint, base_poison=label_poison,
                         count_use=route == "tiles" and needs_grad and num_cols is not None,
                         **({} if labelled is not None else {"ignore_index": ignore_index}))
        entries = KeptEntries(ids, mask_check.offsets, labels, labelled, vocab_start, num_valid_cols, max_set_rows,
                              kernel=kernel)
        poison = entries.poison
    else:
        entries = KeptEntries(ids, mask_check.layout_offsets(), labels, labelled, vocab_start, num_valid_cols,
                              max_set_rows)
        poison = None
    tiling = ReplayChunks(entries, route, want_z=needs_grad, plain_pass=plain_pass)
    if route == "tiles":
        cols = num_valid_cols if num_cols is None else num_cols
        if weight_grad and needs_grad:
            tiling.tiles, tiling.column_tiles = UnionTiles.of_slots_and_columns(entries, cols, TILE_ROWS, COLUMN_TILE,
                                                                                backend, tiling.by_rows)
        else:
            tiling.tiles = UnionTiles.of_slots(entries, cols, TILE_ROWS, backend, tiling.by_rows)
    if check and poison is None:
        poison = mask_check.deferred_poison()
        if not plain_pass:
            poison = poison + tiling.missing_set_poison()
        if label_poison is not None:
            poison = label_poison + poison
    tiling.poison = poison
    tiling.fingerprint = entries.fingerprint if entries.fingerprint is not None or not fingerprint \
        else mask_check.fingerprint()
    return tiling


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

