"""Our Triton kernels on CPU tensors: defined under Triton's interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when a kernel is *defined*. The test modules that need it set the
variable at import (pytest imports every test module before running any test) and call
`kernel_modules()` from a fixture. If triton was imported before the variable was set (megatron.core
and torch._inductor import it), its own @jit library functions (tl.max, tl.sum ...) are
compiled-mode objects that cannot run inside an interpreted kernel: triton's Python modules are
imported afresh (the compiled extension triton._C stays loaded), and our kernel modules are
redefined with them, in import order (each module keeps references to its predecessors' kernels).
"""

import importlib
import sys

# in import order: later modules import kernels from the earlier ones
KERNEL_MODULES = ("triton_math", "triton_gemm_stats", "triton_gemm_dlogits", "sampling_triton", "replay_triton",
                  "replay_union_triton", "triton_backend", "triton_grpo")


def _interpreted(jit_function) -> bool:
    kernel = getattr(jit_function, "kernel", jit_function)  # triton_common.CachedLaunch's kernel
    return type(kernel).__name__ == "InterpretedFunction"


def kernel_modules() -> dict:
    """{name: module} of KERNEL_MODULES, every kernel in them interpreted."""
    import triton.language as tl

    modules = {name: importlib.import_module(f"megatron_fused_ce.ops.backends.{name}") for name in KERNEL_MODULES}
    if not _interpreted(tl.standard.max):
        for name in list(sys.modules):
            if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C"):
                del sys.modules[name]
    kernels = (modules["triton_gemm_stats"]._gemm_stats_tma, modules["triton_gemm_dlogits"]._gemm_dlogits_tma,
               modules["triton_backend"]._stats_kernel, modules["sampling_triton"]._compact_kernel,
               modules["replay_triton"]._kept_stats_kernel, modules["triton_grpo"]._whole_call_kernel)
    if not _interpreted(tl.standard.max) or not all(_interpreted(k) for k in kernels):
        # (sys.modules no longer holds triton.language if it was purged: the reloads import it anew)
        modules = {name: importlib.reload(module) for name, module in modules.items()}
    import triton.language as tl  # noqa: F811  (the interpreted one, if it was re-imported)

    assert _interpreted(tl.standard.max)
    assert _interpreted(modules["triton_backend"]._stats_kernel)
    assert _interpreted(modules["triton_gemm_dlogits"]._gemm_dlogits_tma)
    assert _interpreted(modules["sampling_triton"]._compact_kernel)
    assert _interpreted(modules["replay_triton"]._kept_weight_grad_kernel)
    assert _interpreted(modules["triton_grpo"]._whole_call_kernel)
    return modules
