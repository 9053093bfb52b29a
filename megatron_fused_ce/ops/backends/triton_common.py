"""Helpers shared by the Triton kernels' launchers (triton_backend.py, triton_gemm_*.py,
sampling_triton.py)."""

from __future__ import annotations

import os

import torch
from torch import Tensor

_SM_COUNT: dict = {}
_CAPABILITY: dict = {}


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run on CPU tensors (the test suite on a CPU machine)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached), or a small number off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def compute_capability(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device, cached: torch's lookup costs a few microseconds of host time
    on every call, and the launchers ask on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def f32(t: Tensor) -> Tensor:
    """A per-row coefficient (or a 0-d scalar: a pointer to its value, as a [1] tensor is) as the
    kernels read it: fp32, contiguous; the tensor itself where it already is (`.to` is a
    dispatched op even then, host time at every launch)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return t.to(torch.float32).contiguous()
