"""tools/gpu_check.sh (the GPU check) on the CPU: its dry run prints every stage's commands for the
GPU count it is given, a real run of its env stage leaves the logs its summary reads, and the
summary (tools/gpu_check_report.py) turns synthetic logs of every kind of step into one table.
Also: every tool under tools/ has a CPU test here or in tests/test_tools.py and a step in the
check, so that none goes unrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "gpu_check.sh"
STAGES = ["env", "tests", "cute", "multigpu", "pretrain", "examples", "real_loop", "tools", "bench", "bench_rl", "summary"]


def gpu_check(*args, env=None, timeout=120):
    # (the script's own settings from the caller's environment left out: a shell running the check
    # with GPU_CHECK_TEST_SHARDS or GPU_CHECK_OUT set runs this test as it runs anywhere)
    outer = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=dict(outer, PYTHON=sys.executable, **(env or {})))


def dry_run(gpus, *stages, out):
    result = gpu_check("--dry-run", "--gpus", str(gpus), "--out", str(out), *stages)
    assert result.returncode == 0, result.stderr
    steps = {}  # name -> (stage, time limit, command or "skipped: ...", side by side)
    for line in result.stdout.splitlines():
        m = re.match(r"\[(\w+)\] (\w+) \(limit (\d+)s(, side by side)?\): (.*)$", line)
        if m:
            steps[m.group(2)] = (m.group(1), int(m.group(3)), m.group(5), bool(m.group(4)))
        elif (m := re.match(r"\[(\w+)\] (\w+): skipped \((.*)\)$", line)):
            steps[m.group(2)] = (m.group(1), None, "skipped: " + m.group(3), False)
    return result.stdout, steps


def stage_limits(steps):
    """Each stage's longest possible run: its steps one after the other, those side by side at once."""
    one_by_one, side_by_side = {}, {}
    for stage, limit, _, parallel in steps.values():
        table = side_by_side if parallel else one_by_one
        table[stage] = (max if parallel else sum)((table.get(stage, 0), limit or 0))
    return {stage: one_by_one.get(stage, 0) + side_by_side.get(stage, 0)
            for stage in set(one_by_one) | set(side_by_side)}


def test_dry_run_on_four_gpus(tmp_path):
    """Every stage, its commands for 4 GPUs (the README's main job at TP 2 x PP 2, the NCCL suites
    and the tools at 4 ranks, each example with its GPU config where one exists), each stage
    within ten minutes of time limits, and nothing created."""
    out, steps = dry_run(4, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    per_stage = stage_limits(steps)
    assert set(per_stage) == set(STAGES) - {"summary"}, per_stage
    assert all(total <= 600 for total in per_stage.values()), per_stage
    torchrun = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 4"
    # the suite's files, each in exactly one of the shards run side by side
    shards = [command for name, (_, _, command, parallel) in steps.items() if name.startswith("tests_")]
    assert len(shards) == 8 and all(steps[f"tests_{i}"][3] for i in range(1, 9))
    files = []
    for command in shards:
        m = re.fullmatch(re.escape(sys.executable) + r" -m pytest ((?:tests/test_\w+\.py ?)+) -q -p no:cacheprovider",
                         command)
        assert m, command
        files += m.group(1).split()
    assert sorted(files) == sorted(f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py"))
    # QuACK's paths: their tests in a step of their own (the extra imports only on GPU machines)
    assert steps["cute_tests"][2] == (f"{sys.executable} -m pytest tests/test_cute_backend.py "
                                      "tests/test_cuda_steady_state.py -q -p no:cacheprovider")
    # every NCCL suite file once (the shell's glob orders them by the locale's collation)
    multigpu = steps["multigpu"][2]
    assert multigpu.startswith(f"{torchrun} -m pytest tests/test_multigpu"), multigpu
    assert sorted(w for w in multigpu.split() if w.startswith("tests/")) == \
        sorted(f"tests/{p.name}" for p in (REPO / "tests").glob("test_multigpu*.py"))
    assert steps["multigpu"][2].endswith("-m multigpu -q -p no:cacheprovider")
    assert steps["pretrain"][2] == f"{torchrun} examples/pretrain_gpt.py --tp 2 --pp 2 --compare-unfused"
    for name in ("sft", "dpo", "grpo"):
        gpu = REPO / "examples" / "configs" / f"{name}_gpu.yaml"
        config = f"examples/configs/{name}_gpu.yaml" if gpu.exists() else f"examples/configs/{name}.yaml"
        assert steps[f"examples_{name}"][2] == (f"{torchrun} examples/{name}.py --config {config} --steps 5 "
                                                f"--tp 2 --compare-unfused --log-jsonl {tmp_path}/out/examples_{name}.jsonl")
    assert "--tensor-model-parallel-size 2 " in steps["examples_megatron_lm"][2]
    assert "tools/real_loop_curves.sh tiny" in steps["real_loop"][2]
    assert steps["tools_e2e_seqlen"][2].startswith(f"{torchrun} tools/e2e_seqlen.py --tp 4 ")
    assert "--modes fused,unfused,megatron" in steps["tools_e2e_seqlen"][2]
    assert steps["bench_tp"][2].startswith(f"{torchrun} tools/benchmark.py --tp 4 ")
    assert f"[summary] {sys.executable} tools/gpu_check_report.py summary {tmp_path / 'out'}" in out


def test_dry_run_on_one_gpu_skips_what_needs_several(tmp_path):
    out, steps = dry_run(1, "multigpu", "pretrain", "examples", "bench", out=tmp_path)
    assert set(stage_limits(steps)) == {"multigpu", "pretrain", "examples", "bench"}
    assert steps["multigpu"][2].startswith("skipped: needs 2 or more GPUs")
    assert steps["bench_tp"][2].startswith("skipped")
    assert steps["pretrain"][2].endswith("examples/pretrain_gpt.py --compare-unfused")
    assert "--tp " not in out and "--pp " not in out and "--nproc_per_node 1 " in out
    assert "--tensor-model-parallel-size 1 " in steps["examples_megatron_lm"][2]


def test_bad_stage_or_option_is_refused(tmp_path):
    for args in (["--dry-run", "nonsense"], ["--dry-run", "--no-such-option"]):
        result = gpu_check(*args, "--out", str(tmp_path))
        assert result.returncode == 2 and "gpu_check: unknown" in result.stderr


def test_env_stage_runs_and_the_summary_reads_it(tmp_path):
    """A real (not dry) run of the env stage on this machine, then the summary: the step's log,
    status and place in steps.txt, and its line in the table."""
    result = gpu_check("--gpus", "1", "--out", str(tmp_path), "env", "summary")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "steps.txt").read_text().split() == ["env"]
    status = (tmp_path / "env.status").read_text()
    assert "stage=env" in status and "rc=0" in status
    assert "GPUs: " in (tmp_path / "env.log").read_text()
    table = (tmp_path / "summary.md").read_text()
    assert re.search(r"^\| env \| env \| pass \| \d+ s \| .*torch ", table, re.M), table
    assert table in result.stdout


def test_cute_stage_is_skipped_with_its_reason_where_the_extra_does_not_import(tmp_path):
    """Without quack-kernels and nvidia-cutlass-dsl (every CPU machine) the QuACK stage runs no
    tests and says why in the table, rather than passing as if it had checked those paths."""
    if subprocess.run([sys.executable, "-c", "import quack, cutlass"], capture_output=True).returncode == 0:
        pytest.skip("the cute extra imports here: the stage runs its tests")
    result = gpu_check("--gpus", "1", "--out", str(tmp_path), "cute", "summary")
    assert result.returncode == 0, result.stdout + result.stderr
    status = (tmp_path / "cute_tests.status").read_text()
    assert "stage=cute" in status and "rc=skip" in status and "reason=the cute extra does not import" in status
    table = (tmp_path / "summary.md").read_text()
    assert re.search(r"^\| cute \| cute_tests \| skip", table, re.M), table


# ------------------------------------------------------------------------------------------------
# The summary from synthetic logs
# ------------------------------------------------------------------------------------------------
LOGS = {
    "env": ("env", "0", "GPUs: 4 x NVIDIA H100 80GB HBM3; python 3.12.3, torch 2.11.0, triton 3.6.0, "
                        "megatron-core 0.19.2\nCUDA 13.0, NCCL 2.27.7\n"),
    "tests_1": ("tests", "0", "........s.....\n312 passed, 41 skipped, 3 warnings in 401.22s (0:06:41)\n"),
    "tests_2": ("tests", "1", "..F.s [ 50%]\n..... [100%]\n=== FAILURES ===\nE  AssertionError\n"
                              "=== short test summary info ===\nFAILED tests/test_a.py::test_x[sft] - Asser...\n"
                              "FAILED tests/test_b.py::test_y\n2 failed, 180 passed, 8 skipped in 305.88s (0:05:05)\n"),
    "tests_3": ("tests", "124", "FFFF...FF........ [ 37%]\n.....F\n"),
    "multigpu": ("multigpu", "0", "".join(f"[rank{r}]: 58 passed, 12 skipped in 210.01s\n" for r in range(4))),
    "pretrain": ("pretrain", "0",
                 "pretrain: world 4 = TP 2 x PP 2 x DP 1 on CUDA/NCCL; ...\n"
                 "first batch, lm loss: fused 6.918660 vs unfused 6.918661, |difference| 1.19e-06 "
                 "(relative 1.7e-07); output layer + loss, peak tensor memory: fused 1.06 MiB vs unfused 5.01 MiB\n"
                 "\rpretrain:  50%|#####     | 10/20 [00:02<00:02, 5.1it/s, lm loss=6.1234, tok/s=900, loss_mem=1.06MiB]"
                 "\rpretrain: 100%|##########| 20/20 [00:04<00:00, 5.2it/s, lm loss=4.5678, tok/s=950, loss_mem=1.06MiB]\n"),
    "examples_grpo": ("examples", "1", "step 0 ...\nTraceback (most recent call last):\n  File \"x.py\"\n"
                                       "ValueError: global_batch_size 24 must split into DP=2 ranks\n"),
    "examples_rl_curves": ("examples", "0",
                           "| run | steps | reward, first 3 | reward, last 5 | best | first step ≥ 0.9 | last accuracy |\n"
                           "|---|---:|---:|---:|---:|---:|---:|\n| sft | 5 | 0.066 | 0.070 | 0.071 | - | 0.000 |\n"
                           "| grpo | 5 | 0.000 | 0.002 | 0.007 | - | 0.000 |\n\n"
                           "| run | steps | mean policy ratio | clip fraction | KL to the reference |\n"
                           "|---|---:|---:|---:|---:|\n| grpo | 5 | 1.0063 | 0.01821 | 6.4416 |\n"),
    "examples_megatron_lm": ("examples", "0",
                             "first batch: lm loss fused 6.900000 vs unfused 6.900001, |difference| 1.00e-06\n"
                             "iteration 1/20: lm loss 6.9000 | mtp_1 loss 6.9100\n"
                             "iteration 20/20: lm loss 3.2100 | mtp_1 loss 3.4500\n"),
    "real_loop": ("real_loop", "124", "dataset ready\n[fused] rc=0 wall 80s steps 30 last lm loss 6.1 peak 1.2 GiB\n"
                                      "still running\n"),
    "tools_e2e_seqlen": ("tools", "0",
                         "- fused: longest fitting sequence 8192 (no OOM up to the largest length tried)\n"
                         "- unfused: longest fitting sequence 8192 (no OOM up to the largest length tried)\n"
                         "- fused_vs_unfused: sequence-length ratio 1.00x (undetermined: ...)\n"
                         "- fused_vs_unfused: tokens/s ratio at 8192 (largest both fit) 1.183; max |loss "
                         "difference| at step 0 over common lengths 2.861e-06\n"),
    "tools_profile_op": ("tools", "0", "\n== ce: 38.80 ms per call, GPU kernels 35.40 ms (91 % busy)\n"
                                       "  17.0 ms  nvjet_gemm\n== fwd: 12.90 ms per call, GPU kernels 12.10 ms (94 % busy)\n"),
    "tools_host_sync_cost": ("tools", "0", "ce: 1 synchronizing call(s) per forward + backward\n"
                                           "8192x4096x128256 cuda: floor 35.8 ms, ce 37.6 ms, ce_preloaded 37.1 ms, "
                                           "ce_back_to_back 37.0 ms\n"),
    "tools_host_time": ("tools", "0", "2048x4096x19008 on NVIDIA H200, µs a call (medians)\n"
                                      "method          back to back  from idle     host\n"
                                      "floor_fwd                431        525       36\n"
                                      "ours_ce                 1521       1746     1334\n"),
    "tools_main_grad_loss_scale": ("tools", "0", "cuda, bfloat16, N x H x V = 8192 x 2048 x 65536, impl=auto\n"
                                                 "| loss | g | grad | main_grad | main_grad_expected |\n|---|---|---|---|---|\n"
                                                 "| ce | 1 | 1.10e-03 | 1.00e-03 | 1.00e-03 |\n"
                                                 "| grpo | 1e-05 | 2.30e-03 | 1.00e-03 | 1.20e-03 |\n"),
    "tools_sampling_mask_bench": ("tools", "0", "device: NVIDIA H100 80GB HBM3, torch 2.11.0, chunk_size auto\n"
                                                "| shape NxHxV | sets | K | K / V | route | plain ms | replay ms | "
                                                "replay / plain | target | lp err |\n|---|---|---|---|---|---|---|---|---|---|\n"
                                                "| 8192x4096x128256 | zipf | 50 | 0.0004 | sparse | 48.10 | 9.60 | 0.200 | "
                                                "<= 0.25x ok | 2.1e-03 |\n"
                                                "| 8192x4096x128256 | zipf | 512 | 0.0040 | dense | 48.10 | 30.20 | 0.628 | "
                                                "<= 0.8x ok | 2.3e-03 |\nevery row met its target\n"),
    "tools_make_text_dataset": ("tools", "0", "40 files (1.2 MB) from /usr/lib/python3.12: 345678 tokens, vocab 512 "
                                              "(<|endoftext|> = 0), 8.1 s -> /o/text_document.bin/.idx\n"),
    "bench_one_gpu": ("bench", "0", "(tables)\n"),
    "bench_tp": ("bench", "skip", "skipped: tensor parallelism needs 2 or more GPUs\n"),
}


def write_step(out: Path, name, stage, rc, log, seconds=12):
    with open(out / "steps.txt", "a") as f:
        f.write(name + "\n")
    (out / f"{name}.log").write_text(f"$ the command of {name}\n" + log)
    lines = [f"stage={stage}", f"rc={rc}", f"seconds={seconds}", "limit=570"]
    if rc == "skip":
        lines.append("reason=" + log.split(": ", 1)[1].strip())
    (out / f"{name}.status").write_text("\n".join(lines) + "\n")


def test_summary_table_from_synthetic_logs(tmp_path):
    from importlib import util

    spec = util.spec_from_file_location("gpu_check_report", REPO / "tools" / "gpu_check_report.py")
    report = util.module_from_spec(spec)
    spec.loader.exec_module(report)
    for name, (stage, rc, log) in LOGS.items():
        write_step(tmp_path, name, stage, rc, log)
    (tmp_path / "bench_one_gpu").mkdir()
    (tmp_path / "bench_one_gpu" / "results.json").write_text(json.dumps({"rows": [
        {"impl": "floor", "section": "shapes", "N": 8192, "H": 4096, "V": 128256, "x_floor": 1.0},
        {"impl": "torch_compile", "section": "shapes", "N": 8192, "H": 4096, "V": 128256, "x_floor": 1.058},
        {"impl": "ours_ce@auto", "section": "shapes", "N": 8192, "H": 4096, "V": 128256, "x_floor": 1.0423},
        {"impl": "ours_ce@auto", "section": "memory sweep", "N": 32768, "H": 4096, "V": 128256, "x_floor": 2.0}]}))
    write_step(tmp_path, "tests_1", "tests", "0", LOGS["tests_1"][2], seconds=400)  # run twice: one line, the last

    assert report.main(["summary", str(tmp_path)]) == 1  # a failure and a timeout among them
    table = (tmp_path / "summary.md").read_text().splitlines()
    assert table[:2] == ["| stage | step | result | time | key figure |", "|---|---|---|---:|---|"]
    rows = {cells[1]: cells for cells in (re.split(r" (?<!\\)\| ", line.strip("| ")) for line in table[2:])}
    assert list(rows) == list(LOGS)  # the order the steps first ran
    expected = {
        "env": ("pass", "4 x NVIDIA H100 80GB HBM3; python 3.12.3"),
        "tests_1": ("pass", "312 passed, 41 skipped"),
        "tests_2": ("FAIL", "2 failed, 180 passed, 8 skipped; first failure tests/test_a.py::test_x[sft]"),
        "tests_3": ("TIMEOUT", "over its 570 s limit; 16 passed, 7 failed, 0 skipped so far (37 % of its tests "
                               "at the last progress mark)"),
        "multigpu": ("pass", "58 passed, 12 skipped"),
        "pretrain": ("pass", r"fused vs unfused \|difference\| 1.19e-06; last step lm loss=4.5678, tok/s=950"),
        "examples_grpo": ("FAIL", "ValueError: global_batch_size 24 must split into DP=2 ranks"),
        "examples_rl_curves": ("pass", "sft reward 0.066 -> 0.070, grpo reward 0.000 -> 0.002"),
        "examples_megatron_lm": ("pass", r"fused vs unfused \|difference\| 1.00e-06; last iteration 20/20: "
                                         r"lm loss 3.2100"),
        "real_loop": ("TIMEOUT", "over its 570 s limit; fused 30 steps, lm loss 6.1"),
        "tools_e2e_seqlen": ("pass", "fused/unfused tokens/s x1.183 at 8192, \\|loss diff\\| 2.861e-06; "
                                     "longest fused 8192, unfused 8192"),
        "tools_profile_op": ("pass", "ce 38.80 ms (91 % busy), fwd 12.90 ms (94 % busy)"),
        "tools_host_sync_cost": ("pass", "8192x4096x128256 cuda: floor 35.8 ms, ce 37.6 ms"),
        "tools_host_time": ("pass", "floor_fwd 525 us (host 36), ours_ce 1746 us (host 1334)"),
        "tools_main_grad_loss_scale": ("pass", "largest relative dW error 2.30e-03 over 6 cells"),
        "tools_sampling_mask_bench": ("pass", "zipf K=50 x0.200, zipf K=512 x0.628; every row met its target"),
        "tools_make_text_dataset": ("pass", "40 files (1.2 MB) from /usr/lib/python3.12: 345678 tokens, vocab 512"),
        "bench_one_gpu": ("pass", "8192x4096x128256: ours_ce@auto 1.042, torch_compile 1.058"),
        "bench_tp": ("skip", "tensor parallelism needs 2 or more GPUs"),
    }
    for name, (result, figure) in expected.items():
        stage, step, got_result, seconds, got_figure = rows[name]
        assert (stage, got_result) == (LOGS[name][0], result), rows[name]
        assert got_figure.startswith(figure), (name, got_figure)
    # (the whole figure: a GRPO run's policy table, below the rewards, is not read as rewards)
    assert rows["examples_rl_curves"][4] == expected["examples_rl_curves"][1]
    assert rows["tests_1"][3] == "400 s" and rows["env"][3] == "12 s" and rows["bench_tp"][3] == "-"


def test_summary_without_steps_says_so(tmp_path, capsys):
    from importlib import util

    spec = util.spec_from_file_location("gpu_check_report", REPO / "tools" / "gpu_check_report.py")
    report = util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.main(["summary", str(tmp_path)]) == 1
    assert "no steps recorded" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# No tool goes unrun
# ------------------------------------------------------------------------------------------------
def tool_scripts():
    return sorted(p.name for p in (REPO / "tools").iterdir() if p.suffix in (".py", ".sh") and p.is_file())


def test_every_tool_has_a_cpu_test_and_a_step_in_the_gpu_check(tmp_path):
    """A script under tools/ that no test starts breaks unnoticed (CI has no GPU): each one is
    named by a test file and, but for the check itself, run by one of the check's steps."""
    tests = "".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    untested = [name for name in tool_scripts() if f'"{name}"' not in tests and f"tools/{name}" not in tests]
    assert not untested, f"tools without a CPU test: {untested}"
    out, _ = dry_run(2, out=tmp_path)
    unrun = [name for name in tool_scripts() if name != "gpu_check.sh"
             and f"tools/{name}" not in out and f"tools/{Path(name).stem}.sh" not in out]
    assert not unrun, f"tools the GPU check does not run: {unrun}"
