"""Backends: the per-chunk math of the op behind one interface, and the choice among them.

A backend turns one chunk of logits (`[rows, V_local]`, this rank's vocab shard) into what the
chunk loop needs. Every backend has the required math; what a backend does faster is stated as a
capability, and the chunk loop asks for the capability, never for a backend by name:

| capability | what it replaces | who has it |
|---|---|---|
| `shard_stats`, `shard_logprob`, `shard_dlogits_`, `scale_`, `scale_cast`, `exp_tile_`, `label_targets`, `labelled_loss_sum`, the TP merge's `merge_gathered` / `merged_tail`, `labelled_logprob`, sampling kernels (required) | - | torch (reference, any device), Triton (CUDA) |
| `kept_stats`, `kept_grads`, `entry_stats`, `entry_dlogits`: sampling-mask replay's kept entries (gathered W rows, their dots, statistics, dlogits, dX, dW) (required) | - | torch (replay_torch.py), Triton (replay_triton.py) |
| `union_logits`, `union_sum_rows`: replay's union tiles (a tile of rows times the W rows its kept sets name, gathered in the GEMM) | the dense route's whole-shard GEMMs | Triton (replay_union_triton.py) |
| `gemm_stats`: statistics in the logits GEMM's epilogue (no logits in memory) | logits GEMM + `shard_stats` | Triton |
| `gemm_dlogits`: dlogits in the logits GEMM's epilogue, offsets known | logits GEMM + `shard_dlogits_` | Triton |
| `stats_dlogits`: one launch giving a whole-vocab chunk's statistics and its dlogits, coefficients known before the statistics (cross-entropy, log-probs), the same bits | `shard_stats` + `merged_tail` + `shard_dlogits_` | Triton |
| `label_logprob`: a chunk's label checks and log-probs (and statistics) in one launch (TP = 1, a few thousand rows), the same bits | `label_targets` + `shard_logprob` | Triton |
| `stats_dlogits.with_labels`: the one launch of statistics and dlogits with the label checks in it (TP = 1, a few thousand rows), the same bits | `label_targets` + `stats_dlogits` | Triton |
| `row_kernel`: one pass giving lse and softmax - one_hot | `shard_stats` + merge + `shard_dlogits_` | QuACK (CuTe DSL), added to "auto" |
| `weight_grad_gemm`: the dW GEMMs (write, add in place, add a sum and cast) | cuBLAS | QuACK, added to "auto" |

The math of each function is in torch_backend.py's module docstring; triton_backend.py and
sampling_triton.py give the same results (tests/test_triton_backend.py, tests/test_sampling_triton.py),
cute_backend.py states the contract of its two capabilities and where they apply. A new backend
(another GPU generation, say) is one module that builds a `Backend` and one line in `select`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import Tensor

IMPLS = ("auto", "torch", "triton")  # linear_logprobs(impl=...)


@dataclass
class ShardStats:
    """Per-token partials over this rank's valid vocab columns (fp32, shape [n])."""

    max: Tensor  # m = max_k z_k (-inf when the shard has no valid column)
    sum_exp: Tensor  # sum_k exp(z_k - m)
    target: Tensor  # z_y when the label lives on this shard, else 0
    sum_logits: Optional[Tensor] = None  # sum_k z_k (label smoothing)
    sum_exp_shifted: Optional[Tensor] = None  # sum_k exp(z_k - m) * (z_k - m) (entropy)

    @staticmethod
    def empty(n: int, device, want_sum_logits: bool = False, want_entropy: bool = False) -> "ShardStats":
        """The partials of rows without a valid column (a shard made only of padding, or no rows):
        max -inf, every sum 0."""
        zeros = torch.zeros(n, dtype=torch.float32, device=device)
        return ShardStats(
            max=torch.full_like(zeros, float("-inf")),
            sum_exp=zeros,
            target=zeros.clone(),
            sum_logits=zeros.clone() if want_sum_logits else None,
            sum_exp_shifted=zeros.clone() if want_entropy else None,
        )




def chunk_rows(t: Optional[Tensor], start: int, end: int) -> Optional[Tensor]:
    """t[start:end] (None stays None), or t itself where that is every row: a slice is a dispatched
    op, host time even where it selects everything (a call of one chunk, the chunk loops' and the
    launchers' usual case at RL shapes)."""
    if t is None or (start == 0 and end == t.shape[0]):
        return t
    return t[start:end]


@dataclass(frozen=True)
class FusedGemm:
    """A logits GEMM with an epilogue: `run(...)` where `supported(h, weight)` (the inputs' dtype,
    alignment, device)."""

    supported: Callable
    run: Callable


@dataclass(frozen=True)
class RowKernel:
    """One pass over a chunk of logits giving each row's (loss = lse - z_target, lse) and leaving
    softmax - one_hot(target) in place: `ce_dlogits_(logits, target)`, where
    `supported(dtype, rows, cols, valid_cols, inv_temperature, device, hidden)`."""

    supported: Callable
    ce_dlogits_: Callable


@dataclass(frozen=True)
class LabelsInLaunch:
    """StatsDlogits' launch with label_targets' work in it (no mask, no rank check: TP = 1):
    `run_(logits, labels, ignore_index, true_vocab, vocab_start, num_valid_cols, inv_temperature,
    flags, mean=, scale=, logprob=)` -> StatsDlogits' five results and label_targets' last four
    (targets, labelled, counts, scalars), for chunks of which `applies(rows, num_valid_cols,
    row_bytes, device)`; the same bits as the two launches."""

    applies: Callable
    run_: Callable


@dataclass(frozen=True)
class StatsDlogits:
    """One launch over a chunk of a whole-vocab shard (TP = 1: nothing to merge between the two)
    giving each row's statistics and leaving its dlogits in place, where the dlogits' coefficients
    are known before the statistics: `run_(logits, local_target, num_valid_cols, inv_temperature,
    labelled, scale=, logprob=, poison=)` for chunks of which `applies(rows, num_valid_cols,
    device)`; `with_labels`, the same with the label checks in the launch (None: not available)."""

    applies: Callable
    run_: Callable
    with_labels: Optional[LabelsInLaunch] = None


@dataclass(frozen=True)
class LabelLogprob:
    """One launch over a chunk whose shard is the whole vocab (TP = 1) giving each row's labelled
    log-prob from the raw labels, with label_targets' check of them (a label outside [0,
    true_vocab): NaN in every row and deferred_errors' flag): `run(logits, labels, ignore_index,
    true_vocab, vocab_start, num_valid_cols, inv_temperature, flags)` (forward-only: the log-probs)
    and `with_statistics(..., label_mask=)` (shard_logprob's five results and label_targets' last
    four), for chunks of which `applies(rows, num_valid_cols, device)`; the bits of `label_targets`
    then `shard_logprob`."""

    applies: Callable
    run: Callable
    with_statistics: Callable


@dataclass(frozen=True)
class WeightGradGemm:
    """dW GEMMs: `into_(out, a, b, accumulate=, alpha=, add=)` writes or adds alpha * a @ b (with
    `add`: alpha * a @ b + add, written in out's dtype) and returns False, having done nothing,
    where it does not apply; `supported(a, b, out_dtype, accumulate=, add=)` asks first."""

    supported: Callable
    into_: Callable


@dataclass(frozen=True)
class Backend:
    name: str
    # required: chunk statistics and dlogits, in-place scaling by the upstream gradient, lean's
    # exp tile, the sampler filters' kernels (candidates, kept-set sums, kept-set dlogits) and
    # sampling-mask replay's
    shard_stats: Callable
    # shard_stats of a shard that is the whole vocab (TP = 1) with the per-token epilogue of a
    # forward-only call (log S, lse, the labelled log-prob) in the same launch
    shard_logprob: Callable
    shard_dlogits_: Callable
    scale_: Callable
    scale_cast: Callable
    exp_tile_: Callable
    shard_candidates: Callable
    kept_sums: Callable
    kept_dlogits_: Callable
    # sampling-mask replay (replay.py): each row's partials over its kept entries, and their
    # gradients (dX written, dW added in fp32)
    kept_stats: Callable
    kept_grads: Callable
    # the statistics from the entries' z (the dense route; or z read first off the union tiles'
    # products), and each entry's dlogits (backward; or written straight into the tiles' blocks)
    entry_stats: Callable
    entry_dlogits: Callable
    # each row's target on this shard, which rows are labelled, their count and a bad-label flag
    label_targets: Callable
    # cross-entropy's loss value from the merged statistics (a sum over the labelled rows)
    labelled_loss_sum: Callable
    # [rows, H] rows times a per-row upstream gradient (0 outside an optional row mask), rounded
    # once into an output
    row_scale: Callable
    # the TP merge's per-row math (reductions.merge_shard_stats): every rank's gathered partials
    # merged in rank order into M, log S, lse, z_y, sum z and the entropy (with the rank check's
    # verdict); a whole-vocab shard's log S, lse and entropy; a forward-only call's labelled
    # log-probs with the device checks' poison
    merge_gathered: Callable
    merged_tail: Callable
    labelled_logprob: Callable
    # bytes of scratch per element of a lean tile beyond the tile itself (fp32 copies)
    tile_scratch_bytes: int = 0
    # capabilities (None: not available)
    gemm_stats: Optional[FusedGemm] = None
    gemm_dlogits: Optional[FusedGemm] = None
    row_kernel: Optional[RowKernel] = None
    stats_dlogits: Optional[StatsDlogits] = None
    label_logprob: Optional[LabelLogprob] = None
    weight_grad_gemm: Optional[WeightGradGemm] = None
    # sampling-mask replay's layout of the kept entries and the mask's device checks in kernels
    # (replay.KeptEntries; None: its torch definition)
    kept_layout: Optional[Callable] = None
    # replay's union tiles (replay.UnionTiles): a tile of rows times the W rows of its union of kept
    # columns (gathered in the kernel), and the backward's gathered sums of rows (dX, dW)
    union_logits: Optional[Callable] = None
    union_sum_rows: Optional[Callable] = None
    # their layouts in kernels (one, or a call's two in one set of launches), and dW's columns ordered
    # by classes of use (from the layout's counts where it made them; None: replay.UnionTiles' and
    # replay.columns_by_use's torch definitions)
    union_layouts: Optional[Callable] = None
    columns_by_use: Optional[Callable] = None

    def stats_in_gemm(self, h, weight) -> bool:
        return self.gemm_stats is not None and h.shape[0] > 0 and self.gemm_stats.supported(h, weight)

    def dlogits_in_gemm(self, h, weight) -> bool:
        return self.gemm_dlogits is not None and h.shape[0] > 0 and self.gemm_dlogits.supported(h, weight)


def _triton_or_none() -> Optional[Backend]:
    try:
        from . import triton_backend
    except ImportError:
        return None
    return triton_backend.BACKEND


def triton_available() -> bool:
    return _triton_or_none() is not None


def select(impl: str, device: torch.device) -> Backend:
    """The backend that runs `impl` on `device`: "torch" the reference; "triton" the Triton kernels
    (ValueError where Triton does not import); "auto" the Triton kernels on CUDA (the torch
    reference elsewhere), plus QuACK's row kernel and dW GEMM, which decline where they do not
    apply (cute_backend.py)."""
    torch_backend, cute_backend, triton_module = _parts()
    # (read from the modules on every call: tests and QuACK's install swap them at run time)
    triton = None if triton_module is None else triton_module.BACKEND
    if impl == "torch":
        return torch_backend.BACKEND
    if impl == "triton":
        if triton is None:
            raise ValueError("impl: 'triton' was requested but triton cannot be imported")
        return triton
    base = triton if device.type == "cuda" and triton is not None else torch_backend.BACKEND
    parts = (base, cute_backend.ROW_KERNEL, cute_backend.WEIGHT_GRAD_GEMM)
    # one Backend per combination (a dataclasses.replace on every call is host time in the steady
    # state); keyed by identity, so a part swapped at run time (tests, QuACK installed) is seen
    key = tuple(map(id, parts))
    cached = _AUTO_BACKENDS.get(key)
    if cached is None or not all(map(operator.is_, cached[0], parts)):
        cached = _AUTO_BACKENDS[key] = (parts, replace(base, row_kernel=parts[1], weight_grad_gemm=parts[2]))
    return cached[1]


_AUTO_BACKENDS: dict = {}
_PARTS: Optional[tuple] = None


def _parts() -> tuple:
    """The modules (torch_backend, cute_backend, triton_backend or None where Triton does not
    import): imported on the first call (they import this module), then kept: an import statement
    is host time on every call."""
    global _PARTS
    if _PARTS is None:
        from . import cute_backend, torch_backend

        try:
            from . import triton_backend
        except ImportError:
            triton_backend = None
        _PARTS = (torch_backend, cute_backend, triton_backend)
    return _PARTS
