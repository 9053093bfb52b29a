"""The op's GEMMs on bf16/fp16/fp32 inputs: a chunk's logits (in the input dtype or fp32), its
dlogits once the softmax offsets are known (the backend's fused GEMM where it has one), and
matmuls that write or add an fp32 product in place (weight gradients summed over chunks).

cuBLAS runs them; the weight-gradient GEMMs run on the backend's `weight_grad_gemm` where it has
one and it applies (QuACK's Hopper GEMM: backends/cute_backend.py), and the last chunk's dW can add
the fp32 sum of the others in that GEMM and be written in the weight dtype (matmul_add_cast)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backends import WeightGradGemm


def logits_into(out: Tensor, h: Tensor, weight_t: Tensor) -> Tensor:
    """out = h @ weight_t in out's dtype (the input dtype, or fp32 logits of bf16/fp16 inputs)."""
    if out.dtype == h.dtype:
        return torch.mm(h, weight_t, out=out)
    if out.is_cuda:
        matmul_into_(out, h, weight_t, accumulate=False)
        return out
    return torch.mm(h.float(), weight_t.float(), out=out)  # CPU: no fp32-output bf16 matmul


def logits_gemm(h: Tensor, weight: Tensor, logits_dtype: Optional[torch.dtype]) -> Tensor:
    """Logits h @ W.T (a chunk, a tile) in the input dtype, or in `logits_dtype` (fp32)."""
    if logits_dtype is None or logits_dtype == h.dtype:
        return torch.mm(h, weight.t())
    return matmul_fp32(h, weight.t())


def gemm_input(dlogits: Tensor, h: Tensor) -> Tensor:
    """dlogits as the dX / dW GEMMs take them: in the input dtype (a no-op unless fp32 logits)."""
    return dlogits if dlogits.dtype == h.dtype else dlogits.to(h.dtype)


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


def matmul_into_(out: Tensor, a: Tensor, b: Tensor, *, accumulate: bool, alpha: float = 1.0,
                 weight_grad_gemm: Optional[WeightGradGemm] = None) -> None:
    """out (+)= alpha * a @ b; `accumulate=False` overwrites (no zero-fill, no read of `out`).

    `out` is fp32 when gradients are summed over chunks: low-precision weight-gradient
    accumulation drifts (axolotl #1601, Liger #827). On CUDA cuBLAS writes or adds the fp32 product
    of bf16/fp16 inputs in place (out_dtype); elsewhere (CPU) the chunk product is rounded to the
    input dtype first. A single GEMM over all rows may write the input dtype directly: cuBLAS
    accumulates in fp32 internally. `alpha` is the GEMM's own scale (no pass over `out`).
    `weight_grad_gemm`: a backend's dW GEMM, which runs this product where it applies.
    """
    global _FP32_OUT_MATMUL_OK
    if weight_grad_gemm is not None and weight_grad_gemm.into_(out, a, b, accumulate=accumulate, alpha=alpha):
        return
    beta = 1 if accumulate else 0  # beta = 0: `out` is not read (NaN in it does not propagate)
    if out.dtype == a.dtype:
        if alpha == 1.0 and not accumulate:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(out, a, b, beta=beta, alpha=alpha, out=out)
        return
    if out.is_cuda and _FP32_OUT_MATMUL_OK is not False:
        try:
            if alpha != 1.0:
                torch.addmm(out, a, b, beta=beta, alpha=alpha, out_dtype=out.dtype, out=out)
            elif accumulate:
                torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            else:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
            _FP32_OUT_MATMUL_OK = True
            return
        except (TypeError, RuntimeError):
            if alpha == 1.0:
                _FP32_OUT_MATMUL_OK = False
    if accumulate:
        out.add_(torch.mm(a, b), alpha=alpha)
    elif alpha == 1.0:
        out.copy_(torch.mm(a, b))
    else:
        torch.mul(torch.mm(a, b), alpha, out=out)


def matmul_add_cast(out: Tensor, a: Tensor, b: Tensor, fp32_sum: Tensor, weight_grad_gemm: WeightGradGemm, *,
                    alpha: float = 1.0) -> bool:
    """out = alpha * a @ b + fp32_sum, written in out's dtype by one GEMM (the backend's dW GEMM adds
    the sum in its epilogue): the last chunk's dW, so that no pass reads the fp32 sum again to cast
    it. False, having done nothing, where that GEMM does not apply."""
    return weight_grad_gemm.into_(out, a, b, alpha=alpha, add=fp32_sum)


def dlogits_gemm(h: Tensor, w_block: Tensor, local_target: Tensor, num_valid: int, spec, offsets, coefs: dict,
                 col_start: int = 0) -> Tensor:
    """dlogits of h @ w_block.T (a chunk, or a lean tile of columns from `col_start`; the first
    `num_valid` columns are below the true vocab) in the GEMM input dtype, the softmax offsets
    (row max or lse, log_sum_exp) and coefficients known: from the logits GEMM's epilogue where
    spec's backend has it (no logits in memory), else the logits GEMM then the backend's
    shard_dlogits_ in place."""
    row_max, log_sum_exp = offsets
    args = (local_target, num_valid)
    if spec.backend.dlogits_in_gemm(h, w_block):
        return spec.backend.gemm_dlogits.run(
            h, w_block, *args, w_block.shape[0], spec.inv_temperature, row_max, coefs["p"], coefs["pz"],
            coefs["target"], coefs["uniform"], log_sum_exp, col_start=col_start, round_logits=spec.logits_dtype is None)
    tile = logits_gemm(h, w_block, spec.logits_dtype)
    spec.backend.shard_dlogits_(tile, *args, spec.inv_temperature, row_max, coefs["p"], coefs["pz"], coefs["target"],
                                coefs["uniform"], log_sum_exp=log_sum_exp, col_start=col_start)
    return gemm_input(tile, h)
