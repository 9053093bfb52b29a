"""Fused vs unfused output layer inside Megatron-LM's own training loop, on real text, on one GPU.

    python tools/real_loop_curves.py --work /tmp/real_loop --out $OUT            # ~350M GPT
    python tools/real_loop_curves.py --preset tiny --work /tmp/rl --out /tmp/o   # a quick check

Needs megatron-core >= 0.19 (megatron.training; Python >= 3.12), `tokenizers`, `transformers`,
matplotlib (tools/real_loop_curves.sh runs it with its folders from the environment). Steps, each a
`torchrun --nproc_per_node 1 examples/megatron_lm_real_pretrain_gpt.py ...` process:

  1. tools/make_text_dataset.py: BPE tokenizer (vocab 32768) + indexed dataset of the stdlib sources
  2. `fused`:   --use-linear-ce-fusion-loss, checkpoint at --save-interval
  3. `unfused`: the same seed, initialization and data order, Megatron's own output layer
  4. `fused_to_unfused`: the fused run's checkpoint resumed without the fused layer (2 steps)
     `unfused_to_fused`: the unfused run's checkpoint resumed with it
     `fused_to_fused`:   the fused checkpoint resumed as it was (control: equals the fused run)
  5. `full_fused` / `full_unfused` (stage resume_full): a short pair with Megatron's
     non-distributed mixed-precision optimizer, whose torch-Adam state megatron-core 0.19 reloads,
     then the same three resumes with weights, optimizer state and RNG (`full_fused_to_unfused` ...)
  6. `mtp_fused` / `mtp_unfused`: --mtp-num-layers 1

`--stack te`: Megatron-LM's default stack instead of the local layer spec (Transformer Engine
layers, gradient-accumulation fusion on through the example's stand-in for Apex's extension where
Apex is absent, bf16, distributed optimizer). `--old-code REV_OR_DIR` adds to the main stage the
pair `old_fused` / `old_unfused` with the package code of an older revision (git archive into
--work, or an older checkout's folder) and this version's example script; with `--parallel
--gpus 4` the four runs go side by side, one GPU each. The summary compares each pair and the two
unfused runs (how far two runs of the same layer drift apart): largest and mean per-step
difference, over steps 1-30 and all, and the last-50-step means.

Writes under --out: real_loop_summary.json (per-step losses, tokens/s, peak memory, checkpoint
interchange), real_loop.md (the same as tables), megatron_lm_curves.png (`_te` before .png with
--stack te), real_loop_logs.txt.
Stops starting new runs once --deadline seconds have passed (the summary then lists what ran).
`--stages main,resume`, `--stages resume_full` and `--stages mtp` (another --out each) split the
work over commands with a time limit; each stage needs only the dataset (main's checkpoints stay
in --work for resume).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "megatron_lm_real_pretrain_gpt.py"

PRESETS = {
    # ~350M parameters with a 32k vocabulary (GPT-2 medium shape)
    "full": dict(vocab=32768, max_files=None, layers=24, hidden=1024, heads=16, seq=1024,
                 micro=8, global_batch=8, iters=500, save_interval=250, mtp_iters=500,
                 full_resume_interval=20, lr=3e-4, warmup=50),
    "tiny": dict(vocab=4096, max_files=300, layers=2, hidden=256, heads=4, seq=256,
                 micro=4, global_batch=8, iters=30, save_interval=15, mtp_iters=10,
                 full_resume_interval=5, lr=1e-3, warmup=5),
}

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|")
FIELD_RE = {
    "lm_loss": re.compile(r"\blm loss: ([0-9.eE+-]+)"),
    "mtp_1_loss": re.compile(r"\bmtp_1 loss: ([0-9.eE+-]+)"),
    "ms": re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)"),
    "grad_norm": re.compile(r"grad norm: ([0-9.eE+-]+)"),
}
LOSS_KEYS = ("lm_loss", "mtp_1_loss")
PEAK_RE = re.compile(r"peak GPU memory allocated \(max over ranks\): ([0-9.]+) GiB")


REQUIREMENTS = (("megatron.training.argument_utils", '"megatron-core>=0.19" (megatron.training, Python >= 3.12)'),
                ("tokenizers", "tokenizers"), ("transformers", "transformers"), ("matplotlib", "matplotlib"))


def missing_requirements():
    """The pip requirements of this tool that do not import here (empty when all do)."""
    import importlib

    missing = []
    for module, requirement in REQUIREMENTS:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 (ImportError, or a too-old Python's SyntaxError)
            missing.append(f"{requirement} [{type(error).__name__}: {error}]")
    return missing


def add_datasets_makefile():
    """Megatron-LM's initialization runs `make` in megatron/core/datasets, where a Megatron-LM
    checkout builds the helpers_cpp module; the pip wheel ships that module already built but no
    Makefile. Give it one that only checks the module imports."""
    import megatron.core.datasets

    folder = Path(megatron.core.datasets.__file__).parent
    makefile = folder / "Makefile"
    if not makefile.exists() and os.access(folder, os.W_OK):
        makefile.write_text('all:\n\t@python3 -c "import megatron.core.datasets.helpers_cpp"\n')


# Megatron-LM's stack as its users run it: Transformer Engine layers, gradient-accumulation fusion
# (Megatron's default: megatron-core's own linears need Apex's fused_weight_gradient_mlp_cuda, which
# the example replaces by the package's pure-torch stand-in where Apex is absent), TE's fused RoPE
# and attention. Megatron's masked-softmax and persistent-layer-norm kernels are the local spec's.
LOCAL_STACK = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion",
               "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-rope-fusion"]
TE_STACK = ["--transformer-impl", "transformer_engine"]
STACKS = {"local": LOCAL_STACK, "te": TE_STACK}


def model_args(p, data_dir, iters, distributed_optimizer=True, stack="local"):
    return [
        "--num-layers", str(p["layers"]), "--hidden-size", str(p["hidden"]),
        "--num-attention-heads", str(p["heads"]), "--seq-length", str(p["seq"]),
        "--max-position-embeddings", str(p["seq"]), "--micro-batch-size", str(p["micro"]),
        "--global-batch-size", str(p["global_batch"]), "--train-iters", str(iters),
        "--lr", str(p["lr"]), "--min-lr", str(p["lr"] / 10), "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(p["warmup"]), "--lr-decay-iters", str(p["iters"]),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95",
        "--init-method-std", "0.02", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--position-embedding-type", "rope",
        "--bf16", *(["--use-distributed-optimizer"] if distributed_optimizer else []),
        *STACKS[stack],
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(data_dir),
        "--data-path", str(data_dir / "text_document"), "--split", "100,0,0",
        "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "1",
        "--seed", "1234", "--num-workers", "1", "--distributed-timeout-minutes", "10",
        # megatron-core 0.19's torch_dist loader asks the distributed optimizer for its state_dict
        # before allocating it, which fails with the torch Adam it falls back to without Apex/TE
        # (TE's Adam has no such trouble: the te stack keeps Megatron's default format)
        *(["--ckpt-format", "torch"] if stack == "local" else []),
    ]


def run_one(name, argv, logs, env, work, launch=None):
    """Start one training process (its own rendezvous port, `--standalone`'s free one where a
    fixed port could meet another torchrun job's, and dataset-index cache). `launch`:
    another `script` and environment entries (`env`) for this run (old code, its GPU)."""
    launch = launch or {}
    env = dict(env, **launch.get("env", {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--standalone", str(launch.get("script", SCRIPT))] + argv + [
               "--data-cache-path", str(work / f"cache_{name}")]
    start = time.time()
    log_path = logs / f"{name}.log"
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return proc, start, log_path


def wait(name, proc, start, log_path, timeout):
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    wall = time.time() - start
    result = parse_log(log_path.read_text(errors="replace"))
    result.update(name=name, rc=rc, wall_s=round(wall, 1))
    print(f"[{name}] rc={rc} wall {wall:.0f}s steps {len(result['steps'])} "
          f"last lm loss {result['lm_loss'][-1] if result['lm_loss'] else None} "
          f"peak {result['peak_gib']} GiB", flush=True)
    return result


def parse_log(text):
    steps, fields = [], {k: [] for k in FIELD_RE}
    for line in text.splitlines():
        m = ITER_RE.search(line)
        if not m or "lm loss" not in line:
            continue
        steps.append(int(m.group(1)))
        for key, rx in FIELD_RE.items():
            f = rx.search(line)
            fields[key].append(float(f.group(1)) if f else None)
    # Megatron's training_log does not reset its loss sums after a process's first iteration
    # (is_first_iteration), so the second line logged shows the mean of the first two steps: the
    # second step's own loss is 2 x logged - first (this matters after a resume, where the
    # uninterrupted run logs that step alone)
    as_logged = {}
    if len(steps) >= 2 and steps[1] == steps[0] + 1:
        for key in LOSS_KEYS:
            first, second = fields[key][0], fields[key][1]
            if first is not None and second is not None:
                as_logged[key] = second
                fields[key][1] = round(2 * second - first, 6)
    peak = PEAK_RE.findall(text)
    return {"steps": steps, **fields, "second_step_as_logged": as_logged,
            "peak_gib": float(peak[-1]) if peak else None}


def tokens_per_s(result, tokens_per_step, skip=10):
    ms = [m for s, m in zip(result["steps"], result["ms"]) if m is not None and s > skip]
    if not ms:
        return None
    ms.sort()
    return round(tokens_per_step / (ms[len(ms) // 2] / 1000.0), 1)


def loss_at(result, step, key="lm_loss"):
    if result and step in result["steps"]:
        return result[key][result["steps"].index(step)]
    return None


def _mean(values):
    return sum(values) / len(values) if values else None


def compare(a, b, key="lm_loss", early=30, last=50):
    """Per-step |a - b| over the steps both logged: the largest and the mean, over all of them and
    over steps 1..`early`, and each run's mean over the `last` of them."""
    if not a or not b:
        return None
    bs = dict(zip(b["steps"], b[key]))
    pairs = [(s, x, bs[s]) for s, x in zip(a["steps"], a[key])
             if s in bs and x is not None and bs[s] is not None]
    if not pairs:
        return None
    diffs = [(s, abs(x - y)) for s, x, y in pairs]
    worst = max(diffs, key=lambda d: d[1])
    first = [d for s, d in diffs if s <= early]
    tail = pairs[-last:]
    mean_a, mean_b = _mean([x for _, x, _ in tail]), _mean([y for _, _, y in tail])
    return {"steps": len(diffs), "max_abs_diff": worst[1], "at_step": worst[0],
            "first_step_abs_diff": diffs[0][1],
            "mean_abs_diff_last_50": sum(d for _, d in diffs[-50:]) / len(diffs[-50:]),
            "mean_abs_diff": _mean([d for _, d in diffs]),
            f"max_abs_diff_steps_1_{early}": max(first) if first else None,
            f"mean_abs_diff_steps_1_{early}": _mean(first),
            f"mean_last_{last}": [mean_a, mean_b], f"mean_last_{last}_diff": abs(mean_a - mean_b)}


# (a, b, colour): the differences drawn; old_* ran the package code of --old-code, and the two
# unfused runs show how far two runs of the same layer drift apart
PAIRS = (("fused", "unfused", "tab:red"), ("old_fused", "old_unfused", "tab:purple"),
         ("unfused", "old_unfused", "tab:gray"), ("mtp_fused", "mtp_unfused", "tab:orange"))


def plot(results, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"fused": ("tab:red", "-"), "unfused": ("tab:blue", "--"),
              "old_fused": ("tab:purple", "-"), "old_unfused": ("tab:cyan", ":"),
              "mtp_fused": ("tab:orange", "-"), "mtp_unfused": ("tab:green", "--")}
    for name, (color, ls) in styles.items():
        r = results.get(name)
        if r and r["steps"]:
            axes[0].plot(r["steps"], r["lm_loss"], ls, color=color, lw=1.1, label=f"{name} lm loss")
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("lm loss")
    axes[0].set_title(title)
    axes[0].legend()
    for a, b, color in PAIRS:
        ra, rb = results.get(a), results.get(b)
        if ra and rb:
            bs = dict(zip(rb["steps"], rb["lm_loss"]))
            xs = [s for s in ra["steps"] if s in bs]
            ys = [ra["lm_loss"][ra["steps"].index(s)] - bs[s] for s in xs]
            axes[1].plot(xs, ys, color=color, lw=0.9, label=f"{a} - {b}")
    axes[1].axhline(0, color="k", lw=0.5)
    axes[1].set_xlabel("iteration")
    axes[1].set_ylabel("lm loss difference")
    axes[1].set_title("difference of two runs, same step")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fmt(value):
    return "-" if value is None else f"{value:.3g}"


def _fmt4(value):
    return "-" if value is None else f"{value:.4f}"


def markdown(summary):
    lines = [f"# Megatron-LM loop, fused vs unfused output layer ({summary['preset']}, "
             f"{summary.get('stack', 'local')} stack)", "",
             f"device: {summary['device']}; torch {summary['torch']}; megatron-core "
             f"{summary['megatron_core']}; Python {summary['python']}", "",
             f"dataset: {summary['dataset'].get('files')} stdlib files, "
             f"{summary['dataset'].get('tokens')} tokens, vocab {summary['dataset'].get('vocab_size')}",
             "", "| run | rc | steps | first lm loss | last lm loss | tokens/s | peak GiB | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in summary["runs"].items():
        first = r["lm_loss"][0] if r["lm_loss"] else None
        last = r["lm_loss"][-1] if r["lm_loss"] else None
        rate = r.get("tokens_per_s") or (f"({r.get('tokens_per_s_side_by_side')}, side by side)"
                                         if r.get("side_by_side") else None)
        lines.append(f"| {name} | {r['rc']} | {len(r['steps'])} | {first} | {last} | "
                     f"{rate} | {r['peak_gib']} | {r['wall_s']} |")
    if summary.get("old_code"):
        lines += ["", f"old_fused / old_unfused: the package code of {summary['old_code']['rev']} "
                      "(the example script and the stand-in for Apex's extension of this version)"]
    lines += ["", "| comparison | steps | max abs diff | at step | step-1 diff | max abs diff, steps 1-30 | "
                  "mean abs diff, steps 1-30 | mean abs diff | mean abs diff (last 50) | "
                  "last-50 means | their diff |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in summary["comparisons"].items():
        if c:
            means = c.get("mean_last_50") or [None, None]
            lines.append(f"| {name} | {c['steps']} | {c['max_abs_diff']:.3g} | {c['at_step']} | "
                         f"{c['first_step_abs_diff']:.3g} | {_fmt(c.get('max_abs_diff_steps_1_30'))} | "
                         f"{_fmt(c.get('mean_abs_diff_steps_1_30'))} | {_fmt(c.get('mean_abs_diff'))} | "
                         f"{c['mean_abs_diff_last_50']:.3g} | {_fmt4(means[0])} / {_fmt4(means[1])} | "
                         f"{_fmt(c.get('mean_last_50_diff'))} |")
    lines += ["", f"main runs' resume: {summary.get('resume_mode', 'not run')}", "",
              "| checkpoint interchange | step | resumed | uninterrupted fused | "
              "uninterrupted unfused | step+1 resumed | step+1 fused | step+1 unfused | "
              "max abs diff vs writer (steps) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in summary["interchange"].items():
        lines.append(f"| {name} | {c['step']} | {c['resumed']} | {c['uninterrupted_fused']} | "
                     f"{c['uninterrupted_unfused']} | {c['resumed_next']} | "
                     f"{c['uninterrupted_fused_next']} | {c['uninterrupted_unfused_next']} | "
                     f"{_fmt(c.get('max_abs_diff_vs_writer'))} ({c.get('steps_compared')}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--work", required=True, help="dataset and checkpoints go here")
    parser.add_argument("--out", required=True, help="summary, PNG and logs go here")
    parser.add_argument("--deadline", type=float, default=470.0,
                        help="seconds after which no new run starts")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--main-iters", type=int, default=None,
                        help="stop the main pair after this many steps (same schedule as --iters): "
                             "save_interval + 2 is enough for the resume stage")
    parser.add_argument("--stages", default="main,resume,resume_full,mtp",
                        help="comma-separated subset of main (fused + unfused, with checkpoints), "
                             "resume (needs main's checkpoints in --work), resume_full, mtp")
    parser.add_argument("--serial-mtp", action="store_true",
                        help="run the two MTP runs one after the other (timed) instead of side by side")
    parser.add_argument("--parallel", action="store_true",
                        help="start the fused and unfused runs side by side (a quick check: "
                             "their tokens/s are then not comparable)")
    parser.add_argument("--gpus", type=int, default=1,
                        help="with --parallel, run the i-th of the runs started together on GPU "
                             "i mod GPUS (CUDA_VISIBLE_DEVICES), one GPU each")
    parser.add_argument("--stack", choices=sorted(STACKS), default="local",
                        help="local: the local layer spec, no Apex/TE kernels, no gradient-"
                             "accumulation fusion; te: Megatron-LM's default stack, Transformer "
                             "Engine layers with gradient-accumulation fusion (the example puts "
                             "a pure-torch stand-in where Apex's extension is absent)")
    parser.add_argument("--old-code", metavar="REV_OR_DIR",
                        help="main stage: also run the pair (old_fused, old_unfused) with the "
                             "package code of this git revision, or of the older checkout in this "
                             "folder (the example script stays this version's)")
    parser.add_argument("--no-save", action="store_true",
                        help="the main runs write no checkpoints (nothing for a resume stage)")
    args = parser.parse_args(argv)
    missing = missing_requirements()
    if missing:
        print("real_loop_curves: install first (pip install ...): " + "; ".join(missing), file=sys.stderr)
        return 2
    add_datasets_makefile()
    start = time.time()
    p = dict(PRESETS[args.preset])
    if args.iters:
        p["iters"] = args.iters
    work, out = Path(args.work), Path(args.out)
    logs = work / "logs"
    for d in (work, out, logs):
        d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    import torch

    import megatron.core

    data_dir = work / "data"
    if not (data_dir / "dataset.json").exists():
        cmd = [sys.executable, str(REPO / "tools" / "make_text_dataset.py"), "--output-dir",
               str(data_dir), "--vocab-size", str(p["vocab"])]
        if p["max_files"]:
            cmd += ["--max-files", str(p["max_files"])]
        subprocess.run(cmd, check=True, env=dict(env, TOKENIZERS_PARALLELISM="true"))
    dataset = json.loads((data_dir / "dataset.json").read_text())
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core "
          f"{getattr(megatron.core, '__version__', '?')}; dataset ready after {time.time() - start:.0f}s: "
          f"{dataset}", flush=True)

    summary = {"preset": args.preset, "params": p, "dataset": dataset,
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "python": sys.version.split()[0],
               "megatron_core": getattr(megatron.core, "__version__", "?"),
               "runs": {}, "comparisons": {}, "interchange": {}}
    tokens_per_step = p["global_batch"] * p["seq"]
    results = summary["runs"]
    K = p["save_interval"]

    def record(name, result, side_by_side=False):
        rate = tokens_per_s(result, tokens_per_step)
        result["side_by_side"] = side_by_side
        result["tokens_per_s"] = None if side_by_side else rate
        if side_by_side:
            result["tokens_per_s_side_by_side"] = rate
        results[name] = result
        finish(summary, out, logs)

    def time_left():
        return args.deadline - (time.time() - start)

    summary["stack"] = args.stack
    base = model_args(p, data_dir, args.main_iters or p["iters"], stack=args.stack)
    fused = ["--use-linear-ce-fusion-loss"]

    def save(run, interval):
        return ["--save", str(work / f"ckpt_{run}"), "--save-interval", str(interval)]

    def main_save(run, interval):
        return [] if args.no_save else save(run, interval)

    def load(run, step):
        return ["--load", str(work / f"ckpt_{run}"), "--ckpt-step", str(step)]

    plan = [("fused", base + fused + main_save("fused", K)), ("unfused", base + main_save("unfused", K))]
    stages = set(args.stages.split(","))
    if args.old_code and "main" in stages:
        tree, label = prepare_old_code(args.old_code, work)
        summary["old_code"] = {"rev": label, "tree": str(tree)}
        old = old_code_launch(tree, env)
        plan += [("old_fused", base + fused, old), ("old_unfused", base, old)]
    if "main" in stages:
        run_pair(plan, args.parallel, record, time_left, logs, env, work, args.gpus)
    broken = [name for name, *_ in plan
              if name in results and (results[name]["rc"] != 0 or not results[name]["steps"])]
    if broken:  # fail fast: the rest would fail alike
        print(f"stopping: {', '.join(broken)} failed (see real_loop_logs.txt)", flush=True)
        finish(summary, out, logs, final=True)
        return 1

    peaks = [r["peak_gib"] for r in results.values() if r.get("peak_gib")]
    at_once = max(1, int(70 // (max(peaks) * 1.15))) if peaks else 3  # side by side on 80 GB
    summary["resumes_side_by_side"] = at_once

    def resumes(jobs, writers, k):
        """Run `jobs` (name, argv, writer) at_once at a time; record each resumed run's losses
        at steps k+1, k+2 next to the uninterrupted runs' (`writers`: fused, unfused)."""
        for begin in range(0, len(jobs), at_once):
            if time_left() <= 0:
                break
            batch = jobs[begin:begin + at_once]
            started = [(name, run_one(name, a, logs, env, work)) for name, a, _ in batch]
            for name, (proc, t0, log_path) in started:
                record(name, wait(name, proc, t0, log_path, timeout=max(time_left(), 0) + 120),
                       side_by_side=len(batch) > 1)
        for name, _, writer in jobs:
            if name in results:
                summary["interchange"][name] = interchange_entry(
                    results[name], results.get(writers[0]), results.get(writers[1]),
                    results.get(writer), k)
        finish(summary, out, logs)

    # checkpoint interchange of the main runs (distributed optimizer). Without Apex / Transformer
    # Engine, megatron-core 0.19.2 cannot reload the distributed optimizer's state of its
    # torch-Adam fallback (torch_dist: AssertionError in DistributedOptimizer.state_dict; torch:
    # KeyError 'step'), whichever output layer wrote it: the weights alone are loaded there (the
    # next step's loss depends on nothing else); resume_full shows the whole state.
    if "resume" in stages:
        resume = model_args(p, data_dir, K + 2, stack=args.stack)
        if not full_optimizer_resume_possible():
            resume += ["--no-load-optim", "--no-load-rng"]
            summary["resume_mode"] = "weights only (no Apex/TE: optimizer state not loadable)"
        else:
            summary["resume_mode"] = "full (weights, optimizer, RNG)"
        resumes([("fused_to_unfused", resume + load("fused", K), "fused"),
                 ("unfused_to_fused", resume + fused + load("unfused", K), "unfused"),
                 ("fused_to_fused", resume + fused + load("fused", K), "fused")],
                ("fused", "unfused"), K)

    # the whole state (weights, optimizer, RNG, data position) through Megatron's non-distributed
    # mixed-precision optimizer, which reloads torch Adam's state: a short pair saving at k, then
    # the three resumes to step 2k
    if "resume_full" in stages:
        k = p["full_resume_interval"]
        short = model_args(p, data_dir, 2 * k, distributed_optimizer=False, stack=args.stack)
        run_pair([("full_fused", short + fused + save("full_fused", k)),
                  ("full_unfused", short + save("full_unfused", k))], True, record, time_left, logs, env,
                 work, args.gpus)
        resumes([("full_fused_to_unfused", short + load("full_fused", k), "full_fused"),
                 ("full_unfused_to_fused", short + fused + load("full_unfused", k), "full_unfused"),
                 ("full_fused_to_fused", short + fused + load("full_fused", k), "full_fused")],
                ("full_fused", "full_unfused"), k)

    mtp = model_args(p, data_dir, p["mtp_iters"], stack=args.stack) + ["--mtp-num-layers", "1"]
    # side by side unless --serial-mtp: their losses are compared, the throughput pair is above
    if "mtp" in stages:
        run_pair([("mtp_fused", mtp + fused), ("mtp_unfused", mtp)], not args.serial_mtp, record,
                 time_left, logs, env, work, args.gpus)
    finish(summary, out, logs, final=True)
    print(f"done in {time.time() - start:.0f}s", flush=True)
    return 0


def interchange_entry(resumed, fused_run, unfused_run, writer_run, k):
    """A resumed run's lm loss at steps k+1 and k+2 next to the uninterrupted fused and unfused
    runs', and its largest difference from the run that wrote the checkpoint over the steps
    both logged after k."""
    entry = {"step": k + 1, "resumed": loss_at(resumed, k + 1), "resumed_next": loss_at(resumed, k + 2),
             "uninterrupted_fused": loss_at(fused_run, k + 1),
             "uninterrupted_unfused": loss_at(unfused_run, k + 1),
             "uninterrupted_fused_next": loss_at(fused_run, k + 2),
             "uninterrupted_unfused_next": loss_at(unfused_run, k + 2)}
    after = compare(resumed, writer_run)
    entry["max_abs_diff_vs_writer"] = after["max_abs_diff"] if after else None
    entry["steps_compared"] = after["steps"] if after else 0
    return entry


def package_source(spec, dest) -> str:
    """dest/megatron_fused_ce: the package code of `spec` (a git revision of this checkout, or a
    folder holding a checkout's megatron_fused_ce/), copied there; -> its label (the short
    revision, or the folder's path). Also tools/host_ab.py's."""
    dest, source = Path(dest), Path(spec)
    if source.is_dir():
        shutil.copytree(source / "megatron_fused_ce", dest / "megatron_fused_ce")
        return str(source.resolve())
    git = ["git", "-C", str(REPO)]
    archive = subprocess.run(git + ["archive", spec, "megatron_fused_ce"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return subprocess.run(git + ["rev-parse", "--short", spec], check=True, capture_output=True,
                          text=True).stdout.strip()


def prepare_old_code(spec, work):
    """(folder, label): the package code of `spec` (a git revision of this checkout, or a folder
    holding an older checkout's megatron_fused_ce/) under work/old_code, with this version's
    example script and stand-in for Apex's extension copied in, so that only the package code is
    old. The example imports the package from its own checkout, so the old runs start the copy."""
    tree = work / "old_code"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    label = package_source(spec, tree)
    (tree / "examples").mkdir(exist_ok=True)
    shutil.copy2(SCRIPT, tree / "examples" / SCRIPT.name)
    standin = tree / "megatron_fused_ce" / "megatron" / "grad_accum_fusion.py"
    if not standin.exists():  # it stands for Apex's extension, not for the code under comparison
        shutil.copy2(REPO / "megatron_fused_ce" / "megatron" / "grad_accum_fusion.py", standin)
    return tree, label


def old_code_launch(tree, env):
    """run_one's `launch` for the old code: its copy of the example, and PYTHONPATH with the old
    tree in place of this checkout."""
    rest = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep)
            if entry and Path(entry).resolve() != REPO]
    return {"script": tree / "examples" / SCRIPT.name,
            "env": {"PYTHONPATH": os.pathsep.join([str(tree)] + rest)}}


def full_optimizer_resume_possible():
    """megatron-core 0.19's distributed optimizer reloads its state only with Apex's or
    Transformer Engine's Adam (see the resume stage)."""
    for name in ("transformer_engine", "apex"):
        try:
            __import__(name)
            return True
        except Exception:
            pass
    return False


def run_pair(plan, parallel, record, time_left, logs, env, work, gpus=1):
    """The runs of `plan` ((name, argv) or (name, argv, launch): see run_one) one after the
    other (timed), or side by side with `parallel`, the i-th on GPU i mod `gpus` where gpus > 1."""
    plan = [(entry[0], entry[1], dict(entry[2]) if len(entry) > 2 else {}) for entry in plan]
    if parallel:
        if time_left() <= 0:
            return
        if gpus > 1:
            for i, (_, _, launch) in enumerate(plan):
                launch["env"] = dict(launch.get("env", {}), CUDA_VISIBLE_DEVICES=str(i % gpus))
        started = [(name, run_one(name, argv, logs, env, work, launch)) for name, argv, launch in plan]
        end = time.time() + max(time_left(), 0) + 120  # one limit for all: waits do not add up
        for name, (proc, t0, log_path) in started:
            record(name, wait(name, proc, t0, log_path, timeout=max(end - time.time(), 1)),
                   side_by_side=True)
        return
    for name, argv, launch in plan:
        if time_left() <= 0:
            print(f"[{name}] skipped: deadline", flush=True)
            continue
        result = wait(name, *run_one(name, argv, logs, env, work, launch),
                      timeout=max(time_left(), 0) + 120)
        record(name, result)
        if result["rc"] != 0 or not result["steps"]:
            return


def plot_name(stack):
    return "megatron_lm_curves.png" if stack == "local" else f"megatron_lm_curves_{stack}.png"


def finish(summary, out, logs, final=False):
    runs = summary["runs"]
    summary["comparisons"] = {
        "fused vs unfused (lm loss)": compare(runs.get("fused"), runs.get("unfused")),
        "old_fused vs old_unfused (lm loss)": compare(runs.get("old_fused"), runs.get("old_unfused")),
        "unfused vs old_unfused (lm loss)": compare(runs.get("unfused"), runs.get("old_unfused")),
        "mtp_fused vs mtp_unfused (lm loss)": compare(runs.get("mtp_fused"), runs.get("mtp_unfused")),
        "mtp_fused vs mtp_unfused (mtp_1 loss)": compare(runs.get("mtp_fused"),
                                                         runs.get("mtp_unfused"), "mtp_1_loss"),
    }
    (out / "real_loop_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "real_loop.md").write_text(markdown(summary))
    with open(out / "real_loop_logs.txt", "w") as f:
        for log in sorted(logs.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            keep = [line for line in lines if "iteration" in line or "Error" in line
                    or "error" in line or "peak GPU" in line or "fused linear" in line
                    or line.startswith("$")]
            f.write(f"===== {log.name} ({len(lines)} lines; iteration/error lines and last 60)\n")
            f.write("\n".join(keep[:2000]) + "\n----- tail\n" + "\n".join(lines[-60:]) + "\n")
    if final or runs.get("unfused"):
        try:
            plot(runs, out / plot_name(summary.get("stack", "local")),
                 f"Megatron-LM loop, {summary['device']}, {summary['preset']}, "
                 f"{summary.get('stack', 'local')} stack")
        except Exception as error:  # the numbers matter more than the picture
            print(f"plot failed: {error!r}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
