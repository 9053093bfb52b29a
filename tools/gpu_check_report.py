#!/usr/bin/env python3
"""The reports of the GPU check (tools/gpu_check.sh).

    python tools/gpu_check_report.py env              # GPUs, driver, Python and package versions
    python tools/gpu_check_report.py summary DIR      # one table from the logs the stages left in DIR

`summary` reads, for every step the check ran (DIR/steps.txt, in the order they ran; a step run
again counts once, with its last result), DIR/<step>.status (`stage=`, `rc=`, `seconds=` lines)
and DIR/<step>.log, and prints one line per step: stage, step, result (pass / FAIL / TIMEOUT /
skip), time and the step's key figure, read from its log (or from the results.json a benchmark
step wrote to DIR/<step>/). A failed step's key figure is the last error line of its log. The table
is also written to DIR/summary.md. Exit status 1 if a step failed or timed out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

# ------------------------------------------------------------------------------------------------
# env
# ------------------------------------------------------------------------------------------------
PACKAGES = (("torch", "torch"), ("triton", "triton"), ("megatron.core", "megatron-core"),
            ("transformer_engine", "transformer-engine"), ("quack", "quack-kernels"),
            ("cutlass", "nvidia-cutlass-dsl"), ("liger_kernel", "liger-kernel"),
            ("cut_cross_entropy", "cut-cross-entropy"), ("tokenizers", "tokenizers"),
            ("transformers", "transformers"))


def package_version(module: str):
    """The installed distribution's version without importing the module (Transformer Engine
    and QuACK are slow to import), else the module's __version__, else None when absent."""
    from importlib import metadata

    name = dict(PACKAGES).get(module, module)
    for candidate in (name, name.replace("-", "_")):
        try:
            return metadata.version(candidate)
        except metadata.PackageNotFoundError:
            pass
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:  # noqa: BLE001 (absent, or present and broken: either way not usable)
        return None


def env_report() -> str:
    import torch

    lines = []
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    gpus = (f"{count} x {names[0]}" if count and len(set(names)) == 1 else ", ".join(names)) or "none visible"
    versions = [f"python {platform.python_version()}"] + [
        f"{label} {version}" for module, label in PACKAGES
        if (version := package_version(module)) is not None]
    lines.append(f"GPUs: {gpus}; " + ", ".join(versions))
    if count:
        lines.append(f"CUDA {torch.version.cuda}, NCCL "
                     f"{'.'.join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, 'nccl') else '?'}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,clocks.max.sm",
                              "--format=csv"], capture_output=True, text=True, timeout=30)
        lines.append(smi.stdout.strip())
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        lines.append(topo.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        lines.append("(nvidia-smi not available)")
    return "\n".join(line for line in lines if line)


# ------------------------------------------------------------------------------------------------
# summary: key figures
# ------------------------------------------------------------------------------------------------
PYTEST_LINE = re.compile(r"((?:\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected)"
                         r"(?:, )?)+)(?:, \d+ warnings?)? in [\d.]+s")
TQDM_POSTFIX = re.compile(r"\d+/\d+ \[[^\]]*?(?:it/s|s/it|\?it/s), ([^\]]+)\]")
ERROR_LINE = re.compile(r"(Error|Exception|error:|FAILED|Traceback|Killed|exitcode)")


def pytest_counts(text):
    found = [m.group(1).rstrip(", ") for m in PYTEST_LINE.finditer(text)]
    distinct = list(dict.fromkeys(found))
    if not distinct:
        return None
    # the NCCL suites print one line per rank: the same on every rank is one figure
    return distinct[0] if len(distinct) == 1 else " / ".join(f"rank {i}: {c}" for i, c in enumerate(found))


def _compiled(pattern):
    return pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.M)


PROGRESS_LINE = re.compile(r"^([.FEsxX]+)(?: +\[ *(\d+)%\])?$", re.M)


def pytest_progress(text):
    """A pytest -q run cut short: its progress characters so far."""
    lines = PROGRESS_LINE.findall(text)
    if not lines:
        return None
    marks = "".join(chars for chars, _ in lines)
    percent = next((pct for _, pct in reversed(lines) if pct), None)
    done = f"{marks.count('.')} passed, {marks.count('F') + marks.count('E')} failed, {marks.count('s')} skipped"
    return done + " so far" + (f" ({percent} % of its tests at the last progress mark)" if percent else "")


def pytest_failure(text):
    """A finished pytest run with failures: its counts and the first failing test."""
    counts = pytest_counts(text)
    failed = first(r"^(?:\[rank\d+\]: )?FAILED (\S+)", text)
    parts = [counts] if counts else []
    if failed:
        parts.append(f"first failure {failed}")
    return "; ".join(parts) or None


def first(pattern, text, group=1):
    m = _compiled(pattern).search(text)
    return m.group(group) if m else None


def last(pattern, text, group=1):
    found = list(_compiled(pattern).finditer(text))
    return found[-1].group(group) if found else None


def training_figure(text):
    """An example's run: the first-batch fused-vs-unfused difference and its last progress line."""
    parts = []
    difference = first(r"\|difference\| (\S+?)[;,)\s]", text)
    if difference is not None:
        parts.append(f"fused vs unfused |difference| {difference}")
    postfix = last(TQDM_POSTFIX, text)
    if postfix:
        parts.append("last step " + ", ".join(item.strip() for item in postfix.split(",")[:3]))
    iteration = last(r"^iteration (\d+/\d+): (.*)$", text, 0)
    if iteration:
        parts.append("last " + iteration.strip())
    return "; ".join(parts) or None


def real_loop_figure(text):
    runs = re.findall(r"^\[(\w+)\] rc=(\S+) wall \d+s steps (\d+) last lm loss (\S+)", text, re.M)
    return ", ".join(f"{name} {steps} steps, lm loss {loss}" + ("" if rc == "0" else f" (rc {rc})")
                     for name, rc, steps, loss in runs) or None


def e2e_figure(text):
    parts = []
    m = re.search(r"^- fused_vs_unfused: tokens/s ratio at (\d+) \(largest both fit\) ([\d.]+); "
                  r"max \|loss difference\| at step 0 over common lengths (\S+)", text, re.M)
    if m:
        parts.append(f"fused/unfused tokens/s x{m.group(2)} at {m.group(1)}, |loss diff| {m.group(3)}")
    longest = re.findall(r"^- (\w+): longest fitting sequence (\S+)", text, re.M)
    if longest:
        parts.append("longest " + ", ".join(f"{mode} {seq}" for mode, seq in longest))
    return "; ".join(parts) or None


def profile_figure(text):
    calls = re.findall(r"^== (\w+): ([\d.]+) ms per call, GPU kernels [\d.]+ ms \((\d+) % busy\)", text, re.M)
    return ", ".join(f"{name} {ms} ms ({busy} % busy)" for name, ms, busy in calls) or None


def host_sync_figure(text):
    line = last(r"^\d+x\d+x\d+ \w+: .*$", text, 0)
    return ", ".join(line.split(", ")[:3]) if line else None


def host_time_figure(text):
    """tools/host_time.py: each method's time a call from an idle GPU, and the host's."""
    rows = re.findall(r"^(\w+) +\d+ +(\d+) +(\d+)$", text, re.M)
    return ", ".join(f"{name} {idle} us (host {host})" for name, idle, host in rows) if rows else None


def loss_scale_figure(text):
    """tools/main_grad_loss_scale.py's table: the largest relative dW error of all its cells."""
    cells = re.findall(r"^\| (\w+) \| [\d.e+-]+ \| (.*) \|$", text, re.M)
    errors = [float(x) for _, row in cells for x in row.split(" | ")]
    return f"largest relative dW error {max(errors):.2e} over {len(errors)} cells" if errors else None


def sampling_mask_figure(text):
    """tools/sampling_mask_bench.py: replay / plain per K, and whether every row met its target."""
    rows = re.findall(r"^\| \S+ \| (\w+) \| (\d+) \| [^|]* \| [^|]* \| [^|]* \| [^|]* \| ([\d.]+) \|", text, re.M)
    verdict = last(r"^(every row met its target|\d+ row\(s\) missed their target)$", text)
    parts = [", ".join(f"{sets} K={k} x{ratio}" for sets, k, ratio in rows)] if rows else []
    return "; ".join(parts + ([verdict] if verdict else [])) or None


def rl_curves_figure(text):
    """tools/rl_curves.py: each run's reward over its first 3 and last 5 evaluated steps."""
    # (the reward table only: a GRPO run's policy table below it has the same layout of numbers)
    rewards = text.partition("| reward, first 3 |")[2].split("\n\n")[0]
    rows = re.findall(r"^\| (\w+) \| \d+ \| ([\d.]+) \| ([\d.]+) \|", rewards, re.M)
    return ", ".join(f"{run} reward {first} -> {last}" for run, first, last in rows) or None


def dataset_figure(text):
    return first(r"^(\d+ files .*? tokens, vocab \d+)", text)


def benchmark_figure(folder: Path):
    """ours_ce against the floor (and torch.compile, QuACK where they ran) from the results JSON."""
    for path in sorted(folder.glob("*results.json")):
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = [r for r in results.get("rows", []) if r.get("x_floor") is not None
                and r.get("section", "shapes") not in ("memory sweep", "tp1")]
        if not rows:
            continue
        best = {}
        for r in rows:
            best.setdefault(r["impl"], r)
        shape = next(iter(best.values()))
        where = f"{shape.get('N')}x{shape.get('H')}x{shape.get('V')}"
        if results.get("tp"):
            where += f", TP={results['tp']}, x per-GPU floor"
        shown = [f"{impl} {best[impl]['x_floor']:.3f}" for impl in
                 ("ours_ce@auto", "ours_logprobs@auto", "torch_compile", "quack_c4096", "megatron")
                 if impl in best]
        return f"{where}: " + ", ".join(shown) if shown else None
    return None


FIGURES = {  # step name (or its prefix before "_") -> key figure of its log
    "env": lambda text, folder: first(r"^GPUs: (.*)$", text),
    "tests": lambda text, folder: pytest_counts(text),
    "cute": lambda text, folder: pytest_counts(text),
    "multigpu": lambda text, folder: pytest_counts(text),
    "pretrain": lambda text, folder: training_figure(text),
    "examples_rl_curves": lambda text, folder: rl_curves_figure(text),
    "examples": lambda text, folder: training_figure(text),
    "real_loop": lambda text, folder: real_loop_figure(text),
    "tools_e2e_seqlen": lambda text, folder: e2e_figure(text),
    "tools_profile_op": lambda text, folder: profile_figure(text),
    "tools_host_sync_cost": lambda text, folder: host_sync_figure(text),
    "tools_host_time": lambda text, folder: host_time_figure(text),
    "tools_make_text_dataset": lambda text, folder: dataset_figure(text),
    "tools_main_grad_loss_scale": lambda text, folder: loss_scale_figure(text),
    "tools_sampling_mask_bench": lambda text, folder: sampling_mask_figure(text),
    "tools_benchmark_quick": lambda text, folder: benchmark_figure(folder),
    "bench": lambda text, folder: benchmark_figure(folder),
}


FAILURE_FIGURES = {  # failed (or cut short) steps whose log says more than its last error line
    "tests": lambda text: pytest_failure(text) or pytest_progress(text),
    "cute": lambda text: pytest_failure(text) or pytest_progress(text),
    "multigpu": lambda text: pytest_failure(text) or pytest_progress(text),
}


def failure_figure(name: str, text: str):
    extract = FAILURE_FIGURES.get(name) or FAILURE_FIGURES.get(name.split("_")[0])
    return (extract(text) if extract else None) or error_figure(text)


def figure_for(name: str, text: str, folder: Path):
    extract = FIGURES.get(name) or FIGURES.get(name.split("_")[0])
    try:
        return extract(text, folder) if extract else None
    except Exception as error:  # noqa: BLE001 (a log in an unexpected shape: say so, keep the table)
        return f"(key figure unreadable: {type(error).__name__})"


def error_figure(text: str):
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return (errors or lines or ["(empty log)"])[-1]


def read_status(path: Path) -> dict:
    status = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        status[key.strip()] = value.strip()
    return status


def result_of(rc: str) -> str:
    if rc == "skip":
        return "skip"
    if rc == "0":
        return "pass"
    if rc in ("124", "137"):  # timeout's status, or KILL after its grace period
        return "TIMEOUT"
    return "FAIL"


def clip(text: str, width: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")  # (a bare | would split the table's cell)
    return text if len(text) <= width else text[:width - 3] + "..."


def summarize(out: Path):
    """[(stage, step, result, seconds, key figure)] of the steps listed in out/steps.txt."""
    listed = (out / "steps.txt").read_text().split() if (out / "steps.txt").exists() else []
    rows = []
    for name in dict.fromkeys(listed):
        status_path, log_path = out / f"{name}.status", out / f"{name}.log"
        if not status_path.exists():  # started, never finished (the whole command was killed)
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            done = pytest_progress(text) or (error_figure(text) if text else "no log")
            rows.append(("?", name, "NO RESULT", None, f"the step did not finish (no status file); {done}"))
            continue
        status = read_status(status_path)
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        result = result_of(status.get("rc", "?"))
        if result == "pass":
            figure = figure_for(name, text, out / name) or "-"
        elif result == "skip":
            figure = status.get("reason") or "-"
        elif result == "TIMEOUT":  # what it had done by then, else where it was
            done = figure_for(name, text, out / name) or pytest_progress(text)
            figure = f"over its {status.get('limit', '?')} s limit; " + (done or "last: " + error_figure(text))
        else:
            figure = failure_figure(name, text)
        seconds = int(status["seconds"]) if status.get("seconds", "").isdigit() and result != "skip" else None
        rows.append((status.get("stage", "?"), name, result, seconds, figure))
    return rows


def markdown(rows) -> str:
    lines = ["| stage | step | result | time | key figure |", "|---|---|---|---:|---|"]
    for stage, name, result, seconds, figure in rows:
        lines.append(f"| {stage} | {name} | {result} | {'-' if seconds is None else f'{seconds} s'} | "
                     f"{clip(figure)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="GPUs, driver, Python and package versions")
    summary = sub.add_parser("summary", help="one table from the logs of the check's stages")
    summary.add_argument("dir", help="the check's output folder")
    args = parser.parse_args(argv)
    if args.command == "env":
        print(env_report())
        return 0
    out = Path(args.dir)
    rows = summarize(out)
    if not rows:
        print(f"no steps recorded in {out} (no {out / 'steps.txt'})", file=sys.stderr)
        return 1
    table = markdown(rows)
    (out / "summary.md").write_text(table)
    print(table, end="")
    bad = [name for _, name, result, _, _ in rows if result not in ("pass", "skip")]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} steps passed or skipped"
          + (f"; not passed: {', '.join(bad)}" if bad else "") + f" (table: {out / 'summary.md'})")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
