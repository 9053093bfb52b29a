"""The examples' main() on 4 forked gloo ranks (TP=2 x PP=2, and TP=2 x CP=2), a couple of steps
each, with the first-batch fused-vs-unfused comparison; GRPO (real rollouts) running only the
log-prob passes it needs and its importance-ratio report; and one
real torchrun launch, checked for a clean screen.
(`torchrun --nproc_per_node 4 examples/<name>.py --tp 2 --pp 2` runs the same code.)"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

import test_megatron_common  # noqa: F401  (megatron-core imported before forking)
from dist import run_workers

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.append(EXAMPLES_DIR)  # for their `from example_common import ...` (appended: shadows nothing)


def _load(name):
    """Import examples/<name>.py as `megatron_example_<name>` (no generic top-level names)."""
    spec = importlib.util.spec_from_file_location(f"megatron_example_{name}",
                                                  os.path.join(EXAMPLES_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLES = {name: _load(name) for name in ("pretrain_gpt", "sft", "dpo", "grpo")}
FAST = ["--tp", "2", "--pp", "2", "--steps", "2", "--seq-length", "32",
        "model.num_layers=2", "model.hidden_size=32"]


def example_worker(rank, world, name, argv):
    module = EXAMPLES[name]
    sys.argv = [f"{name}.py"] + argv
    calls = {"compute_logprobs": 0, "build_frozen_copy": 0}
    for fn in calls:
        if hasattr(module, fn):
            original = getattr(module, fn)

            def counted(*args, _fn=fn, _original=original, **kwargs):
                calls[_fn] += 1
                return _original(*args, **kwargs)

            setattr(module, fn, counted)
    module.main()
    return calls


@pytest.mark.parametrize("name,extra", [
    ("pretrain_gpt", []),
    ("sft", ["data.prompt_length=[2,4]", "data.response_length=[3,6]"]),
    ("dpo", ["data.prompt_length=8"]),
    ("grpo", ["data.prompt_length=24", "rollout.num_prompts=2", "rollout.samples_per_prompt=4"]),
])
def test_example_runs(name, extra, capfd):
    run_workers(example_worker, 4, name, FAST + ["--compare-unfused"] + extra, timeout=120)
    out = capfd.readouterr()
    text = out.out + out.err
    assert "fused linear CE: on" in text
    assert "first batch" in text and "|difference|" in text
    difference = float(text.split("|difference| ")[1].split()[0])
    assert difference <= 1e-4


CP_FAST = ["--tp", "2", "--cp", "2", "--steps", "2", "--seq-length", "32", "model.num_layers=2",
           "model.hidden_size=32"]


@pytest.mark.parametrize("name,extra", [
    ("pretrain_gpt", []),
    ("sft", ["data.prompt_length=[2,4]", "data.response_length=[3,6]"]),  # THD packing
    ("dpo", ["data.prompt_length=8"]),
    ("grpo", ["data.prompt_length=24", "rollout.num_prompts=2", "rollout.samples_per_prompt=4"]),
])
def test_example_runs_with_context_parallelism(name, extra, capfd):
    """`--tp 2 --cp 2 --compare-unfused`: every sequence split over 2 CP ranks (GatheredKVAttention
    in the local layer spec), the fused-vs-unfused line of the first batch."""
    run_workers(example_worker, 4, name, CP_FAST + ["--compare-unfused"] + extra, timeout=120)
    out = capfd.readouterr()
    text = out.out + out.err
    assert "world 4 = TP 2 x CP 2 x PP 1 x DP 1" in text
    difference = float(text.split("|difference| ")[1].split()[0])
    assert difference <= 1e-4


@pytest.mark.parametrize("overrides,per_step,frozen", [
    (["grpo.beta=0", "grpo.force_on_policy_ratio=true"], 0, 0),  # the sampler's log-probs only
    (["grpo.beta=0"], 0, 0),                          # the sampler's log-probs serve as the old
    (["grpo.beta=0", "rollout.old_logprobs=trainer"], 1, 0),     # an old-policy pass
    (["grpo.beta=0.05"], 1, 1),                                  # reference model and its pass
])
def test_grpo_runs_only_needed_passes(overrides, per_step, frozen):
    argv = ["--steps", "2", "--seq-length", "16", "model.num_layers=2", "model.hidden_size=32",
            "data.prompt_length=8", "rollout.num_prompts=2"] + overrides
    for calls in run_workers(example_worker, 2, "grpo", argv, timeout=120):
        assert calls == {"compute_logprobs": 2 * per_step, "build_frozen_copy": frozen}


def test_grpo_report_ratio(capfd):
    """`--report-ratio` at TP=2 x PP=2 on the real rollouts (logits gathered over TP, tokens sent
    to the first stage): the trainer's log-probs of the sampler's distribution reproduce the
    recorded ones (r = 1 to fp32 precision) under every setting; plain-softmax log-probs give
    r = the kept mass (< 1) under a filter, exactly 1 without one."""
    argv = ["--tp", "2", "--pp", "2", "--steps", "1", "--seq-length", "16", "model.num_layers=2",
            "model.hidden_size=32", "data.prompt_length=8", "rollout.num_prompts=2",
            "rollout.samples_per_prompt=4", "--report-ratio"]
    run_workers(example_worker, 4, "grpo", argv, timeout=120)
    out = capfd.readouterr()
    rows = {}
    for line in (out.out + out.err).splitlines():
        if line.startswith("| T=1"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0], cells[1])] = dict(tokens=int(cells[2]), mean=float(cells[3]),
                                              max_abs_log=float(cells[7]))
    assert len(rows) == 10, rows
    for (sampler, trainer), row in rows.items():
        assert row["tokens"] == 2 * 4 * 9
        if trainer.startswith("sampler") or sampler == "T=1 (no filter)":
            assert row["max_abs_log"] < 1e-5 and abs(row["mean"] - 1) < 1e-5, (sampler, trainer, row)
        else:
            assert row["mean"] < 0.95, (sampler, trainer, row)
    assert rows[("T=1 top_k=50", "plain softmax")]["mean"] < rows[("T=1 top_p=0.9", "plain softmax")]["mean"]


def test_torchrun_run_is_one_clean_screen():
    """`torchrun ... examples/pretrain_gpt.py --compare-unfused` as the README runs it: exit 0; no
    warning from megatron-core or torchrun (OMP banner); one header line; the parity line with
    the memory of the output layer + loss, fused below unfused; the progress bar to its end."""
    root = os.path.dirname(EXAMPLES_DIR)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "examples/pretrain_gpt.py", "--tp", "2", "--steps", "2", "--seq-length", "32",
            "model.num_layers=2", "model.hidden_size=32", "--compare-unfused",
            "megatron_cfg.linear_ce_fusion_chunk_size=16"]
    proc = subprocess.run(argv, cwd=root, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=240)
    text = proc.stdout
    assert proc.returncode == 0, text
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    noise = [line for line in lines if not (line.startswith("pretrain:") or line.startswith("first batch"))]
    assert noise == [], noise  # nothing but the header, the parity line and the progress bar
    assert not re.search(r"warn|OMP_NUM_THREADS|Traceback", text, re.IGNORECASE), text
    headers = [line for line in lines if "fused linear CE:" in line]
    assert headers == ["pretrain: world 2 = TP 2 x PP 1 x DP 1 on CPU/gloo; model 2 layers, hidden 32, "
                       "vocab 1000; fused linear CE: on (chunk 16)"]
    (parity,) = [line for line in lines if line.startswith("first batch")]
    fused, unfused = map(float, re.search(r"memory: fused ([\d.]+) MiB vs unfused ([\d.]+) MiB",
                                          parity).groups())
    assert 0 < fused < unfused / 2, parity
    assert float(parity.split("|difference| ")[1].split()[0]) <= 1e-4
    assert any("2/2" in line and "lm loss=" in line and "loss_mem=" in line for line in lines)
