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


def test_host_sync_cost_runs_on_cpu():
    """tools/host_sync_cost.py replays the agreement through api._check_arguments: the replayed
    call still runs (and the tool restores the real check)."""
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "host_sync_cost.py"), "--device", "cpu",
         "--shapes", "256x32x515"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("256x32x515 cpu: floor")
    for key in ("ce", "ce_preloaded", "ce_back_to_back", "ce_nosync", "ce_nosync_preloaded",
                "ce_nosync_back_to_back"):
        assert f" {key} " in line


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


FAKE_MEGATRON_LM = r'''
"""Stands in for examples/megatron_lm_real_pretrain_gpt.py: prints Megatron-LM's iteration lines
with a loss that depends on the step and the output layer only, printing a process's second
step as the mean of its first two (as Megatron's training_log does), and refuses the flag
combinations that megatron-core 0.19.2 without Apex/TE cannot resume."""
import sys
a = sys.argv
iters = int(a[a.index("--train-iters") + 1])
start = int(a[a.index("--ckpt-step") + 1]) if "--ckpt-step" in a else 0
fused = "--use-linear-ce-fusion-loss" in a
if start and "--use-distributed-optimizer" in a and "--no-load-optim" not in a:
    sys.exit("KeyError: 'step'")
if start and "--use-distributed-optimizer" not in a and "--no-load-optim" in a:
    sys.exit("the whole state was expected")
def loss(step):
    return 10.0 - 0.01 * step + (2e-5 if fused else 0.0)
printed = []
for step in range(start + 1, iters + 1):
    value = loss(step) if len(printed) != 1 else (loss(step) + printed[0]) / 2
    printed.append(loss(step))
    mtp = " mtp_1 loss: 1.100000E+01 |" if "--mtp-num-layers" in a else ""
    print(f" iteration {step:8d}/{iters:8d} | elapsed time per iteration (ms): 100.0 |"
          f" lm loss: {value:.6E} |{mtp} loss scale: 1.0 |")
print("peak GPU memory allocated (max over ranks): 2.5 GiB")
'''


def test_real_loop_tool_stages_and_megatron_log(tmp_path, monkeypatch):
    """tools/real_loop_curves.py (GPU only otherwise) with a stand-in training script: each stage
    starts the runs it should with the flags megatron-core 0.19 can resume (weights only under the
    distributed optimizer, the whole state under the non-distributed one), recovers each step's
    own loss from Megatron's mean-of-two second line, and compares every resume with its writer."""
    import json

    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import real_loop_curves as tool
    finally:
        sys.path.pop(0)
    script = tmp_path / "fake_pretrain.py"
    script.write_text(FAKE_MEGATRON_LM)
    monkeypatch.setattr(tool, "SCRIPT", script)
    monkeypatch.setattr(tool, "full_optimizer_resume_possible", lambda: False)
    monkeypatch.setitem(tool.PRESETS, "test", dict(tool.PRESETS["tiny"], iters=12, save_interval=6,
                                                   full_resume_interval=3, mtp_iters=4))
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "data").mkdir(parents=True)
    (work / "data" / "dataset.json").write_text(json.dumps({"files": 1, "tokens": 10, "vocab_size": 300}))
    assert tool.main(["--preset", "test", "--work", str(work), "--out", str(out), "--serial-mtp",
                      "--stages", "main,resume,resume_full,mtp"]) == 0
    summary = json.loads((out / "real_loop_summary.json").read_text())
    runs = summary["runs"]
    assert all(r["rc"] == 0 for r in runs.values()), {n: r["rc"] for n, r in runs.items()}
    assert runs["fused"]["steps"] == list(range(1, 13))
    # the second printed line was a mean; the recovered loss is that step's own
    assert runs["unfused"]["lm_loss"][:3] == [9.99, 9.98, 9.97]
    assert runs["unfused"]["second_step_as_logged"]["lm_loss"] == 9.985
    inter = summary["interchange"]
    assert set(inter) == {"fused_to_unfused", "unfused_to_fused", "fused_to_fused", "full_fused_to_unfused",
                          "full_unfused_to_fused", "full_fused_to_fused"}
    assert inter["fused_to_unfused"]["step"] == 7 and inter["full_fused_to_fused"]["step"] == 4
    assert inter["fused_to_fused"]["resumed_next"] == inter["fused_to_fused"]["uninterrupted_fused_next"]
    assert inter["full_fused_to_fused"]["max_abs_diff_vs_writer"] == 0.0
    assert inter["full_fused_to_fused"]["steps_compared"] == 3
    assert abs(inter["full_unfused_to_fused"]["max_abs_diff_vs_writer"] - 2e-5) < 1e-9
    assert summary["resume_mode"].startswith("weights only")
    assert runs["mtp_fused"]["mtp_1_loss"][0] == 11.0 and runs["mtp_unfused"]["side_by_side"] is False
    md = (out / "real_loop.md").read_text()
    assert "| full_fused_to_fused | 4 |" in md
