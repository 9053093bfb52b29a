"""enable_cpu_mode: idempotent, and each redirection scoped as documented (run in a forked
worker: the pytest process itself is never switched to CPU mode)."""

from __future__ import annotations

import torch

import megatron_harness  # noqa: F401  (megatron-core imported before forking)
from dist import init_megatron_parallel, run_workers

from megatron_fused_ce.megatron import enable_cpu_mode
from megatron_fused_ce.testing.cpu import is_cpu_mode


def cpu_mode_worker(rank, world):
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer import utils as transformer_utils

    first = enable_cpu_mode()
    patched = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda,
               schedules.torch, transformer_utils.torch)
    second = enable_cpu_mode()
    same = patched == (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda,
                       schedules.torch, transformer_utils.torch)

    init_megatron_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    tracker = get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    tensor_parallel.model_parallel_cuda_manual_seed(5, force_reset_rng=True)
    with get_cuda_rng_tracker().fork():
        a_again = torch.rand(3)
    return {
        "first": first, "second": second, "same_objects": same, "flag": is_cpu_mode(),
        "current_device": torch.cuda.current_device(),
        "synchronize": torch.cuda.synchronize(),
        "stream_waits": (torch.cuda.current_stream().wait_event(None),
                         torch.cuda.current_stream().wait_stream(None)),
        "dot_cuda_is_cpu": torch.ones(2).cuda().device.type,
        "schedules_zeros": schedules.torch.zeros([], device="cuda").device.type,
        "mask_device": transformer_utils.get_default_causal_mask(4).device.type,
        "other_modules_see_real_torch": layers.torch is torch and torch.zeros is torch.zeros,
        "tracker_streams": (not torch.equal(a, b), torch.equal(a, a_again)),
        "outside_rng_untouched": torch.equal(outside, torch.get_rng_state()),
    }


def test_enable_cpu_mode():
    (r,) = run_workers(cpu_mode_worker, 1)
    assert r["first"] and r["second"] and r["same_objects"] and r["flag"]
    assert r["current_device"] == torch.device("cpu")
    assert r["synchronize"] is None
    assert r["stream_waits"] == (None, None)  # megatron-core >= 0.19 DDP waits on the current stream
    assert r["dot_cuda_is_cpu"] == r["schedules_zeros"] == r["mask_device"] == "cpu"
    assert r["other_modules_see_real_torch"]
    assert r["tracker_streams"] == (True, True)  # the fork continues its stream; reseeding restarts it
    assert r["outside_rng_untouched"]


def test_parent_process_untouched():
    assert not is_cpu_mode()
    assert torch.cuda.current_device.__module__.startswith("torch")
