"""The chunk loop and its autograd Function (backend-agnostic).

`LinearSoftmaxStats` maps (hidden, weight shard, targets) to four differentiable per-token fp32
statistics of z = hidden @ W_full.T / T over the global unpadded vocab:

    target          z_y
    lse             log sum_k exp(z_k)
    sum_logits      sum_k z_k            (only when asked: label smoothing)
    expected_logit  E_p[z] = sum_k p_k z_k  (only when asked: entropy)

Everything users want is an O(tokens) expression of these (api.py): log p_y = target - lse,
entropy = lse - expected_logit, cross-entropy with label smoothing and z-loss, ...

Forward: for each chunk of token rows, logits = h_chunk @ W.T (the only [chunk, V_local] tensor),
backend.shard_stats reduces it to per-token partials; after the loop the partials of all chunks are
merged across TP ranks with two collectives. Only hidden, weight, row indices and per-token lse /
E_p[z] are saved.

Backward: the upstream gradients of the four statistics become per-token coefficients
(see torch_backend.shard_dlogits_):

    d target / dz_k          = [k == y]          -> coef_target  += g_target
    d lse / dz_k             = p_k               -> coef_p       += g_lse
    d sum_logits / dz_k      = 1                 -> coef_uniform += g_sum
    d E_p[z] / dz_k          = p_k (1 + z_k - E) -> coef_p += g_E (1 - E), coef_pz += g_E

and each chunk's logits are recomputed, overwritten in place with dlogits, and multiplied into
dX (rows of this chunk) and dW (accumulated in fp32 over chunks, straight into Megatron's
`weight.main_grad` when asked). dX is then summed over TP ranks (reduce-scattered under sequence
parallelism), as Megatron's ColumnParallelLinear does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from . import reductions
from .torch_backend import ShardStats


@dataclass(frozen=True)
class ChunkSpec:
    """Static settings of one call (everything but tensors)."""

    tp_group: Any
    backend: Any  # torch_backend or triton_backend module
    num_valid_cols: int  # columns of this shard below the true vocab size
    inv_temperature: float
    chunk_size: int
    want_sum_logits: bool
    want_entropy: bool
    sequence_parallel: bool
    accumulate_into_main_grad: bool


def _chunks(num_rows: int, chunk_size: int):
    for start in range(0, num_rows, chunk_size):
        yield start, min(start + chunk_size, num_rows)


def _rows(full_hidden: Tensor, row_index: Optional[Tensor]) -> Tensor:
    """Hidden rows that have a label (all rows when row_index is None)."""
    return full_hidden if row_index is None else full_hidden.index_select(0, row_index)


def adds_into_main_grad(weight: Tensor, accumulate_into_main_grad: bool) -> bool:
    """Whether dW goes into Megatron's fp32 `weight.main_grad` (gradient-accumulation fusion)."""
    return weight.requires_grad and accumulate_into_main_grad and hasattr(weight, "main_grad")


def _weight_grad_dtype(weight: Tensor, num_rows: int, spec: ChunkSpec) -> torch.dtype:
    """dW summed over chunks is kept in fp32 (low-precision accumulation drifts: axolotl #1601,
    Liger #827); one GEMM over all rows writes the weight's dtype (cuBLAS accumulates in fp32)."""
    return weight.dtype if num_rows <= spec.chunk_size else torch.float32


def forward_stats(hidden_rows: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec,
                  on_chunk=None):
    """Chunk loop of the forward pass -> reductions.MergedStats over the rows given.
    `on_chunk(logits)`, if given, also sees each chunk's logits (sampling.py: top-k candidates)."""
    backend, partials = spec.backend, []
    for start, end in _chunks(hidden_rows.shape[0], spec.chunk_size):
        logits = torch.mm(hidden_rows[start:end], weight.t())
        partials.append(
            backend.shard_stats(
                logits,
                local_target[start:end],
                spec.num_valid_cols,
                spec.inv_temperature,
                want_sum_logits=spec.want_sum_logits,
                want_entropy=spec.want_entropy,
            )
        )
        if on_chunk is not None:
            on_chunk(logits)
        del logits
    if partials:
        stats = ShardStats(**{
            name: None if getattr(partials[0], name) is None
            else torch.cat([getattr(p, name) for p in partials])
            for name in ShardStats.__dataclass_fields__
        })
    else:  # no labelled row here: still take part in the collectives
        empty = hidden_rows.new_zeros(0, dtype=torch.float32)
        stats = ShardStats(max=empty, sum_exp=empty, target=empty,
                           sum_logits=empty if spec.want_sum_logits else None,
                           sum_exp_logits=empty if spec.want_entropy else None)
    return reductions.merge_shard_stats(stats, spec.tp_group)


_FP32_OUT_MATMUL_OK = None  # whether cuBLAS fp32-output matmuls of bf16/fp16 inputs work here


def matmul_into_(out: Tensor, a: Tensor, b: Tensor, *, accumulate: bool) -> None:
    """out (+)= a @ b; `accumulate=False` overwrites (no zero-fill, no read of `out`).

    `out` is fp32 when gradients are summed over chunks: low-precision weight-gradient
    accumulation drifts (axolotl #1601, Liger #827). On CUDA cuBLAS writes or adds the fp32 product
    of bf16/fp16 inputs in place (out_dtype); elsewhere (CPU) the chunk product is rounded to the
    input dtype first. A single GEMM over all rows may write the input dtype directly: cuBLAS
    accumulates in fp32 internally.
    """
    global _FP32_OUT_MATMUL_OK
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    if out.is_cuda and _FP32_OUT_MATMUL_OK is not False:
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            else:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
            _FP32_OUT_MATMUL_OK = True
            return
        except (TypeError, RuntimeError):
            _FP32_OUT_MATMUL_OK = False
    if accumulate:
        out.add_(torch.mm(a, b))
    else:
        out.copy_(torch.mm(a, b))


def backward_grads(
    hidden_rows: Tensor,
    weight: Tensor,
    local_target: Tensor,
    spec: ChunkSpec,
    lse: Tensor,
    coefs: dict,
    dx_rows: Optional[Tensor],
    dw_out: Optional[Tensor],
    dw_accumulate: bool,
) -> None:
    """Chunk loop of the backward pass: writes dX rows, and dW into `dw_out` (adding to what it
    holds if `dw_accumulate`, e.g. Megatron's main_grad; else the first chunk overwrites)."""
    for index, (start, end) in enumerate(_chunks(hidden_rows.shape[0], spec.chunk_size)):
        h = hidden_rows[start:end]
        dlogits = spec.backend.shard_dlogits_(
            torch.mm(h, weight.t()),
            local_target[start:end],
            spec.num_valid_cols,
            spec.inv_temperature,
            lse[start:end],
            *(None if c is None else c[start:end] for c in
              (coefs["p"], coefs["pz"], coefs["target"], coefs["uniform"])),
        )
        if dx_rows is not None:
            torch.mm(dlogits, weight, out=dx_rows[start:end])
        if dw_out is not None:
            matmul_into_(dw_out, dlogits.t(), h, accumulate=dw_accumulate or index > 0)
        del dlogits  # free this chunk before the next one's GEMM: one chunk alive at the peak


def _input_grad(dx_rows: Tensor, row_index: Optional[Tensor], full_shape, spec: ChunkSpec) -> Tensor:
    """This rank's partial dX of the labelled rows -> the full input gradient of `hidden`: scatter
    back to all (gathered) rows, then sum over TP ranks (reduce-scatter under SP), as Megatron's
    ColumnParallelLinear does in its backward."""
    dx_full = dx_rows if row_index is None else dx_rows.new_zeros(full_shape).index_copy_(0, row_index, dx_rows)
    if spec.sequence_parallel:
        return reductions.reduce_scatter_sequence(dx_full, spec.tp_group)
    return reductions.all_reduce_sum_(dx_full, spec.tp_group)


def coefficients(g_target, g_lse, g_sum, g_expected, expected_logit, lse) -> Optional[dict]:
    """Upstream grads of the four statistics -> per-token dlogits coefficients (see module doc)."""
    if all(g is None for g in (g_target, g_lse, g_sum, g_expected)):
        return None
    coef_p = torch.zeros_like(lse)
    if g_lse is not None:
        coef_p = coef_p + g_lse
    coef_pz = None
    if g_expected is not None:
        coef_p = coef_p + g_expected * (1.0 - expected_logit)
        coef_pz = g_expected
    return {"p": coef_p, "pz": coef_pz, "target": g_target, "uniform": g_sum}


class LinearSoftmaxStats(torch.autograd.Function):
    """(hidden [n, H], weight [V_local, H]) -> per-token target, lse, sum_logits, E_p[z].

    `on_chunk` (optional, not differentiated) is handed each chunk's logits in the forward pass
    (sampling.py collects top-k candidates there)."""

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, on_chunk=None):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        merged = forward_stats(_rows(full_hidden, row_index), weight, local_target, spec, on_chunk)
        ctx.spec = spec
        ctx.num_full_rows = full_hidden.shape[0]
        ctx.set_materialize_grads(False)
        saved_expected = merged.expected_logit if spec.want_entropy else None
        # Only the local hidden slice is kept under SP: backward all-gathers it again, as
        # Megatron's ColumnParallelLinear does, instead of holding the tp-times larger copy.
        ctx.save_for_backward(hidden, weight, row_index, local_target, merged.lse, saved_expected)
        return merged.target, merged.lse, merged.sum_logits, merged.expected_logit

    @staticmethod
    def backward(ctx, g_target, g_lse, g_sum, g_expected):
        hidden, weight, row_index, local_target, lse, expected_logit = ctx.saved_tensors
        spec: ChunkSpec = ctx.spec
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        coefs = coefficients(g_target, g_lse, g_sum, g_expected, expected_logit, lse)

        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        rows = _rows(full_hidden, row_index)
        dx_rows = rows.new_empty(rows.shape) if needs_dx else None
        into_main_grad = needs_dw and adds_into_main_grad(weight, spec.accumulate_into_main_grad)
        dw_out = grad_weight = None
        if needs_dw:
            dw_out = weight.main_grad if into_main_grad else torch.empty(
                weight.shape, dtype=_weight_grad_dtype(weight, rows.shape[0], spec), device=weight.device)
        if coefs is None or rows.shape[0] == 0:  # nothing to differentiate: zero gradients
            if dx_rows is not None:
                dx_rows.zero_()
            if dw_out is not None and not into_main_grad:
                dw_out.zero_()
        else:
            backward_grads(rows, weight, local_target, spec, lse, coefs, dx_rows, dw_out,
                           dw_accumulate=into_main_grad)
        if needs_dw and not into_main_grad:
            grad_weight = dw_out if dw_out.dtype == weight.dtype else dw_out.to(weight.dtype)

        grad_hidden = _input_grad(dx_rows, row_index, full_hidden.shape, spec) if needs_dx else None

        if into_main_grad:
            # Megatron's gradient-accumulation-fusion convention: the gradient is already in
            # main_grad; hand autograd a dummy so DDP's per-parameter hook still fires.
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                grad_weight = torch.zeros_like(weight)
        return grad_hidden, grad_weight, None, None, None, None


class LinearLossGradInForward(torch.autograd.Function):
    """Gradients during the forward pass: 3 GEMMs per chunk instead of 4 (no backward recompute).

    Valid for a scalar loss whose gradient w.r.t. each token's statistics is known as soon as that
    token's chunk has been merged across TP ranks (cross-entropy, token-level GRPO ...).
    `token_grads(merged_chunk, positions, num_labelled)` returns (g_target, g_lse, g_sum_logits,
    g_expected) for the chunk's tokens under a unit upstream gradient (None = no dependence);
    `positions` are their flat indices into labels.reshape(-1), `num_labelled` the number of
    labelled tokens of the whole call.

    Outputs: (anchor, target, lse, sum_logits, expected_logit). The statistics are plain values;
    `anchor` is a zero scalar that carries the gradient: callers return `loss_value + anchor`, and
    backward scales the dX and dW computed here by the anchor's upstream gradient (loss scaling,
    averaging over micro-batches ...). Costs: the chunk merge is done per chunk (2 collectives per
    chunk instead of 2 per call) and dX / dW (fp32 when summed over several chunks) live from forward to
    backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, token_grads):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        rows = _rows(full_hidden, row_index)
        needs_dx, needs_dw = hidden.requires_grad, weight.requires_grad
        into_main_grad = needs_dw and adds_into_main_grad(weight, spec.accumulate_into_main_grad)
        dx_rows = rows.new_empty(rows.shape) if needs_dx else None
        # Held until backward scales it: added to main_grad in fp32 there, else cast to the weight's dtype.
        dw_dtype = torch.float32 if into_main_grad else _weight_grad_dtype(weight, rows.shape[0], spec)
        dw_acc = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device) if needs_dw else None
        if dw_acc is not None and rows.shape[0] == 0:
            dw_acc.zero_()
        merged_chunks = []
        for index, (start, end) in enumerate(_chunks(rows.shape[0], spec.chunk_size)):
            h = rows[start:end]
            logits = torch.mm(h, weight.t())
            merged = reductions.merge_shard_stats(
                spec.backend.shard_stats(logits, local_target[start:end], spec.num_valid_cols,
                                         spec.inv_temperature, want_sum_logits=spec.want_sum_logits,
                                         want_entropy=spec.want_entropy),
                spec.tp_group)
            merged_chunks.append(merged)
            positions = (row_index[start:end] if row_index is not None
                         else torch.arange(start, end, device=rows.device))
            coefs = coefficients(*token_grads(merged, positions, rows.shape[0]), merged.expected_logit, merged.lse)
            if coefs is None:
                coefs = coefficients(None, torch.zeros_like(merged.lse), None, None, None, merged.lse)
            dlogits = spec.backend.shard_dlogits_(
                logits, local_target[start:end], spec.num_valid_cols, spec.inv_temperature, merged.lse,
                coefs["p"], coefs["pz"], coefs["target"], coefs["uniform"])
            if dx_rows is not None:
                torch.mm(dlogits, weight, out=dx_rows[start:end])
            if dw_acc is not None:
                matmul_into_(dw_acc, dlogits.t(), h, accumulate=index > 0)
            del logits, dlogits  # one chunk alive at the peak

        def cat(name, wanted=True):
            if not wanted:
                return None
            if not merged_chunks:  # no labelled row
                return rows.new_zeros(0, dtype=torch.float32)
            return torch.cat([getattr(m, name) for m in merged_chunks])

        ctx.spec = spec
        ctx.into_main_grad = into_main_grad
        ctx.full_shape = full_hidden.shape
        ctx.save_for_backward(row_index, dx_rows, dw_acc, weight)
        outputs = (cat("target"), cat("lse"), cat("sum_logits", spec.want_sum_logits),
                   cat("expected_logit", spec.want_entropy))
        for out in outputs:
            if out is not None:
                ctx.mark_non_differentiable(out)
        anchor = torch.zeros((), dtype=torch.float32, device=hidden.device)
        return (anchor,) + outputs

    @staticmethod
    def backward(ctx, g_anchor, *unused_stat_grads):
        row_index, dx_rows, dw_acc, weight = ctx.saved_tensors
        spec: ChunkSpec = ctx.spec
        grad_hidden = grad_weight = None
        if dx_rows is not None:
            grad_hidden = _input_grad(dx_rows * g_anchor.to(dx_rows.dtype), row_index, ctx.full_shape, spec)
        if dw_acc is not None:
            # Not in place: the saved buffer must stay valid for a second backward (retain_graph).
            if ctx.into_main_grad:
                weight.main_grad.addcmul_(dw_acc, g_anchor)
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
                    grad_weight = torch.zeros_like(weight)
            else:
                grad_weight = spec.backend.scale_cast(dw_acc, g_anchor, weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None
