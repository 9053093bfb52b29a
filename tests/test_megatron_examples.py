"""The examples' main() on 4 forked gloo ranks (TP=2 x PP=2), a couple of steps each, with the
first-batch fused-vs-unfused comparison; and GRPO running only the log-prob passes it needs.
(`torchrun --nproc_per_node 4 examples/<name>.py --tp 2 --pp 2` runs the same code.)"""

from __future__ import annotations

import importlib.util
import os
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
    ("grpo", ["data.prompt_length=8", "rollout.num_prompts=2", "rollout.samples_per_prompt=4"]),
])
def test_example_runs(name, extra, capfd):
    run_workers(example_worker, 4, name, FAST + ["--compare-unfused"] + extra, timeout=120)
    out = capfd.readouterr()
    text = out.out + out.err
    assert "fused linear CE: on" in text
    assert "first batch" in text and "|difference|" in text
    difference = float(text.split("|difference| ")[1].split()[0])
    assert difference <= 1e-4


@pytest.mark.parametrize("overrides,per_step,frozen", [
    (["grpo.beta=0", "grpo.force_on_policy_ratio=true"], 1, 0),  # only the simulated engine pass
    (["grpo.beta=0"], 1, 0),                                     # old-policy pass (it serves both)
    (["grpo.beta=0.05"], 2, 1),                                  # + reference model and its pass
])
def test_grpo_runs_only_needed_passes(overrides, per_step, frozen):
    argv = ["--steps", "2", "--seq-length", "32", "model.num_layers=2", "model.hidden_size=32",
            "data.prompt_length=8", "rollout.num_prompts=2"] + overrides
    for calls in run_workers(example_worker, 2, "grpo", argv, timeout=120):
        assert calls == {"compute_logprobs": 2 * per_step, "build_frozen_copy": frozen}
