"""Fast mode, the default tiling of the chunk loop: chunks of rows, each one GEMM over the whole
vocab shard (docs/design.md §10.1), the chunk of logits (the only [chunk, V_local] tensor) reduced by
the backend, then overwritten with its dlogits for the dX and dW GEMMs.

`FastChunks` is what chunked.py's loops call through `spec.tiling` (lean.py's `LeanTiles` has the
same methods, on tiles):

  merged_statistics(rows, ...)       forward statistics of the rows, merged over TP ranks (here: this
                                     shard's partials from `shard_partials`, merged once after the loop)
  statistics_type                    what merged_statistics returns (reductions.MergedStats; the
                                     sampler's tiling: sampling.KeptStats, which adds the kept set)
  statistics(rows, ...)              the tiling's own walk for those partials (ShardStats)
  recompute_grads(rows, ...)         the recompute backward: dX rows and / or dW from the offsets
                                     and coefficients
  weight_grad_dtype(weight, n, spec) the dtype of a dW buffer returned to autograd
  forward_plan / forward_rows / forward_statistics / forward_grads
                                     one step of the gradients-in-forward loop: its statistics,
                                     then (the coefficients known) its dX and dW
  weight_grad_in_forward             whether forward_grads makes dW (fast: yes; lean: in backward)

The sampler's tiling (sampling.SamplerChunks: fast chunks with the kept-set math per chunk) walks
the rows with the same two loops, `map_chunk_logits` (forward) and `backward_grads` (backward,
with its own per-chunk dlogits); replay's (replay.ReplayChunks) takes its rows without a kept set
through them, and its dense route through `chunk_logits` and `grad_gemms`.

The chunk's GEMMs come from gemm.py and the backend's capabilities: dlogits from the logits GEMM's
epilogue where the backend has it, a one-pass row kernel where a loss's gradient is
c (softmax - one_hot) (`forward_plan`), the statistics and dlogits of a whole-vocab chunk in one
launch where c is known before the statistics (`StatsWithDlogits`), the backend's dW GEMM, and the
last chunk's dW added to the fp32 sum of the others and written in the weight dtype by one GEMM.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor

from . import reductions
from .backends import ShardStats, chunk_rows
from .forward_grad import PER_ROW, ForwardGradLoss
from .gemm import dlogits_gemm, gemm_input, logits_gemm, matmul_add_cast, matmul_fp32, matmul_into_


def row_chunks(num_rows: int, chunk_size: int):
    """(start, end) of each chunk of `chunk_size` rows (the last one may be shorter)."""
    for start in range(0, num_rows, chunk_size):
        yield start, min(start + chunk_size, num_rows)


def last_chunk_start(num_rows: int, chunk_size: int) -> int:
    """The first row of row_chunks' last chunk (0 for one chunk)."""
    return (num_rows - 1) // chunk_size * chunk_size if num_rows > 0 else 0


def _weight_grad_dtype(weight: Tensor, num_rows: int, spec) -> torch.dtype:
    """dW summed over chunks is kept in fp32 (low-precision accumulation drifts: axolotl #1601,
    Liger #827); one GEMM over all rows writes the weight's dtype (cuBLAS accumulates in fp32)."""
    return weight.dtype if num_rows <= spec.chunk_size else torch.float32



def chunk_logits(h: Tensor, weight: Tensor, spec) -> Tensor:
    """A chunk's logits h @ W.T in the input dtype, or in `spec.logits_dtype` (fp32): the call's
    first product where it was launched ahead (EarlyProduct)."""
    if spec.first_product is not None:
        logits = spec.first_product.take(h, EarlyProduct.LOGITS)
        if logits is not None:
            return logits
    return logits_gemm(h, weight, spec.logits_dtype)


class EarlyProduct:
    """The call's first GEMM, launched before the host's bookkeeping (the label kernel, the rank
    check, autograd's node, the gradient buffers): at the row counts RL runs an eager call spends
    about as long on the host as its first GEMM on the GPU, and what came before that GEMM's launch
    was exposed whole; now it runs while the GPU multiplies. It needs no targets: the fused
    statistics GEMM reads the labels themselves (triton_gemm_stats), a chunk of logits none.

    `launch` makes the product the chunk loop's first step would make (the statistics of every row
    where the backend fuses them into the GEMM, else the logits of the first chunk); that step
    `take`s it instead of launching its own, and token_statistics `drop`s what was not taken once
    the forward is done (nothing of it is held for the backward)."""

    LOGITS, STATISTICS = "logits", "statistics"

    def __init__(self):
        self.address = self.num_rows = self.kind = self.value = self.logits_dtype = None

    def launch(self, rows: Tensor, weight: Tensor, labels: Tensor, spec, *, statistics: bool, label_offset: int,
               ignore_index: int, ahead: Optional["EarlyProduct"] = None) -> None:
        """`statistics`: the chunk loop's first step takes this shard's statistics of `rows` (the
        recompute path and forward-only calls), else a chunk of logits (gradients in the forward).
        `ahead`: the product `launch_remembered` launched for this call, taken over where it is
        what this launch makes, else dropped."""
        backend = spec.backend
        if ahead is not None:
            ahead_value, ahead.value = ahead.value, None
        if statistics and fused_statistics(backend, rows, weight):
            ahead_value = None  # (freed before the fused GEMM's outputs are allocated)
            self.kind, self.value = self.STATISTICS, labelled_gemm_statistics(rows, weight, labels, spec, label_offset,
                                                                              ignore_index)
        else:
            rows = chunk_rows(rows, 0, min(spec.chunk_size, rows.shape[0]))
            self.kind, self.logits_dtype = self.LOGITS, spec.logits_dtype
            if (ahead is not None and ahead_value is not None and ahead.address == rows.data_ptr()
                    and ahead.num_rows == rows.shape[0] and ahead.logits_dtype == spec.logits_dtype):
                self.value = ahead_value
            else:
                ahead_value = None
                self.value = logits_gemm(rows, weight, spec.logits_dtype)
        self.address, self.num_rows = rows.data_ptr(), rows.shape[0]

    # key -> (rows, logits dtype) of the chunk of logits the last call of that key launched first
    # (None: it launched none, or its statistics); a few hundred entries at most
    _REMEMBERED: OrderedDict = OrderedDict()
    MAX_REMEMBERED = 256

    @classmethod
    def launch_remembered(cls, key, hidden: Tensor, weight: Tensor) -> Optional["EarlyProduct"]:
        """The chunk of logits the last call of `key` (its inputs' shapes, dtypes, devices and the
        options that choose the first product) launched first, launched now, before this call's
        argument handling, bookkeeping and checks: at RL shapes those take about as long on the
        host as a GEMM on the GPU, and a call that finds the GPU idle waited for them. Only ever
        the product itself (no collective, nothing written but its output); `launch` takes it
        over where it is what the call makes, else drops it, and a call that raises drops it
        with its frame. None where the key made no chunk of logits first, or is new."""
        plan = cls._REMEMBERED.get(key)
        if plan is None:
            return None
        num_rows, logits_dtype = plan
        ahead = cls()
        rows = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])  # (token_statistics' rows)
        rows = chunk_rows(rows, 0, min(num_rows, rows.shape[0]))
        with torch.no_grad():  # (the caller checked that autocast is off)
            ahead.value = logits_gemm(rows, weight, logits_dtype)
        ahead.kind, ahead.logits_dtype = cls.LOGITS, logits_dtype
        ahead.address, ahead.num_rows = rows.data_ptr(), rows.shape[0]
        return ahead

    @classmethod
    def remember(cls, key, product: Optional["EarlyProduct"]) -> None:
        """What `key`'s call launched first (`product`: None or its statistics: nothing to launch ahead)."""
        plan = (product.num_rows, product.logits_dtype) if product is not None and product.kind == cls.LOGITS else None
        if cls._REMEMBERED.get(key, 0) != plan:
            cls._REMEMBERED[key] = plan
            if len(cls._REMEMBERED) > cls.MAX_REMEMBERED:
                cls._REMEMBERED.popitem(last=False)

    def take(self, rows: Tensor, kind: str):
        """The product if it is the `kind` of these rows (the same first row and count), once; else None."""
        value = self.value
        if value is None or kind != self.kind or rows.shape[0] != self.num_rows or rows.data_ptr() != self.address:
            return None
        self.value = None
        return value

    def drop(self) -> None:
        self.value = None



def logits_partials(logits: Tensor, local_target: Tensor, spec) -> ShardStats:
    """A chunk of logits reduced by the backend to this shard's partials (before the TP merge)."""
    return spec.backend.shard_stats(logits, local_target, spec.num_valid_cols, spec.inv_temperature,
                                    want_sum_logits=spec.want_sum_logits, want_entropy=spec.want_entropy)


_ZEROS: dict = {}  # device -> the fp32 0-d zero device_zero aliases (never written)


def device_zero(device: torch.device) -> Tensor:
    """A new 0-d fp32 zero tensor (a node of its own where autograd takes it) without a fill kernel
    per call: a detached alias of one zero per device. That zero is copied from the host (a
    synchronous copy) by the first call on the device, one that runs the full argument agreement
    and its read-back anyway: no later call, CUDA graph capture or other stream sees it before it
    holds 0."""
    if torch.compiler.is_compiling():  # (traced: a constant of the graph would be no cheaper)
        return torch.zeros((), dtype=torch.float32, device=device)
    zero = _ZEROS.get(device)
    if zero is None:
        zero = _ZEROS[device] = torch.tensor(0.0, dtype=torch.float32, device=device)
    return zero.detach()


def merged_chunk_statistics(logits: Tensor, local_target: Tensor, spec, labelled: Optional[Tensor] = None,
                            call_poison: Optional[Callable[[], Tensor]] = None):
    """A chunk's statistics merged over TP ranks. At TP = 1 without the sum of logits or the entropy
    (nothing to merge) the stats launch finishes each row itself: log S and lse as the merge's tail
    makes them (backend.shard_logprob), one launch fewer. -> (statistics, log-probs): with
    `call_poison`, the `labelled` rows' log-probs plus the call's poison (fp32 [1]) — the stats
    launch's own at TP = 1, else the merge's (reductions.merged_logprobs: the poison taken after the
    merge decides the rank check it holds); without it, None at TP > 1."""
    logprob = None
    if reductions.group_size(spec.tp_group) == 1 and not (spec.want_sum_logits or spec.want_entropy):
        logprob, row_max, log_sum_exp, target, lse = spec.backend.shard_logprob(
            logits, local_target, spec.num_valid_cols, spec.inv_temperature,
            device_zero(logits.device) if call_poison is None else call_poison())
        merged = reductions.MergedStats(lse=lse, target=target, max=row_max, log_sum_exp=log_sum_exp)
    elif call_poison is not None:
        merged, logprob = reductions.merged_logprobs(logits_partials(logits, local_target, spec), spec.tp_group,
                                                     spec.backend, spec.rank_check, labelled, call_poison)
    else:
        merged = reductions.merge_shard_stats(logits_partials(logits, local_target, spec), spec.tp_group,
                                              spec.backend, spec.rank_check)
    return merged, logprob


def chunk_dlogits_(logits: Tensor, local_target: Tensor, spec, offsets: tuple, coefs: dict) -> Tensor:
    """Overwrite a chunk's logits with dlogits, returned as the GEMMs take them."""
    row_max, log_sum_exp = offsets
    spec.backend.shard_dlogits_(logits, local_target, spec.num_valid_cols, spec.inv_temperature, row_max,
                                coefs["p"], coefs["pz"], coefs["target"], coefs["uniform"], log_sum_exp=log_sum_exp)
    return logits



def recomputed_dlogits(h: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                       coefs: dict) -> Tensor:
    """A chunk's dlogits [rows, V_local] in the GEMM input dtype, its softmax offsets known: from the
    logits GEMM's epilogue where the backend has it, else GEMM + dlogits kernel."""
    return dlogits_gemm(h, weight, local_target, spec.num_valid_cols, spec, offsets, coefs)



def grad_gemms(dlogits: Tensor, h: Tensor, weight: Tensor, spec, dx_out: Optional[Tensor],
               dw_out: Optional[Tensor], dw_accumulate: bool, scale: float = 1.0,
               cast_dw_to: Optional[torch.dtype] = None, dw_scale: float = 1.0,
               after_dx: Optional[Callable[[], None]] = None) -> Optional[Tensor]:
    """dX of the chunk's rows into `dx_out`, then dW into `dw_out` (adding to it if
    `dw_accumulate`), from the chunk's dlogits times `scale` (the GEMMs' alpha; dW's times `dw_scale`
    too: the upstream gradient of a dW added into main_grad in the forward). `after_dx` runs between
    the two GEMMs (the forward starts dX's TP reduction there, to overlap the dW GEMM). With
    `cast_dw_to` (the last of several chunks, `dw_out` their fp32 sum), dW may instead be written in
    that dtype with the sum added by one GEMM (last_weight_grad): returned, else None."""
    if dx_out is not None:
        matmul_into_(dx_out, dlogits, weight, accumulate=False, alpha=scale)
    if after_dx is not None:
        after_dx()
    dw_alpha = scale * dw_scale
    dw_last = None if cast_dw_to is None else last_weight_grad(dlogits, h, spec, dw_out, cast_dw_to, dw_alpha)
    if dw_out is not None and dw_last is None:
        matmul_into_(dw_out, dlogits.t(), h, accumulate=dw_accumulate, alpha=dw_alpha,
                     weight_grad_gemm=spec.backend.weight_grad_gemm)
    return dw_last



def row_scaled_grad_gemms(dlogits: Tensor, h: Tensor, weight: Tensor, spec, dx_out: Optional[Tensor],
                          dw_out: Optional[Tensor], row_scale: Tensor, dw_accumulate: bool,
                          cast_dw_to: Optional[torch.dtype] = None, dw_scale: float = 1.0,
                          after_dx: Optional[Callable[[], None]] = None) -> Optional[Tensor]:
    """grad_gemms of diag(row_scale) @ dlogits without a pass over the chunk of dlogits: dX of the
    chunk is the fp32 product dlogits @ W times row_scale, rounded once into `dx_out`; dW =
    dlogits.T @ (row_scale * h), the scaled rows rounded once to the input dtype (as each element
    of scaled dlogits would be)."""
    if dx_out is not None:
        spec.backend.row_scale(dx_out, matmul_fp32(dlogits, weight), row_scale)  # fp32 math, one rounding
    if after_dx is not None:
        after_dx()
    if dw_out is None:
        return None
    scaled_h = spec.backend.row_scale(torch.empty_like(h), h, row_scale)
    return grad_gemms(dlogits, scaled_h, weight, spec, None, dw_out, dw_accumulate, cast_dw_to=cast_dw_to,
                      dw_scale=dw_scale)



class DlogitsMadeInForward:
    """The backward of a log-prob call whose dlogits were made in the forward: the tiling its
    backward's recompute_grads goes through (LinearLogprobDlogitsInForward).

    d log p_y / d logits = one_hot(y) - softmax does not depend on the upstream gradient g, which
    only scales each row: dX = g · (D W), dW = D^T (g · h). So the forward, its statistics known,
    turns its chunk of logits into D in place (the dlogits kernel with unit coefficients) and makes
    D W (fp32), while the host goes on to autograd's backward: at RL row counts the engine and the
    backward's bookkeeping took as long on the host as a GEMM, the GPU idle. The backward is then
    one scale of D W, one of h and the dW GEMM; rounding as row_scaled_grad_gemms' (dX rounded
    once from fp32, g·h once to the input dtype), g taken as 0 in the rows of ignored labels
    (`labelled` False: their D is not zero) by those two scaling launches. Held from forward to
    backward: D ([rows, V_local], the chunk of logits the backward would allocate) and D W ([rows,
    H] fp32, freed once dX is made).

    A call of several chunks holds the last chunk's D this way (rows from `held_from` on, one
    chunk: the bound of the chunk loop) and the softmax offsets of every row (`offsets`: max,
    log_sum_exp); its backward takes the held chunk first, frees D, then makes the other chunks'
    dlogits again as the recompute path does (coefficients -g on the softmax, g on the one-hot),
    so one chunk is alive at the peak and the call makes one logits GEMM fewer than the recompute
    path's. A second backward through a retained graph makes the held chunk's D again as the
    forward made it (then as above): the same gradients, bit for bit."""

    def __init__(self, dlogits: Tensor, product: Optional[Tensor], labelled: Optional[Tensor], held_from: int = 0,
                 offsets: tuple = ()):
        self.dlogits, self.product, self.labelled = dlogits, product, labelled
        self.held_from, self.offsets = held_from, offsets

    @staticmethod
    def make(logits: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
             needs_dx: bool, labelled: Optional[Tensor]) -> "DlogitsMadeInForward":
        """From the chunk of logits (in the input dtype), overwritten; `offsets` its rows' (max,
        log_sum_exp)."""
        return DlogitsMadeInForward.of(log_prob_dlogits_(logits, local_target, spec, offsets), weight, needs_dx,
                                       labelled)

    @staticmethod
    def of(dlogits: Tensor, weight: Tensor, needs_dx: bool, labelled: Optional[Tensor], held_from: int = 0,
           offsets: tuple = ()) -> "DlogitsMadeInForward":
        """From D itself (one_hot - softmax in the input dtype)."""
        return DlogitsMadeInForward(dlogits, matmul_fp32(dlogits, weight) if needs_dx else None, labelled, held_from,
                                    offsets)

    def weight_grad_dtype(self, weight: Tensor, num_rows: int, spec) -> torch.dtype:
        # one chunk: one GEMM writes dW; several: their fp32 sum
        return weight.dtype if self.held_from == 0 else _weight_grad_dtype(weight, num_rows, spec)

    def recompute_grads(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                        coefs: dict, dx_rows: Optional[Tensor], dw_out: Optional[Tensor],
                        accumulate: bool) -> Optional[Tensor]:
        num_rows, held = rows.shape[0], self.held_from
        scale = coefs["target"]  # g of each row (taken as 0 where unlabelled)
        if self.dlogits is None:  # a second backward: the held chunk made again as the forward made it
            self.dlogits = log_prob_dlogits_(chunk_logits(chunk_rows(rows, held, num_rows), weight, spec),
                                              chunk_rows(local_target, held, num_rows), spec,
                                              tuple(chunk_rows(o, held, num_rows) for o in self.offsets))
        # the held chunk first (every backward sums dW in the same order), then the others
        g, keep = chunk_rows(scale, held, num_rows), chunk_rows(self.labelled, held, num_rows)
        if dx_rows is not None:
            # made again by a second backward through a retained graph
            product = self.product if self.product is not None else matmul_fp32(self.dlogits, weight)
            spec.backend.row_scale(chunk_rows(dx_rows, held, num_rows), product, g, keep)  # fp32 math, one rounding
            self.product = product = None  # freed before g·h is made: one of the two [rows, H] alive
        if dw_out is not None:
            h = chunk_rows(rows, held, num_rows)
            scaled_h = spec.backend.row_scale(torch.empty_like(h), h, g, keep)
            grad_gemms(self.dlogits, scaled_h, weight, spec, None, dw_out, dw_accumulate=accumulate)
        if held == 0:  # one chunk: D kept for a second backward
            return None
        self.dlogits = None  # freed before the other chunks' logits are made again
        # the other chunks: log p_y's dlogits g (one_hot - softmax)
        g = torch.where(self.labelled[:held], scale[:held], 0.0)
        rest = {"p": -g, "pz": None, "target": g, "uniform": None}
        return backward_grads(rows[:held], weight, local_target[:held], spec, tuple(o[:held] for o in self.offsets),
                              rest, chunk_rows(dx_rows, 0, held), dw_out, dw_accumulate=True,
                              cast_dw_to=weight_grad_cast_target(dw_out, weight, accumulate), summed_before=True)


def log_prob_dlogits_(logits: Tensor, local_target: Tensor, spec, offsets: tuple) -> Tensor:
    """D = one_hot - softmax in place of a chunk of logits (the dlogits kernel with unit
    coefficients), `offsets` its rows' (max, log_sum_exp)."""
    ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    return chunk_dlogits_(logits, local_target, spec, offsets, {"p": -ones, "pz": None, "target": ones, "uniform": None})


def last_of_several(cast_dw_to: Optional[torch.dtype], index: int, end: int, num_rows: int,
                    summed_before: bool = False) -> Optional[torch.dtype]:
    """grad_gemms' `cast_dw_to` for chunk `index` ending at row `end`: set on the last chunk of
    several only (one chunk writes dW in the weight dtype by itself; `summed_before`: the sum
    holds another chunk's dW already)."""
    return cast_dw_to if (index > 0 or summed_before) and end == num_rows else None



def last_weight_grad(dlogits: Tensor, h: Tensor, spec, dw_sum: Tensor, dtype: torch.dtype,
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
    return {k: chunk_rows(c, start, end) for k, c in coefs.items()}



def backward_grads(
    hidden_rows: Tensor,
    weight: Tensor,
    local_target: Tensor,
    spec,
    offsets: tuple,
    coefs: dict,
    dx_rows: Optional[Tensor],
    dw_out: Optional[Tensor],
    dw_accumulate: bool,
    cast_dw_to: Optional[torch.dtype] = None,
    chunk_dlogits=recomputed_dlogits,
    summed_before: bool = False,
) -> Optional[Tensor]:
    """Chunk loop of the backward pass: writes dX rows, and dW into `dw_out` (adding to what it
    holds if `dw_accumulate`, e.g. Megatron's main_grad; else the first chunk overwrites).
    `offsets`: per-row tensors the dlogits need (the merged softmax's (max, log_sum_exp), see
    MergedStats.grad_offsets), sliced with the chunk. `chunk_dlogits(h, weight, local_target,
    spec, offsets, coefs)` makes a chunk's dlogits (the softmax's by default; the kept set's for
    the sampler). With `cast_dw_to` (dw_out an fp32 sum over chunks), the last chunk may write dW
    in that dtype (last_weight_grad): returned, else None (`summed_before`: dw_out holds a chunk
    made elsewhere, so even a loop of one chunk ends with that GEMM)."""
    dw_last = None
    for index, (start, end) in enumerate(row_chunks(hidden_rows.shape[0], spec.chunk_size)):
        h = chunk_rows(hidden_rows, start, end)
        dlogits = chunk_dlogits(h, weight, chunk_rows(local_target, start, end), spec,
                                tuple(chunk_rows(o, start, end) for o in offsets), _slice_coefs(coefs, start, end))
        dw_last = grad_gemms(dlogits, h, weight, spec, chunk_rows(dx_rows, start, end), dw_out,
                             dw_accumulate=dw_accumulate or index > 0,
                             cast_dw_to=last_of_several(cast_dw_to, index, end, hidden_rows.shape[0], summed_before))
        del dlogits  # free this chunk before the next one's GEMM: one chunk alive at the peak
    return dw_last



def weight_grad_cast_target(dw_out: Optional[Tensor], weight: Tensor, accumulate: bool) -> Optional[torch.dtype]:
    """The dtype the last chunk may write dW in: the weight's, where dw_out is an fp32
    sum over chunks returned to autograd (not Megatron's main_grad, not already that dtype)."""
    if dw_out is None or accumulate or dw_out.dtype == weight.dtype:
        return None
    return weight.dtype



def _one_pass_scale(spec, forward_grad: ForwardGradLoss, rows: Tensor, weight: Tensor, chunk_rows: int, num_labelled):
    """c where every chunk's dlogits may come from the backend's row kernel as c (softmax - one_hot), in one
    pass over the logits: a float (the same c for every token, the GEMMs' alpha), PER_ROW (c_i read
    from each chunk's coefficients), or None where the statistics and dlogits are taken apart. It
    needs a shard with the whole vocab (TP = 1: nothing to merge between the two), a loss whose
    per-token gradient is c (softmax - one_hot) (`forward_grad.one_hot_scale`:
    cross-entropy without smoothing or z-loss, GRPO), whole-shard GEMMs in the input dtype, and the
    row kernel's own conditions (its `supported`)."""
    if not row_kernel_takes(spec, rows, weight, chunk_rows):
        return None
    return forward_grad.one_hot_scale(num_labelled)


def row_kernel_takes(spec, rows: Tensor, weight: Tensor, chunk_rows: int) -> bool:
    """Whether the backend's one-pass row kernel takes chunks of `chunk_rows` rows of this shard,
    whatever the loss (_one_pass_scale's conditions but the loss's own)."""
    row_kernel = spec.backend.row_kernel
    return (row_kernel is not None and reductions.group_size(spec.tp_group) == 1
            and not spec.want_entropy and not spec.want_sum_logits and spec.logits_dtype is None
            and row_kernel.supported(rows.dtype, chunk_rows, weight.shape[0], spec.num_valid_cols,
                                     spec.inv_temperature, rows.device, weight.shape[1]))


class StatsWithDlogits:
    """A FastChunks plan: each chunk's statistics and its dlogits from one launch of the backend's
    `stats_dlogits`, where the host would launch the stats kernel, the merge's tail and the
    dlogits kernel (host time at RL row counts; the GPU's time is about the same). For a loss whose
    dlogits are c (softmax - one_hot) with c known before the statistics
    (`forward_grad.scale_before_statistics`: cross-entropy without smoothing or z-loss), where
    `runs_stats_dlogits`."""

    def __init__(self, scale):
        self.scale = scale

    @classmethod
    def plan(cls, spec, forward_grad: ForwardGradLoss, rows: Tensor, weight: Tensor,
             num_labelled) -> Optional["StatsWithDlogits"]:
        if spec.want_entropy or spec.want_sum_logits or not runs_stats_dlogits(spec, rows, weight):
            return None
        scale = forward_grad.scale_before_statistics(num_labelled)
        return None if scale is None else cls(scale)

    def run_(self, logits: Tensor, local_target: Tensor, spec, labelled: Optional[Tensor]) -> reductions.MergedStats:
        row_max, target, log_sum_exp, lse, _ = spec.backend.stats_dlogits.run_(
            logits, local_target, spec.num_valid_cols, spec.inv_temperature, labelled, scale=self.scale)
        return reductions.MergedStats(lse=lse, target=target, max=row_max, log_sum_exp=log_sum_exp)


class TermsInLaunch:
    """A FastChunks plan: a call's one chunk of every row takes its statistics, the loss's per-token
    terms (d loss / d lp, the metrics' partial sums) and its dlogits from one launch of the loss's own
    (`forward_grad.stats_and_terms_`: GRPO's, triton_grpo.terms_in_launch_), where the host would
    launch the statistics, the per-token kernel and the dlogits kernel (GRPO at TP = 1 where the host
    sets a call's time: triton_grpo.terms_in_launch_applies). `poison`: the call's (the label
    checks'), added to the loss's metrics in the launch."""

    def __init__(self, forward_grad: ForwardGradLoss, poison: Optional[Tensor]):
        self.forward_grad, self.poison = forward_grad, poison
        self.ran = True  # False where the launch did not compile: the launches apart took the chunk

    @staticmethod
    def applies(spec, forward_grad: ForwardGradLoss, rows: Tensor, weight: Tensor) -> bool:
        """One chunk of every row of a whole-vocab shard (TP = 1), no entropy or sum of logits, where
        the loss takes it (its terms_in_launch_applies)."""
        return (not (spec.want_entropy or spec.want_sum_logits) and reductions.group_size(spec.tp_group) == 1
                and 0 < rows.shape[0] <= spec.chunk_size and spec.logits_dtype is None
                and forward_grad.terms_in_launch_applies(spec, rows, weight))

    @classmethod
    def plan(cls, spec, forward_grad: ForwardGradLoss, rows: Tensor, weight: Tensor,
             num_labelled) -> Optional["TermsInLaunch"]:
        if not cls.applies(spec, forward_grad, rows, weight):
            return None
        scalars = getattr(num_labelled, "scalars", None)  # (api.LabelledCount: the label checks' poison first)
        return cls(forward_grad, None if scalars is None else scalars[:1])

    def run_(self, logits: Tensor, local_target: Tensor, spec, labelled: Optional[Tensor]) -> reductions.MergedStats:
        made = self.forward_grad.stats_and_terms_(logits, spec, local_target=local_target, labelled=labelled,
                                                  poison=self.poison)
        if made is None:  # (not compiled: the statistics, then the loss's terms and the dlogits apart)
            self.ran = False
            return merged_chunk_statistics(logits, local_target, spec)[0]
        row_max, target, log_sum_exp, lse = made[:4]
        return reductions.MergedStats(lse=lse, target=target, max=row_max, log_sum_exp=log_sum_exp)


def runs_stats_dlogits(spec, rows: Tensor, weight: Tensor) -> bool:
    """Whether the backend's `stats_dlogits` takes every chunk of `rows` (the last one too): a shard
    with the whole vocab (TP = 1: nothing to merge between the statistics and the dlogits), and
    chunks where the kernel applies (its rows are the stats kernel's, one program each: the
    statistics and dlogits are those of the two kernels, bit for bit)."""
    num_rows, chunk = rows.shape[0], spec.chunk_size
    if spec.backend.stats_dlogits is None or reductions.group_size(spec.tp_group) != 1 or num_rows == 0:
        return False
    applies = spec.backend.stats_dlogits.applies
    row_bytes = weight.shape[0] * (4 if spec.logits_dtype is not None else weight.element_size())
    last = num_rows - (num_rows - 1) // chunk * chunk
    return (applies(min(chunk, num_rows), spec.num_valid_cols, row_bytes, rows.device)
            and applies(last, spec.num_valid_cols, row_bytes, rows.device))


# Statistics of rows whose logits are at most this large come from cuBLAS's logits GEMM and the
# backend's stats kernel (one chunk of logits held), above it from the fused statistics GEMM (no
# logits in memory). Forward-only log-probs from an idle GPU, one H200, fused -> cuBLAS: 2048x4096x
# 19008 1.48-1.59 -> 1.31-1.50x the GEMM floor, 4096x4096x19008 1.31-1.35 -> 1.24-1.27x, 4096x4096x
# 32064 1.26 -> 1.19x, 2048x2048x64128 1.46 -> 1.32x: at these sizes the fused GEMM ran ~10 % slower
# than cuBLAS's (451 against 409 us at 2048x4096x19008) and its launch (descriptors, partials, the
# merge kernel) cost the host more. cuBLAS stayed ahead on larger shapes too (8192x4096x128256: 1.12
# -> 1.06x) but with the whole logits in memory (2 GiB there), and in chunks of 128 MiB it was not
# (1.16x): above this bound the fused GEMM keeps forward-only passes free of logits.
FUSED_STATS_MIN_BYTES = 256 * 1024 * 1024


def fused_statistics(backend, rows: Tensor, weight: Tensor) -> bool:
    """Whether this shard's statistics of `rows` come from the backend's fused statistics GEMM."""
    return (rows.shape[0] * weight.shape[0] * weight.element_size() > FUSED_STATS_MIN_BYTES
            and backend.stats_in_gemm(rows, weight))


def map_chunk_logits(hidden_rows: Tensor, weight: Tensor, spec, visit) -> list:
    """Chunk loop of the forward pass: `visit(start, end, logits)` for each chunk of rows, its
    results in order. One chunk of logits alive at a time."""
    results = []
    for start, end in row_chunks(hidden_rows.shape[0], spec.chunk_size):
        logits = chunk_logits(chunk_rows(hidden_rows, start, end), weight, spec)
        results.append(visit(start, end, logits))
        del logits
    return results


def concat_partials(partials: list, hidden_rows: Tensor, spec) -> ShardStats:
    """The ShardStats of consecutive chunks as one (a rank without labelled rows still takes part
    in the collectives, with empty partials)."""
    if not partials:
        return ShardStats.empty(0, hidden_rows.device, spec.want_sum_logits, spec.want_entropy)
    if len(partials) == 1:  # (a concatenation of one would copy every field)
        return partials[0]
    return ShardStats(**{
        name: None if getattr(partials[0], name) is None else torch.cat([getattr(p, name) for p in partials])
        for name in ShardStats.__dataclass_fields__
    })


def labelled_gemm_statistics(rows: Tensor, weight: Tensor, labels: Tensor, spec, label_offset: int,
                             ignore_index: int) -> ShardStats:
    """This shard's statistics of `rows` from the fused statistics GEMM, reading the labels
    themselves (the shard's first id `label_offset`, `ignore_index`): the product a call launches
    before its label kernel has made the targets (EarlyProduct, the forward-only route)."""
    return spec.backend.gemm_stats.run(
        rows, weight, labels, spec.num_valid_cols, spec.inv_temperature, want_sum_logits=spec.want_sum_logits,
        want_entropy=spec.want_entropy, round_logits=spec.logits_dtype is None, label_offset=label_offset,
        ignore_index=ignore_index)


def shard_partials(hidden_rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ShardStats:
    """This shard's statistics of the rows before the TP merge: from the logits GEMM's epilogue
    where the backend has it (no logits in memory at all), else from the tiling's walk."""
    backend = spec.backend
    if fused_statistics(backend, hidden_rows, weight):
        if spec.first_product is not None:
            stats = spec.first_product.take(hidden_rows, EarlyProduct.STATISTICS)
            if stats is not None:
                return stats
        return backend.gemm_stats.run(
            hidden_rows, weight, local_target, spec.num_valid_cols, spec.inv_temperature,
            want_sum_logits=spec.want_sum_logits, want_entropy=spec.want_entropy,
            round_logits=spec.logits_dtype is None)
    return spec.tiling.statistics(hidden_rows, weight, local_target, spec)


class MergedAfterLoop:
    """The statistics of fast chunks and lean tiles: this shard's partials over all rows, merged
    over TP ranks once after the loop (one all-gather per call, reductions.py)."""

    statistics_type = reductions.MergedStats

    def merged_statistics(self, hidden_rows: Tensor, weight: Tensor, local_target: Tensor, spec):
        return reductions.merge_shard_stats(shard_partials(hidden_rows, weight, local_target, spec), spec.tp_group,
                                            spec.backend, spec.rank_check)


class FastChunks(MergedAfterLoop):
    """Chunks of `spec.chunk_size` rows, each one GEMM over the whole vocab shard (module doc)."""

    weight_grad_in_forward = True

    def forward_rows(self, spec) -> int:
        return spec.chunk_size

    def weight_grad_dtype(self, weight: Tensor, num_rows: int, spec) -> torch.dtype:
        return _weight_grad_dtype(weight, num_rows, spec)

    def statistics(self, hidden_rows: Tensor, weight: Tensor, local_target: Tensor, spec) -> ShardStats:
        """This shard's ShardStats over the rows, chunk by chunk."""
        return concat_partials(map_chunk_logits(hidden_rows, weight, spec, lambda start, end, logits: logits_partials(
            logits, chunk_rows(local_target, start, end), spec)), hidden_rows, spec)

    def recompute_grads(self, rows: Tensor, weight: Tensor, local_target: Tensor, spec, offsets: tuple,
                        coefs: dict, dx_rows: Optional[Tensor], dw_out: Optional[Tensor],
                        accumulate: bool) -> Optional[Tensor]:
        return backward_grads(rows, weight, local_target, spec, offsets, coefs, dx_rows, dw_out,
                              dw_accumulate=accumulate, cast_dw_to=weight_grad_cast_target(dw_out, weight, accumulate))

    def forward_plan(self, rows: Tensor, weight: Tensor, spec, forward_grad: ForwardGradLoss, needs_dx: bool,
                     num_labelled):
        """How this call's chunks make their statistics and dlogits: the row kernel's one-pass
        scale (a float, or PER_ROW), a StatsWithDlogits, or None (the stats and dlogits kernels)."""
        scale = _one_pass_scale(spec, forward_grad, rows, weight, min(spec.chunk_size, rows.shape[0]), num_labelled)
        if scale is None:
            return (StatsWithDlogits.plan(spec, forward_grad, rows, weight, num_labelled)
                    or TermsInLaunch.plan(spec, forward_grad, rows, weight, num_labelled))
        return scale

    def forward_statistics(self, plan, h: Tensor, weight: Tensor, local_target: Tensor, spec,
                           labelled: Optional[Tensor] = None):
        """-> (the chunk's statistics merged over TP ranks, its logits: its dlogits already where the
        `plan` made them). `labelled`: the chunk's rows whose labels are not ignored (None: all)."""
        logits = chunk_logits(h, weight, spec)
        return self.logits_statistics_(plan, logits, local_target, spec, labelled), logits

    def logits_statistics_(self, plan, logits: Tensor, local_target: Tensor, spec,
                           labelled: Optional[Tensor] = None) -> reductions.MergedStats:
        """A chunk's statistics from its logits as the `plan` makes them (forward_statistics' step
        after the GEMM): its dlogits made in place of the logits where the plan makes them."""
        if plan is None:
            return merged_chunk_statistics(logits, local_target, spec)[0]
        if isinstance(plan, (StatsWithDlogits, TermsInLaunch)):
            return plan.run_(logits, local_target, spec, labelled)
        # the logits become softmax - one_hot in the same pass that takes lse; offsets M = z_y,
        # log S = loss: M + log S = lse, and log p_y = -loss exactly
        loss, lse = spec.backend.row_kernel.ce_dlogits_(logits, local_target)
        target = lse - loss
        return reductions.MergedStats(lse=lse, target=target, max=target, log_sum_exp=loss)

    def forward_grads(self, plan, logits: Tensor, h: Tensor, weight: Tensor, local_target: Tensor, spec,
                      merged, coefs: dict, dx_chunk: Optional[Tensor], dw_out: Optional[Tensor], *,
                      dw_accumulate: bool, dw_scale: float, cast_dw_to: Optional[torch.dtype],
                      after_dx: Optional[Callable[[], None]] = None) -> Optional[Tensor]:
        """The chunk's dlogits (in place of its logits, unless the `plan` made them), then dX and dW
        (see grad_gemms)."""
        if isinstance(plan, TermsInLaunch) and not plan.ran:  # (the launches apart took the chunk)
            plan = None
        if plan is None:
            chunk_dlogits_(logits, local_target, spec, (merged.max, merged.log_sum_exp), coefs)
        dlogits = gemm_input(logits, h)
        kwargs = dict(dw_accumulate=dw_accumulate, dw_scale=dw_scale, cast_dw_to=cast_dw_to, after_dx=after_dx)
        if isinstance(plan, (StatsWithDlogits, TermsInLaunch)):  # the coefficients are in the dlogits
            return grad_gemms(dlogits, h, weight, spec, dx_chunk, dw_out, **kwargs)
        if plan is PER_ROW:  # c_i = the coefficient of softmax: dlogits = c_i (softmax - one_hot)
            return row_scaled_grad_gemms(dlogits, h, weight, spec, dx_chunk, dw_out, coefs["p"], **kwargs)
        return grad_gemms(dlogits, h, weight, spec, dx_chunk, dw_out, scale=plan or 1.0, **kwargs)


FAST_CHUNKS = FastChunks()
