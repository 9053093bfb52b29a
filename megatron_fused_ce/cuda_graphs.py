"""Capturing the op's calls in CUDA graphs when they make NCCL collectives (TP > 1).

Every path of the op is capturable (static shapes, no host synchronization in steady state:
docs/performance.md, "RL passes"). Over NCCL one more thing matters: CUDA's default (global)
capture mode fails the capture when *any* thread of the process makes a call that is not
capture-safe, and NCCL's watchdog thread queries the events of the collectives made just before
(the warm-up iterations) while the capture runs: "operation not permitted when stream is
capturing", from one capture to the next. The thread-local mode, which Megatron's own CUDA graphs
use, only refuses such calls from the capturing thread.

    with thread_local_capture():
        graphed = torch.cuda.make_graphed_callables(loss_fn, sample_args)

`torch.cuda.graph` takes the mode as an argument (`capture_error_mode="thread_local"`);
`torch.cuda.make_graphed_callables` does not, so inside the block `torch.cuda.graph` captures in
that mode.
"""

from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def thread_local_capture():
    """Within the block, `torch.cuda.graph` captures with capture_error_mode="thread_local" (see the
    module doc): for torch.cuda.make_graphed_callables over NCCL."""
    graph = torch.cuda.graph
    torch.cuda.graph = functools.partial(graph, capture_error_mode="thread_local")
    try:
        yield
    finally:
        torch.cuda.graph = graph
