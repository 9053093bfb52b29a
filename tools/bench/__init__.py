"""The pieces of tools/benchmark.py: what runs (methods.py: our ops; peers.py: every other
method; tp.py: the tensor-parallel rows), how it is measured (measure.py: timing, memory, the
floor, the float64 reference; run.py: one row, one shape; kernels.py: the Triton kernels against
the torch backend), and how it is reported (report.py: tables, JSON, plots)."""

import os
import sys

import torch

if not torch.cuda.is_available():  # smoke tests on CPU: Triton kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
