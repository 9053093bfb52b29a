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

Forward: the per-token partials of this shard, merged across TP ranks with two collectives after
the loop. Where the backend has it (Triton, bf16/fp16), `gemm_shard_stats` computes them in the
logits GEMM's epilogue: no logits in memory at all. Otherwise, for each chunk of token rows,
logits = h_chunk @ W.T (the only [chunk, V_local] tensor) and backend.shard_stats reduces it. Only
hidden, weight, row indices and per-token lse (M, log S) / entropy are saved. The chunk of logits is in the input dtype (like Megatron's output layer), or fp32
with `logits_dtype=torch.float32` (an fp32-output GEMM; its dlogits are rounded to the input dtype
for the two backward GEMMs).

Backward: the upstream gradients of the four statistics become per-token coefficients
(see backends/torch_backend.shard_dlogits_):

    d target / dz_k          = [k == y]                 -> coef_target  += g_target
    d lse / dz_k             = p_k                      -> coef_p       += g_lse
    d sum_logits / dz_k      = 1                        -> coef_uniform += g_sum
    d H / dz_k               = -p_k (log p_k + H)       -> coef_p -= g_H H, coef_pz -= g_H
                                                           (coef_pz multiplies log p_k = z_k - lse)

and each chunk's logits are recomputed as dlogits (gemm.dlogits_gemm: on the Triton backend the
logits GEMM's epilogue writes dlogits, no logits in memory; else the logits, overwritten in place)
and multiplied into dX (rows of this chunk) and dW (accumulated in fp32 over chunks, straight into
Megatron's `weight.main_grad` when asked). dX is then summed over TP ranks (reduce-scattered under sequence
parallelism), as Megatron's ColumnParallelLinear does.

Each chunk is one GEMM over the whole vocab shard (docs/design.md §10.1); `spec.lean`
(memory_mode="lean") replaces chunks by tiles (lean.py).

Both autograd Functions are first-order only: a second backward through their gradients (a
gradient penalty, create_graph=True) raises instead of silently dropping the second-order term.
They run with autocast off (api.py has already cast the inputs as F.linear would), so forward and a
backward called inside or outside autocast see the same dtypes.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from . import lean, reductions
from .backends import Backend, ShardStats
from .forward_grad import PER_ROW, ForwardGradLoss
from .gemm import dlogits_gemm, gemm_input, logits_gemm, matmul_add_cast, matmul_fp32, matmul_into_


@dataclass(frozen=True)
class ChunkSpec:
    """Static settings of one call (everything but tensors)."""

    tp_group: Any
    backend: Backend  # the per-chunk math and its capabilities (backends/__init__.py)
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
    lean: Optional[lean.LeanTiles] = None  # memory_mode="lean": tile sizes (None: fast mode)


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


def row_chunks(num_rows: int, chunk_size: int):
    """(start, end) of each chunk of `chunk_size` rows (the last one may be shorter)."""
    for start in range(0, num_rows, chunk_size):
        yield start, min(start + chunk_size, num_rows)


def labelled_rows(full_hidden: Tensor, row_index: Optional[Tensor]) -> Tensor:
    """Hidden rows that have a label (all rows when row_index is None)."""
    return full_hidden if row_index is None else full_hidden.index_select(0, row_index)


def adds_into_main_grad(weight: Tensor, accumulate_into_main_grad: bool) -> bool:
    """Whether dW goes into Megatron's fp32 `weight.main_grad` (gradient-accumulation fusion)."""
    return weight.requires_grad and accumulate_into_main_grad and hasattr(weight, "main_grad")


def _weight_grad_dtype(weight: Tensor, num_rows: int, spec: ChunkSpec) -> torch.dtype:
    """dW summed over chunks is kept in fp32 (low-precision accumulation drifts: axolotl #1601,
    Liger #827); one GEMM over all rows writes the weight's dtype (cuBLAS accumulates in fp32)."""
    return weight.dtype if num_rows <= spec.chunk_size else torch.float32


def chunk_logits(h: Tensor, weight: Tensor, spec: ChunkSpec) -> Tensor:
    """A chunk's logits h @ W.T in the input dtype, or in `spec.logits_dtype` (fp32)."""
    return logits_gemm(h, weight, spec.logits_dtype)


def forward_stats(hidden_rows: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec,
                  on_chunk=None):
    """The forward pass's statistics -> reductions.MergedStats over the rows given.
    `on_chunk(logits)`, if given, also sees each chunk's logits (sampling.py: top-k candidates), so
    the chunks of logits are then made even where the statistics could be taken inside the GEMM."""
    return reductions.merge_shard_stats(shard_partials(hidden_rows, weight, local_target, spec, on_chunk),
                                        spec.tp_group)


def shard_partials(hidden_rows: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec,
                   on_chunk=None) -> ShardStats:
    """forward_stats before the TP merge: this shard's ShardStats over the rows given (replay.py
    merges them with the partials of other rows, in one merge)."""
    backend = spec.backend
    if on_chunk is None and backend.stats_in_gemm(hidden_rows, weight):
        return backend.gemm_stats.run(
            hidden_rows, weight, local_target, spec.num_valid_cols, spec.inv_temperature,
            want_sum_logits=spec.want_sum_logits, want_entropy=spec.want_entropy,
            round_logits=spec.logits_dtype is None)
    if on_chunk is None and spec.lean is not None:
        return lean.tile_stats(hidden_rows, weight, local_target, spec)
    partials = []
    for start, end in row_chunks(hidden_rows.shape[0], spec.chunk_size):
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
        return ShardStats(**{
            name: None if getattr(partials[0], name) is None
            else torch.cat([getattr(p, name) for p in partials])
            for name in ShardStats.__dataclass_fields__
        })
    # no labelled row here: still take part in the collectives
    empty = hidden_rows.new_zeros(0, dtype=torch.float32)
    return ShardStats(max=empty, sum_exp=empty, target=empty,
                      sum_logits=empty if spec.want_sum_logits else None,
                      sum_exp_shifted=empty if spec.want_entropy else None)


def chunk_forward(h: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec, want_stats: bool):
    """A chunk's logits [rows, V_local] and, if asked, its ShardStats."""
    logits = chunk_logits(h, weight, spec)
    if not want_stats:
        return logits, None
    return logits, spec.backend.shard_stats(logits, local_target, spec.num_valid_cols, spec.inv_temperature,
                                            want_sum_logits=spec.want_sum_logits, want_entropy=spec.want_entropy)


def chunk_dlogits_(logits: Tensor, local_target: Tensor, spec: ChunkSpec, offsets: tuple, coefs: dict) -> Tensor:
    """Overwrite a chunk's logits with dlogits, returned as the GEMMs take them."""
    row_max, log_sum_exp = offsets
    spec.backend.shard_dlogits_(logits, local_target, spec.num_valid_cols, spec.inv_temperature, row_max,
                                coefs["p"], coefs["pz"], coefs["target"], coefs["uniform"], log_sum_exp=log_sum_exp)
    return logits


def recomputed_dlogits(h: Tensor, weight: Tensor, local_target: Tensor, spec: ChunkSpec, offsets: tuple,
                       coefs: dict) -> Tensor:
    """A chunk's dlogits [rows, V_local] in the GEMM input dtype, its softmax offsets known: from the
    logits GEMM's epilogue where the backend has it, else GEMM + dlogits kernel."""
    return dlogits_gemm(h, weight, local_target, spec.num_valid_cols, spec, offsets, coefs)


def grad_gemms(dlogits: Tensor, h: Tensor, weight: Tensor, spec: ChunkSpec, dx_out: Optional[Tensor],
               dw_out: Optional[Tensor], dw_accumulate: bool, scale: float = 1.0,
               cast_dw_to: Optional[torch.dtype] = None, dw_scale: float = 1.0) -> Optional[Tensor]:
    """dW into `dw_out` (adding to it if `dw_accumulate`) and dX of the chunk's rows
    into `dx_out`, from the chunk's dlogits times `scale` (the GEMMs' alpha; dW's times `dw_scale`
    too: the upstream gradient of a dW added into main_grad in the forward). With `cast_dw_to`
    (the last of several chunks, `dw_out` their fp32 sum), dW may instead be written in that dtype
    with the sum added by one GEMM (last_weight_grad): returned, else None."""
    dw_alpha = scale * dw_scale
    dw_last = None if cast_dw_to is None else last_weight_grad(dlogits, h, spec, dw_out, cast_dw_to, dw_alpha)
    if dw_out is not None and dw_last is None:
        matmul_into_(dw_out, dlogits.t(), h, accumulate=dw_accumulate, alpha=dw_alpha,
                     weight_grad_gemm=spec.backend.weight_grad_gemm)
    if dx_out is not None:
        matmul_into_(dx_out, dlogits, weight, accumulate=False, alpha=scale)
    return dw_last


def row_scaled_grad_gemms(dlogits: Tensor, h: Tensor, weight: Tensor, spec: ChunkSpec, dx_out: Optional[Tensor],
                          dw_out: Optional[Tensor], row_scale: Tensor, dw_accumulate: bool,
                          cast_dw_to: Optional[torch.dtype] = None, dw_scale: float = 1.0) -> Optional[Tensor]:
    """grad_gemms of diag(row_scale) @ dlogits without a pass over the chunk of dlogits: dX of the
    chunk is the fp32 product dlogits @ W times row_scale, rounded once into `dx_out`; dW =
    dlogits.T @ (row_scale * h), the scaled rows rounded once to the input dtype (as each element
    of scaled dlogits would be)."""
    scale = row_scale.unsqueeze(1)
    if dx_out is not None:
        torch.mul(matmul_fp32(dlogits, weight), scale, out=dx_out)  # fp32 math, one rounding
    if dw_out is None:
        return None
    scaled_h = torch.empty_like(h)
    torch.mul(h, scale, out=scaled_h)
    return grad_gemms(dlogits, scaled_h, weight, spec, None, dw_out, dw_accumulate, cast_dw_to=cast_dw_to,
                      dw_scale=dw_scale)


def last_of_several(cast_dw_to: Optional[torch.dtype], index: int, end: int, num_rows: int) -> Optional[torch.dtype]:
    """grad_gemms' `cast_dw_to` for chunk `index` ending at row `end`: set on the last chunk of
    several only (one chunk writes dW in the weight dtype by itself)."""
    return cast_dw_to if index > 0 and end == num_rows else None


def last_weight_grad(dlogits: Tensor, h: Tensor, spec: ChunkSpec, dw_sum: Tensor, dtype: torch.dtype,
                     scale: float = 1.0) -> Optional[Tensor]:
    """The last chunk's dW added to the fp32 sum of the others and written in `dtype` by one GEMM
    (the backend's weight_grad_gemm: gemm.matmul_add_cast), or None where no such GEMM applies (the
    caller then adds into the sum and casts later)."""
    gemm = spec.backend.weight_grad_gemm
    if gemm is None or not gemm.supported(dlogits.t(), h, dtype, add=dw_sum):
        return None  # checked before allocating: no [V, H] buffer unless the GEMM runs
    out = torch.empty(dw_sum.shape, dtype=dtype, device=dw_sum.device)
    if not matmul_add_cast(out, dlogits.t(), h, dw_sum, gemm, alpha=scale):  # `out` not addressable
        matmul_into_(dw_sum, dlogits.t(), h, accumulate=True, alpha=scale)
        out.copy_(dw_sum)
    return out


def _slice_coefs(coefs: dict, start: int, end: int) -> dict:
    return {k: None if c is None else c[start:end] for k, c in coefs.items()}


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
    cast_dw_to: Optional[torch.dtype] = None,
) -> Optional[Tensor]:
    """Chunk loop of the backward pass: writes dX rows, and dW into `dw_out` (adding to what it
    holds if `dw_accumulate`, e.g. Megatron's main_grad; else the first chunk overwrites).
    `offsets`: the rows' (max, log_sum_exp) of the merged softmax (see MergedStats). With
    `cast_dw_to` (dw_out an fp32 sum over chunks), the last chunk may write dW in that dtype
    (last_weight_grad): returned, else None."""
    row_max, log_sum_exp = offsets
    dw_last = None
    for index, (start, end) in enumerate(row_chunks(hidden_rows.shape[0], spec.chunk_size)):
        h = hidden_rows[start:end]
        dlogits = recomputed_dlogits(h, weight, local_target[start:end], spec,
                                     (row_max[start:end], log_sum_exp[start:end]), _slice_coefs(coefs, start, end))
        dw_last = grad_gemms(dlogits, h, weight, spec, None if dx_rows is None else dx_rows[start:end], dw_out,
                             dw_accumulate=dw_accumulate or index > 0,
                             cast_dw_to=last_of_several(cast_dw_to, index, end, hidden_rows.shape[0]))
        del dlogits  # free this chunk before the next one's GEMM: one chunk alive at the peak
    return dw_last


def weight_grad_cast_target(dw_out: Optional[Tensor], weight: Tensor, accumulate: bool) -> Optional[torch.dtype]:
    """The dtype the last chunk may write dW in: the weight's, where dw_out is an fp32
    sum over chunks returned to autograd (not Megatron's main_grad, not already that dtype)."""
    if dw_out is None or accumulate or dw_out.dtype == weight.dtype:
        return None
    return weight.dtype


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
        merged = forward_stats(labelled_rows(full_hidden, row_index), weight, local_target, spec, on_chunk)
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
        stats = (row_max, log_sum_exp)

        def write_grads(rows, dx_rows, dw_out, accumulate):
            if spec.lean is not None:  # two tile sweeps: dX token-outer, dW vocab-outer
                if dx_rows is not None:
                    lean.input_grad_sweep(rows, weight, local_target, spec, stats, coefs, dx_rows)
                if dw_out is not None:
                    lean.weight_grad_sweep(rows, weight, local_target, spec, stats, coefs, dw_out,
                                           accumulate=accumulate)
            else:
                return backward_grads(rows, weight, local_target, spec, stats, coefs, dx_rows, dw_out,
                                      dw_accumulate=accumulate, cast_dw_to=weight_grad_cast_target(dw_out, weight, accumulate))

        grad_hidden, grad_weight = recompute_grads(hidden, weight, row_index, spec, needs_dx, needs_dw,
                                                   coefs is not None, write_grads)
        return grad_hidden, grad_weight, None, None, None, None


def recompute_grads(hidden, weight, row_index, spec: ChunkSpec, needs_dx: bool, needs_dw: bool,
                    has_coefs: bool, write_grads) -> tuple:
    """The frame of every recompute backward (plain and sampler statistics): gather the SP hidden
    states again, allocate the dX rows and the dW buffer (or use Megatron's main_grad), let
    `write_grads(rows, dx_rows, dw_out, accumulate)` fill them (skipped, gradients zero, when
    nothing depends on the statistics; it may return dW already in the weight dtype instead of
    filling an fp32 dw_out), and return (grad_hidden, grad_weight) for autograd."""
    with autocast_off(hidden.device):
        full_hidden = (reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel
                       else hidden)
        rows = labelled_rows(full_hidden, row_index)
        dx_rows = rows.new_empty(rows.shape) if needs_dx else None
        into_main_grad = needs_dw and spec.main_grad_param is not None
        dw_out = grad_weight = dw_done = None
        if needs_dw:
            dw_dtype = weight.dtype if spec.lean is not None else _weight_grad_dtype(weight, rows.shape[0], spec)
            dw_out = spec.main_grad_param.main_grad if into_main_grad else torch.empty(
                weight.shape, dtype=dw_dtype, device=weight.device)
        if not has_coefs or rows.shape[0] == 0:  # nothing to differentiate: zero gradients
            if dx_rows is not None:
                dx_rows.zero_()
            if dw_out is not None and not into_main_grad:
                dw_out.zero_()
        else:
            dw_done = write_grads(rows, dx_rows, dw_out, into_main_grad)
        if needs_dw and not into_main_grad:
            if dw_done is not None:
                grad_weight = dw_done
            else:
                grad_weight = dw_out if dw_out.dtype == weight.dtype else dw_out.to(weight.dtype)
        grad_hidden = _input_grad(dx_rows, row_index, full_hidden.shape, spec) if needs_dx else None
    if into_main_grad:
        grad_weight = _main_grad_added(spec.main_grad_param, weight)
    return grad_hidden, grad_weight


def saved_tensors_hooks_active() -> bool:
    """Whether autograd's saved-tensor hooks are in force (torch.utils.checkpoint with
    use_reentrant=False, activation offloading): tensors saved for backward may then be dropped
    and the forward run again during backward, so a forward pass must have no side effect."""
    top = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


UNPAIRED_FORWARD_ATTR = "fused_ce_unpaired_forward"
UNPAIRED_FORWARD_MESSAGE = (
    "weight.main_grad holds the weight gradient of a forward pass that was never backpropagated "
    "(its autograd graph was freed without a backward: a loss computed under grad mode and dropped, "
    "e.g. an evaluation or log-prob pass outside torch.no_grad(), or a micro-batch abandoned after an "
    "error). With accumulate_into_main_grad the fast path adds dW to main_grad during the forward, so "
    "main_grad was filled with NaN instead of being left silently wrong. Zero the gradient buffer "
    "(Megatron: model.zero_grad_buffer()) before the next step, and run forward-only passes under "
    "torch.no_grad()")


class MainGradSideEffect:
    """The dW that LinearLossGradInForward (fast mode) added to `param.main_grad` during its forward,
    owned by the op's autograd node until a backward through it runs.

    If the node is freed with no backward ever run (the graph dropped, an exception after the
    forward), main_grad holds a gradient nobody asked for. It cannot be taken back here: that needs
    the chunk GEMMs again (and, under sequence parallelism, a collective on every rank at once),
    and the buffer may have been zeroed since. So main_grad is filled with NaN and the parameter
    marked: the next fused call on it raises on every rank (api.py) unless the buffer was zeroed
    in between, and an optimizer step without such a call sees NaN, never a wrong gradient."""

    def __init__(self, param: Tensor):
        self.param = param
        self.backward_ran = False

    def __del__(self):
        if self.backward_ran:
            return
        main_grad = getattr(self.param, "main_grad", None)
        if main_grad is None:
            return
        try:
            poison_main_grad(self.param, UNPAIRED_FORWARD_MESSAGE)
        except Exception:  # interpreter shutdown: nothing left to protect
            pass


def poison_main_grad(param: Tensor, message: str) -> None:
    """Fill `param.main_grad` with NaN and mark the parameter with `message`: an optimizer step sees
    NaN, and the next fused call on it raises `message` on every rank (unpaired_forward_error)."""
    param.main_grad.fill_(float("nan"))
    setattr(param, UNPAIRED_FORWARD_ATTR, message)
    warnings.warn("megatron_fused_ce: " + message, RuntimeWarning, stacklevel=3)


# g may differ from the expected value by the rounding of how each side computes it (Megatron
# divides the loss by the token count, then by the number of micro-batches, in fp32): a few ulps.
EXPECTED_GRAD_RTOL = 2.0 ** -20

UPSTREAM_GRAD_MISMATCH_MESSAGE = (
    "the upstream gradient of a loss computed with expected_upstream_grad={expected:.7g} was {actual:.7g}. "
    "With accumulate_into_main_grad the fast path added expected_upstream_grad x dW to main_grad during "
    "the forward; a different gradient cannot be corrected exactly (the difference of two terms of the "
    "size of dW keeps nothing of a small gradient), so main_grad was filled with NaN instead. Pass the "
    "gradient the backward will bring (Megatron's loss funcs: num_microbatches for "
    "calculate_per_token_loss=False), or leave expected_upstream_grad=None (dW then waits in an fp32 "
    "buffer for the backward). Zero the gradient buffer (model.zero_grad_buffer()) before the next step")


def check_upstream_grad(param: Tensor, actual: float, expected: float) -> None:
    """The first backward of a forward that added expected·dW into main_grad: poison main_grad
    unless the upstream gradient is the expected one (up to EXPECTED_GRAD_RTOL)."""
    if abs(actual - expected) <= EXPECTED_GRAD_RTOL * abs(expected):
        return
    poison_main_grad(param, UPSTREAM_GRAD_MISMATCH_MESSAGE.format(expected=expected, actual=actual))


def unpaired_forward_error(param: Optional[Tensor]) -> Optional[str]:
    """The error for a fused call that adds into `param.main_grad` while it still holds NaN from a
    gradient that could not be made exact (an unpaired forward: MainGradSideEffect; an unexpected
    upstream gradient: check_upstream_grad); None, and the mark cleared, once it was zeroed.
    Reads main_grad (one pass, one host sync) only while the mark is set."""
    message = None if param is None else getattr(param, UNPAIRED_FORWARD_ATTR, None)
    if not message:
        return None
    if bool(torch.isnan(param.main_grad).any()):
        return message if isinstance(message, str) else UNPAIRED_FORWARD_MESSAGE
    setattr(param, UNPAIRED_FORWARD_ATTR, None)
    return None


def _main_grad_added(param: Tensor, weight: Tensor) -> Optional[Tensor]:
    """Megatron's gradient-accumulation-fusion convention (its ColumnParallelLinear backward): the
    gradient is already in main_grad; hand autograd a dummy gradient so that DDP's per-parameter
    hook still fires. DDP ignores it unless the parameter has `zero_out_wgrad` (a weight tied to
    the embedding on the same stage: DDP then adds .grad, the embedding's gradient plus this
    dummy, to main_grad), so it is zeros only then; uninitialized otherwise (no [V, H] memset
    per micro-batch)."""
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        if getattr(param, "zero_out_wgrad", False):
            return torch.zeros_like(weight)
        return torch.empty_like(weight)
    return None


class LinearLossGradInForward(torch.autograd.Function):
    """Gradients during the forward pass: 3 GEMMs per chunk instead of 4 (no backward recompute).

    Valid for a scalar loss whose gradient w.r.t. each token's statistics is known as soon as that
    token's chunk has been merged across TP ranks: `forward_grad`, a ForwardGradLoss (its
    contract: forward_grad.py).

    Outputs: (anchor, target, lse, sum_logits, entropy, max, log_sum_exp). The statistics are plain values;
    `anchor` is a zero scalar that carries the gradient: callers return `loss_value + anchor`, and
    backward scales the dX and dW computed here by the anchor's upstream gradient g (loss scaling,
    averaging over micro-batches ...). Costs: the chunk merge is done per chunk (2 collectives per
    chunk instead of 2 per call) and dX / dW (fp32 when summed over several chunks, unless QuACK's
    GEMM adds the sum while writing the last chunk's dW in the weight dtype) live from
    forward to backward. Not for fp16 (api.py takes the recompute path there): dX would be stored in
    fp16 under a unit upstream gradient, before the loss scale, and per-token terms like p/N underflow.

    Megatron's main_grad (gradient-accumulation fusion). g is only known in the backward, and
    g·dW must never be formed as a difference (1·dW added in the forward, then (g - 1)·dW: for
    g = 1e-5, Megatron's default loss scaling, that keeps nothing of the gradient in bf16):
    * `expected_grad` given (the caller knows g at forward time: Megatron's loss funcs): the dW GEMMs
      add expected_grad·dW straight into main_grad, no [V_local, H] buffer of the op's own. The
      first backward checks that g is that value (one host sync); if it is not, main_grad cannot be
      repaired exactly, so it is poisoned as for an unpaired forward (UpstreamGradMismatch).
    * otherwise: dW is summed in a private fp32 [V_local, H] buffer and the backward adds g·dW to
      main_grad (one pass, no host sync).
    A forward that added into main_grad has a side effect, so it must pair with exactly one first
    backward: a forward whose graph is freed without any backward poisons main_grad with NaN and
    makes the next fused call raise (MainGradSideEffect); a forward run again during backward
    (torch.utils.checkpoint with use_reentrant=False) never gets here: under saved-tensor hooks
    api.py takes the recompute path. Any further backward through the same graph recomputes
    g·dW from the saved per-token coefficients and adds it.

    Lean mode (spec.lean): the forward runs lean sweep A (statistics and dX, tile by tile) and the
    backward lean sweep B (dW with the exact upstream gradient, into main_grad or the weight
    dtype): 4 GEMMs, no chunk of logits and no [V_local, H] buffer.
    """

    @staticmethod
    def forward(ctx, hidden, weight, row_index, local_target, spec: ChunkSpec, forward_grad: ForwardGradLoss,
                expected_grad: Optional[float] = None):
        full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
        rows = labelled_rows(full_hidden, row_index)
        needs_dx, needs_dw = hidden.requires_grad, weight.requires_grad
        into_main_grad = needs_dw and spec.main_grad_param is not None
        # dW added into main_grad by this forward (times expected_grad), or held until backward
        adds_in_forward = into_main_grad and spec.lean is None and expected_grad is not None
        dx_rows = rows.new_empty(rows.shape) if needs_dx else None
        dw_acc = None
        if needs_dw and spec.lean is None and not adds_in_forward:
            # fp32 for main_grad (added times g in backward); else the weight dtype for one chunk
            dw_dtype = torch.float32 if into_main_grad else _weight_grad_dtype(weight, rows.shape[0], spec)
            dw_acc = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device)
            if rows.shape[0] == 0:
                dw_acc.zero_()
        dw_out = spec.main_grad_param.main_grad if adds_in_forward else dw_acc
        # owned by the node from before the first add: freed without a backward (also when this
        # forward raises half-way), it poisons main_grad instead of leaving it wrong
        ctx.main_grad_side_effect = MainGradSideEffect(spec.main_grad_param) if adds_in_forward else None
        merged_chunks, coef_chunks, dw_last = _forward_chunks(
            rows, weight, row_index, local_target, spec, forward_grad, dx_rows, dw_out, adds_in_forward,
            cast_dw_to=weight_grad_cast_target(dw_acc, weight, accumulate=into_main_grad),
            dw_scale=expected_grad if adds_in_forward else 1.0)
        if dw_last is not None:  # dW in the weight dtype already: the fp32 sum is not needed any more
            dw_acc = dw_last

        def cat(values, wanted=True):
            if not wanted:
                return None
            if not values:  # no labelled row
                return rows.new_zeros(0, dtype=torch.float32)
            return torch.cat(values)

        ctx.spec = spec
        ctx.into_main_grad = into_main_grad
        ctx.full_shape = full_hidden.shape
        # the g the first backward must bring, main_grad already holding g·dW (None: nothing added)
        ctx.expected_grad_in_main_grad = expected_grad if adds_in_forward else None
        ctx.needs_dw = needs_dw
        # The gradients made here are handed to autograd by the first backward without a copy
        # (which would be one more [tokens, H] and [V_local, H] buffer), scaled in place by g (no
        # pass when g == 1). They are kept outside save_for_backward, whose version
        # check would reject that; a second backward (retain_graph) recomputes them from the saved
        # per-token coefficients.
        ctx.dx_buffer, ctx.dw_buffer = dx_rows, dw_acc
        ctx.save_for_backward(
            row_index, weight, hidden, local_target, cat([m.max for m in merged_chunks]),
            cat([m.log_sum_exp for m in merged_chunks]),
            *(cat([c[k] for c in coef_chunks], bool(coef_chunks) and coef_chunks[0][k] is not None)
              for k in ("p", "pz", "target", "uniform")))
        outputs = (cat([m.target for m in merged_chunks]), cat([m.lse for m in merged_chunks]),
                   cat([m.sum_logits for m in merged_chunks], spec.want_sum_logits),
                   cat([m.entropy for m in merged_chunks], spec.want_entropy),
                   cat([m.max for m in merged_chunks]), cat([m.log_sum_exp for m in merged_chunks]))
        for out in outputs:
            if out is not None:
                ctx.mark_non_differentiable(out)
        anchor = torch.zeros((), dtype=torch.float32, device=hidden.device)
        return (anchor,) + outputs

    @staticmethod
    @first_order_only
    def backward(ctx, g_anchor, *unused_stat_grads):
        row_index, weight, hidden, local_target, row_max, log_sum_exp, *coef_list = ctx.saved_tensors
        spec: ChunkSpec = ctx.spec
        offsets = (row_max, log_sum_exp)
        dx, dw = ctx.dx_buffer, ctx.dw_buffer
        ctx.dx_buffer = ctx.dw_buffer = None
        if ctx.main_grad_side_effect is not None:
            ctx.main_grad_side_effect.backward_ran = True
        expected = ctx.expected_grad_in_main_grad  # main_grad holds expected·dW of this forward
        ctx.expected_grad_in_main_grad = None
        # dX and a dW made in the weight dtype are scaled by backend.scale_, which reads g on the GPU
        # (no pass when g == 1), and an fp32 dW summed over chunks is cast or added into main_grad
        # with g applied in one pass: a host sync would leave the GPU idle while the host queues
        # what follows. Only the check of g against expected_grad reads g on the host.
        grad_hidden = grad_weight = None
        if dx is not None:
            grad_hidden = _input_grad(spec.backend.scale_(dx, g_anchor), row_index, ctx.full_shape, spec)
        elif ctx.needs_input_grad[0]:  # a second backward through the same graph: recompute dX
            coefs = _scaled_coefs(coef_list, g_anchor)
            with autocast_off(hidden.device):
                rows = labelled_rows(reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel
                             else hidden, row_index)
                dx = rows.new_empty(rows.shape)
                if rows.shape[0] == 0:
                    dx.zero_()
                elif spec.lean is not None:
                    lean.input_grad_sweep(rows, weight, local_target, spec, offsets, coefs, dx)
                else:
                    backward_grads(rows, weight, local_target, spec, offsets, coefs, dx, None, dw_accumulate=False)
                grad_hidden = _input_grad(dx, row_index, ctx.full_shape, spec)
        if dw is not None and ctx.into_main_grad:  # fp32 dW of the forward: main_grad += g·dW
            spec.main_grad_param.main_grad.addcmul_(dw, g_anchor.to(torch.float32))
            grad_weight = _main_grad_added(spec.main_grad_param, weight)
        elif dw is not None:  # fast mode, no main_grad: made in the forward
            if dw.dtype == weight.dtype:
                grad_weight = spec.backend.scale_(dw, g_anchor)
            else:  # summed over chunks in fp32: scale and cast in one pass
                grad_weight = spec.backend.scale_cast(dw, g_anchor, weight.dtype)
        elif expected is not None:
            check_upstream_grad(spec.main_grad_param, float(g_anchor), expected)
            grad_weight = _main_grad_added(spec.main_grad_param, weight)
        elif ctx.needs_dw:  # lean mode, or a second backward: g·dW from the coefficients
            grad_weight = _weight_grad_from_coefs(
                spec, ctx.into_main_grad, hidden, weight, row_index, local_target, offsets, coef_list, g_anchor)
        return grad_hidden, grad_weight, None, None, None, None, None


def _forward_chunks(rows, weight, row_index, local_target, spec: ChunkSpec, forward_grad: ForwardGradLoss, dx_rows,
                    dw_out, into_main_grad: bool, cast_dw_to: Optional[torch.dtype] = None, dw_scale: float = 1.0):
    """LinearLossGradInForward's chunk loop -> (merged statistics, coefficients per chunk, dW): per
    chunk, the statistics merged over TP ranks, the per-token coefficients, then dX (and in fast
    mode dW, times `dw_scale`) into `dx_rows` / `dw_out` (`into_main_grad`: dw_out is main_grad, added
    to from the first chunk on). With `cast_dw_to` (dw_out is an fp32 sum over chunks), the
    last chunk may add the sum and write dW in that dtype in one GEMM (last_weight_grad): that dW
    is returned, else None. Lean mode runs sweep A per chunk instead of a chunk of logits."""
    lean_blocks = None if spec.lean is None else lean.weight_blocks(weight, spec.num_valid_cols, spec.lean.cols_a)
    chunk_size = spec.lean.rows_a if spec.lean is not None else spec.chunk_size
    column_sum = None
    merged_chunks, coef_chunks = [], []
    dw_last = None
    one_hot_scale = _one_pass_scale(spec, forward_grad, rows, weight, min(chunk_size, rows.shape[0]))
    for index, (start, end) in enumerate(row_chunks(rows.shape[0], chunk_size)):
        h = rows[start:end]
        if spec.lean is not None:
            stats, acc = lean.expected_rows(h, lean_blocks, local_target[start:end], spec,
                                            want_acc=dx_rows is not None)
            merged = reductions.merge_shard_stats(stats, spec.tp_group)
        else:
            logits, stats = chunk_forward(h, weight, local_target[start:end], spec,
                                          want_stats=one_hot_scale is None)
            if one_hot_scale is None:
                merged = reductions.merge_shard_stats(stats, spec.tp_group)
            else:  # the logits become softmax - one_hot in the same pass that takes lse
                loss, lse = spec.backend.row_kernel.ce_dlogits_(logits, local_target[start:end])
                target = lse - loss
                # offsets M = z_y, log S = loss: M + log S = lse, and log p_y = -loss exactly
                merged = reductions.MergedStats(lse=lse, target=target, max=target, log_sum_exp=loss)
        merged_chunks.append(merged)
        positions = (row_index[start:end] if row_index is not None
                     else torch.arange(start, end, device=rows.device))
        grads = forward_grad.token_grads(merged, positions, rows.shape[0])
        coefs = coefficients(grads.target, grads.lse, grads.sum_logits, grads.entropy, merged.entropy, merged.lse)
        if coefs is None:
            coefs = coefficients(None, torch.zeros_like(merged.lse), None, None, None, merged.lse)
        coef_chunks.append(coefs)
        if spec.lean is not None:
            if dx_rows is not None:
                if coefs["uniform"] is not None and column_sum is None:
                    column_sum = weight[:spec.num_valid_cols].sum(0, dtype=torch.float32)
                lean.input_grad_from_expected(acc, stats.max, merged.lse, coefs, weight,
                                              local_target[start:end], spec, column_sum, dx_rows[start:end])
            del acc
        else:
            if one_hot_scale is None:
                chunk_dlogits_(logits, local_target[start:end], spec, (merged.max, merged.log_sum_exp), coefs)
            dlogits = gemm_input(logits, h)
            dx_chunk = None if dx_rows is None else dx_rows[start:end]
            gemm_kwargs = dict(dw_accumulate=into_main_grad or index > 0, dw_scale=dw_scale,
                               cast_dw_to=last_of_several(cast_dw_to, index, end, rows.shape[0]))
            if one_hot_scale is PER_ROW:  # c_i = the coefficient of softmax: dlogits = c_i (softmax - one_hot)
                dw_last = row_scaled_grad_gemms(dlogits, h, weight, spec, dx_chunk, dw_out, coefs["p"], **gemm_kwargs)
            else:
                dw_last = grad_gemms(dlogits, h, weight, spec, dx_chunk, dw_out, scale=one_hot_scale or 1.0,
                                     **gemm_kwargs)
            del logits, dlogits  # one chunk alive at the peak
    return merged_chunks, coef_chunks, dw_last


def _one_pass_scale(spec: ChunkSpec, forward_grad: ForwardGradLoss, rows: Tensor, weight: Tensor, chunk_rows: int):
    """c where every chunk's dlogits may come from the backend's row kernel as c (softmax - one_hot), in one
    pass over the logits: a float (the same c for every token, the GEMMs' alpha), PER_ROW (c_i read
    from each chunk's coefficients), or None where the statistics and dlogits are taken apart. It
    needs a shard with the whole vocab (TP = 1: nothing to merge between the two), a loss whose
    per-token gradient is c (softmax - one_hot) (`forward_grad.one_hot_scale`:
    cross-entropy without smoothing or z-loss, GRPO), whole-shard GEMMs in the input dtype, and the
    row kernel's own conditions (its `supported`)."""
    row_kernel = spec.backend.row_kernel
    if (row_kernel is None or reductions.group_size(spec.tp_group) != 1
            or spec.lean is not None or spec.want_entropy or spec.want_sum_logits
            or spec.logits_dtype is not None):
        return None
    if not row_kernel.supported(rows.dtype, chunk_rows, weight.shape[0], spec.num_valid_cols,
                                spec.inv_temperature, rows.device):
        return None
    return forward_grad.one_hot_scale(rows.shape[0])


def _scaled_coefs(coef_list, scale: Tensor) -> dict:
    return {k: None if c is None else c * scale for k, c in zip(("p", "pz", "target", "uniform"), coef_list)}


def _weight_grad_from_coefs(spec: ChunkSpec, into_main_grad: bool, hidden, weight, row_index, local_target,
                            offsets, coef_list, scale: Tensor):
    """scale x dW from the saved per-token coefficients (LinearLossGradInForward.backward): added
    into main_grad, or returned in the weight dtype (fp32-accumulated over chunks)."""
    main_grad = spec.main_grad_param.main_grad if into_main_grad else None
    full_hidden = reductions.gather_sequence(hidden, spec.tp_group) if spec.sequence_parallel else hidden
    rows = labelled_rows(full_hidden, row_index)
    coefs = _scaled_coefs(coef_list, scale)
    with autocast_off(hidden.device):
        if main_grad is not None:
            dw_out = main_grad
        elif spec.lean is not None:
            dw_out = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        else:
            dw_out = torch.empty(weight.shape, dtype=_weight_grad_dtype(weight, rows.shape[0], spec),
                                 device=weight.device)
        if spec.lean is not None:
            lean.weight_grad_sweep(rows, weight, local_target, spec, offsets, coefs, dw_out,
                                   accumulate=main_grad is not None)
        elif rows.shape[0] > 0:
            dw_done = backward_grads(rows, weight, local_target, spec, offsets, coefs, None, dw_out,
                                     dw_accumulate=main_grad is not None,
                                     cast_dw_to=weight_grad_cast_target(dw_out, weight, main_grad is not None))
            if dw_done is not None:
                return dw_done
        elif main_grad is None:
            dw_out.zero_()
    if main_grad is not None:
        return _main_grad_added(spec.main_grad_param, weight)
    return dw_out if dw_out.dtype == weight.dtype else dw_out.to(weight.dtype)
