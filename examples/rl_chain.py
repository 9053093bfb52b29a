"""The RL chain in one command: SFT on the digit task, then GRPO and DPO, each from the SFT
checkpoint, with the reward curves summed up at the end (docs/rl.md).

    python examples/rl_chain.py                       # CPU: 2 ranks, the default configs
    python examples/rl_chain.py --gpu --nproc 1       # one GPU: configs/*_gpu.yaml
    python examples/rl_chain.py --task copy --out runs/copy --grpo-args "--steps 100"

Each stage is a torchrun launch of examples/sft.py, grpo.py or dpo.py (OMP_NUM_THREADS=1 unless
set), writing into `--out`: `sft_checkpoint/` (a Megatron distributed checkpoint and its
`model_config.json`), and `sft.jsonl`, `grpo.jsonl`, `dpo.jsonl` (one JSON line per step: `step`,
`reward`, `accuracy`, ...). A stage that fails ends the chain with its exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import List

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
STAGES = ("sft", "grpo", "dpo")


def read_log(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mean(values) -> float:
    values = list(values)
    return sum(values) / max(len(values), 1)


def summary(stage: str, records: List[dict], seconds: float) -> str:
    """One line per stage: SFT's last evaluation, GRPO's first 3 and last 5 rollout steps, DPO's
    first and last evaluation."""
    rated = [r for r in records if "reward" in r]
    if not rated:
        return f"{stage}: no step with a reward in the log ({seconds:.0f} s)"
    if stage == "grpo":
        first, last = rated[:3], rated[-5:]
        gain = mean(r["reward"] for r in last) - mean(r["reward"] for r in first)
        return (f"grpo: {len(rated)} rollout steps in {seconds:.0f} s; mean reward, first 3 steps "
                f"{mean(r['reward'] for r in first):.3f} -> last 5 {mean(r['reward'] for r in last):.3f} "
                f"(gain {gain:+.3f}); exact match {mean(r['accuracy'] for r in first):.3f} -> "
                f"{mean(r['accuracy'] for r in last):.3f}")
    first, last = rated[0], rated[-1]
    text = (f"{stage}: {records[-1]['step'] + 1} steps in {seconds:.0f} s; evaluation reward "
            f"{first['reward']:.3f} (step {first['step']}) -> {last['reward']:.3f} (step {last['step']}), "
            f"exact match {first['accuracy']:.3f} -> {last['accuracy']:.3f}")
    if stage == "dpo":
        text += f"; preference accuracy, last 10 steps {mean(r['preference_accuracy'] for r in records[-10:] if 'preference_accuracy' in r):.3f}"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="examples/rl_chain.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="processes per stage (torchrun --nproc_per_node; default 2, with --gpu 1)")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU configurations (examples/configs/{sft,grpo,dpo}_gpu.yaml)")
    parser.add_argument("--task", choices=("count", "copy", "reverse"), default="count",
                        help="the digit task of every stage (default: count)")
    parser.add_argument("--out", default=os.path.join("runs", "rl_chain"), metavar="DIR",
                        help="where the checkpoint and the step logs go (default: runs/rl_chain)")
    parser.add_argument("--stages", default="sft,grpo,dpo", metavar="LIST",
                        help="which stages to run, in order (default: sft,grpo,dpo; grpo and dpo "
                             "load the checkpoint an earlier sft run left in --out)")
    for stage in STAGES:
        parser.add_argument(f"--{stage}-args", default="", metavar="ARGS",
                            help=f"more arguments for examples/{stage}.py, e.g. \"--steps 10 --tp 2\"")
    args = parser.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        parser.error(f"--stages takes a comma-separated list of {', '.join(STAGES)}; got {args.stages!r}")
    nproc = args.nproc or (1 if args.gpu else 2)
    checkpoint = os.path.join(args.out, "sft_checkpoint")
    if stages[0] != "sft" and not os.path.exists(os.path.join(checkpoint, "model_config.json")):
        parser.error(f"no SFT checkpoint in {checkpoint}: run the sft stage first")
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    lines = []
    for stage in stages:
        log = os.path.join(args.out, f"{stage}.jsonl")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   os.path.join(EXAMPLES, f"{stage}.py"), "--task", args.task, "--log-jsonl", log]
        if args.gpu:
            command += ["--config", os.path.join(EXAMPLES, "configs", f"{stage}_gpu.yaml")]
        command += ["--save", checkpoint] if stage == "sft" else ["--load", checkpoint]
        command += shlex.split(getattr(args, f"{stage}_args"))
        print("+ " + " ".join(shlex.quote(c) for c in command), flush=True)
        start = time.perf_counter()
        status = subprocess.call(command, env=env)
        seconds = time.perf_counter() - start
        if status:
            print(f"examples/rl_chain.py: the {stage} stage failed (exit status {status})", file=sys.stderr)
            return status
        lines.append(summary(stage, read_log(log), seconds))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
