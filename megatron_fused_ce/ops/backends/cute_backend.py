"""QuACK's CuTe DSL kernels (`pip install megatron_fused_ce[cute]`): a one-pass cross-entropy row
kernel in place of the Triton statistics + dlogits kernels, and its persistent warp-specialized
Hopper GEMM in place of cuBLAS for the weight-gradient GEMMs.

On Hopper, QuACK (quack-kernels, built on nvidia-cutlass-dsl) holds each row of logits on chip
across a cluster of thread blocks, so one read of a chunk gives the row's log-sum-exp and one write
its dlogits = softmax - one_hot(label) in place. The Triton backend reads the chunk twice (the
statistics, then dlogits once they are merged over tensor-parallel ranks): one pass is faster on
every chunk of the benchmark shapes (docs/design.md §10.6).

It applies where nothing has to be merged between the two (the shard holds the whole vocab: TP = 1)
and each row's gradient is c_i (softmax - one_hot), at temperature 1 with no vocab padding:
cross-entropy with "mean" / "sum" reduction, no label smoothing and no z-loss ("sum": one c for
every row, applied by the dX / dW GEMMs as their alpha; "mean": c_i = 1 / the labelled rows, a
count on the device, 0 where ignored), and the fused GRPO loss (c_i per row); a c_i per row is
applied to the chunk's dX rows and hidden rows (fast.row_scaled_grad_gemms). No pass scales dlogits.
Everything else, and every machine without QuACK or a Hopper GPU, keeps the Triton kernels.

The weight-gradient GEMMs (`weight_grad_into_`): dW = dlogits.T @ h per chunk, written in fp32 by
the first chunk, added in place to that fp32 sum (or Megatron's main_grad) by the others, or, for
the last chunk, added to the sum and written in the weight dtype by the GEMM's epilogue (no pass
casts the fp32 sum afterwards). Each runs one fixed QuACK configuration, the fastest of those
tried on an H100 for the bounded default's chunks (docs/design.md §10.11): no autotuning, about
3 s of compilation per kernel the first time on a machine (QuACK caches compiled kernels on
disk). There, QuACK's GEMMs were also timed for the logits and dX GEMMs and were not faster than
cuBLAS on every shape, which keeps them. SM90 only: the configurations were measured there.

Both run only for chunks of at least MIN_CHUNK_WORK multiply-adds: below it their launches' host
time, more than the Triton and cuBLAS launches', sets a call's time (docs/design.md §10.12).

Both reach the chunk loop as capabilities of the "auto" backend (`ROW_KERNEL`, `WEIGHT_GRAD_GEMM`,
backends/__init__.py). `_kernel()` and `_gemm()` are the only calls into QuACK (`cross_entropy_fwd_out`, `gemm_tuned.fn`);
tests replace them with `reference_kernel` / `reference_gemm` (the same contracts in torch), and
`_available` / `_gemm_available` with True, to check the integration on CPU.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from . import RowKernel, WeightGradGemm
from .triton_common import compute_capability

ENABLED = os.environ.get("MEGATRON_FUSED_CE_CUTE", "1") not in ("0", "", "false", "False")
_DTYPES = (torch.bfloat16, torch.float16)

# The least work of a chunk (rows x vocab columns x hidden, a GEMM's multiply-adds) for which
# QuACK's kernels run. Their launches take more host time than the Triton and cuBLAS launches they
# replace (110-400 us more a call of cross-entropy or GRPO on an H200 host), which a call whose GPU
# work is shorter than the host's pays in full: at 2048 x 2048 x 19008 (8.0e10) the Triton path
# took 842 / 1158 us a call back to back (cross-entropy / GRPO) against 1160 / 1488 with QuACK's,
# and from 2048 x 2048 x 32064 (1.3e11) on QuACK's was level or ahead (docs/design.md §10.12).
MIN_CHUNK_WORK = 1e11


def worth_launching(num_rows: int, num_cols: int, hidden: int) -> bool:
    """Whether a chunk of `num_rows` rows of `num_cols` vocab columns over `hidden` has the work
    that hides the host time of QuACK's launches (MIN_CHUNK_WORK)."""
    return num_rows * num_cols * hidden >= MIN_CHUNK_WORK


@functools.lru_cache(maxsize=None)
def _kernel():
    """QuACK's kernel, imported once on first use (None where QuACK or CuTe DSL does not import)."""
    try:
        from quack.cross_entropy import cross_entropy_fwd_out
    except Exception:  # not installed, or a CuTe DSL it does not import with
        return None
    return cross_entropy_fwd_out


def _available(device: torch.device) -> bool:
    """QuACK imports and the device is an SM90 / SM100 GPU."""
    return (device.type == "cuda" and compute_capability(device)[0] in (9, 10)
            and _kernel() is not None)


def supported(logits_dtype: torch.dtype, num_rows: int, num_cols: int, num_valid_cols: int,
              inv_temperature: float, device: torch.device, hidden: int) -> bool:
    """Whether `ce_dlogits_` runs for a chunk of this kind: whole unpadded rows in bf16/fp16
    (a multiple of 8 columns, 16-byte rows), temperature 1, fewer than 2^31 elements (the limit
    the Triton kernels lift with 64-bit row offsets; not relied on here), the work of
    `worth_launching` (with the chunk's `hidden` size), on an SM90/SM100 GPU with QuACK."""
    return (ENABLED and logits_dtype in _DTYPES and num_valid_cols == num_cols and num_cols % 8 == 0
            and num_rows * num_cols < 2**31 and inv_temperature == 1.0
            and worth_launching(num_rows, num_cols, hidden) and _available(device))


# the shard's target of a row whose label is ignored (the label kernel's): the kernel's ignore_index
IGNORED_TARGET = -1


def ce_dlogits_(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Overwrite a chunk of logits [n, V] with softmax - one_hot(target) and return the fp32 per-row
    (loss = lse - z_target, lse); a row whose target is IGNORED_TARGET gets zeros and loss 0 (the
    kernel reads no target logit there: at index -1 it read before the chunk, an illegal address
    where the chunk starts an allocation)."""
    n = logits.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    _kernel()(logits, target, None, loss, lse, logits, None, IGNORED_TARGET)
    return loss, lse


def reference_kernel(x: Tensor, target: Tensor, target_logit: Optional[Tensor], loss: Tensor,
                     lse: Optional[Tensor], dx: Optional[Tensor], weight: Optional[Tensor],
                     ignore_index: int = -100) -> None:
    """QuACK's `cross_entropy_fwd_out` contract in torch (fp32 math): loss, lse and dx written in
    place, dx = softmax(x) - one_hot(target); a row whose target is `ignore_index` gets loss 0 and
    dx 0 (its lse is written)."""
    z = x.float()
    row_lse = torch.logsumexp(z, dim=1)
    rows = torch.arange(x.shape[0], device=x.device)
    ignored = target == ignore_index
    at = torch.where(ignored, 0, target)
    loss.copy_(torch.where(ignored, 0.0, row_lse - z[rows, at]))
    if lse is not None:
        lse.copy_(row_lse)
    if dx is not None:
        grad = torch.exp(z - row_lse.unsqueeze(1))
        grad[rows, at] -= torch.where(ignored, 0.0, 1.0)
        dx.copy_(grad.masked_fill(ignored.unsqueeze(1), 0.0))


# epilogue -> (tile_m, tile_n, pingpong, cluster_m, cluster_n, swap_ab): the QuACK SM90 configuration
# that was fastest for the dW GEMM of the bounded default's chunks on an H100 (docs/design.md §10.11)
GEMM_CONFIGS = {
    "write": (128, 192, True, 2, 1, True),  # dW = alpha dlogits.T @ h (fp32, the first chunk)
    "add": (192, 128, True, 1, 2, False),  # ... + the fp32 sum: in place, or written in the weight dtype
}


@functools.lru_cache(maxsize=None)
def _gemm():
    """(QuACK's GEMM with an explicit configuration, {epilogue: its configuration}), or None where
    QuACK does not import."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_tuned
    except Exception:  # not installed, or a CuTe DSL it does not import with
        return None
    configs = {key: GemmConfig(tile_m=m, tile_n=n, pingpong=pingpong, cluster_m=cm, cluster_n=cn, swap_ab=swap,
                               is_dynamic_persistent=False, device_capacity=9)
               for key, (m, n, pingpong, cm, cn, swap) in GEMM_CONFIGS.items()}
    return gemm_tuned.fn, configs


def _gemm_available(device: torch.device) -> bool:
    """QuACK imports and the device is an SM90 GPU (where GEMM_CONFIGS were measured)."""
    return device.type == "cuda" and compute_capability(device)[0] == 9 and _gemm() is not None


def _tma_ok(t: Tensor) -> bool:
    """A 2-D operand QuACK's TMA copies can address: one unit stride, the other stride and the
    base address 16-byte aligned, no empty dimension."""
    if t.dim() != 2 or 0 in t.shape or 1 not in t.stride():
        return False
    elems = 16 // t.element_size()
    return max(t.stride()) % elems == 0 and t.data_ptr() % 16 == 0


def weight_grad_supported(a: Tensor, b: Tensor, out_dtype: torch.dtype, *, accumulate: bool = False,
                          add: Optional[Tensor] = None) -> bool:
    """Whether weight_grad_into_ runs for these inputs and a contiguous `out` of `out_dtype`:
    inputs both bf16 / fp16, `out` their dtype or fp32, the work of `worth_launching` (a: [vocab,
    rows], b: [rows, hidden]), every operand addressable by TMA, QuACK on an SM90 GPU,
    MEGATRON_FUSED_CE_CUTE not 0."""
    out_row_bytes = b.shape[-1] * torch.finfo(out_dtype).bits // 8
    return (ENABLED and a.dtype in _DTYPES and b.dtype == a.dtype and out_dtype in (a.dtype, torch.float32)
            and (add is None or (add.dtype == torch.float32 and not accumulate))
            and out_row_bytes % 16 == 0 and _gemm_available(a.device)
            and all(_tma_ok(t) for t in (a, b) + (() if add is None else (add,)))  # (2-D operands)
            and worth_launching(a.shape[1], a.shape[0], b.shape[1]))


def weight_grad_into_(out: Tensor, a: Tensor, b: Tensor, *, accumulate: bool = False, alpha: float = 1.0,
                      add: Optional[Tensor] = None) -> bool:
    """out = alpha * a @ b (+ out if `accumulate`; + `add`, an fp32 sum, before `out`'s dtype is
    written) by QuACK's GEMM: a weight gradient dlogits.T @ h. Returns False, having done nothing,
    where it does not apply (weight_grad_supported, and `out` addressable by TMA)."""
    if not (weight_grad_supported(a, b, out.dtype, accumulate=accumulate, add=add) and _tma_ok(out)
            and (add is None or add.shape == out.shape)):
        return False
    gemm, configs = _gemm()
    config = configs["add" if accumulate or add is not None else "write"]
    # in place: QuACK's epilogue reads `out` itself (add_to_output), as its gemm_add_inplace does
    gemm(a, b, out, add, alpha=float(alpha), beta=1.0, add_to_output=accumulate, config=config)
    return True


def reference_gemm(a: Tensor, b: Tensor, out: Tensor, c: Optional[Tensor], *, alpha: float = 1.0, beta: float = 1.0,
                   add_to_output: bool = False, config=None) -> None:
    """QuACK's `gemm_tuned.fn` contract in torch (fp32 math): out = alpha a @ b (+ beta c) (+ out)."""
    acc = alpha * (a.float() @ b.float())
    if c is not None:
        acc = acc + beta * c.float()
    if add_to_output:
        acc = acc + out.float()
    out.copy_(acc)


# what impl="auto" adds to the chunk backend (backends.select)
ROW_KERNEL = RowKernel(supported=supported, ce_dlogits_=ce_dlogits_)
WEIGHT_GRAD_GEMM = WeightGradGemm(supported=weight_grad_supported, into_=weight_grad_into_)
