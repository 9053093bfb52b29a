"""Peak tensor memory of a block of code, on CUDA or on the CPU (for the examples, tests and tools).

    with PeakTensorMemory(device) as mem:
        loss = ...; loss.backward()
    mem.peak_bytes        # the most bytes of tensors alive at once beyond those alive at entry

On CUDA this is `torch.cuda.max_memory_allocated()` minus the bytes allocated at entry (the peak
statistics are reset on entry). The CPU allocator keeps no statistics, and a process's resident
set size (RSS) only grows, so it cannot tell a step that materializes the `[tokens, V/TP]` logits
from one that does not. On the CPU a `TorchDispatchMode` therefore follows every tensor storage
that an operator creates inside the block (forward and backward alike) until it is freed, and
keeps the peak of their total size. Tensors that existed before the block (parameters, inputs,
gradient buffers) and views of them are not counted; their in-place updates allocate nothing.

`pause()` / `resume()` restrict the count to windows inside the block (e.g. from a forward hook
to a gradient hook: the output layer and loss of a training step, forward and backward); tensors
allocated in a window are followed until they are freed. On CUDA each window's peak is measured
from the bytes allocated when it opens.

Nothing in the library imports this module; it changes no global state outside the block.
"""

from __future__ import annotations

import weakref
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakTensorMemory"]


class _LiveStorageBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode (while `counting`) still alive, and their peak."""

    def __init__(self, counting: bool = True):
        super().__init__()
        self.counting = counting
        self.live = 0
        self.peak = 0
        self._storages = {}  # storage data_ptr -> [tensors referring to it, nbytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0:
                continue
            entry = self._storages.get(key)
            if entry is None:
                if not self.counting:
                    continue
                if inputs is None:  # a view of (or in place on) an input allocates nothing new
                    inputs = {t.untyped_storage().data_ptr()
                              for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                if key in inputs:
                    continue
                entry = self._storages[key] = [0, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            entry[0] += 1  # one more tensor on a followed storage (a view of it, or itself again)
            weakref.finalize(tensor, self._release, key)
        return out

    def _release(self, key):
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            self.live -= entry[1]


class PeakTensorMemory:
    """Context manager: `peak_bytes` of tensor memory allocated inside the block (see module doc).

    `device`: where the block computes; CUDA devices use the caching allocator's statistics,
    anything else the CPU tracker. Default: the current CUDA device if CUDA is available, else CPU.
    `paused=True`: count nothing until `resume()`.
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None, *, paused: bool = False):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._paused = paused
        self._mode: Optional[_LiveStorageBytes] = None
        self._base = 0

    def __enter__(self) -> "PeakTensorMemory":
        if self.device.type == "cuda":
            if not self._paused:
                self._start_cuda_window()
        else:
            self._mode = _LiveStorageBytes(counting=not self._paused)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.pause()
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = max(self.peak_bytes, self._mode.peak)
        return False

    def resume(self) -> None:
        """Count what is allocated from now on (no-op if counting)."""
        if not self._paused:
            return
        self._paused = False
        if self.device.type == "cuda":
            self._start_cuda_window()
        elif self._mode is not None:
            self._mode.counting = True

    def pause(self) -> None:
        """Stop counting new allocations (those counted stay followed until freed)."""
        if self._paused:
            return
        self._paused = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(self.peak_bytes,
                                  torch.cuda.max_memory_allocated(self.device) - self._base)
        elif self._mode is not None:
            self._mode.counting = False
            self.peak_bytes = max(self.peak_bytes, self._mode.peak)

    def _start_cuda_window(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
