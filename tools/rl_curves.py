"""Reward curves of RL runs from their `--log-jsonl` files: one markdown table, optionally one PNG.

    python tools/rl_curves.py "GRPO fused=runs/grpo_fused.jsonl" "GRPO unfused=runs/grpo_unfused.jsonl" \
        --png docs/rl_curves.png

Each argument is LABEL=PATH (the PATH of `examples/{sft,grpo,dpo}.py --log-jsonl`). The table gives,
per run, the steps logged, the mean reward over the first 3 and the last 5 evaluated steps, the first
step whose reward reached --target, and the last accuracy; for GRPO runs a further table gives the
mean over steps of the policy ratio, the clipped fraction and the KL to the reference. The PNG (needs matplotlib) plots reward
and accuracy against step, and for GRPO runs the KL to the reference and the mean policy ratio.

Runs of one setting over several seeds: label them GROUP/SEED (`"fused/1234=a.jsonl" "fused/7=b.jsonl"`).
A second table then gives, per group, the mean reward over windows of --window steps (the steps every
run of the group logged), as the mean over seeds and the lowest and highest seed; the PNG draws each
group as its mean with a band from the lowest to the highest seed.

    python tools/rl_curves.py fused/1234=f1.jsonl fused/7=f7.jsonl unfused/1234=u1.jsonl unfused/7=u7.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List


def read_run(path: str) -> List[dict]:
    """The JSON lines of one run (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(rows: List[dict], target: float) -> Dict[str, object]:
    """Figures of one run over its steps that carry a reward (SFT and DPO evaluate every few)."""
    rewarded = [row for row in rows if "reward" in row]
    rewards = [row["reward"] for row in rewarded]
    first = [row["step"] for row in rewarded if row["reward"] >= target]
    return {
        "steps": len(rows),
        "first_3": sum(rewards[:3]) / len(rewards[:3]) if rewards else float("nan"),
        "last_5": sum(rewards[-5:]) / len(rewards[-5:]) if rewards else float("nan"),
        "best": max(rewards) if rewards else float("nan"),
        "first_at_target": first[0] if first else None,
        "last_accuracy": rewarded[-1].get("accuracy", float("nan")) if rewarded else float("nan"),
    }


def table(runs: Dict[str, List[dict]], target: float) -> str:
    lines = [f"| run | steps | reward, first 3 | reward, last 5 | best | first step ≥ {target:g} | last accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, rows in runs.items():
        s = summarize(rows, target)
        reached = "-" if s["first_at_target"] is None else str(s["first_at_target"])
        lines.append(f"| {label} | {s['steps']} | {s['first_3']:.3f} | {s['last_5']:.3f} | {s['best']:.3f} "
                     f"| {reached} | {s['last_accuracy']:.3f} |")
    return "\n".join(lines)


def groups_of(runs: Dict[str, List[dict]]) -> Dict[str, Dict[str, List[dict]]]:
    """GROUP/SEED labels by group (labels without a slash form no group)."""
    groups: Dict[str, Dict[str, List[dict]]] = {}
    for label, rows in runs.items():
        group, sep, seed = label.rpartition("/")
        if sep and group:
            groups.setdefault(group, {})[seed] = rows
    return groups


def _rewards_by_step(rows: List[dict]) -> Dict[int, float]:
    return {row["step"]: row["reward"] for row in rows if "reward" in row}


def window_means(rows: List[dict], window: int, steps: int) -> List[float]:
    """Mean reward of each full window of `window` steps among the first `steps`."""
    by_step = _rewards_by_step(rows)
    means = []
    for start in range(0, steps - window + 1, window):
        values = [by_step[i] for i in range(start, start + window) if i in by_step]
        means.append(sum(values) / len(values) if values else float("nan"))
    return means


def group_table(groups: Dict[str, Dict[str, List[dict]]], window: int) -> str:
    """Per group: mean over seeds (lowest-highest seed) of the reward over each window of steps."""
    steps = min(len(_rewards_by_step(rows)) for runs in groups.values() for rows in runs.values())
    starts = list(range(0, steps - window + 1, window))
    head = "| group | seeds | " + " | ".join(f"steps {a}-{a + window - 1}" for a in starts) + " |"
    lines = [head, "|---|---|" + "---:|" * len(starts)]
    for group, runs in groups.items():
        per_seed = [window_means(rows, window, steps) for rows in runs.values()]
        cells = []
        for i in range(len(starts)):
            values = [means[i] for means in per_seed]
            cells.append(f"{sum(values) / len(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        lines.append(f"| {group} | {', '.join(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


POLICY_STATISTICS = (("ratio_mean", "mean policy ratio", ".4f"), ("clip_ratio", "clip fraction", ".5f"),
                     ("kl", "KL to the reference", ".4f"))


def policy_table(runs: Dict[str, List[dict]]) -> str:
    """Per GRPO run: the mean over its steps of the policy ratio, the clipped fraction and the KL,
    the quantities a biased trainer log-prob moves (runs without `ratio_mean` are left out)."""
    lines = ["| run | steps | " + " | ".join(title for _, title, _ in POLICY_STATISTICS) + " |",
             "|---|---:|" + "---:|" * len(POLICY_STATISTICS)]
    for label, rows in runs.items():
        logged = [row for row in rows if "ratio_mean" in row]
        if not logged:
            continue
        cells = []
        for key, _, spec in POLICY_STATISTICS:
            values = [row[key] for row in logged if key in row]
            cells.append(format(sum(values) / len(values), spec) if values else "-")
        lines.append(f"| {label} | {len(logged)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: Dict[str, List[dict]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install -e \".[plot]\" (the package's plot extra)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "mean reward (0-1)"), ("accuracy", "exact match"),
              ("kl", "KL to the reference (GRPO)"), ("ratio_mean", "mean policy ratio (GRPO)")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    groups = groups_of(runs)
    for ax, (key, title) in zip(axes.flat, panels):
        for number, (group, members) in enumerate(groups.items()):
            curves = [{row["step"]: row[key] for row in rows if key in row} for rows in members.values()]
            steps = sorted(set.intersection(*(set(curve) for curve in curves)))
            if steps:
                mean = [sum(curve[i] for curve in curves) / len(curves) for i in steps]
                # dashes alternate so that groups with the same curve (fused and unfused) both show
                line, = ax.plot(steps, mean, linestyle=("-", "--", ":", "-.")[number % 4],
                                label=f"{group} (mean of {len(curves)})")
                ax.fill_between(steps, [min(curve[i] for curve in curves) for i in steps],
                                [max(curve[i] for curve in curves) for i in steps], color=line.get_color(), alpha=0.2)
        for label, rows in runs.items():
            if label.rpartition("/")[0] in groups:
                continue
            points = [(row["step"], row[key]) for row in rows if key in row]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="." if len(points) < 30 else None, label=label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="a run's label and its --log-jsonl file")
    parser.add_argument("--target", type=float, default=0.9, help="the reward whose first step is reported")
    parser.add_argument("--png", metavar="PATH", help="also write the curves to this PNG (needs matplotlib)")
    parser.add_argument("--window", type=int, default=10, help="steps per window of the seed groups' table")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.rpartition("=")
        if not sep or not label:
            parser.error(f"{spec!r}: expected LABEL=PATH")
        if not Path(path).is_file():
            parser.error(f"{path}: no such file")
        runs[label] = read_run(path)
    print(table(runs, args.target))
    groups = groups_of(runs)
    if groups:
        print()
        print(group_table(groups, args.window))
    if any("ratio_mean" in row for rows in runs.values() for row in rows):
        print()
        print(policy_table(runs))
    if args.png:
        plot(runs, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
