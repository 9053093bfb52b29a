"""What the tests, the examples and the tools run the library with; the library itself never
imports it.

- `enable_cpu_mode()` (cpu.py): megatron-core on CPU over gloo, by redirecting the few CUDA
  assumptions on the path of a GPT training step (docs/design.md §7); changes nothing where CUDA
  is available.
- `with_context_parallel_attention(spec)` / `GatheredKVAttention` (cp_attention.py): context
  parallelism without Transformer Engine, exact but all-gathering keys and values (small models).
- `PeakTensorMemory` (memory.py): the peak tensor memory of a block of code, on CUDA or the CPU.
- `left_in_cycles(call, calls)` (gc_cycles.py): the objects calls of `call` leave in reference cycles.

`enable_cpu_mode` and the CP attention stay importable from `megatron_fused_ce.megatron`, and
`PeakTensorMemory` from `megatron_fused_ce.memory`, where the documentation has long put them.
"""

from .cp_attention import GatheredKVAttention, with_context_parallel_attention
from .cpu import enable_cpu_mode, is_cpu_mode
from .gc_cycles import left_in_cycles
from .memory import PeakTensorMemory

__all__ = ["enable_cpu_mode", "is_cpu_mode", "GatheredKVAttention", "with_context_parallel_attention",
           "PeakTensorMemory", "left_in_cycles"]
