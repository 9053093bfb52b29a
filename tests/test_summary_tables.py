"""The summary at the end of a test run (conftest.pytest_terminal_summary over reference.tables()):
one table per kind of quantity (errors vs float64, differences between two computations, error
ratios, memory ratios), each row named by what it is, and no row for a backend that did not run."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from collections import defaultdict

import torch

import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def test_each_kind_of_quantity_is_its_own_table(monkeypatch):
    for name in ("ERRORS", "DIFFERENCES", "ERROR_RATIOS"):
        monkeypatch.setattr(reference, name, defaultdict(float))
    monkeypatch.setattr(reference, "MEMORY", {})
    reference.record("sampled dX", 2, torch.float32, 3e-7)
    reference.record("sampled dX", 2, torch.float32, 1e-7)  # the worst is kept
    reference.record("ce_loss", 1, torch.bfloat16, 2e-3)
    reference.record_difference("losses CP=2 vs CP=1", 1, torch.float64, 4e-16)
    reference.record_error_ratio("large |z| dW", 1, torch.float32, 0.998)
    memory_row = "linear_logprobs (chunk 128 of 2048 rows): largest tensor / dense [N, V] logits"
    reference.record_memory(memory_row, 0.0625)
    tables = {heading: reference.table(results) for heading, results in reference.tables()}
    assert len(tables) == 4 and all(tables.values())
    errors, differences, ratios, memory = tables.values()
    # rows in their own table only; columns only for what some test recorded
    assert errors[0].split() == ["quantity", "TP=1", "bfloat16", "TP=2", "float32"]
    assert [line.split()[:2] for line in errors[1:]] == [["ce_loss", "2.00e-03"], ["sampled", "dX"]]
    assert errors[2].split()[2:] == ["-", "3.00e-07"]
    assert [line.split()[-1] for line in differences] == ["float64", "4.00e-16"]
    assert ratios[1].split() == ["large", "|z|", "dW", "9.98e-01"]
    assert memory == [f"{memory_row}  0.0625"]
    assert not any("large |z|" in line for line in errors + differences + memory)
    monkeypatch.setattr(reference, "DIFFERENCES", defaultdict(float))
    assert reference.table(reference.tables()[1][1]) == []  # nothing measured: no table


def test_no_test_writes_a_table_directly():
    """Rows go through reference.record_* (one function per kind): writing a dict directly is how
    ratios ended up among the errors vs float64."""
    offenders = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "*.py"))):
        text = open(path).read()
        if re.search(r"reference\.(ERRORS|DIFFERENCES|ERROR_RATIOS|MEMORY)\s*\[", text):
            offenders.append(os.path.basename(path))
    assert offenders == []


def _sections(output: str) -> dict:
    """{heading: [lines]} of the `=== heading ===` sections of pytest's output."""
    sections, current = {}, None
    for line in output.splitlines():
        match = re.match(r"^=+ (.*?) =+$", line)
        if match:
            current = match.group(1)
            sections[current] = []
        elif current is not None and not re.match(r"^\d+ (passed|failed)", line):  # -q's last line
            sections[current].append(line)
    return sections


def test_summary_of_a_run():
    """A few tests of each kind, run as pytest would: errors, error ratios and memory ratios each
    under their heading; the torch stand-in of QuACK's kernels adds no QuACK row."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    selection = ["tests/test_ops.py::test_largest_intermediate_is_one_chunk[logprobs]",
                 "tests/test_reliability.py::test_entropy_precision_at_large_logits[z50-1]",
                 "tests/test_sampling.py::test_logits_dtype_main_grad_autocast_and_first_order_only",
                 "tests/test_cute_backend.py::test_quack_gemms_in_the_sampler_filters_backward",
                 "tests/test_cute_backend.py::test_one_pass_matches_float64_reference"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
                          cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout
    sections = _sections(proc.stdout)
    headings = {heading: lines for heading, lines in sections.items()
                if heading in {h for h, _ in reference.tables()}}
    errors, ratios, memory = (next(lines for heading, lines in headings.items() if heading.startswith(start))
                              for start in ("worst relative error vs the float64", "worst error ratio",
                                            "memory:"))
    assert not any(h.startswith("worst relative difference") for h in headings)  # none measured
    assert any(line.startswith("options lp") for line in errors) and len(errors[0].split()) == 3, errors
    assert all(not line.startswith("large |z|") for line in errors + memory)
    assert {line.split()[2] for line in ratios[1:]} == {"logprobs", "entropy", "dX", "dW"}, ratios
    assert memory == ["linear_logprobs (chunk 128 of 2048 rows): largest tensor / dense [N, V] logits  0.0625"]
    assert not re.search(r"quack|cute", "\n".join(errors + ratios + memory), re.IGNORECASE), errors
