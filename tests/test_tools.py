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


def _benchmark(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "benchmark.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_benchmark_report_renders_a_results_json(tmp_path):
    """`--report` rebuilds results.md from a GPU run's results.json: summary, targets and per-shape
    tables, the same as the run wrote (the committed results.md of each GPU model)."""
    results = os.path.join(REPO, "docs", "bench", "h100", "results.json")
    out = _benchmark("--report", results, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "results.md").read_text()
    assert "### Summary, random logits" in md and "### Targets, peaked logits" in md
    assert "| fast SFT CE (`ours_ce`) faster than torch.compile |" in md
    with open(os.path.join(REPO, "docs", "bench", "h100", "results.md")) as f:
        assert md == f.read()


def test_benchmark_quick_runs_on_cpu(tmp_path):
    """A smoke run on CPU (Triton under the interpreter): our rows and the floor produce times,
    errors against the float64 reference, results.json and results.md."""
    import json

    out = _benchmark("--quick", "--impls", "floor,floor_fwd,torch_eager,ours_ce,ours_fwd", "--sweep", "",
                     "--spreads", "random", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {"floor", "floor_fwd", "torch_eager", "ours_ce@auto", "ours_fwd@auto"}
    assert all("ms" in r for r in rows.values()), rows
    assert rows["ours_ce@auto"]["err_dx"] < 2e-2 and rows["ours_fwd@auto"]["err_logprobs"] < 2e-2
    assert "### Summary, random logits" in (tmp_path / "results.md").read_text()
