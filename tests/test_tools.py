"""The measurement tools still run against the package's current internals (a tool that calls a
private function breaks silently otherwise: tools/ has no other test)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_agreement_cost_runs_on_cpu():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "agreement_cost.py"), "--device", "cpu", "--tokens", "64"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("TP=1 device=cpu")
    n, floor, counts, agreement, _ = lines[-1].split(" | ")
    assert n == "64" and float(agreement) > 0
