"""A pure-torch stand-in for Apex's `fused_weight_gradient_mlp_cuda`, the CUDA extension behind
Megatron's gradient-accumulation fusion (`--gradient-accumulation-fusion`, on by default in
Megatron-LM): `ColumnParallelLinear` / `RowParallelLinear` add their weight gradient into the fp32
`weight.main_grad` buffer with its two functions instead of returning a `.grad`.

Why: Apex is not on PyPI, and its extension is only had by building Apex from source with
`--cpp_ext --cuda_ext` against the installed torch and CUDA. Without it megatron-core refuses to
build those layers with the fusion on ("fused_weight_gradient_mlp_cuda module is not found"), so
Megatron-LM's default stack (Transformer Engine layers, whose own linears accumulate without Apex,
plus megatron-core's output layer) cannot be run as its users run it.

What it costs: the same as Apex's. Each call is one GEMM whose fp32 product of the bf16/fp16
inputs is added into `main_grad` in place (`ops.gemm.matmul_into_`: cuBLAS's fp32-output addmm on
CUDA, `beta = 1`), which is what Apex's `wgrad_gemm_accum_fp32` does through cublasGemmEx with an
fp32 C; no `[out, in]` temporary in the input dtype, no extra pass over `main_grad`.

    from megatron_fused_ce.megatron import install_wgrad_accumulation_standin
    install_wgrad_accumulation_standin()   # "apex" where the real extension imports, else "standin"

before the model is built (megatron-core checks at layer construction).
"""

from __future__ import annotations

import sys
import types

import torch
from torch import Tensor

from ..ops.gemm import matmul_into_

MODULE_NAME = "fused_weight_gradient_mlp_cuda"
LAYERS_MODULE = "megatron.core.tensor_parallel.layers"


def _accumulate(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """main_grad[out, in] += grad_output[..., out]^T @ total_input[..., in], leading dims flattened."""
    if total_input.shape[:-1] != grad_output.shape[:-1]:
        raise ValueError(f"input {tuple(total_input.shape)} and grad_output {tuple(grad_output.shape)} "
                         "differ in their leading (token) dimensions")
    if main_grad.shape != (grad_output.shape[-1], total_input.shape[-1]):
        raise ValueError(f"main_grad {tuple(main_grad.shape)} is not [grad_output's last dim, input's "
                         f"last dim] = [{grad_output.shape[-1]}, {total_input.shape[-1]}]")
    a = grad_output.reshape(-1, grad_output.shape[-1]).t()
    b = total_input.reshape(-1, total_input.shape[-1])
    if not main_grad.is_cuda and a.dtype != main_grad.dtype:
        # CPU has no fp32-output low-precision GEMM: multiply in main_grad's dtype, as cuBLAS
        # accumulates (matmul_into_ would round the product to the input dtype first)
        a, b = a.to(main_grad.dtype), b.to(main_grad.dtype)
    matmul_into_(main_grad, a, b, accumulate=True)


def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """Apex's fp32 variant: `main_grad` (fp32) += grad_output^T @ input, in place."""
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 needs an fp32 main_grad, got {main_grad.dtype}")
    _accumulate(total_input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """Apex's half variant: `main_grad` (fp16 / bf16, the inputs' dtype) += grad_output^T @ input."""
    if main_grad.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"wgrad_gemm_accum_fp16 needs an fp16/bf16 main_grad, got {main_grad.dtype}")
    _accumulate(total_input, grad_output, main_grad)


def standin_module() -> types.ModuleType:
    """A module named like Apex's extension, holding the two functions above."""
    module = types.ModuleType(MODULE_NAME, "pure-torch stand-in for Apex's fused_weight_gradient_mlp_cuda "
                                           f"({__name__})")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    module.__standin__ = True
    return module


def install_wgrad_accumulation_standin() -> str:
    """Make Megatron's gradient-accumulation fusion usable: "apex" where Apex's extension imports
    (nothing changed), else "standin" after registering `standin_module()` as
    `fused_weight_gradient_mlp_cuda` and telling megatron-core's tensor_parallel layers, if they
    are already imported, that the fusion is available (they read a module flag set at import)."""
    existing = sys.modules.get(MODULE_NAME)
    if existing is None:
        try:
            import fused_weight_gradient_mlp_cuda as existing  # noqa: F401
        except ImportError:
            existing = None
    if existing is not None and not getattr(existing, "__standin__", False):
        return "apex"
    module = existing if existing is not None else standin_module()
    sys.modules[MODULE_NAME] = module
    layers = sys.modules.get(LAYERS_MODULE)
    if layers is not None:
        layers.fused_weight_gradient_mlp_cuda = module
        layers._grad_accum_fusion_available = True
    return "standin"


def uninstall_wgrad_accumulation_standin() -> None:
    """Undo `install_wgrad_accumulation_standin` (tests): a no-op where Apex's extension is in use."""
    module = sys.modules.get(MODULE_NAME)
    if module is None or not getattr(module, "__standin__", False):
        return
    del sys.modules[MODULE_NAME]
    layers = sys.modules.get(LAYERS_MODULE)
    if layers is not None:
        if getattr(layers, MODULE_NAME, None) is module:
            delattr(layers, MODULE_NAME)
        layers._grad_accum_fusion_available = False
