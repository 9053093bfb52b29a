"""The tools under tools/ still run against the package's current internals, each on tiny shapes
on the CPU (CI has no GPU: a tool that calls a private function would otherwise break unnoticed;
tests/test_gpu_check.py fails for a tool that no test starts)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tools_module(name: str):
    """A module of tools/ ("host_time", "bench.report"), imported with tools/ on sys.path for the
    import only (the tools import their siblings as top-level modules)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


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


def test_host_time_runs_on_cpu(tmp_path):
    """tools/host_time.py (the per-call host and idle-start times of docs/benchmarks.md's RL A/B) on
    the CPU: each default method of the benchmark runs and gets its three figures, in the table and
    the JSON."""
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "host_time.py"), "--device", "cpu", "--shape", "64x32x100",
         "--rounds", "2", "--calls", "2", "--json", str(tmp_path / "t.json")],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["floor_fwd", "floor", "ours_fwd", "ours_ce", "ours_logprobs", "ours_grpo"], \
        out.stdout
    assert all(len(row) == 4 and all(float(x) > 0 for x in row[1:]) for row in rows)
    figures = json.load(open(tmp_path / "t.json"))["methods"]
    assert set(figures["ours_grpo"]) == {"back_to_back_us", "from_idle_us", "host_us"}


def test_host_time_reports_what_the_calls_leave_to_the_cyclic_collector(tmp_path):
    """tools/host_time.py --gc (docs/performance.md's figures of the collector's cost): per method, the
    objects a call leaves in reference cycles (the package's calls: none) and the collections per
    1000 calls, in the table and the JSON."""
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "host_time.py"), "--device", "cpu", "--shape", "64x32x100",
         "--rounds", "1", "--calls", "2", "--impls", "ours_ce,ours_grpo", "--gc", "30",
         "--json", str(tmp_path / "t.json")],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("0 objects left in reference cycles a call") == 2, out.stdout
    collector = json.load(open(tmp_path / "t.json"))["methods"]["ours_grpo"]["collector"]
    assert collector["cycle_objects_per_call"] == 0 and len(collector["collections_per_1000"]) == 3
    assert collector["mean_host_us"] > 0


def test_host_ab_runs_two_versions_in_one_process_on_cpu():
    """tools/host_ab.py (docs/benchmarks.md's in-process A/B of host time) on the CPU, against this
    checkout's own folder: the second copy of the package imports under another name beside the
    first, every method runs in both, and the two compute alike (dX and dW 0 apart; the forward
    pass's log-probs)."""
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "host_ab.py"), "--against", REPO, "--device", "cpu",
         "--shape", "64x32x300", "--k", "4", "--calls", "2", "--method", "replay,logprobs,ce,grpo,forward"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [row[1].strip().split()[0] for row in rows] == ["replay", "replay", "logprobs", "logprobs", "ce", "ce",
                                                           "grpo", "grpo", "forward", "forward"]
    assert out.stdout.count("dX apart 0.0e+00, dW apart 0.0e+00") == 4, out.stdout
    assert out.stdout.count("forward: log-probs apart 0.0e+00") == 1, out.stdout


def test_host_time_alternates_methods_in_rounds(tmp_path, monkeypatch):
    """tools/host_time.py --alternate: a round of each method in turn, the order reversed every
    other round, each method's figures the medians of its own rounds; without it, one method's
    rounds after another's."""
    host_time = tools_module("host_time")
    order = []

    def maker(name):
        def make(*args):
            step = lambda: None  # noqa: E731
            step.name = name
            return step
        return make

    def measure(step, device, rounds, calls):
        order.append((step.name, rounds))
        return (len(order), 2.0 * len(order), 3.0)

    monkeypatch.setattr(host_time, "MAKERS", {"a": maker("a"), "b": maker("b")})
    monkeypatch.setattr(host_time, "measure", measure)
    out = tmp_path / "alternate.json"
    host_time.main(["--device", "cpu", "--shape", "8x4x10", "--impls", "a,b", "--alternate", "--rounds", "3",
                    "--json", str(out)])
    assert order == [("a", 1), ("b", 1), ("b", 1), ("a", 1), ("a", 1), ("b", 1)]
    figures = json.loads(out.read_text())
    assert figures["alternate"] and figures["methods"]["a"]["back_to_back_us"] == 4  # median of 1, 4, 5
    assert figures["methods"]["b"]["from_idle_us"] == 6  # median of 2, 3, 6 (x 2)
    order.clear()
    host_time.main(["--device", "cpu", "--shape", "8x4x10", "--impls", "a,b", "--rounds", "3"])
    assert order == [("a", 3), ("b", 3)]


def test_host_time_runs_at_tp2_on_cpu(tmp_path):
    """tools/host_time.py --tp 2 under torchrun (gloo on the CPU; NCCL on GPUs: docs/benchmarks.md's
    TP = 2 A/B): every rank runs the TP methods on its vocab shard, rank 0 prints their figures and
    writes the JSON."""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
         os.path.join(REPO, "tools", "host_time.py"), "--tp", "2", "--device", "cpu", "--shape", "32x16x50",
         "--rounds", "1", "--calls", "2", "--json", str(tmp_path / "t.json")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "32x16x50 per rank, TP = 2 on CPU" in out.stdout, out.stdout
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["ours_fwd", "ours_ce", "ours_logprobs", "ours_grpo"], out.stdout
    assert all(len(row) == 4 and all(float(x) > 0 for x in row[1:]) for row in rows)
    assert set(json.load(open(tmp_path / "t.json"))["methods"]) == {"ours_fwd", "ours_ce", "ours_logprobs", "ours_grpo"}


def test_profile_op_runs_on_cpu():
    """tools/profile_op.py (how docs/benchmarks.md's per-kernel figures were taken) on the CPU:
    every path of the op runs under the profiler and lists its ops."""
    paths = "ce,logprobs,ce_lean,logprobs_lean,fwd,grpo"
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "profile_op.py"), "--device", "cpu", "--shape", "64x32x100",
         "--paths", paths, "--reps", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    headers = [line for line in out.stdout.splitlines() if line.startswith("== ")]
    assert [h.split(":")[0][3:] for h in headers] == paths.split(","), out.stdout[-2000:]
    assert all("ms per call, CPU ops" in h for h in headers)
    assert "aten::" in out.stdout  # the ops of each call, by self time


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

    out = _benchmark("--quick", "--impls", "floor,floor_fwd,torch_eager,ours_ce,ours_fwd,ours_fwd_fused", "--sweep", "",
                     "--spreads", "random", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {"floor", "floor_fwd", "torch_eager", "ours_ce@auto", "ours_fwd@auto", "ours_fwd_fused@auto"}
    assert all("ms" in r for r in rows.values()), rows
    assert rows["ours_ce@auto"]["err_dx"] < 2e-2 and rows["ours_fwd@auto"]["err_logprobs"] < 2e-2
    assert rows["ours_fwd_fused@auto"]["err_logprobs"] < 2e-2
    assert "### Summary, random logits" in (tmp_path / "results.md").read_text()


def test_benchmark_paired_floor_on_cpu(tmp_path):
    """`--paired-floor`: every row but the floors is timed in alternation with its own floor, the
    3-GEMM one for forward + backward rows and the 1-GEMM one for forward-only rows, and its x floor
    is against those floor times (not the shape's floor row, timed at another moment)."""
    out = _benchmark("--quick", "--impls", "floor,floor_fwd,ours_ce,ours_fwd", "--sweep", "", "--spreads", "random",
                     "--paired-floor", "--steady-ms", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert not rows["floor"].get("floor_paired") and rows["floor"]["x_floor"] == 1.0
    for impl in ("ours_ce@auto", "ours_fwd@auto"):
        r = rows[impl]
        assert r["floor_paired"] and len(r["floor_times_ms"]) == len(r["times_ms"]) >= 2, r
        assert r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
    assert "timed in alternation" in (tmp_path / "results.md").read_text()


def test_paired_timing_alternates_a_row_with_the_floor_of_its_kind():
    """measure.time_paired calls floor, row, floor, row, ... (warm-up and steady phase included), and
    run.run_one pairs a forward-only row with the 1-GEMM floor, a forward + backward row with the
    3-GEMM floor."""
    import argparse

    measure, run = tools_module("bench.measure"), tools_module("bench.run")
    calls = []

    def stub(name):
        def step():
            calls.append(name)
            return None
        return step

    ms, times, floor_ms, floor_times = measure.time_paired(stub("row"), stub("floor"), 2, 3, 5, 0.0)
    assert calls == ["floor", "row"] * 5 and len(times) == len(floor_times) == 3
    args = argparse.Namespace(warmup=1, min_reps=2, max_reps=2, budget_ms=0.0, steady_ms=0.0)
    h = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(40, 8, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 40, (16,))
    for name, floor in (("ours_fwd", "floor_fwd"), ("ours_ce", "floor")):
        calls.clear()
        row = run.run_one(name, None, h, w, y, args, None, {"floor": stub("floor"), "floor_fwd": stub("floor_fwd")})
        assert calls == [floor] * 3 and row["floor_paired"], (name, calls, row.get("skipped"))


def test_benchmark_environment_on_a_cuda_machine(monkeypatch):
    """The results' environment where CUDA is available (its GPU-only entry, whether QuACK's row
    kernel is on, asked the way cute_backend answers it): recorded, no exception."""
    import types

    from megatron_fused_ce.ops.backends import cute_backend

    report = tools_module("bench.report")
    monkeypatch.setattr(cute_backend, "ENABLED", True)  # (whatever MEGATRON_FUSED_CE_CUTE says here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(multi_processor_count=132, total_memory=2**30))
    for available in (False, True):
        monkeypatch.setattr(cute_backend, "_available", lambda device: available)
        assert report.environment()["cute_row_kernel"] is available


def test_benchmark_tensor_parallel_runs_on_cpu(tmp_path):
    """tools/benchmark.py --tp 2 (what the GPU check runs at TP = the visible GPU count) on two
    gloo processes: per-rank rows against the fp32 reference, the scaling table, the files.
    (The Megatron rows are left out: importing megatron-core would double the test's time.)"""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(REPO, "tools", "benchmark.py"), "--tp", "2", "--device", "cpu", "--quick",
         "--impls", "floor,ours_ce,ours_logprobs", "--chunks", "auto", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    results = json.loads((tmp_path / "tp2_results.json").read_text())
    rows = {r["impl"]: r for r in results["rows"]}
    assert {"floor", "ours_ce@auto", "ours_logprobs@auto"} <= set(rows), sorted(rows)
    for name in ("ours_ce@auto", "ours_logprobs@auto"):
        assert rows[name]["ms"] > 0 and rows[name]["err_dx"] < 2e-2, rows[name]
    assert any(s["method"].startswith("ours_ce") for s in results["scaling"]), results["scaling"]
    assert "### TP=2: N=48, H=32, V=500" in (tmp_path / "tp2_results.md").read_text()


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


def _real_loop_tool():
    return tools_module("real_loop_curves")


def test_real_loop_wrapper_passes_its_arguments(tmp_path):
    """tools/real_loop_curves.sh hands the preset, the folders from the environment and the rest
    of its arguments to tools/real_loop_curves.py (--help: parsed, nothing run)."""
    out = subprocess.run(["bash", os.path.join(REPO, "tools", "real_loop_curves.sh"), "tiny", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "o")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: real_loop_curves.py" in out.stdout and "--stages" in out.stdout


def test_real_loop_tool_names_what_to_install(tmp_path, monkeypatch, capsys):
    """Without megatron.training (megatron-core < 0.19) the tool says what to install and starts
    nothing: exit status 2, no dataset built."""
    tool = _real_loop_tool()
    monkeypatch.setattr(tool, "REQUIREMENTS", (("megatron_fused_ce_no_such_module", '"megatron-core>=0.19"'),
                                               ("json", "json")))
    assert tool.main(["--preset", "tiny", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "pip install" in err and '"megatron-core>=0.19"' in err and "json" not in err
    assert not (tmp_path / "w").exists()


def test_real_loop_tool_stages_and_megatron_log(tmp_path, monkeypatch):
    """tools/real_loop_curves.py (GPU only otherwise) with a stand-in training script: each stage
    starts the runs it should with the flags megatron-core 0.19 can resume (weights only under the
    distributed optimizer, the whole state under the non-distributed one), recovers each step's
    own loss from Megatron's mean-of-two second line, and compares every resume with its writer."""
    import json

    tool = _real_loop_tool()
    script = tmp_path / "fake_pretrain.py"
    script.write_text(FAKE_MEGATRON_LM)
    monkeypatch.setattr(tool, "SCRIPT", script)
    monkeypatch.setattr(tool, "full_optimizer_resume_possible", lambda: False)
    monkeypatch.setattr(tool, "missing_requirements", lambda: [])  # megatron-core >= 0.19 stands in
    monkeypatch.setattr(tool, "add_datasets_makefile", lambda: None)
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


def test_real_loop_te_stack_arguments():
    """--stack te: Megatron-LM's default stack (TE layers, gradient-accumulation fusion on, bf16,
    the distributed optimizer, no per-token loss), without the local stack's --no-* flags."""
    tool = _real_loop_tool()
    p = tool.PRESETS["full"]
    te = tool.model_args(p, tool.Path("/d"), 10, stack="te")
    local = tool.model_args(p, tool.Path("/d"), 10)
    assert te[te.index("--transformer-impl") + 1] == "transformer_engine"
    assert {"--bf16", "--use-distributed-optimizer"} <= set(te)
    for flag in ("--no-gradient-accumulation-fusion", "--calculate-per-token-loss", "--ckpt-format",
                 "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm"):
        assert flag not in te, flag
    assert local[local.index("--transformer-impl") + 1] == "local"
    assert "--no-gradient-accumulation-fusion" in local and "--ckpt-format" in local


def test_real_loop_old_code_runs_side_by_side(tmp_path, monkeypatch):
    """--old-code: the pair run again with an older checkout's package code (this version's
    example script copied beside it, PYTHONPATH naming it instead of this checkout), all four runs
    side by side one GPU each, and the summary compares each pair and the two unfused runs."""
    tool = _real_loop_tool()
    script = tmp_path / "fake_pretrain.py"
    script.write_text(FAKE_MEGATRON_LM + "import os\nprint('SCRIPT=' + os.path.abspath(__file__))\n"
                      "print('PYTHONPATH=' + os.environ.get('PYTHONPATH', ''))\n"
                      "print('CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', '-'))\n")
    monkeypatch.setattr(tool, "SCRIPT", script)
    monkeypatch.setattr(tool, "missing_requirements", lambda: [])
    monkeypatch.setattr(tool, "add_datasets_makefile", lambda: None)
    monkeypatch.setitem(tool.PRESETS, "test", dict(tool.PRESETS["tiny"], iters=40))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site", REPO]))
    old = tmp_path / "old_checkout"
    (old / "megatron_fused_ce" / "megatron").mkdir(parents=True)
    (old / "megatron_fused_ce" / "__init__.py").write_text("")
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "data").mkdir(parents=True)
    (work / "data" / "dataset.json").write_text(json.dumps({"files": 1, "tokens": 10, "vocab_size": 300}))
    assert tool.main(["--preset", "test", "--work", str(work), "--out", str(out), "--stages", "main",
                      "--stack", "te", "--old-code", str(old), "--parallel", "--gpus", "4",
                      "--no-save"]) == 0
    logs = {name: (work / "logs" / f"{name}.log").read_text()
            for name in ("fused", "unfused", "old_fused", "old_unfused")}
    tree = work / "old_code"
    assert (tree / "megatron_fused_ce" / "megatron" / "grad_accum_fusion.py").exists()
    for i, (name, log) in enumerate(logs.items()):
        command = log.splitlines()[0]
        assert "--transformer-impl transformer_engine" in command
        assert "--no-gradient-accumulation-fusion" not in command and "--save " not in command
        assert ("--use-linear-ce-fusion-loss" in command) == (name.split("_")[-1] == "fused")
        assert f"CUDA_VISIBLE_DEVICES={i}" in log
        paths = log.split("PYTHONPATH=")[1].splitlines()[0].split(os.pathsep)
        if name.startswith("old_"):
            assert f"SCRIPT={tree / 'examples' / script.name}" in log
            assert paths[0] == str(tree) and REPO not in paths and "/tmp/site" in paths
        else:
            assert f"SCRIPT={script}" in log and paths[0] == REPO
    summary = json.loads((out / "real_loop_summary.json").read_text())
    assert summary["stack"] == "te" and summary["old_code"]["tree"] == str(tree)
    comparisons = summary["comparisons"]
    for pair in ("fused vs unfused", "old_fused vs old_unfused"):
        c = comparisons[f"{pair} (lm loss)"]
        assert c["steps"] == 40 and abs(c["max_abs_diff"] - 2e-5) < 1e-9
        assert abs(c["max_abs_diff_steps_1_30"] - 2e-5) < 1e-9 and abs(c["mean_abs_diff"] - 2e-5) < 1e-9
        assert abs(c["mean_last_50_diff"] - 2e-5) < 1e-9
    assert comparisons["unfused vs old_unfused (lm loss)"]["max_abs_diff"] == 0.0
    md = (out / "real_loop.md").read_text()
    assert "te stack" in md and "| old_fused vs old_unfused (lm loss) | 40 |" in md


def test_real_loop_old_code_from_a_git_revision(tmp_path, monkeypatch):
    """--old-code REV: the package files of that revision (git archive), the stand-in and the
    example script of this version beside them."""
    if subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    tool = _real_loop_tool()
    tree, label = tool.prepare_old_code("HEAD", tmp_path)
    assert label and (tree / "megatron_fused_ce" / "megatron" / "output_layer.py").exists()
    assert (tree / "examples" / tool.SCRIPT.name).read_text() == tool.SCRIPT.read_text()
    launch = tool.old_code_launch(tree, {"PYTHONPATH": os.pathsep.join([REPO, "/x"])})
    assert launch["env"]["PYTHONPATH"] == os.pathsep.join([str(tree), "/x"])


# ------------------------------------------------------------------------------------------------
# tools/e2e_seqlen.py: its main() on forked gloo ranks, as torchrun would start it
# ------------------------------------------------------------------------------------------------
E2E_TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "1000", "--seqs", "32,64",
            "--steps", "3", "--modes", "fused,unfused,megatron", "--device-memory-limit-gb", "0",
            "--sgd-lr", "1.0", "--simulate-oom-tokens", "32"]


def e2e_worker(rank, world, argv):
    """Loaded here, not at the test module's import: the tool sets PYTORCH_CUDA_ALLOC_CONF for
    its own process."""
    spec = importlib.util.spec_from_file_location("e2e_seqlen_tool", os.path.join(REPO, "tools", "e2e_seqlen.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU; on GPUs tools/gpu_check.sh "
                                                      "runs the tool over NCCL")
def test_e2e_seqlen_tp2_sequence_parallel_matches_tp1(tmp_path):
    """The end-to-end tool on CPU at TP=1 and at TP=2 with sequence parallelism (the local spec,
    its norms made SP-capable), every mode: the losses of three steps with SGD updates between
    them equal TP=1's (so the norms' gradients were reduced over the TP ranks), fused equals unfused,
    Megatron's own loss (softmax over the padded vocab) sits near log(padded / true vocab) above
    them, and the simulated OOM stops every mode at the length above the limit."""
    from dist import run_workers

    (tp1,) = run_workers(e2e_worker, 1, E2E_TINY + ["--out", str(tmp_path / "tp1")], timeout=120)
    tp2 = run_workers(e2e_worker, 2, E2E_TINY + ["--tp", "2", "--out", str(tmp_path / "tp2")],
                      timeout=120)
    meta = tp2[0]["meta"]
    assert (meta["tp"], meta["sequence_parallel"], meta["spec"]) == (2, True, "local")
    assert (tp1["meta"]["tp"], tp1["meta"]["sequence_parallel"]) == (1, False)
    written = json.loads((tmp_path / "tp2" / "e2e_seqlen.json").read_text())
    assert written["summary"] == tp2[0]["summary"]
    assert "TP 2 + sequence parallel" in (tmp_path / "tp2" / "e2e_seqlen.md").read_text()
    for mode in ("fused", "unfused", "megatron"):
        for report in (tp1, tp2[0]):
            runs = report["results"][mode]
            assert runs["32"]["ok"], (mode, runs)
            assert not runs["64"]["ok"] and "simulated" in runs["64"]["error"]
            assert report["summary"]["longest_fitting_seq"][mode] == 32
        one, two = tp1["results"][mode]["32"]["losses"], tp2[0]["results"][mode]["32"]["losses"]
        assert one[1] < one[0] - 1e-3, (mode, one)  # a backward ran and the SGD step changed the model
        # (without the norms' TP all-reduce, the third step's loss moves by ~1e-2)
        assert max(abs(a - b) for a, b in zip(one, two)) < 2e-5, (mode, one, two)
    for report in (tp1, tp2[0]):
        comparisons = report["summary"]["comparisons"]
        assert comparisons["fused_vs_unfused"]["max_abs_loss_diff_first_step"] < 1e-4
        padding = math.log(1024 / 1000)
        assert 0.3 * padding < comparisons["fused_vs_megatron"]["max_abs_loss_diff_first_step"] < 3 * padding


def test_rl_curves_seed_groups_give_mean_and_spread_per_window(tmp_path):
    """GROUP/SEED labels (docs/rl.md's runs over seeds): per group and window of steps, the mean
    over seeds and the lowest and highest seed, over the steps every run of the groups logged."""
    paths = {}
    for name, rewards in {"a1": [0.1, 0.3, 0.5, 0.7, 0.9], "a2": [0.3, 0.5, 0.7, 0.9, 1.0],
                          "b1": [0.2, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8]}.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("\n".join(json.dumps({"step": i, "reward": r}) for i, r in enumerate(rewards)) + "\n")
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "rl_curves.py"), f"A/1={paths['a1']}",
                          f"A/2={paths['a2']}", f"B/1={paths['b1']}", "--window", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    groups = out.stdout.split("\n\n")[1].splitlines()
    assert groups[0] == "| group | seeds | steps 0-1 | steps 2-3 |"  # 5 common steps: two whole windows
    assert groups[2] == "| A | 1, 2 | 0.300 (0.200-0.400) | 0.700 (0.600-0.800) |"
    assert groups[3] == "| B | 1 | 0.200 (0.200-0.200) | 0.400 (0.400-0.400) |"


def test_rl_curves_policy_statistics_of_grpo_runs(tmp_path):
    """GRPO logs (ratio_mean, clip_ratio, kl per step) get a table of their means over the run's
    steps: how docs/rl.md measures the ratio's bias of plain-softmax trainer log-probs."""
    grpo = tmp_path / "grpo.jsonl"
    grpo.write_text("\n".join(json.dumps({"step": i, "reward": 0.5, "ratio_mean": r, "clip_ratio": c, "kl": k})
                              for i, (r, c, k) in enumerate([(0.97, 0.004, 0.01), (0.99, 0.002, 0.03)])) + "\n")
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"step": 0, "reward": 0.3, "loss": 2.0}) + "\n")
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "rl_curves.py"), f"G={grpo}", f"S={sft}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    policy = out.stdout.strip().split("\n\n")[-1].splitlines()
    assert policy[0] == "| run | steps | mean policy ratio | clip fraction | KL to the reference |"
    assert policy[2:] == ["| G | 2 | 0.9800 | 0.00300 | 0.0200 |"]  # (the SFT run logs no ratio)


def test_rl_curves_table_from_log_jsonl(tmp_path):
    """tools/rl_curves.py (docs/rl.md's GPU tables and curves) reads the examples' --log-jsonl:
    the first-3 / last-5 reward means, the first step at the target (SFT and DPO log a reward only
    at their evaluations), and a clear error for a PNG without matplotlib or a missing file."""
    grpo = tmp_path / "grpo.jsonl"
    grpo.write_text("\n".join(json.dumps({"step": i, "reward": r, "accuracy": r / 2, "kl": 0.01})
                              for i, r in enumerate([0.2, 0.4, 0.6, 0.8, 0.95, 0.9, 0.7, 1.0])) + "\n")
    dpo = tmp_path / "dpo.jsonl"
    dpo.write_text("\n".join(json.dumps({"step": i, "loss": 1.0, **({"reward": 0.5, "accuracy": 0.25} if i % 5 == 0 else {})})
                             for i in range(11)) + "\n")
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "rl_curves.py"),
                          f"GRPO run={grpo}", f"DPO run={dpo}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.stdout.splitlines()[2:]}
    assert rows["GRPO run"] == ["8", "0.400", "0.870", "1.000", "4", "0.500"]
    assert rows["DPO run"] == ["11", "0.500", "0.500", "0.500", "-", "0.250"]
    missing = subprocess.run([sys.executable, os.path.join(REPO, "tools", "rl_curves.py"), f"x={tmp_path}/none.jsonl"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    if importlib.util.find_spec("matplotlib") is None:
        png = subprocess.run([sys.executable, os.path.join(REPO, "tools", "rl_curves.py"), f"GRPO run={grpo}",
                              "--png", str(tmp_path / "c.png")], capture_output=True, text=True, timeout=60)
        assert png.returncode != 0 and "needs matplotlib" in png.stderr and ".[plot]" in png.stderr
