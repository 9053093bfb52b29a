"""Run megatron-core's GPTModel, tensor-parallel layers and pipeline schedules on CPU over gloo.

megatron-core assumes CUDA in a handful of places on the path of a GPT training step (model
construction, forward/backward through TP layers, pipeline schedules, DDP, finalize_model_grads);
with those redirected, TP x PP x DP runs on CPU processes over gloo. This is for tests and for
running the examples on machines without a GPU. It changes nothing when CUDA is available, and
calling it twice is a no-op. Not covered (not needed by the tests/examples): megatron's optimizer
(allocates CUDA tensors), the distributed optimizer, TE, CUDA graphs.

The redirections (the first four are what a GPT training step needs; the fifth is needed for tied
embeddings with pipeline parallelism, the sixth by megatron-core >= 0.19's DDP, the seventh by
activation recomputation):

1. ``torch.cuda.current_device()`` returns ``torch.device("cpu")``: megatron allocates parameters,
   pipeline receive buffers and SP scatter buffers with ``device=torch.cuda.current_device()``.
2. ``torch.cuda.synchronize()`` is a no-op: the p2p layer calls it after ``batch_isend_irecv``
   (a workaround for a NCCL race that does not exist on gloo).
3. The model-parallel RNG tracker keeps its named states on the CPU generator: weight init and
   dropout in TP regions fork the tracker, which otherwise reads/writes CUDA generator state.
4. Literal ``device="cuda"`` tensor creation: the pipeline schedules create their token counter
   with ``torch.zeros(..., device="cuda")`` and the local attention builds its default causal mask
   (when no ``attention_mask`` is passed) with ``torch.ones(..., device="cuda")``. Inside those two
   modules only (``pipeline_parallel.schedules``, ``transformer.utils``), ``torch.zeros``/``ones``
   with a CUDA device allocate on the CPU. Nothing outside them sees a different ``torch``.
5. ``Tensor.cuda()`` returns the tensor itself: with tied embeddings and PP > 1 the last stage's
   copy of the word embeddings is synchronised with ``weight.data = weight.data.cuda()`` followed
   by an all-reduce over the embedding group. On a machine without CUDA every ``.cuda()`` call
   would raise, so this only changes code that could not run otherwise.
6. ``torch.cuda.current_stream()`` returns a stream whose waits are no-ops: megatron-core 0.19's
   DDP ``start_grad_sync`` asks for the current stream to wait on CUDA-graph events before every
   gradient reduction. CPU work is synchronous, so there is nothing to wait for.
7. Megatron's recompute (``tensor_parallel.checkpoint``) saves and restores "the CUDA generator"
   around the recomputed forward: on CPU that generator is the CPU one (as for the tracker in 3).
"""

from __future__ import annotations

import contextlib
import types

import torch

_ENABLED = False


def enable_cpu_mode() -> bool:
    """Redirect megatron-core's CUDA assumptions to the CPU. Idempotent.

    Returns True if CPU mode is (now) active, False when CUDA is available and nothing was changed.
    Call it before building models (weight init uses the RNG tracker) and before the first schedule.
    """
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False
    _require_megatron()

    # 1 + 2: the two torch.cuda entry points megatron calls unconditionally.
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _no_synchronize
    # 5: `.cuda()` stays on the CPU (tied embeddings at PP > 1).
    torch.Tensor.cuda = _cuda_stays_on_cpu
    # 6: DDP's gradient sync (megatron-core >= 0.19) waits on the current stream.
    torch.cuda.current_stream = _synchronous_stream

    # 3: a tracker with the same interface whose states are CPU generator states.
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._CUDA_RNG_STATE_TRACKER = _new_cpu_tracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mp_random.initialize_rng_tracker = _initialize_cpu_tracker
    # 7: recompute's generator state (the functions megatron-core's random module calls by name).
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state

    # 4: these two modules see a `torch` whose zeros/ones map device="cuda" to the CPU.
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    for module in (schedules, transformer_utils):
        module.torch = _TorchWithCudaFactoriesOnCpu(torch)

    _ENABLED = True
    return True


INSTALL_HINT = 'pip install "megatron_fused_ce[megatron]" (from a checkout: pip install -e ".[megatron]")'


def _require_megatron() -> None:
    """A one-line install hint instead of a bare ModuleNotFoundError deep inside."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise ModuleNotFoundError(f"enable_cpu_mode() needs megatron-core, which is not installed: "
                                  f"{INSTALL_HINT}", name="megatron") from err


def is_cpu_mode() -> bool:
    return _ENABLED


def _cpu_current_device():
    return torch.device("cpu")


def _get_cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


def _no_synchronize(device=None):
    return None


class _SynchronousStream:
    """The 'current stream' of CPU work: everything already happened, so every wait is a no-op."""

    def wait_event(self, event):
        return None

    def wait_stream(self, stream):
        return None

    def synchronize(self):
        return None


_SYNCHRONOUS_STREAM = _SynchronousStream()


def _synchronous_stream(device=None):
    return _SYNCHRONOUS_STREAM


def _cuda_stays_on_cpu(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _initialize_cpu_tracker(*args, force_reset=False, **kwargs):
    """Stands in for `initialize_rng_tracker`, which `model_parallel_cuda_manual_seed(...,
    force_reset_rng=True)` would otherwise use to build a CUDA tracker again."""
    from megatron.core.tensor_parallel import random as mp_random

    if force_reset or not mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        mp_random._CUDA_RNG_STATE_TRACKER = _new_cpu_tracker()
        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _make_tracker_class():
    from megatron.core.tensor_parallel.random import (
        _MODEL_PARALLEL_RNG_TRACKER_NAME,
        CudaRNGStatesTracker,
    )

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """megatron's RNG tracker with named states on the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            outside = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)

        @contextlib.contextmanager
        def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    return CpuRNGStatesTracker


_TRACKER_CLASS = None  # built on first use: megatron is only imported by enable_cpu_mode()


def _new_cpu_tracker():
    global _TRACKER_CLASS
    if _TRACKER_CLASS is None:
        _TRACKER_CLASS = _make_tracker_class()
    return _TRACKER_CLASS()


def _on_cpu(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


class _TorchWithCudaFactoriesOnCpu(types.ModuleType):
    """`torch`, except that `zeros`/`ones` with a CUDA device allocate on the CPU."""

    def __init__(self, real_torch):
        super().__init__("torch")
        self._torch = real_torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *args, device=None, **kwargs):
        return self._torch.zeros(*args, device=_on_cpu(device), **kwargs)

    def ones(self, *args, device=None, **kwargs):
        return self._torch.ones(*args, device=_on_cpu(device), **kwargs)
