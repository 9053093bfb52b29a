"""The chunk loop and its autograd Function (backend-agnostic).

`LinearSoftmaxStats` maps (hidden, weight shard, targets) to four differentiable per-token fp32
statistics of z = hidden @ W_full.T / T over the global unpadded vocab:

    target          z_y
    lse             log sum_k exp(z_k)
    sum_logits      sum_k z_k            (only when asked: label smoothing)
    entropy         H = -sum_k p_k log p_k  (only when asked)

Everything users want is an O(tokens) expression of these (api.py): log p_y = target - lse,
cross-entropy with label smoothing and z-loss, ... lse also comes in its two parts, the row max M
and log S = log sum_k exp(z_k - M) (not differentiable): log p_k = (z_k - M) - log S keeps digits
that rounding M + log S to fp32 loses (saturated tokens, |z| ~ 50), in values and in dlogits.

Forward: for each chunk of token rows, logits = h_chunk @ W.T (the only [chunk, V_local] tensor),
backend.shard_stats reduces it to per-token partials; after the loop the partials of all chunks are
merged across TP ranks with two collectives. Only hidden, weight, row indices and per-token lse
(M, log S) / entropy are saved. The chunk of logits is in the input dtype (like Megatron's output layer), or fp32
with `logits_dtype=torch.float32` (an fp32-output GEMM; its dlogits are rounded to the input dtype
for the two backward GEMMs).

Backward: the upstream gradients of the four statistics become per-token coefficients
(see torch_backend.shard_dlogits_):

    d target / dz_k          = [k == y]                 -> coef_target  += g_target
    d lse / dz_k             = p_k                      -> coef_p       += g_lse
    d sum_logits / dz_k      = 1                        -> coef_uniform += g_sum
    d H / dz_k               = -p_k (log p_k + H)       -> coef_p -= g_H H, coef_pz -= g_H
                                                           (coef_pz multiplies log p_k = z_k - lse)

and each chunk's logits are recomputed, overwritten in place with dlogits, and multiplied into
dX (rows of this chunk) and dW (accumulated in fp32 over chunks, straight into Megatron's
`weight.main_grad` when asked). dX is then summed over TP ranks (reduce-scattered under sequence
parallelism), as Megatron's ColumnParallelLinear does.

Both autograd Functions are first-order only: a second backward through their gradients (a
gradient penalty, create_graph=True) raises instead of silently dropping the second-order term.
They run with autocast off (api.py has already cast the inputs as F.linear would), so forward and a
backward called inside or outside autocast see the same dtypes.
"""

from __future__ import annotations

import contextlib
import functools
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
    # Megatron's gradient-accumulation fusion: the parameter whose fp32 `main_grad` receives dW
    # (under autocast, the fp32 parameter of which `weight` is a cast copy); None = autograd.
    main_grad_param: Optional[Tensor] = None
    logits_dtype: Optional[torch.dtype] = None  # None: the input dtype


def autocast_off(device: torch.device):
    """A context without autocast for the op's own GEMMs (a no-op when autocast is off)."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        enabled = False
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()


_SECOND_ORDER_ERROR = (
    b"megatron_fused_ce: second-order gradients (a backward through the gradient of "
    b"linear_logprobs / linear_cross_entropy / linear_grpo_loss, e.g. a gradient penalty with "
    b"create_graph=True) are not supported; compute that term with materialized logits")


def first_order_only(backward):
    """Run `backward` without building a graph. Under create_graph=True its gradients are
    returned attached to a node that raises when differentiated again (as torch's
    once_differentiable does, but whatever the upstream gradients, and with our message): the
    chunk loop's gradient is not itself differentiable, and dropping the second-order term
    would give a wrong gradient penalty without a word."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled():
            return grads
        delayed_error = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
        if delayed_error is None:
            raise RuntimeError(_SECOND_ORDER_ERROR.decode())
        tensors = [g for g in grads if isinstance(g, Tensor)]
        raising = delayed_error(_SECOND_ORDER_ERROR, len(tensors))(
            *[g.detach().requires_grad_() for g in tensors])
        raising = iter(raising if isinstance(raising, tuple) else (raising,))
        return tuple(next(raising) if isinstance(g, Tensor) else g for g in grads)

    return wrapper


def _chunks(num_rows: int, chunk_size: int):
    for start in range(0, num_rows, chunk_size):
        yield start, min(start + chunk_size, num_rows)


def _rows(full_hidden: Tensor, row_index: Optional[Tensor]) -> Tensor:
    """Hidden rows that have a label (all rows when row_index is None)."""
    return full_hidden if row_index is None else full_hidden.index_select(0, row_index)


def adds_into_main_grad(weight: Tensor, accumulate_into_main_grad: bool) -> bool:
    """Whether dW goes into Megatron's fp32 `weight.main_grad` (gradient-accumulation fusion)."""
    return weight.requires_grad and accumulate_into_main_grad and hasattr(weight, "main_grad")


def chunk_logits(h: Tensor, weight: Tensor, spec: ChunkSpec) -> Tensor:
    """The chunk's logits h @ W.T in the input dtype, or in `spec.logits_dtype` (fp32)."""
    if spec.logits_dtype is None or spec.logits_dtype == h.dtype:
        return torch.mm(h, weight.t())
    return matmul_fp32(h, weight.t())


def gemm_input(dlogits: Tensor, h: Tensor) -> Tensor:
    """dlogits as the dX / dW GEMMs take them: in the input dtype (a no-op unless fp32 logits)."""
    return dlogits if dlogits.dtype == h.dtype else dlogits.to(h.dtype)


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
        logits = chunk_logits(hidden_rows[start:end], weight, spec)
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
                           sum_exp_shifted=empty if spec.want_entropy else None)
    return reductions.merge_shard_stats(stats, spec.tp_group)


_FP32_OUT_MATMUL_OK = None  # whether cuBLAS fp32-output matmuls of bf16/fp16 inputs work here


def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """fp32(a @ b) of bf16/fp16 inputs: cuBLAS's fp32 output (out_dtype) on CUDA, fp32 copies
    of the inputs elsewhere (CPU: no such kernel)."""
    global _FP32_OUT_MATMUL_OK
    if a.is_cuda and _FP32_OUT_MATMUL_OK is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _FP32_OUT_MATMUL_OK = True
            return out
        except (TypeError, RuntimeError):
            _FP32_OUT_MATMUL_OK = False
    return torch.mm(a.float(), b.float())


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
    offsets: tuple,
    coefs: dict,
    dx_rows: Optional[Tensor],
    dw_out: Optional[Tensor],
    dw_accumulate: bool,
) -> None:
    """Chunk loop of the backward pass: writes dX rows, and dW into `dw_out` (adding to what it
    holds if `dw_accumulate`, e.g. Megatron's main_grad; else the first chunk overwrites).
    `offsets`: the rows' (max, log_sum_exp) of the merged softmax (see MergedStats)."""
    row_max, log_sum_exp = offsets
    for index, (start, end) in enumerate(_chunks(hidden_rows.shape[0], spec.chunk_size)):
        h = hidden_rows[start:end]
        dlogits = spec.backend.shard_dlogits_(
            chunk_logits(h, weight, spec),
            local_target[start:end],
            spec.num_valid_cols,
            spec.inv_temperature,
            row_max[start:end],
            *(None if c is None else c[start:end] for c in
              (coefs["p"], coefs["pz"], coefs["target"], coefs["uniform"])),
            log_sum_exp=log_sum_exp[start:end],
        )
        dlogits = gemm_input(dlogits, h)
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


def coefficients(g_target, g_lse, g_sum, g_entropy, entropy, lse) -> Optional[dict]:
    """Upstream grads of the four statistics -> per-token dlogits coefficients (see module doc)."""
    if all(g is None for g in (g_target, g_lse, g_sum, g_entropy)):
        return None
    coef_p = torch.zeros_like(lse)
    if g_lse is not None:
        coef_p = coef_p + g_lse
    coef_pz = None
    if g_entropy is not None:
        coef_p = coef_p - g_entropy * entropy
        coef_pz = -g_entropy
    return {"p": coef_p, "pz": coef_pz, "target": g_target, "uniform": g_sum}


class LinearSoftmaxStats(torch.autograd.Function):
    """(hidden [n, H], weight [V_local, H]) -> per-token target, lse, sum_logits, entropy, and
    (not differentiable) lse's two parts, max and log_sum_exp, for precise log-probs.

    `on_chunk` (optional, not differentiated) is handed each chunk's logits in the forward pass
    (sampling.py collects top-k candidates there)."""

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, on_chunk=None):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        merged = forward_stats(_rows(full_hidden, row_index), weight, local_target, spec, on_chunk)
        ctx.spec = spec
        ctx.num_full_rows = full_hidden.shape[0]
        ctx.set_materialize_grads(False)
        saved_entropy = merged.entropy if spec.want_entropy else None
        # Only the local hidden slice is kept under SP: backward all-gathers it again, as
        # Megatron's ColumnParallelLinear does, instead of holding the tp-times larger copy.
        ctx.save_for_backward(hidden, weight, row_index, local_target, merged.lse, saved_entropy,
                              merged.max, merged.log_sum_exp)
        ctx.mark_non_differentiable(merged.max, merged.log_sum_exp)
        return (merged.target, merged.lse, merged.sum_logits, merged.entropy, merged.max,
                merged.log_sum_exp)

    @staticmethod
    @first_order_only
    def backward(ctx, g_target, g_lse, g_sum, g_entropy, *unused_parts_of_lse):
        hidden, weight, row_index, local_target, lse, entropy, row_max, log_sum_exp = ctx.saved_tensors
        spec: ChunkSpec = ctx.spec
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        coefs = coefficients(g_target, g_lse, g_sum, g_entropy, entropy, lse)

        with autocast_off(hidden.device):
            full_hidden = (reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel
                           else hidden)
            rows = _rows(full_hidden, row_index)
            dx_rows = rows.new_empty(rows.shape) if needs_dx else None
            into_main_grad = needs_dw and spec.main_grad_param is not None
            dw_out = grad_weight = None
            if needs_dw:
                dw_out = spec.main_grad_param.main_grad if into_main_grad else torch.empty(
                    weight.shape, dtype=_weight_grad_dtype(weight, rows.shape[0], spec), device=weight.device)
            if coefs is None or rows.shape[0] == 0:  # nothing to differentiate: zero gradients
                if dx_rows is not None:
                    dx_rows.zero_()
                if dw_out is not None and not into_main_grad:
                    dw_out.zero_()
            else:
                backward_grads(rows, weight, local_target, spec, (row_max, log_sum_exp), coefs, dx_rows,
                               dw_out, dw_accumulate=into_main_grad)
            if needs_dw and not into_main_grad:
                grad_weight = dw_out if dw_out.dtype == weight.dtype else dw_out.to(weight.dtype)

            grad_hidden = _input_grad(dx_rows, row_index, full_hidden.shape, spec) if needs_dx else None

        if into_main_grad:
            grad_weight = _main_grad_added(spec.main_grad_param, weight)
        return grad_hidden, grad_weight, None, None, None, None


def _main_grad_added(param: Tensor, weight: Tensor) -> Optional[Tensor]:
    """Megatron's gradient-accumulation-fusion convention: the gradient is already in main_grad;
    hand autograd a dummy zero gradient so that DDP's per-parameter hook still fires."""
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


class LinearLossGradInForward(torch.autograd.Function):
    """Gradients during the forward pass: 3 GEMMs per chunk instead of 4 (no backward recompute).

    Valid for a scalar loss whose gradient w.r.t. each token's statistics is known as soon as that
    token's chunk has been merged across TP ranks (cross-entropy, token-level GRPO ...).
    `token_grads(merged_chunk, positions, num_labelled)` returns (g_target, g_lse, g_sum_logits,
    g_entropy) for the chunk's tokens under a unit upstream gradient (None = no dependence);
    `positions` are their flat indices into labels.reshape(-1), `num_labelled` the number of
    labelled tokens of the whole call.

    Outputs: (anchor, target, lse, sum_logits, entropy, max, log_sum_exp). The statistics are plain values;
    `anchor` is a zero scalar that carries the gradient: callers return `loss_value + anchor`, and
    backward scales the dX and dW computed here by the anchor's upstream gradient (loss scaling,
    averaging over micro-batches ...). Costs: the chunk merge is done per chunk (2 collectives per
    chunk instead of 2 per call) and dX / dW (fp32 when summed over several chunks) live from forward to
    backward. Not for fp16 (api.py takes the recompute path there): dX would be stored in fp16
    under a unit upstream gradient, before the loss scale, and per-token terms like p/N underflow.
    """

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, token_grads):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        rows = _rows(full_hidden, row_index)
        needs_dx, needs_dw = hidden.requires_grad, weight.requires_grad
        into_main_grad = needs_dw and spec.main_grad_param is not None
        dx_rows = rows.new_empty(rows.shape) if needs_dx else None
        # Held until backward scales it: added to main_grad in fp32 there, else cast to the weight's dtype.
        dw_dtype = torch.float32 if into_main_grad else _weight_grad_dtype(weight, rows.shape[0], spec)
        dw_acc = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device) if needs_dw else None
        if dw_acc is not None and rows.shape[0] == 0:
            dw_acc.zero_()
        merged_chunks = []
        for index, (start, end) in enumerate(_chunks(rows.shape[0], spec.chunk_size)):
            h = rows[start:end]
            logits = chunk_logits(h, weight, spec)
            merged = reductions.merge_shard_stats(
                spec.backend.shard_stats(logits, local_target[start:end], spec.num_valid_cols,
                                         spec.inv_temperature, want_sum_logits=spec.want_sum_logits,
                                         want_entropy=spec.want_entropy),
                spec.tp_group)
            merged_chunks.append(merged)
            positions = (row_index[start:end] if row_index is not None
                         else torch.arange(start, end, device=rows.device))
            coefs = coefficients(*token_grads(merged, positions, rows.shape[0]), merged.entropy, merged.lse)
            if coefs is None:
                coefs = coefficients(None, torch.zeros_like(merged.lse), None, None, None, merged.lse)
            dlogits = gemm_input(spec.backend.shard_dlogits_(
                logits, local_target[start:end], spec.num_valid_cols, spec.inv_temperature, merged.max,
                coefs["p"], coefs["pz"], coefs["target"], coefs["uniform"],
                log_sum_exp=merged.log_sum_exp), h)
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
                   cat("entropy", spec.want_entropy), cat("max"), cat("log_sum_exp"))
        for out in outputs:
            if out is not None:
                ctx.mark_non_differentiable(out)
        anchor = torch.zeros((), dtype=torch.float32, device=hidden.device)
        return (anchor,) + outputs

    @staticmethod
    @first_order_only
    def backward(ctx, g_anchor, *unused_stat_grads):
        row_index, dx_rows, dw_acc, weight = ctx.saved_tensors
        spec: ChunkSpec = ctx.spec
        grad_hidden = grad_weight = None
        if dx_rows is not None:
            grad_hidden = _input_grad(dx_rows * g_anchor.to(dx_rows.dtype), row_index, ctx.full_shape, spec)
        if dw_acc is not None:
            # Not in place: the saved buffer must stay valid for a second backward (retain_graph).
            if ctx.into_main_grad:
                spec.main_grad_param.main_grad.addcmul_(dw_acc, g_anchor)
                grad_weight = _main_grad_added(spec.main_grad_param, weight)
            else:
                grad_weight = spec.backend.scale_cast(dw_acc, g_anchor, weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None
