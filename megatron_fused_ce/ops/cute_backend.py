"""QuACK's CuTe DSL cross-entropy row kernel: an optional one-pass replacement for the Triton
statistics + dlogits kernels (`pip install megatron_fused_ce[cute]`).

On Hopper, QuACK (quack-kernels, built on nvidia-cutlass-dsl) holds each row of logits on chip
across a cluster of thread blocks, so one read of a chunk gives the row's log-sum-exp and one write
its dlogits = softmax - one_hot(label) in place. The Triton backend reads the chunk twice (the
statistics, then dlogits once they are merged over tensor-parallel ranks): on an H100 the QuACK
kernel took 0.74 / 0.49 / 0.66 ms against 1.10 / 0.90 / 1.27 ms for the chunks of the benchmark
shapes (docs/design.md §10.6).

It applies where nothing has to be merged between the two (the shard holds the whole vocab: TP = 1)
and the loss's gradient is c (softmax - one_hot) with one constant c for every row: cross-entropy
with "mean" / "sum" reduction, no label smoothing, no z-loss, temperature 1, no vocab padding. c
is then applied by the dX / dW GEMMs (cuBLAS alpha), so that no pass scales dlogits. Everything
else, and every machine without QuACK or a Hopper GPU, keeps the Triton kernels.

`_kernel()` is the one call into QuACK (`cross_entropy_fwd_out`); tests replace it with
`reference_kernel` (the same contract in torch), and `_available` with True, to check the
integration on CPU.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

ENABLED = os.environ.get("MEGATRON_FUSED_CE_CUTE", "1") not in ("0", "", "false", "False")
_DTYPES = (torch.bfloat16, torch.float16)


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
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)
            and _kernel() is not None)


def supported(logits_dtype: torch.dtype, num_rows: int, num_cols: int, num_valid_cols: int,
              inv_temperature: float, device: torch.device) -> bool:
    """Whether `ce_dlogits_` runs for a chunk of this kind: whole unpadded rows in bf16/fp16
    (a multiple of 8 columns, 16-byte rows), temperature 1, fewer than 2^31 elements (the limit
    the Triton kernels lift with 64-bit row offsets; not relied on here), on an SM90/SM100 GPU
    with QuACK."""
    return (ENABLED and logits_dtype in _DTYPES and num_valid_cols == num_cols and num_cols % 8 == 0
            and num_rows * num_cols < 2**31 and inv_temperature == 1.0 and _available(device))


def ce_dlogits_(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Overwrite a chunk of logits [n, V] with softmax - one_hot(target) (every target a valid
    column) and return the fp32 per-row (loss = lse - z_target, lse)."""
    n = logits.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    _kernel()(logits, target, None, loss, lse, logits, None)
    return loss, lse


def reference_kernel(x: Tensor, target: Tensor, target_logit: Optional[Tensor], loss: Tensor,
                     lse: Optional[Tensor], dx: Optional[Tensor], weight: Optional[Tensor],
                     ignore_index: int = -100) -> None:
    """QuACK's `cross_entropy_fwd_out` contract in torch (fp32 math): loss, lse and dx written in
    place, dx = softmax(x) - one_hot(target)."""
    z = x.float()
    row_lse = torch.logsumexp(z, dim=1)
    rows = torch.arange(x.shape[0], device=x.device)
    loss.copy_(row_lse - z[rows, target])
    if lse is not None:
        lse.copy_(row_lse)
    if dx is not None:
        grad = torch.exp(z - row_lse.unsqueeze(1))
        grad[rows, target] -= 1.0
        dx.copy_(grad)
