"""`PeakTensorMemory` lives in megatron_fused_ce.testing (the examples' and tests' harness); this
name keeps working where the documentation put it."""

from .testing.memory import PeakTensorMemory

__all__ = ["PeakTensorMemory"]
